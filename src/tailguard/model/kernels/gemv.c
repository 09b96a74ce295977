/* Small-M fp32 linear: y[M, N] = x[M, K] @ W[N, K]^T, for the decode step's few rows.
 *
 * Why our own: oneDNN's fp32 kernel at 8 rows is compute-bound per core and streams the
 * weights at about half the machine's read bandwidth (docs/benchmarks.md, issue 12). At small
 * M the product is a handful of dot products per weight row, so the kernel's one job is to
 * read every weight once, at the memory's rate, and spend as few instructions per weight
 * vector as possible.
 *
 * Layout: the plain [N, K] row-major weight, as the checkpoint stores it (no second copy).
 * A block of R weight rows is streamed along K one vector at a time; each weight vector is
 * multiplied into MB rows of x (vectors that stay in L1), so R x MB accumulators live in
 * registers and each weight load feeds MB FMAs. R is chosen per MB so the accumulators, the
 * R weight vectors and one x vector fit the register file (AVX-512: 32, AVX2: 16). The
 * lanes of each accumulator are summed once at the end of the row. M above MB_MAX is done in
 * chunks of MB_MAX rows while the block's weight rows are still in L1/L2.
 *
 * Threads: the N rows are split into contiguous ranges, one per OpenMP thread (the caller
 * passes torch's thread count; torch's own libgomp serves the parallel region when this
 * library is loaded into a process that imported torch, so there is one thread pool).
 *
 * Written with GCC vector extensions so it compiles for whatever `-march=native` offers;
 * fused multiply-adds come from contraction (-ffp-contract=fast is GCC's default in GNU C).
 */
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
#define VBYTES 64
#define NREG 32
#elif defined(__AVX__)
#define VBYTES 32
#define NREG 16
#else
#define VBYTES 16
#define NREG 16
#endif
#define VL (VBYTES / 4)
#define MB_MAX 8

typedef float vf __attribute__((vector_size(VBYTES)));
typedef float vfu __attribute__((vector_size(VBYTES), aligned(4))); /* unaligned loads */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum(vf v) {
    float s = 0.0f;
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* rows n0 .. n0+R-1 of W against rows m0 .. m0+MB-1 of x; MB and R are constants at every
 * call site, so the loops unroll fully and acc[][] lives in registers. */
ALWAYS_INLINE void block(const float *restrict x, long ldx, const float *restrict w, long K,
                         float *restrict y, long ldy, long n0, const int MB, const int R) {
    vf acc[4][MB_MAX];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) acc[r][m] = (vf){0};
    const float *wr = w + n0 * K;
    long k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = *(const vfu *)(wr + r * K + k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            vf xv = *(const vfu *)(x + m * ldx + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][m] += wv[r] * xv;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            float s = hsum(acc[r][m]);
            for (long kk = k; kk < K; kk++) s += wr[r * K + kk] * x[m * ldx + kk];
            y[m * ldy + n0 + r] = s;
        }
}

/* Accumulators + weight vectors + one x vector within the register file, at most 4 rows. */
#define R_FOR(MB) ((NREG - 2) / ((MB) + 1) > 4 ? 4 : ((NREG - 2) / ((MB) + 1) < 1 ? 1 : (NREG - 2) / ((MB) + 1)))

/* rows [n_begin, n_end) of W against rows [0, M) of x, in chunks of MB_MAX rows of x. */
#define DEFINE_ROWS(MB)                                                                        \
    static void rows_##MB(const float *x, long ldx, const float *w, long K, float *y,          \
                          long ldy, long n_begin, long n_end) {                                \
        const int R = R_FOR(MB);                                                               \
        long n = n_begin;                                                                      \
        for (; n + R <= n_end; n += R) block(x, ldx, w, K, y, ldy, n, MB, R);                  \
        for (; n < n_end; n++) block(x, ldx, w, K, y, ldy, n, MB, 1);                          \
    }
DEFINE_ROWS(1)
DEFINE_ROWS(2)
DEFINE_ROWS(3)
DEFINE_ROWS(4)
DEFINE_ROWS(5)
DEFINE_ROWS(6)
DEFINE_ROWS(7)
DEFINE_ROWS(8)

typedef void (*rows_fn)(const float *, long, const float *, long, float *, long, long, long);
static const rows_fn ROWS[MB_MAX + 1] = {
    0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8,
};

/* One thread's rows: for each slab of weight rows, every chunk of x rows, so the slab is read
 * from memory once and from cache for the later chunks. A slab of 8 rows x K=2816 is 88 KiB:
 * within L2 while the chunks run. */
static void thread_rows(const float *x, long ldx, const float *w, long K, float *y, long ldy,
                        long M, long n_begin, long n_end) {
    if (M <= MB_MAX) {
        ROWS[M](x, ldx, w, K, y, ldy, n_begin, n_end);
        return;
    }
    const long SLAB = 24; /* a multiple of every R_FOR */
    for (long s = n_begin; s < n_end; s += SLAB) {
        long e = s + SLAB < n_end ? s + SLAB : n_end;
        for (long m0 = 0; m0 < M; m0 += MB_MAX) {
            long mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
            ROWS[mb](x + m0 * ldx, ldx, w, K, y + m0 * ldy, ldy, s, e);
        }
    }
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * w[n * K + k]; returns 0, or -1 on bad arguments. */
int tg_linear_small_m(const float *x, long ldx, const float *w, float *y, long ldy, long M,
                      long N, long K, int nthreads) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ldy < N || nthreads < 1) return -1;
    /* Split N into contiguous ranges, each a multiple of 24 rows (every R divides it) so no
     * thread runs a partial register block except at the very end. */
    long units = (N + 23) / 24;
    if (nthreads > units) nthreads = (int)units;
    if (nthreads <= 1) {
        thread_rows(x, ldx, w, K, y, ldy, M, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        long t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        long t = 0, nt = 1;
#endif
        long b = units * t / nt * 24, e = units * (t + 1) / nt * 24;
        if (e > N) e = N;
        if (b < e) thread_rows(x, ldx, w, K, y, ldy, M, b, e);
    }
    return 0;
}

/* Lets the loader check that the library it opened is the one it built. */
int tg_kernel_abi(void) { return 1; }
