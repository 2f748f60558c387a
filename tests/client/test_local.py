"""The embedded backend through the public client API: parity, ordering, lifecycle, re-attach."""

import asyncio

import pytest
import torch

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.config import ClientConfig
from icefloe.protocol import ClientClosedError, ConfigError, InvalidRequestError, NotFoundError

PROMPTS = ["12+7=", "3+4=", "25+17="]


def _config(tmp_path, **overrides) -> ClientConfig:
    data = {
        "model": "tiny:arith",
        "seed": 0,
        "training": {"optimizer": {"lr": 1e-2}, "checkpoint_dir": str(tmp_path / "ckpt")},
    }
    return ClientConfig.build(data, **overrides)


def _batch(tok, samples, prompts_P, group_size):
    prompt_ids_D = [tok(p)["input_ids"] for p in prompts_P for _ in range(group_size)]
    rewards_D = [float(len(s["token_ids"]) % 2) for s in samples]
    mean = sum(rewards_D) / len(rewards_D)
    return build_batch(
        prompt_ids_D, [s["token_ids"] for s in samples], [r - mean for r in rewards_D], pad_id=tok.pad_token_id
    )


def _sync_steps(client, num_steps=2):
    tok = client.tokenizer
    trace = []
    for _ in range(num_steps):
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        samples = client.generate(prompts, {"n": 2, "max_tokens": 4, "seed": 7})
        fb = client.fwd_bwd(_batch(tok, samples, PROMPTS, 2))
        st = client.step()
        client.sync_weights()
        trace.append(([s["token_ids"] for s in samples], fb["loss"], st["grad_norm"]))
    return trace


async def _async_steps(client, num_steps=2):
    tok = client.tokenizer
    trace = []
    for _ in range(num_steps):
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        samples = await client.generate(prompts, {"n": 2, "max_tokens": 4, "seed": 7})
        # Pipelined: both submitted before either is awaited; the training role runs them in order.
        fb, st = await asyncio.gather(client.fwd_bwd(_batch(tok, samples, PROMPTS, 2)), client.step())
        await client.sync_weights()
        trace.append(([s["token_ids"] for s in samples], fb["loss"], st["grad_norm"]))
    return trace


def test_sync_and_async_clients_give_identical_results(tmp_path):
    with Client(_config(tmp_path / "a")) as sync_client:
        sync_trace = _sync_steps(sync_client)

    async def run():
        async with AsyncClient(_config(tmp_path / "b")) as async_client:
            return await _async_steps(async_client)

    assert asyncio.run(run()) == sync_trace


def test_concurrent_generate_calls_coalesce_and_match_one_batched_call(tmp_path):
    async def run():
        async with AsyncClient(_config(tmp_path)) as client:
            tok = client.tokenizer
            prompts = [tok(p)["input_ids"] for p in PROMPTS * 4]
            params = {"max_tokens": 5, "seed": 3}
            single = await asyncio.gather(*(client.generate([p], params) for p in prompts))
            batched = await client.generate(prompts, params)
            return [s[0]["token_ids"] for s in single], [s["token_ids"] for s in batched]

    single, batched = asyncio.run(run())
    assert single == batched


def test_sampler_logprobs_equal_trainer_logprobs_after_sync(tmp_path):
    with Client(_config(tmp_path)) as client:
        tok = client.tokenizer
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        samples = client.generate(prompts, {"max_tokens": 4, "seed": 1})
        client.fwd_bwd(_batch(tok, samples, PROMPTS, 1))
        client.step()
        synced = client.sync_weights()
        assert synced["policy_version"] == 1 and synced["bytes"] > 0
        samples = client.generate(prompts, {"max_tokens": 4, "seed": 2, "logprobs": True})
        assert {s["policy_version"] for s in samples} == {1}
        batch = build_batch(prompts, [s["token_ids"] for s in samples], [0.0] * 3, pad_id=tok.pad_token_id)
        logprobs_BS = client.forward(batch)["logprobs"]
        mask_BS = batch["context"]["loss_mask"].bool()
        trainer = [logprobs_BS[row][mask_BS[row]] for row in range(len(samples))]
        for row, sample in enumerate(samples):
            torch.testing.assert_close(trainer[row], torch.tensor(sample["logprobs"]), atol=1e-5, rtol=1e-5)


def test_checkpoint_round_trip_through_the_client(tmp_path):
    with Client(_config(tmp_path)) as client:
        tok = client.tokenizer
        samples = client.generate([tok("1+1=")["input_ids"]], {"n": 2, "max_tokens": 3, "seed": 0})
        batch = _batch(tok, samples, ["1+1="], 2)
        client.fwd_bwd(batch)
        client.step()
        saved = client.save_checkpoint()
        assert saved["checkpoint_id"] == "global_step1" and saved["kind"] == "resumable"
        first = client.fwd_bwd(batch)["loss"]
        client.step()
        client.load_checkpoint("global_step1")
        assert client.fwd_bwd(batch)["loss"] == pytest.approx(first, abs=1e-6)
        listed = client.list_checkpoints()
        assert [c["checkpoint_id"] for c in listed] == ["global_step1"]
        files = {f["filename"] for f in client.get_checkpoint("global_step1")["files"]}
        assert {"model.safetensors", "config.json"} <= files
        client.delete_checkpoint("global_step1")
        assert client.list_checkpoints() == []
        with pytest.raises(NotFoundError, match="does not exist"):
            client.load_checkpoint("global_step1")


def test_ops_after_shutdown_raise_and_shutdown_is_idempotent(tmp_path):
    client = Client(_config(tmp_path)).open()
    client.shutdown()
    client.shutdown()
    with pytest.raises(ClientClosedError, match="shut down"):
        client.step()


def test_from_handle_reattaches_in_process_and_refuses_elsewhere(tmp_path):
    with Client(_config(tmp_path)) as owner:
        handle = owner.handle()
        twin = Client.from_handle(handle)
        batch = build_batch([[5, 6]], [[7]], [1.0], pad_id=0)
        twin.fwd_bwd(batch)
        assert twin.step()["global_step"] == 1
        owner.fwd_bwd(batch)
        assert owner.step()["global_step"] == 2, "the twin drove the same engines"
        twin.shutdown()
        owner.fwd_bwd(batch)
        assert owner.step()["global_step"] == 3, "closing a twin leaves the owner's engines running"
    with pytest.raises(ConfigError, match="inside one process"):
        Client.from_handle(handle).open()


def test_reference_forward_needs_a_reference_role(tmp_path):
    with Client(_config(tmp_path)) as client:
        batch = build_batch([[5, 6]], [[7]], [1.0], pad_id=0)
        with pytest.raises(InvalidRequestError, match="num_log_prob_workers"):
            client.forward(batch, reference=True)
    with Client(_config(tmp_path, num_log_prob_workers=1)) as client:
        policy = client.forward(batch)["logprobs"]
        client.fwd_bwd(batch)
        client.step()
        torch.testing.assert_close(client.forward(batch, reference=True)["logprobs"], policy)


def test_transport_handle_returns_futures_that_keep_each_roles_order_and_fail_after_close(tmp_path):
    from icefloe.client import ops
    from icefloe.client.transports.local import LocalTransport

    transport = LocalTransport(_config(tmp_path))
    transport.open()
    transport.open()  # idempotent
    batch = build_batch([[5, 6]], [[7]], [1.0], pad_id=0)
    pending = [transport.handle(op.request) for _ in range(3) for op in (ops.fwd_bwd(batch), ops.step())]
    assert [f.result(60)["global_step"] for f in pending[1::2]] == [1, 2, 3]
    assert transport.handle(ops.list_checkpoints().request).result(0) == {"checkpoints": []}
    transport.close()
    transport.close()  # idempotent
    with pytest.raises(ClientClosedError, match="shut down"):
        transport.handle(ops.step().request).result(0)
    with pytest.raises(ClientClosedError, match="was closed"):
        transport.open()


def test_a_learning_rate_that_is_not_finite_is_refused_and_the_weights_stay_finite(tmp_path):
    """inf passed a `> 0` check and turned every weight into NaN without an error."""
    from icefloe.client.transports.local import LocalTransport
    from icefloe.protocol import OP_STEP, TARGET_TRAINING, Request

    transport = LocalTransport(_config(tmp_path))
    with Client(_config(tmp_path), transport=transport) as client:
        batch = build_batch([[5, 6]], [[7]], [1.0], pad_id=0)
        client.fwd_bwd(batch)
        with pytest.raises(InvalidRequestError, match="learning_rate must be > 0 and finite"):
            client.step(learning_rate=float("inf"))
        for rate in (float("inf"), float("nan")):  # sent past the client's check, the engine refuses it too
            with pytest.raises(InvalidRequestError, match="learning_rate must be >= 0 and finite"):
                transport.handle(Request(OP_STEP, TARGET_TRAINING, {"learning_rate": rate})).result(60)
        assert client.step()["global_step"] == 1
        assert torch.isfinite(client.forward(batch)["logprobs"]).all()


def test_lora_reference_is_the_trainer_with_adapters_off_and_sync_takes_a_weight_format(tmp_path):
    config = _config(tmp_path, lora={"rank": 4, "alpha": 8}, num_log_prob_workers=0)
    with Client(config) as client:
        tok = client.tokenizer
        samples = client.generate([tok(p)["input_ids"] for p in PROMPTS], {"n": 2, "max_tokens": 4, "seed": 7})
        batch = _batch(tok, samples, PROMPTS, 2)
        base = client.forward(batch)["logprobs"]  # fresh adapters are a no-op: the policy is the base
        for _ in range(2):
            client.fwd_bwd(batch)
            client.step()
        reference = client.forward(batch, reference=True)["logprobs"]  # no reference role was built
        policy = client.forward(batch)["logprobs"]
        with pytest.raises(InvalidRequestError, match="moves full weights"):
            client.sync_weights(weight_format="hf")
        synced = client.sync_weights(weight_format="lora")
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-6)
    assert not torch.allclose(policy, base, atol=1e-3)
    assert synced["policy_version"] == 2


def sft_object(frame: dict) -> dict:
    """The training API's SFT forward-backward object (§3.1): pre-shifted labels, -100 ignored, no context."""
    ids_BS = frame["kwargs"]["input_ids"]
    labels_BS = torch.where(frame["context"]["loss_mask"] > 0, ids_BS.roll(-1, dims=1), -100)
    return {"args": (), "kwargs": {**frame["kwargs"], "labels": labels_BS}}


def test_sft_object_trains_with_cross_entropy_over_its_labels(tmp_path):
    frame = build_batch([[1, 11, 2, 13], [3, 12]], [[3, 1], [4, 13, 5]], pad_id=0, loss_fn="cross_entropy")
    with Client(_config(tmp_path)) as client:
        sft = client.fwd_bwd(sft_object(frame))
        same = client.fwd_bwd(frame)  # the same weights: nothing stepped in between
        assert sft["loss"] == pytest.approx(same["loss"]) and sft["num_tokens"] == same["num_tokens"] == 5
        client.step()
        assert client.fwd_bwd(sft_object(frame))["loss"] < sft["loss"]
