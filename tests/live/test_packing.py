"""The packed form of the per-request calls (controlplane/live/packing.py): what crosses
Ray is rebuilt into the same model, the fields given included, and nothing else changes."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ray import cloudpickle

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError, UnknownSessionError
from kvprefetch.controlplane.live.packing import PACKED, pack, unpack, unpack_event

names = st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True)
tokens = st.integers(0, 100_000_000)


def _sent(value: Any) -> Any:
    """``value`` after a trip through Ray's pickler."""
    return pickle.loads(cloudpickle.dumps(value))


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a == b
    assert a.model_fields_set == b.model_fields_set
    assert a.model_dump(exclude_unset=True) == b.model_dump(exclude_unset=True)


@given(tenant=st.none() | names, sid=names, inp=tokens, reused=st.none() | tokens,
       parent=st.none() | names,
       hashes=st.none() | st.lists(st.from_regex(r"[a-f0-9]{8}", fullmatch=True),
                                   max_size=4))
def test_route_query_and_request_started_come_back_as_given(
        tenant: str | None, sid: str, inp: int, reused: int | None, parent: str | None,
        hashes: list[str] | None) -> None:
    fields: dict[str, Any] = {"session_id": sid, "input_tokens": inp}
    for key, value in (("tenant", tenant), ("reused_tokens", reused),
                       ("parent_id", parent), ("chunk_hashes", hashes)):
        if value is not None:
            fields[key] = value
    for model in (api.RouteQuery, api.RequestStarted):
        call = model.model_validate(fields)
        packed = pack(call)
        assert type(packed) is tuple
        _same(unpack(model, _sent(packed)), call)


@given(node=st.integers(0, 64), inp=tokens, out=st.none() | tokens,
       ctx=st.none() | tokens, stop=st.none() | st.sampled_from(["end_turn", "tool_use"]),
       read=st.none() | tokens)
def test_request_finished_comes_back_as_given(node: int, inp: int, out: int | None,
                                              ctx: int | None, stop: str | None,
                                              read: int | None) -> None:
    fields: dict[str, Any] = {"session_id": "s", "node": node, "input_tokens": inp}
    for key, value in (("output_tokens", out), ("context_tokens", ctx),
                       ("stop_reason", stop), ("local_tokens_read", read)):
        if value is not None:
            fields[key] = value
    call = api.RequestFinished.model_validate(fields)
    _same(unpack_event("request_finished", _sent(pack(call))), call)


def test_route_answers_and_the_default_tenant() -> None:
    answer = api.RouteAnswer(node=3, node_name="gpu-3", estimated_ttft_s=0.25,
                             local_ready=True)
    _same(unpack(api.RouteAnswer, _sent(pack(answer))), answer)
    _same(unpack(api.RouteAnswer, pack(api.RouteAnswer.no_prefetch())),
          api.RouteAnswer.no_prefetch())
    # "default" given is not "default" by default: the fields given survive the trip
    given_default = api.RouteQuery(tenant="default", session_id="s", input_tokens=1)
    back = unpack(api.RouteQuery, pack(given_default))
    assert "tenant" in back.model_fields_set
    assert "tenant" not in unpack(api.RouteQuery, pack(
        api.RouteQuery(session_id="s", input_tokens=1))).model_fields_set


def test_other_values_cross_as_they_are() -> None:
    hint = api.HintCall(session_id="s", hint=api.Hint(kind="user_typing", eta_s=3.0))
    assert pack(hint) is hint
    assert unpack_event("hint", hint) is hint
    refusal = UnknownSessionError("no session s")
    assert pack(refusal) is refusal
    assert unpack(api.RouteAnswer, refusal) is refusal  # a refused route in route_many
    call = api.RouteQuery(session_id="s", input_tokens=5)
    assert unpack(api.RouteQuery, call) is call  # a sender that did not pack it
    assert set(PACKED) == {api.RouteQuery, api.RequestStarted, api.RequestFinished,
                           api.RouteAnswer}


def test_a_tuple_of_the_wrong_length_is_refused_by_name() -> None:
    packed = pack(api.RouteQuery(session_id="s", input_tokens=5))
    with pytest.raises(InvalidRequestError, match="a packed RouteQuery has 3 items, not 9"):
        unpack(api.RouteQuery, packed[:3])
    with pytest.raises(InvalidRequestError, match="packed RequestFinished"):
        unpack_event("request_finished", packed)
    # bits past the fields name nothing
    wide = unpack(api.RouteQuery, (*packed[:-1], packed[-1] | 1 << 40))
    assert wide.model_fields_set == {"session_id", "input_tokens"}
