"""Helpers the test modules share, one module per job; no test module imports another (tests/test_layering.py)."""
