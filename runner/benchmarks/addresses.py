"""Microseconds per call of the debug address check on a realistic replay's inputs.

Shape: 10 args/kwargs tensors, an attention-metadata dataclass with 10 tensors and 5 ints,
and a per-layer dict of 30 entries (each a NamedTuple of 2 tensors). CPU tensors: the walk
never touches device memory, so the figure holds on a GPU machine too.

    python scripts/bench_addresses.py
"""

from __future__ import annotations

import sys
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention.metadata import CommonAttentionMetadata  # noqa: E402
from runner.cudagraph.addresses import AddressRecorder, tensor_addresses  # noqa: E402


class LayerState(NamedTuple):
    kv_cache: torch.Tensor
    scratch: torch.Tensor


@dataclass
class Metadata:
    """The real common metadata plus backend extras, as a backend's metadata would hold them."""
    common: CommonAttentionMetadata
    split_offsets: torch.Tensor
    split_lens: torch.Tensor
    per_layer: dict = field(default_factory=dict)


def main() -> None:
    z = lambda: torch.zeros(4)  # noqa: E731
    args = tuple(z() for _ in range(5))
    kwargs = {f"kw{i}": z() for i in range(5)}
    common = CommonAttentionMetadata(*(z() for _ in range(8)), num_reqs=8, num_actual_tokens=8, max_query_len=1,
                                     max_seq_len=512, uniform_decode=True)
    meta = Metadata(common, z(), z(),
                    per_layer={f"model.layers.{i}.self_attn": LayerState(z(), z()) for i in range(30)})
    inputs = {"args": args, "kwargs": kwargs, "attn_metadata": meta}
    n_tensors = len(tensor_addresses(inputs))
    rec = AddressRecorder()
    rec.record(**inputs)
    for name, stmt in (("tensor_addresses", lambda: tensor_addresses(inputs)),
                       ("AddressRecorder.check", lambda: rec.check(**inputs))):
        number = 2000
        best = min(timeit.repeat(stmt, number=number, repeat=7)) / number
        print(f"{name}: {best * 1e6:.1f} us per call ({n_tensors} tensors)")


if __name__ == "__main__":
    main()
