"""The shared HF weight loading: single file, sharded index, bf16, name mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedjax.backends.common.weights import canonical_name, checkpoint_files, load_weights
from pagedjax.config import ModelConfig


def test_sharded_bf16_checkpoint_loads_like_the_single_file(tiny_model, tmp_path) -> None:
    single = tiny_model("qwen2")
    config = ModelConfig.from_pretrained(single)
    model = AutoModelForCausalLM.from_pretrained(single).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(tmp_path)) > 1

    want, got = load_weights(single, config), load_weights(tmp_path, config)
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype.name == "bfloat16"
        expected = torch.from_numpy(np.array(want[name])).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), expected, err_msg=name)
    assert got["lm_head"] is got["embed_tokens"]  # tied embeddings


@pytest.mark.parametrize("hf_name, name", [
    ("model.embed_tokens.weight", "embed_tokens"),
    ("lm_head.weight", "lm_head"),
    ("model.layers.3.self_attn.q_proj.bias", "layers.3.q_proj.bias"),
    ("model.layers.0.mlp.down_proj.weight", "layers.0.down_proj.weight"),
    ("model.layers.11.post_attention_layernorm.weight", "layers.11.post_attention_layernorm"),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
])
def test_canonical_names(hf_name: str, name: str | None) -> None:
    assert canonical_name(hf_name) == name


def test_missing_weights_name_the_checkpoint(tiny_model, tmp_path) -> None:
    import shutil

    from safetensors.numpy import save_file

    from pagedjax.backends.common.weights import iter_safetensors

    model_dir = shutil.copytree(tiny_model("llama"), tmp_path / "broken")
    kept = {name: np.array(array) for name, array in
            iter_safetensors(model_dir / "model.safetensors") if ".layers.1." not in name}
    save_file(kept, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights \['layers.1.input_layernorm'"):
        load_weights(model_dir, ModelConfig.from_pretrained(model_dir))
