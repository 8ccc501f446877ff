from __future__ import annotations

import os

import pytest

from kvprefetch.agents.stores.errors import CorruptObjectError, StoreConfigError
from kvprefetch.agents.stores.format import ALGO_XXH64, decode_object, encode_object, make_header


def test_round_trip_several_parts() -> None:
    payload = os.urandom(10_000)
    header, encoded = encode_object("k", payload, 4096)
    assert header.parts == 3
    got_header, got = decode_object(encoded + payload, expected_key="k")
    assert got_header == header
    assert bytes(got) == payload


def test_empty_payload_and_xxh64() -> None:
    header = make_header("e", b"", 4096, algo=ALGO_XXH64)
    assert header.parts == 0
    decode_object(header.encode(), "e")


@pytest.mark.parametrize("where", ["magic", "key", "digest", "payload"])
def test_any_flipped_byte_is_caught(where: str) -> None:
    payload = os.urandom(9000)
    _header, encoded = encode_object("key", payload, 4096)
    blob = bytearray(encoded + payload)
    pos = {"magic": 0, "key": 25, "digest": 30, "payload": len(encoded) + 5000}[where]
    blob[pos] ^= 0x01
    with pytest.raises(CorruptObjectError):
        decode_object(blob, "key")


def test_wrong_key_and_bad_keys() -> None:
    _header, encoded = encode_object("a", b"x", 4096)
    with pytest.raises(CorruptObjectError):
        decode_object(encoded + b"x", "b")
    with pytest.raises(StoreConfigError):
        make_header("", b"x", 4096)
    with pytest.raises(StoreConfigError):
        make_header("k" * 5000, b"x", 4096)
