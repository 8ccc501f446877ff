"""LMCache object names in our stores, and the listings of what the tiers hold: pages for
LMCache's ``list_l2_keys`` (S3, then the write-back uploads not yet in S3; else Valkey) and
the full set of names the adapter's lookup index is reconciled with.

Cursors say where a listing continues: ``s3:<continuation token>``,
``pending:<offset>`` (the write-back backlog, sorted) or
``valkey:<scan cursor>:<entries to skip>``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey

from kvprefetch.agents.lmcache.keys import mp_wire_name
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.format import decode_header, header_length
from kvprefetch.agents.stores.s3.config import translate_boto_errors
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.valkey.config import translate_valkey_errors
from kvprefetch.agents.stores.valkey.store import ValkeyStore
from kvprefetch.agents.stores.write_back import WriteBackQueue

SEP: Final = "@"

# -- object names ---------------------------------------------------------------------------


def object_key_name(key: ObjectKey) -> str:
    """``<model>@<kv_rank:08x>@<object_group_id:x>@<chunk_hash hex>[@<cache_salt>]``.

    ``ObjectKey`` forbids ``@`` in the model name and the salt, so the name is unambiguous.
    """
    return mp_wire_name(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash,
                        key.cache_salt)


def parse_object_key_name(name: str) -> ObjectKey:
    """The inverse of :func:`object_key_name`; ``ValueError`` for anything else."""
    fields = name.split(SEP)
    if len(fields) not in (4, 5):
        raise ValueError(f"not an LMCache object name: {name!r}")
    model, rank, group, chunk_hash = fields[:4]
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(chunk_hash), model_name=model,
                         kv_rank=int(rank, 16), object_group_id=int(group, 16),
                         cache_salt=fields[4] if len(fields) == 5 else "")
    except ValueError as exc:
        raise ValueError(f"not an LMCache object name: {name!r}: {exc}") from None


# -- listings -------------------------------------------------------------------------------


def list_entries(prefix: str, page_size: int, cursor: str | None, *, s3: S3Store | None,
                 valkey: ValkeyStore | None, uploads: WriteBackQueue | None, cold_up: bool
                 ) -> tuple[list[tuple[str, int]], str | None]:
    """One page of ``(name, payload bytes)`` under ``prefix`` and the next page's cursor.

    From S3 when it is configured and ``cold_up`` (the durable tier holds every object),
    then the write-back uploads not yet in S3; else from Valkey (standalone only). A listing
    begun in one tier continues there (the cursor says which). Raises :class:`StoreError`
    when a store fails and ``ValueError`` for a malformed cursor.
    """
    use_s3 = s3 is not None and (
        cursor.startswith("s3:") if cursor is not None else valkey is None or cold_up)
    if cursor is not None and cursor.startswith("pending:") and uploads:
        return _page(uploads.pending_entries(prefix), cursor, page_size)
    if use_s3:
        assert s3 is not None
        entries, token = _list_s3(s3, prefix, page_size, cursor)
        if token is None and uploads is not None:  # the rest of the page
            more, token = _page(uploads.pending_entries(prefix), "pending:0",
                                page_size - len(entries))
            entries += more
        return entries, token
    if valkey is not None:
        return _list_valkey(valkey, prefix, page_size, cursor)
    raise ValueError(f"malformed cursor {cursor!r}")


def key_page(entries: list[tuple[str, int]], token: str | None, strip: int) -> KeyListPage:
    """LMCache's page of the entries that are LMCache objects (names after ``strip``
    characters of namespace prefix)."""
    page = []
    for name, size in entries:
        try:
            key = parse_object_key_name(name[strip:])
        except ValueError:
            continue  # not an LMCache object (something else under our prefix)
        page.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
    return KeyListPage(entries=tuple(page), next_page_token=token)


def listed_names(prefix: str, *, s3: S3Store | None, valkey: ValkeyStore | None,
                 uploads: WriteBackQueue | None) -> set[str]:
    """Every name under ``prefix`` in S3, a standalone Valkey and the write-back backlog.
    Raises :class:`StoreError` when a listing fails and ``NotImplementedError`` for a
    Valkey cluster alone (it cannot be listed)."""
    names: set[str] = set()
    if s3 is not None:
        cursor: str | None = None
        while True:
            entries, cursor = _list_s3(s3, prefix, 1000, cursor)
            names.update(n for n, _ in entries)
            if cursor is None:
                break
    if valkey is not None and not valkey.config.cluster:
        names.update(_scan_valkey_names(valkey, prefix))
    elif valkey is not None and s3 is None:
        raise NotImplementedError("a Valkey cluster alone cannot be listed")
    if uploads is not None:  # in Valkey, not yet in S3 (and a cluster is unlisted)
        names.update(uploads.pending_names())
    return names


def _payload_bytes(total: int, name: str, part_bytes: int) -> int:
    """Payload bytes of an S3 object of ``total`` bytes stored under ``name`` (its header:
    24-byte prefix, key, 8 bytes per part, 8-byte digest), assuming the configured part size;
    the object size when that does not add up (written with another part size)."""
    rest = total - 32 - len(name.encode("utf-8"))
    guess = max(0, rest // (part_bytes + 8))
    for parts in (guess, guess + 1, guess + 2):
        payload = rest - 8 * parts
        if payload >= 0 and -(-payload // part_bytes) == parts:
            return payload
    return total


def _list_s3(store: S3Store, prefix: str, page_size: int, cursor: str | None
             ) -> tuple[list[tuple[str, int]], str | None]:
    c = store.config
    kwargs: dict[str, Any] = {"Bucket": c.bucket, "Prefix": c.key_prefix + prefix,
                              "MaxKeys": min(page_size, 1000)}
    if cursor is not None:
        if not cursor.startswith("s3:") or len(cursor) < 4:
            raise ValueError(f"malformed cursor {cursor!r}")
        kwargs["ContinuationToken"] = cursor[3:]
    with translate_boto_errors("list"):
        resp = store.client.list_objects_v2(**kwargs)
    skip = len(c.key_prefix)
    entries = []
    for item in resp.get("Contents", []):
        name = str(item["Key"])[skip:]
        entries.append((name, _payload_bytes(int(item.get("Size", 0)), name, c.part_bytes)))
    token = resp.get("NextContinuationToken") if resp.get("IsTruncated") else None
    return entries, f"s3:{token}" if token else None


def _page(entries: list[tuple[str, int]], cursor: str, page_size: int
          ) -> tuple[list[tuple[str, int]], str | None]:
    """One page of a sorted in-memory listing; the cursor is ``pending:<offset>``."""
    m = re.fullmatch(r"pending:(\d+)", cursor)
    if m is None:
        raise ValueError(f"malformed cursor {cursor!r}")
    start = int(m.group(1))
    end = start + max(0, page_size)
    return entries[start:end], (f"pending:{end}" if end < len(entries) else None)


def _scan_valkey_names(store: ValkeyStore, prefix: str) -> list[str]:
    """Every object name under ``prefix`` in a standalone Valkey (SCAN over heads)."""
    head = store.head_key("")
    with translate_valkey_errors("list"):
        raw = store.client.scan_iter(match=_glob_escape(head + prefix) + "*", count=1000)
        return [(b.decode() if isinstance(b, bytes) else str(b))[len(head):] for b in raw]


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _list_valkey(store: ValkeyStore, prefix: str, page_size: int, cursor: str | None
                 ) -> tuple[list[tuple[str, int]], str | None]:
    """SCAN over object heads. The cursor is ``valkey:<scan cursor>:<entries to skip>``, so a
    page never holds more than ``page_size`` entries even when one SCAN step returns more."""
    if store.config.cluster:
        raise NotImplementedError("listing a Valkey cluster is not supported; add an s3 tier")
    scan, skip = 0, 0
    if cursor is not None:
        m = re.fullmatch(r"valkey:(\d+):(\d+)", cursor)
        if m is None:
            raise ValueError(f"malformed cursor {cursor!r}")
        scan, skip = int(m.group(1)), int(m.group(2))
    head = store.head_key("")
    match = _glob_escape(head + prefix) + "*"
    names: list[str] = []
    token: str | None = None
    with translate_valkey_errors("list"):
        while True:
            nxt, batch = store.client.scan(cursor=scan, match=match, count=max(page_size, 100))
            batch = [b.decode() if isinstance(b, bytes) else str(b) for b in batch][skip:]
            room = page_size - len(names)
            if len(batch) > room:
                names += batch[:room]
                token = f"valkey:{scan}:{skip + room}"
                break
            names += batch
            skip = 0
            scan = int(nxt)
            if scan == 0:
                break
            if len(names) == page_size:
                token = f"valkey:{scan}:0"
                break
        sizes = _valkey_payload_sizes(store, names)
    return [(n[len(head):], s) for n, s in zip(names, sizes, strict=True)], token


def _valkey_payload_sizes(store: ValkeyStore, heads: Sequence[str]) -> list[int]:
    """Payload bytes from each head's header (two pipelined round trips at most)."""
    pipe = store.client.pipeline(transaction=False)
    for h in heads:
        pipe.getrange(h, 0, 4095)
    firsts = pipe.execute()
    out: list[int] = [0] * len(heads)
    again: list[tuple[int, int]] = []
    for i, raw in enumerate(firsts):
        try:
            need = header_length(raw)
            if need > len(raw):
                again.append((i, need))
            else:
                out[i] = decode_header(raw).payload_bytes
        except StoreError:
            continue  # corrupt or vanished: listed with size 0
    if again:
        pipe = store.client.pipeline(transaction=False)
        for i, need in again:
            pipe.getrange(heads[i], 0, need - 1)
        for (i, _), raw in zip(again, pipe.execute(), strict=True):
            try:
                out[i] = decode_header(raw).payload_bytes
            except StoreError:
                continue
    return out
