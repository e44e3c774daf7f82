"""Which check must catch each planted defect of ``example_plants``: a table of names, kept apart from the plants'
code (selftest-gpu, the CPU tests and ``docs/lora-spec.md``'s test read it)."""

# factory name -> the defect it plants (the plants in the order selftest-gpu runs and prints them)
_DEFECTS = {
    "scale_twice": "forward scale applied twice",
    "frozen_lora_b": "lora_B frozen (detached in forward)",
    "input_grad_dropped": "input gradient dropped (x detached on the LoRA path)",
    "save_drops_lora_b": "save_adapter drops every lora_B",
    "load_ignores_alpha": "load_adapter ignores the folder's lora_alpha and r",
    "eval_skips_adapters": "adapters skipped in eval mode",
    "output_upcast_fp32": "output upcast to fp32",
    "target_left_out": "a target projection (v_proj) left out",
    "nondeterministic_forward": "nondeterministic forward (last bits jitter)",
    "lora_b_random_init": "lora_B initialised at small random values, not zero",
    "lora_a_zero_init": "lora_A initialised at zero too",
    "rslora_ignored": "use_rslora=True accepted and ignored",
    "scale_integer_division": "scale as alpha // r (integer division)",
    "adapter_dtype_ignored": "adapters made in the base dtype whatever adapter_dtype asks",
    "base_left_trainable": "base weights left trainable by inject",
    "input_clipped_in_place": "input clipped in place on the LoRA path",
    "input_kept_on_the_layer": "input kept on the layer for the backward (not in ctx)",
    "merge_ignores_rslora": "merge folds alpha / r under rsLoRA",
    "load_takes_what_fits": "load_adapter takes what fits and skips the rest",
    "merge_folds_nothing": "merge_adapters folds nothing",
    "inject_accepts_unmatched_targets": "targets that match no layer accepted (nothing adapted)",
    "gpu_memory_leak": "1 MiB of GPU memory kept per forward",
    "base_bias_dropped": "base bias dropped (F.linear(x, base.weight))",
    "base_bias_left_trainable": "base bias left trainable by inject",
    "scale_rounded_bf16": "scale rounded through bf16 (exact at 12/8, off at a drawn 7.3/3)",
    "merge_delta_bf16": "merged delta formed in bf16 from fp32 adapters",
    "adapter_grads_nan_to_num": "NaN/Inf replaced in the adapters' gradients (a nan_to_num hook)",
    "lora_input_nan_to_num": "NaN/Inf replaced in the LoRA path's input",
    "lora_a_nan_to_num": "NaN/Inf replaced in A as the forward casts it",
    "inference_weight_cached": (
        "inference weight (W + s·B·A) cached at the first eval no-grad call, kept through training"
    ),
    "merge_kept_in_eval": "merge keeps the layer; eval() ignores its merged mark and adds the adapters again",
    "inference_cast_cache_kept_over_to": (
        "inference casts of the adapters cached per dtype by version, kept over module.to()"
    ),
    "settings_kept_on_the_implementation": (
        "the first model's settings kept on the implementation (saved for every later model)"
    ),
    "served_by_kept_on_the_implementation": "served_by's first answer kept on the implementation",
    "lora_input_grad_nan_to_num": "NaN/Inf replaced in the gradient the LoRA path returns to its input",
    "rank_cut_at_tile": "only the first 128 rank components used (right at r <= 128)",
    "load_takes_complete_pairs": "load_adapter takes a folder holding part of the adapters (complete pairs only checked)",
    "merge_oriented_by_shape": "merge delta oriented by the weight's shape (transposed on square layers)",
    "trainable_by_substring": "parameters marked trainable by 'lora_' in their name (a module named lora_x trains)",
    "load_keys_stripped_of_weight": "load_adapter strips every '.weight' from the keys (a module named weight)",
    "lora_a_init_spread": "lora_A drawn with kaiming_uniform_'s default a = 0 (a forgotten a=√5: √6 times the spread)",
    "unmerge_leaves_delta": "unmerge puts the adapters back and leaves s·B·A in the base weight",
    "alpha_pattern_ignored": "alpha_pattern ignored by inject (every layer at the spec's alpha)",
    "patterns_not_saved": "rank_pattern and alpha_pattern left out of the saved config (and not asked for on load)",
    "disable_not_restored_on_error": "adapters left disabled after an exception inside disabled_adapters",
    "rescale_ignores_rslora": "set_adapter_scale sets factor · alpha / r under rsLoRA",
    "rescale_compounds": "set_adapter_scale multiplies the current scale (compounds) instead of setting it",
}

# The checks that more than one plant must fail.
_NAN_KEPT = "layer properties: drawn cases where a NaN/Inf did not reach what it must"
_LIFECYCLE = "adapter lifecycle: rule sequences whose model left the float64 function of its current adapters"
_SHARED_STATE = "two models adapted by one implementation: state of one seen in the other"

# factory name -> the check that must be among the failed ones: a fragment of its name, as docs/lora-spec.md names
# it. A plant counts as caught only when that check failed.
_CHECKS = {
    "scale_twice": "outputs beyond tolerance",
    "frozen_lora_b": "dB beyond tolerance",
    "input_grad_dropped": "input gradients beyond tolerance",
    "save_drops_lora_b": "saved folder: adapters missing or not bitwise the trained ones",
    "load_ignores_alpha": "folder with a wrong lora_alpha: refused or honoured",
    "eval_skips_adapters": "eval mode: outputs beyond tolerance",
    "output_upcast_fp32": "outputs and gradients of the wrong dtype",
    "target_left_out": "target projections left without adapters",
    "nondeterministic_forward": "same input twice: tensors not bitwise equal",
    "lora_b_random_init": "at initialisation: outputs differ from the base model's",
    "lora_a_zero_init": "at initialisation: adapted layers that cannot learn",
    "rslora_ignored": "rsLoRA alpha/sqrt(r)=12/4: outputs beyond",
    "scale_integer_division": "scale alpha/r=12/8: outputs beyond",
    "adapter_dtype_ignored": "adapters not in the requested dtype",
    "base_left_trainable": "after inject: adapters not trainable, or base parameters trainable",
    "input_clipped_in_place": "inputs or upstream gradients changed in place",
    "input_kept_on_the_layer": "two forwards, one backward: gradients not the sum",
    "merge_ignores_rslora": "rsLoRA alpha/sqrt(r)=12/4: merged weights: outputs beyond tolerance",
    "load_takes_what_fits": "folder with an adapter missing: refused",
    "merge_folds_nothing": "merged weights with the adapters left zeroed: outputs beyond tolerance",
    "inject_accepts_unmatched_targets": "inject with targets that name no layer: refused",
    "gpu_memory_leak": "allocated_mib slope after step",
    "base_bias_dropped": "qwen2: logits beyond tolerance of the float64 adapted model",
    "base_bias_left_trainable": "qwen2: base weights or biases trainable or given a gradient",
    "scale_rounded_bf16": "layer properties: drawn cases off the float64 function",
    "merge_delta_bf16": "layer properties: drawn cases whose merged weights are not W + s·B·A rounded once",
    "adapter_grads_nan_to_num": _NAN_KEPT,
    "lora_input_nan_to_num": _NAN_KEPT,
    "lora_a_nan_to_num": _NAN_KEPT,
    "inference_weight_cached": _LIFECYCLE,
    "merge_kept_in_eval": _LIFECYCLE,
    "inference_cast_cache_kept_over_to": _LIFECYCLE,
    "settings_kept_on_the_implementation": _SHARED_STATE,
    "served_by_kept_on_the_implementation": _SHARED_STATE,
    "lora_input_grad_nan_to_num": _NAN_KEPT,
    "rank_cut_at_tile": "layer properties: drawn cases off the float64 function",
    "load_takes_complete_pairs": "folder with one layer's adapters missing: refused",
    "merge_oriented_by_shape": "layer properties: drawn cases whose merged weights are not W + s·B·A rounded once",
    "trainable_by_substring": "adapters missing or extra, or base parameters trainable",
    "load_keys_stripped_of_weight": "saved and loaded into a fresh model, adapters or outputs not bitwise",
    "lora_a_init_spread": "at initialisation: A not U(±1/√in) or B not zero",
    "unmerge_leaves_delta": _LIFECYCLE,
    "alpha_pattern_ignored": "layer properties: drawn cases off the float64 function",
    "patterns_not_saved": "per-module rank and alpha: PEFT's loader: adapters missing or not bitwise",
    "disable_not_restored_on_error": _LIFECYCLE,
    "rescale_ignores_rslora": _LIFECYCLE,
    "rescale_compounds": _LIFECYCLE,
}

# The plants only the extended tier can catch (the quick tier catches the rest): the leak's check must be a memory
# slope, not a speed verdict that sharing the GPU could move.
_EXTENDED = {"gpu_memory_leak"}

assert _CHECKS.keys() == _DEFECTS.keys(), "every plant has a defect and a check"

# defect -> (factory name, the tier that must catch it, the check that must be among the failed ones)
PLANTS = {
    defect: (factory, "extended" if factory in _EXTENDED else "quick", _CHECKS[factory])
    for factory, defect in _DEFECTS.items()
}
