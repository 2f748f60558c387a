"""Sampling clients of the unmodified ``tinker`` SDK against a real ``icefloe serve`` with tenants: a
snapshot client keeps the weights it was made on whatever is saved later (DPO's reference model), an
inflight one follows the newest, a save repeated for one sampling session is answered as the first,
and each tenant lists and reads only its own sessions."""

from __future__ import annotations

import httpx
import pytest

from .tinker_serve import PROTO, TOKENS, Tinker, forward_backward, tinker_serve

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # ids below tiny:chat's vocabulary of 98
TEXT = [60, 61, 62, 63, 64, 65, 66, 67]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tinker-sampling")
    with tinker_serve(tmp_path) as serve:
        serve.model = str(tmp_path / "models" / "tiny-chat")
        yield serve


@pytest.fixture
def alice(served):
    with tinker.ServiceClient(base_url=served.base_url, api_key=TOKENS["alice"]) as client:
        yield client


def _train(training, steps: int) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:-1]),
        loss_fn_inputs={"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)},
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def _running(served) -> list[dict]:
    return [job for job in served.http.get("/").json()["jobs"] if job["status"] == "running"]


def _logprobs(sampler) -> list[float]:
    return sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:]


def test_a_snapshot_client_keeps_its_weights_while_an_inflight_one_follows(served, alice):
    """DPO's reference (a default save_weights_and_get_sampling_client) moved with every later save, so
    the loss snapped back to ln 2 at each eval: the one sampler it was bound to was refilled."""
    training = alice.create_lora_training_client(base_model=served.model, rank=4).result()
    _train(training, 1)
    reference = training.save_weights_and_get_sampling_client().result()
    kept = _logprobs(reference)  # on the model's own sampler
    inflight = training.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _logprobs(inflight) == kept  # no step between the two saves
    jobs_before = _running(served)
    assert _logprobs(reference) == kept  # moved after the save: an adapter of its own, on the one shared base
    jobs_after = _running(served)
    assert len(jobs_after) == len(jobs_before) + 1
    assert len({job["host"]["host_id"] for job in jobs_after}) == 1
    assert served.http.get("/capacity").json()["in_use_slots"] == 1
    _train(training, 5)
    newest = training.save_weights_and_get_sampling_client().result()
    training.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _logprobs(reference) == kept  # exactly the weights it was made on
    moved = _logprobs(inflight)
    assert moved == _logprobs(newest)  # the newest weights
    assert max(abs(a - b) for a, b in zip(moved, kept, strict=True)) > 0.05
    # newest, made before the last (inflight) save, moved as well; the inflight client never does
    assert len(_running(served)) == len(jobs_after) + 1


def test_a_client_on_a_sampler_weights_path_keeps_them_after_the_next_save(served, alice):
    """A client on tinker://…/sampler_weights/p1 moved by 2.08 nats once p2 was saved, while a new
    client on p1 was right: one path meant different weights depending on when the client was made."""
    training = alice.create_lora_training_client(base_model=served.model, rank=4).result()
    _train(training, 1)
    p1 = training.save_weights_for_sampler("p1").result().path
    on_p1 = alice.create_sampling_client(model_path=p1).result()
    before = _logprobs(on_p1)
    _train(training, 5)
    p2 = training.save_weights_for_sampler("p2").result().path
    assert _logprobs(on_p1) == before
    assert _logprobs(alice.create_sampling_client(model_path=p1).result()) == before
    on_p2 = _logprobs(alice.create_sampling_client(model_path=p2).result())
    assert max(abs(a - b) for a, b in zip(on_p2, before, strict=True)) > 0.05


def test_a_second_save_for_one_sampling_session_is_answered_as_the_first(served):
    """Twice the same sampling_session_seq_id answered 500 (IntegrityError on tinker_runs.run_id); with
    seq_id, the future reported a server error although the checkpoint was written."""
    client = Tinker(served, "alice")
    try:
        session_id, model_id = client.model(base_model="tiny-chat")
        body = {"model_id": model_id, "sampling_session_seq_id": 7}
        answers = []
        for seq_id in (1, 2, None):
            sent = client.ok("/save_weights_for_sampler", body if seq_id is None else {**body, "seq_id": seq_id})
            answers.append(client.outcome(sent["request_id"]).json())
        assert answers[0]["sampling_session_id"] == f"{session_id}:sample:7"
        assert answers == [answers[0]] * 3, answers
        assert "error" not in answers[0]
        named = {"model_id": model_id, "sampling_session_seq_id": 8, "path": "named", "seq_id": 3}
        first = client.outcome(client.ok("/save_weights_for_sampler", named)["request_id"]).json()
        again = client.outcome(client.ok("/save_weights_for_sampler", {**named, "seq_id": 4})["request_id"]).json()
        assert first == again and first["path"] == f"tinker://{model_id}/sampler_weights/named"
        bad = client.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 5, "kind": "later"})
        assert bad.status_code == 400 and "kind must be one of ['snapshot', 'inflight']" in bad.text
        # a number create_sampling_session took already answered 500 (the same IntegrityError), each resend too
        client.sampler(session_id, seq=9)
        for seq_id in (6, 7):
            taken = client.post("/save_weights_for_sampler", {**body, "sampling_session_seq_id": 9, "seq_id": seq_id})
            assert taken.status_code == 400 and taken.json()["code"] == "conflict", taken.text
            assert f"sampling_session_seq_id 9 already names sampling session {session_id}:sample:9" in taken.text
        far = client.http.get("/sessions", params={"offset": 2**63})  # was a 500: too large for SQLite
        assert far.status_code == 400 and "offset in [0, 9223372036854775807]" in far.text, far.text
    finally:
        client.close()


def test_list_sessions_and_get_session_show_only_the_callers_own(served, alice):
    """RestClient.list_sessions and get_session answered 404 (not served)."""
    training = alice.create_lora_training_client(base_model=served.model, rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    mine = alice.holder.get_session_id()
    with tinker.ServiceClient(base_url=served.base_url, api_key=TOKENS["bob"]) as bob:
        bob.create_sampling_client(base_model=served.model).result()
        bobs = bob.holder.get_session_id()
        alice_rest = tinker.RestClient(base_url=served.base_url, api_key=TOKENS["alice"])
        listed = alice_rest.list_sessions(limit=1000).result().sessions
        assert mine in listed and bobs not in listed
        session = alice_rest.get_session(mine).result()
        assert session.training_run_ids == [training.model_id]
        assert session.sampler_ids == [sampler._sampling_session_id]
        bob_rest = tinker.RestClient(base_url=served.base_url, api_key=TOKENS["bob"])
        assert mine not in bob_rest.list_sessions(limit=1000).result().sessions
        with pytest.raises(tinker.NotFoundError) as theirs:
            bob_rest.get_session(mine).result()
        with pytest.raises(tinker.NotFoundError) as unknown:
            bob_rest.get_session("0" * 32).result()
        assert str(theirs.value).replace(mine, "ID") == str(unknown.value).replace("0" * 32, "ID")
        with pytest.raises(tinker.BadRequestError, match="access_scope must be one of"):
            bob_rest.list_sessions(access_scope="everyone").result()


def test_two_d_target_tokens_score_the_sum_over_their_k_targets(served, alice):
    """``target_tokens`` and ``weights`` of shape [L, K] (top-K distillation, the cookbook's soft labels)
    were refused as "not served yet"."""
    training = alice.create_lora_training_client(base_model=served.model, rank=4).result()
    length, k = len(TEXT) - 1, 3
    targets = [[(token + column * 7) % 90 for column in range(k)] for token in TEXT[1:]]
    weights = [[1.0, 0.5, 0.25 * (position % 2)] for position in range(length)]
    model_input = types.ModelInput.from_ints(TEXT[:-1])

    def datum(targets_T, weights_T, shape: list[int], weights_shape: list[int] | None = None) -> types.Datum:
        flat = [t for row in targets_T for t in row] if shape[1:] else targets_T
        weights_shape = weights_shape or shape
        flat_weights = [w for row in weights_T for w in row] if weights_shape[1:] else weights_T
        inputs = {
            "target_tokens": types.TensorData(data=flat, dtype="int64", shape=shape),
            "weights": types.TensorData(data=flat_weights, dtype="float32", shape=weights_shape),
        }
        return types.Datum(model_input=model_input, loss_fn_inputs=inputs)

    two_d = training.forward([datum(targets, weights, [length, k])], "cross_entropy").result()
    columns = [
        training.forward(
            [datum([row[c] for row in targets], [row[c] for row in weights], [length])], "cross_entropy"
        ).result()
        for c in range(k)
    ]
    assert two_d.metrics["loss:sum"] == pytest.approx(sum(one.metrics["loss:sum"] for one in columns), rel=1e-5)
    logprobs_LK = two_d.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs_LK.shape == (length, k)
    for c, one in enumerate(columns):
        assert logprobs_LK[:, c].tolist() == pytest.approx(one.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-5)
    one_d = datum(TEXT[1:], [1.0] * length, [length])
    mixed = training.forward_backward([one_d, datum(targets, weights, [length, k]), one_d], "cross_entropy").result()
    assert [out["logprobs"].to_numpy().shape for out in mixed.loss_fn_outputs] == [(length,), (length, k), (length,)]
    assert mixed.metrics["loss:sum"] == pytest.approx(
        two_d.metrics["loss:sum"] + 2 * -sum(mixed.loss_fn_outputs[0]["logprobs"].tolist()), rel=1e-5
    )
    with pytest.raises(tinker.BadRequestError, match=r"target_tokens and weights must both be \[L, K\]"):
        training.forward([datum(targets, [1.0] * length, [length, k], [length])], "cross_entropy").result()


def _prompt_logprobs(client: Tinker, sampling_session_id: str, seq_id: int) -> list[float] | httpx.Response:
    """The prompt's log-probs through raw ``asample`` (one token sampled), or the refusal."""
    from tinker.proto.response_conv import deserialize_sample_response

    body = {
        "sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 1, "prompt_logprobs": True,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "sampling_params": {"max_tokens": 1},
    }  # fmt: skip
    sent = client.post("/asample", body)
    if sent.status_code != 200:
        return sent
    return deserialize_sample_response(client.outcome(sent.json()["request_id"]).content).prompt_logprobs[1:]


def _full_weight_snapshot_after_a_step(client: Tinker) -> tuple[str, list[float]]:
    """A full-weight model's snapshot client, its log-probs, then a step and a second save."""
    session_id = client.ok("/create_session", {})["session_id"]
    created = client.ok("/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-chat"})
    client.outcome(created["request_id"])
    model_id = created["model_id"]
    save = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 1}
    saved = client.outcome(client.ok("/save_weights_for_sampler", save)["request_id"]).json()
    sampler_id = saved["sampling_session_id"]
    kept = _prompt_logprobs(client, sampler_id, 0)
    step = forward_backward(model_id, 2, TEXT)
    client.outcome(client.ok("/forward_backward", content=step, headers=PROTO)["request_id"])
    adam = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 5e-2}}
    client.outcome(client.ok("/optim_step", adam)["request_id"])
    again = {"model_id": model_id, "seq_id": 4, "sampling_session_seq_id": 2}
    client.outcome(client.ok("/save_weights_for_sampler", again)["request_id"])
    return sampler_id, kept


def test_a_full_weight_snapshot_gets_a_copy_of_its_own_or_a_refusal_naming_the_limit(tmp_path):
    """A full-weight model's snapshot cannot be an adapter on a shared base: it is kept on a sampler
    job of its own (a slot), and where the tenant's max_slots leaves none, the call says so."""
    with tinker_serve(tmp_path, limits={"bob": "max_slots=1"}) as serve:
        alice, bob = Tinker(serve, "alice"), Tinker(serve, "bob")
        try:
            sampler_id, kept = _full_weight_snapshot_after_a_step(alice)
            assert _prompt_logprobs(alice, sampler_id, 1) == kept
            sampler_id, kept = _full_weight_snapshot_after_a_step(bob)
            refused = _prompt_logprobs(bob, sampler_id, 1)
            assert isinstance(refused, httpx.Response) and refused.status_code == 400, refused.text  # never 409:
            assert refused.json()["code"] == "conflict"  # the SDK would retry that
            assert "may hold 1 slots at once (max_slots=1" in refused.json()["message"]
        finally:
            alice.close()
            bob.close()
