"""What training writes: the draft in the published layout (rewritten at every checkpoint), the
resumable state `checkpoint.pt`, the training curves and the run's summary."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from specserve.errors import InvalidArgument
from specserve.speculative.draft_heads import Eagle3Head, EagleHead
from specserve.speculative.eagle_checkpoint import hf_style_config, save_eagle_checkpoint
from specserve.train.train_args import TrainArgs

ARCHITECTURE = "LlamaForCausalLMEagle"
ARCHITECTURE_EAGLE3 = "LlamaForCausalLMEagle3"
TRAINING_ARGS = "training_args.json"  # the run's summary, beside the draft it describes
# A resumed run must build the same head as the checkpoint's, and see the same split and batch
# order: its position is an index into the epoch's batches, and another held-back set would
# score the draft on sequences it trained on. (setting: its flag)
_SAME_ON_RESUME = {
    "head": "--head",
    "draft_vocab": "--draft-vocab",
    "draft_layers": "--draft-layers",
    "seed": "--seed",
    "val_fraction": "--val-fraction",
    "max_len": "--max-len",
    "batch_size": "--batch-size",
    "batch_tokens": "--batch-tokens",
}


def save_state(path: str, head, opt, args: TrainArgs, progress: dict) -> None:
    """The head, the optimizer and `progress` (step, epoch, in_epoch, total_steps, history,
    evals, elapsed), replaced whole: an interrupted write leaves the previous state."""
    tmp = path + ".tmp"
    state = {"head": head.state_dict(), "optimizer": opt.state_dict(), **progress}
    torch.save({**state, "args": asdict(args)}, tmp)
    os.replace(tmp, path)


def load_state(path: str, args: TrainArgs, device) -> dict:
    """The state saved by `save_state`, after checking that it was trained with this head,
    split and batch layout (InvalidArgument naming the flag that differs)."""
    state = torch.load(path, weights_only=False, map_location=device)
    saved = state.get("args", {})
    for key, flag in _SAME_ON_RESUME.items():
        # an EAGLE head has no draft vocabulary of its own: only EAGLE3 checks it
        if key == "draft_vocab" and args.head != "eagle3":
            continue
        if key in saved and saved[key] != getattr(args, key):
            raise InvalidArgument(
                flag,
                f"{path} was trained with {key}={saved[key]!r}, not {getattr(args, key)!r}: "
                "resume with the same value or another --work-dir",
            )
    return state


def write_curve(path: str, final: bool, history: list, evals: list) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"final": final, "history": history, "evals": evals}, f)
    os.replace(path + ".tmp", path)


def save_draft(folder: str, head, capture_layers: list[int] | None = None) -> None:
    """The head in the published layout, float16, without the shared embedding (and for EAGLE
    the shared lm_head). EAGLE3: `capture_layers` (the target layers whose input residual
    stream the features are) go to config.json as the published ids (the layer before)."""
    if isinstance(head, Eagle3Head):
        out = Eagle3Head(head.config, head.lm_head.out_features, head._embed[0])
        arch = ARCHITECTURE_EAGLE3
        extra = {"draft_vocab_size": head.lm_head.out_features}
        if capture_layers:
            ids = [int(i) - 1 for i in capture_layers]
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    else:
        out = EagleHead(
            head.config, head._embed[0], head._lm_head[0], fc_bias=head.fc.bias is not None
        )
        arch, extra = ARCHITECTURE, None
    out.load_state_dict(head.state_dict())
    out = out.half()
    cfg = hf_style_config(head.config, arch, torch_dtype="float16")
    tmp = folder.rstrip("/") + ".tmp"
    save_eagle_checkpoint(tmp, out.cpu(), cfg, extra)
    os.makedirs(folder, exist_ok=True)
    # an earlier run's summary describes other weights (a run writes its own once it ends)
    stale = os.path.join(folder, TRAINING_ARGS)
    if os.path.isfile(stale):
        os.remove(stale)
    for name in os.listdir(tmp):  # each file replaced whole: a reader never sees a torn one
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    os.rmdir(tmp)


def write_training_args(out_dir: str, summary: dict) -> None:
    with open(os.path.join(out_dir, TRAINING_ARGS), "w") as f:
        json.dump(summary, f, indent=2)
