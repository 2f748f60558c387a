"""The Ray backend: training ranks, samplers and reference replicas as named Ray actors.

Op routing, generate coalescing, per-role ordering and checkpoint listing are the local
transport's (this class extends it): each role still has one driver-side ordered worker, and the
engines it drives are actor groups instead of in-process engines. Weight sync is a
torch.distributed broadcast from trainer rank 0 to every sampler on a group of its own, split over
the two roles' workers so it runs after earlier training work and before later sampling work.

Re-attach: actors are named ``{job}-{role}-{index}`` in ``backend.namespace``; ``handle_info``
carries those names plus the cluster address, and another process (or actor) attaches by name.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

import ray

from icefloe.client.transports.roles import RoleTransport
from icefloe.config import ClientConfig, RayConfig
from icefloe.engines.ray import groups, placement
from icefloe.protocol import (
    ConfigError,
    InvalidRequestError,
    JobFailedError,
)

__all__ = ["RayTransport"]

_PEER_ERROR_WAIT_S = 30.0  # how long a failed send waits to learn whether a dead sampler caused it


class RayTransport(RoleTransport):
    """Engines in Ray actors; the owner creates them, a transport built from a handle attaches to them."""

    def __init__(self, config: ClientConfig, handle: dict[str, Any] | None = None) -> None:
        if not isinstance(config.backend, RayConfig):
            raise ConfigError(f"RayTransport needs backend.type='ray'; got {config.backend.type!r}")
        session = (handle or {}).get("session") or uuid.uuid4().hex[:12]
        ray_config: RayConfig = config.backend
        job_name = (handle or {}).get("job_name") or ray_config.job_name or f"icefloe-{session}"
        root = (handle or {}).get("checkpoint_root")
        super().__init__(
            config, session=session, checkpoint_root=Path(root) if root else config.training.checkpoint_root(job_name)
        )
        self.ray_config = ray_config
        self.job_name = job_name
        self._attach = dict(handle) if handle is not None else None
        self._sync_order = threading.Lock()
        self._owner = False
        self._started_ray = False
        self._placement = None
        self._link: str | None = (handle or {}).get("weight_link")
        self.model_dir: Path | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._connect()
        try:
            if self._attach is not None:
                self._attach_actors(self._attach)
            else:
                self._launch()
        except BaseException:  # close() then has nothing to stop: leave no local Ray of ours running
            if self._started_ray:
                ray.shutdown()
            raise

    def _connect(self) -> None:
        """Join the cluster the handle or config names, or start a local Ray when there is none."""
        if ray.is_initialized():
            return
        address = (self._attach or {}).get("address") or self.ray_config.address
        ray.init(address=address, namespace=self.ray_config.namespace, include_dashboard=False)
        self._started_ray = True

    def _launch(self) -> None:
        """Reserve a placement group, start every actor, wire the weight-sync group."""
        from icefloe.engines.models import resolve_model

        config = self.config
        counts = {
            "training": config.num_training_workers,
            "sampling": config.num_sampling_workers,
            "reference": config.num_log_prob_workers if config.lora is None else 0,  # LoRA: trainers score it
        }
        for role, count in counts.items():
            for index in range(count):
                if _actor_exists(f"{self.job_name}-{role}-{index}", self.ray_config.namespace):
                    raise ConfigError(
                        f"Ray actors of job {self.job_name!r} already exist in namespace "
                        f"{self.ray_config.namespace!r}; re-attach with Client.from_handle(...) or choose another "
                        "backend.job_name"
                    )
        self.model_dir = resolve_model(config.model, seed=config.seed)
        bundles, specs = placement.plan_placement(self.job_name, counts, self.ray_config)
        self._owner = True
        self._placement = placement.create_placement_group(
            self.job_name, bundles, self.ray_config, config.job_ready_timeout_s
        )
        by_role = {role: [s for s in specs if s.role == role] for role in counts}

        def create(group_class: type[groups.ActorGroup], role: str) -> Any:
            if not by_role[role]:
                return None
            return group_class.create(self.job_name, config, by_role[role], self._placement, self.model_dir)

        try:
            self.training = create(groups.TrainerGroup, "training")
            self.sampling = create(groups.SamplerGroup, "sampling")
            self.reference = create(groups.TrainerGroup, "reference")
            starts = [call for group in self._groups() for call in group.start_calls()]
            groups.gather(self.job_name, starts, config.job_ready_timeout_s)
            if self.sampling is not None:
                backend = placement.collective_backend(self.ray_config)
                self._link = groups.link_weight_sync(self.training, self.sampling, backend)
                self.training.weight_layout()  # fetched now: never behind a send on trainer rank 0
        except BaseException:
            self._release_actors()
            raise

    def _attach_actors(self, handle: dict[str, Any]) -> None:
        from icefloe.engines.models import resolve_model

        names, namespace, timeout = handle["actors"], handle["namespace"], self.config.job_ready_timeout_s
        self.training = groups.TrainerGroup.attach(self.job_name, "training", names["training"], namespace, timeout)
        if names.get("sampling"):
            self.sampling = groups.SamplerGroup.attach(self.job_name, "sampling", names["sampling"], namespace, timeout)
            self.training.weight_layout()
        if names.get("reference"):
            self.reference = groups.TrainerGroup.attach(
                self.job_name, "reference", names["reference"], namespace, timeout
            )
        self.model_dir = resolve_model(self.config.model, seed=self.config.seed)

    def _stop(self) -> None:
        if self._owner:
            self._release_actors()
        if self._started_ray:
            ray.shutdown()

    def _groups(self) -> list[Any]:
        return [group for group in (self.training, self.sampling, self.reference) if group is not None]

    def _release_actors(self) -> None:
        for group in self._groups():
            group.kill()
        if self._placement is not None:
            ray.util.remove_placement_group(self._placement)
            self._placement = None

    def handle_info(self) -> dict[str, Any]:
        def names(group: Any) -> list[str]:
            return list(group.names) if group is not None else []

        return {
            "backend": "ray",
            "session": self._session,
            "job_name": self.job_name,
            "namespace": self.ray_config.namespace,
            "address": ray.get_runtime_context().gcs_address if ray.is_initialized() else self.ray_config.address,
            "actors": {
                "training": names(self.training),
                "sampling": names(self.sampling),
                "reference": names(self.reference),
            },
            "weight_link": self._link,
            "checkpoint_root": str(self.checkpoint_root),
        }

    @property
    def tokenizer(self) -> Any:
        from icefloe.engines.models import load_tokenizer

        self.open()
        return load_tokenizer(self.model_dir)

    # --- delivery --------------------------------------------------------------------------------
    def _sync_weights(self, body: dict[str, Any]) -> Future:
        """Trainers send on the training worker while samplers receive on the sampling worker.

        The broadcast itself is the rendezvous: each side waits in it for the other, so the copy
        happens after earlier training work and before later sampling work, as in the local backend.
        """
        if self._link is None:
            raise InvalidRequestError("sync_weights needs a sampling role; set num_sampling_workers=1 in the config")
        from icefloe.engines.lora import check_weight_format

        check_weight_format(body.get("weight_format"), self.config.lora, self.config.lora)
        with self._sync_order:  # both halves of one sync enter their queues before another sync's halves
            if body.get("cuda_ipc") and self._cuda_ipc_possible():
                return self._sync_weights_cuda_ipc()
            return self._sync_weights_broadcast()

    def _sync_weights_broadcast(self) -> Future:
        trainers, samplers, link = self.training, self.sampling, self._link
        bucket_bytes = self.ray_config.sync_bucket_mb * 1024 * 1024
        layout = trainers.weight_layout()
        received = self._worker("sampling").submit(samplers.receive_weights, link, layout, bucket_bytes)

        def send() -> dict[str, Any]:
            try:
                sent = trainers.send_weights(link, bucket_bytes)
            except JobFailedError:
                # A dead sampler breaks the broadcast on the trainer's side too: name the sampler when it is the cause.
                with contextlib.suppress(FutureTimeoutError):
                    if isinstance(received.exception(timeout=_PEER_ERROR_WAIT_S), JobFailedError):
                        raise received.exception() from None
                raise
            received.result()  # a receive-side failure fails the op
            return sent

        return self._worker("training").submit(send)

    def _cuda_ipc_possible(self) -> bool:
        """Handles only open on the GPU that made them: one unsharded trainer colocated with the samplers."""
        return (
            self.ray_config.colocate
            and self.ray_config.num_gpus_per_worker > 0
            and self.config.num_training_workers == 1
            and not self.ray_config.fsdp
        )

    def _sync_weights_cuda_ipc(self) -> Future:
        """Share the trainer's CUDA weights with the colocated samplers by handle; no bytes move between processes."""
        trainers, samplers = self.training, self.sampling
        handles: Future = Future()

        def import_on_samplers() -> dict[str, Any]:
            return samplers.import_cuda_ipc(*handles.result())

        def export_from_trainer() -> dict[str, Any]:
            start = time.perf_counter()
            try:
                shared, version = trainers.export_cuda_ipc()
            except BaseException as exc:
                handles.set_exception(exc)
                raise
            handles.set_result((shared, version))
            try:
                imported.result()  # the samplers' failure is the op's failure
            finally:
                trainers.release_cuda_ipc()
            layout_bytes = sum(e.numel * e.torch_dtype.itemsize for e in trainers.weight_layout())
            return {"policy_version": version, "seconds": time.perf_counter() - start, "bytes": layout_bytes}

        imported = self._worker("sampling").submit(import_on_samplers)
        return self._worker("training").submit(export_from_trainer)


def _actor_exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
