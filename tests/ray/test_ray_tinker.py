"""The Tinker API on ``icefloe serve --engines ray``: forward-backward log-probs and Adam parameters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray  # noqa: F401 (the dev extra installs it: fail, never skip)
import tinker
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)
from tinker import types
from typer.testing import CliRunner

from icefloe.cli import app
from icefloe.service.app import ServerThread
from tests.service.service_harness import make_app

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a service, its Ray actors and an SDK round trip
def test_tinker_forward_backward_and_optim_step_on_ray_engines(ray_session, tmp_path):
    """The Ray trainer group dropped the per-row log-probs and refused the Adam parameters."""
    model = str(tmp_path / "models" / "tiny-chat")  # the data dir must not lie under the model root
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", model]).exit_code == 0
    service_app = make_app(
        tmp_path / "serve", slots=2, engines="ray", tokens=["tml-icefloe-test"], model_root=Path(model).parent
    )
    with (
        ServerThread(service_app) as base_url,
        tinker.ServiceClient(base_url=base_url, api_key="tml-icefloe-test") as service,
    ):
        training = service.create_lora_training_client(base_model=model, rank=4).result()
        tokens = training.get_tokenizer().encode("Tinker on icefloe!")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        result = training.forward_backward([datum], "cross_entropy").result()
        (logprobs,) = [out["logprobs"].tolist() for out in result.loss_fn_outputs]
        assert len(logprobs) == len(tokens) - 1
        assert math.isclose(result.metrics["loss:sum"], -sum(logprobs), rel_tol=1e-4)
        adam = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.95, grad_clip_norm=1.0)
        assert training.optim_step(adam).result().metrics["learning_rate:mean"] == pytest.approx(1e-2)
