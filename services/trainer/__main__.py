"""`python -m harnessrl.services.trainer` (same as `harnessrl trainer`)."""

import sys

from harnessrl.services.trainer.cli import main

sys.exit(main())
