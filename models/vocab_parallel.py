"""The vocabulary-parallel embedding and LM head: under tensor parallelism each rank holds one
contiguous row block of the vocabulary, padded to a multiple of tensor_parallel_size
(models/parallel_state.shard_vocab; padding rows are zero).

The embedding looks up the ids its block holds, gives zeros for the others, and one all-reduce
makes every rank's row the full one (exactly: one nonzero term per element). The LM head
computes its block's logits; an all-gather concatenates the blocks in rank order and the padding
columns are cut off, so every consumer of `CausalLM.compute_logits` (sampler, logprobs, the graph's
greedy argmax, soft-capping) sees the whole real vocabulary, as on one rank.

Both are built only when tensor_parallel_size > 1 (`vocab_embedding`, `lm_head_linear`): a single
rank keeps today's ScaledEmbedding and Linear, with no collective and no extra pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import Linear, ScaledEmbedding, WeightLoadError, loaded_shape
from models.parallel_state import (VocabShard, shard_vocab, tensor_parallel_all_gather, tensor_parallel_all_reduce,
                                   tensor_parallel_group)


def _vocab_shard(vocab_size: int) -> VocabShard:
    group = tensor_parallel_group()
    return shard_vocab(vocab_size, group.size, group.rank)


class VocabRows:
    """The loading shared by the embedding and the head: a [vocab, hidden] checkpoint tensor of
    which this rank reads its block's real rows only; the padding rows are zero."""

    vocab_size: int
    shard: VocabShard

    def checkpoint_shape(self, param: nn.Parameter, shard_id=None) -> tuple[int, ...]:
        return (self.vocab_size, *param.shape[1:])

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None:
            raise WeightLoadError(f"this parameter is not packed, yet shard {shard_id!r} was given")
        expected = self.checkpoint_shape(param)
        if loaded_shape(loaded) != expected:
            raise WeightLoadError(f"expected {expected}, found {loaded_shape(loaded)}")
        start, real = self.shard.start, self.shard.num_real_rows
        if real:
            param.data[:real].copy_(loaded[start:start + real])
        param.data[real:].zero_()


class VocabParallelEmbedding(VocabRows, ScaledEmbedding):
    def __init__(self, vocab_size: int, hidden: int, scale: float | None = None) -> None:
        shard = _vocab_shard(vocab_size)
        ScaledEmbedding.__init__(self, shard.num_rows, hidden, scale)
        self.shard, self.vocab_size = shard, vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.num_rows)
        hidden = F.embedding(local.masked_fill_(outside, 0), self.weight)
        hidden = tensor_parallel_all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))
        if self.scale is None:
            return hidden
        return hidden * torch.tensor(self.scale, dtype=hidden.dtype)


class ParallelLMHead(VocabRows, Linear):
    """The LM head's vocabulary block [padded_vocab / size, hidden]; forward returns the gathered
    logits of the real vocabulary [..., vocab_size]. No bias (no supported family has one)."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        shard = _vocab_shard(vocab_size)
        Linear.__init__(self, hidden, shard.num_rows, bias=False)
        self.shard, self.vocab_size = shard, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = tensor_parallel_all_gather(self.product(x, None), dim=-1)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., :self.vocab_size].contiguous()


def vocab_embedding(vocab_size: int, hidden: int, scale: float | None) -> ScaledEmbedding:
    """The token embedding: vocabulary-parallel under tensor parallelism, else ScaledEmbedding."""
    if tensor_parallel_group().size == 1:
        return ScaledEmbedding(vocab_size, hidden, scale)
    return VocabParallelEmbedding(vocab_size, hidden, scale)


def lm_head_linear(hidden: int, vocab_size: int) -> Linear:
    """The LM head: vocabulary-parallel (gathered logits) under tensor parallelism, else a Linear."""
    if tensor_parallel_group().size == 1:
        return Linear(hidden, vocab_size, bias=False)
    return ParallelLMHead(hidden, vocab_size)
