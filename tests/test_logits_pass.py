"""runner/sampling/logits_pass.py: the one pass over the logits before the draw.

- Its penalties equal the torch path of LogitsProcessors (HF's repetition penalty, vLLM's
  frequency and presence) for rows with and without each penalty, rows in any order and slots
  out of order: in place on float32 logits, and fused with the float32 copy of bf16 logits.
- Its candidates are the (penalised) logits' largest values as `torch.topk` gives them: each row's
  sorted list holds every value down to its last (ties included), or, where the list overflowed
  (bf16 logits with many ties, rows of -inf), exactly the k + 1 largest. Widths from 2 to
  MAX_CANDIDATES, one block or many, the last one partial.
- A structured-output bitmask in the pass masks the constrained rows first.
- The draw over a row's list (runner/sampling/race_kernel.py) picks the token the draw over the
  whole row picks.
In Triton's interpreter here; on a GPU (cuda marker) the same, and the sampler's GPU path (the
pass, then the thresholds and the draw) against the sampler's torch path on the CPU.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from configs import SamplingParams  # noqa: E402
from runner.sampling import LogitsProcessors, Sampler, SamplingMetadata, SamplingStates  # noqa: E402
from runner.scheduler import ScheduledRequest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from runner.sampling.logits_pass import _sort_descending  # noqa: E402

VOCAB = 3000   # on a GPU two blocks of the pass without candidates, the second partial
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _requests(params: list[SamplingParams], vocab: int, gen: torch.Generator) -> list[ScheduledRequest]:
    prompts = [torch.randint(0, vocab, (40,), generator=gen).tolist() for _ in params]
    return [ScheduledRequest(f"r{i}", [0], 0, [], True, p, 0, -1, frozenset(), prompts[i], None,
                             p.needs_logits_processors) for i, p in enumerate(params)]


def _case(device: str, vocab: int = VOCAB):
    """Processors of five rows (one without penalties) whose states counted 30 random tokens."""
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(),
              SamplingParams(frequency_penalty=-0.5),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=1.0, repetition_penalty=1.1)]
    gen = torch.Generator().manual_seed(0)
    reqs = _requests(params, vocab, gen)
    states = SamplingStates(vocab, torch.device(device))
    LogitsProcessors.build(reqs[::-1], states, vocab, lambda t: t.to(device))   # slots out of order
    processors = LogitsProcessors.build(reqs, states, vocab, lambda t: t.to(device))
    for _ in range(30):
        processors.record(torch.randint(0, vocab, (len(reqs),), generator=gen).to(device))
    logits = (torch.randn(len(reqs), vocab, generator=gen) * 4).to(device)
    return processors, logits


def _check_penalties(device: str, columns: int, vocab: int = VOCAB):
    from runner.sampling.logits_pass import logits_pass
    processors, logits = _case(device, vocab)
    p = processors.penalties
    assert p is not None and p.rows.tolist() == [0, 2, 3, 4] and processors.only_penalties
    want = logits.clone()
    processors._apply_penalties_torch(want, p)
    got = logits.clone()
    assert logits_pass(got, got, processors.penalty_columns(), 0) is None   # in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])
    # Fused with the copy: bf16 logits in, float32 out, the input untouched.
    bf16 = logits.bfloat16()
    want = bf16.float()
    processors._apply_penalties_torch(want, p)
    out = torch.empty(bf16.shape, dtype=torch.float32, device=device)
    found = logits_pass(bf16, out, processors.penalty_columns(), columns)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(bf16, logits.bfloat16())
    _check_lists(out, found, columns)


def _check_lists(x: torch.Tensor, found, columns: int) -> tuple[int, int]:
    """Each row's candidates against the row: (complete lists, overflowed rows)."""
    complete = overflowed = 0
    x = x.float().cpu()
    for row, (k, c) in enumerate(found.lengths.cpu().tolist()):
        values = found.values[row, :c].cpu()
        assert torch.equal(values, x[row].topk(c).values), (row, k, c)
        if k == c:   # every value >= the last one is in the list
            assert c >= columns and int((x[row] >= values[-1]).sum()) == c, (row, c)
            complete += 1
        else:
            assert (k, c) == (columns - 1, columns), (row, k, c)
            overflowed += 1
    return complete, overflowed


def _check_candidates(device: str, widths=(2, 3, 51, 64, 65, 256), vocabs=(300, 9000)):
    from runner.sampling.logits_pass import logits_pass
    gen = torch.Generator().manual_seed(1)
    complete = overflowed = 0
    for vocab in vocabs:
        for case, columns in enumerate(widths):
            if columns > vocab:
                continue
            if case % 2:   # few distinct values: ties everywhere, also across blocks
                x = (torch.randint(-6, 7, (3, vocab), generator=gen).float() / 2).bfloat16()
            else:
                x = torch.randn(3, vocab, generator=gen) * 3
            x[torch.rand(3, vocab, generator=gen) < 0.1] = float("-inf")
            if case == 2:
                x[-1] = float("-inf")
            found = logits_pass(x.to(device), None, None, columns)
            assert found.values.dtype == torch.float32
            counts = _check_lists(x, found, columns)
            complete, overflowed = complete + counts[0], overflowed + counts[1]
    assert complete and overflowed   # both ways were taken


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 256 tokens (many per row): the interpreter runs one program at a time. The GPU
    test runs the real sizes."""
    from runner.sampling import logits_pass
    monkeypatch.setattr(logits_pass, "BLOCK", 256)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_penalties_equal_the_torch_path_in_the_interpreter(small_blocks):
    _check_penalties("cpu", 3, vocab=300)


def _check_mask(device: str, vocab: int, columns: int):
    """A structured-output bitmask in the pass: the constrained rows' disallowed tokens are -inf
    (the unconstrained rows untouched), before the penalties and the candidates."""
    from runner.sampling.logits_pass import logits_pass
    from runner.structured_output.bitmask import unpack_bitmask
    processors, logits = _case(device, vocab)
    rows = logits.shape[0]
    gen = torch.Generator().manual_seed(4)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, -(-vocab // 32)), generator=gen, dtype=torch.int32)
    constrained = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)
    want = logits.bfloat16().float()
    drop = ~unpack_bitmask(bitmask, vocab) & constrained.bool().unsqueeze(1)
    want = want.masked_fill(drop.to(device), float("-inf"))
    processors._apply_penalties_torch(want, processors.penalties)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    found = logits_pass(logits.bfloat16(), out, processors.penalty_columns(), columns,
                        (bitmask.to(device), constrained.to(device)))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1].isinf(), want[1].isinf()) and not out[1].isinf().any()
    _check_lists(out, found, columns)


def _check_race(device: str, vocab: int):
    """The draw over a row's list equals the draw over the row (same seeds, so the same token):
    rows whose threshold is the k-th value, rows without a filter (they race over the row) and an
    overflowed row (ties: it races over the row)."""
    from runner.sampling.logits_pass import logits_pass
    from runner.sampling.race_kernel import race
    gen = torch.Generator().manual_seed(3)
    rows, k = 8, 4
    x = torch.randn(rows, vocab, generator=gen) * 2
    x[-1] = 1.0   # all tied: the list overflows
    x = x.to(device)
    found = logits_pass(x, None, None, k + 1)
    threshold = found.values[:, k - 1:k].clone()
    threshold[1] = float("-inf")
    temperature = torch.full((rows,), 0.7, device=device)
    counts = torch.zeros(3, vocab, dtype=torch.int32, device=device)
    seen = torch.zeros(3, vocab, dtype=torch.uint8, device=device)
    slots = torch.tensor([2, -1, 0, -1, -1, 1, -1, -1], device=device)
    for trial in range(3):
        seeds = torch.randint(0, 2 ** 31 - 1, (rows,), generator=gen).to(device) if trial else 12345
        want = race(x, temperature, threshold, seeds)
        assert torch.equal(race(x, temperature, threshold, seeds, found, record=(slots, counts, seen)), want)
        assert bool((x.gather(1, want.unsqueeze(1)) >= threshold).all())
        for row, slot in enumerate(slots.tolist()):   # the drawn tokens were counted into the rows' slots
            if slot >= 0:
                assert int(counts[slot, want[row]]) >= 1 and int(seen[slot, want[row]]) == 2
    assert int(counts.sum()) == 3 * 3 and torch.equal(seen != 0, counts > 0)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_structured_output_mask_in_the_pass_in_the_interpreter(small_blocks):
    _check_mask("cpu", 300, 3)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_race_over_the_lists_equals_the_race_over_the_rows_in_the_interpreter(small_blocks):
    _check_race("cpu", 600)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_candidates_equal_torch_topk_in_the_interpreter(small_blocks):
    _check_candidates("cpu", widths=(2, 3, 5), vocabs=(7, 3000))


@triton.jit
def _sort_rows(x_ptr, n_ptr, out_ptr, CAP: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(n_ptr + row)
    idx = tl.arange(0, CAP)
    v = tl.load(x_ptr + row * CAP + idx, mask=idx < n, other=float("-inf"))
    _sort_descending(v, out_ptr + row * CAP, n, CAP, CHUNK)


def _check_rank_sort(device: str) -> None:
    """`_sort_descending` places each of a list's first n values (ties, -0.0 and +0.0, infinities,
    NaN) once, largest first in the order of `_order_key`, the -inf padding after them; n from 0 to
    CAP, CAP a multiple of the chunk and not."""
    gen = torch.Generator().manual_seed(3)
    for cap, chunk in ((128, 32), (16, 32), (64, 16)):
        x = (torch.randint(-4, 5, (4, cap), generator=gen).float() / 2)   # ties everywhere
        x[0, :4] = torch.tensor([-0.0, 0.0, float("inf"), float("-inf")])
        x[1, :5] = torch.tensor([float("nan"), float("-inf"), float("-inf"), -0.0, 0.0])
        x[2] = torch.randn(cap, generator=gen)
        n = torch.tensor([cap, cap // 2 + 3, 5, 0], dtype=torch.int32)
        out = torch.full_like(x, 7.0).to(device)
        _sort_rows[(4,)](x.to(device), n.to(device), out, cap, chunk)
        bits = out.cpu().view(torch.int32)
        keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)   # _order_key
        for row in range(4):
            padded = torch.where(torch.arange(cap) < n[row], x[row], float("-inf"))
            want = padded.view(torch.int32)
            want = torch.where(want < 0, want ^ 0x7FFFFFFF, want).sort(descending=True).values
            assert torch.equal(keys[row], want), (cap, chunk, row, out[row])


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_rank_sort_places_every_value_in_the_interpreter():
    _check_rank_sort("cpu")


def _sampler_case(rows: int, vocab: int, device: str, greedy: bool):
    """Logits, metadata and processors of a batch with penalties, top-k / top-p / min-p (random
    rows) or greedy rows only; the same token history on either device."""
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0.0 if greedy else 0.8, top_k=[50, 20, 5][i % 3] if not greedy else 0,
                             top_p=[0.9, 1.0, 0.5][i % 3] if not greedy else 1.0,
                             min_p=[0.0, 0.05][i % 2] if not greedy else 0.0,
                             repetition_penalty=[1.2, 1.0, 0.9][i % 3], frequency_penalty=[0.0, 0.3][i % 2],
                             presence_penalty=[0.5, 0.0, 0.0, 0.2][i % 4]) for i in range(rows)]
    reqs = _requests(params, vocab, gen)
    history = torch.randint(0, vocab, (20, rows), generator=gen)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
    states = SamplingStates(vocab, torch.device(device))
    processors = LogitsProcessors.build(reqs, states, vocab, lambda t: t.to(device))
    for tokens in history:
        processors.record(tokens.to(device))
    return logits.to(device), SamplingMetadata.from_params(params, {}, device, processors), params


@pytest.mark.cuda
def test_logits_pass_on_the_gpu(kernel_switches):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_penalties("cuda", 51)
    _check_rank_sort("cuda")
    _check_candidates("cuda")
    _check_race("cuda", 128256)
    _check_mask("cuda", 3000, 51)
    kernel_switches(triton_sampling=True)
    sampler = Sampler()
    # Greedy rows with penalties: the pass's argmax equals the torch path's on the CPU.
    logits, metadata, _ = _sampler_case(64, 128256, "cuda", greedy=True)
    cpu_logits, cpu_metadata, _ = _sampler_case(64, 128256, "cpu", greedy=True)
    assert torch.equal(sampler(logits, metadata).sampled_token_ids.cpu(), sampler(cpu_logits, cpu_metadata).sampled_token_ids)
    # Random rows: the thresholds from the pass's candidates equal the torch path's.
    logits, metadata, params = _sampler_case(64, 128256, "cuda", greedy=False)
    cpu_logits, cpu_metadata, _ = _sampler_case(64, 128256, "cpu", greedy=False)
    from runner.sampling.logits_pass import logits_pass
    out = torch.empty(logits.shape, dtype=torch.float32, device="cuda")
    found = logits_pass(logits, out, metadata.processors.penalty_columns(), 51,
                        settings=(metadata.scale, metadata.min_p_offset, metadata.top_k, metadata.top_p))
    processed = cpu_metadata.processors.apply(cpu_logits)
    torch.testing.assert_close(out.cpu(), processed, rtol=1e-6, atol=1e-6)
    got = sampler.threshold(out, metadata, found).cpu()
    want = sampler.threshold(processed, cpu_metadata)
    assert (got == want).float().mean() > 0.95, (got, want)   # top-p sums in another order: rare one-tie shifts
    tokens = sampler(logits, metadata).sampled_token_ids.cpu()
    assert all(processed[row, token] >= want[row] for row, token in enumerate(tokens.tolist()))
    # Through the stage: the draw counts its tokens into the penalty state itself.
    from runner.sampling import SamplingStage
    params = SamplingParams(temperature=0.8, top_k=50, frequency_penalty=0.5)
    reqs = _requests([params] * 4, 128256, torch.Generator().manual_seed(5))
    stage = SamplingStage(128256, torch.device("cuda"))
    drawn = []
    for step in range(3):
        for req in reqs:
            req.output_token_count = step
        out = stage.launch(reqs, lambda: logits[:4], lambda: None).resolve()
        drawn.append([out.sampled[req.request_id] for req in reqs])
    counts = stage.states.output_counts
    for i, req in enumerate(reqs):
        row = counts[stage.states.slots[req.request_id]].cpu()
        assert int(row.sum()) == 3 and all(int(row[token]) >= 1 for token in (d[i] for d in drawn))
        flags = stage.states.seen[stage.states.slots[req.request_id]].cpu()
        assert torch.equal((flags & 2) != 0, row > 0)


def test_every_top_k_of_a_list_capacity_launches_the_same_variants(monkeypatch):
    """What Triton specialises the candidates' launches on (launch/specialisation.py) follows the
    list capacity and the sub-block, not the top-k itself: k + 1 is `do_not_specialize` in the
    bound and sort kernels (a k + 1 divisible by 16, as top-k 15, 31 or 47 give, would otherwise
    compile a variant of its own at its first step)."""
    from launch_keys import RecordingLaunch
    from runner.sampling import logits_pass as lp
    keys = {}
    for name in ("pass", "bound", "compact", "sort"):
        monkeypatch.setattr(lp, f"_launch_{name}", RecordingLaunch(getattr(lp, f"_{name}_kernel"), name, keys))
    rows, vocab = 3, 151936
    logits = torch.zeros(rows, vocab, dtype=torch.bfloat16)
    settings = tuple(torch.zeros(rows) for _ in range(4))
    for top_k in range(1, 32):   # one list capacity (128) and one sub-block at this vocabulary
        assert lp.list_capacity(top_k + 1) == 128 and lp.sub_block(vocab, top_k + 1) == lp.MAX_SUB_BLOCK
        lp.logits_pass(logits, None, None, top_k + 1, settings=settings, workspace={})
    assert {name: len(found) for name, found in keys.items()} == {"pass": 1, "bound": 1, "compact": 1, "sort": 1}
