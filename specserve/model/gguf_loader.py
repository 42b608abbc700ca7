"""GGUF files (llama.cpp): config, weights (dequantized by the `gguf` package), tokenizer.

llama.cpp's converter permutes the rows of q and k weights so that RoPE pairs are
interleaved; our model uses the rotate-half layout, so the permutation is undone here.

The file is parsed by a small reader of our own (`read_gguf`): `gguf.GGUFReader` builds a
numpy view per string of the vocabulary and the merges, which takes seconds for a 49k
vocabulary, and we only need the scalar keys, array lengths and the tensor table. Tensor
bytes are memory-mapped; `gguf.quants.dequantize` turns them into float32.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specserve.model.config import (
    ModelConfig,
    RopeScaling,
    check_attention_shape,
    check_positive_int,
    check_positive_number,
)

_SUPPORTED_ARCHS = {"llama", "qwen2", "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF metadata value types -> struct format (scalars).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALAR.update({11: "<q", 12: "<d"})
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32}
_NP.update({6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64})
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings that was skipped (e.g. the vocabulary): its length only."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    _buf: Any = None  # the mmap; tensor data are views into it

    def tensor_bytes(self, t: GGUFTensor) -> np.ndarray:
        """uint8 [rows..., bytes per row] view of a tensor's data (read-only)."""
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        row_bytes = t.shape[-1] // block * type_size
        flat = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return flat.reshape(*t.shape[:-1], row_bytes)

    def tensor_float32(
        self, t: GGUFTensor, part: tuple[int, int, int] | None = None
    ) -> np.ndarray | None:
        """The tensor, or with part = (dim, start, stop) only that slice of a 2-D tensor,
        dequantizing only its blocks (tensor parallelism). A row is whole blocks, so any rows
        can be taken; columns only on block boundaries: None otherwise."""
        import gguf
        from gguf.quants import dequantize

        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        raw = self.tensor_bytes(t)
        shape = t.shape
        if part is not None:
            dim, start, stop = part
            if dim == 0:
                raw, shape = raw[start:stop], (stop - start, *shape[1:])
            else:
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                if start % block or stop % block:
                    return None
                raw = raw[:, start // block * type_size : stop // block * type_size]
                shape = (shape[0], stop - start)
            raw = np.ascontiguousarray(raw)
        if qtype == gguf.GGMLQuantizationType.F32:
            arr = raw.view(np.float32).copy()  # own the memory: the mmap is read-only
        elif qtype.name in _BLOCK_TYPES:
            arr = _dequantize_blocks(raw, qtype.name)
        else:
            arr = dequantize(raw, qtype)
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)


# Block formats whose `gguf.quants` class dequantizes any number of blocks in one call.
_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _dequantize_blocks(raw: np.ndarray, type_name: str, chunk: int = 1 << 16) -> np.ndarray:
    """Same values as `gguf.quants.dequantize` (same numpy code), but over large chunks of
    blocks rather than 16 rows at a time: about twice as fast on a 135M model."""
    from gguf import quants

    cls = getattr(quants, type_name)
    blocks = raw.reshape(-1, cls.type_size)
    out = np.empty((blocks.shape[0], cls.block_size), dtype=np.float32)
    for i in range(0, blocks.shape[0], chunk):
        out[i : i + chunk] = cls.dequantize_blocks(blocks[i : i + chunk])
    return out


def read_gguf(path: str, keep_string_arrays: Container[str] = ()) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table. String arrays not named in
    `keep_string_arrays` are skipped (a `StringArray` holding their length)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is not a GGUF file (shorter than a GGUF header)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse_gguf(path, buf, keep_string_arrays)
    except (struct.error, IndexError, OverflowError, MemoryError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF metadata ({e})") from e


def _parse_gguf(path: str, buf: mmap.mmap, keep_string_arrays: Container[str]) -> GGUFFile:
    if buf[:4] != b"GGUF":
        if buf[:24] == b"version https://git-lfs.":  # (a clone made without Git LFS)
            raise ValueError(
                f"{path} is a Git LFS pointer, not the model: fetch it with git lfs pull"
            )
        raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    pos = 24

    def read_str(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"), p + 8 + n

    def read_value(p: int, vtype: int, key: str) -> tuple[Any, int]:
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
        if vtype == _STRING:
            return read_str(p)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype in _NP:
                arr = np.frombuffer(buf, dtype=_NP[etype], count=count, offset=p)
                return arr.tolist(), p + arr.nbytes
            if etype == _STRING:
                if key in keep_string_arrays:
                    out = []
                    for _ in range(count):
                        s, p = read_str(p)
                        out.append(s)
                    return out, p
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, p)
                    p += 8 + n
                return StringArray(count), p
            out = []
            for _ in range(count):
                v, p = read_value(p, etype, key)
                out.append(v)
            return out, p
        raise ValueError(f"{path}: unknown GGUF metadata type {vtype} for {key!r}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = read_value(pos + 4, vtype, key)

    import gguf

    entries = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {align!r}")
    data_start = -(-pos // align) * align
    tensors = []
    readable = _readable_types()
    for name, shape, ggml_type, offset in entries:
        if ggml_type not in readable:
            known = {int(t): t.name for t in gguf.GGMLQuantizationType}
            kind = known.get(ggml_type, f"{ggml_type} (unknown)")
            raise ValueError(
                f"{path}: tensor {name!r} has GGML type {kind}, which cannot be dequantized "
                f"(supported: {', '.join(sorted(readable.values()))})"
            )
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, shape, ggml_type, start, nbytes))
    return GGUFFile(path, metadata, tensors, buf)


def _readable_types() -> dict[int, str]:
    """GGML types `gguf.quants.dequantize` implements (id -> name): F32, F16 and those of its
    type table; others (integer types, F64, Q8_1, Q8_K, ...) raise NotImplementedError there,
    so a file holding them is refused while its table is read."""
    import gguf
    from gguf import quants

    types = getattr(quants, "_type_traits", None)  # (private: its dequantize dispatches on it)
    if types is None:
        types = [gguf.GGMLQuantizationType[n] for n in _BLOCK_TYPES]
    types = [*types, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16]
    return {int(t): t.name for t in types if t in gguf.GGML_QUANT_SIZES}


def load_gguf_config(path: str, gf: GGUFFile | None = None) -> ModelConfig:
    gf = gf or read_gguf(path)
    try:
        return _gguf_config(path, gf)
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e.args[0]!r}") from e


def _gguf_config(path: str, gf: GGUFFile) -> ModelConfig:
    m = gf.metadata
    arch = m.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(_SUPPORTED_ARCHS)})"
        )
    a = arch

    def size(key: str, default: Any = None) -> Any:
        """A positive integer of the metadata (KeyError when absent and no default)."""
        value = m[key] if default is None else m.get(key, default)
        check_positive_int(key, value)
        return value

    def number(key: str, default: float) -> float:
        check_positive_number(key, m.get(key, default))
        return float(m.get(key, default))

    heads = size(f"{a}.attention.head_count")
    hidden = size(f"{a}.embedding_length")
    head_dim_key = next(
        (k for k in (f"{a}.attention.key_length", f"{a}.rope.dimension_count") if m.get(k)), None
    )
    head_dim = size(head_dim_key) if head_dim_key else hidden // heads
    # every dimension of a head is rotated: a file rotating fewer (llama.cpp's n_rot), or
    # whose values are of another size than its keys, is refused rather than run otherwise
    for key in (f"{a}.rope.dimension_count", f"{a}.attention.value_length"):
        if m.get(key) is not None and size(key) != head_dim:
            raise ValueError(
                f"{path}: {key} is {m[key]}, not the head size {head_dim} (rotating part of a "
                "head, or values of another size than the keys, is not supported)"
            )
    tensors = {t.name: t for t in gf.tensors}
    tokens = m.get("tokenizer.ggml.tokens")
    vocab = m.get(f"{a}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].shape[0]
    if vocab is None:
        raise ValueError(
            f"{path}: the vocabulary size is unknown (no {a}.vocab_size, "
            "tokenizer.ggml.tokens or token_embd.weight)"
        )
    check_positive_int(f"{a}.vocab_size", vocab)
    scaling = None
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores llama3 scaling as per-frequency divisors of the inverse frequencies
        # (convert_hf_to_gguf computes them from factor/low/high/original context): use them
        # as they are rather than guessing the parameters they came from.
        factors = gf.tensor_float32(tensors["rope_freqs.weight"]).reshape(-1)
        scaling = RopeScaling(
            factor=float(factors.max()),
            original_max_position_embeddings=size(
                f"{a}.rope.scaling.original_context_length", 8192
            ),
            freq_factors=tuple(float(x) for x in factors),
        )
    elif m.get(f"{a}.rope.scaling.type") == "llama3":
        scaling = RopeScaling(
            factor=number(f"{a}.rope.scaling.factor", 8.0),
            original_max_position_embeddings=size(
                f"{a}.rope.scaling.original_context_length", 8192
            ),
        )
    elif m.get(f"{a}.rope.scaling.type") in (None, "linear"):
        # llama.cpp reads an absent type as linear, its factor from rope.scaling.factor or
        # the older rope.scale_linear (absent or 0: none); every frequency divided by it
        factor = m.get(f"{a}.rope.scaling.factor") or m.get(f"{a}.rope.scale_linear") or 1.0
        check_positive_number(f"{a}.rope.scaling.factor", factor)
        if factor != 1.0:
            scaling = RopeScaling(
                factor=float(factor), freq_factors=(float(factor),) * (head_dim // 2)
            )
    elif m.get(f"{a}.rope.scaling.type") != "none":
        raise ValueError(
            f"{path}: rope scaling {m.get(f'{a}.rope.scaling.type')!r} is not supported "
            "(llama3, linear or none)"
        )
    # the tokens that end a generation, as llama.cpp counts them: end of sequence, of turn
    # (chat models' <|eot_id|>, <|im_end|>) and of message
    ends = ("eos", "eot", "eom")
    eos = tuple(dict.fromkeys(m[k] for e in ends if (k := f"tokenizer.ggml.{e}_token_id") in m))
    for e in ("bos", *ends):  # (transformers' tokenizer indexes the token list with them)
        key = f"tokenizer.ggml.{e}_token_id"
        token = m.get(key, 0)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise ValueError(f"{key} must be a token id in [0, {vocab}), got {token!r}")
    kv_heads = size(f"{a}.attention.head_count_kv", heads)
    check_attention_shape(heads, kv_heads, head_dim, "from the GGUF metadata")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=size(f"{a}.feed_forward_length"),
        num_layers=size(f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number(f"{a}.rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=size(f"{a}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        architecture=arch,
    )


def _expected_shape(cfg: ModelConfig, hf_name: str) -> tuple[tuple[int, ...], str] | None:
    """The shape the model needs of a layer's projection (whole, before any tensor-parallel
    slicing) and where its rows come from; None for tensors `_copy` checks alone."""
    q, kv, h, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    q_why = f"attention.head_count * head_dim = {cfg.num_heads} * {cfg.head_dim}"
    kv_why = f"attention.head_count_kv * head_dim = {cfg.num_kv_heads} * {cfg.head_dim}"
    shapes = {
        "q_proj": ((q, h), q_why),
        "k_proj": ((kv, h), kv_why),
        "v_proj": ((kv, h), kv_why),
        "o_proj": ((h, q), q_why),
        "gate_proj": ((inter, h), "feed_forward_length"),
        "up_proj": ((inter, h), "feed_forward_length"),
        "down_proj": ((h, inter), "feed_forward_length"),
    }
    *_, module, kind = hf_name.split(".")
    if module not in shapes:
        return None
    shape, why = shapes[module]
    return (shape[:1] if kind == "bias" else shape), why


def _check_shape(path: str, t: GGUFTensor, hf_name: str, cfg: ModelConfig) -> None:
    """Refuse a projection of the wrong shape naming its GGUF tensor (before `_unpermute`,
    which needs whole heads, and before q/k/v and gate/up are stacked, where wrong pieces
    could add up to the right total)."""
    expected = _expected_shape(cfg, hf_name)
    if expected is not None and tuple(t.shape) != expected[0]:
        raise ValueError(
            f"{path}: tensor {t.name!r} has shape {list(t.shape)}, expected "
            f"{list(expected[0])} ({expected[1]}, embedding_length = {cfg.hidden_size})"
        )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (rows interleaved per head -> rotate-half)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _hf_name(name: str) -> str:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        if kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    raise KeyError(f"unknown GGUF tensor {name!r}")


def iter_gguf_weights(
    path: str, cfg: ModelConfig, gf: GGUFFile | None = None, shard=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named float32 tensors from a GGUF file; with a `CheckpointShard` (tensor
    parallelism) only this rank's part of each, its quantized blocks alone dequantized where
    the slice falls on block boundaries (always for rows)."""
    gf = gf or read_gguf(path)
    permute = cfg.architecture == "llama"
    for t in gf.tensors:
        if t.name == "rope_freqs.weight":
            continue  # read into the config (RopeScaling.freq_factors)
        name = _hf_name(t.name)
        _check_shape(path, t, name, cfg)
        part = shard.part(name) if shard is not None else None
        # tensor_float32 slices 2-D tensors only (its rows are bytes): a 1-D one (a q/k/v
        # bias) is read whole and cut below
        array = gf.tensor_float32(t, part) if part is not None and len(t.shape) == 2 else None
        if array is None:
            tensor = torch.from_numpy(gf.tensor_float32(t))
            if part is not None:
                dim, start, stop = part
                tensor = tensor.narrow(dim, start, stop - start)
        else:
            tensor = torch.from_numpy(array)
        if permute and t.name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            # per-head permutation: a slice of whole heads unpermutes on its own
            tensor = _unpermute(tensor, tensor.shape[0] // cfg.head_dim)
        yield name, tensor if shard is None else shard.pad(name, tensor)


def gguf_chat_template(path: str) -> str | None:
    return read_gguf(path).metadata.get("tokenizer.chat_template")


def gguf_has_tokenizer(path: str) -> bool:
    return "tokenizer.ggml.tokens" in read_gguf(path).metadata


def gguf_architecture(path: str) -> str | None:
    return read_gguf(path).metadata.get("general.architecture")
