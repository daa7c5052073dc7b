"""The garbage collector's rules in an engine process (runner/collector.py): the start-up freezes
what was alive before it, so its collections walk only what it allocates; at its end it collects
its own garbage and unfreezes the heap, errors included; the capture phase inside it freezes what
the start-up built so far and leaves the unfreezing to the start-up."""

from __future__ import annotations

import gc
import weakref

import pytest
from checkpoints import make_tiny_checkpoint

from runner.collector import frozen_heap


class Node:
    """A plain object the collector tracks (it has a __dict__)."""


def _in_a_generation(obj) -> bool:
    """Whether the collector still walks `obj` (frozen objects are in no generation's list). Not
    `gc.get_freeze_count() == 0`: Python 3.12's full collections leave a few hundred objects of
    their own in the permanent generation even after `gc.unfreeze()`."""
    return any(any(o is obj for o in gc.get_objects(generation)) for generation in range(3))


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_start_up_walks_only_what_it_allocates_and_leaves_its_garbage_collected():
    before = Node()
    assert _in_a_generation(before)
    with frozen_heap():
        assert not _in_a_generation(before)          # frozen: no collection inside walks it
        built = Node()
        garbage = Node()
        garbage.cycle = garbage                       # only the collector frees a cycle
        gone = weakref.ref(garbage)
        del garbage
        assert _in_a_generation(built)
    assert gone() is None                             # collected at the end of the start-up
    assert _in_a_generation(before) and _in_a_generation(built)   # and the heap unfrozen


def test_a_failed_start_up_leaves_the_heap_unfrozen():
    before = Node()
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("no KV blocks")
    assert _in_a_generation(before)                   # unfrozen


@pytest.mark.parametrize("inside_a_start_up", [False, True])
def test_the_capture_phase_keeps_a_frozen_heap_frozen(inside_a_start_up):
    from contextlib import nullcontext

    from runner.cudagraph.capture import CapturePhase
    with frozen_heap() if inside_a_start_up else nullcontext():
        made_before = Node()
        with CapturePhase().capturing():
            assert not _in_a_generation(made_before)
        assert _in_a_generation(made_before) is not inside_a_start_up
    assert _in_a_generation(made_before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return str(path)


def _engine(checkpoint: str):
    from configs import EngineConfig
    from runner.engine import LLMEngine
    return LLMEngine(EngineConfig.from_kwargs(model=checkpoint, dtype="float32", device="cpu", num_kv_blocks=64))


def test_an_engine_freezes_the_heap_while_it_starts_and_unfreezes_it_once_ready(checkpoint, monkeypatch):
    import runner.engine as engine_module
    before = Node()
    seen = []
    real_load_tokenizer = engine_module.load_tokenizer

    def load_tokenizer(*args):
        seen.append(_in_a_generation(before))
        return real_load_tokenizer(*args)

    monkeypatch.setattr(engine_module, "load_tokenizer", load_tokenizer)
    engine = _engine(checkpoint)
    assert seen == [False]                            # frozen while the engine started
    assert _in_a_generation(before) and _in_a_generation(engine.model_runner)   # unfrozen once ready
    engine.shutdown()


def test_an_engine_in_reference_cycles_dropped_without_shutdown_is_collected(checkpoint):
    """The reason the heap is not left frozen after the start-up: an engine a caller drops without
    shutdown() goes with the next collection, cycles and all (a GPU engine's graphs and KV cache
    with it)."""
    engine = _engine(checkpoint)
    engine.model_runner.cycle = engine.model_runner
    runner = weakref.ref(engine.model_runner)
    del engine
    gc.collect()
    assert runner() is None
