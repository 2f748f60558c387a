"""Evaluate a model on the demo's arithmetic task through the OpenAI-compatible endpoint of ``icefloe serve``.

Every problem ``a+b=`` of the task (operands 0..9) is asked once, greedily, with the ``openai`` SDK;
a completion scores when it spells the sum and stops by itself (the demo's reward). ``--model`` is any
form the endpoint takes: ``tiny:arith`` (the untrained demo model), a training-API checkpoint
``<job_id>/<checkpoint_id>`` (``icefloe checkpoints JOB`` lists a job's), or a Tinker sampler path.

    python examples/openai/eval_arithmetic.py --base-url http://127.0.0.1:8321 --model tiny:arith
"""

from __future__ import annotations

import argparse

import openai

from icefloe.recipes.tasks import ArithmeticTask


def evaluate(client: openai.OpenAI, model: str, *, max_tokens: int = 4) -> float:
    """The share of the task's problems the model answers exactly."""
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
    parser.add_argument("--model", default="tiny:arith", help="a base model or a checkpoint")
    parser.add_argument("--api-key", default="none", help="the service's token (any word when it runs without auth)")
    args = parser.parse_args()
    with openai.OpenAI(base_url=f"{args.base_url.rstrip('/')}/oai/v1", api_key=args.api_key) as client:
        accuracy = evaluate(client, args.model)
    print(f"model={args.model} accuracy={accuracy:.3f}")


if __name__ == "__main__":
    main()
