"""CUDA graphs for decode steps: the whole step (draft, verify, sampling, acceptance, KV
compaction, draft extend, state write-back) is captured once per shape and replayed.

A step's shapes depend on three host values, which key the graphs:
- the batch size, padded up to a bucket (1, 2, 4, 8, then multiples of 16); padding rows use
  `PAD_ROW`, whose KV is the scratch page;
- the context width, padded up to a power of two (>= 256): every request's KV indices are
  laid out in a [bs, width] block, and the attention launch plan is sized for it;
- the sampling mode (all greedy; filters on or off; log-probs on or off and their top-k
  width; penalties on or off), which selects host-side code paths and output shapes.
A graph's one static input is its batch's rows: a step reads each request's pages, KV length
and sampling parameters by row on the device. Graphs are captured from padding-only inputs
(so capture writes nothing but scratch) and share one memory pool: the greedy and the plain
sampled step of every batch bucket at the shortest width when the engine starts
(`capture_at_start`: kernels compile then, not in a request's time; under adaptive
speculation its timing captures the greedy step of every tier instead, and tensor-parallel
ranks capture nothing at start), the rest as steps meet them. A shape without a graph
replays the smallest captured graph that covers it (same sampling mode and tier, batch and
width buckets at least as large, and at most `MAX_COVER_FACTOR` times: more padding rows, a
wider KV layout) and gets its own graph when the engine is idle (`capture_wanted`) or once
it has served `LONG_LIVED_SHAPE_STEPS` steps in a row (a request outliving its batch); a
shape nothing covers runs eagerly for its first `EAGER_STEPS` steps (about a capture's
time; a batch's tail passes most shapes in fewer), then is captured, or is captured when
the engine idles. A capture that finds no device memory, at start or while serving, leaves
its shape to eager steps on the batch's rows. Under load-adaptive speculation a step's key also names its
tier; an idle engine captures every tier that has run, or was timed at engine start, at a
batch bucket at every context width met there, so that the next wave of requests, whose
tails pass the same shapes with other tiers, does not stop to capture them. Anything
outside the buckets runs eagerly through the same `DecodeStep.run`.

The rows are copied into each graph's static tensor before a replay; that copy and the
replay are ordered on the stream after the previous step, so under overlap scheduling the
host can prepare step k+1 while step k still runs.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from specserve.kv.request_rows import PAD_ROW
from specserve.ops.sampling import SamplingMode, SamplingTensors
from specserve.runtime.graph_capture import (
    capture_graph,
    capture_unless_out_of_memory,
    copy_from_host,
    pow2_bucket,
    synchronize_device,
)
from specserve.speculative.step import StepOutputs

log = logging.getLogger(__name__)

MIN_WIDTH = 256
# A shape (batch bucket, width bucket, sampling mode) that has served this many steps in a
# row is long-lived: widths double, so it serves many more, and a tier captured there to be
# explored, or its own graph where a larger one covered it, pays its capture back. A
# short-lived shape (a batch's shrinking tail, met again and again for a few steps) would
# not.
LONG_LIVED_SHAPE_STEPS = 64
# A shape no graph covers runs eagerly for this many steps before it is captured. A capture
# runs the step three times (two warm-up runs, then the captured one) and instantiates the
# graph: as long as 3-4.5 eager steps (SmolLM2 on an H200: captures of 54-78 ms, eager steps
# of 15-25 ms, launch-bound), so eager steps up to a capture's worth, then the capture, cost
# at most twice what knowing how long the shape lives would (rent, then buy). A batch's tail
# passes most shapes in fewer steps; one that lives on is captured, and one that does not is
# captured when the engine idles. (At 8 eager steps, a shape met in a timed SmolLM2 run
# stalled it for 0.2 s: eight 17-19 ms eager steps and a 60 ms capture.)
EAGER_STEPS = 4
# A graph covers a shape only if its batch and width buckets are at most this many times the
# shape's: padding rows cost device time where the device sets the pace (SmolLM2's 6/8/64
# tree on an H200: 1.5 ms a step at batch 1, 5.0 ms at 64; the 8B shape plain: 4.9 ms at
# batch 1, 15 ms at 256), and until the engine idles or the shape turns long-lived (up to 64
# steps) a far larger graph could cost more than the capture it saves (0.05-0.3 s).
MAX_COVER_FACTOR = 4
# The sampling modes captured at engine start: greedy, and sampling with a temperature and no
# filter (the OpenAI routes' default, temperature 1). Each mode runs kernels of its own (the
# sampler's noise, tree rejection sampling), compiled at a mode's first capture at each batch
# bucket: without this, a server's first default-sampled request at each batch size waited
# for them. Filters (top-k / top-p / min-p), log-probs and penalties are captured as met:
# each would add a graph per bucket, and a filtered step sorts every sampled row's
# probabilities (float32 values and int64 indices: three times its logits' memory).
PENALIZED = 7  # a graph key's penalties flag: (batch, width, *the sampling mode, tier, catch-up)
GREEDY = SamplingMode(all_greedy=True, needs_filter=False)
START_MODES = (GREEDY, SamplingMode(all_greedy=False, needs_filter=False))


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and max_bs itself. Triton specializes a kernel on its
    integer arguments' divisibility by 16: on an H200 at the 8B shape the first capture at 24
    or 56 rows took 0.8-4 s per tier (stalling the step that met it), at 48 rows 0.1 s, since
    multiples of 16 reuse the variants compiled at start-up."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_bs} | set(range(16, max_bs, 16)) | {max_bs}
    return sorted(sizes)


class ReadyTiers(AbstractSet[int]):
    """The tiers of a step's shape that replay without a capture, each looked up once, when
    asked: the policy mostly asks about its best tier alone (looking every tier up took about
    0.1 ms of the host's 1.8 ms per step of SmolLM2 at batch 128 on an H200)."""

    def __init__(self, replayable: Callable[[int], bool], count: int):
        self._replayable = replayable
        self._count = count
        self._known: dict[int, bool] = {}

    def __contains__(self, tier: object) -> bool:
        try:
            t = operator.index(tier)  # type: ignore[arg-type]
        except TypeError:
            return False  # (not a tier: 1.0 is not tier 1)
        if not 0 <= t < self._count:
            return False
        if t not in self._known:
            self._known[t] = self._replayable(t)
        return self._known[t]

    def __iter__(self) -> Iterator[int]:
        return (t for t in range(self._count) if t in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _from_iterable(cls, it) -> frozenset[int]:  # (what &, |, - return)
        return frozenset(it)

    def looked_up(self) -> dict[int, bool]:
        """The tiers asked about so far, and whether each replays."""
        return dict(self._known)

    def __repr__(self) -> str:
        return f"ReadyTiers({sorted(self)})"


@dataclass
class _Captured:
    graph: object | None  # torch.cuda.CUDAGraph; None when not capturing (see DecodeGraphs)
    step: object  # the step over the static inputs (what the graph replays)
    rows: torch.Tensor  # [bs] static input (the step gathers its sampling parameters by row)
    outputs: tuple | None  # the graph's static outputs: DecodeStep.run's, as captured


class DecodeGraphs:
    def __init__(
        self,
        worker,
        max_bs: int,
        max_width: int,
        capture: bool = True,
        eager_without_memory: bool = True,
    ):
        """capture=False runs the same padded, fixed-shape steps eagerly instead of replaying
        graphs: how the padding and bucketing logic is tested on machines without CUDA.
        eager_without_memory=False: a capture without device memory raises (tensor-parallel
        ranks, whose steps must stay alike)."""
        self.worker = worker
        self.capture = capture
        self.eager_without_memory = eager_without_memory
        self.buckets = batch_buckets(max_bs)
        self.max_width = max_width
        self.graphs: dict[tuple, _Captured] = {}
        self.streak: tuple[tuple | None, int] = (None, 0)  # the last shape, its steps in a row
        # A capture stalls every request: on an H200 0.06-0.3 s for SmolLM2 against 2-5 ms
        # steps, 0.05-0.26 s at the 8B shape against 5-30 ms. A covering graph costs a step
        # only its padding rows' work (nothing where the host sets the pace), and a batch's
        # shrinking tail meets a new batch bucket every few steps: capturing each there
        # stalled the last steps of a SmolLM2 batch of 64 for 0.18 s, 70 steps' time. So a
        # covered shape's own graph waits for an idle engine, or for the shape to be
        # long-lived.
        self.wanted: dict[tuple, None] = {}  # keys to capture when idle, in order
        # per (batch bucket, sampling mode) met: the widths, and the (tier, catch-up) run there
        self._met: dict[tuple, tuple[dict[int, None], dict[tuple, None]]] = {}
        # per batch bucket: the (tier, catch-up) timed there at engine start (`step_seconds`),
        # wanted like those run there in every sampling mode (kept when graphs are dropped:
        # the timing is not redone)
        self._timed: dict[int, dict[tuple, None]] = {}
        self._covers: dict[tuple, tuple | None] = {}  # key -> the captured key covering it
        self.pool = None
        self._rows_version = worker.rows.version
        self._attached_version = worker.rows.attached_version
        self.num_captures = 0  # captured while a step (or engine start) waited
        self.num_idle_captures = 0  # captured while no request was running or waiting
        self.captured_last = False  # the last run captured its graph
        self.covered_last = False  # the last run replayed a larger shape's graph
        self.eager_last = False  # the last run left a shape nothing covers to an eager step
        self.ran_rows_last = False  # the last run ran the step on the batch's rows
        self._eager: dict[tuple, _Captured] = {}  # those shapes' padded steps, not captured
        self._eager_steps: dict[tuple, int] = {}  # and how many steps each ran eagerly
        # shapes whose capture ran out of device memory, at start or while serving: their
        # steps run eagerly on the batch's rows alone (until the graphs are dropped)
        self._no_memory: dict[tuple, None] = {}

    def bucket(self, bsz: int, width: int) -> tuple[int, int] | None:
        bs = next((b for b in self.buckets if b >= bsz), None)
        if bs is None or width > self.max_width:
            return None
        return bs, min(pow2_bucket(width, MIN_WIDTH), self.max_width)

    def run(
        self,
        rows: list[int],
        mode: SamplingMode,
        width: int,
        tier: int = 0,
        catch_up: bool = False,
    ) -> StepOutputs | None:
        """Replay the step for these rows: DecodeStep.run's outputs for the real rows; None
        when the batch is too large for a graph (the caller runs it eagerly). A shape
        without a graph replays a larger one covering it; one nothing covers runs its padded
        step eagerly for `EAGER_STEPS` steps, then is captured for this step's tier alone:
        load-adaptive speculation explores only tiers it can replay at a shape
        (`ready_tiers`), so no other tier's capture is needed to explore."""
        self.covered_last = self.captured_last = self.eager_last = False
        self.ran_rows_last = False
        shape = self.bucket(len(rows), width)
        if shape is None:
            return None
        self._drop_stale_graphs()
        key = self._key(shape, mode, tier, catch_up)
        self._want_alike(key)
        last, steps = self.streak
        self.streak = (key[:-2], steps + 1 if key[:-2] == last else 1)
        cap = self.graphs.get(key)
        long_lived = self.streak[1] >= LONG_LIVED_SHAPE_STEPS
        cover = None if cap is not None or long_lived else self._cover(key)
        eager = self._eager_steps.get(key, 0) < EAGER_STEPS and not long_lived
        if cap is None and cover is None and key in self._no_memory:
            return None
        if cap is None and cover is None and eager:
            self.eager_last = True  # (its time is mostly its launches')
            self.wanted[key] = None
            # (counted over every visit, not in a row: a batch flipping between two buckets
            # would otherwise run eagerly for as long as the engine is busy)
            self._eager_steps[key] = self._eager_steps.get(key, 0) + 1
            # at the padded shape: the kernels compiled for it serve (at the real batch size,
            # new Triton specializations compiled for seconds within SmolLM2's timed runs)
            if key not in self._eager:
                self._eager[key] = self._padded_step(*key)
            cap = self._eager[key]
            self.ran_rows_last = True
            self._copy_inputs(cap, rows)
            return cap.step().head(len(rows))
        self.covered_last = cover is not None  # (its time is a larger shape's)
        self.captured_last = cap is None and cover is None  # (its time includes the capture)
        if cover is not None:
            cap = self.graphs[cover]
            if key not in self._no_memory:
                self.wanted[key] = None
        elif cap is None:
            cap = self._capture_if_memory(key)
            if cap is None:  # (captured_last stays: this step's time includes the attempt)
                return None
            self.graphs[key] = cap
            self._covers.clear()  # (a smaller cover may exist now)
        self.ran_rows_last = True
        self._copy_inputs(cap, rows)
        if cap.graph is not None:
            cap.graph.replay()
            outputs = cap.outputs
        else:
            outputs = cap.step()
        return outputs.head(len(rows))

    def ready_tiers(
        self, batch_size: int, kv_bound: int, mode: SamplingMode, tiers: int, catch_up
    ) -> AbstractSet[int] | None:
        """Which of `tiers` tiers a step of this batch (its kv_len bounded by kv_bound) can
        replay now, its graph captured (catch_up(tier): whether that tier's step would catch
        the draft up); a step of any other tier first stalls on its capture. Each tier's
        width is its own (kv_bound + its slot width). A tier whose shape is the one last run,
        if that shape is long-lived (`LONG_LIVED_SHAPE_STEPS`), counts as ready: a capture
        there pays. None when every tier may run alike: no step of this batch is captured
        (eager steps, or a batch past the largest bucket), or every tier is at that
        long-lived shape. Each tier is looked up when asked about (`ReadyTiers`)."""
        worker, shapes = self.worker, {}  # width -> its shape (few tiers' widths differ)

        def shape_of(tier: int) -> tuple[int, int] | None:
            width = kv_bound + worker.tier_slot_width(tier, catch_up(tier))
            if width not in shapes:
                shapes[width] = self.bucket(batch_size, width)
            return shapes[width]

        if shape_of(0) is None or not self.capture:
            return None
        rows = worker.rows
        if rows.version != self._rows_version or (
            mode.penalized and rows.attached_version != self._attached_version
        ):
            return frozenset()  # the next step drops the graphs this one would replay
        mode_key = self._mode(mode)
        last, steps = self.streak
        # (the streak is of the shape the last tier ran at: a tier at that shape may capture)
        long_lived = last if steps >= LONG_LIVED_SHAPE_STEPS else None
        if long_lived is not None and all(
            (*shape_of(t), *mode_key) == long_lived for t in range(tiers) if shape_of(t) is not None
        ):
            return None

        def replayable(t: int) -> bool:
            shape = shape_of(t)
            if shape is None:
                return False
            key = (*shape, *mode_key, t, catch_up(t))
            return key[:-2] == long_lived or self._replayable(key)

        return ReadyTiers(replayable, tiers)

    def _replayable(self, key: tuple) -> bool:
        """Whether a step of this key runs without a capture: its own graph or a cover."""
        return key in self.graphs or self._cover(key) is not None

    def capture_wanted(self) -> bool:
        """Capture the oldest covered shape's own graph (the engine calls this when no request
        is running or waiting; one arriving meanwhile waits for this capture alone). Returns
        whether there was one."""
        if self._stale():
            self._drop_stale_graphs()
        while self.wanted:
            key = next(iter(self.wanted))
            captured = key not in self.graphs
            if captured:
                # (simulated acceptance draws from a device counter that the capture's runs
                # advance: put it back, so its draws do not depend on when the engine idled)
                sim = getattr(self.worker.step, "simulator", None)
                counter = sim.counter.clone() if sim is not None else None
                cap = self._capture_if_memory(key, idle=True)
                if cap is not None:
                    self.graphs[key] = cap
                    self._covers.clear()
                if counter is not None:
                    sim.counter.copy_(counter)
            self.wanted.pop(key, None)  # (after: a reader seeing none wanted sees every graph)
            if captured:
                return True
        return False

    def _want_alike(self, key: tuple) -> None:
        """Want, when idle, the graphs of every (tier, catch-up) run at this key's batch
        bucket and sampling mode, or timed at the bucket, at every width met there. A
        batch's tail passes its buckets at the widest widths of its run, and the policy runs
        other tiers there from one wave of requests to the next: a tier run at a bucket, or
        timed there at engine start (`step_seconds`, so one the policy may pick), is likely
        to run there at its other widths. (Every tier at every shape met would be hundreds
        of captures for tiers the load never runs: buckets not timed at start want only the
        tiers run there.)"""
        bs, width, *rest = key
        mode, variant = tuple(rest[:-2]), tuple(rest[-2:])
        widths, variants = self._met.setdefault((bs, mode), ({}, {}))
        new_width, new_variant = width not in widths, variant not in variants
        widths[width] = variants[variant] = None
        pairs = ([(w, variant) for w in widths] if new_variant else []) + (
            [(width, v) for v in {**self._timed.get(bs, {}), **variants}] if new_width else []
        )
        for w, v in pairs:
            alike = (bs, w, *mode, *v)
            # (a tier's step reaches its slot width past kv_len: no step of it fits a
            # narrower graph, e.g. a catch-up's ring at a width a plain step met)
            fits = w >= self.worker.tier_slot_width(*v)
            if fits and alike != key and alike not in self.graphs and alike not in self._no_memory:
                self.wanted[alike] = None

    def note_timed(self, batch_bucket: int, tier: int) -> None:
        """`tier` was timed at this batch bucket at engine start: the policy may pick it there,
        so it is wanted at every new width met there, in any sampling mode (`_want_alike`)."""
        self._timed.setdefault(batch_bucket, {})[(tier, False)] = None

    def _cover(self, key: tuple) -> tuple | None:
        """The captured key of least padding (batch bucket x width) that can run a step of
        `key`: the same sampling mode, tier and catch-up, batch and width at least as large
        and at most MAX_COVER_FACTOR times as large."""
        if key not in self._covers:
            bs, width, *rest = key
            f = MAX_COVER_FACTOR
            fits = [
                k
                for k in self.graphs
                if bs <= k[0] <= f * bs and width <= k[1] <= f * width and list(k[2:]) == rest
            ]
            self._covers[key] = min(fits, key=lambda k: (k[0] * k[1], k), default=None)
        return self._covers[key]

    @staticmethod
    def _mode(mode: SamplingMode) -> tuple:
        """The part of a graph's key the batch's sampling decides."""
        return (
            mode.all_greedy,
            mode.needs_filter,
            mode.logprobs,
            mode.top_logprobs,
            mode.any_plain,
            mode.penalized,
        )

    @classmethod
    def _key(cls, shape: tuple[int, int], mode: SamplingMode, tier: int, catch_up: bool):
        return (*shape, *cls._mode(mode), tier, catch_up)

    def _stale(self) -> bool:
        rows = self.worker.rows
        return (rows.version, rows.attached_version) != (self._rows_version, self._attached_version)

    def _drop_stale_graphs(self) -> None:
        """The row tensors were reallocated (more requests or longer contexts than sized
        for): graphs captured the old addresses. Only an attached table (the penalties')
        moved: so did what penalized graphs read, and no other graph reads it (the first
        penalized request, or more penalized requests at once than its slots, kept every
        other graph, those captured at start among them). A launched replay may still be
        running: let it finish before its graph and memory pool are released."""
        rows = self.worker.rows
        if not self._stale():
            return
        if self.capture:
            synchronize_device(self.worker.device)
        everything = rows.version != self._rows_version

        def stale(key: tuple) -> bool:
            return everything or key[PENALIZED]

        dropped = [key for key in self.graphs if stale(key)]
        if dropped:
            what = "request rows" if everything else "penalty tables"
            log.info("%s reallocated: %d decode graphs dropped", what, len(dropped))
        for key in dropped:
            del self.graphs[key]
        for keyed in (self.wanted, self._eager, self._eager_steps, self._no_memory):
            for key in [key for key in keyed if stale(key)]:
                del keyed[key]
        # (per batch bucket and sampling mode: its penalties flag is the mode's last)
        for met in [met for met in self._met if stale((*met[:1], None, *met[1]))]:
            del self._met[met]
        self._covers.clear()
        self._rows_version, self._attached_version = rows.version, rows.attached_version
        self.streak = (None, 0)

    @torch.inference_mode()  # (graph inputs are inference tensors, written in place)
    def step_seconds(self, batch_size: int, tier: int, replays: int = 3) -> float | None:
        """The device time of one greedy step of `tier` at this batch size's bucket (its graph
        replayed on padding rows, captured first if need be): what load-adaptive speculation
        weighs tiers by. None without CUDA graphs, past the largest bucket, or without device
        memory for the graph (its steps are then timed as served)."""
        cap = self._start_graph(batch_size, tier)
        if cap is None:
            return None
        shape = self.bucket(batch_size, MIN_WIDTH)
        # (a tier timed at a bucket may be picked there: at the next width met there it is
        # wanted like the tiers that ran; without, the first wave to run it at a new width
        # stalled on its eager steps and capture, 0.2 s of a 0.3 s SmolLM2 run at batch 64)
        self.note_timed(shape[0], tier)
        copy_from_host(cap.rows, [PAD_ROW] * cap.rows.shape[0])
        cap.graph.replay()  # settles clocks and caches
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            cap.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    @torch.inference_mode()  # (as when a step meets its shape: inputs written in place)
    def capture_at_start(self, tiers: int, max_batch_size: int) -> int:
        """Capture the step of each of `tiers` tiers in each of `START_MODES` at every batch
        bucket that a batch of at most `max_batch_size` requests meets, at the shortest width,
        before the first request. The first capture at a batch size compiles its kernels'
        variants: serving SmolLM2 on an H100, the first capture at batch 8 took 3 s, those at
        other widths reuse them (0.08-0.1 s). Returns how many graphs were captured
        (simulated acceptance's counter left as it was found, as by an idle capture). The
        largest bucket first: later, smaller captures reuse its memory in the shared pool.
        (Smallest first, each capture needed more than any before it had left: SmolLM2's
        6/8/64 tree held 10.5 GiB of pool at batch 160, and batch 176 ran out of an H100's
        memory.) A graph that does not fit in memory is left to eager steps, as when serving
        meets it (`_capture_if_memory`): an engine that served without it still starts."""
        before = len(self.graphs)
        sim = getattr(self.worker.step, "simulator", None)
        counter = sim.counter.clone() if sim is not None else None
        for bs in self.start_buckets(max_batch_size):
            for mode in START_MODES:
                for tier in range(tiers):
                    self._start_graph(bs, tier, mode)
        if counter is not None:
            sim.counter.copy_(counter)
        return len(self.graphs) - before

    def start_buckets(self, max_batch_size: int) -> list[int]:
        """The batch buckets a batch of at most `max_batch_size` requests meets, largest
        first (`capture_at_start`'s order)."""
        largest = self.bucket(max_batch_size, MIN_WIDTH)
        top = largest[0] if largest is not None else self.buckets[-1]
        return [bs for bs in reversed(self.buckets) if bs <= top]

    def _start_graph(
        self, batch_size: int, tier: int, mode: SamplingMode = GREEDY
    ) -> _Captured | None:
        """The graph of a step of `tier` in `mode` at this batch size's bucket and the
        shortest width, captured if need be (None without graphs or past the largest
        bucket, or no device memory for it)."""
        shape = self.bucket(batch_size, MIN_WIDTH)
        if shape is None or not self.capture:
            return None
        self._drop_stale_graphs()
        key = self._key(shape, mode, tier, False)
        cap = self.graphs.get(key)
        if cap is None and key not in self._no_memory:
            cap = self._capture_if_memory(key)
            if cap is not None:
                self.graphs[key] = cap
                self._covers.clear()
        return cap

    @staticmethod
    def _copy_inputs(cap: _Captured, rows: list[int]) -> None:
        bs, n = cap.rows.shape[0], len(rows)
        copy_from_host(cap.rows, rows + [PAD_ROW] * (bs - n))

    def _padded_step(
        self,
        bs: int,
        width: int,
        all_greedy: bool,
        needs_filter: bool,
        logprobs: bool,
        top_logprobs: int,
        any_plain: bool,
        penalized: bool,
        tier: int,
        catch_up: bool,
    ) -> _Captured:
        """The step of this key over static, padded inputs, not captured: what a graph of it
        replays, and how a shape runs before it is captured (or without CUDA graphs)."""
        worker, dev = self.worker, self.worker.device
        rows = torch.full((bs,), PAD_ROW, dtype=torch.int64, device=dev)
        mode = SamplingMode(all_greedy, needs_filter, logprobs, top_logprobs, any_plain, penalized)
        kv_upper = [width - worker.tier_slot_width(tier, catch_up)] * bs
        table = worker.rows

        def step():
            with torch.inference_mode():
                # (gathered in the graph: a new batch copies in its rows alone; so are the
                # penalties of a penalized batch, which the step then brings up to date)
                sampling = SamplingTensors.gather(
                    table.sampling_floats, table.sampling_ints, rows, mode
                )
                penalties = worker.penalty_rows.batch(rows) if penalized else None
                return worker.step.run(
                    rows, sampling, width, kv_upper, tier, catch_up, penalties=penalties
                )

        return _Captured(None, step, rows, None)

    def _capture_if_memory(self, key: tuple, idle: bool = False) -> _Captured | None:
        """The graph of `key`, captured; None when the device has no memory left for it. A
        capture runs its step on padding rows alone, so no request's state has moved: the
        step runs eagerly on the batch's rows instead (less memory than the padded graph and
        its pool), and so does every later step of this shape, rather than failing every
        request in flight."""
        cap = capture_unless_out_of_memory(
            lambda: self._capture(*key, idle=idle), f"decode graph {key}", self.eager_without_memory
        )
        if cap is None:
            self._no_memory[key] = None
            self.wanted.pop(key, None)
        return cap

    def _capture(self, *key, idle: bool = False) -> _Captured:
        # (fresh padding rows: a capture runs the step, and the eager step's hold real rows)
        self._eager.pop(key, None)
        self._eager_steps.pop(key, None)
        cap = self._padded_step(*key)
        if not self.capture:
            return cap
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        cap.graph, cap.outputs = capture_graph(cap.step, self.pool, self.worker.device)
        if idle:
            self.num_idle_captures += 1
        else:
            self.num_captures += 1
        bs, width, all_greedy, _, logprobs, top_logprobs, _, penalized, tier, catch_up = key
        log.info(
            "captured decode graph in %.2f s: batch %d, width %d, greedy=%s, logprobs=%s "
            "(top %d), penalized=%s, tier %d, catch-up %s",
            time.perf_counter() - start,
            bs,
            width,
            all_greedy,
            logprobs,
            top_logprobs,
            penalized,
            tier,
            catch_up,
        )
        return cap
