/* libcuda_emu.cpp - a CPU stand-in for the CUDA driver (libcuda.so.1) that runs the
 * kernels of pqcache_kernels.cu, so that pqcache's CUDA device tier can be tested end to
 * end on machines without a GPU: pqcache.h opens it through PQC_CUDA_DRIVER_PATH.
 *
 * What it models:
 *   - device memory and mapped pinned host memory are host allocations; every pointer a
 *     kernel or a copy receives is checked against them (a host pointer where a device
 *     pointer belongs is an error, not a silent success);
 *   - streams are queues executed lazily, in order, when something waits for them
 *     (stream or event synchronisation, a wait on an event, a blocking copy, a free), so
 *     a host that reads results before synchronising sees stale data, as on a GPU;
 *     events order work across streams;
 *   - async copies from pinned memory read their source when they execute; copies from
 *     pageable memory take a snapshot at the call, as the driver stages them; copies to
 *     pageable memory wait for the stream;
 *   - kernels run through emu_device.h, their parameters captured at launch.
 * NVRTC stays the real one: the module image it produced is accepted and ignored.
 *
 * It also stands in for cuBLASLt (libcublasLt.so; pqcache.h opens it through
 * PQC_CUBLASLT_PATH): the cublasLt* calls the library makes, with fp32 matmuls
 * D = alpha op(A) op(B) + beta C over column-major layouts (rows, cols, ld) that run on
 * the emulated streams like kernels, their pointers checked the same way. Each dot
 * product is a sequential fmaf over the inner dimension in ascending order from 0, the
 * order of the kernels' own dot products, so a GEMM here gives the kernels' bits.
 *
 * Build (see the Makefile): the kernel source is included with its one `extern
 * __shared__` declaration removed (the emulator provides that array).
 */
#include "emu_device.h"

#include <stdio.h>
#include <stdlib.h>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_kernels.inc"

namespace emu {
Block blk;
volatile dim3u cur_thread;
dim3u cur_block, cur_grid, cur_dim;
} // namespace emu
float pqc_smem_lut[PQC_EMU_SMEM_BYTES / sizeof(float)];

namespace {

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, ERR_INVALID_VALUE = 1, ERR_OOM = 2, ERR_NOT_FOUND = 500, ERR_INVALID_HANDLE = 400,
       ERR_LAUNCH = 719 };

int g_verbose = -1;
bool verbose()
{
    if (g_verbose < 0) g_verbose = getenv("PQC_EMU_VERBOSE") != nullptr;
    return g_verbose != 0;
}

/* ----- memory regions ----- */
struct Region { size_t size; bool device, pinned; };
std::map<uintptr_t, Region> g_regions;
size_t g_device_bytes;

const Region *find_region(uintptr_t p, size_t n, uintptr_t *base)
{
    auto it = g_regions.upper_bound(p);
    if (it == g_regions.begin()) return nullptr;
    --it;
    if (p < it->first || p + n > it->first + it->second.size) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

CUresult complain(const char *what, uintptr_t p, size_t n)
{
    fprintf(stderr, "cuda-emu: %s: %#llx (+%zu bytes) is not inside an allocation of the right kind\n", what,
            (unsigned long long)p, n);
    return ERR_INVALID_VALUE;
}

bool is_device(uintptr_t p, size_t n) /* device memory, or mapped pinned host memory */
{
    const Region *r = find_region(p, n, nullptr);
    return r && (r->device || r->pinned);
}
bool is_pinned(const void *p, size_t n)
{
    const Region *r = find_region((uintptr_t)p, n, nullptr);
    return r && r->pinned;
}

/* ----- streams and events ----- */
struct Op { uint64_t seq; std::function<void()> fn; };
struct Stream { std::deque<Op> q; uint64_t next = 1, done = 0, id = 0; };
/* an event names its stream by id: a stream destroyed after the record (drained
   then) leaves the event complete, as on a GPU */
struct Event { uint64_t sid = 0; uint64_t seq = 0; };

Stream g_default;
std::map<uint64_t, Stream *> g_live; /* the created streams by id, in creation order (the default: 1) */
uint64_t g_next_sid = 2;

Stream *S(void *h) { return h ? (Stream *)h : &g_default; }
uint64_t sid_of(Stream *s) { return s == &g_default ? 1 : s->id; }
Stream *live(uint64_t sid)
{
    if (sid == 1) return &g_default;
    std::map<uint64_t, Stream *>::iterator it = g_live.find(sid);
    return it == g_live.end() ? nullptr : it->second;
}

void run_until(Stream *s, uint64_t seq)
{
    while (!s->q.empty() && s->q.front().seq <= seq) {
        Op op = std::move(s->q.front());
        s->q.pop_front();
        op.fn();
        s->done = op.seq;
    }
}
void run_all(Stream *s) { run_until(s, ~0ull); }
void run_everything()
{
    run_all(&g_default);
    for (auto &it : g_live) run_all(it.second);
}
void enqueue(Stream *s, std::function<void()> fn)
{
    Op op;
    op.seq = s->next++;
    op.fn = std::move(fn);
    s->q.push_back(std::move(op));
}

/* ----- kernels ----- */
#ifdef PQC_EMU_FAST_SWITCH
/* pqc_emu_switch(from, to): pushes the callee-saved registers, stores the stack pointer
   in *from, loads to and pops the registers saved there; the ret resumes that context */
__asm__(".text\n"
        ".globl pqc_emu_switch\n"
        ".hidden pqc_emu_switch\n"
        ".type pqc_emu_switch, @function\n"
        "pqc_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size pqc_emu_switch, .-pqc_emu_switch\n");
#endif

/* The life of coroutine i: run the block's body as thread blk.cur, leave the barriers,
   hand control back; resumed for the next block, run it again. */
void thread_loop()
{
    for (;;) {
        emu::blk.body(emu::blk.arg);
        emu::Thread &t = emu::blk.thr[emu::blk.cur];
        t.done = 1;
        int w = emu::blk.cur >> 5;
        emu::blk.active--;
        emu::blk.w_active[w]--;
        if (emu::blk.arrived > 0 && emu::blk.arrived == emu::blk.active) {
            emu::blk.arrived = 0;
            emu::blk.gen++;
        }
        if (emu::blk.w_arrived[w] > 0 && emu::blk.w_arrived[w] == emu::blk.w_active[w]) {
            emu::blk.w_arrived[w] = 0;
            emu::blk.w_gen[w]++;
        }
        emu::switch_to(&t.ctx, &emu::blk.sched);
    }
}

/* A new coroutine's first resume enters thread_loop on its own stack. */
void thread_start(emu::Thread &t)
{
    t.stack = (char *)malloc(emu::STACK);
    if (!t.stack) {
        fprintf(stderr, "cuda-emu: out of memory for a thread's stack\n");
        abort();
    }
#ifdef PQC_EMU_FAST_SWITCH
    /* the frame pqc_emu_switch pops: six registers, then the return address; the stack
       pointer after that ret is 8 below a 16-byte boundary, as after a call */
    uintptr_t top = ((uintptr_t)t.stack + emu::STACK) & ~(uintptr_t)15;
    void **sp = (void **)(top - 8 * sizeof(void *));
    void (*entry)() = thread_loop;
    for (int r = 0; r < 6; r++) sp[r] = nullptr;
    memcpy(&sp[6], &entry, sizeof entry);
    sp[7] = nullptr; /* thread_loop never returns */
    t.ctx.sp = sp;
#else
    getcontext(&t.ctx.uc);
    t.ctx.uc.uc_stack.ss_sp = t.stack;
    t.ctx.uc.uc_stack.ss_size = emu::STACK;
    t.ctx.uc.uc_link = nullptr;
    makecontext(&t.ctx.uc, thread_loop, 0);
#endif
    t.started = 1;
}

void run_block(void (*body)(void *), void *arg)
{
    emu::Block &b = emu::blk;
    b.body = body;
    b.arg = arg;
    b.active = emu::THREADS;
    b.arrived = 0;
    for (int w = 0; w < emu::WARPS; w++) {
        b.w_active[w] = 32;
        b.w_arrived[w] = 0;
    }
    for (int i = 0; i < emu::THREADS; i++) {
        emu::Thread &t = b.thr[i];
        if (!t.started) thread_start(t);
        t.done = 0;
    }
    int remaining = emu::THREADS;
    while (remaining > 0)
        for (int i = 0; i < emu::THREADS; i++) {
            if (b.thr[i].done) continue;
            b.cur = i;
            emu::cur_thread.x = (unsigned)i;
            emu::cur_thread.y = emu::cur_thread.z = 0;
            emu::switch_to(&b.sched, &b.thr[i].ctx);
            if (b.thr[i].done) remaining--;
        }
}

struct Launch { unsigned gx, gy, smem; };

template <class T> bool check_arg(const T &, const char *) { return true; }
template <class T> bool check_arg(T *const &p, const char *kernel)
{
    if (p == nullptr) return true;
    if (is_device((uintptr_t)p, 1)) return true;
    complain(kernel, (uintptr_t)p, 1);
    return false;
}

struct Kernel {
    std::function<CUresult(void **, const Launch &, Stream *)> launch;
    unsigned static_smem = 0;   /* static __shared__ bytes (where dynamic memory is used too) */
    unsigned max_dynamic = 49152; /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
};
const unsigned SMEM_OPTIN = 232448; /* cuDeviceGetAttribute 97 below */

template <class... A, size_t... I>
CUresult launch_impl(const char *name, void (*f)(A...), void **p, const Launch &L, Stream *s,
                     std::index_sequence<I...>)
{
    typedef std::tuple<typename std::decay<A>::type...> Args;
    Args args(*static_cast<typename std::decay<A>::type *>(p[I])...);
    bool ok = true;
    (void)std::initializer_list<int>{ (ok = check_arg(std::get<I>(args), name) && ok, 0)... };
    if (!ok) return ERR_INVALID_VALUE;
    if (L.smem > PQC_EMU_SMEM_BYTES) {
        fprintf(stderr, "cuda-emu: %s: %u bytes of dynamic shared memory\n", name, L.smem);
        return ERR_INVALID_VALUE;
    }
    enqueue(s, [f, args, L, name]() {
        struct Ctx { void (*f)(A...); const Args *a; } ctx = { f, &args };
        emu::cur_grid.x = L.gx;
        emu::cur_grid.y = L.gy;
        emu::cur_grid.z = 1;
        emu::cur_dim.x = 256;
        emu::cur_dim.y = emu::cur_dim.z = 1;
        if (verbose()) fprintf(stderr, "cuda-emu: %s grid (%u, %u)\n", name, L.gx, L.gy);
        for (unsigned y = 0; y < L.gy; y++)
            for (unsigned x = 0; x < L.gx; x++) {
                emu::cur_block.x = x;
                emu::cur_block.y = y;
                emu::cur_block.z = 0;
                run_block([](void *c) {
                    Ctx *k = (Ctx *)c;
                    k->f(std::get<I>(*k->a)...);
                }, &ctx);
            }
    });
    return OK;
}

template <class... A> Kernel make_kernel(const char *name, void (*f)(A...))
{
    Kernel k;
    k.launch = [name, f](void **p, const Launch &L, Stream *s) {
        return launch_impl(name, f, p, L, s, std::index_sequence_for<A...>{});
    };
    return k;
}

std::map<std::string, Kernel> &kernels()
{
    static std::map<std::string, Kernel> k;
    if (k.empty()) {
#define K(n) k[#n] = make_kernel(#n, &n)
        K(pqc_lut_build);
        K(pqc_scan_stats);
        K(pqc_softmax_finalize);
        K(pqc_scan);
        K(pqc_topk_pass);
        K(pqc_topk_count);
        K(pqc_topk_compact);
        K(pqc_gather_kv);
        K(pqc_cache_fill);
        K(pqc_select_admit);
        K(pqc_centroid_norms);
        K(pqc_assign_codes);
        K(pqc_kmeans_assign);
        K(pqc_kmeans_update);
        K(pqc_kmeans_assign_dots);
        K(pqc_lut_sum);
        K(pqc_rerank_dots);
        K(pqc_rerank_combine);
        K(pqc_take_at);
        K(pqc_rerank_merge);
        K(pqc_rival_cands);
        K(pqc_rival_stats);
        K(pqc_rival_scores);
        K(pqc_rerank_append);
#undef K
        k["pqc_scan_stats"].static_smem = 2 * 256 * 4; /* red_m, red_s */
    }
    return k;
}

void *aligned(size_t n)
{
    void *p = nullptr;
    if (posix_memalign(&p, 256, n ? (n + 255) / 256 * 256 : 256) != 0) return nullptr;
    return p;
}

int g_module_tag, g_ctx_tag;
/* one lock for the whole driver: pqcache calls it from its pool threads too (k-means) */
std::recursive_mutex g_mu;
#define EMU_LOCK std::lock_guard<std::recursive_mutex> emu_lock_(g_mu)
/* the context current on the calling thread: calls that need one fail without it, as
   on a GPU (each thread must make the context current itself) */
thread_local void *t_ctx;
#define NEED_CTX                                                                         \
    do {                                                                                 \
        if (!t_ctx) {                                                                    \
            fprintf(stderr, "cuda-emu: %s without a current context\n", __func__);       \
            return 201; /* CUDA_ERROR_INVALID_CONTEXT */                                 \
        }                                                                                \
    } while (0)
long g_fail_alloc = -1; /* device allocations left before one fails; -1: never */
/* what the host did to the device, for tests: [0] waits (stream, event and context
   synchronisations, and copies that return only when done: synchronous ones, device to
   pageable host memory), [1] bytes host -> device and [2] device -> host by copies, [3]
   host -> device copies */
unsigned long long g_count[4];

} // namespace

extern "C" {

CUresult cuInit(unsigned) { return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal != 0) return ERR_INVALID_VALUE; *d = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, int)
{
    EMU_LOCK;
    snprintf(name, (size_t)len, "pqcache CPU emulator");
    return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int)
{
    EMU_LOCK;
    switch (attr) {
    case 16: *v = 2; break;       /* SMs: few, so that grids stay small */
    case 19: *v = 1; break;       /* can map host memory */
    case 75: *v = 9; break;       /* compute capability 9.0 */
    case 76: *v = 0; break;
    case 97: *v = (int)SMEM_OPTIN; break; /* opt-in shared memory per block */
    default: *v = 0; break;
    }
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int) { *b = (size_t)16 << 30; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int) { *ctx = &g_ctx_tag; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuCtxSetCurrent(void *ctx)
{
    t_ctx = ctx;
    return OK;
}
CUresult cuCtxSynchronize(void) { EMU_LOCK; NEED_CTX; g_count[0]++; run_everything(); return OK; }
CUresult cuModuleLoadData(void **mod, const void *image)
{
    EMU_LOCK;
    NEED_CTX;
    if (!image) return ERR_INVALID_VALUE;
    *mod = &g_module_tag;
    return OK;
}
CUresult cuModuleUnload(void *) { return OK; }
CUresult cuModuleGetFunction(void **fn, void *, const char *name)
{
    EMU_LOCK;
    NEED_CTX;
    auto it = kernels().find(name);
    if (it == kernels().end()) return ERR_NOT_FOUND;
    *fn = &it->second;
    return OK;
}
CUresult cuFuncSetAttribute(void *fn, int attr, int value)
{
    EMU_LOCK;
    Kernel *k = (Kernel *)fn;
    if (!k) return ERR_INVALID_HANDLE;
    if (attr == 8) { /* max dynamic shared memory: with the static part, within the opt-in */
        if (value < 0 || (unsigned)value + k->static_smem > SMEM_OPTIN) {
            fprintf(stderr, "cuda-emu: cuFuncSetAttribute: %d bytes of dynamic shared memory + %u static exceed %u\n",
                    value, k->static_smem, SMEM_OPTIN);
            return ERR_INVALID_VALUE;
        }
        k->max_dynamic = (unsigned)value;
    }
    return OK;
}
CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra)
{
    EMU_LOCK;
    NEED_CTX;
    if (!fn || extra || gz != 1 || bx != 256 || by != 1 || bz != 1) return ERR_INVALID_VALUE;
    if (gx == 0 || gy == 0 || gy > 65535 || gx > 0x7fffffffu) return ERR_INVALID_VALUE; /* the hardware's grid limits */
    Launch L = { gx, gy, smem };
    if (smem > ((Kernel *)fn)->max_dynamic) {
        fprintf(stderr, "cuda-emu: launch with %u bytes of dynamic shared memory, the kernel allows %u\n", smem,
                ((Kernel *)fn)->max_dynamic);
        return ERR_INVALID_VALUE;
    }
    return ((Kernel *)fn)->launch(params, L, S(stream));
}
/* Test control (not part of the driver API): the device allocation after the next n
   succeeds fails with CUDA_ERROR_OUT_OF_MEMORY; n < 0 turns the failure off. */
void pqc_emu_fail_alloc_after(long n) { g_fail_alloc = n; }
/* Test control: the counters above (4 values), then zeroes them when reset. */
void pqc_emu_counters(unsigned long long *out, int reset)
{
    EMU_LOCK;
    for (int i = 0; i < 4; i++) out[i] = g_count[i];
    if (reset)
        for (int i = 0; i < 4; i++) g_count[i] = 0;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    EMU_LOCK;
    NEED_CTX;
    void *m;
    if (g_fail_alloc >= 0 && g_fail_alloc-- == 0) return ERR_OOM;
    m = aligned(n);
    if (!m) return ERR_OOM;
    memset(m, 0xA5, n); /* device memory starts as garbage */
    g_regions[(uintptr_t)m] = Region{ n, true, false };
    g_device_bytes += n;
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p)
{
    EMU_LOCK;
    NEED_CTX;
    run_everything();
    auto it = g_regions.find((uintptr_t)p);
    if (it == g_regions.end() || !it->second.device) return complain("cuMemFree", (uintptr_t)p, 0);
    g_device_bytes -= it->second.size;
    g_regions.erase(it);
    free((void *)(uintptr_t)p);
    return OK;
}
CUresult cuMemGetInfo_v2(size_t *fr, size_t *total)
{
    EMU_LOCK;
    NEED_CTX;
    *total = (size_t)16 << 30;
    *fr = *total - g_device_bytes;
    return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    void *m = aligned(n);
    if (!m) return ERR_OOM;
    g_regions[(uintptr_t)m] = Region{ n, false, true };
    *p = m;
    return OK;
}
CUresult cuMemFreeHost(void *p)
{
    EMU_LOCK;
    NEED_CTX;
    run_everything();
    auto it = g_regions.find((uintptr_t)p);
    if (it == g_regions.end() || !it->second.pinned) return complain("cuMemFreeHost", (uintptr_t)p, 0);
    g_regions.erase(it);
    free(p);
    return OK;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    if (!is_pinned(p, 1)) return complain("cuMemHostGetDevicePointer", (uintptr_t)p, 1);
    *d = (CUdeviceptr)(uintptr_t)p;
    return OK;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    g_regions[(uintptr_t)p] = Region{ n, false, true };
    return OK;
}
CUresult cuMemHostUnregister(void *p)
{
    EMU_LOCK;
    NEED_CTX;
    run_everything();
    g_regions.erase((uintptr_t)p);
    return OK;
}

static CUresult copy_in(CUdeviceptr dst, const void *src, size_t n, Stream *s)
{
    if (!is_device((uintptr_t)dst, n)) return complain("copy to device", (uintptr_t)dst, n);
    g_count[1] += n;
    g_count[3]++;
    if (is_pinned(src, n)) { /* read when it runs */
        enqueue(s, [dst, src, n]() { memcpy((void *)(uintptr_t)dst, src, n); });
    } else { /* staged now */
        std::shared_ptr<std::vector<unsigned char>> snap(
            new std::vector<unsigned char>((const unsigned char *)src, (const unsigned char *)src + n));
        enqueue(s, [dst, snap, n]() { memcpy((void *)(uintptr_t)dst, snap->data(), n); });
    }
    return OK;
}
static CUresult copy_out(void *dst, CUdeviceptr src, size_t n, Stream *s)
{
    if (!is_device((uintptr_t)src, n)) return complain("copy from device", (uintptr_t)src, n);
    g_count[2] += n;
    enqueue(s, [dst, src, n]() { memcpy(dst, (const void *)(uintptr_t)src, n); });
    if (!is_pinned(dst, n)) { /* pageable destination: the call waits */
        g_count[0]++;
        run_all(s);
    }
    return OK;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    EMU_LOCK;
    NEED_CTX;
    g_count[0]++;
    run_everything();
    CUresult r = copy_in(dst, src, n, &g_default);
    run_all(&g_default);
    return r;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    EMU_LOCK;
    NEED_CTX;
    if (is_pinned(dst, n)) g_count[0]++; /* else copy_out counts it */
    run_everything();
    CUresult r = copy_out(dst, src, n, &g_default);
    run_all(&g_default);
    return r;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) { EMU_LOCK; NEED_CTX; return copy_in(dst, src, n, S(s)); }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) { EMU_LOCK; NEED_CTX; return copy_out(dst, src, n, S(s)); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s)
{
    EMU_LOCK;
    NEED_CTX;
    if (!is_device((uintptr_t)dst, n) || !is_device((uintptr_t)src, n)) return complain("copy on device", (uintptr_t)dst, n);
    enqueue(S(s), [dst, src, n]() { memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n); });
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *s)
{
    EMU_LOCK;
    NEED_CTX;
    if (!is_device((uintptr_t)dst, n)) return complain("cuMemsetD8Async", (uintptr_t)dst, n);
    enqueue(S(s), [dst, v, n]() { memset((void *)(uintptr_t)dst, v, n); });
    return OK;
}
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void *s)
{
    EMU_LOCK;
    NEED_CTX;
    if (!is_device((uintptr_t)dst, n * 4)) return complain("cuMemsetD32Async", (uintptr_t)dst, n * 4);
    enqueue(S(s), [dst, v, n]() {
        unsigned *p = (unsigned *)(uintptr_t)dst;
        for (size_t i = 0; i < n; i++) p[i] = v;
    });
    return OK;
}
CUresult cuStreamCreate(void **s, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    Stream *x = new Stream();
    x->id = g_next_sid++;
    g_live[x->id] = x;
    *s = x;
    return OK;
}
CUresult cuStreamDestroy_v2(void *s)
{
    EMU_LOCK;
    NEED_CTX;
    Stream *x = (Stream *)s;
    run_all(x);
    for (auto it = g_live.begin(); it != g_live.end(); ++it)
        if (it->second == x) {
            g_live.erase(it);
            delete x;
            return OK;
        }
    return ERR_INVALID_HANDLE;
}
CUresult cuStreamSynchronize(void *s) { EMU_LOCK; NEED_CTX; g_count[0]++; run_all(S(s)); return OK; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    Event ev = *(Event *)e; /* the event as recorded now */
    if (!ev.sid) return OK;
    enqueue(S(s), [ev]() {
        Stream *x = live(ev.sid);
        if (x) run_until(x, ev.seq);
    });
    return OK;
}
CUresult cuEventCreate(void **e, unsigned)
{
    EMU_LOCK;
    NEED_CTX;
    *e = new Event();
    return OK;
}
CUresult cuEventDestroy_v2(void *e)
{
    EMU_LOCK;
    delete (Event *)e;
    return OK;
}
CUresult cuEventRecord(void *e, void *s)
{
    EMU_LOCK;
    NEED_CTX;
    Stream *x = S(s);
    Event *ev = (Event *)e;
    ev->sid = sid_of(x);
    ev->seq = x->next; /* completes with the next operation queued: a marker */
    enqueue(x, []() {});
    return OK;
}
CUresult cuEventSynchronize(void *e)
{
    EMU_LOCK;
    NEED_CTX;
    Event *ev = (Event *)e;
    g_count[0]++;
    Stream *x = live(ev->sid);
    if (x) run_until(x, ev->seq);
    return OK;
}
CUresult cuEventQuery(void *e)
{
    EMU_LOCK;
    NEED_CTX;
    Event *ev = (Event *)e;
    Stream *x = live(ev->sid);
    if (x && x->done < ev->seq) {
        /* a stream's queue runs when waited for: what is queued has not run yet */
        return 600; /* CUDA_ERROR_NOT_READY */
    }
    return OK;
}
CUresult cuEventElapsedTime_v2(float *ms, void *, void *) { *ms = 0.0f; return OK; }
CUresult cuGetErrorString(CUresult r, const char **s)
{
    EMU_LOCK;
    *s = r == OK ? "no error" : r == ERR_INVALID_VALUE ? "invalid argument (emulator)" : "error (emulator)";
    return OK;
}
CUresult cuGetErrorName(CUresult r, const char **s)
{
    EMU_LOCK;
    *s = r == OK ? "CUDA_SUCCESS" : r == ERR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" :
         r == ERR_OOM ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN";
    return OK;
}

} // extern "C"

/* ----- cuBLASLt stand-in ----- */
namespace {
typedef int cublasStatus;
enum { LT_OK = 0, LT_NOT_INITIALIZED = 1, LT_INVALID_VALUE = 7, LT_EXECUTION_FAILED = 13, LT_NOT_SUPPORTED = 15 };
struct LtHandle { int tag; };
struct LtDesc { int compute, scale, transa, transb; };
struct LtLayout { int type; uint64_t rows, cols; int64_t ld; int32_t batch; int64_t bstride; uint32_t mode; };
struct LtPref { uint64_t max_ws; };
struct LtAlgo { uint64_t data[8]; };
struct LtHeur { LtAlgo algo; size_t ws; int state; float waves; int reserved[4]; };
const uint64_t ALGO_TAG = 0x70716361636865ull; /* what the heuristic hands out */
long g_lt_fail = -1; /* matmuls left before one fails; -1: never */

bool lt_shape(const LtLayout *l) { return l && l->type == 0 && l->ld >= 1 && (uint64_t)l->ld >= l->rows; }
size_t lt_bytes(const LtLayout *l) /* extent of a column-major matrix, in bytes */
{
    return l->cols == 0 ? 0 : (size_t)(((l->cols - 1) * (uint64_t)l->ld + l->rows) * 4);
}
} // namespace

extern "C" {

/* Test control (not part of cuBLASLt): the matmul after the next n succeeds fails with
   CUBLAS_STATUS_EXECUTION_FAILED; n < 0 turns the failure off. */
void pqc_emu_blaslt_fail_after(long n) { EMU_LOCK; g_lt_fail = n; }

size_t cublasLtGetVersion(void) { return 130000; }
cublasStatus cublasLtCreate(LtHandle **h)
{
    if (!h) return LT_INVALID_VALUE;
    *h = new LtHandle();
    return LT_OK;
}
cublasStatus cublasLtDestroy(LtHandle *h)
{
    if (!h) return LT_NOT_INITIALIZED;
    delete h;
    return LT_OK;
}
cublasStatus cublasLtMatmulDescCreate(LtDesc **d, int compute, int scale)
{
    if (!d) return LT_INVALID_VALUE;
    if ((compute != 68 && compute != 69) || scale != 0) return LT_NOT_SUPPORTED; /* fp32 only */
    *d = new LtDesc{ compute, scale, 0, 0 };
    return LT_OK;
}
cublasStatus cublasLtMatmulDescDestroy(LtDesc *d) { delete d; return LT_OK; }
cublasStatus cublasLtMatmulDescSetAttribute(LtDesc *d, int attr, const void *buf, size_t n)
{
    int v;
    if (!d || !buf || n != sizeof(int)) return LT_INVALID_VALUE;
    memcpy(&v, buf, sizeof v);
    if (v != 0 && v != 1) return LT_INVALID_VALUE;
    if (attr == 3) d->transa = v;
    else if (attr == 4) d->transb = v;
    else return LT_NOT_SUPPORTED;
    return LT_OK;
}
cublasStatus cublasLtMatrixLayoutCreate(LtLayout **l, int type, uint64_t rows, uint64_t cols, int64_t ld)
{
    if (!l) return LT_INVALID_VALUE;
    if (type != 0) return LT_NOT_SUPPORTED;
    if (ld < 1 || (uint64_t)ld < rows) return LT_INVALID_VALUE;
    *l = new LtLayout{ type, rows, cols, ld, 1, 0, 0 };
    return LT_OK;
}
cublasStatus cublasLtMatrixLayoutDestroy(LtLayout *l) { delete l; return LT_OK; }
/* batch count (5, int32), strided batch offset (6, int64), batch mode (8, uint32: 0
   strided, 1 arrays of pointers) */
cublasStatus cublasLtMatrixLayoutSetAttribute(LtLayout *l, int attr, const void *buf, size_t n)
{
    if (!l || !buf) return LT_INVALID_VALUE;
    if (attr == 5 && n == sizeof(int32_t)) {
        int32_t v;
        memcpy(&v, buf, n);
        if (v < 1) return LT_INVALID_VALUE;
        l->batch = v;
    } else if (attr == 6 && n == sizeof(int64_t)) {
        memcpy(&l->bstride, buf, n);
    } else if (attr == 8 && n == sizeof(uint32_t)) {
        uint32_t v;
        memcpy(&v, buf, n);
        if (v > 1) return LT_INVALID_VALUE;
        l->mode = v;
    } else {
        return LT_NOT_SUPPORTED;
    }
    return LT_OK;
}
cublasStatus cublasLtMatmulPreferenceCreate(LtPref **p)
{
    if (!p) return LT_INVALID_VALUE;
    *p = new LtPref{ 0 };
    return LT_OK;
}
cublasStatus cublasLtMatmulPreferenceDestroy(LtPref *p) { delete p; return LT_OK; }
cublasStatus cublasLtMatmulPreferenceSetAttribute(LtPref *p, int attr, const void *buf, size_t n)
{
    if (!p || !buf) return LT_INVALID_VALUE;
    if (attr != 1 || n != sizeof(uint64_t)) return LT_NOT_SUPPORTED;
    memcpy(&p->max_ws, buf, sizeof p->max_ws);
    return LT_OK;
}

/* op(A) is m x k, op(B) k x n, C and D m x n */
static bool lt_dims(const LtDesc *d, const LtLayout *a, const LtLayout *b, const LtLayout *c,
                    const LtLayout *dd, uint64_t *m, uint64_t *n, uint64_t *k)
{
    uint64_t am, ak, bk, bn;
    if (!d || !lt_shape(a) || !lt_shape(b) || !lt_shape(c) || !lt_shape(dd)) return false;
    am = d->transa ? a->cols : a->rows;
    ak = d->transa ? a->rows : a->cols;
    bk = d->transb ? b->cols : b->rows;
    bn = d->transb ? b->rows : b->cols;
    if (ak != bk || c->rows != am || c->cols != bn || dd->rows != am || dd->cols != bn) return false;
    if (a->batch != b->batch || a->batch != c->batch || a->batch != dd->batch) return false;
    if (a->mode != b->mode || a->mode != c->mode || a->mode != dd->mode) return false;
    *m = am;
    *n = bn;
    *k = ak;
    return true;
}

cublasStatus cublasLtMatmulAlgoGetHeuristic(LtHandle *h, LtDesc *d, LtLayout *a, LtLayout *b, LtLayout *c,
                                            LtLayout *dd, LtPref *p, int requested, LtHeur *res, int *returned)
{
    uint64_t m, n, k;
    if (!h || !p || !res || !returned || requested < 1) return LT_INVALID_VALUE;
    if (!lt_dims(d, a, b, c, dd, &m, &n, &k)) return LT_INVALID_VALUE;
    memset(res, 0, sizeof *res);
    res->algo.data[0] = ALGO_TAG;
    res->waves = 1.0f;
    *returned = 1;
    return LT_OK;
}

cublasStatus cublasLtMatmul(LtHandle *h, LtDesc *d, const void *alpha, const void *A, LtLayout *la,
                            const void *B, LtLayout *lb, const void *beta, const void *C, LtLayout *lc, void *D,
                            LtLayout *ld, const LtAlgo *algo, void *ws, size_t ws_bytes, void *stream)
{
    EMU_LOCK;
    uint64_t m, n, k;
    float al, be;
    if (!t_ctx) {
        fprintf(stderr, "cuda-emu: cublasLtMatmul without a current context\n");
        return LT_EXECUTION_FAILED;
    }
    if (!h) return LT_NOT_INITIALIZED;
    if (!alpha || !beta || !A || !B || !D || !algo || algo->data[0] != ALGO_TAG) return LT_INVALID_VALUE;
    if (!lt_dims(d, la, lb, lc, ld, &m, &n, &k)) return LT_INVALID_VALUE;
    if (ws_bytes && !is_device((uintptr_t)ws, ws_bytes)) { complain("cublasLtMatmul workspace", (uintptr_t)ws, ws_bytes); return LT_INVALID_VALUE; }
    memcpy(&al, alpha, 4); /* host pointer mode, the default */
    memcpy(&be, beta, 4);
    /* the extent each argument must have: a matrix per instance (strided), or an array
       of pointers (pointer-array mode, each matrix checked when the matmul runs) */
    int32_t nb = la->batch;
    bool arrays = la->mode == 1;
    auto extent = [&](const LtLayout *l) {
        return arrays ? (size_t)nb * sizeof(uint64_t) : lt_bytes(l) + (size_t)(nb - 1) * (size_t)l->bstride * 4;
    };
    if (!arrays && nb > 1 && (la->bstride < 0 || lb->bstride < 0 || ld->bstride < 0 || lc->bstride < 0)) return LT_INVALID_VALUE;
    if (!is_device((uintptr_t)A, extent(la))) { complain("cublasLtMatmul A", (uintptr_t)A, extent(la)); return LT_INVALID_VALUE; }
    if (!is_device((uintptr_t)B, extent(lb))) { complain("cublasLtMatmul B", (uintptr_t)B, extent(lb)); return LT_INVALID_VALUE; }
    if (!is_device((uintptr_t)D, extent(ld))) { complain("cublasLtMatmul D", (uintptr_t)D, extent(ld)); return LT_INVALID_VALUE; }
    if (be != 0.0f && (!C || !is_device((uintptr_t)C, extent(lc)))) { complain("cublasLtMatmul C", (uintptr_t)C, extent(lc)); return LT_INVALID_VALUE; }
    if (g_lt_fail >= 0 && g_lt_fail-- == 0) return LT_EXECUTION_FAILED;
    LtDesc dc = *d;
    LtLayout a = *la, b = *lb, c = *lc, o = *ld;
    if (verbose()) fprintf(stderr, "cuda-emu: cublasLtMatmul %llu x %llu x %llu, batch %d%s\n", (unsigned long long)m,
                           (unsigned long long)n, (unsigned long long)k, (int)nb, arrays ? " (pointer arrays)" : "");
    enqueue(S(stream), [=]() {
        for (int32_t t = 0; t < nb; t++) {
            const float *pa, *pb, *pc = nullptr;
            float *pd;
            if (arrays) { /* the arrays are device memory: read now, when the copies before ran */
                uint64_t v[4] = { 0, 0, 0, 0 };
                memcpy(&v[0], (const char *)A + (size_t)t * 8, 8);
                memcpy(&v[1], (const char *)B + (size_t)t * 8, 8);
                memcpy(&v[3], (const char *)D + (size_t)t * 8, 8);
                if (be != 0.0f) memcpy(&v[2], (const char *)C + (size_t)t * 8, 8);
                if (!is_device(v[0], lt_bytes(&a)) || !is_device(v[1], lt_bytes(&b)) || !is_device(v[3], lt_bytes(&o)) ||
                    (be != 0.0f && !is_device(v[2], lt_bytes(&c)))) {
                    complain("cublasLtMatmul: a matrix of the pointer arrays", v[0], lt_bytes(&a));
                    abort(); /* a real device would fault */
                }
                pa = (const float *)(uintptr_t)v[0], pb = (const float *)(uintptr_t)v[1];
                pc = (const float *)(uintptr_t)v[2], pd = (float *)(uintptr_t)v[3];
            } else {
                pa = (const float *)A + (size_t)t * (size_t)a.bstride, pb = (const float *)B + (size_t)t * (size_t)b.bstride;
                if (C) pc = (const float *)C + (size_t)t * (size_t)c.bstride;
                pd = (float *)D + (size_t)t * (size_t)o.bstride;
            }
            for (uint64_t j = 0; j < n; j++)
                for (uint64_t i = 0; i < m; i++) {
                    float acc = 0.0f;
                    for (uint64_t e = 0; e < k; e++) {
                        float x = dc.transa ? pa[e + i * (uint64_t)a.ld] : pa[i + e * (uint64_t)a.ld];
                        float y = dc.transb ? pb[j + e * (uint64_t)b.ld] : pb[e + j * (uint64_t)b.ld];
                        acc = fmaf(x, y, acc);
                    }
                    float v = al == 1.0f ? acc : al * acc;
                    if (be != 0.0f) v = v + be * pc[i + j * (uint64_t)c.ld];
                    pd[i + j * (uint64_t)o.ld] = v;
                }
        }
    });
    return LT_OK;
}

} // extern "C"
