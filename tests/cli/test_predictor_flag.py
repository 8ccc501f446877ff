"""``--predictor`` parsing of the sub-commands that have it (no trace is loaded)."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.cli import build_parser

BASE = {
    "eval-predictor": ["eval-predictor", "--trace", "t"],
    "train": ["train", "--trace", "t", "--out", "model.kvp"],
    "sim": ["sim"],
}


def _parse(argv: list[str]) -> list[str] | str | None:
    predictor: list[str] | str | None = build_parser().parse_args(argv).predictor
    return predictor


@pytest.mark.parametrize("flags", [
    ["--predictor", "gbm", "survival", "mod:Cls"],
    ["--predictor", "gbm", "--predictor", "survival", "--predictor", "mod:Cls"],
    ["--predictor", "gbm", "survival", "--predictor", "mod:Cls"],
])
def test_eval_predictor_collects_every_spec_in_order(flags: list[str]) -> None:
    assert _parse([*BASE["eval-predictor"], *flags]) == ["gbm", "survival", "mod:Cls"]


def test_eval_predictor_defaults_to_no_extra_predictor() -> None:
    assert _parse(BASE["eval-predictor"]) == []


def test_eval_predictor_flag_needs_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([*BASE["eval-predictor"], "--predictor"])
    assert exc.value.code == 2
    assert "--predictor" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sim"])
def test_single_predictor_commands_take_one(command: str) -> None:
    assert _parse([*BASE[command], "--predictor", "gbm:model.kvp"]) == "gbm:model.kvp"


def test_sim_default_predictor() -> None:
    assert _parse(BASE["sim"]) == "default"


@pytest.mark.parametrize("command", ["train", "sim"])
@pytest.mark.parametrize("flags", [
    ["--predictor", "gbm", "survival"],
    ["--predictor", "gbm", "--predictor", "survival"],
])
def test_single_predictor_commands_reject_several(
        command: str, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([*BASE[command], *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--predictor takes one predictor here, got 2: gbm survival" in err


def test_train_still_requires_a_predictor(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(BASE["train"])
    assert "--predictor" in capsys.readouterr().err
