"""Mixtures of experts: the expert block against HF's module (both backends), both checkpoint
layouts, router margins of the tiny checkpoints the parity tests use, what is refused, and
speculation with a mixture-of-experts target. Greedy parity with HF generate for each
architecture is tests/e2e/test_hf_parity.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedjax import LLM, SamplingParams
from pagedjax.backends.common.weights import load_weights
from pagedjax.config import ModelConfig
from tests.support.prompts import make_prompts

MOE = ["qwen3_moe", "mixtral", "olmoe", "granitemoe"]


def hf_block(norm_topk_prob: bool, hidden: int = 64, experts: int = 8, inter: int = 32):
    """HF's Qwen3-MoE sparse block with random weights, and its input [T, H]: expert 0's
    router row points along a direction every token has (it takes every token), expert 7's
    against it (it takes none)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        router = block.gate.weight  # [E, H]
        router[0] = 0.0
        router[0, 0] = 4.0
        router[7] = 0.0
        router[7, 0] = -4.0
    x = torch.randn(23, hidden)
    x[:, 0] = 3.0 + x[:, 0].abs()
    return config, block, x


def moe_config(hf_config, renormalize: bool) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.moe_intermediate_size, num_layers=1, num_q_heads=1,
        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
        sliding_window=None, num_experts=hf_config.num_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size, renormalize_topk=renormalize)


@pytest.mark.parametrize("rows", [23, 3, 1])  # jax gathers at 1 x top 2 <= 8 / 4, torch at 3
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_expert_block_equals_hfs(backend: str, renormalize: bool, rows: int) -> None:
    hf_config, block, x = hf_block(renormalize)
    x = x[:rows]
    with torch.no_grad():
        want = block(x[None])[0].numpy()
        router_logits = x @ block.gate.weight.T
        chosen = torch.topk(router_logits, 2, dim=-1).indices
    counts = np.bincount(chosen.flatten().numpy(), minlength=8)
    assert counts[0] == len(x) and counts[7] == 0  # one expert takes every token, one none
    router = block.gate.weight.detach().numpy()  # [E, H]
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
    down = block.experts.down_proj.detach().numpy()  # [E, H, I]
    config = moe_config(hf_config, renormalize)
    if backend == "torch":
        from pagedjax.backends.torch.linear import Linear
        from pagedjax.backends.torch.moe import FusedMoE
        from pagedjax.backends.torch.parallel import Shard

        with torch.device("meta"):
            ours = FusedMoE(config, Shard(), Linear(config.hidden_size, config.num_experts))
        ours.load_state_dict({"router.weight": torch.from_numpy(router.T.copy()),
                              "gate_up_proj": torch.from_numpy(gate_up),
                              "down_proj": torch.from_numpy(down)}, assign=True)
        with torch.no_grad():
            got = ours(x).numpy()
    else:
        import jax.numpy as jnp

        from pagedjax.backends.jax.moe import FusedMoE

        gate, up = np.split(gate_up.transpose(0, 2, 1), 2, axis=-1)  # [E, H, I] each
        params = {"router": {"kernel": jnp.asarray(router.T)}, "gate_proj": jnp.asarray(gate),
                  "up_proj": jnp.asarray(up), "down_proj": jnp.asarray(down.transpose(0, 2, 1))}
        got = np.asarray(FusedMoE(config, jnp.float32).apply({"params": params},
                                                             jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [3, 23])
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_every_expert_form_equals_float64_math(backend: str, rows: int) -> None:
    """routed_experts' forms (gathered, grouped; torch's per-expert loop), each forced at a
    decode step's rows and a prefill's, against the experts in float64."""
    rng = np.random.default_rng(rows)
    e, k, h, inter = 8, 2, 64, 32
    x = rng.standard_normal((rows, h)).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * inter, h)) * 0.2).astype(np.float32)  # [E, 2I, H]
    down = (rng.standard_normal((e, h, inter)) * 0.2).astype(np.float32)  # [E, H, I]
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32)
    want = np.zeros((rows, h))
    for t, (ids, ws) in enumerate(zip(experts, weights, strict=True)):
        for j, w in zip(ids, ws, strict=True):
            gate, up = np.split(gate_up[j].astype(np.float64) @ x[t], 2)
            want[t] += w * (down[j] @ (gate / (1 + np.exp(-gate)) * up))
    if backend == "torch":
        from pagedjax.backends.torch.moe import EXPERT_FORMS, routed_experts

        args = [torch.from_numpy(a) for a in (x, weights, experts.astype(np.int64), gate_up,
                                              down)]
        got = {form: routed_experts(*args, "silu", form).numpy() for form in EXPERT_FORMS}
    else:
        import jax.numpy as jnp

        from pagedjax.backends.jax.moe import EXPERT_FORMS, routed_experts

        gate, up = np.split(gate_up.transpose(0, 2, 1), 2, axis=-1)  # [E, H, I] each
        args = [jnp.asarray(a) for a in (x, weights, experts, gate, up,
                                         down.transpose(0, 2, 1))]
        got = {form: np.asarray(routed_experts(*args, hidden_act="silu", form=form))
               for form in EXPERT_FORMS}
    assert len(got) >= 2
    for form, out in got.items():
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5, err_msg=form)


@pytest.mark.parametrize("name", MOE)
def test_router_margins_stand_above_float32_noise(tiny_model, name: str) -> None:
    """On the parity tests' prompts, every token's k-th and (k+1)-th router logits differ by
    at least 1e-3 (float32 noise in the logits is ~1e-6): no route flips between engines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    logits: list[torch.Tensor] = []
    routers = [m for n, m in model.named_modules()
               if n.endswith(("mlp.gate", "block_sparse_moe.router"))]
    assert routers
    for router in routers:
        router.register_forward_hook(
            lambda _m, _i, out: logits.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        for prompt in make_prompts(model.config.vocab_size):
            model(torch.tensor([prompt]))
    gaps = [torch.sort(out.reshape(-1, out.shape[-1]).float(), -1, descending=True).values
            for out in logits]
    assert min((g[:, k - 1] - g[:, k]).min().item() for g in gaps) > 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_per_expert_and_fused_layouts_load_the_same_weights(tiny_model, tmp_path,
                                                            name: str) -> None:
    """save_pretrained writes one tensor per expert (Mixtral's w1/w3/w2); newer transformers
    hold them fused (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), as a checkpoint
    saved from its state dict is: both load to the same canonical weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    per_expert = tiny_model(name)
    fused = tmp_path / "fused"
    shutil.copytree(per_expert, fused)
    (fused / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()
             if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # the fused layout
    save_file(state, str(fused / "model.safetensors"))
    config = ModelConfig.from_pretrained(per_expert)
    a, b = load_weights(per_expert, config), load_weights(fused, config)
    assert a.keys() == b.keys()
    assert any(".experts." in name for name in a)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_moe_config_fields(tiny_model) -> None:
    qwen = ModelConfig.from_pretrained(tiny_model("qwen3_moe"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.renormalize_topk and qwen.moe_layers == (False, True)  # mlp_only_layers [0]
    assert qwen.fusable_decoder_layer  # one fused C++ call a layer on the CPU
    assert ModelConfig.from_pretrained(tiny_model("mixtral")).renormalize_topk
    assert not ModelConfig.from_pretrained(tiny_model("olmoe")).renormalize_topk
    cfg = json.loads((Path(tiny_model("olmoe")) / "config.json").read_text())
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        ModelConfig.from_dict({**cfg, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig.from_dict({**cfg, "num_experts_per_tok": 9})


def test_what_a_moe_target_refuses_is_named(tiny_model) -> None:
    with pytest.raises(ValueError, match="a mixture of experts.*quantization='int8'.*use "
                                         "quantization=None"):
        LLM(tiny_model("qwen3_moe"), backend="torch", quantization="int8")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_speculation_with_a_moe_target_is_exact(tiny_model, backend: str) -> None:
    """A dense draft for a mixture-of-experts target, and n-gram drafts: greedy tokens equal
    the target's alone."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512)[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(backend=backend, max_model_len=128, num_gpu_blocks_override=64)
    plain = LLM(tiny_model("mixtral"), **kwargs)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for spec in ({"model": tiny_model("draft"), "num_speculative_tokens": 3, "adaptive": False},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "adaptive": False}):
        llm = LLM(tiny_model("mixtral"), speculative_config=spec, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
