"""The config owns every switch: each GRAPHRUNNER_* variable is the default of one validated field, read
only when a config is built (configs/env.py), never by another module and never written; `LLM(...)`
takes every field, and the engine's choice reaches the code below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from configs import EngineConfig, KernelConfig, active_kernel_config
from configs.env import ENV_FIELDS

ROOT = Path(__file__).resolve().parent.parent
ENV_API = {"get", "getenv", "pop", "setdefault", "setenv", "delenv", "putenv", "unsetenv"}


def _env_uses(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line' of each read or write of a GRAPHRUNNER_* variable: `environ.get("GRAPHRUNNER_X")`,
    `os.getenv(...)`, `environ["GRAPHRUNNER_X"]`, `monkeypatch.setenv("GRAPHRUNNER_X", ...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ENV_API \
                and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "environ" and isinstance(node.slice, ast.Constant):
            name = node.slice.value
        if isinstance(name, str) and name.startswith("GRAPHRUNNER_"):
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_no_module_outside_the_config_reads_or_writes_a_graphrunner_variable():
    here = Path(__file__).resolve()
    uses = [use for folder in ("launch", "attention", "models", "runner", "scripts", "tests")
            for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() != here
            for use in _env_uses(path)]
    assert not uses, "GRAPHRUNNER_* read or set outside configs/ (make it a config field):\n" + "\n".join(uses)
    # ... and inside configs/, only env.py reads the environment.
    readers = [path.name for path in (ROOT / "configs").rglob("*.py")
               if "os.environ" in path.read_text() or "getenv" in path.read_text()]
    assert readers == ["env.py"]


def test_the_checker_sees_reads_and_writes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nA = os.environ.get("GRAPHRUNNER_X", "1")\nos.environ["GRAPHRUNNER_Y"] = "0"\n'
                      'B = os.getenv("HOME")\n\n\ndef f(monkeypatch):\n    monkeypatch.setenv("GRAPHRUNNER_Z", "1")\n')
    assert _env_uses(sample, tmp_path) == ["sample.py:2 GRAPHRUNNER_X", "sample.py:3 GRAPHRUNNER_Y",
                                           "sample.py:8 GRAPHRUNNER_Z"]


EVERY_SWITCH = {
    "GRAPHRUNNER_CACHE_DIR": ("/tmp/gr-cache", "/tmp/gr-cache"),
    "GRAPHRUNNER_COMPILE_THREADS": ("3", 3),
    "GRAPHRUNNER_GEMM_WARM_UP": ("0", False),
    "GRAPHRUNNER_CPU_ISA": ("avx2", "avx2"),
    "GRAPHRUNNER_CPU_KERNELS": ("0", False),
    "GRAPHRUNNER_CPU_LINEAR_PACK": ("onednn", "onednn"),
    "GRAPHRUNNER_CPU_PACKED_LINEAR": ("0", False),
    "GRAPHRUNNER_CPU_SCREENED_ARGMAX": ("false", False),
    "GRAPHRUNNER_DEBUG_CUDAGRAPH": ("1", True),
    "GRAPHRUNNER_FAST_LAUNCH": ("0", False),
    "GRAPHRUNNER_FUSED_MERGE": ("0", False),
    "GRAPHRUNNER_FUSED_OPS": ("off", False),
    "GRAPHRUNNER_HOME": ("/tmp/gr-home", "/tmp/gr-home"),
    "GRAPHRUNNER_MIN_SPLIT_TILES": ("4", 4),
    "GRAPHRUNNER_ONE_ROW_BLOCK_K": ("4096", 4096),
    "GRAPHRUNNER_ONE_ROW_BLOCK_N": ("4", 4),
    "GRAPHRUNNER_PDL": ("0", False),
    "GRAPHRUNNER_PP_STEP_TIMEOUT_S": ("0", 0.0),
    "GRAPHRUNNER_PUSH_ALL_REDUCE_IN_GEMV": ("0", False),
    "GRAPHRUNNER_PUSH_ALL_REDUCE_MAX_BYTES": ("0", 0),
    "GRAPHRUNNER_PUSH_ALL_REDUCE_TIMEOUT_RECORD": ("1", True),
    "GRAPHRUNNER_SMALL_BATCH_KERNELS": ("0", False),
    "GRAPHRUNNER_STEP_GRAPH": ("no", False),
    "GRAPHRUNNER_TORCH_DENSE_KV": ("0", False),
    "GRAPHRUNNER_TRITON_SAMPLING": ("0", False),
    "GRAPHRUNNER_WARM_UP_EVERY_CAPTURE": ("1", True),
}
SECTIONS = {"ModelConfig": "model_config_", "CompilationConfig": "compilation", "ParallelConfig": "parallel",
            "KernelConfig": "kernel"}


def _field(config: EngineConfig, owner: str):
    section, name = owner.split(".")
    return getattr(getattr(config, SECTIONS[section]), name)


def test_every_switch_is_a_field_with_its_variable_as_default():
    assert sorted(ENV_FIELDS) == sorted(EVERY_SWITCH)


@pytest.mark.parametrize("variable", sorted(EVERY_SWITCH))
def test_a_variable_sets_its_fields_default_when_the_config_is_built(monkeypatch, variable):
    raw, value = EVERY_SWITCH[variable]
    default = _field(EngineConfig.from_kwargs(model="m"), ENV_FIELDS[variable])
    assert default != value
    monkeypatch.setenv(variable, raw)   # the one place a test sets a GRAPHRUNNER_ variable: this mapping
    assert _field(EngineConfig.from_kwargs(model="m"), ENV_FIELDS[variable]) == value
    # An explicit argument beats the variable.
    section, name = ENV_FIELDS[variable].split(".")
    assert _field(EngineConfig.from_kwargs(model="m", **{name: default}), ENV_FIELDS[variable]) == default


def test_a_bad_value_names_the_variable_or_the_field(monkeypatch):
    monkeypatch.setenv("GRAPHRUNNER_PDL", "maybe")
    with pytest.raises(ValueError, match="GRAPHRUNNER_PDL='maybe'"):
        KernelConfig()
    monkeypatch.setenv("GRAPHRUNNER_PDL", "1")
    monkeypatch.setenv("GRAPHRUNNER_MIN_SPLIT_TILES", "0")
    with pytest.raises(ValueError, match="min_split_tiles"):
        KernelConfig()
    with pytest.raises(ValueError, match="compile_threads"):
        EngineConfig.from_kwargs(model="m", compile_threads=-1)


def test_llm_options_route_to_the_kernel_config():
    config = EngineConfig.from_kwargs(model="m", kernel_config={"pdl": False}, fast_launch=False, step_graph=False,
                                      pp_step_timeout_s=5)
    assert not config.kernel.pdl and not config.kernel.fast_launch
    assert not config.compilation.step_graph and config.parallel.pp_step_timeout_s == 5
    assert not EngineConfig.from_kwargs(model="m", kernel_config=KernelConfig(fused_ops=False)).kernel.fused_ops
    with pytest.raises(ValueError, match="pdll"):
        EngineConfig.from_kwargs(model="m", kernel_config={"pdll": False})
    with pytest.raises(TypeError, match="kernel_config must be a dict"):
        EngineConfig.from_kwargs(model="m", kernel_config="pdl=0")


def test_the_engines_kernel_config_reaches_the_kernels(tmp_path):
    """LLM(kernel_config=...) is what the kernels see: no C kernels, no dense K/V copy, and still HF's tokens."""
    from checkpoints import hf_greedy_generate, make_tiny_checkpoint
    from attention.backends import cpu_decode_attention
    from configs import SamplingParams
    from models import cpu_kernels
    from runner import LLM
    path, hf = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    prompts = [[5, 9, 13, 2], [7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", device="cpu", kernel_config={"cpu_kernels": False,
                                                                            "torch_dense_kv": False})
    assert active_kernel_config() is llm.engine.config.kernel
    assert cpu_kernels.library() is None and not cpu_decode_attention.native_attention()
    assert llm.engine.model_runner.attn_backend.dense_kv is None
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_generate(hf, prompts, 6, ignore_eos=True)


def test_the_cli_passes_whole_sub_configs_as_json():
    import argparse
    from runner.cli import add_config_arguments, config_options
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--kernel-config", '{"pdl": false}', "--compilation-config", '{"step_graph": false}'])
    config = EngineConfig.from_kwargs(model="m", **config_options(args))
    assert not config.kernel.pdl and not config.compilation.step_graph
    assert config_options(parser.parse_args([])) == {}
