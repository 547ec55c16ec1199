"""`python -m thunderep.doctor [--json] [--root PATH]`: the same as `thunderep doctor`."""

import sys

from . import main

sys.exit(main())
