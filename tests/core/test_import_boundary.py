"""The system under test never imports its judge: `import lora_core` loads neither lora_suite, PyYAML nor pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_lora_core_loads_no_harness():
    code = (
        "import sys, lora_core, lora_core.inject, lora_core.layer, lora_core.nf4; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lora_suite', 'yaml', 'pytest', 'cupy')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import lora_core loaded {out.stdout.strip()} {out.stderr[-500:]}"


def test_no_lora_core_source_mentions_the_harness():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "lora_core").rglob("*.py")
        if "lora_suite" in "\n".join(line for line in p.read_text().splitlines() if line.startswith(("import", "from")))
    ]
    assert not offenders, f"lora_core imports lora_suite in {offenders}"
