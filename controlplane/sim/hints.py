"""Client hints a simulated trace implies: "user typing" before human turns, "tool running"
(with an ETA) after tool calls. Pure: no I/O, no clock; every draw comes from the seeded
generator passed in (or one seeded from :attr:`HintConfig.seed`).

The simulator replays sessions closed-loop: request ``k`` arrives ``gap_s`` after the
*simulated* end of response ``k - 1``. A hint is therefore planned relative to that end:
:class:`PlannedHint` says "``after_finish_s`` seconds after the response before request
``turn`` ends, the client sends this hint". Every planned hint comes at or before the request
it precedes (``after_finish_s <= gap_s``), never before the previous response ended.

The model
---------
* **Coverage.** A share ``coverage`` of clients send hints. The choice is made once per
  session group (a Claude Code sub-agent runs inside its parent's client, so it shares the
  parent's choice), by one uniform draw per group: raising ``coverage`` with the same seed
  only adds groups, it never changes the hints of a group already covered.
* **Tool running** (:attr:`HintKind.TOOL_RUNNING`). At the end of a response whose stop
  reason is ``tool_use`` and that is followed by a request, the client reports the tool with
  ``eta_s = gap_s * exp(N(0, tool_eta_sigma))`` (log-normal noise, median 1) at
  ``after_finish_s = 0``. A session's last response has no following request, hence no true
  gap to add noise to, and gets no tool hint.
* **User typing** (:attr:`HintKind.USER_TYPING`). Before a human turn (request ``k >= 1``
  whose previous response did not stop for ``tool_use``) of a session without a parent (a
  sub-agent's input is written by its parent agent, not typed) the client reports that the
  user started typing, at ``arrival - typing time``, capped at the previous response's end.
  The hint carries no ETA: a typing indicator does not know when the user will send.

  - The text typed is estimated as ``new_tokens - previous output_tokens`` (at least 0): the
    new input of a turn also carries the previous response, and the trace's reused prefix
    (block hashes of the previous *input*) does not cover it.
  - Typing speed is drawn once per session, in words per minute, from a normal distribution
    with the mean and standard deviation of Dhakal et al., "Observations on Typing from 136
    Million Keystrokes", CHI 2018 (51.56 and 20.20 wpm over 168,000 participants), floored
    at :data:`MIN_WORDS_PER_MINUTE` so that the normal's left tail stays positive.
  - Words become tokens at ``tokens_per_word`` (1.3 by default: one BPE token is about
    three quarters of an English word, the usual rule of thumb for GPT-style tokenisers).

* **Abandoned typing.** Some typing indicators lead nowhere: the user starts a reply, then
  deletes it or walks away. A share ``abandon_share`` of all typing hints of a covered session
  are abandoned ones, i.e. ``abandon_share / (1 - abandon_share)`` extra hints per real one
  (rounded stochastically per session). Each lands in a *quiet gap* of the session, chosen
  uniformly with replacement: the gap after the session's last response (placed uniformly in
  its first ``abandon_quiet_s`` seconds: no request ever follows), or a human-turn gap in which
  at least ``abandon_quiet_s`` of silence separates the abandoned hint from the real typing
  hint of that gap (placed uniformly in ``[0, real hint - abandon_quiet_s]``). Abandoned hints
  are marked ``abandoned=True`` so reports can tell them apart; a predictor is not told.

Requests without a closed-loop gap (``gap_s is None``: open-loop traces such as Mooncake's)
get no hints: there is no previous-response timeline to place them on.

Random streams: the generator draws, per session in trace order, one coverage uniform (first
session of each group only) and two 64-bit seeds, one for the typing stream and one for the
tool stream. So the tool hints do not depend on whether typing hints are enabled, and the
reverse: the hints of ``kinds={typing, tool}`` are the union of those of each kind alone.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import HintKind, Trace, TraceRequest, TraceSession

#: The hint kinds a simulated client can send, by their name in the API and the CLI.
HINT_KIND_NAMES: dict[str, HintKind] = {
    "user_typing": HintKind.USER_TYPING,
    "tool_running": HintKind.TOOL_RUNNING,
}
#: Short names :func:`parse_hint_kinds` also accepts.
HINT_KIND_ALIASES: dict[str, HintKind] = {
    "typing": HintKind.USER_TYPING,
    "tool": HintKind.TOOL_RUNNING,
}

#: Dhakal et al., CHI 2018: mean and standard deviation of typing speed (words per minute).
DHAKAL_WPM_MEAN = 51.56
DHAKAL_WPM_SD = 20.20
#: Floor of the drawn typing speed (words per minute); not from the study, it only keeps the
#: normal's left tail (2.5 SD below the mean) from giving absurd or negative speeds.
MIN_WORDS_PER_MINUTE = 5.0
#: English words to BPE tokens (about 0.75 words per token).
DEFAULT_TOKENS_PER_WORD = 1.3

_STOP_TOOL_USE = "tool_use"


def parse_hint_kinds(text: str) -> frozenset[HintKind]:
    """Kinds from a comma-separated list of :data:`HINT_KIND_NAMES` ("user_typing,
    tool_running") or :data:`HINT_KIND_ALIASES`."""
    known = HINT_KIND_NAMES | HINT_KIND_ALIASES
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(
            f"hint kinds: expected a comma-separated subset of {', '.join(HINT_KIND_NAMES)}, "
            f"got {text!r}"
        )
    return frozenset(known[n] for n in names)


@dataclass(frozen=True, slots=True)
class HintConfig:
    """What the simulated clients send. Validated on construction (:class:`ConfigError`)."""

    #: Hint kinds sent: :attr:`HintKind.USER_TYPING` and/or :attr:`HintKind.TOOL_RUNNING`.
    kinds: frozenset[HintKind] = field(
        default=frozenset({HintKind.USER_TYPING, HintKind.TOOL_RUNNING})
    )
    #: Share of session groups (clients) that send hints, in [0, 1].
    coverage: float = 1.0
    #: Sigma of the log-normal noise (median 1) on tool-run ETAs; 0 = exact ETAs.
    tool_eta_sigma: float = 0.5
    #: Share of all typing hints that are abandoned (no request follows), in [0, 1).
    abandon_share: float = 0.0
    #: Typing speed distribution (words per minute), drawn once per session.
    words_per_minute_mean: float = DHAKAL_WPM_MEAN
    words_per_minute_sd: float = DHAKAL_WPM_SD
    #: Tokens per typed word.
    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD
    #: Seed of the generator :func:`plan_hints` builds when none is passed in.
    seed: int = 0
    #: Silence (seconds) that follows an abandoned typing hint before any request.
    abandon_quiet_s: float = 300.0

    def __post_init__(self) -> None:
        kinds = frozenset(self.kinds)
        object.__setattr__(self, "kinds", kinds)
        allowed = frozenset(HINT_KIND_NAMES.values())
        if not kinds <= allowed:
            bad = ", ".join(sorted(str(k) for k in kinds - allowed))
            raise ConfigError(f"hints.kinds: cannot simulate {bad}; allowed: "
                              f"{', '.join(sorted(str(k) for k in allowed))}")
        _check(0.0 <= self.coverage <= 1.0, "coverage", self.coverage, "in [0, 1]")
        _check(self.tool_eta_sigma >= 0.0, "tool_eta_sigma", self.tool_eta_sigma, ">= 0")
        _check(0.0 <= self.abandon_share < 1.0, "abandon_share", self.abandon_share,
               "in [0, 1)")
        _check(self.words_per_minute_mean > 0.0, "words_per_minute_mean",
               self.words_per_minute_mean, "> 0")
        _check(self.words_per_minute_sd >= 0.0, "words_per_minute_sd",
               self.words_per_minute_sd, ">= 0")
        _check(self.tokens_per_word > 0.0, "tokens_per_word", self.tokens_per_word, "> 0")
        _check(self.abandon_quiet_s > 0.0, "abandon_quiet_s", self.abandon_quiet_s, "> 0")


def _check(ok: bool, name: str, value: float, rule: str) -> None:
    # `not ok` also catches NaN, which fails every comparison.
    if not ok or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"hints.{name} must be {rule}, got {value!r}")


@dataclass(frozen=True, slots=True)
class PlannedHint:
    """One hint a client sends: ``after_finish_s`` seconds after the end of the response
    before request ``turn`` of ``session_id`` (so ``turn >= 1``; ``turn == len(requests)``
    for an abandoned hint after the session's last response)."""

    session_id: str
    turn: int
    kind: HintKind
    after_finish_s: float
    #: Expected seconds from the hint to the next request; None for typing hints.
    eta_s: float | None = None
    #: True for an abandoned typing hint: no request follows it soon.
    abandoned: bool = False


@dataclass(frozen=True, slots=True)
class HintCounts:
    """Hints by kind: ``typing`` counts the real typing hints only, ``abandoned`` the
    abandoned ones (typing hints too)."""

    typing: int = 0
    tool: int = 0
    abandoned: int = 0

    @property
    def total(self) -> int:
        return self.typing + self.tool + self.abandoned

    def add(self, hint: PlannedHint) -> HintCounts:
        """These counts and ``hint``."""
        if hint.abandoned:
            return HintCounts(self.typing, self.tool, self.abandoned + 1)
        if hint.kind is HintKind.TOOL_RUNNING:
            return HintCounts(self.typing, self.tool + 1, self.abandoned)
        return HintCounts(self.typing + 1, self.tool, self.abandoned)

    @classmethod
    def of(cls, hints: Iterable[PlannedHint]) -> HintCounts:
        counts = cls()
        for h in hints:
            counts = counts.add(h)
        return counts


def hint_kind_names(kinds: Iterable[HintKind]) -> tuple[str, ...]:
    """The names of ``kinds``, in :data:`HINT_KIND_NAMES` order."""
    chosen = set(kinds)
    return tuple(name for name, kind in HINT_KIND_NAMES.items() if kind in chosen)


def plan_hints(
    trace: Trace, config: HintConfig, rng: random.Random | None = None
) -> tuple[PlannedHint, ...]:
    """The hints ``trace`` implies under ``config``: sessions in trace order, and within a
    session by turn, then by ``after_finish_s``. ``rng`` defaults to
    ``random.Random(config.seed)``; see the module docstring for the model."""
    rng = rng if rng is not None else random.Random(config.seed)
    covered: dict[str, bool] = {}
    out: list[PlannedHint] = []
    for session in trace.sessions:
        group = session.parent_id or session.session_id
        if group not in covered:
            covered[group] = rng.random() < config.coverage
        typing_rng = random.Random(rng.getrandbits(64))
        tool_rng = random.Random(rng.getrandbits(64))
        if not covered[group]:
            continue
        hints: list[PlannedHint] = []
        if HintKind.TOOL_RUNNING in config.kinds:
            hints.extend(_tool_hints(session, config, tool_rng))
        if HintKind.USER_TYPING in config.kinds and session.parent_id is None:
            hints.extend(_typing_hints(session, config, typing_rng))
        hints.sort(key=lambda h: (h.turn, h.after_finish_s, h.kind))
        out.extend(hints)
    return tuple(out)


def hints_by_turn(hints: Iterable[PlannedHint]) -> dict[tuple[str, int], tuple[PlannedHint, ...]]:
    """``(session_id, turn) -> hints`` of that gap, in emission order: what a simulator
    looks up when the response before request ``turn`` ends."""
    grouped: dict[tuple[str, int], list[PlannedHint]] = {}
    for h in hints:
        grouped.setdefault((h.session_id, h.turn), []).append(h)
    return {k: tuple(sorted(v, key=lambda h: h.after_finish_s)) for k, v in grouped.items()}


# ---------------------------------------------------------------------------------------------
# Phases.
# ---------------------------------------------------------------------------------------------


def _gaps(session: TraceSession) -> Iterable[tuple[TraceRequest, TraceRequest, float]]:
    """(previous request, request, closed-loop gap) for every request after the first."""
    for prev, req in itertools.pairwise(session.requests):
        if req.gap_s is not None:
            yield prev, req, max(0.0, req.gap_s)


def _tool_hints(
    session: TraceSession, config: HintConfig, rng: random.Random
) -> list[PlannedHint]:
    hints = []
    for prev, req, gap in _gaps(session):
        if prev.stop_reason != _STOP_TOOL_USE:
            continue
        noise = math.exp(rng.gauss(0.0, config.tool_eta_sigma)) if config.tool_eta_sigma else 1.0
        hints.append(PlannedHint(session.session_id, req.turn, HintKind.TOOL_RUNNING, 0.0,
                                 eta_s=gap * noise))
    return hints


def typing_tokens_per_s(config: HintConfig, rng: random.Random) -> float:
    """One session's typing speed in tokens per second (see the module docstring)."""
    wpm = max(MIN_WORDS_PER_MINUTE,
              rng.gauss(config.words_per_minute_mean, config.words_per_minute_sd))
    return wpm * config.tokens_per_word / 60.0


def typed_tokens(prev: TraceRequest, req: TraceRequest) -> int:
    """Tokens the user typed for ``req``: its new input less the part of the previous
    response that its reused prefix does not already cover (a trace whose reused prefix
    is the previous *input*, as Claude Code's block hashes are, carries the whole
    response in the new input; one whose prefix runs through the response, none of it)."""
    uncovered = min(prev.output_tokens,
                    max(0, prev.input_tokens + prev.output_tokens - req.reused_tokens))
    return max(0, req.new_tokens - uncovered)


def _typing_hints(
    session: TraceSession, config: HintConfig, rng: random.Random
) -> list[PlannedHint]:
    tokens_per_s = typing_tokens_per_s(config, rng)
    sid = session.session_id
    hints: list[PlannedHint] = []
    # Quiet gaps for abandoned hints: (turn, latest emission time after the response end).
    quiet: list[tuple[int, float]] = []
    for prev, req, gap in _gaps(session):
        if prev.stop_reason == _STOP_TOOL_USE:
            continue
        typing_s = typed_tokens(prev, req) / tokens_per_s
        after = max(0.0, gap - typing_s)
        hints.append(PlannedHint(sid, req.turn, HintKind.USER_TYPING, after))
        if after > config.abandon_quiet_s:
            quiet.append((req.turn, after - config.abandon_quiet_s))
    if config.abandon_share <= 0.0 or not hints or not session.requests:
        return hints
    quiet.append((session.requests[-1].turn + 1, config.abandon_quiet_s))
    extra = config.abandon_share / (1.0 - config.abandon_share) * len(hints)
    count = int(extra) + (1 if rng.random() < extra - int(extra) else 0)
    for _ in range(count):
        turn, latest = quiet[rng.randrange(len(quiet))]
        hints.append(PlannedHint(sid, turn, HintKind.USER_TYPING, rng.uniform(0.0, latest),
                                 abandoned=True))
    return hints
