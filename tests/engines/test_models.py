"""Tiny model building, tokenizer round-trips and the errors for bad ``model`` specs."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.engines.models import TINY_PRESETS, load_causal_lm, load_tokenizer, resolve_model
from icefloe.protocol import ConfigError


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    return resolve_model("tiny:arith", seed=3, cache_dir=tmp_path_factory.mktemp("models"))


def test_resolve_model_same_seed_gives_identical_weight_bytes(arith_dir, tmp_path):
    again = resolve_model("tiny:arith", seed=3, cache_dir=tmp_path)
    assert again != arith_dir
    assert (again / "model.safetensors").read_bytes() == (arith_dir / "model.safetensors").read_bytes()


def test_resolve_model_other_seed_gives_other_weights(arith_dir, tmp_path):
    other = resolve_model("tiny:arith", seed=4, cache_dir=tmp_path)
    assert (other / "model.safetensors").read_bytes() != (arith_dir / "model.safetensors").read_bytes()


def test_resolve_model_reuses_the_cached_folder(arith_dir):
    stamp = (arith_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny:arith", seed=3, cache_dir=arith_dir.parent) == arith_dir
    assert (arith_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in arith_dir.parent.iterdir() if p.name.startswith(".")] == []


def test_resolve_model_does_not_disturb_the_callers_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    resolve_model("tiny:arith", seed=9, cache_dir=tmp_path)
    torch.testing.assert_close(torch.rand(3), expected)


def test_load_tokenizer_round_trips_text_and_has_special_tokens(arith_dir):
    tokenizer = load_tokenizer(arith_dir)
    ids = tokenizer("17+25=").input_ids
    assert len(ids) == 6  # one token per character, no implicit BOS
    assert tokenizer.decode(ids) == "17+25="
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}) == 3
    assert tokenizer.decode([*tokenizer("42").input_ids, tokenizer.eos_token_id], skip_special_tokens=True) == "42"
    assert tokenizer.decode(tokenizer("x").input_ids) == tokenizer.unk_token


def test_load_causal_lm_reloads_as_hugging_face_model(arith_dir):
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(arith_dir)
    reference = AutoModelForCausalLM.from_pretrained(str(arith_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not model.training
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(ours, theirs, msg=name)
    input_ids = torch.tensor([load_tokenizer(arith_dir)("3+4=").input_ids])
    logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, 4, model.config.vocab_size)


def test_load_causal_lm_honours_dtype(arith_dir):
    model = load_causal_lm(arith_dir, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_resolve_model_unknown_preset_lists_presets(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_model("tiny:huge", cache_dir=tmp_path)
    for name in TINY_PRESETS:
        assert f"tiny:{name}" in str(info.value)


def test_resolve_model_missing_directory_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"model must be a local Hugging Face directory, a hub id .+ or tiny:"):
        resolve_model(str(tmp_path / "nowhere"))


def test_resolve_model_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_accepts_a_saved_directory_as_is(arith_dir):
    assert resolve_model(str(arith_dir), seed=99) == arith_dir


def test_resolve_model_concurrent_builders_agree(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    shared = tmp_path / "shared"
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: resolve_model("tiny:arith", seed=1, cache_dir=shared), range(3)))
    assert len(set(paths)) == 1
    assert sorted(p.name for p in shared.iterdir()) == [paths[0].name]  # no staging folder left behind
    alone = resolve_model("tiny:arith", seed=1, cache_dir=tmp_path / "alone")
    assert (paths[0] / "model.safetensors").read_bytes() == (alone / "model.safetensors").read_bytes()


def test_resolve_model_bench_preset_is_bigger_and_reads_text(tmp_path):
    path = resolve_model("tiny:bench", cache_dir=tmp_path)
    model = load_causal_lm(path)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (384, 4)
    tokenizer = load_tokenizer(path)
    assert tokenizer.decode(tokenizer("Hello, world!").input_ids) == "Hello, world!"


def test_loading_and_saving_a_model_draws_no_progress_bar(tmp_path):
    """transformers drew "Loading weights" and "Writing model shards" bars on every open and save."""
    import subprocess
    import sys

    code = (
        "import sys; from icefloe.engines.models import load_causal_lm, resolve_model; "
        "load_causal_lm(resolve_model('tiny:arith', cache_dir=sys.argv[1])).save_pretrained(sys.argv[2])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "models"), str(tmp_path / "saved")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "saved" / "config.json").is_file()
    assert "it/s]" not in run.stderr and "Loading weights" not in run.stderr, run.stderr
