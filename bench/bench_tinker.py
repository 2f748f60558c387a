"""One cookbook-style RL step through the Tinker SDK vs the same work through icefloe's own client.

Both drive one ``icefloe serve`` subprocess (the tiny chat model, exported to a folder both sides
load). A step: sync the trainer's weights to its sampler, sample ``--group`` completions for each
of ``--prompts`` prompts, score them, one importance-sampling forward-backward over every
completion, one Adam step. The SDK side uses ``save_weights_and_get_sampling_client``, ``sample``
futures, ``forward_backward`` and ``optim_step`` submitted back to back; icefloe's side uses
``sync_weights``, one ``generate``, ``fwd_bwd`` and ``step``. Rounds of one step each run
``--steps`` times, the side that goes first alternating, after ``--warmup`` rounds that are not
counted; ``ratio`` = median SDK step ÷ median icefloe step.

    python -m bench tinker [--steps 30] [--warmup 2] [--prompts 8] [--group 4] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, serve
from icefloe.client import Client, build_batch
from icefloe.config import ClientConfig

API_KEY = "tml-bench"  # the SDK wants a key; the service runs without auth here


def _reward(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _advantages(rewards: list[float], group: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean = sum(chunk) / len(chunk)
        out += [r - mean for r in chunk]
    return out


class _SdkSide:
    def __init__(self, base_url: str, model: str, args: argparse.Namespace) -> None:
        import tinker
        from tinker import types

        self.types, self.args = types, args
        self.service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        self.training = self.service.create_lora_training_client(base_model=model, rank=8).result()
        self.tokenizer = self.training.get_tokenizer()

    def step(self, prompts: list[list[int]]) -> None:
        types, group = self.types, self.args.group
        sampler = self.training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=self.args.max_tokens, temperature=1.0)
        futures = [sampler.sample(types.ModelInput.from_ints(p), group, params) for p in prompts]
        rows = [(p, seq) for p, f in zip(prompts, futures, strict=True) for seq in f.result().sequences]
        advantages = _advantages([_reward(self.tokenizer.decode(seq.tokens)) for _, seq in rows], group)
        data = []
        for (prompt, seq), advantage in zip(rows, advantages, strict=True):
            tokens = prompt + list(seq.tokens)
            padding = [0.0] * (len(prompt) - 1)
            inputs = {
                "target_tokens": tokens[1:],
                "logprobs": padding + list(seq.logprobs),
                "advantages": padding + [advantage] * len(seq.tokens),
            }
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
        backward = self.training.forward_backward(data, "importance_sampling")
        step = self.training.optim_step(types.AdamParams(learning_rate=1e-4))
        backward.result(), step.result()

    def close(self) -> None:
        self.service.close("success").result()


class _IcefloeSide:
    def __init__(self, base_url: str, model: str, args: argparse.Namespace) -> None:
        self.args = args
        # The SDK's LoRA (rank 8; the Tinker routes set alpha = rank), so both sides train the same adapters.
        lora = {"rank": 8, "alpha": 8}
        config = ClientConfig.build(model=model, lora=lora, backend={"type": "remote", "base_url": base_url})
        self.client = Client(config).open()

    def step(self, prompts: list[list[int]]) -> None:
        group = self.args.group
        self.client.sync_weights()
        params = {"n": group, "max_tokens": self.args.max_tokens, "temperature": 1.0, "logprobs": True}
        samples = self.client.generate(prompts, params)
        advantages = _advantages([_reward(s["text"]) for s in samples], group)
        prompt_rows = [p for p in prompts for _ in range(group)]
        batch = build_batch(
            prompt_rows, [s["token_ids"] for s in samples], advantages, pad_id=0, loss_fn="importance_sampling",
            old_logprobs=[s["logprobs"] for s in samples],
        )  # fmt: skip
        self.client.fwd_bwd(batch)
        self.client.step(1e-4)

    def close(self) -> None:
        self.client.shutdown()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tinker", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    smoke = {"steps": 1, "warmup": 0, "prompts": 2, "group": 2, "max_tokens": 4}
    args = parse_args(parser, argv, smoke=smoke)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0; got {args.steps} and {args.warmup}")

    from icefloe.cli import _quiet_transformers
    from icefloe.engines.models import load_tokenizer, resolve_model

    _quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as tmp:
        model = str(Path(tmp) / "models" / "tiny-chat")
        shutil.copytree(resolve_model("tiny:chat"), model)
        tokenizer = load_tokenizer(model)
        prompts = [tokenizer.encode(f"Q: {i} + {i + 3} = ?\nA:") for i in range(args.prompts)]
        with serve(Path(tmp) / "serve", "--model-root", str(Path(tmp) / "models")) as base_url:
            sides = {"sdk": _SdkSide(base_url, model, args), "icefloe": _IcefloeSide(base_url, model, args)}
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            try:
                for round_ in range(args.warmup + args.steps):
                    for name in sorted(sides, reverse=round_ % 2 == 1):  # who goes first alternates
                        started = time.perf_counter()
                        sides[name].step(prompts)
                        if round_ >= args.warmup:
                            seconds[name].append(time.perf_counter() - started)
            finally:
                for side in sides.values():
                    side.close()
    median = {name: statistics.median(times) for name, times in seconds.items()}
    table = Table("client", "median step (s)", "min (s)", "max (s)", title="one RL step on icefloe serve")
    for name, times in seconds.items():
        table.add_row(name, f"{median[name]:.3f}", f"{min(times):.3f}", f"{max(times):.3f}")
    Console().print(table)
    ratio = median["sdk"] / median["icefloe"]
    finish(
        args,
        f"bench=tinker ratio={ratio:.2f} sdk_step_s={median['sdk']:.3f} icefloe_step_s={median['icefloe']:.3f} "
        f"prompts={args.prompts} group={args.group} max_tokens={args.max_tokens} steps={args.steps} "
        f"warmup={args.warmup}",
    )
