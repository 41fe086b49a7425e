"""The tokenizer package against transformers' `AutoTokenizer` on the same folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerInfo,
    write_tokenizer_files,
)

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "mistral", "qwen2", "gemma")
SAMPLE_TEXTS = (
    "",
    "Hello world",
    " leading space and trailing space ",
    "def f(x):\n    return x * 2\n",
    "Café déjà vu — 東京は日本の首都です。😀🚀 👨‍👩‍👧‍👦",
    "numbers 1234567 and 3.14159",
    "special tokens in text: <|eot_id|> <s> </s> <|im_end|>",
)
SYSTEM_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of Japan?"},
    {"role": "assistant", "content": "Tokyo (東京) 🗼"},
    {"role": "user", "content": "And of France?"},
]
USER_ONLY_CONVERSATION = [{"role": "user", "content": "  Say hi in 3 languages.  "}]


@dataclass(frozen=True)
class Built:
    path: Path
    info: TokenizerInfo
    ours: Tokenizer
    theirs: object  # transformers' tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    result = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        info = write_tokenizer_files(path, arch=arch, vocab_size=512)
        theirs = transformers.AutoTokenizer.from_pretrained(path)
        result[arch] = Built(path, info, Tokenizer.from_pretrained(path), theirs)
    return result


def copy_folder(built: Built, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(built.path, dest)
    return dest


# --- build ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_byte_identical_when_repeated(arch: str, built: dict[str, Built], tmp_path: Path) -> None:
    info = write_tokenizer_files(tmp_path, arch=arch, vocab_size=512)
    assert info == built[arch].info
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (built[arch].path / name).read_bytes()


@pytest.mark.parametrize("vocab_size", [512, 8192, 128256])
def test_vocab_fits_the_requested_size(vocab_size: int, tmp_path: Path) -> None:
    info = write_tokenizer_files(tmp_path, arch="llama", vocab_size=vocab_size)
    assert info.vocab_size <= min(vocab_size, 8192)
    assert Tokenizer.from_pretrained(tmp_path).vocab_size == info.vocab_size


def test_build_rejects_unknown_arch_and_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gpt2'.*llama"):
        write_tokenizer_files(tmp_path, arch="gpt2", vocab_size=512)
    with pytest.raises(ValueError, match="vocab_size=100"):
        write_tokenizer_files(tmp_path, arch="qwen2", vocab_size=100)


def test_special_token_ids_per_arch(built: dict[str, Built]) -> None:
    for arch, b in built.items():
        theirs = b.theirs
        assert b.info.bos_token_id == theirs.bos_token_id == b.ours.bos_token_id, arch
        assert b.info.eos_token_id == theirs.eos_token_id == b.ours.eos_token_id, arch
        assert b.info.pad_token_id == theirs.pad_token_id, arch
        assert b.info.vocab_size == len(theirs) == b.ours.vocab_size, arch
        assert b.info.stop_token_ids[0] == b.info.eos_token_id
    llama = built["llama"].ours
    assert llama.convert_ids_to_tokens(built["llama"].info.eos_token_id) == "<|eot_id|>"
    assert llama.convert_ids_to_tokens(list(built["llama"].info.stop_token_ids)) == ["<|eot_id|>", "<|end_of_text|>"]
    assert built["qwen2"].ours.convert_ids_to_tokens(built["qwen2"].info.eos_token_id) == "<|im_end|>"
    assert built["mistral"].info.eos_token_id == 2


# --- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_and_decode_match_transformers(arch: str, built: dict[str, Built]) -> None:
    b = built[arch]
    for text in SAMPLE_TEXTS:
        for add in (True, False):
            ids = b.ours.encode(text, add_special_tokens=add)
            assert ids == b.theirs.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert b.ours.decode(ids, skip_special_tokens=skip) == b.theirs.decode(ids, skip_special_tokens=skip)
    assert b.ours.convert_ids_to_tokens(list(range(20))) == b.theirs.convert_ids_to_tokens(list(range(20)))
    assert set(b.ours.all_special_ids) == {i for i, t in b.theirs.added_tokens_decoder.items() if t.special}


def test_bos_is_added_only_for_llama_and_mistral(built: dict[str, Built]) -> None:
    assert built["llama"].ours.encode("hi")[0] == built["llama"].info.bos_token_id
    assert built["mistral"].ours.encode("hi")[0] == 1
    assert built["qwen2"].ours.encode("hi") == built["qwen2"].ours.encode("hi", add_special_tokens=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), arch=st.sampled_from(ARCHS))
def test_random_text_round_trips_like_transformers(text: str, arch: str, built: dict[str, Built]) -> None:
    b = built[arch]
    ids = b.ours.encode(text, add_special_tokens=False)
    assert ids == b.theirs.encode(text, add_special_tokens=False)
    assert b.ours.decode(ids) == b.theirs.decode(ids, skip_special_tokens=True)


# --- chat templates ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("conversation", [SYSTEM_CONVERSATION, USER_ONLY_CONVERSATION])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    arch: str, conversation: list[dict[str, str]], add_generation_prompt: bool, built: dict[str, Built]
) -> None:
    b = built[arch]
    text = b.ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == b.theirs.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = b.ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == b.theirs.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    if b.info.bos_token_id is not None:  # the template writes bos once; encoding must not add another
        assert ids.count(b.info.bos_token_id) == 1 and ids[0] == b.info.bos_token_id


def test_generation_prompt_ends_with_the_assistant_header(built: dict[str, Built]) -> None:
    llama = built["llama"].ours.apply_chat_template(USER_ONLY_CONVERSATION)
    assert llama.startswith("<|begin_of_text|><|start_header_id|>user") and llama.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    qwen = built["qwen2"].ours.apply_chat_template(USER_ONLY_CONVERSATION)
    assert qwen.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert qwen.endswith("<|im_start|>assistant\n")
    gemma = built["gemma"].ours.apply_chat_template(SYSTEM_CONVERSATION[:2])
    assert gemma == ("<bos><start_of_turn>user\nYou are terse.\n\nWhat is the capital of "
                     "Japan?<end_of_turn>\n<start_of_turn>model\n")
    assert built["mistral"].ours.apply_chat_template(USER_ONLY_CONVERSATION).startswith("<s> [INST] ")


def test_tools_and_tool_calls_render_like_transformers(built: dict[str, Built]) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    conversation = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    b = built["qwen2"]
    ours = b.ours.apply_chat_template(conversation, tools=tools)
    assert ours == b.theirs.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"description": "Weather <now> & later"' in ours  # tojson does not HTML-escape


def test_template_exceptions_become_chat_template_errors(built: dict[str, Built]) -> None:
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        built["mistral"].ours.apply_chat_template(two_users)


def test_chat_template_jinja_file_takes_precedence(built: dict[str, Built], tmp_path: Path) -> None:
    folder = copy_folder(built["qwen2"], tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ eos_token }}", encoding="utf-8"
    )
    ours = Tokenizer.from_pretrained(folder).apply_chat_template(SYSTEM_CONVERSATION)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        SYSTEM_CONVERSATION, add_generation_prompt=True, tokenize=False
    )
    assert ours == theirs == "[system|You are terse.][user|What is the capital of Japan?]" + (
        "[assistant|Tokyo (東京) 🗼][user|And of France?]<|im_end|>"
    )


def test_named_templates_in_config_pick_default(built: dict[str, Built], tmp_path: Path) -> None:
    folder = copy_folder(built["llama"], tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [
        {"name": "rag", "template": "RAG"},
        {"name": "default", "template": "DEFAULT {{ messages | length }}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.apply_chat_template(USER_ONLY_CONVERSATION) == "DEFAULT 1"
    assert tokenizer.apply_chat_template(USER_ONLY_CONVERSATION, tools=[{"a": 1}]) == 'TOOLS [{"a": 1}]'


# --- loading and errors -----------------------------------------------------------------------


def test_generation_config_adds_stop_ids(built: dict[str, Built], tmp_path: Path) -> None:
    folder = copy_folder(built["llama"], tmp_path)
    stops = list(built["llama"].info.stop_token_ids)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset(stops)
    assert built["llama"].ours.eos_token_ids == frozenset([built["llama"].info.eos_token_id])


def test_missing_tokenizer_json_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
        Tokenizer.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("messages, bad", [
    ("hello", "'hello'"),
    ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]"),
    ([["user", "hi"]], r"messages\[0\]"),
])
def test_invalid_messages_name_the_bad_item(messages: object, bad: str, built: dict[str, Built]) -> None:
    with pytest.raises(ValueError, match=bad):
        built["llama"].ours.apply_chat_template(messages)  # type: ignore[arg-type]


def test_model_without_template_says_so(built: dict[str, Built], tmp_path: Path) -> None:
    folder = copy_folder(built["mistral"], tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer.from_pretrained(folder).apply_chat_template(USER_ONLY_CONVERSATION)


def test_out_of_range_id_is_rejected(built: dict[str, Built]) -> None:
    with pytest.raises(ValueError, match="token id 99999 is out of range"):
        built["qwen2"].ours.convert_ids_to_tokens([99999])


def test_package_does_not_import_torch() -> None:
    code = "import sys, workers.tokenizer; sys.exit(1 if 'torch' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


# --- incremental detokenizer ------------------------------------------------------------------


def stream(tokenizer: Tokenizer, prompt: list[int], chunks: list[list[int]], skip: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detokenizer.add_tokens(chunk) for chunk in chunks] + [detokenizer.flush()]


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_emoji_and_cjk_never_show_broken_characters(arch: str, built: dict[str, Built]) -> None:
    tokenizer = built[arch].ours
    text = "東京 😀🚀 👨‍👩‍👧‍👦 crème brûlée — ∑ 한국어 🇯🇵!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.apply_chat_template(USER_ONLY_CONVERSATION, tokenize=True)
    deltas = stream(tokenizer, prompt, [[i] for i in ids] + [[built[arch].info.eos_token_id]])
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas[:-2]  # some character really was split across tokens and held back


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), arch=st.sampled_from(ARCHS), skip=st.booleans())
def test_deltas_concatenate_to_the_full_decode(data: st.DataObject, arch: str, skip: bool,
                                               built: dict[str, Built]) -> None:
    tokenizer = built[arch].ours
    id_strategy = st.integers(0, tokenizer.vocab_size - 1)
    prompt = data.draw(st.lists(id_strategy, max_size=8), label="prompt")
    output = data.draw(st.lists(id_strategy, max_size=24), label="output")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(output)), max_size=6), label="cuts"))
    chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    deltas = stream(tokenizer, prompt, chunks, skip)
    final = tokenizer.decode(output, skip_special_tokens=skip)
    assert "".join(deltas) == final
    if "\ufffd" not in final:
        assert not any("\ufffd" in delta for delta in deltas)


def test_add_tokens_after_flush_is_an_error(built: dict[str, Built]) -> None:
    detokenizer = IncrementalDetokenizer(built["llama"].ours, [])
    detokenizer.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        detokenizer.add_tokens([1])
