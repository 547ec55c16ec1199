/* ThunderEP mailbox: seqlocked per-rank records in POSIX shared memory. See mailbox.h. */
#define _GNU_SOURCE
#include "mailbox.h"

#define XXH_INLINE_ALL
#define XXH_NO_STREAM
#include "third_party/xxhash/xxhash.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define tep_pause() _mm_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define tep_pause() __asm__ __volatile__("yield" ::: "memory")
#else
#define tep_pause() atomic_signal_fence(memory_order_seq_cst)
#endif

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2, "needs lock-free atomics");

/* ---- shared layout (offsets are part of the format; bump TEP_VERSION when they change) ---- */

typedef struct {
    _Atomic uint64_t magic;   /*  0: written last by the creator */
    uint32_t version;         /*  8 */
    uint32_t world_size;      /* 12 */
    uint32_t slot_size;       /* 16: payload capacity of one record */
    uint32_t cell_stride;     /* 20 */
    uint32_t slot_stride;     /* 24 */
    uint32_t header_size;     /* 28 */
    uint64_t generation;      /* 32 */
    uint64_t total_size;      /* 40 */
    _Atomic uint32_t attached; /* 48: ranks attached so far */
    uint32_t creator_pid;     /* 52 */
    _Atomic uint32_t wake_seq; /* 56: bumped by every publish and close (a futex word) */
    _Atomic uint32_t sleepers; /* 60: waiters blocked on wake_seq */
} tep_header;

typedef struct {
    _Atomic uint32_t state;      /*  0: tep_rank_state, or TEP_RANK_CLAIMING while attaching */
    _Atomic uint32_t pid;        /*  4 */
    _Atomic uint64_t pidns;      /*  8: inode of /proc/self/ns/pid, 0 if unknown */
    _Atomic uint64_t starttime;  /* 16: field 22 of /proc/self/stat, guards against pid reuse */
    _Atomic uint64_t last_round; /* 24: last round published (diagnostics) */
    uint8_t reserved[32];
} tep_rank_info;

typedef struct {
    _Atomic uint64_t seq;        /*  0: seqlock, odd while written */
    _Atomic uint64_t round;      /*  8 */
    _Atomic uint64_t generation; /* 16 */
    _Atomic uint32_t length;     /* 24 */
    _Atomic uint32_t flags;      /* 28: TEP_CELL_CHECKED when `checksum` holds the payload's XXH3 */
    _Atomic uint64_t checksum;   /* 32 */
    uint8_t reserved[24];
} tep_cell;

_Static_assert(sizeof(tep_header) == TEP_ALIGN, "header is one cache line");
_Static_assert(sizeof(tep_rank_info) == TEP_ALIGN, "rank info is one cache line");
_Static_assert(sizeof(tep_cell) == TEP_ALIGN, "cell header is one cache line");

#define TEP_RANK_CLAIMING 3u
/* A cell's flags: CHECKED (a multi-bit pattern, so no single flipped bit turns a checked record into an
 * unchecked one) or 0 for a record written outside this library; any other value is corruption. */
#define TEP_CELL_CHECKED 0x314B4843u /* "CHK1" */
#define TEP_LIVENESS_PERIOD_NS 20000000ull /* check /proc for dead peers every 20 ms */

struct tep_mailbox {
    uint8_t *base;
    uint64_t size;
    tep_header *hdr;
    uint32_t world, rank, slot_size, cell_stride, slot_stride;
    uint64_t generation, last_round, own_seq[2], external_round;
    uint64_t spin_ns, yield_ns, sleep_max_ns, my_pidns;
    int checksum; /* whether this rank's records carry a checksum */
};

/* A record's checksum: the payload's XXH3 seeded by generation and round, so a record copied into
 * another round or segment does not verify. */
static uint64_t record_checksum(const void *data, uint32_t length, uint64_t generation, uint64_t round) {
    return XXH3_64bits_withSeed(data, length, generation ^ (round * 0x9E3779B97F4A7C15ull));
}

uint64_t tep_xxh3(const void *data, uint64_t length, uint64_t seed) {
    return XXH3_64bits_withSeed(data, (size_t)length, seed);
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static uint64_t now_ns(void) {
    struct timespec ts;
    return clock_gettime(CLOCK_MONOTONIC, &ts), (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Waiters past their spin and yield phases block on the header's futex word; every publish and
 * close bumps it and wakes them. Ordering (seq_cst both sides): either the publisher sees the
 * sleeper count, or the waiter sees the bumped word and does not block. */
static void wake_waiters(tep_header *h) {
    atomic_fetch_add_explicit(&h->wake_seq, 1, memory_order_seq_cst);
#ifdef __linux__
    if (atomic_load_explicit(&h->sleepers, memory_order_seq_cst))
        syscall(SYS_futex, &h->wake_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
}

static void wait_for_wake(tep_header *h, uint32_t seen, uint64_t max_ns) {
    struct timespec ts = {(time_t)(max_ns / 1000000000ull), (long)(max_ns % 1000000000ull)};
#ifdef __linux__
    syscall(SYS_futex, &h->wake_seq, FUTEX_WAIT, seen, &ts, NULL, 0); /* returns at once if bumped */
#else
    (void)h, (void)seen;
    nanosleep(&ts, NULL);
#endif
}

static void diag_clear(tep_diag *d) { if (d) memset(d, 0, sizeof(*d)), d->rank = -1; }

static int fail(tep_diag *d, int status, int32_t rank, uint64_t found) {
    if (d) d->rank = rank, d->found = found;
    return status;
}

static int fail_sys(tep_diag *d, int err) { return d ? d->os_errno = err, TEP_ERR_SYS : TEP_ERR_SYS; }

static uint32_t cell_stride_for(uint32_t slot_size) {
    return (uint32_t)(sizeof(tep_cell) + round_up(slot_size, TEP_ALIGN));
}

static tep_rank_info *rank_info(const tep_mailbox *mb, uint32_t r) {
    return (tep_rank_info *)(mb->base + TEP_ALIGN + (uint64_t)r * mb->slot_stride);
}

static tep_cell *cell_of(const tep_mailbox *mb, uint32_t r, uint64_t round) {
    return (tep_cell *)((uint8_t *)rank_info(mb, r) + TEP_ALIGN + (round & 1u) * mb->cell_stride);
}

static uint64_t self_pidns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* State letter and start time of a process from /proc/<pid>/stat; 0 if it cannot be read. */
static int proc_stat(uint32_t pid, char *state, uint64_t *starttime) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    *state = p[2];
    p += 3;
    for (int field = 4; field < 22 && p; ++field) p = strchr(p + 1, ' ');
    if (!p) return 0;
    *starttime = strtoull(p + 1, NULL, 10);
    return 1;
}

/* 1 when the rank's process has certainly exited (gone, zombie, or its pid was reused). */
static int peer_dead(const tep_mailbox *mb, uint32_t r) {
    tep_rank_info *ri = rank_info(mb, r);
    if (atomic_load_explicit(&ri->state, memory_order_acquire) != TEP_RANK_ATTACHED) return 0;
    uint64_t ns = atomic_load_explicit(&ri->pidns, memory_order_relaxed);
    if (ns == 0 || ns != mb->my_pidns) return 0; /* another pid namespace: cannot tell */
    uint32_t pid = atomic_load_explicit(&ri->pid, memory_order_relaxed);
    char st = 0;
    uint64_t start = 0;
    if (!proc_stat(pid, &st, &start)) return 1;
    if (st == 'Z' || st == 'X' || st == 'x') return 1;
    return start != atomic_load_explicit(&ri->starttime, memory_order_relaxed);
}

static void fill_peer(const tep_mailbox *mb, uint32_t r, tep_diag *d) {
    if (!d) return;
    tep_rank_info *ri = rank_info(mb, r);
    d->rank = (int32_t)r;
    d->pid = atomic_load_explicit(&ri->pid, memory_order_relaxed);
    d->state = atomic_load_explicit(&ri->state, memory_order_acquire);
    if (d->state == TEP_RANK_CLAIMING) d->state = TEP_RANK_ATTACHED;
    d->peer_round = atomic_load_explicit(&ri->last_round, memory_order_relaxed);
}

static int bad_name(const char *n) {
    return !n || n[0] != '/' || strlen(n) < 2 || strlen(n) > 200 || strchr(n + 1, '/') != NULL;
}

static int check_open(const char *name, uint32_t world, uint32_t rank, uint32_t slot_size,
                      tep_mailbox **out, tep_diag *d) {
    diag_clear(d);
    if (!out) return fail(d, TEP_ERR_ARG, -1, 0);
    *out = NULL;
    if (bad_name(name)) return fail(d, TEP_ERR_ARG, -1, 0);
    if (world == 0 || world > TEP_MAX_WORLD) return fail(d, TEP_ERR_ARG, -1, world);
    if (rank >= world) return fail(d, TEP_ERR_ARG, (int32_t)rank, rank);
    if (slot_size == 0 || slot_size > TEP_MAX_SLOT_SIZE) return fail(d, TEP_ERR_ARG, -1, slot_size);
    return TEP_OK;
}

static void default_backoff(tep_mailbox *mb) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int oversubscribed = cpus > 0 && (long)mb->world > cpus;
    /* A peer that is not there within tens of microseconds is computing or descheduled: block
     * rather than burn the core (with more ranks than cores, the core the peer needs). Blocked
     * waiters are woken by publishes, so naps can be long: short ones only add wake-ups. */
    mb->spin_ns = oversubscribed ? 2000ull : 20000ull;
    mb->yield_ns = oversubscribed ? 200000ull : 100000ull;
    mb->sleep_max_ns = 10000000ull;
}

/* Claim `rank` in a mapped segment. Takes ownership of the mapping (unmapped on failure). The geometry
 * comes from the caller's validated values, never again from the shared header (which another process
 * may change at any time): every index and length below is bounded by them. */
static int claim(void *base, uint64_t size, uint32_t rank, uint32_t world_size, uint32_t slot_size,
                 uint64_t generation, tep_mailbox **out, tep_diag *d) {
    tep_mailbox *mb = calloc(1, sizeof *mb);
    if (!mb) return munmap(base, size), fail_sys(d, ENOMEM);
    mb->hdr = (tep_header *)base;
    mb->base = base, mb->size = size, mb->rank = rank, mb->my_pidns = self_pidns();
    mb->checksum = 1;
    mb->world = world_size, mb->slot_size = slot_size, mb->generation = generation;
    mb->cell_stride = cell_stride_for(slot_size), mb->slot_stride = TEP_ALIGN + 2u * mb->cell_stride;
    default_backoff(mb);

    tep_rank_info *ri = rank_info(mb, rank);
    uint32_t expected = TEP_RANK_EMPTY;
    if (!atomic_compare_exchange_strong_explicit(&ri->state, &expected, TEP_RANK_CLAIMING,
                                                 memory_order_acq_rel, memory_order_acquire)) {
        fill_peer(mb, rank, d);
        if (d) d->found = expected;
        munmap(base, size);
        free(mb);
        return TEP_ERR_RANK_TAKEN;
    }
    char st;
    uint64_t start = 0;
    proc_stat((uint32_t)getpid(), &st, &start);
    atomic_store_explicit(&ri->pid, (uint32_t)getpid(), memory_order_relaxed);
    atomic_store_explicit(&ri->pidns, mb->my_pidns, memory_order_relaxed);
    atomic_store_explicit(&ri->starttime, start, memory_order_relaxed);
    atomic_store_explicit(&ri->last_round, 0, memory_order_relaxed);
    for (int c = 0; c < 2; ++c)
        mb->own_seq[c] = atomic_load_explicit(&cell_of(mb, rank, (uint64_t)c)->seq, memory_order_relaxed);
    atomic_store_explicit(&ri->state, TEP_RANK_ATTACHED, memory_order_release);
    atomic_fetch_add_explicit(&mb->hdr->attached, 1, memory_order_acq_rel);
    *out = mb;
    return TEP_OK;
}

uint64_t tep_segment_size(uint32_t world_size, uint32_t slot_size) {
    uint64_t slot_stride = TEP_ALIGN + 2ull * cell_stride_for(slot_size);
    return round_up(TEP_ALIGN + (uint64_t)world_size * slot_stride, 4096);
}

int tep_create(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t generation, tep_mailbox **out, tep_diag *d) {
    int st = check_open(name, world_size, rank, slot_size, out, d);
    if (st) return st;
    if (generation == 0) return fail(d, TEP_ERR_ARG, -1, 0);
    uint64_t size = tep_segment_size(world_size, slot_size);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return fail_sys(d, errno);
    void *base = MAP_FAILED;
    /* The umask cannot widen 0600, but be explicit about it. */
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0 ||
        (base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        int err = errno;
        close(fd);
        shm_unlink(name);
        return fail_sys(d, err);
    }
    tep_header *h = (tep_header *)base; /* ftruncate zero-filled the segment */
    h->version = TEP_VERSION, h->world_size = world_size, h->slot_size = slot_size;
    h->cell_stride = cell_stride_for(slot_size), h->slot_stride = TEP_ALIGN + 2u * h->cell_stride;
    h->header_size = TEP_ALIGN, h->generation = generation, h->total_size = size;
    h->creator_pid = (uint32_t)getpid();
    atomic_store_explicit(&h->magic, TEP_MAGIC, memory_order_release);
    close(fd);
    st = claim(base, size, rank, world_size, slot_size, generation, out, d);
    if (st != TEP_OK) shm_unlink(name);
    return st;
}

int tep_attach(const char *name, uint32_t world_size, uint32_t rank, uint32_t slot_size,
               uint64_t expected_generation, tep_mailbox **out, tep_diag *d) {
    int st = check_open(name, world_size, rank, slot_size, out, d);
    if (st) return st;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return fail_sys(d, errno);
    struct stat sb;
    int fst = fstat(fd, &sb);
    uint64_t size = fst == 0 ? (uint64_t)sb.st_size : 0;
    tep_header *h = MAP_FAILED;
    if (fst != 0)
        st = fail_sys(d, errno);
    else if (sb.st_uid != geteuid() || (sb.st_mode & 07777) != 0600)
        st = fail(d, TEP_ERR_OWNER, -1, ((uint64_t)sb.st_uid << 32) | (sb.st_mode & 07777));
    else if (size < TEP_ALIGN)
        st = fail(d, TEP_ERR_SIZE, -1, size);
    else if ((h = mmap(NULL, TEP_ALIGN, PROT_READ, MAP_SHARED, fd, 0)) == MAP_FAILED)
        st = fail_sys(d, errno);
    if (st != TEP_OK) return close(fd), st;
    /* One private copy of the header, each field read once: what is validated is what is used. */
    uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
    const volatile tep_header *vh = (const volatile tep_header *)h;
    uint32_t version = vh->version, world = vh->world_size, slot = vh->slot_size;
    uint32_t cell = vh->cell_stride, stride = vh->slot_stride;
    uint64_t generation = vh->generation, total = vh->total_size;
    if (magic != TEP_MAGIC) st = fail(d, TEP_ERR_MAGIC, -1, magic);
    else if (version != TEP_VERSION) st = fail(d, TEP_ERR_VERSION, -1, version);
    else if (world != world_size) st = fail(d, TEP_ERR_WORLD, -1, world);
    else if (slot != slot_size) st = fail(d, TEP_ERR_SLOT, -1, slot);
    else if (total != size || size != tep_segment_size(world_size, slot_size) ||
             cell != cell_stride_for(slot_size) || stride != TEP_ALIGN + 2u * cell)
        st = fail(d, TEP_ERR_SIZE, -1, size);
    else if (expected_generation != 0 && generation != expected_generation)
        st = fail(d, TEP_ERR_GENERATION, -1, generation);
    munmap(h, TEP_ALIGN);
    void *base = st == TEP_OK ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    int err = errno;
    close(fd);
    if (st != TEP_OK) return st;
    if (base == MAP_FAILED) return fail_sys(d, err);
    return claim(base, size, rank, world_size, slot_size, generation, out, d);
}

int tep_unlink(const char *name, tep_diag *d) {
    diag_clear(d);
    if (bad_name(name)) return fail(d, TEP_ERR_ARG, -1, 0);
    return shm_unlink(name) == 0 ? TEP_OK : fail_sys(d, errno);
}

void tep_close(tep_mailbox *mb) {
    if (!mb) return;
    /* Only this rank's own state word is written: peers keep reading their records untouched. */
    atomic_store_explicit(&rank_info(mb, mb->rank)->state, TEP_RANK_CLOSED, memory_order_release);
    wake_waiters(mb->hdr);
    munmap(mb->base, mb->size);
    free(mb);
}

int tep_publish(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length) {
    if (!mb || (length && !data)) return TEP_ERR_ARG;
    if (length > mb->slot_size) return TEP_ERR_TOO_LARGE;
    if (round != mb->last_round + 1) return TEP_ERR_ROUND;
    tep_cell *c = cell_of(mb, mb->rank, round);
    uint64_t s = mb->own_seq[round & 1u];
    /* From the caller's buffer, so bytes changed in the segment after the copy are caught. */
    uint64_t sum = mb->checksum ? record_checksum(data, length, mb->generation, round) : 0;
    atomic_store_explicit(&c->seq, s + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* odd seq is visible before any field changes */
    atomic_store_explicit(&c->round, round, memory_order_relaxed);
    atomic_store_explicit(&c->generation, mb->generation, memory_order_relaxed);
    atomic_store_explicit(&c->length, length, memory_order_relaxed);
    atomic_store_explicit(&c->flags, mb->checksum ? TEP_CELL_CHECKED : 0u, memory_order_relaxed);
    atomic_store_explicit(&c->checksum, sum, memory_order_relaxed);
    if (length) memcpy((uint8_t *)c + sizeof(tep_cell), data, length);
    atomic_store_explicit(&c->seq, s + 2, memory_order_release); /* fields before even seq */
    mb->own_seq[round & 1u] = s + 2;
    mb->last_round = round;
    atomic_store_explicit(&rank_info(mb, mb->rank)->last_round, round, memory_order_relaxed);
    wake_waiters(mb->hdr);
    return TEP_OK;
}

enum { READ_OK, READ_NOT_YET, READ_AHEAD, READ_BAD_LENGTH, READ_BAD_CHECKSUM };

/* One seqlock read of rank r's record for `round` into out + r * stride (at most cap bytes). */
static int try_read(const tep_mailbox *mb, uint32_t r, uint64_t round, void *out, uint32_t stride,
                    uint32_t cap, uint32_t *len_out, uint64_t *found) {
    tep_cell *c = cell_of(mb, r, round);
    uint8_t *dst = (uint8_t *)out + (uint64_t)r * stride;
    for (int attempt = 0; attempt < 4; ++attempt) {
        uint64_t s1 = atomic_load_explicit(&c->seq, memory_order_acquire);
        if (s1 & 1u) return READ_NOT_YET;
        uint64_t rd = atomic_load_explicit(&c->round, memory_order_relaxed);
        uint64_t gen = atomic_load_explicit(&c->generation, memory_order_relaxed);
        uint32_t len = atomic_load_explicit(&c->length, memory_order_relaxed);
        uint32_t flags = atomic_load_explicit(&c->flags, memory_order_relaxed);
        uint64_t sum = atomic_load_explicit(&c->checksum, memory_order_relaxed);
        int ready = rd == round && gen == mb->generation;
        if (ready && len <= cap && len) memcpy(dst, (const uint8_t *)c + sizeof(tep_cell), len);
        atomic_thread_fence(memory_order_acquire); /* the copy happens before the re-check */
        if (atomic_load_explicit(&c->seq, memory_order_relaxed) != s1) continue; /* torn: retry */
        if (!ready) return gen == mb->generation && rd > round ? (*found = rd, READ_AHEAD) : READ_NOT_YET;
        if (len > cap) return *found = len, READ_BAD_LENGTH;
        if (flags != 0 && (flags != TEP_CELL_CHECKED || record_checksum(dst, len, gen, round) != sum))
            return *found = sum, READ_BAD_CHECKSUM; /* the copy is consistent but not what was written */
        *len_out = len;
        return READ_OK;
    }
    return READ_NOT_YET;
}

int tep_collect(tep_mailbox *mb, uint64_t round, void *out, uint32_t out_stride, uint32_t *lengths,
                uint32_t expect_length, uint64_t timeout_ns, tep_diag *d) {
    diag_clear(d);
    if (!mb || !lengths || (!out && out_stride) || round == 0) return fail(d, TEP_ERR_ARG, -1, round);
    uint8_t done[TEP_MAX_WORLD];
    memset(done, 0, mb->world);
    uint32_t remaining = mb->world, cap = out_stride < mb->slot_size ? out_stride : mb->slot_size;
    uint32_t seen = 0;
    int armed = 0, st = TEP_OK;
    uint64_t t0 = now_ns(), next_liveness = t0 + TEP_LIVENESS_PERIOD_NS, found = 0;
    for (;;) {
        for (uint32_t r = 0; r < mb->world && st == TEP_OK; ++r) {
            if (done[r]) continue;
            int rs = try_read(mb, r, round, out, out_stride, cap, &lengths[r], &found);
            if (rs == READ_OK && expect_length != UINT32_MAX && lengths[r] != expect_length)
                rs = READ_BAD_LENGTH, found = lengths[r];
            if (rs == READ_OK) {
                done[r] = 1;
                --remaining;
                if (r == mb->rank && round == mb->external_round) wake_waiters(mb->hdr); /* GPU wrote it */
            } else if (rs != READ_NOT_YET) {
                fill_peer(mb, r, d);
                if (d) d->found = found, d->waited_ns = now_ns() - t0;
                st = rs == READ_AHEAD ? TEP_ERR_DESYNC
                     : rs == READ_BAD_CHECKSUM ? TEP_ERR_CHECKSUM : TEP_ERR_LENGTH;
            }
        }
        if (st != TEP_OK || remaining == 0) break;
        uint64_t now = now_ns(), elapsed = now - t0;
        if (elapsed >= mb->spin_ns) {
            /* A peer that closed or died will never publish: say so now rather than at the timeout.
             * Its state is read before its cell is read again, so a record published just before
             * it closed is still collected. */
            int check_dead = now >= next_liveness;
            if (check_dead) next_liveness = now + TEP_LIVENESS_PERIOD_NS;
            for (uint32_t r = 0; r < mb->world && st == TEP_OK; ++r) {
                if (done[r]) continue;
                int closed = atomic_load_explicit(&rank_info(mb, r)->state, memory_order_acquire) ==
                             TEP_RANK_CLOSED;
                if (!closed && !(check_dead && peer_dead(mb, r))) continue;
                if (try_read(mb, r, round, out, out_stride, cap, &lengths[r], &found) == READ_OK)
                    continue; /* picked up on the next pass */
                fill_peer(mb, r, d);
                if (d) d->waited_ns = elapsed;
                st = closed ? TEP_ERR_PEER_CLOSED : TEP_ERR_PEER_DEAD;
            }
            if (st != TEP_OK) break;
        }
        if (elapsed >= timeout_ns) {
            uint32_t r = 0;
            while (done[r]) ++r; /* the first silent rank */
            fill_peer(mb, r, d);
            if (d) d->waited_ns = elapsed;
            st = TEP_ERR_TIMEOUT;
            break;
        }
        if (elapsed < mb->spin_ns) {
            for (int i = 0; i < 8; ++i) tep_pause();
        } else if (elapsed < mb->yield_ns) {
            sched_yield();
        } else if (!armed) { /* announce the sleeper, then scan once more before blocking */
            atomic_fetch_add_explicit(&mb->hdr->sleepers, 1, memory_order_seq_cst);
            seen = atomic_load_explicit(&mb->hdr->wake_seq, memory_order_seq_cst);
            armed = 1;
        } else {
            /* Bounded so that timeouts, liveness checks and writers that do not wake (a CUDA
             * stream writing through mapped memory) are still noticed. */
            uint64_t left = timeout_ns - elapsed, nap = mb->sleep_max_ns;
            wait_for_wake(mb->hdr, seen, nap < left ? nap : left);
            seen = atomic_load_explicit(&mb->hdr->wake_seq, memory_order_seq_cst);
        }
    }
    if (armed) atomic_fetch_sub_explicit(&mb->hdr->sleepers, 1, memory_order_seq_cst);
    return st;
}

int tep_exchange(tep_mailbox *mb, uint64_t round, const void *data, uint32_t length, void *out,
                 uint32_t *lengths, uint64_t timeout_ns, tep_diag *d) {
    diag_clear(d);
    int st = tep_publish(mb, round, data, length);
    if (st != TEP_OK) {
        if (d && mb) d->rank = (int32_t)mb->rank, d->found = st == TEP_ERR_ROUND ? mb->last_round : length;
        return st;
    }
    return tep_collect(mb, round, out, length, lengths, length, timeout_ns, d);
}

int tep_reserve_external(tep_mailbox *mb, uint64_t round, tep_cell_layout *layout, uint64_t *seq_even,
                         uint64_t *generation, tep_diag *d) {
    diag_clear(d);
    if (!mb || !layout || !seq_even || !generation) return fail(d, TEP_ERR_ARG, -1, 0);
    if (round != mb->last_round + 1) return fail(d, TEP_ERR_ROUND, (int32_t)mb->rank, mb->last_round);
    tep_cell *c = cell_of(mb, mb->rank, round);
    uint64_t off = (uint64_t)((uint8_t *)c - mb->base);
    layout->seq = off + offsetof(tep_cell, seq), layout->round = off + offsetof(tep_cell, round);
    layout->generation = off + offsetof(tep_cell, generation);
    layout->length = off + offsetof(tep_cell, length), layout->payload = off + sizeof(tep_cell);
    *seq_even = mb->own_seq[round & 1u];
    *generation = mb->generation;
    atomic_store_explicit(&c->flags, 0u, memory_order_relaxed); /* an outside writer stores no checksum */
    mb->own_seq[round & 1u] += 2;
    mb->last_round = mb->external_round = round;
    atomic_store_explicit(&rank_info(mb, mb->rank)->last_round, round, memory_order_relaxed);
    return TEP_OK;
}

void *tep_base(const tep_mailbox *mb) { return mb ? mb->base : NULL; }
uint64_t tep_size(const tep_mailbox *mb) { return mb ? mb->size : 0; }
uint64_t tep_generation(const tep_mailbox *mb) { return mb ? mb->generation : 0; }
uint64_t tep_last_round(const tep_mailbox *mb) { return mb ? mb->last_round : 0; }
uint32_t tep_world_size(const tep_mailbox *mb) { return mb ? mb->world : 0; }
uint32_t tep_rank(const tep_mailbox *mb) { return mb ? mb->rank : 0; }
uint32_t tep_slot_size(const tep_mailbox *mb) { return mb ? mb->slot_size : 0; }

int tep_peer_info(const tep_mailbox *mb, uint32_t rank, tep_diag *d) {
    diag_clear(d);
    if (!mb || !d || rank >= mb->world) return TEP_ERR_ARG;
    fill_peer(mb, rank, d);
    return TEP_OK;
}

void tep_set_checksum(tep_mailbox *mb, int on) {
    if (mb) mb->checksum = on != 0;
}

void tep_set_backoff(tep_mailbox *mb, uint64_t spin_ns, uint64_t yield_ns, uint64_t sleep_max_ns) {
    if (mb) mb->spin_ns = spin_ns, mb->yield_ns = yield_ns < spin_ns ? spin_ns : yield_ns,
            mb->sleep_max_ns = sleep_max_ns < 1000 ? 1000 : sleep_max_ns;
}
