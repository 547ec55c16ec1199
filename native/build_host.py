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
from build_common import build_in_place, compile_into, source_path  # noqa: E402

__all__ = ["CDEF", "MODULE_NAME", "NATIVE_DIR", "build", "ffibuilder", "make_ffibuilder"]

MODULE_NAME = "thunderep.moe._host_native"
NATIVE_DIR = Path(__file__).resolve().parent

# Declarations mirrored from host_experts.h (cffi parses no preprocessor directives).
CDEF = """
enum { TEP_HX_F32 = 0, TEP_HX_BF16 = 1, TEP_HX_F16 = 2 };
enum { TEP_HX_SILU = 0, TEP_HX_GELU = 1, TEP_HX_GELU_TANH = 2, TEP_HX_RELU = 3 };
enum { TEP_HX_PENDING = 0, TEP_HX_DONE = 1, TEP_HX_NO_STAMP = 2, TEP_HX_BAD_SLOT = 3, TEP_HX_NO_MEMORY = 4,
       TEP_HX_UNKNOWN = 5 };
typedef struct tep_hx_job {
    const int64_t *ids;
    const void *w;
    const void *x;
    const uint8_t *hot;
    const void *gate_up;
    const void *down;
    const void *gate_up_bias;
    const void *down_bias;
    float *out;
    volatile uint32_t *ready;
    volatile uint32_t *flag;
    int64_t T, K, D, I, S;
    int64_t spins;
    uint32_t stamp, number;
    int dtype, x_dtype, w_dtype, act, interleaved;
} tep_hx_job;
typedef struct tep_hx tep_hx;
tep_hx *tep_hx_create(int threads);
void tep_hx_destroy(tep_hx *hx);
int64_t tep_hx_submit(tep_hx *hx, const tep_hx_job *job);
int tep_hx_state(tep_hx *hx, int64_t ticket);
int tep_hx_wait(tep_hx *hx, int64_t ticket, double timeout_s);
void tep_hx_raise(volatile uint32_t *flag, uint32_t number);
"""


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """Return an FFI configured to compile `host_experts.c` into `MODULE_NAME`."""
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE_NAME,
        '#include "host_experts.h"\n',
        sources=[source_path(NATIVE_DIR / "host_experts.c", relative_paths)],
        include_dirs=[source_path(NATIVE_DIR, relative_paths)],
        depends=[source_path(NATIVE_DIR / name, relative_paths) for name in ("host_experts.h", "build_host.py", "build_common.py")],
        # -O3: the dot products' eight accumulators vectorize (an AVX2 clone beside the baseline on x86-64:
        # host_experts.c's TEP_CLONES)
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-pthread"],
        extra_link_args=["-pthread"],
        libraries=["m"],
        py_limited_api=True,  # the same file name (.abi3.so) however it is built
    )
    return ffi


def build(target_dir: Path | str, verbose: bool = False) -> Path:
    """Compile the extension into `target_dir` (`build_common.compile_into`); return its path."""
    return compile_into(make_ffibuilder(relative_paths=False), "host", target_dir, verbose)


ffibuilder = make_ffibuilder(relative_paths=True)


if __name__ == "__main__":
    build_in_place(build, "moe")
