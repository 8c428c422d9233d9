"""The harnessrl services, one package per service (`harnessrl.services.<name>`).

Each service package holds `__main__.py` (entry point only), `config.py` (its settings
section), `service.py` (lifecycle and wiring) and its domain modules. This directory is
the package `harnessrl.services` (pyproject.toml maps it).
"""
