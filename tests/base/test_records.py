"""quick_init: the faster constructor of frozen records keeps what the dataclass promised."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any

import pytest

from kvprefetch.controlplane.base.records import quick_init
from kvprefetch.controlplane.base.types import (
    FORECAST_LEVELS,
    ArrivalForecast,
    EventKind,
    SessionEvent,
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    a: int
    b: str = "x"
    c: tuple[float, ...] = (1.0,)


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Quick:
    a: int
    b: str = "x"
    c: tuple[float, ...] = (1.0,)


def test_same_signature_defaults_and_values_as_the_generated_init() -> None:
    assert inspect.signature(_Quick) == inspect.signature(_Plain)
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}), ((1, "y"), {}), ((2,), {"c": (3.0,)}), ((), {"a": 4, "b": "z", "c": ()})]
    for args, kwargs in cases:
        quick, plain = _Quick(*args, **kwargs), _Plain(*args, **kwargs)
        assert dataclasses.astuple(quick) == dataclasses.astuple(plain)
    with pytest.raises(TypeError):
        _Quick()  # type: ignore[call-arg]  # a is required
    with pytest.raises(TypeError):
        _Quick(1, "y", (), 5)  # type: ignore[call-arg]  # too many


def test_the_records_stay_frozen_equal_hashable_and_picklable() -> None:
    fc = ArrivalForecast("s", 1.0, (1.0, 2.0, 3.0), 0.5, 60.0, 0.4, conditioned=True)
    assert fc.levels == FORECAST_LEVELS and fc.survival is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        fc.p_return = 0.9  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(fc))
    assert again == fc and hash(again) == hash(fc)
    assert dataclasses.replace(fc, p_return=0.9).p_return == 0.9
    ev = SessionEvent(EventKind.REQUEST_STARTED, "t/s", 2.0, input_tokens=7)
    assert (ev.turn, ev.input_tokens, ev.tenant) == (0, 7, "default")
    assert repr(ev).startswith("SessionEvent(kind=")


def test_refuses_classes_it_cannot_serve_exactly() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    for cls in (NoSlots, Factory, Checked, Mutable):
        with pytest.raises(TypeError):
            quick_init(cls)
