"""Which process is which: the rank layout of a tensor x pipeline parallel world (vLLM's).

    global rank = pp_stage * tensor_parallel_size + tp_rank

so the TP ranks of one pipeline stage are consecutive (on one host they share the fastest links),
and rank 0 (the driver: it schedules) is stage 0's TP rank 0. One tensor-parallel group per
stage; hidden states go from (stage s, tp rank t) to (stage s+1, tp rank t); the last stage's TP
rank 0 samples and sends the tokens to rank 0 (itself when there is one stage).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    tp_size: int
    pp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) and pipeline_parallel_size ({self.pp_size}) "
                             "must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def stage(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def tp_group_ranks(self, stage: int) -> list[int]:
        """The global ranks of one stage's tensor-parallel group, in TP-rank order."""
        return [self.rank(stage, t) for t in range(self.tp_size)]

    def prev_rank(self, rank: int) -> int | None:
        """Where this rank's stage input comes from (None on the first stage)."""
        stage = self.stage(rank)
        return None if stage == 0 else self.rank(stage - 1, self.tp_rank(rank))

    def next_rank(self, rank: int) -> int | None:
        """Where this rank's stage output goes (None on the last stage)."""
        stage = self.stage(rank)
        return None if stage == self.pp_size - 1 else self.rank(stage + 1, self.tp_rank(rank))

    @property
    def sampler_rank(self) -> int:
        """The one rank that samples: the last stage's TP rank 0."""
        return self.rank(self.pp_size - 1, 0)

    def describe(self, rank: int) -> str:
        """'rank 3 (pp stage 1, tp rank 1)', for logs and errors."""
        return f"rank {rank} (pp stage {self.stage(rank)}, tp rank {self.tp_rank(rank)})"
