"""Buckets: the static shapes graphs are compiled for.

    selection.py  which bucket a piece of work runs in (compiler and runtime)
    planner.py    which sizes to build for a workload (`buckets.auto`, `graphc plan`)
"""
