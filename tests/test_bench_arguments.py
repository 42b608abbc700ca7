"""The bench commands' (and train-eagle's) arguments: a value that cannot measure what was
asked is refused before anything loads, naming the flag; one-batch runs each batch whole."""

from __future__ import annotations

import pytest
import torch

from specserve.cli import main
from specserve.errors import InvalidArgument

TINY = ["--model-path", "tiny", "--load-format", "dummy", "--device", "cpu"]


@pytest.fixture
def no_engine(monkeypatch):
    """Engines (and train-eagle's data generation) fail the test if anything builds one."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr("specserve.engine.Engine", refuse)
    monkeypatch.setattr("specserve.train.data.build_dataset", refuse)
    monkeypatch.setattr("specserve.train.arg_checks.check_target", refuse)


def _refused(capsys, argv: list[str], *names: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    for name in names:
        assert name in err, err
    return err


# --- one-batch -------------------------------------------------------------------------


def test_one_batch_runs_its_largest_batch_at_once_by_default(monkeypatch, capsys):
    """The CPU default of 64 running requests would queue 6 of a batch of 70."""
    import specserve.bench.one_batch as one_batch

    seen = {}

    def spy(engine, bs, input_len, output_len, **kw):
        seen[bs] = engine.resolved_args()["max_running_requests"]
        return {"batch_size": bs}

    monkeypatch.setattr(one_batch, "run_one_batch", spy)
    argv = ["bench", "one-batch", *TINY, "--input-len", "4", "--output-len", "2"]
    assert main([*argv, "--batch-size", "2", "70"]) == 0
    assert seen == {2: 70, 70: 70}


@pytest.mark.parametrize(
    "extra, limit",
    [
        (["--batch-size", "2", "8", "--max-running-requests", "4"], "--max-running-requests"),
        (["--batch-size", "4", "--max-total-tokens", "100"], "--max-total-tokens"),
    ],
)
def test_one_batch_refuses_a_batch_the_engine_cannot_hold_whole(capsys, extra, limit):
    argv = ["bench", "one-batch", *TINY, "--input-len", "8", "--output-len", "32", *extra]
    _refused(capsys, argv, "--batch-size", limit)
    assert "decode_throughput_tok_s" not in capsys.readouterr().out  # no batch was run


def test_one_batch_refuses_a_prompt_and_output_past_the_context(capsys):
    """The output would stop short at the context, and the row would say output_len anyway."""
    argv = ["bench", "one-batch", *TINY, "--batch-size", "1", "--input-len", "2040"]
    _refused(capsys, [*argv, "--output-len", "100"], "--output-len", "2048")
    assert "decode_throughput_tok_s" not in capsys.readouterr().out


# --- acceptance ------------------------------------------------------------------------

ACCEPTANCE = ["bench", "acceptance", "--num-prompts", "1", "--max-new-tokens", "4"]


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--dtype", "int8"], ["--dtype", "int8"]),
        (["--algorithm", "EAGLE3"], ["--algorithm", "EAGLE"]),
        (["--engine-arg", "max_total_tokens=abc"], ["--engine-arg", "max_total_tokens"]),
        (["--engine-arg", "page_size=-3"], ["--engine-arg", "page_size"]),
        (["--engine-arg", "foo=1"], ["--engine-arg", "foo", "allowed: ", "page_size"]),
        (["--configs", "3,1,4", "3,2,99"], ["--configs", "3,2,99", "[2, 11]"]),
        (["--target", "/nope"], ["--target", "/nope does not exist"]),
    ],
)
def test_acceptance_refuses_bad_arguments_before_loading(no_engine, capsys, extra, names):
    _refused(capsys, [*ACCEPTANCE, "--configs", "3,1,4", *extra], *names)


def test_acceptance_fails_when_every_configuration_failed(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise InvalidArgument("max_total_tokens", "too few for one request")

    monkeypatch.setattr("specserve.bench.acceptance.run_config", fail)
    assert main([*ACCEPTANCE, "--configs", "3,1,4", "5,1,6"]) != 0
    assert "every configuration failed" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{bad\n", "\n", '{"text": "no prompt field"}\n'])
@pytest.mark.parametrize("command", [["bench", "e2e"], ACCEPTANCE])
def test_a_prompts_file_that_cannot_be_read_is_refused_before_loading(
    no_engine, tmp_path, capsys, text, command
):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    _refused(capsys, [*command, "--prompts", str(path)], "--prompts", str(path))


def test_e2e_checks_every_spec_before_the_first_row_runs(no_engine, capsys):
    argv = ["bench", "e2e", "--model-path", "tiny", "--skip-hf", "--spec", "3,1,4", "3,2,100"]
    _refused(capsys, argv, "--spec", "'3,2,100'", "[2, 11]")
    _refused(capsys, [*argv[:-2], "3,x"], "--spec", "3,x")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--port", "70000"], "--port"),
        (["--port", "0"], "--port"),
        (["--base-url", "http://localhost:70000"], "--base-url"),
        (["--base-url", "localhost:8000"], "--base-url"),
    ],
)
def test_serving_refuses_an_address_it_cannot_reach(no_engine, capsys, extra, flag):
    _refused(capsys, ["bench", "serving", *extra], flag)


def test_e2e_names_a_missing_model_path(no_engine, capsys):
    err = _refused(capsys, ["bench", "e2e", "--model-path", "/nope/model"], "--model-path")
    assert "/nope/model does not exist" in err and "bundled" not in err


# --- train-eagle's --engine-arg ---------------------------------------------------------


@pytest.mark.parametrize(
    "value, names",
    [("max_total_tokens=abc", ["max_total_tokens", "integer"]), ("foo=1", ["foo", "allowed: "])],
)
def test_train_eagle_checks_engine_args_before_loading(no_engine, tmp_path, capsys, value, names):
    argv = ["train-eagle", "--out", str(tmp_path / "d"), "--generator", "engine"]
    _refused(capsys, [*argv, "--engine-arg", value], "--engine-arg", *names)


@pytest.mark.parametrize("manifest", ["{bad", "[1]"])
def test_train_eagle_refuses_a_dataset_whose_manifest_cannot_be_read(tmp_path, capsys, manifest):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(manifest)
    argv = ["train-eagle", "--target", "tiny", "--load-format", "dummy", "--data-dir", str(data)]
    _refused(capsys, [*argv, "--out", str(tmp_path / "out")], "--data-dir", "manifest.json")
    assert not (tmp_path / "out").exists()


# --- multiturn -------------------------------------------------------------------------

MULTITURN = ["bench", "multiturn", *TINY, "--conversations", "2", "--turns", "2"]
SMALL_TURNS = ["--system-len", "8", "--user-len", "4", "--answer-len", "4"]


def test_multiturn_plain_row_beside_simulated_speculation(capsys):
    """The plain row drops simulated acceptance with the speculative settings it needs."""
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "tiny"]
    argv = [*MULTITURN, *SMALL_TURNS, *spec, "--simulate-acc-len", "2"]
    assert main([*argv, "--variants", "plain", "spec"]) == 0
    out = capsys.readouterr().out
    assert "specserve plain" in out and "specserve spec" in out


def test_multiturn_refuses_spec_without_a_draft(no_engine, capsys):
    _refused(capsys, [*MULTITURN, "--variants", "plain", "spec"], "--variants", "draft")


# --- profile-step ----------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_profile_step_needs_cuda(no_engine, capsys):
    argv = ["bench", "profile-step", "--model-path", "smollm2-135m", "--load-format", "dummy"]
    _refused(capsys, [*argv, "--batch-size", "1", "--output-len", "4"], "CUDA")


# --- compare ---------------------------------------------------------------------------

COMPARE = ["bench", "compare", *TINY, "--batch-size", "1", "--skip-hf"]


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--accept-lengths", "0.5"], ["--accept-lengths", "[1, 4]", "0.5"]),
        (["--accept-lengths", "2", "9"], ["--accept-lengths", "[1, 4]"]),
        (["--topk", "2", "--num-draft-tokens", "99"], ["--num-draft-tokens", "[2, 11]"]),
        (["--num-steps", "99"], ["--num-steps", "[1, 16]"]),
        (["--model-path", "/nope/model"], ["--model-path", "does not exist"]),
    ],
)
def test_compare_checks_its_flags_before_any_row_runs(no_engine, capsys, extra, names):
    _refused(capsys, [*COMPARE, *extra], *names)


def test_compare_help_describes_options_with_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "compare", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--num-steps NUM_STEPS draft steps", "(default: 3)", "(default: llama3-8b)"):
        assert text in out


def test_acceptance_rows_of_a_chain_report_the_size_the_engine_runs():
    from specserve.bench.acceptance import parse_config

    assert parse_config("3,1,99") == ("chain-3", 3, 1, 4)
    assert parse_config("3,2,9") == ("tree-k2-n9-s3", 3, 2, 9)
