"""Data: the byte tokenizer, deterministic batches, pools, and Alpaca JSONL."""

from __future__ import annotations

import json

import pytest
import torch

from lora_suite.engine.data import IGNORE_INDEX, Batches, ByteTokenizer, load_alpaca_jsonl
from lora_suite.settings.config import DataSettings


def test_byte_tokenizer_round_trip_and_ids():
    tok = ByteTokenizer()
    ids = tok.encode("naïve ✓")
    assert max(ids) < 256 and tok.decode(ids) == "naïve ✓"
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)


def test_batches_are_a_pure_function_of_the_step():
    b = Batches(DataSettings(batch_size=3, seq_len=16), ByteTokenizer(), 300)
    assert torch.equal(b(5)["input_ids"], b(5)["input_ids"])
    assert not torch.equal(b(5)["input_ids"], b(6)["input_ids"])
    batch = b(0)
    assert batch["input_ids"].shape == (3, 16) and torch.equal(batch["labels"], batch["input_ids"])


def test_pool_cycles_fixed_windows():
    b = Batches(DataSettings(batch_size=2, seq_len=16, pool=2), ByteTokenizer(), 300)
    assert torch.equal(b(0)["input_ids"], b(7)["input_ids"])  # pool == batch size: one fixed batch
    b4 = Batches(DataSettings(batch_size=2, seq_len=16, pool=4), ByteTokenizer(), 300)
    assert torch.equal(b4(0)["input_ids"], b4(2)["input_ids"]) and not torch.equal(
        b4(0)["input_ids"], b4(1)["input_ids"]
    )


def test_tokenizer_larger_than_model_vocab_is_an_error():
    with pytest.raises(ValueError, match="tokenizer has 259 ids but the model's vocabulary has 100"):
        Batches(DataSettings(), ByteTokenizer(), 100)


def _jsonl(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_alpaca_jsonl_masks_the_prompt(tmp_path):
    path = _jsonl(
        tmp_path,
        [{"instruction": "Say hi", "input": "", "output": "hi"}, {"instruction": "Add", "input": "2+2", "output": "4"}],
    )
    examples = load_alpaca_jsonl(path, ByteTokenizer(), 64)
    ids, labels = examples[1]
    text = ByteTokenizer().decode(ids.tolist())
    assert text.startswith("### Instruction:\nAdd\n\n### Input:\n2+2\n\n### Response:\n4")
    supervised = labels[labels != IGNORE_INDEX].tolist()
    assert supervised == ByteTokenizer().encode("4") + [257]  # the response and EOS only
    b = Batches(DataSettings(source="jsonl", path=str(path), batch_size=2, seq_len=64), ByteTokenizer(), 300)
    assert b(0)["input_ids"].shape == (2, 64)


@pytest.mark.parametrize(
    "rows,message",
    [
        (['{"instruction": "x", "output": '], r"d.jsonl:1: not valid JSON"),
        ([{"instruction": "x"}], r"d.jsonl:1: missing or non-string key\(s\) \['output'\]"),
        (["[1, 2]"], r"d.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_jsonl_rows_name_the_line(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_alpaca_jsonl(_jsonl(tmp_path, rows), ByteTokenizer(), 64)


def test_missing_file_and_truncated_responses(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_alpaca_jsonl(tmp_path / "nope.jsonl", ByteTokenizer(), 64)
    path = _jsonl(tmp_path, [{"instruction": "a long instruction " * 10, "output": "y"}])
    with pytest.raises(ValueError, match="every response was truncated away"):
        load_alpaca_jsonl(path, ByteTokenizer(), 16)
