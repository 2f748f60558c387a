"""SamplingEngine: batched generation with torch and the model's KV cache; vLLM on GPU.

The torch engine writes its own decode loop so that it controls, per row: the random stream
(a row's tokens depend on its seed alone, not on what else shares the batch), stop conditions
and the log-prob of each sampled token. Reported log-probs are under the raw distribution
(temperature 1, no top-p/top-k), the quantity ``TrainingEngine.forward`` returns for the same tokens.

A stop token (the tokenizer's EOS, or one of ``stop_token_ids``) is kept as the last entry of
``token_ids``, as vLLM does, because RL must train on the decision to stop; it is left out of
``text`` when it is a special token. A stop string cuts ``text`` before the string and
``token_ids`` after the token that completed it. With ``config.lora`` both engines sample with the
adapter the last weight sync delivered (before any sync it is a no-op: the base model samples).
Tensors: B rows, P prompt positions, V vocabulary, T generated tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import shutil
import tempfile
import time
from collections.abc import Collection, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from icefloe.config import ClientConfig
from icefloe.engines.lora import (
    BASE_ADAPTER,
    SharedBase,
    peft_key,
    read_adapter_checkpoint,
    write_adapter_folder,
)
from icefloe.engines.micro_batches import default_token_budget, sampling_bytes_per_token
from icefloe.engines.models import context_limit, load_causal_lm, load_tokenizer, resolve_model
from icefloe.engines.training import resolve_device
from icefloe.protocol import InvalidRequestError, SamplingParams

__all__ = ["SamplingEngine", "VLLMSamplingEngine", "build_sampling_engine", "generate_steps", "generate_together"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A pass cut to a time (see _prompt_passes) before the engine has timed one: this many positions
# (rows x columns), brief on any device; later passes are sized by the speed measured.
_FIRST_PASS_POSITIONS = 1024
# A pass cut to a time holds at least this many columns: each pass reads the whole cache so far, as a
# decode step does, and with fewer columns of work per read, more, shorter passes would cost more than
# they let others in.
_MIN_PASS_COLUMNS = 64
# A row of a decode batch is padded by at most this many times its prompt's length, or _PAD_SLACK
# columns (see decode_batches).
_PAD_RATIO = 4
_PAD_SLACK = 256
# Odd 64-bit constant for mixing (seed, sample index) into one generator seed.
_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class _Row:
    """One sequence being generated: a prompt, its params and its own random stream."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    adapter: str = BASE_ADAPTER  # the adapter the row samples with, on a shared base
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_logprobs: list[list[list[float]]] = field(default_factory=list)  # per token: [token, logprob] pairs
    finish_reason: str | None = None
    text: str | None = None


class SamplingEngine:
    """Generate completions with a Hugging Face causal LM in torch.

    Args:
        config: the client config; ``model``, ``seed``, ``max_seq_len`` and ``sampling`` are read.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        model_dir: load this Hugging Face directory instead of resolving ``config.model``.
        shared: sample on this base, which other runs share (a model host's): with LoRA through a
            snapshot adapter of its own that weight syncs fill, else the base itself.
    """

    # The name a host that serves several runs knows this engine by (its sub-job): the warnings it logs
    # about its own calls carry it, so they reach that run's log and no other run's.
    owner: str | None = None

    def __init__(
        self,
        config: ClientConfig,
        *,
        device: str | torch.device = "cpu",
        model_dir: Path | None = None,
        shared: SharedBase | None = None,
    ):
        self.config = config
        self.lora = config.lora
        if shared is not None:
            self.device, self.model_dir, self.tokenizer = shared.device, shared.model_dir, shared.tokenizer
            base = shared.base
        else:
            self.device = resolve_device(device)
            self.model_dir = Path(model_dir) if model_dir is not None else resolve_model(config.model, seed=config.seed)
            self.tokenizer = load_tokenizer(self.model_dir)
            dtype = _DTYPES[config.dtype] if self.device.type == "cuda" else torch.float32
            base = load_causal_lm(self.model_dir, dtype=dtype, device=self.device).requires_grad_(False)
            if self.lora is not None:
                shared = SharedBase(base, model_dir=self.model_dir, tokenizer=self.tokenizer)
        self.shared = shared
        self.adapter = BASE_ADAPTER
        if shared is not None and self.lora is not None:  # frozen: only weight syncs write it
            self.adapter = shared.add(self.lora, trainable=False, seed=config.seed)
        self.model = base if shared is None else shared.model
        # What a weight sync may write (every parameter, or with LoRA only the adapter), by PEFT file name.
        if self.lora is not None:
            assert shared is not None
            self._params = shared.parameters(self.adapter)
        else:
            self._params = {} if shared is not None else dict(base.named_parameters())
        # transformers renamed the forward's KV-cache argument from past_key_values to cache.
        forward_args = inspect.signature(base.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._generator = torch.Generator().manual_seed(config.seed)
        self._asleep = False
        # Tags whose rows stop at their next decode step (see cancel()); the samplers of one base share
        # the set, since any of them may decode the others' rows.
        self._cancelled: set[str] = shared.cancelled if shared is not None else set()
        self._positions_per_s: float | None = None  # prompt positions a pass got through, for cutting passes by time
        self.policy_version = 0

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    # --- generation ---------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[dict[str, Any]]:
        """Sample ``params.n`` completions per prompt; results are prompt-major.

        Args:
            prompts: token-id lists or strings (tokenised with the model's tokenizer).
            params: one :class:`SamplingParams` for all prompts, or one per prompt.

        Returns:
            ``[{token_ids, text, finish_reason: "stop"|"length", logprobs?, policy_version}]``
            (``cancelled`` for the rows of a call :meth:`cancel` stopped).

        Raises:
            InvalidRequestError: a prompt is empty, holds an unknown id, or leaves no room below
                ``max_seq_len``; the message names the prompt index.
        """
        return generate_together([(self, prompts, params)])[0]

    def _plan(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[_Row]:
        """The rows a generate call decodes, checked before any work."""
        if self._asleep:
            raise InvalidRequestError("the sampling engine is asleep; call wake() (wake_inference) first")
        per_prompt = self._params_per_prompt(prompts, params)
        unknown = sorted({t for p in per_prompt for t in p.stop_token_ids if not 0 <= t < self.vocab_size})
        if unknown:  # e.g. another tokenizer's end-of-turn id: its samples run on to max_tokens
            log.warning(
                "sampling_params.stop_token_ids %s are not ids of this model's vocabulary [0, %d): "
                "no sample can stop at them",
                unknown,
                self.vocab_size,
                extra={"owner": self.owner},
            )
        rows: list[_Row] = []
        for index, (prompt, wanted) in enumerate(zip(prompts, per_prompt, strict=True)):
            ids = self._prompt_ids(index, prompt)
            limit, named = context_limit(self.model.config, self.config.max_seq_len)
            if len(ids) + wanted.max_tokens > limit:
                raise InvalidRequestError(
                    f"prompts[{index}] ({len(ids)} tokens) + max_tokens ({wanted.max_tokens}) exceeds {named}; "
                    f"set max_tokens to at most {limit - len(ids)}"
                )
            rows += [_Row(ids, wanted, seed, wanted.max_tokens, self.adapter) for seed in self._row_seeds(wanted)]
        return rows

    def _finish(
        self, rows: list[_Row], version: int, pass_s: float | None = None
    ) -> Generator[None, None, list[dict[str, Any]]]:
        """The results of decoded rows, with the prompt log-probs their params ask for: each distinct
        prompt scored in passes (see :meth:`_prompt_passes`), pausing between two, so that scoring
        many long prompts never holds a shared host in one piece."""
        results = [self._result(row, version) for row in rows]
        scored: dict[tuple[Any, ...], tuple[list[float | None], list[Any], list[list[float]] | None]] = {}
        for row, result in zip(rows, results, strict=True):
            params = row.params
            k, targets = params.topk_prompt_logprobs, params.target_prompt_logprobs
            if (params.prompt_logprobs or k or targets) and row.finish_reason != "cancelled":
                key = (tuple(row.prompt_ids), k, targets)
                if key not in scored:
                    if scored:
                        yield
                    scored[key] = yield from self._prompt_logprobs(row.prompt_ids, k, targets, pass_s)
                logprobs, topk, targeted = scored[key]
                if params.prompt_logprobs:
                    result["prompt_logprobs"] = logprobs
                if k:
                    result["topk_prompt_logprobs"] = topk
                if targets:
                    result["target_prompt_logprobs"] = targeted
        return results

    @functools.cached_property
    def token_budget(self) -> int:
        """Positions one decode batch may hold: ``sampling.max_batch_tokens``, or when unset a share of
        the device's free memory over the model's KV-cache and prefill bytes per position (see
        :func:`default_token_budget`), at least ``max_seq_len``."""
        if self.config.sampling.max_batch_tokens is not None:
            return self.config.sampling.max_batch_tokens
        dtype_bytes = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        per_token = sampling_bytes_per_token(
            self.model.config, dtype_bytes=dtype_bytes, max_seq_len=self.config.max_seq_len
        )
        return default_token_budget(per_token, self.device, floor=self.config.max_seq_len, capped=False)

    def cancel(self, tags: Sequence[str]) -> None:
        """Stop the rows of the calls tagged so (``SamplingParams.tag``) at their next decode step, or as
        soon as their generate starts; they end with ``finish_reason`` ``cancelled``. Thread-safe."""
        self._cancelled.update(tags)

    @torch.no_grad()
    def _prompt_logprobs(
        self, ids: list[int], k: int, targets: tuple[tuple[int, ...], ...] | None, pass_s: float | None = None
    ) -> Generator[None, None, tuple[list[float | None], list[Any], list[list[float]] | None]]:
        """log π(prompt[i] | prompt[:i]) for every position, (k > 0) the k likeliest ``[token, logprob]``
        pairs there, likeliest first (position 0 has no context: None), and the log-probs of the
        ``targets`` ids (row i at position i + 1; -1: 0.0); in passes of about ``pass_s``, pausing between two."""
        from transformers import DynamicCache

        wanted_PK = None
        if targets:
            wanted_PK = torch.tensor(targets, dtype=torch.long, device=self.device)
            if wanted_PK.shape[0] != len(ids) - 1 or wanted_PK.min() < -1 or wanted_PK.max() >= self.vocab_size:
                raise InvalidRequestError(
                    f"target_prompt_logprobs must be [{len(ids) - 1}, K] token ids in [0, {self.vocab_size}) or -1; "
                    f"got {wanted_PK.shape[0]} rows of ids from {int(wanted_PK.min())} to {int(wanted_PK.max())}"
                )
        input_1P = torch.tensor([ids], device=self.device)
        prompt = {"input_ids": input_1P, "position_ids": torch.arange(len(ids), device=self.device)[None]}
        logprobs: list[float | None] = [None]
        topk: list[Any] = [None] if k else []
        targeted: list[list[float]] | None = [] if wanted_PK is not None else None
        for end, logits_1CV in self._prompt_passes(self.adapter, prompt, DynamicCache(), pass_s, logits_to_keep=0):
            start = end - logits_1CV.shape[1]
            # Position i scores token i + 1: the prompt's last position scores nothing.
            all_CV = torch.log_softmax(logits_1CV[0, : len(ids) - 1 - start].float(), dim=-1)
            logprobs += all_CV.gather(-1, input_1P[0, start + 1 : start + 1 + len(all_CV), None]).squeeze(-1).tolist()
            if k:
                values_CK, tokens_CK = all_CV.topk(min(k, all_CV.shape[-1]), dim=-1)
                pairs = zip(tokens_CK.tolist(), values_CK.tolist(), strict=True)
                topk += [[list(p) for p in zip(t, v, strict=True)] for t, v in pairs]
            if wanted_PK is not None and targeted is not None:
                wanted_CK = wanted_PK[start : start + len(all_CV)]
                scored_CK = all_CV.gather(-1, wanted_CK.clamp_min(0))
                targeted += torch.where(wanted_CK >= 0, scored_CK, torch.zeros_like(scored_CK)).tolist()
            if end < len(ids):
                yield  # between two passes: the worker may run others' work, a deadline may stop this one
        return logprobs, topk, targeted

    def _prompt_passes(
        self,
        adapters: list[str] | str,
        prompts: dict[str, Tensor],
        cache: Any,
        pass_s: float | None,
        *,
        logits_to_keep: int,
    ) -> Iterator[tuple[int, Tensor]]:
        """The forward over ``prompts`` (``input_ids`` and ``position_ids`` ``[B, P]``, and an
        ``attention_mask`` when rows are left-padded) that fills ``cache``, in passes over columns of
        about ``pass_s`` seconds each at the speed passes ran so far (None: one pass); yields each pass's
        end column and logits (``logits_to_keep`` as the model takes it).

        A caller that pauses between two passes lets the worker of a shared host run other runs' work
        there, and a deadline stop its op: one pass over the long prompts of a whole decode batch
        could hold the host for seconds. A pass holds at least :data:`_MIN_PASS_COLUMNS` columns; too
        many rows for that are cut by :meth:`_prefill`.
        """
        rows, width = prompts["input_ids"].shape
        start = 0
        while start < width:
            columns = width
            if pass_s is not None:
                columns = max(_MIN_PASS_COLUMNS, self._pass_positions(pass_s) // rows)
            end = min(width, start + columns)
            inputs = {name: prompts[name][:, start:end] for name in ("input_ids", "position_ids")}
            if "attention_mask" in prompts:  # the cached columns' too
                inputs["attention_mask"] = prompts["attention_mask"][:, :end]
            started = time.perf_counter()
            out = self._forward(
                adapters, **inputs, use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_arg: cache}
            )
            if pass_s is not None:
                if self.device.type == "cuda":  # else the time would be the launch's, not the pass's
                    torch.cuda.synchronize(self.device)
                rate = rows * (end - start) / max(time.perf_counter() - started, 1e-6)
                known = self._positions_per_s
                self._positions_per_s = rate if known is None else 0.7 * known + 0.3 * rate
            yield end, out.logits
            start = end

    def _pass_positions(self, pass_s: float) -> int:
        """Positions (rows x columns) a pass of about ``pass_s`` seconds holds at the speed passes ran so far."""
        known = self._positions_per_s
        return int(_FIRST_PASS_POSITIONS if known is None else known * pass_s)

    def _prefill(
        self, adapters: list[str], prompts: dict[str, Tensor], pass_s: float | None
    ) -> Generator[None, None, tuple[Any, Tensor]]:
        """The cache of ``prompts`` (as :meth:`_prompt_passes` takes them) and each row's next-token
        logits ``[B, V]``, filled in passes of about ``pass_s`` seconds, pausing between two.

        A pass of :data:`_MIN_PASS_COLUMNS` columns over hundreds of long rows is itself seconds long:
        when the rows are too many for one pass, a group of them at a time is filled into a cache of its
        own, and the caches are joined. A row's numbers do not depend on the group it is filled with.
        """
        from transformers import DynamicCache

        rows, width = prompts["input_ids"].shape
        caches: list[Any] = []
        logits: list[Tensor] = []
        first = 0
        while first < rows:
            if first:
                yield  # between two groups' passes
            group = rows if pass_s is None else max(1, self._pass_positions(pass_s) // _MIN_PASS_COLUMNS)
            last = min(rows, first + group)
            caches.append(DynamicCache())
            part = {name: prompts[name][first:last] for name in prompts}
            passes = self._prompt_passes(adapters[first:last], part, caches[-1], pass_s, logits_to_keep=1)
            end, logits_G1V = next(passes)
            while end < width:
                yield  # between two passes: the worker may run others' work, a deadline may stop this one
                end, logits_G1V = next(passes)
            logits.append(logits_G1V[:, -1].float())
            first = last
        return _joined_caches(caches), torch.cat(logits)

    def _params_per_prompt(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[SamplingParams]:
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of prompts; wrap a single string in a list")
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts; pass one per prompt or one"
            )
        for index, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"sampling_params[{index}] must be a SamplingParams; got {type(p).__name__}")
        return params

    def _prompt_ids(self, index: int, prompt: Sequence[int] | str) -> list[int]:
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError(f"prompts[{index}] is empty; give at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompts[{index}] holds token ids outside [0, {self.vocab_size})")
        limit, named = context_limit(self.model.config, self.config.max_seq_len)
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompts[{index}] has {len(ids)} tokens; it must be shorter than {named} to leave room for generation"
            )
        return ids

    def _row_seeds(self, params: SamplingParams) -> list[int]:
        if params.seed is None:
            return [int(torch.randint(0, 2**62, (1,), generator=self._generator)) for _ in range(params.n)]
        return [(params.seed * _SEED_MIX + index) % 2**63 for index in range(params.n)]

    @torch.no_grad()
    def _decode_steps(self, rows: list[_Row], pass_s: float | None = None) -> Iterator[None]:
        """Prefill the left-padded prompts, then decode one token per step for every unfinished row;
        yields after each step, so a caller can stop between steps (closing the generator frees the cache).

        Rows with the same prompt and adapter (a group's ``n`` samples) share one prefill: it runs
        once and its cache is copied to each. ``pass_s``: the prefill runs in passes of about that
        long (see :meth:`_prompt_passes`), and yields between two. Finished rows leave the batch (and
        the KV cache), so short answers stop costing compute.
        """
        device = self.device
        width = max(len(r.prompt_ids) for r in rows)
        max_new = max(r.max_new for r in rows)
        input_BP = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask_BP = torch.zeros((len(rows), width), dtype=torch.long)
        # Uniform draws come from each row's own generator up front: a row's samples never depend on its batch.
        uniform_BT = torch.zeros((len(rows), max_new))
        for b, row in enumerate(rows):
            input_BP[b, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask_BP[b, width - len(row.prompt_ids) :] = 1
            uniform_BT[b, : row.max_new] = torch.rand(row.max_new, generator=torch.Generator().manual_seed(row.seed))
        stops = [self._stop_ids(row.params) for row in rows]

        live = list(range(len(rows)))  # indices into rows of the batch's current members
        sampler = _RowSampler(rows, device)
        input_ids, mask_BT, uniform_BT = input_BP.to(device), mask_BP.to(device), uniform_BT.to(device)
        position_ids = (mask_BT.cumsum(-1) - 1).clamp_min(0)
        distinct, copies = _distinct_prompts(rows)
        prompts = {"input_ids": input_ids, "attention_mask": mask_BT, "position_ids": position_ids}
        if len(distinct) < len(rows):
            prompts = {name: t.index_select(0, torch.tensor(distinct, device=device)) for name, t in prompts.items()}
        cache, logits_BV = yield from self._prefill([rows[i].adapter for i in distinct], prompts, pass_s)
        if len(distinct) < len(rows):  # each row takes its prompt's cache and next-token logits
            copies_B = torch.tensor(copies, device=device)
            cache.batch_select_indices(copies_B)
            logits_BV = logits_BV.index_select(0, copies_B)
        for step in range(max_new):
            if step:
                adapters = [rows[i].adapter for i in live]
                inputs = {"input_ids": input_ids, "attention_mask": mask_BT, "position_ids": position_ids}
                out = self._forward(adapters, **inputs, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
                logits_BV = out.logits[:, -1].float()
            tokens_B, logprobs_B = sampler.sample(logits_BV, uniform_BT[:, step])
            topk_B = sampler.topk(logits_BV)
            keep = []
            cancelled = self._cancelled
            for b, (token, logprob) in enumerate(zip(tokens_B.tolist(), logprobs_B.tolist(), strict=True)):
                row = rows[live[b]]
                row.token_ids.append(token)
                row.logprobs.append(logprob)
                if row.params.topk_logprobs:
                    row.topk_logprobs.append(topk_B[b][: row.params.topk_logprobs])
                if cancelled and row.params.tag in cancelled:
                    row.finish_reason = "cancelled"
                elif not self._finished(row, stops[live[b]]):
                    keep.append(b)
            yield
            if not keep:
                break
            input_ids, position_ids = tokens_B[:, None], position_ids[:, -1:] + 1
            mask_BT = torch.cat([mask_BT, mask_BT.new_ones((len(live), 1))], dim=-1)
            if len(keep) < len(live):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                input_ids, position_ids, mask_BT, uniform_BT = (
                    t.index_select(0, index) for t in (input_ids, position_ids, mask_BT, uniform_BT)
                )
                live = [live[b] for b in keep]
                sampler = _RowSampler([rows[i] for i in live], device)

    def _forward(self, adapters: list[str] | str, **kwargs: Any) -> Any:
        """The model's forward, each row through its adapter on a shared base."""
        if self.shared is None:
            return self.model(**kwargs)
        return self.shared.forward(adapters, **kwargs)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = None if params.ignore_eos else self.tokenizer.eos_token_id
        return frozenset(params.stop_token_ids) | ({eos} if eos is not None else set())

    def _finished(self, row: _Row, stop_ids: frozenset[int]) -> bool:
        if row.token_ids[-1] in stop_ids:
            row.finish_reason = "stop"
            return True
        if row.params.stop:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in row.params.stop if s and s in text]
            if cuts:
                row.finish_reason, row.text = "stop", text[: min(cuts)]
                return True
        if len(row.token_ids) >= row.max_new:
            row.finish_reason = "length"
            return True
        return False

    def _result(self, row: _Row, version: int) -> dict[str, Any]:
        text = row.text if row.text is not None else self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        result: dict[str, Any] = {
            "token_ids": row.token_ids,
            "text": text,
            "finish_reason": row.finish_reason or "length",
            "policy_version": version,
        }
        if row.params.logprobs:
            result["logprobs"] = row.logprobs
        if row.params.topk_logprobs:
            result["topk_logprobs"] = row.topk_logprobs
        return result

    # --- weights and memory -------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, policy_version: int) -> int:
        """Copy tensors into the model's parameters in place; returns the bytes copied.

        With LoRA only adapter tensors are accepted (the base weights never change), named as the
        trainer's parameters or as a PEFT ``adapter_model.safetensors`` names them, so a sampler
        can also start from a weights-only LoRA checkpoint.

        Raises:
            InvalidRequestError: a name the model does not have, or a shape that differs.
        """
        copied = 0
        for name, tensor in named_tensors:
            param = self._params.get(peft_key(name))
            if param is None:
                what = "an adapter parameter" if self.lora is not None else "a parameter"
                raise InvalidRequestError(
                    f"weight {name!r} is not {what} of the sampling model; sync from a trainer of the same model "
                    "and the same lora settings"
                )
            if param.shape != tensor.shape:
                raise InvalidRequestError(
                    f"weight {name!r} has shape {list(tensor.shape)}; the sampling model expects {list(param.shape)}"
                )
            param.copy_(tensor)
            copied += tensor.numel() * tensor.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.policy_version = int(policy_version)
        return copied

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Offload the weights to CPU (on an accelerator; nothing to free on CPU)."""
        del level  # the torch engine keeps no KV cache between calls: every level frees the same
        if self.device.type != "cpu" and not self._asleep and not self._sharing:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True
        return {}

    @property
    def _sharing(self) -> bool:
        """Other adapters live on this engine's base: it stays on its device for them."""
        return self.shared is not None and (self.lora is None or len(self.shared.adapters) > 1)

    def wake(self) -> dict[str, Any]:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False
        return {}

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Nothing to reset: the torch engine builds a fresh KV cache for every batch."""
        return {}


def generate_together(
    calls: Sequence[tuple[SamplingEngine, Sequence[Sequence[int] | str], SamplingParams | Sequence[SamplingParams]]],
) -> list[list[dict[str, Any]]]:
    """Run several samplers' generate calls as one decode, each row through its sampler's adapter.

    The samplers must share one base (a model host's): the rows of every call then go through one
    forward per decode step, in batches bounded by rows and tokens (:func:`decode_batches`). A row's tokens depend
    on its own seed alone, so each call gets what it would get alone. Returns one result list per
    call, as :meth:`SamplingEngine.generate` returns it.

    Raises:
        InvalidRequestError: a call's prompts or params are invalid (nothing is decoded then).
    """
    results: dict[int, list[dict[str, Any]]] = {}
    for done, _ in generate_steps(calls):
        results.update(done)
    return [results[index] for index in range(len(calls))]


def generate_steps(
    calls: Sequence[tuple[SamplingEngine, Sequence[Sequence[int] | str], SamplingParams | Sequence[SamplingParams]]],
    watched: Collection[int] = (),
    pass_s: float | None = None,
) -> Iterator[tuple[dict[int, list[dict[str, Any]]], dict[int, list[dict[str, Any]]]]]:
    """:func:`generate_together` one decode step at a time: yields after each step ``(done, news)``:
    the results of the calls whose rows have all finished, by call index (each call once), so a small
    call that shares a long decode is answered when its own rows end (its decode batch runs first);
    and for each ``watched`` call still running whose rows grew, per row what it decoded since the
    last news (``token_ids``, and ``logprobs`` / ``topk_logprobs`` where its params ask), so a
    caller can stream it. ``pass_s``: prompts are prefilled and scored in passes of about that long
    (see :meth:`SamplingEngine._prompt_passes`), each pass a step of its own. Checks every call before
    the first step; closing the generator stops the decode there and frees its cache."""
    first = calls[0][0]
    if any(
        engine is not first and (engine.shared is None or engine.shared is not first.shared) for engine, *_ in calls
    ):
        raise ValueError("generate_together needs samplers that share one base model")
    planned = [(engine, engine._plan(prompts, params), engine.policy_version) for engine, prompts, params in calls]
    rows = [row for _, call_rows, _ in planned for row in call_rows]
    # The decode batch holding a row of the smallest call goes first: a small call is answered early.
    size = {id(row): sum(len(r.prompt_ids) + r.max_new for r in call_rows) for _, call_rows, _ in planned
            for row in call_rows}  # fmt: skip
    chunks = decode_batches(rows, first.config.sampling.max_batch_size, first.token_budget)
    chunks.sort(key=lambda chunk: min(size[id(row)] for row in chunk))
    pending = set(range(len(planned)))
    reported = {id(row): 0 for index in watched for row in planned[index][1]}  # row -> tokens sent as news
    try:
        for chunk in chunks:
            batch = sorted(chunk, key=lambda row: row.adapter)  # an adapter's rows in a run
            for _ in first._decode_steps(batch, pass_s):
                done = [index for index in pending if all(row.finish_reason for row in planned[index][1])]
                pending.difference_update(done)
                finished = {}
                for index in done:
                    engine, call_rows, version = planned[index]
                    finished[index] = yield from _quiet(engine._finish(call_rows, version, pass_s))
                yield finished, _news({index: planned[index][1] for index in watched if index in pending}, reported)
        if pending:  # calls with no rows to decode
            finished = {}
            for index in sorted(pending):
                engine, call_rows, version = planned[index]
                finished[index] = yield from _quiet(engine._finish(call_rows, version, pass_s))
            yield finished, {}
    finally:
        for engine, call_rows, _ in planned:
            engine._cancelled.difference_update(row.params.tag for row in call_rows)


def _quiet(steps: Generator[None, None, Any]) -> Generator[tuple[dict, dict], None, Any]:
    """``steps`` as steps of :func:`generate_steps` with nothing to report: ``({}, {})`` at each of its
    pauses; returns what ``steps`` returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        yield {}, {}


def _news(calls: dict[int, list[_Row]], reported: dict[int, int]) -> dict[int, list[dict[str, Any]]]:
    """What each call's rows decoded past ``reported`` (which this advances), for the calls whose rows grew."""
    news: dict[int, list[dict[str, Any]]] = {}
    for index, rows in calls.items():
        if all(len(row.token_ids) == reported[id(row)] for row in rows):
            continue
        grown = []
        for row in rows:
            start = reported[id(row)]
            reported[id(row)] = len(row.token_ids)
            new: dict[str, Any] = {"token_ids": row.token_ids[start:]}
            if row.params.logprobs:
                new["logprobs"] = row.logprobs[start:]
            if row.params.topk_logprobs:
                new["topk_logprobs"] = row.topk_logprobs[start:]
            grown.append(new)
        news[index] = grown
    return news


def _joined_caches(caches: list[Any]) -> Any:
    """One cache holding the rows of ``caches`` (each a ``DynamicCache`` of the same columns) in order.
    Each layer's parts are let go as soon as it is joined, so a join holds about one layer more than
    its parts did."""
    joined = caches[0]
    if len(caches) == 1:
        return joined
    for index, layer in enumerate(joined.layers):
        parts = [cache.layers[index] for cache in caches]
        layer.keys = torch.cat([part.keys for part in parts])
        layer.values = torch.cat([part.values for part in parts])
        for part in parts[1:]:
            part.keys = part.values = None
    return joined


def _distinct_prompts(rows: list[_Row]) -> tuple[list[int], list[int]]:
    """The first row of each distinct (adapter, prompt), in order (an adapter's rows stay together),
    and for every row the position of its prompt among those."""
    position: dict[tuple[str, tuple[int, ...]], int] = {}
    distinct: list[int] = []
    copies: list[int] = []
    for index, row in enumerate(rows):
        key = (row.adapter, tuple(row.prompt_ids))
        if key not in position:
            position[key] = len(distinct)
            distinct.append(index)
        copies.append(position[key])
    return distinct, copies


def decode_batches(rows: list[_Row], max_rows: int, max_tokens: int) -> list[list[_Row]]:
    """Rows in batches of at most ``max_rows`` rows and ``max_tokens`` positions (rows × the longest
    prompt plus new tokens), longest first, so that each batch's rows pad little; one row always fits.

    A row joins a batch only if the batch's longest prompt pads it by at most :data:`_PAD_RATIO`
    times its own length, or :data:`_PAD_SLACK` columns: a short prompt never waits for a prompt many
    times as long to be prefilled (the batch of a small call runs first), nor pays for its columns."""
    batches: list[list[_Row]] = []
    width = new = shortest = 0  # the current batch's longest prompt, most new tokens and shortest prompt
    for row in sorted(rows, key=lambda row: -(len(row.prompt_ids) + row.max_new)):
        grown = (max(width, len(row.prompt_ids)), max(new, row.max_new))
        least = min(shortest, len(row.prompt_ids))
        pads_little = grown[0] - least <= max(_PAD_RATIO * least, _PAD_SLACK)
        if (
            batches
            and pads_little
            and len(batches[-1]) < max_rows
            and (len(batches[-1]) + 1) * sum(grown) <= max_tokens
        ):
            batches[-1].append(row)
            (width, new), shortest = grown, least
            continue
        batches.append([row])
        width, new, shortest = len(row.prompt_ids), row.max_new, len(row.prompt_ids)
    return batches


class _RowSampler:
    """Pick next tokens for a batch whose rows each have their own temperature, top-k and top-p."""

    def __init__(self, rows: list[_Row], device: torch.device) -> None:
        params = [r.params for r in rows]
        self.temperature_B1 = torch.tensor([p.temperature or 1.0 for p in params], device=device)[:, None]
        self.top_k_B = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params], device=device)
        self.top_p_B = torch.tensor([p.top_p for p in params], device=device)
        filtered = [p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params]
        plain = [p.temperature > 0 and not f for p, f in zip(params, filtered, strict=True)]
        self.filtered_rows = torch.tensor([b for b, f in enumerate(filtered) if f], dtype=torch.long, device=device)
        self.plain_rows = torch.tensor([b for b, f in enumerate(plain) if f], dtype=torch.long, device=device)
        self.max_topk = max(p.topk_logprobs for p in params)

    def topk(self, logits_BV: Tensor) -> list[list[list[float]]]:
        """Per row, the ``max_topk`` likeliest ``[token, logprob]`` pairs under the raw distribution
        (empty when no row asks for them)."""
        if not self.max_topk:
            return [[] for _ in range(logits_BV.shape[0])]
        values_BK, tokens_BK = F.log_softmax(logits_BV, dim=-1).topk(min(self.max_topk, logits_BV.shape[-1]), dim=-1)
        return [
            [[t, v] for t, v in zip(ids, values, strict=True)]
            for ids, values in zip(tokens_BK.tolist(), values_BK.tolist(), strict=True)
        ]

    def sample(self, logits_BV: Tensor, uniform_B: Tensor) -> tuple[Tensor, Tensor]:
        """Return the chosen token per row and its log-prob under the raw (temperature 1) distribution."""
        tokens_B = logits_BV.argmax(-1)
        if self.plain_rows.numel():
            rows = self.plain_rows
            probs_RV = F.softmax(logits_BV[rows] / self.temperature_B1[rows], dim=-1)
            tokens_B[rows] = _inverse_cdf(probs_RV, uniform_B[rows])
        if self.filtered_rows.numel():
            rows = self.filtered_rows
            sorted_RV, order_RV = (logits_BV[rows] / self.temperature_B1[rows]).sort(dim=-1, descending=True)
            probs_RV = F.softmax(sorted_RV, dim=-1)
            rank_V = torch.arange(probs_RV.shape[-1], device=probs_RV.device)
            top_k_R1 = self.top_k_B[rows][:, None]
            probs_RV = probs_RV * ((top_k_R1 == 0) | (rank_V < top_k_R1))
            probs_RV = probs_RV / probs_RV.sum(-1, keepdim=True)
            # Then the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before_RV = probs_RV.cumsum(-1) - probs_RV
            picked_R = _inverse_cdf(probs_RV * (mass_before_RV < self.top_p_B[rows][:, None]), uniform_B[rows])
            tokens_B[rows] = order_RV.gather(-1, picked_R[:, None]).squeeze(-1)
        logprobs_B = F.log_softmax(logits_BV, dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)
        return tokens_B, logprobs_B


def _inverse_cdf(weights_RV: Tensor, uniform_R: Tensor) -> Tensor:
    """Index drawn from unnormalised non-negative weights with one uniform number per row."""
    cdf_RV = weights_RV.cumsum(-1)
    target_R1 = (uniform_R * cdf_RV[:, -1])[:, None]
    picked_R = torch.searchsorted(cdf_RV, target_R1, right=True).squeeze(-1)
    return picked_R.clamp_max(weights_RV.shape[-1] - 1)


class VLLMSamplingEngine:
    """The sampling role on GPU via vLLM, with the same methods as :class:`SamplingEngine`.

    Weight loading hands the tensors to the model through ``LLM.apply_model``; to pass them without
    serialising, vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set
    here unless the caller chose). With LoRA, synced adapter tensors are gathered (they may arrive
    in several buckets) and, before the next generate, written as a PEFT folder that vLLM loads
    through a fresh ``LoRARequest``; the previous adapter is dropped. Not exercised by the CPU test suite.
    """

    def __init__(self, config: ClientConfig, *, device: str | torch.device = "cuda", model_dir: Path | None = None):
        if config.lora is not None and config.lora.bias != "none":  # vLLM's PEFT loader takes bias="none" only
            raise InvalidRequestError(
                f"lora.bias={config.lora.bias!r}: vLLM serves LoRA adapters without biases; set lora.bias='none', "
                "or sample with the torch engine (sampling.engine='torch')"
            )
        if importlib.util.find_spec("vllm") is None:
            raise ImportError("sampling.engine='vllm' needs vLLM: pip install icefloe[gpu]")
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm

        del device  # vLLM places the model itself
        self.config = config
        self._vllm = vllm
        self.model_dir = Path(model_dir) if model_dir is not None else resolve_model(config.model, seed=config.seed)
        kwargs = {"dtype": config.dtype, "seed": config.seed, "max_model_len": config.max_seq_len}
        # raw_logprobs: log-probs before temperature/top-p, the quantity the trainer's forward returns.
        kwargs |= {"enable_sleep_mode": True, "logprobs_mode": "raw_logprobs"}
        self.lora = config.lora
        if self.lora is not None:
            kwargs |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": _vllm_lora_rank(self.lora.rank)}
        self.llm = vllm.LLM(model=str(self.model_dir), **(kwargs | config.sampling.engine_kwargs))
        self.tokenizer = self.llm.get_tokenizer()
        self.policy_version = 0
        self._adapter_tensors: dict[str, Tensor] = {}  # synced since the adapter was last written
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="icefloe-lora-")) if self.lora is not None else None
        self._lora_request: Any = None  # None until the first sync: the base model (zero adapters) samples
        self._num_adapters = 0
        self._stale_prefixes = False  # full weights changed since the prefix cache was filled

    def generate(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[dict[str, Any]]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if any(
            p.prompt_logprobs or p.topk_prompt_logprobs or p.target_prompt_logprobs or p.topk_logprobs
            for p in per_prompt
        ):
            raise InvalidRequestError(
                "prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs and topk_logprobs are served by the "
                "torch sampler only; sample on CPU for them"
            )
        inputs = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        vllm_params = [self._vllm_params(p) for p in per_prompt]
        if self._stale_prefixes:  # once after a sync, however many buckets: cached KV holds the old weights' values
            self.llm.reset_prefix_cache()
            self._stale_prefixes = False
        version = self.policy_version
        lora_request = self._current_adapter()
        outputs = self.llm.generate(inputs, vllm_params, use_tqdm=False, lora_request=lora_request)
        results = []
        for request, wanted in zip(outputs, per_prompt, strict=True):
            for completion in request.outputs:
                result: dict[str, Any] = {
                    "token_ids": list(completion.token_ids),
                    "text": completion.text,
                    "finish_reason": "stop" if completion.finish_reason == "stop" else "length",
                    "policy_version": version,
                }
                if wanted.logprobs:
                    result["logprobs"] = [
                        entry[token].logprob
                        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
                    ]
                results.append(result)
        return results

    def cancel(self, tags: Sequence[str]) -> None:
        """A started vLLM generate runs to its end: the service's cancel drops only calls not yet started."""
        del tags

    def _vllm_params(self, params: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            n=params.n, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids), seed=params.seed, logprobs=0 if params.logprobs else None,
            ignore_eos=params.ignore_eos,
        )  # fmt: skip

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, policy_version: int) -> int:
        tensors = list(named_tensors)
        if self.lora is None:
            self.llm.apply_model(lambda model: model.load_weights(weights=tensors))
            self._stale_prefixes = True
        else:  # copies: a broadcast hands over views of a staging buffer it reuses for the next bucket
            self._adapter_tensors.update((peft_key(name), t.detach().to("cpu", copy=True)) for name, t in tensors)
        self.policy_version = int(policy_version)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def _current_adapter(self) -> Any:
        """The ``LoRARequest`` of the last synced adapter, writing it first when a sync delivered a new one."""
        if not self._adapter_tensors:
            return self._lora_request
        from vllm.lora.request import LoRARequest

        assert self.lora is not None and self._adapter_dir is not None
        previous = self._lora_request
        self._num_adapters += 1
        folder = self._adapter_dir / f"adapter-{self._num_adapters}"
        write_adapter_folder(folder, self.lora, self._adapter_tensors.items())
        # A new id each time: vLLM caches adapters by id and would keep serving the old weights.
        self._lora_request = LoRARequest(
            lora_name=f"icefloe-{self._num_adapters}", lora_int_id=self._num_adapters, lora_path=str(folder)
        )
        self._adapter_tensors = {}
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return self._lora_request

    def sleep(self, level: int = 1) -> dict[str, Any]:
        self.llm.sleep(level=level)
        return {}

    def wake(self) -> dict[str, Any]:
        self.llm.wake_up()
        return {}

    def reset_prefix_cache(self) -> dict[str, Any]:
        self.llm.reset_prefix_cache()
        return {}


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [value for value in allowed if value >= rank]
    if not fitting:
        raise InvalidRequestError(f"lora.rank={rank} is above vLLM's largest LoRA rank ({allowed[-1]}); lower it")
    return fitting[0]


def build_sampling_engine(
    config: ClientConfig, device: str | torch.device = "auto", *, model_dir: Path | None = None
) -> SamplingEngine | VLLMSamplingEngine:
    """The sampling engine ``config.sampling.engine`` asks for.

    ``auto`` picks vLLM when the device is CUDA and vLLM is installed, else torch. ``model_dir`` is
    the model folder to load (None: ``config.model``), or a weights-only LoRA checkpoint (a PEFT
    folder): the engine then loads the base ``config.model`` and starts with that adapter.
    """
    adapter = read_adapter_checkpoint(model_dir, config.lora) if model_dir is not None else None
    if adapter is not None:
        model_dir = None
    resolved = resolve_device(device)
    choice = config.sampling.engine
    if choice == "auto":
        choice = "vllm" if resolved.type == "cuda" and importlib.util.find_spec("vllm") is not None else "torch"
    engine_class = VLLMSamplingEngine if choice == "vllm" else SamplingEngine
    engine = engine_class(config, device=resolved, model_dir=model_dir)
    if adapter is not None:
        engine.load_weights(adapter.items(), policy_version=0)
    return engine
