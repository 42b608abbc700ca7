"""What load-adaptive speculation chose, step by step: `specserve bench one-batch` run in this
process with the policy's picks logged, then summarized. Every decode step is also logged
with the host's time around it and how long the host waited for the device, for any
configuration (a fixed tree too), so two configurations' runs can be compared step by step. Each pick records the batch size, the
tier, whether it explored, every tier's score, device-time estimate and acceptance estimate,
the host's time per step and per token it weighed, and the wall clock; every CUDA-graph capture is logged
with its shape and duration. The summary gives, per batch bucket, the picks per tier (best or
exploring), the captures, and each tier's mean wall time per step (from one launch to the
next while the host applied it) beside its device time and the host's measured time, per
step and per emitted token. Every Triton compile is logged with the step it stalled and
the specialization it compiled, and the slowest launches with how they ran (graph replayed,
a larger graph, eagerly, or captured).

    python3 bench/adaptive_policy_trace.py OUT.json [--time-calls] [one-batch flags...]
    e.g. OUT.json --model-path smollm2-135m --chat --output-len 128 --batch-size 16 128 \\
         --repeats 5 --speculative-adaptive
    python3 bench/adaptive_policy_trace.py OUT.json --in-turns [one_batch_in_turns.py flags]

--time-calls also sums each host-side function's time per step (`timed_calls`) and times
every engine's steps on the device (CUDA events around the launch, as adaptive's own are), so
a fixed tier's device time per step can be set beside adaptive's on the same tier.

With --in-turns the configurations of `bench/one_batch_in_turns.py` run in turns in this
process and every engine's steps are logged, in the order they ran, with the engine's number
(in the order the engines first decoded); the picks' summary pools every adaptive engine.

The bench's own JSON goes where --output-json says (its table is printed as usual).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from specserve.runtime.engine_core import EngineCore  # noqa: E402
from specserve.runtime.host_clock import HostClock  # noqa: E402
from specserve.speculative.adaptive import AdaptiveSpeculation, batch_bucket  # noqa: E402


def record_picks(log: list[dict]) -> None:
    """Wrap the policy's pick / observe and the graphs' capture to append to `log`."""
    pick, observe, capture = (
        AdaptiveSpeculation.pick,
        AdaptiveSpeculation.observe,
        DecodeGraphs._capture,
    )
    observe_host = AdaptiveSpeculation.observe_host

    def logged_pick(self, batch_size, can_speculate=True, ready=None):
        before = self._explored
        tier = pick(self, batch_size, can_speculate, ready)
        bucket = batch_bucket(batch_size)
        rec = {
            "wall_ms": time.perf_counter() * 1e3,
            "batch": batch_size,
            "tier": tier,
            "explored": self._explored is not None and self._explored == tier != before,
            "host_us_per_step_and_token": [v * 1e6 for v in self.host.cost_at(bucket)],
            # (what the policy asked about: listing every tier would look each one up,
            # host time an untraced step does not spend)
            "ready": None if ready is None else _asked(ready),
        }
        if can_speculate and self._fill(bucket) is None:
            rec["scores"] = self._scores(batch_size)
            rec["device_ms"] = [
                (self.seconds(t, bucket) or 0.0) * 1e3 for t in range(len(self.tiers))
            ]
            rec["accept"] = list(self.accept)
        log.append(rec)
        return tier

    def logged_observe(self, tier, batch_size, accept_lens, seconds, chain_reach=None):
        if log:  # (the step applied after this pick's launch)
            mean = sum(accept_lens) / max(1, len(accept_lens))
            log[-1].setdefault("observed", []).append(
                [tier, mean, None if seconds is None else seconds * 1e3]
            )
        return observe(self, tier, batch_size, accept_lens, seconds, chain_reach)

    def logged_capture(self, *key, **kwargs):
        start = time.perf_counter()
        out = capture(self, *key, **kwargs)
        if log:
            ms = (time.perf_counter() - start) * 1e3
            log[-1].setdefault("captures", []).append([list(key), kwargs.get("idle", False), ms])
        return out

    def logged_observe_host(self, tier, batch_size, seconds, tokens):
        if log:  # (the host's time around the step applied before this pick's launch)
            log[-1]["host_sample_ms"] = seconds * 1e3
            log[-1]["host_sample_tokens"] = tokens
        return observe_host(self, tier, batch_size, seconds, tokens)

    AdaptiveSpeculation.observe_host = logged_observe_host
    AdaptiveSpeculation.pick = logged_pick
    AdaptiveSpeculation.observe = logged_observe
    DecodeGraphs._capture = logged_capture


def _asked(ready) -> list[int]:
    """The tiers the policy found replayable among those it asked about."""
    looked_up = getattr(ready, "looked_up", None)
    return sorted(t for t, ok in looked_up().items() if ok) if looked_up else sorted(ready)


def record_steps(steps: list[dict], time_calls: bool) -> None:
    """Wrap the engine's decode launch, the host clock and the host-side functions of a step
    (`TIMED_CALLS`) to append one record per launched step: wall clock, batch size, tier, the
    launch's own ms, the host's ms around the step applied since the previous launch (None
    when a prefill, capture or idle loop came between), the ms waited for the device, and
    each timed function's ms from this launch to the next."""
    launch_decode, finish_decode, clock_launch, clock_waited = (
        EngineCore._launch_decode,
        EngineCore._finish_decode,
        HostClock.launch,
        HostClock.waited,
    )
    records: dict[int, dict] = {}  # id of each launched step in flight -> its record

    engines: dict[int, int] = {}  # id of each engine core -> its number, in order met

    def logged_launch_decode(self, reqs):
        start = time.perf_counter()
        rec = {
            "wall_ms": start * 1e3,
            "engine": engines.setdefault(id(self), len(engines)),
            "batch": len(reqs),
            # CPU time of this thread and of the whole process: a host step slower than its
            # own CPU time waited for the CPU or the GIL; a process using much more CPU than
            # the loop thread has other threads busy
            "thread_cpu_ms": time.thread_time() * 1e3,
            "process_cpu_ms": time.process_time() * 1e3,
            "host_ms": None,
            "calls": collections.Counter(),
        }
        steps.append(rec)
        pending = launch_decode(self, reqs)
        records[id(pending)] = rec
        rec["tier"] = pending.tier
        rec["launch_ms"] = (time.perf_counter() - start) * 1e3
        graphs = self.worker.graphs
        if graphs is not None:  # how the step ran: its graph, a larger one, eagerly, captured
            flags = ("captured_last", "covered_last", "eager_last")
            rec["graph"] = next((f[:-5] for f in flags if getattr(graphs, f)), "replayed")
            if len(reqs) > graphs.buckets[-1]:
                rec["graph"] = "unbucketed"  # (past the largest graph: run eagerly as it is)
        return pending

    def logged_finish_decode(self, pending):
        out = finish_decode(self, pending)
        rec = records.pop(id(pending), None)
        if rec is not None and pending.seconds is not None:
            rec["device_ms"] = pending.seconds * 1e3
        return out

    def logged_clock_launch(self):
        out = clock_launch(self)
        if steps and out is not None:  # (inside the launch being recorded)
            steps[-1]["host_ms"] = out[2] * 1e3
        return out

    def logged_clock_waited(self, seconds, tier, batch_size, tokens):
        if steps:  # (the wait follows the latest launch)
            steps[-1]["waited_ms"] = steps[-1].get("waited_ms", 0.0) + seconds * 1e3
        return clock_waited(self, seconds, tier, batch_size, tokens)

    EngineCore._launch_decode = logged_launch_decode
    EngineCore._finish_decode = logged_finish_decode
    HostClock.launch = logged_clock_launch
    HostClock.waited = logged_clock_waited
    for owner, names in timed_calls() if time_calls else ():
        for name in names:
            _time_calls(owner, name, steps)
    if time_calls:  # every engine's steps timed on the device, not adaptive's alone
        from specserve.runtime.worker import Worker

        worker_launch = Worker.launch_decode

        def timed_launch(self, reqs, kv_upper, tier=0, timed=False, catch_up=False):
            return worker_launch(self, reqs, kv_upper, tier, True, catch_up)

        Worker.launch_decode = timed_launch


def record_compiles(steps: list[dict], compiles: list[dict]) -> bool:
    """Log every Triton kernel compiled (or loaded from Triton's disk cache) while the bench
    runs: wall clock, ms, the kernel and its specialization, and the step launched last. A
    launch that stalls on one names the argument values that specialized it."""
    try:
        from triton import knobs
    except ImportError:  # (a Triton without knobs: nothing logged)
        return False
    started: dict[object, float] = {}

    def before(*, key, repr, **_):
        started[str(key)] = time.perf_counter()
        return False  # (compile as usual)

    def after(*, key, repr, compile=None, **_):
        start = started.pop(str(key), None)
        now = time.perf_counter()
        compiles.append(
            {
                "wall_ms": now * 1e3,
                "ms": None if start is None else (now - start) * 1e3,
                "kernel": repr,
                # (the constexprs and the integer arguments' specializations)
                "constants": str((compile or {}).get("constants")),
                "step": len(steps) - 1,
                "batch": steps[-1]["batch"] if steps else None,
            }
        )

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return True


def timed_calls() -> list[tuple[type, tuple[str, ...]]]:
    """The host-side functions of a decode step whose time each step record sums."""
    from specserve.kv.request_rows import RequestRows
    from specserve.runtime.draft_lag import DraftLag
    from specserve.runtime.scheduler import Scheduler
    from specserve.runtime.worker import PendingDecode, Worker

    return [
        (
            EngineCore,
            (
                "step",
                "_launch_decode",
                "_finish_decode",
                "_reap_finished",
                "_append_tokens",
                "_run_prefill",
            ),
        ),
        (Scheduler, ("schedule_decode_ahead", "schedule_prefill_beside", "decode_done")),
        (Worker, ("ready_tiers", "launch_decode", "_sampling_for", "observe_tokens")),
        (RequestRows, ("flush",)),
        (PendingDecode, ("__init__", "result")),
        (DecodeGraphs, ("run", "_copy_inputs", "_want_alike", "ready_tiers")),
        (AdaptiveSpeculation, ("pick", "observe", "observe_host", "speculation_pays")),
        (DraftLag, ("plan", "applied", "catches_up")),
    ]


def _time_calls(owner, name: str, steps: list[dict]) -> None:
    fn = getattr(owner, name)
    label = f"{owner.__name__}.{name}"

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if steps:
                steps[-1]["calls"][label] += (time.perf_counter() - start) * 1e3

    static = isinstance(owner.__dict__.get(name), staticmethod)
    setattr(owner, name, staticmethod(timed) if static else timed)


def summarize_steps(steps: list[dict]) -> None:
    """Per run (the batch only shrinks within one) its steps and wall time; per batch bucket
    the steps, the host's ms a step and the ms it waited for the device a step."""
    runs, run = [], []
    for rec in steps:
        gap = rec["wall_ms"] - run[-1]["wall_ms"] if run else 0.0
        before = run[-1]["wall_ms"] - run[-2]["wall_ms"] if len(run) > 1 else gap
        # a new run: the batch grew, another engine's steps, or a pause far longer than a step
        # (an idle engine)
        if run and (
            rec["batch"] > run[-1]["batch"]
            or rec["engine"] != run[-1]["engine"]
            or gap > max(50.0, 3 * before)
        ):
            runs.append(run)
            run = []
        run.append(rec)
    if run:
        runs.append(run)
    print(
        "run | engine | first batch | steps | wall ms (first to last launch) | host ms "
        "| waited ms | loop thread CPU ms | process CPU ms | steps not replayed (how: count)"
    )
    for i, r in enumerate(runs):
        host = sum(x["host_ms"] or 0.0 for x in r)
        waited = sum(x.get("waited_ms", 0.0) for x in r)
        cpu = [r[-1][k] - r[0][k] for k in ("thread_cpu_ms", "process_cpu_ms")]
        odd = collections.Counter(x.get("graph") for x in r if x.get("graph") != "replayed")
        print(f"{i} | {r[0]['engine']} | {r[0]['batch']} | {len(r)} "
              f"| {r[-1]['wall_ms'] - r[0]['wall_ms']:.1f} | {host:.1f} | {waited:.1f} "
              f"| {cpu[0]:.1f} | {cpu[1]:.1f} | {dict(odd)}")  # fmt: skip
    labels = sorted({label for r in runs for x in r for label in x["calls"]})
    print("ms a step in each timed function, runs of 20 steps or more:")
    print("run | " + " | ".join(labels))
    for i, r in enumerate(runs):
        if len(r) >= 20:
            sums = collections.Counter()
            for x in r:
                sums.update(x["calls"])
            print(f"{i} | " + " | ".join(f"{sums[label] / len(r):.3f}" for label in labels))
    # between launches a and b the host waited for a step in flight (logged on a) and applied
    # it (the clock's sample, logged on b); counted for a's bucket and tier
    by = collections.defaultdict(list)
    for r in runs:
        for a, b in zip(r, r[1:]):
            by[(r[0]["engine"], r[0]["batch"], batch_bucket(a["batch"]), a["tier"])].append((a, b))
    print(
        "engine | first batch | bucket | tier | intervals | wall ms | host ms | waited ms "
        "| launch ms | device ms (steps timed)"
    )
    for (engine, first, bucket, tier), pairs in sorted(by.items()):
        cols = (
            [b["wall_ms"] - a["wall_ms"] for a, b in pairs],
            [b["host_ms"] for _, b in pairs if b["host_ms"] is not None],
            [a.get("waited_ms", 0.0) for a, _ in pairs],
            [a["launch_ms"] for a, _ in pairs],
            [a["device_ms"] for a, _ in pairs if "device_ms" in a],
        )
        cells = [sum(v) / len(v) if v else float("nan") for v in cols]
        cells = " | ".join(f"{c:.2f}" for c in cells)
        print(f"{engine} | {first} | {bucket} | {tier} | {len(pairs)} | {cells}")


def summarize_stalls(steps: list[dict], compiles: list[dict] | None) -> None:
    """Compiles after the first decode step (start-up compiles are expected; with --in-turns
    a later batch size's warm-up compiles count too), and the slowest launches with how each
    ran. compiles None: this Triton could not log them."""
    first = steps[0]["wall_ms"] if steps else float("inf")
    late = [c for c in compiles or [] if c["wall_ms"] > first]
    if compiles is None:
        print("Triton compiles: not logged (this Triton has no compile hooks)")
    else:
        print(f"Triton compiles: {len(compiles)}, {len(late)} after the first decode step:")
    for c in late:
        ms = "-" if c["ms"] is None else f"{c['ms']:.0f}"
        print(f"  step {c['step']} batch {c['batch']} {ms} ms {c['kernel'][:200]}")
        print(f"    constants {c.get('constants', '')[:300]}")
    timed = [(i, x) for i, x in enumerate(steps) if "launch_ms" in x]  # (not a failed one)
    slow = sorted(timed, key=lambda ix: ix[1]["launch_ms"], reverse=True)[:20]
    print("slowest launches (step, engine, batch, tier, ms, graph):")
    for i, x in slow:
        print(f"  {i} {x['engine']} {x['batch']} {x['tier']} {x['launch_ms']:.1f} {x.get('graph')}")


def summarize(log: list[dict]) -> None:
    by_bucket = collections.defaultdict(list)
    for rec in log:
        by_bucket[batch_bucket(rec["batch"])].append(rec)
    for bucket, recs in sorted(by_bucket.items()):
        kinds = collections.Counter(
            (r["tier"], "explored" if r["explored"] else "best") for r in recs
        )
        print(f"bucket {bucket}: {len(recs)} picks, by (tier, why): {sorted(kinds.items())}")
    print("captures a step waited for (pick, batch, tier, graph key, ms):")
    idle = []
    for i, rec in enumerate(log):
        for key, was_idle, ms in rec.get("captures", []):
            if was_idle:
                idle.append(ms)
            else:
                print(f"  {i} {rec['batch']} {rec['tier']} {key} {ms:.0f}")
    print(f"captures while idle: {len(idle)}, {sum(idle) / 1e3:.1f} s")
    # step k's wall time: from launch k+1 to launch k+2, while the host waited for and applied
    # step k (steps of one run only: the batch never grows within a run)
    steps = collections.defaultdict(list)
    for k in range(len(log) - 2):
        a, b, c = log[k], log[k + 1], log[k + 2]
        if not a["batch"] >= b["batch"] >= c["batch"] or c["wall_ms"] - b["wall_ms"] > 50:
            continue
        device = next((o[2] for o in b.get("observed", []) if o[0] == a["tier"]), None)
        steps[(batch_bucket(a["batch"]), a["tier"])].append(
            (
                c["wall_ms"] - b["wall_ms"],
                device,
                c.get("host_sample_ms"),  # (the host's own time while applying step k)
                c.get("host_sample_tokens"),  # (what step k emitted)
            )
        )
    print("bucket | tier | steps | wall ms | device ms (timed steps) | host ms | host us/token")

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    for (bucket, tier), rows in sorted(steps.items()):
        wall, device, host, tokens = (mean(col) for col in zip(*rows))
        cells = [wall, device, host, host * 1e3 / tokens if host and tokens else None]
        shown = " | ".join("-" if v is None else f"{v:.2f}" for v in cells)
        print(f"{bucket} | {tier} | {len(rows)} | {shown}")


def busy_threads(min_seconds: float = 0.5) -> None:
    """Every thread of this process that used at least `min_seconds` of CPU (Linux): a
    thread spinning beside the engine's loop slows the loop's host work."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if cpu >= min_seconds:
            rows.append((cpu, task.name, name))
    print(f"threads using >= {min_seconds} s of CPU: {len(rows)} of {len(list(tasks.iterdir()))}")
    for cpu, tid, name in sorted(rows, reverse=True):
        print(f"  {tid} {name}: {cpu:.1f} s")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's own arguments, and the flags it hands to one-batch (or in-turns)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [-h] OUT.json [--time-calls] [--in-turns] [flags ...]",
        epilog="Any other flags go to `specserve bench one-batch` (with --in-turns, to "
        "bench/one_batch_in_turns.py; a `--` and what follows it are passed as they are).",
        allow_abbrev=False,  # a one-batch flag must never be taken for an abbreviation of ours
    )
    p.add_argument("output", metavar="OUT.json", help="where the trace JSON is written")
    p.add_argument(
        "--time-calls",
        action="store_true",
        help="also sum host functions' time per step and time every engine's steps",
    )
    p.add_argument(
        "--in-turns", action="store_true", help="run bench/one_batch_in_turns.py's configurations"
    )
    cut = argv.index("--") if "--" in argv else len(argv)
    args, flags = p.parse_known_args(argv[:cut])
    flags += argv[cut:]
    # The output path comes first; otherwise a flag's value (`--batch-size 8`) would be taken
    # for it and the trace written to a file named "8".
    if argv[0] != args.output:
        p.error(f"OUT.json must be the first argument, got {argv[0]!r} first")
    out = Path(args.output)
    if out.is_dir():
        p.error(f"argument OUT.json: {out} is a folder; a file path is needed")
    if not out.resolve().parent.is_dir():
        p.error(f"argument OUT.json: its folder {out.resolve().parent} does not exist")
    return args, flags


def main(argv: list[str] | None = None) -> int:
    args, flags = parse_args(sys.argv[1:] if argv is None else argv)
    out, time_calls = Path(args.output), args.time_calls
    log: list[dict] = []
    steps: list[dict] = []
    compiles: list[dict] = []
    record_picks(log)
    record_steps(steps, time_calls)
    logs_compiles = record_compiles(steps, compiles)
    if args.in_turns:  # bench/one_batch_in_turns.py and its flags
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from one_batch_in_turns import main as in_turns_main

        rc = in_turns_main(flags)
    else:
        from specserve.cli import main as cli_main

        rc = cli_main(["bench", "one-batch", *flags])
    out.write_text(json.dumps({"picks": log, "steps": steps, "compiles": compiles}))
    if log:
        summarize(log)
    summarize_steps(steps)
    summarize_stalls(steps, compiles if logs_compiles else None)
    busy_threads()
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
