"""A tier's model, adapters and data from its config: the part every tier shares before training.

``prepare(cfg, device)`` builds the base model (``models.build_model``, honouring the weights mode),
injects LoRA into the configured targets, and returns it with the batch source and what was built, in
words, for the report. The torch dtype names of the YAML are resolved here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lora_suite.config import TierConfig
from lora_suite.data import Batches, tokenizer_for
from lora_core.inject import adapter_parameters, inject_lora, lora_modules
from lora_suite.models import BuiltModel, build_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Prepared:
    built: BuiltModel
    model: nn.Module
    batches: Batches
    replaced: list[str]  # module names that received adapters
    quantize: str | None  # the base storage actually used (None: 16-bit)

    def describe(self, cfg: TierConfig) -> str:
        lora = cfg.lora
        return (f"{cfg.model.name}: {self.built.source}; weights={self.built.weights}; {cfg.dtype} base"
                f"{' stored as NF4' if self.quantize else ''}; LoRA r={lora.r} alpha={lora.alpha} on {list(lora.targets)} "
                f"({len(self.replaced)} layers, {lora.adapter_dtype} adapters); data {cfg.data.source} "
                f"{cfg.data.batch_size}x{cfg.data.seq_len}")


def prepare(cfg: TierConfig, device: torch.device | str, *, backend: str | None = None, seed: int | None = None,
            quantize: str | None | bool = True) -> Prepared:
    """Build, inject and batch per ``cfg``. ``quantize=True`` means the config's own setting.

    Adapters are injected (and, with NF4, the layer quantised) one decoder layer at a time as the model
    is built, so a QLoRA 7B model never exists in 16 bits as a whole.
    """
    seed = cfg.train.seed if seed is None else seed
    quantize = cfg.lora.quantize if quantize is True else quantize
    lora = cfg.lora

    def on_layer(layer: nn.Module) -> None:
        inject_lora(layer, lora.targets, lora.r, lora.alpha, backend=backend if backend is not None else cfg.backend,
                    use_rslora=lora.use_rslora, adapter_dtype=DTYPES[lora.adapter_dtype], quantize=quantize)

    torch.manual_seed(seed)  # adapter init (kaiming A) is the same for the same seed on every backend
    built = build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], device, seed=seed, on_layer=on_layer)
    adapter_ids = {id(a) for a in adapter_parameters(built.model).values()}
    for p in built.model.parameters():  # embeddings, norms, LM head: frozen
        if id(p) not in adapter_ids:
            p.requires_grad_(False)
    replaced = list(lora_modules(built.model))
    batches = Batches(cfg.data, tokenizer_for(built.tokenizer), cfg.model.architecture.vocab_size, device)
    return Prepared(built, built.model, batches, replaced, quantize)
