"""harnessrl experiment: evaluate, train for a fixed budget, evaluate again, report."""
