// tile_scheduler.cuh -- how the warp-specialised wgmma.sp kernel (ssmm_wgmma_sp.cu)
// walks its work items: a persistent grid (one CTA per SM) whose CTA takes the items
// blockIdx.x, blockIdx.x + gridDim.x, ... in the rasterised order of decode_tile
// (ssmm_work.cuh), each item nsplit consecutive items, its K splits (split_k_range), handed
// from the producer warpgroup to the consumers through NSLOT work slots in shared memory
// (token rows, routing scales, expert / row tile / first sorted row / split): the producer
// fills slot n % NSLOT once the consumers have released item n - NSLOT, so it streams item
// n + 1 while the consumers finish and store item n.
#pragma once

#include "ssmm_wgmma_sp_tile.cuh"
#include "ssmm_work.cuh"
#include "tma.cuh"

namespace sam {

#ifdef SAM_HAS_WGMMA

// Producer warpgroup: work item n of this CTA into its slot, and its e (-1: past the
// work).  Warp 0 decodes the item once the consumers are done with item n - NSLOT (total:
// token tiles over all experts, count_token_tiles, in warp 0); then every producer thread
// loads one token row and scale of it and arrives on the slot's `tfull` barrier.
template <typename C>
__device__ __forceinline__ int schedule_item(const PrefillArgs &p, const WgmmaSmem<C> &sm, int n, int total, int tid) {
    constexpr int BN = C::BN, PT = C::PTHREADS, NSLOT = C::NSLOT;
    const int lane = tid & 31, warp = tid >> 5;
    const int slot = n & (NSLOT - 1);
    int32_t *tok = sm.slot_tok(slot), *info = sm.slot_info(slot);
    if (warp == 0) {
        if (n >= NSLOT) mbar_wait(sm.tempty_bar(slot), ((n >> C::NSLOT_LOG2) - 1) & 1);
        int e, rt, tt;
        const int64_t L = (int64_t)blockIdx.x + (int64_t)n * gridDim.x;
        // split-K: L < 2**32 (the launch keeps the items times nsplit below 2**31)
        const int nsplit = C::SPLIT_K ? p.nsplit : 1;
        decode_tile<BN>(p, nsplit == 1 ? L : (int64_t)((uint32_t)L / (uint32_t)nsplit), total, lane, e, rt, tt);
        if (lane == 0) {
            info[0] = e;
            info[1] = rt;
            *reinterpret_cast<int64_t *>(info + 2) = e >= 0 ? tile_s0<BN>(p, e, tt) : 0;
            info[4] = nsplit == 1 ? 0 : (int)((uint32_t)L % (uint32_t)nsplit);
        }
    }
    named_barrier_sync(BAR_PRODUCER, PT);  // the item is decoded (producer warpgroup)
    const int e = info[0];
    {  // token row and routing scale of tile position tid < BN, one load round
        static_assert(BN <= PT, "at most one token row per producer thread");
        const bool has_row = BN == PT || tid < BN;  // (BN == PT: every producer thread, no compare)
        int32_t t = -1;
        float sc = 1.0f;
        if (e >= 0 && has_row) {
            const int64_t s = *reinterpret_cast<const int64_t *>(info + 2) + tid, s_end = expert_s_end(p, e);
            t = row_token(p, s, s_end);
            if (p.scale && s < s_end) sc = p.scale[s];
        }
        if (has_row) {
            tok[tid] = t;
            sm.slot_scale(slot)[tid] = sc;
        }
        mbar_arrive(sm.tfull_bar(slot));
    }
    return e;
}

// The k-tiles [k0, k1) of the item in work slot `info`: its K split (split_k_range), all of
// K where the tile is never split.  (From the launch's parameters at each item: nothing
// held in registers across the item.)
template <typename C>
__device__ __forceinline__ void item_k_range(const PrefillArgs &p, const int32_t *info, int &k0, int &k1) {
    const int KT = (int)(p.cp / C::BK);  // even: columns are padded to 128
    k0 = 0;
    k1 = KT;
    if (C::SPLIT_K && p.nsplit > 1) split_k_range(KT, C::M > 1 ? p.V / C::BK : 2, p.nsplit, info[4], k0, k1);
}

#endif  // SAM_HAS_WGMMA

}  // namespace sam
