"""The documentation site builds with --strict, and its generated reference is complete."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_cli_reference_lists_every_subcommand(site: Path) -> None:
    import argparse

    from kvprefetch.controlplane.cli import build_parser

    text = _text(site / "reference" / "cli" / "index.html")

    def walk(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
        names = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    names.append(f"{prefix} {name}")
                    names += walk(sub, f"{prefix} {name}")
        return names

    commands = walk(build_parser(), "kvprefetch")
    assert "kvprefetch sim" in commands and "kvprefetch bench store" in commands
    missing = [c for c in commands if f"usage: {c} " not in text and f"usage: {c}\n" not in text]
    assert not missing, f"CLI reference lacks: {missing}"


def test_config_reference_lists_every_serve_field(site: Path) -> None:
    from kvprefetch.controlplane.cli.serve_config import ServeConfig
    from kvprefetch.controlplane.live.config import ServiceConfig

    text = _text(site / "reference" / "configuration" / "index.html")
    for model in (ServeConfig, ServiceConfig):
        missing = [name for name in model.model_fields if name not in text]
        assert not missing, f"configuration reference lacks {model.__name__}: {missing}"
    for section, field in ServeConfig.model_fields.items():
        if section not in ("fleet", "service") and field.annotation not in (str, int, float,
                                                                            bool):
            assert f"serve.{section}" in text  # a section of its own


def test_http_reference_lists_every_path(site: Path) -> None:
    text = _text(site / "reference" / "http-api" / "index.html")
    for path in ("/v1/route", "/v1/request_finished", "/v1/hint", "/v1/session_closed",
                 "/healthz", "/metrics"):
        assert path in text


def test_metrics_reference_lists_every_registry_with_type_labels_and_meaning(
        site: Path) -> None:
    text = _text(site / "reference" / "metrics" / "index.html")
    for name, kind, labels in (("kvprefetch_http_requests_total", "counter", "op, status"),
                               ("kvprefetch_http_request_seconds", "histogram", "op")):
        row = re.search(rf"{name}\s+{kind}\s+{re.escape(labels)}\s+\S", text)
        assert row, name
