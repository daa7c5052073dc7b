"""Sampling: logits of the sampling rows -> one token per row (and logprobs).

- `sampler.py`: the batched sampler (greedy, temperature, min-p / top-k / top-p, seeds, logprobs).
"""

from runner.sampling.sampler import (LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, argmax_rows,
                                     make_generator)

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "argmax_rows", "make_generator"]
