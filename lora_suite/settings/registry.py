"""The tier registry: every YAML in configs/ with a ``suite:`` section is a tier (``SuiteEntry``), run from its test
folder under tiers/ with its pytest marker. Adding a tier is one YAML and one test folder; the command line
(``lora-suite <tier>``), ``all``, ``--help`` and the plugin's markers all read this registry.

Where tiers are found: ``$LORA_SUITE_TIERS_DIR`` if set; else a checkout's ``tiers/`` beside the package; else
the copy shipped inside the installed package (``lora_suite/tiers``), as configs are (``core.config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_suite.settings.config import CONFIG_DIR, ConfigError, SuiteEntry, find_data_dir
from lora_suite.settings.loader import load_tier_config
from lora_suite.settings.yaml_io import read_yaml

TIERS_ENV = "LORA_SUITE_TIERS_DIR"


def find_tiers_dir() -> Path:
    """Where the tiers' test folders are (module docstring)."""
    return find_data_dir(TIERS_ENV, "tiers")


@dataclass(frozen=True)
class RegisteredTier:
    name: str
    entry: SuiteEntry
    config: Path  # its YAML
    tests_dir: Path  # its test folder

    @property
    def marker(self) -> str:
        return self.entry.marker or self.name


def registry(config_dir: Path | None = None, tiers_dir: Path | None = None) -> dict[str, RegisteredTier]:
    """name -> tier, in ``order`` (then name): the tiers whose YAML loads. A broken one is left out here and named by
    ``broken_tiers`` (a broken tier YAML breaks that tier only: ``--help`` and the other tiers still work)."""
    return scan(config_dir, tiers_dir)[0]


def broken_tiers(config_dir: Path | None = None, tiers_dir: Path | None = None) -> dict[str, str]:
    """name (the YAML's stem) -> the ConfigError of each tier YAML that does not load, or YAML that does not parse."""
    return scan(config_dir, tiers_dir)[1]


def scan(config_dir: Path | None = None, tiers_dir: Path | None = None):
    """(tiers, broken): every YAML in ``config_dir`` with a ``suite:`` section, loaded, or its error. A tier whose
    test folder is missing, or whose ``tier:`` is not its file's name, is broken with an error naming both."""
    config_dir = Path(config_dir or CONFIG_DIR)
    tiers_dir = Path(tiers_dir or find_tiers_dir())
    found, broken = [], {}
    for path in sorted(config_dir.glob("*.yaml")):
        try:
            raw = read_yaml(path)
            if not isinstance(raw, dict) or "suite" not in raw:
                continue
            found.append(_load(path, config_dir, tiers_dir))
        except ConfigError as exc:
            broken[path.stem] = str(exc)
    found.sort(key=lambda t: (t.entry.order, t.name))
    return {t.name: t for t in found}, broken


def _load(path: Path, config_dir: Path, tiers_dir: Path) -> RegisteredTier:
    cfg = load_tier_config(path, config_dir)
    suite = cfg.suite
    if suite is None:  # `suite:` given but empty: a tier YAML that says nothing of the tier
        raise ConfigError(f"{path}.suite: null; expected the tier's entry (description, order, figures)")
    tests_dir = tiers_dir / (suite.tests or cfg.tier)
    if not tests_dir.is_dir():
        raise ConfigError(
            f"{path}.suite.tests: the tier {cfg.tier!r} runs the tests in {tests_dir}, which is not a folder; "
            "a tier is its YAML plus one test folder under tiers/"
        )
    if cfg.tier != path.stem:
        raise ConfigError(f"{path}.tier: {cfg.tier!r}; a tier's YAML is named for it: expected {path.stem!r}")
    return RegisteredTier(cfg.tier, suite, path, tests_dir)
