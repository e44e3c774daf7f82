"""The nightly GPU workflow's structure (parsed, not run)."""

from __future__ import annotations

from pathlib import Path

import yaml

WORKFLOW = Path(__file__).resolve().parents[3] / ".github" / "workflows" / "nightly-gpu.yml"


def _load():
    data = yaml.safe_load(WORKFLOW.read_text())
    return data, data.get("on", data.get(True))  # YAML 1.1 reads a bare `on:` key as True


def test_triggers_nightly_and_never_on_pull_requests():
    _, on = _load()
    assert on["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"]  # daily
    assert "pull_request" not in on and "pull_request_target" not in on


def test_jobs_run_on_self_hosted_gpu_with_timeouts_and_fork_guard():
    data, _ = _load()
    for name, job in data["jobs"].items():
        assert job["runs-on"][:3] == ["self-hosted", "linux", "gpu"], name  # multigpu adds its own label
        assert isinstance(job["timeout-minutes"], int) and job["timeout-minutes"] > 0, name
        assert "github.event_name != 'pull_request'" in job["if"], name


def test_runs_all_tiers_and_keeps_reports_always():
    data, _ = _load()
    steps = data["jobs"]["gpu-tiers"]["steps"]
    runs = [s.get("run", "") for s in steps]
    # a runner without its GPU fails the night (exit 4) instead of a green night with nothing judged
    assert any("./scripts/gpu-test.sh all --require-gpu --check-vram --continue-on-error" in r for r in runs)
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["path"].startswith("reports/")
    summary = next(s for s in steps if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    assert summary["if"] == "always()" and "report.md" in summary["run"]
    cache = next(s for s in steps if s.get("uses", "").startswith("actions/cache"))
    assert "HF_HOME" in cache["with"]["path"] and "HF_HOME" in data["jobs"]["gpu-tiers"]["env"]


def test_nightly_runs_the_regression_gate_and_the_planted_defects():
    data, _ = _load()
    runs = [s.get("run", "") for job in data["jobs"].values() for s in job["steps"]]
    assert any("gpu-test.sh all" in r and "--baseline auto" in r for r in runs)
    assert any("gpu-test.sh bench" in r and "--baseline auto" in r for r in runs)
    assert any("gpu-test.sh selftest-gpu" in r for r in runs)


def test_the_multigpu_job_runs_only_where_a_multi_gpu_runner_is_declared():
    import yaml

    wf = yaml.safe_load((Path(__file__).resolve().parents[3] / ".github/workflows/nightly-gpu.yml").read_text())
    job = wf["jobs"]["multigpu"]
    assert "multi-gpu" in job["runs-on"] and "vars.MULTI_GPU_RUNNER == 'true'" in job["if"]
    assert any("gpu-test.sh multigpu" in step.get("run", "") for step in job["steps"])


def test_every_night_is_persisted_by_the_one_job_that_may_write_and_never_from_a_fork():
    data, _ = _load()
    assert data["permissions"] == {"contents": "read"}  # the default of every job
    writers = {name for name, job in data["jobs"].items() if job.get("permissions", {}).get("contents") == "write"}
    assert writers == {"persist"}
    job = data["jobs"]["persist"]
    assert "github.repository_owner == github.event.repository.owner.login" in job["if"]
    assert "github.ref == 'refs/heads/main'" in job["if"]
    (step,) = [s for s in job["steps"] if "persist-results.sh" in s.get("run", "")]
    assert step["env"]["LORA_SUITE_STORE"] == "${{ secrets.LORA_SUITE_STORE }}"  # from a secret, never the YAML
    assert "persist" in data["jobs"]["history"]["needs"]
