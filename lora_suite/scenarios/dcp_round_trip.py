"""The sharded checkpoint's round trip (issue 59): ``torch.distributed.checkpoint`` (DCP) must give back, bit for bit,
the training state it saved, on any number of ranks and nodes.

The run trains steps 0 .. K − 1, saves the trainable state with DCP (the adapters, frozen weights left out, and
AdamW's state: moments m, v and the step count t, each rank writing its own shards), trains on through steps
K .. T − 1 and takes the adapters' digest D₁ and the losses L₁(K .. T − 1). Then it loads the checkpoint back into
the same model and optimizer and trains steps K .. T − 1 again: losses L₂, digest D₂. The batches and the learning
rate are functions of the step (``lora_suite.engine.optimizer.lr_at``), the kernels and the collectives see the same
inputs in the same order, so a checkpoint that holds the whole state gives

    L₂(t) = L₁(t) bitwise for every t ≥ K, and D₂ = D₁.

What a faulty save or load loses changes the trajectory at the scale of the learning signal, not of rounding:
moments dropped or reset (the step size restarts its bias correction), tensors loaded under other names, shards
written by one rank only. ``plant_no_optimizer`` loads the adapters alone, as a checkpoint that forgot the optimizer
would: the check must fail on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RoundTrip:
    at: int
    steps_differing: list[int]  # the steps t >= at whose resumed loss is not bitwise the first pass's
    adapters_equal: bool  # D₂ == D₁
    max_abs_loss_gap: float

    def as_dict(self) -> dict:
        return {
            "at": self.at,
            "steps_differing": self.steps_differing,
            "adapters_equal": self.adapters_equal,
            "max_abs_loss_gap": self.max_abs_loss_gap,
        }


def _state(model, optimizer) -> dict:
    """The trainable state as DCP saves it: the model's trainable tensors and the optimizer's, under their FQNs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_sd, "optim": optim_sd}


def _load(model, optimizer, directory: Path, *, plant_no_optimizer: bool) -> None:
    """Read checkpoint ``directory`` back into ``model`` and ``optimizer`` (the adapters alone when planted).

    DCP loads in place: the state dicts hold the parameters' and the optimizer's own tensors, so what ``dcp.load`` is
    not given stays as it was, at the end of the first pass."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    state = _state(model, optimizer)
    if plant_no_optimizer:
        state.pop("optim")
    dcp.load(state, checkpoint_id=str(directory))
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    if plant_no_optimizer:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )


def train_with_round_trip(
    model,
    batches,
    settings,
    adapters: dict,
    at: int,
    directory: str | Path,
    *,
    step_hook=None,
    plant_no_optimizer=False,
) -> tuple[list, RoundTrip]:
    """Train steps 0 .. T − 1 with the DCP checkpoint written after step ``at`` − 1, then resume it and train steps
    ``at`` .. T − 1 again (module docstring). Returns (the first pass's step records, 0 .. T − 1; the round trip's
    figures). ``step_hook`` runs in the first pass only."""
    import torch.distributed.checkpoint as dcp

    from lora_suite.engine.optimizer import make_optimizer
    from lora_suite.engine.trainer import train
    from lora_suite.scenarios.multinode_checks import adapters_digest

    if not 1 <= at < settings.steps:
        raise ValueError(f"a DCP checkpoint after step {at} - 1: expected 1 <= at < train.steps ({settings.steps})")
    directory = Path(directory)
    optimizer = make_optimizer(model, settings, adapters)
    first = train(model, batches, settings, optimizer=optimizer, adapters=adapters, stop_step=at, step_hook=step_hook)
    dcp.save(_state(model, optimizer), checkpoint_id=str(directory))
    rest = train(model, batches, settings, optimizer=optimizer, adapters=adapters, start_step=at, step_hook=step_hook)
    digest_first = adapters_digest(adapters)
    _load(model, optimizer, directory, plant_no_optimizer=plant_no_optimizer)
    again = train(model, batches, settings, optimizer=optimizer, adapters=adapters, start_step=at).records
    gaps = [(r1.step, abs(r1.loss - r2.loss)) for r1, r2 in zip(rest.records, again, strict=True)]
    return first.records + rest.records, RoundTrip(
        at=at,
        steps_differing=[step for step, gap in gaps if not gap == 0.0],
        adapters_equal=adapters_digest(adapters) == digest_first,
        max_abs_loss_gap=max((gap for _, gap in gaps), default=0.0),
    )
