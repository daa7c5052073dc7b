"""Every rank of a multi-process engine replays the same graph for the same batch.

Why: a graph of a tensor-parallel rank holds collectives (the all-reduces, the logits'
all-gather). If one rank replayed a FULL graph while another ran the batch eagerly, or padded it
to another size, their collectives would not pair up and both would wait forever (or sum rows
of different batches). So the ranks agree, in three places:

1. Before the model is built, on one graph plan (`agree_graph_plan`): the runtime modes every
   rank supports and the capture sizes every rank has. Ranks differ when their configs,
   attention backends or devices do; the plan is the largest one they all can serve.
2. After capture, on readiness (`agree_ready`): graphs are used only if every rank captured.
3. At every step, rank 0 (the driver) dispatches once and broadcasts its (mode, descriptor)
   with the step; every rank replays exactly that (`ModelRunner.execute(sched, decision)`), and
   a rank asked for a graph it does not hold raises instead of waiting in a collective.
"""

from __future__ import annotations

import logging

from configs.graph_mode import CUDAGraphMode

logger = logging.getLogger(__name__)

_BY_RUNTIME_MODES = {(m.decode_mode(), m.mixed_mode()): m for m in CUDAGraphMode}


def agree_graph_plan(plans: list[tuple[str, list[int]]]) -> tuple[CUDAGraphMode, list[int]]:
    """The one plan every rank can serve, from each rank's own `(mode name, capture sizes)`:
    per kind of batch (uniform decode, mixed) the runtime mode if every rank has the same one,
    else PIECEWISE if every rank has PIECEWISE graphs (a rank whose attention backend cannot run
    inside a FULL graph still has those), else NONE; the capture sizes every rank has (NONE if
    there is none)."""
    modes = [CUDAGraphMode[name] for name, _ in plans]
    all_piecewise = all(m.has_piecewise() for m in modes)

    def common(per_rank: set[CUDAGraphMode]) -> CUDAGraphMode:
        if len(per_rank) == 1:
            return per_rank.pop()
        return CUDAGraphMode.PIECEWISE if all_piecewise else CUDAGraphMode.NONE

    pair = (common({m.decode_mode() for m in modes}), common({m.mixed_mode() for m in modes}))
    mode = _BY_RUNTIME_MODES.get(pair, CUDAGraphMode.NONE)
    sizes = sorted(set.intersection(*(set(s) for _, s in plans))) if plans else []
    if mode == CUDAGraphMode.NONE or not sizes:
        mode, sizes = CUDAGraphMode.NONE, []
    if len({(m, tuple(s)) for m, s in plans}) > 1:
        logger.warning("ranks planned different CUDA graphs %s; every rank uses %s with capture sizes %s",
                       [(m, list(s)) for m, s in plans], mode.name, sizes)
    return mode, sizes


def agree_ready(ready: bool, agree_min) -> bool:
    """True only if every rank captured its graphs (`agree_min`: the minimum over all ranks)."""
    everyone = bool(agree_min(int(ready)))
    if ready and not everyone:
        logger.warning("another rank has no CUDA graphs ready; every step runs eager on every rank")
    return everyone
