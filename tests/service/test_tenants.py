"""Tenants: the token file names them, each sees only its own jobs (others are 404), the admin sees all,
and a tenant's limits refuse a job over them by name."""

from __future__ import annotations

import asyncio

import pytest

from icefloe.protocol import ConfigError
from icefloe.service.settings import ServeSettings, TenantLimits

from .service_client import PREFIX, TRAINING
from .service_harness import asgi_client, make_app

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "admin": "tok-admin"}


def test_the_token_file_names_tenants_their_limits_and_the_shared_tenant(tmp_path):
    file = tmp_path / "tokens"
    file.write_text("# lab\ntok-shared\nalice: tok-alice max_jobs=2 max_slots=1\nbob: tok-bob\nadmin: tok-admin\n")
    settings = ServeSettings.from_env({}, token_file=file, data_dir=tmp_path)
    assert sorted(settings.token_tenants()) == [
        ("tok-admin", "admin"), ("tok-alice", "alice"), ("tok-bob", "bob"), ("tok-shared", "default"),
    ]  # fmt: skip
    assert settings.tenant_limits == {"alice": TenantLimits(max_jobs=2, max_slots=1)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice: tok max_job=1\n", "then limits as key=value with key one of ['max_jobs', 'max_lora_adapters'"),
        ("alice: tok tok2\n", "a line holds one token"),
        ("alice: tok\nbob: tok\n", "one token is given to tenants 'alice' and 'bob'"),
        ("al/ice: tok\n", "tenant names must be 1-64 of A-Z a-z 0-9 _ . -"),
        ("alice: tok max_slots=0\n", "serve.tenant_limits.alice.max_slots"),
    ],
)
def test_a_bad_token_file_line_is_refused_without_echoing_its_words(tmp_path, text, message):
    file = tmp_path / "tokens"
    file.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as refused:
        ServeSettings.from_env({}, token_file=file, data_dir=tmp_path).token_tenants()
    assert "tok2" not in str(refused.value)


def _app(data_dir, **limits):
    tenants = {name: (token,) for name, token in TOKENS.items()}
    return make_app(data_dir, engines="local", tenant_tokens=tenants, tenant_limits=limits)


def _as(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


@pytest.mark.anyio
async def test_a_tenant_reads_and_touches_only_its_own_jobs_and_the_admin_every_job(data_dir):
    async with asgi_client(_app(data_dir)) as http:
        created = await http.post(PREFIX + "/", json={"sub_job_configs": [TRAINING]}, headers=_as("alice"))
        job_id = created.json()["job_id"]
        unknown = await http.get(f"{PREFIX}/no-such-job", headers=_as("bob"))
        for method, path in (("GET", ""), ("POST", ":cancel"), ("POST", ":heartbeat"), ("GET", "/checkpoints"),
                             ("GET", "/metrics"), ("POST", "/step"), ("POST", "/forward-backward")):  # fmt: skip
            answer = await http.request(method, f"{PREFIX}/{job_id}{path}", headers=_as("bob"), json={})
            assert answer.status_code == 404, (path, answer.text)
        hidden = await http.get(f"{PREFIX}/{job_id}", headers=_as("bob"))
        assert hidden.json()["message"] == unknown.json()["message"].replace("no-such-job", job_id)  # no tell
        assert [j["job_id"] for j in (await http.get(PREFIX + "/", headers=_as("bob"))).json()["jobs"]] == []
        assert (await http.get("/ui/api/jobs", headers=_as("bob"))).json()["jobs"] == []
        assert (await http.get(f"/ui/api/jobs/{job_id}", headers=_as("bob"))).status_code == 404
        assert (await http.get("/metrics", headers=_as("bob"))).status_code == 404  # service-wide: the admin's
        listed = (await http.get(PREFIX + "/", headers=_as("admin"))).json()["jobs"]
        assert [j["job_id"] for j in listed] == [job_id]
        assert (await http.get("/metrics", headers=_as("admin"))).status_code == 200
        assert (await http.post(f"{PREFIX}/{job_id}:cancel", headers=_as("admin"))).status_code == 200


@pytest.mark.anyio
async def test_a_job_over_its_tenants_limit_is_refused_naming_the_limit(data_dir):
    async with asgi_client(_app(data_dir, alice=TenantLimits(max_jobs=1))) as http:
        body = {"sub_job_configs": [TRAINING]}
        assert (await http.post(PREFIX + "/", json=body, headers=_as("alice"))).status_code == 200
        refused = await http.post(PREFIX + "/", json=body, headers=_as("alice"))
        assert refused.status_code == 409
        assert refused.json()["message"] == (
            "tenant 'alice' may hold 1 active jobs at once (max_jobs=1 in the token file); this job would make 2: "
            "finish or cancel one of its jobs first"
        )
        assert (await http.post(PREFIX + "/", json=body, headers=_as("bob"))).status_code == 200  # bob's own limits


def _request_schemas(spec: dict, operation: dict) -> set[str]:
    """The component schemas an operation's request body uses, nested ones included."""
    schemas, found, todo = spec["components"]["schemas"], set(), [operation.get("requestBody", {})]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            name = node.get("$ref", "").rpartition("/")[2]
            if name and name not in found:
                found.add(name)
                todo.append(schemas[name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


@pytest.mark.anyio
async def test_every_route_naming_a_job_answers_another_tenants_job_as_one_that_does_not_exist(data_dir):
    """Walks every documented route: a route added later that forgets the tenant check fails here."""
    app = _app(data_dir)
    routes = [(path, method) for path, ops in app.openapi()["paths"].items() if "{job_id}" in path for method in ops]
    assert len(routes) >= 18  # the documented ones today
    async with asgi_client(app) as http:
        created = await http.post(PREFIX + "/", json={"sub_job_configs": [TRAINING]}, headers=_as("alice"))
        job_id = created.json()["job_id"]
        for path, method in routes:
            filled = path.format(database="DB", schema="SC", endpoint="cortex-training", job_id="{job_id}",
                                 checkpoint_id="global_step1", request_id="r")  # fmt: skip
            hidden = await http.request(method, filled.format(job_id=job_id), headers=_as("bob"), json={})
            unknown = await http.request(method, filled.format(job_id="no-such-job"), headers=_as("bob"), json={})
            assert unknown.status_code == hidden.status_code == 404, (method, path, hidden.text)
            assert hidden.json()["message"] == unknown.json()["message"].replace("no-such-job", job_id)


# Every request field that names a job or a sub-job, and what keeps it within the caller's tenant.
_JOB_FIELDS = {
    ("JobCreate", "job_id"): "a job id the tenant chooses lives in its namespace (Tenancy._own_job_id)",
    ("SourceCheckpointInfo", "source_job_id"): "Tenancy.checkpoint, at create",
    ("LoadBody", "source_job_id"): "Tenancy.checkpoint, in the load route",
    ("LoadBody", "target_sub_job_id"): "a sub-job of the path's job (operations.load_target)",
    ("OperationBody", "sub_job_id"): "a sub-job of the path's job (JobManager.resolve_sub_job)",
    ("query", "sub_job_id"): "a sub-job of the path's job (JobManager.resolve_sub_job)",
    ("TrainingConfigSpec", "multiplex_job_id"): "recorded in the job's warnings, never read",
    ("InferenceConfig", "multiplex_job_id"): "recorded in the job's warnings, never read",
}


def test_every_request_field_naming_a_job_is_one_the_tenancy_checks(data_dir):
    """A field naming another job (``source_job_id`` on load) was read without the tenant check: a new
    field naming a job fails here until it is checked and listed in _JOB_FIELDS."""
    spec = _app(data_dir).openapi()
    schemas, found = spec["components"]["schemas"], set()
    for ops in spec["paths"].values():
        for operation in ops.values():
            for name in _request_schemas(spec, operation):
                found |= {(name, f) for f in schemas[name].get("properties", {}) if f.endswith(("job_id", "job_ids"))}
            found |= {("query", p["name"]) for p in operation.get("parameters", ()) if p["in"] == "query"
                      and p["name"].endswith("job_id")}  # fmt: skip
    assert found == set(_JOB_FIELDS)


@pytest.mark.parametrize(("data", "root"), [("models/serve", "models"), ("serve", "serve/models"), ("same", "same")])
def test_a_data_dir_the_model_root_reaches_is_refused(tmp_path, data, root):
    """A data dir under the model root let a tenant load another's checkpoint as a model."""
    with pytest.raises(ConfigError, match="overlap, so every tenant could load the service's checkpoints as a model"):
        ServeSettings.from_env({}, data_dir=tmp_path / data, model_root=tmp_path / root)
    ServeSettings.from_env({}, data_dir=tmp_path / "serve", model_root=tmp_path / "models")  # apart: fine


@pytest.mark.anyio
async def test_a_lora_job_that_starts_a_host_is_charged_its_slot(data_dir):
    """LoRA jobs of three seeds started three hosts for a tenant with max_slots=1: a job on a shared base
    was charged no slot, also when it started the host."""
    peft = {"peft_type": "Lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}

    def lora(seed: int) -> dict:
        sub = {**TRAINING, "seed": seed, "training_config": {**TRAINING["training_config"], "peft_config": peft}}
        return {"sub_job_configs": [sub]}

    async with asgi_client(_app(data_dir, alice=TenantLimits(max_slots=1))) as http:
        assert (await http.post(PREFIX + "/", json=lora(11), headers=_as("alice"))).status_code == 200
        assert (await http.post(PREFIX + "/", json=lora(11), headers=_as("alice"))).status_code == 200  # joins it
        refused = await http.post(PREFIX + "/", json=lora(12), headers=_as("alice"))
        assert refused.status_code == 409 and "max_slots=1" in refused.json()["message"]
        assert (await http.post(PREFIX + "/", json=lora(12), headers=_as("bob"))).status_code == 200


@pytest.mark.anyio
async def test_the_door_refuses_a_load_of_another_tenants_checkpoint_whatever_route_sends_it(data_dir):
    """The tenant check of a load's ``source_job_id`` lived in one route: a second route that queued a load
    had to repeat it or let one tenant load another's weights. The door checks every item, given no tenant."""
    from icefloe.protocol import NotFoundError
    from icefloe.service.work.door import enter
    from icefloe.service.work.items import Load

    app = _app(data_dir)
    async with asgi_client(app) as http:
        jobs = []
        for tenant in ("alice", "bob"):
            created = await http.post(PREFIX + "/", json={"sub_job_configs": [TRAINING]}, headers=_as(tenant))
            jobs.append(created.json()["job_id"])
        alices, bobs = jobs
        manager = app.state.jobs
        while any(manager.public(job_id)["status"] != "running" for job_id in jobs):
            await asyncio.sleep(0.05)
        saved = await http.post(f"{PREFIX}/{alices}/save", json={}, headers=_as("alice"), params={"wait": 30})
        checkpoint_id = saved.json()["result"]["checkpoint_id"]
        bob = manager.live(bobs)
        with pytest.raises(NotFoundError, match=f"checkpoint {checkpoint_id!r} not found in job {alices}"):
            enter(manager, bob, Load(f"{bobs}:training:0", alices, checkpoint_id))  # no tenant: the job's owner
        with pytest.raises(NotFoundError):
            enter(manager, bob, Load(f"{bobs}:training:0", alices, checkpoint_id), tenant="admin")  # bob's job
        own = enter(manager, manager.live(alices), Load(f"{alices}:training:0", alices, checkpoint_id))
        assert (await http.get(f"{PREFIX}/{alices}/requests/{own}", params={"wait": 30}, headers=_as("alice"))).json()[
            "status"
        ] == "done"
