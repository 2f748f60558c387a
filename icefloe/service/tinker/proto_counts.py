"""Counting a protobuf body's parts from its wire bytes, before the body is parsed.

Parsing builds an object for every nested message, map entry and repeated value: an empty ``Datum`` is
2 bytes on the wire and about 56 bytes parsed, a map entry about 140. So a body is walked first, field
tag by field tag (varint tags, length-delimited fields skipped or entered), and refused from its counts
while nothing has been built. The walk enters only the message fields the schema names, so its depth is
the schema's, and it stops at the first count over its bound, so it costs at most that many steps.
Unknown fields are skipped (kept as bytes when parsed); groups, which nothing here sends, are refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from icefloe.protocol import InvalidRequestError, PayloadTooLargeError

__all__ = ["Counts", "Schema", "count", "schema_of"]

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_SKIPPED = {_FIXED64: 8, _FIXED32: 4}
_TYPE_MESSAGE = 11  # FieldDescriptor.TYPE_MESSAGE
_TYPES_PACKABLE = frozenset(range(1, 19)) - {9, 10, 11, 12}  # every scalar but string, group, message, bytes


@dataclass
class Schema:
    """One message type's fields by number: the schema of a nested message, or None for a scalar field;
    ``packed`` holds the repeated scalars, whose values each count as one object, and ``entries`` the maps,
    whose entries count as two (an entry costs a hash-table slot and a key besides its message)."""

    messages: dict[int, Schema | None] = field(default_factory=dict)
    packed: set[int] = field(default_factory=set)
    entries: set[int] = field(default_factory=set)


def schema_of(descriptor: Any, known: dict[str, Schema] | None = None) -> Schema:
    """The :class:`Schema` of a protobuf message ``descriptor`` (its nested types included)."""
    known = {} if known is None else known
    if descriptor.full_name in known:
        return known[descriptor.full_name]
    schema = known[descriptor.full_name] = Schema()
    for item in descriptor.fields:
        nested = item.message_type if item.type == _TYPE_MESSAGE else None
        schema.messages[item.number] = schema_of(nested, known) if nested is not None else None
        if item.is_repeated and item.type in _TYPES_PACKABLE:
            schema.packed.add(item.number)
        if nested is not None and nested.GetOptions().map_entry:
            schema.entries.add(item.number)
    return schema


@dataclass
class Counts:
    """What one body holds: ``top`` counts each top-level field's occurrences; ``texts`` is the last value
    of each top-level length-delimited field (a ``model_id``), as bytes."""

    objects: int = 0
    fields: int = 0
    top: Counter[int] = field(default_factory=Counter)
    texts: dict[int, bytes] = field(default_factory=dict)


def count(
    raw: bytes, schema: Schema, *, what: str, instead: str, max_objects: int, max_fields: int,
    max_top: dict[int, tuple[int, str]],
) -> Counts:  # fmt: skip
    """Walk ``raw`` (a message ``what`` of ``schema``) and count its objects (messages, map entries and repeated
    values, which parsing would build) and its fields; :class:`PayloadTooLargeError` at the first count over
    ``max_objects``, ``max_fields``, or ``max_top`` (top-level field number -> (bound, its name)), saying
    ``instead`` what to send; :class:`InvalidRequestError` when ``raw`` is not the wire form of a message.
    """
    counts = Counts()
    view = memoryview(raw)
    stack: list[tuple[Schema, int]] = [(schema, len(raw))]
    position = 0
    while stack:
        current, end = stack[-1]
        if position == end:
            stack.pop()
            continue
        tag, position = _varint(view, position, end, what)
        number, wire_type = tag >> 3, tag & 7
        counts.fields += 1
        if counts.fields > max_fields:
            raise _too_many(what, f"more than {max_fields} protobuf fields", max_fields, instead)
        top = len(stack) == 1
        if top:
            counts.top[number] += 1
            bound = max_top.get(number)
            if bound is not None and counts.top[number] > bound[0]:
                raise _too_many(what, f"more than {bound[0]} {bound[1]}", bound[0], instead)
        if wire_type == _VARINT:
            _, position = _varint(view, position, end, what)
            counts.objects += number in current.packed
        elif wire_type in _SKIPPED:
            position = _skip(position, _SKIPPED[wire_type], end, what)
            counts.objects += number in current.packed
        elif wire_type == _LENGTH:
            length, position = _varint(view, position, end, what)
            start, position = position, _skip(position, length, end, what)
            nested = current.messages.get(number)
            if nested is not None:  # entered: its fields are walked next, then the walk goes on here
                counts.objects += 2 if number in current.entries else 1
                stack.append((nested, position))
                position = start
            elif number in current.packed:  # each value takes at least one byte
                counts.objects += length
            elif top:
                counts.texts[number] = bytes(view[start:position])
        else:
            raise InvalidRequestError(f"the body is not a {what} protobuf: wire type {wire_type} at byte {position}")
        if counts.objects > max_objects:
            raise _too_many(
                what, f"more than {max_objects} protobuf messages and repeated values", max_objects, instead
            )
    return counts


def _varint(view: memoryview, position: int, end: int, what: str) -> tuple[int, int]:
    value, shift = 0, 0
    while position < end and shift < 64:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    raise InvalidRequestError(f"the body is not a {what} protobuf: a varint is cut off or too long at byte {position}")


def _skip(position: int, length: int, end: int, what: str) -> int:
    if position + length > end:
        raise InvalidRequestError(f"the body is not a {what} protobuf: a field runs past its end at byte {position}")
    return position + length


def _too_many(what: str, found: str, limit: int, instead: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the {what} holds {found}; at most {limit} are accepted in one request: {instead}")
