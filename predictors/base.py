"""The ``Predictor`` contract: models of when an idle session sends its next request.

Who calls what, and how often
-----------------------------
* ``observe(event)`` — the scheduler (live service or simulator) calls it for **every**
  session event, in time order per session: ``request_started``, ``request_finished``,
  ``hint``, ``session_closed``. Must be O(1) amortised and must not block: the live
  scheduler runs it inline on the event path.
* ``forecast(session_id, now_s)`` — the planner calls it after each ``request_finished``
  and ``hint`` of that session and whenever it re-plans (at most a few times per event).
  Must be cheap (well under a millisecond for heuristic models). It returns ``None`` when
  the session is unknown or currently has a request in flight. ``now_s`` may be later than
  the last finish: a forecast is then conditional on the session not having returned yet.
* ``forget(session_id)`` — called when a session is closed or expired; frees its state.
  Idempotent.

Predictors are deterministic given their inputs and their own seed; they do no I/O after
construction (trained artifacts are loaded by the registry before the run starts).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from controlplane.types import ArrivalForecast, SessionEvent


@runtime_checkable
class Predictor(Protocol):
    """A model of each session's next arrival. See the module docstring for the contract."""

    #: Registry name, e.g. ``"last-gap"``.
    name: str

    def observe(self, event: SessionEvent) -> None:
        """Fold one session event into the model's per-session state."""
        ...

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        """Next-arrival distribution of an idle session, or ``None`` if it has none."""
        ...

    def forget(self, session_id: str) -> None:
        """Drop all state of one session (idempotent)."""
        ...
