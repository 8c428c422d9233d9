"""`python -m harnessrl.services.sample_builder` (same as `harnessrl sample-builder`)."""

import sys

from harnessrl.services.sample_builder.cli import main

sys.exit(main())
