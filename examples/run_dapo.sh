#!/usr/bin/env bash
# DAPO with token selection: verl's DAPO launch (the shape of verl's recipe/dapo scripts) plus ONE key,
# actor_rollout_ref.actor.token_selector, under `python -m verl_tokensel.main_ppo`.
#
#   TOKENSEL_MODEL_PATH=/models/Qwen3-8B-Base TOKENSEL_TRAIN_FILES=/data/dapo-math-17k.parquet \
#   TOKENSEL_VAL_FILES=/data/aime-2024.parquet TOKENSEL_SELECTOR=forking bash examples/run_dapo.sh [hydra overrides]
#
# DAPO (arXiv 2503.14476): GRPO advantages, no KL, clip-higher (0.2 / 0.28), token-mean loss, dynamic
# sampling (groups whose answers all score alike are dropped and refilled; verl's V1 driver, the default,
# does it) and the soft overlong penalty (verl's `dapo` reward manager). The size knobs below are
# environment variables with the 80/20 paper's DAPO values (Qwen3-8B/14B) as defaults; anything else is a
# Hydra override after the script's name, which wins over the script's value for the same key.
#
# Left out on purpose: the reward. verl's `dapo` manager scores with verl's default_compute_score for the
# rows' data_source (math_dapo for DAPO-Math-17k); other data needs
# reward.custom_reward_function.path=<your .py>. Logging: console + wandb, as verl's examples (log in
# through your environment; trainer.logger='[console]' without it).
#
# Other presets: TOKENSEL_SELECTOR=none (stock DAPO, the baseline), forking_paper, gmts, random, ...
# (`verl-tokensel env` lists them; README "Presets"). Your own preset: examples/custom_preset.py.
# On CPU (a tiny model, for debugging): add trainer.device=cpu; tests/test_examples_on_cpu.py runs this
# script that way for one step.
set -euo pipefail

missing=0
require() {
    if [ -z "${!1:-}" ]; then
        echo "error: environment variable $1 is not set; it must point to $2 (see the top of $0)" >&2
        missing=1
    fi
}
require TOKENSEL_MODEL_PATH "the HF model directory, e.g. a local copy of Qwen/Qwen3-8B-Base"
require TOKENSEL_TRAIN_FILES "the training parquet file(s), e.g. /data/dapo-math-17k.parquet"
require TOKENSEL_VAL_FILES "the validation parquet file(s), e.g. /data/aime-2024.parquet"
[ "$missing" -eq 0 ] || exit 2

# the one key this package adds to verl's DAPO command
selector=${TOKENSEL_SELECTOR:-forking}

# cluster
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

# batch: prompts per step, answers per prompt, prompts per PPO mini-batch (512 x 16, 32: 16 updates a step)
train_prompt_bsz=${TRAIN_PROMPT_BSZ:-512}
n_resp_per_prompt=${N_RESP_PER_PROMPT:-16}
train_prompt_mini_bsz=${TRAIN_PROMPT_MINI_BSZ:-32}

# lengths: the last overlong_buffer_len tokens of a response are penalised linearly up to -1
max_prompt_length=${MAX_PROMPT_LENGTH:-2048}
max_response_length=${MAX_RESPONSE_LENGTH:-20480}
overlong_buffer_len=${OVERLONG_BUFFER_LEN:-4096}

# parallelism: Ulysses sequence parallel size of the update, vLLM tensor parallel size of the rollout
# (the layout of recipes' dapo_qwen3_8b; 14B: SP_SIZE=8 GEN_TP=4)
sp_size=${SP_SIZE:-4}
gen_tp=${GEN_TP:-2}
offload=${OFFLOAD:-False}

# tokens per GPU per micro-batch (dynamic batch size): one whole sequence for the update, two for the
# no-grad log-prob passes
actor_ppo_max_token_len=$(( max_prompt_length + max_response_length ))
infer_ppo_max_token_len=$(( actor_ppo_max_token_len * 2 ))

total_training_steps=${TOTAL_TRAINING_STEPS:-null}   # null: total_epochs over the data
project_name=${PROJECT_NAME:-tokensel_dapo}
exp_name=${EXP_NAME:-dapo_${selector}}
ckpts_dir=${CKPTS_DIR:-checkpoints/${project_name}/${exp_name}}

"${TOKENSEL_PYTHON:-python3}" -m verl_tokensel.main_ppo \
    actor_rollout_ref.actor.token_selector="${selector}" \
    data.train_files="${TOKENSEL_TRAIN_FILES}" \
    data.val_files="${TOKENSEL_VAL_FILES}" \
    data.prompt_key=prompt \
    data.truncation=left \
    data.filter_overlong_prompts=True \
    data.max_prompt_length="${max_prompt_length}" \
    data.max_response_length="${max_response_length}" \
    data.train_batch_size="${train_prompt_bsz}" \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.kl_ctrl.kl_coef=0.0 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    reward.reward_manager.name=dapo \
    +reward.reward_kwargs.max_resp_len="${max_response_length}" \
    +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward.reward_kwargs.overlong_buffer_cfg.len="${overlong_buffer_len}" \
    +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward.reward_kwargs.overlong_buffer_cfg.log=False \
    actor_rollout_ref.model.path="${TOKENSEL_MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.ppo_mini_batch_size="${train_prompt_mini_bsz}" \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${actor_ppo_max_token_len}" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.optim.clip_grad=1.0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size="${sp_size}" \
    actor_rollout_ref.actor.fsdp_config.param_offload="${offload}" \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload="${offload}" \
    actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size="${sp_size}" \
    actor_rollout_ref.ref.fsdp_config.param_offload="${offload}" \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="${infer_ppo_max_token_len}" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n="${n_resp_per_prompt}" \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.tensor_model_parallel_size="${gen_tp}" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=$(( max_prompt_length + max_response_length )) \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${infer_ppo_max_token_len}" \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${exp_name}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NGPUS_PER_NODE}" \
    trainer.val_before_train=True \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=100 \
    trainer.total_training_steps="${total_training_steps}" \
    trainer.default_local_dir="${ckpts_dir}" \
    trainer.resume_mode=auto \
    "$@"
