"""What the extension builders (`build_mailbox.py`, `build_probe.py`, `build_host.py`) share: paths as setuptools
or a direct build wants them, compiling an FFI into a folder without ever exposing a half-written file, and
the in-place build a builder runs as a script."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from cffi import FFI

__all__ = ["build_in_place", "compile_into", "set_native_source", "source_path"]

NATIVE_DIR = Path(__file__).resolve().parent


def source_path(p: Path, relative: bool) -> str:
    """p as setuptools wants it (relative to setup.py's directory) or as a direct build does (absolute)."""
    return os.path.relpath(p) if relative else str(p)


def set_native_source(ffi: FFI, module: str, stem: str, relative: bool, depends: tuple[str, ...] = (),
                      **options) -> None:
    """`ffi.set_source` for `<stem>.c` of this folder as `module`: its header `<stem>.h` included; rebuilt
    when the header, the builder or another file it needs (`depends`) or this file changes (which also puts
    them into source distributions); built for the limited API (the same .abi3.so however it is built).
    `options`: the compile and link settings."""
    ffi.set_source(
        module, f'#include "{stem}.h"\n',
        sources=[source_path(NATIVE_DIR / f"{stem}.c", relative)],
        include_dirs=[source_path(NATIVE_DIR, relative)],
        depends=[source_path(NATIVE_DIR / name, relative) for name in (f"{stem}.h", *depends, "build_common.py")],
        py_limited_api=True,
        **options,
    )


def compile_into(ffi: FFI, stem: str, target_dir: Path | str, verbose: bool = False) -> Path:
    """Compile `ffi` (the extension `_{stem}_native`) and move it into `target_dir`; return its path.

    The build runs in a temporary directory and the result is renamed into place, so concurrent
    builders never expose a half-written file; older builds of the extension there are removed (they
    would shadow this one).
    """
    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tep-build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=verbose))
        dest = target_dir / built.name
        staging = target_dir / f".{built.name}.{os.getpid()}.tmp"
        shutil.copyfile(built, staging)
        os.chmod(staging, 0o755)
        os.replace(staging, dest)
    for other in target_dir.glob(f"_{stem}_native*.so"):
        if other != dest:
            other.unlink()
    return dest


def build_in_place(build: Callable[..., Path], subpackage: str) -> None:
    """A builder run as a script: its extension built into `thunderep/<subpackage>/` of this checkout."""
    out = build(NATIVE_DIR.parent / "thunderep" / subpackage, verbose="-v" in sys.argv)
    print(f"built {out.relative_to(NATIVE_DIR.parent)}")
