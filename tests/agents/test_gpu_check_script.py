"""examples/gpu_check.sh before it reaches a GPU: ``--help`` lists both engines' options,
and an engine the chosen Python cannot import is named, with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gpu_check.sh"


def run(*args: str, python: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], env={**os.environ, "PYTHON": python},
                          capture_output=True, text=True, timeout=60)


def test_help_lists_the_engines_and_their_options() -> None:
    r = run("--help", python=sys.executable)
    assert r.returncode == 0, r.stderr
    for option in ("--engine", "{vllm,sglang}", "--page-size", "--prefetch-policy",
                   "--l1-size-gb", "--json"):
        assert option in r.stdout


@pytest.mark.parametrize("engine", [["--engine", "sglang"], ["--engine=sglang"]])
def test_sglang_missing_is_named_and_exits_2(engine: list[str]) -> None:
    r = run("/models/m", *engine, python="false")  # a "python" that imports nothing
    assert r.returncode == 2
    assert "cannot import sglang" in r.stderr and "vllm" not in r.stderr


def test_vllm_stays_the_default_engine() -> None:
    r = run("/models/m", "--prompt-tokens", "100", python="false")
    assert r.returncode == 2 and "cannot import vllm and lmcache" in r.stderr


def test_an_unknown_engine_exits_2() -> None:
    r = run("/models/m", "--engine", "tgi", python=sys.executable)
    assert r.returncode == 2 and "vllm or sglang" in r.stderr
