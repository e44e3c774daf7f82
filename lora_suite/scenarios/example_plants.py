"""Planted defects in copies of the shipped example implementation (``examples/plain_lora.py``): each factory here is
``--lora-impl lora_suite.scenarios.example_plants:<name>``, the example with exactly one defect, and ``PLANTS`` says
which tier must catch it. selftest-gpu runs every plant through that tier and prints the table defect -> tier ->
check that caught it; the CPU tests run the layer checks and the round trip on the ones the CPU can show.

The example is read from the checkout (it is a file users copy, not part of the installed package).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lora_suite.scenarios.example_plant_base import (  # noqa: F401  (EP._example: the tests' handle on the example)
    EXAMPLE,
    _example,
    _forward_plant,
    _layer_init_then,
    _lora,
    _planted,
)
from lora_suite.scenarios.example_plant_table import PLANTS  # noqa: F401  (EP.PLANTS: what each plant must fail)


def _scale_twice(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * self.scale * _lora(self, x, a, b)


def _frozen_b(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.detach().to(x.dtype)
    return self.base(x) + self.scale * _lora(self, x, a, b)


def _no_input_grad(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * _lora(self, x.detach(), a, b)


def _eval_skips(self, x):
    self.calls += 1
    if not self.training:
        return self.base(x)
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * _lora(self, x, a, b)


def _upcast(self, x):
    self.calls += 1
    base = self.base(x.to(self.base.weight.dtype)).float()
    return base + self.scale * _lora(self, x.float(), self.lora_A.float(), self.lora_B.float())


def _nondeterministic(self, x):
    """A racy reduction's footprint: the LoRA term's last bits differ from call to call (up to 2^-9 relative, summed
    with the base in fp32 and rounded once: inside the 16-bit parity tolerances, 2^-5)."""
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    jitter = 1.0 + 2.0**-9 * float(torch.rand(()))
    return (self.base(x).float() + (self.scale * jitter) * _lora(self, x, a, b).float()).to(x.dtype)


_KEPT: list[torch.Tensor] = []


def _leaky(self, x):
    """1 MiB of device memory kept per call of the first adapted layer (a cache that is never emptied)."""
    if getattr(self, "leaks", False):
        _KEPT.append(torch.empty(1 << 19, dtype=torch.bfloat16, device=x.device))
    return _example().PlainLoRALinear.forward(self, x)


scale_twice = _forward_plant("scale_twice", _scale_twice)
frozen_lora_b = _forward_plant("frozen_lora_b", _frozen_b)
input_grad_dropped = _forward_plant("input_grad_dropped", _no_input_grad)
eval_skips_adapters = _forward_plant("eval_skips_adapters", _eval_skips)
output_upcast_fp32 = _forward_plant("output_upcast_fp32", _upcast)
nondeterministic_forward = _forward_plant("nondeterministic_forward", _nondeterministic)


def _inject_then(name: str, change, **kw):
    """The example whose ``inject`` runs as shipped, then ``change(layers, adapted paths, model)`` (under no_grad)."""

    def inject(self, model, spec):
        adapted = _example().PlainLoRA.inject(self, model, spec)
        with torch.no_grad():
            change(list(self.layers(model).values()), adapted, model)
        return adapted

    return _planted(name, inject=inject, **kw)


def gpu_memory_leak():
    def first_leaks(layers, adapted, model):
        model.get_submodule(adapted[0]).leaks = True

    return _inject_then("gpu_memory_leak", first_leaks, forward=_leaky)


def save_drops_lora_b():
    def save_adapter(self, model, path):
        ex = _example()
        out = ex.PlainLoRA.save_adapter(self, model, path)
        from safetensors.torch import load_file, save_file

        weights = out / "adapter_model.safetensors"
        kept = {k: v for k, v in load_file(str(weights)).items() if ".lora_B." not in k}
        save_file(kept, str(weights), metadata={"format": "pt"})
        return out

    return _planted("save_drops_lora_b", save_adapter=save_adapter)


def _load_each(name: str, load):
    """The example whose ``load_adapter`` reads the folder's tensors and, under no_grad, runs ``load(parameter,
    tensors, key)`` for each adapter parameter (``key``: its tensor's name in the folder), nothing else."""

    def load_adapter(self, model, path):
        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        with torch.no_grad():
            for n, p in self.adapter_parameters(model).items():
                load(p, tensors, f"{_example().PEFT_PREFIX}{n}.weight")

    return _planted(name, load_adapter=load_adapter)


def load_ignores_alpha():
    """load_adapter copies the tensors and leaves the layers' alpha and r (so their scale) as they were."""

    def copy(p, tensors, key):
        p.copy_(tensors[key])

    return _load_each("load_ignores_alpha", copy)


def target_left_out():
    def targets_of(self, model, targets):
        found = _example().PlainLoRA.targets_of(self, model, targets)
        return [(p, m) for p, m in found if not p.endswith("v_proj")]

    return _planted("target_left_out", targets_of=targets_of)


def _plant(name: str, build, change):
    """The factory ``<name>()`` of the example ``build(name, change)`` (``--lora-impl ...example_plants:<name>``),
    documented by ``change``'s docstring."""

    def factory():
        return build(name, change)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = change.__doc__
    return factory


def _on_each_layer(name: str, change):
    """The example whose ``inject`` runs as shipped, then ``change(layer)`` on every adapted layer (under no_grad)."""

    def each(layers, adapted, model):
        for m in layers:
            change(m)

    return _inject_then(name, each)


def _random_b(m):
    """lora_B drawn at small random values (std 1e-3) instead of zeros: the adapted model is not the base at step 0."""
    m.lora_B.normal_(0.0, 1e-3)


def _zero_a(m):
    """lora_A zero as well as lora_B: the model starts as the base, and no gradient ever reaches either adapter."""
    m.lora_A.zero_()


def _trainable_base(m):
    """inject freezes nothing: the base weights stay trainable (an optimizer over model.parameters() moves them)."""
    m.base.weight.requires_grad_(True)


def _rslora_ignored(layer, example_init, base, r, alpha, use_rslora, adapter_dtype):
    """use_rslora=True accepted (and saved) but the scale stays alpha / r."""
    example_init(base, r, alpha, False, adapter_dtype)


def _scale_integer_division(layer, example_init, base, r, alpha, use_rslora, adapter_dtype):
    """s = alpha // r: right whenever r divides alpha (the usual alpha = 2r), wrong otherwise."""
    example_init(base, r, alpha, use_rslora, adapter_dtype)
    layer.scale = alpha // (r**0.5 if use_rslora else r)


def _adapter_dtype_ignored(layer, example_init, base, r, alpha, use_rslora, adapter_dtype):
    """Adapters made in the base weight's dtype whatever AdapterSpec.adapter_dtype asks for."""
    example_init(base, r, alpha, use_rslora, None)


lora_b_random_init = _plant("lora_b_random_init", _on_each_layer, _random_b)
lora_a_zero_init = _plant("lora_a_zero_init", _on_each_layer, _zero_a)
base_left_trainable = _plant("base_left_trainable", _on_each_layer, _trainable_base)
rslora_ignored = _plant("rslora_ignored", _layer_init_then, _rslora_ignored)
scale_integer_division = _plant("scale_integer_division", _layer_init_then, _scale_integer_division)
adapter_dtype_ignored = _plant("adapter_dtype_ignored", _layer_init_then, _adapter_dtype_ignored)


def _input_clipped_in_place(self, x):
    """Outliers clipped 'to protect fp16' on the LoRA path, in place through .data: the caller's x changes."""
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    y = self.base(x)
    x.data.clamp_(-2.0, 2.0)
    return y + self.scale * _lora(self, x, a, b)


input_clipped_in_place = _forward_plant("input_clipped_in_place", _input_clipped_in_place)


class _KeptInput(torch.autograd.Function):
    """The LoRA term with its input kept on the layer (``layer.kept = x``) instead of in ``ctx``: a second forward
    before the backward overwrites it."""

    @staticmethod
    def forward(ctx, x, a, b, layer):
        layer.kept = x.detach()
        ctx.save_for_backward(a, b)
        ctx.layer = layer
        return layer.scale * F.linear(F.linear(x, a), b)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        x, s = ctx.layer.kept, ctx.layer.scale
        dh = dy @ b  # (*, r)
        dx = s * dh @ a
        da = s * dh.reshape(-1, dh.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        db = s * dy.reshape(-1, dy.shape[-1]).T @ (x @ a.T).reshape(-1, a.shape[0])
        return dx, da, db, None


def _kept_input(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + _KeptInput.apply(x, a, b, self)


input_kept_on_the_layer = _forward_plant("input_kept_on_the_layer", _kept_input)


def merge_ignores_rslora():
    """merge_adapters folds B·A with alpha / r even where the forward applies alpha / √r."""

    def merge_adapters(self, model):
        for m in self.layers(model).values():
            m.scale = m.alpha / m.r
        _example().PlainLoRA.merge_adapters(self, model)

    return _planted("merge_ignores_rslora", merge_adapters=merge_adapters)


def merge_folds_nothing():
    """merge_adapters reports success and leaves every layer as it was (the unmerged function, adapters in place)."""

    def merge_adapters(self, model):
        return None

    return _planted("merge_folds_nothing", merge_adapters=merge_adapters)


def inject_accepts_unmatched_targets():
    """inject adapts nothing, silently, where no layer matches the targets (a typo in target_modules trains nothing)."""

    def inject(self, model, spec):
        if not self.targets_of(model, tuple(spec.targets)):
            for p in model.parameters():
                p.requires_grad_(False)
            return []
        return _example().PlainLoRA.inject(self, model, spec)

    return _planted("inject_accepts_unmatched_targets", inject=inject)


def load_takes_what_fits():
    """load_adapter copies the tensors whose key and shape fit and skips the rest (a non-strict load, silently)."""

    def copy_if_it_fits(p, tensors, key):
        t = tensors.get(key)
        if t is not None and t.shape == p.shape:
            p.copy_(t)

    return _load_each("load_takes_what_fits", copy_if_it_fits)


from lora_suite.scenarios.example_plants_arch import base_bias_dropped, base_bias_left_trainable  # noqa: E402,F401
from lora_suite.scenarios.example_plants_edges import (  # noqa: E402,F401
    load_keys_stripped_of_weight,
    load_takes_complete_pairs,
    lora_a_init_spread,
    lora_input_grad_nan_to_num,
    merge_oriented_by_shape,
    rank_cut_at_tile,
    trainable_by_substring,
)
from lora_suite.scenarios.example_plants_ops import (  # noqa: E402,F401
    alpha_pattern_ignored,
    disable_not_restored_on_error,
    patterns_not_saved,
    rescale_compounds,
    rescale_ignores_rslora,
    unmerge_leaves_delta,
)
from lora_suite.scenarios.example_plants_state import (  # noqa: E402,F401
    inference_cast_cache_kept_over_to,
    inference_weight_cached,
    merge_kept_in_eval,
    served_by_kept_on_the_implementation,
    settings_kept_on_the_implementation,
)
from lora_suite.scenarios.example_plants_values import (  # noqa: E402,F401
    adapter_grads_nan_to_num,
    lora_a_nan_to_num,
    lora_input_nan_to_num,
    merge_delta_bf16,
    scale_rounded_bf16,
)
