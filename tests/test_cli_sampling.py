"""`specserve generate`'s sampling flags reach the engine, and bad values are a one-line error
naming the parameter."""

from __future__ import annotations

import json

import pytest

from specserve import InvalidArgument
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
    assert "--repetition-penalty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value",
    [("--temperature", "nan"), ("--top-p", "2"), ("--max-new-tokens", "-1"), ("--min-p", "2")],
)
def test_a_bad_sampling_flag_is_refused_before_the_model_loads(monkeypatch, capsys, flag, value):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr("specserve.engine.Engine", refuse)
    assert (
        main(["generate", "hi", "--model-path", "tiny", "--load-format", "dummy", flag, value]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}: ") and "\n" not in err, err


def test_the_streamed_summary_says_how_the_output_ended_in_words(folder, capsys):
    args = ["generate", "hello", "--model-path", folder, "--dtype", "float32",
            "--device", "cpu", "--max-new-tokens", "5", "--ignore-eos"]  # fmt: skip
    assert main(args) == 0
    summary = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert summary.startswith("[5 tokens, ") and summary.endswith("finish: length (5)]"), summary


def test_a_bad_default_max_tokens_names_every_allowed_value():
    from specserve.server.server_config import ServerConfig

    for whole_context in (0, -1, None):
        config = ServerConfig(default_max_tokens=whole_context)
        config.validate()
        assert config.default_max_tokens is None
    with pytest.raises(InvalidArgument) as info:
        ServerConfig(default_max_tokens=-2).validate()
    assert info.value.field == "default_max_tokens" and "0 or -1" in str(info.value)


def test_a_prompt_of_dash_is_read_from_standard_input(folder, capsys, monkeypatch):
    import io

    common = ["--model-path", folder, "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "4", "--ignore-eos", "--json", "--log-level", "INFO"]  # fmt: skip
    assert main(["generate", "hello", *common]) == 0
    want = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["generate", "-", *common]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
