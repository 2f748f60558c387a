"""Chat messages to prompt tokens with the model's own chat template (its tokenizer's ``chat_template``).

A model without a template is refused for chat, saying so: its completions still work. Content is
text, or a list of text parts; images, audio and files are refused by name, as are tool messages.
The messages are checked (:func:`template_messages`) before the model is loaded; rendering and
tokenizing them (:func:`prompt_tokens`) is the costly part, done once they are known to be well formed.
"""

from __future__ import annotations

from typing import Any

from icefloe.service.openai.errors import FieldError
from icefloe.service.openai.schemas import check_text

__all__ = ["prompt_tokens", "template_messages"]

_ROLES = ("system", "developer", "user", "assistant")


def template_messages(messages: list[Any]) -> list[dict[str, str]]:
    """``messages`` as a chat template takes them (``role``, ``content`` as one text, ``name``), or
    :class:`FieldError` naming the first one that is refused."""
    return [_message(index, message) for index, message in enumerate(messages)]


def prompt_tokens(tokenizer: Any, messages: list[dict[str, str]], model: str) -> list[int]:
    """The token ids of ``messages`` (of :func:`template_messages`) rendered by the template, ending
    with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise FieldError(
            "model",
            f"model {model!r} has no chat template (its tokenizer_config.json has no chat_template), so it cannot "
            "chat; use /completions with a prompt in its own format, or a model that has a template",
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise FieldError(where, f"{where} must be an object with a role and content")
    role = message.get("role")
    if role not in _ROLES:
        why = "tool calls are not served" if role in ("tool", "function") else f"role must be one of {list(_ROLES)}"
        raise FieldError(f"{where}.role", f"{where}.role {role!r:.40}: {why}")
    for name in ("tool_calls", "function_call", "audio"):
        if message.get(name):
            raise FieldError(f"{where}.{name}", f"{where}.{name}: tool calls and audio are not served")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for number, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise FieldError(
                    f"{where}.content[{number}]",
                    f"{where}.content[{number}] is a {kind!r:.40} part; only text parts are served (no images, audio "
                    "or files)",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise FieldError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    rendered = {"role": "system" if role == "developer" else role, "content": check_text(content, f"{where}.content")}
    if isinstance(message.get("name"), str):
        rendered["name"] = check_text(message["name"], f"{where}.name")
    return rendered
