"""Replay recovery: the ids a dead worker generated are decoded again on the new one, forced.

Re-prefilling ``prompt + generated`` (``recovery="token"``) is exact on the reference worker
and on CPU, but on a GPU an SGLang server computes a prefill with other kernels than the
decode steps that produced those ids (even with ``--enable-deterministic-inference``), so
the KV, and from some token on the continuation, differ from the fault-free run. Replay
sends the prompt alone and makes the server sample each already generated id in turn,
through its ordinary decode path: with SGLang's deterministic mode every forward is then the
fault-free run's, and so is the continuation. It costs one decode step per generated id.

The forcing is an SGLang custom logit processor (the server needs
``--enable-custom-logit-processor``). SGLang loads a processor from dill-pickled bytes; this
one's pickle evaluates :class:`ForcedIds`'s own source in the server, so any SGLang server
runs it without installing anything. The router builds every such request itself: clients
can send neither ``custom_logit_processor`` nor ``custom_params`` (``native_requests.py``).
"""

from __future__ import annotations

import functools
import inspect
import json
import pickle

FORCED_IDS = "belayer_forced_ids"  # custom_params key: the ids to sample, in order


class ForcedIds:
    """An SGLang custom logit processor: a row whose params carry ``belayer_forced_ids``
    samples those ids, one per sampling step, then its logits pass through untouched.

    Runs inside the SGLang server (its source travels in the request): plain Python only,
    so its keys are literals (``FORCED_IDS``). The count lives in the request's own params
    dict (``belayer_forced_done``), which SGLang keeps for the request's life; an
    intermediate chunk of a chunked prefill samples nothing and is not counted.
    """

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or ()):
            if not isinstance(params, dict) or not params.get("belayer_forced_ids"):
                continue
            req = params.get("__req__")
            if req is not None and (getattr(req, "is_chunked", 0) or 0) > 0:
                continue
            ids, done = params["belayer_forced_ids"], params.get("belayer_forced_done", 0)
            if done >= len(ids):
                continue
            params["belayer_forced_done"] = done + 1
            logits[row].fill_(float("-inf"))
            logits[row, int(ids[done])] = 0.0
        return logits


class _Evaluated:
    """Pickles as ``eval(expr)``: what SGLang's dill loader runs to get the processor class."""

    def __init__(self, expr: str) -> None:
        self.expr = expr

    def __reduce__(self):
        return eval, (self.expr,)


@functools.lru_cache(maxsize=1)
def processor_string() -> str:
    """``custom_logit_processor`` for SGLang's ``/generate``: JSON ``{"callable": hex}``,
    the hex a pickle that defines :class:`ForcedIds` from its source and returns the class
    (SGLang instantiates it once per server and caches it by this string)."""
    source = inspect.getsource(ForcedIds)
    expr = f"(lambda ns: (exec({source!r}, ns), ns['ForcedIds'])[1])({{}})"
    return json.dumps({"callable": pickle.dumps(_Evaluated(expr), protocol=2).hex()})


def replay_fields(generated: list[int]) -> tuple[dict, dict]:
    """The body field and the sampling field that make a worker re-sample ``generated``."""
    return {"custom_logit_processor": processor_string()}, {"custom_params": {FORCED_IDS: list(generated)}}
