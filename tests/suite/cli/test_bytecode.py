"""lora_suite.cli.bytecode on the CPU: where the suite's pytest processes keep compiled bytecode, and its warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

from lora_suite.cli import bytecode, targets


def test_an_interpreter_that_writes_bytecode_is_left_alone(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert bytecode.cache_folder(env) is None and bytecode.child_env(env) == env


def test_no_bytecode_asked_for_gets_the_suites_cache_folder(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path), "KEEP": "x"}
    out = bytecode.child_env(env)
    folder = tmp_path / "lora-suite" / "pycache"
    assert out == {"XDG_CACHE_HOME": str(tmp_path), "KEEP": "x", "PYTHONPYCACHEPREFIX": str(folder)}
    assert folder.is_dir() and "PYTHONDONTWRITEBYTECODE" in env  # the caller's mapping is not changed


def test_the_setting_picks_a_folder_or_leaves_the_interpreter_alone(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: str(tmp_path / "mine")}
    assert bytecode.child_env(env)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "mine")
    off = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: "off"}
    assert bytecode.child_env(off) == off
    own = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "theirs")}
    assert bytecode.child_env(own)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "theirs")


def test_a_folder_that_cannot_be_made_leaves_the_environment_and_says_so(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: str(blocker / "sub")}
    assert bytecode.child_env(env) == env
    assert f"bytecode not cached ({bytecode.ENV}={blocker / 'sub'}" in capsys.readouterr().err


def test_the_clis_pytest_processes_get_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(bytecode.ENV, raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = targets._child_env("quick")
    assert env["PYTHONPYCACHEPREFIX"] == str(Path(tmp_path) / "lora-suite" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in env


def test_the_set_up_compiles_the_packages_into_the_cache_once(tmp_path):
    src = tmp_path / "src" / "pkg_to_compile"
    (src / "sub").mkdir(parents=True)
    (src / "__init__.py").write_text("X = 1\n")
    (src / "sub" / "__init__.py").write_text("")
    (src / "sub" / "deep.py").write_text("Y = 2\n")
    (src / "tests").mkdir()
    (src / "tests" / "test_skipped.py").write_text("Z = 3\n")
    cache = tmp_path / "cache"
    env = bytecode.child_env(
        {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: str(cache), "PYTHONPATH": str(src.parent), "PATH": ""}
    )
    seconds = bytecode.compile_packages(sys.executable, env, ("pkg_to_compile", "no_such_package_here"))
    assert seconds is not None and seconds > 0
    mirror = cache / src.relative_to(src.anchor)  # the cache mirrors the sources' absolute paths
    compiled = sorted(p.name.split(".")[0] for p in mirror.rglob("*.pyc"))
    assert compiled == ["__init__", "__init__", "deep"], compiled  # the package's tests are not compiled
    assert bytecode.compile_packages(sys.executable, env, ("pkg_to_compile",)) is None  # once per interpreter


def test_no_cache_no_set_up(tmp_path):
    assert bytecode.compile_packages(sys.executable, {"PYTHONPATH": str(tmp_path)}) is None
