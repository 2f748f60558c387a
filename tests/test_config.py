"""ClientConfig validation messages and the one place env is read."""

import pytest

from icefloe.config import ClientConfig, LocalConfig, LoraConfig, RemoteConfig
from icefloe.protocol import ConfigError

CORTEX_ENV = {
    "ARCTIC_BACKEND": "cortex",
    "ARCTIC_CORTEX_HOST": "acct.example.invalid",
    "ARCTIC_CORTEX_DATABASE": "DB",
    "ARCTIC_CORTEX_SCHEMA": "SCH",
    "CORTEX_PAT": "pat-secret-value",
}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"max_seq_len": 0}, "max_seq_len: Input should be greater than 0; got 0"),
        ({"training": {"lr_schedule": {"kind": "cosine"}}}, "lr_schedule.total_steps must be > 0"),
        ({"training": {"optimizer": {"betas": [0.9, 1.5]}}}, "training.optimizer.betas"),
        ({"training": {"grad_clip": -1}}, "training.grad_clip"),
        ({"backend": {"type": "nope"}}, "backend"),
        ({"backend": {"type": "remote", "host": "h"}}, "backend.database and backend.schema are required"),
        ({"model": " "}, "model must name a local Hugging Face directory"),
        ({"modle": "x"}, "modle: Extra inputs are not permitted"),
        ({"lora": {"rank": 0}}, "lora.rank: Input should be greater than or equal to 1; got 0"),
        ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules: must be a list of module names or 'all-linear'"),
        ({"lora": {"target_modules": []}}, "lora.target_modules: must be a non-empty list of module names"),
        ({"lora": {"bias": "some"}}, "lora.bias"),
        ({"lora": {}, "backend": {"type": "ray", "fsdp": True}}, "lora with backend.fsdp=true is not supported"),
    ],
)
def test_build_names_the_bad_field(data, fragment):
    with pytest.raises(ConfigError) as info:
        ClientConfig.build(data)
    assert fragment in str(info.value)


def test_build_lists_every_bad_field_at_once():
    with pytest.raises(ConfigError) as info:
        ClientConfig.build(max_seq_len=0, num_training_workers=0)
    assert "max_seq_len" in str(info.value) and "num_training_workers" in str(info.value)


def test_default_backend_is_local():
    assert isinstance(ClientConfig().backend, LocalConfig)


def test_from_env_selects_remote_from_arctic_names():
    config = ClientConfig.from_env(environ=CORTEX_ENV)
    backend = config.backend
    assert isinstance(backend, RemoteConfig)
    assert (backend.host, backend.database, backend.schema_) == ("acct.example.invalid", "DB", "SCH")
    assert backend.pat is not None and backend.pat.get_secret_value() == "pat-secret-value"


@pytest.mark.parametrize(
    ("env", "explicit", "expected_type"),
    [
        ({}, {}, "local"),
        ({"ICEFLOE_BACKEND": "remote", "ICEFLOE_REMOTE_BASE_URL": "http://127.0.0.1:1"}, {}, "remote"),
        ({"ARCTIC_BACKEND": "cortex", "ARCTIC_CORTEX_BASE_URL": "http://127.0.0.1:1"}, {}, "remote"),
        ({"ICEFLOE_BACKEND": "remote"}, {"backend": {"type": "local"}}, "local"),
        ({"ICEFLOE_BACKEND": "ray", "ARCTIC_BACKEND": "cortex"}, {}, "ray"),
    ],
)
def test_from_env_backend_selection_table(env, explicit, expected_type):
    assert ClientConfig.from_env(explicit, environ=env).backend.type == expected_type


def test_from_env_explicit_remote_fields_win():
    config = ClientConfig.from_env(
        {"backend": {"type": "remote", "base_url": "http://127.0.0.1:9", "endpoint": "mine"}},
        environ={"ICEFLOE_REMOTE_BASE_URL": "http://other", "ARCTIC_CORTEX_ENDPOINT": "theirs"},
    )
    assert (config.backend.base_url, config.backend.endpoint) == ("http://127.0.0.1:9", "mine")


def test_from_env_reads_pat_from_the_named_variable():
    env = {**CORTEX_ENV, "ARCTIC_CORTEX_PAT_ENV_VAR": "MY_PAT", "MY_PAT": "from-my-pat"}
    assert ClientConfig.from_env(environ=env).backend.pat.get_secret_value() == "from-my-pat"


def test_icefloe_remote_pat_wins_over_the_managed_apis_generic_cortex_pat():
    """A stale CORTEX_PAT in the shell used to beat the ICEFLOE_REMOTE_PAT that icefloe serve asks for."""
    env = {**CORTEX_ENV, "ICEFLOE_REMOTE_PAT": "for-icefloe-serve"}
    assert ClientConfig.from_env(environ=env).backend.pat.get_secret_value() == "for-icefloe-serve"
    env = {**env, "ICEFLOE_REMOTE_PAT_ENV_VAR": "MY_PAT", "MY_PAT": "named"}
    assert ClientConfig.from_env(environ=env).backend.pat.get_secret_value() == "named"


def test_from_env_rejects_unknown_backend_name():
    with pytest.raises(ConfigError, match="ICEFLOE_BACKEND"):
        ClientConfig.from_env(environ={"ICEFLOE_BACKEND": "kubernetes"})


def test_pat_never_appears_in_repr_or_errors():
    config = ClientConfig.from_env(environ=CORTEX_ENV)
    assert "pat-secret-value" not in repr(config)
    assert "pat-secret-value" not in str(config.model_dump())
    with pytest.raises(ConfigError) as info:
        ClientConfig.build(backend={"type": "remote", "host": "h", "pat": "pat-secret-value"})
    assert "pat-secret-value" not in str(info.value)


def test_schedule_multiplier_is_the_one_formula():
    from icefloe.config import ScheduleConfig

    warm = ScheduleConfig(kind="constant", warmup_steps=4)
    assert [warm.multiplier(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = ScheduleConfig(kind="cosine", total_steps=3, min_lr_ratio=0.5)
    assert [round(cosine.multiplier(s), 4) for s in range(5)] == [1.0, 0.875, 0.625, 0.5, 0.5]


def test_lora_is_off_unless_set_and_defaults_to_the_training_api_defaults():
    assert ClientConfig.build().lora is None
    lora = ClientConfig.build(lora={}).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 8, "all-linear")


def test_lora_peft_config_round_trips_in_the_training_api_spelling():
    peft_config = {
        "peft_type": "Lora",
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
    }
    lora = LoraConfig.from_peft_config(peft_config)
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32, 0.05, ["q_proj", "v_proj"])
    assert lora.to_peft_config() == peft_config
    assert LoraConfig.from_peft_config({"peft_type": "Lora"}) == LoraConfig()  # r = alpha = 8


@pytest.mark.parametrize(
    ("peft_config", "fragment"),
    [
        ({"peft_type": "IA3"}, "peft_config.peft_type must be 'Lora'; got 'IA3'"),
        ({"r": 0}, "peft_config.r: Input should be greater than or equal to 1; got 0"),
        ({"lora_alpha": -1}, "peft_config.lora_alpha: Input should be greater than 0; got -1"),
        ({"use_dora": True}, "peft_config has keys icefloe does not train with: ['use_dora']"),
    ],
)
def test_lora_from_peft_config_names_the_bad_key(peft_config, fragment):
    with pytest.raises(ConfigError) as info:
        LoraConfig.from_peft_config(peft_config)
    assert fragment in str(info.value)


def test_lora_mismatch_names_both_values_of_what_differs():
    trainer = LoraConfig(rank=8, alpha=16, target_modules=["v_proj", "q_proj"])
    assert trainer.mismatch(LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "q_proj"])) == []
    assert trainer.mismatch(LoraConfig(rank=4, alpha=16, dropout=0.1, target_modules="all-linear")) == [
        "r: 8 vs 4",
        "target_modules: ['q_proj', 'v_proj'] vs 'all-linear'",
    ]
    assert trainer.mismatch(None) == ["peft_config: LoRA vs none"]


def test_from_env_is_build_plus_the_environment():
    """The README builds its config with from_env, so the same script runs on any backend: the
    environment picks the backend and fills the remote fields, and explicit arguments still win."""
    args = {"model": "tiny:arith", "training": {"optimizer": {"lr": 3e-3}}}
    assert ClientConfig.from_env(environ={}, **args) == ClientConfig.build(**args)
    env = {"ICEFLOE_BACKEND": "remote", "ICEFLOE_REMOTE_BASE_URL": "http://127.0.0.1:8321", "ICEFLOE_REMOTE_PAT": "t"}
    remote = ClientConfig.from_env(environ=env, **args)
    assert (remote.backend.type, remote.backend.base_url) == ("remote", "http://127.0.0.1:8321")
    assert remote.backend.pat.get_secret_value() == "t" and remote.training.optimizer.lr == 3e-3
    assert ClientConfig.from_env(environ=env, backend={"type": "local"}, **args).backend.type == "local"
    mine = ClientConfig.from_env(environ=env, backend={"type": "remote", "base_url": "http://127.0.0.1:9"}, **args)
    assert mine.backend.base_url == "http://127.0.0.1:9"


def test_checkpoint_root_defaults_to_the_user_data_dir_and_is_absolute(tmp_path, monkeypatch):
    from icefloe.config import TrainingConfig, user_data_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    assert user_data_dir() == tmp_path / "data" / "icefloe"
    assert TrainingConfig().checkpoint_root("s1") == tmp_path / "data" / "icefloe" / "checkpoints" / "s1"
    assert TrainingConfig(checkpoint_dir="ckpt").checkpoint_root("s1") == tmp_path / "ckpt"


def test_local_checkpoints_leave_the_working_directory_alone(tmp_path, monkeypatch):
    """Checkpoints went to ./icefloe-checkpoints and came back as relative paths."""
    from pathlib import Path

    from icefloe.client import Client

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for checkpoint_dir, parent in ((None, tmp_path / "data" / "icefloe" / "checkpoints"), ("ckpt", work / "ckpt")):
        client = Client({"model": "tiny:arith", "training": {"checkpoint_dir": checkpoint_dir}})
        try:
            saved = Path(client.save_checkpoint()["path"])
            listed = [Path(c["path"]) for c in client.list_checkpoints()]
        finally:
            client.shutdown()
        assert saved.is_absolute() and saved.is_dir() and parent in saved.parents
        assert listed == [saved]
    assert [p.name for p in work.iterdir()] == ["ckpt"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_p": 1.5}, "sampling_params.top_p: Input should be less than or equal to 1; got 1.5"),
        ({"max_tokenz": 3}, "sampling_params.max_tokenz: Extra inputs are not permitted; got 3"),
    ],
)
def test_sampling_params_errors_are_one_line_naming_the_field(params, message):
    """They were pydantic's multi-line dump ending in a documentation URL."""
    from icefloe.client import ops
    from icefloe.protocol import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        ops.generate([[1, 2]], params)
    assert str(info.value) == message


def test_build_reads_no_environment(monkeypatch):
    """A stray variable must not switch off TLS checks or attach a token to an explicit config."""
    monkeypatch.setenv("ICEFLOE_REMOTE_VERIFY_SSL", "false")
    monkeypatch.setenv("ICEFLOE_REMOTE_PAT", "secret")
    monkeypatch.setenv("ICEFLOE_REMOTE_HOST", "acct.example.invalid")
    backend = ClientConfig.build({"backend": {"type": "remote", "base_url": "http://127.0.0.1:9"}}).backend
    assert (backend.verify_ssl, backend.pat, backend.host) == (True, None, None)
    assert RemoteConfig().base_url is None and RemoteConfig().verify_ssl is True


def test_from_env_reads_only_the_mapping_it_is_given(monkeypatch):
    monkeypatch.setenv("ICEFLOE_REMOTE_BASE_URL", "http://from-os-environ")
    monkeypatch.setenv("ICEFLOE_REMOTE_VERIFY_SSL", "false")
    backend = ClientConfig.from_env(backend={"type": "remote"}, environ={}).backend
    assert (backend.base_url, backend.verify_ssl) == (None, True)
    given = {"ICEFLOE_REMOTE_BASE_URL": "http://given", "ICEFLOE_REMOTE_MAX_RETRIES": "3"}
    backend = ClientConfig.from_env(backend={"type": "remote"}, environ=given).backend
    assert (backend.base_url, backend.max_retries, backend.verify_ssl) == ("http://given", 3, True)


def test_from_env_without_a_mapping_reads_every_remote_field_from_os_environ(monkeypatch):
    monkeypatch.setenv("ICEFLOE_BACKEND", "remote")
    monkeypatch.setenv("ICEFLOE_REMOTE_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ICEFLOE_REMOTE_VERIFY_SSL", "false")
    monkeypatch.setenv("ICEFLOE_REMOTE_REQUEST_TIMEOUT_S", "7.5")
    monkeypatch.setenv("ICEFLOE_REMOTE_PAT", "tok")
    backend = ClientConfig.from_env().backend
    assert (backend.base_url, backend.verify_ssl, backend.request_timeout_s) == ("http://127.0.0.1:9", False, 7.5)
    assert backend.pat.get_secret_value() == "tok"
    explicit = ClientConfig.from_env(backend={"type": "remote", "verify_ssl": True}).backend
    assert explicit.verify_ssl is True


def test_from_env_names_the_variables_that_set_database_and_schema():
    env = {"ICEFLOE_BACKEND": "remote", "ICEFLOE_REMOTE_HOST": "acct.example.invalid"}
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_env(environ=env)
    assert "ICEFLOE_REMOTE_DATABASE" in str(info.value) and "ICEFLOE_REMOTE_SCHEMA" in str(info.value)


@pytest.mark.parametrize("kind", ["local", "ray", "remote"])
def test_a_backend_field_is_named_without_the_union_tag(kind):
    field = {"local": "device", "ray": "num_gpus_per_worker", "remote": "max_retries"}[kind]
    with pytest.raises(ConfigError) as info:
        ClientConfig.build({"backend": {"type": kind, field: -1}})
    assert f"  backend.{field}: " in str(info.value), str(info.value)
