"""`bench one-batch --chat` for several engine configurations in one process, their timed
runs taken in turns (A, B, C, A, B, C, ...), so that the host's speed drifting over a device
call (on a shared machine whole runs of host work can be 1.5x slower than others) falls on
every configuration alike. Prints JSON and a table: per batch size each configuration's
median decode tok/s and accept length, its runs, and its ratio to the first configuration.
Beside each run, the time a fixed pure-Python loop took just before it (`host_probe_ms`):
the host's raw speed at the time, to tell the machine's slow moments from the engine's; the
CPUs the engine's loop thread was on as the run started and ended (`loop_cpus`, Linux); and
the garbage collections during the run and the time they held the interpreter
(`gc_collections` per generation, `gc_pause_ms`); and the CPU time each thread of the
process used during the run (`thread_cpu_ms`: the loop's, and the busiest other threads' by
name, Linux), which tells whether anything beside the loop competes for the CPUs. Under
adaptive speculation, also the steps each tier served during the run (`tier_steps`) and the
drafts caught up and let go (`catch_ups`, `stopped_speculating`).

Each engine's loop is a thread of its own, placed by the OS, and tends to stay on one CPU
for whole runs; on a shared machine one CPU can run Python at half the speed of another (on
the H200 machine, once: 5 of 16 CPUs twice as fast as the others). `--cpus` pins every
thread of the process (the engines' loops included) to the CPUs listed, so that every
configuration's loop runs where the others' do; `--probe-cpus` prints the probe's time on
each CPU first. A diagnostic: pinned to the two fastest CPUs there, every configuration ran
slower (every thread of the process shared them, and a CPU's speed moved within minutes).
`--loop-cpu` pins the engines' loop threads alone, each run's on the same CPU: a given one,
or `fastest`, the CPU where the probe ran fastest just before each round (one run of each
configuration), so a CPU's speed moving over minutes falls on every configuration alike.

    python3 bench/one_batch_in_turns.py --batch-size 16 128 --repeats 8 \\
        --config tree4-4-16="--speculative-num-steps 4 --speculative-eagle-topk 4 \\
                             --speculative-num-draft-tokens 16" \\
        --config adaptive="--speculative-adaptive" [--output-json OUT.json] \\
        [--input-len N: random prompts instead of the packaged chats] \\
        [--cpus 4,5] [--probe-cpus] [--loop-cpu fastest|CPU] \\
        [-- common engine flags, e.g. --model-path smollm2-135m --dtype bfloat16]

Every engine keeps its KV cache to `--max-total-tokens` (default 100000 here: the engines
share the GPU, so none may size its cache from free memory). Each is warmed up at each batch
size as `bench one-batch` does, and after each of its runs waits for the captures its idle
loop makes, so none captures during another's run. Meant for a CUDA machine; it runs on a
CPU too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.one_batch import (  # noqa: E402
    timed_batch,
    timed_run,
    wait_for_idle_captures,
    warm_up,
)

PROBE_ITERATIONS = 200_000


def host_probe_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes now: the host's current speed."""
    start = time.perf_counter()
    total = 0
    for i in range(PROBE_ITERATIONS):
        total += i & 7
    return (time.perf_counter() - start) * 1e3


def probe_each_cpu() -> dict[int, float]:
    """The probe's milliseconds on each CPU this process may use (Linux), the main thread
    moved to each in turn, then given back its CPUs."""
    allowed = os.sched_getaffinity(0)
    times = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            times[cpu] = round(min(host_probe_ms() for _ in range(3)), 2)
    finally:
        os.sched_setaffinity(0, allowed)
    return times


def pin_process(cpus: set[int]) -> set[int]:
    """Pin every thread of this process to `cpus` (threads started later inherit it from
    the thread that starts them); returns the CPUs the process had."""
    before = os.sched_getaffinity(0)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass  # (the thread ended meanwhile)
    return before


def pin_loops(engines, cpus: set[int]) -> None:
    """Pin each engine's loop thread (only) to `cpus` (Linux)."""
    for engine in engines:
        os.sched_setaffinity(engine._thread.native_id, cpus)


def loop_cpu(engine) -> int | None:
    """The CPU the engine's loop thread last ran on (Linux), or None."""
    tid = getattr(getattr(engine, "_thread", None), "native_id", None)
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except (OSError, TypeError):
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[36])  # (field 39: processor)


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and the CPU seconds it has used (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{task}/stat").read_text()
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:
            continue  # (the thread ended meanwhile)
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def thread_cpu_during(before: dict, after: dict, loop_tid: int | None, top: int = 4) -> dict:
    """CPU milliseconds used between two `thread_cpu_seconds` readings: the loop thread's, and
    the busiest other threads' (name#tid)."""
    used = {
        tid: (name, seconds - before.get(tid, (name, 0.0))[1])
        for tid, (name, seconds) in after.items()
    }
    others = sorted(
        ((f"{name}#{tid}", s) for tid, (name, s) in used.items() if tid != loop_tid),
        key=lambda item: -item[1],
    )
    return {
        "loop": round(used.get(loop_tid, ("", 0.0))[1] * 1e3),
        "others": round(sum(s for _, s in others) * 1e3),
        **{name: round(s * 1e3) for name, s in others[:top] if s > 0},
    }


def adaptive_counts(engine) -> dict | None:
    """Adaptive speculation's running counts: steps per tier, draft catch-ups, drafts let go."""
    seen = engine.stats().get("speculative_adaptive")
    if not seen:
        return None
    return {
        "tier_steps": dict(zip(seen["tiers"], seen["steps"])),
        "catch_ups": seen.get("catch_ups", 0),
        "stopped_speculating": seen.get("stopped_speculating", 0),
    }


def counts_during(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {}
    steps = {tier: n - before["tier_steps"].get(tier, 0) for tier, n in after["tier_steps"].items()}
    return {
        "tier_steps": {tier: n for tier, n in steps.items() if n},
        "catch_ups": after["catch_ups"] - before["catch_ups"],
        "stopped_speculating": after["stopped_speculating"] - before["stopped_speculating"],
    }


def timed_with_cpus(engine, prompts, sp) -> tuple[dict, list[int]]:
    """`timed_run`, with the CPUs its loop thread was on as it started and as it ended (read
    around the run, not during it: a sampling thread would take the GIL from the loop)."""
    before, threads_before, counts = loop_cpu(engine), thread_cpu_seconds(), adaptive_counts(engine)
    run = timed_run(engine, prompts, sp)
    after, threads_after = loop_cpu(engine), thread_cpu_seconds()
    run["adaptive"] = counts_during(counts, adaptive_counts(engine))
    loop_tid = getattr(getattr(engine, "_thread", None), "native_id", None)
    run["thread_cpu_ms"] = thread_cpu_during(threads_before, threads_after, loop_tid)
    cpus = [c for c in (before, after) if c is not None]
    return run, [c for i, c in enumerate(cpus) if i == 0 or c != cpus[i - 1]]


def build_engines(configs: list[tuple[str, str]], common: list[str]) -> dict:
    from specserve.cli import add_engine_args, engine_kwargs
    from specserve.engine import Engine

    engines = {}
    for name, flags in configs:
        p = argparse.ArgumentParser()
        add_engine_args(p)
        args = p.parse_args([*common, *shlex.split(flags)])
        engines[name] = Engine(**engine_kwargs(args))
    return engines


def measure(
    engines: dict,
    batch_size: int,
    output_len: int,
    repeats: int,
    input_len: int | None = None,
    loop_cpu_choice: str | None = None,
) -> dict:
    """Warm each engine up at this batch size, then time `repeats` runs of each, in turns,
    on the same prompts (`timed_batch`: the packaged chats, or random ones of input_len).
    loop_cpu_choice: None (the OS places the loops), a CPU, or "fastest" (chosen per round)."""
    first = next(iter(engines.values()))
    prompts, sp, warm = timed_batch(first, batch_size, input_len, output_len)
    for engine in engines.values():
        warm_up(engine, warm, sp)
    runs = {name: [] for name in engines}
    for _ in range(repeats):
        pinned = None
        if loop_cpu_choice == "fastest":
            probes = probe_each_cpu()
            pinned = min(probes, key=probes.get)
        elif loop_cpu_choice is not None:
            pinned = int(loop_cpu_choice)
        if pinned is not None:
            pin_loops(engines.values(), {pinned})
        for name, engine in engines.items():
            engine.flush_cache()  # each timed prefill computes its prompts afresh
            probe = host_probe_ms()
            run, cpus = timed_with_cpus(engine, prompts, sp)
            wait_for_idle_captures(engine)
            accept = [o["meta_info"].get("spec_accept_length") or 1.0 for o in run["outs"]]
            runs[name].append(
                {
                    "decode_tok_s": round(run["decode_tok_s"], 1),
                    "accept_length": round(sum(accept) / len(accept), 3),
                    "host_probe_ms": round(probe, 2),
                    "loop_cpus": cpus,
                    "loop_pinned_to": pinned,
                    "thread_cpu_ms": run["thread_cpu_ms"],
                    **run["adaptive"],
                    **run["pauses"],  # (the collector's pauses within the run)
                }
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, nargs="+", default=[16, 128])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--input-len", type=int, default=None, help="random prompts of this length (default: chats)"
    )
    p.add_argument("--repeats", type=int, default=8, help="timed runs per configuration")
    p.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="NAME=FLAGS",
        help="a configuration's name and its engine flags (quoted); repeat for each",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--cpus",
        default=None,
        help="comma-separated CPUs to pin every thread of the process to (Linux)",
    )
    p.add_argument(
        "--probe-cpus", action="store_true", help="print the probe's ms on each CPU first"
    )
    p.add_argument(
        "--loop-cpu",
        default=None,
        help="pin the engines' loop threads alone to this CPU, or to the fastest one by the "
        "probe before each round ('fastest') (Linux)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    common = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1 :]
    args = p.parse_args(argv)
    configs = []
    for item in args.config:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            p.error(f"--config {item!r}: expected NAME=FLAGS")
        configs.append((name, flags))
    if args.loop_cpu not in (None, "fastest") and not args.loop_cpu.isdigit():
        p.error(f"--loop-cpu {args.loop_cpu!r}: expected a CPU number or 'fastest'")
    if args.probe_cpus:
        print(json.dumps({"probe_ms_by_cpu": probe_each_cpu()}))
    unpinned = pin_process({int(c) for c in args.cpus.split(",")}) if args.cpus else None
    if "--max-total-tokens" not in common:
        common += ["--max-total-tokens", "100000"]
    engines = build_engines(configs, common)
    table = []
    try:
        for bs in args.batch_size:
            runs = measure(
                engines, bs, args.output_len, args.repeats, args.input_len, args.loop_cpu
            )
            table.append({"batch_size": bs, "runs": runs})
    finally:
        for engine in engines.values():
            engine.shutdown()
        if unpinned is not None:
            pin_process(unpinned)
    names = [name for name, _ in configs]
    for row in table:
        row["median_tok_s"] = {
            n: statistics.median(r["decode_tok_s"] for r in row["runs"][n]) for n in names
        }
        row["over_first"] = {
            n: round(row["median_tok_s"][n] / row["median_tok_s"][names[0]], 3) for n in names
        }
    print(json.dumps(table, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(table, indent=2))
    print("| batch | " + " | ".join(f"{n} tok/s (accept)" for n in names) + " | ratios to first |")
    print("|---" * (len(names) + 2) + "|")
    for row in table:
        cells = []
        for n in names:
            accept = statistics.median(r["accept_length"] for r in row["runs"][n])
            cells.append(f"{row['median_tok_s'][n]:,.0f} ({accept:.2f})")
        ratios = " / ".join(f"{row['over_first'][n]:.2f}" for n in names[1:])
        print(f"| {row['batch_size']} | " + " | ".join(cells) + f" | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
