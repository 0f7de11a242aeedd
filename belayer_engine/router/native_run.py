"""One native ``/generate`` generation on the router: its recovered stream, abort and shape.

``NativeRun`` drives a ``Continuation`` (so a worker lost mid-generation is continued on the
shadow, token by token) and renders SGLang 0.5.23's response for it: cumulative ``text``
and ``output_ids``, ``meta_info`` with SGLang's keys (``finish_reason`` {type, matched |
length | message}, token counts, ``output_token_logprobs`` as [logprob, id, text|null],
``weight_version`` as a string and ``weight_versions`` spans {version, start, end}). The
text is decoded by the router over every id (never spliced from per-worker pieces), and
stop strings are checked there too, so one that straddles a failover is still honoured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from .native_requests import NativeItem
from .recovery import Continuation, Generation, _version
from .upstream import Chunk

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class NativeRun:
    """One generation: feeds on ``Continuation`` chunks, answers SGLang-shaped dicts."""

    def __init__(self, item: NativeItem, codec, index: int, group: object = None) -> None:
        sp = item.sampling
        self.item = item
        self.codec = codec
        self.index = index
        self.gen = Generation(prompt_ids=item.prompt_ids, max_new_tokens=sp.max_new_tokens,
                              sampling=sp.worker_params(),
                              top_logprobs_num=item.top_logprobs_num if item.return_logprob else None,
                              rid=item.rid, group=group)
        self.started = time.time()
        self.aborted = asyncio.Event()
        self.spans: list[dict] = []  # weight version of each run of output tokens
        self._texts: dict[int, str | None] = {}
        self._matched: str | None = None
        self._cache: tuple = (0, None)  # the first worker's prefix-cache hit (SGLang's radix cache)

    # ------------------------------------------------------------------ driving

    async def drive(self, continuation: Continuation, on_progress: Callable[[NativeRun], Awaitable[None]] | None = None) -> None:
        """Run to a finish (or an abort); ``on_progress`` after each chunk with new ids.

        However it ends (a finish, ``/abort_request``, the client gone and this task
        cancelled), the pending step of the generation is cancelled before the stream is
        closed: left running, it kept its worker stream and its place in the router's
        queue after the client had gone."""
        gen = self.gen
        chunks = continuation.run(gen)
        stop = asyncio.ensure_future(self.aborted.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(chunks, None))
                done, _ = await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:  # /abort_request: end it here with what it has
                    gen.finish = dict(ABORTED)
                    return
                chunk = nxt.result()
                if chunk is None:
                    return
                self._absorb(chunk)
                if self._stop_string_hit():
                    gen.finish = {"type": "stop", "matched": self._matched}
                    return
                if gen.finish is not None:
                    if gen.finish.get("type") == "length":  # the client's budget, not the last worker's
                        gen.finish = {"type": "length", "length": self.item.sampling.max_new_tokens}
                    return
                if on_progress is not None and chunk.ids:
                    await on_progress(self)
        finally:
            stop.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            await chunks.aclose()  # closes the worker stream: the worker frees the request

    def _absorb(self, chunk: Chunk) -> None:
        if not self.gen.recoveries and isinstance(chunk.meta.get("cached_tokens"), int):
            self._cache = (chunk.meta["cached_tokens"], chunk.meta.get("cached_tokens_details"))
        if not chunk.ids:
            return
        version = _version(chunk.meta.get("weight_version", self.gen.weight_version))
        version = "default" if version is None else str(version)
        end = len(self.gen.generated)
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = end
        else:
            self.spans.append({"version": version, "start": self.spans[-1]["end"] if self.spans else 0, "end": end})

    def _stop_string_hit(self) -> bool:
        """A stop string in the output that the workers did not end on (one straddling a
        failover): the output is cut after the token that completed it, as SGLang cuts."""
        stops = self.item.sampling.stop
        gen = self.gen
        if not stops or (gen.finish or {}).get("type") == "stop":
            return False
        text = self.codec.decode(gen.generated)
        found = [(text.find(s), s) for s in stops if s in text]
        if not found:
            return False
        self._matched = min(found)[1]
        keep = next(k for k in range(1, len(gen.generated) + 1)
                    if self._matched in self.codec.decode(gen.generated[:k]))
        del gen.generated[keep:]
        del gen.logprobs[keep:]
        del gen.top_logprobs[keep:]
        for span in self.spans:
            span["end"] = min(span["end"], keep)
        self.spans = [s for s in self.spans if s["start"] < s["end"] or s["start"] == 0]
        return True

    # ------------------------------------------------------------------ shape

    def text(self, final: bool) -> str:
        sp = self.item.sampling
        ids = self.gen.generated
        text = self.codec.decode_output(ids, skip_special_tokens=sp.skip_special_tokens)
        finish = self.gen.finish or {}
        matched = finish.get("matched")
        if final and isinstance(matched, str) and not sp.no_stop_trim:
            cut = text.find(matched)
            text = text[:cut] if cut >= 0 else text
        return text if final else text.rstrip("\ufffd")  # an incomplete character waits

    def _token_text(self, token: int) -> str | None:
        if not self.item.text_in_logprobs:
            return None
        if token not in self._texts:
            self._texts[token] = self.codec.decode_output([token], skip_special_tokens=False)
        return self._texts[token]

    def _logprobs(self) -> dict:
        gen = self.gen
        n = len(gen.logprobs)
        out = {"input_token_logprobs": [],
               "output_token_logprobs": [[lp, i, self._token_text(i)] for lp, i in zip(gen.logprobs, gen.generated[:n], strict=True)],
               "output_token_logprobs_length": n}
        if self.item.top_logprobs_num:
            out["input_top_logprobs"] = []
            out["output_top_logprobs"] = [[[lp, i, self._token_text(i)] for lp, i in row] for row in gen.top_logprobs]
        return out

    def payload(self, final: bool, index: int | None = None) -> dict:
        """The SGLang response (``final``) or streamed chunk for this generation so far."""
        gen = self.gen
        v = gen.weight_version
        spans = self.spans or [{"version": "default" if v is None else str(v), "start": 0, "end": 0}]
        meta: dict = {"id": self.item.rid, "finish_reason": gen.finish if final else None,
                      "prompt_tokens": len(gen.prompt_ids), "weight_version": spans[-1]["version"],
                      "num_retractions": 0}
        if self.item.return_logprob:
            meta.update(self._logprobs())
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(gen.generated), "cached_tokens": self._cache[0]})
        if final:
            meta["weight_versions"] = [dict(s) for s in spans]
        meta.update({"cached_tokens_details": self._cache[1], "dp_rank": None})
        if final:
            meta["e2e_latency"] = time.time() - self.started
            meta["belayer"] = gen.summary()  # recoveries, workers, failures (ours; SGLang has none)
        out = {"text": self.text(final), "output_ids": list(gen.generated), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out
