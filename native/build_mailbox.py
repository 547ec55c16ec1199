"""cffi builder of the private extension `thunderep.comm._mailbox_native` (the mailbox's C core).

Three ways in:
  * `pip install .` / `pip install -e .`: setup.py names `ffibuilder` in `cffi_modules`;
  * `python native/build_mailbox.py`: builds in place, into `thunderep/comm/`, for development;
  * `thunderep.comm.mailbox` calls `build(target_dir)` on first use when the extension is missing
    from a source checkout and a C compiler is present.

Only `thunderep/comm/mailbox.py` imports the extension.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the builders' shared helper, beside them
from build_common import build_in_place, compile_into, set_native_source  # noqa: E402

__all__ = ["MODULE_NAME", "NATIVE_DIR", "CDEF", "make_ffibuilder", "build", "ffibuilder"]

MODULE_NAME = "thunderep.comm._mailbox_native"
NATIVE_DIR = Path(__file__).resolve().parent

# Declarations mirrored from mailbox.h (cffi parses no preprocessor directives).
CDEF = """
#define TEP_MAGIC ...
#define TEP_VERSION ...
#define TEP_MAX_WORLD ...
#define TEP_MAX_SLOT_SIZE ...

typedef enum {
    TEP_OK, TEP_ERR_ARG, TEP_ERR_SYS, TEP_ERR_TIMEOUT, TEP_ERR_PEER_CLOSED, TEP_ERR_PEER_DEAD,
    TEP_ERR_DESYNC, TEP_ERR_LENGTH, TEP_ERR_MAGIC, TEP_ERR_VERSION, TEP_ERR_WORLD, TEP_ERR_SLOT,
    TEP_ERR_SIZE, TEP_ERR_GENERATION, TEP_ERR_OWNER, TEP_ERR_TOO_LARGE, TEP_ERR_ROUND,
    TEP_ERR_RANK_TAKEN, TEP_ERR_CHECKSUM, ...
} tep_status;

typedef enum { TEP_RANK_EMPTY, TEP_RANK_ATTACHED, TEP_RANK_CLOSED, ... } tep_rank_state;

typedef struct {
    int32_t rank;
    uint32_t pid;
    uint32_t state;
    int32_t os_errno;
    uint64_t peer_round;
    uint64_t found;
    uint64_t waited_ns;
} tep_diag;

typedef struct {
    uint64_t seq;
    uint64_t round;
    uint64_t generation;
    uint64_t length;
    uint64_t payload;
} tep_cell_layout;

typedef struct tep_mailbox tep_mailbox;

int tep_create(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t generation, tep_mailbox **out, tep_diag *diag);
int tep_attach(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t expected_generation, tep_mailbox **out, tep_diag *diag);
int tep_unlink(const char *name, tep_diag *diag);
void tep_close(tep_mailbox *mb);
int tep_publish(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length);
int tep_collect(tep_mailbox *mb, uint64_t round, void *out, uint32_t out_stride, uint32_t *lengths,
                uint32_t expect_length, uint64_t timeout_ns, tep_diag *diag);
int tep_exchange(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length, void *out,
                 uint32_t *lengths, uint64_t timeout_ns, tep_diag *diag);
int tep_reserve_external(tep_mailbox *mb, uint64_t round, tep_cell_layout *layout,
                         uint64_t *seq_even, uint64_t *generation, tep_diag *diag);
void *tep_base(const tep_mailbox *mb);
uint64_t tep_size(const tep_mailbox *mb);
uint64_t tep_generation(const tep_mailbox *mb);
uint64_t tep_last_round(const tep_mailbox *mb);
uint32_t tep_world_size(const tep_mailbox *mb);
uint32_t tep_rank(const tep_mailbox *mb);
uint32_t tep_slot_size(const tep_mailbox *mb);
int tep_peer_info(const tep_mailbox *mb, uint32_t rank, tep_diag *diag);
void tep_set_backoff(tep_mailbox *mb, uint64_t spin_ns, uint64_t yield_ns, uint64_t sleep_max_ns);
void tep_set_checksum(tep_mailbox *mb, int on);
uint64_t tep_xxh3(const void *data, uint64_t length, uint64_t seed);
uint64_t tep_segment_size(uint32_t world_size, uint32_t slot_size);
"""


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """Return an FFI configured to compile `mailbox.c` into `MODULE_NAME`."""
    ffi = FFI()
    ffi.cdef(CDEF)
    set_native_source(ffi, MODULE_NAME, "mailbox", relative_paths,
                      ("build_mailbox.py", "third_party/xxhash/xxhash.h"),
                      extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
                      libraries=["rt"] if sys.platform.startswith("linux") else [])
    return ffi


def build(target_dir: Path | str, verbose: bool = False) -> Path:
    """Compile the extension into `target_dir` (`build_common.compile_into`); return its path."""
    return compile_into(make_ffibuilder(relative_paths=False), "mailbox", target_dir, verbose)


ffibuilder = make_ffibuilder(relative_paths=True)


if __name__ == "__main__":
    build_in_place(build, "comm")
