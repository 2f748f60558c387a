"""Tinker's wire forms <-> icefloe's: protobuf requests to canonical batches, results to protobuf.

The protobuf classes come from the ``tinker`` package (``pip install icefloe[tinker]``). A datum
of ``L`` tokens becomes one row of the canonical batch with explicit targets: column ``i`` scores
``target_tokens[i]`` (not necessarily the next input token), every column counts, and the Tinker
losses are sums (``loss_agg_mode: token-sum``). Tensors: B rows, S positions.

A ``cross_entropy`` datum may give K targets per position (``target_tokens`` and ``weights`` both
``[L, K]``: top-K distillation, soft labels): it becomes K rows of the batch, row k scoring column k,
so its loss is the sum over the K targets, and its log-probs come back ``[L, K]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from icefloe.protocol import InvalidRequestError
from icefloe.service.limits import MAX_PROTO_FIELDS, MAX_PROTO_OBJECTS, MAX_TINKER_DATUMS
from icefloe.service.tinker import proto_counts

__all__ = ["Layout", "batch_from_request", "forward_backward_output", "model_id_of", "pb", "sample_response"]

Layout = list[tuple[int, int, int | None]]  # per datum: its length, its first row, and K for [L, K] targets

_NUMPY_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
# Tinker input name -> canonical context name
_CONTEXT_NAMES = {"target_tokens": "target_tokens", "weights": "weights", "advantages": "advantages",
                  "logprobs": "old_logprobs", "sequence_ratio_mask": "sequence_ratio_mask"}  # fmt: skip
_MAX_COLUMNS = 1024  # targets per position of a [L, K] target_tokens
_EMPTY_LOGPROB = -99999.0  # the SDK's mark of an empty top-k cell (tinker.types.topk_logprobs.MASK_LOGPROB)
_TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
# Losses the SDK names whose objective Tinker has not published, so they cannot be reproduced here.
_UNPUBLISHED = {
    "stable_reinforce": (
        " (its objective reads stability information that Tinker's sampler records with "
        "record_stability_info, and neither is published)"
    ),
}


_REQUEST = pb.ForwardBackwardRequest.DESCRIPTOR
_REQUEST_SCHEMA = proto_counts.schema_of(_REQUEST)
_FEWER_DATUMS = "send fewer datums per forward_backward (the SDK sends at most 1024)"


def model_id_of(raw: bytes) -> str:
    """The ``model_id`` of a ForwardBackwardRequest's wire bytes, read once the datums, messages and fields
    it holds are counted within their bounds: before it is parsed, so a body of millions of empty messages
    is refused (413) while it costs nothing, and an unknown model (404) before it costs anything."""
    data, model_id = _REQUEST.fields_by_name["data"].number, _REQUEST.fields_by_name["model_id"].number
    counts = proto_counts.count(
        raw, _REQUEST_SCHEMA, what="ForwardBackwardRequest", instead=_FEWER_DATUMS, max_objects=MAX_PROTO_OBJECTS,
        max_fields=MAX_PROTO_FIELDS, max_top={data: (MAX_TINKER_DATUMS, "datums")},
    )  # fmt: skip
    if not counts.texts.get(model_id):  # bytes that walk as a message yet name no model are no request
        raise InvalidRequestError(
            "the body is not a ForwardBackwardRequest protobuf with a model_id; send the model_id create_model answered"
        )
    try:
        return counts.texts[model_id].decode()
    except UnicodeDecodeError:
        raise InvalidRequestError("model_id is not UTF-8 text; send the model_id create_model answered") from None


def _buffer(raw: bytes, dtype: type[np.generic], where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise InvalidRequestError(
            f"{where} holds {len(raw)} bytes, not a multiple of {size} ({np.dtype(dtype).name}); send whole values"
        )
    return np.frombuffer(raw, dtype=dtype)


def _array(tensor: pb.Tensor, where: str, length: int, name: str) -> np.ndarray:
    """The values of one datum's input tensor, one per position (``length``): its shape, sizes and
    (sparse) indices are checked before anything is allocated, and float values must be finite."""
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequestError(f"{where}: dtype {tensor.dtype} is not supported; send float32 or int64")
    shape = [int(d) for d in tensor.shape]
    columns = 1
    if len(shape) == 2 and shape[0] == length and shape[1] > 1 and name in ("target_tokens", "weights"):
        columns = shape[1]  # top-K targets per position: [L, K]
        if columns > _MAX_COLUMNS:
            raise InvalidRequestError(f"{where} has {columns} targets per position; at most {_MAX_COLUMNS} are served")
    if any(d < 0 for d in shape) or (shape and math.prod(shape) != length * columns):
        raise InvalidRequestError(f"{where} has shape {shape[:4]}; a datum of {length} tokens needs [{length}]")
    length *= columns
    if tensor.WhichOneof("encoding") == "sparse_csr":
        array = _from_csr(tensor.sparse_csr, dtype, shape, where)
    else:
        array = _buffer(tensor.dense, dtype, f"{where}.dense")
        if len(array) != length:
            raise InvalidRequestError(
                f"{where} has {len(array)} values for {length} input tokens; give one per input position"
            )
    if dtype is np.float32 and not np.isfinite(array).all():
        position = int(np.flatnonzero(~np.isfinite(array))[0])
        raise InvalidRequestError(
            f"{where} holds {array[position]} at position {position}; every value must be a finite number"
        )
    return array.reshape(-1, columns) if columns > 1 else array


def _from_csr(csr: pb.SparseCsr, dtype: type[np.generic], shape: list[int], where: str) -> np.ndarray:
    """A sparse CSR tensor of a checked 2-D ``shape`` as its dense values, flat."""
    if len(shape) != 2:
        raise InvalidRequestError(f"{where}: a sparse_csr tensor needs a 2-D shape [rows, columns]; got {shape[:4]}")
    rows, width = shape
    values = _buffer(csr.values, dtype, f"{where}.sparse_csr.values")
    crow = _buffer(csr.crow_indices, np.int64, f"{where}.sparse_csr.crow_indices")
    cols = _buffer(csr.col_indices, np.int64, f"{where}.sparse_csr.col_indices")
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(cols) or (np.diff(crow) < 0).any():
        raise InvalidRequestError(
            f"{where}.sparse_csr.crow_indices must be {rows + 1} non-decreasing offsets from 0 to the number of "
            f"column indices ({len(cols)})"
        )
    if len(values) != len(cols):
        raise InvalidRequestError(f"{where}.sparse_csr has {len(values)} values for {len(cols)} column indices")
    if len(cols) and (cols.min() < 0 or cols.max() >= width):
        raise InvalidRequestError(
            f"{where}.sparse_csr.col_indices must be in [0, {width}); got {cols.min()}..{cols.max()}"
        )
    dense = np.zeros(rows * width, dtype=dtype)
    dense[np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow)) * width + cols] = values
    return dense


def batch_from_request(
    request: pb.ForwardBackwardRequest, *, pad_id: int, context_length: int, max_tokens: int
) -> tuple[dict[str, Any], Layout]:
    """The canonical batch of one forward(-backward) chunk, and each datum's layout in it; a datum longer
    than ``context_length`` (the model's positions), or more than ``max_tokens`` in all, is refused.
    Every field is checked here, so the batch goes to the engine as it is (which checks the token ids
    against its vocabulary)."""
    import torch

    loss_fn = request.loss_fn
    if loss_fn not in _TINKER_LOSSES:
        why = _UNPUBLISHED.get(loss_fn, "")
        raise InvalidRequestError(
            f"loss_fn {loss_fn!r} is not served{why}; use one of {list(_TINKER_LOSSES)}, or a custom loss "
            "through forward_backward_custom (it runs client-side)"
        )
    if not request.data:
        raise InvalidRequestError("data is empty; send at least one datum")
    config: dict[str, Any] = {name: value for name, value in request.loss_fn_config.items()}
    for name, value in request.loss_fn_config_v2.items():
        config[name] = value.text if value.WhichOneof("value") == "text" else value.number
    for name, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"loss_fn_config.{name} is {value}; send a finite number")
    total = sum(len(chunk.encoded_text.tokens) // 4 for datum in request.data for chunk in datum.model_input)
    if total > max_tokens:
        raise InvalidRequestError(
            f"the request holds {total} tokens; at most {max_tokens} go in one request (icefloe serve "
            "--max-tokens-per-request): send fewer datums per forward_backward"
        )
    rows: list[np.ndarray] = []
    inputs: list[dict[str, np.ndarray]] = []
    layout: Layout = []
    for index, datum in enumerate(request.data):
        tokens, fields, columns = _datum(datum, f"data.{index}", loss_fn, context_length)
        layout.append((len(tokens), len(rows), columns))
        for column in range(columns or 1):  # K targets per position: one row per column
            rows.append(tokens)
            inputs.append({n: a[:, column] if a.ndim == 2 else a for n, a in fields.items()})
    scored = sum(map(len, rows))
    if scored > max_tokens:
        raise InvalidRequestError(
            f"the request scores {scored} tokens (each of a datum's K target columns is a pass over its tokens); at "
            f"most {max_tokens} go in one request (icefloe serve --max-tokens-per-request): send fewer datums or "
            "fewer targets per position"
        )
    masked = ["sequence_ratio_mask" in fields for fields in inputs]
    if any(masked) and not all(masked):  # a row without one would score over no position
        raise InvalidRequestError(
            f"data.{masked.index(False)}.loss_fn_inputs.sequence_ratio_mask is missing; give it in every datum or none"
        )
    num_rows, width = len(rows), max(map(len, rows))
    input_ids = torch.full((num_rows, width), pad_id, dtype=torch.int64)
    attention = torch.zeros((num_rows, width), dtype=torch.int64)
    context = {name: torch.zeros((num_rows, width)) for name in {n for fields in inputs for n in fields}}
    context["target_tokens"] = torch.full((num_rows, width), pad_id, dtype=torch.int64)
    if loss_fn == "cross_entropy" and "weights" not in context:
        context["weights"] = torch.zeros((num_rows, width))
    for row, (tokens, fields) in enumerate(zip(rows, inputs, strict=True)):
        input_ids[row, : len(tokens)] = torch.from_numpy(tokens)
        attention[row, : len(tokens)] = 1
        if loss_fn == "cross_entropy" and "weights" not in fields:
            context["weights"][row, : len(tokens)] = 1.0
        for name, array in fields.items():
            context[name][row, : len(tokens)] = torch.from_numpy(
                array.astype(np.int64 if name == "target_tokens" else np.float32)
            )
    context["loss_mask"] = attention.float()
    processing = {"loss_fn": loss_fn, "config": {**config, "loss_agg_mode": "token-sum", "return_logprobs": True,
                                                 "forward_only": request.forward_only}}  # fmt: skip
    batch = {"kwargs": {"input_ids": input_ids, "attention_mask": attention}, "context": context,
             "processing": processing}  # fmt: skip
    return batch, layout


def _datum(
    datum: Any, where: str, loss_fn: str, context_length: int
) -> tuple[np.ndarray, dict[str, np.ndarray], int | None]:
    """One datum's token ids (int32; text only), its loss inputs by canonical name (each checked against
    its length by :func:`_array`), and K when its ``target_tokens`` and ``weights`` are both ``[L, K]``
    (None for one target per position)."""
    parts: list[np.ndarray] = []
    for index, chunk in enumerate(datum.model_input):
        chunk_where = f"{where}.model_input.chunks.{index}"
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(f"{chunk_where} is a {kind} chunk; only encoded_text is served")
        parts.append(_buffer(chunk.encoded_text.tokens, np.int32, f"{chunk_where}.encoded_text.tokens"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if not len(tokens):
        raise InvalidRequestError(f"{where}.model_input is empty; give at least one token")
    if tokens.min() < 0:
        raise InvalidRequestError(f"{where}.model_input holds token id {tokens.min()}; token ids are integers from 0")
    if len(tokens) > context_length:
        raise InvalidRequestError(
            f"{where}.model_input has {len(tokens)} tokens; the model has a context of {context_length} tokens: "
            "shorten or split the datum"
        )
    where = f"{where}.loss_fn_inputs"
    fields = {
        _CONTEXT_NAMES[name]: _array(tensor, f"{where}.{name}", len(tokens), name)
        for name, tensor in sorted(datum.loss_fn_inputs.items())
        if name in _CONTEXT_NAMES
    }
    needed = ("target_tokens",) if loss_fn == "cross_entropy" else ("target_tokens", "advantages", "logprobs")
    for name in needed:
        if _CONTEXT_NAMES[name] not in fields:
            raise InvalidRequestError(f"{where}.{name} is missing; loss {loss_fn!r} needs it in every datum")
    if fields["target_tokens"].min() < 0:
        raise InvalidRequestError(
            f"{where}.target_tokens holds {fields['target_tokens'].min()}, not a token id; put any token id where "
            "nothing is scored and set weights to 0 there"
        )
    shapes = {name: fields[name].shape for name in ("target_tokens", "weights") if name in fields}
    if all(len(shape) == 1 for shape in shapes.values()):
        return tokens, fields, None
    if loss_fn != "cross_entropy":
        raise InvalidRequestError(
            f"{where}.target_tokens is [L, K] (K targets per position), which only loss 'cross_entropy' takes; "
            f"send one target per position for {loss_fn!r}"
        )
    if len(set(shapes.values())) != 1 or len(shapes) != 2:
        listed = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise InvalidRequestError(f"{where}: target_tokens and weights must both be [L, K]; got {listed}")
    return tokens, fields, int(shapes["target_tokens"][1])


def forward_backward_output(result: dict[str, Any], layout: Layout) -> bytes:
    """A stored forward(-backward) result (``loss``, ``metrics``, ``logprobs [B, S]`` as an array) as
    protobuf, each datum's log-probs cut out by ``layout`` (``[L]``, or ``[L, K]`` gathered from its K
    rows); consecutive datums of one shape (``[L]``, or ``[L, K]`` of one K) share a record."""
    rows_BS = np.asarray(result["logprobs"], dtype=np.float32)
    logprobs = [
        np.ascontiguousarray(
            rows_BS[first, :length] if columns is None else rows_BS[first : first + columns, :length].T
        )
        for length, first, columns in layout
    ]
    metrics = {"loss:sum": float(result["loss"])}
    metrics |= {f"{name}:mean": float(v) for name, v in result["metrics"].items() if name != "loss"}
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    start = 0
    while start < len(logprobs):
        trailing = logprobs[start].shape[1:]
        end = start + 1
        while end < len(logprobs) and logprobs[end].shape[1:] == trailing:
            end += 1
        group = logprobs[start:end]
        record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(group))
        offsets = np.cumsum([0, *(a.nbytes for a in group)]).astype(np.int64)
        data = b"".join(a.tobytes() for a in group)
        tensor = pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32, trailing_shape=trailing)
        record.fields["logprobs"].CopyFrom(tensor)
        message.loss_fn_outputs.append(record)
        start = end
    if not logprobs:
        message.loss_fn_outputs.append(pb.ArrayRecord(type_tag="ArrayRecord", num_datums=0))
    return message.SerializeToString()


def sample_response(result: dict[str, Any], *, last_n: int | None = None) -> bytes:
    """A stored sample result (``samples`` of one prompt, ``prompt_logprobs``) as protobuf; with
    ``last_n``, only the last ``last_n`` prompt positions keep their log-probs."""
    message = pb.SampleResponse()
    for sample in result["samples"]:
        message.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if sample["finish_reason"] == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(sample["token_ids"], dtype=np.int32).tobytes(),
                logprobs=np.asarray(sample.get("logprobs", []), dtype=np.float32).tobytes(),
            )
        )
    prompt_logprobs, topk = result.get("prompt_logprobs"), result.get("topk_prompt_logprobs")
    if prompt_logprobs is not None:
        skipped = len(prompt_logprobs) - last_n if last_n is not None else 0
        values = [math.nan if v is None or i < skipped else v for i, v in enumerate(prompt_logprobs)]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
        if topk:
            topk = [None if i < skipped else pairs for i, pairs in enumerate(topk)]
    if topk:
        message.topk_prompt_logprobs.CopyFrom(_topk(topk))
    targeted = result.get("target_prompt_logprobs")
    if targeted is not None:  # [len(prompt) - 1, K], 0.0 where nothing was asked
        values = np.asarray(targeted, dtype=np.float32)
        message.target_prompt_logprobs.CopyFrom(
            pb.Tensor(dense=values.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=list(values.shape))
        )
    return message.SerializeToString()


def _topk(rows: list[list[list[float]] | None]) -> pb.TopkLogprobs:
    """Per position ``[token, logprob]`` pairs (None: no context) as the SDK's dense N×K matrices;
    empty cells hold the SDK's sentinel (token 0, log-prob -99999)."""
    k = max((len(pairs) for pairs in rows if pairs), default=0)
    token_ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), _EMPTY_LOGPROB, dtype=np.float32)
    for row, pairs in enumerate(rows):
        for column, (token, logprob) in enumerate(pairs or []):
            token_ids[row, column], logprobs[row, column] = token, logprob
    return pb.TopkLogprobs(token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))
