"""The rollout replica verl builds for ``actor_rollout_ref.rollout.name=icefloe``, and its server actor.

The agent loop sends token ids; they go to icefloe as token ids (no decode / re-tokenise), so the
driver needs no vLLM. The replica owns no GPUs: it starts one Ray actor (:class:`IcefloeLLMServer`)
that re-attaches to the driver's backend through the reconnect handle.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from icefloe.integrations.verl.backend import IcefloeBackend
from icefloe.integrations.verl.sampling import to_sampling_params
from icefloe.integrations.verl.settings import select
from icefloe.protocol import ConfigError, InvalidRequestError

__all__ = ["IcefloeLLMServer", "IcefloeReplica"]

# Ray's default actor concurrency is 1000; the agent loop may have every sample of a step in flight.
_SERVER_CONCURRENCY = 4096


class IcefloeLLMServer:
    """Token-in, token-out generation against the shared icefloe backend (one Ray actor per replica)."""

    def __init__(self, main_config: Any, backend_handle: dict[str, Any], *, free_cache_engine: bool = True) -> None:
        self._backend = IcefloeBackend.from_config(main_config, handle=backend_handle)
        settings = self._backend.settings
        self._max_model_len = settings.max_prompt_length + settings.max_response_length
        self._default_max_tokens = settings.max_response_length
        self._free_cache_engine = free_cache_engine
        self.global_steps: int | None = None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        priority: int = 0,
    ) -> TokenOutput:
        """One sample; ``extra_fields["global_steps"]`` tags the policy that produced it."""
        if image_data or video_data:
            raise InvalidRequestError(f"request {request_id}: icefloe sampling takes text token ids only")
        prompt = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        params = to_sampling_params(
            sampling_params,
            prompt_length=len(prompt),
            default_max_tokens=self._default_max_tokens,
            max_model_len=self._max_model_len,
        )
        sample = await self._backend.generate(prompt, params)
        fields: dict[str, Any] = {
            "token_ids": list(sample["token_ids"]),
            "log_probs": list(sample["logprobs"]) if params.logprobs and sample.get("logprobs") else None,
            "stop_reason": "aborted" if sample.get("finish_reason") == "abort" else "completed",
        }
        if "extra_fields" in TokenOutput.model_fields:
            # set_global_steps (V1's fan-out after a weight sync) names the step; else the sampler's version.
            version = self.global_steps if self.global_steps is not None else sample.get("policy_version")
            fields["extra_fields"] = {"global_steps": version}
        return TokenOutput(**fields)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    async def wake_up(self) -> None:
        await self._backend.wake_inference()
        await self._backend.reset_prefix_cache()

    async def sleep(self) -> None:
        if self._free_cache_engine:
            await self._backend.sleep_inference()

    async def clear_kv_cache(self) -> None:
        await self._backend.reset_prefix_cache()

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None  # icefloe has no partial rollouts to save

    async def resume_generation(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        await self._backend.reset_prefix_cache()

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}  # requests finish on the backend

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def destroy(self) -> None:
        await self._backend.destroy()


class IcefloeReplica(RolloutReplica):
    """A replica with no GPUs of its own: one server actor over the shared backend.

    ``main_config`` / ``backend_handle`` arrive as constructor kwargs from the remote-backend
    trainers; when they do not (stock verl), ``init_hybrid`` asks the forwarder worker for them.
    """

    def __init__(
        self,
        replica_rank: int,
        config: Any,
        model_config: Any,
        gpus_per_node: int = 1,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
        *,
        main_config: Any = None,
        backend_handle: dict[str, Any] | None = None,
        **_ignored: Any,
    ) -> None:
        # RolloutReplica.__init__ is skipped: it sizes GPU worlds for an engine this replica does not run.
        self.replica_rank = replica_rank
        self.config = config
        self.model_config = model_config
        self.gpus_per_node = gpus_per_node
        self.world_size = self.nnodes = 1
        self.gpus_per_replica_node = 1
        self.is_reward_model = is_reward_model
        self.is_teacher_model = is_teacher_model
        self.name_suffix = f"_{name_suffix}" if name_suffix else ""
        self.rollout_mode: Any = None
        self.workers: list[Any] = []
        self.resource_pool = None
        self.bundle_indices: list[int] = []
        self.servers: list[Any] = []
        self._server_address: str | None = None
        self._server_handle: Any = None
        self.main_config = main_config
        self.backend_handle = backend_handle

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_hybrid(self, worker_group: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = list(worker_group.workers[:1])
        if self.backend_handle is None:
            self.backend_handle = worker_group.icefloe_backend_handle()[0]
        await self.launch_servers()

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Start the one server actor (CPU only) that re-attaches to the backend."""
        import ray

        if self.backend_handle is None:
            raise ConfigError(
                "the icefloe replica has no backend_handle; it is passed by the remote-backend trainer "
                "or fetched from the icefloe forwarder worker in init_hybrid"
            )
        server_class = ray.remote(IcefloeLLMServer)
        server = server_class.options(max_concurrency=_SERVER_CONCURRENCY, num_cpus=0.1).remote(
            self.main_config,
            self.backend_handle,
            free_cache_engine=bool(select(self.config, "free_cache_engine", True)),
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"icefloe-replica-{self.replica_rank}{self.name_suffix}"

    async def set_global_steps(self, global_steps: int) -> None:
        """Tag later samples with ``global_steps`` (V1's weight-sync fan-out calls this)."""
        for server in self.servers:
            await server.set_global_steps.remote(global_steps)
