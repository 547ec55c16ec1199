/* The balancer probe's per-call loops (thunderep/balance/probe_math.py is the only caller).
 *
 * The EMA loop performs, per expert, the same IEEE double operations in the same order as numpy's
 * `prev * (1 - alpha) + counts * alpha`, so its results are bit-identical (FP contraction into FMA is
 * off: the builder passes -ffp-contract=off; excess precision is refused below).
 *
 * The code loops reproduce fingerprint.py's codes, whose reference takes the sum of the counts and the
 * log2 from torch. Here the sum is taken in index order and the log2 from libm, and every decision is
 * certified against the reference's rounding instead of copied from it:
 *   - any summation order of n values >= 0 is within (n-1) u S of their sum S (u = 2^-53), so the
 *     reference's total lies in [T - 2 n eps T, T + 2 n eps T] (eps = 2u; twice the bound needed);
 *   - every later step (+, *, /, sqrt, max, the ratio and the noise) is a correctly rounded, monotone
 *     function of that total, so evaluating it, in the reference's operation order, at both ends of the
 *     total's interval bounds the reference's value of it;
 *   - log2 (torch's and libm's within 1 ulp of the true value) is bounded by widening by LOG2_SLACK;
 *   - an expert whose count is surely not significant keeps the baseline's code whatever its octave,
 *     so its log2 is not taken.
 * An expert's code is taken only when every value in these intervals gives the same code; otherwise the
 * call returns TEP_PROBE_UNHANDLED and the caller computes it with the reference. The same happens for
 * a negative, NaN or infinite count or EMA (the reference's NaN propagation), a huge total, or a code
 * outside int16 (the reference's platform-defined cast).
 */

#include "probe.h"

#include <float.h>
#include <math.h>

#define XXH_INLINE_ALL
#define XXH_NO_STREAM
#include "third_party/xxhash/xxhash.h"

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the probe loops need double arithmetic without excess precision (FLT_EVAL_METHOD == 0)"
#endif

#define LOG2_SLACK 0x1p-40      /* relative; a log2 within 1 ulp needs 2^-51 */
#define MAX_TOTAL 1e300         /* larger totals go to the reference */

static int valid_count(double v) { return v >= 0.0 && v <= DBL_MAX; } /* false for NaN, inf, < 0 */

/* counts_out = counts; ema_out = prev * keep + counts * alpha, or the counts without a previous EMA. */
#define EMA_LOOP(COUNT)                                                         \
    for (int64_t e = 0; e < n; e++) {                                           \
        double c = (COUNT);                                                     \
        double v = prev ? prev[e] * keep + c * alpha : c;                       \
        if (!valid_count(c) || !valid_count(v)) return TEP_PROBE_UNHANDLED;     \
        counts_out[e] = c;                                                      \
        ema_out[e] = v;                                                         \
    }                                                                           \
    return TEP_PROBE_OK

int tep_probe_ema_i64(const int64_t *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n) {
    EMA_LOOP((double)counts[e]);
}

int tep_probe_ema_f64(const double *counts, const double *prev, double keep, double alpha,
                      double *counts_out, double *ema_out, int64_t n) {
    EMA_LOOP(counts[e]);
}

/* load = clamp(round half to even(ema), 0, 2^31 - 1) as int32 and as double: torch's
 * ema.round().clamp_(0, 2**31 - 1).to(torch.int32), exact for finite values >= 0. */
int tep_probe_load(const double *ema, int64_t n, int32_t *load, double *load_f) {
    for (int64_t e = 0; e < n; e++) {
        if (!valid_count(ema[e])) return TEP_PROBE_UNHANDLED;
        double r = nearbyint(ema[e]);
        r = r > 2147483647.0 ? 2147483647.0 : r;
        load[e] = (int32_t)r;
        load_f[e] = r;
    }
    return TEP_PROBE_OK;
}

/* The total's interval [*lo, *hi] (see the top); 0 when a count is invalid or the total is huge. */
static int total_bounds(const double *c, int64_t n, double *lo, double *hi, double *mid) {
    double t = 0.0;
    for (int64_t e = 0; e < n; e++) {
        if (!valid_count(c[e])) return 0;
        t += c[e];
    }
    if (!(t <= MAX_TOTAL)) return 0;
    double slack = 2.0 * (double)n * DBL_EPSILON * t;
    *lo = t - slack < 0.0 ? 0.0 : t - slack;
    *hi = t + slack;
    *mid = t;
    return 1;
}

/* The interval of max(log2((c + 1/2) * n / (total + n/2)), cold) over the total's interval, from one
 * log2 at this loop's total: over [t_lo, t_hi] the factor n / (total + n/2) moves by a relative
 * 2 n eps at most, and each product by u, so the log2 moves by less than 8 n eps. */
static void octave_bounds(double c, double factor, int64_t n, double cold, double *lo, double *hi) {
    double x = log2((c + 0.5) * factor);
    double slack = LOG2_SLACK * (1.0 + fabs(x)) + 8.0 * (double)n * DBL_EPSILON;
    *lo = x - slack < cold ? cold : x - slack;
    *hi = x + slack < cold ? cold : x + slack;
}

static int to_int16(double code, int16_t *out) {
    if (!(code >= -32768.0 && code <= 32767.0)) return 0;
    *out = (int16_t)code;
    return 1;
}

int tep_probe_plain(const double *c, int64_t n, double width, double cold, int16_t *codes,
                    uint64_t seed, uint64_t *hash) {
    double t_lo, t_hi, t;
    if (!total_bounds(c, n, &t_lo, &t_hi, &t)) return TEP_PROBE_UNHANDLED;
    double factor = (double)n / (t + 0.5 * (double)n);
    for (int64_t e = 0; e < n; e++) {
        double x_lo, x_hi;
        octave_bounds(c[e], factor, n, cold, &x_lo, &x_hi);
        double code = floor(x_lo / width);
        if (code != floor(x_hi / width) || !to_int16(code, &codes[e])) return TEP_PROBE_UNHANDLED;
    }
    *hash = XXH3_64bits_withSeed(codes, (size_t)n * sizeof(int16_t), seed);
    return TEP_PROBE_OK;
}

/* -1, 0 or +1: d < -half_width, |d| <= half_width, d > half_width. */
static int side(double d, double half_width) { return d > half_width ? 1 : (d < -half_width ? -1 : 0); }

int tep_probe_relative(const double *c, int64_t n, const double *counts_b, const double *x_b,
                       const double *code_b, double total_b, double variance_b, double variance,
                       double z, double width, double cold, int16_t *codes, uint64_t seed,
                       uint64_t *hash) {
    double t_lo, t_hi, t;
    if (!total_bounds(c, n, &t_lo, &t_hi, &t)) return TEP_PROBE_UNHANDLED;
    double factor = (double)n / (t + 0.5 * (double)n);
    double r_lo = total_b > 0 ? t_lo / total_b : 0.0, r_hi = total_b > 0 ? t_hi / total_b : 0.0;
    double noise_lo = 0.5 * z * sqrt(variance + variance_b * r_lo);
    double noise_hi = 0.5 * z * sqrt(variance + variance_b * r_hi);
    double half_width = 0.5 * width;
    for (int64_t e = 0; e < n; e++) {
        /* significant: |sqrt(c + 3/8) - sqrt(cb * ratio + 3/8)| > noise */
        double a = sqrt(c[e] + 0.375);
        double diff_hi = a - sqrt(counts_b[e] * r_lo + 0.375), diff_lo = a - sqrt(counts_b[e] * r_hi + 0.375);
        double abs_min = diff_lo > 0.0 ? diff_lo : (diff_hi < 0.0 ? -diff_hi : 0.0);
        double abs_max = fabs(diff_lo) > fabs(diff_hi) ? fabs(diff_lo) : fabs(diff_hi);
        double step = 0.0;
        if (!(abs_max <= noise_lo)) {  /* maybe significant: moved off the baseline's code? */
            double x_lo, x_hi;
            octave_bounds(c[e], factor, n, cold, &x_lo, &x_hi);
            int s_lo = side(x_lo - x_b[e], half_width), s_hi = side(x_hi - x_b[e], half_width);
            if (s_lo != s_hi || (s_lo != 0 && !(abs_min > noise_hi))) return TEP_PROBE_UNHANDLED;
            step = (double)s_lo;  /* |x - xb| > W / 2 towards sign(x - xb), or 0 */
        }
        if (!to_int16(step + code_b[e], &codes[e])) return TEP_PROBE_UNHANDLED;
    }
    *hash = XXH3_64bits_withSeed(codes, (size_t)n * sizeof(int16_t), seed);
    return TEP_PROBE_OK;
}
