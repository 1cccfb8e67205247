"""The CPU linear layers side by side: pagedjax's packed C++ kernel against the libraries.

Each linear of a decoder layer (q/k/v and gate/up fused, as the engine packs them), plus the LM
head, at M = 1, 4, 16, 64, 256 rows (--rows), float32, on the demo target's and
SmolLM2-135M's shapes:

- torch: our `torch.ops.pagedjax.linear` over packed weights; `torch.nn.functional.linear`
  (MKL's sgemm in torch's CPU build); oneDNN's prepacked path
  (`torch.ops.mkldnn._linear_pointwise` over `_reorder_linear_weight`);
- jax: our kernel through XLA's FFI (`cpu_ffi.linear`); XLA's own dot (`jnp.dot`, jitted).

Each product reads the next of as many copies of the weight as the model has layers (two of the
LM head), so the weights come from wherever a forward finds them (SmolLM2's 30 layers do not fit
in the L3 cache; the demo target's 8 may). torch calls each product from Python, as its eager
step does; jax runs the products over all copies in one jitted call, as its compiled step does.
Each framework runs in a process of its own (`--framework`); without it this script runs both
and writes one table and `cpu_linear.json`. Times are medians over --repeats groups of calls.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_out_argument, environment, median_seconds, print_table, write_json  # noqa: E402

ROWS = (1, 4, 16, 64, 256)
# model -> (hidden, intermediate, q heads, kv heads, head_dim, vocab, layers)
MODELS = {"demo-target": (256, 1024, 8, 4, 32, 4096, 8),
          "smollm2-135m": (576, 1536, 9, 3, 64, 49152, 30)}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of each linear the engine runs per layer, and the LM head."""
    hidden, inter, hq, hkv, d, vocab, _ = MODELS[model]
    return {"qkv": (hidden, (hq + 2 * hkv) * d), "o": (hq * d, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden), "lm_head": (hidden, vocab)}


def cycled(make: Callable[[int], Callable], copies: int) -> Callable:
    """A call that runs make(i)'s function for i = 0, 1, ... copies - 1, 0, ... in turn."""
    runs = [make(i) for i in range(copies)]
    state = [0]

    def run():
        state[0] = (state[0] + 1) % copies
        return runs[state[0]]()

    return run


def torch_candidates(weights: list[np.ndarray], m: int) -> dict:
    import torch

    from pagedjax.kernels_cuda import ops

    assert ops.ops_backend() == "cpp", "the C++ ops did not build"
    fan_in, out = weights[0].shape
    x = torch.randn(m, fan_in)
    weight_t = [torch.from_numpy(w).T.contiguous() for w in weights]  # [out, in]: F.linear's
    packed = [ops.pack_linear_weight(torch.from_numpy(w)) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weight_t]
    n = len(weights)
    return {
        "pagedjax": cycled(lambda i: lambda: torch.ops.pagedjax.linear(x, packed[i], None, out),
                           n),
        "torch F.linear": cycled(lambda i: lambda: torch.nn.functional.linear(x, weight_t[i]),
                                 n),
        "oneDNN prepacked": cycled(lambda i: lambda: torch.ops.mkldnn._linear_pointwise(
            x, onednn[i], None, "none", [], ""), n),
    }


def jax_candidates(weights: list[np.ndarray], m: int) -> dict:
    """Each candidate runs the product against every copy in one jitted call (as a model's
    step does: no dispatch per product); measure() divides by the number of copies."""
    import jax
    import jax.numpy as jnp

    from pagedjax.backends.jax import cpu_ffi

    assert cpu_ffi.available(), "the FFI library did not build"
    fan_in, out = weights[0].shape
    dense = [jnp.asarray(w) for w in weights]
    packed = [cpu_ffi.pack_linear_weight(w) for w in dense]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((m, fan_in), np.float32))
    ours = jax.jit(lambda x, ws: [cpu_ffi.linear(x, w, out) for w in ws])
    xla = jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws])
    return {"pagedjax (FFI)": lambda: ours(x, packed), "XLA dot": lambda: xla(x, dense)}


def measure(framework: str, repeats: int, row_counts: list[int]) -> list[dict]:
    candidates = torch_candidates if framework == "torch" else jax_candidates
    if framework == "torch":
        sync = lambda out: out
    else:
        sync = lambda out: [y.block_until_ready() for y in out]
    rows = []
    rng = np.random.default_rng(0)
    for model in MODELS:
        for name, (fan_in, fan_out) in layer_shapes(model).items():
            copies = 2 if name == "lm_head" else MODELS[model][-1]
            weights = [(rng.standard_normal((fan_in, fan_out), np.float32) * 0.02)
                       .astype(np.float32) for _ in range(copies)]
            per_call = 1 if framework == "torch" else copies  # products per timed call
            for m in row_counts:
                for impl, run in candidates(weights, m).items():
                    seconds = median_seconds(run, sync, repeats) / per_call
                    rows.append({"framework": framework, "model": model, "linear": name,
                                 "M": m, "impl": impl, "us": 1e6 * seconds})
    return rows


def summarise(rows: list[dict], row_counts: list[int]) -> list[dict]:
    """Per model, M and implementation: the sum over the layer's linears (the LM head apart),
    and each library's time over ours in the same framework (> 1: ours is faster)."""
    out = []
    ours = {"torch": "pagedjax", "jax": "pagedjax (FFI)"}
    for model in MODELS:
        for m in row_counts:
            for part in ("layer", "lm_head"):
                pick = [r for r in rows if r["model"] == model and r["M"] == m
                        and (r["linear"] == "lm_head") == (part == "lm_head")]
                totals = {}
                for r in pick:
                    key = (r["framework"], r["impl"])
                    totals[key] = totals.get(key, 0.0) + r["us"]
                for (framework, impl), us in totals.items():
                    base = totals[(framework, ours[framework])]
                    out.append({"model": model, "M": m, "part": part, "framework": framework,
                                "impl": impl, "us": us, "vs ours": us / base})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "jax"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    add_out_argument(parser)
    args = parser.parse_args()
    if args.framework:
        print(json.dumps(measure(args.framework, args.repeats, args.rows)))
        return
    rows = []
    for framework in ("torch", "jax"):
        result = subprocess.run([sys.executable, __file__, "--framework", framework,
                                 "--repeats", str(args.repeats),
                                 "--rows", *map(str, args.rows)], check=True,
                                capture_output=True, text=True)
        rows += json.loads(result.stdout.strip().splitlines()[-1])
    summary = summarise(rows, args.rows)
    print_table(summary, ["model", "M", "part", "framework", "impl", "us", "vs ours"])
    path = write_json("cpu_linear.json", {"environment": environment(), "rows": rows,
                                          "summary": summary}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
