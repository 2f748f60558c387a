"""LoRA through peft: only adapters train and sync, the base is the reference, PEFT folders round-trip."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from torch.testing import assert_close

from icefloe.config import LoraConfig
from icefloe.engines.batch import shifted_token_logprobs
from icefloe.engines.models import load_causal_lm
from icefloe.engines.sampling import SamplingEngine, build_sampling_engine
from icefloe.engines.training import TrainingEngine
from icefloe.engines.weight_sync import sync_weights_local
from icefloe.protocol import InvalidRequestError, SamplingParams, UnsupportedOpError

from .engine_batches import make_batch, make_config, random_rows

LORA = {"rank": 4, "alpha": 8}
TRAINING = {"optimizer": {"lr": 2e-2}}


def _config(lora=None, **training):
    return make_config(lora=LORA if lora is None else lora, training={**TRAINING, **training})


def _all_weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def _fixed_batch(loss_fn: str = "grpo") -> dict:
    return make_batch(*random_rows(6, seed=3), loss_fn=loss_fn)


def _logprobs(model, batch) -> torch.Tensor:
    """The model's shifted log-probs of a right-padded batch; a column that scores padding reads 0, as the engine's."""
    with torch.no_grad():
        logits = model(**batch["kwargs"], use_cache=False).logits
    scores_a_token_BS = torch.nn.functional.pad(batch["kwargs"]["attention_mask"][:, 1:], (0, 1))
    return shifted_token_logprobs(logits, batch["kwargs"]["input_ids"])[0] * scores_a_token_BS


def test_lora_step_changes_only_adapters_and_the_loss_falls(model_dir):
    engine = TrainingEngine(_config(), model_dir=model_dir)
    before = _all_weights(engine)
    synced = {name for name, _ in engine.named_weights()}
    assert synced and all(".lora_A." in n or ".lora_B." in n for n in synced)
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for _, p in engine.sync_parameters()}
    adapter_names = {name for name, p in engine.model.named_parameters() if id(p) in optimized}

    batch = _fixed_batch("cross_entropy")  # on-policy GRPO's loss value does not move; cross-entropy's does
    losses = []
    for _ in range(8):
        losses.append(engine.fwd_bwd(batch)["loss"])
        engine.step()

    after = _all_weights(engine)
    for name in before:
        if name in adapter_names:
            continue
        assert torch.equal(before[name], after[name]), f"base weight {name} changed"
    assert any(not torch.equal(before[name], after[name]) for name in adapter_names)
    assert losses[-1] < losses[0] - 0.05, losses


def test_lora_micro_batches_and_checkpointing_train_like_one_pass(model_dir):
    batch = _fixed_batch()
    plain = TrainingEngine(_config(optimizer={"lr": 2e-2, "eps": 1e-4}), model_dir=model_dir)
    split = TrainingEngine(
        _config(optimizer={"lr": 2e-2, "eps": 1e-4}, micro_batch_tokens=24, gradient_checkpointing=True),
        model_dir=model_dir,
    )
    for engine in (plain, split):
        engine.fwd_bwd(batch)
        engine.step()
    second = [engine.fwd_bwd(batch)["loss"] for engine in (plain, split)]
    assert second[0] == pytest.approx(second[1], abs=1e-5)
    for (name, a), (_, b) in zip(plain.named_weights(), split.named_weights(), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_lora_reference_forward_is_the_base_model(model_dir):
    engine = TrainingEngine(_config(), model_dir=model_dir)
    base = TrainingEngine(_config(), role="reference", model_dir=model_dir)
    batch = _fixed_batch()
    for _ in range(3):
        engine.fwd_bwd(batch)
        engine.step()

    reference = engine.forward(batch, reference=True)["logprobs"]
    assert_close(reference, base.forward(batch)["logprobs"], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(engine.forward(batch)["logprobs"], reference, atol=1e-3)  # the policy moved
    with pytest.raises(UnsupportedOpError, match="needs LoRA"):
        TrainingEngine(make_config(), model_dir=model_dir).forward(batch, reference=True)


def test_lora_sync_moves_only_adapters_and_sampler_matches_trainer(model_dir):
    config = _config()
    trainer = TrainingEngine(config, model_dir=model_dir)
    sampler = SamplingEngine(config, model_dir=model_dir)
    for _ in range(3):
        trainer.fwd_bwd(_fixed_batch())
        trainer.step()

    synced = sync_weights_local(trainer, sampler)

    adapter_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) - adapter_bytes
    assert synced["bytes"] == adapter_bytes < full_bytes / 4
    assert synced["policy_version"] == sampler.policy_version == 3
    prompts = [sampler.tokenizer.encode(p) for p in ["12+7=", "3*4=", "100-58="]]
    results = sampler.generate(prompts, SamplingParams(max_tokens=8, seed=1, logprobs=True))
    assert {r["policy_version"] for r in results} == {3}
    responses = [r["token_ids"] for r in results]
    forward = trainer.forward(make_batch(prompts, responses, [0.0] * 3))["logprobs"]
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        expected = forward[b, len(prompt) - 1 : len(prompt) + len(response) - 1]
        assert_close(torch.tensor(results[b]["logprobs"]), expected, rtol=1e-5, atol=1e-5)


def test_lora_sync_refuses_formats_the_engines_cannot_use(model_dir):
    lora = TrainingEngine(_config(), model_dir=model_dir)
    full = TrainingEngine(make_config(), model_dir=model_dir)
    lora_sampler = SamplingEngine(_config(), model_dir=model_dir)
    full_sampler = SamplingEngine(make_config(), model_dir=model_dir)
    wider_sampler = SamplingEngine(_config(lora={"rank": 8, "alpha": 8}), model_dir=model_dir)

    with pytest.raises(InvalidRequestError, match="use weight_format='lora'"):
        sync_weights_local(lora, lora_sampler, "vllm")
    with pytest.raises(InvalidRequestError, match="needs LoRA adapters on the trainer"):
        sync_weights_local(full, full_sampler, "lora")
    with pytest.raises(InvalidRequestError, match=r"\(trainer vs sampler\): r: 4 vs 8; give both the same"):
        sync_weights_local(lora, wider_sampler)
    with pytest.raises(InvalidRequestError, match="LoRA vs none"):
        sync_weights_local(lora, full_sampler, "lora")
    with pytest.raises(InvalidRequestError, match=r"weight_format must be one of \['vllm', 'hf', 'lora'\]; got 'npz'"):
        sync_weights_local(full, full_sampler, "npz")
    assert sync_weights_local(lora, lora_sampler, "lora")["bytes"] > 0
    assert sync_weights_local(full, full_sampler, "hf")["bytes"] > 0


def test_lora_weights_only_checkpoint_is_a_peft_folder(model_dir, tmp_path):
    engine = TrainingEngine(_config(), model_dir=model_dir)
    batch = _fixed_batch()
    for _ in range(3):
        engine.fwd_bwd(batch)
        engine.step()

    saved = engine.save_checkpoint(tmp_path, kind="weights-only")

    folder = tmp_path / saved["checkpoint_id"]
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "model.safetensors").exists()
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    loaded = peft.PeftModel.from_pretrained(load_causal_lm(model_dir), str(folder))
    assert_close(_logprobs(loaded, batch), engine.forward(batch)["logprobs"], rtol=1e-5, atol=1e-5)

    fresh = TrainingEngine(_config(), model_dir=model_dir)
    assert fresh.load_checkpoint(folder)["kind"] == "weights-only"
    assert_close(fresh.forward(batch)["logprobs"], engine.forward(batch)["logprobs"], rtol=0, atol=0)

    # A sampler starts from the folder too (the base model, then the adapter under PEFT's names).
    on_base = _config().model_copy(update={"model": str(model_dir)})
    sampler = build_sampling_engine(on_base, "cpu", model_dir=folder)
    assert isinstance(sampler, SamplingEngine) and sampler.policy_version == 0
    with pytest.raises(InvalidRequestError, match="lora_alpha: 8 vs 16"):
        build_sampling_engine(on_base.model_copy(update={"lora": LoraConfig(rank=4, alpha=16)}), model_dir=folder)
    with pytest.raises(InvalidRequestError, match="is a LoRA adapter checkpoint"):
        build_sampling_engine(on_base.model_copy(update={"lora": None}), model_dir=folder)
    prompt = sampler.tokenizer.encode("12+7=")
    sample = sampler.generate([prompt], SamplingParams(max_tokens=6, seed=2, logprobs=True))[0]
    scored = engine.forward(make_batch([prompt], [sample["token_ids"]], [0.0]))["logprobs"][0]
    span = slice(len(prompt) - 1, len(prompt) + len(sample["token_ids"]) - 1)
    assert_close(torch.tensor(sample["logprobs"]), scored[span], rtol=1e-5, atol=1e-5)


def test_lora_resumable_checkpoint_continues_bit_for_bit(model_dir, tmp_path):
    config = _config(lora={**LORA, "dropout": 0.2})  # dropout draws random numbers: the RNG must resume too
    batch = _fixed_batch()
    first = TrainingEngine(config, model_dir=model_dir)
    for _ in range(2):
        first.fwd_bwd(batch)
        first.step()
    saved = first.save_checkpoint(tmp_path, kind="resumable")
    expected_loss = first.fwd_bwd(batch)["loss"]
    first.step()

    resumed = TrainingEngine(config, model_dir=model_dir)
    torch.manual_seed(1234)  # whatever ran in between, the checkpoint's RNG state is what counts
    assert resumed.load_checkpoint(saved["path"])["global_step"] == 2
    assert resumed.fwd_bwd(batch)["loss"] == expected_loss
    resumed.step()
    assert resumed.global_step == first.global_step == 3
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "lm_head"]], ids=["all-linear", "tied-head"])
def test_lora_export_merged_writes_full_weights_with_the_same_logprobs(model_dir, tmp_path, target_modules):
    """The tiny model ties its output layer to the input embeddings: merging must not change the embeddings."""
    engine = TrainingEngine(_config(lora={**LORA, "target_modules": target_modules}), model_dir=model_dir)
    batch = _fixed_batch()
    for _ in range(3):
        engine.fwd_bwd(batch)
        engine.step()
    adapters = {name: t.clone() for name, t in engine.named_weights()}

    exported = engine.export_merged(tmp_path / "merged")

    assert exported["kind"] == "merged" and (tmp_path / "merged" / "model.safetensors").is_file()
    merged = load_causal_lm(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert_close(_logprobs(merged, batch), engine.forward(batch)["logprobs"], rtol=1e-5, atol=1e-5)
    for name, tensor in engine.named_weights():  # the trainer keeps training its own adapters
        assert torch.equal(tensor, adapters[name])


def test_lora_engine_refuses_a_full_weight_checkpoint_and_the_reverse(model_dir, tmp_path):
    full = TrainingEngine(make_config(), model_dir=model_dir)
    lora = TrainingEngine(_config(), model_dir=model_dir)
    full_ckpt = full.save_checkpoint(tmp_path / "full", kind="weights-only")["path"]
    lora_ckpt = lora.save_checkpoint(tmp_path / "lora", kind="weights-only")["path"]
    with pytest.raises(InvalidRequestError, match="holds full weights but this engine trains LoRA adapters"):
        lora.load_checkpoint(full_ckpt)
    with pytest.raises(InvalidRequestError, match="holds a LoRA adapter but this engine trains full weights"):
        full.load_checkpoint(lora_ckpt)
    wider = TrainingEngine(_config(lora={"rank": 8}), model_dir=model_dir)
    with pytest.raises(InvalidRequestError, match="r: 4 vs 8"):
        wider.load_checkpoint(lora_ckpt)


def test_lora_target_modules_that_do_not_exist_are_refused(model_dir):
    with pytest.raises(InvalidRequestError, match=r"lora\.target_modules=\['no_such_proj'\]"):
        TrainingEngine(_config(lora={"target_modules": ["no_such_proj"]}), model_dir=model_dir)


def test_lora_through_the_local_client_samples_with_the_synced_adapter(tmp_path):
    """Client → local transport → engines: generate, fwd_bwd, step, sync, generate, forward."""
    from icefloe.client import Client, build_batch

    config = make_config(
        lora=LORA, num_log_prob_workers=1, training={**TRAINING, "checkpoint_dir": str(tmp_path / "ckpt")}
    )
    with Client(config) as client:
        tok = client.tokenizer
        prompts = [tok.encode(p) for p in ["12+7=", "3*4=", "100-58="]]
        params = {"n": 2, "max_tokens": 6, "seed": 3, "logprobs": True}
        samples = client.generate(prompts, params)
        rows = [prompts[i // 2] for i in range(len(samples))]
        batch = build_batch(
            rows, [s["token_ids"] for s in samples], [1.0, -1.0] * 3, pad_id=tok.pad_token_id, loss_fn="grpo"
        )
        for _ in range(3):
            client.fwd_bwd(batch)
            client.step()
        synced = client.sync_weights()
        after = client.generate(prompts, params)
        saved = client.save_checkpoint("weights-only")
        responses = [s["token_ids"] for s in after]
        scored = build_batch(rows, responses, [0.0] * len(after), pad_id=tok.pad_token_id)
        policy = client.forward(scored)["logprobs"]
        reference = client.forward(scored, reference=True)["logprobs"]

    adapter_bytes = sum(p.numel() * p.element_size() for _, p in TrainingEngine(config).named_weights())
    assert synced["bytes"] == adapter_bytes and synced["policy_version"] == 3
    assert {s["policy_version"] for s in after} == {3}
    for b, (prompt, sample) in enumerate(zip(rows, after, strict=True)):
        span = slice(len(prompt) - 1, len(prompt) + len(sample["token_ids"]) - 1)
        assert_close(torch.tensor(sample["logprobs"]), policy[b, span], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(policy, reference, atol=1e-3)  # the reference is the untrained base
    assert (tmp_path / "ckpt" / saved["checkpoint_id"] / "adapter_model.safetensors").is_file()


def test_vllm_sampler_refuses_lora_biases_before_loading_anything():
    """vLLM's PEFT loader takes bias='none' only; a bias would fail at the first generate after a sync."""
    from icefloe.engines.sampling import VLLMSamplingEngine

    with pytest.raises(InvalidRequestError, match="vLLM serves LoRA adapters without biases"):
        VLLMSamplingEngine(_config(lora={**LORA, "bias": "all"}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM)")
def test_gpu_vllm_sampler_serves_the_synced_adapter(model_dir):
    pytest.importorskip("vllm")
    from icefloe.engines.sampling import VLLMSamplingEngine

    config = _config()
    trainer = TrainingEngine(config, device="cuda", model_dir=model_dir)
    sampler = VLLMSamplingEngine(config, model_dir=model_dir)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_tokens=6, seed=1, logprobs=True)
    for _ in range(3):
        trainer.fwd_bwd(_fixed_batch())
        trainer.step()
    before = sampler.generate(prompts, params)

    synced = sync_weights_local(trainer, sampler)

    assert synced["bytes"] == sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    results = sampler.generate(prompts, params)
    assert {r["policy_version"] for r in results} == {3} and {r["policy_version"] for r in before} == {0}
    responses = [r["token_ids"] for r in results]
    forward = trainer.forward(make_batch(prompts, responses, [0.0] * 2))["logprobs"]
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        expected = forward[b, len(prompt) - 1 : len(prompt) + len(response) - 1]
        assert_close(torch.tensor(results[b]["logprobs"]), expected, rtol=0, atol=2e-2)


@pytest.mark.parametrize("kind", ["weights-only", "resumable"])
def test_lora_trainer_refuses_an_adapter_saved_with_another_alpha(model_dir, tmp_path, kind):
    """Another alpha has the same shapes, so the adapter loaded silently at the wrong scale."""
    saved = TrainingEngine(_config(), model_dir=model_dir).save_checkpoint(tmp_path, kind=kind)
    other = TrainingEngine(_config(lora={"rank": 4, "alpha": 16}), model_dir=model_dir)
    with pytest.raises(InvalidRequestError, match="lora_alpha: 8 vs 16"):
        other.load_checkpoint(saved["path"])
