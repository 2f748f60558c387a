"""The Tinker API's request bodies: read without stalling the loop, every field's type and range checked.

A field of the wrong type, a non-finite number or a value out of range is a 400 naming the field, the
value and the fix, never a 500. The ordered routes read a body's ``model_id`` and ``seq_id`` first and
check the rest inside their turn, so such a refusal still uses up the ``seq_id``. A large body's arrays
of numbers arrive as ``array.array`` s (:mod:`icefloe.wire.dense_json`); :func:`int_array` reads
either form.
"""

from __future__ import annotations

import array
import asyncio
import math
import re
from typing import Any

import numpy as np
import orjson
from fastapi import Request

from icefloe.protocol import InvalidRequestError, PayloadTooLargeError
from icefloe.service.limits import CHECK_ON_LOOP_BYTES, MAX_JSON_BYTES, MAX_JSON_DEPTH, check_counts
from icefloe.wire import dense_json

__all__ = ["Fields", "checkpoint_name", "int_array", "json_body"]

_REQUIRED = object()
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


async def _read_capped(request: Request) -> bytes:
    """The raw body; :class:`PayloadTooLargeError` past :data:`MAX_JSON_BYTES` for a JSON route."""
    raw = await request.body()
    if len(raw) > MAX_JSON_BYTES:
        raise PayloadTooLargeError(
            f"the body is {len(raw)} bytes; a Tinker JSON body is at most {MAX_JSON_BYTES} bytes here"
        )
    return raw


async def json_body(request: Request) -> Fields:
    """The body's JSON object as :class:`Fields`; a large one is parsed on a worker thread."""
    raw = await _read_capped(request)
    value = await asyncio.to_thread(_parse, raw) if len(raw) > CHECK_ON_LOOP_BYTES else _parse(raw)
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the body must be a JSON object; got {type(value).__name__}")
    return Fields(value, size=len(raw))


def _parse(raw: bytes) -> Any:
    check_counts(raw, "the body", instead="split the data into smaller calls")
    if len(raw) <= CHECK_ON_LOOP_BYTES:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:  # a large body; or NaN / Infinity literals, which orjson refuses: refused by the field that holds them
        return dense_json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(f"the body nests deeper than {MAX_JSON_DEPTH} levels; flatten it") from None
    except dense_json.TooManyValues as exc:
        raise PayloadTooLargeError(f"the body {exc}: split the data into smaller calls") from None
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not valid JSON ({exc}); send a JSON object") from None


def int_array(value: Any, where: str, what: str, *, low: int, high: int) -> np.ndarray:
    """``value``, a list of integers or an ``array.array`` of them, as an integer array of values in
    ``[low, high)``; else :class:`InvalidRequestError` saying ``where`` must be ``what``."""
    listed = isinstance(value, list) and all(type(v) is int and low <= v < high for v in value)
    if not (listed or (type(value) is array.array and value.typecode in "bhiq")):  # int8 to int64
        raise InvalidRequestError(f"{where} must be {what}")
    values = np.asarray(value, dtype=np.int64 if listed else value.typecode)  # an array.array: viewed, not copied
    if len(values) and (values.min() < low or values.max() >= high):
        raise InvalidRequestError(f"{where} must be {what}")
    return values


def checkpoint_name(value: Any, where: str) -> str:
    """A checkpoint name that is a safe folder name: checked before anything is written."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        shown = value[:80] if isinstance(value, str) else value
        raise InvalidRequestError(
            f"{where} must be 1-128 of A-Z a-z 0-9 . _ - (starting with a letter or digit); got {shown!r}"
        )
    return value


class Fields:
    """One JSON object's fields, each read with its type checked; ``where`` prefixes the names in errors."""

    def __init__(self, value: dict[str, Any], where: str = "", *, size: int = 0) -> None:
        self.value = value
        self.where = where
        self.size = size  # the bytes it was read from (a nested object: 0)

    def name(self, key: str) -> str:
        return f"{self.where}{key}"

    def text(self, key: str, default: Any = _REQUIRED, *, max_chars: int = 1024) -> Any:
        value = self._get(key, default, "a string")
        if value is default:
            return value
        if not isinstance(value, str) or not value or len(value) > max_chars or not value.isprintable():
            raise InvalidRequestError(
                f"{self.name(key)} must be a string of 1-{max_chars} printable characters; got {_shown(value)}"
            )
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int | None = None, high: int | None = None) -> Any:
        value = self._get(key, default, "an integer")
        if value is default:
            return value
        if type(value) is not int:
            raise InvalidRequestError(f"{self.name(key)} must be an integer; got {_shown(value)}")
        _check_range(self.name(key), value, low, high)
        return value

    def number(
        self, key: str, default: Any = _REQUIRED, *, low: float | None = None, high: float | None = None,
        null_ok: bool = True,
    ) -> Any:  # fmt: skip
        """A finite number; ``null_ok=False``: an explicit null is refused, not defaulted (the SDK
        writes a NaN as null, so a null learning rate or temperature was a NaN)."""
        if not null_ok and key in self.value and self.value[key] is None:
            raise InvalidRequestError(
                f"{self.name(key)} must be a finite number; got null (the SDK sends a NaN as null)"
            )
        value = self._get(key, default, "a number")
        if value is default:
            return value
        if type(value) not in (int, float) or not math.isfinite(value):
            raise InvalidRequestError(f"{self.name(key)} must be a finite number; got {_shown(value)}")
        _check_range(self.name(key), value, low, high)
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.value.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{self.name(key)} must be true or false; got {_shown(value)}")
        return value

    def section(self, key: str) -> Fields:
        """A nested object (missing or null: empty)."""
        value = self.value.get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{self.name(key)} must be an object; got {_shown(value)}")
        return Fields(value, f"{self.name(key)}.")

    def _get(self, key: str, default: Any, what: str) -> Any:
        value = self.value.get(key)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise InvalidRequestError(f"{self.name(key)} is required: send {what}")
        return default


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        wanted = (
            f"in [{low}, {high}]"
            if low is not None and high is not None
            else (f"at least {low}" if low is not None else f"at most {high}")
        )
        raise InvalidRequestError(f"{name} must be {wanted}; got {value}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"
