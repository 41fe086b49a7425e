"""Small GGUF files for the tests, written with the `gguf` package the way llama.cpp's converter
(`convert_hf_to_gguf.py`) writes them: `write_gguf` turns a `make_model` checkpoint into one
(metadata keys, tensor names from `gguf.get_tensor_name_map`, the llama family's q/k rows
permuted into llama.cpp's RoPE layout, Gemma's norms stored plus one, Llama 3's RoPE scaling as
a `rope_freqs` tensor, 2-D weights in the asked type and the rest F32), and
`write_spm_tokenizer_gguf` a SentencePiece-style vocabulary (scores, byte tokens, no merges).
`cleave_logits` runs a fresh prompt through Cleave's model outside the engine.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.models.loader import load_model
from workers.models.model_config import ModelConfig

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "phi3": "phi3"}
# a block of 256 values, the K-quants' unit; rows narrower than that stay F32 in such files
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


class WindowedPromptBackend(AttentionBackend):
    """Causal attention within each fresh prompt, with an optional sliding window; no cache."""

    name = "test-windowed-prompt"

    def forward(self, q, k, v, kv_cache, meta, scale, *, window=None, sinks=None):  # type: ignore[no-untyped-def]
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for s, e in itertools.pairwise(starts):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            group = q.shape[1] // k.shape[1]
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            i = torch.arange(e - s)
            mask = i[None, :] <= i[:, None]
            if window is not None:
                mask &= i[:, None] - i[None, :] < window
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                      scale=scale).transpose(0, 1)
        return out


def cleave_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, config, dtype=torch.float32, device="cpu",
                       attn_backend=WindowedPromptBackend())
    return prompt_logits(model, prompt)


def prompt_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """A loaded model's logits at every position of `prompt`, in one pass without a cache."""
    n = len(prompt)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), num_decodes=0, max_query_len=n,
        max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), torch.arange(n),
                       [torch.empty(0)] * len(model.model.layers), meta)
        return model.compute_logits(hidden)


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
    """A GGUF holding only a SentencePiece-style vocabulary ("llama" tokenizer model): the
    family's special tokens, the 256 byte tokens, a user-defined `<think>`, then pieces learned
    on a few lines, scored by rank (Gemma's also runs of spaces, stored as spaces)."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(_SPM_TEXT.splitlines() * 4, vocab_size=420, min_frequency=1,
                                show_progress=False)
    pieces = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    gemma = arch == "gemma3"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if gemma else [
        "<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["<think>"]
    types = [gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.CONTROL
             for t in specials] + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.USER_DEFINED]
    learned = [p for p, _ in pieces if p not in tokens] + (["  ", "    "] if gemma else [])
    tokens += learned
    types += [gguf.TokenType.NORMAL] * len(learned)
    scores = [0.0] * (len(tokens) - len(learned)) + [-float(i) for i in range(len(learned))]
    writer = gguf.GGUFWriter(str(out), arch)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_unk_token_id(ids["<unk>"])
    writer.add_bos_token_id(ids["<bos>" if gemma else "<s>"])
    writer.add_eos_token_id(ids["<eos>" if gemma else "</s>"])
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(not gemma)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


EDGE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; sentencepiece marks word starts.",
    "", " ", "  leading spaces", "trailing spaces   ", "a  b   c    d\t\te\n\nf\r\n g",
    "\n\n\n", "    def main():\n        return 42\n",
    "Ünïcödé, 日本語のテキスト, emoji 🦙🦙 and Ελληνικά; ∑ ≠ ∞",
    "numbers 1234567 3.14159 and 1,000,000",
    "<think>reasoning</think> then <s>text</s> and <|im_start|>user<|im_end|>",
    "<|begin_of_text|>hi<|eot_id|>", "don't won't I'll we've",
]


def assert_same_tokenizer(path: Path, texts: list[str] = EDGE_TEXTS,
                          saved: Path | None = None) -> None:
    """Cleave's tokenizer of the GGUF file at `path` gives transformers' ids and text.
    `saved`: transformers' reading of that file, saved before as a folder (it reads at once)."""
    import transformers

    from workers.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(path)
    theirs = (transformers.AutoTokenizer.from_pretrained(str(saved)) if saved is not None else
              transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    # every id names the same token (transformers' GPT-2 class may append its own
    # "<|endoftext|>" past a vocabulary that lacks one)
    every_id = list(range(len(ours)))
    assert ours.convert_ids_to_tokens(every_id) == theirs.convert_ids_to_tokens(every_id)
    assert len(theirs) - len(ours) in (0, 1)

