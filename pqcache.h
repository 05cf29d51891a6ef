/* pqcache.h - product-quantization KV-cache selection for long-context LLM decoding.

   An embedded, single-header C library implementing PQCache (Zhang et al., SIGMOD 2025):
   every key and value stays in host memory; per layer and KV head the keys are compressed
   with product quantization (k-means codebooks + codes); each decode step scores every past
   token from the codes, fetches only the top-k tokens' K/V through a small device-side block
   cache, and attends over sinks + top-k + the recent window.

   USAGE
   -----
   Do this in *one* C or C++ file, before any other #include:

       #define PQCACHE_IMPLEMENTATION
       #include "pqcache.h"

   Every other file just includes "pqcache.h". The implementation needs POSIX (pthreads,
   clock_gettime, dlopen); it defines _POSIX_C_SOURCE itself when nothing was included
   before it. Link with -lm -lpthread (and -ldl on glibc older than 2.34). Nothing else:
   CUDA, NVRTC and cuBLASLt are opened at run time when present (cuBLASLt is optional).

   GPU: a runtime created with backend PQC_BACKEND_CUDA (or AUTO, where a GPU is usable)
   compiles the kernels of pqcache_kernels.cu (embedded below) with NVRTC, and every
   sequence cache made on it keeps its device tier on the GPU. Environment:
   PQC_CUDA_DRIVER_PATH (a libcuda to open instead of libcuda.so.1), PQC_NVRTC_PATH,
   PQC_CUBLASLT_PATH (the cuBLASLt library to use, and no other; when it cannot be
   opened cuBLASLt is not used), PQC_KMEANS_GEMM (0 or 1: the assignment step of the
   k-means on the GPU by the hand-written kernel, or as a cuBLASLt GEMM X C^T followed by
   an argmin kernel; unset, the runtime times both the first time it meets a shape of
   problem and keeps the faster; without cuBLASLt the kernel is always used),
   PQC_LUT_GEMM (0 or 1: the lookup tables of pqc_batch_select's sequences built per
   sequence by the table kernel, or for the whole batch as one pointer-array cuBLASLt
   matmul; unset, timed and chosen the same way).

   RECIPE
   ------
     1. pqc_runtime_create        a thread pool (or your engine's) and the device tier
     2. pqc_cache_create          one per request: layers, heads, budget, PQ settings
     3. pqc_cache_observe         per layer, optional: the prompt's last queries (they shape
                                  the codebooks and the heads' shares of the top-k)
        pqc_cache_prefill         per layer: the prompt's K/V; the PQ build starts behind it
     4. per decode step and layer:
          pqc_cache_append        the new token's K/V
          pqc_cache_select        sinks + top-k + window for this step's queries
          pqc_cache_fetch         the selected K/V, through the block cache
        (or pqc_driver_prefill / pqc_driver_decode over two callbacks of your engine)
     5. pqc_cache_destroy, pqc_runtime_destroy
   Reuse: pqc_cache_fork starts a request from another's prefix (a system prompt, a
   document) without copying its K/V or rebuilding; pqc_cache_save / pqc_cache_load keep
   a cache across processes.

   CONTENTS OF THE IMPLEMENTATION (each section opens with a banner "N. Title"; grep
   for it; every section depends only on those above it, which tests/header_toc.sh
   checks: the one declaration ahead of its definition is the device table's getter in
   section 1, through which sections 2-14 reach the CUDA code of 16 and 17)
     1. Base                  results, messages, allocation, the size helper, files,
                              half precision, the device table
     2. Runtime and thread pool
     3. CPU kernels           scalar references, AVX2, AVX-512, NEON, run-time dispatch
     4. Scratch memory
     5. Top-k                 radix select
     6. PQ codebook training  k-means++ seeding, Lloyd iterations (their GPU loop is the
                              device table's)
     7. Codes and encoding
     8. Search                lookup tables, scans, GQA combination, the exact reference
     9. Scheduler             the adaptive T_max fits and the calibration file
    10. Slot memory           pqc_backend: where block-cache slots live (host memory by
                              default; an engine may hand its own)
    11. Sequence cache        the configuration, the device-tier table and the plan's
                              fixed part, token store, builds, prefill, append, the step
                              plan, select
    12. Block cache and fetch  admission (shared by every tier), the host tier, the
                              device step, cache creation
    13. Files and forks       cache files, prefix sharing, what a cache holds
    14. Batches and driver    Algorithms 1 and 2 over the engine's callbacks
    15. Kernel source         pqcache_kernels.cu as a string
    16. CUDA loader           driver API, NVRTC, kernel cache, module (dlopen)
    17. CUDA device tier      and the device table of a build with the loader

   CONFIGURATION MACROS (define before including the implementation)
   ----------------------------------------------------------------
   PQCACHE_STATIC         make every public function static (private to one file).
   PQCDEF                 decoration of public functions; default `extern`, or
                          `static` under PQCACHE_STATIC.
   PQC_MALLOC(sz, ctx)    compile-time allocator; define PQC_MALLOC and PQC_FREE together
   PQC_FREE(p, ctx)       or neither. Default: malloc/free. `ctx` is the user pointer of
                          the run-time allocator (pqc_allocator.user), so one can carry
                          state. A run-time allocator given in a desc takes precedence.
   PQC_ASSERT(x)          internal invariant check; default assert(x). Never used for
                          input validation: bad input always returns a result code.
   PQCACHE_NO_SIMD        compile only the portable scalar kernels. Otherwise the SIMD
                          kernels are chosen at run time (pqc_runtime_desc.simd): AVX2
                          and AVX-512 on x86, NEON on AArch64 (little-endian), each
                          bit for bit equal to the scalar ones.
   PQCACHE_NO_THREADS     no pthreads: jobs run inline on the calling thread (n_threads is
                          then ignored with a warning; an engine job callback, which would
                          need the library's locks, gives PQC_ERROR_UNSUPPORTED).
   PQCACHE_NO_CUDA        leave out the run-time CUDA loader.

   CONVENTIONS
   -----------
   - Every function returns a pqc_result (0 = PQC_SUCCESS) unless it cannot fail;
     pqc_result_description() gives a message, and pqc_last_error() the detailed message
     of the last failure on the calling thread. Bad input never crashes, exits or aborts,
     and a failed call leaves its outputs and objects as they were (a driver call that
     fails part-way gives back its tokens at every layer; see pqc_driver_prefill).
   - Files: every file read must be a regular file (a FIFO or device is refused, never
     waited on); files are written to a temporary name and renamed into place.
   - Sizes derived from caller-supplied counts are checked for overflow before use.
   - Descs are zero-initialised structs in which 0 means "the documented default".
   - Public names are pqc_*, macros PQC_*; pqc__* is private.
   - Thread safety is stated per function. Objects are not internally locked unless said.

   LICENSE: MIT, see the end of this file.
*/
#if defined(PQCACHE_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_WIN32)
#define _POSIX_C_SOURCE 200809L
#endif

#ifndef PQCACHE_H
#define PQCACHE_H

#include <stddef.h>
#include <stdint.h>

#define PQCACHE_VERSION_MAJOR 0
#define PQCACHE_VERSION_MINOR 1
#define PQCACHE_VERSION_PATCH 0
#define PQCACHE_VERSION_STRING "0.1.0"

#ifndef PQCDEF
#ifdef PQCACHE_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define PQCDEF static __attribute__((unused))
#else
#define PQCDEF static
#endif
#else
#define PQCDEF extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------
   Base: results, versions, allocator, logging
   ------------------------------------------------------------------------------------- */

typedef enum pqc_result {
    PQC_SUCCESS = 0,
    PQC_ERROR_INVALID_ARGUMENT = -1, /* null pointer, zero-sized or out-of-range value   */
    PQC_ERROR_BAD_SHAPE = -2,        /* m does not divide d_h, wrong dims, bad strides   */
    PQC_ERROR_OUT_OF_RANGE = -3,     /* bits not in 1..8, k > s, layer or head too big   */
    PQC_ERROR_NON_FINITE = -4,       /* NaN or Inf in keys or queries                    */
    PQC_ERROR_OUT_OF_MEMORY = -5,    /* an allocation failed                              */
    PQC_ERROR_EMPTY = -6,            /* an empty sequence where tokens are required       */
    PQC_ERROR_BAD_STATE = -7,        /* call out of order (append before prefill, ...)    */
    PQC_ERROR_CAPACITY = -8,         /* a prompt or sequence longer than configured       */
    PQC_ERROR_THREAD = -9,           /* a worker thread could not be started              */
    PQC_ERROR_JOB_FAILED = -10,      /* an asynchronous build failed; see the message     */
    PQC_ERROR_IO = -11,              /* a file could not be opened, read or written       */
    PQC_ERROR_BAD_FILE = -12,        /* a damaged, truncated or foreign file              */
    PQC_ERROR_NO_DEVICE = -13,       /* no GPU, no driver, or no usable device            */
    PQC_ERROR_BACKEND = -14,         /* a backend (CUDA, NVRTC) call failed               */
    PQC_ERROR_CALLBACK = -15,        /* an engine callback reported failure               */
    PQC_ERROR_UNSUPPORTED = -16      /* a valid request this build cannot serve           */
} pqc_result;

/* Short, static description of a result code. Thread-safe. */
PQCDEF const char *pqc_result_description(pqc_result r);
/* Detailed message of the last failure on this thread ("" if none). Thread-safe. */
PQCDEF const char *pqc_last_error(void);
PQCDEF const char *pqc_version(void); /* "MAJOR.MINOR.PATCH" */
PQCDEF unsigned pqc_version_number(void); /* MAJOR*10000 + MINOR*100 + PATCH */

typedef struct pqc_allocator {
    void *(*alloc)(size_t size, void *user); /* must return memory aligned for any type */
    void (*free)(void *ptr, void *user);     /* free(NULL) must be harmless             */
    void *user;
} pqc_allocator;

typedef enum pqc_log_level { PQC_LOG_ERROR = 0, PQC_LOG_WARN = 1, PQC_LOG_INFO = 2, PQC_LOG_DEBUG = 3 } pqc_log_level;
typedef void (*pqc_log_fn)(void *user, pqc_log_level level, const char *message);

/* Element types of keys, values and queries. */
typedef enum pqc_dtype { PQC_F32 = 0, PQC_F16 = 1, PQC_BF16 = 2 } pqc_dtype;
PQCDEF size_t pqc_dtype_size(pqc_dtype t); /* 4, 2, 2; 0 for an unknown type */

/* A strided 2-D view of rows x cols elements of one dtype; row_stride in bytes
   (0 means tightly packed: cols * element size). */
typedef struct pqc_matrix {
    const void *data;
    pqc_dtype dtype;
    size_t rows;
    size_t cols;
    size_t row_stride;
} pqc_matrix;

/* A packed fp32 matrix view: rows x cols floats, row after row. */
PQCDEF pqc_matrix pqc_matrix_f32(const float *data, size_t rows, size_t cols);

/* fp16 / bf16 conversions (round to nearest even; NaN stays NaN). Thread-safe. */
PQCDEF float pqc_f16_to_f32(uint16_t h);
PQCDEF uint16_t pqc_f32_to_f16(float f);
PQCDEF float pqc_bf16_to_f32(uint16_t h);
PQCDEF uint16_t pqc_f32_to_bf16(float f);

/* ---------------------------------------------------------------------------------------
   Runtime: thread pool, CPU kernel selection, backend. One per process or per engine.
   ------------------------------------------------------------------------------------- */

typedef enum pqc_simd {
    PQC_SIMD_AUTO = 0,   /* best the processor reports (default)            */
    PQC_SIMD_SCALAR = 1, /* portable C reference kernels                    */
    PQC_SIMD_AVX2 = 2,   /* AVX2 + FMA                                      */
    PQC_SIMD_AVX512 = 3, /* AVX-512 F/BW/VL/DQ                              */
    PQC_SIMD_NEON = 4    /* AArch64 Advanced SIMD (every AArch64 processor) */
} pqc_simd;

/* An engine that owns a thread pool can run the library's jobs on it: submit must
   arrange for fn(arg) to be called exactly once, on any thread, and return 0; a non-zero
   return means "could not submit" and the library runs the job inline instead. */
typedef int (*pqc_submit_fn)(void *user, void (*fn)(void *arg), void *arg);

/* Where the device tier lives. AUTO uses a CUDA GPU when one is usable and otherwise
   runs on the CPU, saying why through pqc_runtime_backend_note and the log; CUDA asks
   for the GPU explicitly, and pqc_runtime_create fails (PQC_ERROR_NO_DEVICE, or
   PQC_ERROR_BACKEND when the kernels cannot be built) when it cannot be had. With a GPU,
   the runtime opens the device, compiles the kernels with NVRTC for its architecture
   (or loads them from the kernel cache) and every sequence cache created on it keeps
   its device tier there: see "Sequence cache" below. */
typedef enum pqc_backend_kind { PQC_BACKEND_CPU = 0, PQC_BACKEND_AUTO = 1, PQC_BACKEND_CUDA = 2 } pqc_backend_kind;

typedef struct pqc_runtime_desc {
    int n_threads;           /* worker threads; 0 = PQC_DEFAULT_THREADS; -1 = none (inline) */
    pqc_simd simd;           /* 0 = auto                                               */
    pqc_allocator allocator; /* all-zero = PQC_MALLOC/PQC_FREE                        */
    pqc_log_fn log;          /* optional                                               */
    void *log_user;
    pqc_log_level log_level; /* 0 = errors only                                        */
    pqc_submit_fn submit;    /* optional engine pool; overrides n_threads when set      */
    void *submit_user;
    int backend;             /* a pqc_backend_kind; 0 = CPU                             */
    int cuda_device;         /* CUDA device ordinal (CUDA / AUTO)                       */
    const char *cuda_kernel_cache; /* directory of compiled kernels, keyed by architecture,
                                NVRTC version and source hash; NULL = $XDG_CACHE_HOME/
                                pqcache or ~/.cache/pqcache; "-" = compile every time      */
} pqc_runtime_desc;

#define PQC_DEFAULT_THREADS 1 /* what 0 means for n_threads */

typedef struct pqc_runtime pqc_runtime;

/* Creates a runtime. Fails with PQC_ERROR_THREAD if workers cannot start,
   PQC_ERROR_UNSUPPORTED if a SIMD level is forced that the processor lacks. */
PQCDEF pqc_result pqc_runtime_create(const pqc_runtime_desc *desc, pqc_runtime **out);
/* Waits for every job, then frees. NULL is a no-op. Not thread-safe with other calls. */
PQCDEF void pqc_runtime_destroy(pqc_runtime *rt);
PQCDEF pqc_simd pqc_runtime_simd(const pqc_runtime *rt);   /* the level in use */
PQCDEF pqc_simd pqc_cpu_best_simd(void);                    /* what the CPU offers */
PQCDEF int pqc_runtime_threads(const pqc_runtime *rt);
/* The backend in use, and a sentence on how it was chosen ("" for a plain CPU runtime). */
PQCDEF pqc_backend_kind pqc_runtime_backend(const pqc_runtime *rt);
PQCDEF const char *pqc_runtime_backend_note(const pqc_runtime *rt);
PQCDEF const char *pqc_simd_name(pqc_simd s);

/* ---------------------------------------------------------------------------------------
   Product quantization: codebooks, codes, lookup tables, search, top-k
   ------------------------------------------------------------------------------------- */

typedef enum pqc_init {
    PQC_INIT_KMEANSPP = 0, /* D^2 seeding (default): far, rare keys get their own centroid */
    PQC_INIT_RANDOM = 1    /* 2^b distinct random training points (the authors' choice)    */
} pqc_init;

/* How the engine rotates keys and queries (RoPE): which dims form a rotation pair. Pair i
   turns by pos * base^(-2i/d_h), so low i is fast (position), high i slow (content). */
typedef enum pqc_rope {
    PQC_ROPE_NONE = 0,       /* no rotation, or not stated (default)                     */
    PQC_ROPE_HALF = 1,       /* pair i = dims (i, i + d_h/2): Hugging Face Llama, Mistral,
                                Qwen ("rotate_half")                                      */
    PQC_ROPE_INTERLEAVED = 2 /* pair i = dims (2i, 2i+1): llama2.c, GPT-J, GGML's "norm"  */
} pqc_rope;

/* Which dims form sub-space j. */
typedef enum pqc_subspaces {
    PQC_SUBSPACES_DEFAULT = 0,    /* rope bands where pq.rope states a layout and m divides
                                     d_h/2, else contiguous                               */
    PQC_SUBSPACES_ROPE_BANDS = 1, /* whole rotation pairs, band j of the frequencies: pairs
                                     [j P/m, (j+1) P/m) of the P = d_h/2 pairs, so slow
                                     (content) pairs share sub-spaces and fast (position)
                                     pairs share others. Needs a rope layout and m dividing
                                     d_h/2. For PQC_ROPE_INTERLEAVED the same dims as
                                     contiguous; for PQC_ROPE_HALF sub-space j is dims
                                     [j h, (j+1) h) and [d_h/2 + j h, d_h/2 + (j+1) h),
                                     h = d_h/(2m), in that order                         */
    PQC_SUBSPACES_CONTIGUOUS = 2  /* dims [j d_h/m, (j+1) d_h/m)                          */
} pqc_subspaces;

typedef struct pqc_pq_desc {
    int m;                       /* sub-spaces; must divide d_h. 0 = the default: d_h/32
                                    (codes of 1/64 of an fp16 key's bytes at 8 bits) and at
                                    least PQC_DEFAULT_M, where that divides d_h (and d_h/2
                                    for rope bands); else PQC_DEFAULT_M, 2 or 1, the
                                    largest that divides                                  */
    int bits;                    /* bits per code, 1..8 (2^bits centroids). 0 = the default */
    int iters;                   /* Lloyd iterations T. 0 = the default (PQC_DEFAULT_ITERS;
                                    in a cache with a scheduler, the scheduler's choice);
                                    negative = none (the seeding alone)                   */
    pqc_init init;               /* 0 = k-means++                                           */
    int max_points_per_centroid; /* training sample cap per centroid; 0 = the default;
                                    negative = none (every point trains)                  */
    uint64_t seed;               /* results depend only on seed and data, never on threads */
    double *objective;           /* optional out: m * (iters + 1) values, the k-means
                                    objective (mean squared error of the training sample
                                    in that sub-space) after init and after each iteration */
    int device;                  /* 1: the Lloyd iterations run on the runtime's CUDA GPU
                                    (seeding and sampling stay on the CPU; sub-spaces over
                                    256 dims stay on the CPU). The GPU adds cluster sums
                                    in no fixed order, so results vary in the last bits
                                    and with the run. Needs a CUDA runtime, else
                                    PQC_ERROR_NO_DEVICE. 0 (default): the CPU          */
    const float *metric;         /* optional: d_h per-dimension weights w of the distance
                                    that training and coding minimise, sum_e w_e (x_e -
                                    c_e)^2 (positive, finite, max/min <= 1e12; copied).
                                    With w = the mean squared query per dimension, that
                                    distance is the expected squared error of q.k: the
                                    codebook spends its centroids where queries look
                                    (score-aware quantization). NULL: Euclidean        */
    pqc_rope rope;               /* the keys' RoPE layout (default none). The sequence
                                    cache ties the metric's weights within each pair:
                                    rotation moves a pair's energy between its two dims */
    pqc_subspaces subspaces;     /* 0 = PQC_SUBSPACES_DEFAULT (resolved to one of the two) */
    const float *metric_blocks;  /* optional, instead of metric: m symmetric positive
                                    definite matrices W_j [m][d_h/m][d_h/m] (row-major, in
                                    sub-space element order, pqc_pq_dim) of the distance
                                    sum_j (x_j - c_j)^T W_j (x_j - c_j) that training and
                                    coding minimise (copied). It weighs directions, not
                                    only dims: with W_j = the queries' second moments over
                                    sub-space j's dims it is the expected squared error of
                                    q.k where the queries' dims are correlated. Finite,
                                    symmetric to 1e-6 of its largest entry, and positive
                                    definite with no Cholesky pivot below 1e-12 of its
                                    largest diagonal entry. NULL: none                   */
} pqc_pq_desc;

/* What 0 means in a pqc_pq_desc. Every desc of the library follows one rule: 0 is the
   default (a PQC_DEFAULT_ constant), and where an option can be nothing (no sinks, no
   block cache, no iterations, ...) a negative value means none. */
#define PQC_DEFAULT_M 4    /* the fewest by default: with 8 bits 4 bytes of codes per  */
#define PQC_DEFAULT_BITS 8 /* token and KV head, 1/64 of a 128-wide fp16 key (the
                              paper's operating point); wider keys get d_h/32 (m 8 at 256) */
#define PQC_DEFAULT_ITERS 10
#define PQC_DEFAULT_MAX_POINTS_PER_CENTROID 256

/* A trained product quantizer for one (layer, KV head). Fields are read-only. */
typedef struct pqc_pq {
    int dim;          /* d_h                          */
    int m;            /* sub-spaces                   */
    int bits;         /* bits per code                */
    int ksub;         /* 2^bits centroids             */
    int dsub;         /* dim / m                      */
    int ksub_pad;     /* ksub rounded up to 16        */
    float *centroids; /* [m][ksub][dsub]              */
    float *cent_t;    /* [m][dsub][ksub_pad], private */
    float *cnorm;     /* [m][ksub_pad], private       */
    float *metric;    /* [dim] the desc's weights, or NULL (Euclidean)      */
    float *wnorm;     /* [m][ksub_pad] weighted centroid norms, private     */
    int half_bands;   /* 1: rope bands over the half-split layout: element e of
                         sub-space j is dim pqc_pq_dim(pq, j, e); 0: j*dsub + e */
    pqc_allocator alloc;
    float *mblocks;   /* [m][dsub][dsub] the desc's metric blocks, or NULL      */
    float *wcent_t;   /* [m][dsub][ksub_pad] W_j c transposed, private (blocks) */
    float *mchol;     /* [m][dsub][dsub] the blocks' Cholesky factors L_j (W_j = L_j
                         L_j^T, lower, row-major), private                       */
} pqc_pq;

/* The key dim of element e of sub-space j (centroid element e of sub-space j). */
PQCDEF int pqc_pq_dim(const pqc_pq *pq, int j, int e);

/* PQ codes of a growing sequence: column-major, one bit-packed column per sub-space;
   token t's code in sub-space j is bits [t*bits, t*bits+bits) of column j (LSB first). */
typedef struct pqc_codes {
    int m;
    int bits;
    size_t count;      /* tokens coded                        */
    size_t capacity;   /* tokens that fit without growing     */
    size_t col_stride; /* bytes between columns               */
    unsigned char *data;
    pqc_allocator alloc;
} pqc_codes;

/* Trains a PQ on the rows of keys (cols = d_h). The m sub-space jobs run on the runtime's
   pool; the result is identical for any thread count. rt may be NULL (inline, the best
   SIMD level the processor offers, default allocator). On failure *out is untouched. */
PQCDEF pqc_result pqc_pq_train(pqc_runtime *rt, const pqc_pq_desc *desc, const pqc_matrix *keys, pqc_pq *out);
PQCDEF void pqc_pq_free(pqc_pq *pq);
/* Mean squared reconstruction error (sum over dims, mean over rows) of keys under pq. */
PQCDEF pqc_result pqc_pq_mse(pqc_runtime *rt, const pqc_pq *pq, const pqc_matrix *keys, double *mse);
/* Reconstructs token t's key from its codes into out[dim]. */
PQCDEF pqc_result pqc_pq_decode(const pqc_pq *pq, const pqc_codes *codes, size_t t, float *out);
/* A trained quantizer to and from a file. The file, little-endian throughout:
     8 bytes  "PQCPQ\0\0\0"      4 bytes  format version (1)
     4 bytes  dim, m, bits, flags each (flags: 1 = metric weights present,
              2 = rope bands over the half-split layout, 4 = metric blocks present)
     m * 2^bits * dim/m floats: the centroids ([m][2^bits][dim/m], IEEE binary32),
     then dim floats of metric weights when flag 1 is set, then m * (dim/m)^2 floats
     of metric blocks when flag 4 is set
     8 bytes  FNV-1a 64 of everything before it
   Saving writes a temporary file next to path and renames it into place. Loading
   refuses a truncated, damaged or foreign file (PQC_ERROR_BAD_FILE), something other
   than a regular file (PQC_ERROR_IO), and leaves *out untouched on any failure; the
   loaded quantizer codes and searches exactly as the saved one. */
PQCDEF pqc_result pqc_pq_save(const pqc_pq *pq, const char *path);
PQCDEF pqc_result pqc_pq_load(pqc_runtime *rt, const char *path, pqc_pq *out);

PQCDEF pqc_result pqc_codes_init(pqc_codes *codes, const pqc_pq *pq, size_t capacity, const pqc_allocator *alloc);
PQCDEF void pqc_codes_free(pqc_codes *codes);
PQCDEF pqc_result pqc_codes_reserve(pqc_codes *codes, size_t capacity);
/* Exact bytes the codes of `count` tokens take: m * ceil(count * bits / 8). */
PQCDEF size_t pqc_codes_bytes(const pqc_codes *codes);
/* Appends the codes of keys' rows (nearest centroid per sub-space, ties to the lower
   index). On failure nothing is appended. */
PQCDEF pqc_result pqc_pq_encode(pqc_runtime *rt, const pqc_pq *pq, const pqc_matrix *keys, pqc_codes *codes);
PQCDEF unsigned pqc_codes_get(const pqc_codes *codes, size_t t, int j);

/* How the g query heads that share one KV head are combined into one score per token. */
typedef enum pqc_gqa {
    PQC_GQA_SOFTMAX_SUM = 0, /* default, the authors': per head softmax(q.k / sqrt(d_h)) over
                                all tokens, probabilities summed over the heads. Over 8-bit
                                codes and two or more heads, a PQ search takes a token's
                                exponential as the product of per-sub-space tables of
                                exponentials (no exponential per token and head): the same
                                probabilities to a few units in the last place             */
    PQC_GQA_SUM = 1          /* plain sum of the heads' raw scores = score of the summed query;
                                one table and one scan, g times cheaper                     */
} pqc_gqa;

/* Reusable scratch memory for searches; zero-initialise, pqc_scratch_free when done.
   One scratch per thread. */
typedef struct pqc_scratch {
    void *buf;
    size_t size;
    pqc_allocator alloc;
} pqc_scratch;
PQCDEF void pqc_scratch_free(pqc_scratch *s);

typedef struct pqc_search_desc {
    size_t k;         /* tokens to return, 1..s                                       */
    pqc_gqa gqa;      /* 0 = softmax-sum                                              */
    size_t first;     /* search tokens [first, first+count) of the codes (0, 0 = all) */
    size_t count;
    double rerank;    /* 0 = off; >= 1: the top ceil(rerank * k) by PQ score are scored
                         again with the exact keys (pqc_rerank) and the best k kept      */
    const pqc_matrix *keys; /* with rerank: the exact keys, row t = token t of the codes */
    /* residual-aware scoring: each head's score of token t gains residual_weight * sum_j
       |q_j| * residual_scale[j] * residuals[t * m + j] (an optimistic bound on the q.r
       the code dropped when the weight is 1), with the residual bytes of pqc_pq_residuals */
    const uint8_t *residuals;     /* NULL = off; m bytes per token, row t = token t       */
    const float *residual_scale;  /* [m] the norm of one step of sub-space j's bytes       */
    float residual_weight;        /* > 0 with residuals                                   */
    float softmax_scale; /* softmax-sum: each head's softmax is over score x this; 0 = the
                            default 1/sqrt(d_h); negative, NaN or Inf is refused         */
} pqc_search_desc;

/* Residual norms for residual-aware scoring: for rows [0, keys->rows) of keys (their
   codes at tokens first.. of codes), out[i * m + j] = the norm of the residual of
   sub-space j (key minus its centroid, Euclidean) in steps of scale[j], rounded up and
   capped at 255. scale[j] <= 0 on entry: set to the largest of these norms / 255 (so
   nothing is capped); otherwise used as given (tokens coded later, against the scale of
   the build). */
PQCDEF pqc_result pqc_pq_residuals(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, size_t first,
                                   const pqc_matrix *keys, float *scale, uint8_t *out);
/* Builds the lookup table lut[g][m][ksub] (query head x centroid dot products). */
PQCDEF pqc_result pqc_pq_lut(pqc_runtime *rt, const pqc_pq *pq, const float *queries, int g, float *lut);
/* Approximate top-k for g query heads (queries: g x d_h fp32) over the codes: writes k
   token indices in ascending order to idx and, when scores is not NULL, their combined
   approximate scores. Ties are broken towards the lower index. scratch may be NULL. */
PQCDEF pqc_result pqc_pq_search(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries,
                                int g, const pqc_search_desc *desc, pqc_scratch *scratch, uint32_t *idx,
                                float *scores);
/* All combined approximate scores (out[count]) without selection. */
PQCDEF pqc_result pqc_pq_scores(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries,
                                int g, const pqc_search_desc *desc, pqc_scratch *scratch, float *out);
/* Exact reference: true scores of keys' rows under the same GQA combination, then the
   same top-k. The yardstick for recall: what a perfect selector would pick. Softmax-sum
   at desc->softmax_scale; pqc_exact_scores and pqc_rerank below at 1/sqrt(d_h). */
PQCDEF pqc_result pqc_exact_search(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g,
                                   const pqc_search_desc *desc, pqc_scratch *scratch, uint32_t *idx, float *scores);
PQCDEF pqc_result pqc_exact_scores(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                                   pqc_scratch *scratch, float *out);
/* Re-ranking: exact scores of the n candidate rows `cand` of keys (strictly ascending row
   indices), the g heads combined as gqa says over the candidates alone (softmax-sum: each
   head's softmax over the n candidates, summed), and their top k: k row indices (values
   of cand) ascending, ties to the lower index; scores, when not NULL, their combined
   scores. idx may be cand itself. Cost: n key rows read, n*g dot products. */
PQCDEF pqc_result pqc_rerank(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                             const uint32_t *cand, size_t n, size_t k, pqc_scratch *scratch, uint32_t *idx,
                             float *scores);
/* O(n) top-k of n scores (radix select): k indices ascending, ties to the lower index.
   NaN scores are rejected. */
PQCDEF pqc_result pqc_topk(pqc_runtime *rt, const float *scores, size_t n, size_t k, pqc_scratch *scratch,
                           uint32_t *idx, float *out_scores);
/* Fraction of `truth` (n_truth indices) found in `got` (n_got indices, ascending). */
PQCDEF double pqc_recall(const uint32_t *truth, size_t n_truth, const uint32_t *got, size_t n_got);


/* ---------------------------------------------------------------------------------------
   Adaptive T_max scheduler
   k-means time per (layer, KV head) ~ a1 + b1*s*T; the engine's per-layer prefill compute
   ~ a2 + b2*s + g2*s^2. Both are fitted by least squares as samples arrive, and
   T_max(s) = (g2*s^2 + b2*s + a2 - a1) / (b1*s), clipped to [t_min, t_max], is the largest
   iteration count whose clustering still hides behind the compute.
   Thread safety: a scheduler is internally locked; share one between caches freely.
   ------------------------------------------------------------------------------------- */

typedef struct pqc_scheduler pqc_scheduler;

typedef struct pqc_scheduler_desc {
    int t_min;        /* 0 = PQC_DEFAULT_T_MIN */
    int t_max;        /* 0 = PQC_DEFAULT_T_MAX; at most 100000, the PQ core's limit */
    int t_default;    /* iterations used before both fits exist; 0 = PQC_DEFAULT_ITERS */
    double parallel;  /* k-means jobs that run side by side (worker threads); 0 = 1 */
    pqc_allocator allocator;
} pqc_scheduler_desc;

/* What 0 means in a pqc_scheduler_desc */
#define PQC_DEFAULT_T_MIN 3
#define PQC_DEFAULT_T_MAX 300
#define PQC_DEFAULT_PARALLEL 1.0

typedef struct pqc_scheduler_fit {
    double a1, b1;      /* k-means: seconds = a1 + b1*s*T          */
    double a2, b2, g2;  /* compute: seconds = a2 + b2*s + g2*s^2   */
    int n1, n2;         /* samples behind each fit                 */
} pqc_scheduler_fit;

PQCDEF pqc_result pqc_scheduler_create(const pqc_scheduler_desc *desc, pqc_scheduler **out);
PQCDEF void pqc_scheduler_destroy(pqc_scheduler *s);
/* One k-means measurement: `seconds` to run T iterations over s keys (one KV head). */
PQCDEF pqc_result pqc_scheduler_add_kmeans(pqc_scheduler *s, double tokens, int iters, double seconds);
/* One compute measurement: the engine's prefill of one layer over s tokens. */
PQCDEF pqc_result pqc_scheduler_add_compute(pqc_scheduler *s, double tokens, double seconds);
/* Iterations for a build over s tokens whose `jobs` head builds share the layer's compute. */
PQCDEF int pqc_scheduler_iters(pqc_scheduler *s, double tokens, int jobs);
PQCDEF pqc_scheduler_fit pqc_scheduler_get_fit(pqc_scheduler *s);
PQCDEF pqc_result pqc_scheduler_set_fit(pqc_scheduler *s, const pqc_scheduler_fit *fit);
/* Calibration file: a small checksummed text file. A damaged, truncated or foreign file
   gives PQC_ERROR_BAD_FILE and leaves the scheduler as it was. */
PQCDEF pqc_result pqc_scheduler_save(pqc_scheduler *s, const char *path);
PQCDEF pqc_result pqc_scheduler_load(pqc_scheduler *s, const char *path);

/* ---------------------------------------------------------------------------------------
   Backends: where the device tier (block cache slots, sinks and window) lives.
   A backend is a small table of functions plus a context; optional entries may be NULL.
   The CPU backend keeps the device tier in its own host buffers, so hit rates and bytes
   moved are real figures. This table suits tiers the host can address (its own memory,
   another NUMA node, a pool of the engine's): the library reads slots through pointers.
   The CUDA GPU tier, where selection and gathers must run on the device, is built in:
   it is chosen by the runtime (PQC_BACKEND_CUDA / AUTO) when desc.backend is NULL.
   ------------------------------------------------------------------------------------- */

/* A fetch calls copy_h2d from several threads at once (one per KV head, on the runtime's
   pool), each into its own slots: it must be safe to call concurrently. */
typedef struct pqc_backend_i {
    const char *name;
    void *(*alloc)(void *ctx, size_t bytes);                                  /* device memory */
    void (*free)(void *ctx, void *ptr);
    int (*copy_h2d)(void *ctx, void *dst, const void *src, size_t bytes);     /* host -> device;
                                                        non-zero: failed (PQC_ERROR_BACKEND) */
    int (*synchronize)(void *ctx);                    /* optional: after a fetch's copies     */
} pqc_backend_i;

typedef struct pqc_backend {
    pqc_backend_i iface;
    void *ctx;
} pqc_backend;

/* The CPU backend (plain memory through the allocator). */
PQCDEF pqc_backend pqc_backend_cpu(const pqc_allocator *alloc);

/* ---------------------------------------------------------------------------------------
   Sequence cache: one per request. Layers x KV heads of sinks | PQ-indexed mid tokens |
   recent window, all K/V in host memory, a block cache on the device tier.
   Thread safety: one cache is driven by one thread at a time (its asynchronous builds
   run on the runtime's pool); distinct caches may be used from distinct threads.
   ------------------------------------------------------------------------------------- */

typedef enum pqc_policy {
    PQC_POLICY_LFU = 0, /* least frequently used, ties to the least recently used (default) */
    PQC_POLICY_LRU = 1  /* least recently used                                              */
} pqc_policy;

typedef enum pqc_metric {
    PQC_METRIC_QUERY = 0, /* each head's codebook minimises the expected squared error of
                             q.k over the queries its heads were observed with
                             (pqc_cache_observe; the driver observes the prompt's last
                             queries): per sub-space (a RoPE band under a rope layout) a
                             matrix W_j, the queries' second moments over its dims divided
                             by their mean diagonal entry, plus metric_floor on the
                             diagonal (pqc_pq_desc.metric_blocks). It weighs directions
                             where the queries' dims are correlated. Sub-spaces over 256
                             dims get PQC_METRIC_QUERY_DIAG's weights instead. Euclidean
                             until a head has observations (default)                     */
    PQC_METRIC_L2 = 1,    /* plain Euclidean k-means, observations ignored                */
    PQC_METRIC_QUERY_DIAG = 2 /* weights per dimension instead of matrices: the observed
                             queries' mean square, tied within each RoPE pair, divided by
                             its mean over the dims, plus metric_floor
                             (pqc_pq_desc.metric)                                        */
} pqc_metric;

typedef enum pqc_split {
    PQC_SPLIT_COMPETE = 0,  /* each KV head's share of the layer's top-k from the attention
                               the observed queries paid outside its sinks and window (the
                               even split until a build measured it); and in each head the
                               window competes, every step: its tokens but the last 16
                               (its rivals) are scored exactly with the step's queries
                               and chosen with the coded tokens by the same scores for the
                               head's top-k and their own places, so that a head that
                               attends locally keeps its window and one that does not
                               gives it to top-k (the CUDA tier does this on the
                               device). With exact scoring (rerank, on by default, or
                               outliers) the rivals join each head's candidates, which
                               are scored with the same exact scores (default)           */
    PQC_SPLIT_FIXED = 1,    /* every head takes the same top-k, every layer the window    */
    PQC_SPLIT_ADAPTIVE = 2, /* the heads share the top-k as under COMPETE; the window does
                               not compete, but with a derived window (window 0) each
                               layer's window is lowered at its builds where the observed
                               queries pay it less than the top-k would keep (see window;
                               the default before COMPETE)                               */
    PQC_SPLIT_FIXED_COMPETE = 3 /* every head takes the same top-k, as under FIXED, and in
                               each head the window competes, as under COMPETE: a head's
                               selection depends on its own keys and queries alone, so
                               that caches holding slices of the heads (tensor
                               parallelism: first_kv_head) select what one cache over
                               every head does, with the competing window (with exact
                               scoring too)                                              */
} pqc_split;

typedef struct pqc_cache_desc {
    int n_layers;            /* L                                                         */
    int n_kv_heads;          /* h_kv                                                      */
    int n_q_heads;           /* h (a multiple of h_kv); 0 = h_kv                          */
    int head_dim;            /* d_h                                                       */
    pqc_dtype kv_dtype;      /* host storage of K and V; 0 = fp32                          */
    size_t max_tokens;       /* sequence capacity; 0 = 1M. Longer prompts fail cleanly    */
    int n_sink;              /* sink tokens always attended; 0 = 4; -1 = none              */
    int window;              /* recent window in tokens, every layer's; 0 = recent_share of
                                the budget at the first prefill (under PQC_SPLIT_COMPETE,
                                the default, the window's tokens but its last 16
                                compete for their places every step), which under
                                PQC_SPLIT_ADAPTIVE is the most a layer keeps: a build
                                with observed queries weighs that window and its halves
                                (down to 16 tokens) by the attention they pay, the window
                                plus half of what the budget's other tokens would hold
                                as exact top-k, summed over the layer's heads, and keeps
                                the best (ties: the larger). A window only shrinks; its
                                budget goes to top-k (pqc_cache_layer_window)             */
    double budget_ratio;     /* tokens attended beyond the sinks: ratio * (s - sinks); 0 = 0.1 */
    size_t budget_tokens;    /* a fixed budget instead of the ratio (0 = use the ratio)   */
    double recent_share;     /* share of the budget for the window; 0 = PQC_DEFAULT_RECENT_SHARE */
    pqc_pq_desc pq;          /* m, bits, iters, init, seed as in a PQ desc (pq.iters 0: the
                                scheduler's T, with one); pq.metric must be NULL (see
                                metric below)                                             */
    pqc_metric metric;       /* distance of the PQ builds; 0 = PQC_METRIC_QUERY            */
    double metric_floor;     /* the query metric's floor: added to its normalised blocks'
                                diagonal (or weights); 0 = 1; at least 0.01 for blocks
                                (they stay positive definite in float) and head_dim x
                                1e-11 for weights (their spread stays below 1e12)        */
    int observe;             /* driver prefill: the last `observe` queries of each call are
                                observed; 0 = 32, -1 = none                               */
    pqc_split split;         /* how the heads of a layer share its top-k and whether the
                                window competes; 0 = PQC_SPLIT_COMPETE (pqc_split)        */
    pqc_gqa gqa;             /* how query heads sharing a KV head combine; 0 = softmax-sum */
    float softmax_scale;     /* the model's attention scale: each query head's softmax is
                                over q.k x this, wherever the cache weighs tokens by it
                                (softmax-sum scores, re-ranking, observed attention).
                                0 = 1/sqrt(head_dim); Gemma: query_pre_attn_scalar^-0.5.
                                Negative, NaN, Inf or above 1e6 is refused. Saved in
                                cache files: pqc_cache_load with 0 here takes the file's */
    double rerank;           /* re-ranking: each head's top ceil(rerank x k) coded tokens by
                                PQ score (plus its outlier list, and the window's rivals
                                where the window competes) are scored again with the
                                exact stored keys in host memory (softmax-sum, each query
                                head's softmax over those candidates, the sinks and the
                                window: as the attention over what the head attends
                                weighs them) and the best kept. 0 =
                                PQC_DEFAULT_RERANK (1.5); negative = off (the PQ top-k
                                alone); else at least 1. A head whose build observed
                                queries may take more (rerank_max)                       */
    int outliers;            /* outlier list: per head, the coded tokens its codebook serves
                                worst (largest residual, weighted by the head's metric),
                                `outliers` of them at each build plus up to as many coded
                                since whose residual beats the build's smallest; they join
                                the candidates that are scored exactly each step (with
                                rerank 0 the candidates are the PQ top-k). 0 = none
                                (default; negative: none too); 4 bytes per listed token   */
    double residual_weight;  /* residual-aware scoring (pqc_search_desc.residuals): each
                                coded token keeps its m residual norms (m bytes, weighted
                                by the head's metric) and each head's score gains this
                                times sum_j |q_j| |r_j|, a share of the optimistic bound.
                                0 = off (default; negative: off); best near 0.15. On the CUDA
                                tier the search then runs on the host                    */
    int block_tokens;        /* block size of the block cache; 0 = 128                    */
    int cache_blocks;        /* blocks per layer and KV head; 0 = 32; -1 = no block cache */
    pqc_policy policy;       /* 0 = LFU                                                   */
    int admit_blocks;        /* blocks admitted after each selection; 0 = cache_blocks;
                                -1 = none (the cache holds what the window leaves)        */
    double rebuild_share;    /* re-cluster a layer once this share of its coded tokens was
                                coded without retraining; 0 = 0.5; negative (or >= 1) =
                                never                                                     */
    pqc_scheduler *scheduler;/* optional: picks T for each build when pq.iters is 0        */
    const pqc_backend *backend; /* device tier; NULL = the runtime's (CUDA GPU or CPU)   */
    void *cuda_stream;       /* CUDA runtime: the engine's CUstream (cudaStream_t); every
                                device step of this cache is ordered on it. NULL = a
                                stream of the cache's own                                 */
    int codes_resident;      /* CUDA runtime: 1 = every layer's codes stay in device memory
                                (updated in place as tokens are coded: no copies per step);
                                0 = two code buffers, the next layer's codes copied while
                                the current layer computes (device memory for two layers) */
    int first_kv_head;       /* the model's index of this cache's KV head 0, where caches
                                hold a slice of the heads (a tensor-parallel rank's): head
                                h's codebooks are seeded as model head first_kv_head + h,
                                so that the slices build and select what one cache over
                                every head would (with split = PQC_SPLIT_FIXED or
                                PQC_SPLIT_FIXED_COMPETE, whose heads' selections do not
                                depend on each other). 0 = 0                             */
    double rerank_max;       /* re-ranking per head: each build with observed queries
                                (pqc_cache_observe) measures on them how far down its new
                                codebook's PQ ranking the exact top-k's attention lies,
                                and gives its head the smallest factor (in steps of 0.1,
                                from rerank up to rerank_max) whose candidates hold 0.998
                                of that attention; a head whose codebook ranks the tokens
                                that matter well keeps rerank. Heads without such a build
                                use rerank. 0 = PQC_DEFAULT_RERANK_MAX (6); negative =
                                none (every head rerank); at most 1e6. pqc_cache_head_plan
                                gives a head's candidates                                 */
} pqc_cache_desc;

/* What 0 means in a pqc_cache_desc (the rule of every desc: 0 = the default, negative =
   none, for n_sink, observe, cache_blocks, admit_blocks, rebuild_share, rerank, rerank_max, outliers,
   residual_weight and pq.iters; pq's own defaults are the PQC_DEFAULT_ of a PQ desc). */
#define PQC_DEFAULT_MAX_TOKENS ((size_t)1 << 20)
#define PQC_DEFAULT_N_SINK 4
#define PQC_DEFAULT_RERANK 1.5
#define PQC_DEFAULT_RERANK_MAX 6.0
#define PQC_DEFAULT_BUDGET_RATIO 0.1
#define PQC_DEFAULT_RECENT_SHARE 0.15
#define PQC_DEFAULT_METRIC_FLOOR 1.0
#define PQC_DEFAULT_OBSERVE 32
#define PQC_DEFAULT_BLOCK_TOKENS 128
#define PQC_DEFAULT_CACHE_BLOCKS 32
#define PQC_DEFAULT_REBUILD_SHARE 0.5

typedef struct pqc_cache pqc_cache;

/* Gathered K and V in device memory (CUDA device tier): fp32, head h's rows at
   k + (h * head_stride + i) * d_h * 4 bytes (CUdeviceptr values). */
typedef struct pqc_kv_device {
    uint64_t k, v;
    size_t head_stride;
    uint64_t pos; /* the selected tokens (uint32, ascending): head h's at pos + h*head_stride*4 */
} pqc_kv_device;

typedef struct pqc_layer_stats {
    uint64_t selects, fetches;
    uint64_t hits, misses;     /* selected mid tokens found / not found in the block cache */
    uint64_t bytes_h2d;        /* host -> device: missed rows, admitted blocks, codes, and
                                  the key rows a device step re-ranks from host memory    */
    uint64_t bytes_codes;      /* the codes' part of bytes_h2d                            */
    uint64_t bytes_d2h;        /* device -> host: what offloading the tokens that leave the
                                  window would move. An accounting figure: their rows are
                                  already in host memory, so nothing is copied            */
    uint64_t tokens_selected;  /* sum over selects and KV heads                          */
    uint64_t builds, rebuilds;
    int last_iters;            /* T of the last build                                     */
    double select_s, fetch_s;  /* time in select and fetch                                */
    double build_s;            /* k-means + encoding time of the builds (worker time)     */
    double wait_s;             /* time the first select waited for a build               */
    uint64_t device_waits;     /* CUDA tier: times select, fetch and the device step made
                                  the host wait for the device (a decode step: 0 with
                                  device rows, 1 per layer with host rows; growing a
                                  buffer or moving the block-cache bookkeeping adds one) */
} pqc_layer_stats;

/* Indices to attend, per KV head, ascending. Made by pqc_selection_init, which sizes it
   for the tokens the cache holds then; pqc_cache_select grows it (through alloc) as the
   sequence grows. A selection put together by hand (owned = 0) never grows: its
   capacity must cover the layer's tokens. */
typedef struct pqc_selection {
    int n_kv_heads;
    size_t capacity;  /* per head */
    size_t *count;    /* [n_kv_heads] */
    uint32_t *idx;    /* [n_kv_heads][capacity] */
    pqc_allocator alloc;
    int owned;        /* 1: idx came from alloc and may be replaced by a larger array */
} pqc_selection;

/* Gathered K and V (fp32): head h's rows at k + h*head_stride*d_h, in selection order. */
typedef struct pqc_kv_out {
    float *k;
    float *v;
    size_t head_stride; /* rows between heads, >= the selection's count */
} pqc_kv_out;

PQCDEF pqc_result pqc_cache_create(pqc_runtime *rt, const pqc_cache_desc *desc, pqc_cache **out);
/* The configuration pqc_cache_create makes of desc, into *out: every default filled in
   (n_q_heads, max_tokens, n_sink, budget_ratio, recent_share, metric_floor, observe,
   rerank, block_tokens, cache_blocks, admit_blocks, rebuild_share, softmax_scale, pq.m,
   pq.bits, pq.iters, pq.subspaces, pq.max_points_per_centroid), "none" written as -1 (a
   switched-off outliers or residual_weight as 0), every rule checked with a message of its
   own; nothing is allocated. Given back to pqc_cache_create (or to this call) it makes
   the same cache. window stays 0 where it is derived at the first prefill; pq.iters
   stays 0 where a scheduler picks T. rt: for its log, may be NULL. *out is written only
   on success. */
PQCDEF pqc_result pqc_cache_resolve(pqc_runtime *rt, const pqc_cache_desc *desc, pqc_cache_desc *out);
/* A cache's configuration as resolved at creation, its window as fixed so far. */
PQCDEF pqc_result pqc_cache_config(const pqc_cache *c, pqc_cache_desc *out);
/* Safe while builds run: waits for them first. NULL is a no-op. */
PQCDEF void pqc_cache_destroy(pqc_cache *c);
/* Hands over n tokens of one layer (K and V: n rows of n_kv_heads*d_h, any dtype and
   stride). The first call stores the prompt and starts that layer's PQ build in the
   background; later calls (more prompt chunks, multi-turn) extend the layer and code the
   tokens with the existing codebooks. Nothing is stored on failure. */
PQCDEF pqc_result pqc_cache_prefill(pqc_cache *c, int layer, const pqc_matrix *k, const pqc_matrix *v);
/* Observes n queries of one layer (n rows of n_q_heads*d_h fp32, post-RoPE; best the
   prompt's last ones, which look for what decoding will look for). Under
   PQC_METRIC_QUERY each KV head's next build (the first prefill's, or a rebuild) trains
   and codes with the distance sum_j (k_j - c_j)^T W_j (k_j - c_j) over its sub-spaces,
   W_j = the second moments over sub-space j's dims of the head's group's observed rows
   so far, normalised (see the enum and metric_floor); under PQC_METRIC_QUERY_DIAG with
   sum_e w_e (k_e - c_e)^2, w_e their mean q_e^2. Either way the codebook spends its
   centroids where queries look, so a rare key that differs from its cluster only where
   queries look keeps its own centroid. Call it before the layer's first
   pqc_cache_prefill (pqc_driver_prefill does); later observations count from the next
   rebuild. The last 4 rows are kept to measure where the heads' attention goes (see
   pqc_cache_observed_mass). Waits for a build of the layer that is running, as
   prefill does. Nothing changes on failure. */
PQCDEF pqc_result pqc_cache_observe(pqc_cache *c, int layer, const float *q, size_t n);
/* The attention the observed queries paid (the last 4 observed rows, exact softmax over
   every token the layer held when its last build started, summed over the head's group
   and averaged): the share on the sinks and on the recent window of one (layer, KV
   head). PQC_ERROR_BAD_STATE until a build with observations has finished. Under
   PQC_SPLIT_COMPETE and PQC_SPLIT_ADAPTIVE each head's top-k is the layer's total (heads
   x the even top-k) in proportion to 1 - sinks - window, at least a quarter of the even
   top-k. */
PQCDEF pqc_result pqc_cache_observed_mass(const pqc_cache *c, int layer, int head, double *sinks, double *window);
/* Decode: one new token's K and V (n_kv_heads*d_h fp32 each) for one layer. The oldest
   window token leaves the window and is coded from its own stored key. Like every call
   that changes a layer or selects from it (prefill, observe, append, select, the device
   step, sync, save, fork), it first waits for the layer's build and installs it; a build
   starts once the call that made it due has succeeded. Which codebook serves a step is
   thus a function of the calls made, never of the thread count or of when a worker
   finished. A failed call installs nothing. */
PQCDEF pqc_result pqc_cache_append(pqc_cache *c, int layer, const float *k, const float *v);
PQCDEF pqc_result pqc_selection_init(const pqc_cache *c, pqc_selection *sel);
PQCDEF void pqc_selection_free(pqc_selection *sel);
/* Per KV head the tokens to attend for queries q (n_q_heads x d_h fp32): sinks + top-k
   mid tokens + the window (+ mid tokens not yet coded), deduplicated and ascending (under
   PQC_SPLIT_COMPETE the window's last 16 tokens, and those of its others that won their
   places against the coded tokens, whose top-k takes the places they lost). Waits
   for the layer's build when it is still running. Under PQC_METRIC_QUERY, a query that
   looks where its head's observed queries did not (its energy over the metric's weights,
   against a query shaped like the metric, above 1.5) is counted, and the layer is
   rebuilt in the background with the metric of such queries, at most once per 1/8
   growth of its coded tokens (within pqc_driver_decode and pqc_batch_select: once the
   whole call succeeded). */
PQCDEF pqc_result pqc_cache_select(pqc_cache *c, int layer, const float *q, pqc_selection *sel);
/* A diagnostic view of one KV head's part in a select of this layer with queries q,
   without selecting: plan gets the head's share of the step (its top-k among the coded
   tokens, its candidates scored exactly when the cache re-ranks or keeps outlier lists,
   the window, the sinks, the coded tokens); scores, when not NULL, the score the PQ
   search ranks each coded token by (scores[i] for the mid token n_sink + i: softmax-sum
   over the head's query heads with the normaliser taken over the coded tokens, or their
   plain sum under PQC_GQA_SUM; residual scoring's bound added where on), room for cap of
   them (PQC_ERROR_CAPACITY below plan.coded). Where the layer has no codebook yet,
   scores is left as it is. Like a select it first installs a finished build and codes
   the tokens that left the window; it changes nothing else (no statistics, no drift).
   Call it before the select it is to explain: a select whose queries drifted from the
   observed ones may start a rebuild, which the next call (this one too) installs. */
typedef struct pqc_head_plan {
    size_t tokens;     /* the layer's tokens                                           */
    size_t sinks;      /* sink tokens                                                  */
    size_t window;     /* the recent window (under PQC_SPLIT_COMPETE its tokens but
                          the last 16 compete with the coded ones for the top-k)       */
    size_t coded;      /* coded mid tokens: scores[0 .. coded)                         */
    size_t take;       /* this head's top-k among them this step                       */
    size_t candidates; /* the PQ candidates scored again exactly (re-ranking, outlier
                          lists), else take                                            */
} pqc_head_plan;
PQCDEF pqc_result pqc_cache_head_plan(pqc_cache *c, int layer, const float *q, int head, pqc_head_plan *plan,
                                      float *scores, size_t cap);
/* Gathers the selected K/V through the block cache. The blocks holding the most selected
   tokens are admitted first (see the admission rule in docs/usage.md), so that they serve
   this step's gather. A fetch of 64 MB or more of rows writes the heads' rows that start
   on a 64-byte line (out->k, out->v and head_stride x head_dim x 4 bytes multiples of 64)
   with non-temporal stores: about a third faster, the rows left in memory, not cache. */
PQCDEF pqc_result pqc_cache_fetch(pqc_cache *c, int layer, const pqc_selection *sel, const pqc_kv_out *out);
/* fetch without the copy, where the device tier is host memory (the CPU backend; else
   PQC_ERROR_UNSUPPORTED): krows[h][i] / vrows[h][i] point at the rows of selection entry
   i of head h, in a block-cache slot (a hit) or the host store, as stored: head_dim
   elements of kv_dtype (fp32, fp16 or bf16; a caller with 16-bit storage reads them so,
   and is spared the conversion and the fp32 copy pqc_cache_fetch makes). Admission and
   statistics are those of pqc_cache_fetch. The pointers stay valid until the next fetch,
   append or prefill on this cache. */
PQCDEF pqc_result pqc_cache_fetch_rows(pqc_cache *c, int layer, const pqc_selection *sel,
                                       const void *const *const **krows, const void *const *const **vrows);
/* fetch into device memory (CUDA device tier; else PQC_ERROR_UNSUPPORTED): the gather
   runs on the cache's stream and this call returns without waiting for it; the buffers
   belong to the cache and stay valid until its next fetch. Admission and statistics
   are those of pqc_cache_fetch. */
PQCDEF pqc_result pqc_cache_fetch_device(pqc_cache *c, int layer, const pqc_selection *sel, pqc_kv_device *out);
/* select + fetch_device of one decode step in one call (CUDA device tier; else
   PQC_ERROR_UNSUPPORTED). The search, the top-k, the selection, the block-cache
   admission and the gather are all enqueued on the cache's stream and the call returns
   without waiting: no host synchronisation, and nothing but the queries and each head's
   top-k count (with exact scoring its candidate count and outlier list) goes to the
   device (the rest of the bookkeeping lives there). out as for
   pqc_cache_fetch_device, out->pos the selected tokens; count[h] (n_kv_heads entries)
   the rows of head h. Selection and admission equal those of pqc_cache_select +
   pqc_cache_fetch_device; hits, misses and bytes are counted on the device and read by
   pqc_cache_stats (which waits for the stream). Exact scoring (rerank, outliers) runs on
   the device too, reading each candidate's key row where the gather would: in device
   memory when its block is there, else from the host store (across the bus on a discrete
   GPU, counted in bytes_h2d); the window's rivals (PQC_SPLIT_COMPETE) are scored on the
   device too; caches with residual scoring select on the host: one synchronisation. */
PQCDEF pqc_result pqc_cache_step_device(pqc_cache *c, int layer, const float *q, pqc_kv_device *out, size_t *count);
/* 1 when the cache's device tier is on a CUDA GPU, else 0. */
PQCDEF int pqc_cache_on_device(const pqc_cache *c);
/* Reports the engine's compute time for one layer's prefill (feeds the scheduler). */
PQCDEF pqc_result pqc_cache_report_compute(pqc_cache *c, int layer, double tokens, double seconds);
/* Waits for every build of every layer and installs it; returns the first job error,
   if any (and then installs none). */
PQCDEF pqc_result pqc_cache_sync(pqc_cache *c);
/* A cache to and from a file, to resume decoding where it stopped (another process, a
   conversation that comes back). pqc_cache_save first does what pqc_cache_sync does (waits
   for every build and installs it; the builds that then fall due start at its end), then
   writes every layer's stored K/V (storage dtype), codebooks, codes, observations,
   observed attention, outlier lists and residual bytes, and the window, to a temporary
   file renamed into place. A save thus changes the cache as a sync at that point does,
   and nothing more: a cache not saved installs those builds at its next call on each
   layer instead, and where one lowered a layer's window (PQC_SPLIT_ADAPTIVE) that call
   still selects with the former window, so its selections can differ
   from the saved cache's at that step.
   pqc_cache_load creates a cache from desc and fills it from the file: it selects exactly
   what the saved cache would have selected. The statistics and the block cache start
   empty (hits differ, selections do not). Its softmax scale is desc's, or where desc
   leaves softmax_scale 0 the file's (a file of version 2 or 3: 1/sqrt(d_h)). On the host
   tier the file is mapped read-only
   and its K/V rows become the cache's shared prefix, read in place through the page
   cache (not copied: loading takes the time of checking the file; processes that load
   one file share its pages); rows appended later are the cache's own. While such a cache
   (or a fork of it) lives: renaming another file over the name (pqc_cache_save does) or
   unlinking it is safe, the mapping keeps the loaded rows; truncating the file kills the
   process with SIGBUS at the next read of a row past the new end (fetch, re-ranking,
   save, a fork reading the prefix); rewriting it in place changes the rows under the
   cache (wrong rows, NaN among them, and then appends are refused). The CUDA
   tier copies the rows into its pinned stores. The file, little-endian (saving and loading
   refuse big-endian hosts with PQC_ERROR_UNSUPPORTED):
     "PQCCACHE", u32 version (5; 4 for a cache without calibrated re-ranking factors, 3
     for one at the default softmax scale too, which earlier builds read), u32 x 13:
     layers, KV heads, query heads, d_h, kv dtype, sinks, m, bits, rope, rope bands (1)
     or contiguous (0), metric (0 weights, 1 Euclidean, 2 blocks), outliers, residual
     scoring on; u32 window; f32 softmax scale (versions 4 and 5);
     per layer: u64 tokens, coded, trained, codebook generation, step; u32 observed rows;
       u32 the layer's window when a build lowered it, else 0 (version 2 files lack it);
       f64 observation sums [2 h_kv (d_h + 1 + B) + 2] (B = d_h x d_h/m under
       PQC_METRIC_QUERY with blocks, else 0); f32 observed rows [rows][h d_h];
       f64 observed masses [h_kv][2]; f64 histograms [h_kv][64]; f64 re-ranking
       factors [h_kv] (version 5: 0 = the cache's rerank);
       per KV head: K rows, V rows [tokens][d_h] (storage dtype, each preceded by zero
         bytes up to a file offset that is a multiple of 64); u32 codebook present,
         u32 metric present (1: weights, 2: blocks); if present: f32 centroids
         [m][2^bits][d_h/m], f32 metric [d_h] or blocks [m][d_h/m][d_h/m] (if present),
         the m code columns (ceil(coded bits / 8) bytes each); with
         outliers: u64 listed, u64 of them from the build, f32 threshold, u32 tokens,
         f32 residuals of those since the build; with residual scoring: f32 scales [m],
         the residual bytes [coded][m]
     u64 checksum of everything before it: FNV-1a 64 taken over 64-bit little-endian
     words (the last zero-padded), then over the length in bytes as one more word.
   A truncated, damaged or foreign file gives PQC_ERROR_BAD_FILE, one saved with other
   settings PQC_ERROR_BAD_SHAPE, and *out is left untouched. */
PQCDEF pqc_result pqc_cache_save(pqc_cache *c, const char *path);
PQCDEF pqc_result pqc_cache_load(pqc_runtime *rt, const pqc_cache_desc *desc, const char *path, pqc_cache **out);
/* Prefix sharing: a child cache that holds the parent's tokens as they are now, every
   layer (the layers must hold the same number of tokens: between decode steps). The
   stored K/V rows are not copied: the parent's stores become a read-only prefix shared
   by the parent and all its children (and theirs), reference counted, freed with the
   last cache that uses it; rows appended afterwards are each cache's own. The child
   gets copies of the small state: codebooks, codes, observations, outlier lists,
   residual bytes (a few bytes per token and head, against 2 d_h elements of K/V), and
   the rows the parent appended since its prefix was first shared. It selects exactly
   what the parent would select after the same calls; a rebuild in a child re-clusters
   its own view and leaves the parent's codebooks alone. Waits for the parent's builds
   (pqc_cache_sync). Parent and children may be used, and destroyed in any order, from
   different threads (one thread per cache at a time, as for any cache); they share the
   parent's runtime, backend, scheduler and CUDA stream. The child's statistics and
   block cache start empty. On failure *child is untouched and the parent selects as
   before. */
PQCDEF pqc_result pqc_cache_fork(pqc_cache *parent, pqc_cache **child);
/* Host memory of a cache: own_bytes, what it holds alone (its own K/V rows as
   allocated, codes, codebooks, block tables, observations, outlier lists, residual
   bytes); shared_bytes, the allocated size of the prefix it shares with forks (0 when
   none: count it once for a family of forks). */
PQCDEF void pqc_cache_host_memory(const pqc_cache *c, size_t *own_bytes, size_t *shared_bytes);
PQCDEF size_t pqc_cache_tokens(const pqc_cache *c, int layer);
/* The window in tokens: the cache's (from the first prefill, or the desc), and a layer's,
   which a build lowers (see pqc_cache_desc.window); 0 for a bad layer. */
PQCDEF int pqc_cache_window(const pqc_cache *c);
PQCDEF int pqc_cache_layer_window(const pqc_cache *c, int layer);
PQCDEF pqc_result pqc_cache_stats(const pqc_cache *c, int layer, pqc_layer_stats *out);
/* Bytes held in the device tier (sinks, window, cache slots, centroids, one layer's codes;
   on a CUDA GPU everything the tier allocated there, two code buffers and the scratch
   included) and, for comparison, the bytes of the whole K/V cache in the storage dtype. */
PQCDEF void pqc_cache_memory(const pqc_cache *c, size_t *device_bytes, size_t *full_kv_bytes);
/* Read-only view of the stored K/V rows of one (layer, KV head): row t at base + t*d_h.
   A fork whose rows lie in two parts (its shared prefix, then its own) gives
   PQC_ERROR_BAD_STATE: read it with pqc_cache_kv_part. */
PQCDEF pqc_result pqc_cache_kv(const pqc_cache *c, int layer, int head, const void **k, const void **v,
                               size_t *tokens, pqc_dtype *dtype);
/* The stored rows of one (layer, KV head) from token `from` on that lie contiguously:
   row from + i at k + i*d_h (storage dtype) for i < *count; *count = 0 when from is the
   layer's token count. A loop over from = 0, from + count, ... reads every row. */
PQCDEF pqc_result pqc_cache_kv_part(const pqc_cache *c, int layer, int head, size_t from, const void **k,
                                    const void **v, size_t *count);

/* The blocks (token index / block_tokens) held in the block cache of one (layer, KV head),
   ascending, at most `max` of them; returns how many are cached. */
PQCDEF int pqc_cache_cached_blocks(const pqc_cache *c, int layer, int head, int32_t *out, int max);

/* Batches: several distinct caches (sequences) sharing one runtime; the per-sequence work
   runs in parallel on the pool. q[i] are sequence i's queries; sel[i] its selection. Each
   sequence's call is atomic on its own: on failure the result is the first failing
   sequence's (with its message), that sequence is as it was, and the others keep what
   their calls did. */
PQCDEF pqc_result pqc_batch_select(pqc_cache *const *caches, int n, int layer, const float *const *q,
                                   pqc_selection *const *sel);
PQCDEF pqc_result pqc_batch_fetch(pqc_cache *const *caches, int n, int layer, const pqc_selection *const *sel,
                                  const pqc_kv_out *const *out);

/* ---------------------------------------------------------------------------------------
   Driver: runs Algorithm 1 (prefill with offload and overlapped PQ builds) and
   Algorithm 2 (decode with select and fetch) over the engine's callbacks.
   ------------------------------------------------------------------------------------- */

/* K/V handed to the engine's attention: per KV head `count` rows (dtype, stride d_h),
   and their token positions (NULL = 0..count-1, the causal prefill case). */
typedef struct pqc_kv_view {
    int n_kv_heads;
    int head_dim;
    pqc_dtype dtype;
    const void *const *k;        /* [n_kv_heads] */
    const void *const *v;        /* [n_kv_heads] */
    const size_t *count;         /* [n_kv_heads] */
    const uint32_t *const *pos;  /* [n_kv_heads] or NULL */
    /* Only for engines with accepts_row_pointers: when not NULL, row i of head h is at
       krows[h][i] / vrows[h][i] (d_h elements of dtype each: fp32, or with
       accepts_row_pointers = 2 the cache's storage dtype) and k, v are NULL. */
    const void *const *const *krows;
    const void *const *const *vrows;
    /* Only for engines with accepts_device_kv on a CUDA cache: non-zero when k[h] and
       v[h] are device addresses (fp32 rows, stride d_h) ordered on the cache's stream;
       pos[h] are then device addresses too (uint32 tokens). */
    int on_device;
} pqc_kv_view;

typedef struct pqc_engine {
    void *user;
    /* Q, K, V (post-RoPE, fp32) of tokens [pos0, pos0+n) at this layer from the engine's
       hidden state: q [n][n_q_heads][d_h], k and v [n][n_kv_heads][d_h]. 0 = success. */
    int (*qkv)(void *user, int layer, size_t pos0, size_t n, float *q, float *k, float *v);
    /* Attention of those n tokens over kv (prefill: all tokens so far, causal by position;
       decode: the selected tokens), then the output projection, residual and FFN. */
    int (*attend)(void *user, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv);
    /* Non-zero: decode views may hand rows by pointer (see pqc_kv_view), which spares the
       copy of the selected rows when the device tier is host memory (the CPU backend):
       1 where the storage is fp32, 2 whatever the storage (view dtype: the cache's
       kv_dtype; fp16 and bf16 rows then arrive as stored, not converted). 0 (the
       default): rows always arrive gathered, in fp32. */
    int accepts_row_pointers;
    /* Non-zero: with a CUDA device tier, decode views carry device addresses (on_device)
       and nothing is copied back to the host. 0: rows arrive in host memory. */
    int accepts_device_kv;
} pqc_engine;

/* Prefill n tokens at positions [pos0, pos0+n) through every layer. On failure at any
   layer (a callback, memory, a device) every layer gives back the tokens, codes, exact
   lists, residual bytes, observations and statistics of this call, and a build the call
   installed waits again, finished (one it started is dropped), so that the cache holds
   what it held before, selects what it would have selected, and the same call can be
   made again (the engine restarts its own state for these positions); blocks admitted
   to the block cache by earlier layers may stay. Same for decode. */
PQCDEF pqc_result pqc_driver_prefill(pqc_cache *c, const pqc_engine *e, size_t pos0, size_t n);
/* One decode step at position pos through every layer. */
PQCDEF pqc_result pqc_driver_decode(pqc_cache *c, const pqc_engine *e, size_t pos);


/* ---------------------------------------------------------------------------------------
   CUDA (optional, opened at run time). The kernels of pqcache_kernels.cu are embedded in
   this header and compiled by NVRTC for the device's architecture. These calls report
   what a machine offers; none of them needs a GPU to fail cleanly.
   ------------------------------------------------------------------------------------- */

typedef struct pqc_cuda_info {
    int available;            /* 1: driver, a device and NVRTC were found */
    int driver_version;       /* e.g. 13000 */
    int device_count;
    int cc_major, cc_minor;   /* device 0 */
    int sm_count;
    size_t total_mem;
    int nvrtc_major, nvrtc_minor;
    int have_cublaslt;
    char name[128];
    char message[512];        /* what was found, or why CUDA is unusable */
} pqc_cuda_info;

/* PQC_SUCCESS when a CUDA device is usable; PQC_ERROR_NO_DEVICE with the reason ("no CUDA
   driver (libcuda.so.1 not found)", "no CUDA device", "NVRTC not found", a missing
   symbol, ...) otherwise. Thread-safe. */
PQCDEF pqc_result pqc_cuda_probe(pqc_cuda_info *info);
/* Compiles the embedded kernels with NVRTC for sm_<arch> (cubin != 0) or compute_<arch>
   (PTX); no GPU is needed. The NVRTC log goes to log. */
PQCDEF pqc_result pqc_cuda_compile_kernels(int arch, int cubin, char *log, size_t log_size, size_t *image_bytes);
/* The embedded kernel source (NUL-terminated; "" when built without the loader). */
PQCDEF const char *pqc_cuda_kernel_source(void);

#ifdef __cplusplus
}
#endif
#endif /* PQCACHE_H */

/* =======================================================================================
   IMPLEMENTATION
   ===================================================================================== */
#ifdef PQCACHE_IMPLEMENTATION
#ifndef PQCACHE_IMPLEMENTATION_DONE
#define PQCACHE_IMPLEMENTATION_DONE

#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <stdio.h>
#include <stdarg.h>
#include <float.h>
#include <time.h>
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/mman.h>
#ifndef PQCACHE_NO_THREADS
#include <pthread.h>
#endif
#if !defined(PQCACHE_NO_CUDA) && (defined(__unix__) || defined(__APPLE__))
#define PQC__CUDA_LOADER 1
#include <dlfcn.h>
#else
#define PQC__CUDA_LOADER 0
#endif

#if defined(PQC_MALLOC) != defined(PQC_FREE)
#error "define both PQC_MALLOC and PQC_FREE, or neither"
#endif
#ifndef PQC_MALLOC
#define PQC_MALLOC(sz, ctx) ((void)(ctx), malloc(sz))
#define PQC_FREE(p, ctx) ((void)(ctx), free(p))
#endif
#ifndef PQC_ASSERT
#define PQC_ASSERT(x) assert(x)
#endif

#if !defined(PQCACHE_NO_SIMD) && (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define PQC__X86 1
#include <immintrin.h>
#define PQC__AVX2 __attribute__((target("avx2,fma,f16c")))
#define PQC__AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
/* a kernel's loop inlined where it is called with constant arguments, one copy each */
#define PQC__INLINE_ALWAYS inline __attribute__((always_inline))
#else
#define PQC__X86 0
#endif
/* AArch64 (little-endian): Advanced SIMD is part of the base architecture */
#if !defined(PQCACHE_NO_SIMD) && defined(__aarch64__) && !defined(__AARCH64EB__)
#define PQC__NEON 1
#include <arm_neon.h>
#else
#define PQC__NEON 0
#endif

#if defined(__cplusplus) && __cplusplus >= 201103L
#define PQC__TLS thread_local
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define PQC__TLS _Thread_local
#elif defined(__GNUC__) || defined(__clang__)
#define PQC__TLS __thread
#else
#define PQC__TLS
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PQC__UNUSED __attribute__((unused))
#else
#define PQC__UNUSED
#endif
#define PQC__MIN(a, b) ((a) < (b) ? (a) : (b))
#define PQC__MAX(a, b) ((a) > (b) ? (a) : (b))
#define PQC__KEY_LIMIT 1e16f /* keys and queries beyond this magnitude are rejected */

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------
   1. Base
   ------------------------------------------------------------------------------------- */

static PQC__TLS char pqc__errbuf[512];

PQCDEF const char *pqc_result_description(pqc_result r)
{
    switch (r) {
    case PQC_SUCCESS: return "success";
    case PQC_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case PQC_ERROR_BAD_SHAPE: return "bad shape";
    case PQC_ERROR_OUT_OF_RANGE: return "value out of range";
    case PQC_ERROR_NON_FINITE: return "NaN or Inf in the input";
    case PQC_ERROR_OUT_OF_MEMORY: return "out of memory";
    case PQC_ERROR_EMPTY: return "empty input";
    case PQC_ERROR_BAD_STATE: return "call out of order";
    case PQC_ERROR_CAPACITY: return "capacity exceeded";
    case PQC_ERROR_THREAD: return "thread creation failed";
    case PQC_ERROR_JOB_FAILED: return "asynchronous job failed";
    case PQC_ERROR_IO: return "I/O error";
    case PQC_ERROR_BAD_FILE: return "damaged or foreign file";
    case PQC_ERROR_NO_DEVICE: return "no usable GPU";
    case PQC_ERROR_BACKEND: return "backend failure";
    case PQC_ERROR_CALLBACK: return "engine callback failed";
    case PQC_ERROR_UNSUPPORTED: return "unsupported in this build";
    }
    return "unknown result code";
}

PQCDEF const char *pqc_last_error(void) { return pqc__errbuf; }
PQCDEF const char *pqc_version(void) { return PQCACHE_VERSION_STRING; }
PQCDEF unsigned pqc_version_number(void)
{
    return PQCACHE_VERSION_MAJOR * 10000u + PQCACHE_VERSION_MINOR * 100u + PQCACHE_VERSION_PATCH;
}

struct pqc_runtime;
static void pqc__log(const struct pqc_runtime *rt, pqc_log_level lv, const char *msg);

/* Records a failure message for this thread (and the runtime's log) and returns r. */
static pqc_result pqc__fail(const struct pqc_runtime *rt, pqc_result r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pqc__errbuf, sizeof pqc__errbuf, fmt, ap);
    va_end(ap);
    pqc__log(rt, PQC_LOG_ERROR, pqc__errbuf);
    return r;
}

static void *pqc__alloc(const pqc_allocator *a, size_t n)
{
    if (n == 0) n = 1;
    if (a && a->alloc) return a->alloc(n, a->user);
    return PQC_MALLOC(n, a ? a->user : NULL);
}
static void pqc__free(const pqc_allocator *a, void *p)
{
    if (!p) return;
    if (a && a->alloc) {
        if (a->free) a->free(p, a->user);
        return;
    }
    PQC_FREE(p, a ? a->user : NULL);
}
static void *pqc__calloc(const pqc_allocator *a, size_t n)
{
    void *p = pqc__alloc(a, n);
    if (p) memset(p, 0, n);
    return p;
}
/* The one size helper: *out = a*b*c, or 0 (and *out untouched) when it would overflow.
   Every size the library derives from caller-supplied counts goes through it. */
static int pqc__size3(size_t a, size_t b, size_t c, size_t *out)
{
    size_t ab;
    if (a && b > (size_t)-1 / a) return 0;
    ab = a * b;
    if (ab && c > (size_t)-1 / ab) return 0;
    *out = ab * c;
    return 1;
}
static int pqc__mul(size_t a, size_t b, size_t *out) { return pqc__size3(a, b, 1, out); }

/* FNV-1a, 64 bits, over n bytes continuing from h: the checksums of the calibration file
   and the kernel cache, and the kernel cache's key. */
#define PQC__FNV_OFFSET 14695981039346656037ull
static uint64_t pqc__fnv(const void *data, size_t n, uint64_t h)
{
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Files: every file the library reads is opened without blocking and must be a regular
   file (a FIFO, a device or a directory is refused, never waited on); every file it
   writes goes to a temporary name in the same directory and is renamed into place. */
static FILE *pqc__open_regular(const char *path, char *why, size_t why_size)
{
    struct stat st;
    FILE *f;
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) {
        snprintf(why, why_size, "cannot open %.200s: %.80s", path, strerror(errno));
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(why, why_size, "%.200s is not a regular file", path);
        close(fd);
        return NULL;
    }
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || !(f = fdopen(fd, "rb"))) {
        snprintf(why, why_size, "cannot open %.200s: %.80s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    return f;
}

/* Writes parts[0..n) to path atomically; 0 on success, else -1 with the reason in why.
   An existing path that is not a regular file is left alone and refused. */
static int pqc__write_atomic(const char *path, const void *const *parts, const size_t *sizes, int n, char *why,
                             size_t why_size)
{
    char tmp[1024];
    struct stat st;
    int fd = -1, i, ok = 1, attempt;
    FILE *f;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        snprintf(why, why_size, "%.200s exists and is not a regular file", path);
        return -1;
    }
    for (attempt = 0; attempt < 16 && fd < 0; attempt++) {
        if (snprintf(tmp, sizeof tmp, "%s.tmp%ld.%lx.%d", path, (long)getpid(),
                     (unsigned long)((uintptr_t)&st >> 4), attempt) >=
            (int)sizeof tmp) {
            snprintf(why, why_size, "path too long: %.200s", path);
            return -1;
        }
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0 || !(f = fdopen(fd, "wb"))) {
        snprintf(why, why_size, "cannot create %.200s: %.80s", tmp, strerror(errno));
        if (fd >= 0) {
            close(fd);
            remove(tmp);
        }
        return -1;
    }
    for (i = 0; i < n && ok; i++) ok = fwrite(parts[i], 1, sizes[i], f) == sizes[i];
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        snprintf(why, why_size, "write to %.200s failed: %.80s", path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

PQCDEF size_t pqc_dtype_size(pqc_dtype t)
{
    switch (t) {
    case PQC_F32: return 4;
    case PQC_F16: return 2;
    case PQC_BF16: return 2;
    }
    return 0;
}

PQC__UNUSED static double pqc__now(void)
{
#if defined(CLOCK_MONOTONIC)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

/* ----- half precision ----- */

PQCDEF float pqc_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

PQCDEF uint16_t pqc_f32_to_f16(float f)
{
    uint32_t u, sign, man;
    int exp;
    memcpy(&u, &f, 4);
    sign = (u >> 16) & 0x8000u;
    exp = (int)((u >> 23) & 0xff);
    man = u & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    exp -= 127 - 15;
    if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) { /* subnormal or zero */
        uint32_t m, shift, r, half;
        if (exp < -10) return (uint16_t)sign;
        m = man | 0x800000u;
        shift = (uint32_t)(14 - exp);
        r = m >> shift;
        half = 1u << (shift - 1);
        if ((m & ((half << 1) - 1)) > half || ((m & ((half << 1) - 1)) == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    {
        uint32_t r = ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++; /* may carry into exponent: fine */
        return (uint16_t)(sign | r);
    }
}

PQCDEF float pqc_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

PQCDEF uint16_t pqc_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Converts n elements of one row to fp32. */
static void pqc__row_to_f32(const void *src, pqc_dtype t, size_t n, float *dst)
{
    size_t i;
    if (t == PQC_F32) {
        memcpy(dst, src, n * 4);
    } else if (t == PQC_F16) {
        const unsigned char *p = (const unsigned char *)src;
        for (i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = pqc_f16_to_f32(h);
        }
    } else {
        const unsigned char *p = (const unsigned char *)src;
        for (i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = pqc_bf16_to_f32(h);
        }
    }
}

static size_t pqc__stride(const pqc_matrix *m)
{
    return m->row_stride ? m->row_stride : m->cols * pqc_dtype_size(m->dtype);
}
static const void *pqc__row(const pqc_matrix *m, size_t r)
{
    return (const unsigned char *)m->data + r * pqc__stride(m);
}

/* Validates a matrix view with `cols` expected columns (0 = any). */
static pqc_result pqc__check_matrix(const struct pqc_runtime *rt, const pqc_matrix *m, size_t cols, const char *what)
{
    size_t es;
    if (!m) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "%s: null matrix", what);
    es = pqc_dtype_size(m->dtype);
    if (!es) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "%s: unknown dtype %d", what, (int)m->dtype);
    if (m->rows == 0) return pqc__fail(rt, PQC_ERROR_EMPTY, "%s: no rows", what);
    if (!m->data) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "%s: null data", what);
    if (cols && m->cols != cols)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "%s: %zu columns, expected %zu", what, m->cols, cols);
    {   /* the matrix, its fp32 copy and per-row bookkeeping must be addressable */
        size_t bytes;
        if (m->cols == 0) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "%s: no columns", what);
        if (m->rows > (size_t)-1 / 64 || !pqc__size3(m->rows, m->cols, 8, &bytes) ||
            (m->row_stride && !pqc__mul(m->rows, m->row_stride, &bytes)))
            return pqc__fail(rt, PQC_ERROR_CAPACITY, "%s: %zu x %zu elements do not fit in memory", what, m->rows,
                             m->cols);
    }
    if (m->row_stride && m->row_stride < m->cols * es)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "%s: row stride %zu bytes < row size %zu", what, m->row_stride,
                         m->cols * es);
    return PQC_SUCCESS;
}

/* 1 when every one of n values is finite and at most limit in magnitude (NaN compares
   false). Blocks of 16 without an early exit inside, which compilers vectorise at -O2, so
   that a check costs little beside the pass it joins (exact search checks its keys so). */
static int pqc__within(const float *x, size_t n, float limit)
{
    size_t i = 0;
    int j, ok = 1;
    for (; i + 16 <= n; i += 16) {
        for (j = 0; j < 16; j++) ok &= fabsf(x[i + (size_t)j]) <= limit;
        if (!ok) return 0;
    }
    for (; i < n; i++) ok &= fabsf(x[i]) <= limit;
    return ok;
}
static int pqc__finite_row(const float *x, size_t n) { return pqc__within(x, n, PQC__KEY_LIMIT); }

/* The largest magnitude a value may have to be stored in dtype t (and to be a key). */
static float pqc__store_limit(pqc_dtype t) { return t == PQC_F16 ? 65504.0f : PQC__KEY_LIMIT; }

/* Checks every element of a matrix is finite and at most `limit` in magnitude. */

/* splitmix64: small, good, and reproducible on every platform */
static uint64_t pqc__rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double pqc__rng_unit(uint64_t *s) { return (double)(pqc__rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }
static size_t pqc__rng_below(uint64_t *s, size_t n) { return (size_t)(pqc__rng_unit(s) * (double)n) % (n ? n : 1); }

/* ----- the device side, reached through a table -----
   The sections above the CUDA code (16 and 17) reach it only through this table: the
   runtime opens and closes its device, k-means runs its Lloyd loop there, and a cache
   takes its device tier from it (whose own table carries the batched lookup tables).
   Its getter is defined after the CUDA tier, or with stubs in a build without the
   loader; declaring it here is the one use of something defined further down. */
struct pqc__tier_i;
typedef struct pqc__device_i {
    pqc_result (*open)(pqc_runtime *rt, int ordinal, const char *cache_dir, char *why, size_t why_size);
    void (*close)(pqc_runtime *rt);
    /* Lloyd iterations on the runtime's GPU from the centres c */
    pqc_result (*lloyd)(pqc_runtime *rt, const float *x, size_t n, int d, int k, int iters, float *c, double *obj,
                        char *err, size_t errsz);
    const struct pqc__tier_i *(*tier)(void); /* NULL: no device tier */
} pqc__device_i;
static const pqc__device_i *pqc__device(void);

/* ---------------------------------------------------------------------------------------
   2. Runtime and thread pool
   ------------------------------------------------------------------------------------- */

/* A job the caller owns until it completes; jobs complete into a group. */
typedef struct pqc__group {
    int pending;
} pqc__group;

typedef struct pqc__task {
    void (*fn)(void *arg);
    void *arg;
    pqc__group *group;
    struct pqc_runtime *rt;
    struct pqc__task *next;
} pqc__task;

struct pqc_runtime {
    pqc_allocator alloc;
    pqc_simd simd;
    pqc_log_fn log;
    void *log_user;
    pqc_log_level log_level;
    pqc_submit_fn submit;
    void *submit_user;
    int n_threads;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_t mu;      /* guards the queue and every group's counter */
    pthread_cond_t work_cv;  /* queue not empty, or stopping               */
    pthread_cond_t done_cv;  /* some group reached zero                    */
    pthread_t *threads;
    int started;
    int stopping;
    pqc__task *head, *tail;
#endif
    pqc_backend_kind backend;
    char backend_note[600];
    struct pqc__gpu_device *cu; /* the opened CUDA device, or NULL */
};

static void pqc__log(const struct pqc_runtime *rt, pqc_log_level lv, const char *msg)
{
    if (rt && rt->log && lv <= rt->log_level) rt->log(rt->log_user, lv, msg);
}

PQCDEF const char *pqc_simd_name(pqc_simd s)
{
    switch (s) {
    case PQC_SIMD_AUTO: return "auto";
    case PQC_SIMD_SCALAR: return "scalar";
    case PQC_SIMD_AVX2: return "avx2";
    case PQC_SIMD_AVX512: return "avx512";
    case PQC_SIMD_NEON: return "neon";
    }
    return "unknown";
}

PQCDEF pqc_simd pqc_cpu_best_simd(void)
{
#if PQC__X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
        return PQC_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PQC_SIMD_AVX2;
#endif
#if PQC__NEON
    return PQC_SIMD_NEON;
#else
    return PQC_SIMD_SCALAR;
#endif
}

static void pqc__task_run(pqc__task *t)
{
    pqc_runtime *rt = t->rt;
    pqc__group *g = t->group;
    t->fn(t->arg);
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&rt->mu);
    if (--g->pending == 0) pthread_cond_broadcast(&rt->done_cv);
    pthread_mutex_unlock(&rt->mu);
#else
    (void)rt;
    g->pending--;
#endif
}

#ifndef PQCACHE_NO_THREADS
static void pqc__task_entry(void *p) { pqc__task_run((pqc__task *)p); }

static void *pqc__worker(void *p)
{
    pqc_runtime *rt = (pqc_runtime *)p;
    pthread_mutex_lock(&rt->mu);
    for (;;) {
        pqc__task *t;
        while (!rt->head && !rt->stopping) pthread_cond_wait(&rt->work_cv, &rt->mu);
        if (!rt->head) break; /* stopping and drained */
        t = rt->head;
        rt->head = t->next;
        if (!rt->head) rt->tail = NULL;
        pthread_mutex_unlock(&rt->mu);
        pqc__task_run(t);
        pthread_mutex_lock(&rt->mu);
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}
#endif

/* Starts t (fn, arg set by the caller) in group g. Never fails: without workers, or when
   the engine refuses the job, it runs inline. */
static void pqc__submit(pqc_runtime *rt, pqc__group *g, pqc__task *t)
{
    t->group = g;
    t->rt = rt;
    t->next = NULL;
#ifndef PQCACHE_NO_THREADS
    if (rt) {
        pthread_mutex_lock(&rt->mu);
        g->pending++;
        if (rt->submit) {
            pthread_mutex_unlock(&rt->mu);
            if (rt->submit(rt->submit_user, pqc__task_entry, t) != 0) pqc__task_run(t);
            return;
        }
        if (rt->started > 0) {
            if (rt->tail) rt->tail->next = t;
            else rt->head = t;
            rt->tail = t;
            pthread_cond_signal(&rt->work_cv);
            pthread_mutex_unlock(&rt->mu);
            return;
        }
        pthread_mutex_unlock(&rt->mu);
        pqc__task_run(t);
        return;
    }
#endif
    g->pending++;
    if (rt) {
        pqc__task_run(t);
    } else { /* no runtime: plain inline call */
        t->fn(t->arg);
        g->pending--;
    }
}

/* Waits until every job of g has finished; helps with queued jobs meanwhile, so waiting
   from inside a job cannot deadlock the pool. */
static void pqc__wait(pqc_runtime *rt, pqc__group *g)
{
#ifndef PQCACHE_NO_THREADS
    if (!rt) return;
    pthread_mutex_lock(&rt->mu);
    while (g->pending > 0) {
        if (rt->head && !rt->submit) {
            pqc__task *t = rt->head;
            rt->head = t->next;
            if (!rt->head) rt->tail = NULL;
            pthread_mutex_unlock(&rt->mu);
            pqc__task_run(t);
            pthread_mutex_lock(&rt->mu);
        } else {
            pthread_cond_wait(&rt->done_cv, &rt->mu);
        }
    }
    pthread_mutex_unlock(&rt->mu);
#else
    (void)rt;
    (void)g;
#endif
}

PQC__UNUSED static int pqc__group_busy(pqc_runtime *rt, pqc__group *g)
{
    int busy;
#ifndef PQCACHE_NO_THREADS
    if (rt) pthread_mutex_lock(&rt->mu);
    busy = g->pending > 0;
    if (rt) pthread_mutex_unlock(&rt->mu);
#else
    (void)rt;
    busy = g->pending > 0;
#endif
    return busy;
}

/* parallel for: calls fn(ctx, i) for i in [0, n) on the pool and the calling thread */
typedef struct pqc__pfor {
    void (*fn)(void *ctx, size_t i);
    void *ctx;
    size_t n;
    size_t next;
    pqc_runtime *rt;
} pqc__pfor;

static void pqc__pfor_body(void *p)
{
    pqc__pfor *f = (pqc__pfor *)p;
    for (;;) {
        size_t i;
#ifndef PQCACHE_NO_THREADS
        if (f->rt) pthread_mutex_lock(&f->rt->mu);
#endif
        i = f->next < f->n ? f->next++ : f->n;
#ifndef PQCACHE_NO_THREADS
        if (f->rt) pthread_mutex_unlock(&f->rt->mu);
#endif
        if (i >= f->n) break;
        f->fn(f->ctx, i);
    }
}

#define PQC__MAX_HELPERS 64
static void pqc__parallel_for(pqc_runtime *rt, size_t n, void (*fn)(void *ctx, size_t i), void *ctx)
{
    pqc__pfor f;
    pqc__task tasks[PQC__MAX_HELPERS];
    pqc__group g;
    size_t helpers = 0, i;
    f.fn = fn;
    f.ctx = ctx;
    f.n = n;
    f.next = 0;
    f.rt = rt;
    g.pending = 0;
    if (rt && n > 1) {
        int workers = rt->n_threads;
        helpers = PQC__MIN((size_t)(workers > 0 ? workers : 0), n - 1);
        helpers = PQC__MIN(helpers, (size_t)PQC__MAX_HELPERS);
    }
    for (i = 0; i < helpers; i++) {
        tasks[i].fn = pqc__pfor_body;
        tasks[i].arg = &f;
        pqc__submit(rt, &g, &tasks[i]);
    }
    pqc__pfor_body(&f);
    pqc__wait(rt, &g);
}


PQCDEF pqc_result pqc_runtime_create(const pqc_runtime_desc *desc, pqc_runtime **out)
{
    pqc_runtime_desc d;
    pqc_runtime *rt;
    pqc_simd best = pqc_cpu_best_simd();
    char note[600] = {0};
    if (!out) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_runtime_create: null output");
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if ((d.allocator.alloc == NULL) != (d.allocator.free == NULL))
        return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "allocator: set both alloc and free, or neither");
    if (d.n_threads < -1 || d.n_threads > 1024)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "n_threads %d not in -1..1024", d.n_threads);
    if ((int)d.simd < 0 || (int)d.simd > (int)PQC_SIMD_NEON)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "unknown simd level %d", (int)d.simd);
    /* offered: scalar, the best level, and AVX2 beside AVX-512 */
    if (d.simd != PQC_SIMD_AUTO && d.simd != PQC_SIMD_SCALAR && d.simd != best &&
        !(d.simd == PQC_SIMD_AVX2 && best == PQC_SIMD_AVX512))
        return pqc__fail(NULL, PQC_ERROR_UNSUPPORTED, "simd level %s requested, the processor offers %s",
                         pqc_simd_name(d.simd), pqc_simd_name(best));
    if (d.backend < (int)PQC_BACKEND_CPU || d.backend > (int)PQC_BACKEND_CUDA)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "unknown backend %d", d.backend);
    if (d.cuda_device < 0 || d.cuda_device > 1023)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "cuda_device %d not in 0..1023", d.cuda_device);
    rt = (pqc_runtime *)pqc__calloc(&d.allocator, sizeof *rt);
    if (!rt) return pqc__fail(NULL, PQC_ERROR_OUT_OF_MEMORY, "runtime: allocation failed");
    rt->alloc = d.allocator;
    rt->backend = PQC_BACKEND_CPU;
    memcpy(rt->backend_note, note, sizeof note);
    rt->simd = d.simd == PQC_SIMD_AUTO ? best : d.simd;
    rt->log = d.log;
    rt->log_user = d.log_user;
    rt->log_level = d.log_level;
    rt->submit = d.submit;
    rt->submit_user = d.submit_user;
    rt->n_threads = d.n_threads == 0 ? PQC_DEFAULT_THREADS : (d.n_threads < 0 ? 0 : d.n_threads);
#ifdef PQCACHE_NO_THREADS
    rt->n_threads = 0;
    if (d.submit) { /* jobs on other threads would need the locks this build leaves out */
        pqc__free(&d.allocator, rt);
        return pqc__fail(NULL, PQC_ERROR_UNSUPPORTED,
                         "runtime: built with PQCACHE_NO_THREADS, so jobs cannot go to an engine's pool (submit)");
    }
    if (d.n_threads > 0) pqc__log(rt, PQC_LOG_WARN, "runtime: built with PQCACHE_NO_THREADS: jobs run inline");
#else
    if (pthread_mutex_init(&rt->mu, NULL) != 0) {
        pqc__free(&d.allocator, rt);
        return pqc__fail(NULL, PQC_ERROR_THREAD, "runtime: mutex init failed");
    }
    pthread_cond_init(&rt->work_cv, NULL);
    pthread_cond_init(&rt->done_cv, NULL);
    if (!rt->submit && rt->n_threads > 0) {
        int i;
        rt->threads = (pthread_t *)pqc__alloc(&rt->alloc, sizeof(pthread_t) * (size_t)rt->n_threads);
        if (!rt->threads) {
            pqc_runtime_destroy(rt);
            return pqc__fail(NULL, PQC_ERROR_OUT_OF_MEMORY, "runtime: thread table allocation failed");
        }
        for (i = 0; i < rt->n_threads; i++) {
            if (pthread_create(&rt->threads[i], NULL, pqc__worker, rt) != 0) {
                pqc_runtime_destroy(rt);
                return pqc__fail(NULL, PQC_ERROR_THREAD, "runtime: could not start worker %d of %d", i + 1,
                                 d.n_threads);
            }
            rt->started++;
        }
    }
#endif
    if (d.backend != PQC_BACKEND_CPU) {
        char why[512];
        pqc_result cr = pqc__device()->open(rt, d.cuda_device, d.cuda_kernel_cache, why, sizeof why);
        if (cr == PQC_SUCCESS) {
            rt->backend = PQC_BACKEND_CUDA;
            snprintf(note, sizeof note, "CUDA device tier: %s", why);
        } else if (d.backend == PQC_BACKEND_CUDA) {
            pqc_runtime_destroy(rt);
            return pqc__fail(NULL, cr, "CUDA backend requested but unavailable: %s", why);
        } else {
            snprintf(note, sizeof note, "CUDA unavailable: %s; running on the CPU", why);
            pqc__errbuf[0] = 0;
        }
        memcpy(rt->backend_note, note, sizeof note);
    }
    if (note[0]) pqc__log(rt, PQC_LOG_INFO, note);
    *out = rt;
    return PQC_SUCCESS;
}

PQCDEF void pqc_runtime_destroy(pqc_runtime *rt)
{
    pqc_allocator a;
    if (!rt) return;
    a = rt->alloc;
    pqc__device()->close(rt);
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&rt->mu);
    rt->stopping = 1;
    pthread_cond_broadcast(&rt->work_cv);
    pthread_mutex_unlock(&rt->mu);
    {
        int i;
        for (i = 0; i < rt->started; i++) pthread_join(rt->threads[i], NULL);
    }
    pqc__free(&a, rt->threads);
    pthread_cond_destroy(&rt->work_cv);
    pthread_cond_destroy(&rt->done_cv);
    pthread_mutex_destroy(&rt->mu);
#endif
    pqc__free(&a, rt);
}

PQCDEF pqc_simd pqc_runtime_simd(const pqc_runtime *rt) { return rt ? rt->simd : PQC_SIMD_SCALAR; }
PQCDEF pqc_backend_kind pqc_runtime_backend(const pqc_runtime *rt) { return rt ? rt->backend : PQC_BACKEND_CPU; }
PQCDEF const char *pqc_runtime_backend_note(const pqc_runtime *rt) { return rt ? rt->backend_note : ""; }
PQCDEF int pqc_runtime_threads(const pqc_runtime *rt) { return rt ? rt->n_threads : 0; }

static pqc_simd pqc__simd(const pqc_runtime *rt) { return rt ? rt->simd : pqc_cpu_best_simd(); }
static const pqc_allocator *pqc__rt_alloc(const pqc_runtime *rt) { return rt ? &rt->alloc : NULL; }

/* ---------------------------------------------------------------------------------------
   3. CPU kernels. Each has a scalar reference; the SIMD variants perform the very same
   floating-point operations in the same order (vectorised across centroids or tokens,
   never across the summed dimension), so codes, indices and scores match bit for bit.
   ------------------------------------------------------------------------------------- */

/* dots[c] = sum_e x[e] * ct[e*kpad + c] (fma chain over e from 0), c < k */
static void pqc__dots_scalar(const float *x, int d, const float *ct, int kpad, int k, float *dots)
{
    int c, e;
    for (c = 0; c < k; c++) {
        float acc = 0.0f;
        for (e = 0; e < d; e++) acc = fmaf(x[e], ct[(size_t)e * kpad + c], acc);
        dots[c] = acc;
    }
}

/* For each of n points (rows of x, d dims) the index of the nearest of k centroids
   (squared L2 up to the point's own norm: cn[c] - 2 x.c; ties to the lower index). */
static void pqc__assign_scalar(const float *x, size_t n, int d, const float *ct, const float *cn, int kpad, int k,
                               uint16_t *idx, float *val)
{
    size_t i;
    int c, e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        float best = INFINITY;
        int bi = 0;
        for (c = 0; c < k; c++) {
            float acc = 0.0f, v;
            for (e = 0; e < d; e++) acc = fmaf(xi[e], ct[(size_t)e * kpad + c], acc);
            v = cn[c] - (acc + acc);
            if (v < best) {
                best = v;
                bi = c;
            }
        }
        idx[i] = (uint16_t)bi;
        if (val) val[i] = best;
    }
}

/* One round of k-means++ seeding: for each of n points, v = xn[i] + the lowest
   cn[c] - 2 x_i.c over the round's nb centres (rows of cs; each dot one fma chain over the
   dims from 0, the lowest kept as `v < best` keeps it), raised to 0 below it, and dist[i]
   lowered to v where v is lower: the values pqc__assign gives, in one pass over the
   points and without indices. The SIMD levels read the points in lanes: xt holds them in
   blocks of PQC__SEED_BLOCK, dims-major within each (pqc__seed_blocks), and cg the
   centres in groups of 4, dims-major within each (pqc__seed_groups). */
#define PQC__SEED_BLOCK 16
static void pqc__seedmin_scalar(const float *x, const float *xt, size_t n, int d, const float *cs, const float *cg,
                                const float *cn, int nb, const float *xn, float *dist)
{
    size_t i;
    int c, e;
    (void)xt;
    (void)cg;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        float best = INFINITY, v;
        for (c = 0; c < nb; c++) {
            float acc = 0.0f;
            for (e = 0; e < d; e++) acc = fmaf(xi[e], cs[(size_t)c * d + e], acc);
            v = cn[c] - (acc + acc);
            if (v < best) best = v;
        }
        v = xn[i] + best;
        if (v < 0.0f) v = 0.0f;
        if (v < dist[i]) dist[i] = v;
    }
}

/* xt for pqc__seedmin: x's n points in ceil(n / PQC__SEED_BLOCK) blocks, the block at
   point b holding dim e of its lane l at xt[b * d + e * PQC__SEED_BLOCK + l]; the lanes of
   the last block past n hold 0 (pqc__k_seedmin runs that block in full, on copies of its
   points' norms and distances) */
#define PQC__SEED_ROUND(n) (((n) + PQC__SEED_BLOCK - 1) / PQC__SEED_BLOCK * PQC__SEED_BLOCK)
static void pqc__seed_blocks(const float *x, size_t n, int d, float *xt)
{
    size_t b, l;
    int e;
    for (b = 0; b < n; b += PQC__SEED_BLOCK) {
        float *o = xt + b * (size_t)d;
        for (e = 0; e < d; e++)
            for (l = 0; l < PQC__SEED_BLOCK; l++) *o++ = b + l < n ? x[(b + l) * (size_t)d + e] : 0.0f;
    }
}

/* cg for pqc__seedmin: the whole groups of 4 of cs's nb centres, dim e of the group at
   centre c at cg[c * d + e * 4 + q] (centres left over are read from cs) */
static void pqc__seed_groups(const float *cs, int nb, int d, float *cg)
{
    int c, q, e;
    for (c = 0; c + 4 <= nb; c += 4)
        for (q = 0; q < 4; q++)
            for (e = 0; e < d; e++) cg[(size_t)c * d + (size_t)e * 4 + (size_t)q] = cs[(size_t)(c + q) * d + e];
}

/* out[t] = sum_j lut[j*ksub + code_j(t0+t)], j ascending, from 0 */
static void pqc__scan_scalar(const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n, float *out)
{
    size_t t;
    int j;
    for (t = 0; t < n; t++) out[t] = 0.0f;
    for (j = 0; j < cd->m; j++) {
        const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
        const float *l = lut + (size_t)j * ksub;
        unsigned mask = (1u << cd->bits) - 1u;
        for (t = 0; t < n; t++) {
            size_t bit = (t0 + t) * (size_t)cd->bits;
            unsigned v = ((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7);
            out[t] += l[v & mask];
        }
    }
}

static float pqc__max_scalar(const float *x, size_t n)
{
    float m = -INFINITY;
    size_t i;
    for (i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp for x <= 0: Cody-Waite reduction and a degree-5 polynomial with explicit fused
   operations, so the SIMD versions reproduce it exactly. Relative error < 2e-7. */
#define PQC__EXP_LO (-87.3f)
#define PQC__LOG2E 1.44269504088896341f
#define PQC__LN2_HI 0.693359375f
#define PQC__LN2_LO (-2.12194440e-4f)
#define PQC__EP0 1.9875691500e-4f
#define PQC__EP1 1.3981999507e-3f
#define PQC__EP2 8.3334519073e-3f
#define PQC__EP3 4.1665795894e-2f
#define PQC__EP4 1.6666665459e-1f
#define PQC__EP5 5.0000001201e-1f
static float pqc__expf(float x)
{
    float n, r, z, y, p2;
    int ni;
    uint32_t u;
    if (!(x > PQC__EXP_LO)) x = PQC__EXP_LO;
    n = nearbyintf(x * PQC__LOG2E);
    r = fmaf(n, -PQC__LN2_HI, x);
    r = fmaf(n, -PQC__LN2_LO, r);
    z = r * r;
    y = PQC__EP0;
    y = fmaf(y, r, PQC__EP1);
    y = fmaf(y, r, PQC__EP2);
    y = fmaf(y, r, PQC__EP3);
    y = fmaf(y, r, PQC__EP4);
    y = fmaf(y, r, PQC__EP5);
    y = fmaf(y, z, r);
    y = y + 1.0f;
    ni = (int)n;
    u = (uint32_t)(ni + 127) << 23;
    memcpy(&p2, &u, 4);
    return y * p2;
}

/* e[t] = exp((s[t] - mx) * scale); returns the sum over 16 interleaved lanes
   (lane t % 16), the lanes then added in order: the canonical summation order. */
static float pqc__expsum_scalar(const float *s, size_t n, float mx, float scale, float *e)
{
    float lanes[16] = {0}, z = 0.0f;
    size_t t;
    int l;
    for (t = 0; t < n; t++) {
        e[t] = pqc__expf((s[t] - mx) * scale);
        lanes[t & 15] += e[t];
    }
    for (l = 0; l < 16; l++) z += lanes[l];
    return z;
}

/* The end of a lane sum: values t..n-1 of x into lanes (value t into lane t mod 16), then
   the lanes added in order from 0. */
static float pqc__lanes_end(float *lanes, const float *x, size_t t, size_t n)
{
    float z = 0.0f;
    int l;
    for (; t < n; t++) lanes[t & 15] += x[t];
    for (l = 0; l < 16; l++) z += lanes[l];
    return z;
}

/* The sum of n values as pqc__expsum adds its exponentials: 16 lanes (value t into lane
   t mod 16, in order), then the lanes in order from 0. */
static float pqc__lanesum_scalar(const float *x, size_t n)
{
    float lanes[16] = {0};
    return pqc__lanes_end(lanes, x, 0, n);
}

/* acc[t] = fma(e[t], w, acc[t]) */
static void pqc__axpy_scalar(const float *e, size_t n, float w, float *acc)
{
    size_t t;
    for (t = 0; t < n; t++) acc[t] = fmaf(e[t], w, acc[t]);
}

/* The scores of query heads [h_lo, h_hi) over tokens [t_lo, t_hi) in one pass over the
   codes: out[h * ostride + t] = sum_j lut[(j*ksub + code_j(t0+t))*g + h], j ascending,
   from 0 (for each head the very sums pqc__scan makes from its own table), and
   mx[h] = max(mx[h], each of them). lut: the g heads' tables interleaved, [m][ksub][g].
   prod: the same with products from 1 in place of the sums from 0 (tables of
   exponentials: a product of them is the exponential of the sum). */
static void pqc__scan_heads_part(const pqc_codes *cd, const float *lut, int ksub, int g, int prod, int h_lo, int h_hi,
                                 size_t t0, size_t t_lo, size_t t_hi, float *out, size_t ostride, float *mx)
{
    size_t t;
    int h, j;
    unsigned mask = (1u << cd->bits) - 1u;
    for (t = t_lo; t < t_hi; t++)
        for (h = h_lo; h < h_hi; h++) {
            float a = prod ? 1.0f : 0.0f;
            for (j = 0; j < cd->m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
                size_t bit = (t0 + t) * (size_t)cd->bits;
                unsigned v = ((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7);
                float x = lut[((size_t)j * (size_t)ksub + (v & mask)) * (size_t)g + (size_t)h];
                a = prod ? a * x : a + x;
            }
            out[(size_t)h * ostride + t] = a;
            mx[h] = a > mx[h] ? a : mx[h];
        }
}

#if PQC__X86 || PQC__NEON
/* The end of a SIMD pass over heads in groups of four and tokens in steps of four: the
   running maxima of the last group (lanes[4][4], head by head) folded into mx, as the
   scalar reference compares; then the heads past the groups (h0..g) over the tokens done,
   and every head over the tokens left (nv..n), by the scalar reference. */
static void pqc__scan_heads_end(const pqc_codes *cd, const float *lut, int ksub, int g, int prod, const float *lanes,
                                int h0, size_t t0, size_t nv, size_t n, float *out, size_t ostride, float *mx)
{
    int i;
    for (i = 0; lanes && i < 4; i++) {
        float x = pqc__max_scalar(lanes + 4 * i, 4);
        mx[i] = x > mx[i] ? x : mx[i];
    }
    if (h0 < g) pqc__scan_heads_part(cd, lut, ksub, g, prod, h0, g, t0, 0, nv, out, ostride, mx);
    if (nv < n) pqc__scan_heads_part(cd, lut, ksub, g, prod, 0, g, t0, nv, n, out, ostride, mx);
}
#endif

/* every head over n tokens from t0 (the reference of the SIMD versions) */
static void pqc__scan_heads_scalar(const pqc_codes *cd, const float *lut, int ksub, int g, size_t t0, size_t n,
                                   float *out, size_t ostride, float *mx)
{
    pqc__scan_heads_part(cd, lut, ksub, g, 0, 0, g, t0, 0, n, out, ostride, mx);
}

/* Four heads' products over n tokens from t0 (8-bit codes) into each head's row of out
   (pqc__scan_heads_part with prod), and z[h] = the row's sum as pqc__lanesum adds it (the
   reference of the SIMD versions). el: the four heads' tables of exponentials
   interleaved, [m][ksub][4]. */
static void pqc__scan_products_scalar(const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n, float *out,
                                      size_t ostride, float *z)
{
    int h;
    for (h = 0; h < 4; h++) z[h] = -INFINITY; /* (the maxima the scan also makes, unused) */
    pqc__scan_heads_part(cd, el, ksub, 4, 1, 0, 4, t0, 0, n, out, ostride, z);
    for (h = 0; h < 4; h++) z[h] = pqc__lanesum_scalar(out + (size_t)h * ostride, n);
}

/* out[t] = sum_h e[h * estride + t] * w[h]: one fused chain from 0, heads in order (the
   axpy of each head in turn onto zeros). out may be e (row 0 combined in place): every
   level reads a step's values of all rows before it writes the step's results. */
static void pqc__combine_scalar(const float *e, size_t estride, int g, size_t n, const float *w, float *out)
{
    size_t t;
    int h;
    for (t = 0; t < n; t++) {
        float acc = 0.0f;
        for (h = 0; h < g; h++) acc = fmaf(e[(size_t)h * estride + t], w[h], acc);
        out[t] = acc;
    }
}

/* n fp16 or bf16 values (t) to fp32, as pqc__row_to_f32 makes them: exactly, every
   finite value and infinity alike (the SIMD versions may give a NaN another payload) */
static void pqc__halfrow_scalar(const void *src, pqc_dtype t, size_t n, float *dst)
{
    pqc__row_to_f32(src, t, n, dst);
}

/* A fetched row pair: K and V, d stored values of type t each, as fp32 into ko and vo.
   With stream, the x86 levels write a pair whose destinations start on a 64-byte line
   with non-temporal stores (whole lines, around the caches: pqc__fetch_copy says when);
   the values are the same either way. pqc__rowpair_by: ordinary stores, through a
   level's conversion. */
static void pqc__rowpair_by(void (*halfrow)(const void *, pqc_dtype, size_t, float *), const void *k, const void *v,
                            pqc_dtype t, size_t d, float *ko, float *vo)
{
    if (t == PQC_F32) {
        memcpy(ko, k, d * sizeof(float));
        memcpy(vo, v, d * sizeof(float));
    } else {
        halfrow(k, t, d, ko);
        halfrow(v, t, d, vo);
    }
}
static void pqc__rowpair_scalar(const void *k, const void *v, pqc_dtype t, size_t d, float *ko, float *vo, int stream)
{
    (void)stream;
    pqc__rowpair_by(pqc__halfrow_scalar, k, v, t, d, ko, vo);
}

/* n fp32 values to fp16 or bf16 (t), each as pqc_f32_to_f16 / pqc_f32_to_bf16 makes it */
static void pqc__narrow_scalar(const float *src, pqc_dtype t, size_t n, void *dst)
{
    unsigned char *p = (unsigned char *)dst;
    size_t i;
    for (i = 0; i < n; i++) {
        uint16_t h = t == PQC_F16 ? pqc_f32_to_f16(src[i]) : pqc_f32_to_bf16(src[i]);
        memcpy(p + 2 * i, &h, 2);
    }
}

/* pqc__within as a kernel of its own level */
static int pqc__within_scalar(const float *x, size_t n, float limit) { return pqc__within(x, n, limit); }

/* exact dot of q with n rows of k (fp32, row stride in floats): 16 interleaved lane
   accumulators over the dims (lane e % 16), then the lanes added in order. */
static void pqc__rowdots_scalar(const float *q, const float *rows, size_t n, size_t stride, int d, float *out)
{
    size_t i;
    int e, l;
    for (i = 0; i < n; i++) {
        const float *r = rows + i * stride;
        float lanes[16] = {0}, acc = 0.0f;
        for (e = 0; e < d; e++) lanes[e & 15] = fmaf(q[e], r[e], lanes[e & 15]);
        for (l = 0; l < 16; l++) acc += lanes[l];
        out[i] = acc;
    }
}

/* a hint that p is read soon, into the second-level cache (GCC and clang; nothing
   elsewhere): for scattered rows it beat asking into the first level (figures below) */
#if defined(__GNUC__) || defined(__clang__)
#define PQC__PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 2)
#else
#define PQC__PREFETCH(p) ((void)(p))
#endif
/* scattered rows (re-ranking's candidates, the fetch's selection) are asked for this
   many rows before they are read. Select + fetch of one layer at 128K tokens, one core
   (Zen 4), against 8 rows ahead into the first level: 8 KV heads of 128, fp32 rows
   37.9-38.4 -> 33.0-33.3 ms, fp16 rows 27.7 -> 26.8 ms; 4 KV heads of 256 33.0 -> 26.3
   ms. 24 rows ahead (fp32) and 32 (fp16) were no better. */
#define PQC__ROWS_AHEAD 16

/* The dots of n stored key rows (fp32, fp16 or bf16; stride bytes apart) with q, as
   pqc__rowdots makes them of the rows in fp32, with the key check of pqc__within on
   those values: returns the first row that fails it, or n. row: d floats of scratch.
   pqc__keydots_copy: through an fp32 copy of each row, with one level's conversion,
   check and dots (out NULL: the check alone); the scalar reference, NEON, and the rows
   the AVX2 pass leaves. */
typedef struct pqc__keydots_level {
    void (*halfrow)(const void *src, pqc_dtype t, size_t n, float *dst);
    int (*within)(const float *x, size_t n, float limit);
    void (*rowdots)(const float *q, const float *rows, size_t n, size_t stride, int d, float *out);
} pqc__keydots_level;
static size_t pqc__keydots_copy(const pqc__keydots_level *lv, const float *q, const unsigned char *rows, size_t stride,
                                pqc_dtype t, size_t n, int d, float limit, float *row, float *out)
{
    size_t i, bad = n;
    for (i = 0; i < n && (out || bad == n); i++) {
        if (t == PQC_F32) memcpy(row, rows + i * stride, (size_t)d * sizeof(float));
        else lv->halfrow(rows + i * stride, t, (size_t)d, row);
        if (bad == n && !lv->within(row, (size_t)d, limit)) bad = i;
        if (out) lv->rowdots(q, row, 1, (size_t)d, d, out + i);
    }
    return bad;
}
static size_t pqc__keydots_scalar(const float *q, const unsigned char *rows, size_t stride, pqc_dtype t, size_t n,
                                   int d, float limit, float *row, float *out)
{
    static const pqc__keydots_level lv = {pqc__halfrow_scalar, pqc__within_scalar, pqc__rowdots_scalar};
    return pqc__keydots_copy(&lv, q, rows, stride, t, n, d, limit, row, out);
}

/* The dots of g queries (q: g rows of d) with the stored key rows idx[0..n) of base
   (stride bytes apart; idx NULL: rows 0..n), row after row, every head of a row at once:
   out[h * ostride + i] = the dot of head h with row idx[i], as pqc__rowdots makes it of
   that row in fp32. With check, each row is first checked as pqc__within checks its
   values; the first that fails is returned and the call stops there (n: all passed).
   Scattered rows are asked for PQC__ROWS_AHEAD rows early, and a row's dots are taken
   while the next rows are on their way: re-ranking's candidates cost about a read each
   (a batch of converted rows with each head's dots over the batch left the reads idle
   while it multiplied: 128K fp16 rows, 26K candidates, 4 heads, 83-105 -> 65-72 ns per
   candidate, the same bits). row: d floats of scratch. pqc__gather_at: row i, the row
   PQC__ROWS_AHEAD on (rb bytes) asked for. pqc__gatherdots_copy: through an fp32 copy of
   each row with one level's conversion, check and dots; the scalar reference, NEON, and
   widths the x86 levels do not take. */
static const unsigned char *pqc__gather_at(const unsigned char *base, size_t stride, size_t rb, const uint32_t *idx,
                                           size_t i, size_t n)
{
    size_t o;
    if (idx && i + PQC__ROWS_AHEAD < n)
        for (o = 0; o < rb; o += 64) PQC__PREFETCH(base + (size_t)idx[i + PQC__ROWS_AHEAD] * stride + o);
    return base + (idx ? (size_t)idx[i] : i) * stride;
}
static size_t pqc__gatherdots_copy(const pqc__keydots_level *lv, const float *q, int g, const unsigned char *base,
                                   size_t stride, pqc_dtype t, const uint32_t *idx, size_t n, int d, int check,
                                   float limit, float *row, float *out, size_t ostride)
{
    size_t i;
    int h;
    for (i = 0; i < n; i++) {
        const unsigned char *r = pqc__gather_at(base, stride, (size_t)d * pqc_dtype_size(t), idx, i, n);
        if (t == PQC_F32) memcpy(row, r, (size_t)d * sizeof(float));
        else lv->halfrow(r, t, (size_t)d, row);
        if (check && !lv->within(row, (size_t)d, limit)) return i;
        for (h = 0; h < g; h++) lv->rowdots(q + (size_t)h * (size_t)d, row, 1, (size_t)d, d, out + (size_t)h * ostride + i);
    }
    return n;
}
static size_t pqc__gatherdots_scalar(const float *q, int g, const unsigned char *base, size_t stride, pqc_dtype t,
                                     const uint32_t *idx, size_t n, int d, int check, float limit, float *row,
                                     float *out, size_t ostride)
{
    static const pqc__keydots_level lv = {pqc__halfrow_scalar, pqc__within_scalar, pqc__rowdots_scalar};
    return pqc__gatherdots_copy(&lv, q, g, base, stride, t, idx, n, d, check, limit, row, out, ostride);
}

/* out[i] = |x_i|^2 for n points of d dims: one fused chain over the dims from 0, in
   order (fmaf: a libm call per value where the build has no FMA instructions) */
static void pqc__sqnorms_scalar(const float *x, size_t n, int d, float *out)
{
    size_t i;
    int e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        float acc = 0.0f;
        for (e = 0; e < d; e++) acc = fmaf(xi[e], xi[e], acc);
        out[i] = acc;
    }
}

/* sum[idx[i]][e] += x[i][e] in double, points in index order (exact at every level) */
static void pqc__accum_scalar(const float *x, size_t n, int d, const uint16_t *idx, double *sum)
{
    size_t i;
    int e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        double *sp = sum + (size_t)idx[i] * d;
        for (e = 0; e < d; e++) sp[e] += xi[e];
    }
}

/* The top-k's keys (section 5): an order-preserving integer image of each score */
static uint32_t pqc__fkey(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u &= 0u - (uint32_t)((u << 1) != 0);                  /* -0 == +0 */
    return u ^ ((0u - (u >> 31)) | 0x80000000u); /* negatives: every bit flipped; else the sign */
}

/* the score whose key is key (+0 for the key of both zeros): as floats, scores compare
   with it as their keys compare with key */
static float pqc__key_value(uint32_t key)
{
    uint32_t u = key & 0x80000000u ? key ^ 0x80000000u : ~key;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The top-k's last pass (pqc__topk_take) at each level: the indices of keys above thr and
   of the first *need keys equal to it, appended at idx + *taken (their scores at outs +
   *taken), over the scores the level takes whole blocks of; returns the scores done, and
   pqc__topk_take's scalar loop does the rest. The scalar level leaves it all to that loop.
   idx and outs hold cap entries, as many as the pass takes: a level may store whole
   vectors where they fit, the lanes past the chosen ones written again by what follows. */
static size_t pqc__take_scalar(const float *s, size_t n, uint32_t thr, size_t *need, uint32_t *idx, float *outs,
                               size_t cap, size_t *taken)
{
    (void)s, (void)n, (void)thr, (void)need, (void)idx, (void)outs, (void)cap, (void)taken;
    return 0;
}

/* The top-k's first pass (pqc__topk_keys) at each level: the keys of whole blocks of
   scores into keys[], *lo / *hi lowered / raised to their extremes; returns the scores
   done, and pqc__topk_keys' scalar loop does the rest (at the scalar level, all) */
static size_t pqc__topk_keys_scalar(const float *s, size_t n, uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    (void)s, (void)n, (void)keys, (void)lo, (void)hi;
    return 0;
}

/* The radix select's compaction (pqc__topk_thresh) at each level: the keys of cand[0..n)
   whose digit ((key - base) >> shift) is b, moved to the front in order from cand + *nc
   (*nc <= the first key not yet read), over whole blocks; returns the keys read, and
   pqc__topk_thresh's scalar loop does the rest (at the scalar level, all) */
static size_t pqc__topk_bin_scalar(uint32_t *cand, size_t n, uint32_t base, int shift, uint32_t b, size_t *nc)
{
    (void)cand, (void)n, (void)base, (void)shift, (void)b, (void)nc;
    return 0;
}

/* The select's compaction pass (pqc__bracket_scalar) from score i0 on: *na +=
   the scores above hi, and the scores with lo <= s <= hi appended at cs + *nc (cs needs 16
   elements of slack: the SIMD levels store whole vectors) */
static void pqc__bracket_from(const float *s, size_t i0, size_t n, float lo, float hi, size_t *na, float *cs,
                              size_t *nc)
{
    size_t i, a = *na, c = *nc;
    for (i = i0; i < n; i++) {
        float v = s[i];
        a += v > hi;
        cs[c] = v;
        c += (v >= lo) & (v <= hi);
    }
    *na = a;
    *nc = c;
}

static void pqc__bracket_scalar(const float *s, size_t n, float lo, float hi, size_t *na, float *cs, size_t *nc)
{
    *na = *nc = 0;
    pqc__bracket_from(s, 0, n, lo, hi, na, cs, nc);
}

#if PQC__X86
/* GCC's own intrinsic headers self-initialise their "undefined" vectors, which its C++
   front end reports as maybe-uninitialised at our call sites: silence just that. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/* ----- AVX2 ----- */
PQC__AVX2 static void pqc__dots_avx2(const float *x, int d, const float *ct, int kpad, int k, float *dots)
{
    int c = 0, e;
    for (; c + 32 <= kpad && c + 32 <= k; c += 32) { /* four independent chains */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *cp = ct + c;
        for (e = 0; e < d; e++, cp += kpad) {
            __m256 s = _mm256_set1_ps(x[e]);
            a0 = _mm256_fmadd_ps(s, _mm256_loadu_ps(cp), a0);
            a1 = _mm256_fmadd_ps(s, _mm256_loadu_ps(cp + 8), a1);
            a2 = _mm256_fmadd_ps(s, _mm256_loadu_ps(cp + 16), a2);
            a3 = _mm256_fmadd_ps(s, _mm256_loadu_ps(cp + 24), a3);
        }
        _mm256_storeu_ps(dots + c, a0);
        _mm256_storeu_ps(dots + c + 8, a1);
        _mm256_storeu_ps(dots + c + 16, a2);
        _mm256_storeu_ps(dots + c + 24, a3);
    }
    for (; c + 8 <= kpad && c < k; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        float tmp[8];
        int l;
        for (e = 0; e < d; e++) acc = _mm256_fmadd_ps(_mm256_set1_ps(x[e]), _mm256_loadu_ps(ct + (size_t)e * kpad + c), acc);
        _mm256_storeu_ps(tmp, acc);
        for (l = 0; l < 8 && c + l < k; l++) dots[c + l] = tmp[l];
    }
}

/* the running best of one point's lanes (a lane sees its centroids in ascending order),
   then the point's answer: the scalar loop's, the lowest value with ties to the lower index */
PQC__AVX2 static inline void pqc__assign_upd_avx2(__m256 acc, __m256 cnv, __m256i ci, __m256 *best, __m256i *bidx)
{
    __m256 v = _mm256_sub_ps(cnv, _mm256_add_ps(acc, acc)), lt = _mm256_cmp_ps(v, *best, _CMP_LT_OQ);
    *best = _mm256_blendv_ps(*best, v, lt);
    *bidx = _mm256_blendv_epi8(*bidx, ci, _mm256_castps_si256(lt));
}

PQC__AVX2 static inline void pqc__assign_done_avx2(__m256 best, __m256i bidx, uint16_t *idx, float *val)
{
    /* the lowest value, then the lowest index among the lanes holding it (a lane's value
       is never NaN: a NaN distance never wins the comparison) */
    __m256 m = _mm256_min_ps(best, _mm256_permute2f128_ps(best, best, 1));
    __m256i cand;
    m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    cand = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fffffff), bidx, _mm256_castps_si256(_mm256_cmp_ps(best, m, _CMP_EQ_OQ)));
    cand = _mm256_min_epi32(cand, _mm256_permute2x128_si256(cand, cand, 1));
    cand = _mm256_min_epi32(cand, _mm256_shuffle_epi32(cand, _MM_SHUFFLE(1, 0, 3, 2)));
    cand = _mm256_min_epi32(cand, _mm256_shuffle_epi32(cand, _MM_SHUFFLE(2, 3, 0, 1)));
    *idx = (uint16_t)_mm256_cvtsi256_si32(cand);
    if (val) *val = _mm256_cvtss_f32(m);
}

/* Four points against sixteen centroids a step (eight independent fused chains, each the
   scalar loop's chain over the dims), then the points left one at a time. */
PQC__AVX2 static void pqc__assign_avx2(const float *x, size_t n, int d, const float *ct, const float *cn, int kpad,
                                       int k, uint16_t *idx, float *val)
{
    size_t i = 0;
    int c, e, p;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    (void)k; /* padded centroids have cn = +inf and never win */
    for (; i + 4 <= n && kpad % 16 == 0; i += 4) {
        const float *x0 = x + i * (size_t)d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
        __m256 best[4];
        __m256i bidx[4];
        for (p = 0; p < 4; p++) {
            best[p] = _mm256_set1_ps(INFINITY);
            bidx[p] = _mm256_setzero_si256();
        }
        for (c = 0; c < kpad; c += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e0 = a0, e1 = a0, e2 = a0, e3 = a0;
            __m256 cn0 = _mm256_loadu_ps(cn + c), cn1 = _mm256_loadu_ps(cn + c + 8);
            __m256i ci0 = _mm256_add_epi32(lane, _mm256_set1_epi32(c)), ci1 = _mm256_add_epi32(ci0, _mm256_set1_epi32(8));
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                __m256 v0 = _mm256_loadu_ps(cp), v1 = _mm256_loadu_ps(cp + 8), s;
                s = _mm256_set1_ps(x0[e]);
                a0 = _mm256_fmadd_ps(s, v0, a0);
                e0 = _mm256_fmadd_ps(s, v1, e0);
                s = _mm256_set1_ps(x1[e]);
                a1 = _mm256_fmadd_ps(s, v0, a1);
                e1 = _mm256_fmadd_ps(s, v1, e1);
                s = _mm256_set1_ps(x2[e]);
                a2 = _mm256_fmadd_ps(s, v0, a2);
                e2 = _mm256_fmadd_ps(s, v1, e2);
                s = _mm256_set1_ps(x3[e]);
                a3 = _mm256_fmadd_ps(s, v0, a3);
                e3 = _mm256_fmadd_ps(s, v1, e3);
            }
            pqc__assign_upd_avx2(a0, cn0, ci0, &best[0], &bidx[0]);
            pqc__assign_upd_avx2(e0, cn1, ci1, &best[0], &bidx[0]);
            pqc__assign_upd_avx2(a1, cn0, ci0, &best[1], &bidx[1]);
            pqc__assign_upd_avx2(e1, cn1, ci1, &best[1], &bidx[1]);
            pqc__assign_upd_avx2(a2, cn0, ci0, &best[2], &bidx[2]);
            pqc__assign_upd_avx2(e2, cn1, ci1, &best[2], &bidx[2]);
            pqc__assign_upd_avx2(a3, cn0, ci0, &best[3], &bidx[3]);
            pqc__assign_upd_avx2(e3, cn1, ci1, &best[3], &bidx[3]);
        }
        for (p = 0; p < 4; p++) pqc__assign_done_avx2(best[p], bidx[p], idx + i + p, val ? val + i + p : NULL);
    }
    for (; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        __m256 best = _mm256_set1_ps(INFINITY);
        __m256i bidx = _mm256_setzero_si256();
        for (c = 0; c < kpad; c += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (e = 0; e < d; e++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(xi[e]), _mm256_loadu_ps(ct + (size_t)e * kpad + c), acc);
            pqc__assign_upd_avx2(acc, _mm256_loadu_ps(cn + c), _mm256_add_epi32(lane, _mm256_set1_epi32(c)), &best, &bidx);
        }
        pqc__assign_done_avx2(best, bidx, idx + i, val ? val + i : NULL);
    }
}

/* Points in lanes: one block (16 points, two registers) x 4 centres per register tile
   (8 accumulators, 6 loads per 8 fused adds), then single centres; each lane's dot is
   the scalar chain over the dims, the minimum `v < best` lane by lane. Points past the
   last block: the scalar reference. */
PQC__AVX2 static void pqc__seedmin_avx2(const float *x, const float *xt, size_t n, int d, const float *cs,
                                        const float *cg, const float *cn, int nb, const float *xn, float *dist)
{
    size_t i = 0, sd = (size_t)d;
    const __m256 zero = _mm256_setzero_ps();
    int c, e, h;
    for (; i + PQC__SEED_BLOCK <= n; i += PQC__SEED_BLOCK) {
        const float *p = xt + i * sd;
        __m256 best0 = _mm256_set1_ps(INFINITY), best1 = best0, v;
        for (c = 0; c + 4 <= nb; c += 4) {
            const float *cc = cg + (size_t)c * sd;
            __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, b0 = zero, b1 = zero, b2 = zero, b3 = zero;
            for (e = 0; e < d; e++, cc += 4) {
                const __m256 v0 = _mm256_loadu_ps(p + (size_t)e * PQC__SEED_BLOCK),
                             v1 = _mm256_loadu_ps(p + (size_t)e * PQC__SEED_BLOCK + 8);
                __m256 s_;
#define PQC__SFMA(Q)                                                                                                   \
    s_ = _mm256_broadcast_ss(cc + Q);                                                                                  \
    a##Q = _mm256_fmadd_ps(v0, s_, a##Q);                                                                              \
    b##Q = _mm256_fmadd_ps(v1, s_, b##Q)
                PQC__SFMA(0);
                PQC__SFMA(1);
                PQC__SFMA(2);
                PQC__SFMA(3);
#undef PQC__SFMA
            }
#define PQC__SMIN(Q)                                                                                                   \
    v = _mm256_set1_ps(cn[c + Q]);                                                                                     \
    best0 = _mm256_min_ps(_mm256_sub_ps(v, _mm256_add_ps(a##Q, a##Q)), best0);                                         \
    best1 = _mm256_min_ps(_mm256_sub_ps(v, _mm256_add_ps(b##Q, b##Q)), best1)
            PQC__SMIN(0);
            PQC__SMIN(1);
            PQC__SMIN(2);
            PQC__SMIN(3);
#undef PQC__SMIN
        }
        for (; c < nb; c++) {
            const float *cc = cs + (size_t)c * sd;
            __m256 a0 = zero, b0 = zero;
            for (e = 0; e < d; e++) {
                const __m256 s_ = _mm256_broadcast_ss(cc + e);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + (size_t)e * PQC__SEED_BLOCK), s_, a0);
                b0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + (size_t)e * PQC__SEED_BLOCK + 8), s_, b0);
            }
            v = _mm256_set1_ps(cn[c]);
            best0 = _mm256_min_ps(_mm256_sub_ps(v, _mm256_add_ps(a0, a0)), best0);
            best1 = _mm256_min_ps(_mm256_sub_ps(v, _mm256_add_ps(b0, b0)), best1);
        }
        for (h = 0; h < 2; h++) { /* v = xn + best, raised to 0 below it; dist = v where v is lower */
            v = _mm256_add_ps(_mm256_loadu_ps(xn + i + 8 * (size_t)h), h ? best1 : best0);
            v = _mm256_blendv_ps(v, zero, _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
            _mm256_storeu_ps(dist + i + 8 * (size_t)h, _mm256_min_ps(v, _mm256_loadu_ps(dist + i + 8 * (size_t)h)));
        }
    }
    if (i < n) pqc__seedmin_scalar(x + i * sd, NULL, n - i, d, cs, NULL, cn, nb, xn + i, dist + i);
}

PQC__AVX2 static void pqc__scan_avx2(const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n, float *out)
{
    size_t t = 0;
    int j, b = cd->bits;
    unsigned mask = (1u << b) - 1u;
    if (b == 4 && (t0 & 1) == 0) {
        /* 16-entry tables held in two registers: eight codes (four bytes, the low nibble
           first) look up both halves, the code's bit 3 picks one; j ascending from 0 */
        const __m128i lo4 = _mm_set1_epi8(0x0f);
        for (; t + 8 <= n; t += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (j = 0; j < cd->m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride + ((t0 + t) >> 1);
                const float *l = lut + (size_t)j * ksub;
                int w;
                __m128i v, ix8;
                __m256i ix;
                memcpy(&w, col, 4);
                v = _mm_cvtsi32_si128(w);
                ix8 = _mm_unpacklo_epi8(_mm_and_si128(v, lo4), _mm_and_si128(_mm_srli_epi16(v, 4), lo4));
                ix = _mm256_cvtepu8_epi32(ix8);
                acc = _mm256_add_ps(acc, _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(l), ix),
                                                          _mm256_permutevar8x32_ps(_mm256_loadu_ps(l + 8), ix),
                                                          _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28))));
            }
            _mm256_storeu_ps(out + t, acc);
        }
    } else if (b != 8 && t0 + n < ((size_t)1 << 28)) {
        /* any other width: eight codes out of one byte-offset gather (each lane reads the
           32 bits holding its code) and a variable shift; tables of up to 8 entries are
           looked up in a register */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vb = _mm256_set1_epi32(b),
                      vmask = _mm256_set1_epi32((int)mask), seven = _mm256_set1_epi32(7);
        const __m256i tmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(ksub), lane);
        for (; t + 8 <= n; t += 8) {
            __m256 acc = _mm256_setzero_ps();
            __m256i bits = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_set1_epi32((int)(t0 + t)), lane), vb);
            __m256i byte = _mm256_srli_epi32(bits, 3), sh = _mm256_and_si256(bits, seven);
            for (j = 0; j < cd->m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
                const float *l = lut + (size_t)j * ksub;
                __m256i w = _mm256_i32gather_epi32((const int *)(const void *)col, byte, 1);
                __m256i ix = _mm256_and_si256(_mm256_srlv_epi32(w, sh), vmask);
                acc = _mm256_add_ps(acc, ksub <= 8 ? _mm256_permutevar8x32_ps(_mm256_maskload_ps(l, tmask), ix)
                                                   : _mm256_i32gather_ps(l, ix, 4));
            }
            _mm256_storeu_ps(out + t, acc);
        }
    }
    for (; t + 8 <= n; t += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j < cd->m; j++) {
            const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
            __m256i ix;
            if (b == 8) {
                ix = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + t0 + t)));
            } else {
                int l, tmp[8];
                for (l = 0; l < 8; l++) {
                    size_t bit = (t0 + t + (size_t)l) * (size_t)b;
                    unsigned v = ((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7);
                    tmp[l] = (int)(v & mask);
                }
                ix = _mm256_loadu_si256((const __m256i *)tmp);
            }
            acc = _mm256_add_ps(acc, _mm256_i32gather_ps(lut + (size_t)j * ksub, ix, 4));
        }
        _mm256_storeu_ps(out + t, acc);
    }
    if (t < n) pqc__scan_scalar(cd, lut, ksub, t0 + t, n - t, out + t);
}

PQC__AVX2 static float pqc__max_avx2(const float *x, size_t n)
{
    __m256 m = _mm256_set1_ps(-INFINITY);
    float tmp[8], r;
    size_t i = 0;
    int l;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    _mm256_storeu_ps(tmp, m);
    r = pqc__max_scalar(x + i, n - i);
    for (l = 0; l < 8; l++) r = tmp[l] > r ? tmp[l] : r;
    return r;
}

PQC__AVX2 static __m256 pqc__exp_avx2(__m256 x)
{
    __m256 n, r, z, y;
    __m256i ni;
    x = _mm256_max_ps(x, _mm256_set1_ps(PQC__EXP_LO));
    n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(PQC__LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-PQC__LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-PQC__LN2_LO), r);
    z = _mm256_mul_ps(r, r);
    y = _mm256_set1_ps(PQC__EP0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PQC__EP1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PQC__EP2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PQC__EP3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PQC__EP4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PQC__EP5));
    y = _mm256_fmadd_ps(y, z, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    ni = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(ni));
}

PQC__AVX2 static float pqc__expsum_avx2(const float *s, size_t n, float mx, float scale, float *e)
{
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(mx), vs = _mm256_set1_ps(scale);
    float lanes[16], z = 0.0f;
    size_t t = 0;
    int l;
    for (; t + 16 <= n; t += 16) {
        __m256 a = pqc__exp_avx2(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm), vs));
        __m256 b = pqc__exp_avx2(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), vm), vs));
        _mm256_storeu_ps(e + t, a);
        _mm256_storeu_ps(e + t + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (; t < n; t++) {
        e[t] = pqc__expf((s[t] - mx) * scale);
        lanes[t & 15] += e[t];
    }
    for (l = 0; l < 16; l++) z += lanes[l];
    return z;
}

PQC__AVX2 static void pqc__axpy_avx2(const float *e, size_t n, float w, float *acc)
{
    size_t t = 0;
    const __m256 vw = _mm256_set1_ps(w);
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(acc + t, _mm256_fmadd_ps(_mm256_loadu_ps(e + t), vw, _mm256_loadu_ps(acc + t)));
    for (; t < n; t++) acc[t] = fmaf(e[t], w, acc[t]);
}

/* Four heads from h0 at a time, four tokens a step: each token's four scores are one
   vector load per sub-space from the interleaved tables, added in j order, then turned
   into four rows of four tokens. Tokens past the last group of four and heads past the
   last group of four: the scalar reference. gs: g (g = 4 has pqc__scan_g4_avx2). */
PQC__AVX2 static inline void pqc__scan_heads4_avx2(const pqc_codes *cd, const float *lut, int ksub, size_t gs,
                                                   size_t t0, size_t n, float *out, size_t ostride, float *mx)
{
    size_t t, h0, nv = n & ~(size_t)3;
    int j, m = cd->m;
    for (h0 = 0; h0 + 4 <= gs; h0 += 4) {
        __m128 x0 = _mm_set1_ps(-INFINITY), x1 = x0, x2 = x0, x3 = x0;
        float *o = out + h0 * ostride, lanes[16];
        for (t = 0; t < nv; t += 4) {
            __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (j = 0; j < m; j++) {
                const unsigned char *c = cd->data + (size_t)j * cd->col_stride + t0 + t;
                const float *l = lut + (size_t)j * (size_t)ksub * gs + h0;
                a0 = _mm_add_ps(a0, _mm_loadu_ps(l + (size_t)c[0] * gs));
                a1 = _mm_add_ps(a1, _mm_loadu_ps(l + (size_t)c[1] * gs));
                a2 = _mm_add_ps(a2, _mm_loadu_ps(l + (size_t)c[2] * gs));
                a3 = _mm_add_ps(a3, _mm_loadu_ps(l + (size_t)c[3] * gs));
            }
            _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
            _mm_storeu_ps(o + t, a0);
            _mm_storeu_ps(o + ostride + t, a1);
            _mm_storeu_ps(o + 2 * ostride + t, a2);
            _mm_storeu_ps(o + 3 * ostride + t, a3);
            x0 = _mm_max_ps(a0, x0); /* a > x ? a : x, as the scalar reference */
            x1 = _mm_max_ps(a1, x1);
            x2 = _mm_max_ps(a2, x2);
            x3 = _mm_max_ps(a3, x3);
        }
        _mm_storeu_ps(lanes, x0);
        _mm_storeu_ps(lanes + 4, x1);
        _mm_storeu_ps(lanes + 8, x2);
        _mm_storeu_ps(lanes + 12, x3);
        pqc__scan_heads_end(cd, lut, ksub, (int)gs, 0, lanes, (int)gs, t0, nv, nv, out, ostride, mx + h0);
    }
    pqc__scan_heads_end(cd, lut, ksub, (int)gs, 0, NULL, (int)h0, t0, nv, n, out, ostride, mx);
}

/* g = 4 (the usual GQA group), as pqc__scan_heads4_avx2 with the group size a constant
   (a shift, not a multiply, per code) and eight tokens a step in two groups of four
   accumulators: the same additions in the same order. */
#define PQC__G4_ADD(a, i) a = _mm_add_ps(a, _mm_loadu_ps(l + ((size_t)c[i] << 2)))
#define PQC__G4_OUT(a0, a1, a2, a3, tt)                                                                                    do {                                                                                                                       _MM_TRANSPOSE4_PS(a0, a1, a2, a3);                                                                                     _mm_storeu_ps(out + (tt), a0);                                                                                         _mm_storeu_ps(out + ostride + (tt), a1);                                                                               _mm_storeu_ps(out + 2 * ostride + (tt), a2);                                                                           _mm_storeu_ps(out + 3 * ostride + (tt), a3);                                                                           x0 = _mm_max_ps(a0, x0);                                                                                               x1 = _mm_max_ps(a1, x1);                                                                                               x2 = _mm_max_ps(a2, x2);                                                                                               x3 = _mm_max_ps(a3, x3);                                                                                           } while (0)
PQC__AVX2 static void pqc__scan_g4_avx2(const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n, float *out,
                                        size_t ostride, float *mx)
{
    size_t t, nv = n & ~(size_t)7, tab = (size_t)ksub * 4;
    int j, m = cd->m;
    __m128 x0 = _mm_set1_ps(-INFINITY), x1 = x0, x2 = x0, x3 = x0;
    float lanes[16];
    for (t = 0; t < nv; t += 8) {
        __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const unsigned char *c = cd->data + t0 + t;
        const float *l = lut;
        for (j = 0; j < m; j++, c += cd->col_stride, l += tab) {
            PQC__G4_ADD(a0, 0);
            PQC__G4_ADD(a1, 1);
            PQC__G4_ADD(a2, 2);
            PQC__G4_ADD(a3, 3);
            PQC__G4_ADD(b0, 4);
            PQC__G4_ADD(b1, 5);
            PQC__G4_ADD(b2, 6);
            PQC__G4_ADD(b3, 7);
        }
        PQC__G4_OUT(a0, a1, a2, a3, t);
        PQC__G4_OUT(b0, b1, b2, b3, t + 4);
    }
    _mm_storeu_ps(lanes, x0);
    _mm_storeu_ps(lanes + 4, x1);
    _mm_storeu_ps(lanes + 8, x2);
    _mm_storeu_ps(lanes + 12, x3);
    pqc__scan_heads_end(cd, lut, ksub, 4, 0, lanes, 4, t0, nv, n, out, ostride, mx);
}
#undef PQC__G4_ADD
#undef PQC__G4_OUT

/* g = 4, 8-bit codes: pqc__scan_products in one pass, the sums of the rows kept in 16
   lanes a head as they are written (the lanes pqc__lanesum adds: value t into lane t mod
   16), eight tokens a step as pqc__scan_g4_avx2. SSE operations only, so that each x86
   level compiles it with its own registers (AVX-512's 32 hold every lane). The codes of
   a chunk of tokens are first made the offsets of their entries (code x 4 floats, 16
   bits: PQC__POFF in all, a column after another) by a vector pass, so that each
   entry's load takes its offset as it is, with no shift of its own (a quarter of the
   instructions of a step at m = 4; 128K tokens, m = 4: 1.55 -> 1.31 ns a token). Above
   PQC__POFF / 16 sub-spaces the scalar reference serves. */
#define PQC__POFF 4096
#define PQC__PLD(a, i) a = _mm_loadu_ps(l + o[i])
#define PQC__PMUL(a, i) a = _mm_mul_ps(a, _mm_loadu_ps(l + o[i]))
/* lanes q (a: 0-3, b: 4-7, c: 8-11, d: 12-15) of each head += its four tokens' products */
#define PQC__PZ(q, a0, a1, a2, a3)                                                                                     \
    do {                                                                                                               \
        z0##q = _mm_add_ps(z0##q, a0);                                                                                 \
        z1##q = _mm_add_ps(z1##q, a1);                                                                                 \
        z2##q = _mm_add_ps(z2##q, a2);                                                                                 \
        z3##q = _mm_add_ps(z3##q, a3);                                                                                 \
    } while (0)
/* head h's 16 lanes into lanes[h] */
#define PQC__PLANES(h)                                                                                                 \
    do {                                                                                                               \
        _mm_storeu_ps(lanes[h], z##h##a);                                                                              \
        _mm_storeu_ps(lanes[h] + 4, z##h##b);                                                                          \
        _mm_storeu_ps(lanes[h] + 8, z##h##c);                                                                          \
        _mm_storeu_ps(lanes[h] + 12, z##h##d);                                                                         \
    } while (0)
static PQC__INLINE_ALWAYS void pqc__products_g4_sse(const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n,
                                                    float *out, size_t ostride, float *z)
{
    size_t t, nv = n & ~(size_t)7, tab = (size_t)ksub * 4, ch, c0;
    int j, m = cd->m, h;
    __m128 z0a = _mm_setzero_ps(), z0b = z0a, z0c = z0a, z0d = z0a, z1a = z0a, z1b = z0a, z1c = z0a, z1d = z0a;
    __m128 z2a = z0a, z2b = z0a, z2c = z0a, z2d = z0a, z3a = z0a, z3b = z0a, z3c = z0a, z3d = z0a;
    const __m128i zero = _mm_setzero_si128();
    float lanes[4][16], mx[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* (the tail's maxima, unused) */
    uint16_t off[PQC__POFF];
    if (m > PQC__POFF / 16) {
        pqc__scan_products_scalar(cd, el, ksub, t0, n, out, ostride, z);
        return;
    }
    ch = (size_t)(PQC__POFF / m) & ~(size_t)15; /* a chunk's tokens: 16 or more */
    for (c0 = 0; c0 < nv; c0 += ch) {
        size_t ce = c0 + ch < nv ? c0 + ch : nv, len = ce - c0, q; /* len: a multiple of 8 */
        for (j = 0; j < m; j++) {
            const unsigned char *src = cd->data + (size_t)j * cd->col_stride + t0 + c0;
            uint16_t *dst = off + (size_t)j * ch;
            for (q = 0; q + 16 <= len; q += 16) {
                __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(src + q));
                _mm_storeu_si128((__m128i *)(void *)(dst + q), _mm_slli_epi16(_mm_unpacklo_epi8(v, zero), 2));
                _mm_storeu_si128((__m128i *)(void *)(dst + q + 8), _mm_slli_epi16(_mm_unpackhi_epi8(v, zero), 2));
            }
            if (q < len) { /* the last 8 */
                __m128i v = _mm_loadl_epi64((const __m128i *)(const void *)(src + q));
                _mm_storeu_si128((__m128i *)(void *)(dst + q), _mm_slli_epi16(_mm_unpacklo_epi8(v, zero), 2));
            }
        }
        for (t = c0; t < ce; t += 8) {
            __m128 a0, a1, a2, a3, b0, b1, b2, b3;
            const uint16_t *o = off + (t - c0);
            const float *l = el;
            PQC__PLD(a0, 0);
            PQC__PLD(a1, 1);
            PQC__PLD(a2, 2);
            PQC__PLD(a3, 3);
            PQC__PLD(b0, 4);
            PQC__PLD(b1, 5);
            PQC__PLD(b2, 6);
            PQC__PLD(b3, 7);
            for (j = 1; j < m; j++) {
                o += ch;
                l += tab;
                PQC__PMUL(a0, 0);
                PQC__PMUL(a1, 1);
                PQC__PMUL(a2, 2);
                PQC__PMUL(a3, 3);
                PQC__PMUL(b0, 4);
                PQC__PMUL(b1, 5);
                PQC__PMUL(b2, 6);
                PQC__PMUL(b3, 7);
            }
            _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
            _MM_TRANSPOSE4_PS(b0, b1, b2, b3);
            _mm_storeu_ps(out + t, a0);
            _mm_storeu_ps(out + t + 4, b0);
            _mm_storeu_ps(out + ostride + t, a1);
            _mm_storeu_ps(out + ostride + t + 4, b1);
            _mm_storeu_ps(out + 2 * ostride + t, a2);
            _mm_storeu_ps(out + 2 * ostride + t + 4, b2);
            _mm_storeu_ps(out + 3 * ostride + t, a3);
            _mm_storeu_ps(out + 3 * ostride + t + 4, b3);
            if (t & 8) {
                PQC__PZ(c, a0, a1, a2, a3);
                PQC__PZ(d, b0, b1, b2, b3);
            } else {
                PQC__PZ(a, a0, a1, a2, a3);
                PQC__PZ(b, b0, b1, b2, b3);
            }
        }
    }
    PQC__PLANES(0);
    PQC__PLANES(1);
    PQC__PLANES(2);
    PQC__PLANES(3);
    if (nv < n) pqc__scan_heads_part(cd, el, ksub, 4, 1, 0, 4, t0, nv, n, out, ostride, mx);
    for (h = 0; h < 4; h++) z[h] = pqc__lanes_end(lanes[h], out + (size_t)h * ostride, nv, n);
}
#undef PQC__POFF
#undef PQC__PLD
#undef PQC__PMUL
#undef PQC__PZ
#undef PQC__PLANES

PQC__AVX2 static void pqc__scan_heads_avx2(const pqc_codes *cd, const float *lut, int ksub, int g, size_t t0, size_t n,
                                           float *out, size_t ostride, float *mx)
{
    if (cd->bits != 8) pqc__scan_heads_scalar(cd, lut, ksub, g, t0, n, out, ostride, mx);
    else if (g == 4) pqc__scan_g4_avx2(cd, lut, ksub, t0, n, out, ostride, mx);
    else pqc__scan_heads4_avx2(cd, lut, ksub, (size_t)g, t0, n, out, ostride, mx);
}

/* four heads, 8-bit codes: the fused kernel */
PQC__AVX2 static void pqc__scan_products_avx2(const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n,
                                              float *out, size_t ostride, float *z)
{
    pqc__products_g4_sse(cd, el, ksub, t0, n, out, ostride, z);
}

PQC__AVX2 static void pqc__combine_avx2(const float *e, size_t estride, int g, size_t n, const float *w, float *out)
{
    size_t t = 0;
    int h;
    for (; t + 8 <= n; t += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (h = 0; h < g; h++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(e + (size_t)h * estride + t), _mm256_set1_ps(w[h]), acc);
        _mm256_storeu_ps(out + t, acc);
    }
    if (t < n) pqc__combine_scalar(e + t, estride, g, n - t, w, out + t);
}

PQC__AVX2 static void pqc__halfrow_avx2(const void *src, pqc_dtype t, size_t n, float *dst)
{
    const unsigned char *p = (const unsigned char *)src;
    size_t i = 0;
    if (t == PQC_F16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
    else
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_si256((__m256i *)(dst + i),
                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i))), 16));
    if (i < n) pqc__halfrow_scalar(p + 2 * i, t, n - i, dst + i);
}

/* 8 stored values from element e of row r (t: fp32, fp16 or bf16) as fp32 */
PQC__AVX2 static inline __m256 pqc__load8_avx2(const unsigned char *r, pqc_dtype t, size_t e)
{
    if (t == PQC_F32) return _mm256_loadu_ps((const float *)(const void *)r + e);
    if (t == PQC_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 2 * e)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + 2 * e))), 16));
}

PQC__AVX2 static void pqc__rowpair_avx2(const void *k, const void *v, pqc_dtype t, size_t d, float *ko, float *vo, int stream)
{
    const unsigned char *a = (const unsigned char *)k, *b = (const unsigned char *)v;
    size_t e;
    if (stream && d % 8 == 0 && !(((uintptr_t)ko | (uintptr_t)vo) & 63)) {
        for (e = 0; e < d; e += 8) {
            _mm256_stream_ps(ko + e, pqc__load8_avx2(a, t, e));
            _mm256_stream_ps(vo + e, pqc__load8_avx2(b, t, e));
        }
    } else {
        pqc__rowpair_by(pqc__halfrow_avx2, k, v, t, d, ko, vo);
    }
}

/* Eight values a step: fp16 by F16C's conversion (round to nearest even, as the scalar
   one), bf16 by the scalar one's integer rounding; eight values holding a NaN (whose
   payload the two conversions may quieten differently) go through the scalar one. */
PQC__AVX2 static void pqc__narrow_avx2(const float *src, pqc_dtype t, size_t n, void *dst)
{
    unsigned char *p = (unsigned char *)dst;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
            pqc__narrow_scalar(src + i, t, 8, p + 2 * i);
        } else if (t == PQC_F16) {
            _mm_storeu_si128((__m128i *)(p + 2 * i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else { /* (u + 0x7fff + (u >> 16 & 1)) >> 16, then the eight halves packed in order */
            __m256i u = _mm256_castps_si256(v), r;
            r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
            r = _mm256_srli_epi32(r, 16);
            r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)(p + 2 * i), _mm256_castsi256_si128(r));
        }
    }
    if (i < n) pqc__narrow_scalar(src + i, t, n - i, p + 2 * i);
}

/* pqc__within, eight values a step (a NaN fails the comparison, as there) */
PQC__AVX2 static int pqc__within_avx2(const float *x, size_t n, float limit)
{
    const __m256 lim = _mm256_set1_ps(limit), mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    size_t i = 0;
    int r;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), mag), lim, _CMP_LE_OQ);
        __m256 b = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 8), mag), lim, _CMP_LE_OQ);
        __m256 c = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 16), mag), lim, _CMP_LE_OQ);
        __m256 d = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 24), mag), lim, _CMP_LE_OQ);
        ok = _mm256_and_ps(ok, _mm256_and_ps(_mm256_and_ps(a, b), _mm256_and_ps(c, d)));
    }
    r = _mm256_movemask_ps(ok) == 0xff;
    for (; i < n; i++) r &= fabsf(x[i]) <= limit;
    return r;
}

/* acc + v0 + v1 + v2 + v3, added in that order */
PQC__AVX2 static inline float pqc__lanesum4_avx2(float acc, __m128 v)
{
    acc += _mm_cvtss_f32(v);
    acc += _mm_cvtss_f32(_mm_movehdup_ps(v));
    acc += _mm_cvtss_f32(_mm_movehl_ps(v, v));
    return acc + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 3));
}

/* acc[r] + a_r[0] + a_r[1] + ... + a_r[7] for the four rows r, each row's values added in
   that order (lane order), the four rows side by side: a 4 x 4 transpose within each
   128-bit half, then eight vector adds */
PQC__AVX2 static inline __m128 pqc__lanesum8x4_avx2(__m128 acc, __m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
    __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
    __m256 c0 = _mm256_shuffle_ps(t0, t2, 0x44), c1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 c2 = _mm256_shuffle_ps(t1, t3, 0x44), c3 = _mm256_shuffle_ps(t1, t3, 0xee);
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c0));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c1));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c2));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c3));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c0, 1));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c1, 1));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c2, 1));
    return _mm_add_ps(acc, _mm256_extractf128_ps(c3, 1));
}

PQC__AVX2 static void pqc__rowdots_avx2(const float *q, const float *rows, size_t n, size_t stride, int d, float *out)
{
    size_t i = 0;
    int e, l;
    if (d % 16 == 0) /* four rows side by side: eight chains, the lane sums in one register */
        for (; i + 4 <= n; i += 4) {
            const float *r0 = rows + i * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
            __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
            float s4[4];
            for (e = 0; e < d; e += 16) {
                const __m256 qa = _mm256_loadu_ps(q + e), qb = _mm256_loadu_ps(q + e + 8);
                lo0 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(r0 + e), lo0);
                hi0 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(r0 + e + 8), hi0);
                lo1 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(r1 + e), lo1);
                hi1 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(r1 + e + 8), hi1);
                lo2 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(r2 + e), lo2);
                hi2 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(r2 + e + 8), hi2);
                lo3 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(r3 + e), lo3);
                hi3 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(r3 + e + 8), hi3);
            }
            _mm_storeu_ps(s4, pqc__lanesum8x4_avx2(pqc__lanesum8x4_avx2(_mm_setzero_ps(), lo0, lo1, lo2, lo3), hi0, hi1,
                                                   hi2, hi3));
            memcpy(out + i, s4, sizeof s4);
        }
    for (; i < n; i++) {
        const float *r = rows + i * stride;
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        float lanes[16], acc = 0.0f;
        for (e = 0; e + 16 <= d; e += 16) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(r + e), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), _mm256_loadu_ps(r + e + 8), hi);
        }
        if (e < d) {
            _mm256_storeu_ps(lanes, lo);
            _mm256_storeu_ps(lanes + 8, hi);
            for (; e < d; e++) lanes[e & 15] = fmaf(q[e], r[e], lanes[e & 15]);
            for (l = 0; l < 16; l++) acc += lanes[l];
        } else { /* the same additions, lane by lane out of the registers */
            __m128 v = _mm256_castps256_ps128(lo);
            acc = pqc__lanesum4_avx2(acc, v);
            acc = pqc__lanesum4_avx2(acc, _mm256_extractf128_ps(lo, 1));
            acc = pqc__lanesum4_avx2(acc, _mm256_castps256_ps128(hi));
            acc = pqc__lanesum4_avx2(acc, _mm256_extractf128_ps(hi, 1));
        }
        out[i] = acc;
    }
}


/* The largest 15-bit magnitude pattern of an fp16 or bf16 value whose value is at most
   limit (magnitude grows with the pattern up to infinity; NaN patterns lie above it and
   never compare): |x| <= limit exactly when (bits & 0x7fff) <= this. */
static unsigned pqc__half_limit_bits(pqc_dtype t, float limit)
{
    unsigned lo = 0, hi = 0x7fffu;
    if (!(0.0f <= limit)) return 0xffffu; /* nothing passes: no pattern is at most that */
    while (lo < hi) { /* the last pattern whose value passes */
        unsigned mid = lo + (hi - lo + 1) / 2;
        float v = t == PQC_F16 ? pqc_f16_to_f32((uint16_t)mid) : pqc_bf16_to_f32((uint16_t)mid);
        if (v <= limit) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The magnitude pattern of the limit doubled (the sign shifted out), which the patterns
   of the values that pass it, doubled, do not exceed; PQC__NO_LIM2 when there is none (a
   negative or NaN limit, a half limit below every pattern): the x86 row checks then go
   through the copy. */
#define PQC__NO_LIM2 0xffffffffu
static uint32_t pqc__row_lim2(pqc_dtype t, float limit)
{
    uint32_t b;
    if (!(limit >= 0.0f)) return PQC__NO_LIM2;
    if (t == PQC_F32) {
        memcpy(&b, &limit, sizeof b);
        return b << 1;
    }
    b = pqc__half_limit_bits(t, limit);
    return b > 0x7fffu ? PQC__NO_LIM2 : b << 1;
}

/* pqc__keydots in one pass: each row converted in registers and multiplied with the
   lanes of pqc__rowdots_avx2 (lane e % 16 gets q[e] * r[e] fused in e order, then the 16
   lanes are added in order from 0), no fp32 copy of the rows. The range check runs on
   the raw patterns (the largest magnitude pattern of four rows against the limit's,
   pqc__half_limit_bits; the row that fails is then looked for). Four rows side by side:
   eight independent chains of fused adds, and the four rows' lane sums in one register.
   Widths that are not a multiple of 16 go through the copy. */
#define PQC__HALFDOTS4_AVX2(CONV)                                                                                      \
    for (; i + 4 <= n; i += 4) {                                                                                       \
        const unsigned char *r0 = rows + i * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;         \
        __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0; \
        __m128i top = _mm_setzero_si128();                                                                             \
        __m128 acc;                                                                                                    \
        float s4[4];                                                                                                   \
        for (o = 0; o < 4 * stride; o += 64) _mm_prefetch((const char *)r0 + 16 * stride + o, _MM_HINT_T0);           \
        for (e = 0; e < d; e += 16) {                                                                                  \
            const __m256 qa = _mm256_loadu_ps(q + e), qb = _mm256_loadu_ps(q + e + 8);                                 \
            PQC__HALFSTEP(r0, lo0, hi0, CONV);                                                                          \
            PQC__HALFSTEP(r1, lo1, hi1, CONV);                                                                          \
            PQC__HALFSTEP(r2, lo2, hi2, CONV);                                                                          \
            PQC__HALFSTEP(r3, lo3, hi3, CONV);                                                                          \
        }                                                                                                              \
        acc = pqc__lanesum8x4_avx2(_mm_setzero_ps(), lo0, lo1, lo2, lo3);                                              \
        _mm_storeu_ps(s4, pqc__lanesum8x4_avx2(acc, hi0, hi1, hi2, hi3));                                              \
        memcpy(out + i, s4, sizeof s4);                                                                                \
        if (bad == n && !_mm_test_all_ones(_mm_cmpeq_epi16(_mm_max_epu16(top, lim2), lim2))) {                         \
            size_t b_ = pqc__keydots_copy(&lv, q, r0, stride, t, 4, d, limit, row, NULL); /* which (rare) */  \
            if (b_ < 4) bad = i + b_;                                                                                  \
        }                                                                                                              \
    }
#define PQC__HALFSTEP(r, lo, hi, CONV)                                                                                 \
    do {                                                                                                               \
        __m128i ha_ = _mm_loadu_si128((const __m128i *)((r) + 2 * (size_t)e));                                        \
        __m128i hb_ = _mm_loadu_si128((const __m128i *)((r) + 2 * (size_t)e + 16));                                   \
        top = _mm_max_epu16(top, _mm_max_epu16(_mm_slli_epi16(ha_, 1), _mm_slli_epi16(hb_, 1)));                       \
        lo = _mm256_fmadd_ps(qa, CONV(ha_), lo);                                                                        \
        hi = _mm256_fmadd_ps(qb, CONV(hb_), hi);                                                                        \
    } while (0)
#define PQC__CONV_F16(h) _mm256_cvtph_ps(h)
#define PQC__CONV_BF16(h) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
PQC__AVX2 static size_t pqc__keydots_avx2(const float *q, const unsigned char *rows, size_t stride, pqc_dtype t,
                                           size_t n, int d, float limit, float *row, float *out)
{
    static const pqc__keydots_level lv = {pqc__halfrow_avx2, pqc__within_avx2, pqc__rowdots_avx2};
    size_t i = 0, bad = n, o;
    const uint32_t l2 = pqc__row_lim2(t, limit);
    const __m128i lim2 = _mm_set1_epi16((short)l2); /* halves: at most l2 passes */
    int e;
    if (d % 16 || l2 == PQC__NO_LIM2) return pqc__keydots_copy(&lv, q, rows, stride, t, n, d, limit, row, out);
    if (t == PQC_F32) { /* the patterns of fp32 values: |x| <= limit exactly when bits(|x|) <= bits(limit) */
        const __m256i lim32 = _mm256_set1_epi32((int)l2);
        for (; i + 4 <= n; i += 4) {
            const float *r0 = (const float *)(const void *)(rows + i * stride), *r1, *r2, *r3;
            __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
            __m256i top = _mm256_setzero_si256();
            float s4[4];
            r1 = (const float *)(const void *)(rows + (i + 1) * stride);
            r2 = (const float *)(const void *)(rows + (i + 2) * stride);
            r3 = (const float *)(const void *)(rows + (i + 3) * stride);
            for (o = 0; o < 4 * stride; o += 64) _mm_prefetch((const char *)r0 + 8 * stride + o, _MM_HINT_T0);
            for (e = 0; e < d; e += 16) {
                const __m256 qa = _mm256_loadu_ps(q + e), qb = _mm256_loadu_ps(q + e + 8);
#define PQC__F32STEP(r, lo, hi)                                                                                        \
    do {                                                                                                               \
        __m256 a_ = _mm256_loadu_ps((r) + e), b_ = _mm256_loadu_ps((r) + e + 8);                                       \
        top = _mm256_max_epu32(top, _mm256_max_epu32(_mm256_slli_epi32(_mm256_castps_si256(a_), 1),                    \
                                                     _mm256_slli_epi32(_mm256_castps_si256(b_), 1)));                  \
        lo = _mm256_fmadd_ps(qa, a_, lo);                                                                              \
        hi = _mm256_fmadd_ps(qb, b_, hi);                                                                              \
    } while (0)
                PQC__F32STEP(r0, lo0, hi0);
                PQC__F32STEP(r1, lo1, hi1);
                PQC__F32STEP(r2, lo2, hi2);
                PQC__F32STEP(r3, lo3, hi3);
#undef PQC__F32STEP
            }
            _mm_storeu_ps(s4, pqc__lanesum8x4_avx2(pqc__lanesum8x4_avx2(_mm_setzero_ps(), lo0, lo1, lo2, lo3), hi0, hi1,
                                                   hi2, hi3));
            memcpy(out + i, s4, sizeof s4);
            if (bad == n && _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(top, lim32), lim32)) != -1) {
                size_t b = pqc__keydots_copy(&lv, q, rows + i * stride, stride, t, 4, d, limit, row, NULL);
                if (b < 4) bad = i + b; /* which of the four (rare) */
            }
        }
    } else if (t == PQC_F16) {
        PQC__HALFDOTS4_AVX2(PQC__CONV_F16)
    } else {
        PQC__HALFDOTS4_AVX2(PQC__CONV_BF16)
    }
    if (i < n) { /* the last rows through the copy: the same lanes */
        size_t b = pqc__keydots_copy(&lv, q, rows + i * stride, stride, t, n - i, d, limit, row, out + i);
        if (bad == n && b < n - i) bad = i + b;
    }
    return bad;
}

/* 1 when every value of a stored row of d values (d a multiple of 16) passes the limit
   whose magnitude pattern doubled is lim2 (pqc__row_lim2): |x| <= limit exactly when
   the pattern of |x| is at most the limit's, NaNs' patterns lying above every finite
   one */
PQC__AVX2 static int pqc__row_ok_avx2(const unsigned char *r, pqc_dtype t, int d, uint32_t lim2)
{
    int e;
    if (t == PQC_F32) {
        const __m256i l = _mm256_set1_epi32((int)lim2);
        __m256i top = _mm256_setzero_si256();
        for (e = 0; e < d; e += 8)
            top = _mm256_max_epu32(top, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(r + 4 * (size_t)e)), 1));
        return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(top, l), l)) == -1;
    } else {
        const __m256i l = _mm256_set1_epi16((short)lim2);
        __m256i top = _mm256_setzero_si256();
        for (e = 0; e < d; e += 16)
            top = _mm256_max_epu16(top, _mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)(r + 2 * (size_t)e)), 1));
        return _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_max_epu16(top, l), l)) == -1;
    }
}

/* Row i of pqc__gatherdots on the x86 levels (pqc__gather_at), with check its patterns
   checked (a row that fails them is checked again on its values, lv's way); NULL when it
   cannot be ranked. */
PQC__AVX2 static const unsigned char *pqc__gather_row_avx2(const pqc__keydots_level *lv, const unsigned char *base,
                                                           size_t stride, pqc_dtype t, const uint32_t *idx, size_t i,
                                                           size_t n, int d, int check, float limit, uint32_t lim2,
                                                           float *row)
{
    const unsigned char *r = pqc__gather_at(base, stride, (size_t)d * pqc_dtype_size(t), idx, i, n);
    if (check && !pqc__row_ok_avx2(r, t, d, lim2) &&
        pqc__gatherdots_copy(lv, NULL, 0, r, stride, t, NULL, 1, d, 1, limit, row, NULL, 0) == 0)
        return NULL;
    return r;
}

/* 16 stored values from element e of row r as two vectors of eight fp32 */
#define PQC__LOAD16_AVX2(r, t, e, xa, xb)                                                                              \
    do {                                                                                                               \
        if ((t) == PQC_F32) {                                                                                          \
            xa = _mm256_loadu_ps((const float *)(const void *)(r) + (e));                                              \
            xb = _mm256_loadu_ps((const float *)(const void *)(r) + (e) + 8);                                          \
        } else {                                                                                                       \
            __m128i ha_ = _mm_loadu_si128((const __m128i *)((r) + 2 * (size_t)(e)));                                  \
            __m128i hb_ = _mm_loadu_si128((const __m128i *)((r) + 2 * (size_t)(e) + 16));                             \
            xa = (t) == PQC_F16 ? PQC__CONV_F16(ha_) : PQC__CONV_BF16(ha_);                                            \
            xb = (t) == PQC_F16 ? PQC__CONV_F16(hb_) : PQC__CONV_BF16(hb_);                                            \
        }                                                                                                              \
    } while (0)

/* pqc__gatherdots a row at a time, converted in registers as pqc__keydots_avx2 converts
   it: four heads at once (eight chains: lane e % 16 of each head gets q[e] * r[e] fused
   in e order, as pqc__rowdots_avx2), their lane sums in one register; the heads past a
   multiple of four one at a time. The check runs on the row's patterns first.
   pqc__gatherrows_avx2 is inlined where it is called with t (and d_h 128) as constants, as
   pqc__gatherpairs_avx512 is (85-93 -> 50-56 ns a candidate, in a faster sitting). */
PQC__AVX2 static PQC__INLINE_ALWAYS size_t pqc__gatherrows_avx2(const pqc__keydots_level *lv, const float *q, int g,
                                             const unsigned char *base, size_t stride, pqc_dtype t,
                                             const uint32_t *idx, size_t n, int d, int check, float limit,
                                             uint32_t lim2, float *row, float *out, size_t ostride)
{
    const size_t rb = (size_t)d * pqc_dtype_size(t);
    size_t i;
    int e, h;
    for (i = 0; i < n; i++) {
        const unsigned char *r = check ? pqc__gather_row_avx2(lv, base, stride, t, idx, i, n, d, check, limit, lim2, row)
                                       : pqc__gather_at(base, stride, rb, idx, i, n);
        if (!r) return i;
        for (h = 0; h + 4 <= g; h += 4) {
            const float *q0 = q + (size_t)h * (size_t)d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
            __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
            float s4[4];
            for (e = 0; e < d; e += 16) {
                __m256 xa, xb;
                PQC__LOAD16_AVX2(r, t, e, xa, xb);
                lo0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + e), xa, lo0);
                hi0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + e + 8), xb, hi0);
                lo1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + e), xa, lo1);
                hi1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + e + 8), xb, hi1);
                lo2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + e), xa, lo2);
                hi2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + e + 8), xb, hi2);
                lo3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + e), xa, lo3);
                hi3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + e + 8), xb, hi3);
            }
            _mm_storeu_ps(s4, pqc__lanesum8x4_avx2(pqc__lanesum8x4_avx2(_mm_setzero_ps(), lo0, lo1, lo2, lo3), hi0, hi1,
                                                   hi2, hi3));
            out[(size_t)h * ostride + i] = s4[0];
            out[(size_t)(h + 1) * ostride + i] = s4[1];
            out[(size_t)(h + 2) * ostride + i] = s4[2];
            out[(size_t)(h + 3) * ostride + i] = s4[3];
        }
        for (; h < g; h++) {
            const float *qh = q + (size_t)h * (size_t)d;
            __m256 lo = _mm256_setzero_ps(), hi = lo;
            float acc = 0.0f;
            for (e = 0; e < d; e += 16) {
                __m256 xa, xb;
                PQC__LOAD16_AVX2(r, t, e, xa, xb);
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), xa, lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e + 8), xb, hi);
            }
            acc = pqc__lanesum4_avx2(acc, _mm256_castps256_ps128(lo));
            acc = pqc__lanesum4_avx2(acc, _mm256_extractf128_ps(lo, 1));
            acc = pqc__lanesum4_avx2(acc, _mm256_castps256_ps128(hi));
            out[(size_t)h * ostride + i] = pqc__lanesum4_avx2(acc, _mm256_extractf128_ps(hi, 1));
        }
    }
    return n;
}
PQC__AVX2 static size_t pqc__gatherdots_avx2(const float *q, int g, const unsigned char *base, size_t stride,
                                             pqc_dtype t, const uint32_t *idx, size_t n, int d, int check, float limit,
                                             float *row, float *out, size_t ostride)
{
    static const pqc__keydots_level lv = {pqc__halfrow_avx2, pqc__within_avx2, pqc__rowdots_avx2};
    const uint32_t lim2 = pqc__row_lim2(t, limit);
    if (d % 16 || (check && lim2 == PQC__NO_LIM2))
        return pqc__gatherdots_copy(&lv, q, g, base, stride, t, idx, n, d, check, limit, row, out, ostride);
    if (t == PQC_F16 && d == 128)
        return pqc__gatherrows_avx2(&lv, q, g, base, stride, PQC_F16, idx, n, 128, check, limit, lim2, row, out, ostride);
    if (t == PQC_F16)
        return pqc__gatherrows_avx2(&lv, q, g, base, stride, PQC_F16, idx, n, d, check, limit, lim2, row, out, ostride);
    if (t == PQC_BF16)
        return pqc__gatherrows_avx2(&lv, q, g, base, stride, PQC_BF16, idx, n, d, check, limit, lim2, row, out, ostride);
    return pqc__gatherrows_avx2(&lv, q, g, base, stride, PQC_F32, idx, n, d, check, limit, lim2, row, out, ostride);
}
#undef PQC__LOAD16_AVX2
#undef PQC__HALFDOTS4_AVX2
#undef PQC__HALFSTEP
#undef PQC__CONV_F16
#undef PQC__CONV_BF16

PQC__AVX2 static void pqc__accum_avx2(const float *x, size_t n, int d, const uint16_t *idx, double *sum)
{
    size_t i;
    int e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        double *sp = sum + (size_t)idx[i] * d;
        for (e = 0; e + 4 <= d; e += 4)
            _mm256_storeu_pd(sp + e, _mm256_add_pd(_mm256_loadu_pd(sp + e), _mm256_cvtps_pd(_mm_loadu_ps(xi + e))));
        for (; e < d; e++) sp[e] += xi[e];
    }
}

/* ----- AVX-512 ----- */
PQC__AVX512 static void pqc__dots_avx512(const float *x, int d, const float *ct, int kpad, int k, float *dots)
{
    int c = 0, e;
    for (; c + 64 <= k; c += 64) { /* four independent chains (one alone waited on its latency) */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *cp = ct + c;
        for (e = 0; e < d; e++, cp += kpad) {
            const __m512 s = _mm512_set1_ps(x[e]);
            a0 = _mm512_fmadd_ps(s, _mm512_loadu_ps(cp), a0);
            a1 = _mm512_fmadd_ps(s, _mm512_loadu_ps(cp + 16), a1);
            a2 = _mm512_fmadd_ps(s, _mm512_loadu_ps(cp + 32), a2);
            a3 = _mm512_fmadd_ps(s, _mm512_loadu_ps(cp + 48), a3);
        }
        _mm512_storeu_ps(dots + c, a0);
        _mm512_storeu_ps(dots + c + 16, a1);
        _mm512_storeu_ps(dots + c + 32, a2);
        _mm512_storeu_ps(dots + c + 48, a3);
    }
    for (; c < kpad && c < k; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (e = 0; e < d; e++) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[e]), _mm512_loadu_ps(ct + (size_t)e * kpad + c), acc);
        if (c + 16 <= k) _mm512_storeu_ps(dots + c, acc);
        else _mm512_mask_storeu_ps(dots + c, (__mmask16)((1u << (k - c)) - 1u), acc);
    }
}

/* pqc__dots_avx512 for four queries at once (rows x + h xs, outputs dots + h ds): each
   centroid row of ct read once for the four (it was read from L2 once a query), 64
   centroids x 4 queries a tile (16 independent chains), each lane one fma chain over the
   dims from 0 as the scalar reference. */
PQC__AVX512 static void pqc__dots4_avx512(const float *x, size_t xs, int d, const float *ct, int kpad, int k,
                                          float *dots, size_t ds)
{
    const float *x0 = x, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
    float *o0 = dots, *o1 = o0 + ds, *o2 = o1 + ds, *o3 = o2 + ds;
    int c = 0, e;
    for (; c + 64 <= k; c += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        __m512 e0 = a0, e1 = a0, e2 = a0, e3 = a0, f0 = a0, f1 = a0, f2 = a0, f3 = a0;
        const float *cp = ct + c;
        for (e = 0; e < d; e++, cp += kpad) {
            const __m512 v0 = _mm512_loadu_ps(cp), v1 = _mm512_loadu_ps(cp + 16), v2 = _mm512_loadu_ps(cp + 32),
                         v3 = _mm512_loadu_ps(cp + 48);
            __m512 s_;
#define PQC__D4(Q, A)                                                                                                  \
    s_ = _mm512_set1_ps(x##Q[e]);                                                                                      \
    A##0 = _mm512_fmadd_ps(s_, v0, A##0);                                                                              \
    A##1 = _mm512_fmadd_ps(s_, v1, A##1);                                                                              \
    A##2 = _mm512_fmadd_ps(s_, v2, A##2);                                                                              \
    A##3 = _mm512_fmadd_ps(s_, v3, A##3)
            PQC__D4(0, a);
            PQC__D4(1, b);
            PQC__D4(2, e);
            PQC__D4(3, f);
#undef PQC__D4
        }
#define PQC__D4S(O, A)                                                                                                 \
    _mm512_storeu_ps(O + c, A##0);                                                                                     \
    _mm512_storeu_ps(O + c + 16, A##1);                                                                                \
    _mm512_storeu_ps(O + c + 32, A##2);                                                                                \
    _mm512_storeu_ps(O + c + 48, A##3)
        PQC__D4S(o0, a);
        PQC__D4S(o1, b);
        PQC__D4S(o2, e);
        PQC__D4S(o3, f);
#undef PQC__D4S
    }
    for (; c < kpad && c < k; c += 16) { /* 16 centroids, the last ones masked */
        const __mmask16 m = c + 16 <= k ? (__mmask16)0xffff : (__mmask16)((1u << (k - c)) - 1u);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *cp = ct + c;
        for (e = 0; e < d; e++, cp += kpad) {
            const __m512 v = _mm512_loadu_ps(cp);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[e]), v, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[e]), v, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[e]), v, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[e]), v, a3);
        }
        _mm512_mask_storeu_ps(o0 + c, m, a0);
        _mm512_mask_storeu_ps(o1 + c, m, a1);
        _mm512_mask_storeu_ps(o2 + c, m, a2);
        _mm512_mask_storeu_ps(o3 + c, m, a3);
    }
}

/* pqc__fkey of 16 scores */
PQC__AVX512 static inline __m512i pqc__fkey16_avx512(const float *s)
{
    __m512i u = _mm512_loadu_si512((const void *)s);
    u = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(_mm512_slli_epi32(u, 1), _mm512_slli_epi32(u, 1)), u);
    return _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32((int)0x80000000u)));
}

/* pqc__topk_keys_scalar (section 5), sixteen scores a step */
PQC__AVX512 static size_t pqc__topk_keys_avx512(const float *s, size_t n, uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    __m512i vlo = _mm512_set1_epi32((int)*lo), vhi = _mm512_set1_epi32((int)*hi);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i key = pqc__fkey16_avx512(s + i);
        _mm512_storeu_si512((void *)(keys + i), key);
        vlo = _mm512_min_epu32(vlo, key);
        vhi = _mm512_max_epu32(vhi, key);
    }
    *lo = (uint32_t)_mm512_reduce_min_epu32(vlo);
    *hi = (uint32_t)_mm512_reduce_max_epu32(vhi);
    return i;
}

/* pqc__topk_bin_scalar (section 5), sixteen keys a step: the chosen ones compressed and
   stored whole (at or before the step's own keys, already read) */
PQC__AVX512 static size_t pqc__topk_bin_avx512(uint32_t *cand, size_t n, uint32_t base, int shift, uint32_t b,
                                               size_t *nc)
{
    const __m512i vbase = _mm512_set1_epi32((int)base), vb = _mm512_set1_epi32((int)b);
    const __m128i sh = _mm_cvtsi32_si128(shift);
    size_t i = 0, c = *nc;
    for (; i + 16 <= n; i += 16) {
        const __m512i k = _mm512_loadu_si512((const void *)(cand + i));
        const __mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_srl_epi32(_mm512_sub_epi32(k, vbase), sh), vb);
        _mm512_storeu_si512((void *)(cand + c), _mm512_maskz_compress_epi32(m, k));
        c += (size_t)__builtin_popcount(m);
    }
    *nc = c;
    return i;
}

/* The top-k's last pass (pqc__take_scalar, section 5), sixteen scores a step, compared as
   floats with thr's value (pqc__key_value: the same order and ties as the keys). No branch
   on whether a step takes any: about one step in five takes none at k = n/10, and the
   mispredictions made the pass twice as slow (128K scores: 52 -> 28 us). The chosen lanes
   compressed in a register (a compressing store to memory was a little faster here, but
   is slow on some other cores), stored whole while 16 more entries fit, then under a mask
   of their count; the ties compared only while some are still to take (a mask of the
   count and a broadcast of the index in every step: 128K scores, 21 -> 16-18 us). */
PQC__AVX512 static size_t pqc__take_avx512(const float *s, size_t n, uint32_t thr, size_t *need, uint32_t *idx,
                                           float *outs, size_t cap, size_t *taken)
{
    const __m512 t = _mm512_set1_ps(pqc__key_value(thr));
    const __m512i step = _mm512_set1_epi32(16);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    size_t i = 0, got = *taken, left = *need;
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
        const __m512 v = _mm512_loadu_ps(s + i);
        unsigned m = (unsigned)_mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);
        int cnt;
        if (left > 0) { /* the ties still to take (none once they are all taken) */
            unsigned eq = (unsigned)_mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
            for (; eq && left > 0; left--, eq &= eq - 1) m |= eq & (0u - eq);
        }
        cnt = __builtin_popcount(m);
        if (got + 16 <= cap) { /* whole vectors while they fit; the lanes past the chosen
                                  ones are written again by what follows */
            _mm512_storeu_si512((void *)(idx + got), _mm512_maskz_compress_epi32((__mmask16)m, at));
            if (outs) _mm512_storeu_ps(outs + got, _mm512_maskz_compress_ps((__mmask16)m, v));
        } else {
            const __mmask16 c = (__mmask16)((1u << cnt) - 1u);
            _mm512_mask_storeu_epi32(idx + got, c, _mm512_maskz_compress_epi32((__mmask16)m, at));
            if (outs) _mm512_mask_storeu_ps(outs + got, c, _mm512_maskz_compress_ps((__mmask16)m, v));
        }
        got += (size_t)cnt;
    }
    *taken = got;
    *need = left;
    return i;
}

/* lowest value, then lowest index, across the 16 lanes */
PQC__AVX512 static inline void pqc__argmin16(__m512 best, __m512i bidx, uint16_t *idx, float *val)
{
    float m = _mm512_reduce_min_ps(best);
    __mmask16 eq = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    *idx = (uint16_t)_mm512_mask_reduce_min_epi32(eq, bidx);
    if (val) *val = m;
}

/* 8 points x 32 centroids per register tile (16 accumulators: twice the fused adds in
   flight that the units' latency needs, and 10 loads per 16 of them), then 4 points x 32
   or x 16, then one point at a time; the dot for one (point, centroid) pair is still one
   fma chain over the dims, and each point's lanes see their centroids in ascending order. */
PQC__AVX512 static void pqc__assign_avx512(const float *x, size_t n, int d, const float *ct, const float *cn, int kpad,
                                           int k, uint16_t *idx, float *val)
{
    size_t i = 0;
    int c, e, p;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    (void)k;
/* a point's running best over one accumulator's 16 centroids (lanes in ascending order) */
#define PQC__UPD(A, B, I, CN, CI)                                                                                      \
    do {                                                                                                               \
        __m512 v_ = _mm512_sub_ps(CN, _mm512_add_ps(A, A));                                                            \
        __mmask16 m_ = _mm512_cmp_ps_mask(v_, B, _CMP_LT_OQ);                                                          \
        B = _mm512_mask_mov_ps(B, m_, v_);                                                                             \
        I = _mm512_mask_mov_epi32(I, m_, CI);                                                                          \
    } while (0)
    for (; i + 8 <= n && kpad % 32 == 0; i += 8) {
        const float *x0 = x + i * (size_t)d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d, *x4 = x3 + d, *x5 = x4 + d,
                    *x6 = x5 + d, *x7 = x6 + d;
        __m512 bst[8];
        __m512i bix[8];
        for (p = 0; p < 8; p++) {
            bst[p] = _mm512_set1_ps(INFINITY);
            bix[p] = _mm512_setzero_si512();
        }
        for (c = 0; c < kpad; c += 32) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
            const __m512 cn0 = _mm512_loadu_ps(cn + c), cn1 = _mm512_loadu_ps(cn + c + 16);
            const __m512i ci0 = _mm512_add_epi32(lane, _mm512_set1_epi32(c)), ci1 = _mm512_add_epi32(ci0, _mm512_set1_epi32(16));
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                const __m512 v0 = _mm512_loadu_ps(cp), v1 = _mm512_loadu_ps(cp + 16);
                __m512 s_;
#define PQC__FMA8(P)                                                                                                   \
    s_ = _mm512_set1_ps(x##P[e]);                                                                                      \
    a##P = _mm512_fmadd_ps(s_, v0, a##P);                                                                              \
    b##P = _mm512_fmadd_ps(s_, v1, b##P)
                PQC__FMA8(0);
                PQC__FMA8(1);
                PQC__FMA8(2);
                PQC__FMA8(3);
                PQC__FMA8(4);
                PQC__FMA8(5);
                PQC__FMA8(6);
                PQC__FMA8(7);
#undef PQC__FMA8
            }
#define PQC__UPD8(P)                                                                                                   \
    PQC__UPD(a##P, bst[P], bix[P], cn0, ci0);                                                                          \
    PQC__UPD(b##P, bst[P], bix[P], cn1, ci1)
            PQC__UPD8(0);
            PQC__UPD8(1);
            PQC__UPD8(2);
            PQC__UPD8(3);
            PQC__UPD8(4);
            PQC__UPD8(5);
            PQC__UPD8(6);
            PQC__UPD8(7);
#undef PQC__UPD8
        }
        for (p = 0; p < 8; p++) pqc__argmin16(bst[p], bix[p], idx + i + p, val ? val + i + p : NULL);
    }
    for (; i + 8 <= n && kpad % 32 == 16; i += 8) { /* 8 points x 16 centroids (k-means++ rounds, b = 4) */
        const float *x0 = x + i * (size_t)d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d, *x4 = x3 + d, *x5 = x4 + d,
                    *x6 = x5 + d, *x7 = x6 + d;
        __m512 bst[8];
        __m512i bix[8];
        for (p = 0; p < 8; p++) {
            bst[p] = _mm512_set1_ps(INFINITY);
            bix[p] = _mm512_setzero_si512();
        }
        for (c = 0; c < kpad; c += 16) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            const __m512 cn0 = _mm512_loadu_ps(cn + c);
            const __m512i ci0 = _mm512_add_epi32(lane, _mm512_set1_epi32(c));
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                const __m512 v0 = _mm512_loadu_ps(cp);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[e]), v0, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[e]), v0, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[e]), v0, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[e]), v0, a3);
                a4 = _mm512_fmadd_ps(_mm512_set1_ps(x4[e]), v0, a4);
                a5 = _mm512_fmadd_ps(_mm512_set1_ps(x5[e]), v0, a5);
                a6 = _mm512_fmadd_ps(_mm512_set1_ps(x6[e]), v0, a6);
                a7 = _mm512_fmadd_ps(_mm512_set1_ps(x7[e]), v0, a7);
            }
            PQC__UPD(a0, bst[0], bix[0], cn0, ci0);
            PQC__UPD(a1, bst[1], bix[1], cn0, ci0);
            PQC__UPD(a2, bst[2], bix[2], cn0, ci0);
            PQC__UPD(a3, bst[3], bix[3], cn0, ci0);
            PQC__UPD(a4, bst[4], bix[4], cn0, ci0);
            PQC__UPD(a5, bst[5], bix[5], cn0, ci0);
            PQC__UPD(a6, bst[6], bix[6], cn0, ci0);
            PQC__UPD(a7, bst[7], bix[7], cn0, ci0);
        }
        if (kpad == 16) { /* one block: a lane's index is its centroid's (a lane left at +inf: index 0) */
            for (p = 0; p < 8; p++) {
                float m = _mm512_reduce_min_ps(bst[p]);
                idx[i + p] = (uint16_t)__builtin_ctz((unsigned)_mm512_cmp_ps_mask(bst[p], _mm512_set1_ps(m), _CMP_EQ_OQ));
                if (val) val[i + p] = m;
            }
        } else {
            for (p = 0; p < 8; p++) pqc__argmin16(bst[p], bix[p], idx + i + p, val ? val + i + p : NULL);
        }
    }
    for (; i + 4 <= n; i += 4) {
        const float *x0 = x + i * (size_t)d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
        __m512 b0 = _mm512_set1_ps(INFINITY), b1 = b0, b2 = b0, b3 = b0;
        __m512i i0 = _mm512_setzero_si512(), i1 = i0, i2 = i0, i3 = i0;
        for (c = 0; c + 32 <= kpad; c += 32) { /* 4 points x 32 centroids: 8 accumulators */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e0 = a0, e1 = a0, e2 = a0, e3 = a0;
            __m512 cn0 = _mm512_loadu_ps(cn + c), cn1 = _mm512_loadu_ps(cn + c + 16);
            __m512i ci0 = _mm512_add_epi32(lane, _mm512_set1_epi32(c)), ci1 = _mm512_add_epi32(ci0, _mm512_set1_epi32(16));
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                __m512 v0 = _mm512_loadu_ps(cp), v1 = _mm512_loadu_ps(cp + 16);
                __m512 s0 = _mm512_set1_ps(x0[e]), s1 = _mm512_set1_ps(x1[e]), s2 = _mm512_set1_ps(x2[e]),
                       s3 = _mm512_set1_ps(x3[e]);
                a0 = _mm512_fmadd_ps(s0, v0, a0);
                a1 = _mm512_fmadd_ps(s1, v0, a1);
                a2 = _mm512_fmadd_ps(s2, v0, a2);
                a3 = _mm512_fmadd_ps(s3, v0, a3);
                e0 = _mm512_fmadd_ps(s0, v1, e0);
                e1 = _mm512_fmadd_ps(s1, v1, e1);
                e2 = _mm512_fmadd_ps(s2, v1, e2);
                e3 = _mm512_fmadd_ps(s3, v1, e3);
            }
            PQC__UPD(a0, b0, i0, cn0, ci0);
            PQC__UPD(a1, b1, i1, cn0, ci0);
            PQC__UPD(a2, b2, i2, cn0, ci0);
            PQC__UPD(a3, b3, i3, cn0, ci0);
            PQC__UPD(e0, b0, i0, cn1, ci1);
            PQC__UPD(e1, b1, i1, cn1, ci1);
            PQC__UPD(e2, b2, i2, cn1, ci1);
            PQC__UPD(e3, b3, i3, cn1, ci1);
        }
        for (; c < kpad; c += 16) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, vc, cnv;
            __m512i ci = _mm512_add_epi32(lane, _mm512_set1_epi32(c));
            for (e = 0; e < d; e++) {
                vc = _mm512_loadu_ps(ct + (size_t)e * kpad + c);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[e]), vc, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[e]), vc, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[e]), vc, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[e]), vc, a3);
            }
            cnv = _mm512_loadu_ps(cn + c);
            PQC__UPD(a0, b0, i0, cnv, ci);
            PQC__UPD(a1, b1, i1, cnv, ci);
            PQC__UPD(a2, b2, i2, cnv, ci);
            PQC__UPD(a3, b3, i3, cnv, ci);
        }
#undef PQC__UPD
        pqc__argmin16(b0, i0, idx + i, val ? val + i : NULL);
        pqc__argmin16(b1, i1, idx + i + 1, val ? val + i + 1 : NULL);
        pqc__argmin16(b2, i2, idx + i + 2, val ? val + i + 2 : NULL);
        pqc__argmin16(b3, i3, idx + i + 3, val ? val + i + 3 : NULL);
    }
    for (; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        __m512 best = _mm512_set1_ps(INFINITY);
        __m512i bidx = _mm512_setzero_si512();
        for (c = 0; c < kpad; c += 16) {
            __m512 acc = _mm512_setzero_ps(), v;
            __mmask16 lt;
            for (e = 0; e < d; e++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xi[e]), _mm512_loadu_ps(ct + (size_t)e * kpad + c), acc);
            v = _mm512_sub_ps(_mm512_loadu_ps(cn + c), _mm512_add_ps(acc, acc));
            lt = _mm512_cmp_ps_mask(v, best, _CMP_LT_OQ);
            best = _mm512_mask_mov_ps(best, lt, v);
            bidx = _mm512_mask_mov_epi32(bidx, lt, _mm512_add_epi32(lane, _mm512_set1_epi32(c)));
        }
        pqc__argmin16(best, bidx, idx + i, val ? val + i : NULL);
    }
}

/* Points in lanes: four blocks (64 points) x 4 centres per register tile (16
   accumulators, 8 loads per 16 fused adds), then single centres; each lane's dot is the
   scalar chain over the dims, and the minimum over the centres is `v < best` lane by
   lane (no reduction across lanes, no indices). Points past the last four blocks: the
   scalar reference. */
PQC__AVX512 static void pqc__seedmin_avx512(const float *x, const float *xt, size_t n, int d, const float *cs,
                                            const float *cg, const float *cn, int nb, const float *xn, float *dist)
{
    size_t i = 0, sd = (size_t)d, bs = sd * PQC__SEED_BLOCK;
    const __m512 zero = _mm512_setzero_ps();
    int c, e;
    for (; i + 4 * PQC__SEED_BLOCK <= n; i += 4 * PQC__SEED_BLOCK) {
        const float *p = xt + i * sd;
        __m512 best0 = _mm512_set1_ps(INFINITY), best1 = best0, best2 = best0, best3 = best0, v;
        for (c = 0; c + 4 <= nb; c += 4) {
            const float *cc = cg + (size_t)c * sd;
            __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, b0 = zero, b1 = zero, b2 = zero, b3 = zero;
            __m512 e0 = zero, e1 = zero, e2 = zero, e3 = zero, f0 = zero, f1 = zero, f2 = zero, f3 = zero;
            for (e = 0; e < d; e++, cc += 4) {
                const float *pe = p + (size_t)e * PQC__SEED_BLOCK;
                const __m512 v0 = _mm512_loadu_ps(pe), v1 = _mm512_loadu_ps(pe + bs), v2 = _mm512_loadu_ps(pe + 2 * bs),
                             v3 = _mm512_loadu_ps(pe + 3 * bs);
                __m512 s_;
#define PQC__SFMA(Q)                                                                                                   \
    s_ = _mm512_set1_ps(cc[Q]);                                                                                        \
    a##Q = _mm512_fmadd_ps(v0, s_, a##Q);                                                                              \
    b##Q = _mm512_fmadd_ps(v1, s_, b##Q);                                                                              \
    e##Q = _mm512_fmadd_ps(v2, s_, e##Q);                                                                              \
    f##Q = _mm512_fmadd_ps(v3, s_, f##Q)
                PQC__SFMA(0);
                PQC__SFMA(1);
                PQC__SFMA(2);
                PQC__SFMA(3);
#undef PQC__SFMA
            }
#define PQC__SMIN(Q)                                                                                                   \
    v = _mm512_set1_ps(cn[c + Q]);                                                                                     \
    best0 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(a##Q, a##Q)), best0);                                         \
    best1 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(b##Q, b##Q)), best1);                                         \
    best2 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(e##Q, e##Q)), best2);                                         \
    best3 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(f##Q, f##Q)), best3)
            PQC__SMIN(0);
            PQC__SMIN(1);
            PQC__SMIN(2);
            PQC__SMIN(3);
#undef PQC__SMIN
        }
        for (; c < nb; c++) {
            const float *cc = cs + (size_t)c * sd;
            __m512 a0 = zero, b0 = zero, e0 = zero, f0 = zero;
            for (e = 0; e < d; e++) {
                const float *pe = p + (size_t)e * PQC__SEED_BLOCK;
                const __m512 s_ = _mm512_set1_ps(cc[e]);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(pe), s_, a0);
                b0 = _mm512_fmadd_ps(_mm512_loadu_ps(pe + bs), s_, b0);
                e0 = _mm512_fmadd_ps(_mm512_loadu_ps(pe + 2 * bs), s_, e0);
                f0 = _mm512_fmadd_ps(_mm512_loadu_ps(pe + 3 * bs), s_, f0);
            }
            v = _mm512_set1_ps(cn[c]);
            best0 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(a0, a0)), best0);
            best1 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(b0, b0)), best1);
            best2 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(e0, e0)), best2);
            best3 = _mm512_min_ps(_mm512_sub_ps(v, _mm512_add_ps(f0, f0)), best3);
        }
        /* v = xn + best, raised to 0 below it; dist = v where v is lower */
#define PQC__SDIST(H)                                                                                                  \
    v = _mm512_add_ps(_mm512_loadu_ps(xn + i + H * PQC__SEED_BLOCK), best##H);                                         \
    v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), zero);                                          \
    _mm512_storeu_ps(dist + i + H * PQC__SEED_BLOCK, _mm512_min_ps(v, _mm512_loadu_ps(dist + i + H * PQC__SEED_BLOCK)))
        PQC__SDIST(0);
        PQC__SDIST(1);
        PQC__SDIST(2);
        PQC__SDIST(3);
#undef PQC__SDIST
    }
    /* the whole blocks left, one at a time (the AVX2 kernel's tile: the same lanes' values),
       then the points past them */
    if (i < n) pqc__seedmin_avx2(x + i * sd, xt + i * sd, n - i, d, cs, cg, cn, nb, xn + i, dist + i);
}

PQC__AVX512 static void pqc__scan_avx512(const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n,
                                         float *out)
{
    size_t t = 0;
    int j, b = cd->bits, m = cd->m;
    unsigned mask = (1u << b) - 1u;
    if (b == 8 && n >= 64) {
        /* sub-space by sub-space over the whole range, the 256-entry table held in 16
           registers: 8 two-table permutes and a 3-level blend tree replace a gather.
           out[t] accumulates j = 0, 1, ... in order, as the scalar reference does. */
        size_t nv = n & ~(size_t)15;
        for (j = 0; j < m; j++) {
            const float *l = lut + (size_t)j * ksub;
            const unsigned char *col = cd->data + (size_t)j * cd->col_stride + t0;
            const __m512 T0 = _mm512_loadu_ps(l), T1 = _mm512_loadu_ps(l + 16), T2 = _mm512_loadu_ps(l + 32),
                         T3 = _mm512_loadu_ps(l + 48), T4 = _mm512_loadu_ps(l + 64), T5 = _mm512_loadu_ps(l + 80),
                         T6 = _mm512_loadu_ps(l + 96), T7 = _mm512_loadu_ps(l + 112), T8 = _mm512_loadu_ps(l + 128),
                         T9 = _mm512_loadu_ps(l + 144), TA = _mm512_loadu_ps(l + 160), TB = _mm512_loadu_ps(l + 176),
                         TC = _mm512_loadu_ps(l + 192), TD = _mm512_loadu_ps(l + 208), TE = _mm512_loadu_ps(l + 224),
                         TF = _mm512_loadu_ps(l + 240);
            const __m512i b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64), b7 = _mm512_set1_epi32(128);
            for (t = 0; t < nv; t += 16) {
                __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(col + t)));
                __mmask16 m5 = _mm512_test_epi32_mask(ix, b5), m6 = _mm512_test_epi32_mask(ix, b6),
                          m7 = _mm512_test_epi32_mask(ix, b7);
                __m512 r0 = _mm512_permutex2var_ps(T0, ix, T1), r1 = _mm512_permutex2var_ps(T2, ix, T3),
                       r2 = _mm512_permutex2var_ps(T4, ix, T5), r3 = _mm512_permutex2var_ps(T6, ix, T7),
                       r4 = _mm512_permutex2var_ps(T8, ix, T9), r5 = _mm512_permutex2var_ps(TA, ix, TB),
                       r6 = _mm512_permutex2var_ps(TC, ix, TD), r7 = _mm512_permutex2var_ps(TE, ix, TF);
                __m512 v = _mm512_mask_blend_ps(
                    m7, _mm512_mask_blend_ps(m6, _mm512_mask_blend_ps(m5, r0, r1), _mm512_mask_blend_ps(m5, r2, r3)),
                    _mm512_mask_blend_ps(m6, _mm512_mask_blend_ps(m5, r4, r5), _mm512_mask_blend_ps(m5, r6, r7)));
                if (j == 0) _mm512_storeu_ps(out + t, _mm512_add_ps(_mm512_setzero_ps(), v));
                else _mm512_storeu_ps(out + t, _mm512_add_ps(_mm512_loadu_ps(out + t), v));
            }
        }
        t = nv;
    } else if (b == 8) {
        for (; t + 16 <= n; t += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (j = 0; j < m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride + t0 + t;
                __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)col));
                acc = _mm512_add_ps(acc, _mm512_i32gather_ps(ix, lut + (size_t)j * ksub, 4));
            }
            _mm512_storeu_ps(out + t, acc);
        }
    } else if (b == 4 && (t0 & 1) == 0) {
        const __m128i lo4 = _mm_set1_epi8(0x0f);
        for (; t + 16 <= n; t += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (j = 0; j < m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride + ((t0 + t) >> 1);
                __m128i v = _mm_loadl_epi64((const __m128i *)col);
                __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
                __m512i ix = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
                acc = _mm512_add_ps(acc, _mm512_permutexvar_ps(ix, _mm512_loadu_ps(lut + (size_t)j * ksub)));
            }
            _mm512_storeu_ps(out + t, acc);
        }
    } else if (n >= 16 && t0 + n < ((size_t)1 << 28)) {
        /* any width: 16 codes come out of one byte-offset gather (each lane reads the 32
           bits holding its code) and a variable shift; tables of up to 64 entries are
           looked up in registers */
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i vb = _mm512_set1_epi32(b), vmask = _mm512_set1_epi32((int)mask), seven = _mm512_set1_epi32(7);
        const __m512i b5 = _mm512_set1_epi32(32);
        for (; t + 16 <= n; t += 16) {
            __m512 acc = _mm512_setzero_ps();
            __m512i bits = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)(t0 + t)), lane), vb);
            __m512i byte = _mm512_srli_epi32(bits, 3), sh = _mm512_and_si512(bits, seven);
            for (j = 0; j < m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
                const float *l = lut + (size_t)j * ksub;
                __m512i w = _mm512_i32gather_epi32(byte, (const void *)col, 1);
                __m512i ix = _mm512_and_si512(_mm512_srlv_epi32(w, sh), vmask);
                __m512 v;
                if (ksub <= 16) {
                    v = _mm512_permutexvar_ps(ix, _mm512_maskz_loadu_ps((__mmask16)((1u << ksub) - 1u), l));
                } else if (ksub == 32) {
                    v = _mm512_permutex2var_ps(_mm512_loadu_ps(l), ix, _mm512_loadu_ps(l + 16));
                } else if (ksub == 64) {
                    __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(l), ix, _mm512_loadu_ps(l + 16));
                    __m512 hi = _mm512_permutex2var_ps(_mm512_loadu_ps(l + 32), ix, _mm512_loadu_ps(l + 48));
                    v = _mm512_mask_blend_ps(_mm512_test_epi32_mask(ix, b5), lo, hi);
                } else {
                    v = _mm512_i32gather_ps(ix, l, 4);
                }
                acc = _mm512_add_ps(acc, v);
            }
            _mm512_storeu_ps(out + t, acc);
        }
    }
    if (t < n) pqc__scan_scalar(cd, lut, ksub, t0 + t, n - t, out + t);
}

PQC__AVX512 static float pqc__max_avx512(const float *x, size_t n)
{
    __m512 m = _mm512_set1_ps(-INFINITY);
    size_t i = 0;
    float r;
    float tmp[16];
    int l;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    _mm512_storeu_ps(tmp, m);
    r = pqc__max_scalar(x + i, n - i);
    for (l = 0; l < 16; l++) r = tmp[l] > r ? tmp[l] : r;
    return r;
}

PQC__AVX512 static __m512 pqc__exp_avx512(__m512 x)
{
    __m512 n, r, z, y;
    x = _mm512_max_ps(x, _mm512_set1_ps(PQC__EXP_LO));
    n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(PQC__LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-PQC__LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-PQC__LN2_LO), r);
    z = _mm512_mul_ps(r, r);
    y = _mm512_set1_ps(PQC__EP0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PQC__EP1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PQC__EP2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PQC__EP3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PQC__EP4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PQC__EP5));
    y = _mm512_fmadd_ps(y, z, r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    /* y * 2^n in one rounding, as the product with the power of two built from n's bits
       (n >= -126 after the clamp, so that power is a normal number) */
    return _mm512_scalef_ps(y, n);
}

PQC__AVX512 static float pqc__expsum_avx512(const float *s, size_t n, float mx, float scale, float *e)
{
    __m512 acc = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(mx), vs = _mm512_set1_ps(scale);
    float lanes[16], z = 0.0f;
    size_t t = 0;
    int l;
    /* two vectors a step: the exponential's chain of fused adds is long, and one vector
       at a time left the units waiting on it (128K values: 0.41-0.47 -> 0.34 ns each);
       the lanes still add t, then t + 16, in order */
    for (; t + 32 <= n; t += 32) {
        __m512 a = pqc__exp_avx512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm), vs));
        __m512 b = pqc__exp_avx512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t + 16), vm), vs));
        _mm512_storeu_ps(e + t, a);
        _mm512_storeu_ps(e + t + 16, b);
        acc = _mm512_add_ps(_mm512_add_ps(acc, a), b);
    }
    for (; t + 16 <= n; t += 16) {
        __m512 a = pqc__exp_avx512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm), vs));
        _mm512_storeu_ps(e + t, a);
        acc = _mm512_add_ps(acc, a);
    }
    _mm512_storeu_ps(lanes, acc);
    for (; t < n; t++) {
        e[t] = pqc__expf((s[t] - mx) * scale);
        lanes[t & 15] += e[t];
    }
    for (l = 0; l < 16; l++) z += lanes[l];
    return z;
}

PQC__AVX512 static void pqc__axpy_avx512(const float *e, size_t n, float w, float *acc)
{
    size_t t = 0;
    const __m512 vw = _mm512_set1_ps(w);
    for (; t + 16 <= n; t += 16)
        _mm512_storeu_ps(acc + t, _mm512_fmadd_ps(_mm512_loadu_ps(e + t), vw, _mm512_loadu_ps(acc + t)));
    for (; t < n; t++) acc[t] = fmaf(e[t], w, acc[t]);
}

/* AVX-512 machines take the AVX2 code for this one (same results, as every level) */
PQC__AVX512 static void pqc__scan_heads_avx512(const pqc_codes *cd, const float *lut, int ksub, int g, size_t t0,
                                               size_t n, float *out, size_t ostride, float *mx)
{
    pqc__scan_heads_avx2(cd, lut, ksub, g, t0, n, out, ostride, mx);
}

/* the fused kernel compiled with this level's 32 registers */
PQC__AVX512 static void pqc__scan_products_avx512(const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n,
                                                  float *out, size_t ostride, float *z)
{
    pqc__products_g4_sse(cd, el, ksub, t0, n, out, ostride, z);
}

PQC__AVX512 static void pqc__combine_avx512(const float *e, size_t estride, int g, size_t n, const float *w, float *out)
{
    size_t t = 0;
    int h;
    for (; t + 16 <= n; t += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (h = 0; h < g; h++)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(e + (size_t)h * estride + t), _mm512_set1_ps(w[h]), acc);
        _mm512_storeu_ps(out + t, acc);
    }
    if (t < n) pqc__combine_avx2(e + t, estride, g, n - t, w, out + t);
}

PQC__AVX512 static void pqc__narrow_avx512(const float *src, pqc_dtype t, size_t n, void *dst)
{
    pqc__narrow_avx2(src, t, n, dst);
}

PQC__AVX512 static void pqc__halfrow_avx512(const void *src, pqc_dtype t, size_t n, float *dst)
{
    pqc__halfrow_avx2(src, t, n, dst);
}

PQC__AVX512 static int pqc__within_avx512(const float *x, size_t n, float limit) { return pqc__within_avx2(x, n, limit); }

PQC__AVX512 static size_t pqc__keydots_avx512(const float *q, const unsigned char *rows, size_t stride, pqc_dtype t,
                                               size_t n, int d, float limit, float *row, float *out)
{
    return pqc__keydots_avx2(q, rows, stride, t, n, d, limit, row, out);
}

/* the four rows' lane sums of pqc__rowdots_avx2 from 16-lane accumulators (lanes 0-7 in
   the lower half, 8-15 in the upper) */
PQC__AVX512 static inline void pqc__lanesum16x4_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *out)
{
    float s4[4];
    __m128 acc = pqc__lanesum8x4_avx2(_mm_setzero_ps(), _mm512_castps512_ps256(a0), _mm512_castps512_ps256(a1),
                                      _mm512_castps512_ps256(a2), _mm512_castps512_ps256(a3));
    acc = pqc__lanesum8x4_avx2(acc, _mm512_extractf32x8_ps(a0, 1), _mm512_extractf32x8_ps(a1, 1),
                               _mm512_extractf32x8_ps(a2, 1), _mm512_extractf32x8_ps(a3, 1));
    _mm_storeu_ps(s4, acc);
    memcpy(out, s4, sizeof s4);
}

/* Eight rows side by side where d is a multiple of 16 (eight independent chains, one per
   row, lane e % 16 of each), then four; the lanes added in order as pqc__rowdots_avx2 adds
   them; other widths and the last rows one at a time. */
PQC__AVX512 static void pqc__rowdots_avx512(const float *q, const float *rows, size_t n, size_t stride, int d,
                                            float *out)
{
    size_t i = 0;
    int e, l;
    if (d % 16 == 0) {
        for (; i + 8 <= n; i += 8) {
            const float *r = rows + i * stride;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (e = 0; e < d; e += 16) {
                const __m512 qe = _mm512_loadu_ps(q + e);
                a0 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + e), a0);
                a1 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + stride + e), a1);
                a2 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 2 * stride + e), a2);
                a3 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 3 * stride + e), a3);
                a4 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 4 * stride + e), a4);
                a5 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 5 * stride + e), a5);
                a6 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 6 * stride + e), a6);
                a7 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 7 * stride + e), a7);
            }
            pqc__lanesum16x4_avx512(a0, a1, a2, a3, out + i);
            pqc__lanesum16x4_avx512(a4, a5, a6, a7, out + i + 4);
        }
        for (; i + 4 <= n; i += 4) {
            const float *r = rows + i * stride;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (e = 0; e < d; e += 16) {
                const __m512 qe = _mm512_loadu_ps(q + e);
                a0 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + e), a0);
                a1 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + stride + e), a1);
                a2 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 2 * stride + e), a2);
                a3 = _mm512_fmadd_ps(qe, _mm512_loadu_ps(r + 3 * stride + e), a3);
            }
            pqc__lanesum16x4_avx512(a0, a1, a2, a3, out + i);
        }
    }
    for (; i < n; i++) {
        const float *r = rows + i * stride;
        __m512 acc = _mm512_setzero_ps();
        float lanes[16], s = 0.0f;
        for (e = 0; e + 16 <= d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(r + e), acc);
        _mm512_storeu_ps(lanes, acc);
        for (; e < d; e++) lanes[e & 15] = fmaf(q[e], r[e], lanes[e & 15]);
        for (l = 0; l < 16; l++) s += lanes[l];
        out[i] = s;
    }
}

/* 16 stored values from element e of row r in one vector */
PQC__AVX512 static inline __m512 pqc__load16_avx512(const unsigned char *r, pqc_dtype t, int e)
{
    if (t == PQC_F32) return _mm512_loadu_ps((const float *)(const void *)r + e);
    if (t == PQC_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 2 * (size_t)e)));
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 2 * (size_t)e))), 16));
}

PQC__AVX512 static void pqc__rowpair_avx512(const void *k, const void *v, pqc_dtype t, size_t d, float *ko, float *vo,
                                            int stream)
{
    const unsigned char *a = (const unsigned char *)k, *b = (const unsigned char *)v;
    int e;
    if (!stream || d % 16 || (((uintptr_t)ko | (uintptr_t)vo) & 63)) {
        pqc__rowpair_avx2(k, v, t, d, ko, vo, stream);
        return;
    }
    for (e = 0; e < (int)d; e += 16) {
        _mm512_stream_ps(ko + e, pqc__load16_avx512(a, t, e));
        _mm512_stream_ps(vo + e, pqc__load16_avx512(b, t, e));
    }
}

/* pqc__gatherdots_avx2 with the 16 lanes in one register: four heads' chains per row, their
   lane sums as pqc__rowdots_avx512 adds them. Rows go in pairs, the two rows' chains side
   by side on shared query loads: a row's chains are eight fused steps deep, and a lone row
   left the core waiting on them with its next reads not yet issued (128K fp16 rows, 28K
   candidates, 4 heads: 81-111 -> 67-83 ns per candidate, touching the rows alone 45-56;
   four rows at a time were slower than one). The same chains, so the same bits.
   pqc__gatherdots1_avx512: one row's dots. */
PQC__AVX512 static void pqc__gatherdots1_avx512(const float *q, int g, const unsigned char *r, pqc_dtype t, int d,
                                                float *out, size_t ostride)
{
    int e, h, l;
    for (h = 0; h + 4 <= g; h += 4) {
        const float *q0 = q + (size_t)h * (size_t)d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        float s4[4];
        for (e = 0; e < d; e += 16) {
            const __m512 x = pqc__load16_avx512(r, t, e);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + e), x, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + e), x, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + e), x, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q3 + e), x, a3);
        }
        pqc__lanesum16x4_avx512(a0, a1, a2, a3, s4);
        out[(size_t)h * ostride] = s4[0];
        out[(size_t)(h + 1) * ostride] = s4[1];
        out[(size_t)(h + 2) * ostride] = s4[2];
        out[(size_t)(h + 3) * ostride] = s4[3];
    }
    for (; h < g; h++) {
        const float *qh = q + (size_t)h * (size_t)d;
        __m512 acc = _mm512_setzero_ps();
        float lanes[16], sum = 0.0f;
        for (e = 0; e < d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + e), pqc__load16_avx512(r, t, e), acc);
        _mm512_storeu_ps(lanes, acc);
        for (l = 0; l < 16; l++) sum += lanes[l];
        out[(size_t)h * ostride] = sum;
    }
}
/* the rows in pairs from row 0 on, while both of a pair pass the check (with check): the
   index of the first row not done. Inlined where it is called with t (and d_h 128) as
   constants, so that each gets its own loop: a load that tested t and a loop over a width
   not known when compiling cost 5-10 ns a candidate. */
PQC__AVX512 static PQC__INLINE_ALWAYS size_t pqc__gatherpairs_avx512(const pqc__keydots_level *lv, const float *q, int g,
                                                  const unsigned char *base, size_t stride, pqc_dtype t,
                                                  const uint32_t *idx, size_t n, int d, int check, float limit,
                                                  uint32_t lim2, float *row, float *out, size_t ostride)
{
    const size_t rb = (size_t)d * pqc_dtype_size(t);
    size_t i = 0;
    int e, h, l;
    for (; i + 2 <= n; i += 2) {
        const unsigned char *r0, *r1;
        if (check) {
            r0 = pqc__gather_row_avx2(lv, base, stride, t, idx, i, n, d, check, limit, lim2, row);
            if (!r0) return i;
            r1 = pqc__gather_row_avx2(lv, base, stride, t, idx, i + 1, n, d, check, limit, lim2, row);
            if (!r1) return i;
        } else {
            r0 = pqc__gather_at(base, stride, rb, idx, i, n);
            r1 = pqc__gather_at(base, stride, rb, idx, i + 1, n);
        }
        for (h = 0; h + 4 <= g; h += 4) {
            const float *q0 = q + (size_t)h * (size_t)d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            float s4[4], t4[4];
            for (e = 0; e < d; e += 16) {
                const __m512 x = pqc__load16_avx512(r0, t, e), y = pqc__load16_avx512(r1, t, e);
                __m512 qe = _mm512_loadu_ps(q0 + e);
                a0 = _mm512_fmadd_ps(qe, x, a0);
                b0 = _mm512_fmadd_ps(qe, y, b0);
                qe = _mm512_loadu_ps(q1 + e);
                a1 = _mm512_fmadd_ps(qe, x, a1);
                b1 = _mm512_fmadd_ps(qe, y, b1);
                qe = _mm512_loadu_ps(q2 + e);
                a2 = _mm512_fmadd_ps(qe, x, a2);
                b2 = _mm512_fmadd_ps(qe, y, b2);
                qe = _mm512_loadu_ps(q3 + e);
                a3 = _mm512_fmadd_ps(qe, x, a3);
                b3 = _mm512_fmadd_ps(qe, y, b3);
            }
            pqc__lanesum16x4_avx512(a0, a1, a2, a3, s4);
            pqc__lanesum16x4_avx512(b0, b1, b2, b3, t4);
            out[(size_t)h * ostride + i] = s4[0];
            out[(size_t)(h + 1) * ostride + i] = s4[1];
            out[(size_t)(h + 2) * ostride + i] = s4[2];
            out[(size_t)(h + 3) * ostride + i] = s4[3];
            out[(size_t)h * ostride + i + 1] = t4[0];
            out[(size_t)(h + 1) * ostride + i + 1] = t4[1];
            out[(size_t)(h + 2) * ostride + i + 1] = t4[2];
            out[(size_t)(h + 3) * ostride + i + 1] = t4[3];
        }
        for (; h < g; h++) { /* the heads past a multiple of four */
            const float *qh = q + (size_t)h * (size_t)d;
            __m512 acc = _mm512_setzero_ps(), acd = acc;
            float la[16], lb[16], sa = 0.0f, sb = 0.0f;
            for (e = 0; e < d; e += 16) {
                const __m512 qe = _mm512_loadu_ps(qh + e);
                acc = _mm512_fmadd_ps(qe, pqc__load16_avx512(r0, t, e), acc);
                acd = _mm512_fmadd_ps(qe, pqc__load16_avx512(r1, t, e), acd);
            }
            _mm512_storeu_ps(la, acc);
            _mm512_storeu_ps(lb, acd);
            for (l = 0; l < 16; l++) {
                sa += la[l];
                sb += lb[l];
            }
            out[(size_t)h * ostride + i] = sa;
            out[(size_t)h * ostride + i + 1] = sb;
        }
    }
    return i;
}
PQC__AVX512 static size_t pqc__gatherdots_avx512(const float *q, int g, const unsigned char *base, size_t stride,
                                                 pqc_dtype t, const uint32_t *idx, size_t n, int d, int check,
                                                 float limit, float *row, float *out, size_t ostride)
{
    static const pqc__keydots_level lv = {pqc__halfrow_avx2, pqc__within_avx2, pqc__rowdots_avx512};
    const uint32_t lim2 = pqc__row_lim2(t, limit);
    size_t i;
    if (d % 16 || (check && lim2 == PQC__NO_LIM2))
        return pqc__gatherdots_copy(&lv, q, g, base, stride, t, idx, n, d, check, limit, row, out, ostride);
    /* (pairs for fewer than four heads too: one head's lone chain waited the longest;
       128K fp16 rows, 28K candidates: 1 head 63-67 -> 51-55 ns, 2 heads 78-85 -> 63-68) */
    if (t == PQC_F16 && d == 128)
        i = pqc__gatherpairs_avx512(&lv, q, g, base, stride, PQC_F16, idx, n, 128, check, limit, lim2, row, out, ostride);
    else if (t == PQC_F16)
        i = pqc__gatherpairs_avx512(&lv, q, g, base, stride, PQC_F16, idx, n, d, check, limit, lim2, row, out, ostride);
    else if (t == PQC_BF16)
        i = pqc__gatherpairs_avx512(&lv, q, g, base, stride, PQC_BF16, idx, n, d, check, limit, lim2, row, out, ostride);
    else
        i = pqc__gatherpairs_avx512(&lv, q, g, base, stride, PQC_F32, idx, n, d, check, limit, lim2, row, out, ostride);
    for (; i < n; i++) { /* the last row, or the rows from a pair that failed the check */
        const unsigned char *r = pqc__gather_row_avx2(&lv, base, stride, t, idx, i, n, d, check, limit, lim2, row);
        if (!r) return i;
        pqc__gatherdots1_avx512(q, g, r, t, d, out + i, ostride);
    }
    return n;
}
/* eight points' chains side by side, each the scalar one (fmaf is one instruction here) */
PQC__AVX2 static void pqc__sqnorms_avx2(const float *x, size_t n, int d, float *out)
{
    size_t i = 0;
    int e, p;
    for (; i + 8 <= n; i += 8) {
        const float *xi = x + i * (size_t)d;
        float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (e = 0; e < d; e++)
            for (p = 0; p < 8; p++) a[p] = fmaf(xi[(size_t)p * d + e], xi[(size_t)p * d + e], a[p]);
        for (p = 0; p < 8; p++) out[i + p] = a[p];
    }
    pqc__sqnorms_scalar(x + i * (size_t)d, n - i, d, out + i);
}
PQC__AVX512 static void pqc__sqnorms_avx512(const float *x, size_t n, int d, float *out)
{
    pqc__sqnorms_avx2(x, n, d, out);
}

PQC__AVX512 static void pqc__accum_avx512(const float *x, size_t n, int d, const uint16_t *idx, double *sum)
{
    size_t i;
    int e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        double *sp = sum + (size_t)idx[i] * d;
        for (e = 0; e + 8 <= d; e += 8)
            _mm512_storeu_pd(sp + e, _mm512_add_pd(_mm512_loadu_pd(sp + e), _mm512_cvtps_pd(_mm256_loadu_ps(xi + e))));
        for (; e < d; e++) sp[e] += xi[e];
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif /* PQC__X86 */

#if PQC__NEON
/* ----- NEON (AArch64) -----
   Four lanes a register. Every product-sum is one vfmaq_f32 chain (fused, as fmaf),
   every other operation the scalar one lane by lane; comparisons and selects stand in for
   the scalar ternaries, so NaN and signed zeros fare as they do there. Table look-ups
   move bytes (vqtbl4q_u8) or load lanes: no arithmetic. */
static void pqc__dots_neon(const float *x, int d, const float *ct, int kpad, int k, float *dots)
{
    int c, e, q, l;
    for (c = 0; c < kpad && c < k; c += 16) { /* kpad: a multiple of 16 */
        float32x4_t a[4], a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
        const float *cp = ct + c;
        for (e = 0; e < d; e++, cp += kpad) {
            float32x4_t s = vdupq_n_f32(x[e]);
            a0 = vfmaq_f32(a0, s, vld1q_f32(cp));
            a1 = vfmaq_f32(a1, s, vld1q_f32(cp + 4));
            a2 = vfmaq_f32(a2, s, vld1q_f32(cp + 8));
            a3 = vfmaq_f32(a3, s, vld1q_f32(cp + 12));
        }
        a[0] = a0;
        a[1] = a1;
        a[2] = a2;
        a[3] = a3;
        for (q = 0; q < 4; q++) {
            int c0 = c + 4 * q;
            if (c0 + 4 <= k) {
                vst1q_f32(dots + c0, a[q]);
            } else {
                float tmp[4];
                vst1q_f32(tmp, a[q]);
                for (l = 0; c0 + l < k; l++) dots[c0 + l] = tmp[l];
                break;
            }
        }
    }
}

/* lowest value, then lowest index, across the 4 lanes: the scalar loop's first minimum */
static void pqc__argmin_fin_neon(float32x4_t best, uint32x4_t bidx, uint16_t *idx, float *val)
{
    float bv[4];
    uint32_t bi[4];
    float rv;
    uint32_t r;
    int l;
    vst1q_f32(bv, best);
    vst1q_u32(bi, bidx);
    rv = bv[0];
    r = bi[0];
    for (l = 1; l < 4; l++)
        if (bv[l] < rv || (bv[l] == rv && bi[l] < r)) {
            rv = bv[l];
            r = bi[l];
        }
    *idx = (uint16_t)r;
    if (val) *val = rv;
}

/* 4 points x 16 centroids per register tile; each (point, centroid) dot is still one
   fma chain over the dims from e = 0, and each lane meets its centroids in ascending
   order, keeping the first of the lowest values (v < best: NaN never wins), so the
   lane's first minimum is the scalar loop's */
static void pqc__assign_neon(const float *x, size_t n, int d, const float *ct, const float *cn, int kpad, int k,
                             uint16_t *idx, float *val)
{
    size_t i = 0;
    int c, e;
    const uint32_t lanes[4] = {0, 1, 2, 3};
    const uint32x4_t lane = vld1q_u32(lanes);
    (void)k; /* padded centroids have cn = +inf and never win */
#define PQC__UPD_NEON(A, C, B, I)                                                                                      \
    do {                                                                                                               \
        float32x4_t v_ = vsubq_f32(vld1q_f32(cn + (C)), vaddq_f32(A, A));                                             \
        uint32x4_t lt_ = vcltq_f32(v_, B);                                                                             \
        B = vbslq_f32(lt_, v_, B);                                                                                     \
        I = vbslq_u32(lt_, vaddq_u32(lane, vdupq_n_u32((uint32_t)(C))), I);                                           \
    } while (0)
#define PQC__FMA4_NEON(A0, A1, A2, A3, S)                                                                              \
    do {                                                                                                               \
        float32x4_t s_ = vdupq_n_f32(S);                                                                               \
        A0 = vfmaq_f32(A0, s_, v0);                                                                                    \
        A1 = vfmaq_f32(A1, s_, v1);                                                                                    \
        A2 = vfmaq_f32(A2, s_, v2);                                                                                    \
        A3 = vfmaq_f32(A3, s_, v3);                                                                                    \
    } while (0)
#define PQC__UPD4_NEON(A0, A1, A2, A3, B, I)                                                                           \
    do {                                                                                                               \
        PQC__UPD_NEON(A0, c, B, I);                                                                                    \
        PQC__UPD_NEON(A1, c + 4, B, I);                                                                                \
        PQC__UPD_NEON(A2, c + 8, B, I);                                                                                \
        PQC__UPD_NEON(A3, c + 12, B, I);                                                                               \
    } while (0)
    for (; i + 4 <= n; i += 4) {
        const float *x0 = x + i * (size_t)d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
        float32x4_t b0 = vdupq_n_f32(INFINITY), b1 = b0, b2 = b0, b3 = b0;
        uint32x4_t i0 = vdupq_n_u32(0), i1 = i0, i2 = i0, i3 = i0;
        for (c = 0; c < kpad; c += 16) {
            float32x4_t a00 = vdupq_n_f32(0.0f), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
                        a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00,
                        a33 = a00;
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                float32x4_t v0 = vld1q_f32(cp), v1 = vld1q_f32(cp + 4), v2 = vld1q_f32(cp + 8), v3 = vld1q_f32(cp + 12);
                PQC__FMA4_NEON(a00, a01, a02, a03, x0[e]);
                PQC__FMA4_NEON(a10, a11, a12, a13, x1[e]);
                PQC__FMA4_NEON(a20, a21, a22, a23, x2[e]);
                PQC__FMA4_NEON(a30, a31, a32, a33, x3[e]);
            }
            PQC__UPD4_NEON(a00, a01, a02, a03, b0, i0);
            PQC__UPD4_NEON(a10, a11, a12, a13, b1, i1);
            PQC__UPD4_NEON(a20, a21, a22, a23, b2, i2);
            PQC__UPD4_NEON(a30, a31, a32, a33, b3, i3);
        }
        pqc__argmin_fin_neon(b0, i0, idx + i, val ? val + i : NULL);
        pqc__argmin_fin_neon(b1, i1, idx + i + 1, val ? val + i + 1 : NULL);
        pqc__argmin_fin_neon(b2, i2, idx + i + 2, val ? val + i + 2 : NULL);
        pqc__argmin_fin_neon(b3, i3, idx + i + 3, val ? val + i + 3 : NULL);
    }
    for (; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        float32x4_t best = vdupq_n_f32(INFINITY);
        uint32x4_t bidx = vdupq_n_u32(0);
        for (c = 0; c < kpad; c += 16) {
            float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
            const float *cp = ct + c;
            for (e = 0; e < d; e++, cp += kpad) {
                float32x4_t v0 = vld1q_f32(cp), v1 = vld1q_f32(cp + 4), v2 = vld1q_f32(cp + 8), v3 = vld1q_f32(cp + 12);
                PQC__FMA4_NEON(a0, a1, a2, a3, xi[e]);
            }
            PQC__UPD4_NEON(a0, a1, a2, a3, best, bidx);
        }
        pqc__argmin_fin_neon(best, bidx, idx + i, val ? val + i : NULL);
    }
#undef PQC__UPD4_NEON
#undef PQC__FMA4_NEON
#undef PQC__UPD_NEON
}

/* codes of tokens [t, t + 16) of one column, one byte each */
static uint8x16_t pqc__codes16_neon(const unsigned char *col, int b, unsigned mask, size_t t)
{
    unsigned char tmp[16];
    int l;
    if (b == 4 && (t & 1) == 0) {
        uint8x8_t v = vld1_u8(col + (t >> 1)), lo = vand_u8(v, vdup_n_u8(0x0f)), hi = vshr_n_u8(v, 4);
        return vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi)); /* the low nibble first */
    }
    for (l = 0; l < 16; l++) {
        size_t bit = (t + (size_t)l) * (size_t)b;
        unsigned v = ((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7);
        tmp[l] = (unsigned char)(v & mask);
    }
    return vld1q_u8(tmp);
}

/* Points in lanes: one block (16 points, four registers) x 4 centres per register tile
   (16 accumulators), then single centres; each lane's dot is the scalar chain over the
   dims, the minimum `v < best` lane by lane (a compare and a select: vminq would let a
   NaN win). Points past the last block: the scalar reference. */
#define PQC__FMA4_SEED_NEON(A0, A1, A2, A3, S)                                                                         \
    do {                                                                                                               \
        float32x4_t s_ = vdupq_n_f32(S);                                                                               \
        A0 = vfmaq_f32(A0, v0, s_);                                                                                    \
        A1 = vfmaq_f32(A1, v1, s_);                                                                                    \
        A2 = vfmaq_f32(A2, v2, s_);                                                                                    \
        A3 = vfmaq_f32(A3, v3, s_);                                                                                    \
    } while (0)
static void pqc__seedmin_neon(const float *x, const float *xt, size_t n, int d, const float *cs, const float *cg,
                              const float *cn, int nb, const float *xn, float *dist)
{
    size_t i = 0, sd = (size_t)d;
    const float32x4_t zero = vdupq_n_f32(0.0f);
    int c, e, h;
#define PQC__SMIN_NEON(B, A, CN)                                                                                       \
    do {                                                                                                               \
        float32x4_t v_ = vsubq_f32(vdupq_n_f32(CN), vaddq_f32(A, A));                                                 \
        B = vbslq_f32(vcltq_f32(v_, B), v_, B);                                                                        \
    } while (0)
    for (; i + PQC__SEED_BLOCK <= n; i += PQC__SEED_BLOCK) {
        const float *p = xt + i * sd;
        float32x4_t best[4];
        for (h = 0; h < 4; h++) best[h] = vdupq_n_f32(INFINITY);
        for (c = 0; c + 4 <= nb; c += 4) {
            const float *cc = cg + (size_t)c * sd;
            float32x4_t a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero,
                        a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
            for (e = 0; e < d; e++, cc += 4) {
                const float *pe = p + (size_t)e * PQC__SEED_BLOCK;
                float32x4_t v0 = vld1q_f32(pe), v1 = vld1q_f32(pe + 4), v2 = vld1q_f32(pe + 8), v3 = vld1q_f32(pe + 12);
                PQC__FMA4_SEED_NEON(a00, a01, a02, a03, cc[0]);
                PQC__FMA4_SEED_NEON(a10, a11, a12, a13, cc[1]);
                PQC__FMA4_SEED_NEON(a20, a21, a22, a23, cc[2]);
                PQC__FMA4_SEED_NEON(a30, a31, a32, a33, cc[3]);
            }
            PQC__SMIN_NEON(best[0], a00, cn[c]);
            PQC__SMIN_NEON(best[1], a01, cn[c]);
            PQC__SMIN_NEON(best[2], a02, cn[c]);
            PQC__SMIN_NEON(best[3], a03, cn[c]);
            PQC__SMIN_NEON(best[0], a10, cn[c + 1]);
            PQC__SMIN_NEON(best[1], a11, cn[c + 1]);
            PQC__SMIN_NEON(best[2], a12, cn[c + 1]);
            PQC__SMIN_NEON(best[3], a13, cn[c + 1]);
            PQC__SMIN_NEON(best[0], a20, cn[c + 2]);
            PQC__SMIN_NEON(best[1], a21, cn[c + 2]);
            PQC__SMIN_NEON(best[2], a22, cn[c + 2]);
            PQC__SMIN_NEON(best[3], a23, cn[c + 2]);
            PQC__SMIN_NEON(best[0], a30, cn[c + 3]);
            PQC__SMIN_NEON(best[1], a31, cn[c + 3]);
            PQC__SMIN_NEON(best[2], a32, cn[c + 3]);
            PQC__SMIN_NEON(best[3], a33, cn[c + 3]);
        }
        for (; c < nb; c++) {
            const float *cc = cs + (size_t)c * sd;
            float32x4_t a0 = zero, a1 = zero, a2 = zero, a3 = zero;
            for (e = 0; e < d; e++) {
                const float *pe = p + (size_t)e * PQC__SEED_BLOCK;
                float32x4_t v0 = vld1q_f32(pe), v1 = vld1q_f32(pe + 4), v2 = vld1q_f32(pe + 8), v3 = vld1q_f32(pe + 12);
                PQC__FMA4_SEED_NEON(a0, a1, a2, a3, cc[e]);
            }
            PQC__SMIN_NEON(best[0], a0, cn[c]);
            PQC__SMIN_NEON(best[1], a1, cn[c]);
            PQC__SMIN_NEON(best[2], a2, cn[c]);
            PQC__SMIN_NEON(best[3], a3, cn[c]);
        }
        for (h = 0; h < 4; h++) { /* v = xn + best, raised to 0 below it; dist = v where v is lower */
            float32x4_t v = vaddq_f32(vld1q_f32(xn + i + 4 * (size_t)h), best[h]), dv = vld1q_f32(dist + i + 4 * (size_t)h);
            v = vbslq_f32(vcltq_f32(v, zero), zero, v);
            vst1q_f32(dist + i + 4 * (size_t)h, vbslq_f32(vcltq_f32(v, dv), v, dv));
        }
    }
#undef PQC__SMIN_NEON
#undef PQC__FMA4_SEED_NEON
    if (i < n) pqc__seedmin_scalar(x + i * sd, NULL, n - i, d, cs, NULL, cn, nb, xn + i, dist + i);
}

static void pqc__scan_neon(const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n, float *out)
{
    size_t t = 0;
    int j, b = cd->bits, m = cd->m, nt = 1 << cd->bits;
    unsigned mask = (1u << b) - 1u;
    if (nt <= 64 && n >= 16) {
        /* sub-space by sub-space over the whole range, its table of at most 64 entries
           held in registers and looked up bytewise: byte k of entry c is byte 4c + k of
           the table, 16 entries a register quadruple (an index past one gives 0 from
           vqtbl4q_u8, and leaves the lane as it was in vqtbx4q_u8). out[t] accumulates
           j = 0, 1, ... in order from 0, as the scalar reference does. */
        size_t nv = n & ~(size_t)15;
        int nq = nt <= 16 ? 1 : nt <= 32 ? 2 : 4;
        const unsigned char offs[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
        const uint8x16_t off = vld1q_u8(offs), k64 = vdupq_n_u8(64), k128 = vdupq_n_u8(128), k192 = vdupq_n_u8(192);
        for (j = 0; j < m; j++) {
            const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
            float tf[64];
            uint8x16x4_t T0, T1, T2, T3;
            memset(tf, 0, sizeof tf);
            memcpy(tf, lut + (size_t)j * ksub, (size_t)nt * sizeof(float));
            T0.val[0] = vld1q_u8((const unsigned char *)tf);
            T0.val[1] = vld1q_u8((const unsigned char *)(tf + 4));
            T0.val[2] = vld1q_u8((const unsigned char *)(tf + 8));
            T0.val[3] = vld1q_u8((const unsigned char *)(tf + 12));
            T1.val[0] = vld1q_u8((const unsigned char *)(tf + 16));
            T1.val[1] = vld1q_u8((const unsigned char *)(tf + 20));
            T1.val[2] = vld1q_u8((const unsigned char *)(tf + 24));
            T1.val[3] = vld1q_u8((const unsigned char *)(tf + 28));
            T2.val[0] = vld1q_u8((const unsigned char *)(tf + 32));
            T2.val[1] = vld1q_u8((const unsigned char *)(tf + 36));
            T2.val[2] = vld1q_u8((const unsigned char *)(tf + 40));
            T2.val[3] = vld1q_u8((const unsigned char *)(tf + 44));
            T3.val[0] = vld1q_u8((const unsigned char *)(tf + 48));
            T3.val[1] = vld1q_u8((const unsigned char *)(tf + 52));
            T3.val[2] = vld1q_u8((const unsigned char *)(tf + 56));
            T3.val[3] = vld1q_u8((const unsigned char *)(tf + 60));
            for (t = 0; t < nv; t += 16) {
                /* c4: the 16 codes times 4; tokens 4q..4q+3 look up bytes 4c + 0..3 */
                uint8x16_t c4 = vshlq_n_u8(pqc__codes16_neon(col, b, mask, t0 + t), 2);
                uint8x16_t lo = vzip1q_u8(c4, c4), hi = vzip2q_u8(c4, c4);
#define PQC__LUT_NEON(BI, Q)                                                                                           \
    do {                                                                                                               \
        uint8x16_t bi_ = vaddq_u8(BI, off), r_ = vqtbl4q_u8(T0, bi_);                                                  \
        if (nq > 1) r_ = vqtbx4q_u8(r_, T1, vsubq_u8(bi_, k64));                                                       \
        if (nq > 2) {                                                                                                  \
            r_ = vqtbx4q_u8(r_, T2, vsubq_u8(bi_, k128));                                                              \
            r_ = vqtbx4q_u8(r_, T3, vsubq_u8(bi_, k192));                                                              \
        }                                                                                                              \
        vst1q_f32(out + t + 4 * (Q), vaddq_f32(j == 0 ? vdupq_n_f32(0.0f) : vld1q_f32(out + t + 4 * (Q)),            \
                                               vreinterpretq_f32_u8(r_)));                                             \
    } while (0)
                PQC__LUT_NEON(vzip1q_u8(lo, lo), 0);
                PQC__LUT_NEON(vzip2q_u8(lo, lo), 1);
                PQC__LUT_NEON(vzip1q_u8(hi, hi), 2);
                PQC__LUT_NEON(vzip2q_u8(hi, hi), 3);
#undef PQC__LUT_NEON
            }
        }
        t = nv;
    } else if (nt > 64) {
        /* 128 or 256 entries: 8 tokens at a time, the entries loaded lane by lane */
        for (; t + 8 <= n; t += 8) {
            float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
            for (j = 0; j < m; j++) {
                const unsigned char *col = cd->data + (size_t)j * cd->col_stride;
                const float *l = lut + (size_t)j * ksub;
                unsigned char ix[8];
                float32x4_t v0, v1;
                int li;
                if (b == 8) {
                    memcpy(ix, col + t0 + t, 8);
                } else {
                    for (li = 0; li < 8; li++) {
                        size_t bit = (t0 + t + (size_t)li) * (size_t)b;
                        unsigned v = ((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7);
                        ix[li] = (unsigned char)(v & mask);
                    }
                }
                v0 = vld1q_dup_f32(l + ix[0]);
                v0 = vld1q_lane_f32(l + ix[1], v0, 1);
                v0 = vld1q_lane_f32(l + ix[2], v0, 2);
                v0 = vld1q_lane_f32(l + ix[3], v0, 3);
                v1 = vld1q_dup_f32(l + ix[4]);
                v1 = vld1q_lane_f32(l + ix[5], v1, 1);
                v1 = vld1q_lane_f32(l + ix[6], v1, 2);
                v1 = vld1q_lane_f32(l + ix[7], v1, 3);
                a0 = vaddq_f32(a0, v0);
                a1 = vaddq_f32(a1, v1);
            }
            vst1q_f32(out + t, a0);
            vst1q_f32(out + t + 4, a1);
        }
    }
    if (t < n) pqc__scan_scalar(cd, lut, ksub, t0 + t, n - t, out + t);
}

/* the scalar loop's m = x > m ? x : m lane by lane (NaN never taken); the lanes' maxima
   are equal to the scalar one but for the sign of a zero maximum, where the scalar loop
   keeps the first zero */
static float pqc__max_neon(const float *x, size_t n)
{
    float32x4_t m0 = vdupq_n_f32(-INFINITY), m1 = m0;
    float tmp[8], r;
    size_t i = 0;
    int l;
    for (; i + 8 <= n; i += 8) {
        float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + i + 4);
        m0 = vbslq_f32(vcgtq_f32(a, m0), a, m0);
        m1 = vbslq_f32(vcgtq_f32(b, m1), b, m1);
    }
    vst1q_f32(tmp, m0);
    vst1q_f32(tmp + 4, m1);
    r = pqc__max_scalar(x + i, n - i);
    for (l = 0; l < 8; l++) r = tmp[l] > r ? tmp[l] : r;
    if (r == 0.0f)
        for (i = 0; i < n; i++)
            if (x[i] == 0.0f) return x[i];
    return r;
}

static float32x4_t pqc__exp_neon(float32x4_t x)
{
    const float32x4_t lo = vdupq_n_f32(PQC__EXP_LO);
    float32x4_t n, r, z, y;
    int32x4_t ni;
    x = vbslq_f32(vcgtq_f32(x, lo), x, lo); /* !(x > lo): lo, NaN too */
    n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(PQC__LOG2E)));
    r = vfmaq_f32(x, n, vdupq_n_f32(-PQC__LN2_HI));
    r = vfmaq_f32(r, n, vdupq_n_f32(-PQC__LN2_LO));
    z = vmulq_f32(r, r);
    y = vdupq_n_f32(PQC__EP0);
    y = vfmaq_f32(vdupq_n_f32(PQC__EP1), y, r);
    y = vfmaq_f32(vdupq_n_f32(PQC__EP2), y, r);
    y = vfmaq_f32(vdupq_n_f32(PQC__EP3), y, r);
    y = vfmaq_f32(vdupq_n_f32(PQC__EP4), y, r);
    y = vfmaq_f32(vdupq_n_f32(PQC__EP5), y, r);
    y = vfmaq_f32(r, y, z);
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    ni = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(ni));
}

static float pqc__expsum_neon(const float *s, size_t n, float mx, float scale, float *e)
{
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    const float32x4_t vm = vdupq_n_f32(mx), vs = vdupq_n_f32(scale);
    float lanes[16], z = 0.0f;
    size_t t = 0;
    int l;
    for (; t + 16 <= n; t += 16) {
        float32x4_t v0 = pqc__exp_neon(vmulq_f32(vsubq_f32(vld1q_f32(s + t), vm), vs));
        float32x4_t v1 = pqc__exp_neon(vmulq_f32(vsubq_f32(vld1q_f32(s + t + 4), vm), vs));
        float32x4_t v2 = pqc__exp_neon(vmulq_f32(vsubq_f32(vld1q_f32(s + t + 8), vm), vs));
        float32x4_t v3 = pqc__exp_neon(vmulq_f32(vsubq_f32(vld1q_f32(s + t + 12), vm), vs));
        vst1q_f32(e + t, v0);
        vst1q_f32(e + t + 4, v1);
        vst1q_f32(e + t + 8, v2);
        vst1q_f32(e + t + 12, v3);
        a0 = vaddq_f32(a0, v0);
        a1 = vaddq_f32(a1, v1);
        a2 = vaddq_f32(a2, v2);
        a3 = vaddq_f32(a3, v3);
    }
    vst1q_f32(lanes, a0);
    vst1q_f32(lanes + 4, a1);
    vst1q_f32(lanes + 8, a2);
    vst1q_f32(lanes + 12, a3);
    for (; t < n; t++) {
        e[t] = pqc__expf((s[t] - mx) * scale);
        lanes[t & 15] += e[t];
    }
    for (l = 0; l < 16; l++) z += lanes[l];
    return z;
}

static void pqc__axpy_neon(const float *e, size_t n, float w, float *acc)
{
    size_t t = 0;
    const float32x4_t vw = vdupq_n_f32(w);
    for (; t + 8 <= n; t += 8) {
        vst1q_f32(acc + t, vfmaq_f32(vld1q_f32(acc + t), vld1q_f32(e + t), vw));
        vst1q_f32(acc + t + 4, vfmaq_f32(vld1q_f32(acc + t + 4), vld1q_f32(e + t + 4), vw));
    }
    for (; t < n; t++) acc[t] = fmaf(e[t], w, acc[t]);
}

/* as pqc__scan_heads4_avx2: four heads a vector, four tokens a step, transposed; prod:
   products from 1 for the sums from 0 (pqc__scan_products_neon), a constant where called */
#define PQC__OP4N(prod, a, x) ((prod) ? vmulq_f32(a, x) : vaddq_f32(a, x))
static inline void pqc__scan_heads4_neon(const pqc_codes *cd, const float *lut, int ksub, int g, const int prod,
                                         size_t t0, size_t n, float *out, size_t ostride, float *mx)
{
    size_t t, h0, gs = (size_t)g, nv = n & ~(size_t)3;
    int j, m = cd->m;
    for (h0 = 0; h0 + 4 <= gs; h0 += 4) {
        float32x4_t x0 = vdupq_n_f32(-INFINITY), x1 = x0, x2 = x0, x3 = x0;
        float *o = out + h0 * ostride, lanes[16];
        for (t = 0; t < nv; t += 4) {
            float32x4_t a0 = vdupq_n_f32(prod ? 1.0f : 0.0f), a1 = a0, a2 = a0, a3 = a0, r0, r1, r2, r3;
            float32x4x2_t p01, p23;
            for (j = 0; j < m; j++) {
                const unsigned char *c = cd->data + (size_t)j * cd->col_stride + t0 + t;
                const float *l = lut + (size_t)j * (size_t)ksub * gs + h0;
                a0 = PQC__OP4N(prod, a0, vld1q_f32(l + (size_t)c[0] * gs));
                a1 = PQC__OP4N(prod, a1, vld1q_f32(l + (size_t)c[1] * gs));
                a2 = PQC__OP4N(prod, a2, vld1q_f32(l + (size_t)c[2] * gs));
                a3 = PQC__OP4N(prod, a3, vld1q_f32(l + (size_t)c[3] * gs));
            }
            p01 = vtrnq_f32(a0, a1);
            p23 = vtrnq_f32(a2, a3);
            r0 = vcombine_f32(vget_low_f32(p01.val[0]), vget_low_f32(p23.val[0]));
            r1 = vcombine_f32(vget_low_f32(p01.val[1]), vget_low_f32(p23.val[1]));
            r2 = vcombine_f32(vget_high_f32(p01.val[0]), vget_high_f32(p23.val[0]));
            r3 = vcombine_f32(vget_high_f32(p01.val[1]), vget_high_f32(p23.val[1]));
            vst1q_f32(o + t, r0);
            vst1q_f32(o + ostride + t, r1);
            vst1q_f32(o + 2 * ostride + t, r2);
            vst1q_f32(o + 3 * ostride + t, r3);
            x0 = vbslq_f32(vcgtq_f32(r0, x0), r0, x0);
            x1 = vbslq_f32(vcgtq_f32(r1, x1), r1, x1);
            x2 = vbslq_f32(vcgtq_f32(r2, x2), r2, x2);
            x3 = vbslq_f32(vcgtq_f32(r3, x3), r3, x3);
        }
        vst1q_f32(lanes, x0);
        vst1q_f32(lanes + 4, x1);
        vst1q_f32(lanes + 8, x2);
        vst1q_f32(lanes + 12, x3);
        pqc__scan_heads_end(cd, lut, ksub, g, prod, lanes, g, t0, nv, nv, out, ostride, mx + h0);
    }
    pqc__scan_heads_end(cd, lut, ksub, g, prod, NULL, (int)h0, t0, nv, n, out, ostride, mx);
}
#undef PQC__OP4N

static void pqc__scan_heads_neon(const pqc_codes *cd, const float *lut, int ksub, int g, size_t t0, size_t n,
                                 float *out, size_t ostride, float *mx)
{
    if (cd->bits != 8) pqc__scan_heads_scalar(cd, lut, ksub, g, t0, n, out, ostride, mx);
    else pqc__scan_heads4_neon(cd, lut, ksub, g, 0, t0, n, out, ostride, mx);
}

static float pqc__lanesum_neon(const float *x, size_t n)
{
    float32x4_t a = vdupq_n_f32(0.0f), b = a, c = a, d = a;
    float lanes[16];
    size_t t = 0;
    for (; t + 16 <= n; t += 16) {
        a = vaddq_f32(a, vld1q_f32(x + t));
        b = vaddq_f32(b, vld1q_f32(x + t + 4));
        c = vaddq_f32(c, vld1q_f32(x + t + 8));
        d = vaddq_f32(d, vld1q_f32(x + t + 12));
    }
    vst1q_f32(lanes, a);
    vst1q_f32(lanes + 4, b);
    vst1q_f32(lanes + 8, c);
    vst1q_f32(lanes + 12, d);
    return pqc__lanes_end(lanes, x, t, n);
}

static void pqc__scan_products_neon(const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n, float *out,
                                    size_t ostride, float *z)
{
    int h;
    for (h = 0; h < 4; h++) z[h] = -INFINITY;
    pqc__scan_heads4_neon(cd, el, ksub, 4, 1, t0, n, out, ostride, z);
    for (h = 0; h < 4; h++) z[h] = pqc__lanesum_neon(out + (size_t)h * ostride, n);
}


static void pqc__combine_neon(const float *e, size_t estride, int g, size_t n, const float *w, float *out)
{
    size_t t = 0;
    int h;
    for (; t + 8 <= n; t += 8) {
        float32x4_t a = vdupq_n_f32(0.0f), b = a;
        for (h = 0; h < g; h++) {
            const float32x4_t vw = vdupq_n_f32(w[h]);
            a = vfmaq_f32(a, vld1q_f32(e + (size_t)h * estride + t), vw);
            b = vfmaq_f32(b, vld1q_f32(e + (size_t)h * estride + t + 4), vw);
        }
        vst1q_f32(out + t, a);
        vst1q_f32(out + t + 4, b);
    }
    if (t < n) pqc__combine_scalar(e + t, estride, g, n - t, w, out + t);
}

static void pqc__halfrow_neon(const void *src, pqc_dtype t, size_t n, float *dst)
{
    const unsigned char *p = (const unsigned char *)src;
    size_t i = 0;
    if (t == PQC_F16)
        for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(const void *)(p + 2 * i)))));
    else
        for (; i + 4 <= n; i += 4)
            vst1q_u32((uint32_t *)(void *)(dst + i), vshll_n_u16(vld1_u16((const uint16_t *)(const void *)(p + 2 * i)), 16));
    if (i < n) pqc__halfrow_scalar(p + 2 * i, t, n - i, dst + i);
}

static void pqc__rowpair_neon(const void *k, const void *v, pqc_dtype t, size_t d, float *ko, float *vo, int stream)
{
    (void)stream;
    pqc__rowpair_by(pqc__halfrow_neon, k, v, t, d, ko, vo);
}

/* Four values a step: fp16 by the conversion instruction (round to nearest even under
   the default FPCR, as the scalar one), bf16 by the scalar one's integer rounding; four
   values holding a NaN go through the scalar one. */
static void pqc__narrow_neon(const float *src, pqc_dtype t, size_t n, void *dst)
{
    unsigned char *p = (unsigned char *)dst;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(src + i);
        if (vminvq_u32(vceqq_f32(v, v)) == 0) {
            pqc__narrow_scalar(src + i, t, 4, p + 2 * i);
        } else if (t == PQC_F16) {
            vst1_u16((uint16_t *)(void *)(p + 2 * i), vreinterpret_u16_f16(vcvt_f16_f32(v)));
        } else {
            uint32x4_t u = vreinterpretq_u32_f32(v);
            u = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fffu), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1u))));
            vst1_u16((uint16_t *)(void *)(p + 2 * i), vshrn_n_u32(u, 16));
        }
    }
    if (i < n) pqc__narrow_scalar(src + i, t, n - i, p + 2 * i);
}

static int pqc__within_neon(const float *x, size_t n, float limit)
{
    const float32x4_t lim = vdupq_n_f32(limit);
    uint32x4_t ok = vdupq_n_u32(0xffffffffu);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32x4_t a = vcleq_f32(vabsq_f32(vld1q_f32(x + i)), lim), b = vcleq_f32(vabsq_f32(vld1q_f32(x + i + 4)), lim);
        uint32x4_t c = vcleq_f32(vabsq_f32(vld1q_f32(x + i + 8)), lim), d = vcleq_f32(vabsq_f32(vld1q_f32(x + i + 12)), lim);
        ok = vandq_u32(ok, vandq_u32(vandq_u32(a, b), vandq_u32(c, d)));
    }
    if (vminvq_u32(ok) == 0) return 0;
    return pqc__within(x + i, n - i, limit);
}

/* acc[r] + v_r[0] + v_r[1] + v_r[2] + v_r[3] for the four rows r, each row's values added
   in lane order, the rows side by side (a 4 x 4 transpose, then four vector adds) */
static inline float32x4_t pqc__lanesum4x4_neon(float32x4_t acc, float32x4_t v0, float32x4_t v1, float32x4_t v2,
                                               float32x4_t v3)
{
    float32x4x2_t a = vtrnq_f32(v0, v1), b = vtrnq_f32(v2, v3);
    acc = vaddq_f32(acc, vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0])));
    acc = vaddq_f32(acc, vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1])));
    acc = vaddq_f32(acc, vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0])));
    return vaddq_f32(acc, vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1])));
}

/* Four rows side by side where d is a multiple of 16 (sixteen chains, lane e % 16 of each
   row, the rows' lane sums added in order in one register), then one row at a time. */
static void pqc__rowdots_neon(const float *q, const float *rows, size_t n, size_t stride, int d, float *out)
{
    size_t i = 0;
    int e, l, r;
    if (d % 16 == 0)
        for (; i + 4 <= n; i += 4) {
            float32x4_t a[4][4], acc = vdupq_n_f32(0.0f);
            for (r = 0; r < 4; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = acc;
            for (e = 0; e < d; e += 16)
                for (r = 0; r < 4; r++) {
                    const float *rr = rows + (i + (size_t)r) * stride + e;
                    a[r][0] = vfmaq_f32(a[r][0], vld1q_f32(q + e), vld1q_f32(rr));
                    a[r][1] = vfmaq_f32(a[r][1], vld1q_f32(q + e + 4), vld1q_f32(rr + 4));
                    a[r][2] = vfmaq_f32(a[r][2], vld1q_f32(q + e + 8), vld1q_f32(rr + 8));
                    a[r][3] = vfmaq_f32(a[r][3], vld1q_f32(q + e + 12), vld1q_f32(rr + 12));
                }
            for (l = 0; l < 4; l++) acc = pqc__lanesum4x4_neon(acc, a[0][l], a[1][l], a[2][l], a[3][l]);
            vst1q_f32(out + i, acc);
        }
    for (; i < n; i++) {
        const float *r = rows + i * stride;
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
        float lanes[16], acc = 0.0f;
        for (e = 0; e + 16 <= d; e += 16) {
            a0 = vfmaq_f32(a0, vld1q_f32(q + e), vld1q_f32(r + e));
            a1 = vfmaq_f32(a1, vld1q_f32(q + e + 4), vld1q_f32(r + e + 4));
            a2 = vfmaq_f32(a2, vld1q_f32(q + e + 8), vld1q_f32(r + e + 8));
            a3 = vfmaq_f32(a3, vld1q_f32(q + e + 12), vld1q_f32(r + e + 12));
        }
        vst1q_f32(lanes, a0);
        vst1q_f32(lanes + 4, a1);
        vst1q_f32(lanes + 8, a2);
        vst1q_f32(lanes + 12, a3);
        for (; e < d; e++) lanes[e & 15] = fmaf(q[e], r[e], lanes[e & 15]);
        for (l = 0; l < 16; l++) acc += lanes[l];
        out[i] = acc;
    }
}

static size_t pqc__keydots_neon(const float *q, const unsigned char *rows, size_t stride, pqc_dtype t, size_t n,
                                 int d, float limit, float *row, float *out)
{
    static const pqc__keydots_level lv = {pqc__halfrow_neon, pqc__within_neon, pqc__rowdots_neon};
    return pqc__keydots_copy(&lv, q, rows, stride, t, n, d, limit, row, out);
}
static size_t pqc__gatherdots_neon(const float *q, int g, const unsigned char *base, size_t stride, pqc_dtype t,
                                   const uint32_t *idx, size_t n, int d, int check, float limit, float *row, float *out,
                                   size_t ostride)
{
    static const pqc__keydots_level lv = {pqc__halfrow_neon, pqc__within_neon, pqc__rowdots_neon};
    return pqc__gatherdots_copy(&lv, q, g, base, stride, t, idx, n, d, check, limit, row, out, ostride);
}

/* the scalar chains (fmaf is one instruction on AArch64), four points side by side */
static void pqc__sqnorms_neon(const float *x, size_t n, int d, float *out)
{
    size_t i = 0;
    int e, p;
    for (; i + 4 <= n; i += 4) {
        const float *xi = x + i * (size_t)d;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (e = 0; e < d; e++)
            for (p = 0; p < 4; p++) a[p] = fmaf(xi[(size_t)p * d + e], xi[(size_t)p * d + e], a[p]);
        for (p = 0; p < 4; p++) out[i + p] = a[p];
    }
    pqc__sqnorms_scalar(x + i * (size_t)d, n - i, d, out + i);
}

static void pqc__accum_neon(const float *x, size_t n, int d, const uint16_t *idx, double *sum)
{
    size_t i;
    int e;
    for (i = 0; i < n; i++) {
        const float *xi = x + i * (size_t)d;
        double *sp = sum + (size_t)idx[i] * d;
        for (e = 0; e + 4 <= d; e += 4) {
            float32x4_t v = vld1q_f32(xi + e);
            vst1q_f64(sp + e, vaddq_f64(vld1q_f64(sp + e), vcvt_f64_f32(vget_low_f32(v))));
            vst1q_f64(sp + e + 2, vaddq_f64(vld1q_f64(sp + e + 2), vcvt_high_f64_f32(v)));
        }
        for (; e < d; e++) sp[e] += xi[e];
    }
}

/* row m: the bytes of the lanes set in the 4-lane mask m, lowest first */
static const unsigned char pqc__lanes4_neon[16][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0},
    {8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0},
    {4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0},
    {12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0},
    {4, 5, 6, 7, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15, 0, 0, 0, 0},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0},
    {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}};
#define PQC__POP4(m) ((size_t)(0x4332322132212110ull >> (4 * (m)) & 15u)) /* bits set in m < 16 */

/* The select's compaction pass (pqc__bracket_scalar, section 5): the scores above hi
   counted, those with lo <= s <= hi appended to cs in index order; 4 lanes packed at a
   time by a byte shuffle chosen by their mask (cs's 16 elements of slack take the full
   stores) */
static void pqc__bracket_neon(const float *s, size_t n, float lo, float hi, size_t *na, float *cs, size_t *nc)
{
    static const uint32_t bitv[4] = {1, 2, 4, 8};
    size_t i = 0, a = 0, c = 0;
    const float32x4_t vlo = vdupq_n_f32(lo), vhi = vdupq_n_f32(hi);
    const uint32x4_t bits = vld1q_u32(bitv);
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vld1q_f32(s + i);
        uint32x4_t ma = vcgtq_f32(v, vhi), mc = vandq_u32(vcgeq_f32(v, vlo), vcleq_f32(v, vhi));
        unsigned ba = vaddvq_u32(vandq_u32(ma, bits)), bc = vaddvq_u32(vandq_u32(mc, bits));
        a += PQC__POP4(ba);
        if (bc) {
            const uint8x16_t sh = vld1q_u8(pqc__lanes4_neon[bc]);
            vst1q_f32(cs + c, vreinterpretq_f32_u8(vqtbl1q_u8(vreinterpretq_u8_f32(v), sh)));
            c += PQC__POP4(bc);
        }
    }
    *na = a;
    *nc = c;
    pqc__bracket_from(s, i, n, lo, hi, na, cs, nc);
}

/* The top-k's first pass (pqc__topk_keys_scalar, section 5), four scores a step:
   pqc__fkey's map, unsigned extremes */
static size_t pqc__topk_keys_neon(const float *s, size_t n, uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    uint32x4_t vlo = vdupq_n_u32(*lo), vhi = vdupq_n_u32(*hi);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32x4_t u = vld1q_u32((const uint32_t *)(const void *)(s + i)), key;
        u = vbicq_u32(u, vceqq_u32(vshlq_n_u32(u, 1), vdupq_n_u32(0)));
        key = veorq_u32(u, vorrq_u32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_u32(u), 31)), sign));
        vst1q_u32(keys + i, key);
        vlo = vminq_u32(vlo, key);
        vhi = vmaxq_u32(vhi, key);
    }
    *lo = vminvq_u32(vlo);
    *hi = vmaxvq_u32(vhi);
    return i;
}

/* The radix select's compaction (pqc__topk_bin_scalar, section 5), four keys a step:
   the chosen ones packed by a byte shuffle and stored whole (at or before the step's own
   keys, already read) */
static size_t pqc__topk_bin_neon(uint32_t *cand, size_t n, uint32_t base, int shift, uint32_t b, size_t *nc)
{
    static const uint32_t bitv[4] = {1, 2, 4, 8};
    const uint32x4_t bits = vld1q_u32(bitv), vbase = vdupq_n_u32(base), vb = vdupq_n_u32(b);
    const int32x4_t sh = vdupq_n_s32(-shift);
    size_t i = 0, c = *nc;
    for (; i + 4 <= n; i += 4) {
        const uint32x4_t k = vld1q_u32(cand + i);
        const unsigned m = vaddvq_u32(vandq_u32(vceqq_u32(vshlq_u32(vsubq_u32(k, vbase), sh), vb), bits));
        vst1q_u32(cand + c, vreinterpretq_u32_u8(vqtbl1q_u8(vreinterpretq_u8_u32(k), vld1q_u8(pqc__lanes4_neon[m]))));
        c += PQC__POP4(m);
    }
    *nc = c;
    return i;
}

/* The top-k's last pass (pqc__take_scalar, section 5), four scores a step, compared as
   floats with thr's value (pqc__key_value); the chosen lanes packed by a byte shuffle and
   stored whole while 4 more entries fit in idx, the last ones a lane at a time */
static size_t pqc__take_neon(const float *s, size_t n, uint32_t thr, size_t *need, uint32_t *idx, float *outs,
                             size_t cap, size_t *taken)
{
    static const uint32_t bitv[4] = {1, 2, 4, 8}, lanev[4] = {0, 1, 2, 3};
    const uint32x4_t bits = vld1q_u32(bitv);
    const float32x4_t t = vdupq_n_f32(pqc__key_value(thr));
    uint32x4_t iv = vld1q_u32(lanev);
    size_t i = 0, got = *taken, left = *need, l;
    for (; i + 4 <= n; i += 4, iv = vaddq_u32(iv, vdupq_n_u32(4))) {
        const float32x4_t v = vld1q_f32(s + i);
        unsigned eq = vaddvq_u32(vandq_u32(vceqq_f32(v, t), bits)), m = vaddvq_u32(vandq_u32(vcgtq_f32(v, t), bits));
        for (; eq && left > 0; left--, eq &= eq - 1) m |= eq & (0u - eq);
        if (m) {
            const uint8x16_t sh = vld1q_u8(pqc__lanes4_neon[m]);
            const size_t cnt = PQC__POP4(m);
            const uint32x4_t pi = vreinterpretq_u32_u8(vqtbl1q_u8(vreinterpretq_u8_u32(iv), sh));
            const float32x4_t pv = vreinterpretq_f32_u8(vqtbl1q_u8(vreinterpretq_u8_f32(v), sh));
            if (got + 4 <= cap) {
                vst1q_u32(idx + got, pi);
                if (outs) vst1q_f32(outs + got, pv);
            } else {
                uint32_t ib[4];
                float vb[4];
                vst1q_u32(ib, pi);
                vst1q_f32(vb, pv);
                for (l = 0; l < cnt; l++) {
                    idx[got + l] = ib[l];
                    if (outs) outs[got + l] = vb[l];
                }
            }
            got += cnt;
        }
    }
    *taken = got;
    *need = left;
    return i;
}
#endif /* PQC__NEON */

/* ----- dispatch -----
   PQC__DISPATCH calls the level's kernel; PQC__DISPATCH_TO stores its result in r.
   After an AVX2 or AVX-512 kernel the dispatch zeroes the upper halves of the vector
   registers (vzeroupper). Left set, they cost Intel cores a penalty on every SSE
   instruction that follows (the library's own scalar code, libm, the engine's code) until
   something clears them: on one Xeon, training at 128K went from 0.2 s to 3 s through the
   libm calls of its norms. The compilers insert the instruction at most of a kernel's
   returns but not all (not after a helper that takes vector arguments, nor below -O2), so
   it is issued here, once per kernel call, where it costs a cycle. */
#if PQC__X86
#define PQC__AVX_EXIT() __asm__ __volatile__("vzeroupper")
#define PQC__DISPATCH(simd, name, args)                                                                                \
    do {                                                                                                               \
        if ((simd) == PQC_SIMD_AVX512) {                                                                               \
            name##_avx512 args;                                                                                        \
            PQC__AVX_EXIT();                                                                                           \
        } else if ((simd) == PQC_SIMD_AVX2) {                                                                          \
            name##_avx2 args;                                                                                          \
            PQC__AVX_EXIT();                                                                                           \
        } else {                                                                                                       \
            name##_scalar args;                                                                                        \
        }                                                                                                              \
    } while (0)
#define PQC__DISPATCH_TO(r, simd, name, args)                                                                          \
    do {                                                                                                               \
        if ((simd) == PQC_SIMD_AVX512) {                                                                               \
            (r) = name##_avx512 args;                                                                                  \
            PQC__AVX_EXIT();                                                                                           \
        } else if ((simd) == PQC_SIMD_AVX2) {                                                                          \
            (r) = name##_avx2 args;                                                                                    \
            PQC__AVX_EXIT();                                                                                           \
        } else {                                                                                                       \
            (r) = name##_scalar args;                                                                                  \
        }                                                                                                              \
    } while (0)
#elif PQC__NEON
#define PQC__DISPATCH(simd, name, args)                                                                                \
    do {                                                                                                               \
        if ((simd) == PQC_SIMD_NEON) name##_neon args;                                                                  \
        else name##_scalar args;                                                                                       \
    } while (0)
#define PQC__DISPATCH_TO(r, simd, name, args) ((r) = (simd) == PQC_SIMD_NEON ? name##_neon args : name##_scalar args)
#else
#define PQC__DISPATCH(simd, name, args) ((void)(simd), name##_scalar args)
#define PQC__DISPATCH_TO(r, simd, name, args) ((void)(simd), (r) = name##_scalar args)
#endif

static void pqc__k_assign(pqc_simd s, const float *x, size_t n, int d, const float *ct, const float *cn, int kpad, int k,
                          uint16_t *idx, float *val)
{
    PQC__DISPATCH(s, pqc__assign, (x, n, d, ct, cn, kpad, k, idx, val));
}
/* The SIMD levels take x's points in whole blocks of xt; the last block's points, when it
   is not full, run in lanes too, over copies of their norms and distances padded to a
   block (each lane computes alone, so a point's value is the same in any block). Left to
   the scalar loop, with a libm call per fused multiply-add, those few points were half
   the time of k-means on a few hundred points. */
static void pqc__k_seedmin(pqc_simd s, const float *x, const float *xt, size_t n, int d, const float *cs,
                           const float *cg, const float *cn, int nb, const float *xn, float *dist)
{
    size_t nw = n / PQC__SEED_BLOCK * PQC__SEED_BLOCK, l;
    float xp[PQC__SEED_BLOCK], dp[PQC__SEED_BLOCK];
    if (s == PQC_SIMD_SCALAR || nw == n) {
        PQC__DISPATCH(s, pqc__seedmin, (x, xt, n, d, cs, cg, cn, nb, xn, dist));
        return;
    }
    if (nw) PQC__DISPATCH(s, pqc__seedmin, (x, xt, nw, d, cs, cg, cn, nb, xn, dist));
    for (l = 0; l < PQC__SEED_BLOCK; l++) {
        xp[l] = nw + l < n ? xn[nw + l] : 0.0f;
        dp[l] = nw + l < n ? dist[nw + l] : 0.0f;
    }
    PQC__DISPATCH(s, pqc__seedmin, (x + nw * (size_t)d, xt + nw * (size_t)d, PQC__SEED_BLOCK, d, cs, cg, cn, nb, xp, dp));
    for (l = 0; nw + l < n; l++) dist[nw + l] = dp[l];
}
static void pqc__k_accum(pqc_simd s, const float *x, size_t n, int d, const uint16_t *idx, double *sum)
{
    PQC__DISPATCH(s, pqc__accum, (x, n, d, idx, sum));
}
static void pqc__k_sqnorms(pqc_simd s, const float *x, size_t n, int d, float *out)
{
    PQC__DISPATCH(s, pqc__sqnorms, (x, n, d, out));
}
static void pqc__k_dots(pqc_simd s, const float *x, int d, const float *ct, int kpad, int k, float *dots)
{
    PQC__DISPATCH(s, pqc__dots, (x, d, ct, kpad, k, dots));
}
/* pqc__k_dots for g queries, rows x + h xs, outputs dots + h ds (AVX-512: four at once) */
static void pqc__k_dots_heads(pqc_simd s, const float *x, size_t xs, int g, int d, const float *ct, int kpad, int k,
                              float *dots, size_t ds)
{
    int h = 0;
#if PQC__X86
    if (s == PQC_SIMD_AVX512 && kpad % 16 == 0) {
        for (; h + 4 <= g; h += 4) pqc__dots4_avx512(x + (size_t)h * xs, xs, d, ct, kpad, k, dots + (size_t)h * ds, ds);
        PQC__AVX_EXIT();
    }
#endif
    for (; h < g; h++) pqc__k_dots(s, x + (size_t)h * xs, d, ct, kpad, k, dots + (size_t)h * ds);
}
static void pqc__k_scan(pqc_simd s, const pqc_codes *cd, const float *lut, int ksub, size_t t0, size_t n, float *out)
{
    PQC__DISPATCH(s, pqc__scan, (cd, lut, ksub, t0, n, out));
}
static float pqc__k_max(pqc_simd s, const float *x, size_t n)
{
    float r;
    PQC__DISPATCH_TO(r, s, pqc__max, (x, n));
    return r;
}
static float pqc__k_expsum(pqc_simd s, const float *x, size_t n, float mx, float scale, float *e)
{
    float r;
    PQC__DISPATCH_TO(r, s, pqc__expsum, (x, n, mx, scale, e));
    return r;
}
static void pqc__k_axpy(pqc_simd s, const float *e, size_t n, float w, float *acc)
{
    PQC__DISPATCH(s, pqc__axpy, (e, n, w, acc));
}
static void pqc__k_scan_heads(pqc_simd s, const pqc_codes *cd, const float *lut, int ksub, int g, size_t t0, size_t n,
                              float *out, size_t ostride, float *mx)
{
    PQC__DISPATCH(s, pqc__scan_heads, (cd, lut, ksub, g, t0, n, out, ostride, mx));
}
static void pqc__k_scan_products(pqc_simd s, const pqc_codes *cd, const float *el, int ksub, size_t t0, size_t n,
                                 float *out, size_t ostride, float *z)
{
    PQC__DISPATCH(s, pqc__scan_products, (cd, el, ksub, t0, n, out, ostride, z));
}

static void pqc__k_combine(pqc_simd s, const float *e, size_t estride, int g, size_t n, const float *w, float *out)
{
    PQC__DISPATCH(s, pqc__combine, (e, estride, g, n, w, out));
}
static void pqc__k_halfrow(pqc_simd s, const void *src, pqc_dtype t, size_t n, float *dst)
{
    PQC__DISPATCH(s, pqc__halfrow, (src, t, n, dst));
}
/* n stored values of type t as fp32 (fp32 copied, fp16 and bf16 by the level's conversion) */
static void pqc__k_to_f32(pqc_simd s, const void *src, pqc_dtype t, size_t n, float *dst)
{
    if (t == PQC_F32) memcpy(dst, src, n * sizeof(float));
    else pqc__k_halfrow(s, src, t, n, dst);
}
static void pqc__k_rowpair(pqc_simd s, const void *k, const void *v, pqc_dtype t, size_t d, float *ko, float *vo,
                           int stream)
{
    PQC__DISPATCH(s, pqc__rowpair, (k, v, t, d, ko, vo, stream));
}
/* after non-temporal stores: ordered before whatever this thread stores next (the pool's
   word that the work is done) */
static void pqc__k_stream_fence(pqc_simd s)
{
#if PQC__X86
    if (s == PQC_SIMD_AVX512 || s == PQC_SIMD_AVX2) _mm_sfence();
#else
    (void)s;
#endif
}
/* n fp32 values stored as t (fp32 copied, fp16 and bf16 by the level's conversion) */
static void pqc__k_narrow(pqc_simd s, const float *src, pqc_dtype t, size_t n, void *dst)
{
    if (t == PQC_F32) memcpy(dst, src, n * sizeof(float));
    else PQC__DISPATCH(s, pqc__narrow, (src, t, n, dst));
}
static int pqc__k_within(pqc_simd s, const float *x, size_t n, float limit)
{
    int r;
    PQC__DISPATCH_TO(r, s, pqc__within, (x, n, limit));
    return r;
}
static void pqc__k_rowdots(pqc_simd s, const float *q, const float *rows, size_t n, size_t stride, int d, float *out)
{
    PQC__DISPATCH(s, pqc__rowdots, (q, rows, n, stride, d, out));
}

/* Every value of m finite and within limit, row by row through the SIMD conversion and
   check (a prefill of 128K fp16 rows of 8 heads took 1.26 s in the scalar loops); fp32
   rows on float boundaries are checked where they are (through a copy, the check of 128K
   rows of 128 cost about 3 ms more of a 120 ms training start at m = 4 b = 8). */
static pqc_result pqc__check_range(const struct pqc_runtime *rt, const pqc_matrix *m, float *tmp, float limit,
                                   const char *what)
{
    size_t r;
    pqc_simd simd = pqc__simd(rt);
    int direct = m->dtype == PQC_F32 && !((uintptr_t)m->data % sizeof(float)) && !(pqc__stride(m) % sizeof(float));
    for (r = 0; r < m->rows; r++) { /* (rows off float boundaries: copied first) */
        const float *x = tmp;
        if (direct) x = (const float *)pqc__row(m, r);
        else pqc__k_to_f32(simd, pqc__row(m, r), m->dtype, m->cols, tmp);
        if (pqc__k_within(simd, x, m->cols, limit)) continue;
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "%s: row %zu holds NaN, Inf or a magnitude above %g", what, r,
                         (double)limit);
    }
    return PQC_SUCCESS;
}
static pqc_result pqc__check_finite(const struct pqc_runtime *rt, const pqc_matrix *m, float *tmp, const char *what)
{
    return pqc__check_range(rt, m, tmp, PQC__KEY_LIMIT, what);
}
static size_t pqc__k_keydots(pqc_simd s, const float *q, const unsigned char *rows, size_t stride, pqc_dtype t,
                              size_t n, int d, float limit, float *row, float *out)
{
    size_t r;
    PQC__DISPATCH_TO(r, s, pqc__keydots, (q, rows, stride, t, n, d, limit, row, out));
    return r;
}
static size_t pqc__k_gatherdots(pqc_simd s, const float *q, int g, const unsigned char *base, size_t stride,
                                pqc_dtype t, const uint32_t *idx, size_t n, int d, int check, float limit, float *row,
                                float *out, size_t ostride)
{
    size_t r;
    PQC__DISPATCH_TO(r, s, pqc__gatherdots, (q, g, base, stride, t, idx, n, d, check, limit, row, out, ostride));
    return r;
}

/* ---------------------------------------------------------------------------------------
   4. Scratch memory
   ------------------------------------------------------------------------------------- */

PQCDEF void pqc_scratch_free(pqc_scratch *s)
{
    if (!s) return;
    pqc__free(&s->alloc, s->buf);
    s->buf = NULL;
    s->size = 0;
}

/* Returns scratch of at least n bytes (64-byte aligned carve-outs are the caller's job),
   either from s or freshly allocated into *tmp (which the caller frees). */
static void *pqc__scratch_get(pqc_scratch *s, const pqc_allocator *a, size_t n, void **tmp)
{
    *tmp = NULL;
    if (s) {
        if (s->size < n) {
            void *p;
            if (!s->buf && !s->alloc.alloc && a) s->alloc = *a;
            p = pqc__alloc(&s->alloc, n + n / 4);
            if (!p) return NULL;
            pqc__free(&s->alloc, s->buf);
            s->buf = p;
            s->size = n + n / 4;
        }
        return s->buf;
    }
    *tmp = pqc__alloc(a, n);
    return *tmp;
}

#define PQC__ALIGN_UP(x) (((x) + 63u) & ~(size_t)63u)

/* n bytes of working memory for one call: inside the caller's stack buffer (cap bytes;
   from its first 64-byte line) where they fit, so that a call on a few rows (a decode
   step's) allocates nothing, else allocated into *held, which the caller frees (NULL
   when the stack serves). NULL when that allocation fails. */
#define PQC__SMALL_BUF (4096 + 64)
static void *pqc__small_get(const pqc_allocator *a, unsigned char *stack, size_t cap, size_t n, void **held)
{
    size_t skip = (size_t)((64u - ((uintptr_t)stack & 63u)) & 63u);
    *held = NULL;
    if (n <= cap - skip) return stack + skip;
    return *held = pqc__alloc(a, n);
}

/* ---------------------------------------------------------------------------------------
   5. Top-k by radix select: histogram levels of at most 2048 bins over an
   order-preserving integer image of the scores find the k-th largest key exactly; one
   final pass then emits every index above it plus the lowest-index ties, in index order.
   Above 8K scores a sample first brackets the k-th score, and the levels run over the
   scores inside the bracket only.
   ------------------------------------------------------------------------------------- */

/* bin (of nb bins) holding the k-th largest, given counts; *above = count in higher bins */
static uint32_t pqc__hist_pick(const uint32_t *h, uint32_t nb, size_t k, size_t *above)
{
    size_t acc = 0;
    uint32_t b = nb;
    while (b > 0) {
        b--;
        if (acc + h[b] >= k) break;
        acc += h[b];
    }
    *above = acc;
    return b;
}

#if PQC__X86
/* nibble r of pqc__lanes8[m]: the r-th lane set in the 8-lane mask m, lowest first */
static const uint32_t pqc__lanes8[256] = {
    0x0u, 0x0u, 0x1u, 0x10u, 0x2u, 0x20u, 0x21u, 0x210u,
    0x3u, 0x30u, 0x31u, 0x310u, 0x32u, 0x320u, 0x321u, 0x3210u,
    0x4u, 0x40u, 0x41u, 0x410u, 0x42u, 0x420u, 0x421u, 0x4210u,
    0x43u, 0x430u, 0x431u, 0x4310u, 0x432u, 0x4320u, 0x4321u, 0x43210u,
    0x5u, 0x50u, 0x51u, 0x510u, 0x52u, 0x520u, 0x521u, 0x5210u,
    0x53u, 0x530u, 0x531u, 0x5310u, 0x532u, 0x5320u, 0x5321u, 0x53210u,
    0x54u, 0x540u, 0x541u, 0x5410u, 0x542u, 0x5420u, 0x5421u, 0x54210u,
    0x543u, 0x5430u, 0x5431u, 0x54310u, 0x5432u, 0x54320u, 0x54321u, 0x543210u,
    0x6u, 0x60u, 0x61u, 0x610u, 0x62u, 0x620u, 0x621u, 0x6210u,
    0x63u, 0x630u, 0x631u, 0x6310u, 0x632u, 0x6320u, 0x6321u, 0x63210u,
    0x64u, 0x640u, 0x641u, 0x6410u, 0x642u, 0x6420u, 0x6421u, 0x64210u,
    0x643u, 0x6430u, 0x6431u, 0x64310u, 0x6432u, 0x64320u, 0x64321u, 0x643210u,
    0x65u, 0x650u, 0x651u, 0x6510u, 0x652u, 0x6520u, 0x6521u, 0x65210u,
    0x653u, 0x6530u, 0x6531u, 0x65310u, 0x6532u, 0x65320u, 0x65321u, 0x653210u,
    0x654u, 0x6540u, 0x6541u, 0x65410u, 0x6542u, 0x65420u, 0x65421u, 0x654210u,
    0x6543u, 0x65430u, 0x65431u, 0x654310u, 0x65432u, 0x654320u, 0x654321u, 0x6543210u,
    0x7u, 0x70u, 0x71u, 0x710u, 0x72u, 0x720u, 0x721u, 0x7210u,
    0x73u, 0x730u, 0x731u, 0x7310u, 0x732u, 0x7320u, 0x7321u, 0x73210u,
    0x74u, 0x740u, 0x741u, 0x7410u, 0x742u, 0x7420u, 0x7421u, 0x74210u,
    0x743u, 0x7430u, 0x7431u, 0x74310u, 0x7432u, 0x74320u, 0x74321u, 0x743210u,
    0x75u, 0x750u, 0x751u, 0x7510u, 0x752u, 0x7520u, 0x7521u, 0x75210u,
    0x753u, 0x7530u, 0x7531u, 0x75310u, 0x7532u, 0x75320u, 0x75321u, 0x753210u,
    0x754u, 0x7540u, 0x7541u, 0x75410u, 0x7542u, 0x75420u, 0x75421u, 0x754210u,
    0x7543u, 0x75430u, 0x75431u, 0x754310u, 0x75432u, 0x754320u, 0x754321u, 0x7543210u,
    0x76u, 0x760u, 0x761u, 0x7610u, 0x762u, 0x7620u, 0x7621u, 0x76210u,
    0x763u, 0x7630u, 0x7631u, 0x76310u, 0x7632u, 0x76320u, 0x76321u, 0x763210u,
    0x764u, 0x7640u, 0x7641u, 0x76410u, 0x7642u, 0x76420u, 0x76421u, 0x764210u,
    0x7643u, 0x76430u, 0x76431u, 0x764310u, 0x76432u, 0x764320u, 0x764321u, 0x7643210u,
    0x765u, 0x7650u, 0x7651u, 0x76510u, 0x7652u, 0x76520u, 0x76521u, 0x765210u,
    0x7653u, 0x76530u, 0x76531u, 0x765310u, 0x76532u, 0x765320u, 0x765321u, 0x7653210u,
    0x7654u, 0x76540u, 0x76541u, 0x765410u, 0x76542u, 0x765420u, 0x765421u, 0x7654210u,
    0x76543u, 0x765430u, 0x765431u, 0x7654310u, 0x765432u, 0x7654320u, 0x7654321u, 0x76543210u};

/* the permutation that moves the lanes set in m (8 lanes) to the front */
PQC__AVX2 static inline __m256i pqc__front8_avx2(unsigned m)
{
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)pqc__lanes8[m]),
                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                            _mm256_set1_epi32(15));
}

/* pqc__topk_keys_scalar, eight scores a step: pqc__fkey's map (both zeros to +0's key;
   negatives every bit flipped, the rest the sign bit), unsigned extremes */
PQC__AVX2 static size_t pqc__topk_keys_avx2(const float *s, size_t n, uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u), zero = _mm256_setzero_si256();
    __m256i vlo = _mm256_set1_epi32((int)*lo), vhi = _mm256_set1_epi32((int)*hi);
    uint32_t l8[8], h8[8];
    size_t i = 0;
    int l;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(s + i)), key;
        u = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_slli_epi32(u, 1), zero), u);
        key = _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31), sign));
        _mm256_storeu_si256((__m256i *)(keys + i), key);
        vlo = _mm256_min_epu32(vlo, key);
        vhi = _mm256_max_epu32(vhi, key);
    }
    _mm256_storeu_si256((__m256i *)l8, vlo);
    _mm256_storeu_si256((__m256i *)h8, vhi);
    for (l = 0; l < 8; l++) {
        *lo = l8[l] < *lo ? l8[l] : *lo;
        *hi = h8[l] > *hi ? h8[l] : *hi;
    }
    return i;
}

/* pqc__topk_bin_scalar, eight keys a step: the chosen ones moved to the front by one
   permutation and stored whole (at or before the step's own keys, already read) */
PQC__AVX2 static size_t pqc__topk_bin_avx2(uint32_t *cand, size_t n, uint32_t base, int shift, uint32_t b, size_t *nc)
{
    const __m256i vbase = _mm256_set1_epi32((int)base), vb = _mm256_set1_epi32((int)b);
    const __m128i sh = _mm_cvtsi32_si128(shift);
    size_t i = 0, c = *nc;
    for (; i + 8 <= n; i += 8) {
        const __m256i k = _mm256_loadu_si256((const __m256i *)(cand + i));
        const __m256i eq = _mm256_cmpeq_epi32(_mm256_srl_epi32(_mm256_sub_epi32(k, vbase), sh), vb);
        const unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(eq));
        _mm256_storeu_si256((__m256i *)(cand + c), _mm256_permutevar8x32_epi32(k, pqc__front8_avx2(m)));
        c += (unsigned)__builtin_popcount(m);
    }
    *nc = c;
    return i;
}

/* as pqc__take_scalar, eight scores a step, compared as floats with thr's value (as
   pqc__take_avx512); the chosen lanes moved to the front and stored whole while 8 more
   entries fit in idx, the last ones under a mask of their count (a masked store in every
   step is slow on some AVX2 cores), with no branch on whether a step takes any */
PQC__AVX2 static size_t pqc__take_avx2(const float *s, size_t n, uint32_t thr, size_t *need, uint32_t *idx, float *outs,
                                       size_t cap, size_t *taken)
{
    const __m256 t = _mm256_set1_ps(pqc__key_value(thr));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    size_t i = 0, got = *taken, left = *need;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(s + i);
        unsigned eq = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)), cnt;
        __m256i p, at;
        for (; eq && left > 0; left--, eq &= eq - 1) m |= eq & (0u - eq);
        cnt = (unsigned)__builtin_popcount(m);
        p = pqc__front8_avx2(m);
        at = _mm256_permutevar8x32_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32((int)i)), p);
        if (got + 8 <= cap) {
            _mm256_storeu_si256((__m256i *)(idx + got), at);
            if (outs) _mm256_storeu_ps(outs + got, _mm256_permutevar8x32_ps(v, p));
        } else {
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), lane);
            _mm256_maskstore_epi32((int *)(idx + got), keep, at);
            if (outs) _mm256_maskstore_ps(outs + got, keep, _mm256_permutevar8x32_ps(v, p));
        }
        got += cnt;
    }
    *taken = got;
    *need = left;
    return i;
}

/* as the scalar pass, eight scores a step: the lanes in the bracket moved to the front by
   one permutation and stored whole */
PQC__AVX2 static void pqc__bracket_avx2(const float *s, size_t n, float lo, float hi, size_t *na, float *cs, size_t *nc)
{
    size_t i = 0, a = 0, c = 0;
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(s + i);
        __m256 gc = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, vhi, _CMP_LE_OQ));
        unsigned ba = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, vhi, _CMP_GT_OQ));
        unsigned bc = (unsigned)_mm256_movemask_ps(gc);
        _mm256_storeu_ps(cs + c, _mm256_permutevar8x32_ps(v, pqc__front8_avx2(bc)));
        a += (unsigned)__builtin_popcount(ba);
        c += (unsigned)__builtin_popcount(bc);
    }
    *na = a;
    *nc = c;
    pqc__bracket_from(s, i, n, lo, hi, na, cs, nc);
}

PQC__AVX512 static void pqc__bracket_avx512(const float *s, size_t n, float lo, float hi, size_t *na, float *cs,
                                            size_t *nc)
{
    size_t i = 0, a = 0, c = 0;
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    /* No branch on what a step holds: a test of whether any of the 16 falls in the
       bracket failed about one step in two at random, and the mispredictions made the pass
       2.5x slower; one on whether any reaches lo (7 steps in 8 at k = n/10) cost little */
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(s + i);
        const __mmask16 ml = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
        const __mmask16 ma = _mm512_cmp_ps_mask(v, vhi, _CMP_GT_OQ), mc = (__mmask16)(ml & ~ma);
        _mm512_storeu_ps(cs + c, _mm512_maskz_compress_ps(mc, v));
        a += (size_t)__builtin_popcount(ma);
        c += (size_t)__builtin_popcount(mc);
    }
    *na = a;
    *nc = c;
    pqc__bracket_from(s, i, n, lo, hi, na, cs, nc);
}
#endif

/* The keys of n scores into keys[], their extremes into *lo and *hi */
static void pqc__topk_keys(pqc_simd simd, const float *s, size_t n, uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    size_t i = 0;
    *lo = 0xffffffffu;
    *hi = 0;
    PQC__DISPATCH_TO(i, simd, pqc__topk_keys, (s, n, keys, lo, hi));
    for (; i < n; i++) {
        keys[i] = pqc__fkey(s[i]);
        *lo = keys[i] < *lo ? keys[i] : *lo;
        *hi = keys[i] > *hi ? keys[i] : *hi;
    }
}

/* The keys of cand[0..n) whose digit ((key - base) >> shift) is b, moved to the front in
   order; returns how many */
static size_t pqc__topk_bin(pqc_simd simd, uint32_t *cand, size_t n, uint32_t base, int shift, uint32_t b)
{
    size_t i = 0, nc = 0;
    PQC__DISPATCH_TO(i, simd, pqc__topk_bin, (cand, n, base, shift, b, &nc));
    for (; i < n; i++)
        if (((cand[i] - base) >> shift) == b) cand[nc++] = cand[i];
    return nc;
}

/* The k-th largest key of n scores (0 < k <= n) into *thr, and into *need how many keys
   equal to it the top k hold (the rest of the top k lie above it). scratch: n uint32. The
   key is found digit by digit over histograms of at most 2048 bins, the first digit taken
   over the keys' own range (scores of one search sit in a narrow range, which a fixed
   first digit of the key's top 11 bits put in a few bins: every count then waited on the
   one before it). */
static void pqc__topk_thresh(pqc_simd simd, const float *s, size_t n, size_t k, uint32_t *cand, uint32_t *thr,
                             size_t *need)
{
    uint32_t h[2048], lo, hi, base, b, nb;
    size_t i, nc = 0, above = 0, a2;
    int shift, ns;
    pqc__topk_keys(simd, s, n, cand, &lo, &hi);
    for (shift = 0; shift < 32 && ((hi - lo) >> shift) >= 2048u; shift++) {}
    base = lo;
    nb = ((hi - lo) >> shift) + 1u;
    memset(h, 0, nb * sizeof h[0]);
    for (i = 0; i < n; i++) h[(cand[i] - base) >> shift]++;
    b = pqc__hist_pick(h, nb, k, &above);
    /* the keys of that bin, then their lower digits */
    if (shift > 0) nc = pqc__topk_bin(simd, cand, n, base, shift, b);
    base += b << shift;
    while (shift > 0) { /* the keys in cand lie in [base, base + 2^shift) */
        ns = shift > 11 ? shift - 11 : 0;
        nb = 1u << (shift - ns);
        memset(h, 0, nb * sizeof h[0]);
        for (i = 0; i < nc; i++) h[(cand[i] - base) >> ns]++;
        b = pqc__hist_pick(h, nb, k - above, &a2);
        above += a2;
        nc = ns > 0 ? pqc__topk_bin(simd, cand, nc, base, ns, b) : 0;
        base += b << ns;
        shift = ns;
    }
    *thr = base;
    *need = k - above;
}

/* The indices of the n scores whose keys lie above thr, and of the first need keys equal
   to it (lowest index first), in index order into idx (their scores into outs), which
   hold cap entries: exactly as many as it takes; returns how many */
static size_t pqc__topk_take(pqc_simd simd, const float *s, size_t n, uint32_t thr, size_t need, size_t cap,
                             uint32_t *idx, float *outs)
{
    size_t i = 0, taken = 0;
    const float tv = pqc__key_value(thr); /* compared as floats: the keys' order and ties */
    PQC__DISPATCH_TO(i, simd, pqc__take, (s, n, thr, &need, idx, outs, cap, &taken));
    for (; i < n; i++) {
        if (s[i] > tv || (s[i] == tv && need > 0)) {
            if (s[i] == tv) need--;
            idx[taken] = (uint32_t)i;
            if (outs) outs[taken] = s[i];
            taken++;
        }
    }
    return taken;
}

/* Exact top-k of n scores: indices ascending into idx (scores into outs), ties to the
   lowest index. scratch: n uint32. */
static void pqc__topk_core(pqc_simd simd, const float *s, size_t n, size_t k, uint32_t *cand, uint32_t *idx,
                           float *outs)
{
    uint32_t thr;
    size_t i, need, taken;
    if (k >= n) {
        for (i = 0; i < n; i++) {
            idx[i] = (uint32_t)i;
            if (outs) outs[i] = s[i];
        }
        return;
    }
    pqc__topk_thresh(simd, s, n, k, cand, &thr, &need);
    taken = pqc__topk_take(simd, s, n, thr, need, k, idx, outs);
    PQC_ASSERT(taken == k);
    (void)taken;
}

/* Value of descending rank r (0 = largest) among a[0..n), reordering a (quickselect). */
static float pqc__kth_largest(float *a, size_t n, size_t r)
{
    ptrdiff_t lo = 0, hi = (ptrdiff_t)n - 1, rr = (ptrdiff_t)r;
    while (lo < hi) {
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi], piv, t;
        ptrdiff_t i = lo, j = hi;
        piv = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y)); /* median of 3 */
        while (i <= j) {
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i <= j) {
                t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (rr <= j) hi = j;
        else if (rr >= i) lo = i;
        else return a[rr];
    }
    return a[lo];
}

#define PQC__SAMPLE 2048
/* scratch floats/u32 needed by pqc__select for n scores */
static size_t pqc__select_scratch(size_t n) { return (2 * (n + 16) + PQC__SAMPLE) * sizeof(uint32_t); }

/* Exact top-k (indices ascending, ties to the lower index) of n finite scores.
   A sample brackets the k-th value in [lo, hi]; one pass counts the scores above hi and
   keeps the values inside; the k-th largest key among those (pqc__topk_thresh) is the
   k-th of all, and the top-k's last pass (pqc__topk_take) over every score gives the
   indices. When the bracket misses (rare: it only costs time), the full radix select runs
   instead. */
static void pqc__select(pqc_simd simd, const float *s, size_t n, size_t k, void *scratch, uint32_t *idx, float *outs)
{
    uint32_t *keys = (uint32_t *)scratch, thr;
    float *cs = (float *)(keys + n + 16), *smp = cs + n + 16, lo, hi;
    size_t i, S, na = 0, nc = 0, need, rl, taken;
    double p, delta;
    if (k >= n || n <= 4 * PQC__SAMPLE) {
        pqc__topk_core(simd, s, n, k, keys, idx, outs);
        return;
    }
    S = PQC__SAMPLE;
    /* spread positions: a multiplicative hash of i scaled to [0, n) by its high bits (n <
       2^32 here; a division per sample cost about 0.1 ns per score of a 128K select) */
    for (i = 0; i < S; i++) smp[i] = s[(size_t)(((uint64_t)(uint32_t)((uint32_t)i * 2654435761u + 97u) * n) >> 32)];
    p = (double)k / (double)n;
    delta = 3.0 * sqrt(p * (1.0 - p) / (double)S) + 2.0 / (double)S;
    /* the lower bound's rank first: quickselect leaves the values above it in front, so the
       upper bound's rank is looked for among those few only */
    rl = (size_t)ceil((p + delta) * (double)S);
    if (p + delta >= 1.0 || rl >= S) { /* no lower bound: every sample is in front */
        lo = -INFINITY;
        rl = S - 1;
    } else {
        lo = pqc__kth_largest(smp, S, rl);
    }
    hi = p - delta <= 0.0 ? INFINITY : pqc__kth_largest(smp, rl + 1, (size_t)floor((p - delta) * (double)S));
    PQC__DISPATCH(simd, pqc__bracket, (s, n, lo, hi, &na, cs, &nc));
    if (na > k || na + nc < k) { /* the bracket missed the k-th value */
        pqc__topk_core(simd, s, n, k, keys, idx, outs);
        return;
    }
    /* The k-th largest score is the (k - na)-th of those inside: every score above hi is
       above it and every score below lo under it, as keys too (the keys keep the order of
       the values, -0 and +0 one key), so its key's ties all lie inside, and the top k are
       the keys above it and the first of its ties, as pqc__topk_core makes them. With
       k = na the top k are the scores above hi: the keys above hi's. (The pass used to
       store the indices above hi and inside as well, to be merged with those chosen
       inside: at 128K, k = n/10, that pass took 22 us and the merge 18-36 us, where the
       counting pass takes 12-13 us and the last pass over every score 20.) */
    need = k - na;
    if (need > 0) {
        pqc__topk_thresh(simd, cs, nc, need, keys, &thr, &need);
    } else {
        thr = pqc__fkey(hi);
    }
    taken = pqc__topk_take(simd, s, n, thr, need, k, idx, outs);
    PQC_ASSERT(taken == k);
    (void)taken;
}

PQCDEF pqc_result pqc_topk(pqc_runtime *rt, const float *scores, size_t n, size_t k, pqc_scratch *scratch,
                           uint32_t *idx, float *out_scores)
{
    void *tmp;
    uint32_t *cand;
    size_t i;
    if (!scores || !idx) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_topk: null pointer");
    if (n == 0) return pqc__fail(rt, PQC_ERROR_EMPTY, "pqc_topk: no scores");
    if (k == 0 || k > n) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_topk: k = %zu not in 1..%zu", k, n);
    if (n > 0xffffffffu) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_topk: more than 2^32 scores");
    for (i = 0; i < n; i++)
        if (scores[i] != scores[i]) return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_topk: score %zu is NaN", i);
    cand = (uint32_t *)pqc__scratch_get(scratch, pqc__rt_alloc(rt), pqc__select_scratch(n), &tmp);
    if (!cand) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_topk: scratch allocation failed");
    pqc__select(pqc__simd(rt), scores, n, k, cand, idx, out_scores);
    pqc__free(pqc__rt_alloc(rt), tmp);
    return PQC_SUCCESS;
}

PQCDEF double pqc_recall(const uint32_t *truth, size_t n_truth, const uint32_t *got, size_t n_got)
{
    size_t i, hit = 0;
    if (!truth || n_truth == 0) return 1.0;
    if (!got) return 0.0;
    for (i = 0; i < n_truth; i++) {
        size_t lo = 0, hi = n_got;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (got[mid] < truth[i]) lo = mid + 1;
            else hi = mid;
        }
        if (lo < n_got && got[lo] == truth[i]) hit++;
    }
    return (double)hit / (double)n_truth;
}

/* ---------------------------------------------------------------------------------------
   6. PQ codebook training
   ------------------------------------------------------------------------------------- */

/* whether a resolved desc's sub-spaces gather from the two halves of the half-split
   layout (pqc_pq.half_bands; interleaved bands are the contiguous dims) */
static int pqc__half_bands(const pqc_pq_desc *d)
{
    return d->subspaces == PQC_SUBSPACES_ROPE_BANDS && d->rope == PQC_ROPE_HALF;
}

/* metric blocks: sub-spaces of at most this many dims (their factors are dense) */
#define PQC__MAX_BLOCK 256

/* The Cholesky factor L (lower, row-major n x n, in double) of the symmetric n x n
   matrix w: 0, or 1 + the row whose pivot is not above 1e-12 of the largest diagonal
   entry (not positive definite, or too near singular). */
static int pqc__cholesky(const float *w, int n, double *l)
{
    double big = 0.0;
    int i, j, k;
    for (i = 0; i < n; i++) big = (double)w[(size_t)i * n + i] > big ? (double)w[(size_t)i * n + i] : big;
    for (i = 0; i < n; i++) {
        for (j = 0; j <= i; j++) {
            double a = (double)w[(size_t)i * n + j];
            for (k = 0; k < j; k++) a -= l[(size_t)i * n + k] * l[(size_t)j * n + k];
            if (i == j) {
                if (!(a > 1e-12 * big)) return i + 1;
                l[(size_t)i * n + i] = sqrt(a);
            } else {
                l[(size_t)i * n + j] = a / l[(size_t)j * n + j];
            }
        }
        for (j = i + 1; j < n; j++) l[(size_t)i * n + j] = 0.0;
    }
    return 0;
}

/* Checks m metric blocks of n x n (finite, symmetric to 1e-6 of the largest entry,
   positive definite); with chol, their Cholesky factors into it ([m][n][n] floats).
   Failures return `code`, the message naming `what`. */
static pqc_result pqc__blocks_check(const pqc_runtime *rt, const float *w, int m, int n, float *chol, pqc_result code,
                                    const char *what)
{
    size_t nn = (size_t)n * n, i;
    double *l = (double *)pqc__alloc(pqc__rt_alloc(rt), nn * sizeof(double));
    int j, a, b, bad;
    if (!l) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "%s: %zu bytes", what, nn * sizeof(double));
    for (j = 0; j < m; j++) {
        const float *wj = w + (size_t)j * nn;
        float big = 0.0f;
        for (i = 0; i < nn; i++) {
            if (!(fabsf(wj[i]) <= 3.0e38f)) {
                pqc__free(pqc__rt_alloc(rt), l);
                return pqc__fail(rt, code, "%s: block %d holds NaN, Inf or a huge value", what, j);
            }
            big = fabsf(wj[i]) > big ? fabsf(wj[i]) : big;
        }
        for (a = 0; a < n; a++)
            for (b = 0; b < a; b++)
                if (!(fabsf(wj[(size_t)a * n + b] - wj[(size_t)b * n + a]) <= 1e-6f * big)) {
                    pqc__free(pqc__rt_alloc(rt), l);
                    return pqc__fail(rt, code, "%s: block %d is not symmetric (at %d, %d)", what, j, a, b);
                }
        if ((bad = pqc__cholesky(wj, n, l)) != 0) {
            pqc__free(pqc__rt_alloc(rt), l);
            return pqc__fail(rt, code, "%s: block %d is not positive definite (pivot %d)", what, j, bad - 1);
        }
        for (i = 0; chol && i < nn; i++) chol[(size_t)j * nn + i] = (float)l[i];
    }
    pqc__free(pqc__rt_alloc(rt), l);
    return PQC_SUCCESS;
}

static pqc_result pqc__pq_check_desc(const pqc_runtime *rt, const pqc_pq_desc *in, int dim, pqc_pq_desc *d)
{
    if (in) *d = *in;
    else memset(d, 0, sizeof *d);
    if (d->m == 0) { /* d_h/32 (at least the default), or the largest of the default, 2, 1
                        that divides the dims */
        int need = d->subspaces == PQC_SUBSPACES_ROPE_BANDS && dim % 2 == 0 ? dim / 2 : dim;
        int wide = dim / 32 > PQC_DEFAULT_M ? dim / 32 : PQC_DEFAULT_M;
        d->m = need > 0 && need % wide == 0 ? wide
             : need > 0 && need % PQC_DEFAULT_M == 0 ? PQC_DEFAULT_M : need > 0 && need % 2 == 0 ? 2 : 1;
    }
    if (d->bits == 0) d->bits = PQC_DEFAULT_BITS;
    if (d->iters == 0) d->iters = PQC_DEFAULT_ITERS;
    else if (d->iters < 0) d->iters = 0;
    if (d->max_points_per_centroid == 0) d->max_points_per_centroid = PQC_DEFAULT_MAX_POINTS_PER_CENTROID;
    else if (d->max_points_per_centroid < 0) d->max_points_per_centroid = -1;
    if (dim <= 0) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "key dimension %d must be positive", dim);
    if (d->m < 0 || d->m > dim) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "m = %d not in 1..d_h (%d)", d->m, dim);
    if (dim % d->m) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "m = %d does not divide d_h = %d", d->m, dim);
    if (d->bits < 1 || d->bits > 8) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "bits = %d not in 1..8", d->bits);
    if (d->iters > 100000) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "iters = %d too large", d->iters);
    if ((int)d->init < 0 || (int)d->init > 1) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown init %d", (int)d->init);
    if (d->device < 0 || d->device > 1) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pq.device = %d not 0 or 1", d->device);
    if ((int)d->rope < 0 || (int)d->rope > 2) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown pq.rope %d", (int)d->rope);
    if ((int)d->subspaces < 0 || (int)d->subspaces > 2)
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown pq.subspaces %d", (int)d->subspaces);
    if (d->rope != PQC_ROPE_NONE && dim % 2)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pq.rope: a RoPE layout needs an even d_h, not %d", dim);
    if (d->subspaces == PQC_SUBSPACES_DEFAULT) /* bands keep the slow, content-carrying pairs apart */
        d->subspaces = d->rope != PQC_ROPE_NONE && (dim / 2) % d->m == 0 ? PQC_SUBSPACES_ROPE_BANDS
                                                                         : PQC_SUBSPACES_CONTIGUOUS;
    if (d->subspaces == PQC_SUBSPACES_ROPE_BANDS) {
        if (d->rope == PQC_ROPE_NONE)
            return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pq.subspaces: rope bands need a RoPE layout (pq.rope)");
        if ((dim / 2) % d->m)
            return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pq.subspaces: rope bands need m (%d) to divide the %d pairs", d->m,
                             dim / 2);
    }
    if (d->device && !(rt && rt->cu))
        return pqc__fail(rt, PQC_ERROR_NO_DEVICE, "pq.device: the runtime has no CUDA GPU (create it with PQC_BACKEND_CUDA)");
    if (d->metric) {
        float lo = INFINITY, hi = 0.0f;
        int e;
        for (e = 0; e < dim; e++) {
            float w = d->metric[e];
            if (!(w > 0.0f) || !(w <= 3.0e38f))
                return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pq.metric[%d] = %g: weights must be positive and finite", e,
                                 (double)w);
            if (w < lo) lo = w;
            if (w > hi) hi = w;
        }
        if ((double)hi > 1e12 * (double)lo)
            return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pq.metric: largest/smallest weight %g exceeds 1e12",
                             (double)hi / (double)lo);
    }
    if (d->metric_blocks) { /* their values: checked as pqc__pq_alloc factors them */
        if (d->metric)
            return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pq.metric and pq.metric_blocks: one metric, not both");
        if (dim / d->m > PQC__MAX_BLOCK)
            return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pq.metric_blocks: sub-spaces of %d dims, over %d", dim / d->m,
                             PQC__MAX_BLOCK);
    }
    return PQC_SUCCESS;
}

static void pqc__pq_zero(pqc_pq *pq) { memset(pq, 0, sizeof *pq); }

PQCDEF void pqc_pq_free(pqc_pq *pq)
{
    if (!pq) return;
    pqc__free(&pq->alloc, pq->centroids);
    pqc__free(&pq->alloc, pq->cent_t);
    pqc__free(&pq->alloc, pq->cnorm);
    pqc__free(&pq->alloc, pq->metric);
    pqc__free(&pq->alloc, pq->wnorm);
    pqc__free(&pq->alloc, pq->mblocks);
    pqc__free(&pq->alloc, pq->wcent_t);
    pqc__free(&pq->alloc, pq->mchol);
    pqc__pq_zero(pq);
}

/* Whether sub-spaces gather from the two halves (pqc_pq.half_bands): the layout asks for
   it (pqc__half_bands) and each sub-space holds whole pairs. */
static int pqc__bands_half(int half_bands, int dim, int m) { return half_bands && m > 0 && (dim / m) % 2 == 0; }

/* Dim of element e of sub-space j (of dsub dims) in a dim-wide row (pqc_pq_dim). */
static int pqc__subspace_dim(int dim, int dsub, int half, int j, int e)
{
    int h = dsub / 2;
    if (!half) return j * dsub + e;
    return e < h ? j * h + e : dim / 2 + j * h + (e - h);
}

/* A zeroed codebook's storage; with blocks, their check (failing with `bad`, the message
   naming `what`) and Cholesky factors. */
static pqc_result pqc__pq_alloc(const pqc_runtime *rt, pqc_pq *pq, int dim, int m, int bits, const float *metric,
                                const float *blocks, int half_bands, pqc_result bad, const char *what)
{
    size_t kpad;
    pqc__pq_zero(pq);
    if (rt) pq->alloc = rt->alloc;
    pq->half_bands = pqc__bands_half(half_bands, dim, m);
    pq->dim = dim;
    pq->m = m;
    pq->bits = bits;
    pq->ksub = 1 << bits;
    pq->dsub = dim / m;
    pq->ksub_pad = (pq->ksub + 15) & ~15;
    kpad = (size_t)pq->ksub_pad;
    pq->centroids = (float *)pqc__calloc(&pq->alloc, (size_t)m * pq->ksub * pq->dsub * sizeof(float));
    pq->cent_t = (float *)pqc__calloc(&pq->alloc, (size_t)m * pq->dsub * kpad * sizeof(float));
    pq->cnorm = (float *)pqc__calloc(&pq->alloc, (size_t)m * kpad * sizeof(float));
    if (metric) {
        pq->metric = (float *)pqc__alloc(&pq->alloc, (size_t)dim * sizeof(float));
        pq->wnorm = (float *)pqc__calloc(&pq->alloc, (size_t)m * kpad * sizeof(float));
        if (pq->metric) memcpy(pq->metric, metric, (size_t)dim * sizeof(float));
    }
    if (blocks) {
        size_t nb = (size_t)m * pq->dsub * pq->dsub;
        pq->mblocks = (float *)pqc__alloc(&pq->alloc, nb * sizeof(float));
        pq->mchol = (float *)pqc__alloc(&pq->alloc, nb * sizeof(float));
        pq->wcent_t = (float *)pqc__calloc(&pq->alloc, (size_t)m * pq->dsub * kpad * sizeof(float));
        pq->wnorm = (float *)pqc__calloc(&pq->alloc, (size_t)m * kpad * sizeof(float));
        if (pq->mblocks) memcpy(pq->mblocks, blocks, nb * sizeof(float));
    }
    if (!pq->centroids || !pq->cent_t || !pq->cnorm || (metric && (!pq->metric || !pq->wnorm)) ||
        (blocks && (!pq->mblocks || !pq->mchol || !pq->wcent_t || !pq->wnorm))) {
        pqc_pq_free(pq);
        return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "PQ codebook allocation failed");
    }
    if (blocks) {
        pqc_result r = pqc__blocks_check(rt, blocks, m, pq->dsub, pq->mchol, bad, what);
        if (r != PQC_SUCCESS) {
            pqc_pq_free(pq);
            return r;
        }
    }
    return PQC_SUCCESS;
}

PQCDEF int pqc_pq_dim(const pqc_pq *pq, int j, int e) { return pqc__subspace_dim(pq->dim, pq->dsub, pq->half_bands, j, e); }

/* Sub-vector j of a dim-float row x (in pq's sub-space order) into out. */
static void pqc__gather_sub(const pqc_pq *pq, const float *x, int j, float *out)
{
    int h = pq->dsub / 2;
    if (!pq->half_bands) {
        memcpy(out, x + (size_t)j * pq->dsub, (size_t)pq->dsub * sizeof(float));
        return;
    }
    memcpy(out, x + (size_t)j * h, (size_t)h * sizeof(float));
    memcpy(out + h, x + (size_t)pq->dim / 2 + (size_t)j * h, (size_t)h * sizeof(float));
}

/* transposed, padded copy of k centroids (k x d) and their squared norms (pad = +inf) */
static void pqc__transpose_centroids(const float *c, int k, int d, int kpad, float *ct, float *cn)
{
    int i, e;
    for (e = 0; e < d; e++)
        for (i = 0; i < kpad; i++) ct[(size_t)e * kpad + i] = i < k ? c[(size_t)i * d + e] : 0.0f;
    pqc__sqnorms_scalar(c, (size_t)k, d, cn);
    for (i = k; i < kpad; i++) cn[i] = INFINITY;
}

static void pqc__pq_finish_sub(pqc_pq *pq, int j)
{
    size_t kpad = (size_t)pq->ksub_pad;
    pqc__transpose_centroids(pq->centroids + (size_t)j * pq->ksub * pq->dsub, pq->ksub, pq->dsub, pq->ksub_pad,
                             pq->cent_t + (size_t)j * pq->dsub * kpad, pq->cnorm + (size_t)j * kpad);
    if (pq->metric) {
        /* weighted norms sum_e (w_e c_e) c_e, sequential fmaf from 0: coding compares
           these with 2 (w o x).c, which orders centroids by sum_e w_e (x_e - c_e)^2 */
        int i, e;
        for (i = 0; i < pq->ksub_pad; i++) {
            const float *cc = pq->centroids + ((size_t)j * pq->ksub + (size_t)i) * pq->dsub;
            float acc = 0.0f;
            if (i >= pq->ksub) {
                pq->wnorm[(size_t)j * kpad + (size_t)i] = INFINITY;
                continue;
            }
            for (e = 0; e < pq->dsub; e++) acc = fmaf(pq->metric[pqc_pq_dim(pq, j, e)] * cc[e], cc[e], acc);
            pq->wnorm[(size_t)j * kpad + (size_t)i] = acc;
        }
    }
    if (pq->mblocks) {
        /* W_j c (each entry a sequential fmaf from 0) transposed, and c.(W_j c): coding
           compares these norms with 2 x.(W_j c), which orders centroids by
           (x - c)^T W_j (x - c) for the symmetric W_j */
        const float *w = pq->mblocks + (size_t)j * pq->dsub * pq->dsub;
        float *wt = pq->wcent_t + (size_t)j * pq->dsub * kpad;
        int i, a, b;
        for (i = 0; i < pq->ksub_pad; i++) {
            const float *cc = pq->centroids + ((size_t)j * pq->ksub + (size_t)i) * pq->dsub;
            float nrm = 0.0f;
            if (i >= pq->ksub) {
                for (a = 0; a < pq->dsub; a++) wt[(size_t)a * kpad + (size_t)i] = 0.0f;
                pq->wnorm[(size_t)j * kpad + (size_t)i] = INFINITY;
                continue;
            }
            for (a = 0; a < pq->dsub; a++) {
                float acc = 0.0f;
                for (b = 0; b < pq->dsub; b++) acc = fmaf(w[(size_t)a * pq->dsub + b], cc[b], acc);
                wt[(size_t)a * kpad + (size_t)i] = acc;
                nrm = fmaf(acc, cc[a], nrm);
            }
            pq->wnorm[(size_t)j * kpad + (size_t)i] = nrm;
        }
    }
}

typedef struct pqc__train_job {
    pqc_runtime *rt;
    const pqc_matrix *keys;
    const pqc_pq_desc *desc;
    pqc_pq *pq;
    int j;
    pqc_result res;
    char err[256];
} pqc__train_job;

/* k-means on n points x (n x d) into c (k x d). Work buffers come from one allocation. */

static pqc_result pqc__kmeans(pqc_simd simd, const pqc_allocator *al, const float *x, size_t n, int d, int k, int kpad,
                              int iters, pqc_init init, uint64_t *rng, float *c, double *obj, char *err, size_t errsz,
                              pqc_runtime *gpu)
{
    size_t i, bytes = 0, off_idx, off_val, off_xn, off_ct, off_cn, off_sum, off_cnt, off_aux, off_pre, off_xt;
    double *pre;
    unsigned char *mem;
    uint16_t *idx;
    float *val, *xn, *ct, *cn, *aux;
    double *sum;
    size_t *cnt;
    int it, e, ci;
    off_idx = bytes;
    bytes = PQC__ALIGN_UP(bytes + n * sizeof(uint16_t));
    off_val = bytes;
    bytes = PQC__ALIGN_UP(bytes + n * sizeof(float));
    off_xn = bytes;
    bytes = PQC__ALIGN_UP(bytes + n * sizeof(float));
    off_aux = bytes;
    bytes = PQC__ALIGN_UP(bytes + n * sizeof(float));
    off_ct = bytes;
    bytes = PQC__ALIGN_UP(bytes + (size_t)d * kpad * sizeof(float));
    off_cn = bytes;
    bytes = PQC__ALIGN_UP(bytes + (size_t)kpad * sizeof(float));
    off_sum = bytes;
    bytes = PQC__ALIGN_UP(bytes + (size_t)k * d * sizeof(double));
    off_cnt = bytes;
    bytes = PQC__ALIGN_UP(bytes + (size_t)k * sizeof(size_t));
    off_pre = bytes;
    bytes = PQC__ALIGN_UP(bytes + n * sizeof(double));
    off_xt = bytes; /* k-means++ over SIMD kernels: the points in blocks (pqc__seed_blocks) */
    if (init != PQC_INIT_RANDOM && n > (size_t)k && simd != PQC_SIMD_SCALAR)
        bytes = PQC__ALIGN_UP(bytes + PQC__SEED_ROUND(n) * (size_t)d * sizeof(float));
    mem = (unsigned char *)pqc__alloc(al, bytes);
    if (!mem) {
        snprintf(err, errsz, "k-means work memory (%zu bytes) allocation failed", bytes);
        return PQC_ERROR_OUT_OF_MEMORY;
    }
    idx = (uint16_t *)(mem + off_idx);
    val = (float *)(mem + off_val);
    xn = (float *)(mem + off_xn);
    aux = (float *)(mem + off_aux);
    ct = (float *)(mem + off_ct);
    cn = (float *)(mem + off_cn);
    sum = (double *)(mem + off_sum);
    cnt = (size_t *)(mem + off_cnt);
    pre = (double *)(mem + off_pre);
    pqc__k_sqnorms(simd, x, n, d, xn);

    /* ----- initialisation ----- */
    if (init == PQC_INIT_RANDOM || n <= (size_t)k) {
        /* k distinct random points (all points, cycled, when there are too few) */
        uint32_t *perm = (uint32_t *)aux;
        for (i = 0; i < n; i++) perm[i] = (uint32_t)i;
        for (ci = 0; ci < k; ci++) {
            size_t pick;
            if ((size_t)ci < n) {
                size_t r = (size_t)ci + pqc__rng_below(rng, n - (size_t)ci);
                uint32_t t = perm[ci];
                perm[ci] = perm[r];
                perm[r] = t;
                pick = perm[ci];
            } else {
                pick = perm[(size_t)ci % n];
            }
            memcpy(c + (size_t)ci * d, x + pick * d, (size_t)d * sizeof(float));
        }
    } else {
        /* k-means++ D^2 seeding in rounds of r centres: the round's farthest point (with
           64+ centroids), then draws from the same D^2 distribution; dist[i] = squared
           distance to the nearest chosen centre, lowered by each round's centres in one
           pass over the points in lanes (pqc__seedmin: the values of the assignment
           kernel, without its indices; 32K points of 32 dims, 16 rounds of 16: 14 -> 11
           ms). */
        float *dist = aux, *xt = (float *)(mem + off_xt);
        int chosen = 1, r = k >= 64 ? k / 16 : (k >= 8 ? 4 : 1);
        size_t first = pqc__rng_below(rng, n);
        memcpy(c, x + first * d, (size_t)d * sizeof(float));
        for (i = 0; i < n; i++) dist[i] = INFINITY;
        if (simd != PQC_SIMD_SCALAR) pqc__seed_blocks(x, n, d, xt);
        ci = 0; /* centres [ci, chosen) still to fold into dist */
        while (1) {
            double total = 0.0;
            int nb = chosen - ci, q;
            pqc__sqnorms_scalar(c + (size_t)ci * d, (size_t)nb, d, cn);
            pqc__seed_groups(c + (size_t)ci * d, nb, d, ct);
            pqc__k_seedmin(simd, x, xt, n, d, c + (size_t)ci * d, ct, cn, nb, xn, dist);
            for (i = 0; i < n; i++) {
                total += dist[i];
                pre[i] = total; /* running sum: D^2 draws by binary search */
            }
            ci = chosen;
            if (chosen >= k) break;
            for (q = 0; q < r && chosen < k; q++) {
                size_t pick = 0;
                if (q == 0 && total > 0.0 && k >= 64) {
                    /* farthest-first pick: a lone outlier (a needle) is guaranteed a centre
                       whenever it is the worst-served point. Only with 64+ centroids, where
                       one in 16 costs the average little; a small codebook needs them all
                       for the bulk of the keys. */
                    for (i = 1; i < n; i++)
                        if (dist[i] > dist[pick]) pick = i;
                } else if (total > 0.0) {
                    double u = pqc__rng_unit(rng) * total;
                    size_t lo = 0, hi = n - 1;
                    while (lo < hi) { /* first i with pre[i] > u */
                        size_t mid = lo + (hi - lo) / 2;
                        if (pre[mid] > u) hi = mid;
                        else lo = mid + 1;
                    }
                    pick = lo;
                } else {
                    pick = pqc__rng_below(rng, n); /* every point is already a centre */
                }
                memcpy(c + (size_t)chosen * d, x + pick * d, (size_t)d * sizeof(float));
                chosen++;
            }
        }
    }

    /* ----- Lloyd iterations ----- */
    if (gpu && d <= 256 && n <= 0x7fffffffu) {
        pqc__free(al, mem);
        return pqc__device()->lloyd(gpu, x, n, d, k, iters, c, obj, err, errsz);
    }
    for (it = 0; it <= iters; it++) {
        double o = 0.0;
        int changed = 0;
        if (it == iters && !obj) break; /* the last assignment only serves the objective */
        pqc__transpose_centroids(c, k, d, kpad, ct, cn);
        pqc__k_assign(simd, x, n, d, ct, cn, kpad, k, idx, val);
        for (i = 0; i < n; i++) {
            float v = xn[i] + val[i];
            val[i] = v < 0.0f ? 0.0f : v;
            o += val[i];
        }
        if (obj) obj[it] = o / (double)n;
        if (it == iters) break;
        memset(sum, 0, (size_t)k * d * sizeof(double));
        memset(cnt, 0, (size_t)k * sizeof(size_t));
        for (i = 0; i < n; i++) cnt[idx[i]]++;
        pqc__k_accum(simd, x, n, d, idx, sum);
        for (ci = 0; ci < k; ci++) {
            float *cc = c + (size_t)ci * d;
            if (cnt[ci] == 0) {
                /* empty cluster: move it onto the point worst served so far (which can only
                   lower the objective) */
                size_t far = 0;
                for (i = 1; i < n; i++)
                    if (val[i] > val[far]) far = i;
                if (val[far] > 0.0f) {
                    memcpy(cc, x + far * d, (size_t)d * sizeof(float));
                    val[far] = 0.0f;
                    changed = 1;
                }
                continue;
            }
            for (e = 0; e < d; e++) {
                float nv = (float)(sum[(size_t)ci * d + e] / (double)cnt[ci]);
                if (nv != cc[e]) changed = 1;
                cc[e] = nv;
            }
        }
        if (!changed) { /* converged: the remaining objectives equal this one */
            if (obj)
                for (e = it + 1; e <= iters; e++) obj[e] = obj[it];
            break;
        }
    }
    pqc__free(al, mem);
    return PQC_SUCCESS;
}

/* sub-vector j (pq->dsub dims, in the sub-space's order) of row r as fp32 */
static void pqc__sub_to_f32(pqc_simd simd, const pqc_pq *pq, const pqc_matrix *keys, size_t r, int j, float *out)
{
    size_t es = pqc_dtype_size(keys->dtype), h = (size_t)pq->dsub / 2;
    const unsigned char *row = (const unsigned char *)pqc__row(keys, r);
    if (!pq->half_bands) {
        pqc__k_to_f32(simd, row + (size_t)j * pq->dsub * es, keys->dtype, (size_t)pq->dsub, out);
        return;
    }
    pqc__k_to_f32(simd, row + (size_t)j * h * es, keys->dtype, h, out);
    pqc__k_to_f32(simd, row + ((size_t)pq->dim / 2 + (size_t)j * h) * es, keys->dtype, h, out + h);
}

/* A sub-vector x (d floats) into the space where the metric is Euclidean: x_e sqrt(w_e)
   for the weights' square roots sw, or L^T x for a metric block's Cholesky factor l
   (lower, row-major: (L^T x)_a = sum over b >= a of l[b][a] x_b, in double), in place;
   neither: unchanged. Then |map(x) - map(c)|^2 is the metric's distance. */
static void pqc__metric_map(float *x, int d, const float *sw, const float *l)
{
    int a, b;
    if (sw) {
        for (a = 0; a < d; a++) x[a] *= sw[a];
    } else if (l) {
        for (a = 0; a < d; a++) { /* x[a] is read before it is written; later rows read b > a */
            double acc = 0.0;
            for (b = a; b < d; b++) acc += (double)l[(size_t)b * d + a] * x[b];
            x[a] = (float)acc;
        }
    }
}

/* The inverse of pqc__metric_map for a metric block: c from y = L^T c (back
   substitution in double), in place. */
static void pqc__metric_unmap(float *y, int d, const float *l)
{
    int a, b;
    for (a = d - 1; a >= 0; a--) {
        double acc = (double)y[a];
        for (b = a + 1; b < d; b++) acc -= (double)l[(size_t)b * d + a] * y[b];
        y[a] = (float)(acc / (double)l[(size_t)a * d + a]);
    }
}

/* The training sample for sub-space j when the cap binds: with 64+ centroids the cap/32
   points worst served by a few probe centres, and the probes (rare, distinctive keys must
   shape the codebook: they are what a query is looking for, and a uniform sample keeps a
   lone needle only with probability cap/n), the rest uniformly at random; returned in
   token order. The probes are PQC__PROBES k-means++ (D^2) draws over a uniform subset, so
   they sit in the dense clusters; a point far from all of them is an outlier wherever the
   mean lies (a needle inside the cloud of a multi-cluster sub-space is no farther from the
   mean than the clusters are). sw: square roots of the metric's weights, or NULL; l: the
   sub-space's metric block's Cholesky factor, or NULL (pqc__metric_map). */
#define PQC__PROBES 16
#define PQC__PROBE_BLOCK 1024
#define PQC__PROBE_POOL PQC__PROBE_BLOCK /* the pool's rows are held in one block */
static pqc_result pqc__train_sample(pqc_simd simd, const pqc_pq *pq, const pqc_matrix *keys, int j, int d, int k,
                                    size_t cap, uint64_t *rng, const pqc_allocator *al, const float *sw, const float *l,
                                    uint32_t *sel)
{
    size_t n = keys->rows, nfar = k >= 64 ? cap / 32 : 0, i, got = 0, left, want;
    size_t pool = PQC__MIN(n, (size_t)PQC__PROBE_POOL), fl_bytes;
    float *fl, *dist, *blk, *bxn, *bval, *probe, *ct, *cn, *pd;
    uint32_t *tmp = (uint32_t *)pqc__alloc(al, n * sizeof(uint32_t) + n), *pidx;
    uint16_t *bidx;
    unsigned char *flag;
    int e, pi;
    fl_bytes = (n + (size_t)PQC__PROBE_BLOCK * (d + 2) + (size_t)PQC__PROBES * d * 2 + PQC__PROBES + pool) *
                   sizeof(float) + pool * sizeof(uint32_t) + (size_t)PQC__PROBE_BLOCK * sizeof(uint16_t);
    fl = (float *)pqc__alloc(al, fl_bytes);
    if (!fl || !tmp) {
        pqc__free(al, fl);
        pqc__free(al, tmp);
        return PQC_ERROR_OUT_OF_MEMORY;
    }
    dist = fl;
    blk = dist + n;
    bxn = blk + (size_t)PQC__PROBE_BLOCK * d;
    bval = bxn + PQC__PROBE_BLOCK;
    probe = bval + PQC__PROBE_BLOCK;
    ct = probe + (size_t)PQC__PROBES * d;
    cn = ct + (size_t)PQC__PROBES * d;
    pd = cn + PQC__PROBES;
    pidx = (uint32_t *)(pd + pool);
    bidx = (uint16_t *)(pidx + pool);
    flag = (unsigned char *)(tmp + n);
    memset(flag, 0, n);
    if (nfar > 0) {
        size_t b;
        /* probes: D^2 draws over a uniform pool, its rows in the weighted space in blk
           (pool <= PQC__PROBE_BLOCK rows) */
        for (i = 0; i < pool; i++) {
            pidx[i] = (uint32_t)pqc__rng_below(rng, n);
            pd[i] = INFINITY;
            pqc__sub_to_f32(simd, pq, keys, pidx[i], j, blk + i * d);
            pqc__metric_map(blk + i * d, d, sw, l);
        }
        for (pi = 0; pi < PQC__PROBES; pi++) {
            size_t pick = 0;
            double total = 0.0, u;
            if (pi == 0) {
                pick = pqc__rng_below(rng, pool);
            } else {
                for (i = 0; i < pool; i++) total += pd[i];
                u = pqc__rng_unit(rng) * total;
                for (i = 0; i + 1 < pool && (u -= pd[i]) > 0.0; i++) {}
                pick = total > 0.0 ? i : pqc__rng_below(rng, pool);
            }
            memcpy(probe + (size_t)pi * d, blk + pick * d, (size_t)d * sizeof(float));
            flag[pidx[pick]] = 1; /* a probe is a cluster's typical point: keep it too */
            for (i = 0; i < pool; i++) {
                double acc = 0.0;
                for (e = 0; e < d; e++) {
                    double t = (double)blk[i * d + e] - probe[(size_t)pi * d + e];
                    acc += t * t;
                }
                if ((float)acc < pd[i]) pd[i] = (float)acc;
            }
        }
        /* every point's squared distance to its nearest probe, a block at a time */
        pqc__transpose_centroids(probe, PQC__PROBES, d, PQC__PROBES, ct, cn);
        for (b = 0; b < n; b += PQC__PROBE_BLOCK) {
            size_t nb = PQC__MIN((size_t)PQC__PROBE_BLOCK, n - b);
            for (i = 0; i < nb; i++) {
                float *row = blk + i * d;
                pqc__sub_to_f32(simd, pq, keys, b + i, j, row);
                pqc__metric_map(row, d, sw, l);
            }
            pqc__k_sqnorms(simd, blk, nb, d, bxn);
            pqc__k_assign(simd, blk, nb, d, ct, cn, PQC__PROBES, PQC__PROBES, bidx, bval);
            for (i = 0; i < nb; i++) {
                float v = bxn[i] + bval[i];
                dist[b + i] = v > 0.0f ? v : 0.0f;
            }
        }
        for (i = 0; i < n; i++) /* the probes are in already; they can only be at distance 0 */
            if (flag[i]) dist[i] = -1.0f;
        pqc__topk_core(simd, dist, n, nfar, tmp, sel, NULL);
        for (i = 0; i < nfar; i++) flag[sel[i]] = 1;
        for (i = 0, nfar = 0; i < n; i++) nfar += flag[i];
    }
    left = n - nfar;
    want = cap - nfar;
    for (i = 0; i < n && want > 0; i++) { /* selection sampling over the other points */
        if (flag[i]) continue;
        if ((double)left * pqc__rng_unit(rng) < (double)want) {
            flag[i] = 1;
            want--;
        }
        left--;
    }
    for (i = 0; i < n; i++)
        if (flag[i]) sel[got++] = (uint32_t)i;
    PQC_ASSERT(got == cap);
    pqc__free(al, fl);
    pqc__free(al, tmp);
    return PQC_SUCCESS;
}

static void pqc__train_sub(void *arg)
{
    pqc__train_job *jb = (pqc__train_job *)arg;
    const pqc_matrix *keys = jb->keys;
    pqc_pq *pq = jb->pq;
    const pqc_allocator *al = &pq->alloc;
    int j = jb->j, d = pq->dsub, k = pq->ksub;
    size_t n = keys->rows, cap, i;
    uint64_t rng = jb->desc->seed ^ (0x5851F42D4C957F2Dull * (uint64_t)(j + 1));
    uint32_t *sel = NULL;
    float *x = NULL, sw[256];
    const float *swp = NULL, *lp = pq->mchol ? pq->mchol + (size_t)jb->j * pq->dsub * pq->dsub : NULL;
    double *obj = jb->desc->objective ? jb->desc->objective + (size_t)j * (jb->desc->iters + 1) : NULL;
    pqc_simd simd = pqc__simd(jb->rt);
    (void)pqc__rng_next(&rng);
    cap = n;
    if (jb->desc->max_points_per_centroid > 0 && (size_t)jb->desc->max_points_per_centroid * k < n)
        cap = (size_t)jb->desc->max_points_per_centroid * k;
    x = (float *)pqc__alloc(al, cap * d * sizeof(float) + (pq->metric ? (size_t)d * sizeof(float) : 0));
    if (cap < n) sel = (uint32_t *)pqc__alloc(al, cap * sizeof(uint32_t));
    if (x && pq->metric) { /* training runs in the space scaled by sqrt(w): k-means there
                              minimises the weighted distance; the means scale back exactly */
        float *t = d <= 256 ? sw : x + cap * (size_t)d;
        int e;
        for (e = 0; e < d; e++) t[e] = sqrtf(pq->metric[pqc_pq_dim(pq, j, e)]);
        swp = t;
    }
    if (!x || (cap < n && !sel)) {
        jb->res = PQC_ERROR_OUT_OF_MEMORY;
        snprintf(jb->err, sizeof jb->err, "training sample allocation failed (sub-space %d)", j);
        goto done;
    }
    if (cap < n && pqc__train_sample(simd, pq, keys, j, d, k, cap, &rng, al, swp, lp, sel) != PQC_SUCCESS) {
        jb->res = PQC_ERROR_OUT_OF_MEMORY;
        snprintf(jb->err, sizeof jb->err, "training sample allocation failed (sub-space %d)", j);
        goto done;
    }
    for (i = 0; i < cap; i++) {
        pqc__sub_to_f32(simd, pq, keys, sel ? sel[i] : i, j, x + i * d);
        pqc__metric_map(x + i * d, d, swp, lp);
    }
    jb->res = pqc__kmeans(simd, al, x, cap, d, k, pq->ksub_pad, jb->desc->iters, jb->desc->init, &rng,
                          pq->centroids + (size_t)j * k * d, obj, jb->err, sizeof jb->err,
                          jb->desc->device ? jb->rt : NULL);
    if (jb->res == PQC_SUCCESS && swp) {
        float *cc = pq->centroids + (size_t)j * k * d;
        int ci, e;
        for (ci = 0; ci < k; ci++)
            for (e = 0; e < d; e++) cc[(size_t)ci * d + e] /= swp[e];
    }
    if (jb->res == PQC_SUCCESS && lp) { /* the means map back exactly (a linear map) */
        float *cc = pq->centroids + (size_t)j * k * d;
        int ci;
        for (ci = 0; ci < k; ci++) pqc__metric_unmap(cc + (size_t)ci * d, d, lp);
    }
    if (jb->res == PQC_SUCCESS) pqc__pq_finish_sub(pq, j);
done:
    pqc__free(al, x);
    pqc__free(al, sel);
}

static void pqc__train_pfor(void *ctx, size_t i) { pqc__train_sub((pqc__train_job *)ctx + i); }

static pqc_result pqc__pq_train_impl(pqc_runtime *rt, const pqc_pq_desc *desc, const pqc_matrix *keys, pqc_pq *out,
                                     int nested)
{
    pqc_pq_desc d;
    pqc_pq pq;
    pqc__train_job *jobs;
    pqc_result r;
    float *tmp;
    int j;
    if (!out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_train: null output");
    if ((r = pqc__check_matrix(rt, keys, 0, "pqc_pq_train keys")) != PQC_SUCCESS) return r;
    if (keys->cols > 65536) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "d_h = %zu too large", keys->cols);
    if ((r = pqc__pq_check_desc(rt, desc, (int)keys->cols, &d)) != PQC_SUCCESS) return r;
    tmp = (float *)pqc__alloc(pqc__rt_alloc(rt), keys->cols * sizeof(float));
    if (!tmp) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_train: allocation failed");
    r = pqc__check_finite(rt, keys, tmp, "pqc_pq_train keys");
    pqc__free(pqc__rt_alloc(rt), tmp);
    if (r != PQC_SUCCESS) return r;
    if ((r = pqc__pq_alloc(rt, &pq, (int)keys->cols, d.m, d.bits, d.metric, d.metric_blocks, pqc__half_bands(&d),
                           PQC_ERROR_OUT_OF_RANGE, "pq.metric_blocks")) != PQC_SUCCESS)
        return r;
    jobs = (pqc__train_job *)pqc__calloc(&pq.alloc, (size_t)d.m * sizeof *jobs);
    if (!jobs) {
        pqc_pq_free(&pq);
        return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_train: job table allocation failed");
    }
    for (j = 0; j < d.m; j++) {
        jobs[j].rt = rt;
        jobs[j].keys = keys;
        jobs[j].desc = &d;
        jobs[j].pq = &pq;
        jobs[j].j = j;
    }
    if (nested)
        for (j = 0; j < d.m; j++) pqc__train_sub(&jobs[j]);
    else
        pqc__parallel_for(rt, (size_t)d.m, pqc__train_pfor, jobs);
    r = PQC_SUCCESS;
    for (j = 0; j < d.m && r == PQC_SUCCESS; j++)
        if (jobs[j].res != PQC_SUCCESS) r = pqc__fail(rt, jobs[j].res, "pqc_pq_train: %s", jobs[j].err);
    pqc__free(&pq.alloc, jobs);
    if (r != PQC_SUCCESS) {
        pqc_pq_free(&pq);
        return r;
    }
    *out = pq;
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_pq_train(pqc_runtime *rt, const pqc_pq_desc *desc, const pqc_matrix *keys, pqc_pq *out)
{
    return pqc__pq_train_impl(rt, desc, keys, out, 0);
}
/* from inside a job: no nested submissions (the pool may be the engine's and busy) */
static pqc_result pqc__pq_train_nested(pqc_runtime *rt, const pqc_pq_desc *desc, const pqc_matrix *keys, pqc_pq *out)
{
    return pqc__pq_train_impl(rt, desc, keys, out, 1);
}

/* ---------------------------------------------------------------------------------------
   7. Codes and encoding
   ------------------------------------------------------------------------------------- */

static size_t pqc__col_bytes(size_t tokens, int bits) { return (tokens * (size_t)bits + 7) / 8; }

PQCDEF pqc_result pqc_codes_init(pqc_codes *codes, const pqc_pq *pq, size_t capacity, const pqc_allocator *alloc)
{
    if (!codes || !pq) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_codes_init: null pointer");
    if (pq->m <= 0 || pq->bits < 1 || pq->bits > 8)
        return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_codes_init: untrained PQ");
    memset(codes, 0, sizeof *codes);
    codes->m = pq->m;
    codes->bits = pq->bits;
    if (alloc && alloc->alloc) codes->alloc = *alloc;
    else codes->alloc = pq->alloc;
    if (capacity) return pqc_codes_reserve(codes, capacity);
    return PQC_SUCCESS;
}

PQCDEF void pqc_codes_free(pqc_codes *codes)
{
    if (!codes) return;
    pqc__free(&codes->alloc, codes->data);
    codes->data = NULL;
    codes->count = codes->capacity = codes->col_stride = 0;
}

PQCDEF pqc_result pqc_codes_reserve(pqc_codes *codes, size_t capacity)
{
    size_t stride, total;
    unsigned char *p;
    int j;
    if (!codes || codes->m <= 0) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_codes_reserve: bad codes");
    if (capacity <= codes->capacity) return PQC_SUCCESS;
    if (codes->bits < 1 || codes->bits > 8 || capacity > ((size_t)-1 - 64) / 8)
        return pqc__fail(NULL, PQC_ERROR_CAPACITY, "pqc_codes_reserve: %zu tokens of %d-bit codes do not fit in memory",
                         capacity, codes->bits);
    stride = pqc__col_bytes(capacity, codes->bits) + 16; /* padding for wide loads */
    if (!pqc__mul(stride, (size_t)codes->m, &total))
        return pqc__fail(NULL, PQC_ERROR_CAPACITY, "pqc_codes_reserve: %zu tokens x %d sub-spaces overflow", capacity,
                         codes->m);
    p = (unsigned char *)pqc__calloc(&codes->alloc, total);
    if (!p) return pqc__fail(NULL, PQC_ERROR_OUT_OF_MEMORY, "pqc_codes_reserve: %zu bytes", total);
    if (codes->data)
        for (j = 0; j < codes->m; j++)
            memcpy(p + (size_t)j * stride, codes->data + (size_t)j * codes->col_stride,
                   pqc__col_bytes(codes->count, codes->bits));
    pqc__free(&codes->alloc, codes->data);
    codes->data = p;
    codes->capacity = capacity;
    codes->col_stride = stride;
    return PQC_SUCCESS;
}

/* Drops the codes of tokens [keep, count): their bits are cleared, since codes are
   written by OR-ing into zeroed columns. */
static void pqc__codes_drop(pqc_codes *codes, size_t keep)
{
    int j;
    if (keep >= codes->count || !codes->data) return;
    for (j = 0; j < codes->m; j++) {
        unsigned char *col = codes->data + (size_t)j * codes->col_stride;
        size_t bit = keep * (size_t)codes->bits, end = pqc__col_bytes(codes->count, codes->bits);
        size_t byte = bit >> 3;
        if (bit & 7) col[byte++] &= (unsigned char)((1u << (bit & 7)) - 1u);
        if (end > byte) memset(col + byte, 0, end - byte);
    }
    codes->count = keep;
}

PQCDEF size_t pqc_codes_bytes(const pqc_codes *codes)
{
    return codes ? (size_t)codes->m * pqc__col_bytes(codes->count, codes->bits) : 0;
}

PQCDEF unsigned pqc_codes_get(const pqc_codes *codes, size_t t, int j)
{
    const unsigned char *col;
    size_t bit;
    if (!codes || !codes->data || t >= codes->count || j < 0 || j >= codes->m) return 0;
    col = codes->data + (size_t)j * codes->col_stride;
    bit = t * (size_t)codes->bits;
    return (((unsigned)col[bit >> 3] | ((unsigned)col[(bit >> 3) + 1] << 8)) >> (bit & 7)) & ((1u << codes->bits) - 1u);
}

static void pqc__codes_put(pqc_codes *codes, size_t t, int j, unsigned v)
{
    unsigned char *col = codes->data + (size_t)j * codes->col_stride;
    size_t bit = t * (size_t)codes->bits;
    unsigned sh = (unsigned)(bit & 7), w = v << sh;
    col[bit >> 3] = (unsigned char)(col[bit >> 3] | (w & 0xffu));
    if (sh + (unsigned)codes->bits > 8) col[(bit >> 3) + 1] = (unsigned char)(col[(bit >> 3) + 1] | (w >> 8));
}

/* Encodes rows [r0, r0+n) of keys into codes slots starting at `at`. x: n*dsub floats,
   row: dim + dsub floats (the row, then the sub-space's weights), idx: n uint16 scratch. */
#define PQC__ENC_CHUNK 256
static void pqc__encode_rows(pqc_simd simd, const pqc_pq *pq, const pqc_matrix *keys, size_t r0, size_t n,
                             pqc_codes *codes, size_t at, float *x, float *row, uint16_t *idx)
{
    int j;
    size_t i;
    for (j = 0; j < pq->m; j++) {
        float *w = pq->metric ? row + pq->dim : NULL; /* the sub-space's weights, its order */
        if (w) pqc__gather_sub(pq, pq->metric, j, w);
        for (i = 0; i < n; i++) {
            pqc__sub_to_f32(simd, pq, keys, r0 + i, j, x + i * pq->dsub);
            if (w) { /* (w o x).c against the weighted norms: the weighted nearest centroid */
                int e;
                for (e = 0; e < pq->dsub; e++) x[i * pq->dsub + e] = x[i * pq->dsub + e] * w[e];
            }
        }
        /* a metric block: x.(W_j c) against c.(W_j c) (pqc__pq_finish_sub) */
        pqc__k_assign(simd, x, n, pq->dsub, (pq->mblocks ? pq->wcent_t : pq->cent_t) + (size_t)j * pq->dsub * pq->ksub_pad,
                      (w || pq->mblocks ? pq->wnorm : pq->cnorm) + (size_t)j * pq->ksub_pad, pq->ksub_pad, pq->ksub, idx,
                      NULL);
        for (i = 0; i < n; i++) pqc__codes_put(codes, at + i, j, idx[i]);
    }
}

static pqc_result pqc__check_pq(const pqc_runtime *rt, const pqc_pq *pq, const char *what)
{
    if (!pq || !pq->centroids || !pq->cent_t || pq->m <= 0 || pq->bits < 1 || pq->bits > 8 || pq->dim != pq->m * pq->dsub)
        return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "%s: PQ is null or untrained", what);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_pq_encode(pqc_runtime *rt, const pqc_pq *pq, const pqc_matrix *keys, pqc_codes *codes)
{
    pqc_result r;
    size_t n, at, need, i, bytes, ch;
    float *x, *row;
    uint16_t *idx;
    unsigned char *mem, sbuf[PQC__SMALL_BUF];
    void *held;
    if ((r = pqc__check_pq(rt, pq, "pqc_pq_encode")) != PQC_SUCCESS) return r;
    if (!codes || !codes->data) {
        if (!codes || codes->m == 0) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_encode: codes not initialised");
    }
    if (codes->m != pq->m || codes->bits != pq->bits)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pqc_pq_encode: codes (m=%d, b=%d) do not match the PQ (m=%d, b=%d)",
                         codes->m, codes->bits, pq->m, pq->bits);
    if ((r = pqc__check_matrix(rt, keys, (size_t)pq->dim, "pqc_pq_encode keys")) != PQC_SUCCESS) return r;
    n = keys->rows;
    ch = PQC__MIN(n, (size_t)PQC__ENC_CHUNK); /* rows a chunk: a decode step's few fit on the stack */
    bytes = PQC__ALIGN_UP(ch * pq->dsub * sizeof(float)) + PQC__ALIGN_UP((size_t)(pq->dim + pq->dsub) * sizeof(float)) +
            ch * sizeof(uint16_t);
    mem = (unsigned char *)pqc__small_get(pqc__rt_alloc(rt), sbuf, sizeof sbuf, bytes, &held);
    if (!mem) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_encode: scratch allocation failed");
    x = (float *)mem;
    row = (float *)(mem + PQC__ALIGN_UP(ch * pq->dsub * sizeof(float)));
    idx = (uint16_t *)((unsigned char *)row + PQC__ALIGN_UP((size_t)(pq->dim + pq->dsub) * sizeof(float)));
    if ((r = pqc__check_finite(rt, keys, row, "pqc_pq_encode keys")) != PQC_SUCCESS) goto out;
    at = codes->count;
    need = at + n;
    if (need > codes->capacity) {
        size_t cap = codes->capacity ? codes->capacity : 64;
        while (cap < need) cap = cap + cap / 2 + 64;
        if ((r = pqc_codes_reserve(codes, cap)) != PQC_SUCCESS) goto out;
    }
    for (i = 0; i < n; i += ch) pqc__encode_rows(pqc__simd(rt), pq, keys, i, PQC__MIN(ch, n - i), codes, at + i, x, row, idx);
    codes->count = need;
out:
    pqc__free(pqc__rt_alloc(rt), held);
    return r;
}

static pqc_result pqc__pq_encode_nested(pqc_runtime *rt, const pqc_pq *pq, const pqc_matrix *keys, pqc_codes *codes)
{
    return pqc_pq_encode(rt, pq, keys, codes); /* encoding never submits jobs */
}

/* ----- quantizer files ----- */

#define PQC__PQ_MAGIC "PQCPQ\0\0\0"
#define PQC__PQ_VERSION 1u
#define PQC__PQ_HEAD 28 /* magic, version, dim, m, bits, flags */
typedef char pqc__float_is_binary32[sizeof(float) == 4 && sizeof(uint32_t) == 4 ? 1 : -1];

static void pqc__put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static uint32_t pqc__get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void pqc__put_f32s(unsigned char *p, const float *x, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        pqc__put_u32(p + 4 * i, u);
    }
}

PQCDEF pqc_result pqc_pq_save(const pqc_pq *pq, const char *path)
{
    size_t nc, nw, nb, bytes, i, len;
    unsigned char *buf;
    const void *part;
    uint64_t h;
    char why[300];
    pqc_result r;
    if ((r = pqc__check_pq(NULL, pq, "pqc_pq_save")) != PQC_SUCCESS) return r;
    if (!path) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_save: null path");
    nc = (size_t)pq->m * (size_t)pq->ksub * (size_t)pq->dsub;
    nw = pq->metric ? (size_t)pq->dim : 0;
    nb = pq->mblocks ? (size_t)pq->dim * (size_t)pq->dsub : 0; /* m dsub^2 */
    bytes = PQC__PQ_HEAD + 4 * (nc + nw + nb) + 8;
    if (!(buf = (unsigned char *)pqc__alloc(&pq->alloc, bytes)))
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_save: %zu bytes", bytes);
    memcpy(buf, PQC__PQ_MAGIC, 8);
    pqc__put_u32(buf + 8, PQC__PQ_VERSION);
    pqc__put_u32(buf + 12, (uint32_t)pq->dim);
    pqc__put_u32(buf + 16, (uint32_t)pq->m);
    pqc__put_u32(buf + 20, (uint32_t)pq->bits);
    pqc__put_u32(buf + 24, (pq->metric ? 1u : 0u) | (pq->half_bands ? 2u : 0u) | (pq->mblocks ? 4u : 0u));
    pqc__put_f32s(buf + PQC__PQ_HEAD, pq->centroids, nc);
    if (nw) pqc__put_f32s(buf + PQC__PQ_HEAD + 4 * nc, pq->metric, nw);
    if (nb) pqc__put_f32s(buf + PQC__PQ_HEAD + 4 * (nc + nw), pq->mblocks, nb);
    h = pqc__fnv(buf, bytes - 8, PQC__FNV_OFFSET);
    for (i = 0; i < 8; i++) buf[bytes - 8 + i] = (unsigned char)(h >> (8 * i));
    part = buf;
    len = bytes;
    r = pqc__write_atomic(path, &part, &len, 1, why, sizeof why) != 0
            ? pqc__fail(NULL, PQC_ERROR_IO, "pqc_pq_save: %s", why)
            : PQC_SUCCESS;
    pqc__free(&pq->alloc, buf);
    return r;
}

/* A codebook from read-in floats: centroids [m][2^bits][dim/m], metric weights (or
   NULL) and metric blocks [m][dim/m][dim/m] (or NULL), refused with PQC_ERROR_BAD_FILE
   (the message naming `what`) unless they are finite, the weights positive and the
   blocks symmetric positive definite. */
static pqc_result pqc__pq_from_floats(pqc_runtime *rt, pqc_pq *pq, int dim, int m, int bits, const float *cent,
                                      const float *w, const float *blocks, int half_bands, const char *what)
{
    size_t nc = (size_t)dim << bits, i;
    pqc_result r;
    int j;
    if (!pqc__within(cent, nc, PQC__KEY_LIMIT) || (w && !pqc__within(w, (size_t)dim, 1e30f)))
        return pqc__fail(rt, PQC_ERROR_BAD_FILE, "%s holds NaN, Inf or huge centroids or weights", what);
    for (i = 0; w && i < (size_t)dim; i++)
        if (!(w[i] > 0.0f)) return pqc__fail(rt, PQC_ERROR_BAD_FILE, "%s holds a metric weight <= 0", what);
    if (blocks && (dim / m > PQC__MAX_BLOCK || w))
        return pqc__fail(rt, PQC_ERROR_BAD_FILE, "%s holds metric blocks it cannot have", what);
    if ((r = pqc__pq_alloc(rt, pq, dim, m, bits, w, blocks, half_bands, PQC_ERROR_BAD_FILE, what)) != PQC_SUCCESS)
        return r;
    memcpy(pq->centroids, cent, nc * sizeof(float));
    for (j = 0; j < m; j++) pqc__pq_finish_sub(pq, j);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_pq_load(pqc_runtime *rt, const char *path, pqc_pq *out)
{
    unsigned char head[PQC__PQ_HEAD], *buf = NULL, extra;
    uint32_t dim, m, bits, flags;
    size_t nc, nw, nb, bytes, i;
    uint64_t h = 0;
    char why[300];
    FILE *fp;
    pqc_pq pq;
    pqc_result r;
    float *w = NULL, *wb = NULL;
    if (!path || !out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_load: null argument");
    if (!(fp = pqc__open_regular(path, why, sizeof why))) return pqc__fail(rt, PQC_ERROR_IO, "pqc_pq_load: %s", why);
    if (fread(head, 1, sizeof head, fp) != sizeof head || memcmp(head, PQC__PQ_MAGIC, 8) != 0) {
        fclose(fp);
        return pqc__fail(rt, PQC_ERROR_BAD_FILE, "pqc_pq_load: %.200s is not a pqcache quantizer file", path);
    }
    dim = pqc__get_u32(head + 12);
    m = pqc__get_u32(head + 16);
    bits = pqc__get_u32(head + 20);
    flags = pqc__get_u32(head + 24);
    if (pqc__get_u32(head + 8) != PQC__PQ_VERSION || dim == 0 || dim > 65536 || m == 0 || m > dim || dim % m ||
        bits < 1 || bits > 8 || flags > 7 || ((flags & 2) && (dim / m) % 2) || ((flags & 4) && (flags & 1)) ||
        ((flags & 4) && dim / m > PQC__MAX_BLOCK)) {
        fclose(fp);
        return pqc__fail(rt, PQC_ERROR_BAD_FILE,
                         "pqc_pq_load: %.200s: version %u, dim %u, m %u, bits %u or flags %u not understood", path,
                         (unsigned)pqc__get_u32(head + 8), (unsigned)dim, (unsigned)m, (unsigned)bits, (unsigned)flags);
    }
    nc = (size_t)dim << bits; /* m * 2^bits * dim/m */
    nw = (flags & 1) ? dim : 0;
    nb = (flags & 4) ? (size_t)dim * (dim / m) : 0;
    bytes = PQC__PQ_HEAD + 4 * (nc + nw + nb) + 8;
    if (!(buf = (unsigned char *)pqc__alloc(pqc__rt_alloc(rt), bytes))) {
        fclose(fp);
        return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_load: %zu bytes", bytes);
    }
    memcpy(buf, head, sizeof head);
    i = fread(buf + sizeof head, 1, bytes - sizeof head, fp);
    if (i != bytes - sizeof head || fread(&extra, 1, 1, fp) != 0) {
        fclose(fp);
        pqc__free(pqc__rt_alloc(rt), buf);
        return pqc__fail(rt, PQC_ERROR_BAD_FILE, "pqc_pq_load: %.200s is truncated or has trailing bytes", path);
    }
    fclose(fp);
    for (i = 0; i < 8; i++) h |= (uint64_t)buf[bytes - 8 + i] << (8 * i);
    if (h != pqc__fnv(buf, bytes - 8, PQC__FNV_OFFSET)) {
        pqc__free(pqc__rt_alloc(rt), buf);
        return pqc__fail(rt, PQC_ERROR_BAD_FILE, "pqc_pq_load: %.200s is damaged (checksum)", path);
    }
    /* the floats, in place (a float is 4 bytes: pqc__float_is_binary32), then checked */
    for (i = 0; i < nc + nw + nb; i++) {
        uint32_t u = pqc__get_u32(buf + PQC__PQ_HEAD + 4 * i);
        memcpy(buf + PQC__PQ_HEAD + 4 * i, &u, 4);
    }
    if (nw) w = (float *)(buf + PQC__PQ_HEAD) + nc;
    if (nb) wb = (float *)(buf + PQC__PQ_HEAD) + nc + nw;
    snprintf(why, sizeof why, "pqc_pq_load: %.200s", path);
    r = pqc__pq_from_floats(rt, &pq, (int)dim, (int)m, (int)bits, (const float *)(buf + PQC__PQ_HEAD), w, wb,
                            (flags & 2) != 0, why);
    pqc__free(pqc__rt_alloc(rt), buf);
    if (r != PQC_SUCCESS) return r;
    *out = pq;
    return PQC_SUCCESS;
}

/* The squared residual of token t's sub-space j: x (a key row, dim order) against its
   centroid, weighted by wj (the sub-space's metric weights in sub-space order) or by the
   codebook's metric block for sub-space j (r^T W_j r), or not. sub: dsub floats. */
static float pqc__sub_residual(const pqc_pq *pq, const pqc_codes *codes, size_t t, const float *x, int j,
                               const float *wj, float *sub)
{
    const float *cc = pq->centroids + ((size_t)j * pq->ksub + pqc_codes_get(codes, t, j)) * pq->dsub;
    float a = 0.0f;
    int e, b;
    pqc__gather_sub(pq, x, j, sub);
    if (pq->mblocks) {
        const float *w = pq->mblocks + (size_t)j * pq->dsub * pq->dsub;
        for (e = 0; e < pq->dsub; e++) sub[e] -= cc[e];
        for (e = 0; e < pq->dsub; e++) {
            float r = 0.0f;
            for (b = 0; b < pq->dsub; b++) r += w[(size_t)e * pq->dsub + b] * sub[b];
            a += r * sub[e];
        }
        return a > 0.0f ? a : 0.0f; /* positive definite: only rounding takes it below 0 */
    }
    for (e = 0; e < pq->dsub; e++) {
        float d = sub[e] - cc[e];
        a += (wj ? wj[e] * d : d) * d; /* not fmaf: a library call where FMA is not compiled in */
    }
    return a;
}

PQCDEF pqc_result pqc_pq_residuals(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, size_t first,
                                   const pqc_matrix *keys, float *scale, uint8_t *out)
{
    pqc_result r;
    size_t n, t;
    float *row, *nrm, *wsub, *sub;
    int j, set[256];
    if ((r = pqc__check_pq(rt, pq, "pqc_pq_residuals")) != PQC_SUCCESS) return r;
    if ((r = pqc__check_matrix(rt, keys, (size_t)pq->dim, "pqc_pq_residuals keys")) != PQC_SUCCESS) return r;
    if (!codes || !scale || !out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_residuals: null pointer");
    if (codes->m != pq->m || codes->bits != pq->bits)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pqc_pq_residuals: codes do not belong to this PQ");
    n = keys->rows;
    if (first > codes->count || n > codes->count - first)
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_residuals: tokens [%zu, %zu) beyond %zu coded", first,
                         first + n, codes->count);
    if (pq->m > 256) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_residuals: m = %d over 256", pq->m);
    for (j = 0; j < pq->m; j++) {
        if (!(scale[j] <= 1e30f)) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_residuals: scale[%d]", j);
        set[j] = scale[j] > 0.0f;
    }
    row = (float *)pqc__alloc(pqc__rt_alloc(rt), (3 * (size_t)pq->dim + n * (size_t)pq->m) * sizeof(float));
    if (!row) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_residuals: %zu rows", n);
    wsub = row + pq->dim; /* the metric's weights in sub-space order */
    sub = wsub + pq->dim;
    nrm = sub + pq->dim;
    for (j = 0; pq->metric && j < pq->m; j++) pqc__gather_sub(pq, pq->metric, j, wsub + (size_t)j * pq->dsub);
    for (t = 0; t < n; t++) {
        pqc__row_to_f32(pqc__row(keys, t), keys->dtype, (size_t)pq->dim, row);
        if (!pqc__finite_row(row, (size_t)pq->dim)) {
            pqc__free(pqc__rt_alloc(rt), row);
            return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_pq_residuals: key row %zu holds NaN, Inf or a huge value", t);
        }
        for (j = 0; j < pq->m; j++)
            nrm[t * (size_t)pq->m + (size_t)j] =
                sqrtf(pqc__sub_residual(pq, codes, first + t, row, j, pq->metric ? wsub + (size_t)j * pq->dsub : NULL, sub));
    }
    for (j = 0; j < pq->m; j++)
        if (!set[j]) {
            float mx = 0.0f;
            for (t = 0; t < n; t++) mx = nrm[t * (size_t)pq->m + (size_t)j] > mx ? nrm[t * (size_t)pq->m + (size_t)j] : mx;
            scale[j] = mx > 0.0f ? mx / 255.0f : 1.0f;
        }
    for (t = 0; t < n; t++)
        for (j = 0; j < pq->m; j++) {
            float q = ceilf(nrm[t * (size_t)pq->m + (size_t)j] / scale[j]);
            out[t * (size_t)pq->m + (size_t)j] = (uint8_t)(q >= 255.0f ? 255 : q <= 0.0f ? 0 : (int)q);
        }
    pqc__free(pqc__rt_alloc(rt), row);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_pq_decode(const pqc_pq *pq, const pqc_codes *codes, size_t t, float *out)
{
    int j;
    pqc_result r;
    if ((r = pqc__check_pq(NULL, pq, "pqc_pq_decode")) != PQC_SUCCESS) return r;
    if (!codes || !out) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_decode: null pointer");
    if (t >= codes->count) return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_decode: token %zu of %zu", t, codes->count);
    for (j = 0; j < pq->m; j++) {
        const float *c = pq->centroids + ((size_t)j * pq->ksub + pqc_codes_get(codes, t, j)) * pq->dsub;
        int e;
        for (e = 0; e < pq->dsub; e++) out[pqc_pq_dim(pq, j, e)] = c[e];
    }
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_pq_mse(pqc_runtime *rt, const pqc_pq *pq, const pqc_matrix *keys, double *mse)
{
    pqc_codes codes;
    pqc_result r;
    float *row, *rec;
    double acc = 0.0;
    size_t t;
    int e;
    if ((r = pqc__check_pq(rt, pq, "pqc_pq_mse")) != PQC_SUCCESS) return r;
    if (!mse) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_mse: null output");
    if ((r = pqc__check_matrix(rt, keys, (size_t)pq->dim, "pqc_pq_mse keys")) != PQC_SUCCESS) return r;
    if ((r = pqc_codes_init(&codes, pq, keys->rows, pqc__rt_alloc(rt))) != PQC_SUCCESS) return r;
    if ((r = pqc_pq_encode(rt, pq, keys, &codes)) != PQC_SUCCESS) {
        pqc_codes_free(&codes);
        return r;
    }
    row = (float *)pqc__alloc(&codes.alloc, 2 * (size_t)pq->dim * sizeof(float));
    if (!row) {
        pqc_codes_free(&codes);
        return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_mse: allocation failed");
    }
    rec = row + pq->dim;
    for (t = 0; t < keys->rows; t++) {
        pqc__row_to_f32(pqc__row(keys, t), keys->dtype, keys->cols, row);
        pqc_pq_decode(pq, &codes, t, rec);
        for (e = 0; e < pq->dim; e++) acc += (double)(row[e] - rec[e]) * (double)(row[e] - rec[e]);
    }
    *mse = acc / (double)keys->rows;
    pqc__free(&codes.alloc, row);
    pqc_codes_free(&codes);
    return PQC_SUCCESS;
}

/* ---------------------------------------------------------------------------------------
   8. Search
   ------------------------------------------------------------------------------------- */

PQCDEF pqc_result pqc_pq_lut(pqc_runtime *rt, const pqc_pq *pq, const float *queries, int g, float *lut)
{
    int h, j;
    float stack[1024], *qp = NULL;
    pqc_result r;
    if ((r = pqc__check_pq(rt, pq, "pqc_pq_lut")) != PQC_SUCCESS) return r;
    if (!queries || !lut) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_lut: null pointer");
    if (g <= 0 || g > 1024) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_lut: g = %d", g);
    if (!pqc__finite_row(queries, (size_t)g * pq->dim))
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_pq_lut: query holds NaN, Inf or a huge value");
    if (pq->half_bands) { /* rope bands over the half-split layout: each query row in
                             sub-space order first */
        const size_t nq = (size_t)g * (size_t)pq->dim;
        qp = nq <= 1024 ? stack : (float *)pqc__alloc(pqc__rt_alloc(rt), nq * sizeof(float));
        if (!qp) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_lut: scratch allocation failed");
        for (h = 0; h < g; h++)
            for (j = 0; j < pq->m; j++)
                pqc__gather_sub(pq, queries + (size_t)h * pq->dim, j, qp + (size_t)h * pq->dim + (size_t)j * pq->dsub);
    }
    for (j = 0; j < pq->m; j++) /* every head's table of sub-space j from one read of its centroids */
        pqc__k_dots_heads(pqc__simd(rt), (qp ? qp : queries) + (size_t)j * pq->dsub, (size_t)pq->dim, g, pq->dsub,
                          pq->cent_t + (size_t)j * pq->dsub * pq->ksub_pad, pq->ksub_pad, pq->ksub,
                          lut + (size_t)j * pq->ksub, (size_t)pq->m * pq->ksub);
    if (qp && qp != stack) pqc__free(pqc__rt_alloc(rt), qp);
    return PQC_SUCCESS;
}

/* Per-head score producer for the GQA combination. */
typedef void (*pqc__head_scores_fn)(void *ctx, int h, float *out);

/* Combined scores of g heads into out[n]: SUM asks for head -1 (the pre-combined head);
   SOFTMAX_SUM normalises each head over all n tokens and sums the probabilities.
   tmp: n floats. */
static void pqc__combine(pqc_simd simd, pqc_gqa gqa, int g, size_t n, float scale, pqc__head_scores_fn fn, void *ctx,
                         float *tmp, float *out)
{
    int h;
    if (gqa == PQC_GQA_SUM) {
        fn(ctx, -1, out);
        return;
    }
    for (h = 0; h < g; h++) {
        float mx, z;
        fn(ctx, h, tmp);
        mx = pqc__k_max(simd, tmp, n);
        z = pqc__k_expsum(simd, tmp, n, mx, scale, tmp);
        if (h == 0) memset(out, 0, n * sizeof(float));
        pqc__k_axpy(simd, tmp, n, 1.0f / z, out);
    }
}

/* Softmax-sum of g head rows (hs[h * n + t]; each head's maximum in mx, or NULL to find
   it): each row becomes its exponentials in place, out the sum of the heads'
   probabilities, as pqc__combine makes it head by head. w: g floats of scratch. */
static void pqc__softmax_rows(pqc_simd simd, float *hs, size_t n, int g, const float *mx, float scale, float *w,
                              float *out)
{
    int h;
    for (h = 0; h < g; h++) {
        float *e = hs + (size_t)h * n;
        w[h] = 1.0f / pqc__k_expsum(simd, e, n, mx ? mx[h] : pqc__k_max(simd, e, n), scale, e);
    }
    pqc__k_combine(simd, hs, n, g, n, w, out);
}

typedef struct pqc__pq_ctx {
    pqc_simd simd;
    const pqc_pq *pq;
    const pqc_codes *codes;
    const float *lut; /* [g][m][ksub] then the summed table [m][ksub] */
    int g;
    size_t first, count;
    const uint8_t *res; /* residual-aware scoring, or NULL */
    const float *rw;    /* [g + 1][m] weight of one residual byte per head (then the sum) */
    const float *xd;    /* rivals' exact dots [g][nx + nf] (see pqc__pq_scores_into), or NULL */
    size_t nx, nf;
} pqc__pq_ctx;

static void pqc__pq_head(void *p, int h, float *out)
{
    pqc__pq_ctx *c = (pqc__pq_ctx *)p;
    size_t tl = (size_t)c->pq->m * c->pq->ksub;
    const float *lut = h < 0 ? c->lut + (size_t)c->g * tl : c->lut + (size_t)h * tl;
    pqc__k_scan(c->simd, c->codes, lut, c->pq->ksub, c->first, c->count, out);
    if (c->res) {
        const float *w = c->rw + (size_t)(h < 0 ? c->g : h) * (size_t)c->pq->m;
        const uint8_t *r = c->res + c->first * (size_t)c->pq->m;
        size_t t, m = (size_t)c->pq->m;
        int j;
        if (m == 2) {
            float w0 = w[0], w1 = w[1];
            for (t = 0; t < c->count; t++) out[t] += w0 * (float)r[2 * t] + w1 * (float)r[2 * t + 1];
        } else {
            for (t = 0; t < c->count; t++) {
                float a = 0.0f;
                for (j = 0; j < (int)m; j++) a += w[j] * (float)r[t * m + (size_t)j];
                out[t] += a;
            }
        }
    }
    if (c->nx + c->nf > 0) { /* the rivals after the codes: a head's dots, or (SUM) their sum over the heads */
        size_t i, nxf = c->nx + c->nf;
        int hh;
        if (h >= 0) {
            memcpy(out + c->count, c->xd + (size_t)h * nxf, nxf * sizeof(float));
        } else {
            for (i = 0; i < nxf; i++) {
                float a = 0.0f;
                for (hh = 0; hh < c->g; hh++) a += c->xd[(size_t)hh * nxf + i];
                out[c->count + i] = a;
            }
        }
    }
}

/* The default softmax scale, 1/sqrt(d_h), as the float every score is scaled by. */
static float pqc__default_scale(int d) { return 1.0f / sqrtf((float)d); }

/* a search desc's softmax scale (checked by pqc__search_prep): 0 = 1/sqrt(d_h) */
static float pqc__search_scale(const pqc_search_desc *desc, int d)
{
    return desc && desc->softmax_scale > 0.0f ? desc->softmax_scale : pqc__default_scale(d);
}

static pqc_result pqc__search_prep(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries, int g,
                                   const pqc_search_desc *desc, size_t *first, size_t *count, pqc_gqa *gqa)
{
    pqc_result r;
    if ((r = pqc__check_pq(rt, pq, "pqc_pq_search")) != PQC_SUCCESS) return r;
    if (!codes || !queries || !desc) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_search: null pointer");
    if (codes->m != pq->m || codes->bits != pq->bits)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pqc_pq_search: codes do not belong to this PQ");
    if (g <= 0 || g > 1024) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: g = %d", g);
    if ((int)desc->gqa < 0 || (int)desc->gqa > 1) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown gqa mode");
    if (!(desc->softmax_scale >= 0.0f && desc->softmax_scale <= 1e6f))
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE,
                         "pqc_pq_search: softmax_scale %g (0 = 1/sqrt(d_h), else up to 1e6)",
                         (double)desc->softmax_scale);
    *gqa = desc->gqa;
    *first = desc->first;
    *count = desc->count ? desc->count : (desc->first < codes->count ? codes->count - desc->first : 0);
    if (codes->count == 0 || *count == 0) return pqc__fail(rt, PQC_ERROR_EMPTY, "pqc_pq_search: no coded tokens");
    if (*first > codes->count || *count > codes->count - *first)
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: tokens [%zu, %zu) beyond %zu coded", *first,
                         *first + *count, codes->count);
    if (*count > 0xffffffffu) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: more than 2^32 tokens");
    if (desc->residuals) {
        int j;
        if (!desc->residual_scale)
            return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_search: residuals without residual_scale");
        if (!(desc->residual_weight > 0.0f && desc->residual_weight <= 1e6f))
            return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: residual_weight %g (0 < w <= 1e6)",
                             (double)desc->residual_weight);
        for (j = 0; j < pq->m; j++)
            if (!(desc->residual_scale[j] >= 0.0f && desc->residual_scale[j] <= 1e30f))
                return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: residual_scale[%d] = %g", j,
                                 (double)desc->residual_scale[j]);
    }
    return PQC_SUCCESS;
}

/* Softmax-sum over 8-bit codes without residuals, two or more heads: one pass over the
   codes gives every head's exponentials (pqc__pq_softmax_products). A single head keeps
   the exponentials of its scores (the four-head scan cost more than that saved). */
#define PQC__FUSED_MIN_G 2
static int pqc__fused_heads(const pqc_pq *pq, int g, pqc_gqa gqa, const pqc_search_desc *desc)
{
    return gqa == PQC_GQA_SOFTMAX_SUM && pq->bits == 8 && g >= PQC__FUSED_MIN_G && !(desc && desc->residuals);
}

/* The smallest sum of a head's products for pqc__pq_softmax_products' results to stand
   (2^-20): the products are taken relative to the sum of the sub-spaces' best entries,
   which no token may reach; with this the best token's product is at least 2^-52 (at
   most 2^32 tokens), and every token within 2^-74 of it a normal number, as with the
   exponentials of the scores' differences. */
#define PQC__PROD_FLOOR 9.5367431640625e-07f
/* g heads padded to a multiple of four (the scan's groups): the padding heads' tables are
   ones, their rows unused */
#define PQC__HEADS4(g) (((g) + 3) & ~3)

/* Softmax-sum of g heads (8-bit codes; padded to a multiple of four for the scan, the
   padding heads' tables ones and their rows unused) with each head's exponentials as
   products: E_hj[c] = pqc_exp((lut_h[j][c] - M_hj) * scale), M_hj the table's largest
   entry, and token t's exponential under head h is the product over j (ascending, from 1)
   of E_hj[code_j(t)], the exponential of its score less sum_j M_hj: no exponential per
   token and head, and no pass for the maxima. Z_h = the sum of head h's products (in
   pqc__lanesum's order, pqc__k_scan_products), out = pqc__k_combine of the rows with
   weights 1/Z_h. lut: the heads' tables [g][m][ksub]; el: gp * m * ksub floats of work
   (each group of four heads' exponentials interleaved, [m][ksub][4], gp =
   PQC__HEADS4(g)); w: 3gp floats; rows: gp * count floats, head h's at rows + h * count
   (rows may be out itself, gp * count + nx + nf floats then: head 0's row is combined
   in place, and the working set is a row smaller: at 128K, where the rows no longer
   stay in L2, 0.1 ns of a token's 2.3). Returns 0 (no score written; rows in out are
   left there) when some head's Z_h is below PQC__PROD_FLOOR (queries whose sub-spaces'
   best entries add up far beyond any token's score): the caller then takes the
   exponentials of the scores. The results differ from those by rounding only (a few
   units in the last place); every level makes these bit for bit.
   Rivals (nx > 0: tokens outside the codes, xd their exact dots, then nf more tokens'
   that only join the normalisation; head h's nx + nf at xd + h * (nx + nf)): their
   exponentials relative to the same sum, S_h = sum_j M_hj (j ascending, from 0),
   pqc__k_expsum of the nx + nf with maximum S_h (into ex, g * (nx + nf) floats), join Z_h
   (added after the products' sum), and all are combined into out[count..count + nx +
   nf). A token more than PQC__RIVAL_ABOVE above S_h (scaled) returns 0 too. */
#define PQC__RIVAL_ABOVE 20.0f
static int pqc__pq_softmax_products(pqc_simd simd, const pqc_pq *pq, const pqc_codes *codes, int g, size_t first,
                                    size_t count, float scale, float *lut, float *el, float *w, float *rows,
                                    const float *xd, size_t nx, size_t nf, float *ex, float *out)
{
    size_t i, ks = (size_t)pq->ksub, tl = (size_t)pq->m * ks, nxf = nx + nf;
    float e[4][256];
    int h, j, q, gp = PQC__HEADS4(g);
    for (h = 0; h < g; h++) w[2 * gp + h] = 0.0f;
    for (h = 0; h < gp; h += 4) { /* each group of four heads' tables interleaved, [m][ksub][4] */
        for (j = 0; j < pq->m; j++) {
            float *o = el + (size_t)h * tl + (size_t)j * ks * 4;
            for (q = 0; q < 4; q++) {
                if (h + q < g) {
                    const float *t = lut + ((size_t)(h + q) * pq->m + (size_t)j) * ks;
                    float mj = pqc__k_max(simd, t, ks);
                    w[2 * gp + h + q] += mj;
                    (void)pqc__k_expsum(simd, t, ks, mj, scale, e[q]);
                } else {
                    for (i = 0; i < ks; i++) e[q][i] = 1.0f;
                }
            }
            /* a sub-space's four tables written together: whole lines, in order (one head
               at a time, every line was written four times: 1.6 of a 4K search's 20 us) */
            for (i = 0; i < ks; i++) {
                o[4 * i] = e[0][i];
                o[4 * i + 1] = e[1][i];
                o[4 * i + 2] = e[2][i];
                o[4 * i + 3] = e[3][i];
            }
        }
    }
    for (h = 0; h < gp; h += 4) /* a pass over the codes a group (the four-head kernel) */
        pqc__k_scan_products(simd, codes, el + (size_t)h * tl, pq->ksub, first, count, rows + (size_t)h * count, count,
                             w + h);
    for (h = 0; h < g; h++)
        if (!(w[h] >= PQC__PROD_FLOOR)) return 0;
    for (h = 0; nxf > 0 && h < g; h++)
        if (!((pqc__k_max(simd, xd + (size_t)h * nxf, nxf) - w[2 * gp + h]) * scale <= PQC__RIVAL_ABOVE)) return 0;
    for (h = 0; nxf > 0 && h < g; h++)
        w[h] += pqc__k_expsum(simd, xd + (size_t)h * nxf, nxf, w[2 * gp + h], scale, ex + (size_t)h * nxf);
    for (h = 0; h < g; h++) w[gp + h] = 1.0f / w[h];
    for (i = count; i > 0;) { /* the last rows written first: they are still in cache */
        size_t b = i > 4096 ? i - 4096 : 0;
        pqc__k_combine(simd, rows + b, count, g, i - b, w + gp, out + b);
        i = b;
    }
    if (nxf > 0) pqc__k_combine(simd, ex, nxf, g, nxf, w + gp, out + count);
    return 1;
}

/* scores of the searched range into out; work: lut + tmp from scratch (sized
   by pqc__pq_search_impl). Rivals (nx > 0; the cache's window tokens that compete with
   the coded ones): tokens without codes whose exact dots with each head are known, and
   nf more such tokens that are not chosen from (the cache's sinks and the window's
   last tokens) but count in each head's softmax (xd: head h's nx + nf at xd + h * (nx +
   nf)); their scores follow the range's, out[count..count + nx + nf), made as a coded
   token's are from its heads' PQ scores (SUM: the dots summed over the heads in order;
   softmax-sum: each head normalised over the range and all nx + nf together). */
static pqc_result pqc__pq_scores_into(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries,
                                      int g, pqc_gqa gqa, size_t first, size_t count, const pqc_search_desc *desc,
                                      const float *xd, size_t nx, size_t nf, float *lut, float *rw, float *tmp,
                                      float *out, int rows_in_out)
{
    pqc__pq_ctx c;
    pqc_result r;
    size_t tl = (size_t)pq->m * pq->ksub, i;
    int h;
    if ((r = pqc_pq_lut(rt, pq, queries, g, lut)) != PQC_SUCCESS) return r;
    if (gqa == PQC_GQA_SUM) {
        float *sum = lut + (size_t)g * tl;
        for (i = 0; i < tl; i++) {
            float a = 0.0f;
            for (h = 0; h < g; h++) a += lut[(size_t)h * tl + i];
            sum[i] = a;
        }
    }
    c.simd = pqc__simd(rt);
    c.pq = pq;
    c.codes = codes;
    c.lut = lut;
    c.g = g;
    c.first = first;
    c.count = count;
    c.res = NULL;
    c.rw = rw;
    c.xd = xd;
    c.nx = nx;
    c.nf = nf;
    if (desc && desc->residuals) { /* per head and sub-space: weight x |q_j| x one step */
        int j, e;
        c.res = desc->residuals;
        for (j = 0; j < pq->m; j++) rw[(size_t)g * pq->m + (size_t)j] = 0.0f;
        for (h = 0; h < g; h++)
            for (j = 0; j < pq->m; j++) {
                const float *qh = queries + (size_t)h * pq->dim;
                float a = 0.0f, v;
                if (pq->mchol) { /* q_j^T W_j^-1 q_j = |z|^2 with L_j z = q_j */
                    const float *l = pq->mchol + (size_t)j * pq->dsub * pq->dsub;
                    float z[PQC__MAX_BLOCK];
                    int b;
                    for (e = 0; e < pq->dsub; e++) {
                        float t = qh[pqc_pq_dim(pq, j, e)];
                        for (b = 0; b < e; b++) t -= l[(size_t)e * pq->dsub + b] * z[b];
                        z[e] = t / l[(size_t)e * pq->dsub + e];
                        a += z[e] * z[e];
                    }
                } else {
                    for (e = 0; e < pq->dsub; e++) {
                        int dim = pqc_pq_dim(pq, j, e);
                        a += qh[dim] * qh[dim] / (pq->metric ? pq->metric[dim] : 1.0f);
                    }
                }
                v = desc->residual_weight * sqrtf(a) * desc->residual_scale[j];
                rw[(size_t)h * pq->m + (size_t)j] = v;
                rw[(size_t)g * pq->m + (size_t)j] += v; /* SUM: the heads' bounds add up */
            }
    }
    if (pqc__fused_heads(pq, g, gqa, desc)) {
        float *il = lut + ((size_t)g + 1) * tl, *mx = rw;
        float scale = pqc__search_scale(desc, pq->dim);
        size_t gp = (size_t)PQC__HEADS4(g), nxf = nx + nf, na = count + nxf;
        if (pqc__pq_softmax_products(c.simd, pq, codes, g, first, count, scale, lut, il + (size_t)g * tl, rw,
                                     rows_in_out ? out : tmp, xd, nx, nf, tmp + gp * count, out))
            return PQC_SUCCESS;
        /* the exponential of each sum: every head's scores in one pass over the codes,
           from the heads' tables interleaved (the rivals' dots after them); then each
           head's softmax and the sum, as pqc__combine makes them */
        for (h = 0; h < g; h++)
            for (i = 0; i < tl; i++) il[i * (size_t)g + (size_t)h] = lut[(size_t)h * tl + i];
        for (h = 0; h < g; h++) mx[h] = -INFINITY;
        pqc__k_scan_heads(c.simd, codes, il, pq->ksub, g, first, count, tmp, na, mx);
        for (h = 0; nxf > 0 && h < g; h++) {
            float *row = tmp + (size_t)h * na + count, xm;
            memcpy(row, xd + (size_t)h * nxf, nxf * sizeof(float));
            xm = pqc__k_max(c.simd, row, nxf);
            if (xm > mx[h]) mx[h] = xm;
        }
        pqc__softmax_rows(c.simd, tmp, na, g, mx, scale, rw + g, out);
        return PQC_SUCCESS;
    }
    pqc__combine(c.simd, gqa, g, count + nx + nf, pqc__search_scale(desc, pq->dim), pqc__pq_head, &c, tmp, out);
    return PQC_SUCCESS;
}

/* scratch layout: lut ((g+1)*m*ksub) | tmp (count) | scores (count) | cand (count u32).
   With rivals (xd, nx, nf: see pqc__pq_scores_into; the range must start at token 0) the
   top k are chosen from the range and the nx rivals together, rival i as index count + i
   (all_out: count + nx + nf scores). */
static pqc_result pqc__pq_search_x(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries,
                                   int g, const pqc_search_desc *desc, const float *xd, size_t nx, size_t nf,
                                   pqc_scratch *scratch, uint32_t *idx, float *scores, float *all_out)
{
    size_t first = 0, count = 0, ol, orw, ot, os, oc, bytes, gp, na, nc;
    pqc_gqa gqa = PQC_GQA_SOFTMAX_SUM;
    pqc_result r;
    unsigned char *mem;
    void *tmpmem;
    int fused;
    if ((r = pqc__search_prep(rt, pq, codes, queries, g, desc, &first, &count, &gqa)) != PQC_SUCCESS) return r;
    if (nx + nf > 0 && first > 0) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_search: rivals after a range");
    na = count + nx + nf; /* scores */
    nc = count + nx;      /* chosen from */
    if (!all_out) {
        if (!idx) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_search: null idx");
        if (desc->k == 0 || desc->k > nc)
            return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: k = %zu not in 1..%zu", desc->k, nc);
    }
    fused = pqc__fused_heads(pq, g, gqa, desc);
    gp = (size_t)PQC__HEADS4(g);
    /* tables [g + 1][m][ksub], then where fused the interleaved [m][ksub][g] and the
       exponentials' gp * m * ksub */
    ol = 0;
    orw = PQC__ALIGN_UP(((size_t)g + 1 + (fused ? (size_t)g + gp : 0)) * pq->m * pq->ksub * sizeof(float));
    /* residual weights [g + 1][m], or the fused heads' maxima, weights and sums of their
       sub-spaces' maxima [3gp] */
    ot = orw + PQC__ALIGN_UP(PQC__MAX(((size_t)g + 1) * pq->m, 3 * gp) * sizeof(float));
    /* the heads' rows (and the rivals' exponentials); the scores, where fused the heads'
       rows too (pqc__pq_softmax_products, head 0's combined in place) */
    os = ot + PQC__ALIGN_UP((fused ? gp : 1) * na * sizeof(float));
    oc = os + PQC__ALIGN_UP((fused ? gp * count + nx + nf : na) * sizeof(float));
    bytes = oc + (all_out ? 0 : pqc__select_scratch(nc));
    mem = (unsigned char *)pqc__scratch_get(scratch, pqc__rt_alloc(rt), bytes, &tmpmem);
    if (!mem) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_search: scratch allocation failed");
    r = pqc__pq_scores_into(rt, pq, codes, queries, g, gqa, first, count, desc, xd, nx, nf, (float *)(mem + ol),
                            (float *)(mem + orw), (float *)(mem + ot), all_out ? all_out : (float *)(mem + os),
                            fused && !all_out);
    if (r == PQC_SUCCESS && !all_out) {
        size_t i;
        pqc__select(pqc__simd(rt), (const float *)(mem + os), nc, desc->k, mem + oc, idx, scores);
        if (first)
            for (i = 0; i < desc->k; i++) idx[i] += (uint32_t)first;
    }
    pqc__free(pqc__rt_alloc(rt), tmpmem);
    return r;
}
static pqc_result pqc__pq_search_impl(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries,
                                      int g, const pqc_search_desc *desc, pqc_scratch *scratch, uint32_t *idx,
                                      float *scores, float *all_out)
{
    return pqc__pq_search_x(rt, pq, codes, queries, g, desc, NULL, 0, 0, scratch, idx, scores, all_out);
}

PQCDEF pqc_result pqc_pq_scores(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries, int g,
                                const pqc_search_desc *desc, pqc_scratch *scratch, float *out)
{
    if (!out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_scores: null output");
    return pqc__pq_search_impl(rt, pq, codes, queries, g, desc, scratch, NULL, NULL, out);
}

/* ----- exact reference ----- */

typedef struct pqc__exact_ctx {
    pqc_simd simd;
    const pqc_matrix *keys;
    const float *q; /* [g][d] then the summed query [d] */
    int g, d;
    float *rowbuf; /* a row in fp32 (d floats of scratch) */
    int check;     /* the next pass over the keys also checks them (the first one) */
    size_t bad;    /* the first row holding NaN, Inf or a magnitude above the key limit, or
                      (size_t)-1 */
} pqc__exact_ctx;

/* Scores a chunk of rows at a time; the first pass checks each chunk's values while they
   are in cache, so that a key that cannot be ranked costs no pass of its own. */
#define PQC__EXACT_CHUNK 64

/* The rows' scores against one head's query (h < 0: the summed query). */
static void pqc__exact_head(void *p, int h, float *out)
{
    pqc__exact_ctx *c = (pqc__exact_ctx *)p;
    const float *q = c->q + (size_t)(h < 0 ? c->g : h) * c->d;
    const unsigned char *base = (const unsigned char *)c->keys->data;
    size_t t, n = c->keys->rows, stride = pqc__stride(c->keys);
    int check = c->check;
    c->check = 0;
    /* the keys checked and scored in one pass (fp16 and bf16 converted on the way) */
    for (t = 0; t < n; t += PQC__EXACT_CHUNK) {
        size_t b = PQC__MIN((size_t)PQC__EXACT_CHUNK, n - t);
        size_t bad = pqc__k_keydots(c->simd, q, base + t * stride, stride, c->keys->dtype, b, c->d, PQC__KEY_LIMIT,
                                    c->rowbuf, out + t);
        if (check && c->bad == (size_t)-1 && bad < b) c->bad = t + bad;
    }
}

/* Every head's scores in one pass over the keys: out[h * n + t], each row checked, then
   multiplied with every head's query while it is in registers (pqc__gatherdots; the dots
   pqc__exact_head makes a head at a time: the same chains, a product's factors commute).
   The first row that cannot be ranked stops the pass and is noted in c->bad. Against a
   chunk of 64 rows converted and checked, then each head's dots over the chunk: 128K
   rows of d_h 128, 4 heads, one core, fp16 103-104 -> 56-77 ns per row, fp32 103-108 ->
   93-102, the same selections. */
static void pqc__exact_heads(pqc__exact_ctx *c, float *out)
{
    size_t n = c->keys->rows, bad;
    c->check = 0;
    bad = pqc__k_gatherdots(c->simd, c->q, c->g, (const unsigned char *)c->keys->data, pqc__stride(c->keys),
                            c->keys->dtype, NULL, n, c->d, 1, PQC__KEY_LIMIT, c->rowbuf, out, n);
    if (bad < n) c->bad = bad;
}

static pqc_result pqc__exact_impl(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                                  float scale, size_t k, pqc_scratch *scratch, uint32_t *idx, float *scores,
                                  float *all_out)
{
    pqc__exact_ctx c;
    pqc_result r;
    size_t n, d, oq, ow, orow, ot, os, oc, bytes, i;
    unsigned char *mem;
    void *tmpmem;
    int h, heads;
    if ((r = pqc__check_matrix(rt, keys, 0, "pqc_exact_search keys")) != PQC_SUCCESS) return r;
    if (!queries) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_exact_search: null queries");
    if (g <= 0 || g > 1024) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_exact_search: g = %d", g);
    if ((int)gqa < 0 || (int)gqa > 1) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown gqa mode");
    if (!(scale >= 0.0f && scale <= 1e6f))
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE,
                         "pqc_exact_search: softmax_scale %g (0 = 1/sqrt(d_h), else up to 1e6)", (double)scale);
    n = keys->rows;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)keys->cols);
    d = keys->cols;
    if (n > 0xffffffffu) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_exact_search: more than 2^32 tokens");
    if (!all_out && (!idx || k == 0 || k > n))
        return pqc__fail(rt, idx ? PQC_ERROR_OUT_OF_RANGE : PQC_ERROR_INVALID_ARGUMENT, "pqc_exact_search: k = %zu not in 1..%zu", k, n);
    if (!pqc__finite_row(queries, (size_t)g * d))
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_exact_search: query holds NaN, Inf or a huge value");
    heads = gqa == PQC_GQA_SOFTMAX_SUM && g > 1; /* every head in one pass over the keys */
    oq = 0;
    ow = PQC__ALIGN_UP(((size_t)g + 1) * d * sizeof(float)); /* then the heads' softmax weights [g] */
    orow = ow + PQC__ALIGN_UP((size_t)g * sizeof(float));
    ot = orow + PQC__ALIGN_UP(d * sizeof(float));
    os = ot + PQC__ALIGN_UP((heads ? (size_t)g : 1) * n * sizeof(float));
    oc = os + PQC__ALIGN_UP(n * sizeof(float));
    bytes = oc + (all_out ? 0 : pqc__select_scratch(n));
    mem = (unsigned char *)pqc__scratch_get(scratch, pqc__rt_alloc(rt), bytes, &tmpmem);
    if (!mem) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_exact_search: scratch allocation failed");
    c.simd = pqc__simd(rt);
    c.check = 1;
    c.bad = (size_t)-1;
    c.keys = keys;
    c.q = (const float *)(mem + oq);
    c.g = g;
    c.d = (int)d;
    c.rowbuf = (float *)(mem + orow);
    memcpy(mem + oq, queries, (size_t)g * d * sizeof(float));
    for (i = 0; i < d; i++) {
        float a = 0.0f;
        for (h = 0; h < g; h++) a += queries[(size_t)h * d + i];
        ((float *)(mem + oq))[(size_t)g * d + i] = a;
    }
    if (heads) { /* as pqc__combine makes it, from the heads' rows */
        pqc__exact_heads(&c, (float *)(mem + ot));
        if (c.bad == (size_t)-1)
            pqc__softmax_rows(c.simd, (float *)(mem + ot), n, g, NULL, scale, (float *)(mem + ow),
                              (float *)(mem + os));
    } else {
        pqc__combine(c.simd, gqa, g, n, scale, pqc__exact_head, &c, (float *)(mem + ot),
                     (float *)(mem + os));
    }
    if (c.bad != (size_t)-1) { /* keys with NaN or Inf have no ranking: refused like such queries */
        pqc__free(pqc__rt_alloc(rt), tmpmem);
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_exact_search keys: row %zu holds NaN, Inf or a magnitude above %g",
                         c.bad, (double)PQC__KEY_LIMIT);
    }
    if (all_out) memcpy(all_out, mem + os, n * sizeof(float));
    else pqc__select(c.simd, (const float *)(mem + os), n, k, mem + oc, idx, scores);
    pqc__free(pqc__rt_alloc(rt), tmpmem);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_exact_search(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g,
                                   const pqc_search_desc *desc, pqc_scratch *scratch, uint32_t *idx, float *scores)
{
    if (!desc) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_exact_search: null desc");
    return pqc__exact_impl(rt, keys, queries, g, desc->gqa, desc->softmax_scale, desc->k, scratch, idx, scores, NULL);
}

PQCDEF pqc_result pqc_exact_scores(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                                   pqc_scratch *scratch, float *out)
{
    if (!out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_exact_scores: null output");
    return pqc__exact_impl(rt, keys, queries, g, gqa, 0.0f, 0, scratch, NULL, NULL, out);
}

/* ----- re-ranking ----- */

/* The caller has checked the arguments (and, unless `check`, that the candidates' rows
   are finite: the cache stores only such rows). scratch: the heads' scores [g][n] |
   combined [n] | positions [k] | selection scratch | one converted row [d] | the heads'
   weights [g]. The scores are those pqc_exact_search makes of the same rows (the same
   dots and, for SOFTMAX_SUM, the same softmax, pqc__softmax_rows, over the candidates):
   re-ranking every row is the exact search bit for bit. The last nf candidates only join
   the softmax (a cache's sinks and window): scored, never chosen. The candidates' rows are
   scattered over the keys, so their reads are memory-bound: pqc__gatherdots asks for each
   row early and takes every head's dot of a row in one go. */
static pqc_result pqc__rerank_impl(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                                   float scale, const uint32_t *cand, size_t n, size_t k, pqc_scratch *scratch,
                                   uint32_t *idx, float *scores, int check, size_t nf)
{
    size_t d = keys->cols, i, oc, op, os, orow, bytes, bad;
    float *hs, *comb, *row;
    uint32_t *pos;
    unsigned char *mem;
    void *tmpmem;
    pqc_simd simd = pqc__simd(rt);
    int h;
    oc = PQC__ALIGN_UP(n * (size_t)g * sizeof(float));
    op = oc + PQC__ALIGN_UP(n * sizeof(float));
    os = op + PQC__ALIGN_UP(k * sizeof(uint32_t));
    orow = os + PQC__ALIGN_UP(pqc__select_scratch(n));
    bytes = orow + (d + (size_t)g) * sizeof(float);
    mem = (unsigned char *)pqc__scratch_get(scratch, pqc__rt_alloc(rt), bytes, &tmpmem);
    if (!mem) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_rerank: scratch allocation failed");
    hs = (float *)mem;
    comb = (float *)(mem + oc);
    pos = (uint32_t *)(mem + op);
    row = (float *)(mem + orow);
    bad = pqc__k_gatherdots(simd, queries, g, (const unsigned char *)keys->data, pqc__stride(keys), keys->dtype, cand, n,
                            (int)d, check, PQC__KEY_LIMIT, row, hs, n);
    if (bad < n) {
        pqc__free(pqc__rt_alloc(rt), tmpmem);
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_rerank: key row %u holds NaN, Inf or a huge value",
                         (unsigned)cand[bad]);
    }
    if (gqa == PQC_GQA_SUM) {
        for (i = 0; i < n; i++) {
            float a = 0.0f;
            for (h = 0; h < g; h++) a += hs[(size_t)h * n + i];
            comb[i] = a;
        }
    } else {
        pqc__softmax_rows(simd, hs, n, g, NULL, scale, row + d, comb);
    }
    pqc__select(simd, comb, n - nf, k, mem + os, pos, NULL);
    /* pos is ascending, so pos[i] >= i: idx may overwrite cand in place */
    for (i = 0; i < k; i++) {
        if (scores) scores[i] = comb[pos[i]];
        idx[i] = cand[pos[i]];
    }
    pqc__free(pqc__rt_alloc(rt), tmpmem);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_rerank(pqc_runtime *rt, const pqc_matrix *keys, const float *queries, int g, pqc_gqa gqa,
                             const uint32_t *cand, size_t n, size_t k, pqc_scratch *scratch, uint32_t *idx,
                             float *scores)
{
    pqc_result r;
    size_t i;
    if ((r = pqc__check_matrix(rt, keys, 0, "pqc_rerank keys")) != PQC_SUCCESS) return r;
    if (!queries || !cand || !idx) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_rerank: null pointer");
    if (g <= 0 || g > 1024) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_rerank: g = %d", g);
    if (keys->cols > 65536) return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pqc_rerank: %zu columns", keys->cols);
    if ((int)gqa < 0 || (int)gqa > 1) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "unknown gqa mode");
    if (n == 0) return pqc__fail(rt, PQC_ERROR_EMPTY, "pqc_rerank: no candidates");
    if (n > 0xffffffffu) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_rerank: more than 2^32 candidates");
    if (k == 0 || k > n) return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_rerank: k = %zu not in 1..%zu", k, n);
    for (i = 0; i < n; i++)
        if (cand[i] >= keys->rows || (i > 0 && cand[i] <= cand[i - 1]))
            return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE,
                             "pqc_rerank: candidate %zu (row %u) beyond %zu rows or not strictly ascending", i,
                             (unsigned)cand[i], keys->rows);
    if (!pqc__finite_row(queries, (size_t)g * keys->cols))
        return pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_rerank: query holds NaN, Inf or a huge value");
    return pqc__rerank_impl(rt, keys, queries, g, gqa, pqc__default_scale((int)keys->cols), cand, n, k, scratch, idx,
                            scores, 1, 0);
}

PQCDEF pqc_result pqc_pq_search(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *queries, int g,
                                const pqc_search_desc *desc, pqc_scratch *scratch, uint32_t *idx, float *scores)
{
    pqc_search_desc wide;
    size_t first = 0, count = 0, kk;
    pqc_gqa gqa = PQC_GQA_SOFTMAX_SUM;
    pqc_result r;
    uint32_t *cand;
    if (!desc || desc->rerank == 0) return pqc__pq_search_impl(rt, pq, codes, queries, g, desc, scratch, idx, scores, NULL);
    /* re-ranked: the PQ top ceil(rerank * k), scored again with the exact keys */
    if ((r = pqc__search_prep(rt, pq, codes, queries, g, desc, &first, &count, &gqa)) != PQC_SUCCESS) return r;
    if (!(desc->rerank >= 1.0 && desc->rerank <= 1e6))
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: rerank %g (0 = off, else 1..1e6)", desc->rerank);
    if ((r = pqc__check_matrix(rt, desc->keys, (size_t)pq->dim, "pqc_pq_search rerank keys")) != PQC_SUCCESS) return r;
    if (desc->keys->rows < codes->count)
        return pqc__fail(rt, PQC_ERROR_BAD_SHAPE, "pqc_pq_search: %zu exact keys for %zu coded tokens", desc->keys->rows,
                         codes->count);
    if (!idx) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_pq_search: null idx");
    if (desc->k == 0 || desc->k > count)
        return pqc__fail(rt, PQC_ERROR_OUT_OF_RANGE, "pqc_pq_search: k = %zu not in 1..%zu", desc->k, count);
    kk = (size_t)PQC__MIN(ceil(desc->rerank * (double)desc->k), (double)count);
    cand = (uint32_t *)pqc__alloc(pqc__rt_alloc(rt), kk * sizeof(uint32_t));
    if (!cand) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_pq_search: %zu candidates", kk);
    wide = *desc;
    wide.k = kk;
    r = pqc__pq_search_impl(rt, pq, codes, queries, g, &wide, scratch, cand, NULL, NULL);
    if (r == PQC_SUCCESS) {
        if (!pqc__finite_row(queries, (size_t)g * (size_t)pq->dim))
            r = pqc__fail(rt, PQC_ERROR_NON_FINITE, "pqc_pq_search: query holds NaN, Inf or a huge value");
        else r = pqc__rerank_impl(rt, desc->keys, queries, g, gqa, pqc__search_scale(desc, pq->dim), cand, kk, desc->k,
                                  scratch, idx, scores, 1, 0);
    }
    pqc__free(pqc__rt_alloc(rt), cand);
    return r;
}

/* ---------------------------------------------------------------------------------------
   9. Scheduler
   ------------------------------------------------------------------------------------- */

struct pqc_scheduler {
    pqc_allocator alloc;
    int t_min, t_max, t_default;
    double parallel;
    /* least-squares sums; x scaled by 1e-6 (k-means: x = s*T) and 1e-4 (compute: x = s) */
    double k_n, k_x, k_y, k_xx, k_xy;
    double c_n, c_s[5], c_ys[3];
    int have_fixed;
    pqc_scheduler_fit fixed;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_t mu;
#endif
};

#define PQC__KX 1e-6
#define PQC__CX 1e-4
#define PQC__SCHED_MAX_TOKENS 4294967296.0 /* sample sizes beyond any sequence are refused */

static void pqc__sched_lock(pqc_scheduler *s)
{
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&s->mu);
#else
    (void)s;
#endif
}
static void pqc__sched_unlock(pqc_scheduler *s)
{
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&s->mu);
#else
    (void)s;
#endif
}

PQCDEF pqc_result pqc_scheduler_create(const pqc_scheduler_desc *desc, pqc_scheduler **out)
{
    pqc_scheduler_desc d;
    pqc_scheduler *s;
    if (!out) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_scheduler_create: null output");
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (d.t_min == 0) d.t_min = PQC_DEFAULT_T_MIN;
    if (d.t_max == 0) d.t_max = PQC_DEFAULT_T_MAX;
    if (d.t_default == 0) d.t_default = PQC_DEFAULT_ITERS;
    if (d.parallel == 0) d.parallel = PQC_DEFAULT_PARALLEL;
    if (d.t_min < 0 || d.t_max < d.t_min || d.t_max > 100000 || d.t_default < 0 || d.t_default > 100000 ||
        !(d.parallel > 0))
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE,
                         "scheduler: need 0 <= t_min <= t_max <= 100000, t_default <= 100000, parallel > 0");
    s = (pqc_scheduler *)pqc__calloc(&d.allocator, sizeof *s);
    if (!s) return pqc__fail(NULL, PQC_ERROR_OUT_OF_MEMORY, "scheduler: allocation failed");
    s->alloc = d.allocator;
    s->t_min = d.t_min;
    s->t_max = d.t_max;
    s->t_default = d.t_default;
    s->parallel = d.parallel;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_init(&s->mu, NULL);
#endif
    *out = s;
    return PQC_SUCCESS;
}

PQCDEF void pqc_scheduler_destroy(pqc_scheduler *s)
{
    pqc_allocator a;
    if (!s) return;
    a = s->alloc;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_destroy(&s->mu);
#endif
    pqc__free(&a, s);
}

PQCDEF pqc_result pqc_scheduler_add_kmeans(pqc_scheduler *s, double tokens, int iters, double seconds)
{
    double x;
    if (!s) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "scheduler: null");
    if (!(tokens > 0 && tokens <= PQC__SCHED_MAX_TOKENS) || iters < 0 || iters > 1000000 || !(seconds >= 0) ||
        seconds > 1e9)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE,
                         "scheduler: k-means sample needs 0 < tokens <= 2^32, 0 <= iters <= 1e6, 0 <= seconds <= 1e9");
    x = tokens * iters * PQC__KX;
    pqc__sched_lock(s);
    s->k_n += 1;
    s->k_x += x;
    s->k_y += seconds;
    s->k_xx += x * x;
    s->k_xy += x * seconds;
    pqc__sched_unlock(s);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_scheduler_add_compute(pqc_scheduler *s, double tokens, double seconds)
{
    double x, p = 1;
    int i;
    if (!s) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "scheduler: null");
    if (!(tokens > 0 && tokens <= PQC__SCHED_MAX_TOKENS) || !(seconds >= 0) || seconds > 1e9)
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE,
                         "scheduler: compute sample needs 0 < tokens <= 2^32 and 0 <= seconds <= 1e9");
    x = tokens * PQC__CX;
    pqc__sched_lock(s);
    s->c_n += 1;
    for (i = 0; i < 5; i++, p *= x) s->c_s[i] += p;
    s->c_ys[0] += seconds;
    s->c_ys[1] += seconds * x;
    s->c_ys[2] += seconds * x * x;
    pqc__sched_unlock(s);
    return PQC_SUCCESS;
}

/* solves the 3x3 system a x = b by Gaussian elimination with pivoting; 0 if singular */
static int pqc__solve3(double a[3][3], double b[3], double x[3])
{
    int i, j, k;
    for (i = 0; i < 3; i++) {
        int p = i;
        for (j = i + 1; j < 3; j++)
            if (fabs(a[j][i]) > fabs(a[p][i])) p = j;
        if (fabs(a[p][i]) < 1e-300) return 0;
        if (p != i) {
            for (k = 0; k < 3; k++) {
                double t = a[i][k];
                a[i][k] = a[p][k];
                a[p][k] = t;
            }
            {
                double t = b[i];
                b[i] = b[p];
                b[p] = t;
            }
        }
        for (j = i + 1; j < 3; j++) {
            double f = a[j][i] / a[i][i];
            for (k = i; k < 3; k++) a[j][k] -= f * a[i][k];
            b[j] -= f * b[i];
        }
    }
    for (i = 2; i >= 0; i--) {
        double acc = b[i];
        for (k = i + 1; k < 3; k++) acc -= a[i][k] * x[k];
        x[i] = acc / a[i][i];
    }
    return 1;
}

/* Current fit in unscaled units; n1/n2 = 0 where a line is not determined yet. A fit that
   was set or loaded holds each line until the samples measured since determine that line
   with at least as many samples behind it. */
static pqc_scheduler_fit pqc__sched_fit(const pqc_scheduler *s)
{
    pqc_scheduler_fit f;
    memset(&f, 0, sizeof f);
    if (s->k_n >= 2) {
        double den = s->k_n * s->k_xx - s->k_x * s->k_x;
        if (fabs(den) > 1e-300) {
            f.b1 = (s->k_n * s->k_xy - s->k_x * s->k_y) / den * PQC__KX;
            f.a1 = (s->k_y - f.b1 / PQC__KX * s->k_x) / s->k_n;
            f.n1 = (int)s->k_n;
        }
    }
    if (s->c_n >= 3) {
        double a[3][3], b[3], x[3];
        int i, j;
        for (i = 0; i < 3; i++)
            for (j = 0; j < 3; j++) a[i][j] = s->c_s[i + j];
        for (i = 0; i < 3; i++) b[i] = s->c_ys[i];
        if (pqc__solve3(a, b, x)) {
            f.a2 = x[0];
            f.b2 = x[1] * PQC__CX;
            f.g2 = x[2] * PQC__CX * PQC__CX;
            f.n2 = (int)s->c_n;
        }
    }
    if (s->have_fixed) {
        if (f.n1 == 0 || f.n1 < s->fixed.n1) {
            f.a1 = s->fixed.a1;
            f.b1 = s->fixed.b1;
            f.n1 = s->fixed.n1;
        }
        if (f.n2 == 0 || f.n2 < s->fixed.n2) {
            f.a2 = s->fixed.a2;
            f.b2 = s->fixed.b2;
            f.g2 = s->fixed.g2;
            f.n2 = s->fixed.n2;
        }
    }
    return f;
}

PQCDEF pqc_scheduler_fit pqc_scheduler_get_fit(pqc_scheduler *s)
{
    pqc_scheduler_fit f;
    memset(&f, 0, sizeof f);
    if (!s) return f;
    pqc__sched_lock(s);
    f = pqc__sched_fit(s);
    pqc__sched_unlock(s);
    return f;
}

PQCDEF pqc_result pqc_scheduler_set_fit(pqc_scheduler *s, const pqc_scheduler_fit *fit)
{
    if (!s || !fit) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "scheduler: null");
    if (!(fit->b1 > 0 && fit->b1 <= 1e9) || fit->n1 < 1 || fit->n2 < 1 || !(fabs(fit->a1) <= 1e9) ||
        !(fabs(fit->a2) <= 1e9) || !(fabs(fit->b2) <= 1e9) || !(fabs(fit->g2) <= 1e9))
        return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE,
                         "scheduler: fit needs 0 < b1, finite coefficients up to 1e9 and samples behind both lines");
    pqc__sched_lock(s);
    s->fixed = *fit;
    s->have_fixed = 1;
    pqc__sched_unlock(s);
    return PQC_SUCCESS;
}

PQCDEF int pqc_scheduler_iters(pqc_scheduler *s, double tokens, int jobs)
{
    pqc_scheduler_fit f;
    double t, share;
    int lo, hi, def;
    if (!s) return 10;
    pqc__sched_lock(s);
    f = pqc__sched_fit(s);
    lo = s->t_min;
    hi = s->t_max;
    def = s->t_default;
    /* jobs builds share `parallel` workers during one layer's compute */
    share = jobs > 0 ? s->parallel / (double)jobs : 1.0;
    if (share > 1.0) share = 1.0;
    pqc__sched_unlock(s);
    /* no fit yet, or no sequence to fit: the default, within the clip */
    if (f.n1 == 0 || f.n2 == 0 || !(f.b1 > 0) || !(tokens > 0 && tokens <= PQC__SCHED_MAX_TOKENS))
        return def < lo ? lo : (def > hi ? hi : def);
    t = ((f.g2 * tokens * tokens + f.b2 * tokens + f.a2) * share - f.a1) / (f.b1 * tokens);
    if (!(t >= lo)) return lo; /* also catches NaN */
    if (t > hi) return hi;
    return (int)t;
}

#define PQC__SCHED_MAGIC "pqcache-scheduler 1"

PQCDEF pqc_result pqc_scheduler_save(pqc_scheduler *s, const char *path)
{
    pqc_scheduler_fit f;
    char body[640], why[300];
    const void *part;
    size_t len;
    int n;
    if (!s || !path) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "scheduler save: null");
    f = pqc_scheduler_get_fit(s);
    if (f.n1 == 0 || f.n2 == 0) return pqc__fail(NULL, PQC_ERROR_BAD_STATE, "scheduler save: no fit to save yet");
    n = snprintf(body, 512, "%s\nkmeans %.17g %.17g %d\ncompute %.17g %.17g %.17g %d\n", PQC__SCHED_MAGIC, f.a1, f.b1,
                 f.n1, f.a2, f.b2, f.g2, f.n2);
    if (n < 0 || n >= 512) return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "scheduler save: fit does not print");
    n += snprintf(body + n, sizeof body - (size_t)n, "check %016llx\n",
                  (unsigned long long)pqc__fnv(body, (size_t)n, PQC__FNV_OFFSET));
    part = body;
    len = (size_t)n;
    if (pqc__write_atomic(path, &part, &len, 1, why, sizeof why) != 0)
        return pqc__fail(NULL, PQC_ERROR_IO, "scheduler save: %s", why);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_scheduler_load(pqc_scheduler *s, const char *path)
{
    char buf[1024], *chk, why[300];
    size_t n;
    FILE *fp;
    pqc_scheduler_fit f;
    unsigned long long want = 0;
    char tail;
    if (!s || !path) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "scheduler load: null");
    fp = pqc__open_regular(path, why, sizeof why);
    if (!fp) return pqc__fail(NULL, PQC_ERROR_IO, "scheduler load: %s", why);
    n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = 0;
    memset(&f, 0, sizeof f);
    if (strncmp(buf, PQC__SCHED_MAGIC "\n", strlen(PQC__SCHED_MAGIC) + 1) != 0)
        return pqc__fail(NULL, PQC_ERROR_BAD_FILE, "scheduler load: %s is not a pqcache calibration file", path);
    chk = strstr(buf, "check ");
    if (!chk || sscanf(chk, "check %llx%c", &want, &tail) != 2 || tail != '\n' ||
        pqc__fnv(buf, (size_t)(chk - buf), PQC__FNV_OFFSET) != (uint64_t)want)
        return pqc__fail(NULL, PQC_ERROR_BAD_FILE, "scheduler load: %s is damaged or truncated (checksum)", path);
    if (sscanf(buf + strlen(PQC__SCHED_MAGIC) + 1, "kmeans %lg %lg %d\ncompute %lg %lg %lg %d", &f.a1, &f.b1, &f.n1, &f.a2,
               &f.b2, &f.g2, &f.n2) != 7)
        return pqc__fail(NULL, PQC_ERROR_BAD_FILE, "scheduler load: %s has malformed lines", path);
    if (pqc_scheduler_set_fit(s, &f) != PQC_SUCCESS)
        return pqc__fail(NULL, PQC_ERROR_BAD_FILE, "scheduler load: %s holds an unusable fit", path);
    return PQC_SUCCESS;
}

/* ---------------------------------------------------------------------------------------
   10. Slot memory: pqc_backend_cpu, the block-cache slots of the host tier in host memory
   ------------------------------------------------------------------------------------- */

static void *pqc__cpu_alloc(void *ctx, size_t n) { return pqc__alloc((const pqc_allocator *)ctx, n); }
static void pqc__cpu_free(void *ctx, void *p) { pqc__free((const pqc_allocator *)ctx, p); }
static int pqc__cpu_copy(void *ctx, void *dst, const void *src, size_t n)
{
    (void)ctx;
    memcpy(dst, src, n);
    return 0;
}

PQCDEF pqc_backend pqc_backend_cpu(const pqc_allocator *alloc)
{
    pqc_backend b;
    memset(&b, 0, sizeof b);
    b.iface.name = "cpu";
    b.iface.alloc = pqc__cpu_alloc;
    b.iface.free = pqc__cpu_free;
    b.iface.copy_h2d = pqc__cpu_copy;
    b.ctx = (void *)alloc; /* may be NULL: default allocator */
    return b;
}

/* ---------------------------------------------------------------------------------------
   11. Sequence cache
   ------------------------------------------------------------------------------------- */

typedef struct pqc__head {
    unsigned char *k, *v; /* own rows pn .. pn + cap - 1: [cap][d] in the storage dtype */
    unsigned char *pk, *pv; /* a fork's shared prefix, rows 0 .. pn - 1 (read-only), or NULL */
    pqc_pq pq;            /* current codebook (pq.m == 0: none yet)  */
    pqc_codes codes;      /* codes of mid tokens n_sink .. n_sink + count */
    pqc_pq pq_new;        /* a finished build waiting to be installed */
    pqc_codes codes_new;
    pqc_scratch scratch;
    /* block cache */
    int32_t *slot_of;     /* block -> slot or -1, [n_blocks_cap] */
    int32_t *block_of;    /* slot -> block or -1 */
    uint32_t *filled;     /* rows valid in the slot */
    uint64_t *freq, *stamp;
    unsigned char *dev;   /* device tier: [slots][block_tokens][2][d] storage dtype */
    uint32_t *count_tmp;  /* per block: selected tokens this step */
    float *score;         /* per block: decayed count of selected tokens (admission filter) */
    /* the outlier list (desc.outliers): coded mid tokens, ascending; the build's
       n_outliers_build first, then up to `outliers` coded since: of those whose residual
       beats outlier_thr, the largest residuals (outlier_res, parallel to outliers +
       n_outliers_build). outliers: [2 * desc.outliers] */
    uint32_t *outliers, *outliers_new;
    float *outlier_res, *outlier_res_new; /* [outliers] each, in one block */
    size_t n_outliers, n_outliers_build, n_outliers_new;
    float outlier_thr, outlier_thr_new;
    size_t u_n_outliers, u_n_outliers_build; /* the outlier list before the running call's install */
    float u_outlier_thr;
    pqc_scratch cscratch; /* candidates of a select that scores exactly */
    /* residual-aware scoring (desc.residual_weight): m bytes per coded token, [rq_cap][m],
       and the norm of one step per sub-space; _new: from a build */
    uint8_t *rq, *rq_new;
    size_t rq_cap, rq_new_cap;
    float *rscale, *rscale_new; /* [m] each */
} pqc__head;

#define PQC__DUE_GROWN 1 /* pqc__layer.due: the layer grew (pqc__maybe_build) */
#define PQC__DUE_DRIFT 2 /* drifted queries were added (pqc__drift_commit) */
#define PQC__OBS_KEEP 4 /* observed rows kept per layer to measure where attention goes */
#define PQC__OBS_BINS 64 /* mid tokens by observed attention p: bin b holds 2^-(b+1)/2 < p <= 2^-b/2 */
/* The window a build weighs for its layer (see pqc__observed_mass): the layer's window
   halved up to PQC__WIN_CANDS - 1 times, never below PQC__WIN_MIN tokens; a token of
   top-k counts PQC__WIN_RHO of the attention the exact top-k token would hold (the share
   of it PQ scores find, with room for decode queries that stray from the observed). */
#define PQC__WIN_CANDS 5
#define PQC__WIN_MIN 16
#define PQC__WIN_RHO 0.5

typedef struct pqc__build {
    struct pqc_cache *cache;
    int layer, head;
    size_t n_keys;        /* mid tokens the build trains on and codes */
    const float *metric;  /* the distance's weights (into the layer's bmetric), or NULL */
    const float *blocks;  /* or its blocks (likewise), or NULL */
    size_t n_all;         /* tokens the layer held when the build started */
    int n_obs;            /* observation rows to measure the attention of (0: none) */
    int n_wins;           /* window sizes weighed (1: the layer's window only) */
    size_t wins[PQC__WIN_CANDS]; /* descending; wins[0] is the layer's window */
    double sinks;         /* the rows' attention on the sinks */
    double wmass[PQC__WIN_CANDS]; /* ... on the window of each size */
    double value[PQC__WIN_CANDS]; /* ... kept by the window and PQC__WIN_RHO of top-k */
    double hist[PQC__WIN_CANDS][PQC__OBS_BINS]; /* mid tokens per bin of their attention */
    double rfac;          /* the head's re-ranking factor from the observed rows (0: the cache's) */
    int iters;
    pqc_result res;
    char err[200];
    double seconds;
    pqc__task task;
} pqc__build;

typedef struct pqc__layer {
    pqc__head *heads;
    unsigned char *kbase, *vbase; /* K and V stores of all heads: head h at h * cap rows */
    uint64_t gen;         /* bumped whenever the installed codebooks change */
    size_t n_tokens;      /* stored tokens */
    size_t n_coded;       /* mid tokens covered by the installed codes */
    size_t n_trained;     /* mid tokens the installed codebook was trained on */
    int building;         /* a build or rebuild is in flight, or finished and not installed */
    size_t build_from;    /* n_tokens when it started */
    pqc__group group;
    pqc__build *builds;   /* [n_kv_heads] */
    double *qsq;          /* observations (pqc__qsq_len doubles): [n_kv_heads][d_h] sums of
                             squared observed queries, [n_kv_heads] the rows counted;
                             then the same for decode queries that drifted from the
                             metric; then the drift flag and the coded count at the last
                             drift rebuild + 1 (0: none) */
    double *qpend;        /* [n_kv_heads][d_h + 1] drifted decode queries of a driver step,
                             added to qsq when the whole step succeeded; then the flag */
    float *bmetric;       /* [n_kv_heads][d_h] the weights of the build in flight, or
                             [n_kv_heads][d_h x d_sub] its blocks (pqc__bands) */
    float *qobs;          /* [PQC__OBS_KEEP][n_q_heads * d_h] the last observed rows, oldest
                             first; n_qobs of them */
    int n_qobs;
    double *omass;        /* [n_kv_heads][2] observed attention on sinks and window, -1:
                             not measured */
    double *ohist;        /* [n_kv_heads][PQC__OBS_BINS] mid tokens per bin of observed
                             attention (see PQC__OBS_BINS) */
    int window;           /* the layer's window when a build lowered it (at most the
                             cache's; see pqc__window_of); 0: the cache's */
    int window_next;      /* the window the build installed in the running call chose,
                             taken when the call succeeds; 0: none */
    pqc_layer_stats st;
    uint64_t step;
    double prefill_start;
    /* the running call (see "calls as units"): a build it started, a build it installed
       (the former codebooks, codes and lists wait in the heads' _new fields, and u_*
       hold the layer's figures from before), and the builds that fell due in it */
    int fresh, undo, due;
    uint64_t dgen;        /* changes with every install and every undo: what a device tier
                             copied of the codebooks and codes is current while it holds */
    size_t u_coded, u_trained;
    uint64_t u_gen, u_builds, u_rebuilds;
    int u_last_iters;
    double u_build_s, u_wait_s;
    double *u_omass, *u_ohist; /* [n_kv_heads][2], [n_kv_heads][PQC__OBS_BINS] */
    double *rfac, *u_rfac;     /* [n_kv_heads] each head's re-ranking factor from its build's
                                  observed rows (pqc__rerank_factor), 0: the cache's rerank;
                                  before the running call's install (in omass's block)      */
} pqc__layer;

/* What a call that adds tokens to several layers (the driver's) restores on failure: per
   layer the token count, statistics and step, the observations when the call observes,
   and the window; `last` is the last layer the call reached. Taken by pqc__undo_begin,
   applied (on failure) and released by the end of the outermost call, pqc__call_end. */
typedef struct pqc__undo {
    size_t *n_tokens;
    uint64_t *step;
    pqc_layer_stats *st;
    double *qsq; /* the layers' observation sums, when the call observes */
    float *qobs; /* and their kept rows, n_qobs of them */
    int *n_qobs;
    int window, last, active;
} pqc__undo;

/* The stored prefix shared by forked caches: the first n rows of every layer's K and V
   stores of the cache that was forked first, read-only from then on, freed by the last
   cache that lets go of it. */
typedef struct pqc__share {
    size_t n;                 /* rows shared (tokens of every layer)  */
    size_t cap;               /* rows between heads in the stores     */
    int n_layers, refs;
    unsigned char **k, **v;   /* [n_layers] the stores of a forked cache, or NULL */
    unsigned char **hk, **hv; /* [n_layers * n_kv_heads] each head's first row */
    void *map;                /* or a cache file mapped read-only (pqc_cache_load) */
    size_t map_len;
    pqc_runtime *rt;
    pqc_allocator alloc;
    void (*release)(pqc_runtime *rt, const pqc_allocator *a, void *p); /* the stores' tier frees them */
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_t mu;       /* guards refs: forks are made and destroyed on any thread */
#endif
} pqc__share;

/* How a cache scores its steps: made once at creation by the plan (pqc__plan_init) from
   the options and the tier's capabilities. Search, steps and the tiers read this, never
   the options themselves. */
typedef struct pqc__scoring {
    pqc_gqa gqa;           /* how the query heads of a KV head combine their scores */
    float scale;           /* each head's softmax is over its dots x this (the desc's) */
    double scale_d;        /* the same in double (observed attention): 1/sqrt(d_h) taken in
                              double where the desc's is the default */
    float residual_weight; /* > 0: a PQ score adds this x sum_j |q_j| |r_j| */
    double rerank;         /* > 0: each head's candidates are ceil(rerank x its top-k), or
                              its calibrated factor's (pqc__layer.rfac)                    */
    double rerank_max;     /* > 0: builds with observations calibrate each head's factor   */
    int exact;             /* candidates are scored again with the stored keys */
    int adaptive;          /* the heads share the layer's top-k by observed attention */
    int adaptive_window;   /* a build with observations may lower its layer's window */
    int compete;           /* the window's tokens compete with the coded ones every step
                              (PQC_SPLIT_COMPETE without exact scoring) */
    int tier_search;       /* the tier's search can find the candidates */
    int tier_step;         /* the tier can run a whole decode step */
    int device_rows;       /* the tier hands rows in device memory */
    int map_stores;        /* a loaded file's rows serve where they are mapped (host stores) */
} pqc__scoring;

struct pqc_cache {
    pqc_runtime *rt;
    pqc_allocator alloc;
    pqc_cache_desc d;
    pqc__scoring sp;      /* the plan's part fixed at creation */
    pqc_backend be;
    int g;                /* query heads per KV head */
    size_t es;            /* storage element size */
    size_t row;           /* bytes of one row (d_h elements) */
    size_t cap;           /* own rows allocated per head (rows pn .. pn + cap - 1) */
    size_t pn;            /* rows of the shared prefix (a fork's; 0: none) */
    pqc__share *share;    /* the shared prefix, or NULL */
    size_t nblk;          /* entries of each head's block tables (slot_of, score) */
    pqc_cache_desc udesc; /* the desc as given (a fork is created from it) */
    int window;           /* fixed once known; 0 until the first prefill when derived */
    pqc__layer *layers;
    pqc_selection dsel;   /* the driver's selection and gather buffers, kept across steps */
    float *dbuf;
    size_t dbuf_floats;
    const void **fsrc; /* fetch: source row of each selected row */
    size_t fsrc_cap;
    unsigned char *sbuf;       /* select: per head counts, results, then [heads][sbuf_cap] indices */
    size_t sbuf_cap;
    const void *const **frows; /* fetch_rows: per head, the K then the V row arrays */
    size_t frows_cap;          /* rows per head in fsrc at the last fetch */
    pqc__undo urec;            /* the running driver call's undo record (pqc__undo_begin) */
    pqc_scratch uscratch;      /* its memory, kept across calls */
    const struct pqc__tier_i *tier; /* the device tier, chosen at creation */
    struct pqc__gpu_tier *cu;       /* the CUDA tier's state (only that tier's functions use it) */
    int in_step;               /* a driver decode step is running: drift commits at its end */
    int depth;                 /* public calls running on this cache (nested: the driver's) */
    size_t *takes;             /* [n_kv_heads] select: each head's top-k this step */
    size_t *cands;             /* [n_kv_heads] select: each head's candidates to score exactly */
    size_t fetch_stream;       /* fetches of at least these bytes of rows stream them (tests lower it) */
    float *orow;               /* [3 d_h] the outlier list's residual scratch (outliers > 0)  */
};

/* ----- device tiers ---------------------------------------------------------------------
   A cache's device side: where the block-cache slots live, whether the sink and window
   rows are held in device memory, where the search and the gather run. The host tier
   (slots from the cache's pqc_backend, everything else read where it is in host memory)
   and the CUDA tier (sink slots, window ring, slots, codes and the search on the GPU)
   implement this table; pqc_cache_create picks one, and the cache's logic only ever
   calls through it. */
struct pqc__fetch_job;
/* What a tier can do, in pqc__tier_i.caps; the step plan (pqc__plan_init) is the one
   reader. Optional entries of the table are NULL where the tier has nothing to do: the
   sequence cache then does the host's part (and calls them through pqc__tier_ wrappers). */
#define PQC__CAN_DEVICE_ROWS 1u /* rows (and a whole step, with `step`) stay in device memory */
#define PQC__CAN_RESIDUALS 2u   /* its search and step add the residual term of the scores */
#define PQC__CAN_EXACT 4u       /* its step scores candidates again with the stored keys
                                   (re-ranking, outlier lists) */

typedef struct pqc__tier_i {
    const char *name;
    unsigned caps;                                       /* PQC__CAN_ flags */
    pqc_result (*create)(pqc_cache *c);                  /* the layers exist */
    void (*destroy)(pqc_cache *c);                       /* before the layers go */
    void *(*store_alloc)(pqc_cache *c, size_t bytes);    /* memory of the host K/V stores */
    void (*store_free)(pqc_cache *c, void *p);
    void (*store_release)(pqc_runtime *rt, const pqc_allocator *a, void *p); /* a shared prefix's store */
    const pqc_allocator *(*codes_alloc)(pqc_cache *c);   /* memory of the codes a build makes */
    /* optional from here on (NULL: nothing to do, or the host's way) */
    void (*quiesce)(pqc_cache *c);                       /* no device work reads the stores after it */
    pqc_result (*grown)(pqc_cache *c);                   /* the stores moved (c->cap grew) */
    pqc_result (*stored)(pqc_cache *c, int l, size_t n); /* layer l holds n rows (prefill, or a
                                                            give-back): sinks and window copied */
    pqc_result (*appended)(pqc_cache *c, int l, size_t n); /* row n - 1 was appended */
    int (*sized)(const pqc_cache *c);                    /* device memory was sized by the window */
    /* the top `take` coded mid tokens of every head ([head][take], ascending, from 0 = the
       first mid token) and, when `scores`, their combined scores in *sc; or *idx = NULL:
       the host searches. NULL: the host always searches */
    pqc_result (*search)(pqc_cache *c, int l, const float *q, size_t take, int scores, const int32_t **idx,
                         const float **sc);
    pqc_result (*fetch_prepare)(pqc_cache *c, size_t rows_per_head); /* before any bookkeeping */
    /* the copies into slots (j->fills) and the gather into j->out, dout, or row sources */
    pqc_result (*fetch)(pqc_cache *c, struct pqc__fetch_job *j, pqc_kv_device *dout, int parallel);
    size_t (*device_bytes)(const pqc_cache *c);          /* 0 or NULL: the cache's estimate is the figure */
    int (*zero_copy)(const pqc_cache *c);                /* fetch_rows can hand rows in place */
    /* a whole decode step of layer l (see pqc__step_impl), or PQC__NOT_SERVED; NULL: the
       sequence cache selects and fetches. cands: with exact scoring (PQC__CAN_EXACT), each
       head's PQ candidates scored again, else NULL; ctake: the largest of them (or of takes) */
    pqc_result (*step)(pqc_cache *c, int l, const float *q, const size_t *takes, int search, const size_t *cands,
                       size_t ctake, const size_t *count, const pqc_kv_out *out, pqc_kv_device *dout, uint32_t *pos,
                       size_t pos_stride);
    pqc_result (*adm_pull)(pqc_cache *c, int l);         /* the block-cache bookkeeping is the host's */
    pqc_result (*stats)(const pqc_cache *c, int l, pqc_layer_stats *st); /* adds what the tier counted */
    /* before a batch's selects (pqc_batch_select): the tier may build the lookup tables of
       several of the caches at once; best effort, a cache it leaves builds its own */
    void (*batch_tables)(pqc_cache *const *caches, int n, int l, const float *const *q);
} pqc__tier_i;

#define PQC__NOT_SERVED ((pqc_result)-1001) /* the tier leaves this step to the host */


static void *pqc__store_alloc(pqc_cache *c, size_t bytes) { return c->tier->store_alloc(c, bytes); }
/* the optional entries: what NULL means */
static void pqc__tier_quiesce(pqc_cache *c)
{
    if (c->tier->quiesce) c->tier->quiesce(c);
}
static pqc_result pqc__tier_grown(pqc_cache *c) { return c->tier->grown ? c->tier->grown(c) : PQC_SUCCESS; }
static pqc_result pqc__tier_stored(pqc_cache *c, int l, size_t n)
{
    return c->tier->stored ? c->tier->stored(c, l, n) : PQC_SUCCESS;
}
static pqc_result pqc__tier_appended(pqc_cache *c, int l, size_t n)
{
    return c->tier->appended ? c->tier->appended(c, l, n) : PQC_SUCCESS;
}
static int pqc__tier_sized(const pqc_cache *c) { return c->tier->sized ? c->tier->sized(c) : 0; }
static size_t pqc__tier_device_bytes(const pqc_cache *c) { return c->tier->device_bytes ? c->tier->device_bytes(c) : 0; }
static pqc_result pqc__tier_adm_pull(pqc_cache *c, int l) { return c->tier->adm_pull ? c->tier->adm_pull(c, l) : PQC_SUCCESS; }
static pqc_result pqc__tier_stats(const pqc_cache *c, int l, pqc_layer_stats *st)
{
    return c->tier->stats ? c->tier->stats(c, l, st) : PQC_SUCCESS;
}
static void pqc__store_free(pqc_cache *c, void *p)
{
    if (p) c->tier->store_free(c, p);
}

/* The plan's part fixed at creation: what scores a step and which of it the tier does,
   from the options and the tier's capabilities (the one place that reads both). */
/* the plan's softmax scale from the desc's (again where a loaded file sets it) */
static void pqc__plan_scale(pqc_cache *c)
{
    pqc__scoring *sp = &c->sp;
    sp->scale = c->d.softmax_scale;
    sp->scale_d =
        sp->scale == pqc__default_scale(c->d.head_dim) ? 1.0 / sqrt((double)c->d.head_dim) : (double)sp->scale;
}

static void pqc__plan_init(pqc_cache *c)
{
    pqc__scoring *sp = &c->sp;
    unsigned caps = c->tier->caps;
    int residual = c->d.residual_weight > 0;
    sp->gqa = c->d.gqa;
    pqc__plan_scale(c);
    sp->residual_weight = residual ? (float)c->d.residual_weight : 0.0f;
    sp->rerank = c->d.rerank;
    sp->rerank_max = c->d.rerank > 0 ? c->d.rerank_max : 0.0;
    sp->exact = c->d.rerank > 0 || c->d.outliers > 0;
    sp->adaptive = c->d.split == PQC_SPLIT_COMPETE || c->d.split == PQC_SPLIT_ADAPTIVE;
    /* with exact scoring the window's rivals join each head's candidates (pqc__select_exact) */
    sp->compete = c->d.split == PQC_SPLIT_COMPETE || c->d.split == PQC_SPLIT_FIXED_COMPETE;
    sp->adaptive_window = sp->adaptive && !sp->compete && c->d.window == 0;
    sp->device_rows = (caps & PQC__CAN_DEVICE_ROWS) != 0;
    sp->map_stores = !sp->device_rows;
    sp->tier_search = c->tier->search && (!residual || (caps & PQC__CAN_RESIDUALS));
    sp->tier_step = c->tier->step && sp->device_rows && (!residual || (caps & PQC__CAN_RESIDUALS)) &&
                    (!sp->exact || (caps & PQC__CAN_EXACT));
}

/* The stored K and V rows of token t of a head: in the shared prefix (a fork's) or in
   the cache's own store. */
static unsigned char *pqc__krow(const pqc_cache *c, const pqc__head *H, size_t t)
{
    return t < c->pn ? H->pk + t * c->row : H->k + (t - c->pn) * c->row;
}
static unsigned char *pqc__vrow(const pqc_cache *c, const pqc__head *H, size_t t)
{
    return t < c->pn ? H->pv + t * c->row : H->v + (t - c->pn) * c->row;
}
/* tokens the stores hold room for */
static size_t pqc__room(const pqc_cache *c) { return c->pn + c->cap; }

PQCDEF pqc_matrix pqc_matrix_f32(const float *data, size_t rows, size_t cols)
{
    pqc_matrix m;
    memset(&m, 0, sizeof m);
    m.data = data;
    m.dtype = PQC_F32;
    m.rows = rows;
    m.cols = cols;
    return m;
}

static pqc_result pqc__cfail(const pqc_cache *c, pqc_result r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pqc__errbuf, sizeof pqc__errbuf, fmt, ap);
    va_end(ap);
    pqc__log(c ? c->rt : NULL, PQC_LOG_ERROR, pqc__errbuf);
    return r;
}

/* A layer's window: the cache's (set at the first prefill, or by the desc), until a build
   with observations lowered it (PQC_SPLIT_ADAPTIVE with a derived window). */
static size_t pqc__window_of(const pqc_cache *c, const pqc__layer *L)
{
    return (size_t)(L->window ? L->window : c->window);
}

/* The three regions of n stored tokens of layer L: sinks [0, sink_end), mid tokens
   (PQ-indexed) [sink_end, mid_end), the recent window [mid_end, n). Every bound is at most
   n, however large n_sink and the window are. */
static size_t pqc__sink_end(const pqc_cache *c, size_t n_tokens) { return PQC__MIN((size_t)c->d.n_sink, n_tokens); }
static size_t pqc__mid_end(const pqc_cache *c, const pqc__layer *L, size_t n_tokens)
{
    size_t lo = pqc__sink_end(c, n_tokens), w = pqc__window_of(c, L);
    return n_tokens - lo > w ? n_tokens - w : lo;
}
/* mid tokens of n stored tokens */
static size_t pqc__mid_count(const pqc_cache *c, const pqc__layer *L, size_t n_tokens)
{
    return pqc__mid_end(c, L, n_tokens) - pqc__sink_end(c, n_tokens);
}

/* The window's rivals of a step that searches the coded tokens (PQC_SPLIT_COMPETE): its
   tokens [max(mid_end, sinks), n - PQC__WIN_MIN), how many (0: none compete). */
static size_t pqc__rivals_of(const pqc_cache *c, const pqc__layer *L, size_t n)
{
    size_t from = PQC__MAX(pqc__mid_end(c, L, n), pqc__sink_end(c, n));
    return c->sp.compete && n - from > PQC__WIN_MIN ? n - from - PQC__WIN_MIN : 0;
}

/* The budget for `mid` tokens beyond the sinks, unclamped: budget_tokens, or
   ceil(budget_ratio x mid) (a double, so that no ratio overflows a size_t). */
static double pqc__budget_of(const pqc_cache *c, size_t mid)
{
    return c->d.budget_tokens ? (double)c->d.budget_tokens : ceil(c->d.budget_ratio * (double)mid);
}

/* The step's budget: pqc__budget_of, past mid every token. */
static size_t pqc__budget(const pqc_cache *c, size_t mid)
{
    double b = pqc__budget_of(c, mid);
    return b >= (double)mid ? mid : (size_t)b;
}

/* The window derived from the first prompt's budget (recent_share of it, unclamped), at
   least one token and at most max_tokens, whatever the budget settings. */
static int pqc__derive_window(const pqc_cache *c, size_t n_tokens)
{
    double budget = pqc__budget_of(c, n_tokens - pqc__sink_end(c, n_tokens));
    double w = floor(c->d.recent_share * budget + 0.5), hi = (double)PQC__MIN(c->d.max_tokens, (size_t)0x7fffffff);
    return (int)(w < 1.0 ? 1.0 : (w > hi ? hi : w));
}

/* Whether a resolved desc's metric is a full matrix per sub-space (PQC_METRIC_QUERY with
   sub-spaces of at most 256 dims). */
static int pqc__desc_bands(const pqc_cache_desc *d)
{
    return d->metric == PQC_METRIC_QUERY && d->pq.m > 0 && d->head_dim / d->pq.m <= PQC__MAX_BLOCK;
}
static int pqc__bands(const pqc_cache *c) { return pqc__desc_bands(&c->d); }

/* Floats of one head's metric blocks: m matrices of d_sub x d_sub, d_h x d_sub in all. */
static size_t pqc__blocks_len(const pqc_cache *c)
{
    return (size_t)c->d.head_dim * ((size_t)c->d.head_dim / (size_t)c->d.pq.m);
}

/* The layout of a layer's observations (pqc__layer.qsq): observed queries, drifted
   decode queries, the drift flag and the coded count at the last drift rebuild + 1. Each
   part: [n_kv_heads][d_h] sums of squares, [n_kv_heads] the rows counted, and under
   metric blocks (pqc__bands) [n_kv_heads][m][d_sub][d_sub] the sums of the rows' outer
   products over each sub-space's dims (in sub-space element order, pqc_pq_dim). */
static size_t pqc__qsq_part(const pqc_cache *c)
{
    return (size_t)c->d.n_kv_heads * ((size_t)c->d.head_dim + 1 + (pqc__bands(c) ? pqc__blocks_len(c) : 0));
}
static size_t pqc__qsq_len(const pqc_cache *c) { return 2 * pqc__qsq_part(c) + 2; }

/* ----- the configuration: a desc resolved once -----
   Defaults first (the PQC_DEFAULT_ values), then one check per rule, each with its own
   message; pqc_cache_create keeps the result in c->d. */
#define PQC__RULE(ok, code, ...)                                                   \
    do {                                                                          \
        if (!(ok)) return pqc__fail(rt, code, "pqc_cache_create: " __VA_ARGS__);   \
    } while (0)

static pqc_result pqc__cache_resolve(pqc_runtime *rt, const pqc_cache_desc *desc, pqc_cache_desc *out)
{
    pqc_cache_desc d;
    pqc_pq_desc tmp;
    pqc_result r;
    size_t slot_bytes, row_bytes, all_heads;
    if (!desc || !out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_create: null pointer");
    d = *desc;
    if (d.n_q_heads == 0) d.n_q_heads = d.n_kv_heads;
    if (d.max_tokens == 0) d.max_tokens = PQC_DEFAULT_MAX_TOKENS;
    if (d.n_sink == 0) d.n_sink = PQC_DEFAULT_N_SINK;
    else if (d.n_sink < 0) d.n_sink = 0;
    if (d.budget_ratio == 0) d.budget_ratio = PQC_DEFAULT_BUDGET_RATIO;
    if (d.recent_share == 0) d.recent_share = PQC_DEFAULT_RECENT_SHARE;
    if (d.block_tokens == 0) d.block_tokens = PQC_DEFAULT_BLOCK_TOKENS;
    if (d.cache_blocks == 0) d.cache_blocks = PQC_DEFAULT_CACHE_BLOCKS;
    else if (d.cache_blocks < 0) d.cache_blocks = 0;
    if (d.admit_blocks == 0) d.admit_blocks = d.cache_blocks;
    else if (d.admit_blocks < 0) d.admit_blocks = 0;
    if (d.rebuild_share == 0) d.rebuild_share = PQC_DEFAULT_REBUILD_SHARE;
    else if (d.rebuild_share < 0 || d.rebuild_share >= 1) d.rebuild_share = -1; /* never */
    if (d.metric_floor == 0) d.metric_floor = PQC_DEFAULT_METRIC_FLOOR;
    if (d.observe == 0) d.observe = PQC_DEFAULT_OBSERVE;
    else if (d.observe < 0) d.observe = 0;
    if (d.rerank == 0) d.rerank = PQC_DEFAULT_RERANK;
    else if (d.rerank < 0) d.rerank = 0;
    if (d.rerank_max == 0) d.rerank_max = PQC_DEFAULT_RERANK_MAX;
    else if (d.rerank_max < 0) d.rerank_max = 0;
    if (d.outliers < 0) d.outliers = 0;
    if (d.residual_weight < 0) d.residual_weight = 0;
    if (d.pq.iters == 0 && !d.scheduler) d.pq.iters = PQC_DEFAULT_ITERS;
    else if (d.pq.iters < 0) d.pq.iters = -1;
    PQC__RULE(d.n_layers > 0 && d.n_layers <= 4096 && d.n_kv_heads > 0 && d.n_kv_heads <= 4096 && d.head_dim > 0 &&
                  d.head_dim <= 65536 && d.n_q_heads > 0 && d.n_q_heads <= 65536,
              PQC_ERROR_BAD_SHAPE, "layers %d, kv heads %d, query heads %d, head dim %d (1..4096, 1..4096, 1..65536, "
              "1..65536)", d.n_layers, d.n_kv_heads, d.n_q_heads, d.head_dim);
    PQC__RULE(d.n_q_heads % d.n_kv_heads == 0, PQC_ERROR_BAD_SHAPE, "%d query heads not a multiple of %d KV heads",
              d.n_q_heads, d.n_kv_heads);
    PQC__RULE(pqc_dtype_size(d.kv_dtype) != 0, PQC_ERROR_INVALID_ARGUMENT, "unknown kv dtype %d", (int)d.kv_dtype);
    PQC__RULE(d.max_tokens <= 0xfffffff0u, PQC_ERROR_OUT_OF_RANGE, "max_tokens %zu above 2^32 - 16", d.max_tokens);
    PQC__RULE(d.window >= 0, PQC_ERROR_OUT_OF_RANGE, "window %d is negative", d.window);
    PQC__RULE(d.budget_ratio > 0 && d.budget_ratio <= 1e6, PQC_ERROR_OUT_OF_RANGE, "budget_ratio %g not in (0, 1e6]",
              d.budget_ratio);
    PQC__RULE(d.recent_share >= 0 && d.recent_share <= 1, PQC_ERROR_OUT_OF_RANGE, "recent_share %g not in [0, 1]",
              d.recent_share);
    PQC__RULE((int)d.metric >= 0 && (int)d.metric <= 2, PQC_ERROR_OUT_OF_RANGE, "metric %d unknown", (int)d.metric);
    PQC__RULE(d.metric_floor > 0 && d.metric_floor <= 1e6, PQC_ERROR_OUT_OF_RANGE, "metric_floor %g not in (0, 1e6]",
              d.metric_floor);
    /* the query metric's weights are normalised to a mean of 1 (so at most head_dim) plus
       the floor: a floor below head_dim x 1e-11 could spread them past the PQ core's limit
       of 1e12 (largest / smallest) and every build of the layer would fail */
    PQC__RULE(d.metric == PQC_METRIC_L2 || d.metric_floor >= 1e-11 * (double)d.head_dim, PQC_ERROR_OUT_OF_RANGE,
              "metric_floor %g below head_dim x 1e-11 = %g: the metric's weights could spread past the PQ core's 1e12",
              d.metric_floor, 1e-11 * (double)d.head_dim);
    PQC__RULE((int)d.split >= 0 && (int)d.split <= 3, PQC_ERROR_OUT_OF_RANGE, "split %d unknown", (int)d.split);
    PQC__RULE((int)d.gqa >= 0 && (int)d.gqa <= 1, PQC_ERROR_OUT_OF_RANGE, "gqa %d unknown", (int)d.gqa);
    PQC__RULE(d.rerank == 0 || (d.rerank >= 1 && d.rerank <= 1e6), PQC_ERROR_OUT_OF_RANGE,
              "rerank %g: 0 (off) or 1..1e6", d.rerank);
    PQC__RULE(d.rerank_max >= 0 && d.rerank_max <= 1e6, PQC_ERROR_OUT_OF_RANGE,
              "rerank_max %g: 0 (the default), negative (none) or up to 1e6", d.rerank_max);
    PQC__RULE(d.outliers >= 0 && d.outliers <= (1 << 24), PQC_ERROR_OUT_OF_RANGE, "outliers %d not in 0..2^24",
              d.outliers);
    PQC__RULE(d.residual_weight >= 0 && d.residual_weight <= 1e6, PQC_ERROR_OUT_OF_RANGE,
              "residual_weight %g not in [0, 1e6]", d.residual_weight);
    /* checked as the float the search multiplies by: a double below float's range is 0 */
    PQC__RULE(!(d.residual_weight > 0) || (float)d.residual_weight > 0.0f, PQC_ERROR_OUT_OF_RANGE,
              "residual_weight %g is 0 as a float (the search's type): use 0 or at least 1e-38", d.residual_weight);
    PQC__RULE(d.block_tokens >= 1, PQC_ERROR_OUT_OF_RANGE, "block_tokens %d below 1", d.block_tokens);
    PQC__RULE(d.admit_blocks >= 0 && d.admit_blocks <= d.cache_blocks, PQC_ERROR_OUT_OF_RANGE,
              "admit_blocks %d not in 0..cache_blocks %d", d.admit_blocks, d.cache_blocks);
    PQC__RULE((int)d.policy >= 0 && (int)d.policy <= 1, PQC_ERROR_OUT_OF_RANGE, "policy %d unknown", (int)d.policy);
    PQC__RULE(d.rebuild_share == d.rebuild_share, PQC_ERROR_OUT_OF_RANGE, "rebuild_share is NaN");
    PQC__RULE(d.codes_resident >= 0 && d.codes_resident <= 1, PQC_ERROR_OUT_OF_RANGE, "codes_resident %d: 0 or 1",
              d.codes_resident);
    PQC__RULE(d.first_kv_head >= 0 && d.first_kv_head <= (1 << 20), PQC_ERROR_OUT_OF_RANGE,
              "first_kv_head %d not in 0..2^20", d.first_kv_head);
    PQC__RULE(d.softmax_scale >= 0.0f && d.softmax_scale <= 1e6f, PQC_ERROR_OUT_OF_RANGE,
              "softmax_scale %g: 0 (1/sqrt(head_dim)) or in (0, 1e6]", (double)d.softmax_scale);
    if (d.softmax_scale == 0.0f) d.softmax_scale = pqc__default_scale(d.head_dim);
    PQC__RULE(!d.pq.metric && !d.pq.metric_blocks, PQC_ERROR_INVALID_ARGUMENT,
              "pq.metric and pq.metric_blocks must be NULL (the cache derives each head's metric from observed queries; "
              "see metric)");
    PQC__RULE(pqc__size3((size_t)d.head_dim, pqc_dtype_size(d.kv_dtype), 2 * (size_t)d.block_tokens, &slot_bytes) &&
                  pqc__mul(slot_bytes, (size_t)d.cache_blocks, &row_bytes) &&
                  pqc__size3(row_bytes, (size_t)d.n_kv_heads, (size_t)d.n_layers, &all_heads),
              PQC_ERROR_CAPACITY, "block cache of %d blocks x %d tokens x %d layers x %d heads overflows",
              d.cache_blocks, d.block_tokens, d.n_layers, d.n_kv_heads);
    /* sinks or a window beyond the capacity are the whole sequence */
    if ((size_t)d.n_sink > d.max_tokens) d.n_sink = (int)d.max_tokens;
    if ((size_t)d.window > d.max_tokens) d.window = (int)d.max_tokens;
    if ((r = pqc__pq_check_desc(rt, &d.pq, d.head_dim, &tmp)) != PQC_SUCCESS) return r;
    d.pq.m = tmp.m;
    /* the blocks are normalised to a mean diagonal entry of 1 (entries at most d_sub),
       then rounded to float: a floor of 0.01 keeps them positive definite through that */
    PQC__RULE(!pqc__desc_bands(&d) || d.metric_floor >= 0.01, PQC_ERROR_OUT_OF_RANGE,
              "metric_floor %g below 0.01 under PQC_METRIC_QUERY (its blocks could round to a matrix not positive "
              "definite; PQC_METRIC_QUERY_DIAG takes floors down to head_dim x 1e-11)", d.metric_floor);
    d.pq.bits = tmp.bits;
    d.pq.subspaces = tmp.subspaces;
    d.pq.max_points_per_centroid = tmp.max_points_per_centroid;
    d.pq.objective = NULL;
    *out = d;
    return PQC_SUCCESS;
}
#undef PQC__RULE

/* The cache keeps counts (0 sinks, 0 blocks, ...); a resolved desc given back writes
   none as -1, so that it resolves to itself. */
static void pqc__desc_public(pqc_cache_desc *d)
{
    if (d->n_sink == 0) d->n_sink = -1;
    if (d->rerank == 0) d->rerank = -1;
    if (d->rerank_max == 0) d->rerank_max = -1;
    if (d->observe == 0) d->observe = -1;
    if (d->cache_blocks == 0) d->cache_blocks = -1;
    if (d->admit_blocks == 0) d->admit_blocks = -1;
}

PQCDEF pqc_result pqc_cache_resolve(pqc_runtime *rt, const pqc_cache_desc *desc, pqc_cache_desc *out)
{
    pqc_cache_desc d;
    pqc_result r = pqc__cache_resolve(rt, desc, &d);
    if (r != PQC_SUCCESS) return r;
    pqc__desc_public(&d);
    *out = d;
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_config(const pqc_cache *c, pqc_cache_desc *out)
{
    if (!c || !out) return pqc__fail(c ? c->rt : NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_config: null pointer");
    *out = c->d;
    out->window = c->window;
    pqc__desc_public(out);
    return PQC_SUCCESS;
}

static void pqc__share_drop(pqc_cache *c)
{
    pqc__share *s = c->share;
    int l, last;
    if (!s) return;
    c->share = NULL;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&s->mu);
#endif
    last = --s->refs == 0;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&s->mu);
#endif
    if (!last) return;
    for (l = 0; l < s->n_layers; l++) {
        if (s->k[l]) s->release(s->rt, &s->alloc, s->k[l]);
        if (s->v[l]) s->release(s->rt, &s->alloc, s->v[l]);
    }
    if (s->map) munmap(s->map, s->map_len);
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_destroy(&s->mu);
#endif
    pqc__free(&s->alloc, (void *)s->k);
    pqc__free(&s->alloc, s);
}

/* A shared prefix of n rows for cache c: pointer tables, one reference; the caller
   fills in where the rows are. */
static pqc__share *pqc__share_new(pqc_cache *c, size_t n)
{
    size_t L = (size_t)c->d.n_layers, ptrs = 2 * L + 2 * L * (size_t)c->d.n_kv_heads;
    pqc__share *s = (pqc__share *)pqc__calloc(&c->alloc, sizeof *s);
    if (s && !(s->k = (unsigned char **)pqc__calloc(&c->alloc, ptrs * sizeof(void *)))) {
        pqc__free(&c->alloc, s);
        s = NULL;
    }
#ifndef PQCACHE_NO_THREADS
    if (s && pthread_mutex_init(&s->mu, NULL) != 0) {
        pqc__free(&c->alloc, (void *)s->k);
        pqc__free(&c->alloc, s);
        s = NULL;
    }
#endif
    if (!s) return NULL;
    s->v = s->k + L;
    s->hk = s->v + L;
    s->hv = s->hk + L * (size_t)c->d.n_kv_heads;
    s->n = n;
    s->n_layers = (int)L;
    s->refs = 1;
    s->rt = c->rt;
    s->alloc = c->alloc;
    s->release = c->tier->store_release;
    return s;
}

PQCDEF void pqc_cache_destroy(pqc_cache *c)
{
    int l, h;
    if (!c) return;
    pqc__tier_quiesce(c);
    if (c->layers) {
        for (l = 0; l < c->d.n_layers; l++) pqc__wait(c->rt, &c->layers[l].group);
        for (l = 0; l < c->d.n_layers; l++) {
            pqc__layer *L = &c->layers[l];
            if (L->heads)
                for (h = 0; h < c->d.n_kv_heads; h++) {
                    pqc__head *H = &L->heads[h];
                    pqc_pq_free(&H->pq);
                    pqc_codes_free(&H->codes);
                    pqc_pq_free(&H->pq_new);
                    pqc_codes_free(&H->codes_new);
                    pqc_scratch_free(&H->scratch);
                    pqc_scratch_free(&H->cscratch);
                    pqc__free(&c->alloc, H->outliers);
                    pqc__free(&c->alloc, H->outliers_new);
                    pqc__free(&c->alloc, H->outlier_res < H->outlier_res_new ? H->outlier_res : H->outlier_res_new);
                    pqc__free(&c->alloc, H->rq);
                    pqc__free(&c->alloc, H->rq_new);
                    pqc__free(&c->alloc, H->rscale < H->rscale_new ? H->rscale : H->rscale_new);
                    pqc__free(&c->alloc, H->slot_of);
                    pqc__free(&c->alloc, H->block_of);
                    pqc__free(&c->alloc, H->filled);
                    pqc__free(&c->alloc, H->freq);
                    pqc__free(&c->alloc, H->stamp);
                    pqc__free(&c->alloc, H->count_tmp); /* score lives in the same block */
                }
            pqc__store_free(c, L->kbase);
            pqc__store_free(c, L->vbase);
        }
    }
    pqc__share_drop(c);
    pqc__store_free(c, c->dbuf); /* the driver's rows: store memory (pinned on a GPU) */
    c->tier->destroy(c); /* the tier's memory and its slots, after the stores and codes it made */
    if (c->layers)
        for (l = 0; l < c->d.n_layers; l++) {
            pqc__free(&c->alloc, c->layers[l].heads);
            pqc__free(&c->alloc, c->layers[l].builds);
            pqc__free(&c->alloc, c->layers[l].qsq);
            pqc__free(&c->alloc, c->layers[l].qpend);
            pqc__free(&c->alloc, c->layers[l].qobs);
            pqc__free(&c->alloc, c->layers[l].omass);
            pqc__free(&c->alloc, c->layers[l].ohist);
            pqc__free(&c->alloc, c->layers[l].bmetric);
        }
    pqc__free(&c->alloc, c->layers);
    pqc__free(&c->alloc, c->takes);
    pqc__free(&c->alloc, c->orow);
    pqc_selection_free(&c->dsel);
    pqc__free(&c->alloc, c->sbuf);
    pqc__free(&c->alloc, (void *)c->fsrc);
    pqc__free(&c->alloc, (void *)c->frows);
    pqc_scratch_free(&c->uscratch);
    pqc__free(&c->alloc, c);
}

/* Grows every layer's K/V store to hold `need` tokens per head; all-or-nothing. A layer
   keeps K (and V) of all its heads in one allocation, head h at h * cap rows, so that a
   device can address every head's rows with one base and a head stride. */
static pqc_result pqc__cache_grow(pqc_cache *c, size_t need)
{
    size_t cap = c->cap ? c->cap : 256, nblk, l, h, bytes, lbytes, own;
    int L = c->d.n_layers, H = c->d.n_kv_heads;
    unsigned char **nk, **nv;
    int32_t **ns;
    uint32_t **nc;
    size_t i, n = (size_t)L * H, ok = 0;
    if (need <= pqc__room(c) && (c->nblk || !c->pn)) return PQC_SUCCESS; /* (a new fork: tables) */
    if (need > c->d.max_tokens)
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "sequence of %zu tokens exceeds max_tokens %zu", need, c->d.max_tokens);
    /* headroom, so that the decode steps after a prompt rarely grow the store; a fork's
       own rows start after its shared prefix */
    own = need - c->pn;
    while (cap < own + PQC__MAX((size_t)256, own / 16)) cap = cap + cap / 2;
    if (cap > c->d.max_tokens - c->pn) cap = PQC__MAX(c->d.max_tokens - c->pn, (size_t)1);
    /* every layer's builds read the stores being replaced: let them finish first (their
       results are installed at each layer's next call) */
    for (l = 0; l < (size_t)L; l++) pqc__wait(c->rt, &c->layers[l].group);
    if (!pqc__mul(cap, c->row, &bytes) || !pqc__mul(bytes, (size_t)H, &lbytes))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "sequence too large");
    nblk = (c->pn + cap + (size_t)c->d.block_tokens - 1) / (size_t)c->d.block_tokens;
    nk = (unsigned char **)pqc__calloc(&c->alloc, sizeof(void *) * (size_t)L * 2);
    ns = (int32_t **)pqc__calloc(&c->alloc, sizeof(void *) * n);
    nc = (uint32_t **)pqc__calloc(&c->alloc, sizeof(void *) * n);
    if (!nk || !ns || !nc) {
        pqc__free(&c->alloc, nk);
        pqc__free(&c->alloc, ns);
        pqc__free(&c->alloc, nc);
        return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "K/V store: allocation failed");
    }
    nv = nk + L;
    for (l = 0; l < (size_t)L; l++) {
        nk[l] = (unsigned char *)pqc__store_alloc(c, lbytes);
        nv[l] = (unsigned char *)pqc__store_alloc(c, lbytes);
        if (!nk[l] || !nv[l]) break;
    }
    if (l == (size_t)L) {
        for (i = 0; i < n; i++) {
            if (c->d.cache_blocks > 0) {
                ns[i] = (int32_t *)pqc__alloc(&c->alloc, sizeof(int32_t) * nblk);
                nc[i] = (uint32_t *)pqc__alloc(&c->alloc, (sizeof(uint32_t) + sizeof(float)) * nblk);
                if (!ns[i] || !nc[i]) break;
            }
        }
        ok = i == n;
    }
    if (!ok) {
        for (l = 0; l < (size_t)L; l++) {
            pqc__store_free(c, nk[l]);
            pqc__store_free(c, nv[l]);
        }
        for (i = 0; i < n; i++) {
            pqc__free(&c->alloc, ns[i]);
            pqc__free(&c->alloc, nc[i]);
        }
        pqc__free(&c->alloc, nk);
        pqc__free(&c->alloc, ns);
        pqc__free(&c->alloc, nc);
        return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "K/V store: %zu bytes per layer could not be allocated", lbytes);
    }
    pqc__tier_quiesce(c); /* a device may still read the old stores */
    for (l = 0; l < (size_t)L; l++) {
        pqc__layer *Ly = &c->layers[l];
        for (h = 0; h < (size_t)H; h++) {
            pqc__head *hd = &Ly->heads[h];
            size_t j = l * H + h, used = Ly->n_tokens > c->pn ? (Ly->n_tokens - c->pn) * c->row : 0, ob = c->nblk;
            if (hd->k) memcpy(nk[l] + h * bytes, hd->k, used);
            if (hd->v) memcpy(nv[l] + h * bytes, hd->v, used);
            hd->k = nk[l] + h * bytes;
            hd->v = nv[l] + h * bytes;
            if (c->d.cache_blocks > 0) {
                for (i = 0; i < nblk; i++) ns[j][i] = i < ob ? hd->slot_of[i] : -1;
                {
                    float *nsc = (float *)(nc[j] + nblk);
                    for (i = 0; i < nblk; i++) nsc[i] = i < ob ? hd->score[i] : 0.0f;
                    pqc__free(&c->alloc, hd->slot_of);
                    pqc__free(&c->alloc, hd->count_tmp);
                    hd->slot_of = ns[j];
                    hd->count_tmp = nc[j];
                    hd->score = nsc;
                    memset(hd->count_tmp, 0, sizeof(uint32_t) * nblk);
                }
            }
        }
        pqc__store_free(c, Ly->kbase);
        pqc__store_free(c, Ly->vbase);
        Ly->kbase = nk[l];
        Ly->vbase = nv[l];
    }
    pqc__free(&c->alloc, nk);
    pqc__free(&c->alloc, ns);
    pqc__free(&c->alloc, nc);
    c->cap = cap;
    c->nblk = nblk;
    return pqc__tier_grown(c);
}

static pqc_result pqc__check_layer(const pqc_cache *c, int layer, const char *what)
{
    if (!c) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "%s: null cache", what);
    if (layer < 0 || layer >= c->d.n_layers)
        return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "%s: layer %d not in 0..%d", what, layer, c->d.n_layers - 1);
    return PQC_SUCCESS;
}

/* stores one token row (fp32 or any dtype) of head h at position t */
static void pqc__store_row(pqc_cache *c, unsigned char *dst, const void *src, pqc_dtype st)
{
    size_t d = (size_t)c->d.head_dim, e, m, ss = pqc_dtype_size(st), ds = pqc_dtype_size(c->d.kv_dtype);
    pqc_simd simd = pqc__simd(c->rt);
    float tmp[256];
    if (st == c->d.kv_dtype) {
        memcpy(dst, src, c->row);
        return;
    }
    for (e = 0; e < d; e += m) { /* through fp32, 256 values at a time (src may sit off float boundaries) */
        m = PQC__MIN(d - e, (size_t)256);
        pqc__k_to_f32(simd, (const unsigned char *)src + e * ss, st, m, tmp);
        pqc__k_narrow(simd, tmp, c->d.kv_dtype, m, dst + e * ds);
    }
}

/* view of tokens [from, to) (absolute positions) of one head as a key matrix; the rows
   lie in one part of the stores (all shared or all own: see pqc__keys_gather) */
static pqc_matrix pqc__keys_view(const pqc_cache *c, const pqc__head *H, size_t from, size_t to)
{
    pqc_matrix m;
    m.data = pqc__krow(c, H, from);
    m.dtype = c->d.kv_dtype;
    m.rows = to - from;
    m.cols = (size_t)c->d.head_dim;
    m.row_stride = c->row;
    return m;
}

/* Whether tokens [from, to) straddle a fork's shared prefix and its own rows */
static int pqc__keys_straddle(const pqc_cache *c, size_t from, size_t to) { return from < c->pn && to > c->pn; }

/* A fork's tokens [from, to) may straddle its shared prefix and its own rows: then they
   are copied, into `into` where given ((to - from) rows), else into *buf (allocated,
   freed by the caller), and the view is over the copy. */
static pqc_result pqc__keys_gather(const pqc_cache *c, const pqc__head *H, size_t from, size_t to, pqc_matrix *m,
                                   unsigned char *into, unsigned char **buf)
{
    *buf = NULL;
    *m = pqc__keys_view(c, H, from, to);
    if (pqc__keys_straddle(c, from, to)) {
        size_t a = (c->pn - from) * c->row;
        if (!into && !(into = *buf = (unsigned char *)pqc__alloc(&c->alloc, (to - from) * c->row)))
            return pqc__fail(c->rt, PQC_ERROR_OUT_OF_MEMORY, "keys of %zu tokens", to - from);
        memcpy(into, pqc__krow(c, H, from), a);
        memcpy(into + a, pqc__krow(c, H, c->pn), (to - c->pn) * c->row);
        m->data = into;
    }
    return PQC_SUCCESS;
}

/* mid token index where a fork's own rows start, clipped into [from, to] */
static size_t pqc__mid_cut(const pqc_cache *c, size_t from, size_t to)
{
    size_t cut = c->pn > (size_t)c->d.n_sink ? c->pn - (size_t)c->d.n_sink : 0;
    return cut < from ? from : (cut > to ? to : cut);
}

/* Where the tokens of pool (counts and attention per bin of PQC__OBS_BINS) hold the most
   attention: the attention of its k tokens of most, the bin that k ends in taken in
   proportion. */
static double pqc__top_of_bins(const double *cnt, const double *mass, double k)
{
    double got = 0.0;
    int i;
    for (i = 0; i < PQC__OBS_BINS && k > 0.0; i++) {
        if (cnt[i] <= k) {
            got += mass[i];
            k -= cnt[i];
        } else {
            got += mass[i] * k / cnt[i];
            k = 0.0;
        }
    }
    return got;
}

static int pqc__obs_bin(double p)
{
    int bin = p > 0.0 ? (int)floor(-2.0 * log2(p)) : PQC__OBS_BINS - 1;
    return bin < 0 ? 0 : (bin >= PQC__OBS_BINS ? PQC__OBS_BINS - 1 : bin);
}

/* A head's re-ranking factor from its build's observed rows (raw scores sc as
   pqc__observed_mass makes them, over the n_all tokens): for each row, the exact top-k
   of the coded tokens (k = the head's share of the budget beside the window, as an even
   split gives it) by the attention its group pays them (each query head's softmax over
   the coded tokens, summed), and where the new codebook's PQ score ranks each of them;
   then the smallest factor f (in steps of 0.1, from the cache's rerank up to
   rerank_max) whose candidates, the PQ top ceil(f k), hold PQC__RFAC_KEEP of that
   attention on average over the rows. A head whose codebook ranks the tokens that matter
   well keeps the cache's rerank; one that ranks them badly (wide keys: Gemma 3's 256
   dims in 8 bytes) has more of its ranking checked with the exact keys. Ranks: the
   top-k's PQ scores sorted, then one pass over every coded token's score. 0.998, of
   0.99 / 0.995 / 0.998 on the real models' tuning half: the least whose decode steps
   keep 0.995 of exact top-k's attention at every length of both models (Gemma 3 at 16K:
   0.989 / 0.994 / 0.998). */
#define PQC__RFAC_KEEP 0.998
#define PQC__RFAC_STEPS 10 /* per unit: factors lo, lo + 0.1, .. as (10 lo + i) / 10 */
typedef struct pqc__rfac_pair {
    float p; /* PQ score */
    float w; /* attention */
} pqc__rfac_pair;
static int pqc__rfac_desc(const void *a, const void *b)
{
    float x = ((const pqc__rfac_pair *)a)->p, y = ((const pqc__rfac_pair *)b)->p;
    return x > y ? -1 : x < y ? 1 : 0;
}
static pqc_result pqc__rerank_factor(pqc_cache *c, pqc__build *b, const float *sc)
{
    pqc__layer *L = &c->layers[b->layer];
    pqc__head *H = &L->heads[b->head];
    size_t n = b->n_keys, all = b->n_all, sink = (size_t)c->d.n_sink, qn = (size_t)c->d.n_q_heads * c->d.head_dim;
    size_t budget = pqc__budget(c, all - pqc__sink_end(c, all)), take, i, t, steps;
    double lo = c->sp.rerank, hi = PQC__MAX(c->sp.rerank_max, c->sp.rerank), acc[1024], rows = 0.0, *e;
    int g = c->g, r, h;
    float *w, *ps;
    uint32_t *top, *above;
    pqc__rfac_pair *pr;
    void *scr;
    pqc_search_desc sd;
    pqc_result res = PQC_SUCCESS;
    take = budget > b->wins[0] ? budget - b->wins[0] : 0;
    /* nothing to calibrate: no re-ranking (rerank_max is 0 then too), no search (the
       top-k covers every coded token), or a range that cannot move */
    if (!(c->sp.rerank_max > 0) || take == 0 || take >= n || !(hi > lo)) return PQC_SUCCESS;
    steps = (size_t)PQC__MIN(floor((hi - lo) * PQC__RFAC_STEPS + 1e-9), 1023.0) + 1;
    e = (double *)pqc__alloc(&c->alloc, n * sizeof(double));
    w = (float *)pqc__alloc(&c->alloc, 2 * n * sizeof(float));
    top = (uint32_t *)pqc__alloc(&c->alloc, 2 * (take + 1) * sizeof(uint32_t));
    pr = (pqc__rfac_pair *)pqc__alloc(&c->alloc, take * sizeof(pqc__rfac_pair));
    scr = pqc__alloc(&c->alloc, pqc__select_scratch(n));
    if (!e || !w || !top || !pr || !scr) {
        res = PQC_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    ps = w + n;
    above = top + take + 1;
    for (i = 0; i < steps; i++) acc[i] = 0.0;
    memset(&sd, 0, sizeof sd);
    sd.gqa = c->sp.gqa;
    sd.softmax_scale = c->sp.scale;
    if (c->sp.residual_weight > 0) {
        sd.residuals = H->rq_new;
        sd.residual_scale = H->rscale_new;
        sd.residual_weight = c->sp.residual_weight;
    }
    for (r = 0; r < b->n_obs; r++) {
        double tm = 0.0, kept = 0.0;
        size_t j = 0;
        for (t = 0; t < n; t++) w[t] = 0.0f;
        for (h = 0; h < g; h++) { /* the head's softmax over the coded tokens */
            const float *s = sc + ((size_t)r * (size_t)g + (size_t)h) * all + sink;
            double mx = -INFINITY, z = 0.0;
            for (t = 0; t < n; t++) mx = (double)s[t] > mx ? (double)s[t] : mx;
            for (t = 0; t < n; t++) z += (e[t] = exp(((double)s[t] - mx) * c->sp.scale_d));
            for (t = 0; t < n; t++) w[t] += (float)(e[t] / z);
        }
        pqc__select(pqc__simd(c->rt), w, n, take, scr, top, NULL);
        if ((res = pqc__pq_search_impl(c->rt, &H->pq_new, &H->codes_new,
                                       L->qobs + (size_t)r * qn + (size_t)b->head * (size_t)g * c->d.head_dim, g, &sd,
                                       NULL, NULL, NULL, ps)) != PQC_SUCCESS)
            goto out;
        for (i = 0; i < take; i++) {
            pr[i].p = ps[top[i]];
            pr[i].w = w[top[i]];
            tm += (double)pr[i].w;
            above[i] = 0;
        }
        above[take] = 0;
        qsort(pr, take, sizeof *pr, pqc__rfac_desc);
        for (t = 0; t < n; t++) { /* token t outscores the top-k's tokens from the first below it on */
            size_t a = 0, z = take;
            while (a < z) {
                size_t mid = a + (z - a) / 2;
                if (pr[mid].p < ps[t]) z = mid;
                else a = mid + 1;
            }
            above[a]++;
        }
        for (i = 1; i < take; i++) above[i] += above[i - 1]; /* above[i]: coded tokens scoring above pr[i] */
        for (i = 0; i < steps; i++) { /* the candidates of each factor: those of fewer tokens above */
            size_t cand = (size_t)ceil((lo * PQC__RFAC_STEPS + (double)i) / PQC__RFAC_STEPS * (double)take);
            while (j < take && above[j] < cand) kept += (double)pr[j++].w;
            acc[i] += tm > 0.0 ? kept / tm : 1.0;
        }
        rows += 1.0;
    }
    for (i = 0; i + 1 < steps && acc[i] < PQC__RFAC_KEEP * rows; i++) continue;
    b->rfac = i + 1 < steps || acc[i] >= PQC__RFAC_KEEP * rows ? (lo * PQC__RFAC_STEPS + (double)i) / PQC__RFAC_STEPS : hi;
out:
    pqc__free(&c->alloc, e);
    pqc__free(&c->alloc, w);
    pqc__free(&c->alloc, top);
    pqc__free(&c->alloc, pr);
    pqc__free(&c->alloc, scr);
    return res;
}

/* The attention the layer's kept observation rows pay, per row and query head of the
   group an exact softmax (at the cache's scale, c->sp.scale_d) over the n_all tokens held when the build
   started, averaged (P): the share on the sinks, and for each window size the build
   weighs (b->wins) the share on that window, the mid tokens before it counted by their P
   into the bins of PQC__OBS_BINS, and the value of the split: the window's share plus
   PQC__WIN_RHO times what the budget's other tokens would hold as the exact top-k of
   those mid tokens (from the bins). The scores are the runtime's exact row dots: each
   block of PQC__OBS_BLOCK keys is converted once and dotted with every observed row and
   head. */
#define PQC__OBS_BLOCK 256
static pqc_result pqc__observed_mass(pqc_cache *c, pqc__build *b)
{
    pqc__layer *L = &c->layers[b->layer];
    const pqc__head *H = &L->heads[b->head];
    size_t n = b->n_all, d = (size_t)c->d.head_dim, qn = (size_t)c->d.n_q_heads * d, t, t0, nb, bytes = 0;
    size_t sink = pqc__sink_end(c, n), mid_end = n - b->wins[0], budget = pqc__budget(c, n - sink);
    double scale = c->sp.scale_d, acc_s = 0.0, *pt, cnt[PQC__OBS_BINS], ms[PQC__OBS_BINS], rows;
    int np = b->n_obs * c->g, pr, r, j;
    pqc_result res;
    pqc_simd simd = pqc__simd(c->rt);
    float *sc = NULL, *buf;
    if (pqc__size3((size_t)np, n, sizeof(float), &bytes) && bytes <= (size_t)-1 - PQC__OBS_BLOCK * d * sizeof(float))
        sc = (float *)pqc__alloc(&c->alloc, bytes + PQC__OBS_BLOCK * d * sizeof(float));
    pt = (double *)pqc__calloc(&c->alloc, (n + 1) * sizeof(double));
    if (!sc || !pt) {
        pqc__free(&c->alloc, sc);
        pqc__free(&c->alloc, pt);
        return PQC_ERROR_OUT_OF_MEMORY;
    }
    buf = sc + (size_t)np * n;
    for (t0 = 0; t0 < n; t0 += nb) { /* sc[pr * n + t]: pair pr = (row pr / g, head pr % g) */
        nb = n - t0 < PQC__OBS_BLOCK ? n - t0 : PQC__OBS_BLOCK;
        for (t = 0; t < nb; t++) pqc__k_to_f32(simd, pqc__krow(c, H, t0 + t), c->d.kv_dtype, d, buf + t * d);
        for (pr = 0; pr < np; pr++) {
            const float *q = L->qobs + (size_t)(pr / c->g) * qn + ((size_t)b->head * (size_t)c->g + (size_t)(pr % c->g)) * d;
            pqc__k_rowdots(simd, q, buf, nb, d, (int)d, sc + (size_t)pr * n + t0);
        }
    }
    if ((res = pqc__rerank_factor(c, b, sc)) != PQC_SUCCESS) {
        pqc__free(&c->alloc, sc);
        pqc__free(&c->alloc, pt);
        return res;
    }
    for (pr = 0; pr < np; pr++) {
        float *s = sc + (size_t)pr * n;
        double mx = -INFINITY, z = 0.0, zs = 0.0;
        for (t = 0; t < n; t++)
            if ((double)s[t] > mx) mx = (double)s[t];
        for (t = 0; t < n; t++) {
            double e = exp(((double)s[t] - mx) * scale);
            z += e;
            if (t < sink) zs += e;
            s[t] = (float)e; /* the unnormalised weight, for P past the sinks */
        }
        acc_s += zs / z;
        for (t = sink; t < n; t++) pt[t] += (double)s[t] / z;
    }
    rows = (double)(b->n_obs * c->g);
    b->sinks = acc_s / rows;
    for (r = 0; r < PQC__OBS_BINS; r++) cnt[r] = ms[r] = 0.0;
    for (t = sink; t < n; t++) pt[t] /= rows;
    for (t = sink; t < mid_end; t++) {
        r = pqc__obs_bin(pt[t]);
        cnt[r] += 1.0;
        ms[r] += pt[t];
    }
    for (j = 0; j < b->n_wins; j++) { /* a smaller window: its oldest tokens join the mid tokens */
        size_t w = b->wins[j], from = j ? n - b->wins[j - 1] : n;
        double wm = 0.0;
        for (t = from; t < n - w; t++) {
            r = pqc__obs_bin(pt[t]);
            cnt[r] += 1.0;
            ms[r] += pt[t];
        }
        for (t = n - w; t < n; t++) wm += pt[t];
        b->wmass[j] = wm;
        memcpy(b->hist[j], cnt, sizeof cnt);
        b->value[j] = wm + PQC__WIN_RHO * pqc__top_of_bins(cnt, ms, budget > w ? (double)(budget - w) : 0.0);
    }
    pqc__free(&c->alloc, sc);
    pqc__free(&c->alloc, pt);
    return PQC_SUCCESS;
}

/* How badly token t's code serves its key row (storage dtype): the squared residual,
   each dim weighted by the codebook's metric when it has one. tmp: 3 d floats. */
static float pqc__residual(const pqc_pq *pq, const pqc_codes *codes, size_t t, const void *krow, pqc_dtype dt,
                           float *tmp)
{
    float acc = 0.0f, *w = tmp + pq->dim, *sub = w + pq->dim;
    int j;
    pqc__row_to_f32(krow, dt, (size_t)pq->dim, tmp);
    for (j = 0; j < pq->m; j++) {
        if (pq->metric) pqc__gather_sub(pq, pq->metric, j, w);
        acc += pqc__sub_residual(pq, codes, t, tmp, j, pq->metric ? w : NULL, sub);
    }
    return acc;
}

/* The build's outlier list: its `outliers` coded tokens of largest residual (ascending). */
static pqc_result pqc__pick_outliers(pqc_cache *c, pqc__head *H, const pqc_matrix *keys)
{
    size_t n = H->codes_new.count, k = PQC__MIN((size_t)c->d.outliers, n), t, bytes;
    float *res, *row, mn = INFINITY;
    H->n_outliers_new = 0;
    H->outlier_thr_new = INFINITY;
    if (k == 0) return PQC_SUCCESS;
    bytes = PQC__ALIGN_UP((n + 3 * (size_t)c->d.head_dim) * sizeof(float)) + pqc__select_scratch(n);
    res = (float *)pqc__alloc(&c->alloc, bytes);
    if (!res) return pqc__fail(c->rt, PQC_ERROR_OUT_OF_MEMORY, "outlier list: residuals of %zu tokens", n);
    row = res + n;
    for (t = 0; t < n; t++) res[t] = pqc__residual(&H->pq_new, &H->codes_new, t, pqc__row(keys, t), keys->dtype, row);
    pqc__select(pqc__simd(c->rt), res, n, k, (unsigned char *)res + PQC__ALIGN_UP((n + 3 * (size_t)c->d.head_dim) * sizeof(float)),
                H->outliers_new, NULL);
    for (t = 0; t < k; t++) mn = res[H->outliers_new[t]] < mn ? res[H->outliers_new[t]] : mn;
    H->n_outliers_new = k;
    H->outlier_thr_new = mn;
    pqc__free(&c->alloc, res);
    return PQC_SUCCESS;
}

/* background build of one (layer, head): train on mid tokens, then code them */
static void pqc__build_job(void *arg)
{
    pqc__build *b = (pqc__build *)arg;
    pqc_cache *c = b->cache;
    pqc__head *H = &c->layers[b->layer].heads[b->head];
    pqc_pq_desc d = c->d.pq;
    pqc_matrix keys;
    unsigned char *kbuf;
    pqc_result r;
    double t0 = pqc__now();
    d.iters = b->iters > 0 ? b->iters : -1;
    d.metric = b->metric;
    d.metric_blocks = b->blocks;
    d.seed = c->d.pq.seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(b->layer * 4099 + c->d.first_kv_head + b->head + 1));
    /* nested work runs inline: the pool may be the engine's and fully busy */
    r = pqc__keys_gather(c, H, (size_t)c->d.n_sink, (size_t)c->d.n_sink + b->n_keys, &keys, NULL, &kbuf);
    if (r == PQC_SUCCESS) r = pqc__pq_train_nested(c->rt, &d, &keys, &H->pq_new);
    if (r == PQC_SUCCESS)
        r = pqc_codes_init(&H->codes_new, &H->pq_new, b->n_keys + 256, c->tier->codes_alloc(c));
    if (r == PQC_SUCCESS) r = pqc__pq_encode_nested(c->rt, &H->pq_new, &keys, &H->codes_new);
    if (r == PQC_SUCCESS && c->d.outliers > 0) r = pqc__pick_outliers(c, H, &keys);
    if (r == PQC_SUCCESS && c->d.residual_weight > 0) {
        size_t cap = b->n_keys + 256;
        int j;
        H->rq_new = (uint8_t *)pqc__alloc(&c->alloc, cap * (size_t)c->d.pq.m);
        H->rq_new_cap = cap;
        for (j = 0; j < c->d.pq.m; j++) H->rscale_new[j] = 0.0f;
        if (!H->rq_new) r = pqc__fail(c->rt, PQC_ERROR_OUT_OF_MEMORY, "residual norms of %zu tokens", b->n_keys);
        else r = pqc_pq_residuals(c->rt, &H->pq_new, &H->codes_new, 0, &keys, H->rscale_new, H->rq_new);
    }
    pqc__free(&c->alloc, kbuf);
    if (r == PQC_SUCCESS && b->n_obs > 0 && (r = pqc__observed_mass(c, b)) != PQC_SUCCESS)
        pqc__fail(c->rt, r, "observed attention: allocation failed");
    if (r != PQC_SUCCESS) {
        snprintf(b->err, sizeof b->err, "layer %d head %d: %.150s", b->layer, b->head, pqc_last_error());
        pqc_pq_free(&H->pq_new);
        pqc_codes_free(&H->codes_new);
        pqc__free(&c->alloc, H->rq_new);
        H->rq_new = NULL;
    }
    b->res = r;
    b->seconds = pqc__now() - t0;
}

/* The distance for head h's next build (into the layer's bmetric), from the decode
   queries that drifted from the metric when there are any, else from the observed ones;
   both NULL (Euclidean) without observations or under PQC_METRIC_L2.
   Weights (PQC_METRIC_QUERY_DIAG, or sub-spaces over 256 dims): *w gets w_e = mean q_e^2
   / (mean over e of it) + metric_floor. Blocks (PQC_METRIC_QUERY): *blocks gets per
   sub-space W_j = C_j / (mean diagonal entry of C_j) + metric_floor I, C_j the queries'
   second moments over its dims (the identity where the queries never touched them).
   Queries of no energy at all: NULL. */
static void pqc__build_metric(pqc_cache *c, int l, int h, const float **wout, const float **bout)
{
    pqc__layer *L = &c->layers[l];
    size_t d = (size_t)c->d.head_dim, e, part = pqc__qsq_part(c), nkv = (size_t)c->d.n_kv_heads;
    const double *base = L->qsq[part + nkv * d + (size_t)h] > 0.0 ? L->qsq + part : L->qsq;
    const double *qs = base + (size_t)h * d;
    double tot = 0.0;
    *wout = *bout = NULL;
    if (c->d.metric == PQC_METRIC_L2 || base[nkv * d + (size_t)h] <= 0.0) return;
    for (e = 0; e < d; e++) tot += qs[e];
    if (!(tot > 0.0) || !(tot < 1e300)) return; /* queries of no energy: Euclidean */
    if (pqc__bands(c)) {
        size_t m = (size_t)c->d.pq.m, ds = d / m, j, a, b;
        const double *src = base + nkv * (d + 1) + (size_t)h * pqc__blocks_len(c);
        float *w = L->bmetric + (size_t)h * pqc__blocks_len(c);
        for (j = 0; j < m; j++) {
            const double *cj = src + j * ds * ds;
            float *wj = w + j * ds * ds;
            double tr = 0.0;
            for (a = 0; a < ds; a++) tr += cj[a * ds + a];
            for (a = 0; a < ds; a++)
                for (b = 0; b < ds; b++)
                    wj[a * ds + b] = (float)((tr > 0.0 && tr < 1e300 ? cj[a * ds + b] * (double)ds / tr : (a == b)) +
                                             (a == b ? c->d.metric_floor : 0.0));
        }
        *bout = w;
        return;
    }
    {
        float *w = L->bmetric + (size_t)h * d;
        for (e = 0; e < d; e++) {
            /* with a RoPE layout, one weight per rotation pair: rotation moves a key's (and a
               later query's) energy between the pair's two dims */
            size_t p = c->d.pq.rope == PQC_ROPE_HALF ? (e < d / 2 ? e + d / 2 : e - d / 2)
                     : c->d.pq.rope == PQC_ROPE_INTERLEAVED ? (e ^ 1u) : e;
            w[e] = (float)(0.5 * (qs[e] + qs[p]) * (double)d / tot + c->d.metric_floor);
        }
        *wout = w;
    }
}

/* Starts the build of layer l over its current mid tokens. */
static void pqc__start_build(pqc_cache *c, int l)
{
    pqc__layer *L = &c->layers[l];
    size_t n = pqc__mid_count(c, L, L->n_tokens), w0 = L->n_tokens - pqc__mid_end(c, L, L->n_tokens);
    size_t wmin = PQC__MIN(w0, (size_t)PQC__WIN_MIN);
    int h, j, iters = c->d.pq.iters;
    if (iters == 0) iters = pqc_scheduler_iters(c->d.scheduler, (double)n, c->d.n_kv_heads);
    L->building = 1;
    L->build_from = L->n_tokens;
    if (c->depth > 0 && !L->fresh) { /* a call that may still fail drops it then */
        L->fresh = 1;
        L->u_last_iters = L->st.last_iters;
    }
    L->st.last_iters = iters;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__build *b = &L->builds[h];
        b->cache = c;
        b->layer = l;
        b->head = h;
        b->n_keys = n;
        pqc__build_metric(c, l, h, &b->metric, &b->blocks);
        b->n_all = L->n_tokens;
        b->n_obs = L->n_qobs;
        b->rfac = 0.0;
        b->n_wins = c->sp.adaptive_window ? PQC__WIN_CANDS : 1;
        for (j = 0; j < b->n_wins; j++) b->wins[j] = PQC__MAX(w0 >> j, wmin);
        b->iters = iters;
        b->res = PQC_SUCCESS;
        b->err[0] = 0;
        b->task.fn = pqc__build_job;
        b->task.arg = b;
        pqc__submit(c->rt, &L->group, &b->task);
    }
}

/* Offers coded token t to head H's outlier list (tokens coded since the build): above the
   build's smallest residual it joins, evicting the smallest of a full list if it beats
   it. The list is a function of the tokens offered in order, so it can be replayed. */
static void pqc__outliers_offer(const pqc_cache *c, pqc__head *H, size_t t)
{
    size_t ne = H->n_outliers - H->n_outliers_build, i, mi = 0;
    float r = pqc__residual(&H->pq, &H->codes, t, pqc__krow(c, H, (size_t)c->d.n_sink + t), c->d.kv_dtype, c->orow);
    if (!(r > H->outlier_thr)) return;
    if (ne == (size_t)c->d.outliers) {
        for (i = 1; i < ne; i++) mi = H->outlier_res[i] < H->outlier_res[mi] ? i : mi;
        if (!(r > H->outlier_res[mi])) return;
        for (i = mi; i + 1 < ne; i++) { /* out, keeping the index order */
            H->outliers[H->n_outliers_build + i] = H->outliers[H->n_outliers_build + i + 1];
            H->outlier_res[i] = H->outlier_res[i + 1];
        }
        H->n_outliers--;
        ne--;
    }
    H->outliers[H->n_outliers++] = (uint32_t)t;
    H->outlier_res[ne] = r;
}

/* The outlier lists after the codes from `keep` on were dropped: the build's list loses
   those tokens; a list of tokens coded since that held any is replayed from the build's
   end to keep, as if the dropped tokens had never been coded. */
static void pqc__outliers_truncate(pqc_cache *c, pqc__layer *L, size_t keep)
{
    int h;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        size_t i, t, nb = H->n_outliers_build;
        int replay = 0;
        while (nb > 0 && H->outliers[nb - 1] >= keep) nb--;
        if (nb < H->n_outliers_build) { /* keep lies inside the build's tokens: none coded since remain */
            H->n_outliers_build = H->n_outliers = nb;
            continue;
        }
        for (i = H->n_outliers_build; i < H->n_outliers; i++) replay |= H->outliers[i] >= keep;
        if (!replay) continue;
        H->n_outliers = H->n_outliers_build;
        for (t = L->n_trained; t < keep; t++) pqc__outliers_offer(c, H, t);
    }
}

/* Forgets the codes of mid tokens from `keep` on, in every head. */
static void pqc__codes_truncate(pqc_cache *c, int l, size_t keep)
{
    pqc__layer *L = &c->layers[l];
    int h;
    if (keep >= L->n_coded) return;
    for (h = 0; h < c->d.n_kv_heads; h++) pqc__codes_drop(&L->heads[h].codes, keep);
    if (c->d.outliers > 0) pqc__outliers_truncate(c, L, keep);
    L->n_coded = keep;
}

/* Codes the mid tokens of layer l that an n-token sequence has beyond n_coded, with the
   installed codebooks (nothing while a build is in flight). All heads or none. */
static pqc_result pqc__code_pending(pqc_cache *c, int l, size_t n_tokens)
{
    pqc__layer *L = &c->layers[l];
    size_t end = pqc__mid_count(c, L, n_tokens), from = L->n_coded;
    int h;
    if (L->building || end <= from || L->heads[0].pq.m == 0) return PQC_SUCCESS;
    for (h = 0; c->d.residual_weight > 0 && h < c->d.n_kv_heads; h++) { /* room for the residual bytes */
        pqc__head *H = &L->heads[h];
        size_t m = (size_t)c->d.pq.m, cap = end + end / 8 + 256;
        uint8_t *nb;
        if (end <= H->rq_cap) continue;
        if (!(nb = (uint8_t *)pqc__alloc(&c->alloc, cap * m)))
            return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "residual norms of %zu tokens", end);
        if (from) memcpy(nb, H->rq, from * m);
        pqc__free(&c->alloc, H->rq);
        H->rq = nb;
        H->rq_cap = cap;
    }
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        size_t cut = pqc__mid_cut(c, from, end), sk = (size_t)c->d.n_sink;
        pqc_matrix keys;
        pqc_result r = PQC_SUCCESS;
        if (H->codes.count != from) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "internal: code count mismatch");
        /* a fork's shared rows, then its own */
        if (cut > from) {
            keys = pqc__keys_view(c, H, sk + from, sk + cut);
            r = pqc_pq_encode(c->rt, &H->pq, &keys, &H->codes);
        }
        if (r == PQC_SUCCESS && end > cut) {
            keys = pqc__keys_view(c, H, sk + cut, sk + end);
            r = pqc_pq_encode(c->rt, &H->pq, &keys, &H->codes);
        }
        if (r != PQC_SUCCESS) {
            int g;
            for (g = 0; g <= h; g++) pqc__codes_drop(&L->heads[g].codes, from); /* undo: all heads or none */
            return r;
        }
    }
    for (h = 0; c->d.residual_weight > 0 && h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        size_t cut = pqc__mid_cut(c, from, end), sk = (size_t)c->d.n_sink, m = (size_t)c->d.pq.m;
        pqc_matrix keys;
        pqc_result r = PQC_SUCCESS;
        if (cut > from) {
            keys = pqc__keys_view(c, H, sk + from, sk + cut);
            r = pqc_pq_residuals(c->rt, &H->pq, &H->codes, from, &keys, H->rscale, H->rq + from * m);
        }
        if (r == PQC_SUCCESS && end > cut) {
            keys = pqc__keys_view(c, H, sk + cut, sk + end);
            r = pqc_pq_residuals(c->rt, &H->pq, &H->codes, cut, &keys, H->rscale, H->rq + cut * m);
        }
        if (r != PQC_SUCCESS) {
            int g;
            for (g = 0; g < c->d.n_kv_heads; g++) pqc__codes_drop(&L->heads[g].codes, from);
            return r;
        }
    }
    if (c->d.outliers > 0) { /* tokens the codebook serves badly join the outlier list */
        size_t t;
        for (h = 0; h < c->d.n_kv_heads; h++)
            for (t = from; t < end; t++) pqc__outliers_offer(c, &L->heads[h], t);
    }
    L->n_coded = end;
    return PQC_SUCCESS;
}

/* Drops the results of layer l's build (it finished): the layer keeps what it had. */
static void pqc__build_drop(pqc_cache *c, pqc__layer *L)
{
    int h;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        pqc_pq_free(&H->pq_new);
        pqc_codes_free(&H->codes_new);
        pqc__free(&c->alloc, H->rq_new);
        H->rq_new = NULL;
    }
    L->building = 0;
}

/* Swaps head H's installed codebook, codes, residual bytes and outlier list with those in
   its _new fields (an install, or its undo). */
static void pqc__head_swap(const pqc_cache *c, pqc__head *H)
{
    pqc_pq pq = H->pq;
    pqc_codes codes = H->codes;
    H->pq = H->pq_new;
    H->codes = H->codes_new;
    H->pq_new = pq;
    H->codes_new = codes;
    if (c->d.residual_weight > 0) {
        float *sc = H->rscale;
        uint8_t *rq = H->rq;
        size_t cap = H->rq_cap;
        H->rq = H->rq_new;
        H->rq_cap = H->rq_new_cap;
        H->rq_new = rq;
        H->rq_new_cap = cap;
        H->rscale = H->rscale_new;
        H->rscale_new = sc;
    }
    if (c->d.outliers > 0) {
        uint32_t *ol = H->outliers;
        float *rs = H->outlier_res;
        H->outliers = H->outliers_new;
        H->outliers_new = ol;
        H->outlier_res = H->outlier_res_new;
        H->outlier_res_new = rs;
    }
}

/* Waits for layer l's build and installs it: its codebooks, codes, outlier lists and
   residual bytes take the place of the former ones, which wait in the _new fields until
   the running call ends (pqc__call_end keeps the install or undoes it); or reports the
   job's error once (the failed build changes nothing: the layer keeps what it had and
   builds again when its tokens next grow). Every call that changes a layer or selects
   from it joins first, so the codebook that serves a step is a function of the calls
   made, never of when a worker finished. */
/* The window a build lowered layer L's to (0: none), counting the one the running call
   takes when it succeeds. */
static int pqc__layer_window_set(const pqc__layer *L) { return L->window_next ? L->window_next : L->window; }

/* At an install: the heads' observed attention (when the build measured it) for the
   window size that holds the most of it over the layer's heads (pqc__observed_mass's
   value; ties keep the larger window), which the call takes if it succeeds (a smaller
   window than the layer's: window_next). */
static void pqc__choose_window(pqc_cache *c, pqc__layer *L)
{
    const pqc__build *b0 = &L->builds[0];
    double best = -1.0;
    int h, j, nw = b0->n_obs > 0 ? b0->n_wins : 0, pick = 0;
    for (j = 0; j < nw; j++) {
        double v = 0.0;
        for (h = 0; h < c->d.n_kv_heads; h++) v += L->builds[h].value[j];
        if (v > best) {
            best = v;
            pick = j;
        }
    }
    for (h = 0; nw > 0 && h < c->d.n_kv_heads; h++) {
        const pqc__build *b = &L->builds[h];
        L->omass[2 * h] = b->sinks;
        L->omass[2 * h + 1] = b->wmass[pick];
        memcpy(L->ohist + (size_t)h * PQC__OBS_BINS, b->hist[pick], sizeof b->hist[pick]);
    }
    L->window_next = pick > 0 ? (int)b0->wins[pick] : 0;
}

static pqc_result pqc__join_build(pqc_cache *c, int l)
{
    pqc__layer *L = &c->layers[l];
    size_t nkv = (size_t)c->d.n_kv_heads;
    int h;
    double t0;
    if (!L->building) return PQC_SUCCESS;
    t0 = pqc__now();
    pqc__wait(c->rt, &L->group);
    for (h = 0; h < c->d.n_kv_heads; h++)
        if (L->builds[h].res != PQC_SUCCESS) {
            pqc__cfail(c, PQC_ERROR_JOB_FAILED, "PQ build failed: %s", L->builds[h].err);
            pqc__build_drop(c, L);
            return PQC_ERROR_JOB_FAILED;
        }
    L->building = 0;
    L->undo = 1;
    L->u_coded = L->n_coded;
    L->u_trained = L->n_trained;
    L->u_gen = L->gen;
    L->u_builds = L->st.builds;
    L->u_rebuilds = L->st.rebuilds;
    L->u_build_s = L->st.build_s;
    L->u_wait_s = L->st.wait_s;
    memcpy(L->u_omass, L->omass, 2 * nkv * sizeof(double));
    memcpy(L->u_ohist, L->ohist, PQC__OBS_BINS * nkv * sizeof(double));
    memcpy(L->u_rfac, L->rfac, nkv * sizeof(double));
    for (h = 0; h < c->d.n_kv_heads; h++) L->rfac[h] = L->builds[h].rfac;
    L->st.wait_s += pqc__now() - t0;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        L->st.build_s += L->builds[h].seconds;
        H->u_n_outliers = H->n_outliers;
        H->u_n_outliers_build = H->n_outliers_build;
        H->u_outlier_thr = H->outlier_thr;
        pqc__head_swap(c, H);
        if (c->d.outliers > 0) {
            H->n_outliers = H->n_outliers_build = H->n_outliers_new;
            H->outlier_thr = H->outlier_thr_new;
        }
    }
    pqc__choose_window(c, L);
    if (L->n_trained) L->st.rebuilds++;
    L->st.builds++;
    L->gen++;
    L->dgen++;
    L->n_coded = L->n_trained = L->builds[0].n_keys;
    return PQC_SUCCESS;
}

/* The running call succeeded: layer l's install stays, the former state goes, and the
   window the build chose is the layer's from now on (its tokens that leave the window
   are coded at the next call that codes). */
static void pqc__install_keep(pqc_cache *c, int l)
{
    pqc__layer *L = &c->layers[l];
    int h;
    if (L->window_next) L->window = L->window_next;
    L->window_next = 0;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        const pqc__build *b = &L->builds[h];
        if (c->d.scheduler && b->iters > 0)
            pqc_scheduler_add_kmeans(c->d.scheduler, (double)b->n_keys, b->iters, b->seconds);
        pqc_pq_free(&H->pq_new);
        pqc_codes_free(&H->codes_new);
        pqc__free(&c->alloc, H->rq_new);
        H->rq_new = NULL;
    }
    L->undo = 0;
}

/* The running call failed: layer l as it was before the call. An install is undone (the
   build it installed waits again, finished, with the codes it made and no more), and a
   build the call started is dropped. */
static void pqc__install_undo(pqc_cache *c, int l)
{
    pqc__layer *L = &c->layers[l];
    size_t nkv = (size_t)c->d.n_kv_heads;
    int h;
    if (L->undo) {
        for (h = 0; h < c->d.n_kv_heads; h++) {
            pqc__head *H = &L->heads[h];
            pqc__codes_drop(&H->codes, L->builds[h].n_keys);
            pqc__head_swap(c, H);
            H->n_outliers = H->u_n_outliers;
            H->n_outliers_build = H->u_n_outliers_build;
            H->outlier_thr = H->u_outlier_thr;
        }
        L->n_coded = L->u_coded;
        L->n_trained = L->u_trained;
        L->gen = L->u_gen;
        L->dgen++;
        L->st.builds = L->u_builds;
        L->st.rebuilds = L->u_rebuilds;
        L->st.build_s = L->u_build_s;
        L->st.wait_s = L->u_wait_s;
        memcpy(L->omass, L->u_omass, 2 * nkv * sizeof(double));
        memcpy(L->ohist, L->u_ohist, PQC__OBS_BINS * nkv * sizeof(double));
        memcpy(L->rfac, L->u_rfac, nkv * sizeof(double));
        L->window_next = 0;
        L->building = 1;
        L->undo = 0;
    }
    if (L->fresh && L->building) {
        pqc__wait(c->rt, &L->group);
        pqc__build_drop(c, L);
        L->st.last_iters = L->u_last_iters;
    }
}

/* After layer l grew (and its new mid tokens were coded): starts the first build once
   there is something to learn, or a rebuild when enough tokens were coded without
   retraining; after an install in the running call, at its end (the former state
   still waits in the fields a build writes). Cannot fail. */
static void pqc__maybe_build(pqc_cache *c, int l)
{
    pqc__layer *L = &c->layers[l];
    size_t mid = pqc__mid_count(c, L, L->n_tokens);
    if (L->undo) {
        L->due |= PQC__DUE_GROWN;
        return;
    }
    if (L->building || mid == 0) return;
    if (L->heads[0].pq.m == 0) {
        if (mid >= (size_t)1 << c->d.pq.bits || mid >= 64) pqc__start_build(c, l);
        return;
    }
    if (c->d.rebuild_share > 0 && mid > L->n_trained && (double)(mid - L->n_trained) > c->d.rebuild_share * (double)mid)
        pqc__start_build(c, l);
}

/* Gives back the tokens of layer l from n on (they were added by a call that then
   failed): their codes, a build started on them, and the statistics of the call. */
static void pqc__layer_truncate(pqc_cache *c, int l, size_t n, const pqc_layer_stats *st, uint64_t step)
{
    pqc__layer *L = &c->layers[l];
    if (L->building && L->build_from > n) { /* trained on tokens that are going away */
        pqc__wait(c->rt, &L->group);
        pqc__build_drop(c, L);
    }
    if (n < L->n_tokens) {
        pqc__codes_truncate(c, l, pqc__mid_count(c, L, n));
        L->n_tokens = n;
    }
    L->st = *st;
    L->step = step;
}

/* Adds layer l's pending drifted queries to its observations and starts the drift
   rebuild when one is due; or forgets them (a failed driver step). */
static void pqc__drift_commit(pqc_cache *c, int l, int keep)
{
    pqc__layer *L = &c->layers[l];
    size_t part = pqc__qsq_part(c), i, last;
    double *flag = L->qsq + 2 * part;
    if (L->qpend[part] != 0.0) {
        if (keep) {
            for (i = 0; i < part; i++) L->qsq[part + i] += L->qpend[i];
            flag[0] = 1.0;
        }
        memset(L->qpend, 0, (part + 1) * sizeof(double));
    }
    if (!keep || flag[0] == 0.0) return;
    if (L->undo) { /* after the install, at the end of the call */
        L->due |= PQC__DUE_DRIFT;
        return;
    }
    if (L->building || L->heads[0].pq.m == 0) return;
    last = (size_t)flag[1]; /* coded count at the last drift rebuild + 1 */
    if (last > 0 && L->n_coded < last - 1 + PQC__MAX((size_t)256, (last - 1) / 8)) return;
    flag[0] = 0.0;
    flag[1] = (double)L->n_coded + 1.0;
    pqc__start_build(c, l);
}


/* floats of one layer's kept observation rows */
static size_t pqc__qobs_len(const pqc_cache *c)
{
    return PQC__OBS_KEEP * (size_t)c->d.n_q_heads * (size_t)c->d.head_dim;
}

/* Takes the running call's undo record (c->urec): every layer's token count, statistics
   and step, and its observations when the call observes. The end of the outermost call
   applies it on failure and releases it. */
static pqc_result pqc__undo_begin(pqc_cache *c, int observes)
{
    pqc__undo *u = &c->urec;
    size_t nl = (size_t)c->d.n_layers, qs = observes ? pqc__qsq_len(c) : 0, bytes;
    void *tmp;
    int l;
    if (!pqc__size3(nl, qs, sizeof(double), &bytes) ||
        bytes > (size_t)-1 - nl * (sizeof(size_t) + sizeof(uint64_t) + sizeof(pqc_layer_stats)))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "driver: undo record too large");
    bytes += nl * (sizeof(size_t) + sizeof(uint64_t) + sizeof(pqc_layer_stats));
    /* the cache's record, grown as needed: a decode step allocates nothing */
    u->n_tokens = (size_t *)pqc__scratch_get(&c->uscratch, &c->alloc, bytes, &tmp);
    if (!u->n_tokens) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "driver: allocation failed");
    u->st = (pqc_layer_stats *)(u->n_tokens + nl); /* size_t then stats: both 8-byte aligned */
    u->step = (uint64_t *)(u->st + nl);
    u->qsq = qs ? (double *)(u->step + nl) : NULL;
    u->qobs = NULL;
    u->n_qobs = NULL;
    if (qs) {
        size_t fb;
        if (!pqc__size3(nl, pqc__qobs_len(c), sizeof(float), &fb) || !(u->qobs = (float *)pqc__alloc(&c->alloc, fb)) ||
            !(u->n_qobs = (int *)pqc__alloc(&c->alloc, nl * sizeof(int)))) {
            pqc__free(&c->alloc, u->qobs);
            u->qobs = NULL;
            return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "driver: allocation failed");
        }
    }
    for (l = 0; l < c->d.n_layers; l++) {
        u->n_tokens[l] = c->layers[l].n_tokens;
        u->st[l] = c->layers[l].st;
        u->step[l] = c->layers[l].step;
        if (qs) {
            memcpy(u->qsq + (size_t)l * qs, c->layers[l].qsq, qs * sizeof(double));
            memcpy(u->qobs + (size_t)l * pqc__qobs_len(c), c->layers[l].qobs, pqc__qobs_len(c) * sizeof(float));
            u->n_qobs[l] = c->layers[l].n_qobs;
        }
    }
    u->window = c->window;
    u->last = c->d.n_layers - 1;
    u->active = 1;
    return PQC_SUCCESS;
}

/* The running call failed: every layer up to the last it reached as the record holds it
   (the layers that took the call's tokens give them back). Runs after the call's installs
   were undone, which bring back codes as they were at the install: with the tokens the
   call had coded before it. */
static void pqc__undo_restore(pqc_cache *c)
{
    const pqc__undo *u = &c->urec;
    char msg[sizeof pqc__errbuf];
    int l;
    memcpy(msg, pqc__errbuf, sizeof msg);
    for (l = 0; l <= u->last && l < c->d.n_layers; l++) {
        int gave_back = c->layers[l].n_tokens > u->n_tokens[l];
        pqc__layer_truncate(c, l, u->n_tokens[l], &u->st[l], u->step[l]);
        if (u->qsq) {
            memcpy(c->layers[l].qsq, u->qsq + (size_t)l * pqc__qsq_len(c), pqc__qsq_len(c) * sizeof(double));
            memcpy(c->layers[l].qobs, u->qobs + (size_t)l * pqc__qobs_len(c), pqc__qobs_len(c) * sizeof(float));
            c->layers[l].n_qobs = u->n_qobs[l];
        }
        /* the device's sink and window slots hold the given-back rows: copy them again */
        if (gave_back && u->n_tokens[l] > 0) pqc__tier_stored(c, l, u->n_tokens[l]);
    }
    if (!pqc__tier_sized(c)) c->window = u->window;
    memcpy(pqc__errbuf, msg, sizeof msg);
}

/* ----- calls as units -----
   A public call that changes a cache runs between pqc__call_begin and pqc__call_end
   (nested calls, such as the driver's, count as one). When the outermost one ends, in
   this order whatever the calls nested in it did: every install it made is kept
   (success) or undone (failure), and a build it started is dropped on failure; then, on
   failure, the layers give back what its undo record says (the driver's tokens); then,
   on success, the builds that fell due after an install start. */
static void pqc__call_begin(pqc_cache *c) { c->depth++; }

static pqc_result pqc__call_end(pqc_cache *c, pqc_result r)
{
    int l;
    if (--c->depth > 0) return r;
    for (l = 0; l < c->d.n_layers; l++) {
        pqc__layer *L = &c->layers[l];
        if (r == PQC_SUCCESS && L->undo) pqc__install_keep(c, l);
        else if (r != PQC_SUCCESS && (L->undo || L->fresh)) pqc__install_undo(c, l);
        L->fresh = 0;
    }
    if (c->urec.active) {
        if (r != PQC_SUCCESS) pqc__undo_restore(c);
        pqc__free(&c->alloc, c->urec.qobs);
        pqc__free(&c->alloc, c->urec.n_qobs);
        c->urec.qobs = NULL;
        c->urec.n_qobs = NULL;
        c->urec.active = 0;
    }
    for (l = 0; l < c->d.n_layers; l++) {
        pqc__layer *L = &c->layers[l];
        int due = L->due;
        L->due = 0;
        if (r != PQC_SUCCESS || !due) continue;
        if (due & PQC__DUE_GROWN) pqc__maybe_build(c, l);
        if (due & PQC__DUE_DRIFT) pqc__drift_commit(c, l, 1);
    }
    return r;
}

static pqc_result pqc__check_kv_matrix(const pqc_cache *c, const pqc_matrix *m, const char *what)
{
    pqc_result r = pqc__check_matrix(c->rt, m, (size_t)c->d.n_kv_heads * c->d.head_dim, what);
    if (r != PQC_SUCCESS) return r;
    return PQC_SUCCESS;
}

/* Both calls below first do everything that can fail (checks, a finished build's report,
   growth, storing rows past the visible tokens, coding, device copies) and only then
   make the tokens count; a failure undoes what it did, so the cache stays as it was. */
static pqc_result pqc__prefill(pqc_cache *c, int layer, const pqc_matrix *k, const pqc_matrix *v)
{
    pqc__layer *L;
    pqc_result r;
    size_t n, t, start, coded;
    int h, window;
    float *tmp;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_prefill")) != PQC_SUCCESS) return r;
    if ((r = pqc__check_kv_matrix(c, k, "pqc_cache_prefill K")) != PQC_SUCCESS) return r;
    if ((r = pqc__check_kv_matrix(c, v, "pqc_cache_prefill V")) != PQC_SUCCESS) return r;
    if (k->rows != v->rows)
        return pqc__cfail(c, PQC_ERROR_BAD_SHAPE, "pqc_cache_prefill: %zu K rows but %zu V rows", k->rows, v->rows);
    L = &c->layers[layer];
    n = k->rows;
    start = L->n_tokens;
    if (n > c->d.max_tokens - start)
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_prefill: %zu + %zu tokens exceed max_tokens %zu", start, n,
                          c->d.max_tokens);
    tmp = (float *)pqc__alloc(&c->alloc, k->cols * sizeof(float));
    if (!tmp) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_prefill: allocation failed");
    r = pqc__check_range(c->rt, k, tmp, pqc__store_limit(c->d.kv_dtype), "pqc_cache_prefill K");
    if (r == PQC_SUCCESS) r = pqc__check_range(c->rt, v, tmp, pqc__store_limit(c->d.kv_dtype), "pqc_cache_prefill V");
    pqc__free(&c->alloc, tmp);
    if (r != PQC_SUCCESS) return r;
    if ((r = pqc__join_build(c, layer)) != PQC_SUCCESS) return r; /* the store must not move under a build */
    if ((r = pqc__cache_grow(c, start + n)) != PQC_SUCCESS) return r;
    window = c->window;
    if (c->window == 0) c->window = pqc__derive_window(c, start + n);
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        size_t koff = (size_t)h * c->d.head_dim * pqc_dtype_size(k->dtype);
        size_t voff = (size_t)h * c->d.head_dim * pqc_dtype_size(v->dtype); /* K and V may differ in dtype */
        for (t = 0; t < n; t++) {
            pqc__store_row(c, pqc__krow(c, H, start + t), (const unsigned char *)pqc__row(k, t) + koff, k->dtype);
            pqc__store_row(c, pqc__vrow(c, H, start + t), (const unsigned char *)pqc__row(v, t) + voff, v->dtype);
        }
    }
    coded = L->n_coded;
    r = pqc__code_pending(c, layer, start + n);
    /* the device copies the new sink and window rows before they count as stored */
    if (r == PQC_SUCCESS) r = pqc__tier_stored(c, layer, start + n);
    if (r != PQC_SUCCESS) {
        pqc__codes_truncate(c, layer, coded);
        if (!pqc__tier_sized(c)) c->window = window; /* a device tier sized by it keeps it */
        return r;
    }
    L->n_tokens = start + n;
    L->prefill_start = pqc__now();
    pqc__maybe_build(c, layer);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_prefill(pqc_cache *c, int layer, const pqc_matrix *k, const pqc_matrix *v)
{
    if (!c) return pqc__prefill(c, layer, k, v);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__prefill(c, layer, k, v));
}

/* Adds the outer products of query row q over each sub-space's dims to blk ([m][d_sub]
   [d_sub], sub-space element order). */
static void pqc__blocks_add(const pqc_cache *c, double *blk, const float *q)
{
    int d = c->d.head_dim, half = pqc__bands_half(pqc__half_bands(&c->d.pq), d, c->d.pq.m);
    size_t m = (size_t)c->d.pq.m, ds = (size_t)d / m, j, a, b;
    double x[PQC__MAX_BLOCK];
    for (j = 0; j < m; j++, blk += ds * ds) { /* in the codebooks' sub-space order (pqc_pq_dim) */
        for (a = 0; a < ds; a++) x[a] = (double)q[pqc__subspace_dim(d, (int)ds, half, (int)j, (int)a)];
        for (a = 0; a < ds; a++)
            for (b = 0; b < ds; b++) blk[a * ds + b] += x[a] * x[b];
    }
}

static pqc_result pqc__observe(pqc_cache *c, int layer, const float *q, size_t n)
{
    pqc__layer *L;
    size_t d, qn, all, i, e;
    int h, hh;
    pqc_result r;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_observe")) != PQC_SUCCESS) return r;
    if (!q) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_observe: null queries");
    if (n == 0) return pqc__cfail(c, PQC_ERROR_EMPTY, "pqc_cache_observe: no queries");
    d = (size_t)c->d.head_dim;
    qn = (size_t)c->d.n_q_heads * d;
    if (!pqc__mul(n, qn, &all) || all > ((size_t)-1) / sizeof(float))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_observe: %zu rows overflow", n);
    if (!pqc__finite_row(q, all))
        return pqc__cfail(c, PQC_ERROR_NON_FINITE, "pqc_cache_observe: queries hold NaN, Inf or a huge value");
    /* a build of this layer reads the kept rows: it finishes first (as prefill does) */
    if ((r = pqc__join_build(c, layer)) != PQC_SUCCESS) return r;
    L = &c->layers[layer];
    { /* the last PQC__OBS_KEEP rows, oldest first */
        size_t keep = PQC__MIN(n, (size_t)PQC__OBS_KEEP), old = PQC__MIN((size_t)L->n_qobs, PQC__OBS_KEEP - keep);
        if (old > 0) memmove(L->qobs, L->qobs + ((size_t)L->n_qobs - old) * qn, old * qn * sizeof(float));
        memcpy(L->qobs + old * qn, q + (n - keep) * qn, keep * qn * sizeof(float));
        L->n_qobs = (int)(old + keep);
    }
    for (h = 0; h < c->d.n_kv_heads; h++) {
        double *qs = L->qsq + (size_t)h * d, *blk = L->qsq + (size_t)c->d.n_kv_heads * (d + 1) + (size_t)h * pqc__blocks_len(c);
        for (i = 0; i < n; i++)
            for (hh = 0; hh < c->g; hh++) {
                const float *row = q + i * qn + ((size_t)h * (size_t)c->g + (size_t)hh) * d;
                for (e = 0; e < d; e++) qs[e] += (double)row[e] * (double)row[e];
                if (pqc__bands(c)) pqc__blocks_add(c, blk, row);
            }
        L->qsq[(size_t)c->d.n_kv_heads * d + (size_t)h] += (double)n * (double)c->g;
    }
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_observe(pqc_cache *c, int layer, const float *q, size_t n)
{
    if (!c) return pqc__observe(c, layer, q, n);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__observe(c, layer, q, n));
}

PQCDEF pqc_result pqc_cache_observed_mass(const pqc_cache *c, int layer, int head, double *sinks, double *window)
{
    pqc_result r;
    const double *m;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_observed_mass")) != PQC_SUCCESS) return r;
    if (head < 0 || head >= c->d.n_kv_heads)
        return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_observed_mass: head %d not in 0..%d", head,
                          c->d.n_kv_heads - 1);
    m = c->layers[layer].omass + 2 * head;
    if (m[0] < 0.0)
        return pqc__cfail(c, PQC_ERROR_BAD_STATE, "pqc_cache_observed_mass: layer %d has no build with observations yet",
                          layer);
    if (sinks) *sinks = m[0];
    if (window) *window = m[1];
    return PQC_SUCCESS;
}

static pqc_result pqc__append(pqc_cache *c, int layer, const float *k, const float *v)
{
    pqc__layer *L;
    pqc_result r;
    size_t before, after, coded;
    int h;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_append")) != PQC_SUCCESS) return r;
    if (!k || !v) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_append: null K or V");
    L = &c->layers[layer];
    if (L->n_tokens == 0) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "pqc_cache_append: layer %d has no prefill yet", layer);
    if (L->n_tokens >= c->d.max_tokens)
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_append: layer %d holds max_tokens %zu", layer, c->d.max_tokens);
    if (!pqc__within(k, (size_t)c->d.n_kv_heads * c->d.head_dim, pqc__store_limit(c->d.kv_dtype)) ||
        !pqc__within(v, (size_t)c->d.n_kv_heads * c->d.head_dim, pqc__store_limit(c->d.kv_dtype)))
        return pqc__cfail(c, PQC_ERROR_NON_FINITE, "pqc_cache_append: K or V holds NaN, Inf or a magnitude above %g",
                          (double)pqc__store_limit(c->d.kv_dtype));
    if ((r = pqc__join_build(c, layer)) != PQC_SUCCESS) return r;
    if (L->n_tokens + 1 > pqc__room(c) && (r = pqc__cache_grow(c, L->n_tokens + 1)) != PQC_SUCCESS) return r;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        pqc__head *H = &L->heads[h];
        pqc__store_row(c, pqc__krow(c, H, L->n_tokens), k + (size_t)h * c->d.head_dim, PQC_F32);
        pqc__store_row(c, pqc__vrow(c, H, L->n_tokens), v + (size_t)h * c->d.head_dim, PQC_F32);
    }
    coded = L->n_coded;
    r = pqc__code_pending(c, layer, L->n_tokens + 1); /* the token leaving the window, from its own key */
    if (r == PQC_SUCCESS) r = pqc__tier_appended(c, layer, L->n_tokens + 1);
    if (r != PQC_SUCCESS) {
        pqc__codes_truncate(c, layer, coded);
        return r;
    }
    before = pqc__mid_end(c, L, L->n_tokens);
    L->n_tokens++;
    after = pqc__mid_end(c, L, L->n_tokens);
    if (after > before) L->st.bytes_d2h += (after - before) * 2 * c->row * (size_t)c->d.n_kv_heads; /* offload */
    pqc__maybe_build(c, layer);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_append(pqc_cache *c, int layer, const float *k, const float *v)
{
    if (!c) return pqc__append(c, layer, k, v);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__append(c, layer, k, v));
}

/* Gives sel room for `cap` indices per head, keeping what it holds. */
static pqc_result pqc__selection_grow(const pqc_cache *c, pqc_selection *sel, size_t cap)
{
    size_t bytes, h;
    uint32_t *idx;
    if (!pqc__size3(cap, (size_t)sel->n_kv_heads, sizeof(uint32_t), &bytes))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "selection: %zu indices per head overflow", cap);
    idx = (uint32_t *)pqc__alloc(&sel->alloc, bytes);
    if (!idx) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "selection: %zu indices per head", cap);
    if (sel->idx)
        for (h = 0; h < (size_t)sel->n_kv_heads; h++)
            memcpy(idx + h * cap, sel->idx + h * sel->capacity, PQC__MIN(sel->count[h], sel->capacity) * sizeof(uint32_t));
    pqc__free(&sel->alloc, sel->idx);
    sel->idx = idx;
    sel->capacity = cap;
    return PQC_SUCCESS;
}

/* capacity for n tokens with headroom, so that decode steps rarely reallocate */
static size_t pqc__selection_cap(const pqc_cache *c, size_t n)
{
    size_t want = n + n / 8 + 256;
    return PQC__MIN(want, c->d.max_tokens);
}

PQCDEF pqc_result pqc_selection_init(const pqc_cache *c, pqc_selection *sel)
{
    size_t n = 0;
    pqc_result r;
    int l;
    if (!c || !sel) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_selection_init: null pointer");
    memset(sel, 0, sizeof *sel);
    for (l = 0; l < c->d.n_layers; l++) n = PQC__MAX(n, c->layers[l].n_tokens);
    sel->alloc = c->alloc;
    sel->n_kv_heads = c->d.n_kv_heads;
    sel->owned = 1;
    sel->count = (size_t *)pqc__calloc(&sel->alloc, sizeof(size_t) * (size_t)c->d.n_kv_heads);
    if (!sel->count) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_selection_init: allocation failed");
    if ((r = pqc__selection_grow(c, sel, pqc__selection_cap(c, n))) != PQC_SUCCESS) {
        pqc_selection_free(sel);
        return r;
    }
    return PQC_SUCCESS;
}

PQCDEF void pqc_selection_free(pqc_selection *sel)
{
    if (!sel) return;
    pqc__free(&sel->alloc, sel->count);
    pqc__free(&sel->alloc, sel->idx);
    sel->count = NULL;
    sel->idx = NULL;
    sel->capacity = 0;
}

typedef struct pqc__sel_job {
    pqc_cache *c;
    int layer;
    const float *q;
    uint32_t *out;     /* [n_kv_heads][out_cap]: the selection is written here first */
    size_t out_cap, *out_count;
    size_t take; /* coded mid tokens to take: all of them, none, or the top `take` (the
                    largest of the heads' takes) */
    const size_t *takes; /* [n_kv_heads] each head's top-k, at most take */
    int search;  /* 0 < take < coded: PQ search */
    int exact;   /* the candidates are scored again exactly (rerank or an outlier list) */
    const size_t *cands; /* exact: [n_kv_heads] each head's PQ candidates, takes <= cands <= coded */
    size_t ctake;        /* the largest of cands (or take): the device's top-k per head */
    pqc_result *head_res;
    const int32_t *gpu_idx; /* the device tier's top-k, [n_kv_heads][ctake], or NULL */
    const float *gpu_sc;    /* their scores, when a head takes fewer */
} pqc__sel_job;

/* residual-aware scoring of a head's search, when the cache has it */
static void pqc__residual_desc(const pqc_cache *c, const pqc__head *H, pqc_search_desc *sd)
{
    if (!(c->sp.residual_weight > 0)) return;
    sd->residuals = H->rq;
    sd->residual_scale = H->rscale;
    sd->residual_weight = c->sp.residual_weight;
}

/* Head hi's best n coded tokens by PQ score (ascending, from 0 = the first mid token)
   into out, with its nx rivals among them (PQC_SPLIT_COMPETE; rival i as index coded + i:
   in the tier's top-k, or scored by the host search from their exact dots xd, nf more
   tokens in the softmax, pqc__pq_scores_into): every coded token and rival where n covers
   them (n is cut to that), else the best n of the tier's candidates, else a host search. */
static pqc_result pqc__head_pq_top(const pqc__sel_job *j, size_t hi, const float *xd, size_t nx, size_t nf, size_t *n,
                                   uint32_t *out)
{
    pqc_cache *c = j->c;
    pqc__layer *L = &c->layers[j->layer];
    pqc__head *H = &L->heads[hi];
    size_t coded = L->n_coded, t;
    pqc_search_desc sd;
    pqc_result r = PQC_SUCCESS;
    if (*n >= coded + nx) {
        for (t = 0; t < coded + nx; t++) out[t] = (uint32_t)t;
        *n = coded + nx;
        return PQC_SUCCESS;
    }
    if (j->gpu_idx) {
        const int32_t *g = j->gpu_idx + hi * j->ctake;
        if (*n < j->ctake) { /* the best n of the tier's top ctake, by score (ties to the lower token) */
            r = pqc_topk(c->rt, j->gpu_sc + hi * j->ctake, j->ctake, *n, &H->scratch, out, NULL);
            for (t = 0; r == PQC_SUCCESS && t < *n; t++) out[t] = (uint32_t)g[out[t]];
        } else {
            for (t = 0; t < *n; t++) out[t] = (uint32_t)g[t];
        }
        return r;
    }
    memset(&sd, 0, sizeof sd);
    sd.k = *n;
    sd.gqa = c->sp.gqa;
    sd.softmax_scale = c->sp.scale;
    sd.count = coded;
    pqc__residual_desc(c, H, &sd);
    return pqc__pq_search_x(c->rt, &H->pq, &H->codes, j->q + hi * c->g * c->d.head_dim, c->g, &sd, xd, nx, nf,
                            &H->scratch, out, NULL, NULL);
}

/* Rivals (PQC_SPLIT_COMPETE): the window's tokens [from, from + nx) of head hi, then its
   sinks [0, sink) and the window's last tokens [from + nx, n) (nf = sink + n - from - nx:
   they count in the softmax), scored exactly by every query head of the KV head: their
   dots into *xd ([g][nx + nf], in the head's candidate scratch, which exact scoring uses
   otherwise: the two never meet). */
static pqc_result pqc__rival_dots(const pqc__sel_job *j, size_t hi, size_t sink, size_t from, size_t nx, size_t n,
                                  float **xd)
{
    pqc_cache *c = j->c;
    pqc__head *H = &c->layers[j->layer].heads[hi];
    size_t d = (size_t)c->d.head_dim, nxf = nx + sink + (n - from - nx), lo[3], hi_[3], at = 0, of, gb = 0;
    int part;
    float *f;
    void *tmp;
    lo[0] = from;
    hi_[0] = from + nx;
    lo[1] = 0;
    hi_[1] = sink;
    lo[2] = from + nx;
    hi_[2] = n;
    for (part = 0; part < 3; part++) /* room for a part's copy (across a fork's prefix) */
        if (pqc__keys_straddle(c, lo[part], hi_[part])) gb = PQC__MAX(gb, (hi_[part] - lo[part]) * c->row);
    of = PQC__ALIGN_UP(((size_t)c->g * nxf + d) * sizeof(float));
    f = (float *)pqc__scratch_get(&H->cscratch, &c->alloc, of + gb, &tmp);
    if (!f) return pqc__fail(c->rt, PQC_ERROR_OUT_OF_MEMORY, "select: dots of %zu window tokens", nxf);
    for (part = 0; part < 3; part++) {
        unsigned char *buf;
        pqc_matrix m;
        if (hi_[part] == lo[part]) continue;
        (void)pqc__keys_gather(c, H, lo[part], hi_[part], &m, (unsigned char *)f + of, &buf); /* (copies only) */
        (void)pqc__k_gatherdots(pqc__simd(c->rt), j->q + hi * (size_t)c->g * d, c->g, (const unsigned char *)m.data,
                                m.row_stride, m.dtype, NULL, m.rows, (int)d, 0, 0.0f, f + (size_t)c->g * nxf, f + at,
                                nxf);
        at += m.rows;
    }
    *xd = f;
    return PQC_SUCCESS;
}

/* A head's exact selection: its PQ candidates (the device's top-ctake trimmed by score,
   or the host's top cands, or every coded token) merged with its outlier list, then the
   window's nx rivals [from, from + nx) (PQC_SPLIT_COMPETE), scored with the stored keys;
   the sinks and the window's other tokens [from + nx, n) join each query head's softmax
   (pqc__rerank_impl's nf: scored, never chosen), so that a head's tokens weigh as the
   attention over what it attends weighs them. The best takes + nx are kept (coded indices
   ascending, rival r as coded + r) into out. The scored rows, in this order, are
   candidates (token n_sink + c), rivals, sinks, the window's last tokens: the device's
   order (pqc_rerank_append). */
static pqc_result pqc__select_exact(pqc__sel_job *j, size_t hi, size_t from, size_t nx, uint32_t *out)
{
    pqc_cache *c = j->c;
    pqc__layer *L = &c->layers[j->layer];
    pqc__head *H = &L->heads[hi];
    size_t n = L->n_tokens, nc = j->cands[hi], no = H->n_outliers, coded = L->n_coded, t, a, b, nm, nsel;
    size_t ns = (size_t)c->d.n_sink, sink = PQC__MIN(ns, n), nxf = n - from + sink, take = j->takes[hi] + nx;
    size_t all = nc + no + nxf, oi, ob;
    uint32_t *cb, *mg;
    void *tmp;
    pqc_matrix keys = pqc__keys_view(c, H, 0, n);
    pqc_result r = PQC_SUCCESS;
    /* a fork's keys in two parts: the rows are scored from copies, which the head's scratch
       holds after the indices (no allocation a step) */
    int split = pqc__keys_straddle(c, 0, n);
    oi = PQC__ALIGN_UP((nc + all) * sizeof(uint32_t));
    ob = PQC__ALIGN_UP(all * sizeof(uint32_t));
    cb = (uint32_t *)pqc__scratch_get(&H->cscratch, &c->alloc, oi + (split ? ob + all * c->row : 0), &tmp);
    if (!cb) return pqc__fail(c->rt, PQC_ERROR_OUT_OF_MEMORY, "select: %zu candidates", all);
    mg = cb + nc;
    if (nc > 0) r = pqc__head_pq_top(j, hi, NULL, 0, 0, &nc, cb); /* (none: the adaptive split gave it no top-k) */
    if (r == PQC_SUCCESS) { /* merged with the outlier list (both ascending), as tokens */
        a = b = nm = 0;
        while (a < nc || b < no) {
            uint32_t x = a < nc ? cb[a] : 0xffffffffu, y = b < no ? H->outliers[b] : 0xffffffffu;
            if (b < no && y >= coded) { /* listed but not coded now (cannot happen; kept safe) */
                b++;
                continue;
            }
            mg[nm++] = (uint32_t)(ns + (x <= y ? x : y));
            a += x <= y;
            b += y <= x;
        }
        for (t = from; t < from + nx; t++) mg[nm++] = (uint32_t)t; /* the rivals */
        nsel = nm;
        for (t = 0; t < sink; t++) mg[nm++] = (uint32_t)t;           /* the softmax's other tokens */
        for (t = from + nx; t < n; t++) mg[nm++] = (uint32_t)t;
        if (split) {
            /* score copies of the rows (after their indices: a row of 2-byte elements may
               be 2 bytes off a uint32_t) */
            unsigned char *kb = (unsigned char *)cb + oi;
            uint32_t *id = (uint32_t *)(void *)kb;
            for (t = 0; t < nm; t++) {
                memcpy(kb + ob + t * c->row, pqc__krow(c, H, mg[t]), c->row);
                id[t] = (uint32_t)t;
            }
            keys.data = kb + ob;
            keys.rows = nm;
            r = pqc__rerank_impl(c->rt, &keys, j->q + hi * c->g * c->d.head_dim, c->g, c->sp.gqa, c->sp.scale, id, nm,
                                 take, &H->scratch, out, NULL, 0, nm - nsel);
            for (t = 0; r == PQC_SUCCESS && t < take; t++) out[t] = mg[out[t]];
        } else {
            r = pqc__rerank_impl(c->rt, &keys, j->q + hi * c->g * c->d.head_dim, c->g, c->sp.gqa, c->sp.scale, mg, nm,
                                 take, &H->scratch, out, NULL, 0, nm - nsel);
        }
        for (t = 0; r == PQC_SUCCESS && t < take; t++) /* coded indices, the rivals after them */
            out[t] = out[t] >= from ? (uint32_t)(coded + (out[t] - from)) : out[t] - (uint32_t)ns;
    }
    pqc__free(&c->alloc, tmp);
    return r;
}

/* Head hi's selection: sinks, its top-k of the coded mid tokens (none, all of them, the
   PQ top-k, or the top-k of its candidates scored exactly, as the plan says), the
   tokens not coded yet, the window; ascending. Under PQC_SPLIT_COMPETE, while the coded
   tokens are searched, the window's tokens but its last PQC__WIN_MIN (its rivals) are
   chosen with the coded ones, by the same scores (theirs exact): the head's top-k and
   those tokens' places go to the best of both. */
static void pqc__select_head(void *ctx, size_t hi)
{
    pqc__sel_job *j = (pqc__sel_job *)ctx;
    pqc_cache *c = j->c;
    pqc__layer *L = &c->layers[j->layer];
    size_t n = L->n_tokens, sink = PQC__MIN((size_t)c->d.n_sink, n), mid_end = pqc__mid_end(c, L, n), t, o = 0, k;
    size_t from = PQC__MAX(mid_end, sink), nx = 0, coded = L->n_coded, unc = (size_t)c->d.n_sink + coded, kc = 0;
    uint32_t *out = j->out + hi * j->out_cap;
    pqc_result r = PQC_SUCCESS;
    int placed = 0;
    for (t = 0; t < sink; t++) out[o++] = (uint32_t)t;
    if (j->search) nx = pqc__rivals_of(c, L, n);
    if (j->search && j->takes[hi] + nx > 0) {
        /* (a head the adaptive split gave none of the layer's top-k takes sinks, uncoded
           tokens and window only) */
        float *xd = NULL;
        k = j->takes[hi] + nx;
        if (j->exact) {
            r = pqc__select_exact(j, hi, from, nx, out + o);
        } else {
            if (nx > 0 && !j->gpu_idx) /* (the tier's top-k holds the rivals already) */
                r = pqc__rival_dots(j, hi, sink, from, nx, n, &xd);
            if (r == PQC_SUCCESS) r = pqc__head_pq_top(j, hi, xd, nx, xd ? sink + PQC__WIN_MIN : 0, &k, out + o);
        }
        if (r != PQC_SUCCESS) {
            j->head_res[hi] = r;
            return;
        }
        for (kc = 0; kc < k && out[o + kc] < coded; kc++) out[o + kc] += (uint32_t)c->d.n_sink;
        if (kc < k) { /* rivals chosen: after the tokens not coded yet */
            size_t u = mid_end > unc ? mid_end - unc : 0;
            memmove(out + o + kc + u, out + o + kc, (k - kc) * sizeof(uint32_t));
            for (t = kc + u; t < k + u; t++) out[o + t] = (uint32_t)(from + (out[o + t] - coded));
            for (t = 0; t < u; t++) out[o + kc + t] = (uint32_t)(unc + t);
            o += k + u;
            placed = 1;
        } else {
            o += k;
        }
    } else if (!j->search && j->take > 0) {
        for (t = 0; t < L->n_coded; t++) out[o++] = (uint32_t)(sink + t); /* budget covers all coded */
    }
    for (t = unc; !placed && t < mid_end; t++) out[o++] = (uint32_t)t; /* not coded yet */
    for (t = nx ? n - PQC__WIN_MIN : from; t < n; t++) out[o++] = (uint32_t)t; /* window */
    j->out_count[hi] = o;
    j->head_res[hi] = PQC_SUCCESS;
}

static void pqc__select_heads_pfor(void *ctx, size_t h) { pqc__select_head(ctx, h); }

/* Selection is computed into the cache's own buffer and copied into sel only when every
   head succeeded, so a failed select leaves sel (and the cache) as they were. */
/* Metric drift. A head's codebook spends its centroids where the observed queries
   looked: weighted k-means leaves a residual in dimension e of roughly 1/w_e (relative).
   A decode query q then sees the score error M = (sum_e q_e^2 / w_e) (sum_e w_e) /
   (d_h sum_e q_e^2) relative to a query shaped like the metric (M = 1 for q_e^2 ~ w_e;
   on the hard-keys suite, decode queries like the observed ones give 0.3-1.2, queries
   looking elsewhere 2-80). Above PQC__DRIFT_RATIO the query is counted (into qpend), and
   the layer is rebuilt in the background with the metric of the drifted queries (at
   most once per 1/8 growth of its coded tokens). */
#define PQC__DRIFT_RATIO 1.5

static void pqc__drift_note(pqc_cache *c, int l, const float *q)
{
    pqc__layer *L = &c->layers[l];
    size_t d = (size_t)c->d.head_dim, e, nkv = (size_t)c->d.n_kv_heads;
    int h, hh;
    if (c->d.metric == PQC_METRIC_L2) return;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        const pqc_pq *pq = &L->heads[h].pq;
        double all = 0.0, inv = 0.0, wsum = 0.0;
        size_t ds = (size_t)pq->dsub, j;
        if (!pq->metric && !pq->mblocks) continue;
        /* the weights: the metric's, or the blocks' diagonals (each dim's own weight) */
        for (hh = 0; hh < c->g; hh++) {
            const float *qr = q + ((size_t)h * (size_t)c->g + (size_t)hh) * d;
            if (pq->metric)
                for (e = 0; e < d; e++) {
                    double v = (double)qr[e] * (double)qr[e];
                    all += v;
                    inv += v / (double)pq->metric[e];
                    if (hh == 0) wsum += pq->metric[e];
                }
            else
                for (j = 0; j < (size_t)pq->m; j++)
                    for (e = 0; e < ds; e++) {
                        double v = qr[pqc_pq_dim(pq, (int)j, (int)e)], w = pq->mblocks[(j * ds + e) * ds + e];
                        all += v * v;
                        inv += v * v / w;
                        if (hh == 0) wsum += w;
                    }
        }
        if (!(all > 0.0) || !(inv * wsum > PQC__DRIFT_RATIO * (double)d * all)) continue;
        for (hh = 0; hh < c->g; hh++) {
            const float *qr = q + ((size_t)h * (size_t)c->g + (size_t)hh) * d;
            for (e = 0; e < d; e++) L->qpend[(size_t)h * d + e] += (double)qr[e] * (double)qr[e];
            if (pqc__bands(c)) pqc__blocks_add(c, L->qpend + nkv * (d + 1) + (size_t)h * pqc__blocks_len(c), qr);
        }
        L->qpend[nkv * d + (size_t)h] += (double)c->g;
        L->qpend[pqc__qsq_part(c)] = 1.0;
    }
}


/* Each head's top-k (into takes) from the even top-k `take`; returns the largest. Under
   PQC_SPLIT_COMPETE or ADAPTIVE, once every head's observed attention was measured, the layer's
   total (heads x take) goes to the mid tokens with the most observed attention, whatever
   their head (water-filling over the heads' histograms: every token of the bins above a
   common threshold, the threshold bin shared in proportion; what the histograms do not
   cover, such as tokens coded since, shared evenly), each head at least take/4 (decode
   queries are not the observed ones) and at most its coded tokens. A budget that covers
   every coded token stays with every head. */
static size_t pqc__head_takes(const pqc_cache *c, const pqc__layer *L, size_t take, size_t *takes)
{
    size_t nh = (size_t)c->d.n_kv_heads, h, mx = 0, lo = take / 4, given = 0, spare;
    double total = (double)take * (double)nh, cum = 0.0, in_bin = 0.0;
    int adaptive = c->sp.adaptive && take > 0 && take < L->n_coded && nh > 1 &&
                   L->heads[0].pq.m != 0, b = 0;
    for (h = 0; adaptive && h < nh; h++) adaptive = L->omass[2 * h] >= 0.0;
    for (h = 0; h < nh; h++) takes[h] = take;
    if (!adaptive) return take;
    for (b = 0; b < PQC__OBS_BINS; b++) { /* the threshold bin: the first one that does not fit */
        in_bin = 0.0;
        for (h = 0; h < nh; h++) in_bin += L->ohist[h * PQC__OBS_BINS + (size_t)b];
        if (cum + in_bin > total) break;
        cum += in_bin;
    }
    for (h = 0; h < nh; h++) {
        const double *hist = L->ohist + h * PQC__OBS_BINS;
        double k = 0.0;
        int i;
        for (i = 0; i < b && i < PQC__OBS_BINS; i++) k += hist[i];
        if (b < PQC__OBS_BINS && in_bin > 0.0) k += (total - cum) * hist[b] / in_bin;
        takes[h] = (size_t)floor(k);
        if (takes[h] < lo) takes[h] = lo;
        if (takes[h] > L->n_coded) takes[h] = L->n_coded;
        given += takes[h];
    }
    spare = given < take * nh ? (take * nh - given) / nh : 0;
    for (h = 0; h < nh; h++) {
        takes[h] = PQC__MIN(takes[h] + spare, L->n_coded);
        if (takes[h] > mx) mx = takes[h];
    }
    return mx;
}

/* ----- the step plan -----
   One function plans a decode step of a layer for pqc_cache_select and the device step
   alike: each head's top-k (c->takes) and exact candidates (c->cands), whether the coded
   tokens are searched, scored again exactly, and whether the tier's search finds the
   candidates; with the part fixed at creation (c->sp, pqc__plan_init) nothing else reads
   the options or the tier's capabilities. */
typedef struct pqc__plan {
    size_t n;        /* the layer's tokens */
    size_t coded0;   /* coded before the step: a failed step codes back to it */
    size_t take;     /* the largest of the heads' top-k (c->takes) */
    size_t ctake;    /* the largest of the heads' candidates (c->cands), or take */
    int search;      /* 0 < take < coded: the coded tokens are searched */
    int exact;       /* the candidates are scored again with the stored keys */
    int trim;        /* a head takes fewer than ctake: the tier's search returns scores */
    int tier_search; /* the tier's search finds the candidates */
} pqc__plan;

/* What every step checks first: the layer, a finite query, tokens to select from. */
static pqc_result pqc__step_check(pqc_cache *c, int layer, const float *q, const char *what)
{
    pqc_result r;
    if ((r = pqc__check_layer(c, layer, what)) != PQC_SUCCESS) return r;
    if (!q) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "%s: null query", what);
    if (c->layers[layer].n_tokens == 0) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "%s: layer %d is empty", what, layer);
    if (!pqc__finite_row(q, (size_t)c->d.n_q_heads * c->d.head_dim))
        return pqc__cfail(c, PQC_ERROR_NON_FINITE, "%s: query holds NaN, Inf or a huge value", what);
    return PQC_SUCCESS;
}

/* Installs the layer's finished build, codes what is due, and plans the step: top-k =
   budget - window (the budget counting the tokens beyond the sinks; without a codebook
   every coded-or-not mid token is attended), shared over the heads as the split says;
   exact scoring takes each head's top ceil(rerank x top-k) by PQ score (its top-k with
   only an outlier list); candidates covering every coded token need no search. */
static pqc_result pqc__plan_step(pqc_cache *c, int layer, pqc__plan *p)
{
    pqc__layer *L = &c->layers[layer];
    size_t mid, budget;
    int h;
    pqc_result r;
    if ((r = pqc__join_build(c, layer)) != PQC_SUCCESS) return r;
    p->n = L->n_tokens;
    p->coded0 = L->n_coded;
    if ((r = pqc__code_pending(c, layer, p->n)) != PQC_SUCCESS) return r;
    mid = p->n - pqc__sink_end(c, p->n);
    budget = pqc__budget(c, mid);
    p->take = budget > pqc__window_of(c, L) ? budget - pqc__window_of(c, L) : 0;
    if (L->heads[0].pq.m == 0 || p->take > L->n_coded) p->take = L->n_coded;
    p->take = pqc__head_takes(c, L, p->take, c->takes);
    p->search = p->take > 0 && p->take < L->n_coded;
    p->exact = p->search && c->sp.exact;
    p->ctake = p->take;
    if (p->exact)
        for (h = 0, p->ctake = 0; h < c->d.n_kv_heads; h++) {
            double f = L->rfac[h] > 0 ? L->rfac[h] : c->sp.rerank;
            double want = c->sp.rerank > 0 ? ceil(f * (double)c->takes[h]) : (double)c->takes[h];
            c->cands[h] = want >= (double)L->n_coded ? L->n_coded : (size_t)want;
            if (c->cands[h] > p->ctake) p->ctake = c->cands[h];
        }
    for (h = 0, p->trim = 0; h < c->d.n_kv_heads; h++) /* a head takes fewer */
        p->trim |= (p->exact ? c->cands[h] : c->takes[h]) < p->ctake;
    p->tier_search = p->search && p->ctake < L->n_coded && c->sp.tier_search;
    return PQC_SUCCESS;
}

/* A step's selection made (count[h] rows of head h): its figures, and the drift note. */
static void pqc__step_done(pqc_cache *c, int layer, const float *q, const pqc__plan *p, const size_t *count, double t0)
{
    pqc__layer *L = &c->layers[layer];
    size_t h, nh = (size_t)c->d.n_kv_heads;
    for (h = 0; h < nh; h++) L->st.tokens_selected += count[h];
    if (p->search) {
        size_t need = pqc_codes_bytes(&L->heads[0].codes) * nh; /* codes prefetched per step */
        L->st.bytes_codes += need;
        L->st.bytes_h2d += need;
    }
    L->st.selects++;
    L->st.select_s += pqc__now() - t0;
    pqc__drift_note(c, layer, q);
    if (!c->in_step) pqc__drift_commit(c, layer, 1); /* a driver step commits at its end */
}

static pqc_result pqc__select_impl(pqc_cache *c, int layer, const float *q, pqc_selection *sel, int parallel)
{
    pqc__layer *L;
    pqc_result r;
    pqc__sel_job j;
    pqc__plan p;
    size_t n, nh;
    int h;
    double t0 = pqc__now();
    if ((r = pqc__step_check(c, layer, q, "pqc_cache_select")) != PQC_SUCCESS) return r;
    if (!sel || !sel->idx || !sel->count)
        return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_select: null selection");
    if (sel->n_kv_heads != c->d.n_kv_heads)
        return pqc__cfail(c, PQC_ERROR_BAD_SHAPE, "pqc_cache_select: selection sized for %d heads", sel->n_kv_heads);
    L = &c->layers[layer];
    n = L->n_tokens;
    nh = (size_t)c->d.n_kv_heads;
    if (n > sel->capacity && !sel->owned)
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_select: selection holds %zu indices per head, %zu tokens",
                          sel->capacity, n);
    /* everything that can fail for want of memory, before anything changes */
    if (n > c->sbuf_cap) {
        size_t cap = pqc__selection_cap(c, n), bytes;
        unsigned char *nb;
        if (!pqc__size3(nh, cap * sizeof(uint32_t) + sizeof(size_t) + sizeof(pqc_result), 1, &bytes) ||
            !(nb = (unsigned char *)pqc__alloc(&c->alloc, bytes)))
            return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_select: %zu indices per head", cap);
        pqc__free(&c->alloc, c->sbuf);
        c->sbuf = nb;
        c->sbuf_cap = cap;
    }
    if (n > sel->capacity && (r = pqc__selection_grow(c, sel, pqc__selection_cap(c, n))) != PQC_SUCCESS) return r;
    if ((r = pqc__plan_step(c, layer, &p)) != PQC_SUCCESS) return r;
    j.c = c;
    j.layer = layer;
    j.q = q;
    j.take = p.take;
    j.takes = c->takes;
    j.search = p.search;
    j.exact = p.exact;
    j.cands = c->cands;
    j.ctake = p.ctake;
    j.out_count = (size_t *)c->sbuf;
    j.head_res = (pqc_result *)(j.out_count + nh);
    j.out = (uint32_t *)(j.head_res + nh);
    j.out_cap = c->sbuf_cap;
    j.gpu_idx = NULL;
    j.gpu_sc = NULL;
    /* the tier's top-k holds the window's rivals too, unless exact scoring adds them */
    if (p.tier_search && !p.exact) j.ctake += pqc__rivals_of(c, L, n);
    if (p.tier_search && (r = c->tier->search(c, layer, q, j.ctake, p.trim, &j.gpu_idx, &j.gpu_sc)) != PQC_SUCCESS) {
        pqc__codes_truncate(c, layer, p.coded0);
        return r;
    }
    if (parallel && j.search && !j.gpu_idx) {
        pqc__parallel_for(c->rt, nh, pqc__select_heads_pfor, &j);
        /* a head that failed on a worker runs again here, so that its error (and message)
           is this thread's, or it succeeds this time */
        for (h = 0; h < c->d.n_kv_heads; h++)
            if (j.head_res[h] != PQC_SUCCESS) pqc__select_head(&j, (size_t)h);
    } else {
        for (h = 0; h < c->d.n_kv_heads; h++) pqc__select_head(&j, (size_t)h);
    }
    for (h = 0; h < c->d.n_kv_heads; h++)
        if ((r = j.head_res[h]) != PQC_SUCCESS) {
            pqc__codes_truncate(c, layer, p.coded0);
            return r;
        }
    for (h = 0; h < c->d.n_kv_heads; h++) {
        sel->count[h] = j.out_count[h];
        memcpy(sel->idx + (size_t)h * sel->capacity, j.out + (size_t)h * j.out_cap, j.out_count[h] * sizeof(uint32_t));
    }
    pqc__step_done(c, layer, q, &p, j.out_count, t0);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_select(pqc_cache *c, int layer, const float *q, pqc_selection *sel)
{
    if (!c) return pqc__select_impl(c, layer, q, sel, 1);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__select_impl(c, layer, q, sel, 1));
}

static pqc_result pqc__head_plan(pqc_cache *c, int layer, const float *q, int head, pqc_head_plan *plan, float *scores,
                                 size_t cap)
{
    pqc__plan p;
    pqc__layer *L;
    pqc__head *H;
    pqc_result r;
    if ((r = pqc__step_check(c, layer, q, "pqc_cache_head_plan")) != PQC_SUCCESS) return r;
    if (!plan) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_head_plan: null plan");
    if (head < 0 || head >= c->d.n_kv_heads)
        return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_head_plan: head %d not in 0..%d", head, c->d.n_kv_heads - 1);
    if ((r = pqc__plan_step(c, layer, &p)) != PQC_SUCCESS) return r;
    L = &c->layers[layer];
    H = &L->heads[head];
    if (scores && L->n_coded > 0 && H->pq.m != 0) {
        pqc_search_desc sd;
        if (cap < L->n_coded)
            r = pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_head_plan: %zu coded tokens, room for %zu scores", L->n_coded,
                           cap);
        memset(&sd, 0, sizeof sd);
        sd.gqa = c->sp.gqa;
        sd.softmax_scale = c->sp.scale;
        pqc__residual_desc(c, H, &sd);
        if (r == PQC_SUCCESS)
            r = pqc_pq_scores(c->rt, &H->pq, &H->codes, q + (size_t)head * (size_t)c->g * (size_t)c->d.head_dim, c->g,
                              &sd, NULL, scores);
        if (r != PQC_SUCCESS) {
            pqc__codes_truncate(c, layer, p.coded0); /* as it was (an install is undone at the call's end) */
            return r;
        }
    }
    plan->tokens = p.n;
    plan->sinks = pqc__sink_end(c, p.n);
    plan->window = p.n - pqc__mid_end(c, L, p.n);
    plan->coded = L->n_coded;
    plan->take = c->takes[head];
    plan->candidates = p.exact ? c->cands[head] : plan->take;
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_head_plan(pqc_cache *c, int layer, const float *q, int head, pqc_head_plan *plan,
                                      float *scores, size_t cap)
{
    if (!c) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_head_plan: null cache");
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__head_plan(c, layer, q, head, plan, scores, cap));
}

/* ---------------------------------------------------------------------------------------
   12. Block cache and fetch: admission (one function for every tier), the bookkeeping of
   hits and traffic, and the host tier
   ------------------------------------------------------------------------------------- */

/* The victim slot for a new block: an empty slot, else by policy (LRU: least recently
   used; LFU: lowest decayed frequency score, then least recently used), never a slot
   admitted or used in this step; -1 if there is none. */
static int pqc__victim(const pqc_cache *c, const pqc__head *H, uint64_t step)
{
    int s, best = -1;
    for (s = 0; s < c->d.cache_blocks; s++) {
        if (H->block_of[s] < 0) return s;
        if (H->stamp[s] == step) continue;
        if (best < 0) {
            best = s;
            continue;
        }
        if (c->d.policy == PQC_POLICY_LRU) {
            if (H->stamp[s] < H->stamp[best]) best = s;
        } else {
            float a = H->score[H->block_of[s]], b = H->score[H->block_of[best]];
            if (a < b || (a == b && H->stamp[s] < H->stamp[best])) best = s;
        }
    }
    return best;
}

#define PQC__SCORE_DECAY 0.75f
#define PQC__ADMIT_MARGIN 1.5f

/* Blocks every tier holds in device memory by design: those overlapping the sinks or the
   recent window (the CUDA tier keeps them in its sink slots and window ring; the host
   tier reads them where they are). They are never admission candidates, and their
   selected mid tokens are hits. */
static int pqc__block_resident(const pqc_cache *c, size_t b, size_t mid_end)
{
    size_t bt = (size_t)c->d.block_tokens;
    return b * bt < (size_t)c->d.n_sink || (b + 1) * bt > mid_end;
}

/* The slot serving mid token t of head H, or -1 (not cached, or past the rows copied). */
static int pqc__slot_of_row(const pqc_cache *c, const pqc__head *H, size_t t)
{
    size_t bt = (size_t)c->d.block_tokens;
    int s = c->d.cache_blocks > 0 && c->d.admit_blocks > 0 ? H->slot_of[t / bt] : -1;
    return s >= 0 && (t % bt) < H->filled[s] ? s : -1;
}

/* One copy into the block cache: rows [r0, r1) of block `block` into slot `slot`. */
typedef struct pqc__fill {
    int32_t block, slot;
    uint32_t r0, r1;
} pqc__fill;

/* Admission of one head after a selection, the same on every tier: every block's score
   is a decayed count of its selected tokens; the blocks selected now (resident ones
   excepted) are candidates in score order, and one enters only into a free slot or when
   its score beats the victim's by the margin, so blocks selected once never churn the
   cache; a cached block that grew is topped up. Updates H's bookkeeping and lists the
   copies to make in fills[] (at most admit_blocks); returns how many. Runs before the
   gather, so admitted blocks serve the step that selected them. */
static size_t pqc__admit(const pqc_cache *c, pqc__head *H, const uint32_t *idx, size_t cnt, size_t mid_hi,
                         uint64_t step, pqc__fill *fills)
{
    uint32_t *cntb = H->count_tmp;
    float *sc = H->score;
    size_t bt = (size_t)c->d.block_tokens, mid_lo = (size_t)c->d.n_sink, b, i, nb = (mid_hi + bt - 1) / bt, nf = 0;
    int a;
    for (b = 0; b < nb; b++) sc[b] *= PQC__SCORE_DECAY;
    for (i = 0; i < cnt; i++)
        if (idx[i] >= mid_lo && idx[i] < mid_hi && !pqc__block_resident(c, idx[i] / bt, mid_hi)) cntb[idx[i] / bt]++;
    for (b = 0; b < nb; b++) sc[b] += (float)cntb[b];
    for (a = 0; a < c->d.admit_blocks; a++) {
        size_t best = nb, valid;
        int s;
        for (b = 0; b < nb; b++)
            if (cntb[b] > 0 && (best == nb || sc[b] > sc[best])) best = b;
        if (best == nb) break;
        cntb[best] = 0; /* taken */
        valid = PQC__MIN(bt, mid_hi - best * bt);
        s = H->slot_of[best];
        if (s < 0) {
            s = pqc__victim(c, H, step + 1);
            if (s < 0) break;
            if (H->block_of[s] >= 0 && !(sc[best] > PQC__ADMIT_MARGIN * sc[H->block_of[s]] + 1.0f))
                continue; /* not worth a block copy: hysteresis keeps near-ties from swapping */
            if (H->block_of[s] >= 0) H->slot_of[H->block_of[s]] = -1;
            { /* the slot was topped up earlier in this step: that copy is moot (and two
                 copies into one slot must not race on a device) */
                size_t f, g = 0;
                for (f = 0; f < nf; f++)
                    if (fills[f].slot != s) fills[g++] = fills[f];
                nf = g;
            }
            H->filled[s] = 0;
            H->block_of[s] = (int32_t)best;
            H->slot_of[best] = s;
            H->freq[s] = 0;
            H->stamp[s] = step + 1;
        }
        if (H->filled[s] < valid) { /* admitted, or a partial block that grew */
            fills[nf].block = (int32_t)best;
            fills[nf].slot = s;
            fills[nf].r0 = H->filled[s];
            fills[nf].r1 = (uint32_t)valid;
            nf++;
            H->filled[s] = (uint32_t)valid;
        }
    }
    for (b = 0; b < nb; b++) cntb[b] = 0;
    return nf;
}

typedef struct pqc__fetch_job {
    pqc_cache *c;
    int layer;
    const pqc_selection *sel;
    const pqc_kv_out *out;
    uint64_t *hits, *misses, *h2d;
    int *copy_failed; /* [head] host tier: a backend copy failed */
    pqc__fill *fills; /* [head][admit_blocks] */
    size_t *nfill;    /* [head] */
    const void **src; /* host tier: [head]{[rows_cap] K rows, [rows_cap] V rows}: where each row is */
    size_t rows_cap, chunks;
    int stream; /* host tier: the rows go out with non-temporal stores (pqc__fetch_copy) */
} pqc__fetch_job;

/* The bookkeeping of one head, the same on every tier: admission, then hits (resident
   blocks and cached rows), misses and bytes host -> device. */
static void pqc__fetch_account(void *ctx, size_t hi)
{
    pqc__fetch_job *j = (pqc__fetch_job *)ctx;
    pqc_cache *c = j->c;
    pqc__layer *L = &c->layers[j->layer];
    pqc__head *H = &L->heads[hi];
    size_t cnt = j->sel->count[hi], i, f, bt = (size_t)c->d.block_tokens, nf = 0;
    size_t mid_lo = (size_t)c->d.n_sink, mid_hi = pqc__mid_end(c, L, L->n_tokens);
    const uint32_t *idx = j->sel->idx + hi * j->sel->capacity;
    pqc__fill *fills = j->fills + hi * (size_t)c->d.admit_blocks;
    uint64_t hits = 0, misses = 0, h2d = 0, step = L->step;
    if (c->d.cache_blocks > 0 && c->d.admit_blocks > 0) nf = pqc__admit(c, H, idx, cnt, mid_hi, step, fills);
    for (f = 0; f < nf; f++) h2d += (size_t)(fills[f].r1 - fills[f].r0) * 2 * c->row;
    for (i = 0; i < cnt; i++) {
        size_t t = idx[i];
        int s;
        if (t < mid_lo || t >= mid_hi) continue; /* sinks and window: not counted */
        if (pqc__block_resident(c, t / bt, mid_hi)) {
            hits++;
        } else if ((s = pqc__slot_of_row(c, H, t)) >= 0) {
            if (H->stamp[s] != step + 1) H->freq[s]++;
            H->stamp[s] = step + 1;
            hits++;
        } else {
            misses++;
            h2d += 2 * c->row;
        }
    }
    j->nfill[hi] = nf;
    j->hits[hi] = hits;
    j->misses[hi] = misses;
    j->h2d[hi] = h2d;
}

/* ----- the host tier's fetch: slots in memory from the cache's pqc_backend ----- */

/* Makes head hi's copies into its slots, then records where each selected row is read:
   a cached slot row or the host store. */
static void pqc__host_fetch_head(void *ctx, size_t hi)
{
    pqc__fetch_job *j = (pqc__fetch_job *)ctx;
    pqc_cache *c = j->c;
    pqc__layer *L = &c->layers[j->layer];
    pqc__head *H = &L->heads[hi];
    size_t cnt = j->sel->count[hi], i, f, bt = (size_t)c->d.block_tokens, slot_bytes = bt * 2 * c->row, r;
    size_t mid_lo = (size_t)c->d.n_sink, mid_hi = pqc__mid_end(c, L, L->n_tokens);
    const uint32_t *idx = j->sel->idx + hi * j->sel->capacity;
    const pqc__fill *fills = j->fills + hi * (size_t)c->d.admit_blocks;
    const void **srck = j->src + hi * 2 * j->rows_cap, **srcv = srck + j->rows_cap;
    j->copy_failed[hi] = 0;
    for (f = 0; f < j->nfill[hi]; f++) {
        unsigned char *slot = H->dev + (size_t)fills[f].slot * slot_bytes;
        size_t b = (size_t)fills[f].block;
        for (r = fills[f].r0; r < fills[f].r1; r++)
            if (c->be.iface.copy_h2d(c->be.ctx, slot + r * 2 * c->row, pqc__krow(c, H, b * bt + r), c->row) ||
                c->be.iface.copy_h2d(c->be.ctx, slot + (r * 2 + 1) * c->row, pqc__vrow(c, H, b * bt + r), c->row)) {
                j->copy_failed[hi] = 1;
                return;
            }
    }
    for (i = 0; i < cnt; i++) {
        size_t t = idx[i];
        int s = t >= mid_lo && t < mid_hi && !pqc__block_resident(c, t / bt, mid_hi) ? pqc__slot_of_row(c, H, t) : -1;
        if (s >= 0) {
            const unsigned char *slot_row = H->dev + (size_t)s * slot_bytes + (t % bt) * 2 * c->row;
            srck[i] = slot_row;
            srcv[i] = slot_row + c->row;
        } else {
            srck[i] = pqc__krow(c, H, t);
            srcv[i] = pqc__vrow(c, H, t);
        }
    }
}

#define PQC__FETCH_CHUNK 512
#define PQC__FETCH_PARALLEL_ROWS 4096
/* A fetch whose rows (K and V as fp32, every head) come to at least this many bytes
   writes them with non-temporal stores where they start on 64-byte lines: rows that many
   would not stay in cache for the engine's read anyway, and stores that fill whole lines
   around the caches save reading each line before writing it. Fetch, then a read that
   only adds up every row (the reader that gains most from rows left in cache; 8 KV
   heads, fp16 rows, one core), regular against non-temporal stores: 128K tokens (107 MB
   of rows) 24.3-25.2 -> 18.3-18.7 ms, 64K (54 MB) 8.6-8.8 against 8.1-8.7, 32K (27 MB)
   3.5 against 3.8: the crossing near 60 MB. */
#ifndef PQC__FETCH_STREAM_BYTES
#define PQC__FETCH_STREAM_BYTES ((size_t)64 << 20)
#endif
/* copies chunk q (head q / chunks_per_head) of the gathered rows (from host or from a
   block-cache slot), converting to fp32 */
static void pqc__fetch_copy(void *ctx, size_t q)
{
    pqc__fetch_job *j = (pqc__fetch_job *)ctx;
    const pqc_cache *c = j->c;
    size_t hi = q / j->chunks, r0 = (q % j->chunks) * PQC__FETCH_CHUNK, cnt = j->sel->count[hi], i, d = (size_t)c->d.head_dim;
    const void **srck = j->src + hi * 2 * j->rows_cap, **srcv = srck + j->rows_cap;
    float *ko = j->out->k + hi * j->out->head_stride * d, *vo = j->out->v + hi * j->out->head_stride * d;
    pqc_simd simd = pqc__simd(c->rt);
    for (i = r0; i < cnt && i < r0 + PQC__FETCH_CHUNK; i++) {
        if (i + PQC__ROWS_AHEAD < cnt) { /* the rows scattered over the store: asked for early */
            const char *nk = (const char *)srck[i + PQC__ROWS_AHEAD], *nv = (const char *)srcv[i + PQC__ROWS_AHEAD];
            size_t o;
            for (o = 0; o < c->row; o += 64) {
                PQC__PREFETCH(nk + o);
                PQC__PREFETCH(nv + o);
            }
        }
        pqc__k_rowpair(simd, srck[i], srcv[i], c->d.kv_dtype, d, ko + i * d, vo + i * d, j->stream);
    }
    if (j->stream) pqc__k_stream_fence(simd);
}

/* Host tier: room for the row sources (kept across steps); nothing else can fail. */
static pqc_result pqc__host_fetch_prepare(pqc_cache *c, size_t rows_cap)
{
    size_t nh = (size_t)c->d.n_kv_heads;
    if (nh * 2 * rows_cap > c->fsrc_cap) {
        size_t want = nh * 2 * rows_cap + nh * 2 * rows_cap / 4;
        const void **ns = (const void **)pqc__alloc(&c->alloc, want * sizeof(void *));
        if (!ns) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_fetch: allocation failed");
        pqc__free(&c->alloc, (void *)c->fsrc);
        c->fsrc = ns;
        c->fsrc_cap = want;
    }
    return PQC_SUCCESS;
}

/* Host tier: the copies into slots and the gather (or only the row sources, for
   fetch_rows, when out is NULL), in parallel over heads and row chunks when worth it. */
static pqc_result pqc__host_fetch(pqc_cache *c, struct pqc__fetch_job *j, pqc_kv_device *dout, int parallel)
{
    size_t nh = (size_t)c->d.n_kv_heads, h, rows = 0;
    (void)dout; /* rows stay in host memory on this tier */
    j->src = c->fsrc;
    c->frows_cap = j->rows_cap;
    for (h = 0; h < nh; h++) rows += j->sel->count[h];
    j->stream = j->out && rows * 2 * (size_t)c->d.head_dim * sizeof(float) >= c->fetch_stream;
    /* waking the pool costs tens of microseconds: only for work worth it */
    if (parallel && nh > 1) pqc__parallel_for(c->rt, nh, pqc__host_fetch_head, j);
    else
        for (h = 0; h < nh; h++) pqc__host_fetch_head(j, h);
    for (h = 0; h < nh; h++)
        if (j->copy_failed[h]) { /* the blocks being admitted were not copied: forget them */
            size_t g, f;
            for (g = 0; g < nh; g++)
                for (f = 0; f < j->nfill[g]; f++) {
                    pqc__head *H = &c->layers[j->layer].heads[g];
                    const pqc__fill *fl = j->fills + g * (size_t)c->d.admit_blocks + f;
                    if (H->block_of[fl->slot] == fl->block) H->slot_of[fl->block] = -1;
                    H->block_of[fl->slot] = -1;
                    H->filled[fl->slot] = 0;
                }
            return pqc__cfail(c, PQC_ERROR_BACKEND, "pqc_cache_fetch: the %s backend failed a copy",
                              c->be.iface.name ? c->be.iface.name : "engine's");
        }
    if (j->out) {
        if (parallel && rows >= PQC__FETCH_PARALLEL_ROWS) pqc__parallel_for(c->rt, nh * j->chunks, pqc__fetch_copy, j);
        else
            for (h = 0; h < nh * j->chunks; h++) pqc__fetch_copy(j, h);
    }
    if (c->be.iface.synchronize) c->be.iface.synchronize(c->be.ctx);
    return PQC_SUCCESS;
}

/* The fetch shared by every tier: checks, then everything that can fail for want of
   memory, then the bookkeeping (admission, hits, traffic), then the tier's copies and
   gather. */
static pqc_result pqc__fetch_impl(pqc_cache *c, int layer, const pqc_selection *sel, const pqc_kv_out *out,
                                  pqc_kv_device *dout, int parallel)
{
    int copy = out != NULL; /* NULL: fetch_rows or fetch_device */
    pqc__layer *L;
    pqc_result r;
    pqc__fetch_job j;
    unsigned char *mem, sbuf[PQC__SMALL_BUF];
    void *held;
    size_t nh, h, ab;
    double t0 = pqc__now();
    if ((r = pqc__check_layer(c, layer, "pqc_cache_fetch")) != PQC_SUCCESS) return r;
    if (!sel || (copy && (!out->k || !out->v)) || !sel->count || !sel->idx)
        return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_fetch: null selection or output");
    if (sel->n_kv_heads != c->d.n_kv_heads)
        return pqc__cfail(c, PQC_ERROR_BAD_SHAPE, "pqc_cache_fetch: selection sized for %d heads", sel->n_kv_heads);
    L = &c->layers[layer];
    if (L->n_tokens == 0) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "pqc_cache_fetch: layer %d is empty", layer);
    nh = (size_t)c->d.n_kv_heads;
    for (h = 0; h < nh; h++) {
        size_t i, cnt = sel->count[h];
        const uint32_t *idx = sel->idx + h * sel->capacity;
        if (cnt > sel->capacity)
            return pqc__cfail(c, PQC_ERROR_BAD_SHAPE, "pqc_cache_fetch: head %zu holds %zu indices, capacity %zu", h, cnt,
                              sel->capacity);
        if (copy && cnt > out->head_stride)
            return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_fetch: %zu rows selected, head_stride %zu", cnt,
                              out->head_stride);
        for (i = 0; i < cnt; i++)
            if (idx[i] >= L->n_tokens || (i > 0 && idx[i] <= idx[i - 1]))
                return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_fetch: head %zu index %zu invalid or unsorted", h, i);
    }
    if ((r = pqc__tier_adm_pull(c, layer)) != PQC_SUCCESS) return r; /* after device steps */
    memset(&j, 0, sizeof j);
    for (h = 0, j.rows_cap = 1; h < nh; h++) j.rows_cap = PQC__MAX(j.rows_cap, sel->count[h]);
    j.chunks = (j.rows_cap + PQC__FETCH_CHUNK - 1) / PQC__FETCH_CHUNK;
    if ((r = c->tier->fetch_prepare(c, j.rows_cap)) != PQC_SUCCESS) return r;
    ab = (size_t)(c->d.admit_blocks > 0 ? c->d.admit_blocks : 1);
    mem = (unsigned char *)pqc__small_get(&c->alloc, sbuf, sizeof sbuf,
                                          nh * (4 * sizeof(uint64_t) + ab * sizeof(pqc__fill) + sizeof(int)), &held);
    if (!mem) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_fetch: allocation failed");
    j.c = c;
    j.layer = layer;
    j.sel = sel;
    j.out = out;
    j.hits = (uint64_t *)mem;
    j.misses = j.hits + nh;
    j.h2d = j.misses + nh;
    j.nfill = (size_t *)(j.h2d + nh);
    j.fills = (pqc__fill *)(j.nfill + nh);
    j.copy_failed = (int *)(j.fills + nh * ab);
    for (h = 0; h < nh; h++) pqc__fetch_account(&j, h);
    r = c->tier->fetch(c, &j, dout, parallel);
    if (r == PQC_SUCCESS)
        for (h = 0; h < nh; h++) {
            L->st.hits += j.hits[h];
            L->st.misses += j.misses[h];
            L->st.bytes_h2d += j.h2d[h];
        }
    pqc__free(&c->alloc, held);
    if (r != PQC_SUCCESS) return r;
    L->step++;
    L->st.fetches++;
    L->st.fetch_s += pqc__now() - t0;
    return PQC_SUCCESS;
}

/* ----- the host tier -------------------------------------------------------------------- */

static pqc_result pqc__host_create(pqc_cache *c)
{
    size_t slot_bytes = (size_t)c->d.block_tokens * 2 * c->row;
    int l, h;
    if (c->d.cache_blocks <= 0) return PQC_SUCCESS;
    for (l = 0; l < c->d.n_layers; l++)
        for (h = 0; h < c->d.n_kv_heads; h++) {
            pqc__head *H = &c->layers[l].heads[h];
            H->dev = (unsigned char *)c->be.iface.alloc(c->be.ctx, slot_bytes * (size_t)c->d.cache_blocks);
            if (!H->dev) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_create: block cache allocation failed");
        }
    return PQC_SUCCESS;
}
static void pqc__host_destroy(pqc_cache *c)
{
    int l, h;
    for (l = 0; c->layers && l < c->d.n_layers; l++)
        if (c->layers[l].heads)
            for (h = 0; h < c->d.n_kv_heads; h++)
                if (c->layers[l].heads[h].dev) c->be.iface.free(c->be.ctx, c->layers[l].heads[h].dev);
}
static void *pqc__host_store_alloc(pqc_cache *c, size_t bytes) { return pqc__alloc(&c->alloc, bytes); }
static void pqc__host_store_free(pqc_cache *c, void *p) { pqc__free(&c->alloc, p); }
static void pqc__host_store_release(pqc_runtime *rt, const pqc_allocator *a, void *p)
{
    (void)rt;
    pqc__free(a, p);
}
static const pqc_allocator *pqc__host_codes_alloc(pqc_cache *c) { return &c->alloc; }
static int pqc__host_zero_copy(const pqc_cache *c) { return c->be.iface.alloc == pqc__cpu_alloc; }



static const pqc__tier_i *pqc__host_tier(void)
{
    static const pqc__tier_i t = { "host", 0, pqc__host_create, pqc__host_destroy, pqc__host_store_alloc,
                                   pqc__host_store_free, pqc__host_store_release, pqc__host_codes_alloc,
                                   NULL, NULL, NULL, NULL, NULL, NULL, pqc__host_fetch_prepare, pqc__host_fetch,
                                   NULL, pqc__host_zero_copy, NULL, NULL, NULL, NULL };
    return &t;
}

/* ----- a cache made: its configuration resolved, its layers, its tier (the host tier
   above, or the runtime's device tier), and the plan's fixed part ----- */
/* Every layer's and head's arrays, as c->d says; OUT_OF_MEMORY leaves what it made for
   pqc_cache_destroy. */
static pqc_result pqc__layers_alloc(pqc_cache *c)
{
    const pqc_cache_desc d = c->d;
    int l;
    for (l = 0; l < d.n_layers; l++) {
        pqc__layer *L = &c->layers[l];
        int h;
        L->heads = (pqc__head *)pqc__calloc(&c->alloc, sizeof(pqc__head) * (size_t)d.n_kv_heads);
        L->builds = (pqc__build *)pqc__calloc(&c->alloc, sizeof(pqc__build) * (size_t)d.n_kv_heads);
        {
            size_t part = pqc__qsq_part(c);
            L->qsq = (double *)pqc__calloc(&c->alloc, sizeof(double) * (2 * part + 2));
            L->qpend = (double *)pqc__calloc(&c->alloc, sizeof(double) * (part + 1));
        }
        L->bmetric = (float *)pqc__alloc(&c->alloc, sizeof(float) * (size_t)d.n_kv_heads *
                                                        (pqc__bands(c) ? pqc__blocks_len(c) : (size_t)d.head_dim));
        L->qobs = (float *)pqc__alloc(&c->alloc, sizeof(float) * PQC__OBS_KEEP * (size_t)d.n_q_heads * (size_t)d.head_dim);
        L->omass = (double *)pqc__alloc(&c->alloc, sizeof(double) * 6 * (size_t)d.n_kv_heads);
        L->ohist = (double *)pqc__alloc(&c->alloc, sizeof(double) * 2 * PQC__OBS_BINS * (size_t)d.n_kv_heads);
        if (!L->heads || !L->builds || !L->qsq || !L->qpend || !L->bmetric || !L->qobs || !L->omass || !L->ohist)
            return PQC_ERROR_OUT_OF_MEMORY;
        L->u_omass = L->omass + 2 * d.n_kv_heads;
        L->rfac = L->omass + 4 * d.n_kv_heads;
        L->u_rfac = L->rfac + d.n_kv_heads;
        for (h = 0; h < 2 * d.n_kv_heads; h++) L->rfac[h] = 0.0;
        L->u_ohist = L->ohist + PQC__OBS_BINS * (size_t)d.n_kv_heads;
        for (h = 0; h < 2 * d.n_kv_heads; h++) L->omass[h] = -1.0;
        memset(L->ohist, 0, sizeof(double) * PQC__OBS_BINS * (size_t)d.n_kv_heads); /* a file saves it as it is */
        for (h = 0; h < d.n_kv_heads; h++) {
            pqc__head *H = &L->heads[h];
            H->scratch.alloc = c->alloc;
            H->cscratch.alloc = c->alloc;
            if (d.outliers > 0) {
                H->outliers = (uint32_t *)pqc__alloc(&c->alloc, sizeof(uint32_t) * 2 * (size_t)d.outliers);
                H->outliers_new = (uint32_t *)pqc__alloc(&c->alloc, sizeof(uint32_t) * 2 * (size_t)d.outliers);
                H->outlier_res = (float *)pqc__alloc(&c->alloc, sizeof(float) * 2 * (size_t)d.outliers);
                if (H->outlier_res) H->outlier_res_new = H->outlier_res + d.outliers;
                if (!H->outliers || !H->outliers_new || !H->outlier_res) return PQC_ERROR_OUT_OF_MEMORY;
            }
            if (d.residual_weight > 0) {
                H->rscale = (float *)pqc__alloc(&c->alloc, sizeof(float) * 2 * (size_t)d.pq.m);
                if (!H->rscale) return PQC_ERROR_OUT_OF_MEMORY;
                H->rscale_new = H->rscale + d.pq.m;
            }
            if (d.cache_blocks > 0) {
                int sl;
                H->block_of = (int32_t *)pqc__alloc(&c->alloc, sizeof(int32_t) * (size_t)d.cache_blocks);
                H->filled = (uint32_t *)pqc__calloc(&c->alloc, sizeof(uint32_t) * (size_t)d.cache_blocks);
                H->freq = (uint64_t *)pqc__calloc(&c->alloc, sizeof(uint64_t) * (size_t)d.cache_blocks);
                H->stamp = (uint64_t *)pqc__calloc(&c->alloc, sizeof(uint64_t) * (size_t)d.cache_blocks);
                if (!H->block_of || !H->filled || !H->freq || !H->stamp) return PQC_ERROR_OUT_OF_MEMORY;
                for (sl = 0; sl < d.cache_blocks; sl++) H->block_of[sl] = -1;
            }
        }
    }
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_create(pqc_runtime *rt, const pqc_cache_desc *desc, pqc_cache **out)
{
    pqc_cache_desc d;
    pqc_cache *c;
    pqc_result r;
    if (!desc || !out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_create: null pointer");
    if ((r = pqc__cache_resolve(rt, desc, &d)) != PQC_SUCCESS) return r;
    c = (pqc_cache *)pqc__calloc(pqc__rt_alloc(rt), sizeof *c);
    if (!c) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_create: allocation failed");
    c->rt = rt;
    if (rt) c->alloc = rt->alloc;
    c->d = d;
    c->udesc = *desc;
    if (desc->backend) c->udesc.backend = &c->be; /* a fork copies it from here */
    c->be = d.backend ? *d.backend : pqc_backend_cpu(&c->alloc);
    if (!c->be.iface.alloc || !c->be.iface.free || !c->be.iface.copy_h2d) {
        pqc__free(&c->alloc, c);
        return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_create: backend lacks alloc, free or copy_h2d");
    }
    /* the device tier: the runtime's GPU unless the caller hands a backend of its own */
    c->tier = pqc__host_tier();
    if (rt && rt->cu && !d.backend && pqc__device()->tier) c->tier = pqc__device()->tier();
    pqc__plan_init(c);
    c->g = d.n_q_heads / d.n_kv_heads;
    c->es = pqc_dtype_size(d.kv_dtype);
    c->row = c->es * (size_t)d.head_dim;
    c->window = d.window;
    c->fetch_stream = PQC__FETCH_STREAM_BYTES;
    c->layers = (pqc__layer *)pqc__calloc(&c->alloc, sizeof(pqc__layer) * (size_t)d.n_layers);
    c->takes = (size_t *)pqc__alloc(&c->alloc, sizeof(size_t) * 2 * (size_t)d.n_kv_heads);
    if (!c->layers || !c->takes) goto oom;
    c->cands = c->takes + d.n_kv_heads;
    if (d.outliers > 0 && !(c->orow = (float *)pqc__alloc(&c->alloc, sizeof(float) * 3 * (size_t)d.head_dim))) goto oom;
    if (pqc__layers_alloc(c) != PQC_SUCCESS) goto oom;
    if ((r = c->tier->create(c)) != PQC_SUCCESS) {
        char msg[sizeof pqc__errbuf];
        memcpy(msg, pqc__errbuf, sizeof msg);
        pqc_cache_destroy(c);
        memcpy(pqc__errbuf, msg, sizeof msg);
        return r;
    }
    *out = c;
    return PQC_SUCCESS;
oom:
    pqc_cache_destroy(c);
    return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_create: allocation failed");
}

/* Lets go of a fork's shared prefix; the last cache to do so frees it. */

PQCDEF pqc_result pqc_cache_fetch(pqc_cache *c, int layer, const pqc_selection *sel, const pqc_kv_out *out)
{
    if (!out) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_fetch: null output");
    return pqc__fetch_impl(c, layer, sel, out, NULL, 1);
}

PQCDEF pqc_result pqc_cache_fetch_device(pqc_cache *c, int layer, const pqc_selection *sel, pqc_kv_device *out)
{
    if (!c || !out) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_fetch_device: null pointer");
    if (!c->sp.device_rows)
        return pqc__cfail(c, PQC_ERROR_UNSUPPORTED, "pqc_cache_fetch_device: the cache's device tier is host memory");
    return pqc__fetch_impl(c, layer, sel, NULL, out, 1);
}

PQCDEF int pqc_cache_on_device(const pqc_cache *c) { return c && c->sp.device_rows ? 1 : 0; }

/* A decode step's select and fetch of one layer in one call, where the tier runs the
   whole step (the CUDA tier: selection, admission and gather on the device, no host
   round trip). The rules are pqc__select_impl's and pqc__fetch_impl's (the same tops-k
   per head, the same admission); where the plan says the tier cannot run the step (a
   tier without steps, or scoring its step lacks: exact candidates, residuals) it gives
   PQC__NOT_SERVED before changing anything, and the caller selects and fetches. count[h] receives head h's rows; with out the rows and the selection (into
   pos, head h at pos + h * pos_stride) come to the host, with dout they stay on the
   device. Hits, misses and bytes are counted by the tier (see pqc_cache_stats). */
static pqc_result pqc__step_impl(pqc_cache *c, int layer, const float *q, const pqc_kv_out *out, pqc_kv_device *dout,
                                 size_t *count, uint32_t *pos, size_t pos_stride)
{
    pqc__layer *L;
    pqc_result r;
    pqc__plan p;
    size_t n, sink, unc, win0, mid_end, h, nh;
    double t0 = pqc__now();
    if ((r = pqc__step_check(c, layer, q, "pqc_cache_step_device")) != PQC_SUCCESS) return r;
    if (!count || (out && (!out->k || !out->v || !pos)))
        return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_step_device: null output");
    if (!c->sp.tier_step) return PQC__NOT_SERVED;
    L = &c->layers[layer];
    nh = (size_t)c->d.n_kv_heads;
    if ((r = pqc__plan_step(c, layer, &p)) != PQC_SUCCESS) return r;
    n = p.n;
    mid_end = pqc__mid_end(c, L, n);
    sink = PQC__MIN((size_t)c->d.n_sink, n);
    unc = mid_end > (size_t)c->d.n_sink + L->n_coded ? mid_end - ((size_t)c->d.n_sink + L->n_coded) : 0;
    win0 = PQC__MAX(mid_end, sink);
    for (h = 0; h < nh; h++) {
        count[h] = sink + c->takes[h] + unc + (n > win0 ? n - win0 : 0);
        if ((out && count[h] > out->head_stride) || (pos && count[h] > pos_stride)) {
            pqc__codes_truncate(c, layer, p.coded0);
            return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_cache_step_device: %zu rows selected, room for %zu", count[h],
                              out ? PQC__MIN(out->head_stride, pos_stride) : pos_stride);
        }
    }
    r = c->tier->step(c, layer, q, c->takes, p.search, p.exact ? c->cands : NULL, p.ctake, count, out, dout, pos,
                      pos_stride);
    if (r == PQC__NOT_SERVED) return r;
    if (r != PQC_SUCCESS) {
        pqc__codes_truncate(c, layer, p.coded0);
        return r;
    }
    L->st.fetches++;
    L->step++;
    pqc__step_done(c, layer, q, &p, count, t0);
    return PQC_SUCCESS;
}

static pqc_result pqc__step_device(pqc_cache *c, int layer, const float *q, pqc_kv_device *out, size_t *count)
{
    pqc_result r;
    if (!c || !out || !count) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_step_device: null pointer");
    if (!c->sp.device_rows)
        return pqc__cfail(c, PQC_ERROR_UNSUPPORTED, "pqc_cache_step_device: the cache's device tier is host memory");
    r = pqc__step_impl(c, layer, q, NULL, out, count, NULL, 0);
    if (r != PQC__NOT_SERVED) return r;
    /* exact scoring or residuals: the host selects (one synchronisation), the device gathers */
    if (!c->dsel.idx && (r = pqc_selection_init(c, &c->dsel)) != PQC_SUCCESS) return r;
    if ((r = pqc_cache_select(c, layer, q, &c->dsel)) != PQC_SUCCESS) return r;
    if ((r = pqc_cache_fetch_device(c, layer, &c->dsel, out)) != PQC_SUCCESS) return r;
    memcpy(count, c->dsel.count, (size_t)c->d.n_kv_heads * sizeof(size_t));
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_step_device(pqc_cache *c, int layer, const float *q, pqc_kv_device *out, size_t *count)
{
    if (!c) return pqc__step_device(c, layer, q, out, count);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__step_device(c, layer, q, out, count));
}

static int pqc__zero_copy(const pqc_cache *c) { return c->tier->zero_copy(c); }

PQCDEF pqc_result pqc_cache_fetch_rows(pqc_cache *c, int layer, const pqc_selection *sel,
                                       const void *const *const **krows, const void *const *const **vrows)
{
    pqc_result r;
    size_t h, nh;
    if (!c || !krows || !vrows) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_fetch_rows: null pointer");
    if (!pqc__zero_copy(c))
        return pqc__cfail(c, PQC_ERROR_UNSUPPORTED, "pqc_cache_fetch_rows: needs the CPU backend");
    nh = (size_t)c->d.n_kv_heads;
    if (!c->frows) {
        c->frows = (const void *const **)pqc__alloc(&c->alloc, 2 * nh * sizeof(void *));
        if (!c->frows) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_fetch_rows: allocation failed");
    }
    if ((r = pqc__fetch_impl(c, layer, sel, NULL, NULL, 1)) != PQC_SUCCESS) return r;
    for (h = 0; h < nh; h++) {
        c->frows[h] = c->fsrc + h * 2 * c->frows_cap;
        c->frows[nh + h] = c->fsrc + h * 2 * c->frows_cap + c->frows_cap;
    }
    *krows = c->frows;
    *vrows = c->frows + nh;
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_report_compute(pqc_cache *c, int layer, double tokens, double seconds)
{
    pqc_result r;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_report_compute")) != PQC_SUCCESS) return r;
    if (!c->d.scheduler) return PQC_SUCCESS;
    return pqc_scheduler_add_compute(c->d.scheduler, tokens, seconds);
}

static pqc_result pqc__sync(pqc_cache *c)
{
    int l;
    pqc_result r = PQC_SUCCESS, x;
    if (!c) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_sync: null cache");
    for (l = 0; l < c->d.n_layers; l++)
        if ((x = pqc__join_build(c, l)) != PQC_SUCCESS && r == PQC_SUCCESS) r = x;
    return r;
}

PQCDEF pqc_result pqc_cache_sync(pqc_cache *c)
{
    if (!c) return pqc__sync(c);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__sync(c));
}

/* ---------------------------------------------------------------------------------------
   13. Files and forks: a cache saved and loaded, a cache forked over its prefix, and what a
   cache holds (tokens, statistics, memory, its rows)
   ------------------------------------------------------------------------------------- */

/* ----- cache files ----- */

#define PQC__CACHE_MAGIC "PQCCACHE"
/* whether a head of the cache has a calibrated re-ranking factor (a file then saves them) */
static int pqc__has_rfac(const pqc_cache *c)
{
    int l, h;
    for (l = 0; l < c->d.n_layers; l++)
        for (h = 0; h < c->d.n_kv_heads; h++)
            if (c->layers[l].rfac[h] > 0.0) return 1;
    return 0;
}
#define PQC__CACHE_VERSION 5u /* 4: no re-ranking factors, 3: nor a softmax scale (1/sqrt(d_h));
                                 written for such caches */
#define PQC__CACHE_ALIGN 64 /* K and V rows start at file offsets of a multiple of it */

static int pqc__little_endian(void)
{
    const uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* The cache file's checksum: FNV-1a 64 over the file as little-endian 64-bit words (the
   last one zero-padded), then over its length in bytes: a byte at a time would take a
   second per 300 MB here. */
typedef struct pqc__whash {
    uint64_t h, len;
    unsigned char buf[8];
    unsigned nb;
} pqc__whash;

static void pqc__whash_word(pqc__whash *w, const unsigned char *p)
{
    uint64_t x;
    memcpy(&x, p, 8); /* little-endian hosts only (checked by the callers) */
    w->h = (w->h ^ x) * 1099511628211ull;
}

static void pqc__whash_add(pqc__whash *w, const void *data, size_t n)
{
    const unsigned char *p = (const unsigned char *)data;
    w->len += n;
    while (n > 0 && w->nb > 0) {
        w->buf[w->nb++] = *p++;
        n--;
        if (w->nb == 8) {
            pqc__whash_word(w, w->buf);
            w->nb = 0;
        }
    }
    for (; n >= 8; n -= 8, p += 8) pqc__whash_word(w, p);
    while (n > 0) {
        w->buf[w->nb++] = *p++;
        n--;
    }
}

static uint64_t pqc__whash_end(const pqc__whash *w0)
{
    pqc__whash w = *w0;
    unsigned char len[8];
    if (w.nb) {
        memset(w.buf + w.nb, 0, 8 - w.nb);
        pqc__whash_word(&w, w.buf);
    }
    memcpy(len, &w.len, 8);
    pqc__whash_word(&w, len);
    return w.h;
}

/* The parts of a file: pointers into the cache, and the small fields copied into one
   buffer sized up front (so that its pointers stay put). */
typedef struct pqc__parts {
    const void **p;
    size_t *n;
    int count, cap;
    unsigned char *small;
    size_t used, small_cap;
    pqc__whash h;
} pqc__parts;

static void pqc__part(pqc__parts *w, const void *p, size_t n)
{
    if (n == 0) return;
    w->p[w->count] = p;
    w->n[w->count++] = n;
    pqc__whash_add(&w->h, p, n);
}

static void pqc__part_small(pqc__parts *w, const void *p, size_t n)
{
    memcpy(w->small + w->used, p, n);
    pqc__part(w, w->small + w->used, n);
    w->used += n;
}

static void pqc__part_u64(pqc__parts *w, uint64_t v) { pqc__part_small(w, &v, 8); }

/* zero bytes up to the next file offset that is a multiple of PQC__CACHE_ALIGN */
static void pqc__part_pad(pqc__parts *w)
{
    static const unsigned char zeros[PQC__CACHE_ALIGN] = { 0 };
    pqc__part(w, zeros, (PQC__CACHE_ALIGN - (size_t)(w->h.len % PQC__CACHE_ALIGN)) % PQC__CACHE_ALIGN);
}

/* the settings a file must agree on with the cache it loads into */
static void pqc__cache_shape(const pqc_cache *c, uint32_t *f)
{
    f[0] = (uint32_t)c->d.n_layers;
    f[1] = (uint32_t)c->d.n_kv_heads;
    f[2] = (uint32_t)c->d.n_q_heads;
    f[3] = (uint32_t)c->d.head_dim;
    f[4] = (uint32_t)c->d.kv_dtype;
    f[5] = (uint32_t)c->d.n_sink;
    f[6] = (uint32_t)c->d.pq.m;
    f[7] = (uint32_t)c->d.pq.bits;
    f[8] = (uint32_t)c->d.pq.rope;
    f[9] = c->d.pq.subspaces == PQC_SUBSPACES_ROPE_BANDS; /* 0: contiguous, as files have it */
    f[10] = pqc__bands(c) ? 2u : c->d.metric == PQC_METRIC_L2 ? 1u : 0u; /* weights 0, blocks 2, as files have it */
    f[11] = (uint32_t)c->d.outliers;
    f[12] = c->d.residual_weight > 0;
}
#define PQC__CACHE_SHAPE 13

static pqc_result pqc__save(pqc_cache *c, const char *path)
{
    pqc__parts w;
    uint32_t shape[PQC__CACHE_SHAPE];
    size_t nkv, d, qn, col, bound;
    char why[300];
    pqc_result r;
    int l, h, j, parts, rf = 0;
    if (!c || !path) return pqc__fail(c ? c->rt : NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_save: null argument");
    if (!pqc__little_endian())
        return pqc__cfail(c, PQC_ERROR_UNSUPPORTED, "pqc_cache_save: cache files are written on little-endian hosts");
    if ((r = pqc_cache_sync(c)) != PQC_SUCCESS) return r; /* no build in flight: codes and codebooks are final */
    nkv = (size_t)c->d.n_kv_heads;
    d = (size_t)c->d.head_dim;
    qn = (size_t)c->d.n_q_heads * d;
    parts = 8 + c->d.n_layers * (13 + c->d.n_kv_heads * (20 + c->d.pq.m));
    bound = 128 + (size_t)c->d.n_layers * (64 + nkv * 64);
    memset(&w, 0, sizeof w);
    w.cap = parts;
    w.small_cap = bound;
    w.p = (const void **)pqc__alloc(&c->alloc, sizeof(void *) * (size_t)parts);
    w.n = (size_t *)pqc__alloc(&c->alloc, sizeof(size_t) * (size_t)parts);
    w.small = (unsigned char *)pqc__alloc(&c->alloc, bound);
    if (!w.p || !w.n || !w.small) {
        r = pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_save: allocation failed");
        goto out;
    }
    w.h.h = PQC__FNV_OFFSET;
    pqc__part_small(&w, PQC__CACHE_MAGIC, 8);
    {
        /* a cache without calibrated re-ranking factors writes version 4, and one at the
           default scale too version 3: the same bytes as before those were saved
           (earlier builds load them) */
        int scaled = c->sp.scale != pqc__default_scale(c->d.head_dim);
        uint32_t v = pqc__has_rfac(c) ? PQC__CACHE_VERSION : scaled ? 4u : 3u, win = (uint32_t)c->window;
        pqc__cache_shape(c, shape);
        pqc__part_small(&w, &v, 4);
        pqc__part_small(&w, shape, sizeof shape);
        pqc__part_small(&w, &win, 4);
        if (v >= 4u) pqc__part_small(&w, &c->sp.scale, 4);
        rf = v >= 5u;
    }
    for (l = 0; l < c->d.n_layers; l++) {
        const pqc__layer *L = &c->layers[l];
        uint32_t nq = (uint32_t)L->n_qobs, lw = (uint32_t)pqc__layer_window_set(L);
        pqc__part_u64(&w, L->n_tokens);
        pqc__part_u64(&w, L->n_coded);
        pqc__part_u64(&w, L->n_trained);
        pqc__part_u64(&w, L->gen);
        pqc__part_u64(&w, L->step);
        pqc__part_small(&w, &nq, 4);
        pqc__part_small(&w, &lw, 4);
        pqc__part(&w, L->qsq, pqc__qsq_len(c) * sizeof(double));
        pqc__part(&w, L->qobs, (size_t)L->n_qobs * qn * sizeof(float));
        pqc__part(&w, L->omass, 2 * nkv * sizeof(double));
        pqc__part(&w, L->ohist, PQC__OBS_BINS * nkv * sizeof(double));
        if (rf) pqc__part(&w, L->rfac, nkv * sizeof(double));
        for (h = 0; h < c->d.n_kv_heads; h++) {
            const pqc__head *H = &L->heads[h];
            uint32_t has = H->pq.m != 0, wt = !has ? 0u : H->pq.mblocks ? 2u : H->pq.metric ? 1u : 0u;
            size_t ns = PQC__MIN(L->n_tokens, c->pn); /* a fork's shared rows, then its own */
            pqc__part_pad(&w);
            pqc__part(&w, H->pk, ns * c->row);
            pqc__part(&w, H->k, (L->n_tokens - ns) * c->row);
            pqc__part_pad(&w);
            pqc__part(&w, H->pv, ns * c->row);
            pqc__part(&w, H->v, (L->n_tokens - ns) * c->row);
            pqc__part_small(&w, &has, 4);
            pqc__part_small(&w, &wt, 4);
            if (!has) continue;
            pqc__part(&w, H->pq.centroids, (size_t)H->pq.m * H->pq.ksub * H->pq.dsub * sizeof(float));
            if (wt == 1) pqc__part(&w, H->pq.metric, d * sizeof(float));
            if (wt == 2) pqc__part(&w, H->pq.mblocks, pqc__blocks_len(c) * sizeof(float));
            col = (L->n_coded * (size_t)H->pq.bits + 7) / 8;
            for (j = 0; j < H->pq.m; j++) pqc__part(&w, H->codes.data + (size_t)j * H->codes.col_stride, col);
            if (c->d.outliers > 0) {
                pqc__part_u64(&w, H->n_outliers);
                pqc__part_u64(&w, H->n_outliers_build);
                pqc__part_small(&w, &H->outlier_thr, 4);
                pqc__part(&w, H->outliers, H->n_outliers * sizeof(uint32_t));
                pqc__part(&w, H->outlier_res, (H->n_outliers - H->n_outliers_build) * sizeof(float));
            }
            if (c->d.residual_weight > 0) {
                pqc__part(&w, H->rscale, (size_t)H->pq.m * sizeof(float));
                pqc__part(&w, H->rq, L->n_coded * (size_t)H->pq.m);
            }
        }
    }
    {
        uint64_t sum = pqc__whash_end(&w.h);
        pqc__part_small(&w, &sum, 8);
    }
    r = pqc__write_atomic(path, w.p, w.n, w.count, why, sizeof why) != 0
            ? pqc__cfail(c, PQC_ERROR_IO, "pqc_cache_save: %s", why)
            : PQC_SUCCESS;
out:
    pqc__free(&c->alloc, (void *)w.p);
    pqc__free(&c->alloc, w.n);
    pqc__free(&c->alloc, w.small);
    return r;
}

PQCDEF pqc_result pqc_cache_save(pqc_cache *c, const char *path)
{
    if (!c) return pqc__save(c, path);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__save(c, path));
}

/* A file image being read: the bytes left, and the checksum of those read. */
typedef struct pqc__rd {
    const unsigned char *base, *p, *end;
    pqc__whash h;
} pqc__rd;

/* the next n bytes (added to the checksum) at *at; 0 when fewer are left */
static int pqc__rd_take(pqc__rd *r, size_t n, const unsigned char **at)
{
    if ((size_t)(r->end - r->p) < n) return 0;
    *at = r->p;
    pqc__whash_add(&r->h, r->p, n);
    r->p += n;
    return 1;
}
static int pqc__rd_copy(pqc__rd *r, void *dst, size_t n)
{
    const unsigned char *at;
    if (!pqc__rd_take(r, n, &at)) return 0;
    if (n) memcpy(dst, at, n);
    return 1;
}
/* the zero bytes before K or V rows; 0 when short or not zero */
static int pqc__rd_pad(pqc__rd *r)
{
    size_t n = (PQC__CACHE_ALIGN - (size_t)(r->p - r->base) % PQC__CACHE_ALIGN) % PQC__CACHE_ALIGN, i;
    const unsigned char *at;
    if (!pqc__rd_take(r, n, &at)) return 0;
    for (i = 0; i < n; i++)
        if (at[i]) return 0;
    return 1;
}

/* Whether n stored elements of dtype t are finite and within the store limit, from
   their bits (no conversion of fp16 rows). */
static int pqc__stored_ok(const void *p, pqc_dtype t, size_t n)
{
    size_t i = 0;
    if (t == PQC_F32) return pqc__within((const float *)p, n, PQC__KEY_LIMIT);
    if (t == PQC_F16) /* four at a time: a lane whose exponent bits are all set is Inf or NaN */
        for (; i + 4 <= n; i += 4) {
            uint64_t x, z;
            memcpy(&x, (const unsigned char *)p + 2 * i, 8);
            z = (x & 0x7c007c007c007c00ull) ^ 0x7c007c007c007c00ull;
            if (((z - 0x0001000100010001ull) & ~z & 0x8000800080008000ull) != 0) return 0;
        }
    for (; i < n; i++) {
        uint16_t u;
        memcpy(&u, (const unsigned char *)p + 2 * i, 2);
        if (t == PQC_F16) {
            if ((u & 0x7c00u) == 0x7c00u) return 0; /* Inf or NaN; every finite fp16 is in range */
        } else {
            uint32_t b = (uint32_t)u << 16;
            float f;
            memcpy(&f, &b, 4);
            if (!(f >= -PQC__KEY_LIMIT && f <= PQC__KEY_LIMIT)) return 0;
        }
    }
    return 1;
}

/* The body of pqc_cache_load: fills the new cache c from fp. Returns a result code with
   the message set; BAD_FILE for anything the file gets wrong. */
#define PQC__RETRY_COPY ((pqc_result)-1000) /* a mapped load meets layers of other lengths */
/* Room for one more token in the own stores after a fork moved the prefix (the tier
   learns where the rows are either way). */
static pqc_result pqc__fork_room(pqc_cache *c, size_t n)
{
    pqc_result r = pqc__cache_grow(c, n < c->d.max_tokens ? n + 1 : n);
    if (r == PQC_SUCCESS && !c->layers[0].kbase) r = pqc__tier_grown(c); /* full: no own rows */
    return r;
}


/* Fills a new cache from a file image. mapped: img stays mapped for the cache's life and
   its K/V rows are the cache's shared prefix (read in place, not copied); the image
   then belongs to the cache from the first layer on (*taken = 1). Else the rows are
   copied into the stores. */
static pqc_result pqc__cache_read(pqc_cache *c, const unsigned char *img, size_t len, const char *path, int mapped,
                                  int *taken)
{
    uint64_t want, v64[5];
    pqc__rd rd;
    uint32_t shape[PQC__CACHE_SHAPE], mine[PQC__CACHE_SHAPE], v, win, nq, lw;
    unsigned char magic[8];
    const unsigned char *kp, *vp;
    size_t nkv = (size_t)c->d.n_kv_heads, d = (size_t)c->d.head_dim, qn = (size_t)c->d.n_q_heads * d, col, t;
    int l, hh, j;
    pqc_result r;
#define PQC__RD(dst, n)                                                                                              \
    do {                                                                                                             \
        if (!pqc__rd_copy(&rd, (dst), (n)))                                                                          \
            return pqc__cfail(c, PQC_ERROR_BAD_FILE, "pqc_cache_load: %.200s is truncated", path);                  \
    } while (0)
#define PQC__BAD(...) return pqc__cfail(c, PQC_ERROR_BAD_FILE, __VA_ARGS__)
    if (!img || len == 0) return pqc__cfail(c, PQC_ERROR_BAD_FILE, "pqc_cache_load: %.200s is empty", path);
    memset(&rd, 0, sizeof rd);
    rd.base = rd.p = img;
    rd.end = img + len;
    rd.h.h = PQC__FNV_OFFSET;
    PQC__RD(magic, 8);
    if (memcmp(magic, PQC__CACHE_MAGIC, 8) != 0) PQC__BAD("pqc_cache_load: %.200s is not a pqcache cache file", path);
    PQC__RD(&v, 4);
    /* version 2 (before layers' windows were saved): every layer has the cache's;
       versions 2 and 3 (before the softmax scale was saved): 1/sqrt(d_h); before version 5
       no head has a calibrated re-ranking factor */
    if (v != PQC__CACHE_VERSION && v != 4u && v != 3u && v != 2u)
        PQC__BAD("pqc_cache_load: %.200s has format version %u", path, (unsigned)v);
    PQC__RD(shape, sizeof shape);
    pqc__cache_shape(c, mine);
    if (shape[10] == 0u && mine[10] == 2u)
        return pqc__cfail(c, PQC_ERROR_BAD_SHAPE,
                          "pqc_cache_load: %.200s was saved with the query metric's weights (before it had matrices, "
                          "or with PQC_METRIC_QUERY_DIAG): load it with metric = PQC_METRIC_QUERY_DIAG", path);
    for (j = 0; j < PQC__CACHE_SHAPE; j++)
        if (shape[j] != mine[j])
            return pqc__cfail(c, PQC_ERROR_BAD_SHAPE,
                              "pqc_cache_load: %.200s was saved with other settings (field %d: %u, this desc %u)", path,
                              j, (unsigned)shape[j], (unsigned)mine[j]);
    PQC__RD(&win, 4);
    if (win > c->d.max_tokens) PQC__BAD("pqc_cache_load: %.200s: window %u", path, (unsigned)win);
    c->window = (int)win;
    {
        float fs = pqc__default_scale(c->d.head_dim);
        if (v >= 4u) PQC__RD(&fs, 4);
        if (!(fs > 0.0f && fs <= 1e6f)) PQC__BAD("pqc_cache_load: %.200s: softmax scale %g", path, (double)fs);
        if (c->udesc.softmax_scale == 0.0f) { /* the desc leaves it to the file (a fork keeps it) */
            c->udesc.softmax_scale = c->d.softmax_scale = fs;
            pqc__plan_scale(c);
        }
    }
    for (l = 0; l < c->d.n_layers; l++) {
        pqc__layer *L = &c->layers[l];
        size_t n, coded, trained;
        PQC__RD(v64, sizeof v64);
        PQC__RD(&nq, 4);
        lw = 0;
        if (v >= 3u) PQC__RD(&lw, 4);
        if (lw > win) PQC__BAD("pqc_cache_load: %.200s: layer %d window %u", path, l, (unsigned)lw);
        L->window = (int)lw;
        n = (size_t)v64[0];
        coded = (size_t)v64[1];
        trained = (size_t)v64[2];
        if (v64[0] > c->d.max_tokens || coded > pqc__mid_count(c, L, n) || trained > coded || nq > PQC__OBS_KEEP)
            PQC__BAD("pqc_cache_load: %.200s: layer %d holds inconsistent counts", path, l);
        PQC__RD(L->qsq, pqc__qsq_len(c) * sizeof(double));
        PQC__RD(L->qobs, (size_t)nq * qn * sizeof(float));
        PQC__RD(L->omass, 2 * nkv * sizeof(double));
        PQC__RD(L->ohist, PQC__OBS_BINS * nkv * sizeof(double));
        if (v >= 5u) PQC__RD(L->rfac, nkv * sizeof(double));
        for (t = 0; t < nkv; t++)
            if (!(L->rfac[t] == 0.0 || (L->rfac[t] >= 1.0 && L->rfac[t] <= 1e6)))
                PQC__BAD("pqc_cache_load: %.200s: layer %d re-ranking factors", path, l);
        if (!pqc__within(L->qobs, (size_t)nq * qn, PQC__KEY_LIMIT))
            PQC__BAD("pqc_cache_load: %.200s: layer %d holds non-finite observations", path, l);
        for (t = 0; t < pqc__qsq_len(c); t++) { /* sums of squares and counts: not negative; the blocks' other
                                                   entries (products of two dims) may be */
            size_t at = t % pqc__qsq_part(c), diag = nkv * (d + 1), bl = pqc__blocks_len(c), ds = d / (size_t)c->d.pq.m;
            int sign_free = t < 2 * pqc__qsq_part(c) && at >= diag && ((at - diag) % bl) % (ds * ds) % (ds + 1) != 0;
            if (!((sign_free ? fabs(L->qsq[t]) : L->qsq[t]) >= 0.0 && fabs(L->qsq[t]) < 1e300))
                PQC__BAD("pqc_cache_load: %.200s: layer %d statistics", path, l);
        }
        { /* the drift flags: pending (0 or 1), and the coded count at the last drift rebuild
             + 1, a whole number of tokens (the next select converts it to a size) */
            const double *flag = L->qsq + 2 * pqc__qsq_part(c);
            if (!(flag[0] == 0.0 || flag[0] == 1.0) || flag[1] != floor(flag[1]) ||
                !(flag[1] <= (double)c->d.max_tokens + 1.0))
                PQC__BAD("pqc_cache_load: %.200s: layer %d drift state", path, l);
        }
        for (t = 0; t < 2 * nkv; t++)
            if (!(L->omass[t] >= -1.0 && L->omass[t] <= 1.0)) PQC__BAD("pqc_cache_load: %.200s: layer %d masses", path, l);
        for (t = 0; t < PQC__OBS_BINS * nkv; t++)
            if (!(L->ohist[t] >= 0.0 && L->ohist[t] < 1e300)) PQC__BAD("pqc_cache_load: %.200s: layer %d histogram", path, l);
        L->n_qobs = (int)nq;
        if (mapped && l == 0) { /* the file's rows become the shared prefix of every layer */
            if (!(c->share = pqc__share_new(c, n)))
                return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_load: allocation failed");
            c->share->map = (void *)(uintptr_t)img;
            c->share->map_len = len;
            *taken = 1;
            c->pn = n;
            if ((r = pqc__fork_room(c, n)) != PQC_SUCCESS) return r;
        } else if (mapped && n != c->pn) {
            return PQC__RETRY_COPY;
        } else if (!mapped && (r = pqc__cache_grow(c, n)) != PQC_SUCCESS) {
            return r;
        }
        for (hh = 0; hh < c->d.n_kv_heads; hh++) {
            pqc__head *H = &L->heads[hh];
            uint32_t has, wt;
            if (!pqc__rd_pad(&rd) || !pqc__rd_take(&rd, n * c->row, &kp) || !pqc__rd_pad(&rd) ||
                !pqc__rd_take(&rd, n * c->row, &vp))
                PQC__BAD("pqc_cache_load: %.200s is truncated or damaged", path);
            if (!pqc__stored_ok(kp, c->d.kv_dtype, n * d) || !pqc__stored_ok(vp, c->d.kv_dtype, n * d))
                PQC__BAD("pqc_cache_load: %.200s: layer %d head %d holds non-finite or huge K/V", path, l, hh);
            if (mapped) {
                H->pk = c->share->hk[l * c->d.n_kv_heads + hh] = (unsigned char *)(uintptr_t)kp;
                H->pv = c->share->hv[l * c->d.n_kv_heads + hh] = (unsigned char *)(uintptr_t)vp;
            } else if (n) {
                memcpy(H->k, kp, n * c->row);
                memcpy(H->v, vp, n * c->row);
            }
            PQC__RD(&has, 4);
            PQC__RD(&wt, 4);
            /* wt: the codebook's metric, none (0), weights (1) or blocks (2, under
               PQC_METRIC_QUERY with blocks) */
            if (has > 1 || (wt != 0 && wt != (pqc__bands(c) ? 2u : 1u)) || (wt && !has) || has != (coded > 0))
                PQC__BAD("pqc_cache_load: %.200s: layer %d head %d codebook flags", path, l, hh);
            if (!has) continue;
            {
                float *cent = NULL, *w = NULL, *blk = NULL;
                size_t nc = (size_t)c->d.pq.m * ((size_t)1 << c->d.pq.bits) * (d / (size_t)c->d.pq.m);
                size_t nw = wt == 2 ? pqc__blocks_len(c) : wt ? d : 0;
                cent = (float *)pqc__alloc(&c->alloc, (nc + nw) * sizeof(float));
                if (!cent) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_load: allocation failed");
                if (!pqc__rd_copy(&rd, cent, nc * sizeof(float)) ||
                    (nw && !pqc__rd_copy(&rd, cent + nc, nw * sizeof(float)))) {
                    pqc__free(&c->alloc, cent);
                    PQC__BAD("pqc_cache_load: %.200s is truncated", path);
                }
                char what[300];
                if (wt == 1) w = cent + nc;
                if (wt == 2) blk = cent + nc;
                snprintf(what, sizeof what, "pqc_cache_load: %.200s: layer %d head %d", path, l, hh);
                r = pqc__pq_from_floats(c->rt, &H->pq, (int)d, c->d.pq.m, c->d.pq.bits, cent, w, blk,
                                        pqc__half_bands(&c->d.pq),
                                        what);
                pqc__free(&c->alloc, cent);
                if (r != PQC_SUCCESS) return r;
            }
            if ((r = pqc_codes_init(&H->codes, &H->pq, coded + 256, c->tier->codes_alloc(c))) != PQC_SUCCESS) return r;
            col = (coded * (size_t)H->pq.bits + 7) / 8;
            for (j = 0; j < H->pq.m; j++) PQC__RD(H->codes.data + (size_t)j * H->codes.col_stride, col);
            H->codes.count = coded;
            if (c->d.outliers > 0) {
                uint64_t on[2];
                size_t i;
                PQC__RD(on, sizeof on);
                if (on[1] > (uint64_t)c->d.outliers || on[0] < on[1] || on[0] - on[1] > (uint64_t)c->d.outliers)
                    PQC__BAD("pqc_cache_load: %.200s: layer %d head %d outlier list", path, l, hh);
                H->n_outliers = (size_t)on[0];
                H->n_outliers_build = (size_t)on[1];
                PQC__RD(&H->outlier_thr, 4);
                PQC__RD(H->outliers, H->n_outliers * sizeof(uint32_t));
                PQC__RD(H->outlier_res, (H->n_outliers - H->n_outliers_build) * sizeof(float));
                for (i = 0; i < H->n_outliers; i++)
                    if (H->outliers[i] >= coded || (i > 0 && i != H->n_outliers_build && H->outliers[i] <= H->outliers[i - 1]))
                        PQC__BAD("pqc_cache_load: %.200s: layer %d head %d outlier list entries", path, l, hh);
            }
            if (c->d.residual_weight > 0) {
                H->rq_cap = coded + 256;
                if (!(H->rq = (uint8_t *)pqc__alloc(&c->alloc, H->rq_cap * (size_t)H->pq.m)))
                    return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_load: allocation failed");
                PQC__RD(H->rscale, (size_t)H->pq.m * sizeof(float));
                PQC__RD(H->rq, coded * (size_t)H->pq.m);
                for (j = 0; j < H->pq.m; j++)
                    if (!(H->rscale[j] > 0.0f && H->rscale[j] <= 1e30f))
                        PQC__BAD("pqc_cache_load: %.200s: layer %d head %d residual scales", path, l, hh);
            }
        }
        L->gen = v64[3];
        L->step = v64[4];
        L->n_coded = coded;
        L->n_trained = trained;
        if (n && (r = pqc__tier_stored(c, l, n)) != PQC_SUCCESS) return r;
        L->n_tokens = n;
    }
    if ((size_t)(rd.end - rd.p) < 8 || (memcpy(&want, rd.p, 8), want != pqc__whash_end(&rd.h)))
        PQC__BAD("pqc_cache_load: %.200s is damaged (checksum) or truncated", path);
    if ((size_t)(rd.end - rd.p) > 8) PQC__BAD("pqc_cache_load: %.200s has trailing bytes", path);
    return PQC_SUCCESS;
#undef PQC__RD
#undef PQC__BAD
}

PQCDEF pqc_result pqc_cache_load(pqc_runtime *rt, const pqc_cache_desc *desc, const char *path, pqc_cache **out)
{
    pqc_cache *c = NULL;
    pqc_result r;
    char why[300], msg[sizeof pqc__errbuf];
    FILE *fp;
    struct stat st;
    void *img = NULL;
    size_t len = 0;
    int taken = 0, mapped, attempt;
    if (!desc || !path || !out) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_load: null argument");
    if (!pqc__little_endian())
        return pqc__fail(rt, PQC_ERROR_UNSUPPORTED, "pqc_cache_load: cache files are read on little-endian hosts");
    if (!(fp = pqc__open_regular(path, why, sizeof why))) return pqc__fail(rt, PQC_ERROR_IO, "pqc_cache_load: %s", why);
    if (fstat(fileno(fp), &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size > (uint64_t)(size_t)-1) {
        fclose(fp);
        return pqc__fail(rt, PQC_ERROR_IO, "pqc_cache_load: %.200s: cannot stat", path);
    }
    len = (size_t)st.st_size;
    if (len > 0 && (img = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fileno(fp), 0)) == MAP_FAILED) {
        fclose(fp);
        return pqc__fail(rt, PQC_ERROR_IO, "pqc_cache_load: %.200s: cannot map: %s", path, strerror(errno));
    }
    fclose(fp); /* the mapping stays */
    /* a host tier reads the rows where the file maps them; a device tier copies them
       into its pinned stores (as does a file whose layers hold different lengths) */
    for (attempt = 0, r = PQC_ERROR_BAD_STATE; attempt < 2; attempt++) {
        if ((r = pqc_cache_create(rt, desc, &c)) != PQC_SUCCESS) break;
        mapped = attempt == 0 && len > 0 && c->sp.map_stores;
        taken = 0;
        r = pqc__cache_read(c, (const unsigned char *)img, len, path, mapped, &taken);
        if (r == PQC_SUCCESS) break;
        memcpy(msg, pqc__errbuf, sizeof msg);
        if (taken && c->share) c->share->map = NULL; /* the image stays the caller's */
        taken = 0;
        pqc_cache_destroy(c);
        c = NULL;
        memcpy(pqc__errbuf, msg, sizeof msg);
        if (r != PQC__RETRY_COPY) break;
    }
    if (img && !taken) munmap(img, len);
    if (r != PQC_SUCCESS) {
        memcpy(msg, pqc__errbuf, sizeof msg);
        return pqc__fail(rt, r, "%s", msg);
    }
    *out = c;
    return PQC_SUCCESS;
}

/* ----- prefix sharing ----- */


/* A copy of a codebook into the cache's memory. */
static pqc_result pqc__pq_copy(pqc_cache *c, pqc_pq *dst, const pqc_pq *src)
{
    return pqc__pq_from_floats(c->rt, dst, src->dim, src->m, src->bits, src->centroids, src->metric, src->mblocks,
                               src->half_bands, "pqc_cache_fork");
}

/* The child's copy of the parent's selection state: window, observations, and per head
   codebook, codes, outlier list and residual bytes, and the parent's own rows. */
static pqc_result pqc__fork_copy(pqc_cache *c, const pqc_cache *p, size_t n)
{
    size_t nkv = (size_t)c->d.n_kv_heads, d = (size_t)c->d.head_dim, qn = (size_t)c->d.n_q_heads * d, j;
    int l, h;
    pqc_result r;
    c->window = p->window;
    for (l = 0; l < c->d.n_layers; l++) {
        pqc__layer *L = &c->layers[l];
        const pqc__layer *P = &p->layers[l];
        memcpy(L->qsq, P->qsq, pqc__qsq_len(c) * sizeof(double));
        memcpy(L->qobs, P->qobs, (size_t)P->n_qobs * qn * sizeof(float));
        memcpy(L->omass, P->omass, 2 * nkv * sizeof(double));
        memcpy(L->ohist, P->ohist, PQC__OBS_BINS * nkv * sizeof(double));
        memcpy(L->rfac, P->rfac, nkv * sizeof(double));
        L->window = pqc__layer_window_set(P);
        L->n_qobs = P->n_qobs;
        for (h = 0; h < c->d.n_kv_heads; h++) {
            pqc__head *H = &L->heads[h];
            const pqc__head *Q = &P->heads[h];
            size_t coded = P->n_coded, col;
            if (n > c->pn) { /* the parent's rows since its prefix was shared */
                memcpy(H->k, pqc__krow(p, Q, c->pn), (n - c->pn) * c->row);
                memcpy(H->v, pqc__vrow(p, Q, c->pn), (n - c->pn) * c->row);
            }
            if (!Q->pq.m) continue;
            if ((r = pqc__pq_copy(c, &H->pq, &Q->pq)) != PQC_SUCCESS) return r;
            if ((r = pqc_codes_init(&H->codes, &H->pq, coded + 256, c->tier->codes_alloc(c))) != PQC_SUCCESS) return r;
            col = (coded * (size_t)H->pq.bits + 7) / 8;
            for (j = 0; j < (size_t)H->pq.m; j++)
                memcpy(H->codes.data + j * H->codes.col_stride, Q->codes.data + j * Q->codes.col_stride, col);
            H->codes.count = coded;
            if (c->d.outliers > 0) {
                H->n_outliers = Q->n_outliers;
                H->n_outliers_build = Q->n_outliers_build;
                H->outlier_thr = Q->outlier_thr;
                memcpy(H->outliers, Q->outliers, Q->n_outliers * sizeof(uint32_t));
                memcpy(H->outlier_res, Q->outlier_res, (Q->n_outliers - Q->n_outliers_build) * sizeof(float));
            }
            if (c->d.residual_weight > 0) {
                H->rq_cap = coded + 256;
                if (!(H->rq = (uint8_t *)pqc__alloc(&c->alloc, H->rq_cap * (size_t)H->pq.m)))
                    return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_fork: allocation failed");
                memcpy(H->rscale, Q->rscale, (size_t)H->pq.m * sizeof(float));
                memcpy(H->rq, Q->rq, coded * (size_t)H->pq.m);
            }
        }
        L->gen = P->gen;
        L->step = P->step;
        L->n_coded = P->n_coded;
        L->n_trained = P->n_trained;
        if (n && (r = pqc__tier_stored(c, l, n)) != PQC_SUCCESS) return r;
        L->n_tokens = n;
    }
    return PQC_SUCCESS;
}

/* The parent's first fork: its stores become the shared prefix of n rows, and its own
   rows start after them. */
static pqc_result pqc__share_make(pqc_cache *p, size_t n)
{
    pqc__share *s;
    int l, h, L = p->d.n_layers;
    size_t cap = p->cap;
    pqc_result r;
    if (!(s = pqc__share_new(p, n))) return pqc__cfail(p, PQC_ERROR_OUT_OF_MEMORY, "pqc_cache_fork: allocation failed");
    s->cap = cap;
    for (l = 0; l < L; l++) {
        pqc__layer *Ly = &p->layers[l];
        s->k[l] = Ly->kbase;
        s->v[l] = Ly->vbase;
        Ly->kbase = Ly->vbase = NULL;
        for (h = 0; h < p->d.n_kv_heads; h++) {
            pqc__head *H = &Ly->heads[h];
            H->pk = s->hk[l * p->d.n_kv_heads + h] = H->k;
            H->pv = s->hv[l * p->d.n_kv_heads + h] = H->v;
            H->k = H->v = NULL;
        }
    }
    p->share = s;
    p->pn = n;
    p->cap = 0;
    if ((r = pqc__fork_room(p, n)) != PQC_SUCCESS && p->cap == 0) { /* nothing moved: as it was */
        for (l = 0; l < L; l++) {
            pqc__layer *Ly = &p->layers[l];
            Ly->kbase = s->k[l];
            Ly->vbase = s->v[l];
            s->k[l] = s->v[l] = NULL;
            for (h = 0; h < p->d.n_kv_heads; h++) {
                pqc__head *H = &Ly->heads[h];
                H->k = H->pk;
                H->v = H->pv;
                H->pk = H->pv = NULL;
            }
        }
        p->pn = 0;
        p->cap = cap;
        pqc__share_drop(p);
        pqc__tier_grown(p);
    }
    return r;
}

static pqc_result pqc__fork(pqc_cache *p, pqc_cache **out)
{
    pqc_cache *c = NULL;
    pqc_cache_desc d;
    pqc_result r;
    size_t n;
    int l, h;
    if (!p || !out) return pqc__fail(p ? p->rt : NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_fork: null argument");
    if (p->in_step) return pqc__cfail(p, PQC_ERROR_BAD_STATE, "pqc_cache_fork: a decode step is running");
    n = p->layers[0].n_tokens;
    for (l = 1; l < p->d.n_layers; l++)
        if (p->layers[l].n_tokens != n)
            return pqc__cfail(p, PQC_ERROR_BAD_STATE,
                              "pqc_cache_fork: layer %d holds %zu tokens, layer 0 %zu (fork between decode steps)", l,
                              p->layers[l].n_tokens, n);
    if ((r = pqc_cache_sync(p)) != PQC_SUCCESS) return r;
    d = p->udesc;
    if ((r = pqc_cache_create(p->rt, &d, &c)) != PQC_SUCCESS) return r;
    if (n > 0 && !p->share && (r = pqc__share_make(p, n)) != PQC_SUCCESS) goto fail;
    if (n > 0) {
        pqc__share *s = p->share;
#ifndef PQCACHE_NO_THREADS
        pthread_mutex_lock(&s->mu);
#endif
        s->refs++;
#ifndef PQCACHE_NO_THREADS
        pthread_mutex_unlock(&s->mu);
#endif
        c->share = s;
        c->pn = s->n;
        for (l = 0; l < c->d.n_layers; l++)
            for (h = 0; h < c->d.n_kv_heads; h++) {
                c->layers[l].heads[h].pk = s->hk[l * c->d.n_kv_heads + h];
                c->layers[l].heads[h].pv = s->hv[l * c->d.n_kv_heads + h];
            }
        if ((r = pqc__fork_room(c, n)) != PQC_SUCCESS) goto fail;
    }
    if ((r = pqc__fork_copy(c, p, n)) != PQC_SUCCESS) goto fail;
    *out = c;
    return PQC_SUCCESS;
fail:
    {
        char msg[sizeof pqc__errbuf];
        memcpy(msg, pqc__errbuf, sizeof msg);
        pqc_cache_destroy(c);
        memcpy(pqc__errbuf, msg, sizeof msg);
    }
    return r;
}

PQCDEF pqc_result pqc_cache_fork(pqc_cache *p, pqc_cache **out)
{
    if (!p) return pqc__fork(p, out);
    pqc__call_begin(p);
    return pqc__call_end(p, pqc__fork(p, out));
}

PQCDEF void pqc_cache_host_memory(const pqc_cache *c, size_t *own_bytes, size_t *shared_bytes)
{
    size_t own = 0, shared = 0, nkv, qn;
    int l, h;
    if (c) {
        nkv = (size_t)c->d.n_kv_heads;
        qn = (size_t)c->d.n_q_heads * (size_t)c->d.head_dim;
        for (l = 0; l < c->d.n_layers; l++) {
            const pqc__layer *L = &c->layers[l];
            own += 2 * nkv * c->cap * c->row;
            own += (pqc__qsq_len(c) + pqc__qsq_part(c) + 1 + 4 * nkv + 2 * PQC__OBS_BINS * nkv) * sizeof(double);
            own += (PQC__OBS_KEEP * qn + nkv * (pqc__bands(c) ? pqc__blocks_len(c) : (size_t)c->d.head_dim)) * sizeof(float);
            for (h = 0; h < c->d.n_kv_heads; h++) {
                const pqc__head *H = &L->heads[h];
                if (H->pq.m) {
                    size_t kc = (size_t)H->pq.m * (size_t)H->pq.ksub * (size_t)H->pq.dsub;
                    own += (2 * kc + 2 * (size_t)H->pq.m * (size_t)H->pq.ksub_pad) * sizeof(float);
                    if (H->pq.metric) own += (size_t)c->d.head_dim * sizeof(float);
                    if (H->pq.mblocks) /* the blocks, their Cholesky factors and W c (transposed) */
                        own += (2 * pqc__blocks_len(c) + (size_t)H->pq.m * (size_t)H->pq.dsub * H->pq.ksub_pad +
                                (size_t)H->pq.m * (size_t)H->pq.ksub_pad) * sizeof(float);
                }
                own += pqc_codes_bytes(&H->codes) + H->rq_cap * (size_t)c->d.pq.m;
                own += (size_t)c->d.outliers * (4 * sizeof(uint32_t) + 2 * sizeof(float));
                if (c->d.cache_blocks > 0)
                    own += c->nblk * (sizeof(int32_t) + sizeof(uint32_t) + sizeof(float)) +
                           (size_t)c->d.cache_blocks * (sizeof(int32_t) + sizeof(uint32_t) + 2 * sizeof(uint64_t));
            }
        }
        if (c->share)
            shared = c->share->map ? c->share->map_len : 2 * (size_t)c->d.n_layers * nkv * c->share->cap * c->row;
    }
    if (own_bytes) *own_bytes = own;
    if (shared_bytes) *shared_bytes = shared;
}

PQCDEF size_t pqc_cache_tokens(const pqc_cache *c, int layer)
{
    if (!c || layer < 0 || layer >= c->d.n_layers) return 0;
    return c->layers[layer].n_tokens;
}

PQCDEF int pqc_cache_window(const pqc_cache *c) { return c ? c->window : 0; }
PQCDEF int pqc_cache_layer_window(const pqc_cache *c, int layer)
{
    if (!c || layer < 0 || layer >= c->d.n_layers) return 0;
    return (int)pqc__window_of(c, &c->layers[layer]);
}

PQCDEF pqc_result pqc_cache_stats(const pqc_cache *c, int layer, pqc_layer_stats *out)
{
    pqc_result r;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_stats")) != PQC_SUCCESS) return r;
    if (!out) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_stats: null output");
    *out = c->layers[layer].st;
    return pqc__tier_stats(c, layer, out); /* what device steps counted */
}

PQCDEF void pqc_cache_memory(const pqc_cache *c, size_t *device_bytes, size_t *full_kv_bytes)
{
    size_t dev = 0, full = 0, per_head_fixed, codes = 0, tier_bytes;
    int l, h;
    if (!c) return;
    for (l = 0; l < c->d.n_layers; l++) {
        const pqc__layer *L = &c->layers[l];
        size_t n = L->n_tokens, fixed = PQC__MIN(n, (size_t)c->d.n_sink + pqc__window_of(c, L));
        per_head_fixed = fixed * 2 * c->row + (size_t)c->d.cache_blocks * c->d.block_tokens * 2 * c->row;
        for (h = 0; h < c->d.n_kv_heads; h++) {
            const pqc__head *H = &L->heads[h];
            size_t cb = pqc_codes_bytes(&H->codes);
            dev += per_head_fixed;
            if (H->pq.m) dev += (size_t)H->pq.m * H->pq.ksub * H->pq.dsub * sizeof(float);
            if (cb > codes) codes = cb;
            full += n * 2 * c->row;
        }
    }
    dev += codes * (size_t)c->d.n_kv_heads; /* one layer's codes in flight */
    tier_bytes = pqc__tier_device_bytes(c); /* what a GPU actually holds, where there is one */
    if (tier_bytes) dev = tier_bytes;
    if (device_bytes) *device_bytes = dev;
    if (full_kv_bytes) *full_kv_bytes = full;
}

PQCDEF pqc_result pqc_cache_kv(const pqc_cache *c, int layer, int head, const void **k, const void **v, size_t *tokens,
                               pqc_dtype *dtype)
{
    pqc_result r;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_kv")) != PQC_SUCCESS) return r;
    if (head < 0 || head >= c->d.n_kv_heads) return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_kv: head %d", head);
    if (c->pn && c->layers[layer].n_tokens > c->pn)
        return pqc__cfail(c, PQC_ERROR_BAD_STATE,
                          "pqc_cache_kv: the rows of a fork lie in two parts (shared prefix, own rows): use "
                          "pqc_cache_kv_part");
    if (k) *k = c->layers[layer].n_tokens ? pqc__krow(c, &c->layers[layer].heads[head], 0) : NULL;
    if (v) *v = c->layers[layer].n_tokens ? pqc__vrow(c, &c->layers[layer].heads[head], 0) : NULL;
    if (tokens) *tokens = c->layers[layer].n_tokens;
    if (dtype) *dtype = c->d.kv_dtype;
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cache_kv_part(const pqc_cache *c, int layer, int head, size_t from, const void **k,
                                    const void **v, size_t *count)
{
    pqc_result r;
    size_t n;
    const pqc__head *H;
    if ((r = pqc__check_layer(c, layer, "pqc_cache_kv_part")) != PQC_SUCCESS) return r;
    if (head < 0 || head >= c->d.n_kv_heads)
        return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_kv_part: head %d", head);
    if (!k || !v || !count) return pqc__cfail(c, PQC_ERROR_INVALID_ARGUMENT, "pqc_cache_kv_part: null output");
    n = c->layers[layer].n_tokens;
    if (from > n) return pqc__cfail(c, PQC_ERROR_OUT_OF_RANGE, "pqc_cache_kv_part: token %zu of %zu", from, n);
    H = &c->layers[layer].heads[head];
    *count = from < c->pn ? PQC__MIN(n, c->pn) - from : n - from;
    *k = *count ? pqc__krow(c, H, from) : NULL;
    *v = *count ? pqc__vrow(c, H, from) : NULL;
    return PQC_SUCCESS;
}

PQCDEF int pqc_cache_cached_blocks(const pqc_cache *c, int layer, int head, int32_t *out, int max)
{
    int s, n = 0, i;
    const pqc__head *H;
    if (!c || layer < 0 || layer >= c->d.n_layers || head < 0 || head >= c->d.n_kv_heads) return 0;
    /* after device steps, the device's bookkeeping (a failed read leaves the last known) */
    (void)pqc__tier_adm_pull((pqc_cache *)(uintptr_t)c, layer);
    H = &c->layers[layer].heads[head];
    for (s = 0; s < c->d.cache_blocks; s++) {
        int32_t b = H->block_of[s];
        if (b < 0) continue;
        if (out && n < max) { /* insertion keeps the list ascending */
            for (i = n; i > 0 && out[i - 1] > b; i--) out[i] = out[i - 1];
            out[i] = b;
        }
        n++;
    }
    return n;
}

/* ---------------------------------------------------------------------------------------
   14. Batches and driver
   ------------------------------------------------------------------------------------- */

/* ----- batches ----- */

typedef struct pqc__batch_job {
    pqc_cache *const *caches;
    int layer;
    const float *const *q;
    pqc_selection *const *sel;
    const pqc_selection *const *csel;
    const pqc_kv_out *const *out;
    pqc_result *res;
} pqc__batch_job;

static void pqc__batch_select_one(void *ctx, size_t i)
{
    pqc__batch_job *b = (pqc__batch_job *)ctx;
    pqc_cache *c = b->caches[i];
    pqc_result r;
    c->in_step = 1; /* drift rebuilds start on the caller's thread, after the batch */
    pqc__call_begin(c);
    r = pqc__select_impl(c, b->layer, b->q[i], b->sel[i], 0);
    c->in_step = 0;
    b->res[i] = pqc__call_end(c, r); /* nothing falls due in a select: nothing starts here */
}
static void pqc__batch_fetch_one(void *ctx, size_t i)
{
    pqc__batch_job *b = (pqc__batch_job *)ctx;
    b->res[i] = pqc__fetch_impl(b->caches[i], b->layer, b->csel[i], b->out[i], NULL, 0);
}

static pqc_result pqc__batch(pqc_cache *const *caches, int n, pqc__batch_job *b, void (*fn)(void *, size_t))
{
    pqc_result r = PQC_SUCCESS;
    int i;
    pqc_runtime *rt;
    unsigned char sbuf[PQC__SMALL_BUF];
    void *held;
    if (!caches || n <= 0) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "batch: no caches");
    for (i = 0; i < n; i++)
        if (!caches[i]) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "batch: cache %d is null", i);
    rt = caches[0]->rt;
    for (i = 1; i < n; i++) {
        int j;
        if (caches[i]->rt != rt) return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "batch: caches use different runtimes");
        for (j = 0; j < i; j++) /* one cache twice would be driven by two threads at once */
            if (caches[j] == caches[i])
                return pqc__fail(rt, PQC_ERROR_INVALID_ARGUMENT, "batch: cache %d is also sequence %d", i, j);
    }
    b->res = (pqc_result *)pqc__small_get(&caches[0]->alloc, sbuf, sizeof sbuf, sizeof(pqc_result) * (size_t)n, &held);
    if (!b->res) return pqc__fail(rt, PQC_ERROR_OUT_OF_MEMORY, "batch: allocation failed");
    pqc__parallel_for(rt, (size_t)n, fn, b);
    for (i = 0; i < n && r == PQC_SUCCESS; i++)
        if (b->res[i] != PQC_SUCCESS) {
            fn(b, (size_t)i); /* again on this thread (the call is atomic): its message is this thread's */
            r = b->res[i];
        }
    pqc__free(&caches[0]->alloc, held);
    return r;
}

PQCDEF pqc_result pqc_batch_select(pqc_cache *const *caches, int n, int layer, const float *const *q,
                                   pqc_selection *const *sel)
{
    pqc__batch_job b;
    memset(&b, 0, sizeof b);
    if (!q || !sel) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_batch_select: null arrays");
    pqc_result r;
    int i;
    b.caches = caches;
    b.layer = layer;
    b.q = q;
    b.sel = sel;
    if (caches && n > 0 && caches[0] && caches[0]->tier->batch_tables) caches[0]->tier->batch_tables(caches, n, layer, q);
    r = pqc__batch(caches, n, &b, pqc__batch_select_one);
    /* only successful selects noted drifted queries; the layer index was checked by them */
    for (i = 0; caches && i < n; i++)
        if (caches[i] && layer >= 0 && layer < caches[i]->d.n_layers) pqc__drift_commit(caches[i], layer, 1);
    return r;
}

PQCDEF pqc_result pqc_batch_fetch(pqc_cache *const *caches, int n, int layer, const pqc_selection *const *sel,
                                  const pqc_kv_out *const *out)
{
    pqc__batch_job b;
    memset(&b, 0, sizeof b);
    if (!sel || !out) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_batch_fetch: null arrays");
    b.caches = caches;
    b.layer = layer;
    b.csel = sel;
    b.out = out;
    return pqc__batch(caches, n, &b, pqc__batch_fetch_one);
}

/* ----- driver ----- */

/* The driver runs every layer at one position: each must hold exactly pos tokens. */
static pqc_result pqc__driver_check_pos(const pqc_cache *c, size_t pos, const char *what)
{
    int l;
    for (l = 0; l < c->d.n_layers; l++)
        if (c->layers[l].n_tokens != pos)
            return pqc__cfail(c, PQC_ERROR_BAD_STATE, "%s: position %zu, but layer %d holds %zu tokens", what, pos, l,
                              c->layers[l].n_tokens);
    return PQC_SUCCESS;
}

/* The rows of every head of layer l as one run each, for a prefill view (kp: K of each
   head, then V; cnt: rows): the store's own rows, or, where they lie in two parts (a
   fork, a cache loaded by mapping: the shared prefix, then the cache's own rows), copied
   together into *buf (grown to *buf_bytes as needed, freed by the caller). */
static pqc_result pqc__prefill_rows(pqc_cache *c, int l, const void **kp, size_t *cnt, unsigned char **buf,
                                    size_t *buf_bytes)
{
    const pqc__layer *L = &c->layers[l];
    const int nkv = c->d.n_kv_heads;
    const size_t n = L->n_tokens, head = n * c->row;
    size_t need;
    int h;
    if (!(c->pn > 0 && n > c->pn)) {
        for (h = 0; h < nkv; h++) {
            kp[h] = n ? pqc__krow(c, &L->heads[h], 0) : NULL;
            kp[nkv + h] = n ? pqc__vrow(c, &L->heads[h], 0) : NULL;
            cnt[h] = n;
        }
        return PQC_SUCCESS;
    }
    if (!pqc__size3(2 * (size_t)nkv, n, c->row, &need))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_driver_prefill: %zu tokens do not fit in memory", n);
    if (need > *buf_bytes) {
        unsigned char *nb = (unsigned char *)pqc__alloc(&c->alloc, need);
        if (!nb) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_driver_prefill: %zu bytes of K/V rows", need);
        pqc__free(&c->alloc, *buf);
        *buf = nb;
        *buf_bytes = need;
    }
    for (h = 0; h < nkv; h++) {
        const pqc__head *H = &L->heads[h];
        unsigned char *kd = *buf + 2 * (size_t)h * head, *vd = kd + head;
        size_t ps = c->pn * c->row;
        memcpy(kd, H->pk, ps);
        memcpy(kd + ps, H->k, head - ps);
        memcpy(vd, H->pv, ps);
        memcpy(vd + ps, H->v, head - ps);
        kp[h] = kd;
        kp[nkv + h] = vd;
        cnt[h] = n;
    }
    return PQC_SUCCESS;
}

static pqc_result pqc__driver_prefill(pqc_cache *c, const pqc_engine *e, size_t pos0, size_t n)
{
    size_t qn, kn, bytes, rows_bytes = 0;
    float *q, *k, *v;
    unsigned char *rows = NULL;
    const void **kp;
    size_t *cnt;
    pqc_result r = PQC_SUCCESS;
    int l;
    if (!c || !e || !e->qkv || !e->attend) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_driver_prefill: null");
    if (n == 0) return pqc__cfail(c, PQC_ERROR_EMPTY, "pqc_driver_prefill: no tokens");
    if ((r = pqc__driver_check_pos(c, pos0, "pqc_driver_prefill")) != PQC_SUCCESS) return r;
    if (n > c->d.max_tokens - pos0)
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_driver_prefill: %zu + %zu tokens exceed max_tokens", pos0, n);
    qn = (size_t)c->d.n_q_heads * c->d.head_dim;
    kn = (size_t)c->d.n_kv_heads * c->d.head_dim;
    if (!pqc__mul(n, (qn + 2 * kn) * sizeof(float), &bytes))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_driver_prefill: too many tokens");
    q = (float *)pqc__alloc(&c->alloc, bytes);
    kp = (const void **)pqc__alloc(&c->alloc, (sizeof(void *) * 2 + sizeof(size_t)) * (size_t)c->d.n_kv_heads);
    if (!q || !kp) {
        pqc__free(&c->alloc, q);
        pqc__free(&c->alloc, kp);
        return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_driver_prefill: %zu bytes of Q/K/V", bytes);
    }
    if ((r = pqc__undo_begin(c, c->d.observe > 0)) != PQC_SUCCESS) {
        pqc__free(&c->alloc, q);
        pqc__free(&c->alloc, kp);
        return r;
    }
    k = q + n * qn;
    v = k + n * kn;
    cnt = (size_t *)(kp + 2 * c->d.n_kv_heads);
    for (l = 0; l < c->d.n_layers && r == PQC_SUCCESS; l++) {
        pqc_matrix km, vm;
        pqc_kv_view view;
        double t0 = pqc__now(), t1;
        if (e->qkv(e->user, l, pos0, n, q, k, v) != 0) {
            r = pqc__cfail(c, PQC_ERROR_CALLBACK, "pqc_driver_prefill: qkv callback failed at layer %d", l);
            break;
        }
        km.data = k;
        km.dtype = PQC_F32;
        km.rows = n;
        km.cols = kn;
        km.row_stride = 0;
        vm = km;
        vm.data = v;
        /* the last queries shape the distance of this layer's build (metric) */
        if (c->d.observe > 0) {
            size_t no = PQC__MIN(n, (size_t)c->d.observe);
            if ((r = pqc_cache_observe(c, l, q + (n - no) * qn, no)) != PQC_SUCCESS) break;
        }
        /* offload + background PQ build of this layer, overlapped with the next layers */
        if ((r = pqc_cache_prefill(c, l, &km, &vm)) != PQC_SUCCESS) break;
        if ((r = pqc__prefill_rows(c, l, kp, cnt, &rows, &rows_bytes)) != PQC_SUCCESS) break;
        view.n_kv_heads = c->d.n_kv_heads;
        view.head_dim = c->d.head_dim;
        view.dtype = c->d.kv_dtype;
        view.k = kp;
        view.v = kp + c->d.n_kv_heads;
        view.count = cnt;
        view.pos = NULL;
        view.krows = view.vrows = NULL;
        view.on_device = 0; /* prefill attends over the host store */
        if (e->attend(e->user, l, pos0, n, q, &view) != 0) {
            r = pqc__cfail(c, PQC_ERROR_CALLBACK, "pqc_driver_prefill: attend callback failed at layer %d", l);
            break;
        }
        t1 = pqc__now();
        if (c->d.scheduler && pos0 == 0) pqc_scheduler_add_compute(c->d.scheduler, (double)n, t1 - t0);
    }
    pqc__free(&c->alloc, q);
    pqc__free(&c->alloc, kp);
    pqc__free(&c->alloc, rows);
    c->urec.last = l; /* on failure, the end of the call gives back every layer up to l */
    return r;
}

PQCDEF pqc_result pqc_driver_prefill(pqc_cache *c, const pqc_engine *e, size_t pos0, size_t n)
{
    if (!c) return pqc__driver_prefill(c, e, pos0, n);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__driver_prefill(c, e, pos0, n));
}

static pqc_result pqc__driver_decode(pqc_cache *c, const pqc_engine *e, size_t pos)
{
    size_t qn, kn, cap, need;
    float *q, *k, *v, *ko, *vo;
    const void **kp;
    const uint32_t **pp;
    pqc_selection *sel;
    pqc_kv_out out;
    pqc_result r = PQC_SUCCESS;
    unsigned char sbuf[PQC__SMALL_BUF];
    void *held;
    int l, h;
    if (!c || !e || !e->qkv || !e->attend) return pqc__fail(NULL, PQC_ERROR_INVALID_ARGUMENT, "pqc_driver_decode: null");
    if (pos == 0) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "pqc_driver_decode: position 0: prefill first");
    if ((r = pqc__driver_check_pos(c, pos, "pqc_driver_decode")) != PQC_SUCCESS) return r;
    qn = (size_t)c->d.n_q_heads * c->d.head_dim;
    kn = (size_t)c->d.n_kv_heads * c->d.head_dim;
    cap = pos + 1;
    if (!c->dsel.idx && (r = pqc_selection_init(c, &c->dsel)) != PQC_SUCCESS) return r;
    if (!pqc__size3(2 * cap + 3, kn, sizeof(float), &need))
        return pqc__cfail(c, PQC_ERROR_CAPACITY, "pqc_driver_decode: %zu tokens do not fit in memory", cap);
    need = qn + 2 * kn + 2 * cap * kn;
    if (need > c->dbuf_floats) { /* grows geometrically: decode steps allocate rarely */
        size_t want = need + need / 4;
        /* store memory: pinned on a GPU, so that rows come back without staging; 16 floats
           more, so that the rows can start on a 64-byte line (a large fetch streams them) */
        float *nb = (float *)pqc__store_alloc(c, (want + 16) * sizeof(float));
        if (!nb) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_driver_decode: allocation failed");
        pqc__store_free(c, c->dbuf);
        c->dbuf = nb;
        c->dbuf_floats = want;
    }
    /* the view's pointers: K, V and positions per head */
    kp = (const void **)pqc__small_get(&c->alloc, sbuf, sizeof sbuf, sizeof(void *) * 3 * (size_t)c->d.n_kv_heads, &held);
    if (!kp) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "pqc_driver_decode: allocation failed");
    if ((r = pqc__undo_begin(c, 0)) != PQC_SUCCESS) {
        pqc__free(&c->alloc, held);
        return r;
    }
    sel = &c->dsel;
    q = c->dbuf + (64 - (uintptr_t)c->dbuf % 64) % 64 / sizeof(float);
    k = q + qn;
    v = k + kn;
    ko = v + kn;
    vo = ko + cap * kn;
    pp = (const uint32_t **)(kp + 2 * c->d.n_kv_heads);
    out.k = ko;
    out.v = vo;
    out.head_stride = cap;
    c->in_step = 1;
    for (l = 0; l < c->d.n_layers; l++) {
        pqc_kv_view view;
        pqc_kv_device dk = { 0, 0, 0, 0 };
        if (e->qkv(e->user, l, pos, 1, q, k, v) != 0) {
            r = pqc__cfail(c, PQC_ERROR_CALLBACK, "pqc_driver_decode: qkv callback failed at layer %d", l);
            break;
        }
        if ((r = pqc_cache_append(c, l, k, v)) != PQC_SUCCESS) break;
        view.krows = view.vrows = NULL;
        view.on_device = c->sp.device_rows && e->accepts_device_kv;
        if (c->layers[l].n_tokens > sel->capacity &&
            (r = pqc__selection_grow(c, sel, pqc__selection_cap(c, c->layers[l].n_tokens))) != PQC_SUCCESS)
            break;
        /* the whole step on the device tier where it can (no round trip; with host rows
           one synchronisation, for the rows), else select, then fetch */
        r = c->sp.tier_step ? pqc__step_impl(c, l, q, view.on_device ? NULL : &out, view.on_device ? &dk : NULL,
                                             sel->count, sel->idx, sel->capacity)
                            : PQC__NOT_SERVED;
        if (r == PQC__NOT_SERVED) {
            if ((r = pqc_cache_select(c, l, q, sel)) != PQC_SUCCESS) break;
            if (view.on_device) {
                if ((r = pqc_cache_fetch_device(c, l, sel, &dk)) != PQC_SUCCESS) break;
            } else if ((e->accepts_row_pointers == 2 || (e->accepts_row_pointers && c->d.kv_dtype == PQC_F32)) &&
                       pqc__zero_copy(c)) {
                if ((r = pqc_cache_fetch_rows(c, l, sel, &view.krows, &view.vrows)) != PQC_SUCCESS) break;
            } else if ((r = pqc_cache_fetch(c, l, sel, &out)) != PQC_SUCCESS) {
                break;
            }
        } else if (r != PQC_SUCCESS) {
            break;
        }
        for (h = 0; h < c->d.n_kv_heads; h++) {
            if (view.on_device) { /* device addresses carried in pointers */
                size_t hb = dk.head_stride * (size_t)c->d.head_dim * sizeof(float);
                kp[h] = (const void *)(uintptr_t)(dk.k + (uint64_t)h * hb);
                kp[c->d.n_kv_heads + h] = (const void *)(uintptr_t)(dk.v + (uint64_t)h * hb);
                pp[h] = (const uint32_t *)(uintptr_t)(dk.pos + (uint64_t)h * dk.head_stride * sizeof(uint32_t));
            } else {
                kp[h] = view.krows ? NULL : ko + (size_t)h * cap * c->d.head_dim;
                kp[c->d.n_kv_heads + h] = view.krows ? NULL : vo + (size_t)h * cap * c->d.head_dim;
                pp[h] = sel->idx + (size_t)h * sel->capacity;
            }
        }
        view.n_kv_heads = c->d.n_kv_heads;
        view.head_dim = c->d.head_dim;
        view.dtype = view.krows ? c->d.kv_dtype : PQC_F32;
        view.k = kp;
        view.v = kp + c->d.n_kv_heads;
        view.count = sel->count;
        view.pos = pp;
        if (e->attend(e->user, l, pos, 1, q, &view) != 0) {
            r = pqc__cfail(c, PQC_ERROR_CALLBACK, "pqc_driver_decode: attend callback failed at layer %d", l);
            break;
        }
    }
    pqc__free(&c->alloc, held);
    c->in_step = 0;
    c->urec.last = l; /* on failure, the end of the call gives back every layer up to l */
    for (l = 0; l < c->d.n_layers; l++) pqc__drift_commit(c, l, r == PQC_SUCCESS);
    return r;
}

PQCDEF pqc_result pqc_driver_decode(pqc_cache *c, const pqc_engine *e, size_t pos)
{
    if (!c) return pqc__driver_decode(c, e, pos);
    pqc__call_begin(c);
    return pqc__call_end(c, pqc__driver_decode(c, e, pos));
}

/* =======================================================================================
   15. Kernel source: pqcache_kernels.cu, embedded as a string for NVRTC
   ===================================================================================== */
#if PQC__CUDA_LOADER
/* BEGIN EMBEDDED pqcache_kernels.cu (generated by tools/embed_kernels.sh; do not edit) */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverlength-strings"
#endif
static const char pqc__kernel_source[] =
"/* pqcache_kernels.cu - CUDA kernels of pqcache.\n"
" *\n"
" * This file is compiled at run time with NVRTC (it is embedded into pqcache.h as a\n"
" * string, see tools/embed_kernels.sh), so it includes no headers at all: it only uses\n"
" * NVRTC's built-in types and functions. Every kernel is `extern \"C\"` so that its name in\n"
" * the module is the plain identifier, and every kernel is written for blocks of exactly\n"
" * PQC_BLOCK (256) threads in x (blockDim.y = blockDim.z = 1).\n"
" *\n"
" * Conventions shared with the CPU library (they must match it bit for bit):\n"
" *   - Per KV head: d_h dims, m sub-spaces of d_sub = d_h / m dims, K = 2^b centroids.\n"
" *   - centroids: float32 [m][K][d_sub].\n"
" *   - codes: one byte column per sub-space, bit-packed LSB-first: the code of token t in\n"
" *     sub-space j is bits [t*b, t*b+b) of column j, which starts at codes + j*col_stride\n"
" *     bytes. Columns are followed by at least 8 zero bytes of padding (a 16-bit read at\n"
" *     the last code byte is safe).\n"
" *   - LUT: float32 [g][m][K], LUT[h][j][c] = sequential fmaf over e of\n"
" *     q_h[j*d_sub+e] * centroid[j][c][e], starting from 0.\n"
" *   - score_h(t) = sequential float sum over j = 0..m-1 of LUT[h][j][code_j(t)] from 0.\n"
" *   - SOFTMAX_SUM: e_h(t) = pqc_exp((score_h(t) - max_h) * scale) with the library's own\n"
" *     exp (same polynomial and operation order as the CPU), Z_h = sum over t of e_h(t),\n"
" *     combined(t) = fmaf(e_h(t), 1/Z_h, combined(t)) over h in order, from 0.\n"
" *   - top-k order: the order-preserving key of a float (-0 taken as +0; flip all bits\n"
" *     when the sign is set, else flip the sign bit); larger key first, ties to the lower\n"
" *     token index; results are listed in ascending token index.\n"
" *\n"
" * Batching: kernels that work per KV head take the head from blockIdx.y and find their\n"
" * data through \"head strides\" (in elements of the pointed-to type); pass 0 strides and\n"
" * gridDim.y = 1 to process a single head. All strides and 64-bit offsets are signed\n"
" * 64-bit (long long) on the host side.\n"
" *\n"
" * Determinism: every reduction over floats runs in a fixed order for a given launch\n"
" * shape (no floating-point atomics), except the per-cluster sums of pqc_kmeans_assign\n"
" * and pqc_kmeans_assign_dots.\n"
" * Results equal the CPU library's bit for bit except Z_h of SOFTMAX_SUM (a tree over\n"
" * blocks here, 16 interleaved lanes on the CPU: a few ulps apart), SOFTMAX_SUM's\n"
" * exponentials over 8-bit codes with two or more heads (the CPU takes them as products\n"
" * of per-sub-space tables of exponentials: a few ulps apart) and the k-means sums.\n"
" * That needs --fmad=false (the library passes it): only the explicit fmaf calls fuse.\n"
" */\n"
"\n"
"typedef unsigned char      pqc_u8;\n"
"typedef unsigned short     pqc_u16;\n"
"typedef unsigned int       pqc_u32;\n"
"typedef unsigned long long pqc_u64;\n"
"typedef long long          pqc_i64;\n"
"\n"
"#define PQC_BLOCK        256   /* threads per block, every kernel */\n"
"#define PQC_WARPS        8     /* PQC_BLOCK / 32 */\n"
"#define PQC_FULL         0xffffffffu\n"
"#define PQC_GROUP        8     /* query heads scored together per pass over the codes */\n"
"#define PQC_RADIX_BINS   2048  /* histogram bins of one radix-select pass (11 bits) */\n"
"#define PQC_TOPK_ITEMS   16    /* tokens per thread in the compaction kernels */\n"
"#define PQC_TOPK_TILE    4096  /* PQC_BLOCK * PQC_TOPK_ITEMS tokens per compaction block */\n"
"#define PQC_MAX_DSUB     256   /* largest vector length of the nearest-centroid kernels */\n"
"\n"
"#define PQC_DT_F32  0\n"
"#define PQC_DT_F16  1\n"
"#define PQC_DT_BF16 2\n"
"\n"
"#define PQC_SCAN_RAW         0\n"
"#define PQC_SCAN_SOFTMAX_SUM 1\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* Device functions                                                                     */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* The top-k of head kv: k, or less where a per-head list gives less. */\n"
"__device__ __forceinline__ int pqc_head_k(int k, const int *k_head, pqc_i64 kv)\n"
"{\n"
"    return k_head && k_head[kv] < k \? k_head[kv] : k;\n"
"}\n"
"\n"
"/* IEEE binary16 -> binary32, exact (normals, subnormals, zeros, inf, NaN). */\n"
"__device__ __forceinline__ float pqc_f16_to_f32(pqc_u32 h)\n"
"{\n"
"    pqc_u32 sign = (h & 0x8000u) << 16;\n"
"    pqc_u32 ex = (h >> 10) & 0x1fu;\n"
"    pqc_u32 man = h & 0x3ffu;\n"
"    if (ex == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));\n"
"    if (ex != 0u) return __uint_as_float(sign | ((ex + 112u) << 23) | (man << 13));\n"
"    if (man == 0u) return __uint_as_float(sign);\n"
"    /* subnormal: man * 2^-24 is exact in float */\n"
"    return __uint_as_float(sign | __float_as_uint((float)man * 5.9604644775390625e-8f));\n"
"}\n"
"\n"
"/* bfloat16 -> binary32, exact. */\n"
"__device__ __forceinline__ float pqc_bf16_to_f32(pqc_u32 h)\n"
"{\n"
"    return __uint_as_float((h & 0xffffu) << 16);\n"
"}\n"
"\n"
"/* Element i of a row stored as fp32 / fp16 / bf16 (dtype 0 / 1 / 2). */\n"
"__device__ __forceinline__ float pqc_load_elem(const void *base, pqc_i64 i, int dtype)\n"
"{\n"
"    if (dtype == PQC_DT_F32) return ((const float *)base)[i];\n"
"    pqc_u32 h = ((const pqc_u16 *)base)[i];\n"
"    return dtype == PQC_DT_F16 \? pqc_f16_to_f32(h) : pqc_bf16_to_f32(h);\n"
"}\n"
"\n"
"/* Bytes per element of a dtype. */\n"
"__device__ __forceinline__ int pqc_dtype_size(int dtype)\n"
"{\n"
"    return dtype == PQC_DT_F32 \? 4 : 2;\n"
"}\n"
"\n"
"/* Code of token t in one column (bits [t*b, t*b+b), LSB-first). Reads two bytes, which\n"
"   the column padding makes safe for the last token. */\n"
"__device__ __forceinline__ pqc_u32 pqc_code_at(const pqc_u8 *__restrict__ col, pqc_u64 t,\n"
"                                               int b, pqc_u32 mask)\n"
"{\n"
"    pqc_u64 bit = t * (pqc_u64)b;\n"
"    const pqc_u8 *p = col + (bit >> 3);\n"
"    pqc_u32 v = (pqc_u32)p[0] | ((pqc_u32)p[1] << 8);\n"
"    return (v >> (pqc_u32)(bit & 7u)) & mask;\n"
"}\n"
"\n"
"/* Order-preserving uint32 key of a float: larger float -> larger key; -0 == +0. */\n"
"__device__ __forceinline__ pqc_u32 pqc_float_key(float f)\n"
"{\n"
"    pqc_u32 u = __float_as_uint(f);\n"
"    if ((u << 1) == 0u) u = 0u;\n"
"    return (u & 0x80000000u) \? ~u : (u ^ 0x80000000u);\n"
"}\n"
"\n"
"/* exp(x) for x <= 0, as the CPU library computes it: arguments below -87.3 are clamped,\n"
"   Cody-Waite reduction by ln 2 and a degree-5 polynomial with explicit fused operations,\n"
"   relative error < 2e-7. Bit-identical to the CPU (every operation is IEEE-rounded). */\n"
"__device__ __forceinline__ float pqc_exp(float x)\n"
"{\n"
"    if (!(x > -87.3f)) x = -87.3f;\n"
"    float n = rintf(x * 1.44269504088896341f);\n"
"    float r = fmaf(n, -0.693359375f, x);\n"
"    r = fmaf(n, 2.12194440e-4f, r);\n"
"    float z = r * r;\n"
"    float y = 1.9875691500e-4f;\n"
"    y = fmaf(y, r, 1.3981999507e-3f);\n"
"    y = fmaf(y, r, 8.3334519073e-3f);\n"
"    y = fmaf(y, r, 4.1665795894e-2f);\n"
"    y = fmaf(y, r, 1.6666665459e-1f);\n"
"    y = fmaf(y, r, 5.0000001201e-1f);\n"
"    y = fmaf(y, z, r);\n"
"    y = y + 1.0f;\n"
"    return y * __uint_as_float((pqc_u32)((int)n + 127) << 23);\n"
"}\n"
"\n"
"/* Exclusive prefix sum of v over the 256 threads of the block, in thread order.\n"
"   `warp_tot` is shared scratch of PQC_WARPS words; *total receives the block sum.\n"
"   Every thread of the block must call it (it contains __syncthreads). */\n"
"__device__ __forceinline__ pqc_u32 pqc_block_exclusive_scan(pqc_u32 v, pqc_u32 *warp_tot,\n"
"                                                            pqc_u32 *total)\n"
"{\n"
"    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
"    pqc_u32 x = v;\n"
"    for (int o = 1; o < 32; o <<= 1) {\n"
"        pqc_u32 y = __shfl_up_sync(PQC_FULL, x, o);\n"
"        if (lane >= o) x += y;\n"
"    }\n"
"    if (lane == 31) warp_tot[warp] = x;\n"
"    __syncthreads();\n"
"    if (warp == 0) {\n"
"        pqc_u32 w = lane < PQC_WARPS \? warp_tot[lane] : 0u;\n"
"        for (int o = 1; o < PQC_WARPS; o <<= 1) {\n"
"            pqc_u32 y = __shfl_up_sync(PQC_FULL, w, o);\n"
"            if (lane >= o) w += y;\n"
"        }\n"
"        if (lane < PQC_WARPS) warp_tot[lane] = w; /* inclusive warp totals */\n"
"    }\n"
"    __syncthreads();\n"
"    pqc_u32 before = warp > 0 \? warp_tot[warp - 1] : 0u;\n"
"    *total = warp_tot[PQC_WARPS - 1];\n"
"    __syncthreads(); /* scratch may be reused after return */\n"
"    return before + x - v;\n"
"}\n"
"\n"
"/* Online softmax accumulator (running max mx, running sum sm of exp((x - mx) * scale)). */\n"
"__device__ __forceinline__ void pqc_online_add(float &mx, float &sm, float x, float scale)\n"
"{\n"
"    if (x > mx) {\n"
"        sm = sm * pqc_exp((mx - x) * scale) + 1.0f;\n"
"        mx = x;\n"
"    } else {\n"
"        sm += pqc_exp((x - mx) * scale);\n"
"    }\n"
"}\n"
"\n"
"/* Merge two online-softmax accumulators; an empty one (sum 0) is neutral. */\n"
"__device__ __forceinline__ void pqc_online_merge(float &m1, float &s1, float m2, float s2,\n"
"                                                 float scale)\n"
"{\n"
"    if (s2 == 0.0f) return;\n"
"    if (s1 == 0.0f) { m1 = m2; s1 = s2; return; }\n"
"    float mx = m1 > m2 \? m1 : m2;\n"
"    s1 = s1 * pqc_exp((m1 - mx) * scale) + s2 * pqc_exp((m2 - mx) * scale);\n"
"    m1 = mx;\n"
"}\n"
"\n"
"/* Combines the online-softmax accumulators (mx, sm) of the 256 threads of the block by a\n"
"   tree in shared memory (red_m, red_s: PQC_BLOCK floats each); thread 0 writes the block's\n"
"   {max, sum} to out[0], out[1]. Every thread of the block must call it. */\n"
"__device__ __forceinline__ void pqc_block_online_reduce(float mx, float sm, float scale, float *red_m,\n"
"                                                        float *red_s, float *out)\n"
"{\n"
"    int tid = threadIdx.x;\n"
"    red_m[tid] = mx;\n"
"    red_s[tid] = sm;\n"
"    __syncthreads();\n"
"    for (int o = PQC_BLOCK / 2; o > 0; o >>= 1) {\n"
"        if (tid < o) {\n"
"            float a = red_m[tid], as = red_s[tid];\n"
"            pqc_online_merge(a, as, red_m[tid + o], red_s[tid + o], scale);\n"
"            red_m[tid] = a;\n"
"            red_s[tid] = as;\n"
"        }\n"
"        __syncthreads();\n"
"    }\n"
"    if (tid == 0) {\n"
"        out[0] = red_m[0];\n"
"        out[1] = red_s[0];\n"
"    }\n"
"    __syncthreads(); /* the scratch may be reused after return */\n"
"}\n"
"\n"
"/* Nearest centroid of the vector xs (d floats, typically in shared memory) among K\n"
"   centroids [K][d] with squared norms cn (NULL: computed here), by one full warp:\n"
"   dist(c) = ||c||^2 - 2 x.c with x.c and ||c||^2 accumulated by sequential fmaf from 0;\n"
"   ties go to the lower index. Every lane returns the same index; *best_out gets its\n"
"   dist. All 32 lanes of the warp must call it. */\n"
"/* The warp's smallest (best, besti) over its lanes, ties to the lower index; besti\n"
"   0x7fffffff stands for none. Every lane ends with the result. */\n"
"__device__ __forceinline__ void pqc_warp_argmin(float &best, int &besti)\n"
"{\n"
"    for (int o = 16; o > 0; o >>= 1) {\n"
"        float ob = __shfl_xor_sync(PQC_FULL, best, o);\n"
"        int oi = __shfl_xor_sync(PQC_FULL, besti, o);\n"
"        if (oi != 0x7fffffff &&\n"
"            (besti == 0x7fffffff || ob < best || (ob == best && oi < besti))) {\n"
"            best = ob;\n"
"            besti = oi;\n"
"        }\n"
"    }\n"
"}\n"
"\n"
"__device__ __forceinline__ int pqc_warp_nearest(const float *xs, int d,\n"
"                                                const float *__restrict__ cen,\n"
"                                                const float *__restrict__ cn, int K,\n"
"                                                float *best_out)\n"
"{\n"
"    int lane = threadIdx.x & 31;\n"
"    float best = __int_as_float(0x7f800000); /* +inf */\n"
"    int besti = 0x7fffffff;\n"
"    for (int c = lane; c < K; c += 32) {\n"
"        const float *cr = cen + (pqc_i64)c * d;\n"
"        float dot = 0.0f, nrm = 0.0f;\n"
"        if (cn) {\n"
"            for (int e = 0; e < d; ++e) dot = fmaf(xs[e], cr[e], dot);\n"
"            nrm = cn[c];\n"
"        } else {\n"
"            for (int e = 0; e < d; ++e) {\n"
"                float ce = cr[e];\n"
"                dot = fmaf(xs[e], ce, dot);\n"
"                nrm = fmaf(ce, ce, nrm);\n"
"            }\n"
"        }\n"
"        float dist = nrm - 2.0f * dot;\n"
"        if (besti == 0x7fffffff || dist < best) { best = dist; besti = c; }\n"
"    }\n"
"    pqc_warp_argmin(best, besti);\n"
"    *best_out = best;\n"
"    return besti == 0x7fffffff \? 0 : besti;\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (a) Lookup tables                                                                    */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* The key dim of element e of sub-space j: j*d_sub + e, or with half = 1 (rope bands\n"
"   over the half-split layout) the two runs [j h, (j+1) h) and [d_h/2 + j h, ...),\n"
"   h = d_sub/2, in that order (pqc_pq_dim on the host). */\n"
"__device__ __forceinline__ int pqc_sub_dim(int j, int e, int d_sub, int d_h, int half)\n"
"{\n"
"    if (!half) return j * d_sub + e;\n"
"    int h2 = d_sub >> 1;\n"
"    return e < h2 \? j * h2 + e : (d_h >> 1) + j * h2 + (e - h2);\n"
"}\n"
"\n"
"/* pqc_lut_build: lookup tables of the g query heads of each KV head.\n"
" *   grid  (ceil(m*K / 256), n_kv), block 256; one thread per (sub-space j, centroid c).\n"
" *   q         float [g][d_h] per KV head (q + kv*q_head_stride), d_h = m*d_sub\n"
" *   centroids float [m][K][d_sub] per KV head\n"
" *   half      the sub-space layout of pqc_sub_dim\n"
" *   lut       float [g][m][K] per KV head, or NULL\n"
" *   lut_sum   float [m][K] per KV head, or NULL: sum over h in head order (from 0) of\n"
" *             the g tables, the table of the GQA \"sum\" mode.\n"
" * LUT[h][j][c] = sequential fmaf over e of q[h][pqc_sub_dim(j, e)] * centroids[j][c][e],\n"
" * from 0. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_lut_build(const float *__restrict__ q, pqc_i64 q_head_stride,\n"
"              const float *__restrict__ centroids, pqc_i64 cent_head_stride,\n"
"              int g, int m, int K, int d_sub, int half,\n"
"              float *__restrict__ lut, pqc_i64 lut_head_stride,\n"
"              float *__restrict__ lut_sum, pqc_i64 lut_sum_head_stride)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int idx = blockIdx.x * PQC_BLOCK + threadIdx.x; /* j*K + c */\n"
"    if (idx >= m * K) return;\n"
"    int j = idx / K;\n"
"    int d_h = m * d_sub;\n"
"    const float *cr = centroids + kv * cent_head_stride + (pqc_i64)idx * d_sub;\n"
"    const float *qk = q + kv * q_head_stride;\n"
"    float sum = 0.0f;\n"
"    for (int h = 0; h < g; ++h) {\n"
"        const float *qh = qk + (pqc_i64)h * d_h;\n"
"        float acc = 0.0f;\n"
"        for (int e = 0; e < d_sub; ++e) acc = fmaf(qh[pqc_sub_dim(j, e, d_sub, d_h, half)], cr[e], acc);\n"
"        if (lut) lut[kv * lut_head_stride + (pqc_i64)h * m * K + idx] = acc;\n"
"        sum += acc;\n"
"    }\n"
"    if (lut_sum) lut_sum[kv * lut_sum_head_stride + idx] = sum;\n"
"}\n"
"\n"
"/* pqc_lut_sum: the GQA \"sum\" table from the g tables of each KV head, for tables built\n"
" * elsewhere (the batched cuBLASLt path).\n"
" *   grid  (ceil(m*K / 256), n_kv), block 256; one thread per (sub-space j, centroid c).\n"
" *   lut_sum[j][c] = sum over h in head order (from 0) of lut[h][j][c]: the additions of\n"
" *   pqc_lut_build, so equal tables give equal sums. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_lut_sum(const float *__restrict__ lut, pqc_i64 lut_head_stride, int g, int tab,\n"
"            float *__restrict__ lut_sum, pqc_i64 lut_sum_head_stride)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int idx = blockIdx.x * PQC_BLOCK + threadIdx.x;\n"
"    if (idx >= tab) return;\n"
"    const float *t = lut + kv * lut_head_stride + idx;\n"
"    float sum = 0.0f;\n"
"    for (int h = 0; h < g; ++h) sum += t[(pqc_i64)h * tab];\n"
"    lut_sum[kv * lut_sum_head_stride + idx] = sum;\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (b) Code scan                                                                        */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* Shared part of the two scan kernels: copies the n_luts tables of this KV head into\n"
"   dynamic shared memory when use_smem is set and returns the table base to read. */\n"
"__device__ __forceinline__ const float *pqc_scan_tables(const float *__restrict__ lut,\n"
"                                                        int n_luts, int m, int K,\n"
"                                                        int use_smem, float *smem)\n"
"{\n"
"    if (!use_smem) return lut;\n"
"    int n = n_luts * m * K;\n"
"    for (int i = threadIdx.x; i < n; i += PQC_BLOCK) smem[i] = lut[i];\n"
"    __syncthreads();\n"
"    return smem;\n"
"}\n"
"\n"
"/* Raw scores of token t for the query heads h0 .. h0+PQC_GROUP-1 (those < n_luts):\n"
"   acc[hh] = sequential sum over j of L[h0+hh][j][code_j(t)], from 0. */\n"
"__device__ __forceinline__ void pqc_score_group(const pqc_u8 *__restrict__ codes,\n"
"                                                pqc_i64 col_stride, pqc_u64 t, int m,\n"
"                                                int b, const float *L, int K, int h0,\n"
"                                                int n_luts, float *acc)\n"
"{\n"
"    pqc_u32 mask = (1u << b) - 1u;\n"
"    int mk = m * K;\n"
"#pragma unroll\n"
"    for (int hh = 0; hh < PQC_GROUP; ++hh) acc[hh] = 0.0f;\n"
"    for (int j = 0; j < m; ++j) {\n"
"        pqc_u32 c = pqc_code_at(codes + (pqc_i64)j * col_stride, t, b, mask);\n"
"        const float *Lj = L + (pqc_i64)h0 * mk + j * K + c;\n"
"#pragma unroll\n"
"        for (int hh = 0; hh < PQC_GROUP; ++hh)\n"
"            if (h0 + hh < n_luts) acc[hh] += Lj[hh * mk];\n"
"    }\n"
"}\n"
"\n"
"/* pqc_scan_stats: first pass of the SOFTMAX_SUM mode: per-block softmax statistics.\n"
" *   grid  (P, n_kv), block 256, any P >= 1 (the host picks it; the same P must be given\n"
" *         to pqc_softmax_finalize as n_parts).\n"
" *   dynamic shared memory: use_smem \? n_luts*m*K*4 bytes : 0 (above 48 KiB the host must\n"
" *         raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, or pass use_smem = 0).\n"
" *   codes  per KV head at codes + kv*code_head_stride; column j at + j*col_stride bytes\n"
" *   lut    float [n_luts][m][K] per KV head\n"
" *   partial float [n_luts][P][2] per KV head: {max, sum of pqc_exp((x - max)*scale)} of the\n"
" *          raw scores x of the tokens this block visited (grid-stride over tokens). */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_scan_stats(const pqc_u8 *__restrict__ codes, pqc_i64 code_head_stride,\n"
"               pqc_i64 col_stride, int s, int m, int b,\n"
"               const float *__restrict__ lut, pqc_i64 lut_head_stride, int n_luts,\n"
"               float scale, float *__restrict__ partial, pqc_i64 partial_head_stride,\n"
"               int use_smem)\n"
"{\n"
"    extern __shared__ float pqc_smem_lut[];\n"
"    __shared__ float red_m[PQC_BLOCK];\n"
"    __shared__ float red_s[PQC_BLOCK];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int K = 1 << b;\n"
"    int tid = threadIdx.x;\n"
"    const pqc_u8 *hc = codes + kv * code_head_stride;\n"
"    const float *L = pqc_scan_tables(lut + kv * lut_head_stride, n_luts, m, K, use_smem,\n"
"                                     pqc_smem_lut);\n"
"    float *part = partial + kv * partial_head_stride;\n"
"    pqc_i64 step = (pqc_i64)gridDim.x * PQC_BLOCK;\n"
"    for (int h0 = 0; h0 < n_luts; h0 += PQC_GROUP) {\n"
"        float mx[PQC_GROUP], sm[PQC_GROUP], acc[PQC_GROUP];\n"
"#pragma unroll\n"
"        for (int hh = 0; hh < PQC_GROUP; ++hh) {\n"
"            mx[hh] = -__int_as_float(0x7f800000);\n"
"            sm[hh] = 0.0f;\n"
"        }\n"
"        for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + tid; t < s; t += step) {\n"
"            pqc_score_group(hc, col_stride, (pqc_u64)t, m, b, L, K, h0, n_luts, acc);\n"
"#pragma unroll\n"
"            for (int hh = 0; hh < PQC_GROUP; ++hh)\n"
"                if (h0 + hh < n_luts) pqc_online_add(mx[hh], sm[hh], acc[hh], scale);\n"
"        }\n"
"#pragma unroll\n"
"        for (int hh = 0; hh < PQC_GROUP; ++hh) {\n"
"            if (h0 + hh >= n_luts) continue; /* uniform across the block */\n"
"            pqc_block_online_reduce(mx[hh], sm[hh], scale, red_m, red_s,\n"
"                                    part + ((pqc_i64)(h0 + hh) * gridDim.x + blockIdx.x) * 2);\n"
"        }\n"
"    }\n"
"}\n"
"\n"
"/* pqc_softmax_finalize: combines the per-block statistics of pqc_scan_stats.\n"
" *   grid (1, n_kv), block 256.\n"
" *   partial float [n_luts][n_parts][2] per KV head (n_parts = P of pqc_scan_stats)\n"
" *   stats   float [n_luts][2] per KV head: {max_h, Z_h} with\n"
" *           Z_h = sum over all tokens of pqc_exp((score_h - max_h) * scale). */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_softmax_finalize(const float *__restrict__ partial, pqc_i64 partial_head_stride,\n"
"                     int n_parts, int n_luts, float scale,\n"
"                     float *__restrict__ stats, pqc_i64 stats_head_stride)\n"
"{\n"
"    __shared__ float red_m[PQC_BLOCK];\n"
"    __shared__ float red_s[PQC_BLOCK];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int tid = threadIdx.x;\n"
"    const float *part = partial + kv * partial_head_stride;\n"
"    for (int h = 0; h < n_luts; ++h) {\n"
"        float mx = -__int_as_float(0x7f800000), sm = 0.0f;\n"
"        for (int p = tid; p < n_parts; p += PQC_BLOCK) {\n"
"            pqc_i64 o = ((pqc_i64)h * n_parts + p) * 2;\n"
"            pqc_online_merge(mx, sm, part[o], part[o + 1], scale);\n"
"        }\n"
"        pqc_block_online_reduce(mx, sm, scale, red_m, red_s, stats + kv * stats_head_stride + 2 * h);\n"
"    }\n"
"}\n"
"\n"
"/* pqc_scan: scores every token from its codes.\n"
" *   grid  (P, n_kv), block 256, any P >= 1 (grid-stride over tokens; one token per thread\n"
" *         per step). Dynamic shared memory as for pqc_scan_stats.\n"
" *   mode PQC_SCAN_RAW (0): out[h*s + t] = raw score of token t under table h, for every\n"
" *         h < n_luts. With the summed table of pqc_lut_build (n_luts = 1) this is the\n"
" *         GQA \"sum\" mode: out[t] = combined score.\n"
" *   mode PQC_SCAN_SOFTMAX_SUM (1): out[t] = fmaf(pqc_exp((score_h(t) - max_h) * scale),\n"
" *         1/Z_h, out[t]) over h in order, from 0, with stats = {max_h, Z_h} per head from\n"
" *         pqc_softmax_finalize ([n_luts][2] per KV head).\n"
" *   out: float per KV head at out + kv*out_head_stride. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_scan(const pqc_u8 *__restrict__ codes, pqc_i64 code_head_stride, pqc_i64 col_stride,\n"
"         int s, int m, int b,\n"
"         const float *__restrict__ lut, pqc_i64 lut_head_stride, int n_luts,\n"
"         int mode, const float *__restrict__ stats, pqc_i64 stats_head_stride, float scale,\n"
"         float *__restrict__ out, pqc_i64 out_head_stride, int use_smem)\n"
"{\n"
"    extern __shared__ float pqc_smem_lut[];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int K = 1 << b;\n"
"    const pqc_u8 *hc = codes + kv * code_head_stride;\n"
"    const float *L = pqc_scan_tables(lut + kv * lut_head_stride, n_luts, m, K, use_smem,\n"
"                                     pqc_smem_lut);\n"
"    const float *st = stats \? stats + kv * stats_head_stride : stats;\n"
"    float *o = out + kv * out_head_stride;\n"
"    pqc_i64 step = (pqc_i64)gridDim.x * PQC_BLOCK;\n"
"    float acc[PQC_GROUP];\n"
"    for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + threadIdx.x; t < s; t += step) {\n"
"        float comb = 0.0f;\n"
"        for (int h0 = 0; h0 < n_luts; h0 += PQC_GROUP) {\n"
"            pqc_score_group(hc, col_stride, (pqc_u64)t, m, b, L, K, h0, n_luts, acc);\n"
"#pragma unroll\n"
"            for (int hh = 0; hh < PQC_GROUP; ++hh) {\n"
"                int h = h0 + hh;\n"
"                if (h >= n_luts) break;\n"
"                if (mode == PQC_SCAN_SOFTMAX_SUM)\n"
"                    comb = fmaf(pqc_exp((acc[hh] - st[2 * h]) * scale), 1.0f / st[2 * h + 1],\n"
"                                comb);\n"
"                else\n"
"                    o[(pqc_i64)h * s + t] = acc[hh];\n"
"            }\n"
"        }\n"
"        if (mode == PQC_SCAN_SOFTMAX_SUM) o[t] = comb;\n"
"    }\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (c) Top-k: radix select (3 passes of 11, 11, 10 bits) + index-ordered compaction      */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* pqc_topk_pass: one radix-select pass over the keys of the scores.\n"
" *   grid (P, n_kv), block 256, any P >= 1 per launch. Launch pass = 0, 1, 2 in order on one\n"
" *   stream, then pqc_topk_count and pqc_topk_compact.\n"
" *   scores float [s] per KV head (scores + kv*score_head_stride)\n"
" *   hist   uint32 [2048] per KV head (hist + kv*2048), state uint32 [4] per KV head\n"
" *          (state + kv*4). Both must be zero before the first use (cuMemsetD32 once at\n"
" *          allocation); the kernels leave them zero again except state[0..1].\n"
" *   Pass p histograms the bits [21,32), [10,21) or [0,10) of the keys whose higher bits\n"
" *   equal the prefix found so far (shared-memory atomics, then one global atomicAdd per\n"
" *   non-empty bin). The last block to finish (ticket counter state[2]) finds the bin that\n"
" *   holds the k-th largest key, appends it to the prefix and subtracts the keys above it:\n"
" *   after pass 2, state[0] = T (key of the k-th largest score) and state[1] = number of\n"
" *   keys equal to T to take (the lowest-index ones). k is clamped to s; k <= 0 or s <= 0\n"
" *   does nothing. k_head int32 [n_kv] or NULL: head kv takes min(k, k_head[kv]) (the\n"
" *   three kernels must be given the same k and k_head). */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_topk_pass(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,\n"
"              int pass, pqc_u32 *hist, pqc_u32 *state, const int *__restrict__ k_head)\n"
"{\n"
"    __shared__ pqc_u32 sh[PQC_RADIX_BINS];\n"
"    __shared__ pqc_u32 scan_tmp[PQC_WARPS];\n"
"    __shared__ pqc_u32 s_last, s_bin, s_above;\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    k = pqc_head_k(k, k_head, kv);\n"
"    if (k <= 0 || s <= 0) return;\n"
"    int tid = threadIdx.x;\n"
"    const float *sc = scores + kv * score_head_stride;\n"
"    pqc_u32 *hg = hist + kv * PQC_RADIX_BINS;\n"
"    pqc_u32 *st = state + kv * 4;\n"
"    int shift = pass == 0 \? 21 : (pass == 1 \? 10 : 0);\n"
"    int nbits = pass == 2 \? 10 : 11;\n"
"    int hi = shift + nbits; /* 32, 21, 10 */\n"
"    int nbins = 1 << nbits;\n"
"    pqc_u32 prefix = pass == 0 \? 0u : st[0];\n"
"    pqc_u32 krem = pass == 0 \? (pqc_u32)(k < s \? k : s) : st[1];\n"
"\n"
"    for (int i = tid; i < PQC_RADIX_BINS; i += PQC_BLOCK) sh[i] = 0u;\n"
"    __syncthreads();\n"
"    for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + tid; t < s;\n"
"         t += (pqc_i64)gridDim.x * PQC_BLOCK) {\n"
"        pqc_u32 key = pqc_float_key(sc[t]);\n"
"        if (hi == 32 || (key >> hi) == (prefix >> hi))\n"
"            atomicAdd(&sh[(key >> shift) & (pqc_u32)(nbins - 1)], 1u);\n"
"    }\n"
"    __syncthreads();\n"
"    for (int i = tid; i < nbins; i += PQC_BLOCK)\n"
"        if (sh[i]) atomicAdd(&hg[i], sh[i]);\n"
"    __threadfence();\n"
"    __syncthreads();\n"
"    if (tid == 0) s_last = (atomicAdd(&st[2], 1u) == gridDim.x - 1u) \? 1u : 0u;\n"
"    __syncthreads();\n"
"    if (!s_last) return;\n"
"    __threadfence();\n"
"\n"
"    /* Last block: thread tid owns `per` consecutive bins in descending order, starting at\n"
"       bin nbins-1 - tid*per; an exclusive scan gives the count of keys in higher bins. */\n"
"    volatile pqc_u32 *vh = hg;\n"
"    int per = nbins / PQC_BLOCK; /* 8 or 4 */\n"
"    pqc_u32 cnt[8];\n"
"    pqc_u32 mine = 0u;\n"
"#pragma unroll\n"
"    for (int i = 0; i < 8; ++i) {\n"
"        cnt[i] = i < per \? vh[nbins - 1 - (tid * per + i)] : 0u;\n"
"        mine += cnt[i];\n"
"    }\n"
"    if (tid == 0) { s_bin = 0u; s_above = 0u; }\n"
"    pqc_u32 total;\n"
"    pqc_u32 above = pqc_block_exclusive_scan(mine, scan_tmp, &total);\n"
"#pragma unroll\n"
"    for (int i = 0; i < 8; ++i) {\n"
"        if (i < per && above < krem && krem <= above + cnt[i]) {\n"
"            s_bin = (pqc_u32)(nbins - 1 - (tid * per + i));\n"
"            s_above = above;\n"
"        }\n"
"        above += cnt[i];\n"
"    }\n"
"    __syncthreads();\n"
"    for (int i = tid; i < PQC_RADIX_BINS; i += PQC_BLOCK) hg[i] = 0u;\n"
"    if (tid == 0) {\n"
"        st[0] = prefix | (s_bin << shift);\n"
"        st[1] = krem - s_above;\n"
"        st[2] = 0u;\n"
"    }\n"
"}\n"
"\n"
"/* pqc_topk_count: per-tile counts of keys above and equal to the threshold T.\n"
" *   grid (ceil(s / 4096), n_kv) exactly, block 256 (tile of 4096 tokens per block).\n"
" *   counts uint32 [n_tiles][2] per KV head: {#key > T, #key == T}. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_topk_count(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,\n"
"               const pqc_u32 *__restrict__ state, pqc_u32 *__restrict__ counts,\n"
"               pqc_i64 counts_head_stride, const int *__restrict__ k_head)\n"
"{\n"
"    __shared__ pqc_u32 scan_tmp[PQC_WARPS];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    k = pqc_head_k(k, k_head, kv);\n"
"    if (k <= 0 || s <= 0) return;\n"
"    const float *sc = scores + kv * score_head_stride;\n"
"    pqc_u32 T = state[kv * 4];\n"
"    pqc_u32 gt = 0u, eq = 0u;\n"
"    pqc_i64 base = (pqc_i64)blockIdx.x * PQC_TOPK_TILE;\n"
"    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {\n"
"        pqc_i64 t = base + i * PQC_BLOCK + threadIdx.x;\n"
"        if (t < s) {\n"
"            pqc_u32 key = pqc_float_key(sc[t]);\n"
"            gt += key > T;\n"
"            eq += key == T;\n"
"        }\n"
"    }\n"
"    pqc_u32 tgt, teq;\n"
"    pqc_block_exclusive_scan(gt, scan_tmp, &tgt);\n"
"    pqc_block_exclusive_scan(eq, scan_tmp, &teq);\n"
"    if (threadIdx.x == 0) {\n"
"        counts[kv * counts_head_stride + 2 * (pqc_i64)blockIdx.x] = tgt;\n"
"        counts[kv * counts_head_stride + 2 * (pqc_i64)blockIdx.x + 1] = teq;\n"
"    }\n"
"}\n"
"\n"
"/* pqc_topk_compact: writes the selected token indices in ascending order.\n"
" *   grid (ceil(s / 4096), n_kv) exactly (same tiles as pqc_topk_count), block 256.\n"
" *   Selected: key > T, or key == T and fewer than state[1] equal keys precede it.\n"
" *   out_idx    int32 [min(k, s)] per KV head (out_idx + kv*idx_head_stride)\n"
" *   out_scores float [min(k, s)] per KV head, or NULL: the selected scores.\n"
" *   Each block adds up the counts of the tiles before it, ranks its own tokens with two\n"
" *   block-wide prefix sums (thread i owns tokens tile*4096 + i*16 .. +15) and writes them\n"
" *   at their final positions. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_topk_compact(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,\n"
"                 const pqc_u32 *__restrict__ state, const pqc_u32 *__restrict__ counts,\n"
"                 pqc_i64 counts_head_stride, int *__restrict__ out_idx,\n"
"                 pqc_i64 idx_head_stride, float *__restrict__ out_scores,\n"
"                 pqc_i64 scores_out_head_stride, const int *__restrict__ k_head)\n"
"{\n"
"    /* tile of keys, padded by one word per 32 so that thread-contiguous reads are\n"
"       free of bank conflicts */\n"
"    __shared__ pqc_u32 tile[PQC_TOPK_TILE + PQC_TOPK_TILE / 32];\n"
"    __shared__ pqc_u32 scan_tmp[PQC_WARPS];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    k = pqc_head_k(k, k_head, kv);\n"
"    if (k <= 0 || s <= 0) return;\n"
"    int tid = threadIdx.x;\n"
"    const float *sc = scores + kv * score_head_stride;\n"
"    const pqc_u32 *cn = counts + kv * counts_head_stride;\n"
"    pqc_u32 T = state[kv * 4];\n"
"    pqc_u32 k_eq = state[kv * 4 + 1];\n"
"\n"
"    /* counts of the tiles before this one */\n"
"    pqc_u32 gt_b = 0u, eq_b = 0u;\n"
"    for (int i = tid; i < (int)blockIdx.x; i += PQC_BLOCK) {\n"
"        gt_b += cn[2 * i];\n"
"        eq_b += cn[2 * i + 1];\n"
"    }\n"
"    pqc_u32 gt_before, eq_before;\n"
"    pqc_block_exclusive_scan(gt_b, scan_tmp, &gt_before);\n"
"    pqc_block_exclusive_scan(eq_b, scan_tmp, &eq_before);\n"
"\n"
"    pqc_i64 base = (pqc_i64)blockIdx.x * PQC_TOPK_TILE;\n"
"    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {\n"
"        int p = i * PQC_BLOCK + tid;\n"
"        pqc_i64 t = base + p;\n"
"        tile[p + (p >> 5)] = t < s \? pqc_float_key(sc[t]) : 0u;\n"
"    }\n"
"    __syncthreads();\n"
"\n"
"    int p0 = tid * PQC_TOPK_ITEMS;\n"
"    pqc_u32 n_eq = 0u;\n"
"    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {\n"
"        int p = p0 + i;\n"
"        if (base + p < s && tile[p + (p >> 5)] == T) ++n_eq;\n"
"    }\n"
"    pqc_u32 unused;\n"
"    pqc_u32 eq_rank = eq_before + pqc_block_exclusive_scan(n_eq, scan_tmp, &unused);\n"
"    pqc_u32 n_sel = 0u;\n"
"    pqc_u32 r = eq_rank;\n"
"    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {\n"
"        int p = p0 + i;\n"
"        if (base + p >= s) break;\n"
"        pqc_u32 key = tile[p + (p >> 5)];\n"
"        if (key > T) ++n_sel;\n"
"        else if (key == T) { if (r < k_eq) ++n_sel; ++r; }\n"
"    }\n"
"    pqc_u32 taken_before = gt_before + (eq_before < k_eq \? eq_before : k_eq);\n"
"    pqc_u32 pos = taken_before + pqc_block_exclusive_scan(n_sel, scan_tmp, &unused);\n"
"    int *oi = out_idx + kv * idx_head_stride;\n"
"    float *os = out_scores \? out_scores + kv * scores_out_head_stride : out_scores;\n"
"    r = eq_rank;\n"
"    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {\n"
"        int p = p0 + i;\n"
"        pqc_i64 t = base + p;\n"
"        if (t >= s) break;\n"
"        pqc_u32 key = tile[p + (p >> 5)];\n"
"        int take = 0;\n"
"        if (key > T) take = 1;\n"
"        else if (key == T) { take = r < k_eq; ++r; }\n"
"        if (take) {\n"
"            oi[pos] = (int)t;\n"
"            if (os) os[pos] = sc[t];\n"
"            ++pos;\n"
"        }\n"
"    }\n"
"}\n"
"\n"
"/* Re-ranking on the device: each head's PQ candidates (a top-k of the codes, the k per\n"
"   head given) scored again with the stored keys (in mapped host memory, or the device's\n"
"   copy of their block), as the CPU library's pqc_rerank scores them (the same operations\n"
"   in the same order), then the top-k of those scores (the kernels above) and\n"
"   pqc_take_at. */\n"
"\n"
"/* The pool slot of a head's block b, where a decode step's gather reads its rows: a sink\n"
"   block (b < sink_slots: slot b), the window's ring ((b + 1) * bt > mid_end), or with a\n"
"   block cache a block it holds whole (so: the head's slot_of table, fl: its slots'\n"
"   filled rows); -1: host memory alone holds the block. */\n"
"__device__ __forceinline__ int pqc_block_slot(pqc_i64 b, int bt, int mid_end, int sink_slots, int ring_slots,\n"
"                                              int cache_blocks, const int *so, const pqc_u32 *fl)\n"
"{\n"
"    if (b < sink_slots) return (int)b;\n"
"    if ((b + 1) * bt > mid_end) return sink_slots + (int)((b - sink_slots) % ring_slots);\n"
"    if (cache_blocks > 0 && so[b] >= 0 && fl[so[b]] >= (pqc_u32)bt) return sink_slots + ring_slots + so[b];\n"
"    return -1;\n"
"}\n"
"\n"
"/* pqc_rerank_dots: the exact dots of every query head of a KV head with the key rows of\n"
" *   its candidates, one warp per candidate.\n"
" *   grid (ceil(n / 8), n_kv), block 256.\n"
" *   cand   int32 per KV head (+ kv*cand_head_stride): coded token indices; candidate c is\n"
" *          the key row of token n_sink + c; n_cand int32 [n_kv]: head kv scores the first\n"
" *          n_cand[kv] (at most n)\n"
" *   q      float [g][d_h] per KV head (+ kv*q_head_stride)\n"
" *   host_k, pre_k, split, host_head_stride, pre_head_stride, host_ld, host_dtype: the key\n"
" *          rows, laid out as for pqc_gather_kv\n"
" *   block_tokens .. pool_head_stride: the rows the device holds are read there instead,\n"
" *          as the gather reads them (pqc_block_slot, over the bookkeeping's tables per\n"
" *          head: slot_of + kv*blk_head_stride, filled + kv*slot_head_stride); pool_k laid\n"
" *          out as the gather's cache_k, in host_dtype\n"
" *   stat   uint64 [n_kv][3] or NULL: stat[kv*3 + 2] gains row_bytes for each row read\n"
" *          from host memory\n"
" *   dots   float per KV head (+ kv*dots_head_stride): head h's dot with candidate i at\n"
" *          h*dots_row_stride + i\n"
" * A dot is the CPU's pqc__rowdots: 16 interleaved lanes (lane e % 16) of sequential fmaf\n"
" * over the dims from 0, then the lanes added in order from 0. Here lane l of each half\n"
" * warp takes dims e = l (mod 16), the half warps take every other head, 16 heads at a time. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rerank_dots(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand, int n,\n"
"                int n_sink, const float *__restrict__ q, pqc_i64 q_head_stride, int g,\n"
"                const void *host_k, pqc_i64 host_head_stride, const void *pre_k, pqc_i64 pre_head_stride,\n"
"                pqc_i64 split, pqc_i64 host_ld, int host_dtype, int d_h, int block_tokens, int mid_end,\n"
"                int sink_slots, int ring_slots, int cache_blocks, const int *__restrict__ slot_of,\n"
"                pqc_i64 blk_head_stride, const pqc_u32 *__restrict__ filled, pqc_i64 slot_head_stride,\n"
"                const void *pool_k, pqc_i64 pool_head_stride, pqc_u64 *stat, pqc_u64 row_bytes,\n"
"                float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride)\n"
"{\n"
"    __shared__ float red[PQC_WARPS][32][8];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int w = threadIdx.x >> 5, lane = threadIdx.x & 31, l = lane & 15, hf = lane >> 4;\n"
"    int i = blockIdx.x * PQC_WARPS + w, nc = n_cand[kv] < n \? n_cand[kv] : n;\n"
"    if (i >= nc) return;\n"
"    pqc_i64 t = (pqc_i64)cand[kv * cand_head_stride + i] + n_sink;\n"
"    pqc_i64 sl = pqc_block_slot(t / block_tokens, block_tokens, mid_end, sink_slots, ring_slots, cache_blocks,\n"
"                                slot_of + kv * blk_head_stride, filled + kv * slot_head_stride);\n"
"    const char *row;\n"
"    if (sl >= 0) {\n"
"        row = (const char *)pool_k +\n"
"              (kv * pool_head_stride + (sl * block_tokens + t % block_tokens) * d_h) * pqc_dtype_size(host_dtype);\n"
"    } else {\n"
"        int pre = t < split;\n"
"        row = (const char *)(pre \? pre_k : host_k) +\n"
"              (kv * (pre \? pre_head_stride : host_head_stride) + (pre \? t : t - split) * host_ld) *\n"
"                  pqc_dtype_size(host_dtype);\n"
"        if (stat && lane == 0) atomicAdd(&stat[kv * 3 + 2], row_bytes);\n"
"    }\n"
"    const float *qk = q + kv * q_head_stride;\n"
"    float *out = dots + kv * dots_head_stride + i;\n"
"    for (int h0 = 0; h0 < g; h0 += 16) {\n"
"        float acc[8];\n"
"#pragma unroll\n"
"        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;\n"
"        for (int e = l; e < d_h; e += 16) {\n"
"            float x = pqc_load_elem(row, e, host_dtype);\n"
"#pragma unroll\n"
"            for (int j = 0; j < 8; ++j) {\n"
"                int h = h0 + hf + 2 * j;\n"
"                if (h < g) acc[j] = fmaf(qk[(pqc_i64)h * d_h + e], x, acc[j]);\n"
"            }\n"
"        }\n"
"#pragma unroll\n"
"        for (int j = 0; j < 8; ++j) red[w][lane][j] = acc[j];\n"
"        __syncwarp();\n"
"        if (l == 0)\n"
"            for (int j = 0; j < 8; ++j) {\n"
"                int h = h0 + hf + 2 * j;\n"
"                if (h >= g) break;\n"
"                float a = 0.0f;\n"
"                for (int ll = 0; ll < 16; ++ll) a += red[w][hf * 16 + ll][j];\n"
"                out[(pqc_i64)h * dots_row_stride] = a;\n"
"            }\n"
"        __syncwarp();\n"
"    }\n"
"}\n"
"\n"
"#define PQC_RR_CHUNK 512 /* candidates a block holds in shared memory at a time */\n"
"\n"
"/* pqc_rerank_combine: each head's candidates' combined score from the dots, as the CPU's\n"
" *   pqc_rerank combines them.\n"
" *   grid (1, n_kv), block 256.\n"
" *   dots, dots_head_stride, dots_row_stride, n_cand, n: as pqc_rerank_dots; with\n"
" *          softmax-sum they are overwritten with the exponentials\n"
" *   mode   PQC_SCAN_RAW: comb[i] = the heads' dots added in order from 0;\n"
" *          PQC_SCAN_SOFTMAX_SUM: each head's e(i) = pqc_exp((dot - max) * scale) (max over\n"
" *          its candidates), Z = its 16 interleaved lanes (lane i % 16, each in order from\n"
" *          0) added in order from 0, w = 1 / Z into wbuf [g] per KV head (+ kv*g), and\n"
" *          comb[i] = fmaf(e_h(i), w_h, .) over the heads in order from 0\n"
" *   comb   float [n] per KV head (+ kv*comb_head_stride); entries n_cand[kv] - nf..n-1\n"
" *          get -infinity, below every score (the dots of finite rows are finite), so that\n"
" *          a top-k of at most n_cand[kv] - nf never takes them\n"
" *   nf     the last nf candidates of each head only join the softmax (a cache's sinks and\n"
" *          window tokens, pqc_rerank_append): scored, never chosen */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rerank_combine(float *dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, const int *__restrict__ n_cand,\n"
"                   int n, int g, int mode, float scale, float *wbuf, float *__restrict__ comb, pqc_i64 comb_head_stride,\n"
"                   int nf)\n"
"{\n"
"    __shared__ float ch[4][PQC_RR_CHUNK];\n"
"    __shared__ float red[PQC_BLOCK];\n"
"    __shared__ float mx[4];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int tid = threadIdx.x, nc = n_cand[kv] < n \? n_cand[kv] : n;\n"
"    float *dk = dots + kv * dots_head_stride, *w = wbuf + kv * g, *cb = comb + kv * comb_head_stride;\n"
"    for (int h0 = 0; mode == PQC_SCAN_SOFTMAX_SUM && h0 < g; h0 += 4) {\n"
"        int gh = g - h0 < 4 \? g - h0 : 4, hh = tid >> 4, l = tid & 15;\n"
"        float z = 0.0f;\n"
"        for (int j = 0; j < gh; ++j) { /* the maxima (the same value in any order) */\n"
"            const float *r = dk + (pqc_i64)(h0 + j) * dots_row_stride;\n"
"            float m = -__int_as_float(0x7f800000);\n"
"            for (int i = tid; i < nc; i += PQC_BLOCK) m = fmaxf(m, r[i]);\n"
"            red[tid] = m;\n"
"            __syncthreads();\n"
"            for (int o = PQC_BLOCK / 2; o > 0; o >>= 1) {\n"
"                if (tid < o) red[tid] = fmaxf(red[tid], red[tid + o]);\n"
"                __syncthreads();\n"
"            }\n"
"            if (tid == 0) mx[j] = red[0];\n"
"            __syncthreads();\n"
"        }\n"
"        for (int c0 = 0; c0 < nc; c0 += PQC_RR_CHUNK) { /* exponentials, then the lanes' sums */\n"
"            int cn = nc - c0 < PQC_RR_CHUNK \? nc - c0 : PQC_RR_CHUNK;\n"
"            for (int x = tid; x < gh * PQC_RR_CHUNK; x += PQC_BLOCK) {\n"
"                int j = x / PQC_RR_CHUNK, i = x % PQC_RR_CHUNK;\n"
"                if (i < cn) {\n"
"                    float *r = dk + (pqc_i64)(h0 + j) * dots_row_stride + c0 + i;\n"
"                    float e = pqc_exp((*r - mx[j]) * scale);\n"
"                    ch[j][i] = e;\n"
"                    *r = e;\n"
"                }\n"
"            }\n"
"            __syncthreads();\n"
"            if (hh < gh)\n"
"                for (int i = l; i < cn; i += 16) z += ch[hh][i];\n"
"            __syncthreads();\n"
"        }\n"
"        red[tid] = z;\n"
"        __syncthreads();\n"
"        if (tid < gh) {\n"
"            float a = 0.0f;\n"
"            for (int ll = 0; ll < 16; ++ll) a += red[tid * 16 + ll];\n"
"            w[h0 + tid] = 1.0f / a;\n"
"        }\n"
"        __syncthreads();\n"
"    }\n"
"    for (int i = tid; i < n; i += PQC_BLOCK) {\n"
"        float a = 0.0f;\n"
"        if (i >= nc - nf) {\n"
"            a = -__int_as_float(0x7f800000);\n"
"        } else if (mode == PQC_SCAN_SOFTMAX_SUM) {\n"
"            for (int h = 0; h < g; ++h) a = fmaf(dk[(pqc_i64)h * dots_row_stride + i], w[h], a);\n"
"        } else {\n"
"            for (int h = 0; h < g; ++h) a += dk[(pqc_i64)h * dots_row_stride + i];\n"
"        }\n"
"        cb[i] = a;\n"
"    }\n"
"}\n"
"\n"
"/* Entries of the ascending x[0..n) below v. */\n"
"__device__ __forceinline__ int pqc_lower_bound(const int *x, int n, int v)\n"
"{\n"
"    int lo = 0, hi = n;\n"
"    while (lo < hi) {\n"
"        int mid = (lo + hi) >> 1;\n"
"        if (x[mid] < v) lo = mid + 1;\n"
"        else hi = mid;\n"
"    }\n"
"    return lo;\n"
"}\n"
"\n"
"/* pqc_rerank_merge: each head's candidates merged with its outlier list, as the CPU\n"
" *   library merges them before re-ranking: both ascending, the list's tokens at or past\n"
" *   `coded` left out, a token in both taken once.\n"
" *   grid (1, n_kv), block 256.\n"
" *   cand  int32 (+ kv*cand_head_stride), n_cand int32 [n_kv]: the candidates\n"
" *   outl  int32 (+ kv*out_head_stride), n_out int32 [n_kv]: the outlier list\n"
" *   kept  int32 scratch (+ kv*kept_head_stride), room for n_out[kv]: the list's tokens\n"
" *         merged in, ascending\n"
" *   merged int32 (+ kv*merged_head_stride), n_merged int32 [n_kv]: the union, ascending.\n"
" * A kept token's place is the kept ones before it plus the candidates below it (a block\n"
" * scan over the list in steps of 256), a candidate's its index plus the kept tokens\n"
" * below it. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rerank_merge(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand,\n"
"                 const int *__restrict__ outl, pqc_i64 out_head_stride, const int *__restrict__ n_out, int coded,\n"
"                 int *__restrict__ kept, pqc_i64 kept_head_stride, int *__restrict__ merged,\n"
"                 pqc_i64 merged_head_stride, int *__restrict__ n_merged)\n"
"{\n"
"    __shared__ pqc_u32 scan_tmp[PQC_WARPS];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int tid = threadIdx.x, nc = n_cand[kv], no = n_out[kv];\n"
"    const int *c = cand + kv * cand_head_stride, *o = outl + kv * out_head_stride;\n"
"    int *kp = kept + kv * kept_head_stride, *m = merged + kv * merged_head_stride;\n"
"    pqc_u32 base = 0;\n"
"    for (int j0 = 0; j0 < no; j0 += PQC_BLOCK) {\n"
"        int j = j0 + tid, v = j < no \? o[j] : 0, below = 0;\n"
"        pqc_u32 keep = 0u, total;\n"
"        if (j < no && v < coded) {\n"
"            below = pqc_lower_bound(c, nc, v);\n"
"            keep = below == nc || c[below] != v;\n"
"        }\n"
"        pqc_u32 before = pqc_block_exclusive_scan(keep, scan_tmp, &total);\n"
"        if (keep) {\n"
"            kp[base + before] = v;\n"
"            m[(int)(base + before) + below] = v;\n"
"        }\n"
"        base += total;\n"
"    }\n"
"    __syncthreads();\n"
"    for (int i = tid; i < nc; i += PQC_BLOCK) m[i + pqc_lower_bound(kp, (int)base, c[i])] = c[i];\n"
"    if (tid == 0) n_merged[kv] = nc + (int)base;\n"
"}\n"
"\n"
"/* pqc_take_at: out[i] = src[pos[i]] for i < k (k per head: k_head[kv], at most n),\n"
" *   per KV head (+ kv*src_head_stride, pos_head_stride, out_head_stride): the candidates\n"
" *   a top-k of their scores kept (pos ascending, so out stays ascending). Entries at or\n"
" *   past `coded` are the window's rivals (pqc_rerank_append: rival r as rbase + r) and\n"
" *   become coded + r, as pqc_select_admit takes them.\n"
" *   grid (ceil(n / 256), n_kv), block 256. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_take_at(const int *__restrict__ src, pqc_i64 src_head_stride, const int *__restrict__ pos,\n"
"            pqc_i64 pos_head_stride, const int *__restrict__ k_head, int n, int *__restrict__ out,\n"
"            pqc_i64 out_head_stride, int coded, int rbase)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, k = pqc_head_k(n, k_head, kv);\n"
"    if (i < k) {\n"
"        int v = src[kv * src_head_stride + pos[kv * pos_head_stride + i]];\n"
"        out[kv * out_head_stride + i] = v >= coded \? coded + (v - rbase) : v;\n"
"    }\n"
"}\n"
"\n"
"/* The token of entry j of a step's window rows: its nx rivals [from, from + nx), the sinks\n"
"   [0, sink), then the window's last tokens [from + nx, ...) (pqc_rival_cands,\n"
"   pqc_rerank_append; the CPU library lists them in the same order). */\n"
"__device__ __forceinline__ int pqc_window_row(int j, int from, int nx, int sink)\n"
"{\n"
"    return j < nx \? from + j : j < nx + sink \? j - nx : from + (j - sink);\n"
"}\n"
"\n"
"/* pqc_rerank_append: each head's candidates (cand + kv*cand_head_stride, n_cand[kv] of\n"
" *   them, coded token indices) copied to out (+ kv*out_head_stride), then the window's nx\n"
" *   rivals [from, from + nx), the sinks [0, sink) and the window's last tokens\n"
" *   [from + nx, n), as pqc_rival_cands lists them (token n_sink + c for entry c): the rows\n"
" *   a cache's exact scoring scores, in the CPU library's order; n_out[kv] gets\n"
" *   n_cand[kv] + n - from + sink.\n"
" *   grid (ceil(most / 256), n_kv), block 256, most: the largest n_out. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rerank_append(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand, int n_sink,\n"
"                  int sink, int from, int nx, int n, int *__restrict__ out, pqc_i64 out_head_stride,\n"
"                  int *__restrict__ n_out)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, nc = n_cand[kv], nxf = n - from + sink;\n"
"    if (i == 0) n_out[kv] = nc + nxf;\n"
"    if (i < nc) {\n"
"        out[kv * out_head_stride + i] = cand[kv * cand_head_stride + i];\n"
"    } else if (i < nc + nxf) {\n"
"        out[kv * out_head_stride + i] = pqc_window_row(i - nc, from, nx, sink) - n_sink;\n"
"    }\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (d) Gather of selected K/V rows and block-cache fill                                  */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* Converts one row of n elements of dtype at src to fp32 at dst, by the 32 lanes of a\n"
"   warp (16-byte loads when the row allows them). */\n"
"__device__ __forceinline__ void pqc_warp_row_to_f32(const void *src, int dtype, int n,\n"
"                                                    float *__restrict__ dst, int lane)\n"
"{\n"
"    int es = pqc_dtype_size(dtype);\n"
"    pqc_u64 nbytes = (pqc_u64)n * es;\n"
"    if ((((pqc_u64)src | nbytes) & 15u) == 0u) {\n"
"        const uint4 *s4 = (const uint4 *)src;\n"
"        int n16 = (int)(nbytes >> 4);\n"
"        for (int c = lane; c < n16; c += 32) {\n"
"            uint4 v = s4[c];\n"
"            if (dtype == PQC_DT_F32) {\n"
"                float *d = dst + 4 * c;\n"
"                d[0] = __uint_as_float(v.x);\n"
"                d[1] = __uint_as_float(v.y);\n"
"                d[2] = __uint_as_float(v.z);\n"
"                d[3] = __uint_as_float(v.w);\n"
"            } else {\n"
"                float *d = dst + 8 * c;\n"
"                pqc_u32 w[4];\n"
"                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;\n"
"#pragma unroll\n"
"                for (int i = 0; i < 4; ++i) {\n"
"                    if (dtype == PQC_DT_F16) {\n"
"                        d[2 * i] = pqc_f16_to_f32(w[i] & 0xffffu);\n"
"                        d[2 * i + 1] = pqc_f16_to_f32(w[i] >> 16);\n"
"                    } else {\n"
"                        d[2 * i] = pqc_bf16_to_f32(w[i] & 0xffffu);\n"
"                        d[2 * i + 1] = pqc_bf16_to_f32(w[i] >> 16);\n"
"                    }\n"
"                }\n"
"            }\n"
"        }\n"
"    } else {\n"
"        for (int e = lane; e < n; e += 32) dst[e] = pqc_load_elem(src, e, dtype);\n"
"    }\n"
"}\n"
"\n"
"/* Copies one row of nbytes bytes by the 32 lanes of a warp (16-byte words when aligned,\n"
"   else 2-byte words; rows are a whole number of 2-byte elements). */\n"
"__device__ __forceinline__ void pqc_warp_row_copy(const void *src, void *dst, pqc_u64 nbytes,\n"
"                                                  int lane)\n"
"{\n"
"    if ((((pqc_u64)src | (pqc_u64)dst | nbytes) & 15u) == 0u) {\n"
"        const uint4 *s4 = (const uint4 *)src;\n"
"        uint4 *d4 = (uint4 *)dst;\n"
"        for (pqc_u64 c = lane; c < (nbytes >> 4); c += 32) d4[c] = s4[c];\n"
"    } else {\n"
"        const pqc_u16 *s2 = (const pqc_u16 *)src;\n"
"        pqc_u16 *d2 = (pqc_u16 *)dst;\n"
"        for (pqc_u64 c = lane; c < (nbytes >> 1); c += 32) d2[c] = s2[c];\n"
"    }\n"
"}\n"
"\n"
"/* pqc_gather_kv: fetches the K and V rows of the selected tokens as fp32.\n"
" *   grid (ceil(n / 8), n_kv), block 256; one warp per selected token.\n"
" *   idx        int32 [n] per KV head: token indices (idx + kv*idx_head_stride)\n"
" *   slot_table int32 per KV head: block (token / block_tokens) -> cache slot, or -1; may\n"
" *              be NULL (everything is a miss)\n"
" *   cache_k/v  [n_slots][block_tokens][d_h] of cache_dtype per KV head\n"
" *              (+ kv*cache_head_stride elements): row of token t in slot p is\n"
" *              p*block_tokens + t % block_tokens\n"
" *   host_k/v   device-accessible pointers to pinned, mapped host memory of host_dtype:\n"
" *              row of token t at + kv*host_head_stride + (t - split)*host_ld elements\n"
" *   pre_k/v    the same for tokens t < split (a forked cache's shared prefix): row at\n"
" *              + kv*pre_head_stride + t*host_ld; unused when split is 0\n"
" *   out_k/v    float [n][d_h] per KV head (+ kv*out_head_stride); either may be NULL to\n"
" *              skip K or V\n"
" *   miss_count uint32 [n_kv] or NULL: incremented once per row read from host memory. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_gather_kv(const int *__restrict__ idx, pqc_i64 idx_head_stride, int n,\n"
"              const int *__restrict__ slot_table, pqc_i64 slot_head_stride, int block_tokens,\n"
"              const void *cache_k, const void *cache_v, pqc_i64 cache_head_stride,\n"
"              int cache_dtype,\n"
"              const void *host_k, const void *host_v, pqc_i64 host_head_stride,\n"
"              const void *pre_k, const void *pre_v, pqc_i64 pre_head_stride, pqc_i64 split,\n"
"              pqc_i64 host_ld, int host_dtype, int d_h,\n"
"              float *out_k, float *out_v, pqc_i64 out_head_stride, pqc_u32 *miss_count)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int lane = threadIdx.x & 31;\n"
"    int i = blockIdx.x * PQC_WARPS + (threadIdx.x >> 5);\n"
"    if (i >= n) return;\n"
"    pqc_i64 t = idx[kv * idx_head_stride + i];\n"
"    int slot = -1;\n"
"    if (slot_table) slot = slot_table[kv * slot_head_stride + t / block_tokens];\n"
"    const char *srck, *srcv;\n"
"    int dt;\n"
"    if (slot >= 0) {\n"
"        pqc_i64 row = (pqc_i64)slot * block_tokens + t % block_tokens;\n"
"        pqc_i64 off = (kv * cache_head_stride + row * d_h) * pqc_dtype_size(cache_dtype);\n"
"        srck = (const char *)cache_k + off;\n"
"        srcv = (const char *)cache_v + off;\n"
"        dt = cache_dtype;\n"
"    } else {\n"
"        int pre = t < split;\n"
"        pqc_i64 off = (kv * (pre \? pre_head_stride : host_head_stride) + (pre \? t : t - split) * host_ld) *\n"
"                      pqc_dtype_size(host_dtype);\n"
"        srck = (const char *)(pre \? pre_k : host_k) + off;\n"
"        srcv = (const char *)(pre \? pre_v : host_v) + off;\n"
"        dt = host_dtype;\n"
"        if (miss_count && lane == 0) atomicAdd(&miss_count[kv], 1u);\n"
"    }\n"
"    pqc_i64 o = kv * out_head_stride + (pqc_i64)i * d_h;\n"
"    if (out_k) pqc_warp_row_to_f32(srck, dt, d_h, out_k + o, lane);\n"
"    if (out_v) pqc_warp_row_to_f32(srcv, dt, d_h, out_v + o, lane);\n"
"}\n"
"\n"
"/* pqc_cache_fill: copies rows [row_lo, block_tokens) of whole blocks of K/V from mapped\n"
" *   host memory into cache slots, keeping the dtype (cache dtype = host dtype).\n"
" *   grid (ceil(n_blocks * (block_tokens - row_lo) / 8), n_kv), block 256; one warp per row.\n"
" *   blocks int32 [n_blocks] block ids, slots int32 [n_blocks] destination slots (same for\n"
" *   every KV head: blocks + kv*list_head_stride, slots + kv*list_head_stride)\n"
" *   row_lo: first row of each block to copy (0: whole blocks; the row of one new token\n"
" *   with n_blocks = 1 appends it)\n"
" *   rows of tokens >= s (a partial last block) are left untouched. Layouts (and the\n"
" *   shared prefix below split) as for pqc_gather_kv; cache_v / host_v may be NULL to\n"
" *   copy K only. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_cache_fill(const int *__restrict__ blocks, const int *__restrict__ slots,\n"
"               pqc_i64 list_head_stride, int n_blocks, int block_tokens, int row_lo, int s,\n"
"               const void *host_k, const void *host_v, pqc_i64 host_head_stride,\n"
"               const void *pre_k, const void *pre_v, pqc_i64 pre_head_stride, pqc_i64 split,\n"
"               pqc_i64 host_ld, int dtype, int d_h,\n"
"               void *cache_k, void *cache_v, pqc_i64 cache_head_stride)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int lane = threadIdx.x & 31;\n"
"    pqc_i64 w = (pqc_i64)blockIdx.x * PQC_WARPS + (threadIdx.x >> 5);\n"
"    int rows = block_tokens - row_lo;\n"
"    if (row_lo < 0 || rows <= 0 || w >= (pqc_i64)n_blocks * rows) return;\n"
"    int bi = (int)(w / rows), r = row_lo + (int)(w % rows);\n"
"    pqc_i64 blk = blocks[kv * list_head_stride + bi];\n"
"    pqc_i64 slot = slots[kv * list_head_stride + bi];\n"
"    pqc_i64 t = blk * block_tokens + r;\n"
"    if (t >= s) return;\n"
"    int es = pqc_dtype_size(dtype), pre = t < split;\n"
"    pqc_i64 src = (kv * (pre \? pre_head_stride : host_head_stride) + (pre \? t : t - split) * host_ld) * es;\n"
"    pqc_i64 dst = (kv * cache_head_stride + (slot * block_tokens + r) * d_h) * es;\n"
"    pqc_u64 nbytes = (pqc_u64)d_h * es;\n"
"    const char *hk = (const char *)(pre \? pre_k : host_k), *hv = (const char *)(pre \? pre_v : host_v);\n"
"    pqc_warp_row_copy(hk + src, (char *)cache_k + dst, nbytes, lane);\n"
"    if (hv && cache_v) pqc_warp_row_copy(hv + src, (char *)cache_v + dst, nbytes, lane);\n"
"}\n"
"\n"
"/* The window competing with the coded tokens (PQC_SPLIT_COMPETE): its rivals, the\n"
" * window's tokens [from, from + nx), then the sinks [0, sink) and the window's last tokens\n"
" * [from + nx, n), nxf = nx + sink + n - from - nx of them, as candidates of\n"
" * pqc_rerank_dots (token n_sink + c for candidate c), one list for every head.\n"
" *   pqc_rival_cands: grid ceil(nxf / 256), block 256; n_cand int32 [n_kv] gets nxf. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rival_cands(int *__restrict__ cand, int *__restrict__ n_cand, int n_kv, int n_sink, int sink, int from, int nx,\n"
"                int n)\n"
"{\n"
"    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, nxf = n - from + sink;\n"
"    if (i < n_kv) n_cand[i] = nxf;\n"
"    if (i >= nxf) return;\n"
"    cand[i] = pqc_window_row(i, from, nx, sink) - n_sink;\n"
"}\n"
"\n"
"/* pqc_rival_stats: the rivals and the other exactly scored tokens join each head's\n"
" *   softmax statistics (pqc_softmax_finalize's {max_h, Z_h}): their online {max, sum}\n"
" *   over the nxf dots of head h (dots + kv*dots_head_stride + h*dots_row_stride), merged\n"
" *   into stats after the coded tokens'. grid (1, n_kv), block 256. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rival_stats(const float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, int nxf, int g,\n"
"                float scale, float *__restrict__ stats, pqc_i64 stats_head_stride)\n"
"{\n"
"    __shared__ float red_m[PQC_BLOCK];\n"
"    __shared__ float red_s[PQC_BLOCK];\n"
"    __shared__ float part[2];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int tid = threadIdx.x;\n"
"    for (int h = 0; h < g; ++h) {\n"
"        const float *x = dots + kv * dots_head_stride + (pqc_i64)h * dots_row_stride;\n"
"        float mx = -__int_as_float(0x7f800000), sm = 0.0f;\n"
"        for (int i = tid; i < nxf; i += PQC_BLOCK) pqc_online_add(mx, sm, x[i], scale);\n"
"        pqc_block_online_reduce(mx, sm, scale, red_m, red_s, part);\n"
"        if (tid == 0) {\n"
"            float *st = stats + kv * stats_head_stride + 2 * h, m1 = st[0], s1 = st[1];\n"
"            pqc_online_merge(m1, s1, part[0], part[1], scale);\n"
"            st[0] = m1;\n"
"            st[1] = s1;\n"
"        }\n"
"        __syncthreads();\n"
"    }\n"
"}\n"
"\n"
"/* pqc_rival_scores: the rivals' scores after the coded tokens', out[s + i] for i < nx\n"
" *   (out + kv*out_head_stride), made from their exact dots as pqc_scan makes a coded\n"
" *   token's from its PQ scores: mode PQC_SCAN_RAW (the summed query) the heads' dots\n"
" *   added in order from 0; PQC_SCAN_SOFTMAX_SUM fmaf(pqc_exp((dot_h - max_h) * scale),\n"
" *   1/Z_h, out) over the heads in order, from 0. grid (ceil(nx / 256), n_kv), block 256. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_rival_scores(const float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, int nx, int g,\n"
"                 int mode, const float *__restrict__ stats, pqc_i64 stats_head_stride, float scale, int s,\n"
"                 float *__restrict__ out, pqc_i64 out_head_stride)\n"
"{\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int i = blockIdx.x * PQC_BLOCK + threadIdx.x;\n"
"    if (i >= nx) return;\n"
"    const float *x = dots + kv * dots_head_stride + i;\n"
"    const float *st = stats \? stats + kv * stats_head_stride : stats;\n"
"    float a = 0.0f;\n"
"    for (int h = 0; h < g; ++h) {\n"
"        float v = x[(pqc_i64)h * dots_row_stride];\n"
"        if (mode == PQC_SCAN_SOFTMAX_SUM) a = fmaf(pqc_exp((v - st[2 * h]) * scale), 1.0f / st[2 * h + 1], a);\n"
"        else a += v;\n"
"    }\n"
"    out[kv * out_head_stride + s + i] = a;\n"
"}\n"
"\n"
"/* Token at position i of a head's decode selection (see pqc_select_admit): the first kc\n"
"   of the take top-k entries are coded tokens, the others rivals (coded + r: window\n"
"   token rfrom + r), placed after the tokens not coded yet. */\n"
"__device__ __forceinline__ int pqc_sel_token(int i, int sink, int take, const int *tk, int n_sink, int unc0,\n"
"                                             int unc, int win0, int kc, int coded, int rfrom)\n"
"{\n"
"    if (i < sink) return i;\n"
"    i -= sink;\n"
"    if (i < kc) return (tk \? tk[i] : i) + n_sink;\n"
"    i -= kc;\n"
"    if (i < unc) return unc0 + i;\n"
"    i -= unc;\n"
"    if (i < take - kc) return rfrom + (tk[kc + i] - coded);\n"
"    return win0 + (i - (take - kc));\n"
"}\n"
"\n"
"/* pqc_select_admit: a decode step's selection and block-cache bookkeeping, per KV head, on\n"
" *   the device: the library's host rules (pqc__select_head, pqc__admit, pqc__victim,\n"
" *   pqc__fetch_account) bit for bit, so that the step needs no host round trip.\n"
" *   grid (1, n_kv), block 256.\n"
" *   Selection of head kv, ascending, into sel (+ kv*sel_head_stride), zeros after it up\n"
" *   to `rows`: the sinks [0, min(n_sink, n)); the top-k, topk[i] + n_sink for i < take\n"
" *   (take = takes[kv]; topk NULL: the coded tokens i + n_sink for i < take); the tokens not\n"
" *   coded yet [n_sink + coded, mid_end); the window [max(mid_end, sinks), n). With rivals\n"
" *   (PQC_SPLIT_COMPETE: the window's first `rivals` tokens competed with the coded ones,\n"
" *   pqc_rival_scores) the top-k's entries from coded on are those rivals (window token\n"
" *   max(mid_end, sinks) + entry - coded), which follow the tokens not coded yet, and the\n"
" *   window is its last n - max(mid_end, sinks) - rivals tokens.\n"
" *   Admission (cache_blocks > 0 and admit_blocks > 0): every mid block's score decays by\n"
" *   0.75 and gains its selected tokens (blocks overlapping the sinks or the window\n"
" *   excepted); up to admit_blocks selected blocks in score order (ties to the lower\n"
" *   block) enter a free slot, or the policy's victim (lfu: lowest score, then oldest\n"
" *   stamp; else oldest stamp; never one stamped step + 1) when their score beats the\n"
" *   victim's by 1.5x + 1; a cached block that grew is topped up.\n"
" *   Per head, block tables (+ kv*blk_head_stride): score f32, slot_of i32 (-1: none),\n"
" *   cnt u32 (zero between calls); slot tables (+ kv*slot_head_stride): block_of i32,\n"
" *   filled u32, touched u32 (zero between calls), freq u64, stamp u64.\n"
" *   Outputs: slot_table i32 (+ kv*table_head_stride), for the blocks of the n tokens: the\n"
" *   pool slot of sink and window blocks and of fully cached blocks, else -1 (pool slots:\n"
" *   sink_slots, ring_slots, then the cache's); fill_b/fill_s/fill_rows (+ kv*\n"
" *   fill_head_stride): the copies to make (block, pool slot, rows new), padded up to\n"
" *   admit_blocks with block ceil(n / block_tokens), which pqc_cache_fill skips;\n"
" *   stat u64 (+ kv*3): hits, misses and bytes host -> device added. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_select_admit(const int *__restrict__ topk, pqc_i64 topk_head_stride, const int *__restrict__ takes,\n"
"                 int n_sink, int coded, int mid_end, int n, int rows, int *__restrict__ sel,\n"
"                 pqc_i64 sel_head_stride, int block_tokens, int sink_slots, int ring_slots, int cache_blocks,\n"
"                 int admit_blocks, int lfu, pqc_u64 step, float *score, int *slot_of, pqc_u32 *cnt,\n"
"                 pqc_i64 blk_head_stride, int *block_of, pqc_u32 *filled, pqc_u32 *touched, pqc_u64 *freq,\n"
"                 pqc_u64 *stamp, pqc_i64 slot_head_stride, int *slot_table, pqc_i64 table_head_stride,\n"
"                 int *fill_b, int *fill_s, int *fill_rows, pqc_i64 fill_head_stride, pqc_u64 *stat,\n"
"                 pqc_u64 row_bytes, int rivals)\n"
"{\n"
"    __shared__ float r_sc[PQC_BLOCK];\n"
"    __shared__ int r_b[PQC_BLOCK];\n"
"    __shared__ int s_stop, s_nf, s_kc;\n"
"    __shared__ pqc_u32 s_hits, s_miss;\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int tid = threadIdx.x, bt = block_tokens;\n"
"    const int *tk = topk \? topk + kv * topk_head_stride : 0;\n"
"    int take = takes[kv];\n"
"    int sink = n_sink < n \? n_sink : n;\n"
"    int unc0 = n_sink + coded, unc = mid_end > unc0 \? mid_end - unc0 : 0;\n"
"    int rfrom = mid_end > sink \? mid_end : sink, win0 = rfrom + rivals, win = n > win0 \? n - win0 : 0;\n"
"    int count = sink + take + unc + win, kc;\n"
"    int nb = (mid_end + bt - 1) / bt, nb_all = (n + bt - 1) / bt;\n"
"    int admit = cache_blocks > 0 && admit_blocks > 0, pool0 = sink_slots + ring_slots;\n"
"    pqc_u64 next = step + 1;\n"
"    int *out = sel + kv * sel_head_stride;\n"
"    float *sc = score + kv * blk_head_stride;\n"
"    int *so = slot_of + kv * blk_head_stride;\n"
"    pqc_u32 *cb = cnt + kv * blk_head_stride;\n"
"    int *bo = block_of + kv * slot_head_stride;\n"
"    pqc_u32 *fl = filled + kv * slot_head_stride, *tc = touched + kv * slot_head_stride;\n"
"    pqc_u64 *fq = freq + kv * slot_head_stride, *stp = stamp + kv * slot_head_stride;\n"
"    int *fb = fill_b + kv * fill_head_stride, *fs = fill_s + kv * fill_head_stride;\n"
"    int *fr = fill_rows + kv * fill_head_stride;\n"
"\n"
"    if (tid == 0) { /* the top-k's coded entries (ascending): those below coded */\n"
"        int lo = 0, hi = take;\n"
"        while (tk && rivals > 0 && lo < hi) {\n"
"            int mid = (lo + hi) / 2;\n"
"            if (tk[mid] < coded) lo = mid + 1;\n"
"            else hi = mid;\n"
"        }\n"
"        s_kc = tk && rivals > 0 \? lo : take;\n"
"    }\n"
"    __syncthreads();\n"
"    kc = s_kc;\n"
"    for (int i = tid; i < rows; i += PQC_BLOCK)\n"
"        out[i] = i < count \? pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom) : 0;\n"
"    if (tid == 0) {\n"
"        s_stop = 0;\n"
"        s_nf = 0;\n"
"        s_hits = 0u;\n"
"        s_miss = 0u;\n"
"    }\n"
"    __syncthreads();\n"
"    if (admit) {\n"
"        for (int b = tid; b < nb; b += PQC_BLOCK) sc[b] = __fmul_rn(sc[b], 0.75f);\n"
"        for (int i = tid; i < count; i += PQC_BLOCK) {\n"
"            int t = pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom), b = t / bt;\n"
"            if (t >= n_sink && t < mid_end && !(b * bt < n_sink || (b + 1) * bt > mid_end)) atomicAdd(&cb[b], 1u);\n"
"        }\n"
"        __syncthreads();\n"
"        for (int b = tid; b < nb; b += PQC_BLOCK) sc[b] = __fadd_rn(sc[b], (float)cb[b]);\n"
"        __syncthreads();\n"
"        for (int a = 0; a < admit_blocks; ++a) {\n"
"            float bs = 0.0f;\n"
"            int bb = nb;\n"
"            for (int b = tid; b < nb; b += PQC_BLOCK)\n"
"                if (cb[b] > 0u && (bb == nb || sc[b] > bs)) {\n"
"                    bb = b;\n"
"                    bs = sc[b];\n"
"                }\n"
"            r_sc[tid] = bs;\n"
"            r_b[tid] = bb;\n"
"            __syncthreads();\n"
"            for (int w = PQC_BLOCK / 2; w > 0; w >>= 1) {\n"
"                if (tid < w) {\n"
"                    int j = tid + w;\n"
"                    if (r_b[j] != nb &&\n"
"                        (r_b[tid] == nb || r_sc[j] > r_sc[tid] || (r_sc[j] == r_sc[tid] && r_b[j] < r_b[tid]))) {\n"
"                        r_sc[tid] = r_sc[j];\n"
"                        r_b[tid] = r_b[j];\n"
"                    }\n"
"                }\n"
"                __syncthreads();\n"
"            }\n"
"            if (tid == 0) {\n"
"                int best = r_b[0], s = -1, go = 1;\n"
"                if (best == nb) {\n"
"                    s_stop = 1;\n"
"                    go = 0;\n"
"                } else {\n"
"                    int valid = mid_end - best * bt < bt \? mid_end - best * bt : bt;\n"
"                    cb[best] = 0u;\n"
"                    s = so[best];\n"
"                    if (s < 0) { /* the victim: a free slot, else by policy */\n"
"                        for (int x = 0; x < cache_blocks; ++x) {\n"
"                            if (bo[x] < 0) {\n"
"                                s = x;\n"
"                                break;\n"
"                            }\n"
"                            if (stp[x] == next) continue;\n"
"                            if (s < 0) {\n"
"                                s = x;\n"
"                            } else if (!lfu) {\n"
"                                if (stp[x] < stp[s]) s = x;\n"
"                            } else {\n"
"                                float va = sc[bo[x]], vb = sc[bo[s]];\n"
"                                if (va < vb || (va == vb && stp[x] < stp[s])) s = x;\n"
"                            }\n"
"                        }\n"
"                        if (s < 0) {\n"
"                            s_stop = 1;\n"
"                            go = 0;\n"
"                        } else if (bo[s] >= 0 && !(sc[best] > __fadd_rn(__fmul_rn(1.5f, sc[bo[s]]), 1.0f))) {\n"
"                            go = 0; /* not worth a copy */\n"
"                        } else {\n"
"                            int f, g = 0;\n"
"                            if (bo[s] >= 0) so[bo[s]] = -1;\n"
"                            for (f = 0; f < s_nf; ++f) /* a copy into this slot listed earlier */\n"
"                                if (fs[f] != pool0 + s) {\n"
"                                    fb[g] = fb[f];\n"
"                                    fs[g] = fs[f];\n"
"                                    fr[g] = fr[f];\n"
"                                    ++g;\n"
"                                }\n"
"                            s_nf = g;\n"
"                            fl[s] = 0u;\n"
"                            bo[s] = best;\n"
"                            so[best] = s;\n"
"                            fq[s] = 0ull;\n"
"                            stp[s] = next;\n"
"                        }\n"
"                    }\n"
"                    if (go && fl[s] < (pqc_u32)valid) {\n"
"                        fb[s_nf] = best;\n"
"                        fs[s_nf] = pool0 + s;\n"
"                        fr[s_nf] = valid - (int)fl[s];\n"
"                        ++s_nf;\n"
"                        fl[s] = (pqc_u32)valid;\n"
"                    }\n"
"                }\n"
"            }\n"
"            __syncthreads();\n"
"            if (s_stop) break;\n"
"        }\n"
"        for (int b = tid; b < nb; b += PQC_BLOCK) cb[b] = 0u;\n"
"    }\n"
"    /* hits: blocks resident by design, cached rows; misses: rows read from host memory */\n"
"    for (int i = tid; i < count; i += PQC_BLOCK) {\n"
"        int t = pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom), b = t / bt, s;\n"
"        if (t < n_sink || t >= mid_end) continue;\n"
"        if (b * bt < n_sink || (b + 1) * bt > mid_end) {\n"
"            atomicAdd(&s_hits, 1u);\n"
"        } else if (admit && (s = so[b]) >= 0 && (pqc_u32)(t % bt) < fl[s]) {\n"
"            tc[s] = 1u;\n"
"            atomicAdd(&s_hits, 1u);\n"
"        } else {\n"
"            atomicAdd(&s_miss, 1u);\n"
"        }\n"
"    }\n"
"    __syncthreads();\n"
"    for (int x = tid; admit && x < cache_blocks; x += PQC_BLOCK)\n"
"        if (tc[x]) {\n"
"            if (stp[x] != next) fq[x] += 1ull;\n"
"            stp[x] = next;\n"
"            tc[x] = 0u;\n"
"        }\n"
"    for (int f = s_nf + tid; f < admit_blocks; f += PQC_BLOCK) {\n"
"        fb[f] = nb_all;\n"
"        fs[f] = 0;\n"
"        fr[f] = 0;\n"
"    }\n"
"    for (int b = tid; b < nb_all; b += PQC_BLOCK) {\n"
"        slot_table[kv * table_head_stride + b] =\n"
"            pqc_block_slot(b, bt, mid_end, sink_slots, ring_slots, cache_blocks, so, fl);\n"
"    }\n"
"    if (tid == 0) {\n"
"        pqc_u64 h2d = (pqc_u64)s_miss * 2ull * row_bytes;\n"
"        for (int f = 0; f < s_nf; ++f) h2d += (pqc_u64)fr[f] * 2ull * row_bytes;\n"
"        stat[kv * 3] += s_hits;\n"
"        stat[kv * 3 + 1] += s_miss;\n"
"        stat[kv * 3 + 2] += h2d;\n"
"    }\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (e) PQ codes of new keys                                                             */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* pqc_centroid_norms: out[r] = sequential fmaf over e of c[r][e]^2, from 0.\n"
" *   grid ceil(rows / 256), block 256; one thread per row of the [rows][d] matrix (for\n"
" *   the codebooks of n_kv heads: rows = n_kv*m*K, d = d_sub). */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_centroid_norms(const float *__restrict__ c, int rows, int d, float *__restrict__ out)\n"
"{\n"
"    int r = blockIdx.x * PQC_BLOCK + threadIdx.x;\n"
"    if (r >= rows) return;\n"
"    const float *cr = c + (pqc_i64)r * d;\n"
"    float nrm = 0.0f;\n"
"    for (int e = 0; e < d; ++e) nrm = fmaf(cr[e], cr[e], nrm);\n"
"    out[r] = nrm;\n"
"}\n"
"\n"
"/* pqc_assign_codes: PQ codes of n new keys (nearest centroid per sub-space).\n"
" *   grid (ceil(n*m / 8), n_kv), block 256; one warp per (token i, sub-space j), i = w / m.\n"
" *   x         n key rows of x_dtype per KV head: row i at x + kv*x_head_stride + i*x_ld\n"
" *             elements (d_h = m*d_sub used); d_sub <= 256; element e of sub-space j is\n"
" *             dim pqc_sub_dim(j, e, d_sub, d_h, half)\n"
" *   centroids float [m][K][d_sub] per KV head; cnorm float [m][K] per KV head\n"
" *             (pqc_centroid_norms) or NULL to compute the norms on the fly\n"
" *   metric    float [d_h] per KV head (+ kv*metric_head_stride, indexed by dim), or NULL:\n"
" *             the weights w\n"
" *             of a weighted distance. The key is multiplied by them (x_e * w_e, one\n"
" *             rounding) before the search, and cnorm must then hold the weighted norms\n"
" *             sum_e (w_e c_e) c_e: the order is that of sum_e w_e (x_e - c_e)^2\n"
" *   codes     packed columns per KV head (codes + kv*code_head_stride, column j at\n"
" *             + j*col_stride): the code of key i is OR-ed (32-bit atomicOr) into the\n"
" *             bits of token t_start + i, which must be zero beforehand; or NULL\n"
" *   codes_out uint8 [n][m] per KV head (+ kv*codes_out_head_stride), or NULL\n"
" *   Distance ||c||^2 - 2 x.c (both sequential fmaf from 0), ties to the lower index. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_assign_codes(const void *x, int x_dtype, pqc_i64 x_ld, pqc_i64 x_head_stride, int n,\n"
"                 const float *__restrict__ centroids, const float *__restrict__ cnorm,\n"
"                 pqc_i64 cent_head_stride, pqc_i64 cnorm_head_stride,\n"
"                 const float *__restrict__ metric, pqc_i64 metric_head_stride,\n"
"                 int m, int b, int d_sub, int half,\n"
"                 pqc_u8 *codes, pqc_i64 code_head_stride, pqc_i64 col_stride, int t_start,\n"
"                 pqc_u8 *codes_out, pqc_i64 codes_out_head_stride)\n"
"{\n"
"    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];\n"
"    pqc_i64 kv = blockIdx.y;\n"
"    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;\n"
"    pqc_i64 w = (pqc_i64)blockIdx.x * PQC_WARPS + wib;\n"
"    if (w >= (pqc_i64)n * m || d_sub > PQC_MAX_DSUB) return; /* whole warp */\n"
"    int i = (int)(w / m), j = (int)(w % m);\n"
"    int K = 1 << b;\n"
"    int d_h = m * d_sub;\n"
"    const void *xr = (const char *)x + (kv * x_head_stride + (pqc_i64)i * x_ld) * pqc_dtype_size(x_dtype);\n"
"    const float *wk = metric \? metric + kv * metric_head_stride : metric;\n"
"    for (int e = lane; e < d_sub; e += 32) {\n"
"        int col = pqc_sub_dim(j, e, d_sub, d_h, half);\n"
"        float xe = pqc_load_elem(xr, col, x_dtype);\n"
"        xs[wib][e] = wk \? xe * wk[col] : xe;\n"
"    }\n"
"    __syncwarp();\n"
"    const float *cen = centroids + kv * cent_head_stride + (pqc_i64)j * K * d_sub;\n"
"    const float *cn = cnorm \? cnorm + kv * cnorm_head_stride + (pqc_i64)j * K : cnorm;\n"
"    float best;\n"
"    int code = pqc_warp_nearest(xs[wib], d_sub, cen, cn, K, &best);\n"
"    if (lane != 0) return;\n"
"    if (codes_out) codes_out[kv * codes_out_head_stride + (pqc_i64)i * m + j] = (pqc_u8)code;\n"
"    if (codes) {\n"
"        pqc_u64 bit = (pqc_u64)((pqc_i64)t_start + i) * (pqc_u64)b;\n"
"        pqc_u64 addr = (pqc_u64)(codes + kv * code_head_stride + (pqc_i64)j * col_stride) +\n"
"                       (bit >> 3);\n"
"        pqc_u32 *word = (pqc_u32 *)(addr & ~(pqc_u64)3);\n"
"        pqc_u64 v = (pqc_u64)code << ((addr & 3u) * 8u + (bit & 7u));\n"
"        atomicOr(word, (pqc_u32)v);\n"
"        if (v >> 32) atomicOr(word + 1, (pqc_u32)(v >> 32));\n"
"    }\n"
"}\n"
"\n"
"/* ------------------------------------------------------------------------------------ */\n"
"/* (f) k-means on the GPU                                                               */\n"
"/* ------------------------------------------------------------------------------------ */\n"
"\n"
"/* pqc_kmeans_assign: one Lloyd assignment step for n_sub independent problems.\n"
" *   grid (ceil(n / 8), n_sub), block 256; one warp per point; d <= 256.\n"
" *   Problem j = blockIdx.y uses the columns [j*d, j*d+d) of the points (row i at\n"
" *   x + i*ld), centroids + j*K*d ([K][d]), cnorm + j*K (or cnorm NULL), and writes\n"
" *   assign + j*n (int32 [n], or NULL), sums + j*K*d (float [K][d], or NULL, atomicAdd of\n"
" *   the assigned points: the order of these additions is not fixed), counts + j*K\n"
" *   (uint32 [K], or NULL), min_dist + j*n (float [n], or NULL: max(0, ||x||^2 + ||c||^2\n"
" *   - 2 x.c) for the chosen centroid). Zero sums and counts before the launch.\n"
" *   Nearest centroid as in pqc_assign_codes. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_kmeans_assign(const float *__restrict__ x, pqc_i64 ld, int n, int d,\n"
"                  const float *__restrict__ centroids, const float *__restrict__ cnorm, int K,\n"
"                  int *__restrict__ assign, float *sums, pqc_u32 *counts,\n"
"                  float *__restrict__ min_dist)\n"
"{\n"
"    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];\n"
"    pqc_i64 j = blockIdx.y;\n"
"    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;\n"
"    pqc_i64 i = (pqc_i64)blockIdx.x * PQC_WARPS + wib;\n"
"    if (i >= n || d > PQC_MAX_DSUB) return; /* whole warp */\n"
"    const float *xr = x + i * ld + j * d;\n"
"    for (int e = lane; e < d; e += 32) xs[wib][e] = xr[e];\n"
"    __syncwarp();\n"
"    const float *cen = centroids + j * K * d;\n"
"    const float *cn = cnorm \? cnorm + j * K : cnorm;\n"
"    float best;\n"
"    int c = pqc_warp_nearest(xs[wib], d, cen, cn, K, &best);\n"
"    if (sums) {\n"
"        float *sr = sums + (j * K + c) * d;\n"
"        for (int e = lane; e < d; e += 32) atomicAdd(&sr[e], xs[wib][e]);\n"
"    }\n"
"    if (lane != 0) return;\n"
"    if (assign) assign[j * n + i] = c;\n"
"    if (counts) atomicAdd(&counts[j * K + c], 1u);\n"
"    if (min_dist) {\n"
"        float xn = 0.0f;\n"
"        for (int e = 0; e < d; ++e) xn = fmaf(xs[wib][e], xs[wib][e], xn);\n"
"        float dd = xn + best;\n"
"        min_dist[j * n + i] = dd > 0.0f \? dd : 0.0f;\n"
"    }\n"
"}\n"
"\n"
"/* pqc_kmeans_assign_dots: the assignment step of pqc_kmeans_assign for one problem from\n"
" *   precomputed dot products (the GEMM path of the library's k-means: dots = X C^T by\n"
" *   cuBLASLt, cnorm by pqc_centroid_norms).\n"
" *   grid ceil(n / 8), block 256; one warp per point, the same layout as pqc_kmeans_assign.\n"
" *   dots      float [n][K]: dots[i*K + c] = x_i . c_c\n"
" *   x         n points of d <= 256 floats, row i at x + i*ld (for the sums and ||x||^2)\n"
" *   cnorm     float [K], ||c||^2\n"
" *   assign, sums, counts, min_dist as in pqc_kmeans_assign (each may be NULL).\n"
" *   Distance ||c||^2 - 2 x.c, ties to the lower index: with dots computed as sequential\n"
" *   fmaf from 0 the result equals pqc_kmeans_assign's bit for bit. */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_kmeans_assign_dots(const float *__restrict__ dots, const float *__restrict__ x, pqc_i64 ld,\n"
"                       int n, int d, const float *__restrict__ cnorm, int K,\n"
"                       int *__restrict__ assign, float *sums, pqc_u32 *counts,\n"
"                       float *__restrict__ min_dist)\n"
"{\n"
"    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];\n"
"    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;\n"
"    pqc_i64 i = (pqc_i64)blockIdx.x * PQC_WARPS + wib;\n"
"    if (i >= n || d > PQC_MAX_DSUB) return; /* whole warp */\n"
"    const float *xr = x + i * ld;\n"
"    for (int e = lane; e < d; e += 32) xs[wib][e] = xr[e];\n"
"    __syncwarp();\n"
"    const float *dr = dots + i * K;\n"
"    float best = __int_as_float(0x7f800000); /* +inf */\n"
"    int besti = 0x7fffffff;\n"
"    for (int c = lane; c < K; c += 32) {\n"
"        float dist = cnorm[c] - 2.0f * dr[c];\n"
"        if (besti == 0x7fffffff || dist < best) { best = dist; besti = c; }\n"
"    }\n"
"    pqc_warp_argmin(best, besti);\n"
"    int c = besti == 0x7fffffff \? 0 : besti;\n"
"    if (sums) {\n"
"        float *sr = sums + (pqc_i64)c * d;\n"
"        for (int e = lane; e < d; e += 32) atomicAdd(&sr[e], xs[wib][e]);\n"
"    }\n"
"    if (lane != 0) return;\n"
"    if (assign) assign[i] = c;\n"
"    if (counts) atomicAdd(&counts[c], 1u);\n"
"    if (min_dist) {\n"
"        float xn = 0.0f;\n"
"        for (int e = 0; e < d; ++e) xn = fmaf(xs[wib][e], xs[wib][e], xn);\n"
"        float dd = xn + best;\n"
"        min_dist[i] = dd > 0.0f \? dd : 0.0f;\n"
"    }\n"
"}\n"
"\n"
"/* pqc_kmeans_update: centroid = sum / count for every cluster with count > 0 (empty\n"
" *   clusters keep their centroid; the host may re-seed them).\n"
" *   grid ceil(rows*d / 256), block 256; one thread per element of the [rows][d]\n"
" *   centroid matrix (rows = n_sub*K). */\n"
"extern \"C\" __global__ void __launch_bounds__(PQC_BLOCK)\n"
"pqc_kmeans_update(float *__restrict__ centroids, const float *__restrict__ sums,\n"
"                  const pqc_u32 *__restrict__ counts, int rows, int d)\n"
"{\n"
"    pqc_i64 e = (pqc_i64)blockIdx.x * PQC_BLOCK + threadIdx.x;\n"
"    if (e >= (pqc_i64)rows * d) return;\n"
"    pqc_u32 cnt = counts[e / d];\n"
"    if (cnt > 0u) centroids[e] = sums[e] / (float)cnt;\n"
"}\n"
;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
/* END EMBEDDED pqcache_kernels.cu */
static const char *pqc__kernels(void) { return pqc__kernel_source; }
#endif

/* =======================================================================================
   16. CUDA loader (optional): run-time loader of the driver API, NVRTC and cuBLASLt, the kernels of
   pqcache_kernels.cu embedded as a string, and the probe/compile entry points. Nothing is
   linked: every library is opened with dlopen, and its absence is a clean CPU fallback.
   ===================================================================================== */
#if PQC__CUDA_LOADER
#ifndef PQC__CU_FRAGMENT_INCLUDED
#define PQC__CU_FRAGMENT_INCLUDED

#if defined(__GNUC__) || defined(__clang__)
#define PQC__CU_FN static __attribute__((unused))
#else
#define PQC__CU_FN static
#endif

/* ------------------------------------------------------------------------------------ */
/* CUDA types and constants used (ABI-compatible stand-ins for those of the headers)     */
/* ------------------------------------------------------------------------------------ */

typedef int pqc__cuResult;                              /* CUresult */
typedef int pqc__cuDevice;                              /* CUdevice */
typedef unsigned long long pqc__cuDeviceptr;            /* CUdeviceptr (64-bit) */
typedef struct pqc__cuContextOpaque *pqc__cuContext;    /* CUcontext */
typedef struct pqc__cuModuleOpaque *pqc__cuModule;      /* CUmodule */
typedef struct pqc__cuFunctionOpaque *pqc__cuFunction;  /* CUfunction */
typedef struct pqc__cuStreamOpaque *pqc__cuStream;      /* CUstream / cudaStream_t */
typedef struct pqc__cuEventOpaque *pqc__cuEvent;        /* CUevent */

typedef int pqc__cuNvrtcResult;                         /* nvrtcResult */
typedef struct pqc__cuNvrtcProgramOpaque *pqc__cuNvrtcProgram; /* nvrtcProgram */

typedef int pqc__cuBlasStatus;                          /* cublasStatus_t */
typedef struct pqc__cuBlasLtOpaque *pqc__cuBlasLtHandle;                /* cublasLtHandle_t */
typedef struct pqc__cuBlasLtDescOpaque *pqc__cuBlasLtMatmulDesc;        /* cublasLtMatmulDesc_t */
typedef struct pqc__cuBlasLtLayoutOpaque *pqc__cuBlasLtMatrixLayout;    /* cublasLtMatrixLayout_t */
typedef struct pqc__cuBlasLtPrefOpaque *pqc__cuBlasLtMatmulPreference;  /* cublasLtMatmulPreference_t */
typedef struct { uint64_t data[8]; } pqc__cuBlasLtMatmulAlgo;           /* cublasLtMatmulAlgo_t */
typedef struct {                                        /* cublasLtMatmulHeuristicResult_t */
    pqc__cuBlasLtMatmulAlgo algo;
    size_t workspaceSize;
    pqc__cuBlasStatus state;
    float wavesCount;
    int reserved[4];
} pqc__cuBlasLtHeuristicResult;

#define PQC__CU_SUCCESS                       0
#define PQC__CU_ERROR_STUB_LIBRARY            34
#define PQC__CU_ERROR_NO_DEVICE               100
#define PQC__CU_ERROR_INSUFFICIENT_DRIVER     35
#define PQC__CU_ATTR_MULTIPROCESSOR_COUNT     16
#define PQC__CU_ATTR_CAN_MAP_HOST_MEMORY      19
#define PQC__CU_ATTR_CC_MAJOR                 75
#define PQC__CU_ATTR_CC_MINOR                 76
#define PQC__CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN 97
#define PQC__CU_FUNC_ATTR_MAX_DYNAMIC_SMEM    8
#define PQC__CU_MEMHOSTALLOC_PORTABLE         0x01
#define PQC__CU_MEMHOSTALLOC_DEVICEMAP        0x02
#define PQC__CU_MEMHOSTREGISTER_PORTABLE      0x01
#define PQC__CU_MEMHOSTREGISTER_DEVICEMAP     0x02
#define PQC__CU_STREAM_NON_BLOCKING           0x01
#define PQC__CU_EVENT_DEFAULT                 0x00
#define PQC__CU_EVENT_DISABLE_TIMING          0x02
#define PQC__CUBLAS_STATUS_SUCCESS            0
#define PQC__CUBLAS_COMPUTE_32F               68
#define PQC__CUBLAS_COMPUTE_32F_PEDANTIC      69
#define PQC__CUDA_R_32F                       0
#define PQC__CUBLAS_OP_N                      0
#define PQC__CUBLAS_OP_T                      1
#define PQC__CUBLASLT_MATMUL_DESC_TRANSA      3
#define PQC__CUBLASLT_MATMUL_DESC_TRANSB      4
#define PQC__CUBLASLT_PREF_MAX_WORKSPACE      1
#define PQC__CUBLASLT_LAYOUT_BATCH_COUNT      5
#define PQC__CUBLASLT_LAYOUT_BATCH_MODE       8
#define PQC__CUBLASLT_BATCH_MODE_POINTER_ARRAY 1

/* Status codes of this loader. */
#define PQC__CU_OK                   0
#define PQC__CU_ERR_NO_DRIVER        1  /* libcuda.so.1 not found */
#define PQC__CU_ERR_DRIVER_SYMBOL    2  /* the driver library lacks a required symbol */
#define PQC__CU_ERR_DRIVER_INIT      3  /* cuInit failed (stub library, old driver, ...) */
#define PQC__CU_ERR_NO_DEVICE        4  /* driver present, no CUDA device */
#define PQC__CU_ERR_NO_NVRTC         5  /* libnvrtc not found */
#define PQC__CU_ERR_NVRTC_SYMBOL     6  /* libnvrtc lacks a required symbol */
#define PQC__CU_ERR_NO_CUBLASLT      7  /* libcublasLt not found */
#define PQC__CU_ERR_CUBLASLT_SYMBOL  8  /* libcublasLt lacks a required symbol */
#define PQC__CU_ERR_COMPILE          9  /* NVRTC rejected the source */
#define PQC__CU_ERR_ARCH             10 /* NVRTC cannot target the device */
#define PQC__CU_ERR_MODULE           11 /* the driver rejected the compiled image */
#define PQC__CU_ERR_CUDA             12 /* a driver call failed */
#define PQC__CU_ERR_ALLOC            13 /* out of host memory / no allocator */
#define PQC__CU_ERR_INVALID          14 /* bad argument, or the table is not loaded */

/* Services the loader needs from its host library. Any member may be NULL: without
   alloc/free nothing can be compiled or cached; without get_env PQC_NVRTC_PATH and the
   default cache directory are ignored; without make_dir the cache directory must exist. */
typedef struct pqc__cuHost {
    void *(*alloc)(size_t size, void *user);
    void (*free)(void *ptr, void *user);
    const char *(*get_env)(const char *name, void *user);
    int (*make_dir)(const char *path, void *user); /* 0 on success or if it exists */
    void *user;
} pqc__cuHost;

/* The function table. Members are named after the exact symbols they come from. */
typedef struct pqc__cuApi {
    void *lib_driver, *lib_nvrtc, *lib_blaslt;
    char driver_path[256], nvrtc_path[256], blaslt_path[256];
    int driver_version;            /* cuDriverGetVersion, e.g. 13000 */
    int device_count;
    int nvrtc_major, nvrtc_minor;  /* nvrtcVersion */
    size_t blaslt_version;         /* cublasLtGetVersion */
    pqc__cuHost host;
    char msg[512];                 /* description of the last failure */

    /* driver API (libcuda) */
    pqc__cuResult (*cuInit)(unsigned int flags);
    pqc__cuResult (*cuDriverGetVersion)(int *version);
    pqc__cuResult (*cuDeviceGetCount)(int *count);
    pqc__cuResult (*cuDeviceGet)(pqc__cuDevice *dev, int ordinal);
    pqc__cuResult (*cuDeviceGetName)(char *name, int len, pqc__cuDevice dev);
    pqc__cuResult (*cuDeviceGetAttribute)(int *value, int attrib, pqc__cuDevice dev);
    pqc__cuResult (*cuDeviceTotalMem_v2)(size_t *bytes, pqc__cuDevice dev);
    pqc__cuResult (*cuDevicePrimaryCtxRetain)(pqc__cuContext *ctx, pqc__cuDevice dev);
    pqc__cuResult (*cuDevicePrimaryCtxRelease_v2)(pqc__cuDevice dev);
    pqc__cuResult (*cuCtxSetCurrent)(pqc__cuContext ctx);
    pqc__cuResult (*cuCtxSynchronize)(void);
    pqc__cuResult (*cuModuleLoadData)(pqc__cuModule *mod, const void *image);
    pqc__cuResult (*cuModuleUnload)(pqc__cuModule mod);
    pqc__cuResult (*cuModuleGetFunction)(pqc__cuFunction *fn, pqc__cuModule mod,
                                         const char *name);
    pqc__cuResult (*cuFuncSetAttribute)(pqc__cuFunction fn, int attrib, int value);
    pqc__cuResult (*cuLaunchKernel)(pqc__cuFunction fn, unsigned int gx, unsigned int gy,
                                    unsigned int gz, unsigned int bx, unsigned int by,
                                    unsigned int bz, unsigned int shared_bytes,
                                    pqc__cuStream stream, void **params, void **extra);
    pqc__cuResult (*cuMemAlloc_v2)(pqc__cuDeviceptr *dptr, size_t bytes);
    pqc__cuResult (*cuMemFree_v2)(pqc__cuDeviceptr dptr);
    pqc__cuResult (*cuMemGetInfo_v2)(size_t *free_bytes, size_t *total_bytes);
    pqc__cuResult (*cuMemHostAlloc)(void **p, size_t bytes, unsigned int flags);
    pqc__cuResult (*cuMemFreeHost)(void *p);
    pqc__cuResult (*cuMemHostGetDevicePointer_v2)(pqc__cuDeviceptr *dptr, void *p,
                                                  unsigned int flags);
    pqc__cuResult (*cuMemHostRegister_v2)(void *p, size_t bytes, unsigned int flags);
    pqc__cuResult (*cuMemHostUnregister)(void *p);
    pqc__cuResult (*cuMemcpyHtoD_v2)(pqc__cuDeviceptr dst, const void *src, size_t bytes);
    pqc__cuResult (*cuMemcpyDtoH_v2)(void *dst, pqc__cuDeviceptr src, size_t bytes);
    pqc__cuResult (*cuMemcpyHtoDAsync_v2)(pqc__cuDeviceptr dst, const void *src, size_t bytes,
                                          pqc__cuStream stream);
    pqc__cuResult (*cuMemcpyDtoHAsync_v2)(void *dst, pqc__cuDeviceptr src, size_t bytes,
                                          pqc__cuStream stream);
    pqc__cuResult (*cuMemcpyDtoDAsync_v2)(pqc__cuDeviceptr dst, pqc__cuDeviceptr src,
                                          size_t bytes, pqc__cuStream stream);
    pqc__cuResult (*cuMemsetD8Async)(pqc__cuDeviceptr dst, unsigned char value, size_t n,
                                     pqc__cuStream stream);
    pqc__cuResult (*cuMemsetD32Async)(pqc__cuDeviceptr dst, unsigned int value, size_t n,
                                      pqc__cuStream stream);
    pqc__cuResult (*cuStreamCreate)(pqc__cuStream *stream, unsigned int flags);
    pqc__cuResult (*cuStreamDestroy_v2)(pqc__cuStream stream);
    pqc__cuResult (*cuStreamSynchronize)(pqc__cuStream stream);
    pqc__cuResult (*cuStreamWaitEvent)(pqc__cuStream stream, pqc__cuEvent ev,
                                       unsigned int flags);
    pqc__cuResult (*cuEventCreate)(pqc__cuEvent *ev, unsigned int flags);
    pqc__cuResult (*cuEventDestroy_v2)(pqc__cuEvent ev);
    pqc__cuResult (*cuEventRecord)(pqc__cuEvent ev, pqc__cuStream stream);
    pqc__cuResult (*cuEventSynchronize)(pqc__cuEvent ev);
    pqc__cuResult (*cuEventQuery)(pqc__cuEvent ev);
    pqc__cuResult (*cuEventElapsedTime)(float *ms, pqc__cuEvent start, pqc__cuEvent end);
    pqc__cuResult (*cuGetErrorString)(pqc__cuResult err, const char **str);
    pqc__cuResult (*cuGetErrorName)(pqc__cuResult err, const char **str);

    /* NVRTC */
    pqc__cuNvrtcResult (*nvrtcVersion)(int *major, int *minor);
    pqc__cuNvrtcResult (*nvrtcGetNumSupportedArchs)(int *n);     /* optional */
    pqc__cuNvrtcResult (*nvrtcGetSupportedArchs)(int *archs);    /* optional */
    pqc__cuNvrtcResult (*nvrtcCreateProgram)(pqc__cuNvrtcProgram *prog, const char *src,
                                             const char *name, int num_headers,
                                             const char *const *headers,
                                             const char *const *include_names);
    pqc__cuNvrtcResult (*nvrtcDestroyProgram)(pqc__cuNvrtcProgram *prog);
    pqc__cuNvrtcResult (*nvrtcCompileProgram)(pqc__cuNvrtcProgram prog, int num_options,
                                              const char *const *options);
    pqc__cuNvrtcResult (*nvrtcGetPTXSize)(pqc__cuNvrtcProgram prog, size_t *size);
    pqc__cuNvrtcResult (*nvrtcGetPTX)(pqc__cuNvrtcProgram prog, char *ptx);
    pqc__cuNvrtcResult (*nvrtcGetCUBINSize)(pqc__cuNvrtcProgram prog, size_t *size); /* optional */
    pqc__cuNvrtcResult (*nvrtcGetCUBIN)(pqc__cuNvrtcProgram prog, char *cubin);      /* optional */
    pqc__cuNvrtcResult (*nvrtcGetProgramLogSize)(pqc__cuNvrtcProgram prog, size_t *size);
    pqc__cuNvrtcResult (*nvrtcGetProgramLog)(pqc__cuNvrtcProgram prog, char *log);
    const char *(*nvrtcGetErrorString)(pqc__cuNvrtcResult result);

    /* cuBLASLt (optional library) */
    pqc__cuBlasStatus (*cublasLtCreate)(pqc__cuBlasLtHandle *handle);
    pqc__cuBlasStatus (*cublasLtDestroy)(pqc__cuBlasLtHandle handle);
    size_t (*cublasLtGetVersion)(void);
    pqc__cuBlasStatus (*cublasLtMatmulDescCreate)(pqc__cuBlasLtMatmulDesc *desc,
                                                  int compute_type, int scale_type);
    pqc__cuBlasStatus (*cublasLtMatmulDescDestroy)(pqc__cuBlasLtMatmulDesc desc);
    pqc__cuBlasStatus (*cublasLtMatmulDescSetAttribute)(pqc__cuBlasLtMatmulDesc desc,
                                                        int attr, const void *buf,
                                                        size_t size);
    pqc__cuBlasStatus (*cublasLtMatrixLayoutCreate)(pqc__cuBlasLtMatrixLayout *layout,
                                                    int type, uint64_t rows, uint64_t cols,
                                                    int64_t ld);
    pqc__cuBlasStatus (*cublasLtMatrixLayoutDestroy)(pqc__cuBlasLtMatrixLayout layout);
    pqc__cuBlasStatus (*cublasLtMatrixLayoutSetAttribute)(pqc__cuBlasLtMatrixLayout layout, int attr,
                                                          const void *buf, size_t size);
    pqc__cuBlasStatus (*cublasLtMatmulPreferenceCreate)(pqc__cuBlasLtMatmulPreference *pref);
    pqc__cuBlasStatus (*cublasLtMatmulPreferenceDestroy)(pqc__cuBlasLtMatmulPreference pref);
    pqc__cuBlasStatus (*cublasLtMatmulPreferenceSetAttribute)(
        pqc__cuBlasLtMatmulPreference pref, int attr, const void *buf, size_t size);
    pqc__cuBlasStatus (*cublasLtMatmulAlgoGetHeuristic)(
        pqc__cuBlasLtHandle handle, pqc__cuBlasLtMatmulDesc desc,
        pqc__cuBlasLtMatrixLayout a, pqc__cuBlasLtMatrixLayout b,
        pqc__cuBlasLtMatrixLayout c, pqc__cuBlasLtMatrixLayout d,
        pqc__cuBlasLtMatmulPreference pref, int requested,
        pqc__cuBlasLtHeuristicResult *results, int *returned);
    pqc__cuBlasStatus (*cublasLtMatmul)(
        pqc__cuBlasLtHandle handle, pqc__cuBlasLtMatmulDesc desc, const void *alpha,
        const void *A, pqc__cuBlasLtMatrixLayout a_desc, const void *B,
        pqc__cuBlasLtMatrixLayout b_desc, const void *beta, const void *C,
        pqc__cuBlasLtMatrixLayout c_desc, void *D, pqc__cuBlasLtMatrixLayout d_desc,
        const pqc__cuBlasLtMatmulAlgo *algo, void *workspace, size_t workspace_bytes,
        pqc__cuStream stream);
} pqc__cuApi;

/* One opened device: its primary context and the properties the backend needs. */
typedef struct pqc__cuDev {
    pqc__cuDevice dev;
    pqc__cuContext ctx;
    int ordinal;
    int cc_major, cc_minor;  /* compute capability */
    int sm_count;
    int can_map_host;        /* mapped pinned memory usable from kernels */
    int smem_optin;          /* max dynamic shared memory per block after opt-in */
    size_t total_mem;
    char name[128];
} pqc__cuDev;

/* dlsym returns void*; ISO C has no conversion to a function pointer, so the object
   representation is copied instead (POSIX guarantees they have the same size). */
typedef char pqc__cu_fnptr_is_pointer_sized[sizeof(void *) == sizeof(void (*)(void)) ? 1 : -1];

typedef struct pqc__cuSym {
    const char *name;
    const char *alt;  /* same signature under another name, or NULL */
    size_t offset;    /* of the member in pqc__cuApi */
    int optional;
} pqc__cuSym;

#define PQC__CU_SYM(member, alt, opt) { #member, alt, offsetof(pqc__cuApi, member), opt }

static const pqc__cuSym pqc__cu_driver_syms[] = {
    PQC__CU_SYM(cuInit, NULL, 0),
    PQC__CU_SYM(cuDriverGetVersion, NULL, 0),
    PQC__CU_SYM(cuDeviceGetCount, NULL, 0),
    PQC__CU_SYM(cuDeviceGet, NULL, 0),
    PQC__CU_SYM(cuDeviceGetName, NULL, 0),
    PQC__CU_SYM(cuDeviceGetAttribute, NULL, 0),
    PQC__CU_SYM(cuDeviceTotalMem_v2, NULL, 0),
    PQC__CU_SYM(cuDevicePrimaryCtxRetain, NULL, 0),
    PQC__CU_SYM(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 0),
    PQC__CU_SYM(cuCtxSetCurrent, NULL, 0),
    PQC__CU_SYM(cuCtxSynchronize, NULL, 0),
    PQC__CU_SYM(cuModuleLoadData, NULL, 0),
    PQC__CU_SYM(cuModuleUnload, NULL, 0),
    PQC__CU_SYM(cuModuleGetFunction, NULL, 0),
    PQC__CU_SYM(cuFuncSetAttribute, NULL, 0),
    PQC__CU_SYM(cuLaunchKernel, NULL, 0),
    PQC__CU_SYM(cuMemAlloc_v2, NULL, 0),
    PQC__CU_SYM(cuMemFree_v2, NULL, 0),
    PQC__CU_SYM(cuMemGetInfo_v2, NULL, 0),
    PQC__CU_SYM(cuMemHostAlloc, NULL, 0),
    PQC__CU_SYM(cuMemFreeHost, NULL, 0),
    PQC__CU_SYM(cuMemHostGetDevicePointer_v2, NULL, 0),
    PQC__CU_SYM(cuMemHostRegister_v2, NULL, 0),
    PQC__CU_SYM(cuMemHostUnregister, NULL, 0),
    PQC__CU_SYM(cuMemcpyHtoD_v2, NULL, 0),
    PQC__CU_SYM(cuMemcpyDtoH_v2, NULL, 0),
    PQC__CU_SYM(cuMemcpyHtoDAsync_v2, NULL, 0),
    PQC__CU_SYM(cuMemcpyDtoHAsync_v2, NULL, 0),
    PQC__CU_SYM(cuMemcpyDtoDAsync_v2, NULL, 0),
    PQC__CU_SYM(cuMemsetD8Async, NULL, 0),
    PQC__CU_SYM(cuMemsetD32Async, NULL, 0),
    PQC__CU_SYM(cuStreamCreate, NULL, 0),
    PQC__CU_SYM(cuStreamDestroy_v2, NULL, 0),
    PQC__CU_SYM(cuStreamSynchronize, NULL, 0),
    PQC__CU_SYM(cuStreamWaitEvent, NULL, 0),
    PQC__CU_SYM(cuEventCreate, NULL, 0),
    PQC__CU_SYM(cuEventDestroy_v2, NULL, 0),
    PQC__CU_SYM(cuEventRecord, NULL, 0),
    PQC__CU_SYM(cuEventSynchronize, NULL, 0),
    PQC__CU_SYM(cuEventQuery, NULL, 0),
    /* cuEventElapsedTime_v2 (CUDA 12.8+) has the same signature as the original */
    { "cuEventElapsedTime_v2", "cuEventElapsedTime", offsetof(pqc__cuApi, cuEventElapsedTime), 0 },
    PQC__CU_SYM(cuGetErrorString, NULL, 0),
    PQC__CU_SYM(cuGetErrorName, NULL, 0)
};

static const pqc__cuSym pqc__cu_nvrtc_syms[] = {
    PQC__CU_SYM(nvrtcVersion, NULL, 0),
    PQC__CU_SYM(nvrtcGetNumSupportedArchs, NULL, 1),
    PQC__CU_SYM(nvrtcGetSupportedArchs, NULL, 1),
    PQC__CU_SYM(nvrtcCreateProgram, NULL, 0),
    PQC__CU_SYM(nvrtcDestroyProgram, NULL, 0),
    PQC__CU_SYM(nvrtcCompileProgram, NULL, 0),
    PQC__CU_SYM(nvrtcGetPTXSize, NULL, 0),
    PQC__CU_SYM(nvrtcGetPTX, NULL, 0),
    PQC__CU_SYM(nvrtcGetCUBINSize, NULL, 1),
    PQC__CU_SYM(nvrtcGetCUBIN, NULL, 1),
    PQC__CU_SYM(nvrtcGetProgramLogSize, NULL, 0),
    PQC__CU_SYM(nvrtcGetProgramLog, NULL, 0),
    PQC__CU_SYM(nvrtcGetErrorString, NULL, 0)
};

static const pqc__cuSym pqc__cu_blaslt_syms[] = {
    PQC__CU_SYM(cublasLtCreate, NULL, 0),
    PQC__CU_SYM(cublasLtDestroy, NULL, 0),
    PQC__CU_SYM(cublasLtGetVersion, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulDescCreate, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulDescDestroy, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulDescSetAttribute, NULL, 0),
    PQC__CU_SYM(cublasLtMatrixLayoutCreate, NULL, 0),
    PQC__CU_SYM(cublasLtMatrixLayoutDestroy, NULL, 0),
    PQC__CU_SYM(cublasLtMatrixLayoutSetAttribute, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulPreferenceCreate, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulPreferenceDestroy, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulPreferenceSetAttribute, NULL, 0),
    PQC__CU_SYM(cublasLtMatmulAlgoGetHeuristic, NULL, 0),
    PQC__CU_SYM(cublasLtMatmul, NULL, 0)
};

#define PQC__CU_COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ------------------------------------------------------------------------------------ */
/* Utilities                                                                            */
/* ------------------------------------------------------------------------------------ */

/* Sets api->msg (printf-style, truncated) and evaluates to status. */
#define PQC__CU_FAIL(api, status, ...) \
    (snprintf((api)->msg, sizeof((api)->msg), __VA_ARGS__), (status))

/* Name of a driver error code ("CUDA_ERROR_OUT_OF_MEMORY"). */
PQC__CU_FN const char *pqc__cu_error_name(pqc__cuApi *api, pqc__cuResult r)
{
    const char *s = NULL;
    if (api->cuGetErrorName && api->cuGetErrorName(r, &s) == PQC__CU_SUCCESS && s) return s;
    return "unknown CUresult";
}

/* Checks a driver result: on failure sets api->msg to "<what>: <name> (<string>)" and
   returns PQC__CU_ERR_CUDA, else PQC__CU_OK. */
PQC__CU_FN int pqc__cu_check(pqc__cuApi *api, pqc__cuResult r, const char *what)
{
    const char *str = NULL;
    if (r == PQC__CU_SUCCESS) return PQC__CU_OK;
    if (api->cuGetErrorString) api->cuGetErrorString(r, &str);
    return PQC__CU_FAIL(api, PQC__CU_ERR_CUDA, "%s failed: %s (%s)", what,
                        pqc__cu_error_name(api, r), str ? str : "no description");
}


PQC__CU_FN void *pqc__cu_alloc(pqc__cuApi *api, size_t n)
{
    return api->host.alloc ? api->host.alloc(n, api->host.user) : NULL;
}

PQC__CU_FN void pqc__cu_free(pqc__cuApi *api, void *p)
{
    if (p && api->host.free) api->host.free(p, api->host.user);
}

PQC__CU_FN const char *pqc__cu_getenv(pqc__cuApi *api, const char *name)
{
    const char *v = api->host.get_env ? api->host.get_env(name, api->host.user) : NULL;
    return v && v[0] ? v : NULL;
}

/* Zeroes the table and records the host services (host may be NULL). */
PQC__CU_FN void pqc__cu_api_init(pqc__cuApi *api, const pqc__cuHost *host)
{
    memset(api, 0, sizeof(*api));
    if (host) api->host = *host;
}

/* ------------------------------------------------------------------------------------ */
/* Library loading                                                                      */
/* ------------------------------------------------------------------------------------ */

/* Resolves syms from lib into api. Returns the first missing required symbol, or NULL
   when all are present (missing optional ones are left NULL). */
PQC__CU_FN const char *pqc__cu_resolve(pqc__cuApi *api, void *lib, const pqc__cuSym *syms,
                                       int n)
{
    int i;
    for (i = 0; i < n; ++i) {
        void *p;
        dlerror();
        p = dlsym(lib, syms[i].name);
        if (!p && syms[i].alt) p = dlsym(lib, syms[i].alt);
        if (!p && !syms[i].optional) return syms[i].name;
        memcpy((char *)api + syms[i].offset, &p, sizeof(p));
    }
    return NULL;
}

/* Clears the members of syms in api. */
PQC__CU_FN void pqc__cu_clear(pqc__cuApi *api, const pqc__cuSym *syms, int n)
{
    int i;
    void *p = NULL;
    for (i = 0; i < n; ++i) memcpy((char *)api + syms[i].offset, &p, sizeof(p));
}

/* dlopens the first of names[0..n) that loads (NULL entries are skipped), copies its
   name into path and returns the handle, or NULL. */
PQC__CU_FN void *pqc__cu_dlopen_first(const char *const *names, int n, char *path,
                                      size_t path_size)
{
    int i;
    for (i = 0; i < n; ++i) {
        void *lib;
        if (!names[i]) continue;
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib) {
            snprintf(path, path_size, "%s", names[i]);
            return lib;
        }
    }
    return NULL;
}

/* Opens the driver library from names[0..n) (the first that loads) and resolves the
   driver table. Does not call cuInit. Fails with PQC__CU_ERR_NO_DRIVER or
   PQC__CU_ERR_DRIVER_SYMBOL (the message names the missing symbol). */
PQC__CU_FN int pqc__cu_open_driver(pqc__cuApi *api, const char *const *names, int n)
{
    const char *missing;
    void *lib = pqc__cu_dlopen_first(names, n, api->driver_path, sizeof(api->driver_path));
    if (!lib)
        return PQC__CU_FAIL(api, PQC__CU_ERR_NO_DRIVER, "no CUDA driver (%s not found)",
                            n > 0 && names[0] ? names[0] : "libcuda.so.1");
    missing = pqc__cu_resolve(api, lib, pqc__cu_driver_syms, PQC__CU_COUNT(pqc__cu_driver_syms));
    if (missing) {
        pqc__cu_clear(api, pqc__cu_driver_syms, PQC__CU_COUNT(pqc__cu_driver_syms));
        dlclose(lib);
        return PQC__CU_FAIL(api, PQC__CU_ERR_DRIVER_SYMBOL,
                            "CUDA driver library %s lacks symbol %s (driver too old?)",
                            api->driver_path, missing);
    }
    api->lib_driver = lib;
    return PQC__CU_OK;
}

/* Opens the driver: $PQC_CUDA_DRIVER_PATH when set, then libcuda.so.1 and libcuda.so. */
PQC__CU_FN int pqc__cu_load_driver(pqc__cuApi *api)
{
    const char *env = pqc__cu_getenv(api, "PQC_CUDA_DRIVER_PATH");
    const char *names[3];
    int n = 0;
    if (env && env[0]) names[n++] = env;
    names[n++] = "libcuda.so.1";
    names[n++] = "libcuda.so";
    return pqc__cu_open_driver(api, names, n);
}

/* cuInit + version + device count. Needs the driver table. */
PQC__CU_FN int pqc__cu_init_driver(pqc__cuApi *api)
{
    pqc__cuResult r;
    if (!api->lib_driver) return PQC__CU_FAIL(api, PQC__CU_ERR_INVALID, "CUDA driver not loaded");
    r = api->cuInit(0);
    if (r == PQC__CU_ERROR_NO_DEVICE) return PQC__CU_FAIL(api, PQC__CU_ERR_NO_DEVICE, "no CUDA device");
    if (r == PQC__CU_ERROR_STUB_LIBRARY)
        return PQC__CU_FAIL(api, PQC__CU_ERR_DRIVER_INIT,
                            "no CUDA driver (%s is the toolkit's stub library)", api->driver_path);
    if (r != PQC__CU_SUCCESS) {
        pqc__cu_check(api, r, "cuInit");
        return PQC__CU_ERR_DRIVER_INIT;
    }
    if (api->cuDriverGetVersion(&api->driver_version) != PQC__CU_SUCCESS) api->driver_version = 0;
    if (api->cuDeviceGetCount(&api->device_count) != PQC__CU_SUCCESS || api->device_count <= 0)
        return PQC__CU_FAIL(api, PQC__CU_ERR_NO_DEVICE, "no CUDA device");
    return PQC__CU_OK;
}

/* Opens NVRTC from names[0..n) and resolves its table; records its version. */
PQC__CU_FN int pqc__cu_open_nvrtc(pqc__cuApi *api, const char *const *names, int n)
{
    const char *missing;
    void *lib = pqc__cu_dlopen_first(names, n, api->nvrtc_path, sizeof(api->nvrtc_path));
    if (!lib)
        return PQC__CU_FAIL(api, PQC__CU_ERR_NO_NVRTC,
                            "NVRTC not found (libnvrtc.so.13, .12 or libnvrtc.so; "
                            "set PQC_NVRTC_PATH to its full path)");
    missing = pqc__cu_resolve(api, lib, pqc__cu_nvrtc_syms, PQC__CU_COUNT(pqc__cu_nvrtc_syms));
    if (missing) {
        pqc__cu_clear(api, pqc__cu_nvrtc_syms, PQC__CU_COUNT(pqc__cu_nvrtc_syms));
        dlclose(lib);
        return PQC__CU_FAIL(api, PQC__CU_ERR_NVRTC_SYMBOL, "NVRTC library %s lacks symbol %s",
                            api->nvrtc_path, missing);
    }
    api->lib_nvrtc = lib;
    if (api->nvrtcVersion(&api->nvrtc_major, &api->nvrtc_minor) != 0) {
        api->nvrtc_major = 0;
        api->nvrtc_minor = 0;
    }
    return PQC__CU_OK;
}

/* Opens NVRTC: $PQC_NVRTC_PATH, then libnvrtc.so.13, .12 and libnvrtc.so on the loader
   path, then the same names in /usr/local/cuda/lib64. */
PQC__CU_FN int pqc__cu_load_nvrtc(pqc__cuApi *api)
{
    const char *names[7];
    names[0] = pqc__cu_getenv(api, "PQC_NVRTC_PATH");
    names[1] = "libnvrtc.so.13";
    names[2] = "libnvrtc.so.12";
    names[3] = "libnvrtc.so";
    names[4] = "/usr/local/cuda/lib64/libnvrtc.so.13";
    names[5] = "/usr/local/cuda/lib64/libnvrtc.so.12";
    names[6] = "/usr/local/cuda/lib64/libnvrtc.so";
    return pqc__cu_open_nvrtc(api, names, 7);
}

/* Opens cuBLASLt from names[0..n) and resolves its table. */
PQC__CU_FN int pqc__cu_open_blaslt(pqc__cuApi *api, const char *const *names, int n)
{
    const char *missing;
    void *lib = pqc__cu_dlopen_first(names, n, api->blaslt_path, sizeof(api->blaslt_path));
    if (!lib)
        return PQC__CU_FAIL(api, PQC__CU_ERR_NO_CUBLASLT,
                            "cuBLASLt not found (libcublasLt.so.13 or .12)");
    missing = pqc__cu_resolve(api, lib, pqc__cu_blaslt_syms, PQC__CU_COUNT(pqc__cu_blaslt_syms));
    if (missing) {
        pqc__cu_clear(api, pqc__cu_blaslt_syms, PQC__CU_COUNT(pqc__cu_blaslt_syms));
        dlclose(lib);
        return PQC__CU_FAIL(api, PQC__CU_ERR_CUBLASLT_SYMBOL,
                            "cuBLASLt library %s lacks symbol %s", api->blaslt_path, missing);
    }
    api->lib_blaslt = lib;
    api->blaslt_version = api->cublasLtGetVersion();
    return PQC__CU_OK;
}

/* Opens cuBLASLt: $PQC_CUBLASLT_PATH alone when set (a library named explicitly is the
   one wanted: when it cannot be opened, cuBLASLt is not used), else its usual names
   (loader path, then /usr/local/cuda/lib64). */
PQC__CU_FN int pqc__cu_load_blaslt(pqc__cuApi *api)
{
    static const char *const names[] = {
        "libcublasLt.so.13", "libcublasLt.so.12",
        "/usr/local/cuda/lib64/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.12"
    };
    const char *env = pqc__cu_getenv(api, "PQC_CUBLASLT_PATH");
    if (env) {
        int st = pqc__cu_open_blaslt(api, &env, 1);
        if (st == PQC__CU_ERR_NO_CUBLASLT)
            snprintf(api->msg, sizeof(api->msg), "cuBLASLt not found (PQC_CUBLASLT_PATH %.200s cannot be opened)",
                     env);
        return st;
    }
    return pqc__cu_open_blaslt(api, names, PQC__CU_COUNT(names));
}

/* Closes every library and clears the table (keeps the host services). */
PQC__CU_FN void pqc__cu_unload(pqc__cuApi *api)
{
    pqc__cuHost host = api->host;
    if (api->lib_blaslt) dlclose(api->lib_blaslt);
    if (api->lib_nvrtc) dlclose(api->lib_nvrtc);
    if (api->lib_driver) dlclose(api->lib_driver);
    pqc__cu_api_init(api, &host);
}

/* Everything the backend needs: driver (loaded and initialised, at least one device)
   and NVRTC; cuBLASLt too when want_blaslt (its absence is then not an error:
   api->lib_blaslt stays NULL). On failure nothing stays loaded and api->msg says why,
   e.g. "no CUDA driver (libcuda.so.1 not found)", "no CUDA device", "NVRTC not found". */
PQC__CU_FN int pqc__cu_load(pqc__cuApi *api, int want_blaslt)
{
    int st = pqc__cu_load_driver(api);
    if (st == PQC__CU_OK) st = pqc__cu_init_driver(api);
    if (st == PQC__CU_OK) st = pqc__cu_load_nvrtc(api);
    if (st != PQC__CU_OK) {
        char msg[sizeof(api->msg)];
        memcpy(msg, api->msg, sizeof(msg));
        pqc__cu_unload(api);
        memcpy(api->msg, msg, sizeof(msg));
        return st;
    }
    if (want_blaslt) pqc__cu_load_blaslt(api);
    api->msg[0] = '\0';
    return PQC__CU_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Devices                                                                              */
/* ------------------------------------------------------------------------------------ */

/* Retains the primary context of device `ordinal`, makes it current on the calling
   thread and reads its properties. Any other thread that calls the driver must first
   make d->ctx current with api->cuCtxSetCurrent. */
PQC__CU_FN int pqc__cu_device_open(pqc__cuApi *api, int ordinal, pqc__cuDev *d)
{
    int st;
    memset(d, 0, sizeof(*d));
    if (!api->lib_driver) return PQC__CU_FAIL(api, PQC__CU_ERR_INVALID, "CUDA driver not loaded");
    if (ordinal < 0 || ordinal >= api->device_count)
        return PQC__CU_FAIL(api, PQC__CU_ERR_NO_DEVICE, "no CUDA device %d (%d present)",
                            ordinal, api->device_count);
    d->ordinal = ordinal;
    if ((st = pqc__cu_check(api, api->cuDeviceGet(&d->dev, ordinal), "cuDeviceGet"))) return st;
    if ((st = pqc__cu_check(api, api->cuDevicePrimaryCtxRetain(&d->ctx, d->dev),
                            "cuDevicePrimaryCtxRetain")))
        return st;
    if ((st = pqc__cu_check(api, api->cuCtxSetCurrent(d->ctx), "cuCtxSetCurrent"))) {
        api->cuDevicePrimaryCtxRelease_v2(d->dev);
        d->ctx = NULL;
        return st;
    }
    api->cuDeviceGetAttribute(&d->cc_major, PQC__CU_ATTR_CC_MAJOR, d->dev);
    api->cuDeviceGetAttribute(&d->cc_minor, PQC__CU_ATTR_CC_MINOR, d->dev);
    api->cuDeviceGetAttribute(&d->sm_count, PQC__CU_ATTR_MULTIPROCESSOR_COUNT, d->dev);
    api->cuDeviceGetAttribute(&d->can_map_host, PQC__CU_ATTR_CAN_MAP_HOST_MEMORY, d->dev);
    api->cuDeviceGetAttribute(&d->smem_optin, PQC__CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN, d->dev);
    api->cuDeviceTotalMem_v2(&d->total_mem, d->dev);
    if (api->cuDeviceGetName(d->name, (int)sizeof(d->name), d->dev) != PQC__CU_SUCCESS)
        snprintf(d->name, sizeof(d->name), "CUDA device %d", ordinal);
    d->name[sizeof(d->name) - 1] = '\0';
    return PQC__CU_OK;
}

/* Releases the primary context retained by pqc__cu_device_open. */
PQC__CU_FN void pqc__cu_device_close(pqc__cuApi *api, pqc__cuDev *d)
{
    if (d->ctx && api->lib_driver) {
        api->cuCtxSetCurrent(NULL);
        api->cuDevicePrimaryCtxRelease_v2(d->dev);
    }
    d->ctx = NULL;
}

/* ------------------------------------------------------------------------------------ */
/* NVRTC compilation                                                                    */
/* ------------------------------------------------------------------------------------ */

/* Chooses what to compile for a device of compute capability cc (major*10 + minor):
   a cubin for sm_cc when NVRTC supports it, else PTX for the newest architecture NVRTC
   supports below cc (the driver JIT-compiles it). */
PQC__CU_FN int pqc__cu_pick_arch(pqc__cuApi *api, int cc, int *arch, int *cubin)
{
    int n = 0, i, best = 0, archs[128];
    if (!api->lib_nvrtc) return PQC__CU_FAIL(api, PQC__CU_ERR_INVALID, "NVRTC not loaded");
    *arch = cc;
    *cubin = api->nvrtcGetCUBIN != NULL;
    if (!api->nvrtcGetNumSupportedArchs || !api->nvrtcGetSupportedArchs) return PQC__CU_OK;
    if (api->nvrtcGetNumSupportedArchs(&n) != 0 || n <= 0 || n > 128) return PQC__CU_OK;
    if (api->nvrtcGetSupportedArchs(archs) != 0) return PQC__CU_OK;
    for (i = 0; i < n; ++i) {
        if (archs[i] == cc) return PQC__CU_OK;
        if (archs[i] < cc && archs[i] > best) best = archs[i];
    }
    if (!best)
        return PQC__CU_FAIL(api, PQC__CU_ERR_ARCH,
                            "NVRTC %d.%d cannot compile for sm_%d (oldest supported: sm_%d)",
                            api->nvrtc_major, api->nvrtc_minor, cc, archs[0]);
    *arch = best;
    *cubin = 0;
    return PQC__CU_OK;
}

/* NVRTC contracts a*b+c into fused operations by default; the kernels must round as the
   CPU library does, so only their explicit fmaf calls may fuse. */
#define PQC__CU_NVRTC_FMAD "--fmad=false"

/* Compiles src with NVRTC for arch (e.g. 90): a cubin (--gpu-architecture=sm_90) when
   cubin is non-zero, else NUL-terminated PTX (--gpu-architecture=compute_90). On success
   *image (from host->alloc; release with pqc__cu_free) and *size are set. The compiler
   log (warnings, errors) is copied into log when log_size > 0, truncated and always
   NUL-terminated. */
PQC__CU_FN int pqc__cu_compile(pqc__cuApi *api, const char *src, const char *name, int arch,
                               int cubin, void **image, size_t *size, char *log,
                               size_t log_size)
{
    pqc__cuNvrtcProgram prog = NULL;
    pqc__cuNvrtcResult r;
    char opt_arch[64];
    const char *opts[3];
    size_t n = 0, lsz = 0;
    int st = PQC__CU_OK;
    void *img;

    *image = NULL;
    *size = 0;
    if (log && log_size) log[0] = '\0';
    if (!api->lib_nvrtc) return PQC__CU_FAIL(api, PQC__CU_ERR_INVALID, "NVRTC not loaded");
    if (cubin && (!api->nvrtcGetCUBINSize || !api->nvrtcGetCUBIN))
        return PQC__CU_FAIL(api, PQC__CU_ERR_ARCH, "this NVRTC cannot produce cubins");
    if (!api->host.alloc) return PQC__CU_FAIL(api, PQC__CU_ERR_ALLOC, "no allocator given");
    snprintf(opt_arch, sizeof(opt_arch), "--gpu-architecture=%s_%d", cubin ? "sm" : "compute",
             arch);
    opts[0] = opt_arch;
    opts[1] = "-DPQC_NVRTC=1";
    opts[2] = PQC__CU_NVRTC_FMAD; /* only the explicit fmaf calls fuse, as on the CPU */

    r = api->nvrtcCreateProgram(&prog, src, name ? name : "pqcache_kernels.cu", 0, NULL, NULL);
    if (r != 0)
        return PQC__CU_FAIL(api, PQC__CU_ERR_COMPILE, "nvrtcCreateProgram failed: %s",
                            api->nvrtcGetErrorString(r));
    r = api->nvrtcCompileProgram(prog, 3, opts);
    if (api->nvrtcGetProgramLogSize(prog, &lsz) == 0 && lsz > 1 && log && log_size) {
        char *full = (char *)pqc__cu_alloc(api, lsz);
        if (full && api->nvrtcGetProgramLog(prog, full) == 0) {
            size_t c = lsz - 1 < log_size - 1 ? lsz - 1 : log_size - 1;
            memcpy(log, full, c);
            log[c] = '\0';
        }
        pqc__cu_free(api, full);
    }
    if (r != 0) {
        st = PQC__CU_FAIL(api, PQC__CU_ERR_COMPILE, "NVRTC %d.%d failed to compile for %s_%d: %s",
                          api->nvrtc_major, api->nvrtc_minor, cubin ? "sm" : "compute", arch,
                          api->nvrtcGetErrorString(r));
        api->nvrtcDestroyProgram(&prog);
        return st;
    }
    r = cubin ? api->nvrtcGetCUBINSize(prog, &n) : api->nvrtcGetPTXSize(prog, &n);
    if (r != 0 || n == 0) {
        api->nvrtcDestroyProgram(&prog);
        return PQC__CU_FAIL(api, PQC__CU_ERR_COMPILE, "NVRTC produced no %s",
                            cubin ? "cubin" : "PTX");
    }
    img = pqc__cu_alloc(api, n);
    if (!img) {
        api->nvrtcDestroyProgram(&prog);
        return PQC__CU_FAIL(api, PQC__CU_ERR_ALLOC, "out of memory (%lu bytes)", (unsigned long)n);
    }
    r = cubin ? api->nvrtcGetCUBIN(prog, (char *)img) : api->nvrtcGetPTX(prog, (char *)img);
    api->nvrtcDestroyProgram(&prog);
    if (r != 0) {
        pqc__cu_free(api, img);
        return PQC__CU_FAIL(api, PQC__CU_ERR_COMPILE, "reading the NVRTC output failed: %s",
                            api->nvrtcGetErrorString(r));
    }
    *image = img;
    *size = n;
    return PQC__CU_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Compiled-image cache on disk                                                         */
/* ------------------------------------------------------------------------------------ */

/* Cache file: 32-byte header ("PQCKIMG1", key, image size, FNV-1a of the image, all
   64-bit little endian) followed by the image. The file name repeats the key, the
   architecture and the NVRTC version so that versions never collide. */
#define PQC__CU_CACHE_MAGIC "PQCKIMG1"

/* Cache key of (source, arch, cubin/PTX, NVRTC version). */
PQC__CU_FN uint64_t pqc__cu_cache_key(const pqc__cuApi *api, const char *src, int arch, int cubin)
{
    int meta[4];
    uint64_t h = pqc__fnv(src, strlen(src), PQC__FNV_OFFSET);
    h = pqc__fnv(PQC__CU_NVRTC_FMAD, strlen(PQC__CU_NVRTC_FMAD), h); /* the options too */
    meta[0] = arch;
    meta[1] = cubin;
    meta[2] = api->nvrtc_major;
    meta[3] = api->nvrtc_minor;
    return pqc__fnv(meta, sizeof(meta), h);
}

/* Makes every missing directory of path with host->make_dir (no-op without it). */
PQC__CU_FN void pqc__cu_make_dirs(pqc__cuApi *api, const char *path)
{
    char buf[512];
    size_t i, n = strlen(path);
    if (!api->host.make_dir || n == 0 || n >= sizeof(buf)) return;
    memcpy(buf, path, n + 1);
    for (i = 1; i <= n; ++i) {
        if (buf[i] == '/' || buf[i] == '\0') {
            char c = buf[i];
            buf[i] = '\0';
            api->host.make_dir(buf, api->host.user);
            buf[i] = c;
        }
    }
}

/* The cache directory: dir when given, else $XDG_CACHE_HOME/pqcache, else
   $HOME/.cache/pqcache (created when host->make_dir is set). Returns 0 when a directory
   was found, -1 when there is none (caching is then skipped). */
PQC__CU_FN int pqc__cu_cache_dir(pqc__cuApi *api, const char *dir, char *out, size_t out_size)
{
    const char *xdg = pqc__cu_getenv(api, "XDG_CACHE_HOME");
    const char *home = pqc__cu_getenv(api, "HOME");
    int n;
    if (dir && dir[0]) n = snprintf(out, out_size, "%s", dir);
    else if (xdg) n = snprintf(out, out_size, "%s/pqcache", xdg);
    else if (home) n = snprintf(out, out_size, "%s/.cache/pqcache", home);
    else return -1;
    if (n <= 0 || (size_t)n >= out_size) return -1;
    pqc__cu_make_dirs(api, out);
    return 0;
}

/* File name of a cached image inside dir. Returns 0, or -1 when it does not fit. */
PQC__CU_FN int pqc__cu_cache_path(const pqc__cuApi *api, const char *dir, uint64_t key, int arch,
                                  int cubin, char *out, size_t out_size)
{
    int n = snprintf(out, out_size, "%s/pqc-%08lx%08lx-%s%d-nvrtc%d.%d.%s", dir,
                     (unsigned long)(key >> 32), (unsigned long)(key & 0xffffffffu),
                     cubin ? "sm" : "compute", arch, api->nvrtc_major, api->nvrtc_minor,
                     cubin ? "cubin" : "ptx");
    return n > 0 && (size_t)n < out_size ? 0 : -1;
}

PQC__CU_FN void pqc__cu_put64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 0; i < 8; ++i) p[i] = (unsigned char)(v >> (8 * i));
}

PQC__CU_FN uint64_t pqc__cu_get64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

/* Reads a cached image. Returns 1 and sets *image (host->alloc) / *size on a valid hit,
   0 when the file is absent, of another key, truncated or corrupt. */
PQC__CU_FN int pqc__cu_cache_read(pqc__cuApi *api, const char *path, uint64_t key, void **image,
                                  size_t *size)
{
    unsigned char hdr[32];
    uint64_t n;
    void *img;
    char why[300];
    FILE *f = pqc__open_regular(path, why, sizeof why);
    *image = NULL;
    *size = 0;
    if (!f) return 0;
    if (fread(hdr, 1, 32, f) != 32 || memcmp(hdr, PQC__CU_CACHE_MAGIC, 8) != 0 ||
        pqc__cu_get64(hdr + 8) != key) {
        fclose(f);
        return 0;
    }
    n = pqc__cu_get64(hdr + 16);
    if (n == 0 || n > ((uint64_t)1 << 30) || !(img = pqc__cu_alloc(api, (size_t)n))) {
        fclose(f);
        return 0;
    }
    if (fread(img, 1, (size_t)n, f) != (size_t)n ||
        pqc__fnv(img, (size_t)n, PQC__FNV_OFFSET) != pqc__cu_get64(hdr + 24)) {
        fclose(f);
        pqc__cu_free(api, img);
        return 0;
    }
    fclose(f);
    *image = img;
    *size = (size_t)n;
    return 1;
}

/* Writes a cached image (to a temporary name, then renamed into place, so that readers
   never see a partial file). Returns 0 on success, -1 on failure (not fatal). */
PQC__CU_FN int pqc__cu_cache_write(pqc__cuApi *api, const char *path, uint64_t key,
                                   const void *image, size_t size)
{
    unsigned char hdr[32];
    char why[300];
    const void *parts[2];
    size_t sizes[2];
    (void)api;
    memcpy(hdr, PQC__CU_CACHE_MAGIC, 8);
    pqc__cu_put64(hdr + 8, key);
    pqc__cu_put64(hdr + 16, (uint64_t)size);
    pqc__cu_put64(hdr + 24, pqc__fnv(image, size, PQC__FNV_OFFSET));
    parts[0] = hdr;
    sizes[0] = 32;
    parts[1] = image;
    sizes[1] = size;
    return pqc__write_atomic(path, parts, sizes, 2, why, sizeof why);
}

/* ------------------------------------------------------------------------------------ */
/* Module                                                                               */
/* ------------------------------------------------------------------------------------ */

/* Builds the kernels of src for device d and loads them: picks the target
   (pqc__cu_pick_arch), looks the image up in the disk cache (cache_dir as for
   pqc__cu_cache_dir; "-" disables the cache), compiles on a miss and stores the result,
   then cuModuleLoadData. *from_cache (may be NULL) tells whether the cache served it.
   The NVRTC log goes to log as for pqc__cu_compile. */
PQC__CU_FN int pqc__cu_build_module(pqc__cuApi *api, const pqc__cuDev *d, const char *src,
                                    const char *cache_dir, pqc__cuModule *module,
                                    int *from_cache, char *log, size_t log_size)
{
    char dir[512], path[600];
    int arch, cubin, st, hit = 0, have_path = 0, attempt;
    uint64_t key;
    void *img = NULL;
    size_t size = 0;
    pqc__cuResult r = PQC__CU_SUCCESS;

    *module = NULL;
    if (from_cache) *from_cache = 0;
    if (log && log_size) log[0] = '\0';
    if (!api->lib_driver || !api->lib_nvrtc)
        return PQC__CU_FAIL(api, PQC__CU_ERR_INVALID, "CUDA driver or NVRTC not loaded");
    st = pqc__cu_pick_arch(api, d->cc_major * 10 + d->cc_minor, &arch, &cubin);
    if (st) return st;
    key = pqc__cu_cache_key(api, src, arch, cubin);
    if (!(cache_dir && strcmp(cache_dir, "-") == 0) &&
        pqc__cu_cache_dir(api, cache_dir, dir, sizeof(dir)) == 0 &&
        pqc__cu_cache_path(api, dir, key, arch, cubin, path, sizeof(path)) == 0)
        have_path = 1;

    for (attempt = 0; attempt < 2; ++attempt) {
        hit = 0;
        if (attempt == 0 && have_path) hit = pqc__cu_cache_read(api, path, key, &img, &size);
        if (!hit) {
            st = pqc__cu_compile(api, src, "pqcache_kernels.cu", arch, cubin, &img, &size, log,
                                 log_size);
            if (st) return st;
            if (have_path) pqc__cu_cache_write(api, path, key, img, size);
        }
        r = api->cuModuleLoadData(module, img);
        pqc__cu_free(api, img);
        img = NULL;
        if (r == PQC__CU_SUCCESS) {
            if (from_cache) *from_cache = hit;
            return PQC__CU_OK;
        }
        *module = NULL;
        if (!hit) break; /* a fresh image was rejected: retrying would not help */
        remove(path);   /* a cached image was rejected: drop it and compile afresh */
    }
    pqc__cu_check(api, r, "cuModuleLoadData");
    return PQC__CU_FAIL(api, PQC__CU_ERR_MODULE,
                        "the CUDA driver (version %d) rejected the kernels compiled by NVRTC "
                        "%d.%d for %s_%d: %s", api->driver_version, api->nvrtc_major,
                        api->nvrtc_minor, cubin ? "sm" : "compute", arch,
                        pqc__cu_error_name(api, r));
}

/* Looks up n kernels by name; fails naming the first one missing from the module. */
PQC__CU_FN int pqc__cu_get_functions(pqc__cuApi *api, pqc__cuModule module,
                                     const char *const *names, pqc__cuFunction *out, int n)
{
    int i;
    for (i = 0; i < n; ++i) {
        pqc__cuResult r = api->cuModuleGetFunction(&out[i], module, names[i]);
        if (r != PQC__CU_SUCCESS)
            return PQC__CU_FAIL(api, PQC__CU_ERR_MODULE, "kernel %s not found in the module: %s",
                                names[i], pqc__cu_error_name(api, r));
    }
    return PQC__CU_OK;
}

#endif /* PQC__CU_FRAGMENT_INCLUDED */


static void *pqc__cu_host_alloc(size_t n, void *u) { return pqc__alloc((const pqc_allocator *)u, n); }
static void pqc__cu_host_free(void *p, void *u) { pqc__free((const pqc_allocator *)u, p); }
static const char *pqc__cu_host_env(const char *name, void *u)
{
    (void)u;
    return getenv(name);
}

/* the kernel cache's directories are created as needed (0755) */
static int pqc__cu_host_mkdir(const char *path, void *u)
{
    (void)u;
    return mkdir(path, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

static void pqc__cu_host(pqc__cuHost *h, const pqc_allocator *a)
{
    memset(h, 0, sizeof *h);
    h->alloc = pqc__cu_host_alloc;
    h->free = pqc__cu_host_free;
    h->get_env = pqc__cu_host_env;
    h->make_dir = pqc__cu_host_mkdir;
    h->user = (void *)a;
}

/* ---------------------------------------------------------------------------------------
   17. CUDA device tier. The runtime opens the device and builds the kernels once; every
   cache on it keeps in device memory: the centroids of every layer, two code buffers
   (the layer being searched and the next one, prefetched on a copy stream), the block
   cache slots together with the sink blocks and a ring of window blocks, and the
   per-step scratch. K/V stay in pinned, mapped host memory, which kernels read directly
   for cache misses. A decode step (pqc_cache_step_device, and pqc_driver_decode) runs
   whole on the cache's stream: tables, scan, top-k, the selection with the block-cache
   admission and statistics (pqc_select_admit, the host's rules bit for bit, on
   bookkeeping that lives on the device), the block copies and the gather; nothing comes
   back to the host unless it takes the rows there (one wait per layer). With exact
   scoring (re-ranking, outlier lists, which go up with the queries and are merged in by
   pqc_rerank_merge) the step also scores each head's candidates with their key rows,
   read from the device's blocks or the mapped host store (pqc_rerank_dots,
   pqc_rerank_combine: pqc_rerank's arithmetic, bit for bit), and keeps the best of them
   (the top-k kernels, pqc_take_at). Selections made on the host (pqc_cache_select:
   residuals, or a caller who wants the indices) read the top-k back once per layer and
   step, and the bookkeeping follows whichever side used it last.
   ------------------------------------------------------------------------------------- */

enum {
    PQC__K_LUT, PQC__K_STATS, PQC__K_FINAL, PQC__K_SCAN, PQC__K_PASS, PQC__K_COUNT, PQC__K_COMPACT,
    PQC__K_GATHER, PQC__K_FILL, PQC__K_ASSIGN, PQC__K_KM_ASSIGN, PQC__K_KM_UPDATE, PQC__K_SELECT_ADMIT,
    PQC__K_KM_DOTS, PQC__K_NORMS, PQC__K_LUT_SUM, PQC__K_RR_DOTS, PQC__K_RR_COMBINE, PQC__K_TAKE_AT,
    PQC__K_RR_MERGE, PQC__K_RIVAL_CANDS, PQC__K_RIVAL_STATS, PQC__K_RIVAL_SCORES, PQC__K_RR_APPEND, PQC__K_N
};
static const char *const pqc__k_names[PQC__K_N] = {
    "pqc_lut_build", "pqc_scan_stats", "pqc_softmax_finalize", "pqc_scan", "pqc_topk_pass",
    "pqc_topk_count", "pqc_topk_compact", "pqc_gather_kv", "pqc_cache_fill", "pqc_assign_codes",
    "pqc_kmeans_assign", "pqc_kmeans_update", "pqc_select_admit", "pqc_kmeans_assign_dots",
    "pqc_centroid_norms", "pqc_lut_sum", "pqc_rerank_dots", "pqc_rerank_combine", "pqc_take_at",
    "pqc_rerank_merge", "pqc_rival_cands", "pqc_rival_stats", "pqc_rival_scores", "pqc_rerank_append"
};

#define PQC__CU_RADIX_BINS 2048
#define PQC__CU_TILE 4096
#define PQC__CU_SMEM_DEFAULT 49152

/* The k-means assignment step has two implementations: the kernel pqc_kmeans_assign,
   and a cuBLASLt GEMM of the dot products X C^T followed by pqc_kmeans_assign_dots.
   Unless PQC_KMEANS_GEMM forces one, the first build of a shape class (n rounded up to
   a power of two, d, k) times both on its own first four assignment steps (alternating,
   the faster of two runs each) and the class keeps the faster for the runtime. */
#define PQC__KM_CLASSES 32
#ifndef PQC__KM_DOTS_BYTES /* (tests set it small to exercise the chunking) */
#define PQC__KM_DOTS_BYTES ((size_t)64 << 20) /* dot products of one GEMM, at most */
#endif

typedef struct pqc__km_class {
    int nlog, d, k; /* n <= 2^nlog */
    int gemm;       /* 1: the GEMM path is faster */
    float ms_kernel, ms_gemm;
} pqc__km_class;

struct pqc__gpu_device {
    pqc__cuApi api;
    pqc__cuDev dev;
    pqc__cuModule mod;
    pqc__cuFunction fn[PQC__K_N];
    int smem_limit; /* dynamic shared memory the scan kernels may use */
    pqc__cuBlasLtHandle lt; /* cuBLASLt (thread safe), or NULL: no GEMM path */
    int km_force;           /* PQC_KMEANS_GEMM: -1 unset (measure), 0 kernel, 1 GEMM */
    int lut_force;          /* PQC_LUT_GEMM: the same for the batched lookup tables */
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_t km_mu;  /* guards km, km_n, km_next (builds run on pool threads) and batch */
#endif
    pqc__km_class km[PQC__KM_CLASSES];
    int km_n, km_next;
    struct pqc__batch_luts *batch;  /* the batched lookup tables' state, made at first use */
};


static pqc_result pqc__gpu_open(pqc_runtime *rt, int ordinal, const char *cache_dir, char *why, size_t why_size)
{
    struct pqc__gpu_device *cr;
    pqc__cuHost host;
    char log[2048];
    int st, from_cache = 0;
    pqc_result res = PQC_ERROR_NO_DEVICE;
    cr = (struct pqc__gpu_device *)pqc__calloc(&rt->alloc, sizeof *cr);
    if (!cr) {
        snprintf(why, why_size, "out of memory");
        return PQC_ERROR_OUT_OF_MEMORY;
    }
    pqc__cu_host(&host, &rt->alloc);
    pqc__cu_api_init(&cr->api, &host);
    cr->km_force = -1;
    cr->lut_force = -1;
    st = pqc__cu_load(&cr->api, 0);
    if (st == PQC__CU_OK) st = pqc__cu_device_open(&cr->api, ordinal, &cr->dev);
    if (st == PQC__CU_OK && !cr->dev.can_map_host) {
        snprintf(cr->api.msg, sizeof cr->api.msg, "%s cannot map host memory", cr->dev.name);
        st = PQC__CU_ERR_NO_DEVICE;
    }
    if (st == PQC__CU_OK) {
        res = PQC_ERROR_BACKEND;
        st = pqc__cu_build_module(&cr->api, &cr->dev, pqc__kernels(), cache_dir, &cr->mod, &from_cache, log,
                                  sizeof log);
        if (st == PQC__CU_ERR_COMPILE && log[0]) {
            size_t n = strlen(cr->api.msg);
            snprintf(cr->api.msg + n, sizeof cr->api.msg - n, "; NVRTC log: %.300s", log);
        }
    }
    if (st == PQC__CU_OK) st = pqc__cu_get_functions(&cr->api, cr->mod, pqc__k_names, cr->fn, PQC__K_N);
    if (st != PQC__CU_OK) {
        snprintf(why, why_size, "%s", cr->api.msg[0] ? cr->api.msg : "CUDA could not be initialised");
        if (cr->mod) cr->api.cuModuleUnload(cr->mod);
        if (cr->dev.ctx) pqc__cu_device_close(&cr->api, &cr->dev);
        pqc__cu_unload(&cr->api);
        pqc__free(&rt->alloc, cr);
        return res;
    }
    /* the scan kernels keep the lookup tables in dynamic shared memory; past the default
       48 KiB they must opt in, leaving room for their own static arrays (2 KiB) */
    cr->smem_limit = PQC__CU_SMEM_DEFAULT;
    if (cr->dev.smem_optin - 8192 > PQC__CU_SMEM_DEFAULT &&
        cr->api.cuFuncSetAttribute(cr->fn[PQC__K_STATS], PQC__CU_FUNC_ATTR_MAX_DYNAMIC_SMEM, cr->dev.smem_optin - 8192) == 0 &&
        cr->api.cuFuncSetAttribute(cr->fn[PQC__K_SCAN], PQC__CU_FUNC_ATTR_MAX_DYNAMIC_SMEM, cr->dev.smem_optin - 8192) == 0)
        cr->smem_limit = cr->dev.smem_optin - 8192;
    {
        /* cuBLASLt, optional: without it the k-means assignment uses its kernel */
        char lt_note[300];
        const char *force = pqc__cu_getenv(&cr->api, "PQC_KMEANS_GEMM");
        const char *lforce = pqc__cu_getenv(&cr->api, "PQC_LUT_GEMM");
        if (pqc__cu_load_blaslt(&cr->api) != PQC__CU_OK) {
            snprintf(lt_note, sizeof lt_note, "no cuBLASLt (%.200s): k-means assignment by its kernel", cr->api.msg);
        } else {
            pqc__cuBlasStatus ls = cr->api.cublasLtCreate(&cr->lt);
            if (ls != PQC__CUBLAS_STATUS_SUCCESS || !cr->lt) {
                cr->lt = NULL;
                snprintf(lt_note, sizeof lt_note, "cuBLASLt %.150s unusable (cublasLtCreate status %d): k-means "
                         "assignment by its kernel", cr->api.blaslt_path, (int)ls);
            } else {
                snprintf(lt_note, sizeof lt_note, "cuBLASLt %zu", cr->api.blaslt_version);
            }
        }
        cr->api.msg[0] = '\0';
        if (force && (force[0] == '0' || force[0] == '1') && !force[1]) cr->km_force = force[0] - '0';
        else if (force)
            pqc__log(rt, PQC_LOG_WARN, "PQC_KMEANS_GEMM must be 0 or 1; ignored");
        if (lforce && (lforce[0] == '0' || lforce[0] == '1') && !lforce[1]) cr->lut_force = lforce[0] - '0';
        else if (lforce)
            pqc__log(rt, PQC_LOG_WARN, "PQC_LUT_GEMM must be 0 or 1; ignored");
        snprintf(why, why_size, "%.80s, compute capability %d.%d, %d SMs, kernels %s, %.220s%s", cr->dev.name,
                 cr->dev.cc_major, cr->dev.cc_minor, cr->dev.sm_count,
                 from_cache ? "from the kernel cache" : "compiled by NVRTC", lt_note,
                 !cr->lt ? "" : cr->km_force == 0 ? " (k-means GEMM off: PQC_KMEANS_GEMM=0)"
                                : cr->km_force == 1 ? " (k-means GEMM forced: PQC_KMEANS_GEMM=1)" : "");
    }
#ifndef PQCACHE_NO_THREADS
    if (pthread_mutex_init(&cr->km_mu, NULL) != 0) {
        snprintf(why, why_size, "a mutex could not be created");
        if (cr->lt) cr->api.cublasLtDestroy(cr->lt);
        cr->api.cuModuleUnload(cr->mod);
        pqc__cu_device_close(&cr->api, &cr->dev);
        pqc__cu_unload(&cr->api);
        pqc__free(&rt->alloc, cr);
        return PQC_ERROR_THREAD;
    }
#endif
    rt->cu = cr;
    return PQC_SUCCESS;
}


typedef pqc__cuDeviceptr pqc__dptr;

/* ---- the k-means assignment step as a GEMM ---- */

/* One cuBLASLt matmul of the assignment: dots = X C^T for `rows` points, i.e. in
   cuBLASLt's column-major terms D (k x rows, ld k) = op(A) B with A = C ([k][d] row-major
   is d x k column-major, ld d, transposed) and B = X (d x rows, ld d); D column i holds
   point i's k dot products, so D is [rows][k] row-major. */
typedef struct pqc__km_plan {
    pqc__cuBlasLtMatmulDesc desc;
    pqc__cuBlasLtMatrixLayout la, lb, lc;
    pqc__cuBlasLtHeuristicResult algo;
    size_t rows;
} pqc__km_plan;

static void pqc__km_plan_free(pqc__cuApi *api, pqc__km_plan *p)
{
    if (p->la) api->cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) api->cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) api->cublasLtMatrixLayoutDestroy(p->lc);
    if (p->desc) api->cublasLtMatmulDescDestroy(p->desc);
    memset(p, 0, sizeof *p);
}

/* Builds a cuBLASLt plan (descriptors and an algorithm that needs no workspace) for
   D = op(A) B, op(A) = A^T, fp32, column-major: A a_rows x a_cols, B a_rows x b_cols,
   D a_cols x b_cols, with leading dimensions lda, ldb, ldd; batch > 0: that many products
   whose matrices are read from device arrays of pointers. Returns the failing cuBLASLt
   status with `what` naming the call, or 0. */
static pqc__cuBlasStatus pqc__lt_plan_make(struct pqc__gpu_device *cr, pqc__km_plan *p, uint64_t a_rows, uint64_t a_cols,
                                           int64_t lda, uint64_t b_cols, int64_t ldb, int64_t ldd, int32_t batch,
                                           const char **what)
{
    pqc__cuApi *api = &cr->api;
    int ta = PQC__CUBLAS_OP_T, tb = PQC__CUBLAS_OP_N, found = 0, i;
    uint64_t ws = 0;
    pqc__cuBlasLtMatmulPreference pref = NULL;
    pqc__cuBlasStatus s;
    memset(p, 0, sizeof *p);
    *what = "cublasLtMatmulDescCreate";
    s = api->cublasLtMatmulDescCreate(&p->desc, PQC__CUBLAS_COMPUTE_32F, PQC__CUDA_R_32F);
    if (s == 0) {
        *what = "cublasLtMatmulDescSetAttribute";
        s = api->cublasLtMatmulDescSetAttribute(p->desc, PQC__CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    }
    if (s == 0) s = api->cublasLtMatmulDescSetAttribute(p->desc, PQC__CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    if (s == 0) {
        *what = "cublasLtMatrixLayoutCreate";
        s = api->cublasLtMatrixLayoutCreate(&p->la, PQC__CUDA_R_32F, a_rows, a_cols, lda);
    }
    if (s == 0) s = api->cublasLtMatrixLayoutCreate(&p->lb, PQC__CUDA_R_32F, a_rows, b_cols, ldb);
    if (s == 0) s = api->cublasLtMatrixLayoutCreate(&p->lc, PQC__CUDA_R_32F, a_cols, b_cols, ldd);
    for (i = 0; i < 3 && s == 0 && batch > 0; i++) {
        pqc__cuBlasLtMatrixLayout lay = i == 0 ? p->la : i == 1 ? p->lb : p->lc;
        uint32_t mode = PQC__CUBLASLT_BATCH_MODE_POINTER_ARRAY;
        *what = "cublasLtMatrixLayoutSetAttribute";
        s = api->cublasLtMatrixLayoutSetAttribute(lay, PQC__CUBLASLT_LAYOUT_BATCH_COUNT, &batch, sizeof batch);
        if (s == 0) s = api->cublasLtMatrixLayoutSetAttribute(lay, PQC__CUBLASLT_LAYOUT_BATCH_MODE, &mode, sizeof mode);
    }
    if (s == 0) {
        *what = "cublasLtMatmulPreferenceCreate";
        s = api->cublasLtMatmulPreferenceCreate(&pref);
    }
    if (s == 0) {
        *what = "cublasLtMatmulPreferenceSetAttribute";
        s = api->cublasLtMatmulPreferenceSetAttribute(pref, PQC__CUBLASLT_PREF_MAX_WORKSPACE, &ws, sizeof ws);
    }
    if (s == 0) {
        *what = "cublasLtMatmulAlgoGetHeuristic";
        s = api->cublasLtMatmulAlgoGetHeuristic(cr->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, &p->algo,
                                                &found);
        if (s == 0 && found < 1) s = -1; /* no algorithm for this shape */
    }
    if (pref) api->cublasLtMatmulPreferenceDestroy(pref);
    if (s != 0) pqc__km_plan_free(api, p);
    return s;
}

/* the assignment's plan for `rows` points (see pqc__km_plan) */
static pqc__cuBlasStatus pqc__km_plan_make(struct pqc__gpu_device *cr, pqc__km_plan *p, size_t rows, int d, int k,
                                           const char **what)
{
    pqc__cuBlasStatus s = pqc__lt_plan_make(cr, p, (uint64_t)d, (uint64_t)k, d, (uint64_t)rows, d, k, 0, what);
    p->rows = rows;
    return s;
}

static int pqc__km_nlog(size_t n)
{
    int l = 0;
    while (l < 62 && ((size_t)1 << l) < n) l++;
    return l;
}

/* The class of (n, d, k) known to the runtime: 1 and *out filled, or 0. */
static int pqc__km_lookup(struct pqc__gpu_device *cr, size_t n, int d, int k, pqc__km_class *out)
{
    int i, nl = pqc__km_nlog(n), hit = 0;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&cr->km_mu);
#endif
    for (i = 0; i < cr->km_n && !hit; i++)
        if (cr->km[i].nlog == nl && cr->km[i].d == d && cr->km[i].k == k) {
            *out = cr->km[i];
            hit = 1;
        }
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&cr->km_mu);
#endif
    return hit;
}

static void pqc__km_store(struct pqc__gpu_device *cr, const pqc__km_class *c)
{
    int i;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&cr->km_mu);
#endif
    for (i = 0; i < cr->km_n; i++)
        if (cr->km[i].nlog == c->nlog && cr->km[i].d == c->d && cr->km[i].k == c->k) break;
    if (i == cr->km_n) { /* a new class; when the table is full, the oldest goes */
        if (cr->km_n < PQC__KM_CLASSES) {
            i = cr->km_n++;
        } else {
            i = cr->km_next;
            cr->km_next = (cr->km_next + 1) % PQC__KM_CLASSES;
        }
    }
    cr->km[i] = *c;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&cr->km_mu);
#endif
}

/* Which assignment the runtime uses for (n, d, k), for reports: 1 and *out when a
   class has been measured, else 0. rt must be a CUDA runtime. */
PQC__CU_FN int pqc__cuda_kmeans_choice(pqc_runtime *rt, size_t n, int d, int k,
                                          pqc__km_class *out)
{
    return rt && rt->cu ? pqc__km_lookup(rt->cu, n, d, k, out) : 0;
}

/* Lloyd iterations of one k-means problem (n points of d <= 256 dims, k centres in c) on
   the GPU: assignment with per-cluster sums and counts, then the update; empty clusters
   keep their centre. Runs on a stream of its own, so builds on several pool threads
   proceed side by side. The assignment runs as the kernel or as the GEMM path (see
   PQC__KM_CLASSES); any cuBLASLt failure sends this build back to the kernel. */
static pqc_result pqc__cuda_lloyd(pqc_runtime *rt, const float *x, size_t n, int d, int k, int iters, float *c,
                                  double *obj, char *err, size_t errsz)
{
    struct pqc__gpu_device *cr = rt->cu;
    pqc__cuApi *api = &cr->api;
    pqc__cuStream st = NULL;
    pqc__dptr dx = 0, dc = 0, dsum = 0, dcnt = 0, dmin = 0, zero = 0, dnorm = 0, ddots = 0;
    float *md = NULL;
    pqc__cuResult e = 0;
    const char *what = "";
    int it, ni = (int)n, ki = k, di = d, rows = k, step = 0, j;
    int mode = 0; /* assignment: 0 kernel, 1 GEMM, 2 measuring both (steps 0..3) */
    int steps = iters + (obj ? 1 : 0);
    int64_t ld = d;
    size_t i, chunk = 0;
    pqc__km_plan plan[2];
    pqc__cuEvent ev[8];
    float ms[4];
    pqc__km_class cls;
    memset(plan, 0, sizeof plan);
    memset(ev, 0, sizeof ev);
#define PQC__LL(call, name)                                                 \
    do {                                                                    \
        if (e == 0 && (e = (call)) != 0) what = (name);                     \
    } while (0)
    PQC__LL(api->cuCtxSetCurrent(cr->dev.ctx), "cuCtxSetCurrent");
    PQC__LL(api->cuStreamCreate(&st, PQC__CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    PQC__LL(api->cuMemAlloc_v2(&dx, n * (size_t)d * sizeof(float)), "cuMemAlloc");
    PQC__LL(api->cuMemAlloc_v2(&dc, (size_t)k * d * sizeof(float)), "cuMemAlloc");
    PQC__LL(api->cuMemAlloc_v2(&dsum, (size_t)k * d * sizeof(float)), "cuMemAlloc");
    PQC__LL(api->cuMemAlloc_v2(&dcnt, (size_t)k * 4), "cuMemAlloc");
    if (obj) {
        PQC__LL(api->cuMemAlloc_v2(&dmin, n * sizeof(float)), "cuMemAlloc");
        if (e == 0 && !(md = (float *)pqc__alloc(&rt->alloc, n * sizeof(float)))) {
            snprintf(err, errsz, "k-means: host memory for the objective");
            e = -1;
        }
    }
    PQC__LL(api->cuMemcpyHtoDAsync_v2(dx, x, n * (size_t)d * sizeof(float), st), "cuMemcpyHtoDAsync");
    PQC__LL(api->cuMemcpyHtoDAsync_v2(dc, c, (size_t)k * d * sizeof(float), st), "cuMemcpyHtoDAsync");

    /* the path: forced, known for this class, or measured now (needs four steps) */
    if (e == 0 && cr->lt) {
        if (cr->km_force >= 0) mode = cr->km_force;
        else if (pqc__km_lookup(cr, n, d, k, &cls)) mode = cls.gemm;
        else mode = steps >= 4 ? 2 : 0;
    }
    if (mode) {
        const char *lwhat = "";
        pqc__cuBlasStatus ls = 0;
        pqc__cuResult ce = 0;
        /* whole multiples of 64 points, so that every chunk's X starts 256-byte aligned
           (the alignment cuBLASLt's heuristics assume) */
        chunk = PQC__KM_DOTS_BYTES / ((size_t)k * sizeof(float)) / 64 * 64;
        if (chunk < 64) chunk = 64;
        if (chunk > n) chunk = n;
        if ((ce = api->cuMemAlloc_v2(&dnorm, (size_t)k * sizeof(float))) == 0)
            ce = api->cuMemAlloc_v2(&ddots, chunk * (size_t)k * sizeof(float));
        if (ce == 0) ls = pqc__km_plan_make(cr, &plan[0], chunk, d, k, &lwhat);
        if (ce == 0 && ls == 0 && n % chunk) ls = pqc__km_plan_make(cr, &plan[1], n % chunk, d, k, &lwhat);
        for (j = 0; mode == 2 && ce == 0 && ls == 0 && j < 8; j++) ce = api->cuEventCreate(&ev[j], PQC__CU_EVENT_DEFAULT);
        if (ce != 0 || ls != 0) {
            char msg[200];
            if (ce != 0)
                snprintf(msg, sizeof msg, "k-means: GEMM path unavailable (%s), using the kernel", pqc__cu_error_name(api, ce));
            else
                snprintf(msg, sizeof msg, "k-means: GEMM path unavailable (%s status %d), using the kernel", lwhat, (int)ls);
            pqc__log(rt, PQC_LOG_WARN, msg);
            mode = 0;
        }
    }

    for (it = 0; it <= iters && e == 0; it++) {
        pqc__dptr m = obj ? dmin : 0;
        void *pa[] = { &dx, &ld, &ni, &di, &dc, &zero, &ki, &zero, &dsum, &dcnt, &m };
        void *pu[] = { &dc, &dsum, &dcnt, &rows, &di };
        int gemm = mode == 1 || (mode == 2 && (step & 1)), timed = mode == 2 && step < 4;
        if (it == iters && !obj) break; /* the last assignment only serves the objective */
        if (timed) PQC__LL(api->cuEventRecord(ev[2 * step], st), "cuEventRecord");
        PQC__LL(api->cuMemsetD32Async(dsum, 0, (size_t)k * d, st), "cuMemsetD32Async");
        PQC__LL(api->cuMemsetD32Async(dcnt, 0, (size_t)k, st), "cuMemsetD32Async");
        if (gemm && e == 0) {
            /* norms, then per chunk of points: dots = X C^T, argmin with sums and counts */
            void *pn[] = { &dc, &ki, &di, &dnorm };
            float one = 1.0f, nil = 0.0f;
            pqc__cuBlasStatus ls = 0;
            size_t p0;
            PQC__LL(api->cuLaunchKernel(cr->fn[PQC__K_NORMS], (unsigned)(((size_t)k + 255) / 256), 1, 1, 256, 1, 1, 0,
                                        st, pn, NULL),
                    "pqc_centroid_norms");
            for (p0 = 0; p0 < n && e == 0 && ls == 0; p0 += chunk) {
                size_t r = n - p0 < chunk ? n - p0 : chunk;
                const pqc__km_plan *pl = r == plan[0].rows ? &plan[0] : &plan[1];
                pqc__dptr xp = dx + p0 * (size_t)d * sizeof(float), mp = obj ? dmin + p0 * sizeof(float) : 0;
                int ri = (int)r;
                void *pd[] = { &ddots, &xp, &ld, &ri, &di, &dnorm, &ki, &zero, &dsum, &dcnt, &mp };
                ls = api->cublasLtMatmul(cr->lt, pl->desc, &one, (const void *)(uintptr_t)dc, pl->la,
                                         (const void *)(uintptr_t)xp, pl->lb, &nil, (const void *)(uintptr_t)ddots,
                                         pl->lc, (void *)(uintptr_t)ddots, pl->lc, &pl->algo.algo, NULL, 0, st);
                if (ls == 0)
                    PQC__LL(api->cuLaunchKernel(cr->fn[PQC__K_KM_DOTS], (unsigned)((r + 7) / 8), 1, 1, 256, 1, 1, 0,
                                                st, pd, NULL),
                            "pqc_kmeans_assign_dots");
            }
            if (ls != 0 && e == 0) { /* this build goes back to the kernel, from this step */
                char msg[160];
                snprintf(msg, sizeof msg, "k-means: cublasLtMatmul failed (status %d); using the kernel", (int)ls);
                pqc__log(rt, PQC_LOG_WARN, msg);
                mode = gemm = timed = 0;
                PQC__LL(api->cuMemsetD32Async(dsum, 0, (size_t)k * d, st), "cuMemsetD32Async");
                PQC__LL(api->cuMemsetD32Async(dcnt, 0, (size_t)k, st), "cuMemsetD32Async");
            }
        }
        if (!gemm)
            PQC__LL(api->cuLaunchKernel(cr->fn[PQC__K_KM_ASSIGN], (unsigned)((n + 7) / 8), 1, 1, 256, 1, 1, 0, st, pa,
                                        NULL),
                    "pqc_kmeans_assign");
        if (timed) PQC__LL(api->cuEventRecord(ev[2 * step + 1], st), "cuEventRecord");
        if (timed && step == 3 && e == 0) {
            /* the decision: the faster of two runs each (a tie keeps the kernel) */
            int ok = api->cuEventSynchronize(ev[7]) == 0;
            for (j = 0; ok && j < 4; j++) ok = api->cuEventElapsedTime(&ms[j], ev[2 * j], ev[2 * j + 1]) == 0;
            mode = 0;
            if (ok) {
                cls.nlog = pqc__km_nlog(n);
                cls.d = d;
                cls.k = k;
                cls.ms_kernel = ms[0] < ms[2] ? ms[0] : ms[2];
                cls.ms_gemm = ms[1] < ms[3] ? ms[1] : ms[3];
                cls.gemm = cls.ms_gemm < cls.ms_kernel;
                pqc__km_store(cr, &cls);
                mode = cls.gemm;
            }
        }
        step++;
        if (obj) {
            double o = 0.0;
            PQC__LL(api->cuMemcpyDtoHAsync_v2(md, dmin, n * sizeof(float), st), "cuMemcpyDtoHAsync");
            PQC__LL(api->cuStreamSynchronize(st), "cuStreamSynchronize");
            for (i = 0; e == 0 && i < n; i++) o += md[i];
            obj[it] = o / (double)n;
        }
        if (it == iters) break;
        PQC__LL(api->cuLaunchKernel(cr->fn[PQC__K_KM_UPDATE], (unsigned)(((size_t)k * d + 255) / 256), 1, 1, 256, 1, 1, 0,
                                    st, pu, NULL),
                "pqc_kmeans_update");
    }
    PQC__LL(api->cuMemcpyDtoHAsync_v2(c, dc, (size_t)k * d * sizeof(float), st), "cuMemcpyDtoHAsync");
    PQC__LL(api->cuStreamSynchronize(st), "cuStreamSynchronize");
#undef PQC__LL
    if (e > 0) snprintf(err, errsz, "k-means on the GPU: %s failed: %s", what, pqc__cu_error_name(api, e));
    if (st) {
        api->cuStreamSynchronize(st);
        api->cuStreamDestroy_v2(st);
    }
    for (j = 0; j < 8; j++)
        if (ev[j]) api->cuEventDestroy_v2(ev[j]);
    pqc__km_plan_free(api, &plan[0]);
    pqc__km_plan_free(api, &plan[1]);
    if (dx) api->cuMemFree_v2(dx);
    if (dc) api->cuMemFree_v2(dc);
    if (dsum) api->cuMemFree_v2(dsum);
    if (dcnt) api->cuMemFree_v2(dcnt);
    if (dmin) api->cuMemFree_v2(dmin);
    if (dnorm) api->cuMemFree_v2(dnorm);
    if (ddots) api->cuMemFree_v2(ddots);
    pqc__free(&rt->alloc, md);
    if (e == 0) return PQC_SUCCESS;
    return e > 0 ? PQC_ERROR_BACKEND : PQC_ERROR_OUT_OF_MEMORY;
}

struct pqc__gpu_tier {
    struct pqc__gpu_device *r;
    pqc__cuApi *api;
    pqc__cuStream st, cp;   /* work stream (the engine's or our own), copy stream */
    int own_st;
    /* [code_bufs], [code_bufs], one; an event not yet recorded stands for no work, so waiting on
       it returns at once */
    pqc__cuEvent *ev_codes, *ev_used, ev_staged;
    int K, m, bits, dsub, g, d, n_kv;
    size_t block_tokens;        /* tokens per block */
    /* slots: [sink blocks | window ring | block cache] per layer and head */
    int ready, sink_blocks, window_blocks, n_slots; /* blocks of sinks, of the window ring, in all */
    pqc__dptr *pool_k, *pool_v; /* [L] -> [n_kv][n_slots][bt][d] storage dtype */
    pqc__dptr *cent;            /* [L] -> [n_kv][m][K][dsub] float */
    uint64_t *cent_gen;         /* [L] installed-codebook generation + 1 held there; 0: none */
    pqc__dptr *hk, *hv;         /* [L] device addresses of the mapped K/V stores (own rows) */
    pqc__dptr *pk, *pv;         /* [L] those of a fork's shared prefix (rows < c->pn), or 0 */
    size_t hstride, phstride;   /* elements between heads in the own stores (cap * d) and
                                   in the shared prefix's */
    /* codes, double-buffered */
    int code_bufs;              /* code buffers: 2 (prefetched per layer) or one per layer */
    pqc__dptr *code;            /* [code_bufs] */
    size_t *code_cap, *code_hs, *code_cs, *code_n;
    int *code_layer, last_slot;
    uint64_t *code_gen;
    /* selection scratch */
    pqc__dptr q, lut, lut_sum, partial, stats, hist, state;
    int p_max;
    pqc__dptr scores, counts, topk, topk_sc;
    size_t s_cap;
    float *h_q;
    float *h_ones;              /* [d_h] 1.0f: the weights of a head without a metric */
    float *h_wc;                /* [m][K][d_sub] a head's W c, uploaded (metric blocks) */
    int32_t *h_topk;
    float *h_topk_sc;           /* the top-k's scores, read back when a head takes fewer */
    /* fetch: one upload arena [table | idx | fill blocks, fill slots] on host and device */
    pqc__dptr arena, iota, out_k, out_v;
    int32_t *h_arena;
    size_t arena_cap, iota_n, out_cap, nblk_cap, rows_cap, fill_cap;
    size_t *nfill;
    int32_t *fill_b, *fill_s; /* [n_kv][cache_blocks] recorded admissions */
    pqc_allocator codes_alloc; /* pinned host memory for the codes (async copies) */
    /* the decode step on the device (pqc__gpu_step), made at its first use */
    pqc__dptr *adm;           /* [L] every head's block-cache bookkeeping (pqc__gpu_adm_bytes) */
    size_t *adm_nbc;          /* [L] blocks it has room for */
    int *adm_dev;             /* [L] 1: the device's copy is the current one, the host's stale */
    pqc__dptr dstat;          /* [L][n_kv][3] hits, misses, bytes host -> device of device steps */
    pqc__dptr rfill, dtakes;  /* [n_kv][3][admit] fill lists; int32 [n_kv] tops-k, then with
                                 exact scoring [n_kv] candidate counts, then with outlier
                                 lists [n_kv] their lengths and [n_kv][2 outliers] the lists */
    unsigned char *h_stage;   /* pinned [2][L][stage_bytes]: a step's queries and dtakes */
    /* exact scoring on the device (pqc__gpu_rerank): [n_kv][g][rr_cap] dots, [n_kv][g]
       weights, [n_kv][rr_cap] combined scores, kept positions and their tokens, the
       candidates merged with the outlier lists and [n_kv] their counts */
    pqc__dptr rr_dots, rr_w, rr_comb, rr_pos, rr_ids, rr_cand, rr_nm, rr_ext, rr_next;
    size_t rr_cap;
    /* the window's rivals (PQC_SPLIT_COMPETE, pqc__gpu_search): [rv_cap] candidates,
       [n_kv] their count, [n_kv][g][rv_cap] dots */
    pqc__dptr rv_cand, rv_n, rv_dots;
    size_t rv_cap;
    pqc__cuEvent *ev_stage;   /* [2L] their copies done */
    size_t stage_bytes, pos_cap;
    uint32_t *h_pos;          /* pinned [n_kv][pos_cap]: selections read back with host rows */
    uint64_t waits, waits_seen; /* host waits for the device; those already counted by a layer */
    /* lookup tables a batch built for this cache (pqc__gpu_batch_tables) */
    pqc__dptr qb;             /* [n_q][d] its queries with each sub-space's dims together */
    float *h_qb;              /* pinned staging of qb */
    float *batch_q;              /* the queries the tables are of */
    pqc__cuEvent ev_qb;       /* qb and the codebooks are on the device */
    int batch_ok, batch_layer;      /* u->lut holds layer batch_layer's tables of batch_q */
    uint64_t batch_gen;          /* of codebooks cent_gen batch_gen */
    int lut_pre;              /* the next search finds its tables built */
};
/* The codes live in pinned host memory, so that their copies to the device are truly
   asynchronous. A copy in flight may read bytes the host is OR-ing new codes into: only
   bits of tokens past the copied count change, which the device codes itself anyway.
   Freeing (growth, a rebuild's install) first waits for the copy stream. */
static void *pqc__gpu_codes_alloc_fn(size_t n, void *user)
{
    pqc_cache *c = (pqc_cache *)user;
    void *p = NULL;
    c->cu->api->cuCtxSetCurrent(c->cu->r->dev.ctx);
    if (c->cu->api->cuMemHostAlloc(&p, n ? n : 16, PQC__CU_MEMHOSTALLOC_PORTABLE) != 0) return NULL;
    return p;
}

static void pqc__gpu_codes_free_fn(void *p, void *user)
{
    pqc_cache *c = (pqc_cache *)user;
    if (!p) return;
    c->cu->api->cuCtxSetCurrent(c->cu->r->dev.ctx);
    c->cu->api->cuStreamSynchronize(c->cu->cp);
    c->cu->api->cuMemFreeHost(p);
}


#define PQC__GPU_CALL(c, call, what)                                        \
    do {                                                                    \
        pqc__cuResult r_ = (call);                                          \
        if (r_ != 0) return pqc__gpu_err((c), r_, (what));                  \
    } while (0)

/* a call that makes the host wait for the device, counted (pqc_layer_stats.device_waits) */
#define PQC__GPU_WAIT(c, call, what)                                        \
    do {                                                                    \
        (c)->cu->waits++;                                                   \
        PQC__GPU_CALL(c, call, what);                                       \
    } while (0)

static pqc_result pqc__gpu_err(const pqc_cache *c, pqc__cuResult r, const char *what)
{
    return pqc__cfail(c, PQC_ERROR_BACKEND, "CUDA: %s failed: %s", what, pqc__cu_error_name(c->cu->api, r));
}

static void pqc__gpu_enter(pqc_cache *c) { c->cu->api->cuCtxSetCurrent(c->cu->r->dev.ctx); }

static unsigned pqc__cdiv(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

static pqc_result pqc__gpu_launch(pqc_cache *c, int k, unsigned gx, unsigned gy, unsigned smem, void **p)
{
    struct pqc__gpu_tier *u = c->cu;
    if (gx == 0 || gy == 0) return PQC_SUCCESS;
    PQC__GPU_CALL(c, u->api->cuLaunchKernel(u->r->fn[k], gx, gy, 1, 256, 1, 1, smem, u->st, p, NULL), pqc__k_names[k]);
    return PQC_SUCCESS;
}

static void pqc__gpu_dfree(struct pqc__gpu_tier *u, pqc__dptr *p)
{
    if (*p) u->api->cuMemFree_v2(*p);
    *p = 0;
}

/* (Re)allocates a device buffer to at least `bytes`; the old contents are dropped. */
static pqc_result pqc__gpu_dalloc(pqc_cache *c, pqc__dptr *p, size_t bytes)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__gpu_dfree(u, p);
    PQC__GPU_CALL(c, u->api->cuMemAlloc_v2(p, bytes ? bytes : 16), "cuMemAlloc");
    return PQC_SUCCESS;
}

static pqc_result pqc__gpu_halloc(pqc_cache *c, void **p, size_t bytes)
{
    struct pqc__gpu_tier *u = c->cu;
    if (*p) u->api->cuMemFreeHost(*p);
    *p = NULL;
    PQC__GPU_CALL(c, u->api->cuMemHostAlloc(p, bytes ? bytes : 16, PQC__CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    return PQC_SUCCESS;
}

static void pqc__gpu_free_all(pqc_cache *c, struct pqc__gpu_tier *u)
{
    int l, i;
    if (u->st) u->api->cuStreamSynchronize(u->st);
    if (u->cp) u->api->cuStreamSynchronize(u->cp);
    for (l = 0; l < c->d.n_layers; l++) {
        if (u->pool_k) pqc__gpu_dfree(u, &u->pool_k[l]);
        if (u->pool_v) pqc__gpu_dfree(u, &u->pool_v[l]);
        if (u->cent) pqc__gpu_dfree(u, &u->cent[l]);
    }
    for (i = 0; u->code && i < u->code_bufs; i++) {
        pqc__gpu_dfree(u, &u->code[i]);
        if (u->ev_codes[i]) u->api->cuEventDestroy_v2(u->ev_codes[i]);
        if (u->ev_used[i]) u->api->cuEventDestroy_v2(u->ev_used[i]);
    }
    if (u->ev_staged) u->api->cuEventDestroy_v2(u->ev_staged);
    for (l = 0; u->adm && l < c->d.n_layers; l++) {
        pqc__gpu_dfree(u, &u->adm[l]);
        if (u->ev_stage[l]) u->api->cuEventDestroy_v2(u->ev_stage[l]);
        if (u->ev_stage[c->d.n_layers + l]) u->api->cuEventDestroy_v2(u->ev_stage[c->d.n_layers + l]);
    }
    pqc__gpu_dfree(u, &u->dstat);
    pqc__gpu_dfree(u, &u->rfill);
    pqc__gpu_dfree(u, &u->dtakes);
    pqc__gpu_dfree(u, &u->rr_dots);
    pqc__gpu_dfree(u, &u->rr_w);
    pqc__gpu_dfree(u, &u->rr_comb);
    pqc__gpu_dfree(u, &u->rr_pos);
    pqc__gpu_dfree(u, &u->rr_ids);
    pqc__gpu_dfree(u, &u->rr_cand);
    pqc__gpu_dfree(u, &u->rr_nm);
    pqc__gpu_dfree(u, &u->rr_ext);
    pqc__gpu_dfree(u, &u->rr_next);
    pqc__gpu_dfree(u, &u->rv_cand);
    pqc__gpu_dfree(u, &u->rv_n);
    pqc__gpu_dfree(u, &u->rv_dots);
    if (u->h_stage) u->api->cuMemFreeHost(u->h_stage);
    if (u->h_pos) u->api->cuMemFreeHost(u->h_pos);
    pqc__free(&c->alloc, u->adm); /* with adm_nbc, adm_dev, ev_stage */
    pqc__gpu_dfree(u, &u->q);
    pqc__gpu_dfree(u, &u->qb);
    if (u->h_qb) u->api->cuMemFreeHost(u->h_qb);
    pqc__free(&c->alloc, u->batch_q);
    if (u->ev_qb) u->api->cuEventDestroy_v2(u->ev_qb);
    pqc__gpu_dfree(u, &u->lut);
    pqc__gpu_dfree(u, &u->lut_sum);
    pqc__gpu_dfree(u, &u->partial);
    pqc__gpu_dfree(u, &u->stats);
    pqc__gpu_dfree(u, &u->hist);
    pqc__gpu_dfree(u, &u->state);
    pqc__gpu_dfree(u, &u->scores);
    pqc__gpu_dfree(u, &u->counts);
    pqc__gpu_dfree(u, &u->topk);
    pqc__gpu_dfree(u, &u->topk_sc);
    pqc__gpu_dfree(u, &u->arena);
    pqc__gpu_dfree(u, &u->iota);
    pqc__gpu_dfree(u, &u->out_k);
    pqc__gpu_dfree(u, &u->out_v);
    if (u->h_q) u->api->cuMemFreeHost(u->h_q);
    pqc__free(&c->alloc, u->h_ones);
    pqc__free(&c->alloc, u->h_wc);
    if (u->h_topk) u->api->cuMemFreeHost(u->h_topk);
    if (u->h_topk_sc) u->api->cuMemFreeHost(u->h_topk_sc);
    if (u->h_arena) u->api->cuMemFreeHost(u->h_arena);
    if (u->cp) u->api->cuStreamDestroy_v2(u->cp);
    if (u->own_st && u->st) u->api->cuStreamDestroy_v2(u->st);
    pqc__free(&c->alloc, u->pool_k); /* pool_k, pool_v, cent, hk, hv, cent_gen in one block */
    pqc__free(&c->alloc, u->nfill);
    pqc__free(&c->alloc, u->code); /* with the other per-buffer arrays */
    pqc__free(&c->alloc, u);
}

/* Floats per KV head of a layer's codebook buffer: the centroids [m][K][dsub], then the
   norms the coding kernel compares with [m][K] and the metric's weights [d_h] (uploaded
   when a head of the layer has a metric), then with metric blocks W_j c
   [m][K][dsub] (what coding compares a key with; the centroids where a head has no
   blocks). */
static size_t pqc__gpu_cent_floats(const pqc_cache *c)
{
    const struct pqc__gpu_tier *u = c->cu;
    size_t tab = (size_t)u->m * u->K;
    return tab * (size_t)u->dsub + tab + (size_t)u->d + (pqc__bands(c) ? tab * (size_t)u->dsub : 0);
}

/* How a head of layer l codes: 0 plain, 1 with weights, 2 with metric blocks */
static int pqc__layer_metric(const pqc_cache *c, int l)
{
    int h;
    for (h = 0; h < c->d.n_kv_heads; h++) {
        if (c->layers[l].heads[h].pq.mblocks) return 2;
        if (c->layers[l].heads[h].pq.metric) return 1;
    }
    return 0;
}

static pqc_result pqc__gpu_create(pqc_cache *c)
{
    struct pqc__gpu_tier *u;
    size_t L = (size_t)c->d.n_layers, nkv = (size_t)c->d.n_kv_heads, cb = (size_t)c->d.cache_blocks, n;
    pqc_result r = PQC_SUCCESS;
    int i;
    u = (struct pqc__gpu_tier *)pqc__calloc(&c->alloc, sizeof *u);
    if (!u) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
    u->r = c->rt->cu;
    u->api = &u->r->api;
    u->code_bufs = c->d.codes_resident ? c->d.n_layers : 2;
    n = (size_t)u->code_bufs;
    /* three blocks of per-layer, per-head and per-code-buffer arrays */
    u->pool_k = (pqc__dptr *)pqc__calloc(&c->alloc, L * (7 * sizeof(pqc__dptr) + sizeof(uint64_t)));
    u->nfill = (size_t *)pqc__calloc(&c->alloc, nkv * sizeof(size_t) + 2 * nkv * (cb + 1) * sizeof(int32_t));
    u->code = (pqc__dptr *)pqc__calloc(&c->alloc, n * (sizeof(pqc__dptr) + 5 * sizeof(size_t) + sizeof(uint64_t) +
                                                       2 * sizeof(pqc__cuEvent) + sizeof(int)));
    if (!u->pool_k || !u->nfill || !u->code) {
        pqc__gpu_free_all(c, u);
        return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
    }
    u->pool_v = u->pool_k + L;
    u->cent = u->pool_v + L;
    u->hk = u->cent + L;
    u->hv = u->hk + L;
    u->pk = u->hv + L;
    u->pv = u->pk + L;
    u->cent_gen = (uint64_t *)(u->pv + L);
    u->fill_b = (int32_t *)(u->nfill + nkv);
    u->fill_s = u->fill_b + nkv * (cb + 1);
    u->m = c->d.pq.m;
    u->bits = c->d.pq.bits;
    u->K = 1 << u->bits;
    u->d = c->d.head_dim;
    u->dsub = u->d / u->m;
    u->g = c->g;
    u->n_kv = c->d.n_kv_heads;
    u->block_tokens = (size_t)c->d.block_tokens;
    u->code_cap = (size_t *)(u->code + n);
    u->code_hs = u->code_cap + n;
    u->code_cs = u->code_hs + n;
    u->code_n = u->code_cs + n;
    u->code_gen = (uint64_t *)(u->code_n + n);
    u->ev_codes = (pqc__cuEvent *)(u->code_gen + n);
    u->ev_used = u->ev_codes + n;
    u->code_layer = (int *)(u->ev_used + n);
    for (i = 0; i < u->code_bufs; i++) u->code_layer[i] = -1;
    u->last_slot = 1;
    u->p_max = PQC__MAX(1, (4 * PQC__MAX(u->r->dev.sm_count, 1) + u->n_kv - 1) / u->n_kv);
    u->codes_alloc.alloc = pqc__gpu_codes_alloc_fn;
    u->codes_alloc.free = pqc__gpu_codes_free_fn;
    u->codes_alloc.user = c;
    c->cu = u; /* from here on pqc__gpu_free_all undoes everything */
    pqc__gpu_enter(c);
#define PQC__GPU_TRY(call, what)                                            \
    do {                                                                    \
        pqc__cuResult r_ = (call);                                          \
        if (r_ != 0) { r = pqc__gpu_err(c, r_, (what)); goto fail; }        \
    } while (0)
    if (c->d.cuda_stream) {
        u->st = (pqc__cuStream)c->d.cuda_stream;
    } else {
        PQC__GPU_TRY(u->api->cuStreamCreate(&u->st, PQC__CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        u->own_st = 1;
    }
    PQC__GPU_TRY(u->api->cuStreamCreate(&u->cp, PQC__CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (i = 0; i < u->code_bufs; i++) {
        PQC__GPU_TRY(u->api->cuEventCreate(&u->ev_codes[i], PQC__CU_EVENT_DISABLE_TIMING), "cuEventCreate");
        PQC__GPU_TRY(u->api->cuEventCreate(&u->ev_used[i], PQC__CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    PQC__GPU_TRY(u->api->cuEventCreate(&u->ev_staged, PQC__CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    {
        size_t tab = (size_t)u->m * u->K, cent = pqc__gpu_cent_floats(c) * sizeof(float) * nkv;
        size_t l;
        for (l = 0; l < L; l++)
            if ((r = pqc__gpu_dalloc(c, &u->cent[l], cent)) != PQC_SUCCESS) goto fail;
        u->h_ones = (float *)pqc__alloc(&c->alloc, (size_t)u->d * sizeof(float));
        if (pqc__bands(c)) u->h_wc = (float *)pqc__alloc(&c->alloc, tab * (size_t)u->dsub * sizeof(float));
        if (!u->h_ones || (pqc__bands(c) && !u->h_wc)) {
            r = pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
            goto fail;
        }
        for (l = 0; l < (size_t)u->d; l++) u->h_ones[l] = 1.0f;
        if ((r = pqc__gpu_dalloc(c, &u->q, (size_t)c->d.n_q_heads * u->d * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->lut, nkv * (size_t)u->g * tab * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->lut_sum, nkv * tab * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->partial, nkv * (size_t)u->g * (size_t)u->p_max * 2 * sizeof(float))) !=
                PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->stats, nkv * (size_t)u->g * 2 * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->hist, nkv * PQC__CU_RADIX_BINS * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->state, nkv * 16)) != PQC_SUCCESS ||
            (r = pqc__gpu_halloc(c, (void **)&u->h_q, (size_t)c->d.n_q_heads * u->d * sizeof(float))) != PQC_SUCCESS)
            goto fail;
        PQC__GPU_TRY(u->api->cuMemsetD32Async(u->hist, 0, nkv * PQC__CU_RADIX_BINS, u->st), "cuMemsetD32Async");
        PQC__GPU_TRY(u->api->cuMemsetD32Async(u->state, 0, nkv * 4, u->st), "cuMemsetD32Async");
        PQC__GPU_TRY(u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
    }
#undef PQC__GPU_TRY
    return PQC_SUCCESS;
fail:
    c->cu = NULL;
    pqc__gpu_free_all(c, u);
    return r;
}

static void pqc__gpu_destroy(pqc_cache *c)
{
    struct pqc__gpu_tier *u = c->cu;
    if (!u) return;
    pqc__gpu_enter(c);
    c->cu = NULL;
    pqc__gpu_free_all(c, u);
}

static const pqc_allocator *pqc__gpu_codes_allocator(pqc_cache *c) { return &c->cu->codes_alloc; }

static void *pqc__gpu_host_alloc(pqc_cache *c, size_t bytes)
{
    void *p = NULL;
    pqc__gpu_enter(c);
    if (c->cu->api->cuMemHostAlloc(&p, bytes ? bytes : 16, PQC__CU_MEMHOSTALLOC_PORTABLE | PQC__CU_MEMHOSTALLOC_DEVICEMAP) != 0)
        return NULL;
    return p;
}

static void pqc__gpu_host_free(pqc_cache *c, void *p)
{
    pqc__gpu_enter(c);
    c->cu->api->cuMemFreeHost(p);
}

/* a shared prefix's store, freed by the last fork that used it (the runtime's device) */
static void pqc__gpu_host_release(pqc_runtime *rt, const pqc_allocator *a, void *p)
{
    (void)a;
    rt->cu->api.cuCtxSetCurrent(rt->cu->dev.ctx);
    rt->cu->api.cuMemFreeHost(p);
}

static void pqc__gpu_quiesce(pqc_cache *c)
{
    if (!c->cu) return;
    pqc__gpu_enter(c);
    c->cu->api->cuStreamSynchronize(c->cu->st);
    c->cu->api->cuStreamSynchronize(c->cu->cp);
}

/* After the stores moved or grew: their device addresses, the slot tables' size and
   the block-id table (iota) the fill kernel reads its lists from. */
static pqc_result pqc__gpu_grown(pqc_cache *c)
{
    struct pqc__gpu_tier *u = c->cu;
    int l;
    size_t need, i;
    if (!u) return PQC_SUCCESS;
    pqc__gpu_enter(c);
    for (l = 0; l < c->d.n_layers; l++) {
        u->hk[l] = u->hv[l] = u->pk[l] = u->pv[l] = 0;
        if (c->layers[l].kbase) {
            PQC__GPU_CALL(c, u->api->cuMemHostGetDevicePointer_v2(&u->hk[l], c->layers[l].kbase, 0),
                          "cuMemHostGetDevicePointer");
            PQC__GPU_CALL(c, u->api->cuMemHostGetDevicePointer_v2(&u->hv[l], c->layers[l].vbase, 0),
                          "cuMemHostGetDevicePointer");
        }
        if (c->share) { /* mapped by the cache that made it, portable to this context */
            PQC__GPU_CALL(c, u->api->cuMemHostGetDevicePointer_v2(&u->pk[l], c->share->k[l], 0),
                          "cuMemHostGetDevicePointer");
            PQC__GPU_CALL(c, u->api->cuMemHostGetDevicePointer_v2(&u->pv[l], c->share->v[l], 0),
                          "cuMemHostGetDevicePointer");
        }
    }
    u->hstride = c->cap * (size_t)u->d;
    u->phstride = c->share ? c->share->cap * (size_t)u->d : 0;
    u->nblk_cap = (pqc__room(c) + u->block_tokens - 1) / u->block_tokens;
    need = PQC__MAX(u->nblk_cap + 1, (size_t)u->n_slots + 1);
    if (need > u->iota_n) {
        int32_t *tmp = (int32_t *)pqc__alloc(&c->alloc, need * sizeof(int32_t));
        pqc_result r;
        if (!tmp) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
        for (i = 0; i < need; i++) tmp[i] = (int32_t)i;
        r = pqc__gpu_dalloc(c, &u->iota, need * sizeof(int32_t));
        if (r == PQC_SUCCESS && u->api->cuMemcpyHtoD_v2(u->iota, tmp, need * sizeof(int32_t)) != 0)
            r = pqc__cfail(c, PQC_ERROR_BACKEND, "CUDA: cuMemcpyHtoD failed");
        pqc__free(&c->alloc, tmp);
        if (r != PQC_SUCCESS) return r;
        u->iota_n = need;
    }
    return PQC_SUCCESS;
}

/* The slot of a block resident for good: sink blocks and the window's ring; -1 else. */
static int pqc__gpu_sized(const pqc_cache *c) { return c->cu && c->cu->ready; }

static int pqc__gpu_fixed_slot(const pqc_cache *c, size_t b, size_t mid_end)
{
    const struct pqc__gpu_tier *u = c->cu;
    if (b < (size_t)u->sink_blocks) return (int)b;
    if ((b + 1) * u->block_tokens > mid_end) return u->sink_blocks + (int)((b - (size_t)u->sink_blocks) % (size_t)u->window_blocks);
    return -1;
}

/* Copies rows [row_lo, bt) of the blocks [b0, b0 + n) into the slots [s0, s0 + n) of every
   head of layer l, from the mapped store. */
static pqc_result pqc__gpu_fill_run(pqc_cache *c, int l, size_t ntok, size_t b0, int s0, int n, int row_lo)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__dptr blocks = u->iota + b0 * 4, slots = u->iota + (size_t)s0 * 4;
    int64_t list_hs = 0, hs = (int64_t)u->hstride, ld = u->d, pool_hs = (int64_t)u->n_slots * (int64_t)u->block_tokens * u->d;
    int64_t phs = (int64_t)u->phstride, split = (int64_t)c->pn;
    int bt = (int)u->block_tokens, s = (int)ntok, dt = (int)c->d.kv_dtype, d = u->d;
    void *p[] = { &blocks, &slots, &list_hs, &n, &bt, &row_lo, &s, &u->hk[l], &u->hv[l], &hs, &u->pk[l], &u->pv[l],
                  &phs, &split, &ld, &dt, &d, &u->pool_k[l], &u->pool_v[l], &pool_hs };
    if (n <= 0) return PQC_SUCCESS;
    return pqc__gpu_launch(c, PQC__K_FILL, pqc__cdiv((size_t)n * (u->block_tokens - (size_t)row_lo), 8), (unsigned)u->n_kv, 0, p);
}

/* A prefill that brings layer l to n tokens (rows already in the store): the slot pools
   exist (the window is known now) and every sink and window block holds its rows. */
static pqc_result pqc__gpu_stored(pqc_cache *c, int l, size_t n)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nb = (n + u->block_tokens - 1) / u->block_tokens, mid_end = pqc__mid_end(c, &c->layers[l], n), b, b0;
    pqc_result r;
    int i;
    pqc__gpu_enter(c);
    if (n > 0x7fffffffu) return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: more than 2^31 tokens");
    if (!u->ready) {
        size_t bytes, nsb = ((size_t)c->d.n_sink + u->block_tokens - 1) / u->block_tokens, wb = ((size_t)c->window + u->block_tokens - 1) / u->block_tokens + 1;
        if (nsb + wb + (size_t)c->d.cache_blocks > 0x3fffffff ||
            !pqc__size3((size_t)u->n_kv * (nsb + wb + (size_t)c->d.cache_blocks), u->block_tokens, c->row, &bytes))
            return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: %zu sink, %zu window and %d cache blocks overflow", nsb,
                              wb, c->d.cache_blocks);
        u->sink_blocks = (int)nsb;
        u->window_blocks = (int)wb;
        u->n_slots = u->sink_blocks + u->window_blocks + c->d.cache_blocks;
        for (i = 0; i < c->d.n_layers; i++) {
            if ((r = pqc__gpu_dalloc(c, &u->pool_k[i], bytes)) != PQC_SUCCESS) return r;
            if ((r = pqc__gpu_dalloc(c, &u->pool_v[i], bytes)) != PQC_SUCCESS) return r;
        } /* a failure leaves ready at 0: the next prefill tries again */
        if ((r = pqc__gpu_grown(c)) != PQC_SUCCESS) return r; /* iota covers the slots too */
        u->ready = 1;
    }
    if ((r = pqc__gpu_fill_run(c, l, n, 0, 0, (int)PQC__MIN(nb, (size_t)u->sink_blocks), 0)) != PQC_SUCCESS) return r;
    b0 = PQC__MAX((size_t)u->sink_blocks, mid_end / u->block_tokens);
    for (b = b0; b < nb;) { /* the ring in at most two runs of consecutive slots */
        int s0 = pqc__gpu_fixed_slot(c, b, mid_end);
        size_t run = PQC__MIN(nb - b, (size_t)(u->sink_blocks + u->window_blocks - s0));
        if ((r = pqc__gpu_fill_run(c, l, n, b, s0, (int)run, 0)) != PQC_SUCCESS) return r;
        b += run;
    }
    return PQC_SUCCESS;
}

/* An append that brings layer l to n tokens (the new row already in the store): the row
   goes to its sink or window slot. */
static pqc_result pqc__gpu_appended(pqc_cache *c, int l, size_t n)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t t = n - 1;
    int s;
    if (!u->ready) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "CUDA tier: append before prefill");
    if (n > 0x7fffffffu) return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: more than 2^31 tokens");
    pqc__gpu_enter(c);
    s = pqc__gpu_fixed_slot(c, t / u->block_tokens, pqc__mid_end(c, &c->layers[l], n));
    if (s < 0) return PQC_SUCCESS; /* no window: the token is read from host memory */
    return pqc__gpu_fill_run(c, l, n, t / u->block_tokens, s, 1, (int)(t % u->block_tokens));
}

/* Column stride of a device copy of layer l's codes: the widest of its heads' (heads grow
   their codes together, so they normally agree). */
static size_t pqc__gpu_codes_stride(const pqc_cache *c, int l)
{
    size_t cs = 0, h;
    for (h = 0; h < (size_t)c->d.n_kv_heads; h++) cs = PQC__MAX(cs, c->layers[l].heads[h].codes.col_stride);
    return cs;
}

/* Copies the codes of layer l into code buffer sl on the copy stream (after the last
   scan that read the buffer) and records ev_codes[sl]. */
static pqc_result pqc__gpu_codes_upload(pqc_cache *c, int sl, int l)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__layer *L = &c->layers[l];
    size_t cs = pqc__gpu_codes_stride(c, l), hs, h;
    int j, uniform = 1;
    for (h = 0; h < (size_t)u->n_kv; h++) uniform &= L->heads[h].codes.col_stride == cs;
    hs = cs * (size_t)u->m;
    PQC__GPU_CALL(c, u->api->cuStreamWaitEvent(u->cp, u->ev_used[sl], 0), "cuStreamWaitEvent");
    if (hs * (size_t)u->n_kv > u->code_cap[sl]) {
        pqc_result r;
        PQC__GPU_CALL(c, u->api->cuStreamSynchronize(u->cp), "cuStreamSynchronize");
        if ((r = pqc__gpu_dalloc(c, &u->code[sl], hs * (size_t)u->n_kv + hs / 4)) != PQC_SUCCESS) {
            u->code_cap[sl] = 0;
            u->code_layer[sl] = -1;
            return r;
        }
        u->code_cap[sl] = hs * (size_t)u->n_kv + hs / 4;
    }
    if (!uniform) PQC__GPU_CALL(c, u->api->cuMemsetD8Async(u->code[sl], 0, hs * (size_t)u->n_kv, u->cp), "cuMemsetD8Async");
    for (h = 0; h < (size_t)u->n_kv; h++) {
        const pqc_codes *cd = &L->heads[h].codes;
        pqc__dptr dst = u->code[sl] + h * hs;
        if (uniform) {
            PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(dst, cd->data, hs, u->cp), "cuMemcpyHtoDAsync");
        } else {
            for (j = 0; j < u->m; j++)
                PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(dst + (size_t)j * cs, cd->data + (size_t)j * cd->col_stride,
                                                              cd->col_stride, u->cp),
                              "cuMemcpyHtoDAsync");
        }
    }
    PQC__GPU_CALL(c, u->api->cuEventRecord(u->ev_codes[sl], u->cp), "cuEventRecord");
    u->code_layer[sl] = l;
    u->code_gen[sl] = L->dgen;
    u->code_cs[sl] = cs;
    u->code_hs[sl] = hs;
    u->code_n[sl] = L->n_coded;
    return PQC_SUCCESS;
}

/* Whether buffer sl holds layer l's current codes (up to a tail the device codes itself). */
static int pqc__gpu_codes_valid(const pqc_cache *c, int sl, int l)
{
    const struct pqc__gpu_tier *u = c->cu;
    const pqc__layer *L = &c->layers[l];
    return u->code_layer[sl] == l && u->code_gen[sl] == L->dgen && u->code_cs[sl] == pqc__gpu_codes_stride(c, l) &&
           u->code_n[sl] <= L->n_coded;
}

/* Enqueues layer l's search on the cache's stream: codebooks and codes where needed, the
   lookup tables of the queries already in u->q, the scan and the top-k of every head
   (`take`, or k_head[h] where the device list k_head gives fewer) into u->topk (and
   their scores into u->topk_sc when want_scores). Nothing waits. */
/* The layer's codebooks on the device (with the norms and weights of weighted coding),
   copied once per build. */
static pqc_result pqc__gpu_cents(pqc_cache *c, int l)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__layer *L = &c->layers[l];
    size_t nkv = (size_t)u->n_kv, tab = (size_t)u->m * u->K, h;
    int m = u->m, K = u->K, dsub = u->dsub;
    int64_t c_hs = (int64_t)pqc__gpu_cent_floats(c);
    if (u->cent_gen[l] != L->dgen + 1) {
        size_t cb = tab * (size_t)dsub * sizeof(float), hb = (size_t)c_hs * sizeof(float);
        int weighted = pqc__layer_metric(c, l), j;
        for (h = 0; h < nkv; h++) {
            const pqc_pq *pq = &L->heads[h].pq;
            pqc__dptr base = u->cent[l] + h * hb;
            PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(base, pq->centroids, cb, u->st), "cuMemcpyHtoDAsync");
            if (!weighted) continue;
            /* the norms coding compares with (weighted where the head has a metric; the
               plain ones with weights 1 are the same numbers) and the weights */
            for (j = 0; j < m; j++)
                PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(base + cb + (size_t)j * K * sizeof(float),
                                                              (pq->metric || pq->mblocks ? pq->wnorm : pq->cnorm) +
                                                                  (size_t)j * pq->ksub_pad,
                                                              (size_t)K * sizeof(float), u->st),
                              "cuMemcpyHtoDAsync");
            PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(base + cb + tab * sizeof(float), pq->metric ? pq->metric : u->h_ones,
                                                          (size_t)u->d * sizeof(float), u->st),
                          "cuMemcpyHtoDAsync");
            if (weighted == 2) { /* W_j c out of its transposed copy (pageable: copied before the call returns) */
                const float *src = pq->mblocks ? pq->wcent_t : pq->cent_t;
                int k, e;
                for (j = 0; j < m; j++)
                    for (k = 0; k < K; k++)
                        for (e = 0; e < dsub; e++)
                            u->h_wc[((size_t)j * K + k) * dsub + e] = src[((size_t)j * dsub + e) * pq->ksub_pad + k];
                PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(base + cb + (tab + (size_t)u->d) * sizeof(float), u->h_wc, cb,
                                                              u->st),
                              "cuMemcpyHtoDAsync");
            }
        }
        u->cent_gen[l] = L->dgen + 1;
    }
    return PQC_SUCCESS;
}

/* Each head's top k of s scores (head h's at scores + h * sc_hs floats; k_head: a device
   int32 [n_kv] of smaller k per head, or 0) into out ([head][k] int32, ascending
   positions), and their scores into osc unless 0: three radix passes, per-tile counts,
   ordered compaction. s is at most the score buffers' s_cap. */
static pqc_result pqc__gpu_topk(pqc_cache *c, pqc__dptr scores, int64_t sc_hs, size_t s, size_t k, pqc__dptr k_head,
                                pqc__dptr out, int64_t out_hs, pqc__dptr osc)
{
    struct pqc__gpu_tier *u = c->cu;
    unsigned nkv = (unsigned)u->n_kv, tiles = pqc__cdiv(s, PQC__CU_TILE),
             P = (unsigned)PQC__MAX(PQC__MIN((size_t)u->p_max, (s + 255) / 256), 1);
    int si = (int)s, ki = (int)k, pass;
    int64_t c_cnt_hs = 2 * (int64_t)((u->s_cap + PQC__CU_TILE - 1) / PQC__CU_TILE), os_hs = osc ? out_hs : 0;
    pqc_result r;
    for (pass = 0; pass < 3; pass++) {
        void *p[] = { &scores, &sc_hs, &si, &ki, &pass, &u->hist, &u->state, &k_head };
        if ((r = pqc__gpu_launch(c, PQC__K_PASS, P, nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    {
        void *p[] = { &scores, &sc_hs, &si, &ki, &u->state, &u->counts, &c_cnt_hs, &k_head };
        if ((r = pqc__gpu_launch(c, PQC__K_COUNT, tiles, nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    {
        void *p[] = { &scores, &sc_hs, &si, &ki, &u->state, &u->counts, &c_cnt_hs, &out, &out_hs, &osc, &os_hs,
                      &k_head };
        return pqc__gpu_launch(c, PQC__K_COMPACT, tiles, nkv, 0, p);
    }
}

/* The window's rivals of a device step (PQC_SPLIT_COMPETE; see pqc__select_head): nx
   window tokens from `from` compete with the coded ones; the sinks [0, sink) and the
   window's last tokens up to n join the softmax. slot_of, filled (slot_hs apart),
   mid_end: where the device holds rows (as for pqc__gpu_rerank). */
typedef struct pqc__gpu_rivals {
    size_t nx, nxf, sink, from, n, mid_end, slot_hs; /* nxf: every token scored (nx + sink + the last) */
    pqc__dptr slot_of, filled;
    int cache_blocks; /* the block cache's tables to look in (0: sink and window blocks only) */
} pqc__gpu_rivals;

/* The rivals of layer L's step over n tokens (none unless the step searches), their rows
   looked for in the sink and window blocks only (a device step adds the block cache's
   tables) */
static void pqc__gpu_rivals_at(const pqc_cache *c, const pqc__layer *L, size_t n, int search, pqc__gpu_rivals *rv)
{
    rv->nx = search ? pqc__rivals_of(c, L, n) : 0;
    rv->sink = PQC__MIN((size_t)c->d.n_sink, n);
    rv->mid_end = pqc__mid_end(c, L, n);
    rv->from = PQC__MAX(rv->mid_end, rv->sink);
    rv->n = n;
    rv->nxf = n - rv->from + rv->sink;
    rv->slot_hs = 1;
    rv->slot_of = rv->filled = 0;
    rv->cache_blocks = 0;
}

/* The rivals' exact dots (pqc_rival_cands, pqc_rerank_dots over the rows the device
   holds), into u->rv_dots [n_kv][g][rv_cap]. */
static pqc_result pqc__gpu_rival_dots(pqc_cache *c, int l, const pqc__gpu_rivals *rv)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nkv = (size_t)u->n_kv, g = (size_t)u->g, nxf = rv->nxf;
    int64_t cand_hs = 0, q_hs = (int64_t)g * u->d, hs = (int64_t)u->hstride, phs = (int64_t)u->phstride,
            split = (int64_t)c->pn, ld = u->d, dots_hs, row_hs;
    int n = (int)nxf, n_sink = c->d.n_sink, gi = u->g, dt = (int)c->d.kv_dtype, d = u->d, nkvi = u->n_kv;
    int bt = (int)u->block_tokens, me = (int)rv->mid_end, nsb = u->sink_blocks, wb = u->window_blocks,
        cbk = rv->cache_blocks, sk = (int)rv->sink, from = (int)rv->from, nx = (int)rv->nx, ni = (int)rv->n;
    int64_t blk_hs = cbk > 0 ? (int64_t)u->adm_nbc[l] : 0, slot_hs = (int64_t)rv->slot_hs,
            pool_hs = (int64_t)u->n_slots * (int64_t)u->block_tokens * u->d;
    /* (every row is in the sinks' and the window's blocks: none is read from host memory) */
    pqc__dptr stat = 0, so = rv->slot_of, fl = rv->filled;
    uint64_t rb = c->row;
    pqc_result r;
    if (nxf > u->rv_cap) {
        size_t want = nxf + nxf / 4 + 256;
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        u->rv_cap = 0;
        if ((r = pqc__gpu_dalloc(c, &u->rv_cand, want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rv_n, nkv * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rv_dots, nkv * g * want * sizeof(float))) != PQC_SUCCESS)
            return r;
        u->rv_cap = want;
    }
    row_hs = (int64_t)u->rv_cap;
    dots_hs = (int64_t)g * row_hs;
    {
        void *p[] = { &u->rv_cand, &u->rv_n, &nkvi, &n_sink, &sk, &from, &nx, &ni };
        if ((r = pqc__gpu_launch(c, PQC__K_RIVAL_CANDS, pqc__cdiv(PQC__MAX(nxf, nkv), 256), 1, 0, p)) != PQC_SUCCESS)
            return r;
    }
    {
        void *p[] = { &u->rv_cand, &cand_hs, &u->rv_n, &n, &n_sink, &u->q, &q_hs, &gi, &u->hk[l], &hs, &u->pk[l], &phs,
                      &split, &ld, &dt, &d, &bt, &me, &nsb, &wb, &cbk, &so, &blk_hs, &fl, &slot_hs,
                      &u->pool_k[l], &pool_hs, &stat, &rb, &u->rv_dots, &dots_hs, &row_hs };
        if ((r = pqc__gpu_launch(c, PQC__K_RR_DOTS, pqc__cdiv(nxf, 8), (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    return PQC_SUCCESS;
}

static pqc_result pqc__gpu_search(pqc_cache *c, int l, size_t take, pqc__dptr k_head, int want_scores,
                                  const pqc__gpu_rivals *rv)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__layer *L = &c->layers[l];
    size_t s = L->n_coded, nkv = (size_t)u->n_kv, tab = (size_t)u->m * u->K, nx = rv ? rv->nx : 0;
    int sl, si = (int)s, ki = (int)take, m = u->m, b = u->bits, K = u->K, dsub = u->dsub, g = u->g, mode;
    int half = pqc__half_bands(&c->d.pq);
    int nl = (l + 1) % c->d.n_layers, n_luts, use_smem;
    unsigned P, smem;
    float scale = c->sp.scale;
    pqc_result r;
    int64_t q_hs = (int64_t)g * u->d, c_hs = (int64_t)pqc__gpu_cent_floats(c), l_hs = (int64_t)((size_t)g * tab),
            ls_hs = (int64_t)tab, code_hs, cs, p_hs, st_hs = 2 * g, sc_hs, idx_hs = ki;
    pqc__dptr zero = 0, lut_sum, lut;
    if (s > 0x7fffffffu) return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: more than 2^31 coded tokens");
    pqc__gpu_enter(c);
    /* score, top-k and read-back buffers (the rivals' scores after the coded tokens') */
    if (s + nx > u->s_cap) {
        size_t want = s + nx + (s + nx) / 4 + 1024, tiles_cap = (want + PQC__CU_TILE - 1) / PQC__CU_TILE;
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        u->s_cap = 0;
        if ((r = pqc__gpu_dalloc(c, &u->scores, nkv * want * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->counts, nkv * tiles_cap * 2 * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->topk, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->topk_sc, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_halloc(c, (void **)&u->h_topk, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_halloc(c, (void **)&u->h_topk_sc, nkv * want * 4)) != PQC_SUCCESS)
            return r;
        u->s_cap = want;
    }
    if ((r = pqc__gpu_cents(c, l)) != PQC_SUCCESS) return r;
    /* the layer's codes: resident, prefetched by the previous layer's select, or copied now */
    if (u->code_bufs > 2) {
        sl = l;
        if (!pqc__gpu_codes_valid(c, sl, l) && (r = pqc__gpu_codes_upload(c, sl, l)) != PQC_SUCCESS) return r;
    } else if (pqc__gpu_codes_valid(c, 0, l)) {
        sl = 0;
    } else if (pqc__gpu_codes_valid(c, 1, l)) {
        sl = 1;
    } else {
        sl = u->last_slot ^ 1;
        if ((r = pqc__gpu_codes_upload(c, sl, l)) != PQC_SUCCESS) return r;
    }
    if (u->code_n[sl] < s && u->dsub > 256 && (r = pqc__gpu_codes_upload(c, sl, l)) != PQC_SUCCESS)
        return r; /* sub-vectors too long for the coding kernel: copy the new codes instead */
    PQC__GPU_CALL(c, u->api->cuStreamWaitEvent(u->st, u->ev_codes[sl], 0), "cuStreamWaitEvent");
    code_hs = (int64_t)u->code_hs[sl];
    cs = (int64_t)u->code_cs[sl];
    while (u->code_n[sl] < s) { /* tokens coded since the copy: code them on the device too (a
                                   fork's shared rows and its own rows in one launch each) */
        size_t t0z = u->code_n[sl], cut = pqc__mid_cut(c, t0z, s), end = cut > t0z ? cut : s;
        size_t row0 = (size_t)c->d.n_sink + t0z;
        int64_t x_ld = u->d, x_hs = (int64_t)(row0 < c->pn ? u->phstride : u->hstride), co_hs = 0;
        int x_dt = (int)c->d.kv_dtype, n = (int)(end - t0z), t0 = (int)t0z, how = pqc__layer_metric(c, l);
        pqc__dptr x = row0 < c->pn ? u->pk[l] + row0 * c->row : u->hk[l] + (row0 - c->pn) * c->row, cn = 0, w = 0;
        pqc__dptr cen = u->cent[l];
        void *p[] = { &x, &x_dt, &x_ld, &x_hs, &n, &cen, &cn, &c_hs, &c_hs, &w, &c_hs, &m, &b, &dsub, &half,
                      &u->code[sl], &code_hs, &cs, &t0, &zero, &co_hs };
        if (how) { /* weighted coding: the uploaded norms and weights */
            cn = u->cent[l] + tab * (size_t)dsub * sizeof(float);
            w = cn + tab * sizeof(float);
        }
        if (how == 2) { /* metric blocks: x.(W_j c) against c.(W_j c), no weights */
            cen = w + (size_t)u->d * sizeof(float);
            w = 0;
        }
        if ((r = pqc__gpu_launch(c, PQC__K_ASSIGN, pqc__cdiv((size_t)n * (size_t)m, 8), (unsigned)nkv, 0, p)) != PQC_SUCCESS)
            return r;
        u->code_n[sl] = end;
    }
    /* query -> lookup tables */
    lut_sum = c->sp.gqa == PQC_GQA_SUM ? u->lut_sum : 0;
    if (u->lut_pre) { /* a batch built them (pqc__gpu_batch_tables) */
        u->lut_pre = 0;
    } else {
        void *p[] = { &u->q, &q_hs, &u->cent[l], &c_hs, &g, &m, &K, &dsub, &half, &u->lut, &l_hs, &lut_sum, &ls_hs };
        u->batch_ok = 0; /* the tables are this search's now */
        if ((r = pqc__gpu_launch(c, PQC__K_LUT, pqc__cdiv(tab, 256), (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    /* scan: combined scores of every coded token */
    P = (unsigned)PQC__MIN((size_t)u->p_max, (s + 255) / 256);
    if (P < 1) P = 1;
    p_hs = (int64_t)g * P * 2;
    sc_hs = (int64_t)u->s_cap;
    if (c->sp.gqa == PQC_GQA_SUM) {
        n_luts = 1;
        mode = 0;
        lut = u->lut_sum;
        l_hs = ls_hs;
    } else {
        n_luts = g;
        mode = 1;
        lut = u->lut;
    }
    smem = (unsigned)((size_t)n_luts * tab * sizeof(float));
    use_smem = smem <= (unsigned)u->r->smem_limit;
    if (!use_smem) smem = 0;
    if (mode == 1) {
        int np = (int)P;
        void *p1[] = { &u->code[sl], &code_hs, &cs, &si, &m, &b, &lut, &l_hs, &n_luts, &scale, &u->partial, &p_hs, &use_smem };
        void *p2[] = { &u->partial, &p_hs, &np, &n_luts, &scale, &u->stats, &st_hs };
        if ((r = pqc__gpu_launch(c, PQC__K_STATS, P, (unsigned)nkv, smem, p1)) != PQC_SUCCESS) return r;
        if ((r = pqc__gpu_launch(c, PQC__K_FINAL, 1, (unsigned)nkv, 0, p2)) != PQC_SUCCESS) return r;
    }
    if (nx > 0) { /* the rivals' dots; they join the softmax after the coded tokens */
        int64_t rs, dhs;
        int nxf = (int)rv->nxf;
        if ((r = pqc__gpu_rival_dots(c, l, rv)) != PQC_SUCCESS) return r;
        rs = (int64_t)u->rv_cap;
        dhs = (int64_t)g * rs;
        if (mode == 1) {
            void *p[] = { &u->rv_dots, &dhs, &rs, &nxf, &g, &scale, &u->stats, &st_hs };
            if ((r = pqc__gpu_launch(c, PQC__K_RIVAL_STATS, 1, (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
        }
    }
    {
        pqc__dptr stats = mode == 1 ? u->stats : 0;
        void *p[] = { &u->code[sl], &code_hs, &cs, &si, &m, &b, &lut, &l_hs, &n_luts, &mode, &stats, &st_hs, &scale,
                      &u->scores, &sc_hs, &use_smem };
        if ((r = pqc__gpu_launch(c, PQC__K_SCAN, P, (unsigned)nkv, smem, p)) != PQC_SUCCESS) return r;
    }
    if (nx > 0) { /* the rivals' scores after the coded tokens' */
        int64_t rs = (int64_t)u->rv_cap, dhs = (int64_t)g * rs;
        int nxi = (int)nx;
        pqc__dptr stats = mode == 1 ? u->stats : 0;
        void *p[] = { &u->rv_dots, &dhs, &rs, &nxi, &g, &mode, &stats, &st_hs, &scale, &si, &u->scores, &sc_hs };
        if ((r = pqc__gpu_launch(c, PQC__K_RIVAL_SCORES, pqc__cdiv(nx, 256), (unsigned)nkv, 0, p)) != PQC_SUCCESS)
            return r;
    }
    PQC__GPU_CALL(c, u->api->cuEventRecord(u->ev_used[sl], u->st), "cuEventRecord");
    u->last_slot = sl;
    if ((r = pqc__gpu_topk(c, u->scores, sc_hs, s + nx, take, k_head, u->topk, idx_hs, want_scores ? u->topk_sc : 0)) !=
        PQC_SUCCESS)
        return r;
    /* prefetch the next layer's codes while this one finishes */
    if (u->code_bufs == 2 && nl != l && !c->layers[nl].building && c->layers[nl].heads[0].pq.m && c->layers[nl].n_coded > 0 &&
        !pqc__gpu_codes_valid(c, sl ^ 1, nl) && (r = pqc__gpu_codes_upload(c, sl ^ 1, nl)) != PQC_SUCCESS)
        return r;
    return PQC_SUCCESS;
}

/* The tier's search for a host-side selection: the top-k indices (and scores) come back
   to the host, one synchronisation. */
static pqc_result pqc__gpu_select(pqc_cache *c, int l, const float *q, size_t take, int want_scores,
                                  const int32_t **idx_out, const float **sc_out)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nkv = (size_t)u->n_kv;
    pqc_result r;
    size_t qbytes = (size_t)c->d.n_q_heads * u->d * sizeof(float);
    pqc__gpu_rivals rv;
    pqc__gpu_enter(c);
    /* the window's rivals, their rows read from the device's sink and window blocks (the
       block cache's tables may be on the host now) */
    pqc__gpu_rivals_at(c, &c->layers[l], c->layers[l].n_tokens, !c->sp.exact, &rv);
    /* tables a batch built for these queries and codebooks need neither the queries nor
       the table kernel (the stream already waits for them) */
    u->lut_pre = u->batch_ok && u->batch_layer == l && u->batch_gen == c->layers[l].dgen + 1 && u->cent_gen[l] == u->batch_gen &&
                 memcmp(u->batch_q, q, qbytes) == 0;
    u->batch_ok = 0;
    if (!u->lut_pre || rv.nx) { /* (the rivals' dots need the queries) */
        memcpy(u->h_q, q, qbytes);
        PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(u->q, u->h_q, qbytes, u->st), "cuMemcpyHtoDAsync");
    }
    r = pqc__gpu_search(c, l, take, 0, want_scores, rv.nx ? &rv : NULL);
    u->lut_pre = 0;
    if (r != PQC_SUCCESS) return r;
    PQC__GPU_CALL(c, u->api->cuMemcpyDtoHAsync_v2(u->h_topk, u->topk, nkv * take * 4, u->st), "cuMemcpyDtoHAsync");
    if (want_scores)
        PQC__GPU_CALL(c, u->api->cuMemcpyDtoHAsync_v2(u->h_topk_sc, u->topk_sc, nkv * take * 4, u->st),
                      "cuMemcpyDtoHAsync");
    PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
    *idx_out = u->h_topk;
    *sc_out = want_scores ? u->h_topk_sc : NULL;
    return PQC_SUCCESS;
}

/* ---- the lookup tables of a batch of sequences in one cuBLASLt call ----

   Per (cache, KV head, sub-space) the tables are a small product: D (K x g, ld m*K, the
   layout of u->lut) = C^T Q, with C the sub-space's codebook ([K][dsub] row-major, i.e.
   dsub x K column-major, ld dsub) and Q its query heads' dims (dsub x g, ld d; the
   queries are staged with each sub-space's dims together, so the RoPE-band layout needs
   no strides). pqc_batch_select makes those of all its CUDA caches one pointer-array
   matmul before the selects run, on the runtime's own stream (after every cache's
   staging copies); each cache's stream waits for it and its search skips
   the table kernel. Unless PQC_LUT_GEMM forces a path, the first four batches of a shape
   class (g, dsub, K, entries rounded up to a power of two) alternate the table kernel
   and the matmul, timed with events, and the class keeps the faster (a tie keeps the
   kernel, which then leaves each cache to build its own tables, as without a batch). */
typedef struct pqc__batch_class {
    int g, dsub, K, elog; /* the shape; entries <= 2^elog */
    int gemm, tries;      /* the decision (tries == 4), or batches timed so far */
    int failed;           /* a matmul of this class failed: the kernel, even when forced */
    float ms[4];
} pqc__batch_class;

struct pqc__batch_luts {
    pqc__km_plan plan;            /* the matmul of plan_key, plan_e entries */
    int plan_key[4];              /* g, dsub, K, d */
    int32_t plan_e;
    pqc__dptr dptr;               /* [3][cap] device pointer arrays: codebooks, queries, tables
                                     (the first E of each array used) */
    uint64_t *hptr;               /* their pinned staging */
    size_t cap;
    pqc__cuStream st;             /* the batches' own stream (each cache's stream waits for it) */
    pqc__cuEvent ev_done, ev_t0;  /* the last batch's work is done; a timing start */
    pqc__batch_class cls[PQC__KM_CLASSES];
    int n_cls, next_cls;
    uint64_t gemm_batches, kernel_batches; /* batches whose tables each path built */
};

static void pqc__batch_luts_free(pqc_runtime *rt)
{
    struct pqc__gpu_device *cr = rt->cu;
    struct pqc__batch_luts *lb = cr->batch;
    if (!lb) return;
    if (lb->ev_done) {
        cr->api.cuEventSynchronize(lb->ev_done);
        cr->api.cuEventDestroy_v2(lb->ev_done);
    }
    if (lb->ev_t0) cr->api.cuEventDestroy_v2(lb->ev_t0);
    if (lb->st) cr->api.cuStreamDestroy_v2(lb->st);
    pqc__km_plan_free(&cr->api, &lb->plan);
    if (lb->dptr) cr->api.cuMemFree_v2(lb->dptr);
    if (lb->hptr) cr->api.cuMemFreeHost(lb->hptr);
    pqc__free(&rt->alloc, lb);
    cr->batch = NULL;
}

static void pqc__gpu_close(pqc_runtime *rt)
{
    struct pqc__gpu_device *cr = rt->cu;
    if (!cr) return;
    cr->api.cuCtxSetCurrent(cr->dev.ctx);
    pqc__batch_luts_free(rt);
    if (cr->lt) cr->api.cublasLtDestroy(cr->lt);
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_destroy(&cr->km_mu);
#endif
    if (cr->mod) cr->api.cuModuleUnload(cr->mod);
    pqc__cu_device_close(&cr->api, &cr->dev);
    pqc__cu_unload(&cr->api);
    pqc__free(&rt->alloc, cr);
    rt->cu = NULL;
}


/* A cache whose layer-l tables the batch led by c0 can build: CUDA tier on c0's runtime,
   the layer coded with codebooks, searched by this tier (the plan's c->sp.tier_search),
   and c0's shape. */
static int pqc__gpu_batch_fits(pqc_cache *c, const pqc_cache *c0, int l, const float *q)
{
    const struct pqc__gpu_tier *u, *u0 = c0->cu;
    if (!c || !q || !(u = c->cu) || c->tier != c0->tier || c->rt != c0->rt || !u->ready || l < 0 ||
        l >= c->d.n_layers)
        return 0;
    if (!c->layers[l].heads[0].pq.m || c->layers[l].n_coded == 0 || !c->sp.tier_search) return 0;
    return u->g == u0->g && u->dsub == u0->dsub && u->K == u0->K && u->d == u0->d && u->m == u0->m &&
           c->d.n_q_heads == c0->d.n_q_heads;
}

/* This cache's queries staged for the batch (sub-space dims together) and copied up on
   its stream, with its codebooks; ev_qb marks both done. */
static pqc_result pqc__gpu_batch_stage(pqc_cache *c, int l, const float *q)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t qbytes = (size_t)c->d.n_q_heads * u->d * sizeof(float);
    int half = pqc__half_bands(&c->d.pq);
    int hq, j, e, h2 = u->dsub / 2;
    pqc_result r;
    pqc__gpu_enter(c);
    if (!u->qb && ((r = pqc__gpu_dalloc(c, &u->qb, qbytes)) != PQC_SUCCESS ||
                   (r = pqc__gpu_halloc(c, (void **)&u->h_qb, qbytes)) != PQC_SUCCESS))
        return r;
    if (!u->batch_q && !(u->batch_q = (float *)pqc__alloc(&c->alloc, qbytes)))
        return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
    if (!u->ev_qb) PQC__GPU_CALL(c, u->api->cuEventCreate(&u->ev_qb, PQC__CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    if ((r = pqc__gpu_cents(c, l)) != PQC_SUCCESS) return r;
    for (hq = 0; hq < c->d.n_q_heads; hq++) {
        const float *src = q + (size_t)hq * u->d;
        float *dst = u->h_qb + (size_t)hq * u->d;
        for (j = 0; j < u->m; j++)
            for (e = 0; e < u->dsub; e++)
                dst[j * u->dsub + e] = src[!half ? j * u->dsub + e : e < h2 ? j * h2 + e : u->d / 2 + j * h2 + (e - h2)];
    }
    PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(u->qb, u->h_qb, qbytes, u->st), "cuMemcpyHtoDAsync");
    PQC__GPU_CALL(c, u->api->cuEventRecord(u->ev_qb, u->st), "cuEventRecord");
    return PQC_SUCCESS;
}

/* The batched tables' path for a shape class, for reports: 1 and *out once the class
   has been met (out->tries == 4: decided), else 0; batches whose tables each path built
   in *gemm_batches, *kernel_batches. rt must be a CUDA runtime. */
PQC__CU_FN int pqc__cuda_lut_choice(pqc_runtime *rt, int g, int dsub, int K, size_t entries, pqc__batch_class *out,
                                    uint64_t *gemm_batches, uint64_t *kernel_batches)
{
    struct pqc__gpu_device *cr = rt && rt->cu ? rt->cu : NULL;
    int i, elog = 0, hit = 0;
    if (!cr) return 0;
    while (((size_t)1 << elog) < entries) elog++;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&cr->km_mu);
#endif
    *gemm_batches = cr->batch ? cr->batch->gemm_batches : 0;
    *kernel_batches = cr->batch ? cr->batch->kernel_batches : 0;
    for (i = 0; cr->batch && i < cr->batch->n_cls && !hit; i++)
        if (cr->batch->cls[i].g == g && cr->batch->cls[i].dsub == dsub && cr->batch->cls[i].K == K && cr->batch->cls[i].elog == elog) {
            *out = cr->batch->cls[i];
            hit = 1;
        }
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&cr->km_mu);
#endif
    return hit;
}

static void pqc__gpu_batch_tables(pqc_cache *const *caches, int n, int l, const float *const *q)
{
    pqc_cache *c0 = NULL;
    struct pqc__gpu_device *cr;
    struct pqc__batch_luts *lb;
    pqc__cuApi *api;
    pqc__cuStream gs;
    pqc__batch_class *cls = NULL;
    size_t E = 0, e = 0, tab;
    int i, g, dsub, K, d, m, gemm, elog = 0, timed = 0, ok = 0, ci;
    int64_t l_hs, ls_hs, c_hs;
    const char *what = "";
    char msg[200];
    if (!caches || !q || n < 1) return;
    for (i = 0; i < n && !c0; i++)
        if (caches[i] && caches[i]->cu && pqc__gpu_batch_fits(caches[i], caches[i], l, q[i])) c0 = caches[i];
    if (!c0) return;
    cr = c0->cu->r;
    api = c0->cu->api;
    g = c0->cu->g, dsub = c0->cu->dsub, K = c0->cu->K, d = c0->cu->d, m = c0->cu->m;
    tab = (size_t)m * K;
    if (!cr->lt || cr->lut_force == 0 || dsub % 4 || K % 4) return; /* 16-byte aligned matrices */
    for (i = 0; i < n; i++)
        if (pqc__gpu_batch_fits(caches[i], c0, l, q[i])) E += (size_t)c0->cu->n_kv * m;
    if (E > 0x7fffffff) return;
    while (((size_t)1 << elog) < E) elog++;
    l_hs = (int64_t)((size_t)g * tab);
    ls_hs = (int64_t)tab;
    c_hs = (int64_t)pqc__gpu_cent_floats(c0);
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_lock(&cr->km_mu);
#endif
    api->cuCtxSetCurrent(cr->dev.ctx);
    if (!(lb = cr->batch)) {
        if (!(lb = (struct pqc__batch_luts *)pqc__calloc(&c0->rt->alloc, sizeof *lb))) goto out;
        cr->batch = lb;
        if (api->cuStreamCreate(&lb->st, PQC__CU_STREAM_NON_BLOCKING) != 0 ||
            api->cuEventCreate(&lb->ev_done, PQC__CU_EVENT_DEFAULT) != 0 ||
            api->cuEventCreate(&lb->ev_t0, PQC__CU_EVENT_DEFAULT) != 0) {
            pqc__batch_luts_free(c0->rt);
            goto out;
        }
    }
    /* the path: forced, decided for this class, or timed now */
    for (i = 0; i < lb->n_cls && !cls; i++)
        if (lb->cls[i].g == g && lb->cls[i].dsub == dsub && lb->cls[i].K == K && lb->cls[i].elog == elog)
            cls = &lb->cls[i];
    if (!cls) {
        if (lb->n_cls < PQC__KM_CLASSES) {
            cls = &lb->cls[lb->n_cls++];
        } else {
            cls = &lb->cls[lb->next_cls];
            lb->next_cls = (lb->next_cls + 1) % PQC__KM_CLASSES;
        }
        memset(cls, 0, sizeof *cls);
        cls->g = g, cls->dsub = dsub, cls->K = K, cls->elog = elog;
    }
    if (cls->failed) {
        goto out;
    } else if (cr->lut_force == 1) {
        gemm = 1;
    } else if (cls->tries >= 4) {
        if (!cls->gemm) goto out; /* the kernel: each cache builds its own */
        gemm = 1;
    } else {
        gemm = cls->tries & 1;
        timed = 1;
    }
    /* the previous batch's arrays are free once its work is done */
    if (api->cuEventSynchronize(lb->ev_done) != 0) goto out;
    if (gemm && E > lb->cap) { /* room for whole multiples of 32 pointers: each array 256-byte aligned */
        size_t cap = (E + 31) & ~(size_t)31;
        if (lb->dptr) api->cuMemFree_v2(lb->dptr);
        if (lb->hptr) api->cuMemFreeHost(lb->hptr);
        lb->dptr = 0;
        lb->hptr = NULL;
        lb->cap = 0;
        if (api->cuMemAlloc_v2(&lb->dptr, 3 * cap * sizeof(uint64_t)) != 0 ||
            api->cuMemHostAlloc((void **)&lb->hptr, 3 * cap * sizeof(uint64_t), PQC__CU_MEMHOSTALLOC_PORTABLE) != 0) {
            what = "pointer arrays";
            goto fail;
        }
        lb->cap = cap;
    }
    /* every cache's queries and codebooks up, and the pointers of its products */
    for (ci = 0; ci < n; ci++) {
        pqc_cache *c = caches[ci];
        struct pqc__gpu_tier *u;
        size_t h;
        int j;
        if (!pqc__gpu_batch_fits(c, c0, l, q[ci])) continue;
        u = c->cu;
        if (pqc__gpu_batch_stage(c, l, q[ci]) != PQC_SUCCESS) {
            what = "staging a sequence's queries";
            goto fail;
        }
        for (h = 0; gemm && h < (size_t)u->n_kv; h++)
            for (j = 0; j < m; j++, e++) {
                lb->hptr[e] = (uint64_t)(u->cent[l] + ((size_t)h * (size_t)c_hs + (size_t)j * K * dsub) * sizeof(float));
                lb->hptr[lb->cap + e] = (uint64_t)(u->qb + ((size_t)h * g * d + (size_t)j * dsub) * sizeof(float));
                lb->hptr[2 * lb->cap + e] = (uint64_t)(u->lut + ((size_t)h * (size_t)l_hs + (size_t)j * K) * sizeof(float));
            }
    }
    api->cuCtxSetCurrent(cr->dev.ctx);
    gs = lb->st;
    for (ci = 0; ci < n; ci++)
        if (pqc__gpu_batch_fits(caches[ci], c0, l, q[ci]) && api->cuStreamWaitEvent(gs, caches[ci]->cu->ev_qb, 0) != 0) {
            what = "cuStreamWaitEvent";
            goto fail;
        }
    if (timed && api->cuEventRecord(lb->ev_t0, gs) != 0) goto out;
    if (gemm) {
        float one = 1.0f, nil = 0.0f;
        pqc__cuBlasStatus ls = 0;
        if (lb->plan_e != (int32_t)E || lb->plan_key[0] != g || lb->plan_key[1] != dsub || lb->plan_key[2] != K ||
            lb->plan_key[3] != d) {
            pqc__km_plan_free(api, &lb->plan);
            lb->plan_e = 0;
            ls = pqc__lt_plan_make(cr, &lb->plan, (uint64_t)dsub, (uint64_t)K, dsub, (uint64_t)g, d, (int64_t)tab,
                                   (int32_t)E, &what);
            if (ls != 0) {
                snprintf(msg, sizeof msg, "batched lookup tables: no cuBLASLt plan (%s status %d); the kernel builds them",
                         what, (int)ls);
                pqc__log(c0->rt, PQC_LOG_WARN, msg);
                cls->failed = 1; /* this class stays with the kernel */
                goto out;
            }
            lb->plan_key[0] = g, lb->plan_key[1] = dsub, lb->plan_key[2] = K, lb->plan_key[3] = d;
            lb->plan_e = (int32_t)E;
        }
        if (api->cuMemcpyHtoDAsync_v2(lb->dptr, lb->hptr, 3 * lb->cap * sizeof(uint64_t), gs) != 0) {
            what = "cuMemcpyHtoDAsync";
            goto fail;
        }
        ls = api->cublasLtMatmul(cr->lt, lb->plan.desc, &one, (const void *)(uintptr_t)lb->dptr, lb->plan.la,
                                 (const void *)(uintptr_t)(lb->dptr + lb->cap * sizeof(uint64_t)), lb->plan.lb, &nil,
                                 (const void *)(uintptr_t)(lb->dptr + 2 * lb->cap * sizeof(uint64_t)), lb->plan.lc,
                                 (void *)(uintptr_t)(lb->dptr + 2 * lb->cap * sizeof(uint64_t)), lb->plan.lc,
                                 &lb->plan.algo.algo,
                                 NULL, 0, gs);
        if (ls != 0) {
            snprintf(msg, sizeof msg, "batched lookup tables: cublasLtMatmul failed (status %d); the kernel builds them",
                     (int)ls);
            pqc__log(c0->rt, PQC_LOG_WARN, msg);
            cls->failed = 1;
            goto out;
        }
    }
    for (ci = 0; ci < n; ci++) { /* the GQA sum tables, or (timing the kernel) all tables */
        pqc_cache *c = caches[ci];
        struct pqc__gpu_tier *u;
        pqc__dptr lut_sum;
        int ti = (int)tab, zero = 0;
        int64_t q_hs = (int64_t)g * d;
        if (!pqc__gpu_batch_fits(c, c0, l, q[ci])) continue;
        u = c->cu;
        lut_sum = c->sp.gqa == PQC_GQA_SUM ? u->lut_sum : 0;
        if (gemm && lut_sum) {
            void *p[] = { &u->lut, &l_hs, &g, &ti, &lut_sum, &ls_hs };
            if (api->cuLaunchKernel(cr->fn[PQC__K_LUT_SUM], (unsigned)pqc__cdiv(tab, 256), (unsigned)u->n_kv, 1, 256, 1,
                                    1, 0, gs, p, NULL) != 0) {
                what = "pqc_lut_sum";
                goto fail;
            }
        } else if (!gemm) {
            void *p[] = { &u->qb, &q_hs, &u->cent[l], &c_hs, &g, &m, &K, &dsub, &zero, &u->lut, &l_hs, &lut_sum, &ls_hs };
            if (api->cuLaunchKernel(cr->fn[PQC__K_LUT], (unsigned)pqc__cdiv(tab, 256), (unsigned)u->n_kv, 1, 256, 1, 1,
                                    0, gs, p, NULL) != 0) {
                what = "pqc_lut_build";
                goto fail;
            }
        }
    }
    if (api->cuEventRecord(lb->ev_done, gs) != 0) {
        what = "cuEventRecord";
        goto fail;
    }
    for (ci = 0; ci < n; ci++) { /* each cache's work after the tables */
        pqc_cache *c = caches[ci];
        struct pqc__gpu_tier *u;
        if (!pqc__gpu_batch_fits(c, c0, l, q[ci])) continue;
        u = c->cu;
        if (api->cuStreamWaitEvent(u->st, lb->ev_done, 0) != 0) {
            what = "cuStreamWaitEvent";
            goto fail;
        }
    }
    for (ci = 0; ci < n; ci++) { /* only now are the tables theirs */
        pqc_cache *c = caches[ci];
        struct pqc__gpu_tier *u;
        if (!pqc__gpu_batch_fits(c, c0, l, q[ci])) continue;
        u = c->cu;
        u->batch_ok = 1;
        u->batch_layer = l;
        u->batch_gen = u->cent_gen[l];
        memcpy(u->batch_q, q[ci], (size_t)c->d.n_q_heads * u->d * sizeof(float));
    }
    if (gemm) lb->gemm_batches++;
    else lb->kernel_batches++;
    ok = 1;
    if (timed) {
        float ms = 0.0f;
        c0->cu->waits++; /* the first batches of a class wait once, to read the timer */
        if (api->cuEventSynchronize(lb->ev_done) == 0 && api->cuEventElapsedTime(&ms, lb->ev_t0, lb->ev_done) == 0) {
            cls->ms[cls->tries++] = ms;
            if (cls->tries == 4) /* the faster of two runs each; a tie keeps the kernel */
                cls->gemm = (cls->ms[1] < cls->ms[3] ? cls->ms[1] : cls->ms[3]) <
                            (cls->ms[0] < cls->ms[2] ? cls->ms[0] : cls->ms[2]);
        }
    }
    goto out;
fail:
    snprintf(msg, sizeof msg, "batched lookup tables: %s failed; each sequence builds its own", what);
    pqc__log(c0->rt, PQC_LOG_WARN, msg);
out:
    if (!ok)
        for (ci = 0; ci < n; ci++)
            if (caches[ci] && caches[ci]->cu && caches[ci]->tier == c0->tier) caches[ci]->cu->batch_ok = 0;
#ifndef PQCACHE_NO_THREADS
    pthread_mutex_unlock(&cr->km_mu);
#endif
}

/* Device memory held by the tier: slot pools, centroids, code buffers, scratch. */
static size_t pqc__gpu_device_bytes(const pqc_cache *c)
{
    const struct pqc__gpu_tier *u = c->cu;
    size_t L = (size_t)c->d.n_layers, nkv = (size_t)u->n_kv, tab = (size_t)u->m * u->K, b;
    int i;
    b = L * 2 * nkv * (size_t)u->n_slots * u->block_tokens * c->row;              /* slots */
    b += L * nkv * pqc__gpu_cent_floats(c) * sizeof(float);              /* centroids, norms, weights */
    for (i = 0; i < u->code_bufs; i++) b += u->code_cap[i];                   /* codes */
    b += nkv * u->s_cap * 12 + nkv * (u->s_cap / PQC__CU_TILE + 1) * 8;    /* scores, top-k, its scores */
    b += 2 * nkv * u->rows_cap * (size_t)u->d * sizeof(float) + u->arena_cap * 4 + u->iota_n * 4;
    b += nkv * ((size_t)u->g + 1) * tab * sizeof(float) + nkv * (PQC__CU_RADIX_BINS * 4 + 16) +
         nkv * (size_t)u->g * ((size_t)u->p_max + 1) * 8 + (size_t)c->d.n_q_heads * u->d * sizeof(float);
    return b;
}

/* Before a fetch's bookkeeping: the upload arena of the previous fetch is free again. */
static pqc_result pqc__gpu_fetch_begin(pqc_cache *c)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__gpu_enter(c);
    if (!u->ready) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "CUDA tier: fetch before prefill");
    PQC__GPU_WAIT(c, u->api->cuEventSynchronize(u->ev_staged), "cuEventSynchronize");
    memset(u->nfill, 0, (size_t)u->n_kv * sizeof(size_t));
    return PQC_SUCCESS;
}

/* Room for `rows` gathered rows per head: the upload arena [slot table | indices | fill
   lists] on host and device and the output rows (grown by a quarter more; growing waits
   for the stream, which happens rarely). */
static pqc_result pqc__gpu_rows_room(pqc_cache *c, size_t rows)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nkv = (size_t)u->n_kv, cb = (size_t)c->d.cache_blocks + 1, words;
    pqc_result r;
    if (rows > 0x7fffffffu) return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: selection too large");
    if (rows > u->rows_cap || u->nblk_cap * nkv + rows * nkv + 2 * cb * nkv > u->arena_cap) {
        size_t want_rows = PQC__MAX(rows + rows / 4, u->rows_cap);
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        words = nkv * (u->nblk_cap + want_rows + 2 * cb);
        u->rows_cap = u->arena_cap = 0;
        if ((r = pqc__gpu_dalloc(c, &u->arena, words * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_halloc(c, (void **)&u->h_arena, words * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->out_k, nkv * want_rows * (size_t)u->d * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->out_v, nkv * want_rows * (size_t)u->d * sizeof(float))) != PQC_SUCCESS)
            return r;
        u->rows_cap = want_rows;
        u->arena_cap = words;
    }
    return PQC_SUCCESS;
}

/* The gathered rows as the caller's device view (pos: the selection on the device). */
static void pqc__gpu_rows_device(pqc_cache *c, pqc__dptr pos, pqc_kv_device *dout)
{
    struct pqc__gpu_tier *u = c->cu;
    dout->k = u->out_k;
    dout->v = u->out_v;
    dout->head_stride = u->rows_cap;
    dout->pos = pos;
}

/* Enqueues the copies of head h's count[h] gathered rows into out (the caller waits). */
static pqc_result pqc__gpu_rows_home(pqc_cache *c, const size_t *count, const pqc_kv_out *out)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t h, d = (size_t)u->d;
    for (h = 0; h < (size_t)u->n_kv; h++) {
        size_t bytes = count[h] * d * sizeof(float), off = h * u->rows_cap * d * sizeof(float);
        if (!bytes) continue;
        PQC__GPU_CALL(c, u->api->cuMemcpyDtoHAsync_v2(out->k + h * out->head_stride * d, u->out_k + off, bytes, u->st),
                      "cuMemcpyDtoHAsync");
        PQC__GPU_CALL(c, u->api->cuMemcpyDtoHAsync_v2(out->v + h * out->head_stride * d, u->out_v + off, bytes, u->st),
                      "cuMemcpyDtoHAsync");
    }
    return PQC_SUCCESS;
}

/* After the bookkeeping: admitted blocks are copied into their slots, then every selected
   row is gathered (slots, sink and window blocks from device memory, misses straight from
   the mapped store) as fp32, into device buffers, and copied to `out` when given. */
static pqc_result pqc__gpu_fetch_run(pqc_cache *c, int l, const pqc_selection *sel, const pqc_kv_out *out,
                                     pqc_kv_device *dout)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__layer *L = &c->layers[l];
    size_t nkv = (size_t)u->n_kv, n = L->n_tokens, nb = (n + u->block_tokens - 1) / u->block_tokens, mid_end = pqc__mid_end(c, L, n);
    size_t rows = 1, fills = 0, h, i, b, cb = (size_t)c->d.cache_blocks + 1, words;
    int32_t *tab, *idx, *fb, *fs;
    pqc_result r;
    for (h = 0; h < nkv; h++) {
        rows = PQC__MAX(rows, sel->count[h]);
        fills = PQC__MAX(fills, u->nfill[h]);
    }
    if ((r = pqc__gpu_rows_room(c, rows)) != PQC_SUCCESS) return r;
    /* arena: slot table [nkv][nblk_cap] | indices [nkv][rows_cap] | fills [nkv][2][cb] */
    tab = u->h_arena;
    idx = tab + nkv * u->nblk_cap;
    fb = idx + nkv * u->rows_cap;
    for (h = 0; h < nkv; h++) {
        const pqc__head *H = &L->heads[h];
        int32_t *t = tab + h * u->nblk_cap, *x = idx + h * u->rows_cap;
        const uint32_t *si = sel->idx + h * sel->capacity;
        size_t cnt = sel->count[h];
        for (b = 0; b < nb; b++) {
            int s = pqc__gpu_fixed_slot(c, b, mid_end);
            if (s < 0 && c->d.cache_blocks > 0 && H->slot_of[b] >= 0 && H->filled[H->slot_of[b]] >= (uint32_t)u->block_tokens)
                s = u->sink_blocks + u->window_blocks + H->slot_of[b];
            t[b] = s;
        }
        for (i = 0; i < cnt; i++) x[i] = (int32_t)si[i];
        for (; i < rows; i++) x[i] = 0; /* padding rows gather token 0 into unused rows */
        fs = fb + h * 2 * cb;
        for (i = 0; i < fills; i++) { /* padding entries name a block past the end: skipped */
            fs[i] = i < u->nfill[h] ? u->fill_b[h * cb + i] : (int32_t)nb;
            fs[cb + i] = i < u->nfill[h] ? u->fill_s[h * cb + i] : 0;
        }
    }
    words = nkv * (u->nblk_cap + u->rows_cap + 2 * cb);
    PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(u->arena, u->h_arena, words * 4, u->st), "cuMemcpyHtoDAsync");
    PQC__GPU_CALL(c, u->api->cuEventRecord(u->ev_staged, u->st), "cuEventRecord");
    {
        pqc__dptr dtab = u->arena, didx = u->arena + nkv * u->nblk_cap * 4, dfb = didx + nkv * u->rows_cap * 4,
                  dfs = dfb + cb * 4, zero = 0;
        int64_t list_hs = 2 * (int64_t)cb, hs = (int64_t)u->hstride, ld = u->d,
                pool_hs = (int64_t)u->n_slots * (int64_t)u->block_tokens * u->d, idx_hs = (int64_t)u->rows_cap,
                sl_hs = (int64_t)u->nblk_cap, o_hs = (int64_t)u->rows_cap * u->d, phs = (int64_t)u->phstride,
                split = (int64_t)c->pn;
        int bt = (int)u->block_tokens, row_lo = 0, si = (int)n, dt = (int)c->d.kv_dtype, d = u->d, nf = (int)fills, nr = (int)rows;
        void *pf[] = { &dfb, &dfs, &list_hs, &nf, &bt, &row_lo, &si, &u->hk[l], &u->hv[l], &hs, &u->pk[l], &u->pv[l],
                       &phs, &split, &ld, &dt, &d, &u->pool_k[l], &u->pool_v[l], &pool_hs };
        void *pg[] = { &didx, &idx_hs, &nr, &dtab, &sl_hs, &bt, &u->pool_k[l], &u->pool_v[l], &pool_hs, &dt,
                       &u->hk[l], &u->hv[l], &hs, &u->pk[l], &u->pv[l], &phs, &split, &ld, &dt, &d, &u->out_k,
                       &u->out_v, &o_hs, &zero };
        if (fills > 0 &&
            (r = pqc__gpu_launch(c, PQC__K_FILL, pqc__cdiv(fills * u->block_tokens, 8), (unsigned)nkv, 0, pf)) != PQC_SUCCESS)
            return r;
        if ((r = pqc__gpu_launch(c, PQC__K_GATHER, pqc__cdiv(rows, 8), (unsigned)nkv, 0, pg)) != PQC_SUCCESS) return r;
    }
    if (dout) {
        pqc__gpu_rows_device(c, u->arena + nkv * u->nblk_cap * 4, dout);
        return PQC_SUCCESS;
    }
    if ((r = pqc__gpu_rows_home(c, sel->count, out)) != PQC_SUCCESS) return r;
    PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
    return PQC_SUCCESS;
}

static pqc_result pqc__gpu_fetch(pqc_cache *c, int l, const pqc_selection *sel, const pqc_kv_out *out,
                                 pqc_kv_device *dout)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc_result r = pqc__gpu_fetch_run(c, l, sel, out, dout);
    size_t h, i, cb = (size_t)c->d.cache_blocks + 1;
    if (r == PQC_SUCCESS) return r;
    /* the blocks admitted by this fetch were never copied: forget them, so that no
       later gather reads their slots */
    for (h = 0; h < (size_t)u->n_kv; h++) {
        pqc__head *H = &c->layers[l].heads[h];
        for (i = 0; i < u->nfill[h]; i++) {
            int s = u->fill_s[h * cb + i] - u->sink_blocks - u->window_blocks;
            int32_t b = u->fill_b[h * cb + i];
            if (H->block_of[s] == b) {
                H->block_of[s] = -1;
                H->slot_of[b] = -1;
            }
            H->filled[s] = 0;
        }
        u->nfill[h] = 0;
    }
    return r;
}

static pqc_result pqc__gpu_fetch_prepare(pqc_cache *c, size_t rows_per_head)
{
    (void)rows_per_head;
    return pqc__gpu_fetch_begin(c);
}

/* The admissions of the shared bookkeeping become this tier's fill lists, then the
   copies and the gather run on the device. */
static pqc_result pqc__gpu_fetch_tier(pqc_cache *c, struct pqc__fetch_job *j, pqc_kv_device *dout, int parallel)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t h, f, cb = (size_t)c->d.cache_blocks + 1;
    (void)parallel;
    for (h = 0; h < (size_t)u->n_kv; h++) {
        const pqc__fill *fl = j->fills + h * (size_t)c->d.admit_blocks;
        for (f = 0; f < j->nfill[h] && f < cb; f++) {
            u->fill_b[h * cb + f] = fl[f].block;
            u->fill_s[h * cb + f] = u->sink_blocks + u->window_blocks + fl[f].slot;
        }
        u->nfill[h] = f;
    }
    return pqc__gpu_fetch(c, j->layer, j->sel, j->out, dout);
}

/* ----- the decode step on the device: selection, bookkeeping and gather enqueued, no
   host round trip ----- */

/* Layer l's block-cache bookkeeping on the device for nbc blocks, every head:
   freq, stamp u64 [n_kv][slots] | score f32, slot_of i32, cnt u32 [n_kv][nbc] |
   block_of i32, filled u32, touched u32 [n_kv][slots]. */
static size_t pqc__gpu_adm_slots(const pqc_cache *c) { return (size_t)(c->d.cache_blocks > 0 ? c->d.cache_blocks : 1); }
static size_t pqc__gpu_adm_bytes(const pqc_cache *c, size_t nbc)
{
    return (size_t)c->d.n_kv_heads * (16 * pqc__gpu_adm_slots(c) + 12 * nbc + 12 * pqc__gpu_adm_slots(c));
}

/* Moves layer l's bookkeeping between host and device (to_dev: the host's copy up;
   else the device's back, after waiting for the stream). The move leaves the other side's
   copy the current one. */
static pqc_result pqc__gpu_adm_move(pqc_cache *c, int l, int to_dev)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nkv = (size_t)u->n_kv, ns = pqc__gpu_adm_slots(c), nbc = u->adm_nbc[l], bytes = pqc__gpu_adm_bytes(c, nbc);
    size_t h, i, nb = PQC__MIN(nbc, c->nblk), cbk = (size_t)PQC__MAX(c->d.cache_blocks, 0);
    unsigned char *m = (unsigned char *)pqc__alloc(&c->alloc, bytes);
    uint64_t *fq, *stp;
    float *sc;
    int32_t *so, *bo;
    uint32_t *cn, *fl, *tc;
    pqc__cuResult cr;
    if (!m) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: %zu bytes of block-cache bookkeeping", bytes);
    fq = (uint64_t *)m;
    stp = fq + nkv * ns;
    sc = (float *)(stp + nkv * ns);
    so = (int32_t *)(sc + nkv * nbc);
    cn = (uint32_t *)(so + nkv * nbc);
    bo = (int32_t *)(cn + nkv * nbc);
    fl = (uint32_t *)(bo + nkv * ns);
    tc = fl + nkv * ns;
    if (!to_dev) {
        u->waits++;
        cr = u->api->cuStreamSynchronize(u->st);
        if (cr == 0) cr = u->api->cuMemcpyDtoH_v2(m, u->adm[l], bytes);
        if (cr != 0) {
            pqc__free(&c->alloc, m);
            return pqc__gpu_err(c, cr, "reading the block-cache bookkeeping");
        }
    } else {
        memset(m, 0, bytes);
    }
    for (h = 0; h < nkv; h++) {
        pqc__head *H = &c->layers[l].heads[h];
        for (i = 0; to_dev && i < nbc; i++) {
            so[h * nbc + i] = i < nb && cbk ? H->slot_of[i] : -1;
            sc[h * nbc + i] = i < nb && cbk ? H->score[i] : 0.0f;
        }
        for (i = 0; to_dev && i < ns; i++) {
            bo[h * ns + i] = i < cbk ? H->block_of[i] : -1;
            fl[h * ns + i] = i < cbk ? H->filled[i] : 0;
            fq[h * ns + i] = i < cbk ? H->freq[i] : 0;
            stp[h * ns + i] = i < cbk ? H->stamp[i] : 0;
        }
        for (i = 0; !to_dev && cbk && i < nb; i++) {
            H->slot_of[i] = so[h * nbc + i];
            H->score[i] = sc[h * nbc + i];
        }
        for (i = 0; !to_dev && i < cbk; i++) {
            H->block_of[i] = bo[h * ns + i];
            H->filled[i] = fl[h * ns + i];
            H->freq[i] = fq[h * ns + i];
            H->stamp[i] = stp[h * ns + i];
        }
    }
    (void)tc;
    cr = to_dev ? u->api->cuMemcpyHtoD_v2(u->adm[l], m, bytes) : 0;
    pqc__free(&c->alloc, m);
    if (cr != 0) return pqc__gpu_err(c, cr, "writing the block-cache bookkeeping");
    u->adm_dev[l] = to_dev;
    return PQC_SUCCESS;
}

/* Before the host reads or changes layer l's block-cache bookkeeping: the device's copy,
   when a device step made it the current one. */
static pqc_result pqc__gpu_adm_pull(pqc_cache *c, int l)
{
    if (!c->cu || !c->cu->adm || !c->cu->adm_dev[l]) return PQC_SUCCESS;
    pqc__gpu_enter(c);
    return pqc__gpu_adm_move(c, l, 0);
}

/* Adds the hits, misses and bytes that device steps counted at layer l. Waits for the
   stream (a statistics read is a natural synchronisation point). */
static pqc_result pqc__gpu_stats(const pqc_cache *c, int l, pqc_layer_stats *st)
{
    const struct pqc__gpu_tier *u = c->cu;
    uint64_t v[3 * 64];
    size_t nkv = (size_t)u->n_kv, h, done;
    if (!u->dstat) return PQC_SUCCESS;
    u->api->cuCtxSetCurrent(u->r->dev.ctx);
    PQC__GPU_CALL(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
    for (done = 0; done < nkv; done += 64) { /* 64 heads at a time */
        size_t part = PQC__MIN((size_t)64, nkv - done);
        PQC__GPU_CALL(c, u->api->cuMemcpyDtoH_v2(v, u->dstat + ((size_t)l * nkv + done) * 24, part * 24), "cuMemcpyDtoH");
        for (h = 0; h < part; h++) {
            st->hits += v[3 * h];
            st->misses += v[3 * h + 1];
            st->bytes_h2d += v[3 * h + 2];
        }
    }
    return PQC_SUCCESS;
}

/* The most entries a head's outlier list holds (0 without lists). */
static size_t pqc__gpu_outlier_cap(const pqc_cache *c) { return c->d.outliers > 0 ? 2 * (size_t)c->d.outliers : 0; }

/* What device steps need, made at the first one: bookkeeping tables, statistics, fill
   lists, the tops-k (with exact scoring the candidate counts and outlier lists too), the
   staging of queries (two steps deep per layer, in pinned memory, so that a step's copies
   never wait) and their events. */
static pqc_result pqc__gpu_step_init(pqc_cache *c)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t L = (size_t)c->d.n_layers, nkv = (size_t)u->n_kv, ab = (size_t)PQC__MAX(c->d.admit_blocks, 1), i;
    size_t ints = nkv * (3 + pqc__gpu_outlier_cap(c)); /* dtakes */
    pqc_result r;
    if (u->adm) return PQC_SUCCESS;
    u->stage_bytes = ((size_t)c->d.n_q_heads * u->d * sizeof(float) + ints * sizeof(int32_t) + 63) / 64 * 64;
    if ((r = pqc__gpu_dalloc(c, &u->dstat, L * nkv * 24)) != PQC_SUCCESS ||
        (r = pqc__gpu_dalloc(c, &u->rfill, nkv * 3 * ab * 4)) != PQC_SUCCESS ||
        (r = pqc__gpu_dalloc(c, &u->dtakes, ints * 4)) != PQC_SUCCESS ||
        (r = pqc__gpu_halloc(c, (void **)&u->h_stage, 2 * L * u->stage_bytes)) != PQC_SUCCESS)
        return r;
    PQC__GPU_CALL(c, u->api->cuMemsetD32Async(u->dstat, 0, L * nkv * 6, u->st), "cuMemsetD32Async");
    u->adm = (pqc__dptr *)pqc__calloc(&c->alloc, L * (sizeof(pqc__dptr) + sizeof(size_t) + sizeof(int) +
                                                      2 * sizeof(pqc__cuEvent)) + 16);
    if (!u->adm) return pqc__cfail(c, PQC_ERROR_OUT_OF_MEMORY, "CUDA tier: allocation failed");
    u->ev_stage = (pqc__cuEvent *)(u->adm + L);
    u->adm_nbc = (size_t *)(u->ev_stage + 2 * L);
    u->adm_dev = (int *)(u->adm_nbc + L);
    for (i = 0; i < 2 * L; i++)
        PQC__GPU_CALL(c, u->api->cuEventCreate(&u->ev_stage[i], PQC__CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    return PQC_SUCCESS;
}

/* Exact scoring of a device step (pqc__gpu_step with cands): each head's top cands[h]
   coded tokens by PQ score (u->topk, [head][ctake]), merged with its outlier list where
   the cache keeps one (pqc_rerank_merge), then the window's rivals and the tokens that
   join the softmax only (the sinks and the window's last tokens: rv, pqc_rerank_append),
   scored again with their key rows and the combination pqc__select_exact makes
   (pqc_rerank_dots, pqc_rerank_combine), the best takes[h] + nx of them kept (positions,
   then their tokens, rival r as coded + r: *top, [head][*top_hs]). dtakes holds the
   tops-k, the candidate counts and the outlier lists (pqc__gpu_step). A row the device
   holds (a sink or window block, or a block the cache holds whole: slot_of and filled of
   the bookkeeping, mid_end this step's) is read there, as the gather will read it; the
   others cross the bus and count in the layer's bytes host -> device. */
static pqc_result pqc__gpu_rerank(pqc_cache *c, int l, size_t ctake, size_t take, pqc__dptr slot_of, pqc__dptr filled,
                                  const pqc__gpu_rivals *rv, pqc__dptr *top, int64_t *top_hs)
{
    struct pqc__gpu_tier *u = c->cu;
    size_t nkv = (size_t)u->n_kv, g = (size_t)u->g, ocap = pqc__gpu_outlier_cap(c), coded = c->layers[l].n_coded;
    /* the most rows a head scores: its candidates, then the rivals and the softmax's others */
    size_t nn = (ocap ? PQC__MIN(ctake + ocap, coded) : ctake) + rv->nxf;
    pqc__dptr cand = u->topk, cands = u->dtakes + nkv * 4;
    int64_t cand_hs = (int64_t)ctake, q_hs = (int64_t)g * u->d, hs = (int64_t)u->hstride, phs = (int64_t)u->phstride,
            split = (int64_t)c->pn, ld = u->d, dots_hs, row_hs, comb_hs, pos_hs = (int64_t)take;
    int n = (int)nn, n_sink = c->d.n_sink, gi = u->g, dt = (int)c->d.kv_dtype, d = u->d;
    int mode = c->sp.gqa == PQC_GQA_SUM ? 0 : 1, bt = (int)u->block_tokens, me = (int)rv->mid_end, nsb = u->sink_blocks,
        wb = u->window_blocks, cbk = c->d.cache_blocks, nf = (int)(rv->nxf - rv->nx);
    int64_t blk_hs = (int64_t)u->adm_nbc[l], slot_hs = (int64_t)pqc__gpu_adm_slots(c),
            pool_hs = (int64_t)u->n_slots * (int64_t)u->block_tokens * u->d;
    pqc__dptr stat = u->dstat + (size_t)l * nkv * 24;
    uint64_t rb = c->row;
    float scale = c->sp.scale;
    pqc_result r;
    if (nn > u->rr_cap) {
        size_t want = PQC__MAX(nn, u->s_cap);
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        u->rr_cap = 0;
        if ((r = pqc__gpu_dalloc(c, &u->rr_dots, nkv * g * want * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_w, nkv * g * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_comb, nkv * want * sizeof(float))) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_pos, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_ids, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_cand, ocap ? nkv * want * 4 : 0)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_nm, nkv * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_ext, nkv * want * 4)) != PQC_SUCCESS ||
            (r = pqc__gpu_dalloc(c, &u->rr_next, nkv * 4)) != PQC_SUCCESS)
            return r;
        u->rr_cap = want;
    }
    row_hs = (int64_t)u->rr_cap;
    dots_hs = (int64_t)g * row_hs;
    comb_hs = row_hs;
    if (ocap) { /* the candidates and the outlier lists, merged (rr_pos as scratch) */
        pqc__dptr outl = u->dtakes + 3 * nkv * 4, n_out = u->dtakes + 2 * nkv * 4;
        int64_t out_hs = (int64_t)ocap;
        int ci = (int)coded;
        void *p[] = { &u->topk, &cand_hs, &cands, &outl, &out_hs, &n_out, &ci, &u->rr_pos, &row_hs, &u->rr_cand, &row_hs,
                      &u->rr_nm };
        if ((r = pqc__gpu_launch(c, PQC__K_RR_MERGE, 1, (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
        cand = u->rr_cand;
        cand_hs = row_hs;
        cands = u->rr_nm;
    }
    {
        int sk = (int)rv->sink, from = (int)rv->from, nx = (int)rv->nx, ni = (int)rv->n;
        void *p[] = { &cand, &cand_hs, &cands, &n_sink, &sk, &from, &nx, &ni, &u->rr_ext, &row_hs, &u->rr_next };
        if ((r = pqc__gpu_launch(c, PQC__K_RR_APPEND, pqc__cdiv(nn, 256), (unsigned)nkv, 0, p)) != PQC_SUCCESS)
            return r;
        cand = u->rr_ext;
        cand_hs = row_hs;
        cands = u->rr_next;
    }
    {
        void *p[] = { &cand, &cand_hs, &cands, &n, &n_sink, &u->q, &q_hs, &gi, &u->hk[l], &hs, &u->pk[l], &phs,
                      &split, &ld, &dt, &d, &bt, &me, &nsb, &wb, &cbk, &slot_of, &blk_hs, &filled, &slot_hs,
                      &u->pool_k[l], &pool_hs, &stat, &rb, &u->rr_dots, &dots_hs, &row_hs };
        if ((r = pqc__gpu_launch(c, PQC__K_RR_DOTS, pqc__cdiv(nn, 8), (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    {
        void *p[] = { &u->rr_dots, &dots_hs, &row_hs, &cands, &n, &gi, &mode, &scale, &u->rr_w, &u->rr_comb, &comb_hs,
                      &nf };
        if ((r = pqc__gpu_launch(c, PQC__K_RR_COMBINE, 1, (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    if ((r = pqc__gpu_topk(c, u->rr_comb, comb_hs, nn, take, u->dtakes, u->rr_pos, pos_hs, 0)) != PQC_SUCCESS)
        return r;
    {
        int k = (int)take, ci = (int)coded, rbase = (int)rv->from - n_sink;
        void *p[] = { &cand, &cand_hs, &u->rr_pos, &pos_hs, &u->dtakes, &k, &u->rr_ids, &pos_hs, &ci, &rbase };
        if ((r = pqc__gpu_launch(c, PQC__K_TAKE_AT, pqc__cdiv(take, 256), (unsigned)nkv, 0, p)) != PQC_SUCCESS) return r;
    }
    *top = u->rr_ids;
    *top_hs = pos_hs;
    return PQC_SUCCESS;
}

/* One decode step of layer l on the device: the queries and each head's top-k count
   (takes; search: the top-k of the codes, else every coded token or none, as takes
   says; with cands, each head's candidate count too) go up, then the search (with
   cands: the top cands[h], re-ranked by pqc__gpu_rerank), pqc_select_admit (selection,
   admission, hits), the block copies and the gather are enqueued on the stream. With
   dout the rows stay on the device and nothing waits; with out the rows and the
   selection (into pos, head h at pos + h * pos_stride) come back after one
   synchronisation. */
static pqc_result pqc__gpu_step(pqc_cache *c, int l, const float *q, const size_t *takes, int search, const size_t *cands,
                                size_t ctake, const size_t *count, const pqc_kv_out *out, pqc_kv_device *dout,
                                uint32_t *pos, size_t pos_stride)
{
    struct pqc__gpu_tier *u = c->cu;
    pqc__layer *L = &c->layers[l];
    size_t nkv = (size_t)u->n_kv, n = L->n_tokens, rows = 1, h, qb = (size_t)c->d.n_q_heads * u->d * sizeof(float);
    size_t ab = (size_t)PQC__MAX(c->d.admit_blocks, 1), slot = (size_t)(L->step & 1) * (size_t)c->d.n_layers + (size_t)l;
    size_t take = 0, ocap = pqc__gpu_outlier_cap(c), nx, sx;
    pqc__gpu_rivals rv;
    unsigned char *stage;
    int32_t *tk;
    pqc__dptr topk = 0; /* each head's top-k, [head][topk_hs] (after the search, which may grow it) */
    int64_t topk_hs = (int64_t)ctake;
    pqc__cuResult cr;
    pqc_result r;
    if (!u->ready) return pqc__cfail(c, PQC_ERROR_BAD_STATE, "CUDA tier: decode before prefill");
    if (n > 0x7fffffffu) return pqc__cfail(c, PQC_ERROR_CAPACITY, "CUDA tier: more than 2^31 tokens");
    /* the window's rivals (PQC_SPLIT_COMPETE), as pqc__select_head has them: they join each
       head's top-k on the device */
    pqc__gpu_rivals_at(c, L, n, search, &rv);
    nx = rv.nx;
    sx = cands ? 0 : nx; /* the rivals the search takes (exact scoring adds them after it) */
    topk_hs = (int64_t)(ctake + sx);
    pqc__gpu_enter(c);
    for (h = 0; h < nkv; h++) rows = PQC__MAX(rows, count[h]);
    if ((r = pqc__gpu_step_init(c)) != PQC_SUCCESS || (r = pqc__gpu_rows_room(c, rows)) != PQC_SUCCESS) return r;
    if (out && u->pos_cap < u->rows_cap) {
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        u->pos_cap = 0;
        if ((r = pqc__gpu_halloc(c, (void **)&u->h_pos, nkv * u->rows_cap * 4)) != PQC_SUCCESS) return r;
        u->pos_cap = u->rows_cap;
    }
    if (u->adm_nbc[l] < c->nblk) { /* the tables grow with the stores: through the host */
        if ((r = pqc__gpu_adm_pull(c, l)) != PQC_SUCCESS) return r;
        u->adm_nbc[l] = 0;
        if ((r = pqc__gpu_dalloc(c, &u->adm[l], pqc__gpu_adm_bytes(c, c->nblk))) != PQC_SUCCESS) return r;
        u->adm_nbc[l] = c->nblk;
    }
    if (!u->adm_dev[l] && (r = pqc__gpu_adm_move(c, l, 1)) != PQC_SUCCESS) return r;
    /* the staging slot of this layer two steps ago is free (it always is, unless the
       device runs two whole steps behind) */
    cr = u->api->cuEventQuery(u->ev_stage[slot]);
    if (cr != 0) PQC__GPU_WAIT(c, u->api->cuEventSynchronize(u->ev_stage[slot]), "cuEventSynchronize");
    stage = u->h_stage + slot * u->stage_bytes;
    memcpy(stage, q, qb);
    tk = (int32_t *)(stage + qb);
    for (h = 0; h < nkv; h++) {
        const pqc__head *H = &L->heads[h];
        tk[h] = (int32_t)(takes[h] + nx);
        if (cands) tk[nkv + h] = (int32_t)cands[h];
        if (cands && ocap) {
            tk[2 * nkv + h] = (int32_t)H->n_outliers;
            memcpy(tk + 3 * nkv + h * ocap, H->outliers, H->n_outliers * sizeof(uint32_t));
        }
        take = PQC__MAX(take, takes[h] + nx);
    }
    PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(u->q, stage, qb, u->st), "cuMemcpyHtoDAsync");
    PQC__GPU_CALL(c, u->api->cuMemcpyHtoDAsync_v2(u->dtakes, tk, (cands ? (ocap ? 3 + ocap : 2) : 1) * nkv * 4, u->st),
                  "cuMemcpyHtoDAsync");
    PQC__GPU_CALL(c, u->api->cuEventRecord(u->ev_stage[slot], u->st), "cuEventRecord");
    {
        /* the block-cache bookkeeping on the device (pqc__gpu_adm_bytes) */
        size_t nbc = u->adm_nbc[l], ns = pqc__gpu_adm_slots(c), mid_end = pqc__mid_end(c, &c->layers[l], n);
        pqc__dptr a = u->adm[l], fq = a, stp = fq + nkv * ns * 8, sc = stp + nkv * ns * 8, so = sc + nkv * nbc * 4,
                  cn = so + nkv * nbc * 4, bo = cn + nkv * nbc * 4, fl = bo + nkv * ns * 4, tc = fl + nkv * ns * 4;
        pqc__dptr tab = u->arena, idx = u->arena + nkv * u->nblk_cap * 4;
        pqc__dptr fb = u->rfill, fs = fb + ab * 4, fr = fs + ab * 4, stat = u->dstat + (size_t)l * nkv * 24, zero = 0;
        int64_t sel_hs = (int64_t)u->rows_cap, blk_hs = (int64_t)nbc, slot_hs = (int64_t)ns,
                tab_hs = (int64_t)u->nblk_cap, fill_hs = 3 * (int64_t)ab, hs = (int64_t)u->hstride, ld = u->d,
                pool_hs = (int64_t)u->n_slots * (int64_t)u->block_tokens * u->d, phs = (int64_t)u->phstride, split = (int64_t)c->pn,
                o_hs = (int64_t)u->rows_cap * u->d;
        int n_sink = c->d.n_sink, coded = (int)L->n_coded, me = (int)mid_end, ni = (int)n, nr = (int)rows, bt = (int)u->block_tokens;
        int nsb = u->sink_blocks, wb = u->window_blocks, cbk = c->d.cache_blocks, adm = c->d.admit_blocks, lfu = c->d.policy != PQC_POLICY_LRU;
        int nf = (int)ab, row_lo = 0, dt = (int)c->d.kv_dtype, d = u->d, nxi = (int)nx;
        uint64_t step = L->step, rb = c->row;
        void *pa[] = { &topk, &topk_hs, &u->dtakes, &n_sink, &coded, &me, &ni, &nr, &idx, &sel_hs, &bt, &nsb, &wb, &cbk,
                       &adm, &lfu, &step, &sc, &so, &cn, &blk_hs, &bo, &fl, &tc, &fq, &stp, &slot_hs, &tab, &tab_hs,
                       &fb, &fs, &fr, &fill_hs, &stat, &rb, &nxi };
        void *pf[] = { &fb, &fs, &fill_hs, &nf, &bt, &row_lo, &ni, &u->hk[l], &u->hv[l], &hs, &u->pk[l], &u->pv[l],
                       &phs, &split, &ld, &dt, &d, &u->pool_k[l], &u->pool_v[l], &pool_hs };
        void *pg[] = { &idx, &sel_hs, &nr, &tab, &tab_hs, &bt, &u->pool_k[l], &u->pool_v[l], &pool_hs, &dt,
                       &u->hk[l], &u->hv[l], &hs, &u->pk[l], &u->pv[l], &phs, &split, &ld, &dt, &d, &u->out_k,
                       &u->out_v, &o_hs, &zero };
        rv.slot_of = so; /* the rivals' rows in the block cache too */
        rv.filled = fl;
        rv.slot_hs = ns;
        rv.cache_blocks = c->d.cache_blocks;
        if (search && (r = pqc__gpu_search(c, l, ctake + sx, cands ? u->dtakes + nkv * 4 : u->dtakes, 0,
                                           sx ? &rv : NULL)) != PQC_SUCCESS)
            return r;
        if (search) topk = u->topk;
        if (search && cands && (r = pqc__gpu_rerank(c, l, ctake, take, so, fl, &rv, &topk, &topk_hs)) != PQC_SUCCESS)
            return r;
        if ((r = pqc__gpu_launch(c, PQC__K_SELECT_ADMIT, 1, (unsigned)nkv, 0, pa)) != PQC_SUCCESS) return r;
        if (cbk > 0 && adm > 0 &&
            (r = pqc__gpu_launch(c, PQC__K_FILL, pqc__cdiv(ab * u->block_tokens, 8), (unsigned)nkv, 0, pf)) != PQC_SUCCESS)
            return r;
        if ((r = pqc__gpu_launch(c, PQC__K_GATHER, pqc__cdiv(rows, 8), (unsigned)nkv, 0, pg)) != PQC_SUCCESS) return r;
        if (dout) {
            pqc__gpu_rows_device(c, idx, dout);
            return PQC_SUCCESS;
        }
        if ((r = pqc__gpu_rows_home(c, count, out)) != PQC_SUCCESS) return r;
        PQC__GPU_CALL(c, u->api->cuMemcpyDtoHAsync_v2(u->h_pos, idx, nkv * u->rows_cap * 4, u->st), "cuMemcpyDtoHAsync");
        PQC__GPU_WAIT(c, u->api->cuStreamSynchronize(u->st), "cuStreamSynchronize");
        for (h = 0; h < nkv; h++) memcpy(pos + h * pos_stride, u->h_pos + h * u->rows_cap, count[h] * sizeof(uint32_t));
    }
    return PQC_SUCCESS;
}

static int pqc__gpu_zero_copy(const pqc_cache *c)
{
    (void)c;
    return 0;
}

/* The waits of a layer's select, fetch or step (and of the fetch's preparation before
   it) go to its statistics. */
static void pqc__gpu_note_waits(pqc_cache *c, int l)
{
    struct pqc__gpu_tier *u = c->cu;
    c->layers[l].st.device_waits += u->waits - u->waits_seen;
    u->waits_seen = u->waits;
}
static pqc_result pqc__gpu_select_w(pqc_cache *c, int l, const float *q, size_t take, int scores, const int32_t **idx,
                                    const float **sc)
{
    pqc_result r = pqc__gpu_select(c, l, q, take, scores, idx, sc);
    pqc__gpu_note_waits(c, l);
    return r;
}
static pqc_result pqc__gpu_fetch_tier_w(pqc_cache *c, struct pqc__fetch_job *j, pqc_kv_device *dout, int parallel)
{
    pqc_result r = pqc__gpu_fetch_tier(c, j, dout, parallel);
    pqc__gpu_note_waits(c, j->layer);
    return r;
}
static pqc_result pqc__gpu_step_w(pqc_cache *c, int l, const float *q, const size_t *takes, int search,
                                  const size_t *cands, size_t ctake, const size_t *count, const pqc_kv_out *out,
                                  pqc_kv_device *dout, uint32_t *pos, size_t pos_stride)
{
    pqc_result r = pqc__gpu_step(c, l, q, takes, search, cands, ctake, count, out, dout, pos, pos_stride);
    pqc__gpu_note_waits(c, l);
    return r;
}
static pqc_result pqc__gpu_adm_pull_w(pqc_cache *c, int l)
{
    pqc_result r = pqc__gpu_adm_pull(c, l);
    if (c->cu) pqc__gpu_note_waits(c, l);
    return r;
}

static const pqc__tier_i *pqc__cuda_tier(void)
{
    static const pqc__tier_i t = { "CUDA", PQC__CAN_DEVICE_ROWS | PQC__CAN_EXACT, pqc__gpu_create, pqc__gpu_destroy, pqc__gpu_host_alloc,
                                   pqc__gpu_host_free, pqc__gpu_host_release, pqc__gpu_codes_allocator, pqc__gpu_quiesce, pqc__gpu_grown,
                                   pqc__gpu_stored, pqc__gpu_appended, pqc__gpu_sized, pqc__gpu_select_w,
                                   pqc__gpu_fetch_prepare, pqc__gpu_fetch_tier_w, pqc__gpu_device_bytes,
                                   pqc__gpu_zero_copy, pqc__gpu_step_w, pqc__gpu_adm_pull_w, pqc__gpu_stats,
                                   pqc__gpu_batch_tables };
    return &t;
}

/* the device side as the sections above reach it (see pqc__device_i) */
static const pqc__device_i *pqc__device(void)
{
    static const pqc__device_i dev = { pqc__gpu_open, pqc__gpu_close, pqc__cuda_lloyd, pqc__cuda_tier };
    return &dev;
}

PQCDEF pqc_result pqc_cuda_probe(pqc_cuda_info *info)
{
    pqc__cuApi api;
    pqc__cuHost host;
    pqc__cuDev dev;
    pqc_cuda_info tmp;
    int st;
    if (!info) info = &tmp;
    memset(info, 0, sizeof *info);
    pqc__cu_host(&host, NULL);
    pqc__cu_api_init(&api, &host);
    st = pqc__cu_load(&api, 1);
    if (st != PQC__CU_OK) {
        snprintf(info->message, sizeof info->message, "%s", api.msg);
        return pqc__fail(NULL, PQC_ERROR_NO_DEVICE, "CUDA unavailable: %s", api.msg);
    }
    info->driver_version = api.driver_version;
    info->device_count = api.device_count;
    info->nvrtc_major = api.nvrtc_major;
    info->nvrtc_minor = api.nvrtc_minor;
    info->have_cublaslt = api.lib_blaslt != NULL;
    memset(&dev, 0, sizeof dev);
    st = pqc__cu_device_open(&api, 0, &dev);
    if (st != PQC__CU_OK) {
        snprintf(info->message, sizeof info->message, "%s", api.msg);
        pqc__cu_unload(&api);
        return pqc__fail(NULL, PQC_ERROR_NO_DEVICE, "CUDA device 0 unusable: %s", info->message);
    }
    info->available = 1;
    info->cc_major = dev.cc_major;
    info->cc_minor = dev.cc_minor;
    info->sm_count = dev.sm_count;
    info->total_mem = dev.total_mem;
    snprintf(info->name, sizeof info->name, "%s", dev.name);
    snprintf(info->message, sizeof info->message, "%s, compute capability %d.%d, %d SMs", dev.name, dev.cc_major,
             dev.cc_minor, dev.sm_count);
    pqc__cu_device_close(&api, &dev);
    pqc__cu_unload(&api);
    return PQC_SUCCESS;
}

PQCDEF pqc_result pqc_cuda_compile_kernels(int arch, int cubin, char *log, size_t log_size, size_t *image_bytes)
{
    pqc__cuApi api;
    pqc__cuHost host;
    void *img = NULL;
    size_t size = 0;
    int st;
    if (arch < 50 || arch > 200) return pqc__fail(NULL, PQC_ERROR_OUT_OF_RANGE, "architecture %d not in 50..200", arch);
    pqc__cu_host(&host, NULL);
    pqc__cu_api_init(&api, &host);
    st = pqc__cu_load_nvrtc(&api);
    if (st != PQC__CU_OK) return pqc__fail(NULL, PQC_ERROR_NO_DEVICE, "NVRTC unavailable: %s", api.msg);
    st = pqc__cu_compile(&api, pqc__kernels(), "pqcache_kernels.cu", arch, cubin, &img, &size, log, log_size);
    pqc__cu_free(&api, img);
    pqc__cu_unload(&api);
    if (st != PQC__CU_OK) return pqc__fail(NULL, PQC_ERROR_BACKEND, "NVRTC: %s", api.msg);
    if (image_bytes) *image_bytes = size;
    return PQC_SUCCESS;
}

PQCDEF const char *pqc_cuda_kernel_source(void) { return pqc__kernels(); }

#else /* no CUDA loader in this build */

PQCDEF pqc_result pqc_cuda_probe(pqc_cuda_info *info)
{
    if (info) {
        memset(info, 0, sizeof *info);
        snprintf(info->message, sizeof info->message, "built without the CUDA loader");
    }
    return pqc__fail(NULL, PQC_ERROR_NO_DEVICE, "CUDA unavailable: built without the CUDA loader");
}
PQCDEF pqc_result pqc_cuda_compile_kernels(int arch, int cubin, char *log, size_t log_size, size_t *image_bytes)
{
    (void)arch;
    (void)cubin;
    (void)image_bytes;
    if (log && log_size) log[0] = 0;
    return pqc__fail(NULL, PQC_ERROR_UNSUPPORTED, "built without the CUDA loader");
}
PQCDEF const char *pqc_cuda_kernel_source(void) { return ""; }
#endif /* PQC__CUDA_LOADER */

#if !PQC__CUDA_LOADER
/* Built without the CUDA loader: no device tier (c->cu and rt->cu stay NULL). */
static pqc_result pqc__gpu_open(pqc_runtime *rt, int ordinal, const char *cache_dir, char *why, size_t why_size)
{
    (void)rt;
    (void)ordinal;
    (void)cache_dir;
    snprintf(why, why_size, "built without the CUDA loader");
    return PQC_ERROR_NO_DEVICE;
}
static void pqc__gpu_close(pqc_runtime *rt) { (void)rt; }
static pqc_result pqc__cuda_lloyd(pqc_runtime *rt, const float *x, size_t n, int d, int k, int iters, float *c,
                                  double *obj, char *err, size_t errsz)
{
    (void)rt;
    (void)x;
    (void)n;
    (void)d;
    (void)k;
    (void)iters;
    (void)c;
    (void)obj;
    snprintf(err, errsz, "built without the CUDA loader");
    return PQC_ERROR_NO_DEVICE;
}
static const pqc__device_i *pqc__device(void)
{
    static const pqc__device_i dev = { pqc__gpu_open, pqc__gpu_close, pqc__cuda_lloyd, NULL };
    return &dev;
}
#endif




#ifdef __cplusplus
}
#endif
#endif /* PQCACHE_IMPLEMENTATION_DONE */
#endif /* PQCACHE_IMPLEMENTATION */

/*
MIT License

Copyright (c) 2026 the pqcache authors

Permission is hereby granted, free of charge, to any person obtaining a copy of this
software and associated documentation files (the "Software"), to deal in the Software
without restriction, including without limitation the rights to use, copy, modify, merge,
publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons
to whom the Software is furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR
PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE
FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
DEALINGS IN THE SOFTWARE.
*/
