"""Which implementation each hot op runs: a fused GPU kernel or its plain torch reference.

One frozen `Kernels` is decided by `EngineConfig.resolve()` (a reason per choice, shown by
`Engine.resolved_args()`) and carried explicitly: in the `ForwardContext` of every model
forward and by the decode step. No module reads a switch of its own, so a test or a bench
chooses kernels by passing a `Kernels`, and what an engine runs is visible in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Where the skinny GEMM pays, from H200 measurements (docs/PERFORMANCE.md): at 2..16 tokens it
# lost to cuBLAS; at one token a small model (hidden 576) gains more from its fused norm /
# SiLU / residual (fewer launches) than it loses, while an 8B-shaped model (hidden 4096)
# streams its weights faster through cuBLAS.
SKINNY_MAX_TOKENS = 1
SKINNY_MAX_HIDDEN = 2048


@dataclass(frozen=True)
class Kernels:
    # model layers (CUDA, 16-bit activations)
    skinny_gemm: bool = False  # few-token matmuls with fused norm / SiLU-mul / residual
    skinny_gemm_max_tokens: int = SKINNY_MAX_TOKENS  # most rows that take it
    skinny_gemm_max_hidden: int = SKINNY_MAX_HIDDEN  # widest input that takes it
    fused_norms: bool = False  # RMSNorm, add+RMSNorm, SiLU-and-mul, EAGLE's embed+concat
    fp32_logits: bool = False  # cuBLAS writes float32 logits straight from 16-bit operands
    draft_fc_qkv: bool = False  # an EAGLE head's fc and first qkv as one GEMM
    # the decode step (CUDA)
    decode_metadata: bool = False  # a step's attention metadata in one launch
    sampling_reductions: bool = False  # split-row argmax and top-k log-probs
    draft_tree: bool = False  # a drafting depth's bookkeeping and the tree selection
    tree_accept: bool = False  # acceptance from the ancestor mask in one launch
    kv_commit: bool = False  # the accepted path's KV moved in one launch

    def as_dict(self) -> dict[str, bool | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def skinny_applies(self, num_tokens: int, hidden: int) -> bool:
        return (
            self.skinny_gemm
            and num_tokens <= self.skinny_gemm_max_tokens
            and hidden <= self.skinny_gemm_max_hidden
        )


# The plain torch ops everywhere: CPU, training (autograd), and what every kernel is tested
# against.
REFERENCE = Kernels()

_LAYER_KERNELS = ("skinny_gemm", "fused_norms", "fp32_logits", "draft_fc_qkv")
_STEP_KERNELS = (
    "decode_metadata",
    "sampling_reductions",
    "draft_tree",
    "tree_accept",
    "kv_commit",
)


def resolve_kernels(
    on_gpu: bool, half_precision: bool, triton: bool, disabled: bool, torch_version: tuple
) -> tuple[Kernels, list[tuple[str, bool, str]]]:
    """The kernels an engine runs, with a reason per choice."""
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
        return REFERENCE, decisions
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
    return Kernels(**on), decisions
