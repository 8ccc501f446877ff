"""A call's body validated at the HTTP edge in bounded time and memory.

Who calls: the endpoints of :mod:`kvprefetch.controlplane.live.http_api`, once per call, on
the event loop, after :class:`~kvprefetch.controlplane.live.http_edge.EdgeGuard` has checked
the token and read the body within its limits.

* A small body (at most ``large_body_bytes``) is decoded with :func:`json.loads` and
  validated by the operation's model in one step; its lists stop at their first bad item,
  so the errors are at most one per field.
* A large body is taken apart member by member: every value but the ``token_ids`` and
  ``chunk_hashes`` arrays must be small (a few KiB), and those arrays are validated in
  slices of ``SLICE_BYTES`` with a pause for the event loop between slices (no step holds
  the interpreter for more than about a millisecond), stopping at the list's limit or
  after ``max_listed_errors`` bad items. The rest of the body is then validated by the
  operation's model with the checked lists passed through.

Either way a 422 lists at most ``max_listed_errors`` errors, and says whether there are
more; a bad body costs no more than the slices read before the errors were found.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, FailFast, SkipValidation, TypeAdapter, ValidationError, create_model

#: Bytes of a big list validated in one step (well under a millisecond of work).
SLICE_BYTES = 32 * 1024
#: Largest JSON value of a large body other than its big lists.
MAX_MEMBER_BYTES = 64 * 1024
#: Longest item of a big list, in bytes of JSON (ids and hashes are far shorter): a slice
#: never grows past SLICE_BYTES + MAX_ITEM_BYTES.
MAX_ITEM_BYTES = 1024

_WS = re.compile(rb"[ \t\n\r]*")
_KEY = re.compile(rb'"(?:[^"\\\x00-\x1f]|\\.){0,256}"')


#: What :func:`_json_value` answers for a body that is not JSON.
_UNDECODED = object()


def _json_value(body: bytes, errors: _Errors) -> Any:
    """The JSON value of ``body``, or :data:`_UNDECODED` with the reason added to
    ``errors``."""
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        errors.add(str(exc.pos), f"JSON decode error: {exc.msg}", "json_invalid")
    except UnicodeDecodeError as exc:
        errors.add("", f"invalid body: {exc.reason} (expected JSON in UTF-8)", "json_invalid")
    return _UNDECODED


@dataclass(frozen=True, slots=True)
class FieldProblem:
    """One validation error: ``loc`` dotted (``token_ids.7``; ``(root)`` for the body)."""

    loc: str
    msg: str
    type: str


@dataclass(frozen=True, slots=True)
class Invalid:
    """Why a body was refused: its first errors, and whether it has more than those."""

    problems: tuple[FieldProblem, ...]
    more: bool = False


@dataclass(frozen=True, slots=True)
class BigList:
    """A list field that may be large: its item type and its longest length.
    ``int_range``: the items are integers in this closed range (JSON integers; integral
    numbers such as ``5.0`` too), checked without pydantic where the slice allows."""

    item: Any
    max_items: int
    int_range: tuple[int, int] | None = None


class _Errors:
    """Collects at most ``limit`` problems."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[FieldProblem] = []
        self.more = False

    @property
    def full(self) -> bool:
        return len(self.items) >= self.limit

    def add(self, loc: str, msg: str, kind: str) -> None:
        if self.full:
            self.more = True
        else:
            self.items.append(FieldProblem(loc or "(root)", msg, kind))

    def add_pydantic(self, exc: ValidationError, prefix: tuple[str, ...] = (),
                     offset: int = 0) -> None:
        """The first errors of ``exc`` (only those listed are turned into dicts)."""
        listed = 0
        for err in exc.errors(include_url=False, include_input=False, include_context=False):
            if self.full:
                self.more = True
                return
            loc = list(err.get("loc", ()))
            if prefix and loc and isinstance(loc[0], int):
                loc[0] = loc[0] + offset
            self.add(".".join(str(p) for p in (*prefix, *loc)), str(err.get("msg", "")),
                     str(err.get("type", "")))
            listed += 1
        if exc.error_count() > listed:
            self.more = True

    def result(self) -> Invalid:
        return Invalid(tuple(self.items), self.more)


class BodyValidator:
    """Validates one operation's JSON body as ``model`` (see the module docstring).
    ``lists``: the model's fields that may be large; ``large_body_bytes``: bodies above it
    take the sliced path; ``max_errors``: errors listed at most."""

    def __init__(self, model: type[BaseModel], lists: Mapping[str, BigList], *,
                 large_body_bytes: int, max_errors: int) -> None:
        self.model = model
        self.large_body_bytes = large_body_bytes
        self.max_errors = max_errors
        self.lists = {name: spec for name, spec in lists.items() if name in model.model_fields}
        # Each stops at its first bad item: one slice costs at most its own parse.
        self._items: dict[str, TypeAdapter[list[Any]]] = {
            name: TypeAdapter(_fail_fast_list(spec.item)) for name, spec in self.lists.items()}
        # The model with its big lists taken as they are (checked slice by slice before).
        passed: Any = SkipValidation[list[Any] | None]  # type: ignore[misc]
        shell_fields: dict[str, Any] = {name: (passed, None) for name in self.lists}
        self._shell: type[BaseModel] = create_model(model.__name__, __base__=model,
                                                    **shell_fields)

    async def validate(self, body: bytes, content_type: str | None) -> BaseModel | Invalid:
        """The body as a model instance, or why it is refused."""
        errors = _Errors(self.max_errors)
        if not body:
            errors.add("", "Field required", "missing")
            return errors.result()
        if not _is_json(content_type):
            errors.add("", "Input should be a valid dictionary or object to extract fields "
                           "from", "model_attributes_type")
            return errors.result()
        if len(body) <= self.large_body_bytes:
            return self._small(body, errors)
        return await self._large(body, errors)

    def _small(self, body: bytes, errors: _Errors) -> BaseModel | Invalid:
        value = _json_value(body, errors)
        if value is _UNDECODED:
            return errors.result()
        try:
            return self.model.model_validate(value)
        except ValidationError as exc:
            errors.add_pydantic(exc)
            return errors.result()

    async def _large(self, body: bytes, errors: _Errors) -> BaseModel | Invalid:
        members = _members(body, set(self.lists), errors)
        if members is None:
            return errors.result()
        checked: dict[str, Any] = {}
        for name, value in members.items():
            if isinstance(value, _RawList):
                checked[name] = await self._big_list(name, body, value, errors)
            elif name in self.lists and value is not None:  # small: not an array, or []
                try:
                    checked[name] = self._items[name].validate_python(value)
                except ValidationError as exc:
                    errors.add_pydantic(exc, (name,))
            else:
                checked[name] = value
            if errors.full:
                break
        if errors.items:
            return errors.result()
        try:
            return self._shell.model_validate(checked)
        except ValidationError as exc:
            errors.add_pydantic(exc)
            return errors.result()

    async def _big_list(self, name: str, body: bytes, raw: _RawList,
                        errors: _Errors) -> list[Any] | None:
        """The items of one big array, validated slice by slice (None when refused)."""
        spec, adapter = self.lists[name], self._items[name]
        out: list[Any] = []
        pos, end, index = raw.start, raw.end, 0
        failed = False
        while pos < end and not errors.full:
            cut = end
            if end - pos > SLICE_BYTES + MAX_ITEM_BYTES:
                cut = body.find(b",", pos + SLICE_BYTES, pos + SLICE_BYTES + MAX_ITEM_BYTES)
                if cut < 0:
                    errors.add(f"{name}.{index + body.count(b',', pos, pos + SLICE_BYTES)}",
                               f"an item longer than {MAX_ITEM_BYTES} bytes of JSON",
                               "too_long")
                    return None
            piece = body[pos:cut]
            if index + piece.count(b",") + 1 > spec.max_items:
                errors.add(name, f"List should have at most {spec.max_items} items",
                           "too_long")
                return None
            try:
                if spec.int_range is not None:
                    items, bad = _ints(piece, spec.int_range, adapter,
                                       errors.limit - len(errors.items) + 1)
                    for at, msg, kind in bad:
                        errors.add(f"{name}.{index + at}", msg, kind)
                    failed = failed or bool(bad)
                    if not failed:
                        out.extend(items)
                else:
                    out.extend(adapter.validate_json(b"[" + piece + b"]"))
                pos, index = cut + 1, index + piece.count(b",") + 1
            except (ValidationError, ValueError) as exc:
                failed = True
                k = _first_index(exc)
                if k is None:  # not a list of items at all: nothing more to find here
                    errors.add(name, _message(exc), _kind(exc))
                    return None
                self._add_item_error(errors, name, index + k, exc)
                skip = piece.split(b",", k + 1)
                if len(skip) <= k + 1:
                    pos, index = cut + 1, index + piece.count(b",") + 1
                else:
                    pos = cut - len(skip[-1])
                    index += k + 1
            await asyncio.sleep(0)  # let other calls run between slices
        if pos < end and errors.full:
            errors.more = True  # not looked at
        return None if failed else out

    def _add_item_error(self, errors: _Errors, name: str, index: int, exc: Exception) -> None:
        if isinstance(exc, ValidationError):
            err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
            errors.add(f"{name}.{index}", str(err.get("msg", "")), str(err.get("type", "")))
        else:
            errors.add(f"{name}.{index}", _message(exc), _kind(exc))


class BatchValidator:
    """Validates a batch of calls, ``{"events": [{"op": <operation>, ...its body}, ...]}``
    (a body of at most ``large_body_bytes``, as the edge guard reads a batch): 1 to
    ``max_items`` items, each an object whose ``op`` is one of ``models`` and whose other
    members are that operation's body, validated by its model. The errors name the item
    (``events.3.node``); a batch with any bad item is refused whole, listing at most
    ``max_errors`` errors."""

    def __init__(self, models: Mapping[str, type[BaseModel]], *, max_items: int,
                 max_errors: int) -> None:
        self.models = dict(models)
        self.max_items = max_items
        self.max_errors = max_errors

    def validate(self, body: bytes, content_type: str | None
                 ) -> list[tuple[str, BaseModel]] | Invalid:
        """The items as (operation, model instance), in order, or why the batch is
        refused."""
        errors = _Errors(self.max_errors)
        if not _is_json(content_type):
            errors.add("", "Input should be a valid dictionary or object to extract fields "
                           "from", "model_attributes_type")
            return errors.result()
        value = _json_value(body, errors) if body else None
        if value is _UNDECODED:
            return errors.result()
        if not isinstance(value, dict):
            errors.add("", "Input should be an object with the member events", "dict_type")
            return errors.result()
        for name in value:
            if name != "events":
                errors.add(str(name)[:64], "Extra inputs are not permitted", "extra_forbidden")
        items = value.get("events")
        if not isinstance(items, list):
            errors.add("events", "Input should be a valid list" if "events" in value
                       else "Field required", "list_type" if "events" in value else "missing")
            return errors.result()
        if not 1 <= len(items) <= self.max_items:
            errors.add("events", f"a batch carries 1 to {self.max_items} events "
                                 f"(max_batch_events), not {len(items)}",
                       "too_short" if not items else "too_long")
            return errors.result()
        out: list[tuple[str, BaseModel]] = []
        for index, item in enumerate(items):
            if errors.full:
                errors.more = True
                break
            op = item.get("op") if isinstance(item, dict) else None
            model = self.models.get(op) if isinstance(op, str) else None
            if model is None or not isinstance(op, str):
                if not isinstance(item, dict):
                    errors.add(f"events.{index}", "Input should be an object", "dict_type")
                else:
                    errors.add(f"events.{index}.op", "Input should be one of: "
                               + ", ".join(self.models), "literal_error"
                               if "op" in item else "missing")
                continue
            try:
                out.append((op, model.model_validate(
                    {k: v for k, v in item.items() if k != "op"})))
            except ValidationError as exc:
                errors.add_pydantic(exc, ("events", str(index)))
        if errors.items:
            return errors.result()
        return out


def _fail_fast_list(item: Any) -> Any:
    """``list[item]`` that stops at its first bad item."""
    return Annotated[list[item], FailFast()]


@dataclass(frozen=True, slots=True)
class _RawList:
    """A big array of the body, not yet read: the bytes between its brackets."""

    start: int
    end: int


def _first_index(exc: Exception) -> int | None:
    if isinstance(exc, ValidationError):
        loc = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        first = loc.get("loc", ())
        return first[0] if first and isinstance(first[0], int) else None
    return None


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        return str(err.get("msg", ""))
    return str(exc) or "Invalid JSON"


def _kind(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        return str(err.get("type", ""))
    return "json_invalid"


def _ints(piece: bytes, bounds: tuple[int, int], adapter: TypeAdapter[list[Any]],
          room: int) -> tuple[list[Any], list[tuple[int, str, str]]]:
    """The integers of one slice and its first ``room`` bad items (index in the slice,
    message, kind), from one :func:`json.loads` and one pass: a slice of valid ids is
    checked by type and range in single C-level passes, and only the items that fail them
    are looked at one by one (by ``adapter``, which names the error as for a small body)."""
    items = _json_items(piece)
    low, high = bounds
    if set(map(type, items)) <= {int} and (not items or (min(items) >= low
                                                         and max(items) <= high)):
        return items, []
    bad: list[tuple[int, str, str]] = []
    for at, item in enumerate(items):
        if type(item) is int and low <= item <= high:
            continue
        if isinstance(item, bool | str):  # as api.JSON_INTS: no booleans or strings
            bad.append((at, "Input should be a valid integer", "int_type"))
        else:
            try:
                items[at] = adapter.validate_python([item])[0]  # an integral float
                continue
            except ValidationError as exc:
                err = exc.errors(include_url=False, include_input=False,
                                 include_context=False)[0]
                bad.append((at, str(err.get("msg", "")), str(err.get("type", ""))))
        if len(bad) >= room:
            break
    return items, bad


def _json_items(piece: bytes) -> list[Any]:
    try:
        value = json.loads(b"[" + piece + b"]")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"Invalid JSON: {exc}") from None
    if not isinstance(value, list):  # pragma: no cover - a bracketed piece is a list
        raise ValueError("Invalid JSON")
    return value


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    main = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = main.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _members(body: bytes, big: set[str], errors: _Errors) -> dict[str, Any] | None:
    """The top-level members of a large JSON object: small values decoded, the arrays of
    ``big`` left as :class:`_RawList` (found by their closing bracket: a valid one holds
    none inside). None, with the reason in ``errors``, when the body is not such an
    object."""
    pos = _WS.match(body).end()  # type: ignore[union-attr]
    if body[pos:pos + 1] != b"{":
        errors.add("", "Input should be a valid dictionary or object to extract fields "
                       "from (a body this large must be a JSON object)",
                   "model_attributes_type")
        return None
    pos += 1
    out: dict[str, Any] = {}
    first = True
    while True:
        pos = _WS.match(body, pos).end()  # type: ignore[union-attr]
        if body[pos:pos + 1] == b"}" and first:
            pos += 1
            break
        key_match = _KEY.match(body, pos)
        if key_match is None:
            errors.add(str(pos), "JSON decode error: expected a short member name",
                       "json_invalid")
            return None
        try:
            key = json.loads(key_match.group())
        except (json.JSONDecodeError, UnicodeDecodeError):
            errors.add(str(pos), "JSON decode error: bad member name", "json_invalid")
            return None
        pos = _WS.match(body, key_match.end()).end()  # type: ignore[union-attr]
        if body[pos:pos + 1] != b":":
            errors.add(str(pos), "JSON decode error: expected ':'", "json_invalid")
            return None
        pos = _WS.match(body, pos + 1).end()  # type: ignore[union-attr]
        if key in big and body[pos:pos + 1] == b"[":
            close = body.find(b"]", pos + 1)
            if close < 0:
                errors.add(key, "JSON decode error: unterminated array", "json_invalid")
                return None
            inner_start = _WS.match(body, pos + 1).end()  # type: ignore[union-attr]
            out[key] = (_RawList(pos + 1, close) if inner_start < close else [])
            pos = close + 1
        else:
            decoded = _small_value(body, pos)
            if decoded is None:
                errors.add(key, f"JSON decode error: the value is not JSON or is longer "
                                f"than {MAX_MEMBER_BYTES} bytes", "json_invalid")
                return None
            out[key], pos = decoded
        first = False
        pos = _WS.match(body, pos).end()  # type: ignore[union-attr]
        sep = body[pos:pos + 1]
        if sep == b",":
            pos += 1
            continue
        if sep == b"}":
            pos += 1
            break
        errors.add(str(pos), "JSON decode error: expected ',' or '}'", "json_invalid")
        return None
    if _WS.match(body, pos).end() != len(body):  # type: ignore[union-attr]
        errors.add(str(pos), "JSON decode error: extra data", "json_invalid")
        return None
    return out


_DECODER = json.JSONDecoder()


def _small_value(body: bytes, pos: int) -> tuple[Any, int] | None:
    """The JSON value at ``pos`` and the offset after it, when it is valid and within
    :data:`MAX_MEMBER_BYTES`."""
    window = body[pos:pos + MAX_MEMBER_BYTES]
    try:
        text = window.decode()
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":
            return None
        text = window[:exc.start].decode()  # the window cut a character: it is not ours
    try:
        value, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None
    used = end if text.isascii() else len(text[:end].encode())
    return value, pos + used
