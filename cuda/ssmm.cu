// ssmm.cu -- grouped sparse-sparse matmul on Sparse Tensor Cores.
//
// Kernels and who runs them (sam_ssmm_cuda, impl = auto):
//   S <= SAMOYEDS_DECODE_MAX_ROWS routed rows  -> ssmm_decode.cu (split K, weight-bandwidth bound)
//   sm_90a build on an sm_90 device, 2:4 and 1:2:V (V % 128 == 0)
//                                              -> ssmm_ws.cuh (warp-specialised wgmma.sp, weights by TMA,
//                                                 persistent grid; SAMOYEDS_WGMMA_KERNEL=3: one CTA per item,
//                                                 4: ping-pong consumers (2:4), 5: clusters of two, weights
//                                                 multicast, 6: a work counter; 1:2:V in tiles of 256 rows
//                                                 x 64 or 96 tokens or 128 x 128, ws_tall_tile)
//     SAMOYEDS_WGMMA_KERNEL=1, or no TMA       -> ssmm_wgmma_kernel below (single-role wgmma.sp)
//   otherwise (sm_80/86/89, 1:4:V)             -> ssmm_kernel below (mma.sp)
// impl = mma_sp / wgmma_sp / decode forces one; docs/PERFORMANCE.md has the measurements.
//
// The mma.sp kernel:
// Computes, for every expert e and sorted row s of e (see csrc/ssmm_ref.c):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
// with W_e in the Samoyeds format (samoyeds_layout.h), fp32 accumulation.
//
// One launch covers all experts.  A CTA owns BM = 128 storage rows of one
// expert and BN tokens of that expert; the grid is an upper bound
// (row tiles x (ceil(S/BN) + E)) and each CTA finds its (expert, token tile)
// from offsets[] on the device, so there is no host sync and experts without
// tokens cost nothing.  CTAs are rasterised in groups of GM row tiles so that
// a wave reuses the same weight rows across many token tiles (L2).
//
// Per k-tile (64 dense columns) a 4-stage cp.async pipeline brings in:
//   A: 128 rows x 32 packed values (XOR-swizzled 16-byte chunks),
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
// (fold_row_set, common.cuh); at the end every set is a finished output row.
//
// Epilogue: accumulators -> fp32 shared-memory tile -> bias, activation
// (a gated activation pairs gate row i with up row i of the same CTA, see the
// GLU layout), routing scale -> coalesced 16-byte stores of whole output rows.  Tails in every dimension are predicated (zero-filled
// loads, masked stores); invalid token ids read nothing and write nothing.
#include <cuda.h>  // CUtensorMap and its enums (the encoder is fetched from the driver at run time)
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "tma.cuh"

namespace sam {
namespace {

constexpr int BM = 128;         // storage rows per CTA (two warps of 64 rows)
constexpr int MT = 4;           // m16 tiles per warp (64 rows)
constexpr int GM = 16;          // row tiles per rasterisation group

// Tile configuration: M (accumulator sets per row), BK (dense columns per
// pipeline stage), WN (warps along tokens; 2 x WN warps per CTA), ST (stages).
template <int M_, int BK_, int WN_, int ST_> struct Cfg {
    static constexpr int M = M_, BK = BK_, WN = WN_, ST = ST_;
    static constexpr int BMT = BM;                     // storage rows per CTA
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
    // a multiple of 1024 bytes: B tiles stay on 128-byte-swizzle atoms (wgmma descriptors)
    static constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + META_BYTES + IDX_BYTES + 1023) / 1024 * 1024;
    static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
    // epilogue: fp32 tile [BN][FS] of all accumulators (FS = BM*M + 4: rows land on
    // different banks)
    static constexpr int FS = BM * M + 4;
    static constexpr int EPI_BYTES = BN * FS * 4;
    static constexpr int SMEM = (PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES) + BN * 4 + 1024;  // + alignment
    static constexpr int MIN_BLOCKS = WN == 2 ? 2 : 1;
    // A rows are BK bytes: XOR the 16-byte chunk with the row bits that keep
    // an 8-row ldmatrix phase on distinct banks; B rows are >= 128 bytes.
    static __device__ __forceinline__ uint32_t a_off(int row, int ch) {
        return BK == 64 ? row * 64 + ((ch ^ ((row >> 1) & 3)) << 4) : row * A_ROW + ((ch ^ (row & 7)) << 4);
    }
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * B_ROW + ((ch ^ (row & 7)) << 4); }
};

// SAM_WS_DROP=1 (SAMOYEDS_NVCC_FLAGS=-DSAM_WS_DROP=1): the warp-specialised kernel reads
// SAMOYEDS_WS_DROP, a bit set of parts to leave out so that what remains can be timed alone
// (its output is then not the product): 2 the token rows' loads, 4 the weights' and
// metadata's loads (the stage is marked full without them), 8 the 1:M:V row selection, 16
// the epilogue, 32 the packed values' loads alone (clusters: ignored).  Release builds leave
// it at 0 and compile none of it in.
#ifndef SAM_WS_DROP
#define SAM_WS_DROP 0
#endif
// SAM_WS_A_REGS=1 (with SAM_WS_DROP=1): the warp-specialised kernel's wgmmas take their packed
// A tile from a fixed set of registers instead of the stage, and SAMOYEDS_WS_DROP's bit 32 leaves
// the packed values' TMA load out (the metadata still comes): what the A operand's shared-memory
// writes and reads cost, timed against the same build's other variants.
#ifndef SAM_WS_A_REGS
#define SAM_WS_A_REGS 0
#endif
#if SAM_WS_A_REGS && !SAM_WS_DROP
#error "SAM_WS_A_REGS is a measurement build: set SAM_WS_DROP=1 as well"
#endif
// SAM_WS_CLUSTER_TALL=1: SAMOYEDS_WGMMA_KERNEL=5 (clusters of two, the weights multicast) runs
// 1:2:V in the tile ws_tall_tile picks (256 x 64 or 256 x 96) instead of 128 x 128 alone.  Off
// by default: four more kernels per dtype for a comparison switch.
#ifndef SAM_WS_CLUSTER_TALL
#define SAM_WS_CLUSTER_TALL 0
#endif

struct KParams : SsmmArgs {
    int V;                      // slice length (BK without row selection)
    int nrt;                    // row tiles
    int meta_remap;             // wgmma metadata register layout (see ssmm_wgmma_kernel)
    int gm;                     // row tiles per rasterisation group (GM; SAMOYEDS_SSMM_GM)
    unsigned long long *work;   // WsCfg::DYN: the next work item (zero at launch), else null
    int pdl_trigger;            // the warp-specialised kernel lets the kernel after it launch as it starts
#if SAM_WS_DROP
    int drop;                   // SAMOYEDS_WS_DROP: the parts the warp-specialised kernel leaves out
#endif
};


// Shared memory base rounded up to 1024 bytes (the launch adds 1024 bytes of slack).
__device__ __forceinline__ unsigned char *align_smem(unsigned char *raw) {
    const uint32_t a = smem_u32(raw);
    return raw + (((a + 1023u) & ~1023u) - a);
}

// Token tiles of expert e (0 past the experts).
template <int BN> __device__ __forceinline__ int expert_token_tiles(const KParams &p, int e) {
    return e < p.E ? (max(0, p.offsets[e + 1] - p.offsets[e]) + BN - 1) / BN : 0;
}

// Token tiles over all experts (warp-wide; every lane gets the sum).
template <int BN> __device__ __forceinline__ int count_token_tiles(const KParams &p, int lane) {
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
__device__ __forceinline__ void decode_tile(const KParams &p, int64_t L, int total, int lane, int &e_out, int &rt_out,
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
template <int BN> __device__ __forceinline__ int64_t tile_s0(const KParams &p, int e, int tt) {
    return (int64_t)max(0, p.offsets[e]) + (int64_t)tt * BN;
}
__device__ __forceinline__ int64_t expert_s_end(const KParams &p, int e) {
    return min((int64_t)p.offsets[e + 1], p.S);
}
__device__ __forceinline__ int32_t row_token(const KParams &p, int64_t s, int64_t s_end) {
    if (s >= s_end) return -1;
    const int64_t v = p.token_ids ? (int64_t)p.token_ids[s] : s;
    return (v >= 0 && v < p.T) ? (int32_t)v : -1;
}

// Finds this CTA's (expert e, row tile rt, first sorted row s0): work item
// blockIdx.x, and fills tok_s[BN] with its token rows.  Returns false for a CTA
// past the work (the grid is an upper bound).
template <int BN, int THREADS>
__device__ __forceinline__ bool cta_work(const KParams &p, int32_t *tok_s, int &e_out, int &rt_out, int64_t &s0_out) {
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
    int b_ch, kt_per_slice;
    bool m_load, m_ok, i_load, i_ok;

    __device__ __forceinline__ Loader(const KParams &p, int e, int64_t row0, const int32_t *tok_s, int tid) {
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
        if (i_load) cp_async16(base + i_dst, i_src + (int64_t)(kt / kt_per_slice) * rp, i_ok);
    }
};

// Epilogue, second half (every prefill kernel): from the fp32 tile f[token][c]
// (c = local storage row * M + its row of the group, so c runs over original rows
// in order) of a CTA of BMT storage rows: bias, activation (the gate column of a
// GLU pair -- one pair per 128 storage rows, see the GLU layout -- pairs with the
// up column 64*M further), routing scale, 16-byte stores of whole output rows.
// Not unrolled: it stays small in the instruction cache.
template <typename T, int M, int BMT, int BN, int THREADS, int FS>
__device__ __forceinline__ void store_tile(const KParams &p, const float *ftile, const int32_t *tok_s, int e,
                                              int64_t row0, int64_t s0, int tid) {
    const bool gated = p.act != SAM_ACT_NONE;
    const int OC = gated ? BMT / 2 * M : BMT * M;
    const int64_t col0 = gated ? (row0 / 128) * 64 * M : row0 * M;
    const int64_t bias_up = gated ? p.R / 2 : 0;
    T *out = static_cast<T *>(p.out);
    const int chunks = OC / 8;
    const bool vec_ok = (p.ldo % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.out) & 15) == 0);
#pragma unroll 1
    for (int id = tid; id < BN * chunks; id += THREADS) {
        const int ltok = id / chunks, ch = id % chunks;
        if (tok_s[ltok] < 0) continue;
        const int oc = ch * 8;
        const int64_t c0 = col0 + oc;
        if (c0 >= p.out_cols) continue;
        const int64_t s = s0 + ltok;
        const float sc = p.scale ? p.scale[s] : 1.0f;
        // gate column of output column oc: pair oc / (64 M), 128 M columns per pair
        const int src_c = gated ? (oc / (64 * M)) * 128 * M + oc % (64 * M) : oc;
        const float *src = ftile + ltok * FS + src_c;
        alignas(16) T y8[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int64_t col = c0 + k;
            const bool in = col < p.out_cols;
            float v = src[k];
            if (p.bias && in) v += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + col);
            if (gated) {
                float u = src[64 * M + k];
                if (p.bias && in) u += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + bias_up + col);
                v = gated_act(p, v, u);
            }
            y8[k] = Elem<T>::from_f(v * sc);
        }
        T *dst = out + s * p.ldo + c0;
        if (vec_ok && c0 + 8 <= p.out_cols) {
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(y8);
        } else {
            for (int k = 0; k < 8 && c0 + k < p.out_cols; k++) dst[k] = y8[k];
        }
    }
}

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, C::MIN_BLOCKS) ssmm_kernel(const KParams p) {
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


// ---- Hopper path: wgmma.mma_async.sp (sm_90a) -------------------------------------
//
// Same tiles, copy plan and epilogue as the mma.sp kernel; two warpgroups own 64
// rows each and all BN = 128 tokens.  A warp loads the packed values of its 16
// rows with ldmatrix (the A operand comes from registers), the token tile is
// read by the tensor cores straight from shared memory through a 128-byte-swizzle
// descriptor (the B layout above is that swizzle).  Two wgmma m64n128k32 per
// 64-column k-tile, committed as one group; a group stays in flight while the
// next k-tile's fragments load (wait_group 1), so the copy of k-tile kt+STAGES-2
// only overwrites a stage whose wgmmas are done.  Row selection drains the
// warpgroup (wait_group 0) at each V boundary and folds the total into the
// shares as the mma.sp kernel does.
template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, 1) ssmm_wgmma_kernel(const KParams p) {
#ifdef SAM_HAS_WGMMA
    constexpr int M = C::M, BN = C::BN, BK = C::BK, KS = C::KS, THREADS = C::THREADS, STAGES = C::ST;
    static_assert(BK == 64 && BN == 128 && THREADS == 256 && M <= 2 && STAGES >= 4, "wgmma tile");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = align_smem(smem_raw);
    int32_t *tok_s = reinterpret_cast<int32_t *>(smem + (C::SMEM - 1024 - BN * 4));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w = warp & 3, g = lane >> 2, q = lane & 3;

    int e, rt;
    int64_t s0;
    if (!cta_work<BN, THREADS>(p, tok_s, e, rt, s0)) return;
    const int64_t row0 = (int64_t)rt * BM;
    const int KT = (int)(p.cp / BK);  // even: columns are padded to 128
    auto stage_ptr = [&](int st) { return smem + st * C::STAGE_BYTES; };
    const Loader<T, C> loader(p, e, row0, tok_s, tid);
    const int kt_per_slice = loader.kt_per_slice;
    const int meta_remap = p.meta_remap;

    float acc[M][64];
#pragma unroll
    for (int a = 0; a < M; a++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[a][i] = 0.0f;
    uint32_t perm[2] = {first_sel<M>(), first_sel<M>()};  // (fold_row_set's `sel`)
    uint32_t af[2][KS][4], ef[2][KS];
    const int arow = wg * 64 + w * 16;  // this warp's 16 rows

    auto load_frags = [&](auto par_c, int st) {
        constexpr int par = decltype(par_c)::value;
        unsigned char *base = stage_ptr(st);
        const uint32_t sa = smem_u32(base);
        const uint32_t *mt_s = reinterpret_cast<const uint32_t *>(base + C::A_BYTES + C::B_BYTES);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const int row = arow + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int ch = 2 * ks + (lane >> 4);
            ldmatrix_x4(sa + C::a_off(row, ch), af[par][ks][0], af[par][ks][1], af[par][ks][2], af[par][ks][3]);
            const uint32_t *tile = mt_s + ((wg * 4 + w) * KS + ks) * 16;
            if (meta_remap == 0) {
                ef[par][ks] = tile[2 * g + (q & 1)];
            } else {  // one thread per row: row g (q even) or g + 8 (q odd), all 32 columns
                const uint32_t lo = tile[2 * g], hi = tile[2 * g + 1];
                ef[par][ks] = (q & 1) ? ((lo >> 16) | (hi & 0xffff0000u)) : ((lo & 0xffffu) | (hi << 16));
            }
        }
    };
    auto select_rows = [&](int st) {
        const uint8_t *idx_s = stage_ptr(st) + C::A_BYTES + C::B_BYTES + C::META_BYTES;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const uint32_t want = idx_s[arow + g + 8 * hh];
            fold_row_set<M, 16>([&](int a, int j, int k) -> float & { return acc[a][4 * j + k]; }, perm[hh], want, hh);
        }
    };
    auto step = [&](auto par_c, int kt, bool boundary) {  // boundary: the first k-tile of a slice
        cp_async_wait<STAGES - 3>();  // k-tile kt has landed (this thread's copies)
        fence_proxy_async();
        __syncthreads();              // ... everyone's; and k-tile kt-2's wgmmas are done everywhere
        if (kt + STAGES - 2 < KT) loader.issue(smem_u32(stage_ptr((kt + STAGES - 2) % STAGES)), kt + STAGES - 2);
        cp_async_commit();
        const int st = kt % STAGES;
        load_frags(par_c, st);
        if (M > 1 && boundary) {
            wgmma_wait<0>();
#pragma unroll
            for (int a = 0; a < M; a++) fence_regs(acc[a]);
            select_rows(st);
        }
        constexpr int par = decltype(par_c)::value;
        const uint32_t sb = smem_u32(stage_ptr(st)) + C::A_BYTES;
#pragma unroll
        for (int a = 0; a < M; a++) fence_regs(acc[a]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ks++) WgmmaSp<T>::run(acc[0], af[par][ks], smem_desc_sw128(sb + ks * 64), ef[par][ks]);
        wgmma_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int a = 0; a < M; a++) fence_regs(acc[a]);
    };

#pragma unroll
    for (int st = 0; st < STAGES - 2; st++) {
        if (st < KT) loader.issue(smem_u32(stage_ptr(st)), st);
        cp_async_commit();
    }
    SliceStart slice;
    for (int kt = 0; kt < KT; kt += 2) {
        step(std::integral_constant<int, 0>{}, kt, slice.next(kt_per_slice));
        step(std::integral_constant<int, 1>{}, kt + 1, slice.next(kt_per_slice));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int a = 0; a < M; a++) fence_regs(acc[a]);
#pragma unroll
    for (int hh = 0; hh < 2; hh++)
        finish_row_sets<M, 16>([&](int a, int j, int k) -> float & { return acc[a][4 * j + k]; }, perm[hh], hh);
    cp_async_wait<0>();
    __syncthreads();

    // ---- epilogue: accumulators -> fp32 tile in shared memory -> store_tile
    constexpr int FS = C::FS;
    float *ftile = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int lrow = arow + g + 8 * hh;
#pragma unroll
        for (int a = 0; a < M; a++) {
            const int c = lrow * M + (int)((perm[hh] >> (4 * a)) & 15u);
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int ltok = j * 8 + 2 * q;
                ftile[ltok * FS + c] = acc[a][4 * j + 2 * hh];
                ftile[(ltok + 1) * FS + c] = acc[a][4 * j + 2 * hh + 1];
            }
        }
    }
    __syncthreads();
    store_tile<T, M, BM, C::BN, C::THREADS, C::FS>(p, ftile, tok_s, e, row0, s0, tid);
#else
    (void)p;
    __trap();
#endif
}

#include "ssmm_ws.cuh"

int wgmma_meta_remap() {
    static int v = -1;
    if (v < 0) v = env_int("SAMOYEDS_WGMMA_META", 0);
    return v;
}

enum Kernel { K_MMA_SP = 0, K_WGMMA = 1, K_WGMMA_WS = 2 };

// The warp-specialised kernel streams the weights by TMA: it needs the driver's
// encoder and 16-byte-aligned arrays (always so for arrays the library allocates).
bool ws_tma_usable(const sam_ssmm_params *ps) {
    return tensor_map_encoder() != nullptr && (uintptr_t)ps->values % 16 == 0 && (uintptr_t)ps->meta % 16 == 0;
}

// The warp-specialised kernel's TMA maps over the packed values and metadata
// (layout in ssmm_ws.cuh); false when the encoder refuses them.  Callers check
// ws_tma_usable first.
template <typename T, typename C> bool ws_tensor_maps(const sam_ssmm_params *ps, WsMaps &m) {
    TensorMapEncodeFn enc = tensor_map_encoder();
    const cuuint64_t cp = (cuuint64_t)ps->d.cp, rp = (cuuint64_t)ps->d.rp, E = (cuuint64_t)ps->d.E;
    const cuuint32_t one[3] = {1, 1, 1};
    const CUtensorMapDataType vt =
        std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const cuuint64_t a_dim[3] = {cp / 2, rp, E}, a_stride[2] = {cp, rp * cp};
    // clusters: each CTA loads (and multicasts) 1 / CL of the item's rows
    const cuuint32_t a_box[3] = {(cuuint32_t)(C::BK / 2), (cuuint32_t)(C::BMT / C::CL), 1};
    if (enc(&m.a, vt, 3, const_cast<void *>(ps->values), a_dim, a_stride, a_box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    const cuuint64_t m_dim[3] = {cp / 2, rp / 16, E}, m_stride[2] = {cp * 2, (rp / 16) * cp * 2};
    const cuuint32_t m_box[3] = {(cuuint32_t)(C::KS * 16), (cuuint32_t)(C::BMT / 16 / C::CL), 1};
    if (enc(&m.meta, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<uint32_t *>(ps->meta), m_dim, m_stride, m_box,
            one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    return true;
}

// The token rows by TMA as well (WsMaps::b, WsCfg::BT) where x is read without a row map
// (token_ids null: an expert's rows are contiguous, as the down projection's intermediate
// rows are) and its rows are 16-byte aligned.  False (the cp.async gather) where it cannot
// be, or where the encoder refuses the map.  Boxes of WsCfg's BN rows x BK columns.
// x's rows can be TMA boxes: read without a row map, 16-byte aligned, int32-indexable.
bool ws_tokens_mappable(const sam_ssmm_params *ps, int64_t elem_bytes) {
    return ps->token_ids == nullptr && (uintptr_t)ps->x % 16 == 0 && (ps->ldx * elem_bytes) % 16 == 0 &&
           ps->S < INT32_MAX && ps->T < INT32_MAX && ps->T > 0;
}
template <typename T, int BN> bool ws_tokens_map(const sam_ssmm_params *ps, CUtensorMap &m) {
    constexpr int BK = 64;
    if (!ws_tokens_mappable(ps, sizeof(T))) return false;
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

// max_ctas > 0 (warp-specialised kernel only): a persistent grid of at most that
// many CTAs, each walking the work items blockIdx.x, blockIdx.x + gridDim.x, ...
// bmap: WsCfg::BT's map over the token rows (ws_tokens_map)
template <typename T, typename C, int KIND = K_MMA_SP>
sam_status launch(const sam_ssmm_params *ps, cudaStream_t stream, int max_ctas = 0,
                  const CUtensorMap *bmap = nullptr) {
    constexpr int M = C::M;
    KParams k;
    static_cast<SsmmArgs &>(k) = ssmm_args(ps);
    k.V = M > 1 ? ps->f.v : C::BK;
    k.nrt = (int)ceil_div(ps->d.rp, C::BMT);
    if ((ps->T * ps->ldx) / 8 >= ((int64_t)1 << 32)) {
        set_error("ssmm: x holds %lld elements; the GPU kernel addresses at most 2**35", (long long)(ps->T * ps->ldx));
        return SAM_STATUS_UNSUPPORTED;
    }
    int64_t grid = (int64_t)k.nrt * (ceil_div(ps->S, C::BN) + ps->d.E);  // work items: an upper bound
    if (grid == 0 || k.nrt == 0) return SAM_STATUS_OK;
    if (grid > INT32_MAX) {
        set_error("ssmm: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    k.meta_remap = wgmma_meta_remap();
    k.gm = std::max(1, env_int("SAMOYEDS_SSMM_GM", GM));
#if SAM_WS_DROP
    k.drop = env_int("SAMOYEDS_WS_DROP", 0);
#endif
    k.work = nullptr;
    k.pdl_trigger = 0;
    if constexpr (KIND == K_WGMMA_WS) {
        WsMaps maps;
        if (!ws_tensor_maps<T, C>(ps, maps)) {
            set_error("ssmm: cuTensorMapEncodeTiled refused the packed weights (E=%lld, rp=%lld, cp=%lld)",
                      (long long)ps->d.E, (long long)ps->d.rp, (long long)ps->d.cp);
            return SAM_STATUS_UNSUPPORTED;
        }
        if constexpr (C::BT) {
            static_assert(C::BK == 64, "the box of ws_tokens_map");
            maps.b = *bmap;
        }
        SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_ws_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM),
                     "ssmm");
        if constexpr (C::CL > 1) {
            // clusters of CL CTAs, as many as fit at once (one CTA per SM; a GPC with an
            // odd number of free SMs leaves one idle)
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = C::CL;
            attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
            cfg.blockDim = dim3(C::THREADS);
            cfg.dynamicSmemBytes = C::SMEM;
            cfg.stream = stream;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            // clusters resident at once, asked once per device (devices 0-63 cached)
            static int clusters[64] = {};
            int dev = 0;
            SAM_CUDA_TRY(cudaGetDevice(&dev), "ssmm");
            const bool cached = dev >= 0 && dev < 64;
            int fit = cached ? clusters[dev] : 0;
            if (fit == 0) {
                cfg.gridDim = dim3((unsigned)(C::CL * max(1, device_sm_count() / C::CL)));
                SAM_CUDA_TRY(cudaOccupancyMaxActiveClusters(&fit, ssmm_ws_kernel<T, C>, &cfg), "ssmm");
                if (fit < 1) {
                    set_error("ssmm: no cluster of %d CTAs of the warp-specialised kernel fits on this device", C::CL);
                    return SAM_STATUS_UNSUPPORTED;
                }
                if (cached) clusters[dev] = fit;
            }
            const int64_t pairs = ceil_div(grid, (int64_t)C::CL);
            cfg.gridDim = dim3((unsigned)(C::CL * std::min<int64_t>(pairs, fit)));
            SAM_CUDA_TRY(cudaLaunchKernelEx(&cfg, ssmm_ws_kernel<T, C>, k, maps), "ssmm");
        } else if constexpr (C::DYN) {
            // a counter of this launch alone (stream-ordered, so concurrent launches and
            // CUDA graphs each get their own)
            if (max_ctas > 0 && grid > max_ctas) grid = max_ctas;
            SAM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void **>(&k.work), sizeof(unsigned long long), stream),
                         "ssmm");
            SAM_CUDA_TRY(cudaMemsetAsync(k.work, 0, sizeof(unsigned long long), stream), "ssmm");
            ssmm_ws_kernel<T, C><<<(unsigned)grid, C::THREADS, C::SMEM, stream>>>(k, maps);
            const cudaError_t launched = cudaGetLastError();
            SAM_CUDA_TRY(cudaFreeAsync(k.work, stream), "ssmm");
            SAM_CUDA_TRY(launched, "ssmm");
        } else {
            if (max_ctas > 0 && grid > max_ctas) grid = max_ctas;
            // SAMOYEDS_WS_PDL: 0 a plain launch; 1 (default) a programmatic dependent launch (its CTAs
            // set up while the kernel before ends; the kernel after launches as they end); 2 one that
            // also lets the kernel after it launch as it starts.  Measured on H100 (docs/PERFORMANCE.md,
            // experiments/probe_block_env_ws_pdl.json), the block in turns: 1 0.98-1.00x the time of
            // 0 (Mixtral-8x7B at T = 4096 0.983-0.988x), 2 1.00-1.12x (slower wherever a
            // warp-specialised kernel runs, the most at 16-128 tokens).
            const int ws_pdl = pdl_enabled() ? env_int("SAMOYEDS_WS_PDL", 1) : 0;
            k.pdl_trigger = ws_pdl >= 2;
            SAM_CUDA_TRY(launch_kernel(ssmm_ws_kernel<T, C>, dim3((unsigned)grid), dim3(C::THREADS), C::SMEM, stream,
                                       ws_pdl >= 1, k, maps),
                         "ssmm");
        }
    } else {
        void (*kernel)(const KParams);
        if constexpr (KIND == K_WGMMA) kernel = ssmm_wgmma_kernel<T, C>;
        else kernel = ssmm_kernel<T, C>;
        SAM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM), "ssmm");
        kernel<<<(unsigned)grid, C::THREADS, C::SMEM, stream>>>(k);
    }
    return launch_status("ssmm");
}

// Tile choice per row-group size M.  Variant (SAMOYEDS_SSMM_VARIANT, default 1): 0 = 64-column stages, 4 stages, 8 warps; 1 = 128-column
// stages, 4 stages, 8 warps; 2 = 64-column stages, 4 stages, 4 warps, 2 CTAs/SM.
template <typename T, int M> sam_status launch_cfg(const sam_ssmm_params *ps, cudaStream_t stream, int variant) {
    if (variant == 1 && (M == 1 || ps->f.v % 128 == 0)) return launch<T, Cfg<M, 128, 4, 4>>(ps, stream);
    if (variant == 2) return launch<T, Cfg<M, 64, 2, 4>>(ps, stream);
    return launch<T, Cfg<M, 64, 4, 4>>(ps, stream);
}

int ssmm_variant() {
    static int v = -1;
    if (v < 0) v = env_int("SAMOYEDS_SSMM_VARIANT", 1);  // 128-column stages: fastest mma.sp tiles on H100
    return v;
}

// True when the current device runs the sm_90a kernels compiled into this build.
bool device_has_wgmma() {
    static int cache[64];
    static bool init = false;
    if (!init) {
        for (int i = 0; i < 64; i++) cache[i] = -1;
        init = true;
    }
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return false;
    }
    if (cache[dev] < 0) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        cudaGetLastError();
        cache[dev] = (major == 9 && minor == 0 && strstr(sam_cuda_archs(), "sm_90a") != nullptr) ? 1 : 0;
    }
    return cache[dev] == 1;
}

// The warp-specialised kernel of configuration WsCfg<M, PP, CL, DYN, BT, TALL>, with the
// token rows by TMA (BT) where ws_tokens_map can map them and want_bt (SAMOYEDS_WGMMA_TOKENS_TMA)
// allows it.
template <typename T, int M, bool PP = false, int CL = 1, bool DYN = false, int TALL = 0>
sam_status launch_ws(const sam_ssmm_params *ps, cudaStream_t stream, int ctas, int want_bt) {
    using Cg = WsCfg<M, PP, CL, DYN, false, TALL>;
    using Ct = WsCfg<M, PP, CL, DYN, true, TALL>;
    CUtensorMap bm;
    const bool bt = want_bt != 0 && ws_tokens_map<T, Ct::BN>(ps, bm);
    if (want_bt == 2 && !bt) {
        set_error("ssmm: SAMOYEDS_WGMMA_TOKENS_TMA=2, but the token rows cannot be read by TMA (they need "
                  "token_ids None, x and its row stride 16-byte aligned, fewer than 2**31 rows)");
        return SAM_STATUS_UNSUPPORTED;
    }
    if (bt) return launch<T, Ct, K_WGMMA_WS>(ps, stream, ctas, &bm);
    return launch<T, Cg, K_WGMMA_WS>(ps, stream, ctas);
}

// 1:2:V's tile (SAMOYEDS_WS_TILE: 1 = 256 storage rows x 64 tokens, 2 = 256 x 96, 0 = 128 x 128; unset: the
// rule below).  Measured on H100 (docs/PERFORMANCE.md, v17; experiments/kernel_tall_everywhere_
// 7acfa63.json, ssmm_kernels_tall_tile_*.json), both bit-identical: the tall tile gathers half the
// token bytes per FLOP and leaves less of each expert's last token tile empty, 1.05-1.26x faster
// on every gathered gate_up projection at >= 4096 tokens; where the token rows come by TMA (down
// projections) it ran 0.83-1.34x, slower where its 256-row tiles overhang the rows (MiniCPM-MoE:
// 1152 rows in five), where its items barely fill the SMs (Mixtral-8x22B at T = 256, which the
// rule still gives it) and on long, full token tiles (Mixtral).  So: the tall tile for gathered
// rows; for rows by TMA, where it computes at least 3 % fewer padded row x token products (each
// routed expert's last token tile half empty on average) and its work items fill the SMs.
// The tile of 256 rows x 96 tokens (SAMOYEDS_WS_TILE=2; 192 accumulators per consumer thread, six
// stages) carries 1.3x fewer bytes per FLOP than either; on gathered rows it ran 0.97-1.03x the
// 256 x 64 tile (the gather, unchanged per FLOP, sets the pace there), on Mixtral-8x7B's down
// projection by TMA 1.06-1.16x the 128 x 128 tile and 1.17-1.20x the 256 x 64 one (ssmm_kernels,
// one expert, 8192 and 32768 rows), on Qwen3-30B-A3B's routed down projection 1.10x the 256 x 64
// tile at 256 rows per expert and 0.93x at 64.  So for rows by TMA it is the tile wherever each
// routed expert has at least 256 rows on average, it pads no more work than 128 x 128 and its
// items fill the SMs.
// Returns the tile's token count: 64 or 96 (256 storage rows), 0 for 128 x 128.
int ws_tall_tile(const sam_ssmm_params *ps, int want_bt) {
    const int tile = env_int("SAMOYEDS_WS_TILE", -1);
    if (tile >= 0) return tile == 2 ? 96 : tile == 1 ? 64 : 0;
    if (want_bt == 0 || !ws_tokens_mappable(ps, 2)) return 64;  // (bf16 and fp16 alike)
    const double S = (double)ps->S, routed = (double)std::min<int64_t>(ps->d.E, ps->S);
    const double sms = (double)device_sm_count();
    const double rt_tall = (double)ceil_div(ps->d.rp, 256), rt_128 = (double)ceil_div(ps->d.rp, 128);
    const double work_tall = rt_tall * 256.0 * (S + 32.0 * routed), work_128 = rt_128 * 128.0 * (S + 64.0 * routed);
    const double work_96 = rt_tall * 256.0 * (S + 48.0 * routed), items_96 = rt_tall * (S / 96.0 + routed / 2.0);
    if (S >= 256.0 * routed && work_96 <= work_128 && items_96 >= sms) return 96;
    const double items_tall = rt_tall * (S / 64.0 + routed / 2.0);
    return work_tall < 0.97 * work_128 && items_tall >= sms ? 64 : 0;
}

template <typename T> sam_status launch_m(const sam_ssmm_params *ps, cudaStream_t stream) {
    const int m = ps->f.m, variant = ssmm_variant();
    const bool wgmma_fits = m <= 2 && (m == 1 || ps->f.v % 128 == 0);
    const bool want_wgmma = ps->impl == 2 || (ps->impl == 0 && env_int("SAMOYEDS_SSMM_WGMMA", 1) != 0);
    if (want_wgmma && wgmma_fits && device_has_wgmma()) {
        // SAMOYEDS_WGMMA_KERNEL: 1 single-role kernel; 2 warp-specialised, persistent
        // (one CTA per SM); 3 warp-specialised, one work item per CTA; 4 warp-specialised,
        // persistent, ping-pong consumers (2:4; 1:M:V runs 2); 5 warp-specialised,
        // persistent, clusters of two CTAs sharing the weights by TMA multicast; 6 as 2 with
        // the items taken from a counter in global memory (dynamic order).  Default 2
        // (benchmarks/ssmm_kernels.py compares them on the same inputs).
        const int which = env_int("SAMOYEDS_WGMMA_KERNEL", 0);
        if (which != 1 && ws_tma_usable(ps)) {
            const int ctas = which == 3 ? 0 : device_sm_count();
            // SAMOYEDS_WGMMA_TOKENS_TMA: 1 (default) the token rows by TMA where they can be,
            // 0 never (the gather, for comparisons), 2 required (an error where they cannot)
            const int want_bt = env_int("SAMOYEDS_WGMMA_TOKENS_TMA", 1);
            if (which == 5) {
                if (m == 1) return launch_ws<T, 1, false, 2>(ps, stream, ctas, want_bt);
#if SAM_WS_CLUSTER_TALL
                switch (ws_tall_tile(ps, want_bt)) {
                case 96: return launch_ws<T, 2, false, 2, false, 96>(ps, stream, ctas, want_bt);
                case 64: return launch_ws<T, 2, false, 2, false, 64>(ps, stream, ctas, want_bt);
                default: break;
                }
#endif
                return launch_ws<T, 2, false, 2>(ps, stream, ctas, want_bt);
            }
            if (which == 6) {
                if (m == 1) return launch_ws<T, 1, false, 1, true>(ps, stream, ctas, want_bt);
                return launch_ws<T, 2, false, 1, true>(ps, stream, ctas, want_bt);
            }
            if (m == 1 && which == 4) return launch_ws<T, 1, true>(ps, stream, ctas, want_bt);
            if (m == 1) return launch_ws<T, 1>(ps, stream, ctas, want_bt);
            switch (ws_tall_tile(ps, want_bt)) {
            case 96: return launch_ws<T, 2, false, 1, false, 96>(ps, stream, ctas, want_bt);
            case 64: return launch_ws<T, 2, false, 1, false, 64>(ps, stream, ctas, want_bt);
            default: break;
            }
            return launch_ws<T, 2>(ps, stream, ctas, want_bt);
        }
        if (m == 1) return launch<T, Cfg<1, 64, 4, 6>, K_WGMMA>(ps, stream);
        return launch<T, Cfg<2, 64, 4, 6>, K_WGMMA>(ps, stream);
    }
    if (ps->impl == 2) {
        set_error("ssmm: the wgmma.sp kernel needs an sm_90 device, a build for sm_90a and a format 2:4 or "
                  "1:2:V with V a multiple of 128 (got %d:%d:%d)", ps->f.n, ps->f.m, ps->f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (m == 1) return launch_cfg<T, 1>(ps, stream, variant);
    if (m == 2) return launch_cfg<T, 2>(ps, stream, variant);
    if (m == 4) return launch_cfg<T, 4>(ps, stream, variant);
    set_error("ssmm: the GPU kernel supports formats 2:4, 1:2:V and 1:4:V; got %d:%d:%d", ps->f.n, ps->f.m,
              ps->f.v);
    return SAM_STATUS_UNSUPPORTED;
}

}  // namespace
}  // namespace sam

// Whether this build reads SAMOYEDS_WS_DROP (SAM_WS_DROP above).
extern "C" int sam_ssmm_ws_drop_compiled(void) { return SAM_WS_DROP != 0; }

extern "C" sam_status sam_ssmm_cuda(const sam_ssmm_params *ps, void *stream) {
    const sam_format f = ps->f;
    if (f.n != 1) {
        sam::set_error("ssmm: the GPU kernel needs n = 1 (formats 2:4, 1:2:V, 1:4:V); got %d:%d:%d", f.n, f.m, f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && f.v % 64 != 0) {
        sam::set_error("ssmm: the GPU kernel needs a slice length v that is a multiple of 64; got %d", f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.glu == (ps->act == SAM_ACT_NONE)) {
        sam::set_error("ssmm: the GPU kernel pairs a gated activation with a glu-packed weight and no "
                       "activation with a plain one (glu=%d, act=%d)", f.glu, (int)ps->act);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (ps->d.C % 8 != 0) {
        sam::set_error("ssmm: the GPU kernel needs the column count to be a multiple of 8 (16-byte rows); got %lld",
                       (long long)ps->d.C);
        return SAM_STATUS_UNSUPPORTED;
    }
    // decode / small-T: split-K kernel of cuda/ssmm_decode.cu (threshold: docs/PERFORMANCE.md)
    if (ps->impl == 3 || (ps->impl == 0 && sam_ssmm_use_decode(ps)))
        return sam_ssmm_decode_cuda(ps, stream);
    return sam::with_tc_dtype(ps->dtype, [&](auto t) { return sam::launch_m<decltype(t)>(ps, (cudaStream_t)stream); });
}
