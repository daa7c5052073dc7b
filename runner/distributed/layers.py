"""Which contiguous slice of decoder layers each pipeline rank holds."""

from __future__ import annotations


def split_layers(num_layers: int, pp_size: int, layer_split: list[int] | None = None) -> list[range]:
    """One contiguous `range` of global layer indices per rank, in rank order.

    Default: an even split; when `num_layers % pp_size != 0` the extra layers go one each to the
    ranks just *before* the last one (vLLM's rule), e.g. 30 layers on 4 ranks -> [7, 8, 8, 7].
    Why not the last rank: it also runs the final norm, the LM head over the whole vocabulary and
    the sampler, so it is already the slowest stage; the first rank only adds an embedding lookup.

    `layer_split` (ParallelConfig.pipeline_layer_split) overrides it: layers per rank, `pp_size`
    entries, each >= 1, summing to `num_layers`; anything else is a ValueError that says why.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if layer_split is not None:
        counts = list(layer_split)
        if len(counts) != pp_size:
            raise ValueError(f"pipeline_layer_split {counts} has {len(counts)} entries but "
                             f"pipeline_parallel_size is {pp_size}")
        if any(not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"pipeline_layer_split {counts}: every rank needs at least 1 layer")
        if sum(counts) != num_layers:
            raise ValueError(f"pipeline_layer_split {counts} sums to {sum(counts)} layers but the model has "
                             f"{num_layers}")
    else:
        if num_layers < pp_size:
            raise ValueError(f"the model has {num_layers} layers, fewer than pipeline_parallel_size={pp_size}; "
                             "every pipeline rank needs at least one layer")
        base, extra = divmod(num_layers, pp_size)
        counts = [base] * pp_size
        for i in range(2, extra + 2):  # extra <= pp_size - 1: never the last rank
            counts[-i] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
