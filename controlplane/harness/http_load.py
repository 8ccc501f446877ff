"""The HTTP API under load from a separate process (``kvprefetch bench control-plane
--modes http``).

:func:`drive` runs this module as a child process (``python -m``) that plays sessions
against the HTTP API at ``base_url``: at each caller count in turn, that many asyncio
callers, each on its own persistent HTTP/1.1 connection (a lean client of asyncio
streams, so that the generator takes as little of the shared cores as it can), each
looping over its own sessions (caller ``c`` of ``n`` plays sessions ``c, c + n, ...``):
``POST /v1/route`` then ``POST /v1/request_finished`` on the node it answered, closed
loop (the next call leaves when the previous one answered). With ``batch_events`` the
finishes are queued instead and go in batches (``POST /v1/events``, see
:class:`_Batches`), as a gateway batching its events sends them. Before the first count every
session plays its first turn (not measured). A session replays a trace session's turns
(``plays``: input, reused, output tokens and stop reason per turn), cycling.

Per caller count it reports events per second (a route and a finish are an event each),
route latency p50/p99 as the caller sees it, lost events (an error status, a route with
no node, a finish not accepted) and the child's CPU seconds while measuring (with the
server on the same cores, a generator near one core busy is the bound, not the server).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvprefetch.controlplane.base.errors import ConfigError

#: A turn as the child plays it: input, reused and output tokens, stop reason.
Play = tuple[int, int, int, str | None]
#: Callers of the populate pass (not measured).
POPULATE_CALLERS = 32
#: ``http-batch``: finishes per batch at most, and how often the queued ones are sent.
BATCH_EVENTS = 64
FLUSH_S = 0.005


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One caller count's measurement."""

    callers: int
    events: int
    seconds: float
    events_per_s: float
    route_p50_ms: float
    route_p99_ms: float
    lost_events: int
    #: CPU seconds of the load generator's process while measuring, per wall second.
    generator_cores: float
    #: ``POST /v1/events`` calls that carried the finishes (0: each finish a call).
    event_batches: int = 0


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered))))]


def drive(base_url: str, *, callers: Sequence[int], events: int, sessions: int,
          plays: Sequence[Sequence[Play]], seed: int = 0, timeout_s: float = 30.0,
          token: str | None = None, batch_events: int = 0) -> list[LevelResult]:
    """Run the load generator in a child process against ``base_url`` (see the module
    docstring); one result per caller count, in order. ``batch_events`` > 0: the finishes
    go in batches of up to that many (``POST /v1/events``). Raises :class:`ConfigError`
    for bad arguments and RuntimeError when the child fails."""
    if not callers or min(callers) < 1 or max(callers) > sessions:
        raise ConfigError(f"callers must be 1..{sessions} (the sessions), got {list(callers)}")
    if events < 2 or not plays or not all(plays):
        raise ConfigError("events must be >= 2 and every trace session needs a turn")
    if batch_events < 0:
        raise ConfigError(f"batch_events must be >= 0, got {batch_events}")
    spec = {"base_url": base_url, "callers": list(callers), "events": events,
            "sessions": sessions, "plays": [list(map(list, p)) for p in plays],
            "seed": seed, "timeout_s": timeout_s, "token": token,
            "batch_events": batch_events}
    budget_s = 600.0 + events * len(callers) * 0.05
    proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=budget_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the HTTP load generator failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    return [LevelResult(**r) for r in json.loads(proc.stdout)]


class _Sessions:
    """The sessions' turns (cycling over the trace sessions' plays)."""

    def __init__(self, plays: Sequence[Sequence[Sequence[Any]]], sessions: int) -> None:
        self._plays = [[(int(a), int(b), int(c), d) for a, b, c, d in p] for p in plays]
        self._turn = [0] * sessions

    def next(self, i: int) -> Play:
        plays = self._plays[i % len(self._plays)]
        k = self._turn[i]
        self._turn[i] = k + 1
        inp, reused, out, stop = plays[k % len(plays)]
        return inp, (reused if k % len(plays) else 0), out, stop


class _Connection:
    """One persistent HTTP/1.1 connection (a caller's): a JSON POST at a time, its answer
    read by ``Content-Length``. Lean on purpose: the generator shares the machine's cores
    with the server, and every CPU cycle it spends is one the server does not get."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self._host, self._port = host, port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in
                             {"Host": f"{host}:{port}", **headers}.items()).encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        """(status, the answer's JSON); reconnects once when the server closed it."""
        body = json.dumps(payload).encode()
        request = (f"POST {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode()
                   + self._head + b"\r\n" + body)
        for attempt in (0, 1):
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self._host,
                                                                           self._port)
            assert self._reader is not None
            try:
                self._writer.write(request)
                status_line = await self._reader.readline()
                if not status_line:
                    raise ConnectionResetError("closed by the server")
                length, close = 0, False
                while (line := await self._reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                data = await self._reader.readexactly(length)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
                continue
            if close:
                self.close()
            return int(status_line.split()[1]), json.loads(data) if data else None
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class _Batches:
    """The finishes of ``http-batch``: queued by the callers and sent in batches of up to
    ``size`` (``POST /v1/events``) by the caller that fills one, by a flusher every
    ``FLUSH_S``, and before a session whose finish is queued is routed again; that route
    waits until the batch carrying the finish is answered (its finish goes first, as one
    gateway's events would)."""

    def __init__(self, size: int, conn: _Connection) -> None:
        self.size = size
        self.conn = conn
        self.pending: list[dict[str, Any]] = []
        #: Sessions with a finish queued, and those whose finish is in a batch on its
        #: way (done when the batch is answered).
        self.sessions: set[str] = set()
        self.sending: dict[str, asyncio.Future[None]] = {}
        self.lost = 0
        self.batches = 0

    async def settle(self, sid: str, http: _Connection) -> None:
        """Return once no finish of ``sid`` is queued or on its way (sending the queue on
        ``http`` where one is queued)."""
        if sid in self.sessions:
            await self.send(http)
        done = self.sending.get(sid)
        if done is not None:
            await done

    def queue(self, finish: dict[str, Any]) -> bool:
        """Queue a finish; True when a batch is full (the caller sends it)."""
        self.pending.append({"op": "request_finished", **finish})
        self.sessions.add(finish["session_id"])
        return len(self.pending) >= self.size

    async def send(self, http: _Connection) -> None:
        """Send what is queued (on ``http``), counting the finishes not accepted."""
        while self.pending:
            batch, self.pending = self.pending[:self.size], self.pending[self.size:]
            sids = [e["session_id"] for e in batch]
            self.sessions.difference_update(sids)
            done = asyncio.get_running_loop().create_future()
            for sid in sids:
                self.sending[sid] = done
            try:
                status, answer = await http.post("/v1/events", {"events": batch})
            finally:
                for sid in sids:
                    if self.sending.get(sid) is done:
                        del self.sending[sid]
                done.set_result(None)
            self.batches += 1
            if status != 200 or not isinstance(answer, dict):
                self.lost += len(batch)
            else:
                self.lost += len(batch) - int(answer.get("accepted", 0))

    async def flusher(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(FLUSH_S)
            await self.send(self.conn)


async def _turn(http: _Connection, sid: str, play: Play, routes: list[float] | None,
                batches: _Batches | None = None) -> int:
    """One turn: route, then finish on the node it answered (queued in ``batches`` where
    given). Returns the events lost (a queued finish's loss is counted when sent)."""
    inp, reused, out, stop = play
    if batches is not None:
        await batches.settle(sid, http)
    body = {"session_id": sid, "input_tokens": inp, "reused_tokens": reused}
    began = time.perf_counter()
    status, answer = await http.post("/v1/route", body)
    if routes is not None:
        routes.append(time.perf_counter() - began)
    node = answer.get("node") if status == 200 and isinstance(answer, dict) else None
    if node is None:
        return 2
    finish: dict[str, Any] = {"session_id": sid, "node": node, "input_tokens": inp,
                              "output_tokens": out}
    if stop is not None:
        finish["stop_reason"] = stop
    if batches is not None:
        if batches.queue(finish):
            await batches.send(http)
        return 0
    status, answer = await http.post("/v1/request_finished", finish)
    return 0 if status == 200 and isinstance(answer, dict) and answer.get("accepted") else 1


async def _level(conns: list[_Connection], turns: _Sessions, n: int, total_turns: int,
                 sessions: int, seed: int, routes: list[float] | None,
                 batches: _Batches | None = None) -> int:
    """``total_turns`` turns over ``n`` callers (their finishes in ``batches`` where
    given, every one sent before this returns); the events lost."""
    left = [total_turns]
    lost = [0]

    async def caller(c: int) -> None:
        mine = list(range(c, sessions, n))
        rng = random.Random(seed + 7919 * c)
        while left[0] > 0:
            left[0] -= 1
            i = mine[rng.randrange(len(mine))]
            lost[0] += await _turn(conns[c], f"bench-{i}", turns.next(i), routes, batches)

    if batches is None:
        await asyncio.gather(*(caller(c) for c in range(n)))
        return lost[0]
    stop = asyncio.Event()
    flusher = asyncio.ensure_future(batches.flusher(stop))
    lost_before = batches.lost
    try:
        await asyncio.gather(*(caller(c) for c in range(n)))
    finally:
        stop.set()
        await flusher
    await batches.send(batches.conn)
    return lost[0] + batches.lost - lost_before


async def _populate(conns: list[_Connection], turns: _Sessions, sessions: int) -> None:
    queue = list(range(sessions))

    async def caller(c: int) -> None:
        while queue:
            i = queue.pop()
            await _turn(conns[c], f"bench-{i}", turns.next(i), None)

    await asyncio.gather(*(caller(c) for c in range(min(POPULATE_CALLERS, sessions))))


async def _run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from urllib.parse import urlsplit

    callers: list[int] = spec["callers"]
    sessions: int = spec["sessions"]
    turns = _Sessions(spec["plays"], sessions)
    headers = {"Content-Type": "application/json"}
    if spec.get("token"):
        headers["Authorization"] = f"Bearer {spec['token']}"
    url = urlsplit(spec["base_url"])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    conns = [_Connection(host, port, headers)
             for _ in range(max(max(callers), POPULATE_CALLERS) + 1)]
    size = int(spec.get("batch_events") or 0)
    # The flusher's connection is the last one (no caller's).
    batches = _Batches(size, conns[-1]) if size else None
    out = []
    try:
        await asyncio.wait_for(_populate(conns, turns, sessions), spec["timeout_s"] * sessions)
        for n in callers:
            routes: list[float] = []
            total_turns = spec["events"] // 2
            sent = batches.batches if batches is not None else 0
            cpu = time.process_time()
            began = time.perf_counter()
            lost = await _level(conns, turns, n, total_turns, sessions, spec["seed"], routes,
                                batches)
            seconds = time.perf_counter() - began
            cpu = time.process_time() - cpu
            result = LevelResult(
                callers=n, events=2 * total_turns, seconds=round(seconds, 3),
                events_per_s=round(2 * total_turns / seconds, 1) if seconds > 0 else 0.0,
                route_p50_ms=round(quantile(routes, 0.5) * 1e3, 3),
                route_p99_ms=round(quantile(routes, 0.99) * 1e3, 3), lost_events=lost,
                generator_cores=round(cpu / seconds, 2) if seconds > 0 else 0.0,
                event_batches=(batches.batches if batches is not None else 0) - sent)
            out.append(asdict(result))
    finally:
        for conn in conns:
            conn.close()
    return out


def main() -> int:
    """The child: the spec as JSON on stdin, the results as JSON on stdout."""
    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_run(spec))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
