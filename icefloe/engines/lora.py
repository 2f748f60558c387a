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
    "WEIGHT_FORMATS",
    "add_adapters",
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


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """Wrap ``model`` in a ``peft.PeftModel`` with fresh adapters; only they (and the chosen biases) train.

    The adapters start as an exact no-op (``lora_B`` is zero), so a fresh wrapped model scores
    tokens exactly as the base does. Initialisation draws from torch's default generator.
    """
    import peft

    try:
        with warnings.catch_warnings():
            # peft reads a transformers attribute that transformers 5 deprecated; nothing for a caller to fix.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return peft.get_peft_model(model, peft_config(lora))
    except ValueError as exc:  # peft names the modules it could not find
        raise InvalidRequestError(
            f"lora.target_modules={lora.target_modules!r} does not fit the model: {exc}; name Linear modules "
            "of the model (e.g. ['q_proj', 'v_proj']) or use 'all-linear'"
        ) from None


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of what a LoRA model trains and a weight sync moves: adapters (+ biases)."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def merged_copy(model: Any) -> torch.nn.Module:
    """A plain Hugging Face model with the adapters of peft model ``model`` merged in; ``model`` is untouched.

    An adapted output layer that shares its weight with the input embeddings is untied first:
    merging into the shared tensor would change the embeddings too.
    """
    clone = copy.deepcopy(model)
    base = clone.get_base_model()
    head = base.get_output_embeddings()
    if getattr(base.config, "tie_word_embeddings", False) and head is not None and hasattr(head, "base_layer"):
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
    return clone.merge_and_unload()


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


def peft_key(name: str) -> str:
    """A parameter's name as PEFT files spell it: without the adapter's name."""
    return name.replace(f".{_ADAPTER_NAME}.", ".")


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
