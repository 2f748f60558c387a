"""A tenant's training-API forward far past its deadline on a shared host of a real ``icefloe serve``.

A forward was one engine call: nothing could stop it at the deadline, so a grace later the watcher killed
the shared engine process and every other tenant's job on it lost its engines and its queued ops. Now a
forward runs as calls of a bounded size, and stops between two like a forward-backward.
"""

from __future__ import annotations

import pytest
import torch

from ..service.service_batches import canonical_batch, small_batch
from .serve_process import Serve, create_shared_lora_job, gone
from .tinker_serve import TOKENS, token_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_DEADLINE_S = 1
# 16,384 rows of 60 tokens: a forward many deadlines (and graces) long on a CPU.
_ROWS = 16384


def _long_batch(rows: int) -> dict:
    generator = torch.Generator().manual_seed(7)
    pairs = [(torch.randint(1, 15, (30,), generator=generator).tolist(),
              torch.randint(1, 15, (30,), generator=generator).tolist()) for _ in range(rows)]  # fmt: skip
    return canonical_batch(pairs, [1.0, -1.0] * (rows // 2))


def test_a_long_forward_past_its_deadline_fails_its_own_job_not_the_shared_host(tmp_path):
    tokens = token_file(tmp_path / "tokens")
    with Serve(tmp_path / "serve", "--token-file", str(tokens), "--op-deadline-s", str(_DEADLINE_S)) as serve:
        serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"
        alice, bob = create_shared_lora_job(serve, TOKENS["alice"]), create_shared_lora_job(serve, TOKENS["bob"])
        for job_id in (alice, bob):
            serve.wait_job(job_id, "running")
        engine = serve.engine_pid(alice)
        serve.run(bob, "forward-backward", small_batch(1))

        long = serve.submit(alice, "forward", _long_batch(_ROWS))
        beside = serve.submit(bob, "forward-backward", small_batch(1))
        failed = serve.finished(alice, long)
        assert failed["status"] == "failed"
        assert failed["error"].startswith(
            f"forward on {alice}:training:0 did not finish within its deadline of {_DEADLINE_S} s; "
            "stopped at its next pass or decode step"
        )
        assert serve.wait_job(alice, "failed")["reason"].endswith("no checkpoint was saved")

        assert serve.finished(bob, beside)["status"] == "done"
        assert serve.run(bob, "forward-backward", small_batch(1))["num_tokens"] > 0
        assert serve.call("GET", f"/{bob}")["status"] == "running"
        assert not gone(engine), "the shared engine process was not killed"
