"""Run stock verl 0.9.x (PyPI) with icefloe: ``python -m icefloe.integrations.verl.launch [overrides]``.

Same Hydra overrides as ``python -m verl.trainer.main_ppo``; this adds the ones icefloe needs when
they are absent (the config search path, ``+remote_backend=icefloe``, the trainer mode and the
rollout name) and runs verl's ``run_ppo`` with a TaskRunner that registers icefloe's trainer
mode inside the TaskRunner's own process.
"""

from __future__ import annotations

import sys

from icefloe.integrations.verl import NAME, config_dir

__all__ = ["main", "with_icefloe_overrides"]


def with_icefloe_overrides(argv: list[str]) -> list[str]:
    """``argv`` plus every override icefloe needs that the caller did not give."""
    keys = {arg.split("=", 1)[0].lstrip("+~") for arg in argv}
    needed = {
        "hydra.searchpath": f"hydra.searchpath=[file://{config_dir()}]",
        "remote_backend": f"+remote_backend={NAME}",
        "trainer.use_v1": "trainer.use_v1=true",
        "trainer.v1.trainer_mode": f"trainer.v1.trainer_mode={NAME}",
        "actor_rollout_ref.rollout.name": f"actor_rollout_ref.rollout.name={NAME}",
        # One forwarder and one replica: icefloe owns parallelism, verl's GPU worlds do not apply.
        "actor_rollout_ref.rollout.tensor_model_parallel_size": (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
        ),
        "trainer.n_gpus_per_node": "trainer.n_gpus_per_node=1",
        "trainer.nnodes": "trainer.nnodes=1",
    }
    return [*argv, *(override for key, override in needed.items() if key not in keys)]


def task_runner_class() -> type:
    """verl's V1 TaskRunner, registering the ``icefloe`` trainer mode in its actor process first."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    class IcefloeTaskRunner(TaskRunnerV1.__ray_actor_class__):  # type: ignore[name-defined,misc]
        def run(self, config):
            import icefloe.integrations.verl.stock  # noqa: F401 - registers the trainer mode here

            return super().run(config)

    return ray.remote(num_cpus=1)(IcefloeTaskRunner)


def main() -> None:
    import hydra
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    @hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
    def run(config) -> None:
        auto_set_device(config)
        uses_reference, uses_critic = need_reference_policy(config), need_critic(config)
        validate_config(config, use_reference_policy=uses_reference, use_critic=uses_critic)
        run_ppo(config, task_runner_class=task_runner_class())

    sys.argv = [sys.argv[0], *with_icefloe_overrides(sys.argv[1:])]
    run()


if __name__ == "__main__":
    main()
