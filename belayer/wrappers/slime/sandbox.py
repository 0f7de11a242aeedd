"""``BelayerSandbox``: slime's ``Sandbox`` protocol (slime/agent/sandbox.py: ``sandbox_id``,
async context, ``exec``, ``write_file``, ``read_file``) over Belayer::

    async with BelayerSandbox(image="belayer-base:latest") as sb:    # over a DockerSandbox
        code, out, err = await sb.exec("python3 -V")
    async with BelayerSandbox(env=RecoverableSandboxEnv(...)) as sb:  # every exec an env step
        ...

``exec`` returns ``(exit_code, stdout, stderr)``; Belayer's sandboxes merge stderr into
stdout (as mini-swe-agent's do), so ``stderr`` is "". ``check=True`` raises
``RuntimeError`` on a non-zero exit, as ``E2BSandbox.exec`` does; ``user`` other than root
runs the command through ``runuser``; ``env`` is exported for it; ``idempotent`` is accepted
and ignored (nothing is re-sent: a broken exec is an ``InfraError``). A command timeout is
the command's outcome (exit 124), not an exception. Files travel through ``exec`` (base64,
in chunks under the command and output limits), so they belong to the same boundaries.

Over an env each ``exec`` is one step, a boundary the env may checkpoint, and an
infrastructure failure is recovered by the env. The effects of the execs after the restored
boundary j are gone then, so ``exec`` raises ``SandboxRolledBack(to_step=j)`` rather than
pretend: the caller redoes its work from there. Over a bare ``DockerSandbox`` an
infrastructure failure raises its ``InfraError``. Blocking work runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
from pathlib import Path
from typing import Any

ExecResult = tuple[int, str, str]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WRITE_CHUNK = 256 * 1024  # raw bytes per write command (base64: ~350 KB, under the 1 MiB command limit)


class SandboxRolledBack(Exception):
    """The env restored boundary ``to_step`` after an infrastructure failure: the effects of
    this sandbox's execs after it are gone."""

    def __init__(self, to_step: int, reason: str):
        super().__init__(f"the sandbox was restored to step {to_step} after {reason}: redo the work after it")
        self.to_step, self.reason = to_step, reason


class BelayerSandbox:
    def __init__(self, image: str | None = None, *, env: Any = None, reset_options: dict[str, Any] | None = None,
                 **sandbox_config: Any):
        """Over a new ``DockerSandbox`` (``image`` and ``SandboxConfig`` fields), or over
        ``env`` (a ``RecoverableSandboxEnv``, reset on enter with ``reset_options``)."""
        if env is not None and (image is not None or sandbox_config):
            raise ValueError("give either env or the sandbox's settings, not both")
        self.env = env
        self._config = {**sandbox_config, **({"image": image} if image else {})}
        self._reset_options = reset_options
        self.sandbox: Any = None
        self.sandbox_id = ""

    # ------------------------------------------------------------------ async context

    async def __aenter__(self) -> BelayerSandbox:
        await asyncio.to_thread(self._open)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await asyncio.to_thread(self._close)

    def _open(self) -> None:
        if self.env is not None:
            self.env.reset(options=self._reset_options)
            self.sandbox_id = self.env.name
            return
        from belayer_env import DockerSandbox

        self.sandbox = DockerSandbox(**self._config)
        self.sandbox_id = self.sandbox.container_id

    def _close(self) -> None:
        if self.env is not None:
            self.env.close()
        elif self.sandbox is not None:
            self.sandbox.close()

    # ------------------------------------------------------------------ slime's Sandbox

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult:
        result = await asyncio.to_thread(self._run, _command(cmd, user, env), timeout)
        code, output = result["returncode"], result["output"]
        if check and code != 0:
            raise RuntimeError(f"belayer exec failed (exit={code}): {cmd[:120]}\n{output[:400]}")
        return code, output, ""

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        data = content.read_bytes() if isinstance(content, Path) else (
            content.encode() if isinstance(content, str) else bytes(content))
        path = shlex.quote(sandbox_path)
        await self.exec(f"mkdir -p -- \"$(dirname -- {path})\" && : > {path}", user=user, check=True)
        for start in range(0, len(data), WRITE_CHUNK):
            chunk = base64.b64encode(data[start:start + WRITE_CHUNK]).decode()
            await self.exec(f"printf %s {chunk} | base64 -d >> {path}", user=user, check=True)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text ("" when it cannot be read, as ``E2BSandbox.read_file`` answers)."""
        path = shlex.quote(sandbox_path)
        code, out, _ = await self.exec(f"stat -c %s -- {path}", user=user)
        if code != 0 or not out.strip().isdigit():
            return ""
        size, data = int(out.strip()), bytearray()
        chunk = max(3, (self._max_output() - 64) // 4 * 3)  # base64 of a chunk fits the output cap
        for start in range(0, size, chunk):
            code, out, _ = await self.exec(f"tail -c +{start + 1} -- {path} | head -c {chunk} | base64 -w0",
                                           user=user)
            if code != 0:
                return ""
            data += base64.b64decode(out.strip())
        return data.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ internals

    def _run(self, command: str, timeout: float) -> dict[str, Any]:
        if self.env is None:
            if self.sandbox is None:
                raise RuntimeError("use the sandbox inside `async with`")
            return self.sandbox.execute(command, timeout=timeout)
        _obs, _r, _te, _tr, info = self.env.step_command(command, timeout=timeout)
        rollback = info["belayer"].get("rollback")
        if rollback is not None:
            raise SandboxRolledBack(rollback["to_step"], rollback["reason"])
        return {"returncode": info["returncode"], "output": self.env.last_result["output"]}

    def _max_output(self) -> int:
        config = self.env.config.sandbox if self.env is not None else self.sandbox.config
        return config.max_output_bytes


def _command(cmd: str, user: str, env: dict[str, str] | None) -> str:
    for name in env or {}:
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid environment variable name {name!r}")
    script = "".join(f"export {k}={shlex.quote(str(v))}; " for k, v in (env or {}).items()) + cmd
    if user != "root":
        script = f"runuser -u {shlex.quote(user)} -- bash -c {shlex.quote(script)}"
    return script
