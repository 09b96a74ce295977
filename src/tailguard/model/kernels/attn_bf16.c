/* Causal attention of prompts' first chunks, bf16, on the panels of gemv_bf16.c: vdpbf16ps,
 * or AMX tiles where gemv_bf16.c's AMX path is on (tg_bf16_set_amx).
 *
 * Why: torch's CPU flash attention ran a 2 x 512-token causal call of the 246M model at ~70
 * GFLOP/s on a 2-core Zen 4 (15.6 ms a layer in bf16, the same in fp32), ~20% of a 1,024-token
 * prefill step, where the same cores multiply bf16 matrices at ~425 GFLOP/s
 * (docs/benchmarks.md, issue 12, session 30).
 *
 * A first chunk's keys and values are its own rows of the qkv projection (position i is row
 * first + i), read there after RoPE, not gathered from the cache; a later chunk of a prompt
 * longer than a step (positions start + i) gathers all its start + len keys and values from
 * the paged cache through its block table (session 33: torch's SDPA with gathers and an
 * additive mask had taken those, and a 4 x 2,040-token prefill went 4.3 -> 3.3-3.4 s).
 * Per (sequence, KV head): K packed as a weight [keys, hd] and V^T as a weight [hd, keys]
 * (pairs of keys side by side). Per block of 12 query rows (12 / rep positions x the rep query
 * heads of that KV head, so every key panel serves all of them):
 *   S = Q K^T in fp32 over the keys the block's last position sees (whole panels of 32);
 *   per row, softmax over its own keys (the causal limit and the sliding window): the max,
 *   e = exp(scale * (s - max)) in fp32, their sum, e rounded to bf16 as P (as a bf16
 *   flash kernel feeds its second product);
 *   O = P V in fp32, divided by the sum and rounded to bf16 once into out.
 * Two passes over keys that stay in L2 (a 512-token sequence's K and V: 64 KiB each per head)
 * instead of an online softmax: the same sums, less bookkeeping.
 *
 * On AMX the blocks are 16 query rows (one A tile), P is padded with zeros to whole tiles of
 * 32 keys, and V^T's pairs to whole tiles of 16 (zeros): a 2-core Xeon runs vdpbf16ps at only
 * ~90-150 GFLOP/s; there a layer of 2 x 512 tokens took 8.4 ms on vdpbf16ps and 3.4 ms on
 * tiles (torch's SDPA 56 ms; docs/benchmarks.md, issue 12, session 31).
 *
 * The softmax's exponentials are about half of the call on tiles (1.7 of 3.2 ms at 2 x 512):
 * lanes wholly past the causal limit (or before the window) skip the exp, only lanes across an
 * edge build a mask, and P rounds to bf16 in one vcvtneps2bf16 (the same bits as rows.c's rne
 * on these values): 3.4-3.7 -> 2.5-2.9 ms a call, bit for bit the same (session 32). Session 33:
 * the exp of P is exp_p, degree 5 (P is bf16), ~9% of a call. Sessions 36-37: rows.c's
 * vexp2_bf16, its argument in one FMA. Session 37: on tiles with hd <= 64, attend_block_amx
 * overlaps the tile products with the softmax (0.802x).
 */
#include <string.h>

#include "gemv_bf16.c"
#include "rows.c"

#define AR 12     /* query rows a block: MB_MAX of gemv_bf16.c */
#define AR_AMX 16 /* on AMX: one A tile */
#define AR_MAX 16
#define VT_PAIRS 16 /* V^T's pairs of keys padded to a multiple of this (an AMX B tile) */

static long vt_pairs(long n) { return ((n + 1) / 2 + VT_PAIRS - 1) / VT_PAIRS * VT_PAIRS; }

/* V^T of keys [0, n) as a weight [hd, n]: vp[(d / P) * Kp * 2P + kp * 2P + (d % P) * 2 + h] =
 * v[(2 kp + h) * ld + d], Kp = vt_pairs(n), zero past n. hd % P == 0. */
static void pack_vt(const uint16_t *v, long ld, long n, long hd, uint16_t *vp) {
    long kp_n = vt_pairs(n);
#if TG_BF16 && defined(__AVX512BW__) && P == 32
    /* each pair of keys' 32 values of a panel interleaved in two vpermt2w (a scalar loop had
     * been ~5% of a 2 x 512 call) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (long p = 0; p < hd / P; p++) {
        uint16_t *dst = vp + p * kp_n * 2 * P;
        for (long kp = 0; kp < kp_n; kp++, dst += 2 * P) {
            long j = 2 * kp;
            __m512i a = j < n ? _mm512_loadu_si512(v + j * ld + p * P) : _mm512_setzero_si512();
            __m512i b = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * ld + p * P)
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(dst + P, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
#else
    for (long p = 0; p < hd / P; p++) {
        uint16_t *dst = vp + p * kp_n * 2 * P;
        for (long kp = 0; kp < kp_n; kp++)
            for (long h = 0; h < 2; h++) {
                long j = 2 * kp + h;
                for (long d = 0; d < P; d++)
                    dst[kp * 2 * P + d * 2 + h] = j < n ? v[j * ld + p * P + d] : 0;
            }
    }
#endif
}

/* Elements of one (sequence, KV head)'s packed K and V^T for n keys. */
static long packed_kv(long n, long hd) {
    return (n + P - 1) / P * (hd / 2) * 2 * P + hd / P * vt_pairs(n) * 2 * P;
}

#if TG_BF16

/* max of s[lo..hi] (a scalar loop was half of the whole kernel's time: one vmaxss chain). */
static float span_max(const float *s, long lo, long hi) {
    __m512 m = _mm512_set1_ps(-INFINITY), m1 = m, m2 = m, m3 = m;
    long j = lo;
    for (; j + 64 <= hi + 1; j += 64) { /* four chains: one vmaxps chain is latency-bound */
        m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
    }
    m = _mm512_max_ps(_mm512_max_ps(m, m1), _mm512_max_ps(m2, m3));
    for (; j + 16 <= hi + 1; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (j <= hi) {
        __mmask16 k = (__mmask16)((1u << (hi + 1 - j)) - 1);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + j));
    }
    return _mm512_reduce_max_ps(m);
}

/* A block's query rows into qb [ar][hd]: rows first .. first + npos - 1 of qkv, the rep query
 * heads of KV head g each (adjacent in a row: one copy a position), zero rows after. */
static inline void copy_queries(const uint16_t *qkv, long ld, long first, long npos, long rep,
                                long g, long hd, long ar, uint16_t *qb) {
    for (long i = 0; i < npos; i++) {
        const uint16_t *src = qkv + (first + i) * ld + g * rep * hd;
        for (long d = 0; d < rep * hd; d += 32) /* hd % 32 == 0 */
            _mm512_storeu_si512(qb + i * rep * hd + d, _mm512_loadu_si512(src + d));
    }
    memset(qb + npos * rep * hd, 0, (size_t)(ar - npos * rep) * hd * sizeof(uint16_t));
}

/* c[ar][P] fp32 = a[ar][2 kp_n] x one panel: AR rows on vdpbf16ps, AR_AMX on tiles. */
static void product(const uint16_t *a, long lda, const uint16_t *w, long kp_n, float *c,
                    long ldc, int amx) {
#if TG_AMX
    if (amx) {
        amx_panel_out32(a, lda, w, kp_n, c, ldc);
        return;
    }
#endif
    panel_t(a, lda, w, kp_n, c, ldc, P, AR, 1, 1);
}

/* One block: the chunk's query rows [t0, t0 + npos) (positions start + t0 ...) x rep heads of
 * KV head g, against the n keys packed in kp / vt; ar rows a block (AR, or AR_AMX on tiles). */
static void attend_block(const uint16_t *qkv, long ld, long first, long start, long n, long t0,
                         long npos, long rep, long g, long hd, float scale, long window,
                         const uint16_t *kp, const uint16_t *vt, uint16_t *out, long out_ld,
                         uint16_t *qb, float *s, uint16_t *pb, float *o, int amx) {
    long kmax = start + t0 + npos, np = (kmax + P - 1) / P, spad = np * P;
    long ppad = amx ? (kmax + 31) / 32 * 32 : (kmax + 1) / 2 * 2, ar = amx ? AR_AMX : AR;
    copy_queries(qkv, ld, first + t0, npos, rep, g, hd, ar, qb);
    long kstride = (hd / 2) * 2 * P;
    for (long p = 0; p < np; p++)
        product(qb, hd, kp + p * kstride, hd / 2, s + p * P, spad, amx);
    float inv[AR_MAX];
    for (long r = 0; r < npos * rep; r++) {
        long tq = start + t0 + r / rep, lo = window > 0 && tq + 1 > window ? tq + 1 - window : 0;
        float *sr = s + r * spad, m = span_max(sr, lo, tq);
        uint16_t *pr = pb + r * ppad;
        float total = 0.0f, a = scale * 1.44269504088896341f, b = -m * a; /* log2(e) */
        __m256 totals = _mm256_setzero_ps(); /* pairs of P summed by vdpbf16ps (x 1.0) */
        const __m256bh ones = (__m256bh)_mm256_set1_epi16(0x3f80);
        long j = 0;
        for (; j + VL <= ppad; j += VL) {
            if (j + VL <= lo || j > tq) { /* every lane masked: P 0, the sums as they were */
                *(vhu *)(pr + j) = (vh){};
                continue;
            }
            vf e = vexp2_bf16(*(vfu *)(sr + j) * a + b);
            if (j < lo || j + VL - 1 > tq) { /* lanes across the window's or the causal edge */
                const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
                vi idx = iota + (int)j;
                vi keep = (idx >= (vi){} + (int)lo) & (idx <= (vi){} + (int)tq);
                e = (vf)((vi)e & keep);
            }
            /* P to bf16 in one vcvtneps2bf16: rows.c's rne on e's range (finite, >= 0),
             * except that what underflowed to a subnormal flushes to 0 */
            __m256bh h = _mm512_cvtneps_pbh((__m512)e);
            *(vhu *)(pr + j) = (vh)h;
            totals = _mm256_dpbf16_ps(totals, h, ones); /* the sum of P as rounded */
        }
        total = _mm512_reduce_add_ps(_mm512_zextps256_ps512(totals));
        for (; j < ppad; j++) {
            float e = 0.0f;
            if (j >= lo && j <= tq) {
                vf v = (vf){} - 100.0f;
                v[0] = sr[j] * a + b;
                vf x = vexp2_bf16(v); /* flushed below 2^-126 as vcvtneps2bf16 flushes */
                e = x[0] < 0x1p-126f ? 0.0f : rne(x)[0];
            }
            total += e;
            pr[j] = (uint16_t)(((vu)((vf){} + e))[0] >> 16);
        }
        inv[r] = total > 0.0f ? 1.0f / total : 0.0f;
    }
    for (long r = npos * rep; r < ar; r++) memset(pb + r * ppad, 0, (size_t)ppad * 2);
    long vstride = vt_pairs(n) * 2 * P;
    for (long p = 0; p < hd / P; p++)
        product(pb, ppad, vt + p * vstride, ppad / 2, o + p * P, hd, amx);
    for (long r = 0; r < npos * rep; r++) {
        uint16_t *dst = out + (first + t0 + r / rep) * out_ld + (g * rep + r % rep) * hd;
        for (long d = 0; d < hd; d += VL) store_bf16(dst + d, *(vfu *)(o + r * hd + d) * inv[r]);
    }
}

#if TG_AMX
/* Lanes [j0, j0 + 32) of a row that sees keys [lo, tq]: bit i set where j0 + i is seen. */
static inline uint32_t span_mask(long j0, long lo, long tq) {
    long a = lo - j0, b = tq - j0;
    if (a <= 0 && b >= 31) return 0xffffffffu;
    if (b < 0 || a > 31) return 0;
    a = a < 0 ? 0 : a;
    b = b > 31 ? 31 : b;
    return (uint32_t)(((2ull << b) - 1) & ~((1ull << a) - 1));
}

/* S's panel p (32 keys) of the block into s (stride spad) on C tiles C0 / C1, Q's k-steps in
 * A tiles 4 (and 5 where hd is 64). */
#define S_PANEL(C0, C1, KP, DST)                                                                   \
    do {                                                                                           \
        _tile_zero(C0);                                                                            \
        _tile_zero(C1);                                                                            \
        _tile_loadd(6, (KP), 2 * P * 2);                                                           \
        _tile_loadd(7, (KP) + P, 2 * P * 2);                                                       \
        _tile_dpbf16ps(C0, 4, 6);                                                                  \
        _tile_dpbf16ps(C1, 4, 7);                                                                  \
        if (hk == 2) {                                                                             \
            _tile_loadd(6, (KP) + AMX_K * P, 2 * P * 2);                                           \
            _tile_loadd(7, (KP) + AMX_K * P + P, 2 * P * 2);                                       \
            _tile_dpbf16ps(C0, 5, 6);                                                              \
            _tile_dpbf16ps(C1, 5, 7);                                                              \
        }                                                                                          \
        _tile_stored(C0, (DST), spad * 4);                                                         \
        _tile_stored(C1, (DST) + 16, spad * 4);                                                    \
    } while (0)

/* O += P's k-step (A tile A, from PT) x V^T's k-step at VK, O in C tiles 0-1 (and 2-3). */
#define PV_STEP(A, PT, VK)                                                                         \
    do {                                                                                           \
        _tile_loadd(A, (PT), 64);                                                                  \
        _tile_loadd(6, (VK), 2 * P * 2);                                                           \
        _tile_loadd(7, (VK) + P, 2 * P * 2);                                                       \
        _tile_dpbf16ps(0, A, 6);                                                                   \
        _tile_dpbf16ps(1, A, 7);                                                                   \
        if (hk == 2) {                                                                             \
            _tile_loadd(6, (VK) + vstride, 2 * P * 2);                                             \
            _tile_loadd(7, (VK) + vstride + P, 2 * P * 2);                                         \
            _tile_dpbf16ps(2, A, 6);                                                               \
            _tile_dpbf16ps(3, A, 7);                                                               \
        }                                                                                          \
    } while (0)

/* attend_block on AMX tiles for hd 32 or 64, the tile products overlapped with the vector
 * work instead of between it: S is computed a panel of 32 keys at a time on alternating C tiles
 * (Q's k-steps resident in A tiles 4-5), each panel's row maxima taken while the next panel's
 * products run; then each panel's P (exp, rounded to bf16, summed by vdpbf16ps) goes into one of
 * two 1 KiB A tiles' worth of memory and its P V products (O in C tiles 0-3, a panel of keys a
 * k-step) are issued after the next panel's exponentials, so that the vector units compute the
 * one while the tiles multiply the other. attend_block ran S for the whole block, then the
 * softmax row by row, then P V, each waiting for the last: a 2 x 512 call of the 246M model
 * 0.802x (medians of 15 per-round ratios, all 15 below 1; session 37). */
static void attend_block_amx(const uint16_t *qkv, long ld, long first, long start, long n,
                             long t0, long npos, long rep, long g, long hd, float scale,
                             long window, const uint16_t *kp, const uint16_t *vt, uint16_t *out,
                             long out_ld, uint16_t *qb, float *s, uint16_t *pb, float *o) {
    long kmax = start + t0 + npos, np = (kmax + P - 1) / P, spad = np * P, hk = hd / AMX_K;
    long nrows = npos * rep, kstride = (hd / 2) * 2 * P, vstride = vt_pairs(n) * 2 * P;
    long lo[AR_AMX], tq[AR_AMX], lo_max = 0, tq_min = kmax;
    for (long r = 0; r < nrows; r++) {
        tq[r] = start + t0 + r / rep;
        lo[r] = window > 0 && tq[r] + 1 > window ? tq[r] + 1 - window : 0;
        lo_max = lo[r] > lo_max ? lo[r] : lo_max;
        tq_min = tq[r] < tq_min ? tq[r] : tq_min;
    }
    copy_queries(qkv, ld, first + t0, npos, rep, g, hd, AR_AMX, qb);
    _tile_loadd(4, qb, hd * 2);
    if (hk == 2) _tile_loadd(5, qb + AMX_K, hd * 2);
    __m512 mx[AR_AMX];
    for (long r = 0; r < nrows; r++) mx[r] = _mm512_set1_ps(-INFINITY);
    /* S panel by panel on alternating C tiles, each panel's row maxima taken while the next
     * panel's products run */
    for (long p = 0; p <= np; p++) {
        if (p < np) {
            const uint16_t *kpn = kp + p * kstride;
            if (p & 1)
                S_PANEL(2, 3, kpn, s + p * P);
            else
                S_PANEL(0, 1, kpn, s + p * P);
        }
        if (p == 0) continue;
        long q = p - 1, j0 = q * P;
        const float *sq = s + j0;
        if (j0 >= lo_max && j0 + P - 1 <= tq_min) {
            for (long r = 0; r < nrows; r++)
                mx[r] = _mm512_max_ps(mx[r], _mm512_max_ps(_mm512_loadu_ps(sq + r * spad),
                                                           _mm512_loadu_ps(sq + r * spad + 16)));
            continue;
        }
        for (long r = 0; r < nrows; r++) {
            uint32_t m = span_mask(j0, lo[r], tq[r]);
            if (!m) continue;
            mx[r] = _mm512_mask_max_ps(mx[r], (__mmask16)m, mx[r], _mm512_loadu_ps(sq + r * spad));
            mx[r] = _mm512_mask_max_ps(mx[r], (__mmask16)(m >> 16), mx[r],
                                       _mm512_loadu_ps(sq + r * spad + 16));
        }
    }
    float a = scale * 1.44269504088896341f, b[AR_AMX];
    __m512 sums[AR_AMX];
    for (long r = 0; r < nrows; r++) {
        b[r] = -_mm512_reduce_max_ps(mx[r]) * a;
        sums[r] = _mm512_setzero_ps();
    }
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    const __m512 av = _mm512_set1_ps(a);
    for (long i = 0; i < 2; i++)
        memset(pb + (i * AR_AMX + nrows) * P, 0, (size_t)(AR_AMX - nrows) * P * 2);
    _tile_zero(0);
    _tile_zero(1);
    if (hk == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    /* P panel by panel into alternating 1 KiB tiles, each panel's P V products issued after
     * the next panel's exponentials (so that P's stores have landed) */
    for (long p = 0; p <= np; p++) {
        if (p < np) {
            long j0 = p * P;
            const float *sq = s + j0;
            uint16_t *pt = pb + (p & 1) * AR_AMX * P;
            int full = j0 >= lo_max && j0 + P - 1 <= tq_min;
            for (long r = 0; r < nrows; r++) {
                uint32_t m = full ? 0xffffffffu : span_mask(j0, lo[r], tq[r]);
                if (!m) {
                    _mm512_storeu_si512(pt + r * P, _mm512_setzero_si512());
                    continue;
                }
                __m512 br = _mm512_set1_ps(b[r]);
                __m512 f0 = (__m512)vexp2_bf16(
                    (vf)_mm512_fmadd_ps(_mm512_loadu_ps(sq + r * spad), av, br));
                __m512 f1 = (__m512)vexp2_bf16(
                    (vf)_mm512_fmadd_ps(_mm512_loadu_ps(sq + r * spad + 16), av, br));
                if (m != 0xffffffffu) {
                    f0 = _mm512_maskz_mov_ps((__mmask16)m, f0);
                    f1 = _mm512_maskz_mov_ps((__mmask16)(m >> 16), f1);
                }
                __m512bh h = _mm512_cvtne2ps_pbh(f1, f0);
                _mm512_storeu_si512(pt + r * P, (__m512i)h);
                sums[r] = _mm512_dpbf16_ps(sums[r], h, ones);
            }
        }
        if (p == 0) continue;
        long q = p - 1;
        const uint16_t *vk = vt + q * AMX_K * P;
        if (q & 1)
            PV_STEP(5, pb + AR_AMX * P, vk);
        else
            PV_STEP(4, pb, vk);
    }
    _tile_stored(0, o, hd * 4);
    _tile_stored(1, o + 16, hd * 4);
    if (hk == 2) {
        _tile_stored(2, o + 32, hd * 4);
        _tile_stored(3, o + 48, hd * 4);
    }
    for (long r = 0; r < nrows; r++) {
        float total = _mm512_reduce_add_ps(sums[r]), inv = total > 0.0f ? 1.0f / total : 0.0f;
        uint16_t *dst = out + (first + t0 + r / rep) * out_ld + (g * rep + r % rep) * hd;
        for (long d = 0; d < hd; d += VL) store_bf16(dst + d, *(vfu *)(o + r * hd + d) * inv);
    }
}
#undef S_PANEL
#undef PV_STEP
#endif

/* The calling thread's share of the next linear's weights (`panels` panels of panel_bytes,
 * split as the linear kernel splits them over the same threads: my_panels), prefetched into
 * L2 a few lines after each of this call's blocks (about `blocks` of them a thread) so that
 * the linear finds them there instead of waiting on memory for its first pass: the layer's wo
 * after the attention. */
struct warm_lines {
    const char *base;
    long n, next, per;
};

static struct warm_lines warm_share(const void *warm, long panels, long panel_bytes,
                                    long blocks) {
    struct warm_lines w = {NULL, 0, 0, 0};
    if (!warm || panels < 1 || panel_bytes < 1) return w;
    long b, e;
    my_panels(panels, &b, &e);
    w.base = (const char *)warm + b * panel_bytes;
    w.n = (e - b) * panel_bytes / 64;
    w.per = (w.n + blocks - 1) / blocks;
    return w;
}

static inline void warm_step(struct warm_lines *w, long lines) {
    for (long i = 0; i < lines && w->next < w->n; i++, w->next++)
        __builtin_prefetch(w->base + w->next * 64, 0, 2);
}

#endif

/* Keys or values [0, n) of KV head g of one sequence, gathered from the paged cache
 * ([blocks][bs][nkv][hd] bf16) through its block table into dst [n][hd]. */
static void gather_cache(const uint16_t *cache, const long *table, long bs, long nkv, long g,
                         long hd, long n, uint16_t *dst) {
    for (long j = 0; j < n; j++)
        memcpy(dst + j * hd, cache + ((table[j / bs] * bs + j % bs) * nkv + g) * hd,
               (size_t)hd * sizeof(uint16_t));
}

/* For each sequence s with firsts[s] < T: its lens[s] queries at rows firsts[s] + i of qkv [T,
 * ld] (query head h at column h hd, keys at nh hd + g hd, values at (nh + nkv) hd + g hd),
 * at positions starts[s] + i (starts NULL: all 0), attend causally (position p to keys
 * max(0, p + 1 - window) .. p; window 0: none); results to out[(firsts[s] + i) * out_ld + h hd].
 * A first chunk (start 0) reads its keys and values from its own qkv rows; a later chunk of a
 * prompt reads all its start + len keys from the paged cache (k_cache / v_cache
 * [blocks][block_size][nkv][hd], through tables[s * tbl_ld ...]), which holds this chunk's
 * keys too (the caller writes them first). Returns 0, -1 on shapes or arguments it does not
 * take (hd % 32, nh / nkv > 12, a start without a cache), -2 without memory, -3 without
 * AVX512-BF16. */
int tg_prefill_attention_bf16(const uint16_t *qkv, long ld, long T, const long *firsts,
                              const long *lens, const long *starts, long nseq, long nh, long nkv,
                              long hd, float scale, long window, const uint16_t *k_cache,
                              const uint16_t *v_cache, const long *tables, long tbl_ld,
                              long block_size, uint16_t *out, long out_ld, int nthreads,
                              const void *warm, long warm_panels, long warm_panel_bytes) {
#if !TG_BF16
    (void)qkv, (void)ld, (void)T, (void)firsts, (void)lens, (void)starts, (void)nseq, (void)nh;
    (void)nkv, (void)hd, (void)scale, (void)window, (void)k_cache, (void)v_cache, (void)tables;
    (void)tbl_ld, (void)block_size, (void)out, (void)out_ld, (void)nthreads, (void)warm;
    (void)warm_panels, (void)warm_panel_bytes;
    return -3;
#else
    if (nh % nkv || hd % P || nh / nkv > AR || nseq < 0) return -1;
    int cached = 0; /* some chunk reads the cache */
    for (long s = 0; s < nseq && starts; s++)
        cached |= firsts[s] < T && starts[s] > 0;
    if (cached && (!k_cache || !v_cache || !tables || block_size < 1)) return -1;
#if TG_AMX
    const int amx = g_amx;
#else
    const int amx = 0;
#endif
    long rep = nh / nkv, npos = (amx ? AR_AMX : AR) / rep, nq = nh * hd, maxn = 1, nblocks = 0;
    long *off = malloc((size_t)(nseq + 1) * sizeof(long));   /* packed K/V offsets */
    long *boff = malloc((size_t)(nseq + 1) * sizeof(long));  /* first block of each */
    if (!off || !boff) {
        free(off), free(boff);
        return -2;
    }
    off[0] = boff[0] = 0;
    for (long s = 0; s < nseq; s++) {
        long n = firsts[s] < T ? lens[s] : 0, nk = n ? n + (starts ? starts[s] : 0) : 0;
        maxn = nk > maxn ? nk : maxn;
        off[s + 1] = off[s] + nkv * packed_kv(nk, hd);
        boff[s + 1] = boff[s] + (n + npos - 1) / npos;
    }
    nblocks = boff[nseq] * nkv;
    long spad = (maxn + P - 1) / P * P, ppad = (maxn + 31) / 32 * 32;
    ppad = ppad < 2 * P ? 2 * P : ppad; /* attend_block_amx: two tiles of P */
    long gathered = cached ? 2 * maxn * hd * 2 : 0; /* a cached chunk's K and V rows */
    long per_thread = AR_MAX * (hd * 2 + spad * 4 + ppad * 2 + hd * 4) + gathered + 5 * 64;
    uint16_t *packs = malloc((size_t)(off[nseq] > 0 ? off[nseq] : 1) * sizeof(uint16_t));
    char *scratch = malloc((size_t)per_thread * (size_t)nthreads);
    int failed = !packs || !scratch;
    if (!failed) {
#pragma omp parallel num_threads(nthreads)
        {
            char *mine = scratch + (long)thread_num() * per_thread;
            uint16_t *qb = (uint16_t *)mine;
            float *sc = (float *)(mine + AR_MAX * hd * 2);
            uint16_t *pb = (uint16_t *)((char *)sc + AR_MAX * spad * 4);
            float *o = (float *)((char *)pb + AR_MAX * ppad * 2);
            uint16_t *kg = (uint16_t *)((char *)o + AR_MAX * hd * 4), *vg = kg + maxn * hd;
#if TG_AMX
            if (amx) amx_configure(AMX_M);
#endif
#pragma omp for collapse(2) schedule(static)
            for (long s = 0; s < nseq; s++)
                for (long g = 0; g < nkv; g++) {
                    long n = firsts[s] < T ? lens[s] : 0, start = starts ? starts[s] : 0;
                    if (n == 0) continue;
                    long nk = start + n;
                    uint16_t *kp = packs + off[s] + g * packed_kv(nk, hd);
                    uint16_t *vp = kp + (nk + P - 1) / P * (hd / 2) * 2 * P;
                    if (start > 0) {
                        const long *table = tables + s * tbl_ld;
                        gather_cache(k_cache, table, block_size, nkv, g, hd, nk, kg);
                        gather_cache(v_cache, table, block_size, nkv, g, hd, nk, vg);
                        pack_rows(kg, hd, kp, nk, hd);
                        pack_vt(vg, hd, nk, hd, vp);
                        continue;
                    }
                    const uint16_t *rows = qkv + firsts[s] * ld;
                    pack_rows(rows + nq + g * hd, ld, kp, n, hd);
                    pack_vt(rows + nq + nkv * hd + g * hd, ld, n, hd, vp);
                }
            /* (implicit barrier: every K and V^T packed) */
            struct warm_lines wl = warm_share(warm, warm_panels, warm_panel_bytes,
                                              nblocks / thread_count() + 1);
/* guided: a causal block's cost grows with its position; one block at a time (dynamic, 1)
 * measured 4-6% slower on 2 x 512 tokens (session 32). nowait: the region's end is the
 * barrier, so a thread's last prefetches of wo overlap the other's last blocks. */
#pragma omp for schedule(guided) nowait
            for (long b = 0; b < nblocks; b++) {
                long g = b % nkv, blk = b / nkv, s = 0;
                while (boff[s + 1] <= blk) s++;
                long n = lens[s], t0 = (blk - boff[s]) * npos, start = starts ? starts[s] : 0;
                long k = npos < n - t0 ? npos : n - t0, nk = start + n;
                const uint16_t *kp = packs + off[s] + g * packed_kv(nk, hd);
                const uint16_t *vt = kp + (nk + P - 1) / P * (hd / 2) * 2 * P;
#if TG_AMX
                if (amx && hd <= 2 * AMX_K)
                    attend_block_amx(qkv, ld, firsts[s], start, nk, t0, k, rep, g, hd, scale,
                                     window, kp, vt, out, out_ld, qb, sc, pb, o);
                else
#endif
                    attend_block(qkv, ld, firsts[s], start, nk, t0, k, rep, g, hd, scale, window,
                                 kp, vt, out, out_ld, qb, sc, pb, o, amx);
                warm_step(&wl, wl.per);
            }
            warm_step(&wl, wl.n); /* what a short share of blocks left */
#if TG_AMX
            if (amx) _tile_release();
#endif
        }
    }
    free(packs), free(scratch), free(off), free(boff);
    return failed ? -2 : 0;
#endif
}

int tg_attn_bf16_abi(void) { return 4; }
