"""`specserve train-eagle` refuses what would waste a run or damage files, naming the flag:
an --out that is the target or another model, a prompt file it cannot read, a folder it cannot
write, losses that train nothing, a diverging run (no draft written), data of another target."""

from __future__ import annotations

import hashlib
import json
import os
from argparse import Namespace

import pytest

from specserve import cli
from specserve.errors import InvalidArgument
from specserve.train.arg_checks import check_target
from specserve.train.checkpoint import TRAINING_ARGS, save_draft
from specserve.train.data import DataArgs, build_dataset, fitting_prompts, load_target
from specserve.train.head_init import make_head
from specserve.train.train_args import TrainArgs
from specserve.train.trainer import train
from tests.engine_utils import mixed_prompts
from tests.model_factory import write_hf_model

VOCAB = 96


def _digest(folder) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


def _refused(argv: list[str], capsys, flag: str) -> str:
    capsys.readouterr()  # (what writing the test's models printed)
    assert cli.main(["train-eagle", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}:") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """(target folder, dataset folder): 64 greedy answers of 12 tokens to prompts of 4-12."""
    root = tmp_path_factory.mktemp("train_refusals")
    target = write_hf_model(root / "target", vocab_size=VOCAB, seed=3)
    data = str(root / "data")
    args = DataArgs(
        target=target, out_dir=data, max_new_tokens=12, gen_dtype="float32", batch_size=64
    )
    build_dataset(args, prompt_ids=mixed_prompts(64, VOCAB, seed=2, min_len=4, max_len=12))
    return target, data


def test_out_that_is_the_target_or_another_model_is_refused_and_left_intact(tmp_path, capsys):
    target = write_hf_model(tmp_path / "target", vocab_size=VOCAB, with_tokenizer=True)
    before = _digest(target)
    for out in (target, target + "/", str(tmp_path / "target" / ".." / "target")):
        err = _refused(["--target", target, "--out", out], capsys, "--out")
        assert "target's folder" in err
    other = write_hf_model(tmp_path / "other", vocab_size=VOCAB)
    err = _refused(["--target", target, "--out", other], capsys, "--out")
    assert "LlamaForCausalLM" in err and "not a draft" in err
    assert _digest(target) == before
    assert not os.path.exists(target + ".work") and not os.path.exists(other + ".work")


@pytest.mark.parametrize(
    "content,said",
    [
        ("", "holds no prompt"),
        ('{"prompt": "hi"}\nnot json\n', "line 2 is not JSON"),
        ('{"text": "hi"}\n', 'line 1 is not an object with a "prompt" string'),
        ('[{"prompt": "a"}]\n', "line 1 is not an object"),
        ('{"prompt": 5}\n', "line 1 is not an object"),
    ],
)
def test_a_prompt_file_it_cannot_read_is_refused_before_anything_runs(
    tmp_path, capsys, content, said
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = str(tmp_path / "draft")
    err = _refused(["--out", out, "--prompts", str(prompts)], capsys, "--prompts")
    assert said in err
    assert not os.path.exists(out + ".work")


def test_an_out_folder_it_cannot_create_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = str(tmp_path / "a_file" / "draft")
    err = _refused(["--out", out], capsys, "--out")
    assert "is a file" in err
    err = _refused(["--out", str(tmp_path / "d"), "--work-dir", out], capsys, "--work-dir")
    assert not os.path.exists(tmp_path / "d.work")


def test_a_missing_target_leaves_no_work_folder(tmp_path, capsys):
    out = str(tmp_path / "draft")
    _refused(["--out", out, "--target", str(tmp_path / "missing")], capsys, "--target")
    assert not os.path.exists(out + ".work")


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--feature-weight", "0", "--token-weight", "0"], "--token-weight"),
        (["--head", "eagle3", "--token-weight", "0"], "--token-weight"),
        (["--generator", "engine:2", "--engine-arg", "tp_size=2"], "--generator"),
        (["--generator", "engine,dense", "--engine-arg", "tp_size=2"], "--generator"),
    ],
)
def test_settings_that_cannot_work_are_refused(tmp_path, capsys, flags, named):
    _refused(["--out", str(tmp_path / "d"), *flags], capsys, named)
    assert not os.path.exists(tmp_path / "d.work")


def _train(target, data, out, **overrides):
    args = TrainArgs(
        **{"epochs": 2, "batch_tokens": 512, "ttt_steps": 1, "log_every": 1, **overrides}
    )
    model = load_target(target, "float32", "cpu").model
    return train(model, data, out, args, log=lambda _m: None)


def test_a_diverging_run_stops_naming_the_learning_rate_and_writes_no_draft(tiny_data, tmp_path):
    target, data = tiny_data
    out = str(tmp_path / "draft")
    with pytest.raises(InvalidArgument) as info:
        _train(target, data, out, lr=1e30, grad_clip=1e30)
    assert info.value.field == "--lr" and "diverged" in str(info.value)
    assert not os.path.exists(os.path.join(out, "model.safetensors"))


def test_a_max_len_within_every_prompt_is_refused_naming_it(tiny_data, tmp_path):
    target, data = tiny_data
    with pytest.raises(InvalidArgument) as info:
        _train(target, data, str(tmp_path / "draft"), max_len=3)
    assert info.value.field == "--max-len" and "raise --max-len" in str(info.value)
    assert not os.path.exists(tmp_path / "draft")
    summary = _train(target, data, str(tmp_path / "draft"), epochs=1)  # the same data trains
    assert summary["steps"] >= 1


def test_data_of_a_target_of_another_shape_is_refused(tiny_data, tmp_path):
    target, data = tiny_data
    other = write_hf_model(tmp_path / "other", vocab_size=VOCAB + 32)
    args = Namespace(target=other, load_format="auto", init_layer=None)
    with pytest.raises(InvalidArgument) as info:
        check_target(args, generates=False, data_dir=data)
    assert info.value.field == "--data-dir" and str(VOCAB) in str(info.value)
    check_target(Namespace(target=target, load_format="auto"), generates=False, data_dir=data)


def test_a_draft_written_over_an_earlier_run_drops_that_runs_summary(tmp_path):
    """Until this run ends and writes its own, no summary describes the new weights wrongly."""
    out = tmp_path / "draft"
    out.mkdir()
    (out / TRAINING_ARGS).write_text(json.dumps({"steps": 2}))
    target = load_target("tiny", "float32", "cpu", load_format="dummy").model
    save_draft(str(out), make_head(target, seed=0))
    assert not (out / TRAINING_ARGS).exists() and (out / "model.safetensors").exists()


def test_prompts_whose_answer_would_not_fit_the_context_are_left_out():
    config = Namespace(max_position_embeddings=32)
    args = DataArgs(max_new_tokens=8)
    prompts = [[1] * 10, [1] * 24, [1] * 25, [1] * 40]
    assert fitting_prompts(prompts, config, args) == prompts[:2]
    with pytest.raises(InvalidArgument) as info:
        fitting_prompts([[1] * 30], config, args)
    assert info.value.field == "--prompts" and "32" in str(info.value)


def test_the_default_work_folder_and_a_dangling_link_are_checked_like_given_folders(
    tmp_path, capsys
):
    (tmp_path / "a_file.work").write_text("")  # where the default work folder would go
    err = _refused(["--out", str(tmp_path / "a_file")], capsys, "--work-dir")
    assert "a_file.work is a file" in err
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    err = _refused(["--out", str(tmp_path / "link")], capsys, "--out")
    assert "link to nothing" in err


def test_eagle3_zero_token_weight_is_refused_without_pointing_at_the_feature_loss(tmp_path, capsys):
    argv = ["--out", str(tmp_path / "d"), "--head", "eagle3", "--token-weight", "0"]
    err = _refused(argv, capsys, "--token-weight")
    assert "--feature-weight" not in err


def test_an_answer_length_the_context_cannot_hold_is_refused_naming_it(tmp_path, capsys):
    target = write_hf_model(tmp_path / "t", vocab_size=VOCAB, with_tokenizer=True)
    context = json.load(open(os.path.join(target, "config.json")))["max_position_embeddings"]
    argv = ["--target", target, "--out", str(tmp_path / "d"), "--max-new-tokens", str(context)]
    assert str(context) in _refused(argv, capsys, "--max-new-tokens")
    assert not os.path.exists(tmp_path / "d.work")
