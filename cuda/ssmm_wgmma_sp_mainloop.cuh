// ssmm_wgmma_sp_mainloop.cuh -- the two roles of the warp-specialised wgmma.sp kernel
// (ssmm_wgmma_sp.cu) over the ring of stages: producer() streams the operands of every
// k-tile into it, consumer_mainloop() multiplies them with wgmma.sp.
//
// Producer (warpgroup 0): per work item (tile_scheduler.cuh), one elected thread streams
// the packed values and the 2:4 metadata of each k-tile with TMA (cp.async.bulk.tensor,
// completing on the stage's `full` mbarrier by transaction bytes), and all 128 threads
// gather the BN token rows straight from x by index with cp.async (TMA cannot gather
// rows on sm_90), each thread ending its stage with cp.async.mbarrier.arrive.noinc, so
// a stage is marked full by the hardware the moment its bytes have landed and the
// producer never waits on its own copies: it only waits for a free stage (`empty`).
// Where x is read without a row map (TMA_TOKENS: token_ids null, as the down projection
// reads its intermediate rows), an expert's rows are contiguous and the TMA thread loads
// them too, as one box per k-tile; the other producer threads, which then load nothing,
// still walk the ring and arrive on each stage's `full` barrier (docs/KERNELS.md, "A hang").
//
// Consumers (warpgroups 1 and 2): wait on `full`, load the k-tile's metadata words into
// registers and issue its wgmma.sp with both operands read by the tensor cores from
// shared memory through descriptors (the packed values in the 64-byte swizzle TMA wrote,
// the tokens in the 128-byte swizzle), keep one k-tile of wgmmas in flight, and arrive
// on the `empty` mbarrier of a stage once the wgmmas that read it are done.
//
// Row selection (1:2:V) without moving the accumulators (fold_row_set, ssmm_work.cuh):
// wgmma always accumulates both rows' slices into one running total T (acc[0], never
// moved), and acc[1] keeps D, the sum of the slices that belong to row 0 of the pair.  At
// every V boundary the warpgroup drains its wgmmas and adds (c_prev - c_next) T to D (c = 1
// where a slice selects row 0): one FFMA per accumulator with a coefficient of -1, 0 or 1.
// After the last slice acc[1] is row 0 (D) and acc[0] row 1 (T - D).
#pragma once

#include "ptx_wgmma.cuh"
#include "ssmm_wgmma_sp_tile.cuh"
#include "ssmm_work.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace sam {

#ifdef SAM_HAS_WGMMA

// The producer warpgroup's whole run: every work item of this CTA, then the end record.
template <typename T, typename C>
__device__ __forceinline__ void producer(const PrefillArgs &p, const WgmmaMaps &tm, const WgmmaSmem<C> &sm, int tid,
                                         int kt_per_slice) {
    constexpr int M = C::M, BMT = C::BMT, BN = C::BN, BK = C::BK, KS = C::KS, ST = C::ST, PT = C::PTHREADS;
    constexpr bool PAIRS = C::PAIRS;
    // BT: the token rows of a k-tile come as one TMA box, so only the TMA thread and the
    // threads that load row-selection indices (M > 1) copy anything into a stage
    constexpr bool b_tma = C::BT;
    constexpr int IDX_THREADS = M > 1 ? BMT / 16 : 0;
    const int lane = tid & 31, warp = tid >> 5;
    const T *x = static_cast<const T *>(p.x);
    // B: BN token rows x 8 chunks; thread -> chunk tid % 8, rows tid / 8 + 16 i
    constexpr int B_CH = BN * 8 / PT;
    static_assert(BN * 8 % PT == 0, "whole 16-byte chunks of token rows per producer thread");
    const int b_row = tid / 8, b_ch = tid % 8;
    uint32_t b_dst[B_CH];
#pragma unroll
    for (int i = 0; i < B_CH; i++) b_dst[i] = C::A_BYTES + C::b_off(b_row + 16 * i, b_ch);
    const bool i_load = M > 1 && tid < IDX_THREADS;  // row-selection indices: BMT bytes in 16-byte chunks
    const uint32_t TX = C::A_BYTES + C::META_BYTES + (b_tma ? C::B_BYTES : 0u);
    const int total = warp == 0 ? count_token_tiles<BN>(p, lane) : 0;
    uint32_t it = 0;  // stages issued: stage it % ST, phase it / ST
    for (int n = 0;; n++) {
        const int e = schedule_item<C>(p, sm, n, total, tid);
        if (e < 0) break;
        named_barrier_sync(BAR_PRODUCER, PT);  // every token row of the slot is written
        const int slot = n & (C::NSLOT - 1);
        const int32_t *tok = sm.slot_tok(slot), *info = sm.slot_info(slot);
        const int64_t row0 = (int64_t)info[1] * BMT;
        const int s0 = b_tma ? (int)*reinterpret_cast<const int64_t *>(info + 2) : 0;  // BT: S < 2**31 (host)
        int k0, k1;  // the item's K split (even k0: PAIRS' pairs and the ring position stay even)
        item_k_range<C>(p, info, k0, k1);
        const T *b_src[B_CH];
        unsigned b_ok = 0;
#pragma unroll
        for (int i = 0; i < B_CH; i++) {
            const int t = tok[b_row + 16 * i];
            b_ok |= (unsigned)(t >= 0) << i;
            // an absent row reads row 0 (in bounds; its copy is zero-filled); advanced by BK a k-tile
            b_src[i] = x + (t >= 0 ? (int64_t)t * p.ldx : 0) + k0 * BK + b_ch * 8;
        }
        const bool i_ok = i_load && row0 + tid * 16 < p.rp;
        const uint8_t *i_src = M > 1 ? p.idx + (int64_t)e * p.slices * p.rp + (i_ok ? row0 + tid * 16 : 0) : nullptr;
        // (M > 1: the k-tile's slice, without a division on the loop; k0 starts a slice)
        int slice = k0 / kt_per_slice, slice_left = kt_per_slice;
        for (int kt = k0; kt < k1; kt++, it++) {
            const int s = (int)(it % ST);
            // PAIRS: the barriers of a pair of stages are the even stage's; a pair is waited
            // for at its first k-tile, expects both k-tiles' bytes, and is marked full by every
            // producer thread's arrival after its second k-tile (covering both k-tiles' copies)
            const int sb = PAIRS ? (s & ~1) : s;
            const bool pair_first = !PAIRS || (kt & 1) == 0, pair_last = !PAIRS || (kt & 1) == 1;
            if (pair_first && it >= ST) mbar_wait(sm.empty_bar(sb), ((it / ST) - 1) & 1);
            const uint32_t base = smem_u32(sm.stage_ptr(s));
            if (tid == 0) {
                if (pair_first) mbar_arrive_expect_tx(sm.full_bar(sb), PAIRS ? 2 * TX : TX);
                tma_load_3d(base, &tm.a, kt * (BK / 2), (int)row0, e, sm.full_bar(sb));
                tma_load_3d(base + C::A_BYTES + C::B_BYTES, &tm.meta, kt * KS * 16, (int)(row0 / 16), e,
                            sm.full_bar(sb));
                // the item's rows s0 .. s0 + BN - 1 of x; rows past the expert belong to
                // the next one (their output columns are never stored), rows past T and
                // columns past C are zero-filled
                if constexpr (b_tma) tma_load_2d(base + C::A_BYTES, &tm.b, kt * BK, s0, sm.full_bar(sb));
            }
            if (!b_tma) {
                const int col = kt * BK + b_ch * 8;
                const bool col_ok = col < p.C;
#pragma unroll
                for (int i = 0; i < B_CH; i++) {
                    const bool ok = col_ok && ((b_ok >> i) & 1);
                    cp_async16(base + b_dst[i], col_ok ? b_src[i] : x, ok);
                    b_src[i] += BK;
                }
            }
            if (M > 1 && i_load)
                cp_async16(base + C::A_BYTES + C::B_BYTES + C::META_BYTES + tid * 16, i_src + (int64_t)slice * p.rp,
                           i_ok);
            if (M > 1 && --slice_left == 0) {
                slice++;
                slice_left = kt_per_slice;
            }
            // Every producer thread arrives, also where it copies nothing by cp.async (b_tma:
            // a plain arrival from all but the index loaders).  A thread that waits on `empty`
            // without arriving on `full` is held back by nothing: asleep through two phases of a
            // stage's barrier, it waits on a parity come round again, for good (the hang of
            // docs/KERNELS.md).  Arriving, it holds each phase until it has seen the last.
            if (pair_last) {
                if (!b_tma || i_load) cp_async_mbar_arrive(sm.full_bar(sb));
                else mbar_arrive(sm.full_bar(sb));
            }
        }
    }
    cp_async_wait<0>();
}

// A consumer thread's place: consumer c (0, 1) of the item, its warp of the warpgroup,
// lane (g, q), and its first storage row of the item.
struct WgmmaConsumer {
    int c, warp, lane, g, q, crow, wtid;
    template <typename C>
    __device__ __forceinline__ static WgmmaConsumer at(int tid) {
        WgmmaConsumer w;
        w.c = tid / 128 - 1;
        w.warp = (tid >> 5) & 3;
        w.lane = tid & 31;
        w.g = w.lane >> 2;
        w.q = w.lane & 3;
        w.crow = w.c * C::BMW;
        w.wtid = tid & 127;
        return w;
    }
};

// The metadata words of the k-tile in stage st (the packed values stay in shared memory).
template <typename C>
__device__ __forceinline__ void load_meta(const WgmmaSmem<C> &sm, const WgmmaConsumer &w, uint32_t (&ef)[C::NB][C::KS],
                                          int st) {
    const uint32_t *mt_s = reinterpret_cast<const uint32_t *>(sm.stage_ptr(st) + C::A_BYTES + C::B_BYTES);
#pragma unroll
    for (int b = 0; b < C::NB; b++)
#pragma unroll
        for (int ks = 0; ks < C::KS; ks++)
            ef[b][ks] = mt_s[((w.crow / 16 + b * 4 + w.warp) * C::KS + ks) * 16 + 2 * w.g + (w.q & 1)];
}

// At the first k-tile of a slice: the last slice's total folded into row 0's share
// (fold_row_set: set 0 = acc[0] the total, set 1 = acc[1] the share).
template <typename C>
__device__ __forceinline__ void select_rows(const WgmmaSmem<C> &sm, const WgmmaConsumer &w,
                                            float (&acc)[C::NACC][C::AN], uint32_t (&sel)[C::NB][2], int st) {
    const uint8_t *idx_s = sm.stage_ptr(st) + C::A_BYTES + C::B_BYTES + C::META_BYTES;
#pragma unroll
    for (int b = 0; b < C::NB; b++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const uint32_t want = idx_s[w.crow + b * 64 + w.warp * 16 + w.g + 8 * hh];
            fold_row_set<C::M, C::BN / 8>(
                [&](int a, int j, int k) -> float & { return acc[b * C::ASTRIDE + a][4 * j + k]; }, sel[b][hh], want,
                hh);
        }
}

// K-tile kt of the item at ring position it; `boundary`: the first k-tile of a slice.
template <int PAR, typename T, typename C>
__device__ __forceinline__ void consumer_k_tile(const WgmmaSmem<C> &sm, const WgmmaConsumer &w,
                                                float (&acc)[C::NACC][C::AN], uint32_t (&sel)[C::NB][2],
                                                uint32_t (&ef)[2][C::NB][C::KS], int kt, uint32_t it, bool boundary) {
    constexpr int M = C::M, NB = C::NB, KS = C::KS, ST = C::ST, NACC = C::NACC;
    constexpr bool PAIRS = C::PAIRS, zero_init = M > 1;
    const int st = (int)(it % ST);
    if (!PAIRS || PAR == 0) {  // PAIRS: the pair of stages st, st + 1 at once
        mbar_wait(sm.full_bar(st), (it / ST) & 1);
        // the token rows came through the generic proxy (cp.async); BT: every operand by TMA
        // (the row-selection indices, by cp.async, are read by ordinary loads)
        if constexpr (!C::BT) fence_proxy_async();
    }
    load_meta<C>(sm, w, ef[PAR], st);
    if (M > 1 && boundary) {
        wgmma_wait<0>();
#pragma unroll
        for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
        select_rows<C>(sm, w, acc, sel, st);
#pragma unroll
        for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
    }
    const uint32_t sa = smem_u32(sm.stage_ptr(st)), sb = sa + C::A_BYTES;
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            WgmmaSpSS<T, C::BN>::run(acc[b * C::ASTRIDE], smem_desc_sw64(sa + (w.crow + b * 64) * 64 + ks * 32),
                                     smem_desc_sw128(sb + ks * 64), ef[PAR][b][ks], zero_init || kt > 0 || ks > 0);
    wgmma_commit();
    wgmma_wait<1>();
    // the wgmmas of the k-tile before are done (PAIRS: and of the pair before): one
    // arrival per thread
    if ((!PAIRS || PAR == 0) && kt > 0) mbar_arrive(sm.empty_bar((int)((it - 1) % ST) & (PAIRS ? ~1 : ~0)));
}

// One work item's KT k-tiles (its K split: whole slices, an even count) from ring position it
// (advanced past them): acc ends holding the item's rows over them (M = 2: acc[2b + 1] row 0
// of each pair, acc[2b] row 1); kt counts from the split's first k-tile.
template <typename T, typename C>
__device__ __forceinline__ void consumer_mainloop(const WgmmaSmem<C> &sm, const WgmmaConsumer &w,
                                                  float (&acc)[C::NACC][C::AN], uint32_t (&sel)[C::NB][2],
                                                  uint32_t (&ef)[2][C::NB][C::KS], uint32_t &it, int KT,
                                                  int kt_per_slice) {
    constexpr int M = C::M, NB = C::NB, ST = C::ST, NACC = C::NACC, AN = C::AN;
    constexpr bool PAIRS = C::PAIRS, zero_init = M > 1;
    if (zero_init || KT == 0) {
#pragma unroll
        for (int a = 0; a < NACC; a++)
#pragma unroll
            for (int i = 0; i < AN; i++) acc[a][i] = 0.0f;
    }
#pragma unroll
    for (int b = 0; b < NB; b++) sel[b][0] = sel[b][1] = first_sel<M>();
    SliceStart slice;
    for (int kt = 0; kt < KT; kt += 2, it += 2) {
        consumer_k_tile<0, T, C>(sm, w, acc, sel, ef, kt, it, slice.next(kt_per_slice));
        consumer_k_tile<1, T, C>(sm, w, acc, sel, ef, kt + 1, it + 1, slice.next(kt_per_slice));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
    if (KT > 0) mbar_arrive(sm.empty_bar((int)((it - 1) % ST) & (PAIRS ? ~1 : ~0)));
    // M = 2: the last slice's share, then acc[2b] = T - D: row 1 of each pair
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            finish_row_sets<M, C::BN / 8>(
                [&](int a, int j, int k) -> float & { return acc[b * C::ASTRIDE + a][4 * j + k]; }, sel[b][hh], hh);
}

#endif  // SAM_HAS_WGMMA

}  // namespace sam
