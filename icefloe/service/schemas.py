"""Request and response bodies of the training API, named exactly as the reference spells them.

Families per resource: ``*Create`` / ``*Body`` arrive, ``*Public`` leave. Configs sent by clients
of the managed endpoint carry many passthrough keys (DeepSpeed, PrimeRL, vLLM knobs); those models
allow extra keys, and ``service/specs.py`` honours, refuses or reports each one; typed keys are checked here.
:func:`parse_json_body` bounds every JSON body before a model sees it. In a large body an array of numbers
arrives as an ``array.array`` (:mod:`icefloe.wire.dense_json`): a typed list field reads it as a list,
and a generate's token prompts are kept as they are.
"""

from __future__ import annotations

import array
import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from icefloe.protocol import InvalidRequestError, PayloadTooLargeError, normalize_job_type
from icefloe.service.limits import MAX_JSON_DEPTH, MAX_LISTED_ERRORS, MAX_PROMPTS, MAX_SUB_JOBS, check_counts
from icefloe.wire import dense_json

_CHECKED_TYPES = frozenset({dict, list, tuple, float, array.array})


def parse_json_body(raw: bytes | str, what: str = "body") -> Any:
    """Parse a JSON request body and :func:`check_body` it; :class:`InvalidRequestError` if either fails,
    :class:`~icefloe.protocol.PayloadTooLargeError` before parsing one that would build too many containers
    or strings."""
    check_counts(raw.encode() if isinstance(raw, str) else raw, what)
    try:
        value = dense_json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels; flatten it") from None
    except dense_json.TooManyValues as exc:
        raise PayloadTooLargeError(f"{what} {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequestError(f"{what} is not valid JSON ({exc}); send a JSON object") from None
    check_body(value, what)
    return value


def check_body(value: Any, what: str = "body") -> None:
    """Refuse what no model can: nesting deeper than :data:`MAX_JSON_DEPTH`, and non-finite numbers.

    ``NaN``, ``Infinity`` and ``1e400`` (read as infinity) are refused wherever they sit, passthrough
    keys included: one reaching an optimizer or a loss turns the weights into NaN. The error names
    the first offending fields. Tensors of a decoded DSSST1 frame are leaves and are not looked into.
    """
    non_finite: list[str] = []
    more = 0
    pending = [(value, ())] if type(value) in _CHECKED_TYPES else []
    while pending:
        node, path = pending.pop()
        if type(node) is float:
            if not math.isfinite(node):
                non_finite.append(f"{_dotted(path) or what}={node}")
            continue
        if type(node) is array.array:
            bad = np.flatnonzero(~np.isfinite(node)) if node.typecode in "fd" else ()
            non_finite += [f"{_dotted((*path, int(i)))}={node[i]}" for i in bad[:MAX_LISTED_ERRORS]]
            more += max(0, len(bad) - MAX_LISTED_ERRORS)
            continue
        if len(path) >= MAX_JSON_DEPTH:
            raise InvalidRequestError(
                f"{what} nests deeper than {MAX_JSON_DEPTH} levels (at {_dotted(path[:8])}...); flatten it"
            )
        if type(node) is not dict and _CHECKED_TYPES.isdisjoint(map(type, node)):
            continue  # a list of ints or strings (token ids, prompts): nothing below to check
        for key, child in node.items() if type(node) is dict else enumerate(node):
            if type(child) is float:  # checked here: a path for each number of a long list would cost more
                if not math.isfinite(child):
                    non_finite.append(f"{_dotted((*path, key))}={child}")
            elif type(child) in _CHECKED_TYPES:
                pending.append((child, (*path, key)))
    if non_finite:
        listed = ", ".join(sorted(non_finite)[:MAX_LISTED_ERRORS])
        more += max(0, len(non_finite) - MAX_LISTED_ERRORS)
        raise InvalidRequestError(
            f"{what} holds non-finite numbers: {listed}{f' and {more} more' if more else ''}; send finite values "
            "(JSON has no NaN or Infinity, and a literal beyond ±1.8e308 such as 1e400 overflows to infinity)"
        )


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


JobType = Literal["training", "sampling", "log_probability"]


# Enum-like strings arrive in any case, the managed API's job types with their JOB_TYPE_ prefix.
_EnumText = BeforeValidator(lambda v: normalize_job_type(v) if isinstance(v, str) else v)


class _Open(BaseModel):
    """Typed keys are validated; unknown keys are kept (passthrough of the managed API). A typed number is
    finite whatever the route or media type (``1e400`` parses as infinity)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)


# --- create job --------------------------------------------------------------------------------
class OptimizerSpec(_Open):
    name: str = "AdamW"
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)

    @field_validator("name")
    @classmethod
    def _adamw_only(cls, name: str) -> str:
        if name.lower().replace("_", "") != "adamw":
            raise ValueError(f"only AdamW is available; got {name!r}")
        return name


class TrainingConfigSpec(_Open):
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    max_seq_len: int = Field(512, gt=0)
    train_batch_size: int | None = Field(None, gt=0)
    n_gpus: int = Field(1, gt=0)
    gradient_clipping: float | None = Field(None, ge=0)
    multiplex_job_id: str | None = None
    load_optimizer_states: bool | None = None  # None = the default (true)
    step_peak_memory_log: bool = False  # step results carry peak_memory {gpu_peak, cpu_peak}


class InferenceConfig(_Open):
    max_seq_len: int = Field(512, gt=0)
    n_gpus: int = Field(1, ge=0)  # 0: on the device of the job's training sub-job, taking no slot of its own
    multiplex_job_id: str | None = None


class SourceCheckpointInfo(_Open):
    checkpoint_id: str = Field(min_length=1)
    source_job_id: str | None = None


class SubJobConfig(_Open):
    job_type: Annotated[JobType, _EnumText]
    model_name: str = Field(min_length=1)
    training_config: TrainingConfigSpec | None = None
    inference_config: InferenceConfig | None = None
    global_batch_size: int | None = Field(None, gt=0)
    dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] | None = None
    seed: int | None = None
    # "model_post_init" would shadow pydantic's hook of that name, so the field is renamed and aliased
    post_init_hooks: list[str] | None = Field(None, alias="model_post_init")
    source_checkpoint_info: SourceCheckpointInfo | None = None

    @property
    def section(self) -> TrainingConfigSpec | InferenceConfig | None:
        return self.training_config if self.job_type == "training" else self.inference_config

    @property
    def section_name(self) -> str:
        return "training_config" if self.job_type == "training" else "inference_config"

    @model_validator(mode="after")
    def _config_matches_type(self) -> SubJobConfig:
        if self.job_type == "training" and self.inference_config is not None:
            raise ValueError("a training sub-job takes training_config, not inference_config")
        if self.job_type != "training" and self.training_config is not None:
            raise ValueError(f"a {self.job_type} sub-job takes inference_config, not training_config")
        if not self.model_name.strip():
            raise ValueError("model_name must name a model; got only whitespace")
        return self


class JobCreate(_Open):
    sub_job_configs: list[SubJobConfig] = Field(min_length=1, max_length=MAX_SUB_JOBS)
    job_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    experiment_name: str | None = None
    debug: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _as_sent(cls, value: Any) -> Any:
        """A create-job body is stored, and its passthrough keys reach the engines, as sent: a large body's
        number arrays are lists again here."""
        return dense_json.as_lists(value)


class JobCreated(BaseModel):
    job_id: str
    warnings: list[str] | None = None  # create-body keys accepted but not used, with why (omitted when none)


# --- jobs --------------------------------------------------------------------------------------
class SubJobPublic(_Open):
    sub_job_id: str
    job_type: JobType
    status: str
    model_name: str


class HostPublic(BaseModel):
    """A model host as a job record shows it: shared by LoRA jobs of one base, or one job's own."""

    host_id: str
    shared: bool
    base_model: str | None
    num_jobs: int
    max_jobs: int
    slots: list[int]


class JobPublic(BaseModel):
    job_id: str
    status: str
    reason: str
    created_at: str
    updated_at: str
    image_tag: str
    experiment_name: str
    sub_jobs: list[SubJobPublic]
    warnings: list[str] = Field(default_factory=list)
    # icefloe extensions, on a job this service runs: requests {pending, running}; seconds its client's
    # lease had left before this call renewed it (None = no lease)
    queue: dict[str, int] | None = None
    lease_expires_in_s: float | None = None
    host: HostPublic | None = None  # the model host it runs on, once placed


class JobList(BaseModel):
    jobs: list[JobPublic]


class Capacity(BaseModel):
    has_reservation: bool
    max_total_gpus: int
    reserved_gpus: int
    in_use_gpus: int
    available_gpus: int
    # icefloe: the slots this machine hands out (GPUs, or CPU slots when there is no GPU)
    slot_kind: Literal["gpu", "cpu"]
    max_total_slots: int
    in_use_slots: int
    available_slots: int


class ExperimentRun(BaseModel):
    experiment_name: str
    experiment_run_name: str


# --- compute -----------------------------------------------------------------------------------
class RequestAccepted(_Open):
    """``{request_id, job_id}``; with ``?wait=`` (icefloe extension) also the request's poll answer."""

    request_id: str
    job_id: str


class StepBody(_Open):
    learning_rate: float | None = Field(None, gt=0)


class SaveBody(_Open):
    checkpoint_id: str | None = None  # accepted but, as on the managed endpoint, the id comes from the step
    checkpoint_type: Annotated[Literal["resumable", "weights-only"], _EnumText] = "resumable"


class LoadBody(_Open):
    checkpoint_id: str = Field(min_length=1)
    source_job_id: str | None = None
    target_sub_job_id: str | None = None


def _token_prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A token prompt that arrived as an ``array.array`` stays one (as a list, each token would cost up to
    36 bytes); one of integral floats becomes int64, as a list's floats pass as ints."""
    if type(value) is not array.array:
        return handler(value)
    if value.typecode in "bhiq":  # int8 to int64
        return value
    at = _first_fraction(value)
    if at is not None:
        raise ValueError(f"token ids are integers; got {value[at]} at position {at}")
    return array.array("q", np.asarray(value).astype(np.int64).tobytes())


def _first_fraction(numbers: array.array) -> int | None:
    """Where ``numbers`` first holds a fraction, NaN or infinity (its own frame: a refusal's traceback keeps
    no array of positions)."""
    ids = np.asarray(numbers)
    fractional = ~np.isfinite(ids) | (ids != np.trunc(ids))
    return int(fractional.argmax()) if fractional.any() else None


class GenerateBody(_Open):
    prompts: list[Annotated[str | list[int], WrapValidator(_token_prompt)]] = Field(
        min_length=1, max_length=MAX_PROMPTS
    )
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    routing_key: str | list[str | None] | None = None
    strict: bool = False

    @model_validator(mode="after")
    def _aligned(self) -> GenerateBody:
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != len(self.prompts):
            raise ValueError(
                f"sampling_params has {len(self.sampling_params)} entries for {len(self.prompts)} prompts; "
                "send one dict for all prompts or one entry (or null) per prompt"
            )
        if isinstance(self.routing_key, list):
            if len(self.routing_key) != len(self.prompts):
                raise ValueError(
                    f"routing_key has {len(self.routing_key)} entries for {len(self.prompts)} prompts; "
                    "send one string for all prompts or one entry (or null) per prompt"
                )
            if len({key for key in self.routing_key if key}) > 1:  # one generate runs on one sampler
                raise ValueError(
                    "routing_key names different keys for the prompts of one generate, which runs on one "
                    "sampler; send the prompts of each key in a generate of their own"
                )
        return self


class OperationBody(_Open):
    operation_type: str = Field(min_length=1)
    sub_job_id: str | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] | None = None


class WeightSyncPayload(_Open):
    source_sub_job_id: str | None = None
    target_sub_job_ids: list[str] | None = None
    weight_format: Literal["vllm", "hf", "lora"] | None = None  # None: "lora" for LoRA sub-jobs, else "vllm"


class TailLogsPayload(_Open):
    cursor: str | None = None
    max_lines: int = Field(200, gt=0, le=5000)


class CancelRequestPayload(_Open):
    request_id: str = Field(min_length=1)


# --- requests ----------------------------------------------------------------------------------
class RequestPublic(BaseModel):
    request_id: str
    status: str
    created_at: str
    updated_at: str
    result: dict[str, Any]
    error: str
    events: list[dict[str, Any]]
    next_cursor: str


# --- checkpoints -------------------------------------------------------------------------------
class CheckpointPublic(BaseModel):
    checkpoint_id: str
    global_steps: int
    avg_loss: float | None
    created_at: str
    checkpoint_type: str


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointPublic]


class ExportFile(BaseModel):
    filename: str
    url: str
    size_bytes: int


class CheckpointExport(BaseModel):
    checkpoint_id: str
    files: list[ExportFile]
    expires_at: str


class Capabilities(BaseModel):
    ops: list[str]
    operations: list[str]
    extensions: dict[str, bool]
    limits: dict[str, int]
