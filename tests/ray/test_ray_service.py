"""``icefloe serve --engines ray``: a service job whose engines are Ray actors, driven by the remote client."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("transformers")

from icefloe.client import Client  # noqa: E402
from icefloe.client.batch import build_batch  # noqa: E402
from icefloe.service.app import ServerThread, create_app  # noqa: E402
from icefloe.service.placement import SlotPool  # noqa: E402
from icefloe.service.runtime import make_engine_host  # noqa: E402
from icefloe.service.settings import ServeSettings  # noqa: E402

pytestmark = pytest.mark.integration


def test_make_engine_host_ray_names_the_choice():
    from icefloe.service.ray_host import RayEngineHost

    assert isinstance(make_engine_host("ray", [], {}, {}, Path("logs")), RayEngineHost)


@pytest.mark.slow  # ~10 s: a service, its Ray actors and a whole train-sync-sample round
def test_serve_with_ray_engines_trains_syncs_and_samples(ray_session, model_dir, tmp_path):
    settings = ServeSettings(data_dir=tmp_path / "serve", engines="ray", model_root=model_dir.parent)
    app = create_app(settings, pool=SlotPool("cpu", 2))
    with ServerThread(app) as base_url:
        config = {"model": str(model_dir), "max_seq_len": 48, "backend": {"type": "remote", "base_url": base_url}}
        with Client(config) as client:
            batch = build_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0], pad_id=0)
            result = client.fwd_bwd(batch)
            assert result["num_tokens"] == 5
            assert client.step()["global_step"] == 1
            assert client.sync_weights()["policy_version"] == 1
            sample = client.generate([[1, 2, 3]], {"max_tokens": 3, "logprobs": True})[0]
            assert sample["policy_version"] == 1 and len(sample["token_ids"]) == 3
            serving = serving_actors(ray_session)
            assert any("-training-" in name for name in serving) and any("-sampling-" in name for name in serving)
    assert not serving_actors(ray_session)  # closing the service released the job's actors


def serving_actors(ray) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "icefloe-serve"]
