"""Tuning levers of our Pallas kernel, one at a time from its default, at the decode shapes of
`attention_kernels.py` (bf16, GQA 32/8, head_dim 128, block 16), beside JAX's own Pallas paged
attention and the copy bandwidth, in one process.

Levers: `num_splits` (KV splits merged by log-sum-exp), `num_kv_pages_per_chunk` (keys per
inner-loop step: 4 pages = 64 keys, 8 = 128), `num_warps`, `num_stages` (Triton's software
pipelining of the next chunk's loads with this chunk's compute). GPU only.

    python benchmarks/probes/pallas_tuning.py [--cases 1x2048 64x2048 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_out_argument, environment, median_seconds, print_table, write_json  # noqa: E402,I001
from kernel_cases import GPU_SHAPE, CaseSpec  # noqa: E402
from kernels_jax import IMPLEMENTATIONS, copy_bandwidth_gbs, device_inputs  # noqa: E402

from pagedjax.kernels_pallas import ragged_paged_attention  # noqa: E402

LEVERS: dict[str, tuple[int, ...]] = {
    "num_splits": (1, 2, 4, 8, 16, 32),
    "num_kv_pages_per_chunk": (4, 8, 16),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4),
}
DEFAULT_CASES = ("1x2048", "1x8192", "8x8192", "64x2048", "64x8192")


def _case(text: str) -> CaseSpec:
    batch, context = (int(x) for x in text.split("x"))
    return CaseSpec("decode", batch, context, (1,) * batch, (context,) * batch, GPU_SHAPE)


def _time_us(run, repeats: int) -> float:
    return 1e6 * median_seconds(run, jax.block_until_ready, repeats)


def tune_case(spec: CaseSpec, repeats: int, copy_gbs: float) -> list[dict]:
    inputs = device_inputs(spec)
    rows = []

    def record(impl: str, lever: str, value, run) -> None:
        try:
            us = _time_us(run, repeats)
            gbs = spec.kv_bytes / us / 1e3
            rows.append(dict(batch=spec.batch, context=spec.context, impl=impl, lever=lever,
                             value=value, us=round(us, 1), gbs=round(gbs, 1),
                             pct_copy=round(100 * gbs / copy_gbs, 1)))
        except Exception as error:  # noqa: BLE001 - a failing variant is a result, not a stop
            rows.append(dict(batch=spec.batch, context=spec.context, impl=impl, lever=lever,
                             value=value, error=f"{type(error).__name__}: {error}"[:300]))
        print(rows[-1], flush=True)

    peer, _ = IMPLEMENTATIONS["jax_pallas_paged"].prepare(spec, inputs)
    record("jax_pallas_paged", "default", None, peer)
    del peer
    for lever, values in [("default", (None,)), *LEVERS.items()]:
        for value in values:
            knobs = {} if lever == "default" else {lever: value}
            fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=spec.sm_scale,
                                           decode=True, **knobs))
            record("pallas_ragged", lever, value, functools.partial(fn, *inputs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="BATCHxCONTEXT")
    parser.add_argument("--repeats", type=int, default=20)
    add_out_argument(parser)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("pallas_tuning.py needs a GPU (Triton); on CPU run attention_kernels.py")
    copy_gbs = copy_bandwidth_gbs(2**30, args.repeats)
    rows = [row for case in args.cases for row in tune_case(_case(case), args.repeats, copy_gbs)]
    best = []
    for case in args.cases:
        spec = _case(case)
        mine = [r for r in rows if (r["batch"], r["context"]) == (spec.batch, spec.context)
                and "us" in r]
        ours = [r for r in mine if r["impl"] == "pallas_ragged"]
        peer = [r for r in mine if r["impl"] == "jax_pallas_paged"]
        default = next((r for r in ours if r["lever"] == "default"), None)
        fastest = min(ours, key=lambda r: r["us"], default=None)
        if fastest and default:
            best.append(dict(case=case, default_us=default["us"], best_us=fastest["us"],
                             best=f"{fastest['lever']}={fastest['value']}",
                             best_pct_copy=fastest["pct_copy"],
                             jax_paged_us=peer[0]["us"] if peer else None))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print_table(best, ["case", "default_us", "best_us", "best", "best_pct_copy", "jax_paged_us"])
    name = f"pallas_tuning_{jax.devices()[0].device_kind.replace(' ', '_')}.json"
    write_json(name, dict(environment=environment(), copy_gbs=copy_gbs, rows=rows, best=best),
               args.out)


if __name__ == "__main__":
    main()
