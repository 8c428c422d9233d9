"""Coding tasks for training coding agents: SWE-bench-format tasks (`tasks`), the checks
that clean them without an environment (`clean`), the pinned projects tasks are synthesized
from (`projects`) as git repositories (`fetch`) with their test environments and baselines
(`env`), candidate bugs by AST mutation (`mutate`), problem statements written from what
fails (`statement`)."""
