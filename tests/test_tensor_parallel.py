"""Tensor parallelism on the CPU (gloo, float32): tp_size 2 decodes exactly what tp_size 1
decodes, plain and speculative, and a broken rank fails requests instead of hanging.

The quick tests run both ranks of a sharded model as threads of this process (two gloo
groups); the engine tests start real rank processes and are marked slow."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch

from specserve import Engine
from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.kv.pool import KVCache
from specserve.model.hf_loader import load_hf_config
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner
from specserve.model.sharding import local_kv_heads
from specserve.ops.attention import TorchAttentionBackend
from specserve.ops.attention_metadata import Segment, build_metadata
from specserve.ops.collectives import TensorParallel, connect_rendezvous, serve_rendezvous
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import mixed_prompts, spec_args, write_dummy_config
from tests.model_factory import write_gguf_model, write_hf_model

CPU = dict(skip_tokenizer_init=True, dtype="float32", device="cpu")
GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_k": 50, "max_new_tokens": 20, "ignore_eos": True, "seed": 7}
# odd vocabularies: the last rank's vocabulary shard is padded
MODELS = {
    # 4 query heads over 2 KV heads: one KV head per rank
    "llama": dict(arch="llama", vocab_size=509, num_heads=4, num_kv_heads=2),
    # 1 KV head for 2 ranks: replicated; q/k/v bias; tied embeddings
    "qwen2": dict(arch="qwen2", vocab_size=257, num_kv_heads=1, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: write_hf_model(root / name, seed=3, **kw) for name, kw in MODELS.items()}


@pytest.fixture(scope="module")
def eagle(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-eagle")
    return {
        name: write_random_eagle_checkpoint(str(root / name), load_hf_config(folder), seed=5)
        for name, folder in models.items()
    }


# ---- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_tp_size_must_be_a_positive_integer(bad):
    with pytest.raises(InvalidArgument) as e:
        EngineConfig(tp_size=bad, device="cpu").resolve(cuda_available=False)
    assert e.value.field == "tp_size"


def test_tp_size_must_divide_the_heads_before_any_rank_starts(models):
    started = time.perf_counter()
    with pytest.raises(InvalidArgument) as e:
        Engine(model_path=models["llama"], tp_size=3, **CPU)
    assert e.value.field == "tp_size"
    assert "4 attention heads" in str(e.value) and "allowed: 1, 2, 4" in str(e.value)
    assert time.perf_counter() - started < 5  # refused from the config, no process spawned


def test_a_context_past_the_models_positions_is_refused_before_any_rank_starts(models, monkeypatch):
    from specserve.runtime import tensor_parallel

    def spawn(*args):
        raise AssertionError("a rank was started for a configuration refused from the model")

    monkeypatch.setattr(tensor_parallel.Peers, "spawn", spawn)
    with pytest.raises(InvalidArgument) as e:
        Engine(model_path=models["llama"], tp_size=2, context_length=1 << 20, **CPU)
    assert e.value.field == "context_length" and "max_position_embeddings" in str(e.value)


@pytest.mark.parametrize(
    "config", ["{not json", '{"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}']
)
def test_an_unreadable_model_is_refused_as_with_tp_size_1(tmp_path, config):
    # the shape check before any rank starts reads the config: its failure is the same
    # InvalidArgument naming model_path that loading the model raises with tp_size 1
    (tmp_path / "config.json").write_text(config)
    errors = []
    for tp_size in (1, 2):
        with pytest.raises(InvalidArgument) as e:
            Engine(model_path=str(tmp_path), tp_size=tp_size, **CPU)
        errors.append((e.value.field, str(e.value)))
    assert errors[0][0] == "model_path" and errors[1] == errors[0]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_a_missing_draft_is_refused_before_any_rank_starts(
    models, tmp_path, monkeypatch, algorithm
):
    # refused as with tp_size 1, from the draft's config, not once every rank has loaded its shard
    missing = str(tmp_path / "no-such-draft")
    _refused_alike(models, monkeypatch, algorithm, missing, "no-such-draft")


def test_a_draft_of_another_shape_is_refused_before_any_rank_starts(models, tmp_path, monkeypatch):
    target = load_hf_config(models["llama"])
    wide = replace(target, hidden_size=2 * target.hidden_size)
    eagle = write_random_eagle_checkpoint(str(tmp_path / "wide"), wide, "EAGLE", seed=5)
    _refused_alike(models, monkeypatch, "EAGLE", eagle, "hidden_size")
    # a whole model of another vocabulary as the draft
    _refused_alike(models, monkeypatch, "STANDALONE", models["qwen2"], "vocabulary")


def _refused_alike(models, monkeypatch, algorithm, path, said):
    from specserve.runtime import tensor_parallel

    draft = dict(speculative_algorithm=algorithm, speculative_draft_model_path=path)
    with pytest.raises(InvalidArgument) as alone:
        Engine(model_path=models["llama"], tp_size=1, **draft, **CPU)

    def spawn(*args):
        raise AssertionError("a rank was started for a draft that cannot be read")

    monkeypatch.setattr(tensor_parallel.Peers, "spawn", spawn)
    with pytest.raises(InvalidArgument) as split:
        Engine(model_path=models["llama"], tp_size=2, **draft, **CPU)
    assert split.value.field == alone.value.field == "speculative_draft_model_path"
    assert str(split.value) == str(alone.value) and said in str(split.value)


def test_tp_size_is_a_resolved_decision():
    cfg = EngineConfig(tp_size=2, device="cpu").resolve(cuda_available=False)
    assert any(f == "tp_size" and "gloo" in why for f, _, why in cfg.decisions)


# ---- the sharded model, ranks as threads -------------------------------------------------------------
def _prefill_logits(model, tokens: list[int], kv_heads: int) -> torch.Tensor:
    n = len(tokens)
    cfg = model.config
    cache = KVCache(cfg.num_layers, n, kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.arange(n)
    meta = build_metadata([Segment(slots, n, n)], slots, torch.device("cpu"))
    out = ModelRunner(model, cache, TorchAttentionBackend()).forward(
        torch.tensor(tokens), torch.arange(n), meta
    )
    with torch.inference_mode():
        return model.compute_logits(out.hidden)


def _sharded_logits(
    path: str, tokens: list[int], tp_size: int = 2, load_format: str = "auto"
) -> list[torch.Tensor]:
    """Each rank's logits of a prefill of `tokens`, the ranks run as threads."""
    timeout = datetime.timedelta(seconds=60)
    store = serve_rendezvous(tp_size, timeout)
    results: dict[int, torch.Tensor | BaseException] = {}

    def rank(r: int) -> None:
        try:
            s = store if r == 0 else connect_rendezvous(store.port, tp_size, timeout)
            tp = TensorParallel.join(r, tp_size, torch.device("cpu"), timeout, s)
            model = load_model(path, load_format, torch.float32, torch.device("cpu"), True, tp=tp)
            model = model.model
            results[r] = _prefill_logits(model, tokens, local_kv_heads(model.config, tp_size))
        except BaseException as e:  # re-raised by the test's thread
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in range(tp_size):
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return [results[r] for r in range(tp_size)]


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_logits_equal_the_whole_model_and_every_rank_gets_the_same(models, name):
    path = models[name]
    tokens = mixed_prompts(1, MODELS[name]["vocab_size"], seed=1, min_len=12, max_len=12)[0]
    whole = load_model(path, "auto", torch.float32, torch.device("cpu"), True).model
    want = _prefill_logits(whole, tokens, whole.config.num_kv_heads)
    ranks = _sharded_logits(path, tokens)
    assert ranks[0].shape == want.shape  # the vocabulary padding is cut
    assert torch.equal(ranks[0], ranks[1])  # identical bits: ranks decide tokens alike
    torch.testing.assert_close(ranks[0], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("head_dim", [16, 8])
def test_gguf_shards_equal_slices_of_the_dequantized_tensors(tmp_path, qtype, head_dim):
    # head_dim 8: a rank's o_proj columns (16) cut a Q8_0 block (32): dequantized whole, cut
    folder = write_hf_model(tmp_path / "hf", seed=3, head_dim=head_dim, **MODELS["llama"])
    path, _ = write_gguf_model(tmp_path / "m.gguf", folder, qtype=qtype)
    tokens = mixed_prompts(1, MODELS["llama"]["vocab_size"], seed=2, min_len=10, max_len=10)[0]
    whole = load_model(path, "auto", torch.float32, torch.device("cpu"), True).model
    want = _prefill_logits(whole, tokens, whole.config.num_kv_heads)
    torch.testing.assert_close(_sharded_logits(path, tokens)[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_qkv_biases_shard_by_value(tmp_path, qtype):
    # Qwen2's q/k/v biases are 1-D: a rank's slice counts values, not a row's bytes
    folder = write_hf_model(tmp_path / "hf", seed=3, arch="qwen2", vocab_size=257, num_kv_heads=2)
    path, _ = write_gguf_model(tmp_path / "m.gguf", folder, qtype=qtype)
    tokens = mixed_prompts(1, 257, seed=2, min_len=10, max_len=10)[0]
    whole = load_model(path, "auto", torch.float32, torch.device("cpu"), True).model
    want = _prefill_logits(whole, tokens, whole.config.num_kv_heads)
    torch.testing.assert_close(_sharded_logits(path, tokens)[0], want, atol=1e-5, rtol=1e-5)


DUMMY = {
    "llama": dict(vocab_size=61),
    "qwen2-tied": dict(
        vocab_size=61,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", list(DUMMY))
def test_dummy_weights_are_slices_of_the_unsharded_models(tmp_path, name):
    # random weights (load_format dummy, presets): a rank holds its slices of the weights
    # tp_size 1 draws from the same seed, not a random shard of its own
    path = write_dummy_config(str(tmp_path), **DUMMY[name])
    tokens = mixed_prompts(1, 61, seed=2, min_len=10, max_len=10)[0]
    whole = load_model(path, "dummy", torch.float32, torch.device("cpu"), True).model
    want = _prefill_logits(whole, tokens, whole.config.num_kv_heads)
    got = _sharded_logits(path, tokens, load_format="dummy")[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- the engine, ranks as processes ------------------------------------------------------------------
def _generate(
    args: dict, prompts, params, waves: int = 1, setup=None, **options
) -> tuple[list, dict]:
    """Outputs (ids and output log-probs) of `waves` rounds of the prompts (a later round
    finds the earlier in the prefix cache), and the engine's stats; setup(engine) first."""
    checks = []

    def check_replicas(core) -> None:
        if core.tp is not None:
            core.worker.check_replicas(core.table.owners())
            checks.append(1)

    outputs = []
    with Engine(**args, debug_check_invariants=True) as e:
        e.step_hooks.append(check_replicas)
        if setup is not None:
            setup(e)
        for _ in range(waves):
            outs = e.generate(input_ids=prompts, sampling_params=params, **options)
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
            outputs += [
                (o["output_ids"], o["meta_info"].get("output_token_logprobs")) for o in outs
            ]
        stats = e.stats()
        procs = e.core.peers.procs if e.core.peers is not None else []
    assert not any(p.is_alive() for p in procs)  # shutdown joined every rank
    if args.get("tp_size", 1) > 1:
        assert checks, "every rank's state was compared with rank 0's after each step"
    return outputs, stats


CASES = {
    "plain-overlap-logprobs": dict(
        model="llama", page_size=1, overlap=True, spec=None, logprobs=True
    ),
    "plain-no-overlap-tied": dict(model="qwen2", page_size=3, overlap=False, spec=None),
    # a small KV budget (retraction) and a second round from the prefix cache
    "eagle-chain-retraction-cache": dict(
        model="llama", page_size=4, overlap=True, spec=(1, 3, 4), kv=96, waves=2
    ),
    "eagle-tree-tied": dict(model="qwen2", page_size=2, overlap=False, spec=(4, 3, 10)),
    "standalone-tree": dict(model="llama", page_size=1, overlap=True, spec=(2, 2, 5)),
    # every adaptive tier (ragged ones too), drafts skipped, caught up and left behind
    "eagle-adaptive": dict(model="llama", page_size=2, overlap=True, spec=(4, 3, 10), adaptive=1),
}

# tiers of the adaptive case: plain, chains of 1, 2, 3, the tree verifying 2 / 5 of 10 nodes,
# the tree
ADAPTIVE_SCRIPT = [0, 0, 4, 0, 6, 5, 0, 1, 0, 0, 0, 0, 0, 4, 5, 6, 2, 3, 1]


def _script_tiers(engine) -> None:
    steps = iter(range(10**6))
    engine.core.adaptive.pick = lambda b, can=True, ready=None: ADAPTIVE_SCRIPT[
        next(steps) % len(ADAPTIVE_SCRIPT)
    ]
    # ring full while speculation does not pay: those requests stop speculating
    engine.core.adaptive.speculation_pays = lambda b: False


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_decodes_exactly_what_tp1_decodes(models, eagle, case):
    c = CASES[case]
    args = dict(
        CPU,
        model_path=models[c["model"]],
        page_size=c["page_size"],
        disable_overlap_schedule=not c["overlap"],
        max_total_tokens=c.get("kv", 2048),
    )
    if c["spec"] is not None:
        standalone = case.startswith("standalone")
        args.update(spec_args(models[c["model"]] if standalone else eagle[c["model"]], *c["spec"]))
        if standalone:
            args["speculative_algorithm"] = "STANDALONE"
    setup = None
    if c.get("adaptive"):
        args.update(speculative_adaptive=True, speculative_adaptive_lag_tokens=3)
        setup = _script_tiers
    vocab = MODELS[c["model"]]["vocab_size"]
    prompts = mixed_prompts(6, vocab, seed=11, max_len=24)
    params = [GREEDY] * 5 + [SAMPLED]  # sampled: every rank must draw the same token
    options = {}
    if c.get("logprobs"):  # prompt log-probs: logits of every prompt position, gathered
        options = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    waves = c.get("waves", 1)
    want, _ = _generate(args, prompts, params, waves, setup, **options)
    got, stats = _generate(dict(args, tp_size=2), prompts, params, waves, setup, **options)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    if c.get("logprobs"):
        for (_, a), (_, b) in zip(got, want):
            assert [x[1] for x in a] == [x[1] for x in b]  # the same tokens
            torch.testing.assert_close(
                torch.tensor([x[0] for x in a]), torch.tensor([x[0] for x in b]), atol=1e-4, rtol=0
            )
    if "kv" in c:
        assert stats["num_retractions"] > 0, "the KV budget was meant to force retraction"
    if c["spec"] is not None:
        assert stats["spec_verify_ct"] > 0
    if c.get("adaptive"):
        adaptive = stats["speculative_adaptive"]
        assert all(adaptive["steps"]) and adaptive["catch_ups"] > 0, adaptive
        assert adaptive["stopped_speculating"] > 0, adaptive


@pytest.mark.slow
def test_penalties_are_refused_with_tp_size_2_naming_the_field(models):
    # (the other ranks know a request's output as of its prefill: their draws would differ)
    with Engine(model_path=models["llama"], tp_size=2, **CPU) as e:
        for field, value in (("logit_bias", {"3": 1.0}), ("repetition_penalty", 1.2)):
            with pytest.raises(InvalidArgument) as err:
                e.generate(input_ids=[5, 6], sampling_params=dict(GREEDY, **{field: value}))
            assert err.value.field == field
        assert len(e.generate(input_ids=[5, 6], sampling_params=GREEDY)["output_ids"]) == 20


@pytest.mark.slow
def test_a_killed_rank_fails_requests_with_its_reason(models):
    with Engine(model_path=models["llama"], tp_size=2, **CPU) as e:
        prompt = [5, 6, 7, 8]
        assert len(e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]) == 20
        os.kill(e.core.peers.procs[0].pid, signal.SIGKILL)
        started = time.perf_counter()
        out = e.generate(input_ids=prompt, sampling_params=GREEDY)
        assert time.perf_counter() - started < 30
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "rank 1 was killed by SIGKILL" in out["meta_info"]["finish_reason"]["message"]
        assert "rank 1" in e.failure
        again = e.generate(input_ids=prompt, sampling_params=GREEDY)  # fails at once, too
        assert "rank 1" in again["meta_info"]["finish_reason"]["message"]


@pytest.mark.slow
def test_ranks_run_as_many_cpu_threads_as_rank_0_whose_process_set_its_own(models, eagle):
    # a CPU matmul's bits depend on how many threads share it: ranks spawned with the default
    # would draft apart from a rank 0 whose process (a notebook, a test worker) set another
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        args = dict(CPU, model_path=models["llama"], tp_size=2)
        args.update(spec_args(eagle["llama"], 4, 3, 10))
        _generate(args, mixed_prompts(3, MODELS["llama"]["vocab_size"], seed=4), GREEDY)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_tensor_parallel_run_exits_without_leaked_object_reports(models, tmp_path):
    """Each rank froze its start-up heap for the collector and never unfroze it: its objects
    were never freed, and every rank ended by printing dozens of Triton 'leaked' lines."""
    import subprocess
    import sys

    script = (
        "from specserve import Engine\n"
        f"with Engine(model_path={models['llama']!r}, tp_size=2, **{CPU!r}) as e:\n"
        "    print(e.generate(input_ids=[[5, 6, 7]], sampling_params={'max_new_tokens': 3}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
