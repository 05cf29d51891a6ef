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
 * tools/needle.c, `make needle`).
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

/* the references, --verify and --ref */
#include "passkey_verify.h"

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
