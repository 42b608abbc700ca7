"""Simulated acceptance: force a chosen acceptance length to benchmark the system without a
good draft (SGLang's SIMULATE_ACC_LEN), keeping tokens and KV cache consistent for trees.

Accept length counts the bonus token: 1 means every draft token was rejected. A length is
drawn per request and step, on the device:
- multinomial:    round(Normal(mean, std)), clipped to [1, num_steps + 1];
- match-expected: floor(mean) or ceil(mean), weighted so the expected value is exactly mean;
- per-position:   depth d is accepted with probability rates[d-1] given depth d-1 was.
Token modes:
- real-draft-token (default): the accepted path is a real root-to-node path of the draft
  tree: the highest-scoring node at depth (length - 1), or at the tree's deepest level when
  it is shallower; the bonus token is the target's own token at the path's last node. The
  kept KV is the KV the verify pass computed for exactly those tokens, so a plain prefill of
  the output reproduces the cache.
- fixed: every emitted token is `simulate_acc_fixed_token` (SGLang's old behaviour: fast,
  but the KV cache then holds draft tokens the output does not show).
"""

from __future__ import annotations

import math

import torch

from specserve.errors import InvalidArgument
from specserve.ops.sampling import uniform_noise
from specserve.speculative.tree import Acceptance, DraftTrees, acceptance_of_path


class SimulatedAcceptance:
    def __init__(
        self,
        mean: float,
        method: str,
        token_mode: str,
        num_steps: int,
        rates: list[float] | None,
        fixed_token: int | None,
        device: torch.device,
        seed: int = 0,
        std: float = 1.0,
    ):
        self.mean, self.method, self.token_mode = mean, method, token_mode
        self.max_len = num_steps + 1
        self.rates = torch.tensor(rates or [], dtype=torch.float32, device=device)
        self.fixed_token = fixed_token
        self.std = std
        # Counter-based randomness (like sampling's): draw i depends only on (seed, i), and
        # the counter lives on the device, so a replayed CUDA graph draws fresh lengths.
        self.seed = torch.tensor([seed], dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.device = device

    def _uniform(self, n: int) -> torch.Tensor:
        """n fresh uniforms in (0, 1), advancing the device-side counter."""
        self.counter += 1
        return uniform_noise(self.seed, self.counter, n)[0]

    def draw(self, bsz: int) -> torch.Tensor:
        """[B] int64 accept lengths in [1, num_steps + 1]."""
        if self.method == "match-expected":
            lo = math.floor(self.mean)
            frac = self.mean - lo
            lengths = lo + (self._uniform(bsz) < frac).long()
        elif self.method == "multinomial":
            # Box-Muller, two uniforms per row (row i's draw does not depend on the batch size)
            u = self._uniform(2 * bsz).view(bsz, 2)
            normal = torch.sqrt(-2.0 * torch.log(u[:, 0])) * torch.cos(2 * math.pi * u[:, 1])
            lengths = torch.round(self.mean + normal * self.std).long()
        else:
            u = self._uniform(bsz * len(self.rates)).view(bsz, len(self.rates))
            ok = (u < self.rates[None, :]).long()
            lengths = 1 + torch.cumprod(ok, dim=1).sum(dim=1)
        return lengths.clamp(1, self.max_len)

    def accept(
        self, trees: DraftTrees, target_tokens: torch.Tensor, anc: torch.Tensor
    ) -> Acceptance:
        """anc: the [B, N, N] ancestor-or-self mask of the trees (already built for verify)."""
        bsz, n = trees.tokens.shape
        want_depth = self.draw(bsz) - 1
        deepest = trees.depths.max(dim=1).values
        depth = torch.minimum(want_depth, deepest)
        scores = (
            trees.scores
            if trees.scores is not None
            else torch.zeros(bsz, n, dtype=torch.float64, device=self.device)
        )
        at_depth = trees.depths == depth[:, None]
        chosen = torch.where(at_depth, scores.double(), float("-inf")).argmax(dim=1)
        on_path = torch.gather(anc, 1, chosen[:, None, None].expand(bsz, 1, n)).squeeze(1)
        acc = acceptance_of_path(trees, on_path, target_tokens)
        if self.token_mode == "fixed":
            acc.emitted = torch.full_like(acc.emitted, self.fixed_token)
            acc.bonus = torch.full_like(acc.bonus, self.fixed_token)
        return acc


def build_simulator(cfg, tokenizer, vocab_size: int, device: torch.device):
    """The configuration's simulated acceptance (None when simulate_acc_len is unset)."""
    if cfg.simulate_acc_len is None:
        return None
    from specserve.config.speculative import parse_rates

    fixed = cfg.simulate_acc_fixed_token
    if cfg.simulate_acc_token_mode == "fixed":
        fixed = _default_fixed_token(tokenizer, vocab_size) if fixed is None else fixed
        if not 0 <= fixed < vocab_size:
            raise InvalidArgument(
                "simulate_acc_fixed_token", f"must be a token id in [0, {vocab_size})"
            )
    rates = (
        parse_rates(cfg.simulate_acc_rates) if cfg.simulate_acc_method == "per-position" else None
    )
    return SimulatedAcceptance(
        cfg.simulate_acc_len,
        cfg.simulate_acc_method,
        cfg.simulate_acc_token_mode,
        cfg.speculative_num_steps,
        rates,
        fixed,
        device,
        cfg.random_seed,
    )


def _default_fixed_token(tokenizer, vocab_size: int) -> int:
    """A token that decodes to a plain word, so fixed-mode streams stay readable."""
    if tokenizer is not None:
        ids = tokenizer.encode(" the", add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
    return min(100, vocab_size - 1)
