"""The built-ins ``cupy`` and ``torch``: this project's own layer (``lora_core``) on one of its backends."""

from __future__ import annotations

from lora_suite.implementations.contract import ImplementationError, LoRAImplementation

_ONE_INIT = "lora_core.LoRALinear draws A kaiming-uniform (a = √5) and B zero: it offers no other init"
# What lora_core's injection cannot adapt (found by trying; lora_suite.tiers.quick.test_architectures records it)
ARCHITECTURE_LIMITS = {
    "fused_projections": "lora_core.inject refuses targets outside a Llama block's names (lora_core/targets.py: "
    "q_proj ... down_proj), so Phi-3's qkv_proj and gate_up_proj cannot be named",
    "rank_pattern": "lora_core.inject_lora takes one r and one alpha for every target (no per-module override)",
    "lora_bias": "lora_core.LoRALinear holds A, B and a scale: it has no bias on B",
    "layers_to_transform": "lora_core.inject_lora adapts every linear whose name is a target: it takes no list of layers",
    "modules_to_save": "lora_core trains its adapters only: it keeps no trained copy of a whole module",
    "embedding_target": "lora_core.LoRALinear wraps nn.Linear only; an embedding is not one",
    "lm_head_target": "lora_core.inject refuses targets outside a Llama block's names (lora_core/targets.py)",
    "init_gaussian": _ONE_INIT,
    "init_random_b": _ONE_INIT,
    "init_pissa": _ONE_INIT,
    "init_olora": _ONE_INIT,
    "dora": "lora_core.LoRALinear computes W·x + s·B·A·x: it has no magnitude vector (DoRA)",
}


class LoraCoreImplementation(LoRAImplementation):
    """This project's ``lora_core.LoRALinear`` on one backend (``cupy``: the system under test; ``torch``)."""

    inject_per_layer = True
    operation_reasons = {
        "adapters": "lora_core.LoRALinear holds one adapter (lora_A, lora_B): there is no second one to add or switch to",
        "unmerge": "lora_core's merge_lora turns each LoRA layer into a plain linear: nothing is left to unmerge",
        "disable": "lora_core.LoRALinear has no switch that turns its adapters off for a call",
        "rescale": "lora_core.LoRALinear fixes its scale (lora_scale(r, alpha, use_rslora)) at construction and offers "
        "no call to set it",
    }

    def __init__(self, backend: str):
        self.name = self.expected_path = self.backend = backend
        self.not_applicable = dict(ARCHITECTURE_LIMITS)

    def describe(self) -> str:
        which = "CuPy RawKernels + cuBLAS" if self.name == "cupy" else "torch reference ops"
        return f"{self.name}: lora_core.LoRALinear on the {self.name} backend ({which})"

    def inject(self, model, spec):
        from lora_core.inject import inject_lora

        return inject_lora(
            model,
            spec.targets,
            spec.r,
            spec.alpha,
            backend=self.backend,
            use_rslora=spec.use_rslora,
            adapter_dtype=spec.adapter_dtype,
            quantize=spec.quantize,
            target_parameters=spec.target_parameters,
        )

    def adapter_parameters(self, model):
        from lora_core.inject import adapter_parameters

        return adapter_parameters(model, experts=False)

    def expert_adapters(self, model):
        """Each ``lora_core.LoRAExperts``'s factors, held as the contract reads them (A (E, r, d₂), B (E, d₁, r))."""
        from lora_core.experts import expert_factors
        from lora_suite.implementations.contract import ExpertAdapter

        return {n: ExpertAdapter(f.lora_A, f.lora_B, _as_held, _as_held) for n, f in expert_factors(model).items()}

    def save_adapter(self, model, path):
        from lora_core.adapters import save_peft_adapter

        return save_peft_adapter(model, path)

    def load_adapter(self, model, path):
        from lora_core.adapters import load_peft_adapter

        load_peft_adapter(model, path)

    def merge_adapters(self, model):
        from lora_core.adapters import merge_lora

        merge_lora(model)

    def served_by(self, model):
        from lora_core.experts import expert_modules
        from lora_core.inject import lora_modules

        layers = [*lora_modules(model).values(), *expert_modules(model).values()]
        return ",".join(sorted({str(m.last_backend) for m in layers}))

    def op_calls(self):
        import lora_core

        return lora_core.backend_call_counts()[self.backend]


class FusedLoraCoreImplementation(LoraCoreImplementation):
    """``cupy-fused``: lora_core on the cupy backend with the fused LoRA paths (``lora_core.fuse``): the MLP
    (gate and up from one read of x, SwiGLU in a RawKernel, down) and q/k/v from one read of x, wherever the
    targets cover a whole group; o_proj's LoRA linear already is one Function (reported as ``cupy``).

    The LM head and the loss of a training step run lora_core's fused linear cross-entropy (``lora_core.loss_head``):
    no logits, in eager and captured steps alike.

    ``served_by`` is ``cupy-fused`` only when every adapted layer ran the path its group should and the last
    training loss of a whole model was the fused one: a fusable group that ran unfused, a layer outside one that did not run
    ``cupy``, or a loss of another path is named instead.
    """

    fuses_loss = True

    def __init__(self):
        super().__init__("cupy")
        self.name = self.expected_path = "cupy-fused"
        self.not_applicable = {
            **ARCHITECTURE_LIMITS,
            "partial_groups": "the fused paths adapt whole groups: q, k and v together, gate, up and down together "
            "(a tier that targets q and v runs q, k and v)",
            # Qwen2's q/k/v biases and Gemma's GeGLU are taken (quick: the QKV grid with biases, the GeGLU grid); a
            # bias on an MLP projection is refused by lora_core.fuse with a FuseError, loudly, never run unfused
        }

    def merge_reason(self):
        return (
            "lora_core's merge_lora turns each LoRA layer into a plain linear, which the fused MLP and QKV modules "
            "do not run; merged weights are checked under --lora-impl cupy"
        )

    def describe(self) -> str:
        return (
            "cupy-fused: lora_core.LoRALinear on the cupy backend with the fused MLP (SwiGLU or GeGLU) and QKV (with q/k/v biases) paths and the "
            "fused linear cross-entropy (lora_core.loss_head)"
        )

    def parts(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """The groups these targets cover whole (and "o" when o_proj is a target)."""
        from lora_core.fuse import GROUPS
        from lora_core.inject import ALL_LINEAR

        covered = set(targets) | (set(sum(GROUPS.values(), ())) | {"o_proj"} if ALL_LINEAR in targets else set())
        parts = tuple(g for g, members in GROUPS.items() if set(members) <= covered)
        return parts + (("o",) if "o_proj" in covered else ())

    def inject(self, model, spec):
        from lora_core.fuse import MLP_PARTS, QKV_PARTS
        from lora_core.inject import inject_lora

        parts = self.parts(tuple(spec.targets))
        if not {"mlp", "qkv"} & set(parts):
            raise ImplementationError(
                f"cupy-fused: targets {list(spec.targets)} cover no whole group to fuse (the MLP needs "
                f"{list(MLP_PARTS)}, the attention {list(QKV_PARTS)}); run cupy for these targets"
            )
        return inject_lora(
            model,
            spec.targets,
            spec.r,
            spec.alpha,
            backend="cupy",
            use_rslora=spec.use_rslora,
            adapter_dtype=spec.adapter_dtype,
            quantize=spec.quantize,
            fuse=parts,
            target_parameters=spec.target_parameters,
        )

    def finish_model(self, model, spec):
        """The LM head and the loss through lora_core's fused linear cross-entropy (``lora_core.loss_head``)."""
        from lora_core.loss_head import fuse_loss

        fuse_loss(model, backend="cupy")

    def served_by(self, model):
        from lora_core.experts import expert_modules
        from lora_core.fuse import GROUPS, LoRAMLP
        from lora_core.inject import lora_modules
        from lora_core.loss_head import loss_head, loss_path

        fused_leaf = {leaf: f"cupy-fused-{g}" for g, members in GROUPS.items() for leaf in members}
        wrong = []
        for name, m in lora_modules(model).items():
            grouped = m.fused_group is not None or isinstance(_parent(model, name), LoRAMLP)
            want = fused_leaf.get(name.rsplit(".", 1)[-1], "cupy") if grouped else "cupy"
            if m.last_backend != want:
                wrong.append(f"{name}: {m.last_backend} (expected {want})")
        wrong += [
            f"{n}: {m.last_backend} (expected cupy)"
            for n, m in expert_modules(model).items()
            if m.last_backend != "cupy"
        ]
        head = loss_head(model)  # None on a module that is not a whole causal LM (a probe's layers)
        if head is not None and head.last_backend not in (None, "cupy"):
            wrong.insert(0, f"the training loss: {loss_path(model)} (expected cupy-fused-loss)")
        return self.expected_path if not wrong else "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else "")


def _as_held(t):
    """lora_core holds expert factors in the contract's layout already: (E, r, d₂) and (E, d₁, r)."""
    return t


def _parent(model, name: str):
    parent, _, _ = name.rpartition(".")
    return model.get_submodule(parent) if parent else model
