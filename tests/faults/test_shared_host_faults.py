"""Two tenants' LoRA runs on one shared host of a real ``icefloe serve``: one run's op past its deadline.

The deadline used to kill the shared engine process, failing the other tenant's job too, with the
first job's id in its reason. Now the op stops at its next pass, its own job fails, and the other
run goes on on the same engine process.
"""

from __future__ import annotations

import pytest
import torch

from ..service.service_batches import canonical_batch, small_batch
from .serve_process import Serve, create_shared_lora_job, gone
from .tinker_serve import TOKENS, token_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_DEADLINE_S = 2


def _long_batch() -> dict:
    """3,072 rows of 60 tokens: about a hundred passes, many deadlines long on a CPU."""
    generator = torch.Generator().manual_seed(7)
    rows = [(torch.randint(1, 15, (30,), generator=generator).tolist(),
             torch.randint(1, 15, (30,), generator=generator).tolist()) for _ in range(3072)]  # fmt: skip
    return canonical_batch(rows, [1.0, -1.0] * 1536)


def test_an_op_past_its_deadline_on_a_shared_host_fails_its_own_job_and_the_other_tenants_run_goes_on(tmp_path):
    tokens = token_file(tmp_path / "tokens")
    with Serve(tmp_path / "serve", "--token-file", str(tokens), "--op-deadline-s", str(_DEADLINE_S)) as serve:
        serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"
        alice, bob = create_shared_lora_job(serve, TOKENS["alice"]), create_shared_lora_job(serve, TOKENS["bob"])
        for job_id in (alice, bob):
            serve.wait_job(job_id, "running")
        hosts = {job["job_id"]: job["host"]["host_id"] for job in serve.call("GET", "/")["jobs"]}
        assert hosts[alice] == hosts[bob], "both runs share one host"
        engine = serve.engine_pid(alice)
        before = serve.run(bob, "forward-backward", small_batch(1))

        long = serve.submit(alice, "forward-backward", _long_batch())
        beside = serve.submit(bob, "forward-backward", small_batch(1))  # queued while alice's op runs
        failed = serve.finished(alice, long)
        assert failed["status"] == "failed"
        assert failed["error"].startswith(
            f"forward-backward on {alice}:training:0 did not finish within its deadline of {_DEADLINE_S} s; "
            "stopped at its next pass or decode step"
        )
        job = serve.wait_job(alice, "failed")
        assert job["reason"].endswith("stopped at its next pass or decode step; no checkpoint was saved")
        assert bob not in job["reason"] and hosts[bob] not in job["reason"]

        assert serve.finished(bob, beside)["status"] == "done"
        again = serve.run(bob, "forward-backward", small_batch(1))
        assert again["num_tokens"] == before["num_tokens"]
        assert serve.run(bob, "step", {})["global_steps"] == 1
        assert serve.call("GET", f"/{bob}")["status"] == "running"
        assert not gone(engine), "the shared engine process was not killed"
