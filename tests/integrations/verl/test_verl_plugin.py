"""Registration, V0/V1 detection and lazy loading of the verl plugin, against stand-in verl modules."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_register_populates_backend_worker_and_replica(load_plugin) -> None:
    plugin = load_plugin()
    from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    backend_cls = RemoteBackendRegistry.get("icefloe")
    assert RemoteBackendRegistry.list() == ["icefloe"]
    assert issubclass(backend_cls, RemoteBackend)
    assert plugin.seam_version() == "v0"
    assert RemoteBackendRegistry.get_worker("icefloe").__name__ == "IcefloeActorRolloutRefWorker"
    assert RolloutReplicaRegistry.get("icefloe").__name__ == "IcefloeReplica"


def test_register_selects_v1_worker_when_probe_imports(load_plugin) -> None:
    plugin = load_plugin(v1=True)
    from verl.remote_backend.base import RemoteBackendRegistry

    worker_cls = RemoteBackendRegistry.get_worker("icefloe")
    assert plugin.seam_version() == "v1"
    assert worker_cls.__name__ == "IcefloeV1ActorRolloutRefWorker"
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert issubclass(worker_cls, ActorRolloutRefWorker), "verl V1 requires a subclass of its worker"


def test_register_twice_is_a_no_op(load_plugin) -> None:
    plugin = load_plugin()
    from verl.remote_backend.base import RemoteBackendRegistry

    first = RemoteBackendRegistry.get("icefloe")
    plugin.register()  # verl's rule: the same class / loader again must not raise
    assert RemoteBackendRegistry.get("icefloe") is first


def test_register_without_seam_registers_only_the_replica(load_plugin) -> None:
    load_plugin(seam=False)
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert "verl.remote_backend.base" not in sys.modules
    assert RolloutReplicaRegistry.get("icefloe").__name__ == "IcefloeReplica"


def test_backend_contract_signatures(load_plugin) -> None:
    load_plugin()
    from icefloe.integrations.verl.backend import IcefloeBackend

    params = inspect.signature(IcefloeBackend.from_config).parameters
    assert params["handle"].kind is inspect.Parameter.KEYWORD_ONLY and params["handle"].default is None
    for name in ("destroy", "update_weights", "save_checkpoint"):
        assert inspect.iscoroutinefunction(getattr(IcefloeBackend, name)), name
    assert not inspect.iscoroutinefunction(IcefloeBackend.requires_single_forwarder)


def test_hydra_config_follows_verl_format_rules(load_plugin) -> None:
    """verl's config CI: a comment above every field, a blank line between fields, no inline comments."""
    plugin = load_plugin()
    lines = (Path(plugin.config_dir()) / "remote_backend" / "icefloe.yaml").read_text().splitlines()
    fields = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    assert fields
    for index in fields:
        assert "#" not in lines[index], f"inline comment on line {index + 1}"
        assert lines[index - 1].lstrip().startswith("#"), f"no comment above line {index + 1}: {lines[index]!r}"
        comment_start = index - 1
        while comment_start > 0 and lines[comment_start - 1].lstrip().startswith("#"):
            comment_start -= 1
        assert comment_start == 0 or not lines[comment_start - 1].strip(), f"no blank line before line {index + 1}"


def test_plugin_import_loads_no_torch_engines_or_vllm() -> None:
    """Registration runs inside `import verl`; it must not drag torch, engines, Ray or vLLM in."""
    here = Path(__file__).resolve().parent
    code = (
        "import sys, json, verl_standins\n"
        "verl_standins.install()\n"
        "import icefloe.integrations.verl\n"
        "heavy = ['torch', 'icefloe.engines', 'vllm', 'ray', 'icefloe.integrations.verl.worker_v0',\n"
        "         'icefloe.integrations.verl.rollout', 'icefloe.integrations.verl.payload']\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_registering_the_plugin_again_hands_verl_the_same_objects(load_plugin) -> None:
    """verl imports the plugin through its entry point and the launcher imports it again: a second
    ``register()`` must hand verl's registries the very same objects, which they accept as a no-op
    (a different class or loader under a taken name raises, as the last check shows)."""
    plugin = load_plugin()
    from verl.remote_backend.base import RemoteBackendRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    backend, worker, replica = (RemoteBackendRegistry.get("icefloe"), RemoteBackendRegistry.get_worker("icefloe"),
                                RolloutReplicaRegistry.get("icefloe"))  # fmt: skip
    assert plugin.register() == ["backend", "worker", "replica"]
    assert RemoteBackendRegistry.get("icefloe") is backend and RemoteBackendRegistry.get_worker("icefloe") is worker
    assert RolloutReplicaRegistry.get("icefloe") is replica
    with pytest.raises(ValueError, match="already registered"):
        RemoteBackendRegistry.register("icefloe")(type("AnotherBackend", (), {}))


def test_entry_point_names_the_plugin_module() -> None:
    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert '[project.entry-points."verl.plugins"]' in pyproject
    assert 'icefloe = "icefloe.integrations.verl"' in pyproject
    assert importlib.util.find_spec("icefloe.integrations.verl") is not None
