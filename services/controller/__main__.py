"""`python -m harnessrl.services.controller` (same as `harnessrl controller`)."""

import sys

from harnessrl.services.controller.cli import main

sys.exit(main())
