/* A race check of the native host engine (native/host_experts.c) under ThreadSanitizer: 200 jobs on 4
 * threads, each released by its stamp like a stream would, each raising the flag and giving the first
 * job's sums bit for bit. Built and run by tests/moe/test_host_native.py. */
#include "host_experts.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(void) {
    int64_t S = 6, D = 40, I = 24, T = 3, K = 3;
    float *gu = malloc(sizeof(float) * S * 2 * I * D), *dn = malloc(sizeof(float) * S * D * I);
    for (int64_t i = 0; i < S * 2 * I * D; i++) gu[i] = (float)((i * 7919) % 101) / 101.0f - 0.5f;
    for (int64_t i = 0; i < S * D * I; i++) dn[i] = (float)((i * 104729) % 97) / 97.0f - 0.5f;
    float x[3 * 40], w[9], out[3 * 40], first[3 * 40];
    for (int i = 0; i < 120; i++) x[i] = (float)(i % 13) / 13.0f;
    for (int i = 0; i < 9; i++) w[i] = 0.1f * (float)(i + 1);
    int64_t ids[9] = {4, 0, -1, 0, 2, 4, -1, 5, 1};
    uint8_t hot[6] = {0, 1, 0, 0, 0, 0};
    volatile uint32_t ready = 0, flag = 0;
    tep_hx *hx = tep_hx_create(4);
    tep_hx_job job;
    memset(&job, 0, sizeof job);
    job.ids = ids; job.w = w; job.x = x; job.hot = hot; job.gate_up = gu; job.down = dn; job.out = out;
    job.ready = &ready; job.flag = &flag; job.T = T; job.K = K; job.D = D; job.I = I; job.S = S;
    job.spins = 1 << 26; job.dtype = TEP_HX_F32; job.x_dtype = TEP_HX_F32; job.w_dtype = TEP_HX_F32;
    int64_t last = 0;
    for (uint32_t n = 1; n <= 200; n++) {
        job.stamp = n; job.number = n;
        last = tep_hx_submit(hx, &job);
        __atomic_store_n(&ready, n, __ATOMIC_RELEASE);
        int st = tep_hx_wait(hx, last, 10.0);
        if (st != TEP_HX_DONE) { printf("state %d\n", st); return 1; }
        if (n == 1) memcpy(first, out, sizeof out);
        else if (memcmp(first, out, sizeof out)) { printf("differs at %u\n", n); return 1; }
    }
    printf("ok flag %u\n", flag);
    tep_hx_destroy(hx);
    return 0;
}
