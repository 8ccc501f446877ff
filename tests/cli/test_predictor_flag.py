"""``--predictor`` and ``--predictors`` parsing of the sub-commands that have them (no trace
is loaded), and ``train``'s refusal of a predictor it could fit and not save (on the
bundled slice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefetch.controlplane.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "eval-predictor": ["eval-predictor", "--trace", "t"],
    "train": ["train", "--trace", "t", "--out", "model.kvp"],
    "sim": ["sim"],
}


def _parse(argv: list[str]) -> list[str] | str | None:
    args = build_parser().parse_args(argv)
    predictor: list[str] | str | None = (
        args.predictors if argv[0] == "eval-predictor" else args.predictor)
    return predictor


@pytest.mark.parametrize("flags", [
    ["--predictors", "gbm,survival,mod:Cls"],
    ["--predictors", "gbm", "--predictors", "survival,mod:Cls"],
    ["--predictor", "gbm", "survival", "mod:Cls"],
    ["--predictor", "gbm", "--predictor", "survival", "--predictor", "mod:Cls"],
    ["--predictor", "gbm", "survival", "--predictors", "mod:Cls"],
])
def test_eval_predictor_collects_every_spec_in_order(flags: list[str]) -> None:
    assert _parse([*BASE["eval-predictor"], *flags]) == ["gbm", "survival", "mod:Cls"]


def test_eval_predictor_defaults_to_no_extra_predictor() -> None:
    assert _parse(BASE["eval-predictor"]) == []
    assert _parse(BASE["eval-predictor"]) == []  # the default list is not shared


@pytest.mark.parametrize("flag", ["--predictors", "--predictor"])
def test_eval_predictor_flag_needs_a_value(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([*BASE["eval-predictor"], flag])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sim"])
def test_single_predictor_commands_take_one(command: str) -> None:
    assert _parse([*BASE[command], "--predictor", "gbm:model.kvp"]) == "gbm:model.kvp"


def test_sim_default_predictor() -> None:
    assert _parse(BASE["sim"]) == "default"


@pytest.mark.parametrize("command", ["train", "sim"])
@pytest.mark.parametrize(("flags", "words"), [
    (["--predictor", "gbm", "survival"], "unrecognized arguments: survival"),
    (["--predictor", "gbm", "--predictor", "survival"],
     "--predictor takes one predictor here, got 2: gbm survival"),
])
def test_single_predictor_commands_reject_several(
        command: str, flags: list[str], words: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([*BASE[command], *flags])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_train_still_requires_a_predictor(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(BASE["train"])
    assert "--predictor" in capsys.readouterr().err


def test_train_refuses_a_wrapper_of_an_unsavable_model_before_it_trains(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hinted`` alone wraps ``ewma``, which has no artifact: one line saying so before the
    fit; the hint layer over a trainable model trains and writes its artifact."""
    from kvprefetch.controlplane.cli import main

    trace = str(ROOT / "controlplane" / "data" / "traces" / "claude-code")
    out = tmp_path / "hinted.bin"
    argv = ["train", "--trace", trace, "--out", str(out), "--no-progress"]
    assert main([*argv, "--predictor", "hinted"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvprefetch: error: predictor 'hinted' cannot be trained: it wraps "
                          "'ewma'"), err
    assert not out.exists()
    assert main([*argv, "--predictor", "hinted:empirical"]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "hinted:SPEC (the hint layer over a trainable SPEC" in text and "ewma" not in text
