"""``POST /completions``, ``POST /chat/completions``, ``GET /models``: OpenAI's schemas field for field.

A handler reads its body, checks the limits the Tinker API's samples obey (``--max-samples-per-request``,
``--max-tokens-per-request``, the model's context), loads the model (:mod:`.served`), turns the prompt
into tokens (the chat template for chat), queues the sampling (:mod:`.sampling`) and answers once it
is done, or as server-sent events (:mod:`.stream`). Each bound is checked from the cheapest evidence
first: the count of prompts before the model is loaded, a text's characters before it is tokenized
(:attr:`Base.max_text_chars`), its tokens after; a large prompt is tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from icefloe.protocol import SamplingParams
from icefloe.service.limits import CHECK_ON_LOOP_BYTES
from icefloe.service.middleware import tenant_of
from icefloe.service.openai import sampling
from icefloe.service.openai.chat import prompt_tokens, template_messages
from icefloe.service.openai.errors import FieldError, ModelNotFound
from icefloe.service.openai.schemas import ChatRequest, CompletionRequest, Prompts, prompt_list
from icefloe.service.openai.served import Base, Loaded
from icefloe.service.openai.stream import EventStream, until_done
from icefloe.service.routes import DenseJsonRoute

__all__ = ["router"]

_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /completions; chat samples until a stop or the context's end
_Made = TypeVar("_Made")

router = APIRouter(route_class=DenseJsonRoute)  # a large body's number arrays: machine numbers


@dataclass
class _Context:
    """What a handler needs of the service: the app's state, seen from the mounted sub-app."""

    loaded: Loaded
    request: Request

    @property
    def manager(self) -> Any:
        return self.loaded.manager

    @property
    def tenant(self) -> str:
        return tenant_of(self.request.scope)


async def _context(request: Request) -> _Context:
    return _Context(request.app.state.openai, request)


Ctx = Annotated[_Context, Depends(_context)]


@dataclass
class _Token:
    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None = None


@dataclass
class _Choice:
    """One choice as far as it got: its text, its tokens (with log-probs when asked) and how it ended."""

    text: str = ""
    tokens: list[_Token] = field(default_factory=list)
    finish_reason: str | None = None


# --- models ----------------------------------------------------------------------------------------
@router.get("/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    return {"object": "list", "data": ctx.loaded.listing(ctx.tenant)}


@router.get("/models/{model:path}")
async def get_model(model: str, ctx: Ctx) -> dict[str, Any]:
    for entry in ctx.loaded.listing(ctx.tenant):
        if entry["id"] == model:
            return entry
    raise ModelNotFound(f"model {model!r} not found; GET /models lists the base models and your checkpoints")


# --- completions -----------------------------------------------------------------------------------
@router.post("/completions")
async def completions(body: CompletionRequest, ctx: Ctx) -> Response:
    body.refuse_unserved()
    given = prompt_list(body.prompt)
    if body.max_tokens == 0 and not body.echo:
        raise FieldError("max_tokens", "max_tokens 0 samples nothing; it is allowed only with echo (to score a prompt)")
    _check_samples(ctx, body.n, len(given))
    served, job = await ctx.loaded.served(body.model, ctx.tenant)
    tokenizer = served.base.tokenizer
    scoring_only = body.max_tokens == 0  # echo's prompt log-probs: one token is sampled and dropped
    max_tokens = _COMPLETION_MAX_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
    for index, prompt in enumerate(given):
        if isinstance(prompt, str):
            _check_text_fits(served.base, "prompt" if len(given) == 1 else f"prompt[{index}]", "prompt", len(prompt))
        else:
            _check_context(served.base, len(prompt), max_tokens)
    prompts = await _off_loop_if_large(sum(map(len, given)), lambda: _token_prompts(given, tokenizer))
    k, scored = body.logprobs or 0, body.logprobs is not None
    params = [_params(body, max_tokens=max_tokens, logprobs=scored, top=k, echo=body.echo) for _ in prompts]
    _check_limits(ctx, prompts, params, served.base)
    ticket = sampling.sample(ctx.manager, job, ctx.tenant, prompts, params, streamed=body.stream)

    def choices(samples: list[dict[str, Any]]) -> list[_Choice]:
        made = []
        for index, sample in enumerate(samples):
            prompt = prompts[index // body.n]
            choice = _Choice() if scoring_only else _generated(tokenizer, sample, k if scored else None)
            if body.echo:
                choice.text = tokenizer.decode(prompt) + choice.text
                if scored:
                    choice.tokens = _echoed(tokenizer, prompt, sample, k) + choice.tokens
            choice.finish_reason = "length" if scoring_only else _finish_reason(sample)
            made.append(choice)
        return made

    def chunk(index: int, new: _Choice) -> dict[str, Any]:
        return {"index": index, "text": new.text, "logprobs": lp(new), "finish_reason": new.finish_reason}

    def lp(choice: _Choice) -> dict[str, Any] | None:
        return _completion_logprobs(choice) if scored else None

    answer = _Answer(ctx, body, ticket, "text_completion", prompts, choices, tokenizer, scoring_only=scoring_only)
    if body.stream:
        return answer.stream(chunk)
    samples = await answer.samples()
    listed = [chunk(i, c) for i, c in enumerate(choices(samples))]
    return JSONResponse(answer.envelope(listed, usage=answer.usage(samples)))


def _token_prompts(prompts: Prompts, tokenizer: Any) -> list[list[int]]:
    """Each prompt's token ids: a text tokenized, token ids checked against the vocabulary."""
    made = [list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]
    if any(not ids for ids in made):
        raise FieldError("prompt", "prompt is empty once tokenized; give text the model's tokenizer keeps")
    vocab = len(tokenizer)
    if any(min(ids) < 0 or max(ids) >= vocab for ids in made):
        raise FieldError("prompt", f"prompt holds token ids outside the model's vocabulary [0, {vocab})")
    return made


def _echoed(tokenizer: Any, prompt: list[int], sample: dict[str, Any], k: int) -> list[_Token]:
    """The prompt's tokens with their log-probs (the first has none), as echo shows them."""
    logprobs = sample.get("prompt_logprobs") or [None] * len(prompt)
    tops = sample.get("topk_prompt_logprobs") or [None] * len(prompt)
    return [
        _Token(tokenizer.decode([token]), logprob, _top(tokenizer, top, k) if logprob is not None else None)
        for token, logprob, top in zip(prompt, logprobs, tops, strict=True)
    ]


def _completion_logprobs(choice: _Choice) -> dict[str, Any]:
    offsets, at = [], 0
    for token in choice.tokens:
        offsets.append(at)
        at += len(token.text)
    return {
        "tokens": [t.text for t in choice.tokens],
        "token_logprobs": [t.logprob for t in choice.tokens],
        "top_logprobs": [None if t.top is None else dict(t.top) for t in choice.tokens],
        "text_offset": offsets,
    }


# --- chat ----------------------------------------------------------------------------------------
@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, ctx: Ctx) -> Response:
    body.refuse_unserved()
    if body.max_tokens == 0:
        raise FieldError("max_tokens", "max_tokens must be at least 1")
    _check_samples(ctx, body.n, 1)
    messages = template_messages(body.messages)
    served, job = await ctx.loaded.served(body.model, ctx.tenant)
    tokenizer = served.base.tokenizer
    wanted = body.max_completion_tokens or body.max_tokens
    chars = sum(len(message["content"]) for message in messages)
    _check_text_fits(served.base, "the messages' content", "messages", chars)
    prompt = await _off_loop_if_large(chars, lambda: prompt_tokens(tokenizer, messages, body.model))
    max_tokens = wanted or max(served.base.positions - len(prompt), 1)
    k = body.top_logprobs or 0
    params = [_params(body, max_tokens=max_tokens, logprobs=body.logprobs, top=k, echo=False)]
    _check_limits(ctx, [prompt], params, served.base)
    ticket = sampling.sample(ctx.manager, job, ctx.tenant, [prompt], params, streamed=body.stream)

    def choices(samples: list[dict[str, Any]]) -> list[_Choice]:
        return [_generated(tokenizer, sample, k if body.logprobs else None) for sample in samples]

    def lp(choice: _Choice) -> dict[str, Any] | None:
        return {"content": [_chat_token(t) for t in choice.tokens], "refusal": None} if body.logprobs else None

    def message(index: int, choice: _Choice) -> dict[str, Any]:
        content = {"role": "assistant", "content": choice.text, "refusal": None}
        return {"index": index, "message": content, "logprobs": lp(choice), "finish_reason": choice.finish_reason}

    def chunk(index: int, new: _Choice) -> dict[str, Any]:
        delta = {"content": new.text} if new.text or new.tokens else {}
        return {"index": index, "delta": delta, "logprobs": lp(new), "finish_reason": new.finish_reason}

    def opening(index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    answer = _Answer(ctx, body, ticket, "chat.completion", [prompt], choices, tokenizer)
    if body.stream:
        return answer.stream(chunk, opening)
    samples = await answer.samples()
    listed = [message(i, c) for i, c in enumerate(choices(samples))]
    return JSONResponse(answer.envelope(listed, usage=answer.usage(samples)))


def _chat_token(token: _Token) -> dict[str, Any]:
    def entry(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    top = [entry(text, logprob) for text, logprob in token.top or ()]
    return {**entry(token.text, token.logprob), "top_logprobs": top}


# --- both ------------------------------------------------------------------------------------------
def _params(body: Any, *, max_tokens: int, logprobs: bool, top: int, echo: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=body.stops,
        n=body.n,
        seed=body.seed,
        logprobs=logprobs,
        topk_logprobs=top if logprobs else 0,
        ignore_eos=body.ignore_eos,
        prompt_logprobs=echo and logprobs,
        topk_prompt_logprobs=top if echo and logprobs else 0,
    )


def _check_samples(ctx: _Context, n: int, num_prompts: int) -> None:
    """The samples a request asks for, within ``--max-samples-per-request``: checked before anything is loaded."""
    most = ctx.manager.settings.max_samples_per_request
    if n * num_prompts > most:
        raise FieldError(
            "n",
            f"n ({n}) x {num_prompts} prompts is {n * num_prompts} samples; at most {most} go in one request "
            "(icefloe serve --max-samples-per-request)",
        )


def _check_text_fits(base: Base, where: str, param: str, chars: int) -> None:
    """A text of ``chars`` characters that cannot fit the model's context is refused before it is tokenized."""
    if chars > base.max_text_chars:
        raise FieldError(
            param,
            f"{where} is {chars} characters; no text of more than {base.max_text_chars} characters fits this "
            f"model's maximum context length of {base.positions} tokens. Please reduce the prompt.",
            code="context_length_exceeded",
        )


def _check_context(base: Base, prompt_tokens: int, max_tokens: int) -> None:
    if prompt_tokens + max_tokens > base.positions:
        raise FieldError(
            "max_tokens",
            f"This model's maximum context length is {base.positions} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            code="context_length_exceeded",
        )


async def _off_loop_if_large(size: int, work: Callable[[], _Made]) -> _Made:
    """``work()``, on a worker thread when ``size`` (characters or token ids) is large: tokenizing a
    large prompt would stall every other request."""
    return await asyncio.to_thread(work) if size > CHECK_ON_LOOP_BYTES else work()


def _check_limits(ctx: _Context, prompts: list[list[int]], params: list[SamplingParams], base: Base) -> None:
    """The bounds a Tinker sample's tokens obey: per request, and the model's context."""
    settings = ctx.manager.settings
    n = params[0].n
    for prompt, wanted in zip(prompts, params, strict=True):
        _check_context(base, len(prompt), wanted.max_tokens)
        tokens = n * (len(prompt) + wanted.max_tokens)
        if tokens > settings.max_tokens_per_request:
            raise FieldError(
                "max_tokens",
                f"n ({n}) x (prompt + max_tokens) is up to {tokens} tokens; at most {settings.max_tokens_per_request} "
                "go in one request (icefloe serve --max-tokens-per-request): lower n or max_tokens",
            )


def _generated(tokenizer: Any, sample: dict[str, Any], k: int | None) -> _Choice:
    """A sample as a choice: its text, and (``k`` not None) the tokens that text shows, each with its
    log-prob and ``k`` alternatives; a stop token or the tokens of a stop string are not shown."""
    choice = _Choice(sample["text"], finish_reason=_finish_reason(sample))
    if k is None:
        return choice
    ids = sample["token_ids"]
    shown = len(ids)
    while shown and len(tokenizer.decode(ids[: shown - 1], skip_special_tokens=True)) >= len(sample["text"]):
        shown -= 1
    tops = sample.get("topk_logprobs") or [None] * len(ids)
    choice.tokens = [
        _Token(tokenizer.decode([token]), logprob, _top(tokenizer, top, k))
        for token, logprob, top in zip(ids[:shown], sample["logprobs"][:shown], tops[:shown], strict=True)
    ]
    return choice


def _top(tokenizer: Any, pairs: list[list[float]] | None, k: int) -> list[tuple[str, float]]:
    return [(tokenizer.decode([int(token)]), logprob) for token, logprob in (pairs or [])[:k]]


def _finish_reason(sample: dict[str, Any]) -> str | None:
    """How a sample ended, in OpenAI's words; None while it runs (a streamed answer's progress)."""
    if sample["finish_reason"] is None:
        return None
    return "length" if sample["finish_reason"] == "length" else "stop"


class _Answer:
    """A queued request's answer: whole (JSON) or as server-sent events, each a delta of its choices."""

    def __init__(
        self,
        ctx: _Context,
        body: Any,
        ticket: sampling.Ticket,
        kind: str,
        prompts: list[list[int]],
        choices: Callable[[list[dict[str, Any]]], list[_Choice]],
        tokenizer: Any,
        *,
        scoring_only: bool = False,
    ) -> None:
        self.ctx, self.body, self.ticket, self.kind = ctx, body, ticket, kind
        self.prompts, self.choices, self.tokenizer, self.scoring_only = prompts, choices, tokenizer, scoring_only
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def _gone(self) -> None:
        sampling.cancel(self.ctx.manager, self.ticket)

    async def samples(self) -> list[dict[str, Any]]:
        waiting = sampling.outcome(self.ctx.manager, self.ticket)
        return await until_done(self.ctx.request.receive, waiting, self._gone)

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.kind, "created": self.created, "model": self.body.model}
        return {**head, "choices": choices, "system_fingerprint": None, **extra}

    def usage(self, samples: list[dict[str, Any]]) -> dict[str, int]:
        prompt = sum(map(len, self.prompts))
        completion = 0 if self.scoring_only else sum(len(s["token_ids"]) for s in samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def stream(
        self, chunk: Callable[[int, _Choice], dict[str, Any]], opening: Callable[[int], dict[str, Any]] | None = None
    ) -> EventStream:
        settings = self.ctx.manager.settings
        return EventStream(self._events(chunk, opening), self._gone, settings.public_text)

    async def _events(
        self, chunk: Callable[[int, _Choice], dict[str, Any]], opening: Callable[[int], dict[str, Any]] | None
    ) -> AsyncIterator[dict[str, Any]]:
        kind = f"{self.kind}.chunk" if self.kind == "chat.completion" else self.kind
        usage = {"usage": None} if self.body.include_usage else {}
        count = len(self.prompts) * self.body.n
        if opening is not None:
            yield {**self.envelope([opening(i) for i in range(count)], **usage), "object": kind}
        sent = [_Choice() for _ in range(count)]  # what each choice's events carried so far
        samples: list[dict[str, Any]] = []
        async for samples in sampling.progress(self.ctx.manager, self.ticket, self.tokenizer):
            deltas = []
            for index, (now, before) in enumerate(zip(self.choices(samples), sent, strict=True)):
                new = _Choice(now.text[len(before.text) :], now.tokens[len(before.tokens) :], now.finish_reason)
                if new.text or new.tokens or new.finish_reason != before.finish_reason:
                    deltas.append(chunk(index, new))
                sent[index] = now
            if deltas:
                yield {**self.envelope(deltas, **usage), "object": kind}
        if self.body.include_usage:
            yield {**self.envelope([], usage=self.usage(samples)), "object": kind}
