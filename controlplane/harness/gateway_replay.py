"""Replays a trace through the OpenAI-compatible gateway over HTTP, timing each request's
first token at the client: the client side of ``kvprefetch demo --engine vllm``.

The arrival process is :class:`~kvprefetch.controlplane.harness.replay.Replayer`'s (closed loop on a
compressed wall clock, client hints sent to the scheduler at their planned times); what
differs is one request: instead of calling the scheduler and an emulated engine, the
replayer sends ``POST /v1/completions`` (streaming) to the gateway with the session in the
``X-Session-ID`` header, and the gateway does the rest (route, forward to the chosen node's
vLLM, store the token ids, ``request_finished``). TTFT is from sending the request to the
first streamed event that carries a choice, at the client.

Prompts are token ids (the tiny model's byte tokens, 0-255), one growing context per
session, as a conversation re-sends it: request ``k`` is the first ``reused_tokens`` of
request ``k - 1``'s prompt followed by new tokens up to ``input_tokens`` (the trace's counts,
already scaled to the engine's window by the caller). New tokens are drawn from a generator
seeded by ``(salt, session, turn)``: the same salt replays the same prompts, another salt
gives contents no cache has seen (each policy's run gets its own, so no run finds the
previous run's KV).

Records are in wall seconds since the replay started (arrival on the replay's wall clock,
first token ``arrival + TTFT``); ``stall`` and ``local_tokens`` are unknown at the client
(0). A request whose streamed text is empty (a random-weight model may emit nothing
printable) is counted in :attr:`GatewayReplayResult.empty_text`, not as a failure.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvprefetch.agents.engine_emulator import ServeRequest, ServeResult
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.harness.replay import Replayer, ReplayResult
from kvprefetch.controlplane.live.client import Client
from kvprefetch.controlplane.sim.hints import PlannedHint
from kvprefetch.controlplane.sim.simulator import RequestRecord

log = logging.getLogger(__name__)

#: Token ids a prompt is drawn from: the tiny model's byte tokens (special tokens lie above).
BYTE_TOKENS = 256


@dataclass
class GatewayReplayResult(ReplayResult):
    """:class:`ReplayResult` plus what only an HTTP client sees."""

    #: Requests answered 200 whose streamed text was empty (counted apart from failures).
    empty_text: int = 0
    #: Non-200 answers and transport errors, by reason (each also counts in ``failed``).
    errors: dict[str, int] | None = None
    #: Requests per node, as the gateway's ``X-KVP-Node`` header said.
    per_node: dict[int, int] | None = None


def scale_trace(trace: Trace, token_scale: float, window: int, max_output_tokens: int
                ) -> Trace:
    """The trace with every token count multiplied by ``token_scale`` (rounded, at least 1
    input token), outputs capped at ``max_output_tokens`` and contexts at ``window``
    tokens (input + output): what a small engine replays of a long-context trace."""
    if not 0 < token_scale <= 1:
        raise ValueError("token_scale must be in (0, 1]")
    if window <= max_output_tokens + 1:
        raise ValueError("window must exceed max_output_tokens + 1")
    sessions = []
    for s in trace.sessions:
        reqs = []
        for r in s.requests:
            out = max(1, min(max_output_tokens, round(r.output_tokens * token_scale)))
            inp = max(1, min(window - out, round(r.input_tokens * token_scale)))
            reused = min(inp - 1, round(r.reused_tokens * token_scale)) if r.turn else 0
            reqs.append(replace(r, input_tokens=inp, output_tokens=out,
                                reused_tokens=max(0, reused)))
        sessions.append(replace(s, requests=tuple(reqs)))
    return replace(trace, sessions=tuple(sessions))


class PromptBook:
    """Each session's prompt token ids, turn by turn (see the module docstring).
    Thread-safe; a session's turns are asked for in order."""

    def __init__(self, salt: str) -> None:
        self.salt = salt
        self._last: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def prompt(self, session_id: str, request: TraceRequest) -> list[int]:
        with self._lock:
            previous = self._last.get(session_id, [])
        kept = previous[:request.reused_tokens]
        rng = random.Random(f"{self.salt}/{session_id}/{request.turn}")
        ids = kept + [rng.randrange(BYTE_TOKENS)
                      for _ in range(request.input_tokens - len(kept))]
        with self._lock:
            self._last[session_id] = ids
        return ids


class GatewayReplayer(Replayer):
    """:class:`Replayer` whose requests go through the gateway at ``gateway_url`` (see the
    module docstring). ``client`` is the scheduler's client, for the hints only."""

    def __init__(self, trace: Trace, client: Client, gateway_url: str, model: str, *,
                 compression: float, nodes: int, salt: str,
                 timeout_s: float = 300.0, workers: int = 32,
                 progress: Callable[[int], None] | None = None,
                 stop: threading.Event | None = None,
                 hints: Sequence[PlannedHint] = ()) -> None:
        super().__init__(trace, client, self._no_engine, compression=compression, nodes=nodes,
                         workers=workers, progress=progress, stop=stop, hints=hints)
        import httpx

        self.gateway_url = gateway_url.rstrip("/")
        self.model = model
        self.prompts = PromptBook(salt)
        self._http = httpx.Client(timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=workers))
        self._out = GatewayReplayResult(errors={}, per_node={})

    @staticmethod
    def _no_engine(node: int, request: ServeRequest) -> ServeResult:
        raise RuntimeError("the gateway replayer serves through HTTP")

    def run(self) -> GatewayReplayResult:
        try:
            super().run()
        finally:
            self._http.close()
        assert isinstance(self._out, GatewayReplayResult)
        return self._out

    def _serve_one(self, session: TraceSession, req: TraceRequest, arrival_wall: float) -> None:
        sid = session.session_id
        prompt = self.prompts.prompt(sid, req)
        sent = time.time()
        answer = self._send(sid, prompt, req.output_tokens)
        done = time.time()
        out = self._out
        assert isinstance(out, GatewayReplayResult) and out.errors is not None
        assert out.per_node is not None
        if answer.error:  # Replayer._one counts it failed and drops the session's rest
            with self._cv:
                out.errors[answer.error] = out.errors.get(answer.error, 0) + 1
            raise RuntimeError(f"{sid}/{req.turn}: {answer.error}")
        first = answer.first_token_wall_s if answer.first_token_wall_s else done
        arrival = sent - self._t0
        ttft = first - sent
        record = RequestRecord(sid, req.turn, answer.node, arrival, arrival, arrival,
                               arrival + ttft, req.reused_tokens > 0, 0.0, req.reused_tokens,
                               0)
        result = ServeResult(sid, req.turn, answer.node, sent, sent, sent, first, done,
                             req.reused_tokens, 0, 0, 0, 0, 0.0,
                             route_overhead_s=answer.headers_wall_s - sent)
        with self._cv:
            out.records.append(record)
            out.results.append(result)
            out.per_node[answer.node] = out.per_node.get(answer.node, 0) + 1
            if not answer.text:
                out.empty_text += 1
        self._turn_done(session, req.turn, time.time())

    def _send(self, session_id: str, prompt: list[int], max_tokens: int) -> _Answer:
        import httpx

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "temperature": 0.0, "ignore_eos": True}
        answer = _Answer()
        try:
            with self._http.stream("POST", f"{self.gateway_url}/v1/completions", json=body,
                                   headers={"X-Session-ID": session_id}) as response:
                answer.headers_wall_s = time.time()
                if response.status_code != 200:
                    response.read()
                    answer.error = f"HTTP {response.status_code}"
                    log.warning("%s: gateway answered %d: %s", session_id,
                                response.status_code, response.text[:300])
                    return answer
                answer.node = int(response.headers.get("x-kvp-node", "-1"))
                for line in response.iter_lines():
                    _observe(line, answer)
        except httpx.HTTPError as exc:
            answer.error = type(exc).__name__
            log.warning("%s: %r", session_id, exc)
        if not answer.error and not answer.done:
            answer.error = "stream ended without [DONE]"
        return answer


@dataclass
class _Answer:
    node: int = -1
    headers_wall_s: float = 0.0
    first_token_wall_s: float = 0.0
    text: str = ""
    done: bool = False
    error: str = ""


def _observe(line: str, answer: _Answer) -> None:
    """One server-sent event line: note the first choice's arrival, its text, the end."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        answer.done = True
        return
    try:
        event: dict[str, Any] = json.loads(data)
    except ValueError:
        return
    choices = event.get("choices") or []
    if choices and not answer.first_token_wall_s:
        answer.first_token_wall_s = time.time()
    for choice in choices:
        answer.text += choice.get("text") or ""
