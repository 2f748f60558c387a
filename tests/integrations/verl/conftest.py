"""Fixtures: stand-in verl modules, a fresh import of the plugin per test, a verl-shaped config."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from . import verl_standins

_PLUGIN = "icefloe.integrations.verl"


def _purge() -> None:
    for name in [n for n in sys.modules if n == "verl" or n.startswith(("verl.", _PLUGIN))]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def load_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``load_plugin(v1=False, seam=True)`` installs stand-ins and imports the plugin afresh."""

    def load(**kwargs: Any) -> Any:
        _purge()
        for name, module in verl_standins.build(**kwargs).items():
            monkeypatch.setitem(sys.modules, name, module)
        return importlib.import_module(_PLUGIN)

    yield load
    _purge()


@pytest.fixture
def make_config() -> Callable[..., dict[str, Any]]:
    return verl_config


def verl_config(**overrides: Any) -> dict[str, Any]:
    """A verl config tree (as plain mappings) sized for the tiny model; ``overrides`` take dotted keys."""
    config: dict[str, Any] = {
        "data": {"max_prompt_length": 6, "max_response_length": 4, "train_batch_size": 2},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "trainer": {"total_training_steps": 10},
        "actor_rollout_ref": {
            "model": {"path": "tiny:arith"},
            "actor": {
                "ppo_mini_batch_size": 1,
                "ppo_epochs": 1,
                "use_kl_loss": False,
                "kl_loss_coef": 0.1,
                "kl_loss_type": "low_var_kl",
                "clip_ratio": 0.2,
                "loss_agg_mode": "token-mean",
                "entropy_coeff": 0.0,
                "policy_loss": {"loss_mode": "vanilla"},
                "optim": {"lr": 5e-3, "betas": [0.9, 0.999], "weight_decay": 0.0, "clip_grad": 1.0},
            },
            "rollout": {
                "n": 2,
                "temperature": 1.0,
                "multi_turn": {"enable": False},
                "free_cache_engine": True,
            },
        },
        "remote_backend": {"backend": "local", "local": {"device": "cpu"}, "sampling_gpus": 1},
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config
