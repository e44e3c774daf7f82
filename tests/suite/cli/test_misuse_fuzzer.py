"""The misuse fuzzer (issue 72): every subcommand x every option that takes a value, read from the parser itself (an
option added tomorrow is fuzzed the day it appears), x hostile values. Each run of the command line (dry: no tier
runs) must return an exit status, print no traceback, and where it refuses (exit 2) say so in one line and leave
nothing behind; a blank value or one with a control character is never accepted. The counts are printed."""

from __future__ import annotations

import contextlib
import functools
import io
import os

import lora_suite.settings.registry as registry
from lora_suite.cli import build_parser, main

HOSTILE = ["", " ", "\n", "a\tb", "nan", "-1", "1e999", "é\u202e", "/no/such/deep/path/x", "x" * 4096]
NEVER = ("", " ", "\n", "a\tb")  # blank or a control character: refused by every option


def _options():
    """(subcommand, "--option=" or "" for a positional argument) of every value the parser takes."""
    sub = next(a for a in build_parser()._actions if a.dest == "target")
    out = []
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.option_strings and a.nargs != 0 and a.dest != "help":
                out.append((name, f"{a.option_strings[-1]}="))
            elif not a.option_strings and not isinstance(a, type(sub)):
                out.append((name, ""))  # a positional: the value alone
        if name == "ledger":  # its actions' own options and positionals
            out += [(f"ledger {n}", f"{o.option_strings[-1]}=" if o.option_strings else "") for n, q in next(
                a for a in p._actions if a.dest == "action").choices.items() for o in q._actions
                if o.dest != "help" and o.nargs != 0]  # fmt: skip
    return sorted(set(out))


def test_every_option_of_every_subcommand_survives_hostile_values(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(registry, "scan", functools.lru_cache(None)(registry.scan))
    monkeypatch.setenv("GPU_TEST_DRY_RUN", "1")
    monkeypatch.setenv("SCORECARD_DRY_RUN", "1")
    monkeypatch.chdir(tmp_path)
    options, failures, counts = _options(), [], {"runs": 0, "refused": 0, "accepted": 0}
    assert len(options) > 50, "the parser's options are read"
    for target, flag in options:
        for value in HOSTILE:
            out, err = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    status = main([*target.split(), f"{flag}{value}"])
            except BaseException as exc:  # noqa: BLE001  (what escapes main is the finding)
                failures.append(f"{target} {flag}={value!r}: {type(exc).__name__} escaped: {exc}"[:300])
                continue
            counts["runs"] += 1
            left = os.listdir(tmp_path)
            for name in left:
                os.system(f"rm -rf -- '{tmp_path / name}'")
            text = err.getvalue()
            if "Traceback" in text or "INTERNALERROR" in text:
                failures.append(f"{target} {flag}={value!r}: a traceback")
            elif status == 2:
                counts["refused"] += 1
                if left:
                    failures.append(f"{target} {flag}={value!r}: refused, but left {left[:2]}")
                if not 1 <= len(text.strip().splitlines()) <= 2:
                    failures.append(
                        f"{target} {flag}={value!r}: refused in {len(text.splitlines())} lines: {text[:200]}"
                    )
            elif value in NEVER:
                failures.append(f"{target} {flag}={value!r}: accepted (exit {status})")
            else:
                counts["accepted"] += 1
    with capsys.disabled():
        print(f"\nmisuse fuzzer: {len(options)} options, {counts}; {len(failures)} failures")
    assert failures == [], "\n".join(failures[:20])
