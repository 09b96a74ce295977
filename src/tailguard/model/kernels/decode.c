/* The decoder stack of a decode step in one call (CPU fp32): every layer's RMSNorm, fused
 * QKV projection, RoPE, KV-cache write, paged decode attention, output projection, residual,
 * RMSNorm, gate/up projection, silu(gate) * up, down projection and residual, for T tokens
 * of which the decode group's rows attend.
 *
 * Why: run op by op from Python, a 246M model's batch-8 decode step spent ~10 ms of ~40 outside
 * its matmuls (docs/benchmarks.md, issue 12, session 23): ~13 torch and ctypes calls a layer,
 * each a Python dispatch and most an OpenMP region of their own. Here the whole stack is one
 * parallel region; the phases of a layer are separated by barriers only.
 *
 * The pieces are this folder's own: the small-M linear (gemv.c, panels from tg_pack) and the
 * row kernels (rows.c), included here so each phase is the same code as the op it replaces
 * (same summation order: the same greedy tokens as the op-by-op path, tested).
 */
#include <string.h>

#include "gemv.c"
#include "rows.c"

/* One layer's weights and cache. Linear weights are tg_pack panels. */
struct tg_layer {
    const float *attn_norm, *ffn_norm; /* [H] */
    const float *wqkv;                 /* [(nh + 2 nkv) hd, H] */
    const float *wo;                   /* [H, nh hd] */
    const float *w13;                  /* [2 I, H]: gate rows, then up rows */
    const float *w2;                   /* [H, I] */
    float *k_cache, *v_cache;          /* [blocks, bs, nkv, hd] */
};

struct tg_dims {
    long H, nh, nkv, hd, I, bs, window;
    float eps, scale;
};

static long max3(long a, long b, long c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Floats of x's transposed copy (linear_in_region's xt) the stack's products share: none up to
 * MB_MAX rows, where every product reads x in place; above, room for the widest input, for the
 * products off the k-blocked walk (in_place). */
static long xt_floats(const struct tg_dims *d, long T) {
    return T > MB_MAX ? T * max3(d->H, d->nh * d->hd, d->I) : 0;
}

/* Floats of scratch tg_decode_stack needs. */
long tg_decode_scratch(const struct tg_dims *d, long T, long max_ctx, int nthreads) {
    long nq = d->nh * d->hd, nqkv = (d->nh + 2 * d->nkv) * d->hd;
    long xt = xt_floats(d, T);
    long scores = (long)nthreads * (d->nh / d->nkv) * (max_ctx + 1); /* per thread: rep heads */
    return T * (2 * d->H + nqkv + nq + 3 * d->I) + xt + scores;
}

static void add_row(float *x, const float *y, long H) {
    for (long i = 0; i < H; i += VL) *(vfu *)(x + i) += *(const vfu *)(y + i);
}

/* x [T, H]: the embedded tokens in, the last layer's residual stream out (before the final
 * norm). cos_t / sin_t [T, hd]; slots [T] (each token's KV slot: block * bs + offset). The
 * decode group: nseq sequences, the one query of sequence s at token row q_rows[s] (rows >= T
 * are padding), its block table row s of `tables` [nseq, tbl_ld], its context ctx_lens[s]
 * (<= max_ctx). scratch: tg_decode_scratch floats. Returns 0, -1 on bad arguments. */
int tg_decode_stack(const struct tg_layer *layers, long n_layers, const struct tg_dims *d,
                    float *x, long T, const float *cos_t, const float *sin_t, const long *slots,
                    const long *q_rows, long nseq, const long *tables, long tbl_ld,
                    const long *ctx_lens, long max_ctx, float *scratch, int nthreads) {
    const long H = d->H, I = d->I, hd = d->hd, nkv = d->nkv;
    const long nq = d->nh * hd, nqkv = (d->nh + 2 * nkv) * hd, row = nkv * hd;
    if (T < 1 || nthreads < 1 || H % VL || I % VL || hd % VL || d->nh % nkv ||
        d->nh / nkv > REP_MAX)
        return -1;
    float *h = scratch, *qkv = h + T * H, *att = qkv + T * nqkv, *tmp = att + T * nq;
    float *gu = tmp + T * H, *act = gu + T * 2 * I, *xt = act + T * I;
    float *scores = xt + xt_floats(d, T);
    long real[nseq > 0 ? nseq : 1], nreal = real_seqs(q_rows, nseq, T, real); /* shared */
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        float *p = scores + (long)omp_get_thread_num() * (d->nh / d->nkv) * (max_ctx + 1);
#else
        float *p = scores;
#endif
        for (long l = 0; l < n_layers; l++) {
            const struct tg_layer *L = layers + l;
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) rms_row(x + t * H, L->attn_norm, h + t * H, H, d->eps);
            linear_in_region(h, H, L->wqkv, qkv, nqkv, T, nqkv, H, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                rope_row(qkv + t * nqkv, d->nh + nkv, hd, cos_t + t * hd, sin_t + t * hd);
                memset(att + t * nq, 0, (size_t)nq * sizeof(float));
            }
#pragma omp single
            for (long t = 0; t < T; t++) { /* one thread: padding tokens share a slot */
                memcpy(L->k_cache + slots[t] * row, qkv + t * nqkv + nq, row * sizeof(float));
                memcpy(L->v_cache + slots[t] * row, qkv + t * nqkv + nq + row,
                       row * sizeof(float));
            }
#pragma omp for ATTEND_SCHEDULE /* attend.c: the pairs' costs differ */
            for (long i = 0; i < nreal * nkv; i++) {
                long s = real[i / nkv], g = i % nkv;
                attend_one(qkv, nqkv, q_rows[s], L->k_cache, L->v_cache, tables + s * tbl_ld,
                           ctx_lens[s], d->bs, d->nh, nkv, hd, g, d->scale, d->window, att, nq, p,
                           0);
            }
            linear_in_region(att, nq, L->wo, tmp, H, T, H, nq, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                add_row(x + t * H, tmp + t * H, H);
                rms_row(x + t * H, L->ffn_norm, h + t * H, H, d->eps);
            }
            linear_in_region(h, H, L->w13, gu, 2 * I, T, 2 * I, H, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++)
                silu_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
            linear_in_region(act, I, L->w2, tmp, H, T, H, I, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) add_row(x + t * H, tmp + t * H, H);
        }
    }
    return 0;
}

int tg_decode_abi(void) { return 1; }
