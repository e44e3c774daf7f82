"""Backend resolution: explicit, observable, never a silent fallback (CPU tests)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import lora_core
from lora_core import backend as backend_mod
from lora_core.ops import cupy_interop


def test_import_lora_core_without_cupy_and_run_on_cpu():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
        "import torch, lora_core\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "layer = lora_core.LoRALinear.from_linear(torch.nn.Linear(4, 3), r=2)\n"
        "layer(torch.randn(2, 4)).sum().backward()\n"
        "assert layer.last_backend == 'torch'\n"
        "try:\n"
        "    lora_core.lora_linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2), 1.0,"
        " backend='cupy')\n"
        "except lora_core.CupyUnavailableError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout  # asking for cupy here is an error, never a quiet torch run


def test_cupy_without_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(lora_core.CupyUnavailableError, match="needs a CUDA GPU.*backend='torch'"):
        lora_core.resolve_backend("cupy", torch.device("cpu"))


def _resolve_cupy_afresh(monkeypatch):
    """resolve_backend("cupy") on a CUDA device (torch.cuda.is_available pretended), CuPy and its binding imported
    afresh (under the modules the test planted in sys.modules), the import cache cleared again afterwards."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy_interop, "_ready", None)
    cupy_interop._import_cupy.cache_clear()
    try:
        lora_core.resolve_backend("cupy", torch.device("cuda"))
    finally:
        cupy_interop._import_cupy.cache_clear()


def test_cupy_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(lora_core.CupyUnavailableError, match=r"needs CuPy.*cupy-cuda12x.*cupy-cuda13x"):
        _resolve_cupy_afresh(monkeypatch)


def test_missing_cublas_binding_says_how_to_install(monkeypatch):
    # CuPy alone is not enough: the GEMMs go through nvmath-python's cuBLAS binding (capture-safe), and
    # its absence must be named, not worked around with CuPy's own cuBLAS wrappers.
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublas", None)
    with pytest.raises(lora_core.CupyUnavailableError, match=r"nvmath-python's binding.*nvmath-python\[cu12\]"):
        _resolve_cupy_afresh(monkeypatch)


def test_cpu_tensors_default_to_torch():
    assert lora_core.resolve_backend(None, torch.device("cpu")) == "torch"


def test_cuda_default_without_cupy_warns_once(monkeypatch):
    monkeypatch.setattr(backend_mod, "cupy_available", lambda: False)
    monkeypatch.setattr(backend_mod, "_warned_default", False)
    monkeypatch.delenv(backend_mod.ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="runs the torch reference backend, not the CuPy kernels"):
        assert backend_mod.default_backend(torch.device("cuda")) == "torch"


def test_env_var_overrides_default_and_is_validated(monkeypatch):
    monkeypatch.setenv(backend_mod.ENV_VAR, "torch")
    assert backend_mod.default_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(backend_mod.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="backend='tpu' is not known"):
        backend_mod.default_backend(torch.device("cpu"))


def test_calls_are_counted_per_backend():
    before = lora_core.backend_call_counts()
    lora_core.lora_linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2), 1.0)
    after = lora_core.backend_call_counts()
    assert after["torch"] == before["torch"] + 1 and after["cupy"] == before["cupy"]


def test_cupy_available_is_marked_constant_for_compile_as_torchs_decorator_marks_it():
    """lora_core marks it without importing torch._dynamo; the mark must stay the one torch's decorator sets."""
    import torch

    from lora_core.ops import cupy_interop

    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert getattr(cupy_interop.cupy_available, "_dynamo_marked_constant", False) is True


def test_importing_lora_core_does_not_import_torch_dynamo():
    import subprocess
    import sys

    code = "import sys, lora_core, lora_core.ops.cupy_interop; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
