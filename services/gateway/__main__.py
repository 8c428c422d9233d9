"""`python -m harnessrl.services.gateway` (same as `harnessrl gateway`)."""

import sys

from harnessrl.services.gateway.cli import main

sys.exit(main())
