"""Everything a GPU run should tell us: `--part all` in one command of under 10 minutes, or one
part at a time (each under 9 minutes).

    python benchmarks/gpu_suite.py --part NAME [--part NAME ...] --out DIR [--dry-run]

`all` (a lent GPU's first command) runs, in this order, as many of its steps as fit 570 s (a step
that would run past the deadline gets what is left; one with under 15 s is skipped and recorded
so): the GPU tests (kernels compiled and the CUDA op against the float64 oracle; greedy parity with
HF; async scheduling, branch-free and donated-output steps against the synchronous, branched
engine, on the device), decode steps at batch 1/16/64 on both backends (jax with its optimized HLO
dumped and archived, then with attention_impl="pallas_fused", its weights stacked, cuBLAS GEMMs
and XLA's command-buffer log; torch, then with attention_impl="cuda_fused"; both with
quantization="fp8"), jax's attention kernels against JAX's op, a mixture of experts' expert block
per form at Qwen3-30B-A3B's shape (benchmarks/moe_layer.py), torch's speculation at batch 1 and
32, torch's synchronous decode step and its attention kernels, the 8B shape at batch 1, and jax's
speculation (the longest) last. `--budget-s` shortens its deadline (room for an install in the
same command); `--resume OUT/suite.json`, a second command on a machine still warm, skips the steps
the first finished ok and runs what it left; `--archive $OUT` packs the results into one file after
each step (a GPU machine sends back 8 files, 2 folders down: keep --out outside $OUT). The XLA
command-buffer flags left `all` once measured on an H200 (RESULTS.md, 2026-12-04: no gain).

The other parts (in the order a first run should take them):
- environment: `pagedjax doctor` (which builds the CUDA ops once and caches them), pip list;
- correctness: the kernel tests with the gpu-marked ones (Pallas compiled vs the float64 oracle,
  the CUDA op on device tensors with NaN-poisoned pools), then greedy parity jax/torch/HF in
  float32 (exact) and bf16 (top-5 rule) on tiny models (a mixture of experts among them), and
  the backend test files;
- kernels: benchmarks/attention_kernels.py, B 1/8/64 x context 512/2048/8192, JAX then torch;
- throughput, latency (`pagedjax bench throughput|latency`): on a Llama-3.2-1B-shaped random
  bf16 checkpoint made here;
- spec_decode: the demo pair, one backend per process;
- decode_step, decode_step_8b: decode steps at batch 1/16/64 against the bandwidth floor, with
  the host share, a profile of the device time and (jax) the step's executable timed alone
  (dispatch, back to back, synced), on the 1B and a Llama-3-8B-shaped checkpoint;
- core_process: the offline engine's decode step with its core in the process or in its own;
- moe_layer: benchmarks/moe_layer.py, a mixture of experts' expert block per form (kernel
  choice) at Qwen3-30B-A3B's shape, JAX then torch.

Every step is a subprocess (JAX and torch never share one, XLA's allocator keeps what it
freed) under a timeout; a part's timeouts add up to under 9 minutes. Logs go to OUT/PART/STEP.log
(and stdout), results to OUT/PART/, and OUT/suite.json records each step (command, exit code,
seconds) as soon as it ends. --dry-run runs every part at toy size, on CPU in about a minute per
part (CI runs it). Exit status 1 when a step failed, timed out or is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
BENCH = ("-m", "pagedjax.entrypoints.cli", "bench")  # `pagedjax bench`: latency, throughput
PART_BUDGET_S = 540  # 9 minutes: under the 10-minute limit of one command on the GPU machines
ALL_BUDGET_S = 570  # `all`: its steps run until this deadline
MIN_STEP_S = 15  # a step with less time than this left is skipped
MODEL_CACHE = REPO / "build" / "gpu_suite_models"  # build/ is git-ignored

# Llama-3.2-1B's shape (random weights): 1.24B parameters, GQA 32/8, head_dim 64.
LLAMA_3_2_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# Llama-3-8B's shape (random weights): 8.03B parameters, GQA 32/8, head_dim 128, untied head.
LLAMA_3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
SHAPES = {"1b": LLAMA_3_2_1B, "8b": LLAMA_3_8B}
SHARD_BYTES = 4 << 30  # safetensors shard size of the checkpoints made here
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@dataclasses.dataclass(frozen=True)
class Step:
    """One subprocess: `python ARGV...` run from the repository root."""

    name: str
    argv: tuple[str, ...]
    timeout_s: int
    stdout_file: str | None = None  # also save stdout alone to PART/stdout_file
    env: tuple[tuple[str, str], ...] = ()  # set for this step (XLA_FLAGS)


@dataclasses.dataclass(frozen=True)
class Context:
    out: Path
    dry_run: bool
    model_cache: Path
    budget_s: int = ALL_BUDGET_S  # `all`'s deadline, from its start
    done: frozenset[str] = frozenset()  # `all`'s steps an earlier run finished ok (--resume)
    archive: Path | None = None  # --archive: where results.tar.gz is rewritten after each step

    def model_dir(self, shape: str = "1b") -> Path:
        if self.dry_run:
            return self.model_cache / "toy-bf16"
        names = {"1b": "llama-3.2-1b-shape-bf16", "8b": "llama-3-8b-shape-bf16"}
        return self.model_cache / names[shape]


def _pytest(junit: Path, *args: str) -> tuple[str, ...]:
    return ("-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args)


def environment_steps(ctx: Context) -> list[Step]:
    return [Step("doctor", ("-m", "pagedjax.entrypoints.cli", "doctor", "--json"), 420,
                 "doctor.json"),
            Step("pip_list", ("-m", "pip", "list", "--format", "json"), 60, "pip_list.json")]


def correctness_steps(ctx: Context) -> list[Step]:
    part = ctx.out / "correctness"
    if ctx.dry_run:  # a sample of the same files
        kernels = ("tests/kernels/test_pallas_lowering.py", "tests/kernels/test_cuda_ops.py",
                   "-k", "1b or (attention_float32 and decode)")
        parity = ("tests/e2e/test_gpu_parity.py", "-k", "float32")
    else:  # everything, the gpu-marked tests included (nvcc: the environment part built it)
        kernels = ("-m", "(gpu or not gpu) and not nvcc", "tests/kernels")
        parity = ("-m", "gpu or not gpu", "tests/e2e/test_gpu_parity.py",
                  "tests/backends/test_jax_backend.py", "tests/backends/test_torch_backend.py")
    return [Step("kernel_tests", _pytest(part / "kernel_tests.xml", *kernels), 300),
            Step("parity_tests", _pytest(part / "parity_tests.xml", *parity), 230)]


def kernels_steps(ctx: Context) -> list[Step]:
    sweep = (("--batches", "1", "2", "--contexts", "32", "--repeats", "1") if ctx.dry_run
             else ("--batches", "1", "8", "64", "--contexts", "512", "2048", "8192"))
    script, out = str(BENCHMARKS / "attention_kernels.py"), str(ctx.out / "kernels")
    return [Step(f"kernels_{fw}", (script, "--framework", fw, *sweep, "--out", out), 260)
            for fw in ("jax", "torch")]


def moe_layer_steps(ctx: Context, out: Path | None = None) -> list[Step]:
    """A mixture of experts' expert block per form at Qwen3-30B-A3B's shape, one framework per
    process (on a GPU: 1 to 64 tokens in powers of two, and 512: where the gathered form stops
    paying; jax's rule was gathered while tokens x top-k <= experts, which chose it at 8 tokens
    on the H200, 1.8x slower than grouped there (stop 76): now E / 4 pairs, torch's still E)."""
    sweep = (("--tokens", "1", "3", "--repeats", "2") if ctx.dry_run else
             ("--tokens", "1", "2", "4", "8", "16", "32", "64", "512"))
    script, out = str(BENCHMARKS / "moe_layer.py"), str(out or ctx.out / "moe_layer")
    return [Step(f"moe_layer_{fw}", (script, "--framework", fw, *sweep, "--out", out), 150)
            for fw in ("jax", "torch")]


def _make_model_step(ctx: Context, shape: str = "1b", timeout_s: int = 150) -> Step:
    argv = (str(Path(__file__)), "--make-model", str(ctx.model_dir(shape)), "--shape", shape)
    name = "make_model" if shape == "1b" else f"make_model_{shape}"
    return Step(name, (*argv, "--dry-run") if ctx.dry_run else argv, timeout_s)


def throughput_steps(ctx: Context) -> list[Step]:
    size = (("--num-requests", "4", "--max-input", "16", "--max-output", "8", "--max-num-seqs",
             "4", "--hf-batch-size", "2") if ctx.dry_run else ())
    out = str(ctx.out / "throughput")
    return [_make_model_step(ctx), *(
        Step(f"throughput_{backend}", (*BENCH, "throughput", "--model", str(ctx.model_dir()),
                                       "--backend", backend, *size, "--out", out), 190)
        for backend in ("jax", "torch"))]


def latency_steps(ctx: Context) -> list[Step]:
    out = str(ctx.out / "latency")
    max_tokens = "4" if ctx.dry_run else "128"
    return [_make_model_step(ctx), *(
        Step(f"latency_{backend}", (*BENCH, "latency", "--model", str(ctx.model_dir()),
                                    "--backend", backend, "--max-tokens", max_tokens, "--out",
                                    out), 190)
        for backend in ("jax", "torch"))]


def spec_decode_steps(ctx: Context) -> list[Step]:
    grid = (("--batch-sizes", "1", "--ks", "1", "--max-tokens", "4", "--prompt-sets", "code")
            if ctx.dry_run else
            ("--batch-sizes", "1", "32", "--ks", "2", "4", "--max-tokens", "64"))
    script = str(BENCHMARKS / "spec_decode.py")
    return [Step(f"spec_decode_{backend}", (script, "--backends", backend, *grid, "--out",
                                            str(ctx.out / "spec_decode" / backend)), 260)
            for backend in ("jax", "torch")]


def core_process_steps(ctx: Context) -> list[Step]:
    size = (("--batch-sizes", "1", "2", "--context", "16", "--steps", "4", "--rounds", "1")
            if ctx.dry_run else ("--batch-sizes", "1", "16", "64", "--context", "512"))
    script, out = str(BENCHMARKS / "probes" / "core_process.py"), str(ctx.out / "core_process")
    return [_make_model_step(ctx), *(
        Step(f"core_process_{backend}", (script, "--model", str(ctx.model_dir()), "--backend",
                                         backend, *size, "--out", out), timeout_s)
        for backend, timeout_s in (("jax", 200), ("torch", 180)))]


def _decode_step_steps(ctx: Context, shape: str, timeouts_s: dict[str, int]) -> list[Step]:
    size = (("--batch-sizes", "1", "2", "--context", "16", "--steps", "4") if ctx.dry_run else
            ("--batch-sizes", "1", "16", "64", "--context", "512", "--steps", "32"))
    script, out = str(BENCHMARKS / "decode_step.py"), str(ctx.out / f"decode_step_{shape}")
    return [_make_model_step(ctx, shape, timeouts_s["make"]), *(
        Step(f"decode_step_{backend}", (script, "--model", str(ctx.model_dir(shape)), "--backend",
                                        backend, *size, "--profile", "--probe", "--out", out),
             timeouts_s[backend])
        for backend in ("jax", "torch"))]


def decode_step_steps(ctx: Context) -> list[Step]:
    return _decode_step_steps(ctx, "1b", {"make": 150, "jax": 200, "torch": 180})


def all_steps(ctx: Context) -> list[Step]:
    """`all`, in priority order (see the module docstring); run_parts holds it to ALL_BUDGET_S."""
    part, dry = ctx.out / "all", ctx.dry_run
    tests = ("tests/e2e/test_gpu_parity.py", "tests/engine/test_async_scheduling.py",
             "tests/backends/test_donated_outputs.py", "tests/backends/test_branch_free_steps.py",
             "tests/backends/test_stacked_params.py")
    engine_tests = (*tests, "-k", "float32 or outputs or match or buffers or places or copies")
    kernel_tests = ("-m", "gpu and not nvcc", "tests/kernels")
    if dry:  # a sample: the gpu-marked tests deselect themselves on a CPU
        kernel_tests = ("tests/kernels/test_pallas_lowering.py", "-k", "1b")
        engine_tests = ("tests/backends/test_donated_outputs.py", "-k", "places")
    model, model_8b = str(ctx.model_dir()), str(ctx.model_dir("8b"))
    decode = str(BENCHMARKS / "decode_step.py")
    size = (("--context", "16", "--steps", "4") if dry else ("--context", "512", "--steps", "32"))
    batches = ("1", "2") if dry else ("1", "16", "64")

    def decode_step(name: str, backend: str, *flags: str, timeout_s: int,
                    env: tuple = (), model_dir: str = model, batch_sizes=batches) -> Step:
        return Step(name, (decode, "--model", model_dir, "--backend", backend, "--batch-sizes",
                           *batch_sizes, *size, *flags, "--out", str(part / name)),
                    timeout_s, env=env)

    dump = part / "xla_dump"
    dump_flags = (f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                  "--xla_dump_hlo_module_re=jit_step")  # the step (StepBody.__name__)
    kernel_sizes = (("--batches", "1", "2", "--contexts", "32", "--repeats", "1") if dry
               else ("--batches", "1", "8", "64", "--contexts", "512", "2048", "8192"))
    spec = (("--batch-sizes", "1", "--ks", "1", "--max-tokens", "4") if dry else
            # 256 tokens: at 64, batch 32's adaptive run was 37 steps, 49 ms (stop 78), too
            # short for an online policy (it tried k = 0 in 4 steps, then drafted k = 4 in 31)
            ("--batch-sizes", "1", "32", "--ks", "4", "--max-tokens", "256", "--max-model-len",
             "1024", "--modes", "k=0",
             "k=4", "adaptive", "suffix", "--prompt-sets", "chat", "code"))
    def kernels(fw: str) -> Step:
        return Step(f"kernels_{fw}", (str(BENCHMARKS / "attention_kernels.py"), "--framework",
                                      fw, *kernel_sizes, "--out", str(part / "kernels")), 120)

    def spec_decode(backend: str, timeout_s: int, *extra: str) -> Step:
        return Step(f"spec_decode_{backend}", (str(BENCHMARKS / "spec_decode.py"), "--backends",
                                              backend, *spec, *extra, "--out",
                                              str(part / "spec_decode")), timeout_s)

    return [
        Step("doctor", ("-m", "pagedjax.entrypoints.cli", "doctor", "--json"), 150,
             "doctor.json"),
        Step("kernel_gpu_tests", _pytest(part / "kernel_gpu_tests.xml", *kernel_tests), 120),
        Step("engine_gpu_tests", _pytest(part / "engine_gpu_tests.xml", *engine_tests), 210),
        _make_model_step(ctx, "1b", 60),
        decode_step("decode_step_jax", "jax", "--profile", "--probe", timeout_s=120,
                    env=(("XLA_FLAGS", dump_flags),)),
        Step("xla_dump_archive", ("-c", "import shutil, sys; shutil.make_archive(sys.argv[1], "
                                  "'gztar', sys.argv[2]); shutil.rmtree(sys.argv[2])",
                                  str(dump), str(dump)), 30),
        decode_step("decode_step_jax_fused", "jax", "--attention-impl", "pallas_fused",
                    "--profile", timeout_s=100),
        # issue 50 item 4: the layers' weights stacked (a few arrays a call), off by default
        decode_step("decode_step_jax_stacked", "jax", "--profile", timeout_s=100,
                    env=(("PAGEDJAX_STACK_LAYER_PARAMS", "1"),)),
        # cuBLAS for the projections instead of XLA's Triton GEMM fusions: at batch 1 those
        # read 1.95 GB in 646 µs (3.0 TB/s of 4.2, stop 78); the head's cuBLAS-like 4.2
        decode_step("decode_step_jax_cublas", "jax", "--profile", timeout_s=100,
                    env=(("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false"),),
                    batch_sizes=("1", "64") if not dry else batches),
        # XLA's log of each command-buffer update: whether jax's ~0.74 ms launch at batch 1
        # (~3 µs for each of ~250 kernels, stop 78) is graph updates or launches one by one
        decode_step("decode_step_jax_graph_log", "jax", "--probe", timeout_s=90,
                    env=(("TF_CPP_VMODULE", "command_buffer_thunk=3,command_buffer_cmd=2"),),
                    batch_sizes=("1",)),
        decode_step("decode_step_torch", "torch", "--profile", timeout_s=60),
        # issue 50 item 5 (torch): a decode step's KV write and attention in one CUDA kernel
        decode_step("decode_step_torch_fused", "torch", "--attention-impl", "cuda_fused",
                    "--profile", timeout_s=60),
        *(decode_step(f"decode_step_{backend}_fp8", backend, "--quantization", "fp8",
                      "--profile", timeout_s=timeout_s)  # stop 78: jax's took 101-155 s cold
          for backend, timeout_s in (("torch", 75), ("jax", 160))),
        # Then what earlier runs left unmeasured or undecided, the longest last (stop 78: two
        # calls of 545 and 235 s reached jax's FP8 step; jax's speculation never finished)
        kernels("jax"),
        *moe_layer_steps(ctx, part / "moe_layer"),
        # draft-model steps launched ahead (async speculation: jax's default, torch's where
        # PAGEDJAX_ASYNC_SPECULATION=1) beside waiting for the last one's tokens (on a CPU,
        # jax: 1.02-1.29x faster at k = 4, stop 79)
        spec_decode("torch", 100, "--async-speculation", "both"),
        spec_decode("jax", 180, "--async-speculation", "both"),
        decode_step("decode_step_torch_sync", "torch", "--no-async-scheduling", timeout_s=45),
        kernels("torch"),
        _make_model_step(ctx, "8b", 150),
        decode_step("decode_step_8b_jax", "jax", timeout_s=200, model_dir=model_8b,
                    batch_sizes=("1",)),
    ]


def decode_step_8b_steps(ctx: Context) -> list[Step]:
    # the weights are drawn on the GPU; jax compiles 32 layers per step shape
    return _decode_step_steps(ctx, "8b", {"make": 150, "jax": 230, "torch": 160})


PARTS: dict[str, Callable[[Context], list[Step]]] = {
    "environment": environment_steps,
    "correctness": correctness_steps,
    "kernels": kernels_steps,
    "throughput": throughput_steps,
    "latency": latency_steps,
    "spec_decode": spec_decode_steps,
    "decode_step": decode_step_steps,
    "decode_step_8b": decode_step_8b_steps,
    "core_process": core_process_steps,
    "moe_layer": moe_layer_steps,
    "all": all_steps,
}


def make_model(out_dir: Path, dry_run: bool, shape: str = "1b") -> Path:
    """A random bf16 Llama checkpoint (SHAPES[shape], or a toy one) with the test tokenizer;
    reused when a complete one is already there. The weights are drawn on the GPU where there is
    one (N(0, 0.02), norms 1) and written in SHARD_BYTES safetensors shards: an 8B model in about
    a minute, where initialising it through transformers takes several."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedjax.testing.checkpoints import MULTIBYTE_TEXT, stdlib_corpus, train_tokenizer

    if (out_dir / "config.json").exists():
        print(f"reusing {out_dir}")
        return out_dir
    tokenizer = train_tokenizer(stdlib_corpus() + [MULTIBYTE_TEXT])
    dims = dict(TOY, vocab_size=len(tokenizer)) if dry_run else SHAPES[shape]
    config = LlamaConfig(**dims, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # the embedding serves as the head
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor_shape in shapes.items():
        nbytes = 2 * tensor_shape.numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    partial = out_dir.with_name(out_dir.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for names, file in zip(shards, files):
        tensors = {}
        for name in names:
            tensor = torch.empty(shapes[name], dtype=torch.bfloat16, device=device)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, config.initializer_range, generator=generator)
            tensors[name] = tensor.cpu()
        save_file(tensors, str(partial / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(2 * s.numel() for s in shapes.values())},
                 "weight_map": {name: file for names, file in zip(shards, files)
                                for name in names}}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out_dir)  # complete or absent, never half-written
    params = sum(s.numel() for s in shapes.values())
    print(f"wrote {out_dir} ({params / 1e9:.2f}B params, {len(files)} files)")
    return out_dir


def run_step(step: Step, part_dir: Path, env: dict[str, str]) -> dict:
    """Runs one step (its own process group, killed whole on timeout), teeing output to a log."""
    record = dict(step=step.name, command=[sys.executable, *step.argv], timeout_s=step.timeout_s)
    env = dict(env, **dict(step.env))
    if step.env:
        record["env"] = dict(step.env)
    script = Path(step.argv[0])
    if script.suffix == ".py" and not script.exists():
        return dict(record, status="missing", detail=f"{script} does not exist")
    start = time.monotonic()
    with (part_dir / f"{step.name}.log").open("w") as log:
        proc = subprocess.Popen(record["command"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        stdout = _tee(proc, log, start + step.timeout_s)
        try:
            rc, timed_out = proc.wait(timeout=max(0.0, start + step.timeout_s
                                                  - time.monotonic())), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    if step.stdout_file:
        (part_dir / step.stdout_file).write_text("".join(stdout))
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    return dict(record, status=status, returncode=rc, seconds=round(time.monotonic() - start, 1))


def _tee(proc: subprocess.Popen, log, deadline: float) -> list[str]:
    """Copies the child's stdout and stderr to log and to our stdout until both close or the
    deadline passes; returns the stdout lines."""
    stdout_lines, selector = [], selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            line = key.fileobj.readline()
            if not line:
                selector.unregister(key.fileobj)
                continue
            if key.fileobj is proc.stdout:
                stdout_lines.append(line)
            log.write(line)
            log.flush()
            print(line, end="", flush=True)
    return stdout_lines


def finished_steps(suite_json: Path) -> frozenset[str]:
    """The `all` steps an earlier run's suite.json records as ok (what --resume skips)."""
    records = json.loads(suite_json.read_text())["steps"]
    return frozenset(r["step"] for r in records if r["part"] == "all" and r["status"] == "ok")


def archive_results(out: Path, to: Path) -> None:
    """Everything under out as to/results.tar.gz, and each archive already there (the XLA
    dump's) copied beside it: a GPU machine sends back at most 8 files, 2 folders down. The
    XLA dump's folder, still being written, is left out."""
    to.mkdir(parents=True, exist_ok=True)
    partial = to / "results.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            skip = (path.name.endswith(".tar.gz") or "xla_dump" in path.parent.parts
                    or to == path or to in path.parents)
            if path.is_file() and not skip:
                tar.add(path, arcname=str(path.relative_to(out)))
    partial.rename(to / "results.tar.gz")
    for made in out.rglob("*.tar.gz"):
        if made.parent != to:
            shutil.copyfile(made, to / made.name)


def run_parts(names: list[str], ctx: Context) -> list[dict]:
    """Every step of every named part; OUT/suite.json is rewritten after each step."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    records: list[dict] = []
    summary = ctx.out / "suite.json"
    for name in names:
        part_dir = ctx.out / name
        part_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + ctx.budget_s if name == "all" else None
        for step in PARTS[name](ctx):
            if name == "all" and step.name in ctx.done and not step.name.startswith("make_model"):
                print(f"=== {name}/{step.name}: done in the run resumed", flush=True)
                continue
            if deadline is not None:  # what is left of `all`'s budget
                left = int(deadline - time.monotonic())
                if left < MIN_STEP_S:
                    records.append(dict(step=step.name, part=name, status="skipped",
                                        detail=f"{left} s of the budget left"))
                    print(f"=== {name}/{step.name}: skipped ({left} s left)", flush=True)
                    continue
                step = dataclasses.replace(step, timeout_s=min(step.timeout_s, left))
            print(f"=== gpu_suite {name}/{step.name} (timeout {step.timeout_s}s)", flush=True)
            records.append(dict(run_step(step, part_dir, env), part=name))
            print(f"=== {name}/{step.name}: {records[-1]['status']}", flush=True)
            summary.write_text(json.dumps(dict(dry_run=ctx.dry_run, steps=records), indent=2))
            if ctx.archive is not None:
                archive_results(ctx.out, ctx.archive)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=[*PARTS, "all"])
    parser.add_argument("--out", type=Path, help="output folder (logs, JSON, PNG)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes: any machine, CPU too")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE,
                        help=f"where the random checkpoints are made once (default {MODEL_CACHE})")
    parser.add_argument("--budget-s", type=int, default=ALL_BUDGET_S,
                        help=f"`all`'s deadline in seconds from its start (default {ALL_BUDGET_S}"
                             "; less when the command's limit holds an install too)")
    parser.add_argument("--resume", type=Path, metavar="SUITE_JSON",
                        help="`all` skips the steps this earlier run's suite.json records as ok "
                             "(a second command on a machine still warm)")
    parser.add_argument("--archive", type=Path, metavar="DIR",
                        help="after each step, write DIR/results.tar.gz of everything in --out "
                             "(and the XLA dump's archive beside it): pass $OUT on the GPU "
                             "machines, which send back 8 files at most")
    parser.add_argument("--make-model", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=list(SHAPES), default="1b", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.dry_run, args.shape)
        return 0
    if not args.part or args.out is None:
        parser.error("--part NAME and --out DIR are required")
    names = list(dict.fromkeys(args.part))
    if args.budget_s > ALL_BUDGET_S:
        parser.error(f"--budget-s {args.budget_s}: at most {ALL_BUDGET_S} (a command's limit "
                     "on the GPU machines is 600 s)")
    ctx = Context(out=args.out.resolve(), dry_run=args.dry_run,
                  model_cache=args.model_cache.resolve(), budget_s=args.budget_s,
                  done=finished_steps(args.resume) if args.resume else frozenset(),
                  archive=args.archive.resolve() if args.archive else None)
    records = run_parts(names, ctx)
    bad = [f"{r['part']}/{r['step']}: {r['status']}" for r in records
           if r["status"] not in ("ok", "skipped")]
    print("gpu_suite: " + ("all steps ok" if not bad else "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
