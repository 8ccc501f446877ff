"""Idempotent routes: the answers the scheduler remembers by request id, per tenant.

A route that carries a ``request_id`` (:class:`~kvprefetch.controlplane.base.api.RouteQuery`)
is remembered with a digest of its query and its answer (:class:`RouteMemo`). The same id
again, with the same session and body, answers what the first call did and applies nothing
(no second ``request_started``, no second live session); the same id with another session or
body, or an id whose route was cancelled, is refused with
:class:`~kvprefetch.controlplane.base.errors.RequestIdConflictError` (409).

Each memo is journalled as a :class:`~kvprefetch.controlplane.journal.file.RouteRecord`
right after the route's event, under the service's lock, so a restart replays it and a
caller whose answer was lost (a 503 or a timeout while the scheduler restarted) gets it on
retry. A crash between the two records leaves the route applied but not remembered: a retry
then routes the request again (it is still in flight, so no second start is recorded) and
is remembered from then on.

What is remembered is what can still be retried: a route's memo goes when the request it
answered for ends (``request_finished``: the caller had its answer, it named the node) or
its session closes (:meth:`RouteLedger.finish`, called for those events, live and replayed
alike, so compaction and replay agree). A cancelled route's memo stays, so a retry of it is
refused also after the cancel closed the session. :class:`RouteLedger` also bounds what is
remembered: at most ``per_tenant`` ids per tenant, the least recently used forgotten first
(counted in :attr:`RouteLedger.forgotten`). Pure: no I/O, no clock, not thread-safe (the
service's lock guards it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import RequestIdConflictError
from kvprefetch.controlplane.journal.file import RouteRecord

#: A session's list of ids is swept of forgotten ones past this length (bounds it by what
#: the ledger remembers).
_SESSION_IDS_SWEEP = 16


def route_digest(call: api.RouteQuery) -> str:
    """What identifies a route's body (its session, size, chunk names, reuse and parent;
    not its tenant or request id): 32 hex digits. Token ids count as given: call it on the
    query as the scheduler takes it (after :func:`~kvprefetch.controlplane.live.limits.prehash`
    where the scheduler hashes them)."""
    h = hashlib.blake2b(digest_size=16)
    # Each part carries its length (or a mark for None), so no two bodies join alike.
    for text in (call.session_id, call.parent_id):
        if text is None:
            h.update(b"-;")
        else:
            b = text.encode()
            h.update(b"%d:" % len(b))
            h.update(b)
    h.update(b"%d;%d;" % (call.tokens, -1 if call.reused_tokens is None else call.reused_tokens))
    if call.chunk_hashes is None:
        h.update(b"-;")
    else:  # chunk names are [A-Za-z0-9_-]: a newline cannot occur in one
        h.update(b"%d:" % len(call.chunk_hashes))
        h.update("\n".join(call.chunk_hashes).encode())
    if call.token_ids is None:
        h.update(b";-")
    else:
        h.update(b";%d:" % len(call.token_ids))
        try:
            h.update(array("q", call.token_ids).tobytes())
        except OverflowError:  # beyond 64 bits: no tokenizer's, but the digest still counts it
            h.update(",".join(map(str, call.token_ids)).encode())
    return h.hexdigest()


@dataclass(slots=True)
class RouteMemo:
    """One remembered route: its session (``tenant/session`` form), its query's digest,
    the request it answered for (the session's ``turn`` and the service time it started,
    ``arrival_s``), its answer, and whether it was cancelled since.
    ``journalled``: whether its latest state is in the journal (False after a write that
    failed; the next call with its id writes it again)."""

    session_id: str
    digest: str
    turn: int
    arrival_s: float
    answer: api.RouteAnswer
    cancelled: bool = False
    journalled: bool = False

    def check(self, request_id: str, session_id: str, digest: str | None) -> None:
        """Refuse a call with this id for another session or body (``digest`` None: a
        cancel, which names the session only)."""
        if session_id != self.session_id:
            raise RequestIdConflictError(
                f"request id {request_id!r} names a route of another session; nothing was "
                "applied: send the query with a new id")
        if digest is not None and digest != self.digest:
            raise RequestIdConflictError(
                f"request id {request_id!r} names a route with another body; nothing was "
                "applied: send the query with a new id")

    def record(self, tenant: str, request_id: str, time_s: float) -> RouteRecord:
        """The journal's record of this memo."""
        a = self.answer
        assert a.node is not None  # only answered routes are remembered
        return RouteRecord(request_id, tenant, self.session_id, self.digest, self.turn,
                           time_s, a.node, self.arrival_s, a.node_name, a.estimated_ttft_s,
                           a.local_ready, self.cancelled)

    @classmethod
    def replayed(cls, record: RouteRecord) -> RouteMemo:
        """The memo a journalled record stands for."""
        answer = api.RouteAnswer(node=record.node, node_name=record.node_name,
                                 estimated_ttft_s=record.estimated_ttft_s,
                                 local_ready=record.local_ready, request_id=record.request_id)
        return cls(record.session_id, record.digest, record.turn, record.arrival_s, answer,
                   record.cancelled, journalled=True)


class RouteLedger:
    """The remembered routes, per tenant, by request id (see the module docstring)."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError("per_tenant must be >= 1")
        self.per_tenant = per_tenant
        self._by_tenant: dict[str, OrderedDict[str, RouteMemo]] = {}
        #: The ids of each session's routes not cancelled (``tenant/session`` form), which
        #: :meth:`finish` forgets; an id forgotten meanwhile past ``per_tenant`` may linger
        #: here until then.
        self._by_session: dict[str, list[str]] = {}
        #: Ids forgotten to stay within ``per_tenant`` (their retries route afresh).
        self.forgotten = 0

    def __len__(self) -> int:
        return sum(len(memos) for memos in self._by_tenant.values())

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """Every remembered (tenant, request id)."""
        for tenant, memos in self._by_tenant.items():
            for request_id in memos:
                yield tenant, request_id

    def get(self, tenant: str, request_id: str) -> RouteMemo | None:
        """The memo of this id (now the tenant's most recently used), or None."""
        memos = self._by_tenant.get(tenant)
        memo = memos.get(request_id) if memos is not None else None
        if memo is not None:
            memos.move_to_end(request_id)  # type: ignore[union-attr]
        return memo

    def put(self, tenant: str, request_id: str, memo: RouteMemo) -> None:
        """Remember ``memo`` (replacing one by the same id), forgetting the tenant's least
        recently used past ``per_tenant``."""
        memos = self._by_tenant.get(tenant)
        if memos is None:
            memos = self._by_tenant[tenant] = OrderedDict()
        if request_id in memos:
            memos.move_to_end(request_id)
        memos[request_id] = memo
        if not memo.cancelled:
            ids = self._by_session.get(memo.session_id)
            if ids is None:
                self._by_session[memo.session_id] = [request_id]
            elif request_id not in ids:
                ids.append(request_id)
                if len(ids) > _SESSION_IDS_SWEEP:  # fresh ids for one stuck request: drop
                    ids[:] = [r for r in ids if r in memos]  # those forgotten meanwhile
        while len(memos) > self.per_tenant:
            memos.popitem(last=False)
            self.forgotten += 1

    def finish(self, tenant: str, session_id: str) -> None:
        """The request in flight of session ``session_id`` (``tenant/session`` form) ended,
        or the session closed: forget its routes but the cancelled ones (their callers had
        their answers; a retry of one routes afresh)."""
        ids = self._by_session.pop(session_id, None)
        if ids is None:
            return
        memos = self._by_tenant.get(tenant)
        if memos is None:
            return
        for request_id in ids:
            memo = memos.get(request_id)
            if memo is not None and not memo.cancelled and memo.session_id == session_id:
                del memos[request_id]
        if not memos:
            del self._by_tenant[tenant]

    def replay(self, record: RouteRecord) -> None:
        """A journalled route record, in journal order (the later record of an id wins)."""
        self.put(record.tenant, record.request_id, RouteMemo.replayed(record))
