"""`harnessrl chaos`: faults injected into a training stack, and the books balanced."""

KILLABLE = ("inference", "gateway", "reward", "sample-builder", "trainer", "controller")
"""Every service but the broker (the embedded one keeps its data in memory only)."""
