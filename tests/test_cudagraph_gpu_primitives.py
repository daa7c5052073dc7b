"""The real primitives on a GPU: torch.cuda.CUDAGraph segments, breakable capture, the wrappers,
measure_graph_memory. A toy MLP whose fake attention is a break op that reads a global
"context" scale; replays must equal eager for new inputs copied into the static input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attention.forward_context import ForwardContext, set_forward_context
from configs.graph_mode import CUDAGraphMode as M
from runner.cudagraph import (AddressMismatchError, BatchDescriptor as BD, CapturePhase, CUDAGraphWrapper,
                              break_point, graph_pool, measure_graph_memory)

pytestmark = pytest.mark.cuda
CONTEXT: dict[str, torch.Tensor] = {}


@break_point
def fake_attention(x: torch.Tensor, *, out: torch.Tensor) -> None:
    torch.mul(x, 2.0 * CONTEXT["scale"], out=out)  # the temporary lives outside the pool: fine


@break_point
def fresh_attention(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return x * 2.0


class ToyModel(nn.Module):
    def __init__(self, attention=fake_attention) -> None:
        super().__init__()
        self.up, self.down, self.attention = nn.Linear(16, 32), nn.Linear(32, 16), attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        a = torch.empty_like(h)
        self.attention(h, out=a)
        h = self.down(a) + x
        b = torch.empty_like(h)
        self.attention(h, out=b)
        return b * 0.5 + 1.0


def _context(mode, desc):
    return ForwardContext(None, None, None, mode, desc)


@pytest.fixture
def model():
    torch.manual_seed(0)
    CONTEXT["scale"] = torch.ones((), device="cuda")
    return ToyModel().cuda()


@torch.inference_mode()
def test_piecewise_replay_matches_eager(model):
    static_x, desc, phase = torch.zeros(8, 16, device="cuda"), BD(8, 0, False), CapturePhase()
    wrapper = CUDAGraphWrapper(model, M.PIECEWISE, graph_pool(), phase, address_check=True)
    with phase.capturing(), set_forward_context(_context(M.PIECEWISE, desc)):
        out = wrapper(static_x)
    entry = wrapper._entries[desc]
    assert len(entry.graph.segments) == 3 and len(entry.graph.breaks) == 2
    for step in range(3):
        new_x = torch.randn(8, 16, device="cuda")
        static_x.copy_(new_x)
        CONTEXT["scale"] = torch.tensor(step + 2.0, device="cuda")  # a NEW tensor: read eagerly at replay
        with set_forward_context(_context(M.PIECEWISE, desc)):
            y = wrapper(static_x)
        assert y is out
        torch.testing.assert_close(y, model(new_x))
    assert wrapper.num_replays == 3 and wrapper.replays_by_descriptor[desc] == 3
    with set_forward_context(_context(M.PIECEWISE, desc)), pytest.raises(AddressMismatchError):
        wrapper(static_x.clone())


@torch.inference_mode()
def test_many_piecewise_graphs_share_one_pool_in_any_replay_order(model):
    """Largest first into one pool; later graphs reuse the blocks earlier ones freed (break inputs
    are recorded without owning memory), so replaying in another order must still be exact."""
    static_x, phase = torch.zeros(32, 16, device="cuda"), CapturePhase()
    wrapper = CUDAGraphWrapper(model, M.PIECEWISE, graph_pool(), phase)
    sizes = [32, 16, 8, 4, 2, 1]
    with phase.capturing():
        for n in sizes:
            with set_forward_context(_context(M.PIECEWISE, BD(n, 0, False))):
                wrapper(static_x[:n])
    for step in range(2):
        for n in (1, 16, 4, 32, 2, 8):
            new_x = torch.randn(n, 16, device="cuda")
            static_x[:n].copy_(new_x)
            CONTEXT["scale"] = torch.tensor(1.5 + step, device="cuda")
            with set_forward_context(_context(M.PIECEWISE, BD(n, 0, False))):
                torch.testing.assert_close(wrapper(static_x[:n]), model(new_x))
    assert wrapper.num_replays == 12 and wrapper.num_captured == len(sizes)


@torch.inference_mode()
def test_full_replay_matches_eager_through_nested_wrappers(model):
    static_x, phase, pool = torch.zeros(4, 16, device="cuda"), CapturePhase(), graph_pool()
    piecewise = CUDAGraphWrapper(model, M.PIECEWISE, pool, phase, address_check=True)
    full = CUDAGraphWrapper(piecewise, M.FULL, pool, phase, address_check=True)
    keys = [(M.FULL, BD(4, 4, True)), (M.PIECEWISE, BD(4, 0, False))]
    with phase.capturing():
        for mode, desc in keys:
            with set_forward_context(_context(mode, desc)):
                full(static_x)
    assert (full.num_captured, piecewise.num_captured) == (1, 1)
    for step in range(3):
        for mode, desc in keys:
            new_x = torch.randn(4, 16, device="cuda")
            static_x.copy_(new_x)
            CONTEXT["scale"].fill_(step + 0.5)  # FULL bakes in the address: update in place
            with set_forward_context(_context(mode, desc)):
                y = full(static_x)
            torch.testing.assert_close(y, model(new_x))
    assert full.num_replays == 3 and piecewise.num_replays == 3


@torch.inference_mode()
def test_fresh_tensor_break_op_raises_and_capture_recovers(model):
    phase, desc = CapturePhase(), BD(4, 0, False)
    bad = CUDAGraphWrapper(ToyModel(fresh_attention).cuda(), M.PIECEWISE, graph_pool(), phase)
    with phase.capturing(), set_forward_context(_context(M.PIECEWISE, desc)):
        with pytest.raises(RuntimeError, match="fresh_attention returned a fresh tensor"):
            bad(torch.zeros(4, 16, device="cuda"))
        assert not torch.cuda.is_current_stream_capturing()
        good = CUDAGraphWrapper(model, M.PIECEWISE, graph_pool(), phase)
        x = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(good(x), model(x))


@torch.inference_mode()
def test_measure_graph_memory_positive(model):
    holder = []

    def capture_largest(pool) -> None:
        phase = CapturePhase()
        wrapper = CUDAGraphWrapper(nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16)).cuda(),
                                   M.FULL, pool, phase)
        holder.append(wrapper)
        with phase.capturing(), set_forward_context(_context(M.FULL, BD(512, 512, True))):
            wrapper(torch.zeros(512, 16, device="cuda"))

    cost = measure_graph_memory(capture_largest, release=holder.clear)
    assert cost > 0 and holder == []
