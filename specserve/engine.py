"""The offline API: `Engine(...).generate(...)`, streaming, abort, shutdown.

One background thread runs the step loop; callers submit requests and wait on per-request
queues, so `generate` may be called from several threads at once (the HTTP server does).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.runtime.engine_core import EngineCore
from specserve.runtime.engine_stats import engine_stats
from specserve.runtime.exit_hook import track
from specserve.runtime.gc_heap import freeze_startup_heap, unfreeze_heap
from specserve.runtime.grammar import RequestGrammar, grammar_spec
from specserve.runtime.logprobs import add_logprobs
from specserve.runtime.output import output_or_failure, sample_rids
from specserve.runtime.output_stream import OutputStream
from specserve.runtime.penalties import check_penalties
from specserve.runtime.request import Request
from specserve.runtime.request_inputs import (
    check_rid,
    entry_error,
    normalize_logprob_options,
    normalize_params,
    normalize_prompts,
    normalize_rids,
)
from specserve.runtime.tensor_parallel import start_engine_core
from specserve.sampling_params import FIELDS as SAMPLING_FIELDS
from specserve.sampling_params import INT64_MAX, SamplingParams, check_field, noise_seed

log = logging.getLogger(__name__)


class Engine:
    """Arguments follow SGLang's names; see `EngineConfig` (and `specserve generate --help`)."""

    def __init__(self, **kwargs: Any):
        cfg = EngineConfig.from_kwargs(**kwargs)
        logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.WARNING))
        self.config = cfg.resolve()
        self.config.log_decisions()
        self.core = start_engine_core(self.config)
        # what only the loaded model and the device decide (context length, KV tokens)
        self.config = self.config.with_startup_decisions(self.core.load_decisions)
        freeze_startup_heap()
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # held while checking the engine runs and queueing for its loop, and while stopping
        # it: nothing is queued after the loop's last look at the inbox, unanswered
        self._accepting = threading.Lock()
        self._seed_rng = random.Random(self.config.random_seed)
        self._lock = threading.Lock()
        self.step_hooks: list[Callable[[EngineCore], None]] = []
        # Why the device step failed, once it has: every request in flight was failed, and
        # the server reports the engine unhealthy.
        self.failure: str | None = None
        self._close_at_exit = False  # shut down from the loop's own thread
        self._thread = threading.Thread(target=self._loop, name="specserve-loop", daemon=True)
        self._thread.start()
        track(self)  # (shut down at interpreter exit if still running then)

    # ---- public API ---------------------------------------------------------------------------
    def resolved_args(self) -> dict[str, Any]:
        return self.config.as_dict()

    def stats(self) -> dict[str, Any]:
        """A consistent-enough snapshot for metrics (read without stopping the loop)."""
        return engine_stats(self.core)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        logprob_start_len: int | list[int] = -1,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """One request (str / list[int]) returns a dict; a batch returns a list of dicts.
        A prompt sampled n > 1 times (sampling parameter `n`) gives n dicts: a list for one
        prompt, prompt-major in a batch's flat list, as SGLang. stream=True (one prompt only)
        returns an iterator of incremental outputs, each with the `index` of its sample.
        Log-probs (SGLang's names; a value, or one per prompt): return_logprob adds
        output_token_logprobs (and input_token_logprobs for prompt tokens from
        logprob_start_len on; -1: none) to meta_info; top_logprobs_num > 0 adds the
        likeliest alternatives per position (output_top_logprobs, input_top_logprobs)."""
        if not isinstance(stream, bool):
            raise InvalidArgument("stream", f"must be true or false, got {stream!r}")
        single, prompts = normalize_prompts(prompt, input_ids, self.tokenizer, self._no_tokenizer)
        params = normalize_params(sampling_params, len(prompts))
        rids = normalize_rids(rid, len(prompts))
        options = normalize_logprob_options(
            len(prompts),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        groups = []
        for i, ((p, field), sp, r, opt) in enumerate(zip(prompts, params, rids, options)):
            try:
                groups.append(self._make_requests(p, sp, r, field, opt))
            except InvalidArgument as e:
                if isinstance(sampling_params, list) and e.field in SAMPLING_FIELDS:
                    raise entry_error(e, i) from None
                raise
        reqs = [r for g in groups for r in g]
        names = [r.name for r in reqs]
        if len(set(names)) < len(names):  # (one would be refused as in use by the other)
            repeated = next(n for n in names if names.count(n) > 1)
            raise InvalidArgument(
                "rid",
                f"request id {repeated!r} names two requests of this call (with n > 1 "
                "a prompt's samples are rid-0 .. rid-(n-1))",
            )
        if stream:
            if not single:
                raise InvalidArgument("stream", "streaming takes one prompt at a time")
            return self._stream(reqs)
        self._refuse_on_loop("generate")
        queues = [self._answer_queue(r) for r in reqs]
        self._enqueue_requests(reqs)  # (together: an abort by their rid comes before or after all)
        outs = []
        try:
            for q in queues:
                outs.append(self._wait(q))
        finally:
            if len(outs) < len(reqs):  # a failure raised, or the caller was interrupted
                for req in reqs[len(outs) :]:
                    self._inbox.put(("abort", req))  # (a finished one is left as it is)
                self._wake.set()
        return outs[0] if single and len(outs) == 1 else outs

    def submit(
        self,
        prompt_ids: list[int],
        sampling_params: dict | SamplingParams | None,
        on_output,
        rid: str | None = None,
        **logprob_options: Any,
    ) -> str:
        """Low-level: validated submission of one sample (n = 1) with a callback
        `on_output(dict)` called from the loop thread with incremental outputs."""
        _check_callback(on_output)
        params = SamplingParams.from_any(sampling_params)
        if params.n != 1:
            raise InvalidArgument("n", "submit takes n = 1; submit_samples takes any n")
        rids = self.submit_samples(
            prompt_ids, params, lambda _, out: on_output(out), rid, **logprob_options
        )
        return rids[0]

    def submit_samples(
        self,
        prompt_ids: list[int],
        sampling_params: dict | SamplingParams | None,
        on_output,
        rid: str | None = None,
        **logprob_options: Any,
    ) -> list[str]:
        """Low-level: validated submission of the prompt's n samples (the server uses this).
        `on_output(index, dict)` is called from the loop thread with each sample's incremental
        outputs. Returns the samples' request ids (`rid`, or with n > 1 `rid-0` ...)."""
        _check_callback(on_output)
        reqs = self.make_samples(prompt_ids, sampling_params, rid, **logprob_options)
        return self.submit_made(reqs, on_output)

    def make_samples(
        self,
        prompt_ids: list[int],
        sampling_params: dict | SamplingParams | None,
        rid: str | None = None,
        **logprob_options: Any,
    ) -> list[Request]:
        """The prompt's n sample requests, validated (InvalidArgument), not yet submitted: a
        server builds every prompt's before it admits any."""
        check_rid(rid)
        (opts,) = normalize_logprob_options(1, **logprob_options)
        params = SamplingParams.from_any(sampling_params)
        return self._make_requests(prompt_ids, params, rid, "input_ids", opts)

    def submit_made(self, reqs: list[Request], on_output) -> list[str]:
        """Submit requests from `make_samples`; see `submit_samples`."""
        _check_callback(on_output)
        if any(r.on_output is not None for r in reqs):  # (a second submission would abort it)
            raise InvalidArgument("reqs", "were submitted already; make_samples makes new ones")
        for i, req in enumerate(reqs):
            req.on_output = self._incremental_callback(on_output, i)
        self._enqueue_requests(reqs)
        return [r.name for r in reqs]  # (the engine may key them apart: see add_request)

    def _incremental_callback(self, on_output, index: int):
        tokenizer = self.tokenizer
        return lambda r: on_output(
            index, output_or_failure(r, incremental=True, tokenizer=tokenizer)
        )

    def _enqueue_requests(self, reqs: list[Request]) -> None:
        """Queue requests for the loop, or raise if the engine is shut down."""
        with self._accepting:
            if self._stop.is_set():
                raise RuntimeError("the engine has been shut down")
            for req in reqs:
                self._inbox.put(("add", req))
        self._wake.set()

    def flush_cache(self) -> int:
        """Empty the prefix cache of every page no live request uses (SGLang's flush_cache);
        returns how many pages were dropped. With no request live every page is then free."""
        if threading.current_thread() is self._thread:  # (an output callback: between steps)
            return self.core.flush_cache()
        done: queue.Queue = queue.Queue()
        with self._accepting:
            stopped = self._stop.is_set()
            if not stopped:
                self._inbox.put(("flush", done))
        if stopped:  # the loop thread has ended: nothing else touches the core
            self._thread.join()
            return self.core.flush_cache()
        self._wake.set()
        dropped = done.get()
        if isinstance(dropped, BaseException):
            raise dropped
        return dropped

    def abort(self, rid: str) -> None:
        """Abort the running request submitted as `rid` (with n > 1, all its samples)."""
        check_rid(rid, made_if_none=False)
        with self._accepting:  # (never between the requests of one submission)
            self._inbox.put(("abort", rid))
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (requests in flight fail with a reason), wait up to `timeout` seconds
        for it to end, release the core. Again, or from an output callback: only stops it."""
        with self._accepting:
            if self._stop.is_set():
                return
            self._stop.set()
        self._wake.set()
        if threading.current_thread() is self._thread:
            # (from an output callback: the loop fails what is in flight as it ends, then
            # closes the core itself; it cannot wait for itself)
            self._close_at_exit = True
            return
        self._thread.join(timeout=timeout)  # (its last look at the inbox answers the queue)
        self._close()

    def wait_closed(self, timeout: float | None = None) -> None:
        """Wait for the loop to end after a shutdown (one from an output callback returns at
        once: the loop then fails what is in flight and closes the core itself)."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)

    def _close(self) -> None:
        self.core.close()
        unfreeze_heap()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def tokenize_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt ids of a chat through the model's template (see
        `model.tokenizer.apply_chat_template` for the options, vLLM's names); tools: function
        definitions the template renders (OpenAI's `{"type": "function", "function": {...}}`,
        as transformers passes them)."""
        from specserve.model.tokenizer import apply_chat_template, check_chat_arguments

        if self.tokenizer is None:
            raise InvalidArgument("messages", f"a chat needs a tokenizer ({self._no_tokenizer()})")
        check_chat_arguments(
            self.tokenizer, messages, add_generation_prompt, continue_final_message,
            template_kwargs,
        )  # fmt: skip
        if add_generation_prompt and continue_final_message:
            raise InvalidArgument(
                "continue_final_message",
                "cannot be true with add_generation_prompt true (the final message is either "
                "continued or followed by the assistant's turn); set add_generation_prompt "
                "to false",
            )
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise InvalidArgument("tools", "must be a list of tool definitions (dicts) or None")
        if tools:  # (apply_chat_template's own argument, passed beside the template's variables)
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        try:
            return apply_chat_template(
                self.tokenizer, messages, add_generation_prompt, continue_final_message,
                template_kwargs,
            )  # fmt: skip
        except ValueError as e:  # (no chat template, or the template refused the messages)
            raise InvalidArgument("messages", str(e)) from None

    def _no_tokenizer(self) -> str:
        """Why this engine has no tokenizer."""
        if self.config.skip_tokenizer_init:
            return "skip_tokenizer_init is on"
        return "the model has no tokenizer"

    # ---- inputs -----------------------------------------------------------------------------
    def _make_requests(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str | None,
        field: str,
        logprob_options: dict[str, Any],
    ) -> list[Request]:
        """The prompt's n requests: sample i draws with seed + i when the prompt has a seed,
        else each its own random seed; samples after the first wait for its prefill
        (`prefill_after`), to reuse the prompt's pages."""
        ids = self.truncate_prompt(ids, params.truncate_prompt_tokens, field)
        opts, compiled = self._check_request(ids, params, field, logprob_options)
        grammar_field = None if compiled is None else grammar_spec(params)[0]
        if not opts["return_logprob"]:
            opts["logprob_start_len"] = -1  # (a cached prefix may then cover the prompt)
        with self._lock:
            seeds = [
                noise_seed((params.seed + i) % (INT64_MAX + 1))
                if params.seed is not None
                else self._seed_rng.getrandbits(31)
                for i in range(params.n)
            ]
        rid = rid or uuid.uuid4().hex
        names = sample_rids(rid, params.n)
        reqs = [
            Request(
                rid=names[i],
                prompt_ids=list(ids),
                params=params,
                seed=seed,
                sample_of=rid if params.n > 1 else None,
                grammar=None if compiled is None else RequestGrammar(compiled, grammar_field),
                **opts,
            )
            for i, seed in enumerate(seeds)
        ]
        for r in reqs[1:]:
            r.prefill_after = reqs[0]
        return reqs

    def truncate_prompt(
        self, ids: list[int], keep: int | None, field: str = "input_ids"
    ) -> list[int]:
        """The prompt's last `keep` tokens (sampling parameter truncate_prompt_tokens; -1:
        the longest prompt the engine takes); as given when `keep` is None. The tokens cut
        off are checked too: a bad id is refused, not dropped unseen."""
        keep = check_field("truncate_prompt_tokens", keep)
        if keep is None or not isinstance(ids, (list, tuple)):
            return ids  # (a prompt that is not a list is refused by the prompt's own check)
        longest = min(self.core.context_len - 1, self.core.scheduler.max_prompt_tokens())
        if keep > longest:
            raise InvalidArgument(
                "truncate_prompt_tokens",
                f"must be -1 or in [1, {longest}] (the longest prompt this engine takes), "
                f"got {keep}",
            )
        kept = longest if keep == -1 else keep
        if len(ids) > kept:  # (the part kept is checked with the prompt, once cut)
            self.core.check_token_ids(ids[:-kept], field)
        return ids[-kept:]

    def _check_request(
        self, ids: list[int], params: SamplingParams, field: str, logprob_options: dict[str, Any]
    ) -> tuple[dict[str, Any], Any]:
        """What a prompt's requests need beyond their parameters' own checks; returns the
        log-prob options with their defaults and the compiled grammar of structured output."""
        self.core.validate_prompt(ids, field)
        vocab = self.core.model_config.vocab_size
        # (a stop token outside it could never be sampled, so never stop the request)
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            outside = next((t for t in getattr(params, name) or () if t >= vocab), None)
            if outside is not None:
                raise InvalidArgument(
                    name, f"token id {outside} is outside the vocabulary [0, {vocab})"
                )
        check_penalties(params, self.config.tp_size, self.core.eos_token_ids)
        compiled = self.core.compile_grammar(params)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "stop strings need a tokenizer; use stop_token_ids")
        opts = {"return_logprob": False, "logprob_start_len": -1, **logprob_options}
        if opts["return_logprob"] and opts["logprob_start_len"] >= len(ids):
            raise InvalidArgument(
                "logprob_start_len",
                f"must be -1 or a prompt position in [0, {len(ids)}), got {opts['logprob_start_len']}",
            )
        return opts, compiled

    # ---- plumbing ---------------------------------------------------------------------------
    def _answer_queue(self, req: Request) -> queue.Queue:
        """The queue of the request's one output, when it finishes (no per-step dicts or
        thread wake-ups for a caller that only wants the result)."""
        q: queue.Queue = queue.Queue()
        tok = self.tokenizer
        req.text_at_finish = True
        req.on_output = lambda r: q.put(output_or_failure(r, tokenizer=tok)) if r.finished else None
        return q

    def _refuse_on_loop(self, what: str) -> None:
        if threading.current_thread() is self._thread:  # (it would wait for itself forever)
            raise RuntimeError(
                f"{what} is read as the engine's loop produces it, and the loop runs this "
                "output callback; use submit from a callback"
            )

    def _wait(self, q: queue.Queue) -> dict:
        text, ids, logprobs = [], [], {}
        while True:
            out = q.get()
            if isinstance(out, BaseException):
                raise out
            text.append(out["text"])
            ids.extend(out["output_ids"])
            add_logprobs(logprobs, out["meta_info"])
            if out["finished"]:
                out["text"], out["output_ids"] = "".join(text), ids
                out["meta_info"].update(logprobs)
                return out

    def _stream(self, reqs: list[Request]) -> OutputStream:
        """Incremental outputs of the samples of one prompt, as they come, each with its
        sample's `index` (the requests submitted now)."""
        self._refuse_on_loop("a stream")
        q: queue.Queue = queue.Queue()
        for i, req in enumerate(reqs):
            req.on_output = self._incremental_callback(lambda idx, out: q.put((idx, out)), i)
        self._enqueue_requests(reqs)

        def abort(indices: list[int]) -> None:
            for i in indices:
                self._inbox.put(("abort", reqs[i]))  # that request, whatever its id names now
            self._wake.set()

        return OutputStream(q, len(reqs), abort)

    def _loop(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self._drain_inbox()
            if not core.has_work():
                if core.idle_work():
                    continue  # (one graph captured; the inbox is read before the next)
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                touched = core.step()
            except torch.OutOfMemoryError as e:
                log.exception("engine step ran out of device memory")
                touched = core.touched_by_failed_step() + self._after_out_of_memory(e)
            except Exception as e:  # the device step itself is broken (a request's own host
                # work fails that request alone, in EngineCore): fail the live requests
                self.failure = f"the engine step failed: {type(e).__name__}: {e}"
                log.exception("engine step failed; failing every request in flight")
                touched = core.touched_by_failed_step()
                touched += self._fail_all(f"internal error: {type(e).__name__}: {e}")
            try:
                for hook in self.step_hooks:
                    hook(core)
            except Exception as e:  # a failing check fails the requests, not the loop; the
                # step's own outputs (requests it finished and reaped) still go out
                log.exception("step hook failed")
                touched = touched + self._fail_all(f"step hook: {type(e).__name__}: {e}")
            for r in touched:
                finished, start = r.finished, time.perf_counter()
                self._deliver(r)
                if finished:  # (a request's completion is not a step's host time)
                    core.host_clock.set_aside(time.perf_counter() - start)
        self._drain_inbox()
        for r in self._fail_all("engine shut down"):
            self._deliver(r)
        if self._close_at_exit:
            self._close()

    @staticmethod
    def _deliver(req: Request) -> None:
        if req.on_output is None or req.final_output_sent:
            return
        try:
            req.on_output(req)
        except Exception as e:  # fails this request alone; the next step reaps and reports it
            log.exception("output callback of %s failed", req.rid)
            req.finish("abort", message=f"output callback failed: {type(e).__name__}: {e}")
        else:  # (one that ended while its output was built was told so: not again at reaping)
            req.final_output_sent = req.finished

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if self._stop.is_set():
                    item.finish("abort", message="engine shut down")
                    self._deliver(item)
                    continue
                try:
                    self.core.add_request(item)
                except InvalidArgument as e:
                    item.finish("abort", message=str(e))
                    self._deliver(item)
                except Exception as e:  # a bug met by this request fails it, not the loop
                    log.exception("adding request %s failed", item.rid)
                    item.finish("abort", message=f"internal error: {type(e).__name__}: {e}")
                    self._deliver(item)
            elif kind == "flush":
                try:
                    item.put(self.core.flush_cache())
                except Exception as e:  # raised to the caller of flush_cache
                    log.exception("flushing the prefix cache failed")
                    item.put(e)
            else:
                try:
                    self._abort(item)
                except Exception:  # the request runs on; the loop must not end here
                    log.exception("aborting %r failed", item)

    def _abort(self, item: str | Request) -> None:
        if self.core.abort(item) is None and isinstance(item, str):
            # (reaped and reported by the next step) a prompt's n samples are known by the
            # rid they were submitted with (not by their names' prefix: a request submitted
            # as 'x-1' is no sample of 'x')
            for req in [r for r in self.core.by_name.values() if r.sample_of == item]:
                self.core.abort(req)

    def _after_out_of_memory(self, error: torch.OutOfMemoryError) -> list[Request]:
        """Retract the started requests to run fewer at once (EngineCore says how), or, on
        tensor-parallel ranks or should that fail, fail every request as for a broken step."""
        if self.core.tp is None:
            try:
                return self.core.retract_after_out_of_memory(error)
            except Exception:
                log.exception("retracting the requests after running out of memory failed")
        self.failure = f"the engine step failed: {type(error).__name__}: {error}"
        return self._fail_all(f"internal error: {type(error).__name__}: {error}")

    def _fail_all(self, message: str) -> list[Request]:
        # A step in flight is abandoned: its results are never applied.
        self.core.pending = None
        failed = []
        for r in list(self.core.requests.values()):
            r.inflight_steps = 0
            r.kv_trusted = False  # the broken step may have written it
            r.finish("abort", message=message)
            if not r.finish_reported:
                r.finish_reported = True
                failed.append(r)
        try:
            self.core._reap_finished()
        except Exception:  # the failed requests still go out; a raise here would kill the
            # loop thread and leave every caller waiting
            log.exception("releasing the failed requests' state failed")
        return failed


def _check_callback(on_output) -> None:
    # (else the request fails at its first output, on the loop, where its caller never hears)
    if not callable(on_output):
        raise InvalidArgument("on_output", f"must be callable, got {type(on_output).__name__}")
