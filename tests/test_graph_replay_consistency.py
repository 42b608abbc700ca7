"""What must not differ between eager decoding and padded graph replay, or between
precisions: the draft's rotary frequencies stay float32 in half precision, and simulated
acceptance draws for a row do not depend on how the batch was padded."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.model.rope import rope_inv_freq
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from specserve.speculative.simulate import SimulatedAcceptance
from tests.engine_utils import TINY, spec_args


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE"])
def test_draft_rope_frequencies_stay_float32_in_half_precision(tmp_path, algo):
    """TreeDrafter.__init__ does head.to(device, dtype): in bf16/fp16 that also casts the
    draft's RoPE `inv_freq` buffers (the target's are recomputed in float32 by build_model).
    The fused rope kernel and apply_rotary then rotate the draft's q/k with bf16-rounded
    frequencies: at position p the angle is off by ~p * inv_freq * 2^-9 (radians), which
    ruins the draft's attention at long contexts (lower acceptance; output stays lossless)."""
    draft = "tiny"
    if algo == "EAGLE":
        draft = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE", seed=3)
    args = dict(TINY, dtype="bfloat16", **spec_args(draft, 1, 2, 3))
    with Engine(**args) as e:
        head = e.core.worker.drafter.head
        cfg = head.config
        want = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = {n: b for n, b in head.named_buffers() if n.endswith("inv_freq")}
        assert freqs
        for name, f in freqs.items():
            assert f.dtype == torch.float32, f"{name} is {f.dtype}"
            torch.testing.assert_close(f.cpu(), want, rtol=0, atol=0)


def test_simulated_multinomial_lengths_do_not_depend_on_padding():
    """A padded (graph) batch draws bsz = bucket lengths; real rows should get the same draws
    as the eager, unpadded batch. Multinomial pairs u[i] with u[bsz + i] (Box-Muller), so
    row i's length depends on the padded batch size: graph replay differs from eager."""
    dev = torch.device("cpu")
    a = SimulatedAcceptance(2.5, "multinomial", "real-draft-token", 3, None, None, dev, seed=0)
    b = SimulatedAcceptance(2.5, "multinomial", "real-draft-token", 3, None, None, dev, seed=0)
    for _ in range(5):
        assert a.draw(3).tolist() == b.draw(4)[:3].tolist()
