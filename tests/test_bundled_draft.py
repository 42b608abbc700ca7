"""A packaged model runs with its bundled draft everywhere (Engine, generate, serve), the off
switch works everywhere, and a user's own speculative arguments override it one by one."""

from __future__ import annotations

import json
import os

import pytest

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.model import registry
from specserve.model.registry import BundledDraft

DEFAULT = "smollm2-135m"


def resolved(cuda: bool = False, **kw) -> EngineConfig:
    return EngineConfig(**kw).resolve(cuda_available=cuda)


def served(folder: str, on_gpu: bool) -> dict:
    return registry.draft_serving_settings(folder, on_gpu)


@pytest.fixture
def bundled():
    folder = registry.bundled_draft_folder(DEFAULT)
    if folder is None:
        pytest.fail("the bundled draft of the default model is missing from this checkout")
    return folder


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
def test_default_model_resolves_to_its_bundled_draft_as_served_on_the_device(bundled, cuda):
    c = resolved(cuda)
    want = served(bundled, cuda)
    assert c.speculative_algorithm == "EAGLE" and c.speculative_draft_model_path == bundled
    assert c.speculative_num_steps == want["speculative_num_steps"]
    assert c.speculative_eagle_topk == want["speculative_eagle_topk"]
    assert c.speculative_token_map == want["speculative_token_map"]
    assert "bundled draft" in c.draft_summary() and "no_default_draft" in c.draft_summary()
    reasons = {f: r for f, _, r in c.decisions}
    assert "bundled draft" in reasons["speculative_draft_model_path"]
    as_dict = c.as_dict()  # what Engine.resolved_args() returns
    assert as_dict["speculative_draft_model_path"] == bundled


def test_the_off_switch_and_random_weights_keep_plain_decoding():
    for kw in ({"no_default_draft": True}, {"load_format": "dummy"}):
        c = resolved(**kw)
        assert c.speculative_algorithm is None and c.speculative_draft_model_path is None
        assert "not used" in c.draft_summary()


def test_own_arguments_override_the_bundled_settings_one_by_one(bundled):
    gpu = served(bundled, True)
    c = resolved(True, speculative_num_steps=5)
    assert c.speculative_draft_model_path == bundled and c.speculative_num_steps == 5
    assert c.speculative_eagle_topk == gpu["speculative_eagle_topk"]
    # naming the algorithm alone uses the bundled draft
    c = resolved(speculative_algorithm="EAGLE")
    assert c.speculative_draft_model_path == bundled
    # a chain asked for on the GPU: the bundled tree size is fitted to what a chain can hold
    c = resolved(True, speculative_eagle_topk=1)
    assert c.speculative_num_draft_tokens == 1 + 1 + (c.speculative_num_steps - 1)
    assert any("exceeds" in r for f, _, r in c.decisions if f == "speculative_num_draft_tokens")


def test_a_deeper_chain_than_the_bundled_one_fits_its_size_without_a_warning(bundled, caplog):
    """On the CPU the bundled draft is a 3-step chain of 4 tokens: 5 steps asked for need 6,
    and the size was the bundled one, not the user's, so nothing warns about it."""
    cpu = served(bundled, False)
    assert cpu["speculative_eagle_topk"] == 1
    with caplog.at_level("WARNING"):
        c = resolved(False, speculative_num_steps=5)
    assert c.speculative_num_steps == 5 and c.speculative_num_draft_tokens == 6
    assert not [r for r in caplog.records if "speculative_num_draft_tokens" in r.getMessage()]
    reasons = [r for f, _, r in c.decisions if f == "speculative_num_draft_tokens"]
    assert any("short of a chain of 5 steps" in r for r in reasons), reasons
    with caplog.at_level("WARNING"):  # a size the user gave is still raised, with a warning
        c = resolved(False, speculative_num_steps=5, speculative_num_draft_tokens=3)
    assert c.speculative_num_draft_tokens == 6
    assert [r for r in caplog.records if "speculative_num_draft_tokens" in r.getMessage()]


def test_another_draft_or_algorithm_is_not_mixed_with_the_bundled_one(bundled):
    c = resolved(speculative_algorithm="STANDALONE", speculative_draft_model_path=DEFAULT)
    assert c.speculative_draft_model_path == DEFAULT and c.speculative_token_map is None
    with pytest.raises(InvalidArgument) as e:  # EAGLE3 asked for; the bundled one is EAGLE
        resolved(speculative_algorithm="EAGLE3")
    assert e.value.field == "speculative_draft_model_path"


def test_serving_settings_per_device(tmp_path):
    """serving.json's "cuda" section applies on a GPU only; a token map named there is a file
    of the folder, with its growth, on every device."""
    chain = {"speculative_num_steps": 3, "speculative_eagle_topk": 1}
    tree = {"speculative_num_steps": 8, "speculative_eagle_topk": 8}
    saved = {**chain, "speculative_num_draft_tokens": 4, "cuda": tree}
    (tmp_path / "serving.json").write_text(json.dumps(saved))
    shape = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    assert tuple(served(str(tmp_path), False)[k] for k in shape) == (3, 1, 4)
    assert tuple(served(str(tmp_path), True)[k] for k in shape) == (8, 8, 4)
    assert "speculative_token_map" not in served(str(tmp_path), False)
    grows = {**saved, "speculative_token_map": "t.json", "speculative_token_map_growth": 512}
    (tmp_path / "serving.json").write_text(json.dumps(grows))
    for on_gpu in (False, True):
        s = served(str(tmp_path), on_gpu)
        assert s["speculative_token_map"] == str(tmp_path / "t.json")
        assert s["speculative_token_map_growth"] == 512


def test_generate_and_serve_take_the_same_switch(tmp_path, monkeypatch, capsys):
    """`specserve generate` reports the bundled draft on stderr and runs it; its
    --no-default-draft turns it off; `specserve serve` has the same flag (one parser)."""
    import argparse

    from specserve import cli
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from tests.model_factory import write_hf_model

    target = write_hf_model(str(tmp_path / "target"), seed=5, with_tokenizer=True)
    from specserve.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(target, "config.json"))))
    write_random_eagle_checkpoint(str(tmp_path / "drafts" / "d"), cfg, "EAGLE")
    monkeypatch.setattr(registry, "DRAFTS_ROOT", str(tmp_path / "drafts"))
    monkeypatch.setitem(registry.BUNDLED_DRAFTS, target.lower(), BundledDraft("d", "EAGLE"))
    base = ["generate", "hello", "--model-path", target, "--max-new-tokens", "6", "--json"]

    def run(*extra):
        assert cli.main(base + list(extra)) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["meta_info"], out.err

    meta, err = run()
    assert "bundled draft" in err and meta["spec_verify_ct"] >= 1
    meta, err = run("--no-default-draft")
    assert "spec_verify_ct" not in meta and "not used" in err

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    from specserve.server.cli import add_serve_parser

    add_serve_parser(sub, cli.add_engine_args, cli.engine_kwargs)
    args = parser.parse_args(["serve", "--model-path", target, "--no-default-draft"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["no_default_draft"] is True
    assert EngineConfig(**kwargs).resolve(cuda_available=False).speculative_algorithm is None


@pytest.mark.slow
def test_engine_runs_the_default_model_with_its_bundled_draft_losslessly(bundled):
    """Engine() with no arguments serves the bundled draft as on a CPU (a 3-step chain over
    the token map, growing with the request's tokens); its output equals plain decoding."""
    from specserve import Engine
    from specserve.speculative.token_map import load_token_map

    assert os.path.getsize(os.path.join(bundled, "model.safetensors")) < 20 * 2**20
    prompt = [{"role": "user", "content": "Explain how tides work."}]
    sp = {"temperature": 0, "max_new_tokens": 48}
    with Engine() as e:
        args = e.resolved_args()
        assert args["speculative_draft_model_path"] == bundled
        assert len(load_token_map(args["speculative_token_map"], 49152)) == 16384
        assert args["speculative_token_map_growth"] > 0
        ids = e.tokenize_chat(prompt)
        out = e.generate(input_ids=ids, sampling_params=sp)
    assert out["meta_info"]["spec_verify_ct"] >= 1
    with Engine(no_default_draft=True) as e:
        assert e.resolved_args()["speculative_algorithm"] is None
        plain = e.generate(input_ids=ids, sampling_params=sp)
    assert out["output_ids"] == plain["output_ids"]
