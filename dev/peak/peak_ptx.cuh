// peak_ptx.cuh -- the PTX wrappers only the probes issue: the warpgroup MMA with A in
// registers (wgmma.sp m64n128 / n96 / n64, dense m64n128 is in peak.cu), and the
// cluster and TMA-multicast helpers of the multicast fill.
#pragma once

#include "ptx_wgmma.cuh"
#include "tma.cuh"

namespace sam {


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


#ifdef SAM_HAS_WGMMA
// 2-d TMA tile load, multicast: the box lands at `dst` in every CTA of `mask` (cluster
// ranks), each completing on its own barrier at the offset `bar`.
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar,
                                               uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
// 3-d TMA tile load, multicast, as tma_load_2d_mc.
__device__ __forceinline__ void tma_load_3d_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                               uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
        : "memory");
}
// Arrives on the barrier at offset `bar` of cluster rank `cta`'s shared memory.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_id() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_count() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
    return r;
}
#endif

}  // namespace sam
