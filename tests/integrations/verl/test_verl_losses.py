"""The loss a verl config gets through icefloe equals verl 0.9.1's own, value and gradients.

``golden/verl_losses.json`` holds verl's ``ppo_loss`` on fixed random inputs, made once by
``golden/make_verl_losses.py`` in an environment with verl installed. Each case takes the path a
verl batch takes: a verl config tree → ``VerlSettings`` → ``densify`` → ``update_payload`` →
``to_canonical`` → the registered loss. The model's log-probs and entropies enter the canonical
frame where the lowering puts response-aligned values, and gradients come back through
``responses_from_canonical``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from icefloe.client.batch import responses_from_canonical, to_canonical
from icefloe.engines.losses import get_loss
from icefloe.integrations.verl.payload import densify, update_payload
from icefloe.integrations.verl.settings import VerlSettings

GOLDEN = json.loads((Path(__file__).parent / "golden" / "verl_losses.json").read_text(encoding="utf-8"))
INPUTS = GOLDEN["inputs"]
RESPONSE_WIDTH = len(INPUTS["response_mask"][0])
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _fields(*, with_weights: bool) -> dict[str, torch.Tensor]:
    """The stored inputs as the V0 worker hands them over: dense prompts/responses and [B, R] fields."""
    fields = {name: torch.tensor(INPUTS[name]) for name in ("prompts", "responses", "attention_mask")}
    for name in ("response_mask", "old_log_probs", "advantages", "ref_log_prob"):
        fields[name] = torch.tensor(INPUTS[name], dtype=torch.float32)
    if with_weights:
        fields["rollout_is_weights"] = torch.tensor(INPUTS["rollout_is_weights"], dtype=torch.float32)
    return fields


def _settings(make_config: Any, actor: dict[str, Any], mini_batch_rows: int) -> VerlSettings:
    config = make_config(**{"actor_rollout_ref.rollout.n": 1})
    config["actor_rollout_ref"]["actor"] = {"ppo_mini_batch_size": mini_batch_rows, **actor}
    return VerlSettings.from_verl(config)


def _icefloe_loss(make_config: Any, case: dict[str, Any]) -> dict[str, Any]:
    rows = slice(case["rows"][0], case["rows"][-1] + 1)
    settings = _settings(make_config, case["actor"], len(case["rows"]))
    dense = densify(_fields(with_weights=case["weights"]), pad_token_id=0)
    payload = update_payload(
        dense, rows, pad_token_id=0, temperature=settings.temperature, actor_config=settings.actor_loss_config,
        loss_fn=settings.policy_loss, use_kl_loss=settings.use_kl_loss,
    )  # fmt: skip
    if not case["normalisers"]:  # a verl payload that leaves the normalisers to verl's defaults
        del payload["meta"]["global_batch_size"], payload["meta"]["batch_num_tokens"]
    frame = to_canonical(payload)

    def placed(name: str) -> torch.Tensor:
        values = torch.tensor(INPUTS[name], dtype=torch.float32)[rows]
        lowered = to_canonical({**payload, "batch": {**payload["batch"], "old_log_probs": values}})
        return lowered["context"]["old_logprobs"].clone().requires_grad_(True)

    logprobs_BS, entropy_BS = placed("log_prob"), placed("entropy")
    loss_fn, config = get_loss(frame["processing"]["loss_fn"]), frame["processing"]["config"]
    loss, _ = loss_fn(logprobs_BS, context=frame["context"], config=config, entropy_BS=entropy_BS)
    loss.backward()
    grads = {
        name: responses_from_canonical(
            torch.zeros_like(tensor) if tensor.grad is None else tensor.grad, payload["batch"], RESPONSE_WIDTH
        )
        for name, tensor in (("grad_log_prob", logprobs_BS), ("grad_entropy", entropy_BS))
    }
    return {"loss": loss.detach(), "width": frame["kwargs"]["input_ids"].shape[1], **grads}


def test_golden_covers_every_knob_verl_has() -> None:
    names = [case["name"].split("/") for case in GOLDEN["cases"]]
    full = {tuple(parts) for parts in names if len(parts) == 4}
    modes = {parts[0] for parts in full}
    assert modes == {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                     "seq-mean-token-sum-norm@16", "seq-mean-token-mean"}  # fmt: skip
    kl_types = {parts[2] for parts in full}
    assert kl_types == {"no-kl", "kl", "abs", "mse", "k1", "k2", "k3", "low_var_kl",
                        "kl+", "abs+", "mse+", "k1+", "k2+", "k3+", "low_var_kl+"}  # fmt: skip
    assert len(full) == len(modes) * 2 * len(kl_types) * 2  # × plain/dual clip × entropy on/off
    assert GOLDEN["verl_version"] == "0.9.1"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[case["name"] for case in GOLDEN["cases"]])
def test_verl_path_loss_and_gradients_equal_verls(make_config, case) -> None:
    ours = _icefloe_loss(make_config, case)
    assert_close(ours["loss"], torch.tensor(case["loss"]), **TOLERANCE)
    assert_close(ours["grad_log_prob"], torch.tensor(case["grad_log_prob"]), **TOLERANCE)
    assert_close(ours["grad_entropy"], torch.tensor(case["grad_entropy"]), **TOLERANCE)


def test_seq_mean_token_sum_norm_gives_verls_scale_for_mini_batches_of_different_prompt_lengths(make_config) -> None:
    """Mini-batch frames differ in width (longest prompt + response), yet both divide by verl's R."""
    first, second = GOLDEN["minibatches"]
    settings = _settings(make_config, first["actor"], len(first["rows"]))
    assert settings.mini_batch_size == 3 and settings.actor_loss_config["loss_agg_mode"] == "seq-mean-token-sum-norm"
    widths = []
    for case in (first, second):
        ours = _icefloe_loss(make_config, case)
        widths.append(ours["width"])
        assert_close(ours["loss"], torch.tensor(case["loss"]), **TOLERANCE)
        assert_close(ours["grad_log_prob"], torch.tensor(case["grad_log_prob"]), **TOLERANCE)
        summed = _icefloe_loss(make_config, {**case, "actor": {**case["actor"], "loss_agg_mode": "seq-mean-token-sum"}})
        assert_close(ours["loss"], summed["loss"] / RESPONSE_WIDTH)
    assert widths[0] != widths[1] and RESPONSE_WIDTH not in widths
