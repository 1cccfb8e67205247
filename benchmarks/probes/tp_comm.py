"""Tensor parallelism's communication: bytes all-reduced per decoder layer and per step, as
pagedjax.distributed.tensor_parallel counts them, checked against the HLO XLA partitions the
JAX step into.

Only one GPU is available to this project, so multi-GPU speed is not measured here: this
script computes the volume for Llama-3.2-1B and Llama-3-8B shapes at TP 2/4/8, and compiles
the sharded forward of each shape on fake CPU devices (abstract weights: nothing is allocated)
to read the all-reduces XLA emits. Writes tp_comm.json to --out.

    python benchmarks/probes/tp_comm.py [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "jax" not in sys.modules:  # fake devices must be set before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_out_argument, environment, print_table, write_json  # noqa: E402

SHAPES = {  # name -> config.json fields
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}
BF16 = 2


def model_config(fields: dict):
    from pagedjax.config import ModelConfig

    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"],
                                  "max_position_embeddings": 8192, **fields})


def hlo_all_reduces(config, size: int, num_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each operand all-reduced by the compiled, sharded forward of
    num_tokens tokens (weights and caches abstract: nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from pagedjax.backends.common.attention_metadata import AttentionMetadata
    from pagedjax.backends.jax.model import LlamaForCausalLM
    from pagedjax.backends.jax.parallel import (
        KV_CACHE,
        all_reduce_operands,
        make_mesh,
        param_specs,
        per_shard,
    )
    from pagedjax.distributed.tensor_parallel import TensorParallelPlan
    from pagedjax.kernels_pallas.reference import (
        ragged_paged_attention_reference,
        write_kv_reference,
    )

    plan = TensorParallelPlan.for_model(config, size)
    mesh, shard_config = make_mesh(size), plan.shard_config(config)
    module = LlamaForCausalLM(shard_config, jnp.bfloat16,
                              *per_shard(ragged_paged_attention_reference, write_kv_reference,
                                         mesh, plan))
    ids = jnp.zeros(num_tokens, jnp.int32)
    cache = jax.ShapeDtypeStruct((8 * num_tokens, shard_config.num_kv_heads, 16,
                                  config.head_dim), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, KV_CACHE))
    caches = [(cache, cache)] * config.num_layers
    rope = jnp.zeros((64, config.head_dim))
    meta = AttentionMetadata(ids, ids, jnp.zeros(num_tokens + 1, jnp.int32),
                             jnp.zeros(num_tokens, jnp.int32),
                             jnp.zeros((num_tokens, 8), jnp.int32), rope, rope)
    def forward_logits(m, input_ids, kv_caches):  # the model's step: hidden states, then logits
        return m.logits(m(input_ids, kv_caches, meta)[0])

    abstract = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, caches,
                                                  method=forward_logits))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=NamedSharding(mesh, s)),
                          abstract, param_specs(abstract, plan))
    forward = jax.jit(lambda p, c: module.apply(p, ids, c, method=forward_logits))
    return all_reduce_operands(forward.lower(params, caches).compile().as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-tokens", type=int, default=16,
                        help="tokens of the step whose HLO is checked")
    add_out_argument(parser)
    args = parser.parse_args()

    from pagedjax.distributed.tensor_parallel import TensorParallelPlan

    rows = []
    for name, fields in SHAPES.items():
        config = model_config(fields)
        for size in (2, 4, 8):
            plan = TensorParallelPlan.for_model(config, size)
            row = {"model": name, "TP": size, "KV head copies": plan.kv_replicas}
            for tokens in (1, 16, 64, 2048):
                per_layer = plan.all_reduce_bytes_per_layer(tokens, config.hidden_size, BF16)
                row[f"MB/step T={tokens}"] = per_layer * config.num_layers / 1e6
            # XLA:CPU reduces the bf16 dots' float32 results, so compare elements, not bytes.
            t, h = args.check_tokens, config.hidden_size
            planned = plan.all_reduce_bytes_per_layer(t, h, BF16) // BF16 * config.num_layers
            operands = hlo_all_reduces(config, size, t)
            row["HLO all-reduced [T, H]"] = sum(shape == (t, h) for _, shape in operands)
            row["HLO other elements"] = sum(math.prod(s) for _, s in operands if s != (t, h))
            row[f"HLO = plan (T={t})"] = (
                sum(math.prod(s) for _, s in operands if s == (t, h)) == planned)
            rows.append(row)
            print(row, flush=True)
    columns = ["model", "TP", "KV head copies", *(f"MB/step T={t}" for t in (1, 16, 64, 2048)),
               "HLO all-reduced [T, H]", "HLO other elements",
               f"HLO = plan (T={args.check_tokens})"]
    print_table(rows, columns)
    path = write_json("tp_comm.json", {"dtype": "bfloat16", "results": rows,
                                       "environment": environment()}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
