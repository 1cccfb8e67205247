"""The benchmark harness's statistics: paired rounds and their interval."""

import math

import pytest

from pagedjax.benchmarks.harness import in_turn, paired_ratio


def test_paired_ratio_is_the_geometric_mean_of_each_rounds_ratio_with_students_interval():
    # rounds where the host ran at 1x, 2x and 0.5x speed: a system 1.25x faster in each
    reference = [1.0, 0.5, 2.0]
    seconds = [0.8, 0.4, 1.6]
    mean, low, high = paired_ratio(seconds, reference)
    assert (mean, low, high) == pytest.approx((1.25, 1.25, 1.25))
    # log ratios 0 and log 2: mean log 2 / 2, sd log 2 / sqrt 2, t(1 df) 6.314
    mean, low, high = paired_ratio([1.0, 1.0], [1.0, 2.0])
    half = 6.314 * (math.log(2) / math.sqrt(2)) / math.sqrt(2)
    assert mean == pytest.approx(math.sqrt(2))
    assert (low, high) == pytest.approx((math.exp(math.log(2) / 2 - half),
                                         math.exp(math.log(2) / 2 + half)))
    assert low < 1 < mean < high


def test_one_round_has_no_interval_and_unpaired_rounds_are_an_error():
    mean, low, high = paired_ratio([2.0], [3.0])
    assert mean == pytest.approx(1.5) and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def test_in_turn_starts_each_round_one_system_later():
    assert [in_turn("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"),
                                                   list("abc")]


def test_llamacpp_builds_natively_except_on_a_cpu_with_amx(tmp_path):
    """peer_llamacpp.cpu_options: GGML_NATIVE where the CPU has no AMX; with AMX (whose matmul
    segfaulted in llama.cpp on stop 78's Xeon) each feature the CPU has by name, AMX never."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_llamacpp.py"
    spec = importlib.util.spec_from_file_location("peer_llamacpp", path)
    peer_llamacpp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer_llamacpp)  # it puts benchmarks/ on sys.path, as run

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c bmi2\n")
    assert peer_llamacpp.cpu_options(cpuinfo) == ["-DGGML_NATIVE=ON"]
    cpuinfo.write_text("flags\t\t: avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n")
    options = peer_llamacpp.cpu_options(cpuinfo)
    assert options[0] == "-DGGML_NATIVE=OFF" and not any("AMX" in o for o in options)
    assert "-DGGML_AVX512=ON" in options and "-DGGML_AVX512_VNNI=ON" in options
    assert "-DGGML_AVX512_BF16=OFF" in options and "-DGGML_AVX2=ON" in options
