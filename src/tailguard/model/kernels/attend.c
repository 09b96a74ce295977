/* The paged decode attention: one query row per sequence, each (sequence, KV head) pair read
 * straight from the paged KV cache [num_blocks, bs, nkv, hd] through its block table, with the
 * group's query heads together (GQA); fp32, or bf16 with fp32 sums. tg_decode_attention and
 * tg_decode_attention_bf16 for the op-by-op forward, attend_one for the decode stacks.
 *
 * Not a translation unit of its own: rows.c includes it after the vector helpers it uses
 * (vf / VL, vexp_neg, vsum, load_at / store_at, REP_MAX / HD_MAX), so every library that
 * includes rows.c (the decode stacks, gemv_bf16.c, attn_bf16.c) has it too.
 */
#ifndef TG_ATTEND_C
#define TG_ATTEND_C

/* Cache rows t0 .. t1 (position t at off + t * row elements of esz bytes, a KV head hd of
 * them) prefetched into L1, on AVX-512 only (KV_PREFETCH). On the Zen 3 EPYC (AVX2) a prefetch
 * fills L1 and holds one of its few miss buffers for the whole trip to DRAM, and a block's
 * 64-128 of them at once stall the reads they were meant to help: the fp32 decode stack
 * without them 0.92-0.96x the time at 8 of 8 sequences at ~900 positions, 0.94-0.96x at 4 of 8
 * (1.00x with scattered block tables), 0.98x at ~64 (docs/benchmarks.md, session 41). */
#ifndef KV_PREFETCH
#define KV_PREFETCH (VBYTES != 32)
#endif
static inline void prefetch_rows(const void *cache, long off, long t0, long t1, long row,
                                 long hd, long esz) {
    if (!KV_PREFETCH) return;
    for (long t = t0; t < t1; t++)
        for (long o = 0; o < hd * esz; o += 64)
            __builtin_prefetch((const char *)cache + (off + t * row) * esz + o, 0, 3);
}

/* Positions [j, stop) of one cache block (offset base) while its keys are read: their values,
 * and with next >= 0 the same positions of the next block's keys (at offset next). A block of
 * the paged cache is a short stream of its own, which the AMX Xeon's hardware prefetcher
 * picks up too late: a 16 x 512 prefill's six decode rows a step, their attention 5.2-7.2 ->
 * 3.7-4.5 ms a step (ABAB, session 36). */
static inline void prefetch_kv(const void *k_cache, const void *v_cache, long base, long next,
                               long j, long stop, long bs, long row, long hd, long esz) {
    if (next >= 0) prefetch_rows(k_cache, next, j + bs, stop + bs, row, hd, esz);
    prefetch_rows(v_cache, base, j, stop, row, hd, esz);
}

/* Positions [j, stop) of one cache block (position t's values at base + t * row) into the
 * running sums[rep][hd] of lanes d .. d + NV * VL: NV value vectors a pass, so NV x rep sums
 * are in flight. Two (8 sums at rep 4) where one left the FMAs' latency showing: the attention
 * alone 0.76x / 0.91x the time at ~900 positions (cache hot / cold), the stack 0.95-0.99x
 * (session 41). The same sums in the same order either way; j == lo starts them at zero. */
ALWAYS_INLINE void values_pass(const void *v_cache, long base, long row, long j, long stop,
                               long lo, long len, const float *p, float *sums, long hd,
                               long rep, long d, const int NV, const int bf16) {
    vf acc[2][REP_MAX];
    for (int u = 0; u < NV; u++)
        for (long r = 0; r < rep; r++)
            acc[u][r] = j == lo ? (vf){} : *(vfu *)(sums + r * hd + d + u * VL);
    for (long t = j; t < stop; t++) {
        vf v[2];
        for (int u = 0; u < NV; u++) v[u] = load_at(v_cache, base + d + u * VL + t * row, bf16);
        for (long r = 0; r < rep; r++) {
            float pr = p[r * len + t - lo];
            for (int u = 0; u < NV; u++) acc[u][r] += pr * v[u];
        }
    }
    for (int u = 0; u < NV; u++)
        for (long r = 0; r < rep; r++) *(vfu *)(sums + r * hd + d + u * VL) = acc[u][r];
}

/* Query heads g * rep .. (g + 1) * rep of query row q + qrow * q_ld (its KV head g) over
 * positions [max(0, n - window), n) read through `table`; results to out + qrow * out_ld.
 * p: scratch of rep * n floats. q, the caches and out are fp32, or with `bf16` all bf16
 * (scores, softmax and sums in fp32 either way, the output rounded once). Strides count
 * elements. The rep heads go together: each key and value row is read (and converted) once
 * for all of them, not once per head (GQA: 4 heads a row on Mistral); per head, the sums run
 * in the same order as one head alone would. */
ALWAYS_INLINE void attend_kv_head_t(const void *q, long q_ld, long qrow, const void *k_cache,
                                    const void *v_cache, const long *table, long n, long bs,
                                    long nkv, long hd, long rep, long g, float scale,
                                    long window, void *out, long out_ld, float *p,
                                    const int bf16) {
    long row = nkv * hd; /* elements per cached token */
    long lo = window > 0 && n > window ? n - window : 0, len = n - lo;
    long q0 = qrow * q_ld + g * rep * hd; /* the group's first head */
    /* The rep query rows as fp32, copied to the frame: bf16 ones converted once here, not once
     * per key, and fp32 ones read at constant offsets of the frame. Read in place, GCC hoisted
     * their 4 x 8 vector addresses out of the key loop, spilled them, and every product
     * reloaded its address: the attention alone 0.84-0.88x the time with the copy at ~900
     * positions (one thread, session 41). */
    float qf[rep * hd] __attribute__((aligned(VBYTES)));
    for (long i = 0; i < rep * hd; i += VL) *(vf *)(qf + i) = load_at(q, q0 + i, bf16);
    float m[REP_MAX];
    for (long r = 0; r < rep; r++) m[r] = -INFINITY;
    /* positions block by block: the cache offset of position j is base + j * row */
    for (long j = lo; j < n;) {
        long blk = j / bs, stop = (blk + 1) * bs < n ? (blk + 1) * bs : n;
        long base = (table[blk] - blk) * bs * row + g * hd;
        long next = stop < n ? (table[blk + 1] - blk - 1) * bs * row + g * hd : -1;
        prefetch_kv(k_cache, v_cache, base, next, j, stop, bs, row, hd, bf16 ? 2 : 4);
        for (; j < stop; j++) {
            long kj = base + j * row;
            vf acc[REP_MAX];
            for (long r = 0; r < rep; r++) acc[r] = (vf){};
            for (long d = 0; d < hd; d += VL) {
                vf k = load_at(k_cache, kj + d, bf16);
                for (long r = 0; r < rep; r++) acc[r] += *(const vfu *)(qf + r * hd + d) * k;
            }
            for (long r = 0; r < rep; r++) {
                float sc = vsum(acc[r]) * scale;
                p[r * len + j - lo] = sc;
                m[r] = sc > m[r] ? sc : m[r];
            }
        }
    }
    float inv[REP_MAX];
    for (long r = 0; r < rep; r++) {
        float *pr = p + r * len, total = 0.0f;
        long j = 0;
        for (; j + VL <= len; j += VL) {
            vf e = vexp_neg(*(vfu *)(pr + j) - m[r]);
            *(vfu *)(pr + j) = e;
            total += vsum(e);
        }
        for (; j < len; j++) {
            vf v = (vf){} - 100.0f;
            v[0] = pr[j] - m[r];
            pr[j] = vexp_neg(v)[0];
            total += pr[j];
        }
        inv[r] = total > 0.0f ? 1.0f / total : 0.0f;
    }
    /* The values block by block, every d of a block while its rows are in L1 (the next
     * block's prefetched meanwhile), each lane's running sum over the positions carried from
     * block to block in sums[rep][hd]: the same sums in the same order as one pass over every
     * position a d, which re-read each value line from L2 or memory at long contexts (its rows
     * 1 KB apart, a 4 KiB page every 4): the fp32 stack 0.95-0.98x the time at 4 of 8
     * sequences at ~900 positions, 1.00x at ~64 (docs/benchmarks.md, session 40). fp32 sums in
     * the output row itself; bf16 in a buffer, rounded once at the end. */
    long o0 = qrow * out_ld + g * rep * hd, stop;
    float sbuf[bf16 ? REP_MAX * HD_MAX : 1];
    float *sums = bf16 ? sbuf : (float *)out + o0;
    for (long j = lo; j < n; j = stop) {
        long blk = j / bs, base = (table[blk] - blk) * bs * row + g * hd;
        stop = (blk + 1) * bs < n ? (blk + 1) * bs : n;
        if (stop < n)
            prefetch_rows(v_cache, (table[blk + 1] - blk - 1) * bs * row + g * hd, stop,
                          stop + bs < n ? stop + bs : n, row, hd, bf16 ? 2 : 4);
        long d = 0;
        for (; d + 2 * VL <= hd; d += 2 * VL)
            values_pass(v_cache, base, row, j, stop, lo, len, p, sums, hd, rep, d, 2, bf16);
        for (; d < hd; d += VL)
            values_pass(v_cache, base, row, j, stop, lo, len, p, sums, hd, rep, d, 1, bf16);
    }
    for (long r = 0; r < rep; r++)
        for (long d = 0; d < hd; d += VL)
            store_at(out, o0 + r * hd + d, *(vfu *)(sums + r * hd + d) * inv[r], bf16);
}

/* One (sequence, KV head) of the decode attention: Mistral's shapes with constant sizes, so
 * the loops unroll and the sums stay in registers (the same sums in the same order as the
 * generic call). Shared by tg_decode_attention* and the decode stacks. */
static inline void attend_one(const void *q, long q_ld, long qrow, const void *k_cache,
                              const void *v_cache, const long *table, long n, long bs, long nh,
                              long nkv, long hd, long g, float scale, long window, void *out,
                              long out_ld, float *p, int bf16) {
#define ATTEND(HD, REP, BF16)                                                                  \
    attend_kv_head_t(q, q_ld, qrow, k_cache, v_cache, table, n, bs, nkv, HD, REP, g, scale,    \
                     window, out, out_ld, p, BF16)
    if (bf16 && nh == 4 * nkv && hd == 64)
        ATTEND(64, 4, 1);
    else if (bf16 && nh == 4 * nkv && hd == 128)
        ATTEND(128, 4, 1);
    else if (bf16)
        ATTEND(hd, nh / nkv, 1);
    else if (nh == 4 * nkv && hd == 64)
        ATTEND(64, 4, 0);
    else if (nh == 4 * nkv && hd == 128)
        ATTEND(128, 4, 0);
    else
        ATTEND(hd, nh / nkv, 0);
#undef ATTEND
}

/* How every decode attention (here and in the decode stacks) hands its (sequence, KV head)
 * pairs to threads: one at a time, not in contiguous halves. A pair's cost is its context, and
 * served batches mix contexts: a static split gave one thread every pair of the long ones. The
 * fp32 decode stack of the 246M model at 8 sequences, 1 / 2 / 4 of them at ~900 positions and
 * the rest at ~64, ran 0.91x / 0.86x / 0.81x the time with them handed out, and 1.00x at equal
 * contexts (docs/benchmarks.md, session 40). The outputs do not depend on which thread runs a
 * pair. */
#define ATTEND_SCHEDULE schedule(dynamic, 1)

/* The sequences of a decode group with a real query row (q_rows[s] < pad_row) into idx:
 * their count. Padding sequences sit in the bucket's tail, and a split over all of them gave
 * one thread the real ones: at 6 real rows of 8 one thread ran 16 (sequence, KV head) pairs
 * and the other 8. */
static long real_seqs(const long *q_rows, long nseq, long pad_row, long *idx) {
    long n = 0;
    for (long s = 0; s < nseq; s++)
        if (q_rows[s] < pad_row) idx[n++] = s;
    return n;
}

/* tg_decode_attention, on fp32 or (bf16) bf16 tensors. */
static int decode_attention(const void *q, long q_ld, const long *q_rows, long nseq,
                            long pad_row, const void *k_cache, const void *v_cache,
                            const long *tables, long tbl_ld, const long *ctx_lens, long max_ctx,
                            long bs, long nh, long nkv, long hd, float scale, long window,
                            void *out, long out_ld, int nthreads, int bf16) {
    if (nh % nkv || nh / nkv > REP_MAX || (bf16 && hd > HD_MAX)) return -1;
    long idx[nseq > 0 ? nseq : 1], n = real_seqs(q_rows, nseq, pad_row, idx);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n * nkv > 1)
    {
        size_t len = (size_t)(nh / nkv) * (size_t)(max_ctx > 0 ? max_ctx : 1);
        float *p = malloc(len * sizeof(float));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for ATTEND_SCHEDULE
        for (long i = 0; i < n * nkv; i++) {
            long s = idx[i / nkv], g = i % nkv;
            if (p)
                attend_one(q, q_ld, q_rows[s], k_cache, v_cache, tables + s * tbl_ld,
                           ctx_lens[s], bs, nh, nkv, hd, g, scale, window, out, out_ld, p, bf16);
        }
        free(p);
    }
    return failed ? -2 : 0;
}

/* For every sequence s whose query row q_rows[s] is below pad_row: each query head h attends
 * over positions [max(0, n - window), n) of its KV head h / (nh / nkv), n = ctx_lens[s], the
 * keys and values read from k_cache / v_cache [num_blocks, bs, nkv, hd] through the block
 * table row s of `tables` [nseq, tbl_ld]; the result goes to out[q_rows[s] * out_ld + h * hd].
 * q rows are [nh, hd] at q + q_rows[s] * q_ld. window 0: no window. Scratch for the scores is
 * allocated per thread (nh / nkv * max_ctx floats). Returns 0, -1 when nh / nkv > REP_MAX,
 * or -2 without memory. hd % VL must be 0. fp32 q, caches and out; tg_decode_attention_bf16:
 * all four bf16 (uint16). */
int tg_decode_attention(const float *q, long q_ld, const long *q_rows, long nseq, long pad_row,
                        const float *k_cache, const float *v_cache, const long *tables,
                        long tbl_ld, const long *ctx_lens, long max_ctx, long bs, long nh,
                        long nkv, long hd, float scale, long window, float *out, long out_ld,
                        int nthreads) {
    return decode_attention(q, q_ld, q_rows, nseq, pad_row, k_cache, v_cache, tables, tbl_ld,
                            ctx_lens, max_ctx, bs, nh, nkv, hd, scale, window, out, out_ld,
                            nthreads, 0);
}

int tg_decode_attention_bf16(const uint16_t *q, long q_ld, const long *q_rows, long nseq,
                             long pad_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const long *tables, long tbl_ld, const long *ctx_lens, long max_ctx,
                             long bs, long nh, long nkv, long hd, float scale, long window,
                             uint16_t *out, long out_ld, int nthreads) {
    return decode_attention(q, q_ld, q_rows, nseq, pad_row, k_cache, v_cache, tables, tbl_ld,
                            ctx_lens, max_ctx, bs, nh, nkv, hd, scale, window, out, out_ld,
                            nthreads, 1);
}

#endif /* TG_ATTEND_C */
