"""TrainingEngine: gradient accumulation, micro-batching, schedules, checkpoints, roles."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from icefloe.config import ScheduleConfig
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import InvalidRequestError, UnsupportedOpError

from .engine_batches import make_batch, make_config, random_rows

TRAINING = {"optimizer": {"lr": 1e-2}, "grad_clip": 1.0}
# Adam's first update is about lr·sign(g), so gradient entries near 0 turn 1e-9 rounding into
# lr-sized weight differences; a larger eps keeps "same gradients ⇒ same weights" well conditioned.
WELL_CONDITIONED = {"optimizer": {"lr": 1e-2, "eps": 1e-4}}


def _engine(model_dir, **training) -> TrainingEngine:
    return TrainingEngine(make_config(training={**TRAINING, **training}), model_dir=model_dir)


def _weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.named_weights()}


def _assert_weights_close(a, b, *, exact=False):
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


def _rows_slice(batch: dict, rows: slice, config: dict) -> dict:
    return {
        "args": (),
        "kwargs": {k: v[rows] for k, v in batch["kwargs"].items()},
        "context": {k: v[rows] for k, v in batch["context"].items()},
        "processing": {"loss_fn": batch["processing"]["loss_fn"], "config": config},
    }


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_fwd_bwd_two_halves_then_step_equal_one_full_batch(model_dir, mode):
    prompts, responses, advantages = random_rows(6, seed=1)
    full = make_batch(prompts, responses, advantages, config={"loss_agg_mode": mode})
    totals = {
        "loss_agg_mode": mode,
        "batch_num_tokens": int(full["context"]["loss_mask"].sum()),
        "global_batch_size": 6,
    }
    whole = _engine(model_dir, **WELL_CONDITIONED)
    whole_result = whole.fwd_bwd(full)
    whole.step()

    halves = _engine(model_dir, **WELL_CONDITIONED)
    first = halves.fwd_bwd(_rows_slice(full, slice(0, 3), totals))
    second = halves.fwd_bwd(_rows_slice(full, slice(3, 6), totals))
    halves.step()
    _assert_weights_close(_weights(halves), _weights(whole))
    assert first["loss"] + second["loss"] == pytest.approx(whole_result["loss"], abs=1e-6)


def test_micro_batching_by_token_budget_equals_one_pass(model_dir):
    batch = make_batch(*random_rows(5, seed=2))
    plain = _engine(model_dir, **WELL_CONDITIONED)
    plain_result = plain.fwd_bwd(batch)
    plain_step = plain.step()
    width = batch["kwargs"]["input_ids"].shape[1]
    micro = _engine(model_dir, micro_batch_tokens=2 * width, **WELL_CONDITIONED)  # 3 micro-batches of ≤ 2 rows
    micro_result = micro.fwd_bwd(batch)
    micro_step = micro.step()
    _assert_weights_close(_weights(micro), _weights(plain))
    assert micro_result["num_tokens"] == plain_result["num_tokens"] == int(batch["context"]["loss_mask"].sum())
    assert micro_result.keys() == plain_result.keys() == {"loss", "avg_loss", "metrics", "num_tokens"}
    for name, value in plain_result["metrics"].items():
        if name != "padding_ratio":  # passes of another shape pad differently
            assert micro_result["metrics"][name] == pytest.approx(value, abs=1e-5), name
    assert micro_result["loss"] == micro_result["avg_loss"] == micro_result["metrics"]["loss"]
    assert micro_step["grad_norm"] == pytest.approx(plain_step["grad_norm"], rel=1e-5)


def test_fwd_bwd_accumulates_until_step(model_dir):
    batch = make_batch(*random_rows(3, seed=3))
    once = _engine(model_dir, grad_clip=0.0)
    once.fwd_bwd(batch)
    norm_once = once.step()["grad_norm"]
    twice = _engine(model_dir, grad_clip=0.0)
    twice.fwd_bwd(batch)
    twice.fwd_bwd(batch)
    assert twice.step()["grad_norm"] == pytest.approx(2 * norm_once, rel=1e-5)
    assert norm_once > 0


def test_step_reports_lr_grad_norm_and_honours_an_override(model_dir):
    engine = _engine(model_dir)
    engine.fwd_bwd(make_batch(*random_rows(2, seed=4)))
    result = engine.step(learning_rate=0.5)
    assert result["global_step"] == engine.global_step == engine.weights_version == 1
    assert result["lr"] == result["metrics"]["lr"] == 0.5
    assert result["grad_norm"] == result["metrics"]["grad_norm"] > 0
    engine.fwd_bwd(make_batch(*random_rows(2, seed=5)))
    assert engine.step()["lr"] == pytest.approx(1e-2)  # back on the schedule


def test_step_without_fwd_bwd_since_the_last_step_is_refused_and_changes_nothing(model_dir):
    """A step with no gradients used to advance the step and the LR schedule silently."""
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequestError, match="needs a fwd_bwd since the last step"):
        engine.step()
    engine.fwd_bwd(make_batch(*random_rows(2, seed=4)))
    assert engine.step()["global_step"] == 1
    with pytest.raises(InvalidRequestError, match=r"needs a fwd_bwd since the last step \(global_step 1\)"):
        engine.step()
    assert engine.global_step == 1


def test_schedule_multiplier_warmup_then_linear_and_cosine_decay():
    linear = ScheduleConfig(kind="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [round(linear.multiplier(s), 4) for s in range(8)] == [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    cosine = ScheduleConfig(kind="cosine", warmup_steps=0, total_steps=4)
    assert [round(cosine.multiplier(s), 4) for s in range(5)] == [1.0, 0.8536, 0.5, 0.1464, 0.0]
    assert ScheduleConfig().multiplier(100) == 1.0


def test_resumable_checkpoint_continues_bit_for_bit(model_dir, tmp_path):
    schedule = {"kind": "cosine", "warmup_steps": 1, "total_steps": 5}
    batches = [make_batch(*random_rows(3, seed=10 + i)) for i in range(3)]
    first = _engine(model_dir, lr_schedule=schedule)
    for batch in batches[:2]:
        first.fwd_bwd(batch)
        first.step()
    saved = first.save_checkpoint(tmp_path, kind="resumable")
    first.fwd_bwd(batches[2])
    expected_step = first.step()

    resumed = _engine(model_dir, lr_schedule=schedule)
    loaded = resumed.load_checkpoint(saved["path"])
    assert loaded == {"checkpoint_id": "global_step2", "global_step": 2, "path": saved["path"], "kind": "resumable"}
    resumed.fwd_bwd(batches[2])
    assert resumed.step() == expected_step
    _assert_weights_close(_weights(resumed), _weights(first), exact=True)


def test_saves_at_one_step_each_get_their_own_folder_and_the_resumable_one_keeps_its_optimizer(model_dir, tmp_path):
    """A weights-only save used to replace the resumable one saved at the same step."""
    engine = _engine(model_dir)
    engine.fwd_bwd(make_batch(*random_rows(2, seed=5)))
    engine.step()
    saved = [engine.save_checkpoint(tmp_path, kind=kind) for kind in ("resumable", "weights-only", "resumable")]
    assert [s["checkpoint_id"] for s in saved] == ["global_step1", "global_step1-2", "global_step1-3"]
    assert [s["kind"] for s in saved] == ["resumable", "weights-only", "resumable"]
    assert (tmp_path / "global_step1" / "optimizer.safetensors").is_file()
    assert not (tmp_path / "global_step1-2" / "optimizer.safetensors").exists()


def test_checkpoint_folder_is_pickle_free_and_holds_the_documented_files(model_dir, tmp_path):
    engine = _engine(model_dir)
    engine.fwd_bwd(make_batch(*random_rows(2, seed=5)))
    engine.step()
    path = tmp_path / engine.save_checkpoint(tmp_path)["checkpoint_id"]
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pth"))]
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and state["kind"] == "resumable" and len(state["rng"]["torch"]) > 0


def test_weights_only_checkpoint_loads_as_a_hugging_face_directory(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = _engine(model_dir)
    batch = make_batch(*random_rows(2, seed=6))
    engine.fwd_bwd(batch)
    engine.step()
    saved = engine.save_checkpoint(tmp_path, kind="weights-only")
    assert not (tmp_path / saved["checkpoint_id"] / "optimizer.safetensors").exists()
    exported = AutoModelForCausalLM.from_pretrained(saved["path"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(saved["path"])
    assert tokenizer.decode(tokenizer("12+3=").input_ids) == "12+3="
    with torch.no_grad():
        logits = exported(**{k: batch["kwargs"][k] for k in ("input_ids", "attention_mask")}).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["kwargs"]["input_ids"][:, 1:, None])[..., 0]
    mask = batch["kwargs"]["attention_mask"][:, 1:].bool()
    assert_close(engine.forward(batch)["logprobs"][:, :-1][mask], expected[mask], rtol=1e-5, atol=1e-5)

    fresh = _engine(model_dir)
    assert fresh.load_checkpoint(saved["path"])["kind"] == "weights-only"
    _assert_weights_close(_weights(fresh), _weights(engine), exact=True)
    assert fresh.global_step == 0  # weights only: the optimizer and step are untouched


def test_load_checkpoint_rejects_a_folder_without_weights(model_dir, tmp_path):
    with pytest.raises(InvalidRequestError, match="holds no model"):
        _engine(model_dir).load_checkpoint(tmp_path)


def test_forward_returns_shifted_float32_cpu_tensors_without_grad(model_dir):
    engine = _engine(model_dir)
    batch = make_batch(*random_rows(3, seed=7))
    out = engine.forward(batch)
    shape = tuple(batch["kwargs"]["input_ids"].shape)
    for name in ("logprobs", "entropy"):
        assert out[name].shape == shape and out[name].dtype == torch.float32 and out[name].device.type == "cpu"
        assert not out[name].requires_grad and out[name][:, -1].eq(0).all()
    assert (out["logprobs"][:, :-1] <= 0).all()
    hot = engine.forward({**batch, "processing": {"loss_fn": "grpo", "config": {"temperature": 2.0}}})
    assert (hot["entropy"][:, :-1] > out["entropy"][:, :-1]).float().mean() > 0.5


def test_reference_role_serves_forward_but_not_training(model_dir):
    reference = TrainingEngine(make_config(), role="reference", model_dir=model_dir)
    batch = make_batch(*random_rows(2, seed=8))
    assert reference.forward(batch)["logprobs"].shape == batch["kwargs"]["input_ids"].shape
    with pytest.raises(UnsupportedOpError, match="role='reference'"):
        reference.fwd_bwd(batch)
    with pytest.raises(UnsupportedOpError):
        reference.step()


def test_fwd_bwd_rejects_rows_longer_than_max_seq_len(model_dir):
    engine = _engine(model_dir)
    long = make_batch([[5] * 40], [[6] * 20], [1.0])
    with pytest.raises(InvalidRequestError, match="more than max_seq_len=48"):
        engine.fwd_bwd(long)


def test_sleep_and_wake_on_cpu_are_no_ops(model_dir):
    engine = _engine(model_dir)
    assert engine.sleep() == {} and engine.wake() == {}
    engine.fwd_bwd(make_batch(*random_rows(2, seed=9)))
    assert engine.step()["global_step"] == 1


def test_step_reports_the_pre_clip_global_norm_and_clips(model_dir):
    engine = _engine(model_dir, grad_clip=1e-3)
    engine.fwd_bwd(make_batch(*random_rows(3, seed=12)))
    grads = [p.grad.clone() for p in engine.model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    clipped = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: clipped.append(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in engine._params])))
    )
    assert engine.step()["grad_norm"] == pytest.approx(expected.item(), rel=1e-5)
    assert clipped[0].item() == pytest.approx(1e-3, rel=1e-3)


def test_step_skips_the_update_when_the_gradient_is_not_finite(model_dir):
    engine = _engine(model_dir)
    engine.fwd_bwd(make_batch(*random_rows(2, seed=13)))
    before = _weights(engine)
    next(engine.model.parameters()).grad[0, 0] = float("nan")
    result = engine.step()
    assert result["global_step"] == 1 and result["grad_norm"] != result["grad_norm"]  # NaN
    _assert_weights_close(_weights(engine), before, exact=True)


def test_gradient_checkpointing_trains_like_the_plain_model(model_dir):
    batch = make_batch(*random_rows(3, seed=14))
    plain = _engine(model_dir, **WELL_CONDITIONED)
    plain.fwd_bwd(batch)
    plain.step()
    recomputed = _engine(model_dir, gradient_checkpointing=True, **WELL_CONDITIONED)
    assert getattr(recomputed.model, "is_activation_checkpointing", None) or recomputed.model.is_gradient_checkpointing
    recomputed.fwd_bwd(batch)
    recomputed.step()
    _assert_weights_close(_weights(recomputed), _weights(plain))


def test_publish_folder_replaces_an_existing_checkpoint_without_leftovers(tmp_path):
    """Saving twice at one step used to delete the old folder before the new one was in place."""
    from icefloe.engines.training import publish_folder

    target = tmp_path / "global_step3"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    staging = tmp_path / ".global_step3.tmp"
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    publish_folder(staging, target)
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3"]


def test_step_reports_peak_memory_only_when_asked(model_dir):
    quiet = _engine(model_dir)
    quiet.fwd_bwd(make_batch(*random_rows(2, seed=0)))
    assert "peak_memory" not in quiet.step()
    logged = _engine(model_dir, peak_memory_log=True)
    logged.fwd_bwd(make_batch(*random_rows(2, seed=0)))
    peak = logged.step()["peak_memory"]
    assert peak["gpu_peak"] == 0  # a CPU engine: no device memory
    assert peak["cpu_peak"] > 50 * 1024 * 1024  # this process's RSS high-water mark, in bytes (torch alone is more)


def test_loading_weights_only_starts_a_fresh_adamw_and_reports_the_engines_step(model_dir, tmp_path):
    """The old AdamW moments survived such a load, and it reported the checkpoint's step, not the engine's."""
    source = _engine(model_dir, **WELL_CONDITIONED)
    source.fwd_bwd(make_batch(*random_rows(2, seed=6)))
    source.step()
    saved = source.save_checkpoint(tmp_path, kind="weights-only")  # global_step1
    trained = _engine(model_dir, **WELL_CONDITIONED)
    for seed in (1, 2, 3):
        trained.fwd_bwd(make_batch(*random_rows(2, seed=seed)))
        trained.step()

    loaded = trained.load_checkpoint(saved["path"])
    assert (loaded["checkpoint_id"], loaded["global_step"], loaded["kind"]) == ("global_step1", 3, "weights-only")
    fresh = _engine(model_dir, **WELL_CONDITIONED)
    assert fresh.load_checkpoint(saved["path"])["global_step"] == 0
    batch = make_batch(*random_rows(2, seed=8))
    for engine in (trained, fresh):  # same weights, fresh moments, constant LR: the same update
        engine.fwd_bwd(batch)
        engine.step()
    _assert_weights_close(_weights(trained), _weights(fresh))


@pytest.mark.parametrize(
    ("targets", "message"),
    [(torch.full((2, 5), -100), r"target_tokens holds -100"), (torch.full((2, 5), 3.0), "must be an integer tensor")],
)
def test_forward_and_fwd_bwd_refuse_bad_target_tokens(model_dir, targets, message):
    engine = _engine(model_dir)
    batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], [1.0, -0.5], loss_fn="cross_entropy")
    batch["context"]["target_tokens"] = targets
    with pytest.raises(InvalidRequestError, match=message):
        engine.forward(batch)
    with pytest.raises(InvalidRequestError, match=message):
        engine.fwd_bwd(batch)


def test_an_engines_first_passes_cut_for_fair_share_are_at_the_floor(model_dir):
    """With no pass timed yet, passes cut for fair share ran at the whole budget: on a shared CPU host a
    run's first forward-backward held the host for seconds per pass while another run's small op waited."""
    engine = _engine(model_dir, micro_batch_tokens=160)
    batch = make_batch([[1, 2, 3]] * 24, [[4, 5, 6, 7]] * 24, [1.0] * 24)  # 24 rows of 7 tokens
    _, whole = engine._plan(batch)
    _, first = engine._plan(batch, pass_s=0.025)
    assert [m.num_positions for m in whole] == [154, 14]  # uncut: 22 rows fill the budget
    assert [m.num_positions for m in first] == [35] * 4 + [28]  # at the floor, a quarter of the budget: 5 rows
    engine._timed_pass(10_000, 0.025)  # measured: at 400k positions a second a slice holds the budget
    assert engine._plan(batch, pass_s=0.025)[1] == whole
