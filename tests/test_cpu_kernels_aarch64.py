"""The CPU kernels built for aarch64 (neon, and generic: no Advanced SIMD) answer bit for bit what this
x86 machine's avx2 build answers: each kernel library's source, cross-compiled with the flags
launch/native_build gives those instruction sets, is run under user-mode QEMU on the same inputs.

Needs a cross toolchain (`aarch64-linux-gnu-gcc`, its libc, `qemu-aarch64`); without one the test
skips (that is a missing tool, not a missing instruction set: the x86 instruction sets are all tested
in tests/test_cpu_kernels.py). On Debian: `apt-get install gcc-aarch64-linux-gnu qemu-user`.

Why bit for bit: every build rounds products and sums apart (-ffp-contract=off; the attention's
vectors multiply and add separately) and fuses exactly where the source says so (GR_FMA: fmaf, one
instruction on both architectures), so the same C gives the same bits on both.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from attention.backends import cpu_decode_attention as c_attention
from configs import using_kernel_config
from launch import native_build
from models import cpu_kernels

CROSS, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")

pytestmark = pytest.mark.skipif(not (CROSS and QEMU and SYSROOT.is_dir() and native_build.compiler()),
                                reason="needs aarch64-linux-gnu-gcc, its libc and qemu-aarch64")

# Shapes (the driver's #defines): norm rows x cols; RoPE rows x heads x dim over a table of positions;
# SiLU rows x cols with torch's NEON chunk of 8; the screen's rows x vocab; the attention's requests,
# heads, dim, block size, blocks and table width.
SHAPES = dict(NR=5, NC=200, RH=3, RD=64, RP=100, SC=100, SCHUNK=8, VR=4, VV=3001, AR=3, AHQ=4, AHK=2, AD=64,
              ABS=16, ANB=32, ATW=8)

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
static void* take(FILE* f, size_t bytes) { void* p = malloc(bytes); if (fread(p, 1, bytes, f) != bytes) exit(2); return p; }
int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    float* x = take(in, 4 * NR * NC); float* res = take(in, 4 * NR * NC); float* w = take(in, 4 * NC);
    float* normed = malloc(4 * NR * NC); float* summed = malloc(4 * NR * NC);
    gr_add_rms_norm(x, res, normed, summed, w, NR, NC, 1e-5f);
    fwrite(normed, 4, NR * NC, out); fwrite(summed, 4, NR * NC, out);
    float* qk = take(in, 4 * NR * RH * RD); int64_t* pos = take(in, 8 * NR); float* table = take(in, 4 * RP * RD);
    float* rot = malloc(4 * NR * RH * RD);
    if (gr_rope(qk, RH * RD, NR, RH, RD, pos, table, RP, rot)) exit(3);
    fwrite(rot, 4, NR * RH * RD, out);
    float* gu = take(in, 4 * NR * 2 * SC); float* silu = malloc(4 * NR * SC);
    gr_silu_mul(gu, silu, NR, SC, 2 * SC, SCHUNK);
    fwrite(silu, 4, NR * SC, out);
    uint16_t* approx = take(in, 2 * VR * VV); float* slack = take(in, 4 * VR); float* norms = take(in, 4 * VV);
    float* max_norm = take(in, 4);
    int64_t* ids = malloc(8 * VV); uint8_t* cand = malloc(VV * VR); float* floor_ = malloc(4 * VR); uint8_t* flag = malloc(VV);
    long kept = gr_screen(approx, VR, VV, slack, norms, *max_norm, ids, cand, floor_, flag);
    fwrite(&kept, 8, 1, out); fwrite(ids, 8, kept, out); fwrite(cand, 1, kept * VR, out); fwrite(floor_, 4, VR, out);
    float* q = take(in, 4 * AR * AHQ * AD); float* k = take(in, 4 * AR * AHK * AD); float* v = take(in, 4 * AR * AHK * AD);
    float* cache = take(in, 4 * 2 * ANB * ABS * AHK * AD); int32_t* tab = take(in, 4 * AR * ATW);
    int32_t* lens = take(in, 4 * AR); int64_t* slots = take(in, 8 * AR); float* scale = take(in, 4);
    float* att = malloc(4 * AR * AHQ * AD);
    if (gr_decode_attention(q, AHQ * AD, k, AHK * AD, v, AHK * AD, cache, ANB, ABS, AHK, AHQ / AHK, AD, tab, ATW, ATW,
                            lens, slots, AR, *scale, att)) exit(4);
    fwrite(att, 4, AR * AHQ * AD, out); fwrite(cache, 4, 2 * ANB * ABS * AHK * AD, out);
    fclose(out);
    return 0;
}
"""


def _inputs() -> dict[str, torch.Tensor]:
    s, gen = SHAPES, torch.Generator().manual_seed(7)
    rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen) * scale  # noqa: E731
    gate_up = rand(s["NR"], 2 * s["SC"], scale=4.0)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 88.7, -104.0, float("inf"), float("-inf")])
    table = torch.randperm(s["ANB"], generator=gen)[: s["AR"] * s["ATW"]].view(s["AR"], s["ATW"]).int()
    lens = torch.tensor([37, 1, 100], dtype=torch.int32)
    slots = (table[:, 0].long() * s["ABS"] + torch.tensor([5, 0, 9]))
    approx = rand(s["VR"], s["VV"], scale=3.0).to(torch.bfloat16)
    norms = torch.rand(s["VV"], generator=gen) + 0.5
    return dict(
        x=rand(s["NR"], s["NC"], scale=4.0), res=rand(s["NR"], s["NC"]), w=rand(s["NC"]),
        qk=rand(s["NR"], s["RH"], s["RD"], scale=3.0), pos=torch.randint(0, s["RP"], (s["NR"],), generator=gen),
        table=rand(s["RP"], s["RD"]), gate_up=gate_up,
        approx=approx, slack=torch.rand(s["VR"], generator=gen) * 0.05, norms=norms, max_norm=norms.max().view(1),
        q=rand(s["AR"], s["AHQ"], s["AD"]), k=rand(s["AR"], s["AHK"], s["AD"]), v=rand(s["AR"], s["AHK"], s["AD"]),
        cache=rand(2, s["ANB"], s["ABS"], s["AHK"], s["AD"]), block_table=table, lens=lens, slots=slots,
        scale=torch.tensor([s["AD"] ** -0.5]))


def _here(t: dict[str, torch.Tensor]) -> list[np.ndarray]:
    """The same calls through this machine's avx2 build, in the driver's output order."""
    s = SHAPES
    with using_kernel_config(cpu_isa="avx2"), torch.inference_mode():
        lib = cpu_kernels.library()
        normed, summed = cpu_kernels.add_rms_norm(t["x"], t["res"], t["w"], 1e-5)
        rot = cpu_kernels.rope(t["qk"], t["pos"], t["table"])
        silu = torch.empty(s["NR"], s["SC"])
        lib.gr_silu_mul(t["gate_up"].data_ptr(), silu.data_ptr(), s["NR"], s["SC"], 2 * s["SC"], s["SCHUNK"])
        ids, cand, floor = cpu_kernels.screen_candidates(t["approx"], t["slack"], t["norms"], float(t["max_norm"]))
        cache, att = t["cache"].clone(), torch.empty_like(t["q"])
        assert c_attention.decode_attention(t["q"], t["k"], t["v"], cache, t["block_table"], t["lens"], t["slots"],
                                            float(t["scale"]), att)
    return [x.numpy() for x in (normed, summed, rot, silu, torch.tensor([ids.numel()]), ids,
                                cand.t().contiguous().to(torch.uint8), floor.view(-1), att, cache)]


def _read(raw: bytes, like: list[np.ndarray]) -> list[np.ndarray]:
    out, at = [], 0
    kept = None
    for i, ref in enumerate(like):
        count = ref.size if i not in (5, 6) else kept * (1 if i == 5 else SHAPES["VR"])
        dtype = ref.dtype if i != 4 else np.int64
        got = np.frombuffer(raw, dtype=dtype, count=count, offset=at)
        at += got.nbytes
        if i == 4:
            kept = int(got[0])
        out.append(got)
    assert at == len(raw)
    return out


@pytest.mark.parametrize("isa", ["neon", "generic"])
def test_the_aarch64_builds_answer_as_this_cpus_avx2_build(isa, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(native_build, "machine", lambda: "aarch64")
        flags = ["-O3", *native_build.isa_flags(isa), "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    defines = [f"-D{name}={value}" for name, value in SHAPES.items()]
    source = tmp_path / "kernels.c"
    source.write_text(native_build.CPU_PREAMBLE + cpu_kernels._SOURCE + c_attention._SOURCE + DRIVER)
    binary = tmp_path / f"kernels_{isa}"
    subprocess.run([CROSS, *flags, *defines, str(source), "-o", str(binary), "-lm"], check=True,
                   capture_output=True, text=True)
    inputs = _inputs()
    with open(tmp_path / "in.bin", "wb") as f:
        for name in ("x", "res", "w", "qk", "pos", "table", "gate_up", "approx", "slack", "norms", "max_norm", "q", "k",
                     "v", "cache", "block_table", "lens", "slots", "scale"):
            tensor = inputs[name].contiguous()
            f.write((tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy().tobytes())
    subprocess.run([QEMU, "-L", str(SYSROOT), str(binary), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                   check=True, capture_output=True, timeout=120)
    expected = _here(inputs)
    got = _read((tmp_path / "out.bin").read_bytes(), expected)
    names = ["norm", "residual sum", "rope", "silu*mul", "kept", "ids", "candidates", "floor", "attention", "cache"]
    for name, want, have in zip(names, expected, got):
        want, have = want.reshape(-1), have.reshape(-1)
        if want.dtype == np.float32:   # NaNs alike (x86 and Arm make NaNs of other signs), the rest bit for bit
            assert np.array_equal(np.isnan(want), np.isnan(have)), name
            want, have = want[~np.isnan(want)], have[~np.isnan(have)]
        assert np.array_equal(want.view(np.uint8), have.view(np.uint8)), name
