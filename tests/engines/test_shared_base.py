"""Many LoRA runs on one base model: each trains, samples and saves exactly as it would alone."""

from __future__ import annotations

import peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch
from torch.testing import assert_close

from icefloe.engines.lora import SharedBase
from icefloe.engines.models import load_causal_lm, load_tokenizer
from icefloe.engines.sampling import SamplingEngine, generate_steps, generate_together
from icefloe.engines.training import TrainingEngine, fwd_bwd_steps, fwd_bwd_together
from icefloe.engines.weight_sync import sync_weights_local
from icefloe.protocol import SamplingParams

from .engine_batches import make_batch, make_config, random_rows

# Four runs that differ in everything a run may choose: seed, rank, scale and layers.
RUNS = [
    {"seed": 1, "lora": {"rank": 4, "alpha": 8}},
    {"seed": 2, "lora": {"rank": 8, "alpha": 8}},
    {"seed": 3, "lora": {"rank": 2, "alpha": 4, "train_mlp": False}},
    {"seed": 4, "lora": {"rank": 4, "alpha": 4, "train_unembed": True}},
]


def _config(run: dict):
    return make_config(seed=run["seed"], lora=run["lora"], training={"optimizer": {"lr": 2e-2}})


def _shared(model_dir) -> SharedBase:
    base = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu")).requires_grad_(False)
    return SharedBase(base, model_dir=model_dir, tokenizer=load_tokenizer(model_dir))


def _batch(run_index: int, step: int) -> dict:
    return make_batch(*random_rows(5, seed=100 * run_index + step), config={"loss_agg_mode": "seq-mean-token-sum"})


def _adapter(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.sync_parameters()}


def test_four_runs_on_one_base_train_exactly_as_each_alone(model_dir):
    shared = _shared(model_dir)
    together = [TrainingEngine(_config(run), shared=shared) for run in RUNS]
    alone = [TrainingEngine(_config(run), model_dir=model_dir) for run in RUNS]
    for engine_a, engine_b in zip(together, alone, strict=True):
        assert _adapter(engine_a).keys() == _adapter(engine_b).keys()
    for step in range(5):
        for index, (shared_run, solo_run) in enumerate(zip(together, alone, strict=True)):  # runs interleave
            batch = _batch(index, step)
            assert_close(shared_run.fwd_bwd(batch)["loss"], solo_run.fwd_bwd(batch)["loss"], atol=1e-5, rtol=0)
        for shared_run, solo_run in zip(together, alone, strict=True):
            assert shared_run.step()["grad_norm"] == pytest.approx(solo_run.step()["grad_norm"], abs=1e-5)
    for index, (shared_run, solo_run) in enumerate(zip(together, alone, strict=True)):
        probe = _batch(index, 99)
        assert_close(shared_run.forward(probe)["logprobs"], solo_run.forward(probe)["logprobs"], atol=1e-5, rtol=0)
        reference = shared_run.forward(probe, reference=True)["logprobs"]
        assert_close(reference, solo_run.forward(probe, reference=True)["logprobs"], atol=1e-5, rtol=0)
        for name, tensor in _adapter(solo_run).items():
            assert_close(_adapter(shared_run)[name], tensor, atol=1e-5, rtol=0)


def test_fwd_bwd_of_several_runs_in_shared_passes_equals_each_alone(model_dir):
    """Rows of four runs (batches of different widths and losses) go through their own adapters in
    the same passes: each run's loss, metrics, log-probs and gradients are what it gets alone."""
    shared = _shared(model_dir)
    together = [TrainingEngine(_config(run), shared=shared) for run in RUNS]
    alone = [TrainingEngine(_config(run), model_dir=model_dir) for run in RUNS]
    batches = []
    for index in range(len(RUNS)):
        batch = _batch(index, 7)
        loss_fn = "cross_entropy" if index % 2 else "grpo"
        batch["processing"] = {"loss_fn": loss_fn, "config": {"return_logprobs": True}}
        batches.append(batch)
    results = fwd_bwd_together(list(zip(together, batches, strict=True)))
    assert shared._layers, "mixed passes go by row slices (SharedBase._routed), not peft's adapter_names path"
    assert together[0].token_budget >= sum(int(b["kwargs"]["attention_mask"].sum()) for b in batches)  # one pass
    for mine, engine, solo, batch in zip(results, together, alone, batches, strict=True):
        theirs = solo.fwd_bwd(batch)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["num_tokens"] == theirs["num_tokens"]
        assert_close(mine["logprobs"], theirs["logprobs"], atol=1e-5, rtol=0)
        for name in theirs["metrics"].keys() - {"padding_ratio"}:
            assert mine["metrics"][name] == pytest.approx(theirs["metrics"][name], abs=1e-5), name
        solo_grads = {name: p.grad for name, p in solo.sync_parameters()}
        for name, param in engine.sync_parameters():
            assert_close(param.grad, solo_grads[name], atol=1e-5, rtol=0)


def test_layers_a_run_picks_are_the_ones_adapted(model_dir):
    shared = _shared(model_dir)
    no_mlp, with_head = (TrainingEngine(_config(run), shared=shared) for run in RUNS[2:])
    assert not any(".mlp." in name for name, _ in no_mlp.sync_parameters())
    assert any(".self_attn." in name for name, _ in no_mlp.sync_parameters())
    assert any("lm_head" in name for name, _ in with_head.sync_parameters())


def test_a_runs_fwd_bwd_writes_gradients_to_its_own_adapter_only(model_dir):
    shared = _shared(model_dir)
    first, second = (TrainingEngine(_config(run), shared=shared) for run in RUNS[:2])
    first.fwd_bwd(_batch(0, 0))
    assert all(p.grad is not None for _, p in first.sync_parameters())
    assert all(p.grad is None for _, p in second.sync_parameters())
    grads = {name: p.grad.clone() for name, p in first.sync_parameters()}
    second.fwd_bwd(_batch(1, 0))
    second.step()
    for name, p in first.sync_parameters():
        assert torch.equal(p.grad, grads[name]), f"{name}: another run's fwd_bwd or step touched it"


def test_samplers_on_one_base_sample_in_one_batch_what_each_would_alone(model_dir):
    """Each run's sampler samples with its adapter as of its last sync; the base sampler with none."""
    shared = _shared(model_dir)
    params = SamplingParams(n=3, max_tokens=6, seed=11, logprobs=True)
    prompts = [[5, 6, 7], [8, 9]]
    calls, expected = [], []
    for index, run in enumerate(RUNS[:3]):
        trainer, sampler = TrainingEngine(_config(run), shared=shared), SamplingEngine(_config(run), shared=shared)
        solo_trainer = TrainingEngine(_config(run), model_dir=model_dir)
        solo_sampler = SamplingEngine(_config(run), model_dir=model_dir)
        for engine in (trainer, solo_trainer):
            engine.fwd_bwd(_batch(index, 0))
            engine.step()
        assert sync_weights_local(trainer, sampler)["policy_version"] == 1
        sync_weights_local(solo_trainer, solo_sampler)
        trainer.fwd_bwd(_batch(index, 1))
        trainer.step()  # trained on after the sync: the sampler still holds the synced snapshot
        calls.append((sampler, prompts, params))
        expected.append(solo_sampler.generate(prompts, params))
    base_config = make_config(seed=9)
    calls.append((SamplingEngine(base_config, shared=shared), prompts, params))
    expected.append(SamplingEngine(base_config, model_dir=model_dir).generate(prompts, params))

    results = generate_together(calls)
    for got, want in zip(results, expected, strict=True):
        assert [s["token_ids"] for s in got] == [s["token_ids"] for s in want]
        assert [s["policy_version"] for s in got] == [s["policy_version"] for s in want]
        for mine, theirs in zip(got, want, strict=True):
            assert_close(torch.tensor(mine["logprobs"]), torch.tensor(theirs["logprobs"]), atol=1e-5, rtol=0)


def test_a_run_that_leaves_frees_its_adapter_and_the_others_go_on(model_dir):
    shared = _shared(model_dir)
    leaving, staying = (TrainingEngine(_config(run), shared=shared) for run in RUNS[:2])
    solo = TrainingEngine(_config(RUNS[1]), model_dir=model_dir)
    shared.remove(leaving.adapter)
    assert shared.adapters == [staying.adapter]
    assert not any(f".{leaving.adapter}." in name for name, _ in shared.model.named_parameters())
    batch = _batch(1, 0)
    assert staying.fwd_bwd(batch)["loss"] == pytest.approx(solo.fwd_bwd(batch)["loss"], abs=1e-5)
    shared.remove(staying.adapter)
    assert shared.model is shared.base and not shared.adapters


def test_checkpoints_of_a_shared_run_load_into_a_run_alone(model_dir, tmp_path):
    shared = _shared(model_dir)
    _, run = (TrainingEngine(_config(r), shared=shared) for r in RUNS[:2])
    run.fwd_bwd(_batch(1, 0))
    run.step()
    saved = run.save_checkpoint(tmp_path, "resumable")
    solo = TrainingEngine(_config(RUNS[1]), model_dir=model_dir)
    assert solo.load_checkpoint(saved["path"])["global_step"] == 1
    for name, tensor in _adapter(run).items():
        assert torch.equal(_adapter(solo)[name], tensor)
    probe = _batch(1, 5)
    assert_close(solo.forward(probe)["logprobs"], run.forward(probe)["logprobs"], atol=1e-6, rtol=0)


def test_a_small_fwd_bwd_sharing_passes_with_a_large_one_is_answered_after_its_own_pass(model_dir):
    """A small call stacked with a large one waited for all of the large one's passes."""
    shared = _shared(model_dir)
    runs = [make_config(seed=run["seed"], lora=run["lora"], training={"micro_batch_tokens": 24}) for run in RUNS[:2]]
    large, small = (TrainingEngine(config, shared=shared) for config in runs)
    batches = [make_batch(*random_rows(24, seed=5)), make_batch(*random_rows(1, seed=6))]
    answered: list[list[int]] = []
    results: dict[int, dict] = {}
    for done in fwd_bwd_steps([(large, batches[0]), (small, batches[1])]):
        answered.append(sorted(done))
        results.update(done)
    assert answered[0] == [1] and answered[-1] == [0] and len(answered) > 3
    for index, (config, batch) in enumerate(zip(runs, batches, strict=True)):
        solo = TrainingEngine(config, model_dir=model_dir)
        assert results[index]["loss"] == pytest.approx(solo.fwd_bwd(batch)["loss"], abs=1e-5)


def test_closing_fwd_bwd_steps_part_way_leaves_a_run_that_had_no_gradient_with_none(model_dir):
    shared = _shared(model_dir)
    config = make_config(seed=1, lora=RUNS[0]["lora"], training={"micro_batch_tokens": 24})
    engine = TrainingEngine(config, shared=shared)
    steps = fwd_bwd_steps([(engine, make_batch(*random_rows(24, seed=5)))])
    assert next(steps) == {}  # one pass ran: part of the gradient is in
    assert any(p.grad is not None for _, p in engine.sync_parameters())
    steps.close()
    assert all(p.grad is None for _, p in engine.sync_parameters())
    batch = _batch(0, 0)
    solo = TrainingEngine(config, model_dir=model_dir)
    assert engine.fwd_bwd(batch)["loss"] == pytest.approx(solo.fwd_bwd(batch)["loss"], abs=1e-5)
    solo_grads = dict(solo.sync_parameters())
    for name, param in engine.sync_parameters():
        assert_close(param.grad, solo_grads[name].grad, atol=1e-5, rtol=0)


def test_generate_steps_answers_a_short_call_when_its_rows_end_and_each_as_alone(model_dir):
    shared = _shared(model_dir)
    sampler = SamplingEngine(make_config(seed=3), shared=shared)
    long = (sampler, [[5, 6, 7]] * 4, SamplingParams(max_tokens=30, seed=1, ignore_eos=True))
    short = (sampler, [[8, 9]], SamplingParams(max_tokens=2, seed=2, ignore_eos=True))
    answered: list[tuple[int, ...]] = []
    results: dict[int, list] = {}
    for done, _ in generate_steps([long, short]):
        answered.append(tuple(sorted(done)))
        results.update(done)
    assert answered.index((1,)) == 1 and answered[-1] == (0,)  # the short call's second step ends it
    assert [s["token_ids"] for s in results[0]] == [s["token_ids"] for s in sampler.generate(*long[1:])]
    assert [s["token_ids"] for s in results[1]] == [s["token_ids"] for s in sampler.generate(*short[1:])]


def test_generate_steps_sends_a_watched_calls_new_tokens_only_and_the_others_none(model_dir):
    shared = _shared(model_dir)
    sampler = SamplingEngine(make_config(seed=3), shared=shared)
    params = SamplingParams(max_tokens=12, seed=1, ignore_eos=True, logprobs=True)
    watched = (sampler, [[5, 6, 7]], params.model_copy(update={"n": 2}))
    other = (sampler, [[8, 9]], params)
    grown: list[list[int]] = [[], []]
    results: dict[int, list] = {}
    for done, news in generate_steps([watched, other], watched=[0]):
        assert set(news) <= {0} and not set(news) & set(done)  # news only of the watched call, while it runs
        for row, new in zip(grown, news.get(0, []), strict=False):
            assert len(new["logprobs"]) == len(new["token_ids"])
            row += new["token_ids"]
        results.update(done)
    assert all(len(row) == 11 for row in grown)  # every step but the last, which the result carries
    assert [s["token_ids"][:11] for s in results[0]] == grown
