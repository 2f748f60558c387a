"""TrainingEngine: a Hugging Face causal LM with AdamW, an LR schedule and safetensors checkpoints.

One engine is one model replica in one process. ``fwd_bwd`` accumulates gradients until ``step``,
so several calls that pass the whole optimizer batch's normalisers (``batch_num_tokens``,
``global_batch_size``) train exactly like one big call. Master weights stay float32; on CUDA,
``dtype="bfloat16"`` runs forward and backward under autocast. Dropout is off in ``forward`` so
the log-probs it returns are the ones the sampler sees. With ``config.lora`` the model is wrapped
by ``peft`` and only the adapters train (see ``engines/lora.py``); the base with adapters disabled
then serves as the KL reference. Tensors: B rows, S positions, V vocabulary; b rows and W
positions of one micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import Tensor

from icefloe.config import ClientConfig, OptimizerConfig, TrainingConfig
from icefloe.engines.batch import as_frame, shifted_token_logprobs
from icefloe.engines.lora import (
    ADAPTER_WEIGHTS_FILE,
    BASE_ADAPTER,
    SharedBase,
    merged_copy,
    read_adapter_checkpoint,
    write_adapter_folder,
)
from icefloe.engines.losses import get_loss
from icefloe.engines.micro_batches import (
    MicroBatch,
    Spans,
    check_rows_fit,
    cut_micro_batch,
    default_token_budget,
    place_rows,
    plan_micro_batches,
    row_spans,
    training_bytes_per_token,
)
from icefloe.engines.models import context_limit, load_causal_lm, load_tokenizer, open_modes, resolve_model
from icefloe.protocol import InvalidRequestError, UnsupportedOpError

__all__ = [
    "CHECKPOINT_KINDS",
    "TrainingEngine",
    "describe_checkpoint",
    "fwd_bwd_together",
    "optimizer_file_tensors",
    "optimizer_state_from_file",
    "publish_folder",
    "resolve_device",
]

log = logging.getLogger(__name__)

CHECKPOINT_KINDS = ("resumable", "weights-only")
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FILE = "trainer_state.json"
_AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# A pass cut for fair share keeps at least 1/this of the token budget: per-pass overhead stays small.
_MIN_PASS_SHARE = 4


def publish_folder(staging: Path, target: Path) -> None:
    """Put a fully written folder at ``target``, replacing any older one without a moment of absence.

    The old folder is renamed aside first and deleted last, so a crash leaves either the old or the
    new checkpoint in place, never neither (the service's records keep pointing at something real).
    """
    open_modes(staging)
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.rename(target, aside)
    os.rename(staging, target)
    shutil.rmtree(aside, ignore_errors=True)


def free_checkpoint_name(root: Path, global_step: int) -> str:
    """``global_step{N}``, or ``global_step{N}-2``, ``-3``, ... when saves at step N exist: no save replaces another."""
    name, copy = f"global_step{global_step}", 1
    while (root / (name if copy == 1 else f"{name}-{copy}")).exists():
        copy += 1
    return name if copy == 1 else f"{name}-{copy}"


def describe_checkpoint(path: Path, global_step: int, kind: str) -> dict[str, Any]:
    """What saving or loading a checkpoint returns: ``{checkpoint_id, global_step, path, kind}``."""
    return {"checkpoint_id": path.name, "global_step": global_step, "path": str(path), "kind": kind}


def optimizer_file_tensors(state_by_index: Mapping[int, Mapping[str, Any]]) -> dict[str, Tensor]:
    """AdamW state as ``optimizer.safetensors`` holds it: ``state.{param_index}.{exp_avg|exp_avg_sq|step}``."""
    return {
        f"state.{index}.{key}": value.detach().to("cpu").contiguous()
        for index, state in state_by_index.items()
        for key, value in state.items()
        if isinstance(value, Tensor)
    }


def optimizer_state_from_file(
    tensors: Mapping[str, Tensor], trainer_state: Mapping[str, Any], keys: Sequence[Any]
) -> dict[str, Any]:
    """An optimizer state dict from ``optimizer.safetensors``, parameter ``i`` keyed by ``keys[i]``."""
    per_param: dict[Any, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        if int(index) >= len(keys):
            raise InvalidRequestError(
                f"optimizer state names parameter {index}, but the model has {len(keys)}; the "
                "checkpoint belongs to a different model"
            )
        per_param.setdefault(keys[int(index)], {})[key] = tensor
    groups = [{**group, "betas": tuple(group["betas"])} for group in trainer_state["param_groups"]]
    groups[0]["params"] = list(keys)
    return {"state": per_param, "param_groups": groups}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` means CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TrainingEngine:
    """Forward/backward, optimizer steps and checkpoints for one model.

    Args:
        config: the client config; ``model``, ``seed``, ``dtype``, ``max_seq_len`` and ``training``
            are read.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.
        role: ``"training"``, or ``"reference"`` for an eval-only copy (no optimizer) that serves
            reference log-probs through ``forward``. A reference copy never has adapters: with
            LoRA, prefer ``forward(batch, reference=True)`` on the trainer, which needs no copy.
        model_dir: load this Hugging Face directory instead of resolving ``config.model``.
        shared: train a LoRA adapter of its own on this base, which other runs share (a model
            host's); ``device`` and ``model_dir`` are the base's then.
    """

    # The name a host that serves several runs knows this engine by (its sub-job): the warnings it logs
    # about its own calls carry it, so they reach that run's log and no other run's.
    owner: str | None = None

    def __init__(
        self,
        config: ClientConfig,
        *,
        device: str | torch.device = "cpu",
        role: Literal["training", "reference"] = "training",
        model_dir: Path | None = None,
        shared: SharedBase | None = None,
    ) -> None:
        if role not in ("training", "reference"):
            raise InvalidRequestError(f"role must be 'training' or 'reference'; got {role!r}")
        self.config = config
        self.role = role
        self.lora = config.lora if role == "training" else None
        torch.manual_seed(config.seed)
        if shared is not None:
            if self.lora is None:
                raise InvalidRequestError("a run on a shared base trains a LoRA adapter; set lora in its config")
            self.device, self.model_dir, self.tokenizer = shared.device, shared.model_dir, shared.tokenizer
        else:
            self.device = resolve_device(device)
            self.model_dir = Path(model_dir) if model_dir is not None else resolve_model(config.model, seed=config.seed)
            self.tokenizer = load_tokenizer(self.model_dir)
            base = load_causal_lm(self.model_dir, dtype=torch.float32, device=self.device)
            if role == "training" and config.training.gradient_checkpointing:
                _enable_activation_checkpointing(base)  # on the base model, before peft wraps it
            self.model = base
            if self.lora is not None:
                shared = SharedBase(base, model_dir=self.model_dir, tokenizer=self.tokenizer)
        self.shared = shared  # None: full weights (or an eval-only reference copy)
        self.adapter = BASE_ADAPTER
        if self.lora is not None:
            assert shared is not None
            self.adapter = shared.add(self.lora, trainable=True, seed=config.seed)
            self.model = shared.model
            self._params = list(shared.parameters(self.adapter).values())
        else:
            self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._autocast_dtype = _AUTOCAST_DTYPES.get(config.dtype) if self.device.type == "cuda" else None
        if config.dtype == "float16" and self._autocast_dtype is not None:
            log.warning("dtype=float16 trains under fp16 autocast without loss scaling; prefer bfloat16")
        self._global_step = 0
        self._last_lr = config.training.optimizer.lr
        self._last_loss: float | None = None
        self._tokens_per_s: float | None = None  # positions a fwd_bwd pass computes per second, as measured
        self._asleep = False
        self.optimizer: torch.optim.AdamW | None = None
        if role == "reference":
            self.model.requires_grad_(False)
            return
        opt = config.training.optimizer
        self.optimizer = torch.optim.AdamW(
            self._params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )

    # --- properties --------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (restored by a resumable checkpoint)."""
        return self._global_step

    @property
    def weights_version(self) -> int:
        """The version of the current weights: equal to ``global_step``."""
        return self._global_step

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    # --- compute ------------------------------------------------------------------------------
    def fwd_bwd(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Run the batch's loss forward and backward, adding to the accumulated gradients.

        Normalisers missing from ``processing.config`` default to this call's totals
        (``batch_num_tokens`` = Σ loss_mask, ``global_batch_size`` = B, ``loss_scale_factor`` = S),
        so the micro-batches (see :meth:`token_budget`) add up to the one-pass result. Returns
        ``{loss, avg_loss, metrics, num_tokens}``: ``metrics`` are token-weighted over micro-batches
        (``metrics["loss"]`` = ``loss``; ``padding_ratio`` = positions computed ÷ real tokens),
        ``num_tokens`` = Σ loss_mask.
        """
        return fwd_bwd_together([(self, batch)])[0]

    @torch.no_grad()
    def forward(self, batch: Mapping[str, Any], *, reference: bool = False) -> dict[str, Tensor]:
        """Shifted log-probs and entropies of the batch's tokens, float32 ``[B, S]`` on CPU.

        ``processing.config.temperature`` (default 1) divides the logits first. ``reference=True``
        scores with the reference policy: the base model with the adapters disabled, which only a
        LoRA trainer has (otherwise the reference is a separate ``role="reference"`` engine).
        Columns outside a row's span (padding; see ``engines/micro_batches.py``) read 0.
        """
        self._require_awake()
        if reference and self.lora is None:
            raise UnsupportedOpError(
                "forward(reference=True) on a training engine needs LoRA (the base model is the reference); "
                "set lora, or score with a role='reference' engine (num_log_prob_workers=1)"
            )
        frame = self._validated(batch, require_context=False)
        temperature = _temperature(frame["processing"]["config"])
        spans, passes = self._plan(frame)
        shifted = "target_tokens" not in frame["context"]
        self._set_train_mode(False)
        shape = frame["kwargs"]["input_ids"].shape
        logprobs_BS, entropy_BS = torch.zeros(shape), torch.zeros(shape)
        for micro in passes:
            if not micro.rows:
                self._idle_pass(backward=False)
                continue
            part = cut_micro_batch(frame, micro, spans)
            kwargs = self._to_device(part["kwargs"])
            logits_bWV = self._logits(kwargs, micro.rows, reference=reference)
            targets_bW = part["context"].get("target_tokens")
            targets_bW = None if targets_bW is None else targets_bW.to(self.device)
            logprobs_bW, entropy_bW = shifted_token_logprobs(
                logits_bWV, kwargs["input_ids"], temperature, targets_BS=targets_bW
            )
            place_rows(logprobs_BS, logprobs_bW.cpu(), micro, spans, shifted=shifted)
            place_rows(entropy_BS, entropy_bW.cpu(), micro, spans, shifted=shifted)
        return {"logprobs": logprobs_BS, "entropy": entropy_BS}

    def _logits(
        self,
        kwargs: Mapping[str, Tensor],
        rows: tuple[int, ...],
        *,
        reference: bool = False,
        adapters: list[str] | None = None,
    ) -> Tensor:
        """The one model call of ``fwd_bwd`` and ``forward``: logits ``[b, W, V]`` of one pass.

        ``rows`` are the pass's rows in the caller's batch; ``adapters`` names each row's adapter on a
        shared base (a pass of several runs); ``reference``: the base with this run's adapter off.
        """
        del rows
        with self._autocast():
            if self.shared is None:
                return self.model(**kwargs, use_cache=False).logits
            routed = adapters if adapters is not None else BASE_ADAPTER if reference else self.adapter
            return self.shared.forward(routed, **kwargs, use_cache=False).logits

    def _idle_pass(self, *, backward: bool) -> None:
        """A pass over one token that changes nothing, for a rank that has run out of rows: sharded ranks
        must run the same number of passes (each one gathers parameters and reduces gradients together)."""
        input_ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        with torch.set_grad_enabled(backward):
            logits = self._logits({"input_ids": input_ids}, ())
            if backward:
                (logits.float().sum() * 0.0).backward()

    def _plan(self, frame: Mapping[str, Any], pass_s: float | None = None) -> tuple[Spans, list[MicroBatch]]:
        """Each row's span and the passes over them; a row longer than the budget is refused here,
        before any work. ``pass_s``: also cut passes to about that many seconds each at the speed
        passes ran so far, so that other work can run between them; never below the longest row, nor
        below a quarter of the budget (more, smaller passes would cost more than they let others in).
        Before any pass was timed, passes are at that floor: the budget's passes of an engine's first
        op would hold the host for seconds on a CPU while another run's small op waits."""
        budget = self.token_budget
        spans = row_spans(frame, whole=budget == 0)
        if budget:
            check_rows_fit(spans, budget, "training.micro_batch_tokens")
            if pass_s is not None:
                floor = max(int(spans.length_B.max()) if len(spans.length_B) else 0, budget // _MIN_PASS_SHARE)
                fits = floor if self._tokens_per_s is None else int(self._tokens_per_s * pass_s)
                budget = min(budget, max(floor, fits))
        return spans, plan_micro_batches(spans, budget)

    def _timed_pass(self, num_positions: int, seconds: float) -> None:
        """Fold one pass's speed into the estimate :meth:`_plan` cuts passes by."""
        rate = num_positions / max(seconds, 1e-6)
        self._tokens_per_s = rate if self._tokens_per_s is None else 0.7 * self._tokens_per_s + 0.3 * rate

    @functools.cached_property
    def token_budget(self) -> int:
        """Positions per forward pass: ``training.micro_batch_tokens``, or when unset a share of the
        device's free memory over the model's activation bytes per token, at most 160 MiB of
        activations on CPU and 16384 tokens on CUDA, never below ``max_seq_len`` (see
        :func:`default_token_budget`). 0 means one pass over the batch as sent, padding and all."""
        if self.config.training.micro_batch_tokens is not None:
            return self.config.training.micro_batch_tokens
        per_token = training_bytes_per_token(
            self.model.config, dtype_bytes=2 if self._autocast_dtype is not None else 4,
            checkpointed=self.config.training.gradient_checkpointing,
        )  # fmt: skip
        budget = default_token_budget(per_token, self.device, floor=self.config.max_seq_len)
        log.info("micro-batch budget: %d tokens per pass (%d activation bytes per token)", budget, per_token)
        return budget

    def step(self, learning_rate: float | None = None, adam: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Clip gradients, apply one AdamW update, zero the gradients.

        ``learning_rate`` overrides the scheduled LR for this step only. ``adam`` (the Tinker API's
        per-step Adam parameters) sets ``beta1``, ``beta2``, ``eps``, ``weight_decay`` from this
        step on and ``grad_clip_norm`` for this step (0 = no clipping). ``grad_norm`` is the global
        norm before clipping; a non-finite norm skips the update (the step still counts).
        """
        optimizer = self._require_training("step")
        if learning_rate is not None and not 0 <= learning_rate < math.inf:
            raise InvalidRequestError(f"learning_rate must be >= 0 and finite; got {learning_rate}")
        overrides = _adam_overrides(adam or {})
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:  # nothing to apply: advancing the step and the LR schedule would be silent damage
            raise InvalidRequestError(
                f"step() needs a fwd_bwd since the last step (global_step {self._global_step}); "
                "call fwd_bwd first, and to skip a step do not call step()"
            )
        grad_clip = overrides.pop("grad_clip_norm", self.config.training.grad_clip)
        beta1, beta2 = overrides.pop("beta1", None), overrides.pop("beta2", None)
        schedule = self.config.training.lr_schedule
        base_lr = self.config.training.optimizer.lr
        lr = learning_rate if learning_rate is not None else base_lr * schedule.multiplier(self._global_step)
        for group in optimizer.param_groups:
            betas = group["betas"]
            group["betas"] = (betas[0] if beta1 is None else beta1, betas[1] if beta2 is None else beta2)
            group.update(overrides, lr=lr)  # eps and weight_decay
        grad_norm_t = torch.nn.utils.get_total_norm(grads)
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, grad_clip, grad_norm_t)
        grad_norm = float(grad_norm_t.item())
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            log.warning(
                "skipping the optimizer update at step %d: grad_norm is %s",
                self._global_step,
                grad_norm,
                extra={"owner": self.owner},
            )
        optimizer.zero_grad(set_to_none=True)
        self._global_step += 1
        self._last_lr = lr
        result: dict[str, Any] = {
            "global_step": self._global_step,
            "lr": lr,
            "grad_norm": grad_norm,
            "metrics": {"lr": lr, "grad_norm": grad_norm},
        }
        if self.config.training.peak_memory_log:
            result["peak_memory"] = self._peak_memory()
        return result

    def _peak_memory(self) -> dict[str, int]:
        """High-water marks in bytes: the device's since the last step (then reset), the process's RSS ever."""
        gpu_peak = 0
        if self.device.type == "cuda":
            gpu_peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)  # the next reading covers the next fwd-bwd + step
        return {"gpu_peak": gpu_peak, "cpu_peak": _peak_rss_bytes()}

    def sync_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of what a weight sync moves: every parameter, or with LoRA this run's
        adapter only, named as PEFT files name it (so any adapter of the same shape can receive it)."""
        if self.shared is not None:
            return list(self.shared.parameters(self.adapter).items())
        return list(self.model.named_parameters())

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` of :meth:`sync_parameters` (tied weights once), detached, on the engine device."""
        for name, param in self.sync_parameters():
            yield name, param.detach()

    # --- memory -------------------------------------------------------------------------------
    def sleep(self) -> dict[str, Any]:
        """Move parameters, gradients and optimizer state to CPU to free accelerator memory.

        A run on a base that other runs share keeps it where it is: the others still use it.
        """
        if self.device.type != "cpu" and not self._asleep and not self._sharing:
            self._move_state(torch.device("cpu"))
            torch.cuda.empty_cache()
            self._asleep = True
        return {}

    def wake(self) -> dict[str, Any]:
        """Bring everything :meth:`sleep` offloaded back to the engine device."""
        if self._asleep:
            self._move_state(self.device)
            self._asleep = False
        return {}

    def _move_state(self, device: torch.device) -> None:
        self.model.to(device)
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device)

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, root: Path | str, kind: str = "resumable") -> dict[str, Any]:
        """Write ``root/global_step{N}/``: a loadable Hugging Face directory (+ optimizer state).

        ``resumable`` adds ``optimizer.safetensors`` and ``trainer_state.json`` (step, LR schedule,
        RNG) so :meth:`load_checkpoint` continues bit for bit; ``weights-only`` doubles as the HF
        export. With LoRA the weights are a PEFT adapter folder instead (``adapter_config.json`` +
        ``adapter_model.safetensors``); :meth:`export_merged` writes full weights. The folder is
        written aside and renamed, so a crash never leaves half a checkpoint.
        """
        self._check_checkpoint_kind(kind)
        return self.write_checkpoint(root, kind, *self.checkpoint_tensors(kind))

    def checkpoint_tensors(self, kind: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Full CPU tensors a checkpoint of ``kind`` holds: the weights, and the AdamW state when resumable."""
        weights = {name: t.to("cpu").contiguous() for name, t in self.named_weights()}
        return weights, self._optimizer_tensors() if kind == "resumable" else {}

    def write_checkpoint(
        self, root: Path | str, kind: str, weights: Mapping[str, Tensor], optimizer_tensors: Mapping[str, Tensor]
    ) -> dict[str, Any]:
        """Write ``root/global_step{N}/`` from full tensors: the one writer of the checkpoint format.

        Files: ``config.json`` and ``model.safetensors`` (with LoRA: ``adapter_config.json`` and
        ``adapter_model.safetensors``), the tokenizer, ``trainer_state.json``, and
        ``optimizer.safetensors`` when ``kind`` is ``resumable``.
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        target = root / free_checkpoint_name(root, self._global_step)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            if self.lora is not None:
                write_adapter_folder(staging, self.lora, weights.items())
            else:
                self.model.save_pretrained(str(staging), state_dict=dict(weights))
            self.tokenizer.save_pretrained(str(staging))
            if kind == "resumable":
                save_file(dict(optimizer_tensors), str(staging / _OPTIMIZER_FILE))
            (staging / _STATE_FILE).write_text(json.dumps(self._trainer_state(kind), indent=1))
            publish_folder(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return describe_checkpoint(target, self._global_step, kind)

    def load_checkpoint(self, path: Path | str, optimizer: bool = True) -> dict[str, Any]:
        """Restore weights from a checkpoint folder, plus optimizer, step and RNG when resumable.

        A plain Hugging Face directory (no ``trainer_state.json``) loads as ``weights-only``; so
        does a plain PEFT adapter folder into a LoRA engine. Loading weights only (a weights-only
        folder, or ``optimizer=False``) starts a fresh AdamW and keeps the engine's step. Returns
        :func:`describe_checkpoint`'s fields; ``global_step`` is the engine's step after the load
        (the step the LR schedule continues from), the folder's own only when it was restored.
        """
        path = Path(path)
        weight_files = sorted(p for p in path.glob("*.safetensors") if p.name != _OPTIMIZER_FILE)
        if not path.is_dir() or not weight_files:
            raise InvalidRequestError(
                f"checkpoint path {str(path)!r} holds no model *.safetensors; pass a folder written by "
                "save_checkpoint (e.g. <checkpoint_dir>/global_step12)"
            )
        is_adapter = (path / ADAPTER_WEIGHTS_FILE).is_file()
        if is_adapter != (self.lora is not None):
            held, engine = ("a LoRA adapter", "full weights") if is_adapter else ("full weights", "LoRA adapters")
            raise InvalidRequestError(
                f"checkpoint {str(path)!r} holds {held} but this engine trains {engine}; load it into an "
                f"engine configured {'with' if is_adapter else 'without'} lora"
            )
        state_path = path / _STATE_FILE
        state = json.loads(state_path.read_text()) if state_path.is_file() else {"kind": "weights-only"}
        kind = state.get("kind", "weights-only")
        if is_adapter:
            adapter = read_adapter_checkpoint(path, self.lora)  # refuses another rank or alpha, as the sampler does
            assert adapter is not None
            self._load_adapter(adapter)
        else:
            self._load_weights({name: t for file in weight_files for name, t in load_file(str(file)).items()})
        if self.optimizer is not None and optimizer and kind == "resumable":
            self._load_optimizer(load_file(str(path / _OPTIMIZER_FILE)), state)
            self._global_step = int(state["global_step"])
            self._last_lr = float(state["last_lr"])
            torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
            if state["rng"].get("cuda") and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["rng"]["cuda"]])
        elif self.optimizer is not None:  # moments of other weights would steer these ones: a fresh AdamW
            self.optimizer.state.clear()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        return describe_checkpoint(path, self._global_step, kind)

    def _check_checkpoint_kind(self, kind: str) -> None:
        if kind not in CHECKPOINT_KINDS:
            raise InvalidRequestError(f"checkpoint kind must be one of {list(CHECKPOINT_KINDS)}; got {kind!r}")
        if kind == "resumable":
            self._require_training("save_checkpoint(kind='resumable')")

    def _trainer_state(self, kind: str) -> dict[str, Any]:
        state: dict[str, Any] = {
            "kind": kind,
            "global_step": self._global_step,
            "last_lr": self._last_lr,
            "avg_loss": self._last_loss,
            "lr_schedule": self.config.training.lr_schedule.model_dump(),
            "base_lr": self.config.training.optimizer.lr,
        }
        if kind == "resumable":
            assert self.optimizer is not None
            state["param_groups"] = [
                {k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups
            ]
            state["rng"] = {"torch": torch.get_rng_state().tolist()}
            if self.device.type == "cuda":
                state["rng"]["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    def _optimizer_tensors(self) -> dict[str, Tensor]:
        assert self.optimizer is not None
        return optimizer_file_tensors({i: self.optimizer.state.get(p, {}) for i, p in enumerate(self._params)})

    def _load_optimizer(self, tensors: Mapping[str, Tensor], state: Mapping[str, Any]) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state_dict(optimizer_state_from_file(tensors, state, list(range(len(self._params)))))

    def export_merged(self, target: Path | str) -> dict[str, Any]:
        """Write the policy's full weights as a Hugging Face folder at ``target`` (LoRA: base + adapter merged).

        The merge runs on a copy, so the trainer's base weights and adapters stay exactly as they were.
        """
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            model = self.model if self.lora is None else merged_copy(self.model, self.adapter)
            model.save_pretrained(str(staging))
            self.tokenizer.save_pretrained(str(staging))
            publish_folder(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return describe_checkpoint(target, self._global_step, "merged")

    def _load_adapter(self, loaded: dict[str, Tensor]) -> None:
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(self.model, loaded, adapter_name=self.adapter)
        except RuntimeError as exc:  # a shape mismatch: another LoRA rank, or another model
            raise InvalidRequestError(
                f"adapter weights do not fit this engine's adapters ({exc}); load an adapter with the same rank "
                "and target modules"
            ) from None
        missing = [name for name in result.missing_keys if f".{self.adapter}." in name]
        if missing or result.unexpected_keys:
            raise InvalidRequestError(
                f"adapter weights do not match this engine's adapters: missing {sorted(missing)}, unexpected "
                f"{sorted(result.unexpected_keys)}; load an adapter with the same rank and target modules"
            )

    def _load_weights(self, loaded: dict[str, Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(loaded, strict=False)
        # Tied weights are saved once; the other name shares storage with a loaded parameter.
        own = self.model.state_dict()
        loaded_ptrs = {own[name].data_ptr() for name in loaded if name in own}
        missing = [name for name in missing if own[name].data_ptr() not in loaded_ptrs]
        if missing or unexpected:
            raise InvalidRequestError(
                f"checkpoint weights do not match the model: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}; load a checkpoint of the same model"
            )

    # --- helpers ------------------------------------------------------------------------------
    def _validated(self, batch: Mapping[str, Any], *, require_context: bool) -> dict[str, Any]:
        self._require_awake()
        frame = as_frame(batch, require_context=require_context, vocab_size=self.vocab_size)
        width = frame["kwargs"]["input_ids"].shape[1]
        limit, named = context_limit(self.model.config, self.config.max_seq_len)
        if width > limit:
            raise InvalidRequestError(
                f"kwargs.input_ids has {width} positions, more than {named}: shorten or split the rows"
            )
        return frame

    def _require_training(self, op: str) -> torch.optim.AdamW:
        if self.optimizer is None:
            raise UnsupportedOpError(f"{op} needs a training engine; this one has role={self.role!r} (eval only)")
        self._require_awake()
        return self.optimizer

    def _require_awake(self) -> None:
        if self._asleep:
            raise InvalidRequestError("the training engine is asleep; call wake() (wake_training) before using it")

    def _set_train_mode(self, train: bool) -> None:
        train = train and self.role == "training"
        if self.shared is not None:
            self.shared.train(train)
        elif self.model.training != train:
            self.model.train(train)

    @property
    def _sharing(self) -> bool:
        """Other adapters live on this engine's base (a model host's run)."""
        return self.shared is not None and len(self.shared.adapters) > 1

    def _to_device(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if self.device.type == "cpu":
            return dict(tensors)
        return {name: t.to(self.device, non_blocking=True) for name, t in tensors.items()}

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)


@dataclass
class _Call:
    """One fwd_bwd call of :func:`fwd_bwd_together`: its checked frame, its loss and what it adds up."""

    engine: TrainingEngine
    frame: dict[str, Any]
    loss_fn: Any
    config: dict[str, Any]
    num_tokens: int
    logprobs_BS: Tensor | None  # per-token log-probs, when the call asks for them
    spans: Spans | None = None
    total_loss: Tensor | None = None
    weighted: dict[str, Tensor | float] = field(default_factory=dict)
    positions: int = 0  # positions its passes computed for it

    @classmethod
    def of(cls, engine: TrainingEngine, batch: Mapping[str, Any]) -> _Call:
        engine._require_training("fwd_bwd")
        frame = engine._validated(batch, require_context=True)
        config = dict(frame["processing"]["config"])
        loss_mask_BS = frame["context"]["loss_mask"]
        num_tokens = int(loss_mask_BS.sum().item())  # CPU tensor: no device sync
        # Normalisers default to this call's totals, so micro-batches (and rows) all share them.
        for name, total in (("batch_num_tokens", num_tokens), ("global_batch_size", int(loss_mask_BS.shape[0])),
                            ("loss_scale_factor", int(loss_mask_BS.shape[1]))):  # fmt: skip
            if config.get(name) is None:
                config[name] = total
        _temperature(config)  # refused now, before any pass
        # Opt-in extra (the Tinker API's): the per-token log-probs of every row.
        logprobs_BS = torch.zeros(loss_mask_BS.shape) if config.get("return_logprobs") else None
        return cls(engine, frame, get_loss(frame["processing"]["loss_fn"]), config, num_tokens, logprobs_BS)

    @property
    def forward_only(self) -> bool:
        """Score the loss without touching the gradients (the Tinker API's forward)."""
        return bool(self.config.get("forward_only"))

    def score(self, logits_bWV: Tensor, part: dict[str, Any], micro: MicroBatch) -> Tensor:
        """This call's loss over its rows of a pass (``micro`` in its own frame's rows); adds up its outputs."""
        context = part["context"]
        entropy_grad = float(self.config.get("entropy_coeff") or 0.0) != 0.0
        logprobs_bW, entropy_bW = shifted_token_logprobs(
            logits_bWV, part["kwargs"]["input_ids"], _temperature(self.config), entropy_requires_grad=entropy_grad,
            targets_BS=context.get("target_tokens"),
        )  # fmt: skip
        loss, metrics = self.loss_fn(logprobs_bW, context=context, config=self.config, entropy_BS=entropy_bW)
        if self.logprobs_BS is not None:
            assert self.spans is not None
            shifted = "target_tokens" not in self.frame["context"]
            place_rows(self.logprobs_BS, logprobs_bW.detach().cpu(), micro, self.spans, shifted=shifted)
        self.total_loss = loss.detach() if self.total_loss is None else self.total_loss + loss.detach()
        part_tokens = float(context["loss_mask"].sum().item())
        for name, value in metrics.items():
            if name != "loss":
                self.weighted[name] = self.weighted.get(name, 0.0) + _detached(value) * part_tokens
        self.positions += micro.num_positions
        return loss

    def result(self) -> dict[str, Any]:
        assert self.total_loss is not None  # validate_batch guarantees at least one row
        # One device sync for everything reported.
        names = sorted(self.weighted)
        stacked = [self.total_loss.float(), *(_as_tensor(self.weighted[n], self.total_loss) for n in names)]
        values = torch.stack(stacked).tolist()
        loss_value = values[0]
        metrics = {name: value / max(self.num_tokens, 1) for name, value in zip(names, values[1:], strict=True)}
        metrics["loss"] = loss_value
        real_tokens = row_spans(self.frame).num_tokens  # the spans, also when one pass computes the padding too
        metrics["padding_ratio"] = self.positions / real_tokens
        self.engine._last_loss = loss_value
        result = {"loss": loss_value, "avg_loss": loss_value, "metrics": metrics, "num_tokens": self.num_tokens}
        if self.logprobs_BS is not None:
            result["logprobs"] = self.logprobs_BS
        return result


def fwd_bwd_together(calls: Sequence[tuple[TrainingEngine, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Run fwd_bwd calls as one set of passes: those of one engine, or of several runs on one shared
    base, whose rows then go through their own run's adapter in the same forward.

    Each call's loss is taken over its own rows with its own loss and normalisers, and one backward
    per pass carries each into its own run's adapter only, so every call gets exactly what it gets
    alone (gradients too; ``tests/engines/test_shared_base.py``). Returns one result per call, as
    :meth:`TrainingEngine.fwd_bwd` returns it.

    Raises:
        InvalidRequestError: a call's batch is invalid (nothing has run then), or a loss refused a
            pass; then every run has the gradients it had before, as after any error it raises.
        ValueError: the calls' engines share no base, or their batches cannot share passes
            (different context keys, or forward-only mixed with training); run them one by one.
    """
    prepared = [_Call.of(engine, batch) for engine, batch in calls]
    if len({_share_key(call) for call in prepared}) > 1:
        raise ValueError(
            "fwd_bwd_together needs calls of one engine, or of runs that share one base, with the same context "
            "keys, all forward-only or none"
        )
    results: dict[int, dict[str, Any]] = {}
    # All or nothing: what it raises leaves no gradient.
    for done in _steps_together(prepared, None, answer_early=False):
        results.update(done)
    return [results[index] for index in range(len(calls))]


def fwd_bwd_steps(
    calls: Sequence[tuple[TrainingEngine, Mapping[str, Any]]],
    pass_s: float | None = None,
    *,
    answer_early: bool = True,
) -> Iterator[dict[int, dict[str, Any]]]:
    """:func:`fwd_bwd_together` one pass at a time: yields after each pass the results of the runs
    whose calls' rows have all been through, by call index (each call once; a run's calls together, as
    they add to one gradient). Calls that can share passes (:func:`_share_key`) run together, a group
    after another. Passes of the runs with the fewest positions run first, so a small call that shares
    passes with large ones is answered early; ``pass_s``: passes are cut to about that many seconds (see
    :meth:`TrainingEngine._plan`); ``answer_early=False``: a group's results after its last pass. Every
    call is checked before the first pass.

    All or nothing per run: when a pass raises, or the generator is closed part-way (a deadline, a
    cancel), each run not yet answered gets back the gradients it had before (:class:`_GradsBefore`),
    so a call that failed leaves no gradient behind and one that was answered keeps its own."""
    prepared = [_Call.of(engine, batch) for engine, batch in calls]
    groups: dict[tuple[int, bool, frozenset[str]], list[int]] = {}
    for index, call in enumerate(prepared):
        groups.setdefault(_share_key(call), []).append(index)
    for indices in groups.values():
        # Closed with this generator when it is dropped: the runs not yet answered get their gradients back.
        with contextlib.closing(_steps_together([prepared[i] for i in indices], pass_s, answer_early)) as steps:
            for done in steps:
                yield {indices[i]: result for i, result in done.items()}


def _share_key(call: _Call) -> tuple[int, bool, frozenset[str]]:
    """Calls with one key can share passes: of one engine, or of runs on one shared base, with the same
    context keys, all forward-only or none."""
    engine = call.engine
    return id(engine.shared or engine), call.forward_only, frozenset(call.frame["context"])


def _steps_together(
    prepared: list[_Call], pass_s: float | None, answer_early: bool
) -> Iterator[dict[int, dict[str, Any]]]:
    """The passes of calls of one :func:`_share_key`, as :func:`fwd_bwd_steps` yields them."""
    first = prepared[0].engine
    frame, owner_B, offset = _stacked([c.frame for c in prepared])
    group_of = [id(call.engine) if answer_early else 0 for call in prepared]  # calls answered together
    positions: dict[int, int] = {}
    for call, group in zip(prepared, group_of, strict=True):
        call.spans = row_spans(call.frame)
        positions[group] = positions.get(group, 0) + int(call.spans.length_B.sum())
    spans, passes = first._plan(frame, pass_s)
    passes.sort(key=lambda micro: min((positions[group_of[owner_B[row]]] for row in micro.rows), default=0))
    passes_left = dict.fromkeys(positions, 0)  # passes still to run that hold a row of the group
    for micro in passes:
        for group in {group_of[owner_B[row]] for row in micro.rows}:
            passes_left[group] += 1
    forward_only = prepared[0].forward_only
    before: dict[int, _GradsBefore] = {}  # by run
    if not forward_only:
        for call in prepared:
            if id(call.engine) not in before:
                before[id(call.engine)] = _GradsBefore(call.engine)
    pending = set(range(len(prepared)))
    try:
        for micro in passes:
            first._set_train_mode(not forward_only)  # another op may have run on the base since the last pass
            if not micro.rows:
                first._idle_pass(backward=not forward_only)
                continue
            started = time.perf_counter()
            owners, loss = _run_pass(first, prepared, frame, spans, micro, owner_B, offset, forward_only)
            if not forward_only and loss is not None:
                for owner in owners:
                    before[id(prepared[owner].engine)].added = True  # from here on, even if backward fails
                loss.backward()
            first._timed_pass(micro.num_positions, time.perf_counter() - started)
            for group in {group_of[owner] for owner in owners}:
                passes_left[group] -= 1
            answered = {owner: prepared[owner].result() for owner in pending if passes_left[group_of[owner]] == 0}
            pending.difference_update(answered)
            for owner in answered:
                before.pop(id(prepared[owner].engine), None)
            yield answered
        if pending:  # calls whose rows ran in no pass of their own (idle passes only)
            answered = {owner: prepared[owner].result() for owner in sorted(pending)}
            pending.clear()
            before.clear()
            yield answered
    except BaseException as exc:  # a pass raised, or the op was dropped part-way (GeneratorExit)
        for grads in before.values():
            grads.restore(exc)
        raise


class _GradsBefore:
    """A run's accumulated gradients as a fwd_bwd op found them, put back if the op fails or is dropped
    before the run's calls are answered.

    A LoRA run's are copied (an adapter's gradients are small). A full-weight run's are not: the copy
    would double its gradient memory. Its first fwd_bwd after a step finds none, and one that fails
    before any backward of its rows (a loss refusing its first pass) added nothing, so nothing is lost;
    a later one that fails after a backward takes the gradient of the run's earlier calls since that
    step with it, and its error says so (a note, which the service's failure message carries).
    """

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine = engine
        self.added = False  # a backward of the op reached the run's gradients
        grads = [param.grad for param in engine._params]
        self.kept = engine.lora is not None or all(grad is None for grad in grads)
        self.grads = [None if grad is None else grad.clone() for grad in grads] if self.kept else []

    def restore(self, exc: BaseException) -> None:
        engine = self.engine
        if not self.added:
            return
        if self.kept:
            for param, grad in zip(engine._params, self.grads, strict=True):
                param.grad = grad
            return
        for param in engine._params:
            param.grad = None
        lost = (
            f"the gradient accumulated since step {engine.global_step} is discarded with this part-way fwd_bwd (a "
            "full-weight run keeps no copy of it): run this step's earlier fwd_bwd calls again before step()"
        )
        log.warning("fwd_bwd stopped part-way: %s", lost, extra={"owner": engine.owner})
        if isinstance(exc, Exception):
            exc.add_note(lost)


def _run_pass(
    first: TrainingEngine,
    prepared: list[_Call],
    frame: dict[str, Any],
    spans: Spans,
    micro: MicroBatch,
    owner_B: list[int],
    offset: list[int],
    forward_only: bool,
) -> tuple[set[int], Tensor | None]:
    """The forward of one pass of :func:`fwd_bwd_steps`, each row scored by its call: the calls that
    had rows in it and their losses' sum, whose backward is the caller's."""
    # each call's rows of the pass in one run, so that an adapter updates a slice of rows
    micro = MicroBatch(tuple(sorted(micro.rows, key=owner_B.__getitem__)), micro.width)
    part = cut_micro_batch(frame, micro, spans)
    kwargs, context = first._to_device(part["kwargs"]), first._to_device(part["context"])
    owners = [owner_B[row] for row in micro.rows]
    with torch.set_grad_enabled(not forward_only):
        adapters = [prepared[owner].engine.adapter for owner in owners]
        logits_bWV = first._logits(kwargs, micro.rows, adapters=adapters)
        total: Tensor | None = None
        start = 0
        for owner, rows in itertools.groupby(owners):  # each call's rows: one run of the pass (sorted above)
            stop = start + len(list(rows))
            own_micro = MicroBatch(tuple(row - offset[owner] for row in micro.rows[start:stop]), micro.width)
            own = {section: {k: v[start:stop] for k, v in values.items()}
                   for section, values in (("kwargs", kwargs), ("context", context))}  # fmt: skip
            own_logits, start = logits_bWV[start:stop], stop
            loss = prepared[owner].score(own_logits, own, own_micro)
            total = loss if total is None else total + loss
        del logits_bWV
    return set(owners), total


def _stacked(frames: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int], list[int]]:
    """The frames' rows in one frame (right-padded to the widest: padding changes no span), each
    row's frame, and each frame's first row."""
    if len(frames) == 1:
        return frames[0], [0] * frames[0]["kwargs"]["input_ids"].shape[0], [0]
    width = max(f["kwargs"]["input_ids"].shape[1] for f in frames)

    def padded(tensor: Tensor, own_width: int) -> Tensor:
        if tensor.dim() < 2 or tensor.shape[1] != own_width:  # a per-row extra
            return tensor
        return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, width - own_width))

    def joined(section: str) -> dict[str, Tensor]:
        return {
            name: torch.cat([padded(f[section][name], f["kwargs"]["input_ids"].shape[1]) for f in frames])
            for name in frames[0][section]
        }

    sizes = [f["kwargs"]["input_ids"].shape[0] for f in frames]
    owner_B = [owner for owner, size in enumerate(sizes) for _ in range(size)]
    offset = [sum(sizes[:owner]) for owner in range(len(frames))]
    return {"kwargs": joined("kwargs"), "context": joined("context")}, owner_B, offset


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5 renamed the method
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _temperature(config: Mapping[str, Any]) -> float:
    temperature = config.get("temperature")
    if temperature is None:
        return 1.0
    if not float(temperature) > 0:
        raise InvalidRequestError(f"processing.config.temperature must be > 0; got {temperature}")
    return float(temperature)


def _adam_overrides(adam: Mapping[str, Any]) -> dict[str, float]:
    """The Tinker API's per-step Adam parameters as floats, checked by the config's own rules for
    ``training.optimizer`` and ``training.grad_clip`` before anything is applied."""
    unknown = sorted(set(adam) - {"beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"})
    if unknown:
        raise InvalidRequestError(
            f"adam has unknown keys {unknown}; use beta1, beta2, eps, weight_decay, grad_clip_norm"
        )
    values: dict[str, float] = {}
    for key, given in adam.items():
        try:
            value = values[key] = float(given)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"adam.{key} must be a number; got {given!r}") from None
        if not math.isfinite(value):  # the config's fields accept inf
            raise InvalidRequestError(f"adam.{key} must be finite; got {value}")
        model: type[OptimizerConfig | TrainingConfig] = TrainingConfig if key == "grad_clip_norm" else OptimizerConfig
        field = {"beta1": "betas", "beta2": "betas", "grad_clip_norm": "grad_clip"}.get(key, key)
        probe = (value, 0.0) if key == "beta1" else (0.0, value) if key == "beta2" else value
        try:
            model.model_validate({field: probe})
        except ValidationError as exc:
            rule = exc.errors()[0]["msg"].removeprefix("Value error, ").split("; got")[0]
            raise InvalidRequestError(f"adam.{key} is {value}: {rule}; send a value in range or leave it out") from None
    return values


def _detached(value: Tensor | float) -> Tensor | float:
    return value.detach().float() if isinstance(value, Tensor) else float(value)


def _as_tensor(value: Tensor | float, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.float().reshape(())
    return torch.tensor(float(value), device=like.device)


def _peak_rss_bytes() -> int:
    """This process's peak resident set size (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB
