// ssmm_work.cuh -- what every ssmm kernel (ssmm_mma_sp.cu, ssmm_wgmma_sp.cu,
// ssmm_decode.cu) shares before its epilogue: the launch's arguments, where a CTA's
// work lies (the prefill kernels' work items: expert, row tile, token tile), and the
// row selection of formats 1:M:V in registers.
//
// Work items of the prefill kernels: every (expert e, row tile rt, token tile tt of
// e), token tiles of BN sorted rows from offsets[e]; rasterised in groups of gm row
// tiles so that consecutive items reuse the same weight rows across many token tiles
// (L2).  The grid is an upper bound (row tiles x (ceil(S/BN) + E)); each CTA finds its
// items from offsets[] on the device, so there is no host sync and experts without
// tokens cost nothing.
#pragma once

#include <stdint.h>

#include "common.cuh"
#include "ptx_mma.cuh"

namespace sam {

// ---- the launch -------------------------------------------------------------------
//
// What every ssmm kernel reads of a launch (the kernels' parameter structs extend it).
struct SsmmArgs {
    const void *x;
    int64_t T, ldx, C, cp, rp, slices, R;
    const void *values;
    const uint32_t *meta;
    const uint8_t *idx;
    int glu;
    const int32_t *offsets;
    const int32_t *token_ids;
    int64_t S;
    int E;
    int act;
    const void *bias;
    sam_dtype bias_dtype;
    const float *scale;
    float alpha, limit;
    void *out;
    int64_t ldo, out_cols;
    void *preact;  // a gated act's pre-activation too, or nullptr (sam_ssmm_params.preact)
    int64_t ldp;
};

inline SsmmArgs ssmm_args(const sam_ssmm_params *ps) {
    SsmmArgs a;
    a.x = ps->x;
    a.T = ps->T;
    a.ldx = ps->ldx;
    a.C = ps->d.C;
    a.cp = ps->d.cp;
    a.rp = ps->d.rp;
    a.slices = ps->d.slices;
    a.R = ps->d.R;
    a.values = ps->values;
    a.meta = ps->meta;
    a.idx = ps->idx;
    a.glu = ps->f.glu;
    a.offsets = ps->offsets;
    a.token_ids = ps->token_ids;
    a.S = ps->S;
    a.E = (int)ps->d.E;
    a.act = ps->act;
    a.bias = ps->bias;
    a.bias_dtype = ps->bias_dtype;
    a.scale = ps->scale;
    a.alpha = ps->alpha;
    a.limit = ps->limit;
    a.out = ps->out;
    a.ldo = ps->ldo;
    a.out_cols = ps->act == SAM_ACT_NONE ? ps->d.R : ps->d.R / 2;
    a.preact = ps->act == SAM_ACT_NONE ? nullptr : ps->preact;
    a.ldp = ps->ldp;
    return a;
}


// ---- row selection (formats 1:M:V) ---------------------------------------------------
//
// Row selection (1:M:V) in registers, by a running total.  A condensed row keeps M
// accumulator sets.  The MMA always accumulates into set 0, which is never moved: it holds
// the total T of every slice, whichever row of the group the slice selected.  Set a
// (1 <= a < M) holds D_{a-1}, the share of row a-1: the sum of the slices that selected it.
// With c_{r,j} = 1 where slice j selects row r (else 0) and T_j the total after slice j,
//     D_r = sum_j c_{r,j} (T_j - T_{j-1}) = sum_j (c_{r,j} - c_{r,j+1}) T_j,
// so at each slice boundary, once the slice's MMAs are done, fold_row_set adds
// (c_prev - c_next) T to every share: M - 1 FFMAs per accumulator with a coefficient of -1, 0
// or 1 (exact but for the add's rounding; a third of the instructions of swapping the
// sets, two selects and a move per accumulator and set).  `sel` is the row the previous
// slice selected (M: none yet) in its low byte; bit SEL_LAST_SEEN records that some slice
// selected row M-1.  After the last slice finish_row_sets makes set 0 row M-1 (T minus the
// shares, or exactly 0 where no slice selected it: T minus shares that add up to T leaves
// a rounding residual once three or more slices alternate between other rows) and turns
// `sel` into the perm the stores read: 4 bits per set a, which row of its group it holds.
// at(a, j, k) is the accumulator of set a, n8 tile j, fragment element k; a thread's row hh
// owns elements k = 2hh, 2hh+1 of every tile (mma.sp and wgmma layouts alike).
// The `sel` a row starts with: no row selected yet (M); for M = 1, where nothing is
// folded, the perm the stores read (set 0 is row 0).
template <int M> __device__ __forceinline__ constexpr uint32_t first_sel() { return M > 1 ? (uint32_t)M : 0u; }

// The first k-tile of each slice of kps k-tiles, k-tile by k-tile, by a countdown
// (no division on the k loop).
struct SliceStart {
    int left = 0;
    __device__ __forceinline__ bool next(int kps) {
        const bool first = left == 0;
        left = (first ? kps : left) - 1;
        return first;
    }
};

// mma.sp fragments of MT x NT tiles: every accumulator set at zero, no row selected yet
// (M = 1: the identity perm, set 0 is the row).
template <int M, int MT, int NT>
__device__ __forceinline__ void init_row_sets(float (&acc)[M][MT][NT][4], uint32_t (&sel)[MT][2]) {
#pragma unroll
    for (int a = 0; a < M; a++)
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[a][i][j][k] = 0.0f;
#pragma unroll
    for (int i = 0; i < MT; i++) sel[i][0] = sel[i][1] = first_sel<M>();
}

constexpr uint32_t SEL_LAST_SEEN = 0x100u;

template <int M, int NT, typename At>
__device__ __forceinline__ void fold_row_set(At at, uint32_t &sel, uint32_t want, int hh) {
    const uint32_t prev = sel & 0xffu;
#pragma unroll
    for (int a = 1; a < M; a++) {
        const float coef = (prev == (uint32_t)(a - 1) ? 1.0f : 0.0f) - (want == (uint32_t)(a - 1) ? 1.0f : 0.0f);
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int k = 2 * hh; k < 2 * hh + 2; k++) at(a, j, k) = fmaf(coef, at(0, j, k), at(a, j, k));
    }
    sel = want | (sel & SEL_LAST_SEEN) | (want == (uint32_t)(M - 1) ? SEL_LAST_SEEN : 0u);
}

template <int M, int NT, typename At>
__device__ __forceinline__ void finish_row_sets(At at, uint32_t &sel, int hh) {
    if (M == 1) return;
    fold_row_set<M, NT>(at, sel, (uint32_t)M, hh);  // past the last slice no row is selected
    const bool last_seen = (sel & SEL_LAST_SEEN) != 0u;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int k = 2 * hh; k < 2 * hh + 2; k++) {
            float r = at(0, j, k);
#pragma unroll
            for (int a = 1; a < M; a++) r -= at(a, j, k);
            at(0, j, k) = last_seen ? r : 0.0f;
        }
    uint32_t perm = (uint32_t)(M - 1);
#pragma unroll
    for (int a = 1; a < M; a++) perm |= (uint32_t)(a - 1) << (4 * a);
    sel = perm;
}

// What the prefill kernels (mma.sp, wgmma.sp) read: the launch, the slice length and the
// work items' rasterisation.
struct PrefillArgs : SsmmArgs {
    int V;       // slice length (BK without row selection)
    int nrt;     // row tiles
    int gm;      // row tiles per rasterisation group (SSMM_RASTER_GROUP)
    int nsplit;  // K splits of every item (the wgmma.sp kernel's split-K; 1 elsewhere)
    float *ws;   // nsplit > 1: the splits' fp32 partial sums, [nsplit][S][R] (split_k_range)
};

// Split-K (the wgmma.sp kernel): split j of nsplit covers k-tiles [k0, k1) of K's KT, whole
// units of `unit` k-tiles (1:2:V: a V-slice, so that each split's row selection folds whole
// slices and its rows are partial sums, the fold being linear; 2:4: a pair, the consumers'
// step).  Even k0 and k1 (unit and KT are even); no split is empty while nsplit <= the units
// (host: sam_ssmm_split_k).  Its partial sums go to ws[j][s][col] as the epilogue would see
// them before bias, activation and scale: col an output column, a gated item's up column at
// R / 2 + col (the bias's layout); ssmm_split_reduce_kernel adds them in split order.
// (32-bit: KT * SAM_SPLIT_K_MAX < 2**31, host)
__device__ __forceinline__ void split_k_range(int KT, int unit, int nsplit, int j, int &k0, int &k1) {
    const int units = (KT + unit - 1) / unit;
    k0 = min(KT, units * j / nsplit * unit);
    k1 = min(KT, units * (j + 1) / nsplit * unit);
}

// Row tiles per rasterisation group of the prefill kernels' work items.
constexpr int SSMM_RASTER_GROUP = 16;

// A prefill launch's arguments (slice length V, BMT storage rows x BN tokens a work item)
// and *items, the upper bound of its work items (0: nothing to do).
inline sam_status prefill_args(const sam_ssmm_params *ps, int V, int BMT, int BN, PrefillArgs &k, int64_t &items) {
    static_cast<SsmmArgs &>(k) = ssmm_args(ps);
    k.V = V;
    k.nrt = (int)ceil_div(ps->d.rp, BMT);
    k.gm = SSMM_RASTER_GROUP;
    k.nsplit = 1;
    k.ws = nullptr;
    items = 0;
    if ((ps->T * ps->ldx) / 8 >= ((int64_t)1 << 32)) {
        set_error("ssmm: x holds %lld elements; the GPU kernel addresses at most 2**35", (long long)(ps->T * ps->ldx));
        return SAM_STATUS_UNSUPPORTED;
    }
    const int64_t grid = (int64_t)k.nrt * (ceil_div(ps->S, BN) + ps->d.E);
    if (grid == 0 || k.nrt == 0) return SAM_STATUS_OK;
    if (grid > INT32_MAX) {
        set_error("ssmm: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    items = grid;
    return SAM_STATUS_OK;
}

// Shared memory base rounded up to 1024 bytes (the launch adds 1024 bytes of slack).
__device__ __forceinline__ unsigned char *align_smem(unsigned char *raw) {
    const uint32_t a = smem_u32(raw);
    return raw + (((a + 1023u) & ~1023u) - a);
}

// Token tiles of expert e (0 past the experts).
template <int BN> __device__ __forceinline__ int expert_token_tiles(const PrefillArgs &p, int e) {
    return e < p.E ? (max(0, p.offsets[e + 1] - p.offsets[e]) + BN - 1) / BN : 0;
}

// Token tiles over all experts (warp-wide; every lane gets the sum).
template <int BN> __device__ __forceinline__ int count_token_tiles(const PrefillArgs &p, int lane) {
    int total = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
        int nt = expert_token_tiles<BN>(p, e0 + lane);
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) nt += __shfl_xor_sync(0xffffffffu, nt, d);
        total += nt;
    }
    return total;
}

// Work item L of total * nrt (warp-wide): expert e, row tile rt, token tile tt of e.
// Items are rasterised in groups of GM row tiles so that consecutive items reuse
// the same weight rows across many token tiles (L2).  e = -1 past the work.
template <int BN>
__device__ __forceinline__ void decode_tile(const PrefillArgs &p, int64_t L, int total, int lane, int &e_out, int &rt_out,
                                            int &tt_out) {
    e_out = -1;
    rt_out = tt_out = 0;
    if (L >= (int64_t)total * p.nrt) return;
    const int gm = p.gm;
    const int group = (int)(L / ((int64_t)gm * total)), within = (int)(L % ((int64_t)gm * total));
    const int gm_eff = min(gm, p.nrt - group * gm);
    const int gt = within / gm_eff;
    rt_out = group * gm + within % gm_eff;
    int run = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
        const int nt = expert_token_tiles<BN>(p, e0 + lane);
        int incl = nt;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        const int lo = run + incl - nt, hi = run + incl;
        const unsigned hit = __ballot_sync(0xffffffffu, nt > 0 && gt >= lo && gt < hi);
        if (hit) {
            const int src = __ffs(hit) - 1;
            e_out = e0 + src;
            tt_out = gt - __shfl_sync(0xffffffffu, lo, src);
            return;
        }
        run += __shfl_sync(0xffffffffu, incl, 31);
    }
}

// First sorted row of token tile tt of expert e, the end of e's sorted rows, and
// the token row of sorted row s < s_end (-1: nothing to read or write).
template <int BN> __device__ __forceinline__ int64_t tile_s0(const PrefillArgs &p, int e, int tt) {
    return (int64_t)max(0, p.offsets[e]) + (int64_t)tt * BN;
}
__device__ __forceinline__ int64_t expert_s_end(const PrefillArgs &p, int e) {
    return min((int64_t)p.offsets[e + 1], p.S);
}
__device__ __forceinline__ int32_t row_token(const PrefillArgs &p, int64_t s, int64_t s_end) {
    if (s >= s_end) return -1;
    const int64_t v = p.token_ids ? (int64_t)p.token_ids[s] : s;
    return (v >= 0 && v < p.T) ? (int32_t)v : -1;
}

// Finds this CTA's (expert e, row tile rt, first sorted row s0): work item
// blockIdx.x, and fills tok_s[BN] with its token rows.  Returns false for a CTA
// past the work (the grid is an upper bound).
template <int BN, int THREADS>
__device__ __forceinline__ bool cta_work(const PrefillArgs &p, int32_t *tok_s, int &e_out, int &rt_out, int64_t &s0_out) {
    __shared__ int sh_e, sh_rt, sh_tt;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (warp == 0) {
        const int total = count_token_tiles<BN>(p, lane);
        int e, rt, tt;
        decode_tile<BN>(p, blockIdx.x, total, lane, e, rt, tt);
        if (lane == 0) {
            sh_e = e;
            sh_rt = rt;
            sh_tt = tt;
        }
    }
    __syncthreads();
    const int e = sh_e;
    if (e < 0) return false;
    const int64_t s0 = tile_s0<BN>(p, e, sh_tt), s_end = expert_s_end(p, e);
    for (int i = tid; i < BN; i += THREADS) tok_s[i] = row_token(p, s0 + i, s_end);
    __syncthreads();
    e_out = e;
    rt_out = sh_rt;
    s0_out = s0;
    return true;
}

}  // namespace sam
