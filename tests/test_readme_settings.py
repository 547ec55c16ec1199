"""The settings table (docs/guide/kernels.md, "Settings") names every THUNDEREP_* environment variable the
package reads, and only those."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_environment_variable_is_documented():
    read = set()
    for path in (ROOT / "thunderep").rglob("*.py"):
        read |= set(re.findall(r"\"(THUNDEREP_[A-Z0-9_]+)\"", path.read_text()))
    page = (ROOT / "docs" / "guide" / "kernels.md").read_text()
    table = page[page.index("## Settings"):]
    documented = set(re.findall(r"^\| `(THUNDEREP_[A-Z0-9_]+)", table, re.MULTILINE))
    assert read, "no THUNDEREP_* variables found: the search is broken"
    assert read == documented, (f"read but not documented: {read - documented}; "
                                f"documented but not read: {documented - read}")
