"""The step's token bitmask on the device, and its application to the logits.

xgrammar's bitmask is int32 [rows, ceil(vocab / 32)]: bit j % 32 of word j // 32 is 1 when token
j is allowed. A step's bitmask has one row per sampling row of the batch (rows of requests
without structured output are left unfilled and skipped through `indices`), so requests with
and without a constraint share one step and only the constrained rows are touched. The
application is xgrammar's `apply_token_bitmask_inplace`: a Triton kernel on a GPU, a C++ loop on
a CPU; one launch for all constrained rows, no Python loop over rows or the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """What the sampler needs to constrain a step: the packed bitmask rows (device, int32), the
    sampling rows they apply to (device, int32), the vocabulary they cover, and (for the greedy
    argmax on a GPU) int32 [rows], nonzero where the row is constrained."""
    bitmask: torch.Tensor
    indices: torch.Tensor
    vocab_size: int
    constrained: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows to -inf, in place (float32 logits [rows, vocab])."""
        from xgrammar import apply_token_bitmask_inplace
        apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=min(self.vocab_size, logits.shape[-1]),
                                    indices=self.indices)

    def read_on_device(self, logits: torch.Tensor) -> bool:
        """Whether GPU kernels can read this bitmask for `logits` (runner/greedy.py's masked argmax,
        runner/sampling/logits_pass.py): CUDA logits, per-row flags, a bitmask as wide as the logits."""
        return logits.is_cuda and self.constrained is not None and logits.shape[1] <= self.vocab_size

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: the greedy tokens under the mask, as `apply` then the argmax: on a GPU one
        pass over the logits (any float dtype) that reads the bitmask (runner/greedy.py),
        elsewhere exactly that on float32 logits (masked in place when they are float32)."""
        if self.read_on_device(logits):
            from runner.greedy import masked_argmax_rows
            return masked_argmax_rows(logits, self.bitmask, self.constrained)
        from runner.sampling.sampler import argmax_rows
        logits = logits.float()
        self.apply(logits)
        return argmax_rows(logits)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the packed bitmask allows the token (the reference the
    tests compare the kernels and the matchers with)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
