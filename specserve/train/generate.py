"""Self-distillation answers from one or several generator workers, within a wall-clock budget.

A job is (prompt index, temperature, seed). Pass 0 answers every prompt greedily; each later
pass samples (its temperature cycles through `temperatures`). Every pass visits the prompts in
its own seeded order, so a pass cut short by the deadline still covers varied prompts.

Workers pull chunks of jobs from one queue (a faster worker simply takes more):

- `engine`: `specserve.Engine`, the serving path itself (paged KV cache, continuous batching;
  a new request is submitted whenever one finishes, `max_running_requests` at once);
- `dense`: `features.generate_dense`, the target's own modules over a dense left-padded batch
  (no paging, no scheduler: the fastest way to use an otherwise idle GPU).

One worker runs in this process; several run as processes of their own (`spawn`), each
writing one JSON line per answer to its own file as answers finish. A run stopped before the
end (killed, its machine lost) thus keeps what it finished: the next run of the same jobs in
that folder generates only the others. At the deadline a worker stops and also writes what
its unfinished answers have so far (marked `complete: false`; the dataset keeps them as
answers cut short).
A worker that fails writes its traceback next to its output and the others carry on.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import time
import traceback
from dataclasses import asdict, dataclass, field

Job = tuple[int, float, int]  # prompt index, temperature, seed


@dataclass
class GenConfig:
    target: str
    load_format: str = "auto"
    device: str = "cpu"
    dense_dtype: str = "bfloat16"
    engine_dtype: str | None = None  # None: the engine's own choice
    max_new_tokens: int = 192
    eos: list[int] = field(default_factory=list)
    max_running_requests: int = 256  # engine workers: requests decoding at once
    dense_batch_size: int = 256  # dense workers: rows generated together
    engine_kwargs: dict = field(default_factory=dict)
    torch_threads: int = 2  # per worker process


def parse_workers(spec: str) -> list[str]:
    """'engine' | 'dense' | 'engine:4,dense:1' -> ['engine', 'engine', 'engine', 'engine', 'dense']."""
    out: list[str] = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        kind, _, count = part.partition(":")
        if kind not in ("engine", "dense"):
            raise ValueError(f"generator worker must be 'engine' or 'dense', got {kind!r}")
        n = int(count) if count else 1
        if n < 0:
            raise ValueError(f"{part!r}: negative worker count")
        out += [kind] * n
    if not out:
        raise ValueError(f"no generator worker in {spec!r}")
    return out


def make_jobs(
    num_prompts: int, passes: int, temperatures: tuple[float, ...] | list[float], seed: int
) -> list[Job]:
    """Pass 0 greedy, passes 1.. sampled at temperatures[(pass - 1) % len]; each pass in its
    own seeded prompt order."""
    jobs: list[Job] = []
    for ps in range(passes):
        order = list(range(num_prompts))
        random.Random(seed * 7919 + ps).shuffle(order)
        temp = 0.0 if ps == 0 else float(temperatures[(ps - 1) % len(temperatures)])
        jobs += [(i, temp, (seed * 1_000_003 + ps * 100_003 + i) % 2**31) for i in order]
    return jobs


def chunked(jobs: list[Job], size: int) -> list[list[Job]]:
    return [jobs[i : i + size] for i in range(0, len(jobs), size)]


class _ListSource:
    """The in-process stand-in for the shared job queue."""

    def __init__(self, chunks: list[list[Job]]):
        self.chunks = list(chunks)

    def get(self):
        return self.chunks.pop(0) if self.chunks else None


def _unknown_engine_args(keys) -> str | None:
    """Why `keys` are refused, or None: each must be an EngineConfig field (a typo would
    otherwise run another configuration than the one asked for)."""
    from specserve.config import EngineConfig

    known = EngineConfig.field_names()
    unknown = sorted(k for k in keys if k not in known)
    if not unknown:
        return None
    return f"unknown engine argument {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"


def engine_kwargs_known(kwargs: dict) -> dict:
    """`kwargs`, each key an engine argument; an unknown one is refused naming the allowed."""
    from specserve.errors import InvalidArgument

    why = _unknown_engine_args(kwargs)
    if why:
        raise InvalidArgument("--engine-arg", why)
    return dict(kwargs)


def check_engine_args(kwargs: dict, **base) -> None:
    """Refuse before anything loads what the engine would refuse once loading: `kwargs`
    (the --engine-arg values) over `base` (what the caller passes the engine itself),
    through EngineConfig's own checks, which read no model."""
    from specserve.config import EngineConfig
    from specserve.errors import InvalidArgument

    try:
        EngineConfig.from_kwargs(**{**base, **engine_kwargs_known(kwargs)}).resolve()
    except InvalidArgument as e:
        if e.field == "--engine-arg":
            raise
        raise InvalidArgument("--engine-arg", str(e)) from None


def parse_engine_args(items: list[str]) -> dict:
    """['KEY=VALUE', ...] -> {key: value}; a VALUE that parses as JSON is taken as such
    (true, 65536, 0.8), otherwise as a string; '-' in keys becomes '_'. A KEY that is no
    engine argument is refused (ValueError)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"engine argument {item!r}: expected KEY=VALUE")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    why = _unknown_engine_args(out)
    if why:
        raise ValueError(why)
    return out


def _write(f, job_id: int, job: Job, ids: list[int], complete: bool) -> None:
    f.write(json.dumps({"job": job_id, "ids": ids, "complete": complete}) + "\n")
    f.flush()


def _engine_worker(cfg: GenConfig, prompt_ids, source, f, deadline: float | None) -> None:
    from specserve.engine import Engine

    max_prompt = max(len(p) for p in prompt_ids)
    kw = dict(
        model_path=cfg.target,
        load_format=cfg.load_format,
        device=cfg.device,
        skip_tokenizer_init=True,
        no_default_draft=True,  # the target's own answers, decoded plainly
        max_running_requests=cfg.max_running_requests,
        # sized for the work, not from free memory: several workers share one GPU
        max_total_tokens=cfg.max_running_requests * (max_prompt + cfg.max_new_tokens + 64),
    )
    if cfg.engine_dtype:
        kw["dtype"] = cfg.engine_dtype
    kw.update(engine_kwargs_known(cfg.engine_kwargs))
    done: queue.Queue = queue.Queue()
    got: dict[str, list[int]] = {}
    meta: dict[str, tuple[int, Job]] = {}
    eos = list(cfg.eos)

    def on_output(rid):
        def cb(out):
            got[rid].extend(out["output_ids"])
            if out["finished"]:
                reason = out["meta_info"].get("finish_reason") or {}
                done.put((rid, reason.get("type") if isinstance(reason, dict) else reason))

        return cb

    with Engine(**kw) as engine:
        in_flight, exhausted = 0, False
        want = max(1, cfg.max_running_requests + cfg.max_running_requests // 2)
        while deadline is None or time.time() < deadline:
            while not exhausted and in_flight < want:
                chunk = source.get()
                if chunk is None:
                    exhausted = True
                    break
                for job_id, job in chunk:
                    rid = f"j{job_id}"
                    got[rid], meta[rid] = [], (job_id, job)
                    params = {
                        "temperature": job[1],
                        "max_new_tokens": cfg.max_new_tokens,
                        "seed": job[2],
                        # exactly the caller's EOS set (the model's and its tokenizer's)
                        "ignore_eos": True,
                        "stop_token_ids": eos,
                    }
                    engine.submit(prompt_ids[job[0]], params, on_output(rid), rid=rid)
                    in_flight += 1
            if exhausted and in_flight == 0:
                break
            try:
                rid, reason = done.get(timeout=0.2)
            except queue.Empty:
                continue
            job_id, job = meta.pop(rid)
            _write(f, job_id, job, got.pop(rid), reason in ("stop", "length"))
            in_flight -= 1
    # the engine's loop has stopped: what is left was cut by the deadline
    while True:
        try:
            rid, reason = done.get_nowait()
        except queue.Empty:
            break
        if rid in meta:
            job_id, job = meta.pop(rid)
            _write(f, job_id, job, got.pop(rid), reason in ("stop", "length"))
    for rid, (job_id, job) in meta.items():
        if got[rid]:
            _write(f, job_id, job, got[rid], False)


def _dense_worker(cfg: GenConfig, prompt_ids, source, f, deadline: float | None) -> None:
    from specserve.train.data import load_target
    from specserve.train.features import generate_dense

    loaded = load_target(cfg.target, cfg.dense_dtype, cfg.device, cfg.load_format)
    eos = set(cfg.eos)
    exhausted = False
    while not exhausted and (deadline is None or time.time() < deadline):
        pulled: list[tuple[int, Job]] = []
        while len(pulled) < cfg.dense_batch_size:
            chunk = source.get()
            if chunk is None:
                exhausted = True
                break
            pulled += chunk
        by_temp: dict[float, list[tuple[int, Job]]] = {}
        for item in pulled:
            by_temp.setdefault(item[1][1], []).append(item)
        for temp, items in by_temp.items():
            items.sort(key=lambda it: len(prompt_ids[it[1][0]]))  # less left padding
            outs = generate_dense(
                loaded.model,
                [prompt_ids[job[0]] for _, job in items],
                cfg.max_new_tokens,
                eos,
                temp,
                items[0][1][2],
                deadline=deadline,
            )
            for (job_id, job), ids in zip(items, outs):
                complete = bool(ids) and (ids[-1] in eos or len(ids) >= cfg.max_new_tokens)
                if ids:
                    _write(f, job_id, job, ids, complete)


def run_worker(kind: str, cfg: GenConfig, prompt_ids, source, out_path: str, deadline) -> None:
    with open(out_path, "a") as f:
        if kind == "engine":
            _engine_worker(cfg, prompt_ids, source, f, deadline)
        else:
            _dense_worker(cfg, prompt_ids, source, f, deadline)


def _worker_main(kind, cfg_dict, prompt_ids, q, out_path, deadline) -> None:
    import torch

    cfg = GenConfig(**cfg_dict)
    torch.set_num_threads(max(1, cfg.torch_threads))
    try:
        run_worker(kind, cfg, prompt_ids, q, out_path, deadline)
    except BaseException:
        with open(out_path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


def read_results(path: str) -> list[dict]:
    out = []
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):  # a line cut by a kill is dropped
                out.append(json.loads(line))
    return out


def generate_answers(
    cfg: GenConfig,
    prompt_ids: list[list[int]],
    jobs: list[Job],
    workers: list[str],
    out_dir: str,
    deadline: float | None = None,
    chunk: int = 64,
    log=print,
    poll_seconds: float = 10.0,
) -> list[dict]:
    """Answers for `jobs` (those finished or cut by `deadline`, a time.time() value), as
    dicts {job, ids, complete}, sorted by job. One worker runs in this process; several run
    as processes. Worker files `answers_<i>_<kind>.jsonl` go to `out_dir`, beside the plan
    they answer; the finished answers of an earlier run of the same plan that was stopped
    (killed, or its machine lost) are kept, and only the other jobs are generated."""
    os.makedirs(out_dir, exist_ok=True)
    kept = _finished_answers_of_plan(out_dir, _plan_of(cfg, prompt_ids, jobs))
    if kept:
        log(f"generate: keeping {len(kept)} finished answers of an earlier run of these jobs")
    items = [(j, job) for j, job in enumerate(jobs) if j not in kept]
    chunks = chunked(items, chunk)
    paths = [os.path.join(out_dir, f"answers_{i}_{k}.jsonl") for i, k in enumerate(workers)]
    t0 = time.time()
    if items and len(workers) == 1:
        run_worker(workers[0], cfg, prompt_ids, _ListSource(chunks), paths[0], deadline)
    elif items:
        _run_processes(cfg, prompt_ids, chunks, workers, paths, deadline, log, poll_seconds, t0)
    results: dict[int, dict] = dict(kept)
    for p in paths:
        for r in read_results(p):
            results[r["job"]] = r
    errors = [p + ".error" for p in paths if os.path.exists(p + ".error")]
    for e in errors:
        log(f"generator worker failed ({e}):\n{open(e).read()[-2000:]}")
    if not results:
        raise RuntimeError(f"no answers generated (worker errors: {errors or 'none'})")
    out = [results[j] for j in sorted(results)]
    ntok = sum(len(r["ids"]) for r in out if r["job"] not in kept)
    log(
        f"generated {len(out) - len(kept)} answers, {ntok} tokens in {time.time() - t0:.0f}s "
        f"({ntok / max(1e-9, time.time() - t0):.0f} tok/s; {len(jobs)} jobs planned, "
        f"{len(kept)} answered before)"
    )
    return out


KEPT = "answers_kept.jsonl"  # the finished answers of earlier runs of the same jobs


def _plan_of(cfg: GenConfig, prompt_ids, jobs: list[Job]) -> str:
    """What the answers of `jobs` depend on, as one digest."""
    spec = [cfg.target, cfg.load_format, cfg.max_new_tokens, sorted(cfg.eos), prompt_ids, jobs]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()


def _finished_answers_of_plan(out_dir: str, plan: str) -> dict[int, dict]:
    """The finished answers in `out_dir` if its files answer `plan`, gathered into one file
    (written before the others are removed: a stop meanwhile loses none); the folder is then
    set up for this run, every other answer file removed."""
    plan_path, kept_path = os.path.join(out_dir, "plan.json"), os.path.join(out_dir, KEPT)
    same = False
    if os.path.isfile(plan_path):
        with open(plan_path) as f:
            same = json.load(f).get("plan") == plan
    kept: dict[int, dict] = {}
    names = sorted(n for n in os.listdir(out_dir) if n.startswith("answers_"))
    if same:
        for name in names:
            if name.endswith(".jsonl"):
                done = read_results(os.path.join(out_dir, name))
                kept.update((r["job"], r) for r in done if r["complete"])
    if kept:
        with open(kept_path + ".tmp", "w") as f:
            f.writelines(json.dumps(kept[job_id]) + "\n" for job_id in sorted(kept))
        os.replace(kept_path + ".tmp", kept_path)
    for name in os.listdir(out_dir):
        if name.startswith("answers_") and not (kept and name == KEPT):
            os.remove(os.path.join(out_dir, name))
    with open(plan_path + ".tmp", "w") as f:
        json.dump({"plan": plan}, f)
    os.replace(plan_path + ".tmp", plan_path)
    return kept


def _run_processes(cfg, prompt_ids, chunks, workers, paths, deadline, log, poll_seconds, t0):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    for c in chunks:
        q.put(c)
    for _ in workers:
        q.put(None)
    procs = []
    for kind, path in zip(workers, paths):
        p = ctx.Process(
            target=_worker_main,
            args=(kind, asdict(cfg), prompt_ids, q, path, deadline),
            daemon=True,
        )
        p.start()
        procs.append(p)
    # a worker stops at the deadline by itself; past it plus this grace it is terminated
    grace = 30.0
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(timeout=poll_seconds / max(1, len(procs)))
        n_ans = n_tok = 0
        for path in paths:
            rs = read_results(path)
            n_ans += len(rs)
            n_tok += sum(len(r["ids"]) for r in rs)
        el = time.time() - t0
        alive = sum(p.is_alive() for p in procs)
        log(
            f"[generate {el:5.0f}s] {n_ans} answers, {n_tok} tokens ({n_tok / max(el, 1e-9):.0f}"
            f" tok/s), {alive}/{len(procs)} workers running"
        )
        if deadline is not None and time.time() > deadline + grace:
            for p in procs:
                if p.is_alive():
                    log(f"terminating worker pid {p.pid} ({grace:.0f}s past the deadline)")
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            break
    q.cancel_join_thread()
    q.close()
