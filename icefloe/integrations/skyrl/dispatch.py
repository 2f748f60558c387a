"""``IcefloeDispatch``: SkyRL's ``WorkerDispatch`` interface over one icefloe ``Client``.

Legend: ``B`` rows, ``S`` positions of SkyRL's ``sequences`` (left-padded ``[PAD | prompt | response]``),
``A`` response positions (SkyRL's response tensors are right-aligned in ``[B, A]``), ``C`` positions of
the canonical frame.

SkyRL's layout already is what :func:`icefloe.client.batch.to_canonical` accepts: contiguous real
tokens with left padding, response tensors under the last ``A`` columns. So ``sequences`` travel as
``input_ids`` unchanged and the one lowering in ``icefloe.client.batch`` does the rest.

The trainer calls these methods synchronously from inside its event loop (as it does SkyRL's own
dispatch); the async ones hand the blocking client call to a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from icefloe.client import Client
from icefloe.client.batch import responses_from_canonical
from icefloe.integrations.skyrl.config import loss_config_from_skyrl, section_of
from icefloe.protocol import OP_FORWARD, InvalidRequestError

__all__ = ["CHECKPOINT_POINTER", "IcefloeDispatch"]

logger = logging.getLogger(__name__)

# Written into SkyRL's checkpoint folder: which icefloe checkpoint that SkyRL step corresponds to.
CHECKPOINT_POINTER = "icefloe_checkpoint.json"
_RESPONSE_KEYS = ("loss_mask", "advantages", "action_log_probs", "base_action_log_probs")


class IcefloeDispatch:
    """Routes SkyRL's policy calls to icefloe; SkyRL's ref and critic roles do not exist here."""

    def __init__(self, cfg: Any, client: Client, *, pad_token_id: int) -> None:
        section = section_of(cfg)
        self.cfg = cfg
        self.client = client
        self.pad_token_id = int(pad_token_id)
        self.has_forward = OP_FORWARD in client.capabilities
        self.colocate = bool(section.colocate)
        self.cuda_ipc = bool(section.cuda_ipc_weight_sync)
        self.low_memory = bool(section.low_memory_weight_sync)
        self.loss_config = loss_config_from_skyrl(cfg)
        self.temperature = _training_temperature(cfg)
        self.last_lr: float | None = None
        self.last_sync: dict[str, Any] | None = None
        self._lr_override: float | None = None

    # --- batches --------------------------------------------------------------------------------
    def _payload(self, data: Mapping[str, Any], rows: slice, *, training: bool) -> dict[str, Any]:
        """SkyRL rows ``rows`` as a ``{batch, meta, processing}`` payload (no copy of the layout)."""
        batch: dict[str, Any] = {
            "input_ids": data["sequences"][rows],
            "attention_mask": data["attention_mask"][rows],
        }
        meta = {"pad_token_id": self.pad_token_id, "temperature": self.temperature}
        if not training:
            return {"batch": batch, "meta": meta, "processing": {"loss_fn": "grpo", "config": {}}}
        missing = [key for key in ("loss_mask", "advantages") if data.get(key) is None]
        if missing:
            raise InvalidRequestError(
                f"SkyRL training batch lacks {missing}; compute_advantages_and_returns must run before forward_backward"
            )
        loss_mask_BA = data["loss_mask"][rows].to(torch.float32) * data["response_mask"][rows].to(torch.float32)
        batch["loss_mask"] = loss_mask_BA
        batch["advantages"] = data["advantages"][rows]
        if data.get("action_log_probs") is not None:
            batch["old_log_probs"] = data["action_log_probs"][rows]
        if self.loss_config.get("use_kl_loss"):
            if data.get("base_action_log_probs") is None:
                raise InvalidRequestError(
                    "trainer.algorithm.use_kl_loss is true but the batch has no reference log-probs "
                    "(base_action_log_probs); set trainer.icefloe.num_log_prob_workers=1"
                )
            batch["ref_log_prob"] = data["base_action_log_probs"][rows]
        # SkyRL's seq-mean reductions divide by every row of the mini-batch, masked-out rows included.
        config = {
            **self.loss_config,
            "batch_num_tokens": int(loss_mask_BA.sum().item()),
            "global_batch_size": loss_mask_BA.shape[0],
        }
        return {"batch": batch, "meta": meta, "processing": {"loss_fn": "grpo", "config": config}}

    # --- training role --------------------------------------------------------------------------
    def forward(self, model: str, data: Mapping[str, Any]) -> Any:
        """Log-probs ``[B, A]`` (right-aligned like SkyRL's) of the policy (``"policy"``) or reference (``"ref"``)."""
        from skyrl.backends.skyrl_train.training_batch import TrainingOutputBatch

        if model not in ("policy", "ref"):
            raise InvalidRequestError(f"icefloe has no {model!r} model; only 'policy' and 'ref' run forward")
        num_rows = data["sequences"].shape[0]
        response_width = int(data.metadata["response_length"])
        payload = self._payload(data, slice(0, num_rows), training=False)
        result = self.client.forward(payload, reference=model == "ref")
        logprobs_BA = responses_from_canonical(torch.as_tensor(result["logprobs"]), payload["batch"], response_width)
        return TrainingOutputBatch({"output": logprobs_BA})

    def forward_backward(
        self,
        model: str,
        data: Mapping[str, Any],
        loss_fn: str | None = None,
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        rows: tuple[int, int] | None = None,
    ) -> dict[str, float]:
        """One ``fwd_bwd`` on the policy over ``rows`` (default: all); gradients wait for ``optim_step``.

        ``loss_fn`` / ``loss_fn_config`` name SkyRL's loss; icefloe's ``grpo`` computes the same
        clipped surrogate, configured from ``trainer.algorithm`` (see ``loss_config_from_skyrl``).
        """
        _policy_only(model, "forward_backward")
        start, end = rows if rows is not None else (0, data["sequences"].shape[0])
        payload = self._payload(data, slice(start, end), training=True)
        if loss_fn_config:
            payload["processing"]["config"].update({k: v for k, v in loss_fn_config.items() if k != "n_samples"})
        result = self.client.fwd_bwd(payload)
        metrics = {"policy_loss": float(result["loss"])}
        for name, value in (result.get("metrics") or {}).items():
            if isinstance(value, int | float) and name != "loss":
                metrics[name] = float(value)
        return metrics

    def optim_step(self, model: str) -> float | None:
        """Apply the accumulated gradients; returns the gradient norm."""
        _policy_only(model, "optim_step")
        result = self.client.step(learning_rate=self._lr_override)
        self.last_lr = result.get("lr")
        grad_norm = result.get("grad_norm")
        while isinstance(grad_norm, list | tuple):  # per-rank lists from multi-worker backends: ranks agree
            grad_norm = grad_norm[0] if grad_norm else None
        return None if grad_norm is None else float(grad_norm)

    def set_lr(self, model: str, learning_rate: float) -> None:
        """Use ``learning_rate`` for every later optimizer step instead of the configured schedule."""
        _policy_only(model, "set_lr")
        self._lr_override = float(learning_rate)

    def get_lcm_dp_size(self) -> int:
        # The backend splits batches itself, so SkyRL need not pad rows to a data-parallel multiple.
        return 1

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, model: str, ckpt_dir: str, tokenizer: Any = None) -> dict[str, Any]:
        """Save a resumable icefloe checkpoint and record its id in SkyRL's ``ckpt_dir``."""
        _policy_only(model, "save_checkpoint")
        saved = self.client.save_checkpoint("resumable")
        _write_pointer(ckpt_dir, saved)
        return saved

    def load_checkpoint(self, model: str, ckpt_dir: str, **kwargs: Any) -> dict[str, Any]:
        """Load the icefloe checkpoint that ``save_checkpoint`` recorded in ``ckpt_dir``."""
        _policy_only(model, "load_checkpoint")
        pointer = Path(ckpt_dir) / CHECKPOINT_POINTER
        if not pointer.is_file():
            raise InvalidRequestError(
                f"{ckpt_dir} holds no {CHECKPOINT_POINTER}; it was not written by icefloe's SkyRL integration "
                "(set trainer.resume_mode=none to start fresh)"
            )
        return self.client.load_checkpoint(json.loads(pointer.read_text())["checkpoint_id"])

    def save_hf_model(self, model: str, export_dir: str, tokenizer: Any = None) -> dict[str, Any]:
        """Save the policy's weights (safetensors, on the backend) and record where in ``export_dir``."""
        _policy_only(model, "save_hf_model")
        saved = self.client.save_checkpoint("weights-only")
        _write_pointer(export_dir, saved)
        return saved

    def finalize_pending_saves(self, model: str) -> None:
        # Every save above returns only when the backend has written it.
        return None

    # --- weight sync and memory -----------------------------------------------------------------
    async def save_weights_for_sampler(self) -> dict[str, Any]:
        """Trainer → sampler weight sync, at the start of training and the end of every step."""
        if self.colocate:
            await asyncio.to_thread(self.client.wake_training)
            await asyncio.to_thread(self.client.wake_inference)
            self.last_sync = await asyncio.to_thread(
                self.client.sync_weights, cuda_ipc=self.cuda_ipc, low_memory=self.low_memory
            )
        else:
            self.last_sync = await asyncio.to_thread(
                self.client.sync_weights, cuda_ipc=False, low_memory=self.low_memory
            )
        return self.last_sync

    def init_weight_sync_state(self, inference_engine_client: Any) -> None:
        # The backend wires trainer and sampler together when the client opens.
        return None

    def mark_all_offloaded(self) -> None:
        return None

    def empty_cache(self, model: str | None = None) -> None:
        return None

    def get_node_ids(self) -> list[str]:
        # SkyRL uses node ids to delete old checkpoints on each node; icefloe's live on the backend.
        return []

    def start_profile(self, model: str) -> None:
        return None

    def profile_step(self, model: str) -> None:
        return None

    def stop_profile(self, model: str) -> None:
        return None


def _policy_only(model: str, method: str) -> None:
    if model != "policy":
        raise InvalidRequestError(
            f"{method}({model!r}): icefloe trains only the policy; SkyRL's critic is not supported"
        )


def _training_temperature(cfg: Any) -> float:
    """The temperature that divides logits in training, matching the one rollouts were sampled at."""
    temperature = getattr(cfg.trainer.algorithm, "temperature", None)
    if temperature is None:
        temperature = cfg.generator.sampling_params.temperature
    return float(temperature) if temperature and temperature > 0 else 1.0


def _write_pointer(folder: str, saved: Mapping[str, Any]) -> None:
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    record = {key: saved.get(key) for key in ("checkpoint_id", "global_step", "path", "kind")}
    (target / CHECKPOINT_POINTER).write_text(json.dumps(record, indent=1))
