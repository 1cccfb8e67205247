"""Decode steps against the memory-bandwidth floor, per backend and batch size.

A decode step reads every weight once and each sequence's KV cache, so no step can beat
(weight bytes + KV bytes read) / the device's copy bandwidth (bytes read + written per second by a
device copy in this process, or --copy-gbs). For each batch size B, B requests of --context
prompt tokens are prefilled, then --steps engine steps that decode one token per sequence are
timed one by one; the median counts, beside the floor, the engine's own breakdown (schedule,
prepare, execute, update, output) and the host share. Requests are added as LLM.generate adds
them (one output each, at the end; --output-kind delta: an output every step, as the server
streams). With --profile, a few more steps run under the framework's profiler and the device
time is listed by kernel (where a step's time goes).

    python benchmarks/decode_step.py [--model DIR | --random-llama] [--backend jax|torch]
        [--batch-sizes 1 16 64] [--context 512] [--steps 32] [--dtype auto] [--profile]
        [--copy-gbs GBS] [--output-kind final|delta] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    WARMUP_STEPS,
    accelerator_tag,
    add_async_scheduling_argument,
    add_dtype_argument,
    add_model_arguments,
    add_out_argument,
    add_output_kind_argument,
    args_record,
    environment,
    finish,
    median_seconds,
    model_dir,
    model_name,
    output_kind,
    print_table,
    start_decoding,
    stderr_fd_captured,
    step_phases_ms,
    time_engine_steps,
    write_json,
)

from pagedjax.entrypoints.doctor import nvidia_gpus  # noqa: E402

PROFILE_STEPS = 8
TOP_KERNELS = 15


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_bytes_read(model_dir: str, dtype_bytes: int, tied: bool, fp8: bool = False) -> int:
    """Bytes of the weights one decode step reads: every parameter, in the engine's dtype, except
    an untied input embedding (only the batch's rows of it are read); fp8: the projections at
    one byte a weight (quantization="fp8")."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                projection = fp8 and name.endswith(tuple(f"{p}.weight" for p in _PROJECTIONS))
                total += int(np.prod(f.get_slice(name).get_shape())) * (
                    1 if projection else dtype_bytes)
    return total


def kv_bytes_read(model_config, batch: int, context: int, dtype_bytes: int) -> int:
    """Keys and values of `context` tokens per sequence, every layer."""
    return batch * context * model_config.kv_bytes_per_block(1, dtype_bytes)


def copy_bandwidth_gbs(backend: str) -> float:
    """On a GPU the framework's device copy of 1 GiB; on a CPU a NumPy copy of 128 MiB (past the
    L3; XLA's CPU copy runs on one thread), the same figure for both backends."""
    if not nvidia_gpus():
        x = np.ones(2**25, np.float32)
        y = np.empty_like(x)
        return 2 * x.nbytes / median_seconds(lambda: np.copyto(y, x), lambda _: None, 20) / 1e9
    if backend == "jax":
        from kernels_jax import copy_bandwidth_gbs as measure
    else:
        from kernels_torch import copy_bandwidth_gbs as measure
    gbs = measure(2**30, repeats=20)
    if backend == "torch":
        import torch

        torch.cuda.empty_cache()  # the engine sizes its KV pool from what is free
    return gbs


def time_decode_steps(llm, batch: int, num_steps: int) -> dict:
    """Median wall ms of num_steps engine steps, and the mean ms of each phase
    (`step_phases_ms`)."""
    seconds = time_engine_steps(llm, batch, num_steps)
    phases = step_phases_ms(llm.engine.step_timings)
    return {"step ms": 1e3 * statistics.median(seconds), "phases ms": phases,
            "host share": phases["host share"]}


def probe_step(llm, repeats: int = 50) -> dict:
    """The jax step's executable alone, on the input of one more engine step, called `repeats`
    times (the same tokens rewrite the same KV slots): ms per call back to back, one wait at the
    end ("pipelined": the larger of dispatch and device time), and ms per call waiting for the
    outputs each time ("synced": the engine's execute phase without its host work) in four
    arrangements of the buffers, since XLA re-records (updates) each command of the step's CUDA
    graph whose buffers moved since the last call:
    - "synced": the last call's outputs alive until this call has launched (as the engine's
      asynchronous output processing keeps them);
    - "outputs dropped first": the last call's outputs freed before this call;
    - "inputs on device": the same device input buffers every call (no host transfer);
    - "two executables": two loaded copies of the executable called in turn, the outputs kept
      as in "synced" (each copy's own graph sees the same addresses every other call).
    For each: the number of distinct output, last-token and KV-cache addresses seen, and where
    XLA logs them (TF_CPP_VMODULE=command_buffer_thunk=3), the command-buffer updates and
    their microseconds."""
    import jax
    from jax.experimental import serialize_executable

    runner = llm.engine.runner
    inputs = []
    execute_async = runner.execute_async
    runner.execute_async = lambda model_input: (inputs.append(model_input)
                                                or execute_async(model_input))
    try:
        llm.engine.step()
    finally:
        runner.execute_async = execute_async
    model_input = inputs[-1]
    executable = runner.executable(runner.step_key(model_input))
    jax.block_until_ready(runner.launch(executable, model_input))
    start = time.perf_counter()
    for _ in range(repeats):
        out = runner.launch(executable, model_input)
    jax.block_until_ready(out)
    result = {"pipelined ms": 1e3 * (time.perf_counter() - start) / repeats}
    del out

    def addresses(out) -> tuple[int, int, int]:
        first_cache = jax.tree.leaves(runner.kv_caches)[0]
        return (out.tokens.unsafe_buffer_pointer(), runner._last_tokens.unsafe_buffer_pointer(),
                first_cache.unsafe_buffer_pointer())

    def synced(name: str, step_input, executables, keep_last: bool = True) -> None:
        seconds, dispatch, seen, last = [], [], set(), []
        with stderr_fd_captured() as log:
            for i in range(repeats):
                if not keep_last:
                    last.clear()  # the only reference to the last call's outputs
                start = time.perf_counter()
                out = runner.launch(executables[i % len(executables)], step_input)
                dispatch.append(time.perf_counter() - start)
                jax.device_get(out.wanted(step_input.flags))
                seconds.append(time.perf_counter() - start)
                seen.add(addresses(out))
                last[:] = [out]
                del out
            last.clear()
        updates = re.findall(r"Updated command buffer in (\d+)", log["text"])
        result[f"{name} ms"] = 1e3 * statistics.median(seconds)
        result[f"{name}: dispatch ms"] = 1e3 * statistics.median(dispatch)
        result[f"{name}: addresses (out, last tokens, kv)"] = [len(set(a)) for a in zip(*seen)]
        if updates:
            result[f"{name}: graph updates"] = len(updates)
            result[f"{name}: update us"] = statistics.median(int(u) for u in updates)
        logged = [line[:300] for line in log["text"].splitlines() if "ommand" in line]
        if logged:  # XLA's command-buffer log (TF_CPP_VMODULE), whatever its wording
            result[f"{name}: command-buffer log lines"] = len(logged)
            result[f"{name}: command-buffer log sample"] = list(dict.fromkeys(logged))[:12]

    synced("synced", model_input, [executable])
    synced("synced, outputs dropped first", model_input, [executable], keep_last=False)
    on_device = dataclasses.replace(model_input, ints=jax.device_put(model_input.ints),
                                    floats=jax.device_put(model_input.floats))
    synced("synced, inputs on device", on_device, [executable], keep_last=False)
    try:  # a second copy: serialized and loaded again, as the runner makes it; on a CPU
        # compiled again (jax 0.10's CPU client cannot copy one it loaded from the store, and a
        # failed call would leave the caches it was given deleted)
        if runner._on_cpu:
            twin = runner._lower(runner.step_key(model_input)).compile()
        else:
            payload, in_tree, out_tree = serialize_executable.serialize(executable)
            twin = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=jax.devices()[:1])
        jax.block_until_ready(runner.launch(twin, model_input))
    except Exception as error:  # noqa: BLE001 (recorded, the other figures stand)
        result["two executables"] = f"not loaded: {error}"[:200]
    else:
        synced("synced, two executables", model_input, [executable, twin])
    return result


def profile_steps(llm, backend: str, num_steps: int) -> tuple[list[dict], float]:
    """The device's busiest kernels (ops on a CPU) over num_steps decode steps: name, calls and
    microseconds per step, busiest first; and the microseconds per step of every kernel."""
    if backend == "jax":
        import jax

        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(num_steps):
                    llm.engine.step()
            totals = _xplane_totals(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    else:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(num_steps):
                llm.engine.step()
        device = torch.cuda.is_available()
        totals = {e.key: (e.count, 1e-6 * (e.self_device_time_total if device
                                           else e.self_cpu_time_total))
                  for e in prof.key_averages()}
    busiest = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    every = 1e6 * sum(seconds for _, seconds in totals.values()) / num_steps
    return [{"kernel": name[:80], "calls/step": count / num_steps,
             "us/step": 1e6 * seconds / num_steps} for name, (count, seconds) in busiest], every


def _xplane_totals(path: str) -> dict[str, tuple[int, float]]:
    """name -> (events, seconds) in a JAX trace: the GPU kernels on the device planes' streams
    (else their "XLA Ops" line), or on a CPU the ops on the host's XLA threads."""
    from jax.profiler import ProfileData

    planes = list(ProfileData.from_file(path).planes)
    lines = []
    for plane in (p for p in planes if p.name.startswith("/device:")):
        plane_lines = list(plane.lines)
        lines += ([line for line in plane_lines if line.name.startswith("Stream")]
                  or [line for line in plane_lines if line.name == "XLA Ops"] or plane_lines)
    if not lines:
        lines = [line for p in planes if p.name == "/host:CPU" for line in p.lines
                 if line.name != "python"]
    totals: dict[str, tuple[int, float]] = {}
    for line in lines:
        for event in line.events:
            if event.name.startswith(("ThreadpoolListener", "end:", "ThunkExecutor")):
                continue
            name = re.sub(r"([._]\d+)+$", "", event.name)  # ffi_call.59, fusion.3: one kind
            count, seconds = totals.get(name, (0, 0.0))
            totals[name] = (count + 1, seconds + 1e-9 * event.duration_ns)
    return totals


def measure_batch(llm, args, batch: int, weights: int, copy_gbs: float) -> dict:
    engine = llm.engine
    model_config = engine.model_config
    ids = start_decoding(llm, batch, args.context, output_kind=output_kind(args),
                         max_tokens=engine.config.max_model_len - args.context, seed=batch)
    # the KV the median timed step reads: the mean context (prompts that were computed first
    # have decoded while the others were), half the timed tokens on
    context = round(statistics.mean(s.num_tokens for s in engine.scheduler.running)
                    + args.steps / 2)
    timed = time_decode_steps(llm, batch, args.steps)
    print(f"batch {batch}: median step {timed['step ms']:.3f} ms, phases (ms) "
          f"{ {k: round(v, 3) for k, v in timed['phases ms'].items()} }", flush=True)
    probe = probe_step(llm) if args.probe and args.backend == "jax" else None
    if probe:
        print(f"batch {batch}: the step's executable alone: {probe}", flush=True)
    profile, kernel_us = (profile_steps(llm, args.backend, PROFILE_STEPS) if args.profile
                          else (None, None))
    finish(llm, ids)
    kv = kv_bytes_read(model_config, batch, context, engine.config.kv_cache_dtype_bytes)
    floor_ms = 1e3 * (weights + kv) / (copy_gbs * 1e9)
    row = {"backend": args.backend, "batch": batch, "context": context,
           "weights GB": weights / 1e9, "KV GB": kv / 1e9, "floor ms": floor_ms,
           "step ms": timed["step ms"], "% of floor": 100 * floor_ms / timed["step ms"],
           "host share %": 100 * timed["host share"], "phases ms": timed["phases ms"],
           "tok/s": batch / timed["step ms"] * 1e3}
    if probe is not None:
        row["probe"] = probe
    if profile is not None:
        row["profile"], row["kernel us/step"] = profile, kernel_us
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, random_llama=True)
    parser.add_argument("--backend", choices=("jax", "torch"), default="jax")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch")
    add_dtype_argument(parser)
    add_async_scheduling_argument(parser)
    parser.add_argument("--profile", action="store_true",
                        help="also list where the device time of a step goes")
    parser.add_argument("--probe", action="store_true",
                        help="jax: also time the step's executable alone, pipelined and synced")
    parser.add_argument("--executable-copies", type=int, choices=(1, 2),
                        help="jax: decode steps alternate between this many copies of their "
                             "executable (default: the runner's, 2 on an accelerator)")
    parser.add_argument("--quantization", choices=("fp8", "int8"),
                        help="weights kept quantized (fp8: W8A8, FP8 GEMMs on Hopper)")
    parser.add_argument("--attention-impl", default="auto",
                        help="the engine's attention_impl (jax: pallas_fused writes the KV and "
                             "attends in one kernel a layer in decode steps)")
    parser.add_argument("--copy-gbs", type=float,
                        help="copy bandwidth (GB/s read + written) to use instead of measuring "
                             "this framework's")
    add_output_kind_argument(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.config import ModelConfig

    copy_gbs = args.copy_gbs or copy_bandwidth_gbs(args.backend)  # before the KV pool
    with model_dir(args):
        model_config = ModelConfig.from_pretrained(args.model)
        # room for the tokens decoded while later prompts are computed, then every step here
        max_len = args.context + 256 + WARMUP_STEPS + args.steps + PROFILE_STEPS
        start = time.perf_counter()
        llm = LLM(args.model, backend=args.backend, dtype=args.dtype,
                  max_model_len=max_len, max_num_seqs=max(args.batch_sizes),
                  enable_prefix_caching=False, async_scheduling=args.async_scheduling,
                  quantization=args.quantization, attention_impl=args.attention_impl)
        startup = {"startup s": time.perf_counter() - start,
                   "steps loaded from the store": getattr(llm.engine.runner, "num_cache_hits",
                                                          None)}
        print(f"startup {startup['startup s']:.1f} s ({startup['steps loaded from the store']} "
              "steps loaded from the executable store)", flush=True)
        if args.executable_copies:
            llm.engine.runner.executable_copies = args.executable_copies
        weights = weight_bytes_read(args.model, llm.engine.config.dtype_bytes,
                                    model_config.tie_word_embeddings,
                                    fp8=args.quantization == "fp8")
        rows = [measure_batch(llm, args, b, weights, copy_gbs) for b in args.batch_sizes]
        dtype = llm.engine.config.dtype
        llm.shutdown()
    print(f"{args.backend}, {dtype}, copy bandwidth {copy_gbs:.1f} GB/s, median of "
          f"{args.steps} decode steps")
    print_table(rows, ["backend", "batch", "context", "weights GB", "KV GB", "floor ms",
                       "step ms", "% of floor", "host share %", "tok/s"])
    for row in rows:
        print(f"batch {row['batch']} phases (ms):",
              {k: round(v, 3) for k, v in row["phases ms"].items()})
        if "probe" in row:
            print(f"batch {row['batch']} executable alone (ms):",
                  {k: round(v, 3) if isinstance(v, float) else v
                   for k, v in row["probe"].items()})
        if "kernel us/step" in row:
            print(f"batch {row['batch']}: every kernel {row['kernel us/step']:.1f} us/step")
        for kernel in row.get("profile", []):
            print(f"    {kernel['us/step']:9.1f} us/step  {kernel['calls/step']:6.1f} calls  "
                  f"{kernel['kernel']}")
    env = environment()
    path = write_json(
        f"decode_step_{args.backend}_{model_name(args)}_{accelerator_tag(env)}"
        f"{'' if args.async_scheduling else '_sync'}"
        f"{f'_{args.quantization}' if args.quantization else ''}"
        f"{'' if args.attention_impl == 'auto' else f'_{args.attention_impl}'}"
        f"{f'_copies{args.executable_copies}' if args.executable_copies else ''}.json",
        {"args": args_record(args), "copy_bandwidth_gbs": copy_gbs, "dtype": dtype, **startup,
         "results": rows, "environment": env}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
