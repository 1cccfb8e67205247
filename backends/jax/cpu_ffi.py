"""The JAX backend's glue to the C++ CPU kernels through XLA's FFI (no Pallas here): the
framework-free kernels the torch backend runs on CPU (`kernels_cuda/csrc/cpu/kernels/`:
`attention_cpu_kernel.h`, `linear_cpu_kernel.h`, ...), in float32, as CPU custom calls whose
handlers are `kernels_cuda/csrc/cpu/xla_ffi/cpu_ffi.cpp`; a top-k for the logprobs (XLA's CPU
TopK sorts every row); and a whole decoder layer in one call (`decoder_layer`: the layer
`cpu/kernels/decoder_layer_kernel.h` composes, which the torch op `pagedjax::decoder_layer` runs
too); and a mixture of experts' expert block (`moe_experts`, `cpu/kernels/moe_experts_kernel.h`).

The library is compiled on first use with the system's C++ compiler (`$CXX`, else `c++`) and
cached per source, compiler and jaxlib version in pagedjax's cache folder (pagedjax/cache.py:
`$PAGEDJAX_CACHE_DIR`, default ~/.cache/pagedjax); later processes only load it. Where it cannot
be built or loaded, `available()` is False after one warning and the jnp attention serves.
Imports no torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.backends.common import quantization
from pagedjax.cache import cache_dir
from pagedjax.native_build import loaded_libstdcxx_ldflags

TARGET = "pagedjax_ragged_paged_attention_f32"
LINEAR_TARGET = "pagedjax_linear_f32"
QUANT_LINEAR_TARGET = "pagedjax_quant_linear_f32"
TOP_K_TARGET = "pagedjax_top_k_f32"
FILTER_TARGET = "pagedjax_filter_logits_f32"
DECODER_LAYER_TARGET = "pagedjax_decoder_layer_f32"
LOGITS_STATS_TARGET = "pagedjax_logits_stats_f32"
MOE_EXPERTS_TARGET = "pagedjax_moe_experts_f32"
_SYMBOLS = {TARGET: "PagedjaxRaggedPagedAttentionF32", LINEAR_TARGET: "PagedjaxLinearF32",
            QUANT_LINEAR_TARGET: "PagedjaxQuantLinearF32",
            TOP_K_TARGET: "PagedjaxTopKF32", FILTER_TARGET: "PagedjaxFilterLogitsF32",
            DECODER_LAYER_TARGET: "PagedjaxDecoderLayerF32",
            LOGITS_STATS_TARGET: "PagedjaxLogitsStatsF32",
            MOE_EXPERTS_TARGET: "PagedjaxMoeExpertsF32"}
_HANDLERS = "cpu/xla_ffi/cpu_ffi.cpp"  # under csrc/: the one source compiled
_HEADERS = ("attention_shape.h", "cpu/kernels/*.h")  # under csrc/: what it includes
LINEAR_TILE = 16  # columns per packed tile (linear_cpu_kernel.h)


def _csrc() -> Path:
    """kernels_cuda/csrc, found without importing pagedjax.kernels_cuda (which imports torch)."""
    spec = importlib.util.find_spec("pagedjax.kernels_cuda")
    return Path(spec.submodule_search_locations[0]) / "csrc"


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def library_path() -> Path:
    """Where the build for these sources, this compiler and this jaxlib lives."""
    digest = hashlib.sha256(f"{_compiler()}|{jax.__version__}".encode())
    csrc = _csrc()
    sources = {csrc / _HANDLERS, *(path for pattern in _HEADERS for path in csrc.glob(pattern))}
    for path in sorted(sources):
        digest.update(path.relative_to(csrc).as_posix().encode() + path.read_bytes())
    return cache_dir() / f"jax_ffi_attention_{digest.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """Compiles the library into path (atomically: concurrent processes may race)."""
    if shutil.which(_compiler()) is None:
        raise OSError(f"no C++ compiler: {_compiler()!r} is not on PATH (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        partial = Path(tmp) / path.name
        command = [_compiler(), "-O3", "-std=c++17", "-fPIC", "-shared",
                   f"-I{jax.ffi.include_dir()}", str(_csrc() / _HANDLERS), "-o", str(partial),
                   *loaded_libstdcxx_ldflags()]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(partial, path)


@functools.cache
def available() -> bool:
    """Builds (once) or loads the library and registers the custom call; False, after one
    warning, where that fails."""
    path = library_path()
    try:
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError) as error:
        warnings.warn(f"pagedjax: the C++ CPU kernels for JAX are unavailable, jnp attention "
                      f"and XLA's dots serve instead (slower): {error}", RuntimeWarning,
                      stacklevel=2)
        return False
    return True


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D] float32
    k_cache: jax.Array,  # [N, Hkv, bs, D] float32 or float8_e4m3fn
    v_cache: jax.Array,  # [N, Hkv, bs, D], k_cache's dtype
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # [T, Hq, D]; padding rows (past query_start_loc[-1]) are zeros
    """Causal attention of each sequence's last q_len tokens over its paged KV context (the
    batch contract of the reference), computed by the C++ kernel; float8_e4m3fn caches (an FP8
    KV cache) read as value * k_scale / v_scale. Call `available()` first."""
    if q.dtype != jnp.float32 or not supported_cache(k_cache, v_cache):
        raise ValueError(f"the C++ CPU attention takes float32 q and float32 or float8_e4m3fn "
                         f"caches; got q {q.dtype}, caches {k_cache.dtype}, {v_cache.dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    int32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(q, k_cache, v_cache, int32(kv_lens), int32(block_tables), int32(query_start_loc),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), k_scale=np.float32(k_scale),
                v_scale=np.float32(v_scale))


def supported_cache(k_cache: jax.Array, v_cache: jax.Array) -> bool:
    """Whether the C++ kernels read these caches: both float32, or both float8_e4m3fn."""
    return (k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (jnp.float32, jnp.float8_e4m3fn))


def pack_linear_weight(weight: jax.Array) -> jax.Array:
    """W [in, out] → the tile-major [ceil(out / 16), in, 16] layout `linear` reads, zero-padded:
    packed[t, k, j] = W[k, 16 t + j] (the torch op's layout)."""
    in_features, out_features = weight.shape
    padded = jnp.pad(weight, ((0, 0), (0, -out_features % LINEAR_TILE)))
    return padded.reshape(in_features, -1, LINEAR_TILE).transpose(1, 0, 2)


def linear(x: jax.Array, packed: jax.Array, out_features: int,
           num_rows: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ W [in, out] → [..., out] float32 over W packed by pack_linear_weight, by the
    C++ kernel (each output element one FMA chain in k order: a row's result does not depend on
    the batch). num_rows (int32 scalar): only the first num_rows rows of x (flattened) are
    computed, the rest are zeros (a step's padding rows); None: all. Call `available()` first."""
    if x.dtype != jnp.float32 or packed.dtype != jnp.float32:
        raise ValueError(f"the C++ CPU linear takes float32; got x {x.dtype}, weight "
                         f"{packed.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    padded = packed.shape[0] * LINEAR_TILE
    call = jax.ffi.ffi_call(LINEAR_TARGET,
                            jax.ShapeDtypeStruct((rows.shape[0], padded), jnp.float32),
                            vmap_method="sequential")
    n = rows.shape[0] if num_rows is None else num_rows
    y = call(rows, packed, jnp.asarray(n, jnp.int32).reshape(1))
    if padded != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def pack_moe_weights(gate_up: jax.Array, down: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A mixture of experts' gate_up [E, H, 2I] and down [E, I, H] (per expert [in, out]) →
    (w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16]): each expert's weight packed
    as pack_linear_weight packs one (the torch op's layout)."""
    return jax.vmap(pack_linear_weight)(gate_up), jax.vmap(pack_linear_weight)(down)


def moe_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: jax.Array,
                w2: jax.Array, intermediate_size: int,
                num_rows: jax.Array | None = None) -> jax.Array:
    """A mixture of experts' expert block: x [T, H] float32 → y [T, H], each token's sum, in
    expert order, of weight * (silu(x @ gate) * (x @ up)) @ down over its k experts
    (topk_ids [T, k] int32, topk_weights [T, k] float32; w13, w2 from pack_moe_weights), by the
    C++ kernel the torch op pagedjax::moe_experts runs (the same bits). num_rows (int32 scalar):
    only the first num_rows tokens are computed, the rest are zeros (a step's padding rows, whose
    routes would wake experts no real token chose); None: all. Call `available()` first."""
    if x.dtype != jnp.float32 or w13.dtype != jnp.float32 or w2.dtype != jnp.float32:
        raise ValueError(f"the C++ CPU moe_experts takes float32; got x {x.dtype}, weights "
                         f"{w13.dtype}, {w2.dtype}")
    call = jax.ffi.ffi_call(MOE_EXPERTS_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    n = x.shape[0] if num_rows is None else num_rows
    return call(x, topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32), w13, w2,
                jnp.asarray(n, jnp.int32).reshape(1),
                intermediate_size=np.int64(intermediate_size))


def quant_linear(x: jax.Array, blocks: jax.Array, in_features: int,
                 num_rows: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ W^T → [..., out] float32, W [out, in] kept as GGML blocks (uint8
    [out, in / 32 * block bytes] or interleaved, backends/common/quantization.py; the type and
    layout read from their shape) by the torch op pagedjax::quant_linear's kernel: x's rows
    quantized to int8 blocks (16-bit, two planes, against Q4 blocks), integer dots.
    num_rows: as `linear`'s. Call `available()` first."""
    if x.dtype != jnp.float32 or blocks.dtype != jnp.uint8:
        raise ValueError(f"the C++ CPU quant_linear takes float32 x and uint8 blocks; got x "
                         f"{x.dtype}, blocks {blocks.dtype}")
    qtype, out_features, _ = quantization.layout_of_blocks(blocks.shape, in_features)
    rows = x.reshape(-1, in_features)
    call = jax.ffi.ffi_call(QUANT_LINEAR_TARGET,
                            jax.ShapeDtypeStruct((rows.shape[0], out_features), jnp.float32),
                            vmap_method="sequential")
    n = rows.shape[0] if num_rows is None else num_rows
    y = call(rows, blocks, jnp.asarray(n, jnp.int32).reshape(1), qtype=np.int64(qtype))
    return y.reshape(*x.shape[:-1], out_features)


_NONE = np.zeros(0, np.float32)  # an absent weight of the layer


class DecoderLayerWeights(NamedTuple):
    """One decoder layer's float32 weights (ModelConfig.fusable_decoder_layer), each dense
    projection packed by pack_linear_weight or kept as GGML blocks (uint8 [out, in / 32 * block
    bytes]: quant_linear's); with a router, the MLP is a mixture of experts whose gate_up and
    down are pack_moe_weights' w13 and w2 (packed float32 only)."""

    input_norm: jax.Array  # [H]
    qkv: jax.Array  # [ceil((Hq + 2 Hkv) D / 16), H, 16], or blocks
    qkv_bias: jax.Array  # [(Hq + 2 Hkv) D], or [0]: none
    o: jax.Array  # [ceil(H / 16), Hq D, 16], or blocks
    post_norm: jax.Array  # [H]
    gate_up: jax.Array  # [ceil(2 I / 16), H, 16], or blocks; experts: [E, ceil(2I / 16), H, 16]
    down: jax.Array  # [ceil(H / 16), I, 16], or blocks; experts: [E, ceil(H / 16), I, 16]
    q_norm: jax.Array = _NONE  # [D]: each q head's RMSNorm (Qwen3), or [0]: none
    k_norm: jax.Array = _NONE  # [D]: each k head's, or [0]
    router: jax.Array = _NONE  # [ceil(E / 16), H, 16] packed, or [0]: a dense MLP

    def qtypes(self, in_features: tuple[int, int, int, int]) -> np.ndarray:
        """int64 [4]: the GGML type of qkv, o, gate_up and down (0: packed float32), given
        their in_features."""
        return np.array([0 if w.dtype != jnp.uint8 else
                         quantization.qtype_of_blocks(w.shape, k)
                         for w, k in zip((self.qkv, self.o, self.gate_up, self.down),
                                         in_features, strict=True)], np.int64)


def decoder_layer(
    x: jax.Array,  # [T, H] float32: the last layer's output (the embedding in the first)
    residual: jax.Array | None,  # [T, H]: the stream before the last layer; None in the first
    weights: DecoderLayerWeights,
    kv_cache: tuple[jax.Array, jax.Array],  # k, v [N, Hkv, bs, D] float32 or float8_e4m3fn
    cos: jax.Array,  # [T, D] float32, at each token's position
    sin: jax.Array,  # [T, D]
    slot_mapping: jax.Array,  # [T] int32, -1: padding
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    num_q_heads: int,
    intermediate_size: int,
    eps: float,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    top_k: int = 0,
    renormalize: bool = False,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """A whole decoder layer (ModelConfig.fusable_decoder_layer: Llama's, with per-head q/k
    norms and a mixture of experts where `weights` has them) in one C++ call, as the torch op
    pagedjax::decoder_layer computes it: (output [T, H], residual stream [T, H], the KV caches
    with this step's keys and values written in place). One custom call where XLA compiled ~20
    kernels a layer: a step compiles in a fraction of the time, and runs the glue (norms, rope,
    residual adds, silu, routing) in C++. With a router, intermediate_size is each expert's and
    each token runs its top_k experts (renormalize: their weights divided by their sum). The
    caches are float32, or float8_e4m3fn (an FP8 KV cache: k / k_scale and v / v_scale
    stored). Call `available()` first."""
    k_cache, v_cache = kv_cache
    hidden, head_dim = x.shape[1], k_cache.shape[3]
    qtypes = weights.qtypes((hidden, num_q_heads * head_dim, hidden, intermediate_size))
    out_types = (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                 jax.ShapeDtypeStruct(x.shape, jnp.float32),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    # k_cache, v_cache (arguments 9 and 10) are outputs 2 and 3: updated in place
    call = jax.ffi.ffi_call(DECODER_LAYER_TARGET, out_types, vmap_method="sequential",
                            input_output_aliases={9: 2, 10: 3})
    int32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    w = weights
    out, stream, k_cache, v_cache = call(
        x, x if residual is None else residual, w.input_norm, w.qkv, w.qkv_bias, w.o,
        w.post_norm, w.gate_up, w.down, k_cache, v_cache, cos, sin, int32(slot_mapping),
        int32(kv_lens), int32(block_tables), int32(query_start_loc), w.q_norm, w.k_norm,
        w.router, num_q_heads=np.int64(num_q_heads),
        intermediate_size=np.int64(intermediate_size), eps=np.float32(eps),
        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        has_residual=np.int64(residual is not None), qtypes=qtypes, k_scale=np.float32(k_scale),
        v_scale=np.float32(v_scale), top_k=np.int64(top_k),
        renormalize=np.int64(renormalize))
    return out, stream, (k_cache, v_cache)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k of float32 x [..., V] (NaN-free) over the last axis: (values [..., k],
    int32 indices [..., k]), largest first, ties to the lower index. Call `available()` first."""
    if x.dtype != jnp.float32:
        raise ValueError(f"the C++ CPU top_k takes float32; got {x.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(TOP_K_TARGET, (jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32),
                                           jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32)),
                            vmap_method="sequential")
    values, indices = call(rows)
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


def logits_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Float32 logits x [R, V] → (argmax [R] int32: the first index of the maximum, a NaN
    counting as the maximum; log-sum-exp [R] float32) in one pass per row (logits_cpu_kernel.h).
    Call `available()` first."""
    rows = x.shape[0]
    call = jax.ffi.ffi_call(LOGITS_STATS_TARGET, (jax.ShapeDtypeStruct((rows,), jnp.int32),
                                                  jax.ShapeDtypeStruct((rows,), jnp.float32)),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32))


def filter_logits(x: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """The samplers' top-k / top-p / min-p filter of float32 x [R, V] with knobs [R]: x with
    what the filter drops at -inf (filter_cpu_kernel.h). Call `available()` first."""
    call = jax.ffi.ffi_call(FILTER_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), top_k.astype(jnp.int32), top_p.astype(jnp.float32),
                min_p.astype(jnp.float32))
