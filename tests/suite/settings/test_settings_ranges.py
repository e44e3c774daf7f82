"""Issue 44, item 3: the settings objects check their own fields on construction, in the YAML loader's words, from
one table of rules (``lora_suite.settings.settings_rules.RULES``); a YAML file's error adds the file's location. The
LoRA settings have one shape (``AdapterSpec``): the YAML's lora section is one, and so is what an implementation gets.

The cases of ``test_every_rule_refuses_its_bad_values_in_python_and_in_yaml`` come from the table itself: each rule
says which changes break it (``Rule.breaking``), and each must be refused by ``dataclasses.replace`` of a valid
object and by a tier (or model) YAML holding the same value, with the same words after the key.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys

import pytest
import torch
import yaml

from lora_suite.implementations.contract import AdapterSpec
from lora_suite.settings import config as C
from lora_suite.settings.config import CONFIG_DIR, ConfigError, SettingsError
from lora_suite.settings.field_types import field_types, scalar_type
from lora_suite.settings.loader import load_model_config, load_tier_config
from lora_suite.settings.registry import registry
from lora_suite.settings.settings_rules import RULES

TIER_YAML = CONFIG_DIR / "quick.yaml"  # every section, a suite entry and a figure
CFG = load_tier_config(TIER_YAML)
RAW_TIER = yaml.safe_load(TIER_YAML.read_text())
RAW_MODEL = yaml.safe_load((CONFIG_DIR / "models" / f"{CFG.model.name}.yaml").read_text())
CLASSES = {
    c.__name__: c
    for c in (
        C.LlamaArchitecture,
        C.ModelConfig,
        C.DataSettings,
        C.TrainSettings,
        C.Criteria,
        C.FigureSpec,
        C.SuiteEntry,
        C.TierConfig,
        C.AdapterSpec,
    )
}
# class -> a valid object of it (the shipped quick tier's) and where its YAML sits: keys from the top of the tier
# YAML, or None for the architecture in the model YAML.
BASES = {
    "TierConfig": (CFG, ()),
    "ModelConfig": (CFG.model, None),
    "LlamaArchitecture": (CFG.model.architecture, None),
    "AdapterSpec": (CFG.lora, ("lora",)),
    "DataSettings": (CFG.data, ("data",)),
    "TrainSettings": (CFG.train, ("train",)),
    "Criteria": (CFG.criteria, ("criteria",)),
    "SuiteEntry": (CFG.suite, ("suite",)),
    "FigureSpec": (CFG.suite.figures[0], ("suite", "figures", 0)),
}
CASES = [
    (name, i, rule, changes)
    for name, rules in RULES.items()
    for i, rule in enumerate(rules)
    for changes in rule.breaking(BASES[name][0])
]


def _fields(obj) -> dict:
    return {f.name: vars(obj)[f.name] for f in dataclasses.fields(obj)}  # as stored: a dtype by its name


def _yaml_value(v):
    if dataclasses.is_dataclass(v):
        return {k: _yaml_value(x) for k, x in _fields(v).items()}
    return [_yaml_value(x) for x in v] if isinstance(v, tuple) else v


def _load_changed(tmp_path, route, changes) -> tuple[str, ConfigError]:
    """Write the shipped YAML (tier, or model for route None) with ``changes`` at ``route``, load it, and return
    where its error is placed (the file and the keys) and the error."""
    if route is None:
        raw = copy.deepcopy(RAW_MODEL)
        raw["architecture"].update({k: _yaml_value(v) for k, v in changes.items()})
        path = tmp_path / "changed-model.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as err:
            load_model_config(path, CONFIG_DIR)
        return f"{path}.architecture", err.value
    raw = copy.deepcopy(RAW_TIER)
    node = raw
    for key in route:
        node = node[key]
    node.update({k: _yaml_value(v) for k, v in changes.items()})
    path = tmp_path / "quick.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_tier_config(path, CONFIG_DIR)
    return str(path) + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in route), err.value


@pytest.mark.parametrize("name, i, rule, changes", CASES, ids=[f"{n}[{i}].{r.field}:{c}" for n, i, r, c in CASES])
def test_every_rule_refuses_its_bad_values_in_python_and_in_yaml(name, i, rule, changes, tmp_path):
    obj, route = BASES[name]
    with pytest.raises(SettingsError) as built:
        dataclasses.replace(obj, **changes)
    err = built.value
    assert (err.owner, err.key) == (name, rule.field), str(err)
    assert rule.expected.format_map({**_fields(obj), **changes}) in err.detail, "another rule refused it"
    assert str(err) == f"{name}.{rule.field}: {err.detail}"
    where, loaded = _load_changed(tmp_path, route, changes)
    assert str(loaded) == f"{where}.{rule.field}: {err.detail}"


def test_every_rule_has_bad_values_and_names_fields_of_its_class():
    assert set(RULES) <= set(CLASSES)
    for name, rules in RULES.items():
        fields = {f.name for f in dataclasses.fields(CLASSES[name])}
        for rule in rules:
            assert rule.field in fields and (rule.when is None or rule.when[0] in fields), (name, rule.field)
            assert rule.breaking(BASES[name][0]), f"{name}.{rule.field}: no value breaks it"


EXAMPLES = [
    (lambda: C.TrainSettings(lr=1e30), "TrainSettings.lr: 1e+30 is out of range; expected finite, > 0 and <= 1"),
    (
        lambda: C.TrainSettings(steps=10, warmup_steps=10),
        "TrainSettings.warmup_steps: 10 is out of range; expected 0 <= warmup_steps < steps=10",
    ),
    (
        lambda: C.TrainSettings(steps=3, cuda_graph=True),
        "TrainSettings.graph_warmup_steps: 3 is out of range; expected < steps=3 with cuda_graph (CUDA graphs need",
    ),
    (
        lambda: C.TrainSettings(max_grad_norm=-1.0),
        "TrainSettings.max_grad_norm: -1.0 is out of range; expected null (no clipping) or finite, > 0",
    ),
    (lambda: C.TrainSettings(schedule="zigzag"), "TrainSettings.schedule: 'zigzag' is not one of ['cosine', "),
    (lambda: C.AdapterSpec(r=0), "AdapterSpec.r: 0 is out of range; expected 1 <= r <= min(in, out)"),
    (lambda: C.AdapterSpec(alpha=0.0), "AdapterSpec.alpha: 0.0 is out of range; expected finite, > 0 (alpha 0"),
    (lambda: C.AdapterSpec(targets=()), "AdapterSpec.targets: [] not among the target names"),
    (lambda: C.AdapterSpec(quantize="nf8"), "AdapterSpec.quantize: 'nf8' is not one of [None, 'nf4']"),
    (lambda: C.DataSettings(batch_size=0), "DataSettings.batch_size: 0 is out of range; expected >= 1"),
    (lambda: C.DataSettings(source="jsonl"), "DataSettings.path: None; source 'jsonl' needs the path of an"),
    (lambda: C.Criteria(loss_drop_min=1.5), "Criteria.loss_drop_min: 1.5 is out of range; expected null or 0 < x < 1"),
    (
        lambda: C.Criteria(aged_vs_fresh_pairs=60),
        "Criteria.aged_vs_fresh_pairs_max: 40 is out of range; expected >= aged_vs_fresh_pairs=60",
    ),
    (
        lambda: dataclasses.replace(CFG.model.architecture, num_attention_heads=7),
        "LlamaArchitecture.hidden_size: 576 is out of range; expected a multiple of num_attention_heads=7",
    ),
    (lambda: C.FigureSpec("x", "ms", "wall", "lower"), "FigureSpec.clock: 'wall'; expected device or host"),
    (lambda: C.SuiteEntry("a tier", gpus=0), "SuiteEntry.gpus: 0; expected >= 1"),
    (lambda: dataclasses.replace(CFG, dtype="int8"), "TierConfig.dtype: 'int8' is not one of ['bfloat16', "),
    (lambda: AdapterSpec(("q_proj",), 0, 16.0), "AdapterSpec.r: 0 is out of range; expected 1 <= r <= min(in, out)"),
    (lambda: AdapterSpec(("q_proj",), 8, float("inf")), "AdapterSpec.alpha: inf is out of range; expected finite, > 0"),
    (lambda: AdapterSpec(("q_proj",), 8, 16.0, quantize="int4"), "AdapterSpec.quantize: 'int4' is not one of"),
    (lambda: C.AdapterSpec(adapter_dtype="int8"), "AdapterSpec.adapter_dtype: 'int8' is not one of ['float32', "),
    # The rules across a tier's objects hold for a TierConfig made in Python, as for a YAML file
    (
        lambda: dataclasses.replace(CFG, lora=dataclasses.replace(CFG.lora, r=4096)),
        "TierConfig.lora.r: 4096 is out of range; expected 1 <= r <= 192 (min(in, out) of v_proj",
    ),
    (
        lambda: dataclasses.replace(CFG, lora=dataclasses.replace(CFG.lora, targets=("qq_proj",))),
        "TierConfig.lora.targets: ['qq_proj'] not among ('q_proj', ",
    ),
    (
        lambda: dataclasses.replace(CFG, data=dataclasses.replace(CFG.data, batch_size=6)),
        "TierConfig.criteria.grad_accum_k: 4 is out of range; expected null or >= 2 dividing batch_size=6",
    ),
    (
        lambda: dataclasses.replace(CFG, criteria=dataclasses.replace(CFG.criteria, loss_drop_min=0.1, loss_window=6)),
        "TierConfig.criteria.loss_window: 6 is out of range; expected >= 1, and two windows must fit in steps=10",
    ),
    (
        lambda: C.TierConfig("t", CFG.model, data=C.DataSettings(seq_len=10**6)),
        "TierConfig.data.seq_len: 1000000 is out of range; expected 2 <= seq_len <= max_position_embeddings=8192",
    ),
    (lambda: C.TrainSettings(steps="10"), "TrainSettings.steps: expected int, got '10'"),
    (lambda: C.TrainSettings(steps=True), "TrainSettings.steps: expected int, got True"),
    (lambda: C.TrainSettings(lr="fast"), "TrainSettings.lr: expected a number, got 'fast'"),
    (lambda: C.AdapterSpec(targets="q_proj"), "AdapterSpec.targets: expected a tuple of str, got 'q_proj'"),
    (lambda: C.AdapterSpec(targets=["q_proj"]), "AdapterSpec.targets: expected a tuple of str, got ['q_proj']"),
    (lambda: C.Criteria(grad_accum_k=2.0), "Criteria.grad_accum_k: expected int or None, got 2.0"),
]


@pytest.mark.parametrize("make, message", EXAMPLES, ids=[m.split(":")[0] for _, m in EXAMPLES])
def test_construction_names_the_class_and_key(make, message):
    with pytest.raises(SettingsError, match="^" + re.escape(message)) as err:
        make()
    assert isinstance(err.value, ConfigError) and err.value.key in message.split(":")[0]


def test_the_yaml_path_names_the_file_and_keeps_the_words(tmp_path):
    where, err = _load_changed(tmp_path, ("train",), {"lr": 1e30})
    assert where == f"{tmp_path / 'quick.yaml'}.train"
    assert str(err) == f"{where}.lr: 1e+30 is out of range; expected finite, > 0 and <= 1"
    assert not isinstance(err, SettingsError)  # a file's error: the file, not a class, is where it is


TYPE_CASES = [
    (name, field, value)
    for name, (obj, _) in BASES.items()
    for field in field_types(type(obj))
    if (kind := scalar_type(type(obj), field)) in (int, float, str, bool)
    for value in (("x",) if kind is not str else (3,)) + ((True,) if kind is int else ())
]


@pytest.mark.parametrize("name, field, value", TYPE_CASES, ids=[f"{n}.{f}={v!r}" for n, f, v in TYPE_CASES])
def test_a_wrong_type_is_refused_on_construction(name, field, value):
    with pytest.raises(SettingsError) as err:
        dataclasses.replace(BASES[name][0], **{field: value})
    assert err.value.key == field and err.value.detail.endswith(f"got {value!r}"), str(err.value)


def test_the_lora_section_is_the_spec_an_implementation_gets():
    """One shape of the LoRA settings: the YAML's lora section loads into ``AdapterSpec``, the dtype by its name."""
    assert type(CFG.lora) is AdapterSpec is C.AdapterSpec
    assert CFG.lora.dtype_name == RAW_TIER["lora"].get("adapter_dtype", "float32")
    assert CFG.lora.adapter_dtype is getattr(torch, CFG.lora.dtype_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, None])
def test_adapter_spec_takes_a_float_dtype_or_its_name_or_none(dtype):
    assert AdapterSpec(("all-linear",), 2, 4, adapter_dtype=dtype).adapter_dtype is dtype
    name = None if dtype is None else str(dtype).removeprefix("torch.")
    by_name = AdapterSpec(("all-linear",), 2, 4, adapter_dtype=name)
    assert by_name.adapter_dtype is dtype and by_name.dtype_name == name
    assert by_name == AdapterSpec(("all-linear",), 2, 4, adapter_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64, "int8", "torch.float32", float, 4])
def test_adapter_spec_refuses_other_dtypes(dtype):
    with pytest.raises(SettingsError, match=r"^AdapterSpec\.adapter_dtype: .* is not one of \['float32', 'bfloat16'"):
        AdapterSpec(("all-linear",), 2, 4, adapter_dtype=dtype)


def test_the_settings_load_without_torch():
    """The command line and the controlling process of workers read every tier without importing torch (4 s)."""
    code = (
        "import sys; from lora_suite.settings.registry import registry; from lora_suite.settings.loader import "
        "load_tier_config; cfgs = [load_tier_config(t.config) for t in registry().values()]; "
        "print([c.lora.dtype_name for c in cfgs][0], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["float32", "False"]


def test_default_settings_are_valid():
    """Every class whose fields all have defaults constructs from them; the rest from the shipped quick tier."""
    defaults = [c for c in CLASSES.values() if all(_has_default(f) for f in dataclasses.fields(c))]
    assert {c.__name__ for c in defaults} >= {"AdapterSpec", "DataSettings", "TrainSettings", "Criteria"}
    for c in defaults:
        c()
    for name, (obj, _) in BASES.items():
        assert dataclasses.replace(obj) == obj, name  # a construction from the object's own fields passes its rules


def _has_default(f) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def test_every_shipped_yaml_loads():
    tiers = registry()
    assert {"quick", "convergence", "memory", "extended", "full"} <= set(tiers)
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        assert load_tier_config(path, CONFIG_DIR).source == str(path)
    for path in sorted((CONFIG_DIR / "models").glob("*.yaml")):
        load_model_config(path, CONFIG_DIR)
