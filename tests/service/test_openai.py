"""The official ``openai`` SDK against ``icefloe serve`` on a real uvicorn: completions and chat, streamed
and not, on a base model, a Tinker sampler checkpoint and a training-API checkpoint, with two tenants."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types
from typer.testing import CliRunner

from icefloe.cli import app
from icefloe.service.app import ServerThread

from .service_client import Api
from .service_harness import make_app

ROOT = Path(__file__).resolve().parents[2]
ALICE, BOB, ADMIN = "tml-alice-token", "tml-bob-token", "tml-admin-token"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A model root with the tiny chat model twice: without a chat template, and with one."""
    root = tmp_path_factory.mktemp("models")
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", str(root / "tiny-chat")]).exit_code == 0
    shutil.copytree(root / "tiny-chat", root / "tiny-chat-template")
    config_path = root / "tiny-chat-template" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    from icefloe.engines.models import load_tokenizer

    load_tokenizer(root / "tiny-chat")  # imports transformers now, not in the SDK and the server at once
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    tenants = {"alice": (ALICE,), "bob": (BOB,), "admin": (ADMIN,)}
    service = make_app(
        tmp_path_factory.mktemp("serve"), slots=8, engines="local", tenant_tokens=tenants, model_root=models,
        max_samples_per_request=128,
    )  # fmt: skip
    with ServerThread(service) as url:
        yield url, service


@pytest.fixture(scope="module")
def example():
    """examples/openai/eval_arithmetic.py, imported."""
    spec = importlib.util.spec_from_file_location("eval_arithmetic", ROOT / "examples/openai/eval_arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def alice(server):
    with openai.OpenAI(base_url=f"{server[0]}/oai/v1", api_key=ALICE, max_retries=0) as client:
        yield client


@pytest.fixture
def bob(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key=BOB, max_retries=0) as client:
        yield client


def test_completion_answers_in_openai_schema_with_n_choices_per_prompt(alice):
    answer = alice.completions.create(model="tiny-chat", prompt=["Hello", "Bye"], n=3, max_tokens=5, seed=1)
    assert answer.object == "text_completion" and answer.model == "tiny-chat" and answer.id.startswith("cmpl-")
    assert [c.index for c in answer.choices] == list(range(6))
    assert all(c.finish_reason in ("stop", "length") and c.logprobs is None for c in answer.choices)
    assert answer.usage.prompt_tokens == len("Hello") + len("Bye")
    assert 0 < answer.usage.completion_tokens <= 6 * 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_seed_reproduces_the_choices_and_a_stop_string_ends_them(alice):
    def ask(**extra):
        answer = alice.completions.create(model="tiny-chat", prompt="x", n=4, max_tokens=40, seed=7, **extra)
        return [c.text for c in answer.choices]

    first = ask()
    assert ask() == first and len(set(first)) > 1  # the seed fixes each choice; choices differ from each other
    stop = next(ch for ch in first[0][3:] if ch.strip())  # a character the first choice says later
    stopped = alice.completions.create(
        model="tiny-chat", prompt="x", n=4, max_tokens=40, seed=7, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].text == first[0][: first[0].index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert all(stop not in c.text for c in stopped.choices)


def test_logprobs_and_top_logprobs_of_completions_and_chat(alice):
    answer = alice.completions.create(model="tiny-chat", prompt="ab", max_tokens=6, logprobs=3, seed=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= max(top.values()) + 1e-6 and logprob <= 0
        assert sorted(top.values(), reverse=True) == list(top.values())
        assert token not in top or top[token] == pytest.approx(logprob, abs=1e-5)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]

    chat = alice.chat.completions.create(
        model="tiny-chat-template", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
        top_logprobs=2, seed=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_echo_prompt_logprobs_equal_tinker_compute_logprobs(server, models, alice):
    url, _ = server
    with tinker.ServiceClient(base_url=url, api_key=ALICE) as service:
        sampler = service.create_sampling_client(base_model=str(models / "tiny-chat")).result()
        tokens = sampler.get_tokenizer().encode("The sum of 2 and 3 is 5.")
        expected = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    answer = alice.completions.create(model="tiny-chat", prompt=tokens, max_tokens=0, echo=True, logprobs=1)
    choice = answer.choices[0]
    assert choice.text == "The sum of 2 and 3 is 5." and answer.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and expected[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)


def test_streamed_completion_and_chat_carry_the_same_text_and_usage(alice):
    whole = alice.completions.create(model="tiny-chat", prompt="abc", n=2, max_tokens=8, seed=4)
    chunks = list(
        alice.completions.create(
            model="tiny-chat", prompt="abc", n=2, max_tokens=8, seed=4, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = ["", ""]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    said = alice.chat.completions.create(model="tiny-chat-template", messages=messages, max_tokens=6, seed=5)
    assert said.object == "chat.completion" and said.choices[0].message.role == "assistant"
    streamed = list(
        alice.chat.completions.create(
            model="tiny-chat-template", messages=messages, max_tokens=6, seed=5, stream=True,
        )
    )  # fmt: skip
    assert streamed[0].object == "chat.completion.chunk" and streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == said.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == said.choices[0].finish_reason
    # the template rendered the messages: the prompt is the template's text, not the raw content
    rendered = len("system: be brief\nuser: 2+2?\nassistant:")
    assert said.usage.prompt_tokens == rendered


def test_a_streamed_completion_arrives_as_it_is_decoded_and_equals_the_whole_answer(server, alice):
    """The stream once carried the whole completion in one event when the decode ended."""
    manager = server[1].state.jobs
    ask = {"model": "tiny-chat", "prompt": "go", "n": 2, "max_tokens": 300, "seed": 11}
    ask |= {"extra_body": {"ignore_eos": True}}
    whole = alice.completions.create(**ask)
    texts, num_chunks, running_at_first = ["", ""], 0, None
    for chunk in alice.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.text and running_at_first is None:
                running_at_first = [r["status"] for r in manager.requests.open_rows() if r["op"] == "generate"]
            texts[choice.index] += choice.text
            num_chunks += 1
    assert running_at_first == ["running"]  # the first text came while its decode ran
    assert num_chunks > 4  # in many events, not one per choice
    assert texts == [c.text for c in whole.choices]


def test_a_stop_string_never_shows_in_a_stream(alice):
    """Text that could still grow into a stop string is held back until it cannot."""
    ask = {"model": "tiny-chat", "prompt": "x", "n": 4, "max_tokens": 200, "seed": 7}
    ask |= {"extra_body": {"ignore_eos": True}}
    free = alice.completions.create(**ask).choices[0].text
    stop = free[40:43]  # three characters the first choice says, late enough that text streams before them
    whole = alice.completions.create(**ask, stop=[stop])
    assert whole.choices[0].text == free[: free.index(stop)]
    texts, chunks = [""] * 4, []
    for chunk in alice.completions.create(**ask, stop=[stop], stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            chunks.append(choice.text)
    assert texts == [c.text for c in whole.choices]
    assert all(stop not in text for text in texts) and all(stop not in text for text in chunks)
    assert len(chunks) > 8


def test_chat_with_a_model_without_a_template_is_refused_and_its_completions_work(alice):
    with pytest.raises(openai.BadRequestError) as refused:
        alice.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}])
    assert "has no chat template" in refused.value.message and refused.value.body["param"] == "model"
    assert alice.completions.create(model="tiny-chat", prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"n": 200}, "n"),
    ],
)
def test_an_unserved_field_is_a_400_naming_it(alice, extra, param):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        alice.chat.completions.create(model="tiny-chat-template", messages=messages, max_tokens=2, **extra)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert refused.value.body["type"] == "invalid_request_error"


def test_images_and_an_unknown_model_are_refused_in_openai_terms(alice):
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        alice.chat.completions.create(model="tiny-chat-template", messages=[{"role": "user", "content": image}])
    assert refused.value.body["param"] == "messages[0].content[0]" and "image_url" in refused.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        alice.completions.create(model="no-such-model", prompt="hi")
    assert missing.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("api_key", [None, "not-a-token", ALICE.upper()])
def test_a_missing_or_wrong_token_is_a_401_in_openai_shape(server, api_key):
    headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
    answer = httpx.post(f"{server[0]}/v1/completions", json={"model": "tiny-chat", "prompt": "a"}, headers=headers)
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["type"] == "authentication_error" and "bearer token" in error["message"]
    if api_key is not None:  # the SDK refuses to send no key at all
        client = openai.OpenAI(base_url=f"{server[0]}/oai/v1", api_key=api_key, max_retries=0)
        with client, pytest.raises(openai.AuthenticationError, match="not valid"):
            client.models.list()


def test_a_body_over_the_cap_is_a_413_in_openai_shape(server):
    cap = server[1].state.settings.max_post_bytes
    body = {"model": "tiny-chat", "prompt": "a" * cap}
    answer = httpx.post(f"{server[0]}/oai/v1/completions", json=body, headers={"authorization": f"Bearer {ALICE}"})
    assert answer.status_code == 413
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_json_body_over_the_json_cap_is_told_what_an_openai_caller_can_send_instead(server):
    """Under the body cap but over the JSON cap: the answer told an OpenAI caller to send binary frames."""
    from icefloe.service.limits import MAX_JSON_BYTES

    body = {"model": "tiny-chat", "prompt": "a" * MAX_JSON_BYTES}
    answer = httpx.post(f"{server[0]}/oai/v1/completions", json=body, headers={"authorization": f"Bearer {ALICE}"})
    assert answer.status_code == 413
    message = answer.json()["error"]["message"]
    assert "fewer or shorter prompts" in message and "binary" not in message


def test_models_lists_the_base_models_and_the_callers_own_checkpoints(server, models, alice, bob, example):
    url, _ = server
    with tinker.ServiceClient(base_url=url, api_key=ALICE) as service:
        training = service.create_lora_training_client(base_model=str(models / "tiny-chat"), rank=4).result()
        path = training.save_weights_for_sampler("listed").result().path
    checkpoint = example.train(url, ALICE, steps=1, batch_size=2)  # a training-API checkpoint
    alices = {m.id for m in alice.models.list()}
    assert {"tiny:chat", "tiny-chat", "tiny-chat-template", path, checkpoint} <= alices
    assert not {path, checkpoint} & {m.id for m in bob.models.list()}
    assert alice.models.retrieve(path).id == path and alice.models.retrieve(checkpoint).id == checkpoint


def test_models_lists_the_hub_ids_in_the_services_hugging_face_cache_and_serves_them(hub_cache, alice):
    """A hub id in the service's cache is a base model it serves, but GET /models named none."""
    assert "acme/tiny-chat" in {m.id for m in alice.models.list()}
    answer = alice.completions.create(
        model="acme/tiny-chat", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert answer.model == "acme/tiny-chat" and answer.usage.completion_tokens == 3


def _train(service: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    tokens = training.get_tokenizer().encode("aaaa aaaa aaaa aaaa")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(5):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training


def _scores(client: openai.OpenAI, model: str) -> list[float]:
    answer = client.completions.create(model=model, prompt="aaaa aaaa", max_tokens=0, echo=True, logprobs=0)
    return answer.choices[0].logprobs.token_logprobs[1:]


def test_a_tinker_checkpoint_answers_unlike_its_base_and_only_to_its_tenant(server, models, alice, bob):
    url, _ = server
    with tinker.ServiceClient(base_url=url, api_key=ALICE) as service:
        path = _train(service, str(models / "tiny-chat")).save_weights_for_sampler("trained").result().path
    base, trained = _scores(alice, "tiny-chat"), _scores(alice, path)
    assert sum(trained) > sum(base) + 1.0  # it learned the text it was trained on
    assert _scores(alice, f"tiny-chat;{path}") == pytest.approx(trained, abs=1e-5)
    with pytest.raises(openai.NotFoundError) as hidden:
        bob.completions.create(model=path, prompt="aaaa", max_tokens=1)
    assert hidden.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        alice.completions.create(model=f"tiny-chat-template;{path}", prompt="aaaa", max_tokens=1)


@pytest.mark.anyio
async def test_a_training_api_checkpoint_answers_unlike_its_base(server, anyio_backend):
    url, _ = server
    peft = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    training = {
        "job_type": "training", "model_name": "tiny-chat",
        "training_config": {"optimizer": {"name": "AdamW", "lr": 5e-2}, "max_seq_len": 64, "peft_config": peft},
    }  # fmt: skip
    headers = {"authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        api = Api(http)
        job_id = await api.running(training)
        for seed in range(3):
            await api.fwd_bwd(job_id, seed)
            await api.run(job_id, "POST", "step", json={})
        saved = await api.run(job_id, "POST", "save", json={"checkpoint_type": "weights-only"})
    model = f"{job_id}/{saved['checkpoint_id']}"
    async with openai.AsyncOpenAI(base_url=f"{url}/oai/v1", api_key=ALICE, max_retries=0) as client:
        answers = []
        for name in ("tiny-chat", model):
            answer = await client.completions.create(
                model=name, prompt=[1, 5, 9, 2], max_tokens=0, echo=True, logprobs=0
            )
            answers.append(answer.choices[0].logprobs.token_logprobs[1:])
    assert max(abs(a - b) for a, b in zip(*answers, strict=True)) > 1e-3
    async with openai.AsyncOpenAI(base_url=f"{url}/oai/v1", api_key=BOB, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model=model, prompt="a", max_tokens=1)
        messages = []  # alice's job and no job at all read alike: no answer tells bob that her job exists
        for name in (f"{job_id}/global_step99", f"{uuid.uuid4()}/global_step99"):
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model=name, prompt="a", max_tokens=1)
            messages.append(missing.value.body["message"].replace(name, "<model>"))
        assert messages[0] == messages[1]


def test_a_client_that_leaves_mid_stream_stops_the_decode(server):
    url, service = server
    manager = service.state.jobs
    body = {
        "model": "tiny-chat", "prompt": "go", "max_tokens": 500, "n": 32, "stream": True, "seed": 3,
        "ignore_eos": True,
    }  # fmt: skip
    headers = {"authorization": f"Bearer {ALICE}"}
    with (
        httpx.Client(base_url=url, headers=headers, timeout=60) as http,
        http.stream("POST", "/oai/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        deadline = time.monotonic() + 60
        running = []
        while not running and time.monotonic() < deadline:
            running = [r for r in manager.requests.open_rows() if r["status"] == "running"]
            time.sleep(0.005)
        assert running, "the sampling never started"
    # leaving the block closed the connection mid-stream
    row = running[0]
    deadline = time.monotonic() + 60
    while manager.requests.is_open(row["request_id"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.requests.get(row["job_id"], row["request_id"])["status"] == "done"
    samples = manager.held.take(row["request_id"])  # the samples no one asked for stay held, as they stopped
    assert {s["finish_reason"] for s in samples} == {"cancelled"}
    assert max(len(s["token_ids"]) for s in samples) < 500  # stopped at the next decode step, not at the end


def test_a_client_that_leaves_before_a_whole_answer_stops_the_decode(server):
    """An answer sent whole (no stream) watches its caller too: closing the connection stops the decode."""
    url, service = server
    manager = service.state.jobs
    body = json.dumps({
        "model": "tiny-chat", "prompt": "go", "max_tokens": 500, "n": 32, "seed": 4, "ignore_eos": True,
    }).encode()  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /oai/v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(head.encode() + body)
        deadline = time.monotonic() + 60
        running = []
        while not running and time.monotonic() < deadline:
            running = [r for r in manager.requests.open_rows() if r["status"] == "running"]
            time.sleep(0.005)
        assert running, "the sampling never started"
    row = running[0]
    deadline = time.monotonic() + 60
    while manager.requests.is_open(row["request_id"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = manager.held.take(row["request_id"])
    assert {s["finish_reason"] for s in samples} == {"cancelled"}
    assert max(len(s["token_ids"]) for s in samples) < 500


def test_requests_count_in_metrics_as_the_jobs_generates(server, alice):
    url, _ = server
    alice.completions.create(model="tiny-chat", prompt="m", max_tokens=1)
    metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert 'op="generate"' in metrics


def test_the_example_trains_a_checkpoint_that_beats_its_base_through_the_endpoint(server, alice, example):
    checkpoint = example.train(server[0], ALICE, steps=20, batch_size=32)
    base, trained = example.evaluate(alice, example.BASE_MODEL), example.evaluate(alice, checkpoint)
    assert base == 0.0 and trained >= 0.05  # the untrained model spells no sum; a few steps teach some


def test_a_tenant_past_its_share_of_the_cap_unloads_its_own_models_not_anothers(tmp_path, models):
    tenants = {"alice": (ALICE,), "bob": (BOB,)}
    service = make_app(
        tmp_path, slots=4, engines="local", model_root=models, max_loaded_models=2, tenant_tokens=tenants
    )
    with (
        ServerThread(service) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0) as alice,
        openai.OpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0) as bob,
    ):
        loaded = service.state.openai
        bob.completions.create(model="tiny:chat", prompt="a", max_tokens=1)
        alice.completions.create(model="tiny-chat", prompt="a", max_tokens=1)
        alice.completions.create(model="tiny-chat-template", prompt="a", max_tokens=1)
        # alice holds her share (1 of 2): her own least recently used model made room, bob's stays
        assert list(loaded._served) == [("bob", "tiny:chat"), ("alice", "tiny-chat-template")]


def test_past_its_cap_the_least_recently_used_idle_model_is_unloaded(tmp_path, models):
    service = make_app(tmp_path, slots=4, engines="local", model_root=models, max_loaded_models=1)
    with ServerThread(service) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client:
        loaded = service.state.openai
        client.completions.create(model="tiny-chat", prompt="a", max_tokens=1)
        first = loaded._served[("default", "tiny-chat")].job_id
        client.completions.create(model="tiny:chat", prompt="a", max_tokens=1)
        assert list(loaded._served) == [("default", "tiny:chat")]  # --max-loaded-models 1
        assert service.state.jobs.public(first)["status"] in ("cancelling", "cancelled", "terminated")
        assert client.completions.create(model="tiny-chat", prompt="a", max_tokens=1).choices  # loaded again


def test_spellings_of_one_folder_share_one_loaded_model(server, alice):
    """``tiny-chat/`` and ``tiny-chat/../tiny-chat`` each loaded a model of their own (a sampling job each)."""
    _, service = server
    spellings = ("tiny-chat", "tiny-chat/", "./tiny-chat", "tiny-chat/../tiny-chat", "tiny-chat//")
    for spelling in spellings:
        assert alice.completions.create(model=spelling, prompt="a", max_tokens=1).choices
    loaded = {model for tenant, model in service.state.openai._served if tenant == "alice"}
    assert loaded & set(spellings) == {"tiny-chat"}
