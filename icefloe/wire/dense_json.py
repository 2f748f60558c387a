"""JSON documents whose arrays of numbers are read as machine numbers, never as Python objects.

A Python float costs 32 bytes and an int up to 36 for the 2 to 4 bytes a JSON number takes, so
:func:`json.loads` turned a 4 MiB array of numbers into 30 to 40 MiB. The service reads its JSON bodies
with :func:`loads`, and a DSSST1 header its structure tree (JSON written inside a JSON string) with
:func:`loads_escaped`. In a document over :data:`DENSE_FROM_BYTES`, every array of plain JSON numbers is read, a
slice at a time, into an :class:`array.array` of the narrowest type that holds each of its numbers
exactly as json reads it: int8 to int64 for integers, float32 or float64 for an array with a
fraction, an exponent, NaN or Infinity. An array with an integer that neither int64 nor (among
fractions) a double holds stays a list. So an array takes at most twice its text, but one of mostly
one-digit numbers with a few that need a wide type takes up to four times (about what json's list
of cached small ints took). The rest of the document, each such array replaced by a placeholder
string, is read by :func:`json.loads` (by orjson where a character is beyond the BMP and no duplicate
key is to be refused: see :func:`_remainder`); a smaller document by :func:`json.loads` alone.

An ``array.array`` acts as a list does where code reads a body (``len``, truth, ``==``, ``in``,
iteration yields Python numbers), where a numpy array would raise; ``numpy.asarray`` views it
without a copy, and pickling it costs its bytes.
"""

from __future__ import annotations

import array
import bisect
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

__all__ = ["DENSE_FROM_BYTES", "MAX_INEXACT_NUMBERS", "as_lists", "loads", "loads_escaped"]

# Smaller documents are read by json alone: their arrays cost little, and the swap would cost more.
DENSE_FROM_BYTES = 64 * 1024
# Numbers a document may hold in arrays that no machine type holds exactly (an integer beyond 64 bits, or
# one of 2**53 or more among fractions): json reads each as a Python object of 24 to 36 bytes, plus its
# list's 8, for as few as 2 bytes of text, so these cost at most about 5 MB.
MAX_INEXACT_NUMBERS = 131_072

# A string is passed over whole (brackets inside it are text); an array holding only the characters of
# numbers is a candidate, whose slices the JSON parsers then check as they read them.
_STRING_OR_NUMBERS = re.compile(
    rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|\[(?P<numbers>[ \t\n\r]*+[-0-9NI][-+0-9.eE,NaInfity \t\n\r]*+)\]', re.DOTALL
)
_FLOAT_MARKS = (b".", b"e", b"E", b"N", b"I")  # a fraction, an exponent, NaN, Infinity
_INTEGERS = "bhiq"  # array.array's int8, int16, int32, int64
_FLOATS = "fd"  # float32, float64
_BEYOND_BMP = re.compile(rb"[\xf0-\xf4]")  # the first byte of a 4-byte UTF-8 character
_BEYOND_64_BITS = re.compile(rb"[0-9]{20}")  # a run of digits that may be an integer over 2**64
_SLICE_BYTES = 64 * 1024  # read at a time: its Python numbers live only until they are copied
# In the text of a JSON string holding JSON (escaped once more): a string of that JSON, or an array of
# numbers. Only \" and \\ may be escaped there (see loads_escaped): a string's own escapes are written \\x.
_ESCAPED_STRING_OR_NUMBERS = re.compile(
    rb'\\"(?:[^"\\]++|\\\\(?:\\["\\]|[^"\\]))*+\\"|\[(?P<numbers>[ ]*+[-0-9NI][-+0-9.eE,NaInfity ]*+)\]'
)
_OTHER_ESCAPE = re.compile(rb'(?<!\\)(?:\\\\)*+\\[^"\\]')  # an escape but \" or \\ (a backslash run of odd length)
_ESCAPE = re.compile(rb'\\(["\\])')


PairsHook = Callable[[list[tuple[str, Any]]], dict[str, Any]]


def loads(raw: bytes | str, *, pairs_hook: PairsHook | None = None) -> Any:
    """:func:`json.loads`, except that in a document over ``DENSE_FROM_BYTES`` each non-empty array of
    numbers comes back as an ``array.array``. Raises what :func:`json.loads` raises; a position in a
    large document's error is a byte offset. ``pairs_hook``: json's ``object_pairs_hook``."""
    if len(raw) <= DENSE_FROM_BYTES:
        return json.loads(raw, object_pairs_hook=pairs_hook)
    data = raw.encode() if isinstance(raw, str) else raw
    swapped = _Swapped(data)
    text = _swap(data, 0, len(data), _STRING_OR_NUMBERS, swapped.numbers)
    try:
        value = _remainder(text, pairs_hook)
    except json.JSONDecodeError as exc:
        raise swapped.error(exc) from None
    return swapped.put_back(value)


def loads_escaped(data: bytes | bytearray, start: int, end: int, *, pairs_hook: PairsHook | None = None) -> Any:
    """The JSON document whose text, escaped as the inside of a JSON string, is ``data[start:end]``, read as
    :func:`loads` reads it, without a copy of the whole text: strings are unescaped one by one, and
    arrays of numbers read from ``data`` itself (so a DSSST1 header's tree costs its arrays, not a copy).
    Where the text escapes anything but ``"`` and ``\\`` (a writer of JSON in JSON never does), it is
    unescaped whole first. Raises what :func:`json.loads` raises; a large document's error position is
    one in the text without its arrays."""
    if end - start <= DENSE_FROM_BYTES or _OTHER_ESCAPE.search(data, start, end) is not None:
        return loads(json.loads(b'"' + data[start:end] + b'"'), pairs_hook=pairs_hook)
    swapped = _Swapped(data)

    def unescape(match: re.Match[bytes]) -> bytes:
        if match.start("numbers") >= 0:
            return swapped.numbers(match) or match[0]
        return _ESCAPE.sub(rb"\1", match[0])

    return swapped.put_back(_remainder(_swap(data, start, end, _ESCAPED_STRING_OR_NUMBERS, unescape), pairs_hook))


def _swap(data: bytes | bytearray, start: int, end: int, pattern: re.Pattern[bytes], replace: Any) -> bytes:
    """``pattern.sub(replace, data[start:end])``, without copying ``data[start:end]`` first; a match
    ``replace`` answers None for stays in the text uncut (a body of 65,536 short strings, each cut out
    and joined back as two pieces, cost eight times its size while it was read)."""
    parts, at = [], start
    for match in pattern.finditer(data, start, end):
        replacement = replace(match)
        if replacement is not None:
            parts += (data[at : match.start()], replacement)
            at = match.end()
    parts.append(data[at:end])
    return b"".join(parts)


class _Swapped:
    """The arrays of numbers :func:`loads` took out of ``data``, each a placeholder string in the text json reads."""

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data
        self.prefix = secrets.token_hex(8) + ":"  # no client writes a string that starts so but by chance
        self.arrays: list[array.array] = []
        self.ends: list[int] = []  # where each placeholder ends in the text json reads
        self.removed: list[int] = []  # bytes of ``data`` the placeholders up to there left out
        self.inexact = 0  # numbers of the arrays left to json

    def numbers(self, match: re.Match[bytes]) -> bytes | None:
        """The placeholder of the array of numbers ``match`` found, or None to leave it to json."""
        start, end = match.span("numbers")
        dense = None if start < 0 else _dense(self.data, start, end)
        if dense is None:
            if start >= 0:
                self._left_to_json(start, end)
            return None
        placeholder = f'"{self.prefix}{len(self.arrays)}"'.encode()
        self.arrays.append(dense)
        before = self.removed[-1] if self.removed else 0
        self.ends.append(match.start() - before + len(placeholder))
        self.removed.append(before + match.end() - match.start() - len(placeholder))
        return placeholder

    def _left_to_json(self, start: int, end: int) -> None:
        """Count an array of numbers json will read one by one; a JSONDecodeError past :data:`MAX_INEXACT_NUMBERS`."""
        self.inexact += self.data.count(b",", start, end) + 1
        if self.inexact > MAX_INEXACT_NUMBERS:
            raise json.JSONDecodeError(
                f"more than {MAX_INEXACT_NUMBERS} numbers in arrays that no machine type holds exactly (an integer "
                f"beyond 64 bits, or one of 2**53 or more among fractions; the last such array is at byte {start}): "
                "send such integers as strings, or apart from the fractions",
                "",
                0,
            )

    def error(self, exc: json.JSONDecodeError) -> json.JSONDecodeError:
        """``exc`` at its byte offset in ``data``."""
        at = len(exc.doc[: exc.pos].encode("utf-8", "surrogatepass"))
        shift = bisect.bisect_right(self.ends, at)
        return _error(exc, self.data, at + (self.removed[shift - 1] if shift else 0))

    def put_back(self, value: Any) -> Any:
        return _put_back(value, self.prefix, self.arrays) if self.arrays else value


def _remainder(text: bytes, pairs_hook: PairsHook | None) -> Any:
    """The document without its dense arrays. json first decodes the whole text into one string, which
    takes 4 bytes a character once one of them is beyond the BMP: such a text is read by orjson, which
    builds no such string, but reads an integer beyond 64 bits as a double (so one is refused there) and
    takes no ``pairs_hook`` (so a text that must refuse duplicate keys is read by json)."""
    if pairs_hook is not None or _BEYOND_BMP.search(text) is None:
        return json.loads(text, object_pairs_hook=pairs_hook)
    if _BEYOND_64_BITS.search(text) is not None:
        raise ValueError("a body with a character beyond the BMP takes no integer beyond 64 bits; send it as a string")
    return orjson.loads(text)


def _dense(data: bytes, start: int, end: int) -> array.array | None:
    """The numbers of ``data[start:end]`` (an array's text between its brackets) as an ``array.array``;
    None to leave them to json."""
    count = data.count(b",", start, end) + 1
    floating = any(data.find(mark, start, end) >= 0 for mark in _FLOAT_MARKS)
    numbers, filled = None, 0
    while start < end:
        stop = data.find(b",", min(start + _SLICE_BYTES, end), end)
        stop = end if stop < 0 else stop
        block = np.array(_values(data, start, stop))
        if block.dtype.kind not in ("if" if floating else "i") or (floating and not _exact(block, data, start, stop)):
            return None  # an integer beyond int64, or (among fractions) a double: json keeps it exact
        code = _narrowest(block, (_FLOATS if floating else _INTEGERS)[0] if numbers is None else numbers.typecode)
        if numbers is None:
            numbers = array.array(code, [0]) * count
        elif code != numbers.typecode:  # copied into the wider type once
            wider = array.array(code, [0]) * count
            np.frombuffer(wider, dtype=code)[:filled] = np.frombuffer(numbers, dtype=numbers.typecode)[:filled]
            numbers = wider
        np.frombuffer(numbers, dtype=code)[filled : filled + len(block)] = block
        filled, start = filled + len(block), stop + 1
    return numbers


def _narrowest(block: np.ndarray, code: str) -> str:
    """The narrowest type, ``code`` or a wider one of its kind, that holds each number of ``block`` exactly."""
    kinds = _FLOATS if code in _FLOATS else _INTEGERS
    with np.errstate(over="ignore", invalid="ignore"):
        for wider in kinds[kinds.index(code) : -1]:
            if np.array_equal(block.astype(wider), block, equal_nan=kinds is _FLOATS):
                return wider
    return kinds[-1]


def _exact(block: np.ndarray, data: bytes, start: int, stop: int) -> bool:
    """Whether the doubles of a slice of a float array are the numbers json reads there: an integer from
    2**53 on may not be (and orjson reads one beyond 64 bits as a double)."""
    doubles = block.astype(np.float64)
    with np.errstate(invalid="ignore"):  # NaN
        large = np.flatnonzero(np.abs(doubles) >= 2**53)
    if not len(large):
        return True
    values = json.loads(b"[" + data[start:stop] + b"]")
    return all(type(values[i]) is not int or int(doubles[i]) == values[i] for i in large)


def _values(data: bytes, start: int, stop: int) -> list[Any]:
    """The numbers of one slice, read by orjson, or by json where it holds NaN or Infinity (which orjson refuses)."""
    text = b"[" + data[start:stop] + b"]"
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _error(exc, data, start + exc.pos - 1) from None


def _error(exc: json.JSONDecodeError, data: bytes, at: int) -> json.JSONDecodeError:
    return json.JSONDecodeError(exc.msg, data.decode("latin-1"), at)  # latin-1: one character per byte


def as_lists(value: Any) -> Any:
    """``value`` (in place) with each ``array.array`` :func:`loads` made turned back into the list it was."""
    return _replace(value, lambda leaf: leaf.tolist() if type(leaf) is array.array else leaf)


def _put_back(value: Any, prefix: str, arrays: list[array.array]) -> Any:
    """``value`` (in place) with each placeholder string replaced by its array."""

    def array_of(leaf: Any) -> Any:
        return arrays[int(leaf[len(prefix) :])] if type(leaf) is str and leaf.startswith(prefix) else leaf

    return _replace(value, array_of)


def _replace(value: Any, change: Callable[[Any], Any]) -> Any:
    """``value`` with each leaf (neither dict nor list) replaced by ``change(leaf)``, in place."""
    if type(value) not in (dict, list):
        return change(value)
    pending = [value]
    while pending:
        node = pending.pop()
        for key, child in node.items() if type(node) is dict else enumerate(node):
            if type(child) in (dict, list):
                pending.append(child)
            else:
                changed = change(child)
                if changed is not child:
                    node[key] = changed
    return value
