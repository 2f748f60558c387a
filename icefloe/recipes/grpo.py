"""GRPO on the arithmetic task through the public client API: what ``icefloe demo`` runs.

Each step samples ``group_size`` completions for each of ``problems_per_step`` prompts, scores
them, turns each group's rewards into advantages (mean-centred, then divided by the group's std
unless ``norm_adv_by_std`` is off: Dr.GRPO), and trains on them with ``fwd_bwd`` + ``step``
submitted back to back, then syncs the sampler; the next step's samples are asked for right after
the sync (they queue behind it), so no round trip separates two steps. Lists are named by what they index: ``_P``
problems, ``_G`` members of one group, ``_R`` flat rows.

A tiny model from random weights almost never writes a correct sum, so every reward is 0 and GRPO
has nothing to push up (alone it stalls near 0.1 over 400 steps). A short supervised warm-up
(``warmup_steps``, the ``cross_entropy`` loss on right answers) first teaches the answer format
and about half the sums, leaving the reward near 0.5; the reward reported per step is that of the
RL steps only.

Why some seeds used to stall (seeds 0-4 ended at 0.98, 0.92, 0.92, 0.80, 0.72): learning is all or
nothing per answer class. A group whose members are all wrong has zero advantages and teaches
nothing, so a sum whose right answer the policy stops sampling is never learned again. On the
stalled seeds whole classes sat at exactly 0 for the last 20 steps (seed 4: the sums 0, 1, 10, 11,
16, 17, 18, all answered "12", "2" or "14"), while every other class was near 1. Two things put
them there: problems drawn with replacement left rare ones (``0+0``, ``9+9``) unseen for steps while
their neighbours' updates moved the shared output digits; and each RL step's eight optimizer steps
on the same samples, inside a 0.2 clip range, moved those digits far enough to erase a class that
the warm-up had taught (a 35-step warm-up lost every sum ending in 0-4 on seed 1). So each step
deals every problem once (8 samples each), the clip range is 0.1 (halving the optimizer steps
works as well), and a warm-up teaches the final digits before RL starts. Later seeds 3, 5 and 7
stalled near 0.5 in turn: their warm-up, at a learning rate of 1e-2, had diverged for a few steps
and left a model that scored 0.05 where the others scored 0.2, and RL from there lost half the
classes. At 5e-3 the warm-up ends at the same loss on every seed, and seeds 0-9 ended between 0.75
and 0.99, seven above 0.9: seed 3 (0.75) still lost classes early (its reward fell from 0.23 to
0.17 in the first 40 RL steps) and relearned them too slowly for 200 steps. Three changes fixed it,
each measured on the weak seeds first: a 60-step warm-up (from 25) leaves far fewer classes for RL
to find (seed 3 alone: 0.99), four optimizer steps per RL step (from 8) move the shared digits
half as far per batch of samples, and an RL rate of 1.5e-3 (from 2.5e-3) stopped seed 8 from
losing a tenth of its classes after it had reached 0.9. Now every seed ends between 0.96 and 1.00
(``tests/recipes/golden/demo_curves.json`` holds each full run's end; CI checks a short run of each
seed against its recorded curve).

With ``lora_rank`` > 0 RL trains LoRA adapters only. Adapters alone cannot teach this random
model the answer format (the supervised loss stalls), so the warm-up still trains the full weights
on a client of its own, saves them as a Hugging Face folder, and RL starts from that folder.
Seed 0 at rank 8: the first RL step scores 0.56, the last ten 0.99.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from icefloe.protocol import ConfigError
from icefloe.recipes.tasks import ArithmeticTask, Problem
from icefloe.recipes.trackers import TrackerName, open_trackers

__all__ = ["GRPOConfig", "group_advantages", "main", "run", "summarize"]

_CLIENT_METRICS = ("reward", "response_len", "groups_with_signal")  # what only the client knows, for the service


class GRPOConfig(BaseModel):
    """Everything one run reads; the defaults are the demo (seed 0: reward 0.63 → 1.00 in 200 steps)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "demo"  # the run folder: <out_dir>/<name>/
    out_dir: Path = Path("runs")
    trackers: list[TrackerName] = ["jsonl"]  # where per-step metrics go: jsonl, tensorboard, wandb, mlflow
    seed: int = 0  # seeds the model weights, the problems, the sampler and minibatch order
    model: str = "tiny:arith"
    backend: Literal["local", "ray", "remote"] = "local"  # ray: a running Ray, else a local one; remote: below
    base_url: str | None = None  # remote: the service's URL; None = ICEFLOE_REMOTE_* from the environment
    steps: int = Field(200, gt=0)  # RL steps (each: generate, train, sync)
    problems_per_step: int = Field(100, gt=0)  # 100 = every problem of the table once per step
    group_size: int = Field(8, gt=1)  # samples per problem; advantages are relative within a group
    max_tokens: int = Field(3, gt=0)  # the longest answer (two digits) plus EOS
    temperature: float = Field(1.0, gt=0)
    lr: float = Field(1.5e-3, gt=0)
    lr_schedule: Literal["constant", "cosine"] = "cosine"  # cosine decays to min_lr_ratio·lr by the last step
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    num_minibatches: int = Field(4, gt=0)  # optimizer steps per RL step, each on a slice of the groups
    # PPO's trust region per RL step: 0.2 let the 8 optimizer steps on one step's samples wipe out a whole
    # answer class (every sum ending in 2, say) on some seeds, and a class never sampled right is never relearned.
    eps_clip: float = Field(0.1, gt=0)
    eps_clip_higher: float = Field(0.1, gt=0)  # upper clip; above eps_clip lets rare right answers rise faster
    entropy_coeff: float = Field(0.1, ge=0)  # at step 1, falling linearly to 0 at the last step
    warmup_steps: int = Field(60, ge=0)  # supervised steps before RL (full weights, also before LoRA RL); 0 = none
    warmup_batch_size: int = Field(64, gt=0)
    # 1e-2 was unstable on some seeds (seed 5's loss jumped to 3.4 mid warm-up and ended at 1.5, where
    # others ended near 0.75), and RL from such a start stalled near 0.5; at 5e-3 every seed ends near 0.8.
    warmup_lr: float = Field(5e-3, gt=0)
    max_operand: int = Field(9, ge=1)  # problems are a+b with a, b in 0..max_operand
    eps: float = Field(1e-6, gt=0)  # added to a group's std before dividing
    # False: Dr.GRPO, advantages only mean-centred (verl's algorithm.norm_adv_by_std_in_grpo=False).
    norm_adv_by_std: bool = True
    lora_rank: int = Field(0, ge=0)  # 0 = RL trains the full weights; > 0 = LoRA adapters of this rank
    lora_alpha: int = Field(0, ge=0)  # 0 = 4 × lora_rank
    # RL with LoRA: adapters start at zero and take a larger rate and twice the optimizer steps per RL step
    # (with the full-weight demo's 1.5e-3 and 4 steps seed 0 ended at 0.90). After a 22-step warm-up, 5e-3
    # ended at 0.98 on two threads but 0.77 on one; after the 60-step one, 3e-3 ends at 0.99 on either.
    lora_lr: float = Field(3e-3, gt=0)
    lora_num_minibatches: int = Field(8, gt=0)
    # The output layer too: with its (tied, frozen) embeddings this tiny model cannot make confident answers.
    lora_target_modules: list[str] | Literal["all-linear"] = [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
    ]  # fmt: skip


def group_advantages(rewards_G: Sequence[float], *, eps: float = 1e-6, norm_by_std: bool = True) -> list[float]:
    """Mean-centred rewards of one group, divided by the group's std (+ ``eps``) when ``norm_by_std``.

    ``norm_by_std=False`` is Dr.GRPO (verl's ``norm_adv_by_std_in_grpo=False``). All zeros when
    every member scored the same.
    """
    mean = sum(rewards_G) / len(rewards_G)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / max(len(rewards_G) - 1, 1))
    if std == 0.0:
        return [0.0] * len(rewards_G)
    return [(r - mean) / (std + eps) if norm_by_std else r - mean for r in rewards_G]


def main(config: GRPOConfig) -> list[dict[str, Any]]:
    """Run the recipe to the end; returns the per-step metrics also written to ``metrics.jsonl``."""
    return asyncio.run(run(config))


async def run(config: GRPOConfig, *, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Warm up, run ``config.steps`` GRPO steps, write metrics and the reward plot; ``on_step`` sees each row.

    Raises:
        ConfigError: the run folder ``<out_dir>/<name>`` already holds files (a run's outputs).
    """
    from icefloe.client import AsyncClient
    from icefloe.client.batch import build_batch
    from icefloe.config import ClientConfig
    from icefloe.protocol import SamplingParams

    run_dir = config.out_dir / config.name
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise ConfigError(f"name: the run folder {run_dir} already holds a run; pick another name or delete the folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(config.seed, max_operand=config.max_operand)
    shuffler = random.Random(config.seed + 1)
    lora = None
    if config.lora_rank:
        alpha = config.lora_alpha or 4 * config.lora_rank
        lora = {"rank": config.lora_rank, "alpha": alpha, "target_modules": config.lora_target_modules}
    lr = config.lora_lr if lora else config.lr  # the last lr the trainer reported
    minibatches = config.lora_num_minibatches if lora else config.num_minibatches

    def client_config(model: str, *, warm_up_only: bool = False) -> ClientConfig:
        rl_updates = 0 if warm_up_only else config.steps * minibatches
        checkpoints = run_dir / ("warm-up" if warm_up_only else "checkpoints")
        warm_up_here = config.warmup_steps if warm_up_only or not lora else 0
        return ClientConfig.from_env(
            model=model,
            seed=config.seed,
            max_seq_len=64,
            lora=None if warm_up_only else lora,
            num_sampling_workers=0 if warm_up_only else 1,
            training={
                "optimizer": {"lr": lr},
                "lr_schedule": {
                    "kind": config.lr_schedule,
                    "total_steps": max(1, warm_up_here + rl_updates),  # the optimizer steps this client takes
                    "min_lr_ratio": config.min_lr_ratio,
                },
                # The service keeps a remote job's checkpoints itself: only the other backends write here.
                **({} if config.backend == "remote" else {"checkpoint_dir": str(checkpoints)}),
            },
            sampling={"max_batch_size": config.problems_per_step * config.group_size},
            backend={"type": config.backend, **({"base_url": config.base_url} if config.base_url else {})},
        )

    sampling = SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, n=config.group_size, logprobs=True
    )
    history: list[dict[str, Any]] = []
    config_record = config.model_dump(mode="json")
    with open_trackers(config.trackers, run_dir, run_name=config.name, config=config_record) as tracker:
        model = config.model
        if lora and config.warmup_steps:
            # Adapters alone cannot teach a random tiny model the answer format (the loss stalls), so the
            # warm-up trains the full weights and RL then trains adapters on top of the warmed-up model.
            async with AsyncClient(client_config(model, warm_up_only=True)) as client:
                await _warm_up(client, task, config)
                model = (await client.save_checkpoint("weights-only"))["path"]
        async with AsyncClient(client_config(model)) as client:
            tokenizer = client.tokenizer
            pad_id = tokenizer.pad_token_id

            def encode(problems_P: Sequence[Problem]) -> list[list[int]]:
                return [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems_P]

            if config.warmup_steps and not lora:
                await _warm_up(client, task, config)
                await client.sync_weights()

            def sample_next() -> tuple[list[Problem], list[list[int]], asyncio.Future[list[dict[str, Any]]]]:
                problems_P = task.sample(config.problems_per_step)
                prompt_ids_P = encode(problems_P)
                return problems_P, prompt_ids_P, client.generate(prompt_ids_P, sampling)

            upcoming = sample_next()
            reported: asyncio.Future[None] | None = None  # the last step's metric report, in flight
            for step in range(1, config.steps + 1):
                started = time.perf_counter()
                # --- sample a group per problem and score it ----------------------------------------
                problems_P, prompt_ids_P, generated = upcoming
                samples = await generated
                samples_P_G = [samples[i : i + config.group_size] for i in range(0, len(samples), config.group_size)]
                rewards_P_G = [
                    [task.reward(_completion_text(tokenizer, s), s["finish_reason"], problem) for s in group]
                    for problem, group in zip(problems_P, samples_P_G, strict=True)
                ]

                # --- advantages; groups where every member scored the same teach nothing ----------
                advantages_P_G = [
                    group_advantages(r, eps=config.eps, norm_by_std=config.norm_adv_by_std) for r in rewards_P_G
                ]
                useful_P = [p for p, adv_G in enumerate(advantages_P_G) if any(adv_G)]
                shuffler.shuffle(useful_P)

                # --- train: fwd_bwd and step back to back, one optimizer step per minibatch --------
                # A large entropy bonus early keeps a group from collapsing onto one wrong answer (then
                # no member is ever right and the group teaches nothing); it fades so the policy can sharpen.
                entropy_coeff = config.entropy_coeff * (1 - (step - 1) / config.steps)
                loss_config = {
                    "eps_clip": config.eps_clip,
                    "eps_clip_higher": config.eps_clip_higher,
                    "entropy_coeff": entropy_coeff,
                }
                # Every minibatch's fwd_bwd and step are submitted as soon as it is built, before any is
                # awaited: the trainer runs them in call order and works while the rest are built.
                pending = []
                for chunk_P in _split(useful_P, minibatches):
                    rows_R = [(p, g) for p in chunk_P for g in range(config.group_size)]
                    batch = build_batch(
                        [prompt_ids_P[p] for p, _ in rows_R],
                        [samples_P_G[p][g]["token_ids"] for p, g in rows_R],
                        [advantages_P_G[p][g] for p, g in rows_R],
                        pad_id=pad_id,
                        loss_fn="grpo",
                        loss_config=loss_config,
                        old_logprobs=[samples_P_G[p][g]["logprobs"] for p, g in rows_R],
                    )
                    pending += [client.fwd_bwd(batch), client.step()]  # sent now, while the next is built
                synced_future = client.sync_weights()
                if step < config.steps:
                    # The next step's samples are asked for now: they queue behind the weight sync, so they
                    # come from the weights trained here, and no round trip sits between this step and the next.
                    upcoming = sample_next()
                results = await asyncio.gather(*pending)
                synced = await synced_future
                losses = [trained["loss"] for trained in results[0::2]]
                grad_norms = [optimized["grad_norm"] for optimized in results[1::2]]
                if results:
                    lr = results[-1]["lr"]

                # --- record -----------------------------------------------------------------------
                row = {
                    "step": step,
                    "reward": _mean([r for rewards_G in rewards_P_G for r in rewards_G]),
                    "loss": _mean(losses),
                    "grad_norm": _mean(grad_norms),
                    "lr": lr,
                    "policy_version": synced["policy_version"],
                    "response_len": _mean([len(s["token_ids"]) for s in samples]),
                    "groups_with_signal": len(useful_P),
                    "seconds": time.perf_counter() - started,
                }
                history.append(row)
                tracker.log({key: value for key, value in row.items() if key != "step"}, step)
                # The service keeps what only the client knows, filed under the trainer's global_step after
                # this RL step (the number of its own points), so reward lines up with loss.
                optimizer_step = results[-1]["global_step"] if results else config.warmup_steps + step
                if reported is not None:
                    await reported
                metrics = {key: row[key] for key in _CLIENT_METRICS}
                reported = asyncio.ensure_future(client.log_metrics(metrics, step=max(0, optimizer_step)))
                if on_step is not None:
                    on_step(row)
            if reported is not None:
                await reported
    plot_rewards(history, run_dir / "reward.png", title=f"GRPO on {config.model} (seed {config.seed})")
    return history


async def _warm_up(client: Any, task: ArithmeticTask, config: GRPOConfig) -> None:
    """Supervised steps on correct answers (cross-entropy), before RL."""
    from icefloe.client.batch import build_batch

    tokenizer = client.tokenizer
    eos_id = tokenizer.eos_token_id
    for _ in range(config.warmup_steps):
        problems_P = task.sample(config.warmup_batch_size)
        prompts_P = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems_P]
        answers_P = [[*tokenizer.encode(p.answer, add_special_tokens=False), eos_id] for p in problems_P]
        batch = build_batch(prompts_P, answers_P, None, pad_id=tokenizer.pad_token_id, loss_fn="cross_entropy")
        pending = asyncio.ensure_future(client.fwd_bwd(batch))
        stepped = asyncio.ensure_future(client.step(learning_rate=config.warmup_lr))
        await pending, await stepped


def summarize(history: Sequence[dict[str, Any]], window: int = 10) -> tuple[float, float]:
    """Mean reward of the first and of the last ``window`` steps (fewer when the run is shorter)."""
    rewards = [row["reward"] for row in history]
    return _mean(rewards[:window]), _mean(rewards[-window:])


def plot_rewards(history: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """Reward per step and its 10-step running mean, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede the pyplot import
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in history]
    rewards = [row["reward"] for row in history]
    smooth = [_mean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(steps, rewards, alpha=0.35, label="reward")
    axes.plot(steps, smooth, label="mean of last 10")
    axes.set(xlabel="RL step", ylabel="reward (exact match)", ylim=(-0.02, 1.02), title=title)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _completion_text(tokenizer: Any, sample: dict[str, Any]) -> str:
    """The completion with special tokens spelled out, so a stray pad or BOS inside an answer cannot match."""
    token_ids = sample["token_ids"]
    if sample["finish_reason"] == "stop" and token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in at most ``parts`` contiguous, non-empty slices of near-equal size."""
    parts = min(parts, len(items))
    return [items[i * len(items) // parts : (i + 1) * len(items) // parts] for i in range(parts)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
