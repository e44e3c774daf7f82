"""The tiers' check that lora_core's checkpointed NF4 training took the reuse path (``lora_core.ops.recompute``):
the recompute kept the bases it dequantised, and the backward took every one of them. Where the path applies, it is
checked, never assumed; elsewhere (another implementation, lora_core's torch reference, a 16-bit base, no
checkpointing) there is nothing to reuse and no check."""

from __future__ import annotations

import contextlib

SOURCE = "lora_core.ops.recompute: NF4 bases kept by the checkpointed recompute for the layer's backward"


def applies(prepared, cfg) -> bool:
    """lora_core's cupy layers on an NF4 base, trained with activation checkpointing. The base is the one the run
    actually stores (``prepared.quantize``), not the config's: an NF4 tier also trains a 16-bit-base comparison."""
    from lora_suite.implementations.lora_core_impl import LoraCoreImplementation

    impl = prepared.implementation
    return (
        isinstance(impl, LoraCoreImplementation)
        and impl.backend == "cupy"
        and prepared.quantize == "nf4"
        and cfg.train.gradient_checkpointing
    )


def counts() -> dict[str, int]:
    from lora_core.ops.recompute import reuse_counts

    return reuse_counts()


def check(checker, name: str, before: dict[str, int]) -> None:
    """Since ``before`` (``counts()``): bases were kept, every one was taken, none dropped untaken."""
    now = counts()
    kept, taken, dropped = (now[k] - before[k] for k in ("kept", "taken", "dropped"))
    checker(f"{name}: NF4 bases the recompute kept for their backward", kept, ">", 0, source=SOURCE)
    checker(f"{name}: kept bases taken by their backward", taken, "==", kept, source=SOURCE)
    checker(f"{name}: kept bases dropped untaken", dropped, "==", 0, source=SOURCE)


@contextlib.contextmanager
def checked(checker, name: str, prepared, cfg):
    """Around a training run: ``check`` after it where the path ``applies``; nothing when the run raises."""
    before = counts() if applies(prepared, cfg) else None
    yield
    if before is not None:
        check(checker, name, before)
