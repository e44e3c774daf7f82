"""Ops: the LoRA linear autograd Function and the CuPy <-> torch glue it runs on."""
