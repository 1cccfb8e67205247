"""Python entry points of the pagedjax custom ops (`torch.ops.pagedjax.*`) and their loader.

The extension (C++ CPU kernels, plus the CUDA kernels when a GPU is visible) is compiled on the
first call with `torch.utils.cpp_extension.load` and cached: one build folder per flavour, torch
and CUDA version and arch list, so later processes only load it. CUDA code is compiled for
explicit archs (sm_80 and sm_90 SASS plus compute_90 PTX; `TORCH_CUDA_ARCH_LIST` overrides).

Where the build fails:
- on a machine without a GPU, every op falls back to the pure-torch reference in `reference.py`
  after a single warning;
- on a GPU machine it raises `CudaBuildError`, naming nvcc, ninja, the archs and the log: a
  silent fallback there would serve (and benchmark) the slow reference in place of the kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch.utils import cpp_extension

from pagedjax.kernels_cuda import reference
from pagedjax.native_build import loaded_libstdcxx_ldflags

Backend = Literal["cpp", "cuda", "reference"]

_NAME = "pagedjax_ops"
_CSRC = Path(__file__).parent / "csrc"
# Paths under csrc/: the op schemas (ops.cpp) and the shared headers at the top; what runs on the
# CPU under cpu/: framework-free kernels (cpu/kernels/*.h), their torch ops (cpu/torch/) and their
# XLA FFI handlers (cpu/xla_ffi/, built by backends/jax/cpu_ffi.py, not here); the CUDA kernels
# under cuda/.
_CPU_SOURCES = ("ops.cpp", *(f"cpu/torch/{name}.cpp" for name in (
    "attention_cpu", "linear_cpu", "rotary_cpu", "norm_act_cpu", "decoder_layer_cpu",
    "filter_cpu", "logits_cpu", "gumbel_cpu", "token_mask_cpu", "quant_linear_cpu", "moe_cpu",
    "greedy_decode_cpu", "rejection_cpu")))
_CUDA_SOURCES = ("cuda/attention_cuda.cu", "cuda/attention_f32.cu", "cuda/attention_f16.cu",
                 "cuda/attention_bf16.cu", "cuda/write_kv_cuda.cu", "cuda/norm_act_cuda.cu",
                 "cuda/fp8_quant_cuda.cu")
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"  # A100 and H100 SASS; PTX that newer GPUs JIT-compile
_MIN_CAPABILITY = (8, 0)  # cp.async and bf16 paths


class CudaBuildError(RuntimeError):
    """The CUDA extension could not be built or loaded on a machine with a GPU."""


def cuda_arch_flags(arch_list: str | None = None) -> list[str]:
    """nvcc -gencode flags for "8.0;9.0+PTX"-style lists (default: TORCH_CUDA_ARCH_LIST, else
    DEFAULT_CUDA_ARCHS). Passing them stops torch from guessing archs from the visible GPU."""
    arch_list = arch_list or os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
    flags = []
    for arch in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", arch)
        if match is None:
            raise ValueError(f"CUDA arch {arch!r} in {arch_list!r}: use e.g. '8.0;9.0+PTX'")
        number = f"{match[1]}{match[2]}{match[3]}"
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if match[4]:
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def build_directory(with_cuda: bool) -> Path:
    """The cached build of one flavour: keyed by torch version, CUDA version and archs, and by
    the sources' contents (not their times: a checkout older than a build of other sources must
    not load that build)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    digest = hashlib.sha256()
    for path in sorted(_CSRC.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(_CSRC).as_posix().encode() + path.read_bytes())
    flavour = f"torch{torch.__version__}_src{digest.hexdigest()[:12]}"
    if with_cuda:
        archs = "-".join(flag.rsplit("=", 1)[1] for flag in cuda_arch_flags())
        flavour += f"_cuda{torch.version.cuda}_{archs}"
    return Path(root) / f"{_NAME}_{re.sub(r'[^A-Za-z0-9.]+', '_', flavour)}"


def _build() -> Backend:
    """Compiles the extension (or loads the cached build) into torch.ops.pagedjax; may raise."""
    with_cuda = torch.cuda.is_available()
    sources = [_CSRC / name for name in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    build_dir = build_directory(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{_NAME}.so"
    if library.exists():
        # Built from these sources: load it straight away (cpp_extension.load would run ninja
        # to check, which takes seconds, in every process, tensor-parallel workers included).
        torch.ops.load_library(str(library))
        return "cuda" if with_cuda else "cpp"
    print(f"pagedjax: building {_NAME} in {build_dir} (once, ~1-3 min)", file=sys.stderr)
    cpp_extension.load(
        name=_NAME,
        sources=[str(path) for path in sources],
        extra_cflags=["-O3", "-fopenmp"],  # OpenMP: at::parallel_for runs on threads
        extra_ldflags=loaded_libstdcxx_ldflags(),
        extra_cuda_cflags=["-O3", "-lineinfo", *cuda_arch_flags()],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,  # registers torch.ops.pagedjax.* only; no Python module
    )
    return "cuda" if with_cuda else "cpp"


def _nvcc_version() -> str:
    nvcc = Path(cpp_extension.CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
        return f"{nvcc}: " + (out.strip().splitlines() or ["?"])[-1]
    except OSError:
        return (f"not found (CUDA_HOME={cpp_extension.CUDA_HOME!r}; install the CUDA toolkit "
                f"or set CUDA_HOME)")


def _cuda_build_error(reason: str) -> CudaBuildError:
    """The error a GPU machine gets: everything needed to fix the build in one message."""
    capability = torch.cuda.get_device_capability()
    return CudaBuildError(
        f"pagedjax: the CUDA ops could not be built on this GPU machine ({reason}).\n"
        f"  GPU: {torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]}); torch "
        f"{torch.__version__} built for CUDA {torch.version.cuda}\n"
        f"  nvcc: {_nvcc_version()}\n"
        f"  ninja: {shutil.which('ninja') or 'not on PATH (pip install ninja)'}; C++ compiler: "
        f"{shutil.which(os.environ.get('CXX', 'c++')) or 'not on PATH'}\n"
        f"  archs: {' '.join(cuda_arch_flags())} (TORCH_CUDA_ARCH_LIST overrides)\n"
        f"  build folder (log: build.ninja, rerun with it): {build_directory(True)}\n"
        f"The pure-torch fallback serves only machines without a GPU; with one it would hide "
        f"the kernels. attention_impl='reference' selects it on purpose."
    )


@functools.cache
def ops_backend() -> Backend:
    """Which implementation serves the ops: "cuda" (CUDA + C++ CPU kernels), "cpp" or "reference".

    The first call builds (or loads) the extension. A failure warns once and selects
    "reference" without a GPU; with a GPU it raises CudaBuildError.
    """
    on_gpu = torch.cuda.is_available()
    compiler = os.environ.get("CXX", "c++")
    if on_gpu and torch.cuda.get_device_capability() < _MIN_CAPABILITY:
        raise _cuda_build_error("compute capability below sm_80, which the kernels need")
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler {compiler!r} on PATH (install g++ or set CXX)"
    else:
        try:
            return _build()
        except Exception as error:  # any failure to build or load
            reason = f"building the extension failed with {type(error).__name__}: {error}"[:4000]
    if on_gpu:
        raise _cuda_build_error(reason)
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
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D], contiguous; written in place when given
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]; padding rows (past query_start_loc[-1]) are zeros
    """Causal attention of each sequence's last q_len tokens over its paged KV context. The
    caches are q's dtype, or float8_e4m3fn (an FP8 KV cache, read as value * k_scale /
    value * v_scale).

    `max_query_len` (an upper bound on every q_len, known to the host that built the batch) only
    picks the CUDA launch configuration; without it the CUDA op reads it from query_start_loc,
    which synchronises with the device (and so cannot be captured in a CUDA graph).
    """
    if ops_backend() == "reference":
        result = reference.ragged_paged_attention(
            q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return result if out is None else out.copy_(result)
    args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, sm_scale,
            sliding_window, soft_cap, max_query_len, k_scale, v_scale)  # fmt: skip
    if out is None:
        return torch.ops.pagedjax.ragged_paged_attention(*args)
    torch.ops.pagedjax.ragged_paged_attention_out(out, *args)
    return out


def decode_attention_with_kv_write(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D], this step's keys (heads contiguous; v of the same strides)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    v_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32; -1 = no store
    kv_lens: torch.Tensor,  # [S] int32, context length after this step
    block_tables: torch.Tensor,  # [S, M] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    """write_kv then ragged_paged_attention for a decode step (each sequence's one query token
    at its row, padding sequences none): one CUDA kernel (and the split merge) in a CUDA build,
    where it stores each sequence's new K/V before attending; the two ops elsewhere."""
    if _has_cuda_op(q):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        torch.ops.pagedjax.decode_attention_with_kv_write_out(
            out, q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables,
            query_start_loc, sm_scale, sliding_window, soft_cap, k_scale, v_scale)
        return out
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                                  sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, max_query_len=1, k_scale=k_scale,
                                  v_scale=v_scale)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    v_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32/int64, block_id * block_size + offset; -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's keys/values in their cache slots (rows with slot -1 are skipped); a
    float8_e4m3fn cache stores k / k_scale and v / v_scale, rounded and saturated to +-448."""
    if ops_backend() == "reference":
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        torch.ops.pagedjax.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


LINEAR_TILE = 16  # columns per tile of a packed linear weight (linear_cpu.cpp)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [in, out] → the tile-major [ceil(out / 16), in, 16] layout `linear` reads, zero-padded:
    packed[t, k, j] = W[k, 16 t + j]."""
    in_features, out_features = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -out_features % LINEAR_TILE))
    return padded.view(in_features, -1, LINEAR_TILE).transpose(0, 1).contiguous()


def linear(
    x: torch.Tensor,  # [M, in] float32, rows contiguous
    packed_weight: torch.Tensor,  # [ceil(out / 16), in, 16] from pack_linear_weight
    bias: torch.Tensor | None,  # [out]
    out_features: int,
) -> torch.Tensor:  # [M, out]
    """x @ W (+ bias) on the CPU, float32, over a packed weight (the C++ op; the reference when
    the extension is not built)."""
    if ops_backend() == "reference":
        return reference.linear(x, packed_weight, bias, out_features)
    return torch.ops.pagedjax.linear(x, packed_weight, bias, out_features)


def pack_moe_weights(gate_up_proj: torch.Tensor, down_proj: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' gate_up_proj [E, 2I, H] and down_proj [E, H, I] (the checkpoint's
    [out, in] per expert) → (w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16]): each
    expert's x @ gate_up and x @ down weights packed as pack_linear_weight packs one."""
    def pack(w: torch.Tensor) -> torch.Tensor:  # [E, out, in] → [E, ceil(out / 16), in, 16]
        experts, out_features, in_features = w.shape
        padded = torch.nn.functional.pad(w, (0, 0, 0, -out_features % LINEAR_TILE))
        return padded.view(experts, -1, LINEAR_TILE, in_features).transpose(2, 3).contiguous()

    return pack(gate_up_proj), pack(down_proj)


def moe_experts(
    x: torch.Tensor,  # [T, H] float32
    topk_ids: torch.Tensor,  # [T, k] int32 or int64: each token's experts
    topk_weights: torch.Tensor,  # [T, k] float32: their weights
    w13_packed: torch.Tensor,  # [E, ceil(2I / 16), H, 16] from pack_moe_weights
    w2_packed: torch.Tensor,  # [E, ceil(H / 16), I, 16]
    intermediate_size: int,  # I
) -> torch.Tensor:  # [T, H]
    """A mixture of experts' expert block on the CPU, float32: each token's sum, in expert order,
    of weight * (silu(x @ gate) * (x @ up)) @ down over its k experts (the C++ op; the reference
    when the extension is not built)."""
    if ops_backend() == "reference":
        return reference.moe_experts(x, topk_ids, topk_weights, w13_packed, w2_packed,
                                     intermediate_size)
    return torch.ops.pagedjax.moe_experts(x, topk_ids, topk_weights, w13_packed, w2_packed,
                                          intermediate_size)


def moe_routing(logits: torch.Tensor, k: int, renormalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, experts [T, k] int64): the softmax over
    all experts (float32), its top k (ties to the lower expert), divided by their sum where
    renormalize. On the CPU in float32 the C++ op (the fused decoder layer's routing, so the
    two paths choose the same experts with the same bits), else the reference."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and _has_op(logits):
        return torch.ops.pagedjax.moe_routing(logits.contiguous(), k, renormalize)
    return reference.moe_routing(logits, k, renormalize)


def quant_linear(
    x: torch.Tensor,  # [M, K] float32, rows contiguous
    blocks: torch.Tensor,  # [N, K / 32 * block bytes] uint8, GGML's (common/quantization.py)
    qtype: int,  # 8 (Q8_0, int8), 2 (Q4_0), 3 (Q4_1)
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N]
    """x @ W^T (+ bias) on the CPU with W kept in blocks and x's rows quantized to int8 blocks
    (16-bit ones, two int8 planes, against Q4 blocks) and integer dots (the C++ op; the float32
    product of the dequantized weights when it is not built)."""
    if ops_backend() == "reference":
        return reference.quant_linear(x, blocks, qtype, bias)
    return torch.ops.pagedjax.quant_linear(x, blocks, qtype, bias)


def rotary_embedding_(
    x: torch.Tensor,  # [T, H, D], head vectors contiguous (rows may be strided); rotated in place
    cos: torch.Tensor,  # [T, D] float32, at each token's position
    sin: torch.Tensor,  # [T, D] float32
) -> None:
    """HF's rotary embedding (rotate_half layout, float32 math) applied to x in place: the C++ op
    on the CPU, the CUDA kernel on a GPU, else the reference."""
    if _has_op(x):
        torch.ops.pagedjax.rotary_embedding_(x, cos, sin)
    else:
        reference.rotary_embedding_(x, cos, sin)


def _has_cuda_op(x: torch.Tensor) -> bool:
    """Whether x is on a GPU whose CUDA build has the op (the ops with no C++ CPU kernel)."""
    return x.device.type == "cuda" and ops_backend() == "cuda"


def _has_op(x: torch.Tensor) -> bool:
    """Whether x's device has the op: the C++ CPU ops, and the CUDA kernels in a CUDA build (one
    kernel each where the eager reference runs 3-10, which a CUDA graph does not merge)."""
    backend = ops_backend()
    return backend != "reference" and (x.device.type == "cpu"
                                       or (x.device.type == "cuda" and backend == "cuda"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of x [T, H] (float32 math, rounded as HF rounds) times weight [H]."""
    if _has_op(x):
        return torch.ops.pagedjax.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a layer's residual add and the next norm."""
    if _has_op(x):
        return torch.ops.pagedjax.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (q float8 e4m3 [M, K], scale float32 [M, 1]), x ≈ q * scale: each row scaled
    by max|x| / 448 (FP8 W8A8's dynamic activation scales). One CUDA kernel in a CUDA build
    (the eager reference is nine); the reference elsewhere."""
    if _has_cuda_op(x):
        return torch.ops.pagedjax.quantize_fp8_per_token(x.contiguous())
    return reference.quantize_fp8_per_token(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] → silu(x[:, :I]) * x[:, I:] [T, I]: the gated MLP's activation."""
    if _has_op(x):
        return torch.ops.pagedjax.silu_and_mul(x)
    return reference.silu_and_mul(x)
