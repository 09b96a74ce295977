/* Ceilings of AMX bf16 on this machine, for bench/amx_probe.py (which builds and runs it).
 *
 *   amx_probe peak                 tile products from tiles (no loads) and from L1 loads
 *   amx_probe loop N K KC G MODE   the AMX linear's loop structure of gemv_bf16.c (x in
 *                                  blocks of 32 rows, panels of 32 columns, 2 x 2 C tiles, k in
 *                                  chunks of KC with the sums round-tripping through memory
 *                                  between chunks, G blocks per group), M = 1024, without the
 *                                  x copy or the bf16 store. MODE bit 1: every block reads the
 *                                  same x block (no x stream from L2); bit 2: every panel is
 *                                  the same panel (no weight stream from memory); bit 4: x's
 *                                  tiles loaded with tileloaddt1, as the kernel loads them.
 *
 * Operands hold bf16 values near 1 (not zeros: AMX's rate depends on the data, ~10% here).
 * Prints one line "TFLOP/s <value>" for the process's OpenMP threads. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

static uint16_t *filled(long n, unsigned mul) {
    uint16_t *p = aligned_alloc(4096, (size_t)(n * 2 + 4095) / 4096 * 4096);
    for (long i = 0; i < n; i++) p[i] = (uint16_t)(0x3f00 ^ ((uint32_t)i * mul >> 12 & 0x7f));
    return p;
}

/* 4 independent C tiles; from_l1: A and B tiles reloaded every step from a 32 KiB buffer. */
static double peak(int from_l1) {
    long steps = 10000000;
    double t0 = now();
#pragma omp parallel
    {
        configure();
        uint16_t *b = filled(16384, 40503u);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, b, 64); _tile_loadd(5, b + 512, 64);
        _tile_loadd(6, b + 1024, 128); _tile_loadd(7, b + 1056, 128);
        for (long i = 0; i < steps; i++) {
            if (from_l1) {
                long o = (i & 7) * 2048;
                _tile_loadd(4, b + o, 64); _tile_loadd(5, b + o + 512, 64);
                _tile_loadd(6, b + o + 1024, 128); _tile_loadd(7, b + o + 1056, 128);
            }
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, b, 64);
        _tile_release();
        free(b);
    }
    return 4.0 * 16384 * (double)steps * omp_get_max_threads() / (now() - t0);
}

static double loop(long N, long K, long KC, long G, int mode) {
    const long M = 1024, panels = N / 32, blocks = M / 32, pstride = K * 32;
    uint16_t *xb = filled(M * K, 40503u), *wp = filled(N * K, 2654435761u);
    double best = 1e30;
    for (int r = 0; r < 4; r++) {
        double t0 = now();
#pragma omp parallel
        {
            configure();
            int nt = omp_get_num_threads(), id = omp_get_thread_num();
            long pb = panels * id / nt, pe = panels * (id + 1) / nt;
            float *acc = aligned_alloc(64, (size_t)G * 4096);
            float *out = aligned_alloc(64, 4096);
            for (long g0 = 0; g0 < blocks; g0 += G)
                for (long p = pb; p < pe; p++)
                    for (long k0 = 0; k0 < K; k0 += KC)
                        for (long blk = g0; blk < g0 + G && blk < blocks; blk++) {
                            const uint16_t *xk = xb + (mode & 1 ? 0 : blk * 32 * K) + k0 * 32;
                            const uint16_t *wk = wp + (mode & 2 ? 0 : p * pstride) + k0 * 32;
                            float *a = acc + (blk - g0) * 1024;
                            if (k0 == 0) {
                                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                            } else {
                                _tile_loadd(0, a, 128); _tile_loadd(1, a + 16, 128);
                                _tile_loadd(2, a + 512, 128); _tile_loadd(3, a + 528, 128);
                            }
                            for (long k = k0; k < k0 + KC && k < K; k += 32, xk += 1024, wk += 1024) {
                                _tile_loadd(6, wk, 128); _tile_loadd(7, wk + 32, 128);
                                if (mode & 4) { /* as the kernel: non-temporal x loads */
                                    _tile_stream_loadd(4, xk, 64);
                                    _tile_stream_loadd(5, xk + 512, 64);
                                } else {
                                    _tile_loadd(4, xk, 64); _tile_loadd(5, xk + 512, 64);
                                }
                                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                                _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                            }
                            float *d = k0 + KC < K ? a : out;
                            _tile_stored(0, d, 128); _tile_stored(1, d + 16, 128);
                            _tile_stored(2, d + 512, 128); _tile_stored(3, d + 528, 128);
                        }
            free(acc), free(out);
            _tile_release();
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    free(xb), free(wp);
    return 2.0 * M * N * K / best;
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0) {
        fprintf(stderr, "no AMX tile permission from Linux\n");
        return 2;
    }
    if (argc == 2 && !strcmp(argv[1], "peak")) {
        printf("TFLOP/s %.3f %.3f\n", peak(0) / 1e12, peak(1) / 1e12);
        return 0;
    }
    if (argc == 7 && !strcmp(argv[1], "loop")) {
        long N = atol(argv[2]), K = atol(argv[3]), KC = atol(argv[4]), G = atol(argv[5]);
        if (N % 32 || K % 32 || KC % 32 || KC < 32 || G < 1) return 1;
        printf("TFLOP/s %.3f\n", loop(N, K, KC, G, atoi(argv[6])) / 1e12);
        return 0;
    }
    fprintf(stderr, "usage: amx_probe peak | loop N K KC G MODE\n");
    return 1;
}
