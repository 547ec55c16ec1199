/* Host experts on native threads (host_experts.h). One leader thread takes the jobs in order; the others
 * help it through each job's phases, split by rows of the weights: per cold slot, phase 1 (each thread its
 * share of the I gate and up rows, their activation product a) and phase 2 (each thread its share of the D
 * down rows, added into out with the pair's weight). One barrier between the two phases of a slot; the
 * two a buffers alternate between slots, so a slot's phase 1 never overwrites what a slower thread still
 * reads. Idle threads sleep on a condition variable after a short spin. */

#include "host_experts.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING 1024
#define IDLE_SPINS 20000

typedef struct {
    atomic_int count, sense;
    int n;
} barrier_t;

typedef struct {
    int64_t slot, first, n;      /* a cold slot's pairs: pairs[first .. first + n) */
} unit_t;

struct tep_hx {
    int nthreads;
    atomic_int stop;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t job_cv, done_cv, phase_cv;
    tep_hx_job ring[RING];
    int states[RING];
    int64_t nanos[RING];         /* each ended job's compute time (`tep_hx_nanoseconds`) */
    int64_t head, tail;          /* tickets: next to run (head + 1), last submitted (tail) */
    atomic_llong posted;         /* tail, for the leader's spin before it sleeps */
    int leader_sleeps;           /* under mu: whether a submit must wake the leader */
    /* the job being computed, for the helpers */
    atomic_long gen;
    const tep_hx_job *job;
    const unit_t *units;
    int64_t nunits, *pair_token;
    float *pair_weight, *a[2];
    barrier_t bar;
};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void barrier_wait(barrier_t *b, int *local) {
    *local = !*local;
    if (atomic_fetch_add(&b->count, 1) == b->n - 1) {
        atomic_store(&b->count, 0);
        atomic_store(&b->sense, *local);
    } else {
        for (long spins = 0; atomic_load(&b->sense) != *local; spins++) {
            if (spins < 4000) relax(); else sched_yield();
        }
    }
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load(const void *p, int dtype, int64_t i) {
    if (dtype == TEP_HX_F32) return ((const float *)p)[i];
    if (dtype == TEP_HX_F16) return half_to_float(((const uint16_t *)p)[i]);
    return bf16_to_float(((const uint16_t *)p)[i]);
}

/* On x86-64 the dot products are built twice, for AVX2 with FMA and for the baseline, and the loader picks
 * the one this CPU runs (GCC's and Clang's function multiversioning): at a batch of tokens the products,
 * not the weights' bytes, bound a job, and the baseline's 4-wide vectors are half of AVX2's. Not under
 * ThreadSanitizer, whose runtime the loader's choice runs before. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__SANITIZE_THREAD__)
#define TEP_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define TEP_CLONES
#endif

/* The loop of `dot` over a row r whose value k CONVERT(r[k]) reads as float: 8 lanes, then one fixed tree. */
#define DOT_LOOP(CONVERT)                                                                                  \
    for (; i + 8 <= n; i += 8)                                                                             \
        for (int j = 0; j < 8; j++) acc[j] += CONVERT(r[i + j]) * v[i + j];                                \
    for (; i < n; i++) acc[0] += CONVERT(r[i]) * v[i];

#define AS_FLOAT(x) (x)

/* dot(row of n values of dtype, v of n floats) */
TEP_CLONES
static float dot(const void *row, int dtype, const float *v, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    if (dtype == TEP_HX_F32) {
        const float *r = (const float *)row;
        DOT_LOOP(AS_FLOAT)
    } else if (dtype == TEP_HX_F16) {
        const uint16_t *r = (const uint16_t *)row;
        DOT_LOOP(half_to_float)
    } else {
        const uint16_t *r = (const uint16_t *)row;
        DOT_LOOP(bf16_to_float)
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline float activate(float g, int act) {
    switch (act) {
    case TEP_HX_SILU: return g / (1.0f + expf(-g));
    case TEP_HX_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    case TEP_HX_GELU_TANH: return 0.5f * g * (1.0f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
    default: return g > 0.0f ? g : 0.0f;
    }
}

static inline void share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

/* Every thread's part of the current job (hx->job, hx->units): the slots' two phases. x rows are read as
 * floats from xf (the job's [T, D] rows converted once by the leader). */
static void compute(tep_hx *hx, int t, const float *xf, int *sense) {
    const tep_hx_job *j = hx->job;
    int64_t D = j->D, I = j->I;
    size_t esz = j->dtype == TEP_HX_F32 ? 4 : 2;
    for (int64_t u = 0; u < hx->nunits; u++) {
        const unit_t *un = &hx->units[u];
        float *a = hx->a[u & 1];
        const char *gu = (const char *)j->gate_up + (size_t)un->slot * 2 * I * D * esz;
        const char *dn = (const char *)j->down + (size_t)un->slot * D * I * esz;
        int64_t lo, hi;
        share(I, t, hx->nthreads, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            int64_t gi = j->interleaved ? 2 * i : i, ui = j->interleaved ? 2 * i + 1 : I + i;
            float gb = j->gate_up_bias ? load(j->gate_up_bias, j->dtype, un->slot * 2 * I + gi) : 0.0f;
            float ub = j->gate_up_bias ? load(j->gate_up_bias, j->dtype, un->slot * 2 * I + ui) : 0.0f;
            for (int64_t r = 0; r < un->n; r++) {
                const float *x = xf + hx->pair_token[un->first + r] * D;
                float g = dot(gu + (size_t)gi * D * esz, j->dtype, x, D) + gb;
                float up = dot(gu + (size_t)ui * D * esz, j->dtype, x, D) + ub;
                a[r * I + i] = activate(g, j->act) * up;
            }
        }
        barrier_wait(&hx->bar, sense);
        share(D, t, hx->nthreads, &lo, &hi);
        for (int64_t d = lo; d < hi; d++) {
            float db = j->down_bias ? load(j->down_bias, j->dtype, un->slot * D + d) : 0.0f;
            for (int64_t r = 0; r < un->n; r++) {
                float y = dot(dn + (size_t)d * I * esz, j->dtype, a + r * I, I) + db;
                j->out[hx->pair_token[un->first + r] * D + d] += hx->pair_weight[un->first + r] * y;
            }
        }
    }
    barrier_wait(&hx->bar, sense);  /* the job's end: every thread done with its buffers */
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int wait_stamp(const tep_hx_job *j) {
    /* an acquire load: what the stream copied before writing the stamp is visible after it */
    for (int64_t polls = 0; (int32_t)(__atomic_load_n(j->ready, __ATOMIC_ACQUIRE) - j->stamp) < 0; polls++) {
        if (polls >= j->spins) return TEP_HX_NO_STAMP;
        if (polls < 4000) relax(); else sched_yield();
    }
    if (j->consume) __atomic_store_n(j->ready, 0, __ATOMIC_RELAXED);  /* this arrival is this job's alone */
    return TEP_HX_DONE;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* `run_job` after the stamp: the pairs grouped by cold slot and every thread's part computed. */
static int compute_job(tep_hx *hx, const tep_hx_job *j, int *sense, float **xf_buf, int64_t *xf_cap) {
    int64_t N = j->T * j->K, cold = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t s = j->ids[n];
        if (s >= j->S) return TEP_HX_BAD_SLOT;
        if (s >= 0 && !j->hot[s]) cold++;
    }
    memset(j->out, 0, (size_t)(j->T * j->D) * sizeof(float));
    if (cold == 0) return TEP_HX_DONE;
    int64_t *keys = malloc((size_t)cold * sizeof *keys), *tok = malloc((size_t)cold * sizeof *tok);
    float *wt = malloc((size_t)cold * sizeof *wt);
    unit_t *units = malloc((size_t)cold * sizeof *units);
    if (!keys || !tok || !wt || !units) {
        free(keys); free(tok); free(wt); free(units);
        return TEP_HX_NO_MEMORY;
    }
    cold = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t s = j->ids[n];
        if (s >= 0 && !j->hot[s]) keys[cold++] = s * N + n;  /* grouped by slot, pairs in order */
    }
    qsort(keys, (size_t)cold, sizeof *keys, cmp_i64);
    int64_t nunits = 0;
    for (int64_t c = 0; c < cold; c++) {
        int64_t s = keys[c] / N, n = keys[c] % N;
        tok[c] = n / j->K;
        wt[c] = load(j->w, j->w_dtype, n);
        if (nunits == 0 || units[nunits - 1].slot != s) units[nunits++] = (unit_t){s, c, 0};
        units[nunits - 1].n++;
    }
    /* the token rows as floats, then two activation buffers of the most pairs a slot has (a token routed to
     * one slot twice counts twice) */
    int64_t most = 0;
    for (int64_t u = 0; u < nunits; u++) most = units[u].n > most ? units[u].n : most;
    int64_t need = j->T * j->D + 2 * most * j->I;
    if (need > *xf_cap) {
        free(*xf_buf);
        *xf_buf = malloc((size_t)need * sizeof(float));
        *xf_cap = *xf_buf ? need : 0;
    }
    if (!*xf_buf) {
        free(keys); free(tok); free(wt); free(units);
        return TEP_HX_NO_MEMORY;
    }
    float *xf = *xf_buf;
    for (int64_t i = 0; i < j->T * j->D; i++) xf[i] = load(j->x, j->x_dtype, i);
    hx->job = j;
    hx->units = units;
    hx->nunits = nunits;
    hx->pair_token = tok;
    hx->pair_weight = wt;
    hx->a[0] = xf + j->T * j->D;
    hx->a[1] = hx->a[0] + most * j->I;
    if (hx->nthreads > 1) {
        pthread_mutex_lock(&hx->mu);
        atomic_fetch_add(&hx->gen, 1);
        pthread_cond_broadcast(&hx->phase_cv);
        pthread_mutex_unlock(&hx->mu);
    }
    compute(hx, 0, xf, sense);
    free(keys); free(tok); free(wt); free(units);
    return TEP_HX_DONE;
}

/* The leader's whole job; returns its state, and in *nanos the time from its stamp to its sums. */
static int run_job(tep_hx *hx, const tep_hx_job *j, int *sense, float **xf_buf, int64_t *xf_cap, int64_t *nanos) {
    int state = wait_stamp(j);
    *nanos = 0;
    if (state != TEP_HX_DONE) return state;
    int64_t started = now_ns();
    state = compute_job(hx, j, sense, xf_buf, xf_cap);
    *nanos = state == TEP_HX_DONE ? now_ns() - started : 0;
    return state;
}

void tep_hx_raise(volatile uint32_t *flag, uint32_t number) {
    _Atomic uint32_t *word = (_Atomic uint32_t *)flag;
    uint32_t seen = atomic_load(word);
    while ((int32_t)(number - seen) > 0 && !atomic_compare_exchange_weak(word, &seen, number)) {
    }
}

typedef struct {
    tep_hx *hx;
    int index;
} start_t;

static void *helper(void *arg) {
    start_t st = *(start_t *)arg;
    free(arg);
    tep_hx *hx = st.hx;
    int sense = 0;
    long seen = 0;  /* the generation at creation, not at this thread's start: a job may begin before it */
    for (;;) {
        long spins = 0;
        while (atomic_load(&hx->gen) == seen && !hx->stop && spins < IDLE_SPINS) { relax(); spins++; }
        if (atomic_load(&hx->gen) == seen) {
            pthread_mutex_lock(&hx->mu);
            while (atomic_load(&hx->gen) == seen && !hx->stop) pthread_cond_wait(&hx->phase_cv, &hx->mu);
            pthread_mutex_unlock(&hx->mu);
        }
        if (hx->stop && atomic_load(&hx->gen) == seen) return NULL;
        seen = atomic_load(&hx->gen);
        const tep_hx_job *j = hx->job;
        compute(hx, st.index, hx->a[0] - j->T * j->D, &sense);
    }
}

static void *leader(void *arg) {
    tep_hx *hx = arg;
    int sense = 0;
    float *xf = NULL;
    int64_t xf_cap = 0;
    int64_t done = 0;
    for (;;) {
        /* a short spin first: the next job of a decode step comes within about a layer's launches, and a
         * leader awake spares the submitting thread a wake-up */
        for (long spins = 0; atomic_load(&hx->posted) == done && !hx->stop && spins < IDLE_SPINS; spins++) relax();
        pthread_mutex_lock(&hx->mu);
        hx->leader_sleeps = 1;
        while (hx->head == hx->tail && !hx->stop) pthread_cond_wait(&hx->job_cv, &hx->mu);
        hx->leader_sleeps = 0;
        if (hx->head == hx->tail) {
            pthread_mutex_unlock(&hx->mu);
            break;
        }
        int64_t ticket = hx->head + 1;
        tep_hx_job job = hx->ring[ticket % RING];
        pthread_mutex_unlock(&hx->mu);
        int64_t nanos;
        int state = run_job(hx, &job, &sense, &xf, &xf_cap, &nanos);
        if (state == TEP_HX_DONE) tep_hx_raise(job.flag, job.number);
        pthread_mutex_lock(&hx->mu);
        hx->states[ticket % RING] = state;
        hx->nanos[ticket % RING] = nanos;
        hx->head = done = ticket;
        pthread_cond_broadcast(&hx->done_cv);
        pthread_mutex_unlock(&hx->mu);
    }
    free(xf);
    return NULL;
}

tep_hx *tep_hx_create(int threads) {
    if (threads < 1) threads = 1;
    tep_hx *hx = calloc(1, sizeof *hx);
    if (!hx) return NULL;
    hx->nthreads = threads;
    hx->bar.n = threads;
    hx->threads = calloc((size_t)threads, sizeof(pthread_t));
    pthread_mutex_init(&hx->mu, NULL);
    pthread_cond_init(&hx->job_cv, NULL);
    pthread_cond_init(&hx->done_cv, NULL);
    pthread_cond_init(&hx->phase_cv, NULL);
    int started = hx->threads && pthread_create(&hx->threads[0], NULL, leader, hx) == 0;
    for (int t = 1; started && t < threads; t++) {
        start_t *st = malloc(sizeof *st);
        if (st) *st = (start_t){hx, t};
        started = st && pthread_create(&hx->threads[t], NULL, helper, st) == 0;
        if (!started) {
            free(st);
            hx->nthreads = t;  /* the threads started so far are joined by destroy */
        }
    }
    if (!started) {
        tep_hx_destroy(hx);
        return NULL;
    }
    return hx;
}

void tep_hx_destroy(tep_hx *hx) {
    if (!hx) return;
    pthread_mutex_lock(&hx->mu);
    hx->stop = 1;
    pthread_cond_broadcast(&hx->job_cv);
    pthread_cond_broadcast(&hx->phase_cv);
    pthread_mutex_unlock(&hx->mu);
    for (int t = 0; hx->threads && t < hx->nthreads; t++)
        if (hx->threads[t]) pthread_join(hx->threads[t], NULL);
    free(hx->threads);
    pthread_mutex_destroy(&hx->mu);
    pthread_cond_destroy(&hx->job_cv);
    pthread_cond_destroy(&hx->done_cv);
    pthread_cond_destroy(&hx->phase_cv);
    free(hx);
}

int64_t tep_hx_submit(tep_hx *hx, const tep_hx_job *job) {
    pthread_mutex_lock(&hx->mu);
    if (hx->tail - hx->head >= RING - 1 || hx->stop) {
        pthread_mutex_unlock(&hx->mu);
        return 0;
    }
    int64_t ticket = ++hx->tail;
    hx->ring[ticket % RING] = *job;
    hx->states[ticket % RING] = TEP_HX_PENDING;
    atomic_store(&hx->posted, ticket);
    if (hx->leader_sleeps) pthread_cond_signal(&hx->job_cv);
    pthread_mutex_unlock(&hx->mu);
    return ticket;
}

int tep_hx_state(tep_hx *hx, int64_t ticket) {
    pthread_mutex_lock(&hx->mu);
    int state = ticket <= hx->head ? (ticket > hx->head - (RING - 1) ? hx->states[ticket % RING] : TEP_HX_UNKNOWN)
                                   : TEP_HX_PENDING;
    pthread_mutex_unlock(&hx->mu);
    return state;
}

int tep_hx_wait(tep_hx *hx, int64_t ticket, double timeout_s) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    double whole = floor(timeout_s);
    deadline.tv_sec += (time_t)whole;
    deadline.tv_nsec += (long)((timeout_s - whole) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&hx->mu);
    while (hx->head < ticket && pthread_cond_timedwait(&hx->done_cv, &hx->mu, &deadline) == 0) {
    }
    int state = ticket <= hx->head ? (ticket > hx->head - (RING - 1) ? hx->states[ticket % RING] : TEP_HX_UNKNOWN)
                                   : TEP_HX_PENDING;
    pthread_mutex_unlock(&hx->mu);
    return state;
}

int64_t tep_hx_nanoseconds(tep_hx *hx, int64_t ticket) {
    pthread_mutex_lock(&hx->mu);
    int64_t ns = ticket <= hx->head && ticket > hx->head - (RING - 1) ? hx->nanos[ticket % RING] : -1;
    pthread_mutex_unlock(&hx->mu);
    return ns;
}
