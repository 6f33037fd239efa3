"""GGUF files before llama.cpp sees them: which file a path means, and a bounds-checked read of the
header (llama.cpp only answers NULL for a bad file, and a truncated one may load and then read past
its mapping)."""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mesh_llm.engines.base import EngineError

# GGUF metadata value types -> struct format (8: string, 9: array are variable-length)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SHORT_ARRAY = 4096  # longer arrays are vocab data, never read here


class _GGUFHeader:
    """A bounds-checked reader of a GGUF header (gguf.GGUFReader takes seconds: it parses every
    vocab entry into arrays)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past the end of the file")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        """A scalar or string value; a short array of scalars (per-layer values) as a tuple, other
        arrays (the vocab) skipped as None."""
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.read("I"), self.read("Q")
            if etype not in _GGUF_SCALARS:
                for _ in range(n):
                    self.value(etype)
                return None
            if n > _SHORT_ARRAY:
                self.pos += n * struct.calcsize(_GGUF_SCALARS[etype])
                return None
            fmt = f"<{n}{_GGUF_SCALARS[etype]}"
            values = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += struct.calcsize(fmt)
            return values
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.read(_GGUF_SCALARS[vtype])


def check_gguf(path: Path) -> dict[str, object]:
    """Validate magic, header and tensor extents, returning the metadata (scalars, strings, short arrays): llama.cpp only
    answers NULL for a bad file, and a truncated one may load and then read past the mapping."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise EngineError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            h = _GGUFHeader(buf)
            h.pos = 4
            try:
                version = h.read("I")
                if version not in (2, 3):
                    raise EngineError(f"{path}: unsupported GGUF version {version}")
                n_tensors, n_kv = h.read("Q"), h.read("Q")
                meta = {}
                for _ in range(n_kv):
                    key = h.string()
                    meta[key] = h.value(h.read("I"))
                tensors = []
                for _ in range(n_tensors):
                    name, n_dims = h.string(), h.read("I")
                    dims = [h.read("Q") for _ in range(n_dims)]
                    tensors.append((name, dims, h.read("I"), h.read("Q")))
            except (struct.error, ValueError) as e:
                raise EngineError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    align = int(meta.get("general.alignment") or 32)
    data_start = -(-h.pos // align) * align
    end = data_start
    for name, dims, ttype, offset in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise EngineError(f"{path}: tensor {name} has unknown type {ttype}") from None
        end = max(end, data_start + offset + int(np.prod(dims, dtype=np.uint64)) // block * type_size)
    if end > size:
        raise EngineError(f"{path}: truncated GGUF file ({size:,} bytes, its tensors need {end:,})")
    return meta


def resolve(path: Path) -> Path:
    """The .gguf file to load: ``path`` itself, or the one GGUF (or first shard) in a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        shards = [f for f in files if re.search(r"-00001-of-\d{5}\.gguf$", f.name)]
        if len(shards) == 1 or len(files) == 1:
            return (shards or files)[0]
        raise EngineError(f"{path}: expected one .gguf file in the folder, found {len(files)}")
    if not path.is_file():
        raise EngineError(f"{path}: model file not found")
    return path
