"""The decode step's host path: state kept between steps must give what recomputing gives.

- InputBatch keeps block-table rows between steps (only a grown table's new blocks are
  written); after any sequence of steps - tables growing, batches shifting when a request
  leaves, preempted requests coming back with a new table in the same or another row, rows
  padded for a graph - every buffer must equal one built from scratch.
- The KV-cache manager names every new table (`block_table_id`), preemption included.
- The incremental detokenizer's text equals a whole decode after every token.
- A RequestOutput is a snapshot: later steps do not change it.
- A uniform batch whose last request is a non-final one-token chunk samples the right rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from checkpoints import _byte_tokenizer, make_tiny_checkpoint
from configs import CacheConfig, SamplingParams, SchedulerConfig
from runner import LLM
from runner.detokenizer import IncrementalDetokenizer
from runner.input_batch import InputBatch
from runner.outputs import CompletionOutput, RequestOutput
from runner.request import Request
from runner.scheduler import Scheduler

BS = 4
MAX_REQS, MAX_BLOCKS = 6, 8


def expected_buffers(token_ids, num_computed, block_ids, padded_reqs):
    """The step's inputs computed directly from their definitions."""
    table = np.zeros((padded_reqs, MAX_BLOCKS), dtype=np.int32)
    for row, blocks in enumerate(block_ids):
        table[row, :len(blocks)] = blocks
    positions = [start + i for start, ids in zip(num_computed, token_ids) for i in range(len(ids))]
    rows = [row for row, ids in enumerate(token_ids) for _ in ids]
    slots = [block_ids[r][p // BS] * BS + p % BS for r, p in zip(rows, positions)]
    lens = [len(ids) for ids in token_ids]
    return table, positions, rows, slots, np.cumsum([0] + lens), [s + n for s, n in zip(num_computed, lens)]


@st.composite
def step_sequences(draw):
    """Steps over a few requests whose tables grow, get replaced (preemption) or are unnamed (-1)."""
    next_id, tables, steps = 0, {}, []
    for _ in range(draw(st.integers(1, 12))):
        names = draw(st.lists(st.integers(0, 7), min_size=1, max_size=MAX_REQS, unique=True))
        batch = []
        for name in names:
            table_id, blocks = tables.get(name, (None, []))
            if table_id is None or draw(st.integers(0, 5)) == 0:  # new request, or preempted and back
                table_id, blocks = next_id, []
                next_id += 1
            blocks = blocks + draw(st.lists(st.integers(0, 50), max_size=2))
            blocks = blocks or [draw(st.integers(0, 50))]
            blocks = blocks[:MAX_BLOCKS]
            tables[name] = (table_id, blocks)
            capacity = len(blocks) * BS
            num_new = draw(st.integers(1, min(capacity, 5)))
            start = draw(st.integers(0, capacity - num_new))
            named = table_id if draw(st.integers(0, 7)) else -1
            batch.append((draw(st.lists(st.integers(0, 99), min_size=num_new, max_size=num_new)), start,
                          list(blocks), named))
        padded = draw(st.integers(len(batch), MAX_REQS))
        steps.append((batch, padded))
    return steps


BUFFERS = ("input_ids", "positions", "slot_mapping", "token_request_index", "query_start_loc", "seq_lens",
           "block_table", "placeholder_token_rows", "placeholder_sample_rows", "graph_greedy")


def with_device_copies(batch: InputBatch, monkeypatch) -> list[str]:
    """Give each buffer a "device" tensor of its own (a CPU clone), as on a GPU, so that an upload
    really copies and a skipped one leaves stale rows; returns the log of uploaded buffer names."""
    names = {}
    for name in BUFFERS:
        buffer = getattr(batch, name)
        buffer.gpu = buffer.cpu.clone()
        buffer._views.clear()
        names[id(buffer)] = name
    batch.on_device = True
    log: list[str] = []
    upload = type(batch.input_ids).upload
    monkeypatch.setattr(type(batch.input_ids), "upload", lambda self, n: (log.append(names[id(self)]), upload(self, n)))
    return log


@settings(max_examples=150, deadline=None)
@given(steps=step_sequences(), separate_device=st.booleans())
def test_input_batch_incremental_block_table_matches_scratch(steps, separate_device):
    """With `separate_device` the buffers have device copies, so the uploads the batch skips
    (unchanged block table, query_start_loc, token_request_index) must not leave stale rows."""
    batch = InputBatch(64, MAX_REQS, MAX_BLOCKS, BS, torch.device("cpu"))
    if separate_device:
        with pytest.MonkeyPatch.context() as monkeypatch:
            with_device_copies(batch, monkeypatch)
            _check_steps(batch, steps)
    else:
        _check_steps(batch, steps)


def _check_steps(batch: InputBatch, steps) -> None:
    for requests, padded_reqs in steps:
        token_ids, num_computed, block_ids, table_ids = (list(x) for x in zip(*requests))
        num_tokens = sum(map(len, token_ids))
        common = batch.prepare(token_ids, num_computed, block_ids, num_tokens + 2, padded_reqs,
                               block_table_ids=table_ids)
        table, positions, rows, slots, qsl, seq_lens = expected_buffers(token_ids, num_computed, block_ids,
                                                                        padded_reqs)
        assert (common.block_table.numpy() == table).all()
        assert common.slot_mapping.tolist() == slots + [-1, -1]
        assert common.token_request_index.tolist() == rows + [-1, -1]
        assert batch.positions.gpu[:num_tokens].tolist() == positions
        assert batch.input_ids.gpu[:num_tokens].tolist() == [t for ids in token_ids for t in ids]
        n = len(requests)
        assert common.query_start_loc.tolist() == qsl.tolist() + [num_tokens] * (padded_reqs - n)
        assert common.seq_lens.tolist() == seq_lens + [0] * (padded_reqs - n)
        assert common.num_computed_tokens_cpu.tolist() == num_computed + [0] * (padded_reqs - n)
        assert common.uniform_decode == (num_tokens == n)
        assert common.max_seq_len == max(seq_lens) and common.max_query_len == max(map(len, token_ids))


def test_steady_decode_uploads_only_what_changed(monkeypatch):
    """Async decode of the same requests: after the first step only seq_lens, slot_mapping and
    positions are copied; input_ids come from the previous step's samples on the device; a new
    block, a new request or a non-placeholder token brings the other copies back."""
    batch = InputBatch(16, 4, MAX_BLOCKS, BS, torch.device("cpu"))
    log = with_device_copies(batch, monkeypatch)

    def step(starts, tables, sampled=None):
        log.clear()
        n = len(starts)
        placeholders = None if sampled is None else (list(range(n)), list(range(n)), torch.tensor(sampled))
        common = batch.prepare([[0]] * n, starts, [b for _, b in tables], n, n,
                               block_table_ids=[t for t, _ in tables], placeholders=placeholders)
        assert batch.input_ids.gpu[:n].tolist() == (sampled or [0] * n)
        assert common.seq_lens.tolist() == [s + 1 for s in starts]
        assert common.block_table.tolist() == [b + [0] * (MAX_BLOCKS - len(b)) for _, b in tables]
        assert common.query_start_loc.tolist() == list(range(n + 1))
        return sorted(log)

    every = sorted(["query_start_loc", "token_request_index", "seq_lens", "slot_mapping", "positions",
                    "block_table", "input_ids"])
    assert step([5, 2], [(0, [3, 4]), (1, [6])]) == sorted(every + ["graph_greedy"])   # the gate's first upload
    steady = ["positions", "seq_lens", "slot_mapping"]
    assert step([6, 3], [(0, [3, 4]), (1, [6])], sampled=[11, 12]) == steady
    assert step([7, 4], [(0, [3, 4]), (1, [6, 8])], sampled=[13, 14]) == sorted(steady + ["block_table"])
    assert step([8, 5], [(0, [3, 4, 9]), (1, [6, 8])], sampled=[15, 16]) == sorted(steady + ["block_table"])
    assert step([9, 6], [(0, [3, 4, 9]), (1, [6, 8])], sampled=[17, 18]) == steady
    # A third request joins (its token is known, not a placeholder): every buffer goes again.
    assert step([10, 7, 0], [(0, [3, 4, 9]), (1, [6, 8]), (2, [5])]) == every


def test_the_greedy_gate_reaches_the_device_when_it_changes(monkeypatch):
    """`graph_greedy` (read by a decode graph's argmax kernels) is on the device for every step
    and is copied only on the steps where it changed."""
    batch = InputBatch(16, 4, MAX_BLOCKS, BS, torch.device("cpu"))
    log = with_device_copies(batch, monkeypatch)
    for start, gate, copied in [(5, True, True), (6, True, False), (7, False, True), (8, False, False),
                                (9, True, True)]:
        log.clear()
        batch.prepare([[0]], [start], [[3, 4, 5]], 1, 1, block_table_ids=[0], graph_greedy=gate)
        assert batch.graph_greedy.gpu.tolist() == [int(gate)]
        assert ("graph_greedy" in log) == copied


def test_the_graph_takes_greedy_tokens_only_when_every_row_is_greedy():
    from types import SimpleNamespace

    from configs import SamplingParams
    from runner.model_runner import graph_takes_greedy

    def reqs(*temperatures):
        return [SimpleNamespace(sampling_params=SamplingParams(temperature=t)) for t in temperatures]

    assert graph_takes_greedy(reqs(0.0, 0.0), 1)
    assert not graph_takes_greedy(reqs(0.0, 0.6), 1) and not graph_takes_greedy(reqs(1e-6), 1)
    assert not graph_takes_greedy(reqs(0.0, 0.0), 2)   # tensor parallel: the argmax of the gathered logits


def test_input_batch_rows_follow_the_tables():
    """The cases by name: grown in place, shifted up after a request left, replaced in the same row."""
    batch = InputBatch(16, 3, MAX_BLOCKS, BS, torch.device("cpu"))

    def step(*requests):  # (table_id, blocks) per row, one decode token each at the table's last slot
        common = batch.prepare([[1]] * len(requests), [len(b) * BS - 1 for _, b in requests],
                               [b for _, b in requests], len(requests), 3, block_table_ids=[t for t, _ in requests])
        return common.block_table.numpy().tolist()

    assert step((0, [5, 6]), (1, [7])) == [[5, 6, 0, 0, 0, 0, 0, 0], [7] + [0] * 7, [0] * 8]
    assert step((0, [5, 6, 9]), (1, [7])) == [[5, 6, 9, 0, 0, 0, 0, 0], [7] + [0] * 7, [0] * 8]
    # Request 0 finished: request 1's table moves up to row 0, row 1 is padding now.
    assert step((1, [7, 8])) == [[7, 8] + [0] * 6, [0] * 8, [0] * 8]
    # Request 1 was preempted and comes back with a new, shorter table (new id) in the same row.
    assert step((2, [3])) == [[3] + [0] * 7, [0] * 8, [0] * 8]
    # The same table content under the old id is no shortcut: a new id is written whole.
    assert step((3, [3]), (4, [1, 2])) == [[3] + [0] * 7, [1, 2] + [0] * 6, [0] * 8]


def test_new_table_ids_after_preemption():
    """A table keeps its id while it grows; a preempted request comes back with a new one."""
    # 6 blocks of 4: two requests growing to 6 + 12 tokens cannot both stay (b is preempted).
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                      CacheConfig(block_size=BS, enable_prefix_caching=False), 6, 24, {2})
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for rid in "ab":
        sched.add_request(Request(request_id=rid, prompt_token_ids=[7] * 6, sampling_params=params))
    seen: dict[str, list[tuple[int, list[int], int]]] = {"a": [], "b": []}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for s in out.scheduled:
            seen[s.request_id].append((s.block_table_id, list(s.block_ids), s.num_computed_tokens))
        sched.update({s.request_id: 9 for s in out.scheduled if s.sample})
    assert len({table_id for table_id, _, _ in seen["a"]}) == 1
    b_ids = [table_id for table_id, _, _ in seen["b"]]
    restarts = [i for i in range(1, len(b_ids)) if b_ids[i] != b_ids[i - 1]]
    assert restarts and sched.num_preemptions == len(restarts)
    for i in restarts:
        assert seen["b"][i][2] == 0  # recomputed from scratch: a new table
    for (id0, blocks0, _), (id1, blocks1, _) in zip(seen["b"], seen["b"][1:]):
        if id0 == id1:
            assert blocks1[:len(blocks0)] == blocks0  # same id: the same table, grown at most


def test_update_skips_requests_aborted_after_schedule():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(block_size=BS),
                      64, 64, {2})
    for rid in "ab":
        sched.add_request(Request(request_id=rid, prompt_token_ids=[3, 4], sampling_params=SamplingParams()))
    sched.schedule()
    sched.abort_request("a")
    assert [r.request_id for r in sched.update({"a": 5, "b": 6})] == ["b"]  # a's token may come back
    sched.schedule()
    sched.abort_request("b")
    assert sched.update({}) == []                                           # or not
    with pytest.raises(RuntimeError, match="not expected"):
        sched.add_request(Request(request_id="c", prompt_token_ids=[3], sampling_params=SamplingParams()))
        sched.schedule()
        sched.update({"c": 1, "zzz": 2})


@pytest.mark.parametrize("tokenizer_name", ["byte", "smollm2"])
def test_incremental_detokenizer_matches_whole_decode(tokenizer_name):
    if tokenizer_name == "byte":
        tokenizer, vocab = _byte_tokenizer(4096), 256
    else:
        from models.embedded import EmbeddedModelError, ensure_smollm2
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
        except EmbeddedModelError as error:
            pytest.skip(str(error))
        vocab = tokenizer.vocab_size
    generator = torch.Generator().manual_seed(0)
    texts = ["Héllo wörld 你好 🎉 plain ascii", "日本語のテキスト。", " spaces  and\nnewlines"]
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sequences += [torch.randint(0, vocab, (40,), generator=generator).tolist() for _ in range(20)]
    held = 0
    for skip in (True, False):
        for ids in sequences:
            detok = IncrementalDetokenizer(tokenizer, skip, [])
            assert detok._stream is not None and detok._byte_level  # both take the incremental path
            for i in range(len(ids)):
                assert detok.update(ids[:i + 1]) is None
                assert detok.text == tokenizer.decode(ids[:i + 1], skip_special_tokens=skip).rstrip("\ufffd")
                held += detok._num_emitted < i + 1
    assert held > 10  # the held-back path (unfinished characters, skipped specials) ran


def test_detokenizer_stop_string_found_across_tokens():
    tokenizer = _byte_tokenizer(4096)
    ids = tokenizer.encode("abc STOP here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, True, ["STOP"])
    results = [detok.update(ids[:i + 1]) for i in range(len(ids))]
    assert results.index("STOP") == len("abc STOP") - 1 and detok.text == "abc "


def test_completion_output_is_a_snapshot():
    tokens = [1, 2]
    out = CompletionOutput(0, "", tokens, num_token_ids=len(tokens))
    tokens.append(3)
    assert out.token_ids == [1, 2] and out.token_ids is out.token_ids
    same = CompletionOutput(0, "", [1, 2])
    assert out == same and "token_ids=[1, 2]" in repr(out)
    same.token_ids = [4]
    assert same.token_ids == [4] and out != same
    request = RequestOutput("r", None, [0], None, [out], False)
    assert request == RequestOutput("r", None, [0], None, [CompletionOutput(0, "", [1, 2])], False)
    assert request != RequestOutput("r", None, [0], None, [same], False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa", with_tokenizer=False)
    return path


def test_uniform_batch_ending_in_a_one_token_chunk(tiny_path):
    """Budget 2: request a (1-token prompt) samples while b's prompt goes in 1-token chunks, so
    the batch is uniform (2 tokens, 2 requests) but only row 0 samples: the logits and the
    sampling metadata must cover the sampling rows only (seeded random sampling, same tokens
    as without the budget)."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    llm = LLM(model=str(tiny_path), dtype="float32", device="cpu", max_num_batched_tokens=2, max_num_seqs=2)
    small = [o.outputs[0].token_ids for o in llm.generate([[7], [5, 6, 7, 8]], params, use_tqdm=False)]
    alone = [o.outputs[0].token_ids for o in LLM(model=str(tiny_path), dtype="float32", device="cpu").generate(
        [[7], [5, 6, 7, 8]], params, use_tqdm=False)]
    assert small == alone and all(len(t) == 4 for t in small)


def test_host_benchmark_smoke(tmp_path, capsys):
    """`graphrunner bench host` end to end, tiny: rows per batch size, its JSON under --out."""
    import json

    from runner.benchmarks import host
    result = host.run(["--batch-sizes", "1", "3", "--steps", "3", "--warmup", "1", "--repeats", "2",
                       "--tokenizer", "none", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "host.json").read_text()) == result
    rows = result["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3] and all(0 < r["host_ms"] < r["step_ms"] for r in rows)
    assert all(len(r["host_ms_repeats"]) == 2 for r in rows)
    assert "| none | 3 |" in capsys.readouterr().out
