"""Flag values the CLI must refuse with a one-line error naming the flag (exit status 2),
before it loads a model, generates data or measures anything: never a traceback, a run that
fails minutes later, or one that silently does something else."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from specserve import cli

# a path that exists nowhere: unique to this run (a fixed one, once made by anything, would
# stop these tests from testing anything)
MISSING = os.path.join(tempfile.gettempdir(), f"specserve-missing-{uuid.uuid4().hex}")


def _id(argv: list[str]) -> str:
    """A test id the same in every process (pytest-xdist compares them)."""
    return " ".join(argv).replace(MISSING, "MISSING")


def _refused(capsys, argv: list[str], flag: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}:") and "Traceback" not in err, err
    return err


BAD_TRAIN_FLAGS = [
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--warmup", "2"], "--warmup"),
    (["--min-lr-ratio", "5"], "--min-lr-ratio"),
    (["--grad-clip", "0"], "--grad-clip"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--ttt-decay", "-1"], "--ttt-decay"),
    (["--feature-weight", "-1"], "--feature-weight"),
    (["--ce-vocab", "-1"], "--ce-vocab"),
    (["--save-every-seconds", "-1"], "--save-every-seconds"),
    (["--epochs", "nan"], "--epochs"),
    (["--epochs", "0", "--time-budget", "nan"], "--time-budget"),
    (["--gen-time-budget", "nan"], "--gen-time-budget"),
    (["--sampled-pass", "--temperature", "inf"], "--temperature"),
    (["--seed", str(2**64)], "--seed"),
    (["--device", "tpu"], "--device"),
    (["--load-format", "pt"], "--load-format"),
    (["--prompts", MISSING + ".jsonl"], "--prompts"),
    (["--data-dir", MISSING], "--data-dir"),
    (["--generator", "engine", "--engine-arg", "page_size"], "--engine-arg"),
    (["--head", "eagle3", "--init-layer", "0"], "--init-layer"),
]


@pytest.mark.parametrize("flags,named", BAD_TRAIN_FLAGS, ids=[_id(f) for f, _ in BAD_TRAIN_FLAGS])
def test_train_eagle_refuses_a_bad_value_before_generating(tmp_path, capsys, flags, named):
    _refused(capsys, ["train-eagle", "--out", str(tmp_path / "d"), *flags], named)
    assert not (tmp_path / "d.work").exists()


def test_train_eagle_refuses_a_target_it_cannot_use_naming_the_flag(tmp_path, capsys):
    base = ["train-eagle", "--out", str(tmp_path / "d"), "--load-format", "dummy"]
    _refused(capsys, [*base, "--target", MISSING, "--load-format", "auto"], "--target")
    # tiny: two layers, and no tokenizer for the chat prompts
    err = _refused(capsys, [*base, "--target", "tiny", "--init-layer", "2"], "--init-layer")
    assert "must be < 2" in err
    err = _refused(capsys, [*base, "--target", "tiny"], "--target")
    assert "no tokenizer" in err
    assert not (tmp_path / "d.work" / "data").exists()


def test_token_map_refuses_a_bad_value_before_generating(tmp_path, capsys):
    out = tmp_path / "maps"
    for flags, named in (
        (["--prompts", MISSING + ".jsonl"], "--prompts"),
        (["--device", "tpu"], "--device"),
        (["--gen-time-budget", "nan"], "--gen-time-budget"),
        (["--engine-arg", "page_size"], "--engine-arg"),
        (["--target", "tiny", "--load-format", "dummy"], "--target"),  # (no tokenizer)
    ):
        _refused(capsys, ["token-map", "--out", str(out), *flags], named)
    assert not out.exists()
    # a size past the target's vocabulary (the map would hold all of it, named for more)
    from tests.model_factory import write_hf_model

    target = write_hf_model(tmp_path / "m", vocab_size=101, with_tokenizer=True)
    capsys.readouterr()  # (its progress bar)
    argv = ["token-map", "--out", str(out), "--target", str(target), "--sizes", "64", "102"]
    assert "vocabulary of 101" in _refused(capsys, argv, "--sizes")
    assert not out.exists()


TINY = ["--model-path", "tiny", "--load-format", "dummy", "--device", "cpu"]
BAD_BENCH_FLAGS = [
    (["one-batch", *TINY, "--output-json", MISSING + "/rows.json"], "--output-json"),
    (["profile-step", *TINY, "--output-json", MISSING + "/p.json"], "--output-json"),
    (["multiturn", *TINY, "--system-len", "-1"], "--system-len"),
    (["multiturn", *TINY, "--variants", "plain", "fast"], "--variants"),
    (["acceptance", "--configs", "3,1"], "--configs"),
    (["acceptance", "--configs", "0,1,1"], "--configs"),
    (["acceptance", "--engine-arg", "max_total_tokens"], "--engine-arg"),
    (["acceptance", "--draft", MISSING], "--draft"),
    (["acceptance", "--prompts", MISSING + ".jsonl"], "--prompts"),
    (["compare", *TINY[:2], "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["compare", *TINY[:2], "--draft-vocab-size", "-1"], "--draft-vocab-size"),
    (["compare", *TINY[:2], "--plot", MISSING + "/p.png"], "--plot"),
    (["e2e", "--prompts", MISSING + ".jsonl"], "--prompts"),
    (["serving", "--dataset", MISSING + ".jsonl"], "--dataset"),
    (["serving", "--warmup", "-1"], "--warmup"),
    (["serving", "--timeout", "0"], "--timeout"),
]


@pytest.mark.parametrize("argv,named", BAD_BENCH_FLAGS, ids=[_id(a) for a, _ in BAD_BENCH_FLAGS])
def test_bench_refuses_a_bad_value_before_measuring(capsys, argv, named):
    _refused(capsys, ["bench", *argv], named)
    assert capsys.readouterr().out == ""  # (nothing measured, no table)


def test_bench_one_batch_chat_needs_a_tokenizer(capsys):
    argv = ["bench", "one-batch", *TINY, "--chat", "--batch-size", "1", "--output-len", "2"]
    err = _refused(capsys, argv, "--chat")
    assert "tokenizer" in err


@pytest.mark.parametrize("flag", ["--graceful-shutdown-timeout", "--request-body-timeout"])
def test_serve_refuses_a_timeout_that_is_not_finite(flag):
    """NaN passed the server's range checks (every comparison with it is false)."""
    p = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "serve", *TINY, flag, "nan"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and f"argument {flag}: must be a finite" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("given, runs", [("half", "float16"), ("float", "float32")])
def test_sglangs_dtype_spellings_are_taken(given, runs):
    """`--dtype half` / `--dtype float` (SGLang's and vLLM's names) run float16 / float32, and
    the resolver says why; an unknown dtype is refused naming the accepted ones."""
    from specserve.config import EngineConfig

    cfg = EngineConfig.from_kwargs(model_path="tiny", load_format="dummy", dtype=given).resolve()
    assert cfg.dtype == runs
    assert any(f == "dtype" and given in reason for f, _, reason in cfg.decisions)
    with pytest.raises(ValueError, match="half, float"):
        EngineConfig.from_kwargs(model_path="tiny", load_format="dummy", dtype="fp4").resolve()


def test_engine_flags_show_a_default_of_zero_and_list_load_formats_plainly(capsys):
    """A default of 0 was left out of the help (`0 in (None, False)` is true), and the load
    format's error printed a Python tuple."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "own seed. (default: 0)" in help_text
    argv = ["generate", "--model-path", "tiny", "--load-format", "bin", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "load_format: 'bin' is not one of auto, gguf, safetensors, dummy" in err, err
