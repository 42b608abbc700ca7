"""`Run`: one HTTP request's worth of engine requests (several for a batched /v1/completions,
or n > 1). The engine's callback posts each incremental output onto the run's asyncio queue
through the loop's `LoopOutbox` (one event-loop wake-up per burst of outputs). Text held back
because it could begin a stop string is the engine's business (`request_output`): what
arrives here can be sent as is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from specserve.runtime.logprobs import add_logprobs
from specserve.runtime.output import prompt_rid, sample_rids
from specserve.server.protocol import APIError

if TYPE_CHECKING:
    from specserve.server.state import ServerState

log = logging.getLogger(__name__)


class Run:
    def __init__(
        self,
        state: ServerState,
        loop: asyncio.AbstractEventLoop,
        rename: dict[str, str] | None = None,
        prefix: str = "",
    ):
        """rename, prefix: the engine's field names as the client wrote them (errors)."""
        self.state = state
        self.rename, self.prefix = rename or {}, prefix
        self.outbox = state.outbox(loop)  # every output reaches the run's queue through it
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []  # engine request ids, by choice index
        self.names: list[str] = []  # the ids the client sees (meta_info.id), by choice index
        self.unfinished: set[int] = set()
        self.id = ""  # the first prompt's id (one for all its choices, as OpenAI's responses)

    def submit(self, reqs: list, rid: str | None) -> None:
        """Submit one prompt's sample requests (`Engine.make_samples`) as the next choices;
        rid: the client's id of the prompt."""
        state, outbox, queue = self.state, self.outbox, self.queue
        base, n = len(self.rids), len(reqs)
        rids = [r.name for r in reqs]
        names = sample_rids(rid, n) if rid else rids
        prompt = rid if rid and n > 1 else None

        def on_output(j: int, out: dict[str, Any]) -> None:  # runs on the engine's thread
            try:
                if out.get("finished"):
                    state._finished(names[j], out, prompt)
                out["meta_info"]["id"] = names[j]
                outbox.post(queue, (base + j, out))
            except RuntimeError:  # the event loop is gone (server stopped)
                pass
            except Exception:
                log.exception("output delivery failed")

        with state._lock:  # (checked again: another request may have taken the id since)
            if rid:
                state.check_ids_free(rid, names)
            state.active_rids.update(zip(names, rids))
            if prompt is not None:
                state.active_prompts[prompt] = n
        try:
            state.engine.submit_made(reqs, on_output)
        except BaseException:
            with state._lock:
                for name in names:
                    state.active_rids.pop(name, None)
                if prompt is not None:
                    state._prompt_done(prompt, n)
            raise
        if not self.names:
            self.id = prompt_rid(names)
        self.rids += rids
        self.names += names
        self.unfinished.update(range(base, base + n))

    def abort_error(self, meta: dict[str, Any]) -> APIError:
        """The error for one of this run's requests that the engine aborted."""
        return self.state.abort_error(meta, self.rename, self.prefix)

    def abort(self) -> None:
        """Abort what has not finished (client gone, error, shutdown); frees its KV. By engine
        request id: never another run's request, even one that reuses this run's rid."""
        for i in list(self.unfinished):
            self.state.engine.abort(self.rids[i])

    def end_now(self, message: str) -> None:
        """Queue a final abort for each unfinished request (thread-safe)."""
        for i in list(self.unfinished):
            out = {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "id": self.names[i],
                    "finish_reason": {"type": "abort", "message": message},
                },
                "finished": True,
            }
            self.outbox.post(self.queue, (i, out))

    async def events(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Incremental outputs (index, delta) until every request of the run has finished."""
        while self.unfinished:
            index, out = await self.queue.get()
            if index not in self.unfinished:
                continue  # already ended (end_now), the engine's own final output came later
            if out.get("finished"):
                self.unfinished.discard(index)
            yield index, out

    async def collect(self) -> list[dict[str, Any]]:
        """The final outputs (text, ids and log-probs joined), in choice order."""
        texts: list[list[str]] = [[] for _ in self.rids]
        ids: list[list[int]] = [[] for _ in self.rids]
        logprobs: list[dict[str, list]] = [{} for _ in self.rids]
        final: list[dict[str, Any] | None] = [None] * len(self.rids)
        async for i, out in self.events():
            texts[i].append(out["text"])
            ids[i].extend(out["output_ids"])
            add_logprobs(logprobs[i], out.get("meta_info", {}))
            if out.get("finished"):
                meta = {**out.get("meta_info", {}), **logprobs[i]}
                final[i] = {
                    **out,
                    "text": "".join(texts[i]),
                    "output_ids": ids[i],
                    "meta_info": meta,
                }
        return final  # type: ignore[return-value]


async def watch_disconnect(request, on_disconnect) -> None:
    """Call on_disconnect() when the client goes away (ASGI http.disconnect)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # the connection is gone in some other way
        on_disconnect()
