"""Authenticated, isolated tenants on a real HTTP server on loopback: each tenant's token
is that tenant's only; tenant B cannot read, change, close or probe tenant A's sessions; a
tenant over its live-session quota gets 429 while others are unaffected, visible in the
metrics; ``/metrics`` names tenants only to the metrics or admin token (pseudonyms when
it is open); where bodies name their tenants, at most ``max_named_tenants`` are admitted;
the serve config reads secrets from the environment or files and never shows them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.errors import (  # noqa: E402
    ConfigError,
    UnauthorizedError,
    UnknownSessionError,
    WrongTenantError,
)
from kvprefetch.controlplane.cli.serve_config import load_serve_config  # noqa: E402
from kvprefetch.controlplane.core.quotas import TenantQuota  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.metrics import (  # noqa: E402
    PrometheusMetrics,
    pseudonymize_tenants,
    tenant_pseudonyms,
)
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.tenants import (  # noqa: E402
    DEFAULT_MAX_NAMED_TENANTS,
    TenantAuth,
    TenantLimitError,
    TenantQuotaError,
)

pytestmark = pytest.mark.servers

GIB = 1 << 30
MIB = 1 << 20
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}
ADMIN = "admin-token-0123456789"
METRICS = "metrics-token-0123456789"


@dataclass
class Tenants:
    service: SchedulerService
    url: str

    def post(self, op: str, body: dict[str, Any], token: str | None) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(f"{self.url}/v1/{op}", json=body, headers=headers, timeout=5)


@pytest.fixture
def tenants() -> Iterator[Tenants]:
    metrics = PrometheusMetrics()
    cfg = ServiceConfig(fleet=FLEET, tenants=("acme", "globex"),
                        tenant_max_live_sessions={"acme": 3})
    svc = SchedulerService(cfg, metrics=metrics).start()
    auth = TenantAuth(TOKENS, admin_token=ADMIN, metrics_token=METRICS)
    try:
        with HttpServer(create_app(svc, auth=auth, metrics_registry=metrics)) as srv:
            yield Tenants(svc, srv.url)
    finally:
        svc.close()


def _state(t: Tenants, sid: str, token: str) -> Any:
    return t.post("session_state", {"session_id": sid}, token)


def test_tenant_b_cannot_read_change_close_or_probe_tenant_a_sessions(tenants: Tenants
                                                                      ) -> None:
    t, a, b = tenants, TOKENS["acme"], TOKENS["globex"]
    ans = t.post("route", {"session_id": "s1", "input_tokens": 4000}, a).json()
    assert t.post("request_finished", {"session_id": "s1", "node": ans["node"],
                                       "input_tokens": 4000, "output_tokens": 100},
                  a).status_code == 200
    before = _state(t, "s1", a).json()
    assert before == {"session_id": "s1", "turns": 1, "in_flight": False,
                      "context_tokens": 4100, "keyed_by_content": False}

    def as_b(op: str, body: dict[str, Any]) -> Any:
        return t.post(op, body, b)

    # read, change, close: 404, the very answer for an id no tenant uses
    attempts = [
        ("session_state", {}),
        ("hint", {"hint": {"kind": "tool_running", "eta_s": 3}}),
        ("request_finished", {"node": 0, "input_tokens": 1, "output_tokens": 9}),
        ("session_closed", {}),
    ]
    for op, extra in attempts:
        on_a = as_b(op, {"session_id": "s1", **extra})
        on_none = as_b(op, {"session_id": "zz", **extra})
        assert on_a.status_code == on_none.status_code == 404, (op, on_a.text)
        assert on_a.json() == {"error": "UnknownSessionError",
                               "detail": "unknown session 's1' of tenant 'globex'"}
        assert on_none.json()["detail"].replace("'zz'", "'s1'") == on_a.json()["detail"]
        # naming acme in the body does not help: the token says whose call it is
        forged = as_b(op, {"tenant": "acme", "session_id": "s1", **extra})
        assert forged.status_code == 403 and forged.json()["error"] == "WrongTenantError"
    # probing by opening: B gets a session of its own by that id; A's is untouched
    assert as_b("route", {"session_id": "s1", "input_tokens": 10}).status_code == 200
    assert _state(t, "s1", b).json()["context_tokens"] == 0
    assert as_b("session_closed", {"session_id": "s1"}).status_code == 200
    assert _state(t, "s1", a).json() == before
    assert t.service.has_session("acme", "s1") and not t.service.has_session("globex", "s1")
    # A's own calls still work, with the tenant left out or named rightly
    assert t.post("hint", {"tenant": "acme", "session_id": "s1",
                           "hint": {"kind": "user_typing"}}, a).status_code == 200
    assert t.post("session_closed", {"session_id": "s1"}, a).status_code == 200
    assert _state(t, "s1", a).status_code == 404


def test_tokens_admin_and_the_python_client(tenants: Tenants) -> None:
    t = tenants
    assert t.post("route", {"session_id": "x", "input_tokens": 1}, None).status_code == 401
    wrong = t.post("route", {"session_id": "x", "input_tokens": 1}, "not-a-token-at-all")
    assert wrong.status_code == 401 and "not-a-token" not in wrong.text
    # the admin acts for the tenant the body names; a tenant not configured is refused
    assert t.post("route", {"tenant": "globex", "session_id": "x", "input_tokens": 1},
                  ADMIN).status_code == 200
    assert t.service.has_session("globex", "x")
    assert t.post("route", {"tenant": "initech", "session_id": "x", "input_tokens": 1},
                  ADMIN).status_code == 403
    assert t.post("session_state", {"tenant": "globex", "session_id": "x"},
                  ADMIN).json()["turns"] == 1
    # the Python client with a tenant's token: no tenant to name
    with connect(t.url, token=TOKENS["acme"]) as c:
        node = c.route("py", input_tokens=100).node
        assert node is not None
        assert c.request_finished("py", node=node, input_tokens=100).accepted
        assert c.session_state("py").context_tokens == 100
        with pytest.raises(WrongTenantError):
            c.hint("py", "user_typing", tenant="globex")
    with connect(t.url, token=TOKENS["globex"]) as c, pytest.raises(UnknownSessionError):
        c.session_state("py")


def test_a_tenant_over_its_quota_gets_429_and_the_others_are_unaffected(tenants: Tenants
                                                                        ) -> None:
    t, a, b = tenants, TOKENS["acme"], TOKENS["globex"]
    for i in range(3):
        assert t.post("route", {"session_id": f"a{i}", "input_tokens": 10}, a).status_code == 200
    over = t.post("route", {"session_id": "a3", "input_tokens": 10}, a)
    assert over.status_code == 429, over.text
    assert over.json()["error"] == "TenantQuotaError"
    assert "max_live_sessions 3" in over.json()["detail"]
    assert t.post("request_started", {"session_id": "a3", "input_tokens": 10},
                  a).status_code == 429
    assert not t.service.has_session("acme", "a3")
    # its live sessions keep working; other tenants open as many as they like
    assert t.post("route", {"session_id": "a0", "input_tokens": 20}, a).status_code == 200
    for i in range(5):
        assert t.post("route", {"session_id": f"b{i}", "input_tokens": 10}, b).status_code == 200
    # closing one makes room
    assert t.post("session_closed", {"session_id": "a1"}, a).status_code == 200
    assert t.post("route", {"session_id": "a3", "input_tokens": 10}, a).status_code == 200
    with connect(t.url, token=a) as c, pytest.raises(TenantQuotaError, match="HTTP 429"):
        c.request_started("a4", input_tokens=10)
    metrics = _metrics(t.url, METRICS).text
    assert 'kvprefetch_tenant_live_sessions{tenant="acme"} 3.0' in metrics
    assert 'kvprefetch_tenant_live_sessions{tenant="globex"} 5.0' in metrics
    assert 'kvprefetch_tenant_quota_refusals_total{tenant="acme"} 3.0' in metrics
    assert "globex" not in "".join(line for line in metrics.splitlines()
                                   if line.startswith("kvprefetch_tenant_quota_refusals_total"))
    summary = t.service.summary()
    assert summary["quota_refusals"] == 3
    assert summary["live_sessions_per_tenant"] == {"acme": 3, "globex": 5}


def test_a_tenant_over_its_tier_share_loses_its_own_sessions_and_the_other_is_unaffected(
        ) -> None:
    # acme may hold a quarter of each node's 16 GiB tier (4 GiB) and prefetch at 10% of the
    # NIC; globex has no share. Every session below leaves 2 GiB (16,384 tokens at 128 KiB).
    metrics = PrometheusMetrics()
    cfg = ServiceConfig(fleet=FLEET, tenants=("acme", "globex"),
                        tenant_local_tier_share={"acme": 0.25},
                        tenant_prefetch_bandwidth_share={"acme": 0.1})
    svc = SchedulerService(cfg, metrics=metrics).start()
    auth = TenantAuth(TOKENS, admin_token=ADMIN, metrics_token=METRICS)
    try:
        with HttpServer(create_app(svc, auth=auth, metrics_registry=metrics)) as srv:
            t = Tenants(svc, srv.url)

            def turn(tenant: str, sid: str) -> None:
                token = TOKENS[tenant]
                assert t.post("route", {"session_id": sid, "input_tokens": 16_284},
                              token).status_code == 200
                assert t.post("request_finished", {"session_id": sid, "node": 0,
                                                   "input_tokens": 16_284,
                                                   "output_tokens": 100},
                              token).status_code == 200

            turn("globex", "g1")
            turn("globex", "g2")
            for sid in ("a1", "a2", "a3", "a4"):
                turn("acme", sid)
            held = {e.session_id: e.nbytes for e in svc.core.dram[0]}
            # acme kept 2 of its 4 sessions (its 4 GiB); globex's two are all there
            assert sum(n for sid, n in held.items() if sid.startswith("acme/")) == 4 * GIB
            assert {"globex/g1", "globex/g2"} <= set(held)
            shares = svc.summary()["tenant_shares"]
            assert shares["acme"]["tier_evictions"] == 2
            assert shares["acme"]["local_tier_bytes"] == {"node-0": 4 * GIB, "node-1": 0}
            assert shares["acme"]["local_tier_share"] == 0.25
            assert shares["acme"]["prefetch_bandwidth_share"] == 0.1
            assert set(shares) == {"acme"}
            text = _metrics(t.url, METRICS).text
            assert ('kvprefetch_tenant_local_tier_bytes{node="node-0",tenant="acme"} '
                    "4.294967296e+09") in text
            assert 'kvprefetch_tenant_tier_share_evictions_total{tenant="acme"} 2.0' in text
            assert 'tenant="globex"' not in "".join(
                line for line in text.splitlines() if line.startswith("kvprefetch_tenant_tier"))
    finally:
        svc.close()


def test_credentials_are_checked_at_start_and_never_shown() -> None:
    with pytest.raises(ConfigError, match="exactly one tenant") as err:
        TenantAuth({"a": "same-token-0123456789", "b": "same-token-0123456789"})
    assert "same-token" not in str(err.value)
    with pytest.raises(ConfigError, match="shorter than 16"):
        TenantAuth({"a": "short"})
    with pytest.raises(ConfigError, match="exactly one tenant"):
        TenantAuth({"a": ADMIN}, admin_token=ADMIN)


def _serve_yaml(tmp_path: Path, **over: Any) -> Path:
    cfg: dict[str, Any] = {"stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
                           "agent": {"tier_capacity_bytes": 64 * MIB}}
    cfg.update(over)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_serve_config_reads_tenant_secrets_from_env_and_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "globex.token"
    secret_file.write_text(TOKENS["globex"] + "\n")
    monkeypatch.setenv("KVP_T_ACME", TOKENS["acme"])
    monkeypatch.setenv("KVP_T_ADMIN", ADMIN)
    path = _serve_yaml(
        tmp_path, http={"admin_token": {"env": "KVP_T_ADMIN"},
                        "limits": {"max_token_ids": 1000, "max_body_bytes": 1 << 20}},
        tenants={"acme": {"token": {"env": "KVP_T_ACME"}, "max_live_sessions": 7},
                 "globex": {"token": {"file": str(secret_file)}, "local_tier_share": 0.5,
                            "prefetch_bandwidth_share": 0.2}})
    cfg = load_serve_config(path)
    auth = cfg.auth()
    assert auth.authenticate(TOKENS["acme"]).tenant == "acme"
    assert auth.authenticate(TOKENS["globex"]).tenant == "globex"  # newline stripped
    assert auth.authenticate(ADMIN).tenant is None
    service = cfg.service_config(["n0"])
    assert service.tenants == ("acme", "globex")
    assert service.max_live_sessions("acme") == 7
    assert service.max_live_sessions("globex") == service.max_live_sessions_per_tenant
    assert service.limits.max_token_ids == 1000
    assert service.tenant_quotas == {"globex": TenantQuota(local_tier_share=0.5,
                                                           prefetch_bandwidth_share=0.2)}
    assert TOKENS["acme"] not in repr(cfg) and ADMIN not in repr(cfg)
    # a missing secret names where it was looked for, not a value
    monkeypatch.delenv("KVP_T_ACME")
    with pytest.raises(ConfigError, match=r"tenants\.acme\.token.*KVP_T_ACME"):
        cfg.auth()


@pytest.mark.parametrize(("over", "message"), [
    ({"tenants": {"acme": {"token": {"env": "X"}}}, "http": {"bearer_token": "shared"}},
     "do not mix"),
    ({"tenants": {"..": {"token": {"env": "X"}}}}, "tenant name"),
    ({"tenants": {"acme": {"token": {"env": "X", "file": "/f"}}}}, "exactly one"),
    ({"tenants": {"acme": {"token": {}}}}, "exactly one"),
    ({"http": {"admin_token": {"env": "X"}}}, "only with tenants"),
    ({"http": {"limits": {"max_body_bytes": 5000}}}, "cannot hold"),
    ({"service": {"limits": {}}}, "http.limits"),
    ({"tenants": {"acme": {"token": {"env": "X"}}}, "service": {"tenants": ["b"]}},
     "tenants section"),
    ({"tenants": {"acme": {"token": {"env": "X"}, "local_tier_share": 1.5}}},
     r"tenants\.acme\.local_tier_share"),
    ({"tenants": {"acme": {"token": {"env": "X"}, "prefetch_bandwidth_share": 0}}},
     r"tenants\.acme\.prefetch_bandwidth_share"),
    ({"service": {"tenant_local_tier_share": {"acme": 2}}},
     r"tenant_local_tier_share\['acme'\] must be a fraction in \(0, 1\]"),
    ({"service": {"tenants": ["acme"], "tenant_prefetch_bandwidth_share": {"globex": 0.5}}},
     r"tenant_prefetch_bandwidth_share\['globex'\]: not one of the tenants"),
    ({"tenants": {"acme": {"token": {"env": "X"}}},
      "service": {"tenant_prefetch_bandwidth_share": {"acme": 0.5}}}, "tenants section"),
])
def test_bad_tenant_configs_fail_at_start(tmp_path: Path, over: dict[str, Any],
                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_serve_config(_serve_yaml(tmp_path, **over))


def _metrics(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=5)


def test_metrics_need_the_metrics_or_the_admin_token_when_one_is_configured(
        tenants: Tenants) -> None:
    t = tenants
    assert t.post("route", {"session_id": "s", "input_tokens": 10},
                  TOKENS["acme"]).status_code == 200
    for token in (None, TOKENS["acme"], "wrong-token-0123456789"):
        refused = _metrics(t.url, token)
        assert refused.status_code == 401, token
        assert refused.json()["error"] == "UnauthorizedError"
        assert "acme" not in refused.text
    for token in (METRICS, ADMIN):
        text = _metrics(t.url, token).text
        assert 'kvprefetch_tenant_live_sessions{tenant="acme"} 1.0' in text
    # the metrics token reads /metrics and nothing else
    assert t.post("route", {"session_id": "m", "input_tokens": 10},
                  METRICS).status_code == 401
    assert httpx.get(f"{t.url}/healthz").status_code == 200  # probes need no token


def test_open_metrics_name_tenants_by_pseudonym() -> None:
    metrics = PrometheusMetrics()
    svc = SchedulerService(ServiceConfig(fleet=FLEET, tenants=("acme", "globex")),
                           metrics=metrics).start()
    texts: dict[str, str] = {}
    try:
        for names in (False, True):
            app = create_app(svc, auth=TenantAuth(TOKENS), metrics_registry=metrics,
                             metrics_tenant_names=names)
            with HttpServer(app) as srv:
                for tenant, token in TOKENS.items():
                    assert httpx.post(f"{srv.url}/v1/route",
                                      json={"session_id": f"{tenant}-s", "input_tokens": 10},
                                      headers={"Authorization": f"Bearer {token}"},
                                      timeout=5).status_code == 200
                answer = _metrics(srv.url)
                assert answer.status_code == 200
                texts[str(names)] = answer.text
    finally:
        svc.close()
    hidden, shown = texts["False"], texts["True"]
    assert 'kvprefetch_tenant_live_sessions{tenant="acme"}' in shown
    assert "acme" not in hidden and "globex" not in hidden
    labels = re.findall(r'kvprefetch_tenant_live_sessions\{tenant="(t-[0-9a-f]{12})"\}',
                        hidden)
    assert len(set(labels)) == 2  # one pseudonym per tenant, the counts kept
    # the same credentials, the same pseudonyms (series survive a restart); others differ
    again = tenant_pseudonyms(TenantAuth(TOKENS).pseudonym_key())
    assert sorted(again(name) for name in TOKENS) == sorted(labels)
    other = tenant_pseudonyms(TenantAuth({"acme": "another-token-0123456789"}).pseudonym_key())
    assert other("acme") not in labels


def test_pseudonyms_replace_every_tenant_label_and_nothing_else() -> None:
    text = (b'# HELP x_total help with tenant="acme"\n'
            b'x_total{tenant="acme",node="n0"} 1.0\n'
            b'y{shard="0",tenant="a\\"b"} 2.0\n'
            b'z{tenant="_other"} 3.0\n'
            b'w{not_tenant="acme"} 4.0\n')
    out = pseudonymize_tenants(text, lambda name: {"_other": "_other"}.get(name, f"<{name}>"))
    assert out == (b'# HELP x_total help with tenant="acme"\n'
                   b'x_total{tenant="<acme>",node="n0"} 1.0\n'
                   b'y{shard="0",tenant="<a"b>"} 2.0\n'
                   b'z{tenant="_other"} 3.0\n'
                   b'w{not_tenant="acme"} 4.0\n')


@pytest.mark.parametrize("shared", [True, False], ids=["shared-token", "no-auth"])
def test_bodies_that_name_tenants_create_at_most_max_named_tenants(shared: bool) -> None:
    svc = SchedulerService(ServiceConfig(fleet=FLEET)).start()  # any tenant allowed
    token = "shared-token"
    headers = {"Authorization": f"Bearer {token}"} if shared else {}
    try:
        with HttpServer(create_app(svc, bearer_token=token if shared else None)) as srv:
            def route(tenant: str, sid: str = "s") -> Any:
                return httpx.post(f"{srv.url}/v1/route", headers=headers, timeout=5,
                                  json={"tenant": tenant, "session_id": sid,
                                        "input_tokens": 10})

            with httpx.Client() as http:
                for i in range(DEFAULT_MAX_NAMED_TENANTS):
                    assert http.post(f"{srv.url}/v1/route", headers=headers, json={
                        "tenant": f"t{i}", "session_id": "s", "input_tokens": 10},
                        timeout=5).status_code == 200
            refused = route("one-too-many")
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"] == "TenantLimitError"
            assert "max_named_tenants" in refused.json()["detail"]
            assert not svc.has_session("one-too-many", "s")
            assert route("t0", "s2").status_code == 200  # admitted tenants go on
            assert svc.summary()["live_sessions_per_tenant"].keys() == {
                f"t{i}" for i in range(DEFAULT_MAX_NAMED_TENANTS)}
    finally:
        svc.close()


def test_tenant_tokens_are_not_capped_and_a_small_cap_is_configurable() -> None:
    auth = TenantAuth(shared_token="shared-token", max_named_tenants=2)
    shared = auth.authenticate("shared-token")
    assert [auth.tenant_for(shared, n) for n in ("a", None, "a")] == ["a", "default", "a"]
    with pytest.raises(TenantLimitError):
        auth.tenant_for(shared, "b")
    assert auth.named_tenants == 2
    isolated = TenantAuth(TOKENS, admin_token=ADMIN, max_named_tenants=1)
    admin = isolated.authenticate(ADMIN)
    assert {isolated.tenant_for(admin, n) for n in ("acme", "globex")} == {"acme", "globex"}
    with pytest.raises(ConfigError, match="max_named_tenants"):
        TenantAuth(max_named_tenants=0)


def test_the_metrics_token_is_a_credential_of_its_own() -> None:
    with pytest.raises(ConfigError, match="exactly one tenant"):
        TenantAuth(TOKENS, admin_token=ADMIN, metrics_token=ADMIN)
    with pytest.raises(ConfigError, match="shorter than 16"):
        TenantAuth(metrics_token="short")
    open_ops = TenantAuth(metrics_token=METRICS)  # /v1 stays open, /metrics does not
    assert not open_ops.required and open_ops.metrics_guarded
    assert open_ops.authenticate(None).tenant is None
    open_ops.authorize_metrics(METRICS)
    with pytest.raises(UnauthorizedError):
        open_ops.authorize_metrics(None)


def test_serve_config_reads_the_metrics_token_and_the_tenant_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_T_SHARED", "shared-token")
    secret = tmp_path / "metrics.token"
    secret.write_text(METRICS + "\n")
    cfg = load_serve_config(_serve_yaml(tmp_path, http={
        "bearer_token_env": "KVP_T_SHARED", "metrics_token": {"file": str(secret)},
        "max_named_tenants": 5}))
    auth = cfg.auth()
    assert auth.metrics_guarded and auth.max_named_tenants == 5
    assert not cfg.http.metrics_tenant_names
    auth.authorize_metrics(METRICS)
    assert METRICS not in repr(cfg)
    default = load_serve_config(_serve_yaml(tmp_path)).auth()
    assert default.max_named_tenants == DEFAULT_MAX_NAMED_TENANTS == 64
    assert not default.metrics_guarded
