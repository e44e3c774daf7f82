"""The suite as a product: the built wheel installed into a fresh virtual environment outside the checkout judges a
third party's implementation (``lora-suite quick --lora-impl their_module:factory``) from that party's directory."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TOY = '''
from lora_suite.implementations import LoRAImplementation


class ToyImplementation(LoRAImplementation):
    """A third party's LoRA stack, as small as the contract allows."""

    name = "toy"
    expected_path = "toy"

    def inject(self, model, spec):
        raise NotImplementedError

    def adapter_parameters(self, model):
        return {}

    def save_adapter(self, model, path):
        raise NotImplementedError

    def load_adapter(self, model, path):
        raise NotImplementedError

    def served_by(self, model):
        return "toy"


def make():
    return ToyImplementation()
'''


def test_the_built_wheel_judges_a_third_party_implementation_from_its_own_directory(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = wheels.glob("lora_gpu_suite-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The dependencies (torch, transformers, ...) come from this interpreter's site-packages: a .pth, not a copy.
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: pip must not find this checkout's own install and call the wheel "already satisfied"
    # (installing nothing, console script included). It did under `gpu-test.sh selftest`, which puts the checkout
    # on PYTHONPATH, and an editable install leaves lora_gpu_suite.egg-info there. Hence also no PYTHONPATH.
    inst = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert (venv / "bin" / "lora-suite").exists(), "pip installed no lora-suite console script: " + inst.stdout[-2000:]
    project = tmp_path / "their_project"
    project.mkdir()
    (project / "their_lora.py").write_text(TOY)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHON", "LORA_SUITE_CONFIG_DIR", "LORA_SUITE_TIERS_DIR")
    }
    env["PYTHONPATH"] = str(project)
    out = subprocess.run(
        [venv / "bin" / "lora-suite", "quick", "--lora-impl", "their_lora:make"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "quick        NOT JUDGED (no GPU)" in out.stdout  # a CPU machine: the run says it judged nothing
    report = next((project / "reports").glob("*-quick-their_lora_make/report.json"))
    text = report.read_text()
    assert '"name": "toy"' in text and str(ROOT) not in text.split('"outcomes"')[0], "judged from the checkout"
    assert "site-packages/lora_suite/tiers/quick" in out.stdout  # the shipped tiers ran, not the checkout's
