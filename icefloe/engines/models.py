"""Resolve a ``model`` spec to a local Hugging Face directory, and load what is in it.

``tiny:<preset>`` builds a small Qwen3-style causal LM and a character-level tokenizer in code,
deterministically from the seed, and saves both (safetensors) into a cache folder, so every
backend and every process loads the same bytes. Anything else must be a local directory: the
hub is never contacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import string
import tempfile
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from icefloe.protocol import ConfigError

__all__ = [
    "TINY_PRESETS",
    "TinyPreset",
    "cached_hub_model",
    "context_limit",
    "default_cache_dir",
    "load_causal_lm",
    "load_tokenizer",
    "open_modes",
    "resolve_model",
]

TINY_PREFIX = "tiny:"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face hub names a repository
# Bump when the way a preset is turned into files changes, so stale cache folders are not reused.
_BUILD_FORMAT = 2
# torch's default generator is process-wide: two threads seeding and drawing at once would mix streams.
_INIT_LOCK = threading.Lock()


@dataclass(frozen=True)
class TinyPreset:
    """Shape of a tiny model and the characters its tokenizer knows (one token per character)."""

    alphabet: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True

    def fingerprint(self) -> str:
        """Short hash of everything that decides the saved bytes (besides the seed)."""
        text = json.dumps({"format": _BUILD_FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


_ARITH = TinyPreset(
    alphabet="0123456789+-*= ",
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)

TINY_PRESETS: dict[str, TinyPreset] = {
    # The demo model: a vocabulary of 20 tokens keeps a fresh policy's guesses within reach of RL,
    # and ~100k parameters learn the arithmetic task in about a minute on two CPU cores.
    "arith": _ARITH,
    # Compute-bound shapes for benchmarks: matmuls dominate, not Python overhead.
    "bench": TinyPreset(
        alphabet=string.printable[:95],  # digits, letters, punctuation, space
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # For the Tinker SDK and cookbook: the demo model's shapes over printable ASCII and newline, so
    # chat-style prompts tokenise.
    "chat": replace(_ARITH, alphabet=string.printable[:95] + "\n", max_position_embeddings=512),
}


def default_cache_dir() -> Path:
    """Where built tiny models live: ``~/.cache/icefloe/models``."""
    return Path.home() / ".cache" / "icefloe" / "models"


def resolve_model(spec: str, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face causal-LM directory for ``spec``.

    Args:
        spec: a local directory holding ``config.json``, or ``tiny:<preset>`` (see ``TINY_PRESETS``).
        seed: initialises a tiny model's weights; ignored for a directory.
        cache_dir: parent folder of built tiny models; None = :func:`default_cache_dir`.

    Raises:
        ConfigError: unknown preset, or a directory that is missing or has no ``config.json``.
    """
    if spec.startswith(TINY_PREFIX):
        return _build_tiny(spec.removeprefix(TINY_PREFIX), seed=seed, cache_dir=cache_dir or default_cache_dir())
    path = Path(spec).expanduser()
    if not path.is_dir():
        cached = cached_hub_model(spec)
        if cached is not None:
            return cached
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ConfigError(
            f"model must be a local Hugging Face directory, a hub id (org/name) in the local Hugging Face cache "
            f"({HF_HUB_CACHE}), or tiny:<preset> ({_preset_list()}); {spec!r} is neither (models are never "
            "downloaded: fetch it once with `hf download ORG/NAME`)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model directory {spec!r} has no config.json; point model at a saved Hugging Face causal-LM "
            f"directory or use tiny:<preset> ({_preset_list()})"
        )
    return path


def cached_hub_model(repo_id: str) -> Path | None:
    """The snapshot folder of hub id ``repo_id`` (``org/name``) in the local Hugging Face cache
    (``HF_HUB_CACHE``), offline; None when it is not a hub id or no snapshot there holds a config.json."""
    if not _HUB_ID.fullmatch(repo_id):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def cached_hub_models() -> list[str]:
    """The hub ids (``org/name``) :func:`cached_hub_model` finds in the local Hugging Face cache, sorted."""
    from huggingface_hub import constants

    folders = Path(constants.HF_HUB_CACHE).glob("models--*--*")  # the hub's layout: models--{org}--{name}
    repo_ids = (folder.name.removeprefix("models--").replace("--", "/", 1) for folder in folders)
    return sorted(repo_id for repo_id in repo_ids if cached_hub_model(repo_id) is not None)


def context_limit(model_config: Any, max_seq_len: int) -> tuple[int, str]:
    """The positions one row may hold, and that limit in words: ``max_seq_len``, or the model's own
    context (``max_position_embeddings``) where that is smaller."""
    positions = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if isinstance(positions, int) and positions < max_seq_len:
        return positions, f"the model's context of {positions} tokens"
    return max_seq_len, f"max_seq_len={max_seq_len}"


def load_tokenizer(path: Path | str) -> Any:
    """Load the tokenizer saved in ``path`` (a fast Hugging Face tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:  # batching needs a pad id; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: Path | str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load the causal LM saved in ``path`` onto ``device`` in ``dtype``, in train mode off (eval)."""
    from transformers import AutoModelForCausalLM

    _no_progress_bars()

    # sdpa is at least as fast as eager at every shape measured on CPU, and much faster on GPU.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def open_modes(folder: Path) -> None:
    """Give a folder built in a private staging place (``mkdtemp``: 0700, files 0600) the modes of any
    other: 0755 for folders, 0644 for files, so other users and tools can read an exported model."""
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _no_progress_bars() -> None:
    """Turn off transformers' bars on every load and save ("Loading weights", "Writing model shards"): they
    break up the service's log and the demo's own bar. Each process loads or builds a model before it saves one."""
    from transformers.utils import logging

    logging.disable_progress_bar()


# --- tiny models -------------------------------------------------------------------------------
def _preset_list() -> str:
    return ", ".join(f"{TINY_PREFIX}{name}" for name in sorted(TINY_PRESETS))


def _build_tiny(name: str, *, seed: int, cache_dir: Path) -> Path:
    preset = TINY_PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"model {TINY_PREFIX + name!r} is not a tiny preset; choose one of: {_preset_list()}")
    target = Path(cache_dir).expanduser() / f"{name}-seed{seed}-{preset.fingerprint()}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private folder, then rename: a concurrent builder either wins the rename or finds
    # the finished folder, and nobody ever reads a half-written one.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = _char_tokenizer(preset.alphabet)
        tokenizer.save_pretrained(str(staging))
        _tiny_model(preset, tokenizer, seed=seed).save_pretrained(str(staging))
        open_modes(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _char_tokenizer(alphabet: str):
    """One token per character, special tokens first, no chat template, no implicit BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate([PAD, BOS, EOS, UNK, *dict.fromkeys(alphabet)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # "." matches no newline; "[\s\S]" is every character, for alphabets that hold one.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]" if "\n" in alphabet else "."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join back without separators
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def _tiny_model(preset: TinyPreset, tokenizer, *, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _no_progress_bars()

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # Initialise under a private RNG state so the weights depend on the seed alone, not on what
    # the calling process drew before.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
