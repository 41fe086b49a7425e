"""The tokenizer a GGUF file describes, built by Cleave, against transformers' GGUF loading of the
same file: the same ids on real text and on the edge cases (runs of whitespace, unicode outside
the vocabulary, special and user-defined tokens in the text), and the same text back."""

from __future__ import annotations

import pytest

from tests.workers.gguf_files import assert_same_tokenizer, write_gguf, write_spm_tokenizer_gguf
from workers.models.make_model import make_model
from workers.tokenizer import Tokenizer
from workers.tokenizer.gguf_file import GGUFError

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_sentencepiece_vocabularies(tmp_path, arch):
    assert_same_tokenizer(write_spm_tokenizer_gguf(tmp_path / f"{arch}.gguf", arch))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_byte_level_vocabularies_with_chat_template(tmp_path, arch):
    hf_dir = make_model(tmp_path / "hf", arch=arch, preset="tiny")
    path = write_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0")
    assert_same_tokenizer(path)
    ours, source = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, tokenize=True) == source.apply_chat_template(
        messages, tokenize=True)
    assert ours.eos_token_id == source.eos_token_id


def test_an_unknown_vocabulary_kind_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="tokenizer model 'rwkv' is not supported"):
        Tokenizer.from_pretrained(tmp_path / "t.gguf")
