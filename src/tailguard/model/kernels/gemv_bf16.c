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
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.c" /* silu and the bf16 roundings of the fused silu(gate) * up store */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VL__)
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

/* The calling thread's share [b, e) of `panels` panels, inside a parallel region. */
static void my_panels(long panels, long *b, long *e) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    long t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    long t = 0, nt = 1;
#endif
    *b = panels * t / nt;
    *e = panels * (t + 1) / nt;
}

#if TG_AMX
static int g_amx = 0; /* tg_bf16_set_amx */

#ifndef AMX_KC
#define AMX_KC 256 /* k per chunk of a panel kept in L1 (16 KiB) across a group of blocks */
#endif
#ifndef AMX_L2_X_BYTES
#define AMX_L2_X_BYTES (1024 * 1024)
#endif

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles: 0-3 C (row block r, column half c at 2r + c; up to 16 rows: two panels x two
 * halves), 4-5 A (row blocks; up to 16 rows 5 is a third B), 6-7 B (halves). */
static void amx_configure(int rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 5 ? 16 : (uint8_t)rows;
    }
    _tile_loadconfig(&cfg);
}

/* 17 to 32 rows read in place (amx_medium): C tiles 0-1 and A tile 4 the first 16 rows, C
 * 2-3 and A 5 the other `rows2`, B 6-7. */
static void amx_configure_split(int rows2) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t == 2 || t == 3 || t == 5 ? (uint8_t)rows2 : 16;
    }
    _tile_loadconfig(&cfg);
}

/* c[rows][P] fp32 (ldc floats) rounded into y rows (nvalid columns). */
static void amx_store(const float *c, long ldc, int rows, uint16_t *y, long ldy, long nvalid) {
    for (int m = 0; m < rows; m++) {
        store16(y + m * ldy, _mm512_loadu_ps(c + m * ldc), nvalid);
        store16(y + m * ldy + 16, _mm512_loadu_ps(c + m * ldc + 16), nvalid - 16);
    }
}

/* c[rows][P] (ldc floats) = a[rows][K] (lda apart) x one panel of kp_n = K / 2 pairs, fp32;
 * K a multiple of 32, rows as amx_configure set them (amx_small's odd panel, attn_bf16.c). */
static void amx_panel_out32(const uint16_t *a, long lda, const uint16_t *w, long kp_n,
                              float *c, long ldc) {
    _tile_zero(0);
    _tile_zero(1);
    for (long kp = 0; kp < kp_n; kp += AMX_K / 2, w += AMX_K * P, a += AMX_K) {
        _tile_loadd(4, a, lda * 2);
        _tile_loadd(6, w, 2 * P * 2);
        _tile_loadd(7, w + P, 2 * P * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
}

#ifndef AMX_PF_STEPS
#define AMX_PF_STEPS 3 /* up to 16 rows: k-steps ahead whose weights are prefetched into L1 */
#endif

/* One k-step of a panel (16 pairs x 32 columns: 2 KiB) into L1. */
static inline void amx_prefetch_step(const uint16_t *w) {
    const char *c = (const char *)w;
    for (int i = 0; i < AMX_K * P * 2; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

/* Up to 16 rows: each of this thread's panels against x read in place (ldx apart), two
 * panels at a time where it can (two weight streams in flight, four C tiles). The weights of
 * the k-step AMX_PF_STEPS ahead (past a pair's end: the next pair's first) are prefetched
 * into L1: the decode stack of the 246M model at 8 rows 16.0-17.2 -> 14.8-16.2 ms, weights
 * warm or flushed from the caches (a C harness; session 31's prefetch of one line a step into
 * L2 had measured no gain). */
static void amx_small(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                      long M, long N, long K, long b, long e) {
    long kp_n = K / 2, pstride = kp_n * 2 * P;
    float c[AMX_M * P] __attribute__((aligned(64)));
    amx_configure((int)M);
    long p = b;
    for (; p + 1 < e; p += 2) {
        const uint16_t *w = wp + p * pstride, *v = w + pstride;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long k = 0; k < K; k += AMX_K, w += AMX_K * P, v += AMX_K * P) {
            long ka = k + AMX_PF_STEPS * AMX_K;
            if (ka < K) {
                amx_prefetch_step(w + AMX_PF_STEPS * AMX_K * P);
                amx_prefetch_step(v + AMX_PF_STEPS * AMX_K * P);
            } else if (p + 3 < e) {
                amx_prefetch_step(wp + (p + 2) * pstride + (ka - K) * P);
                amx_prefetch_step(wp + (p + 3) * pstride + (ka - K) * P);
            }
            _tile_loadd(4, x + k, ldx * 2);
            _tile_loadd(5, w, 2 * P * 2);
            _tile_loadd(6, w + P, 2 * P * 2);
            _tile_loadd(7, v, 2 * P * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, v + P, 2 * P * 2);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, c, P * 4);
        _tile_stored(1, c + 16, P * 4);
        long n0 = p * P;
        amx_store(c, P, (int)M, y + n0, ldy, N - n0 < P ? N - n0 : P);
        _tile_stored(2, c, P * 4);
        _tile_stored(3, c + 16, P * 4);
        long n1 = (p + 1) * P;
        amx_store(c, P, (int)M, y + n1, ldy, N - n1 < P ? N - n1 : P);
    }
    if (p < e) { /* an odd last panel */
        amx_panel_out32(x, ldx, wp + p * pstride, kp_n, c, P);
        long n0 = p * P;
        amx_store(c, P, (int)M, y + n0, ldy, N - n0 < P ? N - n0 : P);
    }
    _tile_release();
}

/* 17 to 32 rows (a decode step of up to 32 sequences): x read in place as two A tiles, each of
 * this thread's panels over the whole of K with its 2 x 2 C tiles (no x copy, no k-chunks: x
 * stays in L1/L2 for every panel, the weights stream once), the weights of the k-step
 * AMX_PF_STEPS ahead prefetched into L1 as in amx_small. The same products in the same order
 * as amx_blocked, so the same bits. */
static void amx_medium(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                       long M, long N, long K, long b, long e) {
    long pstride = K / 2 * 2 * P;
    const uint16_t *x2 = x + AMX_M * ldx;
    float c[AMX_XB * P] __attribute__((aligned(64)));
    amx_configure_split((int)(M - AMX_M));
    for (long p = b; p < e; p++) {
        const uint16_t *w = wp + p * pstride;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long k = 0; k < K; k += AMX_K, w += AMX_K * P) {
            long ka = k + AMX_PF_STEPS * AMX_K;
            if (ka < K)
                amx_prefetch_step(w + AMX_PF_STEPS * AMX_K * P);
            else if (p + 1 < e)
                amx_prefetch_step(wp + (p + 1) * pstride + (ka - K) * P);
            _tile_loadd(6, w, 2 * P * 2);
            _tile_loadd(7, w + P, 2 * P * 2);
            _tile_loadd(4, x + k, ldx * 2);
            _tile_loadd(5, x2 + k, ldx * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, P * 4);
        _tile_stored(1, c + 16, P * 4);
        _tile_stored(2, c + AMX_M * P, P * 4);
        _tile_stored(3, c + AMX_M * P + 16, P * 4);
        long n0 = p * P;
        amx_store(c, P, (int)M, y + n0, ldy, N - n0 < P ? N - n0 : P);
    }
    _tile_release();
}

/* The fused silu(gate) * up store of amx_blocked: y rows = silu(gate) * up of fp32 sums g and
 * u [rows][P] (ldc floats), with the unfused path's roundings (w13's output rounded to bf16 by
 * store16's conversion, then rows.c's silu_row_bf16), so the same bits. */
static void amx_store_silu(const float *g, const float *u, long ldc, int rows, uint16_t *y,
                           long ldy) {
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < P; h += 16) {
            __m512i gb = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                _mm512_loadu_ps(g + m * ldc + h)));
            __m512i ub = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                _mm512_loadu_ps(u + m * ldc + h)));
            vf gv = (vf)_mm512_slli_epi32(gb, 16), uv = (vf)_mm512_slli_epi32(ub, 16);
            store_bf16(y + m * ldy + h, rne(silu(gv)) * uv);
        }
}

/* Above 32 rows: xb holds x in zero-padded blocks of 32 rows, each k-step's two A tiles side
 * by side ([blocks][K/32][32 rows][32]: one 2 KB stream per block, as the panel is one for B);
 * each panel against a group of blocks that fits in L2 while the panel stays in L1/L2. */
static void amx_blocked(const uint16_t *xb, const uint16_t *wp, uint16_t *y, long ldy, long M,
                        long N, long K, long b, long e, long silu_i, int *failed) {
    long kp_n = K / 2, pstride = kp_n * 2 * P, blocks = (M + AMX_XB - 1) / AMX_XB;
    long group = AMX_L2_X_BYTES / (AMX_XB * K * 2);
    if (group < 1) group = 1;
    if (group > blocks) group = blocks;
    float c[AMX_XB * P] __attribute__((aligned(64)));
    /* k in chunks of AMX_KC: a chunk of the panel stays in L1 for every block of the group,
     * the blocks' sums wait in acc between chunks */
    long kc = K < AMX_KC ? K : AMX_KC;
    float *acc = kc < K ? aligned_alloc(64, (size_t)group * AMX_XB * P * 4) : NULL;
    /* silu_i > 0 (tg_bf16_linear_silu): output panel q is silu(gate panel q) * up panel
     * q + silu_i / P; the group's gate sums wait in gates */
    float *gates = silu_i ? aligned_alloc(64, (size_t)group * AMX_XB * P * 4) : NULL;
    if (silu_i && !gates) {
#pragma omp atomic write
        *failed = 1;
        free(acc);
        return;
    }
    if (!acc) kc = K;
    amx_configure(AMX_M);
    long half = silu_i / P, passes = silu_i ? 2 : 1;
    for (long g0 = 0; g0 < blocks; g0 += group) {
        long g1 = g0 + group < blocks ? g0 + group : blocks;
        for (long q = b * passes; q < e * passes; q++) {
            long p = passes == 2 ? q / 2 + (q % 2) * half : q; /* gate, up, gate, up, ... */
            long next = passes == 2 ? (q + 1) / 2 + ((q + 1) % 2) * half : q + 1;
            const uint16_t *w = wp + p * pstride;
            long n0 = (passes == 2 ? q / 2 : p) * P, nvalid = N - n0 < P ? N - n0 : P;
            /* the next panel into L2 while this one computes, spread over its k-steps: a
             * panel's first pass would otherwise wait on memory at every line */
            const char *pf = (const char *)(wp + next * pstride);
            const char *pf_end = pf + (q + 1 < e * passes ? pstride * 2 : 0);
            long steps = (g1 - g0) * (K / AMX_K), per = (pstride * 2 / 64 + steps - 1) / steps;
            for (long k0 = 0; k0 < K; k0 += kc) {
                long k1 = k0 + kc < K ? k0 + kc : K;
                for (long blk = g0; blk < g1; blk++) {
                    const uint16_t *xk = xb + blk * AMX_XB * K + k0 * AMX_XB;
                    const uint16_t *wk = w + k0 * P;
                    float *a = acc ? acc + (blk - g0) * AMX_XB * P : c;
                    if (k0 == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, a, P * 4);
                        _tile_loadd(1, a + 16, P * 4);
                        _tile_loadd(2, a + AMX_M * P, P * 4);
                        _tile_loadd(3, a + AMX_M * P + 16, P * 4);
                    }
                    for (long k = k0; k < k1; k += AMX_K, xk += AMX_XB * AMX_K, wk += AMX_K * P) {
                        for (long i = 0; i < per && pf < pf_end; i++, pf += 64)
                            __builtin_prefetch(pf, 0, 2);
                        _tile_loadd(6, wk, 2 * P * 2);
                        _tile_loadd(7, wk + P, 2 * P * 2);
                        _tile_loadd(4, xk, AMX_K * 2);
                        _tile_loadd(5, xk + AMX_M * AMX_K, AMX_K * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    float *gate = passes == 2 ? gates + (blk - g0) * AMX_XB * P : NULL;
                    float *dst = k1 < K ? a : passes == 2 && q % 2 == 0 ? gate : c;
                    _tile_stored(0, dst, P * 4);
                    _tile_stored(1, dst + 16, P * 4);
                    _tile_stored(2, dst + AMX_M * P, P * 4);
                    _tile_stored(3, dst + AMX_M * P + 16, P * 4);
                    if (k1 == K && dst == c) {
                        long m0 = blk * AMX_XB, rows = M - m0 < AMX_XB ? M - m0 : AMX_XB;
                        if (passes == 2)
                            amx_store_silu(gate, c, P, (int)rows, y + m0 * ldy + n0, ldy);
                        else
                            amx_store(c, P, (int)rows, y + m0 * ldy + n0, ldy, nvalid);
                    }
                }
            }
        }
    }
    _tile_release();
    free(acc);
    free(gates);
}

static int amx_applies(long K, long ldx) { return g_amx && K % AMX_K == 0 && ldx >= K; }

/* Inside a parallel region: x into xb's zero-padded blocks of 32 rows (amx_copy_bytes), the
 * rows split over the threads; returns after the barrier (x copied before any panel runs). */
static void amx_copy_blocks(const uint16_t *x, long ldx, long M, long K, uint16_t *xb) {
    long padded = (M + AMX_XB - 1) / AMX_XB * AMX_XB;
#pragma omp for schedule(static)
    for (long m = 0; m < padded; m++) {
        uint16_t *dst = xb + (m / AMX_XB) * AMX_XB * K + (m % AMX_XB) * AMX_K;
        for (long k = 0; k < K; k += AMX_K, dst += AMX_XB * AMX_K) {
            if (m < M)
                memcpy(dst, x + m * ldx + k, AMX_K * 2);
            else
                memset(dst, 0, AMX_K * 2);
        }
    }
}

/* Inside a parallel region, every thread: y = x @ W^T on AMX tiles. xt: amx_copy_bytes. */
static void amx_in_region(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y,
                          long ldy, long M, long N, long K, uint32_t *xt) {
    long panels = (N + P - 1) / P, b, e;
    my_panels(panels, &b, &e);
    if (M <= AMX_XB) {
        if (b < e && M <= AMX_M) amx_small(x, ldx, wp, y, ldy, M, N, K, b, e);
        else if (b < e) amx_medium(x, ldx, wp, y, ldy, M, N, K, b, e);
        return;
    }
    amx_copy_blocks(x, ldx, M, K, (uint16_t *)xt);
    int failed = 0; /* (no gate buffer without silu) */
    if (b < e) amx_blocked((uint16_t *)xt, wp, y, ldy, M, N, K, b, e, 0, &failed);
}
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

/* y [M, I] = silu(x @ Wg^T) * (x @ Wu^T), wp the panels of w13 [2I, K] (gate rows, then up
 * rows): each product rounded to bf16 as tg_bf16_linear rounds it, then silu and the product
 * as rows.c's tg_silu_mul_bf16, so the same bits as those two calls, without w13's [M, 2I]
 * output going to memory and back. On AMX above 32 rows (the prefill's blocked path) only:
 * returns -4 where that path does not apply (the caller makes the two calls), else 0, -1 on
 * bad arguments, -2 without memory. */
int tg_bf16_linear_silu(const uint16_t *x, long ldx, const uint16_t *wp, uint16_t *y, long ldy,
                        long M, long I, long K, int nthreads) {
    if (M < 1 || I < 1 || K < 1 || ldx < K || ldy < I || nthreads < 1) return -1;
#if TG_AMX
    if (M <= AMX_XB || I % P || !amx_applies(K, ldx)) return -4;
    long panels = I / P;
    if (nthreads > panels) nthreads = (int)panels;
    long bytes = amx_copy_bytes(M, K);
    uint32_t *xt = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
    if (!xt) return -2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        long b, e;
        my_panels(panels, &b, &e);
        amx_copy_blocks(x, ldx, M, K, (uint16_t *)xt);
        if (b < e) amx_blocked((uint16_t *)xt, wp, y, ldy, M, I, K, b, e, I, &failed);
    }
    free(xt);
    return failed ? -2 : 0;
#else
    (void)x, (void)wp, (void)y;
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

/* Lets the loader check that the library it opened is the one it built. */
int tg_bf16_kernel_abi(void) { return 3; }
