"""cffi builder of the private extension `thunderep.moe._host_native` (host experts on native threads).

Three ways in:
  * `pip install .` / `pip install -e .`: setup.py names `ffibuilder` in `cffi_modules`;
  * `python native/build_host.py`: builds in place, into `thunderep/moe/`, for development;
  * `thunderep.moe.host_native` calls `build(target_dir)` on first use when the extension is missing from a
    source checkout and a C compiler is present.

Only `thunderep/moe/host_native.py` imports the extension; without it host jobs run as TorchScript
(`thunderep.moe.host_summed`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the builders' shared helper, beside them
from build_common import build_in_place, compile_into, set_native_source  # noqa: E402

__all__ = ["CDEF", "MODULE_NAME", "NATIVE_DIR", "build", "ffibuilder", "make_ffibuilder"]

MODULE_NAME = "thunderep.moe._host_native"
NATIVE_DIR = Path(__file__).resolve().parent

# The declarations are host_experts.h's own, its preprocessor lines left out (cffi parses none).
CDEF = "\n".join(line for line in (NATIVE_DIR / "host_experts.h").read_text().splitlines()
                  if not line.lstrip().startswith("#"))


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """Return an FFI configured to compile `host_experts.c` into `MODULE_NAME`."""
    ffi = FFI()
    ffi.cdef(CDEF)
    set_native_source(ffi, MODULE_NAME, "host_experts", relative_paths, ("build_host.py",),
                      # -O3: the dot products' eight accumulators vectorize (an AVX2 clone beside the baseline
                      # on x86-64: host_experts.c's TEP_CLONES)
                      extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-pthread"], extra_link_args=["-pthread"],
                      libraries=["m"])
    return ffi


def build(target_dir: Path | str, verbose: bool = False) -> Path:
    """Compile the extension into `target_dir` (`build_common.compile_into`); return its path."""
    return compile_into(make_ffibuilder(relative_paths=False), "host", target_dir, verbose)


ffibuilder = make_ffibuilder(relative_paths=True)


if __name__ == "__main__":
    build_in_place(build, "moe")
