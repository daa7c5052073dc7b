"""Issues 4, 5, 6 on a GPU: every graph mode gives eager's greedy tokens (fp32), graphs are
really replayed, FULL serves mixed batches with the Triton backend, and the debug address
check names a moved metadata tensor."""

from __future__ import annotations

import dataclasses
import gc
import re

import pytest
import torch

from checkpoints import hf_greedy_generate, make_tiny_checkpoint
from model_helpers import mixed_step_tokens
from configs import CUDAGraphMode, SamplingParams

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16, 24, 32]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (17,), generator=g)]
    mixed = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 5, 7)]
    expected = hf_greedy_generate(hf, prompts + mixed, GREEDY.max_tokens, ignore_eos=True)
    return path, prompts, mixed, expected[:17], expected[17:]


def _llm(path, mode, **kwargs):
    from runner import LLM
    return LLM(model=str(path), device="cuda", dtype="float32", cudagraph_mode=mode, cudagraph_capture_sizes=SIZES,
               max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=1024, **kwargs)


def _release(llm):
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


EXPECTED_GRAPHS = {"NONE": 0, "PIECEWISE": 14, "FULL": 14, "FULL_AND_PIECEWISE": 14, "FULL_DECODE_ONLY": 7}
"""PIECEWISE: a mixed and a decode graph per size (all SIZES <= max_num_seqs)."""


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_graph_modes_match_eager_and_hf(tiny, mode):
    path, prompts, mixed, expected, expected_mixed = tiny
    llm = _llm(path, mode)
    runner = llm.engine.model_runner
    assert runner.cudagraph_mode == CUDAGraphMode[mode]
    assert runner.cuda_graph_ready == (mode != "NONE")
    wrappers = [w for w in (runner.full, runner.piecewise) if w is not None]
    assert sum(w.num_captured for w in wrappers) == EXPECTED_GRAPHS[mode]
    for n in (1, 3, 17):
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], GREEDY, use_tqdm=False)]
        assert tokens == expected[:n], f"{mode} batch {n}"
    assert mixed_step_tokens(llm.engine, mixed, GREEDY) == expected_mixed
    if mode != "NONE":
        assert sum(w.num_replays for w in wrappers) > 0
        print(f"{mode}: graphs={runner.capture_summary.num_graphs} capture_s={runner.capture_summary.seconds:.2f} "
              f"pool_bytes={runner.capture_summary.pool_bytes} estimate={runner.graph_reserve_bytes}")
    if mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        assert any(d.uniform_decode for d in runner.full.replays_by_descriptor)
    if mode == "FULL":  # the Triton backend (ALWAYS) lets FULL graphs serve mixed prefill+decode steps
        assert any(not d.uniform_decode for d in runner.full.replays_by_descriptor)
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        assert runner.piecewise.num_replays > 0
        assert runner.piecewise.step_graph_runs > 0     # the layers after the first replayed in C
    _release(llm)


def test_torch_backend_falls_back_to_piecewise_with_same_tokens(tiny):
    path, prompts, mixed, expected, expected_mixed = tiny
    llm = _llm(path, "FULL", attention_backend="torch")
    assert llm.engine.model_runner.cudagraph_mode == CUDAGraphMode.PIECEWISE  # torch backend: NEVER in FULL
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected[:3]
    assert mixed_step_tokens(llm.engine, mixed, GREEDY) == expected_mixed
    _release(llm)


def _assert_fails_naming_the_moved_tensor(outputs) -> None:
    """A replay whose input moved raises AddressMismatchError before the graph runs; the engine
    fails that step's requests with the error, which names the tensor that moved."""
    for output in outputs:
        assert output.outputs[0].finish_reason == "abort", output
        assert re.search(r"AddressMismatchError: .*attn_metadata\.seq_lens: 0x[0-9a-f]+ -> 0x[0-9a-f]+", output.error,
                         re.S), output.error


def test_debug_address_check_names_moved_metadata_tensor(tiny):
    path, prompts, mixed, expected, _ = tiny
    llm = _llm(path, "FULL", debug_cudagraph_addresses=True)
    runner = llm.engine.model_runner
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected[:3]
    assert runner.full.num_replays > 0  # checked every replay, no error, same output
    backend = runner.attn_backend
    build = backend.build_metadata
    backend.build_metadata = lambda common: dataclasses.replace(build(common), seq_lens=build(common).seq_lens.clone())
    _assert_fails_naming_the_moved_tensor(llm.generate(prompts[:3], GREEDY, use_tqdm=False))
    _release(llm)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_first_replay_address_check_is_on_by_default(tiny, mode):
    """Without the debug flag, each graph's first replay is checked: a metadata tensor rebound
    instead of copied is named; an engine that copies passes, each replayed graph checked once.
    Prints what the check cost (recording at capture + first replays)."""
    from runner.cudagraph import AddressCheck
    path, prompts, mixed, expected, expected_mixed = tiny
    llm = _llm(path, mode)
    runner = llm.engine.model_runner
    wrappers = [w for w in (runner.full, runner.piecewise) if w is not None]
    assert all(w.address_check is AddressCheck.FIRST_REPLAY for w in wrappers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected[:3]
    assert mixed_step_tokens(llm.engine, mixed, GREEDY) == expected_mixed
    for w in wrappers:
        assert w.first_replay_checks == len(w.replays_by_descriptor)
        assert all((e.recorder is None) == (d in w.replays_by_descriptor) for d, e in w._entries.items())
    summary = runner.capture_summary
    checks = sum(w.first_replay_check_seconds for w in wrappers)
    print(f"\n{mode}: address check recorded {summary.num_graphs} graphs in {summary.address_record_seconds:.4f} s "
          f"(capture {summary.seconds:.2f} s); {sum(w.first_replay_checks for w in wrappers)} first replays "
          f"checked in {checks:.4f} s")
    _release(llm)

    llm = _llm(path, mode)
    backend = llm.engine.model_runner.attn_backend
    build = backend.build_metadata
    backend.build_metadata = lambda common: dataclasses.replace(build(common), seq_lens=build(common).seq_lens.clone())
    _assert_fails_naming_the_moved_tensor(llm.generate(prompts[:3], GREEDY, use_tqdm=False))
    _release(llm)


def test_kv_required_model_survives_warm_up(tiny, monkeypatch):
    """A model whose attention insists on the KV cache in graphs (as hybrid models do): the
    profile run must never capture, and capture after allocation must succeed."""
    from attention.backends.triton_paged import TritonPagedBackend
    from runner import model_runner as model_runner_module

    class KVRequired(TritonPagedBackend):
        def forward(self, layer, query, key, value, out, kv_cache, metadata):
            if kv_cache is None and torch.cuda.is_current_stream_capturing():
                raise AssertionError("captured without a KV cache")
            super().forward(layer, query, key, value, out, kv_cache, metadata)

    monkeypatch.setattr(model_runner_module, "get_attention_backend", lambda name, kernel=None: KVRequired())
    path, prompts, _, expected, _ = tiny
    llm = _llm(path, "FULL_AND_PIECEWISE")
    assert llm.engine.model_runner.cuda_graph_ready
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected[:3]
    _release(llm)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_graph_memory_estimate_within_15_percent_at_default_sizes(tmp_path, mode):
    """Issue 4's goal on a real shape: SmolLM2-135M (dummy bf16 weights), the default capture
    sizes; the reserve the KV budget subtracted vs the pool growth of the real capture."""
    from runner import LLM
    from runner.benchmarks.model_shapes import write_config
    llm = LLM(model=str(write_config("smollm2-135m", tmp_path)), load_format="dummy", dtype="bfloat16",
              cudagraph_mode=mode, gpu_memory_utilization=0.3, max_model_len=2048)
    runner = llm.engine.model_runner
    estimate, actual = runner.graph_reserve_bytes, runner.capture_summary.pool_bytes
    print(f"{mode}: graphs={runner.capture_summary.num_graphs} estimate={estimate / 2**20:.1f} MiB "
          f"actual={actual / 2**20:.1f} MiB ratio={estimate / actual:.3f}")
    _release(llm)
    from runner.cudagraph import default_capture_sizes
    assert runner.dispatcher.capture_sizes == default_capture_sizes(512, max_num_seqs=256)   # the engine's defaults
    assert runner.capture_summary.num_graphs == len(runner.dispatcher.all_keys_to_capture()) == 50
    assert abs(estimate - actual) <= 0.15 * actual
