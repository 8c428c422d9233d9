"""Benchmarks run by `harnessrl bench <name>`; each prints JSON figures, last line one object.

This directory is the package `harnessrl.bench` (pyproject.toml maps it).
"""
