"""Reading a config file's YAML strictly: PyYAML's safe loader, except that a key given twice in one mapping is an
error (PyYAML keeps the last one silently, so a duplicated section would win without a word)."""

from __future__ import annotations

from pathlib import Path

import yaml

from lora_suite.settings.config import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[object, int] = {}  # key -> its line (0-based)
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"the key {key!r} is given twice (line {seen[key] + 1} and line {key_node.start_mark.line + 1}); "
                    "YAML would keep only the last one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    """The YAML document of ``path``; a ConfigError names an unreadable file, malformed YAML or a repeated key."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {_one_line(exc)}") from None


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line: where (line and column, 1-based) and what, without its quoted source lines."""
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
    if mark is None or not what:
        return " ".join(str(exc).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
