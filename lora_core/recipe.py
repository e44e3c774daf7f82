"""A tier's model, adapters and data from its config: the part every tier shares before training.

``prepare(cfg, device)`` builds the base model (``models.build_model``, honouring the weights mode),
injects LoRA into the configured targets, and returns it with the batch source and what was built, in
words, for the report. The torch dtype names of the YAML are resolved here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lora_core.config import TierConfig
from lora_core.data import Batches, tokenizer_for
from lora_core.inject import inject_lora
from lora_core.models import BuiltModel, build_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Prepared:
    built: BuiltModel
    model: nn.Module
    batches: Batches
    replaced: list[str]  # module names that received adapters

    def describe(self, cfg: TierConfig) -> str:
        lora = cfg.lora
        return (f"{cfg.model.name}: {self.built.source}; weights={self.built.weights}; {cfg.dtype} base"
                f"{' (NF4)' if lora.quantize else ''}; LoRA r={lora.r} alpha={lora.alpha} on {list(lora.targets)} "
                f"({len(self.replaced)} layers, {lora.adapter_dtype} adapters); data {cfg.data.source} "
                f"{cfg.data.batch_size}x{cfg.data.seq_len}")


def prepare(cfg: TierConfig, device: torch.device | str, *, backend: str | None = None, seed: int | None = None) -> Prepared:
    seed = cfg.train.seed if seed is None else seed
    built = build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], device, seed=seed)
    torch.manual_seed(seed)  # adapter init (kaiming A) is the same for the same seed on every backend
    replaced = inject_lora(built.model, cfg.lora.targets, cfg.lora.r, cfg.lora.alpha,
                           backend=backend if backend is not None else cfg.backend,
                           use_rslora=cfg.lora.use_rslora, adapter_dtype=DTYPES[cfg.lora.adapter_dtype])
    batches = Batches(cfg.data, tokenizer_for(built.tokenizer), cfg.model.architecture.vocab_size, device)
    return Prepared(built, built.model, batches, replaced)
