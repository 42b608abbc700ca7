"""Sampling through speculative decoding draws from the target's own distribution.

On a 32-token vocabulary, the joint distribution of the first two generated tokens
(over 20,000 requests with distinct seeds) is compared by a chi-square test with the exact
distribution computed from the target's logits, with temperature, top_k and top_p applied by
an independent reference implementation written here.
"""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import ModelConfig
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import reference_logits, write_dummy_config

PROMPT = [5, 9, 3, 17]
SP = {"temperature": 0.9, "top_k": 12, "top_p": 0.85, "max_new_tokens": 2, "ignore_eos": True}
DRAWS = 20_000


def filtered_probs(logits: torch.Tensor) -> torch.Tensor:
    """Independent reference: temperature, then top_k, then top_p on the renormalised rest."""
    probs = torch.softmax(logits.double() / SP["temperature"], dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    top = probs[order[: SP["top_k"]]]
    top = top / top.sum()
    for rank, tok in enumerate(order[: SP["top_k"]].tolist()):
        if mass >= SP["top_p"]:
            break
        keep[tok] = True
        mass += top[rank].item()
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pool cells expected below 5 into one bin; p-value from the regularised gamma."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    nonzero = exp > 0
    obs, exp = obs[nonzero], exp[nonzero]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab32")
    target = write_dummy_config(str(root / "target"), initializer_note="random")
    import json

    with open(f"{target}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    eagle = write_random_eagle_checkpoint(str(root / "eagle"), cfg, "EAGLE", seed=3)
    return target, eagle


def exact_joint(engine) -> torch.Tensor:
    model = engine.core.runner.model
    p1 = filtered_probs(reference_logits(model, PROMPT)[-1])
    vocab = p1.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in torch.nonzero(p1).flatten().tolist():
        joint[t1] = p1[t1] * filtered_probs(reference_logits(model, PROMPT + [t1])[-1])
    return joint


def sample_joint(engine, seed_base: int) -> torch.Tensor:
    params = [{**SP, "seed": seed_base + i} for i in range(DRAWS)]
    outs = engine.generate(input_ids=[PROMPT] * DRAWS, sampling_params=params)
    vocab = engine.core.model_config.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for o in outs:
        t1, t2 = o["output_ids"]
        counts[t1, t2] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("topk, steps, ndt", [(1, 3, 4), (4, 3, 10)])
def test_first_two_tokens_follow_the_target_distribution(model_dir, topk, steps, ndt):
    target, eagle = model_dir
    kwargs = dict(
        model_path=target, load_format="dummy", skip_tokenizer_init=True, max_running_requests=1024
    )
    if topk is not None:
        kwargs.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=eagle,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
        )
    with Engine(**kwargs) as engine:
        expected = exact_joint(engine) * DRAWS
        observed = sample_joint(engine, seed_base=100_000 * topk)
        stats = engine.stats()
    assert observed.sum() == DRAWS
    assert ((observed > 0) & (expected == 0)).sum() == 0, "sampled a token the filters exclude"
    p = chi_square_p(observed.flatten(), expected.flatten())
    assert p > 0.001, f"chi-square p = {p:.2e}"
    if topk is not None:
        assert stats["spec_verify_ct"] > 0


@pytest.mark.slow
def test_a_sampled_token_is_never_one_the_distribution_excludes():
    """Every row allows one token alone (at temperature 1, and under a top-p filter), and that
    token is always the one drawn: over 67 million noise values, where the one in 2**24 that
    used to round to 1.0 (its Gumbel noise infinite, winning over any logit) came about 4
    times."""
    from specserve.ops.sampling import SamplingTensors, sample

    rows, vocab = 64, 1 << 18
    allowed = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))
    logits = torch.full((rows, vocab), float("-inf"))
    logits[torch.arange(rows), allowed] = 0.0
    for top_p in (1.0, 0.9):
        st = SamplingTensors(
            temperatures=torch.ones(rows),
            top_ks=torch.full((rows,), -1, dtype=torch.int64),
            top_ps=torch.full((rows,), top_p),
            min_ps=torch.zeros(rows),
            seeds=torch.arange(rows, dtype=torch.int64),
            all_greedy=False,
            needs_filter=top_p < 1.0,
        )
        for position in range(1, 4 if top_p == 1.0 else 2):
            drawn = sample(logits, st, torch.full((rows,), position))
            assert torch.equal(drawn, allowed), (top_p, position)
