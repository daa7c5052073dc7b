"""Microseconds per call of the debug address check on a realistic replay's inputs.

Shape: 10 args/kwargs tensors, an attention-metadata dataclass with 10 tensors and 5 ints,
and a per-layer dict of 30 entries (each a NamedTuple of 2 tensors). CPU tensors: the walk
never touches device memory, so the figure holds on a GPU machine too.

    graphrunner bench addresses [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from attention.metadata import CommonAttentionMetadata
from runner.benchmarks.results import add_out_argument, write_json
from runner.cudagraph.addresses import AddressRecorder, tensor_addresses


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench addresses", description=__doc__.splitlines()[0])
    add_out_argument(parser)
    out = parser.parse_args(argv).out
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
    us_per_call = {}
    for name, stmt in (("tensor_addresses", lambda: tensor_addresses(inputs)),
                       ("AddressRecorder.check", lambda: rec.check(**inputs))):
        number = 2000
        best = min(timeit.repeat(stmt, number=number, repeat=7)) / number
        us_per_call[name] = best * 1e6
        print(f"{name}: {best * 1e6:.1f} us per call ({n_tensors} tensors)")
    write_json(out, "addresses.json", {"tensors": n_tensors, "us_per_call": us_per_call, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
