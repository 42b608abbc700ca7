"""Which implementation each hot op runs: a fused GPU kernel or its plain torch reference.

One frozen `Kernels` is decided by `EngineConfig.resolve()` (a reason per choice, shown by
`Engine.resolved_args()`) and carried explicitly: in the `ForwardContext` of every model
forward and by the decode step. No module reads a switch of its own, so a test or a bench
chooses kernels by passing a `Kernels`, and what an engine runs is visible in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

# Where the skinny GEMM pays, from H200 measurements (docs/PERFORMANCE.md): at 2..16 tokens it
# lost to cuBLAS; at one token a small model (hidden 576) gains more from its fused norm /
# SiLU / residual (fewer launches) than it loses, while an 8B-shaped model (hidden 4096)
# streams its weights faster through cuBLAS.
SKINNY_MAX_TOKENS = 1
SKINNY_MAX_HIDDEN = 2048

# Tiles of the batch-invariant GEMM (ops/triton_invariant_linear.py) measured on an H200, keyed
# by the weight's (N, K): (block_n, block_k, num_warps, num_stages), from
# `bench/weight_stream_bandwidth.py --tune --tune-ms 1,16,64`. The Llama-3-8B shapes: with these
# tiles, and the norms in their own kernels, a step's matmuls take 1-2% less time than through
# cuBLAS at 1 and 16 rows (docs/PERFORMANCE.md).
INVARIANT_GEMM_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (64, 128, 4, 5),  # qkv
    (4096, 4096): (64, 128, 4, 5),  # o
    (28672, 4096): (64, 128, 4, 2),  # gate_up
    (4096, 14336): (64, 128, 4, 5),  # down
    (128256, 4096): (64, 128, 4, 3),  # lm_head
}
# The shapes whose few-token matmuls the default mode routes to that GEMM: a shape joins once
# its model was measured faster end to end (a tile tuned for deterministic mode alone does not
# make it faster than cuBLAS). The Llama-3-8B ones: 1.4% at batch 1, 0.9% at batch 16.
INVARIANT_GEMM_ROUTED: tuple[tuple[int, int], ...] = (
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
)
# The most rows that the routed shapes were measured faster than cuBLAS at (1 and 16 measured).
INVARIANT_GEMM_MAX_TOKENS = 16
# The GPU the tiles were tuned on: elsewhere their speed is unmeasured, and cuBLAS runs.
INVARIANT_GEMM_TUNED_GPU = "H200"


@dataclass(frozen=True)
class Kernels:
    # model layers (CUDA, 16-bit activations)
    skinny_gemm: bool = False  # few-token matmuls with fused norm / SiLU-mul / residual
    skinny_gemm_max_tokens: int = SKINNY_MAX_TOKENS  # most rows that take it
    skinny_gemm_max_hidden: int = SKINNY_MAX_HIDDEN  # widest input that takes it
    # the skinny GEMM launched with programmatic dependent launch (Hopper and later): a
    # kernel loads its first weight tile while the previous kernel finishes
    programmatic_launch: bool = False
    # few-token matmuls of these weight shapes (N, K) run the batch-invariant GEMM with its
    # tuned tile, faster than cuBLAS there (the residual add in its epilogue)
    invariant_gemm_max_tokens: int = 0  # most rows that take it (0: none)
    invariant_gemm_shapes: tuple[tuple[int, int], ...] = ()
    fused_norms: bool = False  # RMSNorm, add+RMSNorm, SiLU-and-mul, EAGLE's embed+concat
    fp32_logits: bool = False  # cuBLAS writes float32 logits straight from 16-bit operands
    draft_fc_qkv: bool = False  # an EAGLE head's fc and first qkv as one GEMM
    # deterministic inference: a row's bits do not depend on the rest of the batch
    batch_invariant_matmul: bool = False  # every matmul (and logits) through one fixed-order GEMM
    batch_invariant_attention: bool = False  # one reduction order per query row, any forward
    # the decode step (CUDA)
    decode_metadata: bool = False  # a step's attention metadata in one launch
    sampling_reductions: bool = False  # split-row argmax, Gumbel-max draws, top-k log-probs
    filter_search: bool = False  # filters' floor by a search per row from 256 rows (not a sort)
    draft_tree: bool = False  # a drafting depth's bookkeeping and the tree selection
    tree_accept: bool = False  # acceptance from the ancestor mask in one launch
    kv_commit: bool = False  # the accepted path's KV moved in one launch
    accept_stats: bool = False  # adaptive speculation's per-step acceptance bookkeeping

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def skinny_applies(self, num_tokens: int, hidden: int) -> bool:
        return (
            self.skinny_gemm
            and num_tokens <= self.skinny_gemm_max_tokens
            and hidden <= self.skinny_gemm_max_hidden
        )

    def invariant_gemm_applies(self, num_tokens: int, hidden: int) -> bool:
        """Whether a layer with this input width may route its matmuls to the tuned
        batch-invariant GEMM (each matmul then checks its own weight's shape)."""
        return 0 < num_tokens <= self.invariant_gemm_max_tokens and any(
            k == hidden for _, k in self.invariant_gemm_shapes
        )

    def invariant_gemm_tuned(self, weight_shape: tuple[int, ...]) -> bool:
        return tuple(weight_shape) in self.invariant_gemm_shapes


# The plain torch ops everywhere: CPU, training (autograd), and what every kernel is tested
# against.
REFERENCE = Kernels()

_LAYER_KERNELS = ("skinny_gemm", "fused_norms", "fp32_logits", "draft_fc_qkv")
_STEP_KERNELS = (
    "decode_metadata",
    "sampling_reductions",
    "filter_search",
    "draft_tree",
    "tree_accept",
    "kv_commit",
    "accept_stats",
)


_INVARIANT_KERNELS = ("batch_invariant_matmul", "batch_invariant_attention")
# Why deterministic inference is not the default yet: it becomes the default once it costs at
# most 3% at batch 1 (SmolLM2 plain and tree, 8B) and 16 (8B) on the H200
# (bench/deterministic_cost.py); until then it is asked for.
DETERMINISTIC_OFF = (
    "enable_deterministic_inference is off (it decodes at 0.68-0.98x the default's speed on an "
    "H200, SmolLM2 and the 8B shape at batch 1 and 16; the default flips within 3%): cuBLAS, "
    "the skinny GEMM and split-KV attention pick their reduction order by batch shape, so a "
    "row's bf16 bits may change with the batch"
)


def resolve_kernels(
    on_gpu: bool,
    half_precision: bool,
    triton: bool,
    disabled: bool,
    torch_version: tuple,
    deterministic: bool = False,
    gpu_name: str = "",
    tp_size: int = 1,
) -> tuple[Kernels, list[tuple[str, bool, str]]]:
    """The kernels an engine runs, with a reason per choice (gpu_name: the CUDA device's
    name; tp_size: ranks that each hold a slice of every weight)."""
    decisions: list[tuple[str, bool, str]] = []
    if disabled or not on_gpu or not triton:
        why = (
            "disable_fused_kernels: the torch reference ops everywhere"
            if disabled
            else "no CUDA device: the torch reference ops"
            if not on_gpu
            else "Triton is not installed: the torch reference ops"
        )
        decisions.append(("kernels", "reference", why))
        if deterministic:
            decisions.append(
                (
                    "kernels.batch_invariant_matmul",
                    False,
                    f"{why}; deterministic inference in float32 on a CPU runs the torch "
                    "reference (the batch-invariant Triton kernels are for CUDA; they are "
                    "tested on a CPU through Triton's interpreter)",
                )
            )
        return REFERENCE, decisions
    if deterministic:
        return _deterministic(decisions)
    on = dict.fromkeys(_STEP_KERNELS, True)
    step_why = "CUDA: one launch instead of several torch kernels (launch-bound at small batch)"
    for name in _STEP_KERNELS:
        decisions.append((f"kernels.{name}", True, step_why))
    for name in _LAYER_KERNELS:
        on[name] = half_precision
        if not half_precision:
            decisions.append(
                (f"kernels.{name}", False, "float32: the torch ops (tuned for 16-bit)")
            )
    if half_precision:
        decisions.append(
            (
                "kernels.skinny_gemm",
                True,
                f"up to {SKINNY_MAX_TOKENS} token(s) and hidden <= {SKINNY_MAX_HIDDEN}: fused "
                "norm / SiLU / residual saves launches; wider models stream faster via cuBLAS",
            )
        )
        decisions.append(
            (
                "kernels.programmatic_launch",
                False,
                "off: on an H200 the 8B shape's decoder (skinny GEMM, fused) ran 0.8% faster "
                "with it, still 12% slower than cuBLAS with fused elementwise kernels; not "
                "measured end to end",
            )
        )
        decisions.append(
            ("kernels.fused_norms", True, "one kernel per norm, add+norm and SiLU-and-mul")
        )
        decisions.append(
            ("kernels.draft_fc_qkv", True, "one GEMM fewer per draft forward (launch-bound)")
        )
        fp32 = torch_version >= (2, 8)
        on["fp32_logits"] = fp32
        decisions.append(
            (
                "kernels.fp32_logits",
                fp32,
                "cuBLAS writes float32 logits: bf16-rounded logits tie and change argmaxes"
                if fp32
                else "torch < 2.8 cannot write float32 from a 16-bit GEMM: logits upcast",
            )
        )
    if half_precision:
        on.update(_invariant_gemm_routing(gpu_name, tp_size, decisions))
    for name in _INVARIANT_KERNELS:
        decisions.append((f"kernels.{name}", False, DETERMINISTIC_OFF))
    return Kernels(**on), decisions


def _invariant_gemm_routing(gpu_name: str, tp_size: int, decisions: list) -> dict:
    """Few-token matmuls of the weight shapes with a tile tuned on this GPU run the
    batch-invariant GEMM: faster than cuBLAS there, the residual add in its epilogue."""
    why = None
    if not re.search(rf"\b{INVARIANT_GEMM_TUNED_GPU}\b", gpu_name):  # (not a GH200)
        why = f"its tiles were tuned on an {INVARIANT_GEMM_TUNED_GPU}, not this GPU ({gpu_name!r})"
    elif tp_size > 1:
        why = "tensor parallelism slices the weights: no slice's shape has a tuned tile"
    if why is not None:
        decisions.append(("kernels.invariant_gemm_max_tokens", 0, f"cuBLAS: {why}"))
        return {}
    decisions.append(
        (
            "kernels.invariant_gemm_max_tokens",
            INVARIANT_GEMM_MAX_TOKENS,
            f"up to {INVARIANT_GEMM_MAX_TOKENS} rows, the weight shapes measured faster with a "
            f"tile tuned on an {INVARIANT_GEMM_TUNED_GPU} ({len(INVARIANT_GEMM_ROUTED)}: the "
            "Llama-3-8B ones) run the batch-invariant GEMM, faster than cuBLAS there: the 8B "
            "shape decoded 1.4% faster at batch 1 and 0.9% at batch 16",
        )
    )
    return dict(
        invariant_gemm_max_tokens=INVARIANT_GEMM_MAX_TOKENS,
        invariant_gemm_shapes=INVARIANT_GEMM_ROUTED,
    )


def _deterministic(
    decisions: list[tuple[str, bool, str]],
) -> tuple[Kernels, list[tuple[str, bool, str]]]:
    """enable_deterministic_inference on CUDA: every row of every op reduces in an order that
    depends only on that row, so decode, tree verify and batching agree bit for bit."""
    on = dict.fromkeys(_STEP_KERNELS, True)
    step_why = "CUDA: one launch instead of several torch kernels (launch-bound at small batch)"
    for name in _STEP_KERNELS:
        why = step_why
        if name == "sampling_reductions":
            why += "; argmax, Gumbel-max, the filters and top-k reduce each row alone (ties to the lower id): batch-invariant"
        if name == "filter_search":
            why += "; the search finds the sort's floor on every row (the same integer sums): batch-invariant"
        decisions.append((f"kernels.{name}", on[name], why))
    on.update(
        batch_invariant_matmul=True,
        batch_invariant_attention=True,
        fused_norms=True,
        draft_fc_qkv=True,
    )
    decisions += [
        (
            "kernels.batch_invariant_matmul",
            True,
            "enable_deterministic_inference: qkv, o, gate_up, down and lm_head (float32 "
            "logits) run one Triton GEMM whose tile depends on the weight shape only (16-row "
            "tiles, no split-K, K in a fixed order) for every M: decode, tree verify and "
            "prefill rows get the same bits alone or in any batch",
        ),
        (
            "kernels.batch_invariant_attention",
            True,
            "enable_deterministic_inference: decode-step forwards run one kernel per query "
            "row over its visible KV in logical order, in fixed 64-position blocks and "
            "256-position splits (set by the row's own length); prefill runs the extend "
            "kernel unsplit, its blocks aligned to positions",
        ),
        (
            "kernels.fused_norms",
            True,
            "enable_deterministic_inference: RMSNorm, add+RMSNorm and SiLU-and-mul reduce "
            "each row in one program of a fixed width (torch's reductions size their launch "
            "by the batch)",
        ),
        ("kernels.draft_fc_qkv", True, "one GEMM fewer per draft forward (launch-bound)"),
        (
            "kernels.skinny_gemm",
            False,
            "enable_deterministic_inference: the batch-invariant GEMM runs every matmul (the "
            "skinny GEMM reduces one-token rows in another order than verify rows)",
        ),
        (
            "kernels.fp32_logits",
            False,
            "enable_deterministic_inference: the batch-invariant GEMM writes float32 logits",
        ),
    ]
    return Kernels(**on), decisions
