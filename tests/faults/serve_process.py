"""A real ``icefloe serve`` in a subprocess, and a small blocking client of its training API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from icefloe import wire
from icefloe.protocol import JOB_TERMINAL_STATES

PREFIX = "/api/v2/databases/DB/schemas/SC/cortex-training"
TRAINING = {
    "job_type": "training",
    "model_name": "tiny:arith",
    "training_config": {"optimizer": {"name": "AdamW", "lr": 1e-3}, "max_seq_len": 64},
}
_START_TIMEOUT_S = 120.0  # a cold torch import on a loaded 2-core machine
_TERMINAL_REQUEST_STATES = ("done", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Serve:
    """``icefloe serve`` on ``data_dir`` in a subprocess; ``with Serve(...) as serve:`` waits for /health."""

    def __init__(self, data_dir: Path, *args: str, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "icefloe.cli", "serve", "--data-dir", str(data_dir)]
        command += ["--port", str(self.port), "--slots", "2", *args]
        # Output to a file, not a pipe: engine processes inherit it and may outlive a killed service.
        self._log = data_dir.with_name(f"{data_dir.name}-serve-{self.port}.log")
        with self._log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.base_url + PREFIX, timeout=60)

    def __enter__(self) -> Serve:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"icefloe serve exited with {self.process.returncode}: {self.output()[-2000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("icefloe serve did not answer /health in time")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the service, its forkserver and engine processes
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def kill(self) -> None:
        """kill -9 of the service process alone (its engine processes notice their pipes close)."""
        self.process.kill()
        self.process.wait()

    def output(self) -> str:
        return self._log.read_text(errors="replace")

    # --- the training API -----------------------------------------------------------------------
    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text}"
        return response.json() if response.content else None

    def create(self, *sub_jobs: dict[str, Any]) -> str:
        return self.call("POST", "/", json={"sub_job_configs": list(sub_jobs or (TRAINING,))})["job_id"]

    def wait_job(self, job_id: str, *states: str, timeout_s: float = 120.0, renew: bool = True) -> dict[str, Any]:
        """The job once it is in one of ``states``; ``renew=False`` reads it through the job list,
        which does not renew its lease."""
        deadline = time.monotonic() + timeout_s
        while True:
            if renew:
                job = self.call("GET", f"/{job_id}")
            else:
                job = next(j for j in self.call("GET", "/")["jobs"] if j["job_id"] == job_id)
            if job["status"] in states:
                return job
            if job["status"] in JOB_TERMINAL_STATES or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {job['status']} ({job['reason']}), not {states}")
            time.sleep(0.1)

    def submit(self, job_id: str, endpoint: str, body: Any) -> str:
        """Queue an op (a frame for octet endpoints, JSON otherwise); its request id."""
        if endpoint in ("forward-backward", "forward", "generate"):
            kwargs: dict[str, Any] = {
                "content": wire.encode(body),
                "headers": {"Content-Type": "application/octet-stream"},
            }
        else:
            kwargs = {"json": body}
        return self.call("POST", f"/{job_id}/{endpoint}", **kwargs)["request_id"]

    def finished(self, job_id: str, request_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The request's poll answer once it is terminal."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.call("GET", f"/{job_id}/requests/{request_id}", params={"wait": 5})
            if answer["status"] in _TERMINAL_REQUEST_STATES:
                return answer
            if time.monotonic() > deadline:
                raise AssertionError(f"request {request_id} still {answer['status']}")

    def run(self, job_id: str, endpoint: str, body: Any) -> Any:
        answer = self.finished(job_id, self.submit(job_id, endpoint, body))
        assert answer["status"] == "done", answer
        return answer["result"]

    def engine_pid(self, job_id: str) -> int:
        """The job's engine process, as its log names it."""
        page = self.call("POST", f"/{job_id}/operation", json={"operation_type": "tail-logs"})
        for entry in page["entries"]:
            if entry["msg"].startswith("engines run in process "):
                return int(entry["msg"].removeprefix("engines run in process "))
        raise AssertionError(f"job {job_id} has no engine process in its log: {page['entries']}")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped: the signal is asynchronous,
    and on a busy machine a thread still runs (and answers a call) for a while after ``kill``."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")

    def stopped() -> bool:
        try:
            states = {(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()}
        except FileNotFoundError:  # a thread ended as we looked
            return False
        return states <= {"T", "t"}

    wait_for(stopped, 30, f"process {pid} stops")


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


_PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
# A LoRA trainer that can share a host, in passes of at most 2,048 tokens: a long op runs many.
SHARED_LORA = {
    **TRAINING,
    "training_config": {**TRAINING["training_config"], "peft_config": _PEFT, "mb_spec": {"max_tokens_per_mb": 2048}},
}


def create_shared_lora_job(serve: Serve, token: str, *sub_jobs: dict[str, Any]) -> str:
    """A job of the caller of bearer ``token`` with ``sub_jobs`` (default: one :data:`SHARED_LORA` trainer)."""
    answer = httpx.post(f"{serve.base_url}{PREFIX}/", json={"sub_job_configs": list(sub_jobs or (SHARED_LORA,))},
                        headers={"Authorization": f"Bearer {token}"}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()["job_id"]
