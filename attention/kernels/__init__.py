"""Triton kernels for the paged KV cache: the KV write and the unified (prefill + decode) attention.

Every launch here has a grid that depends only on padded shapes (token rows, request rows,
head counts), never on sequence lengths, so a launch captured once in a CUDA graph stays correct
when the metadata tensors it reads are refilled for a later step. On a CPU the same kernel code runs
in Triton's interpreter, which needs TRITON_INTERPRET=1 in the environment before `triton` is first
imported (Triton decides compiled vs interpreted for its own library functions, e.g. `tl.sum`, at
import time); scripts/test.sh sets it.
"""
