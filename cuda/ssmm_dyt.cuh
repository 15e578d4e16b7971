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

// dyt[r][c] for r < R and c < W: a CTA (256 threads) owns 32 columns and chunks of 512 rows
// (every gridDim.y-th); per chunk each thread an 8 x 8 block (columns c0 + 8 sb .., rows r0 + 8 rb ..): the 8 source rows' 16-byte pieces
// loaded (scaled in fp32 and rounded), transposed in registers with byte permutes, written
// as 8 16-byte pieces.  A warp reads 4 rows x 128 bytes and writes 8 rows x 64 bytes per
// instruction.  vec: dy's rows and R hold whole 16-byte pieces, else element by element.
template <typename T>
__global__ void __launch_bounds__(256) dyt_fill_kernel(const DytSrc p, int64_t R, int64_t W, T *dyt, bool vec) {
    __shared__ int64_t src_tok[32];  // dy's row behind column c0 + i (-1: zeros)
    __shared__ float src_sc[32];
    const int64_t c0 = (int64_t)blockIdx.x * 32;
    if (threadIdx.x < 32) {
        // through the expert whose segment holds the column: the last e with dyt_segment(e) <= col
        const int64_t col = c0 + threadIdx.x;
        int64_t tok = -1;
        float sc = 1.0f;
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
                    tok = t;
                    if (p.scale) sc = __ldg(p.scale + s);
                }
            }
        }
        src_tok[threadIdx.x] = tok;
        src_sc[threadIdx.x] = sc;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sb = lane & 3, rb = warp * 8 + (lane >> 2);
    const T *dy = static_cast<const T *>(p.dy);
    // row chunks blockIdx.y, + gridDim.y, ...: the columns' lookup above done once for several
    for (int64_t r0 = (int64_t)blockIdx.y * 512 + 8 * rb; r0 < R; r0 += (int64_t)gridDim.y * 512) {
        uint32_t a[8][4];  // a[i]: column c0 + 8 sb + i's elements r0 .. r0 + 7, in pairs
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int64_t t = src_tok[8 * sb + i];
            uint32_t w[4] = {0u, 0u, 0u, 0u};
            if (t >= 0) {
                const T *row = dy + t * p.lddy + r0;
                if (vec) {
                    const uint4 v = __ldg(reinterpret_cast<const uint4 *>(row));
                    w[0] = v.x;
                    w[1] = v.y;
                    w[2] = v.z;
                    w[3] = v.w;
                } else {
                    const unsigned short *r16 = reinterpret_cast<const unsigned short *>(row);
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const uint32_t lo = r0 + 2 * k < R ? __ldg(r16 + 2 * k) : 0u;
                        const uint32_t hi = r0 + 2 * k + 1 < R ? __ldg(r16 + 2 * k + 1) : 0u;
                        w[k] = lo | (hi << 16);
                    }
                }
                if (p.scale) {
                    const float sc = src_sc[8 * sb + i];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        float x, y;
                        unpack2<T>(w[k], x, y);
                        w[k] = Elem<T>::pack2(x * sc, y * sc);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < 4; k++) a[i][k] = w[k];
        }
        // row r0 + j of the copy: word m holds columns 2 m, 2 m + 1 = element j of a[2 m], a[2 m + 1]
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (r0 + j >= R) break;
            const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
            uint32_t b[4];
#pragma unroll
            for (int m = 0; m < 4; m++) b[m] = prmt(a[2 * m][j >> 1], a[2 * m + 1][j >> 1], sel);
            *reinterpret_cast<uint4 *>(dyt + (r0 + j) * W + c0 + 8 * sb) = make_uint4(b[0], b[1], b[2], b[3]);
        }
    }
}

// The copy in stream-ordered memory ((R + 1) x dyt_cols(S, E) elements of T: row R zeros),
// filled on the stream; null (the error cleared) where it cannot be allocated or the grid
// cannot be launched.  Freed by the caller with cudaFreeAsync on the same stream.
template <typename T> T *dyt_make(const DytSrc &src, int64_t R, cudaStream_t s, sam_status *st) {
    *st = SAM_STATUS_OK;
    const int64_t W = dyt_cols(src.S, src.E);
    void *buf = nullptr;
    if (R <= 0 || W <= 0 || R >= INT32_MAX || W / 32 >= INT32_MAX ||
        cudaMallocAsync(&buf, (size_t)((R + 1) * W) * sizeof(T), s) != cudaSuccess) {
        (void)cudaGetLastError();  // the failed allocation, if any
        return nullptr;
    }
    const bool vec = src.lddy % 8 == 0 && R % 8 == 0 && (reinterpret_cast<uintptr_t>(src.dy) & 15) == 0;
    T *dyt = static_cast<T *>(buf);
    if (cudaMemsetAsync(dyt + R * W, 0, (size_t)W * sizeof(T), s) != cudaSuccess) {
        *st = launch_status("dyt_fill");
        return dyt;
    }
    const int64_t chunks = (R + 511) / 512;  // of 512 rows; a CTA takes every 4th
    dyt_fill_kernel<T><<<dim3((unsigned)(W / 32), (unsigned)(chunks < 4 ? chunks : 4)), 256, 0, s>>>(src, R, W, dyt, vec);
    *st = launch_status("dyt_fill");
    return dyt;
}

}  // namespace
}  // namespace sam
