// dense_decode.cu -- dense weights at a few tokens: out = act(x @ W^T), bound by
// reading W once (the definition is csrc/dense_ref.c).
//
// A block's unpruned shared experts at decode sizes read 3 x I x H weights for a handful
// of tokens: a GEMM library tiles that as a GEMM and streams the weights at about half
// the copy rate, then the gate, up, activation and product are separate launches.
// Here one launch reads the gate and up rows together and applies the activation, and
// its loads are shaped for bandwidth:
//
//   * CTA = 8 warps on 16 output rows (gated: the 16 gate rows and the 16 up rows of
//     them) and every token, in passes of BN = 8 * NT tokens; grid = ceil(R / 16).
//   * The K dimension is split over the warps: warp w takes the column blocks w, w + 8,
//     w + 16, ... of BK = 32 * U columns, so that the eight warps stream 8 * BK
//     contiguous columns of each row together.
//   * No shared memory in the loop: lane (g, q) loads 16 bytes of row g and of row
//     g + 8 at column 8q of every 32-column piece straight into registers, and the same
//     16 bytes of token g.  Read in that order, the pieces are the fragments of two
//     mma.sync m16n8k16: the dot products run over a permutation of K (logical column
//     pair 2q + 8h of step s is physical pair 8q + 4s + 2h), the same for both operands,
//     so the sums are those of W x.  Two blocks of loads in flight per warp (register
//     double buffering); the weights bypass L1 (read once).
//   * The eight partial tiles are summed through shared memory in warp order 0..7
//     (deterministic, no atomics), then the activation and one rounding to T.
//
// Programmatic dependent launch (sm_90): the kernel waits for the kernel before it on the
// stream before it reads x or writes out; with weights_ready it requests its first
// weight blocks before that wait, so the down projection's weights stream while the
// gate/up kernel ends.
//
// Invariants (checked by the launcher): C % 8 == 0, ldx % 8 == 0, x, w, up 16-byte
// aligned.  Rows past R, tokens past T and columns past C load zeros and store nothing.
#include "common.cuh"
#include "ptx_mma.cuh"

namespace sam {
namespace {

constexpr int DD_WARPS = 8, DD_THREADS = 32 * DD_WARPS;

// 16 bytes of a weight row: read once, not kept in L1.
__device__ __forceinline__ uint4 ld_weights(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// 16 bytes of a token row (read by every CTA: kept in L1/L2).  x may be written by the
// kernel before this one: a plain (coherent) load, issued after pdl_wait().
__device__ __forceinline__ uint4 ld_tokens(const void *p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

struct DenseArgs {
    const void *x;
    int64_t ldx;
    int T;
    const void *w[2];  // gate (or the only) rows, up rows
    int R, C;
    sam_act act;
    float alpha, limit;
    void *out;
    int64_t ldo;
    int weights_ready;
};

// MW: weight matrices (1, or 2 for gate + up); NT: n8 token tiles per pass; U: 32-column
// pieces per block (the registers of one block: 4 x U x (2 MW + NT) per thread).
template <int MW_, int NT_, int U_> struct DDCfg {
    static constexpr int MW = MW_, NT = NT_, U = U_;
    static constexpr int BN = 8 * NT, BK = 32 * U;
};

template <typename Cf> struct DDBlock {
    uint4 a[Cf::MW][2][Cf::U];  // rows g, g + 8
    uint4 b[Cf::NT][Cf::U];     // token g of each n8 tile
};

template <typename Cf>
__device__ __forceinline__ void dd_load_weights(DDBlock<Cf> &bl, const DenseArgs &p, int r0, int blk, int g, int q) {
#pragma unroll
    for (int u = 0; u < Cf::U; u++) {
        const int col = blk * Cf::BK + 32 * u + 8 * q;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r0 + g + 8 * h;
            const bool ok = row < p.R && col < p.C;
#pragma unroll
            for (int m = 0; m < Cf::MW; m++) {
                const char *src = static_cast<const char *>(p.w[m]) + ((int64_t)row * p.C + col) * 2;
                bl.a[m][h][u] = ok ? ld_weights(src) : make_uint4(0, 0, 0, 0);
            }
        }
    }
}

template <typename Cf>
__device__ __forceinline__ void dd_load_tokens(DDBlock<Cf> &bl, const DenseArgs &p, int t0, int blk, int g, int q) {
#pragma unroll
    for (int u = 0; u < Cf::U; u++) {
        const int col = blk * Cf::BK + 32 * u + 8 * q;
#pragma unroll
        for (int j = 0; j < Cf::NT; j++) {
            const int t = t0 + 8 * j + g;
            const char *src = static_cast<const char *>(p.x) + ((int64_t)t * p.ldx + col) * 2;
            bl.b[j][u] = t < p.T && col < p.C ? ld_tokens(src) : make_uint4(0, 0, 0, 0);
        }
    }
}

template <typename T, typename Cf>
__device__ __forceinline__ void dd_compute(const DDBlock<Cf> &bl, float (&acc)[Cf::MW][Cf::NT][4]) {
#pragma unroll
    for (int u = 0; u < Cf::U; u++) {
#pragma unroll
        for (int s = 0; s < 2; s++) {
#pragma unroll
            for (int m = 0; m < Cf::MW; m++) {
                const uint4 &lo = bl.a[m][0][u], &hi = bl.a[m][1][u];
                const uint32_t a0 = s ? lo.z : lo.x, a1 = s ? hi.z : hi.x;
                const uint32_t a2 = s ? lo.w : lo.y, a3 = s ? hi.w : hi.y;
#pragma unroll
                for (int j = 0; j < Cf::NT; j++) {
                    const uint4 &bb = bl.b[j][u];
                    Mma16816<T>::run(acc[m][j], a0, a1, a2, a3, s ? bb.z : bb.x, s ? bb.w : bb.y);
                }
            }
        }
    }
}

template <typename T, typename Cf>
__global__ void __launch_bounds__(DD_THREADS, 2) dense_decode_kernel(const DenseArgs p) {
    constexpr int MW = Cf::MW, NT = Cf::NT, BN = Cf::BN, W = DD_WARPS;
    __shared__ float red[W][MW][16][BN + 1];  // + 1: the epilogue's 16 rows on distinct banks
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int r0 = blockIdx.x * 16;
    const int nblk = (p.C + Cf::BK - 1) / Cf::BK;
    DDBlock<Cf> b0, b1;
    // the first block's weights before the wait where nothing before may still write them
    bool loaded = p.weights_ready && warp < nblk;
    if (loaded) dd_load_weights(b0, p, r0, warp, g, q);
    pdl_wait();
    pdl_trigger();
#pragma unroll 1
    for (int t0 = 0; t0 < p.T; t0 += BN) {
        float acc[MW][NT][4];
#pragma unroll
        for (int m = 0; m < MW; m++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[m][j][k] = 0.0f;
        if (warp < nblk) {
            if (!loaded) dd_load_weights(b0, p, r0, warp, g, q);
            dd_load_tokens(b0, p, t0, warp, g, q);
        }
        loaded = false;
        // two blocks in flight: load block k + W while block k multiplies
#pragma unroll 1
        for (int blk = warp; blk < nblk;) {
            int nx = blk + W;
            if (nx < nblk) {
                dd_load_weights(b1, p, r0, nx, g, q);
                dd_load_tokens(b1, p, t0, nx, g, q);
            }
            dd_compute<T, Cf>(b0, acc);
            blk = nx;
            if (blk >= nblk) break;
            nx = blk + W;
            if (nx < nblk) {
                dd_load_weights(b0, p, r0, nx, g, q);
                dd_load_tokens(b0, p, t0, nx, g, q);
            }
            dd_compute<T, Cf>(b1, acc);
            blk = nx;
        }
        // the warp's partial tile: rows g, g + 8; tokens 8j + 2q, + 1
#pragma unroll
        for (int m = 0; m < MW; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                red[warp][m][g][8 * j + 2 * q] = acc[m][j][0];
                red[warp][m][g][8 * j + 2 * q + 1] = acc[m][j][1];
                red[warp][m][g + 8][8 * j + 2 * q] = acc[m][j][2];
                red[warp][m][g + 8][8 * j + 2 * q + 1] = acc[m][j][3];
            }
        __syncthreads();
        T *out = static_cast<T *>(p.out);
        for (int id = tid; id < 16 * BN; id += DD_THREADS) {
            const int row = id & 15, tok = id >> 4;
            const int r = r0 + row, t = t0 + tok;
            if (r >= p.R || t >= p.T) continue;
            float v = 0.0f, u = 0.0f;
#pragma unroll
            for (int w = 0; w < W; w++) {
                v += red[w][0][row][tok];
                if (MW == 2) u += red[w][MW - 1][row][tok];
            }
            out[(int64_t)t * p.ldo + r] = Elem<T>::from_f(MW == 2 ? gated_act(p.act, p.alpha, p.limit, v, u) : v);
        }
        __syncthreads();  // the next pass rewrites red
    }
}

template <typename T, int MW, int NT> sam_status dd_launch(const DenseArgs &a, cudaStream_t stream) {
    // one block's registers (4 U (2 MW + NT) per thread) at most 48: two in flight and the
    // accumulators fit the 128 of two CTAs per SM without spilling
    constexpr int PER = 4 * (2 * MW + NT);
    constexpr int U = 4 * PER <= 48 ? 4 : 2 * PER <= 48 ? 2 : 1;
    using Cf = DDCfg<MW, NT, U>;
    const unsigned grid = (unsigned)((a.R + 15) / 16);
    SAM_CUDA_TRY(launch_kernel(dense_decode_kernel<T, Cf>, dim3(grid), dim3(DD_THREADS), 0, stream, pdl_enabled(), a),
                 "dense_decode");
    return launch_status("dense_decode");
}

template <typename T, int MW> sam_status dd_launch_t(const DenseArgs &a, cudaStream_t stream) {
    if (a.T <= 8) return dd_launch<T, MW, 1>(a, stream);
    if (a.T <= 16) return dd_launch<T, MW, 2>(a, stream);
    return dd_launch<T, MW, 4>(a, stream);
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_dense_decode_cuda(const sam_dense_params *p, void *stream) {
    using namespace sam;
    if (!tc_dtype_ok(p->dtype, "dense_decode")) return SAM_STATUS_UNSUPPORTED;
    if (p->T < 0 || p->R < 0 || p->C < 0 || p->T > INT32_MAX || p->R > INT32_MAX - 16 || p->C > INT32_MAX - 512) {
        set_error("dense_decode: sizes T = %lld, R = %lld, C = %lld out of range", (long long)p->T, (long long)p->R,
                  (long long)p->C);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const bool gated = p->act != SAM_ACT_NONE;
    if (p->act < SAM_ACT_NONE || p->act > SAM_ACT_GPTOSS || (gated && p->up == nullptr && p->R > 0 && p->C > 0)) {
        set_error("dense_decode: act %d needs %s", (int)p->act, gated ? "the up rows" : "a known activation");
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const uintptr_t mis = (reinterpret_cast<uintptr_t>(p->x) | reinterpret_cast<uintptr_t>(p->w) |
                           (gated ? reinterpret_cast<uintptr_t>(p->up) : 0)) & 15u;
    if (p->C % 8 != 0 || p->ldx % 8 != 0 || mis != 0) {
        set_error("dense_decode: the GPU kernel needs C and x's row stride multiples of 8 and x, w, up at "
                  "16-byte aligned addresses (C = %lld, ldx = %lld)", (long long)p->C, (long long)p->ldx);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->T == 0 || p->R == 0) return SAM_STATUS_OK;
    DenseArgs a;
    a.x = p->x;
    a.ldx = p->ldx;
    a.T = (int)p->T;
    a.w[0] = p->w;
    a.w[1] = gated ? p->up : p->w;
    a.R = (int)p->R;
    a.C = (int)p->C;
    a.act = p->act;
    a.alpha = p->alpha;
    a.limit = p->limit;
    a.out = p->out;
    a.ldo = p->ldo;
    a.weights_ready = p->weights_ready && pdl_enabled();
    cudaStream_t s = (cudaStream_t)stream;
    return with_tc_dtype(p->dtype, [&](auto t) {
        using T = decltype(t);
        return gated ? dd_launch_t<T, 2>(a, s) : dd_launch_t<T, 1>(a, s);
    });
}
