"""ChatML prompt rendering, importable without torch (the router uses it).

``apply_chat_template([{"role": "user", "content": "hi"}])`` gives the Qwen/ChatML text
``<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n``. ``chat_segments`` gives
the same text as (text, is_template) pieces, so that a tokenizer can turn special-token
strings into control tokens only where the template put them, never inside content.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from belayer_core.errors import UsageError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise UsageError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise UsageError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def chat_segments(messages: Iterable[Mapping], add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> list[tuple[str, bool]]:
    """The ChatML rendering as ``(text, is_template)`` pieces; content pieces are False.

    ``continue_final_message`` leaves the last (assistant) message open so a generation
    continues it, as in HF ``apply_chat_template``.
    """
    msgs = list(messages)
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise UsageError(f"message {i} must be an object with a string 'role'")
        if IM_START in m["role"] or IM_END in m["role"] or "\n" in m["role"]:
            raise UsageError(f"message {i}: invalid role {m['role']!r}")
        out.append((f"{IM_START}{m['role']}\n", True))
        content = _content_text(m.get("content"))
        if content:
            out.append((content, False))
        if continue_final_message and i == len(msgs) - 1:
            return out
        out.append((f"{IM_END}\n", True))
    if add_generation_prompt:
        out.append((f"{IM_START}assistant\n", True))
    return out


def apply_chat_template(messages: Iterable[Mapping], add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> str:
    """Render OpenAI-style messages as ChatML text (see ``chat_segments``)."""
    return "".join(t for t, _ in chat_segments(messages, add_generation_prompt, continue_final_message))
