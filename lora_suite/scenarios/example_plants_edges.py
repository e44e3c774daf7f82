"""Plants in the example at the edges of what a default run draws (issue 70): the gradient a LoRA layer returns to its
input, ranks beyond a kernel's tile, adapter folders that hold part of the adapters, square layers under a merge. Each
is a class a stack written outside the project carried through the quick tier green before its check drew the case."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_suite.scenarios.example_plant_base import _example, _forward_plant, _layer_init_then, _lora, _planted


class _CleanGradient(torch.autograd.Function):
    """The identity forward; the backward replaces NaN/Inf in the gradient by 0 (a "safe" custom backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return torch.nan_to_num(dx, nan=0.0, posinf=0.0, neginf=0.0)


def _input_grad_cleaned(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * _lora(self, _CleanGradient.apply(x), a, b)


# The gradient the LoRA path returns to its input cleaned of NaN/Inf: dx = dy W + clean(s·(dy B) A). A NaN in the
# upstream gradient still reaches dx through dy W, so only a poison on the adapters' side shows it.
lora_input_grad_nan_to_num = _forward_plant("lora_input_grad_nan_to_num", _input_grad_cleaned)

TILE = 128  # the rank a kernel's tile holds


def _rank_cut(self, x):
    self.calls += 1
    a, b = self.lora_A[:TILE].to(x.dtype), self.lora_B[:, :TILE].to(x.dtype)
    return self.base(x) + self.scale * _lora(self, x, a, b)


# Only the first TILE rank components take part in the forward: right at every r <= 128, wrong above.
rank_cut_at_tile = _forward_plant("rank_cut_at_tile", _rank_cut)


def _settings_checked(model, path) -> None:
    """The example's own check of the folder's settings (r, lora_alpha, use_rslora), which these plants keep."""
    import json

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    for key, want in model._plain_lora.items():
        absent: object = False if key == "use_rslora" else {} if key.endswith("_pattern") else None
        if config.get(key, absent) != want:
            raise ValueError(f"{path} has {key}={config.get(key)!r}, the model {want!r}")


def load_takes_complete_pairs():
    """load_adapter checks each adapter it finds (its A and B both present, shapes that fit) and loads those, but never
    asks that every adapted layer be in the folder: a folder holding part of the adapters loads without a word."""

    def load_adapter(self, model, path):
        from safetensors.torch import load_file

        _settings_checked(model, path)
        prefix = _example().PEFT_PREFIX
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        params = self.adapter_parameters(model)
        unknown = [k for k in tensors if k.removeprefix(prefix).removesuffix(".weight") not in params]
        if unknown:
            raise ValueError(f"{path}: tensors {unknown[:3]} fit no adapter")
        layers = {n.rsplit(".", 1)[0] for n in params}
        with torch.no_grad():
            for layer in layers:
                a, b = (f"{prefix}{layer}.{w}.weight" for w in ("lora_A", "lora_B"))
                if (a in tensors) != (b in tensors):
                    raise ValueError(f"{path}: {layer} has one of lora_A and lora_B")
                if a in tensors:
                    for key, p in ((a, params[f"{layer}.lora_A"]), (b, params[f"{layer}.lora_B"])):
                        if tensors[key].shape != p.shape:
                            raise ValueError(
                                f"{path}: {key} has shape {tuple(tensors[key].shape)}, not {tuple(p.shape)}"
                            )
                        p.copy_(tensors[key])

    return _planted("load_takes_complete_pairs", load_adapter=load_adapter)


def merge_oriented_by_shape():
    """merge_adapters forms the delta as Aᵀ·Bᵀ (in, out) and transposes it when it does not fit the weight: right on
    every non-square layer, the transpose of s·B·A on a square one (in = out)."""

    def merge_adapters(self, model):
        for path, m in self.layers(model).items():
            with torch.no_grad():
                delta = m.scale * (m.lora_A.float().T @ m.lora_B.float().T)
                if delta.shape != m.base.weight.shape:
                    delta = delta.T
                m.base.weight.copy_((m.base.weight.float() + delta).to(m.base.weight.dtype))
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m.base)

    return _planted("merge_oriented_by_shape", merge_adapters=merge_adapters)


def trainable_by_substring():
    """inject marks trainable every parameter whose name holds ``lora_`` (loralib's mark_only_lora_as_trainable), and
    nothing else: a base weight under a module named ``lora_x`` trains with the adapters."""
    example_inject = _example().PlainLoRA.inject

    def inject(self, model, spec):
        adapted = example_inject(self, model, spec)
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
        return adapted

    return _planted("trainable_by_substring", inject=inject)


def load_keys_stripped_of_weight():
    """load_adapter names a folder tensor by its key with every ``.weight`` removed and loads those it finds: a layer
    under a module named ``weight`` (``block.weight.lora_A.weight`` becomes ``block.lora_A``) keeps its adapters as
    they were, silently (peft#2773's class)."""

    def load_adapter(self, model, path):
        from safetensors.torch import load_file

        _settings_checked(model, path)
        prefix = _example().PEFT_PREFIX
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        params = self.adapter_parameters(model)
        with torch.no_grad():
            for key, t in tensors.items():
                name = key.removeprefix(prefix).replace(".weight", "")
                if name in params:
                    params[name].copy_(t)

    return _planted("load_keys_stripped_of_weight", load_adapter=load_adapter)


def _kaiming_default_a(layer, example_init, base, r, alpha, use_rslora, adapter_dtype):
    example_init(base, r, alpha, use_rslora, adapter_dtype)
    with torch.no_grad():
        torch.nn.init.kaiming_uniform_(layer.lora_A)  # a = 0, torch's default: bound √(6/in), not 1/√in


def lora_a_init_spread():
    """A drawn with kaiming_uniform_'s default a = 0 (a forgotten a=√5): U(±√(6/in)), √6 ≈ 2.45 times PEFT's spread.
    Every function check passes (B is still zero); training starts from another point than the reference's."""
    return _layer_init_then("lora_a_init_spread", _kaiming_default_a)
