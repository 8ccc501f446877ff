"""The HTTP edge: what a call passes before an endpoint of
:mod:`kvprefetch.controlplane.live.http_api` sees it, in the order it is checked.

1. The bearer token, from the headers alone: a call without a valid one is answered 401
   before any of its body is read (the connection is then closed). A connection that
   passes it is proven (:mod:`~kvprefetch.controlplane.live.http_conn`).
2. The caller's rate (``rate_limit_calls_per_s``, a token bucket per caller; see
   :class:`CallRate`): a call past it is answered 429 with ``Retry-After``, unread.
3. The body's declared length against ``max_body_bytes`` (413); a batch of calls
   (``/v1/events``) against ``large_body_bytes``, so that a batch is never large.
4. A large body of a caller whose refused bodies have spent its budget is answered 429
   (with ``Retry-After``) from its headers, unread; see :class:`RefusalBudget`.
5. A large body (over ``large_body_bytes``, or of unknown length) waits for one of its
   caller's ``max_large_bodies_per_caller`` turns (429 after ``body_read_timeout_s``),
   so that one tenant's heavy calls queue behind each other and not in front of other
   tenants' calls.
6. The body is read within ``body_read_timeout_s`` and, after ``body_rate_grace_s``, at
   ``min_body_rate_bytes_per_s`` or faster (408 otherwise), never past
   ``max_body_bytes`` (413), and while it arrives its commas, brackets and braces are
   counted: a body with more list items or nested values than any valid call carries is
   refused (422) without reading the rest (a batch may nest :data:`BATCH_ITEM_NESTING`
   values per item, for ``max_batch_events`` items); so is a body with a run of more than
   :data:`MAX_NUMBER_DIGITS` digits (a number no field takes, and one whose decoding alone
   would cost time quadratic in its length), naming the field.

Every body of an operation refused as it is read or validated (400, 408, 413, 422), small
ones included, is charged to its caller's :class:`RefusalBudget`; only large bodies are held
back while it is spent.

Limits are :class:`~kvprefetch.controlplane.live.limits.RequestLimits`. Every refusal is
the API's error body, ``{"error", "detail"}`` (and ``errors`` for a 422), with
``Connection: close``. The caller's :class:`~kvprefetch.controlplane.live.tenants.Principal`
is handed on in ``scope["state"]["principal"]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Collection
from typing import Any

from kvprefetch.controlplane.base.errors import UnauthorizedError
from kvprefetch.controlplane.live.http_conn import PROVEN_STATE
from kvprefetch.controlplane.live.limits import RequestLimits
from kvprefetch.controlplane.live.tenants import Principal, Role, TenantAuth

#: Members, nested objects and lists a valid call has besides its list items (a bound
#: with room to spare: the largest call has about ten members and one nested object).
STRUCTURE_SLACK = 64
#: Longest run of digits a body may carry: above any valid number (token ids have at most
#: 19 digits) and any string field made of digits (session ids have at most 256
#: characters), far below the 4,300 digits past which Python refuses to decode an integer.
MAX_NUMBER_DIGITS = 320
_DIGIT_RUN = b"d" * (MAX_NUMBER_DIGITS + 1)
#: Digits as ``d``, anything else as a space: a long digit run is then one ``bytes.find``.
_DIGITS_AS_D = bytes(0x64 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_KEY_BEFORE = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"\s*:')
#: Nested lists and objects one item of a batch has at most (the item, its hint, its
#: ``token_ids`` or ``chunk_hashes``), with one to spare.
BATCH_ITEM_NESTING = 4
#: Where the principal is handed on to the app (``request.state.principal``).
PRINCIPAL_STATE = "principal"
#: Answers that refuse a body the edge or the endpoint has read (in part): a large one is
#: charged to its caller's :class:`RefusalBudget`.
REFUSED_BODY_STATUSES = frozenset({400, 408, 413, 422})


def bearer_token(headers: Collection[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None: none, or another
    scheme), as :class:`fastapi.security.HTTPBearer` reads it."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def caller_key(principal: Principal) -> str:
    """Whose turns a call takes: its tenant's for a tenant token; otherwise one set each
    for the admin token, the shared token and anonymous callers."""
    if principal.role is Role.TENANT and principal.tenant is not None:
        return f"tenant:{principal.tenant}"
    return principal.role.value


class RefusalBudget:
    """Bytes of refused bodies one caller may still send: a bucket of ``burst_bytes``
    refilled at ``bytes_per_s``, into which each refused body is charged (its declared
    length, else the bytes read). While the bucket is empty or in
    debt, the caller's large bodies are refused unread, so the bytes an abusive caller
    makes the edge receive, parse and validate are bounded by ``burst_bytes`` plus
    ``bytes_per_s`` over time, and the event loop and interpreter it shares with every
    other caller stay free for them. Valid bodies are never charged, and small bodies never
    held back. ``now`` is the event loop's clock, in seconds."""

    def __init__(self, burst_bytes: int, bytes_per_s: int, now: float) -> None:
        self.burst_bytes = burst_bytes
        self.bytes_per_s = bytes_per_s
        self._left = float(burst_bytes)
        self._at = now

    def wait_s(self, now: float) -> float:
        """Seconds until the caller may send a large body again (0: it may now)."""
        self._refill(now)
        return 0.0 if self._left > 0 else (1.0 - self._left) / self.bytes_per_s

    def charge(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self._left -= nbytes

    def _refill(self, now: float) -> None:
        self._left = min(float(self.burst_bytes),
                         self._left + (now - self._at) * self.bytes_per_s)
        self._at = now


class CallRate:
    """One caller's calls: a token bucket of ``burst_calls`` refilled at ``calls_per_s``;
    each call takes one token. ``now`` is the event loop's clock, in seconds."""

    def __init__(self, calls_per_s: float, burst_calls: int, now: float) -> None:
        self.calls_per_s = calls_per_s
        self.burst_calls = burst_calls
        self._left = float(burst_calls)
        self._at = now

    def take(self, now: float) -> float:
        """Take a token: 0 when there was one, else the seconds until there is (nothing
        taken)."""
        self._left = min(float(self.burst_calls),
                         self._left + (now - self._at) * self.calls_per_s)
        self._at = now
        if self._left >= 1.0:
            self._left -= 1.0
            return 0.0
        return (1.0 - self._left) / self.calls_per_s


class _Refused(Exception):
    """Answer the call with this status and error body and close the connection."""

    def __init__(self, status: int, error: str, detail: str,
                 errors: list[dict[str, str]] | None = None, retry_after_s: float = 0.0
                 ) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail, self.errors = status, error, detail, errors
        self.retry_after_s = retry_after_s


class EdgeGuard:
    """ASGI middleware checking every ``POST`` (see the module docstring): the token for
    ``operations`` (paths), the body's size, pace and shape for all. One instance per app;
    its per-caller turns and refusal budgets live as long as the app (one small entry
    per caller)."""

    def __init__(self, app: Any, *, auth: TenantAuth, limits: RequestLimits,
                 operations: Collection[str], batches: Collection[str] = ()) -> None:
        self.app = app
        self.auth = auth
        self.limits = limits
        self.operations = frozenset(operations) | frozenset(batches)
        #: Operations whose body is a batch of calls: at most ``large_body_bytes`` (so
        #: never large) and up to ``max_batch_events`` objects of a few nested values.
        self.batches = frozenset(batches)
        self.max_items = limits.max_token_ids + limits.max_chunk_hashes + STRUCTURE_SLACK
        self.max_batch_nesting = STRUCTURE_SLACK + BATCH_ITEM_NESTING * limits.max_batch_events
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._budgets: dict[str, RefusalBudget] = {}
        self._rates: dict[str, CallRate | None] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        path = scope["path"]
        operation = path in self.operations
        batch = path in self.batches
        cap = self.limits.large_body_bytes if batch else self.limits.max_body_bytes
        try:
            principal = self._authenticate(path, headers)
            if operation:
                scope.setdefault("state", {})[PROVEN_STATE] = True
                self._take_call(principal)
            declared = self._declared_length(headers, cap, batch)
        except _Refused as refusal:
            await _answer(send, refusal)
            return
        turns: asyncio.Semaphore | None = None
        caller = caller_key(principal)
        large = declared is None or declared > self.limits.large_body_bytes
        budget = self._budget(caller) if operation or large else None
        if budget is not None and large:
            wait_s = budget.wait_s(asyncio.get_running_loop().time())
            if wait_s > 0:
                await _answer(send, _Refused(
                    429, "TooManyRefusedBodiesError",
                    "the caller's large bodies refused lately exceed its budget "
                    f"(refused_body_burst_bytes={self.limits.refused_body_burst_bytes}, "
                    f"refused_body_bytes_per_s={self.limits.refused_body_bytes_per_s}): "
                    f"retry in {wait_s:.1f} s", retry_after_s=wait_s))
                return
            turns = self._turns.setdefault(
                caller, asyncio.Semaphore(self.limits.max_large_bodies_per_caller))
            try:
                await asyncio.wait_for(turns.acquire(), self.limits.body_read_timeout_s)
            except TimeoutError:
                await _answer(send, _Refused(
                    429, "TooManyLargeBodiesError",
                    f"the caller has {self.limits.max_large_bodies_per_caller} large "
                    "bodies in progress (max_large_bodies_per_caller): retry later"))
                return
        size = [0]
        try:
            try:
                body = await self._read(receive, size, cap, batch)
            except _Refused as refusal:
                if budget is not None:
                    budget.charge(declared or size[0], asyncio.get_running_loop().time())
                await _answer(send, refusal)
                return
            if body is None:  # the client went away: an answer for the log and metrics only
                await _answer(send, _Refused(400, "ClientDisconnectedError",
                                             "the client closed the connection before the "
                                             "body arrived"))
                return
            scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
            delivered = False

            async def replay() -> Any:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            if budget is None:
                await self.app(scope, replay, send)
                return
            charged = budget

            async def charge_refusals(message: Any) -> None:
                if (message["type"] == "http.response.start"
                        and message["status"] in REFUSED_BODY_STATUSES):
                    charged.charge(len(body), asyncio.get_running_loop().time())
                await send(message)

            await self.app(scope, replay, charge_refusals)
        finally:
            if turns is not None:
                turns.release()

    def _budget(self, caller: str) -> RefusalBudget:
        budget = self._budgets.get(caller)
        if budget is None:
            budget = self._budgets[caller] = RefusalBudget(
                self.limits.refused_body_burst_bytes, self.limits.refused_body_bytes_per_s,
                asyncio.get_running_loop().time())
        return budget

    def _take_call(self, principal: Principal) -> None:
        """Take one of the caller's calls from its rate (429 past it)."""
        caller = caller_key(principal)
        now = asyncio.get_running_loop().time()
        if caller not in self._rates:
            limit = self.limits.rate_limit_for(
                principal.tenant if principal.role is Role.TENANT else None)
            self._rates[caller] = None if limit is None else CallRate(*limit, now)
        rate = self._rates[caller]
        if rate is None:
            return
        wait_s = rate.take(now)
        if wait_s > 0:
            raise _Refused(429, "TooManyCallsError",
                           f"the caller's calls exceed its rate of {rate.calls_per_s:g} calls/s "
                           f"(burst {rate.burst_calls}; rate_limit_calls_per_s, "
                           f"tenant_rate_limits_calls_per_s): retry in {wait_s:.2f} s",
                           retry_after_s=wait_s)

    def _authenticate(self, path: str, headers: Any) -> Principal:
        if path not in self.operations:
            return Principal(Role.ANONYMOUS)  # not an operation: FastAPI answers 404/405
        try:
            return self.auth.authenticate(bearer_token(headers))
        except UnauthorizedError as exc:
            raise _Refused(401, "UnauthorizedError", str(exc)) from None

    def _declared_length(self, headers: Any, cap: int, batch: bool) -> int | None:
        for name, value in headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return None
                if declared > cap:
                    raise _Refused(413, "RequestTooLargeError",
                                   _too_large(declared, "", cap, batch))
                return declared
        return None

    async def _read(self, receive: Any, read: list[int], cap: int,
                    batch: bool) -> bytes | None:
        """The whole body within the limits (None: the client disconnected), at most
        ``cap`` bytes; ``read[0]``: the bytes read so far. ``batch``: the body is a batch
        of calls (more nested objects allowed)."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks: list[bytes] = []
        size = commas = nesting = 0
        max_nesting = self.max_batch_nesting if batch else STRUCTURE_SLACK
        digits = b""  # the digits that end the body so far (a run may span chunks)
        while True:
            deadline = started + limits.body_read_timeout_s
            if limits.min_body_rate_bytes_per_s > 0:
                deadline = min(deadline, started + limits.body_rate_grace_s
                               + size / limits.min_body_rate_bytes_per_s)
            try:
                # A timeout scope, not wait_for: no task per message on Python 3.11.
                async with asyncio.timeout_at(max(deadline, loop.time())):
                    message = await receive()
            except TimeoutError:
                raise _Refused(408, "RequestTimeoutError", _too_slow(
                    size, loop.time() - started, limits)) from None
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            read[0] = size
            if size > cap:
                raise _Refused(413, "RequestTooLargeError", _too_large(
                    size, "at least ", cap, batch))
            commas += chunk.count(b",")
            nesting += chunk.count(b"[") + chunk.count(b"{")
            if commas > self.max_items or nesting > max_nesting:
                what = (f"more than {self.max_items} list items" if commas > self.max_items
                        else f"more than {max_nesting} nested lists or objects")
                raise _Refused(422, "InvalidRequestError",
                               f"invalid body: {what} (no valid call has as many)",
                               [{"loc": "(root)", "msg": f"the body has {what}",
                                 "type": "too_long"}])
            marked = (digits + chunk).translate(_DIGITS_AS_D)
            at = marked.find(_DIGIT_RUN)
            if at >= 0:
                raise _long_number(chunks, chunk, at - len(digits))
            tail = len(marked) - len(marked.rstrip(b"d"))
            digits = (digits + chunk)[-tail:] if tail else b""
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _long_number(chunks: list[bytes], chunk: bytes, at: int) -> _Refused:
    """The 422 of a body with a digit run over :data:`MAX_NUMBER_DIGITS` at ``at`` in
    ``chunk`` (negative: it began in the chunks before), naming the member it is in."""
    field = "(root)"
    before = chunk[:max(at, 0)]
    for part in (before, *reversed(chunks)):
        keys = _KEY_BEFORE.findall(part)
        if keys:
            field = keys[-1].decode()
            break
    msg = (f"a number of more than {MAX_NUMBER_DIGITS} digits (no valid call has one; "
           "integers are 0..max_token_id at most)")
    return _Refused(422, "InvalidRequestError", f"invalid body: {field}: {msg}",
                    [{"loc": field, "msg": msg, "type": "too_long"}])


def _too_large(size: int, at_least: str, limit: int, batch: bool = False) -> str:
    if batch:
        return (f"a batch body of {at_least}{size} bytes is larger than the limit of "
                f"{limit} bytes (large_body_bytes): send fewer events per batch")
    return (f"request body of {at_least}{size} bytes is larger than the limit of {limit} "
            "bytes (max_body_bytes)")


def _too_slow(size: int, elapsed_s: float, limits: RequestLimits) -> str:
    return (f"the request body did not arrive in time: {size} bytes in {elapsed_s:.1f} s "
            f"(body_read_timeout_s={limits.body_read_timeout_s:g}, "
            f"min_body_rate_bytes_per_s={limits.min_body_rate_bytes_per_s} after "
            f"body_rate_grace_s={limits.body_rate_grace_s:g})")


async def _answer(send: Any, refusal: _Refused) -> None:
    body: dict[str, Any] = {"error": refusal.error, "detail": refusal.detail}
    if refusal.errors is not None:
        body["errors"] = refusal.errors
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if refusal.retry_after_s > 0:
        headers.append((b"retry-after", str(math.ceil(refusal.retry_after_s)).encode()))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

