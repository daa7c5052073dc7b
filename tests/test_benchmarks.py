"""The benchmarks of runner/benchmarks/ run on a CPU, and their model shapes load as the engine and HF read them.

The GPU figures themselves come from `graphrunner bench decode` (and the others) on a GPU; here we
make sure the benchmarks' code paths work, write their raw results under `--out`, and that the
shapes are the models they claim to be, without weights.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from models import model_spec
from models.rotary import rope_inverse_frequencies
from runner.benchmarks import decode as bench_decode
from runner.benchmarks import throughput as bench_throughput
from runner.benchmarks.model_shapes import SHAPES, kv_bytes_per_token, parameter_bytes, write_config


def test_throughput_cpu_small_runs_and_reports_positive_rates(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    result = bench_throughput.run(["--cpu-small", "--out", str(tmp_path)])
    assert result["resolved_mode"] == "NONE" and result["device"] == "cpu"
    assert result["num_seqs"] == 16 and result["num_layers"] == 4
    prompts, params = bench_throughput.make_workload(16, 16, 64, 64, seed=0)
    assert result["input_tokens"] == sum(len(p) for p in prompts)
    assert result["output_tokens"] == sum(p.max_tokens for p in params)  # ignore_eos: every request runs out
    assert result["seconds"] > 0 and result["output_tok_s"] > 0
    assert result["total_tok_s"] > result["output_tok_s"]
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert "output" in printed and "bandwidth bound:" in printed and "x the bound" in printed
    bound = result["bound"]
    # Every request's prompt is prefilled and each output token but the last is fed back: the
    # attention reads at least the final context of every request once, in its last step.
    assert bound["steps"] >= max(p.max_tokens for p in params)
    assert bound["kv_tokens_attended"] > sum(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    assert bound["bandwidth_bytes_per_s"] > 0 and 0 < bound["bound_s"] and bound["bound_fraction"] > 0
    assert bound["bound_fraction"] == pytest.approx(bound["bound_s"] / result["seconds"])
    assert bound["weight_bytes"] == parameter_bytes("smollm2-135m", 4, num_hidden_layers=4)


def test_kernel_totals_per_name_and_busy_union():
    from runner.benchmarks.kernel_profile import kernel_totals, table
    totals = kernel_totals([("attention_kernel", 0.0, 10.0), ("gemm", 5.0, 12.0), ("attention_kernel", 20.0, 30.0),
                            ("merge_splits_kernel", 40.0, 41.0)])
    assert totals.per_name == {"attention_kernel": [20.0, 2], "gemm": [7.0, 1], "merge_splits_kernel": [1.0, 1]}
    assert totals.busy_us == 12.0 + 10.0 + 1.0 and totals.span_us == 41.0 and totals.total_us == 28.0
    assert totals.matching_us("attention") == 20.0 and totals.matching_us("kernel", excluding=("merge",)) == 20.0
    lines = table(totals, 2)
    assert "4 launches" in lines[0] and len(lines) == 3 and "attention_kernel" in lines[1] and "gemm" in lines[2]
    assert kernel_totals([]).busy_us == 0.0


def test_profile_kernels_profiles_a_run_of_the_next_seed(monkeypatch):
    """`bench throughput --profile-kernels`: one more run, of the next seed's workload (new prompts),
    under torch.profiler; its kernels are totalled and attention is set against the run's KV bound."""
    import contextlib
    import types
    import torch
    args = bench_throughput.parse_args(["--profile-kernels", "2", "--num-seqs", "4", "--max-input-len", "200",
                                        "--max-output-len", "200"])
    generated, stats = [], iter([{"num_scheduled_steps": 10, "num_kv_tokens_attended": 1000},
                                 {"num_scheduled_steps": 30, "num_kv_tokens_attended": 5000}])
    llm = types.SimpleNamespace(generate=lambda prompts, params, use_tqdm: generated.append(prompts),
                                engine=types.SimpleNamespace(scheduler=types.SimpleNamespace(stats=lambda: next(stats))))
    cuda = torch.autograd.DeviceType.CUDA
    events = [types.SimpleNamespace(name=n, device_type=cuda, time_range=types.SimpleNamespace(start=a, end=b))
              for n, a, b in (("attention_kernel", 0.0, 4e5), ("gemm", 4e5, 5e5))]
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities: contextlib.nullcontext(types.SimpleNamespace(events=lambda: events)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    result = bench_throughput.profile_kernels(llm, args, bandwidth=1e12, overrides={})
    assert generated == [bench_throughput.make_workload(4, 100, 200, 200, seed=1)[0]]
    per_token = kv_bytes_per_token("qwen3-0.6b", 2)
    assert result["kv_bound_s"] == pytest.approx(4000 * per_token / 1e12)
    assert result["bound_s"] == pytest.approx((20 * parameter_bytes("qwen3-0.6b", 2) + 4000 * per_token) / 1e12)
    assert result["attention_s"] == pytest.approx(0.4) and result["busy_s"] == pytest.approx(0.5)
    assert [row[0] for row in result["top"]] == ["attention_kernel", "gemm"]
    assert "% of the copy bandwidth" in result["lines"][-1]


def test_bandwidth_bound_arithmetic():
    """(steps x weight bytes + attended KV entries x bytes per entry) / bandwidth."""
    assert bench_throughput.bandwidth_bound_s(10, 1000, 2_000_000, 100, 1e9) == pytest.approx((2e7 + 1e5) / 1e9)
    assert bench_throughput.bandwidth_bound_s(0, 0, 5, 5, 1.0) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        bench_throughput.bandwidth_bound_s(1, 1, 1, 1, 0.0)
    figures = bench_throughput.bound_figures({"num_scheduled_steps": 100, "num_kv_tokens_attended": 50_000},
                                             "qwen3-0.6b", "bfloat16", 2.5e12, seconds=0.5)
    weights, per_token = parameter_bytes("qwen3-0.6b", 2), kv_bytes_per_token("qwen3-0.6b", 2)
    assert per_token == 2 * 28 * 8 * 128 * 2
    assert figures["bound_s"] == pytest.approx((100 * weights + 50_000 * per_token) / 2.5e12)
    assert figures["bound_fraction"] == pytest.approx(figures["bound_s"] / 0.5)


def test_throughput_workload_follows_nano_vllm():
    """nano-vllm: random.seed(0); prompts of randint(100, 1024) ids in [0, 10000], then max_tokens."""
    import random
    prompts, params = bench_throughput.make_workload(256, 100, 1024, 1024, seed=0)
    random.seed(0)
    expected = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    assert prompts == expected
    assert [p.max_tokens for p in params] == [random.randint(100, 1024) for _ in range(256)]
    assert all(p.ignore_eos and p.temperature == 0.6 for p in params)


def test_decode_bench_cpu_smoke(tmp_path):
    """Every code path of `graphrunner bench decode` except CUDA events and graphs (modes resolve to
    NONE on a CPU); --no-plot leaves only the JSON under --out."""
    out = tmp_path / "decode.json"
    result = bench_decode.run(["--device", "cpu", "--dtype", "float32", "--num-layers", "2",
                               "--shapes", "smollm2-135m", "--batch-sizes", "1", "2", "--modes", "NONE", "FULL",
                               "--warmup", "1", "--steps", "2", "--no-plot", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["batch_size"], r["mode"]) for r in rows] == [(1, "NONE"), (2, "NONE"), (1, "FULL"), (2, "FULL")]
    for r in rows:
        assert r["ms_per_step"] > 0 and 0 <= r["host_ms"] < r["ms_per_step"]
        assert r["floor_ms"] > 0 and r["hf_ms_per_step"] > 0 and r["speedup_vs_hf"] > 0
        assert len(r["step_ms"]) == 2 and r["context"] > 128
    assert [e["resolved_mode"] for e in result["engines"]] == ["NONE", "NONE"]
    assert json.loads(out.read_text())["rows"] == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json"]
    assert all(not r["async_scheduling"] and r["call_ms"] > 0 for r in rows)  # auto: off on a CPU


def test_decode_bench_cpu_async_smoke(tmp_path):
    """--async-scheduling on: ms/step from consecutive steps' `sampled` marks, host ms from the wall time
    of engine.step() less its waits (none on a CPU, where the step runs synchronously anyway)."""
    result = bench_decode.run(["--device", "cpu", "--dtype", "float32", "--num-layers", "2",
                               "--shapes", "smollm2-135m", "--batch-sizes", "2", "--modes", "NONE",
                               "--warmup", "1", "--steps", "3", "--no-hf", "--no-plot", "--async-scheduling", "on"])
    (row,) = result["rows"]
    assert row["async_scheduling"] and result["engines"][0]["async_scheduling"] and row["call_ms"] is None
    assert len(row["step_ms"]) == 3 and row["ms_per_step"] == sorted(row["step_ms"])[1]
    assert 0 < row["host_ms"] <= row["wall_ms"] and row["forward_sample_ms"] > 0


def test_decode_bench_cpu_long_context_smoke(tmp_path, capsys):
    """--context-len: every batch size at every context in one engine (max_model_len raised to fit,
    --max-kv-tokens skipping the largest product), each row with its prompt length, the floor and the
    prefill tokens/s, and the long-context table printed last."""
    result = bench_decode.run(["--device", "cpu", "--dtype", "float32", "--num-layers", "2",
                               "--shapes", "smollm2-135m", "--batch-sizes", "1", "2", "--modes", "NONE",
                               "--context-len", "40", "300", "--max-kv-tokens", "400", "--max-num-batched-tokens",
                               "128", "--warmup", "1", "--steps", "2", "--no-hf", "--no-plot"])
    rows = result["rows"]
    assert [(r["prompt_len"], r["batch_size"]) for r in rows] == [(40, 1), (40, 2), (300, 1)]
    assert result["max_model_len"] >= 300
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["floor_ms"] > 0 and r["context"] > r["prompt_len"]
    assert rows[2]["floor_ms"] > rows[0]["floor_ms"], "a longer context reads more KV"
    table = capsys.readouterr().out.split("Long context")[1]
    assert "| x floor | prefill tok/s |" in table and "| smollm2-135m | NONE | 1 | 300 |" in table


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_loads_with_autoconfig_and_model_spec(tmp_path, name):
    shape = SHAPES[name]
    config = AutoConfig.from_pretrained(write_config(name, tmp_path / name))
    spec = model_spec(config)
    assert spec.architecture == shape["architectures"][0]
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"])
    assert spec.head_dim == shape["head_dim"]
    assert (spec.intermediate_size, spec.vocab_size) == (shape["intermediate_size"], shape["vocab_size"])
    assert spec.tie_word_embeddings == shape["tie_word_embeddings"]
    assert spec.rms_norm_eps == shape["rms_norm_eps"]
    assert spec.max_position_embeddings == shape["max_position_embeddings"]
    assert spec.checkpoint_dtype == torch.bfloat16
    assert spec.qk_norm == (name == "qwen3-0.6b")

    # rope_theta (and llama3 scaling) must survive the round trip: a wrong theta changes nothing else.
    inv_freq, scaling = rope_inverse_frequencies(config)
    d, theta = spec.head_dim, shape["rope_theta"]
    assert scaling == 1.0 and inv_freq.shape == (d // 2,)
    assert inv_freq[1].item() == pytest.approx(theta ** (-2 / d), rel=1e-5)
    lowest = theta ** (-(d - 2) / d)
    if shape["rope_scaling"]:  # llama3: wavelengths beyond original_max / low_freq_factor are divided by factor
        assert inv_freq[-1].item() == pytest.approx(lowest / shape["rope_scaling"]["factor"], rel=1e-5)
    else:
        assert inv_freq[-1].item() == pytest.approx(lowest, rel=1e-5)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_byte_counts_match_hf_parameters(tmp_path, name):
    """The floor's weight bytes are HF's parameter count less norms and an untied embedding table."""
    config = AutoConfig.from_pretrained(write_config(name, tmp_path / name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    streamed = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    if not config.tie_word_embeddings:
        streamed -= model.get_input_embeddings().weight.numel()
    assert parameter_bytes(name) == 2 * streamed
    shape = SHAPES[name]
    expected_kv = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    assert kv_bytes_per_token(name) == expected_kv
    known = {"smollm2-135m": 135e6, "llama-3.2-1b": 1.24e9, "llama-3-8b": 8.03e9, "qwen3-0.6b": 0.6e9}
    total = sum(p.numel() for p in model.parameters())
    assert math.isclose(total, known[name], rel_tol=0.03)


def test_cpu_linear_bench_times_every_available_format(tmp_path, capsys):
    """`graphrunner bench cpu_linear` times F.linear and each packed format this build has over one
    step's projections, says which one `auto` picks, and writes the same figures as JSON."""
    from models.layers import format_available, pack_format
    from runner.benchmarks import cpu_linear
    assert cpu_linear.main(["--layers", "1", "--rows", "1", "4", "--steps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_linear.json").read_text())
    formats = ["F.linear"] + [name for name in ("mkl", "onednn") if format_available(name)]
    assert [r["rows"] for r in result["rows"]] == [1, 4] and result["auto"] == pack_format()
    for row in result["rows"]:
        assert sorted(k for k in row if k != "rows") == sorted(formats) and all(row[f] > 0 for f in formats)
    assert f"auto packs with: {pack_format()}" in capsys.readouterr().out
    weights = cpu_linear.step_weights("smollm2-135m", 1)
    assert [tuple(w.shape) for w in weights] == [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def test_linear_bench_cpu_smoke(tmp_path):
    """`graphrunner bench linear`'s code paths bar CUDA graphs and events: both variants of every
    projection run (the Triton kernels in the interpreter), the table's rows and the JSON agree."""
    import os

    from runner.benchmarks import linear as bench_linear
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert bench_linear.run(["--device", "cpu", "--shapes", "tiny"]) == {"skipped": "TRITON_INTERPRET is not 1"}
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on a CPU")
    out = tmp_path / "linear.json"
    result = bench_linear.run(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--rows", "1", "3",
                               "--repeats", "2", "--replays", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["rows"], r["projection"]) for r in rows] == [
        (m, p) for m in (1, 3) for p in ("qkv", "o", "gate_up", "down", "layer")]
    for r in rows:
        assert r["unfused_us"] > 0 and r["fused_us"] > 0 and r["ratio"] == r["unfused_us"] / r["fused_us"]
    layer = rows[4]
    assert layer["unfused_us"] == pytest.approx(sum(r["unfused_us"] for r in rows[:4]))
    assert json.loads(out.read_text())["rows"] == rows


def test_gemv_configs_bench_cpu_smoke(tmp_path):
    """`graphrunner bench gemv_configs`' code paths bar CUDA graphs: every weight of a layer and the
    LM head, the cuBLAS / default / swept timings, the best config among those swept, the JSON."""
    import os

    from runner.benchmarks import gemv_configs as bench_gemv_configs
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert bench_gemv_configs.run(["--device", "cpu", "--shapes", "tiny"]) == {"skipped": "TRITON_INTERPRET is not 1"}
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on a CPU")
    out = tmp_path / "gemv_configs.json"
    result = bench_gemv_configs.run(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--configs", "2",
                                     "--repeats", "1", "--replays", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [r["projection"] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    for r in rows:
        assert r["cublas_us"] > 0 and r["default_us"] > 0 and len(r["configs"]) == 2
        assert r["best_us"] == min(r["configs"].values())
    assert json.loads(out.read_text())["rows"] == rows


def test_gemv_configs_weights_are_one_ranks_shards_under_tensor_parallelism():
    """`--tensor-parallel-size 2`: the Llama-3-8B shards a TP=2 rank streams (8 KV heads split 4 / 4)."""
    from runner.benchmarks.gemv_configs import weights_of
    whole, shard = weights_of("llama-3-8b"), weights_of("llama-3-8b", 2)
    assert whole == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)}
    assert shard == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
                     "lm_head": (64128, 4096)}


def test_outputs_bench_times_each_stage_of_both_paths(tmp_path, capsys):
    """`graphrunner bench outputs`: offline's FINAL_ONLY outputs, the engine thread's DELTA outputs,
    and the engine process's with their wire stages, per token; the JSON holds the same figures."""
    from runner.benchmarks import outputs as bench_outputs
    assert bench_outputs.main(["--requests", "4", "--steps", "3", "--rounds", "1", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "outputs.json").read_text())["us_per_token"]
    assert set(figures["offline (FINAL_ONLY)"]) == set(figures["engine thread (DELTA)"]) == {"outputs"}
    assert set(figures["engine process (DELTA, wire)"]) == {"outputs", "encode", "pickle", "unpickle", "decode_output"}
    assert all(v > 0 for path in figures.values() for v in path.values())
    assert "| engine process (DELTA, wire) |" in capsys.readouterr().out


def test_break_replay_bench_switches_every_graph_between_variants(capsys):
    """The A/B of `graphrunner bench break_replay` on fake graphs: prepared calls are the records'
    replays where they have one; generic calls are the ops on the recorded inputs; only "fast"
    lets attention take the direct launch."""
    from types import SimpleNamespace

    from attention.kernels import unified_attention
    from runner.benchmarks import break_replay as bench_break_replay
    from runner.cudagraph.breakable import BreakableGraph, BreakRecord

    seen = []
    op = lambda x, *, out: seen.append(("op", x))
    fast = lambda: seen.append("fast")
    graph = BreakableGraph([SimpleNamespace(replay=lambda: None)] * 3,
                           [BreakRecord(op, (1,), {"out": None}, fast), BreakRecord(op, (2,), {"out": None})])
    runner = SimpleNamespace(piecewise=SimpleNamespace(_entries={"desc": SimpleNamespace(graph=graph)}))
    launcher = unified_attention._attention_launch
    try:
        bench_break_replay._set_variant(runner, "generic")
        graph.replay()
        bench_break_replay._set_variant(runner, "python-launch")
        assert launcher.direct_launch("kernel", (1,), 0) is None
        graph.replay()
        bench_break_replay._set_variant(runner, "fast")
        graph.replay()
    finally:
        vars(launcher).pop("direct_launch", None)
    assert seen == [("op", 1), ("op", 2)] + ["fast", ("op", 2)] * 2
    if not torch.cuda.is_available():
        assert bench_break_replay.main([]) == 0
        assert "needs a CUDA device" in capsys.readouterr().out


def test_cpu_engine_vs_hf_bench_smoke(tmp_path, capsys):
    """`graphrunner bench cpu` end to end on the embedded SmolLM2, tiny: one alternating pair and two
    lockstep runs (the engine stepped from HF's per-token stopping-criteria hook), every figure positive."""
    from runner.benchmarks import cpu as bench_cpu
    out = tmp_path / "cpu.json"
    assert bench_cpu.main(["--prompts", "3", "--tokens", "4", "--repeats", "1", "--warmup-runs", "0",
                           "--lockstep-runs", "2", "--max-other-load", "1000", "--cpu-isa", "generic",
                           "--out", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 3 and result["tokens"] == 4 and result["cpu_isa"] == "generic"
    assert len(result["engine_runs"]) == len(result["hf_runs"]) == 1
    assert len(result["lockstep_runs"]) == 2
    assert all(e > 0 and h > 0 for e, h in result["lockstep_runs"]) and result["lockstep_ratio"] > 0
    printed = capsys.readouterr().out
    assert "| lockstep (median ratio) |" in printed and "| whole runs, alternating |" in printed


def test_cublas_first_cases_measure_what_they_name():
    """`graphrunner bench cublas_first`'s three cases, run in this process on the CPU with a small
    shape (on a GPU each runs in a fresh process): each times what its columns name. SmolLM2 has four
    projection shapes; on a CPU every one of the default capture sizes takes the GEMM (no one-row GEMV)."""
    import torch
    from runner.benchmarks import cublas_first
    from runner.cudagraph import default_capture_sizes
    rows = {case: cublas_first.run_case(case, "smollm2-135m", torch.device("cpu")) for case in cublas_first.CASES}
    assert rows["main"]["calls"] == 4 * len(default_capture_sizes())
    assert rows["main"]["first_s"] > 0 and rows["main"]["repeat_s"] > 0
    assert rows["helper"]["helper_s"] > 0 and rows["helper"]["after_helper_s"] > 0
    assert rows["beside"]["alone_s"] > 0 and rows["beside"]["beside_s"] > 0 and rows["beside"]["helper_s"] > 0
