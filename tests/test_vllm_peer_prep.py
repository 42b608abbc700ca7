"""What bench/vllm_peer.py hands vLLM for the real SmolLM2 run, checked on a CPU without vLLM:
the bundled EAGLE draft with its fc bias folded computes what specserve's head computes, the
GGUF written as an HF folder is the model specserve runs, vLLM's chat prompts are the token
ids `specserve bench one-batch --chat` runs, and one-batch --chat passes all of it to vLLM's
API (a stand-in `vllm` module records the calls)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from bench import vllm_peer
from bench.vllm_folders import vllm_draft_folder, write_hf_folder
from specserve import Engine
from specserve.bench.one_batch import chat_batch, random_batch, same_lengths
from specserve.kv.pool import KVCache
from specserve.model.registry import DEFAULT_MODEL, bundled_draft_folder
from specserve.ops.attention import ForwardContext, TorchAttentionBackend
from specserve.ops.attention_metadata import Segment, build_metadata
from specserve.speculative.eagle_checkpoint import load_eagle_head, read_draft_config
from tests.engine_utils import reference_logits

DRAFT = bundled_draft_folder(DEFAULT_MODEL)
VOCAB_USED = 256  # the draft's input ids; the embedding is an input here, not under test


@pytest.fixture(scope="module")
def engine():
    with Engine(dtype="float32", device="cpu", no_default_draft=True) as e:
        yield e


# ---- the folded EAGLE draft ---------------------------------------------------------------


def specserve_eagle(embed: torch.nn.Embedding, feats, ids) -> torch.Tensor:
    """The bundled draft's output through specserve's own head (fc with its bias), float64."""
    # (a stand-in target of the draft's own vocabulary, which the loader checks, with a small
    # embedding table: the rows the test reads)
    vocab = read_draft_config(DRAFT)[1].vocab_size
    target = SimpleNamespace(
        config=SimpleNamespace(hidden_size=embed.embedding_dim, vocab_size=vocab),
        model=SimpleNamespace(embed_tokens=embed),
        lm_head_weight=embed.weight,
    )
    head, _ = load_eagle_head(DRAFT, "EAGLE", target)
    head = head.double().eval()
    cfg = head.config
    n = len(ids)
    slots = torch.arange(n)
    meta = build_metadata([Segment(slots, n, n)], slots, torch.device("cpu"))
    cache = KVCache(1, n, cfg.num_kv_heads, cfg.head_dim, torch.float64, "cpu")
    ctx = ForwardContext(TorchAttentionBackend(), cache, meta)
    with torch.inference_mode():
        return head(ids, feats, torch.arange(n), ctx)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta):
    """Rotate-half RoPE (the HF Llama layout vLLM reads) over [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) / half)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def vllm_style_eagle(state, cfg, embed, feats, ids) -> torch.Tensor:
    """vLLM's EAGLE-1 Llama head in plain torch: fc without bias, layer 0 without input norm,
    attention with the q/k/v/o biases of `state`; returns hidden + residual as vLLM does."""
    w = {k: v.double() for k, v in state.items()}
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    n, heads, kv_heads, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = torch.cat([embed(ids), feats], dim=-1) @ w["fc.weight"].T
    residual = h

    def proj(name, x):
        bias = w.get(a + name + ".bias")
        return F.linear(x, w[a + name + ".weight"], bias)

    positions = torch.arange(n)
    q = rotate(proj("q_proj", h).view(n, heads, d), positions, cfg.rope_theta)
    k = rotate(proj("k_proj", h).view(n, kv_heads, d), positions, cfg.rope_theta)
    v = proj("v_proj", h).view(n, kv_heads, d)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    h = residual + proj("o_proj", attn)
    x = rms_norm(h, w["layers.0.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate, up = x @ w[m + "gate_proj.weight"].T, x @ w[m + "up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[m + "down_proj.weight"].T


def test_the_folded_draft_holds_what_vllms_eagle_loader_takes(tmp_path):
    out = vllm_draft_folder(DRAFT, str(tmp_path / "draft"))
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    assert "fc.bias" not in names and "layers.0.input_layernorm.weight" not in names
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.0.self_attn.{proj}.bias" in names
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["attention_bias"] is True


def test_folding_the_fc_bias_keeps_the_draft_layer_exact(tmp_path):
    _, cfg = read_draft_config(DRAFT)
    torch.manual_seed(0)
    n = 9
    embed = torch.nn.Embedding(VOCAB_USED, cfg.hidden_size).double()
    ids = torch.randint(0, VOCAB_USED, (n,))
    feats = torch.randn(n, cfg.hidden_size, dtype=torch.float64)
    want = specserve_eagle(embed, feats, ids)

    folded = load_file(os.path.join(vllm_draft_folder(DRAFT, str(tmp_path)), "model.safetensors"))
    with torch.no_grad():
        got = vllm_style_eagle(folded, cfg, embed, feats, ids)
        unfolded = {k: v for k, v in folded.items() if not k.endswith(".bias")}
        without_fold = vllm_style_eagle(unfolded, cfg, embed, feats, ids)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    # the bias matters: dropping it is far outside that tolerance
    assert (without_fold - want).abs().max().item() > 1e-2 * scale


# ---- the GGUF as an HF folder --------------------------------------------------------------


def test_hf_folder_is_the_model_specserve_runs(engine, tmp_path):
    from transformers import LlamaForCausalLM

    folder = write_hf_folder(DEFAULT_MODEL, str(tmp_path))
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as st:
        assert "lm_head.weight" not in st.keys()  # tied: vLLM ties it from the config
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = engine.tokenize_chat([{"role": "user", "content": "Name three primary colours."}])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    ours = reference_logits(engine.core.runner.model, ids).float()
    scale = max(1.0, theirs.abs().max().item())
    torch.testing.assert_close(ours, theirs, atol=1e-4 * scale, rtol=0)
    assert ours[-1].argmax() == theirs[-1].argmax()


# ---- prompts -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [3, 16])
def test_vllm_chat_prompts_are_specserves_one_batch_chat_prompts(engine, batch_size):
    args = argparse.Namespace(chat=True, model=DEFAULT_MODEL)
    timed, warm = vllm_peer.batch_prompts(args, batch_size)
    assert timed == chat_batch(engine, batch_size, 8)[0]
    others = chat_batch(engine, batch_size, 8, offset=batch_size)[0]
    assert warm == same_lengths(others, timed)
    assert timed != warm  # the warm-up runs other prompts, as specserve's does
    assert list(map(len, warm)) == list(map(len, timed))  # at the timed prompts' lengths


def test_vllm_random_prompts_are_specserves_random_prompts(engine):
    args = argparse.Namespace(
        chat=False, preset="smollm2-135m", model_folder=None, seed=3, input_len=20
    )
    timed, warm = vllm_peer.batch_prompts(args, 4)
    assert timed == warm == random_batch(engine, 4, 20, 8, seed=3)[0]


# ---- what one-batch --chat asks of vLLM ----------------------------------------------------


class FakeLLM:
    """vllm.LLM's calls as vllm_peer makes them: every prompt gets max_tokens tokens, and each
    generate adds 10 drafts with 15 accepted tokens to the spec-decode counters."""

    last: FakeLLM | None = None

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[list[list[int]], SimpleNamespace]] = []
        FakeLLM.last = self

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(([p["prompt_token_ids"] for p in prompts], params))
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)])
        ] * len(prompts)

    def get_metrics(self):
        n = len(self.calls)
        return [
            SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10 * n),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=15 * n),
        ]


def test_one_batch_chat_gives_vllm_the_folder_the_folded_draft_and_the_chat_ids(
    engine, tmp_path, monkeypatch
):
    fake = ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    model = str(tmp_path / "target")
    argv = ["one-batch", "--model-folder", model, "--chat", "--eagle", DRAFT]
    argv += ["--batch-size", "2", "5", "--output-len", "4", "--work", str(tmp_path / "work")]
    rows = vllm_peer.cmd_one_batch(vllm_peer.parser().parse_args(argv))

    llm = FakeLLM.last
    assert llm.kwargs["model"] == model and llm.kwargs["load_format"] == "auto"
    assert llm.kwargs["skip_tokenizer_init"] and llm.kwargs["dtype"] == "bfloat16"
    spec = llm.kwargs["speculative_config"]
    assert spec["method"] == "eagle" and spec["num_speculative_tokens"] == 3
    with safe_open(os.path.join(spec["model"], "model.safetensors"), framework="pt") as st:
        assert "fc.bias" not in st.keys() and "layers.0.self_attn.o_proj.bias" in st.keys()
    for i, bs in enumerate((2, 5)):  # per batch size: warm-up, the TTFT run, the timed run
        (warm, p_warm), (ttft, p_ttft), (timed, p_timed) = llm.calls[3 * i : 3 * i + 3]
        assert warm == same_lengths(chat_batch(engine, bs, 4, offset=bs)[0], timed)
        assert ttft == timed == chat_batch(engine, bs, 4)[0]
        assert (p_warm.max_tokens, p_ttft.max_tokens, p_timed.max_tokens) == (4, 1, 4)
        assert p_timed.temperature == 0.0 and p_timed.ignore_eos  # as specserve's --chat
        assert rows[i]["input_len"] == round(sum(map(len, timed)) / bs)
        assert rows[i]["spec_accept_length"] == 2.5
