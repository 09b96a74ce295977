/* The decoder stack of a decode step in one call, bf16 (CPUs with AVX512-BF16; its linears on
 * AMX tiles where gemv_bf16.c's AMX path is on):
 * decode.c's phases on bf16 activations, weights and KV cache, each rounding where the
 * op-by-op bf16 path rounds, so both give the same bits (tested).
 *
 * Why: with the bf16 linear kernel (gemv_bf16.c) a 246M model's batch-8 decode step on a
 * 2-core Zen 4 spent ~5 ms of ~18 outside its matmuls and attention: ~13 Python dispatches a
 * layer, most an OpenMP region of their own (docs/benchmarks.md, issue 12, session 30). Here
 * the whole stack is one parallel region; the phases of a layer are separated by barriers.
 *
 * The pieces: the bf16 linear (gemv_bf16.c, panels from tg_bf16_pack) and the row kernels
 * (rows.c: rms_row_bf16, rope_row_bf16, silu_row_bf16; attend.c's attend_one), included so
 * each phase is the op it replaces. The residual add rounds its fp32 sum once, as torch's
 * bf16 add does.
 */
#include <string.h>

#include "gemv_bf16.c"
#include "rows.c"

typedef uint16_t bf16_t;

/* One layer's weights and cache (all bf16). Linear weights are tg_bf16_pack panels. */
struct tg_layer_bf16 {
    const bf16_t *attn_norm, *ffn_norm; /* [H] */
    const bf16_t *wqkv;                 /* [(nh + 2 nkv) hd, H] */
    const bf16_t *wo;                   /* [H, nh hd] */
    const bf16_t *w13;                  /* [2 I, H]: gate rows, then up rows */
    const bf16_t *w2;                   /* [H, I] */
    bf16_t *k_cache, *v_cache;          /* [blocks, bs, nkv, hd] */
};

struct tg_dims_bf16 {
    long H, nh, nkv, hd, I, bs, window;
    float eps, scale;
};

static long max3(long a, long b, long c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Bytes of scratch tg_decode_stack_bf16 needs (each part 64-byte aligned). */
static long align64(long n) { return (n + 63) / 64 * 64; }

/* The next `bytes` of the scratch at *c (each piece 64-byte aligned). */
static void *carve(char **c, long bytes) {
    void *p = *c;
    *c += align64(bytes);
    return p;
}

/* The linears' x scratch for T rows, on either path (vdpbf16ps pairs or the AMX copy). */
static long xt_bytes(long T, long kmax) {
    long pairs = T > MB_MAX ? 4 * T * ((kmax + 1) / 2) : 0;
    long amx = amx_copy_bytes(T, kmax);
    return align64(pairs > amx ? pairs : amx);
}

long tg_decode_scratch_bf16(const struct tg_dims_bf16 *d, long T, long max_ctx, int nthreads) {
    long nq = d->nh * d->hd, nqkv = (d->nh + 2 * d->nkv) * d->hd;
    long acts = align64(2 * T * d->H) * 2 + align64(2 * T * nqkv) + align64(2 * (T + 1) * nq) +
                align64(2 * T * 2 * d->I) + align64(2 * T * d->I);
    long xt = xt_bytes(T, max3(d->H, nq, d->I));
    long scores = align64(4L * nthreads * (d->nh / d->nkv) * (max_ctx + 1));
    return acts + xt + scores;
}

static void add_row_bf16(bf16_t *x, const bf16_t *y, long H) {
    for (long i = 0; i < H; i += VL) store_bf16(x + i, load_bf16(x + i) + load_bf16(y + i));
}

/* x [T, H] bf16: the embedded tokens in, the last layer's residual stream out (before the
 * final norm). cos_t / sin_t [T, hd] bf16; slots [T]; the decode group as in decode.c.
 * scratch: tg_decode_scratch_bf16 bytes, 64-byte aligned. Returns 0, -1 on bad arguments,
 * -3 without AVX512-BF16. */
int tg_decode_stack_bf16(const struct tg_layer_bf16 *layers, long n_layers,
                         const struct tg_dims_bf16 *d, bf16_t *x, long T, const bf16_t *cos_t,
                         const bf16_t *sin_t, const long *slots, const long *q_rows, long nseq,
                         const long *tables, long tbl_ld, const long *ctx_lens, long max_ctx,
                         char *scratch, int nthreads) {
#if !TG_BF16
    (void)layers, (void)n_layers, (void)d, (void)x, (void)T, (void)cos_t, (void)sin_t;
    (void)slots, (void)q_rows, (void)nseq, (void)tables, (void)tbl_ld, (void)ctx_lens;
    (void)max_ctx, (void)scratch, (void)nthreads;
    return -3;
#else
    const long H = d->H, I = d->I, hd = d->hd, nkv = d->nkv, nh = d->nh;
    const long nq = nh * hd, nqkv = (nh + 2 * nkv) * hd, row = nkv * hd;
    if (T < 1 || nthreads < 1 || H % VL || I % VL || (hd / 2) % VL || hd % 2 || nh % nkv ||
        nh / nkv > REP_MAX || hd > HD_MAX || H % 2 || I % 2 || nq % 2)
        return -1;
    char *c = scratch;
    bf16_t *h = carve(&c, 2 * T * H), *tmp = carve(&c, 2 * T * H);
    bf16_t *qkv = carve(&c, 2 * T * nqkv);
    bf16_t *att = carve(&c, 2 * (T + 1) * nq); /* row T: the padding row, as in the torch path */
    bf16_t *gu = carve(&c, 2 * T * 2 * I), *act = carve(&c, 2 * T * I);
    uint32_t *xt = carve(&c, xt_bytes(T, max3(H, nq, I)));
    float *scores = (float *)c;
    long real[nseq > 0 ? nseq : 1], nreal = real_seqs(q_rows, nseq, T, real); /* shared */
#pragma omp parallel num_threads(nthreads)
    {
        float *p = scores + (long)thread_num() * (nh / nkv) * (max_ctx + 1);
        for (long l = 0; l < n_layers; l++) {
            const struct tg_layer_bf16 *L = layers + l;
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++)
                rms_row_bf16(x + t * H, L->attn_norm, h + t * H, H, d->eps);
            linear_in_region(h, H, L->wqkv, qkv, nqkv, T, nqkv, H, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                rope_row_bf16(qkv + t * nqkv, nh + nkv, hd, cos_t + t * hd, sin_t + t * hd);
                memset(att + t * nq, 0, (size_t)nq * sizeof(bf16_t));
            }
#pragma omp single
            for (long t = 0; t < T; t++) { /* one thread: padding tokens share a slot */
                memcpy(L->k_cache + slots[t] * row, qkv + t * nqkv + nq, row * sizeof(bf16_t));
                memcpy(L->v_cache + slots[t] * row, qkv + t * nqkv + nq + row,
                       row * sizeof(bf16_t));
            }
#pragma omp for ATTEND_SCHEDULE /* attend.c: the pairs' costs differ */
            for (long i = 0; i < nreal * nkv; i++) {
                long s = real[i / nkv], g = i % nkv;
                attend_one(qkv, nqkv, q_rows[s], L->k_cache, L->v_cache, tables + s * tbl_ld,
                           ctx_lens[s], d->bs, nh, nkv, hd, g, d->scale, d->window, att, nq, p,
                           1);
            }
            linear_in_region(att, nq, L->wo, tmp, H, T, H, nq, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                add_row_bf16(x + t * H, tmp + t * H, H);
                rms_row_bf16(x + t * H, L->ffn_norm, h + t * H, H, d->eps);
            }
            linear_in_region(h, H, L->w13, gu, 2 * I, T, 2 * I, H, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++)
                silu_row_bf16(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
            linear_in_region(act, I, L->w2, tmp, H, T, H, I, xt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) add_row_bf16(x + t * H, tmp + t * H, H);
        }
    }
    return 0;
#endif
}

#if TG_BF16
static float bf16_to_float(bf16_t b) { /* exact: bf16 is fp32's upper half */
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* Bytes of scratch tg_greedy_head_bf16 needs. */
long tg_greedy_scratch_bf16(long nrows, long H, long V, int nthreads) {
    return align64(2 * nrows * H) + align64(2 * nrows * V) + xt_bytes(nrows, H) +
           align64(4 * V) * nthreads;
}

/* The greedy tail of a decode step, in one parallel region: for each of nrows rows of the
 * stack's output x [T, H] (row rows[i]), the final RMSNorm (norm_w), the output head (panels
 * of [V, H] from tg_bf16_pack) and the id of the first maximal logit (a NaN wins, as
 * torch.argmax) into ids[i]. The op-by-op tail's roundings: rms_row_bf16 as the norm, the
 * head on linear_in_region as the bf16 kernel, bf16 logits widened to fp32 for row_argmax.
 * Why: that tail was five Python calls and a [rows, V] fp32 copy; with this call a 246M
 * model's batch-8 step went 22.1-23.3 -> 20.0-20.6 ms (docs/benchmarks.md, issue 12,
 * session 32).
 * scratch: tg_greedy_scratch_bf16 bytes, 64-byte aligned. Returns 0, -1 on bad arguments,
 * -3 without AVX512-BF16. */
int tg_greedy_head_bf16(const bf16_t *x, long T, const long *rows, long nrows,
                        const bf16_t *norm_w, float eps, long H, const bf16_t *head, long V,
                        long *ids, char *scratch, int nthreads) {
#if !TG_BF16
    (void)x, (void)T, (void)rows, (void)nrows, (void)norm_w, (void)eps, (void)H, (void)head;
    (void)V, (void)ids, (void)scratch, (void)nthreads;
    return -3;
#else
    if (nrows < 1 || T < 1 || V < 1 || H % VL || H % 2 || nthreads < 1) return -1;
    for (long i = 0; i < nrows; i++)
        if (rows[i] < 0 || rows[i] >= T) return -1;
    char *c = scratch;
    bf16_t *h = carve(&c, 2 * nrows * H), *logits = carve(&c, 2 * nrows * V);
    uint32_t *xt = carve(&c, xt_bytes(nrows, H));
    float *wide = (float *)c;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = wide + (long)thread_num() * (align64(4 * V) / 4);
#pragma omp for schedule(static)
        for (long i = 0; i < nrows; i++)
            rms_row_bf16(x + rows[i] * H, norm_w, h + i * H, H, eps);
        linear_in_region(h, H, head, logits, V, nrows, V, H, xt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long i = 0; i < nrows; i++) {
            const bf16_t *l = logits + i * V;
            for (long j = 0; j < V; j++) row[j] = bf16_to_float(l[j]);
            ids[i] = row_argmax(row, V);
        }
    }
    return 0;
#endif
}

int tg_decode_bf16_abi(void) { return 3; }
