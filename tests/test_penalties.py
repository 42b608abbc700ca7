"""Logit bias and repetition / frequency / presence penalties: what they do to a draw (against
transformers and a token-by-token reference), and that speculative decoding with them draws
exactly what plain decoding with them draws, whatever the tree, tier, page size or schedule."""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specserve import Engine
from specserve.errors import InvalidArgument
from specserve.ops import penalties
from specserve.ops.penalties import Penalties, penalize_reference, penalize_rows
from specserve.runtime.cuda_graphs import DecodeGraphs
from specserve.sampling_params import SamplingParams
from tests.engine_utils import TINY, mixed_prompts, spec_args
from tests.model_factory import hf_logits, load_hf_model, random_prompt, write_hf_model

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def random_penalties(b: int, v: int, g: torch.Generator, neutral_rows=()) -> Penalties:
    counts = torch.randint(0, 3, (b, v), generator=g).float() * (
        torch.rand(b, v, generator=g) < 0.1
    )
    bias = torch.randn(b, v, generator=g) * (torch.rand(b, v, generator=g) < 0.05)
    pen = Penalties(
        counts=counts,
        in_prompt=torch.rand(b, v, generator=g) < 0.1,
        bias=bias,
        frequency=torch.rand(b, generator=g) * 4 - 2,
        presence=torch.rand(b, generator=g) * 4 - 2,
        repetition=torch.rand(b, generator=g) * 1.9 + 0.1,
    )
    for i in neutral_rows:
        pen.bias[i], pen.frequency[i], pen.presence[i], pen.repetition[i] = 0, 0, 0, 1
    return pen


def as_lists(pen: Penalties, i: int):
    """Request i of `pen` as the reference takes it: prompt, output, bias."""
    prompt = pen.in_prompt[i].nonzero().flatten().tolist()
    output = [t for t, c in enumerate(pen.counts[i].long().tolist()) for _ in range(c)]
    bias = {t: pen.bias[i, t].item() for t in pen.bias[i].nonzero().flatten().tolist()}
    return prompt, output, bias


@pytest.mark.parametrize("seed", range(4))
def test_each_row_is_penalized_as_the_reference_penalizes_its_draw(seed):
    g = torch.Generator().manual_seed(seed)
    b, v, rows, depth = 3, 50, 20, 5
    pen = random_penalties(b, v, g)
    request = torch.randint(0, b, (rows,), generator=g)
    # tree paths: some rows none, some with repeated tokens and tokens of the output
    path = torch.randint(0, 12, (rows, depth), generator=g)
    path[torch.rand(rows, depth, generator=g) < 0.4] = -1
    path[0] = -1
    logits = torch.randn(rows, v, generator=g) * 3
    out = penalize_rows(logits, pen, request, path)
    for r in range(rows):
        prompt, output, bias = as_lists(pen, int(request[r]))
        output += [t for t in path[r].tolist() if t >= 0]
        i = int(request[r])
        want = penalize_reference(
            logits[r], prompt, output, bias,
            pen.frequency[i].item(), pen.presence[i].item(), pen.repetition[i].item(),
        )  # fmt: skip
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)


def test_neutral_rows_are_left_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    pen = random_penalties(2, 40, g, neutral_rows=[1])
    logits = torch.randn(4, 40, generator=g)
    path = torch.tensor([[3, 3, -1], [-1, -1, -1], [5, 7, 9], [1, -1, 2]])
    out = penalize_rows(logits, pen, torch.tensor([0, 1, 1, 0]), path)
    assert torch.equal(out[1:3], logits[1:3])
    assert not torch.equal(out[0], logits[0])


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors created under it that were alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self.held.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (an output sharing an input's storage, a view or an in-place result, is no new one)
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key not in self.held and key not in given and size:
                    self.held.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, size)
        return out


def test_a_large_batch_of_nodes_is_penalized_in_blocks_of_rows(monkeypatch):
    """Beyond its output, penalizing a [rows, V] batch holds a block of rows' temporaries,
    not several [rows, V] tensors (a large tree batch at a large vocabulary would not fit),
    and draws the same values."""
    g = torch.Generator().manual_seed(0)
    b, n, v = 8, 16, 4096
    pen = random_penalties(b, v, g)
    request = torch.arange(b).repeat_interleave(n)
    path = torch.randint(0, 40, (b * n, 5), generator=g)
    path[torch.rand(b * n, 5, generator=g) < 0.3] = -1
    logits = torch.randn(b * n, v, generator=g)
    monkeypatch.setattr(penalties, "PENALTY_BLOCK", b * n * v)  # one block: all rows at once
    whole = penalize_rows(logits, pen, request, path)
    monkeypatch.setattr(penalties, "PENALTY_BLOCK", 16 * v)
    with LiveBytes() as mem:
        out = penalize_rows(logits, pen, request, path)
    assert torch.equal(out, whole)
    assert mem.peak < 2 * logits.numel() * 4, mem.peak / (logits.numel() * 4)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("hf"), vocab_size=96, seed=3)


def reference_greedy(model, prompt, n, bias=None, frequency=0.0, presence=0.0, repetition=1.0):
    """Greedy decoding with transformers' logits, penalized token by token."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(model, prompt + out)[-1]
        x = penalize_reference(logits, prompt, out, bias or {}, frequency, presence, repetition)
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize(
    "params",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.4, "presence_penalty": -0.5},
        {"logit_bias": {"7": 4.0, "11": -3.0}, "frequency_penalty": 0.7},
    ],
)
def test_greedy_output_is_the_penalized_references(hf_folder, params):
    model = load_hf_model(hf_folder)
    prompts = [random_prompt(n, 96, seed=n) for n in (3, 9)]
    kw = dict(model_path=hf_folder, dtype="float32", device="cpu", skip_tokenizer_init=True)
    with Engine(**kw) as e:
        outs = e.generate(input_ids=prompts, sampling_params=dict(GREEDY, **params))
        unpenalized = e.generate(input_ids=prompts, sampling_params=GREEDY)
    bias = {int(t): b for t, b in params.get("logit_bias", {}).items()}
    for prompt, out in zip(prompts, outs):
        want = reference_greedy(
            model, prompt, GREEDY["max_new_tokens"], bias,
            params.get("frequency_penalty", 0.0), params.get("presence_penalty", 0.0),
            params.get("repetition_penalty", 1.0),
        )  # fmt: skip
        assert out["output_ids"] == want
    # (and they do change something: the same prompts decode otherwise without them)
    assert [o["output_ids"] for o in outs] != [o["output_ids"] for o in unpenalized]


def test_repetition_penalty_is_transformers_own(hf_folder):
    model = load_hf_model(hf_folder)
    prompt = random_prompt(6, 96, seed=1)
    gen = model.generation_config
    gen.eos_token_id = None
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, repetition_penalty=1.5,
            pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt):].tolist()  # fmt: skip
    kw = dict(model_path=hf_folder, dtype="float32", device="cpu", skip_tokenizer_init=True)
    with Engine(**kw) as e:
        ours = e.generate(
            input_ids=prompt,
            sampling_params=dict(GREEDY, max_new_tokens=12, repetition_penalty=1.5),
        )
    assert ours["output_ids"] == hf


def mixed_params(n: int, seed: int, sampled: bool = False) -> list[dict]:
    """Every other request penalized, biased and held to a minimum length, the rest not;
    every one stops at a few common tokens; sampled: seeded draws."""
    rng = random.Random(seed)
    stops = [rng.randrange(3, 500) for _ in range(40)]  # (a tenth of the tiny vocabulary)
    out = []
    for i in range(n):
        p = dict(GREEDY, max_new_tokens=20, stop_token_ids=stops)
        if sampled:
            p.update(temperature=0.9, top_p=0.95, seed=seed * 10 + i)
        if i % 2 == 0:
            p.update(
                frequency_penalty=rng.uniform(-1, 2),
                presence_penalty=rng.uniform(-1, 2),
                repetition_penalty=rng.uniform(0.5, 2),
                logit_bias={str(rng.randrange(3, 500)): rng.uniform(-5, 5) for _ in range(3)},
                min_new_tokens=rng.randrange(0, 16),
            )
        out.append(p)
    return out


def decode(prompts, params, padded=False, random_tiers=None, **kw):
    with Engine(**TINY, debug_check_invariants=True, **kw) as e:
        if padded:  # the CUDA-graph shape (padded batch, static inputs), eagerly on CPU
            e.core.worker.graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        if random_tiers is not None:  # every tier, ragged ones too, in a random order
            rng = random.Random(random_tiers)
            count = len(e.core.adaptive.tiers)
            e.core.adaptive.pick = lambda b, can=True, ready=None: rng.randrange(count)
        outs = e.generate(input_ids=prompts, sampling_params=params)
        return [o["output_ids"] for o in outs], e.stats()


SPECULATIVE = {
    "chain": spec_args("tiny", 1, 3, 4),
    "tree": spec_args("tiny", 3, 4, 10),
    "wide tree": spec_args("tiny", 4, 3, 12),
}


@pytest.mark.parametrize("name", sorted(SPECULATIVE))
@pytest.mark.parametrize(
    "page_size,overlap,padded", [(1, True, False), (4, False, True), (3, True, True)]
)
@pytest.mark.parametrize("sampled", [False, True])
def test_speculative_output_with_penalties_equals_plain(name, page_size, overlap, padded, sampled):
    prompts = mixed_prompts(6, 512, seed=page_size, min_len=2, max_len=16)
    params = mixed_params(6, page_size, sampled)
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap)
    plain, _ = decode(prompts, params, **kw)
    spec, stats = decode(prompts, params, padded=padded, **kw, **SPECULATIVE[name])
    assert spec == plain
    if not sampled:  # (the target is its own draft: its greedy drafts were accepted)
        assert stats["spec_accept_length"] > 1.5


@pytest.mark.parametrize("seed", [0, 1])
def test_every_adaptive_tier_with_penalties_equals_plain(seed):
    """Ragged tiers verify a subset of each tree's nodes (packed rows)."""
    prompts = mixed_prompts(5, 512, seed=seed, min_len=2, max_len=16)
    params = mixed_params(5, seed)
    plain, _ = decode(prompts, params)
    spec, _ = decode(
        prompts, params, random_tiers=seed, **spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    )
    assert spec == plain


@pytest.mark.parametrize("shape", [(1, 3, 4), (3, 4, 10)])
@pytest.mark.parametrize(
    "extra",
    [
        {"frequency_penalty": 2.0, "presence_penalty": 2.0},
        {"repetition_penalty": 0.3},  # (these two also need each node's own path)
        {"logit_bias": {str(t): 4.0 for t in range(3, 60)}},
        {"allowed_token_ids": list(range(100, 140))},
        {"min_new_tokens": 30, "stop_token_ids": list(range(3, 40)), "presence_penalty": -0.5},
    ],
)
def test_the_draft_proposes_from_penalized_logits_too(shape, extra):
    """The target as its own draft: penalized as the target's draws are (each node after
    its own path), every greedy draft is accepted; unpenalized, a bias alone took the
    accept length from 4 to 1.07."""
    prompts = mixed_prompts(8, 40, seed=5, min_len=3, max_len=6)
    params = dict(GREEDY, max_new_tokens=40, **extra)
    with Engine(**TINY, **spec_args("tiny", *shape)) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
    full = shape[1] + 1  # (a chain's depth + 1; the tree's 4 steps + 1)
    # every verify step accepts all; only the last may keep fewer (a stop, max_new_tokens)
    hists = [o["meta_info"]["spec_accept_histogram"] for o in outs]
    assert all(len(h) == full and sum(h[:-1]) <= 1 for h in hists), hists


def test_a_reduced_draft_vocabulary_with_penalties_decodes_as_plain(tmp_path):
    """The draft's columns are some target ids: its penalties are read through them, and
    path tokens outside them count for nothing in the draft."""
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from specserve.speculative.token_map import save_token_map

    vocab = PRESETS["tiny"].vocab_size
    draft = write_random_eagle_checkpoint(str(tmp_path / "d"), PRESETS["tiny"], "EAGLE", seed=3)
    hot = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:60].tolist()
    save_token_map(str(tmp_path / "map.json"), hot)
    prompts = mixed_prompts(5, vocab, seed=2, min_len=2, max_len=16)
    params = [dict(p, allowed_token_ids=hot[:30] + [3]) if i == 1 else p
              for i, p in enumerate(mixed_params(5, 2))]  # fmt: skip
    plain, _ = decode(prompts, params)
    spec, _ = decode(
        prompts, params, **spec_args(draft, 4, 3, 10),
        speculative_token_map=str(tmp_path / "map.json"),
    )  # fmt: skip
    assert spec == plain


def batch_of(vocab: int, *params: dict):
    """BatchPenalties of requests with these sampling parameters (a prompt of 1, 2, 3 and
    one output token, 5)."""
    from specserve.runtime.penalties import BatchPenalties
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    reqs = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(**p), seed=0, output_ids=[5])
        for i, p in enumerate(params)
    ]
    return BatchPenalties(reqs, vocab, {2}, torch.device("cpu"))


@pytest.mark.parametrize("growing", [False, True])
def test_no_draft_row_is_masked_to_nothing(growing):
    """A draft row whose masks would leave none of its columns keeps them: there, every token
    allowed_token_ids leaves in the draft's vocabulary is a stop token min_new_tokens holds
    back (its other tokens are outside it; a growing vocabulary's free columns are -inf). An
    all -inf row's candidates would get NaN log-probabilities (the trees' scores, which
    ragged budgets calibrate with)."""
    from specserve.ops.sampling import topk_logprobs
    from specserve.speculative.draft_vocab import DraftVocab

    v = 20
    vocab = DraftVocab(torch.randn(v, 4), torch.tensor([3, 4, 5, 6, 7]), 2 if growing else 0)
    pen = batch_of(
        v,
        dict(allowed_token_ids=[4, 15], min_new_tokens=5, stop_token_ids=[4]),
        dict(temperature=0.0),
    )
    logits = torch.randn(2, len(vocab.ids)) + (0 if vocab.bias is None else vocab.bias)
    out = pen.draft_draws(logits.clone(), torch.arange(2), 0, vocab.ids)
    logp, _ = topk_logprobs(out, 2, vocab.ids)
    assert torch.isfinite(logp).all(), logp
    assert torch.equal(out[1], logits[1])


def test_path_tokens_count_at_the_column_a_growing_vocabulary_holds_them_in():
    """A growing draft vocabulary's free columns carry ids too (at first token 0's, after a
    release the released token's): a node's path token is penalized at the live column of
    its token, not at a free column of the same id."""
    from specserve.speculative.draft_vocab import DraftVocab

    v = 20
    vocab = DraftVocab(torch.randn(v, 4), torch.tensor([0, 5, 7, 9]), growth=3)
    vocab.add({"a": [11], "b": [12]})
    vocab.release(["b"])
    vocab.release(["a"])
    vocab.add({"c": [12]})  # (now in another column than before)
    pen = batch_of(v, dict(frequency_penalty=100.0))
    logits = torch.zeros(2, len(vocab.ids)) + vocab.bias
    path = torch.tensor([[0], [12]])
    out = pen.draft_draws(logits.clone(), torch.zeros(2, dtype=torch.int64), 1, vocab.ids, path)
    want = logits.clone()
    want[:, 1] -= 100  # token 5, of the output
    want[0, 0] -= 100
    want[1, vocab._column[12]] -= 100
    assert torch.equal(out, want), out


def test_requests_without_penalties_decode_as_in_a_batch_without_any():
    prompts = mixed_prompts(6, 512, seed=4, min_len=2, max_len=16)
    params = mixed_params(6, 4)
    spec = spec_args("tiny", 3, 4, 10)
    mixed, _ = decode(prompts, params, **spec)
    alone, _ = decode(prompts[1::2], params[1::2], **spec)
    assert mixed[1::2] == alone


@pytest.mark.parametrize("spec", [{}, spec_args("tiny", 3, 4, 10)])
def test_penalized_batches_launch_ahead_and_take_the_graph_path(spec):
    """Penalties live by row on the device and each step keeps them up to date, so a batch
    of penalized requests is launched before the step in flight is applied, and runs the
    padded, static-input step a CUDA graph replays (here eagerly, on the CPU)."""
    prompts = mixed_prompts(4, 512, seed=21, min_len=2, max_len=16)
    params = [dict(p, max_new_tokens=24) for p in mixed_params(4, 21)[0::2] * 2]
    assert all(p.get("repetition_penalty") for p in params)
    plain, _ = decode(prompts, params, disable_overlap_schedule=True)
    with Engine(**TINY, debug_check_invariants=True, **spec) as e:
        graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        e.core.worker.graphs = graphs
        outs = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.stats()
    assert [o["output_ids"] for o in outs] == plain
    assert stats["num_decode_steps_launched_ahead"] > 0
    # (the sampling mode's last field in a graph's key: penalized)
    keys = set(graphs.graphs) | set(graphs._eager_steps)
    assert keys and all(key[7] for key in keys)


def test_a_row_a_penalized_request_held_is_neutral_for_the_next():
    """A request without penalties decodes in the row a biased one left, beside a penalized
    one (so its batch is penalized): it draws as it would alone."""
    biased = dict(GREEDY, logit_bias={"7": 100.0}, repetition_penalty=1.5)
    prompts = mixed_prompts(3, 512, seed=8, min_len=2, max_len=16)
    spec = spec_args("tiny", 3, 4, 10)
    with Engine(**TINY, **spec) as e:
        first = e.generate(input_ids=prompts[0], sampling_params=biased)
        assert set(first["output_ids"]) == {7}
        later = e.generate(
            input_ids=prompts[1:],
            sampling_params=[GREEDY, dict(GREEDY, frequency_penalty=1.0)],
        )
    alone, _ = decode(prompts[1:2], [GREEDY], **spec)
    assert later[0]["output_ids"] == alone[0]


def test_retracted_requests_keep_their_penalties():
    prompts = mixed_prompts(16, 512, seed=11, min_len=3, max_len=12)
    params = [dict(p, max_new_tokens=24) for p in mixed_params(16, 11)]
    plain, _ = decode(prompts, params)
    spec, stats = decode(
        prompts, params, page_size=4, max_total_tokens=200, **spec_args("tiny", 3, 4, 10)
    )
    assert stats["num_retractions"] > 0
    assert spec == plain


@pytest.mark.parametrize("spec", [{}, spec_args("tiny", 3, 4, 10)])
def test_allowed_token_ids_are_the_only_tokens_drawn(spec):
    prompts = mixed_prompts(4, 512, seed=6)
    with Engine(**TINY, **spec) as e:
        free = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        allowed = sorted({t for out in free for t in out[1::2]} | {3, 4})
        held = e.generate(
            input_ids=prompts, sampling_params=dict(GREEDY, allowed_token_ids=allowed)
        )
        sampled = e.generate(
            input_ids=prompts,
            sampling_params=dict(GREEDY, temperature=1.0, seed=3, allowed_token_ids=[3, 4, 5]),
        )
    for out in held:
        assert set(out["output_ids"]) <= set(allowed)
    assert [o["output_ids"] for o in held] != free
    for out in sampled:
        assert set(out["output_ids"]) <= {3, 4, 5}


def test_logit_bias_forces_and_bans_tokens():
    prompt = mixed_prompts(1, 512, seed=2)[0]
    with Engine(**TINY, **spec_args("tiny", 3, 4, 10)) as e:
        forced = e.generate(input_ids=prompt, sampling_params=dict(GREEDY, logit_bias={"42": 100}))
        free = e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        banned = e.generate(
            input_ids=prompt, sampling_params=dict(GREEDY, logit_bias={str(t): -100 for t in free})
        )
    assert forced["output_ids"] == [42] * GREEDY["max_new_tokens"]
    assert not set(banned["output_ids"]) & set(free)


@pytest.mark.parametrize(
    "params,field",
    [
        ({"logit_bias": {"512": 1.0}}, "logit_bias"),  # past the tiny model's vocabulary
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"3": "1"}}, "logit_bias"),
        ({"logit_bias": [3]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0, "05": -1.0}}, "logit_bias"),  # (one token twice)
        ({"logit_bias": {5: 1.0, "5": 2.0}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 512]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, True]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        # (too large for a float, too long for int())
        ({"frequency_penalty": 10**400}, "frequency_penalty"),
        ({"logit_bias": {"3": 10**400}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    ],
)
def test_bad_penalties_are_refused_naming_the_field(params, field):
    with Engine(**TINY) as e:
        with pytest.raises(InvalidArgument) as err:
            e.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, **params))
        assert err.value.field == field
        # (and the engine serves the next request as before)
        assert len(e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]) == 16


def test_min_new_tokens_holds_back_stop_tokens_and_stop_strings(hf_folder):
    from tests.model_factory import write_tokenizer

    write_tokenizer(hf_folder, 96)
    prompts = [random_prompt(n, 96, seed=n) for n in (3, 7, 11)]
    with Engine(model_path=hf_folder, dtype="float32", device="cpu") as e:
        for prompt in prompts:
            out = e.generate(input_ids=prompt, sampling_params=GREEDY)
            ids, text = out["output_ids"], out["text"]
            k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
            stop = {**GREEDY, "stop_token_ids": [ids[k]]}
            assert len(e.generate(input_ids=prompt, sampling_params=stop)["output_ids"]) == k + 1
            held = e.generate(input_ids=prompt, sampling_params={**stop, "min_new_tokens": k + 4})
            assert ids[k] not in held["output_ids"][: k + 4]
            assert len(held["output_ids"]) > k + 4
            # a stop string ending within the first tokens does not stop the request either
            assert text
            word = text[: max(1, len(text) // 8)]
            sp = {**GREEDY, "stop": [word]}
            assert e.generate(input_ids=prompt, sampling_params=sp)["text"] == ""
            later = e.generate(input_ids=prompt, sampling_params={**sp, "min_new_tokens": 12})
            assert len(later["output_ids"]) > 12 and later["text"].startswith(word)


def test_min_new_tokens_is_refused_beside_structured_output():
    # (a grammar complete before the minimum length could only continue with a stop token)
    with Engine(**TINY) as e:
        for grammar in ({"regex": "(yes|no)"}, {"json_schema": {"type": "integer"}}):
            with pytest.raises(InvalidArgument) as err:
                e.generate(
                    input_ids=[5, 6], sampling_params={**GREEDY, **grammar, "min_new_tokens": 4}
                )
            assert err.value.field == "min_new_tokens"


def test_min_new_tokens_must_fit_max_new_tokens():
    with Engine(**TINY) as e:
        with pytest.raises(InvalidArgument) as err:
            e.generate(input_ids=[5, 6], sampling_params=dict(GREEDY, min_new_tokens=17))
        assert err.value.field == "min_new_tokens"
        for bad in (-1, True, 2.0, "3"):
            with pytest.raises(InvalidArgument) as err:
                e.generate(input_ids=[5, 6], sampling_params=dict(GREEDY, min_new_tokens=bad))
            assert err.value.field == "min_new_tokens"


def test_penalty_slots_follow_the_penalized_requests_and_the_rows():
    """Only penalized requests take a slot (others point at the neutral one); more of them
    than slots doubles the tables, keeping what slots hold, and tells the request rows (their
    graphs read the old tables); more requests than rows doubles the rows' slot entries; a
    released row frees its slot, written afresh for its next request."""
    from types import SimpleNamespace

    from specserve.kv.request_rows import RequestRows
    from specserve.runtime.penalty_rows import FIRST_SLOTS, PenaltyRows

    rows = RequestRows(torch.device("cpu"), page_size=1, max_pages=4, rows=2)
    table = PenaltyRows(rows, 16, frozenset({2}), torch.device("cpu"))
    rows.attach(table)

    def penalized(i):
        params = SamplingParams.from_any({"logit_bias": {"4": 2.0}, "frequency_penalty": 1.0})
        return SimpleNamespace(params=params, output_ids=[4, 4, i], prompt_ids=[1], penalties=None)

    plain = SimpleNamespace(params=SamplingParams(), output_ids=[3], penalties=None)
    n = FIRST_SLOTS + 3
    rids = [f"r{i}" for i in range(n + 1)]
    for rid in rids:
        rows.on_pages_added(rid, 0, [1])
    assert table.slot_of.shape[0] == rows.num_rows >= n + 1
    reqs = [penalized(i) for i in range(n)] + [plain]
    version, attached = rows.version, rows.attached_version
    table.write(reqs, rows.rows_of(rids))
    # (the penalty tables grew: graphs that read them go stale, the rows' own did not move)
    assert rows.attached_version > attached and rows.version == version
    assert table.num_slots > FIRST_SLOTS + 1
    slots = table.slot_of[rows.rows_of(rids)].tolist()
    assert slots[-1] == 0 and 0 not in slots[:-1] and len(set(slots[:-1])) == n
    for i, slot in enumerate(slots[:-1]):
        want = [0.0] * 16
        want[4] += 2
        want[i] += 1
        assert table.counts[slot].tolist() == want
        assert table.has_bias[slot] and table.bias[slot, 4] == 2.0
    assert table.frequency[0] == 0 and table.repetition[0] == 1 and not table.has_bias[0]
    rows.on_release("r0")
    rows.on_pages_added("again", 0, [1])
    table.write([plain], rows.rows_of(["again"]))
    assert table.slot_of[rows.row("again")] == 0
    reqs[1].output_ids.append(5)  # (counted by its steps on the device, not written again)
    table.write([reqs[1]], rows.rows_of(["r1"]))
    assert table.counts[slots[1], 5] == 0


def test_a_penalized_graph_that_fails_to_capture_leaves_its_steps_eager():
    """Captures run on padding rows alone: where a penalized step's fails, that step and every
    penalized one after it run eagerly, with the same output."""
    prompts = mixed_prompts(4, 512, seed=21, min_len=2, max_len=16)
    params = [dict(p, max_new_tokens=24) for p in mixed_params(4, 21)]
    spec = spec_args("tiny", 3, 4, 10)
    want, _ = decode(prompts, params, **spec)
    with Engine(**TINY, **spec) as e:
        graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        e.core.worker.graphs = graphs
        run, failed = graphs.run, []

        def failing(rows, mode, *args):
            if mode.penalized:
                failed.append(len(rows))
                raise RuntimeError("simulated capture failure")
            return run(rows, mode, *args)

        graphs.run = failing
        outs = e.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    assert len(failed) == 1  # (then no penalized step asked for a graph again)


def test_a_penalized_step_that_fails_after_running_on_its_rows_is_not_run_again():
    """The eager fallback is for a failed capture (padding rows alone): a padded step that ran
    on the batch's rows and then failed has already counted what it emitted into them, so
    running the batch again would count it twice; it fails as any other step does (its
    requests fail), none of them goes on with penalties counted twice."""
    from specserve.kv.request_rows import PAD_ROW

    prompts = mixed_prompts(3, 512, seed=21, min_len=2, max_len=16)
    params = [dict(p, max_new_tokens=24, stop_token_ids=[]) for p in mixed_params(3, 21)]
    spec = spec_args("tiny", 3, 4, 10)
    want, _ = decode(prompts, params, **spec)
    with Engine(**TINY, **spec) as e:
        worker = e.core.worker
        worker.graphs = DecodeGraphs(worker, 4, max_width=4096, capture=False)
        drafter, failed = worker.step.drafter, []
        extend = drafter.extend_after_verify

        def failing(batch, *args):  # (a padded step's failure past its acceptance)
            if not failed and (batch.rows == PAD_ROW).any():
                failed.append(batch.rows.tolist())
                raise RuntimeError("simulated failure of a padded step")
            return extend(batch, *args)

        drafter.extend_after_verify = failing
        outs = e.generate(input_ids=prompts, sampling_params=params)
    assert failed and not worker._penalized_eager
    for out, ids in zip(outs, want):
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] == "abort":
            assert "simulated failure" in reason["message"]
        else:
            assert out["output_ids"] == ids
