/* Host experts on native threads: a decode call's cold experts, weighted and summed per token, computed by
 * an engine of POSIX threads that runs no Python and no OpenMP (thunderep/moe/host_native.py says why).
 *
 * A job: once the GPU's stream has written `stamp` (or a later number) into `*ready`, the pairs of ids [T*K]
 * (local slot, -1 for another rank's) whose slot is not hot are grouped by slot; out [T, D] (float32) is
 * set to sum over those pairs of w[pair] * down[s] @ act(gate) * up, [gate | up] = gate_up[s] @ x[token]
 * (+ biases), in float32 from the held dtype; then `*flag` is raised to `number` (wrap-around compare).
 * A job with `consume` set stores 0 into `*ready` once its stamp has arrived: a stream that writes the same
 * stamp every time (a CUDA graph's fixed values) gives each job its own arrival.
 * Jobs run one after another in submission order. */

#ifndef TEP_HOST_EXPERTS_H
#define TEP_HOST_EXPERTS_H

#include <stdint.h>

enum { TEP_HX_F32 = 0, TEP_HX_BF16 = 1, TEP_HX_F16 = 2 };
enum { TEP_HX_SILU = 0, TEP_HX_GELU = 1, TEP_HX_GELU_TANH = 2, TEP_HX_RELU = 3 };
enum { TEP_HX_PENDING = 0, TEP_HX_DONE = 1, TEP_HX_NO_STAMP = 2, TEP_HX_BAD_SLOT = 3, TEP_HX_NO_MEMORY = 4,
       TEP_HX_UNKNOWN = 5 };

typedef struct tep_hx_job {
    const int64_t *ids;          /* [T * K] */
    const void *w;               /* [T * K] routing weights, w_dtype */
    const void *x;               /* [T, D] token rows, x_dtype */
    const uint8_t *hot;          /* [S] nonzero: the slot is hot (computed elsewhere) */
    const void *gate_up;         /* [S, 2I, D], dtype */
    const void *down;            /* [S, D, I], dtype */
    const void *gate_up_bias;    /* [S, 2I] or NULL, dtype */
    const void *down_bias;       /* [S, D] or NULL, dtype */
    float *out;                  /* [T, D] */
    volatile uint32_t *ready;    /* the stream's stamps */
    volatile uint32_t *flag;     /* the number the stream waits for */
    int64_t T, K, D, I, S;
    int64_t spins;               /* polls of *ready before the job fails (TEP_HX_NO_STAMP) */
    uint32_t stamp, number;
    int consume;                 /* nonzero: *ready set to 0 once the stamp has arrived */
    int dtype, x_dtype, w_dtype, act, interleaved;
} tep_hx_job;

typedef struct tep_hx tep_hx;

tep_hx *tep_hx_create(int threads);
void tep_hx_destroy(tep_hx *hx);
/* Queue a copy of *job; returns its ticket (> 0), or 0 when the queue is full. */
int64_t tep_hx_submit(tep_hx *hx, const tep_hx_job *job);
/* The state of a ticket: TEP_HX_PENDING, TEP_HX_DONE or an error code. */
int tep_hx_state(tep_hx *hx, int64_t ticket);
/* Wait up to timeout_s for a ticket; returns its state (TEP_HX_PENDING on timeout). */
int tep_hx_wait(tep_hx *hx, int64_t ticket, double timeout_s);
/* Nanoseconds an ended ticket's job computed (from its stamp's arrival to its sums; 0 for a failed one),
 * or -1 for a ticket not ended or too old to be known. */
int64_t tep_hx_nanoseconds(tep_hx *hx, int64_t ticket);
/* flag raised to number unless it is there or past it (wrap-around compare), atomically. */
void tep_hx_raise(volatile uint32_t *flag, uint32_t number);

#endif
