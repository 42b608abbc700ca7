"""A reduced draft vocabulary (`speculative_token_map`): drafting stays inside it, outputs stay
the target's, bad files and combinations are refused naming the field."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from specserve import Engine, InvalidArgument
from specserve.model.config import PRESETS
from specserve.speculative.draft_vocab import DraftVocab
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from specserve.speculative.token_map import load_token_map, rank_tokens, save_token_map
from tests.engine_utils import TINY, mixed_prompts, recorded_drafts

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
VOCAB = PRESETS["tiny"].vocab_size


@pytest.fixture(scope="module")
def eagle_draft(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("draft") / "eagle"), PRESETS["tiny"], "EAGLE", seed=3
    )


def _map_file(folder, ids, name="map.json") -> str:
    path = str(folder / name)
    save_token_map(path, [int(i) for i in ids])
    return path


def _spec(draft, token_map, topk=4, steps=3, ndt=10, page_size=1):
    return dict(
        **TINY,
        page_size=page_size,
        debug_check_invariants=True,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        speculative_token_map=token_map,
    )


def _assert_drafts_inside(drafted, allowed):
    assert drafted, "the drafter never ran"
    tokens = torch.cat([t.reshape(-1) for t in drafted])
    assert torch.isin(tokens, allowed).all(), "a drafted token lies outside the vocabulary"
    assert torch.unique(tokens).numel() > 4  # the drafter ranks many of them, not a constant


@pytest.mark.parametrize("page_size", [1, 16])
def test_drafts_stay_inside_the_map_and_outputs_equal_plain(eagle_draft, tmp_path, page_size):
    prompts = mixed_prompts(4, VOCAB, seed=11, min_len=2, max_len=24)
    with Engine(**TINY, page_size=page_size) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    hot = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(page_size))[:40]
    with recorded_drafts() as drafted:
        with Engine(**_spec(eagle_draft, _map_file(tmp_path, hot), page_size=page_size)) as e:
            outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    _assert_drafts_inside(drafted, hot)


def test_eagle3_drafts_are_target_ids_of_its_d2t(tmp_path):
    """EAGLE3's reduced vocabulary takes the same id-map path: drafted tokens are
    draft id + d2t[draft id], read here from the checkpoint file itself."""
    from safetensors.torch import load_file

    folder = write_random_eagle_checkpoint(
        str(tmp_path / "e3"), PRESETS["tiny"], "EAGLE3", draft_vocab_size=60, seed=4
    )
    d2t = load_file(str(tmp_path / "e3" / "model.safetensors"))["d2t"].long()
    allowed = torch.arange(len(d2t)) + d2t
    assert not torch.equal(allowed, torch.arange(len(d2t)))  # a real remapping
    prompts = mixed_prompts(3, VOCAB, seed=5, min_len=2, max_len=20)
    with recorded_drafts() as drafted:
        kw = {**_spec(folder, None), "speculative_algorithm": "EAGLE3"}
        with Engine(**kw) as e:
            e.generate(input_ids=prompts, sampling_params=GREEDY)
    _assert_drafts_inside(drafted, allowed)


def test_restricted_head_ranks_the_map_columns_of_the_full_logits(eagle_draft):
    with Engine(**_spec(eagle_draft, None)) as e:
        head = e.core.worker.drafter.head
    g = torch.randn(5, head.config.hidden_size)
    full = head.logits(g).float()
    hot = torch.tensor([7, 300, 2, 511, 64, 130, 9, 45])
    head.restrict_vocab(hot)
    logp, ids = head.topk(g, 3)
    ref_logp, ref_cols = torch.log_softmax(full[:, hot], -1).topk(3, dim=-1)
    assert torch.equal(ids, hot[ref_cols])
    torch.testing.assert_close(logp, ref_logp)


def test_growing_vocabulary_holds_request_tokens_while_their_requests_run():
    lm_head = torch.randn(50, 8)
    vocab = DraftVocab(lm_head, torch.tensor([3, 9, 4]), growth=4)
    g = torch.randn(2, 8)

    def logits():
        return torch.nn.functional.linear(g, vocab.weight, vocab.bias)

    # map tokens and repeats take no column; a token two requests bring takes one
    assert vocab.add({"a": [9, 7, 7, 12, 3], "b": [12]}) == 2
    assert vocab.ids[:5].tolist() == [3, 9, 4, 7, 12] and vocab.size == 5
    torch.testing.assert_close(logits()[:, :5], g @ lm_head[[3, 9, 4, 7, 12]].T)
    assert torch.isneginf(logits()[:, 5:]).all()  # free room never ranks
    assert vocab.add({"c": [20, 21, 22]}) == 2 and 22 not in vocab  # full: the rest waits
    vocab.release(["a"])  # 7 leaves; 12 stays, b still holds it
    assert 7 not in vocab and 12 in vocab and vocab.size == 6
    assert torch.isneginf(logits()[:, 3]).all()  # 7's column is free again
    assert vocab.add({"c": [22]}) == 1 and vocab.ids[3] == 22  # and taken by the next token
    torch.testing.assert_close(logits()[:, 3], g @ lm_head[22])
    vocab.release(["b", "c", "never-seen"])
    assert vocab.size == 3 and torch.isneginf(logits()[:, 3:]).all()
    assert DraftVocab(lm_head, torch.tensor([3]), growth=0).add({"a": [5]}) == 0  # fixed map


@pytest.mark.parametrize("page_size", [1, 16])
def test_growing_map_drafts_the_requests_tokens_and_outputs_equal_plain(
    eagle_draft, tmp_path, page_size
):
    prompts = mixed_prompts(4, VOCAB, seed=13, min_len=6, max_len=24)
    with Engine(**TINY, page_size=page_size) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    seen = {t for ids in prompts + plain for t in ids}
    hot = torch.tensor([t for t in range(VOCAB) if t not in seen][:40])
    kw = dict(_spec(eagle_draft, _map_file(tmp_path, hot), page_size=page_size),
              speculative_token_map_growth=len(seen))  # fmt: skip
    with recorded_drafts() as drafted, Engine(**kw) as e:
        vocab = e.core.worker.drafter.head.vocab
        buffers = [t.data_ptr() for t in (vocab.weight, vocab.ids, vocab.bias)]
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        assert vocab.size == vocab.base  # every request finished: their columns are free
        # written in place, never reallocated: what captured CUDA graphs read
        assert [t.data_ptr() for t in (vocab.weight, vocab.ids, vocab.bias)] == buffers
    assert [o["output_ids"] for o in outs] == plain
    tokens = torch.cat([t.reshape(-1) for t in drafted])
    assert not torch.isin(tokens, hot).all()  # tokens of the requests were drafted
    _assert_drafts_inside(drafted, torch.cat([hot, torch.tensor(sorted(seen))]))


def test_growing_map_serves_an_engine_built_inside_inference_mode(eagle_draft, tmp_path):
    """Built under torch.inference_mode(), the vocabulary's buffers are inference tensors;
    the loop thread (outside that mode) must still grow and shrink them in place."""
    prompts = mixed_prompts(3, VOCAB, seed=17, min_len=4, max_len=12)
    with Engine(**TINY) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    kw = dict(_spec(eagle_draft, _map_file(tmp_path, range(3, 43))),
              speculative_token_map_growth=64)  # fmt: skip
    with torch.inference_mode():
        e = Engine(**kw)
    with e:
        vocab = e.core.worker.drafter.head.vocab
        assert vocab.bias.is_inference()
        outs = []
        t = threading.Thread(
            target=lambda: outs.extend(e.generate(input_ids=prompts, sampling_params=GREEDY))
        )
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "generate hung"
        assert vocab.size == vocab.base
    assert [o["output_ids"] for o in outs] == plain


def test_token_map_growth_is_refused_without_a_map_or_out_of_range(eagle_draft, tmp_path):
    path = _map_file(tmp_path, range(32))
    with pytest.raises(InvalidArgument, match="speculative_token_map_growth.*give speculative"):
        Engine(**_spec(eagle_draft, None), speculative_token_map_growth=8)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgument, match=r"speculative_token_map_growth.*\[0, "):
            Engine(**_spec(eagle_draft, path), speculative_token_map_growth=bad)
    # more room than the tokens the map lacks
    with pytest.raises(InvalidArgument, match=rf"growth.*\[0, {VOCAB - 32}\]"):
        Engine(**_spec(eagle_draft, path), speculative_token_map_growth=VOCAB - 31)


def test_rank_tokens_orders_by_answer_frequency_then_prompts_then_id():
    answers = [[5, 5, 5, 2], [2, 9, 5]]
    ids, coverage = rank_tokens(answers, vocab_size=12, size=4, prompts=[[7, 7, 3]])
    assert ids == [5, 2, 9, 7]  # 5 (4x), 2 (2x), 9 (1x), then 7: twice in the prompts
    assert coverage == 1.0
    ids, coverage = rank_tokens(answers, vocab_size=12, size=1)
    assert ids == [5] and coverage == pytest.approx(4 / 7)


def test_token_map_file_formats(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([4, 1, 3]))
    assert load_token_map(str(tmp_path / "list.json"), VOCAB).tolist() == [4, 1, 3]
    torch.save(torch.tensor([8, 6]), tmp_path / "map.pt")
    assert load_token_map(str(tmp_path / "map.pt"), VOCAB).tolist() == [8, 6]
    path = _map_file(tmp_path, [3, 2, 1])
    assert json.load(open(path))["size"] == 3
    assert load_token_map(path, VOCAB).tolist() == [3, 2, 1]


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2, 2]", "distinct"),
        (f"[1, {VOCAB}]", "in [0, 512)"),
        ("[-1, 3]", "in [0, 512)"),
        ("[]", "non-empty"),
        ('{"ids": [1, 2]}', "token-id list"),
        ("not json", "token-id list"),
        ("[1, 2]", "needs at least 4"),
        ("[1.5, 2, 3, 4]", "integers"),
        ("[true, false, 3, 4]", "integers"),
    ],
)
def test_bad_token_map_files_are_refused(eagle_draft, tmp_path, content, message):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(InvalidArgument, match="speculative_token_map") as info:
        Engine(**_spec(eagle_draft, str(tmp_path / "bad.json"), topk=4))
    assert message in str(info.value)


def test_bad_torch_token_map_files_are_refused(eagle_draft, tmp_path):
    (tmp_path / "map.bin").write_text("[1, 2, 3, 4]")  # not a torch file
    torch.save(torch.tensor([1.5, 2.0, 3.0, 4.0]), tmp_path / "float.pt")
    for name, message in (("map.bin", "token-id list"), ("float.pt", "integers")):
        with pytest.raises(InvalidArgument, match="speculative_token_map") as info:
            Engine(**_spec(eagle_draft, str(tmp_path / name)))
        assert message in str(info.value)


def test_token_map_is_refused_where_it_cannot_apply(eagle_draft, tmp_path):
    path = _map_file(tmp_path, range(32))
    with pytest.raises(InvalidArgument, match="speculative_token_map.*speculative_algorithm"):
        Engine(**TINY, speculative_token_map=path)
    with pytest.raises(InvalidArgument, match="speculative_token_map.*EAGLE3"):
        Engine(**{**_spec(eagle_draft, path), "speculative_algorithm": "EAGLE3"})
    with pytest.raises(InvalidArgument, match="speculative_token_map.*not a file"):
        Engine(**_spec(eagle_draft, str(tmp_path / "missing.json")))
