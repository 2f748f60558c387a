"""A tenant's generate with a prefill far past its deadline on a shared host of a real ``icefloe serve``.

A generate's prefill was one forward over the prompts of its whole decode batch: long prompts made it
one step of many seconds, which its deadline could not stop, so a grace later the watcher killed the
shared engine process and every other tenant's job on it lost its engines. Now prompts are prefilled
in passes, and a generate stops between two like a forward-backward between its passes.
"""

from __future__ import annotations

import pytest
import torch

from .serve_process import Serve, create_shared_lora_job, gone
from .tinker_serve import TOKENS, token_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_DEADLINE_S = 3
_PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
# A LoRA sampler on the largest tiny model, whose context holds prompts of thousands of tokens.
_SAMPLER = {
    "job_type": "sampling",
    "model_name": "tiny:bench",
    "inference_config": {"max_seq_len": 2048, "peft_config": _PEFT},
}
# 16 prompts of 1,990 tokens: one decode batch whose prefill is many deadlines (and graces) long on a CPU.
_ROWS, _WIDTH = 16, 1990


def _long_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(5, 90, (_ROWS, _WIDTH), generator=generator).tolist()


def test_a_generate_whose_prefill_is_past_its_deadline_fails_its_own_job_not_the_shared_host(tmp_path):
    tokens = token_file(tmp_path / "tokens")
    with Serve(tmp_path / "serve", "--token-file", str(tokens), "--op-deadline-s", str(_DEADLINE_S)) as serve:
        serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"
        alice = create_shared_lora_job(serve, TOKENS["alice"], _SAMPLER)
        bob = create_shared_lora_job(serve, TOKENS["bob"], _SAMPLER)
        for job_id in (alice, bob):
            serve.wait_job(job_id, "running")
        hosts = {job["job_id"]: job["host"]["host_id"] for job in serve.call("GET", "/")["jobs"]}
        assert hosts[alice] == hosts[bob], "both runs share one host"
        engine = serve.engine_pid(alice)
        small = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 4, "seed": 1}}
        before = serve.run(bob, "generate", small)

        long = serve.submit(alice, "generate", {"prompts": _long_prompts(), "sampling_params": {"max_tokens": 2}})
        beside = serve.submit(bob, "generate", small)  # queued while alice's prefill runs
        failed = serve.finished(alice, long)
        assert failed["status"] == "failed"
        assert failed["error"].startswith(
            f"generate on {alice}:sampling:0 did not finish within its deadline of {_DEADLINE_S} s; "
            "stopped at its next pass or decode step"
        )
        job = serve.wait_job(alice, "failed")
        assert bob not in job["reason"] and hosts[bob] not in job["reason"]

        assert serve.finished(bob, beside)["status"] == "done"
        assert serve.run(bob, "generate", small)["results"] == before["results"]
        assert serve.call("GET", f"/{bob}")["status"] == "running"
        assert not gone(engine), "the shared engine process was not killed"
