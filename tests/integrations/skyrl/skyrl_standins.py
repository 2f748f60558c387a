"""Stand-ins for the SkyRL modules the integration touches (SkyRL needs Python 3.12 and is not installed).

Each mirrors the SkyRL name, signature and data layout the integration relies on, checked against
SkyRL's source (``skyrl/train/{config/config,trainer,entrypoints/main_base,utils/utils}.py``,
``skyrl/train/generators/base.py``, ``skyrl/backends/skyrl_train/training_batch.py``):

- the dataclass config and its parser, which recognises nested sections only through ``typing.Union``;
- ``RayPPOTrainer`` with SkyRL's left-padded ``[PAD | prompt | response]`` batch layout, right-aligned
  ``[B, A]`` response tensors, GRPO advantages, and one step of ``train()`` in SkyRL's call order;
- ``peer_access_supported``, whose real probe hangs a CPU-only driver (here it fails loudly instead).
"""

# No `from __future__ import annotations`: like SkyRL, field types must be real objects for the parser.

import dataclasses
import sys
import types
import typing
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from omegaconf import OmegaConf

MODULES = (
    "skyrl",
    "skyrl.backends",
    "skyrl.backends.skyrl_train",
    "skyrl.backends.skyrl_train.training_batch",
    "skyrl.train",
    "skyrl.train.config",
    "skyrl.train.config.config",
    "skyrl.train.entrypoints",
    "skyrl.train.entrypoints.main_base",
    "skyrl.train.generators",
    "skyrl.train.generators.base",
    "skyrl.train.trainer",
    "skyrl.train.utils",
    "skyrl.train.utils.utils",
)


# --- skyrl.backends.skyrl_train.training_batch ---------------------------------------------------
class TensorBatch(dict):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metadata: dict[str, Any] = {}


class TrainingInputBatch(TensorBatch):
    pass


class TrainingOutputBatch(TensorBatch):
    pass


# --- skyrl.train.config.config -------------------------------------------------------------------
@dataclass
class BaseConfig(ABC):  # noqa: B024 - SkyRL's base is an ABC without abstract methods
    pass


@dataclass
class SkyRLLoraConfig(BaseConfig):
    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    lora_sync_path: str = "/tmp/skyrl_lora_sync"
    target_modules: str = "all-linear"
    exclude_modules: Optional[str] = None  # noqa: UP045
    init_method: str = "kaiming"
    max_loras: int = 1


@dataclass
class ModelConfig(BaseConfig):
    path: Optional[str] = None  # noqa: UP045
    lora: SkyRLLoraConfig = field(default_factory=SkyRLLoraConfig)


@dataclass
class OptimizerConfig(BaseConfig):
    lr: float = 1e-6
    adam_betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0


@dataclass
class PolicyConfig(BaseConfig):
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="tiny:arith"))
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class CriticConfig(BaseConfig):
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class PlacementConfig(BaseConfig):
    colocate_all: bool = False
    policy_num_nodes: int = 1
    policy_num_gpus_per_node: int = 1


@dataclass
class AlgorithmConfig(BaseConfig):
    advantage_estimator: str = "grpo"
    kl_estimator_type: str = "k3"
    use_kl_in_reward: bool = False
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    use_entropy_loss: bool = False
    entropy_loss_coef: float = 0.01
    temperature: Optional[float] = None  # noqa: UP045
    policy_loss_type: str = "regular"
    loss_reduction: str = "token_mean"
    grpo_norm_by_std: bool = True
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    max_seq_len: Optional[int] = None  # noqa: UP045 - seq_mean_token_sum_norm's divisor; SkyRL requires it there


@dataclass
class TrainerConfig(BaseConfig):
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    seed: int = 42
    ckpt_path: str = "/tmp/skyrl-ckpt"
    export_path: str = "/tmp/skyrl-export"
    max_prompt_length: int = 512
    train_batch_size: int = 1024
    policy_mini_batch_size: int = 256
    update_epochs_per_batch: int = 1
    override_entrypoint: Optional[str] = None  # noqa: UP045


@dataclass
class SamplingParams(BaseConfig):
    max_generate_length: int = 1024
    temperature: float = 1.0


def _inference_engine_fields(legacy: bool) -> list[tuple[str, Any, Any]]:
    fields = [
        ("run_engines_locally", bool, field(default=True)),
        ("num_engines", int, field(default=1)),
        ("tensor_parallel_size", int, field(default=1)),
        ("external_proxy_url", Optional[str], field(default=None)),  # noqa: UP045
        ("external_server_urls", Optional[list], field(default=None)),  # noqa: UP045
    ]
    if legacy:  # SkyRL generations before the legacy inference path was removed
        fields.append(("remote_urls", list, field(default_factory=list)))
    return fields


@dataclass
class DataConfig(BaseConfig):
    train_data: list = field(default_factory=lambda: ["~/data/gsm8k/train.parquet"])


def _nested_class(annotation: Any) -> type | None:
    if typing.get_origin(annotation) is Union:
        found = [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None


def build_nested_dataclass(cls: type, values: dict) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"Invalid fields {unknown} for {cls.__name__}")
    kwargs = {}
    for name, value in values.items():
        nested = _nested_class(known[name].type)
        kwargs[name] = build_nested_dataclass(nested, value) if nested and isinstance(value, dict) else value
    return cls(**kwargs)


def config_classes(*, legacy: bool) -> dict[str, Any]:
    """The config classes of one SkyRL generation (with or without ``remote_urls``)."""
    engines = dataclasses.make_dataclass("InferenceEngineConfig", _inference_engine_fields(legacy), bases=(BaseConfig,))
    generator = dataclasses.make_dataclass(
        "GeneratorConfig",
        [
            ("inference_engine", engines, field(default_factory=engines)),
            ("sampling_params", SamplingParams, field(default_factory=SamplingParams)),
            ("n_samples_per_prompt", int, field(default=5)),
            ("max_turns", int, field(default=1)),
        ],
        bases=(BaseConfig,),
    )

    def from_cli_overrides(cls: type, args: list[str]) -> Any:
        if not legacy and any(arg.startswith("generator.inference_engine.remote_urls") for arg in args):
            raise ValueError("`remote_urls` is no longer supported, use external_server_urls")
        raw = OmegaConf.to_container(OmegaConf.from_cli(list(args)), resolve=True)
        return build_nested_dataclass(cls, raw)

    config = dataclasses.make_dataclass(
        "SkyRLTrainConfig",
        [
            ("trainer", TrainerConfig, field(default_factory=TrainerConfig)),
            ("generator", generator, field(default_factory=generator)),
            ("data", DataConfig, field(default_factory=DataConfig)),
        ],
        bases=(BaseConfig,),
        namespace={"from_cli_overrides": classmethod(from_cli_overrides)},
    )

    def make_config(algorithm_cls: Any = None, trainer_cls: Any = None, generator_cls: Any = None) -> type:
        trainer = trainer_cls or TrainerConfig
        return dataclasses.make_dataclass(
            "_CustomConfig", [("trainer", trainer, field(default_factory=trainer))], bases=(config,)
        )

    return {
        "InferenceEngineConfig": engines,
        "GeneratorConfig": generator,
        "SkyRLTrainConfig": config,
        "make_config": make_config,
    }


# --- skyrl.train.utils(.utils) -------------------------------------------------------------------
def peer_access_supported(max_num_gpus_per_node: int) -> bool:
    raise AssertionError("SkyRL's GPU peer-access probe ran; on a CPU-only driver it would hang here")


def prepare_runtime_environment(cfg: Any) -> dict[str, str]:
    env: dict[str, str] = {}
    if cfg.trainer.placement.policy_num_gpus_per_node > 1:
        current = sys.modules["skyrl.train.utils.utils"].peer_access_supported
        if not current(max_num_gpus_per_node=cfg.trainer.placement.policy_num_gpus_per_node):
            env["NCCL_P2P_DISABLE"] = "1"
    return env


def validate_cfg(cfg: Any) -> None:
    engines = cfg.generator.inference_engine
    has_legacy = "remote_urls" in {f.name for f in dataclasses.fields(type(engines))}
    if not engines.run_engines_locally:
        if has_legacy:
            assert engines.num_engines == len(engines.remote_urls), (
                "num_engines should be equal to the number of remote_urls"
            )
        elif engines.external_proxy_url is None and engines.external_server_urls is None:
            raise ValueError("run_engines_locally=false requires external_proxy_url or external_server_urls")


# --- skyrl.train.generators.base -----------------------------------------------------------------
class GeneratorInterface(ABC):
    @abstractmethod
    async def generate(self, input_batch: dict) -> dict:
        raise NotImplementedError


# --- skyrl.train.trainer -------------------------------------------------------------------------
def convert_prompts_responses_to_batch_tensors(
    pad_token_id: int, prompts: list[list[int]], responses: list[list[int]], rewards: list[float]
) -> tuple[torch.Tensor, ...]:
    """SkyRL's layout: one left-padded block per row; response tensors right-aligned in [B, A]."""
    num_rows = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    response_width = max(len(r) for r in responses)
    sequences_BS = torch.full((num_rows, width), pad_token_id, dtype=torch.int64)
    attention_mask_BS = torch.zeros((num_rows, width), dtype=torch.int64)
    response_mask_BA = torch.zeros((num_rows, response_width), dtype=torch.int64)
    rewards_BA = torch.zeros((num_rows, response_width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        total = len(prompt) + len(response)
        sequences_BS[row, width - total :] = torch.tensor([*prompt, *response])
        attention_mask_BS[row, width - total :] = 1
        response_mask_BA[row, response_width - len(response) :] = 1
        rewards_BA[row, -1] = float(rewards[row])  # outcome reward on the last token
    return sequences_BS, attention_mask_BS, response_mask_BA, rewards_BA, response_mask_BA.to(torch.float32)


class RayPPOTrainer:
    def __init__(
        self,
        cfg: Any,
        tracker: Any,
        tokenizer: Any,
        train_dataset: Any,
        inference_engine_client: Any,
        generator: Any,
        colocate_pg: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        self.cfg = cfg
        self.colocate_all = cfg.trainer.placement.colocate_all
        self.tracker = tracker
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.inference_engine_client = inference_engine_client
        self.generator = generator
        self.colocate_pg = colocate_pg
        self.all_metrics: dict[str, Any] = {}
        self.global_step = 0
        self.policy_model = self.critic_model = self.ref_model = self.dispatch = None

    def convert_to_training_input(self, generator_output: dict, uids: list[str]) -> TrainingInputBatch:
        sequences, attention_mask, response_mask, rewards, loss_mask = convert_prompts_responses_to_batch_tensors(
            self.tokenizer.pad_token_id,
            generator_output["prompt_token_ids"],
            generator_output["response_ids"],
            generator_output["rewards"],
        )
        batch = TrainingInputBatch(
            sequences=sequences,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rewards=rewards,
            loss_mask=loss_mask,
        )
        batch.metadata = {"uids": uids, "response_length": response_mask.shape[1]}
        return batch

    def compute_advantages_and_returns(self, data: TrainingInputBatch) -> TrainingInputBatch:
        """GRPO: each row's outcome reward, centred (and std-scaled) within its prompt group."""
        scores_B = data["rewards"].sum(dim=-1)
        groups: dict[str, list[int]] = defaultdict(list)
        for row, uid in enumerate(data.metadata["uids"]):
            groups[uid].append(row)
        advantages_B = torch.zeros_like(scores_B)
        for rows in groups.values():
            group = scores_B[rows]
            centred = group - group.mean()
            if self.cfg.trainer.algorithm.grpo_norm_by_std and len(rows) > 1:
                centred = centred / (group.std() + 1e-6)
            advantages_B[rows] = centred
        data["advantages"] = advantages_B[:, None] * data["response_mask"]
        data["returns"] = data["advantages"]
        return data

    async def train_one_step(self, generator_input: dict, uids: list[str]) -> dict[str, Any]:
        """One iteration of SkyRL's ``train()`` loop, in its call order."""
        self.dispatch.init_weight_sync_state(self.inference_engine_client)
        await self.dispatch.save_weights_for_sampler()
        self.global_step += 1
        generator_output = await self.generator.generate(generator_input)
        if self.colocate_all:
            await self.inference_engine_client.sleep()
        training_input = self.convert_to_training_input(generator_output, uids)
        training_input = self.fwd_logprobs_values_reward(training_input)
        training_input = self.compute_advantages_and_returns(training_input)
        rewards = training_input.pop("rewards")
        training_input.metadata.pop("uids")
        status = self.train_critic_and_policy(training_input)
        await self.dispatch.save_weights_for_sampler()
        return {"generator_output": generator_output, "training_input": training_input, "rewards": rewards,
                "status": status}  # fmt: skip


# --- skyrl.train.entrypoints.main_base -----------------------------------------------------------
class BasePPOExp:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.tokenizer = None
        self.train_dataset = self.eval_dataset = self.colocate_pg = None

    def run(self) -> None:
        raise AssertionError("the stand-in experiment does not run a SkyRL training loop")


def main() -> None:
    argv = sys.argv[1:]
    override = next((a.split("=", 1)[1] for a in argv if a.startswith("trainer.override_entrypoint=")), None)
    if override:
        import importlib

        importlib.import_module(override).main()


def build_modules(*, legacy_inference: bool) -> dict[str, types.ModuleType]:
    """Fresh module objects for ``sys.modules``; ``legacy_inference`` adds ``remote_urls``."""
    modules = {name: types.ModuleType(name) for name in MODULES}
    for name in MODULES:
        parent, _, child = name.rpartition(".")
        modules[name].__path__ = []  # every stand-in is importable as a package
        if parent:
            setattr(modules[parent], child, modules[name])
    config_names = (
        "AlgorithmConfig", "BaseConfig", "CriticConfig", "DataConfig", "ModelConfig", "OptimizerConfig",
        "PlacementConfig", "PolicyConfig", "SamplingParams", "SkyRLLoraConfig", "TrainerConfig",
    )  # fmt: skip
    namespace = {
        **{name: globals()[name] for name in config_names},
        **config_classes(legacy=legacy_inference),
    }
    for name, value in namespace.items():
        setattr(modules["skyrl.train.config.config"], name, value)
        setattr(modules["skyrl.train.config"], name, value)
    utils = modules["skyrl.train.utils.utils"]
    utils.peer_access_supported = peer_access_supported
    utils.prepare_runtime_environment = prepare_runtime_environment
    modules["skyrl.train.utils"].validate_cfg = validate_cfg
    modules["skyrl.train.generators.base"].GeneratorInterface = GeneratorInterface
    modules["skyrl.train.trainer"].RayPPOTrainer = RayPPOTrainer
    modules["skyrl.train.entrypoints.main_base"].BasePPOExp = BasePPOExp
    modules["skyrl.train.entrypoints.main_base"].main = main
    batch_module = modules["skyrl.backends.skyrl_train.training_batch"]
    batch_module.TrainingInputBatch = TrainingInputBatch
    batch_module.TrainingOutputBatch = TrainingOutputBatch
    return modules
