"""ChatML prompt rendering, importable without torch (the router uses it).

``apply_chat_template([{"role": "user", "content": "hi"}])`` gives the Qwen/ChatML text
``<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from belayer.errors import UsageError

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


def apply_chat_template(messages: Iterable[Mapping], add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> str:
    """Render OpenAI-style messages as ChatML text.

    ``continue_final_message`` leaves the last (assistant) message open so a generation
    continues it, as in HF ``apply_chat_template``.
    """
    msgs = list(messages)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or "role" not in m:
            raise UsageError(f"message {i} must be an object with a 'role'")
        text = f"{IM_START}{m['role']}\n{_content_text(m.get('content'))}"
        if continue_final_message and i == len(msgs) - 1:
            out.append(text)
            return "".join(out)
        out.append(text + f"{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)
