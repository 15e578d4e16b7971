// glu.cu -- a gated activation of two matrices, out = act(g, u) (the definition is
// sam_glu_ref in csrc/dense_ref.c).
//
// A dense MLP at prefill sizes runs its gate and up matmuls in a GEMM library; torch then
// reads both outputs twice (silu, then the product).  Here one pass: each thread takes 8
// columns of a row as one 16-byte load of g and of u and one 16-byte store (where I, the
// row strides and the pointers allow; else one element at a time), a grid-stride loop
// over rows x 8-column pieces.  Programmatic dependent launch: waits for the kernel
// before on the stream before reading, lets the next one start at once.
//
// Its backward (sam_glu_backward_ref in csrc/dense_ref.c; the formulas are in
// samoyeds_cuda.h), the training step's d pre-activation from d act: the same pass, each
// thread reading 8 columns of the gate, the up and dh (one or two 16-byte loads each) and
// writing 8 of dgate and of dup.  The fp32 operations are rounded one by one (no fused
// multiply-adds) in the order torch's elementwise backward takes, so that the two agree
// up to the final rounding.  Rows past offsets[E] (placeholder rows of an MoE's sorted
// rows, uninitialised) are written as zeros without reading them.
//
// With out_t (the gate_up weight gradient's transposed copy of dy, samoyeds_layout.h's
// sam_dyt_cols layout, what ssmm_dw's wgmma kernel reads) the routed rows go through
// glu_backward_t_kernel instead: built like dyt_fill16_kernel (ssmm_dyt.cuh), one CTA per 64
// columns of the copy (64 sorted rows of one expert), it computes the rows it loads and
// writes them twice, row-major to out and through a shared tile transposed to out_t; the rows
// outside [offsets[0], offsets[E]) are then the other kernels' (GluBackwardArgs::rest).
#include "common.cuh"
#include "ssmm_dyt.cuh"

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


// ---- glu_backward ----------------------------------------------------------------------

struct GluBackwardArgs {
    const void *dh;
    int64_t lddh;
    const void *pre;
    int64_t ldp;
    const float *scale;
    const int32_t *offsets;
    int64_t E;
    void *out;
    int64_t ldo, S, I;
    sam_act act;
    float alpha, limit;
    float *hdot;  // [S] or null: sum_i dh[s][i] * h[s][i] (glu_backward_rows_kernel)
    void *out_t;  // [2I + 1][ldt] or null (glu_backward_t_kernel)
    int64_t ldt;
    int64_t ich;  // glu_backward_t_kernel: columns of I per CTA (blockIdx.y), a multiple of 64
    float *hpart; // [gridDim.y][S] hdot partials where gridDim.y > 1 (summed by glu_hdot_sum_kernel)
    bool rest;    // only the rows outside [offsets[0], offsets[E]) (glu_backward_t_kernel has the others)
};

// The rows a kernel of this file takes: all S, or with rest those outside [offsets[0],
// offsets[E]) (clamped to [0, S]): row_of(j) for j < count.
struct GluRows {
    int64_t skip_lo, skip_n, count;
    __device__ GluRows(const GluBackwardArgs &p) : skip_lo(0), skip_n(0), count(p.S) {
        if (p.rest) {
            skip_lo = min(max((int64_t)p.offsets[0], (int64_t)0), p.S);
            skip_n = min(max((int64_t)p.offsets[p.E], skip_lo), p.S) - skip_lo;
            count = p.S - skip_n;
        }
    }
    __device__ int64_t row_of(int64_t j) const { return j < skip_lo ? j : j + skip_n; }
};

// W consecutive elements as fp32: W = 8 as 16-byte loads (one, two for fp32), W = 1 one element.
template <int W, typename T> __device__ __forceinline__ void load_cols(const T *p, float (&f)[W]) {
    if constexpr (W == 1) {
        f[0] = Elem<T>::to_f(*p);
    } else if constexpr (std::is_same<T, float>::value) {
        const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    } else {
        const uint4 v = *reinterpret_cast<const uint4 *>(p);
        const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] = Elem<T>::to_f(e[j]);
    }
}

template <int W, typename T> __device__ __forceinline__ void store_cols(T *p, const float (&f)[W]) {
    if constexpr (W == 1) {
        *p = Elem<T>::from_f(f[0]);
    } else if constexpr (std::is_same<T, float>::value) {
        reinterpret_cast<float4 *>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4 *>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
        uint4 v;
        uint32_t *w = reinterpret_cast<uint32_t *>(&v);
#pragma unroll
        for (int j = 0; j < 4; j++) w[j] = Elem<T>::pack2(f[2 * j], f[2 * j + 1]);
        *reinterpret_cast<uint4 *>(p) = v;
    }
}

// One gate/up pair, each operation rounded as torch's separate elementwise kernels round it
// (sigmoid: 1 / (1 + exp(-x)) with the accurate expf); the clamps keep a NaN.
__device__ __forceinline__ void glu_backward_pair(sam_act act, float alpha, float limit, float d, float g, float u,
                                                  float &dg, float &du) {
    if (act == SAM_ACT_SWIGLU) {
        const float sg = 1.0f / __fadd_rn(1.0f, expf(-g));
        dg = __fmul_rn(__fmul_rn(d, u), __fmul_rn(sg, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg)))));
        du = __fmul_rn(d, __fmul_rn(g, sg));
        return;
    }
    const float gc = g > limit ? limit : g;
    const float uc = u > limit ? limit : (u < -limit ? -limit : u);
    const float ag = __fmul_rn(alpha, gc);
    const float sg = 1.0f / __fadd_rn(1.0f, expf(-ag));
    dg = g <= limit ? __fmul_rn(__fmul_rn(d, __fadd_rn(uc, 1.0f)),
                                __fadd_rn(sg, __fmul_rn(__fmul_rn(ag, sg), __fsub_rn(1.0f, sg))))
                    : 0.0f;
    du = (u >= -limit && u <= limit) ? __fmul_rn(d, __fmul_rn(gc, sg)) : 0.0f;
}

template <typename T, typename TD, typename TO, int W>
__global__ void __launch_bounds__(256) glu_backward_kernel(const GluBackwardArgs p) {
    pdl_wait();
    pdl_trigger();
    // rows from `live` on are placeholders: written, never read
    const int64_t live = p.offsets != nullptr ? (int64_t)p.offsets[p.E] : p.S;
    const GluRows rows(p);
    const int64_t per = p.I / W;  // pieces of a row
    const int64_t n = rows.count * per;
    for (int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; id < n; id += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = id / per, s = rows.row_of(j), c = (id - j * per) * W;
        float dg[W], du[W];
        if (s < live) {
            float d[W], g[W], u[W];
            load_cols<W>(static_cast<const TD *>(p.dh) + s * p.lddh + c, d);
            load_cols<W>(static_cast<const T *>(p.pre) + s * p.ldp + c, g);
            load_cols<W>(static_cast<const T *>(p.pre) + s * p.ldp + p.I + c, u);
            const float sc = p.scale != nullptr ? p.scale[s] : 1.0f;
#pragma unroll
            for (int j = 0; j < W; j++)
                glu_backward_pair(p.act, p.alpha, p.limit, p.scale != nullptr ? __fmul_rn(d[j], sc) : d[j], g[j],
                                  u[j], dg[j], du[j]);
        } else {
#pragma unroll
            for (int j = 0; j < W; j++) dg[j] = du[j] = 0.0f;
        }
        TO *o = static_cast<TO *>(p.out) + s * p.ldo + c;
        store_cols<W>(o, dg);
        store_cols<W>(o + p.I, du);
    }
}

// The same, a warp per row, and the row's dot product of dh (before the scale) with the
// activation h = act(gate, up) rounded to T as glu writes it: each lane sums its pieces
// in column order, then the lanes' sums are added by a fixed shuffle tree (deterministic).
// It replaces a pass over two [S, I] fp32 copies in the backward (d routing weights).
template <typename T, typename TD, typename TO, int W>
__global__ void __launch_bounds__(256) glu_backward_rows_kernel(const GluBackwardArgs p) {
    pdl_wait();
    pdl_trigger();
    const int64_t live = p.offsets != nullptr ? (int64_t)p.offsets[p.E] : p.S;
    const GluRows rows(p);
    const int lane = threadIdx.x % 32;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t j = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; j < rows.count; j += warps) {
        const int64_t s = rows.row_of(j);
        float dot = 0.0f;
        TO *orow = static_cast<TO *>(p.out) + s * p.ldo;
        if (s >= live) {
            float z[W];
#pragma unroll
            for (int j = 0; j < W; j++) z[j] = 0.0f;
            for (int64_t c = (int64_t)lane * W; c < p.I; c += 32 * W) {
                store_cols<W>(orow + c, z);
                store_cols<W>(orow + p.I + c, z);
            }
        } else {
            const float sc = p.scale != nullptr ? p.scale[s] : 1.0f;
            for (int64_t c = (int64_t)lane * W; c < p.I; c += 32 * W) {
                float d[W], g[W], u[W], dg[W], du[W];
                load_cols<W>(static_cast<const TD *>(p.dh) + s * p.lddh + c, d);
                load_cols<W>(static_cast<const T *>(p.pre) + s * p.ldp + c, g);
                load_cols<W>(static_cast<const T *>(p.pre) + s * p.ldp + p.I + c, u);
#pragma unroll
                for (int j = 0; j < W; j++) {
                    const float h = Elem<T>::to_f(Elem<T>::from_f(gated_act(p.act, p.alpha, p.limit, g[j], u[j])));
                    dot = __fadd_rn(dot, __fmul_rn(d[j], h));
                    glu_backward_pair(p.act, p.alpha, p.limit, p.scale != nullptr ? __fmul_rn(d[j], sc) : d[j], g[j],
                                      u[j], dg[j], du[j]);
                }
                store_cols<W>(orow + c, dg);
                store_cols<W>(orow + p.I + c, du);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
        if (lane == 0) p.hdot[s] = dot;
    }
}

// The routed rows with out_t: one CTA per 64 columns of the copy (64 consecutive sorted rows
// of one expert, or zero columns), looping over I in 64-column steps.  Thread (m, pc) takes
// the row pair 2m, 2m + 1 and the 8 columns 8 pc of the step (dyt_fill16_kernel's mapping):
// it loads dh, gate and up of both rows (16-byte pieces where VEC, else element by element),
// computes them as glu_backward_rows_kernel does, stores dgate and dup row-major, and puts
// the element pairs of the two rows, rounded to T, in a shared [gate | up][64][33]-word tile;
// then the tile's rows go out as 16-byte pieces of out_t's rows i and I + i.  hdot: each
// thread sums its columns of a row in column order, then the 8 threads of a row are added
// in piece order (deterministic; not the rows kernel's order).  Where the grid splits I
// (blockIdx.y: ich columns each, so that a few long experts still fill the GPU), those sums
// go to hpart and glu_hdot_sum_kernel adds them in blockIdx.y order.  The CTAs of
// blockIdx.y = 0 also write their 64 columns of out_t's last row (zeros).
template <typename T, typename TD, typename TO, bool VEC>
__global__ void __launch_bounds__(256) glu_backward_t_kernel(const GluBackwardArgs p) {
    pdl_wait();
    pdl_trigger();
    __shared__ uint32_t tile[2 * 64 * 33];
    __shared__ int64_t src_row[64];
    __shared__ float src_sc[64];
    __shared__ float part[8][64];
    __shared__ int blk_e;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c0 = (int64_t)blockIdx.x * 64, W = p.ldt, I = p.I;
    const DytSrc src{nullptr, 0, nullptr, p.S, nullptr, p.offsets, p.S, (int)p.E};
    if (warp == 0) {
        const int e = dyt_block_expert(src, c0, lane);
        if (lane == 0) blk_e = e;
    }
    __syncthreads();
    if (threadIdx.x < 64) {
        int64_t s = -1, t;
        if (!dyt_source(src, blk_e, c0 + threadIdx.x, s, t)) s = -1;
        src_row[threadIdx.x] = s;
        src_sc[threadIdx.x] = (s >= 0 && p.scale != nullptr) ? p.scale[s] : 1.0f;
    }
    if (threadIdx.x < 8 && blockIdx.y == 0)
        *reinterpret_cast<uint4 *>(static_cast<T *>(p.out_t) + 2 * I * W + c0 + 8 * threadIdx.x) = make_uint4(0, 0, 0, 0);
    __syncthreads();
    const int m = 8 * (warp & 3) + (lane & 7), pc = 4 * (warp >> 2) + (lane >> 3);
    const int64_t srow[2] = {src_row[2 * m], src_row[2 * m + 1]};
    const float ssc[2] = {src_sc[2 * m], src_sc[2 * m + 1]};
    float dot[2] = {0.0f, 0.0f};
    const int q = lane & 7, rl0 = 4 * warp + (lane >> 3);
    const TD *dh = static_cast<const TD *>(p.dh);
    const T *pre = static_cast<const T *>(p.pre);
    T *out_t = static_cast<T *>(p.out_t);
    const int64_t ibeg = (int64_t)blockIdx.y * p.ich, iend = min(I, ibeg + p.ich);
    for (int64_t i0 = ibeg; i0 < iend; i0 += 64) {
        const int64_t i = i0 + 8 * pc;
        float d[2][8], g[2][8], u[2][8];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int64_t s = srow[r];
#pragma unroll
            for (int j = 0; j < 8; j++) d[r][j] = g[r][j] = u[r][j] = 0.0f;
            if (s < 0 || i >= I) continue;
            if (VEC) {
                load_cols<8>(dh + s * p.lddh + i, d[r]);
                load_cols<8>(pre + s * p.ldp + i, g[r]);
                load_cols<8>(pre + s * p.ldp + I + i, u[r]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (i + j >= I) break;
                    d[r][j] = Elem<TD>::to_f(dh[s * p.lddh + i + j]);
                    g[r][j] = Elem<T>::to_f(pre[s * p.ldp + i + j]);
                    u[r][j] = Elem<T>::to_f(pre[s * p.ldp + I + i + j]);
                }
            }
        }
        float dg[2][8], du[2][8];
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int j = 0; j < 8; j++) dg[r][j] = du[r][j] = 0.0f;
            if (srow[r] < 0 || i >= I) continue;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (!VEC && i + j >= I) break;
                if (p.hdot != nullptr) {
                    const float h = Elem<T>::to_f(Elem<T>::from_f(gated_act(p.act, p.alpha, p.limit, g[r][j], u[r][j])));
                    dot[r] = __fadd_rn(dot[r], __fmul_rn(d[r][j], h));
                }
                glu_backward_pair(p.act, p.alpha, p.limit, p.scale != nullptr ? __fmul_rn(d[r][j], ssc[r]) : d[r][j],
                                  g[r][j], u[r][j], dg[r][j], du[r][j]);
            }
            TO *o = static_cast<TO *>(p.out) + srow[r] * p.ldo + i;
            if (VEC) {
                store_cols<8>(o, dg[r]);
                store_cols<8>(o + I, du[r]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (i + j >= I) break;
                    o[j] = Elem<TO>::from_f(dg[r][j]);
                    o[I + j] = Elem<TO>::from_f(du[r][j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            tile[(8 * pc + j) * 33 + m] = Elem<T>::pack2(dg[0][j], dg[1][j]);
            tile[64 * 33 + (8 * pc + j) * 33 + m] = Elem<T>::pack2(du[0][j], du[1][j]);
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const int rl = rl0 + 32 * h, half = rl >> 6, rr = rl & 63;  // gate rows, then up rows
            if (i0 + rr < I) {
                const uint32_t *t = tile + half * 64 * 33 + rr * 33 + 4 * q;
                *reinterpret_cast<uint4 *>(out_t + (half * I + i0 + rr) * W + c0 + 8 * q) =
                    make_uint4(t[0], t[1], t[2], t[3]);
            }
        }
        __syncthreads();
    }
    if (p.hdot != nullptr) {
        part[pc][2 * m] = dot[0];
        part[pc][2 * m + 1] = dot[1];
        __syncthreads();
        if (threadIdx.x < 64 && src_row[threadIdx.x] >= 0) {
            float t = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) t = __fadd_rn(t, part[k][threadIdx.x]);
            if (gridDim.y == 1) p.hdot[src_row[threadIdx.x]] = t;
            else p.hpart[(int64_t)blockIdx.y * p.S + src_row[threadIdx.x]] = t;
        }
    }
}

// hdot[s] for the routed rows s in [offsets[0], offsets[E]) (clamped to [0, S]): the ny
// partials of glu_backward_t_kernel's column blocks, added in block order.
__global__ void __launch_bounds__(256) glu_hdot_sum_kernel(const GluBackwardArgs p, int ny) {
    pdl_wait();
    pdl_trigger();
    const int64_t lo = min(max((int64_t)p.offsets[0], (int64_t)0), p.S);
    const int64_t hi = min(max((int64_t)p.offsets[p.E], lo), p.S);
    for (int64_t s = lo + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s < hi; s += (int64_t)gridDim.x * blockDim.x) {
        float t = 0.0f;
        for (int y = 0; y < ny; y++) t = __fadd_rn(t, p.hpart[(int64_t)y * p.S + s]);
        p.hdot[s] = t;
    }
}

template <typename T, typename TD, typename TO>
sam_status glu_backward_launch(GluBackwardArgs a, bool vec, cudaStream_t stream) {
    const int sms = device_sm_count() > 0 ? device_sm_count() : 132;
    if (a.out_t != nullptr) {
        if constexpr (sizeof(T) == 2) {
            // the routed rows and out_t, then (below) the rows outside [offsets[0], offsets[E])
            const int64_t nb = a.ldt / 64;
            if (nb > INT32_MAX) {
                set_error("glu_backward: out_t too wide for one launch (%lld columns)", (long long)a.ldt);
                return SAM_STATUS_UNSUPPORTED;
            }
            // I split over ny CTAs per 64 columns where the columns alone give fewer than ~8 CTAs an SM
            const int64_t isteps = (a.I + 63) / 64;
            int64_t ny = std::min<int64_t>(isteps, std::max<int64_t>(1, (8 * (int64_t)sms + nb - 1) / std::max<int64_t>(nb, 1)));
            a.ich = 64 * ((isteps + ny - 1) / ny);
            ny = (a.I + a.ich - 1) / a.ich;
            a.hpart = nullptr;
            if (ny > 1 && a.hdot != nullptr &&
                cudaMallocAsync(reinterpret_cast<void **>(&a.hpart), (size_t)(ny * a.S) * sizeof(float), stream) !=
                    cudaSuccess) {
                (void)cudaGetLastError();  // no room for the partials: one CTA per 64 columns, all of I
                a.hpart = nullptr;
                ny = 1;
                a.ich = 64 * isteps;
            }
            void (*tk)(const GluBackwardArgs) =
                vec ? glu_backward_t_kernel<T, TD, TO, true> : glu_backward_t_kernel<T, TD, TO, false>;
            cudaError_t err = launch_kernel(tk, dim3((unsigned)nb, (unsigned)ny), dim3(256), 0, stream, pdl_enabled(), a);
            if (err == cudaSuccess && a.hpart != nullptr) {
                const unsigned g = (unsigned)std::min<int64_t>((a.S + 255) / 256, (int64_t)sms * 4);
                err = launch_kernel(glu_hdot_sum_kernel, dim3(g), dim3(256), 0, stream, pdl_enabled(), a, (int)ny);
            }
            if (a.hpart != nullptr) cudaFreeAsync(a.hpart, stream);  // (stream-ordered: after the kernels)
            if (err != cudaSuccess) return cuda_status(err, "glu_backward");
            a.rest = true;
        } else {
            set_error("glu_backward: out_t on the GPU takes a bfloat16 or float16 pre-activation");
            return SAM_STATUS_UNSUPPORTED;
        }
    }
    const bool rows = a.hdot != nullptr;  // a warp per row, 8 rows a CTA
    void (*kernel)(const GluBackwardArgs) =
        rows ? (vec ? glu_backward_rows_kernel<T, TD, TO, 8> : glu_backward_rows_kernel<T, TD, TO, 1>)
             : (vec ? glu_backward_kernel<T, TD, TO, 8> : glu_backward_kernel<T, TD, TO, 1>);
    const int64_t threads = rows ? a.S * 32 : a.S * (vec ? a.I / 8 : a.I);
    const unsigned grid = (unsigned)std::min<int64_t>((threads + 255) / 256, (int64_t)sms * 8);
    SAM_CUDA_TRY(launch_kernel(kernel, dim3(grid), dim3(256), 0, stream, pdl_enabled(), a), "glu_backward");
    return launch_status("glu_backward");
}

// f(T{}) for T the element type of a float dtype (bfloat16, float16, float32).
template <typename F> sam_status with_float_dtype(sam_dtype dt, F &&f) {
    switch (dt) {
    case SAM_BF16: return f(__nv_bfloat16());
    case SAM_F16: return f(__half());
    case SAM_F32: return f(float());
    default: set_error("glu_backward: the GPU kernel takes bfloat16, float16 or float32"); return SAM_STATUS_UNSUPPORTED;
    }
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

extern "C" sam_status sam_glu_backward_cuda(const sam_glu_backward_params *p, void *stream) {
    using namespace sam;
    if (p->act != SAM_ACT_SWIGLU && p->act != SAM_ACT_GPTOSS) {
        set_error("glu_backward: act %d is not a gated activation", (int)p->act);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->S < 0 || p->I < 0 || (p->offsets != NULL && p->E < 1)) {
        set_error("glu_backward: sizes S = %lld, I = %lld, E = %lld out of range", (long long)p->S, (long long)p->I,
                  (long long)p->E);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if ((p->dh_dtype != SAM_F32 && p->dh_dtype != p->dtype) || (p->out_dtype != SAM_F32 && p->out_dtype != p->dtype)) {
        set_error("glu_backward: dh and out take float32 or the pre-activation's dtype");
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->out_t != NULL && p->dtype == SAM_F32) {
        set_error("glu_backward: out_t on the GPU takes a bfloat16 or float16 pre-activation (ssmm_dw's dtypes)");
        return SAM_STATUS_UNSUPPORTED;
    }
    if (p->S == 0 || p->I == 0) {  // out_t: only its zeros
        if (p->out_t != NULL && p->E > 0) {
            const size_t bytes = (size_t)((2 * p->I + 1) * sam_dyt_cols(p->S, p->E)) * 2;
            SAM_CUDA_TRY(cudaMemsetAsync(p->out_t, 0, bytes, (cudaStream_t)stream), "glu_backward");
        }
        return SAM_STATUS_OK;
    }
    GluBackwardArgs a;
    a.dh = p->dh;
    a.lddh = p->lddh;
    a.pre = p->pre;
    a.ldp = p->ldp;
    a.scale = p->scale;
    a.offsets = p->offsets;
    a.E = p->E;
    a.out = p->out;
    a.ldo = p->ldo;
    a.S = p->S;
    a.I = p->I;
    a.act = p->act;
    a.alpha = p->alpha;
    a.limit = p->limit;
    a.hdot = p->hdot;
    a.out_t = p->out_t;
    a.ldt = p->out_t != NULL ? sam_dyt_cols(p->S, p->E) : 0;
    a.rest = false;
    a.ich = 0;
    a.hpart = nullptr;
    const uintptr_t mis = (reinterpret_cast<uintptr_t>(p->dh) | reinterpret_cast<uintptr_t>(p->pre) |
                           reinterpret_cast<uintptr_t>(p->out)) & 15u;
    const bool vec = mis == 0 && p->I % 8 == 0 && p->lddh % 8 == 0 && p->ldp % 8 == 0 && p->ldo % 8 == 0;
    cudaStream_t s = (cudaStream_t)stream;
    const bool dh32 = p->dh_dtype == SAM_F32, out32 = p->out_dtype == SAM_F32;
    return with_float_dtype(p->dtype, [&](auto t) {
        using T = decltype(t);
        if (dh32 && out32) return glu_backward_launch<T, float, float>(a, vec, s);
        if (dh32) return glu_backward_launch<T, float, T>(a, vec, s);
        if (out32) return glu_backward_launch<T, T, float>(a, vec, s);
        return glu_backward_launch<T, T, T>(a, vec, s);
    });
}
