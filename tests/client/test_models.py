"""What a client may name as its model, and the model's context length, on every backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.client import Client, build_batch
from icefloe.engines.models import resolve_model
from icefloe.protocol import InvalidRequestError
from icefloe.service.app import ServerThread, create_app
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.settings import ServeSettings


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """tiny:chat with a context of 256 positions (its config says so; the weights do not care)."""
    folder = tmp_path_factory.mktemp("models") / "short"
    shutil.copytree(resolve_model("tiny:chat", seed=0), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return folder


@pytest.fixture(scope="module")
def service(tmp_path_factory, short_model):
    serve = tmp_path_factory.mktemp("serve")
    settings = ServeSettings(data_dir=serve, engines="local", model_root=short_model.parent)
    with ServerThread(create_app(settings, pool=SlotPool("cpu", 4))) as base_url:
        yield base_url


@pytest.mark.parametrize("backend", ["local", "remote"])
def test_the_models_context_length_is_enforced_with_the_limit_named(short_model, service, backend):
    """Past 256 positions: fwd_bwd of 402 and max_tokens=100000 were accepted off the Tinker API (the
    client's max_seq_len, 512 by default, was the only check, and generate cut max_tokens silently)."""
    remote = {"type": "remote", "base_url": service} if backend == "remote" else {"type": "local"}
    config = {"model": str(short_model), "backend": remote}
    with Client(config) as client:
        long = build_batch([[5] * 200], [[6] * 202], [1.0], pad_id=0)
        with pytest.raises(InvalidRequestError, match=r"has 402 positions, more than the model's context of 256 "):
            client.fwd_bwd(long)
        with pytest.raises(
            InvalidRequestError,
            match=r"prompts\[0\] \(3 tokens\) \+ max_tokens \(100000\) exceeds the model's context of 256 tokens; "
            r"set max_tokens to at most 253",
        ):
            client.generate([[5, 6, 7]], {"max_tokens": 100000})
        assert len(client.generate([[5, 6, 7]], {"max_tokens": 4, "ignore_eos": True})[0]["token_ids"]) == 4
        assert client.fwd_bwd(build_batch([[5] * 100], [[6] * 156], [1.0], pad_id=0))["num_tokens"] > 0


@pytest.mark.parametrize("backend", ["local", "remote"])
def test_a_hub_id_in_the_local_hugging_face_cache_names_a_model_offline(hub_cache, service, backend):
    """Users keep their models in the Hugging Face cache, and org/name could not name one; on the remote
    backend the service took it but client.tokenizer failed ("not a directory")."""
    remote = {"type": "remote", "base_url": service} if backend == "remote" else {"type": "local"}
    with Client({"model": "acme/tiny-chat", "backend": remote}) as client:
        assert client.tokenizer.decode(client.tokenizer.encode("hub")) == "hub"
        assert len(client.generate(["hi"], {"max_tokens": 2, "ignore_eos": True})[0]["token_ids"]) == 2
    assert resolve_model("acme/tiny-chat") == hub_cache


def test_a_hub_id_missing_from_the_cache_is_refused_naming_the_cache(hub_cache):
    from icefloe.protocol import ConfigError

    with pytest.raises(ConfigError, match=r"Hugging Face cache \(.+/hub\).+'acme/other' is neither .+hf download"):
        resolve_model("acme/other")


def test_exported_and_saved_model_folders_have_the_usual_modes(tmp_path):
    """They were built in mkdtemp folders and kept its modes: 0700 folders and a 0600 model.safetensors."""
    from typer.testing import CliRunner

    from icefloe.cli import app

    assert CliRunner().invoke(app, ["models", "export", "tiny:arith", str(tmp_path / "exported")]).exit_code == 0
    with Client({"model": "tiny:arith", "training": {"checkpoint_dir": str(tmp_path / "ckpt")}}) as client:
        saved = Path(client.save_checkpoint("weights-only")["path"])
    for folder in (tmp_path / "exported", saved):
        modes = {path.name: oct(path.stat().st_mode & 0o777) for path in [folder, *folder.iterdir()]}
        assert modes.pop(folder.name) == "0o755" and modes.pop("model.safetensors") == "0o644", folder
        assert set(modes.values()) == {"0o644"}, modes
