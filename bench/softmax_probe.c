/* The prefill attention's softmax two ways, one thread, no tiles: for the 128 blocks of one
 * (sequence, KV head) of 512 tokens (16 query rows a block: 4 positions x 4 heads), fp32
 * scores in, bf16 P and each row's 1 / sum out.
 *
 *   rows     attn_bf16.c's loop: S [16][keys], per row a vector max, then vexp2_bf16, the causal
 *            edge masked, P rounded by vcvtneps2bf16, its sum by vdpbf16ps, two horizontal
 *            reductions a row
 *   columns  S^T [keys][16] (as S^T = K Q^T on tiles would store it): every vector is one key
 *            across the 16 rows, the max and the sum element-wise, the edge a lane compare,
 *            two keys' P interleaved into one VNNI row (the B operand of O^T = V^T P^T)
 *
 *   gcc -O3 -march=native -fopenmp bench/softmax_probe.c -o /tmp/softmax_probe -lm
 *   flock -x /tmp/tg-cpu.lock /tmp/softmax_probe 300
 *
 * Needs AVX512-BF16; the exp and the row max are the kernel's own (attn_bf16.c, included).
 * Prints both times, their ratio and the row sums' largest relative difference
 * (docs/benchmarks.md, session 36). */
#include <stdio.h>
#include <time.h>

#include "../src/tailguard/model/kernels/attn_bf16.c" /* vexp2_bf16, span_max, vf / vfu / vi */

#define SPAD 544 /* keys a row of S holds (512 rounded up past the last block's) */
#define LOG2E 1.44269504088896341f

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The kernel's row-wise softmax of one block at position t0: s [16][SPAD], P [16][ppad]. */
static void rows(const float *s, long t0, uint16_t *pb, long ppad, float *inv, float scale) {
    const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m256bh ones = (__m256bh)_mm256_set1_epi16(0x3f80);
    for (long r = 0; r < 16; r++) {
        long tq = t0 + r / 4;
        const float *sr = s + r * SPAD;
        float a = scale * LOG2E, b = -span_max(sr, 0, tq) * a;
        uint16_t *pr = pb + r * ppad;
        __m256 totals = _mm256_setzero_ps();
        for (long j = 0; j + 16 <= ppad; j += 16) {
            if (j > tq) {
                _mm256_storeu_si256((__m256i *)(pr + j), _mm256_setzero_si256());
                continue;
            }
            vf e = vexp2_bf16(*(const vfu *)(sr + j) * a + b);
            if (j + 15 > tq) e = (vf)((vi)e & ((iota + (int)j) <= (vi){} + (int)tq));
            __m256bh h = _mm512_cvtneps_pbh((__m512)e);
            _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)h);
            totals = _mm256_dpbf16_ps(totals, h, ones);
        }
        float total = _mm512_reduce_add_ps(_mm512_zextps256_ps512(totals));
        inv[r] = total > 0 ? 1.0f / total : 0.0f;
    }
}

/* The same block column-wise: sT [keys][16], P^T as VNNI pairs [kpad / 2][16 rows][2]. */
static void cols(const float *sT, long kmax, long kpad, long t0, uint16_t *pT, float *inv,
                 float scale) {
    const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m512i tq = (__m512i)((vi){} + (int)t0 + (iota >> 2)); /* row r at t0 + r / 4 */
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    long j = 0;
    for (; j + 4 <= t0 + 1; j += 4) { /* keys every row sees: four chains */
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(sT + j * 16));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(sT + (j + 1) * 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(sT + (j + 2) * 16));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(sT + (j + 3) * 16));
    }
    __m512 m = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
    for (; j < kmax; j++) {
        __mmask16 k = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)j), tq);
        m = _mm512_mask_max_ps(m, k, m, _mm512_loadu_ps(sT + j * 16));
    }
    vf a = (vf){} + scale * LOG2E, b = -(vf)m * a;
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    __m512 tot = _mm512_setzero_ps();
    for (j = 0; j < kpad; j += 2) {
        vf e0 = {}, e1 = {};
        if (j < kmax) {
            e0 = vexp2_bf16(*(const vfu *)(sT + j * 16) * a + b);
            if (j > t0) {
                __mmask16 k = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)j), tq);
                e0 = (vf)_mm512_maskz_mov_ps(k, (__m512)e0);
            }
        }
        if (j + 1 < kmax) {
            e1 = vexp2_bf16(*(const vfu *)(sT + (j + 1) * 16) * a + b);
            if (j + 1 > t0) {
                __mmask16 k = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)j + 1), tq);
                e1 = (vf)_mm512_maskz_mov_ps(k, (__m512)e1);
            }
        }
        __m512bh pair = _mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);
        __m512i row = _mm512_permutexvar_epi16(inter, (__m512i)pair);
        _mm512_storeu_si512(pT + j * 16, row);
        tot = _mm512_dpbf16_ps(tot, (__m512bh)row, ones);
    }
    vf t = (vf)tot;
    for (int r = 0; r < 16; r++) inv[r] = t[r] > 0 ? 1.0f / t[r] : 0.0f;
}

int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 200;
    float *s = aligned_alloc(64, 16 * SPAD * 4), *sT = aligned_alloc(64, SPAD * 16 * 4);
    uint16_t *pb = aligned_alloc(64, 16 * SPAD * 2), *pT = aligned_alloc(64, SPAD * 16 * 2);
    float inv[16], inv2[16];
    for (long i = 0; i < 16 * SPAD; i++) s[i] = (float)((i * 2654435761u >> 8) % 1000) / 100.0f;
    for (long r = 0; r < 16; r++)
        for (long j = 0; j < SPAD; j++) sT[j * 16 + r] = s[r * SPAD + j];
    double tr = 0, tc = 0;
    for (long it = 0; it < iters; it++) {
        double t0 = now();
        for (long blk = 0; blk < 128; blk++) {
            long t = 4 * blk, pad = (t + 4 + 31) / 32 * 32;
            rows(s, t, pb, pad, inv, 0.125f);
        }
        double t1 = now();
        for (long blk = 0; blk < 128; blk++) {
            long t = 4 * blk, pad = (t + 4 + 31) / 32 * 32;
            cols(sT, t + 4, pad, t, pT, inv2, 0.125f);
        }
        tr += t1 - t0, tc += now() - t1;
    }
    float diff = 0; /* the last block's row sums */
    for (int r = 0; r < 16; r++) diff = fmaxf(diff, fabsf(inv[r] - inv2[r]) / inv[r]);
    printf("128 blocks of 16 rows (one (sequence, KV head) of 512 tokens): rows %.1f us, "
           "columns %.1f us, columns / rows %.3f; row sums' largest relative difference %.1e\n",
           tr / iters * 1e6, tc / iters * 1e6, tc / tr, diff);
    free(s), free(sT), free(pb), free(pT);
    return 0;
}
