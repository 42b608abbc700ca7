"""A fresh head for a target (optionally started from one of its layers, fc scaled to its
inputs) and the reduced vocabularies an EAGLE3 head drafts from or an EAGLE loss ranks over."""

from __future__ import annotations

import torch

from specserve.speculative.draft_heads import Eagle3Head, EagleHead
from specserve.train.sequences import SeqData


def make_head(
    target,
    seed: int,
    init_layer: int | None = None,
    kind: str = "eagle",
    draft_ids: torch.Tensor | None = None,
    num_layers: int = 1,
):
    """A fresh head for `target`. kind 'eagle': EagleHead of `num_layers` decoder layers
    (target's embedding and lm_head shared); 'eagle3': Eagle3Head (one layer) over the sorted
    target ids `draft_ids` (default: the whole vocabulary), its lm_head rows and final norm
    starting as the target's. init_layer: copy that target layer into the head's first."""
    if num_layers < 1 or (kind == "eagle3" and num_layers != 1):
        raise ValueError(
            f"draft_layers must be >= 1 for an EAGLE head and 1 for an EAGLE3 head, got {num_layers}"
        )
    cfg = target.config.with_changes(
        num_layers=num_layers, tie_word_embeddings=False, attention_bias=False, qk_norm=False
    )
    torch.manual_seed(seed)
    if kind == "eagle3":
        vocab = target.config.vocab_size
        ids = torch.arange(vocab) if draft_ids is None else draft_ids.cpu().long()
        head = Eagle3Head(cfg, len(ids), target.model.embed_tokens)
        with torch.no_grad():
            head.d2t.copy_(ids - torch.arange(len(ids)))
            w = target.lm_head_weight
            head.lm_head.weight.copy_(w[ids.to(w.device)].to(head.lm_head.weight))
            head.norm.weight.copy_(target.model.norm.weight.to(head.norm.weight))
        return head
    if kind != "eagle":
        raise ValueError(f"head must be 'eagle' or 'eagle3', got {kind!r}")
    head = EagleHead(cfg, target.model.embed_tokens, target.lm_head_weight, fc_bias=True)
    if init_layer is not None:
        src = target.model.layers[init_layer].state_dict()
        dst = head.layers[0].state_dict()
        head.layers[0].load_state_dict(
            {k: src[k].to(v.dtype) for k, v in dst.items() if k in src}, strict=False
        )
    return head


@torch.no_grad()
def scale_fc_init_(head, data: SeqData, sample: int = 65536) -> None:
    """Divide fc's weight columns by the RMS of their inputs. EAGLE: token embeddings and
    feature dimensions (the embedding is ~15x smaller than the feature, whose dimensions range
    1x..20x; at the default init fc would all but ignore the token the draft must condition
    on). EAGLE3: the three layers' residual streams, whose scales differ by orders of
    magnitude. An initialization only; the architecture is unchanged."""
    n = min(sample, data.features.shape[0])
    dev = head.fc.weight.device
    f_rms = data.features[:n].to(dev).float().pow(2).mean(0).sqrt().clamp(min=1e-3)
    if isinstance(head, Eagle3Head):
        head.fc.weight /= f_rms.to(head.fc.weight)
        return
    emb = head._embed[0](data.ids[:n].long().to(dev)).float()
    e_rms = emb.pow(2).mean(0).sqrt().clamp(min=1e-3)
    hsz = head.config.hidden_size
    head.fc.weight[:, :hsz] /= e_rms.to(head.fc.weight)
    head.fc.weight[:, hsz:] /= f_rms.to(head.fc.weight)


def ce_vocabulary(data: SeqData, size: int, vocab_size: int | None = None) -> torch.Tensor:
    """`size` sorted token ids ranked by (k + 1) * (times the target's likeliest next token) +
    (times among its other k candidates), over every recorded position: top-1 occurrences
    dominate, candidates break ties and rank the rest. With `vocab_size`, padded with unseen
    ids (in id order) to exactly `size`."""
    top = data.top_ids.long()
    n = vocab_size or int(top.max()) + 1
    counts = torch.bincount(top[:, 0], minlength=n) * top.shape[1]
    counts += torch.bincount(top.reshape(-1), minlength=n)
    counts = counts.cpu()
    order = torch.sort(counts, descending=True, stable=True).indices
    keep = order[:size] if vocab_size else order[:size][counts[order[:size]] > 0]
    return keep.sort().values


def vocab_lookup(ids: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[vocab_size] int64: the index of every target id in `ids`, -1 outside."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
    lookup[ids.to(device)] = torch.arange(len(ids), device=device)
    return lookup
