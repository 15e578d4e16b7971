// moe.cu -- MoE routing metadata and the combine on the GPU, bit-identical to
// csrc/moe_ref.c.  No host synchronisation: the sizes that depend on the
// routing (rows per expert) stay on the device; kernels that consume them read
// offsets[] themselves.
//
// route: one block.  Each warp owns a contiguous chunk of the T*K entries, so
//   the sort is stable if ranks are handed out chunk by chunk, warp by warp.
//   Pass 1 counts per (warp, expert) with __match_any_sync (no atomics: one
//   leader per expert per batch of 32 writes the warp's private counter);
//   pass 2 scans (expert-major, warp-minor) into bases; pass 3 revisits the
//   chunk and writes each entry's sorted row.  Shared memory: warps * E ints.
// combine: out[t] = sum_k y[pos[t,k]] in fp32, k in order, one thread per pair
//   of columns of a token row.
#include "common.cuh"

namespace sam {
namespace {

constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ int64_t load_idx(const void *p, sam_dtype t, int64_t i) {
    return t == SAM_I64 ? static_cast<const int64_t *>(p)[i] : (int64_t) static_cast<const int32_t *>(p)[i];
}

__global__ void route_kernel(const void *top_k_index, sam_dtype it, int64_t T, int64_t K, int32_t E,
                             int32_t *offsets, int32_t *token_ids, int32_t *perm, int32_t *pos) {
    extern __shared__ int32_t sm[];  // cnt[warps][E], then tot[E + 1]
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int32_t *cnt = sm, *tot = sm + warps * E;
    const int64_t n = T * K;
    const int64_t chunk = (n + warps - 1) / warps;
    const int64_t begin = min(n, (int64_t)warp * chunk), end = min(n, begin + chunk);
    for (int i = threadIdx.x; i < warps * E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    const unsigned lt = (1u << lane) - 1u;
    // pass 1: counts
    for (int64_t b = begin; b < end; b += 32) {
        const int64_t i = b + lane;
        int32_t e = -1;
        if (i < end) {
            int64_t v = load_idx(top_k_index, it, i);
            e = (v >= 0 && v < E) ? (int32_t)v : -1;
        }
        const unsigned peers = __match_any_sync(FULL, e);
        if (e >= 0 && (peers & lt) == 0) cnt[warp * E + e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // pass 2: per expert, exclusive over warps; then over experts
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t run = 0;
        for (int w = 0; w < warps; w++) {
            int32_t c = cnt[w * E + e];
            cnt[w * E + e] = run;
            run += c;
        }
        tot[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t run = 0;
        for (int e = 0; e < E; e++) {
            int32_t c = tot[e];
            tot[e] = run;
            run += c;
        }
        tot[E] = run;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = tot[e];
    for (int i = threadIdx.x; i < warps * E; i += blockDim.x) cnt[i] += tot[i % E];
    __syncthreads();
    // pass 3: ranks
    for (int64_t b = begin; b < end; b += 32) {
        const int64_t i = b + lane;
        int32_t e = -1;
        if (i < end) {
            int64_t v = load_idx(top_k_index, it, i);
            e = (v >= 0 && v < E) ? (int32_t)v : -1;
        }
        const unsigned peers = __match_any_sync(FULL, e);
        int32_t base = e >= 0 ? cnt[warp * E + e] : 0;
        __syncwarp();
        if (e >= 0) {
            const int32_t s = base + __popc(peers & lt);
            token_ids[s] = (int32_t)(i / K);
            perm[s] = (int32_t)i;
            pos[i] = s;
            if ((peers & lt) == 0) cnt[warp * E + e] = base + __popc(peers);
        } else if (i < end) {
            pos[i] = -1;
        }
        __syncwarp();
    }
    __syncthreads();
    for (int64_t s = tot[E] + threadIdx.x; s < n; s += blockDim.x) {
        token_ids[s] = 0;
        perm[s] = -1;
    }
}

__global__ void gather_weights_kernel(float *out, const void *w, sam_dtype wt, const int32_t *perm,
                                      const int32_t *offsets, int32_t E, int64_t S) {
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S) return;
    const int32_t p = perm[s];
    out[s] = (s < offsets[E] && p >= 0 && p < S) ? load_as_float(w, wt, p) : 0.0f;
}

template <typename T> __device__ __forceinline__ float2 load2(const T *p) {
    typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type v =
        *reinterpret_cast<const typename std::conditional<std::is_same<T, __half>::value, __half2,
                                                          __nv_bfloat162>::type *>(p);
    return make_float2(Elem<T>::to_f(v.x), Elem<T>::to_f(v.y));
}
template <> __device__ __forceinline__ float2 load2<float>(const float *p) { return make_float2(p[0], p[1]); }

template <typename TY, typename TO>
__global__ void combine_kernel(TO *out, const TY *y, const int32_t *pos, int64_t T, int64_t K, int64_t H,
                               int64_t ldy, int64_t S) {
    const int64_t pairs = (H + 1) / 2;
    const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= T * pairs) return;
    const int64_t t = gid / pairs, h = 2 * (gid % pairs);
    const bool two = h + 1 < H;
    float a = 0.0f, b = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const int32_t s = pos[t * K + k];
        if (s < 0 || s >= S) continue;
        const TY *src = y + (int64_t)s * ldy + h;
        if (two) {
            float2 v = load2<TY>(src);
            a += v.x;
            b += v.y;
        } else {
            a += Elem<TY>::to_f(src[0]);
        }
    }
    out[t * H + h] = Elem<TO>::from_f(a);
    if (two) out[t * H + h + 1] = Elem<TO>::from_f(b);
}

template <typename TY>
sam_status combine_out(void *out, sam_dtype ot, const TY *y, const int32_t *pos, int64_t T, int64_t K, int64_t H,
                       int64_t ldy, int64_t S, cudaStream_t stream) {
    const int64_t n = T * ((H + 1) / 2);
    if (n == 0) return SAM_STATUS_OK;
    const unsigned blocks = (unsigned)ceil_div(n, 256);
    switch (ot) {
    case SAM_BF16: combine_kernel<TY, __nv_bfloat16><<<blocks, 256, 0, stream>>>((__nv_bfloat16 *)out, y, pos, T, K, H, ldy, S); break;
    case SAM_F16: combine_kernel<TY, __half><<<blocks, 256, 0, stream>>>((__half *)out, y, pos, T, K, H, ldy, S); break;
    case SAM_F32: combine_kernel<TY, float><<<blocks, 256, 0, stream>>>((float *)out, y, pos, T, K, H, ldy, S); break;
    default: set_error("moe_combine: unsupported output dtype"); return SAM_STATUS_UNSUPPORTED;
    }
    return launch_status("moe_combine");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_moe_route_cuda(const void *top_k_index, sam_dtype index_dtype, int64_t T, int64_t K,
                                         int64_t E, int32_t *offsets, int32_t *token_ids, int32_t *perm,
                                         int32_t *pos, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    // warps * E counters must fit in 96 KB of shared memory
    int warps = (int)std::min<int64_t>(32, std::max<int64_t>(1, (96 * 1024 / 4 - E - 1) / std::max<int64_t>(E, 1)));
    if (E > 96 * 1024 / 4 / 2) {
        sam::set_error("moe_route: %lld experts is more than this kernel supports (12287)", (long long)E);
        return SAM_STATUS_UNSUPPORTED;
    }
    const size_t smem = sizeof(int32_t) * (size_t)(warps * E + E + 1);
    SAM_CUDA_TRY(cudaFuncSetAttribute(sam::route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "moe_route");
    sam::route_kernel<<<1, warps * 32, smem, s>>>(top_k_index, index_dtype, T, K, (int32_t)E, offsets, token_ids,
                                                  perm, pos);
    return sam::launch_status("moe_route");
}

extern "C" sam_status sam_moe_gather_weights_cuda(float *out, const void *w, sam_dtype wt, const int32_t *perm,
                                                  const int32_t *offsets, int64_t E, int64_t S, void *stream) {
    if (S == 0) return SAM_STATUS_OK;
    sam::gather_weights_kernel<<<(unsigned)sam::ceil_div(S, 256), 256, 0, (cudaStream_t)stream>>>(
        out, w, wt, perm, offsets, (int32_t)E, S);
    return sam::launch_status("moe_gather_weights");
}

extern "C" sam_status sam_moe_combine_cuda(void *out, sam_dtype out_dtype, const void *y, sam_dtype y_dtype,
                                           const int32_t *pos, int64_t T, int64_t K, int64_t H, int64_t ldy,
                                           int64_t S, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    switch (y_dtype) {
    case SAM_BF16: return sam::combine_out(out, out_dtype, (const __nv_bfloat16 *)y, pos, T, K, H, ldy, S, s);
    case SAM_F16: return sam::combine_out(out, out_dtype, (const __half *)y, pos, T, K, H, ldy, S, s);
    case SAM_F32: return sam::combine_out(out, out_dtype, (const float *)y, pos, T, K, H, ldy, S, s);
    default: sam::set_error("moe_combine: unsupported y dtype"); return SAM_STATUS_UNSUPPORTED;
    }
}
