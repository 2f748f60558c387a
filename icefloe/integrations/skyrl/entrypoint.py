"""SkyRL's ``trainer.override_entrypoint`` target: parse, check, build the client, run the experiment.

``main`` parses SkyRL's config extended with ``trainer.icefloe``, refuses bad data and unsupported
settings before anything starts, builds and opens the icefloe client once, then runs
:class:`IcefloeSkyRLExp` in this process. Stock SkyRL moves its loop into a Ray task to keep GPU
work off the head node; here the loop only does CPU work (prompts, rewards, advantages) and every
heavy op is on the backend, so staying in the driver keeps one client and one set of engines.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Optional

from skyrl.train.entrypoints.main_base import BasePPOExp

from icefloe.client import Client
from icefloe.client.transports import probe_capabilities
from icefloe.integrations.skyrl import install_driver_shims
from icefloe.integrations.skyrl.config import IcefloeSection, client_config_from_skyrl, section_of
from icefloe.integrations.skyrl.generator import IcefloeGenerator
from icefloe.integrations.skyrl.launch import OVERRIDE_FLAG, prepare_argv, skyrl_has_remote_urls
from icefloe.integrations.skyrl.preflight import check_settings, check_train_data
from icefloe.integrations.skyrl.scoring import ScoringPool
from icefloe.integrations.skyrl.trainer import IcefloeInferenceEngineStub, IcefloePPOTrainer
from icefloe.protocol import OP_FORWARD

__all__ = ["IcefloeSkyRLExp", "main", "skyrl_config_class"]


def skyrl_config_class() -> type:
    """SkyRL's config class with ``trainer.icefloe`` added (SkyRL's parser rejects unknown fields)."""
    from skyrl.train.config.config import TrainerConfig, make_config

    trainer_cls = dataclasses.make_dataclass(
        "IcefloeTrainerConfig",
        # typing.Optional, not `X | None`: SkyRL's parser recognises nested sections by typing.Union.
        [("icefloe", Optional[IcefloeSection], dataclasses.field(default=None))],  # noqa: UP045
        bases=(TrainerConfig,),
    )
    return make_config(trainer_cls=trainer_cls)


class IcefloeSkyRLExp(BasePPOExp):
    """SkyRL's experiment with icefloe's generator and trainer; SkyRL's inference servers are never built."""

    def __init__(self, cfg: Any, *, client: Client) -> None:
        self.icefloe_client = client
        self.icefloe_generator: IcefloeGenerator | None = None
        super().__init__(cfg)

    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> IcefloeGenerator:
        section = section_of(cfg)
        sampling = cfg.generator.sampling_params
        self.icefloe_generator = IcefloeGenerator(
            self.icefloe_client,
            tokenizer,
            ScoringPool(section.scoring_workers, section.env_modules),
            default_sampling_params={
                "temperature": sampling.temperature,
                "max_tokens": sampling.max_generate_length,
            },
        )
        return self.icefloe_generator

    def get_trainer(
        self,
        cfg: Any,
        tracker: Any,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any,
        inference_engine_client: Any,
        generator: Any,
        colocate_pg: Any,
    ) -> IcefloePPOTrainer:
        return IcefloePPOTrainer(
            cfg=cfg,
            tracker=tracker,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client,
            generator=generator,
            colocate_pg=colocate_pg,
            icefloe_client=self.icefloe_client,
        )

    def _setup_trainer(self) -> IcefloePPOTrainer:
        os.makedirs(self.cfg.trainer.export_path, exist_ok=True)
        os.makedirs(self.cfg.trainer.ckpt_path, exist_ok=True)
        colocate = section_of(self.cfg).colocate
        engines = IcefloeInferenceEngineStub(self.icefloe_client, colocate=colocate)
        generator = self.get_generator(self.cfg, self.tokenizer, engines)
        trainer = self.get_trainer(
            cfg=self.cfg,
            tracker=self.get_tracker(),
            tokenizer=self.tokenizer,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            inference_engine_client=engines,
            generator=generator,
            colocate_pg=self.colocate_pg,
        )
        self.trainer = trainer
        trainer.build_models()
        # SkyRL sleeps the sampler after generating only when it believes training and sampling share GPUs.
        trainer.colocate_all = colocate
        return trainer

    def run(self) -> None:
        try:
            super().run()
        finally:
            if self.icefloe_generator is not None:
                self.icefloe_generator.close()


def main() -> None:
    """Entry for ``trainer.override_entrypoint=icefloe.integrations.skyrl.entrypoint``."""
    from skyrl.train.utils import validate_cfg

    install_driver_shims()
    argv = prepare_argv(sys.argv[1:], legacy_remote_urls=skyrl_has_remote_urls())
    argv = [arg for arg in argv if not arg.startswith(f"{OVERRIDE_FLAG}=")]
    cfg = skyrl_config_class().from_cli_overrides(argv)
    if cfg.trainer.icefloe is None:
        cfg.trainer.icefloe = IcefloeSection()
    validate_cfg(cfg)
    check_train_data(cfg.data.train_data)
    client_config = client_config_from_skyrl(cfg)
    # Asked before any job or engine exists, so a refused setting costs nothing.
    has_forward = OP_FORWARD in probe_capabilities(client_config)
    check_settings(cfg, has_forward=has_forward, backend=client_config.backend.type)
    client = Client(client_config).open()
    try:
        IcefloeSkyRLExp(cfg, client=client).run()
    finally:
        client.shutdown()
