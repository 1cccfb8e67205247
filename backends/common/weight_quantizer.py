"""Which blocks each projection keeps under `quantization=` (EngineConfig.quantization), decided
once for both backends: "int8" quantizes each weight at load (symmetric per output channel);
"gguf" takes a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks, each checked to decode to the weight
the model loaded from the file's dequantized conversion. The backends ask for every fused
projection (q/k/v and gate/up as one weight, as both run them) and the LM head, and keep what
they get (backends/common/quantization.py's layouts: interleaved in groups of 8 rows wherever
the rows allow, as the CPU kernels read fastest) or their float32 weight where it is None.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re

import numpy as np

from pagedjax.backends.common import quantization
from pagedjax.config import ModelConfig

logger = logging.getLogger(__name__)

# A fused projection's canonical parts, in their row order in the fused weight
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                     "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LM_HEAD = "lm_head"
_LAYER = re.compile(r"layers\.(\d+)\.(\w+)")

Blocks = tuple[int, np.ndarray]  # (GGML type id, uint8 [out, in / 32 * block bytes] or interleaved)


def projection_label(layer: int, fused: str) -> str:
    """The name a backend asks for a decoder layer's fused projection by: layers.{i}.{fused}."""
    return f"layers.{layer}.{fused}"


class WeightQuantizer:
    """quantizer(label, weight [out, in] float32) → Blocks, or None: the weight stays float32.
    label: projection_label(i, one of FUSED_PROJECTIONS) or LM_HEAD. `summary()` logs what
    was kept, once every weight was asked for."""

    def __init__(self, method: str, config: ModelConfig, gguf_path: str | None = None) -> None:
        if method not in ("int8", "gguf"):
            raise ValueError(f"quantization={method!r} keeps no blocks; use 'int8' or 'gguf'.")
        self.method, self.config = method, config
        self.counts: collections.Counter = collections.Counter()
        self._tensors = None
        if method == "gguf":
            from pagedjax.model_loader.gguf import gguf_linear_blocks

            self._tensors = gguf_linear_blocks(gguf_path)

    def __call__(self, label: str, weight: np.ndarray) -> Blocks | None:
        weight = np.asarray(weight, np.float32)
        if self.method == "int8":
            kept = None
            if weight.shape[1] % quantization.BLOCK == 0:
                kept = quantization.Q8_0, quantization.quantize_int8_per_channel(weight)
        else:
            kept = self._file_blocks(label, weight)
        self.counts[quantization.QTYPE_NAMES[kept[0]] if kept else "float32"] += 1
        if kept is None and self.method == "gguf":
            logger.info("quantization='gguf': %s stays float32 (a type without kept blocks, or "
                        "mixed types in a fused projection)", label)
        if kept is not None and kept[1].shape[0] % quantization.GROUP == 0:
            kept = kept[0], quantization.interleave_rows(kept[1], kept[0])
        return kept

    def summary(self) -> None:
        logger.info("quantization=%r: %s", self.method,
                    ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items())))

    def _file_blocks(self, label: str, expected: np.ndarray) -> Blocks | None:
        """The first combination of the parts' row orders whose blocks decode to `expected`
        (llama.cpp's converter permutes q/k rows for its rotary layout: both orders are
        tried)."""
        from pagedjax.model_loader.gguf import GGUF_LINEAR_NAMES

        if label == LM_HEAD:
            name = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
            parts = [self._rows(name, LM_HEAD)]
        else:
            layer, fused = _LAYER.fullmatch(label).groups()
            parts = [self._rows(f"blk.{layer}.{GGUF_LINEAR_NAMES[p]}.weight", p)
                     for p in FUSED_PROJECTIONS[fused]]
        for choice in itertools.product(*parts):
            qtypes = {qtype for qtype, _ in choice}
            if len(qtypes) != 1:
                return None
            blocks = np.concatenate([rows for _, rows in choice])
            qtype = qtypes.pop()
            decoded = quantization.dequantize(blocks, qtype, expected.shape[1])
            # (the largest difference: np.allclose's isclose is several times slower)
            if (decoded.shape == expected.shape
                    and np.abs(decoded - expected).max(initial=0.0) <= 1e-6):
                return qtype, blocks
        return None

    def _rows(self, name: str, canonical: str) -> list[Blocks]:
        """The file's tensor `name` as (qtype, rows of blocks), in each row order it may have;
        none where its type keeps no blocks."""
        from pagedjax.model_loader.gguf import reverse_permute_rows

        qtype, data = self._tensors[name]
        if qtype not in quantization.QTYPE_NAMES:
            return []
        data = np.asarray(data)
        heads = {"q_proj": self.config.num_q_heads, "k_proj": self.config.num_kv_heads}
        if canonical in heads:
            return [(qtype, reverse_permute_rows(data, heads[canonical])), (qtype, data)]
        return [(qtype, data)]
