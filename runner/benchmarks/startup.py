"""Start-up: process start to first token (and to N tokens), engine vs HF transformers, side by side.

    graphrunner bench startup [--model default] [--tokens 1 8] [--repeats 3] [--threads N] [--gpu-tokenizer DIR]
                              [--gpu-shapes llama-3.2-1b qwen3-0.6b] [--gpu-warm-runs 2]
                              [--gpu-against NAME=VALUE] [--no-cpu] [--smoke] [--out DIR]

CPU, each in a fresh subprocess, alternating (engine, HF, engine, HF, ...) `--repeats` times per
token count: (a) `graphrunner generate --model PATH --chat --max-tokens N` (`python -m runner.cli`,
what the console script runs) and (b) a script that imports transformers, loads the same
checkpoint folder (`AutoModelForCausalLM.from_pretrained(dtype=float32)` and its tokenizer),
applies the chat template and runs greedy `generate(max_new_tokens=N)`. Both print their text;
the figure is the child's wall time from spawn to exit (interpreter start, imports, load, warm-up,
generation, exit: what a user waits for) and its peak resident memory (`ru_maxrss` from
`os.wait4`). With `--tokens 1` the time is the time to first token. Medians are reported, with
the ratios engine / HF (below 1: the engine is faster / lighter). Both sides use the same torch
thread count (`--threads`, else torch's default), float32, greedy, and both stop at the model's
EOS or after N tokens (the same greedy text: the same work; both texts are printed).

GPU (when torch sees one, and `--gpu-shapes` is not empty): `LLM(model=<shape folder>,
load_format="dummy")` to ready, in a fresh subprocess, for each shape of
runner/benchmarks/model_shapes.py: once with every cache folder empty (KernelConfig.cache_dir, where
Triton's and the native builds' caches live, set to a new temporary folder) and then
`--gpu-warm-runs` times (2) with the caches that run filled (warm), after one untimed run that
fills Python's bytecode cache (see `gpu_rows`). `--gpu-against NAME=VALUE` runs each of these
again with that environment variable set, alternating with the default, and prints the medians of
each setting: a switch's effect measured on one host at one time, where hosts differ by more than
most start-up changes. `--no-cpu` leaves the CPU comparison out (a GPU machine without the
embedded checkpoint). The seconds printed come from the child's own clock
around `LLM(...)` plus the engine's start-up breakdown (load, profile, KV cache, compile, capture).
With `--gpu-tokenizer DIR` each shape folder also holds that tokenizer's files, so `LLM(...)`
loads a tokenizer as it does for a user's checkpoint.

`--smoke`: a tiny random Llama (SmolLM2's tokenizer and vocabulary, 2 layers of width 64) written
into the output folder (or a temporary one), `--tokens 1`, one repeat: the whole path in seconds,
for tests. Raw results: `--out DIR/startup.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runner.benchmarks.results import add_out_argument, write_json

PROMPT = "What is the capital of France?"

HF_SCRIPT = r"""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, tokens, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if threads:
    torch.set_num_threads(threads)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
with torch.inference_mode():
    out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, temperature=None, top_p=None, top_k=None)
new = out[0, inputs["input_ids"].shape[1]:]
print(f"text: {tokenizer.decode(new, skip_special_tokens=True)!r} ({len(new)} tokens)")
"""

GPU_SCRIPT = r"""
import json, sys, time
started = time.perf_counter()
from runner import LLM
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], load_format="dummy", max_model_len=2048, cache_dir=sys.argv[2])
ready = time.perf_counter()
print("RESULT " + json.dumps({"import_s": imported - started, "llm_to_ready_s": ready - imported,
                              "breakdown": llm.engine.start_up_seconds}))
"""


def run_child(argv: list[str], timeout: float = 900, env: dict | None = None) -> dict:
    """Run `argv` to its end; its wall seconds from spawn to exit, peak RSS (MiB, its ru_maxrss) and output."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                pid, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.01)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read()
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed with exit status {child.returncode}:\n{output[-3000:]}")
    return {"seconds": round(seconds, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "output": output.strip()}


def engine_argv(path: str, tokens: int, threads: int | None) -> list[str]:
    argv = [sys.executable, "-m", "runner.cli", "generate", "--model", path, "--chat", "--prompt", PROMPT,
            "--max-tokens", str(tokens), "--device", "cpu"]
    return argv + (["--threads", str(threads)] if threads else [])


def hf_argv(path: str, tokens: int, threads: int | None) -> list[str]:
    return [sys.executable, "-c", HF_SCRIPT, path, str(tokens), str(threads or 0), PROMPT]


def _text(output: str, engine: bool) -> str:
    """The generated text from a child's output (for the side-by-side check that both said the same)."""
    lines = output.splitlines()
    if engine:
        start = next((i for i, line in enumerate(lines) if line.startswith("### ")), None)
        return lines[start + 1] if start is not None and start + 1 < len(lines) else ""
    return next((line for line in lines if line.startswith("text: ")), "")


def cpu_rows(path: str, token_counts: list[int], repeats: int, threads: int | None) -> list[dict]:
    rows = []
    for tokens in token_counts:
        engine_runs, hf_runs = [], []
        for _ in range(repeats):
            engine_runs.append(run_child(engine_argv(path, tokens, threads)))
            hf_runs.append(run_child(hf_argv(path, tokens, threads)))
        engine_s = statistics.median(r["seconds"] for r in engine_runs)
        hf_s = statistics.median(r["seconds"] for r in hf_runs)
        engine_rss = statistics.median(r["peak_rss_mib"] for r in engine_runs)
        hf_rss = statistics.median(r["peak_rss_mib"] for r in hf_runs)
        rows.append({"tokens": tokens, "engine_s": engine_s, "hf_s": hf_s, "time_ratio": round(engine_s / hf_s, 3),
                     "engine_peak_rss_mib": engine_rss, "hf_peak_rss_mib": hf_rss,
                     "rss_ratio": round(engine_rss / hf_rss, 3),
                     "engine_text": _text(engine_runs[-1]["output"], True), "hf_text": _text(hf_runs[-1]["output"], False),
                     "engine_runs": [{k: r[k] for k in ("seconds", "peak_rss_mib")} for r in engine_runs],
                     "hf_runs": [{k: r[k] for k in ("seconds", "peak_rss_mib")} for r in hf_runs]})
    return rows


def gpu_rows(shapes: list[str], folder: Path, tokenizer: str | None = None, warm_runs: int = 2,
             against: str | None = None) -> list[dict]:
    """Each shape (with `tokenizer`'s files copied in, as a user's checkpoint has them, where
    given): an untimed run first (its own throwaway kernel cache) so that Python's bytecode
    cache holds every module the start-up imports, as in an installed environment: children write
    their bytecode under one PYTHONPYCACHEPREFIX (where site-packages has no bytecode and is read-only,
    every process would otherwise compile the sources of torch and transformers again, seconds of
    every row). Then the rows: empty kernel caches, then `warm_runs` warm ones.

    `against` ("NAME=VALUE", an environment variable such as GRAPHRUNNER_GEMM_WARM_UP=0): every row
    also runs with that variable set, in its own cache folder, the two settings alternating (the
    warm runs in the order AB, BA, AB, ...), so that a change behind a switch is measured against
    its absence on one host at one time."""
    from runner.benchmarks.model_shapes import write_config
    rows = []
    env = dict(os.environ)
    env.setdefault("PYTHONPYCACHEPREFIX", str(folder / "pycache"))
    settings = [("default", env)]
    if against:
        name, _, value = against.partition("=")
        settings.append((against, {**env, name: value}))
    for shape in shapes:
        path = write_config(shape, folder / shape)
        if tokenizer:
            copy_tokenizer(Path(tokenizer), path)
        with tempfile.TemporaryDirectory(prefix="graphrunner-bytecode-") as throwaway:
            run_child([sys.executable, "-c", GPU_SCRIPT, str(path), throwaway], env=env)
        caches = [tempfile.mkdtemp(prefix="graphrunner-cold-") for _ in settings]
        try:
            order = [("empty caches", i) for i in range(len(settings))]
            for run in range(warm_runs):
                order += [("warm caches", i) for i in (range(len(settings)) if run % 2 == 0 else
                                                      reversed(range(len(settings))))]
            for label, i in order:
                result = run_child([sys.executable, "-c", GPU_SCRIPT, str(path), caches[i]], env=settings[i][1])
                line = next(line for line in result["output"].splitlines() if line.startswith("RESULT "))
                rows.append({"shape": shape, "caches": label, "setting": settings[i][0],
                             **json.loads(line[len("RESULT "):]),
                             "process_s": result["seconds"], "peak_rss_mib": result["peak_rss_mib"]})
        finally:
            for cache in caches:
                shutil.rmtree(cache, ignore_errors=True)
    return rows


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_tokenizer(source: Path, folder: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (folder / name).write_bytes((source / name).read_bytes())


def write_smoke_checkpoint(folder: Path, tokenizer_from: str) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (its vocabulary size), saved by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(Path(tokenizer_from), folder)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def print_cpu(rows: list[dict]) -> None:
    print("| tokens | graphrunner generate s | HF s | time ratio | graphrunner peak RSS MiB | HF peak RSS MiB | "
          "RSS ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['engine_s']:.2f} | {r['hf_s']:.2f} | {r['time_ratio']:.2f} | "
              f"{r['engine_peak_rss_mib']:.0f} | {r['hf_peak_rss_mib']:.0f} | {r['rss_ratio']:.2f} |")
    for r in rows:
        print(f"{r['tokens']} tokens: graphrunner {r['engine_text']!r}; HF {r['hf_text']!r}")


def print_gpu(rows: list[dict]) -> None:
    """One line per start-up, then (with several of a kind) the median of each (shape, caches, setting)."""
    header = "| shape | caches | setting | LLM(...) to ready s | load | profile | KV cache | compile | capture | process s |"
    print(header)
    print("|---|---|---|" + "---:|" * 7)

    def line(r: dict, label: str) -> str:
        b = r["breakdown"]
        return (f"| {r['shape']} | {r['caches']} | {label} | {r['llm_to_ready_s']:.2f} | {b.get('load', 0):.2f} | "
                f"{b.get('profile', 0):.2f} | {b.get('kv_cache', 0):.2f} | {b.get('compile', 0):.2f} | "
                f"{b.get('capture', 0):.2f} | {r['process_s']:.1f} |")
    for r in rows:
        print(line(r, r["setting"]))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["caches"], r["setting"]), []).append(r)
    if all(len(group) == 1 for group in groups.values()):
        return
    print("\nMedians:")
    print(header)
    print("|---|---|---|" + "---:|" * 7)
    for group in groups.values():
        median = {"shape": group[0]["shape"], "caches": group[0]["caches"],
                  "llm_to_ready_s": statistics.median(r["llm_to_ready_s"] for r in group),
                  "process_s": statistics.median(r["process_s"] for r in group),
                  "breakdown": {k: statistics.median(r["breakdown"].get(k, 0) for r in group)
                                for k in ("load", "profile", "kv_cache", "compile", "capture")}}
        print(line(median, f"{group[0]['setting']} (median of {len(group)})"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint folder, or 'default' (the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="token counts to time (1: first token)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per token count (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument("--gpu-shapes", nargs="*", default=["llama-3.2-1b", "qwen3-0.6b"],
                        help="model shapes timed LLM(...) to ready on a GPU (none: skip)")
    parser.add_argument("--gpu-tokenizer", metavar="DIR",
                        help="a tokenizer folder copied into each GPU shape's folder, so LLM(...) loads it too")
    parser.add_argument("--gpu-warm-runs", type=int, default=2, help="warm-cache start-ups of each shape (and setting)")
    parser.add_argument("--gpu-against", metavar="NAME=VALUE",
                        help="also run every GPU start-up with this environment variable set, alternating with "
                             "the default (e.g. GRAPHRUNNER_GEMM_WARM_UP=0: the tree against its switch off)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU comparison with HF (GPU rows only)")
    parser.add_argument("--smoke", action="store_true", help="tiny random checkpoint, 1 token, 1 repeat (tests)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="graphrunner-startup-") as scratch:
        rows = []
        if not args.no_cpu:
            from models.embedded import ensure_smollm2
            path = str(ensure_smollm2()) if args.model == "default" else args.model
            if args.smoke:
                path = str(write_smoke_checkpoint(Path(scratch) / "tiny-llama", path))
                args.tokens, args.repeats, args.gpu_shapes = [1], 1, []
            rows = cpu_rows(path, args.tokens, args.repeats, args.threads)
            print_cpu(rows)
        result = {"model": args.model, "smoke": args.smoke, "threads": args.threads, "repeats": args.repeats,
                  "cpu": rows, "cpus": os.cpu_count()}
        import torch
        if torch.cuda.is_available() and args.gpu_shapes:
            if args.gpu_against and "=" not in args.gpu_against:
                parser.error(f"--gpu-against takes NAME=VALUE, got {args.gpu_against!r}")
            result["gpu"] = gpu_rows(args.gpu_shapes, Path(scratch), args.gpu_tokenizer, args.gpu_warm_runs,
                                     args.gpu_against)
            print_gpu(result["gpu"])
    write_json(args.out, "startup.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
