"""Request bodies of ``/completions`` and ``/chat/completions`` as OpenAI publishes them, and what the
endpoint refuses.

A field OpenAI defines that the endpoint cannot honour (tools, response formats, penalties, images)
is refused by name (400), never ignored; a field OpenAI does not define either is refused as OpenAI
refuses it ("Unrecognized request argument"). ``top_k`` and ``ignore_eos`` are extensions vLLM
serves too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from icefloe.service.openai.errors import FieldError

__all__ = ["ChatRequest", "CompletionRequest", "StreamOptions"]

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
        """Refuse, by name, every field this endpoint does not honour."""
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
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or not all(stops):
            raise FieldError("stop", "stop takes up to 4 non-empty strings")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatRequest(_Request):
    """``POST /chat/completions``: ``messages`` rendered by the model's chat template."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def refuse_unserved(self) -> None:
        super().refuse_unserved()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
