"""LoRA adapters through ``peft``: wrap a model, name what a weight sync moves, write PEFT folders.

A LoRA engine wraps its Hugging Face model with ``peft.get_peft_model``; the trainer and the
sampler wrap the same way, so an adapter tensor has the same name on both sides and a weight sync
copies it by name like any other parameter. On disk an adapter is a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained``
and vLLM load.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from icefloe.config import LoraConfig
from icefloe.protocol import InvalidRequestError

__all__ = [
    "ADAPTER_WEIGHTS_FILE",
    "BASE_ADAPTER",
    "WEIGHT_FORMATS",
    "SharedBase",
    "check_weight_format",
    "merged_copy",
    "peft_config",
    "peft_key",
    "read_adapter_checkpoint",
    "trainable_parameters",
    "write_adapter_folder",
]

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
WEIGHT_FORMATS = ("vllm", "hf", "lora")  # the training API's weight-sync formats ("vllm" is its default)
_ADAPTER_NAME = "default"  # peft's name for a model's only adapter; it appears in parameter names


def peft_config(lora: LoraConfig, *, target_modules: list[str] | None = None) -> Any:
    """The ``peft.LoraConfig`` for ``lora`` (``target_modules`` overrides the configured ones)."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError("LoRA (config.lora) needs peft: pip install icefloe[torch]")
    import peft

    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        bias=lora.bias,
        target_modules=target_modules if target_modules is not None else lora.target_modules,
    )


BASE_ADAPTER = "__base__"  # peft's name, in a mixed batch, for rows that run the base model alone


class SharedBase:
    """One base model in memory and the LoRA adapters of every run on it (peft's multi-adapter model).

    A run trains an adapter of its own (its own rank, scale and layers) and nothing else; a sampler
    samples with a frozen snapshot adapter that each weight sync refreshes. One forward may mix rows
    of several adapters (:meth:`forward` takes one adapter name per row; ``BASE_ADAPTER`` rows run
    the base alone, the KL reference). peft runs such mixed batches in eval mode only, so a base
    shared by several adapters must have no dropout (:func:`shareable`); a base with one adapter
    trains as a plain peft model, dropout included.

    Args:
        base: the Hugging Face model; adapters are injected into it in place.
        model_dir: the folder it was loaded from; tokenizer: its tokenizer (the runs share both).
    """

    def __init__(self, base: torch.nn.Module, *, model_dir: Path, tokenizer: Any) -> None:
        self.base = base
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.device = next(base.parameters()).device
        self._kinds = _linear_kinds(base)  # before peft wraps it: its own layers are Linear too
        self.cancelled: set[str] = set()  # tags of generate calls to stop (its samplers' SamplingEngine.cancel)
        self._active: str | None = None  # peft's active adapter
        self.model: Any = base  # the peft model once an adapter exists
        self._configs: dict[str, LoraConfig] = {}
        self._trainable: set[str] = set()
        self._count = 0
        self._layers: list[Any] | None = []  # peft's LoRA Linear layers, for mixed batches (None: peft's own path)

    @property
    def mixed(self) -> bool:
        """More than one adapter: batches name an adapter per row (and run in eval mode)."""
        return len(self._configs) > 1

    @property
    def adapters(self) -> list[str]:
        return list(self._configs)

    def add(self, lora: LoraConfig, *, trainable: bool, seed: int, name: str | None = None) -> str:
        """Add a fresh adapter (an exact no-op until trained: ``lora_B`` starts at zero); returns its name.

        The initialisation draws from a generator seeded with ``seed`` alone, so a run's adapter
        starts the same whatever else shares the base.
        """
        import peft

        if name is None:
            self._count += 1
            name = _ADAPTER_NAME if self._count == 1 else f"run{self._count}"
        config = peft_config(lora, target_modules=_target_modules(self._kinds, lora))
        try:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                torch.manual_seed(seed)
                # peft reads a transformers attribute that transformers 5 deprecated; nothing for a caller to fix.
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                if not self._configs:
                    self.model = peft.get_peft_model(self.base, config, adapter_name=name)
                else:
                    self.model.add_adapter(name, config)
        except ValueError as exc:  # peft names the modules it could not find
            raise InvalidRequestError(
                f"lora.target_modules={lora.target_modules!r} does not fit the model: {exc}; name Linear modules "
                "of the model (e.g. ['q_proj', 'v_proj']) or use 'all-linear'"
            ) from None
        self._configs[name] = lora
        self._active = self._active or name  # peft's first adapter is its active one
        if trainable:
            self._trainable.add(name)
        self._mark_trainable()
        self._find_layers()
        return name

    def remove(self, name: str) -> None:
        """Drop an adapter and its tensors; the last one leaves the plain base model."""
        if self._configs.pop(name, None) is None:
            return
        self._trainable.discard(name)
        if self._active == name:
            self._active = None  # peft picks another; the next plain forward names its own
        if self._configs:
            with warnings.catch_warnings():  # peft says which adapter it makes active: none is, batches name theirs
                warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted", UserWarning)
                self.model.delete_adapter(name)
            self._mark_trainable()
            self._find_layers()
        else:
            self.model = self.model.unload()
            self._layers = []

    def parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters (and, with ``bias`` set, the biases it trains), by PEFT file name."""
        marker = f".{name}."
        lora = self._configs[name]
        found = {}
        for full, param in self.model.named_parameters():
            if marker in full or (lora.bias != "none" and full.endswith(".bias") and param.requires_grad):
                found[peft_key(full, name)] = param
        return found

    def forward(self, adapters: list[str] | str, **kwargs: Any) -> Any:
        """The model's forward with each row through its adapter (``adapters``: one name, or one per row).

        Rows that all use one adapter run through it as peft's active adapter, in whatever mode
        :meth:`train` set; a batch of several names an adapter per row, which peft runs in eval mode.
        """
        rows = kwargs["input_ids"].shape[0]
        names = [adapters] * rows if isinstance(adapters, str) else list(adapters)
        if len(set(names)) == 1:  # peft's plain path: no per-row gather and scatter in every LoRA layer
            if names[0] == BASE_ADAPTER:
                if not self._configs:
                    return self.model(**kwargs)
                with self.model.disable_adapter():
                    return self.model(**kwargs)
            self._activate(names[0])
            return self.model(**kwargs)
        if self.model.training:
            self.model.train(False)
        if self._layers is None:  # a layer kind the routing does not know: peft's own mixed path
            return self.model(**kwargs, adapter_names=names)
        return self._routed(names, kwargs)

    def _routed(self, names: list[str], kwargs: dict[str, Any]) -> Any:
        """A mixed forward: every LoRA layer runs the base once for all rows, then adds each adapter's
        update to that adapter's run of consecutive rows (one split and one concatenation, where peft's
        ``adapter_names`` path gathers and scatters rows by index lists and walks every module on each
        call). Callers keep an adapter's rows together."""
        runs = [(name, len(list(rows))) for name, rows in itertools.groupby(names)]
        sizes = [size for _, size in runs]

        def add_updates(layer: Any, args: tuple[Any, ...], output: Tensor) -> Tensor:
            updates = []
            for (name, _), rows in zip(runs, args[0].split(sizes), strict=True):
                if name in layer.lora_A:
                    lora_a = layer.lora_A[name]
                    update = layer.lora_B[name](lora_a(layer.lora_dropout[name](rows.to(lora_a.weight.dtype))))
                    updates.append((update * layer.scaling[name]).to(output.dtype))
                else:  # the base's rows (the KL reference), or an adapter that leaves this layer alone
                    updates.append(output.new_zeros((*rows.shape[:-1], output.shape[-1])))
            return output + torch.cat(updates)

        layers = self._layers or []
        active = [layer._active_adapter for layer in layers]
        hooks = [layer.register_forward_hook(add_updates) for layer in layers]
        for layer in layers:
            layer._active_adapter = []  # the base alone; add_updates adds the adapters
        try:
            return self.model(**kwargs)
        finally:
            for layer, adapters, hook in zip(layers, active, hooks, strict=True):
                layer._active_adapter = adapters
                hook.remove()

    def _find_layers(self) -> None:
        """peft's LoRA layers; a layer kind with its own maths (not a plain LoRA Linear) leaves mixed
        batches to peft (``None``)."""
        from peft.tuners.lora.layer import Linear

        layers = [m for m in self.model.modules() if hasattr(m, "lora_A")]
        plain = all(type(m) is Linear and not m.lora_variant and hasattr(m, "_active_adapter") for m in layers)
        self._layers = layers if plain else None

    def train(self, mode: bool) -> None:
        """Train mode only where peft allows it: never while batches mix adapters."""
        mode = mode and not self.mixed
        if self.model.training != mode:
            self.model.train(mode)

    def _activate(self, name: str) -> None:
        """Make ``name`` peft's active adapter (the one a plain forward runs through)."""
        if self._active != name:
            self.model.base_model.set_adapter(name)
            self._mark_trainable()  # peft leaves only the active adapter trainable
            self._active = name

    def _mark_trainable(self) -> None:
        # peft re-marks only its active adapter trainable whenever one is added or deleted.
        for full, param in self.model.named_parameters():
            if ".lora_" in full:
                param.requires_grad_(any(f".{name}." in full for name in self._trainable))


def _target_modules(kinds: dict[str, str], lora: LoraConfig) -> list[str] | str:
    """What peft adapts: the given module names, ``"all-linear"``, or, by full name, the Linear
    modules of the layer kinds ``lora.layers`` picks (``kinds``: see :func:`_linear_kinds`)."""
    if not isinstance(lora.target_modules, str) or lora.layers == (True, True, False):
        return lora.target_modules
    wanted = {kind for kind, on in zip(("attn", "mlp", "unembed"), lora.layers, strict=True) if on}
    return [name for name, kind in kinds.items() if kind in wanted]


def _linear_kinds(model: torch.nn.Module) -> dict[str, str]:
    """Each Linear module of a plain (unwrapped) model: ``attn``, ``mlp`` (any other block) or ``unembed``."""
    head = model.get_output_embeddings()
    attention = [name for name, module in model.named_modules() if "attention" in type(module).__name__.lower()]
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            inside_attention = any(name.startswith(f"{block}.") for block in attention)
            kinds[name] = "unembed" if module is head else "attn" if inside_attention else "mlp"
    return kinds


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of what a LoRA model trains and a weight sync moves: adapters (+ biases)."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def merged_copy(model: Any, adapter: str = _ADAPTER_NAME) -> torch.nn.Module:
    """A plain Hugging Face model with adapter ``adapter`` of peft model ``model`` merged in;
    ``model`` is untouched.

    An adapted output layer that shares its weight with the input embeddings is untied first:
    merging into the shared tensor would change the embeddings too.
    """
    clone = copy.deepcopy(model)
    base = clone.get_base_model()
    head = base.get_output_embeddings()
    if getattr(base.config, "tie_word_embeddings", False) and head is not None and hasattr(head, "base_layer"):
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
    return clone.merge_and_unload(adapter_names=[adapter])


def check_weight_format(weight_format: str | None, trainer: LoraConfig | None, sampler: LoraConfig | None) -> str:
    """The format a trainer → sampler sync uses, after checking both ends can use it.

    ``None`` picks ``"lora"`` when the trainer trains adapters and ``"vllm"`` (full weights)
    otherwise. ``"lora"`` moves only adapter tensors and needs the same rank, alpha and target
    modules on both ends; ``"vllm"`` and ``"hf"`` move full weights and need LoRA on neither.

    Raises:
        InvalidRequestError: an unknown format, or one the two ends cannot use; names both ends' values.
    """
    if weight_format is None:
        weight_format = "lora" if trainer is not None else "vllm"
    if weight_format not in WEIGHT_FORMATS:
        raise InvalidRequestError(f"weight_format must be one of {list(WEIGHT_FORMATS)}; got {weight_format!r}")
    if weight_format != "lora":
        if trainer is not None or sampler is not None:
            raise InvalidRequestError(
                f"weight_format {weight_format!r} moves full weights, but the "
                f"{'trainer' if trainer is not None else 'sampler'} has LoRA adapters; use weight_format='lora' "
                "with LoRA (peft_config) on both, or on neither for full weights"
            )
        return weight_format
    if trainer is None:
        raise InvalidRequestError(
            "weight_format 'lora' needs LoRA adapters on the trainer; set lora (peft_config) on the training "
            "and sampling configs, or sync full weights (weight_format 'vllm')"
        )
    differences = trainer.mismatch(sampler)
    if differences:
        raise InvalidRequestError(
            "LoRA sync needs the same adapter shape on trainer and sampler (trainer vs sampler): "
            + "; ".join(differences)
            + "; give both the same peft_config"
        )
    return weight_format


def peft_key(name: str, adapter: str = _ADAPTER_NAME) -> str:
    """A parameter's name as PEFT files spell it: without the adapter's name."""
    return name.replace(f".{adapter}.", ".")


def write_adapter_folder(path: Path, lora: LoraConfig, named: Iterable[tuple[str, Tensor]]) -> Path:
    """Write ``named`` adapter tensors (parameter names of a wrapped model) as a PEFT folder at ``path``.

    ``adapter_config.json`` lists the adapted modules by name, as ``peft`` resolves them, so a
    loader (vLLM) need not know what ``"all-linear"`` means for this model.
    """
    tensors = {peft_key(name): tensor.detach().to("cpu").contiguous() for name, tensor in named}
    modules = sorted({_module_path(key) for key in tensors if ".lora_A." in key or ".lora_B." in key})
    path.mkdir(parents=True, exist_ok=True)
    peft_config(lora, target_modules=modules).save_pretrained(str(path))
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE))
    return path


def read_adapter_checkpoint(folder: Path, lora: LoraConfig | None) -> dict[str, Tensor] | None:
    """The adapter tensors of a weights-only LoRA checkpoint (a PEFT folder), by PEFT file name;
    None when ``folder`` holds no adapter (a full model).

    Raises:
        InvalidRequestError: ``lora`` is None, or its rank or alpha differ from the adapter's.
    """
    weights = Path(folder) / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        return None
    if lora is None:
        raise InvalidRequestError(
            f"{Path(folder).name} is a LoRA adapter checkpoint; start from it with the lora settings "
            "(peft_config) it was trained with"
        )
    saved = json.loads((Path(folder) / "adapter_config.json").read_text())
    differences = [
        f"{key}: {saved.get(key)} vs {mine}" for key, mine in (("r", lora.rank), ("lora_alpha", lora.alpha))
        if saved.get(key) != mine
    ]  # fmt: skip
    if differences:
        raise InvalidRequestError(
            f"the adapter in {Path(folder).name} and the lora settings differ (adapter vs settings): "
            f"{'; '.join(differences)}; configure lora (peft_config) as the adapter was trained"
        )
    return load_file(str(weights))


def _module_path(key: str) -> str:
    """``base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`` → ``model.layers.0.mlp.up_proj``."""
    module = key.split(".lora_A.")[0].split(".lora_B.")[0]
    return module.removeprefix("base_model.model.")
