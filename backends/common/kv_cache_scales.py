"""The per-layer scales of an FP8 KV cache (kv_cache_dtype="fp8", vLLM's semantics): the cache
holds k / k_scale and v / v_scale in float8 e4m3, attention reads value * scale. A checkpoint
quantized for it (llm-compressor, ModelOpt) carries them as `model.layers.{i}.self_attn.k_scale`
and `v_scale` (vLLM also reads them under k_proj / v_proj); a layer without them gets 1.0, as in
vLLM. Shared by both backends."""

from __future__ import annotations

import re
from pathlib import Path

from pagedjax.backends.common.weights import checkpoint_files, iter_safetensors

_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")


def kv_cache_scales(model_dir: str | Path, num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer: the checkpoint's, else 1.0."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for path in checkpoint_files(model_dir):
        for name, array in iter_safetensors(path):
            match = _SCALE_RE.match(name)
            if match is None:
                continue
            layer, which = int(match.group(1)), match.group(2)
            values = array.astype("float32").reshape(-1)
            if values.size != 1 or not values[0] > 0:
                raise ValueError(f"{name} in {path} is {values.tolist()[:4]}, not one positive "
                                 "scale per layer (per-head scales are not supported); use "
                                 "kv_cache_dtype='auto' with this checkpoint.")
            value = float(values[0])
            if layer < num_layers:
                scales[layer]["kv".index(which)] = value
    return [(k, v) for k, v in scales]
