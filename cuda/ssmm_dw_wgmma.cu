// ssmm_dw_wgmma.cu -- the weight gradient of an ssmm in the packed layout on Hopper
// (dense wgmma.mma_async m64n256k16, sm_90a): what sam_ssmm_dw_cuda runs on sm_90 devices
// (dw_choose_kernel, ssmm_dw.cuh).  Same definition as the mma.sync kernel (ssmm_dw.cu,
// csrc/ssmm_ref.c sam_ssmm_dw_ref):
//     out[e][p][j] = sum over sorted rows s of e of dy[s][r] * scale[s] * x[tok(s)][col]
// for storage row p (original row r in the slice of col) and the kept column col of slot j.
//
// ---- the product, transposed --------------------------------------------------------------
// D^T[c][p] = sum_s X[s][c] G_j[s][p], c = columns of x (wgmma M), p = storage rows (wgmma
// N), K = the expert's sorted rows; G_j[s][p] = dy[s][row of p in slice j] * scale[s]
// ("dy gathered for slice j").  Both operands arrive token-major: per token, x's columns and
// dy's rows are contiguous, i.e. M-contiguous for wgmma's A and N-contiguous for its B:
// both are MN-major shared-memory tiles read with the transpose bits set (16-bit types).
// Columns on M makes the slice a property of the A operand's 64-row block: V % 64 == 0,
// so the 64 columns of one wgmma (m64) lie in one slice and each consumer warpgroup's B is
// the dy gathered for that one slice, with all 256 storage rows in one m64n256k16.
//
// ---- gather or select (the arithmetic) ----------------------------------------------------
// Either (a) gather: a producer picks each storage row's kept row of dy per slice into the B
// tile (MMA work R/M x C per token: the kept entries' share of dense), or (b) compute all M
// candidate rows of every group densely (B = dy's R rows as they are) and keep the selected
// one in the epilogue (MMA work R x C per token, as cuBLAS's dense dW).  At an equal MMA
// rate (b) is at best cuBLAS's time (1.0x), below the 1.5x target for every M > 1; (a)
// bounds at M x (2x for 1:2:V, 4x for 1:4:V) and pays the gather: per token and CTA tile
// (128 columns x 256 storage rows) it loads 256 M x 2 bytes of dy into registers (M
// candidates per kept row), permutes bytes and stores 512 bytes per slice into shared
// memory, against 32K MMA multiply-adds; at 1:2:128 that is 1 KB of L2 reads and 512 B
// of st.shared per 32K MACs (plus 256 B of x by cp.async), next to the 10 KB per k16 per
// warpgroup that wgmma itself reads from shared memory: the gather adds ~20 % to the
// shared-memory traffic, the selection in the epilogue would add 100 % (M = 2) to 300 %
// (M = 4) to the tensor-core time.  So (a), the gather, by one producer warpgroup.
//
// ---- gather, or copy first (dw_use_copy, ssmm_dw.cuh) --------------------------------------
// The gather below re-reads M candidate rows of dy per kept row and permutes them in every
// CTA of a row block, i.e. once per column block.  The rule instead has the launcher write
// dy transposed once (ssmm_dyt.cuh: per sorted row s of expert e, column dyt_segment(e) + s -
// offsets[e], scaled and rounded as the gather does; segments on 64-column boundaries with
// zeros to the next k-tile; a zero row R) and the producer (TR) copies each storage row's
// kept row of it, 64 tokens = one 128-byte K-major row per k-tile, straight into a B tile by
// cp.async: per k-tile 32 KB of dy instead of 32 M KB of candidates, no permutes, no
// staging, so one more stage (4).  The consumers read that B K-major (wgmma's transpose bit
// 0, the start stepping 32 bytes per k16).  The TR producer is built to issue few
// instructions (~190 a k-tile, from ~500; ncu showed the consumers waiting on it): the copy's
// row of each storage row is found once per CTA (into shared memory, then 16 running
// pointers a thread, the zero row where none is kept: no predicates), and x's row offsets
// of a k-tile are written a k-tile ahead by 64 threads into shared memory, their token ids
// loaded two k-tiles ahead.  The gather stays for where the copy cannot be allocated.
// Measured: docs/KERNELS.md.
//
// ---- the CTA ---------------------------------------------------------------------------
// One CTA per (expert, 256 storage rows, 128 columns): the grid is known on the host, every
// output entry is written by exactly one CTA (experts without rows: zeros), no atomics, a
// fixed order per entry (k-tiles in order, wgmma's fp32 accumulation): deterministic.
// 384 threads = 3 warpgroups:
//   WG 0, producer: per k-tile of 64 sorted rows, into a ring of ST stages:
//     X: the 64 tokens' rows of x, columns c0 .. c0 + 127, gathered by token id with
//        cp.async (16-byte pieces, zero-filled past the expert's rows, for invalid tokens and
//        past C): TMA cannot gather rows on sm_90, and even with the identity row map (the
//        down projection) a TMA box would read the next expert's rows into the last k-tile,
//        which must be zero here (they would be summed), so one cp.async path serves both;
//        completes on the stage's `full` barrier by cp.async.mbarrier.arrive.noinc.
//     G: per distinct slice of the CTA's two 64-column halves (NSL = 1 or 2), dy gathered:
//        each thread owns 8 storage rows (one 16-byte piece) of one 64-row block and token
//        rows kr + 4 i (i < 16) of every k-tile; in two steps (below): the M candidate
//        pieces of a token row (16 bytes each, 8 M consecutive rows of dy) and its scale go
//        by cp.async into the thread's own slots of a staging area, and a few rows later
//        the thread reads them back (ld.shared), picks with byte permutes (selectors from
//        idx, once per CTA), scales, and stores the piece (st.shared) into the stage, then
//        fences the generic proxy against the async one and arrives.
//   WG 1, 2, consumers: columns c0 + 64 (wg - 1) .. + 63, all 256 storage rows: per k-tile 4
//     wgmma m64n256k16 (128 fp32 accumulators per thread), one k-tile of wgmmas in flight,
//     the stage released (`empty`) when the wgmmas that read it are done.
//
// ---- the producer's dy gather: bytes in flight (the arithmetic) -----------------------------
// Per k-tile a CTA does 2 x 4 m64n256k16 = 2.1 M MACs: 1024 cycles of an SM's tensor cores
// (2048 dense 16-bit MACs per cycle), and reads from L2 64 x 256 M x 2 = 32 M KB of dy
// candidates (64 KB at M = 2) and 16 KB of x.  Measured (Mixtral gate_up, T = 4096,
// 1:2:128: 1738 k-tiles per SM in 7.2 ms) a k-tile took ~7200 cycles, 11 bytes per cycle
// per SM from L2 (2.6 TB/s in all), with the consumers waiting on `full` (53 % of the stall
// samples): latency-bound, too few bytes in flight.  The previous producer held the
// candidates in registers: GB = 8 token rows x M pieces per batch (32 KB per SM at M = 2,
// 16 KB at M = 1 and 4), loaded, waited for, then permuted with nothing in flight (two
// round trips per k-tile, serialised with the permutes); GB = 16 spills at 168 registers,
// and setmaxnreg could move only ~32 registers per producer thread (384 x 168 = 64.5 K, the
// consumers need 128 accumulators + addressing): ~8 more pieces, not 2x.  Here the
// candidates land in shared memory by cp.async, which holds no registers: D token rows
// per thread are staged (a ring of 4 cp.async groups of RB = D / 4 rows), the loads of
// group n + 4 are issued right after group n is permuted, so D - RB rows stay in flight
// all the time, independent of the permutes:
//     D = 16 (M = 1; M = 2, NSL = 1): 32 / 64 KB per SM in flight, a whole k-tile ahead;
//     D = 8 (M = 4, NSL = 1; M = 2, NSL = 2): 64 / 32 KB; D = 4 (M = 4, NSL = 2): 32 KB.
// Little's law at ~1000 cycles of loaded L2 latency: 64 KB in flight sustains 64 B/cycle,
// above an SM's share of L2 bandwidth (~5.5-7 TB/s: 24-30 B/cycle), so the bound moves
// to L2 itself: 80 KB per k-tile at 24-30 B/cycle = 2700-3300 cycles (next: the shared
// memory, (80 KB wgmma + 16 KB x + 32 KB G + 2 x 64 KB staged candidates) / 128 B per
// cycle = 2000 cycles; the producer's ~50 instructions per token row, ~800 issue cycles
// of its warp's scheduler; the tensor cores, 1024).  Expected: ~2x, 7.2 -> ~3.5 ms for
// that case.  ncu if it works: the consumers' `full` waits (long scoreboard on the
// mbarrier try_wait) well under half of the stall samples, L2 -> SM throughput
// (lts__t_sectors_srcunit_tex) near its peak, the producer's stalls at
// cp.async.wait_group rather than on global loads.  What is then left is L2 traffic: every
// CTA of an (expert, row block) loads the same candidates for its own 128 columns (32
// column blocks for Mixtral), which a cluster along the column blocks could share (TMA
// multicast of the raw candidates into this staging area).
// The staging is thread-private (each thread reads back only what its own cp.asyncs wrote:
// cp.async.wait_group orders them, no barrier), 16-byte pieces at [slot][candidate][thread]
// and scales at [slot][thread] (a warp's 16-byte accesses cover 512 contiguous bytes: no
// bank conflicts).  The candidates go by cp.async.ca (cp_async16_ca: pieces c, c + 1 share a
// sector); with up to 222 KB of shared memory ~34 KB of L1 is left, enough for a reuse one
// instruction apart.  dy not in 16-byte pieces (dy_vec = 0) goes through registers into the
// same slots (element loads, st.shared), read back in program order.
// Shared memory: per stage X 2 x [64 tokens][128 B], G NSL x 4 x [64 tokens][128 B]; all
// tiles in the 128-byte swizzle (16-byte chunk ^ token % 8), 1024-byte aligned blocks;
// then the staging (128 threads x D x (16 M + 4) bytes), then the barriers.
//   NSL = 1 (V % 128 == 0, or M == 1): 48 KB, 3 stages + 40 / 72 / 68 KB (M = 1 / 2 / 4);
//   NSL = 2: 80 KB, 2 stages + 36 / 34 KB (M = 2 / 4).
//
// ---- epilogue ------------------------------------------------------------------------------
// After both consumers' last wgmma (a named barrier of the 256 consumer threads; the
// producer has nothing in flight then), the ring and the candidate staging are reused: each warp writes its
// 16 columns x 256 storage rows of fp32 sums transposed, [p][20 words] (no bank conflicts
// for the fragment's writes), then each lane finishes storage rows lane + 32 i: reads its 16
// sums, picks the 2 kept of every 4 columns from the meta nibbles, rounds once and stores the
// 8 packed values as one 16-byte store.  Padding rows (q >= rc) and columns (>= C) get 0;
// rows past rp belong to no CTA's output and are not stored.
#include <string.h>

#include "ptx_wgmma.cuh"
#include "ssmm_dw.cuh"
#include "ssmm_dyt.cuh"
#include "ssmm_work.cuh"
#include "tma.cuh"

namespace sam {
namespace {

constexpr int DWG_BN = 256;        // storage rows per CTA (wgmma N)
constexpr int DWG_BC = 128;        // columns per CTA (two consumer warpgroups x m64)
constexpr int DWG_BK = 64;         // tokens per k-tile (4 x k16)
constexpr int DWG_THREADS = 384;   // producer + 2 consumer warpgroups
constexpr int DWG_XBYTES = 2 * DWG_BK * 128;      // X tile: 2 column blocks
constexpr int DWG_GBLOCK = DWG_BK * 128;          // one 64-row block of a G tile (LBO)
constexpr int DWG_GBYTES = 4 * DWG_GBLOCK;        // one G tile: 256 storage rows
constexpr int DWG_STG_WORDS = 20;                 // epilogue staging: row stride in 32-bit words
constexpr int DWG_STG_BYTES = DWG_BN * DWG_STG_WORDS * 4;  // one warp's staging area (20 KB)

// TR: G from the transposed copy of dy (K-major tiles by cp.async, no candidate staging, one
// stage more); else the register/staging gather above.
template <int M, int NSL, bool TR = false> struct DwgCfg {
    static constexpr int STAGE = DWG_XBYTES + NSL * DWG_GBYTES;
    static constexpr int ST = NSL == 1 ? (TR ? 4 : 3) : 2;
    static constexpr int PIPE = ST * STAGE;
    // candidate staging: D token rows per producer thread, 4 cp.async groups of RB rows
    static constexpr int D = 32 / (M * NSL > 2 ? M * NSL : 2);
    static constexpr int RB = D / 4;
    static constexpr int RAW_OFF = PIPE;                      // [D][M][128 threads] x 16 B
    static constexpr int SC_OFF = RAW_OFF + (TR ? 0 : D * M * 128 * 16);  // [D][128 threads] x 4 B
    static constexpr int GROW_OFF = SC_OFF + (TR ? 0 : D * 128 * 4);     // TR: [NSL][256] dyt rows
    static constexpr int XOFF_OFF = GROW_OFF + (TR ? NSL * DWG_BN * 4 : 0);  // TR: [2][64] x rows
    static constexpr int BAR_OFF = XOFF_OFF + (TR ? 2 * DWG_BK * 8 : 0);    // full[ST], empty[ST]
    static_assert(DWG_BK / 4 % RB == 0, "whole groups per k-tile");
    static_assert(BAR_OFF >= 8 * DWG_STG_BYTES, "the epilogue's staging reuses the ring and the candidate staging");
    static_assert(STAGE % 1024 == 0 && DWG_XBYTES % 1024 == 0 && DWG_GBLOCK % 1024 == 0,
                  "1024-byte aligned tiles (128-byte swizzle atoms; descriptors with base offset 0)");
    static_assert((DWG_GBLOCK >> 4) < (1 << 14), "LBO fits its 14-bit descriptor field");
    static constexpr int SMEM = BAR_OFF + 2 * ST * 8 + 1024;  // + alignment slack
    static_assert(SMEM <= 227 * 1024, "shared memory");
};

// T: bf16 / fp16; M: rows per group (1, 2, 4); NSL: G tiles per stage (1 or 2); TR: G from
// p.dyt (K-major B) instead of the gather from dy.
template <typename T, int M, int NSL, bool TR>
__global__ void __launch_bounds__(DWG_THREADS, 1) ssmm_dw_wgmma_kernel(const DwArgs p) {
#ifdef SAM_HAS_WGMMA
    using C = DwgCfg<M, NSL, TR>;
    constexpr int ST = C::ST;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = align_smem(smem_raw);
    const uint32_t sbase = smem_u32(smem);
    const uint32_t bar0 = sbase + C::BAR_OFF;
    auto full_bar = [&](int s) { return bar0 + 8u * s; };
    auto empty_bar = [&](int s) { return bar0 + 8u * (ST + s); };
    const int tid = threadIdx.x;

    // ---- the work item: (expert, row block, column block), column blocks fastest
    int64_t item = blockIdx.x;
    const int cb = (int)(item % p.ncb);
    item /= p.ncb;
    const int rb = (int)(item % p.nrb);
    const int e = (int)(item / p.nrb);
    const int64_t row0 = (int64_t)rb * DWG_BN, c0 = (int64_t)cb * DWG_BC;
    const int64_t s_begin = max(0, p.offsets[e]);
    const int64_t s_end = min((int64_t)p.offsets[e + 1], p.S);
    const int n_e = (int)max((int64_t)0, s_end - s_begin);
    const int KT = (n_e + DWG_BK - 1) / DWG_BK;
    // slices: half h (columns c0 + 64 h ..) lies in slice (c0 + 64 h) / V; G tile slot of half h
    const int64_t j0 = M > 1 ? c0 / p.v : 0;
    const int slot1 = (NSL == 2 && M > 1) ? (int)((c0 + 64) / p.v - j0) : 0;  // 0 or 1

    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(full_bar(s), 2 * 128);  // every producer thread: its cp.asyncs (noinc) + its stores
            mbar_init(empty_bar(s), 2 * 128);  // every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // the producers' common part: X, chunk xc (16 bytes; column block xc / 8, chunk xc % 8) of
    // token rows xr + 8 i, gathered by token id with cp.async (zero-filled past the expert's rows,
    // for invalid tokens and past C); its token ids of k-tile kt (-1: none), all loads issued
    // before any is used: one id load after another, each waited for by its copy, was most of
    // the producer's time (ncu: 8 serialised L2 round trips per k-tile); the next k-tile's are
    // loaded one k-tile ahead, in flight during this one's dy copies
    const int xc = tid & 15, xr = tid >> 4;
    const int64_t xcol = c0 + 8 * xc;
    const bool x_colok = xcol < p.C;
    const uint32_t x_dst = (uint32_t)((xc >> 3) * DWG_BK * 128);  // + row * 128 + swizzled chunk
    // (loads unconditional, clamped to the expert's last row: independent, all in flight at once)
    auto load_ids = [&](int kt, int32_t (&ids)[DWG_BK / 8]) {
        int32_t v[DWG_BK / 8];
        if (p.token_ids) {
#pragma unroll
            for (int i = 0; i < DWG_BK / 8; i++)
                v[i] = __ldg(p.token_ids + s_begin + min(kt * DWG_BK + xr + 8 * i, n_e - 1));
        } else {
#pragma unroll
            for (int i = 0; i < DWG_BK / 8; i++) v[i] = (int32_t)(s_begin + kt * DWG_BK + xr + 8 * i);
        }
#pragma unroll
        for (int i = 0; i < DWG_BK / 8; i++) ids[i] = kt * DWG_BK + xr + 8 * i < n_e ? v[i] : -1;
    };
    const T *xbase = static_cast<const T *>(p.x) + (x_colok ? xcol : 0);
    auto copy_x = [&](uint32_t stage, const int32_t (&tok)[DWG_BK / 8]) {
#pragma unroll
        for (int i = 0; i < DWG_BK / 8; i++) {
            const int r = xr + 8 * i;
            const int32_t t = tok[i];
            const bool ok = x_colok && t >= 0 && (int64_t)t < p.T;
            cp_async16(stage + x_dst + r * 128 + (((xc & 7) ^ (r & 7)) << 4), xbase + (ok ? (int64_t)t * p.ldx : 0), ok);
        }
    };

    // k-tile kt's stage once the consumers have released it, X's copies into it issued; the
    // next k-tile's token ids loaded into tok_next
    auto stage_x = [&](int kt, int32_t (&tok_next)[DWG_BK / 8]) {
        int32_t tok[DWG_BK / 8];
#pragma unroll
        for (int i = 0; i < DWG_BK / 8; i++) tok[i] = tok_next[i];
        if (kt + 1 < KT) load_ids(kt + 1, tok_next);
        const int st = kt % ST;
        if (kt >= ST) mbar_wait(empty_bar(st), ((kt / ST) - 1) & 1);
        const uint32_t stage = sbase + (uint32_t)st * C::STAGE;
        copy_x(stage, tok);
        return stage;
    };

    if (tid < 128 && TR) {
        // ================= producer, from dy's transposed copy =================
        // per k-tile: X as below; G as K-major tiles, storage row n of the CTA (slot s) one
        // 128-byte row (64 tokens) of p.dyt: the kept row of its slice (the copy's zero row R
        // where there is none), 16-byte pieces by cp.async (a warp's copy covers 4 whole rows).
        // The segments of the copy are 64-column aligned with zeros to the next k-tile past the
        // expert's rows (ssmm_dyt.cuh): no predicate, each piece's source a running pointer.
        const int ptid = tid;
        const T *dyt = static_cast<const T *>(p.dyt);
        const int gq = ptid & 7, gn = ptid >> 3;  // chunk, first row (then + 16 i)
        const int nsl_cta = (NSL == 2 && slot1 == 1) ? 2 : 1;
        // the copy's row behind every storage row of the CTA and slot, into shared memory (two
        // or four per thread, their idx loads in flight together), then each thread's 16
        const int64_t zrow = p.glu ? 2 * p.half_rows : p.half_rows;
        int32_t *grow_s = reinterpret_cast<int32_t *>(smem + C::GROW_OFF);
#pragma unroll
        for (int k0 = 0; k0 < NSL * DWG_BN; k0 += 128) {
            const int k = k0 + ptid, s = k / DWG_BN;
            const int64_t P = row0 + k % DWG_BN;
            const bool live = s < nsl_cta && P < p.rp && (M == 1 || j0 + s < p.slices);
            int64_t sel = 0;
            if (M > 1) {
                const uint8_t *ip = p.idx + ((int64_t)e * p.slices + j0 + s) * p.rp + P;
                sel = __ldg(live ? ip : p.idx) & (M - 1);
            }
            int64_t uh = 0, uq = P;
            if (p.glu) {
                uh = (P / 64) & 1;
                uq = (P / 64 >> 1) * 64 + P % 64;
            }
            const int64_t local = uq * M + sel;
            grow_s[k] = (int32_t)(live && local < p.half_rows ? uh * p.half_rows + local : zrow);
        }
        named_barrier_sync(2, 128);
        const int64_t seg = dyt_segment(p.offsets, e);
        const T *gp[NSL][16];
#pragma unroll
        for (int s = 0; s < NSL; s++)
#pragma unroll
            for (int i = 0; i < 16; i++) gp[s][i] = dyt + (int64_t)grow_s[s * DWG_BN + gn + 16 * i] * p.ldt + seg + 8 * gq;
        const uint32_t g_dst = (uint32_t)(DWG_XBYTES + gn * 128 + ((gq ^ (gn & 7)) << 4));  // + slot, 16 i rows
        // X: the element offset in x of each token row of a k-tile (-1: zeros), written a
        // k-tile ahead by threads < 64 (row ptid, its token id loaded two k-tiles ahead) into
        // xoff_s[kt & 1][xr][i] (row xr + 8 i): each thread reads its 8 rows as 64 contiguous bytes
        int64_t *xoff_s = reinterpret_cast<int64_t *>(smem + C::XOFF_OFF);
        // the token id of row ptid of k-tile kt, raw (its load left in flight until x_put's use)
        auto x_id = [&](int kt) -> int32_t {
            const int kk = min(kt * DWG_BK + ptid, n_e - 1);
            return p.token_ids ? __ldg(p.token_ids + s_begin + kk) : (int32_t)(s_begin + kk);
        };
        auto x_put = [&](int kt, int32_t id) {  // (bytes; x's rows are 16-byte aligned: the binding)
            const int64_t t = kt * DWG_BK + ptid < n_e ? (int64_t)id : -1;
            xoff_s[(kt & 1) * DWG_BK + (ptid & 7) * 8 + (ptid >> 3)] =
                t >= 0 && t < p.T ? t * p.ldx * (int64_t)sizeof(T) : -1;
        };
        int32_t id_next = 0;
        if (ptid < DWG_BK && KT > 0) {
            x_put(0, x_id(0));
            if (KT > 1) id_next = x_id(1);
        }
        named_barrier_sync(2, 128);
        const char *xb = reinterpret_cast<const char *>(static_cast<const T *>(p.x) + (x_colok ? xcol : 0));
        const uint32_t xoff_rd = smem_u32(xoff_s) + (uint32_t)xr * 64;
        for (int kt = 0; kt < KT; kt++) {
            const int st = kt % ST;
            // this k-tile's x offsets (written before the last barrier), read before the wait
            uint4 xv[DWG_BK / 16];
#pragma unroll
            for (int i = 0; i < DWG_BK / 16; i++) xv[i] = lds_v4(xoff_rd + (kt & 1) * DWG_BK * 8 + 16 * i);
            if (kt >= ST) mbar_wait(empty_bar(st), ((kt / ST) - 1) & 1);
            const uint32_t stage = sbase + (uint32_t)st * C::STAGE;
#pragma unroll
            for (int i = 0; i < DWG_BK / 8; i += 2) {
                const uint4 v = xv[i / 2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = xr + 8 * (i + h);
                    const uint32_t lo = h ? v.z : v.x, hi = h ? v.w : v.y;
                    const bool ok = x_colok && (int32_t)hi >= 0;  // -1: no row
                    const int64_t off = ok ? (int64_t)(((uint64_t)hi << 32) | lo) : 0;
                    cp_async16(stage + x_dst + r * 128 + (((xc & 7) ^ (r & 7)) << 4), xb + off, ok);
                }
            }
#pragma unroll
            for (int s = 0; s < NSL; s++)
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    if (s < nsl_cta) cp_async16(stage + g_dst + s * DWG_GBYTES + i * 16 * 128, gp[s][i], true);
                    gp[s][i] += DWG_BK;
                }
            cp_async_mbar_arrive(full_bar(st));
            mbar_arrive(full_bar(st));
            if (kt + 1 < KT) {
                if (ptid < DWG_BK) {
                    x_put(kt + 1, id_next);
                    if (kt + 2 < KT) id_next = x_id(kt + 2);
                }
                named_barrier_sync(2, 128);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }
    if (tid < 128) {
        // ================= producer =================
        const int ptid = tid;
        const T *dy = static_cast<const T *>(p.dy);
        // G: 8-row piece P8 of 64-row block ub, token rows kr + 4 i (i < 16)
        const int P8 = ptid & 7, ub = (ptid >> 3) & 3, kr = ptid >> 5;
        const int64_t pb = row0 + 64 * ub;  // first storage row of the block
        const bool ub_live = pb < p.rp;
        int uh = 0;
        int64_t uq0 = pb;
        if (p.glu) {
            uh = (int)((pb / 64) & 1);
            uq0 = (pb / 64 >> 1) * 64;
        }
        const int64_t u_local = (uq0 + 8 * P8) * M;                  // first candidate row in the half
        const int64_t u_base = (int64_t)uh * p.half_rows + u_local;  // ... in dy's columns
        unsigned u_rowok = 0;  // 16-byte candidate pieces c < M inside the half
#pragma unroll
        for (int c = 0; c < M; c++) u_rowok |= (unsigned)(ub_live && u_local + 8 * c < p.half_rows) << c;
        uint32_t sel[NSL][2];
#pragma unroll
        for (int s = 0; s < NSL; s++) {
            sel[s][0] = sel[s][1] = 0u;
            // slot s's slice: j0 + s (NSL == 2: a second slice only where the halves differ)
            if (M > 1 && ub_live && (s == 0 || slot1 == 1) && j0 + s < p.slices) {
                const uint8_t *ip = p.idx + ((int64_t)e * p.slices + j0 + s) * p.rp + pb + 8 * P8;
                make_selectors<M>(*reinterpret_cast<const uint2 *>(ip), sel[s]);
            }
        }
        const int nsl_cta = (NSL == 2 && slot1 == 1) ? 2 : 1;
        const uint32_t g_dst = (uint32_t)(DWG_XBYTES + ub * DWG_GBLOCK);  // + slot, row, swizzled chunk

        // dy's candidates through the staging: group n (of the CTA's 16 / RB per k-tile) holds
        // token rows kr + 4 (RB (n % NG) + b), b < RB, of k-tile n / NG, in slots RB (n % 4) + b
        constexpr int RB = C::RB, NG = DWG_BK / 4 / RB;
        const int NGT = KT * NG;
        const uint32_t raw0 = sbase + C::RAW_OFF + 16u * ptid, sc0 = sbase + C::SC_OFF + 4u * ptid;
        auto raw_at = [&](int d, int c) { return raw0 + (uint32_t)(d * M + c) * (128 * 16); };
        auto sc_at = [&](int d) { return sc0 + (uint32_t)d * (128 * 4); };
        auto issue = [&](int n) {
            if (n < NGT) {
                const int kt = n / NG, i0 = RB * (n % NG);
#pragma unroll
                for (int b = 0; b < RB; b++) {
                    const int d = RB * (n & 3) + b;
                    const int kk = kt * DWG_BK + kr + 4 * (i0 + b);
                    const int64_t s = s_begin + kk;
                    const int64_t u = kk < n_e ? dw_dy_row(p, s) : -1;
                    const bool tv = u >= 0;  // (an id outside dy: a zero row)
                    if (p.scale) cp_async4(sc_at(d), tv ? p.scale + s : p.scale, tv);
                    const T *row = dy + (tv ? u : 0) * p.lddy;
                    if (p.dy_vec) {
#pragma unroll
                        for (int c = 0; c < M; c++) {
                            const bool ok = tv && ((u_rowok >> c) & 1u);
                            cp_async16_ca(raw_at(d, c), ok ? row + u_base + 8 * c : dy, ok);
                        }
                    } else {
                        // rows not in 16-byte pieces (the half's rows or dy's row start not a multiple of 8)
                        const unsigned short *r16 = reinterpret_cast<const unsigned short *>(row);
#pragma unroll
                        for (int c = 0; c < M; c++) {
                            uint32_t w[4];
#pragma unroll
                            for (int q = 0; q < 4; q++) {
                                uint32_t lo = 0, hi = 0;
                                const int64_t l0 = u_local + 8 * c + 2 * q;
                                if (tv && ub_live && l0 < p.half_rows) lo = __ldg(r16 + u_base + 8 * c + 2 * q);
                                if (tv && ub_live && l0 + 1 < p.half_rows) hi = __ldg(r16 + u_base + 8 * c + 2 * q + 1);
                                w[q] = lo | (hi << 16);
                            }
                            sts_v4(raw_at(d, c), w[0], w[1], w[2], w[3]);
                        }
                    }
                }
            }
            cp_async_commit();  // empty past the last group: the count of pending groups stays uniform
        };

        int32_t tok_next[DWG_BK / 8];
        if (KT > 0) load_ids(0, tok_next);
#pragma unroll
        for (int n = 0; n < 4; n++) issue(n);
        for (int kt = 0; kt < KT; kt++) {
            const int st = kt % ST;
            // X by cp.async (the arrive below also waits for this thread's earlier
            // cp.asyncs: the candidates of this k-tile, issued before, needed for it anyway)
            const uint32_t stage = stage_x(kt, tok_next);
            cp_async_mbar_arrive(full_bar(st));
            // G from the staging: group n has landed when at most the 3 after it are pending
            // (4 prologue commits + one per issue(): n + 4 committed here).  X's copies above join
            // the next commit, group kt NG + 4; waiting for that group waits for them as well
#pragma unroll 1
            for (int g = 0; g < NG; g++) {
                const int n = kt * NG + g;
                cp_async_wait<3>();
#pragma unroll
                for (int b = 0; b < RB; b++) {
                    const int d = RB * (n & 3) + b;
                    const int r = kr + 4 * (RB * g + b);
                    uint32_t w[4 * M];
#pragma unroll
                    for (int c = 0; c < M; c++) {
                        const uint4 v = lds_v4(raw_at(d, c));
                        w[4 * c] = v.x;
                        w[4 * c + 1] = v.y;
                        w[4 * c + 2] = v.z;
                        w[4 * c + 3] = v.w;
                    }
                    const float rsc = p.scale ? lds_f32(sc_at(d)) : 1.0f;
                    const uint32_t dst = stage + g_dst + r * 128 + ((P8 ^ (r & 7)) << 4);
#pragma unroll
                    for (int s = 0; s < NSL; s++) {
                        if (s < nsl_cta) {
                            uint32_t o[4];
#pragma unroll
                            for (int k = 0; k < 4; k++) {
                                o[k] = gather_word<M>(w, sel[s], k);
                                if (p.scale) o[k] = scale2<T>(o[k], rsc);
                            }
                            sts_v4(dst + s * DWG_GBYTES, o[0], o[1], o[2], o[3]);
                        }
                    }
                }
                // its slots are free (read above, in program order): the group 4 ahead
                issue(n + 4);
            }
            // the stores above are read by wgmma (the async proxy): fence, then arrive
            fence_proxy_async();
            mbar_arrive(full_bar(st));
        }
        // every copy of this thread has landed before it exits: X's copies, which complete on
        // the mbarrier, also joined the group that the next issue() committed (cp.async.commit_group
        // takes every copy not yet in a group), and the groups past the last are empty; the commit
        // here only covers a copy that no later issue() committed (none today)
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }

    // ================= consumers =================
    const int wg = (tid >> 7) - 1;  // 0, 1: columns c0 + 64 wg ..
    const int wt = tid & 127, warp = wt >> 5, lane = tid & 31;
    const int slot = wg == 0 ? 0 : slot1;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    fence_regs(acc);  // the zeros are written before the first wgmma.fence
    for (int kt = 0; kt < KT; kt++) {
        const int st = kt % ST;
        mbar_wait(full_bar(st), (kt / ST) & 1);
        fence_proxy_async();  // x came through cp.async (the generic proxy)
        const uint32_t stage = sbase + (uint32_t)st * C::STAGE;
        const uint32_t a0 = stage + wg * DWG_BK * 128, b0 = stage + DWG_XBYTES + slot * DWG_GBYTES;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < DWG_BK / 16; ks++) {
            if constexpr (TR)
                WgmmaDenseMN256<T>::template run<true>(acc, smem_desc_mn_sw128(a0 + ks * 2048, DWG_GBLOCK),
                                                       smem_desc_sw128(b0 + ks * 32), 1);
            else
                WgmmaDenseMN256<T>::run(acc, smem_desc_mn_sw128(a0 + ks * 2048, DWG_GBLOCK),
                                        smem_desc_mn_sw128(b0 + ks * 2048, DWG_GBLOCK), 1);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc);
        // the wgmmas of k-tile kt - 1 are done: release its stage
        if (kt > 0) mbar_arrive(empty_bar((kt - 1) % ST));
    }
    wgmma_drain(acc);
    // both consumers are past their last wgmma, the producer has nothing in flight (every
    // stage it filled was waited for): the ring becomes the staging area
    named_barrier_sync(1, 256);

    // ---- epilogue: D^T fragment -> staging [p][c] (fp32) -> kept columns, one rounding
    const int g = lane >> 2, q = lane & 3;
    float *stg = reinterpret_cast<float *>(smem + (wg * 4 + warp) * DWG_STG_BYTES);
    // fragment: acc[4 j + 2 h + k] = D^T[16 warp + g + 8 h][8 j + 2 q + k]
#pragma unroll
    for (int j = 0; j < DWG_BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int k = 0; k < 2; k++) stg[(8 * j + 2 * q + k) * DWG_STG_WORDS + g + 8 * h] = acc[4 * j + 2 * h + k];
    __syncwarp();
    const int64_t cw = c0 + 64 * wg + 16 * warp;  // the warp's first column (16-aligned)
    const int64_t mtiles = p.cp / 32;
    const uint32_t *meta = p.meta + (int64_t)e * (p.rp / 16) * mtiles * 16;
    T *outp = static_cast<T *>(p.out) + (int64_t)e * p.rp * (p.cp / 2) + cw / 2;
    // the meta words of the lane's rows first (independent loads, all in flight at once)
    uint32_t mwv[DWG_BN / 32];
#pragma unroll
    for (int i = 0; i < DWG_BN / 32; i++) {
        const int64_t P = row0 + lane + 32 * i;
        int64_t qq = P;
        if (p.glu) qq = (P / 64 >> 1) * 64 + P % 64;
        const bool live = n_e > 0 && P < p.rp && qq < p.rc;
        // meta word: tile (P / 16, cw / 32), word 2 (P % 8) + (cw % 32) / 16, half (P % 16) / 8
        const uint32_t *mp = meta + ((P / 16) * mtiles + cw / 32) * 16 + 2 * (P % 8) + (cw % 32) / 16;
        const uint32_t mw = __ldg(live ? mp : p.meta);
        mwv[i] = live ? (mw >> (16 * ((P % 16) / 8))) & 0xffffu : 0u;
    }
#pragma unroll
    for (int i = 0; i < DWG_BN / 32; i++) {
        const int pl = lane + 32 * i;
        const int64_t P = row0 + pl;
        if (P >= p.rp) break;  // (uniform across the warp per i: rp % 64 == 0)
        int64_t qq = P;
        if (p.glu) qq = (P / 64 >> 1) * 64 + P % 64;
        const bool row_live = qq < p.rc;
        const float4 *src = reinterpret_cast<const float4 *>(stg + pl * DWG_STG_WORDS);
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float4 f = src[k];
            v[4 * k] = f.x;
            v[4 * k + 1] = f.y;
            v[4 * k + 2] = f.z;
            v[4 * k + 3] = f.w;
        }
        const uint32_t half = mwv[i];
        uint32_t o[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t nib = (half >> (4 * k)) & 0xfu;
            const float a = pick4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3], nib & 3u);
            const float b = pick4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3], nib >> 2);
            const bool ok = row_live && cw + 4 * k < p.C;
            o[k] = ok ? Elem<T>::pack2(a, b) : 0u;
        }
        st_global_v4(outp + P * (p.cp / 2), make_uint4(o[0], o[1], o[2], o[3]));
    }
#else
    (void)p;
    __trap();
#endif
}

template <typename T, int M, int NSL, bool TR>
sam_status launch(const DwArgs &a, int64_t grid, cudaStream_t stream) {
    using C = DwgCfg<M, NSL, TR>;
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_dw_wgmma_kernel<T, M, NSL, TR>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM),
                 "ssmm_dw");
    ssmm_dw_wgmma_kernel<T, M, NSL, TR><<<(unsigned)grid, DWG_THREADS, C::SMEM, stream>>>(a);
    return launch_status("ssmm_dw");
}

template <typename T, bool TR> sam_status launch_m(const DwArgs &a, int m, bool two, int64_t grid, cudaStream_t s) {
    switch (m) {
    case 1: return launch<T, 1, 1, TR>(a, grid, s);
    case 2: return two ? launch<T, 2, 2, TR>(a, grid, s) : launch<T, 2, 1, TR>(a, grid, s);
    default: return two ? launch<T, 4, 2, TR>(a, grid, s) : launch<T, 4, 1, TR>(a, grid, s);
    }
}

// dy's transposed copy (R x dyt_cols, scaled: ssmm_dyt.cuh) in stream-ordered memory, the
// kernel from it, the copy freed on the stream; where the memory cannot be had, the gather
// from dy.  The caller's copy (dy_t, a.dyt set) where it made one.
template <typename T> sam_status launch_t(DwArgs a, int m, bool two, int64_t grid, cudaStream_t s) {
    if (a.dyt != nullptr) return launch_m<T, true>(a, m, two, grid, s);  // the caller's copy (dy_t)
    const int64_t R = a.glu ? 2 * a.half_rows : a.half_rows;
    const DytSrc src{a.dy, a.lddy, a.dy_ids, a.Tdy, a.scale, a.offsets, a.S, a.E};
    sam_status st;
    T *buf = dyt_make<T>(src, R, s, &st);
    if (buf == nullptr) return launch_m<T, false>(a, m, two, grid, s);
    a.dyt = buf;
    a.ldt = dyt_cols(a.S, a.E);
    if (st == SAM_STATUS_OK) st = launch_m<T, true>(a, m, two, grid, s);
    cudaFreeAsync(buf, s);
    return st;
}

}  // namespace

bool ssmm_dw_wgmma_available() { return device_runs_sm90a(); }

sam_status ssmm_dw_wgmma_launch(const DwArgs &in, sam_dtype dtype, int m, bool copy, cudaStream_t stream) {
    DwArgs a = in;
    a.nrb = (int)ceil_div(a.rp, DWG_BN);
    a.ncb = (int)ceil_div(a.cp, DWG_BC);  // cp % 128 == 0: whole blocks
    const int64_t grid = (int64_t)a.E * a.nrb * a.ncb;
    if (grid > INT32_MAX) {
        set_error("ssmm_dw: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (grid == 0) return SAM_STATUS_OK;
    // two G tiles per stage where a CTA's two 64-column halves can lie in different slices
    const bool two = m > 1 && a.v % 128 != 0;
    if (!copy) {
        if (dtype == SAM_BF16) return launch_m<__nv_bfloat16, false>(a, m, two, grid, stream);
        return launch_m<__half, false>(a, m, two, grid, stream);
    }
    if (dtype == SAM_BF16) return launch_t<__nv_bfloat16>(a, m, two, grid, stream);
    return launch_t<__half>(a, m, two, grid, stream);
}

}  // namespace sam
