"""``IcefloeBackend``: verl's ``RemoteBackend`` contract over icefloe's ``AsyncClient``.

The trainer builds one on the driver with ``from_config(main_config)``; the forwarder worker and
the rollout server re-attach with ``from_config(main_config, handle=reconnect_handle())``. Compute
methods take verl's dense layout (see :mod:`icefloe.integrations.verl.payload`) and speak only
the public client API, so every icefloe backend (local, ray, remote) behaves the same.
torch is imported inside the compute methods: importing this module stays light.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from icefloe.client.client import AsyncClient
from icefloe.client.transports import probe_capabilities
from icefloe.config import ClientConfig
from icefloe.integrations._guards import refuse_zero_logprobs, zero_logprob_offenders
from icefloe.integrations.verl.settings import VerlSettings, client_config, policy_regime
from icefloe.protocol import OP_FORWARD, ClientClosedError, ConfigError, InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["IcefloeBackend", "check_opened", "preflight"]

logger = logging.getLogger(__name__)

# icefloe loss metric → the name verl's dashboards use for the same quantity (added, never replacing).
_VERL_METRIC_NAMES = {
    "approx_kl": "ppo_kl",
    "clip_ratio": "pg_clipfrac",
    "clip_ratio_lower": "pg_clipfrac_lower",
    "kl": "kl_loss",
}


def preflight(main_config: Any, config: ClientConfig) -> ClientConfig:
    """Refuse settings that need log-probs the chosen backend cannot compute; return the config to use.

    Runs before any client exists. When no knob reads log-probs, ``allow_zero_logprobs`` is switched
    on (it only matters on a service without ``forward``). Otherwise the backend must have
    ``forward`` (a remote service is asked, without creating a job), else every offending knob is
    listed in one error. :func:`check_opened` repeats the check once connected.
    """
    regime = policy_regime(main_config)
    if not zero_logprob_offenders(regime):
        if "allow_zero_logprobs" in type(config.backend).model_fields:
            backend = config.backend.model_copy(update={"allow_zero_logprobs": True})
            config = config.model_copy(update={"backend": backend})
        return config
    if OP_FORWARD not in probe_capabilities(config):
        refuse_zero_logprobs(regime, backend=config.backend.type)
    return config


def check_opened(main_config: Any, client: AsyncClient) -> None:
    """After connecting: the same refusal, for a service whose ops were unknown until now."""
    if OP_FORWARD not in client.capabilities:
        refuse_zero_logprobs(policy_regime(main_config), backend=client.config.backend.type)


class IcefloeBackend:
    """One icefloe client shared by verl's driver, forwarder worker and rollout servers."""

    def __init__(self, client: AsyncClient, settings: VerlSettings, *, owner: bool) -> None:
        self._client: AsyncClient | None = client
        self.settings = settings
        self._owner = owner  # only the driver's instance shuts the engines / job down

    # --- the RemoteBackend contract ----------------------------------------------------------
    @classmethod
    def from_config(cls, main_config: Any, *, handle: Mapping[str, Any] | None = None) -> IcefloeBackend:
        """Create the backend on the driver, or re-attach to it when ``handle`` is given.

        Raises:
            ConfigError: a verl or ``remote_backend`` setting is invalid, or needs log-probs the
                selected backend cannot compute (every offending knob is listed).
        """
        if handle is not None:
            client = AsyncClient.from_handle(handle["client"])
            return cls(client, VerlSettings.model_validate(handle["settings"]), owner=False)
        settings = VerlSettings.from_verl(main_config)
        config = preflight(main_config, client_config(main_config))
        client = AsyncClient(config)
        client.handle()  # connects now (loads engines / attaches the job), so the backend's ops are known
        try:
            check_opened(main_config, client)
        except ConfigError:
            asyncio.run(client.shutdown())  # nothing may keep running for a refused config
            raise
        tokenizer = client.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(client, settings.model_copy(update={"pad_token_id": int(pad or 0)}), owner=True)

    def reconnect_handle(self) -> dict[str, Any]:
        """JSON-safe (hence Ray-picklable) description another process re-attaches with."""
        return {"client": self.client.handle(), "settings": self.settings.model_dump(mode="json")}

    async def destroy(self) -> None:
        """Release the client; the driver's instance also shuts the backend down. Idempotent."""
        client, self._client = self._client, None
        if client is not None and self._owner:
            await client.shutdown()

    async def update_weights(self) -> dict[str, Any]:
        """Trainer → sampler weight sync, then wake the sampler verl put to sleep after the rollout.

        Bumps the policy version every later sample is tagged with. With LoRA only the adapters move.
        """
        synced = await self.client.sync_weights(
            cuda_ipc=self.settings.cuda_ipc,
            low_memory=self.settings.low_memory,
            weight_format="lora" if self.client.config.lora is not None else None,
        )
        await self.client.wake_inference()
        await self.client.reset_prefix_cache()  # no sample may reuse prefixes computed with the old weights
        return synced

    async def save_checkpoint(self) -> dict[str, Any]:
        """A resumable checkpoint in the backend's own storage."""
        return await self.client.save_checkpoint("resumable")

    def requires_single_forwarder(self) -> bool:
        """One forwarder: several would each send the whole batch to the same backend."""
        return True

    # --- compute used by this package's worker and server ------------------------------------
    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            raise ClientClosedError("the icefloe verl backend was destroyed; the trainer must build a new one")
        return self._client

    async def compute_log_prob(
        self, dense: Mapping[str, Tensor], *, ref: bool, calculate_entropy: bool, temperature: float
    ) -> dict[str, Tensor]:
        """Nested predict-next ``log_probs`` (and ``entropy``) for every row of a dense verl batch."""
        from icefloe.integrations.verl.payload import log_prob_payload, nested_rows, row_lengths

        payload = log_prob_payload(dense, pad_token_id=self._pad_id, temperature=temperature)
        result = await self.client.forward(payload, reference=ref)
        lengths_B = row_lengths(dense)
        out = {"log_probs": nested_rows(result["logprobs"], lengths_B)}
        if calculate_entropy and result.get("entropy") is not None:
            out["entropy"] = nested_rows(result["entropy"], lengths_B)
        return out

    async def update_actor(
        self,
        dense: Mapping[str, Tensor],
        *,
        mini_batch_size: int,
        epochs: int,
        temperature: float,
        shuffle: bool = False,
        seed: int = 0,
    ) -> dict[str, Any]:
        """``epochs`` passes over the batch in mini-batches, one ``fwd_bwd`` + ``step`` each.

        Returns ``{metrics, global_token_num}``: metrics averaged over every optimizer step
        (``lr`` is the last one), and each row's token count for the MFU estimate.
        """
        import torch

        from icefloe.integrations.verl.payload import row_lengths, update_payload

        num_rows = int(dense["input_ids"].shape[0])
        if mini_batch_size <= 0 or num_rows % mini_batch_size:
            raise InvalidRequestError(
                f"the batch has {num_rows} rows, not a multiple of the mini-batch size {mini_batch_size} "
                "(actor_rollout_ref.actor.ppo_mini_batch_size × rollout.n); make data.train_batch_size "
                "a multiple of ppo_mini_batch_size"
            )
        generator = torch.Generator().manual_seed(int(seed))
        per_step: list[dict[str, float]] = []
        for _ in range(epochs):
            order = torch.randperm(num_rows, generator=generator) if shuffle else torch.arange(num_rows)
            for start in range(0, num_rows, mini_batch_size):
                payload = update_payload(
                    dense,
                    order[start : start + mini_batch_size],
                    pad_token_id=self._pad_id,
                    temperature=temperature,
                    actor_config=self.settings.actor_loss_config,
                    loss_fn=self.settings.policy_loss,
                    use_kl_loss=self.settings.use_kl_loss,
                )
                trained = await self.client.fwd_bwd(payload)
                stepped = await self.client.step()
                per_step.append(_step_metrics(trained, stepped))
        return {"metrics": _reduce(per_step), "global_token_num": row_lengths(dense).tolist()}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        """One sample for one prompt given as token ids (no re-tokenising)."""
        results = await self.client.generate([list(prompt_ids)], params)
        return results[0]

    async def sleep_inference(self) -> None:
        await self.client.sleep_inference(level=1)

    async def wake_inference(self) -> None:
        await self.client.wake_inference()

    async def reset_prefix_cache(self) -> None:
        await self.client.reset_prefix_cache()

    @property
    def _pad_id(self) -> int:
        return int(self.settings.pad_token_id or 0)


def _step_metrics(trained: Mapping[str, Any], stepped: Mapping[str, Any]) -> dict[str, float]:
    metrics = {k: float(v) for k, v in (trained.get("metrics") or {}).items() if _is_number(v)}
    metrics["loss"] = float(trained["loss"])
    for ours, theirs in _VERL_METRIC_NAMES.items():
        if ours in metrics:
            metrics.setdefault(theirs, metrics[ours])
    for name in ("grad_norm", "lr"):
        if _is_number(stepped.get(name)):
            metrics[name] = float(stepped[name])
    return metrics


def _reduce(per_step: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({key for step in per_step for key in step})
    reduced = {}
    for key in keys:
        values = [step[key] for step in per_step if key in step]
        reduced[key] = values[-1] if key == "lr" else sum(values) / len(values)
    return reduced


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
