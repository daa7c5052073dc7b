"""Weight loading against the disk: load GB/s beside `cat FILES > /dev/null` GB/s for the same files.

    graphrunner bench load [--checkpoint DIR ...] [--synthetic llama-3.2-1b] [--num-layers 6]
        [--device cpu|cuda] [--repeats 3] [--out DIR]

For each checkpoint (the folders given with --checkpoint, the embedded SmolLM2 when it is built,
and one random checkpoint of a model shape written into a temporary folder, about 1.2 GB in
bfloat16 by default), it times `cat` of the checkpoint's safetensors files, then the engine's
`load_safetensors` (map, copy into freshly allocated parameters, NaN/Inf check) with the check on
(the engine default) and off; on a GPU also with plain pageable copies instead of the pinned staging
(models/weight_copy.py), on a CPU also into parameters from torch's allocator (4 KiB pages)
instead of the huge-page mapping (models/param_arena.py). Every figure is the checkpoint's bytes over the best of `--repeats`
timings, with the median beside it, plus the process CPU seconds and page faults of the best
load (on a busy machine CPU time is the steadier figure).

Both sides read from the page cache: dropping it needs root, so after one untimed `cat` the files
are cached and the comparison is warm against warm, which the output says. A cold read is
bounded by the disk for both alike.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runner.benchmarks.model_shapes import SHAPES, write_config
from runner.benchmarks.results import add_out_argument, write_json


def write_random_checkpoint(shape: str, folder: Path, dtype, **overrides) -> int:
    """A checkpoint of model shape `shape` (runner/benchmarks/model_shapes.py, `overrides` such
    as num_hidden_layers applied) with random weights in HF's tensor names, written to `folder`
    as one model.safetensors; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    from models import build_model, load_hf_config, model_spec

    write_config(shape, folder, dtype=str(dtype).removeprefix("torch."), **overrides)
    spec = model_spec(load_hf_config(folder))
    model = build_model(spec, folder, device=torch.device("cpu"), dtype=dtype, load_format="dummy")
    state = {}
    for name, param in model.named_parameters():  # unpack ours into HF's names
        parts = name.split(".")
        if parts[-2] == "qkv_proj":
            q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            for proj, (a, b) in zip(("q_proj", "k_proj", "v_proj"), ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                state[".".join(parts[:-2] + [proj, parts[-1]])] = param.data[a:b].contiguous()
        elif parts[-2] == "gate_up_proj":
            half = param.shape[0] // 2
            state[".".join(parts[:-2] + ["gate_proj", parts[-1]])] = param.data[:half].contiguous()
            state[".".join(parts[:-2] + ["up_proj", parts[-1]])] = param.data[half:].contiguous()
        elif not (name == "lm_head.weight" and spec.tie_word_embeddings):
            state[name] = param.data
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in state.values())


def _usage() -> tuple[float, float, int]:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), used.ru_utime + used.ru_stime, used.ru_minflt


def _summary(nbytes: int, runs: list[dict]) -> dict:
    best = min(runs, key=lambda run: run["seconds"])
    return {"best_s": best["seconds"], "median_s": statistics.median(run["seconds"] for run in runs),
            "best_gb_s": nbytes / best["seconds"] / 1e9,
            "median_gb_s": nbytes / statistics.median(run["seconds"] for run in runs) / 1e9,
            "cpu_s": best.get("cpu_s"), "page_faults": best.get("page_faults"), "runs": runs}


def time_cat(files: list[Path], repeats: int) -> list[dict]:
    """`cat FILES > /dev/null`, once untimed (to warm the page cache), then `repeats` times."""
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        runs.append({"seconds": time.perf_counter() - started})
    return runs


def time_load(folder: Path, device, dtype, repeats: int, check_finite: bool, pinned_staging: bool | None,
              huge_pages: bool = True) -> list[dict]:
    """models/loader.py's load_safetensors into freshly allocated parameters (allocate_model, not
    timed: it is the same with or without a checkpoint), `repeats` times, each model freed before
    the next."""
    import torch

    from models import load_hf_config, model_spec
    from models.loader import allocate_model, load_safetensors
    spec = model_spec(load_hf_config(folder))
    runs = []
    for _ in range(repeats):
        model = allocate_model(spec, device=device, dtype=dtype, huge_pages=huge_pages)
        wall, cpu, faults = _usage()
        load_safetensors(model, folder, check_finite=check_finite, pinned_staging=pinned_staging)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall2, cpu2, faults2 = _usage()
        runs.append({"seconds": wall2 - wall, "cpu_s": cpu2 - cpu, "page_faults": faults2 - faults})
        del model
    return runs


def checkpoint_dtype(folder: Path):
    """The dtype most of the checkpoint's bytes are stored in (the load then converts nothing)."""
    from models.loader import checkpoint_tensor_files
    from models.safetensors_file import TORCH_DTYPES, read_safetensors_header
    by_dtype: dict[str, int] = {}
    for file in set(checkpoint_tensor_files(folder).values()):
        for info in read_safetensors_header(file).values():
            begin, end = info["data_offsets"]
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + end - begin
    return TORCH_DTYPES[max(by_dtype, key=by_dtype.get)]


def measure(folder: Path, device, repeats: int) -> dict:
    """cat and load figures for one checkpoint folder."""
    files = sorted(folder.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    dtype = checkpoint_dtype(folder)
    result = {"checkpoint": str(folder), "files": len(files), "bytes": nbytes,
              "dtype": str(dtype).removeprefix("torch."), "device": str(device),
              "cat": _summary(nbytes, time_cat(files, repeats))}
    variants = {"load": (True, None, True), "load_unchecked": (False, None, True)}
    if device.type == "cuda":
        variants["load_pageable"] = (True, False, True)
    else:
        variants["load_small_pages"] = (True, None, False)
    for key, (check, staging, huge_pages) in variants.items():
        result[key] = _summary(nbytes, time_load(folder, device, dtype, repeats, check, staging, huge_pages))
        result[key]["fraction_of_cat"] = result[key]["best_gb_s"] / result["cat"]["best_gb_s"]
    return result


def report(result: dict) -> str:
    cat = result["cat"]
    lines = [f"{result['checkpoint']} ({result['files']} file(s), {result['bytes'] / 1e9:.3f} GB, {result['dtype']}) "
             f"-> {result['device']}, warm page cache (dropping it needs root):",
             f"  cat > /dev/null         {cat['best_gb_s']:7.2f} GB/s (median {cat['median_gb_s']:.2f})"]
    names = {"load": "load (engine, checked)", "load_unchecked": "load, no NaN/Inf check",
             "load_pageable": "load, pageable copies", "load_small_pages": "load, 4 KiB pages"}
    for key, name in names.items():
        if key in result:
            run = result[key]
            lines.append(f"  {name:<23} {run['best_gb_s']:7.2f} GB/s (median {run['median_gb_s']:.2f}) = "
                         f"{100 * run['fraction_of_cat']:.0f}% of cat; best {run['best_s']:.3f} s, "
                         f"{run['cpu_s']:.3f} CPU s, {run['page_faults']} page faults")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, action="append", default=[],
                        help="a checkpoint folder to measure (repeatable); the embedded SmolLM2 is added when built")
    parser.add_argument("--no-embedded", action="store_true", help="leave the embedded SmolLM2 out")
    parser.add_argument("--synthetic", choices=sorted(SHAPES) + ["none"], default="llama-3.2-1b",
                        help="model shape of the random checkpoint written to a temporary folder ('none': skip)")
    parser.add_argument("--num-layers", type=int, default=6,
                        help="its layer count (default 6: about 1.2 GB for llama-3.2-1b in bfloat16)")
    parser.add_argument("--synthetic-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    import torch

    from configs.env import default_home
    from models.embedded import SMOLLM2_DIRNAME

    device = torch.device(args.device)
    folders = list(args.checkpoint)
    embedded = Path(default_home()).expanduser() / SMOLLM2_DIRNAME
    if not args.no_embedded and (embedded / "model.safetensors").is_file():
        folders.append(embedded)
    results = []
    work = Path(tempfile.mkdtemp(prefix="graphrunner-bench-load-"))
    try:
        if args.synthetic != "none":
            synthetic = work / args.synthetic
            write_random_checkpoint(args.synthetic, synthetic, getattr(torch, args.synthetic_dtype),
                                    num_hidden_layers=args.num_layers)
            folders.append(synthetic)
        if not folders:
            parser.error("nothing to measure: give --checkpoint DIR or a --synthetic shape")
        for folder in folders:
            result = measure(folder, device, args.repeats)
            print(report(result), flush=True)
            results.append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, "load.json", {"results": results, "torch": torch.__version__,
                                       "torch_threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
