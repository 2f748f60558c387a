"""Benchmarks run with ``python -m bench <name>``; see ``bench/__main__.py`` for the convention."""
