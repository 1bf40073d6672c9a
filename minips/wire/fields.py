"""Checks for message fields, sans-IO: each takes a value and returns it (normalised) or raises
``Invalid`` saying what was expected. ``messages.py`` attaches one to every field.

Invariants:
- A check accepts exactly what docs/protocol.md, section 2, allows: ints are exact ``int`` (not
  bool) in range, numbers are finite, text and names are bounded, maps have str keys and nest at
  most ``MAX_DEPTH`` deep, buffers are C-contiguous bytes-like objects.
- A check never copies what it accepts, except to normalise (int -> float, bytes-like -> bytes,
  buffer -> flat "B" memoryview). Number checks carry ``fast = (type, lo, hi)``: a value of
  exactly that type within [lo, hi] passes without calling the check.

Public API: ``Invalid``, ``Check``, ``integer``, ``number``, ``text``, ``blob``, ``boolean``,
``names``, ``ints`` (a list of ints), ``pairs`` (a list of [int, int]), ``mapping``,
``vector_codec`` (the codec map of a vector payload: ``VALUE_TYPES``, ``INDEX_SCHEMES``),
``views`` (a tuple of buffers), and the limits ``MAX_INT``, ``MAX_TEXT``, ``MAX_NAME``,
``MAX_BUFFERS``, ``MAX_DEPTH``, ``MAX_LIST``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "MAX_INT", "MAX_TEXT", "MAX_NAME", "MAX_BUFFERS", "MAX_DEPTH", "Invalid", "Check",
    "integer", "number", "text", "blob", "boolean", "names", "ints", "pairs", "mapping",
    "views", "vector_codec", "VALUE_TYPES", "INDEX_SCHEMES", "MAX_LIST",
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
    """The codec map of a vector payload (sparse_codec.py): ``k`` (entries of a sparse
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
