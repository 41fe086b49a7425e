"""Write a small, real tokenizer for a synthetic checkpoint (no model hub needed).

`write_tokenizer_files` trains a byte-level BPE on the corpus below with the `tokenizers` library
and writes `tokenizer.json` plus a `tokenizer_config.json` that `transformers.AutoTokenizer`
loads, with the special tokens and chat template of the family named by `arch`:

| arch    | bos                 | eos (stop here) | pad             | also stop at      | template |
|---------|---------------------|-----------------|-----------------|-------------------|----------|
| llama   | `<|begin_of_text|>` | `<|eot_id|>`    | none            | `<|end_of_text|>` | Llama 3  |
| mistral | `<s>`               | `</s>`          | none            | -                 | `[INST]` |
| qwen2   | none                | `<|im_end|>`    | `<|endoftext|>` | `<|endoftext|>`   | ChatML   |
| gemma   | `<bos>`             | `<end_of_turn>` | `<pad>`         | `<eos>`           | Gemma 3  |
| deepseek| `<｜begin▁of▁sentence｜>` | `<｜end▁of▁sentence｜>` | the eos | -  | DeepSeek-R1 |
| harmony | none                | `<|return|>`    | `<|endoftext|>` | `<|call|>`, eot   | Harmony  |

(deepseek_v3 checkpoints get the deepseek family, gpt_oss the harmony one: their reasoning
templates, `workers.tokenizer.reasoning_templates`.)

bos is added by the post-processor on `encode(add_special_tokens=True)` (llama, mistral) and by the
chat template itself, which is why chat prompts are encoded with `add_special_tokens=False`.
The output is deterministic: the same arguments give a byte-identical `tokenizer.json`. The
families' special tokens and chat templates are `workers.tokenizer.families`; the training corpus
is kept inline below, so the tokenizer is built the same way with no package data to ship.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from workers.tokenizer.families import FAMILIES, SUPPORTED_ARCHS, Family

MAX_TOKENIZER_VOCAB = 8192
# Llama 3's pre-tokenizer split: contractions, words, numbers in groups of three, punctuation runs.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerInfo:
    """Ids of the tokenizer written by `write_tokenizer_files`.

    `vocab_size` counts every id, special tokens included (it can be far below the model's vocab).
    `eos_token_id` is the tokenizer's `eos_token`: the id a chat turn ends with. `stop_token_ids` is
    every id generation should stop at, `eos_token_id` first; write it as `eos_token_id` in
    `config.json` / `generation_config.json` so `Tokenizer.from_pretrained` stops at all of them.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    stop_token_ids: tuple[int, ...]


# Training text: English prose, dialogue, code, numbers, and multi-byte UTF-8 (accents, CJK, emoji)
# so that merges cover two-, three- and four-byte characters.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he rowed out past the harbour wall, and every evening he came home with his nets.
"What did you catch today?" she asked. "Nothing but the wind," he said, and they both laughed.
It was the best of times, it was the worst of times; it was the age of wisdom and of foolishness.
A language model predicts the next token given the previous tokens in the sequence.
Inference servers batch many requests together so the accelerator stays busy.
The scheduler decides which requests run in each step, and the cache stores keys and values.
Prefill processes the whole prompt at once; decode produces one token per step per request.
Throughput is measured in tokens per second, latency in milliseconds per output token.
Please summarize the following article in three sentences, then list two open questions.
You are a helpful assistant. Answer concisely and cite your sources when you can.
Hello! How can I help you today? I'd like to book a table for two at 7:30 pm, please.
We're sure they'll arrive soon; I've heard it's raining, so don't worry if they're late.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"fib({i}) = {fibonacci(i)}")

class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_computed_tokens = 0

import json
data = {"name": "cleave", "version": "0.1.0", "tags": ["llm", "serving"], "ok": true}
print(json.dumps(data, indent=2))
SELECT id, name, created_at FROM users WHERE age >= 18 ORDER BY created_at DESC LIMIT 10;
<div class="note"><p>Tokenizers split text into pieces &amp; map them to ids.</p></div>
if (x != nullptr && x->next) { return x->next->value * 2 + 1; } else { return -1; }
0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 512 1024 2048 4096 8192 65536 128256
3.14159 2.71828 1.41421 -0.5 1e-6 6.022e23 $19.99 50% 2024-01-15 12:34:56 +1 (555) 010-9999
The total is 1,234,567.89 euros, up 12.5% from last year's 1,097,393.68 euros.
Café, naïve, façade, résumé, déjà vu, crème brûlée, piñata, jalapeño, Ångström, Zürich.
Le cœur a ses raisons que la raison ne connaît point. L'été dernier, nous sommes allés à Genève.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, schön, Mädchen, Tschüß.
¿Dónde está la biblioteca? Mañana será otro día. ¡Qué bueno verte, señor Muñoz!
Москва — столица России. Привет, как дела? Спасибо, всё хорошо.
Καλημέρα κόσμε. Η γλώσσα είναι ζωντανή. Αθήνα, Θεσσαλονίκη.
東京は日本の首都です。今日はいい天気ですね。私は猫が好きです。
我们今天去公园散步。中文分词是一个有趣的问题。你好，世界！谢谢你的帮助。
서울은 한국의 수도입니다. 안녕하세요, 만나서 반갑습니다.
مرحبا بالعالم. שלום עולם. नमस्ते दुनिया। สวัสดีชาวโลก
Emoji: 😀 😃 😄 😁 😂 🤣 😊 🙂 🙃 😉 😍 🥰 😘 🤔 🤖 🚀 🌍 🌟 🔥 💡 ✅ ❌ ⚡ ☕ 🍕 🎉 👍 👋 🙏
Family and flags: 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 🇯🇵 🇧🇷 — and skin tones: 👍🏽 👋🏿 🙌🏻
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ π θ λ μ Ω → ⇒ ∀ ∃ ∈ ∅ ∂ ∇ ℝ ℕ
Typography: “quotes” ‘single’ — em dash – en dash … ellipsis • bullet © ® ™ § ¶ € £ ¥ ₹
The robot 🤖 said "こんにちは" and the café ☕ owner replied «Bonjour!» with a smile 😊.
Numbers in text: chapter 7, verse 21, room 404, flight UA 2567, pi is about 3.14159.
Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.
Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex ea.
The weather today is sunny with a high of 24°C and a low of 15°C; tomorrow, light rain.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.
All happy families are alike; each unhappy family is unhappy in its own way.
In the beginning the universe was created. This has made a lot of people very angry.
"""


def write_tokenizer_files(out_dir: Path | str, *, arch: str, vocab_size: int) -> TokenizerInfo:
    """Train and write `tokenizer.json` and `tokenizer_config.json` into `out_dir` (created if
    missing).

    The tokenizer has at most `min(vocab_size, 8192)` ids, special tokens included.
    """
    family = FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    num_specials = len(family.leading_specials) + len(family.trailing_specials)
    budget = min(vocab_size, MAX_TOKENIZER_VOCAB)
    min_vocab = 256 + num_specials + 16
    if budget < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer of arch {arch!r}; "
            f"expected at least {min_vocab}"
        )
    tokenizer = _train(family, budget - len(family.trailing_specials))
    tokenizer.add_special_tokens(list(family.trailing_specials))
    if family.bos is not None:
        bos_id = tokenizer.token_to_id(family.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B:1",
            special_tokens=[(family.bos, bos_id)],
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = _tokenizer_config(family, tokenizer)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    eos_id = _token_id(tokenizer, family.eos)
    return TokenizerInfo(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=None if family.bos is None else tokenizer.token_to_id(family.bos),
        eos_token_id=eos_id,
        pad_token_id=None if family.pad is None else tokenizer.token_to_id(family.pad),
        stop_token_ids=(eos_id, *(_token_id(tokenizer, t) for t in family.extra_stops)),
    )


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a special token the tokenizer was trained with."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the trained tokenizer has no token {token!r}")
    return token_id


def _train(family: Family, learned_vocab_size: int) -> Tokenizer:
    """Byte-level BPE with `family.leading_specials` at ids 0.. and <= `learned_vocab_size` ids."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()  # its settings are fixed (the arguments did nothing)
    trainer = trainers.BpeTrainer(
        vocab_size=learned_vocab_size,
        min_frequency=2,
        special_tokens=list(family.leading_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _tokenizer_config(family: Family, tokenizer: Tokenizer) -> dict[str, object]:
    """`tokenizer_config.json` as transformers writes it for a `PreTrainedTokenizerFast`."""
    added = {
        str(token_id): {
            "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    config: dict[str, object] = {"added_tokens_decoder": added}
    if family.bos is not None:
        config["bos_token"] = family.bos
    config.update({
        "chat_template": family.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": family.eos,
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": family.model_max_length,
        "pad_token": family.pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    if family.unk is not None:
        config["unk_token"] = family.unk
    return config
