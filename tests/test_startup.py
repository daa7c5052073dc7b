"""Start-up and footprint on a CPU: the KV-cache default (what max_model_len x max_num_seqs can use,
capped) in pages resident only once written, the CLI options that size it, the INFO line that breaks
the start-up down, a CPU start that imports neither Triton nor torch._dynamo, and `graphrunner bench
startup --smoke`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import make_tiny_checkpoint
from configs import CacheConfig, EngineConfig
from configs.engine_config import KV_CACHE_MEMORY_CAP
from runner import cli
from runner.platform import num_kv_blocks, zeroed_host_tensor

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return path


# ---- the KV-cache default ------------------------------------------------------------------------
def test_kv_default_is_what_max_model_len_times_max_num_seqs_can_use():
    cache = CacheConfig(block_size=16)
    # 4 sequences of 1000 tokens: 63 blocks each (1000 / 16 rounded up), far below every cap.
    assert cache.default_kv_cache_blocks(4096, max_model_len=1000, max_num_seqs=4, available_bytes=64 * GIB) == 4 * 63


def test_kv_default_is_capped_at_4_gib_and_a_quarter_of_available_memory():
    cache = CacheConfig(block_size=16)
    per_block = 2**20
    # SmolLM2-like: 256 x 8192 tokens would need 131072 blocks of 1 MiB.
    assert cache.default_kv_cache_blocks(per_block, 8192, 256, available_bytes=64 * GIB) == KV_CACHE_MEMORY_CAP // per_block
    assert KV_CACHE_MEMORY_CAP == 4 * GIB
    assert cache.default_kv_cache_blocks(per_block, 8192, 256, available_bytes=8 * GIB) == 2 * GIB // per_block
    # Never below one full-length sequence (the scheduler needs it), even where the caps say less.
    assert cache.default_kv_cache_blocks(per_block, 8192, 256, available_bytes=GIB) == 8192 // 16


def test_kv_cache_memory_is_the_explicit_override_and_takes_units():
    config = EngineConfig.from_kwargs(model="m", kv_cache_memory="512MiB", max_num_seqs=2)
    assert config.cache.kv_cache_memory == 512 * 2**20
    assert num_kv_blocks(config, 2**20, torch.device("cpu"), 0, 0, max_model_len=64) == 512
    assert EngineConfig.from_kwargs(model="m", kv_cache_memory="2GiB").cache.kv_cache_memory == 2 * GIB
    assert EngineConfig.from_kwargs(model="m", kv_cache_memory="512MB").cache.kv_cache_memory == 512 * 10**6
    default = EngineConfig.from_kwargs(model="m", max_num_seqs=3)
    assert num_kv_blocks(default, 2**20, torch.device("cpu"), 0, 0, max_model_len=160) == 3 * 10
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_kwargs(model="m", kv_cache_memory="lots")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_cpu_kv_cache_pages_are_zero_and_resident_only_once_written():
    before = _rss_bytes()
    cache = zeroed_host_tensor((2, 1024, 16, 8, 64), torch.float32)   # 64 MiB
    assert cache.shape == (2, 1024, 16, 8, 64) and cache.dtype == torch.float32
    assert _rss_bytes() - before < 16 * 2**20
    assert not cache[1, 1023].any() and not cache[0, 0].any()
    cache[0, :512].fill_(1.0)                                           # 16 MiB written
    assert _rss_bytes() - before >= 12 * 2**20
    assert float(cache.sum()) == 512 * 16 * 8 * 64


def test_a_cpu_engine_sizes_its_kv_cache_by_its_sequences(tiny):
    from runner import LLM
    with LLM(model=str(tiny), device="cpu", max_model_len=64, max_num_seqs=3) as llm:
        assert llm.engine.executor.num_blocks == 3 * 4        # 3 sequences of 64 tokens in 16-token blocks


# ---- CLI options ---------------------------------------------------------------------------------
@pytest.fixture
def recorded_llm(monkeypatch):
    """The options `graphrunner generate` passes to LLM, recorded; no engine is built."""
    import runner.llm
    seen = {}

    class Recorded(Exception):
        """Raised in place of building the engine, once the options are recorded."""

    def recording_llm(model, **options):
        seen.update(options, model=model)
        raise Recorded

    monkeypatch.setattr(runner.llm, "LLM", recording_llm)
    return seen


def test_generate_options_size_the_engine_and_reach_its_config(recorded_llm):
    cli.main(["generate", "--model", "/some/model", "--kv-cache-memory", "2GiB", "--max-model-len", "128",
              "--max-num-seqs", "4", "--threads", "1"])
    options = {k: v for k, v in recorded_llm.items() if k != "model"}
    config = EngineConfig.from_kwargs(model=recorded_llm["model"], **options)
    assert config.cache.kv_cache_memory == 2 * GIB
    assert config.model.max_model_len == 128
    assert config.scheduler.max_num_seqs == 4
    assert config.parallel.threads == 1


@pytest.mark.parametrize("argv, named", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: "),
    (["--kv-cache-memory", "0"], "--kv-cache-memory: "),
    (["--threads", "0"], "--threads: "),
    (["--max-num-seqs", "0"], "--max-num-seqs: "),
], ids=["not-a-size", "zero-bytes", "zero-threads", "zero-seqs"])
def test_bad_sizes_are_usage_errors_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "/nowhere", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_serve_takes_the_same_options():
    from runner.engine_args import engine_kwargs
    args = cli.build_parser().parse_args(["serve", "default", "--kv-cache-memory", "512MB", "--max-model-len", "256",
                                          "--max-num-seqs", "8", "--threads", "2"])
    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    assert (config.cache.kv_cache_memory, config.model.max_model_len, config.scheduler.max_num_seqs,
            config.parallel.threads) == (512 * 10**6, 256, 8, 2)


def test_threads_sets_torchs_thread_count(tiny):
    from runner import LLM
    previous = torch.get_num_threads()
    try:
        with LLM(model=str(tiny), device="cpu", max_model_len=32, max_num_seqs=2, threads=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


# ---- the start-up line ---------------------------------------------------------------------------
def test_ready_line_breaks_the_start_up_down(tiny, caplog):
    from runner import LLM
    with caplog.at_level(logging.INFO, logger="runner.engine"):
        with LLM(model=str(tiny), device="cpu", max_model_len=32, max_num_seqs=2) as llm:
            seconds = llm.engine.start_up_seconds
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in ")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    for phase in ("load", "profile", "kv cache", "compile", "capture", "other"):
        assert f" {phase} " in lines[0], lines[0]
    assert set(seconds) == {"load", "profile", "kv_cache", "compile", "capture", "total"}
    assert all(value >= 0 for value in seconds.values())
    assert seconds["load"] > 0 and seconds["total"] >= sum(v for k, v in seconds.items() if k != "total")


def test_a_cpu_start_imports_neither_triton_nor_dynamo(tiny):
    """Triton and torch._dynamo are seconds of imports a CPU engine never uses; so is sympy, which
    Module.to_empty pulled in (models/loader.materialize); transformers' family config module (read
    by AutoConfig, for the model or for AutoTokenizer) imports its image, video and generation
    utilities, seconds more (models/config_json.py)."""
    watched = ("triton", "torch._dynamo", "sympy", "transformers.modeling_utils", "transformers.models.llama.configuration_llama")
    script = (f"import sys\nfrom runner import LLM, SamplingParams\n"
              f"llm = LLM(model={str(tiny)!r}, device='cpu', max_model_len=32, max_num_seqs=2)\n"
              f"assert llm.engine.tokenizer is not None\n"
              f"llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)\n"
              f"print(sorted(m for m in {watched!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---- the benchmark -------------------------------------------------------------------------------
def test_startup_bench_smoke(tmp_path, capsys):
    """`graphrunner bench startup --smoke`: both sides run in subprocesses on a tiny checkpoint with
    SmolLM2's tokenizer; every figure is measured (positive) and the raw results are written."""
    from runner.benchmarks import startup
    assert startup.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "startup.json").read_text())
    (row,) = result["cpu"]
    assert row["tokens"] == 1
    assert row["engine_s"] > 0 and row["hf_s"] > 0 and row["engine_peak_rss_mib"] > 0 and row["hf_peak_rss_mib"] > 0
    assert row["time_ratio"] == pytest.approx(row["engine_s"] / row["hf_s"], rel=0.01)
    printed = capsys.readouterr().out
    assert "| tokens | graphrunner generate s | HF s | time ratio |" in printed


def test_startup_bench_gpu_rows_alternate_a_setting_with_the_default(tmp_path, monkeypatch, capsys):
    """`--gpu-against NAME=VALUE`: each setting has its own cache folder (its empty row fills it),
    the warm runs alternate AB, BA, ..., only the other setting's children see the variable, and
    the medians of each (shape, caches, setting) are printed. The children are faked: this checks
    the plan, not a GPU."""
    from runner.benchmarks import startup
    monkeypatch.setattr("runner.benchmarks.model_shapes.write_config", lambda shape, folder: Path(folder))
    runs = []

    def fake_child(argv, env=None):
        cache, setting = argv[-1], env.get("BENCH_SETTING", "default")
        runs.append((cache, setting))
        seconds = 2.0 if setting == "default" else 3.0
        breakdown = {"load": 0.1, "profile": 0.5, "kv_cache": 0.0, "compile": 0.0, "capture": seconds - 0.6}
        return {"seconds": 9.0, "peak_rss_mib": 1.0,
                "output": "RESULT " + json.dumps({"llm_to_ready_s": seconds, "breakdown": breakdown})}
    monkeypatch.setattr(startup, "run_child", fake_child)
    rows = startup.gpu_rows(["qwen3-0.6b"], tmp_path, warm_runs=3, against="BENCH_SETTING=0")
    timed = runs[1:]   # the first run only fills Python's bytecode cache
    assert [s for _, s in timed] == ["default", "0", "default", "0", "0", "default", "default", "0"]
    caches = {setting: {c for c, s in timed if s == setting} for setting in ("default", "0")}
    assert all(len(c) == 1 for c in caches.values()) and caches["default"] != caches["0"]
    assert [(r["caches"], r["setting"]) for r in rows[:2]] == [("empty caches", "default"),
                                                                ("empty caches", "BENCH_SETTING=0")]
    startup.print_gpu(rows)
    printed = capsys.readouterr().out
    assert "| qwen3-0.6b | warm caches | BENCH_SETTING=0 (median of 3) | 3.00 |" in printed
    assert "| qwen3-0.6b | warm caches | default (median of 3) | 2.00 |" in printed


# ---- packed weights only where they pay -----------------------------------------------------------
@pytest.fixture(params=["mkl", "onednn"])
def pack(request):
    """Each packed-weight format this torch build has, in force (KernelConfig.cpu_linear_pack)."""
    from configs import using_kernel_config
    from models import layers
    if not layers.format_available(request.param):
        pytest.skip(f"this torch build has no {request.param} packed linear")
    with using_kernel_config(cpu_linear_pack=request.param, cpu_packed_linear=True):
        assert layers.pack_format() == request.param
        yield request.param


def test_a_linear_packs_its_weight_on_its_first_batched_product_only(pack):
    """A pack costs the weight's memory again: 1-2-row products (one-prompt decode, where packing
    gains nothing) never build one; the first product of 3-64 rows does, and every later product of
    the same rows computes the same bits (a later pack would change the first one's last bits)."""
    from models import layers
    linear = layers.Linear(64, 32, bias=False)
    packs = layers.weight_packs[pack]

    def built() -> bool:
        entry = packs._entries.get(id(linear.weight))
        return entry is not None and entry[2] is not None

    with torch.no_grad(), layers.decode_step_products(True):
        for _ in range(3):
            linear(torch.randn(1, 64))
            linear(torch.randn(2, 64))
        assert not built()
        x = torch.randn(8, 64)
        first = linear(x)
        assert built()
        assert torch.equal(linear(x), first)
        assert torch.allclose(first, torch.nn.functional.linear(x, linear.weight), atol=1e-5)


def test_only_decode_steps_pack_weights(pack):
    """A prefill of a few dozen tokens runs once: packing every weight for it would cost more start-up
    time and memory than it saves, so products outside a decode step (the runner marks them with
    `decode_step_products`) take F.linear and build nothing."""
    from models import layers
    linear = layers.Linear(64, 32, bias=False)
    x = torch.randn(24, 64)
    with torch.no_grad():
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))
        with layers.decode_step_products(False):
            linear(x)
        assert id(linear.weight) not in layers.weight_packs[pack]._entries
        with layers.decode_step_products(True):
            linear(x)
        assert layers.weight_packs[pack]._entries[id(linear.weight)][2] is not None


def test_auto_packs_with_mkl_on_intel_and_onednn_elsewhere(monkeypatch):
    """`auto` (models/layers.pack_format) follows the measurement of `graphrunner bench cpu_linear`;
    a format this build lacks falls back to the other."""
    from configs import using_kernel_config
    from models import layers
    with using_kernel_config(cpu_linear_pack="auto"):
        for vendor, expected in [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), (None, "onednn")]:
            monkeypatch.setattr(layers, "cpu_vendor", lambda vendor=vendor: vendor)
            monkeypatch.setattr(layers, "format_available", lambda name: True)
            assert layers.pack_format() == expected
            monkeypatch.setattr(layers, "format_available", lambda name, expected=expected: name != expected)
            assert layers.pack_format() == {"mkl": "onednn", "onednn": "mkl"}[expected]
            monkeypatch.setattr(layers, "format_available", lambda name: False)
            assert layers.pack_format() is None and layers._packing_format() is None


def test_engines_of_both_formats_give_hf_greedy_tokens(tmp_path):
    """A batched CPU decode (4 prompts: 4-row products, packed) under each format, same greedy tokens as
    HF transformers; each format keeps its own packs."""
    from checkpoints import hf_greedy_generate
    from models import layers
    from runner import LLM, SamplingParams
    tiny, hf_model = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    prompts = [[1, 5, 9, 13], [2, 7], [3, 3, 3, 8, 21], [11]]
    expected = hf_greedy_generate(hf_model, prompts, 6, ignore_eos=True)
    for pack in [name for name in ("mkl", "onednn") if layers.format_available(name)]:
        llm = LLM(model=str(tiny), dtype="float32", device="cpu", kernel_config={"cpu_linear_pack": pack})
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, pack
