"""The push all-reduce against NCCL between two GPUs, as a decode step meets it: in a CUDA graph.

    graphrunner bench all_reduce [--rows 1 4 8 16 32] [--hidden 4096] [--pairs 32] [--replays 50]
        [--out DIR]

Spawns two ranks (one GPU each, NCCL, the engine's own group set-up and push all-reduce set-up:
runner/distributed/comm.py). For each row count it first checks the push kernel against NCCL on
random bf16 rows (bit for bit), then captures one graph of --pairs (one-row-path GEMV of a
[hidden, hidden / 2] weight, all-reduce of its [rows, hidden] output) pairs three ways: GEMV only,
GEMV + NCCL all-reduce, GEMV + push all-reduce. Prints the cost of one all-reduce (a pair's time
less the GEMV's, best of 3 x --replays replays) for NCCL and the push kernel, and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys

import torch

from runner.benchmarks.results import add_out_argument, write_json


def _pair_time_us(kind: str, rows: int, args, reducer) -> float:
    import torch.distributed as dist
    from models import small_batch_kernels
    weight = torch.randn(args.hidden, args.hidden // 2, dtype=torch.bfloat16, device="cuda") * 0.01
    x = torch.randn(rows, args.hidden // 2, dtype=torch.bfloat16, device="cuda")

    def body() -> None:
        for _ in range(args.pairs):
            y = small_batch_kernels.linear(x, weight)
            if kind == "nccl":
                dist.all_reduce(y)
            elif kind == "push":
                reducer.all_reduce_(y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / args.replays / args.pairs)
    return best


def _rank(rank: int, port: int, args, results) -> None:
    import torch.distributed as dist
    from runner.distributed.comm import destroy_groups, init_groups, push_all_reduce, set_distributed_env
    from runner.distributed.topology import Topology
    set_distributed_env()
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    groups = init_groups("nccl", rank, Topology(tp_size=2, pp_size=1), 120.0, store)
    try:
        max_bytes = max(args.rows) * args.hidden * 2
        reducer = push_all_reduce(max_bytes, torch.device("cuda", rank), groups)
        if reducer is None:
            raise RuntimeError("the push all-reduce could not be set up between these GPUs")
        gen = torch.Generator(device="cuda").manual_seed(rank)
        rows_out = []
        for rows in args.rows:
            identical = True
            for _ in range(20):
                x = torch.randn(rows, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
                expected = x.clone()
                dist.all_reduce(expected, group=groups.tp_group)
                identical &= torch.equal(reducer.all_reduce_(x), expected)
            times = {kind: _pair_time_us(kind, rows, args, reducer) for kind in ("none", "nccl", "push")}
            rows_out.append(dict(rows=rows, bytes=rows * args.hidden * 2, identical_to_nccl=identical,
                                 gemv_us=times["none"], nccl_us=times["nccl"] - times["none"],
                                 push_us=times["push"] - times["none"]))
        if rank == 0:
            results.put(rows_out)
        torch.cuda.synchronize()
        del reducer
    finally:
        destroy_groups(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench all_reduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--replays", type=int, default=50)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("bench all_reduce needs two GPUs", file=sys.stderr)
        return 1
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_rank, args=(port, args, results), nprocs=2, start_method="spawn", join=True)
    rows = results.get()
    print(f"{torch.cuda.get_device_name(0)} x2, {args.pairs} (GEMV, all-reduce) pairs in a CUDA graph, "
          f"rows of {args.hidden} bf16; per all-reduce:")
    print("| rows | KiB | GEMV us | NCCL us | push us | push / NCCL | push == NCCL |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['bytes'] / 1024:.0f} | {r['gemv_us']:.2f} | {r['nccl_us']:.2f} | {r['push_us']:.2f} | "
              f"{r['push_us'] / r['nccl_us']:.2f} | {'yes' if r['identical_to_nccl'] else 'NO'} |")
    write_json(args.out, "all_reduce.json", dict(device=torch.cuda.get_device_name(0), hidden=args.hidden,
                                                  pairs=args.pairs, replays=args.replays, rows=rows))
    return 0 if all(r["identical_to_nccl"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
