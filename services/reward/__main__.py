"""`python -m harnessrl.services.reward` (same as `harnessrl reward`)."""

import sys

from harnessrl.services.reward.cli import main

sys.exit(main())
