"""LoRA implementations of other projects, bundled so the suite can judge them beside its own (issue 19).

Each is an entry point of ``lora_suite.implementations`` and an optional extra; importing one of these modules
does not import its library: the factory does, and names the extra to install when it is missing.
"""
