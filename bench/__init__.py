"""Benches, not tests: each measures and prints figures (tests never time anything). Run one from the
repository root as ``.venv/bin/python -m bench.NAME`` (its docstring says the options); testkit/ and the
packages are imported from the checkout, no sys.path edits."""
