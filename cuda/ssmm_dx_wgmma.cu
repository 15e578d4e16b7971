// ssmm_dx_wgmma.cu -- the input gradient of an ssmm from the forward's own packing on Hopper
// (dense wgmma.mma_async m64n256k16, sm_90a): what sam_ssmm_dx_cuda runs on sm_90 devices
// (dx_choose_kernel, ssmm_dx.cuh).  Same definition as the mma.sync kernel (ssmm_dx.cu,
// csrc/ssmm_ref.c sam_ssmm_dx_ref):
//     out[s][c] = scale[s] * sum over storage rows p of dy[tok(s)][orig(p, c / V)] * Wc[p][c]
// over the kept rows only: tokens x Rp x C multiply-adds, half the dense product at 1:2:V.
// The 2:4 structure lies along dX's output columns, where sparse tensor cores cannot use it,
// so this is a dense product of the kept rows, with no transposed packing to refresh after
// an optimizer step.
//
// ---- the product, transposed --------------------------------------------------------------
// D^T[c][s] = sum_p Wc[p][c] G_j[p][s], c = columns (wgmma M), s = the CTA's sorted rows
// (wgmma N), K = storage rows; G_j[p][s] = dy[tok(s)][orig(p, j)] for the slice j of c.
// Columns on M makes the slice a property of the A operand's 64-row block (V % 64 == 0), so
// each consumer warpgroup's B is G for one slice, all 256 sorted rows in one m64n256k16 --
// the weight gradient's kernel (ssmm_dw_wgmma.cu) with the roles of the operands swapped.
// Both operands are MN-major shared-memory tiles (transpose bits set, 16-bit types):
//   A = Wc: per k-tile the 64 storage rows' 128 columns, decompressed by the consumers from
//       the packed values the producer copied into the stage (8 kept values and 16 meta bits
//       per 16 columns, byte permutes) and stored with st.shared into two [64 rows][128 B]
//       blocks (128-byte swizzle), one per consumer warpgroup;
//   B = G_j: the kept row orig(p, j) of every storage row p is one run of the CTA's 256
//       tokens in dy's transposed copy (ssmm_dyt.cuh, written first by the launcher:
//       dyt[r][segment(e) + i] = dy[tok(offsets[e] + i)][r]), copied as 16-byte pieces by
//       cp.async into four [64 rows][128 B] blocks (LBO 8 KB), zero-filled past the
//       expert's rows.  No M candidates per kept row and no permutes: the copy's one pass
//       over dy is shared by every column block (C / 128 of them).
// The scale multiplies the fp32 sums in the epilogue (one rounding, as the definition says).
//
// ---- the CTA ---------------------------------------------------------------------------
// One CTA per (expert, 256 sorted rows, 128 columns), found on the device from the offsets
// (dx_find_item, column blocks fastest: the CTAs that run together read the same token
// rows of the copy for different columns); every output entry written by one CTA, k-tiles
// in order, no atomics: deterministic.  CTAs past the last item zero the rows no expert
// owns.  384 threads = 3 warpgroups:
//   WG 0, producer: per k-tile of 64 storage rows, into a ring of ST stages (3 of 57 KB
//     with one G tile, 2 of 89 KB with two: the two 64-column halves in different slices,
//     V % 128 != 0), by cp.async: G, its source rows from idx staged RR - 1 = 3 k-tiles
//     ahead in the thread's own pieces of a small ring (no global load waited for in the
//     loop), then the k-tile's packed values and meta words; all complete on the stage's
//     `full` barrier by cp.async.mbarrier.arrive.noinc.  About 200 instructions a k-tile:
//     when the producer also decompressed A it issued 530 and the consumers starved.
//   WG 1, 2, consumers: columns c0 + 64 (wg - 1) .. + 63, all 256 rows: per k-tile make
//     their A block (a 16-entry table maps a meta nibble to both byte-permute selectors of
//     its 4 columns), fence the generic proxy against the async one, meet on a named
//     barrier, issue 4 wgmma m64n256k16 (128 fp32 accumulators per thread), and release
//     (`empty`) the stage of the k-tile before, whose wgmmas are then done.  A is made while
//     the previous k-tile's wgmmas run; made a whole k-tile ahead it was slower (docs/KERNELS.md).
// Per k-tile a CTA does 2.1 M multiply-adds and moves 32 KB of G and 8 KB of values from L2.
//
// ---- epilogue ------------------------------------------------------------------------------
// After both consumers' last wgmma (a named barrier of the 256 consumer threads) the ring is
// the staging area: each thread writes its sums times the row's scale, rounded once, as
// [256 rows][128 columns] (rows 272 bytes apart: the four rows of a warp's store land in
// different banks), then the 256 threads store whole 16-byte pieces of the rows this CTA
// owns (s < the tile's end, c < C).
#include "ptx_wgmma.cuh"
#include "ssmm_dx.cuh"
#include "ssmm_dyt.cuh"
#include "ssmm_work.cuh"
#include "tma.cuh"

namespace sam {
namespace {

constexpr int DXW_BM = 256;                    // sorted rows per CTA (wgmma N)
constexpr int DXW_BC = 128;                    // columns per CTA (two consumer warpgroups x m64)
constexpr int DXW_BK = 64;                     // storage rows per k-tile (4 x k16)
constexpr int DXW_THREADS = 384;               // producer + 2 consumer warpgroups
constexpr int DXW_ABLOCK = DXW_BK * 128;       // one 64-column block of the A tile (8 KB)
constexpr int DXW_ABYTES = 2 * DXW_ABLOCK;
constexpr int DXW_GBLOCK = DXW_BK * 128;       // one 64-row block of a G tile (LBO)
constexpr int DXW_GBYTES = 4 * DXW_GBLOCK;     // one G tile: 256 sorted rows
constexpr int DXW_STG_ROW = DXW_BC * 2 + 16;   // epilogue staging: bytes per sorted row

constexpr int DXW_VBYTES = DXW_BK * 128;       // the k-tile's packed values: [64 rows][128 B]
constexpr int DXW_MBYTES = 4 * 256;            // its meta: 4 tile rows x 4 column tiles x 16 words
// The producer's idx ring: per thread and k-tile, NSL 16-byte pieces (16 storage rows'
// selections per slot) [slot][piece][thread], issued RR - 1 k-tiles ahead of their use.
constexpr int DXW_RR = 4;

// A stage: A (decompressed by the consumers), G (NSL tiles), the packed values, the meta.
template <int NSL> struct DxwCfg {
    static constexpr int G_OFF = DXW_ABYTES;
    static constexpr int V_OFF = G_OFF + NSL * DXW_GBYTES;
    static constexpr int M_OFF = V_OFF + DXW_VBYTES;
    static constexpr int STAGE = M_OFF + DXW_MBYTES;
    static constexpr int ST = NSL == 1 ? 3 : 2;
    static constexpr int IDX_OFF = ST * STAGE;                               // [RR][NSL][128] x 16 B
    static constexpr int BAR_OFF = IDX_OFF + DXW_RR * NSL * 128 * 16;       // full[ST], empty[ST]
    static constexpr int SMEM = BAR_OFF + 2 * ST * 8 + 1024;               // + alignment slack
    static_assert(IDX_OFF >= DXW_BM * DXW_STG_ROW, "the epilogue's staging reuses the ring");
    static_assert(STAGE % 1024 == 0 && DXW_ABLOCK % 1024 == 0 && DXW_GBLOCK % 1024 == 0,
                  "1024-byte aligned tiles (128-byte swizzle atoms; descriptors with base offset 0)");
    static_assert((DXW_GBLOCK >> 4) < (1 << 14), "LBO fits its 14-bit descriptor field");
    static_assert(SMEM + 256 <= 227 * 1024, "shared memory (+ the static part)");
};

// T: bf16 / fp16; M: rows per group (1, 2, 4); NSL: G tiles per stage (1 or 2).
template <typename T, int M, int NSL>
__global__ void __launch_bounds__(DXW_THREADS, 1) ssmm_dx_wgmma_kernel(const DxArgs p) {
#ifdef SAM_HAS_WGMMA
    using C = DxwCfg<NSL>;
    constexpr int ST = C::ST;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ int s_warp[DXW_THREADS / 32];
    __shared__ int s_item[3];
    __shared__ uint2 s_lut[16];  // a 2:4 meta nibble -> the byte-permute selectors of its 4 dense columns
    unsigned char *smem = align_smem(smem_raw);
    const uint32_t sbase = smem_u32(smem);
    const uint32_t bar0 = sbase + C::BAR_OFF;
    auto full_bar = [&](int s) { return bar0 + 8u * s; };
    auto empty_bar = [&](int s) { return bar0 + 8u * (ST + s); };
    const int tid = threadIdx.x;
    const int64_t item = blockIdx.x;

    // ---- the work item: expert, row tile, column block (column blocks fastest)
    const int64_t tiles = dx_find_item<DXW_BM, DXW_THREADS, false>(p, item, s_warp, s_item);
    const int e = s_item[0];
    if (e < 0) {
        const int64_t busy = (int64_t)p.ncb * tiles;
        if (item >= busy)
            dx_zero_rows<T, DXW_BM, DXW_BC, DXW_THREADS>(p, item - busy, (int64_t)gridDim.x - busy);
        return;
    }
    const int rt = s_item[1], cb = s_item[2];
    const int64_t s_begin = clamp_rows(p.offsets[e], p.S) + (int64_t)rt * DXW_BM;
    const int64_t s_end = min(clamp_rows(p.offsets[e + 1], p.S), s_begin + DXW_BM);
    const int nrow = (int)(s_end - s_begin);  // 1 .. 256
    const int64_t c0 = (int64_t)cb * DXW_BC;
    const int KT = (int)(p.rp / DXW_BK);
    // slices: half h (columns c0 + 64 h ..) lies in slice (c0 + 64 h) / V; G tile slot of half h
    const int64_t j0 = M > 1 ? c0 / p.v : 0;
    const int slot1 = (NSL == 2 && M > 1) ? (int)((c0 + 64) / p.v - j0) : 0;  // 0 or 1

    if (tid < 16) {
        // nibble (i0 | i1 << 2): dense column j holds kept value 0 where j == i0, 1 where j == i1,
        // else 0; the selector of columns 0, 1, then of columns 2, 3
        const uint32_t i0 = tid & 3, i1 = tid >> 2;
        s_lut[tid] = make_uint2(dense_sel(i0, i1, 0) | (dense_sel(i0, i1, 1) << 8),
                                dense_sel(i0, i1, 2) | (dense_sel(i0, i1, 3) << 8));
    }
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(full_bar(s), 128);       // every producer thread: its cp.asyncs (noinc)
            mbar_init(empty_bar(s), 2 * 128);  // every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid < 128) {
        // ================= producer =================
        const int ptid = tid;
        // G: token chunk gq (8 rows) of storage rows 16 gn + i (i < 16) of each k-tile; a warp
        // copies 4 runs of 512 contiguous bytes per storage row
        const int gq = ptid & 31, gn = ptid >> 5;
        const T *dyt = static_cast<const T *>(p.dyt);
        const bool tok_ok = 8 * gq < nrow;
        const int64_t tcol = dyt_segment(p.offsets, e) + (int64_t)rt * DXW_BM + 8 * gq;
        const uint32_t ldb = (uint32_t)p.ldt * (uint32_t)sizeof(T);  // bytes between rows of the copy
        const uint32_t g_dst = (uint32_t)(DXW_ABYTES + (gq >> 3) * DXW_GBLOCK);  // + slot, row, chunk
        const int nsl_cta = (NSL == 2 && slot1 == 1) ? 2 : 1;
        // the raw A of each k-tile, copied into the stage for the consumers to decompress:
        // values of storage rows ar + 16 i (i < 4), 16-byte piece uc (columns c0 + 16 uc ..);
        // meta piece mq of tile row mr (threads < 64: 4 column tiles x 16 words = 16 pieces
        // per tile row); running pointers (k-tiles in order)
        const int uc = ptid & 7, ar = ptid >> 3, mq = ptid & 15, mr = (ptid >> 4) & 3;
        const int64_t mtiles = p.cp / 32;
        const char *vptr = reinterpret_cast<const char *>(static_cast<const T *>(p.values) +
                                                          ((int64_t)e * p.rp + ar) * (p.cp / 2) + c0 / 2 + 8 * uc);
        const uint32_t vrow16 = (uint32_t)(16 * (p.cp / 2) * sizeof(T));  // bytes between rows ar + 16 i
        const int64_t vktile = 4 * (int64_t)vrow16;
        const uint32_t *mptr = p.meta + ((int64_t)e * (p.rp / 16) * mtiles + mr * mtiles + c0 / 32) * 16 + 4 * mq;
        const int64_t mktile = 4 * mtiles * 16;
        const uint32_t v_dst = (uint32_t)(C::V_OFF + ar * 128 + ((uc ^ (ar & 7)) << 4)), m_dst = (uint32_t)(C::M_OFF + mr * 256 + mq * 16);
        // the idx of storage rows 16 gn .. per slot, RR - 1 k-tiles ahead, one cp.async group
        // per k-tile (empty past the last: the count of pending groups stays uniform)
        const uint8_t *iptr[NSL];
        bool iok[NSL];
#pragma unroll
        for (int s = 0; s < NSL; s++) {
            iok[s] = M > 1 && s < nsl_cta && j0 + s < p.slices;
            iptr[s] = iok[s] ? p.idx + ((int64_t)e * p.slices + j0 + s) * p.rp + 16 * gn
                             : reinterpret_cast<const uint8_t *>(p.meta);  // (nothing is read)
        }
        const uint32_t idx0 = sbase + C::IDX_OFF + 16u * ptid;
        auto idx_at = [&](int k, int s) { return idx0 + (uint32_t)(((k & (DXW_RR - 1)) * NSL + s) * (128 * 16)); };
        auto issue_idx = [&](int k) {
            if (M > 1 && k < KT) {
#pragma unroll
                for (int s = 0; s < NSL; s++) {
                    cp_async8(idx_at(k, s), iptr[s], iok[s]);
                    cp_async8(idx_at(k, s) + 8, iptr[s] + (iok[s] ? 8 : 0), iok[s]);
                    if (iok[s]) iptr[s] += DXW_BK;
                }
            }
            cp_async_commit();
        };
#pragma unroll
        for (int k = 0; k < DXW_RR - 1; k++) issue_idx(k);
        for (int kt = 0; kt < KT; kt++) {
            const int st = kt % ST;
            // k-tile kt's idx has landed when at most the RR - 2 groups after it are pending
            cp_async_wait<DXW_RR - 2>();
            if (kt >= ST) mbar_wait(empty_bar(st), ((kt / ST) - 1) & 1);
            const uint32_t stage = sbase + (uint32_t)st * C::STAGE;
            // G: the kept row of every storage row of the k-tile, per slot (its slice): storage
            // row 16 gn + i holds dyt row base + i M + sel (GLU: a k-tile lies in one 64-row chunk
            // of one half), valid below the half's rows
            int64_t uh = 0, uq0 = (int64_t)kt * DXW_BK + 16 * gn;
            if (p.glu) {
                uh = kt & 1;
                uq0 = (int64_t)(kt >> 1) * DXW_BK + 16 * gn;
            }
            const int64_t lim64 = p.half_rows - uq0 * M;  // i M + sel below this
            const int lim = tok_ok ? (int)max((int64_t)0, min(lim64, (int64_t)(16 * M))) : 0;
            // (no row valid: any valid address, nothing is read)
            const char *gb = lim > 0 ? reinterpret_cast<const char *>(dyt + (uh * p.half_rows + uq0 * M) * p.ldt + tcol)
                                     : reinterpret_cast<const char *>(dyt);
            const uint32_t gdst = stage + g_dst + (uint32_t)(16 * gn) * 128;
#pragma unroll
            for (int s = 0; s < NSL; s++) {
                if (s >= nsl_cta) continue;
                uint32_t iw[4] = {0u, 0u, 0u, 0u};
                if (M > 1) {
                    const uint4 v = lds_v4(idx_at(kt, s));
                    iw[0] = v.x;
                    iw[1] = v.y;
                    iw[2] = v.z;
                    iw[3] = v.w;
                }
                const uint32_t slim = (M == 1 || j0 + s < p.slices) ? (uint32_t)lim : 0u;
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const uint32_t o = i * M + (M > 1 ? (iw[i >> 2] >> (8 * (i & 3))) & (M - 1) : 0u);
                    const bool ok = o < slim;  // o ldb < 64 x 2^26 (the launcher's bound on ldt)
                    // (o >= slim: the address is never read, src-size 0)
                    cp_async16(gdst + s * DXW_GBYTES + i * 128 + (((gq & 7) ^ (i & 7)) << 4), gb + (uint64_t)o * ldb, ok);
                }
            }
            // the raw A
#pragma unroll
            for (int i = 0; i < 4; i++) cp_async16(stage + v_dst + i * 16 * 128, vptr + i * vrow16, true);
            if (ptid < 64) cp_async16(stage + m_dst, mptr, true);
            vptr += vktile;
            mptr += mktile;
            cp_async_mbar_arrive(full_bar(st));
            // the idx RR - 1 k-tiles ahead (its slot was last read in k-tile kt - 1, in program
            // order); this k-tile's copies above join its group
            issue_idx(kt + DXW_RR - 1);
        }
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }

    // ================= consumers =================
    const int wg = (tid >> 7) - 1;  // 0, 1: columns c0 + 64 wg ..
    const int ct = tid - 128, warp = (tid & 127) >> 5, lane = tid & 31;  // (ct: 0 .. 255)
    const int slot = wg == 0 ? 0 : slot1;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    fence_regs(acc);  // the zeros are written before the first wgmma.fence
    // this thread's share of its warpgroup's A block (64 storage rows x its 64 columns): units
    // u = wt + 128 j (j < 2) of 16 columns, storage row u / 4, column unit 4 wg + u % 4; its meta
    // word (tile row r / 16, column tile uc / 2, word 2 (r % 8) + uc % 2, half (r % 16) / 8)
    const int wt = tid & 127;
    const uint32_t lut = smem_u32(s_lut);
    uint32_t a_src[2], a_msrc[2], a_d0[2], a_d1[2], a_sh[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int u = wt + 128 * j, r = u >> 2, ul = u & 3, ucol = 4 * wg + ul;
        a_src[j] = (uint32_t)(C::V_OFF + r * 128 + ((ucol ^ (r & 7)) << 4));  // (16-byte pieces swizzled by row)
        a_msrc[j] = (uint32_t)(C::M_OFF + ((r / 16) * 4 + ucol / 2) * 64 + (2 * (r % 8) + (ucol & 1)) * 4);
        a_sh[j] = (uint32_t)(16 * ((r % 16) / 8));
        a_d0[j] = (uint32_t)(wg * DXW_ABLOCK + r * 128 + (((2 * ul) ^ (r & 7)) << 4));
        a_d1[j] = (uint32_t)(wg * DXW_ABLOCK + r * 128 + (((2 * ul + 1) ^ (r & 7)) << 4));
    }
    // k-tile k's A block from its raw values and meta (waits for the stage's full barrier):
    // 16 dense columns from 8 kept values and 16 meta bits (one table lookup per 4-column
    // group: both selectors), byte permutes, two 16-byte stores per unit; then every thread
    // fences (A by st.shared, G by cp.async: the generic proxy; wgmma reads through the async
    // one) and the warpgroup meets
    auto make_a = [&](int k) {
        const int st = k % ST;
        mbar_wait(full_bar(st), (k / ST) & 1);
        const uint32_t stage = sbase + (uint32_t)st * C::STAGE;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const uint4 v = lds_v4(stage + a_src[j]);
            const uint32_t bm = lds_u32(stage + a_msrc[j]) >> a_sh[j];
            const uint32_t pv[4] = {v.x, v.y, v.z, v.w};
            uint32_t w[8];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint2 sel = lds_v2(lut + 8u * ((bm >> (4 * q)) & 0xfu));
                w[2 * q] = prmt(pv[q], 0u, sel.x);
                w[2 * q + 1] = prmt(pv[q], 0u, sel.y);
            }
            sts_v4(stage + a_d0[j], w[0], w[1], w[2], w[3]);
            sts_v4(stage + a_d1[j], w[4], w[5], w[6], w[7]);
        }
        fence_proxy_async();
        named_barrier_sync(2 + wg, 128);
    };
    auto mma_k = [&](int k) {
        const uint32_t stage = sbase + (uint32_t)(k % ST) * C::STAGE;
        const uint32_t a0 = stage + wg * DXW_ABLOCK, b0 = stage + C::G_OFF + slot * DXW_GBYTES;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < DXW_BK / 16; ks++)
            WgmmaDenseMN256<T>::run(acc, smem_desc_mn_sw128(a0 + ks * 2048, DXW_ABLOCK),
                                    smem_desc_mn_sw128(b0 + ks * 2048, DXW_GBLOCK), 1);
        wgmma_commit();
    };
    // A(kt) is made while the wgmmas of kt - 1 run.  (Made a k-tile ahead instead, waiting for
    // the full barrier of kt + 1 before releasing kt - 1, it ran 1.4x slower: the producer's
    // copies for kt + 1 then start only one k-tile ahead of their use; docs/KERNELS.md.)
    for (int kt = 0; kt < KT; kt++) {
        make_a(kt);
        mma_k(kt);
        wgmma_wait<1>();
        fence_regs(acc);
        // the wgmmas of k-tile kt - 1 are done: release its stage
        if (kt > 0) mbar_arrive(empty_bar((kt - 1) % ST));
    }
    wgmma_drain(acc);
    // both consumers are past their last wgmma, the producer has nothing in flight (every
    // stage it filled was waited for): the ring becomes the staging area
    named_barrier_sync(1, 256);

    // ---- epilogue: D^T fragment * scale -> staging [row][column], one rounding -> out
    // fragment: acc[4 j + 2 h + k] = D^T[16 warp + g + 8 h][8 j + 2 q + k]
    const int g = lane >> 2, q = lane & 3;
    const int col = 64 * wg + 16 * warp + g;  // + 8 h
#pragma unroll
    for (int j = 0; j < DXW_BM / 8; j++)
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int n = 8 * j + 2 * q + k;
            const float sc = (p.scale && n < nrow) ? __ldg(p.scale + s_begin + n) : 1.0f;
            T *row = reinterpret_cast<T *>(smem + n * DXW_STG_ROW);
#pragma unroll
            for (int h = 0; h < 2; h++) row[col + 8 * h] = Elem<T>::from_f(acc[4 * j + 2 * h + k] * sc);
        }
    named_barrier_sync(1, 256);
    T *out = static_cast<T *>(p.out);
#pragma unroll 4
    for (int i = ct; i < DXW_BM * (DXW_BC / 8); i += 256) {
        const int n = i >> 4, ch = i & 15;
        const int64_t c = c0 + 8 * ch;
        if (n < nrow && c < p.C)
            st_global_v4(out + (s_begin + n) * p.ldo + c,
                         *reinterpret_cast<const uint4 *>(smem + n * DXW_STG_ROW + 16 * ch));
    }
#else
    (void)p;
    __trap();
#endif
}

template <typename T, int M, int NSL> sam_status launch(const DxArgs &a, int64_t grid, cudaStream_t stream) {
    using C = DxwCfg<NSL>;
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_dx_wgmma_kernel<T, M, NSL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      C::SMEM),
                 "ssmm_dx");
    ssmm_dx_wgmma_kernel<T, M, NSL><<<(unsigned)grid, DXW_THREADS, C::SMEM, stream>>>(a);
    return launch_status("ssmm_dx");
}

template <typename T> sam_status launch_m(const DxArgs &a, int m, bool two, int64_t grid, cudaStream_t s) {
    switch (m) {
    case 1: return launch<T, 1, 1>(a, grid, s);
    case 2: return two ? launch<T, 2, 2>(a, grid, s) : launch<T, 2, 1>(a, grid, s);
    default: return two ? launch<T, 4, 2>(a, grid, s) : launch<T, 4, 1>(a, grid, s);
    }
}

// dy's transposed copy (unscaled, by token id: ssmm_dyt.cuh) in stream-ordered memory, the
// kernel from it, the copy freed on the stream; *ran false where the memory cannot be had.
template <typename T>
sam_status launch_t(DxArgs a, int m, bool two, int64_t grid, cudaStream_t s, bool *ran) {
    const int64_t R = a.glu ? 2 * a.half_rows : a.half_rows;
    const DytSrc src{a.dy, a.lddy, a.token_ids, a.T, nullptr, a.offsets, a.S, a.E};
    sam_status st;
    T *buf = dyt_make<T>(src, R, s, &st);
    *ran = buf != nullptr;
    if (buf == nullptr) return SAM_STATUS_OK;
    a.dyt = buf;
    a.ldt = dyt_cols(a.S, a.E);
    if (st == SAM_STATUS_OK) st = launch_m<T>(a, m, two, grid, s);
    cudaFreeAsync(buf, s);
    return st;
}

}  // namespace

bool ssmm_dx_wgmma_available() { return device_runs_sm90a(); }

sam_status ssmm_dx_wgmma_launch(const DxArgs &in, sam_dtype dtype, int m, cudaStream_t stream, bool *ran) {
    DxArgs a = in;
    a.ncb = (int)ceil_div(a.cp, DXW_BC);  // cp % 128 == 0: whole blocks
    // every row tile S rows can make (ceil(S / BM) + E: one partial tile per expert at most),
    // per column block; the rest of the CTAs zero the rows no expert owns
    const int64_t grid = (ceil_div(a.S, DXW_BM) + a.E) * a.ncb;
    *ran = false;
    // the producer's 32-bit row offsets into the copy: 64 rows x 2 bytes x its columns < 2^32
    if (dyt_cols(a.S, a.E) >= ((int64_t)1 << 25)) return SAM_STATUS_OK;
    if (grid > INT32_MAX) {
        set_error("ssmm_dx: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    // two G tiles per stage where a CTA's two 64-column halves can lie in different slices
    const bool two = m > 1 && a.v % 128 != 0;
    if (dtype == SAM_BF16) return launch_t<__nv_bfloat16>(a, m, two, grid, stream, ran);
    return launch_t<__half>(a, m, two, grid, stream, ran);
}

}  // namespace sam
