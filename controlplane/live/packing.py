"""The calls sent for every request, and the route answer, as plain tuples on Ray.

Ray pickles each argument of an actor call with its own pickler, which calls back into
Python for every object it meets that is not a plain value. A pydantic model is such an
object, and it pickles as its field dict, the set of fields given and two Nones, each a
call back into Python. Packed, a call is a tuple of the field values, in the model's field
order, then a bit mask of the fields given: all plain values that the C pickler writes
alone (`kvprefetch bench control-plane --modes ray-1` shows the route rate it buys).

Only the types that cross once per request are packed (:data:`PACKED`: the route query,
``request_started``, ``request_finished`` and the route answer); hints, closes, reports
and everything else cross as models. :func:`unpack` rebuilds the model without validating
it again: the sender validated it (:func:`kvprefetch.controlplane.base.api.parse`) and runs the same
code; a tuple of the wrong length is refused with the type named.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, TypeVar

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError

_M = TypeVar("_M", bound=api.RouteQuery | api.RequestStarted | api.RequestFinished
             | api.RouteAnswer)

#: The packed types, and the event kinds of
#: :class:`~kvprefetch.controlplane.live.client.EventBatcher`
#: whose calls are packed.
PACKED: tuple[type[Any], ...] = (api.RouteQuery, api.RequestStarted, api.RequestFinished,
                                 api.RouteAnswer)
EVENT_TYPES: dict[str, type[Any]] = {"request_started": api.RequestStarted,
                                     "request_finished": api.RequestFinished}


class _Layout:
    """One packed type: its field names in order, and how to read and rebuild them."""

    __slots__ = ("all_bits", "bits", "given", "names", "values")

    def __init__(self, model: type[Any]) -> None:
        self.names: tuple[str, ...] = tuple(model.model_fields)
        self.bits = {name: 1 << i for i, name in enumerate(self.names)}
        self.values = itemgetter(*self.names)
        self.all_bits = (1 << len(self.names)) - 1
        #: The set of fields given, by mask (filled as masks are met; at most 2^fields).
        self.given: dict[int, frozenset[str]] = {}

    def given_set(self, mask: int) -> set[str]:
        mask &= self.all_bits  # bits past the fields name nothing (and the cache stays bounded)
        names = self.given.get(mask)
        if names is None:
            names = self.given[mask] = frozenset(
                n for i, n in enumerate(self.names) if mask >> i & 1)
        return set(names)


_LAYOUTS = {model: _Layout(model) for model in PACKED}
_set = object.__setattr__


def pack(model: Any) -> Any:
    """``model`` as a tuple when its type is in :data:`PACKED`; anything else as it is."""
    layout = _LAYOUTS.get(type(model))
    if layout is None:
        return model
    mask = 0
    bits = layout.bits
    for name in model.__pydantic_fields_set__:
        mask |= bits[name]
    return (*layout.values(model.__dict__), mask)


def unpack(model: type[_M], packed: Any) -> _M:
    """The ``model`` that :func:`pack` made ``packed`` from; a value that is not a tuple is
    returned as it is (a sender that did not pack it)."""
    if type(packed) is not tuple:
        return packed
    layout = _LAYOUTS[model]
    if len(packed) != len(layout.names) + 1:
        raise InvalidRequestError(f"a packed {model.__name__} has {len(packed)} items, "
                                  f"not {len(layout.names) + 1}")
    out = model.__new__(model)
    # zip stops at the names, before the mask; a strict= keyword would cost 0.35 us here.
    _set(out, "__dict__", dict(zip(layout.names, packed)))  # noqa: B905
    _set(out, "__pydantic_fields_set__", layout.given_set(packed[-1]))
    _set(out, "__pydantic_extra__", None)
    _set(out, "__pydantic_private__", None)
    return out


def unpack_event(kind: str, call: Any) -> Any:
    """A batched event's call as the service takes it (a packed one rebuilt)."""
    model = EVENT_TYPES.get(kind)
    return call if model is None else unpack(model, call)
