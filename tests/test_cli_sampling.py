"""`specserve generate`'s sampling flags reach the engine, and bad values are a one-line error
naming the parameter."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main
from tests.model_factory import write_hf_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("hf"), vocab_size=96, seed=3, with_tokenizer=True)


def test_the_cli_passes_penalties_and_refuses_bad_ones(folder, capsys):
    common = ["generate", "hello", "--model-path", folder, "--dtype", "float32",
              "--device", "cpu", "--max-new-tokens", "8", "--ignore-eos", "--json"]  # fmt: skip
    assert main(common) == 0
    free = json.loads(capsys.readouterr().out)["output_ids"]
    assert main([*common, "--frequency-penalty", "2", "--presence-penalty", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] != free
    assert main([*common, "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err
