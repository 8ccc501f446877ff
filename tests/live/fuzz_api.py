"""``make fuzz``: schemathesis against the HTTP API served locally with two tenants.

    python tests/live/fuzz_api.py --cases 5000 --json out/fuzz.json

Starts a server in a child process (``serve`` below: the scheduler service in that process,
no Ray and no agents, behind the app ``kvprefetch serve`` builds from a serve config with
two tenants, acme and globex, whose tokens are read from files, and an admin token read
from the environment), generates cases for every operation of its OpenAPI document in
positive and negative mode, sends each with acme's token, stops the server, and writes::

    {"cases": int, "server_errors": int, "undocumented": int,
     "cross_tenant_successes": int, ...}

* ``cases``: generated requests sent (acme's; in boundary mode below, both tenants'); the
  replays below are not counted in it.
* ``server_errors``: answers 5xx.
* ``undocumented``: answers that fail schemathesis' conformance checks (a status the
  OpenAPI document does not list for the operation, a wrong content type, a body or
  headers that do not match the documented schema).
* ``cross_tenant_successes``: after every case whose ``session_id`` names a live session
  of acme's, the same call is replayed with globex's token (the body's ``tenant`` left out,
  so that it is a valid globex call), and once more with the body naming acme. Counted:
  a 2xx to a call that needs an existing session (``session_state``, ``hint``,
  ``request_finished``, ``session_closed``: globex holds no session by that id, since the
  fuzzer closes each one its replays open), a 2xx to the forged-tenant replay, and any
  change of acme's session (read with acme's token before and after the replay).

To reach the service rather than stop at validation, in 3 of 4 positive cases the body's
``tenant`` is dropped (acme's calls are then acme's) and a route's or request_started's
size is made consistent (the one rule the schema cannot state), and in 8 of 9 positive
cases the session id is taken from a pool of 8 (so events land on live sessions).
Deterministic per ``--seed``.

**Stateful mode** (``--stateful-cases``, a share of ``--cases``): schemathesis' state
machine (``schema.as_state_machine()``) over the same document with OpenAPI links added
(:data:`LINKS`: each call of a session leads to the session's next calls, the session id
taken from the request, a route's node from its answer), so scenarios run sequences such
as route -> request_finished -> hint -> session_closed on one session, which independent
cases rarely reach. Each step is a case, counted and checked as above (and replayed as
globex); the JSON adds ``stateful``: its cases, scenarios, ``transitions`` (pairs of
consecutive 2xx answers on one session within a scenario, by operation), ``lifecycles``
(sessions that went opened -> request_finished -> hint -> session_closed, all 2xx, in that
order within one scenario) and ``restarts`` (runs Hypothesis stopped as flaky because the
server's state made a replayed prefix take another path; the next seed goes on).

**Boundary mode** (``--boundary-cases``, a share of ``--cases``; run first, on a fresh
server): schemathesis' coverage phase (``schema.iter_coverage_cases``, the cases its
``coverage`` phase sends) over every operation, in positive and negative mode: each
field's boundaries taken from the document (minimum and maximum lengths and values, the
values just outside them, an empty and a maximum-length list, every enum value and a
wrong one, null, wrong types, missing required fields, unexpected properties, methods the
document does not list, a missing or unusable body or content type, no bearer token),
plus the lists too long for schemathesis to build (``token_ids`` at ``maxItems`` and one
past it, each id at the document's maximum). Operations run in :data:`BOUNDARY_ORDER`, so
that the sessions route's cases open are live for the events' cases. Each case is sent
with acme's token and again with globex's (both count; the case without a token once); in
a positive case the body's ``tenant`` becomes the caller's (unless the case is about
``tenant``) and a route's size is made consistent without touching the field under test.
Each answer is checked as above (5xx, conformance, replayed as the other tenant, with a
2xx not counted where the other tenant holds its own session by that id) and by
schemathesis' checks for these cases: invalid data is refused with 4xx, a method the
document does not list answers 405 with ``Allow``, a call without a token answers 401
(``boundary.rule_violations``, which must be 0 too). The JSON adds ``boundary_cases`` and
``boundary``: its cases, the distinct cases generated, the cases per scenario and the
rule violations. With fewer ``--boundary-cases`` than the pass has, an even spread of its
cases is sent.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

TOKENS = {"acme": "fuzz-acme-token-0123456789", "globex": "fuzz-globex-token-0123456789"}
ADMIN_ENV = "KVPREFETCH_FUZZ_ADMIN_TOKEN"
ADMIN = "fuzz-admin-token-0123456789"
POOL = [f"s{i}" for i in range(8)]
#: Nodes of the served fleet (``serve`` below).
NODES = 2
#: Operations that need a live session of the caller's tenant.
NEEDS_SESSION = {"session_state", "hint", "request_finished", "session_closed"}
#: Stateful mode: the calls that may follow each call of a session (OpenAPI links from its
#: 200 answer, the session id taken from the request). session_state leads nowhere: an
#: operation with links out may start a scenario, and schemathesis starts them only from
#: the operations it deems likely to succeed with random data when there are any (a read
#: of a random session would be the only one).
LINKS = {
    "route": ("request_finished", "hint", "session_closed"),
    "request_started": ("route", "request_finished", "hint"),
    "request_finished": ("hint", "route", "session_closed"),
    "hint": ("session_closed", "request_finished", "route"),
    "session_closed": ("session_state", "route"),
}
#: Boundary mode: the operations in the order their cases are sent (the sessions route's
#: cases open stay live for the events' cases and are read before session_closed's close
#: them).
BOUNDARY_ORDER = ("route", "request_started", "request_finished", "hint", "session_state",
                  "session_closed")
#: A session's life, in order, that a scenario should be able to walk (all 2xx).
LIFECYCLE = (("route", "request_started"), ("request_finished",), ("hint",),
             ("session_closed",))


# ---------------------------------------------------------------------------- the server
def write_config(folder: Path) -> Path:
    """A serve config with two tenants (tokens in files) and an admin (token in the
    environment); its stores and agent sections are required by the format and unused
    here (no agents)."""
    files = {}
    for tenant, token in TOKENS.items():
        files[tenant] = folder / f"{tenant}.token"
        files[tenant].write_text(token + "\n")
        files[tenant].chmod(0o600)
    import yaml

    cfg = {
        "stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
        "agent": {"tier_capacity_bytes": 64 << 20},
        "fleet": {"node": {"hbm_kv_bytes": 2 << 30, "dram_tier_bytes": 16 << 30}},
        "service": {"policy": "predictive", "predictor": "ewma",
                    "max_live_sessions_per_tenant": 100_000},
        "http": {"host": "127.0.0.1", "port": 0, "admin_token": {"env": ADMIN_ENV},
                 "call_timeout_s": 5.0,
                 "limits": {"max_body_bytes": 1 << 20, "max_token_ids": 50_000,
                            "max_chunk_hashes": 2048}},
        "tenants": {"acme": {"token": {"file": str(files["acme"])},
                             "max_live_sessions": 50_000},
                    "globex": {"token": {"file": str(files["globex"])},
                               "max_live_sessions": 100}},
    }
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def serve(config: Path) -> int:
    """The child process: serve until SIGTERM; prints ``ready <url>`` once listening."""
    from kvprefetch.controlplane.cli.serve import http_app
    from kvprefetch.controlplane.cli.serve_config import load_serve_config
    from kvprefetch.controlplane.live.http_api import HttpServer
    from kvprefetch.controlplane.live.metrics import PrometheusMetrics
    from kvprefetch.controlplane.live.service import SchedulerService

    cfg = load_serve_config(config)
    service_cfg = cfg.service_config([f"node-{i}" for i in range(NODES)])
    metrics = PrometheusMetrics()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with SchedulerService(service_cfg, metrics=metrics) as svc:
        app = http_app(cfg, svc, cfg.auth(), chunk_tokens=service_cfg.chunk_tokens,
                       metrics=metrics)
        with HttpServer(app, cfg.http.host, cfg.http.port) as srv:
            print(f"ready {srv.url}", flush=True)
            stop.wait()
    return 0


class Server:
    """The child process serving the API (started and stopped here)."""

    def __init__(self, folder: Path) -> None:
        self.config = write_config(folder)
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> Server:
        env = {**os.environ, ADMIN_ENV: ADMIN}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", "--config", str(self.config)],
            stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("ready "):
                self.url = line.split()[1]
                return self
            if not line and self.proc.poll() is not None:
                break
        self.__exit__()
        raise RuntimeError("the fuzz server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------- the fuzzer
class Tally:
    def __init__(self) -> None:
        self.cases = 0
        self.server_errors = 0
        self.undocumented = 0
        self.cross_tenant_successes = 0
        self.replays = 0
        self.statuses: dict[str, int] = {}
        self.examples: list[str] = []
        self.stateful_cases = 0
        self.scenarios = 0
        self.transitions: dict[str, int] = {}
        self.lifecycles = 0
        self.stateful_restarts = 0
        self.boundary_cases = 0
        self.boundary_generated = 0
        self.boundary_scenarios: dict[str, int] = {}
        self.rule_violations = 0

    def example(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text[:500])

    def result(self, seconds: float) -> dict[str, Any]:
        return {"cases": self.cases, "server_errors": self.server_errors,
                "undocumented": self.undocumented,
                "cross_tenant_successes": self.cross_tenant_successes,
                "cross_tenant_replays": self.replays,
                "statuses": dict(sorted(self.statuses.items())),
                "boundary_cases": self.boundary_cases,
                "boundary": {"cases": self.boundary_cases,
                             "generated": self.boundary_generated,
                             "scenarios": dict(sorted(self.boundary_scenarios.items())),
                             "rule_violations": self.rule_violations},
                "stateful": {"cases": self.stateful_cases, "scenarios": self.scenarios,
                             "transitions": dict(sorted(self.transitions.items())),
                             "lifecycles": self.lifecycles,
                             "restarts": self.stateful_restarts},
                "seconds": round(seconds, 1), "examples": self.examples}


class Fuzzer:
    def __init__(self, url: str, tally: Tally) -> None:
        import httpx
        import schemathesis
        from schemathesis.checks import not_a_server_error
        from schemathesis.specs.openapi.checks import (
            content_type_conformance,
            missing_required_header,
            negative_data_rejection,
            response_headers_conformance,
            response_schema_conformance,
            status_code_conformance,
            unsupported_method,
        )

        self.url = url
        self.tally = tally
        self.http = httpx.Client(base_url=url, timeout=30)
        self.schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        self.conformance = [status_code_conformance, content_type_conformance,
                            response_schema_conformance, response_headers_conformance]
        self.server_error = not_a_server_error
        #: boundary mode's own checks (schemathesis runs them in its coverage phase)
        self.boundary_rules = [negative_data_rejection, unsupported_method,
                               missing_required_header]
        #: stateful calls prepared so far (3 of 4 are made consistent, as positive cases)
        self._stateful_seq = 0

    def close(self) -> None:
        self.http.close()

    def _post(self, op: str, body: Any, tenant: str) -> Any:
        return self.http.post(f"/v1/{op}", json=body,
                              headers={"Authorization": f"Bearer {TOKENS[tenant]}"})

    def operations(self) -> list[Any]:
        results: list[Any] = list(self.schema.get_all_operations())
        return [r.ok() for r in results if r.ok().path.startswith("/v1/")]

    def run(self, operation: Any, mode: Any, examples: int, seed: int) -> None:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        from hypothesis import strategies as st

        op = operation.path.removeprefix("/v1/")
        positive = mode.value == "positive"

        @hseed(seed)
        @settings(max_examples=examples, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode),
               drop_tenant=st.sampled_from([True, True, True, False]),
               pooled=st.sampled_from([None, *POOL]))
        def fuzz(case: Any, drop_tenant: bool, pooled: str | None) -> None:
            if positive and isinstance(case.body, dict):
                body = dict(case.body)
                if drop_tenant:
                    body.pop("tenant", None)
                if pooled is not None and "session_id" in body:
                    body["session_id"] = pooled
                if drop_tenant and op in ("route", "request_started"):
                    _size_rule(body)
                case.body = body
            self.case(op, case)

        fuzz()

    def case(self, op: str, case: Any) -> None:
        self.check(op, case, self.call(case))

    def call(self, case: Any, tenant: str = "acme") -> Any:
        # random and stateful cases are acme's (schemathesis would generate bearer tokens
        # of its own; the 401 paths are tested in tests/live/test_tenants.py)
        auth = {"Authorization": f"Bearer {TOKENS[tenant]}"}
        case.headers = {**(case.headers or {}), **auth}
        return case.call(base_url=self.url, headers=auth)

    def check(self, op: str, case: Any, response: Any, tenant: str = "acme", *,
              other_may_hold: bool = False) -> None:
        """Count one answer to ``tenant``'s case, check it against the document, replay it
        as the other tenant (``other_may_hold``: who may hold a session by the same id)."""
        t = self.tally
        auth = {"Authorization": f"Bearer {TOKENS[tenant]}"}
        t.cases += 1
        key = f"{op} {response.status_code}"
        t.statuses[key] = t.statuses.get(key, 0) + 1
        if response.status_code >= 500:
            t.server_errors += 1
            t.example(f"5xx {op} {case.body!r:.200} -> {response.text}")
        try:
            case.validate_response(response, checks=self.conformance, headers=auth)
        except (Exception, BaseExceptionGroup) as exc:  # a failed check (one or a group)
            t.undocumented += 1
            t.example(f"undocumented {op} {response.status_code} {case.body!r:.200}: {exc}")
        if isinstance(case.body, dict):
            self.replay(op, case.body, tenant, _other(tenant), other_may_hold=other_may_hold)

    def replay(self, op: str, body: dict[str, Any], owner: str, intruder: str, *,
               other_may_hold: bool = False) -> None:
        """Replay ``owner``'s call as ``intruder`` (and once more naming ``owner``) when it
        names a live session of ``owner``'s; count what succeeds or changes that session.
        ``other_may_hold``: ``intruder`` may hold a session by the same id of its own (the
        boundary pass sends every case as both tenants), whose 2xx is then no success."""
        sid = body.get("session_id")
        if not isinstance(sid, str):
            return
        before = self._post("session_state", {"session_id": sid}, owner)
        if before.status_code != 200:
            return  # the owner has no live session by this id: nothing to steal
        holds = (other_may_hold and
                 self._post("session_state", {"session_id": sid}, intruder).status_code == 200)
        t = self.tally
        t.replays += 1
        as_intruder = {k: v for k, v in body.items() if k != "tenant"}
        answer = self._post(op, as_intruder, intruder)
        ok = 200 <= answer.status_code < 300
        if ok and op in NEEDS_SESSION and not holds:
            t.cross_tenant_successes += 1
            t.example(f"cross-tenant {op} {sid!r}: {answer.status_code} {answer.text}")
        if ok and op not in NEEDS_SESSION and not holds:  # it opened its own: close it
            closed = self._post("session_closed", {"session_id": sid}, intruder)
            if closed.status_code != 200:
                t.example(f"{intruder} could not close its own {sid!r}: {closed.text}")
        forged = self._post(op, {**as_intruder, "tenant": owner}, intruder)
        if 200 <= forged.status_code < 300:
            t.cross_tenant_successes += 1
            t.example(f"forged tenant {op} {sid!r}: {forged.status_code} {forged.text}")
        after = self._post("session_state", {"session_id": sid}, owner)
        if after.status_code != 200 or after.json() != before.json():
            t.cross_tenant_successes += 1
            t.example(f"{owner}'s {sid!r} changed by {intruder}'s {op}: {before.text} -> "
                      f"{after.status_code} {after.text}")

    # -- boundary mode -------------------------------------------------------------------
    def boundary_plan(self) -> list[BoundaryCase]:
        """Every operation's boundary cases (schemathesis' coverage phase, positive and
        negative), in :data:`BOUNDARY_ORDER`, with the over-long lists it leaves out."""
        from schemathesis import GenerationMode

        config = self.schema.config.generation_for(phase="coverage")
        operations = {o.path.removeprefix("/v1/"): o for o in self.operations()}
        plan: list[BoundaryCase] = []
        for op in BOUNDARY_ORDER:
            operation = operations[op]
            # generated once: the schema remembers the unexpected methods it has probed
            cases: list[Any] = list(self.schema.iter_coverage_cases(
                operation, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                generation_config=config))
            for case in cases:
                data = case.meta.phase.data
                plan.append(BoundaryCase(op, case, str(data.scenario), _target(data),
                                         case.meta.generation.mode.is_positive,
                                         data.parameter == "Authorization"
                                         and data.scenario == "missing_parameter"))
            plan += [c._replace(op=op) for c in _long_lists(operation, cases)]
        return plan

    def boundary(self, limit: int | None = None) -> None:
        """Send the boundary cases (about ``limit`` calls, an even spread, when given) as
        both tenants, check each answer, then close the sessions the pass opened."""
        t = self.tally
        plan = self.boundary_plan()
        t.boundary_generated = len(plan)
        if limit is not None and limit < 2 * len(plan):  # each case is sent twice
            keep = max(1, -(-limit // 2))
            plan = [plan[i * len(plan) // keep] for i in range(keep)]
        sids: set[str] = set()
        for b in plan:
            for tenant in ("acme",) if b.no_token else tuple(TOKENS):
                case = _copy(b.case)
                if isinstance(case.body, dict):
                    case.body = _aim(b.op, dict(case.body), tenant, b.target)
                response = (case.call(base_url=self.url) if b.no_token
                            else self.call(case, tenant))
                t.boundary_cases += 1
                t.boundary_scenarios[b.scenario] = t.boundary_scenarios.get(b.scenario, 0) + 1
                self.check(b.op, case, response, tenant, other_may_hold=True)
                self.check_rules(b, case, response, tenant)
                sid = case.body.get("session_id") if isinstance(case.body, dict) else None
                if isinstance(sid, str):
                    sids.add(sid)
        for sid in sorted(sids):  # leave no session of the pass to the later passes
            for tenant in TOKENS:
                self._post("session_closed", {"session_id": sid}, tenant)

    def check_rules(self, b: BoundaryCase, case: Any, response: Any, tenant: str) -> None:
        """Schemathesis' checks of boundary cases: invalid data refused (4xx), 405 with
        ``Allow`` for methods the document does not list, 401 without a token (a case
        of the fuzzer's own, without schemathesis' metadata: refused with 4xx when
        invalid)."""
        auth = {"Authorization": f"Bearer {TOKENS[tenant]}"}
        try:
            if case.meta is not None:
                case.validate_response(response, checks=self.boundary_rules, headers=auth)
            elif not b.positive and not 400 <= response.status_code < 500:
                raise AssertionError(f"invalid data answered {response.status_code}")
        except (Exception, BaseExceptionGroup) as exc:
            self.tally.rule_violations += 1
            self.tally.example(f"rule {b.op} {b.scenario} {response.status_code} "
                               f"{case.body!r:.200}: {exc}")

    # -- stateful mode -------------------------------------------------------------------
    def linked_schema(self) -> Any:
        """The served document with :data:`LINKS` added to each operation's 200 answer."""
        import schemathesis

        raw = self.http.get("/openapi.json").json()
        ids = {path.removeprefix("/v1/"): ops["post"]["operationId"]
               for path, ops in raw["paths"].items() if path.startswith("/v1/")}
        for source, targets in LINKS.items():
            answer = raw["paths"][f"/v1/{source}"]["post"]["responses"]["200"]
            links = answer.setdefault("links", {})
            for target in targets:
                body: dict[str, str] = {"session_id": "$request.body#/session_id"}
                if source == "route" and target == "request_finished":
                    body["node"] = "$response.body#/node"  # where the route sent it
                links[f"{source}_then_{target}"] = {"operationId": ids[target],
                                                    "requestBody": body}
        return schemathesis.openapi.from_dict(raw)

    def stateful(self, scenarios: int, steps: int, seed: int) -> None:
        """Run ``scenarios`` scenarios of up to ``steps`` linked calls each."""
        from hypothesis import HealthCheck, Phase, settings
        from hypothesis import seed as hseed
        from hypothesis.errors import Flaky
        from schemathesis.generation.stateful import run_state_machine_as_test

        fuzzer, t = self, self.tally
        base = self.linked_schema().as_state_machine()

        class Machine(base):  # type: ignore[misc, valid-type]
            rule_order_seed = seed

            def setup(self) -> None:
                t.scenarios += 1
                #: session id -> the operations of its 2xx answers, in order
                self.lives: dict[str, list[str]] = {}
                #: session ids sent in this scenario
                self.sent: set[str] = set()

            def before_call(self, case: Any) -> None:
                fuzzer.prepare_stateful(case, self.sent, self.lives)

            def call(self, case: Any, **kwargs: Any) -> Any:
                return fuzzer.call(case)

            def validate_response(self, response: Any, case: Any,
                                  additional_checks: Any = None, **kwargs: Any) -> None:
                op = case.operation.path.removeprefix("/v1/")
                t.stateful_cases += 1
                fuzzer.check(op, case, response)  # counted, never raised
                sid = case.body.get("session_id") if isinstance(case.body, dict) else None
                if isinstance(sid, str) and 200 <= response.status_code < 300:
                    life = self.lives.setdefault(sid, [])
                    if life:
                        key = f"{life[-1]} -> {op}"
                        t.transitions[key] = t.transitions.get(key, 0) + 1
                    life.append(op)

            def teardown(self) -> None:
                t.lifecycles += sum(_walks(life, LIFECYCLE) for life in self.lives.values())

        try:
            run_state_machine_as_test(hseed(seed)(Machine), settings=settings(
                max_examples=scenarios, stateful_step_count=steps, deadline=None,
                database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck)))
        except Flaky:
            # The server's state differs between runs of a prefix (a link followed once is
            # not the next time): Hypothesis stops the run; schemathesis' own runner treats
            # this as success and starts again, as the caller does with the next seed.
            t.stateful_restarts += 1

    def prepare_stateful(self, case: Any, sent: set[str], lives: dict[str, list[str]]
                         ) -> None:
        """As positive cases above: acme's calls without a tenant (3 of 4), sizes kept. A
        call that starts a scenario's step on a random session id (not one a link carried
        over) and needs a live session is made on the scenario's latest open one."""
        self._stateful_seq += 1
        if not isinstance(case.body, dict):
            return
        body = dict(case.body)
        if self._stateful_seq % 4:
            body.pop("tenant", None)
            if case.operation.path in ("/v1/route", "/v1/request_started"):
                _size_rule(body)
            node = body.get("node")  # a node of the fleet (ints may come as 240.0)
            if (isinstance(node, int | float) and not isinstance(node, bool)
                    and node == int(node) and not 0 <= node < NODES):
                body["node"] = int(node) % NODES
        sid = body.get("session_id")
        op = case.operation.path.removeprefix("/v1/")
        if isinstance(sid, str) and sid not in sent and op in NEEDS_SESSION:
            open_ = [s for s, life in lives.items() if life and life[-1] != "session_closed"]
            if open_:
                body["session_id"] = sid = open_[-1]
        if isinstance(sid, str):
            sent.add(sid)
        case.body = body


class BoundaryCase(NamedTuple):
    """One case of the boundary pass: the operation, the case as generated, its coverage
    scenario, the body field it is about (if one), whether it is valid, and whether it is
    the call without a bearer token."""

    op: str
    case: Any
    scenario: str
    target: str | None
    positive: bool
    no_token: bool = False


def _other(tenant: str) -> str:
    return next(other for other in TOKENS if other != tenant)


def _copy(case: Any) -> Any:
    """A case of its own (body and metadata copied), to send once per tenant."""
    return case.operation.Case(
        method=case.method, headers=dict(case.headers or {}), query=dict(case.query or {}),
        body=copy.deepcopy(case.body), media_type=case.media_type,
        _meta=copy.deepcopy(case.meta))


def _target(data: Any) -> str | None:
    """The body field a coverage case is about: where its schema keyword is
    (``/properties/input_tokens/anyOf/0/maximum``) or, for a valid value, what its
    description quotes (``Object with valid 'eta_s' value: ...``)."""
    location = data.location or ""
    if location.startswith("/properties/"):
        return str(location.split("/")[2])
    parts = data.description.split("'")
    return parts[1] if len(parts) >= 3 else None


def _aim(op: str, body: dict[str, Any], tenant: str, target: str | None) -> dict[str, Any]:
    """A boundary case as ``tenant``'s call that gets past the checks it is not about, so
    that a valid one can reach the scheduler and an invalid one that the server does not
    refuse is seen: its ``tenant`` the caller's (unless the case is about it; another
    tenant's name is refused with 403 whatever the rest holds) and a route's size
    consistent (the one rule the schema cannot state), the field under test left as
    generated."""
    if target != "tenant" and isinstance(body.get("tenant"), str):
        body["tenant"] = tenant
    if op not in ("route", "request_started"):
        return body
    if target == "chunk_hashes" or (target == "input_tokens" and
                                    body.get("input_tokens") is not None):
        body.pop("token_ids", None)
        if body.get("input_tokens") is None:
            body["input_tokens"] = 1000
    elif isinstance(body.get("token_ids"), list):
        body.pop("chunk_hashes", None)
        if body.get("input_tokens") is not None:
            body["input_tokens"] = len(body["token_ids"])
    elif body.get("input_tokens") is None:
        body["input_tokens"] = 1000
    return body


def _long_lists(operation: Any, cases: list[Any]) -> list[BoundaryCase]:
    """Cases with each body list at its ``maxItems`` and one past it, where the coverage
    phase built neither (it leaves out lists of 16,384 items or more), each item the
    largest the document allows (``op`` left for the caller)."""
    bodies = list(operation.body)
    schema = bodies[0].definition.get("schema", {}) if bodies else {}
    built = {(name, len(value)) for case in cases if isinstance(case.body, dict)
             for name, value in case.body.items() if isinstance(value, list)}
    out = []
    for name, prop in schema.get("properties", {}).items():
        array = next((s for s in prop.get("anyOf", [prop]) if s.get("type") == "array"), None)
        if array is None or not isinstance(array.get("maxItems"), int):
            continue
        items = array.get("items", {})
        item: Any = int(items.get("maximum", 0)) if items.get("type") == "integer" else "a"
        for n in (array["maxItems"], array["maxItems"] + 1):
            if (name, n) not in built:
                case = operation.Case(body={"session_id": "0", name: [item] * n},
                                      media_type="application/json")
                at_most = n <= array["maxItems"]
                scenario = "maximum_items_array" if at_most else "array_above_max_items"
                out.append(BoundaryCase("", case, scenario, name, at_most))
    return out


def _walks(life: list[str], steps: tuple[tuple[str, ...], ...]) -> bool:
    """Whether ``life`` holds ``steps`` in order (each one of its alternatives)."""
    i = 0
    for op in life:
        if i < len(steps) and op in steps[i]:
            i += 1
    return i == len(steps)


def _size_rule(body: dict[str, Any]) -> None:
    """Make a generated body keep the one rule the schema cannot state (a size: token_ids,
    or input_tokens with optional chunk_hashes, consistent), so that it reaches the
    scheduler instead of stopping at 422."""
    ids = body.get("token_ids")
    if isinstance(ids, list):
        body.pop("chunk_hashes", None)
        body.pop("input_tokens", None)
    elif body.get("input_tokens") is None:
        body["input_tokens"] = 1000


def fuzz(url: str, cases: int, seed: int = 15, *, stateful_cases: int = 0,
         steps: int = 10, boundary_cases: int | None = 0) -> dict[str, Any]:
    """At least ``cases`` cases against the API at ``url``: first the boundary pass
    (``boundary_cases`` calls of it, all of it with None, none with 0), then about
    ``stateful_cases`` in scenarios of up to ``steps`` linked calls, the rest independent;
    the tally."""
    from schemathesis import GenerationMode

    started = time.monotonic()
    tally = Tally()
    fuzzer = Fuzzer(url, tally)
    try:
        if boundary_cases is None or boundary_cases > 0:
            fuzzer.boundary(boundary_cases)
        round_ = 0
        while tally.stateful_cases < stateful_cases and round_ < 200:
            # a scenario runs 2..steps calls (about steps/2 on average)
            left = stateful_cases - tally.stateful_cases
            fuzzer.stateful(max(1, -(-2 * left // (steps + 2))), steps, seed + round_)
            round_ += 1
        plan = [(op, mode) for op in fuzzer.operations()
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        round_ = 0
        while tally.cases < cases and round_ < 5:  # hypothesis may stop a strategy early
            per = max(1, -(-(cases - tally.cases) // len(plan)))
            for operation, mode in plan:
                fuzzer.run(operation, mode, per, seed + round_)
            round_ += 1
    finally:
        fuzzer.close()
    return tally.result(time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="(the child process) serve the API")
    s.add_argument("--config", required=True, type=Path)
    p.add_argument("--cases", type=int, default=5000)
    p.add_argument("--stateful-cases", type=int, default=1000,
                   help="of --cases, about this many in linked scenarios (stateful mode)")
    p.add_argument("--steps", type=int, default=10,
                   help="calls per stateful scenario, at most")
    p.add_argument("--boundary-cases", default=None, metavar="N|all",
                   type=lambda v: None if v == "all" else int(v),
                   help="of --cases, this many boundary-value calls first (schemathesis' "
                        "coverage phase, as both tenants): a number, or 'all' (the default)")
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--json", type=Path, default=Path("out/fuzz.json"))
    args = p.parse_args(argv)
    if args.command == "serve":
        return serve(args.config)
    with tempfile.TemporaryDirectory(prefix="kvprefetch-fuzz-") as tmp, Server(Path(tmp)) as srv:
        result = fuzz(srv.url, args.cases, args.seed, stateful_cases=args.stateful_cases,
                      steps=args.steps, boundary_cases=args.boundary_cases)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("cases", "server_errors", "undocumented",
                                      "cross_tenant_successes", "cross_tenant_replays",
                                      "boundary_cases", "seconds")}
    summary["boundary"] = {k: v for k, v in result["boundary"].items() if k != "scenarios"}
    summary["stateful"] = {k: v for k, v in result["stateful"].items() if k != "transitions"}
    print(json.dumps(summary))
    bad = (result["server_errors"] or result["undocumented"]
           or result["cross_tenant_successes"] or result["boundary"]["rule_violations"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
