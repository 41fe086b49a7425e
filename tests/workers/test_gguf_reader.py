"""Cleave's one-pass GGUF header reader (`workers.tokenizer.gguf_reader`) against the `gguf`
package's own `GGUFReader` on the same files: every metadata value (and its Python type), and
every tensor's name, type, shape, offset and bytes. Files of plain, bf16, block- and K-quantized
tensors, a BPE and a SentencePiece vocabulary, Llama 3's `rope_freqs`, and a file that is not
GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.workers.gguf_files import write_gguf, write_spm_tokenizer_gguf
from workers.models.make_model import make_model
from workers.tokenizer.gguf_file import GGUFError, open_gguf
from workers.tokenizer.gguf_reader import GGUFFile

gguf = pytest.importorskip("gguf")
K_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64}


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # its own pseudo-fields
    assert list(ours.fields) == keys
    for key in keys:
        value = theirs.fields[key].contents()
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("hf"), arch="llama", preset="tiny",
                      overrides=K_SHAPE)  # llama3 RoPE scaling: a rope_freqs tensor too


@pytest.mark.parametrize("ggml_type", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_written_file_reads_as_the_gguf_package_reads_it(checkpoint, tmp_path, ggml_type):
    assert_same_as_gguf_reader(write_gguf(checkpoint, tmp_path / "m.gguf", ggml_type))


def test_a_sentencepiece_vocabulary_reads_as_the_gguf_package_reads_it(tmp_path):
    assert_same_as_gguf_reader(write_spm_tokenizer_gguf(tmp_path / "spm.gguf"))


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFError, match=r"model\.gguf.*not a readable GGUF file.*magic"):
        open_gguf(bad)
