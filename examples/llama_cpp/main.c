/* pqc_llama - llama.cpp generating with pqcache serving its full-attention layers
   (pqc_llama.h), or with llama.cpp's own attention, and optionally both side by side.

   usage: pqc_llama -m model.gguf (-f prompt.txt | -p text) [options]
   The prompt is text; special tokens in it (a chat template's) are parsed as such.
   Decoding is greedy. The report (standard error) gives the prefill and decode speed, the
   library's share of a step, the KV memory of both caches and the peak resident memory;
   with -c a reference context with llama.cpp's own attention decodes the same tokens and
   each step's next token and KL(full || pqcache) are compared. */
#define _POSIX_C_SOURCE 199309L
#include "pqc_llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(void) {
    fprintf(stderr,
            "usage: pqc_llama -m model.gguf (-f prompt.txt | -p text) [options]\n"
            "  -n <int>    tokens to generate, greedy (default 32)\n"
            "  -a <mode>   attention of decode steps: pqcache (default) or full (llama.cpp's own)\n"
            "  -b <float>  pqcache's budget ratio (default: the library's, 0.1)\n"
            "  -t <int>    threads (default 2)\n"
            "  -c          compare with llama.cpp's own attention every step: next-token\n"
            "              agreement and mean KL(full || this mode)\n"
            "  -fa <on|off|auto>  llama.cpp's flash attention (default auto: on for the CPU)\n"
            "  -rfa <on|off|auto> the reference's (-c), default as -fa: -a full -c -rfa off\n"
            "              compares llama.cpp's two attention kernels with each other\n"
            "  -f32        pqcache stores K/V as fp32 (default fp16, as llama.cpp's cache)\n"
            "  -q          print no text, only the report; -O <path>: the generated token ids\n"
            "  -T          print the prompt's token count and exit\n"
            "  -e          generate -n tokens even past an end-of-generation token\n"
            "  -p2 <text>  after generating, one more prompt turn in the same context (its\n"
            "              next token printed); pqcache refuses it (docs/llama_cpp.md)\n");
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The process's peak resident memory in bytes (Linux), 0 where unknown. */
static size_t peak_rss(void) {
    char line[256];
    size_t kb = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    char *s;
    long n;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return NULL;
    }
    s = (char *)malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    fclose(f);
    return s;
}

/* llama.cpp's log: errors pass through; the KV buffers' sizes are summed (kv_mib). */
static double kv_mib;
static void log_cb(enum ggml_log_level level, const char *text, void *user) {
    const char *at = strstr(text, "KV buffer size =");
    double mib;
    (void)user;
    if (at && sscanf(at, "KV buffer size = %lf", &mib) == 1) kv_mib += mib;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int fa_of(const char *v, enum llama_flash_attn_type *out) {
    if (!strcmp(v, "on")) *out = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (!strcmp(v, "off")) *out = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else if (!strcmp(v, "auto")) *out = LLAMA_FLASH_ATTN_TYPE_AUTO;
    else return 0;
    return 1;
}

static llama_token argmax(const float *x, int n) {
    int i, b = 0;
    for (i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* KL(p || q) of the softmaxes of logits a (p) and b (q). */
static double kl_logits(const float *a, const float *b, int n) {
    double ma = a[argmax(a, n)], mb = b[argmax(b, n)], za = 0, zb = 0, kl = 0;
    int i;
    for (i = 0; i < n; i++) {
        za += exp(a[i] - ma);
        zb += exp(b[i] - mb);
    }
    for (i = 0; i < n; i++) {
        double lp = a[i] - ma - log(za), lq = b[i] - mb - log(zb);
        kl += exp(lp) * (lp - lq);
    }
    return kl;
}

/* One llama_decode of n tokens; 0 on success, else a message on stderr. */
static int decode(struct llama_context *ctx, pqc_llama *g, llama_token *tok, int n, const char *what) {
    int rc = llama_decode(ctx, llama_batch_get_one(tok, n));
    if (rc != 0) {
        fprintf(stderr, "pqc_llama: %s: llama_decode failed (%d)\n", what, rc);
        return 1;
    }
    if (g && pqc_llama_status(g) != PQC_SUCCESS) {
        fprintf(stderr, "pqc_llama: %s: pqcache: %s (%s)\n", what, pqc_llama_error(g),
                pqc_result_description(pqc_llama_status(g)));
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *prompt_path = NULL, *prompt_text = NULL, *mode = "pqcache", *ids_path = NULL;
    const char *second = NULL;
    int n_gen = 32, threads = 2, compare = 0, quiet = 0, count_only = 0, kv_f32 = 0, ignore_eos = 0, ref_set = 0, i, n_prompt, n_vocab, agree = 0, steps = 0, rc = 1;
    double budget = 0, kl_sum = 0, t0, t_prefill, t_decode = 0, kv_bytes = 0;
    char *text = NULL;
    llama_token *tokens = NULL, *out_ids = NULL;
    struct llama_model *model = NULL;
    struct llama_context *ctx = NULL, *ref = NULL;
    const struct llama_vocab *vocab;
    struct llama_model_params mp;
    struct llama_context_params cp;
    pqc_llama *g = NULL;
    FILE *ids = NULL;
    enum llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_AUTO, ref_fa = LLAMA_FLASH_ATTN_TYPE_AUTO;

    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-c")) compare = 1;
        else if (!strcmp(a, "-T")) count_only = 1;
        else if (!strcmp(a, "-f32")) kv_f32 = 1;
        else if (!strcmp(a, "-e")) ignore_eos = 1;
        else if (!strcmp(a, "-q")) quiet = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        } else if (!v) {
            usage();
            return 2;
        } else {
            i++;
            if (!strcmp(a, "-m")) model_path = v;
            else if (!strcmp(a, "-f")) prompt_path = v;
            else if (!strcmp(a, "-p")) prompt_text = v;
            else if (!strcmp(a, "-n")) n_gen = atoi(v);
            else if (!strcmp(a, "-a")) mode = v;
            else if (!strcmp(a, "-b")) budget = atof(v);
            else if (!strcmp(a, "-t")) threads = atoi(v);
            else if (!strcmp(a, "-O")) ids_path = v;
            else if (!strcmp(a, "-p2")) second = v;
            else if (!strcmp(a, "-fa") && fa_of(v, &fa)) ref_set ? (void)0 : (void)(ref_fa = fa);
            else if (!strcmp(a, "-rfa") && fa_of(v, &ref_fa)) ref_set = 1;
            else {
                fprintf(stderr, "pqc_llama: unknown option %s\n", a);
                usage();
                return 2;
            }
        }
    }
    if (!model_path || (!prompt_path == !prompt_text) || n_gen < 1 || threads < 1 ||
        (strcmp(mode, "pqcache") && strcmp(mode, "full")) || budget < 0 ) {
        usage();
        return 2;
    }
    text = prompt_path ? read_file(prompt_path) : NULL;
    if (prompt_path && !text) {
        fprintf(stderr, "pqc_llama: cannot read %s\n", prompt_path);
        return 2;
    }

    llama_backend_init();
    llama_log_set(log_cb, NULL);
    mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        fprintf(stderr, "pqc_llama: cannot load %s\n", model_path);
        goto done;
    }
    vocab = llama_model_get_vocab(model);
    n_vocab = llama_vocab_n_tokens(vocab);
    {
        const char *s = text ? text : prompt_text;
        int len = (int)strlen(s), cap = len + 16;
        tokens = (llama_token *)malloc((size_t)cap * sizeof *tokens);
        if (!tokens) goto done;
        n_prompt = llama_tokenize(vocab, s, len, tokens, cap, true, true);
        if (n_prompt <= 0) {
            fprintf(stderr, "pqc_llama: the prompt gives no tokens\n");
            goto done;
        }
    }
    if (count_only) {
        printf("%d\n", n_prompt);
        rc = 0;
        goto done;
    }

    /* The prompt as one ubatch, so that the codebooks of the first prefill see all of it
       and its last queries are the ones observed. */
    cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)((n_prompt + n_gen + 255) / 256 * 256);
    cp.n_batch = cp.n_ubatch = (uint32_t)n_prompt;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.no_perf = true;
    cp.flash_attn_type = fa;
    if (!strcmp(mode, "pqcache")) {
        pqc_llama_params pp;
        memset(&pp, 0, sizeof pp);
        pp.desc.budget_ratio = budget;
        pp.max_tokens = cp.n_ctx;
        pp.kv_f32 = kv_f32;
        if (pqc_llama_create(model, &pp, &g) != PQC_SUCCESS) {
            fprintf(stderr, "pqc_llama: pqcache: %s\n", pqc_last_error());
            goto done;
        }
    }
    kv_mib = 0;
    ctx = llama_init_from_model(model, cp);
    kv_bytes = kv_mib * 1048576.0;
    if (!ctx) {
        fprintf(stderr, "pqc_llama: cannot create a context of %u tokens\n", cp.n_ctx);
        goto done;
    }
    if (g) pqc_llama_attach(g, ctx);
    cp.flash_attn_type = ref_fa;
    if (compare && !(ref = llama_init_from_model(model, cp))) {
        fprintf(stderr, "pqc_llama: cannot create the reference context\n");
        goto done;
    }
    out_ids = (llama_token *)malloc((size_t)n_gen * sizeof *out_ids);
    if (!out_ids) goto done;

    t0 = now_s();
    if (decode(ctx, g, tokens, n_prompt, "prefill")) goto done;
    t_prefill = now_s() - t0;
    if (ref && decode(ref, NULL, tokens, n_prompt, "reference prefill")) goto done;

    for (i = 0; i < n_gen; i++) {
        const float *lg = llama_get_logits_ith(ctx, -1);
        llama_token tok = argmax(lg, n_vocab);
        if (ref) {
            const float *lr = llama_get_logits_ith(ref, -1);
            agree += argmax(lr, n_vocab) == tok;
            kl_sum += kl_logits(lr, lg, n_vocab);
            steps++;
        }
        out_ids[i] = tok;
        if (!quiet) {
            char piece[256];
            int n = llama_token_to_piece(vocab, tok, piece, sizeof piece, 0, false);
            if (n > 0) fwrite(piece, 1, (size_t)n, stdout);
            fflush(stdout);
        }
        if ((!ignore_eos && llama_vocab_is_eog(vocab, tok)) || i + 1 == n_gen) {
            n_gen = i + 1;
            break;
        }
        t0 = now_s();
        if (decode(ctx, g, &tok, 1, "decode")) goto done;
        t_decode += now_s() - t0;
        if (ref && decode(ref, NULL, &tok, 1, "reference decode")) goto done;
    }
    if (!quiet) printf("\n");
    if (second) { /* another turn: the generated tokens, then the new prompt's */
        int len = (int)strlen(second), n2;
        llama_token *t2 = (llama_token *)malloc((size_t)(len + 17) * sizeof *t2);
        if (!t2) goto done;
        t2[0] = out_ids[n_gen - 1];
        n2 = llama_tokenize(vocab, second, len, t2 + 1, len + 16, false, true);
        if (n2 < 0 || decode(ctx, g, t2, n2 + 1, "second prompt")) {
            free(t2);
            goto done;
        }
        free(t2);
        printf("second prompt: next token %d\n", (int)argmax(llama_get_logits_ith(ctx, -1), n_vocab));
    }
    if (ids_path) {
        if (!(ids = fopen(ids_path, "w"))) {
            fprintf(stderr, "pqc_llama: cannot write %s\n", ids_path);
            goto done;
        }
        for (i = 0; i < n_gen; i++) fprintf(ids, "%d\n", (int)out_ids[i]);
        fclose(ids);
    }

    fprintf(stderr, "mode %s, %d prompt tokens, %d generated, %d threads\n", mode, n_prompt, n_gen, threads);
    fprintf(stderr, "prefill: %.2f s, %.1f tokens/s\n", t_prefill, n_prompt / t_prefill);
    if (n_gen > 1) fprintf(stderr, "decode: %.1f tokens/s (%d steps)\n", (n_gen - 1) / t_decode, n_gen - 1);
    if (g) {
        pqc_llama_stats st;
        pqc_cache_desc cfg;
        pqc_llama_stats_get(g, &st);
        if (pqc_cache_config(pqc_llama_cache(g), &cfg) == PQC_SUCCESS)
            fprintf(stderr, "pqcache: %d layers served, m %d, %d bits, budget %.3g, window %d, %d sinks\n", st.layers,
                    cfg.pq.m, cfg.pq.bits, cfg.budget_ratio, pqc_cache_window(pqc_llama_cache(g)), cfg.n_sink);
        if (st.steps)
            fprintf(stderr,
                    "pqcache step: select %.3f ms, fetch %.3f ms, attend %.3f ms per token (%.1f%% of a step), "
                    "%.0f rows per layer and KV head; the first selects waited %.3f s for the builds\n",
                    1e3 * st.select_s / (double)st.steps, 1e3 * st.fetch_s / (double)st.steps,
                    1e3 * st.attend_s / (double)st.steps, 100.0 * (st.select_s + st.fetch_s + st.attend_s) / t_decode,
                    (double)st.tokens_selected / (double)st.steps / (double)st.layers / (double)st.kv_heads,
                    st.build_wait_s);
        fprintf(stderr, "pqcache host memory: %.1f MB for %zu tokens per layer\n", st.host_bytes / 1e6, st.tokens);
    }
    fprintf(stderr, "llama.cpp KV cache: %.1f MB allocated (%u cells)\n", kv_bytes / 1e6, cp.n_ctx);
    if (steps)
        fprintf(stderr, "compare: next token agrees %d/%d, mean KL(full || %s) %.5f\n", agree, steps, mode,
                kl_sum / steps);
    fprintf(stderr, "peak resident memory: %.1f MB\n", peak_rss() / 1e6);
    rc = 0;
done:
    if (ref) llama_free(ref);
    if (ctx) llama_free(ctx);
    pqc_llama_destroy(g);
    if (model) llama_model_free(model);
    llama_backend_free();
    free(tokens);
    free(out_ids);
    free(text);
    return rc;
}
