"""Log-probabilities against Hugging Face transformers on the same weights (float32), and n
samples per prompt.

The reference is log_softmax of transformers' logits over prompt + output: token i's value is
row i - 1's. Speculative steps must report the target's own values (read at the accepted
path's nodes), so they equal plain decoding's and the reference's, for chains and trees, a
standalone draft (the target itself: every draft accepted, so stops land inside accepted
runs) and a random EAGLE head, overlap on and off, and chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from specserve import Engine, InvalidArgument
from specserve.model.hf_loader import load_hf_config
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import padded_graphs, spec_args, wait_for_idle_captures
from tests.model_factory import hf_logits, load_hf_model, random_prompt, write_hf_model

VOCAB = 256
TOL = 1e-4
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [random_prompt(n, VOCAB, seed=n) for n in (3, 11, 21)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = write_hf_model(tmp_path_factory.mktemp("lp") / "m", vocab_size=VOCAB, seed=21)
    return folder, load_hf_model(folder)


@pytest.fixture(scope="module")
def eagle(target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lp_eagle") / "e")
    return write_random_eagle_checkpoint(path, load_hf_config(target[0]), "EAGLE", seed=3)


def engine(folder: str, **kw) -> Engine:
    base = dict(model_path=folder, dtype="float32", device="cpu", max_total_tokens=1024)
    return Engine(**{**base, **kw})


def standalone(folder: str, topk: int, steps: int, ndt: int, **kw) -> dict:
    """The target as its own draft."""
    return {**spec_args(folder, topk, steps, ndt, **kw), "speculative_algorithm": "STANDALONE"}


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the distribution of token i + 1."""
    return torch.log_softmax(hf_logits(hf, ids), dim=-1)


def check(out: dict, hf, prompt: list[int], start: int = -1, k: int = 0) -> None:
    """The output's log-probs (and top-k) equal the reference's."""
    meta, ids = out["meta_info"], out["output_ids"]
    ref = reference(hf, prompt + ids)
    p = len(prompt)
    got = meta["output_token_logprobs"]
    assert [t for _, t, _ in got] == ids
    want = [ref[p - 1 + j, t].item() for j, t in enumerate(ids)]
    torch.testing.assert_close(
        torch.tensor([v for v, _, _ in got]), torch.tensor(want), atol=TOL, rtol=0
    )
    inputs = meta["input_token_logprobs"]
    if start < 0:
        assert inputs == []
    else:
        assert [t for _, t, _ in inputs] == prompt[start:]
        assert inputs[0][0] is None  # nothing of the asked range precedes it (as SGLang)
        want_in = [ref[i - 1, prompt[i]].item() for i in range(start + 1, p)]
        got_in = [v for v, _, _ in inputs[1:]]
        torch.testing.assert_close(torch.tensor(got_in), torch.tensor(want_in), atol=TOL, rtol=0)
    if k:
        rows = [p - 1 + j for j in range(len(ids))]
        tops = meta["output_top_logprobs"]
        if start >= 0:
            rows = list(range(start, p - 1)) + rows
            assert meta["input_top_logprobs"][0] is None
            tops = meta["input_top_logprobs"][1:] + tops
        assert len(tops) == len(rows)
        for row, top in zip(rows, tops):
            values, top_ids = ref[row].topk(k)
            assert [t for _, t, _ in top] == top_ids.tolist()
            torch.testing.assert_close(
                torch.tensor([v for v, _, _ in top]), values, atol=TOL, rtol=0
            )
        for (v, t, _), top in zip(got, meta["output_top_logprobs"]):
            if t == top[0][1]:  # a greedy token reports exactly its top-1 value
                assert v == top[0][0]


def generate(e: Engine, sp=GREEDY, start: int = -1, k: int = 0, prompts=PROMPTS) -> list[dict]:
    return e.generate(
        input_ids=prompts,
        sampling_params=sp,
        return_logprob=True,
        top_logprobs_num=k,
        logprob_start_len=start,
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_matches_transformers(target, overlap):
    folder, hf = target
    with engine(folder, disable_overlap_schedule=not overlap) as e:
        outs = generate(e, start=0, k=3)
        only_out = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True)
    for prompt, out in zip(PROMPTS, outs):
        check(out, hf, prompt, start=0, k=3)
    check(only_out, hf, PROMPTS[0])
    assert "output_top_logprobs" not in only_out["meta_info"]


SPEC = [  # (draft, topk, steps, num_draft_tokens, page size, overlap)
    ("target", 1, 3, 4, 1, True),  # a chain
    ("target", 4, 3, 10, 3, False),  # a tree
    ("eagle", 4, 3, 8, 16, True),
    ("eagle", 1, 4, 5, 1, False),
]


@pytest.mark.parametrize("draft, topk, steps, ndt, page_size, overlap", SPEC)
def test_speculative_decoding_reports_the_targets_logprobs(
    target, eagle, draft, topk, steps, ndt, page_size, overlap
):
    folder, hf = target
    path = folder if draft == "target" else eagle
    args = spec_args(path, topk, steps, ndt, page_size=page_size)
    args["speculative_algorithm"] = "STANDALONE" if draft == "target" else "EAGLE"
    with engine(folder, **args, disable_overlap_schedule=not overlap) as e:
        outs = generate(e, start=1, k=2)
        assert e.stats()["spec_verify_ct"] > 0
    for prompt, out in zip(PROMPTS, outs):
        check(out, hf, prompt, start=1, k=2)


def test_same_values_with_and_without_speculation_when_sampling(target):
    folder, _ = target
    sp = {"temperature": 1.0, "top_k": 20, "max_new_tokens": 10, "ignore_eos": True, "seed": 7}
    with engine(folder) as e:
        plain = generate(e, sp, k=1)
    with engine(folder, **standalone(folder, 2, 3, 6)) as e:
        spec = generate(e, sp, k=1)
    for a, b in zip(plain, spec):
        assert a["output_ids"] == b["output_ids"]
        va = [v for v, _, _ in a["meta_info"]["output_token_logprobs"]]
        vb = [v for v, _, _ in b["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(va), torch.tensor(vb), atol=TOL, rtol=0)


def test_a_stop_inside_an_accepted_run_keeps_only_kept_tokens(target):
    folder, hf = target
    with engine(folder) as e:
        ref = e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    stop = ref[6]
    args = standalone(folder, 1, 5, 6)
    with engine(folder, **args) as e:  # the target drafts itself: every step accepts 6
        out = e.generate(
            input_ids=PROMPTS[1],
            sampling_params={**GREEDY, "stop_token_ids": [stop]},
            return_logprob=True,
        )
    assert out["output_ids"] == ref[: ref.index(stop) + 1]
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    check(out, hf, PROMPTS[1])


def test_chunked_prefill_keeps_prompt_logprobs_across_chunks(target):
    folder, hf = target
    prompt = random_prompt(30, VOCAB, seed=5)
    with engine(folder, chunked_prefill_size=8, page_size=4) as e:
        sp = {**GREEDY, "max_new_tokens": 4}
        outs = generate(e, sp, start=[3, 0], k=2, prompts=[prompt, PROMPTS[0]])
    check(outs[0], hf, prompt, start=3, k=2)
    check(outs[1], hf, PROMPTS[0], start=0, k=2)


def test_prompt_scoring_without_output_tokens(target):
    folder, hf = target
    with engine(folder) as e:
        out = e.generate(
            input_ids=PROMPTS[2],
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
        skipped = e.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    check(out, hf, PROMPTS[2], start=0, k=1)
    assert "input_token_logprobs" not in skipped["meta_info"]


def test_stream_delivers_each_logprob_once(target):
    folder, hf = target
    with engine(folder) as e:
        parts = list(
            e.generate(
                input_ids=PROMPTS[1],
                sampling_params=GREEDY,
                stream=True,
                return_logprob=True,
                logprob_start_len=2,
            )
        )
    ids = [t for p in parts for t in p["output_ids"]]
    out = {
        "output_ids": ids,
        "meta_info": {
            k: [x for p in parts for x in p["meta_info"][k]]
            for k in ("output_token_logprobs", "input_token_logprobs")
        },
    }
    check(out, hf, PROMPTS[1], start=2)
    assert all(p["index"] == 0 for p in parts)


def test_logprob_options_are_validated(target):
    folder, _ = target
    with engine(folder) as e:
        bad = [
            dict(return_logprob=True, logprob_start_len=len(PROMPTS[0])),
            dict(return_logprob=True, logprob_start_len=-2),
            dict(return_logprob=True, top_logprobs_num=21),
            dict(return_logprob="yes"),
        ]
        for kw in bad:
            with pytest.raises(InvalidArgument) as exc:
                e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **kw)
            assert exc.value.field in kw
        for n in (0, 65, 2.0, True):
            with pytest.raises(InvalidArgument) as exc:
                e.generate(input_ids=PROMPTS[0], sampling_params={"n": n})
            assert exc.value.field == "n"


# ---- n samples ---------------------------------------------------------------------------------
def test_n_samples_are_seed_plus_i(target):
    folder, _ = target
    sp = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}
    with engine(folder) as e:
        outs = e.generate(input_ids=PROMPTS[1], sampling_params={**sp, "n": 3})
        alone = [
            e.generate(input_ids=PROMPTS[1], sampling_params={**sp, "seed": 11 + i})["output_ids"]
            for i in range(3)
        ]
        batch = e.generate(input_ids=PROMPTS[:2], sampling_params={**sp, "n": 2})
        streamed = list(
            e.generate(input_ids=PROMPTS[1], sampling_params={**sp, "n": 3}, stream=True)
        )
        unseeded = e.generate(input_ids=PROMPTS[1], sampling_params={**sp, "seed": None, "n": 2})
    assert [o["output_ids"] for o in outs] == alone
    assert len({tuple(a) for a in alone}) == 3
    assert len(batch) == 4  # prompt-major, as SGLang
    assert [o["output_ids"] for o in batch[2:]] == alone[:2]
    by_index = {
        i: [t for p in streamed if p["index"] == i for t in p["output_ids"]] for i in range(3)
    }
    assert [by_index[i] for i in range(3)] == alone
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_n_requests_name_sample_zero_for_their_prefill(target):
    folder, _ = target
    with engine(folder) as e:
        seen = []
        real_add = e.core.add_request

        def add(req):
            seen.append(req)
            real_add(req)

        e.core.add_request = add
        e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "n": 3}, rid="group")
    assert [r.rid for r in seen] == ["group-0", "group-1", "group-2"]
    assert seen[0].prefill_after is None
    assert all(r.prefill_after is seen[0] for r in seen[1:])


# ---- the CUDA-graph shape -------------------------------------------------------------------------
def test_padded_graph_steps_give_the_same_logprobs(target):
    """Batches padded to graph buckets (run eagerly on CPU), keyed by the log-prob mode: a
    batch that asks with top-k, one without top-k and one without log-probs use three shapes
    and report what eager steps report."""
    folder, hf = target
    args = standalone(folder, 2, 3, 6)
    with engine(folder, **args) as e:
        graphs = padded_graphs(e)
        padded = generate(e, start=0, k=3)
        no_top = generate(e, k=0)
        plain = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        wait_for_idle_captures(graphs)  # (short-lived shapes run eagerly, captured when idle)
        keys = sorted(graphs.graphs)
    assert {k[4:6] for k in keys} == {(True, 4), (True, 0), (False, 0)}  # (log-probs, top-k)
    for prompt, out, out0, p in zip(PROMPTS, padded, no_top, plain):
        check(out, hf, prompt, start=0, k=3)
        check(out0, hf, prompt)
        assert p["output_ids"] == out["output_ids"]


def test_retraction_keeps_the_logprobs_already_reported(target):
    """A retracted request re-prefills its prompt and outputs: prompt values are not repeated,
    and the token sampled when it resumes gets its value from that prefill's last logits."""
    folder, hf = target
    prompts = [random_prompt(6, VOCAB, seed=40 + i) for i in range(8)]
    sp = {**GREEDY, "max_new_tokens": 16}
    with engine(folder, page_size=4, max_total_tokens=96) as e:
        outs = generate(e, sp, start=0, k=1, prompts=prompts)
        assert e.stats()["num_retractions"] > 0
    for prompt, out in zip(prompts, outs):
        check(out, hf, prompt, start=0, k=1)
