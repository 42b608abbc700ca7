"""The bridge between the HTTP handlers (asyncio) and the engine (its own loop thread).

`ServerState` owns the admission limit (`max_queued_requests`: requests submitted and not
finished), the metrics, and the mapping of engine argument errors onto request fields.
It builds each HTTP request's engine requests and submits them as one `Run` (server/run.py).

Tokenization runs on small thread pools, never on the event loop: one large prompt must not
stall other clients or /health. Large texts tokenize on a pool of their own, so the shared one
is never held by them; what cannot fit is rejected before it gets there (`request_size`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from specserve.errors import InvalidArgument
from specserve.runtime.output import sample_rids
from specserve.runtime.request_inputs import normalize_logprob_options
from specserve.sampling_params import GRAMMAR_PARAMS, check_field, is_int
from specserve.server.logprobs import TokenBytes, TokenStrings
from specserve.server.metrics import ServerMetrics
from specserve.server.outbox import LoopOutbox
from specserve.server.protocol import APIError
from specserve.server.request_size import RequestSize
from specserve.server.run import Run
from specserve.server.server_config import ServerConfig

log = logging.getLogger(__name__)


def engine_error(e: InvalidArgument, rename: dict[str, str], prefix: str = "") -> APIError:
    """An engine InvalidArgument as a 400 naming the field as the client wrote it."""
    msg = str(e)
    if msg.startswith(e.field + ": "):
        msg = msg[len(e.field) + 2 :]
    param = {"rid": "rid", **rename}.get(e.field, prefix + e.field)
    return APIError(f"{param}: {msg}", param=param)


def prompt_param(param: str, i: int, count: int) -> str:
    """The field of prompt i of `count`, as errors name it: `prompt[1]` in a batch (a batch is
    refused whole, and the client learns which of its prompts is at fault)."""
    return f"{param}[{i}]" if count > 1 else param


# the engine's names of a prompt
PROMPT_FIELDS = ("input_ids", "prompt")
# Prompts of more tokens than this, in all, are checked (and echoed) off the event loop:
# 2,000 prompts of 500 ids held it for half a second.
OFF_LOOP_PROMPT_TOKENS = 100_000
# Texts (a prompt, a chat's content, a request body) of more characters than this tokenize or
# parse on a pool of their own: a 2 MB prompt takes 6-14 s to tokenize before it can be found
# too long, and two of them on the shared pool kept a one-word request waiting 9 s.
LARGE_TEXT_CHARS = 64 * 1024
# Grammars compiling at once (see `ServerState.grammar_pool`).
GRAMMAR_WORKERS = 4

T = TypeVar("T")


class ServerState:
    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.model_name = cfg.served_model_name or str(engine.config.model_path)
        self.context_len: int = engine.core.context_len
        self.tokenizer = engine.tokenizer
        self.shutting_down = False
        self._lock = threading.Lock()
        self.inflight = 0
        # In flight: the id each request shows its client (the client's rid, or one made up)
        # -> its engine request id, made up for every submission, so that a rid is free for
        # reuse as soon as its request finished, and an abort reaches only its own request.
        self.active_rids: dict[str, str] = {}
        # the rid of each prompt in flight sampled n > 1 times (its samples are rid-0 ..):
        # -> its samples not yet finished; the rid itself is taken while any runs
        self.active_prompts: dict[str, int] = {}
        self.runs: weakref.WeakSet[Run] = weakref.WeakSet()
        self.metrics = ServerMetrics(engine, self._server_state)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specserve-tokenize")
        self.large_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="specserve-tokenize-large"
        )
        # structured-output grammars compile on a pool of their own: a large JSON schema
        # compiles for seconds, and on the tokenizing pool two such requests kept every other
        # client's text prompt waiting (a one-token chat took 31 s behind two 3,000-property
        # schemas on a 2-core machine). Several workers: one client's slow compile (a
        # 50,000-way regex: 10 s) left every other grammar waiting behind it. (A request whose
        # grammars are compiled already is built on the tokenizing pool, waiting for none.)
        self.grammar_pool = ThreadPoolExecutor(
            max_workers=GRAMMAR_WORKERS, thread_name_prefix="specserve-grammar"
        )
        self.size = RequestSize(
            self.tokenizer, self.context_len, cfg.max_queued_requests, cfg.max_samples_per_request
        )
        # the most tokens one sequence can reach: its prompt and output share the KV cache (a
        # sequence alone in it decodes plainly where its tree's window no longer fits: as
        # far as plain decoding goes)
        self.kv_tokens: int = engine.core.scheduler.max_prompt_tokens() + 1
        self._outbox: LoopOutbox | None = None
        self._token_bytes = None
        if self.tokenizer is not None:
            # log-probs' raw token bytes: built now, off the event loop (a first request with
            # log-probs would otherwise build them on it)
            self._token_bytes = TokenBytes(self.tokenizer, engine.core.model_config.vocab_size)
            self.pool.submit(self._token_bytes, 0)

    def token_strings(self) -> TokenStrings:
        """A response's token strings for its log-probs (the server's token bytes shared)."""
        return TokenStrings(self.tokenizer, self._token_bytes)

    def outbox(self, loop: asyncio.AbstractEventLoop) -> LoopOutbox:
        """The engine-to-loop hand-over of the server's event loop (a run keeps its own: a new
        loop, as a test client may start, gets a new one without affecting runs in flight)."""
        with self._lock:
            if self._outbox is None or self._outbox.loop is not loop:
                self._outbox = LoopOutbox(loop)
            return self._outbox

    async def off_loop(self, fn: Callable[..., T], *args: Any, chars: int = 0) -> T:
        """fn(*args) on the server's thread pool (tokenizing, parsing large bodies); on the
        large texts' pool where it works on more than LARGE_TEXT_CHARS characters."""
        pool = self.large_pool if chars > LARGE_TEXT_CHARS else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def unhealthy(self) -> str | None:
        """Why the server cannot serve (shutting down, or the engine's step failed)."""
        if self.engine.failure:
            return self.engine.failure
        if self.shutting_down:
            return "the server is shutting down"
        return None

    def _server_state(self) -> dict[str, Any]:
        return {"inflight": self.inflight, "max_queued_requests": self.cfg.max_queued_requests}

    def count_rejected(self, status: int) -> None:
        self.metrics.rejected.labels(str(status)).inc()

    def accepts_model(self, name: str | None) -> bool:
        return not name or name in (self.model_name, str(self.engine.config.model_path))

    # ---- admission ----------------------------------------------------------------------------
    def check_healthy(self) -> None:
        """503 while the server cannot serve."""
        reason = self.unhealthy()
        if reason:
            raise APIError(reason, status=503, type="service_unavailable_error")

    def reserve(self, n: int) -> None:
        self.check_healthy()
        limit = self.cfg.max_queued_requests
        with self._lock:
            if limit is not None and self.inflight + n > limit:
                busy = self.inflight
            else:
                self.inflight += n
                return
        raise APIError(
            f"the server is at capacity ({busy} requests in flight, max_queued_requests="
            f"{limit}); retry later",
            status=503,
            type="service_unavailable_error",
        )

    def release(self, n: int = 1) -> None:
        with self._lock:
            self.inflight -= n

    def _finished(self, name: str, out: dict[str, Any], prompt: str | None = None) -> None:
        with self._lock:
            self.active_rids.pop(name, None)
            if prompt is not None:
                self._prompt_done(prompt)
        self.release(1)
        try:
            self.metrics.observe_finished(out)
        except Exception:  # metrics must never break the engine's loop
            log.exception("metrics update failed")

    # ---- tokenization -------------------------------------------------------------------------
    async def encode(self, text: str, param: str, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(
                f"{param}: text needs a tokenizer, and this server runs without one "
                "(skip_tokenizer_init, or a model without one); send token ids",
                param=param,
            )
        self.size.check_text(len(text), param)
        return await self.off_loop(self._encode, text, special, chars=len(text))

    def _encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    async def encode_chat(
        self, messages: list[dict[str, str]], options: dict[str, Any] | None = None
    ) -> list[int]:
        """options: `Engine.tokenize_chat`'s (the template's)."""
        if self.tokenizer is not None:
            if self.size.message_tokens is None:
                await self.off_loop(self.size.measure_message_tokens, self.engine.tokenize_chat)
            self.size.check_chat(messages)
        try:
            return await self.off_loop(
                functools.partial(self.engine.tokenize_chat, messages, **(options or {})),
                chars=sum(len(m.get("content") or "") for m in messages),
            )
        except InvalidArgument as e:  # no tokenizer/template, or the template refused them
            raise engine_error(e, {"template_kwargs": "chat_template_kwargs"}) from None
        except Exception as e:  # (a template's own error type)
            raise APIError(f"messages: {e}", param="messages") from None

    def truncate_prompt(
        self, ids: list[int], keep: int | None, prompt: str, prefix: str = ""
    ) -> list[int]:
        """The prompt cut as sampling parameter truncate_prompt_tokens asks (before its size
        is checked against the context). prefix: where the route's body holds the sampling
        parameters (`sampling_params.` on /generate), as its other errors name them; prompt:
        the prompt's own field, as errors name it."""
        try:
            return self.engine.truncate_prompt(ids, keep)
        except InvalidArgument as e:
            raise engine_error(e, {"input_ids": prompt}, prefix) from None

    def check_context(
        self,
        ids: list[int],
        max_tokens: int | None,
        prompt_param: str,
        max_param: str,
        at_least: int = 0,
    ) -> int:
        """The max_new_tokens to use: as requested, or the default (raised to `at_least`, the
        request's min_tokens) capped by the context."""
        n = len(ids)
        if n >= self.context_len:
            raise APIError(
                f"{prompt_param}: the prompt has {n} tokens but the model's context length is "
                f"{self.context_len} (the prompt must be shorter)",
                param=prompt_param,
            )
        if n >= self.kv_tokens:  # (no max_tokens could make it fit: the prompt is at fault)
            raise APIError(
                f"{prompt_param}: the prompt has {n} tokens but the KV cache holds at most "
                f"{self.kv_tokens - 1} for one request (the prompt must be shorter)",
                param=prompt_param,
            )
        room = self.context_len - n
        if max_tokens is None:
            room = max(0, min(room, self.kv_tokens - n))
            default = self.cfg.default_max_tokens
            return room if default is None else min(max(default, at_least), room)
        if max_tokens > room:
            raise APIError(
                f"{max_param}: the context length is {self.context_len} tokens and the prompt "
                f"has {n}, so at most {room} can be generated; {max_tokens} were requested",
                param=max_param,
            )
        if n + max_tokens > self.kv_tokens:
            raise APIError(
                f"{max_param}: the KV cache holds {self.kv_tokens} tokens of one sequence "
                f"(its pages) and the prompt has {n}, so "
                f"at most {max(self.kv_tokens - n, 0)} can be generated; {max_tokens} were "
                "requested",
                param=max_param,
            )
        return max_tokens

    def abort_all(self) -> None:
        """Abort every request in flight (graceful-shutdown timeout)."""
        with self._lock:
            rids = list(self.active_rids.values())
        for rid in rids:
            self.engine.abort(rid)

    def end_all_now(self, message: str) -> None:
        """Finish every open run at once with an abort (a second shutdown signal): streams
        send their error event and [DONE] without waiting for the engine."""
        self.shutting_down = True
        for run in list(self.runs):
            run.end_now(message)
        self.abort_all()

    def abort_error(
        self, meta: dict[str, Any], rename: dict[str, str] | None = None, prefix: str = ""
    ) -> APIError:
        """The error for a request the engine aborted (shutdown, an internal failure, or the
        request's own fault: its grammar, named as the client wrote it through `rename`)."""
        reason = meta.get("finish_reason") or {}
        message = str(reason.get("message") or "request aborted")
        if self.shutting_down or "shut down" in message:
            err = APIError(
                "request aborted: the server is shutting down",
                status=503,
                type="service_unavailable_error",
            )
        elif reason.get("status_code") == 400:  # the request's own fault (its grammar)
            field = reason.get("param")
            param = (rename or {}).get(field, prefix + field) if field else None
            if field and message.startswith(field + ": "):
                message = f"{param}: {message[len(field) + 2 :]}"
            err = APIError(f"request aborted: {message}", param=param)
        else:
            err = APIError(f"request aborted: {message}", status=500, type="server_error")
        err.rejected = False  # it reached the engine
        return err

    # ---- runs ---------------------------------------------------------------------------------
    async def start(
        self,
        prompts: list[list[int]],
        params: list[dict[str, Any]],
        rename: dict[str, str],
        prefix: str = "",
        rids: list[str] | None = None,
        logprob_options: dict[str, Any] | None = None,
        prefixes: list[str] | None = None,
    ) -> Run:
        """Admit and submit each prompt's n samples (sampling parameter `n`) as engine
        requests; choice i * n + j is prompt i's sample j. rids: the client's id of each
        prompt. prefixes: where each prompt's sampling parameters are in the body, where they
        differ (errors; else `prefix`). Raises APIError (400/503).

        A request with structured output is built on the grammar pool, not on the event loop
        (one of more than OFF_LOOP_PROMPT_TOKENS prompt tokens on the server's pool):
        its grammar compiles there (a large JSON schema takes seconds), and every prompt's
        validation reads the schema again (a large one shared by a batch of prompts held
        the event loop, and every other client, for as long). It holds its places in the
        queue (`max_queued_requests`) meanwhile, so such builds cannot pile up past it."""
        held = 0
        if any(sp.get(name) is not None for sp in params for name in GRAMMAR_PARAMS):
            held = sum(_samples(sp) for sp in params)
            self.reserve(held)
        try:
            args = (prompts, params, rename, prefix, rids, logprob_options, prefixes)
            if held:
                loop = asyncio.get_running_loop()
                made, as_text = await loop.run_in_executor(self.pool, self._make_if_compiled, *args)
                if made is None:
                    args = (prompts, as_text, *args[2:])
                    made = await loop.run_in_executor(self.grammar_pool, self._make, *args)
            elif sum(map(len, prompts)) > OFF_LOOP_PROMPT_TOKENS:
                made = await self.off_loop(self._make, *args)
            else:
                made = self._make(*args)
            self.check_healthy()  # (a shutdown may have begun meanwhile)
            total = sum(len(reqs) for reqs, _ in made)
            if total > held:
                self.reserve(total - held)
            elif total < held:
                self.release(held - total)
        except BaseException:
            self.release(held)
            raise
        return self._submit(made, total, rename, prefix)

    def _make_if_compiled(
        self, prompts, params, *rest
    ) -> tuple[list[tuple[list, str | None]] | None, list[dict[str, Any]]]:
        """(`_make`'s requests if every grammar they ask for is compiled already, else None:
        they are built on the grammar pool, behind compiles that may take seconds; the
        parameters with their schemas as text, serialized once for both)."""
        texts: dict[int, str] = {}
        as_text, compiled = [], True
        for sp in params:
            try:
                sp = _schema_as_text(sp, texts)
            except InvalidArgument:  # (refused by `_make`, naming the prompt)
                return None, params
            as_text.append(sp)
            spec = next(((f, sp[f]) for f in GRAMMAR_PARAMS if sp.get(f) is not None), None)
            if spec is not None and not (
                isinstance(spec[1], str) and self.engine.core.grammar_compiled(*spec)
            ):
                compiled = False
        return (self._make(prompts, as_text, *rest) if compiled else None), as_text

    def _make(
        self,
        prompts: list[list[int]],
        params: list[dict[str, Any]],
        rename: dict[str, str],
        prefix: str,
        rids: list[str] | None,
        logprob_options: dict[str, Any] | None,
        prefixes: list[str] | None = None,
    ) -> list[tuple[list, str | None]]:
        """Every prompt's requests with the client's id of the prompt, built (validated)
        before any is admitted: a bad one is a 400 whatever the load, and costs no engine
        work for the prompts before it."""
        try:
            if rids and len(set(rids)) < len(rids):
                repeated = next(r for r in rids if rids.count(r) > 1)
                raise InvalidArgument("rid", f"request id {repeated!r} is given to two prompts")
            # (each option given once, or once per prompt: a list of another length is refused)
            options = normalize_logprob_options(len(prompts), **(logprob_options or {}))
            made, texts = [], {}
            for i, (ids, sp, opts) in enumerate(zip(prompts, params, options)):
                try:
                    sp = _schema_as_text(sp, texts)
                    reqs = self.engine.make_samples(ids, sp, uuid.uuid4().hex, **opts)
                except InvalidArgument as e:
                    if e.field not in PROMPT_FIELDS or len(prompts) == 1:
                        # (a prompt's own sampling parameters are named by its entry)
                        raise engine_error(e, rename, prefixes[i] if prefixes else prefix) from None
                    param = rename.get(e.field, e.field)
                    raise engine_error(e, {e.field: prompt_param(param, i, len(prompts))}) from None
                name = rids[i] if rids else None
                if name:
                    with self._lock:
                        self.check_ids_free(name, sample_rids(name, len(reqs)))
                made.append((reqs, name))
        except InvalidArgument as e:
            raise engine_error(e, rename, prefix) from None
        return made

    def check_ids_free(self, rid: str, names: list[str]) -> None:
        """That neither a prompt's rid nor its samples' names are those of a request or a
        sampled prompt still running (called holding the state's lock)."""
        taken = next(
            (
                r
                for r in dict.fromkeys([rid, *names])
                if r in self.active_rids or r in self.active_prompts
            ),
            None,
        )
        if taken is not None:
            raise InvalidArgument(
                "rid",
                f"request id {taken!r} is in use by a request still running; choose another "
                "id, or reuse it once that request has finished",
            )

    def _prompt_done(self, prompt: str, samples: int = 1) -> None:
        """(called holding the state's lock)"""
        left = self.active_prompts.get(prompt, 0) - samples
        if left > 0:
            self.active_prompts[prompt] = left
        else:
            self.active_prompts.pop(prompt, None)

    def _submit(
        self, made: list[tuple[list, str | None]], total: int, rename: dict[str, str], prefix: str
    ) -> Run:
        """Submit what `_make` built, its `total` places in the queue already taken."""
        run = Run(self, asyncio.get_running_loop(), rename, prefix)
        self.runs.add(run)
        try:
            for reqs, name in made:
                run.submit(reqs, name)
        except InvalidArgument as e:
            run.abort()
            self.release(total - len(run.rids))
            raise engine_error(e, rename, prefix) from None
        except RuntimeError as e:  # the engine has been shut down
            run.abort()
            self.release(total - len(run.rids))
            raise APIError(str(e), status=503, type="service_unavailable_error") from None
        except BaseException:
            run.abort()
            self.release(total - len(run.rids))
            raise
        return run


def _samples(sp: dict[str, Any]) -> int:
    """The requests one prompt's parameters make (`n`, checked by the routes' models; a value
    they let through is refused by the engine when the requests are made)."""
    n = sp.get("n")
    return n if is_int(n) and n >= 1 else 1


def _schema_as_text(sp: dict[str, Any], texts: dict[int, str]) -> dict[str, Any]:
    """The parameters with a JSON schema object as its JSON text, serialized once for the
    prompts that share it (`texts`, by the object's id: the engine would serialize it again
    for every prompt; the request's params hold every schema, so ids stay distinct)."""
    schema = sp.get("json_schema")
    if not isinstance(schema, dict):
        return sp
    if id(schema) not in texts:
        texts[id(schema)] = check_field("json_schema", schema)
    return {**sp, "json_schema": texts[id(schema)]}
