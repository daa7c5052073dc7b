"""CPU linears of one decode step: F.linear vs MKL's packed weight vs oneDNN's, per row count.

    graphrunner bench cpu_linear [--shape smollm2-135m] [--rows 1 2 4 8 16 32 64 128] [--threads N]
                                 [--steps 3] [--out DIR]

For a model shape (runner/benchmarks/model_shapes.py) every fp32 projection of one decode step
(each layer's qkv, o, gate_up and down, and the LM head), each layer with its own weights so that
they come from memory as in a real step, timed by the host clock as a whole step: milliseconds
per step for each of the three ways `models.layers.Linear` can multiply (F.linear; the packed
formats KernelConfig.cpu_linear_pack chooses between). Also prints which format `auto` picks on
this CPU and the ratio of each format to F.linear. This is the measurement behind `auto`
(models/layers.pack_format): MKL's packs are the faster on Intel CPUs, oneDNN's on AMD ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from runner.benchmarks.model_shapes import SHAPES
from runner.benchmarks.results import add_out_argument, torch_threads, write_json


def step_weights(shape: str, layers: int | None) -> list[torch.Tensor]:
    """One [N, K] fp32 weight per projection of a decode step of `shape` (random values)."""
    config = SHAPES[shape]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    count = layers or config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) * 0.02 for _ in range(count) for n, k in per_layer]
    return weights + [torch.randn(config["vocab_size"], hidden, generator=generator) * 0.02]


def time_step(products, inputs: dict[int, torch.Tensor], steps: int) -> float:
    """Median milliseconds of one pass over every product (after one untimed pass)."""
    def one_pass() -> None:
        for product in products:
            product(inputs[product.in_features])
    one_pass()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


class _Product:
    def __init__(self, fn, in_features: int) -> None:
        self.fn, self.in_features = fn, in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def ways(weights: list[torch.Tensor]) -> dict[str, list[_Product]]:
    """F.linear and each packed format available in this torch build, over the same weights."""
    from models.layers import build_pack, format_available, packed_product
    found = {"F.linear": [_Product(lambda x, w=w: F.linear(x, w), w.shape[1]) for w in weights]}
    for name in ("mkl", "onednn"):
        if not format_available(name):
            continue
        packs = [build_pack(name, w) for w in weights]
        if any(pack is None for pack in packs):
            continue
        found[name] = [_Product(lambda x, w=w, p=p, n=name: packed_product(n, x, p, w, None, x.shape[0]), w.shape[1])
                       for w, p in zip(weights, packs)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench cpu_linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=None, help="layers to time (default: the shape's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=3, help="timed passes per row count (median)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    from launch.native_build import cpu_vendor
    from models.layers import pack_format
    rows_out = []
    with torch_threads(args.threads), torch.no_grad():
        products = ways(step_weights(args.shape, args.layers))
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in {p.in_features for p in products["F.linear"]}}
            row = {"rows": rows, **{name: time_step(p, inputs, args.steps) for name, p in products.items()}}
            rows_out.append(row)
        threads = torch.get_num_threads()
    names = list(products)
    print(f"{args.shape}, fp32, {threads} threads, CPU vendor {cpu_vendor()}, torch {torch.__version__}; "
          f"auto packs with: {pack_format()}")
    print("| rows | " + " | ".join(f"{n} ms/step" for n in names) + " | "
          + " | ".join(f"{n} / F.linear" for n in names[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(names) - 1))
    for row in rows_out:
        print(f"| {row['rows']} | " + " | ".join(f"{row[n]:.2f}" for n in names) + " | "
              + " | ".join(f"{row[n] / row['F.linear']:.2f}" for n in names[1:]) + " |")
    write_json(args.out, "cpu_linear.json", {"shape": args.shape, "threads": threads, "vendor": cpu_vendor(),
                                             "auto": pack_format(), "rows": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
