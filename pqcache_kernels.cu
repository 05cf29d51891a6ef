/* pqcache_kernels.cu - CUDA kernels of pqcache.
 *
 * This file is compiled at run time with NVRTC (it is embedded into pqcache.h as a
 * string, see tools/embed_kernels.sh), so it includes no headers at all: it only uses
 * NVRTC's built-in types and functions. Every kernel is `extern "C"` so that its name in
 * the module is the plain identifier, and every kernel is written for blocks of exactly
 * PQC_BLOCK (256) threads in x (blockDim.y = blockDim.z = 1).
 *
 * Conventions shared with the CPU library (they must match it bit for bit):
 *   - Per KV head: d_h dims, m sub-spaces of d_sub = d_h / m dims, K = 2^b centroids.
 *   - centroids: float32 [m][K][d_sub].
 *   - codes: one byte column per sub-space, bit-packed LSB-first: the code of token t in
 *     sub-space j is bits [t*b, t*b+b) of column j, which starts at codes + j*col_stride
 *     bytes. Columns are followed by at least 8 zero bytes of padding (a 16-bit read at
 *     the last code byte is safe).
 *   - LUT: float32 [g][m][K], LUT[h][j][c] = sequential fmaf over e of
 *     q_h[j*d_sub+e] * centroid[j][c][e], starting from 0.
 *   - score_h(t) = sequential float sum over j = 0..m-1 of LUT[h][j][code_j(t)] from 0.
 *   - SOFTMAX_SUM: e_h(t) = pqc_exp((score_h(t) - max_h) * scale) with the library's own
 *     exp (same polynomial and operation order as the CPU), Z_h = sum over t of e_h(t),
 *     combined(t) = fmaf(e_h(t), 1/Z_h, combined(t)) over h in order, from 0.
 *   - top-k order: the order-preserving key of a float (-0 taken as +0; flip all bits
 *     when the sign is set, else flip the sign bit); larger key first, ties to the lower
 *     token index; results are listed in ascending token index.
 *
 * Batching: kernels that work per KV head take the head from blockIdx.y and find their
 * data through "head strides" (in elements of the pointed-to type); pass 0 strides and
 * gridDim.y = 1 to process a single head. All strides and 64-bit offsets are signed
 * 64-bit (long long) on the host side.
 *
 * Determinism: every reduction over floats runs in a fixed order for a given launch
 * shape (no floating-point atomics), except the per-cluster sums of pqc_kmeans_assign
 * and pqc_kmeans_assign_dots.
 * Results equal the CPU library's bit for bit except Z_h of SOFTMAX_SUM (a tree over
 * blocks here, 16 interleaved lanes on the CPU: a few ulps apart), SOFTMAX_SUM's
 * exponentials over 8-bit codes with two or more heads (the CPU takes them as products
 * of per-sub-space tables of exponentials: a few ulps apart) and the k-means sums.
 * That needs --fmad=false (the library passes it): only the explicit fmaf calls fuse.
 */

typedef unsigned char      pqc_u8;
typedef unsigned short     pqc_u16;
typedef unsigned int       pqc_u32;
typedef unsigned long long pqc_u64;
typedef long long          pqc_i64;

#define PQC_BLOCK        256   /* threads per block, every kernel */
#define PQC_WARPS        8     /* PQC_BLOCK / 32 */
#define PQC_FULL         0xffffffffu
#define PQC_GROUP        8     /* query heads scored together per pass over the codes */
#define PQC_RADIX_BINS   2048  /* histogram bins of one radix-select pass (11 bits) */
#define PQC_TOPK_ITEMS   16    /* tokens per thread in the compaction kernels */
#define PQC_TOPK_TILE    4096  /* PQC_BLOCK * PQC_TOPK_ITEMS tokens per compaction block */
#define PQC_MAX_DSUB     256   /* largest vector length of the nearest-centroid kernels */

#define PQC_DT_F32  0
#define PQC_DT_F16  1
#define PQC_DT_BF16 2

#define PQC_SCAN_RAW         0
#define PQC_SCAN_SOFTMAX_SUM 1

/* ------------------------------------------------------------------------------------ */
/* Device functions                                                                     */
/* ------------------------------------------------------------------------------------ */

/* The top-k of head kv: k, or less where a per-head list gives less. */
__device__ __forceinline__ int pqc_head_k(int k, const int *k_head, pqc_i64 kv)
{
    return k_head && k_head[kv] < k ? k_head[kv] : k;
}

/* IEEE binary16 -> binary32, exact (normals, subnormals, zeros, inf, NaN). */
__device__ __forceinline__ float pqc_f16_to_f32(pqc_u32 h)
{
    pqc_u32 sign = (h & 0x8000u) << 16;
    pqc_u32 ex = (h >> 10) & 0x1fu;
    pqc_u32 man = h & 0x3ffu;
    if (ex == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (ex != 0u) return __uint_as_float(sign | ((ex + 112u) << 23) | (man << 13));
    if (man == 0u) return __uint_as_float(sign);
    /* subnormal: man * 2^-24 is exact in float */
    return __uint_as_float(sign | __float_as_uint((float)man * 5.9604644775390625e-8f));
}

/* bfloat16 -> binary32, exact. */
__device__ __forceinline__ float pqc_bf16_to_f32(pqc_u32 h)
{
    return __uint_as_float((h & 0xffffu) << 16);
}

/* Element i of a row stored as fp32 / fp16 / bf16 (dtype 0 / 1 / 2). */
__device__ __forceinline__ float pqc_load_elem(const void *base, pqc_i64 i, int dtype)
{
    if (dtype == PQC_DT_F32) return ((const float *)base)[i];
    pqc_u32 h = ((const pqc_u16 *)base)[i];
    return dtype == PQC_DT_F16 ? pqc_f16_to_f32(h) : pqc_bf16_to_f32(h);
}

/* Bytes per element of a dtype. */
__device__ __forceinline__ int pqc_dtype_size(int dtype)
{
    return dtype == PQC_DT_F32 ? 4 : 2;
}

/* Code of token t in one column (bits [t*b, t*b+b), LSB-first). Reads two bytes, which
   the column padding makes safe for the last token. */
__device__ __forceinline__ pqc_u32 pqc_code_at(const pqc_u8 *__restrict__ col, pqc_u64 t,
                                               int b, pqc_u32 mask)
{
    pqc_u64 bit = t * (pqc_u64)b;
    const pqc_u8 *p = col + (bit >> 3);
    pqc_u32 v = (pqc_u32)p[0] | ((pqc_u32)p[1] << 8);
    return (v >> (pqc_u32)(bit & 7u)) & mask;
}

/* Order-preserving uint32 key of a float: larger float -> larger key; -0 == +0. */
__device__ __forceinline__ pqc_u32 pqc_float_key(float f)
{
    pqc_u32 u = __float_as_uint(f);
    if ((u << 1) == 0u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u ^ 0x80000000u);
}

/* exp(x) for x <= 0, as the CPU library computes it: arguments below -87.3 are clamped,
   Cody-Waite reduction by ln 2 and a degree-5 polynomial with explicit fused operations,
   relative error < 2e-7. Bit-identical to the CPU (every operation is IEEE-rounded). */
__device__ __forceinline__ float pqc_exp(float x)
{
    if (!(x > -87.3f)) x = -87.3f;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y, z, r);
    y = y + 1.0f;
    return y * __uint_as_float((pqc_u32)((int)n + 127) << 23);
}

/* Exclusive prefix sum of v over the 256 threads of the block, in thread order.
   `warp_tot` is shared scratch of PQC_WARPS words; *total receives the block sum.
   Every thread of the block must call it (it contains __syncthreads). */
__device__ __forceinline__ pqc_u32 pqc_block_exclusive_scan(pqc_u32 v, pqc_u32 *warp_tot,
                                                            pqc_u32 *total)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    pqc_u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        pqc_u32 y = __shfl_up_sync(PQC_FULL, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
        pqc_u32 w = lane < PQC_WARPS ? warp_tot[lane] : 0u;
        for (int o = 1; o < PQC_WARPS; o <<= 1) {
            pqc_u32 y = __shfl_up_sync(PQC_FULL, w, o);
            if (lane >= o) w += y;
        }
        if (lane < PQC_WARPS) warp_tot[lane] = w; /* inclusive warp totals */
    }
    __syncthreads();
    pqc_u32 before = warp > 0 ? warp_tot[warp - 1] : 0u;
    *total = warp_tot[PQC_WARPS - 1];
    __syncthreads(); /* scratch may be reused after return */
    return before + x - v;
}

/* Online softmax accumulator (running max mx, running sum sm of exp((x - mx) * scale)). */
__device__ __forceinline__ void pqc_online_add(float &mx, float &sm, float x, float scale)
{
    if (x > mx) {
        sm = sm * pqc_exp((mx - x) * scale) + 1.0f;
        mx = x;
    } else {
        sm += pqc_exp((x - mx) * scale);
    }
}

/* Merge two online-softmax accumulators; an empty one (sum 0) is neutral. */
__device__ __forceinline__ void pqc_online_merge(float &m1, float &s1, float m2, float s2,
                                                 float scale)
{
    if (s2 == 0.0f) return;
    if (s1 == 0.0f) { m1 = m2; s1 = s2; return; }
    float mx = m1 > m2 ? m1 : m2;
    s1 = s1 * pqc_exp((m1 - mx) * scale) + s2 * pqc_exp((m2 - mx) * scale);
    m1 = mx;
}

/* Combines the online-softmax accumulators (mx, sm) of the 256 threads of the block by a
   tree in shared memory (red_m, red_s: PQC_BLOCK floats each); thread 0 writes the block's
   {max, sum} to out[0], out[1]. Every thread of the block must call it. */
__device__ __forceinline__ void pqc_block_online_reduce(float mx, float sm, float scale, float *red_m,
                                                        float *red_s, float *out)
{
    int tid = threadIdx.x;
    red_m[tid] = mx;
    red_s[tid] = sm;
    __syncthreads();
    for (int o = PQC_BLOCK / 2; o > 0; o >>= 1) {
        if (tid < o) {
            float a = red_m[tid], as = red_s[tid];
            pqc_online_merge(a, as, red_m[tid + o], red_s[tid + o], scale);
            red_m[tid] = a;
            red_s[tid] = as;
        }
        __syncthreads();
    }
    if (tid == 0) {
        out[0] = red_m[0];
        out[1] = red_s[0];
    }
    __syncthreads(); /* the scratch may be reused after return */
}

/* Nearest centroid of the vector xs (d floats, typically in shared memory) among K
   centroids [K][d] with squared norms cn (NULL: computed here), by one full warp:
   dist(c) = ||c||^2 - 2 x.c with x.c and ||c||^2 accumulated by sequential fmaf from 0;
   ties go to the lower index. Every lane returns the same index; *best_out gets its
   dist. All 32 lanes of the warp must call it. */
/* The warp's smallest (best, besti) over its lanes, ties to the lower index; besti
   0x7fffffff stands for none. Every lane ends with the result. */
__device__ __forceinline__ void pqc_warp_argmin(float &best, int &besti)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(PQC_FULL, best, o);
        int oi = __shfl_xor_sync(PQC_FULL, besti, o);
        if (oi != 0x7fffffff &&
            (besti == 0x7fffffff || ob < best || (ob == best && oi < besti))) {
            best = ob;
            besti = oi;
        }
    }
}

__device__ __forceinline__ int pqc_warp_nearest(const float *xs, int d,
                                                const float *__restrict__ cen,
                                                const float *__restrict__ cn, int K,
                                                float *best_out)
{
    int lane = threadIdx.x & 31;
    float best = __int_as_float(0x7f800000); /* +inf */
    int besti = 0x7fffffff;
    for (int c = lane; c < K; c += 32) {
        const float *cr = cen + (pqc_i64)c * d;
        float dot = 0.0f, nrm = 0.0f;
        if (cn) {
            for (int e = 0; e < d; ++e) dot = fmaf(xs[e], cr[e], dot);
            nrm = cn[c];
        } else {
            for (int e = 0; e < d; ++e) {
                float ce = cr[e];
                dot = fmaf(xs[e], ce, dot);
                nrm = fmaf(ce, ce, nrm);
            }
        }
        float dist = nrm - 2.0f * dot;
        if (besti == 0x7fffffff || dist < best) { best = dist; besti = c; }
    }
    pqc_warp_argmin(best, besti);
    *best_out = best;
    return besti == 0x7fffffff ? 0 : besti;
}

/* ------------------------------------------------------------------------------------ */
/* (a) Lookup tables                                                                    */
/* ------------------------------------------------------------------------------------ */

/* The key dim of element e of sub-space j: j*d_sub + e, or with half = 1 (rope bands
   over the half-split layout) the two runs [j h, (j+1) h) and [d_h/2 + j h, ...),
   h = d_sub/2, in that order (pqc_pq_dim on the host). */
__device__ __forceinline__ int pqc_sub_dim(int j, int e, int d_sub, int d_h, int half)
{
    if (!half) return j * d_sub + e;
    int h2 = d_sub >> 1;
    return e < h2 ? j * h2 + e : (d_h >> 1) + j * h2 + (e - h2);
}

/* pqc_lut_build: lookup tables of the g query heads of each KV head.
 *   grid  (ceil(m*K / 256), n_kv), block 256; one thread per (sub-space j, centroid c).
 *   q         float [g][d_h] per KV head (q + kv*q_head_stride), d_h = m*d_sub
 *   centroids float [m][K][d_sub] per KV head
 *   half      the sub-space layout of pqc_sub_dim
 *   lut       float [g][m][K] per KV head, or NULL
 *   lut_sum   float [m][K] per KV head, or NULL: sum over h in head order (from 0) of
 *             the g tables, the table of the GQA "sum" mode.
 * LUT[h][j][c] = sequential fmaf over e of q[h][pqc_sub_dim(j, e)] * centroids[j][c][e],
 * from 0. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_lut_build(const float *__restrict__ q, pqc_i64 q_head_stride,
              const float *__restrict__ centroids, pqc_i64 cent_head_stride,
              int g, int m, int K, int d_sub, int half,
              float *__restrict__ lut, pqc_i64 lut_head_stride,
              float *__restrict__ lut_sum, pqc_i64 lut_sum_head_stride)
{
    pqc_i64 kv = blockIdx.y;
    int idx = blockIdx.x * PQC_BLOCK + threadIdx.x; /* j*K + c */
    if (idx >= m * K) return;
    int j = idx / K;
    int d_h = m * d_sub;
    const float *cr = centroids + kv * cent_head_stride + (pqc_i64)idx * d_sub;
    const float *qk = q + kv * q_head_stride;
    float sum = 0.0f;
    for (int h = 0; h < g; ++h) {
        const float *qh = qk + (pqc_i64)h * d_h;
        float acc = 0.0f;
        for (int e = 0; e < d_sub; ++e) acc = fmaf(qh[pqc_sub_dim(j, e, d_sub, d_h, half)], cr[e], acc);
        if (lut) lut[kv * lut_head_stride + (pqc_i64)h * m * K + idx] = acc;
        sum += acc;
    }
    if (lut_sum) lut_sum[kv * lut_sum_head_stride + idx] = sum;
}

/* pqc_lut_sum: the GQA "sum" table from the g tables of each KV head, for tables built
 * elsewhere (the batched cuBLASLt path).
 *   grid  (ceil(m*K / 256), n_kv), block 256; one thread per (sub-space j, centroid c).
 *   lut_sum[j][c] = sum over h in head order (from 0) of lut[h][j][c]: the additions of
 *   pqc_lut_build, so equal tables give equal sums. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_lut_sum(const float *__restrict__ lut, pqc_i64 lut_head_stride, int g, int tab,
            float *__restrict__ lut_sum, pqc_i64 lut_sum_head_stride)
{
    pqc_i64 kv = blockIdx.y;
    int idx = blockIdx.x * PQC_BLOCK + threadIdx.x;
    if (idx >= tab) return;
    const float *t = lut + kv * lut_head_stride + idx;
    float sum = 0.0f;
    for (int h = 0; h < g; ++h) sum += t[(pqc_i64)h * tab];
    lut_sum[kv * lut_sum_head_stride + idx] = sum;
}

/* ------------------------------------------------------------------------------------ */
/* (b) Code scan                                                                        */
/* ------------------------------------------------------------------------------------ */

/* Shared part of the two scan kernels: copies the n_luts tables of this KV head into
   dynamic shared memory when use_smem is set and returns the table base to read. */
__device__ __forceinline__ const float *pqc_scan_tables(const float *__restrict__ lut,
                                                        int n_luts, int m, int K,
                                                        int use_smem, float *smem)
{
    if (!use_smem) return lut;
    int n = n_luts * m * K;
    for (int i = threadIdx.x; i < n; i += PQC_BLOCK) smem[i] = lut[i];
    __syncthreads();
    return smem;
}

/* Raw scores of token t for the query heads h0 .. h0+PQC_GROUP-1 (those < n_luts):
   acc[hh] = sequential sum over j of L[h0+hh][j][code_j(t)], from 0. */
__device__ __forceinline__ void pqc_score_group(const pqc_u8 *__restrict__ codes,
                                                pqc_i64 col_stride, pqc_u64 t, int m,
                                                int b, const float *L, int K, int h0,
                                                int n_luts, float *acc)
{
    pqc_u32 mask = (1u << b) - 1u;
    int mk = m * K;
#pragma unroll
    for (int hh = 0; hh < PQC_GROUP; ++hh) acc[hh] = 0.0f;
    for (int j = 0; j < m; ++j) {
        pqc_u32 c = pqc_code_at(codes + (pqc_i64)j * col_stride, t, b, mask);
        const float *Lj = L + (pqc_i64)h0 * mk + j * K + c;
#pragma unroll
        for (int hh = 0; hh < PQC_GROUP; ++hh)
            if (h0 + hh < n_luts) acc[hh] += Lj[hh * mk];
    }
}

/* pqc_scan_stats: first pass of the SOFTMAX_SUM mode: per-block softmax statistics.
 *   grid  (P, n_kv), block 256, any P >= 1 (the host picks it; the same P must be given
 *         to pqc_softmax_finalize as n_parts).
 *   dynamic shared memory: use_smem ? n_luts*m*K*4 bytes : 0 (above 48 KiB the host must
 *         raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, or pass use_smem = 0).
 *   codes  per KV head at codes + kv*code_head_stride; column j at + j*col_stride bytes
 *   lut    float [n_luts][m][K] per KV head
 *   partial float [n_luts][P][2] per KV head: {max, sum of pqc_exp((x - max)*scale)} of the
 *          raw scores x of the tokens this block visited (grid-stride over tokens). */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_scan_stats(const pqc_u8 *__restrict__ codes, pqc_i64 code_head_stride,
               pqc_i64 col_stride, int s, int m, int b,
               const float *__restrict__ lut, pqc_i64 lut_head_stride, int n_luts,
               float scale, float *__restrict__ partial, pqc_i64 partial_head_stride,
               int use_smem)
{
    extern __shared__ float pqc_smem_lut[];
    __shared__ float red_m[PQC_BLOCK];
    __shared__ float red_s[PQC_BLOCK];
    pqc_i64 kv = blockIdx.y;
    int K = 1 << b;
    int tid = threadIdx.x;
    const pqc_u8 *hc = codes + kv * code_head_stride;
    const float *L = pqc_scan_tables(lut + kv * lut_head_stride, n_luts, m, K, use_smem,
                                     pqc_smem_lut);
    float *part = partial + kv * partial_head_stride;
    pqc_i64 step = (pqc_i64)gridDim.x * PQC_BLOCK;
    for (int h0 = 0; h0 < n_luts; h0 += PQC_GROUP) {
        float mx[PQC_GROUP], sm[PQC_GROUP], acc[PQC_GROUP];
#pragma unroll
        for (int hh = 0; hh < PQC_GROUP; ++hh) {
            mx[hh] = -__int_as_float(0x7f800000);
            sm[hh] = 0.0f;
        }
        for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + tid; t < s; t += step) {
            pqc_score_group(hc, col_stride, (pqc_u64)t, m, b, L, K, h0, n_luts, acc);
#pragma unroll
            for (int hh = 0; hh < PQC_GROUP; ++hh)
                if (h0 + hh < n_luts) pqc_online_add(mx[hh], sm[hh], acc[hh], scale);
        }
#pragma unroll
        for (int hh = 0; hh < PQC_GROUP; ++hh) {
            if (h0 + hh >= n_luts) continue; /* uniform across the block */
            pqc_block_online_reduce(mx[hh], sm[hh], scale, red_m, red_s,
                                    part + ((pqc_i64)(h0 + hh) * gridDim.x + blockIdx.x) * 2);
        }
    }
}

/* pqc_softmax_finalize: combines the per-block statistics of pqc_scan_stats.
 *   grid (1, n_kv), block 256.
 *   partial float [n_luts][n_parts][2] per KV head (n_parts = P of pqc_scan_stats)
 *   stats   float [n_luts][2] per KV head: {max_h, Z_h} with
 *           Z_h = sum over all tokens of pqc_exp((score_h - max_h) * scale). */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_softmax_finalize(const float *__restrict__ partial, pqc_i64 partial_head_stride,
                     int n_parts, int n_luts, float scale,
                     float *__restrict__ stats, pqc_i64 stats_head_stride)
{
    __shared__ float red_m[PQC_BLOCK];
    __shared__ float red_s[PQC_BLOCK];
    pqc_i64 kv = blockIdx.y;
    int tid = threadIdx.x;
    const float *part = partial + kv * partial_head_stride;
    for (int h = 0; h < n_luts; ++h) {
        float mx = -__int_as_float(0x7f800000), sm = 0.0f;
        for (int p = tid; p < n_parts; p += PQC_BLOCK) {
            pqc_i64 o = ((pqc_i64)h * n_parts + p) * 2;
            pqc_online_merge(mx, sm, part[o], part[o + 1], scale);
        }
        pqc_block_online_reduce(mx, sm, scale, red_m, red_s, stats + kv * stats_head_stride + 2 * h);
    }
}

/* pqc_scan: scores every token from its codes.
 *   grid  (P, n_kv), block 256, any P >= 1 (grid-stride over tokens; one token per thread
 *         per step). Dynamic shared memory as for pqc_scan_stats.
 *   mode PQC_SCAN_RAW (0): out[h*s + t] = raw score of token t under table h, for every
 *         h < n_luts. With the summed table of pqc_lut_build (n_luts = 1) this is the
 *         GQA "sum" mode: out[t] = combined score.
 *   mode PQC_SCAN_SOFTMAX_SUM (1): out[t] = fmaf(pqc_exp((score_h(t) - max_h) * scale),
 *         1/Z_h, out[t]) over h in order, from 0, with stats = {max_h, Z_h} per head from
 *         pqc_softmax_finalize ([n_luts][2] per KV head).
 *   out: float per KV head at out + kv*out_head_stride. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_scan(const pqc_u8 *__restrict__ codes, pqc_i64 code_head_stride, pqc_i64 col_stride,
         int s, int m, int b,
         const float *__restrict__ lut, pqc_i64 lut_head_stride, int n_luts,
         int mode, const float *__restrict__ stats, pqc_i64 stats_head_stride, float scale,
         float *__restrict__ out, pqc_i64 out_head_stride, int use_smem)
{
    extern __shared__ float pqc_smem_lut[];
    pqc_i64 kv = blockIdx.y;
    int K = 1 << b;
    const pqc_u8 *hc = codes + kv * code_head_stride;
    const float *L = pqc_scan_tables(lut + kv * lut_head_stride, n_luts, m, K, use_smem,
                                     pqc_smem_lut);
    const float *st = stats ? stats + kv * stats_head_stride : stats;
    float *o = out + kv * out_head_stride;
    pqc_i64 step = (pqc_i64)gridDim.x * PQC_BLOCK;
    float acc[PQC_GROUP];
    for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + threadIdx.x; t < s; t += step) {
        float comb = 0.0f;
        for (int h0 = 0; h0 < n_luts; h0 += PQC_GROUP) {
            pqc_score_group(hc, col_stride, (pqc_u64)t, m, b, L, K, h0, n_luts, acc);
#pragma unroll
            for (int hh = 0; hh < PQC_GROUP; ++hh) {
                int h = h0 + hh;
                if (h >= n_luts) break;
                if (mode == PQC_SCAN_SOFTMAX_SUM)
                    comb = fmaf(pqc_exp((acc[hh] - st[2 * h]) * scale), 1.0f / st[2 * h + 1],
                                comb);
                else
                    o[(pqc_i64)h * s + t] = acc[hh];
            }
        }
        if (mode == PQC_SCAN_SOFTMAX_SUM) o[t] = comb;
    }
}

/* ------------------------------------------------------------------------------------ */
/* (c) Top-k: radix select (3 passes of 11, 11, 10 bits) + index-ordered compaction      */
/* ------------------------------------------------------------------------------------ */

/* pqc_topk_pass: one radix-select pass over the keys of the scores.
 *   grid (P, n_kv), block 256, any P >= 1 per launch. Launch pass = 0, 1, 2 in order on one
 *   stream, then pqc_topk_count and pqc_topk_compact.
 *   scores float [s] per KV head (scores + kv*score_head_stride)
 *   hist   uint32 [2048] per KV head (hist + kv*2048), state uint32 [4] per KV head
 *          (state + kv*4). Both must be zero before the first use (cuMemsetD32 once at
 *          allocation); the kernels leave them zero again except state[0..1].
 *   Pass p histograms the bits [21,32), [10,21) or [0,10) of the keys whose higher bits
 *   equal the prefix found so far (shared-memory atomics, then one global atomicAdd per
 *   non-empty bin). The last block to finish (ticket counter state[2]) finds the bin that
 *   holds the k-th largest key, appends it to the prefix and subtracts the keys above it:
 *   after pass 2, state[0] = T (key of the k-th largest score) and state[1] = number of
 *   keys equal to T to take (the lowest-index ones). k is clamped to s; k <= 0 or s <= 0
 *   does nothing. k_head int32 [n_kv] or NULL: head kv takes min(k, k_head[kv]) (the
 *   three kernels must be given the same k and k_head). */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_topk_pass(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,
              int pass, pqc_u32 *hist, pqc_u32 *state, const int *__restrict__ k_head)
{
    __shared__ pqc_u32 sh[PQC_RADIX_BINS];
    __shared__ pqc_u32 scan_tmp[PQC_WARPS];
    __shared__ pqc_u32 s_last, s_bin, s_above;
    pqc_i64 kv = blockIdx.y;
    k = pqc_head_k(k, k_head, kv);
    if (k <= 0 || s <= 0) return;
    int tid = threadIdx.x;
    const float *sc = scores + kv * score_head_stride;
    pqc_u32 *hg = hist + kv * PQC_RADIX_BINS;
    pqc_u32 *st = state + kv * 4;
    int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    int nbits = pass == 2 ? 10 : 11;
    int hi = shift + nbits; /* 32, 21, 10 */
    int nbins = 1 << nbits;
    pqc_u32 prefix = pass == 0 ? 0u : st[0];
    pqc_u32 krem = pass == 0 ? (pqc_u32)(k < s ? k : s) : st[1];

    for (int i = tid; i < PQC_RADIX_BINS; i += PQC_BLOCK) sh[i] = 0u;
    __syncthreads();
    for (pqc_i64 t = (pqc_i64)blockIdx.x * PQC_BLOCK + tid; t < s;
         t += (pqc_i64)gridDim.x * PQC_BLOCK) {
        pqc_u32 key = pqc_float_key(sc[t]);
        if (hi == 32 || (key >> hi) == (prefix >> hi))
            atomicAdd(&sh[(key >> shift) & (pqc_u32)(nbins - 1)], 1u);
    }
    __syncthreads();
    for (int i = tid; i < nbins; i += PQC_BLOCK)
        if (sh[i]) atomicAdd(&hg[i], sh[i]);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = (atomicAdd(&st[2], 1u) == gridDim.x - 1u) ? 1u : 0u;
    __syncthreads();
    if (!s_last) return;
    __threadfence();

    /* Last block: thread tid owns `per` consecutive bins in descending order, starting at
       bin nbins-1 - tid*per; an exclusive scan gives the count of keys in higher bins. */
    volatile pqc_u32 *vh = hg;
    int per = nbins / PQC_BLOCK; /* 8 or 4 */
    pqc_u32 cnt[8];
    pqc_u32 mine = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        cnt[i] = i < per ? vh[nbins - 1 - (tid * per + i)] : 0u;
        mine += cnt[i];
    }
    if (tid == 0) { s_bin = 0u; s_above = 0u; }
    pqc_u32 total;
    pqc_u32 above = pqc_block_exclusive_scan(mine, scan_tmp, &total);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (i < per && above < krem && krem <= above + cnt[i]) {
            s_bin = (pqc_u32)(nbins - 1 - (tid * per + i));
            s_above = above;
        }
        above += cnt[i];
    }
    __syncthreads();
    for (int i = tid; i < PQC_RADIX_BINS; i += PQC_BLOCK) hg[i] = 0u;
    if (tid == 0) {
        st[0] = prefix | (s_bin << shift);
        st[1] = krem - s_above;
        st[2] = 0u;
    }
}

/* pqc_topk_count: per-tile counts of keys above and equal to the threshold T.
 *   grid (ceil(s / 4096), n_kv) exactly, block 256 (tile of 4096 tokens per block).
 *   counts uint32 [n_tiles][2] per KV head: {#key > T, #key == T}. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_topk_count(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,
               const pqc_u32 *__restrict__ state, pqc_u32 *__restrict__ counts,
               pqc_i64 counts_head_stride, const int *__restrict__ k_head)
{
    __shared__ pqc_u32 scan_tmp[PQC_WARPS];
    pqc_i64 kv = blockIdx.y;
    k = pqc_head_k(k, k_head, kv);
    if (k <= 0 || s <= 0) return;
    const float *sc = scores + kv * score_head_stride;
    pqc_u32 T = state[kv * 4];
    pqc_u32 gt = 0u, eq = 0u;
    pqc_i64 base = (pqc_i64)blockIdx.x * PQC_TOPK_TILE;
    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {
        pqc_i64 t = base + i * PQC_BLOCK + threadIdx.x;
        if (t < s) {
            pqc_u32 key = pqc_float_key(sc[t]);
            gt += key > T;
            eq += key == T;
        }
    }
    pqc_u32 tgt, teq;
    pqc_block_exclusive_scan(gt, scan_tmp, &tgt);
    pqc_block_exclusive_scan(eq, scan_tmp, &teq);
    if (threadIdx.x == 0) {
        counts[kv * counts_head_stride + 2 * (pqc_i64)blockIdx.x] = tgt;
        counts[kv * counts_head_stride + 2 * (pqc_i64)blockIdx.x + 1] = teq;
    }
}

/* pqc_topk_compact: writes the selected token indices in ascending order.
 *   grid (ceil(s / 4096), n_kv) exactly (same tiles as pqc_topk_count), block 256.
 *   Selected: key > T, or key == T and fewer than state[1] equal keys precede it.
 *   out_idx    int32 [min(k, s)] per KV head (out_idx + kv*idx_head_stride)
 *   out_scores float [min(k, s)] per KV head, or NULL: the selected scores.
 *   Each block adds up the counts of the tiles before it, ranks its own tokens with two
 *   block-wide prefix sums (thread i owns tokens tile*4096 + i*16 .. +15) and writes them
 *   at their final positions. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_topk_compact(const float *__restrict__ scores, pqc_i64 score_head_stride, int s, int k,
                 const pqc_u32 *__restrict__ state, const pqc_u32 *__restrict__ counts,
                 pqc_i64 counts_head_stride, int *__restrict__ out_idx,
                 pqc_i64 idx_head_stride, float *__restrict__ out_scores,
                 pqc_i64 scores_out_head_stride, const int *__restrict__ k_head)
{
    /* tile of keys, padded by one word per 32 so that thread-contiguous reads are
       free of bank conflicts */
    __shared__ pqc_u32 tile[PQC_TOPK_TILE + PQC_TOPK_TILE / 32];
    __shared__ pqc_u32 scan_tmp[PQC_WARPS];
    pqc_i64 kv = blockIdx.y;
    k = pqc_head_k(k, k_head, kv);
    if (k <= 0 || s <= 0) return;
    int tid = threadIdx.x;
    const float *sc = scores + kv * score_head_stride;
    const pqc_u32 *cn = counts + kv * counts_head_stride;
    pqc_u32 T = state[kv * 4];
    pqc_u32 k_eq = state[kv * 4 + 1];

    /* counts of the tiles before this one */
    pqc_u32 gt_b = 0u, eq_b = 0u;
    for (int i = tid; i < (int)blockIdx.x; i += PQC_BLOCK) {
        gt_b += cn[2 * i];
        eq_b += cn[2 * i + 1];
    }
    pqc_u32 gt_before, eq_before;
    pqc_block_exclusive_scan(gt_b, scan_tmp, &gt_before);
    pqc_block_exclusive_scan(eq_b, scan_tmp, &eq_before);

    pqc_i64 base = (pqc_i64)blockIdx.x * PQC_TOPK_TILE;
    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {
        int p = i * PQC_BLOCK + tid;
        pqc_i64 t = base + p;
        tile[p + (p >> 5)] = t < s ? pqc_float_key(sc[t]) : 0u;
    }
    __syncthreads();

    int p0 = tid * PQC_TOPK_ITEMS;
    pqc_u32 n_eq = 0u;
    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {
        int p = p0 + i;
        if (base + p < s && tile[p + (p >> 5)] == T) ++n_eq;
    }
    pqc_u32 unused;
    pqc_u32 eq_rank = eq_before + pqc_block_exclusive_scan(n_eq, scan_tmp, &unused);
    pqc_u32 n_sel = 0u;
    pqc_u32 r = eq_rank;
    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {
        int p = p0 + i;
        if (base + p >= s) break;
        pqc_u32 key = tile[p + (p >> 5)];
        if (key > T) ++n_sel;
        else if (key == T) { if (r < k_eq) ++n_sel; ++r; }
    }
    pqc_u32 taken_before = gt_before + (eq_before < k_eq ? eq_before : k_eq);
    pqc_u32 pos = taken_before + pqc_block_exclusive_scan(n_sel, scan_tmp, &unused);
    int *oi = out_idx + kv * idx_head_stride;
    float *os = out_scores ? out_scores + kv * scores_out_head_stride : out_scores;
    r = eq_rank;
    for (int i = 0; i < PQC_TOPK_ITEMS; ++i) {
        int p = p0 + i;
        pqc_i64 t = base + p;
        if (t >= s) break;
        pqc_u32 key = tile[p + (p >> 5)];
        int take = 0;
        if (key > T) take = 1;
        else if (key == T) { take = r < k_eq; ++r; }
        if (take) {
            oi[pos] = (int)t;
            if (os) os[pos] = sc[t];
            ++pos;
        }
    }
}

/* Re-ranking on the device: each head's PQ candidates (a top-k of the codes, the k per
   head given) scored again with the stored keys (in mapped host memory, or the device's
   copy of their block), as the CPU library's pqc_rerank scores them (the same operations
   in the same order), then the top-k of those scores (the kernels above) and
   pqc_take_at. */

/* The pool slot of a head's block b, where a decode step's gather reads its rows: a sink
   block (b < sink_slots: slot b), the window's ring ((b + 1) * bt > mid_end), or with a
   block cache a block it holds whole (so: the head's slot_of table, fl: its slots'
   filled rows); -1: host memory alone holds the block. */
__device__ __forceinline__ int pqc_block_slot(pqc_i64 b, int bt, int mid_end, int sink_slots, int ring_slots,
                                              int cache_blocks, const int *so, const pqc_u32 *fl)
{
    if (b < sink_slots) return (int)b;
    if ((b + 1) * bt > mid_end) return sink_slots + (int)((b - sink_slots) % ring_slots);
    if (cache_blocks > 0 && so[b] >= 0 && fl[so[b]] >= (pqc_u32)bt) return sink_slots + ring_slots + so[b];
    return -1;
}

/* pqc_rerank_dots: the exact dots of every query head of a KV head with the key rows of
 *   its candidates, one warp per candidate.
 *   grid (ceil(n / 8), n_kv), block 256.
 *   cand   int32 per KV head (+ kv*cand_head_stride): coded token indices; candidate c is
 *          the key row of token n_sink + c; n_cand int32 [n_kv]: head kv scores the first
 *          n_cand[kv] (at most n)
 *   q      float [g][d_h] per KV head (+ kv*q_head_stride)
 *   host_k, pre_k, split, host_head_stride, pre_head_stride, host_ld, host_dtype: the key
 *          rows, laid out as for pqc_gather_kv
 *   block_tokens .. pool_head_stride: the rows the device holds are read there instead,
 *          as the gather reads them (pqc_block_slot, over the bookkeeping's tables per
 *          head: slot_of + kv*blk_head_stride, filled + kv*slot_head_stride); pool_k laid
 *          out as the gather's cache_k, in host_dtype
 *   stat   uint64 [n_kv][3] or NULL: stat[kv*3 + 2] gains row_bytes for each row read
 *          from host memory
 *   dots   float per KV head (+ kv*dots_head_stride): head h's dot with candidate i at
 *          h*dots_row_stride + i
 * A dot is the CPU's pqc__rowdots: 16 interleaved lanes (lane e % 16) of sequential fmaf
 * over the dims from 0, then the lanes added in order from 0. Here lane l of each half
 * warp takes dims e = l (mod 16), the half warps take every other head, 16 heads at a time. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rerank_dots(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand, int n,
                int n_sink, const float *__restrict__ q, pqc_i64 q_head_stride, int g,
                const void *host_k, pqc_i64 host_head_stride, const void *pre_k, pqc_i64 pre_head_stride,
                pqc_i64 split, pqc_i64 host_ld, int host_dtype, int d_h, int block_tokens, int mid_end,
                int sink_slots, int ring_slots, int cache_blocks, const int *__restrict__ slot_of,
                pqc_i64 blk_head_stride, const pqc_u32 *__restrict__ filled, pqc_i64 slot_head_stride,
                const void *pool_k, pqc_i64 pool_head_stride, pqc_u64 *stat, pqc_u64 row_bytes,
                float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride)
{
    __shared__ float red[PQC_WARPS][32][8];
    pqc_i64 kv = blockIdx.y;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31, l = lane & 15, hf = lane >> 4;
    int i = blockIdx.x * PQC_WARPS + w, nc = n_cand[kv] < n ? n_cand[kv] : n;
    if (i >= nc) return;
    pqc_i64 t = (pqc_i64)cand[kv * cand_head_stride + i] + n_sink;
    pqc_i64 sl = pqc_block_slot(t / block_tokens, block_tokens, mid_end, sink_slots, ring_slots, cache_blocks,
                                slot_of + kv * blk_head_stride, filled + kv * slot_head_stride);
    const char *row;
    if (sl >= 0) {
        row = (const char *)pool_k +
              (kv * pool_head_stride + (sl * block_tokens + t % block_tokens) * d_h) * pqc_dtype_size(host_dtype);
    } else {
        int pre = t < split;
        row = (const char *)(pre ? pre_k : host_k) +
              (kv * (pre ? pre_head_stride : host_head_stride) + (pre ? t : t - split) * host_ld) *
                  pqc_dtype_size(host_dtype);
        if (stat && lane == 0) atomicAdd(&stat[kv * 3 + 2], row_bytes);
    }
    const float *qk = q + kv * q_head_stride;
    float *out = dots + kv * dots_head_stride + i;
    for (int h0 = 0; h0 < g; h0 += 16) {
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (int e = l; e < d_h; e += 16) {
            float x = pqc_load_elem(row, e, host_dtype);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                int h = h0 + hf + 2 * j;
                if (h < g) acc[j] = fmaf(qk[(pqc_i64)h * d_h + e], x, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) red[w][lane][j] = acc[j];
        __syncwarp();
        if (l == 0)
            for (int j = 0; j < 8; ++j) {
                int h = h0 + hf + 2 * j;
                if (h >= g) break;
                float a = 0.0f;
                for (int ll = 0; ll < 16; ++ll) a += red[w][hf * 16 + ll][j];
                out[(pqc_i64)h * dots_row_stride] = a;
            }
        __syncwarp();
    }
}

#define PQC_RR_CHUNK 512 /* candidates a block holds in shared memory at a time */

/* pqc_rerank_combine: each head's candidates' combined score from the dots, as the CPU's
 *   pqc_rerank combines them.
 *   grid (1, n_kv), block 256.
 *   dots, dots_head_stride, dots_row_stride, n_cand, n: as pqc_rerank_dots; with
 *          softmax-sum they are overwritten with the exponentials
 *   mode   PQC_SCAN_RAW: comb[i] = the heads' dots added in order from 0;
 *          PQC_SCAN_SOFTMAX_SUM: each head's e(i) = pqc_exp((dot - max) * scale) (max over
 *          its candidates), Z = its 16 interleaved lanes (lane i % 16, each in order from
 *          0) added in order from 0, w = 1 / Z into wbuf [g] per KV head (+ kv*g), and
 *          comb[i] = fmaf(e_h(i), w_h, .) over the heads in order from 0
 *   comb   float [n] per KV head (+ kv*comb_head_stride); entries n_cand[kv] - nf..n-1
 *          get -infinity, below every score (the dots of finite rows are finite), so that
 *          a top-k of at most n_cand[kv] - nf never takes them
 *   nf     the last nf candidates of each head only join the softmax (a cache's sinks and
 *          window tokens, pqc_rerank_append): scored, never chosen */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rerank_combine(float *dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, const int *__restrict__ n_cand,
                   int n, int g, int mode, float scale, float *wbuf, float *__restrict__ comb, pqc_i64 comb_head_stride,
                   int nf)
{
    __shared__ float ch[4][PQC_RR_CHUNK];
    __shared__ float red[PQC_BLOCK];
    __shared__ float mx[4];
    pqc_i64 kv = blockIdx.y;
    int tid = threadIdx.x, nc = n_cand[kv] < n ? n_cand[kv] : n;
    float *dk = dots + kv * dots_head_stride, *w = wbuf + kv * g, *cb = comb + kv * comb_head_stride;
    for (int h0 = 0; mode == PQC_SCAN_SOFTMAX_SUM && h0 < g; h0 += 4) {
        int gh = g - h0 < 4 ? g - h0 : 4, hh = tid >> 4, l = tid & 15;
        float z = 0.0f;
        for (int j = 0; j < gh; ++j) { /* the maxima (the same value in any order) */
            const float *r = dk + (pqc_i64)(h0 + j) * dots_row_stride;
            float m = -__int_as_float(0x7f800000);
            for (int i = tid; i < nc; i += PQC_BLOCK) m = fmaxf(m, r[i]);
            red[tid] = m;
            __syncthreads();
            for (int o = PQC_BLOCK / 2; o > 0; o >>= 1) {
                if (tid < o) red[tid] = fmaxf(red[tid], red[tid + o]);
                __syncthreads();
            }
            if (tid == 0) mx[j] = red[0];
            __syncthreads();
        }
        for (int c0 = 0; c0 < nc; c0 += PQC_RR_CHUNK) { /* exponentials, then the lanes' sums */
            int cn = nc - c0 < PQC_RR_CHUNK ? nc - c0 : PQC_RR_CHUNK;
            for (int x = tid; x < gh * PQC_RR_CHUNK; x += PQC_BLOCK) {
                int j = x / PQC_RR_CHUNK, i = x % PQC_RR_CHUNK;
                if (i < cn) {
                    float *r = dk + (pqc_i64)(h0 + j) * dots_row_stride + c0 + i;
                    float e = pqc_exp((*r - mx[j]) * scale);
                    ch[j][i] = e;
                    *r = e;
                }
            }
            __syncthreads();
            if (hh < gh)
                for (int i = l; i < cn; i += 16) z += ch[hh][i];
            __syncthreads();
        }
        red[tid] = z;
        __syncthreads();
        if (tid < gh) {
            float a = 0.0f;
            for (int ll = 0; ll < 16; ++ll) a += red[tid * 16 + ll];
            w[h0 + tid] = 1.0f / a;
        }
        __syncthreads();
    }
    for (int i = tid; i < n; i += PQC_BLOCK) {
        float a = 0.0f;
        if (i >= nc - nf) {
            a = -__int_as_float(0x7f800000);
        } else if (mode == PQC_SCAN_SOFTMAX_SUM) {
            for (int h = 0; h < g; ++h) a = fmaf(dk[(pqc_i64)h * dots_row_stride + i], w[h], a);
        } else {
            for (int h = 0; h < g; ++h) a += dk[(pqc_i64)h * dots_row_stride + i];
        }
        cb[i] = a;
    }
}

/* Entries of the ascending x[0..n) below v. */
__device__ __forceinline__ int pqc_lower_bound(const int *x, int n, int v)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (x[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* pqc_rerank_merge: each head's candidates merged with its outlier list, as the CPU
 *   library merges them before re-ranking: both ascending, the list's tokens at or past
 *   `coded` left out, a token in both taken once.
 *   grid (1, n_kv), block 256.
 *   cand  int32 (+ kv*cand_head_stride), n_cand int32 [n_kv]: the candidates
 *   outl  int32 (+ kv*out_head_stride), n_out int32 [n_kv]: the outlier list
 *   kept  int32 scratch (+ kv*kept_head_stride), room for n_out[kv]: the list's tokens
 *         merged in, ascending
 *   merged int32 (+ kv*merged_head_stride), n_merged int32 [n_kv]: the union, ascending.
 * A kept token's place is the kept ones before it plus the candidates below it (a block
 * scan over the list in steps of 256), a candidate's its index plus the kept tokens
 * below it. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rerank_merge(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand,
                 const int *__restrict__ outl, pqc_i64 out_head_stride, const int *__restrict__ n_out, int coded,
                 int *__restrict__ kept, pqc_i64 kept_head_stride, int *__restrict__ merged,
                 pqc_i64 merged_head_stride, int *__restrict__ n_merged)
{
    __shared__ pqc_u32 scan_tmp[PQC_WARPS];
    pqc_i64 kv = blockIdx.y;
    int tid = threadIdx.x, nc = n_cand[kv], no = n_out[kv];
    const int *c = cand + kv * cand_head_stride, *o = outl + kv * out_head_stride;
    int *kp = kept + kv * kept_head_stride, *m = merged + kv * merged_head_stride;
    pqc_u32 base = 0;
    for (int j0 = 0; j0 < no; j0 += PQC_BLOCK) {
        int j = j0 + tid, v = j < no ? o[j] : 0, below = 0;
        pqc_u32 keep = 0u, total;
        if (j < no && v < coded) {
            below = pqc_lower_bound(c, nc, v);
            keep = below == nc || c[below] != v;
        }
        pqc_u32 before = pqc_block_exclusive_scan(keep, scan_tmp, &total);
        if (keep) {
            kp[base + before] = v;
            m[(int)(base + before) + below] = v;
        }
        base += total;
    }
    __syncthreads();
    for (int i = tid; i < nc; i += PQC_BLOCK) m[i + pqc_lower_bound(kp, (int)base, c[i])] = c[i];
    if (tid == 0) n_merged[kv] = nc + (int)base;
}

/* pqc_take_at: out[i] = src[pos[i]] for i < k (k per head: k_head[kv], at most n),
 *   per KV head (+ kv*src_head_stride, pos_head_stride, out_head_stride): the candidates
 *   a top-k of their scores kept (pos ascending, so out stays ascending). Entries at or
 *   past `coded` are the window's rivals (pqc_rerank_append: rival r as rbase + r) and
 *   become coded + r, as pqc_select_admit takes them.
 *   grid (ceil(n / 256), n_kv), block 256. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_take_at(const int *__restrict__ src, pqc_i64 src_head_stride, const int *__restrict__ pos,
            pqc_i64 pos_head_stride, const int *__restrict__ k_head, int n, int *__restrict__ out,
            pqc_i64 out_head_stride, int coded, int rbase)
{
    pqc_i64 kv = blockIdx.y;
    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, k = pqc_head_k(n, k_head, kv);
    if (i < k) {
        int v = src[kv * src_head_stride + pos[kv * pos_head_stride + i]];
        out[kv * out_head_stride + i] = v >= coded ? coded + (v - rbase) : v;
    }
}

/* The token of entry j of a step's window rows: its nx rivals [from, from + nx), the sinks
   [0, sink), then the window's last tokens [from + nx, ...) (pqc_rival_cands,
   pqc_rerank_append; the CPU library lists them in the same order). */
__device__ __forceinline__ int pqc_window_row(int j, int from, int nx, int sink)
{
    return j < nx ? from + j : j < nx + sink ? j - nx : from + (j - sink);
}

/* pqc_rerank_append: each head's candidates (cand + kv*cand_head_stride, n_cand[kv] of
 *   them, coded token indices) copied to out (+ kv*out_head_stride), then the window's nx
 *   rivals [from, from + nx), the sinks [0, sink) and the window's last tokens
 *   [from + nx, n), as pqc_rival_cands lists them (token n_sink + c for entry c): the rows
 *   a cache's exact scoring scores, in the CPU library's order; n_out[kv] gets
 *   n_cand[kv] + n - from + sink.
 *   grid (ceil(most / 256), n_kv), block 256, most: the largest n_out. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rerank_append(const int *__restrict__ cand, pqc_i64 cand_head_stride, const int *__restrict__ n_cand, int n_sink,
                  int sink, int from, int nx, int n, int *__restrict__ out, pqc_i64 out_head_stride,
                  int *__restrict__ n_out)
{
    pqc_i64 kv = blockIdx.y;
    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, nc = n_cand[kv], nxf = n - from + sink;
    if (i == 0) n_out[kv] = nc + nxf;
    if (i < nc) {
        out[kv * out_head_stride + i] = cand[kv * cand_head_stride + i];
    } else if (i < nc + nxf) {
        out[kv * out_head_stride + i] = pqc_window_row(i - nc, from, nx, sink) - n_sink;
    }
}

/* ------------------------------------------------------------------------------------ */
/* (d) Gather of selected K/V rows and block-cache fill                                  */
/* ------------------------------------------------------------------------------------ */

/* Converts one row of n elements of dtype at src to fp32 at dst, by the 32 lanes of a
   warp (16-byte loads when the row allows them). */
__device__ __forceinline__ void pqc_warp_row_to_f32(const void *src, int dtype, int n,
                                                    float *__restrict__ dst, int lane)
{
    int es = pqc_dtype_size(dtype);
    pqc_u64 nbytes = (pqc_u64)n * es;
    if ((((pqc_u64)src | nbytes) & 15u) == 0u) {
        const uint4 *s4 = (const uint4 *)src;
        int n16 = (int)(nbytes >> 4);
        for (int c = lane; c < n16; c += 32) {
            uint4 v = s4[c];
            if (dtype == PQC_DT_F32) {
                float *d = dst + 4 * c;
                d[0] = __uint_as_float(v.x);
                d[1] = __uint_as_float(v.y);
                d[2] = __uint_as_float(v.z);
                d[3] = __uint_as_float(v.w);
            } else {
                float *d = dst + 8 * c;
                pqc_u32 w[4];
                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (dtype == PQC_DT_F16) {
                        d[2 * i] = pqc_f16_to_f32(w[i] & 0xffffu);
                        d[2 * i + 1] = pqc_f16_to_f32(w[i] >> 16);
                    } else {
                        d[2 * i] = pqc_bf16_to_f32(w[i] & 0xffffu);
                        d[2 * i + 1] = pqc_bf16_to_f32(w[i] >> 16);
                    }
                }
            }
        }
    } else {
        for (int e = lane; e < n; e += 32) dst[e] = pqc_load_elem(src, e, dtype);
    }
}

/* Copies one row of nbytes bytes by the 32 lanes of a warp (16-byte words when aligned,
   else 2-byte words; rows are a whole number of 2-byte elements). */
__device__ __forceinline__ void pqc_warp_row_copy(const void *src, void *dst, pqc_u64 nbytes,
                                                  int lane)
{
    if ((((pqc_u64)src | (pqc_u64)dst | nbytes) & 15u) == 0u) {
        const uint4 *s4 = (const uint4 *)src;
        uint4 *d4 = (uint4 *)dst;
        for (pqc_u64 c = lane; c < (nbytes >> 4); c += 32) d4[c] = s4[c];
    } else {
        const pqc_u16 *s2 = (const pqc_u16 *)src;
        pqc_u16 *d2 = (pqc_u16 *)dst;
        for (pqc_u64 c = lane; c < (nbytes >> 1); c += 32) d2[c] = s2[c];
    }
}

/* pqc_gather_kv: fetches the K and V rows of the selected tokens as fp32.
 *   grid (ceil(n / 8), n_kv), block 256; one warp per selected token.
 *   idx        int32 [n] per KV head: token indices (idx + kv*idx_head_stride)
 *   slot_table int32 per KV head: block (token / block_tokens) -> cache slot, or -1; may
 *              be NULL (everything is a miss)
 *   cache_k/v  [n_slots][block_tokens][d_h] of cache_dtype per KV head
 *              (+ kv*cache_head_stride elements): row of token t in slot p is
 *              p*block_tokens + t % block_tokens
 *   host_k/v   device-accessible pointers to pinned, mapped host memory of host_dtype:
 *              row of token t at + kv*host_head_stride + (t - split)*host_ld elements
 *   pre_k/v    the same for tokens t < split (a forked cache's shared prefix): row at
 *              + kv*pre_head_stride + t*host_ld; unused when split is 0
 *   out_k/v    float [n][d_h] per KV head (+ kv*out_head_stride); either may be NULL to
 *              skip K or V
 *   miss_count uint32 [n_kv] or NULL: incremented once per row read from host memory. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_gather_kv(const int *__restrict__ idx, pqc_i64 idx_head_stride, int n,
              const int *__restrict__ slot_table, pqc_i64 slot_head_stride, int block_tokens,
              const void *cache_k, const void *cache_v, pqc_i64 cache_head_stride,
              int cache_dtype,
              const void *host_k, const void *host_v, pqc_i64 host_head_stride,
              const void *pre_k, const void *pre_v, pqc_i64 pre_head_stride, pqc_i64 split,
              pqc_i64 host_ld, int host_dtype, int d_h,
              float *out_k, float *out_v, pqc_i64 out_head_stride, pqc_u32 *miss_count)
{
    pqc_i64 kv = blockIdx.y;
    int lane = threadIdx.x & 31;
    int i = blockIdx.x * PQC_WARPS + (threadIdx.x >> 5);
    if (i >= n) return;
    pqc_i64 t = idx[kv * idx_head_stride + i];
    int slot = -1;
    if (slot_table) slot = slot_table[kv * slot_head_stride + t / block_tokens];
    const char *srck, *srcv;
    int dt;
    if (slot >= 0) {
        pqc_i64 row = (pqc_i64)slot * block_tokens + t % block_tokens;
        pqc_i64 off = (kv * cache_head_stride + row * d_h) * pqc_dtype_size(cache_dtype);
        srck = (const char *)cache_k + off;
        srcv = (const char *)cache_v + off;
        dt = cache_dtype;
    } else {
        int pre = t < split;
        pqc_i64 off = (kv * (pre ? pre_head_stride : host_head_stride) + (pre ? t : t - split) * host_ld) *
                      pqc_dtype_size(host_dtype);
        srck = (const char *)(pre ? pre_k : host_k) + off;
        srcv = (const char *)(pre ? pre_v : host_v) + off;
        dt = host_dtype;
        if (miss_count && lane == 0) atomicAdd(&miss_count[kv], 1u);
    }
    pqc_i64 o = kv * out_head_stride + (pqc_i64)i * d_h;
    if (out_k) pqc_warp_row_to_f32(srck, dt, d_h, out_k + o, lane);
    if (out_v) pqc_warp_row_to_f32(srcv, dt, d_h, out_v + o, lane);
}

/* pqc_cache_fill: copies rows [row_lo, block_tokens) of whole blocks of K/V from mapped
 *   host memory into cache slots, keeping the dtype (cache dtype = host dtype).
 *   grid (ceil(n_blocks * (block_tokens - row_lo) / 8), n_kv), block 256; one warp per row.
 *   blocks int32 [n_blocks] block ids, slots int32 [n_blocks] destination slots (same for
 *   every KV head: blocks + kv*list_head_stride, slots + kv*list_head_stride)
 *   row_lo: first row of each block to copy (0: whole blocks; the row of one new token
 *   with n_blocks = 1 appends it)
 *   rows of tokens >= s (a partial last block) are left untouched. Layouts (and the
 *   shared prefix below split) as for pqc_gather_kv; cache_v / host_v may be NULL to
 *   copy K only. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_cache_fill(const int *__restrict__ blocks, const int *__restrict__ slots,
               pqc_i64 list_head_stride, int n_blocks, int block_tokens, int row_lo, int s,
               const void *host_k, const void *host_v, pqc_i64 host_head_stride,
               const void *pre_k, const void *pre_v, pqc_i64 pre_head_stride, pqc_i64 split,
               pqc_i64 host_ld, int dtype, int d_h,
               void *cache_k, void *cache_v, pqc_i64 cache_head_stride)
{
    pqc_i64 kv = blockIdx.y;
    int lane = threadIdx.x & 31;
    pqc_i64 w = (pqc_i64)blockIdx.x * PQC_WARPS + (threadIdx.x >> 5);
    int rows = block_tokens - row_lo;
    if (row_lo < 0 || rows <= 0 || w >= (pqc_i64)n_blocks * rows) return;
    int bi = (int)(w / rows), r = row_lo + (int)(w % rows);
    pqc_i64 blk = blocks[kv * list_head_stride + bi];
    pqc_i64 slot = slots[kv * list_head_stride + bi];
    pqc_i64 t = blk * block_tokens + r;
    if (t >= s) return;
    int es = pqc_dtype_size(dtype), pre = t < split;
    pqc_i64 src = (kv * (pre ? pre_head_stride : host_head_stride) + (pre ? t : t - split) * host_ld) * es;
    pqc_i64 dst = (kv * cache_head_stride + (slot * block_tokens + r) * d_h) * es;
    pqc_u64 nbytes = (pqc_u64)d_h * es;
    const char *hk = (const char *)(pre ? pre_k : host_k), *hv = (const char *)(pre ? pre_v : host_v);
    pqc_warp_row_copy(hk + src, (char *)cache_k + dst, nbytes, lane);
    if (hv && cache_v) pqc_warp_row_copy(hv + src, (char *)cache_v + dst, nbytes, lane);
}

/* The window competing with the coded tokens (PQC_SPLIT_COMPETE): its rivals, the
 * window's tokens [from, from + nx), then the sinks [0, sink) and the window's last tokens
 * [from + nx, n), nxf = nx + sink + n - from - nx of them, as candidates of
 * pqc_rerank_dots (token n_sink + c for candidate c), one list for every head.
 *   pqc_rival_cands: grid ceil(nxf / 256), block 256; n_cand int32 [n_kv] gets nxf. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rival_cands(int *__restrict__ cand, int *__restrict__ n_cand, int n_kv, int n_sink, int sink, int from, int nx,
                int n)
{
    int i = blockIdx.x * PQC_BLOCK + threadIdx.x, nxf = n - from + sink;
    if (i < n_kv) n_cand[i] = nxf;
    if (i >= nxf) return;
    cand[i] = pqc_window_row(i, from, nx, sink) - n_sink;
}

/* pqc_rival_stats: the rivals and the other exactly scored tokens join each head's
 *   softmax statistics (pqc_softmax_finalize's {max_h, Z_h}): their online {max, sum}
 *   over the nxf dots of head h (dots + kv*dots_head_stride + h*dots_row_stride), merged
 *   into stats after the coded tokens'. grid (1, n_kv), block 256. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rival_stats(const float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, int nxf, int g,
                float scale, float *__restrict__ stats, pqc_i64 stats_head_stride)
{
    __shared__ float red_m[PQC_BLOCK];
    __shared__ float red_s[PQC_BLOCK];
    __shared__ float part[2];
    pqc_i64 kv = blockIdx.y;
    int tid = threadIdx.x;
    for (int h = 0; h < g; ++h) {
        const float *x = dots + kv * dots_head_stride + (pqc_i64)h * dots_row_stride;
        float mx = -__int_as_float(0x7f800000), sm = 0.0f;
        for (int i = tid; i < nxf; i += PQC_BLOCK) pqc_online_add(mx, sm, x[i], scale);
        pqc_block_online_reduce(mx, sm, scale, red_m, red_s, part);
        if (tid == 0) {
            float *st = stats + kv * stats_head_stride + 2 * h, m1 = st[0], s1 = st[1];
            pqc_online_merge(m1, s1, part[0], part[1], scale);
            st[0] = m1;
            st[1] = s1;
        }
        __syncthreads();
    }
}

/* pqc_rival_scores: the rivals' scores after the coded tokens', out[s + i] for i < nx
 *   (out + kv*out_head_stride), made from their exact dots as pqc_scan makes a coded
 *   token's from its PQ scores: mode PQC_SCAN_RAW (the summed query) the heads' dots
 *   added in order from 0; PQC_SCAN_SOFTMAX_SUM fmaf(pqc_exp((dot_h - max_h) * scale),
 *   1/Z_h, out) over the heads in order, from 0. grid (ceil(nx / 256), n_kv), block 256. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_rival_scores(const float *__restrict__ dots, pqc_i64 dots_head_stride, pqc_i64 dots_row_stride, int nx, int g,
                 int mode, const float *__restrict__ stats, pqc_i64 stats_head_stride, float scale, int s,
                 float *__restrict__ out, pqc_i64 out_head_stride)
{
    pqc_i64 kv = blockIdx.y;
    int i = blockIdx.x * PQC_BLOCK + threadIdx.x;
    if (i >= nx) return;
    const float *x = dots + kv * dots_head_stride + i;
    const float *st = stats ? stats + kv * stats_head_stride : stats;
    float a = 0.0f;
    for (int h = 0; h < g; ++h) {
        float v = x[(pqc_i64)h * dots_row_stride];
        if (mode == PQC_SCAN_SOFTMAX_SUM) a = fmaf(pqc_exp((v - st[2 * h]) * scale), 1.0f / st[2 * h + 1], a);
        else a += v;
    }
    out[kv * out_head_stride + s + i] = a;
}

/* Token at position i of a head's decode selection (see pqc_select_admit): the first kc
   of the take top-k entries are coded tokens, the others rivals (coded + r: window
   token rfrom + r), placed after the tokens not coded yet. */
__device__ __forceinline__ int pqc_sel_token(int i, int sink, int take, const int *tk, int n_sink, int unc0,
                                             int unc, int win0, int kc, int coded, int rfrom)
{
    if (i < sink) return i;
    i -= sink;
    if (i < kc) return (tk ? tk[i] : i) + n_sink;
    i -= kc;
    if (i < unc) return unc0 + i;
    i -= unc;
    if (i < take - kc) return rfrom + (tk[kc + i] - coded);
    return win0 + (i - (take - kc));
}

/* pqc_select_admit: a decode step's selection and block-cache bookkeeping, per KV head, on
 *   the device: the library's host rules (pqc__select_head, pqc__admit, pqc__victim,
 *   pqc__fetch_account) bit for bit, so that the step needs no host round trip.
 *   grid (1, n_kv), block 256.
 *   Selection of head kv, ascending, into sel (+ kv*sel_head_stride), zeros after it up
 *   to `rows`: the sinks [0, min(n_sink, n)); the top-k, topk[i] + n_sink for i < take
 *   (take = takes[kv]; topk NULL: the coded tokens i + n_sink for i < take); the tokens not
 *   coded yet [n_sink + coded, mid_end); the window [max(mid_end, sinks), n). With rivals
 *   (PQC_SPLIT_COMPETE: the window's first `rivals` tokens competed with the coded ones,
 *   pqc_rival_scores) the top-k's entries from coded on are those rivals (window token
 *   max(mid_end, sinks) + entry - coded), which follow the tokens not coded yet, and the
 *   window is its last n - max(mid_end, sinks) - rivals tokens.
 *   Admission (cache_blocks > 0 and admit_blocks > 0): every mid block's score decays by
 *   0.75 and gains its selected tokens (blocks overlapping the sinks or the window
 *   excepted); up to admit_blocks selected blocks in score order (ties to the lower
 *   block) enter a free slot, or the policy's victim (lfu: lowest score, then oldest
 *   stamp; else oldest stamp; never one stamped step + 1) when their score beats the
 *   victim's by 1.5x + 1; a cached block that grew is topped up.
 *   Per head, block tables (+ kv*blk_head_stride): score f32, slot_of i32 (-1: none),
 *   cnt u32 (zero between calls); slot tables (+ kv*slot_head_stride): block_of i32,
 *   filled u32, touched u32 (zero between calls), freq u64, stamp u64.
 *   Outputs: slot_table i32 (+ kv*table_head_stride), for the blocks of the n tokens: the
 *   pool slot of sink and window blocks and of fully cached blocks, else -1 (pool slots:
 *   sink_slots, ring_slots, then the cache's); fill_b/fill_s/fill_rows (+ kv*
 *   fill_head_stride): the copies to make (block, pool slot, rows new), padded up to
 *   admit_blocks with block ceil(n / block_tokens), which pqc_cache_fill skips;
 *   stat u64 (+ kv*3): hits, misses and bytes host -> device added. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_select_admit(const int *__restrict__ topk, pqc_i64 topk_head_stride, const int *__restrict__ takes,
                 int n_sink, int coded, int mid_end, int n, int rows, int *__restrict__ sel,
                 pqc_i64 sel_head_stride, int block_tokens, int sink_slots, int ring_slots, int cache_blocks,
                 int admit_blocks, int lfu, pqc_u64 step, float *score, int *slot_of, pqc_u32 *cnt,
                 pqc_i64 blk_head_stride, int *block_of, pqc_u32 *filled, pqc_u32 *touched, pqc_u64 *freq,
                 pqc_u64 *stamp, pqc_i64 slot_head_stride, int *slot_table, pqc_i64 table_head_stride,
                 int *fill_b, int *fill_s, int *fill_rows, pqc_i64 fill_head_stride, pqc_u64 *stat,
                 pqc_u64 row_bytes, int rivals)
{
    __shared__ float r_sc[PQC_BLOCK];
    __shared__ int r_b[PQC_BLOCK];
    __shared__ int s_stop, s_nf, s_kc;
    __shared__ pqc_u32 s_hits, s_miss;
    pqc_i64 kv = blockIdx.y;
    int tid = threadIdx.x, bt = block_tokens;
    const int *tk = topk ? topk + kv * topk_head_stride : 0;
    int take = takes[kv];
    int sink = n_sink < n ? n_sink : n;
    int unc0 = n_sink + coded, unc = mid_end > unc0 ? mid_end - unc0 : 0;
    int rfrom = mid_end > sink ? mid_end : sink, win0 = rfrom + rivals, win = n > win0 ? n - win0 : 0;
    int count = sink + take + unc + win, kc;
    int nb = (mid_end + bt - 1) / bt, nb_all = (n + bt - 1) / bt;
    int admit = cache_blocks > 0 && admit_blocks > 0, pool0 = sink_slots + ring_slots;
    pqc_u64 next = step + 1;
    int *out = sel + kv * sel_head_stride;
    float *sc = score + kv * blk_head_stride;
    int *so = slot_of + kv * blk_head_stride;
    pqc_u32 *cb = cnt + kv * blk_head_stride;
    int *bo = block_of + kv * slot_head_stride;
    pqc_u32 *fl = filled + kv * slot_head_stride, *tc = touched + kv * slot_head_stride;
    pqc_u64 *fq = freq + kv * slot_head_stride, *stp = stamp + kv * slot_head_stride;
    int *fb = fill_b + kv * fill_head_stride, *fs = fill_s + kv * fill_head_stride;
    int *fr = fill_rows + kv * fill_head_stride;

    if (tid == 0) { /* the top-k's coded entries (ascending): those below coded */
        int lo = 0, hi = take;
        while (tk && rivals > 0 && lo < hi) {
            int mid = (lo + hi) / 2;
            if (tk[mid] < coded) lo = mid + 1;
            else hi = mid;
        }
        s_kc = tk && rivals > 0 ? lo : take;
    }
    __syncthreads();
    kc = s_kc;
    for (int i = tid; i < rows; i += PQC_BLOCK)
        out[i] = i < count ? pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom) : 0;
    if (tid == 0) {
        s_stop = 0;
        s_nf = 0;
        s_hits = 0u;
        s_miss = 0u;
    }
    __syncthreads();
    if (admit) {
        for (int b = tid; b < nb; b += PQC_BLOCK) sc[b] = __fmul_rn(sc[b], 0.75f);
        for (int i = tid; i < count; i += PQC_BLOCK) {
            int t = pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom), b = t / bt;
            if (t >= n_sink && t < mid_end && !(b * bt < n_sink || (b + 1) * bt > mid_end)) atomicAdd(&cb[b], 1u);
        }
        __syncthreads();
        for (int b = tid; b < nb; b += PQC_BLOCK) sc[b] = __fadd_rn(sc[b], (float)cb[b]);
        __syncthreads();
        for (int a = 0; a < admit_blocks; ++a) {
            float bs = 0.0f;
            int bb = nb;
            for (int b = tid; b < nb; b += PQC_BLOCK)
                if (cb[b] > 0u && (bb == nb || sc[b] > bs)) {
                    bb = b;
                    bs = sc[b];
                }
            r_sc[tid] = bs;
            r_b[tid] = bb;
            __syncthreads();
            for (int w = PQC_BLOCK / 2; w > 0; w >>= 1) {
                if (tid < w) {
                    int j = tid + w;
                    if (r_b[j] != nb &&
                        (r_b[tid] == nb || r_sc[j] > r_sc[tid] || (r_sc[j] == r_sc[tid] && r_b[j] < r_b[tid]))) {
                        r_sc[tid] = r_sc[j];
                        r_b[tid] = r_b[j];
                    }
                }
                __syncthreads();
            }
            if (tid == 0) {
                int best = r_b[0], s = -1, go = 1;
                if (best == nb) {
                    s_stop = 1;
                    go = 0;
                } else {
                    int valid = mid_end - best * bt < bt ? mid_end - best * bt : bt;
                    cb[best] = 0u;
                    s = so[best];
                    if (s < 0) { /* the victim: a free slot, else by policy */
                        for (int x = 0; x < cache_blocks; ++x) {
                            if (bo[x] < 0) {
                                s = x;
                                break;
                            }
                            if (stp[x] == next) continue;
                            if (s < 0) {
                                s = x;
                            } else if (!lfu) {
                                if (stp[x] < stp[s]) s = x;
                            } else {
                                float va = sc[bo[x]], vb = sc[bo[s]];
                                if (va < vb || (va == vb && stp[x] < stp[s])) s = x;
                            }
                        }
                        if (s < 0) {
                            s_stop = 1;
                            go = 0;
                        } else if (bo[s] >= 0 && !(sc[best] > __fadd_rn(__fmul_rn(1.5f, sc[bo[s]]), 1.0f))) {
                            go = 0; /* not worth a copy */
                        } else {
                            int f, g = 0;
                            if (bo[s] >= 0) so[bo[s]] = -1;
                            for (f = 0; f < s_nf; ++f) /* a copy into this slot listed earlier */
                                if (fs[f] != pool0 + s) {
                                    fb[g] = fb[f];
                                    fs[g] = fs[f];
                                    fr[g] = fr[f];
                                    ++g;
                                }
                            s_nf = g;
                            fl[s] = 0u;
                            bo[s] = best;
                            so[best] = s;
                            fq[s] = 0ull;
                            stp[s] = next;
                        }
                    }
                    if (go && fl[s] < (pqc_u32)valid) {
                        fb[s_nf] = best;
                        fs[s_nf] = pool0 + s;
                        fr[s_nf] = valid - (int)fl[s];
                        ++s_nf;
                        fl[s] = (pqc_u32)valid;
                    }
                }
            }
            __syncthreads();
            if (s_stop) break;
        }
        for (int b = tid; b < nb; b += PQC_BLOCK) cb[b] = 0u;
    }
    /* hits: blocks resident by design, cached rows; misses: rows read from host memory */
    for (int i = tid; i < count; i += PQC_BLOCK) {
        int t = pqc_sel_token(i, sink, take, tk, n_sink, unc0, unc, win0, kc, coded, rfrom), b = t / bt, s;
        if (t < n_sink || t >= mid_end) continue;
        if (b * bt < n_sink || (b + 1) * bt > mid_end) {
            atomicAdd(&s_hits, 1u);
        } else if (admit && (s = so[b]) >= 0 && (pqc_u32)(t % bt) < fl[s]) {
            tc[s] = 1u;
            atomicAdd(&s_hits, 1u);
        } else {
            atomicAdd(&s_miss, 1u);
        }
    }
    __syncthreads();
    for (int x = tid; admit && x < cache_blocks; x += PQC_BLOCK)
        if (tc[x]) {
            if (stp[x] != next) fq[x] += 1ull;
            stp[x] = next;
            tc[x] = 0u;
        }
    for (int f = s_nf + tid; f < admit_blocks; f += PQC_BLOCK) {
        fb[f] = nb_all;
        fs[f] = 0;
        fr[f] = 0;
    }
    for (int b = tid; b < nb_all; b += PQC_BLOCK) {
        slot_table[kv * table_head_stride + b] =
            pqc_block_slot(b, bt, mid_end, sink_slots, ring_slots, cache_blocks, so, fl);
    }
    if (tid == 0) {
        pqc_u64 h2d = (pqc_u64)s_miss * 2ull * row_bytes;
        for (int f = 0; f < s_nf; ++f) h2d += (pqc_u64)fr[f] * 2ull * row_bytes;
        stat[kv * 3] += s_hits;
        stat[kv * 3 + 1] += s_miss;
        stat[kv * 3 + 2] += h2d;
    }
}

/* ------------------------------------------------------------------------------------ */
/* (e) PQ codes of new keys                                                             */
/* ------------------------------------------------------------------------------------ */

/* pqc_centroid_norms: out[r] = sequential fmaf over e of c[r][e]^2, from 0.
 *   grid ceil(rows / 256), block 256; one thread per row of the [rows][d] matrix (for
 *   the codebooks of n_kv heads: rows = n_kv*m*K, d = d_sub). */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_centroid_norms(const float *__restrict__ c, int rows, int d, float *__restrict__ out)
{
    int r = blockIdx.x * PQC_BLOCK + threadIdx.x;
    if (r >= rows) return;
    const float *cr = c + (pqc_i64)r * d;
    float nrm = 0.0f;
    for (int e = 0; e < d; ++e) nrm = fmaf(cr[e], cr[e], nrm);
    out[r] = nrm;
}

/* pqc_assign_codes: PQ codes of n new keys (nearest centroid per sub-space).
 *   grid (ceil(n*m / 8), n_kv), block 256; one warp per (token i, sub-space j), i = w / m.
 *   x         n key rows of x_dtype per KV head: row i at x + kv*x_head_stride + i*x_ld
 *             elements (d_h = m*d_sub used); d_sub <= 256; element e of sub-space j is
 *             dim pqc_sub_dim(j, e, d_sub, d_h, half)
 *   centroids float [m][K][d_sub] per KV head; cnorm float [m][K] per KV head
 *             (pqc_centroid_norms) or NULL to compute the norms on the fly
 *   metric    float [d_h] per KV head (+ kv*metric_head_stride, indexed by dim), or NULL:
 *             the weights w
 *             of a weighted distance. The key is multiplied by them (x_e * w_e, one
 *             rounding) before the search, and cnorm must then hold the weighted norms
 *             sum_e (w_e c_e) c_e: the order is that of sum_e w_e (x_e - c_e)^2
 *   codes     packed columns per KV head (codes + kv*code_head_stride, column j at
 *             + j*col_stride): the code of key i is OR-ed (32-bit atomicOr) into the
 *             bits of token t_start + i, which must be zero beforehand; or NULL
 *   codes_out uint8 [n][m] per KV head (+ kv*codes_out_head_stride), or NULL
 *   Distance ||c||^2 - 2 x.c (both sequential fmaf from 0), ties to the lower index. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_assign_codes(const void *x, int x_dtype, pqc_i64 x_ld, pqc_i64 x_head_stride, int n,
                 const float *__restrict__ centroids, const float *__restrict__ cnorm,
                 pqc_i64 cent_head_stride, pqc_i64 cnorm_head_stride,
                 const float *__restrict__ metric, pqc_i64 metric_head_stride,
                 int m, int b, int d_sub, int half,
                 pqc_u8 *codes, pqc_i64 code_head_stride, pqc_i64 col_stride, int t_start,
                 pqc_u8 *codes_out, pqc_i64 codes_out_head_stride)
{
    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];
    pqc_i64 kv = blockIdx.y;
    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    pqc_i64 w = (pqc_i64)blockIdx.x * PQC_WARPS + wib;
    if (w >= (pqc_i64)n * m || d_sub > PQC_MAX_DSUB) return; /* whole warp */
    int i = (int)(w / m), j = (int)(w % m);
    int K = 1 << b;
    int d_h = m * d_sub;
    const void *xr = (const char *)x + (kv * x_head_stride + (pqc_i64)i * x_ld) * pqc_dtype_size(x_dtype);
    const float *wk = metric ? metric + kv * metric_head_stride : metric;
    for (int e = lane; e < d_sub; e += 32) {
        int col = pqc_sub_dim(j, e, d_sub, d_h, half);
        float xe = pqc_load_elem(xr, col, x_dtype);
        xs[wib][e] = wk ? xe * wk[col] : xe;
    }
    __syncwarp();
    const float *cen = centroids + kv * cent_head_stride + (pqc_i64)j * K * d_sub;
    const float *cn = cnorm ? cnorm + kv * cnorm_head_stride + (pqc_i64)j * K : cnorm;
    float best;
    int code = pqc_warp_nearest(xs[wib], d_sub, cen, cn, K, &best);
    if (lane != 0) return;
    if (codes_out) codes_out[kv * codes_out_head_stride + (pqc_i64)i * m + j] = (pqc_u8)code;
    if (codes) {
        pqc_u64 bit = (pqc_u64)((pqc_i64)t_start + i) * (pqc_u64)b;
        pqc_u64 addr = (pqc_u64)(codes + kv * code_head_stride + (pqc_i64)j * col_stride) +
                       (bit >> 3);
        pqc_u32 *word = (pqc_u32 *)(addr & ~(pqc_u64)3);
        pqc_u64 v = (pqc_u64)code << ((addr & 3u) * 8u + (bit & 7u));
        atomicOr(word, (pqc_u32)v);
        if (v >> 32) atomicOr(word + 1, (pqc_u32)(v >> 32));
    }
}

/* ------------------------------------------------------------------------------------ */
/* (f) k-means on the GPU                                                               */
/* ------------------------------------------------------------------------------------ */

/* pqc_kmeans_assign: one Lloyd assignment step for n_sub independent problems.
 *   grid (ceil(n / 8), n_sub), block 256; one warp per point; d <= 256.
 *   Problem j = blockIdx.y uses the columns [j*d, j*d+d) of the points (row i at
 *   x + i*ld), centroids + j*K*d ([K][d]), cnorm + j*K (or cnorm NULL), and writes
 *   assign + j*n (int32 [n], or NULL), sums + j*K*d (float [K][d], or NULL, atomicAdd of
 *   the assigned points: the order of these additions is not fixed), counts + j*K
 *   (uint32 [K], or NULL), min_dist + j*n (float [n], or NULL: max(0, ||x||^2 + ||c||^2
 *   - 2 x.c) for the chosen centroid). Zero sums and counts before the launch.
 *   Nearest centroid as in pqc_assign_codes. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_kmeans_assign(const float *__restrict__ x, pqc_i64 ld, int n, int d,
                  const float *__restrict__ centroids, const float *__restrict__ cnorm, int K,
                  int *__restrict__ assign, float *sums, pqc_u32 *counts,
                  float *__restrict__ min_dist)
{
    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];
    pqc_i64 j = blockIdx.y;
    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    pqc_i64 i = (pqc_i64)blockIdx.x * PQC_WARPS + wib;
    if (i >= n || d > PQC_MAX_DSUB) return; /* whole warp */
    const float *xr = x + i * ld + j * d;
    for (int e = lane; e < d; e += 32) xs[wib][e] = xr[e];
    __syncwarp();
    const float *cen = centroids + j * K * d;
    const float *cn = cnorm ? cnorm + j * K : cnorm;
    float best;
    int c = pqc_warp_nearest(xs[wib], d, cen, cn, K, &best);
    if (sums) {
        float *sr = sums + (j * K + c) * d;
        for (int e = lane; e < d; e += 32) atomicAdd(&sr[e], xs[wib][e]);
    }
    if (lane != 0) return;
    if (assign) assign[j * n + i] = c;
    if (counts) atomicAdd(&counts[j * K + c], 1u);
    if (min_dist) {
        float xn = 0.0f;
        for (int e = 0; e < d; ++e) xn = fmaf(xs[wib][e], xs[wib][e], xn);
        float dd = xn + best;
        min_dist[j * n + i] = dd > 0.0f ? dd : 0.0f;
    }
}

/* pqc_kmeans_assign_dots: the assignment step of pqc_kmeans_assign for one problem from
 *   precomputed dot products (the GEMM path of the library's k-means: dots = X C^T by
 *   cuBLASLt, cnorm by pqc_centroid_norms).
 *   grid ceil(n / 8), block 256; one warp per point, the same layout as pqc_kmeans_assign.
 *   dots      float [n][K]: dots[i*K + c] = x_i . c_c
 *   x         n points of d <= 256 floats, row i at x + i*ld (for the sums and ||x||^2)
 *   cnorm     float [K], ||c||^2
 *   assign, sums, counts, min_dist as in pqc_kmeans_assign (each may be NULL).
 *   Distance ||c||^2 - 2 x.c, ties to the lower index: with dots computed as sequential
 *   fmaf from 0 the result equals pqc_kmeans_assign's bit for bit. */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_kmeans_assign_dots(const float *__restrict__ dots, const float *__restrict__ x, pqc_i64 ld,
                       int n, int d, const float *__restrict__ cnorm, int K,
                       int *__restrict__ assign, float *sums, pqc_u32 *counts,
                       float *__restrict__ min_dist)
{
    __shared__ float xs[PQC_WARPS][PQC_MAX_DSUB];
    int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    pqc_i64 i = (pqc_i64)blockIdx.x * PQC_WARPS + wib;
    if (i >= n || d > PQC_MAX_DSUB) return; /* whole warp */
    const float *xr = x + i * ld;
    for (int e = lane; e < d; e += 32) xs[wib][e] = xr[e];
    __syncwarp();
    const float *dr = dots + i * K;
    float best = __int_as_float(0x7f800000); /* +inf */
    int besti = 0x7fffffff;
    for (int c = lane; c < K; c += 32) {
        float dist = cnorm[c] - 2.0f * dr[c];
        if (besti == 0x7fffffff || dist < best) { best = dist; besti = c; }
    }
    pqc_warp_argmin(best, besti);
    int c = besti == 0x7fffffff ? 0 : besti;
    if (sums) {
        float *sr = sums + (pqc_i64)c * d;
        for (int e = lane; e < d; e += 32) atomicAdd(&sr[e], xs[wib][e]);
    }
    if (lane != 0) return;
    if (assign) assign[i] = c;
    if (counts) atomicAdd(&counts[c], 1u);
    if (min_dist) {
        float xn = 0.0f;
        for (int e = 0; e < d; ++e) xn = fmaf(xs[wib][e], xs[wib][e], xn);
        float dd = xn + best;
        min_dist[i] = dd > 0.0f ? dd : 0.0f;
    }
}

/* pqc_kmeans_update: centroid = sum / count for every cluster with count > 0 (empty
 *   clusters keep their centroid; the host may re-seed them).
 *   grid ceil(rows*d / 256), block 256; one thread per element of the [rows][d]
 *   centroid matrix (rows = n_sub*K). */
extern "C" __global__ void __launch_bounds__(PQC_BLOCK)
pqc_kmeans_update(float *__restrict__ centroids, const float *__restrict__ sums,
                  const pqc_u32 *__restrict__ counts, int rows, int d)
{
    pqc_i64 e = (pqc_i64)blockIdx.x * PQC_BLOCK + threadIdx.x;
    if (e >= (pqc_i64)rows * d) return;
    pqc_u32 cnt = counts[e / d];
    if (cnt > 0u) centroids[e] = sums[e] / (float)cnt;
}
