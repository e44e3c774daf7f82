"""Which check must catch each planted defect of ``example_plants``: a table of names, kept apart from the plants'
code (selftest-gpu, the CPU tests and ``docs/lora-spec.md``'s test read it)."""

# defect -> (factory name, the tier that must catch it, the check that must be among the failed ones: a fragment of
# its name, as docs/lora-spec.md names it; the leak's must be a memory slope, not a speed verdict that sharing the
# GPU could move). A plant counts as caught only when that check failed.
PLANTS = {
    "forward scale applied twice": ("scale_twice", "quick", "outputs beyond tolerance"),
    "lora_B frozen (detached in forward)": ("frozen_lora_b", "quick", "dB beyond tolerance"),
    "input gradient dropped (x detached on the LoRA path)": (
        "input_grad_dropped",
        "quick",
        "input gradients beyond tolerance",
    ),
    "save_adapter drops every lora_B": (
        "save_drops_lora_b",
        "quick",
        "saved folder: adapters missing or not bitwise the trained ones",
    ),
    "load_adapter ignores the folder's lora_alpha and r": (
        "load_ignores_alpha",
        "quick",
        "folder with a wrong lora_alpha: refused or honoured",
    ),
    "adapters skipped in eval mode": ("eval_skips_adapters", "quick", "eval mode: outputs beyond tolerance"),
    "output upcast to fp32": ("output_upcast_fp32", "quick", "outputs and gradients of the wrong dtype"),
    "a target projection (v_proj) left out": ("target_left_out", "quick", "target projections left without adapters"),
    "nondeterministic forward (last bits jitter)": (
        "nondeterministic_forward",
        "quick",
        "same input twice: tensors not bitwise equal",
    ),
    "lora_B initialised at small random values, not zero": (
        "lora_b_random_init",
        "quick",
        "at initialisation: outputs differ from the base model's",
    ),
    "lora_A initialised at zero too": (
        "lora_a_zero_init",
        "quick",
        "at initialisation: adapted layers that cannot learn",
    ),
    "use_rslora=True accepted and ignored": ("rslora_ignored", "quick", "rsLoRA alpha/sqrt(r)=12/4: outputs beyond"),
    "scale as alpha // r (integer division)": ("scale_integer_division", "quick", "scale alpha/r=12/8: outputs beyond"),
    "adapters made in the base dtype whatever adapter_dtype asks": (
        "adapter_dtype_ignored",
        "quick",
        "adapters not in the requested dtype",
    ),
    "base weights left trainable by inject": (
        "base_left_trainable",
        "quick",
        "after inject: adapters not trainable, or base parameters trainable",
    ),
    "input clipped in place on the LoRA path": (
        "input_clipped_in_place",
        "quick",
        "inputs or upstream gradients changed in place",
    ),
    "input kept on the layer for the backward (not in ctx)": (
        "input_kept_on_the_layer",
        "quick",
        "two forwards, one backward: gradients not the sum",
    ),
    "merge folds alpha / r under rsLoRA": (
        "merge_ignores_rslora",
        "quick",
        "rsLoRA alpha/sqrt(r)=12/4: merged weights: outputs beyond tolerance",
    ),
    "load_adapter takes what fits and skips the rest": (
        "load_takes_what_fits",
        "quick",
        "folder with an adapter missing: refused",
    ),
    "merge_adapters folds nothing": (
        "merge_folds_nothing",
        "quick",
        "merged weights with the adapters left zeroed: outputs beyond tolerance",
    ),
    "targets that match no layer accepted (nothing adapted)": (
        "inject_accepts_unmatched_targets",
        "quick",
        "inject with targets that name no layer: refused",
    ),
    "1 MiB of GPU memory kept per forward": ("gpu_memory_leak", "extended", "allocated_mib slope after step"),
    "base bias dropped (F.linear(x, base.weight))": (
        "base_bias_dropped",
        "quick",
        "qwen2: logits beyond tolerance of the float64 adapted model",
    ),
    "base bias left trainable by inject": (
        "base_bias_left_trainable",
        "quick",
        "qwen2: base weights or biases trainable or given a gradient",
    ),
    "scale rounded through bf16 (exact at 12/8, off at a drawn 7.3/3)": (
        "scale_rounded_bf16",
        "quick",
        "layer properties: drawn cases off the float64 function",
    ),
    "merged delta formed in bf16 from fp32 adapters": (
        "merge_delta_bf16",
        "quick",
        "layer properties: drawn cases whose merged weights are not W + s·B·A rounded once",
    ),
    "NaN/Inf replaced in the adapters' gradients (a nan_to_num hook)": (
        "adapter_grads_nan_to_num",
        "quick",
        "layer properties: drawn cases where a NaN/Inf did not reach what it must",
    ),
    "NaN/Inf replaced in the LoRA path's input": (
        "lora_input_nan_to_num",
        "quick",
        "layer properties: drawn cases where a NaN/Inf did not reach what it must",
    ),
    "inference weight (W + s·B·A) cached at the first eval no-grad call, kept through training": (
        "inference_weight_cached",
        "quick",
        "adapter lifecycle: rule sequences whose model left the float64 function of its current adapters",
    ),
    "merge keeps the layer; eval() ignores its merged mark and adds the adapters again": (
        "merge_kept_in_eval",
        "quick",
        "adapter lifecycle: rule sequences whose model left the float64 function of its current adapters",
    ),
    "inference casts of the adapters cached per dtype by version, kept over module.to()": (
        "inference_cast_cache_kept_over_to",
        "quick",
        "adapter lifecycle: rule sequences whose model left the float64 function of its current adapters",
    ),
    "the first model's settings kept on the implementation (saved for every later model)": (
        "settings_kept_on_the_implementation",
        "quick",
        "two models adapted by one implementation: state of one seen in the other",
    ),
    "served_by's first answer kept on the implementation": (
        "served_by_kept_on_the_implementation",
        "quick",
        "two models adapted by one implementation: state of one seen in the other",
    ),
}
