"""Online serving: `pagedjax serve` on the demo target, loaded by `pagedjax bench serve` at several
concurrencies (TTFT, TPOT, ITL, E2E percentiles and throughput, vLLM's definitions).

Starts the server as a subprocess on 127.0.0.1 (its startup, compiles included, is reported),
runs one benchmark per concurrency with no warm-up request (the server compiled its step shapes
before it answered /health), stops it; reports the compiles the server met while serving.

    python benchmarks/serving.py [--backend torch|jax] [--concurrency 1 8 32]
                                 [--input-len 64] [--output-len 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_out_argument, environment, print_table, write_json  # noqa: E402

from pagedjax.benchmarks.serve import add_cli_args as add_bench_serve_args  # noqa: E402
from pagedjax.benchmarks.serve import main as bench_serve  # noqa: E402
from pagedjax.model_loader.demo import demo_model_dirs  # noqa: E402


def start_server(backend: str, port: int, log_path: Path) -> tuple[subprocess.Popen, float]:
    """The server process, and the seconds until it answered /health."""
    command = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", demo_model_dirs()[0],
               "--backend", backend, "--port", str(port), "--uvicorn-log-level", "warning"]
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as response:
                if response.status == 200:
                    return process, time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server did not start; see {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="torch", choices=("torch", "jax"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    add_out_argument(parser)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / f"serving_{args.backend}_cpu.log"
    process, startup = start_server(args.backend, port, log_path)
    runs = []
    try:
        for concurrency in args.concurrency:
            bench = add_bench_serve_args(argparse.ArgumentParser()).parse_args([
                "--url", f"http://127.0.0.1:{port}", "--max-concurrency", str(concurrency),
                "--num-prompts", str(max(16, 4 * concurrency)),
                "--num-warmups", "0", "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--ignore-eos"])
            load = os.getloadavg()[0]
            runs.append({**bench_serve(bench), "load_average_1min_before": load})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
            compiles = [line for line in response.read().decode().splitlines()
                        if line.startswith("pagedjax:compiles_after_startup_total")]
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    rows = [{"concurrency": r["max_concurrency"], "requests": r["completed"],
             "out tok/s": r["output_throughput"], "req/s": r["request_throughput"],
             "TTFT p50": r["median_ttft_ms"], "TTFT p99": r["p99_ttft_ms"],
             "TPOT p50": r["median_tpot_ms"], "TPOT p99": r["p99_tpot_ms"],
             "ITL p50": r["median_itl_ms"], "ITL p99": r["p99_itl_ms"],
             "E2E p50": r["median_e2el_ms"], "E2E p99": r["p99_e2el_ms"]} for r in runs]
    print_table(rows, list(rows[0]))
    print(f"server startup {startup:.1f} s; {compiles[0] if compiles else 'no compile count'}")
    path = write_json(f"serving_{args.backend}_cpu.json",
                      {"environment": environment(), "backend": args.backend,
                       "model": "demo target", "startup_s": startup,
                       "compiles_after_startup": compiles, "runs": runs}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
