/* cache_checksum.h - the checksum that ends a cache file (pqc_cache_save): FNV-1a 64 over
   little-endian 64-bit words, the last one zero-padded, then over the length in bytes as
   one more word. For tests and fuzz targets that craft files the loader must still check. */
#ifndef PQC_TESTS_CACHE_CHECKSUM_H
#define PQC_TESTS_CACHE_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

static uint64_t cache_file_checksum(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull, w;
    size_t i, j;
    for (i = 0; i < n; i += 8) {
        w = 0;
        for (j = 0; j < 8 && i + j < n; j++) w |= (uint64_t)p[i + j] << (8 * j);
        h = (h ^ w) * 0x100000001b3ull;
    }
    return (h ^ (uint64_t)n) * 0x100000001b3ull;
}

#endif
