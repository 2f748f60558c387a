"""Job logs of two tenants' samplers on one shared host of a real ``icefloe serve``, read by the tenant
who did not send the op: what an engine warns about one run's call must reach that run's log alone."""

from __future__ import annotations

import threading

import pytest

from .serve_process import Serve, create_shared_lora_job
from .tinker_serve import TOKENS, token_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
_SAMPLER = {
    "job_type": "sampling",
    "model_name": "tiny:chat",
    "inference_config": {"max_seq_len": 256, "peft_config": _PEFT},
}
_MARK = 777_000  # stop token ids far outside tiny:chat's vocabulary: the sampling engine warns naming them
_NAMED = "stop_token_ids [77700"  # how the warning names one of _MARK .. _MARK + 9


def _log_lines(serve: Serve, job_id: str) -> list[str]:
    page = serve.call(
        "POST", f"/{job_id}/operation", json={"operation_type": "tail-logs", "payload": {"max_lines": 1000}}
    )
    return [entry["msg"] for entry in page["entries"]]


def test_a_warning_about_one_tenants_generate_stays_out_of_the_other_tenants_log(tmp_path):
    """Alice's generates with unknown stop_token_ids warned naming them; each warning also reached the
    log of Bob's sampler, whose generates shared the decode batch (10 of 10 while Bob kept 8-prompt
    generates going): Bob read Alice's sampling parameters in his own job's log."""
    tokens = token_file(tmp_path / "tokens")
    with Serve(tmp_path / "serve", "--token-file", str(tokens)) as serve:
        serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"
        alice = create_shared_lora_job(serve, TOKENS["alice"], _SAMPLER)
        bob = create_shared_lora_job(serve, TOKENS["bob"], _SAMPLER)
        for job_id in (alice, bob):
            serve.wait_job(job_id, "running")
        done = threading.Event()

        def keep_bob_sampling() -> None:
            while not done.is_set():
                serve.run(bob, "generate", {"prompts": [[5, 6, 7, 8]] * 8, "sampling_params": {"max_tokens": 50}})

        flood = threading.Thread(target=keep_bob_sampling)
        flood.start()
        try:
            for attempt in range(10):
                params = {"max_tokens": 20, "stop_token_ids": [_MARK + attempt]}
                serve.run(alice, "generate", {"prompts": [[5, 6, 7, 8]], "sampling_params": params})
        finally:
            done.set()
            flood.join()

        assert sum(_NAMED in line for line in _log_lines(serve, alice)) == 10  # the engine warned each time
        assert [line for line in _log_lines(serve, bob) if _NAMED in line] == []
