"""`specserve train-eagle` on tiny random-weight targets (CPU, seconds): the generators, the
dataset, the training (loss falls, the engine's accept length rises), resume, the time budget,
the command line, and the bundled-draft wiring of `specserve generate`."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from specserve import Engine
from specserve.errors import InvalidArgument
from specserve.speculative.eagle_checkpoint import eagle3_capture_layers, load_eagle_head
from specserve.train.checkpoint import save_draft
from specserve.train.data import DataArgs, build_dataset, load_shards, load_target
from specserve.train.features import forward_padded, generate_dense
from specserve.train.generate import GenConfig, generate_answers, make_jobs, parse_workers
from specserve.train.head_init import make_head, scale_fc_init_
from specserve.train.schedule import lr_at, schedule_seconds
from specserve.train.sequences import SeqData
from specserve.train.train_args import TrainArgs
from specserve.train.trainer import train
from specserve.train.unroll import ttt_mask
from tests.engine_utils import TINY, mixed_prompts, plain_forward

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
VOCAB = 128


def tiny_target():
    return load_target("tiny", "float32", "cpu", load_format="dummy").model


def quiet(_msg) -> None:
    pass


def test_dense_generator_equals_engine_greedy():
    prompts = mixed_prompts(6, 512, seed=3, min_len=1, max_len=20)
    with Engine(**TINY) as e:
        ref = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert generate_dense(tiny_target(), prompts, 24) == ref


def test_dense_generator_stops_and_compacts_like_the_engine():
    # an EOS the tiny model draws often: rows finish at different steps, and whether the batch
    # is compacted at every finish, never, or in between, the outputs are the engine's
    model = tiny_target()
    prompts = mixed_prompts(10, 512, seed=5, min_len=1, max_len=16)
    free = generate_dense(model, prompts, 30)
    # the token whose first occurrence falls at the most different steps across rows
    firsts: dict[int, set[int]] = {}
    for o in free:
        for t in set(o):
            firsts.setdefault(t, set()).add(o.index(t))
    eos = max(firsts, key=lambda t: len(firsts[t]))
    params = {"temperature": 0.0, "max_new_tokens": 30, "stop_token_ids": [eos]}
    with Engine(**TINY) as e:
        ref = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert len({len(r) for r in ref}) > 2  # finished at several different steps
    for frac in (0.0, 0.5, 1.1):
        assert generate_dense(model, prompts, 30, {eos}, compact_fraction=frac) == ref


def test_padded_forward_equals_runtime_forward():
    model = tiny_target()
    seqs = mixed_prompts(3, 512, seed=4, min_len=5, max_len=30)
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    f = forward_padded(model, ids, capture_layers=(1,), topk=3)
    for r, s in enumerate(seqs):
        _, out = plain_forward(model, s)
        torch.testing.assert_close(f.hidden[r, : len(s)], out.hidden, atol=1e-5, rtol=1e-5)
        logits = model.compute_logits(out.hidden)
        assert torch.equal(f.top_ids[r, : len(s), 0], logits.argmax(-1))


def test_ttt_mask_is_the_drafter_visibility():
    # step-k query at p: true-feature keys at <= p - k, then its draft ancestors p-k+1..p
    m = ttt_mask(4, 2, "cpu").int()
    assert m.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ]


def test_jobs_and_worker_specs():
    jobs = make_jobs(5, 3, (0.7, 1.0), seed=1)
    assert len(jobs) == 15 and [j[1] for j in jobs] == [0.0] * 5 + [0.7] * 5 + [1.0] * 5
    for ps in range(3):  # every pass visits every prompt once
        assert sorted(j[0] for j in jobs[5 * ps : 5 * ps + 5]) == list(range(5))
    assert len({j[2] for j in jobs}) == 15
    assert parse_workers("engine:2,dense") == ["engine", "engine", "dense"]
    with pytest.raises(ValueError):
        parse_workers("vllm")


def test_lr_schedule():
    args = TrainArgs(lr=1.0, warmup=0.1, min_lr_ratio=0.1)
    assert lr_at(0.0, args) == pytest.approx(0.01)
    assert lr_at(0.05, args) == pytest.approx(0.5)
    assert lr_at(0.1, args) == pytest.approx(1.0)
    assert lr_at(0.55, args) == pytest.approx(0.55)
    assert lr_at(1.0, args) == pytest.approx(0.1)


# ---- a tiny target with structure to learn, its dataset ---------------------------------------
def _write_target(folder, with_tokenizer: bool = False, num_layers: int = 2) -> str:
    """A small random HF target whose lm_head is scaled up (peaked next-token distributions,
    as in a trained model: a near-uniform random model has no structure to learn)."""
    from safetensors.torch import load_file, save_file

    from tests.model_factory import write_hf_model

    target = write_hf_model(
        folder,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        seed=5,
        with_tokenizer=with_tokenizer,
        num_layers=num_layers,
    )
    path = os.path.join(target, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8
    save_file(weights, path, metadata={"format": "pt"})
    return target


def _tiny_dataset(target: str, out_dir: str, **extra) -> dict:
    """256 greedy + 256 sampled answers of 40 tokens; returns the manifest."""
    args = DataArgs(
        target=target,
        out_dir=out_dir,
        max_new_tokens=40,
        gen_dtype="float32",
        feature_dtype="float32",
        batch_size=64,
        sampled_passes=1,
        temperature=0.7,
        **extra,
    )
    return build_dataset(args, prompt_ids=mixed_prompts(256, VOCAB, seed=11, max_len=12))


# a short training that visibly learns the tiny targets' structure
SHORT_TRAIN = dict(
    epochs=6, lr=3e-3, batch_tokens=1024, ttt_steps=2, log_every=4, save_every=0, val_fraction=0.1
)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """(folder, manifest, target path): the tiny dataset in shards of 200 sequences."""
    root = tmp_path_factory.mktemp("eagle")
    target = _write_target(root / "target")
    manifest = _tiny_dataset(target, str(root / "data"), shard_size=200)
    return root, manifest, target


def test_dataset_layout(tiny_data):
    root, manifest, _ = tiny_data
    assert manifest["complete"] and manifest["num_sequences"] == 512
    assert len(manifest["shards"]) == 3  # 200 + 200 + 112 sequences
    shards = load_shards(str(root / "data"))
    sh = shards[0]
    n = int(sh["offsets"][-1])
    assert sh["input_ids"].shape == (n,) and sh["hidden"].shape == (n, 64)
    assert sh["hidden"].dtype == torch.float16 and sh["top_ids"].shape == (n, 4)
    # the greedy pass comes first: every answer token is the target's greedy choice
    start, pl = 0, int(sh["prompt_lens"][0])
    end = int(sh["offsets"][1])
    ids, top = sh["input_ids"][start:end], sh["top_ids"][start:end, 0]
    assert torch.equal(ids[pl:], top[pl - 1 : -1])
    # a sequence trains when it has a position the drafter would use: an answer of one
    # token that is EOS has none (the target drew the EOS itself, nothing is left to draft)
    usable = 0
    for sh in shards:
        answer = (sh["offsets"][1:] - sh["offsets"][:-1]) - sh["prompt_lens"]
        usable += int(((answer >= 2) | ((answer == 1) & ~sh["ended"])).sum())
    data = SeqData(shards, 1024)
    assert len(data) == usable >= 480
    # batches: padded to their longest sequence, loss rows inside each sequence's answer
    b = data.batch([0, 1, 2], ttt_steps=2)
    width = int(data.n[[0, 1, 2]].max())
    assert b["ids"].shape == (3, width) and b["features"].shape == (3, width, 64)
    rows = b["rows"][0]
    r, p = rows // (width - 1), rows % (width - 1)
    for i in range(3):
        mine = p[r == i]
        assert int(mine.min()) == data.lo[i] and int(mine.max()) == data.hi[i] - 1
    by_tokens = data.batches(range(len(data)), 0, batch_tokens=200)
    assert sorted(int(i) for bt in by_tokens for i in bt) == list(range(len(data)))
    assert all(len(bt) * int(data.n[bt].max()) <= 200 or len(bt) == 1 for bt in by_tokens)


def _run_draft(target: str, draft: str, prompts, algorithm="EAGLE", topk: int = 1):
    """(accept length, greedy outputs) of a 3-step chain (topk 1) or tree with the draft."""
    with Engine(
        model_path=target,
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=4 if topk == 1 else 1 + 3 * topk,
    ) as e:
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        return e.stats()["spec_accept_length"], [o["output_ids"] for o in outs]


def _accept_length(target: str, draft: str, prompts) -> float:
    return _run_draft(target, draft, prompts)[0]


def test_training_lowers_loss_and_raises_accept_length(tiny_data):
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    # the head as training starts it, saved as a draft: the baseline accept length
    untrained = str(root / "untrained")
    head = make_head(target, seed=0)
    scale_fc_init_(head, SeqData(load_shards(str(root / "data")), 1024))
    save_draft(untrained, head)

    out = str(root / "draft")
    summary = train(target, str(root / "data"), out, TrainArgs(**SHORT_TRAIN), log=quiet)
    curve = json.load(open(os.path.join(out, "train_curve.json")))
    hist = curve["history"]
    first, last = hist[0], hist[-1]
    assert last["loss"] < 0.6 * first["loss"], (first, last)
    assert last["acc"][0] > first["acc"][0] + 0.2, (first, last)
    assert summary["final"]["val_acc_0"] > 0.25, summary["final"]  # prompts never trained on

    # the saved folder is a published-layout EAGLE checkpoint without embedding / lm_head
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in saved.values())
    assert not any("embed" in k or "lm_head" in k for k in saved)
    loaded, _ = load_eagle_head(out, "EAGLE", target)
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    for name, p in loaded.state_dict().items():
        torch.testing.assert_close(p, state["head"][name].half().float(), atol=0, rtol=0)

    # the engine's greedy accept length (3-step chain), on prompts never trained on
    prompts = mixed_prompts(8, VOCAB, seed=99, max_len=12)
    before = _accept_length(target_path, untrained, prompts)
    after = _accept_length(target_path, out, prompts)
    # (measured: 1.0 -> about 1.5; the untrained head's drafts are never accepted)
    assert before < 1.1 and after > before + 0.25, (before, after)
    print(f"accept length untrained {before:.3f}, trained {after:.3f}")


def test_resume_continues_from_saved_step(tiny_data):
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    out = str(root / "resume")
    args = TrainArgs(epochs=1, lr=3e-3, batch_size=16, ttt_steps=1, save_every=5)
    first = train(target, str(root / "data"), out, args, log=quiet)
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    per_epoch = -(-first["num_train_sequences"] // 16)
    assert ckpt["step"] == first["steps"] == per_epoch
    logs: list[str] = []
    args2 = TrainArgs(**{**args.__dict__, "epochs": 2})
    second = train(target, str(root / "data"), out, args2, resume=True, log=logs.append)
    assert any("resumed" in m and f"step {per_epoch}" in m for m in logs)
    assert second["steps"] == 2 * per_epoch
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert state["step"] == 2 * per_epoch and state["epoch"] == 1
    assert len(state["history"]) > len(ckpt["history"])
    # another split or batch layout would score the draft on sequences it trained on, and
    # put the saved position in other batches: refused, naming the flag
    for change, flag in (
        ({"seed": 1}, "--seed"),
        ({"val_fraction": 0.2}, "--val-fraction"),
        ({"batch_size": 8}, "--batch-size"),
    ):
        bad = TrainArgs(**{**args2.__dict__, **change, "epochs": 3})
        with pytest.raises(InvalidArgument, match=flag) as refused:
            train(target, str(root / "data"), out, bad, resume=True, log=quiet)
        assert refused.value.field == flag
    assert (
        torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["step"] == state["step"]
    )


def test_a_short_run_stops_and_resume_without_a_checkpoint_starts_as_a_fresh_run(tiny_data):
    """A fraction of an epoch trains one step (it meant "no limit" once rounded to 0 steps);
    unrolled steps past every position of a batch add nothing (they crashed); --resume
    with no checkpoint yet is a fresh run, initialized alike."""
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    # (short sequences: the last unrolled steps reach no position of a batch of one)
    args = TrainArgs(epochs=1e-6, batch_size=1, ttt_steps=64, save_every=0, val_fraction=0)
    heads = []
    for name, resume in (("fresh", False), ("resumed", True)):
        out = str(root / f"short-{name}")
        summary = train(target, str(root / "data"), out, args, resume=resume, log=quiet)
        assert summary["steps"] == 1
        state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
        assert all(torch.isfinite(v).all() for v in state["head"].values())
        heads.append(state["head"])
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_time_budget_stops_training_and_anneals(tiny_data):
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    out = str(root / "timed")
    args = TrainArgs(
        epochs=0, time_budget=3.0, lr=1e-3, batch_size=8, ttt_steps=1, log_every=1, save_every=0
    )
    t0 = time.perf_counter()
    summary = train(target, str(root / "data"), out, args, log=quiet)
    # (several steps, however loaded the machine: the clock, not a step count, stopped it)
    assert summary["steps"] >= 3 and summary["train_seconds"] >= 3.0
    assert time.perf_counter() - t0 < 30
    hist = json.load(open(os.path.join(out, "train_curve.json")))["history"]
    assert hist[-1]["lr"] < 0.3 * args.lr  # the schedule ran to its end on the clock


def test_time_budget_stops_a_run_whose_schedule_resume_continues(tiny_data):
    """With epochs the schedule follows the steps: a run whose time budget is spent stops
    mid-schedule with its learning rate still high, and a resumed run finishes that schedule."""
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    out = str(root / "paused")
    base = dict(epochs=3, lr=1e-3, warmup=0.0, batch_size=16, ttt_steps=1, log_every=1)
    args = TrainArgs(**base, time_budget=0.5, save_every=0)
    first = train(target, str(root / "data"), out, args, log=quiet)
    curve = os.path.join(out, "train_curve.json")
    hist = json.load(open(curve))["history"]
    per_epoch = -(-first["num_train_sequences"] // 16)
    assert 0.5 <= first["train_seconds"] < 10.0 and 1 <= first["steps"] < 2 * per_epoch
    assert hist[-1]["lr"] > 0.3 * base["lr"]  # stopped early in the schedule: not annealed
    second = train(target, str(root / "data"), out, TrainArgs(**base), resume=True, log=quiet)
    hist = json.load(open(curve))["history"]
    assert second["steps"] == 3 * per_epoch
    assert hist[-1]["lr"] < 0.1 * base["lr"]


def test_time_budget_of_a_resumed_clock_schedule(tiny_data):
    """With epochs 0 every run's schedule ends annealed at its budget: a resumed run's spans
    the seconds trained before plus its own budget."""
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    out = str(root / "clock")
    base = dict(epochs=0, time_budget=2.0, lr=1e-3, batch_size=8, ttt_steps=1, log_every=1)
    first = train(target, str(root / "data"), out, TrainArgs(**base, save_every=0), log=quiet)
    curve = os.path.join(out, "train_curve.json")
    assert json.load(open(curve))["history"][-1]["lr"] < 0.3 * base["lr"]
    second = train(
        target, str(root / "data"), out, TrainArgs(**base, save_every=0), resume=True, log=quiet
    )
    hist = json.load(open(curve))["history"]
    assert second["steps"] > first["steps"]
    assert first["train_seconds"] + 1.5 <= second["train_seconds"] < first["train_seconds"] + 5.0
    assert hist[-1]["lr"] < 0.3 * base["lr"]
    assert schedule_seconds(TrainArgs(**base), 3.0) == 5.0
    assert schedule_seconds(TrainArgs(**{**base, "epochs": 1.0}), 3.0) == 0.0  # by steps


def test_bundled_prompt_files_are_what_the_generator_writes():
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "make_prompts.py")
    done = subprocess.run([sys.executable, tool, "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- generation workers ---------------------------------------------------------------------------
def test_parallel_workers_answer_every_job_once(tiny_data, tmp_path):
    """An engine worker and a dense worker (processes) share the jobs: every job is answered
    once, and greedy answers equal the dense generator's in this process."""
    _, _, target_path = tiny_data
    prompts = mixed_prompts(24, VOCAB, seed=21, max_len=10)
    jobs = make_jobs(len(prompts), 2, (0.8,), seed=0)
    cfg = GenConfig(
        target=target_path,
        dense_dtype="float32",
        engine_dtype="float32",
        max_new_tokens=12,
        eos=[2],
        max_running_requests=8,
        dense_batch_size=8,
        torch_threads=1,
    )
    logs: list[str] = []
    res = generate_answers(
        cfg, prompts, jobs, ["engine", "dense"], str(tmp_path), chunk=4, log=logs.append
    )
    assert not any("failed" in m for m in logs), logs
    assert sorted(os.listdir(tmp_path)) == [
        "answers_0_engine.jsonl",
        "answers_1_dense.jsonl",
        "plan.json",
    ]
    assert [r["job"] for r in res] == list(range(len(jobs)))
    assert all(r["complete"] for r in res)
    model = load_target(target_path, "float32", "cpu").model
    greedy = [(j, job) for j, job in enumerate(jobs) if job[1] == 0.0]
    ref = generate_dense(model, [prompts[job[0]] for _, job in greedy], 12, {2})
    assert [res[j]["ids"] for j, _ in greedy] == ref


def test_a_stopped_generation_keeps_its_finished_answers(tiny_data, tmp_path):
    """A run killed mid-generation leaves its finished answers (and a line cut by the kill);
    the next run of the same jobs keeps those and generates only the others. Other jobs (here
    another length) start over."""
    _, _, target_path = tiny_data
    prompts = mixed_prompts(12, VOCAB, seed=23, max_len=10)
    jobs = make_jobs(len(prompts), 1, (), seed=0)
    cfg = GenConfig(target=target_path, dense_dtype="float32", max_new_tokens=8, eos=[2])
    full = generate_answers(cfg, prompts, jobs, ["dense"], str(tmp_path), log=quiet)
    path = tmp_path / "answers_0_dense.jsonl"
    lines = path.read_text().splitlines()
    # as a kill leaves it: 5 finished answers (one marked to tell a kept answer from a new
    # one), an unfinished one, and a torn line
    marked = {**json.loads(lines[0]), "ids": [7, 7, 7]}
    partial = {**json.loads(lines[5]), "complete": False}
    kept = [json.dumps(marked), *lines[1:5], json.dumps(partial)]
    path.write_text("".join(line + "\n" for line in kept) + lines[6][:9])  # (torn: no newline)
    logs: list[str] = []
    again = generate_answers(cfg, prompts, jobs, ["dense"], str(tmp_path), log=logs.append)
    assert any("keeping 5 finished answers" in m for m in logs), logs
    assert [r["job"] for r in again] == list(range(len(jobs))) and all(r["complete"] for r in again)
    assert again[marked["job"]]["ids"] == [7, 7, 7]
    assert [r for r in again if r["job"] != marked["job"]] == [
        r for r in full if r["job"] != marked["job"]
    ]
    assert any(f"generated {len(jobs) - 5} answers" in m for m in logs), logs
    # a second stop keeps them still; another plan does not
    again = generate_answers(cfg, prompts, jobs, ["dense"], str(tmp_path), log=quiet)
    assert again[marked["job"]]["ids"] == [7, 7, 7]
    cfg.max_new_tokens = 6
    other = generate_answers(cfg, prompts, jobs, ["dense"], str(tmp_path), log=quiet)
    assert all(len(r["ids"]) <= 6 for r in other) and len(other) == len(jobs)


def test_deadline_cuts_generation_and_keeps_prefixes(tiny_data):
    _, _, target_path = tiny_data
    # 256 answers of ~250 tokens (the context) at 4 at a time: far more than 4 s of work,
    # even on an idle fast machine (64 answers could finish in 2 s there); the deadline
    # counts the engine's start too, which a loaded machine slows
    prompts = mixed_prompts(256, VOCAB, seed=22, max_len=10)
    cfg = GenConfig(
        target=target_path, engine_dtype="float32", max_new_tokens=1000, eos=[], dense_batch_size=4
    )
    import tempfile

    model = load_target(target_path, "float32", "cpu").model
    for kind in ("engine", "dense"):
        cfg.max_running_requests = 4
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            res = generate_answers(
                cfg, prompts, make_jobs(256, 1, (), 0), [kind], tmp, deadline=t0 + 4.0, log=quiet
            )
            assert time.time() - t0 < 20
        assert res and not all(r["complete"] for r in res)
        r = res[0]
        # the cut answer is the start of the real one (compared over its first tokens: over
        # hundreds of float32 steps batches of other sizes may break a near-tie differently)
        assert len(r["ids"]) >= 16
        ref = generate_dense(model, [prompts[make_jobs(256, 1, (), 0)[r["job"]][0]]], 16)[0]
        assert r["ids"][:16] == ref


# ---- the command line ---------------------------------------------------------------------------
def test_train_eagle_command_end_to_end(tmp_path, capsys):
    """Bundled prompts through a tiny target's chat template, one greedy and one sampled pass,
    features, a short training; the output loads in the engine."""
    from specserve.cli import main

    target = _write_target(tmp_path / "target", with_tokenizer=True)
    out = str(tmp_path / "draft")
    argv = ["train-eagle", "--target", target, "--out", out, "--num-prompts", "24"]
    argv += ["--max-new-tokens", "16", "--sampled-passes", "1", "--temperature", "0.7"]
    argv += ["--gen-dtype", "float32", "--feature-dtype", "float32", "--gen-batch-size", "24"]
    argv += ["--epochs", "1", "--batch-tokens", "2048", "--ttt-steps", "1"]
    argv += ["--token-map-size", "8192"]
    assert main(argv) == 0
    meta = json.load(open(os.path.join(out, "training_args.json")))
    assert meta["data"]["num_sequences"] == 48 and meta["train"]["steps"] >= 1
    # the reduced draft vocabulary beside the draft: the answers' tokens first
    token_map = json.load(open(os.path.join(out, "token_map.json")))
    answers = json.load(open(os.path.join(out + ".work", "data", "answers.json")))["answers"]
    seen = {t for a in answers for t in a}
    vocab = load_target(target, "float32", "cpu").config.vocab_size
    assert token_map["size"] == len(token_map["token_ids"]) == min(8192, vocab)
    assert set(token_map["token_ids"][: len(seen)]) == seen and token_map["coverage"] == 1.0
    for extra in ({}, {"speculative_token_map": os.path.join(out, "token_map.json")}):
        with Engine(
            model_path=target,
            dtype="float32",
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=out,
            speculative_num_steps=2,
            **extra,
        ) as e:
            o = e.generate(prompt="hello", sampling_params={"max_new_tokens": 8})
        assert o["meta_info"]["spec_verify_ct"] >= 1


def test_token_map_command_writes_a_folder_of_maps_or_one_file(tmp_path, capsys):
    """`specserve token-map`: one ranking of the target's answer tokens, cut at each size,
    one file per size in a folder or exactly the named file; several sizes into one file
    are refused before any generation."""
    from specserve.cli import main

    target = _write_target(tmp_path / "target", with_tokenizer=True)
    base = ["token-map", "--target", target, "--num-prompts", "6", "--max-new-tokens", "8"]
    folder = tmp_path / "maps"
    assert main(base + ["--out", str(folder), "--sizes", "16", "64"]) == 0
    small, large = (json.load(open(folder / f"token_map_{n}.json")) for n in (16, 64))
    assert (small["size"], large["size"]) == (16, 64)
    assert large["token_ids"][:16] == small["token_ids"]  # one ranking, cut at each size
    assert len(set(large["token_ids"])) == 64 and large["source"]["answers"] == 6
    one = tmp_path / "one" / "map.json"
    assert main(base + ["--out", str(one), "--sizes", "32"]) == 0
    assert json.load(open(one))["token_ids"] == large["token_ids"][:32]
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "x.json"), "--sizes", "16", "32"]) == 2
    assert "--sizes takes one value" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "x.gen").exists()


def test_eagle3_capture_layers_fit_any_depth():
    assert eagle3_capture_layers({}, 32) == [2, 16, 29]
    for n in range(1, 12):
        layers = eagle3_capture_layers({}, n)
        assert len(layers) == 3 and layers == sorted(layers) and 0 <= layers[0] <= layers[-1] < n
    raw = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert eagle3_capture_layers(raw, 32) == [2, 16, 29]
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        eagle3_capture_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 40]}}, 32)


@pytest.mark.parametrize("num_layers", [4, 8])
def test_eagle3_training_raises_accept_length(tmp_path, num_layers):
    """An EAGLE3 head (three target layers; on a 4-layer target one layer twice) over a reduced
    draft vocabulary: the loss falls, the saved draft is a published-layout EAGLE3 checkpoint,
    and the engine's accept length rises while its output stays the target's own."""
    from safetensors.torch import load_file

    target_path = _write_target(tmp_path / "target", num_layers=num_layers)
    data_dir = str(tmp_path / "data")
    _tiny_dataset(target_path, data_dir, eagle3=True)
    target = load_target(target_path, "float32", "cpu").model
    untrained = str(tmp_path / "untrained")
    head = make_head(target, seed=0, kind="eagle3")
    save_draft(untrained, head, capture_layers=eagle3_capture_layers({}, num_layers))
    out = str(tmp_path / "draft")
    args = TrainArgs(head="eagle3", draft_vocab=96, **SHORT_TRAIN)
    summary = train(target, data_dir, out, args, log=quiet)
    hist = json.load(open(os.path.join(out, "train_curve.json")))["history"]
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"], (hist[0], hist[-1])
    assert summary["final"]["val_acc_0"] > 0.25, summary["final"]

    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    layers = eagle3_capture_layers(cfg, num_layers)
    assert layers == eagle3_capture_layers({}, num_layers)
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert saved["lm_head.weight"].shape == (96, 64) and saved["fc.weight"].shape == (64, 192)
    d2t = saved["d2t"]
    ids = torch.arange(96) + d2t
    assert (ids[1:] > ids[:-1]).all() and int(ids.max()) < VOCAB  # sorted target ids
    assert not any("embed" in k for k in saved)

    prompts = mixed_prompts(8, VOCAB, seed=99, max_len=12)
    with Engine(model_path=target_path, skip_tokenizer_init=True, dtype="float32") as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    before, _ = _run_draft(target_path, untrained, prompts, "EAGLE3")
    after, outs = _run_draft(target_path, out, prompts, "EAGLE3")
    tree, tree_outs = _run_draft(target_path, out, prompts, "EAGLE3", topk=2)
    assert outs == plain and tree_outs == plain  # lossless
    assert after > before + 0.25 and tree >= after - 0.05, (before, after, tree)
    print(f"EAGLE3 accept length untrained {before:.3f}, trained {after:.3f}, tree {tree:.3f}")


def test_linear_soft_ce_in_bfloat16_stays_close():
    """With a bfloat16 weight (the trainer under autocast) the loss and both gradients stay
    within 2% of float32 autograd, with a large vocabulary and 1/rows row weights (where a
    low-precision product of 1/vocab and 1/rows would lose them)."""
    from specserve.train.soft_ce import linear_soft_ce, soft_ce_reference

    seed = int(time.time()) % 10000
    g = torch.Generator().manual_seed(seed)
    rows, hidden, vocab = 300, 32, 6000
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(vocab, hidden, generator=g)).requires_grad_(True)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(rows)])
    probs = torch.rand(rows, 4, generator=g)
    probs = probs / probs.sum(-1, keepdim=True)
    row_w = torch.full((rows,), 1.0 / rows)
    loss, _ = linear_soft_ce(x, w.to(torch.bfloat16), ids, probs, row_w, chunk=64)
    loss.backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref, _ = soft_ce_reference(x2, w2, ids, probs, row_w)
    ref.backward()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert abs(loss.item() - ref.item()) < 0.02 * abs(ref.item()), seed
    assert rel(x.grad, x2.grad) < 0.02 and rel(w.grad, w2.grad) < 0.02, seed
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_eagle3_resume_keeps_vocabulary_and_rejects_other_heads(tmp_path):
    """Resuming an EAGLE3 run keeps the checkpoint's draft vocabulary; resuming it as another
    head or vocabulary size fails with a message naming the setting; an EAGLE dataset is
    given EAGLE3 features when an EAGLE3 head asks for them."""
    target_path = _write_target(tmp_path / "target", num_layers=4)
    data_dir = str(tmp_path / "data")
    common = dict(
        target=target_path,
        out_dir=data_dir,
        max_new_tokens=16,
        gen_dtype="float32",
        feature_dtype="float32",
        batch_size=32,
    )
    prompts = mixed_prompts(48, VOCAB, seed=12, max_len=8)
    assert build_dataset(DataArgs(**common), prompt_ids=prompts)["capture_layers"] == []
    manifest = build_dataset(DataArgs(**common, eagle3=True), prompt_ids=prompts)
    assert manifest["capture_layers"] == [1, 2, 2]
    target = load_target(target_path, "float32", "cpu").model
    out, work = str(tmp_path / "draft"), str(tmp_path / "work")
    args = TrainArgs(head="eagle3", draft_vocab=40, epochs=1, batch_size=16, ttt_steps=1)
    train(target, data_dir, out, args, work_dir=work, log=quiet)
    d2t = torch.load(os.path.join(work, "checkpoint.pt"), weights_only=False)["head"]["d2t"]
    more = TrainArgs(**{**args.__dict__, "epochs": 2})
    train(target, data_dir, out, more, resume=True, work_dir=work, log=quiet)
    state = torch.load(os.path.join(work, "checkpoint.pt"), weights_only=False)
    assert torch.equal(state["head"]["d2t"], d2t) and state["epoch"] == 1
    for change in ({"draft_vocab": 50}, {"head": "eagle"}):
        bad = TrainArgs(**{**more.__dict__, **change, "epochs": 3})
        key = next(iter(change))
        with pytest.raises(ValueError, match=key):
            train(target, data_dir, out, bad, resume=True, work_dir=work, log=quiet)


@pytest.mark.parametrize("train_weight", [False, True])
def test_linear_soft_ce_matches_autograd_reference(train_weight):
    """The chunked cross-entropy (gradients formed in its forward) equals plain autograd: loss,
    top-1 hits, and the gradients of the input and, when it trains, of the weight."""
    from specserve.train.soft_ce import linear_soft_ce, soft_ce_reference

    seed = int(time.time()) % 10000  # fresh inputs each run; the seed is in the failure
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    rows, hidden, vocab, k = 37, 16, 50, 4
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=train_weight)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(rows)])
    ids[:5, 0] = (x[:5].detach() @ w.detach().t()).argmax(-1)  # some certain hits
    probs = torch.rand(rows, k, generator=g)
    probs = probs / probs.sum(-1, keepdim=True)
    row_w = torch.rand(rows, generator=g)
    row_w[3] = 0.0
    loss, hits = linear_soft_ce(x, w, ids, probs, row_w, chunk=8)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref_loss, ref_hits = soft_ce_reference(x2, w2, ids, probs, row_w)
    (3.0 * loss).backward()
    (3.0 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-4)
    assert torch.equal(hits, ref_hits) and hits[:5].all()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    if train_weight:
        torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-4)
    else:
        assert w.grad is None


@pytest.mark.parametrize(
    "factors, attention", [(None, 1.0), ((1.0, 2.0, 8.0, 8.0), 1.0), ((1.0, 1.5, 4.0, 4.0), 1.14)]
)
def test_draft_config_keeps_the_targets_rope_scaling(factors, attention):
    """A head trained with its target's rotary scaling (llama3 parameters, or explicit
    frequency factors: GGUF's, or linear / YaRN's with YaRN's attention factor) is served with
    the same scaling: config.json round-trips it."""
    from specserve.model.config import ModelConfig, RopeScaling
    from specserve.speculative.eagle_checkpoint import hf_style_config

    scaling = RopeScaling(
        factor=32.0,
        original_max_position_embeddings=4096,
        freq_factors=factors,
        attention_factor=attention,
    )
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_scaling=scaling,
    )
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(hf_style_config(cfg, "X"))))
    assert back.rope_scaling == scaling and back.rope_theta == cfg.rope_theta


def test_draft_algorithm_is_read_from_the_checkpoint(tmp_path):
    """bench acceptance / e2e and the bundled-draft wiring pick EAGLE or EAGLE3 from the draft
    itself: EAGLE-1 heads published under a plain Llama architecture, EAGLE3 heads, whole
    models (STANDALONE)."""
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import (
        draft_algorithm,
        write_random_eagle_checkpoint,
    )

    e1 = write_random_eagle_checkpoint(str(tmp_path / "e1"), PRESETS["tiny"], "EAGLE")
    cfg_path = os.path.join(e1, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["LlamaForCausalLM"]  # as many published EAGLE-1 heads say
    json.dump(cfg, open(cfg_path, "w"))
    e3 = write_random_eagle_checkpoint(
        str(tmp_path / "e3"), PRESETS["tiny"], "EAGLE3", draft_vocab_size=40
    )
    model = _write_target(tmp_path / "model")
    assert draft_algorithm(e1) == "EAGLE"
    from safetensors.torch import load_file

    bin_dir = tmp_path / "e1bin"  # the older published layout: pytorch_model.bin
    bin_dir.mkdir()
    torch.save(load_file(os.path.join(e1, "model.safetensors")), bin_dir / "pytorch_model.bin")
    json.dump(cfg, open(bin_dir / "config.json", "w"))
    assert draft_algorithm(str(bin_dir)) == "EAGLE"
    assert draft_algorithm(e3) == "EAGLE3"
    assert draft_algorithm(model) == "STANDALONE"
    assert draft_algorithm(str(tmp_path / "model.gguf")) == "STANDALONE"


def test_two_layer_head_trains_saves_and_drafts_losslessly(tiny_data, tmp_path):
    """--draft-layers 2: the head trains (loss falls), is saved with two decoder layers, and
    the engine drafts with it without changing the output; resuming as another depth fails."""
    root, _, target_path = tiny_data
    target = load_target(target_path, "float32", "cpu").model
    out, work = str(tmp_path / "draft2"), str(tmp_path / "work2")
    args = TrainArgs(**{**SHORT_TRAIN, "epochs": 3, "draft_layers": 2})
    train(target, str(root / "data"), out, args, work_dir=work, log=quiet)
    hist = json.load(open(os.path.join(out, "train_curve.json")))["history"]
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"], (hist[0], hist[-1])
    assert json.load(open(os.path.join(out, "config.json")))["num_hidden_layers"] == 2
    loaded, _ = load_eagle_head(out, "EAGLE", target)
    assert len(loaded.layers) == 2
    prompts = mixed_prompts(4, VOCAB, seed=98, max_len=12)
    accept, outs = _run_draft(target_path, out, prompts, topk=2)
    with Engine(model_path=target_path, skip_tokenizer_init=True, dtype="float32") as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert outs == plain and accept >= 1.0
    bad = TrainArgs(**{**args.__dict__, "draft_layers": 1, "epochs": 4})
    with pytest.raises(ValueError, match="draft_layers"):
        train(target, str(root / "data"), out, bad, resume=True, work_dir=work, log=quiet)
    with pytest.raises(ValueError, match="draft_layers"):
        make_head(target, seed=0, kind="eagle3", num_layers=2)


BAD_TRAIN_FLAGS = [
    (["--head", "eagle3", "--draft-layers", "2"], "--draft-layers"),
    (["--draft-layers", "0"], "--draft-layers"),
    (["--gen-batch-size", "0"], "--gen-batch-size"),
    (["--num-prompts", "-3"], "--num-prompts"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--val-fraction", "-0.5"], "--val-fraction"),
    (["--val-fraction", "1"], "--val-fraction"),
    (["--epochs", "0"], "--epochs"),
    (["--log-every", "0"], "--log-every"),
    (["--seed", "-1"], "--seed"),
    (["--ttt-steps", "-1"], "--ttt-steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--gen-dtype", "fp8"], "--gen-dtype"),
    (["--autocast", "fp32"], "--autocast"),
    (["--generator", "engine:x"], "--generator"),
    (["--sampled-passes", "1", "--temperature", "0"], "--temperature"),
    (["--token-map-size", "-1"], "--token-map-size"),
    (["--curve-file", "/nonexistent-folder/c.json"], "--curve-file"),
    (["--generator", "dense", "--engine-arg", "page_size=4"], "--engine-arg"),
    (["--head", "eagle3", "--token-map-size", "512"], "--token-map-size"),
    (["--draft-vocab", "512"], "--draft-vocab"),  # (an EAGLE head: it did nothing)
    (["--head", "eagle3", "--draft-vocab", "-1"], "--draft-vocab"),
]


@pytest.mark.parametrize("flags,named", BAD_TRAIN_FLAGS, ids=[n for _, n in BAD_TRAIN_FLAGS])
def test_train_eagle_refuses_a_bad_flag_naming_it_before_generating(tmp_path, capsys, flags, named):
    from specserve import cli

    assert cli.main(["train-eagle", "--out", str(tmp_path / "d"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}:") and "Traceback" not in err, err
    assert not (tmp_path / "d.work").exists()  # nothing generated


def test_token_map_refuses_a_bad_flag_naming_it_before_generating(tmp_path, capsys):
    from specserve import cli

    (tmp_path / "file").write_text("")
    for flags, named in (
        (["--num-prompts", "0"], "--num-prompts"),
        (["--gen-batch-size", "0"], "--gen-batch-size"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--sizes", "0"], "--sizes"),
    ):
        assert cli.main(["token-map", "--out", str(tmp_path / "m"), *flags]) == 2
        assert capsys.readouterr().err.startswith(f"error: {named}:")
    one_file = ["token-map", "--out", str(tmp_path / "m.json"), "--sizes", "8", "16"]
    assert cli.main(one_file) == 2  # (one file holds one map)
    assert capsys.readouterr().err.startswith("error: --sizes:")
    assert cli.main(["token-map", "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.startswith("error: --out:")
    assert not (tmp_path / "m").exists()


def test_a_work_folder_with_other_data_is_refused_naming_the_flag(tmp_path, capsys):
    """A rerun into the same work folder with another target or prompt count would train on
    the earlier run's data: refused before anything runs (a --data-dir is used as it is)."""
    from specserve import cli
    from specserve.train.data import DataArgs, defining_args, refuse_other_data

    data = tmp_path / "d.work" / "data"
    data.mkdir(parents=True)
    made = DataArgs(target=str(tmp_path / "t"), out_dir=str(data), num_prompts=16)
    (data / "answers.json").write_text(json.dumps({"args": defining_args(made)}))
    refuse_other_data(made)  # the same values: reused
    argv = ["train-eagle", "--out", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    assert cli.main([*argv, "--num-prompts", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --num-prompts:") and "16" in err and "64" in err, err
    assert cli.main([*argv[:3], "--target", "other", "--num-prompts", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --target:")


def test_a_work_folder_in_use_by_another_run_is_refused(tmp_path, capsys):
    """Two runs on one work folder would delete and overwrite each other's data."""
    import fcntl

    from specserve import cli

    work = tmp_path / "d.work"
    work.mkdir()
    target = _write_target(tmp_path / "t", with_tokenizer=True)
    argv = ["train-eagle", "--out", str(tmp_path / "d"), "--target", target]
    capsys.readouterr()  # (what writing the target printed)
    with open(work / "lock", "w") as held:  # (another run holds it)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cli.main(argv) == 2
        assert capsys.readouterr().err.startswith(f"error: --work-dir: {work} is in use")
