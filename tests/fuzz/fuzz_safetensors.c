/* fuzz_safetensors.c - libFuzzer target for tiny_llama's Hugging Face loader
   (examples/tiny_llama/tiny_llama.h: tl_hf_parse_config, tl_st_parse,
   tl_hf_bind, tl_build_model on a model directory).

   The input is a config.json text, one NUL byte, then a safetensors file
   (without a NUL the whole input is the config and the safetensors file is
   empty).

   Checks (a violation prints "FUZZ CHECK FAILED" and aborts, so libFuzzer
   keeps the input):
   - tl_hf_parse_config either fails with a message or gives a config that
     passes tl_check_config unchanged;
   - tl_st_parse either fails with a message or lists tensors sorted by name,
     each with a byte range inside the file, after the header, sized as its
     shape and dtype say, no two overlapping;
   - with both accepted, tl_hf_bind either refuses with a message or binds a
     model whose forward step (token 0 at position 0) reads only the bytes of
     a copy of the file (ASan checks that);
   - tl_build_model on the two files written to a directory agrees with the
     in-memory verdict and leaves nothing mapped when it fails.
   Every allocation is freed (LeakSanitizer checks that). */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"
#define FZ_TARGET "fuzz_safetensors"
#include "fuzz/fuzz_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static size_t fz_dtype_size(int dtype)
{
    return dtype == TL_F32 ? 4 : 2;
}

static void fz_check_tensors(const tl_st_file *f, size_t size)
{
    int i;
    for (i = 0; i < f->n; i++) {
        const tl_st_tensor *t = &f->t[i];
        size_t numel = 1;
        int d;
        if (i > 0 && strcmp(f->t[i - 1].name, t->name) >= 0)
            fz_fail("tensors not sorted by name, or a name twice", t->name);
        if (t->begin < 8 || t->begin > t->end || t->end > size)
            fz_fail("a tensor's bytes are outside the file", t->name);
        for (d = 0; d < t->ndim; d++)
            numel *= (size_t)t->shape[d];
        if (t->dtype >= 0 && t->end - t->begin != numel * fz_dtype_size(t->dtype))
            fz_fail("a tensor's byte count does not match its shape", t->name);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = (const uint8_t *)memchr(data, 0, size);
    size_t clen = nul ? (size_t)(nul - data) : size;
    const unsigned char *st = nul ? nul + 1 : data + size;
    size_t slen = nul ? size - clen - 1 : 0;
    char err[TL_ERR_LEN], dir[600];
    tl_config c;
    tl_st_file f;
    tl_model m;
    int cfg_ok, st_ok, bind_ok = 0;
    unsigned char *copy = NULL;

    err[0] = '\0';
    cfg_ok = tl_hf_parse_config((const char *)data, clen, &c, err, sizeof err) == 0;
    if (cfg_ok) {
        tl_config check = c;
        if (tl_check_config(&check, err, sizeof err) != 0 || memcmp(&check, &c, sizeof c) != 0)
            fz_fail("an accepted config.json fails tl_check_config", err);
    } else if (!err[0]) {
        fz_fail("tl_hf_parse_config failed without a message", "");
    }

    err[0] = '\0';
    copy = (unsigned char *)malloc(slen ? slen : 1);
    if (!copy)
        abort();
    if (slen)
        memcpy(copy, st, slen);
    st_ok = tl_st_parse(copy, slen, &f, err, sizeof err) == 0;
    if (st_ok)
        fz_check_tensors(&f, slen);
    else if (!err[0])
        fz_fail("tl_st_parse failed without a message", "");

    if (cfg_ok && st_ok) {
        const unsigned char *bases[1];
        bases[0] = copy;
        err[0] = '\0';
        memset(&m, 0, sizeof m);
        bind_ok = tl_hf_bind(&c, &f, NULL, 1, NULL, err, sizeof err) == 0;
        if (!bind_ok && !err[0])
            fz_fail("tl_hf_bind failed without a message", "");
        if (bind_ok) {
            tl_state s;
            if (tl_hf_bind(&c, &f, bases, 1, &m, err, sizeof err) != 0)
                fz_fail("tl_hf_bind with the data refuses what it accepted without", err);
            m.config = c;
            if (tl_build_state(&s, &c, 2, 1, err, sizeof err) == 0) {
                if (!tl_forward(&m, &s, NULL, 0, 0))
                    fz_fail("the forward step of a bound model failed", s.err);
                tl_free_state(&s);
            }
            tl_free_model(&m);
        }
    }
    if (st_ok)
        tl_st_free(&f);
    free(copy);

    /* the same through the directory loader */
    fz_write_file(fz_scratch_path(FZ_TARGET, "config.json"), data, clen);
    fz_write_file(fz_scratch_path(FZ_TARGET, "model.safetensors"), st, slen);
    snprintf(dir, sizeof dir, "%s", fz_scratch_path(FZ_TARGET, "config.json"));
    *strrchr(dir, '/') = '\0';
    err[0] = '\0';
    if (tl_build_model(&m, dir, err, sizeof err) == 0) {
        if (!bind_ok)
            fz_fail("tl_build_model accepts a directory the in-memory checks refuse", "");
        tl_free_model(&m);
    } else {
        if (bind_ok && slen > 0)
            fz_fail("tl_build_model refuses a directory the in-memory checks accept", err);
        if (!err[0])
            fz_fail("tl_build_model failed without a message", "");
        if (m.shard_maps != NULL || m.layers != NULL || m.map != NULL)
            fz_fail("a failed tl_build_model left memory behind", err);
    }
    return 0;
}
