/* Row kernels over a step's logits [R, V] (fp32): greedy argmax and inverse-CDF sampling.
 *
 * Why our own: on the embedded model (vocab 32,000, hidden 256) the head's logits are the
 * largest tensor of a decode step, and torch's CPU ops over them cost more than the head's
 * matmul share: argmax over 44 rows 2.5 ms (it is not vectorised), and the sampler's softmax,
 * float64 cumulative sum and searchsorted ~0.1-0.3 ms a row (docs/benchmarks.md, session 22).
 * Both are single passes over memory here.
 *
 * Sampling is the inverse CDF of softmax(logits / T): m = max, e_j = exp((l_j - m) / T), and
 * the pick is the first j whose running sum of e exceeds u * sum(e), u uniform in [0, 1) from
 * the caller (so seeded requests stay reproducible). Pass 1 is the max; pass 2 the sums of e
 * over blocks of 256 (float inside a block, double across blocks); pass 3 finds the block,
 * then recomputes that block's 256 exponentials and scans them. No scratch buffer.
 *
 * exp is our own (2^t by a degree-7 polynomial of the fraction and the exponent's bits,
 * relative error ~1e-7 on the range used), written with GCC vector extensions like gemv.c,
 * so it runs VL lanes at a time on whatever `-march=native` offers, without libm.
 */
#ifndef TG_ROWS_C /* included by gemv_bf16.c, decode*.c and attn_bf16.c as well */
#define TG_ROWS_C
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256
#define REP_MAX 16 /* query heads per KV head the decode attention takes (nh / nkv) */
#define HD_MAX 256 /* head_dim the bf16 decode attention takes (its fp32 sums) */

#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define VL (VBYTES / 4)
typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4))); /* unaligned access */
typedef int32_t vi __attribute__((vector_size(VBYTES)));

/* e^x for x <= 0, VL at a time; below -87 the result is 0 (under float's normal range). */
static inline vf vexp_neg(vf x) {
    vi under = x < -87.0f;
    vf t = (x * 1.44269504088896341f) * (vf)(~under & (vi)((vf){} + 1.0f)); /* log2(e) */
    vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    vf f = (t - n) * 0.693147180559945309f;  /* |f| <= ln2 / 2 */
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 +
           f * (1.0f / 720 + f * (1.0f / 5040)))))));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~under);
}

static float row_max(const float *x, long n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (long j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* First index of the maximum; a NaN anywhere wins (as torch.argmax), at its first index.
 * The maximum of each block of BLOCK is vectorised; only the first block holding the row's
 * maximum (or a NaN) is scanned element by element. */
static long row_argmax(const float *x, long n) {
    float m = row_max(x, n);
    for (long j0 = 0; j0 < n; j0 += BLOCK) {
        long len = j0 + BLOCK < n ? BLOCK : n - j0;
        float bm = row_max(x + j0, len);
        int nan = 0;
#pragma omp simd reduction(| : nan)
        for (long j = 0; j < len; j++) nan |= x[j0 + j] != x[j0 + j];
        if (bm == m || nan)
            for (long j = j0; j < j0 + len; j++)
                if (x[j] == m || x[j] != x[j]) return j;
    }
    return 0;
}

/* e[j] = exp((x[j] - m) * inv_t) for j < n (n <= BLOCK); returns their sum. */
static float block_exp(const float *x, long n, float m, float inv_t, float *e) {
    long j = 0;
    vf acc = {};
    for (; j + VL <= n; j += VL) {
        vf v = vexp_neg((*(const vfu *)(x + j) - m) * inv_t);
        *(vfu *)(e + j) = v;
        acc += v;
    }
    float s = 0.0f;
    for (int k = 0; k < VL; k++) s += acc[k];
    for (; j < n; j++) { /* the tail, through a vector with one live lane */
        vf v = (vf){} - 100.0f;
        v[0] = (x[j] - m) * inv_t;
        e[j] = vexp_neg(v)[0];
        s += e[j];
    }
    return s;
}

static long row_sample(const float *x, long n, float inv_t, double u) {
    float m = row_max(x, n);
    if (!isfinite(m)) return row_argmax(x, n);
    long blocks = (n + BLOCK - 1) / BLOCK;
    double sums[blocks];
    float e[BLOCK];
    double total = 0.0;
    for (long b = 0; b < blocks; b++) {
        long j0 = b * BLOCK, len = j0 + BLOCK < n ? BLOCK : n - j0;
        sums[b] = block_exp(x + j0, len, m, inv_t, e);
        total += sums[b];
    }
    if (!(total > 0.0) || !isfinite(total)) return row_argmax(x, n); /* a NaN in the row */
    double target = u * total, acc = 0.0;
    long b = 0;
    while (b < blocks - 1 && acc + sums[b] <= target) acc += sums[b++];
    long j0 = b * BLOCK, len = j0 + BLOCK < n ? BLOCK : n - j0, last = -1;
    block_exp(x + j0, len, m, inv_t, e);
    for (long j = 0; j < len; j++) {
        if (e[j] > 0.0f) last = j0 + j;
        acc += e[j];
        if (acc > target && e[j] > 0.0f) return j0 + j;
    }
    /* rounding left the target past the block's end: the last token with any weight */
    if (last >= 0) return last;
    return row_argmax(x, n);
}

/* out[i] = argmax of row rows[i] of x (row stride ld, n columns). */
void tg_argmax_rows(const float *x, long ld, const long *rows, long nrows, long n, long *out,
                    int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nrows > 1)
    for (long i = 0; i < nrows; i++) out[i] = row_argmax(x + rows[i] * ld, n);
}

/* out[i] = a token sampled from softmax(row rows[i] / temperature) with uniform u[i];
 * inv_temp[i] = 1 / temperature (> 0). */
void tg_sample_rows(const float *x, long ld, const long *rows, long nrows, long n,
                    const float *inv_temp, const double *u, long *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nrows > 1)
    for (long i = 0; i < nrows; i++) out[i] = row_sample(x + rows[i] * ld, n, inv_temp[i], u[i]);
}



/* ---- vector helpers of the decode attention (attend.c) and the bf16 row ops ---- */

/* The sum of v's lanes, as a tree (a serial sum of 16 lanes is 15 dependent adds: it was the
 * decode attention's bottleneck, one per key and query head). */
static inline float vsum(vf v) {
#if VBYTES == 64
    return _mm512_reduce_add_ps((__m512)v);
#elif VBYTES == 32
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.0f;
    for (int k = 0; k < VL; k++) s += v[k];
    return s;
#endif
}

/* bf16 <-> fp32, VL lanes: bf16 is the top half of an fp32; rounding to nearest even with NaN
 * kept quiet, as c10::BFloat16 rounds (so a bf16 model's kernel output rounds as torch's). */
typedef uint16_t vh __attribute__((vector_size(VBYTES / 2)));
typedef uint16_t vhu __attribute__((vector_size(VBYTES / 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));

static inline vf load_bf16(const uint16_t *p) {
#if VBYTES == 64 /* one vpmovzxwd (the generic conversion went through 128-bit halves) */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vhu *)p, vu) << 16);
#endif
}

#if VBYTES == 64 && defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* Where the hardware rounds as c10 does: vcvtneps2bf16 rounds to nearest even, but flushes
 * denormal inputs to zero and keeps a NaN's sign and payload, so a vector holding either takes
 * the integer path below. */
#define HW_RNE 1
static inline int hw_rne_ok(vf v) { return _mm512_fpclass_ps_mask((__m512)v, 0xA1) == 0; }
#endif

/* fp32 rounded to the nearest bf16, as an fp32 (its low half zero); NaN -> the quiet NaN. */
static inline vf rne(vf v) {
#ifdef HW_RNE
    if (__builtin_expect(hw_rne_ok(v), 1))
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)v)), 16);
#endif
    vu b = (vu)v;
    vu r = ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) << 16;
    vi nan = v != v;
    return (vf)((nan & (vi)((vu){} + 0x7FC00000u)) | (~nan & (vi)r));
}

static inline void store_bf16(uint16_t *p, vf v) {
#ifdef HW_RNE
    if (__builtin_expect(hw_rne_ok(v), 1)) {
        _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
        return;
    }
#endif
#if VBYTES == 64
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)rne(v), 16)));
#else
    *(vhu *)p = __builtin_convertvector((vu)rne(v) >> 16, vh);
#endif
}

/* VL elements at p + i as fp32: the element type is a constant at every call site. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
ALWAYS_INLINE vf load_at(const void *p, long i, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : *(const vfu *)((const float *)p + i);
}

ALWAYS_INLINE void store_at(void *p, long i, vf v, const int bf16) {
    if (bf16)
        store_bf16((uint16_t *)p + i, v);
    else
        *(vfu *)((float *)p + i) = v;
}

#include "attend.c" /* the paged decode attention */

int tg_rows_abi(void) { return 8; }
/* ---- fused elementwise ops of a forward (fp32, rows of a contiguous [T, ...] tensor) ---- */

/* y = w * (x * rsqrt(mean(x^2) + eps)) over one row of H floats, H % VL == 0. */
static inline void rms_row(const float *x, const float *w, float *y, long H, float eps) {
    vf acc = {};
    for (long d = 0; d < H; d += VL) {
        vf v = *(const vfu *)(x + d);
        acc += v * v;
    }
    float r = 1.0f / sqrtf(vsum(acc) / (float)H + eps);
    for (long d = 0; d < H; d += VL)
        *(vfu *)(y + d) = *(const vfu *)(w + d) * (*(const vfu *)(x + d) * r);
}

/* y[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), H % VL == 0. */
void tg_rms_norm(const float *x, const float *w, float *y, long T, long H, float eps) {
    for (long t = 0; t < T; t++) rms_row(x + t * H, w, y + t * H, H, eps);
}

/* silu(a) = a * sigmoid(a), with e = e^-|a| (the exp's argument <= 0): sigmoid(a) is
 * 1 / (1 + e) for a >= 0 and e / (1 + e) below, which keeps its relative precision where it is
 * tiny (1 - 1 / (1 + e) would cancel: ~1% off at a = -12). */
static inline vf silu(vf a) {
    vi neg = a < 0.0f;
    vf e = vexp_neg((vf)((vi)a | ((vi){} + INT32_MIN))); /* e^-|a|: the sign bit set */
    vf num = (vf)(((vi)e & neg) | ((vi)((vf){} + 1.0f) & ~neg));
    return a * (num / (1.0f + e));
}

/* y[i] = silu(g[i]) * u[i] over I floats, I % VL == 0. */
static inline void silu_row(const float *g, const float *u, float *y, long I) {
    for (long i = 0; i < I; i += VL)
        *(vfu *)(y + i) = silu(*(const vfu *)(g + i)) * *(const vfu *)(u + i);
}

/* y[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I], I % VL == 0. */
void tg_silu_mul(const float *gu, float *y, long T, long I) {
    for (long t = 0; t < T; t++) silu_row(gu + t * 2 * I, gu + t * 2 * I + I, y + t * I, I);
}

/* Rotate-half RoPE in place on `heads` heads of hd floats at v, c / s [hd]:
 * x1' = x1 c - x2 s, x2' = x2 c + x1 s over the two halves. */
static inline void rope_row(float *v, long heads, long hd, const float *c, const float *s) {
    long half = hd / 2;
    for (long h = 0; h < heads; h++, v += hd)
        for (long i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = b * c[i + half] + a * s[i + half];
        }
}

/* ---- the same three ops on bf16 rows, rounding where torch's bf16 ops round ----
 * RMSNorm: transformers normalises in fp32, rounds to bf16, then multiplies by the bf16
 * weight (rounded again); silu(gate) rounds, then the product with up rounds; RoPE rounds each
 * product and then their sum. Sums run in fp32. Rows are split over OpenMP threads (a prefill
 * step has thousands); H, I and hd % VL == 0. */

/* 1 / sqrt(mean(x^2) + eps) of a bf16 row of H (H % VL == 0): RMSNorm's scale. */
static inline float rms_scale_bf16(const uint16_t *xr, long H, float eps) {
    /* four chains of sums of squares: one chain waited on each FMA's latency (~4 cycles a
     * vector, 2-3x the loads' pace; session 35) */
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    long d = 0;
    for (; d + 4 * VL <= H; d += 4 * VL) {
        vf v0 = load_bf16(xr + d), v1 = load_bf16(xr + d + VL);
        vf v2 = load_bf16(xr + d + 2 * VL), v3 = load_bf16(xr + d + 3 * VL);
        a0 += v0 * v0, a1 += v1 * v1, a2 += v2 * v2, a3 += v3 * v3;
    }
    for (; d < H; d += VL) {
        vf v = load_bf16(xr + d);
        a0 += v * v;
    }
    return 1.0f / sqrtf(vsum((a0 + a1) + (a2 + a3)) / (float)H + eps);
}

/* y[d] = w[d] * bf16(x[d] * r) rounded, for d in [0, n) (n % VL == 0): RMSNorm's output. */
static inline void rms_apply_bf16(const uint16_t *xr, const uint16_t *w, float r, uint16_t *y,
                                  long n) {
    for (long d = 0; d < n; d += VL)
        store_bf16(y + d, load_bf16(w + d) * rne(load_bf16(xr + d) * r));
}

static inline void rms_row_bf16(const uint16_t *xr, const uint16_t *w, uint16_t *y, long H,
                                float eps) {
    rms_apply_bf16(xr, w, rms_scale_bf16(xr, H, eps), y, H);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* 2^t for finite t <= ~0, for results rounded to bf16 right after (2^-9): u = t - floor(t) in
 * [0, 1) by one vreduceps, 2^u by a degree-4 polynomial fitted to its relative error there
 * (~2.6e-6), times 2^floor(t) by vscalefps (which floors t itself); below 2^-126 a denormal
 * or 0 (vcvtneps2bf16 flushes both to 0), so no range mask. The prefill attention's P
 * (attn_bf16.c) and silu_bf16. History: session 33's exp_p (degree 5 after (s - max) * scale
 * * log2(e), a range mask) -> the caller's argument in one FMA and a degree-4 Taylor
 * polynomial after vrndscaleps, a 2 x 512 attention call 0.943x, then 0.956x (session 36);
 * vreduceps for vrndscaleps and the subtraction 0.963x / 0.966x, and 0.959x with the builds
 * in the other order (session 37). */
static inline vf vexp2_bf16(vf t) {
    vf u = (vf)_mm512_reduce_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    vf p = 1.00000261f +
           u * (0.693003626f + u * (0.241443205f + u * (0.0520113513f + u * 0.0135339777f)));
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)t);
}

/* silu for the bf16 paths, whose result is rounded to bf16 right after: e^-|a| as
 * vexp2_bf16(-|a| log2(e)), and 1 / (1 + e) by vrcp14ps and one Newton step (~1e-7), where
 * silu has a degree-7 exp and a division for fp32: ~3e-6 relative in all. w13 + norm + silu at
 * 1,024 rows 0.901x / 0.973x (the two builds in either order; session 37): the deferred silu
 * store's vector work had slowed the tile loop it runs inside. */
static inline vf silu_bf16(vf a) {
    vf e = vexp2_bf16((vf)_mm512_mul_ps(_mm512_abs_ps((__m512)a),
                                        _mm512_set1_ps(-1.44269504088896341f)));
    __m512 d = _mm512_add_ps((__m512)e, _mm512_set1_ps(1.0f)), r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))); /* r (2 - d r) */
    __mmask16 neg = _mm512_cmp_ps_mask((__m512)a, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), neg, (__m512)e); /* sigmoid: num / d */
    return (vf)_mm512_mul_ps((__m512)a, _mm512_mul_ps(num, r));
}
#else
static inline vf silu_bf16(vf a) { return silu(a); }
#endif

static inline void silu_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *y, long I) {
    for (long i = 0; i < I; i += VL)
        store_bf16(y + i, rne(silu_bf16(load_bf16(g + i))) * load_bf16(u + i));
}

/* Rotate-half RoPE in place on `heads` bf16 heads of hd at v, c / s [hd] bf16, each product
 * and then their sum rounded as torch's bf16 ops round. The row's cos / sin are widened to fp32
 * once for all its heads, a slice of up to HD_MAX / 2 of each half at a time (they had been
 * widened again in every head, since the compiler cannot tell that they do not alias v): M's
 * 1,024-row RoPE + K/V pass 0.270 -> 0.236 ms, medians of 40 (session 36). */
static inline void rope_row_bf16(uint16_t *v, long heads, long hd, const uint16_t *c,
                                 const uint16_t *s) {
    enum { W = HD_MAX / 2 }; /* cw / sw: [the slice of the first half | of the second] */
    float cw[2 * W] __attribute__((aligned(64))), sw[2 * W] __attribute__((aligned(64)));
    long half = hd / 2;
    for (long i0 = 0; i0 < half; i0 += W) {
        long w = half - i0 < W ? half - i0 : W;
        for (long i = 0; i < w; i += VL) {
            *(vfu *)(cw + i) = load_bf16(c + i0 + i);
            *(vfu *)(cw + W + i) = load_bf16(c + half + i0 + i);
            *(vfu *)(sw + i) = load_bf16(s + i0 + i);
            *(vfu *)(sw + W + i) = load_bf16(s + half + i0 + i);
        }
        for (long h = 0; h < heads; h++) {
            uint16_t *lo = v + h * hd + i0, *hi = lo + half;
            for (long i = 0; i < w; i += VL) {
                vf a = load_bf16(lo + i), b = load_bf16(hi + i);
                vf a2 = rne(a * *(vfu *)(cw + i)) + rne(-b * *(vfu *)(sw + i));
                vf b2 = rne(b * *(vfu *)(cw + W + i)) + rne(a * *(vfu *)(sw + W + i));
                store_bf16(lo + i, a2);
                store_bf16(hi + i, b2);
            }
        }
    }
}

void tg_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long T, long H,
                      float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 16)
    for (long t = 0; t < T; t++) rms_row_bf16(x + t * H, w, y + t * H, H, eps);
}

void tg_silu_mul_bf16(const uint16_t *gu, uint16_t *y, long T, long I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 16)
    for (long t = 0; t < T; t++) silu_row_bf16(gu + t * 2 * I, gu + t * 2 * I + I, y + t * I, I);
}

/* RoPE in place on the first `heads` heads of each row of x [T, ld] (fp32, or bf16 rounded as
 * torch's bf16 ops round), cos / sin [T, hd] in x's dtype; with slots, row t's last nkv
 * rotated heads (K) and the nkv heads after them (V) also copied into slot slots[t] of k_cache
 * / v_cache ([slots][nkv][hd]): the step's KV write in the same pass over the rows, instead of
 * two index_copy_ calls reading K and V back (session 35). Padding rows may share a slot (the
 * null block's): their copies race there, as index_copy_'s would, to garbage nobody reads. */
void tg_rope_kv(void *x, long ld, long T, long heads, long hd, const void *cos_t,
                const void *sin_t, int bf16, long nkv, const long *slots, void *k_cache,
                void *v_cache, int nthreads) {
    long es = bf16 ? 2 : 4, kv_bytes = nkv * hd * es;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 16)
    for (long t = 0; t < T; t++) {
        char *row = (char *)x + t * ld * es;
        if (bf16)
            rope_row_bf16((uint16_t *)row, heads, hd, (const uint16_t *)cos_t + t * hd,
                          (const uint16_t *)sin_t + t * hd);
        else
            rope_row((float *)row, heads, hd, (const float *)cos_t + t * hd,
                     (const float *)sin_t + t * hd);
        if (!slots) continue;
        const char *k = row + (heads - nkv) * hd * es;
        memcpy((char *)k_cache + slots[t] * kv_bytes, k, (size_t)kv_bytes);
        memcpy((char *)v_cache + slots[t] * kv_bytes, k + kv_bytes, (size_t)kv_bytes);
    }
}

/* y[i] = x[i] rounded to bf16 as every bf16 kernel here rounds (rne, store_bf16): the self-check
 * holds it to torch's conversion bit for bit, special values included. */
void tg_round_bf16(const float *x, uint16_t *y, long n) {
    long i = 0;
    for (; i + VL <= n; i += VL) store_bf16(y + i, *(const vfu *)(x + i));
    for (; i < n; i++) {
        vf v = {};
        v[0] = x[i];
        y[i] = (uint16_t)(((vu)rne(v))[0] >> 16);
    }
}

int tg_rows_lanes(void) { return VL; }

#endif /* TG_ROWS_C */
