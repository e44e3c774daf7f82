"""The per-rank memory of an FSDP2 run, measured or on paper: one derivation for both.

A rank of an FSDP2 job sharded F ways holds what one GPU would hold at the same per-rank batch, P, less what
sharding takes away, S·(1 − 1/F), plus what it gathers at once, T:

    peak_rank ≤ P − S·(1 − 1/F) + T

S, the shardable bytes: every parameter (the base, NF4 codes and quantisation state included, and the adapters) and
the adapters' gradients and AdamW's two fp32 moments. T, the transient: the root unit's own parameters (embeddings,
final norm, LM head: FSDP2 keeps the root gathered between forward and backward) and three decoder layers (the one
running; for the next, prefetched, FSDP2's flat all-gather buffer and the per-parameter tensors it copies out into).
The rest of P (activations, logits, scratch) is per rank and sharding leaves it as it is.

The multigpu tier judges a measured rank against this bound with P measured on one GPU and S, T counted on the model
(``lora_suite.scenarios.multigpu.memory_terms``). ``plan_per_rank`` takes all three from the architecture on paper
(P from ``lora_suite.measure.memory.estimate_training_memory``): what a model too large for any GPU at hand (a 70B
QLoRA) needs per rank, before a run. It assumes the NF4 codes and their quantisation state shard like any parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_suite.measure.memory import _DTYPE_BYTES, estimate_training_memory
from lora_suite.settings.config import AdapterSpec, LlamaArchitecture


def sharded_peak(one_gpu: float, sharded: float, transient: float, factor: int) -> float:
    """peak_rank = P − S·(1 − 1/F) + T (module docstring), in the unit of its arguments."""
    if factor < 1:
        raise ValueError(f"sharding factor {factor} must be >= 1")
    return one_gpu - sharded * (1 - 1 / factor) + transient


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan, in bytes: the one-GPU estimate P, the shardable S, the transient T and the peak."""

    world: int
    one_gpu: int
    sharded: int
    transient: int

    @property
    def peak(self) -> float:
        return sharded_peak(self.one_gpu, self.sharded, self.transient, self.world)


def plan_per_rank(
    arch: LlamaArchitecture,
    lora: AdapterSpec,
    *,
    world: int,
    batch_per_rank: int,
    seq_len: int,
    gradient_checkpointing: bool = True,
    dtype: str = "bfloat16",
) -> RankPlan:
    """The plan of one of ``world`` FSDP2 ranks, each training ``batch_per_rank`` sequences of ``seq_len``."""
    if world < 1 or batch_per_rank < 1 or seq_len < 1:
        raise ValueError(
            f"world={world}, batch_per_rank={batch_per_rank}, seq_len={seq_len}: expected each an integer >= 1"
        )
    est = estimate_training_memory(
        arch,
        lora,
        batch_size=batch_per_rank,
        seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
        dtype=dtype,
    )
    layers, h, wbytes = arch.num_hidden_layers, arch.hidden_size, _DTYPE_BYTES[dtype]
    sharded = est.weights + est.quant_state + est.adapters + est.gradients + est.optimizer
    root_own = (arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2) + h) * wbytes
    # a decoder layer: its share of the base (linears and norms), of the quantisation state, of the adapters
    per_layer = (est.weights - root_own + est.quant_state + est.adapters) // layers
    transient = root_own + 3 * per_layer
    return RankPlan(world, est.allocated_peak, sharded, transient)
