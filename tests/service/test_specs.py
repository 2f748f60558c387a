"""Create bodies → sub-job specs (icefloe.service.specs): which models a caller may name."""

from __future__ import annotations

import pytest

from icefloe.engines.models import resolve_model

from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


async def test_model_name_is_a_preset_or_a_folder_under_the_model_root_and_nothing_else(data_dir, tmp_path, caplog):
    """model_name took any server path, and the error said whether a directory existed there; a refused
    link left no line in the service log to say why."""
    root = tmp_path / "models"
    built = resolve_model("tiny:arith", cache_dir=tmp_path / "build")
    (root / "org").mkdir(parents=True)
    built.rename(root / "org" / "tiny-arith")  # a hub-style org/name folder
    (root / "no-config").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "org" / "escape").symlink_to(outside)
    async with asgi_client(make_app(data_dir, model_root=root)) as http:
        api = Api(http)
        job_id = await api.running({**TRAINING, "model_name": "org/tiny-arith"})
        assert (await api.job(job_id))["sub_jobs"][0]["model_name"] == "org/tiny-arith"
        assert (
            await api.call(
                "POST", "/", json={"sub_job_configs": [{**TRAINING, "model_name": str(root / "org" / "tiny-arith")}]}
            )
        ).status_code == 200
        refusals = {}
        for name in (
            str(outside),  # exists, outside the root
            "/no/such/dir",
            "../outside",
            "org/../../outside",
            "org/escape",  # a link inside the root to a folder outside it
            "org/missing",
            "no-config",  # a folder under the root that holds no model
            "~",
        ):
            response = await api.call(
                "POST", "/", json={"sub_job_configs": [{**TRAINING, "model_name": name}]}, check=False
            )
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), name
            refusals[name] = response.json()["message"].replace(repr(name), "<name>")
        assert len(set(refusals.values())) == 1, refusals  # one message: nothing tells the cases apart
        logged = [r.getMessage() for r in caplog.records if "'org/escape' refused" in r.getMessage()]
        assert logged and f"is a link to {outside}, outside the model root" in logged[0], logged
        assert "tiny:<preset>" in refusals["/no/such/dir"] and "--model-root" in refusals["/no/such/dir"]
    async with asgi_client(make_app(tmp_path / "serve-2")) as http:  # no model root: presets only
        response = await Api(http).call(
            "POST", "/", json={"sub_job_configs": [{**TRAINING, "model_name": "org/tiny-arith"}]}, check=False
        )
        assert response.status_code == 400 and "is not a model this service offers" in response.json()["message"]


async def test_a_sampler_with_no_gpus_of_its_own_runs_on_its_trainers_slot(data_dir):
    beside = {**SAMPLING, "inference_config": {"max_seq_len": 64, "n_gpus": 0}}
    async with asgi_client(make_app(data_dir, slots=1)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, beside)  # two sub-jobs, one slot
        assert (await api.job(job_id))["status"] == "running"
        alone = await api.call("POST", "/", json={"sub_job_configs": [beside]}, check=False)
    assert alone.status_code == 400
    assert "n_gpus is 0" in alone.json()["message"] and "no training sub-job" in alone.json()["message"]


async def test_a_section_key_sent_on_the_sub_job_itself_is_a_400_and_an_unknown_one_a_warning(data_dir):
    """peft_config beside training_config used to be dropped: the job trained full weights, with no warning."""
    peft = {"peft_type": "Lora", "r": 4, "lora_alpha": 8}
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        body = {"sub_job_configs": [{**TRAINING, "peft_config": peft, "activation_checkpointing": True}]}
        refused = await api.call("POST", "/", json=body, check=False)
        assert refused.status_code == 400
        assert refused.json()["message"] == (
            "sub_job_configs.0 has ['activation_checkpointing', 'peft_config'] on the sub-job itself, where they do "
            "nothing; move them into sub_job_configs.0.training_config"
        )
        body = {"sub_job_configs": [TRAINING, {**SAMPLING, "max_seq_len": 32}]}
        refused = await api.call("POST", "/", json=body, check=False)
        assert refused.status_code == 400 and "move them into sub_job_configs.1.inference_config" in refused.text

        created = (await api.call("POST", "/", json={"sub_job_configs": [{**TRAINING, "colour": "blue"}]})).json()
        unused = "sub_job_configs.0.colour is recorded but not used: the sub-job has no such field"
        assert created["warnings"] == [unused]
