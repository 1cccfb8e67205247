"""What launching a jax step costs on the host: a jitted call's dispatch against its number of
array arguments, and a host-side trace of decode steps (where PJRT's launch spends its time).

    python benchmarks/probes/jax_dispatch.py --arguments     # dispatch µs at 2..200 arguments
    python benchmarks/probes/jax_dispatch.py --trace --model DIR [--batch 1] [--steps 16]

The trace keeps XLA's command buffers (CUDA graphs) on under the profiler only when the process
runs with XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true (they are off otherwise,
which times another program); CUPTI inflates the graph launch itself. Figures are inclusive
microseconds per step of each host event, busiest first.
"""

from __future__ import annotations

import argparse
import glob
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import start_decoding  # noqa: E402


def dispatch_us(arguments, repeats: int = 200) -> float:
    """Median µs until a jitted call of `arguments` returns (not waiting for the device)."""
    import jax

    def first_two(tree):
        a, b = jax.tree.leaves(tree)[:2]
        return a + b

    call = jax.jit(first_two).lower(arguments).compile()
    for _ in range(20):
        jax.block_until_ready(call(arguments))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = call(arguments)
        seconds.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return 1e6 * statistics.median(seconds)


def argument_sweep() -> None:
    import jax.numpy as jnp

    for n in (2, 10, 50, 100, 200):
        arrays = [jnp.full((1024,), i, jnp.bfloat16) for i in range(n)]
        print(f"{n:4d} arrays as a list: dispatch {dispatch_us(arrays):7.1f} us", flush=True)
    arrays = {f"w{i}": jnp.full((1024,), i, jnp.bfloat16) for i in range(200)}
    print(f" 200 arrays as a dict: dispatch {dispatch_us(arrays):7.1f} us")


def host_trace(model: str, batch: int, steps: int, top: int = 40) -> None:
    import jax
    from jax.profiler import ProfileData

    from pagedjax import LLM

    llm = LLM(model, backend="jax", max_model_len=1024, max_num_seqs=max(batch, 16),
              enable_prefix_caching=False)
    start_decoding(llm, batch, 512, max_tokens=400, seed=0)
    for _ in range(10):
        llm.engine.step()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # C++ events only: the Python tracer slows every call
    options.host_tracer_level = 3
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, profiler_options=options):
            for _ in range(steps):
                llm.engine.step()
        path = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0]
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                for event in line.events:
                    key = (line.name[:24], re.sub(r"([._]\d+)+$", "", event.name)[:90])
                    count, ns = totals.get(key, (0, 0))
                    totals[key] = (count + 1, ns + event.duration_ns)
    llm.shutdown()
    for (thread, name), (count, ns) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{ns / 1e3 / steps:9.1f} us/step {count / steps:6.1f} calls  {thread} | {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arguments", action="store_true", help="the argument-count sweep")
    parser.add_argument("--trace", action="store_true", help="a host trace of decode steps")
    parser.add_argument("--model", help="HF checkpoint dir (default: the demo target)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    if args.arguments or not args.trace:
        argument_sweep()
    if args.trace:
        from pagedjax.model_loader.demo import demo_model_dirs

        host_trace(args.model or demo_model_dirs()[0], args.batch, args.steps)


if __name__ == "__main__":
    main()
