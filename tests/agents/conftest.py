"""Server fixtures for the data-plane tests: one real valkey-server and one real S3 server
(SeaweedFS, or moto) per session on loopback. Tests use unique keys and delete them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.local import LocalTierConfig


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


@pytest.fixture
def remote(valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str
           ) -> RemoteStoreConfig:
    """Valkey in front of S3, under the test's own key prefix (modules that need other
    settings define their own ``remote``)."""
    return RemoteStoreConfig(
        valkey=valkey_server.store_config(key_prefix=f"kvp:{key_prefix}"),
        s3=s3_server.store_config(key_prefix=f"kvp/{key_prefix}"))


@pytest.fixture
def dram(dram_dir: Path) -> LocalTierConfig:
    """A 64 MiB node-local tier in the test's own directory."""
    return LocalTierConfig(path=str(dram_dir), capacity_bytes=64 << 20)
