"""Op names, request envelopes, job/request states and the one error hierarchy.

Every layer speaks this vocabulary: the client builds ``Request(op, target, body)``, a transport
delivers it, the service executes it. Errors are rooted at :class:`IcefloeError`; each class also
inherits the stdlib base it stands for, and all stay picklable because Ray carries them across
processes::

    IcefloeError
    ├── ConfigError (ValueError)                  bad configuration; fatal, fix the config
    ├── InvalidRequestError (ValueError)          bad batch / arguments; fatal, fix the call
    ├── WireError (ValueError)                    a DSSST1 frame or chunk failed validation
    │   ├── LegacyPickleError                     pickle / torch.save bytes were offered
    │   ├── FrameFormatError                      header, offsets, sizes, names or tree invalid
    │   └── ChunkError                            a chunk set does not reassemble
    │       ├── ChunkMismatchError                descriptors disagree (group, hash, size, total)
    │       ├── ChunkIndexError                   duplicate, missing or out-of-range chunk index
    │       └── ChunkDigestError                  size or SHA-256 of the joined frame is wrong
    ├── ClientClosedError (RuntimeError)          an op was called after shutdown()
    ├── NotFoundError (LookupError)               a job, request, checkpoint or link does not exist
    │   └── ExpiredError                          a download link outlived its lifetime
    ├── ConflictError (RuntimeError)              the call does not fit the job's state or an earlier call
    │   └── SequenceGapError                      a numbered POST waited too long for the one before it
    ├── UnauthenticatedError (PermissionError)    no valid bearer token
    ├── ForbiddenError (PermissionError)          a change a browser sent from another site (cookie or no auth)
    │   └── MisdirectedRequestError               a Host header naming no address of the service (no auth)
    ├── TooManyRequestsError (RuntimeError)       failed token checks, or a tenant's held bytes, past a cap; wait, retry
    ├── PayloadTooLargeError (ValueError)         a POST body over the service's cap
    ├── UnsupportedOpError (NotImplementedError)  the backend has no such op
    ├── RequestFailedError (RuntimeError)         an op failed; ``reason`` + ``category`` user|server
    │   └── ChunkGroupError                       the service refused a chunk group
    │       ├── ChunkGroupRestartError            unknown group got a non-zero first chunk
    │       ├── ChunkGroupConflictError           group id reused with a different frame
    │       └── ChunkGroupMissingChunksError      the final chunk came before the others
    ├── JobFailedError (RuntimeError)             the job reached a terminal state; ``reason`` + sub-jobs
    └── IcefloeTimeoutError (TimeoutError)        a deadline passed

To add an error: subclass the closest node, keep ``__init__`` arguments stored on ``self.args`` (so
pickling round-trips), say in the docstring when it is raised, and add it to the tree above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CHUNK_GROUP_CODES",
    "CODE_CHUNK_GROUP_CONFLICT",
    "CODE_CHUNK_GROUP_MISSING_CHUNKS",
    "CODE_CHUNK_GROUP_RESTART_REQUIRED",
    "CODE_CONFLICT",
    "CODE_FORBIDDEN",
    "CODE_INTERNAL",
    "CODE_INVALID_ARGUMENT",
    "CODE_MISDIRECTED_REQUEST",
    "CODE_NOT_FOUND",
    "CODE_NOT_IMPLEMENTED",
    "CODE_PAYLOAD_TOO_LARGE",
    "CODE_REQUEST_TIMEOUT",
    "CODE_SEQUENCE_GAP",
    "CODE_TOO_MANY_REQUESTS",
    "CODE_UNAUTHENTICATED",
    "CODE_UNAVAILABLE",
    "ENGINE_CALLS",
    "ENGINE_OPERATIONS",
    "INLINE_OPERATIONS",
    "JOB_ACTIVE_STATES",
    "JOB_STATES",
    "JOB_TERMINAL_STATES",
    "MEMORY_OPS",
    "OPS",
    "OP_CANCEL",
    "OP_DELETE_CHECKPOINT",
    "OP_FORWARD",
    "OP_FWD_BWD",
    "OP_GENERATE",
    "OP_GET_CHECKPOINT",
    "OP_LIST_CHECKPOINTS",
    "OP_LOAD",
    "OP_RESET_PREFIX_CACHE",
    "OP_SAVE",
    "OP_SLEEP_INFERENCE",
    "OP_SLEEP_TRAINING",
    "OP_STEP",
    "OP_WAKE_INFERENCE",
    "OP_WAKE_TRAINING",
    "OP_WEIGHT_SYNC",
    "REQUEST_FAILURE_STATES",
    "REQUEST_SUCCESS_STATES",
    "SEGMENT_BY_JOB_TYPE",
    "SEQUENCE_HEADER",
    "TARGETS",
    "TARGET_JOB",
    "TARGET_REFERENCE",
    "TARGET_SAMPLING",
    "TARGET_TRAINING",
    "ChunkDigestError",
    "ChunkError",
    "ChunkGroupConflictError",
    "ChunkGroupError",
    "ChunkGroupMissingChunksError",
    "ChunkGroupRestartError",
    "ChunkIndexError",
    "ChunkMismatchError",
    "ClientClosedError",
    "ConfigError",
    "ConflictError",
    "EngineCall",
    "ExpiredError",
    "ForbiddenError",
    "FrameFormatError",
    "IcefloeError",
    "IcefloeTimeoutError",
    "InvalidRequestError",
    "JobFailedError",
    "LegacyPickleError",
    "MisdirectedRequestError",
    "NotFoundError",
    "PayloadTooLargeError",
    "Request",
    "RequestFailedError",
    "SamplingParams",
    "SequenceGapError",
    "TooManyRequestsError",
    "UnauthenticatedError",
    "UnsupportedOpError",
    "WireError",
    "checked_metrics",
    "normalize_job_state",
    "normalize_job_type",
    "normalize_request_state",
]

# --- ops ---------------------------------------------------------------------------------------
# Names match the training API's endpoint / operation_type spelling where one exists.
OP_FWD_BWD: Final = "forward-backward"
OP_FORWARD: Final = "forward"
OP_STEP: Final = "step"
OP_GENERATE: Final = "generate"
OP_WEIGHT_SYNC: Final = "weight-sync"
OP_SAVE: Final = "save"
OP_LOAD: Final = "load"
OP_LIST_CHECKPOINTS: Final = "list-checkpoints"
OP_GET_CHECKPOINT: Final = "get-checkpoint"
OP_DELETE_CHECKPOINT: Final = "delete-checkpoint"
OP_SLEEP_TRAINING: Final = "sleep-training"
OP_WAKE_TRAINING: Final = "wake-training"
OP_SLEEP_INFERENCE: Final = "sleep-inference"
OP_WAKE_INFERENCE: Final = "wake-inference"
OP_RESET_PREFIX_CACHE: Final = "reset-prefix-cache"
OP_CANCEL: Final = "cancel"

OPS: Final = frozenset(
    {
        OP_FWD_BWD, OP_FORWARD, OP_STEP, OP_GENERATE, OP_WEIGHT_SYNC, OP_SAVE, OP_LOAD,
        OP_LIST_CHECKPOINTS, OP_GET_CHECKPOINT, OP_DELETE_CHECKPOINT, OP_SLEEP_TRAINING,
        OP_WAKE_TRAINING, OP_SLEEP_INFERENCE, OP_WAKE_INFERENCE, OP_RESET_PREFIX_CACHE, OP_CANCEL,
    }
)  # fmt: skip


@dataclass(frozen=True)
class EngineCall:
    """How an op reaches an engine, on every backend: the role whose engine runs it, the engine
    method, and that method's arguments from the op's body."""

    role: str
    method: str
    args: Callable[[dict[str, Any]], tuple[Any, ...]] = lambda body: ()
    optional: bool = False  # the role may be absent: the op then answers {}
    kwargs: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: {}


#: The op table: every op that is one call of an engine method (engines, Ray actor groups and the
#: service's model hosts share the method names), read by the client's engine host and by the
#: service's work items alike. The ops not here are more than one call (generates batch, a weight
#: sync crosses roles, listing checkpoints reads folders, cancel ends a job). A save or load body
#: names its checkpoint ``folder``: the caller finds it (the client's checkpoint root; a service's
#: checkpoint record, which its tenant may see).
ENGINE_CALLS: Final[dict[str, EngineCall]] = {
    OP_FWD_BWD: EngineCall("training", "fwd_bwd", lambda body: (body["batch"],)),
    OP_FORWARD: EngineCall(
        "training",
        "forward",
        lambda body: (body["batch"],),
        kwargs=lambda body: {"reference": bool(body.get("reference"))},
    ),
    OP_STEP: EngineCall("training", "step", lambda body: (body.get("learning_rate"), body.get("adam"))),
    OP_SAVE: EngineCall(
        "training", "save_checkpoint", lambda body: (body["folder"], body.get("checkpoint_type", "resumable"))
    ),
    OP_LOAD: EngineCall(
        "training", "load_checkpoint", lambda body: (body["folder"], body.get("load_optimizer_states", True))
    ),
    OP_SLEEP_TRAINING: EngineCall("training", "sleep"),
    OP_WAKE_TRAINING: EngineCall("training", "wake"),
    OP_SLEEP_INFERENCE: EngineCall("sampling", "sleep", lambda body: (body.get("level", 1),), True),
    OP_WAKE_INFERENCE: EngineCall("sampling", "wake", optional=True),
    OP_RESET_PREFIX_CACHE: EngineCall("sampling", "reset_prefix_cache", optional=True),
}

# Sleep and wake: a service's sub-jobs are always resident (a shared base serves other jobs), so a
# remote client answers these itself.
MEMORY_OPS: Final = frozenset({OP_SLEEP_TRAINING, OP_WAKE_TRAINING, OP_SLEEP_INFERENCE, OP_WAKE_INFERENCE})

#: Engine ops a service runs through its ``{job}/operation`` route, answered inline: those with
#: no route of their own. An op that is one engine call lands here and needs no transport or
#: service code of its own.
ENGINE_OPERATIONS: Final = frozenset(ENGINE_CALLS) - {OP_FWD_BWD, OP_FORWARD, OP_STEP, OP_SAVE, OP_LOAD} - MEMORY_OPS

# Operation types the training API answers inline (no request_id to poll).
INLINE_OPERATIONS: Final = frozenset(
    {"bootstrap-router-replay", "cancel-request", "router-replay-discard", "tail-logs", *ENGINE_OPERATIONS}
)

# The header of the ``sequenced_submit`` extension: ``<session>:<n>`` fixes a POST's place in line.
SEQUENCE_HEADER: Final = "Icefloe-Sequence"

# --- targets -----------------------------------------------------------------------------------
TARGET_TRAINING: Final = "training"
TARGET_SAMPLING: Final = "sampling"
TARGET_REFERENCE: Final = "log_probability"
TARGET_JOB: Final = "job"
TARGETS: Final = frozenset({TARGET_TRAINING, TARGET_SAMPLING, TARGET_REFERENCE, TARGET_JOB})

Target = Literal["training", "sampling", "log_probability", "job"]


@dataclass(frozen=True, slots=True)
class Request:
    """One op addressed to one role; what every transport delivers.

    ``body`` holds plain Python values and tensors; a transport decides how they travel.
    ``idempotency_key`` lets a remote transport retry without executing twice.
    """

    op: str
    target: Target
    body: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise InvalidRequestError(f"Request.op must be one of {sorted(OPS)}; got {self.op!r}")
        if self.target not in TARGETS:
            raise InvalidRequestError(f"Request.target must be one of {sorted(TARGETS)}; got {self.target!r}")


class SamplingParams(BaseModel):
    """vLLM-style sampling parameters, validated once on the client side.

    ``logprobs`` asks for the log-probability of each sampled token under the model's raw
    distribution (temperature 1, no top-p/top-k), the quantity the trainer's ``forward`` returns.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = Field(1, gt=0)  # samples per prompt; results are prompt-major
    seed: int | None = None  # None = the engine's running generator
    logprobs: bool = False
    ignore_eos: bool = False  # True: only stop / stop_token_ids / max_tokens end a sample
    prompt_logprobs: bool = False  # each result also carries the prompt's log-probs (None at position 0)
    topk_prompt_logprobs: int = Field(0, ge=0)  # k > 0: and the k likeliest tokens at each prompt position
    topk_logprobs: int = Field(0, ge=0)  # k > 0: each sampled token's k likeliest alternatives, [token, logprob]
    # [len(prompt) - 1, K] token ids whose log-probs each result carries, row i scored at prompt position
    # i + 1; -1 asks for nothing (0.0 comes back there). The torch sampler serves it.
    target_prompt_logprobs: tuple[tuple[int, ...], ...] | None = None
    tag: str | None = None  # names the call for the sampling engine's cancel() (the service sets it)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, value: object) -> bool:
        # vLLM passes an int (number of top alternatives); any non-negative int asks for sampled-token logprobs.
        if value is None:
            return False
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return value >= 0
        raise ValueError(f"logprobs must be a bool or an int; got {value!r}")


# --- job and request states --------------------------------------------------------------------
JOB_ACTIVE_STATES: Final = frozenset({"pending", "placing", "initializing", "running", "cancelling"})
JOB_TERMINAL_STATES: Final = frozenset({"cancelled", "canceled", "terminated", "failed", "done"})
JOB_STATES: Final = JOB_ACTIVE_STATES | JOB_TERMINAL_STATES
REQUEST_SUCCESS_STATES: Final = frozenset({"done", "completed", "succeeded"})
REQUEST_FAILURE_STATES: Final = frozenset({"failed", "cancelled", "canceled"})


#: A sub-job id is ``{job_id}:{segment}:{index}``; the segment names its job type too.
SEGMENT_BY_JOB_TYPE: Final = {"training": "training", "sampling": "sampling", "log_probability": "log_prob"}
_JOB_TYPE_ALIASES: Final = {"log_prob": "log_probability", "logprob": "log_probability", "log_probs": "log_probability"}


def normalize_job_type(value: object) -> str:
    """A job type as the API may spell it (``JOB_TYPE_LOG_PROB``, ``log_prob``, `` Training``) in its plain
    form; unknown stays as-is."""
    text = str(value or "").strip().lower().removeprefix("job_type_")
    return _JOB_TYPE_ALIASES.get(text, text)


def normalize_job_state(value: object) -> str:
    """Lower-case a job state and strip the ``job_state_`` enum prefix; unknown stays as-is."""
    text = str(value).strip().lower()
    return text.removeprefix("job_state_")


def normalize_request_state(value: object) -> str:
    """Lower-case a request state and strip the ``request_state_`` enum prefix."""
    text = str(value).strip().lower()
    return text.removeprefix("request_state_")


# --- error codes on the wire (`{code, message}` bodies) ----------------------------------------
CODE_INVALID_ARGUMENT: Final = "invalid_argument"
CODE_NOT_FOUND: Final = "not_found"
CODE_CONFLICT: Final = "conflict"
CODE_UNAUTHENTICATED: Final = "unauthenticated"
CODE_FORBIDDEN: Final = "forbidden"
CODE_MISDIRECTED_REQUEST: Final = "misdirected_request"
CODE_REQUEST_TIMEOUT: Final = "request_timeout"
CODE_PAYLOAD_TOO_LARGE: Final = "payload_too_large"
CODE_NOT_IMPLEMENTED: Final = "not_implemented"
CODE_UNAVAILABLE: Final = "unavailable"
CODE_TOO_MANY_REQUESTS: Final = "too_many_requests"
CODE_INTERNAL: Final = "internal"
CODE_SEQUENCE_GAP: Final = "sequence_gap"
CODE_CHUNK_GROUP_RESTART_REQUIRED: Final = "chunk_group_restart_required"
CODE_CHUNK_GROUP_CONFLICT: Final = "chunk_group_conflict"
CODE_CHUNK_GROUP_MISSING_CHUNKS: Final = "chunk_group_missing_chunks"
CHUNK_GROUP_CODES: Final = frozenset(
    {CODE_CHUNK_GROUP_RESTART_REQUIRED, CODE_CHUNK_GROUP_CONFLICT, CODE_CHUNK_GROUP_MISSING_CHUNKS}
)


# --- errors ------------------------------------------------------------------------------------
class IcefloeError(Exception):
    """Root of every error icefloe raises on purpose.

    The remote transport raises the class the service's wire ``code`` names, so a caller catches
    the same class on every backend; such an error also carries the answer's ``status_code`` and
    ``code`` (both None for an error raised in this process).
    """

    status_code: int | None = None
    code: str | None = None


class ConfigError(IcefloeError, ValueError):
    """A configuration value is invalid or missing. Fatal: the message names the field and the fix."""


class InvalidRequestError(IcefloeError, ValueError):
    """An op was called with a bad argument or batch. Fatal: the message names the field and the fix."""


class WireError(IcefloeError, ValueError):
    """A DSSST1 frame or chunk set failed validation. Nothing was reconstructed from it."""


class LegacyPickleError(WireError):
    """The bytes are pickle or a torch.save zip, which the wire never loads."""


class FrameFormatError(WireError):
    """The frame is not valid DSSST1: header, offsets, sizes, names, dtypes or tree."""


class ChunkError(WireError):
    """A set of chunk frames does not reassemble into one frame."""


class ChunkMismatchError(ChunkError):
    """Chunk descriptors disagree on kind, group, hash, size, total or operation."""


class ChunkIndexError(ChunkError):
    """A chunk index is duplicated, missing or out of range."""


class ChunkDigestError(ChunkError):
    """The joined bytes do not match the announced size or SHA-256."""


class ClientClosedError(IcefloeError, RuntimeError):
    """An op was called on a client after ``shutdown()``; build a new client."""


class NotFoundError(IcefloeError, LookupError):
    """A job, request, checkpoint or download link the call names does not exist."""


class ExpiredError(NotFoundError):
    """A download link or a stored result outlived its lifetime; export the checkpoint or run the request again."""


class ConflictError(IcefloeError, RuntimeError):
    """The call does not fit the current state: a job that is not running, an id or key already used."""


class SequenceGapError(ConflictError):
    """A numbered POST (``Icefloe-Sequence``) waited too long for the POST numbered before it."""


class UnauthenticatedError(IcefloeError, PermissionError):
    """The call carries no bearer token the service accepts."""


class ForbiddenError(IcefloeError, PermissionError):
    """The call may not be made: a change a browser sent from another origin (through the login cookie,
    to the login form, or to a service without tokens)."""


class MisdirectedRequestError(ForbiddenError):
    """With auth off, a ``Host`` header that names no address of the service: a page whose name was
    re-pointed at it (DNS rebinding). Reach the service by its address, or set ``--public-url``."""


class TooManyRequestsError(IcefloeError, RuntimeError):
    """Too many failed token checks (logins, bearer tokens) from one address, or a tenant holding its cap of
    bytes the service keeps for it (undrained stream events, ops held ahead); the message says what to do."""


class PayloadTooLargeError(IcefloeError, ValueError):
    """A POST body is larger than the service takes; split the frame into request chunks."""


class UnsupportedOpError(IcefloeError, NotImplementedError):
    """The selected backend does not provide this op; the message names the op and the alternative."""


class RequestFailedError(IcefloeError, RuntimeError):
    """An op reached the backend and failed.

    ``category`` is ``"user"`` when the caller must change the request (a 4xx), ``"server"`` when
    the backend failed (a 5xx or an engine error). ``status_code`` and ``code`` carry the HTTP
    status and wire code when the failure came over HTTP.
    """

    def __init__(
        self,
        reason: str,
        *,
        category: Literal["user", "server"] = "server",
        status_code: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(reason, category, status_code, code, request_id)
        self.reason = reason
        self.category = category
        self.status_code = status_code
        self.code = code
        self.request_id = request_id

    def __reduce__(self):  # keyword-only arguments need an explicit recipe to pickle
        return (
            _rebuild_request_failed,
            (type(self), self.reason, self.category, self.status_code, self.code, self.request_id),
        )

    def __str__(self) -> str:
        parts = [self.reason]
        if self.status_code is not None:
            parts.append(f"(HTTP {self.status_code}{', ' + self.code if self.code else ''})")
        if self.request_id:
            parts.append(f"[request {self.request_id}]")
        return " ".join(parts)


def _rebuild_request_failed(cls, reason, category, status_code, code, request_id):
    return cls(reason, category=category, status_code=status_code, code=code, request_id=request_id)


class ChunkGroupError(RequestFailedError):
    """The service refused a chunk group; never retried chunk by chunk."""


class ChunkGroupRestartError(ChunkGroupError):
    """The service does not know the group and wants it resent from chunk 0."""


class ChunkGroupConflictError(ChunkGroupError):
    """The group id was reused with a different frame hash, chunk count or payload."""


class ChunkGroupMissingChunksError(ChunkGroupError):
    """The final chunk arrived while earlier chunks of the group were missing."""


class JobFailedError(IcefloeError, RuntimeError):
    """A job reached a terminal state (failed, cancelled, terminated) while it was needed.

    ``sub_jobs`` maps each sub-job id to its status so the message shows which part broke.
    """

    def __init__(self, job_id: str, status: str, reason: str = "", sub_jobs: dict[str, str] | None = None):
        super().__init__(job_id, status, reason, sub_jobs)
        self.job_id = job_id
        self.status = status
        self.reason = reason
        self.sub_jobs = dict(sub_jobs or {})

    def __str__(self) -> str:
        text = f"job {self.job_id} is {self.status}"
        if self.reason:
            text += f": {self.reason}"
        if self.sub_jobs:
            text += " (sub-jobs: " + ", ".join(f"{k}={v}" for k, v in sorted(self.sub_jobs.items())) + ")"
        return text


class IcefloeTimeoutError(IcefloeError, TimeoutError):
    """A deadline passed while waiting for a job or request; the work may still be running."""


MAX_REPORTED_METRICS: Final = 256  # metric names in one report
MAX_METRIC_STEP: Final = 2**63 - 1  # a step is a 64-bit integer where it is kept (SQLite)
MAX_METRIC_NAME_CHARS: Final = 256  # a name is stored with every value of it, so its length bounds what a job keeps


def checked_metrics(step: object, metrics: object) -> dict[str, float]:
    """A client's metric report as ``{name: float}``, or :class:`InvalidRequestError` naming the bad field.

    The client checks before sending and the service again on arrival, with the same words.
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_METRIC_STEP:
        raise InvalidRequestError(f"step must be an integer >= 0; got {step!r:.40} (at most 2**63 - 1)")
    if not isinstance(metrics, Mapping) or not metrics:
        raise InvalidRequestError(f"metrics must be a non-empty object of name -> number; got {metrics!r:.100}")
    if len(metrics) > MAX_REPORTED_METRICS:
        raise InvalidRequestError(f"metrics holds {len(metrics)} names; send at most {MAX_REPORTED_METRICS} per report")
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name.strip() or name in ("step", "time"):
            raise InvalidRequestError(f"metrics: name {name!r} must be a non-empty string other than 'step' or 'time'")
        if len(name) > MAX_METRIC_NAME_CHARS:
            raise InvalidRequestError(
                f"metrics: name {name:.40}... has {len(name)} characters; at most {MAX_METRIC_NAME_CHARS}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidRequestError(f"metrics.{name} must be a finite number; got {value!r:.100}")
        values[name] = float(value)
    return values
