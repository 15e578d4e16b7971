// ssmm_dx.cuh -- what the two ssmm_dx kernels share (ssmm_dx.cu: mma.sync, any sm_80+;
// ssmm_dx_wgmma.cu: wgmma, sm_90a): the launch arguments, the work item of a CTA (found on
// the device from the offsets, no host sync), the zeroing of the rows no expert owns, and
// the selection rule.
#pragma once

#include "common.cuh"
#include "ptx_mma.cuh"

namespace sam {

// The arguments of both kernels (sam_ssmm_dx_params resolved by the launcher).
struct DxArgs {
    const void *dy;
    int64_t T, lddy;
    const void *values;
    const uint32_t *meta;
    const uint8_t *idx;
    const int32_t *offsets, *token_ids;
    const float *scale;
    void *out;
    int64_t S, ldo;
    int64_t C, cp, rp, half_rows, slices;
    int E, glu, v, ncb, dy_vec;
    // the wgmma kernel's transposed copy of dy (ssmm_dyt.cuh: dyt[r][dyt_segment(e) + i] =
    // dy[tok(offsets[e] + i)][r], unscaled), and its row stride
    const void *dyt;
    int64_t ldt;
};

// (device helpers: internal to each kernel file)
namespace {

__device__ __forceinline__ int64_t clamp_rows(int32_t o, int64_t S) {
    return o < 0 ? 0 : (o > S ? S : (int64_t)o);
}

// The byte-permute selector of one dense 2-element word of a 4-column group: element i of
// the group holds the first kept value (bytes 0-1 of the packed pair) where i == i0, the
// second (bytes 2-3) where i == i1, else 0 (bytes of the zero operand).
__device__ __forceinline__ uint32_t dense_sel(uint32_t i0, uint32_t i1, uint32_t i) {
    return i == i0 ? 0x10u : i == i1 ? 0x32u : 0x44u;
}

// The work item of CTA `item` among (expert, BM sorted rows, column block) items, ordered
// by expert, then (ROWS_FASTEST) column block and row tile, or row tile and column block:
// a prefix sum of the experts' row tiles, THREADS experts a pass, by the whole CTA.  Writes
// s_item = {expert (-1: none), row tile, column block} and returns the row tiles of all
// experts (the busy CTAs are the first ncb times that many).  s_warp: THREADS / 32 ints.
template <int BM, int THREADS, bool ROWS_FASTEST>
__device__ int64_t dx_find_item(const DxArgs &p, int64_t item, int *s_warp, int *s_item) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) s_item[0] = -1;
    __syncthreads();  // (E == 0: no pass below, every CTA zeroes)
    int64_t tiles = 0;
    for (int e0 = 0; e0 < p.E; e0 += THREADS) {
        const int e = e0 + tid;
        int nt = 0;
        if (e < p.E) {
            const int64_t a = clamp_rows(p.offsets[e], p.S), b = clamp_rows(p.offsets[e + 1], p.S);
            nt = b > a ? (int)((b - a + BM - 1) / BM) : 0;
        }
        int incl = nt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        int wbase = 0, total = 0;
#pragma unroll
        for (int w = 0; w < THREADS / 32; w++) {
            const int t = s_warp[w];
            wbase += w < warp ? t : 0;
            total += t;
        }
        const int64_t lo = (int64_t)p.ncb * (tiles + wbase + incl - nt);
        if (nt > 0 && item >= lo && item < lo + (int64_t)p.ncb * nt) {
            const int64_t local = item - lo;
            s_item[0] = e;
            s_item[1] = (int)(ROWS_FASTEST ? local % nt : local / p.ncb);
            s_item[2] = (int)(ROWS_FASTEST ? local / nt : local % p.ncb);
        }
        tiles += total;
        __syncthreads();
    }
    return tiles;
}

// The rows no expert owns ([0, offsets[0]) and [offsets[E], S)): zeros, whole 16-byte pieces
// (C and ldo multiples of 8), BM x BN units, by the CTAs past the last item in a grid-stride
// loop (f: this CTA's place among them, nfree: how many there are).
template <typename T, int BM, int BN, int THREADS>
__device__ void dx_zero_rows(const DxArgs &p, int64_t f, int64_t nfree) {
    const int64_t first = clamp_rows(p.offsets[0], p.S), last = clamp_rows(p.offsets[p.E], p.S);
    const int64_t nza = (first + BM - 1) / BM, nzb = (p.S - last + BM - 1) / BM;
    const int64_t units = (nza + nzb) * p.ncb;
    T *out = static_cast<T *>(p.out);
    for (int64_t u = f; u < units; u += nfree) {
        const int64_t zt = u / p.ncb, cb = u % p.ncb;
        const int64_t r0 = zt < nza ? zt * BM : last + (zt - nza) * BM;
        const int64_t r1 = min(r0 + BM, zt < nza ? first : p.S);
        const int64_t c0 = cb * BN;
        for (int i = threadIdx.x; i < BM * (BN / 8); i += THREADS) {
            const int64_t r = r0 + i / (BN / 8), c = c0 + 8 * (i % (BN / 8));
            if (r < r1 && c < p.C) st_global_v4(out + r * p.ldo + c, make_uint4(0, 0, 0, 0));
        }
    }
}

}  // namespace

// ---- which kernel runs an ssmm_dx (sam_ssmm_dx_cuda) -------------------------------------
enum DxKernel { DX_MMA = 0, DX_WGMMA = 1 };

// The selection rule: the wgmma kernel (ssmm_dx_wgmma.cu) wherever it runs (an sm_90 device
// with the sm_90a build: `wgmma_ok`), else the mma.sync kernel (ssmm_dx.cu), which takes
// every format, dtype and alignment the launcher accepts.  `force` (sam_ssmm_dx_params.impl
// - 1): DX_MMA or DX_WGMMA (an error where it cannot run), so the tests run both kernels on
// an H100; -1 leaves the rule's choice.
inline DxKernel dx_choose_kernel(bool wgmma_ok, int force) {
    if (force == DX_MMA) return DX_MMA;
    return wgmma_ok ? DX_WGMMA : DX_MMA;
}

// Whether the wgmma kernel can run on the current device (ssmm_dx_wgmma.cu).
bool ssmm_dx_wgmma_available();
// Launches it (a.* filled as for the mma kernel; m the format's M, 1, 2 or 4): writes dy's
// transposed copy into stream-ordered memory, runs the kernel from it, frees it.  *ran is
// false, nothing launched and SAM_STATUS_OK returned, where the copy cannot be allocated.
sam_status ssmm_dx_wgmma_launch(const DxArgs &a, sam_dtype dtype, int m, cudaStream_t stream, bool *ran);

}  // namespace sam
