"""A fwd_bwd that fails or is dropped part-way leaves no gradient behind, also when it shared passes.

Runs accumulate gradients over fwd_bwd calls until their step. When calls of two runs share passes and
one fails part-way, each run's gradient must equal the sum over its calls that succeeded, each once:
what the earlier passes added is put back, and a call run again (the worker and the service rerun a
failed batch call by call) adds its own once.
"""

from __future__ import annotations

import threading

import peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch

from icefloe.engines.host import Worker
from icefloe.engines.lora import SharedBase
from icefloe.engines.models import load_causal_lm, load_tokenizer
from icefloe.engines.training import TrainingEngine, fwd_bwd_steps, fwd_bwd_together
from icefloe.protocol import InvalidRequestError

from ..refusing_loss import REFUSING_LOSS, register_refusing_loss
from .engine_batches import make_batch, make_config, random_rows

LORAS = [{"rank": 4, "alpha": 8}, {"rank": 8, "alpha": 8}]
PASS_TOKENS = 24  # positions per pass: a call of a few rows takes several


@pytest.fixture
def passes(monkeypatch) -> list[tuple[str | None, bool]]:
    """Each pass a call's loss ran, as the call's tag and whether it refused."""
    return register_refusing_loss(monkeypatch)


def _shared(model_dir) -> SharedBase:
    base = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu")).requires_grad_(False)
    return SharedBase(base, model_dir=model_dir, tokenizer=load_tokenizer(model_dir))


def _runs(model_dir) -> list[TrainingEngine]:
    """Runs A and B on one base."""
    shared = _shared(model_dir)
    return [TrainingEngine(_config(run), shared=shared) for run in range(len(LORAS))]


def _config(run: int):
    training = {"optimizer": {"lr": 2e-2}, "micro_batch_tokens": PASS_TOKENS}
    return make_config(seed=run + 1, lora=LORAS[run], training=training)


def _batch(tag: str, num_rows: int, seed: int, *, refuse_at_pass: int | None = None) -> dict:
    config = {"tag": tag, "refuse_at_pass": refuse_at_pass}
    return make_batch(*random_rows(num_rows, seed=seed), loss_fn=REFUSING_LOSS, config=config)


def _grads(engine: TrainingEngine) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in engine.sync_parameters()}


def _alone(model_dir, run: int, batches: list[dict]) -> dict:
    """The run's gradient after its ``batches``' fwd_bwd calls alone, one by one, on a base of its own."""
    engine = TrainingEngine(_config(run), shared=_shared(model_dir))
    for batch in batches:
        engine.fwd_bwd(batch)
    return _grads(engine)


def _assert_grads(engine: TrainingEngine, expected: dict, *, exact: bool = True) -> None:
    """``exact``: bit for bit (every pass of the run's calls ran alone); else as close as passes shared
    with another run's rows come (a pass's matmuls then sum in another order)."""
    for name, grad in _grads(engine).items():
        if expected[name] is None:
            assert grad is None, name
        elif exact:
            assert grad is not None and torch.equal(grad, expected[name]), name
        else:
            torch.testing.assert_close(grad, expected[name], atol=1e-6, rtol=0, msg=name)


def test_an_error_in_a_later_shared_pass_puts_back_both_runs_gradients(model_dir, passes):
    """A pass of B's call raised after earlier passes of A's and B's calls had added to both adapters:
    their partial sums stayed, so A's call run again counted twice and B's step took half a call."""
    run_a, run_b = _runs(model_dir)
    a1, b1, a2 = _batch("A", 4, seed=1), _batch("B", 4, seed=2), _batch("A", 6, seed=3)
    b2 = _batch("B", 6, seed=4, refuse_at_pass=3)
    run_a.fwd_bwd(a1)
    run_b.fwd_bwd(b1)
    passes.clear()
    with pytest.raises(InvalidRequestError, match="refuses pass 3"):
        fwd_bwd_together([(run_a, a2), (run_b, b2)])
    assert ("A", False) in passes[:-1] and ("B", False) in passes[:-1], "both added in passes before the error"
    _assert_grads(run_a, _alone(model_dir, 0, [a1]))
    _assert_grads(run_b, _alone(model_dir, 1, [b1]))

    run_a.fwd_bwd(a2)  # A's call again, alone, as the worker and the service run it after such an error
    _assert_grads(run_a, _alone(model_dir, 0, [a1, a2]))


def test_a_batch_refused_part_way_and_run_again_call_by_call_counts_each_gradient_once(model_dir, passes):
    """The worker runs a batch refused as invalid again call by call, so the bad call fails alone: the
    call that succeeded then added the gradient of the passes before the refusal, and its own again."""
    run_a, run_b = _runs(model_dir)
    a1, b1, a2 = _batch("A", 4, seed=1), _batch("B", 4, seed=2), _batch("A", 6, seed=3)
    b2 = _batch("B", 6, seed=4, refuse_at_pass=3)
    run_a.fwd_bwd(a1)
    run_b.fwd_bwd(b1)
    worker = Worker("shared-base", linger_s=0.0)
    lanes = [worker.lane("a"), worker.lane("b")]
    release, started = threading.Event(), threading.Event()
    lanes[0].submit(lambda: (started.set(), release.wait(10)))
    try:
        assert started.wait(10)
        futures = [
            lane.submit_batchable("fwd_bwd", (engine, batch), fwd_bwd_together)
            for lane, engine, batch in ((lanes[0], run_a, a2), (lanes[1], run_b, b2))
        ]
        passes.clear()
        release.set()
        assert futures[0].result(30)["num_tokens"] == int(a2["context"]["loss_mask"].sum())
        with pytest.raises(InvalidRequestError, match="refuses pass 3"):
            futures[1].result(30)
    finally:
        worker.close()
    assert {"A", "B"} <= {tag for tag, _ in passes[: passes.index(("B", True))]}, "one batch, then the rerun"
    _assert_grads(run_a, _alone(model_dir, 0, [a1, a2]))
    _assert_grads(run_b, _alone(model_dir, 1, [b1]))


def test_a_shared_fwd_bwd_dropped_part_way_keeps_the_answered_run_and_each_runs_earlier_calls(model_dir, passes):
    """Closing the passes part-way (a deadline, a cancel) zeroed the whole gradient of each run not yet
    answered, also what its earlier calls since the last step had added."""
    run_a, run_b = _runs(model_dir)
    a1, b1 = _batch("A", 4, seed=1), _batch("B", 4, seed=2)
    a2, b2 = _batch("A", 1, seed=3), _batch("B", 24, seed=4)  # A's small call is answered first
    run_a.fwd_bwd(a1)
    run_b.fwd_bwd(b1)
    steps = fwd_bwd_steps([(run_a, a2), (run_b, b2)])
    answered: dict[int, dict] = {}
    while 0 not in answered:
        answered.update(next(steps))
    assert 1 not in answered and ("B", False) in passes[-2:], "B's call is part-way, with passes behind it"
    steps.close()
    _assert_grads(run_a, _alone(model_dir, 0, [a1, a2]), exact=False)
    _assert_grads(run_b, _alone(model_dir, 1, [b1]))


def test_a_runs_calls_in_one_set_of_passes_are_answered_together(model_dir, passes):
    """Two calls of one run add to one gradient: with the small one answered first, a drop of the large
    one could not put back the large one's part alone (it zeroed both)."""
    run_a, run_b = _runs(model_dir)
    a1, small, large, other = (
        _batch("A", 4, seed=1),
        _batch("A", 1, seed=3),
        _batch("A", 12, seed=5),
        _batch("B", 12, seed=4),
    )
    run_a.fwd_bwd(a1)
    answered = [sorted(done) for done in fwd_bwd_steps([(run_a, small), (run_b, other), (run_a, large)]) if done]
    assert [0, 2] in answered and [1] in answered
    _assert_grads(run_a, _alone(model_dir, 0, [a1, small, large]), exact=False)


def test_a_dedicated_runs_failed_call_leaves_its_earlier_gradient(model_dir, passes):
    """One run alone (a dedicated LoRA host): a call that fails in its third pass leaves the gradient of
    the run's earlier call as it was."""
    engine = TrainingEngine(_config(0), model_dir=model_dir)
    earlier, failing = _batch("A", 4, seed=1), _batch("A", 8, seed=6, refuse_at_pass=3)
    engine.fwd_bwd(earlier)
    passes.clear()
    with pytest.raises(InvalidRequestError, match="refuses pass 3"):
        engine.fwd_bwd(failing)
    _assert_grads(engine, _alone(model_dir, 0, [earlier]))


def test_a_full_weight_runs_failed_call_discards_its_gradient_and_says_so(model_dir, passes):
    """A full-weight run keeps no copy of its gradient (it would double gradient memory): a call that fails
    after a backward of its rows leaves none, and its error says so. One that fails before any (a loss
    refusing its first pass) added nothing and keeps the run's earlier gradient; so does the run's first
    call after a step, which found none."""
    config = make_config(seed=1, training={"micro_batch_tokens": PASS_TOKENS})
    engine = TrainingEngine(config, model_dir=model_dir)
    with pytest.raises(InvalidRequestError) as first:
        engine.fwd_bwd(_batch("A", 8, seed=6, refuse_at_pass=3))
    assert not getattr(first.value, "__notes__", None), "nothing was accumulated, nothing is lost"
    assert all(p.grad is None for p in engine.model.parameters())

    earlier = _batch("A", 4, seed=1)
    engine.fwd_bwd(earlier)
    expected = {name: p.grad.clone() for name, p in engine.model.named_parameters()}
    with pytest.raises(InvalidRequestError) as refused_first:
        engine.fwd_bwd(_batch("A", 8, seed=6, refuse_at_pass=1))
    assert not getattr(refused_first.value, "__notes__", None)
    assert all(torch.equal(p.grad, expected[name]) for name, p in engine.model.named_parameters())

    with pytest.raises(InvalidRequestError) as later:
        engine.fwd_bwd(_batch("A", 8, seed=6, refuse_at_pass=3))
    assert "gradient accumulated since step 0 is discarded" in " ".join(later.value.__notes__)
    assert all(p.grad is None for p in engine.model.parameters())


def test_a_run_answered_in_a_slice_whose_later_pass_fails_keeps_its_answer_and_counts_its_gradient_once(
    model_dir, passes
):
    """A's small call shares passes with B's large one and is answered after its own pass; B's call refuses
    a later pass of the same slice. The slice still answers A (its gradient stays, once); the refusal fails
    B at the next advance, and B gets back the gradient it had. Before, the slice raised and A's answer was
    lost: the service ran A's call again, and its gradient counted twice."""
    from icefloe.service.hosts.seam import LocalEngineHost

    run_a, run_b = _runs(model_dir)
    a1, b1 = _batch("A", 4, seed=1), _batch("B", 4, seed=2)
    a2, b2 = _batch("A", 1, seed=3), _batch("B", 24, seed=4, refuse_at_pass=3)
    run_a.fwd_bwd(a1)
    run_b.fwd_bwd(b1)
    host = LocalEngineHost([], {}, {})
    host._engines = {"a": run_a, "b": run_b}
    passes.clear()
    op_id, done, finished = host.advance("a", ("fwd_bwd", [("a", a2), ("b", b2)]), 60.0)  # every pass in one slice
    assert list(done) == [0] and not finished
    assert passes.index(("A", False)) < passes.index(("B", True)), "A's pass ran before B refused"
    with pytest.raises(InvalidRequestError, match="refuses pass 3"):
        host.advance("a", op_id, 60.0)
    with pytest.raises(InvalidRequestError, match="no suspended op"):
        host.advance("a", op_id, 60.0)  # the failure ended the op
    _assert_grads(run_a, _alone(model_dir, 0, [a1, a2]), exact=False)
    _assert_grads(run_b, _alone(model_dir, 1, [b1]), exact=False)
