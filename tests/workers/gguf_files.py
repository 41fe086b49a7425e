"""Small GGUF files for the tests, written with the `gguf` package the way llama.cpp's converter
(`convert_hf_to_gguf.py`) writes them: `write_gguf` turns a `make_model` checkpoint into one
(metadata keys, tensor names from `gguf.get_tensor_name_map`, the llama family's q/k rows
permuted into llama.cpp's RoPE layout, Gemma's norms stored plus one, Llama 3's RoPE scaling as
a `rope_freqs` tensor, 2-D weights in the asked type and the rest F32), and
`write_spm_tokenizer_gguf` a SentencePiece-style vocabulary (scores, byte tokens, no merges).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "phi3": "phi3"}
# a block of 256 values, the K-quants' unit; rows narrower than that stay F32 in such files
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def write_gguf(hf_dir: Path, out: Path, ggml_type: str = "F32", *,
               perturb_norms: bool = True) -> Path:
    """`hf_dir` (a make_model checkpoint) as a GGUF file at `out`, matrices in `ggml_type`.
    `perturb_norms`: seeded noise on the norm weights (make_model's are all one, which would
    hide a norm loaded into the wrong place)."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config, arch)
    _write_bpe_tokenizer(writer, hf_dir, config["vocab_size"])
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    noise = torch.Generator().manual_seed(7)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        base, _, suffix = name.rpartition(".")
        tensor = tensor.float()
        if perturb_norms and name.endswith("norm.weight"):
            tensor = tensor + 0.2 * torch.randn(tensor.shape, generator=noise)
        values = _converted(name, tensor, config, arch).numpy()
        _add_tensor(writer, f"{table.get_name(base)}.{suffix}", values, ggml_type)
    rope = config.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(config, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], arch: str) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _converted(name: str, tensor: torch.Tensor, config: dict[str, Any], arch: str
               ) -> torch.Tensor:
    """llama.cpp's converter's transforms: q/k permuted (llama), norms plus one (Gemma 3)."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return tensor + 1
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads"]
        if ".k_proj." in name:
            heads = config["num_key_value_heads"]
        shape = tensor.shape
        return tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]
                              ).swapaxes(1, 2).reshape(shape)
    return tensor


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, ggml_type: str) -> None:
    kind = gguf.GGMLQuantizationType[ggml_type]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if values.ndim != 2 or values.shape[-1] % block or kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif ggml_type in K_QUANTS:
        writer.add_tensor(name, random_k_blocks(values.shape, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)


def random_k_blocks(shape: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """K-quant blocks of seeded random bits with small fp16 scales: `gguf` reads these types but
    cannot write them, and any bits make a valid block."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(int(kind) * 7919 + shape[0])
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    # the super-block scales (fp16 d and, for Q4_K/Q5_K, dmin) sit first, Q6_K's d last; d
    # brings a typical weight (sub-scale times quant: ~250, ~500, ~1000) near 1/sqrt(fan_in)
    typical = {"Q4_K": 250.0, "Q5_K": 500.0, "Q6_K": 1000.0}[kind.name]
    scale = np.float16(1.0 / (typical * math.sqrt(shape[1]))).tobytes()
    offsets = (size - 2,) if kind == gguf.GGMLQuantizationType.Q6_K else (0, 2)
    for offset in offsets:
        data[..., offset:offset + 2] = np.frombuffer(scale, dtype=np.uint8)
    return data.reshape(shape[0], -1)


def _llama3_factors(config: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """Llama 3's scaling as llama.cpp's converter writes it: a divisor per frequency."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_bpe_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """A make_model tokenizer (byte-level BPE, Llama 3's split) as a "gpt2" vocabulary."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in spec["added_tokens"]}
    by_id.update(special)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             if i in by_id else gguf.TokenType.UNUSED for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in spec["model"]["merges"]])
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        if config.get(key) is not None:
            add(ids[config[key]])
    if config.get("pad_token") is None and "eos_token" in config:
        # transformers' Phi3Config would otherwise take pad id 32000, outside a tiny vocabulary
        writer.add_pad_token_id(ids[config["eos_token"]])
    writer.add_add_bos_token(config.get("bos_token") is not None)
    writer.add_chat_template(config["chat_template"])


_SPM_TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.
Tokenizers split text into pieces; sentencepiece marks word starts with a low line.
    def main():  return 42  # indented code, numbers 1234 and 56.78
Ünïcödé, 日本語のテキスト, emoji 🦙 and tabs\tbetween words.
"""


def write_spm_tokenizer_gguf(out: Path, arch: str = "llama") -> Path:
    """A GGUF holding only a SentencePiece-style vocabulary ("llama" tokenizer model): <unk>,
    <s>, </s>, the 256 byte tokens, then pieces learned on a few lines, scored by rank."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(_SPM_TEXT.splitlines() * 4, vocab_size=420, min_frequency=1,
                                show_progress=False)
    pieces = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [p for p, _ in pieces if p not in tokens]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(tokens) - 259))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(arch != "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
