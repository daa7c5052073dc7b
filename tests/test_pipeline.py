"""Issue 7: pipeline parallel. On a CPU (gloo, spawned workers, torchrun): PP=2/3 give PP=1's
and HF's tokens, the layer split and its validation, worker death and worker errors surface as
errors naming the rank (bounded time, never a hang), and no process outlives shutdown.
The `cuda` test (2 GPUs, NCCL) checks every graph mode against PP=1."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from model_helpers import generated_tokens, process_alive
from configs import SamplingParams
from runner import LLM
from runner.engine import EngineDeadError
from runner.distributed.executor import WorkerError
from runner.distributed.layers import split_layers
from runner.scheduler import SchedulerOutput

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
# A 32-token budget with these prompt lengths chunks the long prefills and mixes them with decodes.
CPU = dict(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=128, max_num_batched_tokens=32,
           max_num_seqs=4)


@contextmanager
def hang_guard(seconds: float):
    """pytest-timeout is not installed everywhere: if a test hangs, dump stacks and exit the run."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 41, 1, 17, 70, 9)]


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("pp") / "llama", "llama_gqa", num_hidden_layers=4,
                                    with_tokenizer=False)
    prompts = _prompts(0)
    return path, prompts, hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """Tied embeddings (and Qwen2's q/k/v biases): a last rank that is not the first loads the
    checkpoint's embedding as its LM head."""
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("pp") / "tied", "qwen2", tie_word_embeddings=True,
                                    num_hidden_layers=4, with_tokenizer=False, seed=3)
    prompts = _prompts(1)
    return path, prompts, hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)


def _pp1_reference(path, prompts, expected):
    """PP=1 on the same checkpoint: greedy tokens, and seeded-sampling tokens and logprobs."""
    with LLM(model=str(path), **CPU) as llm:
        assert generated_tokens(llm, prompts, GREEDY) == expected
        seeded = llm.generate(prompts[:3], SEEDED, use_tqdm=False)
    return [o.outputs[0].token_ids for o in seeded], [o.outputs[0].logprobs for o in seeded]


# ---- layer split -----------------------------------------------------------------------------
def test_even_split_gives_the_remainder_to_the_ranks_before_the_last():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(30, 4) == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]
    assert [len(r) for r in split_layers(5, 3)] == [2, 2, 1]
    assert [len(r) for r in split_layers(4, 3)] == [1, 2, 1]
    assert [len(r) for r in split_layers(3, 3)] == [1, 1, 1]
    assert split_layers(4, 1) == [range(0, 4)]


def test_layer_split_override_and_its_validation():
    assert split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    assert split_layers(6, 3, [1, 4, 1]) == [range(0, 1), range(1, 5), range(5, 6)]
    with pytest.raises(ValueError, match="has 3 entries but pipeline_parallel_size is 2"):
        split_layers(4, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="at least 1 layer"):
        split_layers(4, 2, [4, 0])
    with pytest.raises(ValueError, match="sums to 5 layers but the model has 4"):
        split_layers(4, 2, [3, 2])
    with pytest.raises(ValueError, match="fewer than pipeline_parallel_size=5"):
        split_layers(4, 5)


def test_bad_split_fails_before_any_worker_starts(untied):
    path, _, _ = untied
    with pytest.raises(ValueError, match="sums to 3 layers but the model has 4"):
        LLM(model=str(path), pipeline_parallel_size=2, pipeline_layer_split=[2, 1], **CPU)
    with pytest.raises(ValueError, match="pipeline_layer_split has 3 entries"):  # the config's own check
        LLM(model=str(path), pipeline_parallel_size=2, pipeline_layer_split=[2, 1, 1], **CPU)
    with pytest.raises(ValueError, match="fewer than pipeline_parallel_size=5"):
        LLM(model=str(path), pipeline_parallel_size=5, **CPU)
    assert multiprocessing.active_children() == []


# ---- same tokens as PP=1 and HF; shutdown ---------------------------------------------------
@pytest.mark.parametrize("checkpoint, pp, layer_split", [("untied", 2, None), ("tied", 3, [1, 2, 1])])
def test_pipeline_matches_pp1_and_hf_and_shuts_down_cleanly(request, checkpoint, pp, layer_split):
    path, prompts, expected = request.getfixturevalue(checkpoint)
    seeded_tokens, seeded_logprobs = _pp1_reference(path, prompts, expected)
    with hang_guard(120):
        with LLM(model=str(path), pipeline_parallel_size=pp, pipeline_layer_split=layer_split, **CPU) as llm:
            executor = llm.engine.executor
            pids = executor.worker_pids
            assert sorted(pids) == list(range(1, pp))
            assert executor.layer_ranges == split_layers(4, pp, layer_split)
            assert llm.engine.model_runner.layer_range == executor.layer_ranges[0]
            # Mixed steps: a 32-token budget chunks the 41- and 70-token prompts next to decodes.
            assert generated_tokens(llm, prompts, GREEDY) == expected
            seeded = llm.generate(prompts[:3], SEEDED, use_tqdm=False)  # generators live on the last rank
            assert [o.outputs[0].token_ids for o in seeded] == seeded_tokens
            assert [o.outputs[0].logprobs for o in seeded] == seeded_logprobs
            assert generated_tokens(llm, prompts[:2], GREEDY) == expected[:2]  # again, after finished ids went round
        assert multiprocessing.active_children() == []
        assert not any(process_alive(pid) for pid in pids.values())
        assert [p.exitcode for p in executor._state.workers.processes.values()] == [0] * (pp - 1)  # "stop"
        llm.shutdown()  # twice is fine
        with pytest.raises(RuntimeError, match="shut down"):
            executor.execute(SchedulerOutput([], 0, [], ["0"]))


# ---- failures --------------------------------------------------------------------------------
def _assert_failed(outputs, pattern: str, count: int | None = None) -> None:
    """A broken pipeline kills the engine: every request finishes with "abort" and an error that
    says why (the worker's rank, its exit or its traceback)."""
    assert outputs and (count is None or len(outputs) == count), outputs
    for output in outputs:
        assert output.finished and output.outputs[0].finish_reason == "abort", output
        assert re.search(pattern, output.error, re.S), output.error


def test_killed_worker_is_an_error_naming_the_rank(untied):
    path, prompts, expected = untied
    with hang_guard(120):
        llm = LLM(model=str(path), pipeline_parallel_size=3, **CPU)
        pids = llm.engine.executor.worker_pids
        assert generated_tokens(llm, prompts[:2], GREEDY) == expected[:2]
        os.kill(pids[1], signal.SIGKILL)  # between generate() calls, the middle rank
        started = time.monotonic()
        outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)  # the engine dies: each request says why
        _assert_failed(outs, r"WorkerError: worker rank 1 \(pp stage 1, tp rank 0\) died: pid \d+, exit code -9, SIGKILL")
        assert time.monotonic() - started < 30
        assert multiprocessing.active_children() == []  # the survivor was stopped at once
        assert not any(process_alive(pid) for pid in pids.values())
        with pytest.raises(WorkerError, match=r"the distributed executor is down: worker rank 1 \(pp stage 1"):
            llm.engine.executor.execute(SchedulerOutput([], 0, [], ["0"]))
        with pytest.raises(EngineDeadError, match="rank 1"):  # later calls: one clear error at once
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        llm.shutdown()
        llm.shutdown()


def test_worker_killed_mid_generation(untied):
    path, prompts, _ = untied
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with hang_guard(120), LLM(model=str(path), pipeline_parallel_size=2, **CPU) as llm:
        pid = llm.engine.executor.worker_pids[1]
        engine = llm.engine
        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(prompt, long, request_id=str(i))
        for _ in range(5):
            engine.step()
        killer = threading.Timer(0.2, os.kill, (pid, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        killer.join()
        _assert_failed([o for o in outs if o.finished], r"WorkerError: worker rank 1 .*died: .*SIGKILL",
                       count=4)
        with pytest.raises(EngineDeadError):
            engine.step()
        assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []


def test_interrupted_wait_claims_its_reply_before_the_next_step(untied):
    """Ctrl-C while rank 0 waits for the last rank: the workers finish that step anyway, so the
    next execute must take that reply first, or every later step would get the one before's."""
    path, prompts, expected = untied
    with hang_guard(120), LLM(model=str(path), pipeline_parallel_size=2, **CPU) as llm:
        engine, executor = llm.engine, llm.engine.executor
        engine.add_request(prompts[3], GREEDY, request_id="a")
        engine.step()
        sched = engine.scheduler.schedule()
        workers = executor._state.workers
        real_next_event = workers.next_event

        def interrupted(timeout):
            workers.next_event = real_next_event
            time.sleep(0.3)  # the reply is on its way
            raise KeyboardInterrupt
        workers.next_event = interrupted
        with pytest.raises(KeyboardInterrupt):
            executor.execute(sched)
        output = executor.execute(sched)  # the same step again: drains the interrupted reply first
        engine.scheduler.update(output.sampled)
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
        assert finished[0].outputs[0].token_ids == expected[3]


def test_worker_error_reports_its_traceback(untied, tmp_path):
    """Rank 1's layers are missing from the checkpoint: rank 0 loads fine, rank 1 raises; the
    caller gets rank 1's traceback, not a bare 'connection closed'."""
    path, _, _ = untied
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in path.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.3.")}, broken / "model.safetensors",
              metadata={"format": "pt"})
    with hang_guard(120):
        with pytest.raises(WorkerError, match=r"(?s)worker rank 1 \(pp stage 1, tp rank 0\) failed:\n.*Traceback.*layers\.3"):
            LLM(model=str(broken), pipeline_parallel_size=2, **CPU)
    assert multiprocessing.active_children() == []


def test_worker_step_error_reports_its_traceback(untied, tmp_path, monkeypatch):
    """The last rank raises inside a step: generate() raises with that rank's traceback. The
    fault is injected into the spawned workers only, through a sitecustomize they import at start."""
    path, prompts, _ = untied
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import runner.model_runner
        def sample(self, *args, **kwargs):
            raise ValueError("injected sampler failure")
        runner.model_runner.ModelRunner.sample = sample
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    with hang_guard(120), LLM(model=str(path), pipeline_parallel_size=2, **CPU) as llm:
        monkeypatch.delenv("PYTHONPATH")
        outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        _assert_failed(outs, r"worker rank 1 \(pp stage 1, tp rank 0\) failed:\n.*sample.*ValueError: injected sampler failure")
    assert multiprocessing.active_children() == []


# ---- lifecycle in a fresh process ----------------------------------------------------------
def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return script


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_exit_without_shutdown_stops_the_workers(untied, tmp_path):
    """The atexit/weakref finalizer: a script that never calls shutdown() leaves nothing behind."""
    path, prompts, expected = untied
    script = _script(tmp_path, f"""
        import json
        from configs import SamplingParams
        from runner import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(path)!r}, pipeline_parallel_size=2, **{CPU!r})
            out = llm.generate({prompts[:1]!r}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)
            print(json.dumps({{"pids": list(llm.engine.executor.worker_pids.values()), "tokens": out[0].outputs[0].token_ids}}))
    """)
    done = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected[0]
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in result["pids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in result["pids"])


def test_workers_exit_when_rank0_is_killed(untied, tmp_path):
    path, _, _ = untied
    script = _script(tmp_path, f"""
        import os, signal
        from runner import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(path)!r}, pipeline_parallel_size=3, **{CPU!r})
            print(" ".join(str(pid) for pid in llm.engine.executor.worker_pids.values()), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)


def test_torchrun_external_launcher(untied, tmp_path):
    """`torchrun --nproc-per-node 2 script.py`: rank 0's LLM drives; rank 1's LLM(...) serves and
    exits the process with status 0 when rank 0 shuts down (the line after it never runs)."""
    path, prompts, expected = untied
    script = _script(tmp_path, f"""
        import json, os
        from configs import SamplingParams
        from runner import LLM
        llm = LLM(model={str(path)!r}, pipeline_parallel_size=2, **{CPU!r})
        if os.environ["RANK"] != "0":
            raise SystemExit("rank 1 returned from LLM(...)")
        out = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
        llm.shutdown()
        print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in out]))
    """)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == expected


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_cuda_pipeline_matches_pp1_in_every_graph_mode(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa", num_hidden_layers=4, with_tokenizer=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (11,), generator=g)]
    expected = hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
                   max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=256, debug_cudagraph_addresses=True)
    with LLM(model=str(path), **options) as llm:
        single = generated_tokens(llm, prompts, GREEDY) + generated_tokens(llm, prompts[:3], GREEDY)
    with hang_guard(300), LLM(model=str(path), pipeline_parallel_size=2, **options) as llm:
        runner = llm.engine.model_runner
        assert runner.cuda_graph_ready == (mode != "NONE")
        piped = generated_tokens(llm, prompts, GREEDY) + generated_tokens(llm, prompts[:3], GREEDY)
        wrappers = [w for w in (runner.full, runner.piecewise) if w is not None]
        if mode != "NONE":
            assert sum(w.num_replays for w in wrappers) > 0  # rank 0 replayed; the others decide alike
    assert piped == single
    assert piped[:len(prompts)] == expected
    assert multiprocessing.active_children() == []
