"""A resumed run: stopped at step K, checkpointed, and resumed in a fresh model, training must go on as the
uninterrupted run goes on.

What a resume restores (``lora_suite.engine.checkpoint``): the adapters, through the implementation's own
``save_adapter``/``load_adapter`` (a PEFT folder); AdamW's state, its moments m, v and step count t, which torch keys
by the position of each parameter in the optimizer's list; the step K, of which the learning rate
(``lora_suite.engine.optimizer.lr_at``) and the batches are functions. With all of it restored, step t ≥ K of the
resumed run computes what step t of the uninterrupted run computes, from the same numbers:

    θ_{t+1} = θ_t − lr(t)·(m̂_t / (√v̂_t + ε) + λ·θ_t),   m_t, v_t from m_{t−1}, v_{t−1} and g_t(θ_t, batch(t))

so its losses differ from the uninterrupted run's only where the arithmetic differs: a captured run resumes with
``graph_warmup_steps`` eager steps, whose AdamW step size is computed in fp64 on the host instead of fp32 on the
device (a relative 2^-24 per update, the convergence tier's captured-vs-eager derivation). What a faulty resume
loses moves the trajectory at the scale of the learning signal: moments reset (t = 0: bias correction restarts),
moments given to other tensors (the list in another order), adapters rounded or not loaded, the schedule restarted.

The band: a second resume from the same checkpoint, right by construction (``resume_by_name``): the adapters copied
into the fresh model by canonical name from the values the run held at step K, not through the implementation's
``load_adapter``, and the optimizer built over the adapters in the order of the run that saved the state. It takes
every difference a correct resume may show (the eager warm-up's arithmetic, kernels that do not reproduce bit for
bit) and none of what the implementation's own load and listing do. The tier judges the implementation's resume
against the uninterrupted run with ``lora_suite.measure.criteria.loss_match``, the by-name resume as its control:
gap(t) ≤ max(factor·e(t), floor). The band of the tier's loss-match check (a control whose lora_A is perturbed by
the bf16 unit roundoff) is too wide for this: on the CPU it let a resume with every layer's moments misplaced pass
(``tests/suite/engine/test_resume.py``), since a correct resume is exact where that control is not.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lora_suite.engine.checkpoint import (
    load_adapter_checkpoint,
    load_optimizer_state,
    save_adapter_checkpoint,
    verify_checkpoint,
)
from lora_suite.engine.gradients import copy_adapters
from lora_suite.engine.optimizer import make_optimizer
from lora_suite.engine.prepare import Prepared, trained_parameters
from lora_suite.engine.trainer import TrainResult, train
from lora_suite.settings.config import TrainSettings


class CheckpointAt:
    """A ``train`` step hook that writes checkpoint ``directory`` once optimizer step ``at − 1`` is done (the
    checkpoint's step is ``at``, the next step to run): the adapters through ``prepared.implementation``, the state
    of ``optimizer`` (the one the run trains with) and the step. ``saved`` says whether it was written."""

    def __init__(self, at: int, directory: str | Path, prepared: Prepared, optimizer) -> None:
        if at < 1:
            raise ValueError(f"a checkpoint after step {at} - 1: expected at >= 1 (the next step to run)")
        self.at, self.directory, self.prepared, self.optimizer = at, Path(directory), prepared, optimizer
        self.saved = False
        self.adapters: dict[str, torch.Tensor] = {}  # canonical name -> the value at the checkpoint (on the CPU)

    def __call__(self, step: int) -> None:
        if step == self.at - 1:
            save_adapter_checkpoint(
                self.prepared.model,
                self.directory,
                step=self.at,
                optimizer=self.optimizer,
                implementation=self.prepared.implementation,
            )
            self.adapters = {n: p.detach().cpu().clone() for n, p in self.prepared.adapters.items()}
            self.saved = True


def train_with_checkpoint(
    prepared: Prepared, settings: TrainSettings, at: int, directory: str | Path
) -> tuple[TrainResult, dict[str, torch.Tensor]]:
    """Train ``prepared`` from step 0 to ``settings.steps``, writing checkpoint ``directory`` after step ``at − 1``;
    returns the result and the adapters' values at the checkpoint by canonical name (for ``resume_by_name``)."""
    optimizer = make_optimizer(prepared.model, settings, prepared.adapters)
    hook = CheckpointAt(at, directory, prepared, optimizer)
    result = train(
        prepared.model, prepared.batches, settings, optimizer=optimizer, adapters=prepared.adapters, step_hook=hook
    )
    if not hook.saved:
        raise RuntimeError(f"the run of {settings.steps} steps never reached step {at - 1}: no checkpoint written")
    return result, hook.adapters


def resume(prepared: Prepared, settings: TrainSettings, directory: str | Path) -> tuple[int, TrainResult]:
    """Resume checkpoint ``directory`` in ``prepared`` (a fresh model of the same config: the same base weights):
    its adapters through the implementation's ``load_adapter``, then an optimizer over the adapters as the
    implementation lists them after that load, given the saved state; train from the saved step to
    ``settings.steps``. Returns (that step, the result: its losses are those of steps step .. steps − 1)."""
    step = load_adapter_checkpoint(prepared.model, directory, implementation=prepared.implementation)
    adapters, _ = trained_parameters(prepared.implementation, prepared.model, prepared.spec)
    optimizer = make_optimizer(prepared.model, settings, adapters)
    load_optimizer_state(optimizer, directory)
    result = train(prepared.model, prepared.batches, settings, optimizer=optimizer, start_step=step, adapters=adapters)
    return step, result


def resume_by_name(
    prepared: Prepared, settings: TrainSettings, directory: str | Path, adapters: dict[str, torch.Tensor]
) -> tuple[int, TrainResult]:
    """The control of ``resume``: checkpoint ``directory``'s step and optimizer state, with ``adapters`` (the values
    at the checkpoint, by canonical name) copied into ``prepared``, a fresh model whose adapter list is in the order
    of the run that saved the state; train from that step to ``settings.steps``."""
    step = verify_checkpoint(directory)
    copy_adapters(prepared.adapters, adapters)
    optimizer = make_optimizer(prepared.model, settings, prepared.adapters)
    load_optimizer_state(optimizer, directory)
    result = train(
        prepared.model, prepared.batches, settings, optimizer=optimizer, start_step=step, adapters=prepared.adapters
    )
    return step, result
