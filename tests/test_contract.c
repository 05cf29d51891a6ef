/* Contract tests: hostile sizes and values get a result code, never a crash; a call that
   fails leaves every observable of its objects as it was; allocation failure is injected
   at every allocation of a whole serving scenario, and each failed call, retried, ends
   where an undisturbed run ends. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"
#include "test_util.h"
#include "test_size.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

/* ----- helpers ----------------------------------------------------------------------- */

static uint64_t g_rng = 777; /* the random stream of tu_uniform and tu_uniform_rows */

/* A small cache: the base cache (tu_cache_desc) with up to 4,096 tokens, PQ of 4 bits,
   3 iterations, seed 5, and a block cache of 4 blocks of 16 tokens. */
static pqc_cache_desc small_desc(int layers, int hkv, int hq, int d)
{
    pqc_cache_desc cd = tu_cache_desc(layers, hkv, hq, d);
    cd.max_tokens = 4096;
    cd.pq.bits = 4;
    cd.pq.iters = 3;
    cd.pq.seed = 5;
    cd.block_tokens = 16;
    cd.cache_blocks = 4;
    return cd;
}

static pqc_result prefill(pqc_cache *c, int layer, const float *k, const float *v, size_t n)
{
    size_t cols = (size_t)c->d.n_kv_heads * (size_t)c->d.head_dim;
    pqc_matrix km = pqc_matrix_f32(k, n, cols), vm = pqc_matrix_f32(v, n, cols);
    return pqc_cache_prefill(c, layer, &km, &vm);
}

/* ----- the configuration pass ---------------------------------------------------------- */

/* pqc_cache_resolve fills every default with its named value, writes "none" as -1 (one
   rule: 0 = default, negative = none), resolves a resolved desc to itself, and gives each
   rule a message of its own that names its field; a cache reports the resolved
   configuration, its window once fixed. */
TEST resolved_configuration_names_its_defaults_and_each_rule(void)
{
    static const struct { const char *field; int what; } bad[] = {
        {"layers", 0}, {"multiple", 1}, {"kv dtype", 2}, {"max_tokens", 3}, {"window", 4}, {"budget_ratio", 5},
        {"recent_share", 6}, {"metric 5 unknown", 7}, {"metric_floor", 8}, {"split", 9}, {"gqa", 10}, {"rerank", 11},
        {"outliers", 12}, {"residual_weight", 13}, {"block_tokens", 14}, {"admit_blocks", 15}, {"policy", 16},
        {"rebuild_share", 17}, {"codes_resident", 18}, {"first_kv_head", 19}, {"block cache", 20},
        {"pq.metric", 21}, {"softmax_scale", 22}, {"rerank_max", 23}};
    pqc_cache_desc cd = small_desc(2, 2, 4, 16), r, sentinel, got;
    pqc_cache *c;
    float w = 1.0f;
    size_t i;
    char seen[sizeof bad / sizeof bad[0]][200];
    cd.max_tokens = 0;
    cd.cache_blocks = 0;
    cd.block_tokens = 0;
    cd.n_q_heads = 0;
    cd.n_kv_heads = 2;
    cd.n_sink = 0;
    cd.rerank = 0;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_DEFAULT_MAX_TOKENS, r.max_tokens);
    ASSERT_EQ(PQC_DEFAULT_N_SINK, r.n_sink);
    ASSERT_EQ(PQC_DEFAULT_RERANK, r.rerank);
    ASSERT_EQ(PQC_DEFAULT_BUDGET_RATIO, r.budget_ratio);
    ASSERT_EQ(PQC_DEFAULT_RECENT_SHARE, r.recent_share);
    ASSERT_EQ(PQC_DEFAULT_METRIC_FLOOR, r.metric_floor);
    ASSERT_EQ(PQC_DEFAULT_OBSERVE, r.observe);
    ASSERT_EQ(PQC_DEFAULT_BLOCK_TOKENS, r.block_tokens);
    ASSERT_EQ(PQC_DEFAULT_CACHE_BLOCKS, r.cache_blocks);
    ASSERT_EQ(PQC_DEFAULT_CACHE_BLOCKS, r.admit_blocks);
    ASSERT_EQ(PQC_DEFAULT_REBUILD_SHARE, r.rebuild_share);
    ASSERT_EQ(2, r.n_q_heads);
    ASSERT_EQ(0, r.window);  /* derived at the first prefill */
    ASSERT_EQ(2, r.pq.m);
    ASSERT_EQ(4, r.pq.bits);
    ASSERT_EQ(3, r.pq.iters);
    ASSERT_EQ(PQC_DEFAULT_MAX_POINTS_PER_CENTROID, r.pq.max_points_per_centroid);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &r, &got));
    ASSERT_EQ(0, memcmp(&got, &r, sizeof got));
    cd.pq.iters = 0; /* no scheduler: the PQ default */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_DEFAULT_ITERS, r.pq.iters);
    cd.n_sink = -1;
    cd.cache_blocks = -1;
    cd.observe = -1;
    cd.rebuild_share = -3;
    cd.rerank = -1;
    cd.outliers = -7;
    cd.pq.iters = -5;
    cd.pq.max_points_per_centroid = -2;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(-1, r.n_sink);
    ASSERT_EQ(-1, r.cache_blocks);
    ASSERT_EQ(-1, r.admit_blocks);
    ASSERT_EQ(-1, r.observe);
    ASSERT_EQ(-1, r.rebuild_share);
    ASSERT_EQ(-1, r.rerank); /* off, written as -1 so that it resolves to itself */
    ASSERT_EQ(0, r.outliers);
    ASSERT_EQ(-1, r.pq.iters);
    ASSERT_EQ(-1, r.pq.max_points_per_centroid);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &r, &got));
    ASSERT_EQ(0, memcmp(&got, &r, sizeof got));
    cd.rebuild_share = 1.5; /* a share that can never be reached is never too */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(-1, r.rebuild_share);
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pqc_cache_desc b = small_desc(2, 2, 4, 16);
        switch (bad[i].what) {
        case 0: b.n_layers = 0; break;
        case 1: b.n_q_heads = 5; break;
        case 2: b.kv_dtype = (pqc_dtype)99; break;
        case 3: b.max_tokens = (size_t)1 << 33; break;
        case 4: b.window = -2; break;
        case 5: b.budget_ratio = -1; break;
        case 6: b.recent_share = 2; break;
        case 7: b.metric = (pqc_metric)5; break;
        case 8: b.metric_floor = 1e-13; break;
        case 9: b.split = (pqc_split)7; break;
        case 10: b.gqa = (pqc_gqa)7; break;
        case 11: b.rerank = 0.5; break;
        case 12: b.outliers = (1 << 24) + 1; break;
        case 13: b.residual_weight = 1e-300; break;
        case 14: b.block_tokens = -5; break;
        case 15: b.admit_blocks = 99; break;
        case 16: b.policy = (pqc_policy)9; break;
        case 17: b.rebuild_share = nan(""); break;
        case 18: b.codes_resident = 2; break;
        case 19: b.first_kv_head = -1; break;
        case 20: b.block_tokens = 1 << 30; b.cache_blocks = 1 << 30; b.n_layers = 4096; break;
        case 22: b.softmax_scale = -0.125f; break;
        case 23: b.rerank_max = 2e6; break;
        default: b.pq.metric = &w; break;
        }
        memset(&sentinel, 0x5a, sizeof sentinel);
        got = sentinel;
        ASSERT(pqc_cache_resolve(NULL, &b, &got) != PQC_SUCCESS);
        ASSERT_EQ(0, memcmp(&got, &sentinel, sizeof got)); /* *out untouched */
        ASSERTm(pqc_last_error(), strstr(pqc_last_error(), bad[i].field) != NULL);
        snprintf(seen[i], sizeof seen[i], "%.190s", pqc_last_error());
        ASSERT(pqc_cache_create(NULL, &b, &c) != PQC_SUCCESS); /* create refuses it alike */
    }
    for (i = 1; i < sizeof bad / sizeof bad[0]; i++) /* one message per rule */
        ASSERT(strcmp(seen[i], seen[i - 1]) != 0);
    cd = small_desc(2, 2, 4, 16);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(c, &got));
    ASSERT_EQ(0, memcmp(&got, &r, sizeof got));
    {
        float *k = tu_uniform_rows(&g_rng, 300, 32), *v = tu_uniform_rows(&g_rng, 300, 32);
        ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 300));
        free(k);
        free(v);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(c, &got));
    ASSERT_EQ(pqc_cache_window(c), got.window);
    ASSERT(got.window > 0);
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_config(NULL, &got));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_resolve(NULL, NULL, &got));
    pqc_cache_destroy(c);
    PASS();
}

/* The default m follows the key's width: d_h/32 sub-spaces of 8 bits (codes of 1/64 of an
   fp16 key's bytes), 4 at the fewest; where that does not divide the dims (or the rotation
   pairs, where rope bands are asked for) the largest of 4, 2, 1 that does. Rope bands are
   the sub-spaces where m divides the pairs (d_h 36: m 4 over contiguous dims). */
TEST default_codes_follow_the_keys_width(void)
{
    static const struct { int d, rope, m; } want[] = {
        {64, 1, 4}, {128, 1, 4}, {256, 1, 8}, {512, 2, 16}, {96, 1, 4}, {80, 0, 4}, {192, 1, 6},
        {320, 1, 10}, {160, 1, 5}, {160, 0, 5}, {36, 1, 4}, {6, 0, 2}, {7, 0, 1}};
    size_t i;
    for (i = 0; i < sizeof want / sizeof want[0]; i++) {
        pqc_cache_desc cd = tu_cache_desc(1, 1, 2, want[i].d), r;
        cd.pq.m = 0;
        cd.pq.bits = 0;
        cd.pq.rope = (pqc_rope)want[i].rope;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
        ASSERT_EQm("m of the default", want[i].m, r.pq.m);
        ASSERT_EQ(8, r.pq.bits);
    }
    PASS();
}

/* ----- hostile sizes and values ------------------------------------------------------ */

TEST fetch_with_fewer_tokens_than_sinks_stays_in_bounds(void)
{
    int variant;
    for (variant = 0; variant < 3; variant++) {
        pqc_cache_desc cd = small_desc(1, 2, 2, 8);
        pqc_cache *c;
        pqc_selection sel;
        float *k = tu_uniform_rows(&g_rng, 40, 16), *v = tu_uniform_rows(&g_rng, 40, 16), q[16], *ko, *vo;
        const void *const *const *kr, *const *const *vr;
        pqc_kv_out out;
        size_t n = 10, h, i;
        if (variant == 0) cd.max_tokens = 20;      /* 32 sinks, capacity under it */
        if (variant == 1) cd.n_sink = 1000000;     /* huge sink count, short prompt */
        if (variant == 2) cd.n_sink = 12, n = 11;  /* just under the sinks */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, n));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        for (i = 0; i < 16; i++) q[i] = tu_uniform(&g_rng);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ko = (float *)malloc(2 * 40 * 8 * sizeof(float));
        vo = ko + 40 * 8;
        out.k = ko;
        out.v = vo;
        out.head_stride = 20;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
        for (h = 0; h < 2; h++) {
            ASSERT_EQ(n, sel.count[h]); /* all sinks */
            for (i = 0; i < n; i++) ASSERT_EQ(k[i * 16 + h * 8 + 3], ko[(h * 20 + i) * 8 + 3]);
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_rows(c, 0, &sel, &kr, &vr));
        ASSERT_EQ(v[5 * 16 + 8 + 1], ((const float *)vr[1][5])[1]);
        for (i = 0; i < 5; i++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k + (n + i) * 16, v + (n + i) * 16));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
        free(ko);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        free(k);
        free(v);
    }
    PASS();
}

TEST fetch_on_a_layer_without_prefill_is_refused(void)
{
    pqc_cache_desc cd = small_desc(2, 1, 1, 8);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_uniform_rows(&g_rng, 50, 8), *v = tu_uniform_rows(&g_rng, 50, 8), q[8] = { 1, 0, 0, 0, 0, 0, 0, 0 }, buf[2 * 64 * 8];
    pqc_kv_out out;
    const void *const *const *kr, *const *const *vr;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 50));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    out.k = buf;
    out.v = buf + 64 * 8;
    out.head_stride = 64;
    sel.count[0] = 0; /* an empty selection for the empty layer */
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_fetch(c, 1, &sel, &out));
    ASSERT(strstr(pqc_last_error(), "empty") != NULL);
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_fetch_rows(c, 1, &sel, &kr, &vr));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_select(c, 1, q, &sel));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(k);
    free(v);
    PASS();
}

TEST selection_count_beyond_capacity_is_refused(void)
{
    pqc_cache_desc cd = small_desc(1, 2, 2, 8);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_uniform_rows(&g_rng, 100, 16), *v = tu_uniform_rows(&g_rng, 100, 16), q[16] = { 0 }, buf[2 * 2 * 200 * 8];
    pqc_kv_out out;
    const void *const *const *kr, *const *const *vr;
    size_t cap;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 100));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    cap = sel.capacity;
    sel.count[1] = cap + 1;
    out.k = buf;
    out.v = buf + 2 * 200 * 8;
    out.head_stride = 200 + cap;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_fetch_rows(c, 0, &sel, &kr, &vr));
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_fetch(c, 0, &sel, &out));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(k);
    free(v);
    PASS();
}

TEST selection_is_sized_by_the_sequence_and_grows(void)
{
    pqc_cache_desc cd = small_desc(1, 2, 2, 8);
    pqc_cache *c;
    pqc_selection sel, hand;
    float *k = tu_uniform_rows(&g_rng, 2000, 16), *v = tu_uniform_rows(&g_rng, 2000, 16), q[16] = { 0 };
    uint32_t idx[2 * 64];
    size_t cnt[2];
    cd.max_tokens = (size_t)1 << 24;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT(sel.capacity < 4096); /* not max_tokens indices per head */
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 2000));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT(sel.capacity >= 2000 && sel.capacity < 8192);
    ASSERT(sel.count[0] > 32);
    /* a selection put together by hand never grows: too small is an error */
    memset(&hand, 0, sizeof hand);
    hand.n_kv_heads = 2;
    hand.capacity = 64;
    hand.count = cnt;
    hand.idx = idx;
    cnt[0] = cnt[1] = 7;
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_select(c, 0, q, &hand));
    ASSERT_EQ(7, cnt[0]);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(k);
    free(v);
    PASS();
}

TEST huge_code_capacity_is_refused(void)
{
    pqc_pq pq;
    pqc_codes codes;
    pqc_pq_desc d;
    float *k = tu_uniform_rows(&g_rng, 300, 8);
    pqc_matrix km = pqc_matrix_f32(k, 300, 8);
    int bits;
    memset(&d, 0, sizeof d);
    d.m = 2;
    d.bits = 4;
    d.iters = 2;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &km, &pq));
    for (bits = 1; bits <= 8; bits++) {
        pq.bits = bits;
        ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_codes_init(&codes, &pq, (size_t)-1, NULL));
        ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_codes_init(&codes, &pq, (size_t)-1 / 4, NULL));
    }
    pq.bits = 4;
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, 100, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &km, &codes));
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_codes_reserve(&codes, (size_t)-1 / 2));
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_codes_reserve(&codes, ((size_t)-1 / 4) * 3));
    ASSERT_EQ(300, codes.count); /* unchanged, and still usable */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &km, &codes));
    ASSERT_EQ(600, codes.count);
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    free(k);
    PASS();
}

TEST matrices_too_large_to_address_are_refused(void)
{
    float buf[64] = { 0 };
    pqc_matrix m = pqc_matrix_f32(buf, (size_t)-1 / 16, 8);
    pqc_pq_desc d;
    pqc_pq pq;
    pqc_cache_desc cd = small_desc(1, 1, 1, 8);
    pqc_cache *c;
    memset(&d, 0, sizeof d);
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_pq_train(NULL, &d, &m, &pq));
    m.rows = 4;
    m.row_stride = (size_t)-1 / 2; /* rows x stride overflows */
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_pq_train(NULL, &d, &m, &pq));
    m = pqc_matrix_f32(buf, (size_t)-1 / 128, 8);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_prefill(c, 0, &m, &m));
    ASSERT_EQ(0, pqc_cache_tokens(c, 0));
    m.rows = 8;
    m.cols = 0;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &m, &pq));
    pqc_cache_destroy(c);
    PASS();
}

TEST exact_search_refuses_keys_without_a_ranking(void)
{
    size_t i;
    float *k = tu_uniform_rows(&g_rng, 50, 8), q[8] = { 1, 0, 0, 0, 0, 0, 0, 0 }, all[50];
    pqc_matrix m = pqc_matrix_f32(k, 50, 8);
    pqc_search_desc sd;
    uint32_t idx[5];
    memset(&sd, 0, sizeof sd);
    sd.k = 5;
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &m, q, 1, &sd, NULL, idx, NULL));
    k[17 * 8 + 3] = HUGE_VAL;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_exact_search(NULL, &m, q, 1, &sd, NULL, idx, NULL));
    ASSERT(strstr(pqc_last_error(), "row 17") != NULL);
    k[17 * 8 + 3] = NAN;
    for (i = 0; i < 50; i++) all[i] = -7.0f;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_exact_scores(NULL, &m, q, 1, PQC_GQA_SUM, NULL, all));
    for (i = 0; i < 50; i++) ASSERT_EQ(-7.0f, all[i]); /* the output untouched */
    free(k);
    { /* past the first chunk of rows, a finite magnitude beyond the key limit, fp16 Inf,
         every query head's softmax */
        float *big = tu_uniform_rows(&g_rng, 200, 8), q2[16] = { 1, 0, 0, 0, 0, 0, 0, 0, 0, 1 };
        uint16_t *h16 = (uint16_t *)malloc(200 * 8 * sizeof(uint16_t));
        pqc_matrix mb = pqc_matrix_f32(big, 200, 8), mh;
        ASSERT(h16 != NULL);
        big[150 * 8 + 5] = 1e17f;
        ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_exact_search(NULL, &mb, q2, 2, &sd, NULL, idx, NULL));
        ASSERT(strstr(pqc_last_error(), "row 150") != NULL);
        big[150 * 8 + 5] = 0.5f;
        for (i = 0; i < 200 * 8; i++) h16[i] = pqc_f32_to_f16(big[i]);
        h16[99 * 8 + 1] = 0x7c00; /* +Inf */
        mh = mb;
        mh.data = h16;
        mh.dtype = PQC_F16;
        mh.row_stride = 8 * sizeof(uint16_t);
        ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_exact_search(NULL, &mh, q2, 2, &sd, NULL, idx, NULL));
        ASSERT(strstr(pqc_last_error(), "row 99") != NULL);
        h16[99 * 8 + 1] = pqc_f32_to_f16(0.25f);
        ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &mh, q2, 2, &sd, NULL, idx, NULL));
        free(big);
        free(h16);
    }
    PASS();
}

TEST prefill_with_k_and_v_of_different_dtypes(void)
{
    pqc_cache_desc cd = small_desc(1, 2, 2, 8);
    pqc_cache *c;
    float *k = tu_uniform_rows(&g_rng, 40, 16);
    uint16_t v16[40 * 16];
    pqc_matrix km = pqc_matrix_f32(k, 40, 16), vm;
    const void *kr, *vr;
    size_t n, i;
    pqc_dtype dt;
    for (i = 0; i < 40 * 16; i++) v16[i] = pqc_f32_to_f16((float)i / 64.0f);
    vm.data = v16;
    vm.dtype = PQC_F16;
    vm.rows = 40;
    vm.cols = 16;
    vm.row_stride = 0;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv(c, 0, 1, &kr, &vr, &n, &dt));
    ASSERT_EQ(40u, n);
    for (i = 0; i < 40; i++) { /* head 1's V row i: the fp16 values at [i][8..16) */
        ASSERT_EQ(pqc_f16_to_f32(v16[i * 16 + 8 + 5]), ((const float *)vr)[i * 8 + 5]);
        ASSERT_EQ(k[i * 16 + 8 + 5], ((const float *)kr)[i * 8 + 5]);
    }
    pqc_cache_destroy(c);
    free(k);
    PASS();
}

TEST block_cache_size_overflow_is_refused(void)
{
    pqc_cache_desc cd = small_desc(1, 1, 1, 65536);
    pqc_cache *c = NULL;
    cd.pq.m = 2;
    cd.block_tokens = 0x7fffffff;
    cd.cache_blocks = 0x7fffffff;
    cd.admit_blocks = 1;
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_create(NULL, &cd, &c));
    ASSERT(c == NULL);
    cd = small_desc(4096, 4096, 4096, 65536);
    cd.block_tokens = 1 << 20;
    cd.cache_blocks = 1 << 20;
    cd.admit_blocks = 1;
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_create(NULL, &cd, &c));
    PASS();
}

TEST values_beyond_the_storage_range_are_refused_before_storing(void)
{
    pqc_dtype st;
    for (st = PQC_F32; st <= PQC_BF16; st = (pqc_dtype)(st + 1)) {
        pqc_cache_desc cd = small_desc(1, 1, 1, 8);
        pqc_cache *c;
        pqc_selection sel;
        float *k = tu_uniform_rows(&g_rng, 200, 8), *v = tu_uniform_rows(&g_rng, 200, 8), q[8] = { 1, 1, 1, 1, 1, 1, 1, 1 };
        cd.kv_dtype = st;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
        k[150 * 8 + 2] = 70000.0f; /* finite in fp32, Inf in fp16 */
        if (st == PQC_F16) {
            ASSERT_EQ(PQC_ERROR_NON_FINITE, prefill(c, 0, k, v, 200));
            ASSERT_EQ(0, pqc_cache_tokens(c, 0));
            ASSERT(strstr(pqc_last_error(), "65504") != NULL);
            k[150 * 8 + 2] = 65504.0f; /* the largest fp16 value is fine */
        }
        ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 200));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        k[2] = -1e6f;
        ASSERT_EQ(st == PQC_F16 ? PQC_ERROR_NON_FINITE : PQC_SUCCESS, pqc_cache_append(c, 0, k, v));
        ASSERT_EQ(st == PQC_F16 ? 200u : 201u, pqc_cache_tokens(c, 0));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel)); /* the layer is not lost */
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        free(k);
        free(v);
    }
    PASS();
}

TEST huge_budget_gives_a_sane_window(void)
{
    pqc_cache_desc cd = small_desc(1, 1, 1, 8);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_uniform_rows(&g_rng, 300, 8), *v = tu_uniform_rows(&g_rng, 300, 8), q[8] = { 0 };
    cd.budget_tokens = (size_t)-1;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 300));
    ASSERT(pqc_cache_window(c) >= 1 && (size_t)pqc_cache_window(c) <= cd.max_tokens);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT_EQ(300, sel.count[0]); /* a budget beyond the sequence attends to everything */
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    cd.budget_tokens = 0;
    cd.budget_ratio = 1e6;
    cd.recent_share = 1;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 300));
    ASSERT_EQ((int)cd.max_tokens, pqc_cache_window(c));
    pqc_cache_destroy(c);
    free(k);
    free(v);
    PASS();
}

/* ----- scheduler ------------------------------------------------------------------- */

static int fit_equal(pqc_scheduler_fit a, pqc_scheduler_fit b) { return memcmp(&a, &b, sizeof a) == 0; }

TEST scheduler_refuses_samples_that_would_break_the_fit(void)
{
    pqc_scheduler *s;
    pqc_scheduler_fit before;
    double bad[7];
    size_t i;
    int t0;
    bad[0] = HUGE_VAL;
    bad[1] = -HUGE_VAL;
    bad[2] = NAN;
    bad[3] = 1e200;
    bad[4] = 5e9;
    bad[5] = -1;
    bad[6] = 0;
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(NULL, &s));
    for (i = 1; i <= 4; i++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_add_kmeans(s, 1000.0 * (double)i, 10, 0.001 * (double)i));
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_add_compute(s, 1000.0 * (double)i, 0.002 * (double)(i * i) + 0.001));
    }
    before = pqc_scheduler_get_fit(s);
    t0 = pqc_scheduler_iters(s, 4000, 1);
    ASSERT(before.n1 == 4 && before.n2 == 4);
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_kmeans(s, bad[i], 10, 0.1));
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_compute(s, bad[i], 0.1));
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_compute(s, 1000, bad[i] == 0 ? -1 : bad[i]));
        ASSERT(fit_equal(before, pqc_scheduler_get_fit(s)));
    }
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_kmeans(s, 1000, 2000000, 0.1));
    ASSERT(fit_equal(before, pqc_scheduler_get_fit(s)));
    ASSERT_EQ(t0, pqc_scheduler_iters(s, 4000, 1));
    ASSERT_EQ(t0, pqc_scheduler_iters(s, 4000, 1));
    pqc_scheduler_destroy(s);
    PASS();
}

/* a scheduler holding a fixed fit, or NULL */
static pqc_scheduler *fitted_scheduler(void)
{
    pqc_scheduler *s;
    pqc_scheduler_fit f;
    memset(&f, 0, sizeof f);
    f.a1 = 0.001;
    f.b1 = 2e-8;
    f.n1 = 5;
    f.a2 = 0.002;
    f.b2 = 1e-6;
    f.g2 = 3e-10;
    f.n2 = 5;
    if (pqc_scheduler_create(NULL, &s) != PQC_SUCCESS) return NULL;
    if (pqc_scheduler_set_fit(s, &f) != PQC_SUCCESS) {
        pqc_scheduler_destroy(s);
        return NULL;
    }
    return s;
}

/* A scheduler that could hand the builds more iterations than k-means takes is refused
   when it is created, not by every build later. */
TEST scheduler_iterations_stay_within_the_pq_limit(void)
{
    pqc_scheduler_desc d;
    pqc_scheduler *s = NULL;
    memset(&d, 0, sizeof d);
    d.t_max = 100001;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_create(&d, &s));
    d.t_max = 0;
    d.t_default = 100001;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_create(&d, &s));
    d.t_min = d.t_max = d.t_default = 100000;
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(&d, &s));
    ASSERT_EQ(100000, pqc_scheduler_iters(s, 4096, 1));
    pqc_scheduler_destroy(s);
    PASS();
}

TEST calibration_files_are_regular_files_only(void)
{
    pqc_scheduler *s;
    pqc_scheduler_fit before;
    char fifo[512], dir[512], good[512];
    ASSERT((s = fitted_scheduler()) != NULL);
    before = pqc_scheduler_get_fit(s);
    tu_tmp_path(fifo, sizeof fifo, "fifo");
    tu_tmp_path(dir, sizeof dir, "dir");
    tu_tmp_path(good, sizeof good, "calib");
    remove(fifo);
    ASSERT_EQ(0, mkfifo(fifo, 0600));
    ASSERT_EQ(0, mkdir(dir, 0700));
    /* a FIFO with no writer would block a plain open forever */
    ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_load(s, fifo));
    ASSERT(strstr(pqc_last_error(), "not a regular file") != NULL);
    ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_save(s, fifo));
    ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_load(s, dir));
    ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_save(s, dir));
    ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_load(s, "/dev/null"));
    ASSERT(fit_equal(before, pqc_scheduler_get_fit(s)));
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_save(s, good));
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_load(s, good));
    ASSERT(fit_equal(before, pqc_scheduler_get_fit(s)));
    remove(fifo);
    rmdir(dir);
    remove(good);
    pqc_scheduler_destroy(s);
    PASS();
}

/* engine for the driver tests: K/V are a pure function of (layer, position), so a call
   repeated after a failure sees the same values; `fail_layer` makes a callback fail */
typedef struct eng {
    int kv, hq, d, fail_qkv, fail_attend;
    long attends;
    /* check_rows: every prefill view (fp32 rows) is read as documented, count[h] rows of
       k[h] and v[h], and each must be the K/V eng_qkv made for that token */
    int check_rows;
    long rows_read, rows_wrong;
    /* peaks: the queries all point one way and every third key points there too, so that
       attention goes to a few mid tokens and builds lower the window (adaptive split) */
    int peaks;
} eng;
static float eval(int layer, size_t pos, size_t i)
{
    uint64_t z = (uint64_t)layer * 0x9E3779B97F4A7C15ull ^ (uint64_t)pos * 0xBF58476D1CE4E5B9ull ^ (uint64_t)i * 0x94D049BB133111EBull;
    z ^= z >> 29;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 32;
    return (float)((double)(z >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
}

/* a small trained quantizer: 300 keys of d_h 16, m 4, 3 bits; with rope bands and a
   metric when `rich` (1: weights, 2: blocks) */
static int small_pq(int rich, pqc_pq *pq, float *keys)
{
    pqc_pq_desc d;
    pqc_matrix km = pqc_matrix_f32(keys, 300, 16);
    float w[16], wb[2 * 8 * 8];
    int i;
    for (i = 0; i < 2 * 8 * 8; i++) /* 1 + 0.5 on the diagonal, 0.5 off it: positive definite */
        wb[i] = (i % 64) / 8 == i % 8 ? 1.5f + (float)(i / 64) : 0.5f;
    for (i = 0; i < 300 * 16; i++) keys[i] = eval(1, (size_t)i / 16, (size_t)i % 16) * (i % 16 < 4 ? 5.0f : 1.0f);
    for (i = 0; i < 16; i++) w[i] = 0.25f + (float)(i % 4);
    memset(&d, 0, sizeof d);
    d.m = rich ? 2 : 4;
    d.bits = 3;
    d.iters = 4;
    d.seed = 7;
    if (rich) {
        d.metric = rich == 1 ? w : NULL;
        d.metric_blocks = rich == 2 ? wb : NULL;
        d.rope = PQC_ROPE_HALF;
        d.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    }
    return pqc_pq_train(NULL, &d, &km, pq) == PQC_SUCCESS;
}

/* A saved quantizer loads back bit for bit and codes and searches as the original. */
TEST quantizer_files_round_trip(void)
{
    float keys[300 * 16], q[2 * 16];
    char path[512];
    int rich, i;
    tu_tmp_path(path, sizeof path, "pq");
    for (i = 0; i < 32; i++) q[i] = eval(2, 0, (size_t)i);
    for (rich = 0; rich < 3; rich++) {
        pqc_pq a, b;
        pqc_codes ca, cb;
        pqc_search_desc sd;
        pqc_matrix km = pqc_matrix_f32(keys, 300, 16);
        uint32_t ia[30], ib[30];
        ASSERT(small_pq(rich, &a, keys));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_save(&a, path));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_load(NULL, path, &b));
        ASSERT_EQ(a.dim, b.dim);
        ASSERT_EQ(a.m, b.m);
        ASSERT_EQ(a.bits, b.bits);
        ASSERT_EQ(a.half_bands, b.half_bands);
        ASSERT_EQ(rich != 0, a.half_bands);
        ASSERT_MEM_EQ(a.centroids, b.centroids, sizeof(float) * (size_t)a.m * (size_t)a.ksub * (size_t)a.dsub);
        ASSERT_EQ(a.metric == NULL, b.metric == NULL);
        if (a.metric) ASSERT_MEM_EQ(a.metric, b.metric, sizeof(float) * 16);
        ASSERT_EQ(rich == 2, a.mblocks != NULL);
        ASSERT_EQ(a.mblocks == NULL, b.mblocks == NULL);
        if (a.mblocks) ASSERT_MEM_EQ(a.mblocks, b.mblocks, sizeof(float) * 2 * 8 * 8);
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&ca, &a, 300, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&cb, &b, 300, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &a, &km, &ca));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &b, &km, &cb));
        ASSERT_MEM_EQ(ca.data, cb.data, pqc_codes_bytes(&ca));
        memset(&sd, 0, sizeof sd);
        sd.k = 30;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &a, &ca, q, 2, &sd, NULL, ia, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &b, &cb, q, 2, &sd, NULL, ib, NULL));
        ASSERT_MEM_EQ(ia, ib, sizeof ia);
        pqc_codes_free(&ca);
        pqc_codes_free(&cb);
        pqc_pq_free(&a);
        pqc_pq_free(&b);
    }
    remove(path);
    PASS();
}

/* Every truncation, every flipped byte, trailing bytes, a foreign file and paths that are
   no regular file are refused, and the output is left as it was. */
TEST quantizer_file_damage_is_refused(void)
{
    float keys[300 * 16];
    char path[512], bad[512], dir[512];
    unsigned char *img;
    long size = 0, i;
    pqc_pq a, out;
    int refused = 0;
    tu_tmp_path(path, sizeof path, "pqgood");
    tu_tmp_path(bad, sizeof bad, "pqbad");
    tu_tmp_path(dir, sizeof dir, "pqdir");
    ASSERT(small_pq(1, &a, keys));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_save(&a, path));
    ASSERT((img = tu_file_image(path, &size)) != NULL);
    memset(&out, 0x5a, sizeof out);
    for (i = 0; i <= size; i += i < 40 ? 1 : 97) { /* truncations (and, at size + 1, a trailing byte) */
        img[size] = 7;
        ASSERT(tu_file_write(bad, img, (size_t)(i == size ? size + 1 : i)));
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_pq_load(NULL, bad, &out));
        refused++;
    }
    for (i = 0; i < size; i += i < 40 ? 1 : 61) { /* a flipped bit anywhere */
        img[i] ^= 0x10;
        ASSERT(tu_file_write(bad, img, (size_t)size));
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_pq_load(NULL, bad, &out));
        img[i] ^= 0x10;
        refused++;
    }
    { /* the scheduler's file is foreign here */
        pqc_scheduler *s;
        ASSERT((s = fitted_scheduler()) != NULL);
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_save(s, bad));
        pqc_scheduler_destroy(s);
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_pq_load(NULL, bad, &out));
    }
    remove(bad);
    ASSERT_EQ(PQC_ERROR_IO, pqc_pq_load(NULL, bad, &out)); /* no such file */
    ASSERT_EQ(0, mkdir(dir, 0700));
    ASSERT_EQ(PQC_ERROR_IO, pqc_pq_load(NULL, dir, &out));
    ASSERT_EQ(PQC_ERROR_IO, pqc_pq_save(&a, dir));
    ASSERT_EQ(PQC_ERROR_IO, pqc_pq_load(NULL, "/dev/null", &out));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_load(NULL, NULL, &out));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_load(NULL, path, NULL));
    {
        unsigned char want[sizeof out];
        memset(want, 0x5a, sizeof want);
        ASSERT_MEM_EQ(want, &out, sizeof out); /* untouched by every failure */
    }
    {
        pqc_pq none;
        memset(&none, 0, sizeof none);
        ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_save(&none, bad));
        ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_save(&a, NULL));
    }
    ASSERT(refused > 60);
    { /* well-formed files whose metric blocks are not a metric, or come with weights */
        pqc_pq bk;
        unsigned char *im;
        long n = 0, at = 28 + 4 * (16 << 3); /* head, then the centroids: the blocks */
        int k;
        ASSERT(small_pq(2, &bk, keys));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_save(&bk, path));
        pqc_pq_free(&bk);
        ASSERT((im = tu_file_image(path, &n)) != NULL);
        ASSERT_EQ(at + 4 * 2 * 8 * 8 + 8, n);
        for (k = 0; k < 2; k++) {
            uint64_t h;
            int b;
            unsigned char sv[4];
            if (k == 0) { /* the first block's first diagonal entry -1.5: not positive definite */
                memcpy(sv, im + at, 4);
                im[at + 3] |= 0x80;
            } else { /* flags 1 | 2 | 4: weights and blocks both */
                memcpy(sv, im + 24, 4);
                im[24] = 7;
            }
            h = pqc__fnv(im, (size_t)n - 8, PQC__FNV_OFFSET);
            for (b = 0; b < 8; b++) im[n - 8 + b] = (unsigned char)(h >> (8 * b));
            ASSERT(tu_file_write(bad, im, (size_t)n));
            ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_pq_load(NULL, bad, &out));
            memcpy(k == 0 ? im + at : im + 24, sv, 4);
        }
        free(im);
        remove(bad);
    }
    rmdir(dir);
    remove(path);
    free(img);
    pqc_pq_free(&a);
    PASS();
}
static int eng_qkv(void *u, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    eng *e = (eng *)u;
    size_t t, i, qn = (size_t)e->hq * e->d, kn = (size_t)e->kv * e->d;
    if (layer == e->fail_qkv) return 1;
    for (t = 0; t < n; t++) {
        for (i = 0; i < qn; i++) q[t * qn + i] = eval(layer + 100, pos0 + t, i) + (e->peaks ? 2.0f : 0.0f);
        for (i = 0; i < kn; i++) {
            k[t * kn + i] = eval(layer, pos0 + t, i) + (e->peaks && (pos0 + t) % 3 == 1 ? 2.0f : 0.0f);
            v[t * kn + i] = eval(layer + 50, pos0 + t, i);
        }
    }
    return 0;
}
static int eng_attend(void *u, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    eng *e = (eng *)u;
    (void)pos0;
    (void)n;
    (void)q;
    (void)kv;
    if (layer == e->fail_attend) return 1;
    e->attends++;
    if (e->check_rows && kv->pos == NULL && kv->dtype == PQC_F32 && kv->k) {
        int h;
        size_t t, i;
        for (h = 0; h < kv->n_kv_heads; h++)
            for (t = 0; t < kv->count[h]; t++) {
                const float *kr = (const float *)kv->k[h] + t * (size_t)e->d, *vr = (const float *)kv->v[h] + t * (size_t)e->d;
                int wrong = 0;
                for (i = 0; i < (size_t)e->d; i++) {
                    size_t col = (size_t)h * (size_t)e->d + i;
                    wrong |= kr[i] != eval(layer, t, col) || vr[i] != eval(layer + 50, t, col);
                }
                e->rows_read++;
                e->rows_wrong += wrong;
            }
    }
    return 0;
}

/* an engine over eng_qkv / eng_attend for kv KV heads, hq query heads of d dims */
static void eng_init(pqc_engine *e, eng *en, int kv, int hq, int d)
{
    memset(en, 0, sizeof *en);
    en->kv = kv;
    en->hq = hq;
    en->d = d;
    en->fail_qkv = en->fail_attend = -1;
    memset(e, 0, sizeof *e);
    e->user = en;
    e->qkv = eng_qkv;
    e->attend = eng_attend;
}

TEST loaded_calibration_sets_t_on_every_layer(void)
{
    pqc_scheduler *s;
    pqc_scheduler_fit f;
    pqc_cache_desc cd = small_desc(4, 1, 1, 16);
    pqc_cache *c;
    pqc_engine e;
    eng en;
    pqc_layer_stats st;
    char path[512];
    int want, l;
    memset(&f, 0, sizeof f);
    /* k-means of 1000 tokens x T costs 1e-6*T s; compute of a layer 2.35e-5 s: T = 23 */
    f.b1 = 1e-9;
    f.n1 = 20;
    f.b2 = 2.35e-8;
    f.n2 = 20;
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(NULL, &s));
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_set_fit(s, &f));
    tu_tmp_path(path, sizeof path, "fit");
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_save(s, path));
    pqc_scheduler_destroy(s);
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(NULL, &s));
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_load(s, path));
    remove(path);
    cd.pq.iters = 0; /* T from the scheduler */
    cd.scheduler = s;
    cd.n_sink = -1;
    cd.window = 1;
    want = pqc_scheduler_iters(s, 1999, 1);
    ASSERT_EQ(23, want);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    eng_init(&e, &en, 1, 1, 16);
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, 2000));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    for (l = 0; l < 4; l++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, l, &st));
        ASSERT_EQ_FMT(want, st.last_iters, "%d"); /* every layer, not only the first */
        ASSERT_EQ(1, (int)st.builds);
    }
    pqc_cache_destroy(c);
    pqc_scheduler_destroy(s);
    PASS();
}

/* ----- failure atomicity --------------------------------------------------------------- */

/* Everything a caller can observe of a cache (and the state that decides what it will
   select next), folded into a hash; timings excluded only where a success path set them. */
/* h folded with n bytes at p: 32 at a time into four independent chains (a multiply and
   a shift per 8 bytes; four chains keep the multiplier busy, which matters in the
   sanitizer builds, where every call of the atomicity sweep folds the whole cache twice),
   then eight at a time, then the tail byte by byte; any change of the bytes changes h but
   for a 2^-64 chance */
#define FOLD_STEP(h, w) ((h) = ((h) ^ (w)) * 0x9E3779B97F4A7C15ull, (h) ^= (h) >> 29)
static uint64_t fold(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    size_t i = 0;
    uint64_t w[4], h1 = h ^ 1u, h2 = h ^ 2u, h3 = h ^ 3u;
    for (; i + 32 <= n; i += 32) {
        memcpy(&w[0], b + i, 8); /* (8 bytes at a time: inlined at every level) */
        memcpy(&w[1], b + i + 8, 8);
        memcpy(&w[2], b + i + 16, 8);
        memcpy(&w[3], b + i + 24, 8);
        FOLD_STEP(h, w[0]);
        FOLD_STEP(h1, w[1]);
        FOLD_STEP(h2, w[2]);
        FOLD_STEP(h3, w[3]);
    }
    if (i) {
        FOLD_STEP(h, h1);
        FOLD_STEP(h, h2);
        FOLD_STEP(h, h3);
    }
    for (; i + 8 <= n; i += 8) {
        memcpy(w, b + i, 8);
        FOLD_STEP(h, w[0]);
    }
    for (; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}
/* with_blocks 0: leave out the block cache's contents, which a failed driver call may
   have changed (it is a cache: what it holds decides hits, never what is selected) */
static int g_with_blocks = 1;
/* with_times 0: leave out the statistics' timings too (to compare two caches), and with
   with_blocks 0 the block cache's hits and the bytes they saved */
static int g_with_times = 1;
static uint64_t observe(const pqc_cache *c, const pqc_selection *sel)
{
    uint64_t h = 0xcbf29ce484222325ull;
    int l, hd, w = pqc_cache_window(c);
    h = fold(h, &w, sizeof w);
    for (l = 0; l < c->d.n_layers; l++) {
        const pqc__layer *L = &c->layers[l];
        pqc_layer_stats st;
        size_t n = pqc_cache_tokens(c, l), nb = (n + (size_t)c->d.block_tokens - 1) / (size_t)c->d.block_tokens;
        pqc_cache_stats(c, l, &st);
        if (!g_with_times) {
            st.select_s = st.fetch_s = st.build_s = st.wait_s = 0.0;
            if (!g_with_blocks) st.hits = st.misses = st.bytes_h2d = 0; /* what the block cache held */
        }
        h = fold(h, &n, sizeof n);
        h = fold(h, &st, sizeof st);
        h = fold(h, &L->n_coded, sizeof L->n_coded);
        h = fold(h, &L->n_trained, sizeof L->n_trained);
        h = fold(h, &L->gen, sizeof L->gen);
        h = fold(h, &L->step, sizeof L->step);
        h = fold(h, L->qsq, pqc__qsq_len(c) * sizeof(double)); /* the observations and drift state */
        {
            int lw = pqc_cache_layer_window(c, l);
            h = fold(h, &lw, sizeof lw);
        }
        for (hd = 0; hd < c->d.n_kv_heads; hd++) {
            const pqc__head *H = &L->heads[hd];
            const void *k, *v;
            size_t tk, nr = 0;
            int32_t blocks[64];
            int nbk = pqc_cache_cached_blocks(c, l, hd, blocks, 64);
            h = fold(h, &H->codes.count, sizeof H->codes.count);
            if (H->codes.data) {
                int j;
                for (j = 0; j < H->codes.m; j++)
                    h = fold(h, H->codes.data + (size_t)j * H->codes.col_stride, pqc__col_bytes(H->codes.count, H->codes.bits));
            }
            if (H->pq.centroids)
                h = fold(h, H->pq.centroids, sizeof(float) * (size_t)H->pq.m * (size_t)H->pq.ksub * (size_t)H->pq.dsub);
            if (H->pq.metric) h = fold(h, H->pq.metric, sizeof(float) * (size_t)H->pq.dim);
            if (H->pq.mblocks) h = fold(h, H->pq.mblocks, sizeof(float) * (size_t)H->pq.dim * (size_t)H->pq.dsub);
            if (c->d.outliers > 0) { /* the exact lists */
                h = fold(h, &H->n_outliers, sizeof H->n_outliers);
                h = fold(h, &H->n_outliers_build, sizeof H->n_outliers_build);
                h = fold(h, &H->outlier_thr, sizeof H->outlier_thr);
                if (H->n_outliers) h = fold(h, H->outliers, H->n_outliers * sizeof(uint32_t));
            }
            if (c->d.residual_weight > 0 && H->rq && L->n_coded) /* the residual bytes */
                h = fold(h, H->rq, L->n_coded * (size_t)c->d.pq.m);
            if (g_with_blocks) {
                h = fold(h, blocks, sizeof(int32_t) * (size_t)(nbk < 0 ? 0 : nbk));
                if (H->score) h = fold(h, H->score, sizeof(float) * nb);
                if (H->freq) h = fold(h, H->freq, sizeof(uint64_t) * (size_t)c->d.cache_blocks);
                if (H->filled) h = fold(h, H->filled, sizeof(uint32_t) * (size_t)c->d.cache_blocks);
            }
            for (tk = 0; tk < n; tk += nr) { /* rows in one or two parts (a fork) */
                if (pqc_cache_kv_part(c, l, hd, tk, &k, &v, &nr) != PQC_SUCCESS || !nr) break;
                h = fold(h, k, nr * c->row);
                h = fold(h, v, nr * c->row);
            }
        }
    }
    if (sel && sel->idx) {
        for (hd = 0; hd < sel->n_kv_heads; hd++) {
            h = fold(h, &sel->count[hd], sizeof(size_t));
            h = fold(h, sel->idx + (size_t)hd * sel->capacity, sel->count[hd] * sizeof(uint32_t));
        }
    }
    return h;
}

typedef struct scen {
    tu_failing fa;
    int threads;
    int steps, fork_steps, driver_steps; /* decode steps of the cache, its fork, the driver */
    long failures, job_failures, atomicity_breaks, bad_codes, calls_total;
    uint64_t final_hash; /* selections and gathered rows at the end */
    char first_break[300];
} scen;

/* Runs one call: on failure the observables must not have moved; then it is retried
   (the allocator fails only once) until it succeeds. Nothing waits for the builds first:
   a failed call must not install a build that finished before it either. */
#define SCEN_CALL(S, C, SEL, EXPR)                                                                   \
    do {                                                                                             \
        int tries_;                                                                                  \
        for (tries_ = 0; tries_ < 4; tries_++) {                                                     \
            uint64_t h0_, h1_;                                                                       \
            pqc_result r_;                                                                           \
            h0_ = (C) ? observe((C), (SEL)) : 0;                                                     \
            r_ = (EXPR);                                                                             \
            if (r_ == PQC_SUCCESS) break;                                                            \
            (S)->failures++;                                                                         \
            if (r_ == PQC_ERROR_JOB_FAILED) (S)->job_failures++;                                     \
            else if (r_ != PQC_ERROR_OUT_OF_MEMORY || !pqc_last_error()[0]) (S)->bad_codes++;        \
            h1_ = (C) ? observe((C), (SEL)) : 0;                                                     \
            if (h0_ != h1_ && !(S)->atomicity_breaks++)                                              \
                snprintf((S)->first_break, sizeof (S)->first_break, "%.120s -> %d (%.100s)", #EXPR, (int)r_, \
                         pqc_last_error());                                                          \
        }                                                                                            \
        if (tries_ == 4) return -1;                                                                  \
    } while (0)

static uint64_t fold_kv(uint64_t h, const pqc_selection *sel, const pqc_kv_out *o, int d)
{
    int hd;
    for (hd = 0; hd < sel->n_kv_heads; hd++) {
        h = fold(h, sel->idx + (size_t)hd * sel->capacity, sel->count[hd] * sizeof(uint32_t));
        h = fold(h, o->k + (size_t)hd * o->head_stride * (size_t)d, sel->count[hd] * (size_t)d * sizeof(float));
        h = fold(h, o->v + (size_t)hd * o->head_stride * (size_t)d, sel->count[hd] * (size_t)d * sizeof(float));
    }
    return h;
}

/* The scenario: a runtime, a 2-layer fp16 cache with prompt, chunked prompt, decode steps
   with select and gather, a second turn (re-ranked, with outlier lists); and a driver-run
   fp32 cache with row pointers (outlier lists, residual-aware scoring).
   Returns 0 when it ran to the end (with retries), -1 when a call failed for good. */
static int scenario(scen *S)
{
    pqc_runtime_desc rd;
    pqc_runtime *rt = NULL;
    pqc_cache *a = NULL, *b = NULL;
    pqc_cache_desc cd = small_desc(2, 2, 4, 16);
    pqc_selection sel;
    pqc_kv_out out;
    pqc_engine e;
    eng en;
    float *k, *v, q[4 * 16], *obuf;
    size_t i, step;
    int l, res = 0;
    uint64_t fh = 0xcbf29ce484222325ull;
    memset(&rd, 0, sizeof rd);
    memset(&sel, 0, sizeof sel);
    rd.n_threads = S->threads;
    rd.allocator.alloc = tu_fail_alloc;
    rd.allocator.free = tu_fail_free;
    rd.allocator.user = &S->fa;
    g_rng = 99;
    g_with_blocks = 1;
    k = tu_uniform_rows(&g_rng, 600, 32);
    v = tu_uniform_rows(&g_rng, 600, 32);
    obuf = (float *)malloc(2 * 2 * 700 * 16 * sizeof(float));
    out.k = obuf;
    out.v = obuf + 2 * 700 * 16;
    out.head_stride = 700;
    for (i = 0; i < 64; i++) q[i] = tu_uniform(&g_rng);
    cd.kv_dtype = PQC_F16;
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    cd.rebuild_share = 0.3;
    cd.rerank = 2; /* exact scoring: the failures inside it, and outlier lists given back */
    cd.outliers = 4;
    if (pqc_runtime_create(&rd, &rt) != PQC_SUCCESS) goto early;
    if (pqc_cache_create(rt, &cd, &a) != PQC_SUCCESS) goto early;
    if (pqc_selection_init(a, &sel) != PQC_SUCCESS) goto early;
    for (l = 0; l < 2; l++) SCEN_CALL(S, a, &sel, prefill(a, l, k, v, 300));
    for (l = 0; l < 2; l++) SCEN_CALL(S, a, &sel, prefill(a, l, k + 300 * 32, v + 300 * 32, 100));
    for (step = 0; step < (size_t)S->steps; step++)
        for (l = 0; l < 2; l++) {
            SCEN_CALL(S, a, &sel, pqc_cache_append(a, l, k + (400 + step) * 32, v + (400 + step) * 32));
            SCEN_CALL(S, a, &sel, pqc_cache_select(a, l, q, &sel));
            SCEN_CALL(S, a, &sel, pqc_cache_fetch(a, l, &sel, &out));
            fh = fold_kv(fh, &sel, &out, 16);
        }
    { /* a fork over the prefix decodes on its own, then a fork of the fork */
        pqc_cache *f1 = NULL, *f2 = NULL;
        pqc_selection sf;
        memset(&sf, 0, sizeof sf);
        SCEN_CALL(S, a, &sel, pqc_cache_fork(a, &f1));
        SCEN_CALL(S, f1, &sf, pqc_selection_init(f1, &sf));
        for (step = 0; step < (size_t)S->fork_steps; step++)
            for (l = 0; l < 2; l++) {
                SCEN_CALL(S, f1, &sf, pqc_cache_append(f1, l, k + (440 + step) * 32, v + (440 + step) * 32));
                SCEN_CALL(S, f1, &sf, pqc_cache_select(f1, l, q, &sf));
                SCEN_CALL(S, f1, &sf, pqc_cache_fetch(f1, l, &sf, &out));
                fh = fold_kv(fh, &sf, &out, 16);
            }
        SCEN_CALL(S, f1, &sf, pqc_cache_fork(f1, &f2));
        for (l = 0; l < 2; l++) {
            SCEN_CALL(S, f2, &sf, pqc_cache_append(f2, l, k + 450 * 32, v + 450 * 32));
            SCEN_CALL(S, f2, &sf, pqc_cache_select(f2, l, q, &sf));
            SCEN_CALL(S, f2, &sf, pqc_cache_fetch(f2, l, &sf, &out));
            fh = fold_kv(fh, &sf, &out, 16);
        }
        pqc_selection_free(&sf);
        pqc_cache_destroy(f2);
        pqc_cache_destroy(f1);
    }
    for (l = 0; l < 2; l++) SCEN_CALL(S, a, &sel, prefill(a, l, k + 424 * 32, v + 424 * 32, 150)); /* second turn */
    for (l = 0; l < 2; l++) {
        SCEN_CALL(S, a, &sel, pqc_cache_select(a, l, q, &sel));
        SCEN_CALL(S, a, &sel, pqc_cache_fetch(a, l, &sel, &out));
        fh = fold_kv(fh, &sel, &out, 16);
    }
    /* the driver, fp32 storage, rows by pointer */
    cd = small_desc(2, 1, 2, 16);
    cd.n_sink = 2;
    cd.budget_ratio = 0.3;
    cd.outliers = 3;
    cd.residual_weight = 0.15;
    if (pqc_cache_create(rt, &cd, &b) != PQC_SUCCESS) goto early;
    eng_init(&e, &en, 1, 2, 16);
    e.accepts_row_pointers = 1;
    g_with_blocks = 0; /* the driver's documented recovery: everything but the block cache */
    SCEN_CALL(S, b, (pqc_selection *)NULL, pqc_driver_prefill(b, &e, 0, 250));
    for (step = 0; step < (size_t)S->driver_steps; step++) SCEN_CALL(S, b, (pqc_selection *)NULL, pqc_driver_decode(b, &e, 250 + step));
    g_with_blocks = 1;
    {
        pqc_selection sb;
        memset(&sb, 0, sizeof sb);
        SCEN_CALL(S, b, &sb, pqc_selection_init(b, &sb));
        SCEN_CALL(S, b, &sb, pqc_cache_select(b, 1, q, &sb));
        SCEN_CALL(S, b, &sb, pqc_cache_fetch(b, 1, &sb, &out));
        fh = fold_kv(fh, &sb, &out, 16);
        pqc_selection_free(&sb);
    }
    S->final_hash = fh;
    goto done;
early: /* a failure while creating: it must say so */
    if (!pqc_last_error()[0]) S->bad_codes++;
    res = 1;
done:
    pqc_selection_free(&sel);
    pqc_cache_destroy(b);
    pqc_cache_destroy(a);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    free(obuf);
    return res;
}

/* Under ThreadSanitizer the sweep takes every 8th allocation: races are what it is there
   for; the other builds take every allocation. */
#define SWEEP_STRIDE (TU_TSAN ? 8 : 1)

/* The scenario's decode steps: in the small size each loop still runs more than once (the
   block cache admits and evicts, a rebuild falls due, the fork decodes past its prefix),
   so every allocation site is reached, at a fraction of the allocations. */
static void scen_size(scen *S)
{
    S->steps = TEST_SIZE(12, 3);
    S->fork_steps = TEST_SIZE(4, 2);
    S->driver_steps = TEST_SIZE(6, 2);
}

static char g_break[300];
static enum greatest_test_res atomicity_sweep(int threads)
{
    scen S;
    long total, n, runs = 0, fired = 0;
    uint64_t ref;
    memset(&S, 0, sizeof S);
    pthread_mutex_init(&S.fa.mu, NULL);
    S.threads = threads;
    scen_size(&S);
    S.fa.fail_at = -1;
    ASSERT_EQ(0, scenario(&S));
    ASSERT_EQ(0L, S.failures);
    ASSERT_EQ(0L, S.fa.live);
    total = S.fa.calls;
    ref = S.final_hash;
    ASSERT_GT(total, 100L);
    /* every allocation of the scenario fails once, in turn */
    for (n = 0; n < total; n += SWEEP_STRIDE) {
        int rc;
        memset(&S, 0, sizeof S - sizeof S.fa);
        S.threads = threads;
        scen_size(&S);
        S.fa.calls = 0;
        S.fa.live = 0;
        S.fa.fired = 0;
        S.fa.fail_at = n;
        S.failures = S.job_failures = S.atomicity_breaks = S.bad_codes = 0;
        S.first_break[0] = 0;
        rc = scenario(&S);
        runs++;
        fired += S.fa.fired;
        memcpy(g_break, S.first_break, sizeof g_break); /* the message outlives S */
        ASSERTm(g_break, S.atomicity_breaks == 0);
        ASSERT_EQ_FMT(0L, S.bad_codes, "%ld");
        ASSERT_EQ_FMT(0L, S.fa.live, "%ld");
        ASSERT(rc == 0 || rc == 1);
        /* a retried failure ends exactly where the undisturbed run ended, unless a
           background build failed (the layer then rebuilds later, so it may select
           differently, but it still selects) */
        if (rc == 0 && S.job_failures == 0) ASSERT_EQ_FMT((unsigned long long)ref, (unsigned long long)S.final_hash, "%llx");
    }
    ASSERT_EQ((total + SWEEP_STRIDE - 1) / SWEEP_STRIDE, runs);
    ASSERT_GT(fired, runs / 2);
    printf("    %ld allocations (%s), every %d%s failed once in turn: %ld runs, the failure fired in %ld\n", total,
           threads < 0 ? "inline" : "2 threads", SWEEP_STRIDE, SWEEP_STRIDE == 1 ? "" : "th", runs, fired);
    pthread_mutex_destroy(&S.fa.mu);
    PASS();
}

TEST failed_calls_change_nothing_at_every_allocation_inline(void) { return atomicity_sweep(-1); }
TEST failed_calls_change_nothing_at_every_allocation_threaded(void) { return atomicity_sweep(2); }

/* ----- results that do not depend on timing ---------------------------------------------- */

/* h folded with a selection: every head's count and indices */
static uint64_t fold_sel(uint64_t h, const pqc_selection *s)
{
    int hd;
    for (hd = 0; hd < s->n_kv_heads; hd++) {
        h = fold(h, &s->count[hd], sizeof(size_t));
        h = fold(h, s->idx + (size_t)hd * s->capacity, s->count[hd] * sizeof(uint32_t));
    }
    return h;
}

/* An allocator that makes the workers slow at random (a sleep of up to 2 ms in one of
   four of their allocations): builds then finish before or after the next call at random */
static pthread_t g_main_thread;
static pthread_mutex_t g_slow_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_slow_state = 1;
static void *slow_alloc(size_t n, void *u)
{
    (void)u;
    if (!pthread_equal(pthread_self(), g_main_thread)) {
        uint64_t z;
        pthread_mutex_lock(&g_slow_mu);
        z = (g_slow_state = g_slow_state * 6364136223846793005ull + 1442695040888963407ull) >> 33;
        pthread_mutex_unlock(&g_slow_mu);
        if ((z & 3) == 0) {
            struct timespec ts;
            ts.tv_sec = 0;
            ts.tv_nsec = (long)(z % 2000) * 1000L;
            nanosleep(&ts, NULL);
        }
    }
    return malloc(n);
}
static void slow_free(void *p, void *u)
{
    (void)u;
    free(p);
}

/* A random decode program (seeded) on a runtime of `threads` workers (-1: inline): a
   2-layer cache rebuilding every `share` of its coded tokens, a chunked prompt with
   observed queries, decode steps whose queries drift away from the observed ones half
   way (drift rebuilds), bursts of appends, a fork that decodes alongside its parent, batched
   selects of the two. Every selection's hash goes to out[]; then each layer's build
   counts. Returns the number of entries, or 0 when a call failed. */
static size_t timing_program(int threads, int seed, double share, int steps, uint64_t *out, size_t cap)
{
    pqc_runtime_desc rd;
    pqc_runtime *rt = NULL;
    pqc_cache *a = NULL, *f = NULL;
    pqc_cache_desc cd = small_desc(2, 2, 4, 16);
    pqc_selection sa, sf;
    float *k, *v, q[4 * 16], qo[8 * 4 * 16];
    size_t n = 0, i, at = 0, next = 300;
    int l, step, ok = 1;
    memset(&rd, 0, sizeof rd);
    memset(&sa, 0, sizeof sa);
    memset(&sf, 0, sizeof sf);
    rd.n_threads = threads;
    rd.allocator.alloc = slow_alloc;
    rd.allocator.free = slow_free;
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    cd.rebuild_share = share;
    cd.cache_blocks = 0;
    if (seed % 3 == 1) {
        cd.rerank = 2;
        cd.outliers = 4;
    } else if (seed % 3 == 2) {
        cd.residual_weight = 0.1;
    }
    g_rng = 7000 + (uint64_t)seed;
    k = tu_uniform_rows(&g_rng, 1200, 32);
    v = tu_uniform_rows(&g_rng, 1200, 32);
    for (i = 0; i < 8 * 64; i++) qo[i] = tu_uniform(&g_rng) * ((i % 16) < 8 ? 1.0f : 0.05f);
#define TP(x) \
    do { \
        if ((x) != PQC_SUCCESS) { ok = 0; goto end; } \
    } while (0)
    TP(pqc_runtime_create(&rd, &rt));
    TP(pqc_cache_create(rt, &cd, &a));
    TP(pqc_selection_init(a, &sa));
    for (l = 0; l < 2; l++) {
        TP(pqc_cache_observe(a, l, qo, 8));
        TP(prefill(a, l, k, v, 200));
    }
    for (l = 0; l < 2; l++) TP(prefill(a, l, k + 200 * 32, v + 200 * 32, 100));
    for (step = 0; step < steps; step++) {
        int drift = step > steps / 2, extra = tu_uniform(&g_rng) > 0.8f, batch = f && tu_uniform(&g_rng) > 0.5f;
        if (step == steps / 3) {
            TP(pqc_cache_fork(a, &f));
            TP(pqc_selection_init(f, &sf));
        }
        for (l = 0; l < 2; l++) {
            for (i = 0; i < 64; i++) q[i] = tu_uniform(&g_rng) * (((i % 16) < 8) == !drift ? 1.0f : 0.05f);
            TP(pqc_cache_append(a, l, k + (next % 1200) * 32, v + (next % 1200) * 32));
            if (f) TP(pqc_cache_append(f, l, k + ((next + 77) % 1200) * 32, v + ((next + 77) % 1200) * 32));
            if (batch) {
                pqc_cache *cs[2];
                const float *qs[2];
                pqc_selection *ss[2];
                cs[0] = a;
                cs[1] = f;
                qs[0] = qs[1] = q;
                ss[0] = &sa;
                ss[1] = &sf;
                TP(pqc_batch_select(cs, 2, l, qs, ss));
            } else {
                TP(pqc_cache_select(a, l, q, &sa));
                if (f) TP(pqc_cache_select(f, l, q, &sf));
            }
            if (at + 2 > cap) { ok = 0; goto end; }
            out[at++] = fold_sel(0xcbf29ce484222325ull, &sa);
            if (f) out[at++] = fold_sel(0xcbf29ce484222325ull, &sf);
        }
        next++;
        if (extra) { /* a burst of tokens appended to every layer with no select between */
            int j, burst = 1 + (int)(40.0f * (tu_uniform(&g_rng) + 1.0f));
            for (j = 0; j < burst; j++, next++)
                for (l = 0; l < 2; l++) TP(pqc_cache_append(a, l, k + (next % 1200) * 32, v + (next % 1200) * 32));
        }
    }
    for (l = 0; l < 2 && at + 4 <= cap; l++) {
        pqc_layer_stats st;
        TP(pqc_cache_stats(a, l, &st));
        out[at++] = st.builds;
        out[at++] = st.rebuilds;
        TP(pqc_cache_stats(f, l, &st));
        out[at++] = st.builds;
        out[at++] = st.rebuilds;
    }
    n = at;
end:
#undef TP
    pqc_selection_free(&sa);
    pqc_selection_free(&sf);
    pqc_cache_destroy(f);
    pqc_cache_destroy(a);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    return ok ? n : 0;
}

/* The codebook that serves a step is a function of the calls made: inline and on 1, 2
   and 4 workers, the same programs select the same tokens, bit for bit, whatever the
   rebuild share (a finished build is installed by the next call on its layer, which
   waits for it; a build starts only once the call that made it due has succeeded). */
TEST selections_do_not_depend_on_the_thread_count(void)
{
    static const double shares[] = { 0.05, 0.1, 0.2, 0.5, 0.07, 0.3 };
    static const int threads[] = { 1, 2, 4 };
    enum { CAP = 2048 };
    uint64_t *ref = (uint64_t *)malloc(CAP * sizeof(uint64_t)), *got = (uint64_t *)malloc(CAP * sizeof(uint64_t));
    int p, t, programs = TEST_SIZE(6, 3), steps = TEST_SIZE(90, 40);
    long compared = 0, rebuilds = 0;
    g_main_thread = pthread_self();
    for (p = 0; p < programs; p++) {
        size_t nr = timing_program(-1, p, shares[p], steps, ref, CAP), i;
        ASSERT(nr > 8);
        for (i = nr - 8; i < nr; i += 2) rebuilds += (long)ref[i + 1];
        for (t = 0; t < 3; t++) {
            size_t ng = timing_program(threads[t], p, shares[p], steps, got, CAP);
            ASSERT_EQ(nr, ng);
            for (i = 0; i < nr; i++)
                if (ref[i] != got[i]) FAILm("a selection depends on the thread count");
            compared += (long)nr;
        }
    }
    ASSERT_GT(rebuilds, (long)programs * 4); /* the programs do rebuild */
    printf("    %d programs, %ld selections and counts compared on 1, 2 and 4 workers with the inline run, %ld "
           "rebuilds\n", programs, compared, rebuilds);
    free(ref);
    free(got);
    PASS();
}

/* ----- the driver's recovery ------------------------------------------------------------ */

TEST failed_driver_calls_give_back_their_tokens(void)
{
    pqc_cache_desc cd = small_desc(3, 1, 2, 16);
    pqc_cache *c, *ref;
    pqc_engine e;
    eng en;
    pqc_selection s1, s2;
    float q[32];
    int l, fail;
    size_t i;
    cd.n_sink = 2;
    eng_init(&e, &en, 1, 2, 16);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &ref));
    for (fail = 0; fail < 3; fail++) { /* qkv fails at layer 1, then attend at layer 2, ... */
        en.fail_qkv = fail == 0 ? 1 : -1;
        en.fail_attend = fail == 1 ? 2 : (fail == 2 ? 0 : -1);
        ASSERT_EQ(PQC_ERROR_CALLBACK, pqc_driver_prefill(c, &e, 0, 400));
        ASSERT(strstr(pqc_last_error(), "callback failed") != NULL);
        for (l = 0; l < 3; l++) ASSERT_EQ(0, pqc_cache_tokens(c, l)); /* every layer as before */
    }
    en.fail_qkv = en.fail_attend = -1;
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, 400)); /* the retry just works */
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(ref, &e, 0, 400));
    for (i = 0; i < 10; i++) {
        en.fail_attend = (int)(i % 3);
        ASSERT_EQ(PQC_ERROR_CALLBACK, pqc_driver_decode(c, &e, 400 + i));
        for (l = 0; l < 3; l++) ASSERT_EQ(400 + i, pqc_cache_tokens(c, l));
        en.fail_attend = -1;
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, 400 + i));
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(ref, &e, 400 + i));
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &s1));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ref, &s2));
    for (i = 0; i < 32; i++) q[i] = eval(7, i, 3);
    for (l = 0; l < 3; l++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q, &s1));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(ref, l, q, &s2));
        ASSERT_EQ(s2.count[0], s1.count[0]);
        ASSERT_MEM_EQ(s2.idx, s1.idx, s1.count[0] * sizeof(uint32_t));
    }
    pqc_selection_free(&s1);
    pqc_selection_free(&s2);
    pqc_cache_destroy(c);
    pqc_cache_destroy(ref);
    PASS();
}

/* ----- a failed driver step leaves nothing behind ---------------------------------------- */

/* An engine that fails where told (eng) and counts the failing steps in which a build was
   installed before the failure (the cache's layers with an install the running call
   would keep or undo). */
typedef struct fstep_eng {
    eng en;
    const pqc_cache *c;
    long installs_seen;
} fstep_eng;
static int fstep_attend(void *u, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    fstep_eng *f = (fstep_eng *)u;
    if (layer == f->en.fail_attend && f->c) {
        int l, any = 0;
        for (l = 0; l < f->c->d.n_layers; l++) any |= f->c->layers[l].undo;
        f->installs_seen += any;
    }
    return eng_attend(&f->en, layer, pos0, n, q, kv);
}
static int fstep_qkv(void *u, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    return eng_qkv(&((fstep_eng *)u)->en, layer, pos0, n, q, k, v);
}

/* A cache of `kind` (0: its own prompt, 1: a fork of a cache with the prompt, 2: loaded
   by mapping the file of such a cache) holding a 300-token prompt from the driver. */
static pqc_result fstep_cache(int kind, const pqc_cache_desc *cd, const pqc_engine *e, const char *path, pqc_cache **out)
{
    pqc_cache *base = NULL;
    pqc_result r = pqc_cache_create(NULL, cd, &base);
    if (r == PQC_SUCCESS) r = pqc_driver_prefill(base, e, 0, 300);
    if (r != PQC_SUCCESS || kind == 0) {
        *out = base;
        return r;
    }
    if (kind == 1) r = pqc_cache_fork(base, out);
    else if ((r = pqc_cache_save(base, path)) == PQC_SUCCESS) r = pqc_cache_load(NULL, cd, path, out);
    pqc_cache_destroy(base);
    return r;
}

/* An engine callback that fails in a decode step, at each layer in turn, in its first or
   its second callback, while rebuilds fall due and finished builds are installed inside
   the failing step (a rebuild share of 0.05 on the inline runtime: a build started by the
   step's append is installed by the same step's select), leaves the cache as it was: its
   counts, codes, codebooks, exact lists and residual bytes, window and statistics; a save
   afterwards loads; and the cache goes on to select exactly what a twin that never saw a
   failure selects. Every split, with PQ scoring, exact scoring (re-ranking and outlier
   lists) and residual scoring (the default metric: blocks), and the default split with
   the diagonal metric (and outlier lists), on a cache, a fork and a mapped load. */
TEST failed_driver_steps_leave_nothing_behind(void)
{
    static const pqc_split splits[] = { PQC_SPLIT_COMPETE, PQC_SPLIT_FIXED, PQC_SPLIT_ADAPTIVE, PQC_SPLIT_FIXED_COMPETE };
    char path[512], spath[512];
    int si, scoring, kind, steps = TEST_SIZE(36, 18);
    long failed = 0, installs = 0, loads = 0, compared = 0;
    tu_tmp_path(path, sizeof path, "fstep");
    tu_tmp_path(spath, sizeof spath, "fstep_saved");
    g_with_blocks = 0; /* the block cache is a cache: a failed step may have admitted blocks */
    for (si = 0; si < 4; si++)
        for (scoring = 0; scoring < 4; scoring++)
            for (kind = 0; kind < 3 && (scoring < 3 || si == 0); kind++) {
                pqc_cache_desc cd = small_desc(3, 2, 4, 16);
                pqc_cache *c = NULL, *ref = NULL;
                pqc_engine e;
                fstep_eng fe;
                size_t pos = 300;
                int step;
                cd.n_sink = 4;
                cd.budget_ratio = 0.2;
                cd.rebuild_share = 0.05;
                cd.split = splits[si];
                if (scoring == 1) {
                    cd.rerank = 1.5;
                    cd.outliers = 4;
                } else if (scoring == 2) {
                    cd.residual_weight = 0.15;
                } else if (scoring == 3) { /* weights per dim (not the default's blocks) */
                    cd.metric = PQC_METRIC_QUERY_DIAG;
                    cd.outliers = 4;
                }
                eng_init(&e, &fe.en, 2, 4, 16);
                e.user = &fe;
                e.qkv = fstep_qkv;
                e.attend = fstep_attend;
                fe.c = NULL;
                fe.installs_seen = 0;
                ASSERT_EQ(PQC_SUCCESS, fstep_cache(kind, &cd, &e, path, &c));
                ASSERT_EQ(PQC_SUCCESS, fstep_cache(kind, &cd, &e, path, &ref));
                for (step = 0; step < steps; step++, pos++) {
                    int at = step % 6, l;
                    uint64_t before, after;
                    pqc_result r;
                    /* the failing step: qkv, then attend, at layer 0, 1, 2 in turn */
                    fe.en.fail_qkv = at % 2 == 0 ? at / 2 : -1;
                    fe.en.fail_attend = at % 2 == 1 ? at / 2 : -1;
                    fe.c = c;
                    before = observe(c, NULL);
                    r = pqc_driver_decode(c, &e, pos);
                    after = observe(c, NULL);
                    if (r != PQC_ERROR_CALLBACK || before != after)
                        FAILm(r != PQC_ERROR_CALLBACK ? "the step did not fail" : "a failed step left something behind");
                    for (l = 0; l < 3; l++) ASSERT_EQ(pos, pqc_cache_tokens(c, l));
                    failed++;
                    if (step % 6 == 5) { /* a save after a failure loads, and saved, it loads the same */
                        pqc_cache *m = NULL;
                        ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, spath));
                        ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, spath, &m));
                        pqc_cache_destroy(m);
                        ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(ref, spath)); /* (a save installs as a sync: both) */
                        loads++;
                    }
                    /* then the step succeeds, on the cache and on its twin */
                    fe.en.fail_qkv = fe.en.fail_attend = -1;
                    fe.c = NULL;
                    ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos));
                    ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(ref, &e, pos));
                    if (fold_sel(1, &c->dsel) != fold_sel(1, &ref->dsel)) FAILm("selections differ from the twin's");
                    compared++;
                }
                g_with_times = 0;
                if (observe(c, NULL) != observe(ref, NULL)) FAILm("the cache differs from its twin");
                g_with_times = 1;
                installs += fe.installs_seen;
                ASSERT(scoring == 3 ? c->layers[0].heads[0].pq.metric != NULL && c->layers[2].heads[1].pq.metric != NULL
                                    : c->layers[0].heads[0].pq.mblocks != NULL && c->layers[2].heads[1].pq.mblocks != NULL);
                pqc_cache_destroy(c);
                pqc_cache_destroy(ref);
            }
    g_with_blocks = 1;
    remove(path);
    remove(spath);
    ASSERT_GT(installs, failed / 20); /* the failing steps do install builds */
    printf("    %ld failed steps (%ld with a build installed before the failure), %ld saves loaded, %ld steps compared\n",
           failed, installs, loads, compared);
    PASS();
}

/* pqc_cache_save changes a cache as pqc_cache_sync does, and nothing more: it installs
   every finished build (waiting for those in flight), and the builds that fall due start
   at its end. So a saved cache selects from then on what a twin synced at the same point
   selects, and what the cache loaded from its file selects; a twin neither saved nor
   synced installs the same builds at its next call instead, and where such a build
   lowered the window (the adaptive split, here with re-ranking) that call still
   selects with the former window: the saved cache's selections differ there, as
   documented (the driver's prompt observed, rebuilds falling due every few steps,
   builds on two workers). */
TEST a_save_changes_a_cache_as_a_sync_does(void)
{
    pqc_cache_desc cd = small_desc(2, 2, 4, 16);
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache *saved = NULL, *synced = NULL, *plain = NULL, *loaded = NULL;
    pqc_engine e;
    eng en;
    char path[512];
    size_t pos = 300;
    int step, saves = 0, compared = 0, plain_differs = 0;
    ASSERT(rt != NULL);
    tu_tmp_path(path, sizeof path, "savesync");
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    cd.recent_share = 0.5;
    cd.rebuild_share = 0.05;
    cd.rerank = 1.5;
    cd.split = PQC_SPLIT_ADAPTIVE;
    eng_init(&e, &en, 2, 4, 16);
    en.peaks = 1;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &saved));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &synced));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &plain));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(saved, &e, 0, 300));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(synced, &e, 0, 300));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(plain, &e, 0, 300));
    for (step = 0; step < 40; step++, pos++) {
        if (step % 7 == 0) { /* saved, synced, and the file loaded (its own copy decodes on) */
            pqc_cache_destroy(loaded);
            loaded = NULL;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(saved, path));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(synced));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(rt, &cd, path, &loaded));
            saves++;
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(saved, &e, pos));
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(synced, &e, pos));
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(plain, &e, pos));
        if (fold_sel(1, &saved->dsel) != fold_sel(1, &synced->dsel)) FAILm("a saved cache selects otherwise than a synced one");
        plain_differs += fold_sel(1, &saved->dsel) != fold_sel(1, &plain->dsel);
        if (loaded) {
            ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(loaded, &e, pos));
            if (fold_sel(1, &saved->dsel) != fold_sel(1, &loaded->dsel))
                FAILm("a loaded cache selects otherwise than the saved one");
        }
        compared++;
    }
    ASSERT_EQ(6, saves);
    ASSERT_GT(compared, 30);
    ASSERT(pqc_cache_layer_window(saved, 0) < pqc_cache_window(saved)); /* a build lowered the window */
    ASSERT_GT(plain_differs, 0);
    {
        pqc_layer_stats st;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(saved, 0, &st));
        ASSERT_GT(st.rebuilds, 1); /* builds fell due and were installed along the way */
    }
    pqc_cache_destroy(loaded);
    pqc_cache_destroy(saved);
    pqc_cache_destroy(synced);
    pqc_cache_destroy(plain);
    pqc_runtime_destroy(rt);
    remove(path);
    PASS();
}

/* A prefill through the driver on a cache whose rows lie in two parts (a fork and its
   parent, a cache loaded by mapping its file) hands the engine every token's rows in one
   run per head, as documented: count[h] rows, row t the token t's. */
TEST driver_prefill_views_hold_every_token_of_forks_and_loads(void)
{
    pqc_cache_desc cd = small_desc(2, 2, 2, 16);
    pqc_cache *p = NULL, *f = NULL, *m = NULL;
    pqc_engine e;
    eng en;
    char path[512];
    cd.kv_dtype = PQC_F32;
    tu_tmp_path(path, sizeof path, "driver_parts");
    eng_init(&e, &en, 2, 2, 16);
    en.check_rows = 1;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &p));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(p, &e, 0, 120));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p, &f));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(f, &e, 120, 40));  /* the child's second turn */
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(p, &e, 120, 30));  /* the parent's */
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(f, &e, 160));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(f, &e, 161, 9));   /* after a decode step */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(p, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &m));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(m, &e, 150, 20));  /* a resumed conversation */
    remove(path);
    /* 2 layers x 2 heads: 120, 160, 150, 170, 170 rows */
    ASSERT_EQ_FMT(4L * (120 + 160 + 150 + 170 + 170), en.rows_read, "%ld");
    ASSERT_EQ_FMT(0L, en.rows_wrong, "%ld");
    pqc_cache_destroy(m);
    pqc_cache_destroy(f);
    pqc_cache_destroy(p);
    PASS();
}

TEST driver_refuses_layers_of_unequal_length(void)
{
    pqc_cache_desc cd = small_desc(2, 1, 1, 8);
    pqc_cache *c;
    pqc_engine e;
    eng en;
    float *k = tu_uniform_rows(&g_rng, 20, 8), *v = tu_uniform_rows(&g_rng, 20, 8);
    eng_init(&e, &en, 1, 1, 8);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 17));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 1, k, v, 16));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_driver_decode(c, &e, 17));
    ASSERT(strstr(pqc_last_error(), "layer 1 holds 16") != NULL);
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_driver_prefill(c, &e, 17, 4));
    ASSERT_EQ(0L, en.attends); /* refused before any callback */
    ASSERT_EQ(17u, pqc_cache_tokens(c, 0));
    pqc_cache_destroy(c);
    free(k);
    free(v);
    PASS();
}

/* ----- worker errors reach the caller ------------------------------------------------ */

static volatile int g_fail_scratch;
static void *scratch_fail_alloc(size_t n, void *u)
{
    (void)u;
    if (g_fail_scratch && n >= 4096) return NULL;
    return malloc(n);
}

TEST select_failing_on_a_worker_reports_its_message(void)
{
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_cache_desc cd = small_desc(1, 4, 4, 16);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_uniform_rows(&g_rng, 3000, 64), *v = tu_uniform_rows(&g_rng, 3000, 64), q[64];
    size_t i;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = 2;
    rd.allocator.alloc = scratch_fail_alloc;
    rd.allocator.free = tu_free;
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
    cd.max_tokens = 3500;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 3000));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    for (i = 0; i < 64; i++) q[i] = tu_uniform(&g_rng);
    g_fail_scratch = 1; /* the heads' search scratch cannot be had */
    ASSERT_EQ(PQC_ERROR_OUT_OF_MEMORY, pqc_cache_select(c, 0, q, &sel));
    g_fail_scratch = 0;
    ASSERT(pqc_last_error()[0] != 0);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST batch_refuses_one_cache_twice(void)
{
    pqc_runtime *rt;
    pqc_runtime_desc rd;
    pqc_cache_desc cd = small_desc(1, 1, 1, 8);
    pqc_cache *c, *cs[2];
    pqc_selection sel, *sels[2];
    float *k = tu_uniform_rows(&g_rng, 100, 8), *v = tu_uniform_rows(&g_rng, 100, 8), q[8] = { 0 };
    const float *qs[2];
    memset(&rd, 0, sizeof rd);
    rd.n_threads = 2;
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill(c, 0, k, v, 100));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    cs[0] = cs[1] = c;
    qs[0] = qs[1] = q;
    sels[0] = sels[1] = &sel;
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_batch_select(cs, 2, 0, qs, sels));
    ASSERT(strstr(pqc_last_error(), "also sequence") != NULL);
    ASSERT_EQ(PQC_SUCCESS, pqc_batch_select(cs, 1, 0, qs, sels));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_batch_select(cs, 1, 3, qs, sels));
    ASSERT(strstr(pqc_last_error(), "layer 3") != NULL); /* the worker's message reaches the caller */
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

SUITE(contract)
{
    RUN_TEST(batch_refuses_one_cache_twice);
    RUN_TEST(resolved_configuration_names_its_defaults_and_each_rule);
    RUN_TEST(default_codes_follow_the_keys_width);
    RUN_TEST(fetch_with_fewer_tokens_than_sinks_stays_in_bounds);
    RUN_TEST(fetch_on_a_layer_without_prefill_is_refused);
    RUN_TEST(selection_count_beyond_capacity_is_refused);
    RUN_TEST(selection_is_sized_by_the_sequence_and_grows);
    RUN_TEST(huge_code_capacity_is_refused);
    RUN_TEST(matrices_too_large_to_address_are_refused);
    RUN_TEST(exact_search_refuses_keys_without_a_ranking);
    RUN_TEST(prefill_with_k_and_v_of_different_dtypes);
    RUN_TEST(block_cache_size_overflow_is_refused);
    RUN_TEST(values_beyond_the_storage_range_are_refused_before_storing);
    RUN_TEST(huge_budget_gives_a_sane_window);
    RUN_TEST(scheduler_refuses_samples_that_would_break_the_fit);
    RUN_TEST(scheduler_iterations_stay_within_the_pq_limit);
    RUN_TEST(calibration_files_are_regular_files_only);
    RUN_TEST(quantizer_files_round_trip);
    RUN_TEST(quantizer_file_damage_is_refused);
    RUN_TEST(loaded_calibration_sets_t_on_every_layer);
    RUN_TEST(failed_driver_calls_give_back_their_tokens);
    RUN_TEST(failed_driver_steps_leave_nothing_behind);
    RUN_TEST(a_save_changes_a_cache_as_a_sync_does);
    RUN_TEST(driver_prefill_views_hold_every_token_of_forks_and_loads);
    RUN_TEST(driver_refuses_layers_of_unequal_length);
    RUN_TEST(select_failing_on_a_worker_reports_its_message);
    RUN_TEST(failed_calls_change_nothing_at_every_allocation_inline);
    RUN_TEST(failed_calls_change_nothing_at_every_allocation_threaded);
    RUN_TEST(selections_do_not_depend_on_the_thread_count);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(contract);
    GREATEST_MAIN_END();
}
#endif
