"""The gateway-facing operations as pydantic models: the one schema shared by the Python
client, the HTTP API (and its OpenAPI document) and the scheduler service.

Every call names its ``tenant``; session ids are the gateway's (unique per tenant). The
size of a request is given as ``input_tokens``, or as ``token_ids`` (the service then keys
the session's chunks by content, as LMCache does), or as ``input_tokens`` plus precomputed
``chunk_hashes``.

Numbers are JSON numbers: ``true``/``false`` and strings such as ``"5"`` are refused where
the schema says integer or number (pydantic alone would take them), and ``5.0`` counts as
the integer 5, as in JSON Schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvprefetch.controlplane.base.errors import InvalidRequestError, MalformedHintError
from kvprefetch.controlplane.base.vocabulary import canonical_stop_reason

#: Every stop reason the API takes (see :mod:`kvprefetch.controlplane.base.vocabulary`).
StopReasonName = Literal["tool_use", "end_turn", "max_tokens", "stop_sequence", "refusal",
                         "pause_turn", "aborted", "tool_calls", "function_call", "stop",
                         "length", "content_filter", "abort"]


def _not_bool_or_text(kind: str, what: str) -> BeforeValidator:
    """A check, run before pydantic's own, that refuses ``true``/``false`` and strings
    (``"5"``) where the schema says ``kind``: pydantic's lax mode would take them as 1/0
    and 5, which the OpenAPI document does not allow. Integral floats (``5.0``) stay
    accepted for integers, as JSON Schema counts them as integers. Put it after any
    ``Field`` constraints in ``Annotated[...]`` (so that it runs first and the
    constraints stay in the JSON schema)."""

    def check(value: Any) -> Any:
        if isinstance(value, bool | str | bytes):
            raise PydanticCustomError(kind, f"Input should be a valid {what}")
        return value

    return BeforeValidator(check)


#: JSON integers and numbers only (see :func:`_not_bool_or_text`).
JSON_INT = _not_bool_or_text("int_type", "integer")
JSON_NUMBER = _not_bool_or_text("float_type", "number")


def _ints_only(value: Any) -> Any:
    # One pass over the types, then pydantic's own (fast) check of each item: a check per
    # item would make a million token ids 5 times slower to validate.
    if isinstance(value, list) and not set(map(type, value)) <= {int}:
        for index, item in enumerate(value):
            if isinstance(item, bool | str | bytes):
                raise PydanticCustomError("int_type", "Input should be a valid integer "
                                          "(item {index})", {"index": index})
    return value


#: A list of JSON integers (``JSON_INT`` for each item, at the cost of one pass).
JSON_INTS = BeforeValidator(_ints_only)

Name = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+=-]+$")]
Tokens = Annotated[int, Field(ge=0, le=100_000_000), JSON_INT]
#: A hint ETA: at most one day.
EtaSeconds = Annotated[float, Field(ge=0, le=86_400), JSON_NUMBER]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: Session ids may contain '/' (Claude Code sub-agents: ``parent/agent_002``).
SessionName = Annotated[str, Field(min_length=1, max_length=256,
                                   pattern=r"^[A-Za-z0-9._:@+=/-]+$")]


class _SessionCall(_Model):
    tenant: Name = "default"
    session_id: SessionName


class _Sized(_SessionCall):
    input_tokens: Tokens | None = None
    token_ids: Annotated[list[int], JSON_INTS] | None = Field(None, max_length=10_000_000)
    chunk_hashes: list[Annotated[str, Field(min_length=1, max_length=128,
                                            pattern=r"^[A-Za-z0-9_-]+$")]] | None = None
    #: Tokens of the previous context this request reuses (default: all of it).
    reused_tokens: Tokens | None = None
    parent_id: SessionName | None = None

    @model_validator(mode="after")
    def _size(self) -> _Sized:
        if self.token_ids is not None:
            if self.chunk_hashes is not None:
                raise ValueError("give token_ids or chunk_hashes, not both")
            if self.input_tokens is not None and self.input_tokens != len(self.token_ids):
                raise ValueError("input_tokens disagrees with len(token_ids)")
        elif self.input_tokens is None:
            raise ValueError("give input_tokens (optionally with chunk_hashes) or token_ids")
        return self

    @property
    def tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else int(self.input_tokens or 0)


class RequestStarted(_Sized):
    """A request of the session arrived at the gateway (before routing)."""


#: A route's request id: chosen by the caller (the Python client: 32 hex digits), unique
#: within its tenant for as long as the scheduler remembers it: while the request it routed
#: is in flight (its ``request_finished`` or the session's close forgets it), and after a
#: cancel.
RequestId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:@+=-]+$",
                                 description="the caller's id of this route, unique within "
                                             "its tenant (the Python client sends 32 hex "
                                             "digits): a call again with the same id and body "
                                             "answers what the first one did and applies "
                                             "nothing twice while the request is in flight; "
                                             "the same id with another body is refused "
                                             "(409)")]


class RouteQuery(_Sized):
    """Where should this request run? Records ``request_started`` too unless already sent
    for this request. With ``request_id`` the call is idempotent (see ``RequestId``)."""

    request_id: RequestId | None = None


class RequestFinished(_SessionCall):
    """The response ended on ``node``; the session's context is now
    ``input_tokens + output_tokens`` tokens (or ``context_tokens`` when given). ``node``
    None (a route that gave no advice: ``RouteAnswer.node`` None) is a finish on no known
    node: it is acknowledged and not recorded (``Ack.accepted`` False), as no node's books
    can take the context; the request stays in flight at the scheduler until the session's
    next finish on a node, or its close."""

    node: Annotated[int, Field(ge=0), JSON_INT] | None = Field(
        default=None,
        description="the index of the node that served the request, one of the fleet's "
                    "(422 when out of range); left out or null when the route gave no "
                    "node (its answer's node was null): the finish is then acknowledged "
                    "with accepted false and not recorded")
    input_tokens: Tokens
    output_tokens: Tokens = 0
    context_tokens: Tokens | None = None
    stop_reason: Annotated[StopReasonName, AfterValidator(canonical_stop_reason)] | None = Field(
        default=None,
        description="why the response ended: an OpenAI finish reason or an Anthropic stop "
                    "reason, stored as its canonical name (tool_calls and function_call -> "
                    "tool_use; stop -> end_turn; length -> max_tokens; content_filter -> "
                    "refusal; abort -> aborted; the canonical names are taken as they are)")
    local_tokens_read: Tokens | None = Field(
        default=None,
        description="prompt tokens the engine took from a cache instead of computing them "
                    "(vLLM: usage.prompt_tokens_details.cached_tokens), for engines that do "
                    "not report their local-tier reads themselves: a prefetch of the "
                    "session to this node that had landed when the request arrived then "
                    "counts as read, not wasted")
    #: Hashes of the whole context's chunks, when the gateway keys by content.
    chunk_hashes: list[Annotated[str, Field(min_length=1, max_length=128,
                                            pattern=r"^[A-Za-z0-9_-]+$")]] | None = None


HintKindName = Literal["user_typing", "tool_running", "session_closed"]


class Hint(_Model):
    """A typed hint: a person typing (``eta_s`` optional), a tool call running for about
    ``eta_s`` seconds, or the session closing."""

    kind: HintKindName
    eta_s: EtaSeconds | None = None

    @model_validator(mode="after")
    def _eta(self) -> Hint:
        if self.kind == "session_closed" and self.eta_s is not None:
            raise ValueError("a session_closed hint takes no eta_s")
        return self


class HintCall(_SessionCall):
    hint: Hint


class SessionClosed(_SessionCall):
    """The session will not return: its prefetches stop and its state is freed."""


class RouteAnswer(_Model):
    """Where to run the request. ``node`` None means: no advice (the call timed out or the
    scheduler is unavailable); run it anywhere, without prefetch."""

    node: int | None
    node_name: str | None = None
    estimated_ttft_s: float | None = None
    #: KV of the session is (or is arriving) in the chosen node's local tier.
    local_ready: bool = False
    timed_out: bool = False
    #: The query's ``request_id``: with it, a caller that got no answer (``timed_out``, or a
    #: 503) sends the same query again or cancels the route (``RouteCancel``).
    request_id: str | None = None

    @classmethod
    def no_prefetch(cls, *, timed_out: bool = True, request_id: str | None = None
                    ) -> RouteAnswer:
        return cls(node=None, timed_out=timed_out, request_id=request_id)


class RouteCancel(_SessionCall):
    """Undo the route ``request_id`` of this session, whose request the caller abandoned
    (its answer never came, or the request will not run)."""

    request_id: RequestId


#: What a cancel found: ``cancelled``, the route's request is undone (by this call or an
#: earlier cancel of the same id); ``unknown``, the scheduler remembers no route by that id
#: (never applied, its request already finished or its session closed, or forgotten past
#: ``route_memory_per_tenant``): nothing to undo; ``finished``, the route's request is no
#: longer the session's request in flight though its id is remembered: nothing undone.
CancelOutcome = Literal["cancelled", "unknown", "finished"]


class RouteCancelled(_Model):
    """A cancel's answer (see ``CancelOutcome``)."""

    request_id: str
    outcome: CancelOutcome


class Ack(_Model):
    """An event call's answer. ``accepted`` False: not recorded; ``timed_out`` says the
    scheduler did not answer in time, else it could not be reached (the Python client
    answers so rather than raise) or the call was a finish on no node
    (``RequestFinished``)."""

    accepted: bool = True
    timed_out: bool = False


#: The answer of an event call that was recorded or queued (frozen: one object serves every
#: call; it was a model built per event on the scheduler's and the batching client's paths).
ACCEPTED = Ack()


def parse(model: type[_Model], data: Any) -> Any:
    """Validate ``data`` as ``model``; raise the typed error a caller can catch."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            parts.append(f"{loc}: {err['msg']}")
        message = f"invalid {model.__name__}: " + "; ".join(parts)
        if model is HintCall or model is Hint:
            raise MalformedHintError(message) from None
        raise InvalidRequestError(message) from None
