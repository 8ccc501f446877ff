"""The step output every core call returns."""

from __future__ import annotations

from kvprefetch.controlplane.core.step import StepOutput


def test_the_empty_step_output_is_the_default_one() -> None:
    assert StepOutput() == StepOutput.empty()
