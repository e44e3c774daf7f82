"""The judges: one module per invariant family a LoRA implementation must satisfy, each driving the training engine
(``lora_suite.engine``: the probe block, prepare, the trainer) through the implementation contract alone and returning
``Verdict``s. Parity and its error model (``parity``, ``probe_judge``), the layer contract on fixed grids
(``layer_checks``, ``invariant_checks``) and drawn (``layer_properties``, ``hypothesis_profiles``), non-finite
propagation (``non_finite_checks``), merge rounding (``merge_rounding``), the adapter lifecycle
(``lifecycle``, ``lifecycle_state``), the whole model's function (``model_function``), adapter folders
(``round_trip``, ``peft_folder``, ``broken_folders``) and one implementation adapting two models (``two_models``)."""
