"""`harnessrl chaos`: faults injected into a training stack, and the books balanced."""

from harnessrl import registry

KILLABLE = registry.killable()
"""Every service `up` starts but the broker (the embedded one keeps its data in memory
only), as the registry marks them."""
