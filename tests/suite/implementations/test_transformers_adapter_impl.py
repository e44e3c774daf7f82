"""The ``transformers-adapter`` peer (LoRA through transformers' ``PeftAdapterMixin``: ``model.add_adapter``) on the
CPU: its name is known and resolves; on a tiny random Llama it computes y = x Wᵀ + s·(x Aᵀ) Bᵀ in float64 (rsLoRA's
s too), only A and B get gradients, the model keeps its class, a saved folder reloads into a fresh model with
identical logits, loads with ``peft.PeftModel.from_pretrained`` to the same logits, a lora_core folder loads, a folder
of another r, alpha, rsLoRA or targets is refused naming the value (nothing loaded); merged or disabled adapters are
not reported as served; it trains through the harness (also on bitsandbytes' NF4 base), and the quick tier's layer
properties and adapter lifecycle hold for it on the probe block.

Where the installed transformers refuses the installed peft (its own ``MIN_PEFT_VERSION`` gate: transformers 5.24
asks for peft >= 0.22), every test that adapts a model is skipped with that reason, and the peer's refusal is
tested instead (``test_a_peft_that_transformers_refuses_is_refused_naming_both_versions``)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lora_suite.engine.models import build_tiny_llama
from lora_suite.implementations import AdapterSpec, ImplementationError, adapted_modules, resolve_implementation
from lora_suite.settings.implementation_names import BUNDLED, known_names

peft = pytest.importorskip("peft")

from lora_suite.implementations.transformers_adapter_impl import integration_refusal  # noqa: E402 (needs peft)

NAME = "transformers-adapter"
REFUSED = integration_refusal()
adapts = pytest.mark.skipif(REFUSED is not None, reason=f"transformers refuses the installed peft: {REFUSED}")
F64 = torch.float64
SPEC = AdapterSpec(("q_proj", "v_proj", "down_proj"), 4, 12.0, False, F64)  # s = 3
SPEC32 = dataclasses.replace(SPEC, adapter_dtype=torch.float32)
IDS = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))


def _adapted(spec=SPEC, dtype=F64, randomise=True):
    impl = resolve_implementation(NAME)
    model = build_tiny_llama(dtype)
    impl.inject(model, spec)
    if randomise:  # B non-zero, so that the adapters change the function and dA is not zero
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in impl.adapter_parameters(model).values():
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * p.shape[1] ** -0.5)
    return impl, model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_the_name_is_known_and_resolves():
    assert NAME in known_names() and BUNDLED[NAME].endswith(
        "transformers_adapter_impl:TransformersAdapterImplementation"
    )
    impl = resolve_implementation(NAME)
    assert impl.name == impl.expected_path == NAME
    assert "PeftAdapterMixin.add_adapter" in impl.describe()
    assert impl.reason_not_applicable("rslora") is None and impl.reason_not_applicable("bf16_base") is None


def test_a_peft_that_transformers_refuses_is_refused_naming_both_versions(monkeypatch):
    import transformers.integrations.peft as integration

    monkeypatch.setattr(integration, "MIN_PEFT_VERSION", "999.0")
    impl = resolve_implementation(NAME)  # selection never imports torch: the gate is asked where a model is adapted
    with pytest.raises(ImplementationError, match=r"PEFT integration needs peft >= 999\.0, peft \S+ is installed"):
        impl.preload()
    model = build_tiny_llama()
    with pytest.raises(ImplementationError, match=r"needs peft >= 999\.0"):
        impl.inject(model, SPEC32)
    assert not hasattr(model, "peft_config")


@adapts
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha/r", "rslora"])
def test_each_adapted_layer_and_the_model_compute_the_float64_formula(rslora, one_thread):
    spec = dataclasses.replace(SPEC, use_rslora=rslora)
    impl, model = _adapted(spec)
    assert type(model).__name__ == "LlamaForCausalLM" and not isinstance(model, peft.PeftModel)
    scale = spec.alpha / (math.sqrt(spec.r) if rslora else spec.r)
    adapters, base = impl.adapter_parameters(model), build_tiny_llama(F64)
    paths = adapted_modules(adapters)
    assert {p.rsplit(".", 1)[-1] for p in paths} == set(spec.targets) and len(paths) == 6
    x = torch.randn(3, 5, 128, dtype=F64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for path in paths:
            w, a, b = base.get_submodule(path).weight, adapters[f"{path}.lora_A"], adapters[f"{path}.lora_B"]
            xi = x[..., : w.shape[1]]
            torch.testing.assert_close(
                model.get_submodule(path)(xi), xi @ w.T + scale * (xi @ a.T) @ b.T, rtol=1e-12, atol=1e-12
            )
            base.get_submodule(path).weight += scale * b @ a  # the merged reference model: W + s·B·A
    torch.testing.assert_close(_logits(model), _logits(base), rtol=1e-10, atol=1e-10)
    assert impl.served_by(model) == NAME


@adapts
def test_only_a_and_b_get_gradients():
    impl, model = _adapted(SPEC32, torch.float32)
    adapters = impl.adapter_parameters(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if any(p is q for q in adapters.values())
    }
    model(input_ids=IDS, labels=IDS).loss.backward()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    assert len(with_grad) == len(adapters) and all(any(p is q for q in adapters.values()) for p in with_grad)
    assert all(bool(p.grad.abs().sum() > 0) for p in adapters.values())
    assert {p.dtype for p in adapters.values()} == {torch.float32}


@adapts
def test_a_saved_folder_reloads_with_identical_logits_and_loads_in_peft(tmp_path):
    from safetensors.torch import load_file

    impl, model = _adapted(SPEC32, torch.float32)
    want = _logits(model)
    impl.save_adapter(model, tmp_path / "a")
    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    model.save_pretrained(tmp_path / "hf")  # what transformers itself writes: the same keys and tensors
    theirs = load_file(str(tmp_path / "hf" / "adapter_model.safetensors"))
    assert saved.keys() == theirs.keys() and all(torch.equal(saved[k], theirs[k]) for k in saved)
    assert all(k.startswith("base_model.model.model.layers.") for k in saved)
    _, fresh = _adapted(SPEC32, torch.float32, randomise=False)
    assert not torch.equal(_logits(fresh), want)
    impl.load_adapter(fresh, tmp_path / "a")
    assert torch.equal(_logits(fresh), want)
    got = impl.adapter_parameters(fresh)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in got.values())
    assert impl.served_by(fresh) == NAME
    wrapped = peft.PeftModel.from_pretrained(build_tiny_llama(), str(tmp_path / "a"))
    assert torch.equal(_logits(wrapped), want)


@adapts
def test_a_lora_core_folder_loads(tmp_path):
    from lora_core.adapters import save_peft_adapter
    from lora_core.inject import adapter_parameters, inject_lora

    theirs = build_tiny_llama()
    inject_lora(theirs, SPEC32.targets, SPEC32.r, SPEC32.alpha, backend="torch")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(theirs).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_peft_adapter(theirs, tmp_path / "core")
    impl, model = _adapted(SPEC32, torch.float32, randomise=False)
    impl.load_adapter(model, tmp_path / "core")
    torch.testing.assert_close(_logits(model), _logits(theirs), rtol=1e-5, atol=1e-5)


@adapts
@pytest.mark.parametrize(
    "key, value",
    [("lora_alpha", 24.0), ("r", 8), ("use_rslora", True), ("target_modules", ["q_proj", "k_proj", "down_proj"])],
)
def test_a_folder_of_other_settings_is_refused_naming_the_value_and_nothing_is_loaded(key, value, tmp_path):
    impl, model = _adapted(SPEC32, torch.float32)
    impl.save_adapter(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config[key] = value
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    _, fresh = _adapted(SPEC32, torch.float32, randomise=False)
    before = {n: p.detach().clone() for n, p in impl.adapter_parameters(fresh).items()}
    with pytest.raises(ImplementationError, match=rf"adapter_config\.json has {key}="):
        impl.load_adapter(fresh, tmp_path / "a")
    assert all(torch.equal(p, before[n]) for n, p in impl.adapter_parameters(fresh).items())


@adapts
def test_merged_or_disabled_adapters_are_not_served(one_thread):
    impl, model = _adapted()
    assert impl.served_by(model) == f"{NAME} layers that never ran"
    want = _logits(model)
    model.disable_adapters()
    assert not torch.equal(_logits(model), want)
    assert "disabled=True" in impl.served_by(model)
    model.enable_adapters()
    impl.merge_adapters(model)
    torch.testing.assert_close(_logits(model), want, rtol=1e-10, atol=1e-10)
    assert "merged=True" in impl.served_by(model)
    assert impl.served_by(build_tiny_llama()).endswith(
        "not adapted by transformers' PEFT integration (_hf_peft_config_loaded unset)"
    )


@adapts
def test_it_trains_through_the_harness(tiny_cfg):
    from lora_suite.engine.prepare import prepare
    from lora_suite.engine.trainer import train
    from lora_suite.measure.criteria import loss_drop

    p = prepare(tiny_cfg, "cpu", implementation=NAME)
    result = train(p.model, p.batches, tiny_cfg.train, adapters=p.adapters)
    assert p.implementation.served_by(p.model) == NAME
    assert loss_drop(result.losses, tiny_cfg.criteria.loss_window) >= tiny_cfg.criteria.loss_drop_min


@adapts
def test_on_a_bitsandbytes_nf4_base_it_wraps_peft_s_4bit_layer_and_reloads(tiny_cfg, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    from lora_suite.engine.prepare import prepare

    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16")
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize="nf4"))
    p = prepare(cfg, "cpu", implementation=NAME)
    layers = [p.model.get_submodule(m) for m in adapted_modules(p.adapters)]
    assert layers and all(isinstance(m, PeftLinear4bit) and isinstance(m.base_layer, bnb.nn.Linear4bit) for m in layers)
    probe = p.batches(999)["input_ids"]
    with torch.no_grad():
        logits = p.model(input_ids=probe).logits
    assert p.implementation.served_by(p.model) == NAME
    p.implementation.save_adapter(p.model, tmp_path / "a")
    fresh = prepare(cfg, "cpu", implementation=NAME)
    fresh.implementation.load_adapter(fresh.model, tmp_path / "a")
    with torch.no_grad():
        assert torch.equal(fresh.model(input_ids=probe).logits, logits)


@adapts
def test_the_quick_tier_s_layer_properties_and_lifecycle_hold_on_the_probe_block(one_thread):
    """A module that is not a transformers model (the probe block) gets the mixin's own functions."""
    from lora_suite.engine import probes as P
    from lora_suite.judges import layer_properties as LP
    from lora_suite.judges import lifecycle as LC

    impl = resolve_implementation(NAME)
    for prop in ("function", "merge", "non_finite"):
        run = LP.run_property(prop, impl, LP.Limits.of(impl, 24, 12), "cpu")
        assert run.failure is None, (prop, run.failure, run.reproduce)
    shape = P.BlockShape("tiny-bias", 48, 40, 16, 76, bias=True)
    spec = AdapterSpec(P.PROBE_TARGETS, 4, 12.0, False, torch.float32)
    for k in range(2):
        v = LC.run_lifecycle(impl, shape, spec, torch.float32, "cpu", part=(k, 2))
        assert v.passed, v.detail
