"""The scripts ``kvprefetch init`` writes run from the folder it writes them to: each finds
the files it names beside itself, not in a clone's ``examples/``; and SGLang's node script
reads the tier serve's agents warm by default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.cli.serve_config import AgentSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def init_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert main(["init", str(tmp_path / "kvp")]) == 0
    capsys.readouterr()
    return tmp_path / "kvp"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, **extra}


def test_gpu_check_runs_from_the_init_folder(init_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([str(init_dir / "gpu_check.sh"), "--help"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    assert "--engine" in done.stdout and "--page-size" in done.stdout
    # the engine check runs from there too, and names what the chosen Python lacks
    done = subprocess.run([str(init_dir / "gpu_check.sh"), "/models/m", "--engine", "sglang"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=60,
                          env=_env(PYTHON="false"))
    assert done.returncode == 2 and "cannot import sglang" in done.stderr


def test_vllm_node_runs_from_the_init_folder_up_to_its_lmcache_server(
        init_dir: Path, tmp_path: Path) -> None:
    """The L2 adapter's JSON is built (kvprefetch imported wherever the script is); the
    LMCache server, here a stand-in that records its arguments and exits, is started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "lmcache-args"
    (bin_dir / "lmcache").write_text(f'#!/bin/sh\necho "$@" > {record}\nexit 1\n')
    (bin_dir / "lmcache").chmod(0o755)
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 7\n")
    (bin_dir / "curl").chmod(0o755)
    text = (init_dir / "vllm_node.sh").read_text()
    assert not re.search(r'^cd "\$\(dirname', text, re.M)
    done = subprocess.run(
        [str(init_dir / "vllm_node.sh"), "m"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=_env(VALKEY_HOST="127.0.0.1", S3_BUCKET="my-kv-bucket",
                              PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert done.returncode == 1 and "lmcache server exited" in done.stderr, done.stderr
    args = record.read_text()
    assert "server --host 127.0.0.1" in args and "my-kv-bucket" in args


def test_sglang_node_reads_the_tier_serve_warms_by_default(init_dir: Path) -> None:
    default = re.search(r'path=env\("DRAM_DIR", "([^"]+)" \+ env\("NODE", "(\d+)"\)\)',
                        (init_dir / "sglang_node.sh").read_text())
    assert default is not None
    served = AgentSettings.model_fields["tier_path"].default
    for node in (0, 3):
        assert default.group(1) + str(node) == served.format(node=node)
    assert default.group(2) == "0"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_files_init_and_json_write_follow_the_umask(
        umask: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As any program's output: a dashboard a non-root Grafana reads under umask 022, and
    private under 077."""
    old = os.umask(umask)
    try:
        assert main(["init", str(tmp_path / "kvp")]) == 0
        assert main(["sim", "--nodes", "1", "--policies", "ondemand", "--no-progress",
                     "--json", str(tmp_path / "sim.json")]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    files = [p for p in (tmp_path / "kvp").rglob("*") if p.is_file()]
    assert files
    for path in [*files, tmp_path / "sim.json"]:
        want = (0o777 if path.suffix == ".sh" else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))
