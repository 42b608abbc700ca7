"""Speculative settings beyond the suite's usual shapes: SGLang's conventions for the tree
flags, drafts that do not fit their target refused at start-up, and draft vocabularies whose
columns could give two siblings one token."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import Engine, InvalidArgument
from specserve.config import EngineConfig
from specserve.model.config import PRESETS
from specserve.speculative.draft_vocab import DraftVocab
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from specserve.speculative.token_map import save_token_map
from tests.engine_utils import TINY, mixed_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
# the prefill's token and whole verify runs of 2, 3, 4 or 6 tokens (the acceptance statistics
# count what a request keeps, and max_new_tokens would cut its last run short)
WHOLE_RUNS = dict(GREEDY, max_new_tokens=13)


def resolved(**kw) -> EngineConfig:
    return EngineConfig(
        speculative_algorithm="EAGLE", speculative_draft_model_path="x", **kw
    ).resolve(cuda_available=False)


def tree_of(c: EngineConfig) -> tuple[int, int, int]:
    return c.speculative_num_steps, c.speculative_eagle_topk, c.speculative_num_draft_tokens


@pytest.mark.parametrize(
    "given", [dict(speculative_eagle_topk=4), dict(speculative_num_draft_tokens=8)]
)
def test_topk_or_tree_size_without_steps_is_refused_as_in_sglang(given):
    with pytest.raises(InvalidArgument) as info:
        resolved(**given)
    assert info.value.field == "speculative_num_steps"
    assert "[1, 16]" in str(info.value)


def test_steps_alone_or_nothing_fill_a_chain():
    assert tree_of(resolved()) == (3, 1, 4)
    assert tree_of(resolved(speculative_num_steps=5)) == (5, 1, 6)
    assert tree_of(resolved(speculative_num_steps=5, speculative_eagle_topk=4)) == (5, 4, 21)


@pytest.mark.parametrize("ndt", [-1, 1, 2, 3, 6, 64])
def test_a_chain_verifies_every_step_as_in_sglang(ndt):
    c = resolved(
        speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=ndt
    )
    assert tree_of(c) == (4, 1, 5)
    assert any(f == "speculative_num_draft_tokens" and v == 5 for f, v, _ in c.decisions)


def test_a_tree_larger_than_its_candidates_is_refused_with_the_allowed_range():
    with pytest.raises(InvalidArgument) as info:
        resolved(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=8)
    assert info.value.field == "speculative_num_draft_tokens" and "[2, 7]" in str(info.value)


def test_adjusted_chain_decodes_as_plain():
    prompts = mixed_prompts(3, 512, seed=2, max_len=12)
    sp = dict(GREEDY, max_new_tokens=1 + 3 * 4)  # the prefill's token + 3 verifies of 4
    with Engine(**TINY) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    spec = dict(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=2,
    )
    with Engine(**TINY, **spec) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == plain
    # the target is its own draft: every verify accepts the whole 3-token chain
    assert all(o["meta_info"]["spec_accept_histogram"] == [0, 0, 0, 3] for o in outs)


SELF_DRAFT_CHAIN = dict(  # the target is its own draft: every verify accepts all 4 tokens
    speculative_algorithm="STANDALONE",
    speculative_draft_model_path="tiny",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)


def test_acceptance_statistics_count_the_tokens_a_request_kept():
    """A request ending inside a verify step (max_new_tokens, a stop token) keeps part of its
    accepted run: its statistics and the engine's count what it kept, so
    1 + sum((i + 1) * histogram[i]) is its completion_tokens."""
    with Engine(**TINY) as e:  # a prompt whose output has a new token inside the 2nd verify
        for seed in range(100):
            prompt = mixed_prompts(1, 512, seed=seed, min_len=4, max_len=4)[0]
            sp = dict(GREEDY, max_new_tokens=12)
            ids = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
            stop = next((t for i, t in enumerate(ids) if 6 <= i < 8 and t not in ids[:i]), None)
            if stop is not None:
                break
    cut = {
        "max_new_tokens": dict(GREEDY, max_new_tokens=7),  # 1 + 4 + 2
        "stop_token_ids": dict(GREEDY, stop_token_ids=[stop]),
    }
    with Engine(**TINY, **SELF_DRAFT_CHAIN) as e:
        outs = {name: e.generate(input_ids=prompt, sampling_params=sp) for name, sp in cut.items()}
        stats = e.stats()
    for name, o in outs.items():
        meta, kept = o["meta_info"], len(o["output_ids"])
        assert o["output_ids"] == ids[:kept], name
        hist = meta["spec_accept_histogram"]
        assert 1 + sum((i + 1) * c for i, c in enumerate(hist)) == kept, (name, hist)
        assert hist[3] == 1 and sum(hist) == meta["spec_verify_ct"] == 2, (name, hist)
        assert meta["spec_accept_length"] == (kept - 1) / 2, name
    assert (
        stats["spec_accept_length"] == (7 - 1 + len(outs["stop_token_ids"]["output_ids"]) - 1) / 4
    )


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return write_random_eagle_checkpoint(str(root / "e"), PRESETS["tiny"], "EAGLE", seed=3)


def spec(draft: str, algo: str = "EAGLE", steps: int = 3, topk: int = 4, ndt: int = 12, **kw):
    return dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        **kw,
    )


@pytest.mark.parametrize("allowed", [[100], [100, 300]])
def test_growing_token_map_under_allowed_tokens_equals_plain(tmp_path, eagle, allowed):
    """allowed_token_ids leaves fewer finite draft columns than topk, so the draft's top-k
    takes free columns of a growing vocabulary too: their tokens must differ from the map's,
    or two siblings share a token and verification accepts both (a crash, or wrong text)."""
    save_token_map(str(tmp_path / "map.json"), list(range(100, 140)))
    prompts = mixed_prompts(3, 512, seed=1, min_len=2, max_len=10)
    sp = dict(GREEDY, allowed_token_ids=allowed)
    with Engine(**TINY) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    growing = dict(
        speculative_token_map=str(tmp_path / "map.json"), speculative_token_map_growth=50
    )
    with Engine(**TINY, **spec(eagle, **growing), debug_check_invariants=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == plain


def test_growing_vocabulary_columns_hold_distinct_tokens():
    rng = random.Random(0)
    v = 40
    vocab = DraftVocab(torch.randn(v, 4), torch.tensor([5, 0, 9, 3]), growth=6)
    live: dict[str, list[int]] = {}
    for i in range(300):
        if live and rng.random() < 0.4:
            owner = rng.choice(sorted(live))
            del live[owner]
            vocab.release([owner])
        else:
            owner = f"r{i}"
            live[owner] = [rng.randrange(v) for _ in range(rng.randint(1, 5))]
            vocab.add({owner: live[owner]})
        ids = vocab.ids.tolist()
        assert len(set(ids)) == len(ids), ids
        assert ids[:4] == [5, 0, 9, 3]
        for t, col in vocab._column.items():  # a live token's column names it
            assert ids[col] == t and vocab.bias[col] == 0


def _rewrite(folder: str, config: dict | None = None, tensors: dict | None = None) -> str:
    if config:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            raw = json.load(f)
        with open(path, "w") as f:
            json.dump({**raw, **config}, f)
    if tensors:
        path = os.path.join(folder, "model.safetensors")
        save_file({**load_file(path), **tensors}, path)
    return folder


def test_eagle3_draft_tokens_mapped_to_one_target_token_are_refused(tmp_path):
    draft = write_random_eagle_checkpoint(str(tmp_path / "e3"), PRESETS["tiny"], "EAGLE3", 10)
    d2t = load_file(os.path.join(draft, "model.safetensors"))["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft tokens 0 and 1 both name target token d2t[0]
    _rewrite(draft, tensors={"d2t": d2t})
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **spec(draft, "EAGLE3", topk=2, ndt=6))
    assert info.value.field == "speculative_draft_model_path" and "d2t" in str(info.value)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_a_draft_for_another_vocabulary_is_refused(tmp_path, algo):
    draft = write_random_eagle_checkpoint(
        str(tmp_path / "d"), PRESETS["tiny"].with_changes(vocab_size=300), algo
    )
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **spec(draft, algo, topk=2, ndt=6))
    assert info.value.field == "speculative_draft_model_path"
    assert "300" in str(info.value) and "512" in str(info.value)


def test_topk_above_the_draft_vocabulary_names_the_allowed_range(tmp_path):
    draft = write_random_eagle_checkpoint(str(tmp_path / "e3"), PRESETS["tiny"], "EAGLE3", 10)
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **spec(draft, "EAGLE3", steps=2, topk=12, ndt=20))
    assert info.value.field == "speculative_eagle_topk" and "[1, 10]" in str(info.value)


@pytest.mark.parametrize(
    "config, tensors, words",
    [
        ({"num_hidden_layers": 2}, None, "num_hidden_layers"),  # the head holds one layer
        (None, "float d2t", "integer"),  # offsets cut to integers would name other tokens
        (None, "short t2d", "t2d"),  # a target-to-draft map of another vocabulary
    ],
)
def test_a_malformed_eagle3_draft_is_refused(tmp_path, config, tensors, words):
    draft = write_random_eagle_checkpoint(str(tmp_path / "e3"), PRESETS["tiny"], "EAGLE3", 10)
    if tensors == "float d2t":
        d2t = load_file(os.path.join(draft, "model.safetensors"))["d2t"]
        tensors = {"d2t": d2t.float() + 0.5}
    elif tensors == "short t2d":
        tensors = {"t2d": torch.ones(300, dtype=torch.bool)}
    _rewrite(draft, config, tensors)
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **spec(draft, "EAGLE3", topk=2, ndt=6))
    assert info.value.field == "speculative_draft_model_path" and words in str(info.value)


def test_simulated_length_is_clipped_to_what_the_tree_can_accept(eagle):
    """A 4-step topk-8 tree of 3 nodes accepts at most 2 deep: match-expected asked for 3
    gives the longest it can, and says so, instead of a silent shortfall."""
    sim = dict(simulate_acc_len=3.0, simulate_acc_method="match-expected")
    with Engine(**TINY, **spec(eagle, steps=4, topk=8, ndt=3), **sim) as e:
        assert e.resolved_args()["simulate_acc_len"] == 3.0
        e.generate(input_ids=mixed_prompts(2, 512, seed=4), sampling_params=WHOLE_RUNS)
        assert e.stats()["spec_accept_length"] == 3.0
    with Engine(**TINY, **spec(eagle, steps=4, topk=8, ndt=2), **sim) as e:
        assert e.resolved_args()["simulate_acc_len"] == 2.0


def test_a_wide_tree_of_few_nodes_drafts_only_what_it_can_verify():
    """16 steps of topk 16 keeping 2 nodes verify the draft's first token alone: drafting the
    other 15 depths reserved a 241-position window, refused by a 150-token KV budget."""
    prompts = mixed_prompts(4, 512, seed=3, min_len=3, max_len=20)
    with Engine(**TINY, max_total_tokens=150) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    wide = spec("tiny", "STANDALONE", steps=16, topk=16, ndt=2)
    with Engine(**TINY, **wide, max_total_tokens=150, debug_check_invariants=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=WHOLE_RUNS)
        outs = [o["output_ids"][: GREEDY["max_new_tokens"]] for o in outs]
        assert e.stats()["spec_accept_length"] == 2.0  # the target is its own draft
    assert outs == plain


def _draw_case(rng: random.Random, root: str, case: int) -> dict:
    """Tree shapes past the usual sweep's (up to 16 steps and topk 16, trees narrower than
    their steps), EAGLE token maps that grow, EAGLE3 vocabularies as small as topk, drafts of
    other shapes, adaptive tiers, tight KV budgets, and each request's penalties and allowed
    tokens."""
    from specserve.model.config import ModelConfig
    from tests.engine_utils import write_dummy_config
    from tests.test_random_configs import adjustments

    shape = dict(
        vocab_size=rng.choice([40, 300]),
        hidden_size=rng.choice([32, 64]),
        num_hidden_layers=rng.choice([1, 4]),
        num_attention_heads=4,
        num_key_value_heads=rng.choice([1, 4]),
        intermediate_size=64,
        model_type=rng.choice(["llama", "qwen2"]),
    )
    folder = write_dummy_config(f"{root}/m{case}", **shape)
    with open(f"{folder}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    algo = rng.choice(["EAGLE", "EAGLE3", "STANDALONE"])
    topk, steps = rng.choice([1, 2, 5, 8, 16]), rng.choice([1, 3, 8, 16])
    extra: dict = {}
    if algo == "STANDALONE":
        draft = write_dummy_config(
            f"{root}/s{case}", **dict(shape, hidden_size=48, num_hidden_layers=1)
        )
    elif algo == "EAGLE3":
        vocab = rng.choice([topk, max(topk, 20)])
        draft = write_random_eagle_checkpoint(f"{root}/d{case}", cfg, algo, vocab, seed=case)
    else:
        draft = write_random_eagle_checkpoint(f"{root}/d{case}", cfg, algo, seed=case)
        if rng.random() < 0.6:
            ids = rng.sample(range(cfg.vocab_size), rng.randint(topk, cfg.vocab_size // 2))
            save_token_map(f"{root}/map{case}.json", ids)
            extra = dict(
                speculative_token_map=f"{root}/map{case}.json",
                speculative_token_map_growth=rng.randint(0, cfg.vocab_size - len(ids)),
            )
    most = 1 + topk + (steps - 1) * topk * topk
    ndt = rng.choice([2, 3, min(most, 1 + steps), min(most, 64)])
    if rng.random() < 0.3:
        extra["speculative_adaptive"] = True
    common = dict(
        model_path=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        random_seed=case,
        max_total_tokens=rng.choice([400, 1200]),
        page_size=rng.choice([1, 3, 16]),
        disable_overlap_schedule=rng.random() < 0.5,
    )
    prompts = mixed_prompts(rng.randint(2, 8), cfg.vocab_size, seed=case, max_len=30)
    sp = {"temperature": 0.0, "max_new_tokens": rng.randint(5, 25), "ignore_eos": True}
    if rng.random() < 0.3:
        sp.update(temperature=0.8, top_k=rng.choice([-1, 5]), seed=case)
    own = random.Random(case)
    sps = [dict(sp, **adjustments(own, cfg.vocab_size, sp["max_new_tokens"])) for _ in prompts]
    return dict(common=common, spec=spec(draft, algo, steps, topk, ndt, **extra), sp=sps,
                prompts=prompts)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", range(16))
def test_unusual_speculative_configuration_is_lossless(tmp_path, case):
    c = _draw_case(random.Random(5000 + case), str(tmp_path), case)
    with Engine(**c["common"]) as e:
        plain = e.generate(input_ids=c["prompts"], sampling_params=c["sp"])
    with Engine(**c["common"], **c["spec"], debug_check_invariants=True) as e:
        outs = e.generate(input_ids=c["prompts"], sampling_params=c["sp"])
        assert e.stats()["kv_used_tokens"] == 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain], c["spec"]
