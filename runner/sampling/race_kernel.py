"""The random draw of a GPU step in one pass over the logits (Triton): filter, temperature and
the exponential race together.

Why: in torch the draw is a chain of full-batch kernels after the thresholds are known (scale
by the temperature, mask below the threshold, draw Exp(1), clamp, log, subtract, argmax), each
reading or writing [rows, vocab] floats: at batch 256 over Llama's 128256 tokens ~130 MB each.
Here the programs of a row (a few per row: `PROGRAMS_PER_SM`) each read their share of the row's
logits once and keep the argmax of x / T - log(q) over the tokens x >= threshold (drawing q only
in blocks that keep a token), the row's last program to finish taking the best of the shares.
Where the GPU pass made a list of the row's largest values that holds every kept token
(runner/sampling/logits_pass.py), the row's first program races over that list alone. q ~ Exp(1)
from Philox keyed by the row's seed and the token's index (`_uniform`: one Philox evaluation gives four neighbouring tokens theirs):
the exponential race of runner/sampling/sampler.py `_race`
(P(token i) = softmax(x / T)_i over the kept tokens), with q drawn here instead of by torch, and
the score taken in base 2 (`_score`: the same order of tokens, cheaper arithmetic).

Seeds: one int per step from the default CPU generator, row r drawing with it + r, or where some
rows have a seeded request one int per row from the default CUDA generator and for those rows
from the request's own generator (`row_seeds`): a seeded request's tokens depend only
on its own generator and logits, as on the torch path (which draws different q, so the same
seed gives other tokens on a GPU than on a CPU). tests/test_race_kernel.py checks the sampled
frequencies against the softmax in Triton's interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from launch.fast_launch import FastLaunch, num_sms

BLOCK = 1024
SEED_BOUND = 2 ** 31 - 1
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _uniform(seed, tokens):
    """U[0, 1) for each token: component t % 4 of Philox's four outputs for counter t // 4 (one
    Philox evaluation serves four neighbouring tokens), in the order `_uniform_block` lays out."""
    u0, u1, u2, u3 = tl.rand4x(seed, tokens // 4)
    c = tokens % 4
    return tl.where(c == 0, u0, tl.where(c == 1, u2, tl.where(c == 2, u1, u3)))


@triton.jit
def _uniform_block(seed, off, QUARTER: tl.constexpr):
    """U[0, 1) for tokens off .. off + 4 * QUARTER - 1 as a [QUARTER, 4] tile (row i: tokens
    off + 4i .. off + 4i + 3), equal to `_uniform` of each token (off a multiple of 4)."""
    u0, u1, u2, u3 = tl.rand4x(seed, off // 4 + tl.arange(0, QUARTER))
    return tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [QUARTER, 4])


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2(x): with FAST the GPU's approximate instruction (lg2.approx, relative error about
    2^-22), else tl.log2 (libdevice's exact log2f; Triton's interpreter has no libdevice)."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _score(x, scale, u, FAST: tl.constexpr):
    """The race's score of logit x with uniform u, `scale` = log2(e) / T: x / T - log(q) for
    q = -log(u) ~ Exp(1), times log2(e) and less a constant (-log2(-log2 u) = -log2(q) + log2(ln 2)),
    so every token keeps its place in the order. In base 2 a token costs a multiply and two
    approximate logs, where x / T - log(-log u) cost a division and two exact natural logs
    (libdevice's logf): the draw was bound by that arithmetic, not by the logits' bytes. 256 rows
    of Qwen3's 151936 tokens in bf16 took 158 us, now 94 (`graphrunner bench fused_ops --rows 1
    32 256`, H100; 1 row 10 us either way)."""
    return x * scale - _log2(-_log2(u, FAST), FAST)


@triton.jit(do_not_specialize=["base_seed", "blocks_per_split"])
def _race_kernel(x_ptr, stride_x, temp_ptr, threshold_ptr, seed_ptr, seeded, base_seed, out_ptr, list_ptr, ids_ptr,
                 stride_list, count_ptr, bound_ptr, slots_ptr, counts_ptr, stride_counts, seen_ptr, V, CAP,
                 blocks_per_split, part_score_ptr, part_idx_ptr, ticket_ptr,
                 BLOCK: tl.constexpr, LISTS: tl.constexpr, LIST_BLOCK: tl.constexpr,
                 RECORD: tl.constexpr, SPLITS_PAD: tl.constexpr, FAST: tl.constexpr):
    """Program (row, split): the race over the split's `blocks_per_split` blocks of the row. With
    one split per row it stores the token; with several each stores its best (score, first index)
    and the row's last split to finish (an arrival ticket per row) takes the best of them: the same
    token as one program walking the whole row (highest score, the lowest index among equal ones)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    base = x_ptr + row.to(tl.int64) * stride_x
    scale = LOG2E / tl.load(temp_ptr + row)
    threshold = tl.load(threshold_ptr + row)
    # `seeded` (a bool: a runtime branch, so seeded and unseeded steps share one compiled variant):
    # a seed per row, from the rows' own generators; else the step's seed, one per row from it.
    seed = base_seed.to(tl.int64) + row
    if seeded:
        seed = tl.load(seed_ptr + row)
    QUARTER: tl.constexpr = BLOCK // 4
    tile = 4 * tl.arange(0, QUARTER)[:, None] + tl.arange(0, 4)[None, :]   # [QUARTER, 4]: the block's tokens
    best = tl.full([QUARTER, 4], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([QUARTER, 4], 2147483647, dtype=tl.int32)
    lo = split * blocks_per_split * BLOCK
    hi = tl.minimum(lo + blocks_per_split * BLOCK, V)   # tokens of the row to race over (none where its list serves)
    if LISTS:
        count = tl.load(count_ptr + row)
        if (count <= CAP) & (threshold >= tl.load(bound_ptr + row)):   # every kept token is listed
            hi = lo
            if split == 0:
                at = tl.arange(0, LIST_BLOCK)
                listed = row.to(tl.int64) * stride_list + at
                x = tl.load(list_ptr + listed, mask=at < count, other=float("-inf"))
                tokens = tl.load(ids_ptr + listed, mask=at < count, other=2147483647)
                kept = (at < count) & (x >= threshold)
                score = tl.where(kept, _score(x, scale, _uniform(seed, tokens), FAST), float("-inf"))
                top = tl.max(score, axis=0)
                first = tile == 0
                best = tl.where(first, top, best)
                best_idx = tl.where(first, tl.min(tl.where(score == top, tokens, 2147483647), axis=0), best_idx)
    for off in range(lo, hi, BLOCK):
        idx = off + tile
        ok = idx < V
        x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32)
        kept = ok & (x >= threshold)
        # The draws (Philox and two logs per token) only for a block that keeps a token: under
        # top-k most blocks keep none, and the pass is then a read of the row.
        if tl.max(tl.max(kept.to(tl.int32), axis=1), axis=0) > 0:
            u = _uniform_block(seed, off, QUARTER)   # [0, 1): q = -log(u) ~ Exp(1); u = 0 never wins
            score = tl.where(kept, _score(x, scale, u, FAST), float("-inf"))
            take = score > best
            best = tl.where(take, score, best)
            best_idx = tl.where(take, idx, best_idx)
    best = tl.reshape(best, [BLOCK])
    best_idx = tl.reshape(best_idx, [BLOCK])
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    if splits > 1:
        # Every split stores its best; the ticket's acq_rel atomic publishes them to, and acquires
        # the others' for, the last arrival, which reads them past L1 (.cg) and resets the ticket
        # for the next launch (the attention kernel's in-kernel merge does the same).
        part = row.to(tl.int64) * splits
        tl.store(part_score_ptr + part + split, top)
        tl.store(part_idx_ptr + part + split, first)
        tl.debug_barrier()
        arrived = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            tl.atomic_xchg(ticket_ptr + row, 0, sem="relaxed", scope="gpu")
            at = tl.arange(0, SPLITS_PAD)
            scores = tl.load(part_score_ptr + part + at, mask=at < splits, other=float("-inf"), cache_modifier=".cg")
            firsts = tl.load(part_idx_ptr + part + at, mask=at < splits, other=2147483647, cache_modifier=".cg")
            top = tl.max(scores, axis=0)
            first = tl.min(tl.where(scores == top, firsts, 2147483647), axis=0)
            _store_token(out_ptr, row, first, slots_ptr, counts_ptr, stride_counts, seen_ptr, RECORD)
    else:
        _store_token(out_ptr, row, first, slots_ptr, counts_ptr, stride_counts, seen_ptr, RECORD)


@triton.jit
def _store_token(out_ptr, row, first, slots_ptr, counts_ptr, stride_counts, seen_ptr, RECORD: tl.constexpr):
    """The row's token (0 where no token was kept), and with RECORD the penalties' count of it."""
    token = tl.where(first == 2147483647, 0, first)
    tl.store(out_ptr + row, token.to(tl.int64))
    if RECORD:   # the penalties' count of the drawn token (SamplingStates.record's job, without its launches)
        slot = tl.load(slots_ptr + row)
        if slot >= 0:   # (SamplingStates: the count, and the token's OUTPUT flag in `seen`)
            at = counts_ptr + slot * stride_counts + token
            tl.store(at, tl.load(at) + 1)
            flag = seen_ptr + slot * stride_counts + token
            tl.store(flag, tl.load(flag) | 2)


_launch = FastLaunch(_race_kernel)   # launched every step: no JITFunction.run per call

PROGRAMS_PER_SM = 8
"""A row's blocks are split until the grid has about this many programs per SM (each of 8 warps).
One program per row walked a 152K-token row in ~150 serial blocks, a latency-bound loop that left
most of each SM idle: on an H100, bf16 rows of Qwen3's vocabulary at temperature alone
(`graphrunner bench fused_ops`), 191 us at 1 row, 195 at 32, 229 at 256; split, 10-21, 30, 158."""
MAX_SPLITS = 256
"""At most this many programs per row (the final merge reads a row's partials as one vector)."""
_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _target_programs(device: torch.device) -> int:
    """Programs a launch aims at: PROGRAMS_PER_SM per SM on a GPU; one per row in the interpreter."""
    return PROGRAMS_PER_SM * num_sms(device) if device.type == "cuda" else 1


def _splits(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(splits per row, blocks per split) for a launch of `rows` rows of `vocab` tokens."""
    blocks = triton.cdiv(vocab, BLOCK)
    want = triton.cdiv(_target_programs(device), rows)
    per_split = triton.cdiv(blocks, max(1, min(want, blocks, MAX_SPLITS)))
    return triton.cdiv(blocks, per_split), per_split


def _split_scratch(device: torch.device, rows: int, splits: int):
    """(scores float32, first indices int32, tickets int32 [rows], zero between launches) for
    `rows` x `splits` partials, kept per device and grown as needed, as the attention kernel keeps
    its merge tickets (sampling is not captured in a graph; its launches run one after another)."""
    held = _scratch.get(device)
    if held is None or held[0].numel() < rows * splits or held[2].numel() < rows:
        size = max(rows * splits, 0 if held is None else held[0].numel())
        tickets = max(rows, 0 if held is None else held[2].numel())
        held = _scratch[device] = (torch.empty(size, dtype=torch.float32, device=device),
                                torch.empty(size, dtype=torch.int32, device=device),
                                torch.zeros(tickets, dtype=torch.int32, device=device))
    return held


def row_seeds(rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor | int:
    """The step's seeds: with seeded rows, int64 [rows] on `device`, a seed per row from the
    default generator and seeded rows' from their own (each advances once per step; no host
    sync); else one int from the default CPU generator, from which the kernel derives each row's
    (seed + row: no launch)."""
    if not generators:
        return int(torch.randint(0, SEED_BOUND - (1 << 24), ()))
    seeds = torch.randint(0, SEED_BOUND, (rows,), device=device)
    for row, gen in generators.items():
        seeds[row] = torch.randint(0, SEED_BOUND, (1,), device=device, generator=gen)[0]
    return seeds


def race(logits: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor | None,
         seeds: torch.Tensor | int, candidates=None, record=None) -> torch.Tensor:
    """int64 [N]: per row, a token drawn from softmax(logits / temperature) restricted to
    logits >= threshold (None: no filter). logits [N, V] (any float dtype, contiguous rows),
    temperature float32 [N] or [N, 1] (> 0), threshold float32 [N, 1] or None, seeds from
    `row_seeds` (int64 [N], or one int: row r draws with seed + r).
    `candidates` (runner/sampling/logits_pass.py `Candidates` of these logits): a row whose list
    holds every token it keeps races over the list alone, with the same draws (q is keyed by the
    token), so with the same result. `record` ((slots int64 [N], -1 for none; output_counts int32
    [slots, V]; seen uint8 [slots, V], of the same strides)): each row's drawn token is counted into
    `output_counts[slots[row]]` and flagged as output in `seen` (a slot at most once), as
    SamplingStates.record does."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if threshold is None:
        threshold = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    c = candidates
    cap = 1 if c is None else c.listed.shape[1]
    seed_tensor = isinstance(seeds, torch.Tensor)
    slots, counts, seen = record if record is not None else (out, out, out)
    if record is not None:
        assert seen.stride(0) == counts.stride(0), "seen and output_counts share their row stride"
    splits, per_split = _splits(rows, vocab, logits.device)
    scores, firsts, tickets = _split_scratch(logits.device, rows, splits)   # typed alike for one split: one variant
    _launch((rows, splits), logits, logits.stride(0), temperature.reshape(-1).float(), threshold.reshape(-1).float(),
            seeds if seed_tensor else out, seed_tensor, 0 if seed_tensor else seeds, out, out if c is None else c.listed,
            out if c is None else c.listed_ids, 0 if c is None else c.listed.stride(0),
            out if c is None else c.count, out if c is None else c.bound, slots, counts,
            0 if record is None else counts.stride(0), seen, vocab, cap, per_split, scores, firsts, tickets,
            BLOCK, c is not None, triton.next_power_of_2(cap), record is not None, MAX_SPLITS,
            logits.is_cuda, device_index=logits.device.index or 0, num_warps=8)
    return out
