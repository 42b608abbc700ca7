"""A dataset folder's sequences held on the training device, cut into length-grouped batches,
and the held-back split by prompt."""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

from specserve.device import to_device


class SeqData:
    """The sequences of a dataset folder as flat tensors on `device` (a GPU keeps all of it:
    batches are gathered there, never copied from the host) plus host-side metadata.

    Training position p of a sequence feeds token x_{p+1} and feature h_p; its targets are
    h_{p+1} and the target's next-token candidates at p + 1. Positions with a loss are the
    ones the drafter uses when serving: p from prompt_len - 1 (the root after prefill is the
    first answer token) to the position predicting the last token (the final EOS, or for a
    cut answer the token after the cut)."""

    def __init__(self, shards: list[dict], max_len: int, device="cpu", feature: str = "hidden"):
        """feature: 'hidden' (EAGLE: the final normed hidden state) or 'aux' (EAGLE3: the
        residual streams of three target layers, recorded with `DataArgs.eagle3`)."""
        self.device = torch.device(device)
        ids, features, top_ids, top_probs = [], [], [], []
        starts, lens, pls, ended, groups, fulls = [], [], [], [], [], []
        base = 0
        for sh in shards:
            offs = sh["offsets"].numpy()
            host_ids = sh["input_ids"].cpu().numpy()
            pl_sh = sh["prompt_lens"].numpy()
            # a sequence's group is its prompt: passes over one prompt share it
            groups.append(
                np.array(
                    [zlib.crc32(host_ids[o : o + p_].tobytes()) for o, p_ in zip(offs[:-1], pl_sh)],
                    dtype=np.int64,
                )
            )
            full = offs[1:] - offs[:-1]
            fulls.append(full)
            n = np.minimum(full, max_len)
            starts.append(offs[:-1] + base)
            lens.append(n)
            pls.append(sh["prompt_lens"].numpy().astype(np.int64))
            ended.append(sh["ended"].numpy() & (full <= max_len))
            base += int(offs[-1])
            ids.append(sh["input_ids"].to(self.device))
            if feature not in sh:
                raise ValueError(
                    f"the dataset has no {feature!r} features"
                    + (" (generate it with --eagle3-features)" if feature == "aux" else "")
                )
            features.append(sh[feature].to(self.device))
            top_ids.append(sh["top_ids"].to(self.device))
            top_probs.append(sh["top_probs"].to(self.device))
        self.ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
        self.features = torch.cat(features) if features else torch.zeros(0, 1)
        if not bool(torch.isfinite(self.features).all()):  # e.g. float16 storage overflowed
            raise ValueError(f"the dataset's {feature!r} features hold inf or nan values")
        self.top_ids = torch.cat(top_ids) if top_ids else torch.zeros(0, 1, dtype=torch.int32)
        self.top_probs = torch.cat(top_probs) if top_probs else torch.zeros(0, 1)
        cat = (lambda xs: np.concatenate(xs)) if shards else (lambda xs: np.zeros(0, np.int64))
        start, n, pl, en = cat(starts), cat(lens), cat(pls), cat(ended).astype(bool)
        group = cat(groups)
        lo = pl - 1
        hi = np.where(en, n - 2, n - 1)
        keep = hi > lo  # at least one position with a loss
        # (those with one were it not for max_len: `max_len` cut the others' answers away)
        full = cat(fulls)
        whole_ended = cat([sh["ended"].numpy() for sh in shards]).astype(bool)
        self.num_with_answer = int((np.where(whole_ended, full - 2, full - 1) > lo).sum())
        self.start, self.n, self.lo, self.hi = start[keep], n[keep], lo[keep], hi[keep]
        self.group = group[keep]
        self.num_loss_positions = int((self.hi - self.lo).sum())

    def __len__(self) -> int:
        return len(self.start)

    def batch(self, idx, ttt_steps: int = 0) -> dict:
        """Right-padded [B, N] tensors gathered on the device, and for every unrolled step k
        the flat indices (b * (N - 1) + p) of the positions with a loss (p >= k)."""
        idx = np.asarray(idx)
        st, n, lo, hi = self.start[idx], self.n[idx], self.lo[idx], self.hi[idx]
        width = int(n.max())
        t = width - 1
        pos = np.arange(width)
        gather = st[:, None] + np.minimum(pos[None, :], n[:, None] - 1)  # padding repeats
        cnt = hi - lo
        p = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        rows = np.repeat(np.arange(len(idx)), cnt) * t + p
        g = _to_device(gather, self.device)
        rows_d = [_to_device(rows, self.device)]
        for k in range(1, ttt_steps + 1):
            ok = p >= k
            rows_d.append(rows_d[0] if ok.all() else _to_device(rows[ok], self.device))
        return {
            "ids": self.ids[g].long(),
            "features": self.features[g],
            "top_ids": self.top_ids[g].long(),
            "top_probs": self.top_probs[g],
            "rows": rows_d,
            "tokens": int(len(idx) * width),
        }

    def batches(
        self, indices, seed: int, batch_size: int = 4, batch_tokens: int = 0
    ) -> list[np.ndarray]:
        """Shuffled batches of similar lengths (sorted within windows of many batches): of
        `batch_size` sequences, or with `batch_tokens` of at most that many padded tokens."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(np.asarray(indices, dtype=np.int64))
        out: list[np.ndarray] = []
        if batch_tokens <= 0:
            window = batch_size * 32
            for i in range(0, len(order), window):
                chunk = order[i : i + window]
                chunk = chunk[np.argsort(self.n[chunk], kind="stable")]
                out += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
        else:
            mean = max(1.0, float(self.n.mean())) if len(self.n) else 1.0
            window = max(64, int(32 * batch_tokens / mean))
            for i in range(0, len(order), window):
                chunk = order[i : i + window]
                chunk = chunk[np.argsort(self.n[chunk], kind="stable")]
                cur: list[int] = []
                for j in chunk.tolist():  # ascending lengths: the newest sets the width
                    if cur and (len(cur) + 1) * int(self.n[j]) > batch_tokens:
                        out.append(np.asarray(cur))
                        cur = []
                    cur.append(j)
                if cur:
                    out.append(np.asarray(cur))
        perm = rng.permutation(len(out))
        return [out[i] for i in perm]


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)


def split_by_prompt(data: SeqData, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-back, training) sequence indices; every answer to a held-back prompt is held
    back, so held-back accuracy measures prompts never trained on."""
    prompts = sorted(set(data.group.tolist()))
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: int(len(prompts) * fraction)])
    is_val = np.fromiter((g in held for g in data.group.tolist()), dtype=bool, count=len(data))
    return np.nonzero(is_val)[0], np.nonzero(~is_val)[0]
