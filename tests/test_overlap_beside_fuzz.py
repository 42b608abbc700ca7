"""Randomized differential test of prefills run beside the decode step in flight (overlap).

Under overlap scheduling the engine launches decode step k+1 before it applies step k, and
prefills arriving requests behind it (`Scheduler.schedule_prefill_beside`), instead of
draining. Each case here draws an engine configuration (page size 1/2/3/4/16, a small KV
budget that forces retraction, few running slots, small prefill chunks, the prefix cache
with shared prompt prefixes, plain / standalone-speculative / load-adaptive configurations,
optionally padded "graph" prefills replayed one chunk each) and a workload (staggered
arrivals, aborts, stop tokens, `speculative: false`, n > 1 siblings, prompt log-probs,
`max_new_tokens: 0` prompt scoring), runs it with overlap on and off, and checks:

- every request finishes (stopped, length, or aborted), none is lost and the loop never spins
  without progress;
- each request's greedy output (and its log-probs) equals the overlap-off run's, token for
  token; an aborted one's output is a prefix of it;
- the KV invariants hold after every step (`debug_check_invariants`) and no page is in use at
  the end (nor locked in the prefix cache).

`EngineCore` is driven directly (arrivals and aborts at given step numbers), so a failing seed
reproduces exactly; one test drives `Engine` from client threads with real timing.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field

import pytest

from specserve import Engine
from specserve.config import EngineConfig
from specserve.model.config import PRESETS
from specserve.runtime.engine_core import EngineCore
from specserve.runtime.prefill_graphs import PrefillGraphs
from specserve.runtime.request import ReqState, Request
from specserve.runtime.tensor_parallel import start_engine_core
from specserve.sampling_params import SamplingParams
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, spec_args

VOCAB = 512
MAX_STEPS = 5000  # a case needs a few hundred steps; more means the loop stopped progressing


# ---- a workload --------------------------------------------------------------------------------
@dataclass
class Spec:
    """One request (or a group of n > 1 samples) of a workload."""

    rid: str
    prompt: list[int]
    params: dict
    arrival: int  # engine step at which it is submitted
    n: int = 1
    abort_at: int | None = None  # engine step at which it is aborted (overlap-on run only)
    logprob: dict = field(default_factory=dict)


@dataclass
class Case:
    seed: int
    engine: dict
    specs: list[Spec]
    padded_prefill: bool = False  # replay padded prefill "graphs" (capture off), 64 tokens

    def describe(self) -> str:
        e = {k: v for k, v in self.engine.items() if k not in TINY}
        return f"seed={self.seed} padded={self.padded_prefill} engine={e}"


SPEC_CONFIGS = [
    None,
    ("tiny", 1, 3, 4),
    ("tiny", 4, 3, 10),
    ("tiny", 2, 2, 5),
    ("eagle", 1, 3, 4),
    ("eagle", 4, 3, 10),
    ("adaptive", 4, 3, 10),
    ("adaptive", 1, 2, 3),
    ("adaptive-eagle", 4, 3, 8),
]
_EAGLE: list[str] = []


def eagle_checkpoint() -> str:
    """A random EAGLE draft for the tiny model, written once per process."""
    if not _EAGLE:
        folder = os.path.join(tempfile.mkdtemp(prefix="beside-fuzz-"), "eagle")
        _EAGLE.append(write_random_eagle_checkpoint(folder, PRESETS["tiny"], "EAGLE", seed=4))
    return _EAGLE[0]


def draw_case(seed: int, *, heavy: bool = False) -> Case:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4, 16])
    spec = rng.choice(SPEC_CONFIGS)
    engine = dict(
        TINY,
        page_size=page_size,
        max_running_requests=rng.choice([1, 2, 3, 4, 4, 6, 8, 16]),
        chunked_prefill_size=rng.choice([1, 3, 5, 8, 16, 33, -1]),
        # small enough that the running requests' windows and outputs do not all fit
        max_total_tokens=rng.choice([80, 120, 160, 220, 320]),
        debug_check_invariants=True,
        random_seed=seed,
    )
    if spec is not None:
        draft, topk, steps, ndt = spec
        path = eagle_checkpoint() if draft.endswith("eagle") else "tiny"
        if draft.startswith("adaptive"):
            engine.update(spec_args(path, topk, steps, ndt, speculative_adaptive=True))
            engine["speculative_adaptive_lag_tokens"] = rng.choice([2, 4, 8])
        else:
            engine.update(spec_args(path, topk, steps, ndt))
    if rng.random() < 0.15:
        engine["disable_radix_cache"] = True
    if rng.random() < 0.15:  # requests run into the context length (finish "length")
        engine["context_length"] = rng.randint(40, 90)
    padded = rng.random() < 0.3

    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(2)]
    stop_ids = rng.sample(range(3, VOCAB), 25)
    specs = []
    n_req = rng.randint(8, 24 if heavy else 14)
    bursts = [rng.randint(0, 40) for _ in range(3)]  # arrivals come in a few bursts
    for i in range(n_req):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + [
                rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))
            ]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))]
        params = {
            # seeded sampling draws from (seed, position, token): the same either way
            "temperature": 0.0 if rng.random() < 0.8 else 0.7,
            "seed": i,
            "max_new_tokens": rng.randint(1, 40),
            "ignore_eos": rng.random() < 0.8,
        }
        if rng.random() < 0.3:
            params["stop_token_ids"] = stop_ids
        if spec is not None and rng.random() < 0.25:
            params["speculative"] = False
        logprob = {}
        if rng.random() < 0.1:  # the output tokens' log-probs only
            logprob = {"return_logprob": True, "top_logprobs_num": rng.choice([0, 3])}
        elif rng.random() < 0.15:
            logprob = {
                "return_logprob": True,
                "logprob_start_len": rng.randrange(0, len(prompt)),
                "top_logprobs_num": rng.choice([0, 2]),
            }
            if rng.random() < 0.4:
                params["max_new_tokens"] = 0  # prompt scoring: the prefill is all
        n = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        arrival = rng.choice(bursts) + rng.randint(0, 3)
        abort_at = arrival + rng.randint(0, 20) if rng.random() < 0.2 else None
        specs.append(Spec(f"r{i}", prompt, params, arrival, n, abort_at, logprob))
    return Case(seed, engine, specs, padded_prefill=padded)


# ---- running it ---------------------------------------------------------------------------------
def make_requests(spec: Spec) -> list[Request]:
    params = SamplingParams.from_any(dict(spec.params))
    opts = {"return_logprob": False, "logprob_start_len": -1, **spec.logprob}
    if spec.n == 1:
        return [Request(spec.rid, list(spec.prompt), params, seed=params.seed, **opts)]
    reqs = [
        Request(f"{spec.rid}-{i}", list(spec.prompt), params, seed=params.seed + i, **opts)
        for i in range(spec.n)
    ]
    for r in reqs[1:]:
        r.prefill_after = reqs[0]
    return reqs


def build_core(case: Case, overlap: bool, tp_size: int = 1) -> EngineCore:
    cfg = EngineConfig.from_kwargs(
        **case.engine, disable_overlap_schedule=not overlap, tp_size=tp_size
    ).resolve()
    core = start_engine_core(cfg)  # (tp_size > 1: rank processes replay rank 0's calls)
    if case.padded_prefill:
        w = core.worker
        w.prefill_graphs = PrefillGraphs(w, 64, max_width=core.context_len, capture=False)
    return core


def fit_workload(case: Case, core: EngineCore) -> None:
    """Keep every request's whole fill (prompt and outputs: what a resumed request
    re-prefills) within what one request can hold alone, so no request can be cut short by
    an exhausted cache in one run and not in the other."""
    most = core.scheduler.max_prompt_tokens() - 2 * core.table.page_size
    for s in case.specs:
        s.prompt = s.prompt[: max(1, min(most // 2, core.context_len - 1))]
        s.params["max_new_tokens"] = min(s.params["max_new_tokens"], most - len(s.prompt))
        if "logprob_start_len" in s.logprob:
            s.logprob["logprob_start_len"] = min(s.logprob["logprob_start_len"], len(s.prompt) - 1)


@dataclass
class Result:
    output_ids: list[int]
    finish: str
    input_logprobs: list
    output_logprobs: list
    retractions: int


def drive(
    case: Case, overlap: bool, with_aborts: bool, tp_size: int = 1
) -> tuple[dict[str, Result], EngineCore]:
    """Runs the workload to the end; the caller closes the returned core."""
    core = build_core(case, overlap, tp_size)
    try:
        return _drive(core, case, with_aborts), core
    except BaseException:
        core.close()
        raise


def _drive(core: EngineCore, case: Case, with_aborts: bool) -> dict[str, Result]:
    fit_workload(case, core)
    arrivals: dict[int, list[Spec]] = {}
    for s in case.specs:
        arrivals.setdefault(s.arrival, []).append(s)
    aborts: dict[int, list[str]] = {}
    if with_aborts:
        for s in case.specs:
            if s.abort_at is not None:
                rids = [s.rid] if s.n == 1 else [f"{s.rid}-{i}" for i in range(s.n)]
                aborts.setdefault(s.abort_at, []).extend(rids)
    last = max([*arrivals, *aborts], default=0)
    submitted: dict[str, Request] = {}
    step = 0
    while step <= last or core.has_work():
        for s in arrivals.get(step, ()):
            core.validate_prompt(s.prompt, "input_ids")
            for r in make_requests(s):
                submitted[r.rid] = r
                core.add_request(r)
        for rid in aborts.get(step, ()):
            core.abort(rid)
        if core.has_work():
            core.step()
            check_limits(core, case)
            if core.peers is not None:  # every rank holds rank 0's pages, rows and state
                core.worker.check_replicas(list(core.requests))
        step += 1
        assert step < MAX_STEPS, f"no progress after {step} steps: {case.describe()}"
    out = {}
    for rid, r in submitted.items():
        assert r.finished, f"{rid} never finished ({r.state}): {case.describe()}"
        out[rid] = Result(
            list(r.output_ids),
            r.finish_reason["type"],
            list(r.logprobs.input.values),
            list(r.logprobs.output.values),
            r.num_retractions,
        )
    return out


def check_limits(core: EngineCore, case: Case) -> None:
    """At most max_running_requests requests run or are part way through their prefill, and
    no decode step in flight holds a finished request that was reaped."""
    sched = core.scheduler
    live = sum(not r.finished for r in sched.running)
    live += sum(r.state is ReqState.PREFILLING for r in sched.waiting)
    limit = case.engine["max_running_requests"]
    assert live <= limit, f"{live} requests active, limit {limit}: {case.describe()}"
    if core.pending is not None:
        for r in core.pending.reqs:
            assert r.rid in core.requests, f"{r.rid} reaped while in flight: {case.describe()}"


def assert_drained(core: EngineCore, case: Case) -> None:
    """Nothing live, no page in use or locked; flushing the cache frees every page."""
    assert not core.requests and core.pending is None, case.describe()
    assert not core.scheduler.running and not core.scheduler.waiting, case.describe()
    core.check_invariants()
    alloc = core.table.allocator
    used = alloc.num_usable_pages - core.table.available_pages
    assert used == 0, f"{used} pages still in use: {case.describe()}"
    core.flush_cache()
    assert alloc.num_free_pages == alloc.num_usable_pages, case.describe()
    assert not core.table.owners(), case.describe()


def close(a: list, b: list, tol: float = 1e-3) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and not math.isclose(x, y, rel_tol=tol, abs_tol=tol):
            return False
    return True


def check_case(case: Case, tp_size: int = 1) -> dict:
    ref, ref_core = drive(case, overlap=False, with_aborts=False)
    assert_drained(ref_core, case)
    got, core = drive(case, overlap=True, with_aborts=True, tp_size=tp_size)
    try:
        assert_drained(core, case)
    finally:
        core.close()
    assert set(got) == set(ref)
    aborted = 0
    for rid, want in ref.items():
        have = got[rid]
        assert want.finish != "abort", f"{rid}: {want}"
        if have.finish == "abort":
            aborted += 1
            n = len(have.output_ids)
            assert have.output_ids == want.output_ids[:n], f"{rid}: {case.describe()}"
            continue
        assert have.output_ids == want.output_ids, (
            f"{rid}: overlap {have.output_ids} != {want.output_ids}: {case.describe()}"
        )
        assert have.finish == want.finish, f"{rid}: {case.describe()}"
        assert close(have.input_logprobs, want.input_logprobs), f"{rid}: {case.describe()}"
        assert close(have.output_logprobs, want.output_logprobs), f"{rid}: {case.describe()}"
    return {
        "beside": core.num_prefills_beside,
        "ahead": core.num_launched_ahead,
        "retractions": core.scheduler.num_retractions,
        "aborted": aborted,
        "prefix_hits": core.scheduler.prefix_hit_tokens,
    }


# ---- the tests ------------------------------------------------------------------------------------
# drawn to cover together: every page size, plain / standalone / EAGLE / adaptive drafts,
# padded prefills replayed one chunk each, retraction, aborts, prefix hits, n > 1, prompt
# log-probs, max_new_tokens 0, a short context length, and max_running_requests 2 to 16
QUICK_SEEDS = [1, 3, 7, 9, 10, 12, 14, 16, 17, 18, 21, 24, 25, 28, 32, 33, 38, 39]
_QUICK_STATS: dict[int, dict] = {}


@pytest.mark.parametrize("seed", QUICK_SEEDS)
def test_random_workloads_same_with_prefills_beside(seed):
    _QUICK_STATS[seed] = check_case(draw_case(seed))


def test_quick_seeds_exercise_what_they_are_for():
    """Together the quick seeds prefill beside a step in flight, retract, abort and hit the
    prefix cache (a guard against the draw drifting into workloads that test nothing)."""
    if set(_QUICK_STATS) != set(QUICK_SEEDS):
        pytest.skip("runs after the quick seeds, in the same session")
    totals = {k: sum(st[k] for st in _QUICK_STATS.values()) for k in _QUICK_STATS[QUICK_SEEDS[0]]}
    assert all(totals[k] > 0 for k in totals), totals


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
def test_random_workloads_same_with_prefills_beside_heavy(seed):
    check_case(draw_case(seed, heavy=True))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(300, 302))
def test_random_workloads_same_with_prefills_beside_tensor_parallel(seed):
    """tp_size 2 (rank processes on the CPU, gloo): rank 0 sends each prefill beside a step in
    flight, with the page-table changes before it, down to rank 1, which must replay the
    same calls in the same order; after every step both ranks hold the same pages, rows, KV
    lengths, roots and draft features, and the outputs equal tp_size 1 without overlap."""
    case = draw_case(seed)
    case.padded_prefill = False  # (set on rank 0 alone, it would change rank 0's calls only)
    # a model saved to disk: random "dummy" weights are drawn per shard, so tp 1 and 2 differ
    model, eagle = hf_model()
    case.engine.update(model_path=model, load_format="auto")
    draft = case.engine.get("speculative_draft_model_path")
    if draft is not None:
        case.engine["speculative_draft_model_path"] = model if draft == "tiny" else eagle
    check_case(case, tp_size=2)


_HF: list[tuple[str, str]] = []


def hf_model() -> tuple[str, str]:
    """The tiny model's shape saved as a HF checkpoint, and an EAGLE draft for it."""
    if not _HF:
        from specserve.model.hf_loader import load_hf_config
        from tests.model_factory import write_hf_model

        root = tempfile.mkdtemp(prefix="beside-fuzz-tp-")
        model = write_hf_model(os.path.join(root, "model"), vocab_size=VOCAB, seed=3)
        eagle = write_random_eagle_checkpoint(
            os.path.join(root, "eagle"), load_hf_config(model), "EAGLE", seed=5
        )
        _HF.append((model, eagle))
    return _HF[0]


# ---- through Engine: client threads, real timing -----------------------------------------------
def engine_workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(36)]
    prompts, params = [], []
    for i in range(28):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 14))]
        prompts.append(shared + tail if i % 3 else tail * 2)
        sp = {"temperature": 0.0, "max_new_tokens": rng.randint(2, 28), "ignore_eos": True}
        if i % 4 == 1:
            sp["speculative"] = False
        if i % 5 == 2:
            sp["stop_token_ids"] = rng.sample(range(3, VOCAB), 40)
        params.append(sp)
    return prompts, params


@pytest.mark.parametrize(
    "spec",
    [None, ("tiny", 4, 3, 10), ("adaptive", 2, 3, 6)],
    ids=["plain", "tree", "adaptive"],
)
def test_threaded_clients_with_aborts_through_engine(spec):
    """Clients submit from their own threads at staggered times and some abort: every request
    returns, finished ones equal the overlap-off engine's outputs, aborted ones a prefix of
    them, and no KV is in use once all have returned."""
    prompts, params = engine_workload(7)
    kw = dict(
        TINY,
        page_size=3,
        max_total_tokens=150,
        max_running_requests=5,
        chunked_prefill_size=12,
        debug_check_invariants=True,
    )
    if spec is not None:
        draft, topk, steps, ndt = spec
        kw.update(spec_args("tiny", topk, steps, ndt, speculative_adaptive=draft == "adaptive"))
    with Engine(**kw, disable_overlap_schedule=True) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    rng = random.Random(11)
    to_abort = set(rng.sample(range(len(prompts)), 7))
    results: dict[int, dict] = {}
    with Engine(**kw) as e:

        def client(i):
            time.sleep(0.004 * i + rng.uniform(0, 0.01))
            results[i] = e.generate(input_ids=prompts[i], sampling_params=params[i], rid=f"c{i}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for i in sorted(to_abort):
            time.sleep(rng.uniform(0.0, 0.03))
            e.abort(f"c{i}")
        for t in threads:
            t.join(timeout=120)
        assert e.failure is None
        stats = e.stats()
    assert len(results) == len(prompts), "a request never returned"
    for i, out in results.items():
        got = out["output_ids"]
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            assert i in to_abort
            assert got == want[i][: len(got)], i
        else:
            assert got == want[i], i
    assert stats["kv_used_tokens"] == 0
    assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
    assert stats["num_prefill_batches_beside_decode"] > 0
