/* tl_prefill.h - the attention of a prompt as blocked matrix products: a tile
   of queries (a few tokens x the query heads of one KV head) against tiles of
   keys, an online softmax (a running maximum and sum per query, the partial
   output rescaled as the maximum grows), the causal mask and a sliding window
   applied by tiles (tiles wholly outside them skipped). AVX2 + FMA kernels
   chosen at run time, portable C otherwise.

   The same function as tl_attend_causal, computed in another order: results
   agree to rounding, not to the bit. tl_state.exact_prefill selects
   tl_attend_causal instead (the decode path's arithmetic, to the bit).

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_PREFILL_H
#define TL_PREFILL_H

/* Floats of scratch one tl_attend_prefill call needs (per thread). */
size_t tl_attend_prefill_work(const tl_config *c);

/* The causal attention of n query tokens at positions pos0 .. pos0+n-1 (q: n rows of
   n_heads * head_size, after RoPE) over the key and value rows 0 .. pos0+n-1 of each KV
   head g (row i at k[g] + i * stride, v[g] + i * stride); with window > 0 a token at p
   sees positions p-window+1 .. p only. Outputs to out (n rows of n_heads * head_size).
   work: tl_attend_prefill_work(c) floats. */
void tl_attend_prefill(const tl_config *c, int pos0, int n, const float *q,
                       const float *const *k, const float *const *v, size_t stride, int window,
                       float *work, float *out);

/* A layer's keys and values packed once as the tiles' kernels read them, for positions
   0 .. positions-1 in tiles of 128: the query tiles of every chunk and thread then read
   them instead of packing each key tile they meet again (tl_attend_prompt's tiles). */
typedef struct tl_prefill_tiles {
    float *kt, *vt; /* per KV head g, tile t: kt + (g * tiles + t) * head_size * 128, and vt
                       + (g * tiles + t) * head_size (rounded up to 16) * 128 floats    */
    int tiles;      /* tiles per KV head                                               */
} tl_prefill_tiles;
/* Allocates (zeroed) tiles for positions 0 .. positions-1; -1 when out of memory. */
int tl_prefill_tiles_init(tl_prefill_tiles *t, const tl_config *c, int positions);
void tl_prefill_tiles_free(tl_prefill_tiles *t);
/* Packs the rows of positions from .. to-1 (row p of KV head g at k[g] + p * stride). */
void tl_prefill_pack(const tl_config *c, const float *const *k, const float *const *v, size_t stride, int from,
                     int to, tl_prefill_tiles *t);

#endif /* TL_PREFILL_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_PREFILL_IMPLEMENTED)
#define TL_PREFILL_IMPLEMENTED

#define TL__PF_ROWS 192  /* query rows (tokens x heads of a group) per tile, about, */
#define TL__PF_ROW_FLOATS 24576 /* and at most this many floats of queries (L2 holds a tile) */
#define TL__PF_TK 128    /* keys per tile */

/* tokens per query tile: about TL__PF_ROWS rows, at least one token */
static int tl__pf_tokens(const tl_config *c)
{
    int group = c->n_heads / c->n_kv_heads, rows = TL__PF_ROWS;
    if (rows * c->head_size > TL__PF_ROW_FLOATS)
        rows = TL__PF_ROW_FLOATS / c->head_size;
    return group >= rows ? 1 : rows / group;
}

/* floats of one tile of values packed in blocks of 16 columns */
static size_t tl__pf_vt_floats(int hs) { return (size_t)(hs + 15) / 16 * 16 * TL__PF_TK; }

size_t tl_attend_prefill_work(const tl_config *c)
{
    size_t rows = (size_t)tl__pf_tokens(c) * (size_t)(c->n_heads / c->n_kv_heads), hs = (size_t)c->head_size;
    /* the queries and the output of a tile, its scores, the keys transposed and the values
       packed (columns in blocks of 16), max and sum */
    return 2 * rows * hs + rows * TL__PF_TK + hs * TL__PF_TK + tl__pf_vt_floats(c->head_size) + 2 * rows;
}

/* ----------------------------------------------------------------------------
   The tile's products, with the keys and values packed in blocks of 16 columns (so a
   kernel's loads are contiguous): kt holds key j's element d at TL__PF_KT(hs, d, j), vt
   value j's element d at TL__PF_VT(d, j).
   s (rows x TL__PF_TK) = qt (rows x hs) kt, the columns 0 .. ncol-1 (a multiple of 8);
   o (rows x hs) += p (rows x TL__PF_TK) [values 0 .. nk-1] */
#define TL__PF_KT(hs, d, j) (((size_t)((j) / 16) * (size_t)(hs) + (size_t)(d)) * 16 + (size_t)((j) % 16))
#define TL__PF_VT(d, j) (((size_t)((d) / 16) * TL__PF_TK + (size_t)(j)) * 16 + (size_t)((d) % 16))

static void tl__pf_scores_c(const float *qt, const float *kt, int rows, int hs, int ncol, float *s)
{
    int r, d, j;
    for (r = 0; r < rows; r++) {
        float *sr = s + (size_t)r * TL__PF_TK;
        const float *qr = qt + (size_t)r * (size_t)hs;
        for (j = 0; j < ncol; j++)
            sr[j] = 0;
        for (d = 0; d < hs; d++) {
            float a = qr[d];
            for (j = 0; j < ncol; j++)
                sr[j] += a * kt[TL__PF_KT(hs, d, j)];
        }
    }
}

static void tl__pf_values_c(const float *p, const float *vt, int nk, int rows, int hs, float *o)
{
    int r, j, d;
    for (r = 0; r < rows; r++) {
        float *or_ = o + (size_t)r * (size_t)hs;
        const float *pr = p + (size_t)r * TL__PF_TK;
        for (j = 0; j < nk; j++) {
            float a = pr[j];
            if (a == 0)
                continue;
            for (d = 0; d < hs; d++)
                or_[d] += a * vt[TL__PF_VT(d, j)];
        }
    }
}

/* p[i] = 2^(s[i] - mx) for i in [a, b), 0 elsewhere in [0, ncol); returns their sum (the
   scores are in base 2: the queries carry log2(e)) */
static float tl__pf_exp_c(float *s, int a, int b, int ncol, float mx)
{
    float sum = 0;
    int j;
    for (j = 0; j < ncol; j++) {
        float e = j >= a && j < b ? exp2f(s[j] - mx) : 0.0f;
        s[j] = e;
        sum += e;
    }
    return sum;
}

#ifdef TL__X86
/* the kernels by register blocks of 6 rows x 16 columns (tl__fma_6x16, tl_kernels.h) */
TL__FMA static void tl__pf_scores_avx2(const float *qt, const float *kt, int rows, int hs, int ncol, float *s)
{
    const float *b = kt;
    size_t as = (size_t)hs, bs = 16 * (size_t)hs, os = TL__PF_TK;
    int n = hs, r, c;
    for (r = 0; r < rows; r += 6) {
        const float *a = qt + (size_t)r * as;
        float *o = s + (size_t)r * os;
        TL__FMA_ROWS(rows - r < 6 ? rows - r : 6, 0);
    }
}

/* by blocks of 16 columns, then of 6 rows: a block of values stays in L1 across the rows */
TL__FMA static void tl__pf_values_avx2(const float *p, const float *vt, int nk, int rows, int hs, float *o)
{
    size_t as = TL__PF_TK, os = (size_t)hs;
    int r, c;
    for (c = 0; c < hs; c += 16) {
        const float *b = vt + (size_t)(c / 16) * TL__PF_TK * 16;
        int nv = c + 16 <= hs ? 2 : 1;
        for (r = 0; r < rows; r += 6) {
            int mr = rows - r < 6 ? rows - r : 6;
            const float *a = p + (size_t)r * as;
            float *or_ = o + (size_t)r * os + c;
#define TL__PF_VALUES(mr)                                  \
    if (nv == 2)                                           \
        tl__fma_6x16(a, as, b, nk, mr, 2, 1, or_, os);     \
    else                                                   \
        tl__fma_6x16(a, as, b, nk, mr, 1, 1, or_, os)
            switch (mr) {
            case 6: TL__PF_VALUES(6); break;
            case 5: TL__PF_VALUES(5); break;
            case 4: TL__PF_VALUES(4); break;
            case 3: TL__PF_VALUES(3); break;
            case 2: TL__PF_VALUES(2); break;
            default: TL__PF_VALUES(1); break;
            }
#undef TL__PF_VALUES
        }
    }
}

/* 2^x for x <= 0 (0 below -126): 2^round(x) times a polynomial of the rest (in
   [-0.5, 0.5]; Cephes' exp2f coefficients, about 1 ulp), fewer operations than
   tl__exp8's e^x */
TL__FMA static inline __m256 tl__pf_exp2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-126.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), fx, y;
    x = _mm256_max_ps(x, lo);
    fx = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, fx);
    y = _mm256_set1_ps(1.535336188319500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.339887440266574e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(9.618437357674640e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.550332471162809e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(2.402264791363012e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(6.931472028550421e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.0f));
    return tl__ldexp8(y, fx, under);
}

/* the SIMD tl__pf_exp_c; pos: the position of column 0 */
TL__FMA static float tl__pf_exp_avx2(float *s, int a, int b, int ncol, float mx, int pos)
{
    __m256 m = _mm256_set1_ps(mx);
    __m256i lo = _mm256_set1_epi32(a - 1), hi = _mm256_set1_epi32(b);
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float sum = 0;
    int j = 0;
    if (a == 0)   /* columns below b need no mask (most rows: the whole tile) */
        for (; j + 8 <= b; j += 8)
            _mm256_storeu_ps(s + j, tl__pf_exp2(_mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m),
                                                              _mm256_setzero_ps())));
    for (; j < ncol; j += 8) {
        __m256i jj = _mm256_add_epi32(idx, _mm256_set1_epi32(j));
        __m256 in = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(jj, lo), _mm256_cmpgt_epi32(hi, jj)));
        _mm256_storeu_ps(s + j, _mm256_and_ps(in, tl__pf_exp2(_mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m),
                                                                                _mm256_setzero_ps()))));
    }
    /* summed in four lanes by position mod 4, each in the order of positions, so that the
       sum does not depend on where the tile starts (a window's first tile starts where
       its rows do) */
    {
        float lane[4] = { 0, 0, 0, 0 };
        __m128 v = _mm_setzero_ps();
        for (j = a; j < b && (pos + j) % 4 != 0; j++)
            lane[(pos + j) % 4] += s[j];
        v = _mm_loadu_ps(lane);
        for (; j + 4 <= b; j += 4)
            v = _mm_add_ps(v, _mm_loadu_ps(s + j));
        _mm_storeu_ps(lane, v);
        for (; j < b; j++)
            lane[(pos + j) % 4] += s[j];
        sum = (lane[0] + lane[1]) + (lane[2] + lane[3]);
    }
    return sum;
}

/* the largest of s[a .. b-1] (b > a), or m if larger */
TL__FMA static float tl__pf_max_avx2(const float *s, int a, int b, float m)
{
    __m256 v = _mm256_set1_ps(m);
    __m128 h;
    int j = a;
    for (; j + 8 <= b; j += 8)
        v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    for (; j < b; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

/* o[0 .. n-1] *= a (n a multiple of 8) */
TL__FMA static void tl__pf_scale_avx2(float *o, int n, float a)
{
    __m256 v = _mm256_set1_ps(a);
    int d;
    for (d = 0; d < n; d += 8)
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), v));
}

#endif

/* ----------------------------------------------------------------------------
   One KV head, one tile of query tokens [t0, t1) */

typedef struct {
    const tl_config *c;
    int pos0, window, group, hs, simd, origin;
    float *qt, *o, *s, *kt, *vt, *mx, *sum;
    const tl_prefill_tiles *tiles; /* packed keys and values, or NULL: each tile packs */
} tl__pf_ctx;

int tl_prefill_tiles_init(tl_prefill_tiles *t, const tl_config *c, int positions)
{
    size_t n;
    t->tiles = (positions + TL__PF_TK - 1) / TL__PF_TK;
    n = (size_t)c->n_kv_heads * (size_t)t->tiles;
    t->kt = (float *)calloc(n * (size_t)c->head_size * TL__PF_TK, sizeof(float));
    t->vt = (float *)calloc(n * tl__pf_vt_floats(c->head_size), sizeof(float));
    if (!t->kt || !t->vt) {
        tl_prefill_tiles_free(t);
        return -1;
    }
    return 0;
}

void tl_prefill_tiles_free(tl_prefill_tiles *t)
{
    free(t->kt);
    free(t->vt);
    t->kt = t->vt = NULL;
    t->tiles = 0;
}

void tl_prefill_pack(const tl_config *c, const float *const *k, const float *const *v, size_t stride, int from,
                     int to, tl_prefill_tiles *t)
{
    int hs = c->head_size, g, p, d;
    size_t kts = (size_t)hs * TL__PF_TK, vts = tl__pf_vt_floats(hs);
    for (g = 0; g < c->n_kv_heads; g++)
        for (p = from; p < to; p++) {
            size_t tile = (size_t)g * (size_t)t->tiles + (size_t)(p / TL__PF_TK);
            float *kt = t->kt + tile * kts, *vt = t->vt + tile * vts;
            const float *kr = k[g] + (size_t)p * stride, *vr = v[g] + (size_t)p * stride;
            int j = p % TL__PF_TK;
            for (d = 0; d < hs; d++) {
                kt[TL__PF_KT(hs, d, j)] = kr[d];
                vt[TL__PF_VT(d, j)] = vr[d];
            }
        }
}

static void tl__pf_tile(const tl__pf_ctx *x, const float *q, const float *kg, const float *vg, size_t stride,
                        int h0, int t0, int t1, float *out)
{
    const tl_config *c = x->c;
    int group = x->group, hs = x->hs, rows = (t1 - t0) * group, r, d, j;
    int pmin = x->pos0 + t0, pmax = x->pos0 + t1 - 1, k0;
    int lo = x->window > 0 && pmin - x->window + 1 > 0 ? pmin - x->window + 1 : 0, k1;
    const float *kt, *vt;
    size_t qd = (size_t)c->n_heads * (size_t)hs;
    float scale = tl_attn_scale(c) * 1.44269504088896341f;   /* and log2(e): base-2 scores */

    for (r = 0; r < rows; r++) {   /* the tile's queries, scaled, row r = token r / group */
        const float *qr = q + (size_t)(t0 + r / group) * qd + (size_t)(h0 + r % group) * (size_t)hs;
        for (d = 0; d < hs; d++)
            x->qt[(size_t)r * (size_t)hs + d] = qr[d] * scale;
        x->mx[r] = -INFINITY;
        x->sum[r] = 0;
    }
    memset(x->o, 0, (size_t)rows * (size_t)hs * sizeof(float));

    /* key tiles at multiples of TL__PF_TK in positions origin + row: where a row's sums
       split depends on its position alone, not on the rows that share its tile */
    k0 = lo - (lo + x->origin) % TL__PF_TK;
    for (k0 = k0 < 0 ? 0 : k0; k0 <= pmax; k0 = k1) {
        int nk, ncol;
        k1 = k0 - (k0 + x->origin) % TL__PF_TK + TL__PF_TK;
        nk = (pmax + 1 < k1 ? pmax + 1 : k1) - k0;
        ncol = (nk + 7) / 8 * 8;
        if (x->tiles) {   /* packed once (columns past nk: zeros or later keys, masked) */
            size_t tile = (size_t)(h0 / group) * (size_t)x->tiles->tiles + (size_t)(k0 / TL__PF_TK);
            kt = x->tiles->kt + tile * (size_t)hs * TL__PF_TK;
            vt = x->tiles->vt + tile * tl__pf_vt_floats(hs);
        } else {
            kt = x->kt;
            vt = x->vt;
            j = 0;
#ifdef TL__X86
            if (x->simd)   /* the keys transposed, 8 at a time */
                for (; j + 8 <= nk; j += 8)
                    tl__transpose8_avx2(kg + (size_t)(k0 + j) * stride, stride, hs, x->kt, j);
#endif
            for (; j < nk; j++) {   /* the rest one by one (padding columns 0) */
                const float *kr = kg + (size_t)(k0 + j) * stride;
                for (d = 0; d < hs; d++)
                    x->kt[TL__PF_KT(hs, d, j)] = kr[d];
            }
            for (j = 0; j < nk; j++) {   /* the values in blocks of 16 columns */
                const float *vr = vg + (size_t)(k0 + j) * stride;
                for (d = 0; d + 16 <= hs; d += 16)
                    memcpy(x->vt + TL__PF_VT(d, j), vr + d, 16 * sizeof(float));
                for (; d < hs; d++)
                    x->vt[TL__PF_VT(d, j)] = vr[d];
            }
            for (; j < ncol; j++)
                for (d = 0; d < hs; d++)
                    x->kt[TL__PF_KT(hs, d, j)] = 0;
        }
#ifdef TL__X86
        if (x->simd)
            tl__pf_scores_avx2(x->qt, kt, rows, hs, ncol, x->s);
        else
#endif
            tl__pf_scores_c(x->qt, kt, rows, hs, ncol, x->s);
        for (r = 0; r < rows; r++) {   /* the online softmax, row by row */
            int p = x->pos0 + t0 + r / group;
            int a = x->window > 0 && p - x->window + 1 > k0 ? p - x->window + 1 - k0 : 0;
            int b = p + 1 - k0 < nk ? p + 1 - k0 : nk;   /* columns [a, b) are visible */
            float *sr = x->s + (size_t)r * TL__PF_TK, m = -INFINITY, mnew, alpha, add;
            if (b <= a) {
                memset(sr, 0, (size_t)ncol * sizeof(float));
                continue;
            }
#ifdef TL__X86
            if (x->simd)
                m = tl__pf_max_avx2(sr, a, b, m);
            else
#endif
                for (j = a; j < b; j++)
                    m = sr[j] > m ? sr[j] : m;
            mnew = m > x->mx[r] ? m : x->mx[r];
#ifdef TL__X86
            if (x->simd)
                add = tl__pf_exp_avx2(sr, a, b, ncol, mnew, x->origin + k0);
            else
#endif
                add = tl__pf_exp_c(sr, a, b, ncol, mnew);
            if (mnew > x->mx[r]) {
                float *orow = x->o + (size_t)r * (size_t)hs;
                alpha = x->mx[r] == -INFINITY ? 0.0f : exp2f(x->mx[r] - mnew);
#ifdef TL__X86
                if (x->simd)
                    tl__pf_scale_avx2(orow, hs, alpha);
                else
#endif
                    for (d = 0; d < hs; d++)
                        orow[d] *= alpha;
                x->sum[r] *= alpha;
                x->mx[r] = mnew;
            }
            x->sum[r] += add;
        }
#ifdef TL__X86
        if (x->simd)
            tl__pf_values_avx2(x->s, vt, nk, rows, hs, x->o);
        else
#endif
            tl__pf_values_c(x->s, vt, nk, rows, hs, x->o);
    }
    for (r = 0; r < rows; r++) {
        float *dst = out + (size_t)(t0 + r / group) * qd + (size_t)(h0 + r % group) * (size_t)hs;
        const float *orow = x->o + (size_t)r * (size_t)hs;
        float inv = x->sum[r] > 0 ? 1.0f / x->sum[r] : 0.0f;
        for (d = 0; d < hs; d++)
            dst[d] = orow[d] * inv;
    }
}

/* tl_attend_prefill with the SIMD kernels (where the CPU has them) or, simd 0, without;
   row 0 of k and v holds position origin (key tiles start at multiples of TL__PF_TK in
   positions, so a token's output is the same whichever rows are passed) */
static void tl__attend_prefill_ex(const tl_config *c, int pos0, int n, const float *q,
                                  const float *const *k, const float *const *v, size_t stride, int window,
                                  float *work, float *out, int simd, int origin, const tl_prefill_tiles *tiles)
{
    tl__pf_ctx x;
    int tq = tl__pf_tokens(c), g, t0;
    size_t rows;
    x.c = c;
    x.pos0 = pos0;
    x.window = window;
    x.origin = origin;
    x.tiles = origin == 0 ? tiles : NULL;   /* the tiles start at position 0 */
    x.group = c->n_heads / c->n_kv_heads;
    x.hs = c->head_size;
    rows = (size_t)tq * (size_t)x.group;
    x.simd = 0;
#ifdef TL__X86
    x.simd = simd && c->head_size % 8 == 0 && tl__have_fma();
#else
    (void)simd;
#endif
    x.qt = work;
    x.o = x.qt + rows * (size_t)x.hs;
    x.s = x.o + rows * (size_t)x.hs;
    x.kt = x.s + rows * TL__PF_TK;
    x.vt = x.kt + (size_t)x.hs * TL__PF_TK;
    x.mx = x.vt + tl__pf_vt_floats(x.hs);
    x.sum = x.mx + rows;
    for (g = 0; g < c->n_kv_heads; g++)
        for (t0 = 0; t0 < n; t0 += tq)
            tl__pf_tile(&x, q, k[g], v[g], stride, g * x.group, t0, t0 + tq < n ? t0 + tq : n, out);
}

void tl_attend_prefill(const tl_config *c, int pos0, int n, const float *q,
                       const float *const *k, const float *const *v, size_t stride, int window,
                       float *work, float *out)
{
    tl__attend_prefill_ex(c, pos0, n, q, k, v, stride, window, work, out, 1, 0, NULL);
}

#endif /* TL_PREFILL implementation */
