"""What the SGLang test modules do when SGLang cannot be imported: fail, naming the fix
(`make test` installs it), or, with ``KVPREFETCH_SGLANG_OPTIONAL=1``, skip visibly."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def sglang_missing(exc: ImportError) -> NoReturn:
    if os.environ.get("KVPREFETCH_SGLANG_OPTIONAL") == "1":
        pytest.skip(f"SGLang not installed ({exc}); KVPREFETCH_SGLANG_OPTIONAL=1",
                    allow_module_level=True)
    pytest.fail(f"SGLang is not importable ({exc}): run `make setup-sglang` (or set "
                "KVPREFETCH_SGLANG_OPTIONAL=1 to skip these tests visibly)", pytrace=False)
