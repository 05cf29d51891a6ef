/* Recorded behaviour: what fixed programs select, and the bytes of a cache file, as an
   earlier build made them (the digests below and tests/data/golden.pqc); and a file saved
   by a build before the defaults moved (tests/data/golden_v1.pqc: window = half the
   budget), which must still decode on as it did. A change that moves one selected token
   or one byte of the file format fails here. Where a change of behaviour is meant, record
   again and say why in the commit (golden_v1.pqc stays; its digest moves only with a
   meant change to the selection rule the file's settings ask for):
       make build/test_golden && PQC_GOLDEN_RECORD=tests/data/golden.pqc build/test_golden
   prints the new digests (paste them below) and writes the file. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN_FILE "tests/data/golden.pqc"
#define GOLDEN_V1_FILE "tests/data/golden_v1.pqc"
#define GOLDEN_V1_DIGEST 0xa891b4383e1ef57full /* program 1 decoding on from it */
#define N_PROGRAMS 7
#define PROMPT 320
#define STEPS 60
#define SAVE_AT 30 /* the file holds program 1 after this many decode steps */

/* FNV-1a 64 of what a program selected: layer, counts, indices, step by step */
static const uint64_t recorded[N_PROGRAMS + 1] = {
    0x6ce03e983b68f2a1ull, 0x4283197f9aef044aull, 0xd5d7b9ac73e3d789ull, /* programs 0-2 */
    0x19c18978a9cb568cull, 0x3db84241a7dfe086ull,                      /* programs 3-4 */
    0x565823669f4ecc87ull,                                             /* program 5 */
    0xfd85205e2bbe21b6ull,                                             /* program 6 */
    0x3274774ac126e46aull /* program 1 decoding on from the file */
};

static uint64_t g_rng;
static uint64_t rnd(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static float unif(void) { return (float)((rnd() >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f; }

static void fnv(uint64_t *h, uint64_t v)
{
    int i;
    for (i = 0; i < 8; i++) *h = (*h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;
}

/* n rows of clustered keys (8 centres per row shape, plus noise), values, queries */
static void rows(float *x, size_t n, size_t cols, const float *centres)
{
    size_t i, e;
    for (i = 0; i < n; i++) {
        const float *ce = centres + (rnd() % 8) * cols;
        for (e = 0; e < cols; e++) x[i * cols + e] = ce[e] + 0.3f * unif();
    }
}

static pqc_cache_desc program_desc(int p)
{
    pqc_cache_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 2;
    cd.n_kv_heads = 2;
    cd.n_q_heads = 4;
    cd.head_dim = 16;
    cd.max_tokens = 4096;
    cd.n_sink = 4;
    cd.pq.m = 2;
    cd.pq.bits = 5;
    cd.pq.iters = 4;
    cd.pq.seed = 7;
    cd.block_tokens = 16;
    cd.cache_blocks = 4;
    cd.observe = 16;
    cd.metric = PQC_METRIC_QUERY_DIAG; /* the default's weights when 0-4 were recorded */
    cd.rerank = -1;                    /* the PQ top-k alone, the default when 0-5 were */
    switch (p) {
    case 1: /* fp16 storage, re-ranking, outliers */
        cd.kv_dtype = PQC_F16;
        cd.rerank = 2;
        cd.outliers = 8;
        break;
    case 2: /* residual-aware scores, a fixed split, plain PQ */
        cd.residual_weight = 0.15;
        cd.split = PQC_SPLIT_FIXED;
        cd.metric = PQC_METRIC_L2;
        break;
    case 3: /* summed GQA scores, LRU, rebuilds during decoding */
        cd.gqa = PQC_GQA_SUM;
        cd.policy = PQC_POLICY_LRU;
        cd.rebuild_share = 0.05;
        break;
    case 4: /* a fixed budget, a short window, no sinks */
        cd.budget_tokens = 60;
        cd.recent_share = 0.25;
        cd.n_sink = -1;
        break;
    case 5: /* the default metric: a matrix per sub-space, rope bands, rebuilds */
        cd.metric = PQC_METRIC_QUERY;
        cd.pq.rope = PQC_ROPE_HALF;
        cd.rebuild_share = 0.05;
        break;
    case 6: /* the defaults of selection: 4 sinks, re-ranking 1.5, the query metric */
        cd.n_sink = 0;
        cd.rerank = 0;
        cd.metric = PQC_METRIC_QUERY;
        cd.pq.rope = PQC_ROPE_HALF;
        break;
    default: break;
    }
    return cd;
}

typedef struct {
    float centres[8 * 2 * 16], qcentres[8 * 4 * 16];
    float k[PROMPT * 32], v[PROMPT * 32], q[16 * 64];
} program_data;

/* The generator seeded and a program's key and query centres drawn from it */
static void data_start(program_data *pd, uint64_t seed)
{
    size_t i;
    g_rng = seed;
    for (i = 0; i < sizeof pd->centres / sizeof pd->centres[0]; i++) pd->centres[i] = 2.0f * unif();
    for (i = 0; i < sizeof pd->qcentres / sizeof pd->qcentres[0]; i++) pd->qcentres[i] = 2.0f * unif();
}

/* One step of every layer: append a token, select with a query near the keys */
static pqc_result decode_step(pqc_cache *c, program_data *pd, pqc_selection *sel, uint64_t *h)
{
    int l, hh;
    size_t t;
    pqc_result r;
    for (l = 0; l < 2; l++) {
        rows(pd->k, 1, 32, pd->centres);
        rows(pd->v, 1, 32, pd->centres);
        rows(pd->q, 1, 64, pd->qcentres);
        if ((r = pqc_cache_append(c, l, pd->k, pd->v)) != PQC_SUCCESS) return r;
        if ((r = pqc_cache_select(c, l, pd->q, sel)) != PQC_SUCCESS) return r;
        fnv(h, (uint64_t)l);
        for (hh = 0; hh < 2; hh++) {
            fnv(h, sel->count[hh]);
            for (t = 0; t < sel->count[hh]; t++) fnv(h, sel->idx[(size_t)hh * sel->capacity + t]);
        }
    }
    return PQC_SUCCESS;
}

/* Program p: a prompt, its last queries observed, STEPS decode steps; the digest of the
   selections into *h. With save, program 1 is saved after SAVE_AT steps. */
static pqc_result run_program(int p, const char *save, uint64_t *h)
{
    static program_data pd;
    pqc_runtime_desc rd;
    pqc_runtime *rt = NULL;
    pqc_cache_desc cd = program_desc(p);
    pqc_cache *c = NULL;
    pqc_selection sel;
    pqc_result r;
    int l, s;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = 2;
    *h = 0xcbf29ce484222325ull;
    data_start(&pd, 0x9e3779b97f4a7c15ull + (uint64_t)p);
    if ((r = pqc_runtime_create(&rd, &rt)) != PQC_SUCCESS) return r;
    if ((r = pqc_cache_create(rt, &cd, &c)) != PQC_SUCCESS) goto done;
    for (l = 0; l < 2; l++) {
        pqc_matrix km = pqc_matrix_f32(pd.k, PROMPT, 32), vm = pqc_matrix_f32(pd.v, PROMPT, 32);
        rows(pd.k, PROMPT, 32, pd.centres);
        rows(pd.v, PROMPT, 32, pd.centres);
        rows(pd.q, 16, 64, pd.qcentres);
        if ((r = pqc_cache_observe(c, l, pd.q, 16)) != PQC_SUCCESS) goto done;
        if ((r = pqc_cache_prefill(c, l, &km, &vm)) != PQC_SUCCESS) goto done;
    }
    if ((r = pqc_selection_init(c, &sel)) != PQC_SUCCESS) goto done;
    for (s = 0; s < STEPS && r == PQC_SUCCESS; s++) {
        r = decode_step(c, &pd, &sel, h);
        if (r == PQC_SUCCESS && save && s + 1 == SAVE_AT) r = pqc_cache_save(c, save);
    }
    pqc_selection_free(&sel);
done:
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    return r;
}

/* Program 1 decoding on from the file for STEPS - SAVE_AT steps, on data of its own. */
static pqc_result run_from_file(const char *path, uint64_t *h)
{
    static program_data pd;
    pqc_cache_desc cd = program_desc(1);
    pqc_cache *c = NULL;
    pqc_selection sel;
    pqc_result r;
    int s;
    if ((r = pqc_cache_load(NULL, &cd, path, &c)) != PQC_SUCCESS) return r;
    data_start(&pd, 0x51ed270b27ull);
    *h = 0xcbf29ce484222325ull;
    if ((r = pqc_selection_init(c, &sel)) == PQC_SUCCESS) {
        for (s = SAVE_AT; s < STEPS && r == PQC_SUCCESS; s++) r = decode_step(c, &pd, &sel, h);
        pqc_selection_free(&sel);
    }
    pqc_cache_destroy(c);
    return r;
}

/* Every program selects what the recorded build selected, step by step. */
TEST selections_are_the_recorded_ones(void)
{
    int p;
    for (p = 0; p < N_PROGRAMS; p++) {
        uint64_t h;
        ASSERT_EQ(PQC_SUCCESS, run_program(p, NULL, &h));
        if (h != recorded[p]) {
            fprintf(stderr, "program %d: selections digest 0x%016llxull, recorded 0x%016llxull\n", p,
                    (unsigned long long)h, (unsigned long long)recorded[p]);
            FAILm("a program selects other tokens than the recorded build");
        }
    }
    PASS();
}

/* The recorded build's file loads and decodes on as recorded, and a cache saved now is
   the same file, byte for byte. */
TEST the_recorded_file_loads_and_saving_writes_it_again(void)
{
    char path[512];
    uint64_t h;
    long n_old, n_new;
    unsigned char *old_b, *new_b;
    tu_tmp_path(path, sizeof path, "golden.pqc");
    ASSERT_EQ(PQC_SUCCESS, run_from_file(GOLDEN_FILE, &h));
    if (h != recorded[N_PROGRAMS]) {
        fprintf(stderr, "from the file: selections digest 0x%016llxull, recorded 0x%016llxull\n",
                (unsigned long long)h, (unsigned long long)recorded[N_PROGRAMS]);
        FAILm("the recorded file decodes on to other selections");
    }
    ASSERT_EQ(PQC_SUCCESS, run_program(1, path, &h));
    old_b = tu_file_image(GOLDEN_FILE, &n_old);
    new_b = tu_file_image(path, &n_new);
    remove(path);
    ASSERT(old_b && new_b);
    ASSERT_EQ(n_old, n_new);
    ASSERT_EQ(0, memcmp(old_b, new_b, (size_t)n_old));
    free(old_b);
    free(new_b);
    PASS();
}

/* A file of the build before the defaults moved loads, keeps its window, and decodes on
   as it did in that build. */
TEST a_file_of_an_earlier_build_decodes_on_as_it_did(void)
{
    uint64_t h;
    pqc_cache_desc cd = program_desc(1);
    pqc_cache *c = NULL;
    cd.metric = PQC_METRIC_QUERY; /* the query metric's weights were its default then: the message says so */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_load(NULL, &cd, GOLDEN_V1_FILE, &c));
    ASSERT(strstr(pqc_last_error(), "PQC_METRIC_QUERY_DIAG") != NULL);
    ASSERT(c == NULL);
    ASSERT_EQ(PQC_SUCCESS, run_from_file(GOLDEN_V1_FILE, &h));
    if (h != GOLDEN_V1_DIGEST) {
        fprintf(stderr, "from %s: selections digest 0x%016llxull, recorded 0x%016llxull\n", GOLDEN_V1_FILE,
                (unsigned long long)h, (unsigned long long)GOLDEN_V1_DIGEST);
        FAILm("a file of an earlier build decodes on to other selections");
    }
    PASS();
}

SUITE(golden)
{
    RUN_TEST(selections_are_the_recorded_ones);
    RUN_TEST(the_recorded_file_loads_and_saving_writes_it_again);
    RUN_TEST(a_file_of_an_earlier_build_decodes_on_as_it_did);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    const char *rec = getenv("PQC_GOLDEN_RECORD");
    if (rec && *rec) { /* record: write the file, print the digests */
        uint64_t h[N_PROGRAMS + 1];
        int p;
        for (p = 0; p < N_PROGRAMS; p++)
            if (run_program(p, p == 1 ? rec : NULL, &h[p]) != PQC_SUCCESS) {
                fprintf(stderr, "program %d failed: %s\n", p, pqc_last_error());
                return 1;
            }
        if (run_from_file(rec, &h[N_PROGRAMS]) != PQC_SUCCESS) {
            fprintf(stderr, "decoding on from %s failed: %s\n", rec, pqc_last_error());
            return 1;
        }
        for (p = 0; p <= N_PROGRAMS; p++) printf("    0x%016llxull,\n", (unsigned long long)h[p]);
        return 0;
    }
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(golden);
    GREATEST_MAIN_END();
}
#endif
