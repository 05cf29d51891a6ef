/* test_support.h - what the C tests of tiny_llama share: a temporary directory
   for the files they write, and whole-file reads and writes. */
#ifndef TL_TEST_SUPPORT_H
#define TL_TEST_SUPPORT_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__GNUC__) || defined(__clang__)
#define TLT_FN static __attribute__((unused))
#else
#define TLT_FN static
#endif

/* ----------------------------------------------------------------------------
   The test directory and its files */

static char g_dir[512]; /* the test directory, made by make_test_dir */

/* Makes the test directory, TMPDIR/NAME_XXXXXX (TMPDIR unset: /tmp); 0 on success. */
TLT_FN int make_test_dir(const char *name)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/%s_XXXXXX", tmp && *tmp ? tmp : "/tmp", name);
    return mkdtemp(g_dir) ? 0 : -1;
}

/* a path in the test directory; valid until 8 more calls */
TLT_FN const char *tmp_path(const char *name)
{
    static char paths[8][600];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, 600, "%s/%s", g_dir, name);
    return p;
}

/* Removes the test directory and the files in it. */
TLT_FN void remove_test_dir(void)
{
    DIR *d = opendir(g_dir);
    struct dirent *e;
    char path[1200];
    if (!d)
        return;
    while ((e = readdir(d)) != NULL) {   /* only files this program wrote */
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", g_dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(g_dir);
}

TLT_FN unsigned char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = (unsigned char *)malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

TLT_FN int write_file(const char *path, const unsigned char *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f)
        return -1;
    ok = fwrite(buf, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

#endif
