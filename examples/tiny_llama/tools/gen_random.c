/* gen_random.c - writes a llama2.c checkpoint with random weights, so the
   engine can be tried and tested without downloading a model.

   The weights are seeded: the same sizes and seed give the same model, in
   either header format. Norm weights are 1 + 0.1 N(0,1); the embedding (and
   an unshared classifier) 2 N(0, 1/dim), wq and wk sqrt(3) N(0, 1/dim), the
   other matrices N(0, 1/fan_in): logits and attention scores vary enough
   for the choice of attended tokens to show in the output. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "../tiny_llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void)
{
    fprintf(stderr,
        "usage: tiny_llama_gen <out.bin> [options]\n"
        "  -d <int>    dim (default 256)\n"
        "  -f <int>    FFN hidden_dim (default 768)\n"
        "  -l <int>    layers (default 2)\n"
        "  -H <int>    query heads (default 4)\n"
        "  -k <int>    key/value heads (default 2)\n"
        "  -v <int>    vocabulary size (default 512)\n"
        "  -s <int>    seq_len, the longest context (default 4096)\n"
        "  -t <float>  RoPE theta (default 10000)\n"
        "  -S <int>    seed (default 1)\n"
        "  -u          unshared classifier (own wcls matrix)\n"
        "  -L          legacy header (no magic; cannot hold a RoPE theta)\n");
}

static int parse_int(const char *s, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < -2147483647L || v > 2147483647L)
        return -1;
    *out = (int)v;
    return 0;
}

int main(int argc, char **argv)
{
    tl_config c;
    char err[TL_ERR_LEN];
    int i, legacy = 0, seed = 1, bad = 0;

    memset(&c, 0, sizeof c);
    c.dim = 256;
    c.hidden_dim = 768;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 512;
    c.seq_len = 4096;
    c.shared_classifier = 1;
    c.rope_theta = TL_DEFAULT_ROPE_THETA;
    if (argc < 2 || argv[1][0] == '-') {
        usage();
        return 1;
    }
    for (i = 2; i < argc && !bad; i++) {
        const char *flag = argv[i];
        if (strcmp(flag, "-u") == 0) { c.shared_classifier = 0; continue; }
        if (strcmp(flag, "-L") == 0) { legacy = 1; continue; }
        if (i + 1 >= argc || flag[0] != '-' || flag[1] == '\0' || flag[2] != '\0') {
            bad = 1;
            break;
        }
        i++;
        switch (flag[1]) {
        case 'd': bad = parse_int(argv[i], &c.dim); break;
        case 'f': bad = parse_int(argv[i], &c.hidden_dim); break;
        case 'l': bad = parse_int(argv[i], &c.n_layers); break;
        case 'H': bad = parse_int(argv[i], &c.n_heads); break;
        case 'k': bad = parse_int(argv[i], &c.n_kv_heads); break;
        case 'v': bad = parse_int(argv[i], &c.vocab_size); break;
        case 's': bad = parse_int(argv[i], &c.seq_len); break;
        case 'S': bad = parse_int(argv[i], &seed); break;
        case 't': {
            char *end;
            c.rope_theta = strtof(argv[i], &end);
            bad = end == argv[i] || *end != '\0';
            break;
        }
        default: bad = 1;
        }
    }
    if (bad) {
        usage();
        return 1;
    }
    if (tl_write_random_checkpoint(argv[1], &c, legacy, (unsigned long long)seed,
                                   err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    c.version = legacy ? 0 : 1;
    tl_check_config(&c, err, sizeof err);
    fprintf(stderr, "wrote %s: %s header, dim %d, hidden %d, %d layers, %d heads, %d kv heads, "
            "vocab %d, seq_len %d, theta %g, %s classifier, %zu bytes\n", argv[1],
            legacy ? "legacy" : "version 1", c.dim, c.hidden_dim, c.n_layers, c.n_heads,
            c.n_kv_heads, c.vocab_size, c.seq_len, (double)c.rope_theta,
            c.shared_classifier ? "shared" : "own", tl_checkpoint_size(&c, c.version));
    return 0;
}
