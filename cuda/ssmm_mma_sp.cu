// ssmm_mma_sp.cu -- the prefill kernel of ssmm for sm_80 and later (mma.sp):
// what auto runs off sm_90a, for 1:4:V, and for 1:2:V with V not a multiple of 128.
//
// Computes, for every expert e and sorted row s of e (csrc/ssmm_ref.c):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
// with W_e in the Samoyeds format (samoyeds_layout.h), fp32 accumulation.
//
// One launch covers all experts.  A CTA owns BM = 128 storage rows of one expert and
// BN tokens of that expert: one work item (ssmm_work.cuh, cta_work).
//
// Per k-tile (BK dense columns) a 4-stage cp.async pipeline brings in:
//   A: 128 rows x BK/2 packed values (XOR-swizzled 16-byte chunks),
//   B: BN token rows gathered by index straight from x (XOR-swizzled),
//   the 2:4 metadata of the tile (already in mma.sp lane order),
//   the row-selection indices of the current column slice (N < M).
// 8 warps as 2 (rows) x 4 (tokens); a warp runs 4 x NT mma.sp m16n8k32 per
// k-step on ldmatrix fragments, loaded one k-step ahead (double-buffered
// registers).  Every thread's copy sources are computed once per CTA and
// advance by one k-tile per stage.
//
// Row selection (format 1:M:V) costs no memory traffic: each condensed row
// keeps M accumulator sets in registers, the running total the mma accumulates
// into and the shares of M - 1 rows of its group, folded in at every V boundary
// (fold_row_set, ssmm_work.cuh); at the end every set is a finished output row.
//
// Epilogue: accumulators -> fp32 shared-memory tile -> store_tile
// (ssmm_epilogue.cuh).  Tails in every dimension are predicated (zero-filled loads,
// masked stores); invalid token ids read nothing and write nothing.
#include "ptx_mma.cuh"
#include "ssmm_epilogue.cuh"
#include "ssmm_kernels.h"
#include "ssmm_work.cuh"

namespace sam {
namespace {

constexpr int BM = 128;         // storage rows per CTA (two warps of 64 rows)
constexpr int MT = 4;           // m16 tiles per warp (64 rows)

// The tile: M (accumulator sets per row), BK (dense columns per pipeline stage); WN = 4
// warps along tokens (2 x WN warps per CTA), ST = 4 stages.
template <int M_, int BK_> struct MmaSpTile {
    static constexpr int M = M_, BK = BK_, WN = 4, ST = 4;
    static constexpr int KS = BK / 32;                 // mma k-steps per stage
    static constexpr int THREADS = 64 * WN;
    static constexpr int NT = M <= 2 ? 4 : 2;          // n8 tiles per warp
    static constexpr int BN = WN * 8 * NT;             // tokens per CTA
    static constexpr int A_ROW = BK;                   // bytes of one packed row per stage
    static constexpr int B_ROW = BK * 2;               // bytes of one token row per stage
    static constexpr int A_BYTES = BM * A_ROW;
    static constexpr int B_BYTES = BN * B_ROW;
    static constexpr int META_BYTES = (BM / 16) * KS * 64;
    static constexpr int IDX_BYTES = M > 1 ? BM : 0;
    static constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + META_BYTES + IDX_BYTES + 1023) / 1024 * 1024;
    static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
    // epilogue: fp32 tile [BN][FS] of all accumulators (FS = BM*M + 4: rows land on
    // different banks)
    static constexpr int FS = BM * M + 4;
    static constexpr int EPI_BYTES = BN * FS * 4;
    static constexpr int SMEM = (PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES) + BN * 4 + 1024;  // + alignment
    // A rows are BK bytes: XOR the 16-byte chunk with the row bits that keep
    // an 8-row ldmatrix phase on distinct banks; B rows are >= 128 bytes.
    static __device__ __forceinline__ uint32_t a_off(int row, int ch) {
        return BK == 64 ? row * 64 + ((ch ^ ((row >> 1) & 3)) << 4) : row * A_ROW + ((ch ^ (row & 7)) << 4);
    }
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * B_ROW + ((ch ^ (row & 7)) << 4); }
};

// Per-thread copy plan of a CTA, fixed for its lifetime: sources advance by one
// k-tile per stage, shared-memory destinations never change.
template <typename T, typename C> struct Loader {
    static constexpr int M = C::M, BK = C::BK, KS = C::KS, BN = C::BN, THREADS = C::THREADS;
    static constexpr int A_CPR = BK / 16, B_CPR = BK / 8;  // 16-byte chunks per row of A and B
    static constexpr int A_CH = BM * A_CPR / THREADS;      // chunks per thread
    static constexpr int B_CH = BN * B_CPR / THREADS;
    static constexpr int A_STEP = THREADS / A_CPR, B_STEP = THREADS / B_CPR;  // rows between a thread's chunks
    static constexpr int M_CH = 8 * KS * 4, M_STRIDE = THREADS / M_CH, I_STRIDE = THREADS / 8;
    static_assert(A_STEP % 8 == 0 && B_STEP % 8 == 0, "a thread's chunks share one swizzle phase");
    static_assert(M_CH <= THREADS && B_CH * THREADS == BN * B_CPR && A_CH * THREADS == BM * A_CPR, "load plan");

    const T *vals, *a_src, *x;
    const uint32_t *m_src;
    const uint8_t *i_src;
    int64_t a_pitch, rp;
    int64_t ncols;
    uint32_t a_dst, b_dst, m_dst, i_dst;
    uint32_t b_off[B_CH];
    unsigned a_ok, b_ok;
    int b_ch, kt_per_slice, last_slice;
    bool m_load, m_ok, i_load, i_ok;

    __device__ __forceinline__ Loader(const PrefillArgs &p, int e, int64_t row0, const int32_t *tok_s, int tid) {
        vals = static_cast<const T *>(p.values) + (int64_t)e * p.rp * (p.cp / 2);
        const uint32_t *meta = p.meta + (int64_t)e * (p.rp / 16) * (p.cp / 32) * 16;
        const uint8_t *idxg = M > 1 ? p.idx + (int64_t)e * p.slices * p.rp : nullptr;
        x = static_cast<const T *>(p.x);
        a_pitch = p.cp / 2;
        rp = p.rp;
        ncols = p.C;
        // A: rows tid/A_CPR + i*A_STEP, chunk tid%A_CPR
        const int a_row = tid / A_CPR, a_ch = tid % A_CPR;
        a_src = vals + (int64_t)(row0 + a_row) * a_pitch + a_ch * 8;
        a_dst = C::a_off(a_row, a_ch);
        a_ok = 0;
#pragma unroll
        for (int i = 0; i < A_CH; i++) a_ok |= (unsigned)(row0 + a_row + i * A_STEP < p.rp) << i;
        // B: token rows tid/B_CPR + i*B_STEP, chunk tid%B_CPR; offsets into x in 16-byte units
        // (32 bits cover 64 GiB of activations; the launcher checks)
        const int b_row = tid / B_CPR;
        b_ch = tid % B_CPR;
        b_dst = C::A_BYTES + C::b_off(b_row, b_ch);
        b_ok = 0;
#pragma unroll
        for (int i = 0; i < B_CH; i++) {
            const int t = tok_s[b_row + i * B_STEP];
            b_ok |= (unsigned)(t >= 0) << i;
            b_off[i] = t >= 0 ? (uint32_t)(((int64_t)t * p.ldx) / 8 + b_ch) : 0u;
        }
        // metadata (8 row tiles x KS k-steps x 4 chunks) and indices (8 chunks),
        // spread over all warps so that no warp arrives late at the barrier
        m_load = tid % M_STRIDE == 0 && tid / M_STRIDE < M_CH;
        const int m_chunk = tid / M_STRIDE;
        const int64_t m_r16 = row0 / 16 + m_chunk / (KS * 4);
        m_ok = m_r16 < p.rp / 16;
        m_src = meta + (m_ok ? m_r16 * (p.cp / 32) * 16 + (m_chunk % (KS * 4)) * 4 : 0);
        m_dst = C::A_BYTES + C::B_BYTES + m_chunk * 16;
        i_load = M > 1 && tid % I_STRIDE == 1;
        const int i_chunk = tid / I_STRIDE;
        i_ok = row0 + i_chunk * 16 < p.rp;
        i_src = M > 1 ? idxg + (i_ok ? row0 + i_chunk * 16 : 0) : nullptr;
        i_dst = C::A_BYTES + C::B_BYTES + C::META_BYTES + i_chunk * 16;
        kt_per_slice = M > 1 ? p.V / BK : 1;
        // columns are padded to 128: with V = 64 the last k-tile can lie past the last slice
        // (all-zero values); it keeps the last slice's indices, never reads past idx
        last_slice = M > 1 ? (int)p.slices - 1 : 0;
    }

    // Issues the copies of k-tile kt into the stage at shared address base.
    __device__ __forceinline__ void issue(uint32_t base, int kt) const {
        const T *as = a_src + (int64_t)kt * (BK / 2);
#pragma unroll
        for (int i = 0; i < A_CH; i++) {
            const bool ok = (a_ok >> i) & 1;
            cp_async16(base + a_dst + i * A_STEP * C::A_ROW, ok ? as + (int64_t)i * A_STEP * a_pitch : vals, ok);
        }
        const int col = kt * BK + b_ch * 8;
        const bool col_ok = col < ncols;
        const T *xs = x + kt * BK;
#pragma unroll
        for (int i = 0; i < B_CH; i++) {
            const bool ok = col_ok && ((b_ok >> i) & 1);
            cp_async16(base + b_dst + i * B_STEP * C::B_ROW, ok ? xs + (int64_t)b_off[i] * 8 : x, ok);
        }
        if (m_load) cp_async16(base + m_dst, m_src + (int64_t)kt * KS * 16, m_ok);
        if (i_load) cp_async16(base + i_dst, i_src + (int64_t)min(kt / kt_per_slice, last_slice) * rp, i_ok);
    }
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, 1) ssmm_mma_sp_kernel(const PrefillArgs p) {
    constexpr int M = C::M, NT = C::NT, BN = C::BN, BK = C::BK, KS = C::KS, THREADS = C::THREADS,
                  STAGES = C::ST, WARPS_N = C::WN;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = align_smem(smem_raw);
    int32_t *tok_s = reinterpret_cast<int32_t *>(smem + (C::SMEM - 1024 - BN * 4));

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int g = lane >> 2, q = lane & 3;

    int e, rt;
    int64_t s0, row0;
    if (!cta_work<BN, THREADS>(p, tok_s, e, rt, s0)) return;
    row0 = (int64_t)rt * BM;

    const int KT = (int)(p.cp / BK);
    auto stage_ptr = [&](int st) { return smem + st * C::STAGE_BYTES; };
    const Loader<T, C> loader(p, e, row0, tok_s, tid);
    auto load_stage = [&](int st, int kt) { loader.issue(smem_u32(stage_ptr(st)), kt); };
    const int kt_per_slice = loader.kt_per_slice;

    // accumulators: set 0 is written by mma (the running total); sets 1..M-1 the
    // shares of rows 0..M-2 (fold_row_set).  perm[mt][hh]: the row the previous
    // slice selected, then (finish_row_sets) 4 bits per set a: which row set a holds
    float acc[M][MT][NT][4];
    uint32_t perm[MT][2];
    init_row_sets(acc, perm);

    // fragments, double-buffered across k-steps where registers allow: A and B
    // for M = 1; B and metadata for M = 2 (A is then loaded right before use)
    constexpr int NA = M == 1 ? 2 : 1, NB = M <= 2 ? 2 : 1;
    uint32_t af[NA][MT][4], bf[NB][NT][4], ef[NB][MT];
    auto load_a = [&](int buf, int st, int ks) {
        const uint32_t sa = smem_u32(stage_ptr(st));
#pragma unroll
        for (int i = 0; i < MT; i++) {
            const int row = wm * 64 + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int ch = 2 * ks + (lane >> 4);
            ldmatrix_x4(sa + C::a_off(row, ch), af[buf][i][0], af[buf][i][1], af[buf][i][2], af[buf][i][3]);
        }
    };
    auto load_frags = [&](int buf, int st, int ks) {  // B and metadata (and A when double-buffered)
        unsigned char *base = stage_ptr(st);
        const uint32_t sa = smem_u32(base), sb = sa + C::A_BYTES;
        const uint32_t *mt_s = reinterpret_cast<const uint32_t *>(base + C::A_BYTES + C::B_BYTES);
        if (NA == 2) load_a(buf, st, ks);
#pragma unroll
        for (int i = 0; i < MT; i++) ef[buf][i] = mt_s[((wm * 4 + i) * KS + ks) * 16 + 2 * g + (q & 1)];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = wn * 8 * NT + j * 8 + (lane & 7);
            const int ch = 4 * ks + (lane >> 3);
            ldmatrix_x4(sb + C::b_off(r, ch), bf[buf][j][0], bf[buf][j][1], bf[buf][j][2], bf[buf][j][3]);
        }
    };
    auto mma_all = [&](int buf) {
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
                MmaSp<T>::run(acc[0][i][j], af[NA == 2 ? buf : 0][i], bf[NB == 2 ? buf : 0][j], ef[NB == 2 ? buf : 0][i]);
    };
    // a new column slice: fold the last one's total into the shares
    auto select_rows = [&](int st) {
        const uint8_t *idx_s = stage_ptr(st) + C::A_BYTES + C::B_BYTES + C::META_BYTES;
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const uint32_t want = idx_s[wm * 64 + i * 16 + g + 8 * hh];
                fold_row_set<M, NT>([&](int a, int j, int k) -> float & { return acc[a][i][j][k]; }, perm[i][hh],
                                      want, hh);
            }
    };

    // ---- main loop: STAGES-deep cp.async pipeline, fragments one k-step ahead
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < KT) load_stage(st, st);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    constexpr bool DB = NB == 2;
    int rd = 0, wr = STAGES - 1;
    if (DB && KT > 0) load_frags(0, 0, 0);
    int to_slice = 0;  // k-tiles left in the current slice (SliceStart's countdown, written out)
    for (int kt = 0; kt < KT; kt++) {
        if (M > 1) {
            if (to_slice == 0) {
                select_rows(rd);
                to_slice = kt_per_slice;
            }
            to_slice--;
        }
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            if (!DB) {
                load_frags(0, rd, ks);
                load_a(0, rd, ks);
                mma_all(0);
            } else if (NA == 1) {
                load_a(0, rd, ks);
            }
            if (ks + 1 < KS) {
                if (DB) load_frags((ks + 1) & 1, rd, ks + 1);
            } else {
                // k-tile kt+1 must be resident, and every warp done with the slot refilled next
                cp_async_wait<STAGES - 3>();
                __syncthreads();
                if (kt + STAGES - 1 < KT) load_stage(wr, kt + STAGES - 1);
                cp_async_commit();
                rd = rd + 1 == STAGES ? 0 : rd + 1;
                wr = wr + 1 == STAGES ? 0 : wr + 1;
                if (DB && kt + 1 < KT) load_frags((ks + 1) & 1, rd, 0);
            }
            if (DB) mma_all(ks & 1);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            finish_row_sets<M, NT>([&](int a, int j, int k) -> float & { return acc[a][i][j][k]; }, perm[i][hh], hh);

    // ---- epilogue: accumulators -> fp32 tile in shared memory -> store_tile
    constexpr int FS = C::FS;  // padded row stride of the fp32 tile
    float *ftile = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int lrow = wm * 64 + i * 16 + g + 8 * hh;
#pragma unroll
            for (int a = 0; a < M; a++) {
                const int c = lrow * M + (int)((perm[i][hh] >> (4 * a)) & 15u);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const int ltok = wn * 8 * NT + j * 8 + 2 * q;
                    ftile[ltok * FS + c] = acc[a][i][j][2 * hh];
                    ftile[(ltok + 1) * FS + c] = acc[a][i][j][2 * hh + 1];
                }
            }
        }
    __syncthreads();

    store_tile<T, M, BM, C::BN, C::THREADS, C::FS>(p, ftile, tok_s, e, row0, s0, tid);
}



template <typename T, typename C> sam_status launch(const sam_ssmm_params *ps, cudaStream_t stream) {
    PrefillArgs k;
    int64_t grid = 0;
    const sam_status st = prefill_args(ps, C::M > 1 ? ps->f.v : C::BK, BM, C::BN, k, grid);
    if (st != SAM_STATUS_OK || grid == 0) return st;
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_mma_sp_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM),
                 "ssmm");
    ssmm_mma_sp_kernel<T, C><<<(unsigned)grid, C::THREADS, C::SMEM, stream>>>(k);
    return launch_status("ssmm");
}

// 128-column stages where the slices allow (docs/KERNELS.md, "mma.sp tiles"), else 64.
template <typename T, int M> sam_status launch_tile(const sam_ssmm_params *ps, cudaStream_t stream) {
    if (M == 1 || ps->f.v % 128 == 0) return launch<T, MmaSpTile<M, 128>>(ps, stream);
    return launch<T, MmaSpTile<M, 64>>(ps, stream);
}

}  // namespace

sam_status ssmm_mma_sp_launch(const sam_ssmm_params *ps, cudaStream_t stream) {
    return with_tc_dtype(ps->dtype, [&](auto t) {
        using T = decltype(t);
        switch (ps->f.m) {
        case 1: return launch_tile<T, 1>(ps, stream);
        case 2: return launch_tile<T, 2>(ps, stream);
        case 4: return launch_tile<T, 4>(ps, stream);
        default:
            set_error("ssmm: the GPU kernel supports formats 2:4, 1:2:V and 1:4:V; got %d:%d:%d", ps->f.n, ps->f.m,
                      ps->f.v);
            return SAM_STATUS_UNSUPPORTED;
        }
    });
}

}  // namespace sam
