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

#include <algorithm>

namespace sam {
namespace {

constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ int64_t load_idx(const void *p, sam_dtype t, int64_t i) {
    return t == SAM_I64 ? static_cast<const int64_t *>(p)[i] : (int64_t) static_cast<const int32_t *>(p)[i];
}

// Routing, deterministic: the sorted rows of an expert are its (token, k) pairs in
// increasing pair index i = t * K + k.  One CTA (n = T * K small) or, for large n, blocks
// of rb pairs: route_kernel(mode 1) counts each block's pairs per expert, route_scan_kernel
// turns the counts into each block's first row per expert (and the offsets), and
// route_kernel(mode 2) writes each block's rows from there, in the same order.
constexpr int64_t RB = 2048;      // pairs per block of the multi-block path (at least)
constexpr int64_t RB_BLOCKS = 256;  // blocks at most (the scan walks them per expert)

// tot[0..E) (the routed rows per expert) -> exclusive offsets in tot[0..E], also written to
// offsets[]; then the CTA is synchronised.
// The scan by warp 0, 32 experts per step (shuffles, not one expert after another).
__device__ __forceinline__ void expert_offsets(int32_t *tot, int32_t E, int32_t *offsets) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int32_t run = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + lane;
            const int32_t c = e < E ? tot[e] : 0;
            int32_t v = c;  // inclusive scan over the lanes
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int32_t u = __shfl_up_sync(FULL, v, d);
                if (lane >= d) v += u;
            }
            if (e < E) tot[e] = run + v - c;
            run += __shfl_sync(FULL, v, 31);
        }
        if (lane == 0) tot[E] = run;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = tot[e];
}
// Sorted rows [routed, n) hold no pair: token 0, perm -1 (and routing weight 0).
__device__ __forceinline__ void fill_unrouted(int32_t routed, int64_t n, int32_t *token_ids, int32_t *perm,
                                              float *scale) {
    for (int64_t s = routed + threadIdx.x; s < n; s += blockDim.x) {
        token_ids[s] = 0;
        perm[s] = -1;
        if (scale) scale[s] = 0.0f;
    }
}

// mode 0: the whole routing in one CTA; 1: this block's counts per expert into blk[b][e];
// 2: this block's rows, starting at blk[b][e] (absolute) for expert e.  With scale, each
// sorted row's routing weight too (scale[s] = w[perm[s]], what gather_weights_kernel gives).
__global__ void route_kernel(const void *top_k_index, sam_dtype it, int64_t T, int64_t K, int32_t E,
                             int32_t *offsets, int32_t *token_ids, int32_t *perm, int32_t *pos, int mode,
                             int32_t *blk, int64_t rb, float *scale, const void *w, sam_dtype wt) {
    extern __shared__ int32_t sm[];  // cnt[warps][E], then tot[E + 1]
    pdl_wait();  // (mode 0 is a programmatic dependent launch: common.cuh)
    pdl_trigger();
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int32_t *cnt = sm, *tot = sm + warps * E;
    const int64_t n = T * K;
    const int64_t lo = mode == 0 ? 0 : min(n, (int64_t)blockIdx.x * rb), hi = mode == 0 ? n : min(n, lo + rb);
    const int64_t chunk = (hi - lo + warps - 1) / warps;
    const int64_t begin = min(hi, lo + (int64_t)warp * chunk), end = min(hi, begin + chunk);
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
    if (mode == 1) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int32_t run = 0;
            for (int w = 0; w < warps; w++) run += cnt[w * E + e];
            blk[(int64_t)blockIdx.x * E + e] = run;
        }
        return;
    }
    // pass 2: per expert, exclusive over warps (from the block's first row of e)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t run = mode == 2 ? blk[(int64_t)blockIdx.x * E + e] : 0;
        for (int w = 0; w < warps; w++) {
            int32_t c = cnt[w * E + e];
            cnt[w * E + e] = run;
            run += c;
        }
        tot[e] = run;
    }
    __syncthreads();
    if (mode == 0) {  // then over experts: the offsets
        expert_offsets(tot, E, offsets);
        for (int i = threadIdx.x; i < warps * E; i += blockDim.x) cnt[i] += tot[i % E];
        __syncthreads();
    }
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
            if (scale) scale[s] = load_as_float(w, wt, i);
            if ((peers & lt) == 0) cnt[warp * E + e] = base + __popc(peers);
        } else if (i < end) {
            pos[i] = -1;
        }
        __syncwarp();
    }
    if (mode == 0) {
        __syncthreads();
        fill_unrouted(tot[E], n, token_ids, perm, scale);
    }
}

// Multi-block routing, between the two route_kernel passes: blk[b][e] (block b's count of
// expert e) becomes block b's first sorted row of e; the offsets; the rows past the routed
// ones (placeholder pairs) filled as the one-CTA path fills them.
__global__ void route_scan_kernel(int32_t *blk, int64_t B, int32_t E, int64_t n, int32_t *offsets,
                                  int32_t *token_ids, int32_t *perm, float *scale) {
    extern __shared__ int32_t tot[];  // [E + 1]
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t run = 0;
#pragma unroll 8
        for (int64_t b = 0; b < B; b++) {
            const int32_t c = blk[b * E + e];
            blk[b * E + e] = run;
            run += c;
        }
        tot[e] = run;
    }
    __syncthreads();
    expert_offsets(tot, E, offsets);
    for (int64_t i = threadIdx.x; i < B * E; i += blockDim.x) blk[i] += tot[i % E];
    fill_unrouted(tot[E], n, token_ids, perm, scale);
}

__global__ void gather_weights_kernel(float *out, const void *w, sam_dtype wt, const int32_t *perm,
                                      const int32_t *offsets, int32_t E, int64_t S) {
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S) return;
    const int32_t p = perm[s];
    out[s] = (s < offsets[E] && p >= 0 && p < S) ? load_as_float(w, wt, p) : 0.0f;
}

// x's routed rows in expert order (sam_moe_gather_rows_cuda): one CTA per group of rows,
// a warp per row, 16-byte pieces where H, ldx and both pointers allow, else elements.
template <typename V>
__global__ void gather_rows_kernel(V *dst, const V *x, int64_t ldx, int64_t H, const int32_t *token_ids,
                                   const int32_t *offsets, int32_t E, int64_t S) {
    pdl_wait();  // a programmatic dependent launch (common.cuh): token_ids, offsets come from the routing
    pdl_trigger();
    const int64_t warps = blockDim.x / 32;
    const int64_t s = (int64_t)blockIdx.x * warps + threadIdx.x / 32;
    if (s >= S || s >= (int64_t)offsets[E]) return;
    const int32_t t = token_ids[s];
    const V *src = x + (int64_t)t * ldx;
    V *out = dst + s * H;
    for (int64_t h = threadIdx.x % 32; h < H; h += 32) out[h] = src[h];
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
    pdl_wait();  // a programmatic dependent launch (common.cuh)
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

// The same, 8 columns per thread with 16-byte loads (2-byte y, H and ldy multiples of 8,
// 16-byte aligned y and out): one CTA per token row, up to four of its rows' loads in
// flight, added in k order as above (bit-identical results).
template <typename TY, typename TO>
__global__ void combine_kernel_v8(TO *out, const TY *y, const int32_t *pos, int64_t K, int64_t H, int64_t ldy,
                                  int64_t S) {
    static_assert(sizeof(TY) == 2, "2-byte y");
    pdl_wait();  // a programmatic dependent launch (common.cuh)
    const int64_t t = blockIdx.x;
    for (int64_t h = (int64_t)threadIdx.x * 8; h < H; h += (int64_t)blockDim.x * 8) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k0 = 0; k0 < K; k0 += 4) {
            uint4 v[4];
            bool ok[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t k = k0 + u;
                const int32_t s = k < K ? pos[t * K + k] : -1;
                ok[u] = s >= 0 && s < S;
                v[u] = ok[u] ? *reinterpret_cast<const uint4 *>(y + (int64_t)s * ldy + h) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (!ok[u]) continue;
                const TY *e = reinterpret_cast<const TY *>(&v[u]);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += Elem<TY>::to_f(e[j]);
            }
        }
        TO *dst = out + t * H + h;
        if constexpr (sizeof(TO) == 2) {
            uint4 o;
            TO *oe = reinterpret_cast<TO *>(&o);
#pragma unroll
            for (int j = 0; j < 8; j++) oe[j] = Elem<TO>::from_f(acc[j]);
            *reinterpret_cast<uint4 *>(dst) = o;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) dst[j] = Elem<TO>::from_f(acc[j]);
        }
    }
}

template <typename TY>
sam_status combine_out(void *out, sam_dtype ot, const TY *y, const int32_t *pos, int64_t T, int64_t K, int64_t H,
                       int64_t ldy, int64_t S, cudaStream_t stream) {
    const int64_t n = T * ((H + 1) / 2);
    if (n == 0) return SAM_STATUS_OK;
    if constexpr (sizeof(TY) == 2) {
        if (H % 8 == 0 && ldy % 8 == 0 && (reinterpret_cast<uintptr_t>(y) & 15) == 0 &&
            (reinterpret_cast<uintptr_t>(out) & 15) == 0 && T <= INT32_MAX) {
            const dim3 grid((unsigned)T), block((unsigned)std::min<int64_t>(256, std::max<int64_t>(32, H / 8)));
            const bool pdl = pdl_enabled();
            switch (ot) {
            case SAM_BF16: SAM_CUDA_TRY(launch_kernel(combine_kernel_v8<TY, __nv_bfloat16>, grid, block, 0, stream, pdl, (__nv_bfloat16 *)out, y, pos, K, H, ldy, S), "moe_combine"); break;
            case SAM_F16: SAM_CUDA_TRY(launch_kernel(combine_kernel_v8<TY, __half>, grid, block, 0, stream, pdl, (__half *)out, y, pos, K, H, ldy, S), "moe_combine"); break;
            case SAM_F32: SAM_CUDA_TRY(launch_kernel(combine_kernel_v8<TY, float>, grid, block, 0, stream, pdl, (float *)out, y, pos, K, H, ldy, S), "moe_combine"); break;
            default: set_error("moe_combine: unsupported output dtype"); return SAM_STATUS_UNSUPPORTED;
            }
            return launch_status("moe_combine");
        }
    }
    const dim3 grid((unsigned)ceil_div(n, 256)), block(256);
    const bool pdl = pdl_enabled();
    switch (ot) {
    case SAM_BF16: SAM_CUDA_TRY(launch_kernel(combine_kernel<TY, __nv_bfloat16>, grid, block, 0, stream, pdl, (__nv_bfloat16 *)out, y, pos, T, K, H, ldy, S), "moe_combine"); break;
    case SAM_F16: SAM_CUDA_TRY(launch_kernel(combine_kernel<TY, __half>, grid, block, 0, stream, pdl, (__half *)out, y, pos, T, K, H, ldy, S), "moe_combine"); break;
    case SAM_F32: SAM_CUDA_TRY(launch_kernel(combine_kernel<TY, float>, grid, block, 0, stream, pdl, (float *)out, y, pos, T, K, H, ldy, S), "moe_combine"); break;
    default: set_error("moe_combine: unsupported output dtype"); return SAM_STATUS_UNSUPPORTED;
    }
    return launch_status("moe_combine");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_moe_route_cuda(const void *top_k_index, sam_dtype index_dtype, int64_t T, int64_t K,
                                         int64_t E, int32_t *offsets, int32_t *token_ids, int32_t *perm,
                                         int32_t *pos, float *scale, const void *weights, sam_dtype weights_dtype,
                                         void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t n = T * K;
    // warps * E counters must fit in 96 KB of shared memory; one CTA takes a warp per 64
    // pairs (the scan over warps per expert is serial: no more warps than pairs need)
    int warps = (int)std::min<int64_t>(32, std::max<int64_t>(1, (96 * 1024 / 4 - E - 1) / std::max<int64_t>(E, 1)));
    if (n <= 2 * sam::RB) warps = (int)std::min<int64_t>(warps, std::max<int64_t>(1, sam::ceil_div(n, 64)));
    if (E > 96 * 1024 / 4 / 2) {
        sam::set_error("moe_route: %lld experts is more than this kernel supports (12287)", (long long)E);
        return SAM_STATUS_UNSUPPORTED;
    }
    const size_t smem = sizeof(int32_t) * (size_t)(warps * E + E + 1);
    SAM_CUDA_TRY(cudaFuncSetAttribute(sam::route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "moe_route");
    if (n <= 2 * sam::RB) {  // one CTA
        SAM_CUDA_TRY(sam::launch_kernel(sam::route_kernel, dim3(1), dim3(warps * 32), smem, s, sam::pdl_enabled(),
                                        top_k_index, index_dtype, T, K, (int32_t)E, offsets, token_ids, perm, pos,
                                        0, (int32_t *)nullptr, (int64_t)0, scale, weights, weights_dtype),
                     "moe_route");
        return sam::launch_status("moe_route");
    }
    const int64_t rb = std::max(sam::RB, sam::ceil_div(n, sam::RB_BLOCKS)), B = sam::ceil_div(n, rb);
    // blocks of RB pairs: counts, scan, rows (a [B][E] scratch of this launch alone, stream-ordered)
    int32_t *blk = nullptr;
    SAM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void **>(&blk), sizeof(int32_t) * (size_t)(B * E), s), "moe_route");
    sam::route_kernel<<<(unsigned)B, warps * 32, smem, s>>>(top_k_index, index_dtype, T, K, (int32_t)E, offsets,
                                                            token_ids, perm, pos, 1, blk, rb, nullptr, nullptr,
                                                            weights_dtype);
    sam::route_scan_kernel<<<1, 1024, sizeof(int32_t) * (size_t)(E + 1), s>>>(blk, B, (int32_t)E, n, offsets,
                                                                              token_ids, perm, scale);
    sam::route_kernel<<<(unsigned)B, warps * 32, smem, s>>>(top_k_index, index_dtype, T, K, (int32_t)E, offsets,
                                                            token_ids, perm, pos, 2, blk, rb, scale, weights,
                                                            weights_dtype);
    const cudaError_t launched = cudaGetLastError();
    SAM_CUDA_TRY(cudaFreeAsync(blk, s), "moe_route");
    SAM_CUDA_TRY(launched, "moe_route");
    return sam::launch_status("moe_route");
}

extern "C" sam_status sam_moe_gather_weights_cuda(float *out, const void *w, sam_dtype wt, const int32_t *perm,
                                                  const int32_t *offsets, int64_t E, int64_t S, void *stream) {
    if (S == 0) return SAM_STATUS_OK;
    sam::gather_weights_kernel<<<(unsigned)sam::ceil_div(S, 256), 256, 0, (cudaStream_t)stream>>>(
        out, w, wt, perm, offsets, (int32_t)E, S);
    return sam::launch_status("moe_gather_weights");
}

namespace sam {
namespace {
// Rows [offsets[E], S) of out zeroed: 16-byte stores where rows and stride allow (vec), else
// bytes; a grid-stride loop over the tail's pieces (none in the common case: every pair routed).
__global__ void zero_unrouted_kernel(char *out, int64_t row_bytes, int64_t ld_bytes, const int32_t *offsets,
                                     int32_t E, int64_t S, bool vec) {
    const int64_t routed = max((int64_t)0, (int64_t)__ldg(offsets + E));
    if (routed >= S) return;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    if (vec) {
        const int64_t per = row_bytes / 16, n = (S - routed) * per;
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
            *reinterpret_cast<uint4 *>(out + (routed + i / per) * ld_bytes + 16 * (i % per)) = make_uint4(0, 0, 0, 0);
    } else {
        const int64_t n = (S - routed) * row_bytes;
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
            out[(routed + i / row_bytes) * ld_bytes + i % row_bytes] = 0;
    }
}
}  // namespace
}  // namespace sam

extern "C" sam_status sam_moe_zero_unrouted_cuda(void *out, int64_t row_bytes, int64_t ld_bytes,
                                                 const int32_t *offsets, int64_t E, int64_t S, void *stream) {
    if (S == 0 || row_bytes == 0) return SAM_STATUS_OK;
    const bool vec = row_bytes % 16 == 0 && ld_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    const int64_t pieces = S * (vec ? row_bytes / 16 : row_bytes);
    const unsigned blocks = (unsigned)std::min<int64_t>(sam::ceil_div(pieces, (int64_t)256), 1024);
    sam::zero_unrouted_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(static_cast<char *>(out), row_bytes,
                                                                         ld_bytes, offsets, (int32_t)E, S, vec);
    return sam::launch_status("moe_zero_unrouted");
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

extern "C" sam_status sam_moe_gather_rows_cuda(void *dst, const void *x, sam_dtype dtype, int64_t ldx, int64_t H,
                                               const int32_t *token_ids, const int32_t *offsets, int64_t E,
                                               int64_t S, void *stream) {
    using namespace sam;
    if (S == 0 || H == 0) return SAM_STATUS_OK;
    const int64_t bytes = dtype == SAM_F32 ? 4 : dtype == SAM_BF16 || dtype == SAM_F16 ? 2 : 0;
    if (bytes == 0) {
        set_error("moe_gather_rows: unsupported dtype");
        return SAM_STATUS_UNSUPPORTED;
    }
    const int rows_per_cta = 8;
    const dim3 grid((unsigned)ceil_div(S, rows_per_cta)), block(32 * rows_per_cta);
    cudaStream_t s = (cudaStream_t)stream;
    const bool pdl = pdl_enabled();
    const bool v16 = (H * bytes) % 16 == 0 && (ldx * bytes) % 16 == 0 &&
                     (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
    if (v16) {
        SAM_CUDA_TRY(launch_kernel(gather_rows_kernel<uint4>, grid, block, 0, s, pdl, (uint4 *)dst,
                                   (const uint4 *)x, ldx * bytes / 16, H * bytes / 16, token_ids, offsets,
                                   (int32_t)E, S),
                     "moe_gather_rows");
    } else if (bytes == 2) {
        SAM_CUDA_TRY(launch_kernel(gather_rows_kernel<uint16_t>, grid, block, 0, s, pdl, (uint16_t *)dst,
                                   (const uint16_t *)x, ldx, H, token_ids, offsets, (int32_t)E, S),
                     "moe_gather_rows");
    } else {
        SAM_CUDA_TRY(launch_kernel(gather_rows_kernel<uint32_t>, grid, block, 0, s, pdl, (uint32_t *)dst,
                                   (const uint32_t *)x, ldx, H, token_ids, offsets, (int32_t)E, S),
                     "moe_gather_rows");
    }
    return launch_status("moe_gather_rows");
}
