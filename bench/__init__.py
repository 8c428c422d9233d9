"""Benchmarks run by `harnessrl bench <name>`; each prints JSON figures, last line one object.

Importable as `harnessrl.bench` through the link libs/harnessrl/bench.
"""
