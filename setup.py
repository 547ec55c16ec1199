"""Build hook for the mailbox extension; all other metadata lives in pyproject.toml.

`pip install .` compiles `native/mailbox.c` through cffi into `thunderep.comm._mailbox_native`. When
that cannot happen (no cffi at build time, no C compiler, a compile error) the package still installs:
a warning is printed and thunderep uses the collective control plane (or builds the extension on first
use if a compiler appears later in a source checkout).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

_WARNING = """
********************************************************************************
thunderep: the shared-memory mailbox extension was NOT built ({reason}).
thunderep is installed and works; its control plane falls back to torch.distributed
collectives, which are slower on one host. To get the mailbox, install a C compiler
(e.g. `apt install gcc`, `xcode-select --install`) and reinstall thunderep.
********************************************************************************
"""


_warned = False


def _warn(reason: object) -> None:
    global _warned
    if not _warned:
        _warned = True
        sys.stderr.write(_WARNING.format(reason=reason))


class OptionalBuildExt(build_ext):
    """build_ext whose failures are warnings: the extension is an accelerator, not a requirement."""

    _failed: set[str] = set()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, platform unsupported, cffi codegen failure
            _warn(f"{type(exc).__name__}: {exc}")

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, DistutilsExecError, LinkError, OSError, ...
            self._failed.add(ext.name)
            _warn(f"building {ext.name} failed: {type(exc).__name__}: {exc}")

    def _built(self) -> list:
        return [e for e in self.extensions if e.name not in self._failed]

    def copy_extensions_to_source(self) -> None:  # editable installs: skip what did not build
        all_exts, self.extensions = self.extensions, self._built()
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = all_exts

    def get_outputs(self) -> list[str]:
        all_exts, self.extensions = self.extensions, self._built()
        try:
            return super().get_outputs()
        finally:
            self.extensions = all_exts


_cffi_modules: list[str] = []
if not Path(__file__).with_name("native").joinpath("build_mailbox.py").is_file():
    _warn("native/build_mailbox.py is missing from this source tree")
else:
    try:
        import cffi  # noqa: F401  (build requirement; absent only with --no-build-isolation)
    except ImportError as exc:
        _warn(f"cffi is not importable at build time: {exc}")
    else:
        _cffi_modules = ["native/build_mailbox.py:ffibuilder"]
        if Path(__file__).with_name("native").joinpath("build_probe.py").is_file():
            _cffi_modules.append("native/build_probe.py:ffibuilder")  # the balancer probe's loops
        if Path(__file__).with_name("native").joinpath("build_host.py").is_file():
            _cffi_modules.append("native/build_host.py:ffibuilder")  # host experts on native threads

setup(cmdclass={"build_ext": OptionalBuildExt}, cffi_modules=_cffi_modules)
