"""The trainer pods' startup, liveness and readiness probe: `python healthz.py PORT`.

One pod template serves every node, and only node rank 0 runs a service: global rank 0
(Kafka, checkpoints, WeightSync, /healthz on PORT). There the probe is that service's
GET /healthz, failing unless it answers 2xx. The other nodes serve nothing; their health
is torchrun's, which exits (so the container restarts) when any rank fails, and theirs
fail when rank 0 does (their collectives with it break).
"""

import os
import sys
import urllib.request

if os.environ["NODE_RANK"] == "0":
    # urlopen raises on anything but 2xx (and when nothing listens): python exits 1.
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=4).close()
