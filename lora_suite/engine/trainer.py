"""The training loop of every tier: AdamW over the adapters only, warm-up then decay, accumulation, records.

One visible loop (``train``). Each optimizer step records what ``lora_suite.engine.step_record`` lists (loss,
gradient norm, learning rate, tokens/s, host and GPU step time, process CPU time, memory). A non-finite loss or
gradient stops the run with ``NonFiniteError`` naming the offending parameters, instead of training on NaN. Records
go into the caller's ``records`` list as they are made, so a run that stops (NaN, an error, Ctrl-C) keeps them.

Gradient accumulation over k micro-batches is token-weighted, so that it equals one k-times batch:
    L = Σ_i Σ_{t∈T_i} ℓ_t / Σ_i |T_i|,   each micro-batch contributes  mean_i · |T_i| / Σ_j |T_j|
where T_i are the tokens with a label in micro-batch i (the model's loss is the mean over its T_i).
Dividing by k instead is only right when every |T_i| is equal (it is not with prompt-masked data).

Captured steps (``train.cuda_graph``): after ``graph_warmup_steps`` eager steps on a side stream (they allocate
the optimizer state and the libraries' workspaces, as CUDA graph capture requires), one step (forward and
backward over the micro-batches, clipping, AdamW) is captured into a CUDA graph with static input buffers and
replayed for every later step: each step copies its micro-batches into the buffers, writes the learning rate
into the optimizer's lr tensor (a capturable AdamW) and replays. The gradients live in the graph's memory and
are overwritten, never zeroed, by each replay. The loss and gradient norm are read back after the replay; so
the non-finite guard stops the run one update later than in eager mode (the update of the non-finite step is
already applied; the error says so). Records say which steps were replayed (``StepRecord.captured``). An SDPA
model's attention becomes ``capture.CAPTURED_ATTENTION`` (its causal kernels, no mask built under capture).

The optimizer, the learning-rate schedule and clipping live in ``lora_suite.engine.optimizer``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lora_core.inject import adapter_parameters
from lora_suite.engine.capture import StaticBatches, causal_attention_for_capture, checkpointing_kwargs
from lora_suite.engine.non_finite import non_finite_message
from lora_suite.engine.optimizer import check_capturable, clip_gradients, lr_at, make_optimizer, set_lr
from lora_suite.engine.step_record import StepRecord, step_readings
from lora_suite.measure.device_time import DeviceTimer
from lora_suite.measure.nvml import NvmlReader, ProcessMemory
from lora_suite.settings.config import TrainSettings

log = logging.getLogger("lora_suite.engine.trainer")


class NonFiniteError(FloatingPointError):
    """Loss or gradients became NaN/Inf; the message names the step and the parameters."""


@dataclass
class TrainResult:
    records: list[StepRecord]
    optimizer: torch.optim.Optimizer
    run: TrainingRun | None = None  # the run's state, to drive it further (aged-vs-fresh comparison)

    @property
    def process_memory_source(self) -> str | None:
        """Where ``StepRecord.process_gpu_mib`` came from (``ProcessMemory.source``); None on the CPU."""
        own = None if self.run is None else self.run.process_memory
        return None if own is None else own.source

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


class CapturedStep:
    """One optimizer step (accumulation, clipping, AdamW) captured in a CUDA graph; ``run`` replays it."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        micro: list[dict[str, torch.Tensor]],
        max_norm: float,
    ):
        self.static = StaticBatches(micro)
        self.graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)  # the captured backward then assigns (not adds to) the gradients
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            self.loss = accumulate_gradients(model, self.static.buffers)
            self.grad_norm = clip_gradients(params, max_norm)
            optimizer.step()

    def run(self, micro: list[dict[str, torch.Tensor]], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.static.load(micro, step)
        self.graph.replay()
        return self.loss, self.grad_norm


def label_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of tokens that carry a loss in a causal-LM batch (labels shifted by one, -100 ignored)."""
    return (batch["labels"][:, 1:] != -100).sum()


def accumulate_gradients(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Forward and backward over the micro-batches, token-weighted (module docstring); returns the loss.

    Gradients add into ``.grad``; the returned loss (a detached 0-d tensor, no sync) is the loss of the
    micro-batches taken together as one batch.
    """
    counts = [label_tokens(b) for b in micro_batches]
    total = torch.stack(counts).sum().clamp_min(1)
    loss_sum: torch.Tensor | None = None
    for batch, count in zip(micro_batches, counts):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        weighted = out.loss * (count / total)
        weighted.backward()
        loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
    if loss_sum is None:
        raise ValueError(f"no micro-batches to accumulate over: got {len(micro_batches)}, expected at least 1")
    return loss_sum


@contextlib.contextmanager
def frozen_heap():
    """Move every live object out of the cyclic collector's reach for the duration (``gc.freeze``).

    A full collection over a model's large object graph stalls a step for hundreds of ms (seen once in an
    extended-tier run on the H200): noise in step-time statistics, not a property of the code under test.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class TrainingRun:
    """The state of one training run (model, batches, optimizer, records, a captured graph) and its ``step``.

    ``train`` drives one run from its start to its stop; the extended tier's aged-vs-fresh comparison
    (``lora_suite.scenarios.aged_vs_fresh``) drives two runs in turns, a step of one then a step of the other. A run is
    used inside ``with run:`` (training mode, an NVML reader), which may be entered again later.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: Callable[[int], dict[str, torch.Tensor]],
        settings: TrainSettings,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        start_step: int = 0,
        adapters: dict[str, nn.Parameter] | None = None,
        records: list[StepRecord] | None = None,
        step_hook: Callable[[int], None] | None = None,
        device_timer: DeviceTimer | None = None,
    ):
        self.model, self.batches, self.settings = model, batches, settings
        self.named = adapter_parameters(model) if adapters is None else adapters
        self.optimizer = optimizer or make_optimizer(model, settings, self.named)
        self.params = list(self.named.values())
        self.cuda = self.params[0].is_cuda
        self.records = [] if records is None else records
        self.step_hook, self.device_timer = step_hook, device_timer
        if settings.cuda_graph:
            check_capturable(self.params)
            if not any(torch.is_tensor(g["lr"]) for g in self.optimizer.param_groups):
                raise ValueError(
                    "train.cuda_graph: true needs a capturable optimizer with a tensor lr "
                    "(make_optimizer builds one from the same settings)"
                )
            causal_attention_for_capture(model)  # its causal kernels, as eager (capture.py)
        self.capture_at = start_step + settings.graph_warmup_steps if settings.cuda_graph else None
        # the warm-up steps run here, as capture requires
        self.side = torch.cuda.Stream() if settings.cuda_graph else None
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
        self.captured: CapturedStep | None = None
        if settings.gradient_checkpointing:
            kwargs = checkpointing_kwargs(model, settings)
            enable = model.gradient_checkpointing_enable
            enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]  # a transformers model's method
        self.nvml: NvmlReader | None = None
        self.process_memory: ProcessMemory | None = None  # one for the run's life (a run entered again keeps it)

    def __enter__(self) -> TrainingRun:
        self.model.train()
        if self.cuda and self.nvml is None:
            self.nvml = NvmlReader()
            if self.process_memory is None:
                self.process_memory = ProcessMemory(self.nvml)
            self.process_memory.reader = self.nvml
        return self

    def __exit__(self, *exc) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
        self.model.eval()

    def step(self, step: int, *, record: bool = True) -> StepRecord:
        """Optimizer step ``step`` (micro-batches ``step * grad_accum ...``), timed and recorded (module docstring)."""
        settings, cuda = self.settings, self.cuda
        if self.captured is None and self.side is not None and step == self.capture_at:
            torch.cuda.current_stream().wait_stream(self.side)  # the warm-up is over: back on the main stream
            self.side = None
        stream_ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        timer = self.device_timer.measure(step, cuda) if self.device_timer else contextlib.nullcontext()
        with timer, stream_ctx:
            t0, c0 = time.perf_counter(), time.process_time()
            if cuda:
                ev_start, ev_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev_start.record()
            lr = lr_at(step, settings)
            set_lr(self.optimizer, lr)
            micro = [self.batches(step * settings.grad_accum + i) for i in range(settings.grad_accum)]
            n_tokens = sum(b["input_ids"].numel() for b in micro)
            max_norm = settings.max_grad_norm if settings.max_grad_norm is not None else math.inf
            replayed = self.capture_at is not None and step >= self.capture_at
            if replayed:
                loss, grad_norm = self._replayed_update(step, micro, max_norm)
            else:
                loss, grad_norm = self._eager_update(step, micro, max_norm)
            if self.step_hook is not None:
                self.step_hook(step)
            if cuda:
                ev_end.record()  # on the stream the step ran on (the side stream during a graph's warm-up)
                torch.cuda.synchronize()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        readings = step_readings(
            settings,
            step,
            (ev_start, ev_end) if cuda else None,
            nvml=self.nvml,
            process_memory=self.process_memory,
            device_timer=self.device_timer,
        )
        rec = StepRecord(
            **readings,
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_s=n_tokens / dt,
            step_time_s=dt,
            cpu_time_s=cpu,
            captured=replayed,
        )
        if record:
            self.records.append(rec)
        return rec

    def _replayed_update(self, step: int, micro: list[dict[str, torch.Tensor]], max_norm: float) -> tuple[float, float]:
        """One update by the captured graph (captured from these micro-batches on its first call, then replayed);
        returns (loss, gradient norm), read back after the replay, so a non-finite step's update is already
        applied."""
        if self.captured is None:
            self.captured = CapturedStep(self.model, self.optimizer, self.params, micro, max_norm)
        loss_t, norm_t = self.captured.run(micro, step)
        grad_norm, loss = float(norm_t), float(loss_t)  # sync after the replay
        self._stop_if_non_finite(step, loss, grad_norm, micro, " (captured step: its update is already applied)")
        return loss, grad_norm

    def _eager_update(self, step: int, micro: list[dict[str, torch.Tensor]], max_norm: float) -> tuple[float, float]:
        """One eager update: zeroed gradients, token-weighted accumulation, clipping to ``max_norm``, and the AdamW
        step only once the loss and gradient norm are finite; returns (loss, gradient norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_t = accumulate_gradients(self.model, micro)
        grad_norm = float(clip_gradients(self.params, max_norm))  # syncs
        loss = float(loss_t)
        self._stop_if_non_finite(step, loss, grad_norm, micro)
        self.optimizer.step()
        return loss, grad_norm

    def _stop_if_non_finite(
        self, step: int, loss: float, grad_norm: float, micro: list[dict[str, torch.Tensor]], note: str = ""
    ) -> None:
        """The non-finite guard: raise ``NonFiniteError`` naming what is non-finite (``note`` appended) unless the
        loss and the gradient norm are both finite."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteError(non_finite_message(step, loss, grad_norm, self.named, self.model, micro) + note)


def train(
    model: nn.Module,
    batches: Callable[[int], dict[str, torch.Tensor]],
    s: TrainSettings,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    stop_step: int | None = None,
    adapters: dict[str, nn.Parameter] | None = None,
    records: list[StepRecord] | None = None,
    step_hook: Callable[[int], None] | None = None,
    device_timer: DeviceTimer | None = None,
) -> TrainResult:
    """Run optimizer steps ``start_step .. stop_step`` (default: to ``s.steps``); batches(i) gives micro-batch i.

    ``records``: a list the step records are appended to as they are made (it survives an exception).
    ``step_hook(step)``: called inside each timed step after the optimizer step (the suite's planted-defect
    self-tests slow or leak through it; tiers pass nothing).
    ``device_timer``: profiles the steps it names (``lora_suite.measure.device_time``); their records carry
    ``device_time_s`` and ``profiled``.
    """
    stop_step = s.steps if stop_step is None else stop_step
    run = TrainingRun(
        model,
        batches,
        s,
        optimizer=optimizer,
        start_step=start_step,
        adapters=adapters,
        records=records,
        step_hook=step_hook,
        device_timer=device_timer,
    )
    began = time.perf_counter()
    with run, frozen_heap():
        for step in range(start_step, stop_step):
            rec = run.step(step)
            if (step + 1) % s.log_every == 0 or step == stop_step - 1 or step == start_step:
                done = step + 1 - start_step
                eta = (time.perf_counter() - began) / done * (stop_step - step - 1)
                log.info(
                    "step %d/%d loss %.4f grad_norm %.3g lr %.2e %.0f tok/s %.0f ms alloc %.2f GiB process %s "
                    "(device %s) eta %s",
                    step + 1,
                    s.steps,
                    rec.loss,
                    rec.grad_norm,
                    rec.lr,
                    rec.tokens_per_s,
                    rec.step_time_s * 1e3,
                    rec.allocated_mib / 1024,
                    "-" if rec.process_gpu_mib is None else f"{rec.process_gpu_mib / 1024:.2f} GiB",
                    "-" if rec.nvml_used_mib is None else f"{rec.nvml_used_mib / 1024:.2f} GiB",
                    f"{eta // 60:.0f}m{eta % 60:02.0f}s",
                )
    return TrainResult(run.records, run.optimizer, run)
