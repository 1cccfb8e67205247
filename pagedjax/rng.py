"""Counter-based random numbers shared by both backends.

u(seed, step, j) in (0, 1) is a pure function of three uint32 counters, so a seeded request
samples the same tokens whatever its batch, step bucket or backend. Each backend implements
`uniform` with its own integer ops; this NumPy version is the reference they are tested against.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B9  # step stride
STREAM = 0x85EBCA6B  # vocabulary-index stride
MIX_MUL_1 = 0x7FEB352D  # lowbias32 multipliers (Wellons' hash prospector)
MIX_MUL_2 = 0x846CA68B
# A uniform keeps the top 23 bits k of a hash: u = (k + 0.5) / 2**23. float32 holds every such
# value exactly, so u lies strictly inside (0, 1). (With 24 bits the largest, (2**24 - 0.5) /
# 2**24, rounded to 1.0: a Gumbel noise of +inf that picked a uniformly random token, about once
# in 2**24 draws, ~0.3 % of the rows sampled over a 49k vocabulary, and outside a grammar's mask.)
UNIFORM_BITS = 23


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32: a bijective uint32 → uint32 hash."""
    x = np.asarray(x, np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(MIX_MUL_1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MIX_MUL_2)
    x ^= x >> np.uint32(16)
    return x


def uniform(seed: np.ndarray, step: np.ndarray, num: int) -> np.ndarray:
    """[L] uint32 seeds, [L] uint32 steps → [L, num] float32 uniforms in (0, 1)."""
    seed = np.asarray(seed, np.uint32)[:, None]
    step = np.asarray(step, np.uint32)[:, None]
    key = mix32(seed ^ mix32(step * np.uint32(GOLDEN)))
    bits = mix32(key + np.arange(num, dtype=np.uint32)[None, :] * np.uint32(STREAM))
    return bits_to_uniform(bits)


def bits_to_uniform(bits: np.ndarray) -> np.ndarray:
    """uint32 hashes → float32 uniforms strictly inside (0, 1) (UNIFORM_BITS)."""
    top = (bits >> np.uint32(32 - UNIFORM_BITS)).astype(np.float32)
    return (top + np.float32(0.5)) * np.float32(2.0**-UNIFORM_BITS)


def derive_seed(*values: int) -> int:
    """A uint32 stream id from a few integers (request seed, completion index, ...)."""
    x = 0x2545F491
    for v in values:
        x = int(mix32(np.uint32((x ^ v) & 0xFFFFFFFF)))
        x = (x + GOLDEN) & 0xFFFFFFFF
    return x
