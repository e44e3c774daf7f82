"""The implementation registry and contract on the CPU: built-ins, a toy third-party implementation plugged in
from this test module (by ``module:factory`` and by entry point), and every selection error.

The toy implementation below is written here, independent of lora_core: a plain module with A, B and a
scale. The same harness code the tiers use (prepare.prepare, the trainer, the checkpoint) trains it, saves it
in PEFT format and reloads it, and its adapters must agree with lora_core's torch layers name by name.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lora_core.adapters import load_peft_adapter
from lora_suite import implementations as I
from lora_suite.engine.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.measure.criteria import loss_drop


class ToyLoRALinear(nn.Module):
    """y = x Wᵀ + s·(x Aᵀ) Bᵀ, with A (r, in) and B (out, r): a third party's layer."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dtype):
        super().__init__()
        self.base, self.scale, self.calls = base, alpha / r, 0
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        self.calls += 1
        return self.base(x) + self.scale * ((x.to(self.lora_A.dtype) @ self.lora_A.T) @ self.lora_B.T).to(x.dtype)


class ToyImplementation(I.LoRAImplementation):
    name = expected_path = "toy"
    not_applicable = {
        "nf4_base": "the toy layer has no 4-bit base",
        "op_call_count": "the toy keeps counts per layer only",
        "lora_core_ops": "the toy does not use lora_core",
    }

    def inject(self, model, spec):
        if spec.quantize:
            raise I.ImplementationError("toy: no quantised base")
        for p in model.parameters():
            p.requires_grad_(False)
        chosen = [
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and n.rsplit(".", 1)[-1] != "lm_head"
            and ("all-linear" in spec.targets or n.rsplit(".", 1)[-1] in spec.targets)
        ]
        for name, m in chosen:
            parent, _, child = name.rpartition(".")
            setattr(
                model.get_submodule(parent) if parent else model,
                child,
                ToyLoRALinear(m, spec.r, spec.alpha, spec.adapter_dtype),
            )
        return [n for n, _ in chosen]

    def adapter_parameters(self, model):
        return {
            f"{n}.{w}": getattr(m, w)
            for n, m in model.named_modules()
            if isinstance(m, ToyLoRALinear)
            for w in ("lora_A", "lora_B")
        }

    def save_adapter(self, model, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        layers = [m for m in model.modules() if isinstance(m, ToyLoRALinear)]
        r = layers[0].lora_A.shape[0]
        (path / "adapter_config.json").write_text(
            f'{{"peft_type": "LORA", "r": {r}, "lora_alpha": {layers[0].scale * r}, "target_modules": ["q_proj"]}}'
        )
        save_file(
            {
                f"base_model.model.{n}.weight": p.detach().contiguous()
                for n, p in self.adapter_parameters(model).items()
            },
            str(path / "adapter_model.safetensors"),
        )
        return path

    def load_adapter(self, model, path):
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        with torch.no_grad():
            for n, p in self.adapter_parameters(model).items():
                p.copy_(tensors[f"base_model.model.{n}.weight"])

    def served_by(self, model):
        layers = [m for m in model.modules() if isinstance(m, ToyLoRALinear)]
        return "toy" if layers and all(m.calls for m in layers) else "toy layers that never ran"


def toy_factory():
    return ToyImplementation()


SPEC = f"{__name__}:toy_factory"


# ------------------------------------------------------------------ selection
def test_builtins_resolve_and_default_is_cupy():
    assert I.resolve_implementation(None).name == "cupy"
    assert I.resolve_implementation("torch").name == "torch"
    assert I.resolve_implementation("peft").name == "peft"
    assert "nf4_base" in I.resolve_implementation("peft").not_applicable


def test_a_toy_implementation_plugs_in_by_module_and_factory():
    impl = I.resolve_implementation(SPEC)
    assert isinstance(impl, ToyImplementation)
    assert I.implementation_record(impl, SPEC) == {
        "name": "toy",
        "spec": SPEC,
        "description": "toy",
        "not_applicable": ToyImplementation.not_applicable,
    }


def test_a_toy_implementation_plugs_in_by_entry_point(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="toy", value=SPEC, group=I.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [ep] if group == I.ENTRY_POINT_GROUP else []
    )
    assert I.entry_point_names() == sorted(["toy", *I.BUNDLED])
    assert I.resolve_implementation("toy").name == "toy"


class _Half(I.LoRAImplementation):
    name = expected_path = "half"

    def inject(self, model, spec):
        return []


@pytest.mark.parametrize(
    "spec,message",
    [
        ("triton", r"'triton' is not known: built-ins \['cupy', 'cupy-fused', 'torch', 'peft'\]"),
        ("no_such_module:make", r"cannot load 'make' from module 'no_such_module' \(ModuleNotFoundError"),
        (f"{__name__}:no_such_factory", r"cannot load 'no_such_factory'"),
        (f"{__name__}:SPEC", r"gave a str, not a lora_suite.implementations.LoRAImplementation"),
        (
            f"{__name__}:_Half",
            r"does not meet the contract: methods not implemented \['adapter_parameters', "
            r"'save_adapter', 'load_adapter', 'served_by'\]",
        ),
        ("", r"expected a name"),
    ],
)
def test_bad_selections_are_refused_naming_the_value(spec, message):
    with pytest.raises(I.ImplementationError, match=message):
        I.resolve_implementation(spec)


def test_unknown_not_applicable_features_are_refused():
    class Odd(ToyImplementation):
        not_applicable = {"fp8_base": "no"}

    with pytest.raises(I.ImplementationError, match=r"declares unknown features \['fp8_base'\]"):
        I.check_contract(Odd(), "odd")


def test_peft_refuses_an_nf4_base_with_its_reason(tiny_cfg):
    with pytest.raises(I.ImplementationError, match="bitsandbytes"):
        I.resolve_implementation("peft").inject(nn.Linear(4, 4), I.AdapterSpec(("all-linear",), 2, 4, quantize="nf4"))


# ------------------------------------------------------------------ the contract, through the harness
def _peer(name, *more):
    """A bundled peer as a parameter (with ``more`` values), skipped with the extra to install where its library
    does not import."""
    module = {"loralib": "loralib", "torchtune": "torchtune", "peft-bnb": "bitsandbytes"}[name]
    return pytest.param(
        name,
        *more,
        marks=pytest.mark.skipif(
            importlib.util.find_spec(module) is None,
            reason=f"{module} is not installed: pip install lora-gpu-suite[{name}]",
        ),
    )


@pytest.mark.parametrize("spec", ["torch", "peft", SPEC, _peer("loralib"), _peer("torchtune")])
def test_implementation_trains_saves_and_reloads_through_the_harness(spec, tiny_cfg, tmp_path):
    ref = prepare(tiny_cfg, "cpu", implementation="torch")
    p = prepare(tiny_cfg, "cpu", implementation=spec)
    assert {n: tuple(t.shape) for n, t in p.adapters.items()} == {n: tuple(t.shape) for n, t in ref.adapters.items()}
    assert p.replaced == ref.replaced
    trainable = {id(t) for t in p.model.parameters() if t.requires_grad}
    assert trainable == {id(t) for t in p.adapters.values()}, "only the adapters may train"

    result = train(p.model, p.batches, tiny_cfg.train, adapters=p.adapters)
    assert p.implementation.served_by(p.model) == p.implementation.expected_path
    assert loss_drop(result.losses, tiny_cfg.criteria.loss_window) >= tiny_cfg.criteria.loss_drop_min

    probe = p.batches(999)["input_ids"]
    with torch.no_grad():
        logits = p.model(input_ids=probe).logits
    ckpt = save_adapter_checkpoint(
        p.model, tmp_path / "ckpt", step=40, optimizer=result.optimizer, implementation=p.implementation
    )
    fresh = prepare(tiny_cfg, "cpu", implementation=spec)
    assert load_adapter_checkpoint(fresh.model, ckpt, implementation=fresh.implementation) == 40
    with torch.no_grad():
        assert torch.equal(fresh.model(input_ids=probe).logits, logits)
    # The folder is PEFT's format: lora_core's loader reads it into its own layers, with the same function.
    load_peft_adapter(ref.model, ckpt)
    with torch.no_grad():
        torch.testing.assert_close(ref.model(input_ids=probe).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["peft", SPEC, _peer("loralib"), _peer("torchtune")])
def test_same_adapters_give_the_same_function_as_lora_core(spec, tiny_cfg):
    """Canonical names and the scale mean the same thing in every implementation: equal adapters, equal logits."""
    ref = prepare(tiny_cfg, "cpu", implementation="torch")
    p = prepare(tiny_cfg, "cpu", implementation=spec)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in ref.adapters.items():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
            p.adapters[name].copy_(t)
    probe = ref.batches(0)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            p.model(input_ids=probe).logits, ref.model(input_ids=probe).logits, rtol=1e-5, atol=1e-5
        )


def test_capturing_an_implementation_that_declares_it_cannot_be_captured_is_refused(tiny_cfg):
    import dataclasses

    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, cuda_graph=True))
    impl = I.LoraCoreImplementation("torch")
    impl.not_applicable["cuda_graph_capture"] = "its op sets the cuBLAS stream on every call"
    with pytest.raises(
        I.ImplementationError,
        match="train.cuda_graph: true, but implementation 'torch' cannot be captured: its op sets the cuBLAS stream",
    ):
        prepare(cfg, "cpu", implementation=impl)


def test_the_cupy_implementation_declares_capture_applicable():
    # issue 10: its GEMMs go through nvmath's binding on torch's handle, which stream capture accepts
    assert I.LoraCoreImplementation("cupy").reason_not_applicable("cuda_graph_capture") is None


@pytest.mark.parametrize("name", [_peer("loralib"), _peer("torchtune")])
def test_a_peer_declares_what_it_cannot_do_and_refuses_it_naming_why(name, tiny_cfg):
    import dataclasses

    impl = I.resolve_implementation(name)
    assert impl.name == name and set(impl.not_applicable) >= {"fp32_adapters_on_16bit_base", "rslora", "nf4_base"}
    half = dataclasses.replace(tiny_cfg, dtype="bfloat16")
    with pytest.raises(
        I.ImplementationError,
        match=f"lora.adapter_dtype: float32 on a bfloat16 base, but implementation '{name}' cannot: {name}'s",
    ):
        prepare(half, "cpu", implementation=name)
    same = dataclasses.replace(half, lora=dataclasses.replace(half.lora, adapter_dtype="bfloat16"))
    p = prepare(same, "cpu", implementation=name)  # adapters in the base dtype: the peer's own way
    assert {t.dtype for t in p.adapters.values()} == {torch.bfloat16}
    for spec in (
        I.AdapterSpec(("all-linear",), 2, 4, use_rslora=True),
        I.AdapterSpec(("all-linear",), 2, 4, quantize="nf4"),
    ):
        with pytest.raises(I.ImplementationError, match="alpha / r|quantised base|QLoRA"):
            impl.inject(nn.Sequential(nn.Linear(4, 4)), spec)
    p.model.eval()  # loralib's default would merge s*B*A into the frozen base here; merge_weights=False does not
    assert p.implementation.served_by(p.model) == f"{name} layers that never ran"


@pytest.mark.parametrize("name", [_peer("peft-bnb")])
def test_peft_on_a_bitsandbytes_nf4_base_trains_and_reloads_as_qlora(name, tiny_cfg, tmp_path):
    """QLoRA as people run it, on the CPU (bitsandbytes 0.50 quantises and runs 4-bit there): every linear but
    the LM head is a quantised Linear4bit, PEFT wraps the targets with its bitsandbytes layer, the loss falls,
    the PEFT folder reloads with identical logits; a 16-bit base is refused naming lora.quantize."""
    import dataclasses

    import bitsandbytes as bnb

    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16")
    with pytest.raises(I.ImplementationError, match="lora.quantize: null .* implementation 'peft-bnb' cannot: QLoRA"):
        prepare(cfg, "cpu", implementation=name)
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize="nf4"))
    p = prepare(cfg, "cpu", implementation=name)
    quantised = [n for n, m in p.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    linears = [n for n, m in p.model.named_modules() if type(m) is nn.Linear and ".lora_" not in n]  # not adapters
    assert quantised and all(n.endswith("lm_head") for n in linears)
    assert {t.dtype for t in p.adapters.values()} == {torch.float32}  # PEFT's QLoRA default: fp32 adapters
    result = train(p.model, p.batches, cfg.train, adapters=p.adapters)
    assert p.implementation.served_by(p.model) == "peft-bnb"
    assert loss_drop(result.losses, cfg.criteria.loss_window) >= cfg.criteria.loss_drop_min
    probe = p.batches(999)["input_ids"]
    p.model.eval()  # bitsandbytes takes another 4-bit matmul path in training mode: compare in one mode
    with torch.no_grad():
        logits = p.model(input_ids=probe).logits
    p.implementation.save_adapter(p.model, tmp_path / "a")
    fresh = prepare(cfg, "cpu", implementation=name)
    fresh.implementation.load_adapter(fresh.model, tmp_path / "a")
    fresh.model.eval()
    with torch.no_grad():
        assert torch.equal(fresh.model(input_ids=probe).logits, logits)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("torch", []),
        ("peft", []),
        _peer(
            "loralib",
            [
                "float32 adapters on the bfloat16 base (configs/x.yaml lora.adapter_dtype); the tier runs "
                "bfloat16 adapters"
            ],
        ),
        _peer("peft-bnb", ["bfloat16 base (configs/x.yaml lora.quantize: null); the tier runs on an NF4 base"]),
    ],
)
def test_a_tier_config_fits_what_the_implementation_declares_and_says_so(name, expected, tiny_cfg):
    """The tiers' shared mechanism (tiers/conftest.py Tier.config): each change is a not-applicable record with
    the implementation's own reason, and the changed config then prepares without an error."""
    import dataclasses

    from lora_suite.engine.prepare import fit_to_implementation

    impl = I.resolve_implementation(name)
    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16")
    fitted, notes = fit_to_implementation(cfg, impl, "configs/x.yaml")
    assert [what for what, _ in notes] == expected
    assert all(reason and reason in impl.not_applicable.values() for _, reason in notes)
    prepare(fitted, "cpu", implementation=impl)
    nf4 = dataclasses.replace(
        cfg, lora=dataclasses.replace(cfg.lora, quantize="nf4"), train=dataclasses.replace(cfg.train, cuda_graph=True)
    )
    _, notes = fit_to_implementation(nf4, I.resolve_implementation("peft"), "configs/x.yaml")
    assert [what for what, _ in notes][
        0
    ] == "nf4 base (configs/x.yaml lora.quantize); the tier runs on the bfloat16 base"


@pytest.mark.parametrize("name", [_peer("peft-bnb")])
def test_a_comparison_run_shares_the_quantised_base_of_the_implementation_under_test(name, tiny_cfg):
    """prepare(base_from=): the torch reference over peft-bnb's bitsandbytes codes and absmaxes dequantises to
    bitsandbytes' own weights bit for bit, where quantising the same bf16 weights itself does not (bitsandbytes
    stores the absmaxes with its dynamic 8-bit map): without sharing, a tier would compare two quantisers."""
    import dataclasses

    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    from lora_core.layer import LoRALinear, NF4Linear
    from lora_core.nf4 import dequantize_nf4

    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16", lora=dataclasses.replace(tiny_cfg.lora, quantize="nf4"))
    p = prepare(cfg, "cpu", implementation=name)
    shared = prepare(cfg, "cpu", implementation="torch", base_from=p.implementation)
    own = prepare(cfg, "cpu", implementation="torch")
    theirs = {
        n: dequantize_4bit(m.weight.data, m.weight.quant_state)
        for n, m in p.model.named_modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }
    assert theirs

    def dequantised(model):
        return {
            n.removesuffix(".base_layer"): dequantize_nf4(m.nf4)
            for n, m in model.named_modules()
            if isinstance(m, (LoRALinear, NF4Linear))
        }

    mine, self_quantised = dequantised(shared.model), dequantised(own.model)
    for n, w in theirs.items():
        key = n.removesuffix(".base_layer")
        assert torch.equal(mine[key], w), key
    assert any(not torch.equal(self_quantised[n.removesuffix(".base_layer")], w) for n, w in theirs.items())


@pytest.mark.parametrize("name", [_peer("peft-bnb")])
def test_an_implementations_own_4bit_base_goes_in_layer_by_layer_as_the_model_is_built(name, tiny_cfg):
    """As transformers quantises while it loads: peft-bnb's Linear4bit replaces each decoder layer's linears before
    the next layer exists, so a QLoRA model is never whole in 16 bits and its build does not set its peak (the
    first H200 run built the whole bf16 model first: 15.7 GiB peak at 7B, reports/…-scorecard notes)."""
    import dataclasses

    impl = I.resolve_implementation(name)
    seen, own = [], impl.quantize_base

    def spy(module):
        seen.append(type(module).__name__)
        return own(module)

    impl.quantize_base = spy
    cfg = dataclasses.replace(tiny_cfg, dtype="bfloat16", lora=dataclasses.replace(tiny_cfg.lora, quantize="nf4"))
    p = prepare(cfg, "cpu", implementation=impl)
    assert seen == ["LlamaDecoderLayer"] * cfg.model.architecture.num_hidden_layers + ["LlamaForCausalLM"]
    import bitsandbytes as bnb

    plain = [n for n, m in p.model.named_modules() if type(m) is nn.Linear and ".lora_" not in n]
    assert plain == ["lm_head"] and any(isinstance(m, bnb.nn.Linear4bit) for m in p.model.modules())


def test_a_peer_whose_library_does_not_import_names_the_extra_to_install():
    with pytest.raises(
        I.ImplementationError,
        match=r"--lora-impl torchtune: no_such_module_xyz does not import "
        r"\(.*\); install lora-gpu-suite\[torchtune\]",
    ):
        I.require_module("torchtune", "no_such_module_xyz")


def test_cupy_fused_fuses_the_groups_the_targets_cover_and_refuses_when_none():
    from lora_suite.implementations.contract import AdapterSpec

    impl = I.resolve_implementation("cupy-fused")
    assert isinstance(impl.op_calls(), int)  # counted under the cupy backend (a KeyError on the H100 at 88062a8)
    assert impl.parts(("all-linear",)) == ("mlp", "qkv", "o")
    assert impl.parts(("q_proj", "k_proj", "v_proj", "gate_proj")) == ("qkv",)
    with pytest.raises(I.ImplementationError, match=r"targets \['q_proj', 'v_proj'\] cover no whole group to fuse"):
        impl.inject(torch.nn.Linear(2, 2), AdapterSpec(targets=("q_proj", "v_proj"), r=2, alpha=4))


def test_cupy_fused_served_by_names_each_layer_that_did_not_run_its_fused_path():
    from lora_core import inject_lora
    from lora_core.inject import lora_modules
    from lora_suite.engine.models import build_random
    from tests.conftest import TINY_ARCH

    model = build_random(TINY_ARCH, torch.float32, "cpu")
    inject_lora(model, "all-linear", r=2, backend="torch", fuse=("mlp", "qkv", "o"))
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    impl = I.resolve_implementation("cupy-fused")
    served = impl.served_by(model)
    assert "model.layers.0.self_attn.q_proj: torch-fused-qkv (expected cupy-fused-qkv)" in served
    for m in lora_modules(model).values():  # what a cupy run of the fused model records
        m.last_backend = m.last_backend.replace("torch", "cupy")
    assert impl.served_by(model) == "cupy-fused"
    model.model.layers[1].mlp.up_proj.last_backend = "cupy"  # one layer of a fused group ran unfused
    assert impl.served_by(model) == "model.layers.1.mlp.up_proj: cupy (expected cupy-fused-mlp)"
    model.model.layers[1].mlp.up_proj.last_backend = "cupy-fused-mlp"
    from lora_core.loss_head import fuse_loss

    fuse_loss(model, backend="torch")  # a training loss on another path than the cupy engine's is named
    assert impl.served_by(model) == "cupy-fused"  # installed, not run yet
    ids = torch.zeros(1, 4, dtype=torch.long)
    model.train()(input_ids=ids, labels=ids)
    for m in lora_modules(model).values():
        m.last_backend = m.last_backend.replace("torch", "cupy")
    assert impl.served_by(model) == "the training loss: torch-fused-loss (expected cupy-fused-loss)"


def test_a_tier_targeting_part_of_a_group_runs_the_whole_group_under_cupy_fused_and_says_so(tiny_cfg):
    from lora_suite.engine.prepare import fit_to_implementation

    impl = I.resolve_implementation("cupy-fused")
    cfg = dataclasses.replace(tiny_cfg, lora=dataclasses.replace(tiny_cfg.lora, targets=("q_proj", "v_proj")))
    fitted, notes = fit_to_implementation(cfg, impl, "configs/x.yaml")
    assert fitted.lora.targets == ("q_proj", "v_proj", "k_proj")
    assert notes == [
        (
            "LoRA on ['q_proj', 'v_proj'] only (configs/x.yaml lora.targets); the tier adapts "
            "['q_proj', 'v_proj', 'k_proj']",
            impl.not_applicable["partial_groups"],
        )
    ]
    whole = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=("all-linear",)))
    assert fit_to_implementation(whole, impl, "configs/x.yaml")[1] == []
    assert fit_to_implementation(cfg, I.resolve_implementation("cupy"), "configs/x.yaml")[1] == []
