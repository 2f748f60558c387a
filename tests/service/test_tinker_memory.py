"""A cookbook-sized RL batch through the Tinker SDK: bounded engine memory, little padding.

The tinker-cookbook's ``guess_number`` sends a ``forward_backward`` of 80 datums and about 69k
tokens, padded to about 1,700 positions each. In one padded pass its engine grew to 15-19 GB; with
micro-batches by token budget the engine process stays under 2 GB on the 6M-parameter tiny:bench.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import tinker
from tinker import types

from bench import descendant_pids, proc_status_kib
from icefloe.service.app import ServerThread
from tests.service.service_harness import make_app

API_KEY = "tml-icefloe-test"
ROWS, LOW, HIGH = 80, 100, 1700


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 70k tokens forward and backward on two shared CPU cores
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the engine's peak RSS from /proc (Linux)")
def test_guess_number_sized_forward_backward_keeps_the_engine_under_2_gb(tmp_path):
    from icefloe.engines.models import resolve_model

    model = tmp_path / "models" / "tiny-bench"
    shutil.copytree(resolve_model("tiny:bench"), model)
    rng = random.Random(0)
    lengths = [HIGH] + [rng.randint(LOW, HIGH) for _ in range(ROWS - 1)]
    data = []
    for length in lengths:
        tokens = [rng.randrange(4, 99) for _ in range(length + 1)]
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": [-4.6] * length,
            "advantages": [rng.uniform(-1, 1)] * length,
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))

    service_app = make_app(tmp_path / "serve", engines="process", tokens=[API_KEY], model_root=model.parent)
    with ServerThread(service_app) as base_url, tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as service:
        before = descendant_pids(os.getpid())
        training = service.create_lora_training_client(base_model=str(model), rank=32).result()
        result = training.forward_backward(data, "importance_sampling").result()
        engines = descendant_pids(os.getpid()) - before
        peak_bytes = max(proc_status_kib(pid, "VmHWM") for pid in engines) * 1024
        assert training.optim_step(types.AdamParams(learning_rate=1e-4)).result() is not None

    assert sum(lengths) > 65_000
    assert [len(out["logprobs"].tolist()) for out in result.loss_fn_outputs] == lengths  # every datum, in order
    assert result.metrics["padding_ratio:mean"] <= 1.1
    assert peak_bytes < 2 * 2**30, f"engine peak RSS {peak_bytes / 2**30:.2f} GiB"
