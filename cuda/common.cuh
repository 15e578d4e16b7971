// common.cuh -- what every samoyeds .cu file shares: error reporting for the
// launchers (a thread-local message, never exit), programmatic dependent launch,
// element types and the gated activations.  The PTX wrappers are in ptx_mma.cuh
// (sm_80: cp.async, ldmatrix, mma.sp), ptx_wgmma.cuh and tma.cuh (sm_90a).
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

// Streaming multiprocessors of the current device, cached per device (0 when unknown).
int device_sm_count();

// Whether the current device is sm_90 and this build holds sm_90a code (the wgmma kernels),
// cached per device.
bool device_runs_sm90a();

// ---- programmatic dependent launch (sm_90+) -------------------------------------------
//
// A kernel launched with pdl = true may be scheduled while the kernel before it on the
// stream is still running (once every CTA of that one has called pdl_trigger() or
// ended).  Such a kernel calls pdl_wait() in every CTA before it reads what an earlier
// kernel writes, writes what an earlier kernel reads, or ends: pdl_wait() returns once
// the kernel before has completed and its writes are visible.  Both are no-ops on a
// kernel launched without the attribute and below sm_90.

// Whether the current device runs programmatic dependent launches (compute capability 9.0
// or newer) and sam_cuda_set_pdl has not turned them off; cached per device.
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

// The gated activation of gate v and up u (bias added), as every kernel and the C
// reference compute it: SwiGLU silu(v) * u, or GPT-OSS's clamped variant.
__device__ __forceinline__ float gated_act(sam_act act, float alpha, float limit, float v, float u) {
    if (act == SAM_ACT_SWIGLU) return __fdividef(v, 1.0f + __expf(-v)) * u;
    const float gc = fminf(v, limit);
    const float uc = fmaxf(fminf(u, limit), -limit);
    return (uc + 1.0f) * __fdividef(gc, 1.0f + __expf(-alpha * gc));
}

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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace sam
