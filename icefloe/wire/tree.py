"""DSSST1 encode/decode: nested Python values ↔ one safetensors frame plus a structure tree.

``__metadata__["dss"]`` holds ``{"v": "DSSST1", "tree": node}`` where a node is ``["t", key]``
(tensor; ``["t", key, {"scalar": true}]`` for 0-dim, stored as shape [1]), ``["d", [[k, node], ...]]``
(dict), ``["l", [...]]`` (list), ``["u", [...]]`` (tuple) or ``["j", value]`` (plain JSON). A tensor's
key is its dotted path (``kwargs.input_ids``, ``pair.0``; ``__root__`` at the root). A frame with no
tensors carries the placeholder ``__dss_empty__`` (U8 [1]). ``__metadata__["op"]`` holds operation
metadata, read without decoding tensors by :func:`read_metadata`.

Dotted keys are ESCAPED, never refused: in a tensor key each path segment has ``%`` written as
``%25`` and ``.`` as ``%2E``, so ``{"a.b": t}`` (key ``a%2Eb``) cannot collide with
``{"a": {"b": t}}`` (key ``a.b``); a whole key equal to ``__metadata__`` or ``__dss_empty__`` starts
``%5F`` instead of ``_``. Decoders take keys from the tree, so other DSSST1 readers decode these
frames unchanged. Encoding keeps tuples: a dict or list is embedded as ``j`` only when nothing below
it is a tensor or a tuple. Dict keys must be strings.

Decoding validates the container, the tree (known tags, exact arity, every referenced tensor present
and referenced once, nothing unreferenced but the placeholder) and BOOL bytes before building any
tensor; only tensors and JSON values are ever reconstructed.
"""

from __future__ import annotations

import json
from typing import Any, Final

from icefloe.protocol import FrameFormatError, WireError
from icefloe.wire import dense_json
from icefloe.wire.frames import (
    EscapedText,
    FrameHeader,
    TensorSpec,
    as_byte_view,
    parse_strict_json,
    read_header,
    strict_json_errors,
    unique_pairs,
    write_frame,
)
from icefloe.wire.tensors import build_tensors, check_tensor_bytes, is_tensor, resolve_kind, tensor_record

__all__ = ["EMPTY_KEY", "MAX_DEPTH", "ROOT_KEY", "WIRE_VERSION", "decode", "encode", "parse_op", "read_metadata"]

WIRE_VERSION: Final = "DSSST1"
ROOT_KEY: Final = "__root__"
EMPTY_KEY: Final = "__dss_empty__"
# Containers nested deeper than this are refused on both sides (a cycle would otherwise recurse forever).
MAX_DEPTH: Final = 128
_RESERVED_KEYS: Final = frozenset({"__metadata__", EMPTY_KEY})
_PLAIN_SCALARS: Final = (str, int, float, bool, type(None))
_TAGS: Final = frozenset({"t", "d", "l", "u", "j"})


def encode(obj: Any, op_metadata: dict[str, Any] | None = None) -> bytes:
    """Encode nested dict/list/tuple/JSON scalars and torch/numpy tensors as one DSSST1 frame.

    ``op_metadata`` (a JSON-serialisable dict) is stored as ``__metadata__["op"]`` when non-empty.

    Raises:
        FrameFormatError: a value, dict key or dtype the wire cannot carry; the message names its path.
    """
    records: list[tuple[str, str, tuple[int, ...], memoryview]] = []
    tree, _ = _encode_node(obj, (), records)
    if not records:
        records.append((EMPTY_KEY, "U8", (1,), memoryview(b"\x00")))
    metadata = {"dss": _dumps({"v": WIRE_VERSION, "tree": tree}, "the structure tree")}
    if op_metadata:
        if not isinstance(op_metadata, dict):
            raise FrameFormatError(f"op_metadata must be a dict; got {type(op_metadata).__name__}")
        metadata["op"] = _dumps(op_metadata, "op_metadata")
    return write_frame(metadata, records)


def decode(
    data: bytes | bytearray | memoryview,
    *,
    tensors: str = "torch",
    header: FrameHeader | None = None,
    dense: bool = False,
) -> Any:
    """Decode a DSSST1 frame; tensors come back as torch tensors (numpy if asked or torch is absent).

    Tensors view ``data`` when it is writable (bytearray), else each is copied once from it.
    ``header``: ``read_header(data)``, when the caller has parsed it already. ``dense``: in a tree over
    64 KiB, each array of plain numbers is an ``array.array`` (:mod:`icefloe.wire.dense_json`), read from
    ``data`` without a copy of the tree's text: what a service wants of a request's token ids.

    Raises:
        LegacyPickleError: ``data`` is pickle or a ``torch.save`` archive.
        FrameFormatError: the container, metadata or tree is invalid; the message names the offender.
    """
    kind = resolve_kind(tensors)
    view = as_byte_view(data)
    header = header or read_header(view)
    tree = _read_tree(header.metadata, dense)
    referenced: dict[str, bool] = {}
    _check_node(tree, referenced, depth=0, where="tree")
    specs = _referenced_specs(header, referenced)
    for spec in specs:
        check_tensor_bytes(view, spec)
    return _build_node(tree, build_tensors(view, specs, kind))


def read_metadata(frame: object, header: FrameHeader | None = None) -> dict[str, Any]:
    """The frame's ``op`` metadata as a dict, without decoding tensors; ``{}`` for anything else.

    ``header``: ``read_header(frame)``, when the caller has parsed it already.
    """
    if header is None:
        try:
            header = read_header(frame)
        except WireError:
            return {}
    return parse_op(header.metadata.get("op"))


def parse_op(op_text: str | EscapedText | None) -> dict[str, Any]:
    """Leniently parse an ``op`` metadata string: anything but a JSON object gives ``{}``, and so does
    a long one (an EscapedText: no operation's metadata is that long)."""
    if not isinstance(op_text, str):
        return {}
    try:
        op = json.loads(op_text)
    except (ValueError, RecursionError):
        return {}
    return op if isinstance(op, dict) else {}


# --- encoding ----------------------------------------------------------------------------------
def _encode_node(value: Any, path: tuple[str, ...], records: list) -> tuple[list, bool]:
    """Return ``(node, structured)``; ``structured`` is True when a tensor or tuple lies below."""
    if len(path) > MAX_DEPTH:
        raise FrameFormatError(f"value at {_where(path)} nests deeper than {MAX_DEPTH} levels (a cycle?)")
    if is_tensor(value):
        name = _tensor_key(path)
        dtype, shape, raw = tensor_record(value, name)
        if shape == ():
            records.append((name, dtype, (1,), raw))
            return ["t", name, {"scalar": True}], True
        records.append((name, dtype, shape, raw))
        return ["t", name], True
    if isinstance(value, tuple):
        children = [_encode_node(item, (*path, str(index)), records)[0] for index, item in enumerate(value)]
        return ["u", children], True
    if isinstance(value, list):
        if all(type(item) in _PLAIN_SCALARS for item in value):
            return ["j", value], False
        encoded = [_encode_node(item, (*path, str(index)), records) for index, item in enumerate(value)]
        if any(structured for _, structured in encoded):
            return ["l", [node for node, _ in encoded]], True
        return ["j", value], False
    if isinstance(value, dict):
        items = []
        structured = False
        for key, item in value.items():
            if not isinstance(key, str):
                raise FrameFormatError(
                    f"dict key {key!r} at {_where(path)} is {type(key).__name__}; the wire needs str keys"
                )
            node, item_structured = _encode_node(item, (*path, key), records)
            items.append([key, node])
            structured = structured or item_structured
        return (["d", items], True) if structured else (["j", value], False)
    if isinstance(value, _PLAIN_SCALARS):
        return ["j", value], False
    raise FrameFormatError(
        f"value at {_where(path)} is {type(value).__module__}.{type(value).__qualname__}; the wire carries "
        "only dict/list/tuple/str/int/float/bool/None and torch/numpy tensors (convert it first)"
    )


def _tensor_key(path: tuple[str, ...]) -> str:
    if not path:
        return ROOT_KEY
    key = ".".join(segment.replace("%", "%25").replace(".", "%2E") for segment in path)
    return "%5F" + key[1:] if key in _RESERVED_KEYS else key


def _where(path: tuple[str, ...]) -> str:
    return repr(".".join(path)) if path else "the root"


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as error:
        raise FrameFormatError(f"{what} is not JSON-serialisable: {error}") from None


# --- decoding ----------------------------------------------------------------------------------
def _read_tree(metadata: dict[str, str | EscapedText], dense: bool) -> Any:
    dss_text = metadata.get("dss")
    if dss_text is None:
        raise FrameFormatError("frame has no __metadata__['dss']; it is safetensors but not DSSST1")
    if not isinstance(dss_text, EscapedText):
        dss = parse_strict_json(dss_text, "__metadata__['dss']")
    elif dense:
        with strict_json_errors("__metadata__['dss']"):
            dss = dense_json.loads_escaped(dss_text.data, dss_text.start, dss_text.end, pairs_hook=unique_pairs)
    else:
        dss = parse_strict_json(dss_text.decoded(), "__metadata__['dss']")
    if not isinstance(dss, dict) or set(dss) != {"v", "tree"}:
        keys = sorted(dss) if isinstance(dss, dict) else type(dss).__name__
        raise FrameFormatError(f"__metadata__['dss'] must be an object with exactly v and tree; got {keys}")
    if dss["v"] != WIRE_VERSION:
        raise FrameFormatError(f"__metadata__['dss'].v is {dss['v']!r}; this reader speaks {WIRE_VERSION!r}")
    return dss["tree"]


def _check_node(node: Any, referenced: dict[str, bool], depth: int, where: str) -> None:
    """Validate one tree node (recursively), collecting tensor keys and their scalar flags."""
    if depth > MAX_DEPTH:
        raise FrameFormatError(f"tree node {where} nests deeper than {MAX_DEPTH} levels")
    if not isinstance(node, list) or not node or not isinstance(node[0], str) or node[0] not in _TAGS:
        tag = node[0] if isinstance(node, list) and node else node
        raise FrameFormatError(f"tree node {where} has unknown tag {tag!r}; expected one of t, d, l, u, j")
    tag = node[0]
    if tag == "t":
        _check_tensor_node(node, referenced, where)
        return
    if len(node) != 2:
        raise FrameFormatError(f"tree node {where} ({tag!r}) must have 2 elements; got {len(node)}")
    if tag == "j":
        return
    children = node[1]
    if not isinstance(children, list):
        raise FrameFormatError(f"tree node {where} ({tag!r}) must hold a list; got {type(children).__name__}")
    if tag != "d":
        for index, child in enumerate(children):
            _check_node(child, referenced, depth + 1, f"{where}[{index}]")
        return
    seen: set[str] = set()
    for index, item in enumerate(children):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise FrameFormatError(f"tree node {where} item {index} must be [str key, node]; got {item!r:.80}")
        if item[0] in seen:
            raise FrameFormatError(f"tree node {where} repeats dict key {item[0]!r}")
        seen.add(item[0])
        _check_node(item[1], referenced, depth + 1, f"{where}[{item[0]!r}]")


def _check_tensor_node(node: list, referenced: dict[str, bool], where: str) -> None:
    if len(node) not in (2, 3) or not isinstance(node[1], str):
        raise FrameFormatError(f"tree node {where} must be ['t', key] or ['t', key, options]; got {node!r:.80}")
    scalar = False
    if len(node) == 3:
        options = node[2]
        if (
            not isinstance(options, dict)
            or set(options) - {"scalar"}
            or not isinstance(options.get("scalar", False), bool)
        ):
            raise FrameFormatError(f"tree node {where} options must be {{'scalar': bool}}; got {options!r:.80}")
        scalar = options.get("scalar", False)
    if node[1] in referenced:
        raise FrameFormatError(f"tree references tensor {node[1]!r} twice (again at {where})")
    referenced[node[1]] = scalar


def _referenced_specs(header: FrameHeader, referenced: dict[str, bool]) -> list[TensorSpec]:
    specs = []
    for key, scalar in referenced.items():
        spec = header.tensors.get(key)
        if spec is None:
            raise FrameFormatError(f"tree references tensor {key!r}, which the frame does not contain")
        if scalar and spec.shape != (1,):
            raise FrameFormatError(f"tensor {key!r} is marked scalar but has shape {list(spec.shape)}; expected [1]")
        specs.append(spec)
    unreferenced = sorted(set(header.tensors) - set(referenced))
    placeholder = header.tensors.get(EMPTY_KEY)
    if EMPTY_KEY in unreferenced and placeholder is not None and (placeholder.dtype, placeholder.shape) == ("U8", (1,)):
        unreferenced.remove(EMPTY_KEY)
    if unreferenced:
        raise FrameFormatError(f"frame holds tensors the tree never references: {unreferenced}")
    return specs


def _build_node(node: list, tensors: dict[str, Any]) -> Any:
    tag = node[0]
    if tag == "t":
        tensor = tensors[node[1]]
        return tensor.reshape(()) if len(node) == 3 and node[2].get("scalar", False) else tensor
    if tag == "j":
        return node[1]
    if tag == "d":
        return {key: _build_node(child, tensors) for key, child in node[1]}
    children = [_build_node(child, tensors) for child in node[1]]
    return children if tag == "l" else tuple(children)
