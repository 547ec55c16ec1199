"""cffi builder of the private extension `thunderep.balance._probe_native` (the balancer probe's loops).

Three ways in:
  * `pip install .` / `pip install -e .`: setup.py names `ffibuilder` in `cffi_modules`;
  * `python native/build_probe.py`: builds in place, into `thunderep/balance/`, for development;
  * `thunderep.balance.probe_math` calls `build(target_dir)` on first use when the extension is
    missing from a source checkout and a C compiler is present.

Only `thunderep/balance/probe_math.py` imports the extension; without it the probe computes the same
values with its numpy / torch reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the builders' shared helper, beside them
from build_common import build_in_place, compile_into, set_native_source  # noqa: E402

__all__ = ["CDEF", "MODULE_NAME", "NATIVE_DIR", "build", "ffibuilder", "make_ffibuilder"]

MODULE_NAME = "thunderep.balance._probe_native"
NATIVE_DIR = Path(__file__).resolve().parent

# Declarations mirrored from probe.h (cffi parses no preprocessor directives).
CDEF = """
enum { TEP_PROBE_OK, TEP_PROBE_UNHANDLED, ... };

int tep_probe_ema_i64(const int64_t *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n);
int tep_probe_ema_f64(const double *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n);
int tep_probe_load(const double *ema, int64_t n, int32_t *load, double *load_f);
int tep_probe_plain(const double *c, int64_t n, double width, double cold, int16_t *codes,
                    uint64_t seed, uint64_t *hash);
int tep_probe_relative(const double *c, int64_t n, const double *counts_b, const double *x_b,
                       const double *code_b, double total_b, double variance_b, double variance,
                       double z, double width, double cold, int16_t *codes, uint64_t seed,
                       uint64_t *hash);
"""


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """Return an FFI configured to compile `probe.c` into `MODULE_NAME`."""
    ffi = FFI()
    ffi.cdef(CDEF)
    set_native_source(ffi, MODULE_NAME, "probe", relative_paths, ("build_probe.py", "third_party/xxhash/xxhash.h"),
                      # probe.c's bounds assume IEEE double steps: no FMA contraction, no value-changing
                      # optimizations.
                      extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffp-contract=off", "-fno-fast-math",
                                          "-fno-math-errno"])
    return ffi


def build(target_dir: Path | str, verbose: bool = False) -> Path:
    """Compile the extension into `target_dir` (`build_common.compile_into`); return its path."""
    return compile_into(make_ffibuilder(relative_paths=False), "probe", target_dir, verbose)


ffibuilder = make_ffibuilder(relative_paths=True)


if __name__ == "__main__":
    build_in_place(build, "balance")
