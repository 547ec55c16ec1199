/*
 * ThunderEP mailbox: a shared-memory control plane for the ranks of one host.
 *
 * One POSIX shared-memory segment per process group. Layout (every block 64-byte aligned):
 *
 *   tep_header                        magic, version, world size, slot size, generation, sizes
 *   slot[0] .. slot[world_size - 1]   one per rank:
 *       tep_rank_info                 pid, state (attached / closed), identity for liveness checks
 *       tep_cell[0], tep_cell[1]      two seqlocked records, indexed by round parity
 *
 * A cell is a seqlock: `seq` is odd while its writer is inside, even otherwise; the writer stores
 * round, generation, length, flags, checksum and payload between the two increments. A reader copies
 * the record and accepts it only if `seq` was even and unchanged around the copy, the cell's round is
 * the round it asked for, its generation is the segment's and, when the record carries one, the XXH3
 * checksum of the copied payload (seeded by generation and round) is the one its writer computed from
 * its own buffer. The seqlock catches torn writes; the checksum catches bytes changed in the segment by
 * anything else. Records written by a CUDA stream (tep_reserve_external) carry no checksum. Rank r
 * writes only its own slot.
 *
 * Why two cells per rank: after rank r has collected round n it may publish round n+1 at once, while
 * a slower peer is still copying r's round-n record. Round n+1 goes to the other cell, so nothing a
 * peer may still read is overwritten; round n+2 can only be published after every peer published
 * n+1, which each does only after it finished collecting round n.
 *
 * Waits poll with a pause instruction, then sched_yield, then block on a futex word in the header that
 * every publish and close bumps (Linux; short sleeps elsewhere), so more ranks than cores still
 * progress and long waits burn no CPU. Every wait is bounded by a timeout; a peer whose process
 * exited or that closed its mailbox is reported as soon as it is noticed. Every function returns a
 * tep_status; failing ones fill a tep_diag naming the rank and the values involved.
 *
 * Not thread-safe: one thread per process drives a mailbox handle.
 */
#ifndef THUNDEREP_MAILBOX_H
#define THUNDEREP_MAILBOX_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TEP_MAGIC 0x31584F424D504554ULL /* "TEPMBOX1", little endian */
#define TEP_VERSION 2u
#define TEP_ALIGN 64u
#define TEP_MAX_WORLD 256u
#define TEP_MAX_SLOT_SIZE (1u << 20)

typedef enum {
    TEP_OK = 0,
    TEP_ERR_ARG = 1,         /* invalid argument (diag.found holds the value) */
    TEP_ERR_SYS = 2,         /* a system call failed (diag.os_errno) */
    TEP_ERR_TIMEOUT = 3,     /* diag.rank did not publish the round in time */
    TEP_ERR_PEER_CLOSED = 4, /* diag.rank closed its mailbox before publishing the round */
    TEP_ERR_PEER_DEAD = 5,   /* diag.rank's process exited before publishing the round */
    TEP_ERR_DESYNC = 6,      /* diag.rank published a later round than this one can be at */
    TEP_ERR_LENGTH = 7,      /* diag.rank's record has another length (diag.found) than expected */
    TEP_ERR_MAGIC = 8,       /* the segment is not a mailbox (diag.found = magic found) */
    TEP_ERR_VERSION = 9,     /* layout version differs (diag.found) */
    TEP_ERR_WORLD = 10,      /* world size differs (diag.found) */
    TEP_ERR_SLOT = 11,       /* slot size differs (diag.found) */
    TEP_ERR_SIZE = 12,       /* segment size inconsistent with its header (diag.found = size) */
    TEP_ERR_GENERATION = 13, /* generation differs from the expected one (diag.found) */
    TEP_ERR_OWNER = 14,      /* segment owned by another user or mode is not 0600 (diag.found) */
    TEP_ERR_TOO_LARGE = 15,  /* record longer than the slot size (diag.found = length) */
    TEP_ERR_ROUND = 16,      /* publish round is not last round + 1 (diag.found = last round) */
    TEP_ERR_RANK_TAKEN = 17, /* another live process already attached as this rank (diag.pid) */
    TEP_ERR_CHECKSUM = 18    /* diag.rank's record does not match its checksum (diag.found = stored) */
} tep_status;

typedef enum {
    TEP_RANK_EMPTY = 0,
    TEP_RANK_ATTACHED = 1,
    TEP_RANK_CLOSED = 2
} tep_rank_state;

/* Filled by a failing call: which rank, which values. */
typedef struct {
    int32_t rank;        /* the rank the status is about, -1 if none */
    uint32_t pid;        /* that rank's pid as recorded at attach, 0 if unknown */
    uint32_t state;      /* that rank's tep_rank_state */
    int32_t os_errno;    /* errno of a failed system call */
    uint64_t peer_round; /* the last round that rank published */
    uint64_t found;      /* the offending value (see tep_status) */
    uint64_t waited_ns;  /* how long the call waited */
} tep_diag;

/* Byte offsets of one cell's fields from the segment base (for writers outside this library, e.g.
 * a CUDA stream writing through mapped pinned memory). */
typedef struct {
    uint64_t seq;        /* uint64 seqlock counter */
    uint64_t round;      /* uint64 round */
    uint64_t generation; /* uint64 generation */
    uint64_t length;     /* uint32 payload length */
    uint64_t payload;    /* slot_size bytes */
} tep_cell_layout;

typedef struct tep_mailbox tep_mailbox;

/* Create the segment `name` (O_EXCL, mode 0600) sized for world_size ranks of slot_size bytes and
 * attach to it as `rank`. `generation` must be non-zero; the creator picks it at random. */
int tep_create(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t generation, tep_mailbox **out, tep_diag *diag);

/* Attach to an existing segment as `rank`; checks owner, mode, magic, version, world size, slot size,
 * size and (when expected_generation is non-zero) generation. */
int tep_attach(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t expected_generation, tep_mailbox **out, tep_diag *diag);

/* Remove the segment's name; mappings stay valid until every rank closes. */
int tep_unlink(const char *name, tep_diag *diag);

/* Mark this rank closed, unmap and free the handle. NULL is a no-op. */
void tep_close(tep_mailbox *mb);

/* Write this rank's record for `round` (must be the last published round + 1; the first is 1). */
int tep_publish(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length);

/* Wait for every rank's record of `round` and copy rank r's record to out + r * out_stride, its length
 * to lengths[r]. expect_length == UINT32_MAX accepts any length <= out_stride. */
int tep_collect(tep_mailbox *mb, uint64_t round, void *out, uint32_t out_stride, uint32_t *lengths,
                uint32_t expect_length, uint64_t timeout_ns, tep_diag *diag);

/* tep_publish then tep_collect of the same round, with expect_length = length and
 * out_stride = length: the records land packed in `out` (world_size * length bytes). */
int tep_exchange(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length, void *out,
                 uint32_t *lengths, uint64_t timeout_ns, tep_diag *diag);

/* Reserve `round` for a writer outside this library (a CUDA stream): returns the cell's field offsets
 * and its current (even) seq; the writer stores seq+1, the fields and payload, then seq+2. */
int tep_reserve_external(tep_mailbox *mb, uint64_t round, tep_cell_layout *layout,
                         uint64_t *seq_even, uint64_t *generation, tep_diag *diag);

/* Introspection. */
void *tep_base(const tep_mailbox *mb);
uint64_t tep_size(const tep_mailbox *mb);
uint64_t tep_generation(const tep_mailbox *mb);
uint64_t tep_last_round(const tep_mailbox *mb);
uint32_t tep_world_size(const tep_mailbox *mb);
uint32_t tep_rank(const tep_mailbox *mb);
uint32_t tep_slot_size(const tep_mailbox *mb);
int tep_peer_info(const tep_mailbox *mb, uint32_t rank, tep_diag *diag);

/* Polling schedule: spin with a pause instruction for spin_ns, then sched_yield until yield_ns, then
 * block until a publish or close wakes the waiter, at most sleep_max_ns at a time. A record written
 * by a CUDA stream wakes nobody itself; its rank's own collect wakes the others when it sees it.
 * Defaults depend on world size vs online CPUs. */
void tep_set_backoff(tep_mailbox *mb, uint64_t spin_ns, uint64_t yield_ns, uint64_t sleep_max_ns);

/* Whether this rank's records carry an XXH3-64 checksum of their payload (on after create / attach).
 * Readers check every record that carries one, whatever their own setting. */
void tep_set_checksum(tep_mailbox *mb, int on);

/* XXH3-64 of `length` bytes with `seed` (what a record's checksum is, seeded by tep_record_seed). */
uint64_t tep_xxh3(const void *data, uint64_t length, uint64_t seed);

/* Bytes of a segment for world_size ranks of slot_size-byte records (a multiple of 4096). */
uint64_t tep_segment_size(uint32_t world_size, uint32_t slot_size);

#ifdef __cplusplus
}
#endif

#endif /* THUNDEREP_MAILBOX_H */
