"""Policy weights from the trainer to inference replicas over the WeightSync gRPC contract.

Trainer side: WeightSyncServer(settings).publish(version, step, state_dict).
Engine side: WeightSyncClient(address).fetch(version) -> FetchResult (verified tensors).
vLLM: harnessrl.weights.vllm_worker (a worker extension and the pause/update/resume driver).

Importing this package imports torch; nothing under harnessrl.apps.cli imports it at module level.
"""

from harnessrl.weights.allocator import tune_malloc
from harnessrl.weights.checksums import ALGORITHMS, DEFAULT_ALGORITHM, digest
from harnessrl.weights.client import FetchResult, WeightSyncClient
from harnessrl.weights.errors import WeightSyncError
from harnessrl.weights.manifest import build_manifest, manifest_checksum, verify_manifest
from harnessrl.weights.server import WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FetchResult",
    "WeightSyncClient",
    "WeightSyncError",
    "WeightSyncServer",
    "WeightSyncSettings",
    "build_manifest",
    "digest",
    "manifest_checksum",
    "tune_malloc",
    "verify_manifest",
]
