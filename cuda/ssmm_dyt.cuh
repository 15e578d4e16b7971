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
// (samoyeds_layout.h: sam_dyt_segment, sam_dyt_cols, the one definition)
__device__ __forceinline__ int64_t dyt_segment(const int32_t *offsets, int e) {
    return sam_dyt_segment((int64_t)__ldg(offsets + e), e);
}
inline int64_t dyt_cols(int64_t S, int E) { return sam_dyt_cols(S, E); }

// The sorted row s and the row t of dy behind column col of expert e's segment; false where
// there is none (past the expert's rows, or a token id outside [0, T): a zero column).
__device__ __forceinline__ bool dyt_source(const DytSrc &p, int e, int64_t col, int64_t &s, int64_t &t) {
    const int64_t i = col - dyt_segment(p.offsets, e);
    const int64_t sb = max((int64_t)0, (int64_t)__ldg(p.offsets + e));
    const int64_t se = min((int64_t)__ldg(p.offsets + e + 1), p.S);
    if (i < 0 || sb + i >= se) return false;
    s = sb + i;
    t = p.token_ids ? (int64_t)__ldg(p.token_ids + s) : s;
    return t >= 0 && t < p.T;
}

// The expert whose segment holds columns c0 .. c0 + 63 (c0 a multiple of 64: one expert's, or
// padding after it), called by the 32 lanes of one warp, each getting it: the number of
// experts whose segment starts at or before c0, less one, by ballots (four loads a lane in flight).
__device__ __forceinline__ int dyt_block_expert(const DytSrc &p, int64_t c0, int lane) {
    int cnt = 0;
    for (int base = 0; base < p.E; base += 128) {
        bool ok[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int e = base + 32 * u + lane;
            ok[u] = e < p.E && dyt_segment(p.offsets, e) <= c0;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) cnt += __popc(__ballot_sync(0xffffffffu, ok[u]));
    }
    return max(cnt - 1, 0);
}

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
            int64_t s, t;
            if (dyt_source(p, lo, col, s, t)) {
                src = s;
                tok = t;
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

// The same copy where dy's rows hold whole 16-byte pieces (vec16: lddy % 8 == 0, R % 8 == 0,
// dy 16-byte aligned): one CTA per 64 columns (64 sorted rows, all of one expert: segments are
// 64-column aligned) and DYT_RCH rows of the copy, in 64 x 64 tiles.  The block's expert is
// found once (warp 0: a ballot over the segments' starts, four loads a lane in flight) and
// its 64 source rows' offsets and scales go to shared memory; then per tile each thread loads
// two rows' 16-byte pieces (8 of dy's columns), pairs their elements into 32-bit words (one
// byte permute each) and stores the 8 words transposed, and reads back 16-byte pieces of the
// copy's rows.  The [64][33]-word tile is conflict-free both ways: a warp writes row pairs
// m = lane % 8 of pieces lane / 8 (banks 8 piece + m), and reads rows lane / 8 of 8-column
// pieces lane % 8 (banks row + 4 piece).  The per-element kernel above paid a 64-thread binary
// search over the experts (one dependent load per step) and two token-id round trips for every
// 8 KB it moved, and ran at half the copy rate.  Two tiles an iteration (four loads a thread in
// flight before the first shared store): 0.87-0.91x the time of one on an H200.
constexpr int DYT_RCH = 256;  // the copy's rows per CTA (4 tiles)

template <typename T>
__global__ void __launch_bounds__(256) dyt_fill16_kernel(const DytSrc p, int64_t R, int64_t W, T *dyt) {
    __shared__ uint32_t tile[2 * 64 * 33];
    __shared__ int64_t src_off[64];  // element offset of the column's row of dy (-1: zeros)
    __shared__ float src_sc[64];
    __shared__ int blk_e;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c0 = (int64_t)blockIdx.x * 64;
    const int64_t rbeg = (int64_t)blockIdx.y * DYT_RCH, rend = min(R, rbeg + DYT_RCH);
    if (warp == 0) {
        const int e = dyt_block_expert(p, c0, lane);  // (every lane: the ballots need them all)
        if (lane == 0) blk_e = e;
    }
    __syncthreads();
    if (threadIdx.x < 64) {
        const int e = blk_e;
        int64_t off = -1;
        float sc = 1.0f;
        int64_t s, t;
        if (p.E > 0 && dyt_source(p, e, c0 + threadIdx.x, s, t)) {
            off = t * p.lddy;
            if (p.scale) sc = __ldg(p.scale + s);
        }
        src_off[threadIdx.x] = off;
        src_sc[threadIdx.x] = sc;
    }
    __syncthreads();
    const T *dy = static_cast<const T *>(p.dy);
    // load side: row pair m (columns 2m, 2m + 1 of the block), piece pc (the copy's rows 8 pc ..)
    const int m = 8 * (warp & 3) + (lane & 7), pc = 4 * (warp >> 2) + (lane >> 3);
    const int64_t off0 = src_off[2 * m], off1 = src_off[2 * m + 1];
    const float sc0 = src_sc[2 * m], sc1 = src_sc[2 * m + 1];
    // store side: the copy's rows rl = 4 warp + lane / 8 (+ 32), 8-column piece q = lane % 8
    const int q = lane & 7, rl0 = 4 * warp + (lane >> 3);
    // two 64-row tiles an iteration: four 16-byte loads a thread in flight before the first store
    for (int64_t r0 = rbeg; r0 < rend; r0 += 128) {
        uint4 a[2], b[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t r = r0 + 64 * u + 8 * pc;
            a[u] = make_uint4(0, 0, 0, 0);
            b[u] = make_uint4(0, 0, 0, 0);
            if (r < R) {
                if (off0 >= 0) a[u] = __ldg(reinterpret_cast<const uint4 *>(dy + off0 + r));
                if (off1 >= 0) b[u] = __ldg(reinterpret_cast<const uint4 *>(dy + off1 + r));
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (p.scale) {
                a[u] = make_uint4(scale2<T>(a[u].x, sc0), scale2<T>(a[u].y, sc0), scale2<T>(a[u].z, sc0),
                                  scale2<T>(a[u].w, sc0));
                b[u] = make_uint4(scale2<T>(b[u].x, sc1), scale2<T>(b[u].y, sc1), scale2<T>(b[u].z, sc1),
                                  scale2<T>(b[u].w, sc1));
            }
            const uint32_t aw[4] = {a[u].x, a[u].y, a[u].z, a[u].w}, bw[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
            uint32_t *tl = tile + u * 64 * 33;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                tl[(8 * pc + 2 * j) * 33 + m] = __byte_perm(aw[j], bw[j], 0x5410);      // element 2 j of both rows
                tl[(8 * pc + 2 * j + 1) * 33 + m] = __byte_perm(aw[j], bw[j], 0x7632);  // element 2 j + 1
            }
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const int rl = rl0 + 32 * h;  // 0 .. 127: tile rl / 64, its row rl % 64
            if (r0 + rl < R) {
                const uint32_t *t = tile + (rl / 64) * 64 * 33 + (rl % 64) * 33 + 4 * q;
                *reinterpret_cast<uint4 *>(dyt + (r0 + rl) * W + c0 + 8 * q) = make_uint4(t[0], t[1], t[2], t[3]);
            }
        }
        __syncthreads();
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
    const bool vec16 = src.lddy % 8 == 0 && R % 8 == 0 && (reinterpret_cast<uintptr_t>(src.dy) & 15) == 0;
    T *dyt = static_cast<T *>(buf);
    if (cudaMemsetAsync(dyt + R * W, 0, (size_t)W * sizeof(T), s) != cudaSuccess) {
        *st = launch_status("dyt_fill");
        return dyt;
    }
    if (vec16)
        dyt_fill16_kernel<T><<<dim3((unsigned)(W / 64), (unsigned)((R + DYT_RCH - 1) / DYT_RCH)), 256, 0, s>>>(src, R, W,
                                                                                                             dyt);
    else
        dyt_fill_kernel<T><<<dim3((unsigned)(W / 64), (unsigned)((R + 63) / 64)), 256, 0, s>>>(src, R, W, dyt, vec);
    *st = launch_status("dyt_fill");
    return dyt;
}

}  // namespace
}  // namespace sam
