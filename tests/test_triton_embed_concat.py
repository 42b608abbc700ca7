"""The draft input rows [embedding; feature] in one kernel, against torch's gather + concat."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the kernel needs the triton package")

from specserve.ops.triton_embed_concat import embed_concat, embed_concat_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "vocab,hidden,feat_dim,tokens,dtype,feat_dtype,id_dtype",
    [
        (1000, 576, 576, 8, torch.bfloat16, torch.bfloat16, torch.int64),  # SmolLM2's draft
        (50, 96, 288, 9, torch.float16, torch.float32, torch.int32),  # EAGLE3-wide, cast
        (7, 16, 16, 1, torch.float32, torch.float32, torch.int64),
        (300, 40, 24, 0, torch.bfloat16, torch.bfloat16, torch.int64),  # no tokens
    ],
)
def test_kernel_matches_gather_and_concat(vocab, hidden, feat_dim, tokens, dtype, feat_dtype,
                                          id_dtype):  # fmt: skip
    g = torch.Generator().manual_seed(vocab + hidden + tokens)
    table = torch.randn(vocab + 5, hidden + 3, generator=g).to(dtype)[:vocab, :hidden]  # strided
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(id_dtype)
    feats = torch.randn(tokens, feat_dim, generator=g).to(feat_dtype)
    want = embed_concat_reference(table, ids, feats)
    got = embed_concat(table.to(DEVICE), ids.to(DEVICE), feats.to(DEVICE))
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


class _FcInput(Exception):
    """Raised by a pre-hook on fc: carries the head's fc input, ends the forward there."""


def test_eagle_head_builds_the_same_fc_input_with_the_kernel():
    """With fused norms chosen, the EAGLE head builds its fc input with the kernel (the
    interpreter on CPU): the same rows as the torch gather + concat."""
    from types import SimpleNamespace

    from specserve.config import Kernels
    from specserve.model.config import PRESETS
    from specserve.speculative.draft_heads import EagleHead

    cfg = PRESETS["tiny"].with_changes(num_layers=1)
    torch.manual_seed(0)
    dtype = torch.half if DEVICE.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(DEVICE, dtype)
    head = EagleHead(cfg, embed, embed.weight).to(DEVICE, dtype)

    def stop(_module, args):
        raise _FcInput(args[0])

    head.fc.register_forward_pre_hook(stop)
    ids = torch.randint(0, cfg.vocab_size, (5,), device=DEVICE)
    feats = torch.randn(5, cfg.hidden_size, device=DEVICE, dtype=dtype)
    ctx = SimpleNamespace(kernels=Kernels(fused_norms=True))  # the head reads only the kernels
    calls = []
    from specserve.ops import triton_embed_concat

    real = triton_embed_concat.embed_concat

    def counted(*args):
        calls.append(1)
        return real(*args)

    triton_embed_concat.embed_concat = counted
    try:
        with torch.inference_mode(), pytest.raises(_FcInput) as seen:
            head(ids, feats, torch.arange(5, device=DEVICE), ctx)
    finally:
        triton_embed_concat.embed_concat = real
    assert calls, "the kernel path was not taken"
    assert torch.equal(seen.value.args[0], embed_concat_reference(embed.weight, ids, feats))
