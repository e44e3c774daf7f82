"""lora_suite.measure.carried on the CPU: the live models left by earlier work, and what refers to them."""

from __future__ import annotations

import gc
import logging

from torch import nn

from lora_suite.measure.carried import carried_note, describe_carried, live_models

MIB = 2**20


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(512, 512)  # 1 MiB of fp32 weight
        self.head = nn.Linear(512, 8)


class _Run:
    """Stands for what kept a model alive: a finished run's state."""

    def __init__(self, model):
        self.model = model


def _keeper(model):
    return lambda: model


def test_only_the_outermost_live_model_is_named_with_its_bytes():
    gc.collect()
    model = _Model()
    found = [(m, b) for m, b in live_models(MIB, "cpu") if m is model or m is model.body]
    assert [m for m, _ in found] == [model]  # its Linear is inside it: the model is what is alive
    assert found[0][1] == sum(t.numel() * 4 for t in model.parameters())


def test_an_attribute_and_a_closure_that_keep_a_model_alive_are_named():
    gc.collect()
    model = _Model()
    run = _Run(model)
    keep = _keeper(model)
    del model
    lines = [line for line in describe_carried(MIB, "cpu") if line.startswith("_Model")]
    assert len(lines) == 1, lines
    assert "attribute 'model' of a _Run" in lines[0]
    assert "a closure cell of _keeper.<locals>.<lambda>" in lines[0]
    del run, keep


def test_nothing_is_named_once_the_model_is_gone():
    gc.collect()
    model = _Model()
    del model
    assert not [line for line in describe_carried(MIB, "cpu") if line.startswith("_Model")]


def test_the_note_names_what_is_alive_only_past_its_threshold():
    gc.collect()
    model = _Model()
    run = _Run(model)
    assert carried_note(4 * MIB - 1, 4 * MIB, "cpu") == ""  # a little carried memory: nothing to chase
    note = carried_note(4 * MIB, 4 * MIB, "cpu")
    assert note.startswith("; still alive: ") and "_Model (1.0 MiB) referred to by attribute 'model' of a _Run" in note
    del run, model


class _Kept:
    """Stands for a harness object that stored an exception raised inside a model's forward."""

    error: BaseException | None = None


def _forward_that_fails(model):
    inner(model)


def inner(model):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_frame_kept_by_a_stored_exception_names_the_exception_and_its_holder():
    gc.collect()
    model = _Model()
    kept = _Kept()
    try:
        _forward_that_fails(model)
    except RuntimeError as exc:
        kept.error = exc
    del model
    (line,) = [line for line in describe_carried(MIB, "cpu") if line.startswith("_Model")]
    assert "a frame of _forward_that_fails" in line, line
    assert "kept by the traceback of RuntimeError('operation not permitted when stream is capturing')" in line
    assert "held by attribute 'error' of a _Kept" in line
    kept.error = None
    gc.collect()
    assert not [x for x in describe_carried(MIB, "cpu") if x.startswith("_Model")]


_RECORD: tuple | None = None  # stands for a library's module-level record of a failed import


def test_a_stored_exception_in_a_module_globals_tuple_names_the_global():
    global _RECORD
    gc.collect()
    model = _Model()
    try:
        _forward_that_fails(model)
    except RuntimeError as exc:
        _RECORD = ("name", exc, "detail", 4)
    del model
    (line,) = [line for line in describe_carried(MIB, "cpu") if line.startswith("_Model")]
    assert "held by a tuple of 4 items, the global _RECORD of " in line, line
    _RECORD = None
    gc.collect()


class _KeepingHandler(logging.Handler):
    """Stands for a log capture that keeps every record (pytest's keeps a test phase's records until it ends)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_an_exception_logged_as_an_argument_names_the_log_capture_that_keeps_it():
    gc.collect()
    model = _Model()
    handler = _KeepingHandler()
    log = logging.getLogger("carried-test")
    log.addHandler(handler)
    log.propagate = False
    try:
        _forward_that_fails(model)
    except RuntimeError as exc:
        log.warning("import of %s failed in %s (%s): %s", "tanh", "math", "fallback", exc)
    del model
    (line,) = [line for line in describe_carried(MIB, "cpu") if line.startswith("_Model")]
    want = (
        "held by a tuple of 4 items, held by attribute 'args' of a LogRecord, held by a list of 1 items, "
        "held by attribute 'records' of a _KeepingHandler"
    )
    assert want in line, line
    log.removeHandler(handler)
    handler.records.clear()
    gc.collect()
