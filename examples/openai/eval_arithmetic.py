"""Train the demo's arithmetic task briefly on ``icefloe serve``, then evaluate the base model and the
checkpoint through its OpenAI-compatible endpoint with the ``openai`` SDK.

Training is the demo's warm-up (:mod:`icefloe.recipes.grpo`): supervised steps on right answers, the
full weights of ``tiny:arith``, through the training API (icefloe's remote client); the checkpoint it
saves is then a model the endpoint serves, ``<job_id>/<checkpoint_id>``. Evaluation asks every
problem ``a+b=`` of the task (operands 0..9) once, greedily; a completion scores when it spells the
sum and stops by itself (the demo's reward).

    icefloe serve &                 # auth off; with tokens, pass one as --api-key
    python examples/openai/eval_arithmetic.py --base-url http://127.0.0.1:8321 [--steps 60]
"""

from __future__ import annotations

import argparse

import openai

from icefloe.client import Client, build_batch
from icefloe.recipes.tasks import ArithmeticTask

BASE_MODEL = "tiny:arith"


def train(base_url: str, api_key: str | None, *, steps: int, batch_size: int = 64, lr: float = 5e-3) -> str:
    """``steps`` supervised steps on the task through the training API; returns the saved checkpoint
    as the endpoint names it, ``<job_id>/<checkpoint_id>``."""
    backend = {"type": "remote", "base_url": base_url, **({"pat": api_key} if api_key else {})}
    task = ArithmeticTask(seed=0)
    with Client({"model": BASE_MODEL, "backend": backend}) as client:
        tokenizer = client.tokenizer
        for _ in range(steps):
            problems_P = task.sample(batch_size)
            prompts_P = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems_P]
            answers_P = [
                [*tokenizer.encode(p.answer, add_special_tokens=False), tokenizer.eos_token_id] for p in problems_P
            ]
            client.fwd_bwd(build_batch(prompts_P, answers_P, pad_id=tokenizer.pad_token_id, loss_fn="cross_entropy"))
            client.step(learning_rate=lr)
        saved = client.save_checkpoint("weights-only")
        job_id = client.handle()["transport"]["job_id"]
    return f"{job_id}/{saved['checkpoint_id']}"


def evaluate(client: openai.OpenAI, model: str, *, max_tokens: int = 4) -> float:
    """The share of the task's problems ``model`` answers exactly."""
    problems = ArithmeticTask(seed=0).all_problems()
    answer = client.completions.create(
        model=model, prompt=[p.prompt for p in problems], max_tokens=max_tokens, temperature=0.0
    )
    rewards = [
        ArithmeticTask.reward(choice.text, choice.finish_reason, problem)
        for problem, choice in zip(problems, answer.choices, strict=True)
    ]
    return sum(rewards) / len(rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8321", help="the service (its /oai/v1 is used)")
    parser.add_argument("--api-key", default=None, help="the service's token (none when it runs without auth)")
    parser.add_argument("--steps", type=int, default=60, help="supervised steps (the demo's warm-up has 60)")
    args = parser.parse_args()
    base_url = args.base_url.rstrip("/")
    checkpoint = train(base_url, args.api_key, steps=args.steps)
    with openai.OpenAI(base_url=f"{base_url}/oai/v1", api_key=args.api_key or "none") as client:
        for model in (BASE_MODEL, checkpoint):
            print(f"model={model} accuracy={evaluate(client, model):.3f}")


if __name__ == "__main__":
    main()
