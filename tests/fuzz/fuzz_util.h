/* fuzz_util.h - what the fuzz targets share besides what test_util.h gives them: a
   scratch directory made once per process (under TMPDIR, removed at exit with the files
   named in it) and writing an input to a file there. A failure to set these up aborts:
   it is the harness's, not the target's. A target that defines FZ_TARGET (its name)
   before the include also gets fz_fail, the report of a violated check. Every function
   may go unused. */
#ifndef PQC_FUZZ_UTIL_H
#define PQC_FUZZ_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"

#define FZ_MAX_FILES 8
static char fz__dir[512];
static char fz__files[FZ_MAX_FILES][600];
static int fz__n_files;

TU_FN void fz__cleanup(void)
{
    int i;
    for (i = 0; i < fz__n_files; i++) remove(fz__files[i]);
    if (fz__dir[0]) rmdir(fz__dir);
}

/* This process's scratch directory, pqc_TARGET_XXXXXX under TMPDIR (made on first use;
   removed at exit, once the files fz_scratch_path named in it are). */
TU_FN const char *fz_scratch_dir(const char *target)
{
    if (!fz__dir[0]) {
        const char *tmp = tu_tmp_dir();
        if (strlen(tmp) > 400) tmp = "/tmp";
        snprintf(fz__dir, sizeof fz__dir, "%s/pqc_%s_XXXXXX", tmp, target);
        if (!mkdtemp(fz__dir)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fz__cleanup);
    }
    return fz__dir;
}

/* The path of `name` in this process's scratch directory (the file is removed at exit).
   Names must be few and fixed: at most FZ_MAX_FILES. */
TU_FN const char *fz_scratch_path(const char *target, const char *name)
{
    int i;
    fz_scratch_dir(target);
    for (i = 0; i < fz__n_files; i++)
        if (strcmp(strrchr(fz__files[i], '/') + 1, name) == 0) return fz__files[i];
    if (fz__n_files == FZ_MAX_FILES) abort();
    snprintf(fz__files[fz__n_files], sizeof fz__files[0], "%s/%s", fz__dir, name);
    return fz__files[fz__n_files++];
}

/* Writes size bytes to path, or aborts. */
TU_FN void fz_write_file(const char *path, const void *data, size_t size)
{
    if (!tu_file_write(path, data, size)) {
        perror("fuzz: writing the input");
        abort();
    }
}

#ifdef FZ_TARGET
/* A violated check: "FUZZ CHECK FAILED" with the target's name, then abort, so that
   libFuzzer keeps the input. */
TU_FN void fz_fail(const char *what, const char *detail)
{
    fprintf(stderr, "FUZZ CHECK FAILED: %s: %s (%s)\n", FZ_TARGET, what, detail ? detail : "");
    abort();
}
#endif

#endif
