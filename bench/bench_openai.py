"""The same sampling through the OpenAI-compatible endpoint (``openai`` SDK) vs the Tinker SDK's ``sample``.

Both drive one ``icefloe serve`` subprocess (the tiny chat model, exported to a folder both load).
A round: ``--prompts`` prompts of ``--max-tokens`` tokens each (EOS ignored, so every sample has
exactly that many), sent at once by each side: the Tinker SDK as one ``sample`` future per prompt,
the ``openai`` SDK as one ``/completions`` request per prompt, concurrently (as an eval harness
sends them), or with ``--batched`` as one request holding every prompt. Rounds run ``--rounds``
times, the side that goes first alternating, after ``--warmup`` rounds not counted; ``ratio`` =
median endpoint round / median Tinker round. Then ``--clients`` streaming clients at once, each
asking for ``--stream-tokens`` tokens: time to first token (the first event with text) and to the
whole answer, p50; text streams as it is decoded, so the first comes long before the whole.

    python -m bench openai [--rounds 10] [--warmup 2] [--prompts 64] [--max-tokens 16] [--clients 8]
                           [--stream-tokens 128] [--batched]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, serve

API_KEY = "tml-bench"  # the SDKs want a key; the service runs without auth here


class _TinkerSide:
    def __init__(self, base_url: str, model: str, args: argparse.Namespace) -> None:
        import tinker
        from tinker import types

        self.types, self.args = types, args
        self.service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        self.sampler = self.service.create_sampling_client(base_model=model).result()

    def round(self, prompts: list[list[int]]) -> None:
        types = self.types
        params = types.SamplingParams(max_tokens=self.args.max_tokens, temperature=1.0, stop=[])  # no EOS stop
        futures = [self.sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
        lengths = [len(f.result().sequences[0].tokens) for f in futures]
        assert lengths == [self.args.max_tokens] * len(prompts), lengths

    def close(self) -> None:
        self.service.close("success").result()


class _OpenAISide:
    def __init__(self, base_url: str, model: str, args: argparse.Namespace) -> None:
        import openai

        self.args, self.model = args, model
        self.client = openai.AsyncOpenAI(base_url=f"{base_url}/oai/v1", api_key=API_KEY, max_retries=0)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._complete([1]))  # loads the model: its sampling job starts here

    def round(self, prompts: list[list[int]]) -> None:
        tokens = self.loop.run_until_complete(self._round(prompts))
        assert tokens == self.args.max_tokens * len(prompts), tokens

    async def _round(self, prompts: list[list[int]]) -> int:
        """Tokens sampled in all."""
        if self.args.batched:
            return (await self._complete(prompts)).usage.completion_tokens
        answers = await asyncio.gather(*(self._complete(p) for p in prompts))
        return sum(answer.usage.completion_tokens for answer in answers)

    async def _complete(self, prompt: list[int] | list[list[int]]):
        return await self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=self.args.max_tokens, temperature=1.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    def streamed(self, prompts: list[list[int]]) -> list[tuple[float, float]]:
        """Seconds to the first event with text and to the stream's end, for each of ``prompts`` streamed at once."""
        return self.loop.run_until_complete(self._streamed(prompts))

    async def _streamed(self, prompts: list[list[int]]) -> list[tuple[float, float]]:
        return list(await asyncio.gather(*(self._stream_one(p) for p in prompts)))

    async def _stream_one(self, prompt: list[int]) -> tuple[float, float]:
        started = time.perf_counter()
        first = None
        stream = await self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=self.args.stream_tokens, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async with stream:
            async for chunk in stream:
                if first is None and any(choice.text for choice in chunk.choices):
                    first = time.perf_counter() - started
        assert first is not None
        return first, time.perf_counter() - started

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())  # the streams' generators, closed here
        self.loop.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench openai", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens each streaming client asks for")
    parser.add_argument("--batched", action="store_true", help="the endpoint gets all prompts in one request")
    smoke = {"rounds": 1, "warmup": 0, "prompts": 4, "max_tokens": 4, "clients": 2, "stream_tokens": 8}
    args = parse_args(parser, argv, smoke=smoke)
    if args.rounds < 1 or args.warmup < 0 or args.clients < 1 or args.stream_tokens < 1:
        parser.error("--rounds, --clients and --stream-tokens must be >= 1 and --warmup >= 0")

    from icefloe.cli import _quiet_transformers
    from icefloe.engines.models import load_tokenizer, resolve_model

    _quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        model = str(Path(tmp) / "models" / "tiny-chat")
        shutil.copytree(resolve_model("tiny:chat"), model)
        tokenizer = load_tokenizer(model)
        prompts = [tokenizer.encode(f"Q: {i} + {i + 3} = ?\nA:") for i in range(args.prompts)]
        with serve(Path(tmp) / "serve", "--model-root", str(Path(tmp) / "models")) as base_url:
            sides = {"tinker": _TinkerSide(base_url, model, args), "openai": _OpenAISide(base_url, "tiny-chat", args)}
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            try:
                for round_ in range(args.warmup + args.rounds):
                    for name in sorted(sides, reverse=round_ % 2 == 1):  # who goes first alternates
                        started = time.perf_counter()
                        sides[name].round(prompts)
                        if round_ >= args.warmup:
                            seconds[name].append(time.perf_counter() - started)
                streaming = sides["openai"]
                assert isinstance(streaming, _OpenAISide)
                streamed = [s for _ in range(args.rounds) for s in streaming.streamed(prompts[: args.clients])]
            finally:
                for side in sides.values():
                    side.close()
    median = {name: statistics.median(times) for name, times in seconds.items()}
    table = Table(
        "client", "median round (s)", "min (s)", "max (s)", title=f"{args.prompts} prompts x {args.max_tokens} tokens"
    )
    for name, times in seconds.items():
        table.add_row(name, f"{median[name]:.3f}", f"{min(times):.3f}", f"{max(times):.3f}")
    Console().print(table)
    ttft, whole = (statistics.median(times) for times in zip(*streamed, strict=True))
    print(
        f"{args.clients} streaming clients at once, {args.stream_tokens} tokens each: "
        f"time to first token p50 {ttft:.3f} s, to the whole answer p50 {whole:.3f} s"
    )
    ratio = median["openai"] / median["tinker"]
    finish(
        args,
        f"bench=openai ratio={ratio:.2f} openai_round_s={median['openai']:.3f} tinker_round_s={median['tinker']:.3f} "
        f"ttft_p50_s={ttft:.3f} stream_whole_p50_s={whole:.3f} stream_tokens={args.stream_tokens} "
        f"prompts={args.prompts} max_tokens={args.max_tokens} clients={args.clients} "
        f"rounds={args.rounds} warmup={args.warmup} batched={int(args.batched)}",
    )
