"""Server fixtures for the data-plane tests: one real valkey-server and one real S3 server
(SeaweedFS, or moto) per session on loopback. Tests use unique keys and delete them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.embedded import EmbeddedS3, EmbeddedValkey


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[EmbeddedValkey]:
    with EmbeddedValkey() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    with EmbeddedS3() as server:
        yield server


@pytest.fixture
def key_prefix() -> str:
    """A prefix unique to one test, so that tests sharing a server never collide."""
    return f"t-{uuid.uuid4().hex[:10]}/"


@pytest.fixture
def dram_dir(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        d = shm / f"kvp-test-{uuid.uuid4().hex[:10]}"
        yield d
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path / "dram"
