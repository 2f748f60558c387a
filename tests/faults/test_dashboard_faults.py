"""The dashboard of a real ``icefloe serve`` process under the attacks a shared server meets: a page on
another port of the same host acting through the login cookie, a stolen cookie, framing, guessed
tokens, a forged ``Host``; and tenants that must each see only their own jobs."""

from __future__ import annotations

import httpx
import pytest

from .serve_process import PREFIX, TRAINING, free_port
from .tinker_serve import TOKENS, tinker_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tinker_serve(tmp_path_factory.mktemp("dashboard-faults")) as serve:
        yield serve


def _login(base_url: str, tenant: str) -> str:
    """The session cookie the login form sets for ``tenant``'s token."""
    answer = httpx.post(f"{base_url}/ui/login", content=f"token={TOKENS[tenant]}", headers=_FORM)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui", answer.text
    cookie = answer.headers["set-cookie"].split(";")[0]
    assert cookie.startswith("icefloe_session=") and TOKENS[tenant] not in answer.headers["set-cookie"]
    return cookie


def _api(base_url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=base_url + PREFIX, headers={"Authorization": f"Bearer {TOKENS[tenant]}"}, timeout=60)


def _running_job(serve, tenant: str) -> str:
    with _api(serve.base_url, tenant) as api:
        job_id = api.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]
    serve.wait_job(job_id, "running")
    return job_id


def test_a_page_on_another_port_cannot_act_through_the_login_cookie(served):
    """A page on another port of the same host cancelled a job through the cookie: SameSite does not cover
    ports, and there was no Origin check, no CSRF token and no frame protection."""
    job_id = _running_job(served, "alice")
    cookie = _login(served.base_url, "alice")
    other_origin = f"http://127.0.0.1:{free_port()}"
    cancel = f"{served.base_url}{PREFIX}/{job_id}:cancel"
    refused = httpx.post(cancel, headers={"Cookie": cookie, "Origin": other_origin})
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    assert httpx.post(cancel, headers={"Cookie": cookie}).status_code == 403  # no Origin, no CSRF token
    with _api(served.base_url, "alice") as api:
        assert api.get(f"/{job_id}").json()["status"] in ("pending", "placing", "initializing", "running")
    # The dashboard's own page may: its Origin, or its session's CSRF token.
    csrf = httpx.get(f"{served.base_url}/ui/api/session", headers={"Cookie": cookie}).json()["csrf_token"]
    heartbeat = cancel.replace(":cancel", ":heartbeat")
    assert httpx.post(heartbeat, headers={"Cookie": cookie, "X-CSRF-Token": csrf}).status_code == 200
    own = httpx.post(cancel, headers={"Cookie": cookie, "Origin": served.base_url})
    assert own.status_code == 200 and own.json()["status"] in ("cancelling", "cancelled")
    for page in ("/ui", f"/ui/jobs/{job_id}", "/ui/login"):
        answer = httpx.get(served.base_url + page, headers={"Cookie": cookie})
        assert answer.headers["x-frame-options"] == "DENY", page
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'", page


def test_the_cookie_holds_a_session_that_logout_revokes(served):
    """The cookie held the service token itself, and there was no logout."""
    cookie = _login(served.base_url, "alice")
    stolen = {"Cookie": cookie}
    assert httpx.get(f"{served.base_url}/ui/api/jobs", headers=stolen).status_code == 200
    page = httpx.get(f"{served.base_url}/ui", headers=stolen).text
    assert 'id="logout"' in page
    csrf = httpx.get(f"{served.base_url}/ui/api/session", headers=stolen).json()
    assert csrf["tenant"] == "alice"
    out = httpx.post(f"{served.base_url}/ui/logout", headers={**stolen, "X-CSRF-Token": csrf["csrf_token"]})
    assert out.status_code == 303 and 'icefloe_session=""' in out.headers["set-cookie"]
    assert httpx.get(f"{served.base_url}/ui/api/jobs", headers=stolen).status_code == 401  # revoked server-side
    assert httpx.get(f"{served.base_url}/ui", headers=stolen).headers["location"] == "/ui/login"


def test_a_tenant_sees_only_its_own_jobs_and_the_admin_every_job(served):
    mine, theirs = _running_job(served, "bob"), _running_job(served, "alice")
    bob, admin = {"Cookie": _login(served.base_url, "bob")}, {"Cookie": _login(served.base_url, "admin")}
    listed = {row["job_id"] for row in httpx.get(f"{served.base_url}/ui/api/jobs", headers=bob).json()["jobs"]}
    assert mine in listed and theirs not in listed
    assert httpx.get(f"{served.base_url}/ui/api/jobs/{theirs}", headers=bob).status_code == 404
    assert httpx.get(f"{served.base_url}{PREFIX}/{theirs}/metrics", headers=bob).status_code == 404
    assert httpx.get(f"{served.base_url}/metrics", headers=bob).status_code == 404  # its series name every job
    assert theirs in httpx.get(f"{served.base_url}/metrics", headers=admin).text
    everyone = {row["job_id"] for row in httpx.get(f"{served.base_url}/ui/api/jobs", headers=admin).json()["jobs"]}
    assert {mine, theirs} <= everyone


def test_export_links_use_the_public_url_never_the_host_header(tmp_path):
    """Export links took their host from the request's Host header, which the caller writes."""
    for args, base in (
        ((), None),
        (("--public-url", "https://icefloe.example:8443/lab"), "https://icefloe.example:8443/lab"),
    ):
        with tinker_serve(tmp_path, *args) as serve, _api(serve.base_url, "alice") as api:
            job_id = _running_job(serve, "alice")
            saved = api.post(f"/{job_id}/save", params={"wait": 60}, json={}).json()
            assert saved["status"] == "done", saved
            export = f"/{job_id}/checkpoints/{saved['result']['checkpoint_id']}:export"
            links = api.post(export, headers={"Host": "evil.example"}).json()["files"]
            expected = f"{base or serve.base_url}/files/"  # without --public-url: the address the call came in on
            assert links and all(link["url"].startswith(expected) for link in links), links
            assert (
                httpx.get(links[0]["url"].replace(base, serve.base_url) if base else links[0]["url"]).status_code == 200
            )


def test_guessed_logins_are_refused_after_a_few_even_with_the_right_token(served):
    """600 wrong tokens went through in 1.2 s. (Last in this module: it blocks logins from this address.)"""
    statuses = [
        httpx.post(f"{served.base_url}/ui/login", content=f"token=tml-guess-{i}", headers=_FORM).status_code
        for i in range(12)
    ]
    assert statuses[:10] == [303] * 10 and statuses[10:] == [429, 429]
    right = httpx.post(f"{served.base_url}/ui/login", content=f"token={TOKENS['bob']}", headers=_FORM)
    assert right.status_code == 429 and "try again in" in right.json()["message"]
    assert "set-cookie" not in right.headers
