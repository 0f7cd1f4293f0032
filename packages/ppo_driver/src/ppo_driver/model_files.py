"""Whether a model's files are whole, read from their own tables without loading a tensor: a
``.safetensors`` file's header (its tensors' byte ranges) and a GGUF file's header (its tensors'
shapes, types and offsets) against the file's size. A copy cut short, or a header cut in the middle,
is found in milliseconds, before anything loads the weights (or Ray starts).

Each check returns None for a whole file, else one line: "``path`` is truncated or damaged (...)".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

__all__ = ["DamagedFile", "gguf_problem", "safetensors_problem"]


class DamagedFile(ValueError):
    """A model file whose own header says it should be larger, or that cannot be parsed."""


def _damaged(path: Path, detail: str) -> str:
    return f"{path} is truncated or damaged ({detail})"


def safetensors_problem(path: Path) -> str | None:
    """A ``.safetensors`` file: 8 bytes of header length, the JSON header, then the tensors' bytes at
    the header's ``data_offsets``; the file must hold the last one."""
    size = path.stat().st_size
    if size < 8:
        return _damaged(path, f"{size} of at least 8 bytes")
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            return _damaged(path, f"{size} bytes; its header alone says {8 + header_len}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return _damaged(path, f"{size} bytes; its header is not JSON")
    if not isinstance(header, dict):
        return _damaged(path, f"{size} bytes; its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return _damaged(path, f"{size} bytes; tensor {name!r} has no data_offsets")
        end = max(end, offsets[1])
    expected = 8 + header_len + end
    if size < expected:
        return _damaged(path, f"{size} of {expected} bytes")
    return None


# GGUF metadata value types (ggml's gguf.h): fixed-size ones by their struct code; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise DamagedFile(f"{self.size} bytes; its header is cut at byte {self.f.tell()}")
        return data

    def unpack(self, code: str) -> int | float | bool:
        value: int | float | bool = struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]
        return value

    def string(self) -> str:
        n = int(self.unpack("Q"))
        if n > self.size:
            raise DamagedFile(f"{self.size} bytes; a string in its header claims {n} bytes")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = int(self.unpack("I")), int(self.unpack("Q"))
            if count > self.size:
                raise DamagedFile(f"{self.size} bytes; an array in its header claims {count} items")
            return [self.value(inner) for _ in range(count)]
        raise DamagedFile(f"{self.size} bytes; unknown metadata type {kind} at byte {self.f.tell()}")


def gguf_problem(path: Path) -> str | None:
    """A GGUF file: the header (metadata, then each tensor's dims, type and offset) read in full, and
    the data section, aligned after it, holding every tensor's bytes (ggml's block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with path.open("rb") as f:
        r = _Reader(f, size)
        try:
            if r.take(4) != b"GGUF":
                return _damaged(path, f"{size} bytes; it does not start with the GGUF magic")
            version = int(r.unpack("I"))
            count_code = "I" if version == 1 else "Q"
            n_tensors, n_kv = int(r.unpack(count_code)), int(r.unpack(count_code))
            alignment = 32
            for _ in range(n_kv):
                key = r.string()
                value = r.value(int(r.unpack("I")))
                if key == "general.alignment" and isinstance(value, int):
                    alignment = value
            end = 0
            for _ in range(n_tensors):
                name = r.string()
                dims = [int(r.unpack("Q")) for _ in range(int(r.unpack("I")))]
                kind, offset = int(r.unpack("I")), int(r.unpack("Q"))
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    return _damaged(path, f"{size} bytes; tensor {name!r} has unknown type {kind}")
                elements = 1
                for d in dims:
                    elements *= d
                end = max(end, offset + elements // block * type_size)
        except DamagedFile as exc:
            return _damaged(path, str(exc))
        header_end = f.tell()
    data_start = -(-header_end // alignment) * alignment
    expected = data_start + end
    if size < expected:
        return _damaged(path, f"{size} of {expected} bytes")
    return None
