"""The fuzzer: targets for what takes outside input and the harness that runs them.

A test tool, run as ``python -m tests.fuzz`` (``__main__.py`` says how); tests/test_bad_inputs.py
runs the same targets, small and seeded. No module here is a test file: pytest collects none.
"""
