"""A real ``icefloe serve`` for the Tinker API fault tests: a model root holding ``tiny-chat``, a token file
naming tenants, and a small blocking client of the API's raw routes (bodies the SDK would never send)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from .serve_process import Serve

# The SDK insists on the tml- prefix.
TOKENS = {"alice": "tml-alice-key", "bob": "tml-bob-key", "admin": "tml-admin-key"}


def export_model(root: Path) -> Path:
    folder = root / "tiny-chat"
    command = [sys.executable, "-m", "icefloe.cli", "models", "export", "tiny:chat", str(folder)]
    subprocess.run(command, check=True, capture_output=True)
    return folder


def token_file(path: Path, **limits: str) -> Path:
    """One line per tenant of :data:`TOKENS`, ``limits`` (tenant -> 'max_jobs=1 ...') after its token."""
    path.write_text("".join(f"{name}: {token} {limits.get(name, '')}\n" for name, token in TOKENS.items()))
    return path


def tinker_serve(tmp_path: Path, *args: str, limits: dict[str, str] | None = None) -> Serve:
    """``icefloe serve`` with the model root ``tmp_path/models`` (tiny-chat exported there) and tenants."""
    root = tmp_path / "models"
    if not (root / "tiny-chat").is_dir():
        export_model(root)
    tokens = token_file(tmp_path / "tokens", **(limits or {}))
    serve = Serve(tmp_path / "serve", "--model-root", str(root), "--token-file", str(tokens), "--slots", "4", *args)
    serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"  # its training-API helpers see every job
    return serve


class Tinker:
    """Raw calls to ``/api/v1`` as one tenant."""

    def __init__(self, serve: Serve, tenant: str) -> None:
        self.serve = serve
        self.http = httpx.Client(
            base_url=f"{serve.base_url}/api/v1", headers={"X-API-Key": TOKENS[tenant]}, timeout=120
        )

    def close(self) -> None:
        self.http.close()

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs) if body is not None else self.http.post(path, **kwargs)

    def ok(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        answer = self.post(path, body, **kwargs)
        assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text}"
        return answer.json()

    def outcome(self, future_id: str, timeout_s: float = 120) -> httpx.Response:
        """A future's final answer: a protobuf or JSON result, or ``{error, category}``."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.post("/retrieve_future", {"request_id": future_id})
            waiting = answer.headers["content-type"].startswith("application/json") and (
                answer.status_code == 200 and answer.json().get("type") == "try_again"
            )
            if not waiting:
                return answer
            assert time.monotonic() < deadline, f"future {future_id} still pending"

    def model(self, base_model: str = "tiny-chat", rank: int = 4) -> tuple[str, str]:
        """(session id, model id) of a new LoRA model, once its job runs."""
        session_id = self.ok("/create_session", {})["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": base_model, "lora_config": {"rank": rank}}
        created = self.ok("/create_model", body)
        assert self.outcome(created["request_id"]).json()["model_id"] == created["model_id"]
        return session_id, created["model_id"]

    def sampler(self, session_id: str, seq: int = 0, base_model: str = "tiny-chat") -> str:
        body = {"session_id": session_id, "sampling_session_seq_id": seq, "base_model": base_model}
        return self.ok("/create_sampling_session", body)["sampling_session_id"]


def forward_backward(model_id: str, seq_id: int, tokens: list[int], **inputs: Any) -> bytes:
    """A cross_entropy ForwardBackwardRequest of one datum; ``inputs`` replace or add loss_fn_inputs
    (a Tensor protobuf each), a ``loss_fn_config`` dict sets the config."""
    from tinker.proto import tinker_public_pb2 as pb

    config = inputs.pop("loss_fn_config", {})
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for name, value in config.items():
        message.loss_fn_config[name] = value
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], dtype=np.int32).tobytes()
    length = len(tokens) - 1
    fields = {
        "target_tokens": dense(np.asarray(tokens[1:], dtype=np.int64)),
        "weights": dense(np.ones(length, dtype=np.float32)),
        **inputs,
    }
    for name, tensor in fields.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return message.SerializeToString()


def dense(array: np.ndarray, shape: list[int] | None = None) -> Any:
    from tinker.proto import tinker_public_pb2 as pb

    dtype = {np.float32: pb.DTYPE_FLOAT32, np.int64: pb.DTYPE_INT64}[array.dtype.type]
    return pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=list(array.shape) if shape is None else shape)


def sparse(values: np.ndarray, crow: list[int], cols: list[int], shape: list[int]) -> Any:
    from tinker.proto import tinker_public_pb2 as pb

    csr = pb.SparseCsr(
        values=values.tobytes(),
        crow_indices=np.asarray(crow, dtype=np.int64).tobytes(),
        col_indices=np.asarray(cols, dtype=np.int64).tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=shape)


PROTO = {"Content-Type": "application/x-protobuf"}
