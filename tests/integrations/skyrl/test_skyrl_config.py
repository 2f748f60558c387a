"""``trainer.icefloe.*`` parsing and its translation (with SkyRL's own fields) to ClientConfig."""

from __future__ import annotations

import math

import pytest
import torch

from icefloe.client.batch import to_canonical
from icefloe.engines.losses import get_loss
from icefloe.integrations.skyrl.config import IcefloeSection, client_config_from_skyrl, loss_config_from_skyrl
from icefloe.protocol import ConfigError


def test_config_class_parses_icefloe_section_from_cli(make_cfg):
    cfg = make_cfg("trainer.icefloe.colocate=true", "trainer.icefloe.num_log_prob_workers=1", "trainer.seed=7")
    assert isinstance(cfg.trainer.icefloe, IcefloeSection)
    assert cfg.trainer.icefloe.colocate is True
    assert cfg.trainer.icefloe.num_log_prob_workers == 1
    assert cfg.trainer.seed == 7


def test_config_class_rejects_unknown_icefloe_knob(make_cfg):
    with pytest.raises((TypeError, ValueError), match="colocat"):
        make_cfg("trainer.icefloe.colocat=true")


def test_config_translation_reads_skyrl_fields(make_cfg, tmp_path):
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.seed=5",
        f"trainer.ckpt_path={tmp_path}",
        "trainer.policy.optimizer_config.lr=3e-3",
        "trainer.policy.optimizer_config.max_grad_norm=0.5",
        "trainer.placement.policy_num_gpus_per_node=4",
        "generator.inference_engine.num_engines=2",
        "generator.inference_engine.tensor_parallel_size=2",
        "trainer.max_prompt_length=64",
        "generator.sampling_params.max_generate_length=32",
        "trainer.icefloe.dtype=float32",
        "trainer.icefloe.device=cpu",
    )
    config = client_config_from_skyrl(cfg)
    assert (config.model, config.seed, config.dtype, config.max_seq_len) == ("tiny:arith", 5, "float32", 96)
    assert (config.num_training_workers, config.num_sampling_workers) == (4, 4)
    assert config.training.optimizer.lr == 3e-3
    assert config.training.grad_clip == 0.5
    assert str(config.training.checkpoint_dir) == str(tmp_path)
    assert config.backend.type == "local"
    assert config.backend.device == "cpu"


def test_config_section_worker_counts_override_skyrl_placement(make_cfg):
    cfg = make_cfg("trainer.icefloe.num_training_workers=1", "trainer.icefloe.num_sampling_workers=1")
    config = client_config_from_skyrl(cfg)
    assert (config.num_training_workers, config.num_sampling_workers) == (1, 1)


def test_config_default_backend_yields_to_arctic_backend_env(make_cfg, monkeypatch):
    monkeypatch.setenv("ARCTIC_BACKEND", "cortex")
    monkeypatch.setenv("ARCTIC_CORTEX_BASE_URL", "http://127.0.0.1:9")
    config = client_config_from_skyrl(make_cfg())
    assert config.backend.type == "remote"
    assert config.backend.base_url == "http://127.0.0.1:9"


def test_config_explicit_section_backend_wins_over_env(make_cfg, monkeypatch):
    monkeypatch.setenv("ICEFLOE_BACKEND", "remote")
    config = client_config_from_skyrl(make_cfg("trainer.icefloe.backend=ray", "trainer.icefloe.colocate=true"))
    assert config.backend.type == "ray"
    assert config.backend.colocate is True


def test_loss_config_maps_skyrl_algorithm(make_cfg):
    cfg = make_cfg(
        "trainer.algorithm.eps_clip_low=0.1",
        "trainer.algorithm.eps_clip_high=0.3",
        "trainer.algorithm.policy_loss_type=dual_clip",
        "trainer.algorithm.loss_reduction=sequence_mean",
        "trainer.algorithm.kl_estimator_type=k3",
        "trainer.algorithm.use_entropy_loss=true",
    )
    assert loss_config_from_skyrl(cfg) == {
        "eps_clip": 0.1,
        "eps_clip_higher": 0.3,
        "c_clip": 3.0,
        "loss_agg_mode": "seq-mean-token-mean",
        "entropy_coeff": 0.01,
        "entropy_agg_mode": "token-mean",
        "use_kl_loss": True,
        "kl_coef": 0.001,
        "kl_type": "low_var_kl",
        "kl_agg_mode": "seq-mean-token-mean",
    }


def test_loss_config_lists_every_unsupported_setting(make_cfg):
    cfg = make_cfg("trainer.algorithm.policy_loss_type=sapo", "trainer.algorithm.loss_reduction=prompt_mean")
    with pytest.raises(ConfigError) as raised:
        loss_config_from_skyrl(cfg)
    assert "policy_loss_type='sapo'" in str(raised.value)
    assert "loss_reduction='prompt_mean'" in str(raised.value)


def test_config_translation_maps_skyrl_lora(make_cfg):
    assert client_config_from_skyrl(make_cfg()).lora is None  # rank 0: full weights
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=32",
        "trainer.policy.model.lora.dropout=0.05",
        "trainer.icefloe.dtype=float32",
    )
    lora = client_config_from_skyrl(cfg).lora
    assert lora is not None
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 32, 0.05, "all-linear")


def test_config_translation_refuses_skyrl_lora_settings_it_cannot_honour(make_cfg):
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.init_method=xavier",
        "trainer.policy.model.lora.exclude_modules=lm_head",
        "trainer.policy.model.lora.target_modules=.*proj",
    )
    with pytest.raises(ConfigError) as refused:
        client_config_from_skyrl(cfg)
    lines = str(refused.value).splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [
        "trainer.policy.model.lora.exclude_modules",
        "trainer.policy.model.lora.init_method",
        "trainer.policy.model.lora.target_modules",
    ]


# --- the loss SkyRL's trainer.algorithm gets, through the one lowering (to_canonical) -----------------
# Two rows of 6 tokens (no padding); SkyRL's response tensors cover the last 3 and row 1 masks one out.
_SEQUENCES = torch.tensor([[5, 6, 7, 8, 9, 4], [4, 6, 7, 8, 3, 2]])
_LOSS_MASK_BA = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _skyrl_loss(cfg, *, advantage: float, log_ratio: float = 0.0, kl_per_row=(0.0, 0.0), entropy=None):
    """The grpo loss and its gradient for a payload shaped as ``IcefloeDispatch`` sends it.

    The current log-probs sit ``log_ratio`` above the old ones and ``kl_per_row[b]`` above the
    reference's on every scored token.
    """
    old_BA = torch.full((2, 3), -1.0)
    ref_BA = old_BA + log_ratio - torch.tensor(kl_per_row)[:, None]
    batch = {
        "input_ids": _SEQUENCES,
        "attention_mask": torch.ones_like(_SEQUENCES),
        "loss_mask": _LOSS_MASK_BA,
        "advantages": torch.full((2, 3), advantage),
        "old_log_probs": old_BA,
        "ref_log_prob": ref_BA,
    }
    config = {**loss_config_from_skyrl(cfg), "batch_num_tokens": int(_LOSS_MASK_BA.sum())}
    processing = {"loss_fn": "grpo", "config": config}
    frame = to_canonical({"batch": batch, "meta": {"pad_token_id": 0}, "processing": processing})
    context = frame["context"]
    logprobs_BS = (context["old_logprobs"] + log_ratio * context["loss_mask"]).requires_grad_(True)
    entropy_BS = None if entropy is None else torch.tensor(entropy)[:, None].expand_as(logprobs_BS).contiguous()
    loss_fn = get_loss(frame["processing"]["loss_fn"])
    loss, metrics = loss_fn(logprobs_BS, context=context, config=frame["processing"]["config"], entropy_BS=entropy_BS)
    loss.backward()
    assert logprobs_BS.grad is not None
    return loss.item(), logprobs_BS.grad, metrics


def test_loss_regular_policy_loss_has_no_dual_clip(make_cfg):
    # A = -1, ratio e²: SkyRL's regular loss is -min(r·A, clip(r)·A) = e² per token, with a gradient;
    # a dual clip at 3 would cap it at 3 and leave no gradient.
    loss, grad, _ = _skyrl_loss(make_cfg("trainer.algorithm.use_kl_loss=false"), advantage=-1.0, log_ratio=2.0)
    assert loss == pytest.approx(math.exp(2.0), rel=1e-5)
    assert grad.abs().sum().item() > 0.0
    dual, dual_grad, _ = _skyrl_loss(
        make_cfg("trainer.algorithm.use_kl_loss=false", "trainer.algorithm.policy_loss_type=dual_clip"),
        advantage=-1.0, log_ratio=2.0,
    )  # fmt: skip
    assert dual == pytest.approx(3.0, rel=1e-5)
    assert dual_grad.abs().sum().item() == 0.0


def test_loss_seq_mean_token_sum_norm_divides_by_skyrl_max_seq_len(make_cfg):
    cfg = make_cfg(
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",
        "trainer.algorithm.max_seq_len=64",
    )
    # On-policy, A = 1: SkyRL scales A by 1/(B·max_seq_len) and sums: -Σ mask / (2·64).
    loss, _, _ = _skyrl_loss(cfg, advantage=1.0)
    assert loss == pytest.approx(-float(_LOSS_MASK_BA.sum()) / (2 * 64), rel=1e-5)


def test_loss_seq_mean_token_sum_norm_without_max_seq_len_is_refused(make_cfg):
    cfg = make_cfg("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm")
    with pytest.raises(ConfigError, match=r"trainer\.algorithm\.max_seq_len"):
        loss_config_from_skyrl(cfg)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_loss_kl_and_entropy_terms_aggregate_as_skyrl_whatever_the_reduction(make_cfg, reduction):
    cfg = make_cfg(
        f"trainer.algorithm.loss_reduction={reduction}",
        "trainer.algorithm.max_seq_len=64",
        "trainer.algorithm.kl_estimator_type=k1",
        "trainer.algorithm.kl_loss_coef=0.5",
        "trainer.algorithm.use_entropy_loss=true",
        "trainer.algorithm.entropy_loss_coef=0.1",
    )
    # A = 0 leaves only the regularisers. SkyRL: KL = mean over rows of each row's token mean;
    # entropy = token mean over the batch.
    loss, _, _ = _skyrl_loss(cfg, advantage=0.0, kl_per_row=(0.3, 0.9), entropy=(2.0, 5.0))
    kl = (0.3 + 0.9) / 2
    entropy = (3 * 2.0 + 2 * 5.0) / 5
    assert loss == pytest.approx(0.5 * kl - 0.1 * entropy, rel=1e-5)
