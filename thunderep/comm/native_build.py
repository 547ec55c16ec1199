"""Building a native extension on first use, for a source checkout whose install did not build it: the
mailbox (`comm.mailbox`) and the balancer's probe loop (`balance.probe_math`). One build per source
version, machine and Python, in the user's cache, under a lock, so that ranks starting together build once.
Only the one module that wraps an extension calls this; nothing here imports it."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..env import no_native_build

__all__ = ["build_on_first_use"]

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"


def build_on_first_use(stem: str, module_name: str, sources: tuple[str, ...], import_error: ImportError,
                       fix: str, error: type[Exception]) -> Any:
    """Build `native/build_{stem}.py`'s extension (`_{stem}_native`) into the cache and import it as
    `module_name`; `error` (the caller's exception type) saying why not, and `fix`, otherwise. `sources`:
    the files under native/ whose bytes key the build."""
    what = f"the {stem} extension"
    builder = NATIVE_DIR / f"build_{stem}.py"
    if no_native_build():
        raise error(f"{what} is missing ({import_error}) and THUNDEREP_NO_NATIVE_BUILD is set; {fix}")
    if not builder.is_file():
        raise error(f"{what} was not built when thunderep was installed ({import_error}); {fix}")
    if not any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "cc", "gcc", "clang")):
        raise error(f"{what} is missing ({import_error}) and no C compiler was found to build it; {fix}")
    key = hashlib.sha256()
    for name in sources:
        key.update((NATIVE_DIR / name).read_bytes())
    key.update(sys.implementation.cache_tag.encode() + os.uname().machine.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "thunderep" / "native" / key.hexdigest()[:16]
    try:
        target.mkdir(parents=True, exist_ok=True)
        with open(target / ".lock", "w") as lock:  # ranks starting together build once
            fcntl.flock(lock, fcntl.LOCK_EX)
            built = sorted(target.glob(f"_{stem}_native*.so"))
            if not built:
                spec = importlib.util.spec_from_file_location(f"_tep_build_{stem}", builder)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                built = [module.build(target)]
        spec = importlib.util.spec_from_file_location(module_name, built[0])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as exc:  # compiler errors come in many types (cffi, setuptools, OSError)
        raise error(f"{what} is missing and building it failed ({type(exc).__name__}: {exc}); {fix}") from exc
    sys.modules[module_name] = mod
    return mod
