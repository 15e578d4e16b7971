// ssmm_wgmma_sp_tile.cuh -- the tiles of the warp-specialised wgmma.sp kernel
// (ssmm_wgmma_sp.cu) and the layout of its shared memory: the ring of stages, the
// epilogue's staging areas, the work slots and the mbarriers.
//
// Tiles (BK = 64 dense columns per stage, NB = ROWS / 128 m64 blocks per consumer):
//   2:4 (M = 1):       256 storage rows (each consumer 2 x m64) x 128 tokens, 4 stages of
//                      34 KB; 128 fp32 accumulators per thread.
//   1:2:V, 256 x 64:   each consumer 2 x m64, each the running total and row 0's share
//                      (row selection, ssmm_work.cuh) x 64 tokens (m64n64k32), 7 stages of
//                      27 KB (gathered token rows: 8, their barriers per pair of stages,
//                      PAIRS); 128 accumulators per thread.
//   1:2:V, 256 x 96:   m64n96k32, 6 stages of 31 KB; 192 accumulators per thread
//                      (setmaxnreg 232 / 40).
//   1:2:V, 128 x 128:  each consumer 1 x m64 x 128 tokens, 7 stages of 26 KB; a gated
//                      item's gate rows are consumer 0's and its up rows consumer 1's
//                      (HANDOVER).
// docs/KERNELS.md ("The wgmma.sp kernel") says why these tiles and ring depths.
#pragma once

#include <cuda.h>  // CUtensorMap

#include "ptx_mma.cuh"

namespace sam {

// Tensor maps of one launch (host: ssmm_wgmma_sp.cu): the packed values as
// [E][rp][cp/2] elements, boxes of ROWS rows x 32 values (64 bytes, 64-byte swizzle:
// the K-major layout wgmma reads through smem_desc_sw64), and the metadata as
// [E][rp/16][cp/2] words, boxes of ROWS/16 row tiles x (KS x 16) words.  With
// TMA_TOKENS, also the token rows x as [T][C] elements, boxes of TOKENS rows x 64
// columns (128 bytes, 128-byte swizzle: the layout wgmma reads through smem_desc_sw128),
// for an identity row map (token_ids null: the rows of an expert are contiguous in x).
struct WgmmaMaps {
    CUtensorMap a, meta, b;
};

// M: accumulator sets per condensed row (1: 2:4, 2: 1:2:V); ROWS x TOKENS: storage rows
// x tokens of a work item; TMA_TOKENS: the token rows by TMA (WgmmaMaps::b), else
// gathered by cp.async.
template <int M_, int ROWS, int TOKENS, bool TMA_TOKENS>
struct WgmmaTile {
    static constexpr int M = M_;
    static constexpr bool BT = TMA_TOKENS;
    static constexpr bool TALL = M == 2 && ROWS == 256;  // 1:2:V in 256 storage rows
    static_assert((M == 1 && ROWS == 256 && TOKENS == 128) ||
                      (M == 2 && ((ROWS == 128 && TOKENS == 128) || (ROWS == 256 && (TOKENS == 64 || TOKENS == 96)))),
                  "2:4: 256 x 128; 1:2:V: 128 x 128, 256 x 64 or 256 x 96");
    static constexpr int NB = ROWS / 128;              // m64 blocks per consumer warpgroup
    static constexpr int BMW = 64 * NB;                // storage rows per consumer
    static constexpr int BMT = ROWS;                   // storage rows per work item
    static constexpr int CPI = 2;                      // consumers per work item
    static constexpr int NSLOT_LOG2 = 1, NSLOT = 1 << NSLOT_LOG2;  // work slots
    static constexpr int BN = TOKENS, BK = 64, KS = BK / 32;  // (TMA_TOKENS: the box of the tokens' map)
    // accumulator arrays of AN registers per thread (one m64 x BN block each): M = 1 one per
    // block; M = 2 the total and row 0's share of each block, block b at 2 b, 2 b + 1
    static constexpr int AN = BN / 2, ASTRIDE = M == 1 ? 1 : 2, NACC = NB * ASTRIDE;
    // M = 2, gated, NB = 1: consumer 0 holds the gate rows of an item and consumer 1 the up
    // rows, handed over through shared memory; TALL: each consumer holds a gate chunk (block
    // 0) and the up chunk of the same rows (block 1)
    static constexpr bool HANDOVER = M > 1 && !TALL;
    static constexpr int THREADS = 384, PTHREADS = 128;
    // registers per thread after setmaxnreg (128 * PREGS + 256 * CREGS <= 384 * 168): more for the
    // consumers where they hold more than 128 accumulators (256 x 96: 192)
    static constexpr bool WIDE_ACC = NACC * AN > 128;
    static constexpr int PREGS = WIDE_ACC ? 40 : M == 1 ? 72 : 64, CREGS = WIDE_ACC ? 232 : 216;
    // split-K's partial store (store_partial) needs registers WIDE_ACC does not have: never split
    static constexpr bool SPLIT_K = !WIDE_ACC;
    // setmaxnreg.inc only takes registers the producer's .dec gave back to the CTA's pool
    // (THREADS x 168 at launch, __launch_bounds__(384, 1)); asking for more never returns
    static_assert(PTHREADS * PREGS + (THREADS - PTHREADS) * CREGS <= THREADS * 168, "setmaxnreg register pool");
    static constexpr int A_BYTES = BMT * 64;           // BK/2 packed values x 2 bytes per row
    static constexpr int B_BYTES = BN * 128;
    static constexpr int META_BYTES = (BMT / 16) * KS * 64;
    static constexpr int IDX_BYTES = M > 1 ? BMT : 0;
    // a multiple of 1024 bytes: B tiles stay on 128-byte-swizzle atoms (wgmma descriptors)
    static constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + META_BYTES + IDX_BYTES + 1023) / 1024 * 1024;
    // PAIRS (the 256 x 64 tile with gathered token rows): the ring's barriers guard pairs of
    // stages, k-tiles 2i and 2i + 1 of an item (every item has an even number of k-tiles and
    // starts at an even ring position), so that a consumer waits on `full`, fences the
    // gathered rows and releases a stage once per two k-tiles, over a ring of eight stages
    static constexpr bool PAIRS = M == 2 && TALL && BN == 64 && !BT;
    static constexpr int ST = M == 1 ? 4 : BN == 96 ? 6 : PAIRS ? 8 : 7;  // stages of the ring
    static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
    // Epilogue staging, one area per consumer: a chunk of the tile's output (tokens x
    // the consumer's output columns, in T, 16-byte pieces XOR-swizzled by token row),
    // written from the accumulators and stored as whole 16-byte pieces of output rows.
    // HANDOVER: the consumers hand each other half of a chunk's tokens through one fp32
    // tile of XT tokens x (BMW * M) columns in consumer 1's staging area, and both stage
    // their outputs into consumer 0's.
    // (PAIRS: 4 KB, 16-token chunks, which leaves room for the eighth stage)
    static constexpr int STG_BYTES = PAIRS ? 4096 : 8192;
    static constexpr int XT = 32, XS = BMW * M + 4;
    static constexpr int STG_OFF = PIPE_BYTES, XCH_OFF = STG_OFF + STG_BYTES;
    static constexpr int EPI_BYTES = STG_BYTES + (HANDOVER && XT * XS * 4 > STG_BYTES ? XT * XS * 4 : STG_BYTES);
    // NSLOT work slots, each: BN token rows, BN routing scales, (e, rt, s0, split)
    static constexpr int SLOT_OFF = STG_OFF + EPI_BYTES, SLOT_BYTES = BN * 8 + 32;
    static constexpr int BAR_OFF = SLOT_OFF + NSLOT * SLOT_BYTES;  // full[ST] empty[ST] tfull[NSLOT] tempty[NSLOT]
    static constexpr int SMEM = BAR_OFF + (2 * ST + 2 * NSLOT) * 8 + 1024;  // + alignment slack
    static_assert(SMEM <= 227 * 1024, "shared memory");
    // A (TMA, 64-byte swizzle, read by smem_desc_sw64): rows of 64 bytes; B: rows of
    // 128 bytes in the 128-byte swizzle (smem_desc_sw128)
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }
};

// Named barriers of the kernel (bar.sync ids; 0 is __syncthreads): the producer warpgroup,
// both consumer warpgroups together, and consumer c alone (BAR_CONSUMER0 + c).
enum WgmmaBarrier : int { BAR_CONSUMERS = 2, BAR_PRODUCER = 3, BAR_CONSUMER0 = 4 };

// Addresses in a CTA's shared memory (base aligned to 1024 bytes): the stages of the
// ring, the mbarriers (full / empty per stage: the stage's bytes landed / its wgmmas are
// done; tfull / tempty per work slot: the item is decoded / its epilogue is done), and
// the work slots (int32 tok[BN], float scale[BN], then e, rt, s0 as int64, and the K split).
template <typename C> struct WgmmaSmem {
    unsigned char *smem;
    uint32_t bar0;
    __device__ __forceinline__ explicit WgmmaSmem(unsigned char *base)
        : smem(base), bar0(smem_u32(base + C::BAR_OFF)) {}
    __device__ __forceinline__ uint32_t full_bar(int s) const { return bar0 + 8u * s; }
    __device__ __forceinline__ uint32_t empty_bar(int s) const { return bar0 + 8u * (C::ST + s); }
    __device__ __forceinline__ uint32_t tfull_bar(int s) const { return bar0 + 8u * (2 * C::ST + s); }
    __device__ __forceinline__ uint32_t tempty_bar(int s) const { return bar0 + 8u * (2 * C::ST + C::NSLOT + s); }
    __device__ __forceinline__ int32_t *slot_tok(int s) const {
        return reinterpret_cast<int32_t *>(smem + C::SLOT_OFF + s * C::SLOT_BYTES);
    }
    __device__ __forceinline__ float *slot_scale(int s) const { return reinterpret_cast<float *>(slot_tok(s) + C::BN); }
    __device__ __forceinline__ int32_t *slot_info(int s) const { return slot_tok(s) + 2 * C::BN; }
    __device__ __forceinline__ unsigned char *stage_ptr(int st) const { return smem + st * C::STAGE_BYTES; }
};

}  // namespace sam
