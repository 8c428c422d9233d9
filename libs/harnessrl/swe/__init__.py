"""Coding tasks for training coding agents: candidate bugs by AST mutation (`mutate`)."""
