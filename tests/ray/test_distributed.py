"""Sharding, reduction, bucketing and the weight broadcast of ``icefloe.engines.distributed`` (no Ray).

The broadcast test runs two gloo ranks as threads of this process; the FSDP test spawns two
processes, since each needs its own default process group.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.client.batch import build_batch
from icefloe.config import ClientConfig
from icefloe.engines.batch import validate_batch
from icefloe.engines.distributed import (
    WeightBroadcast,
    combine_fwd_bwd,
    concat_forward,
    plan_buckets,
    shard_rows,
    weight_layout,
)
from icefloe.engines.models import resolve_model
from icefloe.engines.training import TrainingEngine


def make_frame(num_rows: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    prompts = [[1 + (i % 5), 2, 3][: 2 + i % 2] for i in range(num_rows)]
    responses = [[int(t) for t in torch.randint(3, 18, (2 + i % 4,), generator=generator)] for i in range(num_rows)]
    advantages = [float(a) for a in torch.randn(num_rows, generator=generator)]
    return validate_batch(build_batch(prompts, responses, advantages, pad_id=0))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return resolve_model("tiny:arith", seed=7, cache_dir=tmp_path_factory.mktemp("models"))


def test_shard_rows_fixes_global_normalisers_before_splitting():
    frame = make_frame(5)
    shards, real_rows = shard_rows(frame, 2)
    assert real_rows == [2, 3]
    total_tokens = int(frame["context"]["loss_mask"].sum())
    for shard in shards:
        assert shard["processing"]["config"]["batch_num_tokens"] == total_tokens
        assert shard["processing"]["config"]["global_batch_size"] == 5
    joined = torch.cat([s["kwargs"]["input_ids"] for s in shards])
    assert torch.equal(joined, frame["kwargs"]["input_ids"])


def test_shard_rows_keeps_caller_normalisers():
    frame = make_frame(3)
    frame["processing"]["config"] = {"batch_num_tokens": 100, "global_batch_size": 12}
    shards, _ = shard_rows(frame, 3)
    assert {s["processing"]["config"]["batch_num_tokens"] for s in shards} == {100}
    assert {s["processing"]["config"]["global_batch_size"] for s in shards} == {12}


def test_shard_rows_pads_a_rank_without_rows_with_a_zero_weight_row():
    frame = make_frame(1)
    shards, real_rows = shard_rows(frame, 2)
    assert real_rows == [0, 1]
    assert shards[0]["kwargs"]["input_ids"].shape[0] == 1
    assert float(shards[0]["context"]["loss_mask"].sum()) == 0.0
    assert float(shards[0]["context"]["advantages"].abs().sum()) == 0.0


def test_combine_fwd_bwd_sums_losses_and_token_weights_metrics():
    results = [
        {"loss": 0.25, "metrics": {"loss": 0.25, "entropy": 1.0}, "num_tokens": 1},
        {"loss": 0.5, "metrics": {"loss": 0.5, "entropy": 4.0}, "num_tokens": 3},
    ]
    combined = combine_fwd_bwd(results, [1, 3])
    assert combined["loss"] == pytest.approx(0.75)
    assert combined["metrics"]["entropy"] == pytest.approx((1.0 * 1 + 4.0 * 3) / 4)  # not (1 + 4) / 2
    assert combined["num_tokens"] == 4


def test_concat_forward_drops_padding_rows():
    parts = [{"logprobs": torch.zeros(1, 3)}, {"logprobs": torch.ones(2, 3)}]
    joined = concat_forward(parts, [0, 2])
    assert torch.equal(joined["logprobs"], torch.ones(2, 3))


def test_plan_buckets_caps_bytes_and_splits_dtypes():
    named = [
        ("a", torch.zeros(10)),
        ("b", torch.zeros(10)),
        ("c", torch.zeros(30)),
        ("d", torch.zeros(4, dtype=torch.float16)),
    ]
    buckets = plan_buckets(weight_layout(named), bucket_bytes=80)
    assert [[e.name for e in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]


def test_weight_broadcast_copies_every_tensor_in_place_with_the_version():
    torch.manual_seed(0)
    source = {"w1": torch.randn(7, 5), "w2": torch.randn(33), "w3": torch.randn(2, 2, dtype=torch.float64)}
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    pointers = {name: t.data_ptr() for name, t in target.items()}
    layout = weight_layout(source.items())
    port = free_port()
    outcome: dict[str, object] = {}

    def load(views, *, policy_version):
        for name, view in views:
            target[name].copy_(view)
        return 0

    def receiver():
        link = WeightBroadcast("127.0.0.1", port, 1, 2)
        outcome["received"] = link.receive(layout, load, bucket_bytes=64)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightBroadcast("127.0.0.1", port, 0, 2)
    sent = sender.send(source.items(), 9, bucket_bytes=64)
    thread.join(timeout=60)
    received_bytes, version = outcome["received"]
    assert version == 9 and sent == received_bytes == sum(t.numel() * t.element_size() for t in source.values())
    for name, tensor in source.items():
        assert torch.equal(target[name], tensor)
        assert target[name].data_ptr() == pointers[name]


def _dp_rank(rank: int, port: int, model_dir: str, out_dir: str, fsdp: bool) -> None:
    import torch.distributed as dist

    from icefloe.engines.distributed import DataParallelTrainingEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        config = ClientConfig.build(model=model_dir, max_seq_len=48, training={"optimizer": {"lr": 1e-3}})
        # 64-byte buckets: the gradient all-reduce runs in many buckets, planned as the weight broadcast's are.
        engine = DataParallelTrainingEngine(config, model_dir=Path(model_dir), fsdp=fsdp, bucket_bytes=64)
        result = engine.fwd_bwd(shard_rows(make_frame(5), 2)[0][rank])
        step = engine.step()
        saved = engine.save_checkpoint(Path(out_dir) / "dp", "resumable")
        engine.fwd_bwd(shard_rows(make_frame(5, seed=9), 2)[0][rank])
        second = engine.step()
        loaded = engine.load_checkpoint(saved["path"])
        engine.fwd_bwd(shard_rows(make_frame(5, seed=9), 2)[0][rank])
        replayed = engine.step()
        weights = {name: t.clone() for name, t in engine.named_weights()}
        outcome = {"result": result, "step": step, "second": second, "replayed": replayed, "loaded": loaded}
        torch.save({**outcome, "saved": saved, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_data_parallel_trains_like_one_engine_and_checkpoints_in_its_format(model_dir, tmp_path, fsdp):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    mp.start_processes(
        _dp_rank, args=(free_port(), str(model_dir), str(tmp_path), fsdp), nprocs=2, join=True, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]

    torch.set_num_threads(1)
    config = ClientConfig.build(model=str(model_dir), max_seq_len=48, training={"optimizer": {"lr": 1e-3}})
    single = TrainingEngine(config, model_dir=model_dir)
    expected = single.fwd_bwd(make_frame(5))
    expected_step = single.step()
    combined = combine_fwd_bwd([r["result"] for r in ranks], [2, 3])
    assert combined["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert ranks[0]["step"]["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-5)

    # Every rank reports the folder rank 0 wrote, and it holds the files one engine writes, alike.
    dp_dir = Path(ranks[0]["saved"]["path"])
    assert ranks[1]["saved"] == ranks[0]["saved"] == {
        "checkpoint_id": "global_step1", "global_step": 1, "path": str(dp_dir), "kind": "resumable"
    }  # fmt: skip
    single_dir = Path(single.save_checkpoint(tmp_path / "single", "resumable")["path"])
    assert sorted(p.name for p in dp_dir.iterdir()) == sorted(p.name for p in single_dir.iterdir())
    # The recorded loss is the whole batch's, as the caller was told, not rank 0's share of it.
    avg_loss = [json.loads((d / "trainer_state.json").read_text())["avg_loss"] for d in (dp_dir, single_dir)]
    assert avg_loss[0] == pytest.approx(avg_loss[1], abs=1e-5)
    for file in ("model.safetensors", "optimizer.safetensors"):
        ours, theirs = load_file(str(dp_dir / file)), load_file(str(single_dir / file))
        assert sorted(ours) == sorted(theirs)
        for name, tensor in theirs.items():
            torch.testing.assert_close(ours[name], tensor, atol=1e-5, rtol=0, msg=f"{file}: {name}")

    # Reloading the checkpoint restores weights and AdamW moments: step 2 replays exactly.
    for rank in ranks:
        assert rank["loaded"]["global_step"] == 1
        assert rank["replayed"]["global_step"] == 2
        assert rank["replayed"]["grad_norm"] == pytest.approx(rank["second"]["grad_norm"], rel=1e-6)
    for name, tensor in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[1]["weights"][name], tensor, atol=0, rtol=0)

    # One engine resumes from the data-parallel checkpoint and takes the same second step.
    resumed = TrainingEngine(config, model_dir=model_dir)
    assert resumed.load_checkpoint(dp_dir)["global_step"] == 1
    resumed.fwd_bwd(make_frame(5, seed=9))
    assert resumed.step()["grad_norm"] == pytest.approx(ranks[0]["second"]["grad_norm"], rel=1e-4)
    for name, tensor in resumed.named_weights():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, atol=1e-5, rtol=0)


def _fsdp_micro_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from icefloe.engines.distributed import DataParallelTrainingEngine
    from icefloe.protocol import InvalidRequestError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # 8 positions per pass: about one row per pass, so the ranks plan different numbers of passes.
        training = {"optimizer": {"lr": 1e-3}, "micro_batch_tokens": 8}
        config = ClientConfig.build(model=model_dir, max_seq_len=48, training=training)
        engine = DataParallelTrainingEngine(config, model_dir=Path(model_dir), fsdp=True)
        shards, _ = shard_rows(make_frame(7), 2)
        passes = len(engine._plan(shards[rank])[1])
        result = engine.fwd_bwd(shards[rank])
        step = engine.step()
        forward = engine.forward(shards[rank])
        too_long = build_batch([[1]] * 3, [[2] * 3, [2] * 3, [2] * 12], None, pad_id=0, loss_fn="cross_entropy")
        too_long_shards, _ = shard_rows(validate_batch(too_long), 2)  # the 13-token row goes to rank 1
        try:
            engine.fwd_bwd(too_long_shards[rank])
            refusal = ""
        except InvalidRequestError as exc:
            refusal = str(exc)
        weights = {name: t.clone() for name, t in engine.named_weights()}
        outcome = {"result": result, "step": step, "forward": forward, "refusal": refusal, "passes": passes}
        torch.save({**outcome, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_with_micro_batches_trains_like_one_engine(model_dir, tmp_path):
    """FSDP used to refuse micro-batches: sharded ranks must run the same number of passes."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _fsdp_micro_rank, args=(free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert ranks[0]["passes"] == ranks[1]["passes"] > 2  # the rank with fewer rows ran idle passes

    torch.set_num_threads(1)
    config = ClientConfig.build(model=str(model_dir), max_seq_len=48, training={"optimizer": {"lr": 1e-3}})
    single = TrainingEngine(config, model_dir=model_dir)
    expected = single.fwd_bwd(make_frame(7))
    expected_step = single.step()
    expected_forward = single.forward(make_frame(7))
    combined = combine_fwd_bwd([r["result"] for r in ranks], [3, 4])
    assert combined["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert ranks[0]["step"]["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-5)
    for name, tensor in single.named_weights():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)
    joined = concat_forward([r["forward"] for r in ranks], [3, 4])
    torch.testing.assert_close(joined["logprobs"], expected_forward["logprobs"], atol=1e-5, rtol=1e-5)
    # A row over the budget on rank 1 fails both ranks: neither waits forever in a collective.
    assert ranks[1]["refusal"].startswith("row 1 has 13 tokens, more than the micro-batch budget of 8")
    assert ranks[0]["refusal"] == "another data-parallel rank refused its share of the batch; see its error"
