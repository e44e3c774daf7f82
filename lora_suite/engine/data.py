"""Training data: the embedded default corpus, or Alpaca-format JSONL; batches are a pure function of the step.

Embedded default: ``EMBEDDED_CORPUS`` (an original English text of ~4 KB written for this project),
tokenised, repeated into a stream, and cut into windows at offsets drawn from a generator seeded with
(seed, step), or, with ``pool: N``, cycled through N fixed windows (N = batch size: one fixed batch, the
classic "overfit one batch" check of a training loop). Deterministic, so a resumed run sees the same
batches, and learnable by LoRA on a random-initialised base: the model can fit the corpus's statistics
and memorise the pool. (A random bigram stream is not: on an H200 SmolLM2-135M with q,v adapters lowered its loss only
5% in 100 steps on one.) Each tier's loss threshold is calibrated on this corpus and
says so in its YAML.

Tokenisers: a checkpoint's own tokenizer when it has one; otherwise ``ByteTokenizer`` (ids 0-255 are
bytes, then BOS, EOS, PAD), whose ids fit every Llama vocabulary.

JSONL: one object per line with "instruction", optional "input", and "output"; the prompt is formatted as
in Stanford Alpaca, the loss is taken on the response only (prompt and padding labelled -100).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from lora_suite.settings.config import DataSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100

EMBEDDED_CORPUS = """\
The lighthouse keeper kept a notebook for the weather. Every morning at six he wrote the wind, the swell,
the colour of the sky over the western ridge, and the number of boats that left the harbour before
breakfast. On calm days the list was long and the handwriting was neat. On rough days the entries were
short, and some of them were only a single word: grey, or rain, or no boats.

His daughter learned to read from that notebook. She knew the word north before she knew the word
apple, and she could spell barometer long before she could tie her shoes. When she was seven she began
to add her own lines at the bottom of each page, in pencil, in capital letters: GULLS ON THE ROCK.
FOG TILL TEN. ONE SEAL. Her father never corrected them. He said that a record is only useful if
nobody is afraid to write in it.

The island had one road, one shop, and a school with eleven pupils. The road ran from the pier to the
lighthouse and stopped there, as if it had nothing more to say. In winter the ferry came twice a week,
and the shop sold out of bread on the day before it arrived. People planned their lives around the
ferry the way other people plan around the seasons. Letters, medicine, nails, flour and news all came
on the same small boat, and all of it was late when the sea was high.

Measuring things carefully was the family habit. The keeper checked the lamp at dusk and again at
midnight, wrote the time, and signed his name. He tested the fog horn on the first day of each month.
He counted the stairs, one hundred and twelve, and repainted the numbers on every tenth step when the
salt had eaten them. When an inspector visited from the mainland, he asked to see the notebooks, and he
read them for an hour without speaking. Then he said that the island had the best records on the coast,
and that he would like to copy the method.

The method was simple. Write what you see, not what you expect to see. Write it at the same time every
day. Use the same words for the same things. If you make a mistake, cross it out with one line so that
it can still be read, and write the correction beside it. Never tear out a page. Compare today with the
same day last year, and if the difference is large, look again before you believe it.

Years later the daughter became an engineer and worked on machines that learn from examples. She found
that the old rules still applied. A training run is a long voyage, and its log is the only witness. Record
the loss at every step, the speed, the memory, the rate of learning. Run the same test the same way every
night. When a number changes, do not smooth it away; find out why. A result that nobody can repeat is a
story, not a measurement.

She kept a notebook on her desk, with the wind and the weather of her experiments: loss falling, memory
flat, throughput steady, one seal. Her colleagues laughed at the last line, but she kept writing it. It
reminded her that the most useful records are honest about small things, and that a long list written
on a calm day is worth as much as a single word written in a storm.
"""


class Tokenizer(Protocol):
    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then BOS 256, EOS 257, PAD 258: for models without their own tokenizer."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class HFTokenizer:
    """A transformers tokenizer behind the same small interface."""

    tok: PreTrainedTokenizerBase

    @property
    def eos_id(self) -> int:
        return self.tok.eos_token_id

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]


def tokenizer_for(hf_tokenizer: PreTrainedTokenizerBase | None) -> Tokenizer:
    return ByteTokenizer() if hf_tokenizer is None else HFTokenizer(hf_tokenizer)


class Batches:
    """``batches(step)`` -> {"input_ids", "labels"} of shape (batch, seq_len), the same for the same step."""

    def __init__(self, settings: DataSettings, tokenizer: Tokenizer, model_vocab_size: int, device="cpu"):
        if tokenizer.vocab_size > model_vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has {model_vocab_size}"
            )
        self.settings, self.tokenizer, self.device = settings, tokenizer, torch.device(device)
        if settings.source == "embedded":
            ids = tokenizer.encode(EMBEDDED_CORPUS) + [tokenizer.eos_id]
            need = settings.seq_len * 4  # a stream several windows long, so that offsets vary
            self.stream: torch.Tensor | None = torch.tensor(ids * max(1, -(-need // len(ids))), dtype=torch.long)
            self.examples: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        else:
            assert settings.path is not None, "settings_rules: data.source 'jsonl' needs data.path"
            self.stream = None
            self.examples = load_alpaca_jsonl(settings.path, tokenizer, settings.seq_len)

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        s = self.settings
        gen = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        if self.stream is not None:
            if s.pool:
                pool = torch.randint(
                    0, len(self.stream) - s.seq_len + 1, (s.pool,), generator=torch.Generator().manual_seed(s.seed)
                ).tolist()
                starts = [pool[(step * s.batch_size + j) % s.pool] for j in range(s.batch_size)]
            else:
                starts = torch.randint(0, len(self.stream) - s.seq_len + 1, (s.batch_size,), generator=gen).tolist()
            ids = torch.stack([self.stream[i : i + s.seq_len] for i in starts])
            labels = ids.clone()
        else:
            assert self.examples is not None, "a source without a stream has examples (__init__)"
            pick = torch.randint(0, len(self.examples), (s.batch_size,), generator=gen).tolist()
            ids = torch.stack([self.examples[i][0] for i in pick])
            labels = torch.stack([self.examples[i][1] for i in pick])
        return {"input_ids": ids.to(self.device), "labels": labels.to(self.device)}


ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def load_alpaca_jsonl(path: str | Path, tokenizer: Tokenizer, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per example, truncated / padded to ``seq_len``; loss on the response only."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.path {path} does not exist (expected an Alpaca-format JSONL file)")
    examples = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            raise ValueError(
                f"{path}:{lineno}: missing or non-string key(s) {missing}; an Alpaca row has "
                "'instruction', optional 'input', and 'output'"
            )
        extra = row.get("input") or ""
        prompt = ALPACA_PROMPT.format(
            instruction=row["instruction"], input_block=f"### Input:\n{extra}\n\n" if extra else ""
        )
        p_ids, r_ids = tokenizer.encode(prompt), tokenizer.encode(row["output"]) + [tokenizer.eos_id]
        ids = (p_ids + r_ids)[:seq_len]
        labels = ([IGNORE_INDEX] * len(p_ids) + r_ids)[:seq_len]
        pad = seq_len - len(ids)
        ids += [tokenizer.pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        examples.append((torch.tensor(ids), torch.tensor(labels)))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    if all((lab == IGNORE_INDEX).all() for _, lab in examples):
        raise ValueError(f"{path}: every response was truncated away at seq_len={seq_len}; raise data.seq_len")
    return examples
