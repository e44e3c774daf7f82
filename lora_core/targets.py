"""The names LoRA can target in a Llama block, importable without torch (the suite's config loader and command
line validate targets before any GPU work)."""

ALL_LINEAR = "all-linear"  # every nn.Linear except the LM head, as PEFT's shorthand
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a Llama block's linears
# the 3-D expert parameters of a mixture-of-experts block that LoRA can target (lora_core.experts), in the order the
# experts module registers them
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
