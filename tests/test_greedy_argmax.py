"""runner/greedy.py: the GPU argmax equals torch's argmax (first maximum), run here in Triton's
interpreter with several chunk counts; the GPU run is in tests/test_triton_gpu.py."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on a CPU need TRITON_INTERPRET=1", allow_module_level=True)

from runner import greedy  # noqa: E402
from runner.sampling import argmax_rows  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, sms", [(1, 7, 8), (1, 5000, 8), (3, 2049, 2), (17, 1025, 132), (2, 3000, 1)])
def test_argmax_equals_torch_with_ties_and_edges(rows, vocab, sms, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype).to(DEVICE)
    if vocab > 100:
        x[0, vocab // 3] = x[0, vocab - 1] = 40.0          # a tie across chunks: the first wins
        x[-1, 1023:1025] = 41.0                           # a tie across a BLOCK boundary
    if rows > 2:
        x[1] = float("-inf")                               # all -inf: index 0, as torch
    got = greedy.launch(x, sms)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


def test_nan_counts_as_largest():
    x = torch.zeros(1, 3000, device=DEVICE)
    x[0, 2500] = float("nan")
    x[0, 10] = 5.0
    assert greedy.launch(x, 8).item() == 2500


def test_a_closed_gate_writes_nothing_and_an_open_one_the_argmax():
    """The gate a graph reads (`argmax_rows(logits, gate)`): at 0 both passes return before
    touching their outputs, at 1 they compute torch's argmax."""
    rows, vocab, sms = 3, 3000, 8
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    chunks, chunk_len = greedy.chunking(rows, vocab, sms)
    vals = torch.full((rows * chunks,), 7.0, device=DEVICE)
    idxs = torch.full((rows * chunks,), 7, dtype=torch.int32, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    for value in (0, 1):
        gate = torch.tensor([value], dtype=torch.int32, device=DEVICE)
        greedy._argmax_chunks_kernel[(rows, chunks)](x, vals, idxs, vocab, x.stride(0), chunk_len, out, 0, out, gate,
                                                     BLOCK=greedy.BLOCK, MASKED=False, GATED=True, PDL=False)
        greedy._argmax_rows_kernel[(rows,)](vals, idxs, out, chunks, gate, CHUNKS_PAD=greedy.MAX_CHUNKS, GATED=True,
                                            PDL=False)
        if value == 0:
            assert (out == -1).all() and (vals == 7.0).all() and (idxs == 7).all()
        else:
            assert torch.equal(out, x.argmax(dim=-1))
    assert torch.equal(greedy.launch(x, sms, gate=torch.ones(1, dtype=torch.int32, device=DEVICE)), x.argmax(dim=-1))


def test_cpu_tensor_takes_torch_argmax_and_rejects_bad_layout():
    x = torch.randn(4, 10)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    with pytest.raises(ValueError, match="contiguous rows"):
        greedy.argmax_rows(x.t())


@pytest.mark.parametrize("rows, vocab, sms, expected", [(1, 128256, 132, 64), (32, 49152, 132, 9), (512, 49152, 132, 1),
                                                        (1, 500, 132, 1)])
def test_chunks_spread_rows_over_the_sms(rows, vocab, sms, expected):
    assert greedy.num_chunks(rows, vocab, sms) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, sms", [(1, 7, 8), (4, 2049, 2), (6, 3000, 132)])
def test_masked_argmax_equals_masking_then_argmax(rows, vocab, sms, dtype):
    """Constrained rows see only the tokens their bitmask row allows (xgrammar's packing), the
    others every token; the bitmask covers more ids than the logits (its last word, and whole
    extra words as when it is as wide as a larger model vocabulary); a row allowing nothing gives 0."""
    from runner.structured_output.bitmask import unpack_bitmask
    g = torch.Generator().manual_seed(rows + vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    words = -(-vocab // 32) + 2
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    constrained = torch.tensor([(row + 1) % 2 for row in range(rows)], dtype=torch.int32)
    if rows > 2:
        bitmask[2] = 0                                   # constrained, nothing allowed
    allowed = unpack_bitmask(bitmask, vocab)
    expected = x.float().clone()
    rows_on = constrained.bool()
    expected[rows_on] = expected[rows_on].masked_fill(~allowed[rows_on], float("-inf"))
    got = greedy.launch(x.to(DEVICE), sms, (bitmask.to(DEVICE), constrained.to(DEVICE)))
    assert torch.equal(got.cpu(), expected.argmax(dim=-1))
    if DEVICE == "cuda":
        assert torch.equal(greedy.masked_argmax_rows(x.cuda(), bitmask.cuda(), constrained.cuda()).cpu(), got.cpu())


def test_queue_variants_launches_one_row_per_dtype_and_mask(monkeypatch):
    """Start-up queues the eager argmax's compiles (runner/graph_start_up.py): each dtype once
    unmasked and once masked with the flags 16-byte aligned and not, on logits laid out as serving's."""
    calls = []
    monkeypatch.setattr(greedy, "num_sms", lambda device: 132)
    monkeypatch.setattr(greedy, "launch", lambda logits, sms, masked=None: calls.append(
        (logits.shape, logits.dtype, logits.stride(), sms,
         None if masked is None else (masked[0].shape, masked[1].storage_offset() * 4 % 16 == 0))))
    vocab = 50000
    greedy.queue_variants(vocab, (torch.bfloat16, torch.float32), torch.device("cpu"))
    assert sorted(str(c) for c in calls) == sorted(
        str((torch.Size([1, vocab]), dtype, (vocab, 1), 132, masked))
        for dtype in (torch.bfloat16, torch.float32)
        for masked in (None, (torch.Size([1, 1563]), True), (torch.Size([1, 1563]), False)))


def test_every_row_count_launches_the_same_variants(monkeypatch):
    """What Triton specialises the two launches on (launch/specialisation.py) does not depend on the
    row count: the scratch's halves stay 16-byte aligned, pass 2 takes a fixed width and does not
    specialise the chunk count, and every chunk is whole BLOCKs. So the one row `queue_variants`
    launches compiles what every row count up to a serving batch will launch."""
    from launch_keys import RecordingLaunch
    keys = {}
    monkeypatch.setattr(greedy, "_chunks_launch", RecordingLaunch(greedy._argmax_chunks_kernel, "chunks", keys))
    monkeypatch.setattr(greedy, "_rows_launch", RecordingLaunch(greedy._argmax_rows_kernel, "rows", keys))
    vocab = 128256
    storage = torch.empty(300 * vocab, dtype=torch.bfloat16)
    for rows in range(1, 301):
        greedy.launch(storage[:rows * vocab].view(rows, vocab), 132)
    assert len(keys["chunks"]) == 1 and len(keys["rows"]) == 1
    for rows, vocab, sms in [(1, 128256, 132), (7, 50000, 132), (64, 1000, 8), (300, 49152, 132)]:
        chunks, chunk_len = greedy.chunking(rows, vocab, sms)
        assert chunk_len % greedy.BLOCK == 0 and (chunks - 1) * chunk_len < vocab <= chunks * chunk_len
        assert chunks <= greedy.MAX_CHUNKS
