// ssmm_dw.cu -- the weight gradient of an ssmm in the packed layout (sam_ssmm_dw_cuda):
// the launcher (checks, then dw_choose_kernel of ssmm_dw.cuh: the wgmma kernel of
// ssmm_dw_wgmma.cu on sm_90a, else the mma.sync kernel below) and the mma.sync kernel,
// an SDDMM that computes only the kept entries.  For every expert e, storage row p and
// packed column j (the k-th kept value of the 4-column group c4) -- csrc/ssmm_ref.c,
// sam_ssmm_dw_ref, is the definition:
//     out[e][p][j] = sum over sorted rows s of e of dy[s][r] * scale[s] * x[tok(s)][col]
// with r the original row storage row p holds in slice c4 / V (idx, GLU interleave),
// col = c4 + the k-th kept position of the group (meta).  Dense dW is never formed.
//
// Work: one CTA per (expert, 128 storage rows, 256 columns), so the grid is known on the
// host (E x row blocks x column blocks) and every entry of out is written by exactly one
// CTA, experts without rows included (zeros).  The K loop runs over the expert's sorted
// rows, found from offsets on the device (no host sync); no split over K, no atomics:
// each entry is one fp32 sum in a fixed order, bit-identical run to run.
//
// The product is D[p][c] = sum_k A[p][k] B[k][c] (M = storage rows, N = columns, K =
// tokens) on mma.sync m16n8k16 (fp32 accumulation).  Both operands arrive K-major along
// the tokens, so both are read by ldmatrix.trans:
//   B = x rows [BK tokens][256 columns], gathered by token id, by a cp.async ring
//       (DW_ST stages, 16-byte chunks XOR-swizzled by token);
//   A = dy^T [64 storage rows][BK tokens] per 64-row block and column slice.  The row a
//       storage row holds depends on the slice (1:M:V row selection), and the rows of a
//       block lie in a window of 64 M consecutive original rows of dy (GLU: of one half).
//       Each thread loads its 16 M-byte pieces of the window straight into registers
//       (two k-tiles ahead), picks the selected element of every M candidates with byte
//       permutes (selectors from idx, once per CTA), applies the routing scale if any
//       (one rounding of the scaled operand, as a bf16 autograd does), and stores the
//       gathered A tile for each distinct slice of the CTA's columns (up to 4 at V = 64)
//       in a double buffer.  Plain 2:4 and GLU 2:4 without a scale need no gather: their
//       A tile is the window itself, brought by cp.async in the ring ("direct").
// 8 warps as 2 (64-row blocks) x 4 (64 columns, one slice each since V % 64 == 0); a
// warp's 64 x 64 tile is 4 x 8 mma tiles, 128 fp32 accumulators per thread.
//
// Epilogue: the two lanes holding a 4-column group of a row swap halves (shfl), the
// lane that then holds the whole group picks its two kept columns from the meta nibble,
// rounds once and packs them; a warp stages its 64 x 32 packed values in shared memory
// and writes whole 16-byte pieces.  Padding rows (q >= rc) and columns (>= C) are 0.
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "ptx_mma.cuh"
#include "ssmm_dw.cuh"

namespace sam {
namespace {

constexpr int DW_BM = 128;                 // storage rows per CTA (two 64-row blocks)
constexpr int DW_BN = 256;                 // dense columns per CTA
constexpr int DW_BK = 32;                  // tokens per k-tile
constexpr int DW_THREADS = 256;            // 8 warps: 2 (row blocks) x 4 (64 columns)
constexpr int DW_ST = 4;                   // cp.async ring depth
constexpr int DW_XROW = DW_BN * 2;         // bytes of one token row of the x tile
constexpr int DW_XBYTES = DW_BK * DW_XROW; // x tile of a stage
constexpr int DW_AROW = 128;               // bytes of one token row of an A block (64 rows)
constexpr int DW_ABLOCK = DW_BK * DW_AROW; // one 64-row block of A
constexpr int DW_ATILE = 2 * DW_ABLOCK;    // the CTA's A for one slice
constexpr int DW_MAX_SLOTS = DW_BN / 64;   // distinct slices in a CTA's columns (V >= 64)
constexpr int DW_STG_WORDS = 20;           // epilogue staging: row stride in 32-bit words
constexpr int DW_STG_BYTES = 64 * DW_STG_WORDS * 4;  // one warp's staging area

// The kernel.  M: rows per group (1, 2, 4).  DIRECT (M == 1, no scale, 16-byte dy pieces):
// the A blocks come by cp.async in the ring; else through registers (gather, scale).
template <typename T, int M, bool DIRECT>
__global__ void __launch_bounds__(DW_THREADS, 1) ssmm_dw_kernel(const DwArgs p) {
    constexpr int STAGE = DIRECT ? DW_XBYTES + DW_ATILE : DW_XBYTES;
    static_assert(!DIRECT || M == 1, "direct A blocks need M == 1");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t raw_addr = smem_u32(smem_raw);
    unsigned char *smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    const uint32_t sbase = smem_u32(smem);
    const uint32_t abase = sbase + DW_ST * STAGE;  // A double buffer (not DIRECT)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int g = lane >> 2, q4 = lane & 3;

    // ---- the work item: (expert, row block, column block); column blocks fastest
    int64_t item = blockIdx.x;
    const int cb = (int)(item % p.ncb);
    item /= p.ncb;
    const int rb = (int)(item % p.nrb);
    const int e = (int)(item / p.nrb);
    const int64_t row0 = (int64_t)rb * DW_BM, c0 = (int64_t)cb * DW_BN;
    const int64_t s_begin = max(0, p.offsets[e]);
    const int64_t s_end = min((int64_t)p.offsets[e + 1], p.S);
    const int n_e = (int)max((int64_t)0, s_end - s_begin);
    const int KT = (n_e + DW_BK - 1) / DW_BK;

    // a 64-row block b: its storage rows row0 + 64 b ..; (half, first condensed row)
    auto block_q0 = [&](int b, int &h, int64_t &q0) {
        const int64_t pb = row0 + 64 * b;
        if (p.glu) {
            const int64_t chunk = pb / 64;
            h = (int)(chunk & 1);
            q0 = (chunk >> 1) * 64;
        } else {
            h = 0;
            q0 = pb;
        }
    };

    // ---- slices: the columns of warp column wn lie in slice (c0 + 64 wn) / V; slot =
    // that slice minus the CTA's first slice (one A tile per slot)
    const int last_group = (int)min((int64_t)(DW_MAX_SLOTS - 1), (p.C - 1 - c0) / 64);
    int64_t j0 = 0;
    int nslot_cta = 1, slot_w = 0;
    if (M > 1) {
        j0 = c0 / p.v;
        nslot_cta = (int)((c0 + 64 * last_group) / p.v - j0) + 1;
        slot_w = wn <= last_group ? (int)((c0 + 64 * wn) / p.v - j0) : 0;
    }

    // ---- the A pieces this thread brings: block ub, 8-row chunk P8, tokens kr, kr + 16
    const int P8 = tid & 7, ub = (tid >> 3) & 1, kr = tid >> 4;
    int uh;
    int64_t uq0;
    block_q0(ub, uh, uq0);
    const bool ub_live = row0 + 64 * ub < p.rp;
    const int64_t u_local = uq0 * M + 8 * M * P8;                  // first candidate row in the half
    const int64_t u_base = (int64_t)uh * p.half_rows + u_local;    // ... in dy's columns
    unsigned u_rowok = 0;  // 16-byte pieces c < M of the window that lie inside the half
#pragma unroll
    for (int c = 0; c < M; c++) u_rowok |= (unsigned)(ub_live && u_local + 8 * c < p.half_rows) << c;
    const T *dy = static_cast<const T *>(p.dy);
    const uint32_t a_dst = ub * DW_ABLOCK + kr * DW_AROW + ((P8 ^ (kr & 7)) << 4);  // + 16 rows: + 16 DW_AROW

    // selectors of each slot (M > 1), kept in shared memory (registers are short): this
    // thread's own words, read back by this thread only
    uint2 *sel_s = reinterpret_cast<uint2 *>(smem + DW_ST * STAGE + 2 * DW_MAX_SLOTS * DW_ATILE) + tid;
    if (M > 1) {
#pragma unroll
        for (int s = 0; s < DW_MAX_SLOTS; s++) {
            uint32_t sl[2] = {0u, 0u};
            if (s < nslot_cta && ub_live) {
                const uint8_t *ip = p.idx + ((int64_t)e * p.slices + j0 + s) * p.rp + row0 + 64 * ub + 8 * P8;
                make_selectors<M>(*reinterpret_cast<const uint2 *>(ip), sl);
            }
            sel_s[s * DW_THREADS] = make_uint2(sl[0], sl[1]);
        }
    }

    // ---- the x pieces this thread brings: chunk xc (8 columns) of token rows xr + 8 i
    const int xc = tid & 31, xr = tid >> 5;
    const bool x_colok = c0 + 8 * xc < p.C;
    const T *x = static_cast<const T *>(p.x);
    const uint32_t x_dst = xr * DW_XROW + ((xc ^ xr) << 4);  // + 8 rows: + 8 DW_XROW

    // token of row k of k-tile kt (-1: none)
    auto token_of = [&](int kt, int k) -> int {
        const int kk = kt * DW_BK + k;
        if (kk >= n_e) return -1;
        const int64_t s = s_begin + kk;
        const int64_t t = p.token_ids ? (int64_t)p.token_ids[s] : s;
        return (t >= 0 && t < p.T) ? (int)t : -1;
    };
    auto load_tokens = [&](int kt, int (&tk)[4]) {
#pragma unroll
        for (int i = 0; i < 4; i++) tk[i] = token_of(kt, xr + 8 * i);
    };
    auto issue_stage = [&](int kt, const int (&tk)[4]) {
        const uint32_t st = sbase + (uint32_t)(kt % DW_ST) * STAGE;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool ok = x_colok && tk[i] >= 0;
            const T *src = ok ? x + (int64_t)tk[i] * p.ldx + c0 + 8 * xc : x;
            cp_async16(st + x_dst + i * 8 * DW_XROW, src, ok);
        }
        if (DIRECT) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int kk = kt * DW_BK + kr + 16 * u;
                const int64_t row = kk < n_e ? dw_dy_row(p, s_begin + kk) : -1;
                const bool ok = row >= 0 && (u_rowok & 1u);
                const T *src = ok ? dy + row * p.lddy + u_base : dy;
                cp_async16(st + DW_XBYTES + a_dst + u * 16 * DW_AROW, src, ok);
            }
        }
    };

    // ---- A through registers (not DIRECT): raw candidates of k-tile kt, then the gather
    uint4 raw[2][M];
    float rsc[2];
    auto load_dy = [&](int kt) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int kk = kt * DW_BK + kr + 16 * u;
            const int64_t s = s_begin + kk;
            const int64_t row = kk < n_e ? dw_dy_row(p, s) : -1;
            const bool tv = row >= 0;
            rsc[u] = p.scale ? (tv ? __ldg(p.scale + s) : 0.0f) : 1.0f;
            load_candidates<T, M>(raw[u], dy + (tv ? row : 0) * p.lddy, u_base, u_local, p.half_rows, u_rowok, tv,
                                  ub_live, p.dy_vec);
        }
    };
    auto prep = [&](int buf) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            uint32_t w[4 * M];
#pragma unroll
            for (int c = 0; c < M; c++) {
                w[4 * c] = raw[u][c].x;
                w[4 * c + 1] = raw[u][c].y;
                w[4 * c + 2] = raw[u][c].z;
                w[4 * c + 3] = raw[u][c].w;
            }
#pragma unroll
            for (int s = 0; s < DW_MAX_SLOTS; s++) {
                if (s < (M > 1 ? nslot_cta : 1)) {
                    uint32_t sl[2] = {0u, 0u};
                    if (M > 1) {
                        const uint2 sv = sel_s[s * DW_THREADS];
                        sl[0] = sv.x;
                        sl[1] = sv.y;
                    }
                    uint32_t o[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        o[k] = gather_word<M>(w, sl, k);
                        if (p.scale) o[k] = scale2<T>(o[k], rsc[u]);
                    }
                    const uint32_t dst = abase + (uint32_t)(buf * p.nslot + s) * DW_ATILE + a_dst + u * 16 * DW_AROW;
                    sts_v4(dst, o[0], o[1], o[2], o[3]);
                }
            }
        }
    };

    // ---- accumulators and the mma of one k-tile
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;
    const bool warp_live = row0 + 64 * wm < p.rp && c0 + 64 * wn < p.C;
    const int mi = lane >> 3, l7 = lane & 7;
    auto mma_tile = [&](int kt) {
        const uint32_t xs = sbase + (uint32_t)(kt % DW_ST) * STAGE;
        const uint32_t as = (DIRECT ? xs + DW_XBYTES : abase + (uint32_t)((kt & 1) * p.nslot + slot_w) * DW_ATILE) +
                            wm * DW_ABLOCK;
#pragma unroll
        for (int ks = 0; ks < DW_BK / 16; ks++) {
            uint32_t af[4][4], bfr[8][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int tok = 16 * ks + 8 * (mi >> 1) + l7;
                const int ch = 2 * i + (mi & 1);
                ldsm_x4_trans(as + tok * DW_AROW + ((ch ^ l7) << 4), af[i][0], af[i][1], af[i][2], af[i][3]);
            }
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int tok = 16 * ks + 8 * (mi & 1) + l7;
                const int ch = 8 * wn + 2 * jj + (mi >> 1);
                ldsm_x4_trans(xs + tok * DW_XROW + ((ch ^ l7) << 4), bfr[2 * jj][0], bfr[2 * jj][1], bfr[2 * jj + 1][0],
                              bfr[2 * jj + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    Mma16816<T>::run(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j][0], bfr[j][1]);
        }
    };

    // ---- main loop: x (and DIRECT A) by a DW_ST-deep cp.async ring; A through registers
    // (loaded two k-tiles ahead, gathered one ahead) into a double buffer; one barrier per
    // k-tile.  Iteration kt: mma(kt) reads A buffer kt & 1, prep(kt + 1) writes the other one,
    // last read by mma(kt - 1) before the barrier that ended iteration kt - 1.
    if (KT > 0) {
        {
            int tk[DW_ST - 1][4];
#pragma unroll
            for (int st = 0; st < DW_ST - 1; st++) load_tokens(st, tk[st]);
#pragma unroll
            for (int st = 0; st < DW_ST - 1; st++) {
                if (st < KT) issue_stage(st, tk[st]);
                cp_async_commit();
            }
        }
        int tk_next[4];
        load_tokens(DW_ST - 1, tk_next);
        if (!DIRECT) {
            load_dy(0);
            prep(0);
            if (KT > 1) load_dy(1);
        }
        cp_async_wait<DW_ST - 2>();
        __syncthreads();
        for (int kt = 0; kt < KT; kt++) {
            // refill the slot mma(kt - 1) read (every warp is past it: the barrier below)
            if (kt + DW_ST - 1 < KT) issue_stage(kt + DW_ST - 1, tk_next);
            cp_async_commit();
            if (kt + DW_ST < KT) load_tokens(kt + DW_ST, tk_next);
            if (warp_live) mma_tile(kt);
            // the next k-tile's A after the mma in program order: its permutes and stores issue
            // while the tensor cores still work through the mma queue
            if (!DIRECT && kt + 1 < KT) {
                prep((kt + 1) & 1);
                if (kt + 2 < KT) load_dy(kt + 2);
            }
            cp_async_wait<DW_ST - 2>();
            __syncthreads();
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: pick the kept columns, round once, stage per warp, 16-byte stores
    if (!(row0 + 64 * wm < p.rp && c0 + 64 * wn < p.cp)) return;
    int wh;
    int64_t wq0;
    block_q0(wm, wh, wq0);
    const int odd = q4 & 1, hq = q4 >> 1;
    const int64_t pw = row0 + 64 * wm, cw = c0 + 64 * wn;
    const int64_t mtiles = p.cp / 32;
    const uint32_t *meta = p.meta + (int64_t)e * (p.rp / 16) * mtiles * 16;
    uint32_t *stg = reinterpret_cast<uint32_t *>(smem + warp * DW_STG_BYTES);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int lr = 16 * i + g + 8 * odd;  // the row this lane finishes
        const bool row_live = wq0 + lr < p.rc;
        const uint32_t *mrow = meta + ((pw + 16 * i) / 16 * mtiles + cw / 32) * 16 + 2 * g;
#pragma unroll
        for (int jw = 0; jw < 4; jw++) {
            const uint32_t mword = n_e > 0 ? __ldg(mrow + (jw >> 1) * 16 + (jw & 1)) : 0u;
#pragma unroll
            for (int jl = 0; jl < 2; jl++) {
                const int j = 2 * jw + jl;
                const float s0 = odd ? acc[i][j][0] : acc[i][j][2];
                const float s1 = odd ? acc[i][j][1] : acc[i][j][3];
                const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
                const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
                const float v0 = odd ? r0 : acc[i][j][0], v1 = odd ? r1 : acc[i][j][1];
                const float v2 = odd ? acc[i][j][2] : r0, v3 = odd ? acc[i][j][3] : r1;
                const uint32_t nib = (mword >> (16 * odd + 4 * (2 * jl + hq))) & 0xfu;
                const float o0 = pick4(v0, v1, v2, v3, nib & 3u), o1 = pick4(v0, v1, v2, v3, (nib >> 2) & 3u);
                const bool ok = row_live && cw + 8 * j + 4 * hq < p.C;
                stg[lr * DW_STG_WORDS + 2 * j + hq] = ok ? Elem<T>::pack2(o0, o1) : 0u;
            }
        }
    }
    __syncwarp();
    T *out = static_cast<T *>(p.out) + ((int64_t)e * p.rp + pw) * (p.cp / 2) + cw / 2;
#pragma unroll
    for (int it = 0; it < 8; it++) {
        const int r = (lane >> 2) + 8 * it, ch = lane & 3;
        const uint4 v = *reinterpret_cast<const uint4 *>(stg + r * DW_STG_WORDS + ch * 4);
        st_global_v4(out + (int64_t)r * (p.cp / 2) + ch * 8, v);
    }
}

template <typename T, int M, bool DIRECT> sam_status launch(const DwArgs &a, int64_t grid, cudaStream_t stream) {
    constexpr int STAGE = DIRECT ? DW_XBYTES + DW_ATILE : DW_XBYTES;
    // ring, A double buffer, selectors (M > 1)
    const int smem_pipe = DW_ST * STAGE + (DIRECT ? 0 : M > 1 ? 2 * DW_MAX_SLOTS * DW_ATILE + DW_MAX_SLOTS * DW_THREADS * 8
                                                              : 2 * a.nslot * DW_ATILE);
    const int smem = std::max(smem_pipe, 8 * DW_STG_BYTES) + 1024;
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_dw_kernel<T, M, DIRECT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                 "ssmm_dw");
    ssmm_dw_kernel<T, M, DIRECT><<<(unsigned)grid, DW_THREADS, smem, stream>>>(a);
    return launch_status("ssmm_dw");
}

template <typename T> sam_status launch_dtype(const DwArgs &a, int m, bool direct, int64_t grid, cudaStream_t s) {
    switch (m) {
    case 1: return direct ? launch<T, 1, true>(a, grid, s) : launch<T, 1, false>(a, grid, s);
    case 2: return launch<T, 2, false>(a, grid, s);
    default: return launch<T, 4, false>(a, grid, s);
    }
}


}  // namespace
}  // namespace sam

extern "C" sam_status sam_ssmm_dw_cuda(const sam_ssmm_dw_params *ps, void *stream) {
    using namespace sam;
    const sam_format f = ps->f;
    const sam_dims &d = ps->d;
    if (f.n != 1) {
        set_error("ssmm_dw: the GPU kernel needs n = 1 (formats 2:4, 1:2:V, 1:4:V); got %d:%d:%d", f.n, f.m, f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m != 1 && f.m != 2 && f.m != 4) {
        set_error("ssmm_dw: the GPU kernel supports formats 2:4, 1:2:V and 1:4:V; got %d:%d:%d", f.n, f.m, f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && (f.v <= 0 || f.v % 64 != 0)) {
        set_error("ssmm_dw: the GPU kernel needs a slice length v that is a multiple of 64; got %d", f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (d.C % 8 != 0) {
        set_error("ssmm_dw: the GPU kernel needs the column count to be a multiple of 8 (16-byte rows); got %lld",
                  (long long)d.C);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (!tc_dtype_ok(ps->dtype, "ssmm_dw")) return SAM_STATUS_UNSUPPORTED;
    if (ps->ldx % 8 != 0 || (reinterpret_cast<uintptr_t>(ps->x) & 15) != 0 ||
        (reinterpret_cast<uintptr_t>(ps->out) & 15) != 0) {
        set_error("ssmm_dw: the GPU kernel needs x and out 16-byte aligned and x's row stride a multiple of 8 "
                  "(got %lld)", (long long)ps->ldx);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && ps->idx == nullptr) {
        set_error("ssmm_dw: format 1:%d:%d needs idx", f.m, f.v);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (d.E == 0 || d.rp == 0 || d.cp == 0) return SAM_STATUS_OK;

    DwArgs a{};
    a.dy = ps->dy;
    a.lddy = ps->lddy;
    a.S = ps->S;
    a.dy_ids = ps->dy_ids;
    a.Tdy = ps->Tdy;
    a.dyt = ps->dy_t;  // (null: the wgmma launcher makes the copy where it takes one)
    a.ldt = ps->dy_t != nullptr ? sam_dyt_cols(ps->S, d.E) : 0;
    a.x = ps->x;
    a.T = ps->T;
    a.ldx = ps->ldx;
    a.meta = ps->meta;
    a.idx = ps->idx;
    a.offsets = ps->offsets;
    a.token_ids = ps->token_ids;
    a.scale = ps->scale;
    a.out = ps->out;
    a.C = d.C;
    a.cp = d.cp;
    a.rp = d.rp;
    a.rc = d.rc;
    a.half_rows = d.half_rows;
    a.slices = d.slices;
    a.E = (int)d.E;
    a.glu = f.glu;
    a.v = f.m > 1 ? f.v : 0;
    a.nrb = (int)ceil_div(d.rp, DW_BM);
    a.ncb = (int)ceil_div(d.cp, DW_BN);
    // A tiles per buffer: the most distinct slices the 64-column groups (inside C) of a
    // column block touch
    a.nslot = 1;
    if (f.m > 1 && d.C > 0) {
        for (int64_t c0 = 0; c0 < d.C; c0 += DW_BN) {
            const int64_t last = std::min<int64_t>(c0 + 64 * (DW_MAX_SLOTS - 1), (d.C - 1) / 64 * 64);
            a.nslot = std::max(a.nslot, (int)(last / f.v - c0 / f.v) + 1);
        }
    }
    a.dy_vec = d.half_rows % 8 == 0 && ps->lddy % 8 == 0 && (reinterpret_cast<uintptr_t>(ps->dy) & 15) == 0;
    const int64_t grid = (int64_t)a.E * a.nrb * a.ncb;
    if (grid > INT32_MAX) {
        set_error("ssmm_dw: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    cudaStream_t s = (cudaStream_t)stream;
    // the one place that picks the kernel (dw_choose_kernel, ssmm_dw.cuh)
    if (ps->impl >= 2 && !ssmm_dw_wgmma_available()) {
        set_error("ssmm_dw: impl %d (the wgmma kernel) needs the sm_90a build on an sm_90 device", ps->impl);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (ps->dy_t != nullptr && (ps->impl == 1 || ps->impl == 2 || !ssmm_dw_wgmma_available())) {
        set_error("ssmm_dw: dy_t is read by the wgmma kernel's copy producer only (impl 0 or 3, the sm_90a build "
                  "on an sm_90 device)");
        return SAM_STATUS_UNSUPPORTED;
    }
    const int force = ps->impl == 1 ? (int)DW_MMA : ps->impl >= 2 ? (int)DW_WGMMA : -1;
    if (dw_choose_kernel(ssmm_dw_wgmma_available(), force) == DW_WGMMA) {
        const bool copy = a.dyt != nullptr || dw_use_copy(ps->impl >= 2 ? ps->impl - 2 : -1);
        return ssmm_dw_wgmma_launch(a, ps->dtype, f.m, copy, s);
    }
    const bool direct = f.m == 1 && ps->scale == nullptr && a.dy_vec;
    if (ps->dtype == SAM_BF16) return launch_dtype<__nv_bfloat16>(a, f.m, direct, grid, s);
    return launch_dtype<__half>(a, f.m, direct, grid, s);
}
