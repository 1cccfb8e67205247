"""The architecture rows of pagedjax/model_loader/architectures.py: what each reads from a
checkpoint, and the knobs that set them apart (their greedy tokens against HF transformers':
tests/e2e/test_hf_parity.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedjax.config import ModelConfig
from tests.support.hf_reference import hf_greedy

PROMPT_LENS = (1, 17, 40)
MAX_TOKENS = 8


def test_rows_read_what_sets_them_apart(tiny_model) -> None:
    """The config fields each row switches on, read from the checkpoints made above."""
    qwen3 = ModelConfig.from_pretrained(tiny_model("qwen3"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias) == ("head", 24, False)
    olmo2 = ModelConfig.from_pretrained(tiny_model("olmo2"))
    assert (olmo2.qk_norm, olmo2.norm_layout) == ("full", "post")
    granite = ModelConfig.from_pretrained(tiny_model("granite"))
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.sm_scale,
            granite.logits_scaling) == (6.0, 0.5, 0.1, 2.0)
    phi3 = ModelConfig.from_pretrained(tiny_model("phi3"))
    assert (phi3.sliding_window, phi3.rope_scaling["rope_type"]) == (24, "longrope")
    gemma2 = ModelConfig.from_pretrained(tiny_model("gemma2"))
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (0.3, 10.0)
    assert gemma2.layer_sliding_windows == (24, None) and gemma2.local_rope_theta is None
    gemma3 = ModelConfig.from_pretrained(tiny_model("gemma3"))
    assert (gemma3.layer_sliding_windows, gemma3.local_rope_theta) == ((24, None), 10000.0)
    assert (gemma3.local_rope(0), gemma3.local_rope(1)) == (True, False)
    assert (gemma3.sm_scale, gemma3.norm_layout, gemma3.hidden_act) == (
        24**-0.5, "sandwich", "gelu_tanh")


def test_unsupported_architecture_names_the_served_ones() -> None:
    with pytest.raises(ValueError, match="'GPTNeoXForCausalLM' is not supported.*Qwen3"):
        ModelConfig.from_dict({"architectures": ["GPTNeoXForCausalLM"]})


def test_longrope_tables_are_transformers(tiny_model) -> None:
    """Phi-3's LongRoPE tables: positions within the pretraining length (128 here) rotate as
    transformers' short factors, later ones as its long factors, both scaled as it scales."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedjax.backends.common.rope import rope_cos_sin

    model_dir = tiny_model("phi3")
    config = ModelConfig.from_pretrained(model_dir)
    cos, sin = rope_cos_sin(config, 256)
    hf_config = AutoConfig.from_pretrained(model_dir)
    for seq_len, rows in ((None, slice(0, 128)), (129, slice(128, 256))):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=seq_len)
        freqs = torch.arange(256, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        np.testing.assert_allclose(cos[rows], (emb.cos() * factor).numpy()[rows], atol=1e-6)
        np.testing.assert_allclose(sin[rows], (emb.sin() * factor).numpy()[rows], atol=1e-6)
    assert config.rope_scaling["attention_factor"] == pytest.approx((1 + np.log(4) / np.log(128))
                                                                    ** 0.5)


def test_gemma2_attention_cap_changes_the_tokens(tiny_model, tmp_path) -> None:
    """The tiny Gemma 2's attention soft-cap binds: HF's greedy tokens differ without it, so the
    parity above checks the kernels' cap."""
    import shutil

    model_dir = tiny_model("gemma2")
    uncapped = shutil.copytree(model_dir, tmp_path / "uncapped")
    config = json.loads((uncapped / "config.json").read_text())
    config["attn_logit_softcapping"] = None
    (uncapped / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config["vocab_size"], n).tolist() for n in PROMPT_LENS]
    assert hf_greedy(model_dir, prompts, MAX_TOKENS) != hf_greedy(str(uncapped), prompts,
                                                                 MAX_TOKENS)
