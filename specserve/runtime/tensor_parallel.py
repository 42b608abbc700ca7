"""Tensor parallelism's processes: rank 0 schedules, every rank runs the same worker calls.

`start_engine_core(cfg)` with tp_size 1 is `EngineCore(cfg)`, nothing more. Otherwise rank 0,
the caller's process, checks that the model divides, serves a rendezvous store on a free
local port, spawns ranks 1..tp-1 (torch.multiprocessing, spawn) and builds its EngineCore on
its shard. Every rank builds the same EngineCore on its own shard (the same rows, drafter and
KV layout), but only rank 0's scheduler runs: its Worker is wrapped in `LeaderWorker`, which
sends each call that runs the model, with its host inputs (the page-table changes since the
last call, the requests' tokens and sampling parameters, the chunk bounds, the step's rows
and bounds), down a pipe to every other rank before making the call itself. A rank replays
it on its own Worker (`Follower`), and the model's collectives pair the ranks up inside the
call. Sampling noise depends only on (seed, position, token), and every rank computes from
the same all-reduced activations, so the ranks draw the same tokens and accept the same
paths: their device state stays identical and nothing is sent back.

Failure ends the group: a rank that raises reports why and exits; one that dies closes its
sockets, so gloo fails the peers' collectives at once (NCCL has no such signal: rank 0
watches its ranks' processes and aborts the group); every collective also has a timeout.
Rank 0 then fails the step with the rank's reason, and every later one at once. Ranks > 0
ignore SIGINT (rank 0 ends them), watch rank 0's process and leave when it is gone.
`EngineCore.close` (called by `Engine.shutdown`) stops and joins them.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import wait as wait_for

import torch
import torch.multiprocessing as mp

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.model.loader import read_model_config
from specserve.model.sharding import check_shardable
from specserve.ops.collectives import TensorParallel, connect_rendezvous, serve_rendezvous
from specserve.runtime.capacity import context_length
from specserve.runtime.engine_core import EngineCore
from specserve.runtime.gc_heap import freeze_startup_heap, unfreeze_heap
from specserve.runtime.logprobs import TokenLogprobs
from specserve.runtime.request import PrefillChunk, Request
from specserve.speculative.factory import check_draft_readable

log = logging.getLogger(__name__)

# A collective waits this long for a slow peer (loading its shard can take minutes) before it
# fails; a dead peer is noticed long before (closed sockets, or the process watch).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
JOIN_SECONDS = 10.0


def start_engine_core(cfg: EngineConfig) -> EngineCore:
    if cfg.tp_size == 1:
        return EngineCore(cfg)
    check_shardable(_model_config(cfg), cfg.tp_size)
    store = serve_rendezvous(cfg.tp_size, COLLECTIVE_TIMEOUT)
    peers = Peers.spawn(cfg, store)
    try:
        peers.await_ranks()
        tp = TensorParallel.join(0, cfg.tp_size, _rank_device(cfg, 0), COLLECTIVE_TIMEOUT, store)
        peers.watch(tp)
        core = EngineCore(cfg, tp)
    except BaseException as e:
        reason = peers.failure()
        peers.stop()
        # rank 0's own refusal (every rank refuses alike) stays what it is; a collective that
        # failed because a rank died says which rank and why
        if reason is not None and not isinstance(e, InvalidArgument):
            raise RuntimeError(f"tensor parallelism failed to start: {reason}") from e
        raise
    core.peers = peers
    core.worker = LeaderWorker(core.worker, peers)
    return core


def _model_config(cfg: EngineConfig):
    """The model's shape, read before any rank starts; an unreadable model or draft, or a
    context_length past the model's positions, is refused as with tp_size 1 (EngineCore
    would refuse them seconds later, once every rank had started)."""
    model = read_model_config(cfg.model_path, cfg.load_format)
    context_length(cfg, model)
    check_draft_readable(cfg, model)
    return model


def _rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if cfg.device.startswith("cuda") else torch.device("cpu")


# ---- rank 0 ------------------------------------------------------------------------------------
class Peers:
    """Ranks 1..tp-1 as seen from rank 0: their processes and the pipes to them."""

    def __init__(self, procs, conns, store):
        self.procs = procs
        self.conns = conns
        self._store = store  # rank 0 serves the rendezvous for as long as the group lives
        self._stopping = False
        self._reported: dict[int, str] = {}

    @classmethod
    def spawn(cls, cfg: EngineConfig, store) -> Peers:
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, cfg.tp_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(rank, cfg, store.port, theirs, os.getpid(), torch.get_num_threads()),
                name=f"specserve-tp{rank}",
                daemon=True,
            )
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        return cls(procs, conns, store)

    def await_ranks(self) -> None:
        """Wait until every rank has reached the rendezvous, or fail as soon as one died
        (the group's own rendezvous would wait for it until the timeout)."""
        keys = [_arrived(rank) for rank in range(1, len(self.procs) + 1)]
        while not self._store.check(keys):
            reason = self.failure(wait=0.0)
            if reason is not None:
                raise RuntimeError(reason)
            time.sleep(0.02)

    def watch(self, tp: TensorParallel) -> None:
        """Abort the group's collectives when a rank dies (NCCL would wait for it)."""

        def watch() -> None:
            wait_for([p.sentinel for p in self.procs])
            if not self._stopping:
                log.error("tensor parallelism: %s", self.failure(wait=0.0))
                tp.abort()

        threading.Thread(target=watch, name="specserve-tp-watch", daemon=True).start()

    def send(self, message) -> None:
        reason = self.failure(wait=0.0)
        if reason is not None:
            raise RuntimeError(f"tensor parallelism: {reason}")
        for conn in self.conns:
            conn.send(message)

    def receive(self) -> list:
        """One reply from each rank (debug queries)."""
        replies = []
        for rank, conn in enumerate(self.conns, start=1):
            reply = conn.recv()
            if reply[0] == "error":
                self._reported[rank] = reply[1]
                raise RuntimeError(f"tensor parallelism: rank {rank} failed: {reply[1]}")
            replies.append(reply[1])
        return replies

    def failure(self, wait: float = 5.0) -> str | None:
        """Why the group is broken (a rank exited, or reported an error), else None. wait:
        how long to give a rank whose sockets closed to finish exiting (on a loaded 2-core
        machine a killed rank was not yet reaped after 1 s, and the reason read as rank 0's
        socket error)."""
        deadline = time.monotonic() + wait
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            try:
                while rank not in self._reported and conn.poll():
                    kind, text = conn.recv()
                    if kind == "error":
                        self._reported[rank] = text
            except (EOFError, OSError):
                pass
            if rank in self._reported:
                return f"rank {rank} failed: {self._reported[rank]}"
            if p.exitcode is not None:
                code = p.exitcode
                how = (
                    f"was killed by {signal.Signals(-code).name}"
                    if code < 0
                    else f"exited ({code})"
                )
                return f"rank {rank} {how}"
        return None

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + JOIN_SECONDS
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # stuck in a collective rank 0 left: it cannot finish
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()


class _RecordingMirror:
    """Rank 0's page-table mirror: updates its RequestRows and logs the change for the others."""

    def __init__(self, rows, ops: list):
        self.rows = rows
        self.ops = ops

    def on_pages_added(self, rid: str, first_index: int, pages: list[int]) -> None:
        self.rows.on_pages_added(rid, first_index, pages)
        self.ops.append(("pages", rid, first_index, list(pages)))

    def on_release(self, rid: str) -> None:
        self.rows.on_release(rid)
        self.ops.append(("release", rid))


class LeaderWorker:
    """Rank 0's Worker as the scheduler sees it: a call that runs the model is first sent,
    with everything logged since the last one, to the other ranks. Anything else is the
    wrapped Worker's."""

    def __init__(self, worker, peers: Peers):
        self._worker = worker
        self._peers = peers
        self._ops: list = []
        self._broken: str | None = None
        worker.table.mirror = _RecordingMirror(worker.rows, self._ops)

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def prefill(self, chunks: list[PrefillChunk]):
        return self._call(
            ("prefill", [_chunk_message(c) for c in chunks]), self._worker.prefill, chunks
        )

    def launch_decode(
        self,
        reqs: list[Request],
        kv_upper: list[int],
        tier: int = 0,
        timed: bool = False,
        catch_up: bool = False,
    ):
        # which requests stopped speculating (adaptive speculation) shapes the step too
        stale = [r.rid for r in reqs if r.draft_stale]
        rids = [r.rid for r in reqs]
        message = ("decode", rids, list(kv_upper), tier, catch_up, stale)
        return self._call(
            message, self._worker.launch_decode, reqs, kv_upper, tier, timed, catch_up
        )

    def capture_wanted(self) -> bool:
        # every rank captures the same graph: their steps replay the same shapes' graphs.
        # (Every rank wants what rank 0 wants: the same steps decided it.)
        graphs = self._worker.graphs
        if graphs is None or not graphs.wanted:
            return False  # (no message to the ranks on every idle tick)
        return self._call(("capture_wanted",), self._worker.capture_wanted)

    def forget(self, rid: str) -> None:
        self._ops.append(("forget", rid))
        self._worker.forget(rid)

    def observe_tokens(self, tokens_by_request) -> None:
        self._ops.append(("observe", {rid: list(t) for rid, t in tokens_by_request.items()}))
        self._worker.observe_tokens(tokens_by_request)

    def _call(self, call, fn, *args):
        if self._broken is not None:
            raise RuntimeError(self._broken)
        ops, self._ops[:] = list(self._ops), []
        try:
            self._peers.send((ops, call))
            return fn(*args)
        except Exception as e:
            reason = self._peers.failure()
            self._broken = (
                f"tensor parallelism: {reason or f'rank 0 failed: {type(e).__name__}: {e}'}"
            )
            raise RuntimeError(self._broken) from e

    def check_replicas(self, rids: list[str]) -> None:
        """Raise unless every rank holds what rank 0 holds for these requests: pages (host
        table and device rows), KV lengths, roots and draft features (tests, debugging)."""
        counts = [len(self.table.pages(r)) for r in rids]
        mine = _replica_state(self._worker, rids, counts)
        self._peers.send((list(self._ops), ("state", rids, counts)))
        self._ops.clear()
        for rank, theirs in enumerate(self._peers.receive(), start=1):
            for key, value in mine.items():
                same = (
                    torch.equal(value, theirs[key])
                    if torch.is_tensor(value)
                    else value == theirs[key]
                )
                if not same:
                    raise AssertionError(f"rank {rank}'s {key} differs from rank 0's")


def _replica_state(worker, rids: list[str], page_counts: list[int]) -> dict:
    rows = worker.rows
    live = torch.tensor(
        rows.rows_of([r for r, n in zip(rids, page_counts) if n]), dtype=torch.int64
    )
    dev = live.to(rows.device)
    state = {
        "table pages": [worker.table.pages(r)[:n] for r, n in zip(rids, page_counts)],
        "rows": live.tolist(),
        "device page table": rows.pages[dev].cpu(),
        "kv lengths": rows.kv_lens[dev].cpu(),
        "roots": rows.roots[dev].cpu(),
        "cpu threads": torch.get_num_threads(),  # (the replicas' bits on a CPU depend on it)
    }
    if rows.features is not None:
        state["draft features"] = rows.features[dev].cpu()
    return state


def _chunk_message(c: PrefillChunk) -> tuple:
    r = c.req
    request = (
        r.rid,
        r.prompt_ids,
        r.output_ids,
        r.params,
        r.seed,
        r.return_logprob,
        r.top_logprobs_num,
        r.logprob_start_len,
        len(r.logprobs.input),  # how far prompt log-probs got (the chunk computes the rest)
    )
    return request, c.start, c.end, c.copy_page, c.first


# ---- ranks 1..tp-1 -----------------------------------------------------------------------------
class Follower:
    """Replays rank 0's worker calls on this rank's EngineCore (its scheduler stays idle)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.worker = core.worker
        self.requests: dict[str, Request] = {}  # sampling inputs of the requests holding rows

    def apply(self, message):
        ops, call = message
        for op in ops:
            kind = op[0]
            if kind == "pages":
                self.core.table.follow_added(*op[1:])
            elif kind == "release":
                self.core.table.follow_released(op[1])
            elif kind == "forget":
                self.requests.pop(op[1], None)
                self.worker.forget(op[1])
            else:
                self.worker.observe_tokens(op[1])
        kind = call[0]
        if kind == "prefill":
            self.worker.prefill([self._chunk(*c) for c in call[1]])
        elif kind == "decode":
            _, rids, kv_upper, tier, catch_up, stale = call
            reqs = [self.requests[r] for r in rids]
            for r in reqs:
                r.draft_stale = r.rid in stale
            self.worker.launch_decode(reqs, kv_upper, tier, catch_up=catch_up)
        elif kind == "capture_wanted":
            self.worker.capture_wanted()
        else:  # "state"
            return _replica_state(self.worker, call[1], call[2])
        return None

    def _chunk(self, request, start, end, copy_page, first) -> PrefillChunk:
        rid, prompt, output, params, seed, logprob, top, logprob_start, done = request
        req = Request(
            rid,
            prompt,
            params,
            seed,
            return_logprob=logprob,
            top_logprobs_num=top,
            logprob_start_len=logprob_start,
        )
        req.output_ids = output
        req.logprobs.input = TokenLogprobs([None] * done, [None] * done)
        self.requests[rid] = req
        return PrefillChunk(req, start, end, copy_page, first)


def _rank_main(
    rank: int, cfg: EngineConfig, port: int, conn, parent_pid: int, cpu_threads: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 ends them
    # rank 0's thread count, whatever its process set: a CPU matmul's bits depend on how many
    # threads share it, and the replicated parts (draft, sampler) must agree to the bit
    torch.set_num_threads(cpu_threads)
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.WARNING))
    _leave_with_parent(parent_pid)
    try:
        device = _rank_device(cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = connect_rendezvous(port, cfg.tp_size, COLLECTIVE_TIMEOUT)
        store.set(_arrived(rank), "1")
        tp = TensorParallel.join(rank, cfg.tp_size, device, COLLECTIVE_TIMEOUT, store)
        follower = Follower(EngineCore(replace(cfg, device=str(device)), tp))
        freeze_startup_heap()
        while (message := conn.recv()) is not None:
            reply = follower.apply(message)
            if reply is not None:
                conn.send(("state", reply))
        # (a frozen heap is never freed: the process would end with Triton's objects alive,
        # each reported as leaked)
        unfreeze_heap()
    except EOFError:  # rank 0 is gone
        os._exit(1)
    except BaseException as e:
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        if isinstance(e, InvalidArgument):  # (rank 0 refuses the same, and says so)
            log.error("tensor-parallel rank %d: %s", rank, e)
        else:
            log.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)


def _arrived(rank: int) -> str:
    return f"arrived/{rank}"


def _leave_with_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (killed: it could not stop this rank itself)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="specserve-tp-parent", daemon=True).start()
