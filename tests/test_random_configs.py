"""A randomized sweep: model shapes, draft kinds, tree shapes, page sizes, chunking, KV
budgets, overlap, sampling and each request's penalties, bias, length limits, allowed tokens
and prompt truncation drawn at random; speculative output must equal plain output and every
page must be free afterwards."""

from __future__ import annotations

import json
import random

import pytest

from specserve import Engine
from specserve.model.config import ModelConfig
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import mixed_prompts, write_dummy_config


def draw_case(rng: random.Random, root: str, case: int) -> dict:
    shape = dict(
        vocab_size=rng.choice([64, 300]),
        hidden_size=rng.choice([32, 64]),
        num_hidden_layers=rng.choice([1, 2, 3]),
        num_attention_heads=4,
        num_key_value_heads=rng.choice([1, 2, 4]),
        intermediate_size=64,
        tie_word_embeddings=rng.random() < 0.5,
        model_type=rng.choice(["llama", "qwen2", "qwen3"]),
    )
    if shape["model_type"] == "qwen3":
        shape["head_dim"] = rng.choice([8, 16])
    folder = write_dummy_config(f"{root}/m{case}", **shape)
    with open(f"{folder}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    algo = rng.choice(["EAGLE", "EAGLE3", "STANDALONE"])
    if algo == "STANDALONE":
        draft = folder
    else:
        vocab = rng.choice([None, 40]) if algo == "EAGLE3" else None
        draft = write_random_eagle_checkpoint(f"{root}/d{case}", cfg, algo, vocab, seed=case)
    topk, steps = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([1, 2, 3, 5])
    sp = {"temperature": 0.0, "max_new_tokens": rng.randint(1, 30), "ignore_eos": True}
    if rng.random() < 0.3:
        sp.update(
            temperature=0.9, top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.8]), seed=case
        )
    spec = dict(
        page_size=rng.choice([1, 2, 3, 5, 16, 64]),
        chunked_prefill_size=rng.choice([-1, 3, 16]),
        disable_overlap_schedule=rng.random() < 0.5,
        max_running_requests=rng.choice([1, 3, 64]),
        speculative_algorithm=algo,
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=rng.randint(2, min(1 + topk + (steps - 1) * topk * topk, 80)),
    )
    if rng.random() < 0.4:
        spec["max_total_tokens"] = rng.choice([150, 300, 600])
    common = dict(
        model_path=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        debug_check_invariants=True,
        random_seed=case,
    )
    prompts = mixed_prompts(
        rng.randint(1, 10), cfg.vocab_size, seed=case, max_len=rng.choice([5, 40])
    )
    # each request's own adjustments, from a stream of their own (the draws above stay)
    own = random.Random(case)
    sps = [dict(sp, **adjustments(own, cfg.vocab_size, sp["max_new_tokens"])) for _ in prompts]
    return dict(common=common, spec=spec, sp=sps, prompts=prompts)


def adjustments(rng: random.Random, vocab: int, max_new: int) -> dict:
    """About half the requests: penalties, a logit bias, a minimum length held against stop
    tokens, allowed tokens, a truncated prompt or no drafts, each drawn at random."""
    out: dict = {}
    if rng.random() < 0.5:
        return out
    if rng.random() < 0.5:
        out.update(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2))
    if rng.random() < 0.4:
        out["repetition_penalty"] = rng.uniform(0.3, 2)
    if rng.random() < 0.3:
        out["logit_bias"] = {str(rng.randrange(vocab)): rng.uniform(-10, 10) for _ in range(3)}
    if rng.random() < 0.3:
        out.update(
            min_new_tokens=rng.randint(0, max_new),
            stop_token_ids=rng.sample(range(vocab), vocab // 8),
            ignore_eos=False,
        )
    if rng.random() < 0.2:
        out["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(1, vocab // 4))
    if rng.random() < 0.2:
        out["truncate_prompt_tokens"] = rng.randint(1, 8)
    if rng.random() < 0.2:
        out["speculative"] = False
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", range(24))
def test_random_configuration_is_lossless(tmp_path, case):
    c = draw_case(random.Random(1000 + case), str(tmp_path), case)
    with Engine(**c["common"]) as e:
        plain = [
            o["output_ids"] for o in e.generate(input_ids=c["prompts"], sampling_params=c["sp"])
        ]
    with Engine(**c["common"], **c["spec"]) as e:
        outs = e.generate(input_ids=c["prompts"], sampling_params=c["sp"])
        assert e.stats()["kv_used_tokens"] == 0
    assert [o["output_ids"] for o in outs] == plain, c["spec"]
