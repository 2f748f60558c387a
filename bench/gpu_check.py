"""One run of icefloe's GPU paths on a CUDA machine; ``--dry-run`` runs the same checks on CPU.

``python -m bench.gpu_check`` (``make gpu-check``, see docs/gpu.md) builds a Qwen3-0.6B-shaped model
with random weights and a one-character-per-token tokenizer (nothing is downloaded), then runs each
check through icefloe's own client and engines, timed and isolated from the others:

  train           bf16 fwd_bwd + step on a GRPO batch: finite, falling loss; peak GPU memory
  sample          generate with seeds, logprobs and stop tokens (vLLM); a seed gives the same tokens again
  sync_local      weight sync inside one process; the sampler's log-probs then match the trainer's, also
                  on prompts it sampled before the sync (no prefix cached with the old weights is reused)
  sync_ipc        CUDA IPC hand-off to a sampler in a second process, then the same comparison
  sync_broadcast  bucketed broadcast to a sampler in a second process (NCCL; gloo on CPU), then the same
  sleep_wake      both engines sleep and wake: memory freed and taken back, outputs unchanged
  lora            LoRA adapters trained, synced (twice) and sampled with (vLLM)
  ray             the Ray backend: trainer and sampler actors sharing one GPU (0.5 each), CUDA IPC sync
  pytest_gpu      the tests marked ``gpu`` (they skip without CUDA)

Each check prints ``check=<name> ok|skip|FAIL <seconds>s key=value ...`` (a failure adds the tail of
its traceback); the run ends with ``bench=gpu ok=<n>/<total> ...``. A check past its share of
``--budget-s`` is reported as failed and the rest go on. ``--dry-run`` uses the tiny preset on CPU and
skips only what needs CUDA. Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import os
import queue
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from icefloe.client import Client, build_batch
from icefloe.config import ClientConfig
from icefloe.engines.models import TINY_PRESETS, TinyPreset, load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parent.parent
QWEN3_SHAPE = "qwen3-0.6b-shape"
VLLM_PIN = "vllm==0.33.0"
# One tenth of the H200 per vLLM engine holds the 0.6B weights and ~90k tokens of KV cache, and
# leaves room for the three engines of the run and the gpu tests' own.
VLLM_KWARGS = {"gpu_memory_utilization": 0.1, "enforce_eager": True}
SYNC_REPEATS = 3  # timed syncs after one warm-up; the median is reported


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _register_qwen3_shape() -> None:
    """Qwen3-0.6B's shapes; its 151,936 ids are 4 special tokens and one character each."""
    points = itertools.chain(range(0x100, 0xD800), range(0xE000, 0x110000))  # no ASCII, no surrogates
    TINY_PRESETS[QWEN3_SHAPE] = TinyPreset(
        alphabet="".join(map(chr, itertools.islice(points, 151_936 - 4))),
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


@dataclass
class Run:
    """What every check shares: the device, the model, the sizes, and clients built on first use."""

    gpu: bool
    vllm: str | None  # the installed vLLM's version
    model_dir: Path
    vocab: int
    rows: int  # GRPO batch rows
    prompt_len: int
    response_len: int
    lr: float
    atol: float  # sampler vs trainer log-prob tolerance (largest gap)
    figures: dict[str, Any] = field(default_factory=dict)  # for the closing line
    clients: dict[str, Client] = field(default_factory=dict)
    peer: Peer | None = None

    def config(self, **overrides: Any) -> ClientConfig:
        base = {
            "model": str(self.model_dir),
            "dtype": "bfloat16" if self.gpu else "float32",
            "max_seq_len": 4 * (self.prompt_len + self.response_len),
            "training": {"optimizer": {"lr": self.lr}, "peak_memory_log": True},
            "sampling": {"engine_kwargs": VLLM_KWARGS if self.vllm else {}},
            "backend": {"type": "local", "device": "cuda" if self.gpu else "cpu"},
            "job_ready_timeout_s": 300,
        }
        return ClientConfig.build(base, **overrides)

    def client(self, name: str, **overrides: Any) -> Client:
        if name not in self.clients:
            self.clients[name] = Client(self.config(**overrides)).open()
        return self.clients[name]

    def prompts(self, count: int, seed: int, length: int | None = None) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(4, self.vocab, (count, length or self.prompt_len), generator=generator).tolist()

    def grpo_batch(self, scorer: Callable[[dict], dict]) -> dict[str, Any]:
        """A GRPO batch with advantages ±1 whose old log-probs are the current policy's (ratio 1 at first)."""
        prompts, responses = self.prompts(self.rows, 1), self.prompts(self.rows, 2, self.response_len)
        batch = build_batch(prompts, responses, [(-1.0) ** row for row in range(self.rows)], pad_id=0)
        batch["context"]["old_logprobs"] = scorer(batch)["logprobs"]
        return batch

    def close(self) -> None:
        for client in self.clients.values():
            client.shutdown()
        self.clients.clear()
        if self.peer is not None:
            self.peer.close()
            self.peer = None


def _need_vllm(run: Run) -> None:
    if run.gpu and run.vllm is None:
        raise Skip(f"vLLM is not installed: pip install {VLLM_PIN} (docs/gpu.md)")


def _gpu_used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _logprob_gap(run: Run, prompts: list[list[int]], samples: list[dict], forward: Callable[[dict], dict]) -> float:
    """Largest |sampler log-prob - trainer log-prob| over every sampled token; fails above ``run.atol``."""
    batch = build_batch(prompts, [s["token_ids"] for s in samples], [0.0] * len(prompts), pad_id=0)
    trainer_BS, mask_BS = forward(batch)["logprobs"], batch["context"]["loss_mask"].bool()
    gap = max(
        (torch.tensor(sample["logprobs"]) - trainer_BS[row][mask_BS[row]].float()).abs().max().item()
        for row, sample in enumerate(samples)
    )
    _expect(math.isfinite(gap) and gap <= run.atol, f"sampler log-probs differ from the trainer's by {gap:.4g}")
    return gap


# --- checks: each returns the figures it prints, raises Skip, or fails by raising --------------------
def check_train(run: Run) -> dict[str, Any]:
    client = run.client("local")
    batch = run.grpo_batch(client.forward)
    losses, start = [], time.perf_counter()
    for _ in range(4):
        losses.append(client.fwd_bwd(batch)["loss"])
        stepped = client.step()
    seconds = time.perf_counter() - start
    _expect(all(math.isfinite(loss) for loss in losses), f"non-finite loss: {losses}")
    _expect(losses[-1] < losses[0], f"loss did not fall over 4 steps: {losses}")
    tok_s = 4 * int(batch["kwargs"]["attention_mask"].sum()) / seconds
    peak_gib = stepped["peak_memory"]["gpu_peak"] / 2**30
    run.figures |= {"train_tok_s": tok_s, "peak_gib": peak_gib}
    return {"loss0": losses[0], "loss3": losses[-1], "train_tok_s": tok_s, "peak_gib": peak_gib}


def check_sample(run: Run) -> dict[str, Any]:
    _need_vllm(run)
    client = run.client("local")
    prompts = run.prompts(8, 3)
    params = {"max_tokens": run.response_len, "seed": 7, "logprobs": True}
    first, again = client.generate(prompts, params), client.generate(prompts, params)
    other = client.generate(prompts, {**params, "seed": 8})
    tokens = [s["token_ids"] for s in first]
    _expect(tokens == [s["token_ids"] for s in again], "the same seed gave different tokens")
    _expect(tokens != [s["token_ids"] for s in other], "another seed gave the same tokens")
    for sample in first:
        logprobs = sample["logprobs"]
        _expect(len(logprobs) == len(sample["token_ids"]), "one log-prob per sampled token")
        _expect(all(math.isfinite(x) and x <= 1e-6 for x in logprobs), f"log-probs out of range: {logprobs[:4]}")
    alone = client.generate(prompts[:1], params)[0]["token_ids"]
    stop_id = alone[len(alone) // 2]
    stopped = client.generate(prompts[:1], {**params, "stop_token_ids": [stop_id]})[0]
    _expect(stopped["token_ids"] == alone[: alone.index(stop_id) + 1], "stop token did not end the sample on it")
    _expect(stopped["finish_reason"] == "stop", f"finish_reason {stopped['finish_reason']!r} after a stop token")
    bulk = run.prompts(8 * run.rows, 4)
    start = time.perf_counter()
    samples = client.generate(bulk, {"max_tokens": 2 * run.response_len, "ignore_eos": True, "seed": 1})
    tok_s = sum(len(s["token_ids"]) for s in samples) / (time.perf_counter() - start)
    run.figures["tok_s"] = tok_s
    return {"engine": "vllm" if run.vllm else "torch", "tok_s": tok_s, "rows": len(bulk)}


def check_sync_local(run: Run) -> dict[str, Any]:
    client = run.client("local")
    prompts, params = run.prompts(4, 5), {"max_tokens": run.response_len, "seed": 3, "logprobs": True}
    client.generate(prompts, params)  # their prefixes are cached with the old weights; the sync must drop them
    batch = run.grpo_batch(client.forward)
    client.fwd_bwd(batch)
    version = client.step()["global_step"]
    seconds = []
    for _ in range(1 + SYNC_REPEATS):
        start = time.perf_counter()
        synced = client.sync_weights()
        seconds.append(time.perf_counter() - start)
    _expect(synced["policy_version"] == version, f"policy_version {synced['policy_version']} after step {version}")
    samples = client.generate(prompts, params)
    _expect({s["policy_version"] for s in samples} == {version}, "samples do not carry the synced version")
    gap = _logprob_gap(run, prompts, samples, client.forward)
    run.figures["local_sync_s"] = statistics.median(seconds[1:])
    return {"sync_s": run.figures["local_sync_s"], "gib": synced["bytes"] / 2**30, "max_gap": gap}


def check_sleep_wake(run: Run) -> dict[str, Any]:
    client = run.client("local")
    prompts = run.prompts(4, 6)
    greedy = {"max_tokens": run.response_len, "temperature": 0.0, "logprobs": True}
    batch = run.grpo_batch(client.forward)
    before, scored = client.generate(prompts, greedy), client.forward(batch)["logprobs"]
    used = _gpu_used_gib() if run.gpu else math.nan
    client.sleep_inference(level=1)
    client.sleep_training()
    asleep = _gpu_used_gib() if run.gpu else math.nan
    client.wake_training()
    client.wake_inference()
    awake = _gpu_used_gib() if run.gpu else math.nan
    after = client.generate(prompts, greedy)
    _expect([s["token_ids"] for s in after] == [s["token_ids"] for s in before], "greedy samples changed")
    _expect(torch.equal(client.forward(batch)["logprobs"], scored), "trainer log-probs changed")
    figures = {"freed_gib": used - asleep, "restored_gib": awake - asleep}
    if run.gpu:
        _expect(figures["freed_gib"] > 1.0, f"sleep freed only {figures['freed_gib']:.2f} GiB")
        _expect(figures["restored_gib"] > 1.0, f"wake took back only {figures['restored_gib']:.2f} GiB")
    return figures if run.gpu else {"memory": "n/a-on-cpu", "outputs": "unchanged"}


def check_lora(run: Run) -> dict[str, Any]:
    _need_vllm(run)
    client = run.client("lora", lora={"rank": 8, "alpha": 16})
    prompts = run.prompts(4, 7)
    for round_ in range(2):  # the second sync replaces the adapter the first one delivered
        client.fwd_bwd(run.grpo_batch(client.forward))
        version = client.step(learning_rate=10 * run.lr)["global_step"]
        synced = client.sync_weights()
        samples = client.generate(prompts, {"max_tokens": run.response_len, "seed": round_, "logprobs": True})
        _expect({s["policy_version"] for s in samples} == {version}, "samples do not carry the synced version")
        gap = _logprob_gap(run, prompts, samples, client.forward)
    return {"adapter_mib": synced["bytes"] / 2**20, "max_gap": gap}


def check_sync_ipc(run: Run) -> dict[str, Any]:
    if not run.gpu:
        raise Skip("CUDA IPC needs CUDA")
    from icefloe.engines.distributed import export_cuda_ipc

    peer = _peer(run)
    _train(run, peer.trainer)
    seconds = []
    for _ in range(1 + SYNC_REPEATS):
        start = time.perf_counter()
        named = [(name, tensor.contiguous()) for name, tensor in peer.trainer.named_weights()]
        peer.ask("ipc", export_cuda_ipc(named), peer.trainer.global_step)
        seconds.append(time.perf_counter() - start)
        del named  # the peer has copied out of the shared tensors
    gap = peer.gap(run)
    run.figures["ipc_s"] = statistics.median(seconds[1:])
    return {"sync_s": run.figures["ipc_s"], "max_gap": gap}


def check_sync_broadcast(run: Run) -> dict[str, Any]:
    from icefloe.engines.distributed import weight_layout

    peer = _peer(run)
    _train(run, peer.trainer)
    backend = "nccl" if run.gpu else "gloo"
    layout = weight_layout(peer.trainer.named_weights())
    seconds = []
    try:
        for _ in range(1 + SYNC_REPEATS):
            seconds.append(_broadcast_once(peer, layout, backend))
    except Exception as exc:  # a limit of NCCL, not of the broadcast: one rank per GPU
        if "Duplicate GPU" in str(exc):
            raise Skip("NCCL refuses two ranks on one GPU (Duplicate GPU detected): needs a second GPU") from exc
        raise
    gap = peer.gap(run)
    run.figures["sync_s"] = statistics.median(seconds[1:])
    return {"backend": backend, "sync_s": run.figures["sync_s"], "max_gap": gap}


def _broadcast_once(peer: Peer, layout: list[Any], backend: str) -> float:
    """Seconds of one broadcast of the trainer's weights to the peer (joining the group the first time)."""
    from icefloe.engines.distributed import DEFAULT_BUCKET_BYTES, WeightBroadcast

    start = time.perf_counter()
    if peer.link is None:  # rank 0 hosts the store: the peer joins it while this waits for it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        peer.send("join", ("127.0.0.1", port), backend)
        peer.link = WeightBroadcast("127.0.0.1", port, 0, 2, backend=backend, device=str(peer.trainer.device))
        peer.answer()
    peer.send("receive", layout, DEFAULT_BUCKET_BYTES)
    peer.link.send(peer.trainer.named_weights(), peer.trainer.global_step, DEFAULT_BUCKET_BYTES)
    peer.answer()
    return time.perf_counter() - start


def check_ray(run: Run) -> dict[str, Any]:
    if "ray" not in sys.modules:
        raise Skip("Ray is not installed: pip install 'icefloe[ray]'")
    backend = {"type": "ray", "colocate": True, "num_gpus_per_worker": 0.5 if run.gpu else 0.0}
    client = run.client("ray", backend=backend)
    losses = [client.fwd_bwd(run.grpo_batch(client.forward))["loss"]]
    version = client.step()["global_step"]
    start = time.perf_counter()
    synced = client.sync_weights(cuda_ipc=run.gpu)  # colocated: by handle on GPU, gloo broadcast on CPU
    seconds = time.perf_counter() - start
    prompts = run.prompts(4, 8)
    samples = client.generate(prompts, {"max_tokens": run.response_len, "seed": 5, "logprobs": True})
    _expect(math.isfinite(losses[0]), f"non-finite loss {losses[0]}")
    _expect(synced["policy_version"] == version == samples[0]["policy_version"], "the synced version is not sampled")
    gap = _logprob_gap(run, prompts, samples, client.forward)
    return {"sync": "cuda_ipc" if run.gpu else "gloo", "sync_s": seconds, "max_gap": gap}


def check_pytest_gpu(run: Run, remaining_s: float) -> dict[str, Any]:
    files = sorted(str(p) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    _expect(bool(files), "no test file holds a test marked gpu")
    if not run.gpu:
        raise Skip(f"needs CUDA ({len(files)} files hold gpu tests)")
    run.close()  # the tests start engines of their own: free this run's GPU memory first
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=remaining_s)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    _expect(done.returncode == 0, f"pytest exit {done.returncode}: {summary}\n{done.stdout[-2000:]}")
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary))
    return {"passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0)}


def _start_ray(gpu: bool) -> str:
    """Start Ray on the main thread (a driver started on a check's thread dies at shutdown); "" or the error."""
    try:
        import ray

        ray.init(num_cpus=4 if gpu else 2, num_gpus=1 if gpu else 0, include_dashboard=False,
                 log_to_driver=False, namespace="icefloe-gpu-check")  # fmt: skip
    except ImportError:
        return ""  # check_ray skips
    except Exception as exc:
        return f"ray.init failed: {type(exc).__name__}: {exc}"
    return ""


# --- the second process: a sampler that takes weights by CUDA IPC or by broadcast --------------------
def _train(run: Run, trainer: Any) -> None:
    trainer.fwd_bwd(run.grpo_batch(trainer.forward))
    trainer.step()


class Peer:
    """A TrainingEngine here and a sampling engine in a spawned process, talking over two queues."""

    def __init__(self, config: ClientConfig) -> None:
        from icefloe.engines.training import TrainingEngine

        self.trainer = TrainingEngine(config, device=config.backend.device)
        self.link: Any = None
        context = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(target=_peer_main, args=(config.model_dump_json(), self.inbox, self.outbox))
        self.process.start()
        try:
            self.answer()  # its engine is loaded
        except BaseException:
            self.process.kill()
            raise

    def send(self, kind: str, *args: Any) -> None:
        self.inbox.put((kind, args))

    def answer(self, timeout_s: float = 120) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, value = self.outbox.get(timeout=1)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the sampler process exited with code {self.process.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the sampler process did not answer within {timeout_s:.0f}s") from None
        if status != "ok":
            raise RuntimeError(f"in the sampler process: {value}")
        return value

    def ask(self, kind: str, *args: Any) -> Any:
        self.send(kind, *args)
        return self.answer()

    def gap(self, run: Run) -> float:
        prompts = run.prompts(4, 9)
        params = {"max_tokens": run.response_len, "seed": 2, "logprobs": True}
        samples = self.ask("generate", prompts, params)
        version = samples[0]["policy_version"]
        _expect(
            version == self.trainer.global_step,
            f"sampler holds version {version}, trainer is at step {self.trainer.global_step}",
        )
        return _logprob_gap(run, prompts, samples, self.trainer.forward)

    def close(self) -> None:
        self.inbox.put(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def _peer(run: Run) -> Peer:
    if run.peer is None:
        run.peer = Peer(run.config())
    return run.peer


def _peer_main(config_json: str, inbox: Any, outbox: Any) -> None:
    """The sampler process: load, then serve ``ipc``, ``join``, ``receive`` and ``generate`` until None."""
    from icefloe.engines import build_sampling_engine
    from icefloe.engines.distributed import WeightBroadcast, import_cuda_ipc
    from icefloe.protocol import SamplingParams

    config = ClientConfig.model_validate_json(config_json)
    device = config.backend.device
    engine = build_sampling_engine(config, device)
    link = None
    outbox.put(("ok", None))
    while (message := inbox.get()) is not None:
        kind, args = message
        try:
            if kind == "ipc":
                handles, version = args
                tensors = list(import_cuda_ipc(handles, torch.cuda.current_device()))
                outbox.put(("ok", engine.load_weights(tensors, policy_version=version)))
                del tensors
            elif kind == "join":
                master, backend = args
                link = WeightBroadcast(*master, 1, 2, backend=backend, device=device)
                outbox.put(("ok", None))
            elif kind == "receive":
                assert link is not None, "receive before join"
                layout, bucket_bytes = args
                outbox.put(("ok", link.receive(layout, engine.load_weights, bucket_bytes)))
            else:
                prompts, params = args
                outbox.put(("ok", engine.generate(prompts, SamplingParams(**params))))
        except Exception as exc:  # the parent reports it; this process stays up for the next check
            outbox.put(("error", "".join(traceback.format_exception(exc)[-3:]).strip()))


# --- the runner ------------------------------------------------------------------------------------
CHECKS: list[tuple[str, Callable[..., dict[str, Any]]]] = [
    ("train", check_train),
    ("sample", check_sample),
    ("sync_local", check_sync_local),
    ("sleep_wake", check_sleep_wake),
    ("lora", check_lora),
    ("sync_ipc", check_sync_ipc),
    ("sync_broadcast", check_sync_broadcast),
    ("ray", check_ray),
    ("pytest_gpu", check_pytest_gpu),
]


def _format(figures: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())


def _run_check(fn: Callable[..., dict[str, Any]], args: tuple, limit_s: float) -> tuple[str, str, bool]:
    """``(status, text, still_running)`` of one check run on a thread of its own, abandoned after ``limit_s``."""
    outcome: list[tuple[str, str]] = []

    def target() -> None:
        try:
            outcome.append(("ok", _format(fn(*args))))
        except Skip as skip:
            outcome.append(("skip", f'reason="{skip}"'))
        except BaseException as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            tail = "".join(traceback.format_exception(exc)[-4:]).rstrip()
            outcome.append(("FAIL", f"{type(exc).__name__}: {first}\n{tail}"))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    if not outcome:
        return "FAIL", f"timed out after {limit_s:.0f}s (left running)", True
    return *outcome[0], False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="CPU and the tiny preset; skip what needs CUDA")
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time budget")
    parser.add_argument("--only", default="", help="comma-separated check names to run (default: all)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    try:
        vllm = metadata.version("vllm") if gpu else None
    except metadata.PackageNotFoundError:
        vllm = None
    cache = Path(tempfile.mkdtemp(prefix="icefloe-gpu-check-"))
    if gpu:
        _register_qwen3_shape()
    with torch.device("cuda" if gpu else "cpu"):  # random init of 0.6B parameters: seconds on the GPU
        model_dir = resolve_model(f"tiny:{QWEN3_SHAPE}" if gpu else "tiny:chat", cache_dir=cache)
    sizes = {"rows": 16, "prompt_len": 64, "response_len": 64, "lr": 1e-4, "atol": 0.25} if gpu else {
        "rows": 4, "prompt_len": 6, "response_len": 8, "lr": 1e-3, "atol": 1e-4}  # fmt: skip
    run = Run(gpu=gpu, vllm=vllm, model_dir=model_dir, vocab=len(load_tokenizer(model_dir)), **sizes)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"gpu_check device={device} torch={torch.__version__} vllm={vllm} model={model_dir.name}", flush=True)

    lines, statuses, stuck = [], [], False
    try:
        for name, fn in CHECKS:
            if args.only and name not in args.only.split(","):
                continue
            remaining = args.budget_s - (time.monotonic() - began)
            start = time.perf_counter()
            if remaining < 20:
                status, text = "skip", 'reason="time budget spent"'
            elif fn is check_ray and (failure := _start_ray(gpu)):
                status, text, hung = "FAIL", failure, False
            elif fn is check_pytest_gpu:  # last: it gets what is left
                status, text, hung = _run_check(fn, (run, remaining - 15), remaining - 5)
            else:
                status, text, hung = _run_check(fn, (run,), min(180.0, remaining))
            stuck = stuck or hung
            line = f"check={name} {status} {time.perf_counter() - start:.1f}s {text}"
            print(line, flush=True)
            lines.append(line.splitlines()[0])
            statuses.append(status)
    finally:
        if not stuck:
            run.close()
            if "ray" in sys.modules and sys.modules["ray"].is_initialized():
                sys.modules["ray"].shutdown()  # on the main thread, where it started
        shutil.rmtree(cache, ignore_errors=True)
    keys = ("sync_s", "ipc_s", "local_sync_s", "tok_s", "train_tok_s", "peak_gib")
    figures = {key: run.figures.get(key, "-") for key in keys}
    figures |= {"sampler": f"vllm-{vllm}" if vllm else "torch", "device": device.replace(" ", "_")}
    print("\n".join(["--- summary", *lines]))  # again at the end: engines log a lot between the lines
    print(
        f"bench=gpu ok={statuses.count('ok')}/{len(statuses)} skip={statuses.count('skip')} "
        f"fail={statuses.count('FAIL')} {_format(figures)} seconds={time.monotonic() - began:.0f}",
        flush=True,
    )
    code = 1 if "FAIL" in statuses else 0
    if stuck:  # a check still hangs in a collective or an engine: do not wait for it at exit
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
