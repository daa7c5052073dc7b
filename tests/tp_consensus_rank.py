"""One rank of tests/test_tensor_parallel.py's consensus test, in a module of its own so that a
spawned process imports only torch and the runner's distributed and graph code (not the test
module with transformers and the checkpoints)."""

from __future__ import annotations

import datetime

import torch

from configs.graph_mode import CUDAGraphMode

# Batches (num_tokens, num_reqs, uniform decode) the consensus test dispatches.
BATCHES = [(1, 1, True), (3, 3, True), (5, 2, False), (8, 8, True), (9, 9, True), (12, 3, False), (16, 4, False)]
# Each rank's own plan: different capture sizes, and rank 2's backend has no FULL graphs.
PLANS = {0: ("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16]), 1: ("FULL_AND_PIECEWISE", [1, 2, 4, 8]),
         2: ("PIECEWISE", [1, 2, 4, 8, 16]), 3: ("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16, 32])}


def consensus_rank(rank: int, port: int, results) -> None:
    """One rank of a TP=2 x PP=2 world: its own graph plan (PLANS), the start-up agreement
    through the real groups, then rank 0's broadcast decision for each of BATCHES."""
    try:
        import torch.distributed as dist

        from runner.cudagraph import CudagraphDispatcher
        from runner.cudagraph.consensus import agree_graph_plan, agree_ready
        from runner.distributed.topology import Topology
        from runner.distributed.comm import Agreement, broadcast_message, destroy_groups, init_groups
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=datetime.timedelta(seconds=60))
        groups = init_groups("gloo", rank, Topology(2, 2), 60, store)
        agreement = Agreement(groups)
        mode_name, sizes = PLANS[rank]
        own = CudagraphDispatcher(CUDAGraphMode[mode_name], sizes, max_num_seqs=8)
        own.mark_ready()
        alone = [own.dispatch(*b) for b in BATCHES]       # what this rank would pick by itself
        mode, agreed_sizes = agree_graph_plan(agreement.gather(PLANS[rank]))
        dispatcher = CudagraphDispatcher(mode, agreed_sizes, max_num_seqs=8)
        ready_first = agree_ready(rank != 1, agreement.min)   # rank 1 failed to capture
        if ready_first:
            dispatcher.mark_ready()
        first = [dispatcher.dispatch(*b) for b in BATCHES]
        dispatcher.mark_ready()
        ready = agree_ready(True, agreement.min)
        replayed = []
        for batch in BATCHES:   # rank 0 decides, every rank replays that (and could: `has`)
            decision = broadcast_message(dispatcher.dispatch(*batch) if rank == 0 else None, groups)
            replayed.append((decision, dispatcher.has(*decision)))
        # The TP group (stage 0: ranks 0, 1; stage 1: ranks 2, 3) works for a collective.
        probe = torch.tensor([float(rank)])
        dist.all_reduce(probe, group=groups.tp_group)
        results.put((rank, dict(alone=alone, plan=(mode, agreed_sizes), ready_first=ready_first, first=first,
                                ready=ready, replayed=replayed, tp_sum=probe.item())))
        destroy_groups(groups)
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        results.put((rank, repr(error)))
