"""`graphrunner generate`: one-line errors, exit 2 on bad usage, exit 1 when a prompt fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_tiny_checkpoint
from runner import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return path


@pytest.fixture
def engine_options(monkeypatch):
    """The options the CLI passes to LLM, recorded; a small KV cache so each start is quick."""
    import runner.llm
    real, seen = runner.llm.LLM, {}

    def small_llm(model, **options):
        seen.update(options, model=model)
        return real(model, num_kv_blocks=32, **options)

    monkeypatch.setattr(runner.llm, "LLM", small_llm)
    return seen


def _one_line_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("graphrunner: error:")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr
    return errors[0]


@pytest.mark.parametrize("argv, named", [
    (["--max-tokens", "many"], "--max-tokens"),
    (["--cudagraph-mode", "SOMETIMES"], "--cudagraph-mode"),
    (["--device", "tpu"], "--device"),
    (["--max-model-len", "0"], "--max-model-len: Input should be greater than or equal to 1 (got 0)"),
    (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0 (got -1.0)"),
    (["--no-such-option"], "--no-such-option"),
    (["--kernel-config", '{"fast_launch": "x"}'], "KernelConfig.fast_launch: Input should be a valid boolean"),
], ids=["not-an-int", "unknown-mode", "unknown-device", "config-range", "sampling-range", "unknown-option",
        "json-config-field"])
def test_bad_usage_exits_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "/nowhere", *argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert named in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("argv, named", [(["--port", "99999"], "--port: Input should be less than or equal to 65535"),
                                         (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater")])
def test_bad_serve_options_exit_2_naming_the_flag_before_anything_starts(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/nowhere", *argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert named in stderr and "Traceback" not in stderr


def test_bad_prompts_file_is_a_usage_error(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    for path, message in ((prompts, "prompts.jsonl:2: expected an object with a string 'prompt' field"),
                          (tmp_path / "absent.jsonl", "cannot read")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["generate", "--prompts-file", str(path)])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_engine_error_is_one_line_and_exit_1_in_a_subprocess(tmp_path):
    """As a user runs it: no traceback, the problem named, status 1."""
    result = subprocess.run([sys.executable, "-m", "runner.cli", "generate", "--model", str(tmp_path / "absent")],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1, result.stderr
    line = _one_line_error(result.stderr)
    assert "CheckpointError" in line and "absent" in line and "does not exist" in line


def test_verbose_adds_the_traceback(tmp_path, capsys):
    assert cli.main(["generate", "--verbose", "--model", str(tmp_path / "absent")]) == 1
    stderr = capsys.readouterr().err
    assert "Traceback" in stderr and "graphrunner: error: CheckpointError" in stderr


def test_any_failed_prompt_exits_1(tiny, engine_options, capsys):
    argv = ["generate", "--model", str(tiny), "--max-tokens", "4", "--device", "cpu", "--max-model-len", "32"]
    assert cli.main([*argv, "--prompt", "hello"]) == 0
    assert "graphrunner: error" not in capsys.readouterr().err
    assert cli.main([*argv, "--json", "--prompt", "hello", "--prompt", "x" * 64]) == 1
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["error"] is None for r in records] == [True, False]
    assert records[1]["finish_reason"] == "abort"
    assert _one_line_error(captured.err) == "graphrunner: error: 1 of 2 prompts failed"


def test_damaged_weights_fail_in_one_line_unless_the_check_is_off(tiny, tmp_path, engine_options, capsys):
    import shutil
    import struct

    from models.safetensors_file import read_safetensors_header
    damaged = shutil.copytree(tiny, tmp_path / "damaged")
    file = damaged / "model.safetensors"
    (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
    begin = read_safetensors_header(file)["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
    with open(file, "r+b") as handle:
        handle.seek(8 + header_len + begin)
        handle.write(b"\xff" * 8)
    argv = ["generate", "--model", str(damaged), "--max-tokens", "2", "--device", "cpu", "--prompt", "hi"]
    assert cli.main(argv) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "NonFiniteWeightError" in line and "'model.layers.0.mlp.up_proj.weight'" in line
    cli.main([*argv, "--no-check-finite-weights"])  # loads; what NaN weights then generate is not the point
    assert engine_options["check_finite_weights"] is False
    assert "NonFiniteWeightError" not in capsys.readouterr().err


def test_every_option_has_a_help_text_about_the_product(capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for command in (parser, *subparsers.choices.values()):
        for action in command._actions:
            if action.option_strings or action.dest in ("command", "which"):
                assert action.help, f"{command.prog} {action.option_strings or action.dest} has no help text"
        text = command.format_help()
        for word in ("scripts/", "session", "device machine", "TODO"):
            assert word not in text, f"{command.prog} --help mentions {word!r}"
