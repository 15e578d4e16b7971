// ssmm_wgmma_sp.cu -- the warp-specialised Hopper kernel of ssmm (wgmma.mma_async.sp,
// sm_90a): what auto runs on sm_90 devices for 2:4 and 1:2:V with V % 128 == 0 above the
// decode sizes.
//
// Computes what every ssmm kernel computes (csrc/ssmm_ref.c):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
//
// CTA = 3 warpgroups on a persistent grid (one CTA per SM, tile_scheduler.cuh), each
// work item ROWS storage rows x TOKENS tokens of one expert (ssmm_wgmma_sp_tile.cuh):
//   warpgroup 0, the producer: decodes the items into the work slots and streams every
//     k-tile's operands into a ring of stages (producer(), ssmm_wgmma_sp_mainloop.cuh);
//   warpgroups 1 and 2, the consumers: the item's wgmma.sp over the ring
//     (consumer_mainloop()), then its epilogue (epilogue(), ssmm_wgmma_sp_epilogue.cuh).
// Split-K (nsplit > 1, few items): each item is nsplit items over ranges of K
// (split_k_range, ssmm_work.cuh) that store fp32 partial sums (store_partial), which
// ssmm_split_reduce_kernel adds in split order and finishes with the epilogue.
// No CTA-wide barrier after the set-up; setmaxnreg gives the consumers most registers.
// docs/KERNELS.md ("The wgmma.sp kernel") has the design and its measurements.
#include <cuda.h>  // CUtensorMap and its enums (the encoder is fetched from the driver at run time)
#include <string.h>

#include <algorithm>

#include "ssmm_kernels.h"
#include "ssmm_wgmma_sp_epilogue.cuh"
#include "ssmm_wgmma_sp_mainloop.cuh"
#include "ssmm_wgmma_sp_tile.cuh"
#include "ssmm_work.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace sam {
namespace {

// PRE: a gated launch that writes its pre-activation too (p.preact; the training forward): a
// kernel of its own, so that the others' registers are not spent on it.
template <typename T, typename C, bool PRE>
__global__ void __launch_bounds__(C::THREADS, 1) ssmm_wgmma_sp_kernel(const PrefillArgs p,
                                                                       const __grid_constant__ WgmmaMaps tm) {
#ifdef SAM_HAS_WGMMA
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const WgmmaSmem<C> sm(align_smem(smem_raw));
    const int tid = threadIdx.x;
    const int kt_per_slice = C::M > 1 ? p.V / C::BK : 1;
    if (tid == 0) {
        for (int s = 0; s < C::ST; s++) {
            // every producer thread's arrival (its cp.asyncs landed; BT: a plain arrival
            // where it copies nothing) + the TMA thread's expect_tx
            mbar_init(sm.full_bar(s), C::PTHREADS + 1);
            mbar_init(sm.empty_bar(s), C::CPI * 128);  // the item's consumer threads
        }
        for (int s = 0; s < C::NSLOT; s++) {
            mbar_init(sm.tfull_bar(s), C::PTHREADS);  // the producer threads, each after its token row
            mbar_init(sm.tempty_bar(s), C::CPI * 128);  // the item's consumers, after their epilogue
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tma_prefetch_map(&tm.a);
        tma_prefetch_map(&tm.meta);
        if constexpr (C::BT) tma_prefetch_map(&tm.b);
    }
    __syncthreads();
    // A programmatic dependent launch (common.cuh): the barriers above are set up while the
    // kernel before ends, nothing below reads or writes before it has; the kernel after
    // launches as this one's CTAs end.
    pdl_wait();

    if (tid / 128 == 0) {
        setmaxnreg_dec<C::PREGS>();
        producer<T, C>(p, tm, sm, tid, kt_per_slice);
        return;
    }
    setmaxnreg_inc<C::CREGS>();
    const WgmmaConsumer w = WgmmaConsumer::at<C>(tid);
    // M = 1: two m64 blocks.  What wgmma writes is not zero-filled: the first k-tile's
    // wgmmas start from zero (scale-d = 0), so no ordinary instruction defines an
    // accumulator while wgmmas are in flight.  M = 2: of block b, acc[2b] the running
    // total T of both rows of a pair, acc[2b + 1] row 0's share D (row selection), both
    // set to zero before an item's first wgmma.
    float acc[C::NACC][C::AN];
    uint32_t sel[C::NB][2];  // M = 2: the row the previous slice selected, for row hh of block b
    uint32_t ef[2][C::NB][C::KS];
    const EpilogueTarget<T> target = EpilogueTarget<T>::template make<C>(p, sm, w.c);
    uint32_t it = 0;  // ring position of the item's first k-tile
    for (int n = 0;; n++) {
        const int slot = n & (C::NSLOT - 1);
        mbar_wait(sm.tfull_bar(slot), (n >> C::NSLOT_LOG2) & 1);
        const int32_t *info = sm.slot_info(slot);
        const int e = info[0];
        if (e < 0) break;
        const int64_t row0 = (int64_t)info[1] * C::BMT, s0 = *reinterpret_cast<const int64_t *>(info + 2);
        int k0, k1;
        item_k_range<C>(p, info, k0, k1);
        consumer_mainloop<T, C>(sm, w, acc, sel, ef, it, k1 - k0, kt_per_slice);
        if constexpr (PRE)
            epilogue<true, true, T, C>(p, sm, w, target, acc, sm.slot_tok(slot), sm.slot_scale(slot), e, row0, s0);
        else if (C::SPLIT_K && p.nsplit > 1)
            store_partial<C>(p, w, acc, sm.slot_tok(slot), row0, s0, sm.slot_info(slot)[4]);
        else if (p.act != SAM_ACT_NONE)
            epilogue<true, false, T, C>(p, sm, w, target, acc, sm.slot_tok(slot), sm.slot_scale(slot), e, row0, s0);
        else
            epilogue<false, false, T, C>(p, sm, w, target, acc, sm.slot_tok(slot), sm.slot_scale(slot), e, row0, s0);
        mbar_arrive(sm.tempty_bar(slot));
    }
#else
    (void)p;
    (void)tm;
    __trap();
#endif
}

// The TMA maps over the packed values and metadata (layout at WgmmaMaps); false when the
// encoder refuses them.
template <typename T, typename C> bool weight_maps(const sam_ssmm_params *ps, WgmmaMaps &m) {
    TensorMapEncodeFn enc = tensor_map_encoder();
    const cuuint64_t cp = (cuuint64_t)ps->d.cp, rp = (cuuint64_t)ps->d.rp, E = (cuuint64_t)ps->d.E;
    const cuuint32_t one[3] = {1, 1, 1};
    const CUtensorMapDataType vt =
        std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const cuuint64_t a_dim[3] = {cp / 2, rp, E}, a_stride[2] = {cp, rp * cp};
    const cuuint32_t a_box[3] = {(cuuint32_t)(C::BK / 2), (cuuint32_t)C::BMT, 1};
    if (enc(&m.a, vt, 3, const_cast<void *>(ps->values), a_dim, a_stride, a_box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    const cuuint64_t m_dim[3] = {cp / 2, rp / 16, E}, m_stride[2] = {cp * 2, (rp / 16) * cp * 2};
    const cuuint32_t m_box[3] = {(cuuint32_t)(C::KS * 16), (cuuint32_t)(C::BMT / 16), 1};
    return enc(&m.meta, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<uint32_t *>(ps->meta), m_dim, m_stride, m_box,
               one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The TMA map over the token rows (WgmmaMaps::b): boxes of BN rows x 64 columns; false
// where they cannot be mapped (ssmm_tokens_mappable) or the encoder refuses them.
template <typename T, int BN> bool token_map(const sam_ssmm_params *ps, CUtensorMap &m) {
    constexpr int BK = 64;
    if (!ssmm_tokens_mappable(ps)) return false;
    TensorMapEncodeFn enc = tensor_map_encoder();
    const cuuint32_t one[2] = {1, 1};
    const CUtensorMapDataType vt =
        std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const cuuint64_t dim[2] = {(cuuint64_t)ps->d.C, (cuuint64_t)ps->T}, stride[1] = {(cuuint64_t)ps->ldx * sizeof(T)};
    const cuuint32_t box[2] = {(cuuint32_t)BK, (cuuint32_t)BN};
    return enc(&m, vt, 2, const_cast<void *>(ps->x), dim, stride, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// One launch of tile C: a persistent grid of at most one CTA per SM.  bmap: C::BT's map
// over the token rows.
template <typename T, typename C, bool PRE = false>
sam_status launch(const sam_ssmm_params *ps, cudaStream_t stream, const CUtensorMap *bmap, int nsplit) {
    PrefillArgs k;
    int64_t grid = 0;
    const sam_status st = prefill_args(ps, C::M > 1 ? ps->f.v : C::BK, C::BMT, C::BN, k, grid);
    if (st != SAM_STATUS_OK || grid == 0) return st;
    // (choose_kernel never splits a tile without SPLIT_K; the scheduler's 32-bit item index)
    // (PRE: the pre-activation comes from the epilogue, which a split item does not run)
    if (!C::SPLIT_K || PRE || grid * nsplit > INT32_MAX) nsplit = 1;
    k.nsplit = nsplit;
    grid *= nsplit;
    WgmmaMaps maps;
    if (!weight_maps<T, C>(ps, maps)) {
        set_error("ssmm: cuTensorMapEncodeTiled refused the packed weights (E=%lld, rp=%lld, cp=%lld)",
                  (long long)ps->d.E, (long long)ps->d.rp, (long long)ps->d.cp);
        return SAM_STATUS_UNSUPPORTED;
    }
    if constexpr (C::BT) {
        static_assert(C::BK == 64, "the box of token_map");
        maps.b = *bmap;
    }
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_wgmma_sp_kernel<T, C, PRE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      C::SMEM),
                 "ssmm");
    const int64_t sms = device_sm_count();
    if (sms > 0 && grid > sms) grid = sms;
    if (nsplit == 1) {
        SAM_CUDA_TRY(launch_kernel(ssmm_wgmma_sp_kernel<T, C, PRE>, dim3((unsigned)grid), dim3(C::THREADS), C::SMEM,
                                   stream, pdl_enabled(), k, maps),
                     "ssmm");
        return launch_status("ssmm");
    }
    // split-K: the partial sums in a workspace of this launch alone (stream-ordered, also
    // under graph capture), added up by a second kernel, one CTA per sorted row (offsets
    // are int32: no row at or past 2**31 - 1 is an expert's)
    SAM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void **>(&k.ws), sizeof(float) * (size_t)(nsplit * ps->S * ps->d.R),
                                 stream),
                 "ssmm");
    cudaError_t err = launch_kernel(ssmm_wgmma_sp_kernel<T, C, PRE>, dim3((unsigned)grid), dim3(C::THREADS), C::SMEM,
                                    stream, pdl_enabled(), k, maps);
    if (err == cudaSuccess)
        err = launch_kernel(ssmm_split_reduce_kernel<T>, dim3((unsigned)std::min<int64_t>(ps->S, INT32_MAX)),
                            dim3(SPLIT_REDUCE_THREADS), 0, stream,
                            pdl_enabled(), k);
    const cudaError_t freed = cudaFreeAsync(k.ws, stream);
    SAM_CUDA_TRY(err, "ssmm");
    SAM_CUDA_TRY(freed, "ssmm");
    return launch_status("ssmm");
}

// Tile M, ROWS x TOKENS with the token rows by TMA where `rows` allows and they can be.
template <typename T, int M, int ROWS, int TOKENS>
sam_status launch_tile(const sam_ssmm_params *ps, cudaStream_t stream, sam_token_rows rows, int nsplit) {
    CUtensorMap bm;
    // with the pre-activation (the training forward, whose token rows are gathered): gathered
    if (ps->preact != nullptr && ps->act != SAM_ACT_NONE && rows != SAM_TOKEN_ROWS_TMA)
        return launch<T, WgmmaTile<M, ROWS, TOKENS, false>, true>(ps, stream, nullptr, 1);
    const bool bt = rows != SAM_TOKEN_ROWS_GATHER && token_map<T, TOKENS>(ps, bm);
    if (rows == SAM_TOKEN_ROWS_TMA && !bt) {
        set_error("ssmm: token_rows='tma', but the token rows cannot be read by TMA (they need token_ids None, "
                  "x and its row stride 16-byte aligned, fewer than 2**31 rows)");
        return SAM_STATUS_UNSUPPORTED;
    }
    if (ps->preact != nullptr && ps->act != SAM_ACT_NONE) {
        set_error("ssmm: token_rows='tma' does not write a pre-activation (preact); its rows are gathered");
        return SAM_STATUS_UNSUPPORTED;
    }
    if (bt) return launch<T, WgmmaTile<M, ROWS, TOKENS, true>>(ps, stream, &bm, nsplit);
    return launch<T, WgmmaTile<M, ROWS, TOKENS, false>>(ps, stream, nullptr, nsplit);
}

}  // namespace

bool ssmm_weights_mappable(const sam_ssmm_params *ps) {
    return (uintptr_t)ps->values % 16 == 0 && (uintptr_t)ps->meta % 16 == 0;
}

bool ssmm_tokens_mappable(const sam_ssmm_params *ps) {
    return ps->token_ids == nullptr && (uintptr_t)ps->x % 16 == 0 && (ps->ldx * 2) % 16 == 0 && ps->S < INT32_MAX &&
           ps->T < INT32_MAX && ps->T > 0;
}

bool ssmm_wgmma_sp_available() { return device_runs_sm90a() && tensor_map_encoder() != nullptr; }

sam_status ssmm_wgmma_sp_launch(const sam_ssmm_params *ps, cudaStream_t stream, sam_tile tile, sam_token_rows rows,
                                int nsplit) {
    return with_tc_dtype(ps->dtype, [&](auto t) {
        using T = decltype(t);
        if (ps->f.m == 1) return launch_tile<T, 1, 256, 128>(ps, stream, rows, nsplit);
        switch (tile) {
        case SAM_TILE_256X96: return launch_tile<T, 2, 256, 96>(ps, stream, rows, nsplit);
        case SAM_TILE_256X64: return launch_tile<T, 2, 256, 64>(ps, stream, rows, nsplit);
        default: return launch_tile<T, 2, 128, 128>(ps, stream, rows, nsplit);
        }
    });
}

}  // namespace sam
