"""Failure isolation: one request's failure is that request's alone; a failed step fails its own
requests and the engine goes on; a device error makes the engine dead, loudly and at once.
Faults are injected into the engine's parts (detokenizer, executor, sampled tokens), on a tiny
checkpoint, with and without async scheduling."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from configs import RequestOutputKind, SamplingParams
from runner import LLM
from runner.engine import EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 12, 7, 20)]
    return path, prompts, hf_greedy_generate(hf, prompts, GREEDY.max_tokens, ignore_eos=True)


def run(engine, max_steps=200):
    """Step until nothing is left; the finished output of each request by id (raises if one comes twice)."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    raise AssertionError("the engine did not finish")


def add_all(engine, prompts, params=GREEDY):
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))


def assert_clean(engine):
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage == 0.0
    assert engine.scheduler.num_steps_pending == 0 and not engine._tracked and not engine._parents


@MODES
def test_a_request_whose_detokenizer_raises_fails_alone(tiny, async_scheduling):
    path, prompts, expected = tiny
    engine = LLM(model=str(path), dtype="float32", device="cpu", async_scheduling=async_scheduling).engine
    add_all(engine, prompts)
    detok = engine._tracked["1"].detokenizer
    real, calls = detok.update, []

    def failing(token_ids):
        calls.append(1)
        if len(calls) == 3:
            raise UnicodeError("injected detokenizer failure")
        return real(token_ids)

    detok.update = failing
    done = run(engine)
    bad = done["1"]
    assert bad.finished and bad.outputs[0].finish_reason == "abort" and "injected detokenizer failure" in bad.error
    assert bad.outputs[0].token_ids == expected[1][:3]
    for i in (0, 2, 3):
        assert done[str(i)].error is None and done[str(i)].outputs[0].token_ids == expected[i]
    assert_clean(engine)


@MODES
def test_a_token_outside_the_vocabulary_fails_its_request_alone(tiny, async_scheduling):
    path, prompts, expected = tiny
    engine = LLM(model=str(path), dtype="float32", device="cpu", async_scheduling=async_scheduling).engine
    add_all(engine, prompts)
    steps = []

    def corrupt(result):
        steps.append(1)
        if len(steps) == 4 and "2" in result.sampled:
            result.sampled["2"] = 10**6
        return result

    if async_scheduling:
        real = engine.executor.execute_async

        class Corrupted:  # the host copy only: the device tokens the next step gathers stay valid
            def __init__(self, pending):
                self.pending, self.sampled = pending, pending.sampled

            def resolve(self):
                return corrupt(self.pending.resolve())

        def launch(sched):
            return Corrupted(real(sched))
        engine.executor.execute_async = launch
    else:
        real = engine.executor.execute
        engine.executor.execute = lambda sched: corrupt(real(sched))
    done = run(engine)
    assert done["2"].outputs[0].finish_reason == "abort" and "10000" in done["2"].error
    assert "outside the vocabulary" in done["2"].error
    for i in (0, 1, 3):
        assert done[str(i)].error is None and done[str(i)].outputs[0].token_ids == expected[i]
    assert_clean(engine)


@MODES
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny, async_scheduling):
    """The forward raises once: that step() call returns an error output for each request of the
    step (no exception), the request not in it runs on, and new requests are served as before."""
    path, prompts, expected = tiny
    engine = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=2,
                 async_scheduling=async_scheduling).engine
    name = "execute_async" if async_scheduling else "execute"
    real, calls = getattr(engine.executor, name), []

    def flaky(sched):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real(sched)

    setattr(engine.executor, name, flaky)
    add_all(engine, prompts[:3])
    done = run(engine)
    failed = sorted(rid for rid, out in done.items() if out.error is not None)
    assert failed == ["0", "1"]  # max_num_seqs=2: the failed step held 0 and 1, 2 was waiting
    for rid in failed:
        out = done[rid]
        assert out.outputs[0].finish_reason == "abort" and "injected step failure" in out.error
        assert out.outputs[0].token_ids == expected[int(rid)][:len(out.outputs[0].token_ids)]
    assert done["2"].outputs[0].token_ids == expected[2]
    assert_clean(engine)
    add_all(engine, prompts)
    again = run(engine)
    assert [again[str(i)].outputs[0].token_ids for i in range(4)] == expected


def test_a_lost_step_in_flight_fails_its_requests(tiny):
    """Async: step n's tokens never arrive. Its requests fail; the step launched after it is
    forgotten, and a request that was only in that one is scheduled again and finishes."""
    path, prompts, expected = tiny
    engine = LLM(model=str(path), dtype="float32", device="cpu", async_scheduling=True).engine
    real, calls = engine.executor.execute_async, []

    class Lost:
        sampled = None

        def resolve(self):
            raise RuntimeError("injected resolve failure")

    def flaky(sched):
        calls.append(1)
        pending = real(sched)
        return Lost() if len(calls) == 2 else pending

    engine.executor.execute_async = flaky
    engine.add_request(prompts[0], GREEDY, request_id="0")
    engine.step()
    engine.step()  # launches step 2 (which will be lost), applies step 1
    engine.add_request(prompts[1], GREEDY, request_id="1")  # in step 3 only, launched before 2 is resolved
    done = run(engine)
    assert "injected resolve failure" in done["0"].error and done["0"].outputs[0].finish_reason == "abort"
    assert done["1"].error is None and done["1"].outputs[0].token_ids == expected[1]
    assert_clean(engine)


@MODES
def test_a_device_error_makes_the_engine_dead(tiny, async_scheduling):
    path, prompts, expected = tiny
    engine = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=2,
                 async_scheduling=async_scheduling).engine
    name = "execute_async" if async_scheduling else "execute"
    real, calls = getattr(engine.executor, name), []

    def broken(sched):
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(sched)

    setattr(engine.executor, name, broken)
    add_all(engine, prompts[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                output_kind=RequestOutputKind.DELTA))
    done = run(engine)
    assert sorted(done) == ["0", "1", "2"]  # the waiting request too: nothing can serve it now
    assert all(o.outputs[0].finish_reason == "abort" and "engine died" in o.error for o in done.values())
    assert all("illegal memory access" in o.error for o in done.values())
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage == 0.0
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request(prompts[0], GREEDY)


def test_generate_keeps_the_other_prompts_when_a_step_fails(tiny):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=2)
    real, calls = llm.engine.executor.execute, []

    def flaky(sched):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real(sched)

    llm.engine.executor.execute = flaky
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.error is not None for o in outs] == [True, True, False, False]
    assert [o.outputs[0].token_ids for o in outs[2:]] == expected[2:]
    assert all(o.finished for o in outs)
    llm.engine.executor.execute = real
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_which_errors_are_fatal():
    from runner.engine import is_fatal

    class Executor:
        failure = None

    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"), Executor())
    assert is_fatal(RuntimeError("NCCL error in: ..."), Executor())
    assert not is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"), Executor())
    assert not is_fatal(ValueError("bad seed"), Executor())
    if hasattr(torch, "AcceleratorError"):
        assert is_fatal(torch.AcceleratorError("device lost"), Executor())
    broken = Executor()
    broken.failure = "pipeline worker rank 1 died"
    assert is_fatal(ValueError("anything"), broken)
