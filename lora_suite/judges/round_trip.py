"""The adapter round trip any implementation must survive: train a few steps, ``save_adapter``, build a fresh model,
``load_adapter``, and get the trained model back bitwise; a folder whose scale is not the model's must be refused
(or honoured), never loaded as if it matched; and where the folder is PEFT's format on a 16-bit base, PEFT's own
loader reads the same tensors and the same scale. PEFT's format and its loader's reading are judged by
``lora_suite.judges.peft_folder``; folders that do not fit the model, which must be refused, by
``lora_suite.judges.broken_folders``.

Why bitwise: the fresh model has the same base weights (same seed), the loaded adapters must be the trained ones
bit for bit, and the same implementation on the same inputs must compute the same logits (``layer_checks``'s
determinism check judges that part on its own). A few training steps move the logits by far less than a 16-bit
tolerance, so a tolerance would let a save that drops every lora_B (a fresh B is zero) pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from lora_suite.engine.prepare import Prepared
from lora_suite.judges.broken_folders import copy_beside, load_fresh
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.peft_folder import CONFIG_FILE, WEIGHTS_FILE, saved_folder_verdicts, saved_tensors
from lora_suite.measure.criteria import Verdict


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
        f"raised {type(exc).__name__}",  # type: ignore[arg-type]  # a word, not a figure: "==" takes any value
        "==",
        "loaded",  # type: ignore[arg-type]  # as above
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
    bad = copy_beside(folder, f"wrong-{key.replace('_', '-')}")
    config = json.loads((bad / CONFIG_FILE).read_text())
    if key not in config and key not in OPTIONAL:
        return Verdict(
            f"folder with a wrong {key}: its config has no {key}",
            "missing",  # type: ignore[arg-type]  # a word, not a figure: "==" takes any value
            "==",
            "present",  # type: ignore[arg-type]  # as above
            "PEFT's adapter_config.json",
        )
    config[key] = planted(config)
    (bad / CONFIG_FILE).write_text(json.dumps(config))
    fresh, refusal = load_fresh(build, bad)
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
