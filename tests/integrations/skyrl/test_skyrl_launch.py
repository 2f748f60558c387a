"""The launcher: driver shims, the override flag, and remote-inference settings for both SkyRL generations."""

from __future__ import annotations

import sys

import pytest

from icefloe.integrations.skyrl import SHIM_MARKER, install_driver_shims
from icefloe.integrations.skyrl.launch import (
    ENTRYPOINT,
    PLACEHOLDER_URL,
    main,
    prepare_argv,
    skyrl_has_remote_urls,
)
from icefloe.protocol import ConfigError


def test_shim_replaces_peer_access_probe_and_is_marked(skyrl):
    utils = skyrl["skyrl.train.utils.utils"]
    assert install_driver_shims() is True
    assert utils.peer_access_supported(max_num_gpus_per_node=8) is False
    assert getattr(utils.peer_access_supported, SHIM_MARKER) is True


def test_shim_install_is_idempotent(skyrl):
    utils = skyrl["skyrl.train.utils.utils"]
    assert install_driver_shims() is True
    installed = utils.peer_access_supported
    assert install_driver_shims() is False
    assert utils.peer_access_supported is installed


def test_shim_keeps_prepare_runtime_environment_off_the_gpu_probe(skyrl, make_cfg):
    """Regression: with >1 GPU per node the real probe waits forever for GPUs on a CPU-only driver."""
    utils = skyrl["skyrl.train.utils.utils"]
    cfg = make_cfg("trainer.placement.policy_num_gpus_per_node=4")
    with pytest.raises(AssertionError, match="probe ran"):
        utils.prepare_runtime_environment(cfg)
    install_driver_shims()
    assert utils.prepare_runtime_environment(cfg) == {"NCCL_P2P_DISABLE": "1"}


def test_prepare_argv_adds_override_flag_only_when_absent():
    args = prepare_argv(["trainer.seed=1"], legacy_remote_urls=False)
    assert args.count(f"trainer.override_entrypoint={ENTRYPOINT}") == 1
    mine = prepare_argv(["trainer.override_entrypoint=my.module"], legacy_remote_urls=False)
    assert [a for a in mine if a.startswith("trainer.override_entrypoint=")] == [
        "trainer.override_entrypoint=my.module"
    ]


def test_prepare_argv_repeats_placeholder_url_per_engine_on_legacy_skyrl():
    args = prepare_argv(["generator.inference_engine.num_engines=3"], legacy_remote_urls=True)
    urls = ",".join([PLACEHOLDER_URL] * 3)
    assert f"generator.inference_engine.remote_urls=[{urls}]" in args
    assert "generator.inference_engine.run_engines_locally=false" in args
    assert not any("external_server_urls" in a for a in args)


def test_prepare_argv_sets_external_server_urls_on_new_inference_layer():
    args = prepare_argv(["generator.inference_engine.num_engines=2"], legacy_remote_urls=False)
    assert f"generator.inference_engine.external_server_urls=[{PLACEHOLDER_URL},{PLACEHOLDER_URL}]" in args
    assert not any("remote_urls=" in a and "external" not in a for a in args)


def test_prepare_argv_keeps_user_urls():
    given = ["generator.inference_engine.remote_urls=[http://a]"]
    args = prepare_argv(given, legacy_remote_urls=True)
    assert [a for a in args if "remote_urls" in a] == given
    proxy = ["generator.inference_engine.external_proxy_url=http://router:8080"]
    assert not any("external_server_urls" in a for a in prepare_argv(proxy, legacy_remote_urls=False))


def test_prepare_argv_refuses_local_skyrl_engines():
    with pytest.raises(ConfigError, match="run_engines_locally=true"):
        prepare_argv(["generator.inference_engine.run_engines_locally=true"], legacy_remote_urls=False)


@pytest.mark.parametrize("legacy", [True, False], ids=["remote_urls-generation", "new-inference-layer"])
def test_prepared_argv_passes_each_generations_validation(install_skyrl, legacy):
    modules = install_skyrl(legacy_inference=legacy)
    from icefloe.integrations.skyrl.entrypoint import skyrl_config_class

    assert skyrl_has_remote_urls() is legacy
    args = prepare_argv(["generator.inference_engine.num_engines=4"], legacy_remote_urls=legacy)
    args = [a for a in args if not a.startswith("trainer.override_entrypoint=")]
    cfg = skyrl_config_class().from_cli_overrides(args)
    modules["skyrl.train.utils"].validate_cfg(cfg)  # raises on a mismatch


def test_legacy_validation_fails_without_repeated_urls(install_skyrl):
    """Regression: one placeholder URL for several engines died in SkyRL's validator."""
    modules = install_skyrl(legacy_inference=True)
    from icefloe.integrations.skyrl.entrypoint import skyrl_config_class

    cfg = skyrl_config_class().from_cli_overrides(
        [
            "generator.inference_engine.num_engines=4",
            "generator.inference_engine.run_engines_locally=false",
            f"generator.inference_engine.remote_urls=[{PLACEHOLDER_URL}]",
        ]
    )
    with pytest.raises(AssertionError, match="remote_urls"):
        modules["skyrl.train.utils"].validate_cfg(cfg)


def test_launcher_installs_shim_then_runs_skyrl_main_with_override(skyrl, monkeypatch):
    seen = {}

    def fake_entrypoint_main():
        seen["argv"] = list(sys.argv)
        seen["shimmed"] = getattr(skyrl["skyrl.train.utils.utils"].peer_access_supported, "_icefloe_shimmed", False)

    import types

    fake = types.ModuleType("fake_icefloe_entry")
    fake.main = fake_entrypoint_main
    monkeypatch.setitem(sys.modules, "fake_icefloe_entry", fake)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    # runpy executes SkyRL's main_base as __main__; the stand-in's module has no source, so run its main.
    monkeypatch.setattr("runpy.run_module", lambda name, run_name, alter_sys: sys.modules[name].main())
    main(["trainer.override_entrypoint=fake_icefloe_entry", "trainer.seed=3"])
    assert seen["shimmed"] is True
    assert seen["argv"][1:3] == ["trainer.override_entrypoint=fake_icefloe_entry", "trainer.seed=3"]
    assert "generator.inference_engine.run_engines_locally=false" in seen["argv"]


def test_launcher_without_skyrl_names_python_312(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl", None)
    with pytest.raises(ImportError, match=r"Python 3\.12"):
        main(["trainer.seed=1"])
