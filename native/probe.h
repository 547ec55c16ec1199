/* The balancer probe's per-call loops; see probe.c. Arrays are contiguous, n elements each. */
#ifndef THUNDEREP_PROBE_H
#define THUNDEREP_PROBE_H

#include <stdint.h>

enum { TEP_PROBE_OK = 0, TEP_PROBE_UNHANDLED = 1 };

/* counts_out = counts as double; ema_out = prev * keep + counts * alpha (prev NULL: the counts). */
int tep_probe_ema_i64(const int64_t *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n);
int tep_probe_ema_f64(const double *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n);
/* load = ema rounded half to even, clamped to [0, 2^31 - 1], as int32 and as double. */
int tep_probe_load(const double *ema, int64_t n, int32_t *load, double *load_f);
/* codes = floor(max(x, cold) / width) as int16, x the octaves of counts c (fingerprint.py);
   *hash = XXH3-64 of the codes' bytes. */
int tep_probe_plain(const double *c, int64_t n, double width, double cold, int16_t *codes,
                    uint64_t seed, uint64_t *hash);
/* codes of counts c relative to a baseline (fingerprint.py's formulas); *hash as above. */
int tep_probe_relative(const double *c, int64_t n, const double *counts_b, const double *x_b,
                       const double *code_b, double total_b, double variance_b, double variance,
                       double z, double width, double cold, int16_t *codes, uint64_t seed,
                       uint64_t *hash);

#endif
