"""The parsers of the command line's option values (argparse ``type=``): each refuses a bad value with a message
naming the option, the value and what was expected (``argparse.ArgumentTypeError``, which the parser turns into one
usage line, exit 2)."""

from __future__ import annotations

import argparse
import re


def _node_rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--node-rank must be a whole number >= 0, got {text!r}")
    return int(text)


def _endpoint(text: str) -> str:
    from lora_suite.scenarios.multinode import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--rdzv-endpoint: {exc}") from None
    return text


def _positive_int(flag: str, least: int = 1, why: str = ""):
    def parse(text: str) -> int:
        if not re.fullmatch(r"[1-9][0-9]*", text) or int(text) < least:
            words = "a positive whole number" if least == 1 else f"a whole number >= {least}{why}"
            raise argparse.ArgumentTypeError(f"{flag} must be {words}, got {text!r}")
        return int(text)

    return parse


def _workers(text: str) -> str:
    if text != "auto" and not re.fullmatch(r"[1-9][0-9]*", text):
        raise argparse.ArgumentTypeError(f"--workers must be a positive whole number or auto, got {text!r}")
    return text


def _vram_limit(text: str) -> float:
    from lora_suite.measure.vram_limit import VramLimitError, parse_limit

    try:
        return parse_limit(text)
    except VramLimitError as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).removeprefix(f'--vram-limit {text}: ')}, got {text!r}") from None


def _weights(text: str) -> str:
    if text not in ("auto", "pretrained", "random"):
        raise argparse.ArgumentTypeError(f"--weights must be auto, pretrained or random, got {text!r}")
    return text


def _impl(text: str) -> str:
    from lora_suite.settings.implementation_names import SpecError, parse_spec

    try:
        return parse_spec(text).text
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
