"""``python -m bench load --api tinker``: SDK clients under load, then a kill -9 of the service and a restart.

``--clients`` (default 16) unmodified ``tinker`` SDK clients, spread over four processes, each train
their own LoRA model (rank 8) on an ``icefloe serve`` subprocess for ``--seconds``: forward_backward,
optim_step and a sample per round, a ``save_state`` every other round. Then the service is killed
with SIGKILL mid-flight and started again on the same data dir and port; the clients see their
in-flight calls fail (not hang) and stop. Every future the service handed out is then read back
once: ``lost`` counts those that answer neither a result nor an error (unknown, or still pending).
``errors_5xx`` counts 5xx answers the clients received, at any time. Every save whose
``result()`` came back before the kill is loaded into a fresh model: ``loadable`` of ``saves``.
``ratio`` = ``loadable`` ÷ ``saves`` (1 when every save outlived the kill).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import finish

_KEY = "tml-bench-load"
_PROCESSES = 4
_TOKENS = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # ids of tiny:chat's vocabulary
_FUTURE_ROUTES = ("/retrieve_future", "/retrieve_futures", "/cancel_future")  # they read futures, not make them


@dataclass
class _Tally:
    rounds: int = 0
    errors_before_kill: list[str] = field(default_factory=list)
    errors_after_kill: int = 0
    saves: list[str] = field(default_factory=list)  # paths whose save_state().result() came back
    futures: list[str] = field(default_factory=list)  # every future id a POST was answered with
    statuses: Counter = field(default_factory=Counter)


def _watch(tally: _Tally) -> None:
    """Count every answer's status and note every future id the SDK is handed, from inside its HTTP client."""
    send = httpx.AsyncClient.send

    async def watched(self: httpx.AsyncClient, request: httpx.Request, **kwargs: object) -> httpx.Response:
        response = await send(self, request, **kwargs)
        tally.statuses[response.status_code // 100 * 100] += 1
        path = request.url.path
        if request.method == "POST" and response.status_code == 200 and not path.endswith(_FUTURE_ROUTES):
            await response.aread()
            if response.headers.get("content-type", "").startswith("application/json"):
                with suppress(ValueError):
                    body = response.json()
                    if isinstance(body, dict) and "request_id" in body:
                        tally.futures.append(body["request_id"])
        return response

    httpx.AsyncClient.send = watched  # type: ignore[method-assign]


def _client(
    base_url: str, model: str, index: int, stop: threading.Event, killed: object, ready: object, tally: _Tally
) -> None:
    import tinker
    from tinker import types

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(_TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": _TOKENS[1:], "weights": [1.0] * (len(_TOKENS) - 1)},
    )
    prompt, params = types.ModelInput.from_ints(_TOKENS[:4]), types.SamplingParams(max_tokens=8, temperature=1.0)
    service = tinker.ServiceClient(base_url=base_url, api_key=_KEY)
    try:
        training = service.create_lora_training_client(base_model=model, rank=8).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        ready.put(index)  # type: ignore[attr-defined]
        round_ = 0
        while not stop.is_set():
            try:
                backward = training.forward_backward([datum], "cross_entropy")
                step = training.optim_step(types.AdamParams(learning_rate=1e-3))
                sample = sampler.sample(prompt, 2, params)
                backward.result(), step.result(), sample.result()
                if round_ % 2 == 0:
                    path = training.save_state(f"c{index}-r{round_}").result().path
                    if not killed.is_set():  # type: ignore[attr-defined]
                        tally.saves.append(path)
                tally.rounds += 1
            except Exception as exc:  # after the kill, every call of the old model fails: that is expected
                if killed.is_set():  # type: ignore[attr-defined]
                    tally.errors_after_kill += 1
                    return
                tally.errors_before_kill.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            round_ += 1
    finally:
        with suppress(Exception):  # the session may be gone with the killed service
            service.close("success").result(timeout=30)


def _run_clients(
    base_url: str, model: str, count: int, first: int, stop: object, killed: object, ready: object
) -> _Tally:
    """One process's clients, each on a thread of its own, until ``stop`` is set."""
    tally = _Tally()
    _watch(tally)
    local_stop = threading.Event()
    threads = [
        threading.Thread(target=_client, args=(base_url, model, first + i, local_stop, killed, ready, tally))
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    stop.wait()  # type: ignore[attr-defined]
    local_stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return tally


class _Service:
    """``icefloe serve`` on a fixed port, which a kill -9 and a restart keep."""

    def __init__(self, data_dir: Path, model_root: Path, slots: int) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(self.port), "--data-dir"]
        self.command += [str(data_dir), "--model-root", str(model_root), "--slots", str(slots), "--token", _KEY]
        self.log = data_dir.with_suffix(".log")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("a") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 180
        while True:
            with suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"icefloe serve did not come up; see {self.log}")
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(60)


def _read_back(base_url: str, futures: list[str]) -> int:
    """How many futures answer neither a result nor an error."""

    async def one(http: httpx.AsyncClient, future_id: str) -> bool:
        answer = await http.post("/retrieve_future", json={"request_id": future_id})
        if answer.status_code != 200:
            return True
        return (
            answer.headers["content-type"].startswith("application/json") and answer.json().get("type") == "try_again"
        )

    async def all_of_them() -> int:
        headers = {"X-API-Key": _KEY}
        async with httpx.AsyncClient(base_url=f"{base_url}/api/v1", headers=headers, timeout=120) as http:
            lost = 0
            for start in range(0, len(futures), 32):
                lost += sum(await asyncio.gather(*(one(http, f) for f in futures[start : start + 32])))
            return lost

    return asyncio.run(all_of_them())


def _load_all(base_url: str, model: str, saves: list[str]) -> int:
    """How many of ``saves`` load into a fresh model."""
    import tinker

    loaded = 0
    with tinker.ServiceClient(base_url=base_url, api_key=_KEY) as service:
        training = service.create_lora_training_client(base_model=model, rank=8).result()
        for path in saves:
            with suppress(Exception):
                training.load_state(path).result()
                loaded += 1
    return loaded


def run(args: argparse.Namespace) -> None:
    clients = args.clients[0]
    from icefloe.engines.models import resolve_model

    with tempfile.TemporaryDirectory(prefix="icefloe-bench-load-") as tmp:
        model_root = Path(tmp) / "models"
        model = str(model_root / "tiny-chat")
        shutil.copytree(resolve_model("tiny:chat"), model)
        service = _Service(Path(tmp) / "serve", model_root, slots=clients + 2)
        service.start()
        try:
            manager = multiprocessing.Manager()
            stop, killed, ready = manager.Event(), manager.Event(), manager.Queue()
            shares = [clients // _PROCESSES + (i < clients % _PROCESSES) for i in range(_PROCESSES)]
            firsts = [sum(shares[:i]) for i in range(_PROCESSES)]
            with ProcessPoolExecutor(_PROCESSES) as pool:
                parts = [pool.submit(_run_clients, service.base_url, model, n, first, stop, killed, ready)
                         for n, first in zip(shares, firsts, strict=True) if n]  # fmt: skip
                for _ in range(clients):  # the clock starts once every client has its model and sampler
                    ready.get(timeout=900)
                time.sleep(args.seconds)
                killed.set()
                service.kill()  # mid-flight: every client has calls in the air
                service.start()
                stop.set()
                tallies = [part.result() for part in parts]
            lost = _read_back(service.base_url, [f for t in tallies for f in t.futures])
            saves = [path for t in tallies for path in t.saves]
            loadable = _load_all(service.base_url, model, saves)
        finally:
            service.stop()
    statuses = sum((t.statuses for t in tallies), Counter())
    errors = [e for t in tallies for e in t.errors_before_kill]
    rounds = sum(t.rounds for t in tallies)
    futures = sum(len(t.futures) for t in tallies)
    print(f"{'clients':>8}{'rounds':>8}{'futures':>9}{'saves':>7}{'loadable':>10}{'lost':>6}"
          f"{'2xx':>8}{'4xx':>6}{'5xx':>6}")  # fmt: skip
    print(f"{clients:>8}{rounds:>8}{futures:>9}{len(saves):>7}{loadable:>10}{lost:>6}"
          f"{statuses[200]:>8}{statuses[400]:>6}{statuses[500]:>6}")  # fmt: skip
    for error in errors[:5]:
        print(f"error before the kill: {error}")
    finish(
        args,
        f"bench=load ratio={loadable / len(saves) if saves else float('nan'):.3f} api=tinker clients={clients} "
        f"seconds={args.seconds:g} rounds={rounds} futures={futures} "
        f"saves={len(saves)} loadable={loadable} lost={lost} errors_5xx={statuses[500]} "
        f"errors_before_kill={len(errors)} failed_after_kill={sum(t.errors_after_kill for t in tallies)}",
        record_as="load-tinker",
    )
