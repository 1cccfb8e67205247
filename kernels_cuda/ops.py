"""Python entry points of the pagedjax custom ops (`torch.ops.pagedjax.*`) and their loader.

The extension (C++ CPU kernels, plus the CUDA kernels when a GPU is visible) is compiled on the
first call with `torch.utils.cpp_extension.load` and cached in torch's extension directory, so
later processes only load it. Without a C++ compiler, or if the build fails, every op falls back
to the pure-torch reference in `reference.py` after a single warning.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch.utils import cpp_extension

from pagedjax.kernels_cuda import reference

Backend = Literal["cpp", "cuda", "reference"]

_NAME = "pagedjax_ops"
_CSRC = Path(__file__).parent / "csrc"
_CPU_SOURCES = ("ops.cpp", "attention_cpu.cpp")
_CUDA_SOURCES = ("attention_cuda.cu", "write_kv_cuda.cu")


def _build() -> Backend:
    """Compiles the extension (or loads the cached build) into torch.ops.pagedjax; may raise."""
    with_cuda = torch.cuda.is_available()
    sources = [_CSRC / name for name in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    # One build folder per flavour, so a process without a GPU does not rebuild the CUDA one.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / f"{_NAME}_{'cuda' if with_cuda else 'cpu'}"
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{_NAME}.so"
    newest_source = max(path.stat().st_mtime for path in [*sources, *_CSRC.glob("*.h")])
    if not library.exists() or library.stat().st_mtime < newest_source:
        print(f"pagedjax: building {_NAME} in {build_dir} (once, ~1-3 min)", file=sys.stderr)
    cpp_extension.load(
        name=_NAME,
        sources=[str(path) for path in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,  # registers torch.ops.pagedjax.* only; no Python module
    )
    return "cuda" if with_cuda else "cpp"


@functools.cache
def ops_backend() -> Backend:
    """Which implementation serves the ops: "cuda" (CUDA + C++ CPU kernels), "cpp" or "reference".

    The first call builds (or loads) the extension; a failure warns once and selects "reference".
    """
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler {compiler!r} on PATH (install g++ or set CXX)"
    else:
        try:
            return _build()
        except Exception as error:  # any failure to build or load means: fall back
            reason = f"building the extension failed with {type(error).__name__}: {error}"[:4000]
    warnings.warn(
        f"pagedjax: falling back to the slow pure-torch reference ops, {reason}",
        RuntimeWarning,
        stacklevel=2,
    )
    return "reference"


def ragged_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D]
    v_cache: torch.Tensor,  # [N, Hkv, bs, D]
    kv_lens: torch.Tensor,  # [S] int32, context length after this step
    block_tables: torch.Tensor,  # [S, M] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D], contiguous; written in place when given
) -> torch.Tensor:  # [T, Hq, D]; padding rows (past query_start_loc[-1]) are zeros
    """Causal attention of each sequence's last q_len tokens over its paged KV context.

    `max_query_len` (an upper bound on every q_len, known to the host that built the batch) only
    picks the CUDA launch configuration; without it the CUDA op reads it from query_start_loc,
    which synchronises with the device (and so cannot be captured in a CUDA graph).
    """
    if ops_backend() == "reference":
        result = reference.ragged_paged_attention(
            q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
            sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
        return result if out is None else out.copy_(result)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, sm_scale,
            sliding_window, logits_soft_cap, max_query_len)  # fmt: skip
    if out is None:
        return torch.ops.pagedjax.ragged_paged_attention(*args)
    torch.ops.pagedjax.ragged_paged_attention_out(out, *args)
    return out


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    v_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32/int64, block_id * block_size + offset; -1 = skip
) -> None:
    """Store this step's keys/values in their cache slots (rows with slot -1 are skipped)."""
    if ops_backend() == "reference":
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        torch.ops.pagedjax.write_kv(k, v, k_cache, v_cache, slot_mapping)
