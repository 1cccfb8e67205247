"""A varied workload as users send it, timed from the moment `LLM(...)` returns: jax beside
torch, plain and speculative, with the compiles each meets after startup.

Requests arrive in groups while others run (the engine steps between arrivals). Prompts run
from 1 token to what max_model_len leaves, a third of them behind a shared 48-token system
prefix (prefix-cache hits); n = 1-2; greedy and sampled rows (temperature, top-k, top-p, min-p,
seeds); logprobs, prompt_logprobs, penalties, logit_bias and min_tokens on some; every fifth
request constrained (structured outputs: a choice or a regex; `structured=False` leaves them
out, for a model without a tokenizer). Each LLM
reports its startup (cold: nothing cached; then warm: a second process with the persistent
cache), its wall time on the workload, and its compiles after startup (JAX's backend compiles,
counted with jax.monitoring; CUDA graph captures for torch).

    python benchmarks/varied_workload.py [--backends jax torch] [--requests 40]
                                         [--speculative both|on|off] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_out_argument, environment, print_table, write_json  # noqa: E402

SYSTEM_PREFIX = 48  # tokens (three blocks of 16): a third of the prompts share it
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@dataclass(frozen=True)
class Request:
    arrival: int  # engine steps after the first request before it is added
    prompt: list[int]
    params: dict  # SamplingParams keywords


# Every fifth request's constraint, in turn (StructuredOutputsParams keywords).
STRUCTURED = ({"choice": ["yes", "no", "maybe not"]}, {"regex": "[0-9]{1,6}(-[a-z]{1,3})?"})


def varied_workload(vocab_size: int, max_model_len: int, num_requests: int, *,
                    max_tokens: int = 16, seed: int = 0, structured: bool = True
                    ) -> list[Request]:
    """num_requests requests in groups of 4, a group every 3 steps (see the module docstring)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, vocab_size, SYSTEM_PREFIX).tolist()
    longest = max_model_len - max_tokens
    lengths = [1, longest] + rng.integers(1, longest + 1, num_requests - 2).tolist()
    requests = []
    for i, length in enumerate(lengths):
        prompt = rng.integers(1, vocab_size, length).tolist()
        if i % 3 == 2 and length > SYSTEM_PREFIX:
            prompt[:SYSTEM_PREFIX] = prefix
        params = dict(n=int(rng.integers(1, 3)), max_tokens=int(rng.integers(1, max_tokens + 1)),
                      ignore_eos=True, seed=i)
        if rng.random() < 0.5:  # sampled, with some of the filters
            params.update(temperature=float(rng.choice([0.6, 1.0])),
                          top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([0, 20])),
                          min_p=float(rng.choice([0.0, 0.05])))
        else:
            params.update(temperature=0.0)
        if rng.random() < 0.25:
            params["logprobs"] = int(rng.choice([0, 3]))
        if rng.random() < 0.15:
            params["prompt_logprobs"] = 1
        if rng.random() < 0.2:
            params.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        if rng.random() < 0.15:
            params["logit_bias"] = {int(t): 2.0 for t in rng.integers(0, vocab_size, 3)}
        if rng.random() < 0.1:
            params["min_tokens"] = min(2, params["max_tokens"])
        if structured and i % 5 == 4:
            params["structured_outputs"] = STRUCTURED[i // 5 % len(STRUCTURED)]
            params.update(min_tokens=0, max_tokens=max(params["max_tokens"], 8))
        requests.append(Request(3 * (i // 4), prompt, params))
    return requests


def run_workload(llm, requests: list[Request]) -> dict:
    """Drive llm's engine through the requests as they arrive; the outputs' token ids."""
    from pagedjax import SamplingParams, StructuredOutputsParams

    engine, pending, outputs, step = llm.engine, list(enumerate(requests)), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival <= step:
            i, request = pending.pop(0)
            params = dict(request.params)
            if "structured_outputs" in params:
                params["structured_outputs"] = StructuredOutputsParams(
                    **params["structured_outputs"])
            engine.add_request(str(i), {"prompt_token_ids": request.prompt},
                               SamplingParams(**params))
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = [c.token_ids for c in output.outputs]
        step += 1
    return outputs


def measure(backend: str, speculative: bool, num_requests: int) -> dict:
    """One LLM on the demo target (with the demo draft): its startup, its wall time on the
    workload, and what compiled after startup. Runs in a process of its own."""
    import jax.monitoring

    from pagedjax import LLM
    from pagedjax.config import ModelConfig
    from pagedjax.model_loader.demo import demo_model_dirs

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **_: compiles.append(seconds) if name == BACKEND_COMPILE else None)
    target, draft = demo_model_dirs()
    spec = {"model": draft, "num_speculative_tokens": 4} if speculative else None
    start = time.perf_counter()
    llm = LLM(target, backend=backend, speculative_config=spec)
    startup = time.perf_counter() - start
    startup_compiles = len(compiles)
    config = ModelConfig.from_pretrained(target)
    requests = varied_workload(config.vocab_size, llm.engine.config.max_model_len, num_requests,
                               max_tokens=32)
    start = time.perf_counter()
    outputs = run_workload(llm, requests)
    seconds = time.perf_counter() - start
    metrics = llm.get_metrics()
    return {"backend": backend, "speculative": speculative, "startup_s": startup,
            "workload_s": seconds, "requests": len(outputs),
            "output_tokens": sum(len(t) for ts in outputs.values() for t in ts),
            "startup_compiles": startup_compiles,
            "compiles_after_startup": len(compiles) - startup_compiles,
            "compile_seconds_after_startup": sum(compiles[startup_compiles:]),
            "num_compiles_after_startup": metrics["num_compiles_after_startup"],
            "compile_cache_hits": metrics["compile_cache_hits"],
            "spec_decode_steps_per_k": metrics.get("spec_decode_steps_per_k")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--speculative", choices=("both", "on", "off"), default="both")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # backend,speculative: this process
    add_out_argument(parser)
    args = parser.parse_args()
    if args.one:
        backend, speculative = args.one.split(",")
        print(json.dumps(measure(backend, speculative == "1", args.requests)))
        return
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.speculative]
    rows = []
    with tempfile.TemporaryDirectory() as cache:  # cold, then warm: one fresh cache per run
        env = dict(os.environ, PAGEDJAX_CACHE_DIR=cache)
        for speculative in modes:
            for backend in args.backends:
                for start in ("cold", "warm"):
                    done = subprocess.run(
                        [sys.executable, __file__, "--one", f"{backend},{int(speculative)}",
                         "--requests", str(args.requests)], env=env, capture_output=True,
                        text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append({**row, "start": start})
    for speculative in modes:  # jax's time over torch's, each warm
        warm = {r["backend"]: r for r in rows
                if r["start"] == "warm" and r["speculative"] == speculative}
        if {"jax", "torch"} <= warm.keys():
            for r in rows:
                if r["speculative"] == speculative:
                    r["x torch"] = r["workload_s"] / warm["torch"]["workload_s"]
    print_table(rows, ["backend", "speculative", "start", "startup_s", "workload_s", "x torch",
                       "compiles_after_startup", "compile_cache_hits"])
    path = write_json("varied_workload_cpu.json", {"environment": environment(),
                                                   "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
