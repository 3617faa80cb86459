"""Chat messages to a prompt through the checkpoint's chat template, rendered as `transformers`'
apply_chat_template renders it: a sandboxed Jinja environment with trim_blocks and lstrip_blocks,
`raise_exception` available to the template, and the variables messages, add_generation_prompt,
bos_token, eos_token and tools."""

from __future__ import annotations

from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised, or could not be compiled."""


class ContentError(ValueError):
    """Message content this server cannot render: a part that is not text."""


TEXT_PART_SEPARATOR = "\n"  # text parts of one message are joined by this, as vLLM does for string templates


def text_content(content: str | list[dict] | None) -> str | None:
    """A message's content as the template expects it, a string: OpenAI's list of parts becomes its text
    parts joined by TEXT_PART_SEPARATOR. Raises ContentError naming any part of another type."""
    if content is None or isinstance(content, str):
        return content
    others = sorted({part["type"] for part in content if part["type"] != "text"})
    if others:
        raise ContentError(
            f"content parts of type {', '.join(repr(t) for t in others)} are not supported: "
            "this server serves text only (parts of type 'text')"
        )
    return TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
) -> str:
    """`tools`: the functions the model may call, in OpenAI's form (None without: templates test `tools`)."""
    try:
        return _compiled(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
        )
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e
