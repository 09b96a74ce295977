/* The bf16 linear: y[M, N] = x[M, K] @ W[N, K]^T, bf16 in and out, fp32 sums, for CPUs with
 * AVX512-BF16 (vdpbf16ps: AMD Zen 4, Intel Cooper Lake), on AMX tiles where the CPU has them
 * (Intel Sapphire Rapids and later; see "AMX" below).
 *
 * Why our own: at decode sizes the product is a few multiply-adds per weight, so the job is
 * to read every weight once at the memory's rate. oneDNN's bf16 kernel on a 2-core Zen 4
 * streams an 8-row decode's weights at 18-27 GB/s of the 27-55 GB/s the cores can read
 * (docs/benchmarks.md, issue 12, session 30).
 *
 * Weight layout (tg_bf16_pack): panels of P = 32 output columns, each [K/2][P][2] bf16: at
 * every pair of k, the P columns' two weights side by side, which is vdpbf16ps's operand
 * layout (each fp32 lane sums two products). A panel is one sequential stream; each k-pair is
 * two 64-byte vector loads, each multiplied into MB rows of x whose (k, k+1) pair is
 * broadcast as one 32-bit value, so 2 x MB fp32 accumulators live in registers and one load
 * feeds MB instructions (of 32 multiply-adds each). K is padded to even with a zero weight.
 *
 * Up to MB_MAX rows x is read in place (decode sizes: every weight is read exactly once).
 * Above, x is copied into chunks [K/2][MB_MAX] of pairs, and each panel runs against a group
 * of chunks that fits in L2 while it is in L1/L2.
 *
 * Threads: contiguous panel ranges, one per OpenMP thread (torch's libgomp serves the region
 * in a process that imported torch: one thread pool).
 *
 * Sums are fp32 in the kernel's own order and rounded to bf16 once (round to nearest even), as
 * oneDNN's bf16 matmul does; the two differ by summation order only.
 *
 * AMX (Sapphire Rapids and later; tg_bf16_set_amx(1)): the same panels are AMX's B operand as
 * they are: 16 k-pair rows of 16 columns x 2 bf16 is one 64-byte tile row, and the panel's
 * 128-byte k-pair stride is the tile's load stride, so one copy of each weight serves both
 * paths. Up to 16 rows one A tile (M rows of x, read in place) meets two panels' B tiles at a
 * time; above, x is copied into zero-padded blocks of 32 rows and each panel is a 2 x 2 grid of C
 * tiles. On a 2-core Xeon with AMX our vdpbf16ps path runs ~90-150 GFLOP/s, so an 8-row decode
 * is compute-bound on it, and oneDNN's AMX kernels stream small-M weights at 6-15 GB/s
 * (docs/benchmarks.md, issue 12, session 31). Needs K % 32 == 0 (else the vdpbf16ps path).
 * The tile code is gemv_amx.c, included below.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.c" /* silu and the bf16 roundings of the fused silu(gate) * up store */

/* The bf16 kernels also take AVX512-DQ (every CPU with AVX512-BF16 has it): rows.c's vexp2_bf16
 * (vreduceps) and the rounding checks (vfpclassps, rows.c's hw_rne_ok). */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VL__) &&               \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define TG_BF16 1
#else
#define TG_BF16 0
#endif

#if TG_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define TG_AMX 1
#else
#define TG_AMX 0
#endif

#define P 32           /* output columns per panel: two vectors of 16 fp32 lanes */
#define AMX_K 32       /* AMX: k per tile step (16 pairs) */
#define AMX_M 16       /* AMX: rows per A / C tile */
#define AMX_XB 32      /* AMX: rows per x block above AMX_M rows (a 2 x 2 grid of C tiles) */
#define MB_MAX 12      /* 24 accumulators + 2 weights + a broadcast within 32 registers */
#define L2_X_BYTES (512 * 1024)
#ifndef PF_PAIRS
#define PF_PAIRS 64 /* software prefetch distance in k-pairs (8 KiB of the panel stream) */
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Bytes of x copy the AMX path needs for M rows of K (0 up to 32 rows: x read in place; 0 in a
 * build without AMX). */
static long amx_copy_bytes(long M, long K) {
    return TG_AMX && M > AMX_XB ? (M + AMX_XB - 1) / AMX_XB * AMX_XB * K * 2 : 0;
}

int tg_bf16_panel_width(void) { return P; }
int tg_bf16_supported(void) { return TG_BF16; }

/* wp[(n / P) * Kp * 2P + kp * 2P + (n % P) * 2 + (k & 1)] = w[n * ldw + k], Kp = ceil(K / 2),
 * zero-padded to whole panels and to an even K. */
static void pack_rows(const uint16_t *w, long ldw, uint16_t *wp, long N, long K) {
    long panels = (N + P - 1) / P, kp_n = (K + 1) / 2;
#if defined(__AVX512F__)
    /* a panel's pairs of k are a transpose of 32-bit words: two gathers of 16 rows a pair (the
     * scalar loop below had been ~0.2 ms of a 2 x 512-token prefill attention call, packing
     * its keys; session 35). Rows past N read as zeros; the gathers' 32-bit word offsets
     * reach 15 rows. */
    if (K % 2 == 0 && ldw % 2 == 0 && ldw / 2 * 15 <= INT32_MAX && !((uintptr_t)w & 3)) {
        const int *w32 = (const int *)w;
        __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512i idx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)(ldw / 2)));
        for (long p = 0; p < panels; p++) {
            long rows = N - p * P < P ? N - p * P : P;
            uint32_t valid = rows == P ? 0xFFFFFFFFu : (1u << rows) - 1; /* P == 32 rows */
            __mmask16 lo = (__mmask16)valid, hi = (__mmask16)(valid >> 16);
            const int *b0 = w32 + p * P * (ldw / 2), *b1 = b0 + 16 * (ldw / 2);
            int *dst = (int *)(wp + p * kp_n * 2 * P);
            for (long kp = 0; kp < kp_n; kp++, dst += P) {
                __m512i z = _mm512_setzero_si512();
                _mm512_storeu_si512(dst, _mm512_mask_i32gather_epi32(z, lo, idx, b0 + kp, 4));
                _mm512_storeu_si512(dst + 16, _mm512_mask_i32gather_epi32(z, hi, idx, b1 + kp, 4));
            }
        }
        return;
    }
#endif
    for (long p = 0; p < panels; p++) {
        uint16_t *dst = wp + p * kp_n * 2 * P;
        for (long kp = 0; kp < kp_n; kp++)
            for (long j = 0; j < P; j++)
                for (long h = 0; h < 2; h++) {
                    long n = p * P + j, k = 2 * kp + h;
                    dst[kp * 2 * P + j * 2 + h] = n < N && k < K ? w[n * ldw + k] : 0;
                }
    }
}

void tg_bf16_pack(const uint16_t *w, uint16_t *wp, long N, long K) {
    long panels = (N + P - 1) / P, kp_n = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        long n0 = p * P, rows = N - n0 < P ? N - n0 : P;
        pack_rows(w + n0 * K, K, wp + p * kp_n * 2 * P, rows, K);
    }
}

#if TG_BF16

/* Round 16 fp32 lanes to bf16 and store them (a partial store for the last panel). */
ALWAYS_INLINE void store16(uint16_t *dst, __m512 v, long valid) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (valid >= 16)
        _mm256_storeu_si256((__m256i *)dst, h);
    else if (valid > 0)
        _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << valid) - 1), h);
}

/* 16 fp32 lanes rounded as store16 rounds them, back as fp32 (what a later op reads). */
ALWAYS_INLINE vf as_stored16(__m512 v) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16);
}

/* One panel against MB rows of x into y[0..MB)[n0..n0+nvalid). With DIRECT x is the rows
 * themselves (ldx apart, K even, read as 32-bit pairs), else a chunk [Kp][MB] of pairs. y is
 * bf16, or with OUT32 the fp32 sums (attn_bf16.c's scores and outputs; nvalid == P). */
ALWAYS_INLINE void panel_t(const uint16_t *restrict x, long ldx, const uint16_t *restrict wp,
                           long kp_n, void *restrict y, long ldy, long nvalid, const int MB,
                           const int DIRECT, const int OUT32) {
    __m512 a0[MB_MAX], a1[MB_MAX];
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    const uint32_t *x32 = (const uint32_t *)x;
#pragma GCC unroll 2
    for (long kp = 0; kp < kp_n; kp++) {
        const uint16_t *row = wp + kp * 2 * P;
        __builtin_prefetch(row + PF_PAIRS * 2 * P, 0, 2);
        __builtin_prefetch(row + PF_PAIRS * 2 * P + P, 0, 2);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + P);
#pragma GCC unroll 12
        for (int m = 0; m < MB; m++) {
            const uint32_t xv = DIRECT ? x32[m * (ldx / 2) + kp] : x32[kp * MB + m];
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xv);
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, b);
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, b);
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) {
        if (OUT32) {
            _mm512_storeu_ps((float *)y + m * ldy, a0[m]);
            _mm512_storeu_ps((float *)y + m * ldy + 16, a1[m]);
        } else {
            store16((uint16_t *)y + m * ldy, a0[m], nvalid);
            store16((uint16_t *)y + m * ldy + 16, a1[m], nvalid - 16);
        }
    }
}

ALWAYS_INLINE void panel(const uint16_t *restrict x, long ldx, const uint16_t *restrict wp,
                         long kp_n, uint16_t *restrict y, long ldy, long nvalid, const int MB,
                         const int DIRECT) {
    panel_t(x, ldx, wp, kp_n, y, ldy, nvalid, MB, DIRECT, 0);
}

#define DEFINE_PANEL(MB)                                                                       \
    static void panel_##MB(const uint16_t *x, long ldx, const uint16_t *wp, long kp_n,         \
                           uint16_t *y, long ldy, long nvalid) {                               \
        panel(x, ldx, wp, kp_n, y, ldy, nvalid, MB, 0);                                        \
    }                                                                                          \
    static void direct_##MB(const uint16_t *x, long ldx, const uint16_t *wp, long kp_n,        \
                            uint16_t *y, long ldy, long nvalid) {                              \
        panel(x, ldx, wp, kp_n, y, ldy, nvalid, MB, 1);                                        \
    }
DEFINE_PANEL(1)
DEFINE_PANEL(2)
DEFINE_PANEL(3)
DEFINE_PANEL(4)
DEFINE_PANEL(5)
DEFINE_PANEL(6)
DEFINE_PANEL(7)
DEFINE_PANEL(8)
DEFINE_PANEL(9)
DEFINE_PANEL(10)
DEFINE_PANEL(11)
DEFINE_PANEL(12)

typedef void (*panel_fn)(const uint16_t *, long, const uint16_t *, long, uint16_t *, long,
                         long);
static const panel_fn PANELS[MB_MAX + 1] = {
    0,       panel_1, panel_2, panel_3,  panel_4,  panel_5, panel_6,
    panel_7, panel_8, panel_9, panel_10, panel_11, panel_12,
};
static const panel_fn DIRECT[MB_MAX + 1] = {
    0,        direct_1, direct_2, direct_3,  direct_4,  direct_5, direct_6,
    direct_7, direct_8, direct_9, direct_10, direct_11, direct_12,
};

/* x rows [m0, m0 + mb) as pairs into xt[Kp][mb] (32-bit each; an odd K's last pair padded). */
static void pair_chunk(const uint16_t *x, long ldx, long K, long m0, long mb, uint32_t *xt) {
    long kp_n = (K + 1) / 2;
    for (long m = 0; m < mb; m++) {
        const uint16_t *row = x + (m0 + m) * ldx;
        for (long kp = 0; kp < kp_n; kp++) {
            uint32_t lo = row[2 * kp], hi = 2 * kp + 1 < K ? row[2 * kp + 1] : 0;
            xt[kp * mb + m] = lo | hi << 16;
        }
    }
}

/* The calling thread's number and the region's thread count (0 and 1 without OpenMP). */
#ifdef _OPENMP
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
static int thread_num(void) { return omp_get_thread_num(); }
static int thread_count(void) { return omp_get_num_threads(); }
#else
static int thread_num(void) { return 0; }
static int thread_count(void) { return 1; }
#endif

/* The calling thread's share [b, e) of `panels` panels, inside a parallel region. */
static void my_panels(long panels, long *b, long *e) {
    long t = thread_num(), nt = thread_count();
    *b = panels * t / nt;
    *e = panels * (t + 1) / nt;
}

#if TG_AMX
#include "gemv_amx.c"
#endif

/* Bytes of scratch linear_in_region needs for M rows of K (x's pairs or its AMX copy). */
static long linear_scratch_bytes(long M, long K, long ldx) {
#if TG_AMX
    if (amx_applies(K, ldx)) return amx_copy_bytes(M, K);
#endif
    return M <= MB_MAX && K % 2 == 0 && ldx % 2 == 0 ? 0 : M * ((K + 1) / 2) * 4;
}

static void linear_in_region(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y,
                             long ldy, long M, long N, long K, uint32_t *xt) {
#if TG_AMX
    if (amx_applies(K, ldx)) {
        amx_in_region(x, ldx, wp, y, ldy, M, N, K, xt);
        return;
    }
#endif
    long panels = (N + P - 1) / P, kp_n = (K + 1) / 2, b, e;
    long pstride = kp_n * 2 * P;
    if (M <= MB_MAX && K % 2 == 0 && ldx % 2 == 0) {
        my_panels(panels, &b, &e);
        for (long p = b; p < e; p++) {
            long n0 = p * P, nvalid = N - n0 < P ? N - n0 : P;
            DIRECT[M](x, ldx, wp + p * pstride, kp_n, y + n0, ldy, nvalid);
        }
        return;
    }
    long chunks = (M + MB_MAX - 1) / MB_MAX;
#pragma omp for schedule(static)
    for (long c = 0; c < chunks; c++) {
        long m0 = c * MB_MAX, mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
        pair_chunk(x, ldx, K, m0, mb, xt + m0 * kp_n);
    }
    /* (implicit barrier: every chunk is ready before any panel runs) */
    my_panels(panels, &b, &e);
    long group = L2_X_BYTES / (kp_n * MB_MAX * 4);
    if (group < 1) group = 1;
    for (long g0 = 0; g0 < chunks; g0 += group) {
        long g1 = g0 + group < chunks ? g0 + group : chunks;
        for (long p = b; p < e; p++) {
            long n0 = p * P, nvalid = N - n0 < P ? N - n0 : P;
            for (long c = g0; c < g1; c++) {
                long m0 = c * MB_MAX, mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
                PANELS[mb]((const uint16_t *)(xt + m0 * kp_n), 0, wp + p * pstride, kp_n,
                           y + m0 * ldy + n0, ldy, nvalid);
            }
        }
    }
}

/* y[m * ldy + n] = bf16(sum_k x[m * ldx + k] * W[n, k]), wp being W packed by tg_bf16_pack.
 * Returns 0, -1 on bad arguments, -2 if the x buffer cannot be allocated, -3 without
 * AVX512-BF16. */
int tg_bf16_linear(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                   long M, long N, long K, int nthreads) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ldy < N || nthreads < 1) return -1;
    long panels = (N + P - 1) / P;
    if (nthreads > panels) nthreads = (int)panels;
    uint32_t *xt = NULL;
    long scratch = linear_scratch_bytes(M, K, ldx);
    if (scratch && !(xt = aligned_alloc(64, (size_t)(scratch + 63) / 64 * 64))) return -2;
#pragma omp parallel num_threads(nthreads)
    linear_in_region(x, ldx, wp, y, ldy, M, N, K, xt);
    free(xt);
    return 0;
}

#else

int tg_bf16_linear(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                   long M, long N, long K, int nthreads) {
    (void)x, (void)ldx, (void)wp, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    (void)nthreads;
    return -3;
}

#endif

#if TG_AMX
/* tg_bf16_linear_fused on AMX: x copied first where it must be (RMSNorm'd by norm_w, eps where
 * norm_w is not NULL); with res amx_panels_first, else amx_blocked (with silu each thread its
 * amx_thread_floats buffer after x's blocks): 0, or -2 without memory. */
static int amx_fused(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                     long M, long N, long K, int nthreads, const uint16_t *norm_w, float eps,
                     int silu, const uint16_t *res, long ldres) {
    long panels = N / P;
    if (nthreads > panels) nthreads = (int)panels;
    long x_bytes = (amx_copy_bytes(M, K) + 63) / 64 * 64;
    long thread_floats = silu ? (amx_thread_floats(M, K, 1) + 15) / 16 * 16 : 0;
    char *scratch = aligned_alloc(64, (size_t)x_bytes + (size_t)nthreads * thread_floats * 4);
    if (!scratch) return -2;
#pragma omp parallel num_threads(nthreads)
    {
        long t = thread_num();
        struct amx_share sh = amx_share_of(M, panels, norm_w != NULL);
        struct amx_x xs = amx_x_of(x, ldx, M, K, (uint16_t *)scratch, &sh,
                                   panels * (silu ? 2 : 1), norm_w, eps);
        float *buf = silu ? (float *)(scratch + x_bytes) + t * thread_floats : NULL;
        if (sh.b < sh.e && sh.bb < sh.be) {
            if (res) /* wo, w2: the weights' group kept, x streaming */
                amx_panels_first(&xs, wp, y, ldy, M, K, &sh, res, ldres);
            else
                amx_blocked(&xs, wp, y, ldy, M, N, K, &sh, silu, buf);
        }
    }
    free(scratch);
    return 0;
}
#endif

/* y [M, N] = x @ W^T with what a decoder layer does around it, in one pass (each with the
 * roundings of the separate calls, so their bits):
 * - norm_w: x is RMSNorm'd by norm_w, eps on its way into the AMX blocks, as rows.c's
 *   tg_rms_norm_bf16 normalises (wqkv after attn_norm, w13 after ffn_norm);
 * - silu: wp holds w13's 2N rows (gate, then up) and y = silu(gate) * up, as tg_bf16_linear
 *   and then rows.c's tg_silu_mul_bf16, w13's [M, 2N] product never in memory;
 * - res (ldres apart; y may be res): y = res + the product rounded to bf16, as torch's bf16
 *   add rounds it (the residual adds after wo and w2); not with silu.
 * On AMX above 32 rows with N whole panels only: -4 elsewhere (the caller makes the separate
 * calls), else 0, -1 on bad arguments, -2 without memory. */
int tg_bf16_linear_fused(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                         long M, long N, long K, int nthreads, const uint16_t *norm_w, float eps,
                         int silu, const uint16_t *res, long ldres) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ldy < N || nthreads < 1) return -1;
    if (res && (silu || ldres < N)) return -1;
#if TG_AMX
    if (M <= AMX_XB || N % P || !amx_applies(K, ldx)) return -4;
    return amx_fused(x, ldx, wp, y, ldy, M, N, K, nthreads, norm_w, eps, silu, res, ldres);
#else
    (void)x, (void)wp, (void)y, (void)norm_w, (void)eps, (void)silu, (void)res;
    return -4;
#endif
}

/* Turn the AMX path on (1) or off (0): on asks Linux for the tile state (arch_prctl) once.
 * Returns whether it is on: 0 where the build or the kernel has no AMX. */
int tg_bf16_set_amx(int on) {
#if TG_AMX
    static int permitted = -1;
    if (on && permitted < 0)
        permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0;
    g_amx = on && permitted > 0;
    return g_amx;
#else
    (void)on;
    return 0;
#endif
}

/* Tests: 0 has the plain linear's AMX blocked path do without its buffer, as it does where
 * there is no memory for one (K unchunked); 1, the default, back. Returns on. */
int tg_bf16_amx_buffers(int on) {
#if TG_AMX
    g_amx_buffers = on;
#endif
    return on;
}

/* Lets the loader check that the library it opened is the one it built. */
int tg_bf16_kernel_abi(void) { return 7; }
