"""The same call answers with the same error class and the same field types on the local and remote backends."""

from __future__ import annotations

import pytest
import torch

from icefloe.client import Client, build_batch
from icefloe.client.remote.admin import ServiceAdmin
from icefloe.config import ClientConfig
from icefloe.protocol import IcefloeError


def _local(tmp_path) -> ClientConfig:
    return ClientConfig.build(
        {"model": "tiny:arith", "seed": 0, "training": {"checkpoint_dir": str(tmp_path / "ckpt")}}
    )


def _no_advantages() -> dict:
    frame = build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)
    del frame["context"]["advantages"]  # grpo needs them: refused when the batch is checked
    return frame


def _bad_loss_mode() -> dict:
    # Refused only by the loss itself, while the op runs.
    return build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0, loss_config={"loss_agg_mode": "bogus"})


def cross_entropy_frame() -> dict:
    return build_batch([[3, 4, 5], [8, 9]], [[6, 7], [10, 11, 12]], pad_id=0, loss_fn="cross_entropy")


def sft_object() -> dict:
    """The training API's SFT object for :func:`cross_entropy_frame`: pre-shifted labels (-100 =
    ignored), no context, no processing."""
    frame = cross_entropy_frame()
    ids_BS = frame["kwargs"]["input_ids"]
    labels_BS = torch.where(frame["context"]["loss_mask"] > 0, ids_BS.roll(-1, dims=1), -100)
    return {"args": (), "kwargs": {**frame["kwargs"], "labels": labels_BS}}


BAD_CALLS = {
    "batch refused on arrival": lambda client: client.fwd_bwd(_no_advantages()),
    "batch refused while running": lambda client: client.fwd_bwd(_bad_loss_mode()),
    "unknown checkpoint": lambda client: client.load_checkpoint("global_step99"),
}


def _error(client: Client, call) -> IcefloeError:
    with pytest.raises(IcefloeError) as info:
        call(client)
    return info.value


def _types(record: dict) -> dict[str, type]:
    return {key: type(value) for key, value in record.items()}


def errors_loss_and_listing(client: Client) -> tuple[dict[str, type], float, list[dict]]:
    """The class of the error each bad call raises, the loss of one SFT batch, the checkpoint listing after its step."""
    errors = {what: type(_error(client, call)) for what, call in BAD_CALLS.items()}
    loss = client.fwd_bwd(sft_object())["loss"]
    client.step()
    client.save_checkpoint()
    return errors, loss, client.list_checkpoints()


def test_bad_requests_and_checkpoint_listings_have_one_type_on_every_backend(service, tmp_path):
    with Client(_local(tmp_path)) as local, Client(service.config()) as remote:
        local_errors, local_loss, local_listed = errors_loss_and_listing(local)
        remote_errors, remote_loss, remote_listed = errors_loss_and_listing(remote)
    assert remote_errors == local_errors
    assert remote_loss == pytest.approx(local_loss)  # the SFT object trains alike
    assert len(local_listed) == len(remote_listed) == 1
    shared = set(local_listed[0]) & set(remote_listed[0])
    assert {"checkpoint_id", "global_step", "created_at", "kind"} <= shared
    assert _types({k: remote_listed[0][k] for k in shared}) == _types({k: local_listed[0][k] for k in shared})
    assert local_listed[0]["created_at"].endswith("Z"), "ISO-8601 UTC text, as the training API writes it"


def test_reading_a_running_jobs_log_without_follow_ends_at_its_current_end(service):
    with Client(service.config()) as client, ServiceAdmin(service.config().backend) as admin:
        client.open()  # the job is running
        job_id = client.handle()["transport"]["job_id"]
        entries = list(admin.read_logs(job_id, follow=False))
        assert any("job is running" in entry["msg"] for entry in entries)
        assert admin.get_job(job_id)["status"] == "running"


def test_following_a_log_ends_once_the_job_has_ended(service):
    client = Client(service.config()).open()
    with ServiceAdmin(service.config().backend) as admin:
        job_id = client.handle()["transport"]["job_id"]
        client.shutdown()  # cancels the job: the log ends with its last state
        messages = [entry["msg"] for entry in admin.read_logs(job_id, follow=True, max_wait_s=0.2)]
        assert admin.get_job(job_id)["status"] in ("cancelled", "terminated")
    assert "job is running" in messages and messages[-1].startswith("job is ")


def test_every_op_answers_the_same_keys_on_the_local_and_remote_backends(service, tmp_path):
    """The README's "same shapes": remote results carried the service's own keys (a sync said
    weight_format 'vllm' with a torch sampler; a step global_steps and last_lr; a save checkpoint_tag)."""

    def shapes(client: Client) -> dict[str, list[str]]:
        batch = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0)
        return {
            "fwd_bwd": sorted(client.fwd_bwd(batch)),
            "step": sorted(client.step()),
            "sync_weights": sorted(client.sync_weights()),
            "generate": sorted(client.generate([[3, 4]], {"max_tokens": 2, "logprobs": True})[0]),
            "save_checkpoint": sorted(client.save_checkpoint()),
            "load_checkpoint": sorted(client.load_checkpoint("global_step1")),
        }

    with Client(_local(tmp_path)) as local, Client(service.config()) as remote:
        assert shapes(remote) == shapes(local)
