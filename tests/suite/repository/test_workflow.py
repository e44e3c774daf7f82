"""The nightly GPU workflow's structure (parsed, not run): a matrix over runner labels, one job per GPU type, each
judged against its own GPU model's baselines and recording into the one results store; docs/reports.md names every
label of it."""

from __future__ import annotations

from pathlib import Path

import yaml

from lora_suite.results.ledger import folder_token

ROOT = Path(__file__).resolve().parents[3]
WORKFLOW = ROOT / ".github" / "workflows" / "nightly-gpu.yml"
STORE = "${{ secrets.LORA_SUITE_STORE }}"
NIGHT = "nightly-${{ github.run_id }}-${{ matrix.gpu }}"


def _load():
    data = yaml.safe_load(WORKFLOW.read_text())
    return data, data.get("on", data.get(True))  # YAML 1.1 reads a bare `on:` key as True


def _rows() -> list[dict]:
    return _load()[0]["jobs"]["gpu"]["strategy"]["matrix"]["include"]


def _step(job: dict, text: str) -> dict:
    (found,) = [s for s in job["steps"] if text in s.get("run", "")]
    return found


def test_triggers_nightly_and_never_on_pull_requests():
    _, on = _load()
    assert on["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"]  # daily
    assert "pull_request" not in on and "pull_request_target" not in on


def test_jobs_run_on_self_hosted_gpu_with_timeouts_and_fork_guard():
    data, _ = _load()
    for name, job in data["jobs"].items():
        assert job["runs-on"][:3] == ["self-hosted", "linux", "gpu"], name  # gpu and multigpu add their own label
        assert isinstance(job["timeout-minutes"], int) and job["timeout-minutes"] > 0, name
        assert "github.event_name != 'pull_request'" in job["if"], name
        assert "github.repository_owner == github.event.repository.owner.login" in job["if"], name
        assert "matrix." not in job["if"], name  # a job's `if` is read before its matrix exists


def test_one_gpu_job_per_gpu_type_on_its_own_runner_label():
    data, _ = _load()
    job, rows = data["jobs"]["gpu"], _rows()
    assert len(rows) >= 2  # the GPU types with runners; the commented rows show a fleet's next ones
    for key in ("gpu", "label", "model"):
        assert all(row.get(key) for row in rows), key
        assert len({row[key] for row in rows}) == len(rows), key  # distinct GPU types, labels and models
    assert not {row["label"] for row in rows} & {"gpu", "multi-gpu", "self-hosted", "linux"}
    assert job["runs-on"] == ["self-hosted", "linux", "gpu", "${{ matrix.label }}"]
    assert job["strategy"]["fail-fast"] is False  # one GPU type failing never cancels the others
    assert set(job["strategy"]["matrix"]) == {"include"}  # the rows are the matrix: no cross product


def test_one_run_at_a_time_per_gpu_type_and_never_one_group_for_all():
    data, _ = _load()
    assert "concurrency" not in data  # a workflow-wide group would run the GPU types one after another
    gpu = data["jobs"]["gpu"]["concurrency"]
    assert "${{ matrix.gpu }}" in gpu["group"] and gpu["cancel-in-progress"] is False
    assert data["jobs"]["multigpu"]["concurrency"]["group"] != gpu["group"]


def test_each_gpu_type_is_judged_against_its_own_gpu_models_baselines():
    job = _load()[0]["jobs"]["gpu"]
    # --baseline auto reads the runner's GPU (reports/baselines/<its model>/); the row's model is checked against it
    tiers = _step(job, "gpu-test.sh all --require-gpu")
    assert (
        "--baseline auto" in tiers["run"] and "--check-vram" in tiers["run"] and "--continue-on-error" in tiers["run"]
    )
    assert "--baseline auto" in _step(job, "gpu-test.sh bench")["run"]
    assert "--baseline" not in _step(job, "--lora-impl peft")["run"]  # the baselines judged cupy
    check = next(s for s in job["steps"] if s.get("id") == "runner")
    assert "nvidia-smi --query-gpu=name" in check["run"] and "${{ matrix.model }}" in check["run"]
    later = [s for s in job["steps"] if "gpu-test.sh" in s.get("run", "") and s is not tiers]
    assert later and all("steps.runner.outcome == 'success'" in s["if"] for s in later)
    for t in ("gpu-test.sh selftest-gpu", "gpu-test.sh bench", "--lora-impl peft", "--require-gpu"):
        assert '--report-dir "reports/$NIGHT' in _step(job, t)["run"], t


def test_every_gpu_model_with_committed_baselines_has_a_row():
    """``--baseline auto`` names a GPU's folder by ``folder_token`` of nvidia-smi's name: each folder under
    reports/baselines/ is the model of one matrix row, so no GPU model's baselines go unused at night."""
    folders = {p.name for p in (ROOT / "reports" / "baselines").iterdir() if p.is_dir()}
    models = {folder_token(row["model"]).rstrip("_") for row in _rows()}
    assert folders and folders <= models, folders - models


def test_every_job_records_into_the_one_store_from_the_secret():
    data, _ = _load()
    gpu = data["jobs"]["gpu"]
    assert gpu["env"]["LORA_SUITE_STORE"] == STORE  # empty without the secret: --record keeps reports/results.sqlite
    assert "--record" in _step(gpu, "gpu-test.sh all --require-gpu")["run"]
    assert gpu["env"]["NIGHT"] == NIGHT  # the store group of a GPU type's night, its report folder and its artifact
    for name in ("persist", "history"):
        steps = [s for s in data["jobs"][name]["steps"] if "LORA_SUITE_STORE" in s.get("env", {})]
        assert steps and all(s["env"]["LORA_SUITE_STORE"] == STORE for s in steps), name
    assert STORE not in WORKFLOW.read_text().replace(f"LORA_SUITE_STORE: {STORE}", "")  # set by name, never echoed


def test_runs_all_tiers_and_keeps_reports_per_gpu_type_always():
    data, _ = _load()
    job = data["jobs"]["gpu"]
    uploads = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert len(uploads) == 1
    (upload,) = uploads
    assert upload["if"] == "always()" and upload["with"]["name"] == NIGHT and "${{ matrix.gpu }}" in NIGHT
    assert upload["with"]["path"].rstrip("/") == f"reports/{NIGHT}"
    multi = next(s for s in data["jobs"]["multigpu"]["steps"] if s.get("uses", "").startswith("actions/upload"))
    assert multi["with"]["name"] == "nightly-${{ github.run_id }}-multigpu"
    summary = next(s for s in job["steps"] if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    assert summary["if"] == "always()" and "report.md" in summary["run"] and "${{ matrix.gpu }}" in summary["run"]
    cache = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/cache"))
    assert "HF_HOME" in cache["with"]["path"] and "HF_HOME" in job["env"]
    assert "${{ matrix.gpu }}" in cache["with"]["key"]
    limits = [s.get("timeout-minutes") for s in job["steps"] if "gpu-test.sh" in s.get("run", "")]
    assert all(limits) and sum(limits) <= job["timeout-minutes"]  # the job's limit never cuts a step short of its own


def test_nightly_runs_the_regression_gate_and_the_planted_defects():
    data, _ = _load()
    runs = [s.get("run", "") for job in data["jobs"].values() for s in job["steps"]]
    assert any("gpu-test.sh all" in r and "--baseline auto" in r for r in runs)
    assert any("gpu-test.sh bench" in r and "--baseline auto" in r for r in runs)
    assert any("gpu-test.sh selftest-gpu" in r for r in runs)


def test_the_multigpu_job_runs_only_where_a_multi_gpu_runner_is_declared():
    job = _load()[0]["jobs"]["multigpu"]
    assert "multi-gpu" in job["runs-on"] and "vars.MULTI_GPU_RUNNER == 'true'" in job["if"]
    assert any("gpu-test.sh multigpu" in step.get("run", "") for step in job["steps"])
    multinode = [s for s in job["steps"] if "gpu-test.sh multinode" in s.get("run", "")]  # issue 59: 2 nodes
    assert len(multinode) == 1 and multinode[0]["if"] == "always()"  # also after a failed multigpu tier


def test_every_night_is_persisted_by_the_one_job_that_may_write_and_never_from_a_fork():
    data, _ = _load()
    assert data["permissions"] == {"contents": "read"}  # the default of every job
    writers = {name for name, job in data["jobs"].items() if job.get("permissions", {}).get("contents") == "write"}
    assert writers == {"persist"}
    job = data["jobs"]["persist"]
    assert "github.repository_owner == github.event.repository.owner.login" in job["if"]
    assert "github.ref == 'refs/heads/main'" in job["if"]
    assert set(job["needs"]) == {"gpu", "multigpu"} and job["if"].startswith("always()")
    step = _step(job, "persist-results.sh")
    assert step["env"]["LORA_SUITE_STORE"] == STORE  # from a secret, never the YAML
    # each GPU type's artifact under its own group (its name): GPU types started together may share a run id
    assert 'for night in "${nights[@]}"' in step["run"] and 'persist-results.sh "$night" "$(basename' in step["run"]
    assert "nightly-${{ github.run_id }}-*/" in step["run"]
    assert "persist" in data["jobs"]["history"]["needs"]


def test_the_example_rows_of_a_larger_fleet_are_rows_the_matrix_would_take():
    """The commented rows (A100, a 24 GB consumer card) uncommented parse as matrix rows of their own type and label."""
    text = WORKFLOW.read_text()
    examples = [ln.split("# ", 1)[1].split("   #")[0] for ln in text.splitlines() if ln.strip().startswith("# - {gpu:")]
    rows = [yaml.safe_load(e)[0] for e in examples]
    assert {r["gpu"] for r in rows} == {"a100", "rtx4090"} and all(r["label"] == f"gpu-{r['gpu']}" for r in rows)
    assert not {r["gpu"] for r in rows} & {r["gpu"] for r in _rows()}
    docs = (ROOT / "docs" / "reports.md").read_text()
    assert all(f"`{r['label']}`" in docs for r in rows)


def test_the_docs_say_how_to_add_a_gpu_type_and_name_every_label():
    text = (ROOT / "docs" / "reports.md").read_text()
    section = text.split("## The nightly over a fleet")[1].split("\n## ")[0]
    for row in _rows():
        assert f"`{row['label']}`" in section and f"`{row['gpu']}`" in section, row
    for needed in ("strategy.matrix.include", "reports/baselines/<GPU>", "`LORA_SUITE_STORE`", "`multi-gpu`"):
        assert needed in section, needed
