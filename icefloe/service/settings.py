"""Settings of one ``icefloe serve`` process.

Environment variables are read only in :meth:`ServeSettings.from_env`, so a test builds settings
explicitly and never depends on the shell it runs in.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from icefloe.config import validated
from icefloe.protocol import ConfigError
from icefloe.service.limits import SEQUENCE_WINDOW

__all__ = ["ADMIN_TENANT", "SHARED_TENANT", "TOKENS_ENV_VAR", "ServeSettings", "TenantLimits"]

TOKENS_ENV_VAR = "ICEFLOE_SERVE_TOKENS"  # comma-separated bearer tokens
SHARED_TENANT = "default"  # the tenant of every bare token (and of everyone when auth is off)
ADMIN_TENANT = "admin"  # sees and touches every tenant's work
_MAX_POST_BYTES = 62_914_560  # the training API's per-POST cap (60 MiB)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN_LINE = re.compile(r"(?:(?P<tenant>[^\s:]+):\s+)?(?P<token>\S+)(?P<limits>(?:\s+\S+)*)")


class TenantLimits(BaseModel):
    """What one tenant may hold at once (a line of the token file: ``name: token max_jobs=2 ...``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_jobs: int | None = Field(None, gt=0)  # active jobs of either API (a Tinker model or sampler is one); None = any
    max_lora_adapters: int | None = Field(None, gt=0)  # active jobs that train or sample a LoRA adapter
    max_slots: int | None = Field(None, gt=0)  # slots its active jobs hold, counted from their sub-jobs


class ServeSettings(BaseModel):
    """Where the service keeps its state, who may call it and how much compute it may hand out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path  # SQLite records, job logs, results and checkpoints live here
    host: str = "127.0.0.1"  # loopback unless told otherwise: the API runs training code for its callers
    port: int = Field(8321, ge=0, le=65535)  # 0 = any free port
    tokens: tuple[SecretStr, ...] = ()  # the shared tenant's; no token at all = no auth (a local, single-user service)
    # Named tenants (token file lines `name: token`): each sees and touches only its own work.
    tenant_tokens: dict[str, tuple[SecretStr, ...]] = Field(default_factory=dict)
    tenant_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    # The service's address as its callers reach it (a proxy in front): download links are made on it.
    # None = the address the request came in on (never the Host header a caller sends).
    public_url: str | None = None
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
    # Request chunks one tenant's jobs hold together for groups not yet complete; a job's older groups
    # are dropped to stay under it (they restart from chunk 0), else 429; a frame larger than this is 413.
    max_tenant_chunk_bytes: int = Field(1024**3, gt=0)
    export_ttl_s: float = Field(3600.0, gt=0)  # lifetime of a checkpoint download link
    max_long_poll_s: float = Field(60.0, ge=0)  # cap on ?wait= so a proxy never sees a silent socket
    # A numbered POST (Icefloe-Sequence) waits this long for a missing predecessor, then gets 409.
    sequence_gap_timeout_s: float = Field(30.0, gt=0)
    # A numbered call (Icefloe-Sequence, Tinker seq_id) more than this far past its stream's next number is
    # refused (400): what a stream holds for the numbers it waits on is bounded by it.
    sequence_window: int = Field(SEQUENCE_WINDOW, gt=0)
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
    # Values a job keeps of what its client reports (POST {job}/metrics); past it a report is 409.
    max_job_metric_values: int = Field(250_000, gt=0)
    # Tinker API bounds per request: samples (num_samples x prompts) and tokens (a forward_backward's
    # datums, or a sample's prompt plus what it may generate, times num_samples).
    max_samples_per_request: int = Field(1024, gt=0)
    max_tokens_per_request: int = Field(1_048_576, gt=0)
    # Tinker ops a tenant sent ahead of a seq_id that has not come wait parsed, holding their tensors:
    # past this many MiB of them, the next is 429 (a retry keeps its number).
    max_held_ahead_mb: int = Field(256, gt=0)
    # Generate-stream events one tenant's polls have not drained: past this many MiB of them a new
    # generate-stream is 429, and a running stream whose samples do not fit fails its remaining prompts.
    max_stream_events_mb: int = Field(256, gt=0)
    # Models the OpenAI endpoint keeps loaded (one sampling job each, over all tenants); past it the
    # least recently used idle one is unloaded.
    max_loaded_models: int = Field(16, gt=0)
    # An OpenAI endpoint model no request used for this long is unloaded (its slot freed), whatever lease_ttl_s is.
    loaded_model_idle_s: float = Field(600.0, gt=0)
    ui_session_ttl_s: float = Field(12 * 3600.0, gt=0)  # a dashboard login lasts this long
    # Failed token checks (dashboard logins, bearer tokens, Tinker API keys) one client address may
    # make per minute; past it, that address is answered 429 before its token is looked at.
    max_failed_logins_per_minute: int = Field(10, gt=0)
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (addresses or networks, "*" = any).
    # Empty: none, so a client's address (for the failure limit) is its connection's peer.
    forwarded_allow_ips: tuple[str, ...] = ()
    # A connection's request headers must arrive within this long; a body within body_timeout_s
    # plus one second per 8 KiB it delivers. Slower connections get 408 and are closed.
    header_timeout_s: float = Field(20.0, gt=0)
    body_timeout_s: float = Field(20.0, gt=0)

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens_non_empty(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        cleaned = [t.get_secret_value() if isinstance(t, SecretStr) else str(t) for t in value or ()]
        if any(not t.strip() for t in cleaned):
            raise ValueError("tokens must not contain an empty string; drop it or set a real token")
        return tuple(t.strip() for t in cleaned)

    @field_validator("tenant_tokens")
    @classmethod
    def _tenants_named_once(cls, value: dict[str, tuple[SecretStr, ...]]) -> dict[str, tuple[SecretStr, ...]]:
        bad = sorted(name for name in value if not _TENANT_NAME.fullmatch(name))
        if bad:
            raise ValueError(f"tenant names must be 1-64 of A-Z a-z 0-9 _ . -; got {bad}")
        return value

    @field_validator("forwarded_allow_ips", mode="before")
    @classmethod
    def _proxies(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        cleaned = tuple(str(part).strip() for part in value or ())
        for part in cleaned:
            if part != "*":
                try:
                    ipaddress.ip_network(part, strict=False)
                except ValueError:
                    raise ValueError(f"forwarded_allow_ips takes addresses, networks or '*'; got {part!r}") from None
        return cleaned

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", value):
            raise ValueError(f"public_url must be http(s)://host[:port][/path]; got {value!r}")
        return value.rstrip("/") if value else value

    @model_validator(mode="after")
    def _data_dir_apart_from_model_root(self) -> ServeSettings:
        """Any folder under the model root loads as a model: a data dir there would let a tenant load
        another's checkpoint (``model_name: jobs/<job>/checkpoints/global_step1``)."""
        if self.model_root is not None:
            data, root = self.data_dir.resolve(), self.model_root.resolve()
            if data.is_relative_to(root) or root.is_relative_to(data):
                raise ValueError(
                    f"data_dir {str(data)!r} and model_root {str(root)!r} overlap, so every tenant could load the "
                    "service's checkpoints as a model; keep them apart (icefloe serve --data-dir outside --model-root)"
                )
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens) or any(self.tenant_tokens.values())

    def token_values(self) -> tuple[str, ...]:
        """The raw tokens, for comparison and log redaction only; never log or return them."""
        return tuple(token for token, _ in self.token_tenants())

    def token_tenants(self) -> list[tuple[str, str]]:
        """(raw token, its tenant) for every token; a token given for two tenants raises ConfigError."""
        pairs = [(t.get_secret_value(), SHARED_TENANT) for t in self.tokens]
        pairs += [(t.get_secret_value(), name) for name, tokens in self.tenant_tokens.items() for t in tokens]
        owners: dict[str, str] = {}
        for token, tenant in pairs:
            if owners.setdefault(token, tenant) != tenant:
                raise ConfigError(
                    f"serve.tenant_tokens: one token is given to tenants {owners[token]!r} and {tenant!r}"
                )
        return pairs

    def deadline_s(self, op: str) -> float:
        return self.op_deadlines_s.get(op, self.op_deadline_s)

    def job_dir(self, job_id: str) -> Path:
        return self.data_dir / "jobs" / job_id

    def public_path(self, path: str | Path) -> str:
        """A folder of the data dir as a caller may read it: relative to the data dir, so no answer
        names where the service keeps its files."""
        folder = Path(path)
        if folder.is_relative_to(self.data_dir):
            return str(folder.relative_to(self.data_dir))
        return self.public_text(str(path))

    def public_text(self, text: str) -> str:
        """``text`` (an engine's error, a log line, a failure reason) as a caller may read it: the
        service's own folders named (``<data dir>``, ``<model root>``, ``<model cache>``), not spelled out."""
        pattern, names = self.own_folders
        return pattern.sub(lambda found: names[found.group(0)], text)

    @functools.cached_property
    def own_folders(self) -> tuple[re.Pattern[str], dict[str, str]]:
        """A pattern matching the service's folders as whole path parts, and the name each is shown by."""
        names = {str(self.data_dir): "<data dir>", str(self.data_dir.resolve()): "<data dir>"}
        if self.model_root is not None:
            names |= {str(self.model_root): "<model root>", str(self.model_root.resolve()): "<model root>"}
        names |= dict.fromkeys(_model_caches(), "<model cache>")
        names.pop("/", None)  # a root folder would rename every slash
        longest_first = sorted(names, key=len, reverse=True)  # a cache may lie inside another folder
        return re.compile("|".join(map(re.escape, longest_first)) + r"(?![\w.-])"), names

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, token_file: Path | None = None, **values: Any
    ) -> ServeSettings:
        """Build settings, adding tokens from ``ICEFLOE_SERVE_TOKENS`` and ``token_file`` to any given explicitly.

        ``token_file`` holds one token per line, ``name: token`` for a named tenant, optionally followed
        by that tenant's limits (``max_jobs=2 max_lora_adapters=4 max_slots=2``); blank lines and lines
        starting with ``#`` are skipped. Unlike a token on the command line, neither source shows the
        secret in ``ps``. Raises :class:`ConfigError` naming every bad field.
        """
        env = os.environ if environ is None else environ
        from_env = [t for t in env.get(TOKENS_ENV_VAR, "").split(",") if t.strip()]
        explicit = list(values.pop("tokens", None) or ())
        named: dict[str, list[str]] = {}
        limits: dict[str, dict[str, str]] = {}
        if token_file is not None:
            for tenant, token, tenant_limits in _read_token_file(token_file):
                if tenant is None:
                    explicit.append(token)
                else:
                    named.setdefault(tenant, []).append(token)
                if tenant_limits:
                    limits.setdefault(tenant or SHARED_TENANT, {}).update(tenant_limits)
        fields = {**values, "tokens": explicit + from_env, "tenant_tokens": named, "tenant_limits": limits}
        return validated(cls, fields, "serve.")


@functools.cache
def _model_caches() -> tuple[str, ...]:
    """Where models the service loads on a caller's behalf may live besides the model root: icefloe's own
    cache and the Hugging Face hub cache (a hub id's snapshot)."""
    caches = [str(Path.home() / ".cache" / "icefloe")]
    try:
        from huggingface_hub import constants
    except ImportError:  # no hub: no hub cache to name
        return tuple(caches)
    return (*caches, str(Path(constants.HF_HUB_CACHE)), str(Path(constants.HF_HUB_CACHE).resolve()))


def _read_token_file(path: Path) -> list[tuple[str | None, str, dict[str, str]]]:
    """(tenant or None for a bare token, token, limits) per line of a token file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"serve.token_file: cannot read {str(path)!r} ({type(exc).__name__}); fix the path") from None
    entries = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        match = _TOKEN_LINE.fullmatch(text)
        assert match is not None  # any non-blank line matches: a token is any word
        pairs = [word.partition("=") for word in match["limits"].split()]
        if any(not eq or key not in TenantLimits.model_fields or not value for key, eq, value in pairs):
            raise ConfigError(  # the words are not echoed: one may be a second token
                f"serve.token_file line {number}: a line holds one token ('name: token' or 'token'), then limits "
                f"as key=value with key one of {sorted(TenantLimits.model_fields)}"
            )
        entries.append((match["tenant"], match["token"], {word: value for word, _, value in pairs}))
    if not entries:
        raise ConfigError(f"serve.token_file: {str(path)!r} holds no token; write one token per line")
    return entries
