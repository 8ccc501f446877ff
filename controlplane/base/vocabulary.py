"""One vocabulary for why a response stopped and what a hint says.

Engines and APIs name the end of a response differently: OpenAI-compatible servers (vLLM,
SGLang, the gateway) give a ``finish_reason`` (``stop``, ``length``, ``tool_calls``),
Anthropic's Messages API a ``stop_reason`` (``end_turn``, ``max_tokens``, ``tool_use``).
Both are accepted everywhere a stop reason enters (the API, the gateway, trace loaders) and
mapped to one canonical set, which is what the predictors see:

========================  ==========================================  =====================
canonical                 accepted as                                 what a predictor reads
========================  ==========================================  =====================
``tool_use``              ``tool_use``, ``tool_calls``,               a tool runs, then the
                          ``function_call``                           session returns soon
``end_turn``              ``end_turn``, ``stop``                      a person reads and
                                                                      types the next turn
``max_tokens``            ``max_tokens``, ``length``                  cut off: often
                                                                      continued at once
``stop_sequence``         ``stop_sequence``                           as ``end_turn``
``refusal``               ``refusal``, ``content_filter``             often rephrased soon
``pause_turn``            ``pause_turn``                              the client resumes
``aborted``               ``abort`` (vLLM), ``aborted``               the client went away
========================  ==========================================  =====================

Hint kinds (:class:`~kvprefetch.controlplane.base.types.HintKind`) carry the same names in
the API, the CLI and the journal: ``user_typing`` (a person is composing the next turn;
``eta_s`` optional), ``tool_running`` (a tool call runs for about ``eta_s`` seconds) and
``session_closed`` (the session will not return).
"""

from __future__ import annotations

from typing import Final

#: The canonical stop reasons, in the order of the table above.
STOP_REASONS: Final = ("tool_use", "end_turn", "max_tokens", "stop_sequence", "refusal",
                       "pause_turn", "aborted")

#: Every accepted name -> its canonical stop reason.
STOP_REASON_ALIASES: Final[dict[str, str]] = {
    **{name: name for name in STOP_REASONS},
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "stop": "end_turn",
    "length": "max_tokens",
    "content_filter": "refusal",
    "abort": "aborted",
}

#: The hint kinds, as the API, the CLI and the journal name them.
HINT_KINDS: Final = ("user_typing", "tool_running", "session_closed")


def canonical_stop_reason(reason: str) -> str:
    """The canonical name of an OpenAI finish reason or an Anthropic stop reason; ValueError
    (naming the accepted ones) for anything else."""
    try:
        return STOP_REASON_ALIASES[reason]
    except (KeyError, TypeError):
        raise ValueError(f"unknown stop reason {reason!r}; accepted: "
                         f"{', '.join(STOP_REASON_ALIASES)}") from None


def stop_reason_or_none(reason: str | None) -> str | None:
    """For recorded traces: the canonical name, or None where the reason is missing or not
    one of the accepted names (an unknown reason carries no signal a predictor knows)."""
    return None if reason is None else STOP_REASON_ALIASES.get(reason)
