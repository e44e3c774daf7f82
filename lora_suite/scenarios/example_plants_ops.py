"""Plants in the example's optional operations (issue 70): what a user calls on an adapted model beyond training
(unmerge, the adapters disabled for a block, the scale set by a factor). Each is a class of real reports: an adapter
deleted while merged left its delta in the weight (peft#3498), an exception inside ``disable_adapter`` left the
adapters off (peft#367), ``set_scale`` recomputed alpha/r under rsLoRA (peft#2733); the lifecycle machine judges
them, since every other check calls none of these operations."""

from __future__ import annotations

from contextlib import contextmanager

from lora_suite.scenarios.example_plant_base import _planted


def unmerge_leaves_delta():
    """unmerge_adapters puts each LoRA layer back and leaves s·B·A in its base weight (applied twice from then on)."""

    def unmerge_adapters(self, model):
        for path, m in model.__dict__.pop("_plain_lora_merged", {}).items():
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m)

    return _planted("unmerge_leaves_delta", unmerge_adapters=unmerge_adapters)


def disable_not_restored_on_error():
    """disabled_adapters turns the adapters back on only when the block ends normally (no try/finally): an exception
    inside it leaves the model computing its base function."""

    @contextmanager
    def disabled_adapters(self, model):
        layers = list(self.layers(model).values())
        for m in layers:
            m.enabled = False
        yield
        for m in layers:
            m.enabled = True

    return _planted("disable_not_restored_on_error", disabled_adapters=disabled_adapters)


def rescale_ignores_rslora():
    """set_adapter_scale sets factor · alpha / r whatever use_rslora says (alpha / √r)."""

    def set_adapter_scale(self, model, factor):
        for m in self.layers(model).values():
            m.scale = factor * m.alpha / m.r

    return _planted("rescale_ignores_rslora", set_adapter_scale=set_adapter_scale)


def rescale_compounds():
    """set_adapter_scale multiplies the current scale by the factor (PEFT's scale_layer) where it must set it: right
    once from the spec's scale, wrong on the second call."""

    def set_adapter_scale(self, model, factor):
        for m in self.layers(model).values():
            m.scale = m.scale * factor

    return _planted("rescale_compounds", set_adapter_scale=set_adapter_scale)


def alpha_pattern_ignored():
    """inject builds every layer with the spec's alpha, whatever alpha_pattern says (r per module kept): the layers a
    pattern names run at the wrong scale."""

    def inject(self, model, spec):
        import dataclasses

        from lora_suite.scenarios.example_plant_base import _example

        return _example().PlainLoRA.inject(self, model, dataclasses.replace(spec, alpha_pattern=()))

    return _planted("alpha_pattern_ignored", inject=inject)


def patterns_not_saved():
    """save_adapter leaves rank_pattern and alpha_pattern out of adapter_config.json and load_adapter does not ask for
    them: its own round trip is bitwise (the tensors carry their ranks), but the folder says every layer has r and
    alpha, so PEFT (or anyone) reads it wrong."""
    from lora_suite.scenarios.example_plant_base import _example

    def save_adapter(self, model, path):
        patterns = {k: model._plain_lora.pop(k) for k in ("rank_pattern", "alpha_pattern")}
        try:
            return _example().PlainLoRA.save_adapter(self, model, path)
        finally:
            model._plain_lora.update(patterns)

    def load_adapter(self, model, path):
        patterns = {k: model._plain_lora.pop(k) for k in ("rank_pattern", "alpha_pattern")}
        try:
            _example().PlainLoRA.load_adapter(self, model, path)
        finally:
            model._plain_lora.update(patterns)

    return _planted("patterns_not_saved", save_adapter=save_adapter, load_adapter=load_adapter)
