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

Optional extensions (looked up with ``getattr``; the trained built-ins have them all, see
:mod:`kvprefetch.predictors.learned`):

* ``forecast_many(session_ids, now_s) -> list[ArrivalForecast | None]`` — one vectorised
  call for many sessions (``now_s`` one float or one per session); prefer it when
  re-planning many idle sessions.
* ``fit(trace, *, seed=None, progress=False) -> self`` — train (``kvprefetch train``).
* ``save(path)`` and classmethod ``load(path)`` — one versioned artifact file; the registry
  calls ``Class.load(path)`` for ``name:FILE`` specs.
* ``fitted: bool`` — false for a model that still needs training; the registry's ``load``
  refuses it at start-up.

Semantics of a forecast: ``gap_quantiles_s`` are conditional on the session returning (and,
when ``now_s`` is later than the last finish, on it not having returned yet);
``p_return`` is the probability of returning within ``horizon_s`` of the last finish (the
trained models use "within the next 60 s from now", so their ``horizon_s`` is
``elapsed + 60``). :func:`kvprefetch.predictors.distribution.prob_return_within` converts any
forecast to another horizon.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvprefetch.controlplane.base.types import ArrivalForecast, SessionEvent


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
