"""``--vram-limit GiB`` (issue 56, item 6): the allocator's cap and the pre-check's free memory of a smaller card,
and what is refused (``lora_suite.measure.vram_limit``). The cap itself acts on a GPU: here torch's setter is
watched."""

from __future__ import annotations

import pytest
import torch

from lora_suite.cli import main
from lora_suite.measure import memory as M
from lora_suite.measure import vram_limit as V

GIB = 2**30
H100 = 79.19 * GIB  # an H100's total as torch reports it


@pytest.mark.parametrize("text", ["0", "-16", "0.5", "nan", "inf", "sixteen", ""])
def test_a_limit_that_names_no_card_is_refused_by_value(text, capsys):
    with pytest.raises(V.VramLimitError, match=f"--vram-limit {text}: expected a card's memory in GiB"):
        V.parse_limit(text)
    assert main(["memory", "--vram-limit", text]) == 2
    assert f"got {text!r}" in capsys.readouterr().err


def test_the_cap_leaves_the_cuda_context_out_of_the_card():
    fraction = V.memory_fraction(16, int(H100))
    assert fraction * H100 == pytest.approx(16 * GIB - V.CONTEXT_BYTES)
    with pytest.raises(V.VramLimitError, match=r"--vram-limit 100: more than this GPU's 79.2 GiB"):
        V.memory_fraction(100, int(H100))


def test_the_precheck_judges_against_the_card_not_the_gpu():
    est = M.MemoryEstimate(int(12 * GIB), 0, 0, 0, 0, int(4 * GIB), 0, 0)
    free = int(70 * GIB)
    assert M.vram_verdict(est, V.limited_free(free, None), None)[0]  # an H100's free memory holds it
    ok, msg = M.vram_verdict(est, V.limited_free(free, 16.0, held_bytes=int(0.5 * GIB)), None, 16.0)
    assert not ok and "as on a 16 GiB card (--vram-limit): NOT enough" in msg, msg
    assert V.limited_free(int(10 * GIB), 16.0) == 10 * GIB  # a GPU with less free than the card: its own reading


def test_applying_the_limit_caps_this_process_on_its_device(monkeypatch):
    calls = []

    class Props:
        total_memory = int(H100)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    note = V.apply_limit(24.0, 0)
    assert calls == [(pytest.approx((24 * GIB - V.CONTEXT_BYTES) / H100), 0)]
    assert "judged as on a 24 GiB card" in note and "capped at 23.40 GiB" in note, note
