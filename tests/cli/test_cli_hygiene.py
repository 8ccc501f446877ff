"""The ``kvprefetch`` command line as a user meets it: ``--version``, ``-v`` on either side of
the sub-command, one line (not a traceback) for a missing extra, one flag name per meaning,
the API's hint-kind names, every policy in ``--help``, sizes with units, and bad values
refused by argparse with the flag named."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.controlplane import __version__
from kvprefetch.controlplane.cli import build_parser, main
from kvprefetch.controlplane.cli.options import (
    EXTRA_OF_MODULE,
    TRACE_FORMATS,
    missing_extra,
    parse_size,
    positive_float,
    positive_int,
)
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.traces.detect import FORMATS

REPO = Path(__file__).resolve().parents[2]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of a command line argparse refuses (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _help(argv: list[str], capsys: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "500")  # no wrapping inside hyphenated names
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------ --version, -v
def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvprefetch {__version__}" == "kvprefetch 0.1.0"


@pytest.mark.parametrize(("argv", "verbose"), [
    (["sim"], False),
    (["-v", "sim"], True),
    (["sim", "-v"], True),
    (["sim", "--verbose", "--nodes", "2"], True),
    (["-v", "sim", "-v"], True),
    (["journal", "check", "-v", "j.jsonl"], True),
    (["bench", "-v", "store"], True),
    (["bench", "store", "-v"], True),
])
def test_verbose_is_accepted_before_and_after_the_sub_command(argv: list[str],
                                                              verbose: bool) -> None:
    assert build_parser().parse_args(argv).verbose is verbose


# ------------------------------------------------------------------ missing extras
_NO_EXTRAS = textwrap.dedent("""\
    import importlib.abc, sys

    BLOCKED = {"ray", "valkey", "boto3", "botocore", "xxhash", "blake3", "httpx", "fastapi",
               "uvicorn", "starlette", "prometheus_client", "sklearn", "torch", "matplotlib",
               "lmcache"}

    class NoExtras(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoExtras())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    from kvprefetch.controlplane.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _NO_EXTRAS, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["sim", "--help"], ["sim-grid", "--help"], ["train", "--help"],
    ["eval-predictor", "--help"], ["journal", "check", "--help"], ["bench", "--help"],
    ["sim", "--nodes", "1", "--policies", "ondemand,predictive", "--limit-sessions", "4",
     "--workers", "1", "--no-progress"],
])
def test_the_core_commands_need_no_extra(argv: list[str]) -> None:
    res = _without_extras(*argv)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr


def test_the_top_level_help_lists_commands_whose_extras_are_missing() -> None:
    res = _without_extras("--help")
    assert res.returncode == 0
    for command in ("sim", "serve", "demo", "bench", "journal"):
        assert re.search(rf"^\s+{command}\s", res.stdout, re.MULTILINE), command


def _subcommands() -> list[list[str]]:
    from kvprefetch.controlplane.cli import BENCHES, COMMANDS

    return [[name] for name in COMMANDS] + [["bench", name] for name in BENCHES]


@pytest.mark.parametrize("command", _subcommands(), ids=" ".join)
def test_every_subcommand_help_needs_no_extra(command: list[str]) -> None:
    res = _without_extras(*command, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: kvprefetch {' '.join(command)}"), res.stdout[:200]


def test_no_help_shows_rest_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """Help is read in a terminal: no reST roles or double backquotes from docstrings."""
    from kvprefetch.controlplane.cli import BENCHES, COMMANDS

    commands = [[name] for name in COMMANDS] + [["bench", name] for name in BENCHES]
    commands += [["journal", "check"], ["journal", "compact"]]
    for command in commands:
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert text.startswith(f"usage: kvprefetch {' '.join(command)}"), command
        assert "``" not in text and not re.search(r":(class|func|meth|mod):`", text), command


@pytest.mark.parametrize(("argv", "extras"), [
    (["serve", "--config", "x.yaml"], ("serve", "stores")),
    (["serve", "--config", "x.yaml", "--address", "auto"], ("serve", "stores")),
    (["demo"], ("serve", "stores")),
    (["bench", "lmcache"], ("lmcache", "stores")),
    (["bench", "store"], ("stores",)),
])
def test_a_missing_extra_is_one_line_naming_every_missing_extra(
        argv: list[str], extras: tuple[str, ...]) -> None:
    res = _without_extras(*argv)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    joined = ",".join(extras)
    if len(extras) == 1:
        match = re.fullmatch(rf"kvprefetch {command}: needs the '{extras[0]}' extra: pip "
                             rf"install 'kvprefetch\[{joined}\]' \(missing module: (\w+)\)",
                             lines[0])
    else:
        named = " and ".join(f"'{e}'" for e in extras)
        match = re.fullmatch(rf"kvprefetch {command}: needs the {named} extras: pip install "
                             rf"'kvprefetch\[{joined}\]' \(missing modules: ([\w, ]+)\)",
                             lines[0])
    assert match is not None, lines[0]
    modules = match[1].split(", ")
    assert [EXTRA_OF_MODULE[m] for m in modules] == list(extras)


def test_connect_to_ray_without_ray_is_a_typed_error() -> None:
    res = subprocess.run([sys.executable, "-c", _NO_EXTRAS.replace(
        "from kvprefetch.controlplane.cli import main\nsys.exit(main(sys.argv[1:]))",
        "from kvprefetch import KvPrefetchError, connect\n"
        "try:\n    connect('auto')\nexcept KvPrefetchError as exc:\n"
        "    print(type(exc).__name__, exc)\n")], cwd=REPO, capture_output=True, text=True,
        timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ConfigError connect('auto'): a Ray address needs the "
                                 "'serve' extra"), res.stdout


def test_missing_extra_names_the_extra_or_nothing() -> None:
    exc = ModuleNotFoundError("No module named 'ray.util'", name="ray.util")
    assert missing_extra(exc, "sim") == (
        "kvprefetch sim: needs the 'serve' extra: pip install 'kvprefetch[serve]' "
        "(missing module: ray)")
    assert missing_extra(ModuleNotFoundError("x", name="kvprefetch.nope"), "sim") is None
    assert missing_extra(ModuleNotFoundError("x"), "sim") is None


PLOT_LINE = re.compile(r"kvprefetch (sim|sim-grid|eval-predictor|demo): needs the 'plot' extra: "
                       r"pip install 'kvprefetch\[plot\]' \(missing module: matplotlib\)")


@pytest.mark.parametrize("argv", [
    ["sim-grid", "--traces", "synthetic:agentic:6", "--nodes", "1", "--loads", "1",
     "--seeds", "0", "--policies", "ondemand,predictive", "--workers", "1", "--no-progress",
     "--json", "{out}", "--plot", "{png}"],
    ["eval-predictor", "--trace", "synthetic:agentic:12", "--no-progress", "--json", "{out}",
     "--calibration-plot", "{png}"],
    ["sim", "--trace", "synthetic:agentic:6", "--nodes", "1", "--workers", "1",
     "--no-progress", "--json", "{out}", "--plot", "{png}"],
])
def test_a_plot_without_matplotlib_stops_the_command_before_it_runs(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot is the last thing written: without the 'plot' extra the command says so in
    one line (exit status 2) before any work, not after the whole run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what import sees when it is absent
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main([a.format(out=out, png=png) for a in argv]) == 2
    captured = capsys.readouterr()
    assert PLOT_LINE.fullmatch(captured.err.strip()), captured.err
    assert captured.out == "" and not out.exists() and not png.exists()


def test_a_demo_plot_without_matplotlib_stops_before_the_demo_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvprefetch.controlplane.harness.demo as demo

    started: list[object] = []
    monkeypatch.setattr(demo, "run_demo", lambda args: started.append(args) or 0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--no-progress", "--plot", str(tmp_path / "demo.png")]) == 2
    assert PLOT_LINE.fullmatch(capsys.readouterr().err.strip())
    assert started == []


def test_the_extras_table_follows_pyproject() -> None:
    """Each direct requirement of an extra maps to it; each mapped extra exists."""
    extras: dict[str, list[str]] = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    module_of = {"scikit-learn": "sklearn", "valkey-glide-sync": "glide_sync"}
    for extra, requirements in extras.items():
        if extra == "dev":
            continue
        for requirement in requirements:
            dist = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()
            module = module_of.get(dist, dist.replace("-", "_"))
            assert EXTRA_OF_MODULE.get(module) == extra, requirement
    assert set(EXTRA_OF_MODULE.values()) <= set(extras) - {"dev"}


# ------------------------------------------------------------------ one flag, one name
def test_trace_format_is_one_flag_everywhere(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert ("auto", *FORMATS) == TRACE_FORMATS
    parse = build_parser().parse_args
    for base in (["sim"], ["train", "--trace", "t", "--out", "o", "--predictor", "gbm"],
                 ["eval-predictor", "--trace", "t"]):
        assert parse(base).trace_format == "auto"
        assert parse([*base, "--trace-format", "mooncake"]).trace_format == "mooncake"
        assert parse([*base, "--format", "azure"]).trace_format == "azure"  # hidden alias
        text = _help(base, capsys, monkeypatch)
        assert "--trace-format" in text and "--format" not in text.replace("--trace-format", "")


def test_an_unknown_trace_format_names_the_flag_and_the_values(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["sim", "--trace-format", "parquet"], capsys)
    assert "argument --trace-format: invalid choice: 'parquet'" in err
    assert all(f"'{name}'" in err for name in TRACE_FORMATS)
    err = _usage_error(["train", "--trace", "t", "--out", "o", "--predictor", "gbm",
                        "--format", "parquet"], capsys)
    assert "invalid choice: 'parquet'" in err


def test_an_undetectable_trace_says_which_flag_names_its_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "requests.txt"
    trace.write_text("hello\n")
    assert main(["sim", "--trace", str(trace), "--no-progress", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot tell the trace format" in err and "--trace-format" in err
    assert "fmt=" not in err and all(name in err for name in FORMATS)


def test_test_fraction_is_one_flag_everywhere(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert parse(["sim"]).test_fraction is None
    assert parse(["sim", "--test-fraction", "0.3"]).test_fraction == 0.3
    assert parse(["sim", "--test-split", "0.3"]).test_fraction == 0.3  # hidden alias
    assert "--test-split" not in _help(["sim"], capsys, monkeypatch)
    train = ["train", "--trace", "t", "--out", "o", "--predictor", "gbm"]
    assert parse(train).test_fraction == 0.25
    assert parse([*train, "--test-fraction", "0"]).test_fraction == 0.0  # train on everything
    assert parse([*train, "--test-split", "0.5"]).test_fraction == 0.5
    assert "(0, 1)" in _usage_error(["eval-predictor", "--trace", "t", "--test-fraction", "0"],
                                    capsys)
    assert "[0, 1)" in _usage_error([*train, "--test-fraction", "1"], capsys)
    assert "argument --test-fraction" in _usage_error(["sim", "--test-fraction", "1.5"], capsys)


def test_sim_takes_one_predictor_and_eval_predictor_a_plural_flag(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert parse(["sim", "--predictor", "ewma"]).predictor == "ewma"
    assert "unrecognized arguments: gbm" in _usage_error(
        ["sim", "--predictor", "ewma", "gbm"], capsys)
    assert parse(["eval-predictor", "--trace", "t", "--predictors", "gbm,ewma"]
                 ).predictors == ["gbm", "ewma"]
    text = _help(["eval-predictor", "--trace", "t"], capsys, monkeypatch)
    assert "--predictors" in text and "--predictor " not in text


# ------------------------------------------------------------------ hints, policies
def test_hint_kinds_take_the_api_names_and_the_short_ones(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvprefetch.controlplane.base.vocabulary import HINT_KINDS
    from kvprefetch.controlplane.cli.sim import hint_config

    parse = build_parser().parse_args
    api = hint_config(parse(["sim", "--hints", "user_typing,tool_running"]))
    short = hint_config(parse(["sim", "--hints", "typing,tool"]))
    assert api is not None and api == short
    assert {str(k) for k in api.kinds} <= set(HINT_KINDS)
    text = _help(["sim"], capsys, monkeypatch)
    assert "'user_typing'" in text and "'tool_running'" in text
    assert "'typing'" not in text and "'tool'" not in text


def test_a_session_closed_hint_in_sim_says_why_the_simulator_sends_none(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The docs list ``session_closed`` with the hints; the simulator's clients cannot send
    it (a trace ends its sessions), and the refusal says so, naming the flag."""
    assert main(["sim", "--nodes", "1", "--hints", "user_typing,session_closed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvprefetch: error: --hints: session_closed is a hint the live "
                          "service takes; a replayed trace ends its sessions itself"), err


def test_sim_grid_reports_the_api_hint_names(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    assert main(["sim-grid", "--traces", "synthetic:agentic:6", "--nodes", "1", "--loads",
                 "1", "--seeds", "0", "--policies", "ondemand,predictive", "--hints",
                 "tool,typing", "--workers", "1", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["hints"] == "user_typing,tool_running"


@pytest.mark.parametrize("command", ["sim", "sim-grid"])
def test_help_lists_every_accepted_policy(command: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help([command], capsys, monkeypatch)
    for name in POLICIES:
        assert re.search(rf"[\s,:]{re.escape(name)}[,;\s]", text), name


# ------------------------------------------------------------------ values
@pytest.mark.parametrize(("text", "size"), [
    ("4096", 4096), ("0", 0), ("64GiB", 64 << 30), ("512MiB", 512 << 20),
    ("1.5GB", 1_500_000_000), ("2 kib", 2048), ("10kB", 10_000), ("1TiB", 1 << 40),
    ("100B", 100), (".5MiB", 1 << 19), ("1e", None), ("64GiBs", None), ("-1GiB", None),
    ("GiB", None), ("", None), ("1.5.2GB", None), ("nan", None),
])
def test_parse_size(text: str, size: int | None) -> None:
    if size is not None:
        assert parse_size(text) == size
        return
    with pytest.raises(argparse.ArgumentTypeError, match=r"is not a size.*512MiB"):
        parse_size(text)


def test_a_bad_size_is_a_usage_error_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvprefetch")
    parser.add_argument("--dram-bytes", type=parse_size)
    assert parser.parse_args(["--dram-bytes", "24GiB"]).dram_bytes == 24 << 30
    with pytest.raises(SystemExit):
        parser.parse_args(["--dram-bytes", "lots"])
    assert "argument --dram-bytes: 'lots' is not a size" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "--nodes", "0"], "argument --nodes: 0 is not a positive integer"),
    (["sim", "--nodes", "-3"], "argument --nodes: -3 is not a positive integer"),
    (["sim", "--nodes", "two"], "argument --nodes: 'two' is not a positive integer"),
    (["sim", "--load", "-1"], "argument --load: -1 is not a positive number"),
    (["sim", "--load", "0"], "argument --load: 0 is not a positive number"),
    (["sim", "--load", "nan"], "argument --load: 'nan' is not a positive number"),
    (["sim", "--session-rate", "0"], "argument --session-rate: 0 is not a positive number"),
    (["sim", "--concurrency", "0"], "argument --concurrency: 0 is not a positive integer"),
    (["sim", "--workers", "0"], "argument --workers: 0 is not a positive integer"),
    (["sim", "--limit-sessions", "0"], "argument --limit-sessions: 0 is not a positive"),
    (["sim", "--seed", "-1"], "argument --seed: -1 is not an integer >= 0"),
    (["sim-grid", "--traces", "synthetic:chat", "--workers", "0"],
     "argument --workers: 0 is not a positive integer"),
    (["train", "--trace", "t", "--out", "o", "--predictor", "gbm", "--limit-sessions", "-2"],
     "argument --limit-sessions: -2 is not a positive integer"),
    (["journal", "check", "j", "--show", "-1"], "argument --show: -1 is not an integer >= 0"),
])
def test_bad_values_are_one_line_usage_errors_naming_the_flag(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(argv, capsys)
    assert "Traceback" not in err and err.startswith("usage: ")
    assert words in err.strip().splitlines()[-1]  # one error line after the usage


def test_number_types() -> None:
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    for bad in ("1.5", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float("inf")


# ------------------------------------------------------------------ plot
def _plot_report(prefetched: int) -> dict[str, Any]:
    policy = {"returning_ttft_quantiles_s": [0.1, 0.5, 2.0], "prefetched_bytes": prefetched,
              "wasted_bytes": prefetched // 4}
    return {"meta": {"trace": "t", "nodes": 1, "model": "8b"},
            "policies": {"ondemand": dict(policy, prefetched_bytes=0, wasted_bytes=0),
                         "predictive": policy}}


@pytest.mark.parametrize("prefetched", [0, 3 << 30])
def test_the_prefetch_panel_says_when_nothing_was_prefetched(
        prefetched: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from kvprefetch.controlplane.sim import report

    saved: list[Any] = []
    monkeypatch.setattr(report, "save_figure_atomic", lambda fig, path: saved.append(fig))
    report.write_plot(_plot_report(prefetched), tmp_path / "p.png")
    panel = saved[0].axes[1]
    texts = [t.get_text() for t in panel.texts]
    if prefetched:
        assert texts == [] and len(panel.patches) == 2  # predictive: useful + wasted
    else:
        assert texts == ["no prefetches"] and not panel.patches
        assert list(panel.get_yticks()) == []


@pytest.mark.parametrize(("nodes", "remedy"), [
    ("1", "replay a larger trace"), ("4", "lower --nodes or replay a larger trace")])
def test_the_low_pressure_note_says_lower_nodes_only_where_there_are_some_to_lower(
        nodes: str, remedy: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--nodes", nodes, "--policies", "ondemand", "--no-progress"]) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("note: pressure")]
    assert note.endswith(f"prefetch matters less; {remedy}"), note
