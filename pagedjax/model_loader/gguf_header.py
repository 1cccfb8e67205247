"""A GGUF file's header read in one pass: its metadata and its tensor directory, each tensor's
data a memory-mapped view (nothing copied).

gguf-py's `GGUFReader` builds a NumPy view for every element of every metadata array (a
vocabulary's tens of thousands of strings and merges), paid at every engine start on a GGUF
file (RESULTS.md, stop 64). Here the header is walked with `struct` over the mapped bytes
(string arrays decoded in a loop, number arrays as one `frombuffer`). The layout (GGUF v2/v3,
little-endian) is gguf-py's and llama.cpp's `gguf.cpp`:

    magic "GGUF", version u32, tensor_count u64, kv_count u64,
    kv_count × (key: string, value type u32, value),
    tensor_count × (name: string, n_dims u32, dims u64 × n_dims, ggml type u32, offset u64),
    padding to general.alignment (32), then the tensors' data, each at its offset from there;
    a string is (length u64, UTF-8 bytes); an array is (element type u32, count u64, elements).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # the value types with a length
# GGUF's fixed-size value types: type id → struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
# GGML tensor types read as their own element type; every other type is blocks (uint8 rows)
_ELEMENT_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                  27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF's order: dims[0] is a row's length (ne[0])
    type: int  # GGML type id (gguf.GGMLQuantizationType)
    data: np.ndarray  # memory-mapped: [*reversed(dims[1:]), row] of the element type, or uint8
    # [*reversed(dims[1:]), row bytes] for block types (gguf-py's GGUFReader shapes)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]  # scalars, str, list[str], or a 1-D array for number arrays
    tensors: dict[str, GGUFTensor]  # in the file's order


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def unpack_all(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"{str(self.path)!r} ends inside its GGUF header (at byte "
                             f"{self.offset}): a truncated or not a GGUF file.") from None
        self.offset += struct.calcsize(fmt)
        return values

    def unpack(self, fmt: str):
        values = self.unpack_all(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.offset
        self.offset += length
        if self.offset > len(self.buffer):
            raise ValueError(f"{str(self.path)!r} ends inside its GGUF header (a string of "
                             f"{length} bytes at byte {start}).")
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            element_type, count = self.unpack("<IQ")
            if element_type == STRING:
                return [self.string() for _ in range(count)]
            if element_type in _SCALARS:
                dtype = np.dtype(_SCALARS[element_type].replace("?", "b1"))
                array = np.frombuffer(self.buffer, dtype, count, self.offset).copy()
                self.offset += dtype.itemsize * count
                return array
            return [self.value(element_type) for _ in range(count)]  # arrays of arrays
        if value_type not in _SCALARS:
            raise ValueError(f"{str(self.path)!r}: unknown GGUF value type {value_type} at byte "
                             f"{self.offset - 4}.")
        return self.unpack(_SCALARS[value_type])


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The file's metadata and tensors (ValueError for a file that is not GGUF v2/v3)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    mapped = np.memmap(path, np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    if bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file (it starts {bytes(mapped[:4])!r}, "
                         f"not {MAGIC!r}).")
    cursor.offset = 4
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in VERSIONS:
        raise ValueError(f"{str(path)!r} is GGUF version {version}; pagedjax reads versions "
                         f"{', '.join(map(str, VERSIONS))} (little-endian).")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    directory = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.unpack_all(f"<{cursor.unpack('<I')}Q")
        directory.append((name, dims, *cursor.unpack("<IQ")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in directory:
        outer = tuple(reversed(dims[1:]))
        dtype = _ELEMENT_TYPES.get(ggml_type)
        if dtype is not None:
            shape, dtype = (*outer, dims[0]), np.dtype(dtype)
        else:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            shape, dtype = (*outer, dims[0] // block * block_bytes), np.dtype(np.uint8)
        start = data_start + offset
        stop = start + math.prod(shape) * dtype.itemsize
        if stop > len(mapped):
            raise ValueError(f"{str(path)!r}: tensor {name!r} ends at byte {stop}, after the "
                             f"file's end ({len(mapped)}): a truncated GGUF file.")
        data = mapped[start:stop].view(dtype).reshape(shape)
        tensors[name] = GGUFTensor(name, tuple(dims), ggml_type, data)
    return GGUFHeader(version, metadata, tensors)
