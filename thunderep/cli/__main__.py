"""`python -m thunderep.cli`: the `thunderep` command."""

import sys

from . import main

sys.exit(main())
