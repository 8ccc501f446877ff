"""The wheel as a user meets it: built from the repository's files (what a clean checkout
holds), installed with no extras into a fresh virtual environment next to ``openai-agents``
(whose import name is ``agents``). What must work there: the ``kvprefetch`` command
(``--help``, ``--version``, ``sim`` on the bundled trace slice, ``init``), the public
Python face (``from kvprefetch import connect``), the SDK's own ``agents`` package in the
same interpreter, and a command that needs an extra says which, in one line, exit code 2.

It installs from the package index (slow: about a minute); marked ``slow``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` in ``cwd``: outside the repository, whose folders (agents/ ...) would
    otherwise shadow the installed packages."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def _checkout(dest: Path) -> Path:
    """The repository's tracked and new (not ignored) files, links kept as links."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                  REPO)
    assert listed.returncode == 0, listed.stderr
    for rel in filter(None, listed.stdout.split("\0")):
        src, dst = REPO / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with openai-agents and the kvprefetch wheel (no extras); its bin/."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _checkout(tmp / "src")
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                  str(tmp / "dist"), str(src)], tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kvprefetch-*.whl")
    venv.EnvBuilder(with_pip=True).create(tmp / "venv")
    bin_ = tmp / "venv" / "bin"
    pip = _run([str(bin_ / "python"), "-m", "pip", "install", "-q", "openai-agents",
                str(wheel)], tmp)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return bin_


def test_the_wheel_installs_one_import_package(installed: Path, tmp_path: Path) -> None:
    files = _run([str(installed / "python"), "-c",
                  "import importlib.metadata as m; "
                  "print('\\n'.join(str(f) for f in m.files('kvprefetch')))"], tmp_path)
    assert files.returncode == 0, files.stderr
    tops = {f.split("/")[0] for f in files.stdout.split()}
    # the package, its metadata and the console script: no top-level agents/ or predictors/
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"kvprefetch"}


def test_commands_run_without_extras(installed: Path, tmp_path: Path) -> None:
    kvp = str(installed / "kvprefetch")
    help_ = _run([kvp, "--help"], tmp_path)
    assert help_.returncode == 0 and "sim" in help_.stdout, help_.stderr
    version = _run([kvp, "--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == "kvprefetch 0.1.0"
    sim = _run([kvp, "sim", "--nodes", "1", "--policies", "ondemand,predictive",
                "--json", str(tmp_path / "sim.json")], tmp_path)
    assert sim.returncode == 0, sim.stderr[-2000:]
    assert "predictive" in sim.stdout and (tmp_path / "sim.json").is_file()
    init = _run([kvp, "init", str(tmp_path / "configs")], tmp_path)
    assert init.returncode == 0, init.stderr
    assert (tmp_path / "configs" / "serve.yaml").is_file()


def test_a_command_that_needs_an_extra_says_which(installed: Path, tmp_path: Path) -> None:
    out = _run([str(installed / "kvprefetch"), "bench", "store"], tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'kvprefetch[stores]'" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_the_sdk_and_the_client_share_one_interpreter(installed: Path, tmp_path: Path) -> None:
    code = ("import agents, kvprefetch; from kvprefetch import connect, Hint, STOP_REASONS; "
            "from agents import Agent; "
            "assert 'site-packages/agents/' in agents.__file__, agents.__file__; "
            "assert callable(connect) and Hint(kind='tool_running', eta_s=2).eta_s == 2; "
            "print(kvprefetch.__version__, STOP_REASONS[0])")
    out = _run([str(installed / "python"), "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.1.0", "tool_use"]
