"""harnessrl: reinforcement learning through the real agent harness."""

__version__ = "0.1.0"
