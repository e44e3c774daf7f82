"""Fixtures of the engine's CPU tests: ``one_thread`` is in tests/conftest.py, shared with the implementations'."""
