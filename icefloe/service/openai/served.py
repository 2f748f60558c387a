"""What the ``model`` field names, the sampling job that serves it, and the cache of loaded models.

``model`` may be a base model the service offers (``tiny:<preset>``, a folder under ``--model-root``,
a hub id in the local Hugging Face cache), a Tinker checkpoint (``tinker://<run>/sampler_weights/<name>``,
or ``/weights/``), a training-API checkpoint (``<job_id>/<checkpoint_id>``, full weights or LoRA), or
``<base>;<checkpoint>`` as Tinker allows. Each is served by a sampling job of the caller's tenant, made
on first use and kept while used: a LoRA checkpoint is an adapter on the shared host of its base model,
full weights get a host of their own (:mod:`icefloe.service.hosts.pool` decides, as for any job). At
most ``max_loaded_models`` (``icefloe serve --max-loaded-models``) stay loaded; past that the least
recently used idle one is cancelled. A model no request used for ``loaded_model_idle_s``
(``--loaded-model-idle-s``) is unloaded, whether or not the service's jobs have leases (``--lease-ttl-s 0``
would otherwise keep it, and its slot, forever); its next request loads it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import posixpath
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from icefloe.protocol import ConfigError, ConflictError, InvalidRequestError, NotFoundError, TooManyRequestsError
from icefloe.service import store
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.openai.errors import ModelNotFound
from icefloe.service.schemas import JobCreate
from icefloe.service.specs import sub_job_specs
from icefloe.service.tenants import Tenancy

__all__ = ["Base", "Loaded", "Served", "Target"]

_START_POLL_S = 0.05  # how often a request waiting for its job to start looks at it
_START_TIMEOUT_S = 600.0
_TINKER_PREFIX = "tinker://"
_LISTED = 1000  # checkpoints of each API GET /models lists, newest first
_DATABASE, _SCHEMA = "openai", "v1"  # what the endpoint's jobs are listed under
_FOLDED_CHARS = 4  # characters a normalizer may turn into one (NFKC composes a letter with its marks)


@dataclass(frozen=True)
class Target:
    """A model name resolved: the base model, its LoRA adapter's config and the checkpoint to start from."""

    base_model: str
    lora: dict[str, Any] | None = None
    source: dict[str, str] | None = None  # {checkpoint_id, source_job_id}


@dataclass(frozen=True)
class Base:
    """What the endpoint needs of a base model in its own process: its tokenizer and context length."""

    tokenizer: Any
    positions: int
    longest_token_chars: int  # characters of the vocabulary's longest token (a byte-level token: its bytes)

    @property
    def max_text_chars(self) -> int:
        """Characters past which a text cannot fit the context, so it is refused before it is tokenized:
        each token covers at most the longest token's characters, times what a tokenizer's normalizer
        may fold into one (a letter and its combining marks)."""
        return self.positions * self.longest_token_chars * _FOLDED_CHARS


@dataclass
class Served:
    """A loaded model: the job that samples it, and its base."""

    model: str
    tenant: str
    job_id: str
    base: Base


class Loaded:
    """The sampling jobs that serve models, per (tenant, model), least recently used first."""

    def __init__(self, manager: JobManager, tenancy: Tenancy, tinker: Any, *, max_loaded: int) -> None:
        self.manager = manager
        self.tenancy = tenancy
        self.tinker = tinker  # the Tinker API's state (its checkpoints), or None without the tinker extra
        self.max_loaded = max_loaded
        self._served: OrderedDict[tuple[str, str], Served] = OrderedDict()
        self._loading: dict[tuple[str, str], asyncio.Task[Served]] = {}

    async def served(self, model: str, tenant: str) -> tuple[Served, LiveJob]:
        """The loaded model and its running job; loads it first if needed (404 for a model the tenant
        may not use, 400 for a malformed name)."""
        key = (tenant, _spelled_once(model))
        served = self._served.get(key)
        job = self.manager.live_job(served.job_id) if served is not None else None
        if served is None or job is None or job.stopping:
            self._served.pop(key, None)
            task = self._loading.get(key)
            if task is None:  # one load per model, however many requests wait for it
                task = self._loading[key] = asyncio.get_running_loop().create_task(self._load(*key))
                task.add_done_callback(lambda _: self._loading.pop(key, None))
            served = await asyncio.shield(task)
        job = await self._running(served.job_id)
        self._served.move_to_end(key)
        self.manager.renew(served.job_id, self.manager.settings.loaded_model_idle_s)
        return served, job

    async def _load(self, tenant: str, model: str) -> Served:
        target = await asyncio.to_thread(self.resolve, model, tenant)
        base = await asyncio.to_thread(self.base, target.base_model)
        inference: dict[str, Any] = {"max_seq_len": base.positions, "n_gpus": 1}
        if target.lora is not None:
            inference["peft_config"] = target.lora
        sub_job: dict[str, Any] = {"job_type": "sampling", "model_name": target.base_model}
        sub_job |= {"inference_config": inference, "source_checkpoint_info": target.source}
        body = JobCreate.model_validate({"sub_job_configs": [sub_job], "experiment_name": f"openai {model}"[:200]})
        await asyncio.to_thread(self._cancel, self._evict(tenant))
        job_id = await asyncio.to_thread(
            self.tenancy.create, self.manager, body, tenant=tenant, database=_DATABASE, schema=_SCHEMA
        )
        served = self._served[(tenant, model)] = Served(model, tenant, job_id, base)
        return served

    def _evict(self, tenant: str) -> list[str]:
        """Make room for one more of ``tenant``'s models; returns the jobs to cancel.

        The cap is shared fairly: the tenant's own least recently used idle model goes first; another
        tenant's only while ``tenant`` holds less than its share (the cap over the tenants holding
        models), and then from the tenant holding the most. A tenant at its share with every model
        busy is refused (429), so one tenant can neither push out another's models at will nor grow
        past the cap by keeping its own busy."""
        victims = []
        while len(self._served) >= self.max_loaded:
            held: dict[str, list[tuple[str, str]]] = {}
            for key, served in self._served.items():  # least recently used first
                held.setdefault(served.tenant, []).append(key)
            share = max(1, self.max_loaded // len(held.keys() | {tenant}))
            idle = [key for key, served in self._served.items() if not self.manager.requests.has_open(served.job_id)]
            own = [key for key in idle if key[0] == tenant]
            others = sorted((key for key in idle if key[0] != tenant), key=lambda key: -len(held[key[0]]))
            if own:
                key = own[0]
            elif len(held.get(tenant, [])) < share and others:
                key = others[0]  # sorted is stable: the most-holding tenant's least recently used
            elif len(held.get(tenant, [])) >= share:
                raise TooManyRequestsError(
                    f"this tenant holds {len(held[tenant])} of the {self.max_loaded} models the endpoint keeps "
                    f"loaded (--max-loaded-models), its share, and each is busy; send again when one is idle"
                )
            else:
                break  # below its share and every model busy: load past the cap rather than refuse it
            victims.append(self._served.pop(key).job_id)
        return victims

    def _cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            with contextlib.suppress(ConflictError, NotFoundError):  # stopped already
                self.manager.cancel(job_id, "evicted from the OpenAI endpoint's loaded models (least recently used)")

    async def _running(self, job_id: str) -> LiveJob:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _START_TIMEOUT_S
        while True:
            job = self.manager.live_job(job_id)
            status = job.status if job is not None else self.manager.public(job_id)["status"]
            if job is not None and status == "running":
                return job
            if status not in ("pending", "placing", "initializing"):
                reason = self.manager.public(job_id)["reason"] or ""
                raise ConflictError(f"the model's sampling job {job_id} is {status}: {reason}; send the request again")
            if loop.time() > deadline:
                raise ConflictError(f"the model's sampling job {job_id} did not start within {_START_TIMEOUT_S:g} s")
            await asyncio.sleep(_START_POLL_S)

    # --- names ----------------------------------------------------------------------------------
    def resolve(self, model: str, tenant: str) -> Target:
        """The base model, adapter and checkpoint ``model`` names for ``tenant``."""
        name = model.strip()
        if not name:
            raise ModelNotFound("model is empty; name a base model (GET /models lists them) or a checkpoint")
        if ";" in name:  # <base>;<checkpoint>: the base must be the checkpoint's own
            base_name, _, checkpoint = (part.strip() for part in name.partition(";"))
            target = self._checkpoint(checkpoint, tenant)
            if target is None:
                raise ModelNotFound(f"checkpoint {checkpoint!r} of model {name!r} not found")
            if self._folder(base_name) != self._folder(target.base_model):
                raise ModelNotFound(
                    f"model {name!r}: the checkpoint was trained on {target.base_model!r}, not {base_name!r}; name its "
                    "own base, or the checkpoint alone"
                )
            return target
        target = self._checkpoint(name, tenant)
        if target is not None:
            return target
        self._folder(name)  # a base model the service offers, or 404
        return Target(name)

    def _checkpoint(self, name: str, tenant: str) -> Target | None:
        """The checkpoint ``name`` names (404 for another tenant's or a missing one), or None when it is
        no checkpoint's form."""
        if name.startswith(_TINKER_PREFIX):
            return self._tinker_checkpoint(name, tenant)
        job_id, slash, checkpoint_id = name.partition("/")
        if not slash or "/" in checkpoint_id or not self.tenancy.sees(tenant, self.tenancy.owner(job_id)):
            return None  # a hub id (org/name) is a base model's name; another tenant's job is no job at all
        try:
            self.tenancy.checkpoint(tenant, job_id=job_id, checkpoint_id=checkpoint_id)
        except NotFoundError:
            raise ModelNotFound(f"model {name!r} not found: no checkpoint {checkpoint_id!r} in job {job_id}") from None
        row = store.get_job(self.tenancy.db, job_id=job_id)
        assert row is not None
        configs = row["spec"]["body"]["sub_job_configs"]
        saver = next((c for c in configs if c.get("job_type") == "training"), configs[0])
        section = saver.get("training_config") or saver.get("inference_config") or {}
        source = {"checkpoint_id": checkpoint_id, "source_job_id": job_id}
        return Target(saver["model_name"], section.get("peft_config"), source)

    def _tinker_checkpoint(self, name: str, tenant: str) -> Target:
        if self.tinker is None:
            raise ModelNotFound(
                f"model {name!r} not found: this service has no Tinker API (pip install 'icefloe[tinker]')"
            )
        from icefloe.service.tinker.state import CheckpointPath

        path = CheckpointPath.parse(name)
        try:
            job_id = self.tinker.checkpoint_job(path, tenant)
            base_model, rank, layers = self.tinker.base_model_of(path, tenant)
        except NotFoundError:
            raise ModelNotFound(f"model {name!r} not found: no such checkpoint of yours") from None
        lora = {"peft_type": "Lora", "r": rank, "lora_alpha": rank, **layers} if rank else None
        return Target(base_model, lora, {"checkpoint_id": path.checkpoint_id, "source_job_id": job_id})

    def _folder(self, base_model: str) -> str:
        """What the engines load for ``base_model`` (404 when the service offers no such model)."""
        body = JobCreate.model_validate({"sub_job_configs": [{"job_type": "sampling", "model_name": base_model}]})
        try:
            (spec,) = sub_job_specs("openai", body, model_root=self.manager.settings.model_root)
        except (InvalidRequestError, ConfigError):
            raise ModelNotFound(
                f"model {base_model!r} not found; name a base model (GET /models lists them) or a checkpoint "
                "(tinker://<run>/sampler_weights/<name>, <job_id>/<checkpoint_id>)"
            ) from None
        return spec.config.model

    @functools.lru_cache(maxsize=32)  # noqa: B019 (one Loaded per app, living as long as it)
    def base(self, base_model: str) -> Base:
        """The tokenizer and context length of ``base_model``, loaded in this process once."""
        from transformers import AutoConfig

        from icefloe.engines.models import context_limit, load_tokenizer, resolve_model

        folder = resolve_model(self._folder(base_model))
        positions, _ = context_limit(AutoConfig.from_pretrained(str(folder)), 1 << 30)
        tokenizer = load_tokenizer(folder)
        return Base(tokenizer, positions, max(map(len, tokenizer.get_vocab()), default=1))

    # --- listing ----------------------------------------------------------------------------------
    def listing(self, tenant: str) -> list[dict[str, Any]]:
        """``GET /models``: the base models the service offers (presets, folders under the model root, hub
        ids in its Hugging Face cache), then the tenant's checkpoints (Tinker sampler paths, then the
        training API's ``<job_id>/<checkpoint_id>``), newest first."""
        from icefloe.engines.models import TINY_PRESETS, cached_hub_models

        now = int(time.time())
        names = [f"tiny:{preset}" for preset in sorted(TINY_PRESETS)]
        root = self.manager.settings.model_root
        if root is not None and root.is_dir():
            folders = [p.parent for p in (*root.glob("*/config.json"), *root.glob("*/*/config.json"))]
            names += sorted(str(folder.relative_to(root)) for folder in folders)
        names += [repo_id for repo_id in cached_hub_models() if repo_id not in names]
        models = [{"id": name, "object": "model", "created": now, "owned_by": "icefloe"} for name in names]
        owner, db = self.tenancy.owner_filter(tenant), self.tenancy.db
        checkpoints: list[tuple[str, dict[str, Any]]] = []
        if self.tinker is not None:
            records = store.owned_tinker_checkpoints(db, owner=owner, limit=_LISTED, offset=0)
            checkpoints += [(path, r) for r in records if (path := _tinker_path(r)) is not None]
        records = store.owned_training_checkpoints(db, owner=owner, limit=_LISTED)
        checkpoints += [(f"{r['job_id']}/{r['checkpoint_id']}", r) for r in records]
        for name, record in checkpoints:
            created = int(datetime.fromisoformat(record["created_at"]).timestamp())
            models.append({"id": name, "object": "model", "created": created, "owned_by": tenant})
        return models


def _spelled_once(model: str) -> str:
    """``model`` as one spelling of the folder (or checkpoint) it names: ``org/name/``, ``./org/name`` and
    ``org//x/../name`` are ``org/name``, so they share one loaded model rather than each loading its own."""
    name = model.strip()
    if not name or name.startswith(_TINKER_PREFIX) or ";" in name:
        return name
    return posixpath.normpath(name)


def _tinker_path(record: dict[str, Any]) -> str | None:
    """``tinker://<run>/sampler_weights/<name>`` of a Tinker sampler checkpoint record, else None."""
    prefix = "tinker-sampler_weights-"
    checkpoint_id = record["checkpoint_id"]
    if not checkpoint_id.startswith(prefix):
        return None
    return f"{_TINKER_PREFIX}{record['run_id']}/sampler_weights/{checkpoint_id.removeprefix(prefix)}"
