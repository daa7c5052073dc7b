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
from runner.outputs import RequestOutput
from runner.request import Request
from runner.scheduler import Scheduler

BS = 4
MAX_REQS, MAX_BLOCKS = 6, 8


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
    for skip in (True, False):
        for ids in sequences:
            detok = IncrementalDetokenizer(tokenizer, skip, [])
            assert detok._stream is not None  # both are fast tokenizers: the incremental path runs
            for i in range(len(ids)):
                assert detok.update(ids[:i + 1]) is None
                assert detok.text == tokenizer.decode(ids[:i + 1], skip_special_tokens=skip).rstrip("\ufffd")


def test_detokenizer_stop_string_found_across_tokens():
    tokenizer = _byte_tokenizer(4096)
    ids = tokenizer.encode("abc STOP here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, True, ["STOP"])
    results = [detok.update(ids[:i + 1]) for i in range(len(ids))]
    assert results.index("STOP") == len("abc STOP") - 1 and detok.text == "abc "


def test_request_output_is_a_snapshot():
    tokens = [1, 2]
    out = RequestOutput("r", None, [0], "", tokens, False, num_token_ids=len(tokens))
    tokens.append(3)
    assert out.token_ids == [1, 2] and out.token_ids is out.token_ids
    same = RequestOutput("r", None, [0], "", [1, 2], False)
    assert out == same and "token_ids=[1, 2]" in repr(out)
    same.token_ids = [4]
    assert same.token_ids == [4] and out != same
