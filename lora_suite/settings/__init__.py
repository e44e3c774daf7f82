"""Shared types and configs: the frozen dataclasses, the strict YAML loader, the tier registry."""
