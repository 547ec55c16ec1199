"""`python -m thunderep.cli`: the `thunderep` command."""

from . import entry

entry()
