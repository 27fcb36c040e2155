"""Fixtures of the tests of :mod:`tokenmdp.testing` (one intra-op thread: see tests/conftest.py)."""
