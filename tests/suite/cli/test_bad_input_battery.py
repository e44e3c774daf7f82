"""The bad-input battery (issue 20): every entry point fed broken, missing, partial, mismatched and hostile input.

Each case asserts a clear error that names the bad value (or the key) and what was expected, raised before any
GPU work (configs, data, flags, implementation names, adapter folders and checkpoints are all read first), and
nothing written half. Entry points and their case counts are printed by ``test_the_battery_has_150_cases``
and stated in docs/reports.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lora_suite.core.config import CONFIG_DIR, ConfigError
from lora_suite.core.loader import load_model_config, load_tier_config
from lora_suite.engine.data import ByteTokenizer, load_alpaca_jsonl
from lora_suite.implementations import ImplementationError, load_peft_tensors, resolve_implementation

ROOT = Path(__file__).resolve().parents[3]
DEL = "<deleted>"

# ------------------------------------------------------------------ tier YAML (configs/<tier>.yaml)
# (base tier, key path, bad value, what the message must hold besides the key)
TIER_CASES = [
    ("quick", "dtype", "float8", "not one of ['bfloat16', 'float16', 'float32']"),
    ("quick", "dtype", 3, "expected str, got 3"),
    ("quick", "weights", "maybe", "'maybe' is not one of ['auto', 'pretrained', 'random']"),
    ("quick", "model", "gpt-5", "model config 'gpt-5' not found"),
    ("quick", "model", 7, "expected the name of a file"),
    ("quick", "model", DEL, "expected the name of a file"),
    ("quick", "implementation", "no such impl!", "'no such impl!' is not a LoRA implementation name"),
    ("quick", "lora.r", 0, "0 is out of range; expected 1 <= r"),
    ("quick", "lora.r", -4, "-4 is out of range"),
    ("quick", "lora.r", "8", "expected int, got '8'"),
    ("quick", "lora.r", 2.5, "expected int, got 2.5"),
    ("quick", "lora.r", 4096, "4096 is out of range; expected 1 <= r <= 192"),
    ("quick", "lora.alpha", -1, "-1.0 is out of range; expected finite, > 0"),
    ("quick", "lora.alpha", 0, "0.0 is out of range"),
    ("quick", "lora.alpha", "big", "expected a number, got 'big'"),
    ("quick", "lora.targets", ["qq_proj"], "['qq_proj'] not among"),
    ("quick", "lora.targets", [], "[] not among"),
    ("quick", "lora.targets", [1, 2], "lora.targets[0]: expected str, got 1"),
    ("quick", "lora.quantize", "nf8", "'nf8' is not one of [None, 'nf4']"),
    ("quick", "lora.adapter_dtype", "int8", "'int8' is not one of"),
    ("quick", "lora.use_rslora", "yes", "expected bool, got 'yes'"),
    ("quick", "lora.dropout", 0.1, "unknown key(s) ['dropout']"),
    ("quick", "lora", None, "expected a mapping, got NoneType"),
    ("quick", "lora", [1, 2], "expected a mapping, got list"),
    ("quick", "data.batch_size", 0, "0 is out of range; expected >= 1"),
    ("quick", "data.batch_size", -1, "-1 is out of range"),
    ("quick", "data.batch_size", "8", "expected int, got '8'"),
    ("quick", "data.seq_len", 0, "0 is out of range; expected 2 <= seq_len"),
    ("quick", "data.seq_len", 10**9, "1000000000 is out of range"),
    ("quick", "data.source", "web", "'web' is not one of ['embedded', 'jsonl']"),
    ("quick", "data.source", "jsonl", "source 'jsonl' needs the path"),
    ("quick", "data.pool", -1, "-1 is out of range; expected >= 0"),
    ("quick", "data.shuffle", True, "unknown key(s) ['shuffle']"),
    ("quick", "train.steps", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.steps", -5, "-5 is out of range"),
    ("quick", "train.steps", True, "expected int, got True"),
    ("quick", "train.steps", 1.5, "expected int, got 1.5"),
    ("quick", "train.lr", -1e-3, "-0.001 is out of range; expected finite, > 0"),
    ("quick", "train.lr", 0, "0.0 is out of range"),
    ("quick", "train.lr", "fast", "expected a number, got 'fast'"),
    ("quick", "train.lr", ".nan", "is out of range"),
    ("quick", "train.lr", 1.0e30, "1e+30 is out of range; expected finite, > 0 and <= 1"),  # issue 28
    ("quick", "source", "elsewhere.yaml", "the loader sets it to the file a config came from"),  # issue 28
    ("quick", "train.warmup_steps", -1, "-1 is out of range; expected 0 <= warmup_steps < steps"),
    ("quick", "train.warmup_steps", 10, "10 is out of range; expected 0 <= warmup_steps < steps"),
    ("quick", "train.schedule", "zigzag", "'zigzag' is not one of ['cosine', 'linear', 'constant']"),
    ("quick", "train.grad_accum", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.log_every", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.cuda_graph", "yes", "expected bool, got 'yes'"),
    ("quick", "train.graph_warmup_steps", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.seed", "x", "expected int, got 'x'"),
    ("quick", "train.optimizer", "sgd", "unknown key(s) ['optimizer']"),
    ("quick", "tier", None, "expected str, got None"),
    ("quick", "extra_top", 1, "unknown key(s) ['extra_top']"),
    ("quick", "criteria.nonsense", 3, "unknown key(s) ['nonsense']"),
    ("convergence", "criteria.loss_drop_min", 1.5, "1.5 is out of range; expected null or 0 < x < 1"),
    ("convergence", "criteria.loss_drop_min", -0.1, "-0.1 is out of range"),
    ("convergence", "criteria.loss_window", 0, "0 is out of range"),
    ("convergence", "criteria.loss_window", 60, "60 is out of range; expected >= 1, and two windows must fit"),
    ("convergence", "criteria.control_perturbation", 0, "0.0 is out of range; expected 0 < x < 1"),
    ("convergence", "criteria.loss_match_floor", -1, "-1.0 is out of range; expected null or finite, >= 0"),
    ("extended", "criteria.stall_fraction_max", 1.0, "1.0 is out of range; expected null or 0 < x < 1"),
] + [
    ("extended", f"criteria.{name}", -1, "-1.0 is out of range; expected null or finite, > 0")
    for name in (
        "loss_match_factor",
        "smooth_slack",
        "vram_budget_gib",
        "leak_slope_max_mib_per_step",
        "stall_fraction_max",
        "device_time_drift_max",
        "aged_vs_fresh_slowdown_max",
        "host_leak_slope_max_mib_per_step",
        "aged_vs_fresh_resolution",
        "tier_seconds_target",
        "grad_match_factor",
        "vram_budget_16bit_base_gib",
        "memory_estimate_error_max",
        "build_seconds_max",
        "grad_loss_floor",
        "scaling_efficiency_min",
        "rank_failure_seconds_max",
    )
]


def _mutated(tmp_path: Path, tier: str, path: str, value) -> Path:
    raw = yaml.safe_load((CONFIG_DIR / f"{tier}.yaml").read_text())
    node, keys = raw, path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value == DEL:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    out = tmp_path / f"{tier}.yaml"
    text = yaml.safe_dump(raw)
    out.write_text(text.replace("'.nan'", ".nan"))  # a YAML NaN, not the string
    return out


@pytest.mark.parametrize("tier, key, value, expected", TIER_CASES, ids=[f"{t}-{k}={v!r}" for t, k, v, _ in TIER_CASES])
def test_tier_yaml(tier, key, value, expected, tmp_path):
    path = _mutated(tmp_path, tier, key, value)
    with pytest.raises(ConfigError) as err:
        load_tier_config(path, CONFIG_DIR)
    msg = str(err.value)
    assert expected in msg, msg
    leaf = key.split(".")[-1]
    assert leaf in msg or key.split(".")[0] in msg or "model config" in msg, f"the key is not named: {msg}"


FILE_CASES = [
    ("not YAML at all", "lora: [unclosed", "malformed YAML"),
    ("a list at the top", "- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ("a scalar at the top", "42\n", "expected a mapping at the top level, got int"),
    ("empty file", "", "expected a mapping at the top level"),
    ("binary junk", "\x00\x01\x02", "malformed YAML"),
    # issue 28: PyYAML kept the second silently
    (
        "a section given twice",
        "tier: quick\nmodel: smollm2-135m\nlora:\n  r: 4\nlora:\n  r: 8\n",
        "'lora' is given twice",
    ),
]


@pytest.mark.parametrize("what, text, expected", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_tier_yaml_file(what, text, expected, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_tier_config(path, CONFIG_DIR)


def test_tier_yaml_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config .*missing.yaml"):
        load_tier_config(tmp_path / "missing.yaml", CONFIG_DIR)


# ------------------------------------------------------------------ model YAML (configs/models/<name>.yaml)
MODEL_CASES = [
    ("hidden_size", 0),
    ("hidden_size", -64),
    ("num_hidden_layers", 0),
    ("num_attention_heads", 0),
    ("intermediate_size", 0),
    ("vocab_size", 0),
    ("hidden_size", "wide"),
    ("num_attention_heads", 7),
]


@pytest.mark.parametrize("key, value", MODEL_CASES, ids=[f"{k}={v!r}" for k, v in MODEL_CASES])
def test_model_yaml(key, value, tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "models" / "smollm2-135m.yaml").read_text())
    arch = raw["architecture"] if "architecture" in raw else raw
    arch[key] = value
    path = tmp_path / "broken-model.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_model_config(str(path), CONFIG_DIR)
    assert key in str(err.value) and repr(value) in str(err.value), str(err.value)


def test_model_name_that_is_not_known():
    with pytest.raises(ConfigError, match=r"model config 'llama-9' not found .* known models: \['llama-2-7b'"):
        load_model_config("llama-9", CONFIG_DIR)


# ------------------------------------------------------------------ JSONL data (data.source: jsonl)
JSONL_CASES = [
    ("not JSON", "{oops\n", r":1: not valid JSON"),
    ("a list per line", "[1, 2]\n", r":1: expected a JSON object, got list"),
    ("a number per line", "3\n", r":1: expected a JSON object, got int"),
    ("missing output", '{"instruction": "a"}\n', r":1: missing or non-string key\(s\) \['output'\]"),
    ("missing instruction", '{"output": "b"}\n', r":1: missing or non-string key\(s\) \['instruction'\]"),
    ("output not a string", '{"instruction": "a", "output": 3}\n', r":1: missing or non-string key\(s\) \['output'\]"),
    ("second line broken", '{"instruction": "a", "output": "b"}\n{"instruction": \n', r":2: not valid JSON"),
    ("empty file", "", r"holds no examples"),
    ("only blank lines", "\n\n  \n", r"holds no examples"),
    ("instruction null", '{"instruction": null, "output": "b"}\n', r"missing or non-string key\(s\) \['instruction'\]"),
]


@pytest.mark.parametrize("what, text, expected", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_jsonl_data(what, text, expected, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected):
        load_alpaca_jsonl(path, ByteTokenizer(), 64)


def test_jsonl_data_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path .*nope.jsonl does not exist"):
        load_alpaca_jsonl(tmp_path / "nope.jsonl", ByteTokenizer(), 64)


def test_jsonl_responses_truncated_away(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"instruction": "x" * 500, "output": "y"}) + "\n")
    with pytest.raises(ValueError, match="every response was truncated away at seq_len=16; raise data.seq_len"):
        load_alpaca_jsonl(path, ByteTokenizer(), 16)


# ------------------------------------------------------------------ gpu-test.sh flags
CLI_CASES = [
    ([], "no target given"),
    (["nosuch"], "unknown target 'nosuch'"),
    (["quick", "--report-dir"], "--report-dir needs a directory, got ''"),
    (["quick", "--report-dir=--x"], "--report-dir needs a directory, got '--x'"),
    (["quick", "--report-dir", "--check-vram"], "--report-dir needs a directory, got '--check-vram'"),
    (["quick", "--lora-impl"], "--lora-impl needs a value"),
    (["quick", "--lora-impl", "no such"], "--lora-impl must be a name or package.module:factory, got 'no such'"),
    (["quick", "--backend", "cupy"], "--backend was replaced by --lora-impl"),
    (["quick", "--weights", "maybe"], "--weights must be auto, pretrained or random, got 'maybe'"),
    (["quick", "--weights"], "--weights needs a value"),
    (["multigpu", "--gpus", "0"], "--gpus must be a positive whole number, got '0'"),
    (["multigpu", "--gpus", "two"], "--gpus must be a positive whole number, got 'two'"),
    (["quick", "--baseline"], "--baseline needs a directory, got ''"),
    (["quick", "--frobnicate"], "unknown option '--frobnicate'"),
    (["compare", "onlyone"], "compare needs two run directories"),
    (["all", "extra"], "only one target allowed, got 'all' and 'extra'"),
    (["scorecard", "--jobs", "0"], "--jobs must be a positive whole number, got '0'"),
    (["scorecard", "--lora-impl", "a b"], "--lora-impl must be names separated by commas, got 'a b'"),
    (["scorecard", "--gpus", "2"], "unknown option '--gpus'"),
    (["history", "--html", "page.md"], "--html needs a path ending in .html, got 'page.md'"),
    (["history", "/nonexistent/reports"], "history: /nonexistent/reports does not exist (a run folder)"),
    (["history", "--since", "yesterday"], "unknown option '--since'"),
    (["history", "--html", "/proc/nowhere/h.html"], "history: cannot write /proc/nowhere/h.html"),  # issue 28
    (["selftest", "--report-dir", "out"], "selftest (the CPU tests) writes no run report"),  # issue 28: ignored
]


@pytest.mark.parametrize("args, expected", CLI_CASES, ids=[" ".join(a) or "(none)" for a, _ in CLI_CASES])
def test_gpu_test_sh_flags(args, expected, tmp_path):
    env = {**os.environ, "GPU_TEST_BOOTSTRAP_DRY_RUN": "0"}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-test.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-500:])
    assert expected in out.stderr, out.stderr
    assert not any(tmp_path.iterdir()), "a refused command wrote something"


# ------------------------------------------------------------------ --lora-impl values
IMPL_CASES = [
    ("", "expected a name"),
    ("   ", "expected a name"),
    ("nope", "'nope' is not known"),
    ("a b", "'a b' is not known"),
    ("pkg.mod:", "expected 'package.module:factory'"),
    (":make", "expected 'package.module:factory'"),
    ("../evil:x", "expected 'package.module:factory'"),
    ("os;rm -rf /:x", "expected 'package.module:factory'"),
    ("os:nonexistent", "cannot load 'nonexistent' from module 'os'"),
    ("lora_suite.nonexistent:make", "cannot load 'make' from module 'lora_suite.nonexistent'"),
    ("lora_suite.implementations:FEATURES", "gave a dict, not a lora_suite.implementations.LoRAImplementation"),
    ("json:dumps", "its factory 'dumps' raised TypeError"),
    ("json:JSONDecoder", "gave a type, not a lora_suite.implementations.LoRAImplementation"),
    ("peft-bnb-nope", "'peft-bnb-nope' is not known"),
]


@pytest.mark.parametrize("spec, expected", IMPL_CASES, ids=[repr(s) for s, _ in IMPL_CASES])
def test_lora_impl_values(spec, expected):
    with pytest.raises(ImplementationError, match=re.escape(expected)):
        resolve_implementation(spec)


# ------------------------------------------------------------------ adapter folders (PEFT format)
def _adapters():
    return {
        "model.layers.0.self_attn.q_proj.lora_A": nn.Parameter(torch.zeros(4, 16)),
        "model.layers.0.self_attn.q_proj.lora_B": nn.Parameter(torch.zeros(16, 4)),
    }


def _folder(tmp_path: Path, tensors: dict | None, config: str | None = '{"r": 4, "lora_alpha": 8}') -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    if config is not None:
        (d / "adapter_config.json").write_text(config)
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


PFX = "base_model.model.model.layers.0.self_attn.q_proj"
ADAPTER_CASES = [
    (
        "no config",
        {f"{PFX}.lora_A.weight": torch.zeros(4, 16), f"{PFX}.lora_B.weight": torch.zeros(16, 4)},
        None,
        "has no adapter_config.json: not a PEFT folder",
    ),
    ("config not JSON", {f"{PFX}.lora_A.weight": torch.zeros(4, 16)}, "{r: 4", "adapter_config.json is not valid JSON"),
    (
        "a key that fits no adapter",
        {
            f"{PFX}.lora_A.weight": torch.zeros(4, 16),
            f"{PFX}.lora_B.weight": torch.zeros(16, 4),
            "base_model.model.lm_head.lora_A.weight": torch.zeros(1),
        },
        None,
        "keys that fit no adapter ['base_model.model.lm_head.lora_A.weight']",
    ),
    (
        "an adapter without a key",
        {f"{PFX}.lora_A.weight": torch.zeros(4, 16)},
        None,
        f"adapters without a key ['{PFX}.lora_B.weight']",
    ),
    (
        "a wrong shape",
        {f"{PFX}.lora_A.weight": torch.zeros(8, 16), f"{PFX}.lora_B.weight": torch.zeros(16, 4)},
        None,
        f"{PFX}.lora_A.weight has shape (8, 16), the model's adapter (4, 16)",
    ),
    (
        "a transposed B",
        {f"{PFX}.lora_A.weight": torch.zeros(4, 16), f"{PFX}.lora_B.weight": torch.zeros(4, 16)},
        None,
        f"{PFX}.lora_B.weight has shape (4, 16), the model's adapter (16, 4)",
    ),
]


@pytest.mark.parametrize("what, tensors, config, expected", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_adapter_folder(what, tensors, config, expected, tmp_path):
    folder = _folder(tmp_path, tensors, None if what == "no config" else config or '{"r": 4, "lora_alpha": 8}')
    adapters = _adapters()
    before = {n: p.detach().clone() for n, p in adapters.items()}
    with pytest.raises((ImplementationError, ValueError)) as err:
        load_peft_tensors("peft", adapters, folder)
    assert expected in str(err.value), str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in adapters.items()), "a refused folder changed adapters"


def test_adapter_folder_without_weights(tmp_path):
    folder = _folder(tmp_path, None)
    with pytest.raises(Exception, match="adapter_model.safetensors"):
        load_peft_tensors("peft", _adapters(), folder)


def test_adapter_folder_with_a_corrupt_weights_file(tmp_path):
    folder = _folder(tmp_path, None)
    (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        load_peft_tensors("peft", _adapters(), folder)


# ------------------------------------------------------------------ checkpoints (adapters + optimizer + meta)
CHECKPOINT_CASES = [
    "missing directory",
    "meta removed",
    "meta not JSON",
    "adapter weights removed",
    "weights truncated",
    "optimizer state missing on resume",
    "adapters hold NaN",  # issue 28: checkpointed and resumed without a check
]


@pytest.mark.parametrize("what", CHECKPOINT_CASES)
def test_checkpoint(what, tmp_path, tiny_prepared):
    from lora_suite.engine.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint

    model, adapters, optimizer = tiny_prepared
    ckpt = save_adapter_checkpoint(
        model, tmp_path / "ckpt", step=7, optimizer=None if "optimizer" in what else optimizer
    )
    files = {p.name: p for p in Path(ckpt).iterdir()}
    meta = next((p for n, p in files.items() if n.endswith(".json") and "adapter_config" not in n), None)
    if what == "missing directory":
        target = tmp_path / "nowhere"
    else:
        target = Path(ckpt)
        if what == "meta removed":
            meta.unlink()
        elif what == "meta not JSON":
            meta.write_text("{broken")
        elif what == "adapter weights removed":
            files["adapter_model.safetensors"].unlink()
        elif what == "weights truncated":
            data = files["adapter_model.safetensors"].read_bytes()
            files["adapter_model.safetensors"].write_bytes(data[: len(data) // 2])
        elif what == "adapters hold NaN":
            from safetensors.torch import load_file, save_file

            from lora_suite.engine.checkpoint import MANIFEST_FILE

            weights = files["adapter_model.safetensors"]
            tensors = load_file(str(weights))
            next(iter(tensors.values()))[0, 0] = float("nan")
            save_file(tensors, str(weights), metadata={"format": "pt"})
            manifest = json.loads((target / MANIFEST_FILE).read_text())
            manifest["files"][weights.name] = {"bytes": weights.stat().st_size, "sha256": _sha(weights)}
            (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = {n: p.detach().clone() for n, p in adapters.items()}
    with pytest.raises(Exception) as err:
        load_adapter_checkpoint(model, target, optimizer=optimizer)
    msg = str(err.value)
    assert str(target) in msg or target.name in msg or "optimizer state" in msg, msg
    assert all(torch.equal(p, before[n]) for n, p in adapters.items()), "a refused checkpoint changed adapters"


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_adapters_holding_nan_are_not_checkpointed(tmp_path, tiny_prepared):
    from lora_suite.engine.checkpoint import save_adapter_checkpoint

    model, adapters, optimizer = tiny_prepared
    with torch.no_grad():
        next(iter(adapters.values()))[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not checkpointing step 7: 1 adapter\(s\) hold NaN/Inf"):
        save_adapter_checkpoint(model, tmp_path / "ckpt", step=7, optimizer=optimizer)
    assert not (tmp_path / "ckpt").exists()


@pytest.fixture
def tiny_prepared(tiny_cfg):
    from lora_suite.engine.optimizer import make_optimizer
    from lora_suite.engine.prepare import prepare

    p = prepare(tiny_cfg, "cpu", implementation="torch")
    return p.model, p.adapters, make_optimizer(p.model, tiny_cfg.train, p.adapters)


@pytest.mark.parametrize("impl", ["peft", "loralib", "torchtune"])
def test_an_adapter_folder_of_another_alpha(impl, tmp_path, tiny_cfg):
    """Issue 28: these implementations resumed a folder saved with another alpha without a word (lora_core's own
    loader refused it): the same tensors under another scale are another model."""
    from lora_suite.engine.prepare import prepare
    from lora_suite.implementations import ImplementationError

    prepared = prepare(tiny_cfg, "cpu", implementation=impl)
    prepared.implementation.save_adapter(prepared.model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["lora_alpha"] = 2 * config["lora_alpha"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ImplementationError, match=f"has lora_alpha={config['lora_alpha']!r}, the model's adapters"):
        prepared.implementation.load_adapter(prepared.model, tmp_path / "a")


# ------------------------------------------------------------------ report directories (compare, history)
def _run_dir(root: Path, name: str, report: dict | str | None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if report is not None:
        (d / "report.json").write_text(report if isinstance(report, str) else json.dumps(report))
    return d


REPORT_DIR_CASES = [
    ("compare: baseline missing", "missing", "ok", "absent-base does not exist (a run folder)"),  # issue 44
    ("compare: run missing", "ok", "missing", "absent-run does not exist (a run folder)"),
    ("compare: both empty", "empty", "empty", "nothing to compare"),
    ("compare: report not JSON", "broken", "ok", "report.json"),
    ("compare: two implementations", "peft", "ok", "only compares with runs of the same one"),
    # issue 28's battery: these passed with exit 0
    ("compare: baseline judged nothing", "nothing", "ok", "judged nothing (its report.json has no checks"),
    ("compare: baseline not an object", "list", "ok", "holds a JSON list, expected an object"),
    ("compare: baseline from a newer suite", "future", "ok", "schema_version 99; this suite reads 1 to 4"),
]


@pytest.mark.parametrize("what, base, run, expected", REPORT_DIR_CASES, ids=[c[0] for c in REPORT_DIR_CASES])
def test_report_dirs_for_compare(what, base, run, expected, tmp_path):
    outcome = {"test": "t::x", "outcome": "passed"}
    ok = {
        "schema_version": 3,
        "status": "complete",
        "checks": [],
        "outcomes": [outcome],
        "implementation": {"name": "cupy"},
    }
    kinds = {"ok": ok, "peft": {**ok, "implementation": {"name": "peft"}}, "broken": "{not json", "empty": None}
    kinds.update(nothing={**ok, "outcomes": []}, list=[ok], future={**ok, "schema_version": 99})

    def make(kind, name):
        return tmp_path / f"absent-{name}" if kind == "missing" else _run_dir(tmp_path, name, kinds[kind])

    b, r = make(base, "base"), make(run, "run")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-test.sh"), "compare", str(b), str(r)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert expected in out.stdout + out.stderr, (out.stdout[-800:], out.stderr[-800:])


HISTORY_CASES = [
    ("a directory without reports", "empty", "no report.json under"),
    ("a report that is not JSON", "broken", "not a readable report.json"),
    ("a report without a run time", "timeless", "no run time"),
    ("a report that is not an object", "list", "holds list, expected a JSON object"),
    ("a report from a newer suite", "future", "schema_version 7; this suite reads 1 to 4"),
]


@pytest.mark.parametrize("what, kind, expected", HISTORY_CASES, ids=[c[0] for c in HISTORY_CASES])
def test_report_dirs_for_history(what, kind, expected, tmp_path, capsys):
    from lora_suite.tools.history import main

    root = tmp_path / "reports"
    root.mkdir()
    if kind == "broken":
        _run_dir(root, "20261120T000000Z-quick", "{not json")
    elif kind == "timeless":
        _run_dir(root, "run", {"checks": []})
    elif kind == "list":
        _run_dir(root, "20261120T000000Z-quick", [1, 2])
    elif kind == "future":
        _run_dir(root, "20261120T000000Z-quick", {"schema_version": 7, "checks": []})
    assert main([str(tmp_path / "out" / "h.html"), str(root)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing written half"


# ------------------------------------------------------------------ multigpu launch options
@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"nproc": 0}, "nproc=0 must be >= 1"),
        ({"nproc": -2}, "nproc=-2 must be >= 1"),
        ({"nproc": 2, "mode": "zero3"}, "mode 'zero3' is not one of"),
        ({"nproc": 2, "mode": ""}, "mode '' is not one of"),
    ],
    ids=["nproc 0", "nproc -2", "mode zero3", "mode empty"],
)
def test_multigpu_launch_options(kw, expected, tmp_path):
    from lora_suite.scenarios.multigpu import launch_command

    with pytest.raises(ValueError, match=re.escape(expected)):
        launch_command(CONFIG_DIR / "multigpu.yaml", tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_multigpu_batch_that_does_not_split_over_the_ranks():
    from lora_suite.scenarios.multigpu import rank_rows

    with pytest.raises(ValueError, match="the global batch has 7 rows, not divisible by 2 ranks"):
        rank_rows({"input_ids": torch.zeros(7, 4)}, 0, 2)


# ------------------------------------------------------------------ the sharing scenario (issue 28)
SHARING_CASES = [
    (["churny"], "the phase must be pair, plants or churn, got 'churny'"),
    (["pair", "three"], "run counts must be whole numbers >= 0, got 'three'"),
    (["pair", "3", "-1"], "run counts must be whole numbers >= 0, got '-1'"),
    (["churn", "some"], "run counts must be whole numbers >= 0, got 'some'"),
]


@pytest.mark.parametrize("args, expected", SHARING_CASES, ids=[" ".join(a) for a, _ in SHARING_CASES])
def test_sharing_acceptance_arguments(args, expected, tmp_path):
    script = Path(__file__).resolve().parents[3] / "scripts" / "sharing-acceptance.sh"
    out = subprocess.run(["bash", str(script), str(tmp_path / "out"), *args], capture_output=True, text=True)
    assert out.returncode == 2 and expected in out.stderr, out.stderr
    assert not (tmp_path / "out").exists(), "nothing written before the arguments are checked"


CHURN_CASES = [
    (["--hold-gib", "-1"], "--hold-gib must be > 0, got -1.0"),
    (["--period-s", "0"], "--period-s must be > 0, got 0.0"),
    (["--churn-gib", "0.1"], "--churn-gib must be >= 0.25 (the smallest chunk), got 0.1"),
]


@pytest.mark.parametrize("args, expected", CHURN_CASES, ids=[" ".join(a) for a, _ in CHURN_CASES])
def test_memory_churn_arguments(args, expected, capsys):
    from lora_suite.scenarios.memory_churn import parse

    with pytest.raises(SystemExit) as exc:
        parse(args)
    assert exc.value.code == 2 and expected in capsys.readouterr().err


# ------------------------------------------------------------------ issue 28's findings in lora_core
def _second_inject():
    from lora_core import inject_lora
    from lora_suite.engine.models import build_random
    from tests.conftest import TINY_ARCH

    model = build_random(TINY_ARCH, torch.float32, "cpu")
    inject_lora(model, ("q_proj",), r=2, backend="torch")
    inject_lora(model, ("v_proj",), r=2, backend="torch")


def _nf4_near_the_float32_limit():
    from lora_core.nf4 import quantize_nf4

    quantize_nf4(torch.full((4, 64), 3.0e38))


def _nf4_into_an_integer_dtype():
    from lora_core.nf4 import dequantize_nf4, quantize_nf4

    dequantize_nf4(quantize_nf4(torch.randn(4, 64)), torch.int32)


def _local_path_without_a_config():
    import dataclasses
    import tempfile

    from lora_suite.core.loader import load_model_config
    from lora_suite.engine.models import build_model

    empty = tempfile.mkdtemp()
    cfg = dataclasses.replace(load_model_config("smollm2-135m", CONFIG_DIR), local_path=empty)
    build_model(cfg, "auto", torch.float32, "cpu")


def _peft_folder_of_lora_core(corrupt: str):
    import tempfile

    import lora_core
    from lora_suite.engine.models import build_random
    from tests.conftest import TINY_ARCH

    model = build_random(TINY_ARCH, torch.float32, "cpu")
    lora_core.inject_lora(model, ("q_proj",), r=2, backend="torch")
    folder = Path(tempfile.mkdtemp()) / "a"
    lora_core.save_peft_adapter(model, folder)
    if corrupt == "weights":
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (folder / "adapter_config.json").write_text("[1]")
    lora_core.load_peft_adapter(model, folder)


CORE_CASES = [
    ("a second inject_lora call", _second_inject, "already has 2 LoRA layer(s) (model.layers.0.self_attn.q_proj"),
    ("NF4 weights near the float32 limit", _nf4_near_the_float32_limit, "has values up to 3e+38: the double"),
    ("NF4 dequantised into int32", _nf4_into_an_integer_dtype, "dtype torch.int32 is not one of"),
    # issue 28: fell back to random weights without a word
    ("a local_path without config.json", _local_path_without_a_config, "holds no config.json (expected a Hugging"),
    # issue 28: library tracebacks that named no file
    (
        "lora_core reads truncated weights",
        lambda: _peft_folder_of_lora_core("weights"),
        "is not a readable safetensors",
    ),
    (
        "lora_core reads a config list",
        lambda: _peft_folder_of_lora_core("config"),
        "holds a JSON list, expected a PEFT",
    ),
]


@pytest.mark.parametrize("what, call, expected", CORE_CASES, ids=[c[0] for c in CORE_CASES])
def test_lora_core_inputs(what, call, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        call()


# ------------------------------------------------------------------ the count docs/reports.md states
def test_the_battery_has_150_cases(request):
    counts = {
        "tier YAML": len(TIER_CASES) + len(FILE_CASES) + 1,
        "model YAML": len(MODEL_CASES) + 1,
        "JSONL data": len(JSONL_CASES) + 2,
        "gpu-test.sh flags": len(CLI_CASES),
        "--lora-impl values": len(IMPL_CASES),
        "adapter folders": len(ADAPTER_CASES) + 2,
        "checkpoints": len(CHECKPOINT_CASES) + 4,
        "report dirs (compare, history)": len(REPORT_DIR_CASES) + len(HISTORY_CASES),
        "multigpu launch options": 5,
        "sharing scenario arguments": len(SHARING_CASES) + len(CHURN_CASES),
        "lora_core and model inputs": len(CORE_CASES),
    }
    print(json.dumps(counts), sum(counts.values()))
    assert sum(counts.values()) >= 150, counts
