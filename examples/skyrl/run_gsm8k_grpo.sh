#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3-0.6B: SkyRL's trainer loop, icefloe's training and sampling.
#
#   python examples/skyrl/prepare_gsm8k.py --output-dir ~/data/gsm8k-skyrl   # once
#   bash examples/skyrl/run_gsm8k_grpo.sh [extra SkyRL overrides]
#
# Backend: in-process engines by default. ICEFLOE_BACKEND=remote (or ARCTIC_BACKEND=cortex) with
# ICEFLOE_REMOTE_BASE_URL / ARCTIC_CORTEX_* sends the compute to a training service instead; a
# backend without `forward` (the managed endpoint) runs only single-epoch GRPO without KL, which
# is what this script configures.
set -euo pipefail

DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k-skyrl}"   # not ~/data/gsm8k: verl's GSM8K files use another schema
MODEL="${MODEL:-Qwen/Qwen3-0.6B}"
NUM_TRAIN_GPUS="${NUM_TRAIN_GPUS:-1}"
NUM_ENGINES="${NUM_ENGINES:-1}"
RUN_DIR="${RUN_DIR:-$HOME/runs/skyrl-gsm8k-icefloe}"

python -m icefloe.integrations.skyrl \
  data.train_data="['${DATA_DIR}/train.parquet']" \
  data.val_data="['${DATA_DIR}/validation.parquet']" \
  trainer.policy.model.path="${MODEL}" \
  trainer.placement.colocate_all=false \
  trainer.placement.policy_num_gpus_per_node="${NUM_TRAIN_GPUS}" \
  generator.inference_engine.num_engines="${NUM_ENGINES}" \
  generator.inference_engine.tensor_parallel_size=1 \
  trainer.algorithm.advantage_estimator=grpo \
  trainer.algorithm.use_kl_loss=false \
  trainer.algorithm.use_kl_in_reward=false \
  trainer.update_epochs_per_batch=1 \
  trainer.epochs=1 \
  trainer.train_batch_size=64 \
  trainer.policy_mini_batch_size=64 \
  trainer.max_prompt_length=512 \
  generator.max_input_length=512 \
  generator.sampling_params.max_generate_length=1024 \
  generator.n_samples_per_prompt=4 \
  trainer.policy.optimizer_config.lr=1.0e-6 \
  trainer.eval_before_train=false \
  trainer.eval_interval=10 \
  trainer.ckpt_interval=0 \
  trainer.ckpt_path="${RUN_DIR}/ckpt" \
  trainer.export_path="${RUN_DIR}/export" \
  trainer.logger=console \
  trainer.project_name=icefloe-skyrl \
  trainer.run_name=gsm8k-grpo-qwen3-0.6b \
  trainer.icefloe.dtype=bfloat16 \
  trainer.icefloe.scoring_workers=8 \
  "$@"
