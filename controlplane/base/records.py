"""Frozen records made often: a faster ``__init__`` for frozen, slotted dataclasses.

A frozen dataclass's generated ``__init__`` sets each field through
``object.__setattr__`` (looked up and called once per field), which makes the records the
scheduler builds for every event (events, forecasts, routing requests and decisions, step
outputs) markedly slower to build than mutable ones (``kvprefetch bench control-plane
--modes inproc`` measures the pure core's events per second). :func:`quick_init` replaces it by one
that sets each slot through the slot's own descriptor, read once per class. The record stays
frozen (assignment still raises ``FrozenInstanceError``), equal, hashable and printable;
only construction is faster.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Give the frozen, slotted dataclass ``cls`` a descriptor-based ``__init__`` with the
    same signature and the same defaults. Apply it above ``@dataclass(frozen=True,
    slots=True)``. TypeError for a class it cannot serve exactly: not a frozen slotted
    dataclass, or with a ``__post_init__``, a ``default_factory``, an ``init=False`` or a
    keyword-only field."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init needs a frozen, slotted dataclass, not {cls.__name__}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__name__} has a __post_init__")
    scope: dict[str, Any] = {}
    args, body = [], []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"quick_init: field {cls.__name__}.{f.name} is not a plain "
                            "positional field")
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        scope[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        body.append(f"    _set_{f.name}(self, {f.name})\n")
    source = f"def __init__(self, {', '.join(args)}):\n{''.join(body) or '    pass'}\n"
    exec(source, scope)  # as dataclasses builds its own __init__
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__signature__ = inspect.signature(cls.__init__)
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
