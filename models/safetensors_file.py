"""Reading a safetensors file's header ourselves, so a damaged file fails with a clear error.

Why: safetensors' own errors (e.g. `MetadataIncompleteBuffer`) name neither the file nor what
is wrong, and a file whose data bytes were overwritten loads without complaint. The format is
an 8-byte little-endian header length N, N bytes of JSON (`name -> {dtype, shape,
data_offsets: [begin, end]}` plus an optional `__metadata__`), then the data section, whose
length must be the largest `end`. Checking that costs one small read per file, so the loader
does it for every file before it maps any: a truncated download, a garbled header or tensors
whose byte ranges disagree with their shapes are named, with the file, before any copy.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
                "C64": 8}
_MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header."""


class DamagedCheckpointError(ValueError):
    """A safetensors file is truncated, has an unreadable header, or its offsets are inconsistent."""


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """`tensor name -> {"dtype", "shape", "data_offsets"}` from `path`'s header, after checking that
    the file is as long as the header says and every tensor's byte range fits its dtype and shape.
    Raises DamagedCheckpointError naming the file and the problem."""
    path = Path(path)
    size = path.stat().st_size

    def damaged(what: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"damaged checkpoint file {str(path)!r} ({size} bytes): {what}; "
                                      f"download or convert it again")

    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise damaged("shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise damaged(f"unreadable header: its length field says {header_len} bytes, the file has "
                          f"{size - 8} after it")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise damaged(f"unreadable header (not valid JSON: {error})") from None
    if not isinstance(header, dict):
        raise damaged(f"unreadable header (a JSON {type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    data_len, end_max = size - 8 - header_len, 0
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        except (TypeError, KeyError, ValueError):
            raise damaged(f"unreadable header entry for tensor {name!r}: {info!r}") from None
        if end - begin != nbytes or begin < 0:
            raise damaged(f"tensor {name!r} ({dtype}, shape {list(shape)}) needs {nbytes} bytes but its "
                          f"data_offsets {[begin, end]} span {end - begin}")
        end_max = max(end_max, end)
    if data_len != end_max:
        kind = "truncated" if data_len < end_max else "has trailing bytes"
        raise damaged(f"{kind}: size mismatch, the header's offsets need a data section of {end_max} bytes, "
                      f"the file holds {data_len}")
    return header


TORCH_DTYPES = {  # safetensors dtype name -> torch dtype
                "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
                "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
                "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
