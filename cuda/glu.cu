// glu.cu -- a gated activation of two matrices, out = act(g, u) (the definition is
// sam_glu_ref in csrc/dense_ref.c).
//
// A dense MLP at prefill sizes runs its gate and up matmuls in a GEMM library; torch then
// reads both outputs twice (silu, then the product).  Here one pass: each thread takes 8
// columns of a row as one 16-byte load of g and of u and one 16-byte store (where I, the
// row strides and the pointers allow; else one element at a time), a grid-stride loop
// over rows x 8-column pieces.  Programmatic dependent launch: waits for the kernel
// before on the stream before reading, lets the next one start at once.
#include "common.cuh"

namespace sam {
namespace {

struct GluArgs {
    const void *g, *u;
    int64_t ldg, ldu;
    void *out;
    int64_t ldo, T, I;
    sam_act act;
    float alpha, limit;
};

template <typename T, bool VEC> __global__ void __launch_bounds__(256) glu_kernel(const GluArgs p) {
    pdl_wait();
    pdl_trigger();
    const int64_t per = VEC ? p.I / 8 : p.I;  // pieces of a row
    const int64_t n = p.T * per;
    for (int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; id < n; id += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = id / per, c = (id - t * per) * (VEC ? 8 : 1);
        const T *g = static_cast<const T *>(p.g) + t * p.ldg + c;
        const T *u = static_cast<const T *>(p.u) + t * p.ldu + c;
        T *o = static_cast<T *>(p.out) + t * p.ldo + c;
        if (VEC) {
            const uint4 gv = *reinterpret_cast<const uint4 *>(g), uv = *reinterpret_cast<const uint4 *>(u);
            const T *ge = reinterpret_cast<const T *>(&gv), *ue = reinterpret_cast<const T *>(&uv);
            uint4 ov;
            uint32_t *ow = reinterpret_cast<uint32_t *>(&ov);
#pragma unroll
            for (int j = 0; j < 4; j++)
                ow[j] = Elem<T>::pack2(
                    gated_act(p.act, p.alpha, p.limit, Elem<T>::to_f(ge[2 * j]), Elem<T>::to_f(ue[2 * j])),
                    gated_act(p.act, p.alpha, p.limit, Elem<T>::to_f(ge[2 * j + 1]), Elem<T>::to_f(ue[2 * j + 1])));
            *reinterpret_cast<uint4 *>(o) = ov;
        } else {
            *o = Elem<T>::from_f(gated_act(p.act, p.alpha, p.limit, Elem<T>::to_f(*g), Elem<T>::to_f(*u)));
        }
    }
}

template <typename T> sam_status glu_launch(const GluArgs &a, bool vec, cudaStream_t stream) {
    const int64_t n = a.T * (vec ? a.I / 8 : a.I);
    const int sms = device_sm_count() > 0 ? device_sm_count() : 132;
    const unsigned grid = (unsigned)std::min<int64_t>((n + 255) / 256, (int64_t)sms * 8);
    if (vec)
        SAM_CUDA_TRY(launch_kernel(glu_kernel<T, true>, dim3(grid), dim3(256), 0, stream, pdl_enabled(), a), "glu");
    else
        SAM_CUDA_TRY(launch_kernel(glu_kernel<T, false>, dim3(grid), dim3(256), 0, stream, pdl_enabled(), a), "glu");
    return launch_status("glu");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_glu_cuda(const sam_glu_params *p, void *stream) {
    using namespace sam;
    if (!tc_dtype_ok(p->dtype, "glu")) return SAM_STATUS_UNSUPPORTED;
    if (p->act != SAM_ACT_SWIGLU && p->act != SAM_ACT_GPTOSS) {
        set_error("glu: act %d is not a gated activation", (int)p->act);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->T < 0 || p->I < 0) {
        set_error("glu: sizes T = %lld, I = %lld out of range", (long long)p->T, (long long)p->I);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->T == 0 || p->I == 0) return SAM_STATUS_OK;
    GluArgs a;
    a.g = p->g;
    a.u = p->u;
    a.ldg = p->ldg;
    a.ldu = p->ldu;
    a.out = p->out;
    a.ldo = p->ldo;
    a.T = p->T;
    a.I = p->I;
    a.act = p->act;
    a.alpha = p->alpha;
    a.limit = p->limit;
    const uintptr_t mis = (reinterpret_cast<uintptr_t>(p->g) | reinterpret_cast<uintptr_t>(p->u) |
                           reinterpret_cast<uintptr_t>(p->out)) & 15u;
    const bool vec = mis == 0 && p->I % 8 == 0 && p->ldg % 8 == 0 && p->ldu % 8 == 0 && p->ldo % 8 == 0;
    cudaStream_t s = (cudaStream_t)stream;
    return with_tc_dtype(p->dtype, [&](auto t) { return glu_launch<decltype(t)>(a, vec, s); });
}
