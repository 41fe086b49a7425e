"""A GGUF file (llama.cpp's single-file checkpoint): finding it, opening it
(`gguf_reader.GGUFFile`, with the `gguf` package's type tables), and reading its metadata by
llama.cpp's key names.

Torch-free, so the router's tokenizer and the engine's loader share it. `open_gguf` keeps the
last two files open per process: the config, the tokenizer and the weights each need one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from workers.tokenizer.gguf_reader import GGUFFile

GGUF_SUFFIX = ".gguf"


class GGUFError(ValueError):
    """A GGUF file Cleave cannot serve; the message names what is unsupported or missing
    (architecture, tensor type, metadata key) and the file."""


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself (`*.gguf`), or the one `*.gguf` in a folder
    that has no `config.json` (a Hugging Face folder wins). None when `path` is neither.
    Raises GGUFError for a folder holding several GGUF files: which one is meant is unclear."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == GGUF_SUFFIX else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(f for f in p.iterdir() if f.suffix.lower() == GGUF_SUFFIX and f.is_file())
    if len(files) > 1:
        raise GGUFError(f"model folder {str(p)!r} holds {len(files)} GGUF files "
                        f"{[f.name for f in files]}; pass the path of the one to serve")
    return files[0] if files else None


class GGUFMetadata:
    """A GGUF file's key-value metadata, values decoded (str, int, float, bool, lists)."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    @property
    def architecture(self) -> str:
        """`general.architecture`, llama.cpp's family name ("llama", "qwen2", "gemma3" ...)."""
        return str(self.require("general.architecture"))

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def require(self, key: str) -> Any:
        """The value of `key`; raises GGUFError naming the key and the file when absent."""
        if key not in self._fields:
            raise GGUFError(f"GGUF file {str(self.path)!r} lacks the metadata key {key!r}")
        return self.get(key)

    def arch_key(self, suffix: str, default: Any = None, *, required: bool = False) -> Any:
        """`{architecture}.{suffix}` (e.g. "block_count"), as llama.cpp's converter writes it."""
        key = f"{self.architecture}.{suffix}"
        return self.require(key) if required else self.get(key, default)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file at `path`, its header read (memory-mapped; tensors are read lazily).
    Raises GGUFError when the file is not a GGUF file the reader understands."""
    p = Path(path).resolve()
    try:
        stat = p.stat()
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    return _open(str(p), stat.st_mtime_ns, stat.st_size)


def read_metadata(path: str | Path) -> GGUFMetadata:
    return GGUFMetadata(open_gguf(path), Path(path))


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    # keyed by mtime and size too, so a rewritten file is read again
    del mtime_ns, size
    try:
        import gguf  # noqa: F401 -- the type tables
    except ImportError as e:  # a declared dependency; say so plainly when it is missing
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    try:
        return GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - any parse failure of a foreign file says the same
        raise GGUFError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") from None
