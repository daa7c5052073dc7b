"""scripts/push_trace/sitecustomize.py, the trace scripts/tp_soak.sh gives every process of a run,
on a CPU: each rank of a TP=2 engine writes its start-up phases, steps and collectives in the same
order as its peer; a push all-reduce's peer timeout is shortened to PUSH_TRACE_TIMEOUT_S (never
lengthened); its timeout record is logged as soon as a row is written; and a synchronize that
lasts PUSH_TRACE_STALL_S logs a snapshot of the counters, tickets and slot tags; the allocator
blocks it reports are every block over the range asked. On two GPUs (`multigpu`): that snapshot
of a push kernel stalled for real, taken while it spins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "scripts" / "push_trace"


def _run(script: str, tmp_path: Path, **env) -> list[Path]:
    """`script` in a fresh interpreter with the trace on (files tmp_path/trace-PID.txt)."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRACE), str(REPO)]),
                   PUSH_TRACE_PREFIX=str(tmp_path / "trace"), **env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=240, env=environ, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return sorted(tmp_path.glob("trace-*.txt"))


def _events(path: Path) -> list[str]:
    """The file's events without their sequence number, time and thread."""
    return [line.split(" ", 3)[3] for line in path.read_text().splitlines() if not line.startswith("#")]


@pytest.mark.timeout(300)
def test_each_rank_traces_the_same_phases_steps_and_collectives(tmp_path):
    files = _run("""
        from tests.checkpoints import make_tiny_checkpoint
        from runner.llm import LLM
        from configs import SamplingParams
        path, _ = make_tiny_checkpoint(__import__("pathlib").Path(r"%s") / "ckpt", "llama_gqa",
                                       num_hidden_layers=2, with_tokenizer=False, vocab_size=255)
        with LLM(model=str(path), tensor_parallel_size=2, device="cpu", dtype="float32") as llm:
            llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    """ % tmp_path, tmp_path)
    ranks = {}
    for path in files:
        events = _events(path)
        rank = next((m.group(1) for e in events if (m := re.match(r"runner: tp rank (\d)", e))), None)
        if rank is not None:
            ranks[rank] = events
    assert sorted(ranks) == ["0", "1"]
    for events in ranks.values():
        phases = [e for e in events if e.startswith("enter ")]
        assert phases[:4] == ["enter init_groups", "enter push_all_reduce", "enter start_model_runner",
                              "enter load_model"]
        assert "enter profile_run" in phases and "enter destroy_groups" in phases
        assert any(e.startswith("step ") for e in events)
        assert any(e.startswith("collective tensor_parallel_all_reduce") for e in events)
    # the ranks made the same collectives in the same order
    def collectives(events):
        return [e for e in events if e.startswith("collective")]
    assert collectives(ranks["0"]) == collectives(ranks["1"])


SETUP = """
    import time, torch
    import sitecustomize as trace
    from models.push_all_reduce import PushAllReduce
    max_bytes = 4096
    buffers = [torch.zeros(PushAllReduce.buffer_bytes(max_bytes, 2), dtype=torch.uint8) for _ in range(2)]

    def wait_for(text):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(text in p.read_text() for p in __import__("pathlib").Path(r"%s").glob("trace-*.txt")):
                return
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} in the trace")
"""


def test_peer_timeout_is_shortened_never_lengthened(tmp_path):
    files = _run(SETUP % tmp_path + """
    assert PushAllReduce(buffers, 0, max_bytes, peer_timeout_s=60.0).timeout_ns == 5 * 10**9
    assert PushAllReduce(buffers, 0, max_bytes).timeout_ns == 5 * 10**9
    assert PushAllReduce(buffers, 0, max_bytes, peer_timeout_s=3.0).timeout_ns == 3 * 10**9
    """, tmp_path, PUSH_TRACE_TIMEOUT_S="5")
    events = _events(files[0])
    assert [e for e in events if e.startswith("push all-reduce set up")] == [
        "push all-reduce set up: rank 0 of 2 peer timeout 5.0 s", "push all-reduce set up: rank 0 of 2 peer timeout 5.0 s",
        "push all-reduce set up: rank 0 of 2 peer timeout 3.0 s"]


def test_a_timeout_record_and_a_stalled_synchronize_are_logged(tmp_path):
    files = _run(SETUP % tmp_path + """
    push = PushAllReduce(buffers, 0, max_bytes, timeout_record=True)
    slot = max_bytes // 4
    own = buffers[0].view(torch.int64)
    own[(1 * 2 + 1) * slot: (1 * 2 + 1) * slot + slot] = 37 << 32      # region 0, parity 1, from rank 1
    peer = buffers[1].view(torch.int64)
    peer[(2 * 2 + 0) * slot: (2 * 2 + 0) * slot + slot] = 5 << 32        # region 1, parity 0, rank 0's slot
    push.counters[0] = 38
    push.timeout_record[0] = torch.tensor([1, 0, 0, 1, 38, 36, 36, 39])
    wait_for("TIMEOUT RECORD")
    trace._sync["since"] = time.monotonic() - 100    # as if the main thread had waited that long
    wait_for("SNAPSHOT rank 0 tickets")
    time.sleep(0.5)
    """, tmp_path)
    events = _events(files[0])
    assert ("TIMEOUT RECORD push all-reduce timeout: rank 0 waited 600 s in the push all-reduce kernel for rank 1's "
            "words of call 38; that slot held calls 36..36, the other slot call 39") in events
    assert any(e.startswith("STALL: in torch.cuda.synchronize for") for e in events)
    assert "SNAPSHOT rank 0 counters [38" in "\n".join(events)
    assert "SNAPSHOT rank 0 own buffer region 0 parity 1 from rank 1 lanes 0:1024 tags 37..37" in events
    assert "SNAPSHOT rank 0 own buffer region 0 parity 0 from rank 1 lanes 0:1024 tags 0..0" in events
    assert "SNAPSHOT rank 0 rank 1's buffer region 1 parity 0 from rank 0 lanes 0:1024 tags 5..5" in events
    assert not any("from rank 0" in e for e in events if "own buffer" in e)   # its own slots are not read there


def test_blocks_at_names_every_block_over_a_range():
    import importlib.util
    spec = importlib.util.spec_from_file_location("push_trace_under_test", TRACE / "sitecustomize.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)   # PUSH_TRACE_PREFIX unset here: it patches nothing
    segments = [{"address": 0x1000, "total_size": 0x1000, "segment_type": "small", "blocks": [
                    {"size": 0x200, "state": "active_allocated"}, {"size": 0x200, "state": "inactive"},
                    {"size": 0xC00, "state": "active_allocated"}]},
                {"address": 0x4000, "total_size": 0x2000, "segment_type": "large", "is_expandable": True,
                 "blocks": [{"address": 0x4000, "size": 0x2000, "state": "active_allocated"}]}]
    assert trace.blocks_at(segments, 0x1200, 0x1400) == ["block 0x1200+512 inactive in small segment 0x1000+4096"]
    assert trace.blocks_at(segments, 0x11F0, 0x1210) == [
        "block 0x1000+512 active_allocated in small segment 0x1000+4096",
        "block 0x1200+512 inactive in small segment 0x1000+4096"]
    assert trace.blocks_at(segments, 0x5000, 0x5008) == [
        "block 0x4000+8192 active_allocated in large segment 0x4000+8192 (expandable)"]
    assert trace.blocks_at(segments, 0x3000, 0x3100) == []


def _rank_stalled_by_its_peer(rank: int, port: int, failures) -> None:
    """Rank 0 all-reduces while rank 1 never does, so rank 0's synchronize stalls behind a push kernel
    that spins until the 20 s peer timeout: the trace's watcher must snapshot it meanwhile (rank 1
    waits, so its mapping stays open); then the kernel traps."""
    import torch
    from tests.test_push_all_reduce import rank0_with_a_silent_peer
    store, reducer = rank0_with_a_silent_peer(rank, port, peer_timeout_s=20.0)
    try:
        reducer.all_reduce_(torch.ones(1, 4096, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
        failures.put("the all-reduce returned without the peer's words")
    except RuntimeError as error:   # the trap, after the snapshot
        if "CUDA" not in str(error):
            failures.put(f"the stalled all-reduce ended in another error: {error}")
    finally:
        store.set("rank 0 done", "1")
        os._exit(0)


@pytest.mark.multigpu
@pytest.mark.timeout(180)
def test_multigpu_a_stalled_push_kernel_is_snapshotted_while_it_spins(tmp_path, monkeypatch):
    """The snapshot copies the counters and both ranks' slots on a stream of its own while the
    stalled kernel still runs: rank 0's 32 programs each counted call 1 (its 2048 lanes: programs 0
    and 1), its words of call 1 are in its slots of rank 1's buffer (read over the mapping), and rank
    1's slots in rank 0's buffer are still zeroed."""
    from tests.test_push_all_reduce import _on_two_gpus
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TRACE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PUSH_TRACE_PREFIX", str(tmp_path / "trace"))
    monkeypatch.setenv("PUSH_TRACE_STALL_S", "3")
    _on_two_gpus(_rank_stalled_by_its_peer)
    traces = [p.read_text() for p in sorted(tmp_path.glob("trace-*.txt"))]
    stalled = [t for t in traces if "STALL: in torch.cuda.synchronize" in t]
    assert len(stalled) == 1, traces
    events = [line.split(" ", 3)[3] for line in stalled[0].splitlines() if not line.startswith("#")]
    assert f"SNAPSHOT rank 0 counters {[1] * 32}" in events
    assert "SNAPSHOT rank 0 tickets [0, 0, 0, 0]" in events
    for lanes, tag in (("0:1024", 1), ("1024:2048", 1), ("2048:4096", 0)):
        assert f"SNAPSHOT rank 0 rank 1's buffer region 0 parity 1 from rank 0 lanes {lanes} tags {tag}..{tag}" in events
        assert f"SNAPSHOT rank 0 rank 1's buffer region 0 parity 0 from rank 0 lanes {lanes} tags 0..0" in events
        assert f"SNAPSHOT rank 0 own buffer region 0 parity 1 from rank 1 lanes {lanes} tags 0..0" in events
    assert any(e.startswith("SNAPSHOT rank 0 own buffer") and "active_allocated" in e for e in events)
