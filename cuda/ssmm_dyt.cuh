// ssmm_dyt.cuh -- dy transposed, per expert segment: what the wgmma kernels of ssmm_dw
// (ssmm_dw_wgmma.cu) and ssmm_dx (ssmm_dx_wgmma.cu) read their kept rows of dy from.  Row r
// of the copy holds, for every sorted row s of expert e, dy's element r of s's source row
// (dy[s], or dy[token_ids[s]]) at column dyt_segment(e) + s - offsets[e], optionally scaled
// by scale[s] and rounded; zeros between the segments.  A kept row of a slice is then one
// run of contiguous tokens, copied in 16-byte pieces without candidates or permutes.
#pragma once

#include "common.cuh"
#include "ssmm_dw.cuh"

namespace sam {

// The source of a copy.
struct DytSrc {
    const void *dy;
    int64_t lddy;
    const int32_t *token_ids;  // null: sorted row s reads dy[s]
    int64_t T;                 // rows of dy (a token id outside [0, T) reads as a zero row)
    const float *scale;        // null: unscaled
    const int32_t *offsets;
    int64_t S;
    int E;
};

namespace {

// Where expert e's sorted rows start among the columns of the copy: every expert's segment
// begins on a multiple of 64 columns (a k-tile of 64 tokens, 128 bytes: 128-byte aligned runs)
// and is followed by zeros up to at least the next multiple of 64 past its rows
// (seg(e + 1) - seg(e) >= n_e + 1, both multiples of 64), so a k-tile of 64 tokens from the
// segment's start never reaches the next expert: past the expert's rows it reads zeros.  The
// copy has dyt_cols(S, E) = round_up64(S + 64 E) columns, and one more row than dy has
// columns, all zeros (dyt_make): the row a storage row without a kept row reads.
__device__ __forceinline__ int64_t dyt_segment(const int32_t *offsets, int e) {
    return (max((int64_t)0, (int64_t)__ldg(offsets + e)) + 64 * (int64_t)e + 63) / 64 * 64;
}
inline int64_t dyt_cols(int64_t S, int E) { return (S + 64 * (int64_t)E + 63) / 64 * 64; }

// dyt[r][c] for r < R and c < W: 64 x 64 tiles through shared memory, 256 threads: each warp
// reads 8 rows of dy (2 elements a lane, 128 bytes a row) and writes 8 rows of dyt the same
// way; vec: dy's rows and R hold whole element pairs (4-byte loads), else element by element.
template <typename T>
__global__ void __launch_bounds__(256) dyt_fill_kernel(const DytSrc p, int64_t R, int64_t W, T *dyt, bool vec) {
    __shared__ uint16_t tile[64][66];
    __shared__ int64_t src_row[64], src_tok[64];  // sorted row (-1: none) and its row of dy
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c0 = (int64_t)blockIdx.x * 64, r0 = (int64_t)blockIdx.y * 64;
    if (threadIdx.x < 64) {
        // the row of dy behind column c0 + t (-1: padding or an invalid token), through the
        // expert whose segment holds it: the last e with dyt_segment(e) <= c
        const int64_t col = c0 + threadIdx.x;
        int64_t src = -1, tok = 0;
        if (p.E > 0 && col < W) {
            int lo = 0, hi = p.E - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (dyt_segment(p.offsets, mid) <= col) lo = mid; else hi = mid - 1;
            }
            const int64_t i = col - dyt_segment(p.offsets, lo);
            const int64_t sb = max((int64_t)0, (int64_t)__ldg(p.offsets + lo));
            const int64_t se = min((int64_t)__ldg(p.offsets + lo + 1), p.S);
            if (i >= 0 && sb + i < se) {
                const int64_t s = sb + i;
                const int64_t t = p.token_ids ? (int64_t)__ldg(p.token_ids + s) : s;
                if (t >= 0 && t < p.T) {
                    src = s;
                    tok = t;
                }
            }
        }
        src_row[threadIdx.x] = src;
        src_tok[threadIdx.x] = tok;
    }
    __syncthreads();
    const T *dy = static_cast<const T *>(p.dy);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int cl = warp + 8 * j;  // the tile's column (a sorted row)
        const int64_t s = src_row[cl];
        const int64_t r = r0 + 2 * lane;
        float a = 0.0f, b = 0.0f;
        if (s >= 0) {
            const T *row = dy + src_tok[cl] * p.lddy + r;
            if (vec && r + 1 < R) {
                const uint32_t w = __ldg(reinterpret_cast<const unsigned int *>(row));
                unpack2<T>(w, a, b);
            } else {
                if (r < R) a = Elem<T>::to_f(row[0]);
                if (r + 1 < R) b = Elem<T>::to_f(row[1]);
            }
            if (p.scale) {
                const float sc = __ldg(p.scale + s);
                a *= sc;
                b *= sc;
            }
        }
        const uint32_t w = Elem<T>::pack2(a, b);
        tile[cl][2 * lane] = (uint16_t)(w & 0xffffu);
        tile[cl][2 * lane + 1] = (uint16_t)(w >> 16);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int rl = warp + 8 * j;
        const int64_t r = r0 + rl, col = c0 + 2 * lane;
        if (r >= R || col >= W) continue;
        const uint32_t w = (uint32_t)tile[2 * lane][rl] | ((uint32_t)tile[2 * lane + 1][rl] << 16);
        *reinterpret_cast<uint32_t *>(dyt + r * W + col) = w;  // W % 8 == 0: col + 1 < W
    }
}

// The copy in stream-ordered memory ((R + 1) x dyt_cols(S, E) elements of T: row R zeros),
// filled on the stream; null (the error cleared) where it cannot be allocated or the grid
// cannot be launched.  Freed by the caller with cudaFreeAsync on the same stream.
template <typename T> T *dyt_make(const DytSrc &src, int64_t R, cudaStream_t s, sam_status *st) {
    *st = SAM_STATUS_OK;
    const int64_t W = dyt_cols(src.S, src.E);
    void *buf = nullptr;
    if (R <= 0 || W <= 0 || R >= INT32_MAX || W / 64 >= INT32_MAX || (R + 63) / 64 > 65535 ||
        cudaMallocAsync(&buf, (size_t)((R + 1) * W) * sizeof(T), s) != cudaSuccess) {
        (void)cudaGetLastError();  // the failed allocation, if any
        return nullptr;
    }
    const bool vec = src.lddy % 2 == 0 && R % 2 == 0 && (reinterpret_cast<uintptr_t>(src.dy) & 3) == 0;
    T *dyt = static_cast<T *>(buf);
    if (cudaMemsetAsync(dyt + R * W, 0, (size_t)W * sizeof(T), s) != cudaSuccess) {
        *st = launch_status("dyt_fill");
        return dyt;
    }
    dyt_fill_kernel<T><<<dim3((unsigned)(W / 64), (unsigned)((R + 63) / 64)), 256, 0, s>>>(src, R, W, dyt, vec);
    *st = launch_status("dyt_fill");
    return dyt;
}

}  // namespace
}  // namespace sam
