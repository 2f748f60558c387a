"""SamplingEngine: seeded reproducibility, batch independence, stop handling, errors."""

from __future__ import annotations

import pytest
import torch

from icefloe.engines import sampling
from icefloe.engines.sampling import SamplingEngine, build_sampling_engine
from icefloe.protocol import InvalidRequestError, SamplingParams

from .engine_batches import make_config

PROMPTS = ["12+7=", "3*4=", "100-58="]


@pytest.fixture(scope="module")
def sampler(model_dir) -> SamplingEngine:
    return SamplingEngine(make_config(), model_dir=model_dir)


def _ids(results):
    return [r["token_ids"] for r in results]


def test_generate_same_seed_gives_same_tokens(sampler):
    params = SamplingParams(max_tokens=12, seed=11, n=2, logprobs=True)
    first = sampler.generate(PROMPTS, params)
    assert _ids(sampler.generate(PROMPTS, params)) == _ids(first)
    assert _ids(sampler.generate(PROMPTS, params.model_copy(update={"seed": 12}))) != _ids(first)
    assert len(first) == 6 and all(len(r["logprobs"]) == len(r["token_ids"]) for r in first)


def test_generate_rows_do_not_depend_on_batch_composition(sampler):
    """Each prompt alone, with its own seed, samples what it samples inside a mixed batch."""
    params = [
        SamplingParams(max_tokens=10, seed=s, n=2, top_k=s % 3 * 5, top_p=0.9 if s == 2 else 1.0) for s in range(3)
    ]
    together = sampler.generate(PROMPTS, params)
    alone = [r for prompt, p in zip(PROMPTS, params, strict=True) for r in sampler.generate([prompt], p)]
    assert _ids(together) == _ids(alone)  # also pins the prompt-major order


def test_a_groups_samples_share_one_prefill_and_sample_what_a_prefill_each_would(sampler, monkeypatch):
    params = SamplingParams(max_tokens=8, seed=5, n=4, logprobs=True)
    prompts = [*PROMPTS, PROMPTS[0]]  # a prompt asked twice shares its prefill too
    prefill_rows: list[int] = []
    forward = sampler._forward

    def counting(adapters, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefill_rows.append(kwargs["input_ids"].shape[0])
        return forward(adapters, **kwargs)

    monkeypatch.setattr(sampler, "_forward", counting)
    shared = sampler.generate(prompts, params)
    monkeypatch.setattr(sampling, "_distinct_prompts", lambda rows: (list(range(len(rows))), list(range(len(rows)))))
    each = sampler.generate(prompts, params)
    assert prefill_rows == [3, 16]
    assert _ids(shared) == _ids(each)
    for a, b in zip(shared, each, strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_generate_splits_large_requests_without_changing_results(model_dir, sampler):
    small = SamplingEngine(make_config(sampling={"max_batch_size": 2}), model_dir=model_dir)
    params = SamplingParams(max_tokens=8, seed=3, n=3)
    assert _ids(small.generate(PROMPTS, params)) == _ids(sampler.generate(PROMPTS, params))


def test_generate_bounds_decode_batches_by_tokens_without_changing_results(model_dir, sampler):
    """Many prompts with a large n decode in batches of at most max_batch_tokens positions."""
    params = SamplingParams(max_tokens=6, seed=3, n=5, logprobs=True)
    bounded = SamplingEngine(make_config(sampling={"max_batch_tokens": 30}), model_dir=model_dir)
    sizes: list[int] = []
    decode = bounded._decode_steps
    bounded._decode_steps = lambda rows, pass_s=None: (
        sizes.append(len(rows) * max(len(r.prompt_ids) + r.max_new for r in rows)),
        decode(rows, pass_s),
    )[1]
    assert _ids(bounded.generate(PROMPTS, params)) == _ids(sampler.generate(PROMPTS, params))
    assert len(sizes) > 2 and max(sizes) <= 30
    assert sampler.token_budget >= 48  # the default: at least max_seq_len


def test_generate_greedy_and_top_k_one_agree(sampler):
    greedy = sampler.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    top1 = sampler.generate(PROMPTS, SamplingParams(max_tokens=8, top_k=1, seed=9))
    nucleus = sampler.generate(PROMPTS, SamplingParams(max_tokens=8, top_p=1e-3, top_k=5, seed=9))
    assert _ids(greedy) == _ids(top1) == _ids(nucleus)


def test_generate_accepts_token_id_prompts(sampler):
    params = SamplingParams(max_tokens=6, seed=4)
    as_text = sampler.generate(PROMPTS[:1], params)
    as_ids = sampler.generate([sampler.tokenizer.encode(PROMPTS[0])], params)
    assert _ids(as_ids) == _ids(as_text)


def test_generate_finish_reason_length_and_stop_token(sampler):
    greedy = sampler.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))[0]
    assert greedy["finish_reason"] == "length" and len(greedy["token_ids"]) == 4
    stop_id = greedy["token_ids"][1]
    stopped = sampler.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(stop_id,)))[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == greedy["token_ids"][: greedy["token_ids"].index(stop_id) + 1]  # stop id kept


def test_generate_stop_string_truncates_text_and_tokens(sampler):
    greedy = sampler.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0))[0]
    text = greedy["text"]
    assert len(text) >= 4, "the tiny model should produce a few characters greedily"
    stop = text[2:4]
    cut = sampler.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0, stop=(stop,)))[0]
    start = text.find(stop)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[:start]
    # One token per character: the tokens run through the one that completed the stop string.
    assert cut["token_ids"] == greedy["token_ids"][: start + len(stop)]


def test_generate_reports_the_policy_version(sampler):
    assert {r["policy_version"] for r in sampler.generate(PROMPTS, SamplingParams(max_tokens=2))} == {
        sampler.policy_version
    }


def test_generate_rejects_bad_prompts(sampler):
    with pytest.raises(
        InvalidRequestError, match=r"prompts\[1\] has 60 tokens; it must be shorter than max_seq_len=48 to leave room"
    ):
        sampler.generate(["1+1=", "1" * 60], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\] is empty"):
        sampler.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\] holds token ids outside"):
        sampler.generate([[1, 999]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="sampling_params has 1 entries for 2 prompts"):
        sampler.generate(["1", "2"], [SamplingParams()])


def test_generate_refuses_max_tokens_past_max_seq_len_and_fills_it_exactly(sampler):
    """A max_tokens past the room left was cut short silently (finish_reason "length" after 3 tokens)."""
    prompt = "1" * 45
    with pytest.raises(
        InvalidRequestError, match=r"prompts\[0\] \(45 tokens\) \+ max_tokens \(20\) exceeds max_seq_len=48; "
    ):
        sampler.generate([prompt], SamplingParams(max_tokens=20))
    params = SamplingParams(max_tokens=3, stop_token_ids=(), ignore_eos=True, temperature=0)
    assert len(sampler.generate([prompt], params)[0]["token_ids"]) == 3


def test_load_weights_rejects_unknown_names_and_shapes(sampler):
    with pytest.raises(InvalidRequestError, match="'nope' is not a parameter"):
        sampler.load_weights([("nope", torch.zeros(1))], policy_version=1)
    name, param = next(iter(sampler.model.named_parameters()))
    with pytest.raises(InvalidRequestError, match="expects"):
        sampler.load_weights([(name, torch.zeros(param.numel() + 1))], policy_version=1)


def test_memory_controls_answer_empty_dicts(sampler):
    assert sampler.sleep() == {} and sampler.wake() == {} and sampler.reset_prefix_cache() == {}


def test_build_sampling_engine_picks_torch_on_cpu(model_dir):
    engine = build_sampling_engine(make_config(sampling={"engine": "auto"}), "cpu", model_dir=model_dir)
    assert isinstance(engine, SamplingEngine)


def test_vllm_engine_without_vllm_names_the_extra(model_dir):
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install icefloe\[gpu\]"):
            build_sampling_engine(make_config(sampling={"engine": "vllm"}), "cpu", model_dir=model_dir)
    else:  # pragma: no cover - only where vLLM is installed
        pytest.skip("vLLM is installed here")


def test_inverse_cdf_draws_each_token_in_proportion_to_its_weight():
    from icefloe.engines.sampling import _inverse_cdf

    weights = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(1000, 4)
    uniform = (torch.arange(1000) + 0.5) / 1000  # evenly spread: counts come out exactly proportional
    counts = torch.bincount(_inverse_cdf(weights * 7.0, uniform), minlength=4)  # unnormalised is fine
    assert counts.tolist() == [100, 0, 600, 300]


def test_cancel_stops_a_tagged_call_at_its_next_decode_step_and_leaves_the_rest_of_its_batch(sampler, monkeypatch):
    """cancel_future used to leave a started sample running to its end (a million-sample call ran on for 40 s)."""
    wanted = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    alone = sampler.generate([PROMPTS[1]], wanted)
    forward, steps = sampler.model.forward, []

    def counting(*args, **kwargs):  # a cancel arriving from another thread while the third step runs
        steps.append(1)
        if len(steps) == 3:
            sampler.cancel(["stop-me"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(sampler.model, "forward", counting)
    tagged = SamplingParams(max_tokens=12, seed=4, ignore_eos=True, tag="stop-me")
    stopped, kept = sampler.generate(PROMPTS[:2], [tagged, wanted])
    assert stopped["finish_reason"] == "cancelled" and len(stopped["token_ids"]) == 3
    assert _ids([kept]) == _ids(alone) and kept["finish_reason"] == "length"
    assert len(steps) == 12  # the other row went on to its end


def test_target_prompt_logprobs_score_the_asked_ids_at_each_prompt_position(sampler):
    ids = sampler.tokenizer.encode(PROMPTS[2])
    other = [(token + 1) % sampler.vocab_size for token in ids[1:]]
    targets = tuple((token, alternative, -1) for token, alternative in zip(ids[1:], other, strict=True))
    params = SamplingParams(max_tokens=1, prompt_logprobs=True, target_prompt_logprobs=targets)
    (result,) = sampler.generate([ids], params)
    scored = result["target_prompt_logprobs"]
    assert [row[0] for row in scored] == pytest.approx(result["prompt_logprobs"][1:], abs=1e-6)
    assert all(row[2] == 0.0 for row in scored) and all(row[1] < 0 for row in scored)
    with pytest.raises(InvalidRequestError, match=r"target_prompt_logprobs must be \[6, K\]"):
        sampler.generate([ids], params.model_copy(update={"target_prompt_logprobs": targets[:2]}))


def test_a_prefill_and_prompt_scoring_in_passes_of_one_column_sample_and_score_what_one_pass_does(
    model_dir, monkeypatch
):
    """A generate's prefill was one forward over every prompt of its decode batch (and a prompt's scoring
    one over the prompt): long prompts made one step of a shared host seconds long, which no other run's
    op could pass and no deadline could stop. Cut by time (and with no floor), passes here hold one column each."""
    engine = SamplingEngine(make_config(), model_dir=model_dir)
    prompts = ["12+7=", "3*4=", "1000-58+6=", "12+7=", "9"]  # left-padded rows, a shared prefill, a 1-token prompt
    params = SamplingParams(max_tokens=6, seed=3, n=2, logprobs=True, prompt_logprobs=True, topk_prompt_logprobs=2)
    whole = sampling.generate_together([(engine, prompts, params)])[0]

    widths: list[int] = []
    forward = engine._forward

    def recording(adapters, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(adapters, **kwargs)

    monkeypatch.setattr(engine, "_forward", recording)
    monkeypatch.setattr(sampling, "_FIRST_PASS_POSITIONS", 1)  # with these and pass_s 1 ns: a column per pass
    monkeypatch.setattr(sampling, "_MIN_PASS_COLUMNS", 1)
    steps = list(sampling.generate_steps([(engine, prompts, params)], pass_s=1e-9))
    cut = next(done[0] for done, _ in steps if done)

    assert set(widths) == {1}  # every pass one column: the prefill's, the scoring's, then the decode's
    longest = max(len(p) for p in prompts)
    num_scored = sum(len(p) for p in set(prompts))
    assert len(steps) >= longest + num_scored - len(set(prompts))  # a step between any two passes
    assert _ids(cut) == _ids(whole)
    for a, b in zip(cut, whole, strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
        assert a["prompt_logprobs"][0] is None and b["prompt_logprobs"][0] is None
        assert a["prompt_logprobs"][1:] == pytest.approx(b["prompt_logprobs"][1:], abs=1e-5)
        assert [[t for t, _ in at] for at in a["topk_prompt_logprobs"][1:]] == [
            [t for t, _ in at] for at in b["topk_prompt_logprobs"][1:]
        ]


def test_a_prefill_of_many_long_rows_is_cut_by_rows_so_no_pass_holds_more_positions_than_its_budget(
    model_dir, monkeypatch
):
    """Passes were cut by columns only, at least _MIN_PASS_COLUMNS each: a decode batch of hundreds of
    long prompts made each pass hundreds x 64 positions, seconds on a CPU whatever the time asked. Here
    a budget of 4 rows x 64 columns prefills 12 long rows a group of four at a time, every forward
    (prefill, scoring, decode) stays within it, and each row's numbers are those of one whole pass."""
    engine = SamplingEngine(make_config(), model_dir=model_dir)
    draw = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, engine.vocab_size, (length,), generator=draw).tolist() for length in range(20, 44, 2)]
    params = SamplingParams(max_tokens=4, seed=5, logprobs=True, prompt_logprobs=True)
    whole = sampling.generate_together([(engine, prompts, params)])[0]

    shapes: list[tuple[int, int]] = []
    forward = engine._forward

    def recording(adapters, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(adapters, **kwargs)

    budget = 4 * sampling._MIN_PASS_COLUMNS
    monkeypatch.setattr(engine, "_forward", recording)
    monkeypatch.setattr(engine, "_pass_positions", lambda pass_s: budget)
    steps = list(sampling.generate_steps([(engine, prompts, params)], pass_s=1.0))
    cut = next(done[0] for done, _ in steps if done)

    assert max(rows * columns for rows, columns in shapes) <= budget
    prefill = [(rows, columns) for rows, columns in shapes if rows > 1 and columns > 1]
    assert prefill == [(4, 42)] * 3  # the 12 rows left-padded to the longest, four at a time
    assert cut == whole


def test_a_short_prompt_decodes_apart_from_long_ones_so_it_never_waits_for_their_prefill():
    """A 3-token prompt joined a decode batch of 2,000-token ones (it fit the token budget): it waited for
    their whole prefill, padded to their width, and on a shared host failed with their deadline."""
    params = SamplingParams(max_tokens=4)
    lengths = [2000, 1200, 900, 100, 60, 3]
    rows = [sampling._Row([5] * length, params, seed=0, max_new=4) for length in lengths]
    batches = sampling.decode_batches(rows, max_rows=256, max_tokens=10**9)
    # each row padded by at most 4 times its own length, or 256 columns
    assert [[len(row.prompt_ids) for row in batch] for batch in batches] == [[2000, 1200, 900], [100, 60, 3]]
