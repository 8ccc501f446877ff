"""One vocabulary: OpenAI finish reasons and Anthropic stop reasons map to one canonical set
in the API and in its OpenAPI document; ``default`` reads hints and ``hinted:SPEC`` wraps
any predictor spec."""

from __future__ import annotations

import typing

import pytest

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.base.vocabulary import (
    STOP_REASON_ALIASES,
    STOP_REASONS,
    canonical_stop_reason,
    stop_reason_or_none,
)
from kvprefetch.predictors import registry
from kvprefetch.predictors.adaptive import AdaptivePredictor
from kvprefetch.predictors.features import KNOWN_STOP_REASONS
from kvprefetch.predictors.heuristics import EwmaPredictor
from kvprefetch.predictors.hinted import HintedPredictor


def _finished(stop: object) -> api.RequestFinished:
    return api.parse(api.RequestFinished, {"session_id": "s", "node": 0, "input_tokens": 10,
                                           "stop_reason": stop})


@pytest.mark.parametrize(("given", "canonical"), [
    ("tool_calls", "tool_use"), ("function_call", "tool_use"), ("tool_use", "tool_use"),
    ("stop", "end_turn"), ("end_turn", "end_turn"), ("length", "max_tokens"),
    ("max_tokens", "max_tokens"), ("content_filter", "refusal"), ("abort", "aborted"),
    ("stop_sequence", "stop_sequence"), ("pause_turn", "pause_turn")])
def test_the_api_stores_every_accepted_stop_reason_by_its_canonical_name(
        given: str, canonical: str) -> None:
    assert _finished(given).stop_reason == canonical == canonical_stop_reason(given)


def test_an_unknown_stop_reason_is_refused_by_field() -> None:
    with pytest.raises(InvalidRequestError, match="stop_reason"):
        _finished("eos")
    with pytest.raises(ValueError, match="accepted: tool_use"):
        canonical_stop_reason("eos")
    assert _finished(None).stop_reason is None
    assert stop_reason_or_none("eos") is None and stop_reason_or_none("length") == "max_tokens"


def test_the_schema_and_the_vocabulary_name_the_same_reasons() -> None:
    field = api.RequestFinished.model_fields["stop_reason"].annotation
    names = {a for arg in typing.get_args(field) for a in typing.get_args(arg)
             if isinstance(a, str)}
    literal = typing.get_args(api.StopReasonName)
    assert set(literal) == set(STOP_REASON_ALIASES) and names <= set(literal)
    assert set(STOP_REASON_ALIASES.values()) == set(STOP_REASONS)
    # the predictors' stop classes are canonical names
    assert set(KNOWN_STOP_REASONS) <= set(STOP_REASONS)
    schema = api.RequestFinished.model_json_schema()["properties"]["stop_reason"]
    enum = next(s["enum"] for s in schema["anyOf"] if "enum" in s)
    assert set(enum) == set(STOP_REASON_ALIASES)
    assert "tool_calls and function_call -> tool_use" in schema["description"]


def _idle_forecast(predictor: object, hint: HintKind | None) -> float:
    """The predicted median gap of a session idle 1 s after a finish, with or without a
    ``hint`` at the finish (ETA 30 s for a tool)."""
    p = typing.cast(HintedPredictor, predictor)
    for turn, t in enumerate((0.0, 200.0, 400.0)):
        p.observe(SessionEvent(EventKind.REQUEST_STARTED, "s", t, turn=turn, input_tokens=100))
        p.observe(SessionEvent(EventKind.REQUEST_FINISHED, "s", t + 5, turn=turn,
                               input_tokens=100, output_tokens=10, stop_reason="end_turn"))
    if hint is not None:
        p.observe(SessionEvent(EventKind.HINT, "s", 406.0, hint=hint, eta_s=30.0))
    fc = p.forecast("s", 406.0)
    assert fc is not None
    return fc.arrival_quantile_after(0.5, 406.0)


def test_default_is_the_shipped_model_reading_hints() -> None:
    default = registry.load("default")
    assert isinstance(default, HintedPredictor)
    assert isinstance(default.inner, AdaptivePredictor) and default.inner.fitted
    plain = _idle_forecast(registry.load("default"), None)
    hinted = _idle_forecast(registry.load("default"), HintKind.TOOL_RUNNING)
    # a tool with an ETA of 30 s: due about 30 s after the hint, not a human gap away
    assert 406.0 + 10 < hinted < 406.0 + 90 < plain


def test_hinted_wraps_any_spec_once() -> None:
    ewma = registry.load("hinted:ewma")
    assert isinstance(ewma, HintedPredictor) and isinstance(ewma.inner, EwmaPredictor)
    shipped = registry.load("hinted:default")  # already hinted: not wrapped twice
    assert isinstance(shipped, HintedPredictor) and isinstance(shipped.inner, AdaptivePredictor)
    assert isinstance(registry.load("hinted").inner, EwmaPredictor)  # type: ignore[attr-defined]


def test_a_late_hint_s_eta_counts_from_the_hint() -> None:
    """A tool hint 40 s after the response with an ETA of 2 s: the session is due about
    2 s after the hint, with the ETA's spread (sigma 0.5 on the 2 s), not spread over the
    40 s already passed."""
    p = registry.load("default")
    p.observe(SessionEvent(EventKind.REQUEST_STARTED, "s", 0.0, input_tokens=100))
    p.observe(SessionEvent(EventKind.REQUEST_FINISHED, "s", 5.0, input_tokens=100,
                           output_tokens=10, stop_reason="end_turn"))
    p.observe(SessionEvent(EventKind.HINT, "s", 45.0, hint=HintKind.TOOL_RUNNING, eta_s=2.0))
    fc = p.forecast("s", 45.0)
    assert fc is not None
    q10, q50, q90 = (fc.arrival_quantile_after(q, 45.0) for q in (0.1, 0.5, 0.9))
    assert 45.5 < q10 < q50 < q90 < 50.0 and abs(q50 - 47.0) < 0.3
