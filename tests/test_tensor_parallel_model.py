"""Issue 22, the model side of tensor parallelism: every architecture at TP=2 gives TP=1's logits, a
rank reads only its slices of the checkpoint, and the shard arithmetic.

The parity test spawns two CPU ranks (gloo on 127.0.0.1, bounded by RANK_TIMEOUT_S) once for all
architectures; each rank builds the models with its tensor-parallel group set first (as the runner
does) and drives them directly, without the engine: a batched prefill, a batched decode step and
a one-row decode step through the Llama family's fused small-batch layer path (its kernels stood in
for by torch ops here: the GPU runs the real ones), all through the torch attention backend with a
KV cache of the rank's own heads. The parent computes the same steps at TP=1 and compares.

Loading needs no collective, so the sharded-load tests build a rank's model in this process with a
stand-in group object (a collective would fail on it).
"""

from __future__ import annotations

import datetime
import os
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_tiny_checkpoint
from model_helpers import load_ours
from models import WeightLoadError
from models import parallel_state
from models.loader import NonFiniteWeightError, destination
from models.parallel_state import (padded_vocab_size, reset_tensor_parallel_group, set_tensor_parallel_group,
                                   shard_heads, shard_size, shard_vocab)

TP = 2
RANK_TIMEOUT_S = 120
BLOCK_SIZE = 4
NUM_BLOCKS = 8

CASES = {
    # name: (family, checkpoint overrides). TINY: 4 q heads, hidden 64, intermediate 128.
    # One KV head for two ranks (replicated), o_proj / MLP biases (added once, after the reduce),
    # an odd vocabulary (padded to 256: rank 1 holds one padding row), untied.
    "llama_kv1_biases_odd_vocab": ("llama_gqa", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                                     vocab_size=255)),
    "llama_mha_tied_odd_vocab": ("llama", dict(tie_word_embeddings=True, vocab_size=253)),
    "mistral": ("mistral", {}),
    "qwen2_qkv_bias": ("qwen2", {}),
    "qwen3_kv1": ("qwen3", dict(num_key_value_heads=1)),
    # Fused qkv_proj / gate_up_proj, cut per part; the fused k part replicated.
    "phi3_fused_kv1": ("phi3", dict(num_key_value_heads=1)),
    "gemma2_tied_softcaps_odd_vocab": ("gemma2", dict(tie_word_embeddings=True, vocab_size=255)),
    "gemma3": ("gemma3", dict(num_key_value_heads=1)),
}
SMALL_BATCH_FAMILIES = {"llama_kv1_biases_odd_vocab", "llama_mha_tied_odd_vocab", "mistral", "qwen2_qkv_bias",
                        "qwen3_kv1", "phi3_fused_kv1"}
"""Cases whose decoder layer is models/llama.py's DecoderLayer (the one with a small-batch path)."""


@pytest.fixture(autouse=True)
def single_rank_after():
    yield
    reset_tensor_parallel_group()


# ---- shard arithmetic ---------------------------------------------------------------------------

def test_heads_split_evenly_with_their_kv_heads():
    assert [shard_heads(8, 4, 2, r) for r in range(2)] == [
        parallel_state.HeadShard(4, 2, 0, 0), parallel_state.HeadShard(4, 2, 4, 2)]
    assert shard_heads(32, 8, 1, 0) == parallel_state.HeadShard(32, 8, 0, 0)
    # Each rank's q heads attend to the KV heads it holds: q head h uses KV head h // (Hq / Hkv).
    for heads, kv, tp in [(8, 4, 2), (8, 2, 4), (12, 3, 6), (16, 1, 4), (8, 8, 8)]:
        for rank in range(tp):
            s = shard_heads(heads, kv, tp, rank)
            wanted = {h // (heads // kv) for h in range(s.q_head_start, s.q_head_start + s.num_heads)}
            assert wanted == set(range(s.kv_head_start, s.kv_head_start + s.num_kv_heads)), (heads, kv, tp, rank)


def test_fewer_kv_heads_than_ranks_replicates_one_per_rank():
    """vLLM's rule: rank r holds KV head r * num_kv_heads // tp_size."""
    assert [shard_heads(8, 2, 4, r).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert [shard_heads(4, 1, 2, r) for r in range(2)] == [
        parallel_state.HeadShard(2, 1, 0, 0), parallel_state.HeadShard(2, 1, 2, 0)]


@pytest.mark.parametrize("args, message", [
    ((9, 3, 2, 0), "num_attention_heads=9 is not divisible by tensor_parallel_size=2"),
    ((12, 6, 4, 0), "num_key_value_heads=6 is not divisible by tensor_parallel_size=4"),
    ((12, 2, 3, 0), "tensor_parallel_size=3 is not a multiple of num_key_value_heads=2"),
    ((4, 2, 2, 2), "rank 2 is outside 0..1"),
])
def test_head_counts_that_do_not_divide_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        shard_heads(*args)


def test_vocab_padded_to_a_multiple_of_the_ranks():
    assert padded_vocab_size(255, 2) == 256 and padded_vocab_size(256, 2) == 256 and padded_vocab_size(49152, 1) == 49152
    assert [shard_vocab(255, 2, r) for r in range(2)] == [parallel_state.VocabShard(0, 128, 128),
                                                          parallel_state.VocabShard(128, 128, 127)]
    assert shard_vocab(5, 4, 3) == parallel_state.VocabShard(6, 2, 0)   # a block of padding only
    assert shard_vocab(10, 1, 0) == parallel_state.VocabShard(0, 10, 10)
    with pytest.raises(ValueError, match="intermediate_size=130 is not divisible by tensor_parallel_size=4"):
        shard_size(130, 4, "intermediate_size")


def test_model_build_names_an_indivisible_field(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False, intermediate_size=130)
    set_tensor_parallel_group(0, 4, object())
    with pytest.raises(ValueError, match="intermediate_size=130 is not divisible by tensor_parallel_size=4"):
        load_ours(path)


def test_tensor_parallel_size_checked_against_the_config(tmp_path):
    from models import load_hf_config, model_spec
    from models.hf_config import check_tensor_parallel_size
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False, intermediate_size=130)
    spec = model_spec(load_hf_config(path))
    check_tensor_parallel_size(spec, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        check_tensor_parallel_size(spec, 3)
    with pytest.raises(ValueError, match="intermediate_size=130 is not divisible by tensor_parallel_size=4"):
        check_tensor_parallel_size(spec, 4)


def test_single_rank_builds_todays_modules_and_no_collective(tmp_path, monkeypatch):
    """tensor_parallel_size 1: plain Linear / ScaledEmbedding modules (no parallel layer, no padding),
    and a forward that never reaches torch.distributed."""
    import torch.distributed as dist
    from model_helpers import prefill_logits
    from models.layers import Linear, RowParallelLinear, ScaledEmbedding
    from models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False, vocab_size=255, mlp_bias=True)
    model = load_ours(path)
    kinds = {type(m) for m in model.modules()}
    assert not kinds & {RowParallelLinear, ParallelLMHead, VocabParallelEmbedding}
    assert type(model.lm_head) is Linear and type(model.model.embed_tokens) is ScaledEmbedding
    assert model.lm_head.weight.shape[0] == 255
    assert (model.num_local_heads, model.num_local_kv_heads) == (4, 2)
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("a collective on a single rank"))
    assert prefill_logits(model, [[1, 2, 3]])[0].shape == (3, 255)


# ---- sharded loading (in this process: loading needs no collective) ------------------------------

class _RecordingOpen:
    """safetensors' safe_open, recording the shape of every `get_slice(name)[...]` read and refusing
    `get_tensor` (a whole tensor)."""

    def __init__(self, real, reads: list):
        self.real, self.reads = real, reads

    def __call__(self, file, framework):
        return _RecordingHandle(self.real(file, framework=framework), self.reads)


class _RecordingHandle:
    def __init__(self, handle, reads):
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, name):
        raise AssertionError(f"get_tensor({name!r}) would read the whole tensor")

    def get_slice(self, name):
        return _RecordingSlice(self.handle.get_slice(name), name, self.reads)


class _RecordingSlice:
    def __init__(self, part, name, reads):
        self.part, self.name, self.reads = part, name, reads

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        tensor = self.part[index]
        self.reads.append((self.name, tuple(self.part.get_shape()), tuple(tensor.shape)))
        return tensor


SPLIT_TENSORS = ("q_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                 "qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")
"""Checkpoint tensors of which a rank of two must read strictly less than the whole."""


@pytest.mark.parametrize("case", ["llama_kv1_biases_odd_vocab", "phi3_fused_kv1", "gemma2_tied_softcaps_odd_vocab"])
def test_a_rank_reads_only_its_slices(tmp_path, monkeypatch, case):
    """Each rank reads every tensor through get_slice (never get_tensor), at most what it keeps of it
    (strictly less than the whole for the split projections, the embedding and the head), and what
    it keeps is exactly its slice of the HF model's weights."""
    import models.loader
    family, overrides = CASES[case]
    path, hf = make_tiny_checkpoint(tmp_path / case, family, with_tokenizer=False, **overrides)
    hf_weights = hf.state_dict()
    real_open = models.loader.safe_open
    for rank in range(TP):
        reads: list = []
        monkeypatch.setattr(models.loader, "safe_open", _RecordingOpen(real_open, reads))
        set_tensor_parallel_group(rank, TP, object())
        model = load_ours(path)
        assert reads
        by_name: dict[str, list] = {}
        for name, full, got in reads:
            by_name.setdefault(name, []).append((full, got))
        for name, shapes in by_name.items():
            full_numel = torch.Size(shapes[0][0]).numel()
            read = sum(torch.Size(got).numel() for _, got in shapes)
            kept = _kept_numel(model, name)
            assert read <= kept, (rank, name, read, kept)
            if name.endswith(SPLIT_TENSORS):
                assert read < full_numel, (rank, name, read, full_numel)
        _assert_rank_holds_its_slices(model, hf_weights, rank)


def _kept_numel(model, checkpoint_name: str) -> int:
    from models.loader import _target
    param, shard = _target(model, checkpoint_name)
    if shard == "tied":
        shard = None
    return destination(model, param, shard).numel()


def _assert_rank_holds_its_slices(model, hf_weights: dict, rank: int) -> None:
    spec = model.spec
    heads = shard_heads(spec.num_heads, spec.num_kv_heads, TP, rank)
    d = spec.head_dim
    inter = spec.intermediate_size // TP
    vocab = shard_vocab(spec.vocab_size, TP, rank)
    layer = model.model.layers["0"]
    attn, mlp = layer.self_attn, layer.mlp
    prefix = "model.layers.0."

    def hf(name):
        return hf_weights[prefix + name] if prefix + name in hf_weights else None

    if hf("self_attn.qkv_proj.weight") is not None:   # Phi-3: fused
        q_all, k_all, v_all = hf("self_attn.qkv_proj.weight").split(
            [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d])
        gate_all, up_all = hf("mlp.gate_up_proj.weight").chunk(2)
    else:
        q_all, k_all, v_all = (hf(f"self_attn.{p}_proj.weight") for p in "qkv")
        gate_all, up_all = hf("mlp.gate_proj.weight"), hf("mlp.up_proj.weight")
    q = q_all[heads.q_head_start * d:(heads.q_head_start + heads.num_heads) * d]
    kv = slice(heads.kv_head_start * d, (heads.kv_head_start + heads.num_kv_heads) * d)
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k_all[kv], v_all[kv]]))
    cols = slice(rank * heads.num_heads * d, (rank + 1) * heads.num_heads * d)
    assert torch.equal(attn.o_proj.weight, hf("self_attn.o_proj.weight")[:, cols])
    if attn.o_proj.bias is not None:   # replicated, whole
        assert torch.equal(attn.o_proj.bias, hf("self_attn.o_proj.bias"))
    rows = slice(rank * inter, (rank + 1) * inter)
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate_all[rows], up_all[rows]]))
    assert torch.equal(mlp.down_proj.weight, hf("mlp.down_proj.weight")[:, rows])
    embed = model.model.embed_tokens.weight
    real = slice(vocab.start, vocab.start + vocab.num_real_rows)
    assert embed.shape[0] == vocab.num_rows
    assert torch.equal(embed[:vocab.num_real_rows], hf_weights["model.embed_tokens.weight"][real])
    assert not embed[vocab.num_real_rows:].any()   # padding rows are zero
    head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    assert torch.equal(model.lm_head.weight[:vocab.num_real_rows], hf_weights[head_name][real])
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == embed.data_ptr()


def test_tied_head_of_a_last_pipeline_stage_reads_its_vocab_block(tmp_path):
    """TP x PP: a last stage without the embedding loads its tied head from the embedding's tensor,
    its own vocabulary block only."""
    from models import build_model, load_hf_config, model_spec
    path, hf = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False, tie_word_embeddings=True,
                                    vocab_size=255)
    spec = model_spec(load_hf_config(path))
    for rank in range(TP):
        set_tensor_parallel_group(rank, TP, object())
        last = build_model(spec, path, device=torch.device("cpu"), dtype=torch.float32, layer_range=range(1, 2))
        vocab = shard_vocab(255, TP, rank)
        embed = hf.model.embed_tokens.weight[vocab.start:vocab.start + vocab.num_real_rows]
        assert torch.equal(last.lm_head.weight[:vocab.num_real_rows], embed)
        assert not last.lm_head.weight[vocab.num_real_rows:].any()


def test_damage_is_still_named_under_tensor_parallelism(tmp_path):
    """A NaN in the slice a rank reads fails that rank's finite check, naming the tensor; a wrong
    shape names the checkpoint's expected shape (not the rank's slice); a missing tensor likewise."""
    from safetensors.torch import load_file, save_file
    path, _ = make_tiny_checkpoint(tmp_path / "c", "llama_gqa", with_tokenizer=False)
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    broken = dict(weights)
    broken[name] = weights[name].clone()
    broken[name][-1, 0] = float("nan")   # the last row: rank 1's half
    save_file(broken, str(path / "model.safetensors"), metadata={"format": "pt"})
    set_tensor_parallel_group(0, TP, object())
    load_ours(path)   # rank 0 never reads the damaged row
    set_tensor_parallel_group(1, TP, object())
    with pytest.raises(NonFiniteWeightError, match=f"{name}.*1 NaN"):
        load_ours(path)
    wrong = dict(weights)
    wrong["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 120)
    save_file(wrong, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"down_proj.weight.*expected \(64, 128\), found \(64, 120\)"):
        load_ours(path)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(missing, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"k_proj.weight' \(expected shape \(32, 64\), found none\)"):
        load_ours(path)


# ---- TP=2 forward against TP=1 (spawned ranks) ---------------------------------------------------

def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(vocab)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 11)]
    prompts[0][0], prompts[1][0] = vocab - 1, 0   # the last real row (rank 1's block) and the first
    return prompts


def _norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    """models/small_batch_kernels.norm_linear in torch ops: (RMSNorm(x + residual) @ weight.T + bias, x + residual)."""
    x = x if residual is None else x + residual
    normed = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return F.linear(normed, weight, bias), x


def _norm_gate_up_silu(x, residual, norm_weight, eps, weight, bias=None):
    gate_up, residual = _norm_linear(x, residual, norm_weight, eps, weight, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up, residual


TORCH_SMALL_BATCH_KERNELS = types.SimpleNamespace(norm_linear=_norm_linear, norm_gate_up_silu=_norm_gate_up_silu,
                                                  linear=F.linear)
"""The small-batch kernels' signatures in torch ops (what the Triton kernels compute, which the GPU runs)."""


@torch.inference_mode()
def _run_steps(model, small_batch_row: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """fp32 logits (on the CPU) of: a prefill of two prompts, a decode step of both, then a decode
    step of the first alone (on a CPU through the fused small-batch layer path when
    `small_batch_row`; a GPU takes the real kernels by itself), with a paged KV cache of this rank's
    heads; the torch attention backend on a CPU, Triton on a GPU."""
    from attention.backends import get_attention_backend
    from attention.forward_context import ForwardContext, set_forward_context
    from runner.input_batch import InputBatch
    import models.llama

    spec = model.spec
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, model.num_local_kv_heads, spec.head_dim, device=device,
                          dtype=model.lm_head.weight.dtype) for _ in model.layer_range]
    backend = get_attention_backend("torch" if device == "cpu" else "triton")
    batch = InputBatch(32, 2, NUM_BLOCKS, BLOCK_SIZE, torch.device(device))
    blocks = [[0, 1, 2], [3, 4, 5, 6]]
    prompts = _prompts(spec.vocab_size)

    def step(tokens, computed, block_ids):
        total = sum(map(len, tokens))
        common = batch.prepare(tokens, computed, block_ids, total, len(tokens))
        input_ids, positions = batch.model_inputs(total)
        with set_forward_context(ForwardContext(backend.build_metadata(common), caches, backend)):
            return model.compute_logits(model(input_ids, positions)).cpu()

    out = {"prefill": step(prompts, [0, 0], blocks)}
    lens = [len(p) for p in prompts]
    out["decode"] = step([[5], [spec.vocab_size - 2]], lens, blocks)
    real_small_batch = models.llama.small_batch
    if small_batch_row and device == "cpu":   # the CPU never takes it by itself: answer the kernels for one row
        models.llama.small_batch = lambda x: TORCH_SMALL_BATCH_KERNELS if x.shape[0] == 1 else None
    try:
        out["decode_one_row"] = step([[7]], [lens[0] + 1], blocks[:1])
    finally:
        models.llama.small_batch = real_small_batch
    return out


def _rank_main(rank: int, store_port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", store_port, TP + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=TP, timeout=timeout)
    try:
        # The runner's order: the tensor-parallel group first, then build_model.
        set_tensor_parallel_group(rank, TP, dist.group.WORLD)
        results = {}
        for name, path in checkpoints.items():
            model = load_ours(path)
            results[name] = _run_steps(model, name in SMALL_BATCH_FAMILIES)
            results[name]["local_kv_heads"] = torch.tensor(model.num_local_kv_heads)
            results[name]["local_heads"] = torch.tensor(model.num_local_heads)
        dummy = load_ours(checkpoints["llama_kv1_biases_odd_vocab"], load_format="dummy")
        results["dummy"] = _run_steps(dummy, True)
        dist.barrier()   # both ranks are past their last collective
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    # Results saved: leave without the interpreter's and gloo's teardown, which on a loaded 2-core
    # machine can abort a rank at exit ("terminate called without an active exception") after its
    # results are written, failing the parity tests for something they do not check.
    os._exit(0)


def _spawn_ranks(rank_main, checkpoints: dict[str, str], out_dir: Path) -> list[dict]:
    """Run `rank_main(rank, store_port, checkpoints, out_dir)` in TP spawned processes, bounded by
    RANK_TIMEOUT_S; each rank's results from out_dir/rank{r}.pt."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    # Port 0: the store binds a free port itself; the ranks join it as its clients.
    store = dist.TCPStore("127.0.0.1", 0, TP + 1, is_master=True, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S),
                          wait_for_workers=False)
    context = mp.start_processes(rank_main, args=(store.port, checkpoints, str(out_dir)), nprocs=TP,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {TP} tensor-parallel ranks did not finish in {RANK_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(TP)]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """(TP=1 results by case, [rank 0's, rank 1's] TP=2 results by case): one spawn for all cases."""
    root = tmp_path_factory.mktemp("tp_model")
    checkpoints, expected = {}, {}
    for name, (family, overrides) in CASES.items():
        path, _ = make_tiny_checkpoint(root / name, family, with_tokenizer=False, **overrides)
        checkpoints[name] = str(path)
        model = load_ours(path)
        expected[name] = _run_steps(model, False)
        expected[name]["local_heads"] = model.num_local_heads
        expected[name]["spec"] = model.spec
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"   # two ranks on a shared 2-core machine
    try:
        ranks = _spawn_ranks(_rank_main, checkpoints, root)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return expected, ranks


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_logits_equal_tp1(tp_results, case):
    expected, ranks = tp_results
    spec = expected[case]["spec"]
    heads = [shard_heads(spec.num_heads, spec.num_kv_heads, TP, r) for r in range(TP)]
    for rank, results in enumerate(ranks):
        got = results[case]
        assert int(got["local_heads"]) == spec.num_heads // TP
        assert int(got["local_kv_heads"]) == heads[rank].num_kv_heads
        for step in ("prefill", "decode", "decode_one_row"):
            want = expected[case][step]
            assert got[step].shape == want.shape == (want.shape[0], spec.vocab_size), (rank, step)
            # fp32: the ranks' partial sums are added in another order than one rank's matmul adds
            # them, so the logits differ by float noise that scales with the logits' size (TP=1 itself
            # differs from HF transformers by 3.3e-5 on gemma3, whose logits reach 16).
            error = (got[step] - want).abs().max().item()
            assert error <= 1e-5 * max(1.0, want.abs().max().item()), (case, rank, step, error)


def test_dummy_weights_load_per_shard(tp_results):
    """load_format dummy: each rank draws its shard's values; the replicated ones agree across ranks,
    so both ranks compute the same full-vocabulary logits."""
    expected, ranks = tp_results
    vocab = expected["llama_kv1_biases_odd_vocab"]["spec"].vocab_size
    for step in ("prefill", "decode", "decode_one_row"):
        a, b = ranks[0]["dummy"][step], ranks[1]["dummy"][step]
        assert a.shape[-1] == vocab and bool(torch.isfinite(a).all())
        assert torch.allclose(a, b, atol=1e-6), step


# ---- the same on two GPUs (NCCL, the Triton backend, the real fused and small-batch kernels) ------

def _gpu_rank_main(rank: int, store_port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist
    from models import build_model, load_hf_config, model_spec
    torch.cuda.set_device(rank)
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", store_port, TP + 1, is_master=False, timeout=timeout)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=TP, timeout=timeout,
                            device_id=torch.device("cuda", rank))
    try:
        set_tensor_parallel_group(rank, TP, dist.group.WORLD)
        results = {}
        for name, path in checkpoints.items():
            model = build_model(model_spec(load_hf_config(path)), path, device=torch.device("cuda", rank),
                                dtype=torch.float32)
            results[name] = _run_steps(model, True, f"cuda:{rank}")
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_logits_equal_tp1_on_two_gpus(tmp_path):
    """fp32 on GPUs: every architecture at TP=2 (NCCL) against TP=1 on one GPU, through the Triton
    attention backend (the layer writes the KV cache of its own heads) and, for the one-row decode,
    the small-batch kernels on each rank's shard with their all-reduce."""
    from models import build_model, load_hf_config, model_spec
    checkpoints, expected = {}, {}
    for name, (family, overrides) in CASES.items():
        path, _ = make_tiny_checkpoint(tmp_path / name, family, with_tokenizer=False, **overrides)
        checkpoints[name] = str(path)
        model = build_model(model_spec(load_hf_config(path)), path, device=torch.device("cuda", 0),
                            dtype=torch.float32)
        expected[name] = _run_steps(model, True, "cuda:0")
    for rank, got in enumerate(_spawn_ranks(_gpu_rank_main, checkpoints, tmp_path)):
        for name in CASES:
            for step, want in expected[name].items():
                error = (got[name][step] - want).abs().max().item()
                # TF32 is off by default for fp32 matmuls; the GEMV and cuBLAS sum in other orders.
                assert error <= 1e-4 * max(1.0, want.abs().max().item()), (name, rank, step, error)
