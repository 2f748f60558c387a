"""Request bodies of ``/completions`` and ``/chat/completions`` as OpenAI publishes them, and what the
endpoint refuses.

A field OpenAI defines that the endpoint cannot honour (tools, response formats, penalties, images)
is refused by name (400), never ignored; a field OpenAI does not define either is refused as OpenAI
refuses it ("Unrecognized request argument"). ``top_k`` and ``ignore_eos`` are extensions vLLM
serves too.

``prompt`` is read from its shape by :func:`prompt_list`, not validated as a union of four list types:
a union checks every element once per branch, and a body of half a million numbers ending in a
string built an error per element per branch (gigabytes, seconds of a stalled event loop). Text a
tokenizer cannot encode (a lone surrogate, ``"\\ud800"``) is refused naming its field (:func:`check_text`).
"""

from __future__ import annotations

import array
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from icefloe.service.openai.errors import FieldError

__all__ = ["ChatRequest", "CompletionRequest", "StreamOptions", "check_text", "prompt_list"]

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI: 0-20); completions' logprobs (OpenAI: 0-5) share it

# Defined by OpenAI, not served here: each with what to do instead. A value equal to the default passes.
_REFUSED: dict[str, tuple[Any, str]] = {
    "tools": (None, "tool calls are not served; describe the tools in the prompt"),
    "tool_choice": (None, "tool calls are not served"),
    "parallel_tool_calls": (None, "tool calls are not served"),
    "functions": (None, "function calls are not served"),
    "function_call": (None, "function calls are not served"),
    "response_format": (None, "structured output (response_format) is not served; ask for the format in the prompt"),
    "audio": (None, "audio output is not served"),
    "modalities": (None, "only text output is served"),
    "prediction": (None, "predicted outputs are not served"),
    "web_search_options": (None, "web search is not served"),
    "reasoning_effort": (None, "reasoning_effort is not served"),
    "logit_bias": (None, "logit_bias is not served"),
    "frequency_penalty": (0, "frequency_penalty is not served; leave it 0"),
    "presence_penalty": (0, "presence_penalty is not served; leave it 0"),
    "suffix": (None, "suffix (insertion) is not served"),
    "best_of": (1, "best_of is not served; ask for n samples and rank them yourself"),
}
# Defined by OpenAI, accepted and without effect on sampling.
_ACCEPTED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # half of a UTF-16 pair (JSON's \ud800 escape): no character
_INTEGER_ARRAYS = frozenset("bBhHiIlLqQ")  # array.array typecodes of a dense JSON array of integers
_PROMPT_FORMS = "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids"

Prompts = list[str] | list[Sequence[int]]  # each prompt text, or token ids (a list, or an array.array of a large body)


def check_text(text: str, where: str, param: str | None = None) -> str:
    """``text``, or :class:`FieldError` (for ``param``, default ``where``) naming ``where`` when it holds
    a lone surrogate: no UTF-8 encodes one, so a tokenizer fails on it."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is not None:
        raise FieldError(
            param or where,
            f"{where} holds a lone surrogate (\\u{ord(found[0]):04x} at character {found.start()}), which is no "
            "Unicode character; send text that encodes as UTF-8",
        )
    return text


def prompt_list(prompt: Any) -> Prompts:
    """``prompt`` as a list of prompts, each text or token ids, checked from its shape: which form it is
    is read from its first element, then each element is checked once, naming the first wrong one
    (:class:`FieldError`)."""
    if type(prompt) is str:
        return [check_text(prompt, "prompt")]
    if _token_ids(prompt):
        prompts: Prompts = [prompt]
    elif type(prompt) is not list or not prompt:
        raise FieldError("prompt", f"prompt must be {_PROMPT_FORMS}")
    elif type(prompt[0]) is str:
        wrong = next((i for i, p in enumerate(prompt) if type(p) is not str), None)
        if wrong is not None:
            raise FieldError("prompt", f"prompt[{wrong}] is {_kind(prompt[wrong])}, in a list of strings")
        prompts = [check_text(p, f"prompt[{i}]", "prompt") for i, p in enumerate(prompt)]
    elif type(prompt[0]) is int:  # token ids with something else among them
        wrong = next(i for i, t in enumerate(prompt) if type(t) is not int)
        raise FieldError("prompt", f"prompt[{wrong}] is {_kind(prompt[wrong])}, in a list of token ids (integers)")
    else:
        wrong = next((i for i, p in enumerate(prompt) if not _token_ids(p)), None)
        if wrong is not None:
            raise FieldError("prompt", f"prompt[{wrong}] is {_kind(prompt[wrong])}; prompt must be {_PROMPT_FORMS}")
        prompts = prompt
    if any(not p for p in prompts):
        raise FieldError("prompt", "prompt is empty; give text or at least one token id")
    return prompts


def _token_ids(value: Any) -> bool:
    if type(value) is array.array:
        return value.typecode in _INTEGER_ARRAYS
    return type(value) is list and all(type(t) is int for t in value)


def _kind(value: Any) -> str:
    """What a wrong element is, in JSON's words."""
    if type(value) is array.array:
        return "a list of numbers with fractions"
    names = {str: "a string", int: "an integer", float: "a number with a fraction", bool: "a boolean", list: "a list"}
    return names.get(type(value), "an object" if isinstance(value, dict) else "null")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    """The fields both routes take (OpenAI's names and bounds)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): 0 or -1 = off
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM's): only stop strings and max_tokens end a sample

    def refuse_unserved(self) -> None:
        """Refuse, by name, every field this endpoint does not honour, and text no tokenizer encodes."""
        check_text(self.model, "model")
        for name, value in (self.model_extra or {}).items():
            if name in _ACCEPTED or value is None:
                continue
            if name not in _REFUSED:
                raise FieldError(name, f"Unrecognized request argument supplied: {name}")
            default, why = _REFUSED[name]
            if value != default:
                raise FieldError(name, f"{name}: {why}")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if len(self.stops) > 4 or not all(self.stops):
            raise FieldError("stop", "stop takes up to 4 non-empty strings")
        for stop in self.stops:
            check_text(stop, "stop")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: Any  # read by prompt_list: see the module's docstring
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatRequest(_Request):
    """``POST /chat/completions``: ``messages`` rendered by the model's chat template."""

    messages: list[Any] = Field(min_length=1)  # each an object, checked by chat.template_messages (no copy of each)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
