"""The start-up's cuBLAS warm-up (runner/gemm_warm_up.py) on a CPU: which GEMMs it plans, that each
call is the product `Linear.product` computes, that a failure on its thread costs nothing but the
warm-up, where the runner starts it, and that the compile-ahead pass leaves cuBLAS to it. The GPU test (tests/test_gemm_warm_up_cuda.py) runs it
in a real start-up."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_tiny_checkpoint
from configs import EngineConfig
from models import load_hf_config, model_spec
from models.loader import build_model
from runner import gemm_warm_up
from runner.gemm_warm_up import GemmWarmUp, gemm_signatures
from runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("c"), "llama_gqa", with_tokenizer=False,
                                   vocab_size=255, mlp_bias=True)
    spec = model_spec(load_hf_config(path))
    return path, spec, build_model(spec, str(path), device=torch.device("cpu"), dtype=torch.float32)


def test_signatures_are_each_projection_shape_once_without_the_lm_head(tiny):
    _, _, model = tiny
    layer = model.model.layers["0"]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    signatures = gemm_signatures(model)
    expected = {(tuple(p.weight.shape), p.bias is not None) for p in projections}
    assert {(tuple(w.shape), b is not None) for w, b in signatures} == expected
    assert len(signatures) == len(expected) < len(model.model.layers) * len(projections)
    assert all(w.shape[0] != 255 for w, _ in signatures)   # not the LM head's [vocab, hidden]
    mlp_bias = {tuple(w.shape): b for w, b in signatures}[tuple(layer.mlp.down_proj.weight.shape)]
    assert mlp_bias is layer.mlp.down_proj.bias is not None   # a plain Linear passes its own bias


def test_plan_is_every_row_count_smallest_first_without_gemv_rows(tiny, monkeypatch):
    _, _, model = tiny
    signatures = gemm_signatures(model)
    plan = GemmWarmUp(signatures, [8, 1, 4, 8, 2], torch.device("cpu")).calls
    assert [m for _, _, m in plan] == [m for m in (1, 2, 4, 8) for _ in signatures]
    # On a GPU one row goes to the one-row GEMV, not cuBLAS: nothing to warm there.
    monkeypatch.setattr(gemm_warm_up, "small_batch", lambda x: object() if x.shape[0] == 1 else None)
    assert [m for _, _, m in GemmWarmUp(signatures, [1, 2], torch.device("cpu")).calls] == [2] * len(signatures)


def test_plan_leaves_out_shapes_whose_buffers_would_be_too_large(tiny, monkeypatch):
    _, _, model = tiny
    signatures = gemm_signatures(model)
    widest = max(max(w.shape) for w, _ in signatures)
    monkeypatch.setattr(gemm_warm_up, "BUFFER_BYTES", 8 * widest * 4)   # float32: 8 rows of the widest
    plan = {(tuple(w.shape), m) for w, _, m in GemmWarmUp(signatures, [4, 8, 16], torch.device("cpu")).calls}
    expected = {(tuple(w.shape), m) for w, _ in signatures for m in (4, 8, 16) if m * max(w.shape) <= 8 * widest}
    assert plan == expected
    wide = next(tuple(w.shape) for w, _ in signatures if max(w.shape) == widest)
    assert (wide, 8) in plan and (wide, 16) not in plan


def test_each_call_is_the_layers_product(tiny):
    """`_call` writes F.linear(x, weight, bias) into its output buffer for every planned shape
    (with and without a bias): the GEMM the captures will call, not another."""
    _, _, model = tiny
    warm = GemmWarmUp(gemm_signatures(model), [3, 5], torch.device("cpu"))
    assert {b is None for _, b, _ in warm.calls} == {True, False}
    warm._inputs = torch.empty(max(m * w.shape[1] * 4 for w, _, m in warm.calls), dtype=torch.uint8)
    warm._outputs = torch.empty(max(m * w.shape[0] * 4 for w, _, m in warm.calls), dtype=torch.uint8)
    for weight, bias, rows in warm.calls:
        n, k = weight.shape
        x = warm._inputs[: rows * k * 4].view(torch.float32).view(rows, k)
        x.copy_(torch.randn(rows, k))
        with torch.inference_mode():   # as on its thread
            warm._call(weight, bias, rows)
        out = warm._outputs[: rows * n * 4].view(torch.float32).view(rows, n)
        torch.testing.assert_close(out, F.linear(x, weight, bias).detach(), rtol=0, atol=1e-5)


def test_start_and_wait_run_every_call_then_drop_the_buffers(tiny, monkeypatch, caplog):
    _, _, model = tiny
    warm = GemmWarmUp(gemm_signatures(model), [1, 2, 4], torch.device("cpu"))
    made = []
    real = GemmWarmUp._call
    monkeypatch.setattr(GemmWarmUp, "_call", lambda self, w, b, m: (made.append((w, b, m)), real(self, w, b, m)))
    with caplog.at_level(logging.INFO, logger="runner.gemm_warm_up"):
        warm.start()
        warm.wait()
    # The first call of each kind (with a bias, without) before `start` returns, then every call.
    first_of_each_kind = {}
    for call in warm.calls:
        first_of_each_kind.setdefault(call[1] is None, call)
    expected = [*first_of_each_kind.values(), *warm.calls]
    assert len(first_of_each_kind) == 2
    assert [(id(w), id(b), m) for w, b, m in made] == [(id(w), id(b), m) for w, b, m in expected]
    assert len(made) == len(warm.calls) + 2 and warm.error is None
    assert warm._inputs is None and warm._outputs is None and warm._thread is None
    assert f"first calls of {len(warm.calls)} GEMM shapes" in caplog.text


def test_a_failure_on_the_helper_is_logged_and_start_up_goes_on(tiny, monkeypatch, caplog):
    _, _, model = tiny
    warm = GemmWarmUp(gemm_signatures(model), [2], torch.device("cpu"))

    def fail(self, weight, bias, rows):
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(GemmWarmUp, "_call", fail)
    with caplog.at_level(logging.WARNING, logger="runner.gemm_warm_up"):
        warm.start()   # returns although the first call raised
        warm.wait()
    assert isinstance(warm.error, RuntimeError)
    assert "the cuBLAS warm-up stopped (RuntimeError: CUDA out of memory (simulated))" in caplog.text


def test_the_compile_ahead_pass_makes_no_gemm(tiny, monkeypatch):
    """Inside the compile-ahead pass a projection returns zeros of its output's shape without a
    GEMM (nothing reads its values there; cuBLAS's first calls are the helper's); outside it, the
    product."""
    from models import layers
    _, _, model = tiny
    down = model.model.layers["0"].mlp.down_proj
    x = torch.randn(2, 3, down.in_features)
    expected = F.linear(x, down.weight, down.bias)
    monkeypatch.setattr(layers, "compiling_ahead", lambda: True)
    monkeypatch.setattr(layers.F, "linear", lambda *a, **k: pytest.fail("a GEMM in the compile-ahead pass"))
    out = down(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.any()
    monkeypatch.undo()
    torch.testing.assert_close(down(x), expected)


def test_nothing_to_warm_is_a_no_op():
    warm = GemmWarmUp([], [1, 2], torch.device("cpu"))
    warm.start()
    warm.wait()
    assert warm.calls == [] and warm._thread is None


def test_runner_starts_it_only_where_graphs_are_captured_on_a_gpu(tiny, monkeypatch):
    path, spec, _ = tiny
    config = EngineConfig.from_kwargs(model=str(path), cudagraph_capture_sizes=[1, 2, 4], max_num_seqs=4,
                                      max_num_batched_tokens=64, num_kv_blocks=16, device="cpu")
    runner = ModelRunner(config, spec, str(path), torch.device("cpu"), torch.float32, 128)
    runner.load_model()
    started = []
    monkeypatch.setattr(GemmWarmUp, "start", lambda self: started.append(self))
    assert runner.start_gemm_warm_up().calls == [] and not started   # a CPU: nothing is captured


def test_config_switch_defaults_on_and_turns_off():
    assert EngineConfig.from_kwargs(model="m").compilation.gemm_warm_up is True
    assert EngineConfig.from_kwargs(model="m", gemm_warm_up=False).compilation.gemm_warm_up is False
