"""The quantized CPU linear per number of rows of x, beside the float32 linear: which wins where.

A SmolLM2-135M's worth of projections (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), each a distinct copy so that a pass streams every weight from memory as a
model's step does, run through:
- `quant`: pagedjax::quant_linear on the blocks as the backends keep them (interleaved in
  groups of 8 rows): below 64 rows x's rows quantized to int8 blocks (one row against Q4: two
  int8 planes) and integer dots (VNNI or AVX2), from 64 rows the weights dequantized a tile at a
  time into the float32 linear;
- `float32`: pagedjax::linear over the same weights dequantized to float32 once (what a
  dequantized model reads; a per-call dequantization would cost more on top).
Per format and row count: ms a pass (median of the passes after two warm-ups, the two taking
turns pass by pass) and the weights' GB/s. PAGEDJAX_NO_AVX512=1 measures the AVX2 paths.

    python benchmarks/probes/quant_linear_rows.py [--formats Q4_0 Q4_1 Q8_0]
        [--rows 1 4 16 32 128 512] [--passes 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # [out, in] a layer


def main() -> None:
    from pagedjax.backends.common import quantization
    from pagedjax.kernels_cuda import linear, pack_linear_weight, quant_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 128, 512])
    parser.add_argument("--passes", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    base = {s: rng.standard_normal(s).astype(np.float32) * 0.05 for s in set(SHAPES)}
    print(f"{'format':6} {'rows':>5} {'quant ms':>9} {'GB/s':>6} {'float32 ms':>11} "
          f"{'float32 / quant':>16}")
    for name in args.formats:
        qtype = quantization.QTYPE_OF[name]
        blocks = {s: quantization.interleave_rows(quantization.QUANTIZERS[name](base[s]), qtype)
                  for s in set(SHAPES)}
        quant = [(torch.from_numpy(blocks[s].copy()), s) for s in SHAPES]
        dense = [(pack_linear_weight(torch.from_numpy(
            quantization.dequantize(blocks[s], qtype, s[1]).T.copy())), s) for s in SHAPES]
        nbytes = sum(w.numel() for w, _ in quant)
        for rows in args.rows:
            x = {k: torch.randn(rows, k) for k in (576, 1536)}
            times: dict[str, list[float]] = {"quant": [], "float32": []}
            for _ in range(args.passes + 2):
                start = time.perf_counter()
                for w, (_, k) in quant:
                    quant_linear(x[k], w, qtype, None)
                times["quant"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for w, (n, k) in dense:
                    linear(x[k], w, None, n)
                times["float32"].append(time.perf_counter() - start)
            q, f = (statistics.median(times[label][2:]) for label in ("quant", "float32"))
            print(f"{name:6} {rows:5d} {q * 1e3:9.2f} {nbytes / q / 1e9:6.1f} {f * 1e3:11.2f} "
                  f"{f / q:16.2f}", flush=True)


if __name__ == "__main__":
    main()
