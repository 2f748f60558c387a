"""Settings of one ``icefloe serve`` process.

Environment variables are read only in :meth:`ServeSettings.from_env`, so a test builds settings
explicitly and never depends on the shell it runs in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from icefloe.config import validated
from icefloe.protocol import ConfigError

__all__ = ["TOKENS_ENV_VAR", "ServeSettings"]

TOKENS_ENV_VAR = "ICEFLOE_SERVE_TOKENS"  # comma-separated bearer tokens
_MAX_POST_BYTES = 62_914_560  # the training API's per-POST cap (60 MiB)


class ServeSettings(BaseModel):
    """Where the service keeps its state, who may call it and how much compute it may hand out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path  # SQLite records, job logs, results and checkpoints live here
    host: str = "127.0.0.1"  # loopback unless told otherwise: the API runs training code for its callers
    port: int = Field(8321, ge=0, le=65535)  # 0 = any free port
    tokens: tuple[SecretStr, ...] = ()  # empty = no auth (a local, single-user service)
    # Folder whose model folders jobs may load (model_name "org/name" = model_root/org/name);
    # None = tiny:<preset> models only. Nothing outside it is ever read on a caller's behalf.
    model_root: Path | None = None
    slots: int = Field(4, gt=0)  # CPU slots handed to sub-jobs when torch sees no GPU
    # LoRA jobs of one base model share a host (one copy of the base, one slot); at most this many per host.
    max_adapters: int = Field(32, ge=1)
    # Where a job's engines run: a child process per job, this process (threads), or Ray actors.
    engines: Literal["process", "local", "ray"] = "process"
    ray_address: str | None = None  # engines="ray": cluster to join; None = a local Ray started on demand
    max_post_bytes: int = Field(_MAX_POST_BYTES, gt=8192)
    inline_result_max_bytes: int = Field(4 * 1024 * 1024, gt=0)  # larger DSSST1 results go as result chunks
    result_chunk_bytes: int = Field(8 * 1024 * 1024, gt=16384)  # size of one result_chunk frame
    # A tensor result (a DSSST1 frame on disk) is deleted this long after its request finished; a poll
    # after that is 410. Long enough to re-poll a page whose answer was lost, short enough that a
    # forward per RL step does not fill the disk.
    result_ttl_s: float = Field(3600.0, gt=0)
    # Request chunks one job holds for groups not yet complete; older groups are dropped to stay under
    # it (they restart from chunk 0), and a frame larger than this is refused with 413.
    max_job_chunk_bytes: int = Field(1024**3, gt=0)
    export_ttl_s: float = Field(3600.0, gt=0)  # lifetime of a checkpoint download link
    max_long_poll_s: float = Field(60.0, ge=0)  # cap on ?wait= so a proxy never sees a silent socket
    # A numbered POST (Icefloe-Sequence) waits this long for a missing predecessor, then gets 409.
    sequence_gap_timeout_s: float = Field(30.0, gt=0)
    idempotency_ttl_s: float = Field(86400.0, gt=0)  # an Idempotency-Key record is replayed for this long
    # Replies above this are kept as their bare {request_id, job_id} (a ?wait= answer) or not kept at all.
    idempotency_max_response_bytes: int = Field(64 * 1024, ge=1024)
    # A job whose client renewed nothing for this long, with no request in flight, is cancelled; 0 = never.
    lease_ttl_s: float = Field(600.0, ge=0)
    # An op running longer than this fails its job and kills its engine process (per op name, else the default).
    op_deadline_s: float = Field(3600.0, gt=0)
    op_deadlines_s: dict[str, float] = Field(default_factory=dict)
    # One uvicorn line per HTTP request: off by default, since writing it stalls the event loop
    # while an engine thread holds the GIL (~0.5 ms per request on a busy CPU service).
    access_log: bool = False
    metrics_public: bool = False  # True: GET /metrics answers without the token (a scraper on a trusted network)

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens_non_empty(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        cleaned = [t.get_secret_value() if isinstance(t, SecretStr) else str(t) for t in value or ()]
        if any(not t.strip() for t in cleaned):
            raise ValueError("tokens must not contain an empty string; drop it or set a real token")
        return tuple(t.strip() for t in cleaned)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)

    def token_values(self) -> tuple[str, ...]:
        """The raw tokens, for comparison and log redaction only; never log or return them."""
        return tuple(t.get_secret_value() for t in self.tokens)

    def deadline_s(self, op: str) -> float:
        return self.op_deadlines_s.get(op, self.op_deadline_s)

    def job_dir(self, job_id: str) -> Path:
        return self.data_dir / "jobs" / job_id

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, token_file: Path | None = None, **values: Any
    ) -> ServeSettings:
        """Build settings, adding tokens from ``ICEFLOE_SERVE_TOKENS`` and ``token_file`` to any given explicitly.

        ``token_file`` holds one token per line; blank lines and lines starting with ``#`` are skipped.
        Unlike a token on the command line, neither source shows the secret in ``ps``. Raises
        :class:`ConfigError` naming every bad field.
        """
        env = os.environ if environ is None else environ
        from_env = [t for t in env.get(TOKENS_ENV_VAR, "").split(",") if t.strip()]
        explicit = list(values.pop("tokens", None) or ())
        tokens = explicit + from_env + (_read_tokens(token_file) if token_file else [])
        return validated(cls, {**values, "tokens": tokens}, "serve.")


def _read_tokens(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"serve.token_file: cannot read {str(path)!r} ({type(exc).__name__}); fix the path") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ConfigError(f"serve.token_file: {str(path)!r} holds no token; write one token per line")
    return tokens
