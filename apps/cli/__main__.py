"""`python -m harnessrl.apps.cli` is the same as `harnessrl`."""

import sys

from harnessrl.apps.cli import main

sys.exit(main())
