"""The unmodified ``tinker`` SDK (0.38.0) against ``icefloe serve`` on a real uvicorn, with the tiny chat model."""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types
from typer.testing import CliRunner

from icefloe.cli import app
from icefloe.service.app import ServerThread
from tests.service.service_harness import make_app

API_KEY = "tml-icefloe-test"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The exported tiny:chat folder, which the SDK and the service both load offline."""
    folder = str(tmp_path_factory.mktemp("models") / "tiny-chat")
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", folder]).exit_code == 0
    from icefloe.engines.models import load_tokenizer

    load_tokenizer(folder)  # imports transformers now: a test's SDK and its server importing it at once can fail
    return folder


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, model):
    root = Path(model).parent
    service_app = make_app(
        tmp_path_factory.mktemp("serve"), slots=8, engines="local", tokens=[API_KEY], model_root=root
    )
    with ServerThread(service_app) as url:
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


def test_forward_backward_and_optim_step_lower_the_loss(service, model):
    by_name = service.create_lora_training_client(base_model=Path(model).name, rank=4).result()
    # The tokenizer is named as the caller named the model, never by the service's own path for it.
    assert by_name.get_info().model_data.tokenizer_id == Path(model).name
    training = service.create_lora_training_client(base_model=model, rank=4).result()
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


def _policy_data(tokenizer, text: str, logprobs: list[float], advantage: float) -> types.Datum:
    tokens = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": logprobs,
            "advantages": [advantage] * (len(tokens) - 1),
        },
    )


def test_forward_logprobs_equal_compute_logprobs_of_saved_weights(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    datum = _sft_datum(tokenizer, "logprobs agree\n")
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("after-one-step").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/after-one-step"
    sampler = service.create_sampling_client(model_path=path).result()
    tokens = tokenizer.encode("logprobs agree\n")
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    trained = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(tokens)
    assert prompt_logprobs[1:] == pytest.approx(trained, abs=1e-4)


def test_sample_returns_several_sequences_with_stops_logprobs_and_ids(service, model):
    sampler = service.create_sampling_client(base_model=model).result()
    tokenizer = sampler.get_tokenizer()
    stops = sorted(set(tokenizer.encode("aeiouAEIOU stn")))
    prompt = types.ModelInput.from_ints(tokenizer.encode("Q: say something\nA:"))
    params = types.SamplingParams(max_tokens=40, temperature=1.0, stop=stops, seed=3)
    response = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(response.sequences) == 3
    assert len({seq.sequence_id for seq in response.sequences}) == 3
    for seq in response.sequences:
        assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)
        assert not set(seq.tokens[:-1]) & set(stops)  # nothing stops before the stop token
        if seq.stop_reason == "stop":
            assert seq.tokens[-1] in stops  # the stop token is the last one returned
    assert any(seq.stop_reason == "stop" for seq in response.sequences)
    unstoppable = types.SamplingParams(max_tokens=5, stop=[], seed=3)
    response = sampler.sample(prompt, num_samples=2, sampling_params=unstoppable).result()
    assert [(seq.stop_reason, len(seq.tokens)) for seq in response.sequences] == [("length", 5)] * 2


def test_sample_calls_sent_back_to_back_each_get_their_own_answer(service, model):
    sampler = service.create_sampling_client(base_model=model).result()
    tokenizer = sampler.get_tokenizer()
    calls = [(f"prompt {i}:", i % 3 + 1, i + 1) for i in range(6)]  # (text, num_samples, max_tokens)
    prompts = [types.ModelInput.from_ints(tokenizer.encode(text)) for text, _, _ in calls]
    futures = [
        sampler.sample(prompt, n, types.SamplingParams(max_tokens=m, stop=[]))
        for prompt, (_, n, m) in zip(prompts, calls, strict=True)
    ]  # nothing awaited until every call is sent: they reach the sampler together
    shapes = [[len(seq.tokens) for seq in future.result().sequences] for future in futures]
    assert shapes == [[m] * n for _, n, m in calls]


def test_unpickled_sampling_clients_join_the_session_and_never_share_a_seq_id(service, model):
    import pickle

    sampler = service.create_sampling_client(base_model=model).result()
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(2)]  # as worker processes get them
    prompt = types.ModelInput.from_ints(sampler.get_tokenizer().encode("clones"))
    lengths = [
        len(client.sample(prompt, 1, types.SamplingParams(max_tokens=length, stop=[])).result().sequences[0].tokens)
        for client, length in zip([sampler, *clones], [2, 3, 4], strict=True)
    ]  # each client's first seq_id, one after another: a shared one would get the first client's answer back
    assert lengths == [2, 3, 4]


def test_a_cancelled_sample_that_has_not_started_never_runs(base_url, model):
    import httpx

    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        assert http.post("/client/dynamic_config", json={}).json()["sample_cancel_enabled"]  # the SDK sends cancels
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": model}
        sampling_session_id = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]

        def asample(seq_id: int, max_tokens: int) -> str:
            body = {"sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                    "sampling_params": {"max_tokens": max_tokens, "stop": []}}  # fmt: skip
            return http.post("/asample", json=body).json()["request_id"]

        def outcome(future_id: str) -> dict:
            while (answer := http.post("/retrieve_future", json={"request_id": future_id})).headers.get(
                "content-type", ""
            ).startswith("application/json") and answer.json().get("type") == "try_again":
                pass
            return answer.json() if answer.headers["content-type"].startswith("application/json") else {}

        running = asample(1, 400)  # keeps the sampler busy
        time.sleep(0.2)  # the first is decoding: the next call waits in the queue
        queued = asample(2, 4)
        assert http.post("/cancel_future", json={"request_id": queued}).status_code == 200
        assert "cancelled" in outcome(queued)["error"]
        assert outcome(running) == {}  # a protobuf SampleResponse: it ran to the end
        http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})


def test_a_sample_cancelled_while_its_job_is_still_starting_answers_as_a_user_error(tmp_path, model):
    """Since samples went through the one door, a sample cancelled before its job ran answered as a server
    error (its refusal reached the poll as an exception); before, it was a user error, as it is once queued."""
    import httpx

    from tests.service.service_client import PREFIX, TRAINING

    root = Path(model).parent
    service_app = make_app(tmp_path / "serve", slots=1, engines="local", tokens=[API_KEY], model_root=root)
    with ServerThread(service_app) as url, httpx.Client(base_url=url, timeout=60) as http:
        http.headers["Authorization"] = f"Bearer {API_KEY}"
        holder = http.post(PREFIX + "/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]  # the one slot
        deadline = time.monotonic() + 60
        while http.get(f"{PREFIX}/{holder}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        session_id = http.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": model}
        sampler = http.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        body = {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": 2}}  # fmt: skip
        future_id = http.post("/api/v1/asample", json=body).json()["request_id"]  # its job waits for the slot
        assert http.post("/api/v1/cancel_future", json={"request_id": future_id}).status_code == 200
        http.post(f"{PREFIX}/{holder}:cancel")  # the sampler's job starts now; the cancelled call never runs
        while (answer := http.post("/api/v1/retrieve_future", json={"request_id": future_id}).json()).get(
            "type"
        ) == "try_again":
            assert time.monotonic() < deadline
        assert answer == {"error": "cancelled by the caller", "category": "user"}


def test_a_sample_call_resent_while_the_first_copy_is_queued_gets_the_same_future(base_url, model):
    import concurrent.futures

    import httpx

    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": model}
        sampling_session_id = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]
        body = {"sampling_session_id": sampling_session_id, "seq_id": 7, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": 2}}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            copies = [pool.submit(http.post, "/asample", json=body) for _ in range(2)]
            answers = [copy.result().json() for copy in copies]
        assert answers[0] == answers[1]
        http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})


def test_top_k_prompt_logprobs_are_the_likeliest_tokens_at_each_position(service, model):
    sampler = service.create_sampling_client(base_model=model).result()
    tokens = sampler.get_tokenizer().encode("top k here")
    response = sampler.sample(
        types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True, topk_prompt_logprobs=3,
    ).result()  # fmt: skip
    topk, scored = response.topk_prompt_logprobs, response.prompt_logprobs
    assert topk[0] is None and len(topk) == len(tokens)
    for token, logprob, pairs in zip(tokens[1:], scored[1:], topk[1:], strict=True):
        values = [lp for _, lp in pairs]
        assert len(pairs) == 3 and values == sorted(values, reverse=True)
        assert logprob <= values[0] + 1e-5 and math.log(sum(math.exp(v) for v in values)) <= 1e-5
        assert dict(pairs).get(token, logprob) == pytest.approx(logprob, abs=1e-5)  # in the top k: the same value
    assert tokens[1] in [t for t, _ in topk[1]] or scored[1] < topk[1][-1][1]


def test_importance_sampling_and_ppo_losses_are_sums_over_tokens(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    texts = ["2+2=4", "one more rollout"]
    current = training.forward([_sft_datum(tokenizer, t) for t in texts], "cross_entropy").result()
    on_policy = [out["logprobs"].tolist() for out in current.loss_fn_outputs]
    data = [_policy_data(tokenizer, t, lp, adv) for t, lp, adv in zip(texts, on_policy, [1.0, -0.5], strict=True)]
    expected = -(1.0 * 4 - 0.5 * 15)  # ratio 1 on-policy: -Σ A over every target token
    result = training.forward_backward(data, "importance_sampling").result()
    assert result.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    ppo = training.forward(data, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    assert ppo.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    scored = [lp for out in ppo.loss_fn_outputs for lp in out["logprobs"].tolist()]
    assert scored == pytest.approx([lp for row in on_policy for lp in row], abs=1e-5)
    for datum in data:  # the sequence ratio over the second half of each row only
        width = len(datum.loss_fn_inputs["advantages"].data)
        datum.loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_numpy(
            np.asarray([0.0] * (width // 2) + [1.0] * (width - width // 2), dtype=np.float32)
        )
    gspo = training.forward(data, "gspo").result()
    assert gspo.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    shifted = [[lp - 0.1 for lp in row] for row in on_policy]  # every sequence ratio e^0.1, clipped at 1.05
    stale = [_policy_data(tokenizer, t, lp, 1.0) for t, lp in zip(texts, shifted, strict=True)]
    clipped = training.forward(stale, "gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}).result()
    assert clipped.metrics["loss:sum"] == pytest.approx(-1.05 * (4 + 15), rel=1e-4)


def test_save_state_then_resume_with_optimizer_continues_exactly(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    data = [_sft_datum(tokenizer, "resume me exactly")]
    adam = types.AdamParams(learning_rate=1e-2)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(adam).result()
    path = training.save_state("step-1").result().path
    assert path == f"tinker://{training.model_id}/weights/step-1"

    def one_more_step(client) -> float:
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
        return client.forward(data, "cross_entropy").result().metrics["loss:sum"]

    continued = one_more_step(training)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert one_more_step(resumed) == pytest.approx(continued, abs=1e-5)
    weights_only = service.create_training_client_from_state(path).result()
    assert one_more_step(weights_only) != pytest.approx(continued, abs=1e-5)  # fresh Adam moments


def test_async_ops_submitted_back_to_back_complete_in_order(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    data = [_sft_datum(tokenizer, "pipelined"), _sft_datum(tokenizer, "steps")]
    futures = []
    for step in range(4):  # nothing awaited until every op is submitted
        futures.append(training.forward_backward(data, "cross_entropy"))
        futures.append(training.optim_step(types.AdamParams(learning_rate=1e-2 * (step + 1))))
    results = [future.result() for future in futures]
    losses = [r.metrics["loss:sum"] for r in results[0::2]]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == 4  # each saw the step before it
    assert [r.metrics["learning_rate:mean"] for r in results[1::2]] == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_a_model_and_its_sampler_run_on_one_slot(tmp_path, model):
    root = Path(model).parent
    service_app = make_app(tmp_path / "serve", slots=1, engines="local", tokens=[API_KEY], model_root=root)
    with ServerThread(service_app) as url, tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        training = service.create_lora_training_client(base_model=model, rank=4).result()
        tokens = training.get_tokenizer().encode("one slot")
        training.forward_backward([_sft_datum(training.get_tokenizer(), "one slot")], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        assert len(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()) == len(tokens)


def test_a_sampler_waiting_for_a_slot_tells_the_sdk_user_why_within_one_poll(tmp_path, model, monkeypatch, caplog):
    """A Tinker sampling client waiting for a slot hung for minutes with nothing said to the SDK user."""
    import httpx

    from icefloe.service.tinker import routes
    from tests.service.service_client import PREFIX, TRAINING

    monkeypatch.setattr(routes, "_POLL_S", 0.5)  # a poll answers try_again after 0.5 s, not 30
    try_agains: list[bool] = []  # each try_again answered: did it carry a reason?
    told_after: list[int] = []  # how many try_agains had been answered when the SDK user was told

    def counted_try_again(future_id, state, job_id):
        answer = try_again(future_id, state, job_id)
        try_agains.append(b"queue_state_reason" in answer.body)
        return answer

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if told in record.getMessage():
                told_after.append(len(try_agains))

    try_again = routes._try_again
    monkeypatch.setattr(routes, "_try_again", counted_try_again)
    told = "Reason: waiting for 1 cpu slot(s): 0 of 1 free, 0 job(s) of yours ahead"
    root = Path(model).parent
    service_app = make_app(tmp_path / "serve", slots=1, engines="local", tokens=[API_KEY], model_root=root)
    with ServerThread(service_app) as url, httpx.Client(base_url=url + PREFIX, timeout=60) as http:
        http.headers["Authorization"] = f"Bearer {API_KEY}"
        holder = http.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]  # takes the one slot
        deadline = time.monotonic() + 60
        while http.get(f"/{holder}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        handler = Told()
        logging.getLogger("tinker").addHandler(handler)
        try:
            with (
                caplog.at_level("WARNING", logger="tinker"),
                tinker.ServiceClient(base_url=url, api_key=API_KEY) as service,
            ):
                sampler = service.create_sampling_client(base_model=model).result()
                future = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2))
                while not told_after:
                    assert time.monotonic() < deadline, [record.getMessage() for record in caplog.records]
                    time.sleep(0.05)
                http.post(f"/{holder}:cancel")
                assert len(future.result().sequences) == 1
        finally:
            logging.getLogger("tinker").removeHandler(handler)
    # Within one poll: the first try_again carried the reason, and the SDK said it before a second came.
    assert try_agains[0] and told_after[0] == 1, (try_agains, told_after)


def test_leaving_the_service_client_finishes_its_session(base_url, model):
    import httpx

    with tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as service:
        service.create_lora_training_client(base_model=model, rank=4).result()
        session_id = service.holder.get_session_id()
    headers = {"X-API-Key": API_KEY}
    answer = httpx.post(f"{base_url}/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert answer.status_code == 410
    refused = httpx.post(f"{base_url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"})
    assert refused.status_code == 401


def test_a_finished_or_lapsed_sessions_jobs_are_cancelled_with_the_reason(tmp_path, model):
    """A cancelled Tinker session's jobs ended with an empty reason."""
    import httpx

    from tests.service.service_client import PREFIX

    service_app = make_app(tmp_path / "serve", engines="local", model_root=Path(model).parent)
    with ServerThread(service_app) as url, httpx.Client(base_url=url, timeout=60) as http:
        sessions, jobs = {}, {}
        for name in ("finished", "lapsed"):
            session_id = sessions[name] = http.post("/api/v1/create_session", json={}).json()["session_id"]
            body = {"session_id": session_id, "model_seq_id": 0, "base_model": model}
            assert http.post("/api/v1/create_model", json=body).status_code == 200
            (jobs[name],) = service_app.state.tinker.sessions[session_id].jobs  # a finished session is forgotten
        http.post(f"/api/v1/sessions/{sessions['finished']}/finish", json={"reason": {"type": "success"}})
        service_app.state.tinker.session_lease_s = 0.2  # the other one sends no heartbeat from now on
        expected = {
            "finished": "its Tinker session was finished",
            "lapsed": "its Tinker session sent no heartbeat for 0.2 s",
        }
        deadline = time.monotonic() + 60
        for name, job_id in jobs.items():
            while (job := http.get(f"{PREFIX}/{job_id}").json())["status"] != "terminated":
                assert time.monotonic() < deadline, job
                time.sleep(0.05)
            assert job["reason"] == expected[name]
        assert http.post("/api/v1/session_heartbeat", json={"session_id": sessions["lapsed"]}).status_code == 410


def test_save_weights_and_get_sampling_client_and_a_custom_loss(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    datum = _sft_datum(tokenizer, "custom loss\n")

    def negative_log_likelihood(data, logprobs_list):
        loss = sum(-lp.sum() for lp in logprobs_list)
        return loss, {"nll": float(loss.detach())}

    custom = training.forward_backward_custom([datum], negative_log_likelihood).result()
    builtin = training.forward([datum], "cross_entropy").result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    tokens = tokenizer.encode("custom loss\n")
    trained = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:] == pytest.approx(trained, abs=1e-4)


def test_a_refused_op_uses_up_its_seq_id_and_the_next_op_runs(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    tokens = tokenizer.encode("no targets")
    missing_targets = types.Datum(
        model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"weights": [1.0] * 10}
    )
    with pytest.raises(tinker.BadRequestError, match="target_tokens is missing"):
        training.forward_backward([missing_targets], "cross_entropy").result()
    result = training.forward_backward([_sft_datum(tokenizer, "next one runs")], "cross_entropy").result()
    assert result.metrics["loss:sum"] > 0


def test_one_service_answers_the_tinker_sdk_and_the_training_api_at_once(service, base_url, model):
    from icefloe.client import Client
    from icefloe.config import ClientConfig

    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    pending = training.forward_backward([_sft_datum(tokenizer, "both APIs")], "cross_entropy")
    config = ClientConfig.build(model=model, backend={"type": "remote", "base_url": base_url, "pat": API_KEY})
    with Client(config) as client:
        (sample,) = client.generate([tokenizer.encode("both")], {"max_tokens": 3, "seed": 1})
    assert len(sample["token_ids"]) <= 3
    assert pending.result().metrics["loss:sum"] > 0


def test_rest_client_lists_a_runs_checkpoints_and_their_weights_info(service, base_url, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    state_path = training.save_state("kept").result().path
    sampler_path = training.save_weights_for_sampler("for-sampling").result().path
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert sorted((c.checkpoint_type, c.tinker_path) for c in listed) == [
        ("sampler", sampler_path),
        ("training", state_path),
    ]
    info = rest.get_weights_info_by_tinker_path(state_path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (model, True, 4)


def test_copy_weights_names_the_same_weights_under_a_new_run(service, base_url, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    training.forward_backward([_sft_datum(tokenizer, "copy me")], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    source = training.save_weights_for_sampler("to-copy").result().path
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    copied = rest.copy_weights(source, "any-project").result()
    assert copied.startswith("tinker://copy-") and copied.endswith("/sampler_weights/to-copy")
    info = rest.get_weights_info_by_tinker_path(copied).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (model, True, 4)
    prompt = types.ModelInput.from_ints(tokenizer.encode("copy me"))
    samplers = [service.create_sampling_client(model_path=path).result() for path in (source, copied)]
    assert samplers[0].compute_logprobs(prompt).result() == samplers[1].compute_logprobs(prompt).result()
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [source]  # the copy belongs to its own run


def test_a_resent_seq_id_gets_its_first_future_and_a_later_one_waits_its_turn(base_url, model):
    import concurrent.futures

    import httpx
    from tinker.proto.request_conv import forward_backward_request_to_proto

    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        created = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": model})
        model_id = created.json()["model_id"]
        future = {"request_id": created.json()["request_id"]}
        while http.post("/retrieve_future", json=future).json().get("type") == "try_again":
            pass  # long-polls until the model runs

        def optim_step() -> dict:  # seq_id 2: refused by the engine if it ran before the forward_backward
            return http.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}}).json()

        tokens = list(range(10, 20))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id=model_id,
            seq_id=1,
        )
        body = forward_backward_request_to_proto(request).SerializeToString()
        headers = {"Content-Type": "application/x-protobuf"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(optim_step)  # sent first: held until seq_id 1 is taken
            first = http.post("/forward_backward", content=body, headers=headers).json()
            assert http.post("/forward_backward", content=body, headers=headers).json() == first  # a resend
            step = http.post("/retrieve_future", json={"request_id": second.result()["request_id"]}).json()
        assert step["metrics"]["grad_norm:mean"] > 0  # the step saw the forward_backward's gradients
        http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})


def test_a_forward_backward_body_that_is_not_protobuf_is_refused_as_the_callers_mistake(base_url):
    import httpx

    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        answer = http.post(
            "/forward_backward", content=b"\xff\xff\xff", headers={"Content-Type": "application/x-protobuf"}
        )
    assert answer.status_code == 400
    assert "the body is not a ForwardBackwardRequest protobuf" in answer.text


def test_samples_complete_through_retrieve_futures_when_the_service_advertises_it(tmp_path, model):
    import httpx

    service_app = make_app(tmp_path / "serve", engines="local", tokens=[API_KEY], model_root=Path(model).parent)
    service_app.state.tinker.advertise_retrieve_futures = True
    with ServerThread(service_app) as url, tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        sampler = service.create_sampling_client(base_model=model).result()
        prompt = types.ModelInput.from_ints([5, 6, 7])
        futures = [sampler.sample(prompt, n, types.SamplingParams(max_tokens=n + 1, stop=[])) for n in (1, 2, 3)]
        shapes = [[len(seq.tokens) for seq in future.result().sequences] for future in futures]
        assert shapes == [[2], [3, 3], [4, 4, 4]]
        handle = json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))  # names the sampling session
        poll = {"target": {"sampling_session_id": handle["sampling_session_id"]}, "prev_cursor": 0, "timeout": 0}
        with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": API_KEY}) as http:
            deadline = time.monotonic() + 30
            while (answer := http.post("/retrieve_futures", json=poll).json())["completions"]:
                assert time.monotonic() < deadline, f"the SDK never acknowledged its completions: {answer}"
        assert answer["cursor"] == 3  # the SDK read all three through retrieve_futures and acknowledged them


def test_stable_reinforce_and_unserved_sample_fields_are_refused_by_name(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    datum = _policy_data(tokenizer, "stable?", [-1.0] * 6, 1.0)
    with pytest.raises(tinker.BadRequestError, match=r"'stable_reinforce' is not served.*'importance_sampling'"):
        training.forward_backward([datum], "stable_reinforce").result()
    sampler = service.create_sampling_client(base_model=model).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("refused"))
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs=2 is not served"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=2).result()
    recording = service.create_sampling_client(base_model=model, record_stability_info=True).result()
    with pytest.raises(tinker.BadRequestError, match="record_stability_info=true is not served"):
        recording.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def test_prompt_logprobs_last_n_scores_only_the_prompts_tail(service, model):
    sampler = service.create_sampling_client(base_model=model).result()
    prompt = types.ModelInput.from_ints(sampler.get_tokenizer().encode("only the tail"))
    params = types.SamplingParams(max_tokens=1)
    full = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result().prompt_logprobs
    tail = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=3).result()
    assert tail.prompt_logprobs[:-3] == [None] * (len(full) - 3)
    assert tail.prompt_logprobs[-3:] == pytest.approx(full[-3:], abs=1e-5)


def test_a_loss_made_with_create_custom_loss_runs_client_side(service, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    datum = _sft_datum(training.get_tokenizer(), "traced loss\n")

    def weighted_nll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/weighted_nll:sum": loss}

    handle = service.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None  # client/config leaves custom_loss_server_side off
    custom = training.forward_backward_custom([datum], handle).result()
    builtin = training.forward([datum], "cross_entropy").result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert custom.metrics["custom/weighted_nll:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)


def _flat(output) -> list[float]:
    return [lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist()]


def test_a_batch_the_sdk_splits_into_chunks_completes_and_matches_one_request(service, model):
    """The SDK sends chunks 2..n of a big batch first and waits for their answers before it sends
    chunk 1: a service that held each POST until the seq_id before it arrived never finished."""
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    distinct = [_sft_datum(tokenizer, text) for text in ("a b", "cd e", "fgh")]
    repeats = 350  # 1050 datums: more than the SDK's 1024 per request
    reference = training.forward(distinct, "cross_entropy").result()
    chunked = training.forward(distinct * repeats, "cross_entropy").result()
    assert _flat(chunked) == pytest.approx(_flat(reference) * repeats, abs=1e-5)
    assert chunked.metrics["loss:sum"] == pytest.approx(repeats * reference.metrics["loss:sum"], rel=1e-4)
    trained = training.forward_backward(distinct * repeats, "cross_entropy").result()
    assert trained.metrics["loss:sum"] == pytest.approx(repeats * reference.metrics["loss:sum"], rel=1e-4)
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"] > 0


def test_a_datum_or_sample_beyond_the_models_context_is_refused_in_tinker_terms(service, model):
    """The limit was a fixed 2048 (tiny:chat holds 512 positions), and the errors named icefloe's
    kwargs.input_ids and max_seq_len; a sample past it came back short with stop_reason length."""
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    long_datum = _sft_datum(tokenizer, "x" * 601)
    with pytest.raises(tinker.BadRequestError, match=r"data\.1\.model_input has 600 tokens; .* context of 512 tokens"):
        training.forward([_sft_datum(tokenizer, "fits"), long_datum], "cross_entropy").result()
    assert training.forward([_sft_datum(tokenizer, "x" * 513)], "cross_entropy").result().metrics["loss:sum"] > 0
    sampler = service.create_sampling_client(base_model=model).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("0123456789"))
    too_long = types.SamplingParams(max_tokens=503, temperature=1.0)
    with pytest.raises(tinker.BadRequestError, match=r"prompt \(10 tokens\) \+ max_tokens \(503\).*512.*at most 502"):
        sampler.sample(prompt, num_samples=1, sampling_params=too_long).result()


def test_a_policy_loss_refuses_a_datum_without_logprobs_even_when_another_has_them(service, model):
    """Logprobs given in one datum only were zero-filled in the others: a ratio of exp(logp), silently."""
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokenizer = training.get_tokenizer()
    with_logprobs = _policy_data(tokenizer, "2+2=4", [-1.0] * 4, 1.0)
    without = _policy_data(tokenizer, "3+3=6", [-1.0] * 4, 1.0)
    del without.loss_fn_inputs["logprobs"]
    with pytest.raises(tinker.BadRequestError, match=r"data\.1\.loss_fn_inputs\.logprobs is missing"):
        training.forward_backward([with_logprobs, without], "importance_sampling").result()
    masked = _policy_data(tokenizer, "4+4=8", [-1.0] * 4, 1.0)
    masked.loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_numpy(np.ones(4, dtype=np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"data\.0\.loss_fn_inputs\.sequence_ratio_mask is missing"):
        training.forward_backward([with_logprobs, masked], "gspo").result()


def test_top_k_targets_give_top_k_logprobs(service, model):
    """(N, K) target_tokens and weights (top-K distillation) were refused, first as 'N*K values for N
    tokens', then by name; each of the K columns is scored, and the log-probs come back (N, K)."""
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    tokens = training.get_tokenizer().encode("distil me")
    targets = np.asarray([tokens[1:], tokens[1:]], dtype=np.int64).T  # (N, 2)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(targets),
            "weights": types.TensorData.from_numpy(np.full(targets.shape, 0.5, dtype=np.float32)),
        },
    )
    result = training.forward_backward([datum], "cross_entropy").result()
    logprobs = result.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (8, 2) and (logprobs[:, 0] == logprobs[:, 1]).all()
    assert result.metrics["loss:sum"] == pytest.approx(-0.5 * logprobs.sum(), rel=1e-5)


def test_a_sampler_forgets_the_answer_of_a_seq_id_long_past(base_url, model, monkeypatch):
    """Every sample call's answer was kept for the life of the service, for a resend that never comes."""
    import httpx

    from icefloe.service.tinker import state as tinker_state

    monkeypatch.setattr(tinker_state, "FUTURES_KEPT", 2)
    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": model}
        sampling_session_id = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]

        def asample(seq_id: int) -> str:
            body = {"sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                    "sampling_params": {"max_tokens": 1}}  # fmt: skip
            return http.post("/asample", json=body).json()["request_id"]

        first = asample(1)
        assert asample(1) == first  # a resend, still remembered
        asample(2)
        asample(3)  # two numbers later: seq_id 1 is forgotten
        assert asample(1) != first
        http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})


def test_server_capabilities_list_the_served_model_as_skyrl_checks_it(base_url, model, monkeypatch):
    """SkyRL's Tinker API test_capabilities: the SDK's get_server_capabilities lists the model the test
    trains. It was a 404, so the SDK's own raise_if_tinker_not_accessible() failed too."""
    from tinker.auth import raise_if_tinker_not_accessible

    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    capabilities = rest.get_server_capabilities().result()
    served = {item.model_name: item for item in capabilities.supported_models}
    assert Path(model).name in served and "tiny:chat" in served  # by the name create_model takes
    assert served[Path(model).name].max_context_length == 512 and served["tiny:chat"].trainable
    assert not any(name.startswith("/") for name in served)  # never the server's own path
    monkeypatch.setenv("TINKER_BASE_URL", base_url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    raise_if_tinker_not_accessible()


def test_rest_client_lists_runs_and_user_checkpoints_and_deletes_one(service, base_url, model):
    training = service.create_lora_training_client(base_model=model, rank=4).result()
    kept = training.save_state("kept").result().path
    dropped = training.save_state("dropped").result().path
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    runs = rest.list_training_runs(limit=1000).result()
    assert training.model_id in [run.training_run_id for run in runs.training_runs]
    run = rest.get_training_run(training.model_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == (model, True, 4)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == dropped
    mine = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert {kept, dropped} <= set(mine)
    rest.delete_checkpoint_from_tinker_path(dropped).result()
    listed = [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert listed == [kept]
    with pytest.raises(tinker.NotFoundError, match="not found"):
        rest.get_weights_info_by_tinker_path(dropped).result()
    with pytest.raises(tinker.NotFoundError, match="session some-session not found"):
        rest.get_session("some-session").result()


def test_save_weights_external_gives_download_links_to_a_peft_folder(service, base_url, model, tmp_path):
    import urllib.request

    from safetensors.torch import load_file

    training = service.create_lora_training_client(base_model=model, rank=4).result()
    exported = training.save_weights_external("exported").result().path
    assert exported == f"tinker://{training.model_id}/external_weights/exported"
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    urls = rest.get_external_weights_urls(exported).result().urls
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls)
    assert all(url.startswith(f"{base_url}/files/") for url in urls.values())
    for name, url in urls.items():
        urllib.request.urlretrieve(url, tmp_path / name)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert tensors and all("lora_" in key for key in tensors)


def test_target_prompt_logprobs_score_the_ids_asked_for(service, model):
    import torch

    sampler = service.create_sampling_client(base_model=model).result()
    tokens = sampler.get_tokenizer().encode("score these")
    prompt = types.ModelInput.from_ints(tokens)
    wanted = torch.full((len(tokens) - 1, 2), -1, dtype=torch.int64)
    wanted[:, 0] = torch.tensor(tokens[1:])
    wanted[2, 1] = 7
    for targets in (types.TensorData.from_torch(wanted), types.TensorData.from_torch_sparse(wanted, pad_value=-1)):
        response = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                                  target_prompt_logprobs=targets).result()  # fmt: skip
        scored = np.asarray(response.target_prompt_logprobs.data).reshape(len(tokens) - 1, 2)
        assert scored[:, 0] == pytest.approx(response.prompt_logprobs[1:], abs=1e-5)
        assert scored[2, 1] < 0 and (np.delete(scored[:, 1], 2) == 0).all()


def test_a_finished_session_is_pruned_from_memory_and_its_run_stays_listed(tmp_path, model):
    service_app = make_app(tmp_path / "serve", engines="local", tokens=[API_KEY], model_root=Path(model).parent)
    with ServerThread(service_app) as url:
        with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
            training = service.create_lora_training_client(base_model=model, rank=4).result()
            path = training.save_state("kept").result().path
            state = service_app.state.tinker
            assert training.model_id in state.models and state.sessions
        assert not state.sessions and not state.models and not state.samplers  # pruned: nothing kept per session
        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [path]
        assert rest.get_training_run(training.model_id).result().training_run_id == training.model_id


def test_an_op_that_waits_past_the_gap_timeout_fails_and_the_number_it_waited_for_is_refused(tmp_path, model):
    """Held for a seq_id that never comes, an op gives up after the gap timeout; the missing number is late."""
    import httpx

    service_app = make_app(
        tmp_path, slots=2, engines="local", tokens=[API_KEY], model_root=Path(model).parent,
        sequence_gap_timeout_s=0.5,
    )  # fmt: skip
    with (
        ServerThread(service_app) as url,
        httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http,
    ):
        session_id = http.post("/create_session", json={}).json()["session_id"]
        created = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": model})
        model_id = created.json()["model_id"]
        while (
            http.post("/retrieve_future", json={"request_id": created.json()["request_id"]}).json().get("type")
            == "try_again"
        ):
            pass  # long-polls until the model runs
        step = {"model_id": model_id, "seq_id": 2, "adam_params": {}}
        held = http.post("/optim_step", json=step).json()
        assert "never arrived" in http.post("/retrieve_future", json=held).json()["error"]
        late = http.post("/optim_step", json={**step, "seq_id": 1})
        assert late.status_code == 400 and "moved on past it" in late.json()["message"]
        assert http.post("/optim_step", json=step).json() == held  # a resend of the one that gave up
        http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})
