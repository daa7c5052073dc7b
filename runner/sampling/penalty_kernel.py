"""The repetition, frequency and presence penalties in one pass over the logits (Triton, GPU).

Why: in torch the penalties are a dozen full-batch kernels (gathers of the per-slot counts and
prompt mask, compares, two `where`s, products, subtractions), each reading or writing
[rows, vocab]; at batch 256 over Llama's 128256 tokens every one of them moves ~130 MB. Here one
program per (penalty row, block of the vocabulary) reads the row's logits, the slot's output
counts and prompt mask once and writes the logits in place. Same formula and order as the torch
path (runner/sampling/processors.py `_apply_penalties`, HF / vLLM): repetition over prompt and
output tokens (divide a positive logit, multiply a negative one), then minus frequency * count
and presence * (count > 0) over output tokens. The results equal the torch path's up to float
rounding (the compiler may fuse a product and a subtraction); tests/test_penalty_kernel.py
compares them in Triton's interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import FastLaunch

BLOCK = 2048


@triton.jit
def _penalties_kernel(x_ptr, stride_x, rows_ptr, slots_ptr, counts_ptr, stride_counts, prompt_ptr, stride_prompt,
                      rep_ptr, freq_ptr, pres_ptr, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    rep = tl.load(rep_ptr + i)
    freq = tl.load(freq_ptr + i)
    pres = tl.load(pres_ptr + i)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    count = tl.load(counts_ptr + slot * stride_counts + offs, mask=ok, other=0)
    in_prompt = tl.load(prompt_ptr + slot * stride_prompt + offs, mask=ok, other=0)
    seen = (in_prompt != 0) | (count > 0)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * count.to(tl.float32)
    x = x - pres * (count > 0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + offs, x, mask=ok)


_launch = FastLaunch(_penalties_kernel)   # launched every step: no JITFunction.run per call


def apply_penalties(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, output_counts: torch.Tensor,
                    prompt_mask: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """In place on float32 logits `x` [N, V] (contiguous rows): the penalties of `rows` (int64
    [P]), whose token state is `output_counts[slots]` (int32) and `prompt_mask[slots]` (bool);
    repetition, frequency and presence are float32 [P] or [P, 1]."""
    num, vocab = rows.shape[0], x.shape[1]
    if num == 0:
        return
    _launch((num, triton.cdiv(vocab, BLOCK)), x, x.stride(0), rows, slots, output_counts, output_counts.stride(0),
            prompt_mask.view(torch.uint8), prompt_mask.stride(0), repetition.reshape(-1), frequency.reshape(-1),
            presence.reshape(-1), vocab, BLOCK, device_index=x.device.index or 0, num_warps=8)
