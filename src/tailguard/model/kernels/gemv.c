/* Small-M fp32 linear: y[M, N] = x[M, K] @ W[N, K]^T, for the decode step's few rows.
 *
 * Why our own: at decode sizes the product is a few multiply-adds per weight, so the kernel's
 * one job is to read every weight once, at the memory's rate, with as few instructions per
 * weight vector as possible. oneDNN's fp32 kernel reaches about half the read bandwidth on
 * the AVX2 EPYC and ~70% on the AVX-512 Xeon at 8 rows (docs/benchmarks.md, issue 12).
 *
 * Weight layout (tg_pack): panels of P = 2 vectors of output columns, each panel [K][P], i.e.
 * W^T cut into column blocks of P, zero-padded to a whole panel. A panel is one sequential
 * stream; at every k its P weights are two vector loads, and each is multiplied into MB rows
 * of x broadcast from a scalar, so 2 x MB accumulators live in registers and a weight load
 * feeds MB FMAs; x is transposed per call into chunks [K][MB] so those broadcasts read one
 * contiguous line per 16 / MB values of k (a plain [N, K] weight pairs each weight vector
 * with MB x vectors instead, and at 8 rows that x traffic made it compute/L2-bound: measured
 * 19 GB/s vs 22 for oneDNN).
 *
 * Blocking: for each group of x chunks that fits in L2, every panel of the thread's range,
 * and for each panel every chunk of the group while the panel is in L1/L2. At decode sizes
 * there is one chunk and each weight is read exactly once.
 *
 * With 256-bit vectors (AVX2: 16 registers, so MB_MAX is 6 rows) a decode step's 8 rows are
 * two chunks. Run one after the other over a whole panel (64 KiB at K = 1,024), the second
 * re-read the panel from L2 while the memory stream stood idle, and a 2-row chunk's 4
 * accumulators wait on FMA latency: [8 x 1024] x [1024 x 5632] streamed 16-17 GB/s where one
 * row streams 21. So up to DIRECT_MAX rows, each panel is walked in blocks of KB values of k,
 * every chunk in turn on a block while it is in L1, the sums carried in a small buffer
 * (kblock_rows): 0.91-0.95x the time at 7-32 rows, 0.97x at 64 (docs/benchmarks.md, session 38)
 * for weights that stream from memory (kblocked()).
 *
 * Threads: the panels are split into contiguous ranges, one per OpenMP thread, or at decode
 * sizes over a weight that streams, handed out 4 at a time (at 3-12 rows on AVX2 as two
 * pairs, each pair walked together: pair_walk). The caller passes torch's thread count;
 * torch's own libgomp serves the parallel region when this library is loaded into a process
 * that imported torch, so there is one thread pool.
 *
 * Written with GCC vector extensions so it compiles for whatever `-march=native` offers;
 * FMAs come from contraction (-ffp-contract=fast is GCC's default in GNU C).
 */
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VBYTES 64
#define MB_MAX 12 /* 24 accumulators + 2 weights + broadcasts within 32 registers */
#define DIRECT_MAX MB_MAX /* one chunk read in place; the k-blocked walk not measured here */
#elif defined(__AVX__)
#define VBYTES 32
#define MB_MAX 6 /* 12 + 2 + broadcasts within 16 */
#define DIRECT_MAX 64 /* rows read in place, chunks walked over k blocks (kblock_rows) */
#else
#define VBYTES 16
#define MB_MAX 6
#define DIRECT_MAX MB_MAX
#endif
#define KB 32 /* k values a block: 2 KiB of a 16-column panel, every chunk's pass in L1 */
#define VL (VBYTES / 4)
#define P (2 * VL)
#define L2_X_BYTES (512 * 1024) /* x chunks kept in L2 while the panels stream past */
/* Software prefetch of the panel stream, PF_ROWS rows (8 KiB on AVX-512) ahead, into L2
 * and L1 (locality 2). The hardware prefetchers alone left a core waiting on memory once it
 * had FMAs to do per line: measured at 8 rows [8 x 1024] x [1024 x 5632], 2 threads, 18 ->
 * 25-28 GB/s (1 row: 29 -> 31). Distances 16-256 rows measured alike; locality 0 (NTA) halved
 * the rate where a second x chunk re-reads the panel. */
#ifndef PF_ROWS
#define PF_ROWS 64
#endif
/* Products of up to PF_MIN_ROWS rows read without it: on the AVX2 EPYC (Zen 3) a 1-row product
 * has so little compute a line that the software prefetches only compete with the hardware's
 * stream: M's 64 linears at 1 row 0.897x the time without them, the rate of a plain read (1.01x
 * against 1.15x); at 2 rows 0.97x (noise), 4 rows 1.06x, 6 rows 1.13x (docs/benchmarks.md,
 * session 40). The AVX-512 Xeon measured the opposite at 1 row (29 -> 31 GB/s with them). */
#ifndef PF_MIN_ROWS
#if VBYTES == 32
#define PF_MIN_ROWS 1
#else
#define PF_MIN_ROWS 0
#endif
#endif
#ifndef PF_LOC
#define PF_LOC 2
#endif

typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4))); /* unaligned access */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* One panel [K][P] against MB rows of x into y[0..MB)[n0..n0+nvalid). MB and DIRECT are
 * constants at every call site, so the loops unroll and the accumulators stay in registers.
 * x is a transposed chunk [K][MB], or with DIRECT the rows of x themselves (ldx apart): one
 * chunk needs no transposed copy, each row's line serving 16 values of k. */
ALWAYS_INLINE void panel(const float *restrict x, long ldx, const float *restrict wp, long K,
                         float *restrict y, long ldy, long n0, long nvalid, const int MB,
                         const int DIRECT) {
    vf a0[MB_MAX], a1[MB_MAX];
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = (vf){0};
#pragma GCC unroll 2
    for (long k = 0; k < K; k++) {
        if (MB > PF_MIN_ROWS) {
            __builtin_prefetch(wp + (k + PF_ROWS) * P, 0, PF_LOC);
            __builtin_prefetch(wp + (k + PF_ROWS) * P + P / 2, 0, PF_LOC);
        }
        const vf w0 = *(const vfu *)(wp + k * P);
        const vf w1 = *(const vfu *)(wp + k * P + VL);
#pragma GCC unroll 12
        for (int m = 0; m < MB; m++) {
            const float xv = DIRECT ? x[m * ldx + k] : x[k * MB + m];
            const vf b = xv - (vf){0}; /* x - 0.0 == x: folds to a broadcast */
            a0[m] += w0 * b;
            a1[m] += w1 * b;
        }
    }
    if (nvalid == P) {
#pragma GCC unroll 12
        for (int m = 0; m < MB; m++) {
            *(vfu *)(y + m * ldy + n0) = a0[m];
            *(vfu *)(y + m * ldy + n0 + VL) = a1[m];
        }
    } else {
        for (int m = 0; m < MB; m++)
            for (long j = 0; j < nvalid; j++)
                y[m * ldy + n0 + j] = j < VL ? a0[m][j] : a1[m][j - VL];
    }
}

/* MB rows of x (read in place, ldx apart) against the panel's rows [k0, k1), the sums
 * carried in acc[MB][P] from one block to the next. PF: prefetch the stream that many rows
 * ahead, or not at all at 0 (the first chunk on a block does; the others find the block in
 * L1). */
ALWAYS_INLINE void panel_block(const float *restrict x, long ldx, const float *restrict wp,
                               long k0, long k1, float *restrict acc, const int MB,
                               const int PF) {
    vf a0[MB_MAX], a1[MB_MAX];
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) {
        a0[m] = *(const vf *)(acc + m * P);
        a1[m] = *(const vf *)(acc + m * P + VL);
    }
#pragma GCC unroll 2
    for (long k = k0; k < k1; k++) {
        if (PF) __builtin_prefetch(wp + (k + PF) * P, 0, PF_LOC);
        if (PF && P * 4 > 64) __builtin_prefetch(wp + (k + PF) * P + P / 2, 0, PF_LOC);
        const vf w0 = *(const vfu *)(wp + k * P);
        const vf w1 = *(const vfu *)(wp + k * P + VL);
#pragma GCC unroll 12
        for (int m = 0; m < MB; m++) {
            const vf b = x[m * ldx + k] - (vf){0};
            a0[m] += w0 * b;
            a1[m] += w1 * b;
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < MB; m++) {
        *(vf *)(acc + m * P) = a0[m];
        *(vf *)(acc + m * P + VL) = a1[m];
    }
}

#define DEFINE_PANEL(MB)                                                                       \
    static void panel_##MB(const float *x, long ldx, const float *wp, long K, float *y,        \
                           long ldy, long n0, long nvalid) {                                   \
        panel(x, ldx, wp, K, y, ldy, n0, nvalid, MB, 0);                                       \
    }                                                                                          \
    static void direct_##MB(const float *x, long ldx, const float *wp, long K, float *y,       \
                            long ldy, long n0, long nvalid) {                                  \
        panel(x, ldx, wp, K, y, ldy, n0, nvalid, MB, 1);                                       \
    }                                                                                          \
    static void block_##MB(const float *x, long ldx, const float *wp, long k0, long k1,        \
                           float *acc, int first) {                                            \
        if (first)                                                                             \
            panel_block(x, ldx, wp, k0, k1, acc, MB, PF_ROWS);                                 \
        else                                                                                   \
            panel_block(x, ldx, wp, k0, k1, acc, MB, 0);                                       \
    }
DEFINE_PANEL(1)
DEFINE_PANEL(2)
DEFINE_PANEL(3)
DEFINE_PANEL(4)
DEFINE_PANEL(5)
DEFINE_PANEL(6)
#if MB_MAX > 6
DEFINE_PANEL(7)
DEFINE_PANEL(8)
DEFINE_PANEL(9)
DEFINE_PANEL(10)
DEFINE_PANEL(11)
DEFINE_PANEL(12)
#endif

typedef void (*panel_fn)(const float *, long, const float *, long, float *, long, long, long);
static const panel_fn PANELS[MB_MAX + 1] = {
    0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6,
#if MB_MAX > 6
    panel_7, panel_8, panel_9, panel_10, panel_11, panel_12,
#endif
};
static const panel_fn DIRECT[MB_MAX + 1] = {
    0, direct_1, direct_2, direct_3, direct_4, direct_5, direct_6,
#if MB_MAX > 6
    direct_7, direct_8, direct_9, direct_10, direct_11, direct_12,
#endif
};
typedef void (*block_fn)(const float *, long, const float *, long, long, float *, int);
static const block_fn BLOCK[MB_MAX + 1] = {
    0, block_1, block_2, block_3, block_4, block_5, block_6,
#if MB_MAX > 6
    block_7, block_8, block_9, block_10, block_11, block_12,
#endif
};

/* The columns one panel holds of N: P, or fewer in the last. */
static inline long panel_cols(long n0, long N) { return N - n0 < P ? N - n0 : P; }

/* M rows of a panel's sums acc[M][P] into y's columns [n0, n0 + nvalid). */
ALWAYS_INLINE void store_sums(const float *acc, long M, float *y, long ldy, long n0,
                              long nvalid) {
    if (nvalid == P) {
#pragma GCC unroll 12
        for (int m = 0; m < M; m++) {
            *(vfu *)(y + m * ldy + n0) = *(const vf *)(acc + m * P);
            *(vfu *)(y + m * ldy + n0 + VL) = *(const vf *)(acc + m * P + VL);
        }
    } else {
        for (int m = 0; m < M; m++)
            for (long j = 0; j < nvalid; j++) y[m * ldy + n0 + j] = acc[m * P + j];
    }
}

/* Two chunks of A and B rows (A + B = M, MB_MAX < M <= 2 MB_MAX: 7-12 rows on AVX2, the decode
 * batches of a few sequences) over every k block of one panel, inlined with their sizes
 * constant (kblock_rows' switch): a call through BLOCK per block and chunk, and its loop
 * bounds, cost 1.00 / 1.10x the time at 8 rows on a panel in L2 (two A/Bs), the decode stack
 * 1.04-1.06x. Both chunks prefetch the stream (the second's prefetch repeats the first's, half
 * a block later): 0.96-0.99x the time of the first alone in 4 A/Bs of 30-40 rounds streaming
 * (docs/benchmarks.md, session 39). Prefetching every other line instead cost 1.5x; none at
 * all, 1.19x. */
ALWAYS_INLINE void kblock2(const float *x, long ldx, const float *wp, long K, float *acc,
                           float *y, long ldy, long n0, long nvalid, const int A, const int B) {
    for (long k0 = 0; k0 < K; k0 += KB) {
        long k1 = k0 + KB < K ? k0 + KB : K;
        panel_block(x, ldx, wp, k0, k1, acc, A, PF_ROWS);
        panel_block(x + A * ldx, ldx, wp, k0, k1, acc + A * P, B, PF_ROWS);
    }
    store_sums(acc, A + B, y, ldy, n0, nvalid);
}

/* M rows (MB_MAX < M <= DIRECT_MAX) read in place against one panel: chunks of at most
 * MB_MAX rows, balanced (8 = 4 + 4), each over the panel's k block in turn while it is in L1
 * (two chunks on KBLOCK2's inlined walks). */
static void kblock_rows(const float *x, long ldx, const float *wp, long K, float *y, long ldy,
                        long n0, long nvalid, long M) {
    float acc[DIRECT_MAX * P] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)M * P * sizeof(float));
    long chunks = (M + MB_MAX - 1) / MB_MAX, base = M / chunks, extra = M % chunks;
#define KBLOCK2(A, B) return kblock2(x, ldx, wp, K, acc, y, ldy, n0, nvalid, A, B)
    /* the cases' chunk sizes are AVX2's (MB_MAX 6); the first chunk takes the odd row */
    switch (MB_MAX == 6 ? M : 0) {
    case 7: KBLOCK2(4, 3);
    case 8: KBLOCK2(4, 4);
    case 9: KBLOCK2(5, 4);
    case 10: KBLOCK2(5, 5);
    case 11: KBLOCK2(6, 5);
    case 12: KBLOCK2(6, 6);
    default:
        for (long k0 = 0; k0 < K; k0 += KB) {
            long k1 = k0 + KB < K ? k0 + KB : K;
            for (long c = 0, m0 = 0; c < chunks; m0 += base + (c < extra), c++)
                BLOCK[base + (c < extra)](x + m0 * ldx, ldx, wp, k0, k1, acc + m0 * P, c == 0);
        }
    }
#undef KBLOCK2
    store_sums(acc, M, y, ldy, n0, nvalid);
}

/* Two panels side by side on the k-blocked walk: 3-12 rows (A + B, B = 0 for one chunk) over
 * each k block of panel 0, then the same block of panel 1, so the core reads two streams at
 * once: the likely reason it pays, the hardware prefetchers follow each stream, so more lines
 * are in flight for the same instructions a line (the walk, not the FMAs, limits the one-panel
 * rate on Zen 3: session 41).
 * Measured against one panel at a time, M's 64 linears, 2 threads: 0.88-0.95x the time at 8
 * rows, 0.88-0.92x at 3, 4 and 6, 0.96-0.97x at 5 and 12; 1.04-1.08x slower at 16 (three
 * chunks a block: compute-bound already) and no gain at 2 rows (1 not tried: its walk has no
 * software prefetch and reads at a plain read's rate; docs/benchmarks.md, session 42).
 * Each stream prefetched PAIR_PF_ROWS ahead, half the one-panel distance: as many lines
 * requested in all. The same sums in the same order as one panel alone. */
#ifndef PAIR_PF_ROWS
#define PAIR_PF_ROWS 32
#endif
#define PAIR_MIN 3
#define PAIR_MAX (2 * MB_MAX)

/* Panels p and p + 1 (weights at w, w + K * P; columns from n0 of N, the second maybe the
 * last and narrower). */
ALWAYS_INLINE void pair_walk(const float *x, long ldx, const float *w, long K, float *y,
                             long ldy, long n0, long N, const int A, const int B) {
    float acc[2][PAIR_MAX * P] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    for (long k0 = 0; k0 < K; k0 += KB) {
        long k1 = k0 + KB < K ? k0 + KB : K;
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            const float *wi = w + i * K * P;
            panel_block(x, ldx, wi, k0, k1, acc[i], A, PAIR_PF_ROWS);
            if (B) panel_block(x + A * ldx, ldx, wi, k0, k1, acc[i] + A * P, B, PAIR_PF_ROWS);
        }
    }
    store_sums(acc[0], A + B, y, ldy, n0, P);
    store_sums(acc[1], A + B, y, ldy, n0 + P, panel_cols(n0 + P, N));
}

/* One function per chunk pair, not inlined into the hand-out: inlined into kblock_rows (whose
 * frame holds the 64-row sums), the walk measured 0.97-1.02x the one-panel time instead of
 * 0.88-0.93x (session 42). */
#define DEFINE_PAIR(A, B)                                                                      \
    static __attribute__((noinline)) void pair_##A##_##B(                                      \
        const float *x, long ldx, const float *w, long K, float *y, long ldy, long n0, long N) { \
        pair_walk(x, ldx, w, K, y, ldy, n0, N, A, B);                                          \
    }
DEFINE_PAIR(3, 0)
DEFINE_PAIR(4, 0)
DEFINE_PAIR(5, 0)
DEFINE_PAIR(6, 0)
DEFINE_PAIR(4, 3)
DEFINE_PAIR(4, 4)
DEFINE_PAIR(5, 4)
DEFINE_PAIR(5, 5)
DEFINE_PAIR(6, 5)
DEFINE_PAIR(6, 6)
typedef void (*pair_fn)(const float *, long, const float *, long, float *, long, long, long);
/* by rows; the chunks as kblock_rows cuts them (AVX2's MB_MAX 6: the first takes the odd row) */
static const pair_fn PAIRS[PAIR_MAX + 1] = {
    [3] = pair_3_0, [4] = pair_4_0,  [5] = pair_5_0,  [6] = pair_6_0,
    [7] = pair_4_3, [8] = pair_4_4,  [9] = pair_5_4,  [10] = pair_5_5,
    [11] = pair_6_5, [12] = pair_6_6,
};

int tg_panel_width(void) { return P; }

/* wp[(n / P) * K * P + k * P + n % P] = w[n * K + k], zero-padded to whole panels: wp holds
 * ceil(N / P) * K * P floats. */
void tg_pack(const float *w, float *wp, long N, long K) {
    long panels = (N + P - 1) / P;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        float *dst = wp + p * K * P;
        for (long k = 0; k < K; k++)
            for (long j = 0; j < P; j++) {
                long n = p * P + j;
                dst[k * P + j] = n < N ? w[n * K + k] : 0.0f;
            }
    }
}

/* x rows [m0, m0 + mb) transposed into xt[K][mb]. */
static void transpose_chunk(const float *x, long ldx, long K, long m0, long mb, float *xt) {
    for (long m = 0; m < mb; m++) {
        const float *row = x + (m0 + m) * ldx;
        for (long k = 0; k < K; k++) xt[k * mb + m] = row[k];
    }
}

static void thread_panels(const float *xt, const float *wp, long M, long N, long K, float *y,
                          long ldy, long p_begin, long p_end) {
    long chunk_bytes = K * MB_MAX * 4;
    long group = L2_X_BYTES / chunk_bytes; /* x chunks per pass over the weights */
    if (group < 1) group = 1;
    long chunks = (M + MB_MAX - 1) / MB_MAX;
    for (long g0 = 0; g0 < chunks; g0 += group) {
        long g1 = g0 + group < chunks ? g0 + group : chunks;
        for (long p = p_begin; p < p_end; p++) {
            long n0 = p * P, nvalid = N - n0 < P ? N - n0 : P;
            for (long c = g0; c < g1; c++) {
                long m0 = c * MB_MAX, mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
                PANELS[mb](xt + m0 * K, 0, wp + p * K * P, K, y + m0 * ldy, ldy, n0, nvalid);
            }
        }
    }
}

/* Whether decode-sized rows against a [N, K] weight take the k-blocked walk and the dynamic
 * hand-out (AVX2 only, DIRECT_MAX > MB_MAX): a panel larger than L1 (K > 512 on AVX2), so a
 * second chunk could not find it there, and a weight that streams from memory (every linear
 * of the 246M model). On cache-resident weights (the embedded model, hidden 256) the walk's
 * extra stores and the hand-outs cost more than they save: 0.96-1.17x the old time at its
 * layer shapes, 11 of 12 above 1 (8-64 rows, 1 thread; session 38). */
#define L1_PANEL_BYTES (32 * 1024)
#define STREAM_BYTES (4L * 1024 * 1024)
static int kblocked(long N, long K) {
    return DIRECT_MAX > MB_MAX && K * P * 4 > L1_PANEL_BYTES && N * K * 4 >= STREAM_BYTES;
}

/* Whether linear_in_region reads x in place, without the transposed copy into xt: up to
 * MB_MAX rows, and up to DIRECT_MAX on the k-blocked walk. */
static int in_place(long M, long N, long K) {
    return M <= MB_MAX || (M <= DIRECT_MAX && kblocked(N, K));
}

/* Panel p of a weight that streams (kblocked), M <= DIRECT_MAX rows read in place. */
static void streamed_panel(const float *x, long ldx, const float *wp, long K, float *y,
                           long ldy, long p, long N, long M) {
    const float *w = wp + p * K * P;
    if (M <= MB_MAX)
        DIRECT[M](x, ldx, w, K, y, ldy, p * P, panel_cols(p * P, N));
    else
        kblock_rows(x, ldx, w, K, y, ldy, p * P, panel_cols(p * P, N), M);
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

/* The product below for the calling thread of an enclosing parallel region (every thread of
 * it must call this with the same arguments). Where in_place, x is read in place; else every
 * thread transposes its share of the chunks into xt (M * K floats, shared) first. The caller
 * puts a barrier after it before reading y. */
static void linear_in_region(const float *x, long ldx, const float *wp, float *y, long ldy,
                             long M, long N, long K, float *xt) {
    long panels = (N + P - 1) / P;
    long b, e;
    if (M <= DIRECT_MAX && kblocked(N, K)) {
        /* panels handed out 4 at a time: a core slowed by a neighbour (the HTTP process, the
         * host) takes fewer instead of holding the other at the next barrier */
        if (MB_MAX == 6 && M >= PAIR_MIN && M <= PAIR_MAX) {
            /* two panels at a time, walked together (pair_walk) */
#pragma omp for schedule(dynamic, 2) nowait
            for (long p = 0; p < panels; p += 2) {
                if (p + 1 < panels)
                    PAIRS[M](x, ldx, wp + p * K * P, K, y, ldy, p * P, N);
                else /* an odd panel out */
                    streamed_panel(x, ldx, wp, K, y, ldy, p, N, M);
            }
            return;
        }
#pragma omp for schedule(dynamic, 4) nowait
        for (long p = 0; p < panels; p++) streamed_panel(x, ldx, wp, K, y, ldy, p, N, M);
        return;
    }
    if (M <= MB_MAX) { /* a static split, every weight read once */
        my_panels(panels, &b, &e);
        for (long p = b; p < e; p++) {
            long n0 = p * P, nvalid = N - n0 < P ? N - n0 : P;
            DIRECT[M](x, ldx, wp + p * K * P, K, y, ldy, n0, nvalid);
        }
        return;
    }
    long chunks = (M + MB_MAX - 1) / MB_MAX;
    /* chunk c at xt + c * MB_MAX * K, laid out [K][mb] */
#pragma omp for schedule(static)
    for (long c = 0; c < chunks; c++) {
        long m0 = c * MB_MAX, mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
        transpose_chunk(x, ldx, K, m0, mb, xt + m0 * K);
    }
    /* (implicit barrier: every chunk is transposed before any panel runs) */
    my_panels(panels, &b, &e);
    if (b < e) thread_panels(xt, wp, M, N, K, y, ldy, b, e);
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * W[n, k], wp being W packed by tg_pack.
 * Returns 0, -1 on bad arguments, -2 if the x buffer cannot be allocated. */
int tg_linear_small_m(const float *x, long ldx, const float *wp, float *y, long ldy, long M,
                      long N, long K, int nthreads) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ldy < N || nthreads < 1) return -1;
    long panels = (N + P - 1) / P;
    if (nthreads > panels) nthreads = (int)panels;
    float *xt = NULL;
    if (!in_place(M, N, K) && !(xt = malloc((size_t)M * (size_t)K * sizeof(float)))) return -2;
#pragma omp parallel num_threads(nthreads)
    linear_in_region(x, ldx, wp, y, ldy, M, N, K, xt);
    free(xt);
    return 0;
}

/* Lets the loader check that the library it opened is the one it built. */
int tg_kernel_abi(void) { return 4; }
