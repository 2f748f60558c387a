#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3-0.6B: verl keeps the loop, rewards and advantages; icefloe trains and samples.
# Runs on verl branches with the remote-backend seam and on stock PyPI verl 0.9.x (README.md). Data: prepare_gsm8k.py.
set -euo pipefail

DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
# local | ray | remote (ICEFLOE_BACKEND, as everywhere else); remote also reads ICEFLOE_REMOTE_BASE_URL
# (icefloe serve) or the ARCTIC_CORTEX_* vars.
BACKEND=${ICEFLOE_BACKEND:-${ARCTIC_BACKEND:-ray}}
ICEFLOE_CONFIG_DIR=$(python -c 'import icefloe.integrations.verl as p; print(p.config_dir())')
# V0 (verl release/v0.7.1 with PR 6422) needs the trainer switch and the new worker path; V1 reads the Hydra
# choice; stock PyPI verl (no seam) runs through icefloe's launcher, which registers an icefloe trainer mode.
SEAM=$(python -c 'import importlib.util as u, icefloe.integrations.verl as p; print(p.seam_version() if u.find_spec("verl.remote_backend") else "stock")')
if [[ "$SEAM" == "v0" ]]; then
  ENTRY=(python -m verl.trainer.main_ppo)
  SEAM_ARGS=(remote_backend=icefloe trainer.remote_backend=icefloe trainer.use_legacy_worker_impl=disable)
elif [[ "$SEAM" == "v1" ]]; then
  ENTRY=(python -m verl.trainer.main_ppo)
  SEAM_ARGS=(remote_backend=icefloe trainer.use_v1=true)
else
  ENTRY=(python -m icefloe.integrations.verl.launch)
  SEAM_ARGS=(actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8)
fi

export VERL_USE_EXTERNAL_MODULES=icefloe.integrations.verl

"${ENTRY[@]}" \
  "hydra.searchpath=[file://${ICEFLOE_CONFIG_DIR}]" \
  remote_backend.backend="${BACKEND}" \
  remote_backend.training_gpus=1 \
  remote_backend.sampling_gpus=1 \
  remote_backend.dtype=bfloat16 \
  "${SEAM_ARGS[@]}" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=false \
  data.train_files="${DATA_DIR}/train.parquet" \
  data.val_files="${DATA_DIR}/test.parquet" \
  data.train_batch_size=16 \
  data.max_prompt_length=512 \
  data.max_response_length=1024 \
  actor_rollout_ref.model.path="${MODEL}" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 \
  actor_rollout_ref.actor.ppo_epochs=1 \
  actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.rollout.name=icefloe \
  actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.rollout.calculate_log_probs=false \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.total_epochs=1 \
  trainer.total_training_steps=40 \
  trainer.logger='["console"]' \
  "$@"
