"""A GGUF file's header read in one pass: the metadata decoded to Python values, the tensors'
names, types and shapes, their data memory-mapped and left unread.

The `gguf` package's own `GGUFReader` builds a numpy view for every element of every array
before it returns: ten seconds for SmolLM2's 49,152-token vocabulary and its merges, paid by
every process that loads the model (the router's tokenizer, each worker). Read here, the same
header takes a few hundredths of a second. The layout follows llama.cpp's `gguf.md` (versions 2
and 3, either byte order); the type tables (`GGMLQuantizationType`, block sizes) are the `gguf`
package's. Tensors are given as `GGUFReader` gives them (`shape` innermost dimension first;
`data` shaped outermost first, a block-quantized row as its bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: number -> (struct code, numpy dtype); 8 string, 9 array
_SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
            4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
            10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}
_STRING, _ARRAY = 8, 9
# plain element types whose data `GGUFReader` gives as numbers; the rest as bytes per row
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dimensions, innermost first (as stored)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # memory-mapped, outermost dimension first


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool, or a list of them);
    `tensors`: in the file's order. Raises ValueError for a file that is not GGUF."""

    def __init__(self, path: str) -> None:
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]  # numpy exports a buffer
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"no GGUF magic at the start (found {bytes(self._buf[:4])!r})")
        version = struct.unpack_from("<I", self._buf, 4)[0]
        # a big-endian file's version reads as 2**24 and more
        self._order: Literal["<", ">"] = "<" if version & 0xFFFF else ">"
        self._pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        num_tensors, num_fields = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from(self._order + code, self._buf, self._pos)
        self._pos += struct.calcsize(code)
        return value

    def _string(self) -> str:
        size = self._scalar("Q")
        text = str(self._buf[self._pos:self._pos + size], "utf-8")
        self._pos += size
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item in _SCALARS:  # numbers: one numpy read
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder(self._order)
                values = np.frombuffer(self._buf, dtype, count, self._pos)
                self._pos += values.nbytes
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self._pos}")
        return self._scalar(_SCALARS[kind][0])

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, start: int, name: str, dims: list[int], kind: int,
                offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        ggml_type = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        shape = tuple(reversed(dims))
        plain = _PLAIN.get(ggml_type.name)
        dtype: np.dtype[Any]
        if plain is None:
            dtype, count = np.dtype(np.uint8), n_bytes
            shape = quant_shape_to_byte_shape(shape, ggml_type)
        else:
            dtype, count = np.dtype(plain).newbyteorder(self._order), n_elements
        data = np.frombuffer(self._map, dtype, count, start + offset).reshape(shape)
        return GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes,
                          start + offset, data)
