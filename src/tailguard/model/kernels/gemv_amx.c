/* The AMX tile path of gemv_bf16.c (included by it, inside its `#if TG_AMX`): the same
 * panels as AMX's B operand. Up to 16 rows one in-place A tile meets two panels at a time
 * (amx_small); 17-32 rows two in-place A tiles meet one panel over the whole of K
 * (amx_medium); above, x is copied into zero-padded blocks of 32 rows, each panel a 2 x 2
 * grid of C tiles over k-chunks kept in L1 across a group of blocks (amx_blocked, with the
 * epilogues of tg_bf16_linear_fused). Where this machine's tiles stand:
 * bench/amx_probe.py, docs/engine.md "CPU bf16 with AMX". */
static int g_amx = 0;         /* tg_bf16_set_amx */
static int g_amx_buffers = 1; /* tg_bf16_amx_buffers (tests) */

#ifndef AMX_KC
#define AMX_KC 256 /* k per chunk of a panel kept in L1 (16 KiB) across a group of blocks */
#endif
#ifndef AMX_KC_WIDE
#define AMX_KC_WIDE 512 /* the same up to AMX_KC_WIDE_K (32 KiB of the panel) */
#endif
#ifndef AMX_KC_WIDE_K
#define AMX_KC_WIDE_K 2048
#endif
#ifndef AMX_L2_X_BYTES
#define AMX_L2_X_BYTES (1024 * 1024)
#endif

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 64 bytes wide, tile t `rows[t]` rows high. */
static void amx_load_tiles(const uint8_t rows[8]) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows[t];
    }
    _tile_loadconfig(&cfg);
}

/* Tiles: 0-3 C (row block r, column half c at 2r + c; up to 16 rows: two panels x two
 * halves), 4-5 A (row blocks; up to 16 rows 5 is a third B), 6-7 B (halves). */
static void amx_configure(int rows) {
    uint8_t r = (uint8_t)rows;
    amx_load_tiles((const uint8_t[8]){r, r, r, r, r, 16, 16, 16});
}

/* 17 to 32 rows read in place (amx_medium): C tiles 0-1 and A tile 4 the first 16 rows, C
 * 2-3 and A 5 the other `rows2`, B 6-7. */
static void amx_configure_split(int rows2) {
    uint8_t r = (uint8_t)rows2;
    amx_load_tiles((const uint8_t[8]){16, 16, r, r, 16, r, 16, 16});
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
            vf gv = as_stored16(_mm512_loadu_ps(g + m * ldc + h));
            vf uv = as_stored16(_mm512_loadu_ps(u + m * ldc + h));
            store_bf16(y + m * ldy + h, rne(silu_bf16(gv)) * uv);
        }
}

/* amx_store with the residual added: y rows = bf16(bf16(c) + r), the product rounded as
 * amx_store rounds it, then the sum as torch's bf16 add rounds it (so the same bits as the
 * linear and then `r + y`); n whole panels. A row's 32 columns at once: the product rounded
 * by one vcvtne2ps2bf16, both operands widened by unpacking against zero (which puts each
 * 128-bit lane's words out of order, the same order for both), the sums rounded by one
 * vcvtne2ps2bf16 and put back in order by one vpermw; a row whose sums hold a denormal or a
 * NaN (which vcvtne2ps2bf16 does not round as c10 does: rows.c's hw_rne_ok) takes the 16-lane
 * path. wo and w2 with the residual at 1,024 rows: the whole store had cost 5-7% of the call
 * (a build storing the product alone 0.947x / 0.926x); this one ~1-2% faster than the 16-lane
 * one (A/Bs in both orders; session 37). */
static void amx_store_add(const float *c, long ldc, int rows, const uint16_t *r, long ldr,
                          uint16_t *y, long ldy) {
    /* word n of the row in natural order is word order[n] of the packed unpacked halves */
    const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                           10, 9, 8, 23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16,
                                           3, 2, 1, 0);
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < rows; m++) {
        const float *cr = c + m * ldc;
        __m512i pw = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(cr + 16), _mm512_loadu_ps(cr));
        __m512i rw = _mm512_loadu_si512(r + m * ldr);
        __m512 lo = _mm512_add_ps((__m512)_mm512_unpacklo_epi16(zero, pw),
                                  (__m512)_mm512_unpacklo_epi16(zero, rw));
        __m512 hi = _mm512_add_ps((__m512)_mm512_unpackhi_epi16(zero, pw),
                                  (__m512)_mm512_unpackhi_epi16(zero, rw));
        if (hw_rne_ok((vf)lo) && hw_rne_ok((vf)hi)) {
            __m512i sw = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(y + m * ldy, _mm512_permutexvar_epi16(order, sw));
            continue;
        }
        for (int h = 0; h < P; h += 16) {
            vf prod = as_stored16(_mm512_loadu_ps(cr + h));
            store_bf16(y + m * ldy + h, prod + load_bf16(r + m * ldr + h));
        }
    }
}

/* Where amx_blocked reads x: every block of 32 rows copied into `blocks` (zero-padded, each
 * k-step's two A tiles side by side: amx_copy_blocks), or, with rows set, blocks [0, full)
 * read in place (rows ld apart) and only a partial last block copied (blocks' block 0). */
struct amx_x {
    const uint16_t *blocks, *rows;
    long ld, full;
};

/* Block blk's first k-step in x: returns its first A tile; *ld_bytes the tiles' row stride,
 * *step the elements to the next k-step, *half those to the second A tile (rows 16-31). */
static inline const uint16_t *amx_x_block(const struct amx_x *xs, long blk, long K,
                                          long *ld_bytes, long *step, long *half) {
    if (xs->rows && blk < xs->full) {
        *ld_bytes = xs->ld * 2, *step = AMX_K, *half = AMX_M * xs->ld;
        return xs->rows + blk * AMX_XB * xs->ld;
    }
    *ld_bytes = AMX_K * 2, *step = AMX_XB * AMX_K, *half = AMX_M * AMX_K;
    return xs->blocks + (xs->rows ? blk - xs->full : blk) * AMX_XB * K;
}

/* x is read in place (struct amx_x's rows) where a thread runs at most AMX_INPLACE_PANELS
 * panels, to amortise the copy over: at 1,024 rows on 2 threads, wo and w2 of the 246M model
 * (N 1,024: 16 panels a thread) ran 1.81 -> 2.00 and 1.74 -> 1.97 TFLOP/s in place, w13 (88)
 * 1.98 -> 1.81: the copied blocks' contiguous tiles pay where x is read for many panels
 * (session 33; amx_x_of). */
#ifndef AMX_INPLACE_PANELS
#define AMX_INPLACE_PANELS 16
#endif

#ifndef AMX_L2_X_BYTES_SILU
#define AMX_L2_X_BYTES_SILU (512 * 1024)
#endif

/* Blocks of 32 x rows per group in amx_blocked: as many as fit in AMX_L2_X_BYTES, with silu in
 * AMX_L2_X_BYTES_SILU (its gate and up sums wait in a buffer 4 blocks' sums a block of the
 * group, struct amx_pending: with groups of 1 MiB of x, 1.3 MiB of a 2 MiB L2 a thread). w13
 * + norm + silu at 1,024 rows (groups of 16 -> 8 blocks): 0.970x and 0.850x in two A/Bs (12
 * blocks 0.985x, 6 blocks 1.006x); in the model w13 / w2 1.52-1.60 -> 1.43-1.48 a step. wqkv
 * (no silu) with groups of 8 blocks read no better in the model and keeps 16 (session 37). */
static long amx_group(long M, long K, int silu) {
    long bytes = silu ? AMX_L2_X_BYTES_SILU : AMX_L2_X_BYTES;
    long blocks = (M + AMX_XB - 1) / AMX_XB, group = bytes / (AMX_XB * K * 2);
    return group < 1 ? 1 : group > blocks ? blocks : group;
}

/* k per chunk of amx_blocked: a chunk of a panel stays in L1 across a group of blocks while
 * x's tiles stream past it. x's tiles are loaded with tileloaddt1 (the non-temporal hint) so
 * that they do not push the panel's chunk out of L1, which lets the chunk be 32 KiB and the C
 * tiles' round trips half as many: the 246M model's linears at 1,024 rows, medians of 15 in
 * one process (ms, chunks of 256 and plain loads -> chunks of 512 and tileloaddt1): w13 + silu
 * 5.32 -> 4.76 and 5.40 -> 4.77, wqkv 1.63 -> 1.49, wo + res 1.35 -> 1.25, a layer's four
 * 11.5 -> 10.8 (session 34). Chunks of 512 with plain loads lost 15-25% (sessions 33-34),
 * tileloaddt1 with chunks of 256 gained 0-2%. w2 (K 2,816: x groups of 5 blocks) keeps chunks
 * of 256: 3.22 -> 3.30 ms with 512. The sums reloaded between chunks take the hint too: a
 * layer's four 9.75 -> 9.59 and 9.82 -> 9.56 ms, w2 + res 2.97 -> 2.83 and 3.06 -> 2.87. */
static long amx_kc(long K) {
    long kc = K <= AMX_KC_WIDE_K ? AMX_KC_WIDE : AMX_KC;
    return K < kc ? K : kc;
}

/* Floats of the buffer amx_blocked uses per thread: the group's sums between k-chunks (where
 * K is chunked), and with silu two turns of the group's gate and up sums (struct
 * amx_pending). */
static long amx_thread_floats(long M, long K, int silu) {
    long g = amx_group(M, K, silu) * AMX_XB * P;
    return (amx_kc(K) < K ? g : 0) + (silu ? 4 * g : 0);
}

/* Finished sums waiting for their store into y, `per` rows at each k-step of later work: with
 * silu, a pair of panels' over the group during the next pair's k-steps (amx_blocked: silu's
 * exp and division need more k-steps than a block has); with a residual, a tile's during the
 * next tile's (amx_panels_first). So the vector work runs while the tiles compute instead of
 * between their products. The 246M model's linears at 1,024 rows, 2 threads, medians of 15 in
 * one process (ms, stored after each block -> while later k-steps compute; both then in
 * amx_blocked): w13 with silu and the folded norm 6.90 -> 5.93 (plain w13, no silu, 6.22 ms),
 * wo + residual 1.51 -> 1.35, w2 + residual 3.53 -> 3.25; a layer's four 13.8 -> 12.3
 * (session 34). A plain store waits for the next block's k-steps only where K is chunked
 * (amx_blocked): wqkv + norm 1.42 / 1.49 -> 1.38 / 1.33 ms (session 35); with K unchunked,
 * as in the embedded model's head at 150 rows (N 32,000, K 256), deferred it measured 10-15%
 * slower (session 34). */
struct amx_pending {
    const float *c, *gate; /* sums [rows][P]; with gate, y = silu(gate) * c (the same layout) */
    const uint16_t *res;   /* else with res y = res + c (ldres apart), else y = c */
    uint16_t *y;
    long ldy, ldres;
    int rows, done, per;
    long nvalid; /* neither gate nor res: y = c, its first nvalid columns */
};

/* Store the pending rows [done, upto). */
static inline void amx_pending_rows(struct amx_pending *pd, int upto) {
    int end = upto < pd->rows ? upto : pd->rows, m0 = pd->done;
    if (m0 >= end) return;
    const float *c = pd->c + m0 * P;
    uint16_t *y = pd->y + m0 * pd->ldy;
    if (pd->gate)
        amx_store_silu(pd->gate + m0 * P, c, P, end - m0, y, pd->ldy);
    else if (pd->res)
        amx_store_add(c, P, end - m0, pd->res + m0 * pd->ldres, pd->ldres, y, pd->ldy);
    else
        amx_store(c, P, end - m0, y, pd->ldy, pd->nvalid);
    pd->done = end;
}

/* One block's 2 x 2 C tiles over k in [k0, k1): from zero at k0 == 0, else from the sums in a;
 * the weight panel's k-steps at wk, x's at xk (amx_x_block's strides). The streamed operand
 * is loaded with tileloaddt1 (the non-temporal hint): with w_nt the weights'
 * (amx_panels_first), with x_nt x's (amx_blocked where K is chunked; unchunked, as in the
 * embedded model's head at K 256, the hint cost 3-4%). Each k-step stores `per` pending rows
 * and prefetches the next panel (*pf up to pf_end, pf_per lines a step). */
static inline __attribute__((always_inline)) void
amx_block_chunk(const uint16_t *xk, long xld, long xstep, long xhalf, const uint16_t *wk, long k0,
                long k1, const float *a, struct amx_pending *pd, const char **pf,
                const char *pf_end, long pf_per, const int w_nt, int x_nt) {
    if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_stream_loadd(0, a, P * 4); /* the sums too: read once a chunk */
        _tile_stream_loadd(1, a + 16, P * 4);
        _tile_stream_loadd(2, a + AMX_M * P, P * 4);
        _tile_stream_loadd(3, a + AMX_M * P + 16, P * 4);
    }
    for (long k = k0; k < k1; k += AMX_K, xk += xstep, wk += AMX_K * P) {
        for (long i = 0; i < pf_per && *pf < pf_end; i++, *pf += 64) __builtin_prefetch(*pf, 0, 2);
        if (w_nt) {
            _tile_stream_loadd(6, wk, 2 * P * 2);
            _tile_stream_loadd(7, wk + P, 2 * P * 2);
        } else {
            _tile_loadd(6, wk, 2 * P * 2);
            _tile_loadd(7, wk + P, 2 * P * 2);
        }
        if (x_nt) {
            _tile_stream_loadd(4, xk, xld);
            _tile_stream_loadd(5, xk + xhalf, xld);
        } else {
            _tile_loadd(4, xk, xld);
            _tile_loadd(5, xk + xhalf, xld);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (pd->done < pd->rows) amx_pending_rows(pd, pd->done + pd->per);
    }
}

static inline void amx_store_tiles(float *dst) {
    _tile_stored(0, dst, P * 4);
    _tile_stored(1, dst + 16, P * 4);
    _tile_stored(2, dst + AMX_M * P, P * 4);
    _tile_stored(3, dst + AMX_M * P + 16, P * 4);
}

#ifndef AMX_ROWS_SPLIT
#define AMX_ROWS_SPLIT 4 /* blocks of x a thread at least, to split the rows (amx_share_of) */
#endif

/* A thread's share of amx_blocked's work: panels [b, e) against x's blocks [bb, be). */
struct amx_share {
    long b, e, bb, be;
    int rows; /* split by rows: every panel, the thread's own blocks */
};

/* Inside a parallel region: the calling thread's share of M rows x `panels` panels. With
 * split_rows, where each thread has AMX_ROWS_SPLIT blocks or more, its own blocks of rows
 * against every panel, so that it copies (and RMSNorms) only the rows it multiplies, in its
 * own core's caches and with no barrier; else its own panels against every block. Split by
 * rows where a norm is folded into the copy (tg_bf16_linear_fused): the 246M model's linears at
 * 1,024 rows, medians of 15 in one process, wqkv 1.73 -> 1.57 and 1.71 -> 1.56 ms, w13 with
 * silu 5.59 -> 5.44 and 5.48 -> 5.42; not for the others: w2 + residual 3.25 -> 3.36 and
 * 3.28 -> 3.49 ms (it reads x in place by panels), plain w13 within noise (session 34). */
static struct amx_share amx_share_of(long M, long panels, int split_rows) {
    long blocks = (M + AMX_XB - 1) / AMX_XB;
    split_rows = split_rows && blocks >= (long)AMX_ROWS_SPLIT * thread_count();
    struct amx_share sh = {0, panels, 0, blocks, split_rows};
    if (sh.rows)
        my_panels(blocks, &sh.bb, &sh.be);
    else
        my_panels(panels, &sh.b, &sh.e);
    return sh;
}

/* Above 32 rows: x's blocks of 32 rows (struct amx_x: copied, each k-step's two A tiles side
 * by side, [blocks][K/32][32 rows][32], one 2 KB stream per block as the panel is one for B;
 * or in place); each panel against a group of blocks that fits in L2 while the panel stays in
 * L1/L2, k in chunks (amx_kc) with the group's sums waiting in the buffer between chunks.
 * y = the rounded sums, stored during the next block's k-steps where K is chunked (else
 * right after the block); with silu (buf, amx_thread_floats
 * floats, required), wp holds 2N columns, gate panels then up panels, and output panel q is
 * silu(gate q) * up q, the group's gate and up sums waiting in buf for their store during the
 * next pair (struct amx_pending). Without silu the buffer is its own, and without memory for
 * it K is not chunked. */
static void amx_blocked(const struct amx_x *xs, const uint16_t *wp, uint16_t *y, long ldy,
                        long M, long N, long K, const struct amx_share *sh, int silu,
                        float *buf) {
    long b = sh->b, e = sh->e;
    long kp_n = K / 2, pstride = kp_n * 2 * P;
    long group = amx_group(M, K, silu), gf = group * AMX_XB * P, kc = amx_kc(K);
    long need = amx_thread_floats(M, K, silu);
    float *own = NULL;
    if (!buf && need && g_amx_buffers) buf = own = aligned_alloc(64, (size_t)need * 4);
    if (!buf) kc = K;
    float *acc = kc < K ? buf : NULL;
    float *pairs = silu ? buf + (acc ? gf : 0) : NULL; /* [2 turns][gate, up][group's sums] */
    float c[AMX_XB * P] __attribute__((aligned(64))); /* a block's sums (no silu) */
    struct amx_pending pd = {.rows = 0, .done = 0};
    long turn = 0; /* with silu: pairs stored so far */
    amx_configure(AMX_M);
    /* weight panel of step q: q itself, or with silu gate 0, up 0, gate 1, up 1, ... */
    long passes = silu ? 2 : 1, half = (N + P - 1) / P;
#define WEIGHT_PANEL(q) (passes == 2 ? (q) / 2 + ((q) % 2) * half : (q))
    for (long g0 = sh->bb; g0 < sh->be; g0 += group) {
        long g1 = g0 + group < sh->be ? g0 + group : sh->be;
        for (long q = b * passes; q < e * passes; q++) {
            const uint16_t *w = wp + WEIGHT_PANEL(q) * pstride;
            long n0 = q / passes * P, nvalid = N - n0 < P ? N - n0 : P;
            float *fin = silu ? pairs + ((turn % 2) * 2 + q % 2) * gf : NULL;
            /* the next panel into L2 while this one computes, spread over its k-steps: a
             * panel's first pass would otherwise wait on memory at every line */
            const char *pf = (const char *)(wp + WEIGHT_PANEL(q + 1) * pstride);
            const char *pf_end = pf + (q + 1 < e * passes ? pstride * 2 : 0);
            long steps = (g1 - g0) * (K / AMX_K), pf_per = (pstride * 2 / 64 + steps - 1) / steps;
            for (long k0 = 0; k0 < K; k0 += kc) {
                long k1 = k0 + kc < K ? k0 + kc : K;
                for (long blk = g0; blk < g1; blk++) {
                    long xld, xstep, xhalf, m0 = blk * AMX_XB;
                    const uint16_t *xk = amx_x_block(xs, blk, K, &xld, &xstep, &xhalf);
                    float *a = acc ? acc + (blk - g0) * AMX_XB * P : NULL;
                    amx_block_chunk(xk + k0 / AMX_K * xstep, xld, xstep, xhalf, w + k0 * P, k0,
                                    k1, a, &pd, &pf, pf_end, pf_per, 0, kc < K);
                    if (k1 < K) {
                        amx_store_tiles(a);
                    } else if (silu) {
                        amx_store_tiles(fin + (blk - g0) * AMX_XB * P);
                    } else { /* stored during the next block's k-steps where K is chunked */
                        amx_pending_rows(&pd, INT32_MAX);
                        amx_store_tiles(c);
                        pd = (struct amx_pending){c, NULL, NULL, y + m0 * ldy + n0, ldy, 0,
                                                  (int)(M - m0 < AMX_XB ? M - m0 : AMX_XB), 0,
                                                  (int)((AMX_XB * AMX_K + kc - 1) / kc), nvalid};
                        if (kc == K) amx_pending_rows(&pd, INT32_MAX); /* unchunked: now */
                    }
                }
            }
            if (silu && q % 2) { /* a pair done: stored during the next pair's k-steps */
                amx_pending_rows(&pd, INT32_MAX);
                long rows = (M < g1 * AMX_XB ? M : g1 * AMX_XB) - g0 * AMX_XB;
                pd = (struct amx_pending){fin, fin - gf, NULL, y + g0 * AMX_XB * ldy + n0, ldy, 0,
                                          (int)rows, 0,
                                          (int)((rows + 2 * steps - 1) / (2 * steps)), P};
                turn++;
            }
        }
    }
#undef WEIGHT_PANEL
    amx_pending_rows(&pd, INT32_MAX);
    _tile_release();
    free(own);
}

#ifndef AMX_L2_W_BYTES
#define AMX_L2_W_BYTES (1024 * 1024)
#endif

/* The loops of amx_blocked the other way round, for the linears with a residual res (wo, w2;
 * ldres apart, whole panels): a
 * group of the thread's panels (as many as fit in AMX_L2_W_BYTES) stays in L2 while x's
 * blocks stream past once per group, each block's k-chunk of 512 kept in L1 across the
 * group's panels (the weights loaded with tileloaddt1, the sums between chunks waiting in a
 * buffer a panel of the group); the residual store runs during the next tile's k-steps. The
 * 246M model's linears at 1,024 rows with 16 copies of the weights (so that they stream from
 * memory as in the model), medians of 12 in one process: wo + res 1.30 -> 1.06 and 1.38 ->
 * 1.03 ms, w2 + res 3.36 -> 3.00 and 3.31 -> 3.04; wqkv (norm folded, split by rows) went
 * 1.52 -> 1.66 this way and keeps amx_blocked, as w13 with silu does (session 34; a /tmp copy
 * of amx_probe.c with this loop order had measured 1.11x on w13's shape, 1.24x on wo's and
 * 1.04-1.07x on w2's). Without memory for the buffer, K is not chunked. */
static void amx_panels_first(const struct amx_x *xs, const uint16_t *wp, uint16_t *y, long ldy,
                             long M, long K, const struct amx_share *sh,
                             const uint16_t *res, long ldres) {
    long pstride = K * P, pg = AMX_L2_W_BYTES / (pstride * 2);
    long kc = K < AMX_KC_WIDE ? K : AMX_KC_WIDE;
    if (pg < 1) pg = 1;
    if (pg > sh->e - sh->b) pg = sh->e - sh->b;
    float *acc = kc < K && g_amx_buffers ? aligned_alloc(64, (size_t)pg * AMX_XB * P * 4) : NULL;
    if (!acc) kc = K;
    float bsums[AMX_XB * P] __attribute__((aligned(64)));
    struct amx_pending pd = {.rows = 0, .done = 0};
    const char *pf = NULL;
    amx_configure(AMX_M);
    for (long p0 = sh->b; p0 < sh->e; p0 += pg) {
        long p1 = p0 + pg < sh->e ? p0 + pg : sh->e;
        for (long blk = sh->bb; blk < sh->be; blk++) {
            long xld, xstep, xhalf, m0 = blk * AMX_XB;
            const uint16_t *x0 = amx_x_block(xs, blk, K, &xld, &xstep, &xhalf);
            for (long k0 = 0; k0 < K; k0 += kc) {
                long k1 = k0 + kc < K ? k0 + kc : K;
                for (long p = p0; p < p1; p++) {
                    float *a = acc ? acc + (p - p0) * AMX_XB * P : NULL;
                    amx_block_chunk(x0 + k0 / AMX_K * xstep, xld, xstep, xhalf,
                                    wp + p * pstride + k0 * P, k0, k1, a, &pd, &pf, NULL, 0, 1,
                                    0);
                    if (k1 < K) {
                        amx_store_tiles(a);
                        continue;
                    }
                    long n0 = p * P; /* stored during the next tile's k-steps */
                    amx_pending_rows(&pd, AMX_XB);
                    amx_store_tiles(bsums);
                    pd = (struct amx_pending){bsums, NULL, res + m0 * ldres + n0, y + m0 * ldy + n0,
                                              ldy, ldres, (int)(M - m0 < AMX_XB ? M - m0 : AMX_XB),
                                              0, (int)((AMX_XB * AMX_K + kc - 1) / kc), P};
                }
            }
        }
    }
    amx_pending_rows(&pd, INT32_MAX);
    _tile_release();
    free(acc);
}

static int amx_applies(long K, long ldx) { return g_amx && K % AMX_K == 0 && ldx >= K; }

/* Padded row m of x (M rows) into its place in xb's zero-padded blocks of 32 rows
 * (amx_copy_bytes): with norm_w, RMSNorm(x row) * norm_w on the way, as rows.c's rms_row_bf16
 * writes it (the same bits as the norm's own pass, which then never goes to memory). */
static void amx_copy_row(const uint16_t *x, long ldx, long M, long K, uint16_t *xb,
                         const uint16_t *norm_w, float eps, long m) {
    uint16_t *dst = xb + (m / AMX_XB) * AMX_XB * K + (m % AMX_XB) * AMX_K;
    const uint16_t *xr = x + m * ldx;
    float r = m < M && norm_w ? rms_scale_bf16(xr, K, eps) : 0.0f;
    for (long k = 0; k < K; k += AMX_K, dst += AMX_XB * AMX_K) {
        if (m >= M)
            memset(dst, 0, AMX_K * 2);
        else if (norm_w)
            rms_apply_bf16(xr + k, norm_w + k, r, dst, AMX_K);
        else
            memcpy(dst, xr + k, AMX_K * 2);
    }
}

/* x's blocks [bb, be) (of M rows) into xb: inside a parallel region split over its threads
 * (returning after the barrier: copied before any panel runs) or, with mine, by the calling
 * thread alone. */
static void amx_copy_blocks(const uint16_t *x, long ldx, long M, long K, uint16_t *xb,
                            const uint16_t *norm_w, float eps, long bb, long be, int mine) {
    long lo = bb * AMX_XB, hi = be * AMX_XB;
    if (mine) {
        for (long m = lo; m < hi; m++) amx_copy_row(x, ldx, M, K, xb, norm_w, eps, m);
        return;
    }
#pragma omp for schedule(static)
    for (long m = lo; m < hi; m++) amx_copy_row(x, ldx, M, K, xb, norm_w, eps, m);
}

/* Inside a parallel region, every thread: x for its share of amx_blocked, in place where a
 * thread runs at most AMX_INPLACE_PANELS of the `loads` panels (with silu twice the output
 * panels; the same answer in every thread, as the copy's barrier needs) and no norm is folded
 * into the copy, else copied into xb (amx_copy_bytes); in place, only a partial last block is
 * copied (into xb's first block). Returns when the blocks the thread reads are there (split
 * by panels: after the copy's barrier). */
static struct amx_x amx_x_of(const uint16_t *x, long ldx, long M, long K, uint16_t *xb,
                             const struct amx_share *sh, long loads, const uint16_t *norm_w,
                             float eps) {
    struct amx_x xs = {xb, NULL, ldx, 0};
    long per_thread = sh->rows ? loads : (loads + thread_count() - 1) / thread_count();
    if (norm_w || per_thread > AMX_INPLACE_PANELS) {
        amx_copy_blocks(x, ldx, M, K, xb, norm_w, eps, sh->bb, sh->be, sh->rows);
        return xs;
    }
    xs.rows = x, xs.full = M / AMX_XB;
    if (sh->be > xs.full) /* the partial last block: the thread that has it, or all of them */
        amx_copy_blocks(x + xs.full * AMX_XB * ldx, ldx, M - xs.full * AMX_XB, K, xb, NULL,
                        0.0f, 0, 1, sh->rows);
    return xs;
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
    struct amx_share sh = amx_share_of(M, panels, 0);
    struct amx_x xs = amx_x_of(x, ldx, M, K, (uint16_t *)xt, &sh, panels, NULL, 0.0f);
    if (sh.b < sh.e && sh.bb < sh.be) amx_blocked(&xs, wp, y, ldy, M, N, K, &sh, 0, NULL);
}
