"""The unmodified ``tinker`` SDK (0.38.0) against ``icefloe serve`` on a real uvicorn, with the tiny chat model."""

from __future__ import annotations

import math

import pytest

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from icefloe.service.app import ServerThread  # noqa: E402
from tests.service.service_harness import make_app  # noqa: E402

MODEL = "tiny:chat"
API_KEY = "tml-icefloe-test"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    app = make_app(tmp_path_factory.mktemp("serve"), slots=8, engines="local", tokens=[API_KEY])
    with ServerThread(app) as url:
        yield url


@pytest.fixture
def service(base_url):
    with tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as client:
        yield client


def _sft_datum(tokenizer, text: str) -> types.Datum:
    tokens = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_forward_backward_and_optim_step_lower_the_loss(service):
    training = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    assert training.get_info().is_lora and training.get_info().lora_rank == 4
    tokenizer = training.get_tokenizer()
    data = [_sft_datum(tokenizer, "hello world\n"), _sft_datum(tokenizer, "Tinker on icefloe!")]
    adam = types.AdamParams(learning_rate=1e-2)
    losses = []
    for _ in range(4):
        result = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
        losses.append(result.metrics["loss:sum"])
        assert [len(out["logprobs"].tolist()) for out in result.loss_fn_outputs] == [11, 17]
    assert losses[-1] < losses[0]
    expected = -sum(sum(out["logprobs"].tolist()) for out in result.loss_fn_outputs)
    assert math.isclose(result.metrics["loss:sum"], expected, rel_tol=1e-4)
