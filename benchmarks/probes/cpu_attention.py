"""The JAX backend's attention on CPU: the jnp reference (one loop iteration per KV block) beside
the tiled version (KV gathered once per tile of query rows, several blocks per iteration) at its
tile and chunk sizes, on decode, verification, prefill and mixed batches.

Each implementation runs jitted on the same inputs; the error column is the largest absolute
difference from the reference. Writes cpu_attention.json to --out.

    python benchmarks/probes/cpu_attention.py [--out DIR] [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_out_argument, environment, print_table, write_json  # noqa: E402

HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=32)  # the demo target's attention
BLOCK_SIZE = 16
CASES = {  # name -> (q_lens, kv_lens)
    "decode B1 ctx100": ([1], [100]),
    "decode B8 ctx200": ([1] * 8, [200] * 8),
    "decode B32 ctx300": ([1] * 32, [300] * 32),
    "verify B4 q5 ctx200": ([5] * 4, [200] * 4),
    "prefill B2 q256": ([256] * 2, [256] * 2),
    "mixed 1x200 + 7 decodes": ([200] + [1] * 7, [200] + [300] * 7),
}
TILINGS = [(16, 8), (8, 8), (32, 8), (16, 4), (16, 16)]  # (rows_per_tile, chunk_blocks)


def make_case(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int]) -> dict:
    """Padded like the engine pads: T and S powers of two, T == S for decode batches."""
    import jax.numpy as jnp

    from pagedjax.core.batch import bucket

    decode = all(q == 1 for q in q_lens)
    num_seqs = bucket(len(q_lens))
    num_tokens = num_seqs if decode else bucket(sum(q_lens))
    max_blocks = -(-max(kv_lens) // BLOCK_SIZE)
    num_blocks = num_seqs * max_blocks + 1
    shape = (num_blocks, HEADS["num_kv_heads"], BLOCK_SIZE, HEADS["head_dim"])
    tables = rng.permutation(num_blocks - 1)[: num_seqs * max_blocks].reshape(num_seqs, -1)
    query_start_loc = np.full(num_seqs + 1, sum(q_lens), np.int32)
    query_start_loc[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.zeros(num_seqs, np.int32)
    lens[: len(kv_lens)] = kv_lens
    q = rng.standard_normal((num_tokens, HEADS["num_q_heads"], HEADS["head_dim"]))
    return dict(q=jnp.asarray(q, jnp.float32),
                k_cache=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                v_cache=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                kv_lens=jnp.asarray(lens), block_tables=jnp.asarray(tables, jnp.int32),
                query_start_loc=jnp.asarray(query_start_loc)), decode


def median_us(fn, args: dict, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(**args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(**args))
        samples.append(time.perf_counter() - start)
    return 1e6 * float(np.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    add_out_argument(parser)
    args = parser.parse_args()

    import jax

    from pagedjax.backends.jax import cpu_ffi
    from pagedjax.backends.jax.attention import ragged_paged_attention_cpu
    from pagedjax.kernels_pallas.reference import ragged_paged_attention_reference
    from pagedjax.kernels_pallas.tiled_attention import ragged_paged_attention_tiled

    rng, rows = np.random.default_rng(0), []
    for name, (q_lens, kv_lens) in CASES.items():
        case, decode = make_case(rng, q_lens, kv_lens)
        reference = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.17))
        want = np.asarray(reference(**case))
        impls = {"reference (per block)": reference,
                 "cpu (the backend's choice)": jax.jit(functools.partial(
                     ragged_paged_attention_cpu, sm_scale=0.17, decode=decode))}
        if cpu_ffi.available():
            impls["C++ kernel (XLA FFI)"] = jax.jit(functools.partial(
                cpu_ffi.ragged_paged_attention, sm_scale=0.17))
        for rows_per_tile, chunk_blocks in TILINGS:
            label = f"tiled {'decode' if decode else f'rows {rows_per_tile}'}, chunk {chunk_blocks}"
            if label not in impls:
                impls[label] = jax.jit(functools.partial(
                    ragged_paged_attention_tiled, sm_scale=0.17, decode=decode,
                    rows_per_tile=rows_per_tile, chunk_blocks=chunk_blocks))
        for impl, fn in impls.items():
            error = float(np.max(np.abs(np.asarray(fn(**case)) - want)))
            rows.append({"case": name, "impl": impl, "µs": median_us(fn, case, args.repeats),
                         "max abs err": f"{error:.1e}"})
        base = rows[-len(impls)]["µs"]
        for row in rows[-len(impls):]:
            row["× reference"] = base / row["µs"]
    print_table(rows, ["case", "impl", "µs", "× reference", "max abs err"])
    path = write_json("cpu_attention.json", {"heads": HEADS, "block_size": BLOCK_SIZE,
                                             "results": rows, "environment": environment()},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
