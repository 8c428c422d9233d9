"""`python -m harnessrl` is the same as `harnessrl`."""

import sys

from harnessrl.cli import main

sys.exit(main())
