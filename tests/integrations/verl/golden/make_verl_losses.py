"""Write ``verl_losses.json``: verl 0.9.1's own actor loss on fixed random inputs, values and gradients.

Run once, from the repository root, in a throwaway environment that has verl (CI only reads
the JSON); verl's full dependency set is not needed, only what its loss modules import::

    python3 -m venv /tmp/verlvenv
    /tmp/verlvenv/bin/pip install torch==2.13.0 numpy omegaconf
    /tmp/verlvenv/bin/pip install --no-deps verl==0.9.1
    /tmp/verlvenv/bin/pip install "tensordict>=0.8,<=0.10.0" codetiming datasets
    /tmp/verlvenv/bin/python tests/integrations/verl/golden/make_verl_losses.py

The output records the verl and torch versions it was made with.

The loss is ``verl.workers.utils.losses.ppo_loss`` (policy loss ``vanilla`` from ``core_algos``,
the entropy term and the KL term through ``core_algos.kl_penalty`` / ``agg_loss``), called as
verl's engine worker calls it: a dense V0 batch (prompts left-padded to P, responses
right-padded to R), flat predict-next log-probs per row, ``dp_size``/``batch_num_tokens``/
``global_batch_size`` as non-tensor entries. Cases: every ``loss_agg_mode`` (plus
``loss_scale_factor``) × dual clip at verl's default ``clip_ratio_c`` / a ``clip_ratio_c`` that never
binds × every ``kl_loss_type`` (and none) × entropy on/off, with the worker's normalisers; a few
cases with verl's defaults (no normalisers), with ``rollout_is_weights``, and with an empty actor
config; two mini-batches of different prompt lengths under ``seq-mean-token-sum-norm``; and
``compute_grpo_outcome_advantage`` with and without std normalisation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

OUT = Path(__file__).with_name("verl_losses.json")
SEED = 20260901
PROMPT_LENS = [3, 5, 1, 4, 2, 5]  # P = 5
RESPONSE_LENS = [7, 2, 6, 5, 3, 4]  # R = 7
# Row 2 masks two tokens out mid-response (a tool turn); row 4 masks its whole response.
MASK_HOLES = {2: [2, 3], 4: [0, 1, 2]}
ROW_ADVANTAGES = [1.3, -0.8, 0.6, -1.7, 0.9, -0.4]
AGG_VARIANTS: list[dict[str, Any]] = [
    {"loss_agg_mode": "token-mean"},
    {"loss_agg_mode": "token-sum"},
    {"loss_agg_mode": "seq-mean-token-sum"},
    {"loss_agg_mode": "seq-mean-token-sum-norm"},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 16},
    {"loss_agg_mode": "seq-mean-token-mean"},
]
CLIP_VARIANTS: dict[str, dict[str, Any]] = {
    "dual": {},  # clip_ratio_c unset: verl's default 3.0
    "plain": {"clip_ratio_c": 1.0e6},  # a dual-clip bound no ratio reaches
}
KL_NAMES = ["kl", "abs", "mse", "k1", "k2", "k3", "low_var_kl"]
KL_VARIANTS = [None, *KL_NAMES, *(f"{name}+" for name in KL_NAMES)]
CLIP_HIGHER = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def _inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(SEED)
    num_rows, width_p, width_r = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
    prompts = torch.zeros(num_rows, width_p, dtype=torch.int64)
    responses = torch.zeros(num_rows, width_r, dtype=torch.int64)
    attention = torch.zeros(num_rows, width_p + width_r, dtype=torch.int64)
    mask = torch.zeros(num_rows, width_r)
    for row, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        prompts[row, width_p - p :] = torch.randint(1, 50, (p,), generator=gen)
        responses[row, :r] = torch.randint(1, 50, (r,), generator=gen)
        attention[row, width_p - p : width_p + r] = 1
        mask[row, :r] = 1.0
        mask[row, MASK_HOLES.get(row, [])] = 0.0
    real = attention[:, width_p:].float()  # response tokens that exist (masked or not)
    log_prob = -(torch.rand(num_rows, width_r, generator=gen) * 2.5 + 0.05) * real
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention,
        "response_mask": mask,
        "log_prob": log_prob,
        "old_log_probs": (log_prob + 0.9 * torch.randn(num_rows, width_r, generator=gen)) * real,
        "ref_log_prob": (log_prob + 0.6 * torch.randn(num_rows, width_r, generator=gen)) * real,
        "entropy": torch.rand(num_rows, width_r, generator=gen) * 2.0 * real,
        "advantages": torch.tensor(ROW_ADVANTAGES)[:, None] * mask,
        "rollout_is_weights": torch.where(real > 0, 0.5 + torch.rand(num_rows, width_r, generator=gen), 1.0),
    }


def _flat(values_BR: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """verl's predict-next flat layout: row b holds p-1 fillers, its r response values, one filler."""
    parts = []
    for row in rows:
        p, r = PROMPT_LENS[row], RESPONSE_LENS[row]
        filler = torch.full((p - 1,), -7.0)
        parts += [filler, values_BR[row, :r], torch.full((1,), -7.0)]
    return torch.cat(parts)


def _verl_loss(
    inputs: dict[str, Any], actor: dict[str, Any], *, rows: list[int], entropy: bool, weights: bool, normalisers: bool
) -> dict[str, Any]:
    """verl's ppo_loss on ``rows``; returns the loss and its gradients w.r.t. log-probs and entropy."""
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    entropy_BR = inputs["entropy"].clone().requires_grad_(True)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **actor)
    fields = ["prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages"]
    if config.use_kl_loss:
        fields.append("ref_log_prob")
    if weights:
        fields.append("rollout_is_weights")
    index = torch.tensor(rows)
    data = TensorDict({name: inputs[name][index] for name in fields}, batch_size=[len(rows)])
    mask = inputs["response_mask"][index]
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=int(mask.sum().item()) if normalisers else None,
        global_batch_size=len(rows) if normalisers else None,
    )
    model_output = {"log_probs": _flat(log_prob, rows)}
    if entropy:
        model_output["entropy"] = _flat(entropy_BR, rows)
    loss, _ = ppo_loss(config, model_output, data)
    loss.backward()
    grad_entropy = entropy_BR.grad if entropy_BR.grad is not None else torch.zeros_like(entropy_BR)
    return {
        "loss": loss.item(),
        "grad_log_prob": _rounded(log_prob.grad[index]),
        "grad_entropy": _rounded(grad_entropy[index]),
    }


def _case(inputs: dict[str, Any], name: str, actor: dict[str, Any], **how: Any) -> dict[str, Any]:
    rows = how.pop("rows", list(range(len(PROMPT_LENS))))
    return {"name": name, "actor": actor, "rows": rows, **how, **_verl_loss(inputs, actor, rows=rows, **how)}


def _rounded(values: torch.Tensor) -> list[Any]:
    """float32 values, written with the 9 significant digits that round-trip them."""
    return [[float(f"{v:.9g}") for v in row] for row in values.tolist()]


def _advantages() -> list[dict[str, Any]]:
    rewards = [[1.0, 0.0, 0.0, 1.0, 1.0], [0.3, 0.3, 0.3], [0.0, 2.5, -1.0, 0.7], [0.0, 0.0]]
    index = np.array([g for g, group in enumerate(rewards) for _ in group])
    flat = torch.tensor([r for group in rewards for r in group])[:, None]
    out = []
    for norm in (True, False):
        advantages, _ = compute_grpo_outcome_advantage(flat, torch.ones_like(flat), index, norm_adv_by_std_in_grpo=norm)
        out.append({"rewards": rewards, "norm_adv_by_std_in_grpo": norm, "advantages": _rounded(advantages.T)[0]})
    return out


def main() -> None:
    torch.manual_seed(0)
    inputs = _inputs()
    cases = []
    for agg in AGG_VARIANTS:
        for clip_name, clip in CLIP_VARIANTS.items():
            for kl in KL_VARIANTS:
                for entropy in (False, True):
                    actor = {**CLIP_HIGHER, **clip, **agg}
                    if kl is not None:
                        actor.update(use_kl_loss=True, kl_loss_type=kl, kl_loss_coef=0.3)
                    if entropy:
                        actor["entropy_coeff"] = 0.03
                    label = "/".join(
                        [agg["loss_agg_mode"] + ("@16" if "loss_scale_factor" in agg else ""), clip_name, kl or "no-kl"]
                    )
                    name = f"{label}/{'entropy' if entropy else 'no-entropy'}"
                    cases.append(_case(inputs, name, actor, entropy=entropy, weights=False, normalisers=True))
    # verl's own defaults: agg_loss counts rows with at least one token when no global_batch_size comes.
    for agg in AGG_VARIANTS:
        actor = {**CLIP_HIGHER, **agg, "use_kl_loss": True, "kl_loss_type": "k3+", "entropy_coeff": 0.03}
        name = f"{agg['loss_agg_mode']}/defaults"
        cases.append(_case(inputs, name, actor, entropy=True, weights=False, normalisers=False))
    for agg in AGG_VARIANTS:
        actor = {**CLIP_HIGHER, **agg}
        name = f"{agg['loss_agg_mode']}/rollout_is_weights"
        cases.append(_case(inputs, name, actor, entropy=False, weights=True, normalisers=True))
    cases.append(_case(inputs, "empty-actor-config", {}, entropy=False, weights=False, normalisers=True))
    # Two mini-batches of different prompt lengths (rows 0-2: prompts of 3, 5, 1; rows 3-5: 4, 2, 5).
    norm = {**CLIP_HIGHER, "loss_agg_mode": "seq-mean-token-sum-norm"}
    minibatches = [
        _case(inputs, f"seq-mean-token-sum-norm/minibatch-{i}", norm, rows=rows, entropy=False, weights=False,
              normalisers=True)
        for i, rows in enumerate(([0, 1, 2], [3, 4, 5]))
    ]  # fmt: skip
    document = {
        "verl_version": verl.__version__,
        "torch_version": torch.__version__,
        "generated_by": "tests/integrations/verl/golden/make_verl_losses.py",
        "seed": SEED,
        "inputs": {
            "prompt_lens": PROMPT_LENS,
            "response_lens": RESPONSE_LENS,
            **{name: value.tolist() for name, value in inputs.items() if value.dtype == torch.int64},
            **{name: _rounded(value) for name, value in inputs.items() if value.dtype != torch.int64},
        },
        "cases": cases,
        "minibatches": minibatches,
        "grpo_advantages": _advantages(),
    }
    OUT.write_text(json.dumps(document, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases + {len(minibatches)} mini-batches to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    sys.exit(main())
