"""Tenants: the token file names them, each sees only its own jobs (others are 404), the admin sees all,
and a tenant's limits refuse a job over them by name."""

from __future__ import annotations

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
