"""Programmatic dependent launch (launch/pdl.py): when kernels launch with it, and that
every kernel that may be launched with it waits before touching what earlier kernels write.

The real overlap is a GPU matter (tests/test_triton_gpu.py compares PDL on and off bit for bit,
and the graph-mode parity tests run with it on); here: the device rule and the kernels' source."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from launch import pdl
from attention.kernels import unified_attention as ua
from models import fused_kernels as fk
from models import small_batch_kernels as sbk
from runner import greedy

PDL_KERNELS = [sbk._small_rows_kernel, sbk._norm_qkv_rope_cache_kernel, ua.attention_kernel, ua.merge_splits_kernel,
               greedy._argmax_chunks_kernel, greedy._argmax_rows_kernel, fk._add_rms_norm_kernel,
               fk._silu_and_mul_kernel, fk._rope_kernel, fk._rope_and_cache_kernel]


def test_cpu_never_uses_pdl():
    assert not pdl.use_pdl(torch.device("cpu"))
    assert pdl.pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("capability, enabled, expected", [((9, 0), True, True), ((10, 0), True, True),
                                                           ((8, 9), True, False), ((9, 0), False, False)])
def test_hopper_or_newer_and_not_switched_off(monkeypatch, capability, enabled, expected, kernel_switches):
    kernel_switches(pdl=enabled)
    monkeypatch.setattr(pdl, "_capability", lambda index: capability)
    assert pdl.use_pdl(torch.device("cuda", 0)) is expected


def _statements(kernel) -> list[ast.stmt]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):   # the docstring
        body = body[1:]
    return body


def _calls(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


PRE_WAIT_READS = {
    "_norm_qkv_rope_cache_kernel": {"pos_ptr", "cos_sin_ptr", "slot_ptr"},
    "attention_kernel": {"qsl_ptr", "seq_lens_ptr", "table_row"},
}
"""What a kernel may load before its wait besides weight tiles (`_weight_tile`, `_tile_blocks`):
step metadata uploaded before the step's first kernel, and constant tables."""

PRE_WAIT_TICKETS = {"_small_rows_kernel": "ar_tickets_ptr"}
"""The one write a kernel may make before its wait: an all-reducing GEMV's ticket (`linear_all_reduce`),
from a counter that only such GEMVs touch and of which two never overlap, so the kernel before it
cannot be reading it."""


def _pointer_names(expr: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and (n.id.endswith("_ptr") or n.id == "table_row")}


@pytest.mark.parametrize("kernel", PDL_KERNELS, ids=lambda k: k.fn.__name__)
def test_kernel_waits_before_reading_activations(kernel):
    """The PDL contract, read off the source: `wait_for_producers(PDL)` is a top-level statement,
    and before it the kernel stores nothing and loads only weight tiles and what PRE_WAIT_READS
    allows it."""
    name = kernel.fn.__name__
    body = _statements(kernel)
    waits = [i for i, stmt in enumerate(body) if "wait_for_producers" in _calls(stmt)]
    assert len(waits) == 1, f"{name} must call wait_for_producers(PDL) once, at top level"
    assert "PDL" in inspect.signature(kernel.fn).parameters
    allowed = PRE_WAIT_READS.get(name, set())
    for stmt in body[:waits[0]]:
        source = ast.unparse(stmt)
        tickets = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and ast.unparse(n.func) == "tl.atomic_add"]
        for ticket in tickets:
            assert ast.unparse(ticket.args[0]) == PRE_WAIT_TICKETS.get(name), f"{name}: `{ast.unparse(ticket)}` before the wait"
            source = source.replace(ast.unparse(ticket), "ticket")
        assert "tl.store" not in source and "tl.atomic" not in source, f"{name}: `{source}` before the wait"
        assert _calls(stmt) <= {"_weight_tile", "_tile_blocks", "range", "tag_of_call"}, \
            f"{name}: `{source}` before the wait"
        for call in ast.walk(stmt):
            if isinstance(call, ast.Call) and ast.unparse(call.func) in ("tl.load", "_tile_blocks"):
                assert _pointer_names(call.args[0]) <= allowed, f"{name}: `{ast.unparse(call)}` before the wait"
        if "_tile_blocks" in _calls(stmt):
            assert "table_row" in allowed


def _decode_chain(k: int, inter: int, vocab: int, dtype: torch.dtype):
    """One decode row through a chain of PDL kernels, each reading the one before: norm + qkv-like
    GEMV, norm + gate_up + SiLU, down GEMV, final add + RMSNorm, LM-head GEMV, greedy argmax."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(dtype)
    x, res = rand(1, k), rand(1, k)
    norm_w = (1 + torch.randn(k, device="cuda", generator=g) / 10).to(dtype)
    w_qkv, w_gu, w_down, w_head = rand(k, k), rand(2 * inter, k), rand(k, inter), rand(vocab, k)

    def step():
        h, r = sbk.norm_linear(x, res, norm_w, 1e-5, w_qkv)
        act, r2 = sbk.norm_gate_up_silu(h, r, norm_w, 1e-5, w_gu)
        down = sbk.linear(act, w_down)
        final, _ = fk.add_rms_norm(down, norm_w, 1e-5, r2)
        logits = sbk.linear(final, w_head)
        return h, act, down, logits, greedy.argmax_rows(logits)

    return x, res, step


@pytest.mark.cuda
@pytest.mark.parametrize("k, inter", [(576, 1536), (2048, 8192)], ids=["smollm2", "llama-3.2-1b"])
def test_pdl_chain_in_a_cuda_graph_equals_the_chain_without_pdl(monkeypatch, k, inter, kernel_switches):
    """The same kernels with and without PDL compute bit for bit the same; captured with PDL (the
    graph gets programmatic edges) and replayed many times with new inputs, every replay still
    equals the PDL-free eager chain: a kernel that read its input before the wait would see the
    previous replay's values."""
    if not pdl.use_pdl(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    dtype = torch.bfloat16
    x, res, step = _decode_chain(k, inter, 49152, dtype)

    def reference():
        kernel_switches(pdl=False)
        try:
            return [t.clone() for t in step()]
        finally:
            kernel_switches(pdl=True)

    for want, got in zip(reference(), step()):   # eager, PDL on
        assert torch.equal(want, got)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    g = torch.Generator(device="cuda").manual_seed(1)
    for replay in range(40):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(dtype))
        res.copy_(torch.randn(res.shape, device="cuda", generator=g).to(dtype))
        graph.replay()
        want = reference()
        torch.cuda.synchronize()
        for name, a, b in zip(("qkv", "act", "down", "logits", "argmax"), want, outs):
            assert torch.equal(a, b), f"replay {replay}: {name} differs"
