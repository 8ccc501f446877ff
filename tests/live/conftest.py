"""Fixtures of the live control-plane tests: real Valkey and S3 on loopback (one each per
session), in-process fleets (``kvptest.live_fleet``) and, for the Ray tests, Ray runtimes
that are always shut down. Tests here import raycluster.py by name: pytest's default import
mode puts this folder on the path. Every test that needs Ray or a real server
is marked ``live`` here, so that ``make test-fast`` runs only the in-process ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey

HERE = Path(__file__).parent
# Modules whose every test starts a real server but that carry no marker of their own:
# test_http.py runs each test against a uvicorn server on loopback.
SERVER_MODULES = {"test_http.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent != HERE:
            continue
        if item.path.name in SERVER_MODULES:
            item.add_marker(pytest.mark.servers)
        if item.get_closest_marker("servers") or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[EmbeddedValkey]:
    with EmbeddedValkey() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    with EmbeddedS3() as server:
        yield server
