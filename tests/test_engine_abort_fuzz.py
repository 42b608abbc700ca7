"""Randomized stress of one `Engine` through its public API: requests submitted over time
(shared prompt prefixes, long prompts, n > 1 samples, `speculative: false`, seeded
sampling, stop tokens, request ids used again once free), some aborted at random moments
(right after submission, mid chunked prefill, mid decode from their own output callback,
after they finished), prefix-cache flushes while requests run, sometimes a shutdown
part way, under a KV cache small enough to force retraction, with a random page size, chunk
size, context length, overlap setting and plain / chain / tree / EAGLE / load-adaptive
speculation.

Every request must reach a terminal state with a reason and be told so exactly once; each
output not aborted equals the prompt decoded alone by a plain engine (an aborted one a
prefix of it); and once the engine idles no KV page is in use, and flushing the prefix cache
frees all of them.

Arrivals and aborts are issued from a step hook (after a given engine step) or from the
requests' output callbacks, both on the engine's loop thread, so a seed replays the same
interleaving of submissions, aborts and steps (up to the adaptive policy's timing).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.runtime.request import Request
from tests.engine_utils import TINY, spec_args
from tests.test_overlap_beside_fuzz import eagle_checkpoint

VOCAB = PRESETS["tiny"].vocab_size
EOS = PRESETS["tiny"].eos_token_ids[0]
WEIGHTS = dict(TINY, random_seed=0)  # every engine here loads the same random weights
MAX_STEPS = 4000  # a case takes a few hundred steps; more means the loop makes no progress
WAIT_S = 240.0  # for every request's last output (a hang fails the test, not the run)

# (draft, topk, num_steps, num_draft_tokens); None: plain decoding
SPEC_CONFIGS = [
    None,
    ("tiny", 1, 3, 4),
    ("tiny", 4, 3, 10),
    ("eagle", 2, 2, 5),
    ("adaptive", 4, 3, 8),
    ("adaptive", 1, 2, 3),
]
ABORT_MODES = ("now", "step", "prefilling", "tokens", "finished")


# ---- a workload ---------------------------------------------------------------------------
@dataclass
class Planned:
    """One submission (a prompt with its n samples)."""

    rid: str
    prompt: list[int]
    params: dict
    arrival: int  # the engine step after which it is submitted
    abort: str | None = None  # one of ABORT_MODES
    abort_arg: int = 0  # "step": steps after arrival; "tokens": output tokens received


@dataclass
class Case:
    seed: int
    engine: dict
    planned: list[Planned]
    fits: bool = True  # every request's fill fits the cache alone (else it may end early)
    flush_at: frozenset[int] = frozenset()  # steps after which the prefix cache is flushed
    shutdown_at: int | None = None  # the step after which the engine is shut down

    def describe(self) -> str:
        e = {k: v for k, v in self.engine.items() if k not in WEIGHTS}
        return f"seed={self.seed} engine={e}"


def draw_case(seed: int, heavy: bool = False) -> Case:
    rng = random.Random(seed)
    engine = dict(
        WEIGHTS,
        page_size=rng.choice([1, 2, 3, 4, 5, 8, 16]),
        max_running_requests=rng.choice([2, 3, 4, 8]),
        chunked_prefill_size=rng.choice([-1, 4, 7, 16, 32]),
        # a few requests' prompts, outputs and step windows overflow it: retraction
        max_total_tokens=rng.choice([96, 128, 160]),
        disable_overlap_schedule=rng.random() < 0.4,
        disable_radix_cache=rng.random() < 0.15,
        debug_check_invariants=True,
    )
    spec = rng.choice(SPEC_CONFIGS)
    if spec is not None:
        draft, topk, steps, ndt = spec
        path = eagle_checkpoint() if draft == "eagle" else "tiny"
        engine.update(spec_args(path, topk, steps, ndt, speculative_adaptive=draft == "adaptive"))
        if draft == "adaptive":
            engine["speculative_adaptive_lag_tokens"] = rng.choice([2, 8])
    if rng.random() < 0.15:  # requests run into the context length
        engine["context_length"] = rng.randint(30, 70)

    # (of 32 tokens or more, a request arriving beside one computing it waits for its pages)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 60))] for _ in range(2)]
    stop_ids = rng.sample(range(3, VOCAB), 30)
    bursts = [0] + [rng.randint(1, 40) for _ in range(2)]
    planned: list[Planned] = []
    for i in range(rng.randint(16, 28) if heavy else rng.randint(8, 14)):
        # (some long: a few of them fill most of the cache)
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.choice([14, 14, 60]))]
        tail = tail[: rng.randint(1, len(tail))]
        prompt = rng.choice(prefixes) + tail if rng.random() < 0.6 else tail * 2
        params = {"temperature": 0.0, "max_new_tokens": rng.randint(1, 40), "ignore_eos": True}
        if rng.random() < 0.2:
            params["stop_token_ids"] = stop_ids
        if rng.random() < 0.1:
            params["ignore_eos"] = False
        if spec is not None and rng.random() < 0.2:
            params["speculative"] = False
        if rng.random() < 0.15:
            params["n"] = rng.randint(2, 3)
        if rng.random() < 0.15:  # seeded: the same draws alone as in any batch
            params.update(temperature=0.8, top_k=rng.choice([-1, 20]), seed=rng.randrange(100))
        if rng.random() < 0.04:
            params["max_new_tokens"] = 0
        rid = f"r{i}"
        # an id used again once its earlier request is done (filed under a key of its own
        # while the earlier one still holds pages); only ids nobody aborts later
        reusable = [p.rid for p in planned if p.abort is None and p.params.get("n", 1) == 1]
        if reusable and params.get("n", 1) == 1 and rng.random() < 0.15:
            rid = rng.choice(reusable)
        plan = Planned(rid, prompt, params, rng.choice(bursts) + rng.randint(0, 3))
        if rng.random() < 0.4:
            plan.abort = rng.choice(ABORT_MODES)
            plan.abort_arg = rng.randint(0, 12)
        planned.append(plan)
    planned.sort(key=lambda p: p.arrival)
    # the first is submitted from the test's thread, before any step: alone, so the loop
    # cannot start between the puts of one submission; the rest after a step, from the loop
    planned[0].arrival, planned[0].params["n"] = 0, 1
    if planned[0].abort == "now":
        planned[0].abort = "step"
    for p in planned[1:]:
        p.arrival = max(p.arrival, 1)
    case = Case(seed, engine, planned, fits=rng.random() < 0.85)
    case.flush_at = frozenset(rng.sample(range(1, 80), rng.choice([0, 0, 3])))
    if rng.random() < 0.1:
        case.shutdown_at = rng.randint(1, 60)
    return case


def fit_workload(case: Case, engine: Engine) -> None:
    """Prompts the engine takes; unless the case says otherwise, every request's whole fill
    (what a resumed request prefills again) fits the cache alone with a step's window, so
    none is cut short by an exhausted cache."""
    most = engine.core.scheduler.max_prompt_tokens() - 2 * engine.core.table.page_size
    assert most >= 8, case.describe()
    longest = min(most - 1, engine.core.context_len - 2)
    for p in case.planned:
        p.prompt = p.prompt[:longest]
        if case.fits:
            p.params["max_new_tokens"] = min(p.params["max_new_tokens"], most - len(p.prompt))


# ---- references ---------------------------------------------------------------------------
_REFERENCE: dict[tuple, list[int]] = {}


@pytest.fixture(scope="module")
def plain_engine():
    with Engine(**WEIGHTS, disable_radix_cache=True, disable_overlap_schedule=True) as e:
        yield e


SAMPLING = ("temperature", "top_k", "seed")


def reference(engine: Engine, prompt: list[int], params: dict, length: int) -> list[int]:
    """The prompt's first `length` tokens decoded alone and plainly, EOS ignored (the
    sample's own seed with n > 1 is the prompt's seed + its index)."""
    sampling = {k: params[k] for k in SAMPLING if k in params}
    key = (tuple(prompt), tuple(sorted(sampling.items())))
    have = _REFERENCE.get(key, [])
    if len(have) < length:
        sp = dict(sampling, max_new_tokens=max(length, 40), ignore_eos=True)
        out = engine.generate(input_ids=prompt, sampling_params=sp)
        have = _REFERENCE[key] = out["output_ids"]
    return have[:length]


def expected(engine: Engine, p: Planned, index: int, context_len: int) -> tuple[list[int], dict]:
    """What sample `index` of the submission must output, and its finish reason."""
    params = dict(p.params)
    if "seed" in params:
        params["seed"] += index
    room = context_len - len(p.prompt)
    length = min(p.params["max_new_tokens"], room)
    want = reference(engine, p.prompt, params, length)
    stops = set(p.params.get("stop_token_ids", ()))
    if not p.params["ignore_eos"]:
        stops.add(EOS)
    for i, tok in enumerate(want):
        if tok in stops:
            return want[: i + 1], {"type": "stop", "matched": tok}
    if length < p.params["max_new_tokens"]:
        return want, {"type": "length", "length": length, "message": "context length reached"}
    return want, {"type": "length", "length": length}


# ---- driving one engine -------------------------------------------------------------------
@dataclass
class Tracked:
    plan: Planned
    reqs: list[Request]
    outputs: list[list[dict]]  # per sample, every output dict delivered
    arrived_at: int = 0  # the engine step after which it was submitted
    abort_sent: bool = False
    at_abort: list[str] | None = None  # each sample's state when the abort was sent
    finished: set[int] = field(default_factory=set)


class Driver:
    """Issues the case's arrivals and aborts from the engine's loop thread."""

    def __init__(self, engine: Engine, case: Case):
        self.engine, self.case = engine, case
        self.queue = list(case.planned)
        self.tracked: list[Tracked] = []
        self.steps = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.idle = threading.Event()
        self.total = 0
        self.finals = 0
        self.stopped = False  # shut down: nothing more is submitted

    def start(self) -> None:
        self.engine.step_hooks.append(self.after_step)
        self._arrive(0)  # (one submission: see draw_case)

    def _arrive(self, upto: int) -> None:
        while self.queue and self.queue[0].arrival <= upto:
            self._submit(self.queue.pop(0))

    def _submit(self, p: Planned) -> None:
        if any(t.plan.rid == p.rid and not t.reqs[-1].finished for t in self.tracked):
            p.rid += f"-{len(self.tracked)}"  # (its earlier request runs on: not free yet)
        reqs = self.engine.make_samples(p.prompt, dict(p.params), rid=p.rid)
        with self.lock:
            self.total += len(reqs)
        t = Tracked(p, reqs, [[] for _ in reqs], arrived_at=self.steps)
        self.tracked.append(t)
        self.engine.submit_made(reqs, lambda i, out, t=t: self.on_output(t, i, out))
        if p.abort == "now":
            self._abort(t)

    def _abort(self, t: Tracked) -> None:
        if t.abort_sent:
            return
        t.abort_sent = True
        t.at_abort = [r.state.value for r in t.reqs]
        self.engine.abort(t.plan.rid)

    def on_output(self, t: Tracked, index: int, out: dict) -> None:
        with self.lock:
            if index in t.finished:
                self.errors.append(f"{t.reqs[index].name}: an output after its last one")
            t.outputs[index].append(out)
            if out["finished"]:
                t.finished.add(index)
                self.finals += 1
                if self.finals == self.total and (self.stopped or not self.queue):
                    self.all_done.set()
        got = sum(len(o["output_ids"]) for o in t.outputs[index])
        mode = t.plan.abort
        if mode == "tokens" and not out["finished"] and got >= t.plan.abort_arg:
            self._abort(t)
        elif mode == "finished" and len(t.finished) == len(t.reqs):
            self._abort(t)  # (nothing live by that id any more: a no-op)

    def after_step(self, core) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            self.errors.append(f"no progress after {MAX_STEPS} steps")
            raise RuntimeError("the fuzz's step limit")  # fails every request in flight
        if self.stopped:
            return
        if self.steps == self.case.shutdown_at:
            self.stopped = True
            self.queue.clear()
            self.engine.shutdown()  # (from the loop: it fails what is live as it ends)
            with self.lock:
                if self.finals == self.total:
                    self.all_done.set()
            return
        if self.steps in self.case.flush_at:
            self.engine.flush_cache()  # (dropped pages nobody uses, a step maybe in flight)
        self._arrive(self.steps)
        for t in self.tracked:
            mode, live = t.plan.abort, [r for r in t.reqs if not r.finished]
            if t.abort_sent or not live:
                continue
            if mode == "step" and self.steps >= t.arrived_at + t.plan.abort_arg:
                self._abort(t)
            elif mode == "prefilling" and any(r.state.value == "prefilling" for r in live):
                self._abort(t)
        if not core.has_work() and self.queue:  # idle before the next burst: bring it now
            self._arrive(self.queue[0].arrival)
        if not self.queue and not core.has_work() and all(r.finished for t in self.tracked
                                                           for r in t.reqs):  # fmt: skip
            self.idle.set()


def run_case(case: Case, plain: Engine) -> dict:
    with Engine(**case.engine) as e:
        fit_workload(case, e)
        d = Driver(e, case)
        d.start()
        done = d.all_done.wait(WAIT_S) and (d.stopped or d.idle.wait(WAIT_S))
        missing = [
            t.reqs[i].name for t in d.tracked for i in range(len(t.reqs)) if i not in t.finished
        ]
        assert done, f"never finished: {missing} {case.describe()}"
        assert e.failure is None, f"{e.failure}: {case.describe()}"
        assert not d.errors, f"{d.errors}: {case.describe()}"
        if not d.stopped:  # (an engine shut down reports nothing more)
            stats = e.stats()
            assert stats["kv_used_tokens"] == 0, f"KV in use when idle: {case.describe()}"
            assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
        e.flush_cache()  # (once shut down: after its loop has ended)
        alloc = e.core.table.allocator
        leaked = alloc.num_usable_pages - alloc.num_free_pages
        assert leaked == 0, f"{leaked} pages never returned: {case.describe()}"
        assert not e.core.table.owners() and not e.core.requests, case.describe()
        retractions = e.core.scheduler.num_retractions
        hits = e.core.scheduler.prefix_hit_tokens
        context_len = e.core.context_len

    aborted = 0
    for t in d.tracked:
        for i, outs in enumerate(t.outputs):
            want, why = expected(plain, t.plan, i, context_len)
            where = f"{t.reqs[i].name} ({t.plan.abort}): {case.describe()}"
            got = [tok for o in outs for tok in o["output_ids"]]
            reason = outs[-1]["meta_info"]["finish_reason"]
            assert reason and reason.get("type") in ("stop", "length", "abort"), where
            # an abort is applied before the next step: what had not finished by then is
            # aborted, what had is left as it finished
            # (no new tokens asked: finished as it is admitted)
            live_at_abort = t.at_abort is not None and t.at_abort[i] != "finished"
            live_at_abort = live_at_abort and t.plan.params["max_new_tokens"] > 0
            if live_at_abort:
                assert reason["type"] == "abort", f"{reason}: {where}"
            if reason["type"] == "abort":
                if not live_at_abort:
                    assert d.stopped and reason.get("message") == "engine shut down", where
                aborted += 1
                assert reason.get("message"), where
                assert got == want[: len(got)], f"{got} not a prefix of {want}: {where}"
                if t.plan.abort == "now":
                    assert got == [], where
                continue
            if reason.get("message") == "KV cache exhausted" and not case.fits:
                assert got == want[: len(got)], f"{got} not a prefix of {want}: {where}"
                continue
            assert got == want, f"{got} != alone and plain {want}: {where}"
            assert reason == why, f"{reason} != {why}: {where}"
    return {
        "retractions": retractions,
        "prefix_hits": hits,
        "aborted": aborted,
        "aborted_when": {state for t in d.tracked for state in t.at_abort or ()},
    }


# ---- the tests ----------------------------------------------------------------------------
QUICK_SEEDS = list(range(12))
_QUICK_STATS: dict[int, dict] = {}


@pytest.mark.parametrize("seed", QUICK_SEEDS)
def test_random_workloads_with_aborts_finish_lossless_and_leak_no_kv(seed, plain_engine):
    _QUICK_STATS[seed] = run_case(draw_case(seed), plain_engine)


def test_quick_seeds_retract_hit_the_cache_and_abort_in_every_phase():
    """A guard against the draw drifting into workloads that test little."""
    if set(_QUICK_STATS) != set(QUICK_SEEDS):
        pytest.skip("runs after the quick seeds, in the same pytest run")
    stats = list(_QUICK_STATS.values())
    assert sum(s["retractions"] for s in stats) > 0
    assert sum(s["prefix_hits"] for s in stats) > 0
    assert sum(s["aborted"] for s in stats) > 0
    phases = set().union(*(s["aborted_when"] for s in stats))
    assert {"waiting", "prefilling", "running", "finished"} <= phases, phases


# (40 heavy seeds: about 2 minutes on one CI worker, which runs a test file at a time; wider
# sweeps are for changes to the scheduler: pass more seeds by editing this range locally)
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
def test_random_workloads_with_aborts_heavy(seed, plain_engine):
    run_case(draw_case(seed, heavy=True), plain_engine)
