"""PEFT's adapter folder, as ``save_adapter`` must write it and PEFT reads it: its two files (``adapter_config.json``,
``adapter_model.safetensors`` with PEFT's key names), its tensors under the canonical names, what the format
promises beyond their values (each tensor in its adapter's dtype, adapters only, a config recording the model's r,
lora_alpha, use_rslora and targets), and PEFT's own loader reading the tensors and the scale back
(``peft_loader``). ``lora_suite.judges.round_trip`` judges a folder with these."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from lora_suite.engine.prepare import Prepared
from lora_suite.engine.probes import spec_scale
from lora_suite.implementations import AdapterSpec
from lora_suite.judges.layer_checks import none_of
from lora_suite.measure.criteria import Verdict

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's adapters under canonical names (``<path>.lora_A``), from PEFT's keys."""
    from safetensors.torch import load_file

    out = {}
    for key, t in load_file(str(folder / WEIGHTS_FILE)).items():
        name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
        out[name] = t
    return out


def _config_errors(config: dict, expected: dict, leaves: list[str]) -> list[str]:
    """The config's settings that are not the model's: ``expected``'s keys (use_rslora absent means False), no
    dropout and no fan_in_fan_out where written, and every adapted leaf module among ``target_modules``."""
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else (targets or [])
    bad = [
        f"{key}={config.get(key, 'missing')!r}, the model's {value!r}"
        for key, value in expected.items()
        if config.get(key, False if key == "use_rslora" else None) != value
    ]
    for key, value in (("lora_dropout", 0.0), ("fan_in_fan_out", False)):  # the suite trains without dropout, and
        if key in config and config[key] != value:  # nn.Linear keeps W as (out, in): PEFT reads both from the folder
            bad.append(f"{key}={config[key]!r}, the model's {value!r}")
    if "all-linear" not in targets and (missing := [t for t in leaves if t not in targets]):
        bad.append(f"target_modules {targets} lacks {missing}")
    return bad


def saved_folder_verdicts(
    trained: Prepared, folder: Path, want: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]
) -> list[Verdict]:
    """What PEFT's format promises beyond the tensors' values: each tensor in its adapter's dtype, no tensor but the
    adapters (no base weight), and a config that records the model's r, lora_alpha, use_rslora and targets."""
    wrong_dtype = [
        f"{n}: {saved[n].dtype}, adapter {t.dtype}" for n, t in want.items() if n in saved and saved[n].dtype != t.dtype
    ]
    extra = sorted(set(saved) - set(want))
    spec = trained.spec
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        config, unreadable = {}, [f"{CONFIG_FILE}: {type(exc).__name__}"]
    else:
        unreadable = []
    leaves = sorted({n.rsplit(".", 2)[-2] for n in want})
    expected = {} if spec is None else {"r": spec.r, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora}
    bad_config = unreadable + _config_errors(config, expected, leaves)
    return [
        none_of(
            f"saved folder: tensors not in their adapter's dtype (of {len(want)})",
            wrong_dtype,
            "PEFT saves each adapter in its own dtype",
        ),
        none_of(
            f"saved folder: tensors that are not adapters ({len(saved)} saved)",
            extra,
            "PEFT's adapter_model.safetensors holds the adapters only, never base weights",
            sep=", ",
        ),
        none_of(
            "saved folder: config settings that are not the model's (r, lora_alpha, use_rslora, target_modules, "
            "lora_dropout, fan_in_fan_out)",
            bad_config,
            "PEFT's adapter_config.json (LoraConfig): what PEFT's loader builds the layers from",
        ),
    ]


def peft_loader(
    trained: Prepared, build_base: Callable[[], torch.nn.Module], folder: Path, spec: AdapterSpec
) -> list[Verdict]:
    """PEFT's own loader (``PeftModel.from_pretrained``) on the folder ``round_trip`` wrote, over a fresh base:
    each LoRA layer's A and B must be the trained tensors and its scaling the model's scale (its own where ``spec``
    overrides its r or alpha: rank_pattern, alpha_pattern)."""
    import peft
    from peft.tuners.lora import LoraLayer

    want = {n: p.detach() for n, p in trained.adapters.items()}
    scale = spec_scale(spec)
    try:
        model = peft.PeftModel.from_pretrained(build_base(), str(folder), is_trainable=False)
    except Exception as exc:  # noqa: BLE001  (PEFT refusing the folder is the verdict: named, not a crash)
        why = f"PEFT's loader refused the folder: {type(exc).__name__}: {str(exc)[:300]}"
        return [
            Verdict(
                f"PEFT's loader: adapters missing or not bitwise the trained ones (of {len(want)})",
                len(want),
                "==",
                0,
                "peft.PeftModel.from_pretrained on the saved folder",
                why,
            ),
            Verdict(
                f"PEFT's loader: layers whose scaling is not {scale:g} (of {0})",
                math.inf,
                "==",
                0,
                "lora_alpha / r (alpha / sqrt(r) with use_rslora) in adapter_config.json",
                why,
            ),
        ]
    found, bad_t, bad_s = {}, [], []
    base = model.get_submodule("base_model.model")
    for path, m in base.named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            found[f"{path}.lora_A"] = base.get_parameter(f"{path}.lora_A.default.weight").detach()
            found[f"{path}.lora_B"] = base.get_parameter(f"{path}.lora_B.default.weight").detach()
            if not math.isclose(float(m.scaling["default"]), spec.scale_of(path.rsplit(".", 1)[-1]), rel_tol=1e-9):
                bad_s.append(f"{path}: {m.scaling['default']}")
    for n, t in want.items():
        if n not in found or found[n].shape != t.shape or not torch.equal(found[n].to(t.dtype), t):
            bad_t.append(n)
    return [
        none_of(
            f"PEFT's loader: adapters missing or not bitwise the trained ones (of {len(want)})",
            bad_t,
            "peft.PeftModel.from_pretrained on the saved folder",
            sep=", ",
            shown=4,
        ),
        none_of(
            f"PEFT's loader: layers whose scaling is not {scale:g} (of {len(found) // 2})",
            bad_s,
            "lora_alpha / r (alpha / sqrt(r) with use_rslora) in adapter_config.json",
            sep=", ",
            shown=4,
        ),
    ]
