// common.cuh -- what every samoyeds .cu file shares: error reporting for the
// launchers (a thread-local message, never exit), element types, and the PTX
// wrappers for asynchronous copies, ldmatrix and sparse mma.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "samoyeds_cuda.h"

namespace sam {

// ---- launcher-side errors ---------------------------------------------------------

void set_error(const char *fmt, ...);

// Maps a CUDA error to a status with a message naming the op.
sam_status cuda_status(cudaError_t err, const char *op);

// Checks the launch that just happened (configuration errors only; the kernel
// runs asynchronously).
inline sam_status launch_status(const char *op) { return cuda_status(cudaGetLastError(), op); }

#define SAM_CUDA_TRY(expr, op)                                   \
    do {                                                         \
        cudaError_t err_ = (expr);                               \
        if (err_ != cudaSuccess) return sam::cuda_status(err_, op); \
    } while (0)

// Integer from the environment (launch-time kernel choices); dflt when unset or empty.
int env_int(const char *name, int dflt);

// Streaming multiprocessors of the current device, cached per device (0 when unknown).
int device_sm_count();

// ---- programmatic dependent launch (sm_90+) -------------------------------------------
//
// A kernel launched with pdl = true may be scheduled while the kernel before it on the
// stream is still running (once every CTA of that one has called pdl_trigger() or
// ended).  Such a kernel calls pdl_wait() in every CTA before it reads what an earlier
// kernel writes, writes what an earlier kernel reads, or ends: pdl_wait() returns once
// the kernel before has completed and its writes are visible.  Both are no-ops on a
// kernel launched without the attribute and below sm_90.

// Whether the current device runs programmatic dependent launches (compute capability 9.0
// or newer) and SAMOYEDS_PDL is not 0; cached per device, the variable read per call.
bool pdl_enabled();

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    if (pdl) {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// ---- element types ----------------------------------------------------------------

template <typename T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
    static __device__ __forceinline__ uint32_t pack2(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};
template <> struct Elem<__half> {
    static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
    static __device__ __forceinline__ uint32_t pack2(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};

template <> struct Elem<float> {  // packing only: no tensor-core path for fp32
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};

__device__ __forceinline__ float load_as_float(const void *p, sam_dtype t, int64_t i) {
    switch (t) {
    case SAM_F32: return static_cast<const float *>(p)[i];
    case SAM_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case SAM_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    case SAM_F64: return (float)static_cast<const double *>(p)[i];
    default: return 0.0f;
    }
}

__device__ __forceinline__ double load_as_double(const void *p, sam_dtype t, int64_t i) {
    if (t == SAM_F64) return static_cast<const double *>(p)[i];
    return (double)load_as_float(p, t, i);
}

__device__ __forceinline__ void store_from_float(void *p, sam_dtype t, int64_t i, float v) {
    switch (t) {
    case SAM_F32: static_cast<float *>(p)[i] = v; break;
    case SAM_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
    case SAM_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
    default: break;
    }
}

// ---- PTX wrappers -------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One 16-byte store to global memory (p 16-byte aligned), as one instruction: written as a
// uint4 assignment, the warp-specialised kernel's epilogue was compiled into four 4-byte stores.
__device__ __forceinline__ void st_global_v4(void *p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// 16-byte asynchronous copy global -> shared; src_bytes = 0 writes zeros and
// reads nothing (tails and out-of-range rows).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// The same with an L2 prefetch of the 256-byte block around src (PTX .L2::256B): the
// decode kernel's weight copies, which read each row 64 bytes per k-tile and warp.
__device__ __forceinline__ void cp_async16_l2_256(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                            uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// D = A(sparse 16x32, 2:4) * B(32x8) + C, fp32 accumulate, metadata selector 0
// (lanes 4r and 4r+1 of each quad supply the metadata word).
template <typename T> struct MmaSp;
template <> struct MmaSp<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                               uint32_t e) {
        asm volatile(
            "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
    }
};
template <> struct MmaSp<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                               uint32_t e) {
        asm volatile(
            "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
    }
};

// ---- row selection (formats 1:M:V) ----------------------------------------------
//
// What every ssmm kernel reads of a launch (the kernels' parameter structs extend it).
struct SsmmArgs {
    const void *x;
    int64_t T, ldx, C, cp, rp, slices, R;
    const void *values;
    const uint32_t *meta;
    const uint8_t *idx;
    int glu;
    const int32_t *offsets;
    const int32_t *token_ids;
    int64_t S;
    int E;
    int act;
    const void *bias;
    sam_dtype bias_dtype;
    const float *scale;
    float alpha, limit;
    void *out;
    int64_t ldo, out_cols;
};

inline SsmmArgs ssmm_args(const sam_ssmm_params *ps) {
    SsmmArgs a;
    a.x = ps->x;
    a.T = ps->T;
    a.ldx = ps->ldx;
    a.C = ps->d.C;
    a.cp = ps->d.cp;
    a.rp = ps->d.rp;
    a.slices = ps->d.slices;
    a.R = ps->d.R;
    a.values = ps->values;
    a.meta = ps->meta;
    a.idx = ps->idx;
    a.glu = ps->f.glu;
    a.offsets = ps->offsets;
    a.token_ids = ps->token_ids;
    a.S = ps->S;
    a.E = (int)ps->d.E;
    a.act = ps->act;
    a.bias = ps->bias;
    a.bias_dtype = ps->bias_dtype;
    a.scale = ps->scale;
    a.alpha = ps->alpha;
    a.limit = ps->limit;
    a.out = ps->out;
    a.ldo = ps->ldo;
    a.out_cols = ps->act == SAM_ACT_NONE ? ps->d.R : ps->d.R / 2;
    return a;
}

// The gated activation of gate v and up u (bias added), as every kernel and the C
// reference compute it: SwiGLU silu(v) * u, or GPT-OSS's clamped variant.
__device__ __forceinline__ float gated_act(sam_act act, float alpha, float limit, float v, float u) {
    if (act == SAM_ACT_SWIGLU) return __fdividef(v, 1.0f + __expf(-v)) * u;
    const float gc = fminf(v, limit);
    const float uc = fmaxf(fminf(u, limit), -limit);
    return (uc + 1.0f) * __fdividef(gc, 1.0f + __expf(-alpha * gc));
}
__device__ __forceinline__ float gated_act(const SsmmArgs &p, float v, float u) {
    return gated_act((sam_act)p.act, p.alpha, p.limit, v, u);
}

// mma.sync m16n8k16, fp32 accumulation, of the 16-bit element type T (dense_decode, router).
template <typename T> struct Mma16816;
template <> struct Mma16816<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
template <> struct Mma16816<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

// Runs f(T{}) with T the tensor-core element type of dt (bfloat16 or float16).
// Whether dt is one of the tensor cores' input types (bf16, fp16); if not, the error names op.
inline bool tc_dtype_ok(sam_dtype dt, const char *op) {
    if (dt == SAM_BF16 || dt == SAM_F16) return true;
    set_error("%s: the GPU kernel takes bfloat16 or float16", op);
    return false;
}

template <typename F> sam_status with_tc_dtype(sam_dtype dt, F &&f, const char *op = "ssmm") {
    switch (dt) {
    case SAM_BF16: return f(__nv_bfloat16());
    case SAM_F16: return f(__half());
    default: tc_dtype_ok(dt, op); return SAM_STATUS_UNSUPPORTED;
    }
}

// Row selection (1:M:V) in registers, by a running total.  A condensed row keeps M
// accumulator sets.  The MMA always accumulates into set 0, which is never moved: it holds
// the total T of every slice, whichever row of the group the slice selected.  Set a
// (1 <= a < M) holds D_{a-1}, the share of row a-1: the sum of the slices that selected it.
// With c_{r,j} = 1 where slice j selects row r (else 0) and T_j the total after slice j,
//     D_r = sum_j c_{r,j} (T_j - T_{j-1}) = sum_j (c_{r,j} - c_{r,j+1}) T_j,
// so at each slice boundary, once the slice's MMAs are done, fold_row_set adds
// (c_prev - c_next) T to every share: M - 1 FFMAs per accumulator with a coefficient of -1, 0
// or 1 (exact but for the add's rounding; a third of the instructions of swapping the
// sets, two selects and a move per accumulator and set).  `sel` is the row the previous
// slice selected (M: none yet).  After the last slice finish_row_sets makes set 0 row M-1
// (T minus the shares) and turns `sel` into the perm the stores read: 4 bits per set a,
// which row of its group it holds.
// at(a, j, k) is the accumulator of set a, n8 tile j, fragment element k; a thread's row hh
// owns elements k = 2hh, 2hh+1 of every tile (mma.sp and wgmma layouts alike).
// The `sel` a row starts with: no row selected yet (M); for M = 1, where nothing is
// folded, the perm the stores read (set 0 is row 0).
template <int M> __device__ __forceinline__ constexpr uint32_t first_sel() { return M > 1 ? (uint32_t)M : 0u; }

// The first k-tile of each slice of kps k-tiles, k-tile by k-tile, by a countdown
// (no division on the k loop).
struct SliceStart {
    int left = 0;
    __device__ __forceinline__ bool next(int kps) {
        const bool first = left == 0;
        left = (first ? kps : left) - 1;
        return first;
    }
};

// mma.sp fragments of MT x NT tiles: every accumulator set at zero, no row selected yet
// (M = 1: the identity perm, set 0 is the row).
template <int M, int MT, int NT>
__device__ __forceinline__ void init_row_sets(float (&acc)[M][MT][NT][4], uint32_t (&sel)[MT][2]) {
#pragma unroll
    for (int a = 0; a < M; a++)
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[a][i][j][k] = 0.0f;
#pragma unroll
    for (int i = 0; i < MT; i++) sel[i][0] = sel[i][1] = first_sel<M>();
}

template <int M, int NT, typename At>
__device__ __forceinline__ void fold_row_set(At at, uint32_t &sel, uint32_t want, int hh) {
#pragma unroll
    for (int a = 1; a < M; a++) {
        const float coef = (sel == (uint32_t)(a - 1) ? 1.0f : 0.0f) - (want == (uint32_t)(a - 1) ? 1.0f : 0.0f);
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 2 * hh; k < 2 * hh + 2; k++) at(a, j, k) = fmaf(coef, at(0, j, k), at(a, j, k));
    }
    sel = want;
}

template <int M, int NT, typename At>
__device__ __forceinline__ void finish_row_sets(At at, uint32_t &sel, int hh) {
    if (M == 1) return;
    fold_row_set<M, NT>(at, sel, (uint32_t)M, hh);  // past the last slice no row is selected
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int k = 2 * hh; k < 2 * hh + 2; k++) {
            float r = at(0, j, k);
#pragma unroll
            for (int a = 1; a < M; a++) r -= at(a, j, k);
            at(0, j, k) = r;
        }
    uint32_t perm = (uint32_t)(M - 1);
#pragma unroll
    for (int a = 1; a < M; a++) perm |= (uint32_t)(a - 1) << (4 * a);
    sel = perm;
}

// ---- Hopper (sm_90a): warpgroup MMA ---------------------------------------------------

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SAM_HAS_WGMMA 1
#endif

__device__ __forceinline__ void wgmma_fence() {
#ifdef SAM_HAS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef SAM_HAS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#ifdef SAM_HAS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Shared memory written through the generic proxy (cp.async, st.shared) is
// read by wgmma through the async proxy: each writer fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef SAM_HAS_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accumulator registers across asynchronous MMAs.
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major tile in a SW-byte swizzle layout:
// rows of SW bytes, 8-row atoms 8 x SW bytes apart (and so aligned); layout type
// 1 = 128-byte, 2 = 64-byte swizzle.  The start may step inside a row (k steps).
template <int SW> __device__ __forceinline__ uint64_t smem_desc_swizzled(uint32_t addr) {
    static_assert(SW == 128 || SW == 64, "128- or 64-byte swizzle");
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(8 * SW >> 4) << 32) |
           ((uint64_t)(SW == 128 ? 1 : 2) << 62);
}
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) { return smem_desc_swizzled<128>(addr); }
__device__ __forceinline__ uint64_t smem_desc_sw64(uint32_t addr) { return smem_desc_swizzled<64>(addr); }

// D[64 x 128] = A(sparse 64 x 32, registers, 2:4) * B(32 x 128, shared memory,
// K-major) + (scale_d ? D : 0), fp32 accumulate; metadata selector 0.  Issued by
// a whole warpgroup.
template <typename T> struct WgmmaSp;
#define SAM_WGMMA_SP(TYPE, PTXT)                                                                        \
    template <> struct WgmmaSp<TYPE> {                                                                  \
        static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, \
                                                   uint32_t e, int scale_d = 1) {                       \
            SAM_WGMMA_SP_ASM(PTXT)                                                                      \
        }                                                                                               \
    };
#ifdef SAM_HAS_WGMMA
#define SAM_WGMMA_SP_ASM(PTXT)                                                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"                                           \
                 "wgmma.mma_async.sp.sync.aligned.m64n128k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, %69, 0, p, 1, 1, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "r"(scale_d));
#else
#define SAM_WGMMA_SP_ASM(PTXT) (void)d; (void)a; (void)desc; (void)e; (void)scale_d; __trap();
#endif
SAM_WGMMA_SP(__nv_bfloat16, "bf16")
SAM_WGMMA_SP(__half, "f16")
#undef SAM_WGMMA_SP
#undef SAM_WGMMA_SP_ASM

// As WgmmaSp, with the packed A tile (64 rows x 16 values) read from shared memory
// through a descriptor instead of registers, and N = 128, 96 or 64 columns of B:
// D[64 x N] in N / 2 registers per thread.
template <typename T, int N = 128> struct WgmmaSpSS;
#define SAM_WGMMA_SP_SS(TYPE, PTXT, N)                                                                  \
    template <> struct WgmmaSpSS<TYPE, N> {                                                             \
        static __device__ __forceinline__ void run(float (&d)[N / 2], uint64_t adesc, uint64_t bdesc,   \
                                                   uint32_t e, int scale_d = 1) {                       \
            SAM_WGMMA_SP_SS_ASM_##N(PTXT)                                                               \
        }                                                                                               \
    };
#ifdef SAM_HAS_WGMMA
#define SAM_WGMMA_SP_SS_ASM_128(PTXT)                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %67, 0;\n"                                          \
                 "wgmma.mma_async.sp.sync.aligned.m64n128k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, %66, 0, p, 1, 1, 0, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                 \
                 : "l"(adesc), "l"(bdesc), "r"(e), "r"(scale_d));
#define SAM_WGMMA_SP_SS_ASM_96(PTXT)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %51, 0;\n"                                          \
                 "wgmma.mma_async.sp.sync.aligned.m64n96k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, %50, 0, p, 1, 1, 0, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])                                                                                 \
                 : "l"(adesc), "l"(bdesc), "r"(e), "r"(scale_d));
#define SAM_WGMMA_SP_SS_ASM_64(PTXT)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %35, 0;\n"                                          \
                 "wgmma.mma_async.sp.sync.aligned.m64n64k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34, 0, p, 1, 1, 0, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                 \
                 : "l"(adesc), "l"(bdesc), "r"(e), "r"(scale_d));
#else
#define SAM_WGMMA_SP_SS_ASM_128(PTXT) (void)d; (void)adesc; (void)bdesc; (void)e; (void)scale_d; __trap();
#define SAM_WGMMA_SP_SS_ASM_96(PTXT) (void)d; (void)adesc; (void)bdesc; (void)e; (void)scale_d; __trap();
#define SAM_WGMMA_SP_SS_ASM_64(PTXT) (void)d; (void)adesc; (void)bdesc; (void)e; (void)scale_d; __trap();
#endif
SAM_WGMMA_SP_SS(__nv_bfloat16, "bf16", 128)
SAM_WGMMA_SP_SS(__half, "f16", 128)
SAM_WGMMA_SP_SS(__nv_bfloat16, "bf16", 64)
SAM_WGMMA_SP_SS(__half, "f16", 64)
SAM_WGMMA_SP_SS(__nv_bfloat16, "bf16", 96)
SAM_WGMMA_SP_SS(__half, "f16", 96)
#undef SAM_WGMMA_SP_SS
#undef SAM_WGMMA_SP_SS_ASM_128
#undef SAM_WGMMA_SP_SS_ASM_64
#undef SAM_WGMMA_SP_SS_ASM_96

// As WgmmaSpSS, with the packed A tile in registers (the operand form of WgmmaSp) for
// N = 64 and 96 columns of B; N = 128 is WgmmaSp.  The rate measurement (peak.cu) and
// measurement builds (SAM_WS_A_REGS in ssmm.cu) issue it.
template <typename T, int N> struct WgmmaSpRS;
#define SAM_WGMMA_SP_RS(TYPE, PTXT, N)                                                                  \
    template <> struct WgmmaSpRS<TYPE, N> {                                                             \
        static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t bdesc, \
                                                   uint32_t e, int scale_d = 1) {                       \
            SAM_WGMMA_SP_RS_ASM_##N(PTXT)                                                               \
        }                                                                                               \
    };
#ifdef SAM_HAS_WGMMA
#define SAM_WGMMA_SP_RS_ASM_64(PTXT)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                          \
                 "wgmma.mma_async.sp.sync.aligned.m64n64k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 0, p, 1, 1, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(e), "r"(scale_d));
#define SAM_WGMMA_SP_RS_ASM_96(PTXT)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %54, 0;\n"                                          \
                 "wgmma.mma_async.sp.sync.aligned.m64n96k32.f32." PTXT "." PTXT " "                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, %53, 0, p, 1, 1, 0;\n}\n"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(e), "r"(scale_d));
#else
#define SAM_WGMMA_SP_RS_ASM_64(PTXT) (void)d; (void)a; (void)bdesc; (void)e; (void)scale_d; __trap();
#define SAM_WGMMA_SP_RS_ASM_96(PTXT) (void)d; (void)a; (void)bdesc; (void)e; (void)scale_d; __trap();
#endif
SAM_WGMMA_SP_RS(__nv_bfloat16, "bf16", 64)
SAM_WGMMA_SP_RS(__half, "f16", 64)
SAM_WGMMA_SP_RS(__nv_bfloat16, "bf16", 96)
SAM_WGMMA_SP_RS(__half, "f16", 96)
#undef SAM_WGMMA_SP_RS
#undef SAM_WGMMA_SP_RS_ASM_64
#undef SAM_WGMMA_SP_RS_ASM_96
template <typename T> struct WgmmaSpRS<T, 128> {
    static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4], uint64_t bdesc, uint32_t e,
                                               int scale_d = 1) {
        WgmmaSp<T>::run(d, a, bdesc, e, scale_d);
    }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace sam
