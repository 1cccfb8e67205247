"""Rotary position embedding frequencies, shared by both backends (NumPy, float32 like HF)."""

from __future__ import annotations

import numpy as np

from pagedjax.config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:  # [head_dim // 2]
    """Inverse frequencies with linear or llama3 scaling, computed as transformers does (float32);
    local: the sliding layers' own base, unscaled (Gemma 3)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":  # the short factors
        return _longrope_inv_freq(config, scaling["short_factor"])
    if scaling is None:
        return inv_freq.astype(np.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: ModelConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [max_len, head_dim] in float32 (HF's rotate_half layout). With a local
    rope base (config.local_rope_theta) the tables are [2 * max_len, head_dim]: the local
    table follows the global one, and a layer with config.local_rope(layer) reads row
    max_len + position."""
    tables = [_cos_sin(rope_inv_freq(config), max_len)]
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        tables = [_longrope_cos_sin(config, max_len)]
    if config.local_rope_theta is not None:
        tables.append(_cos_sin(rope_inv_freq(config, local=True), max_len))
    cos, sin = (np.concatenate(parts) for parts in zip(*tables))
    return cos, sin


def _longrope_cos_sin(config: ModelConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE: positions within the pretraining length rotate by the short factors, later ones
    by the long factors (per token, as vLLM does; transformers switches a whole forward pass
    once its length passes it), both scaled by the attention factor."""
    scaling = config.rope_scaling
    short = _cos_sin(_longrope_inv_freq(config, scaling["short_factor"]), max_len)
    long = _cos_sin(_longrope_inv_freq(config, scaling["long_factor"]), max_len)
    use_long = (np.arange(max_len) >= scaling["original_max_position_embeddings"])[:, None]
    factor = np.float32(scaling["attention_factor"])
    return tuple((np.where(use_long, lg, sh) * factor).astype(np.float32)
                 for sh, lg in zip(short, long))


def _longrope_inv_freq(config: ModelConfig, factors: list[float]) -> np.ndarray:
    """1 / (factor * theta ** (2i / D)), in float32 as transformers computes it."""
    dim = config.head_dim
    base = np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    return (1.0 / (np.asarray(factors, np.float32) * base)).astype(np.float32)


def _cos_sin(inv_freq: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    freqs = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
