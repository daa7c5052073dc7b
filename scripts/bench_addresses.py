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
from runner.cudagraph.addresses import AddressRecorder, tensor_addresses  # noqa: E402


class LayerState(NamedTuple):
    kv_cache: torch.Tensor
    scratch: torch.Tensor


@dataclass
class Metadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    token_request_index: torch.Tensor
    split_offsets: torch.Tensor
    split_lens: torch.Tensor
    num_reqs: int = 8
    num_actual_tokens: int = 8
    max_query_len: int = 1
    max_seq_len: int = 512
    uniform_decode: bool = True
    per_layer: dict = field(default_factory=dict)


def main() -> None:
    z = lambda: torch.zeros(4)  # noqa: E731
    args = tuple(z() for _ in range(5))
    kwargs = {f"kw{i}": z() for i in range(5)}
    meta = Metadata(*(z() for _ in range(10)),
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
