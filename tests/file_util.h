/* file_util.h - small file helpers shared by the tests of the library's file formats. */
#ifndef PQC_TESTS_FILE_UTIL_H
#define PQC_TESTS_FILE_UTIL_H

#include <stdio.h>
#include <stdlib.h>

/* The whole file at path in a buffer with one spare byte after it (NULL on failure). */
static unsigned char *file_image(const char *path, long *size)
{
    FILE *f = fopen(path, "rb");
    unsigned char *img = NULL;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (*size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (img = (unsigned char *)malloc((size_t)*size + 1)) != NULL && fread(img, 1, (size_t)*size, f) != (size_t)*size) {
        free(img);
        img = NULL;
    }
    fclose(f);
    return img;
}

/* Writes n bytes of p to path; 1 on success. */
static int file_write(const char *path, const unsigned char *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(p, 1, n, f) == n;
    if (f && fclose(f) != 0) ok = 0;
    return ok;
}

#endif
