"""Dense batched passes of a target model for training data: a plain causal forward that
records what a draft head learns from, and a KV-cached batched generator.

Both run the target's own modules (`LlamaForCausalLM` from `specserve.model.llama`) over
padded [B, N] batches with `F.scaled_dot_product_attention`, bypassing the paged runtime: the
arithmetic per layer is the model's (qkv_proj, optional q/k norm, rotary, o_proj, MLP, norms),
only the attention kernel and the batch layout differ.

- `forward_features(model, seqs)`: the final normed hidden state of every position
  (`ModelOutput.hidden`, EAGLE's feature), optionally the residual stream entering
  `capture_layers` (EAGLE3), and the target's top-k next-token ids and probabilities.
- `generate_dense(model, prompts, ...)`: greedy or temperature sampling, left-padded prompts,
  a dense KV cache, finished rows dropped as they finish. Much faster on a CPU than the
  paged engine (no slot gathers); `specserve.train.data` can use either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _split_heads(attn, x: torch.Tensor, positions: torch.Tensor):
    """q [B, heads, N, d], k/v [B, kv_heads, N, d] for x [B, N, H] at positions [B, N]."""
    b, n, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(b * n, attn.num_heads, attn.head_dim)
    k = k.reshape(b * n, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(b, n, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rotary(positions.reshape(-1), q, k)
    q = q.view(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return q, k, v.transpose(1, 2)


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _attend(attn, q, k, v, mask=None, is_causal=False) -> torch.Tensor:
    """SDPA over [B, heads, N, d] / [B, kv_heads, M, d]; returns o_proj(out) [B, N, H]."""
    group = attn.num_heads // attn.num_kv_heads
    b, _, n, d = q.shape
    if n == 1 and group > 1 and not is_causal:
        # one query per sequence: the heads sharing a K/V head become its query rows (mask
        # [B, 1, 1, M] is the same for all of them), so the cache is never copied per head
        out = F.scaled_dot_product_attention(
            q.view(b, attn.num_kv_heads, group, d), k, v, attn_mask=mask
        )
        return attn.o_proj(out.reshape(b, 1, attn.q_size))
    out = F.scaled_dot_product_attention(
        q, _expand_kv(k, group), _expand_kv(v, group), attn_mask=mask, is_causal=is_causal
    )
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, attn.q_size))


@dataclass
class Features:
    hidden: torch.Tensor  # [B, N, H] final normed hidden (what lm_head reads)
    aux: torch.Tensor | None  # [B, N, len(capture_layers) * H] residual entering those layers
    top_ids: torch.Tensor | None  # [B, N, k] target's likeliest next tokens
    top_probs: torch.Tensor | None  # [B, N, k] their probabilities


@torch.inference_mode()
def forward_padded(
    model,
    input_ids: torch.Tensor,
    capture_layers: tuple[int, ...] = (),
    topk: int = 0,
) -> Features:
    """Plain causal forward of right-padded sequences [B, N] (padding only ever sees itself
    and earlier tokens, so real positions are exact)."""
    b, n = input_ids.shape
    positions = torch.arange(n, device=input_ids.device).expand(b, n)
    h = model.model.embed_tokens(input_ids)
    aux = []
    for i, layer in enumerate(model.model.layers):
        if i in capture_layers:  # a layer named twice is captured twice, as in the engine
            aux.extend(h for c in capture_layers if c == i)
        q, k, v = _split_heads(layer.self_attn, layer.input_layernorm(h), positions)
        h = h + _attend(layer.self_attn, q, k, v, is_causal=True)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    hidden = model.model.norm(h)
    top_ids = top_probs = None
    if topk:
        # in the model's dtype: a float32 copy of [B, N, vocab] logits costs more than the
        # forward on a CPU
        logits = F.linear(hidden, model.lm_head_weight)
        top_logits, top_ids = logits.topk(topk, dim=-1)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        top_probs = torch.exp(top_logits.float() - lse.float())
    return Features(hidden, torch.cat(aux, dim=-1) if aux else None, top_ids, top_probs)


def length_batches(lengths: list[int], max_tokens: int, max_batch: int = 256) -> list[list[int]]:
    """Indices grouped so that each padded batch holds at most `max_tokens` tokens
    (sorted by length, longest first; a sequence longer than the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * width > max_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def forward_features(
    model,
    seqs: list[list[int]],
    capture_layers: tuple[int, ...] = (),
    topk: int = 4,
    max_tokens: int = 8192,
    progress=None,
) -> Iterator[tuple[int, Features]]:
    """Yield (sequence index, Features of that one sequence, unpadded) for every sequence,
    computed in padded batches of at most `max_tokens` tokens."""
    device = next(model.parameters()).device
    for idx in length_batches([len(s) for s in seqs], max_tokens):
        width = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.int64)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        f = forward_padded(model, ids.to(device), capture_layers, topk)
        for r, i in enumerate(idx):
            n = len(seqs[i])
            yield (
                i,
                Features(
                    f.hidden[r, :n],
                    None if f.aux is None else f.aux[r, :n],
                    None if f.top_ids is None else f.top_ids[r, :n],
                    None if f.top_probs is None else f.top_probs[r, :n],
                ),
            )
        if progress is not None:
            progress.update(sum(len(seqs[i]) for i in idx))


@torch.inference_mode()
def generate_dense(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    temperature: float = 0.0,
    seed: int = 0,
    deadline: float | None = None,
    compact_fraction: float = 0.25,
) -> list[list[int]]:
    """Continuations of `prompts` (one batch; callers chunk). Each output stops after its first
    EOS id (kept) or at max_new_tokens. temperature 0 is greedy.

    Finished rows stay in the batch (their tokens are ignored) until at least
    `compact_fraction` of it has finished; then the batch and its caches are compacted. Copying
    the caches at every finish would cost more than the decoding on a GPU. `deadline` (a
    `time.time()` value): stop there and return the outputs so far (unfinished ones shorter)."""
    import time

    device = next(model.parameters()).device
    layers = model.model.layers
    b = len(prompts)
    p = max(len(x) for x in prompts)
    total = p + max_new_tokens
    pad = torch.tensor([p - len(x) for x in prompts], device=device)
    ids = torch.zeros(b, p, dtype=torch.int64)
    for r, x in enumerate(prompts):
        ids[r, p - len(x) :] = torch.tensor(x)
    ids = ids.to(device)
    cols = torch.arange(total, device=device)
    key_ok = cols[None, :] >= pad[:, None]  # [B, total]: left padding is never attended
    a0 = layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype
    kc = [torch.zeros(b, a0.num_kv_heads, total, a0.head_dim, dtype=dtype, device=device)]
    kc = [kc[0]] + [torch.zeros_like(kc[0]) for _ in range(len(layers) - 1)]
    vc = [torch.zeros_like(kc[0]) for _ in layers]
    gen = torch.Generator(device=device).manual_seed(seed)

    def step(x, positions, c0, c1, mask):
        h = model.model.embed_tokens(x)
        for li, layer in enumerate(layers):
            q, k, v = _split_heads(layer.self_attn, layer.input_layernorm(h), positions)
            kc[li][:, :, c0:c1] = k
            vc[li][:, :, c0:c1] = v
            h = h + _attend(layer.self_attn, q, kc[li][:, :, :c1], vc[li][:, :, :c1], mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.compute_logits(model.model.norm(h[:, -1]))

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    positions = (torch.arange(p, device=device)[None, :] - pad[:, None]).clamp(min=0)
    causal = cols[None, :p] <= cols[:p, None]
    # a padding query sees itself, so no softmax row is empty
    mask = (causal[None] & key_ok[:, None, :p]) | torch.eye(p, dtype=torch.bool, device=device)
    tok = pick(step(ids, positions, 0, p, mask[:, None]))
    outs: list[list[int]] = [[] for _ in range(b)]
    rows = list(range(b))  # original row of each batch row
    live = [True] * b  # batch row still generating
    last_pos = positions[:, -1]
    for c in range(p, total):
        for j, t in enumerate(tok.tolist()):
            if live[j]:
                r = rows[j]
                outs[r].append(t)
                if t in eos_ids or len(outs[r]) >= max_new_tokens:
                    live[j] = False
        n_live = sum(live)
        if n_live == 0 or c == total - 1 or (deadline is not None and time.time() >= deadline):
            break
        if len(live) - n_live >= max(1, compact_fraction * len(live)):
            keep = torch.tensor(live, device=device)
            rows = [r for r, ok in zip(rows, live) if ok]
            live = [True] * len(rows)
            tok, last_pos, key_ok = tok[keep], last_pos[keep], key_ok[keep]
            for li in range(len(layers)):
                kc[li], vc[li] = kc[li][keep], vc[li][keep]
        last_pos = last_pos + 1
        tok = pick(step(tok[:, None], last_pos[:, None], c, c + 1, key_ok[:, None, None, : c + 1]))
    return outs
