"""``ChatHistory``: owns the chat message list and rolls it back with the env.

A plain agent loop gets prefix-consistent recovery by wrapping: send ``env.messages`` to
the model, pass its reply to ``step``. The reply is the assistant message; ``parse_action``
turns it into the command (default: the last fenced ```bash block, or the whole reply;
NUL bytes, which bash cannot receive, are dropped).
On ``info["belayer"]["rollback"]`` the list is cut back to boundary j, so the model
regenerates from exactly the context that matches the restored sandbox.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import gymnasium as gym

_BASH_BLOCK = re.compile(r"```(?:bash|sh)?\s*\n(.*?)\n```", re.DOTALL)


def parse_bash_block(reply: str) -> str:
    """The last ```bash fenced block of a reply, or the whole reply when it has none."""
    blocks = _BASH_BLOCK.findall(reply)
    return blocks[-1].strip() if blocks else reply


class ChatHistory(gym.Wrapper):
    def __init__(self, env: gym.Env, system_prompt: str | None = None,
                 parse_action: Callable[[str], str] = parse_bash_block):
        super().__init__(env)
        self.system_prompt = system_prompt
        self.parse_action = parse_action
        self.messages: list[dict[str, str]] = []
        self._boundary: list[int] = []  # _boundary[j] = len(messages) at boundary j

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages.append({"role": "user", "content": str(obs)})
        self._boundary = [len(self.messages)]
        return obs, info

    def step(self, reply: str) -> tuple[Any, float, bool, bool, dict]:
        # NUL bytes cannot reach bash; in a model's reply they are noise, not a caller's bug
        obs, reward, terminated, truncated, info = self.env.step(self.parse_action(reply).replace("\x00", ""))
        rollback = info.get("belayer", {}).get("rollback")
        if rollback is not None:
            j = rollback["to_step"]
            del self.messages[self._boundary[j]:]
            del self._boundary[j + 1:]
            return obs, reward, terminated, truncated, info
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": str(obs)})
        self._boundary.append(len(self.messages))
        return obs, reward, terminated, truncated, info

    @property
    def boundary(self) -> int:
        """The committed step count the message list corresponds to."""
        return len(self._boundary) - 1
