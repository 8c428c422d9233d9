"""`python -m harnessrl.services.inference` (same as `harnessrl inference`)."""

import sys

from harnessrl.services.inference.cli import main

sys.exit(main())
