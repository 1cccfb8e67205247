"""benchmarks/gpu_suite.py: every part runs at toy size (--dry-run) on this machine and leaves its
results where a GPU run will look for them; every part fits its 9-minute budget."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "gpu_suite.py"


def _load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


gpu_suite = _load_suite()


@pytest.mark.parametrize("dry_run", [False, True])
def test_every_part_fits_its_budget_one_framework_per_process(tmp_path, dry_run):
    ctx = gpu_suite.Context(out=tmp_path, dry_run=dry_run, model_cache=tmp_path / "models")
    for name, steps_of in gpu_suite.PARTS.items():
        steps = steps_of(ctx)
        if name == "all":  # held to its deadline instead, its steps in priority order
            assert gpu_suite.ALL_BUDGET_S < 600
            assert [s.name for s in steps[:3]] == ["doctor", "kernel_gpu_tests",
                                                   "engine_gpu_tests"]
            assert len({s.name for s in steps}) == len(steps)  # a log each
        else:
            assert sum(step.timeout_s for step in steps) <= gpu_suite.PART_BUDGET_S < 600, name
        for step in steps:  # at most one framework named on each command line
            assert len({arg for arg in step.argv if arg in ("jax", "torch")}) <= 1, step


# the part each test checks, in the order they run
TEST_PARTS = {"test_environment": "environment", "test_correctness": "correctness",
              "test_kernels": "kernels", "test_spec_decode": "spec_decode",
              "test_decode_step": "decode_step", "test_moe_layer": "moe_layer"}


@pytest.fixture(scope="module")
def suite_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_suite")


@pytest.fixture(scope="module")
def part_runs(request, suite_out) -> Iterator[dict[str, Future]]:
    """The dry runs of the parts the session's tests check, two at a time (each is mostly one
    busy thread: imports, compiles), in the order the tests run; the toy model made first, as
    the parts share it."""
    names = []
    for item in request.session.items:
        name = _part_of(item) if item.module is request.module else None
        if name and name not in names:
            names.append(name)
    made = _run([str(SUITE), "--make-model", str(suite_out / "models" / "toy-bf16"),
                 "--dry-run"])
    assert made.returncode == 0, made.stderr[-3000:]
    with ThreadPoolExecutor(2) as pool:
        yield {name: pool.submit(_run_part, name, suite_out) for name in names}


def _part_of(item: pytest.Item) -> str | None:
    if item.originalname == "test_end_to_end_benchmarks_on_a_random_bf16_model":
        return item.callspec.params["part"]
    return TEST_PARTS.get(item.originalname)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=900)


def _run_part(name: str, out: Path) -> tuple[list[dict], str]:
    """Runs one part with --dry-run: (its step records from suite.json, what went wrong)."""
    done = _run([str(SUITE), "--part", name, "--dry-run", "--out", str(out / name),
                 "--model-cache", str(out / "models")])
    records = json.loads((out / name / "suite.json").read_text())["steps"]
    failed = [r for r in records if r["status"] != "ok"]
    problem = (f"{name}: {failed}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
               if done.returncode != 0 or failed else "")
    return records, problem


def _part(part_runs: dict[str, Future], name: str) -> list[dict]:
    records, problem = part_runs[name].result()
    assert not problem, problem
    return records


def _json(path_glob: str, folder: Path) -> dict:
    (path,) = folder.glob(path_glob)
    return json.loads(path.read_text())


def test_environment(suite_out, part_runs):
    _part(part_runs, "environment")
    folder = suite_out / "environment" / "environment"
    doctor = json.loads((folder / "doctor.json").read_text())
    assert doctor["problems"] == [] and doctor["ops_build"]["backend"] in ("cpp", "cuda")
    assert any(p["name"] == "pagedjax" for p in json.loads((folder / "pip_list.json").read_text()))


@pytest.mark.slow
def test_correctness(suite_out, part_runs):
    _part(part_runs, "correctness")
    for report in ("kernel_tests.xml", "parity_tests.xml"):
        suite = ElementTree.parse(suite_out / "correctness" / "correctness" / report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        assert int(suite.get("tests")) > 0, report
        assert suite.get("failures") == suite.get("errors") == suite.get("skipped") == "0"


def test_kernels(suite_out, part_runs):
    _part(part_runs, "kernels")
    folder = suite_out / "kernels" / "kernels"
    for framework in ("jax", "torch"):
        payload = _json(f"kernels_{framework}_*.json", folder)
        rows = payload["results"]
        assert {r["case"] for r in rows} == {"decode", "mixed"} and payload["environment"]
        assert all(r["status"] == "ok" or r["status"] == "skipped: decode only" for r in rows)
        assert all(isinstance(r["l2_resident"], bool) for r in rows)
        on_gpu = payload["device"]["platform"] == "gpu"
        expected_detail = {"pallas_ragged": "triton" if on_gpu else "interpret",
                           "pallas_fused_decode": "triton" if on_gpu else "interpret",
                           "torch_pagedjax_op": "cuda" if on_gpu else "cpp"}
        if framework == "jax":  # the fused decode path ran beside the general kernel
            assert any(r["impl"] == "pallas_fused_decode" and r["status"] == "ok" for r in rows)
        for row in rows:
            if row["impl"] in expected_detail and row["status"] == "ok":
                assert row["detail"] == expected_detail[row["impl"]]
                assert row["max_abs_err"] < 2e-2  # bf16 against the framework's reference


@pytest.mark.slow
@pytest.mark.parametrize("part", ["throughput", "latency"])
def test_end_to_end_benchmarks_on_a_random_bf16_model(suite_out, part_runs, part):
    records = _part(part_runs, part)
    assert [r["step"] for r in records] == ["make_model", f"{part}_jax", f"{part}_torch"]
    config = json.loads((suite_out / "models" / "toy-bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    results = list((suite_out / part / part).glob("*.json"))
    assert len(results) >= 2, results  # one per backend


@pytest.mark.slow
def test_spec_decode(suite_out, part_runs):
    _part(part_runs, "spec_decode")
    for backend in ("jax", "torch"):
        payload = _json("spec_decode_*.json", suite_out / "spec_decode" / "spec_decode" / backend)
        assert {r["backend"] for r in payload["results"]} == {backend}


def test_a_sharded_random_checkpoint_reads_the_same_in_hf_and_pagedjax(tmp_path, monkeypatch):
    """make_model's own safetensors writer (the 8B checkpoint's: several shards and an index):
    HF transformers and pagedjax read the same model, greedy tokens equal."""
    from pagedjax import LLM, SamplingParams
    from tests.support.hf_reference import hf_greedy

    monkeypatch.setattr(gpu_suite, "SHARD_BYTES", 64 << 10)
    model = gpu_suite.make_model(tmp_path / "toy", dry_run=True)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in model.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    prompts = [[5, 17, 99, 3], [42] * 9]
    llm = LLM(str(model), backend="torch", dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(str(model), prompts, 8)


def test_decode_step(suite_out, part_runs):
    records = _part(part_runs, "decode_step")
    assert [r["step"] for r in records] == ["make_model", "decode_step_jax", "decode_step_torch"]
    folder = suite_out / "decode_step" / "decode_step_1b"
    for backend in ("jax", "torch"):
        payload = _json(f"decode_step_{backend}_*.json", folder)
        rows = payload["results"]
        assert [r["batch"] for r in rows] == [1, 2] and payload["copy_bandwidth_gbs"] > 0
        for row in rows:
            assert row["step ms"] > 0 and row["floor ms"] > 0 and 0 < row["host share %"] < 100
            assert row["weights GB"] > 0 and row["KV GB"] > 0
            assert row["profile"] and all(k["us/step"] > 0 for k in row["profile"])


def test_moe_layer(suite_out, part_runs):
    """Each framework's expert-block forms ran, agree with the grouped form, and the form the
    model picks is marked (gathered for 1 token x top 2 <= 8 experts, grouped past it)."""
    records = _part(part_runs, "moe_layer")
    assert [r["step"] for r in records] == ["moe_layer_jax", "moe_layer_torch"]
    for framework, forms in (("jax", {"gathered", "grouped"}),
                             ("torch", {"gathered", "grouped", "loop"})):
        rows = _json(f"moe_layer_{framework}_*.json",
                     suite_out / "moe_layer" / "moe_layer")["results"]
        assert {r["form"] for r in rows} == forms
        assert all(r["status"] == "ok" and r["us"] > 0 for r in rows), rows
        assert all(r["max_abs_diff_vs_grouped"] < 1e-5 for r in rows)
        chosen = {r["tokens"]: r["form"] for r in rows if r["model_choice"]}
        assert chosen == {1: "gathered", 3: "gathered"}


def test_resume_runs_what_the_first_command_left_within_its_budget(tmp_path, monkeypatch):
    """--resume skips `all`'s steps an earlier suite.json records as ok (a model is made again:
    reused where it is there), runs the rest, and --budget-s skips what would not fit."""
    first = tmp_path / "first.json"
    ran: list[tuple[str, int]] = []

    def run_step(step, part_dir, env):
        ran.append((step.name, step.timeout_s))
        return dict(step=step.name, status="ok")

    monkeypatch.setattr(gpu_suite, "run_step", run_step)
    ctx = gpu_suite.Context(out=tmp_path / "a", dry_run=True, model_cache=tmp_path / "models")
    names = [s.name for s in gpu_suite.all_steps(ctx)]
    done = names[:names.index("spec_decode_jax")]
    first.write_text(json.dumps({"steps": [
        *({"step": name, "part": "all", "status": "ok"} for name in done),
        {"step": "spec_decode_jax", "part": "all", "status": "timeout"}]}))
    records = gpu_suite.run_parts(["all"], gpu_suite.Context(
        out=tmp_path / "b", dry_run=True, model_cache=tmp_path / "models", budget_s=100,
        done=gpu_suite.finished_steps(first)))
    models = [name for name in done if name.startswith("make_model")]  # made again (reused)
    assert [name for name, _ in ran] == [*models, *names[names.index("spec_decode_jax"):]]
    assert all(timeout <= 100 for _, timeout in ran)
    assert {r["status"] for r in records} == {"ok"}

    ran.clear()
    monkeypatch.setattr(gpu_suite.time, "monotonic", iter(range(0, 10_000, 30)).__next__)
    records = gpu_suite.run_parts(["all"], gpu_suite.Context(
        out=tmp_path / "c", dry_run=True, model_cache=tmp_path / "models", budget_s=100))
    assert 0 < len(ran) < len(names)  # the clock moves 30 s a look: the budget runs out
    assert records[-1]["status"] == "skipped"


def test_archive_packs_the_results_into_what_a_gpu_machine_sends_back(tmp_path):
    """--archive: one results.tar.gz of everything under --out (not the XLA dump being written,
    not the archive itself), the dump's own archive copied beside it: 2 files, 0 folders down."""
    import tarfile

    out, to = tmp_path / "run", tmp_path / "OUT"
    (out / "all" / "decode_step_jax" / "xla_dump").mkdir(parents=True)
    (out / "suite.json").write_text("{}")
    (out / "all" / "decode_step_jax" / "result.json").write_text("{}")
    (out / "all" / "decode_step_jax" / "xla_dump" / "module.txt").write_text("HloModule")
    (out / "all" / "xla_dump.tar.gz").write_bytes(b"dump")
    gpu_suite.archive_results(out, to)
    gpu_suite.archive_results(out, to)  # after the next step: rewritten, not nested
    assert sorted(p.name for p in to.iterdir()) == ["results.tar.gz", "xla_dump.tar.gz"]
    with tarfile.open(to / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["all/decode_step_jax/result.json", "suite.json"]
