"""Message fields, sans-IO: the checks a message field carries, and the schema that runs them.

A field check takes a value and returns it (normalised) or raises ``Invalid`` saying what was
expected; ``checked(check)`` declares a dataclass field with its check, and ``SCHEMAS`` holds,
per message class, what its fields need (computed once). ``messages.py`` and ``control.py``
declare every message with these; nothing here knows a message kind.

Invariants:
- A check accepts exactly what docs/protocol.md, section 2, allows: ints are exact ``int`` (not
  bool) in range, numbers are finite, text and names are bounded, maps have str keys and nest at
  most ``MAX_DEPTH`` deep, buffers are C-contiguous bytes-like objects.
- A check never copies what it accepts, except to normalise (int -> float, bytes-like -> bytes,
  buffer -> flat "B" memoryview). Number checks carry ``fast = (type, lo, hi)``: a value of
  exactly that type within [lo, hi] passes without calling the check (``Schema.checks``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "MAX_INT",
    "MAX_TEXT",
    "MAX_NAME",
    "MAX_BUFFERS",
    "MAX_DEPTH",
    "MAX_LIST",
    "Invalid",
    "Check",
    "integer",
    "number",
    "text",
    "blob",
    "boolean",
    "names",
    "ints",
    "pairs",
    "mapping",
    "views",
    "VALUE_TYPES",
    "INDEX_SCHEMES",
    "vector_codec",
    "Payload",
    "payload",
    "PAYLOAD_KEYS",
    "checked",
    "Schema",
    "SCHEMAS",
]


MAX_BUFFERS = 16  # raw buffers per frame; sparse packets use 2-3
MAX_TEXT = 4096  # characters of a free-text field (reason, address)
MAX_NAME = 64  # characters of a name field (role, code, encoding, capability)
MAX_INT = 2**63 - 1  # ints are signed 64-bit on the wire
MAX_DEPTH = 8  # nesting of lists/maps inside a map field
MAX_LIST = 1 << 16  # ints in a list field (a group's members, the workers a PULL waited for)
VALUE_TYPES = ("f32", "f16")  # a vector payload's value type (codec "value")
INDEX_SCHEMES = ("varint", "u32")  # a sparse payload's index coding (codec "index")


class Invalid(Exception):
    """A value a field does not allow; the message says what was expected."""


Check = Callable[[Any], Any]


def integer(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:  # type() is: bool is not an int here
            raise Invalid(f"expected an int in [{lo}, {hi}]")
        return v

    check.fast = (int, lo, hi)  # type: ignore[attr-defined]
    return check


def number(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(v: Any) -> float:
        t = type(v)
        if t is float:
            if lo <= v <= hi and v - v == 0.0:  # v - v is nan for inf and nan: finite only
                return v
        elif t is int and lo <= v <= hi:
            return float(v)
        elif t is not int:  # a numpy scalar, a string, ...: say so, the value may look right
            raise Invalid(f"expected a finite number (a Python float or int, not "
                          f"{t.__name__}) in [{lo}, {hi}]")
        raise Invalid(f"expected a finite number in [{lo}, {hi}]")

    # finite bounds for the fast path: inf and nan fail them and go through check()
    fast = (float, max(lo, -sys.float_info.max), min(hi, sys.float_info.max))
    check.fast = fast  # type: ignore[attr-defined]
    return check


def text(maxlen: int, choices: tuple[str, ...] = ()) -> Check:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > maxlen or (choices and v not in choices):
            within = f" in {choices}" if choices else ""
            raise Invalid(f"expected a str of <= {maxlen} chars{within}")
        return v

    return check


def blob(*sizes: int) -> Check:
    def check(v: Any) -> bytes:
        if type(v) is bytes and len(v) in sizes:
            return v
        if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) not in sizes:
            raise Invalid(f"expected bytes of length {' or '.join(map(str, sizes))}")
        return bytes(v)

    return check


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise Invalid("expected a bool")
    return v


def names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NAME:
        raise Invalid(f"expected a list of <= {MAX_NAME} names")
    name = text(MAX_NAME)
    return tuple([name(x) for x in v])


def ints(maxlen: int = MAX_LIST, lo: int = -MAX_INT) -> Check:
    def check(v: Any) -> list[int]:
        if (not isinstance(v, (list, tuple)) or len(v) > maxlen
                or not all(type(x) is int and lo <= x <= MAX_INT for x in v)):
            raise Invalid(f"expected a list of <= {maxlen} ints >= {lo}")
        return list(v)  # a list, as msgpack gives it back (records keep JSON lists)

    return check


def pairs(v: Any) -> list[list[int]]:
    """A short list of [int, int] (an exchange's session and seq; -1: none)."""
    pair = ints(2, -1)
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NAME:
        raise Invalid(f"expected a list of <= {MAX_NAME} [int, int] pairs")
    out = [pair(x) for x in v]
    if any(len(x) != 2 for x in out):
        raise Invalid("expected [int, int] pairs")
    return out


_PRIMITIVES = frozenset({type(None), bool, int, float, str, bytes})


def _tree(v: Any, depth: int) -> None:
    """Check (without copying) that a list or map holds only primitives, lists/tuples and maps
    with str keys, at most ``depth`` deep. Tuples come back from the wire as lists."""
    if depth <= 0:
        raise Invalid("nested too deep")
    if isinstance(v, dict):
        for k, x in v.items():
            if type(k) is not str:
                raise Invalid("map keys must be str")
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    else:
        raise Invalid(f"unsupported value of type {type(v).__name__}")


def mapping(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Invalid("expected a map")
    _tree(v, MAX_DEPTH)
    return v


def _flat(b: Any) -> memoryview:
    if type(b) is memoryview and b.format == "B" and b.ndim == 1 and b.c_contiguous:
        return b  # already what we hold (every decoded buffer is one)
    return memoryview(b).cast("B")  # cast() refuses non-contiguous arrays instead of copying


def views(v: Any) -> tuple[memoryview, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_BUFFERS:
        raise Invalid(f"expected a tuple of <= {MAX_BUFFERS} buffers")
    try:
        return tuple([_flat(b) for b in v])
    except TypeError as e:
        raise Invalid(f"buffers must be C-contiguous bytes-like objects ({e})") from None


def vector_codec(v: Any) -> dict[str, Any]:
    """The codec map of a vector payload (sparse.py): ``k`` (entries of a sparse
    vector), ``index`` and ``value`` (its index coding and value type). Other keys are
    refused; what depends on the model's size is checked on decode."""
    if type(v) is not dict:
        raise Invalid("expected a codec map")
    for key, x in v.items():
        if key == "k":
            ok = type(x) is int and 0 <= x <= MAX_INT
        elif key == "index":
            ok = x in INDEX_SCHEMES
        elif key == "value":
            ok = x in VALUE_TYPES
        else:
            raise Invalid("codec keys are k, index and value")
        if not ok:
            raise Invalid(f"bad codec {key!r}: k is an int >= 0, index one of {INDEX_SCHEMES}, "
                          f"value one of {VALUE_TYPES}")
    return v


class Payload(NamedTuple):
    """One vector as it travels (sparse.py encodes and decodes it): ``encoding`` and ``codec``
    go in the message's map under those two keys, ``buffers`` are the frame's body."""

    encoding: str
    codec: dict[str, Any]
    buffers: tuple[Any, ...]


_encoding = text(MAX_NAME)
PAYLOAD_KEYS = ("encoding", "codec")  # a payload's keys in the map (the buffers are the body)


def payload(v: Any) -> Payload:
    """A vector payload field: a ``Payload`` whose parts pass their checks (buffers held as
    flat memoryviews)."""
    if type(v) is not Payload:
        raise Invalid("expected a Payload (encoding, codec, buffers)")
    encoding, codec, buffers = v
    return Payload(_encoding(encoding), vector_codec(codec), views(buffers))


def checked(check: Check, default: Any = dataclasses.MISSING,
            factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field validated by ``check`` (one of the field checks above)."""
    return field(default=default, default_factory=factory, metadata={"check": check})


@dataclass(frozen=True)
class Schema:
    """What the code needs of a class's fields, computed once (dataclasses.fields() is slow)."""

    # (field, check, type, lo, hi) in declaration order; a value of exactly that type within
    # [lo, hi] is valid without calling check (numbers only; type None for other fields)
    checks: tuple[tuple[str, Check, Any, Any, Any], ...]
    wire_checks: tuple[tuple[str, Check, Any, Any, Any], ...]  # those of the map's fields
    meta: tuple[str, ...]  # the fields in the msgpack map, in order
    meta_set: frozenset[str]
    omissible: tuple[tuple[str, Callable[[], Any]], ...]  # MAY_OMIT's fields, their defaults


def _default_of(f: dataclasses.Field[Any]) -> Callable[[], Any]:
    """A field's default as a function: its factory, or one returning its value."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    value = f.default
    return lambda: value


class _Schemas(dict[type, Schema]):
    """class -> Schema, computed on first use; a hit is a plain dict lookup (no Python call).
    A message class names its fields kept out of the map (``NOT_IN_META``) and those a peer may
    leave out (``MAY_OMIT``)."""

    def __missing__(self, cls: Any) -> Schema:
        fields = dataclasses.fields(cls)
        checks = tuple((f.name, f.metadata["check"], *getattr(f.metadata["check"], "fast",
                                                               (None, 0, 0))) for f in fields)
        meta: list[str] = []
        wire_checks: list[tuple[str, Check, Any, Any, Any]] = []
        for c in checks:
            if c[1] is payload:  # a vector payload: its encoding and codec are two map keys
                meta += PAYLOAD_KEYS
                wire_checks += [("encoding", _encoding, None, 0, 0),
                                ("codec", vector_codec, None, 0, 0)]
            elif c[0] not in cls.NOT_IN_META:
                meta.append(c[0])
                wire_checks.append(c)
        omissible = tuple((f.name, _default_of(f)) for f in fields if f.name in cls.MAY_OMIT)
        schema = self[cls] = Schema(checks, tuple(wire_checks), tuple(meta), frozenset(meta),
                                    omissible)
        return schema


SCHEMAS = _Schemas()
