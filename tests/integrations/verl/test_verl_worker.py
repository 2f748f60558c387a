"""The V0 and V1 forwarder workers driving a real local backend on the tiny model.

Each test is one verl step: compute_log_prob → compute_ref_log_prob → update_actor (KL loss,
ppo_epochs = 2) → update_weights → generate, then checks the reward-weighted loss went down.
"""

from __future__ import annotations

import asyncio

import torch

PROMPTS = [[3, 4, 5], [3, 4, 5], [6, 7, 8, 9], [6, 7, 8, 9]]
RESPONSES = [[10, 11], [12, 13, 14], [10, 12], [11, 13, 14, 15]]
ADVANTAGES = [1.0, -1.0, 1.0, -1.0]


def _nested(rows: list[list[float]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _v1_batch() -> dict:
    return {
        "prompts": _nested(PROMPTS),
        "responses": _nested(RESPONSES),
        "input_ids": _nested([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]),
        "response_mask": _nested([[1.0] * len(r) for r in RESPONSES], torch.float32),
        "temperature": 1.0,
    }


def _v0_batch() -> dict:
    width_p, width_r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompts = torch.tensor([[0] * (width_p - len(p)) + p for p in PROMPTS])
    responses = torch.tensor([r + [0] * (width_r - len(r)) for r in RESPONSES])
    mask = torch.tensor([[0] * (width_p - len(p)) + [1] * (len(p) + len(r)) + [0] * (width_r - len(r))
                         for p, r in zip(PROMPTS, RESPONSES, strict=True)])  # fmt: skip
    return {
        "input_ids": _nested([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]),
        "prompts": prompts,
        "responses": responses,
        "attention_mask": mask,
        "response_mask": mask[:, width_p:].to(torch.float32),
        "temperature": 1.0,
    }


def _response_values(nested: torch.Tensor, as_nested: bool) -> list[list[float]] | torch.Tensor:
    """verl's no_padding_2_padding: values[end - R_b - 1 : end - 1] of each predict-next row."""
    rows = []
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        end = len(p) + len(r)
        rows.append(nested[b][end - len(r) - 1 : end - 1].tolist())
    if as_nested:
        return _nested(rows, torch.float32)
    width = max(map(len, rows))
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])


def _reward_weighted_loss(log_probs: torch.Tensor) -> float:
    total, count = 0.0, 0
    for row, values in enumerate(_response_values(log_probs, as_nested=False).tolist()):
        n = len(RESPONSES[row])
        total += -ADVANTAGES[row] * sum(values[:n])
        count += n
    return total / count


def _run_step(plugin_loader, make_config, *, v1: bool, **overrides) -> dict:
    load_plugin = plugin_loader
    load_plugin(v1=v1)
    from verl.remote_backend.base import RemoteBackendRegistry

    from icefloe.integrations.verl.rollout import IcefloeLLMServer

    config = make_config(**{
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "data.train_batch_size": 2,
        **overrides,
    })  # fmt: skip
    driver = RemoteBackendRegistry.create("icefloe", config)
    handle = driver.reconnect_handle()
    worker_cls = RemoteBackendRegistry.get_worker("icefloe")
    worker = worker_cls(config["actor_rollout_ref"], "actor_rollout_ref", main_config=config, backend_handle=handle)
    call = (lambda result: result) if v1 else asyncio.run
    loop_run = worker._loop.run if v1 else asyncio.run
    try:
        worker.init_model()
        assert worker.dispatch_info == {"actor": (0, True), "ref": (0, True), "rollout": (0, True)}
        batch = _v1_batch() if v1 else _v0_batch()
        out = call(worker.compute_log_prob(batch))
        assert out["log_probs"].is_nested and [len(r) for r in out["log_probs"]] == [5, 6, 6, 8]
        assert out["entropy"].is_nested and "mfu" in out["metrics"]
        ref = call(worker.compute_ref_log_prob(batch))
        before = _reward_weighted_loss(out["log_probs"])
        batch["old_log_probs"] = _response_values(out["log_probs"], as_nested=v1)
        batch["ref_log_prob"] = _response_values(ref["log_probs"], as_nested=v1)
        batch["advantages"] = (
            _nested([[a] * len(r) for a, r in zip(ADVANTAGES, RESPONSES, strict=True)], torch.float32)
            if v1
            else torch.tensor(ADVANTAGES)[:, None] * batch["response_mask"]
        )
        batch.update(mini_batch_size=2, epochs=2)
        metrics = call(worker.update_actor(batch))["metrics"]
        verl_names = {"kl_loss", "ppo_kl", "pg_clipfrac", "pg_clipfrac_lower"}
        assert {"loss", "grad_norm", "lr", "mfu", *verl_names} <= set(metrics)
        after = _reward_weighted_loss(call(worker.compute_log_prob(batch))["log_probs"])
        assert after < before, (before, after)
        synced = call(worker.update_weights(global_steps=1))
        server = IcefloeLLMServer(config, handle)
        sample = loop_run(server.generate([3, 4, 5], {"logprobs": True, "max_tokens": 3}, "req-0"))
        assert len(sample.token_ids) <= 3 and len(sample.log_probs) == len(sample.token_ids)
        assert sample.extra_fields["global_steps"] == synced["policy_version"]
        loop_run(server.destroy())
        return synced
    finally:
        call(worker.destroy())
        asyncio.run(driver.destroy())
        asyncio.run(driver.destroy())  # idempotent


def test_v0_worker_step_lowers_reward_weighted_loss(load_plugin, make_config) -> None:
    _run_step(load_plugin, make_config, v1=False)


def test_v1_worker_densifies_nested_batches_and_trains(load_plugin, make_config) -> None:
    _run_step(load_plugin, make_config, v1=True)


def test_v1_worker_with_lora_trains_and_syncs_only_the_adapters(load_plugin, make_config) -> None:
    from icefloe.engines.models import load_causal_lm, resolve_model

    lora = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 32}
    synced = _run_step(load_plugin, make_config, v1=True, **lora)
    model = load_causal_lm(resolve_model("tiny:arith", seed=0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < synced["bytes"] < full_bytes / 5  # adapters only (weight_format "lora")
