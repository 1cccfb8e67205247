"""`pagedjax doctor`: the report on this (CPU) machine, and the problems it flags on a GPU one."""

from __future__ import annotations

import json
from pathlib import Path

from pagedjax.entrypoints import doctor
from pagedjax.entrypoints.cli import main


def test_doctor_reports_this_machine(capsys) -> None:
    import torch

    from pagedjax.backends.jax.attention import resolve_attention

    on_gpu = torch.cuda.is_available()
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"]["cuda_available"] is on_gpu
    jax_attention = resolve_attention("auto").name  # what the JAX backend will use here
    assert report["jax"]["attention"].split()[0] == jax_attention
    if jax_attention != "reference":  # the smoke run compared it with the reference
        assert report["smoke_jax"]["ran"] == jax_attention
        assert report["smoke_jax"]["max_abs_err"] < 1e-4
    if on_gpu:
        assert report["jax"]["backend"] == "gpu"
        assert report["jax"]["attention"] == "pallas (compiled with Triton)"
        assert report["ops_build"]["backend"] == "cuda" and report["ops_build"]["cuda_arch_flags"]
    else:
        assert report["jax"]["backend"] == "cpu"
        assert report["ops_build"]["backend"] == "cpp"
        assert "_cuda" not in Path(report["ops_build"]["build_directory"]).name
    assert report["smoke_torch"]["ran"] == ("cuda on cuda" if on_gpu else "cpp on cpu")
    assert report["smoke_torch"]["max_abs_err"] < 1e-4
    assert report["versions"]["jax"] and report["versions"]["torch"]
    assert report["problems"] == []


def test_doctor_text_report(capsys) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ops_build:\n  build_directory:" in out and out.rstrip().endswith("problems: none")


def _gpu_report(**changes) -> dict:
    report = {
        "nvidia_smi": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580.65", "memory_mib": 81559}],
        "jax": {"backend": "gpu", "attention": "pallas (compiled with Triton)"},
        "torch": {"cuda_build": "13.0", "cuda_available": True},
        "ops_build": {"backend": "cuda"},
        "smoke_jax": {"ran": "pallas", "max_abs_err": 1e-6},
        "smoke_torch": {"ran": "cuda on cuda", "max_abs_err": 1e-6},
    }
    for key, value in changes.items():
        report[key] = value
    return report


def test_a_healthy_gpu_machine_has_no_problems() -> None:
    assert doctor._problems(_gpu_report()) == []


def test_problems_on_a_gpu_machine() -> None:
    problems = doctor._problems(_gpu_report(
        jax={"backend": "cpu"}, torch={"cuda_available": False},
        ops_build={"backend": "failed", "error": "CudaBuildError: nvcc not found\nmore"},
        smoke_jax={"ran": "pallas", "max_abs_err": 3e-3},
    ))
    assert any("JAX runs on CPU" in p and "jax[cuda13]" in p for p in problems)
    assert any("torch does not" in p for p in problems)
    assert "ops_build: CudaBuildError: nvcc not found" in problems
    assert any("smoke_jax: max abs error 3.00e-03" in p for p in problems)


def test_problems_make_the_exit_status_one(monkeypatch, capsys) -> None:
    monkeypatch.setattr(doctor, "collect", lambda: dict(_gpu_report(), problems=["broken"]))
    assert main(["doctor"]) == 1
    assert "PROBLEMS:\n  - broken" in capsys.readouterr().out
