"""The bad-input battery (issue 20), the training data: Alpaca-format JSONL files (``data.source: jsonl``) that are
broken, empty or truncated away, refused by ``lora_suite.engine.data.load_alpaca_jsonl`` with the line and the
reason, before any GPU work."""

from __future__ import annotations

import json

import pytest

from lora_suite.engine.data import ByteTokenizer, load_alpaca_jsonl

JSONL_CASES = {  # what -> (the file, what the message must match)
    "not JSON": ("{oops\n", r":1: not valid JSON"),
    "a list per line": ("[1, 2]\n", r":1: expected a JSON object, got list"),
    "a number per line": ("3\n", r":1: expected a JSON object, got int"),
    "missing output": ('{"instruction": "a"}\n', r":1: missing or non-string key\(s\) \['output'\]"),
    "missing instruction": ('{"output": "b"}\n', r":1: missing or non-string key\(s\) \['instruction'\]"),
    "output not a string": ('{"instruction": "a", "output": 3}\n', r":1: missing or non-string key\(s\) \['output'\]"),
    "second line broken": ('{"instruction": "a", "output": "b"}\n{"instruction": \n', r":2: not valid JSON"),
    "empty file": ("", r"holds no examples"),
    "only blank lines": ("\n\n  \n", r"holds no examples"),
    "instruction null": ('{"instruction": null, "output": "b"}\n', r"missing or non-string key\(s\) \['instruction'\]"),
}


@pytest.mark.parametrize("what", JSONL_CASES)
def test_jsonl_data(what, tmp_path):
    text, expected = JSONL_CASES[what]
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected):
        load_alpaca_jsonl(path, ByteTokenizer(), 64)


def test_jsonl_data_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path .*nope.jsonl does not exist"):
        load_alpaca_jsonl(tmp_path / "nope.jsonl", ByteTokenizer(), 64)


def test_jsonl_responses_truncated_away(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"instruction": "x" * 500, "output": "y"}) + "\n")
    with pytest.raises(ValueError, match="every response was truncated away at seq_len=16; raise data.seq_len"):
        load_alpaca_jsonl(path, ByteTokenizer(), 16)
