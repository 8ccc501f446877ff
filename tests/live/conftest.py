"""Fixtures of the live control-plane tests: real Valkey and S3 on loopback (one each per
session), in-process fleets (tests/live/harness.py) and, for the Ray tests, Ray runtimes that
are always shut down."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.embedded import EmbeddedS3, EmbeddedValkey

sys.path.insert(0, str(Path(__file__).parent))
# Token auth (ARCHITECTURE.md: two raylets on one machine need it); Ray reads the mode when
# it is imported, so it is set before any test module imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[EmbeddedValkey]:
    with EmbeddedValkey() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    with EmbeddedS3() as server:
        yield server
