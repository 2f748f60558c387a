"""tinker-cookbook's math_rl recipe (0.6.1, unmodified) against ``icefloe serve``, run as a user runs it.

CI installs the cookbook with ``make test-slow`` (``--no-deps`` plus what it imports: it declares
``tml-renderers``, which PyPI cannot satisfy and this recipe never imports).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

if importlib.util.find_spec("tinker_cookbook") is None:
    pytest.skip("needs tinker-cookbook (make test-slow installs it)", allow_module_level=True)

from icefloe.service.app import ServerThread  # noqa: E402
from tests.service.service_harness import make_app  # noqa: E402


def _math_rl(*overrides: str, cwd: os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """The cookbook's math_rl recipe on arithmetic for 3 small LoRA steps, with ``overrides`` on top."""
    small = ["env=arithmetic", "lora_rank=8", "groups_per_batch=4", "group_size=4", "max_tokens=8", "max_steps=3",
             "learning_rate=1e-3", "behavior_if_log_dir_exists=delete"]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *small, *overrides],
        cwd=cwd,
        env={**os.environ, "TINKER_API_KEY": "tml-cookbook", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_math_rl_arithmetic_trains_against_icefloe_serve(tmp_path):
    model = tmp_path / "models" / "tiny-chat"  # the data dir must not lie under the model root
    subprocess.run([sys.executable, "-m", "icefloe.cli", "models", "export", "tiny:chat", str(model)], check=True)
    log_path = tmp_path / "run"
    with ServerThread(make_app(tmp_path / "serve", engines="local", model_root=model.parent)) as base_url:
        recipe = _math_rl(f"model_name={model}", "renderer_name=role_colon", f"base_url={base_url}",
                          "loss_fn=importance_sampling", f"log_path={log_path}")  # fmt: skip
    assert recipe.returncode == 0, recipe.stdout[-3000:] + recipe.stderr[-3000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    kls = [row["optim/kl_sample_train_v1"] for row in rows if "optim/kl_sample_train_v1" in row]
    assert len(kls) == 3 and all(abs(kl) < 1e-4 for kl in kls)  # the sampler samples what the trainer trains
    final = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["state_path"].endswith("/weights/final")


def test_a_recipe_that_looks_up_its_renderer_by_name_runs_on_a_known_name_folder_async(tmp_path):
    """docs/tinker.md, "Running the cookbook's recipes": a folder named like a model the cookbook knows
    (its renderer: role_colon), under the model root and run from there; a longer context from the
    folder's config.json; asynchronous RL with cispo. With a constant reward nothing trains."""
    import httpx

    models = tmp_path / "models"
    model = models / "Qwen" / "Qwen3-8B-Base"
    subprocess.run([sys.executable, "-m", "icefloe.cli", "models", "export", "tiny:chat", str(model)], check=True)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    log_path = tmp_path / "run"
    with ServerThread(make_app(tmp_path / "serve", engines="local", model_root=models)) as base_url:
        served = httpx.get(f"{base_url}/api/v1/get_server_capabilities").json()["supported_models"]
        recipe = _math_rl("model_name=Qwen/Qwen3-8B-Base", f"base_url={base_url}", "loss_fn=cispo",
                          "max_steps_off_policy=1", f"log_path={log_path}", cwd=models)  # fmt: skip
    assert recipe.returncode == 0, recipe.stdout[-3000:] + recipe.stderr[-3000:]
    assert json.loads((log_path / "config.json").read_text())["renderer_name"] == "role_colon"  # found by name
    assert any(m.get("model_name") == "Qwen/Qwen3-8B-Base" and "4096" in json.dumps(m) for m in served), served
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    rewards = {row["env/all/reward/total"] for row in rows if "env/all/reward/total" in row}
    grad_norms = {row["grad_norm:mean"] for row in rows if "grad_norm:mean" in row}
    assert len(rows) >= 3 and len(rewards) == 1 and grad_norms == {0.0}  # one reward for all: nothing trains


def test_weights_download_fetches_a_training_checkpoint_as_a_peft_folder(tmp_path, monkeypatch):
    """The cookbook's weights.download: load the checkpoint into a new run, export it encrypted to a key it
    makes (save_weights_external), fetch and decrypt each file, delete the export. It failed on the 404
    of save_weights_external."""
    import tinker
    from safetensors.torch import load_file
    from tinker_cookbook import weights

    model = tmp_path / "models" / "tiny-chat"  # the data dir must not lie under the model root
    subprocess.run([sys.executable, "-m", "icefloe.cli", "models", "export", "tiny:chat", str(model)], check=True)
    monkeypatch.setenv("TINKER_API_KEY", "tml-cookbook")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ServerThread(make_app(tmp_path / "serve", engines="local", model_root=model.parent)) as base_url:
        with tinker.ServiceClient(base_url=base_url) as service:
            training = service.create_lora_training_client(base_model=str(model), rank=4).result()
            state_path = training.save_state("to-download").result().path
        output = weights.download(tinker_path=state_path, output_dir=str(tmp_path / "adapter"), base_url=base_url)
        rest = tinker.RestClient(base_url=base_url)
        exports = [c for c in rest.list_user_checkpoints().result().checkpoints if c.checkpoint_type == "external"]
    files = {path.name for path in (tmp_path / "adapter").iterdir()}
    assert output == str(tmp_path / "adapter") and {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert all("lora_" in key for key in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert exports == []  # the temporary export was deleted


_DPO_SCRIPT = """
import json, sys
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

model, pairs, log_path, base_url = sys.argv[1:]
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=model, renderer_name="role_colon", max_length=64, batch_size=2
)
comparisons = ComparisonBuilderFromJsonl(train_path=pairs, test_path=pairs)
config = train_dpo.Config(
    recipe_name="dpo", log_path=log_path, model_name=model, renderer_name="role_colon", base_url=base_url, lora_rank=8,
    dataset_builder=DPODatasetBuilderFromComparisons(common_config=common, comparison_builder=comparisons),
    learning_rate=5e-3, lr_schedule="constant", dpo_beta=1.0, num_epochs=3, eval_every=2, save_every=3,
    infrequent_eval_every=0,
)
train_dpo.main(config)
"""


def test_dpo_keeps_its_reference_while_evals_and_checkpoints_save_new_weights(tmp_path):
    """The cookbook's DPO keeps a save_weights_and_get_sampling_client() snapshot as its reference; each
    eval's own snapshot and each save_every checkpoint refilled the sampler it was bound to, so the
    reference became the policy and the loss snapped back to exactly ln 2 (margin 0) at every eval."""
    model = tmp_path / "models" / "tiny-chat"  # the data dir must not lie under the model root
    subprocess.run([sys.executable, "-m", "icefloe.cli", "models", "export", "tiny:chat", str(model)], check=True)
    pairs = tmp_path / "pairs.jsonl"
    rows = []
    for i in range(4):
        comparison = {
            "prompt_conversation": [{"role": "user", "content": f"count to {i + 3}"}],
            "completion_A": [{"role": "assistant", "content": " ".join(str(n) for n in range(i + 3))}],
            "completion_B": [{"role": "assistant", "content": "no"}],
        }
        rows.append(json.dumps({"comparison": comparison, "label": "A"}))
    pairs.write_text("\n".join(rows) + "\n")
    log_path = tmp_path / "run"
    with ServerThread(make_app(tmp_path / "serve", engines="local", model_root=model.parent)) as base_url:
        recipe = subprocess.run(
            [sys.executable, "-c", _DPO_SCRIPT, str(model), str(pairs), str(log_path), base_url],
            env={**os.environ, "TINKER_API_KEY": "tml-cookbook", "HF_HUB_OFFLINE": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert recipe.returncode == 0, recipe.stdout[-3000:] + recipe.stderr[-3000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["dpo_loss"] for row in rows if "dpo_loss" in row]
    evals = [row for row in rows if any(key.startswith("test/") for key in row)]
    assert len(losses) == 6 and len(evals) >= 3, rows
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the initial policy
    assert all(abs(loss - math.log(2)) > 1e-3 for loss in losses[1:]), losses  # and stays the initial policy
    assert losses[-1] < losses[0]
