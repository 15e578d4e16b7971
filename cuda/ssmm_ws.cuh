// ssmm_ws.cuh -- the warp-specialised Hopper kernel of ssmm (wgmma.mma_async.sp,
// sm_90a).  Included by ssmm.cu inside its namespace: it shares KParams and the work
// decoding (count_token_tiles, decode_tile, tile_s0, row_token) of the other two
// kernels there.
//
// Computes what every ssmm kernel computes (csrc/ssmm_ref.c):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
//
// CTA = 3 warpgroups on a persistent grid (one CTA per SM; SAMOYEDS_WGMMA_KERNEL=3
// launches one CTA per work item instead; 4, 5 and 6 select the ping-pong, cluster and
// work-counter variants of WsCfg below, measured in docs/PERFORMANCE.md, not run by
// auto).  A CTA walks the work items blockIdx.x, blockIdx.x + gridDim.x, ... in the
// rasterised order of cta_work (ssmm.cu), each item BMT storage rows x BN = 128 tokens
// of one expert, through two work slots in
// shared memory (token rows, routing scales, expert / row tile / first sorted row):
// the producer fills slot n % 2 once the consumers have released item n - 2, so
// it streams item n + 1 while the consumers finish and store item n.
//
// Warpgroup 0 is the producer: warp 0 decodes the next item, every thread loads
// one token row and scale of it; then one elected thread streams the packed values
// and the 2:4 metadata of each k-tile with TMA (cp.async.bulk.tensor, completing
// on the stage's `full` mbarrier by transaction bytes), and all 128 threads gather
// the BN token rows straight from x by index with cp.async (TMA cannot gather rows
// on sm_90), each thread ending its stage with cp.async.mbarrier.arrive.noinc, so
// a stage is marked full by the hardware the moment its bytes have landed and the
// producer never waits on its own copies: it only waits for a free stage (`empty`).
// Where x is read without a row map (token_ids null, as the down projection reads its
// intermediate rows; WsCfg::BT), an expert's rows are contiguous and the TMA thread loads
// them too, as one 128-row box per k-tile (docs/PERFORMANCE.md, v11: 1.2-1.35x over the
// gather on the same rows); the other producer threads, which then load nothing, still
// walk the ring and arrive on each stage's `full` barrier (docs/PERFORMANCE.md, "A hang").
// Warpgroups 1 and 2 are consumers: they wait on `full`, load the k-tile's metadata
// words into registers and issue its wgmma.sp with both operands read by the tensor
// cores from shared memory through descriptors (the packed values in the 64-byte
// swizzle TMA wrote, the tokens in the 128-byte swizzle), keep one k-tile of wgmmas
// in flight, and arrive on the `empty` mbarrier of a stage once the wgmmas that
// read it are done.  No CTA-wide barrier anywhere; setmaxnreg gives the consumers
// 216 registers and the producer 72.
//
// Epilogue, per consumer warpgroup and outside the ring (so it overlaps the
// producer's next item): bias, activation and routing scale on the accumulators
// in fp32, one rounding to T into an 8 KB staging chunk (WsCfg::PAIRS: 4 KB), then
// whole 16-byte pieces of output rows.  A gated item's gate and up rows are the two m64 blocks of one
// consumer (a GLU chunk pair, samoyeds_layout.h); in the 128 x 128 1:M:V tile they
// are consumer 0's and consumer 1's, and each hands the other the rows of half of
// the tokens in fp32, each computing the activation of its half.
//
// Tiles (BK = 64 dense columns per stage, NB m64 blocks per consumer):
//   2:4 (M = 1):     BM = 256 storage rows (each consumer 2 x m64) x 128 tokens,
//                    4 stages of 34 KB; 128 fp32 accumulators per thread.
//   1:M:V (M = 2), TALL = 64 (SAMOYEDS_WS_TILE=1; ws_tall_tile in ssmm.cu): BM = 256 storage rows
//                    (each consumer 2 x m64, each the running total and row 0's
//                    share, below) x 64 tokens (m64n64k32), 7 stages of 27 KB (gathered
//                    token rows: 8, their barriers per pair of stages, WsCfg::PAIRS);
//                    128 accumulators per thread.
//   1:M:V, TALL = 96 (SAMOYEDS_WS_TILE=2): 256 storage rows x 96 tokens (m64n96k32), 6 stages
//                    of 31 KB; 192 accumulators per thread (setmaxnreg 232 / 40).
//   1:M:V, 128 x 128 (SAMOYEDS_WS_TILE=0): BM = 128 storage rows (each consumer
//                    1 x m64) x 128 tokens, 7 stages of 26 KB.
// The taller tiles halve the token bytes per issued FLOP against 128 x 128 (for
// 1:2:V at the same bytes per FLOP in all: twice the weight bytes, which TMA
// streams, for half the gathered token rows) and leave less of a token tile empty.
// docs/PERFORMANCE.md has the measurements (v7: weights by TMA; v9: persistent).
//
// Row selection (1:2:V) without moving the accumulators, as in the other kernels
// (fold_row_set, common.cuh): wgmma always accumulates both rows' slices into one
// running total T (acc[0], never moved), and acc[1] keeps D, the sum of the slices that
// belong to row 0 of the pair.  At every V boundary the warpgroup drains its wgmmas and
// adds (c_prev - c_next) T to D (c = 1 where a slice selects row 0): one FFMA per
// accumulator with a coefficient of -1, 0 or 1, a third of the instructions of swapping
// two sets.  After the last slice acc[1] is row 0 (D) and acc[0] row 1 (T - D).
#pragma once

// Tensor maps of one launch (host: ws_tensor_maps in ssmm.cu): the packed values
// as [E][rp][cp/2] elements, boxes of BMT rows x 32 values (64 bytes, 64-byte
// swizzle: the K-major layout wgmma reads through smem_desc_sw64), and the metadata as
// [E][rp/16][cp/2] words, boxes of BMT/16 row tiles x (KS x 16) words.
// With WsCfg::BT, also the token rows x as [T][C] elements, boxes of BN rows x
// 64 columns (128 bytes, 128-byte swizzle: the layout wgmma reads through smem_desc_sw128),
// for an identity row map (token_ids null: the rows of an expert are contiguous in x).
struct WsMaps {
    CUtensorMap a, meta, b;
};

// PP = false: cooperative, both consumers on one item (BMT = 2 x BMW rows).  PP = true
// (2:4 only): ping-pong, each consumer a whole item of BMW = 128 rows, the two taking
// alternate items, so one's epilogue runs while the other's wgmmas keep the tensor
// cores busy.  Each consumer has a ring of its own, half of the stages.
//
// CL = 2: clusters of two CTAs on the persistent grid, each cluster walking pairs of
// work items of one expert and row tile and consecutive token tiles (rank r takes the
// pair's token tile r); each CTA's TMA thread loads half of the packed values and
// metadata of a k-tile and multicasts it to both, so the weights come out of L2 once
// per pair.  A stage's `empty` barrier then counts the consumer warps of both CTAs.
//
// DYN: the CTAs take the work items in the same rasterised order from a counter in global
// memory (KParams::work) instead of blockIdx.x + n * gridDim.x.
//
// BT: the token rows by TMA (WsMaps::b), for x read without a row map.
// Stages of the ring (2:4 / 1:M:V; BT: token rows by TMA); overridable at build time
// (SAMOYEDS_NVCC_FLAGS=-DSAM_WS_STAGES_M1=...) for ring-depth measurements.
#ifndef SAM_WS_STAGES_M1
#define SAM_WS_STAGES_M1 4  // 2:4: 4 measured faster than 6 on long K
#endif
#ifndef SAM_WS_PAIRS
#define SAM_WS_PAIRS 1  // the 256 x 64 tile on gathered rows: barriers per pair of stages (WsCfg::PAIRS)
#endif
#ifndef SAM_WS_STAGES_M2
#define SAM_WS_STAGES_M2 7
#endif
#ifndef SAM_WS_STAGES_M1_BT
#define SAM_WS_STAGES_M1_BT SAM_WS_STAGES_M1
#endif
#ifndef SAM_WS_STAGES_M2_BT
#define SAM_WS_STAGES_M2_BT SAM_WS_STAGES_M2
#endif
#ifndef SAM_WS_STAGES_PAIRS
#define SAM_WS_STAGES_PAIRS 8  // WsCfg::PAIRS: four pairs of 27 KB stages (the staging areas then 4 KB)
#endif
#ifndef SAM_WS_STAGES_T96
#define SAM_WS_STAGES_T96 6  // 1:2:V, 256 x 96: 31 KB stages, six fit
#endif
template <int M_, bool PP_ = false, int CL_ = 1, bool DYN_ = false, bool BT_ = false, int TALL_ = 0>
struct WsCfg {
    static constexpr int M = M_;
    static constexpr bool BT = BT_;
    static constexpr bool TALL = TALL_ != 0;  // TALL_: the tall tile's tokens (64 or 96), 0: 128 x 128
    static_assert(TALL_ == 0 || TALL_ == 64 || TALL_ == 96, "the tall tile holds 64 or 96 tokens");
    static constexpr bool PP = PP_;
    static constexpr int CL = CL_;
    static constexpr bool DYN = DYN_;
    static_assert(!DYN || CL == 1, "the work counter hands out single items");
    static_assert(!PP || M == 1, "ping-pong consumers: 2:4 only (1:M:V needs both consumers' registers per item)");
    static_assert(CL == 1 || (CL == 2 && !PP), "clusters of 2, cooperative consumers");
    static_assert(!TALL || (M == 2 && !PP), "the tall 1:M:V tile: 1:2:V, cooperative");
    static constexpr int NB = M == 1 || TALL ? 2 : 1;  // m64 blocks per consumer warpgroup
    static constexpr int BMW = 64 * NB;                // storage rows per consumer
    static constexpr int BMT = PP ? BMW : 2 * BMW;     // storage rows per work item
    static constexpr int CPI = PP ? 1 : 2;             // consumers per work item
    static constexpr int NSLOT_LOG2 = PP ? 2 : 1, NSLOT = 1 << NSLOT_LOG2;  // work slots
    static constexpr int BN = TALL ? TALL_ : 128, BK = 64, KS = BK / 32;  // (BT: the box of ws_tokens_map)
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
    // setmaxnreg.inc only takes registers the producer's .dec gave back to the CTA's pool
    // (THREADS x 168 at launch, __launch_bounds__(384, 1)); asking for more never returns
    static_assert(PTHREADS * PREGS + (THREADS - PTHREADS) * CREGS <= THREADS * 168, "setmaxnreg register pool");
    static constexpr int A_BYTES = BMT * 64;           // BK/2 packed values x 2 bytes per row
    static constexpr int B_BYTES = BN * 128;
    static constexpr int META_BYTES = (BMT / 16) * KS * 64;
    static constexpr int IDX_BYTES = M > 1 ? BMT : 0;
    static constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + META_BYTES + IDX_BYTES + 1023) / 1024 * 1024;
    // PAIRS (the 256 x 64 tile with gathered token rows; SAM_WS_PAIRS): the ring's barriers
    // guard pairs of stages, k-tiles 2i and 2i + 1 of an item (every item has an even number
    // of k-tiles and starts at an even ring position), so that a consumer waits on `full`,
    // fences the gathered rows and releases a stage once per two k-tiles, over a ring of
    // eight stages (docs/PERFORMANCE.md, v20)
    static constexpr bool PAIRS = SAM_WS_PAIRS && M == 2 && TALL_ == 64 && !BT;
    static constexpr int ST = PP ? 8 : M == 1 ? (BT ? SAM_WS_STAGES_M1_BT : SAM_WS_STAGES_M1)
                                              : BN == 96 ? SAM_WS_STAGES_T96
                                              : PAIRS ? SAM_WS_STAGES_PAIRS
                                              : (BT ? SAM_WS_STAGES_M2_BT : SAM_WS_STAGES_M2);
    static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
    // Epilogue staging, one area per consumer: a chunk of the tile's output (tokens x
    // the consumer's output columns, in T, 16-byte pieces XOR-swizzled by token row),
    // written from the accumulators and stored as whole 16-byte pieces of output rows.
    // M > 1 with a gated activation: the gate rows of a CTA are consumer 0's, the up
    // rows consumer 1's; they hand each other half of a chunk's tokens through one fp32
    // tile of XT tokens x (BMW * M) columns in consumer 1's staging area, and both stage
    // their outputs into consumer 0's.
    // (PAIRS: 4 KB, 16-token chunks, which leaves room for the eighth stage)
    static constexpr int STG_BYTES = PAIRS ? 4096 : 8192;
    static constexpr int XT = 32, XS = BMW * M + 4;
    static constexpr int STG_OFF = PIPE_BYTES, XCH_OFF = STG_OFF + STG_BYTES;
    static constexpr int EPI_BYTES = STG_BYTES + (HANDOVER && XT * XS * 4 > STG_BYTES ? XT * XS * 4 : STG_BYTES);
    // NSLOT work slots, each: BN token rows, BN routing scales, (e, rt, s0)
    static constexpr int SLOT_OFF = STG_OFF + EPI_BYTES, SLOT_BYTES = BN * 8 + 16;
    static constexpr int BAR_OFF = SLOT_OFF + NSLOT * SLOT_BYTES;  // full[ST] empty[ST] tfull[NSLOT] tempty[NSLOT]
    static constexpr int SMEM = BAR_OFF + (2 * ST + 2 * NSLOT) * 8 + 1024;  // + alignment slack
    static_assert(SMEM <= 227 * 1024, "shared memory");
    // A (TMA, 64-byte swizzle, read by smem_desc_sw64): rows of 64 bytes; B: rows of
    // 128 bytes in the 128-byte swizzle (smem_desc_sw128)
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, 1) ssmm_ws_kernel(const KParams p, const __grid_constant__ WsMaps tm) {
#ifdef SAM_HAS_WGMMA
    constexpr int M = C::M, NB = C::NB, BMW = C::BMW, BMT = C::BMT, BN = C::BN, BK = C::BK, KS = C::KS,
                  ST = C::ST, PT = C::PTHREADS, NSLOT = C::NSLOT, CL = C::CL;
    constexpr bool PP = C::PP;
    // Ping-pong: one ring of RS = ST / 2 stages per consumer, item n on ring n % 2, so that a
    // consumer waits on every phase of the stages it reads (on one shared ring it would skip the
    // other's positions, and a parity wait for a stage whose previous phase, the other
    // consumer's, has not completed yet reads as done).  Cooperative: one ring of ST.
    constexpr int RS = PP ? ST / 2 : ST;
    static_assert(!PP || ST % 2 == 0, "ping-pong: two rings of ST / 2 stages");
    constexpr bool PAIRS = C::PAIRS;
    static_assert(!PAIRS || RS % 2 == 0, "pairs of stages: an even ring");
    // the stage of position it of ring `ring` (a macro: as a lambda it changed the cooperative
    // kernels' register allocation)
#define SAM_WS_STAGE(ring, it) (PP ? (ring) * RS + (int)((it) % RS) : (int)((it) % ST))
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = align_smem(smem_raw);
    const uint32_t bar0 = smem_u32(smem + C::BAR_OFF);
    auto full_bar = [&](int s) { return bar0 + 8u * s; };
    auto empty_bar = [&](int s) { return bar0 + 8u * (ST + s); };
    auto tfull_bar = [&](int s) { return bar0 + 8u * (2 * ST + s); };
    auto tempty_bar = [&](int s) { return bar0 + 8u * (2 * ST + NSLOT + s); };
    // work slot: int32 tok[BN], float scale[BN], then e, rt, and s0 as int64
    auto slot_tok = [&](int s) { return reinterpret_cast<int32_t *>(smem + C::SLOT_OFF + s * C::SLOT_BYTES); };
    auto slot_scale = [&](int s) { return reinterpret_cast<float *>(slot_tok(s) + BN); };
    auto slot_info = [&](int s) { return slot_tok(s) + 2 * BN; };
    auto stage_ptr = [&](int st) { return smem + st * C::STAGE_BYTES; };
    const int tid = threadIdx.x;
    const uint32_t rank = CL == 1 ? 0u : cluster_rank();
    const int KT = (int)(p.cp / BK);  // even: columns are padded to 128
    // parts left out, for measurements (SAM_WS_DROP in ssmm.cu; 0 in release builds)
#if SAM_WS_DROP
    const int drop = p.drop;
#else
    constexpr int drop = 0;
#endif
    const int kt_per_slice = M > 1 ? p.V / BK : 1;
    // BT: the token rows of a k-tile come as one TMA box, so only the TMA thread and the
    // threads that load row-selection indices (M > 1) copy anything into a stage
    constexpr bool b_tma = C::BT;
    constexpr int IDX_THREADS = M > 1 ? BMT / 16 : 0;
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            // every producer thread's arrival (its cp.asyncs landed; b_tma: a plain arrival
            // where it copies nothing) + the TMA thread's expect_tx
            mbar_init(full_bar(s), PT + 1);
            // the item's consumer threads; clusters: the consumer warps of both CTAs
            mbar_init(empty_bar(s), CL == 1 ? C::CPI * 128 : CL * 8);
        }
        for (int s = 0; s < NSLOT; s++) {
            mbar_init(tfull_bar(s), PT);               // the producer threads, each after its token row
            mbar_init(tempty_bar(s), C::CPI * 128);  // the item's consumers, after their epilogue
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tma_prefetch_map(&tm.a);
        tma_prefetch_map(&tm.meta);
        if constexpr (b_tma) tma_prefetch_map(&tm.b);
    }
    if (CL == 1) __syncthreads();
    else cluster_sync();  // the peer multicasts into this CTA's stages from now on
    // A programmatic dependent launch (common.cuh; SAMOYEDS_WS_PDL in ssmm.cu): the barriers
    // above are set up while the kernel before ends, nothing below reads or writes before it
    // has; the kernel after launches as this one's CTAs end (or from here, p.pdl_trigger).
    pdl_wait();
    if (p.pdl_trigger) pdl_trigger();

    const int wg = tid / 128;
    if (wg == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<C::PREGS>();
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
        const bool drop_b = (drop & 2) != 0, drop_a = (drop & 4) != 0, drop_v = (drop & 32) != 0 && CL == 1;
        const uint32_t TX = (drop_a ? 0u : (drop_v ? 0u : C::A_BYTES) + C::META_BYTES) + (b_tma && !drop_b ? C::B_BYTES : 0u);
        const int total = warp == 0 ? count_token_tiles<BN * CL>(p, lane) : 0;  // (clusters: token tile pairs)
        uint32_t it = 0;      // stages issued into the ring of item n: slot it % RS, phase it / RS
        uint32_t it_alt = 0;  // ping-pong: into the other ring
        int ends = 0;     // end-of-work records written (ping-pong: one per consumer)
        for (int n = 0;; n++) {
            if constexpr (PP) {  // item n on ring n % 2
                if (n > 0) {
                    const uint32_t t = it;
                    it = it_alt;
                    it_alt = t;
                }
            }
            const int slot = n & (NSLOT - 1);
            int32_t *tok = slot_tok(slot), *info = slot_info(slot);
            if (warp == 0) {  // work item n of this CTA into its slot, once its consumers are done with item n-NSLOT
                if (n >= NSLOT) mbar_wait(tempty_bar(slot), ((n >> C::NSLOT_LOG2) - 1) & 1);
                int e, rt, tt;
                int64_t L;
                if constexpr (C::DYN) {
                    unsigned long long w = 0;
                    if (lane == 0) w = atomicAdd(p.work, 1ull);
                    L = (int64_t)__shfl_sync(0xffffffffu, w, 0);
                } else {
                    L = CL == 1 ? (int64_t)blockIdx.x + (int64_t)n * gridDim.x
                                : (int64_t)cluster_id() + (int64_t)n * cluster_count();
                }
                decode_tile<BN * CL>(p, L, total, lane, e, rt, tt);
                if (lane == 0) {
                    info[0] = e;
                    info[1] = rt;
                    // clusters: token tile 2 tt + rank (past the expert's rows for an odd tile count: no tokens)
                    *reinterpret_cast<int64_t *>(info + 2) = e >= 0 ? tile_s0<BN * CL>(p, e, tt) + rank * BN : 0;
                }
            }
            named_barrier_sync(3, PT);  // the item is decoded (producer warpgroup)
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
                    slot_scale(slot)[tid] = sc;
                }
                mbar_arrive(tfull_bar(slot));
            }
            if (e < 0) {
                if (++ends == (PP ? 2 : 1)) break;  // an end record for each consumer's item sequence
                continue;
            }
            named_barrier_sync(3, PT);  // every token row of the slot is written
            const int64_t row0 = (int64_t)info[1] * BMT;
            const int s0 = b_tma ? (int)*reinterpret_cast<const int64_t *>(info + 2) : 0;  // BT: S < 2**31 (host)
            const T *b_src[B_CH];
            unsigned b_ok = 0;
#pragma unroll
            for (int i = 0; i < B_CH; i++) {
                const int t = tok[b_row + 16 * i];
                b_ok |= (unsigned)(t >= 0) << i;
                // an absent row reads row 0 (in bounds; its copy is zero-filled); advanced by BK a k-tile
                b_src[i] = x + (t >= 0 ? (int64_t)t * p.ldx : 0) + b_ch * 8;
            }
            const bool i_ok = i_load && row0 + tid * 16 < p.rp;
            const uint8_t *i_src = M > 1 ? p.idx + (int64_t)e * p.slices * p.rp + (i_ok ? row0 + tid * 16 : 0) : nullptr;
            int slice = 0, slice_left = kt_per_slice;  // (M > 1: the k-tile's slice, without a division)
            for (int kt = 0; kt < KT; kt++, it++) {
                const int s = SAM_WS_STAGE(n & 1, it);
                // PAIRS: the barriers of a pair of stages are the even stage's; a pair is waited
                // for at its first k-tile, expects both k-tiles' bytes, and is marked full by every
                // producer thread's arrival after its second k-tile (covering both k-tiles' copies)
                const int sb = PAIRS ? (s & ~1) : s;
                const bool pair_first = !PAIRS || (kt & 1) == 0, pair_last = !PAIRS || (kt & 1) == 1;
                if (pair_first && it >= RS) mbar_wait(empty_bar(sb), ((it / RS) - 1) & 1);
                const uint32_t base = smem_u32(stage_ptr(s));
                if (tid == 0) {
                    // (clusters: both halves land here)
                    if (pair_first) mbar_arrive_expect_tx(full_bar(sb), PAIRS ? 2 * TX : TX);
                    if (drop_a) {  // (measurement builds: the stage is marked full without them)
                    } else if constexpr (CL == 1) {
                        if (!drop_v) tma_load_3d(base, &tm.a, kt * (BK / 2), (int)row0, e, full_bar(sb));
                        tma_load_3d(base + C::A_BYTES + C::B_BYTES, &tm.meta, kt * KS * 16, (int)(row0 / 16), e,
                                    full_bar(sb));
                    } else {  // this rank's half of the rows, to both CTAs
                        constexpr int HR = BMT / CL;
                        tma_load_3d_mc(base + rank * (C::A_BYTES / CL), &tm.a, kt * (BK / 2), (int)row0 + rank * HR, e,
                                       full_bar(sb), (uint16_t)((1u << CL) - 1));
                        tma_load_3d_mc(base + C::A_BYTES + C::B_BYTES + rank * (C::META_BYTES / CL), &tm.meta,
                                       kt * KS * 16, (int)(row0 / 16) + rank * (HR / 16), e, full_bar(sb),
                                       (uint16_t)((1u << CL) - 1));
                    }
                    // the item's rows s0 .. s0 + BN - 1 of x; rows past the expert belong to
                    // the next one (their output columns are never stored), rows past T and
                    // columns past C are zero-filled
                    if constexpr (b_tma) {
                        if (!drop_b) tma_load_2d(base + C::A_BYTES, &tm.b, kt * BK, s0, full_bar(sb));
                    }
                }
                if (!b_tma && !drop_b) {
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
                    cp_async16(base + C::A_BYTES + C::B_BYTES + C::META_BYTES + tid * 16,
                               i_src + (int64_t)slice * p.rp, i_ok);
                if (M > 1 && --slice_left == 0) {
                    slice++;
                    slice_left = kt_per_slice;
                }
                // Every producer thread arrives, also where it copies nothing by cp.async (b_tma:
                // a plain arrival from all but the index loaders).  A thread that waits on `empty` without
                // arriving on `full` is held back by nothing: asleep through two phases of a
                // stage's barrier, it waits on a parity come round again, for good (the hang of
                // docs/PERFORMANCE.md).  Arriving, it holds each phase until it has seen the last.
                if (pair_last) {
                    if (!b_tma || i_load) cp_async_mbar_arrive(full_bar(sb));
                    else mbar_arrive(full_bar(sb));
                }
            }
        }
        cp_async_wait<0>();
        if (CL > 1) cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
        return;
    }
    // ---------------- consumers ----------------
    setmaxnreg_inc<C::CREGS>();
    const int c = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;  // warp of its warpgroup
    const int g = lane >> 2, q = lane & 3;
    // M = 1: two m64 blocks.  What wgmma writes is not zero-filled: the first k-tile's
    // wgmmas start from zero (scale-d = 0), so no ordinary instruction defines an
    // accumulator while wgmmas are in flight.  M = 2: of block b, acc[2b] the running
    // total T of both rows of a pair, acc[2b + 1] row 0's share D (row selection, above),
    // both set to zero before an item's first wgmma.
    constexpr int AN = C::AN, ASTRIDE = C::ASTRIDE, NACC = C::NACC, NT8 = BN / 8;
    float acc[NACC][AN];
    constexpr bool zero_init = M > 1;
    uint32_t sel[NB][2];  // M = 2: the row the previous slice selected, for row hh of block b (fold_row_set)
    uint32_t ef[2][NB][KS];
    const int crow = PP ? 0 : c * BMW;  // first storage row of this consumer in the item
#if SAM_WS_A_REGS
    // measurement builds with SAM_WS_A_REGS: every wgmma takes these registers as its packed
    // A tile instead of reading the stage's (what A in registers would cost; not the product)
    const uint32_t a_regs[4] = {0x3c003c00u ^ (uint32_t)lane, 0x3c003c00u, 0x3c003c00u ^ (uint32_t)g, 0x3c003c00u};
#endif

    // the metadata words of the k-tile (the packed values stay in shared memory)
    auto load_meta = [&](auto par_c, int st) {
        constexpr int par = decltype(par_c)::value;
        const uint32_t *mt_s = reinterpret_cast<const uint32_t *>(stage_ptr(st) + C::A_BYTES + C::B_BYTES);
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                ef[par][b][ks] = mt_s[((crow / 16 + b * 4 + warp) * KS + ks) * 16 + 2 * g + (q & 1)];
    };
    // at the first k-tile of a slice: the last slice's total folded into row 0's share
    // (fold_row_set, common.cuh: set 0 = acc[0] the total, set 1 = acc[1] the share)
    auto select_rows = [&](int st) {
        const uint8_t *idx_s = stage_ptr(st) + C::A_BYTES + C::B_BYTES + C::META_BYTES;
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const uint32_t want = idx_s[crow + b * 64 + warp * 16 + g + 8 * hh];
                fold_row_set<M, NT8>([&](int a, int j, int k) -> float & { return acc[b * ASTRIDE + a][4 * j + k]; },
                                     sel[b][hh], want, hh);
            }
    };
    // the wgmmas that read stage st are done: one arrival per thread, or (clusters) one
    // per warp on the stage's barrier in both CTAs, whose producers both write it
    auto release = [&](int st) {
        if constexpr (CL == 1) {
            mbar_arrive(empty_bar(st));
        } else {
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(empty_bar(st));
                mbar_arrive_cluster(empty_bar(st), rank ^ 1u);
            }
        }
    };
    // k-tile kt of the item, ring position it; `boundary`: the first k-tile of a slice
    auto step = [&](auto par_c, int kt, uint32_t it, bool boundary) {
        constexpr int par = decltype(par_c)::value;
        const int st = SAM_WS_STAGE(c, it);
        if (!PAIRS || par == 0) {  // PAIRS: the pair of stages st, st + 1 at once
            mbar_wait(full_bar(st), (it / RS) & 1);
            // the token rows came through the generic proxy (cp.async); BT: every operand by TMA
            // (the row-selection indices, by cp.async, are read by ordinary loads)
            if constexpr (!C::BT) fence_proxy_async();
        }
        load_meta(par_c, st);
        if (M > 1 && boundary) {
            wgmma_wait<0>();
#pragma unroll
            for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
            if (!(drop & 8)) select_rows(st);
#pragma unroll
            for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
        }
        const uint32_t sa = smem_u32(stage_ptr(st)), sb = sa + C::A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#if SAM_WS_A_REGS
                WgmmaSpRS<T, BN>::run(acc[b * ASTRIDE], a_regs, smem_desc_sw128(sb + ks * 64), ef[par][b][ks],
                                      zero_init || kt > 0 || ks > 0);
#else
                WgmmaSpSS<T, BN>::run(acc[b * ASTRIDE], smem_desc_sw64(sa + (crow + b * 64) * 64 + ks * 32),
                                      smem_desc_sw128(sb + ks * 64), ef[par][b][ks], zero_init || kt > 0 || ks > 0);
#endif
        wgmma_commit();
        wgmma_wait<1>();
        // the wgmmas of the k-tile before are done (PAIRS: and of the pair before)
        if ((!PAIRS || par == 0) && kt > 0) release(SAM_WS_STAGE(c, it - 1) & (PAIRS ? ~1 : ~0));
    };

    T *out = static_cast<T *>(p.out);
    const bool vec_ok = p.ldo % 8 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
    const int wtid = tid & 127;  // thread of its warpgroup
    auto bias_at = [&](int64_t i) { return load_as_float(p.bias, p.bias_dtype, i); };
    float *xch = reinterpret_cast<float *>(smem + C::XCH_OFF);
    unsigned char *stg = smem + C::STG_OFF + c * C::STG_BYTES;

    // ---- epilogue, from the accumulators: thread (warp, g, q) holds storage rows
    // crow + b*64 + warp*16 + g + 8hh and tokens j*8 + 2q + t at acc[b * ASTRIDE + set][4j + 2hh + t].
    // Bias, activation and routing scale in fp32 in the order of store_tile, rounded
    // once; then whole 16-byte pieces of output rows, chunk by chunk.
    auto epilogue = [&](auto gated_c, const int32_t *tok, const float *scl, int e, int64_t row0, int64_t s0) {
        constexpr bool GATED = decltype(gated_c)::value;
        constexpr bool HANDOVER = C::HANDOVER && GATED;  // the consumers pair gate and up rows via xch
        // output blocks of a consumer: one per m64 block, or one from a gate and an up block
        // (M = 1 and TALL gated; HANDOVER: from this consumer's block and the partner's)
        constexpr int OB = GATED ? 1 : NB;
        constexpr int OCW = OB * 64 * M;                           // output columns of a consumer
        constexpr int PR = OCW / 8;                               // 16-byte pieces per staged row
        constexpr int TC = C::STG_BYTES / (OCW * 2), JC = TC / 8;  // tokens per chunk
        static_assert(!HANDOVER || TC == C::XT, "hand-over chunk");
        static_assert(BN % TC == 0 && JC >= 1, "staging chunks");
        // HANDOVER: consumer c computes the n8 token blocks jj in [c JC/2, (c+1) JC/2) of
        // every chunk, from its own rows and the partner's, handed over in fp32 through
        // xch; both stage into consumer 0's area
        unsigned char *const sbase = HANDOVER ? smem + C::STG_OFF : stg;
        const int64_t ocol0 = M == 1 ? (GATED ? (row0 / 128) * 64 + (PP ? 0 : c * 64) : row0 + crow)
                                     : (GATED ? (HANDOVER ? row0 : row0 + crow) : (row0 + crow) * 2);
        const int lr = warp * 16 + g;  // + 8 hh
        // this thread's output column of output block ob, row hh, column x of its row's group
        // (M = 2: the pair's row x; M = 1: x = 0)
        auto colw = [&](int ob, int hh, int x) { return ((ob * 64 + lr + 8 * hh) * M) + x; };
        float bz[OB][2][M][GATED ? 2 : 1] = {};  // [ob][hh][x][gate, up]
        if (p.bias) {
#pragma unroll
            for (int ob = 0; ob < OB; ob++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
#pragma unroll
                    for (int x = 0; x < M; x++)
#pragma unroll
                        for (int u = 0; u < (GATED ? 2 : 1); u++) {
                            const int64_t col = ocol0 + colw(ob, hh, x);
                            if (col < p.out_cols) bz[ob][hh][x][u] = bias_at((int64_t)e * p.R + u * (p.R / 2) + col);
                        }
        }
        auto stg_at = [&](int tl, int cw) {  // staged element (token tl of the chunk, column cw)
            return sbase + tl * (OCW * 2) + ((((cw >> 3) ^ (tl & 7)) << 4) | ((cw & 7) * 2));
        };
        auto consumer_sync = [&]() {
            if (HANDOVER) named_barrier_sync(2, 256);
            else named_barrier_sync(4 + c, 128);
        };
        // the value of block b at accumulator i for row x of its group (M = 2: set 1 holds
        // row 0, set 0 row 1 of each pair)
        auto val = [&](int b, int i, int x) -> float {
            if constexpr (M == 1) return acc[b][i];
            else return x == 0 ? acc[b * ASTRIDE + 1][i] : acc[b * ASTRIDE][i];
        };
        // M > 1: this thread's column pair at accumulator i (its row hh = (i / 2) % 2), as (column 0, column 1)
        auto pair_at = [&](int i) { return make_float2(val(0, i, 0), val(0, i, M - 1)); };
        // the staged chunk ch as whole 16-byte pieces of output rows, by NTHR threads from id0
        auto store_chunk = [&](auto nthr_c, int ch, int id0) {
            constexpr int NTHR = decltype(nthr_c)::value;
#pragma unroll
            for (int r = 0; r < TC * PR / NTHR; r++) {
                const int id = id0 + NTHR * r, tl = id / PR, pc = id % PR, ltok = ch * TC + tl;
                if (tok[ltok] < 0) continue;
                const int64_t col = ocol0 + pc * 8;
                if (col >= p.out_cols) continue;
                const uint4 v = *reinterpret_cast<const uint4 *>(sbase + tl * (OCW * 2) + ((pc ^ (tl & 7)) << 4));
                T *dst = out + (s0 + ltok) * p.ldo + col;
                if (vec_ok && col + 8 <= p.out_cols) {
                    st_global_v4(dst, v);
                } else {
                    const T *y = reinterpret_cast<const T *>(&v);
                    for (int k = 0; k < 8 && col + k < p.out_cols; k++) dst[k] = y[k];
                }
            }
        };
        if constexpr (HANDOVER) {
#pragma unroll
            for (int ch = 0; ch < BN / TC; ch++) {
                // the partner's tokens: this consumer's rows of them, over to the partner
#pragma unroll
                for (int jj = 0; jj < JC; jj++) {
                    if ((jj >= JC / 2) != (c == 0)) continue;
#pragma unroll
                    for (int t = 0; t < 2; t++)
#pragma unroll
                        for (int hh = 0; hh < 2; hh++)
                            *reinterpret_cast<float2 *>(xch + (jj * 8 + 2 * q + t) * C::XS + (lr + 8 * hh) * 2) =
                                pair_at(4 * (ch * JC + jj) + 2 * hh + t);
                }
                consumer_sync();  // handed over
#pragma unroll
                for (int jj = 0; jj < JC; jj++) {
                    if ((jj >= JC / 2) != (c == 1)) continue;
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        const int tl = jj * 8 + 2 * q + t;
                        const float sc = scl[ch * TC + tl];
#pragma unroll
                        for (int hh = 0; hh < 2; hh++) {
                            const float2 own = pair_at(4 * (ch * JC + jj) + 2 * hh + t);
                            const float2 other = *reinterpret_cast<const float2 *>(xch + tl * C::XS + (lr + 8 * hh) * 2);
                            float g0 = c == 0 ? own.x : other.x, g1 = c == 0 ? own.y : other.y;
                            float u0 = c == 0 ? other.x : own.x, u1 = c == 0 ? other.y : own.y;
                            if (p.bias) {
                                g0 += bz[0][hh][0][0];
                                g1 += bz[0][hh][M - 1][0];
                                u0 += bz[0][hh][0][1];
                                u1 += bz[0][hh][M - 1][1];
                            }
                            *reinterpret_cast<uint32_t *>(stg_at(tl, colw(0, hh, 0))) =
                                Elem<T>::pack2(gated_act(p, g0, u0) * sc, gated_act(p, g1, u1) * sc);
                        }
                    }
                }
                consumer_sync();  // the chunk is staged, and every read of xch is done
                store_chunk(std::integral_constant<int, 256>{}, ch, c * 128 + wtid);
                // no barrier here: the next chunk writes xch only after this one's reads of it
                // (the sync above) and stages only after its first sync, which every thread
                // reaches after its stores
            }
        } else {
#pragma unroll
            for (int ch = 0; ch < BN / TC; ch++) {
#pragma unroll
                for (int jj = 0; jj < JC; jj++)
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        const int tl = jj * 8 + 2 * q + t, j = ch * JC + jj;
                        const float sc = scl[ch * TC + tl];
#pragma unroll
                        for (int hh = 0; hh < 2; hh++) {
                            const int i = 4 * j + 2 * hh + t;
#pragma unroll
                            for (int ob = 0; ob < OB; ob++) {
                                float y[M];
#pragma unroll
                                for (int x = 0; x < M; x++) {
                                    if constexpr (GATED) {  // block 0 the gate rows, block 1 the up rows
                                        float v = val(0, i, x), u = val(1, i, x);
                                        if (p.bias) {
                                            v += bz[0][hh][x][0];
                                            u += bz[0][hh][x][1];
                                        }
                                        y[x] = gated_act(p, v, u) * sc;
                                    } else {
                                        float v = val(ob, i, x);
                                        if (p.bias) v += bz[ob][hh][x][0];
                                        y[x] = v * sc;
                                    }
                                }
                                if constexpr (M == 1)
                                    *reinterpret_cast<T *>(stg_at(tl, colw(ob, hh, 0))) = Elem<T>::from_f(y[0]);
                                else
                                    *reinterpret_cast<uint32_t *>(stg_at(tl, colw(ob, hh, 0))) =
                                        Elem<T>::pack2(y[0], y[1]);
                            }
                        }
                    }
                consumer_sync();  // the chunk is staged
                store_chunk(std::integral_constant<int, 128>{}, ch, wtid);
                consumer_sync();  // the staging area may be overwritten
            }
        }
    };

    // cooperative: every item, ring positions running on; ping-pong: items c, c + 2, ..., on
    // ring c, item n's k-tiles at its positions (n / 2) * KT on (every item has KT k-tiles)
    uint32_t it = 0;
    for (int n = PP ? c : 0;; n += PP ? 2 : 1) {
        const int slot = n & (NSLOT - 1);
        mbar_wait(tfull_bar(slot), (n >> C::NSLOT_LOG2) & 1);
        const int32_t *info = slot_info(slot);
        const int e = info[0];
        if (e < 0) break;
        if (PP) it = (uint32_t)(n >> 1) * (uint32_t)KT;  // (this consumer's items n = c, c + 2, ...)
        const int64_t row0 = (int64_t)info[1] * BMT, s0 = *reinterpret_cast<const int64_t *>(info + 2);
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
            step(std::integral_constant<int, 0>{}, kt, it, slice.next(kt_per_slice));
            step(std::integral_constant<int, 1>{}, kt + 1, it + 1, slice.next(kt_per_slice));
        }
        wgmma_wait<0>();
#pragma unroll
        for (int a = 0; a < NACC; a++) fence_regs(acc[a]);
        if (KT > 0) release(SAM_WS_STAGE(c, it - 1) & (PAIRS ? ~1 : ~0));
        if (!(drop & 8)) {  // M = 2: the last slice's share, then acc[2b] = T - D: row 1 of each pair
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
                    finish_row_sets<M, NT8>(
                        [&](int a, int j, int k) -> float & { return acc[b * ASTRIDE + a][4 * j + k]; }, sel[b][hh], hh);
        }

        if (drop & 16) {  // (measurement builds: nothing stored)
        } else if (p.act != SAM_ACT_NONE) {
            epilogue(std::true_type{}, slot_tok(slot), slot_scale(slot), e, row0, s0);
        } else {
            epilogue(std::false_type{}, slot_tok(slot), slot_scale(slot), e, row0, s0);
        }
        mbar_arrive(tempty_bar(slot));
    }
    if (CL > 1) cluster_sync();
#undef SAM_WS_STAGE
#else
    (void)p;
    (void)tm;
    __trap();
#endif
}
