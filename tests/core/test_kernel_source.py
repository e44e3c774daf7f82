"""``cupy_interop.kernel_source``: the code CuPy compiles for a RawKernel file holds its local headers, pasted in
place of their ``#include`` lines once each, so CuPy's disk cache (keyed on the code) never serves a binary built
from an older header."""

from __future__ import annotations

import re

import pytest

from lora_core.ops import cupy_interop as cx

SOURCES = sorted(p.name for p in cx.KERNEL_DIR.glob("*.cu"))


@pytest.mark.parametrize("name", SOURCES)
def test_every_kernel_file_is_compiled_with_its_headers_pasted(name):
    code = cx.kernel_source(name)
    assert not re.search(r'^#include "', code, re.M), f"{name}: a local #include is left for NVRTC to resolve"
    for header in re.findall(r'^#include "([^"]+)"', (cx.KERNEL_DIR / name).read_text(), re.M):
        assert (cx.KERNEL_DIR / header).read_text().strip() in code


def test_a_header_is_pasted_once_and_its_edits_change_the_code(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text("int a_v;\n")
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\nint b_v;\n')
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n__global__ void k() {}\n')
    monkeypatch.setattr(cx, "KERNEL_DIR", tmp_path)
    before = cx.kernel_source("k.cu")
    assert before.count("int a_v;") == 1 and "int b_v;" in before
    (tmp_path / "a.cuh").write_text("int a_v2;\n")
    assert cx.kernel_source("k.cu") != before


def test_the_converters_are_written_once():
    defining = [p.name for p in cx.KERNEL_DIR.glob("*.cu*") if "__float2bfloat16_rn(v)" in p.read_text()]
    assert defining == ["float_convert.cuh"]
