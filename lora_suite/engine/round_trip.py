"""The adapter round trip any implementation must survive: train a few steps, ``save_adapter``, build a fresh model,
``load_adapter``, and get the trained model back bitwise; a folder whose scale is not the model's must be refused
(or honoured), never loaded as if it matched; and where the folder is PEFT's format on a 16-bit base, PEFT's own
loader reads the same tensors and the same scale.

Why bitwise: the fresh model has the same base weights (same seed), the loaded adapters must be the trained ones
bit for bit, and the same implementation on the same inputs must compute the same logits (``layer_checks``'s
determinism check judges that part on its own). A few training steps move the logits by far less than a 16-bit
tolerance, so a tolerance would let a save that drops every lora_B (a fresh B is zero) pass.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from lora_suite.engine.layer_checks import none_of
from lora_suite.engine.prepare import Prepared
from lora_suite.measure.criteria import Verdict

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def train_a_few(prepared: Prepared, steps: int, lr: float) -> list[float]:
    """``steps`` AdamW steps on the adapters (batches 0..steps-1); the losses."""
    opt = torch.optim.AdamW(list(prepared.adapters.values()), lr=lr)
    losses = []
    for step in range(steps):
        batch = prepared.batches(step)
        loss = prepared.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits.detach().clone()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's adapters under canonical names (``<path>.lora_A``), from PEFT's keys."""
    from safetensors.torch import load_file

    out = {}
    for key, t in load_file(str(folder / WEIGHTS_FILE)).items():
        name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
        out[name] = t
    return out


# A folder whose adapter_config.json says another value than the model's: key -> the planted value
TAMPERED = {
    "lora_alpha": lambda c: 2 * c["lora_alpha"] + 1,
    "r": lambda c: 2 * c["r"],
    "use_rslora": lambda c: not c.get("use_rslora", False),  # PEFT's LoraConfig: absent means False
}
OPTIONAL = {"use_rslora"}  # keys a folder may leave out (their absence has PEFT's default meaning)


def round_trip(
    trained: Prepared, build: Callable[[], Prepared], folder: Path, tampered: tuple[str, ...] = tuple(TAMPERED)
) -> list[Verdict]:
    """``trained`` saved to ``folder``, a fresh model from ``build()`` loaded from it: verdicts on the folder's
    tensors, the fresh model before and after loading, and folders with a planted wrong value of each ``tampered``
    key (lora_alpha and r; ``tampered_folder`` judges one on its own)."""
    impl = trained.implementation
    batch = trained.batches(10_000)  # a batch the training did not see
    want = {n: p.detach().clone() for n, p in trained.adapters.items()}
    want_logits = logits(trained.model, batch)
    impl.save_adapter(trained.model, folder)
    saved = saved_tensors(folder) if (folder / WEIGHTS_FILE).is_file() else {}
    out = [_saved_bitwise_verdict(want, saved)]
    out += saved_folder_verdicts(trained, folder, want, saved)
    fresh = build()
    out.append(
        Verdict(
            "fresh model before loading: max |logits - trained logits| (the round trip can tell them apart)",
            _max_diff(logits(fresh.model, batch), want_logits),
            ">",
            0.0,
            "training moved the adapters: a fresh model that already matched would make the next checks blind",
        )
    )
    try:
        impl.load_adapter(fresh.model, folder)
    except Exception as exc:  # noqa: BLE001  (recorded as the failed check, with the error, not a crash)
        return out + [_load_failed_verdict(exc)]
    out += _loaded_verdicts(fresh, want, batch, want_logits)
    for key in tampered:
        out.append(_tampered(trained, build, folder, key, TAMPERED[key], logits(fresh.model, batch)))
    return out


def _saved_bitwise_verdict(want: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> Verdict:
    """The saved folder holds every trained adapter, of its shape and bitwise its values (after a cast to the
    adapter's dtype and device)."""
    bad = [
        n for n, t in want.items() if n not in saved or saved[n].shape != t.shape or not torch.equal(saved[n].to(t), t)
    ]
    return none_of(
        f"saved folder: adapters missing or not bitwise the trained ones (of {len(want)})",
        bad,
        "save_adapter writes PEFT's format (adapter_model.safetensors, PEFT's key names)",
        sep=", ",
        shown=4,
    )


def _load_failed_verdict(exc: Exception) -> Verdict:
    """The failed check of a ``load_adapter`` that raised on the folder ``save_adapter`` wrote, naming the error."""
    return Verdict(
        "after load_adapter: the folder save_adapter wrote loads",
        f"raised {type(exc).__name__}",
        "==",
        "loaded",
        "load_adapter reads what save_adapter wrote",
        str(exc)[:300],
    )


def _loaded_verdicts(
    fresh: Prepared, want: dict[str, torch.Tensor], batch: dict, want_logits: torch.Tensor
) -> list[Verdict]:
    """After ``load_adapter``: the fresh model's adapters bitwise the trained ones, and its logits on ``batch``
    bitwise the trained model's (max |Δ| = 0)."""
    got = fresh.implementation.adapter_parameters(fresh.model)
    bad = [n for n, t in want.items() if n not in got or not torch.equal(got[n].detach(), t)]
    return [
        none_of(
            f"after load_adapter: adapters not bitwise the trained ones (of {len(want)})",
            bad,
            "load_adapter reads what save_adapter wrote",
            sep=", ",
            shown=4,
        ),
        Verdict(
            "after load_adapter: max |logits - trained logits|",
            _max_diff(logits(fresh.model, batch), want_logits),
            "==",
            0.0,
            "same base, same adapters, same implementation: the same logits bitwise",
        ),
    ]


def _tensors(change: Callable[[dict], dict]) -> Callable[[Path], None]:
    """A folder change that rewrites the saved tensors with ``change``."""

    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = change(load_file(str(folder / WEIGHTS_FILE)))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE), metadata={"format": "pt"}
        )

    return apply


def _drop_one(tensors: dict) -> dict:
    return dict(list(tensors.items())[:-1])


def _add_unknown(tensors: dict) -> dict:
    some = next(iter(tensors.values()))
    return {**tensors, f"{PEFT_PREFIX}model.no_such_module.lora_A.weight": torch.zeros_like(some)}


def _reshape_one(tensors: dict) -> dict:
    key, t = next(iter(tensors.items()))
    return {**tensors, key: torch.cat([t, t[:1]])}  # one row more: another rank's or another layer's tensor


def _config_text(text: str | None) -> Callable[[Path], None]:
    """A folder change that replaces the config file with ``text`` (None: removes it)."""

    def apply(folder: Path) -> None:
        if text is None:
            (folder / CONFIG_FILE).unlink()
        else:
            (folder / CONFIG_FILE).write_text(text)

    return apply


# A folder that does not fit the model: what -> how the saved folder is changed. Each must be refused: a loader that
# takes the rest leaves a layer as it was (peft#2773: weights silently not loaded), reads a tensor into a layer of
# another shape, or loads weights under settings it guessed (no config, or one it could not read).
BROKEN = {
    "an adapter missing": _tensors(_drop_one),
    "a tensor that fits no adapter": _tensors(_add_unknown),
    "an adapter of another shape": _tensors(_reshape_one),
    "no adapter_config.json": _config_text(None),
    "an adapter_config.json that is not JSON": _config_text('{"r": 8, "lora_alpha":'),
    "an adapter_config.json that is a JSON list": _config_text("[]"),
}


def broken_folder(trained: Prepared, build: Callable[[], Prepared], folder: Path, what: str) -> Verdict:
    """``trained`` saved to ``folder``, then a copy broken as ``BROKEN[what]`` says, loaded into a fresh model: it
    must be refused."""
    if what not in BROKEN:
        raise ValueError(f"broken_folder: {what!r} is not one of {sorted(BROKEN)}")
    trained.implementation.save_adapter(trained.model, folder)
    bad = _copy(folder, "broken-" + "".join(c if c.isalnum() else "-" for c in what))
    BROKEN[what](bad)
    _, refusal = _load_fresh(build, bad)
    return Verdict(
        f"folder with {what}: refused (never loaded in part)",
        refusal is not None,
        "==",
        True,
        "a folder that does not fit the model, or whose settings cannot be read, is not the trained adapter "
        "(peft#2773)",
        f"refused: {refusal}" if refusal else "loaded without an error",
    )


def _copy(folder: Path, suffix: str) -> Path:
    """A copy of ``folder`` beside it, to plant a defect in."""
    bad = folder.with_name(f"{folder.name}-{suffix}")
    shutil.copytree(folder, bad, dirs_exist_ok=True)
    return bad


def _load_fresh(build: Callable[[], Prepared], folder: Path) -> tuple[Prepared, str | None]:
    """A fresh model with ``folder`` loaded into it, and the loader's refusal (its error, named; None: it loaded)."""
    fresh = build()
    try:
        fresh.implementation.load_adapter(fresh.model, folder)
    except Exception as exc:  # noqa: BLE001  (a refusal is an answer the callers judge; it is named)
        return fresh, f"{type(exc).__name__}: {str(exc)[:200]}"
    return fresh, None


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
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else (targets or [])
    expected = {} if spec is None else {"r": spec.r, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora}
    bad_config = unreadable + [
        f"{key}={config.get(key, 'missing')!r}, the model's {value!r}"
        for key, value in expected.items()
        if config.get(key, False if key == "use_rslora" else None) != value
    ]
    for key, value in (("lora_dropout", 0.0), ("fan_in_fan_out", False)):  # the suite trains without dropout, and
        if key in config and config[key] != value:  # nn.Linear keeps W as (out, in): PEFT reads both from the folder
            bad_config.append(f"{key}={config[key]!r}, the model's {value!r}")
    if "all-linear" not in targets and (missing := [t for t in leaves if t not in targets]):
        bad_config.append(f"target_modules {targets} lacks {missing}")
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


def tampered_folder(trained: Prepared, build: Callable[[], Prepared], folder: Path, key: str) -> Verdict:
    """``trained`` saved to ``folder``, then a copy whose config's ``key`` is planted wrong, loaded into a fresh model:
    refused or honoured, never loaded as if it matched (the trained model's logits are what a match would give)."""
    if key not in TAMPERED:
        raise ValueError(f"tampered_folder: key {key!r} is not one of {sorted(TAMPERED)}")
    trained.implementation.save_adapter(trained.model, folder)
    return _tampered(trained, build, folder, key, TAMPERED[key], logits(trained.model, trained.batches(10_000)))


def _tampered(trained, build, folder: Path, key: str, planted, good_logits) -> Verdict:
    """A copy of ``folder`` whose config's ``key`` is not the model's: ``load_adapter`` must refuse it, or load it
    under that value (logits then differ); loading it as if it matched is the defect."""
    bad = _copy(folder, f"wrong-{key.replace('_', '-')}")
    config = json.loads((bad / CONFIG_FILE).read_text())
    if key not in config and key not in OPTIONAL:
        return Verdict(
            f"folder with a wrong {key}: its config has no {key}",
            "missing",
            "==",
            "present",
            "PEFT's adapter_config.json",
        )
    config[key] = planted(config)
    (bad / CONFIG_FILE).write_text(json.dumps(config))
    fresh, refusal = _load_fresh(build, bad)
    if refusal is not None:  # any refusal is the right answer; it is named in the detail
        outcome, detail = "refused", refusal
    else:
        same = torch.equal(logits(fresh.model, trained.batches(10_000)), good_logits)
        outcome, detail = ("ignored" if same else "honoured"), f"{key}={config[key]} in the folder"
    return Verdict(
        f"folder with a wrong {key}: refused or honoured (not loaded as if it matched)",
        outcome != "ignored",
        "==",
        True,
        "the same tensors under another scale are another model",
        f"{outcome}: {detail}",
    )


def peft_loader(
    trained: Prepared, build_base: Callable[[], torch.nn.Module], folder: Path, scale: float
) -> list[Verdict]:
    """PEFT's own loader (``PeftModel.from_pretrained``) on the folder ``round_trip`` wrote, over a fresh base:
    each LoRA layer's A and B must be the trained tensors and its scaling the model's scale."""
    import peft
    from peft.tuners.lora import LoraLayer

    model = peft.PeftModel.from_pretrained(build_base(), str(folder), is_trainable=False)
    want = {n: p.detach() for n, p in trained.adapters.items()}
    found, bad_t, bad_s = {}, [], []
    for path, m in model.base_model.model.named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            found[f"{path}.lora_A"] = m.lora_A["default"].weight.detach()
            found[f"{path}.lora_B"] = m.lora_B["default"].weight.detach()
            if not math.isclose(float(m.scaling["default"]), scale, rel_tol=1e-9):
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
