/* emu_device.h - runs pqcache_kernels.cu on the CPU: the CUDA execution model the
 * kernels rely on (blocks of 256 threads, __syncthreads, warp shuffles, shared memory,
 * atomics), emulated with one coroutine per thread on a single OS thread. Included before
 * the kernel source (see libcuda_emu.cpp); only as much CUDA as the kernels use.
 *
 * Threads of a block run until they reach a barrier (or a shuffle, which is two warp
 * barriers); the scheduler then resumes the next one. A thread that returns leaves every
 * later barrier, as on the hardware. Static __shared__ arrays become function statics,
 * which is exact because one block runs at a time.
 *
 * The coroutines live as long as the process: each runs the kernel body of every block in
 * turn. On x86-64 they switch with a few instructions (the callee-saved registers and the
 * stack pointer: the kernels change neither the floating-point control word nor the
 * signal mask); elsewhere, or with PQC_EMU_UCONTEXT defined, through swapcontext, which
 * also saves the signal mask with a system call at every switch.
 */
#ifndef PQC_EMU_DEVICE_H
#define PQC_EMU_DEVICE_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };

namespace emu {

struct dim3u { unsigned x, y, z; };

enum { THREADS = 256, WARPS = 8, STACK = 128 * 1024 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(PQC_EMU_UCONTEXT)
#define PQC_EMU_FAST_SWITCH 1
/* a coroutine's saved stack pointer (its callee-saved registers lie on its stack) */
struct Context { void *sp; };
#else
struct Context { ucontext_t uc; };
#endif

struct Thread {
    Context ctx;
    char *stack;
    int done;
    int started;
};

struct Block {
    Thread thr[THREADS];
    Context sched;
    int cur;
    int active, arrived;
    unsigned gen;
    int w_active[WARPS], w_arrived[WARPS];
    unsigned w_gen[WARPS];
    unsigned char xchg[WARPS][32][8];
    void (*body)(void *);
    void *arg;
};

extern Block blk;
extern volatile dim3u cur_thread;
extern dim3u cur_block, cur_grid, cur_dim;

/* saves the running context in from and resumes to */
#ifdef PQC_EMU_FAST_SWITCH
extern "C" void pqc_emu_switch(void **from_sp, void *to_sp);
inline void switch_to(Context *from, Context *to) { pqc_emu_switch(&from->sp, to->sp); }
#else
inline void switch_to(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }
#endif

inline void yield_now() { switch_to(&blk.thr[blk.cur].ctx, &blk.sched); }

inline void sync_block()
{
    unsigned g = blk.gen;
    if (++blk.arrived == blk.active) {
        blk.arrived = 0;
        blk.gen++;
        return;
    }
    while (blk.gen == g) yield_now();
}

inline void sync_warp()
{
    int w = blk.cur >> 5;
    unsigned g = blk.w_gen[w];
    if (++blk.w_arrived[w] == blk.w_active[w]) {
        blk.w_arrived[w] = 0;
        blk.w_gen[w]++;
        return;
    }
    while (blk.w_gen[w] == g) yield_now();
}

template <class T> inline T shfl_from(T v, int src_lane, int use)
{
    int w = blk.cur >> 5, lane = blk.cur & 31;
    T out = v;
    memcpy(blk.xchg[w][lane], &v, sizeof(T));
    sync_warp();
    if (use) memcpy(&out, blk.xchg[w][src_lane & 31], sizeof(T));
    sync_warp();
    return out;
}

} // namespace emu

#define threadIdx emu::cur_thread
#define blockIdx emu::cur_block
#define gridDim emu::cur_grid
#define blockDim emu::cur_dim

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; emu::sync_warp(); }
inline void __threadfence() {}

template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int o)
{
    (void)mask;
    return emu::shfl_from(v, (emu::blk.cur & 31) ^ o, 1);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d)
{
    (void)mask;
    int lane = emu::blk.cur & 31;
    return emu::shfl_from(v, lane - (int)d, lane >= (int)d);
}

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }

/* rounded float operations (never fused: the emulator's compile contracts nothing) */
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

/* one OS thread runs every coroutine, so plain read-modify-write is atomic */
inline unsigned atomicAdd(unsigned *p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline int atomicAdd(int *p, int v) { int o = *p; *p = o + v; return o; }
inline float atomicAdd(float *p, float v) { float o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    unsigned long long o = *p;
    *p = o + v;
    return o;
}
inline unsigned atomicOr(unsigned *p, unsigned v) { unsigned o = *p; *p = o | v; return o; }

/* dynamic shared memory of the scan kernels */
extern float pqc_smem_lut[];
#define PQC_EMU_SMEM_BYTES (1u << 20)

#endif
