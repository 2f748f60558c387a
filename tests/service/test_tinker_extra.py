"""Without the ``tinker`` extra, the Tinker API's routes answer 501 naming the install."""

from __future__ import annotations

import importlib.util

import pytest

from tests.service.service_harness import asgi_client, make_app


@pytest.mark.anyio
async def test_tinker_routes_answer_501_with_the_install_hint_without_the_extra(data_dir, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tinker" else find_spec(name, *a))
    async with asgi_client(make_app(data_dir)) as client:
        answer = await client.post("/api/v1/create_session", json={})
        health = await client.get("/health")
    assert answer.status_code == 501
    assert "pip install 'icefloe[tinker]'" in answer.json()["message"]
    assert health.status_code == 200  # the rest of the service is unaffected
