"""The predictors guide's blocks in order, as written, on CPU: the custom predictor of
``examples/`` in the simulator and the evaluation, then a gbm trained, evaluated and
replayed (the ``ml`` extra). The block on a deployment's journal carries its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pages import blocks, script

pytest.importorskip("sklearn")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PAGE = "guides/predictors.md"


def test_the_page_runs_as_written(tmp_path: Path) -> None:
    page = blocks(PAGE)
    assert [b.skip is None for b in page] == [True, True, False]
    (tmp_path / "page.sh").write_text(script(page, tmp_path))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
                                                       os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(["bash", "page.sh"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert (tmp_path / "gbm.kvp").stat().st_size > 0
    assert done.stdout.count("wall time") == 2  # both simulator runs reported
    assert "stop-aware" in done.stdout.lower() or "StopAware" in done.stdout, \
        done.stdout[-3000:]
