"""Planted defects of the class "state across calls", in copies of the shipped example (each factory is
``--lora-impl lora_suite.scenarios.example_plants:<name>``; ``example_plant_table.PLANTS`` names the check that must
catch it): a value computed once and reused, or one that depends on what ran before. Each passes every check that
judges one call or one fixed sequence (the parity grid, eval mode, merge, the round trip); the adapter lifecycle
(``lora_suite.judges.lifecycle``) catches it within a few rules.

- ``inference_weight_cached``: inference (eval mode, no grad) runs on W + s·B·A cached at its first call;
  ``load_adapter`` empties the cache, an optimizer step does not: eval after more training shows the old adapters;
- ``merge_kept_in_eval``: ``merge_adapters`` folds s·B·A into W and keeps the layer with a ``merged`` flag (PEFT's
  way), but only train mode honours the flag: in eval mode the adapters are added a second time;
- ``inference_cast_cache_kept_over_to``: inference runs on the adapters cast to the activation dtype, cached per
  dtype and keyed on the adapters' version counters (an optimizer step and a load bump them); ``module.to()`` does
  not, so after fp32 -> bf16 -> fp32 the fp32 entry still holds the adapters as they were before their rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_suite.scenarios.example_plant_base import _example, _forward_plant, _lora, _planted


def _inference(layer) -> bool:
    return not layer.training and not torch.is_grad_enabled()


def _cached_weight(self, x):
    """W + s·B·A (fp32, rounded once to x's dtype) made at the first inference call and kept (made again only for
    another activation dtype)."""
    if not _inference(self):
        return _example().PlainLoRALinear.forward(self, x)
    self.calls += 1
    w = getattr(self, "_inference_weight", None)
    if w is None or w.dtype != x.dtype:
        delta = self.scale * (self.lora_B.float() @ self.lora_A.float())
        w = self._inference_weight = (self.base.weight.float() + delta).to(x.dtype)
    return F.linear(x, w, self.base.bias)


def inference_weight_cached():
    """Eval-mode no-grad forwards use a merged weight cached at the first one; load_adapter clears it, training not."""

    def load_adapter(self, model, path):
        _example().PlainLoRA.load_adapter(self, model, path)
        for m in self.layers(model).values():
            m._inference_weight = None

    return _planted("inference_weight_cached", forward=_cached_weight, load_adapter=load_adapter)


def _merged_in_train_only(self, x):
    if getattr(self, "merged", False) and self.training:
        self.calls += 1
        return self.base(x)
    return _example().PlainLoRALinear.forward(self, x)


def merge_kept_in_eval():
    """merge_adapters folds s·B·A into W (fp32, rounded once) and marks the layer merged; eval() ignores the mark."""

    def merge_adapters(self, model):
        for m in self.layers(model).values():
            with torch.no_grad():
                delta = m.scale * (m.lora_B.float() @ m.lora_A.float())
                m.base.weight.copy_((m.base.weight.float() + delta).to(m.base.weight.dtype))
            m.merged = True

    return _planted("merge_kept_in_eval", forward=_merged_in_train_only, merge_adapters=merge_adapters)


def _version_keyed_cast(self, x):
    """Inference on A and B cast to x's dtype, one cached pair per dtype, reused while their versions are unchanged."""
    if not _inference(self):
        return _example().PlainLoRALinear.forward(self, x)
    self.calls += 1
    cache = self.__dict__.setdefault("_casts", {})
    key = (self.lora_A._version, self.lora_B._version)
    if cache.get(x.dtype, (None,))[0] != key:
        cache[x.dtype] = (key, self.lora_A.detach().to(x.dtype, copy=True), self.lora_B.detach().to(x.dtype, copy=True))
    _, a, b = cache[x.dtype]
    return self.base(x) + self.scale * _lora(self, x, a, b)


inference_cast_cache_kept_over_to = _forward_plant("inference_cast_cache_kept_over_to", _version_keyed_cast)


def settings_kept_on_the_implementation():
    """inject records the model's r, lora_alpha and use_rslora on the implementation the first time (reused for every
    later model): the second model's saved folder names the first model's settings."""
    example_inject = _example().PlainLoRA.inject

    def inject(self, model, spec):
        adapted = example_inject(self, model, spec)
        model._plain_lora = self.__dict__.setdefault("_first_settings", model._plain_lora)
        return adapted

    return _planted("settings_kept_on_the_implementation", inject=inject)


def served_by_kept_on_the_implementation():
    """served_by answers once and keeps the answer on the implementation: a model none of whose layers ran is then
    reported as served (the first model's forward counted for every later one)."""
    example_served_by = _example().PlainLoRA.served_by

    def served_by(self, model):
        return self.__dict__.setdefault("_served", example_served_by(self, model))

    return _planted("served_by_kept_on_the_implementation", served_by=served_by)
