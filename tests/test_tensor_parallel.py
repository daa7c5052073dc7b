"""Issue 22: tensor parallelism, the runtime side. On a CPU (gloo, spawned workers): the rank
layout and groups, the config/CLI surface and its errors, the ranks' agreement on one graph plan,
one block count and one graph per step, TP=2 and TP=2 x PP=2 giving TP=1's and HF's tokens, and a
dead or failing TP rank surfacing as an error that names it. The `multigpu` tests (2 GPUs) check
TP=2 against TP=1 in FULL and FULL_AND_PIECEWISE with the address check on, with the push
all-reduce (the default) and with NCCL's all-reduces; with 4 GPUs, TP=2 x PP=2 the same way.

Two kinds of end-to-end test:
- `replicated`: every TP rank builds the whole model and a test shim (REPLICATED_SHIM) adds the
  collectives a sharded model makes: an all-reduce of each stage's output (x / 2 summed over two
  ranks: exact) and a vocabulary-parallel LM head (each rank keeps its slice of the logits, padded
  when the vocabulary does not split evenly, and the slices are all-gathered). It checks the
  runtime (every TP rank runs every step, in the same collectives, and rank 0 gets the sampler's
  tokens) independently of how models/ shard.
- the parity tests run the models as they are: they need the sharded model side (column/row
  parallel layers, local head counts) for checkpoints with at least as many KV heads as ranks.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import re
import signal
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from model_helpers import generated_tokens, process_alive
from tp_consensus_rank import consensus_rank
from configs import CUDAGraphMode, EngineConfig, SamplingParams
from models.parallel_state import tensor_parallel_group
from runner import LLM
from runner.cudagraph import BatchDescriptor
from runner.cudagraph.consensus import agree_graph_plan
from runner.distributed.topology import Topology

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=32,
           max_num_seqs=4)
# MQA (1 KV head: fewer than the 2 TP ranks, so it is replicated) and a vocabulary of 255 (odd).
MQA_ODD_VOCAB = dict(num_key_value_heads=1, vocab_size=255)


def _prompts(seed: int, vocab: int = 255) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 41, 1, 17)]


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "mqa", "llama", num_hidden_layers=4,
                                    with_tokenizer=False, seed=4, **MQA_ODD_VOCAB)
    prompts = _prompts(0)
    return path, prompts, hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)


# ---- layout, head counts, config, CLI ---------------------------------------------------------
def test_rank_layout_is_stage_major():
    t = Topology(tp_size=2, pp_size=2)
    assert t.world_size == 4
    assert [(t.stage(r), t.tp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert t.tp_group_ranks(0) == [0, 1] and t.tp_group_ranks(1) == [2, 3]
    assert [t.prev_rank(r) for r in range(4)] == [None, None, 0, 1]   # same TP rank, previous stage
    assert [t.next_rank(r) for r in range(4)] == [2, 3, None, None]
    assert t.sampler_rank == 2 and Topology(2, 1).sampler_rank == 0 and Topology(1, 3).sampler_rank == 2
    assert t.describe(3) == "rank 3 (pp stage 1, tp rank 1)"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Topology(0, 1)


def test_config_field_and_its_validation():
    config = EngineConfig.from_kwargs(model="m", tensor_parallel_size=2, pipeline_parallel_size=3)
    assert config.parallel.tensor_parallel_size == 2 and config.parallel.world_size == 6
    assert EngineConfig.from_kwargs(model="m").parallel.tensor_parallel_size == 1
    # Async scheduling: on by default for tensor parallelism on a GPU, never with pipeline stages.
    assert EngineConfig.from_kwargs(model="m", tensor_parallel_size=2).resolve_async_scheduling("cuda")
    assert not EngineConfig.from_kwargs(model="m", tensor_parallel_size=2).resolve_async_scheduling("cpu")
    assert not EngineConfig.from_kwargs(model="m", tensor_parallel_size=2,
                                        pipeline_parallel_size=2).resolve_async_scheduling("cuda")
    assert EngineConfig.from_kwargs(model="m", tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(model="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="async_scheduling=True is not supported .*pipeline_parallel_size=2"):
        EngineConfig.from_kwargs(model="m", tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True)


def test_cli_flags():
    from runner.cli import build_parser
    from runner.engine_args import engine_kwargs
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-tp", "2", "--pipeline-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2 and engine_kwargs(args)["pipeline_parallel_size"] == 2
    args = parser.parse_args(["generate", "--tensor-parallel-size", "2", "-pp", "3"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)


def test_unsplittable_heads_fail_before_any_process(mqa, tmp_path):
    path, _, _ = mqa
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(model=str(path), tensor_parallel_size=3, **CPU)
    assert multiprocessing.active_children() == []


def test_more_processes_than_gpus_is_a_clear_error(mqa, monkeypatch):
    from models.hf_config import load_hf_config, model_spec
    from runner.distributed.executor import DistributedExecutor
    path, _, _ = mqa
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2, pipeline_parallel_size=2)
    spec = model_spec(load_hf_config(str(path)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size x pipeline_parallel_size = 2 x 2 needs 4 GPUs on "
                                         r"this host \(one per process\); torch sees 1"):
        DistributedExecutor(config, spec, str(path), torch.device("cuda"), torch.float32, 128)
    assert multiprocessing.active_children() == []


# ---- agreement: one graph plan, readiness, one graph per step --------------------------------
def test_graph_plan_agreement_rules():
    F, P = "FULL_AND_PIECEWISE", "PIECEWISE"
    assert agree_graph_plan([(F, [1, 2, 4]), (F, [1, 2, 4])]) == (CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4])
    assert agree_graph_plan([(F, [1, 2, 4, 8]), (F, [1, 2, 8, 16])]) == (CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 8])
    assert agree_graph_plan([(F, [1, 2]), (P, [1, 2])]) == (CUDAGraphMode.PIECEWISE, [1, 2])   # decode: both have PIECEWISE
    assert agree_graph_plan([(F, [1]), ("FULL_DECODE_ONLY", [1])]) == (CUDAGraphMode.FULL_DECODE_ONLY, [1])
    assert agree_graph_plan([(F, [1, 2]), ("NONE", [])]) == (CUDAGraphMode.NONE, [])
    assert agree_graph_plan([("FULL", [1, 2]), (P, [1, 2])]) == (CUDAGraphMode.NONE, [])   # FULL has no PIECEWISE
    assert agree_graph_plan([(F, [1, 2]), (F, [4, 8])]) == (CUDAGraphMode.NONE, [])   # no common size


def test_ranks_that_would_pick_different_graphs_agree():
    import torch.distributed as dist
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    procs = [context.Process(target=consensus_rank, args=(rank, store.port, results)) for rank in range(4)]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    bad = {rank: r for rank, r in got.items() if not isinstance(r, dict)}
    assert not bad, bad
    alone = [got[r]["alone"] for r in range(4)]
    assert len({tuple(a) for a in alone}) > 1, "the ranks' own plans must differ for this test to mean anything"
    assert alone[0][4] != alone[1][4]     # 9 tokens: rank 0 pads to its 16-graph, rank 1 has none that big
    for rank in range(4):
        r = got[rank]
        assert r["plan"] == (CUDAGraphMode.PIECEWISE, [1, 2, 4, 8])
        assert r["ready_first"] is False and all(d == (CUDAGraphMode.NONE, None) for d in r["first"])
        assert r["ready"] is True
        assert all(ok for _, ok in r["replayed"])
        assert [d for d, _ in r["replayed"]] == [d for d, _ in got[0]["replayed"]]
        assert r["tp_sum"] == (1.0 if rank < 2 else 5.0)
    decisions = [d for d, _ in got[0]["replayed"]]
    assert decisions[1] == (CUDAGraphMode.PIECEWISE, BatchDescriptor(4, 0, True))
    assert decisions[4] == (CUDAGraphMode.NONE, None)   # 9 tokens: larger than the common sizes


def test_a_rank_refuses_a_graph_it_does_not_hold(mqa):
    """A decision this rank cannot replay raises a clear error instead of running something else
    (which would leave the other ranks waiting in a collective)."""
    from models.hf_config import load_hf_config, model_spec
    from runner.model_runner import ModelRunner
    from runner.scheduler import ScheduledRequest, SchedulerOutput
    path, _, _ = mqa
    config = EngineConfig.from_kwargs(model=str(path), **CPU)
    runner = ModelRunner(config, model_spec(load_hf_config(str(path))), str(path), torch.device("cpu"),
                         torch.float32, 128)
    sched = SchedulerOutput([ScheduledRequest("a", [5], 3, [0], True, SamplingParams(), 1)], 1, [], [])
    assert runner.padded_num_tokens(sched, (CUDAGraphMode.NONE, None)) == 1
    with pytest.raises(RuntimeError, match=r"rank 0 chose the FULL graph .*num_tokens=1.* but this rank \(tp rank 0, "
                                           r"layers 0\.\.3\) has no such graph \(graphs ready: False, mode NONE"):
        runner.padded_num_tokens(sched, (CUDAGraphMode.FULL, BatchDescriptor(1, 1, True)))


@pytest.mark.parametrize("failure", [None, "worker rank 1 died"])
def test_teardown_releases_graphs_before_destroying_groups(monkeypatch, failure):
    """NCCL cannot destroy a communicator while a CUDA graph holding its collectives exists
    (destroy_process_group hangs): a clean shutdown stops the workers, releases rank 0's graphs,
    then destroys the groups. After a failure nothing synchronises (a collective may never end):
    the groups are aborted with the graphs still there."""
    from runner.distributed import executor
    calls = []
    monkeypatch.setattr(executor, "broadcast_message", lambda message, groups: calls.append(message[0]))
    monkeypatch.setattr(executor, "destroy_groups", lambda groups, abort: calls.append(("destroy", abort)))
    state = executor._State(groups=object(), failure=failure, release_graphs=lambda: calls.append("release"))
    executor._teardown(state)
    executor._teardown(state)  # idempotent
    assert calls == (["stop", "release", ("destroy", False)] if failure is None else [("destroy", True)])
    assert state.release_graphs is None


@pytest.mark.parametrize("abort", [False, True])
def test_an_abort_that_blocks_delays_the_teardown_only_so_long(monkeypatch, caplog, abort):
    """A failure's teardown aborts the NCCL groups on a helper thread and goes on after
    ABORT_WAIT_S if the abort blocks (it can wait on an operation of the failed step); a clean
    one destroys them in turn, on the caller's thread."""
    import threading
    from runner.distributed import comm
    release, calls = threading.Event(), []

    def blocking_destroy(group, aborting):
        calls.append((group, aborting, threading.current_thread().name))
        if aborting:
            release.wait(30)
    monkeypatch.setattr(comm, "_destroy", blocking_destroy)
    monkeypatch.setattr(comm, "ABORT_WAIT_S", 0.3)
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    groups = comm.DistributedGroups(0, Topology(tp_size=2, pp_size=1), "nccl", None, None, None, None, True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="runner.distributed.comm"):
        comm.destroy_groups(groups, abort=abort)
    release.set()
    assert time.monotonic() - started < 5
    if abort:
        assert calls == [(None, True, "graphrunner-nccl-abort")]
        assert "aborting the NCCL communicators has not ended after 0 s" in caplog.text
    else:
        assert calls == [(None, False, threading.current_thread().name)] and not caplog.text


def test_a_push_all_reduce_timeout_reaches_rank_0s_error_and_log(monkeypatch, caplog):
    """A step that trapped in the push all-reduce: rank 0's error carries what its kernels waited
    for (models/push_all_reduce.PushAllReduce.timeouts), and the teardown logs it, which also
    covers an async step whose error surfaces outside the executor."""
    from runner.distributed import executor
    line = "push all-reduce timeout: rank 0 waited 120 s in the push all-reduce kernel for rank 1's words of call 9"
    monkeypatch.setattr(executor, "push_all_reduce_timeouts", lambda: [line])
    monkeypatch.setattr(executor, "destroy_groups", lambda groups, abort: None)
    state = executor._State()
    fake = SimpleNamespace(_state=state, rank=0, _finalizer=lambda: executor._teardown(state))
    error = RuntimeError("CUDA error: unspecified launch failure")
    with caplog.at_level(logging.ERROR, logger="runner.distributed.executor"), pytest.raises(RuntimeError) as raised:
        executor.DistributedExecutor._fail(fake, error, "step")
    assert raised.value is error and error.__notes__ == [line]
    assert line in caplog.text and "step failed on rank 0" in state.failure


# ---- end to end: the runtime with a replicated model and emulated collectives ----------------
REPLICATED_SHIM = '''
"""Test shim: build the whole model on every TP rank (the TP group hidden while it is built and
while it runs), then add the collectives a sharded model makes: each stage's output all-reduced
(x / size summed over the group) and a vocabulary-parallel LM head (slices padded to an equal
width, all-gathered, the padding cut). Each non-empty step is logged as "tp_rank first_layer tokens"."""
import os
import torch
from models import parallel_state
from runner.model_runner import ModelRunner

SINGLE = parallel_state.TensorParallelGroup()


def _hidden(call, *args):
    real = parallel_state.tensor_parallel_group()
    parallel_state._GROUP = SINGLE
    try:
        return call(*args)
    finally:
        parallel_state._GROUP = real


def install():
    load, execute = ModelRunner.load_model, ModelRunner.execute

    def load_model(self):
        _hidden(load, self)
        model, group = self.model, parallel_state.tensor_parallel_group()
        forward, compute_logits = model.forward, model.compute_logits

        def tp_forward(input_ids, positions, intermediate=None):
            out = _hidden(forward, input_ids, positions, intermediate)
            for t in ([out] if isinstance(out, torch.Tensor) else [out.hidden_states, out.residual]):
                parallel_state.tensor_parallel_all_reduce(t.div_(group.size))
            return out

        def tp_compute_logits(hidden, float32=True):
            full = _hidden(compute_logits, hidden, float32)
            vocab = full.shape[-1]
            width = -(-vocab // group.size)
            part = full[..., group.rank * width:(group.rank + 1) * width]
            shard = torch.zeros(*full.shape[:-1], width, dtype=full.dtype)
            shard[..., :part.shape[-1]] = part
            return parallel_state.tensor_parallel_all_gather(shard)[..., :vocab]

        model.forward, model.compute_logits = tp_forward, tp_compute_logits

    def logged_execute(self, sched, decision=None):
        out = execute(self, sched, decision)
        folder = os.environ.get("TP_SHIM_STEP_LOG")
        if folder and sched.scheduled:
            with open(os.path.join(folder, str(os.getpid())), "a") as log:
                log.write(f"{self.tp_rank} {self.layer_range.start} {sched.num_scheduled_tokens}\\n")
        return out

    ModelRunner.load_model, ModelRunner.execute = load_model, logged_execute
    return lambda: setattr(ModelRunner, "load_model", load) or setattr(ModelRunner, "execute", execute)
'''


@pytest.fixture
def replicated(tmp_path, monkeypatch):
    """The shim in this process (rank 0) and, through sitecustomize, in every spawned worker;
    yields the folder of the per-process step logs."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "tp_replicated_shim.py").write_text(REPLICATED_SHIM)
    (shim / "sitecustomize.py").write_text("import tp_replicated_shim\ntp_replicated_shim.install()\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TP_SHIM_STEP_LOG", str(logs))
    monkeypatch.syspath_prepend(str(shim))
    import tp_replicated_shim
    undo = tp_replicated_shim.install()
    yield logs
    undo()


LOGPROBS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def _logprob_values(entries) -> list[tuple[int, float]]:
    """(token id, logprob) of every entry of a logprobs list (None entries skipped)."""
    return [(token, lp.logprob) for entry in entries if entry for token, lp in sorted(entry.items())]


def _step_logs(logs: Path) -> dict[tuple[int, int], list[int]]:
    """(tp rank, first layer) -> the token counts of the steps that process ran."""
    steps = {}
    for log in logs.iterdir():
        lines = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        steps[lines[0][:2]] = [tokens for _, _, tokens in lines]
    return steps


@pytest.mark.parametrize("tp, pp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_replicated_model_runs_every_step_on_every_rank(mqa, replicated, tp, pp):
    path, prompts, expected = mqa
    with LLM(model=str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **CPU) as llm:
        executor = llm.engine.executor
        pids = executor.worker_pids
        assert sorted(pids) == list(range(1, tp * pp))
        assert executor.topology == Topology(tp, pp)
        runner = llm.engine.model_runner
        assert (runner.tp_rank, runner.tp_size, runner.model.num_local_kv_heads) == (0, tp, 1)
        assert runner.kv_caches[0].shape[3] == 1
        assert generated_tokens(llm, prompts, GREEDY) == expected
        with pytest.raises(RuntimeError, match="a tensor-parallel engine .* is alive in this process"):
            LLM(model=str(path), **CPU)
        # Prompt logprobs and sample logprobs: every TP rank computes the same logits (collectives), rank 0 samples.
        parallel = llm.generate(prompts[:2], LOGPROBS, use_tqdm=False)
    assert multiprocessing.active_children() == []
    assert not any(process_alive(pid) for pid in pids.values())
    steps = _step_logs(replicated)   # before the TP=1 engine below logs its own steps
    with LLM(model=str(path), **CPU) as llm:   # the TP group was reset at shutdown
        single = llm.generate(prompts[:2], LOGPROBS, use_tqdm=False)
    for p, s in zip(parallel, single):
        assert p.outputs[0].token_ids == s.outputs[0].token_ids
        assert _logprob_values(p.prompt_logprobs) == pytest.approx(_logprob_values(s.prompt_logprobs), abs=1e-5)
        assert _logprob_values(p.outputs[0].logprobs) == pytest.approx(_logprob_values(s.outputs[0].logprobs), abs=1e-5)
    stages = [0, 2] if pp == 2 else [0]
    assert sorted(steps) == sorted((t, layer) for t in range(tp) for layer in stages)
    assert len({tuple(s) for s in steps.values()}) == 1 and steps[(0, 0)]   # the same steps on every rank
    assert [len(s) for s in steps.values()][0] > GREEDY.max_tokens


# ---- end to end with the models as they are (needs the sharded model side) -------------------
FAMILIES = [
    pytest.param("llama", MQA_ODD_VOCAB, id="llama-mqa-vocab255"),   # KV heads replicated, odd vocabulary
    pytest.param("llama_gqa", {}, id="llama-gqa"),                   # 2 KV heads: one per rank
    pytest.param("qwen2", dict(tie_word_embeddings=True), id="qwen2-tied", marks=pytest.mark.slow),
    pytest.param("qwen3", {}, id="qwen3", marks=pytest.mark.slow),
    pytest.param("phi3", {}, id="phi3", marks=pytest.mark.slow),
    pytest.param("mistral", {}, id="mistral", marks=pytest.mark.slow),
    pytest.param("gemma2", {}, id="gemma2", marks=pytest.mark.slow),
    pytest.param("gemma3", {}, id="gemma3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_tp2_matches_tp1_and_hf(tmp_path, family, overrides):
    path, hf = make_tiny_checkpoint(tmp_path / family, family, with_tokenizer=False, seed=6, **overrides)
    vocab = overrides.get("vocab_size", 256)
    prompts = _prompts(2, vocab)
    expected = hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    with LLM(model=str(path), **CPU) as llm:
        single = generated_tokens(llm, prompts, GREEDY)
    with LLM(model=str(path), tensor_parallel_size=2, **CPU) as llm:
        parallel = generated_tokens(llm, prompts, GREEDY)
    assert single == expected
    assert parallel == expected
    assert multiprocessing.active_children() == []


def test_tp2_async_scheduling_matches_hf_and_sync(mqa):
    """Async scheduling under TP=2: rank 0 launches step n+1 before step n's tokens reach the host,
    and its sampled tokens reach rank 1's placeholder inputs by a broadcast in the TP group. Greedy
    tokens equal HF's; seeded sampling (rank 0's generators) equals the synchronous engine's."""
    path, prompts, expected = mqa
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=6, ignore_eos=True)
    with LLM(model=str(path), tensor_parallel_size=2, async_scheduling=True, **CPU) as llm:
        assert llm.engine.async_scheduling
        assert generated_tokens(llm, prompts, GREEDY) == expected
        parallel_seeded = generated_tokens(llm, prompts[:2], seeded)
    with LLM(model=str(path), async_scheduling=False, **CPU) as llm:
        assert generated_tokens(llm, prompts[:2], seeded) == parallel_seeded
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_tp2_pp2_matches_tp1_and_hf(mqa):
    path, prompts, expected = mqa
    with LLM(model=str(path), tensor_parallel_size=2, pipeline_parallel_size=2, **CPU) as llm:
        assert generated_tokens(llm, prompts, GREEDY) == expected
        seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=6, ignore_eos=True)
        parallel_seeded = generated_tokens(llm, prompts[:2], seeded)
    with LLM(model=str(path), **CPU) as llm:
        assert generated_tokens(llm, prompts[:2], seeded) == parallel_seeded
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_torchrun_tp2(mqa, tmp_path):
    """`torchrun --nproc-per-node 2` with tensor_parallel_size=2: rank 0's LLM drives and samples;
    rank 1's LLM(...) serves its TP shard and exits with status 0 when rank 0 shuts down."""
    import json
    import subprocess
    import sys
    path, prompts, expected = mqa
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent(f"""
        import json, os
        from configs import SamplingParams
        from runner import LLM
        llm = LLM(model={str(path)!r}, tensor_parallel_size=2, **{CPU!r})
        if os.environ["RANK"] != "0":
            raise SystemExit("rank 1 returned from LLM(...)")
        out = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        llm.shutdown()
        print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in out]))
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == expected


# ---- failures ----------------------------------------------------------------------------------
def _assert_failed(outputs, pattern: str) -> None:
    assert outputs
    for output in outputs:
        assert output.finished and output.outputs[0].finish_reason == "abort", output
        assert re.search(pattern, output.error, re.S), output.error


def test_killed_tp_rank_is_an_error_naming_it(mqa):
    from runner.engine import EngineDeadError
    path, prompts, expected = mqa
    llm = LLM(model=str(path), tensor_parallel_size=2, **CPU)
    pid = llm.engine.executor.worker_pids[1]
    assert generated_tokens(llm, prompts[:1], GREEDY) == expected[:1]
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    _assert_failed(outs, r"WorkerError: worker rank 1 \(pp stage 0, tp rank 1\) died: pid \d+, exit code -9, SIGKILL")
    assert time.monotonic() - started < 30
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pp stage 0, tp rank 1\)"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert multiprocessing.active_children() == [] and not process_alive(pid)


@pytest.mark.slow
def test_tp_rank_step_error_reports_its_traceback(mqa, tmp_path, monkeypatch):
    """TP rank 1 raises inside a step: the requests fail with its traceback, naming it."""
    path, prompts, _ = mqa
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import runner.model_runner
        execute = runner.model_runner.ModelRunner.execute
        def failing(self, sched, decision=None):
            if self.tp_rank == 1 and sched.scheduled:
                raise ValueError("injected TP rank failure")
            return execute(self, sched, decision)
        runner.model_runner.ModelRunner.execute = failing
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    with LLM(model=str(path), tensor_parallel_size=2, **CPU) as llm:
        monkeypatch.delenv("PYTHONPATH")
        outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        _assert_failed(outs, r"worker rank 1 \(pp stage 0, tp rank 1\) failed:\n.*ValueError: injected TP rank failure")
    assert multiprocessing.active_children() == []


# ---- GPU -------------------------------------------------------------------------------------
def _graph_mode_reference(tmp_path, mode: str):
    """A tiny GQA Llama checkpoint (4 layers, 8 heads over 2 KV heads, 255-token vocabulary), its
    prompts, HF's greedy tokens for them, the GPU engine options of `mode` (address check on) and
    TP=1's tokens: the prompts, then the first three again (prefix-cache hits)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa", num_hidden_layers=4, with_tokenizer=False,
                                    vocab_size=255)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 255, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (11,), generator=g)]
    expected = hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
                   max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=256, debug_cudagraph_addresses=True)
    with LLM(model=str(path), **options) as llm:
        single = generated_tokens(llm, prompts, GREEDY) + generated_tokens(llm, prompts[:3], GREEDY)
    return path, prompts, expected, options, single


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("all_reduce", ["push", "nccl"])
def test_multigpu_tp2_matches_tp1_in_graph_modes(tmp_path, mode, all_reduce):
    """TP=2 greedy output equals TP=1's and HF's with the push all-reduce (the default: the kernel,
    and the one-row GEMVs summing their own output) and with NCCL for every all-reduce."""
    path, prompts, expected, options, single = _graph_mode_reference(tmp_path, mode)
    nccl_for_all = {} if all_reduce == "push" else {"push_all_reduce_max_bytes": 0}
    with LLM(model=str(path), tensor_parallel_size=2, **nccl_for_all, **options) as llm:
        runner = llm.engine.model_runner
        assert runner.cuda_graph_ready and runner.model.num_local_kv_heads == 1
        push = tensor_parallel_group().push
        parallel = generated_tokens(llm, prompts, GREEDY) + generated_tokens(llm, prompts[:3], GREEDY)
        assert sum(w.num_replays for w in (runner.full, runner.piecewise) if w is not None) > 0
        assert runner.steps_by_mode["FULL"] > 0
        if all_reduce == "push":
            assert push is not None   # every all-reduce here: the push kernel
            assert push.tickets.any()   # one-row steps: o_proj / down all-reduced in the GEMV
        else:
            assert push is None
    assert parallel == single
    assert parallel[:len(prompts)] == expected
    assert multiprocessing.active_children() == []


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="TP=2 x PP=2 needs 4 CUDA GPUs")
@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_multigpu_tp2_pp2_matches_tp1_in_graph_modes(tmp_path, mode):
    """TP=2 x PP=2 on four GPUs, with the defaults (each stage's TP pair all-reduces with the push
    kernel), gives TP=1's and HF's greedy tokens, its graphs replayed on rank 0 (stage 0)."""
    path, prompts, expected, options, single = _graph_mode_reference(tmp_path, mode)
    with LLM(model=str(path), tensor_parallel_size=2, pipeline_parallel_size=2, **options) as llm:
        runner = llm.engine.model_runner
        assert runner.cuda_graph_ready and runner.model.num_local_kv_heads == 1
        assert tensor_parallel_group().push is not None
        parallel = generated_tokens(llm, prompts, GREEDY) + generated_tokens(llm, prompts[:3], GREEDY)
        assert sum(w.num_replays for w in (runner.full, runner.piecewise) if w is not None) > 0
    assert parallel == single
    assert parallel[:len(prompts)] == expected
    assert multiprocessing.active_children() == []


# ---- benchmark option ---------------------------------------------------------------------------
def test_decode_bench_takes_tensor_parallel_sizes():
    """`graphrunner bench decode --tensor-parallel-size 1 2`: each mode at both sizes, rows labelled
    `MODE tp2`, and the TP=2 / TP=1 ratio table (the GPU figures come from a 2-GPU run)."""
    from runner.benchmarks import decode as bench_decode
    args = bench_decode.parse_args(["--device", "cpu", "-tp", "1", "2", "2"])
    assert args.tensor_parallel_size == [1, 2]
    assert bench_decode.tp_label("FULL", 2) == "FULL tp2" and bench_decode.tp_label("FULL", 1) == "FULL"
    row = dict(shape="llama-3-8b", tok_s=0.0, host_ms=0.0, forward_sample_ms=0.0, wall_ms=0.0, context=0.0)
    rows = [bench_decode.Row(batch_size=1, mode="FULL", ms_per_step=10.0, **row),
            bench_decode.Row(batch_size=1, mode="FULL tp2", ms_per_step=6.0, tensor_parallel_size=2, **row)]
    table = bench_decode.tp_ratio_table(rows)
    assert "| llama-3-8b | 1 | FULL | 2 | 6.000 | 10.000 | 0.600 |" in table
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--device", "cpu", "--tensor-parallel-size", "0"])
