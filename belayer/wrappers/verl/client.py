"""``EngineClient``: verl's ``LLMServerClient`` over Belayer's router (SGLang's native API).

verl's agent loops call ``server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``;
verl's own client forwards that to an SGLang replica, a Ray actor on a GPU that builds
SGLang's ``GenerateReqInput`` in-process (``verl/workers/rollout/sglang_rollout/
async_sglang_server.py``, ``SGLangHttpServer.generate``). This client builds the same request
and posts it as SGLang's native ``POST /generate`` to the engine's router, where a worker
SIGKILLed mid-generation is continued on the shadow: verl receives one generation.

Converted as verl's SGLang server converts it: ``max_new_tokens`` (or vLLM-style
``max_tokens``) else the rollout budget ``min(response_length, prompt_length +
response_length - len(prompt))``, clamped to ``max_model_len - len(prompt) - 1``;
``logprobs`` -> ``return_logprob``; the rest are SGLang sampling params. The answer becomes
verl's ``TokenOutput``: ``token_ids``, ``log_probs`` (with ``logprobs``), ``stop_reason``
(SGLang's finish type) and ``extra_fields["global_steps"]``: the engine's weight version of the
generation (an int when it is one), plus ``extra_fields["weight_versions"]``, every version
any of its tokens came from.

``BelayerAgentLoopManager`` is verl's ``AgentLoopManager`` with this client (set
``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` to it and ``BELAYER_ENGINE_URL``
to the router); verl's own rollout replicas and their weight sync are then not used: weights
go to the engine (``engine.update_weights`` or the router's ``/update_weights_from_tensor``).
"""

from __future__ import annotations

import os
from typing import Any

from verl.experimental.agent_loop import AgentLoopManager
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from belayer.wrappers.episode import post_json
from belayer_core.errors import RequestFailed, UsageError

URL_ENV = "BELAYER_ENGINE_URL"


class EngineClient(LLMServerClient):
    def __init__(self, config: Any, base_url: str | None = None, **kwargs: Any):
        super().__init__(config=config, load_balancer_handle=None)
        url = base_url or os.environ.get(URL_ENV)
        if not url:
            raise UsageError(f"EngineClient needs the engine's router URL (base_url= or ${URL_ENV})")
        self.base_url = url.rstrip("/").removesuffix("/v1")

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data or kwargs.get("mm_processor_output"):
            raise UsageError("EngineClient serves text-only agent loops (the engine takes token ids)")
        body = self.request(request_id, list(prompt_ids), dict(sampling_params))
        output = await post_json(f"{self.base_url}/generate", body)
        return token_output(output, body["return_logprob"])

    def request(self, request_id: str, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """The native ``/generate`` body verl's SGLang server would build for this call."""
        rollout = self.config.actor_rollout_ref.rollout
        if "max_new_tokens" in params:
            max_new = params.pop("max_new_tokens")
        elif "max_tokens" in params:
            max_new = params.pop("max_tokens")
        else:
            max_new = min(rollout.response_length, rollout.prompt_length + rollout.response_length - len(prompt_ids))
        max_model_len = rollout.get("max_model_len")
        if max_model_len:
            max_new = min(max_new, int(max_model_len) - len(prompt_ids) - 1)
        params["max_new_tokens"] = max(0, int(max_new))
        return_logprob = bool(params.pop("logprobs", False))
        return {"rid": request_id, "input_ids": prompt_ids, "sampling_params": params,
                "return_logprob": return_logprob}


class BelayerAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` whose workers call the engine through ``EngineClient``."""

    def __init__(self, config: Any, llm_client: Any = None, *args: Any, **kwargs: Any):
        super().__init__(config, EngineClient(config), *args, **kwargs)


def token_output(output: dict[str, Any], return_logprob: bool) -> TokenOutput:
    """verl's ``TokenOutput`` from one SGLang-native answer, as verl's SGLang server fills it."""
    meta = output.get("meta_info", {})
    finish = (meta.get("finish_reason") or {}).get("type")
    token_ids = [int(t) for t in output.get("output_ids", [])]
    log_probs = None
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        if [int(t[1]) for t in triples] != token_ids:
            raise RequestFailed(f"output_token_logprobs ({len(triples)}) do not match output_ids ({len(token_ids)})")
        log_probs = [float(t[0]) for t in triples]
    versions = [_version(s["version"]) for s in meta.get("weight_versions") or []]
    version = _version(meta.get("weight_version"))
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=finish,
                       extra_fields={"global_steps": version, "weight_versions": versions or [version],
                                     "belayer": meta.get("belayer") or {}})


def _version(value: Any) -> Any:
    """The engine reports versions as strings (SGLang's ``weight_version``); verl compares ints."""
    return int(value) if isinstance(value, str) and value.isdigit() else value

