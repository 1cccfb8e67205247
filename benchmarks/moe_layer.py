"""A mixture of experts' expert block alone, per form (kernel choice) and framework: time, bytes of
the chosen experts' weights per second, working memory, and agreement with the other forms.

On a GPU at Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2048, experts 768 wide, bf16) for
1, 8, 64 and 512 tokens; on a CPU a toy shape in float32 (a smoke test, not a measurement). The
forms are the backends' own (`routed_experts` in backends/{jax,torch}/moe.py): "gathered" (the
chosen experts' weights gathered per (token, expert) pair and multiplied as a batch; the model's
choice when pairs <= experts), "grouped" (pairs sorted by expert: jax.lax.ragged_dot, torch's
grouped_mm), and torch's "loop" (a product per expert). Routes are drawn uniformly at random;
the router (the same for every form) is not timed. Working memory: jax, the compiled function's
XLA temp bytes; torch, the peak allocated during a call beyond its inputs.

Each framework runs in its own process: without --framework this runs `--framework jax`, then
`--framework torch`, as children.

    python benchmarks/moe_layer.py [--framework jax|torch] [--tokens 1 8 64 512] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_out_argument,
    environment,
    median_seconds,
    print_table,
    write_json,
)

FRAMEWORKS = ("jax", "torch")
GATHER_LIMIT_BYTES = 4e9  # the gathered form copies T * k experts' weights: not past this


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    dtype: str


GPU_SHAPE = Shape(128, 8, 2048, 768, "bfloat16")  # Qwen3-30B-A3B's
CPU_SHAPE = Shape(8, 2, 64, 32, "float32")
GPU_TOKENS, CPU_TOKENS = (1, 8, 64, 512), (1, 3, 16)


def routes(tokens: int, shape: Shape, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs as numpy: x [T, H], weights [T, k] (summing to 1), experts [T, k] (distinct)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, shape.hidden), dtype=np.float32)
    experts = np.stack([rng.choice(shape.experts, shape.top_k, replace=False)
                        for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, shape.top_k)).astype(np.float32)
    return x, weights / weights.sum(-1, keepdims=True), experts


def expert_weights(shape: Shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """gate_up [E, 2I, H] and down [E, H, I] (the checkpoint's layout), float32."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(shape.hidden)
    gate_up = rng.standard_normal((shape.experts, 2 * shape.inter, shape.hidden),
                                  dtype=np.float32) * scale
    down = rng.standard_normal((shape.experts, shape.hidden, shape.inter),
                               dtype=np.float32) * scale
    return gate_up, down


# --- the frameworks: forms(shape, weights) → {form: prepare(x, w, ids) → (run, sync, bytes)} ---


def jax_forms(shape: Shape, gate_up: np.ndarray, down: np.ndarray) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp

    from pagedjax.backends.jax.moe import EXPERT_FORMS, routed_experts

    dtype = jnp.dtype(shape.dtype)
    gate, up = np.split(gate_up.transpose(0, 2, 1), 2, axis=-1)  # [E, H, I] each
    params = [jnp.asarray(a, dtype) for a in (gate, up, down.transpose(0, 2, 1))]
    device = jax.devices()[0]

    def prepare(form: str) -> Callable:
        fn = jax.jit(lambda x, w, ids, *p: routed_experts(x, w, ids, *p, hidden_act="silu",
                                                          form=form))

        def ready(x, w, ids):
            args = (jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(ids), *params)
            compiled = fn.lower(*args).compile()
            memory = compiled.memory_analysis()
            work = getattr(memory, "temp_size_in_bytes", None) if memory else None
            return (lambda: compiled(*args)), jax.block_until_ready, work
        return ready

    info = dict(name=device.device_kind, platform=jax.default_backend(),
                tokamax=_importable("tokamax"))
    return {form: prepare(form) for form in EXPERT_FORMS}, info


def torch_forms(shape: Shape, gate_up: np.ndarray, down: np.ndarray) -> tuple[dict, dict]:
    import torch

    from pagedjax.backends.torch.moe import EXPERT_FORMS, routed_experts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, shape.dtype)
    params = [torch.from_numpy(a).to(device, dtype) for a in (gate_up, down)]

    def sync(out):
        if out.is_cuda:
            torch.cuda.synchronize()
        return out

    def prepare(form: str) -> Callable:
        def ready(x, w, ids):
            args = (torch.from_numpy(x).to(device, dtype), torch.from_numpy(w).to(device),
                    torch.from_numpy(ids).to(device, torch.int64), *params)

            def run():
                with torch.inference_mode():
                    return routed_experts(*args, "silu", form)

            work = None
            if device.type == "cuda":
                sync(run())
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                sync(run())
                work = torch.cuda.max_memory_allocated() - base
            return run, sync, work
        return ready

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {form: prepare(form) for form in EXPERT_FORMS}, dict(name=name, platform=device.type)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _failure(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
    return ("oom: " if "out of memory" in text or "RESOURCE_EXHAUSTED" in text else
            "error: ") + text


def measure(forms: dict, shape: Shape, tokens: int, repeats: int) -> list[dict]:
    """One row per form at `tokens` tokens; each form's output beside the grouped form's."""
    x, w, ids = routes(tokens, shape, seed=tokens)
    item = np.dtype(np.float32).itemsize if shape.dtype == "float32" else 2
    chosen = len(np.unique(ids))
    chosen_bytes = chosen * 3 * shape.hidden * shape.inter * item
    rows, outputs = [], {}
    for form, prepare in forms.items():
        row = dict(tokens=tokens, form=form, chosen_experts=chosen,
                   model_choice=form == ("gathered" if ids.size <= shape.experts else "grouped"))
        gathered = ids.size * 3 * shape.hidden * shape.inter * item
        if form == "gathered" and gathered > GATHER_LIMIT_BYTES:
            rows.append(dict(row, status=f"skipped: would gather {gathered / 1e9:.1f} GB"))
            continue
        try:
            run, sync, work = prepare(x, w, ids)
            outputs[form] = np.asarray(_host(sync(run())), np.float32)
            seconds = median_seconds(run, sync, repeats)
        except Exception as error:  # noqa: BLE001 - one failing form must not end the sweep
            rows.append(dict(row, status=_failure(error)))
            continue
        rows.append(dict(row, status="ok", us=seconds * 1e6,
                         chosen_gbs=chosen_bytes / seconds / 1e9,
                         working_mb=None if work is None else work / 1e6))
    reference = outputs.get("grouped")
    for row in rows:
        if reference is not None and row["form"] in outputs:
            row["max_abs_diff_vs_grouped"] = float(np.max(np.abs(outputs[row["form"]]
                                                                 - reference)))
    return rows


def _host(out: Any) -> np.ndarray:
    if hasattr(out, "detach"):
        return out.detach().float().cpu().numpy()
    return np.asarray(out.astype("float32"))


def run_framework(args: argparse.Namespace) -> Path:
    import importlib

    gpu = (importlib.import_module("jax").default_backend() == "gpu" if args.framework == "jax"
           else importlib.import_module("torch").cuda.is_available())
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    gate_up, down = expert_weights(shape, seed=0)
    forms, device = (jax_forms if args.framework == "jax" else torch_forms)(shape, gate_up, down)
    del gate_up, down
    payload = dict(environment=environment(), framework=args.framework, device=device,
                   shape=asdict(shape), results=[])
    name = f"moe_layer_{args.framework}_{device['name'].replace(' ', '_')}.json"
    path = write_json(name, payload, args.out)
    for tokens in args.tokens or (GPU_TOKENS if gpu else CPU_TOKENS):
        rows = measure(forms, shape, tokens, args.repeats)
        payload["results"] += rows
        write_json(name, payload, args.out)
        for row in rows:
            print(json.dumps(row), flush=True)
    table = [dict(r, max_abs_diff_vs_grouped=f"{r['max_abs_diff_vs_grouped']:.1e}")
             if "max_abs_diff_vs_grouped" in r else r for r in payload["results"]]
    print_table(table, ["tokens", "form", "model_choice", "us", "chosen_gbs", "working_mb",
                        "max_abs_diff_vs_grouped", "status"])
    print(f"wrote {path}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=FRAMEWORKS)
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=20)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.framework:
        run_framework(args)
        return 0
    failed = 0
    for framework in FRAMEWORKS:  # each in a process of its own
        command = [sys.executable, __file__, *sys.argv[1:], "--framework", framework]
        failed |= subprocess.run(command).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
