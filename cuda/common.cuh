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

// 16-byte asynchronous copy global -> shared; src_bytes = 0 writes zeros and
// reads nothing (tails and out-of-range rows).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace sam
