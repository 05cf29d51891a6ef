/* make_passkey.c - a two-layer llama2.c checkpoint, with weights set by hand,
 * that retrieves a passkey planted anywhere in a context of up to 131072
 * tokens (needle in a haystack).
 *
 *   make_passkey OUT.bin [--seq-len N] [--passkey-len n]   write the model
 *   make_passkey --verify OUT.bin [--quick]                write, reload, check
 *   make_passkey --roles                                   token ids of the roles
 *   make_passkey --prompt LEN DEPTH SEED                   a haystack prompt
 *   make_passkey --ref OUT.bin LEN DEPTH SEED              reference logits
 *   --hard with any of these: the harder variant (see THE HARDER VARIANT)
 *
 * Plain C99 (also compiles as C++), libc and libm only.
 *
 * THE PROBLEM
 *
 * The prompt is <s> followed by filler tokens, with the needle K v1 .. vn
 * (n = 4 by default) planted at some depth: K is one of 4 key tokens, the v's
 * are n distinct value tokens out of 28. After the prompt, feeding K as the
 * next token makes the model's greedy output v1; feeding v1 gives v2, and so
 * on: the model emits v1 .. vn. When the needle is not found (for instance
 * when a sparse-attention selector drops it) the model emits <unk> (id 0).
 * The weights do not depend on n; any n in 1..28 works.
 *
 * `--prompt LEN DEPTH SEED` prints four lines:
 *   prompt LEN t0 t1 .. t(LEN-1)     t0 = <s> (1); feed these first
 *   query K                          the next token to feed
 *   answer n v1 .. vn                the expected greedy continuation
 *   needle P                         position of K in the prompt
 * DEPTH is a percentage: the needle starts at 1 + round(DEPTH/100 * (LEN-n-2)),
 * so 0 puts it right after <s> and 100 makes vn the last prompt token. The
 * whole run uses positions 0 .. LEN+n-1, which must be < max_seq_len.
 *
 * Token ids (vocab 64, `--roles` prints them):
 *   0 <unk> (the "not found" answer), 1 <s>, 2 </s> (never produced),
 *   3..31 fillers (29), 32..35 keys (4), 36..63 values (28).
 *   Keys and values are the 32 "content" tokens; content token t owns code
 *   c = t - 32. Only the roles differ, the circuit treats all 32 alike.
 *
 * CHECKPOINT FORMAT
 *
 * llama2.c version 1 (export.py, version1_export), little-endian:
 *   header, 256 bytes: uint32 magic 0x616b3432 ("ak42"), int32 version = 1,
 *   int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
 *   max_seq_len, uint8 shared_classifier, zeros. pqcache extension: float32
 *   rope_theta at byte offset 40 (0 means 10000); here 1e9.
 *   then fp32 tensors, matrices row-major [out][in], in this order:
 *     rms_att      [n_layers][dim]         (attention_norm, every layer)
 *     rms_ffn      [n_layers][dim]         (ffn_norm, every layer)
 *     rms_final    [dim]                   (norm)
 *     embedding    [vocab][dim]            (tok_embeddings)
 *     wq           [n_layers][dim][dim]
 *     wk           [n_layers][n_kv_heads*head_size][dim]
 *     wv           [n_layers][n_kv_heads*head_size][dim]
 *     wo           [n_layers][dim][dim]
 *     w1           [n_layers][hidden_dim][dim]
 *     w2           [n_layers][dim][hidden_dim]
 *     w3           [n_layers][hidden_dim][dim]
 *     wcls         [vocab][dim]            (output; only when not shared)
 * This model: dim 128, hidden_dim 128, 2 layers, 1 head (head_size 128),
 * n_kv_heads 1, vocab 64, max_seq_len 131072 (--seq-len), shared_classifier
 * 0, rope_theta 1e9. The file is 985856 bytes.
 *
 * THE FORWARD PASS IT IS BUILT FOR (llama2.c's run.c)
 *
 *   x = embedding[token]
 *   per layer: xb = rmsnorm(x) * rms_att  (rmsnorm(x) = x / sqrt(mean(x^2) + 1e-5))
 *     q = wq xb, k = wk xb, v = wv xb; RoPE on q and k: pair i of a head
 *     (dims 2i, 2i+1) turns by pos * theta^(-2i/head_size),
 *     (a, b) -> (a cos - b sin, a sin + b cos)
 *     att = softmax over positions 0..pos of q.k / sqrt(head_size)
 *     x += wo (sum att v)
 *     xb = rmsnorm(x) * rms_ffn; x += w2 (silu(w1 xb) * (w3 xb))   (zero here)
 *   logits = wcls (rmsnorm(x) * rms_final)
 *
 * THE CONSTRUCTION (an induction circuit)
 *
 * Residual stream, 128 dims:
 *    0..31  CUR   code of the current token (one-hot; zero for non-content)
 *   32..63  PREV  code of the previous token, written by layer 0
 *   64..95  OUT   code of the retrieved token, written by layer 1
 *   96      ONE   1 in every embedding
 *   97..127 ENERGY  one dim per non-content token (token 31 reuses dim 97 with
 *                 sign -1), so every embedding has norm sqrt(2)
 * All embeddings have the same norm, so RMSNorm scales every token alike at
 * layer 0 (1/rms = 8); without that, layer 0's scores would change per token
 * and it would pick the wrong neighbour.
 *
 * Layer 0, previous-token head. Query and key read only ONE, in RoPE pairs
 * 0..11 (the 12 fastest: theta_i = 1e9^(-2i/128) from 1 down to 0.028 rad per
 * position). Key k_i = g (1, 0), query pre-rotated by one position,
 * q_i = g (cos theta_i, -sin theta_i), g = 3 * 8 after the norm. After RoPE
 * the score of offset d (key at p-d) is (g^2 / sqrt(128)) sum_i cos((d-1)
 * theta_i) = 50.9 * sum_i cos((d-1) theta_i): 611 at d = 1; offsets 0 and 2
 * are 50.5 lower, every offset 3..131071 at least 119 lower (12 pairs are
 * needed: with 10, some offsets near 91000 come within 0.6 units of the
 * peak). The value copies CUR, the output writes it to PREV with unit size.
 * Non-content tokens have no code, so after a filler PREV is zero.
 *
 * Layer 1, content match. Query = 3.5 * CUR, key = 3.5 * PREV, both in head
 * dims 96..127 (RoPE pairs 48..63, the 16 slowest). With theta = 1e9 those
 * pairs turn by at most 1.78e-7 rad per position, 0.023 rad over 131072
 * positions (cos >= 0.9997): matching does not depend on distance. At the
 * decode step of K, the query is code(K) and the only key that matches is
 * the one at the needle's v1 (its PREV holds code(K)); score 46-57. The value
 * copies CUR (so it carries code(v1)) and the output writes it to OUT. Codes
 * are orthonormal, so other content positions score ~0; positions after a
 * filler have a zero key (score 0) and a zero value (they add nothing even
 * when attended). Feeding v_i next matches the needle's v_(i+1), whose PREV
 * is code(v_i).
 *
 * Classifier (not shared with the embedding): content token t reads OUT[c]
 * with weight 4, <unk> reads ONE with weight 0.5, every other row is zero.
 * A hit gives the answer a logit of 22.6-26.1 and <unk> 2.8-3.3; every other
 * logit is ~0. A miss leaves OUT empty: <unk> (3.3-4.0) over logits of ~0.
 *
 * <s> must start the prompt: at position 0 layer 0 can only attend to itself,
 * so a content token there would be its own "previous token".
 *
 * MEASURED (make_passkey --verify; double precision, full attention;
 * 11 depths 0, 10, .., 100% per context; greedy decoding of all n = 4 values)
 *
 *   context  solved  logit margin  right logit  match gap  layer-1 mass   layer-0 mass
 *                    (vs best                   (logits,   off the        off p-1
 *                     wrong)                     needle    needle         (max over
 *                                                vs next)                  positions)
 *      4096  11/11     19.80        22.62        46.18      3.6e-17        2.3e-22
 *      8192  11/11     19.80        22.62        46.18      7.2e-17        2.3e-22
 *     16384  11/11     19.80        22.62        46.18      1.4e-16        2.3e-22
 *     32768  11/11     19.80        22.62        46.18      2.9e-16        2.3e-22
 *     65536  11/11     19.80        22.62        46.17      5.8e-16        2.3e-22
 *    131072  11/11     19.80        22.62        46.17      1.2e-15        2.3e-22
 *
 *   The best wrong token is always <unk>; other content tokens stay below 1e-18.
 *   Layer 0 with the engine's fp32 RoPE (angle = (float)pos * freq) at every
 *   position up to 131071: peak at p-1 at least 50.17 logits above offsets
 *   0 and 2..8 (50.51 in exact arithmetic).
 *   The engine's fp32 forward pass, run literally (O(n^2)) on 2048-token
 *   contexts at 5 depths, solves all and matches the double-precision
 *   logits within 1.3e-6.
 *
 * How --verify computes long contexts exactly. Decode steps are literal:
 * every layer of the query token attends to every position. For the prompt
 * positions, layer 0's pre-RoPE query and key are the same for every token
 * (checked on the loaded weights), so its score depends only on the offset d;
 * its output at p is sum_j w(p-j) v_j / Z(p) with Z(p) = sum_{d=0..p} w(d)
 * from a prefix sum, and v_j is non-zero only at the needle (also checked):
 * the exact full-attention result in O(len). Layer 1's keys and values are
 * then computed at every prompt position. Everything runs on the weights
 * read back from the written file.
 *
 * WHAT A PQ-BASED KV SELECTOR SEES (layer 1, the matching head)
 *
 * - Keys before the needle are exactly zero (their PREV is zero); keys after
 *   it are below 3.3e-21 (layer 0's off-peak leakage). The only non-zero keys
 *   are the n+1 positions right after K, v1, .., vn, each 3.5 * code * (1/rms)
 *   of norm 22.86 (the one after vn, a filler, carries code(vn)). Each lies
 *   along one coordinate of head dims 96..127 (RoPE pairs 48..63; the
 *   rotation leaks at most sin 0.023 into its pair partner), so it is
 *   non-zero in a single PQ sub-space and zero in all others.
 * - The decode step of K produces the query 3.5 * code(K) / rms, norm 28.0
 *   (22.86 when vn is the last prompt token), in the coordinate 96 + (K - 32),
 *   cos >= 0.9997 with the needle key; its score there is 46-57 against 0 for
 *   every filler key.
 * - Filler values are zero in this head: attending to any number of fillers
 *   changes nothing; only selecting the needle position matters. If the
 *   selector drops it, the output is <unk>.
 * - Because almost all keys are identical (zero), a k-means that seeds its
 *   centroids by sampling keys at random can end with only zero centroids and
 *   quantise the needle key to zero; seeding that spreads centroids
 *   (k-means++) or a reserve for outliers keeps it.
 * - Layer 0 needs the immediately preceding position during prefill (its keys
 *   are RoPE "clock" vectors of equal norm; a local window covers it). During
 *   decode, layer 0's output only changes RMSNorm scales and the keys of the
 *   decode positions themselves, not which position is retrieved.
 *
 * THE HARDER VARIANT (--hard)
 *
 * Above, every layer-1 key of a filler is zero, so any quantizer tells the
 * needle apart and the model cannot show what a selector loses. `--hard`
 * (vocabulary 256) gives layer 1 keys shaped like a real model's, on which
 * plain PQ (Euclidean k-means, m = 2, b = 6) loses the needle while full
 * attention still retrieves it at every depth:
 * - 221 fillers (ids 3..31 and 64..255). Filler i has topic g = i mod 8 and a
 *   random unit noise vector: embedding ONE + (topic axis + noise) / sqrt 2 in
 *   residual dims 100..107 and 108..127; norm sqrt 2 as before, so layer 0
 *   and every layer-0 fact above are unchanged. <unk>, <s>, </s> keep their
 *   energy dims 97..99.
 * - Layer-1 key of a filler: along u_g = (codes 4g..4g+3) / 2 in the match
 *   dims with a needle key's norm (22.86 after a filler), plus noise of twice
 *   that norm in head dims 64..95 (RoPE pairs 32..47; an orthonormal image of
 *   the 20 noise dims) that no query reads. Every content token carries a
 *   fixed noise vector of the same norm in the same dims, so the needle's key
 *   has its neighbours' norm (51.1 against <= 56) and sits in their cloud.
 * - Layer-1 query of a filler: along u_g (what the prompt's end looks like to
 *   a selector that observes queries; filler outputs are never read).
 * - The K query scores the needle 46-57 and the fillers of K's topic half of
 *   that (cos 0.5); `--verify` measures a match gap of at least 22.8 logits
 *   and at most 1.9e-6 of the mass off the needle up to 131072 tokens.
 * Why plain PQ fails: in the second sub-space (head dims 64..127) the noise
 * carries four times the variance of the match dims, so Euclidean k-means
 * spends its 64 centroids on the noise; the needle's code lands on a centroid
 * whose match part is an average over fillers, and it scores like them. A
 * codebook weighted by the observed queries (pqcache's default metric) gives
 * the noise dims almost no weight and keeps the needle (examples/tiny_llama/
 * needle.c, `make needle`).
 *
 * WHAT THE ENGINE MUST DO
 *
 * - Read rope_theta from header offset 40 (1e9 here); with 10000 both heads
 *   fail immediately.
 * - Accept positions up to max_seq_len - 1 = 131071 (header).
 *   --seq-len accepts up to 1048576; `--verify --seq-len 1048576 --quick`
 *   solves every case there too (layer 0: fp32 gap >= 48.5 logits, best
 *   offset beyond 2 is 100 logits down; layer 1: the match pairs turn by up
 *   to 0.19 rad, match gap 46.1), using ~1 GB and ~1.5 minutes.
 * - Use the separate classifier (shared_classifier = 0: wcls follows w3).
 * - Subtract the maximum before exp in softmax: layer 0's scores reach 611.
 * - RoPE on interleaved pairs (2i, 2i+1) as above, freq = theta^(-2i/128).
 * - Start prompts with <s> (id 1), as --prompt does.
 */

#if !defined(_POSIX_C_SOURCE) && !defined(__cplusplus)
#define _POSIX_C_SOURCE 200809L
#endif

#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Construction constants                                                    */

#define PK_DIM 128          /* residual width = head size (one head)        */
#define PK_HIDDEN 128       /* FFN width; all FFN weights are zero          */
#define PK_LAYERS 2
#define PK_HEADS 1
#define PK_HEAD_SIZE (PK_DIM / PK_HEADS)
#define PK_VOCAB 64
#define PK_THETA 1e9        /* RoPE base, written at header offset 40       */
#define PK_SEQ_LEN 131072   /* default max_seq_len                          */
#define PK_PASSKEY_LEN 4    /* default number of value tokens               */
#define PK_EPS 1e-5         /* RMSNorm epsilon of the engine                */

/* residual stream layout */
#define R_CUR 0             /* 32 dims: code of the current token           */
#define R_PREV 32           /* 32 dims: code of the previous token (layer 0)*/
#define R_OUT 64            /* 32 dims: retrieved code (layer 1)            */
#define R_ONE 96            /* 1 dim: constant 1 in every embedding         */
#define R_ENERGY 97         /* 31 dims: energy of the code-less tokens      */
#define N_CODE 32
#define N_ENERGY 31

/* vocabulary */
#define TOK_UNK 0           /* "abstain": emitted when nothing is retrieved */
#define TOK_BOS 1
#define TOK_EOS 2
#define FILLER_FIRST 3
#define N_FILLER 29         /* ids 3..31                                    */
#define KEY_FIRST 32
#define N_KEY 4             /* ids 32..35                                   */
#define VALUE_FIRST 36
#define N_VALUE 28          /* ids 36..63                                   */
#define CODE_FIRST KEY_FIRST /* content token t has code t - CODE_FIRST     */

/* gains */
#define PREV_PAIRS 12       /* RoPE pairs 0..11 carry the previous-token head */
#define PREV_GAIN 3.0       /* layer-0 wq/wk weight on the constant dim      */
#define MATCH_GAIN 3.5      /* layer-1 wq (current code) / wk (prev code)    */
#define CLS_GAIN 4.0        /* classifier weight on the retrieved code       */
#define ABSTAIN_GAIN 0.5    /* classifier weight of <unk> on the constant dim */

#define MATCH_HEAD_DIM0 (PK_HEAD_SIZE - N_CODE) /* pairs 48..63 of the head  */

/* the harder variant (--hard) */
#define PK_HARD_VOCAB 256   /* fillers 3..31 and 64..255 (221)              */
#define HARD_TOPICS 8       /* filler topics; topic g owns codes 4g..4g+3   */
#define HARD_TOPIC_DIM0 (R_ENERGY + 3)  /* residual 100..107: topic axis    */
#define HARD_NOISE_DIM0 (HARD_TOPIC_DIM0 + HARD_TOPICS) /* 108..127: noise  */
#define HARD_NOISE_DIMS 20
#define HARD_NOISE_HEAD0 64 /* layer-1 head dims 64..95 carry the noise     */
#define HARD_NOISE_HEAD_DIMS 32
#define HARD_KAPPA 1.0      /* filler match-key norm / needle match-key norm */
#define HARD_NU 2.0         /* noise norm / needle match-key norm            */

/* ------------------------------------------------------------------------ */
/* Model in memory (llama2.c layout: matrices row-major [out][in])           */

typedef struct {
    int dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared;
    float theta;
    float *rms_att;   /* [L][dim]       */
    float *rms_ffn;   /* [L][dim]       */
    float *rms_final; /* [dim]          */
    float *emb;       /* [vocab][dim]   */
    float *wq;        /* [L][dim][dim]  */
    float *wk;        /* [L][kv][dim]   */
    float *wv;        /* [L][kv][dim]   */
    float *wo;        /* [L][dim][dim]  */
    float *w1;        /* [L][hid][dim]  */
    float *w2;        /* [L][dim][hid]  */
    float *w3;        /* [L][hid][dim]  */
    float *wcls;      /* [vocab][dim]   */
} Model;

static int kv_dim(const Model *m) { return m->dim / m->n_heads * m->n_kv_heads; }

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static float *fzeros(size_t n) { return (float *)xcalloc(n, sizeof(float)); }

static void model_alloc(Model *m)
{
    size_t L = (size_t)m->n_layers, d = (size_t)m->dim, h = (size_t)m->hidden;
    size_t kv = (size_t)kv_dim(m), v = (size_t)m->vocab;
    m->rms_att = fzeros(L * d);
    m->rms_ffn = fzeros(L * d);
    m->rms_final = fzeros(d);
    m->emb = fzeros(v * d);
    m->wq = fzeros(L * d * d);
    m->wk = fzeros(L * kv * d);
    m->wv = fzeros(L * kv * d);
    m->wo = fzeros(L * d * d);
    m->w1 = fzeros(L * h * d);
    m->w2 = fzeros(L * d * h);
    m->w3 = fzeros(L * h * d);
    m->wcls = m->shared ? m->emb : fzeros(v * d);
}

static void model_free(Model *m)
{
    free(m->rms_att); free(m->rms_ffn); free(m->rms_final); free(m->wq);
    free(m->wk); free(m->wv); free(m->wo); free(m->w1); free(m->w2); free(m->w3);
    if (!m->shared) free(m->wcls);
    free(m->emb);
    memset(m, 0, sizeof *m);
}

static int is_content(int t) { return t >= CODE_FIRST && t < CODE_FIRST + N_CODE; }

/* Frequency of RoPE pair i (head dims 2i, 2i+1): theta^(-2i/head_size). */
static double rope_freq(double theta, int i, int head_size)
{
    return pow(theta, -2.0 * i / head_size);
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int rng_below(uint64_t *s, int n) { return (int)(rng_next(s) % (uint64_t)n); }

/* Vocabulary of the model in use: PK_VOCAB, or PK_HARD_VOCAB for the harder
   variant (--hard). Prompts draw their fillers from it. */
static int pk_vocab = PK_VOCAB;

static int n_fillers(void) { return N_FILLER + (pk_vocab - PK_VOCAB); }

/* Filler i (0 .. n_fillers()-1): ids 3..31, then 64.. in the harder variant. */
static int filler_token(int i) { return i < N_FILLER ? FILLER_FIRST + i : PK_VOCAB + (i - N_FILLER); }

/* Selects the variant from a checkpoint's vocabulary; -1 when it is neither. */
static int pk_use_vocab(int vocab)
{
    if (vocab != PK_VOCAB && vocab != PK_HARD_VOCAB)
        return -1;
    pk_vocab = vocab;
    return 0;
}

/* A standard normal deviate (Box-Muller) from the generator. */
static double rng_gauss(uint64_t *s)
{
    double u = ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    double v = (double)(rng_next(s) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* A random unit vector of n dims. */
static void rng_unit(uint64_t *s, double *x, int n)
{
    double nn = 0.0;
    int i;
    for (i = 0; i < n; i++) {
        x[i] = rng_gauss(s);
        nn += x[i] * x[i];
    }
    for (i = 0; i < n; i++) x[i] /= sqrt(nn);
}

/* The harder variant: fillers with topics and noise, layer-1 keys no longer
   zero (see THE HARDER VARIANT above). Runs after the plain construction. */
static void model_build_hard(Model *m)
{
    const int D = PK_DIM;
    const double rho0 = 1.0 / sqrt(2.0 / D + PK_EPS), rho1 = 1.0 / sqrt(3.0 / D + PK_EPS);
    const double cn = MATCH_GAIN * rho1; /* norm of a needle's match key */
    double basis[HARD_NOISE_HEAD_DIMS][HARD_NOISE_DIMS], u[HARD_NOISE_DIMS];
    float *wq = m->wq + (size_t)D * D, *wk = m->wk + (size_t)D * D;
    uint64_t s = 0x5eed0fa11e75ull;
    int t, i, j, g, c;

    /* an orthonormal map of the 20 noise energy dims into head dims 64..95 */
    for (j = 0; j < HARD_NOISE_DIMS; j++) {
        int jj;
        double nn = 0.0;
        for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) basis[i][j] = rng_gauss(&s);
        for (jj = 0; jj < j; jj++) { /* Gram-Schmidt */
            double dot = 0.0;
            for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) dot += basis[i][j] * basis[i][jj];
            for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) basis[i][j] -= dot * basis[i][jj];
        }
        for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) nn += basis[i][j] * basis[i][j];
        for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) basis[i][j] /= sqrt(nn);
    }

    /* filler embeddings: ONE + (topic axis + unit noise) / sqrt 2, norm sqrt 2 */
    for (t = 0; t < n_fillers(); t++) {
        float *e = m->emb + (size_t)filler_token(t) * D;
        memset(e, 0, (size_t)D * sizeof(float));
        e[R_ONE] = 1.0f;
        e[HARD_TOPIC_DIM0 + t % HARD_TOPICS] = (float)(1.0 / sqrt(2.0));
        rng_unit(&s, u, HARD_NOISE_DIMS);
        for (j = 0; j < HARD_NOISE_DIMS; j++) e[HARD_NOISE_DIM0 + j] = (float)(u[j] / sqrt(2.0));
    }

    /* layer 1: topic g -> key and query along u_g = (sum of codes 4g..4g+3) / 2
       in the match dims, key norm HARD_KAPPA * cn after a filler */
    for (g = 0; g < HARD_TOPICS; g++)
        for (c = 4 * g; c < 4 * g + 4; c++) {
            float w = (float)(HARD_KAPPA * cn * 0.5 * sqrt(2.0) / rho0);
            wk[(size_t)(MATCH_HEAD_DIM0 + c) * D + HARD_TOPIC_DIM0 + g] = w;
            wq[(size_t)(MATCH_HEAD_DIM0 + c) * D + HARD_TOPIC_DIM0 + g] = w;
        }
    /* noise: filler noise (norm HARD_NU * cn after a filler) and a fixed noise
       direction per content token in the same sub-space (norm HARD_NU * cn at
       a needle position, where 1/rms is rho1) */
    for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++)
        for (j = 0; j < HARD_NOISE_DIMS; j++)
            wk[(size_t)(HARD_NOISE_HEAD0 + i) * D + HARD_NOISE_DIM0 + j] =
                (float)(HARD_NU * cn * sqrt(2.0) / rho0 * basis[i][j]);
    for (c = 0; c < N_CODE; c++) {
        rng_unit(&s, u, HARD_NOISE_DIMS);
        for (i = 0; i < HARD_NOISE_HEAD_DIMS; i++) {
            double b = 0.0;
            for (j = 0; j < HARD_NOISE_DIMS; j++) b += basis[i][j] * u[j];
            wk[(size_t)(HARD_NOISE_HEAD0 + i) * D + R_CUR + c] = (float)(HARD_NU * cn / rho1 * b);
        }
    }
}

static void model_build(Model *m, int seq_len)
{
    const int D = PK_DIM;
    const double rho0 = 1.0 / sqrt(2.0 / D + PK_EPS); /* 1/rms at layer 0 */
    const double rho1 = 1.0 / sqrt(3.0 / D + PK_EPS); /* 1/rms, needle keys */
    float *wq, *wk, *wv, *wo;
    int t, i, k;

    memset(m, 0, sizeof *m);
    m->dim = D;
    m->hidden = PK_HIDDEN;
    m->n_layers = PK_LAYERS;
    m->n_heads = PK_HEADS;
    m->n_kv_heads = PK_HEADS;
    m->vocab = pk_vocab;
    m->seq_len = seq_len;
    m->shared = 0;
    m->theta = (float)PK_THETA;
    model_alloc(m);

    for (i = 0; i < PK_LAYERS * D; i++) m->rms_att[i] = m->rms_ffn[i] = 1.0f;
    for (i = 0; i < D; i++) m->rms_final[i] = 1.0f;

    /* Embeddings: every token has norm sqrt(2): 1 on the constant dim plus
     * either its code (content tokens) or one energy dim (the rest). */
    for (t = 0; t < PK_VOCAB; t++) {
        float *e = m->emb + (size_t)t * D;
        e[R_ONE] = 1.0f;
        if (is_content(t))
            e[R_CUR + (t - CODE_FIRST)] = 1.0f;
        else if (t < N_ENERGY)
            e[R_ENERGY + t] = 1.0f;
        else
            e[R_ENERGY + t % N_ENERGY] = -1.0f;
    }

    /* Layer 0: previous-token head. */
    wq = m->wq; wk = m->wk; wv = m->wv; wo = m->wo;
    for (i = 0; i < PREV_PAIRS; i++) {
        double f = rope_freq(PK_THETA, i, PK_HEAD_SIZE);
        wq[(size_t)(2 * i) * D + R_ONE] = (float)(PREV_GAIN * cos(f));
        wq[(size_t)(2 * i + 1) * D + R_ONE] = (float)(-PREV_GAIN * sin(f));
        wk[(size_t)(2 * i) * D + R_ONE] = (float)PREV_GAIN;
    }
    for (k = 0; k < N_CODE; k++) {
        wv[(size_t)k * D + R_CUR + k] = 1.0f;
        wo[(size_t)(R_PREV + k) * D + k] = (float)(1.0 / rho0);
    }

    /* Layer 1: content match in the lowest-frequency pairs. */
    wq += (size_t)D * D; wk += (size_t)D * D; wv += (size_t)D * D; wo += (size_t)D * D;
    for (k = 0; k < N_CODE; k++) {
        wq[(size_t)(MATCH_HEAD_DIM0 + k) * D + R_CUR + k] = (float)MATCH_GAIN;
        wk[(size_t)(MATCH_HEAD_DIM0 + k) * D + R_PREV + k] = (float)MATCH_GAIN;
        wv[(size_t)k * D + R_CUR + k] = 1.0f;
        wo[(size_t)(R_OUT + k) * D + k] = (float)(1.0 / rho1);
    }

    /* Classifier: content tokens read the retrieved code, <unk> reads the
     * constant dim (a small fixed logit that wins when nothing is found). */
    for (k = 0; k < N_CODE; k++)
        m->wcls[(size_t)(CODE_FIRST + k) * D + R_OUT + k] = (float)CLS_GAIN;
    m->wcls[(size_t)TOK_UNK * D + R_ONE] = (float)ABSTAIN_GAIN;
    if (pk_vocab != PK_VOCAB)
        model_build_hard(m);
}

/* ------------------------------------------------------------------------ */
/* Checkpoint I/O (little-endian)                                           */

static void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v & 0xff);
    p[1] = (unsigned char)((v >> 8) & 0xff);
    p[2] = (unsigned char)((v >> 16) & 0xff);
    p[3] = (unsigned char)((v >> 24) & 0xff);
}

static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int32_t get_i32(const unsigned char *p)
{
    uint32_t u = get_u32(p);
    int32_t i;
    memcpy(&i, &u, sizeof i);
    return i;
}

static void put_i32(unsigned char *p, int32_t v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    put_u32(p, u);
}

static int write_floats(FILE *f, const float *x, size_t n)
{
    unsigned char buf[4096];
    size_t i = 0;
    while (i < n) {
        size_t j, c = n - i < 1024 ? n - i : 1024;
        for (j = 0; j < c; j++) put_u32(buf + 4 * j, f32_bits(x[i + j]));
        if (fwrite(buf, 4, c, f) != c) return -1;
        i += c;
    }
    return 0;
}

/* The tensor list in version-1 order, with element counts. */
typedef struct {
    float *p;
    size_t n;
} Tensor;

static int model_tensors(Model *m, Tensor *t)
{
    size_t L = (size_t)m->n_layers, d = (size_t)m->dim, h = (size_t)m->hidden;
    size_t kv = (size_t)kv_dim(m), v = (size_t)m->vocab;
    int n = 0;
    t[n].p = m->rms_att; t[n++].n = L * d;
    t[n].p = m->rms_ffn; t[n++].n = L * d;
    t[n].p = m->rms_final; t[n++].n = d;
    t[n].p = m->emb; t[n++].n = v * d;
    t[n].p = m->wq; t[n++].n = L * d * d;
    t[n].p = m->wk; t[n++].n = L * kv * d;
    t[n].p = m->wv; t[n++].n = L * kv * d;
    t[n].p = m->wo; t[n++].n = L * d * d;
    t[n].p = m->w1; t[n++].n = L * h * d;
    t[n].p = m->w2; t[n++].n = L * d * h;
    t[n].p = m->w3; t[n++].n = L * h * d;
    if (!m->shared) {
        t[n].p = m->wcls; t[n++].n = v * d;
    }
    return n;
}

static int model_write(Model *m, const char *path)
{
    unsigned char hdr[256];
    Tensor t[12];
    int i, n;
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot open %s for writing\n", path);
        return -1;
    }
    memset(hdr, 0, sizeof hdr);
    put_u32(hdr + 0, 0x616b3432u);
    put_i32(hdr + 4, 1);
    put_i32(hdr + 8, m->dim);
    put_i32(hdr + 12, m->hidden);
    put_i32(hdr + 16, m->n_layers);
    put_i32(hdr + 20, m->n_heads);
    put_i32(hdr + 24, m->n_kv_heads);
    put_i32(hdr + 28, m->vocab);
    put_i32(hdr + 32, m->seq_len);
    hdr[36] = (unsigned char)(m->shared ? 1 : 0);
    put_u32(hdr + 40, f32_bits(m->theta));
    if (fwrite(hdr, 1, sizeof hdr, f) != sizeof hdr) goto fail;
    n = model_tensors(m, t);
    for (i = 0; i < n; i++)
        if (write_floats(f, t[i].p, t[i].n)) goto fail;
    if (fclose(f)) {
        fprintf(stderr, "error writing %s\n", path);
        return -1;
    }
    return 0;
fail:
    fclose(f);
    fprintf(stderr, "error writing %s\n", path);
    return -1;
}

/* Opens a checkpoint for reading. Only a regular file is read: the open does
   not block (a named pipe without a writer would wait forever) and anything
   else (directory, device, pipe) is refused. NULL after a message. */
static FILE *open_regular(const char *path, off_t *size)
{
    struct stat st;
    FILE *f;
    int fd = open(path, O_RDONLY | O_NONBLOCK), flags;
    if (fd < 0) {
        fprintf(stderr, "cannot open %s\n", path);
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "%s is not a regular file\n", path);
        close(fd);
        return NULL;
    }
    flags = fcntl(fd, F_GETFL);
    if (flags == -1 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == -1 ||
        !(f = fdopen(fd, "rb"))) {
        fprintf(stderr, "cannot read %s\n", path);
        close(fd);
        return NULL;
    }
    *size = st.st_size;
    return f;
}

/* a * b + c, clearing *ok when it does not fit in size_t */
static size_t mul_add(size_t a, size_t b, size_t c, int *ok)
{
    if (a != 0 && b > ((size_t)-1 - c) / a) {
        *ok = 0;
        return 0;
    }
    return a * b + c;
}

/* Bytes of a version-1 checkpoint with m's header; 0 if that overflows. */
static size_t model_file_size(const Model *m)
{
    size_t L = (size_t)m->n_layers, d = (size_t)m->dim, h = (size_t)m->hidden;
    size_t kv = (size_t)kv_dim(m), v = (size_t)m->vocab, n = 0;
    int ok = 1, i;
    n = mul_add(mul_add(2, L, 1, &ok), d, n, &ok);   /* RMSNorm weights */
    for (i = 0; i < (m->shared ? 1 : 2); i++)
        n = mul_add(v, d, n, &ok);                   /* embedding, classifier */
    for (i = 0; i < 2; i++) {
        n = mul_add(mul_add(L, d, 0, &ok), d, n, &ok);  /* wq, wo */
        n = mul_add(mul_add(L, kv, 0, &ok), d, n, &ok); /* wk, wv */
    }
    for (i = 0; i < 3; i++)
        n = mul_add(mul_add(L, h, 0, &ok), d, n, &ok);  /* w1, w2, w3 */
    n = mul_add(n, 4, 256, &ok);
    return ok ? n : 0;
}

static int model_read(Model *m, const char *path)
{
    unsigned char hdr[256], buf[4096];
    Tensor t[12];
    int i, n;
    off_t size = 0;
    FILE *f = open_regular(path, &size);
    memset(m, 0, sizeof *m);
    if (!f)
        return -1;
    if (fread(hdr, 1, sizeof hdr, f) != sizeof hdr || get_u32(hdr) != 0x616b3432u ||
        get_i32(hdr + 4) != 1) {
        fprintf(stderr, "%s: not a version-1 checkpoint\n", path);
        fclose(f);
        return -1;
    }
    m->dim = get_i32(hdr + 8);
    m->hidden = get_i32(hdr + 12);
    m->n_layers = get_i32(hdr + 16);
    m->n_heads = get_i32(hdr + 20);
    m->n_kv_heads = get_i32(hdr + 24);
    m->vocab = get_i32(hdr + 28);
    m->seq_len = get_i32(hdr + 32);
    m->shared = hdr[36] != 0;
    m->theta = bits_f32(get_u32(hdr + 40));
    if (m->theta == 0.0f) m->theta = 10000.0f;
    if (m->dim <= 0 || m->n_heads <= 0 || m->dim % m->n_heads || m->n_kv_heads <= 0 ||
        m->n_heads % m->n_kv_heads || m->hidden <= 0 || m->n_layers <= 0 ||
        m->vocab <= 0 || m->seq_len <= 0) {
        fprintf(stderr, "%s: bad header\n", path);
        fclose(f);
        return -1;
    }
    {   /* the size before any allocation: a header may claim anything */
        size_t want = model_file_size(m);
        if (want == 0 || (uintmax_t)size != (uintmax_t)want) {
            if (want == 0)
                fprintf(stderr, "%s: bad header (its sizes overflow)\n", path);
            else
                fprintf(stderr, "%s: %s (the header needs %zu bytes, the file has %jd)\n",
                        path, (uintmax_t)size > (uintmax_t)want ? "trailing bytes" : "truncated",
                        want, (intmax_t)size);
            fclose(f);
            memset(m, 0, sizeof *m);
            return -1;
        }
    }
    model_alloc(m);
    n = model_tensors(m, t);
    for (i = 0; i < n; i++) {
        size_t k = 0;
        while (k < t[i].n) {
            size_t j, c = t[i].n - k < 1024 ? t[i].n - k : 1024;
            if (fread(buf, 4, c, f) != c) {
                fprintf(stderr, "%s: truncated\n", path);
                fclose(f);
                model_free(m);
                return -1;
            }
            for (j = 0; j < c; j++) t[i].p[k + j] = bits_f32(get_u32(buf + 4 * j));
            k += c;
        }
    }
    if (fread(buf, 1, 1, f) != 0) {
        fprintf(stderr, "%s: trailing bytes\n", path);
        fclose(f);
        model_free(m);
        return -1;
    }
    fclose(f);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Prompts                                                                   */

/* Prompt of len tokens: <s>, fillers, and the needle K v1..vn starting at
 * 1 + round(depth/100 * (len - n - 2)). Returns the needle position. */
static int make_prompt(int len, double depth_pct, uint64_t seed, int n, int *toks,
                       int *query, int *answer)
{
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 12345u;
    int vals[N_VALUE];
    int i, pos, room = len - n - 2;
    if (depth_pct < 0) depth_pct = 0;
    if (depth_pct > 100) depth_pct = 100;
    pos = 1 + (int)floor(depth_pct / 100.0 * room + 0.5);
    *query = KEY_FIRST + rng_below(&s, N_KEY);
    for (i = 0; i < N_VALUE; i++) vals[i] = VALUE_FIRST + i;
    for (i = 0; i < n; i++) { /* partial Fisher-Yates: n distinct values */
        int j = i + rng_below(&s, N_VALUE - i), tmp = vals[i];
        vals[i] = vals[j];
        vals[j] = tmp;
        answer[i] = vals[i];
    }
    toks[0] = TOK_BOS;
    for (i = 1; i < len; i++) toks[i] = filler_token(rng_below(&s, n_fillers()));
    toks[pos] = *query;
    for (i = 0; i < n; i++) toks[pos + 1 + i] = answer[i];
    return pos;
}

/* ------------------------------------------------------------------------ */
/* Reference 1: the engine's forward pass, literally, in fp32               */

typedef struct {
    const Model *m;
    int cap;
    float *x, *xb, *xb2, *hb, *hb2, *q, *att, *logits;
    float *kc, *vc; /* [L][cap][kv] */
} Fp32;

static void fp32_init(Fp32 *r, const Model *m, int cap)
{
    size_t kv = (size_t)kv_dim(m);
    r->m = m;
    r->cap = cap;
    r->x = fzeros((size_t)m->dim);
    r->xb = fzeros((size_t)m->dim);
    r->xb2 = fzeros((size_t)m->dim);
    r->hb = fzeros((size_t)m->hidden);
    r->hb2 = fzeros((size_t)m->hidden);
    r->q = fzeros((size_t)m->dim);
    r->att = fzeros((size_t)m->n_heads * (size_t)cap);
    r->logits = fzeros((size_t)m->vocab);
    r->kc = fzeros((size_t)m->n_layers * (size_t)cap * kv);
    r->vc = fzeros((size_t)m->n_layers * (size_t)cap * kv);
}

static void fp32_free(Fp32 *r)
{
    free(r->x); free(r->xb); free(r->xb2); free(r->hb); free(r->hb2); free(r->q);
    free(r->att); free(r->logits); free(r->kc); free(r->vc);
}

static void rmsnorm_f(float *o, const float *x, const float *w, int n)
{
    float ss = 0.0f;
    int j;
    for (j = 0; j < n; j++) ss += x[j] * x[j];
    ss = 1.0f / sqrtf(ss / (float)n + 1e-5f);
    for (j = 0; j < n; j++) o[j] = w[j] * (ss * x[j]);
}

static void matmul_f(float *o, const float *x, const float *w, int n, int d)
{
    int i, j;
    for (i = 0; i < d; i++) {
        float v = 0.0f;
        for (j = 0; j < n; j++) v += w[(size_t)i * n + j] * x[j];
        o[i] = v;
    }
}

/* One token at position pos; att0/att1 receive the attention weights of
 * head 0 of layers 0 and 1 when not NULL. Returns the logits. */
static float *fp32_forward(Fp32 *r, int token, int pos, float *att0, float *att1)
{
    const Model *m = r->m;
    int D = m->dim, hs = m->dim / m->n_heads, kvd = kv_dim(m);
    int mul = m->n_heads / m->n_kv_heads, l, i, h, t;
    memcpy(r->x, m->emb + (size_t)token * D, (size_t)D * sizeof(float));
    for (l = 0; l < m->n_layers; l++) {
        size_t lo = (size_t)l * r->cap * kvd;
        float *k = r->kc + lo + (size_t)pos * kvd, *v = r->vc + lo + (size_t)pos * kvd;
        rmsnorm_f(r->xb, r->x, m->rms_att + (size_t)l * D, D);
        matmul_f(r->q, r->xb, m->wq + (size_t)l * D * D, D, D);
        matmul_f(k, r->xb, m->wk + (size_t)l * kvd * D, D, kvd);
        matmul_f(v, r->xb, m->wv + (size_t)l * kvd * D, D, kvd);
        for (i = 0; i < D; i += 2) {
            int hd = i % hs;
            float freq = 1.0f / powf(m->theta, (float)hd / (float)hs);
            float val = (float)pos * freq, fcr = cosf(val), fci = sinf(val);
            float a = r->q[i], b = r->q[i + 1];
            r->q[i] = a * fcr - b * fci;
            r->q[i + 1] = a * fci + b * fcr;
            if (i < kvd) {
                a = k[i];
                b = k[i + 1];
                k[i] = a * fcr - b * fci;
                k[i + 1] = a * fci + b * fcr;
            }
        }
        for (h = 0; h < m->n_heads; h++) {
            float *q = r->q + (size_t)h * hs, *att = r->att + (size_t)h * r->cap;
            float *xo = r->xb + (size_t)h * hs, mx, sum = 0.0f;
            size_t ko = (size_t)(h / mul) * hs;
            for (t = 0; t <= pos; t++) {
                const float *kt = r->kc + lo + (size_t)t * kvd + ko;
                float s = 0.0f;
                for (i = 0; i < hs; i++) s += q[i] * kt[i];
                att[t] = s / sqrtf((float)hs);
            }
            mx = att[0];
            for (t = 1; t <= pos; t++) mx = att[t] > mx ? att[t] : mx;
            for (t = 0; t <= pos; t++) {
                att[t] = expf(att[t] - mx);
                sum += att[t];
            }
            for (t = 0; t <= pos; t++) att[t] /= sum;
            memset(xo, 0, (size_t)hs * sizeof(float));
            for (t = 0; t <= pos; t++) {
                const float *vt = r->vc + lo + (size_t)t * kvd + ko;
                for (i = 0; i < hs; i++) xo[i] += att[t] * vt[i];
            }
            if (h == 0 && l == 0 && att0) memcpy(att0, att, (size_t)(pos + 1) * sizeof(float));
            if (h == 0 && l == 1 && att1) memcpy(att1, att, (size_t)(pos + 1) * sizeof(float));
        }
        matmul_f(r->xb2, r->xb, m->wo + (size_t)l * D * D, D, D);
        for (i = 0; i < D; i++) r->x[i] += r->xb2[i];
        rmsnorm_f(r->xb, r->x, m->rms_ffn + (size_t)l * D, D);
        matmul_f(r->hb, r->xb, m->w1 + (size_t)l * m->hidden * D, D, m->hidden);
        matmul_f(r->hb2, r->xb, m->w3 + (size_t)l * m->hidden * D, D, m->hidden);
        for (i = 0; i < m->hidden; i++) {
            float g = r->hb[i];
            r->hb[i] = g * (1.0f / (1.0f + expf(-g))) * r->hb2[i];
        }
        matmul_f(r->xb, r->hb, m->w2 + (size_t)l * D * m->hidden, m->hidden, D);
        for (i = 0; i < D; i++) r->x[i] += r->xb[i];
    }
    rmsnorm_f(r->x, r->x, m->rms_final, D);
    matmul_f(r->logits, r->x, m->wcls, D, m->vocab);
    return r->logits;
}

/* ------------------------------------------------------------------------ */
/* Reference 2: the same math in double precision, for contexts up to       */
/* max_seq_len. Decode steps are computed literally over every position.    */
/* Over the prompt, layer 0's scores depend only on the offset (every token */
/* gives the same pre-RoPE query and key; this is checked), so its output  */
/* at position p is sum_j w(p-j) v_j / Z(p) over the few positions whose   */
/* value is non-zero, with Z(p) = sum_{d=0..p} w(d) from a prefix sum: the */
/* exact full-attention result in O(len) instead of O(len^2).              */

typedef struct {
    int rows, cols;
    int *ptr, *col;
    double *val;
} Csr;

static void csr_make(Csr *c, const float *w, int rows, int cols)
{
    int i, j, nnz = 0;
    for (i = 0; i < rows * cols; i++) nnz += w[i] != 0.0f;
    c->rows = rows;
    c->cols = cols;
    c->ptr = (int *)xcalloc((size_t)rows + 1, sizeof(int));
    c->col = (int *)xcalloc((size_t)nnz, sizeof(int));
    c->val = (double *)xcalloc((size_t)nnz, sizeof(double));
    nnz = 0;
    for (i = 0; i < rows; i++) {
        for (j = 0; j < cols; j++) {
            float v = w[(size_t)i * cols + j];
            if (v != 0.0f) {
                c->col[nnz] = j;
                c->val[nnz++] = v;
            }
        }
        c->ptr[i + 1] = nnz;
    }
}

static void csr_free(Csr *c)
{
    free(c->ptr);
    free(c->col);
    free(c->val);
}

static void csr_mv(double *o, const Csr *c, const double *x)
{
    int i, k;
    for (i = 0; i < c->rows; i++) {
        double s = 0.0;
        for (k = c->ptr[i]; k < c->ptr[i + 1]; k++) s += c->val[k] * x[c->col[k]];
        o[i] = s;
    }
}

static int csr_row_nonzero(const Csr *c, int i) { return c->ptr[i + 1] > c->ptr[i]; }

#define MAXL 8

typedef struct {
    const Model *m;
    int D, hs, kvd, cap;
    Csr wq[MAXL], wk[MAXL], wv[MAXL], wo[MAXL], w1[MAXL], w2[MAXL], w3[MAXL], cls;
    /* active kv dims per layer (RoPE-pair closed for keys) and caches */
    int nk[MAXL], nv[MAXL];
    int *kd[MAXL], *vd[MAXL];
    double *kc[MAXL], *vc[MAXL]; /* [cap][nk], [cap][nv] */
    double *freq;                /* [hs/2] */
    /* scratch */
    double *x, *xb, *xo, *q, *k, *v, *h1, *h3, *tmp, *att[MAXL], *logits;
} Ref;

static void ref_init(Ref *r, const Model *m, int cap)
{
    int l, i;
    memset(r, 0, sizeof *r);
    r->m = m;
    r->D = m->dim;
    r->hs = m->dim / m->n_heads;
    r->kvd = kv_dim(m);
    r->cap = cap;
    for (l = 0; l < m->n_layers; l++) {
        size_t D = (size_t)m->dim, kv = (size_t)r->kvd, H = (size_t)m->hidden;
        csr_make(&r->wq[l], m->wq + l * D * D, m->dim, m->dim);
        csr_make(&r->wk[l], m->wk + l * kv * D, r->kvd, m->dim);
        csr_make(&r->wv[l], m->wv + l * kv * D, r->kvd, m->dim);
        csr_make(&r->wo[l], m->wo + l * D * D, m->dim, m->dim);
        csr_make(&r->w1[l], m->w1 + l * H * D, m->hidden, m->dim);
        csr_make(&r->w2[l], m->w2 + l * D * H, m->dim, m->hidden);
        csr_make(&r->w3[l], m->w3 + l * H * D, m->hidden, m->dim);
        r->kd[l] = (int *)xcalloc((size_t)r->kvd, sizeof(int));
        r->vd[l] = (int *)xcalloc((size_t)r->kvd, sizeof(int));
        for (i = 0; i < r->kvd; i += 2)
            if (csr_row_nonzero(&r->wk[l], i) || csr_row_nonzero(&r->wk[l], i + 1)) {
                r->kd[l][r->nk[l]++] = i;
                r->kd[l][r->nk[l]++] = i + 1;
            }
        for (i = 0; i < r->kvd; i++)
            if (csr_row_nonzero(&r->wv[l], i)) r->vd[l][r->nv[l]++] = i;
        r->kc[l] = (double *)xcalloc((size_t)cap * (size_t)(r->nk[l] ? r->nk[l] : 1), sizeof(double));
        r->vc[l] = (double *)xcalloc((size_t)cap * (size_t)(r->nv[l] ? r->nv[l] : 1), sizeof(double));
        r->att[l] = (double *)xcalloc((size_t)cap * (size_t)m->n_heads, sizeof(double));
    }
    csr_make(&r->cls, m->wcls, m->vocab, m->dim);
    r->freq = (double *)xcalloc((size_t)r->hs / 2, sizeof(double));
    for (i = 0; i < r->hs / 2; i++) r->freq[i] = rope_freq(m->theta, i, r->hs);
    r->x = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->xb = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->xo = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->q = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->k = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    r->v = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    r->tmp = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->h1 = (double *)xcalloc((size_t)m->hidden, sizeof(double));
    r->h3 = (double *)xcalloc((size_t)m->hidden, sizeof(double));
    r->logits = (double *)xcalloc((size_t)m->vocab, sizeof(double));
}

static void ref_free(Ref *r)
{
    int l;
    for (l = 0; l < r->m->n_layers; l++) {
        csr_free(&r->wq[l]); csr_free(&r->wk[l]); csr_free(&r->wv[l]); csr_free(&r->wo[l]);
        csr_free(&r->w1[l]); csr_free(&r->w2[l]); csr_free(&r->w3[l]);
        free(r->kd[l]); free(r->vd[l]); free(r->kc[l]); free(r->vc[l]); free(r->att[l]);
    }
    csr_free(&r->cls);
    free(r->freq); free(r->x); free(r->xb); free(r->xo); free(r->q); free(r->k);
    free(r->v); free(r->tmp); free(r->h1); free(r->h3); free(r->logits);
}

static void rmsnorm_d(double *o, const double *x, const float *w, int n)
{
    double ss = 0.0;
    int j;
    for (j = 0; j < n; j++) ss += x[j] * x[j];
    ss = 1.0 / sqrt(ss / n + PK_EPS);
    for (j = 0; j < n; j++) o[j] = w[j] * ss * x[j];
}

static void rope_d(double *x, int n, int hs, const double *freq, double pos)
{
    int i;
    for (i = 0; i < n; i += 2) {
        double a = pos * freq[(i % hs) / 2], c = cos(a), s = sin(a);
        double u = x[i], w = x[i + 1];
        x[i] = u * c - w * s;
        x[i + 1] = u * s + w * c;
    }
}

/* The FFN of layer l applied to r->x in place. */
static void ref_ffn(Ref *r, int l)
{
    const Model *m = r->m;
    int i;
    rmsnorm_d(r->xb, r->x, m->rms_ffn + (size_t)l * r->D, r->D);
    csr_mv(r->h1, &r->w1[l], r->xb);
    csr_mv(r->h3, &r->w3[l], r->xb);
    for (i = 0; i < m->hidden; i++) r->h1[i] = r->h1[i] / (1.0 + exp(-r->h1[i])) * r->h3[i];
    csr_mv(r->tmp, &r->w2[l], r->h1);
    for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
}

/* q, k, v of layer l for r->x at pos; k and v stored in the caches. */
static void ref_qkv(Ref *r, int l, int pos)
{
    int i;
    rmsnorm_d(r->xb, r->x, r->m->rms_att + (size_t)l * r->D, r->D);
    csr_mv(r->q, &r->wq[l], r->xb);
    csr_mv(r->k, &r->wk[l], r->xb);
    csr_mv(r->v, &r->wv[l], r->xb);
    rope_d(r->q, r->D, r->hs, r->freq, pos);
    rope_d(r->k, r->kvd, r->hs, r->freq, pos);
    for (i = 0; i < r->nk[l]; i++) r->kc[l][(size_t)pos * r->nk[l] + i] = r->k[r->kd[l][i]];
    for (i = 0; i < r->nv[l]; i++) r->vc[l][(size_t)pos * r->nv[l] + i] = r->v[r->vd[l][i]];
}

/* Literal decode step: token at pos attends to all of 0..pos in every layer. */
static double *ref_step(Ref *r, int token, int pos)
{
    const Model *m = r->m;
    int l, h, i, t, mul = m->n_heads / m->n_kv_heads;
    for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)token * r->D + i];
    for (l = 0; l < m->n_layers; l++) {
        ref_qkv(r, l, pos);
        memset(r->xo, 0, (size_t)r->D * sizeof(double));
        for (h = 0; h < m->n_heads; h++) {
            int lo = (h / mul) * r->hs, hi = lo + r->hs;
            double *att = r->att[l] + (size_t)h * r->cap, mx = -1e300, sum = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *kt = r->kc[l] + (size_t)t * r->nk[l];
                double s = 0.0;
                for (i = 0; i < r->nk[l]; i++) {
                    int d = r->kd[l][i];
                    if (d >= lo && d < hi) s += r->q[h * r->hs + d - lo] * kt[i];
                }
                att[t] = s / sqrt((double)r->hs);
                if (att[t] > mx) mx = att[t];
            }
            for (t = 0; t <= pos; t++) sum += att[t] = exp(att[t] - mx);
            for (t = 0; t <= pos; t++) att[t] /= sum;
            for (t = 0; t <= pos; t++) {
                const double *vt = r->vc[l] + (size_t)t * r->nv[l];
                if (att[t] == 0.0) continue;
                for (i = 0; i < r->nv[l]; i++) {
                    int d = r->vd[l][i];
                    if (d >= lo && d < hi) r->xo[h * r->hs + d - lo] += att[t] * vt[i];
                }
            }
        }
        csr_mv(r->tmp, &r->wo[l], r->xo);
        for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
        ref_ffn(r, l);
    }
    rmsnorm_d(r->xb, r->x, m->rms_final, r->D);
    csr_mv(r->logits, &r->cls, r->xb);
    return r->logits;
}

/* Offset table of layer 0, head h: s(d) = score of a query at p with the key
 * at p-d (d = 0..cap-1), shifted so that the maximum is 0. Fails (returns
 * -1) when the pre-RoPE query or key of layer 0 depends on the token. */
typedef struct {
    double *w;      /* [H][cap] exp(s(d) - max)              */
    double *z;      /* [H][cap] prefix sums of w             */
    double *zoff;   /* [H][cap] prefix sums of w without d=1 */
    double *v;      /* [vocab][kvd] layer-0 value per token  */
    int *vnz;       /* [vocab] value non-zero                */
} Layer0;

static int layer0_table(Ref *r, Layer0 *t)
{
    const Model *m = r->m;
    int H = m->n_heads, hs = r->hs, mul = m->n_heads / m->n_kv_heads;
    int tok, h, d, i;
    double *q0 = (double *)xcalloc((size_t)r->D, sizeof(double));
    double *k0 = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    double *s = (double *)xcalloc((size_t)r->cap, sizeof(double));
    t->w = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->z = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->zoff = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->v = (double *)xcalloc((size_t)m->vocab * r->kvd, sizeof(double));
    t->vnz = (int *)xcalloc((size_t)m->vocab, sizeof(int));
    for (tok = 0; tok < m->vocab; tok++) {
        for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)tok * r->D + i];
        rmsnorm_d(r->xb, r->x, m->rms_att, r->D);
        csr_mv(r->q, &r->wq[0], r->xb);
        csr_mv(r->k, &r->wk[0], r->xb);
        csr_mv(t->v + (size_t)tok * r->kvd, &r->wv[0], r->xb);
        for (i = 0; i < r->kvd; i++) t->vnz[tok] |= t->v[(size_t)tok * r->kvd + i] != 0.0;
        if (tok == 0) {
            memcpy(q0, r->q, (size_t)r->D * sizeof(double));
            memcpy(k0, r->k, (size_t)r->kvd * sizeof(double));
            continue;
        }
        /* 1e-6: the harder variant's filler embeddings have norm sqrt 2 up to float
           rounding (a few 1e-8 relative), which moves layer-0 scores by < 1e-5 */
        for (i = 0; i < r->D; i++)
            if (fabs(r->q[i] - q0[i]) > 1e-6 * (1.0 + fabs(q0[i]))) goto dependent;
        for (i = 0; i < r->kvd; i++)
            if (fabs(r->k[i] - k0[i]) > 1e-6 * (1.0 + fabs(k0[i]))) goto dependent;
    }
    for (h = 0; h < H; h++) {
        const double *qh = q0 + (size_t)h * hs, *kh = k0 + (size_t)(h / mul) * hs;
        double mx = -1e300, *w = t->w + (size_t)h * r->cap;
        for (d = 0; d < r->cap; d++) {
            double acc = 0.0;
            for (i = 0; i < hs; i += 2) {
                double a = -(double)d * r->freq[i / 2], c = cos(a), sn = sin(a);
                acc += qh[i] * (kh[i] * c - kh[i + 1] * sn) + qh[i + 1] * (kh[i] * sn + kh[i + 1] * c);
            }
            s[d] = acc / sqrt((double)hs);
            if (s[d] > mx) mx = s[d];
        }
        for (d = 0; d < r->cap; d++) {
            w[d] = exp(s[d] - mx);
            t->z[(size_t)h * r->cap + d] = (d ? t->z[(size_t)h * r->cap + d - 1] : 0.0) + w[d];
            t->zoff[(size_t)h * r->cap + d] =
                (d ? t->zoff[(size_t)h * r->cap + d - 1] : 0.0) + (d == 1 ? 0.0 : w[d]);
        }
    }
    free(q0); free(k0); free(s);
    return 0;
dependent:
    free(q0); free(k0); free(s);
    return -1;
}

static void layer0_free(Layer0 *t)
{
    free(t->w); free(t->z); free(t->zoff); free(t->v); free(t->vnz);
}

/* Prompt pass: fills the layer caches for positions 0..len-1 exactly.
 * Returns the largest off-peak mass of layer 0 (mass not on p-1, p >= 1). */
static double ref_prompt(Ref *r, const Layer0 *t, const int *toks, int len)
{
    const Model *m = r->m;
    int H = m->n_heads, mul = H / m->n_kv_heads, p, h, i, c, nsrc = 0;
    int *src = (int *)xcalloc((size_t)len, sizeof(int));
    double worst = 0.0;
    for (p = 0; p < len; p++) {
        int tok = toks[p];
        for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)tok * r->D + i];
        ref_qkv(r, 0, p);
        if (t->vnz[tok]) src[nsrc++] = p;
        memset(r->xo, 0, (size_t)r->D * sizeof(double));
        for (h = 0; h < H; h++) {
            const double *w = t->w + (size_t)h * r->cap;
            double z = t->z[(size_t)h * r->cap + p];
            int ko = (h / mul) * r->hs;
            for (c = 0; c < nsrc; c++) {
                double a = w[p - src[c]] / z;
                const double *vt = t->v + (size_t)toks[src[c]] * r->kvd + ko;
                for (i = 0; i < r->hs; i++) r->xo[h * r->hs + i] += a * vt[i];
            }
            if (p >= 1) {
                double off = t->zoff[(size_t)h * r->cap + p] / z;
                if (off > worst) worst = off;
            }
        }
        csr_mv(r->tmp, &r->wo[0], r->xo);
        for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
        ref_ffn(r, 0);
        ref_qkv(r, 1, p); /* layer-1 keys and values; its output is not needed */
    }
    free(src);
    return worst;
}

/* ------------------------------------------------------------------------ */
/* Verification                                                              */

typedef struct {
    int cases, solved;      /* greedy decoding reproduced v1..vn          */
    double margin;          /* min logit(right) - max logit(other)        */
    double right;           /* min logit of the right token               */
    double match_miss;      /* max layer-1 mass not on the right position */
    double match_gap;       /* min log(att right / att best other)        */
    double prev_off;        /* max layer-0 mass not on p-1 (prompt+decode) */
    double k_needle;        /* min |layer-1 key| at needle + 1            */
    double k_other;         /* max |layer-1 key| off needle+1..needle+n+1 */
    double q_query;         /* min |layer-1 query| of the K decode step   */
    double qk_cos;          /* min cosine of that query with that key     */
} Stats;

static void stats_init(Stats *s)
{
    s->cases = s->solved = 0;
    s->margin = s->right = s->match_gap = 1e300;
    s->match_miss = s->prev_off = s->k_other = 0.0;
    s->k_needle = s->q_query = s->qk_cos = 1e300;
}

static double norm_d(const double *x, int n)
{
    double s = 0.0;
    int i;
    for (i = 0; i < n; i++) s += x[i] * x[i];
    return sqrt(s);
}

static int argmax_d(const double *x, int n)
{
    int i, b = 0;
    for (i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One haystack: prompt of ctx - n tokens, then n decode steps. When got is
 * not NULL it receives the n x vocab logits. */
static int run_case(Ref *r, const Layer0 *t, int ctx, double depth, uint64_t seed, int n,
                    Stats *st, double *got)
{
    const Model *m = r->m;
    int len = ctx - n, query, answer[N_VALUE], s, i, ok = 1, tok;
    int *toks = (int *)xcalloc((size_t)len, sizeof(int));
    int needle = make_prompt(len, depth, seed, n, toks, &query, answer);
    double off = ref_prompt(r, t, toks, len);
    if (off > st->prev_off) st->prev_off = off;
    for (i = 0; i < len; i++) {
        double kn = norm_d(r->kc[1] + (size_t)i * r->nk[1], r->nk[1]);
        if (i == needle + 1 && kn < st->k_needle) st->k_needle = kn;
        if ((i <= needle || i > needle + n + 1) && kn > st->k_other) st->k_other = kn;
    }
    tok = query;
    for (s = 0; s < n; s++) {
        int pos = len + s, target = needle + 1 + s, best;
        double *lg = ref_step(r, tok, pos), wrong = -1e300, miss = 0.0, other = 0.0;
        const double *a0 = r->att[0], *a1 = r->att[1];
        for (i = 0; i < m->vocab; i++)
            if (i != answer[s] && lg[i] > wrong) wrong = lg[i];
        if (lg[answer[s]] - wrong < st->margin) st->margin = lg[answer[s]] - wrong;
        if (lg[answer[s]] < st->right) st->right = lg[answer[s]];
        for (i = 0; i <= pos; i++)
            if (i != target) {
                miss += a1[i];
                if (a1[i] > other) other = a1[i];
            }
        if (miss > st->match_miss) st->match_miss = miss;
        if (log(a1[target] / other) < st->match_gap) st->match_gap = log(a1[target] / other);
        miss = 0.0;
        for (i = 0; i <= pos; i++)
            if (i != pos - 1) miss += a0[i];
        if (miss > st->prev_off) st->prev_off = miss;
        if (s == 0) { /* r->q holds the layer-1 query of the K step */
            const double *kt = r->kc[1] + (size_t)(needle + 1) * r->nk[1];
            double qn, dot = 0.0;
            for (i = 0; i < r->nk[1]; i++) dot += r->q[r->kd[1][i]] * kt[i];
            qn = norm_d(r->q, r->D);
            if (qn < st->q_query) st->q_query = qn;
            dot /= qn * norm_d(kt, r->nk[1]);
            if (dot < st->qk_cos) st->qk_cos = dot;
        }
        if (got) memcpy(got + (size_t)s * m->vocab, lg, (size_t)m->vocab * sizeof(double));
        best = argmax_d(lg, m->vocab);
        if (best != answer[s]) ok = 0;
        tok = best;
    }
    st->cases++;
    st->solved += ok;
    free(toks);
    return ok;
}

/* The engine's fp32 forward over the whole prompt (O(len^2)); returns the
 * largest |logit - double reference logit| over the decode steps. */
static double fp32_case(const Model *m, int ctx, double depth, uint64_t seed, int n,
                        const double *want, int *ok)
{
    Fp32 f;
    int len = ctx - n, query, answer[N_VALUE], p, s, i, tok;
    int *toks = (int *)xcalloc((size_t)len, sizeof(int));
    double worst = 0.0;
    make_prompt(len, depth, seed, n, toks, &query, answer);
    fp32_init(&f, m, ctx);
    for (p = 0; p < len; p++) fp32_forward(&f, toks[p], p, NULL, NULL);
    *ok = 1;
    tok = query;
    for (s = 0; s < n; s++) {
        float *lg = fp32_forward(&f, tok, len + s, NULL, NULL);
        int b = 0;
        for (i = 0; i < m->vocab; i++) {
            double d = fabs((double)lg[i] - want[(size_t)s * m->vocab + i]);
            if (d > worst) worst = d;
            if (lg[i] > lg[b]) b = i;
        }
        if (b != answer[s]) *ok = 0;
        tok = b;
    }
    fp32_free(&f);
    free(toks);
    return worst;
}

/* Layer 0 at every position with the engine's fp32 RoPE (angle = (float)pos
 * * freq, freq = 1/powf(theta, hd/hs)): smallest gap between the score of
 * p-1 and the best of p, p-2, ..., p-8. */
static double fp32_prev_gap(const Model *m, int *where)
{
    int D = m->dim, hs = m->dim / m->n_heads, kvd = kv_dim(m), p, d, i;
    float *xb = fzeros((size_t)D), *q0 = fzeros((size_t)D), *k0 = fzeros((size_t)kvd);
    float *q = fzeros((size_t)hs), *ring = fzeros((size_t)9 * hs);
    double worst = 1e300;
    rmsnorm_f(xb, m->emb + (size_t)TOK_BOS * D, m->rms_att, D);
    matmul_f(q0, xb, m->wq, D, D);
    matmul_f(k0, xb, m->wk, D, kvd);
    for (p = 0; p < m->seq_len; p++) {
        float *k = ring + (size_t)(p % 9) * hs;
        for (i = 0; i < hs; i += 2) {
            float freq = 1.0f / powf(m->theta, (float)i / (float)hs);
            float val = (float)p * freq, c = cosf(val), s = sinf(val);
            q[i] = q0[i] * c - q0[i + 1] * s;
            q[i + 1] = q0[i] * s + q0[i + 1] * c;
            k[i] = k0[i] * c - k0[i + 1] * s;
            k[i + 1] = k0[i] * s + k0[i + 1] * c;
        }
        if (p >= 9) {
            float sc[9], other = -1e30f;
            for (d = 0; d < 9; d++) {
                const float *kt = ring + (size_t)((p - d) % 9) * hs;
                float acc = 0.0f;
                for (i = 0; i < hs; i++) acc += q[i] * kt[i];
                sc[d] = acc / sqrtf((float)hs);
                if (d != 1 && sc[d] > other) other = sc[d];
            }
            if ((double)(sc[1] - other) < worst) {
                worst = (double)(sc[1] - other);
                *where = p;
            }
        }
    }
    free(xb); free(q0); free(k0); free(q); free(ring);
    return worst;
}

static int verify(const char *path, int n, int quick)
{
    Model m;
    Ref r;
    Layer0 t;
    Stats all;
    int ctx, nd = quick ? 5 : 11, di, fails = 0, where = 0;
    double gap, off_peak, far_gap;
    if (model_read(&m, path)) return 1;
    if (pk_use_vocab(m.vocab)) {
        fprintf(stderr, "%s: vocabulary %d is neither variant's (%d, %d)\n", path, m.vocab,
                PK_VOCAB, PK_HARD_VOCAB);
        model_free(&m);
        return 1;
    }
    if (m.n_layers != 2) {
        fprintf(stderr, "verify: expects a two-layer model\n");
        model_free(&m);
        return 1;
    }
    printf("checkpoint %s: dim %d hidden %d layers %d heads %d vocab %d seq_len %d "
           "theta %g shared %d\n", path, m.dim, m.hidden, m.n_layers, m.n_heads, m.vocab,
           m.seq_len, (double)m.theta, m.shared);
    ref_init(&r, &m, m.seq_len);
    if (layer0_table(&r, &t)) {
        fprintf(stderr, "verify: layer-0 scores depend on the token\n");
        ref_free(&r);
        model_free(&m);
        return 1;
    }
    {   /* layer-0 offset profile over the whole window */
        const double *w = t.w;
        int d, dbest = 2;
        double s1 = log(w[1]), best = -1e300, fbest = -1e300;
        for (d = 0; d < r.cap; d++) {
            if (d == 1) continue;
            if (log(w[d]) > best) best = log(w[d]);
            if (d >= 2 && log(w[d]) > fbest && d > 2) {
                fbest = log(w[d]);
                dbest = d;
            }
        }
        gap = s1 - best;
        far_gap = s1 - fbest;
        off_peak = t.zoff[r.cap - 1] / t.z[r.cap - 1];
        printf("layer 0 (previous-token head), exact offsets 0..%d:\n"
               "  peak at offset 1; nearest competitor %.2f logits below; best offset >= 3 "
               "(%d) %.2f below\n  off-peak mass at the last position %.3g\n",
               r.cap - 1, gap, dbest, far_gap, off_peak);
    }
    gap = fp32_prev_gap(&m, &where);
    printf("  engine fp32 RoPE, offsets 0..8 at every position: min gap %.2f logits (pos %d)\n",
           gap, where);
    if (gap < 10.0) fails++;

    stats_init(&all);
    printf("greedy passkey retrieval, full attention, %d depths per context (double):\n", nd);
    printf("  %7s %7s %9s %9s %9s %10s %10s %10s\n", "context", "solved", "margin", "right",
           "match_gap", "match_miss", "prev_off", "seconds");
    for (ctx = 4096;; ctx *= 2) {
        Stats st;
        clock_t c0 = clock();
        int c = ctx < m.seq_len ? ctx : m.seq_len;
        stats_init(&st);
        for (di = 0; di < nd; di++) {
            double depth = 100.0 * di / (nd - 1);
            run_case(&r, &t, c, depth, (uint64_t)c * 1000u + (uint64_t)di, n, &st, NULL);
        }
        printf("  %7d %3d/%-3d %9.3f %9.3f %9.3f %10.3g %10.3g %10.2f\n", c, st.solved,
               st.cases, st.margin, st.right, st.match_gap, st.match_miss, st.prev_off,
               (double)(clock() - c0) / CLOCKS_PER_SEC);
        fails += st.cases - st.solved;
        if (st.k_needle < all.k_needle) all.k_needle = st.k_needle;
        if (st.k_other > all.k_other) all.k_other = st.k_other;
        if (st.q_query < all.q_query) all.q_query = st.q_query;
        if (st.qk_cos < all.qk_cos) all.qk_cos = st.qk_cos;
        if (c == m.seq_len) break;
    }

    printf("layer-1 (matching) keys: |k| at the position after the needle's key >= %.3f,\n"
           "  |k| at filler-preceded positions <= %.3g; K query |q| >= %.3f, cos(q, k) >= %.6f\n",
           all.k_needle, all.k_other, all.q_query, all.qk_cos);

    {   /* the engine's own fp32 forward, literally, on short contexts */
        int fctx = quick ? 1024 : 2048, ok, nf = quick ? 3 : 5;
        double *want = (double *)xcalloc((size_t)n * m.vocab, sizeof(double)), diff = 0.0;
        int fsolved = 0;
        Stats st;
        stats_init(&st);
        if (fctx > m.seq_len) fctx = m.seq_len;
        for (di = 0; di < nf; di++) {
            double depth = 100.0 * di / (nf - 1), d;
            uint64_t seed = 777u + (uint64_t)di;
            run_case(&r, &t, fctx, depth, seed, n, &st, want);
            d = fp32_case(&m, fctx, depth, seed, n, want, &ok);
            if (d > diff) diff = d;
            fsolved += ok;
        }
        printf("fp32 engine-order forward (full O(n^2) attention), context %d: solved %d/%d, "
               "max |logit - double| %.3g\n", fctx, fsolved, nf, diff);
        fails += nf - fsolved;
        free(want);
    }
    layer0_free(&t);
    ref_free(&r);
    model_free(&m);
    printf(fails ? "FAILED\n" : "OK\n");
    return fails ? 1 : 0;
}

/* Reference logits of the decode steps of one prompt (double precision). */
static int reference(const char *path, int len, double depth, uint64_t seed, int n)
{
    Model m;
    Ref r;
    Layer0 t;
    Stats st;
    double *lg;
    int query, answer[N_VALUE], needle, s, i, j, ok;
    int *toks;
    if (model_read(&m, path)) return 1;
    if (pk_use_vocab(m.vocab)) {
        fprintf(stderr, "%s: vocabulary %d is neither variant's (%d, %d)\n", path, m.vocab,
                PK_VOCAB, PK_HARD_VOCAB);
        model_free(&m);
        return 1;
    }
    if (m.n_layers != 2 || len < n + 2 || len + n > m.seq_len) {
        fprintf(stderr, "--ref: needs a two-layer model and passkey_len + 2 <= LEN <= "
                        "max_seq_len - passkey_len\n");
        model_free(&m);
        return 1;
    }
    ref_init(&r, &m, len + n);
    if (layer0_table(&r, &t)) {
        fprintf(stderr, "--ref: layer-0 scores depend on the token\n");
        ref_free(&r);
        model_free(&m);
        return 1;
    }
    toks = (int *)xcalloc((size_t)len, sizeof(int));
    needle = make_prompt(len, depth, seed, n, toks, &query, answer);
    lg = (double *)xcalloc((size_t)n * m.vocab, sizeof(double));
    stats_init(&st);
    ok = run_case(&r, &t, len + n, depth, seed, n, &st, lg);
    printf("prompt %d tokens, needle at %d, query %d\n", len, needle, query);
    for (s = 0; s < n; s++) {
        const double *l = lg + (size_t)s * m.vocab;
        int top[5], k;
        for (k = 0; k < 5; k++) {
            int b = -1;
            for (i = 0; i < m.vocab; i++) {
                for (j = 0; j < k; j++)
                    if (top[j] == i) break;
                if (j == k && (b < 0 || l[i] > l[b])) b = i;
            }
            top[k] = b;
        }
        printf("step %d pos %d: expected %d, top", s, len + s, answer[s]);
        for (k = 0; k < 5; k++) printf(" %d:%.7g", top[k], l[top[k]]);
        printf("\n");
    }
    printf("%s: min margin %.4f, layer-1 mass off the needle %.3g\n", ok ? "solved" : "FAILED",
           st.margin, st.match_miss);
    free(lg);
    free(toks);
    layer0_free(&t);
    ref_free(&r);
    model_free(&m);
    return ok ? 0 : 1;
}

/* ------------------------------------------------------------------------ */
/* Command line                                                              */

static void print_roles(int n)
{
    int i;
    printf("vocab %d\n", pk_vocab);
    printf("unk %d\n", TOK_UNK);
    printf("bos %d\n", TOK_BOS);
    printf("eos %d\n", TOK_EOS);
    printf("fillers %d", n_fillers());
    for (i = 0; i < n_fillers(); i++) printf(" %d", filler_token(i));
    printf("\nkeys %d", N_KEY);
    for (i = 0; i < N_KEY; i++) printf(" %d", KEY_FIRST + i);
    printf("\nvalues %d", N_VALUE);
    for (i = 0; i < N_VALUE; i++) printf(" %d", VALUE_FIRST + i);
    printf("\npasskey_len %d\n", n);
}

static int print_prompt(int len, double depth, uint64_t seed, int n)
{
    int query, answer[N_VALUE], i, pos;
    int *toks;
    if (len < n + 2) {
        fprintf(stderr, "--prompt: LEN must be at least passkey_len + 2\n");
        return 1;
    }
    toks = (int *)xcalloc((size_t)len, sizeof(int));
    pos = make_prompt(len, depth, seed, n, toks, &query, answer);
    printf("prompt %d", len);
    for (i = 0; i < len; i++) printf(" %d", toks[i]);
    printf("\nquery %d\nanswer %d", query, n);
    for (i = 0; i < n; i++) printf(" %d", answer[i]);
    printf("\nneedle %d\n", pos);
    free(toks);
    return 0;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: make_passkey OUT.bin [--seq-len N] [--passkey-len n] [--hard]\n"
            "       make_passkey --verify OUT.bin [--seq-len N] [--passkey-len n] [--quick]\n"
            "       make_passkey --roles [--passkey-len n]\n"
            "       make_passkey --prompt LEN DEPTH SEED [--passkey-len n]\n"
            "       make_passkey --ref CKPT.bin LEN DEPTH SEED [--passkey-len n]\n"
            "  OUT.bin        write the checkpoint (llama2.c version-1 format)\n"
            "  --verify       write OUT.bin, read it back and check retrieval numerically\n"
            "  --roles        print the token ids of every role\n"
            "  --prompt       print a haystack of LEN tokens (starting with <s>) with the\n"
            "                 needle at DEPTH percent (0..100), the query token to feed\n"
            "                 next, the expected answer and the needle position\n"
            "  --ref          reference logits (double precision, full attention) of the\n"
            "                 decode steps after that prompt, for checking an engine\n"
            "  --seq-len N    max_seq_len of the checkpoint (default %d)\n"
            "  --passkey-len n  number of value tokens, 1..%d (default %d)\n"
            "  --hard         the harder variant (vocabulary %d; with --roles, --prompt:\n"
            "                 its fillers)\n",
            PK_SEQ_LEN, N_VALUE, PK_PASSKEY_LEN, PK_HARD_VOCAB);
}

int main(int argc, char **argv)
{
    const char *out = NULL;
    int seq_len = PK_SEQ_LEN, n = PK_PASSKEY_LEN, do_verify = 0, quick = 0, roles = 0;
    int prompt = 0, plen = 0, i;
    const char *ref = NULL;
    double pdepth = 0.0;
    unsigned long long pseed = 0;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--seq-len") && i + 1 < argc) {
            seq_len = atoi(argv[++i]);
        } else if (!strcmp(a, "--passkey-len") && i + 1 < argc) {
            n = atoi(argv[++i]);
        } else if (!strcmp(a, "--verify")) {
            do_verify = 1;
        } else if (!strcmp(a, "--quick")) {
            quick = 1;
        } else if (!strcmp(a, "--hard")) {
            pk_vocab = PK_HARD_VOCAB;
        } else if (!strcmp(a, "--roles")) {
            roles = 1;
        } else if ((!strcmp(a, "--prompt") && i + 3 < argc) ||
                   (!strcmp(a, "--ref") && i + 4 < argc)) {
            if (a[2] == 'r') ref = argv[++i];
            prompt = 1;
            plen = atoi(argv[++i]);
            pdepth = atof(argv[++i]);
            pseed = strtoull(argv[++i], NULL, 10);
        } else if (a[0] != '-' && !out) {
            out = a;
        } else {
            usage();
            return 2;
        }
    }
    if (n < 1 || n > N_VALUE) {
        fprintf(stderr, "--passkey-len must be in 1..%d\n", N_VALUE);
        return 2;
    }
    if (roles) {
        print_roles(n);
        return 0;
    }
    if (ref) return reference(ref, plen, pdepth, (uint64_t)pseed, n);
    if (prompt) return print_prompt(plen, pdepth, (uint64_t)pseed, n);
    if (!out) {
        usage();
        return 2;
    }
    if (seq_len < 64 || seq_len > (1 << 20)) {
        fprintf(stderr, "--seq-len must be in 64..%d\n", 1 << 20);
        return 2;
    }
    {
        Model m;
        model_build(&m, seq_len);
        if (model_write(&m, out)) {
            model_free(&m);
            return 1;
        }
        model_free(&m);
    }
    if (do_verify) return verify(out, n, quick);
    return 0;
}
