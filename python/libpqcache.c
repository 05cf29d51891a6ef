/* libpqcache.c - pqcache.h built as a shared library for the Python binding (make lib).
   Every public pqc_* function is exported as the header declares it. The two helpers
   below do what ctypes cannot: tell the binding the C sizes of the structs it mirrors,
   and time a loop of calls without the binding's own overhead. With
   PQCPY_NO_LIBRARY_IMPLEMENTATION defined, the helpers alone: link pqcache.h's
   implementation compiled elsewhere (make lib links build/pqcache_lib.o). */
#if !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE)
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#endif
#ifndef PQCPY_NO_LIBRARY_IMPLEMENTATION
#define PQCACHE_IMPLEMENTATION
#endif
#include "../pqcache.h"

#include <string.h>
#include <time.h>

/* sizeof the public struct named `name`, 0 for a name not in the table */
size_t pqcpy_sizeof(const char *name)
{
#define PQCPY_SIZE(T) if (strcmp(name, #T) == 0) return sizeof(T)
    if (!name) return 0;
    PQCPY_SIZE(pqc_allocator);
    PQCPY_SIZE(pqc_matrix);
    PQCPY_SIZE(pqc_runtime_desc);
    PQCPY_SIZE(pqc_pq_desc);
    PQCPY_SIZE(pqc_pq);
    PQCPY_SIZE(pqc_codes);
    PQCPY_SIZE(pqc_scratch);
    PQCPY_SIZE(pqc_search_desc);
    PQCPY_SIZE(pqc_scheduler_desc);
    PQCPY_SIZE(pqc_scheduler_fit);
    PQCPY_SIZE(pqc_backend_i);
    PQCPY_SIZE(pqc_backend);
    PQCPY_SIZE(pqc_cache_desc);
    PQCPY_SIZE(pqc_kv_device);
    PQCPY_SIZE(pqc_layer_stats);
    PQCPY_SIZE(pqc_head_plan);
    PQCPY_SIZE(pqc_selection);
    PQCPY_SIZE(pqc_kv_out);
    PQCPY_SIZE(pqc_kv_view);
    PQCPY_SIZE(pqc_engine);
    PQCPY_SIZE(pqc_cuda_info);
#undef PQCPY_SIZE
    return 0;
}

/* Runs pqc_cache_select `reps` times on the same layer, queries and selection, and
   stores the wall-clock seconds of the whole loop in *seconds. Stops at the first
   failure and returns its result (its message is pqc_last_error()). */
pqc_result pqcpy_time_select(pqc_cache *c, int layer, const float *q, pqc_selection *sel, int reps, double *seconds)
{
    struct timespec t0, t1;
    pqc_result r = PQC_SUCCESS;
    int i;
    if (!seconds || reps < 1) return PQC_ERROR_INVALID_ARGUMENT;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (i = 0; i < reps && r == PQC_SUCCESS; i++) r = pqc_cache_select(c, layer, q, sel);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return r;
}
