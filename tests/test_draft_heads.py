"""Serving-time rewrites of the EAGLE head compute what the trained head computes."""

from __future__ import annotations

import pytest
import torch

from specserve.kv.pool import KVCache
from specserve.model.config import PRESETS
from specserve.ops.attention import ForwardContext, TorchAttentionBackend
from specserve.runtime.forward_batch import Segment, build_metadata
from specserve.spec.draft_heads import EagleHead


@pytest.mark.parametrize("fc_bias, qkv_bias", [(True, False), (False, True), (False, False)])
def test_fused_fc_and_qkv_gives_the_same_draft_states_and_kv(fc_bias, qkv_bias):
    cfg = PRESETS["tiny"].with_changes(num_layers=2, attention_bias=qkv_bias)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = EagleHead(cfg, embed, embed.weight, fc_bias=fc_bias).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    n = 7
    ids = torch.randint(0, cfg.vocab_size, (n,))
    feats = torch.randn(n, cfg.hidden_size)
    slots = torch.arange(n)
    meta = build_metadata([Segment(slots, n, n)], slots, torch.device("cpu"))

    def run():
        cache = KVCache(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        with torch.inference_mode():
            g = head(
                ids, feats, torch.arange(n), ForwardContext(TorchAttentionBackend(), cache, meta)
            )
        return g, cache.layer(0)[0].clone()

    g_ref, k_ref = run()
    head.fuse_fc_and_qkv()
    assert head._fc_qkv is not None
    g, k = run()
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
