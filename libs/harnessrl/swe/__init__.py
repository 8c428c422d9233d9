"""Coding tasks for training coding agents: SWE-bench-format tasks (`tasks`), the checks
that clean them without an environment (`clean`), candidate bugs by AST mutation (`mutate`)."""
