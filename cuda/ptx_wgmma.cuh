// ptx_wgmma.cuh -- PTX wrappers of the Hopper path (sm_90a): warpgroup MMA
// (wgmma.mma_async.sp with both operands in shared memory), its fences and the
// shared-memory matrix descriptors.  Outside sm_90a builds they compile to nothing
// (or a trap): the kernels that use them check SAM_HAS_WGMMA.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace sam {

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

// After a consumer's last wgmma: every group done, the accumulators kept in place, and the
// ring's last reads (wgmma's, the async proxy) fenced against the generic writes of an
// epilogue that reuses it as staging.
template <int N> __device__ __forceinline__ void wgmma_drain(float (&d)[N]) {
    wgmma_wait<0>();
    fence_regs(d);
    fence_proxy_async();
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

// D[64 x N] = A(sparse 64 x 32, 2:4, shared memory by descriptor adesc) * B(32 x N, shared
// memory by descriptor bdesc, K-major) + (scale_d ? D : 0), fp32 accumulate, metadata
// selector 0; N = 128, 96 or 64 (N / 2 registers per thread).  Issued by a whole warpgroup.
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

// Shared-memory matrix descriptor of an MN-major tile in the 128-byte swizzle (16-bit
// elements): the canonical layout ((8 x 8, m), (8, k)) of 64-element MN blocks: each K
// index one 128-byte row of 64 MN-contiguous elements (16-byte chunks XOR-swizzled by the
// row's place in its 8-row atom), 8-row atoms 1024 bytes apart (SBO), MN blocks `lbo`
// bytes apart (LBO).  The start steps by whole atoms (k16: 2048 bytes), so it stays on
// the 1024-byte alignment the swizzle pattern is anchored to (base offset 0).
__device__ __forceinline__ uint64_t smem_desc_mn_sw128(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// Dense D[64 x 256] (+)= A[64 x 16] * B[16 x 256], fp32 accumulate, both operands in shared
// memory through descriptors, both MN-major (transpose bits 1: A is M-contiguous per K
// index, B N-contiguous; 16-bit types only); scale_d = 0 ignores D.  Issued by a whole
// warpgroup; 128 accumulators per thread (ssmm_dw_wgmma.cu).
template <typename T> struct WgmmaDenseMN256;
// one specialisation per 16-bit type: the same instruction, its type in the string
#ifdef SAM_HAS_WGMMA
#define SAM_WGMMA_DENSE_MN256_ASM(PTYPE, TNSPB) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTYPE "." PTYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
        "%128, %129, p, 1, 1, 1, " TNSPB ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(adesc), "l"(bdesc), "r"(scale_d));
#else
#define SAM_WGMMA_DENSE_MN256_ASM(PTYPE, TNSPB) ((void)d, (void)adesc, (void)bdesc, (void)scale_d, __trap())
#endif
// BK: B K-major (transpose bit 0: each of B's 256 N rows K-contiguous, as smem_desc_sw128
// describes; the start steps 32 bytes per k16) instead of MN-major.
template <> struct WgmmaDenseMN256<__nv_bfloat16> {
    template <bool BK = false>
    static __device__ __forceinline__ void run(float (&d)[128], uint64_t adesc, uint64_t bdesc, int scale_d = 1) {
        if constexpr (BK) { SAM_WGMMA_DENSE_MN256_ASM("bf16", "0"); } else { SAM_WGMMA_DENSE_MN256_ASM("bf16", "1"); }
    }
};
template <> struct WgmmaDenseMN256<__half> {
    template <bool BK = false>
    static __device__ __forceinline__ void run(float (&d)[128], uint64_t adesc, uint64_t bdesc, int scale_d = 1) {
        if constexpr (BK) { SAM_WGMMA_DENSE_MN256_ASM("f16", "0"); } else { SAM_WGMMA_DENSE_MN256_ASM("f16", "1"); }
    }
};
#undef SAM_WGMMA_DENSE_MN256_ASM

}  // namespace sam
