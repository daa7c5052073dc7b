"""A safetensors file memory-mapped once, each tensor a zero-copy view of the mapping.

Why not `safe_open(...).get_slice(name)[:]`: whether that copies depends on the safetensors
version (0.8 maps the file; older releases read each tensor into a fresh buffer first), and it
parses the header that models/safetensors_file.py has already read and checked. Here a tensor's
bytes are mapped privately (copy-on-write: nothing can write to the file through a view) and the
tensor is `frombuffer(mapping)[offset:].view(dtype).view(shape)`: the only copy a load makes is the one
into the parameter, which a weight_loader does (`dest.copy_(view)`, converting the dtype in the
same pass when the checkpoint's differs), and a tensor-parallel loader that narrows the view
reads only the pages of its slice. A tensor whose offset is not a multiple of its element size
(a hand-written file may pack a 1-byte tensor before a 4-byte one) cannot be viewed in place
and is copied once.

Each tensor maps only its own pages, and the mapping lives as long as a view of it (torch keeps
the buffer alive): once the loader has copied a tensor, its pages leave the process's resident
memory (they stay in the page cache), so a load's peak resident memory is the parameters plus one
tensor, not plus the whole file.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from models.safetensors_file import read_safetensors_header

TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
                "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
                "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class MappedSafetensors:
    """`tensor(name)`: a view of the named tensor in the mapped file (`header`: the file's already
    checked header, from read_safetensors_header; read here when not given). Use it as a context
    manager, or call `close()`: views already handed out stay valid."""

    def __init__(self, path: Path, header: dict[str, dict] | None = None) -> None:
        self.path = Path(path)
        self.header = read_safetensors_header(self.path) if header is None else header
        self.file = open(self.path, "rb")
        (header_len,) = memoryview(self.file.read(8)).cast("Q")
        self.data_start = 8 + header_len

    def __enter__(self) -> "MappedSafetensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def names(self) -> list[str]:
        return list(self.header)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor's own mapping of just its pages (unmapped when the last view of it goes, so a
        load's resident memory never holds the whole file), viewed as its dtype and shape."""
        info = self.header[name]
        dtype = TORCH_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {str(self.path)!r} has dtype {info['dtype']}, which torch cannot hold")
        begin, end = (self.data_start + offset for offset in info["data_offsets"])
        if end == begin:
            return torch.empty(info["shape"], dtype=dtype)
        base = begin - begin % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self.file.fileno(), end - base, access=mmap.ACCESS_COPY, offset=base)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)[begin - base:]
        if begin % dtype.itemsize:
            raw = raw.clone()   # misaligned in the file: one copy to aligned memory
        return raw.view(dtype).view(info["shape"])
