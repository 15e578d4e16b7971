// ssmm_dx.cu -- the input gradient of an ssmm from the forward's own packing (sam_ssmm_dx_cuda):
// no transposed copy of the weight, no cache, no refresh after an optimizer step.  For every
// expert e, sorted row s of e and column c -- csrc/ssmm_ref.c, sam_ssmm_dx_ref, is the
// definition:
//     out[s][c] = scale[s] * sum over storage rows p of dy[tok(s)][orig(p, c / V)] * Wc[p][c]
// with orig(p, j) the original row storage row p holds in slice j (idx, GLU interleave) and
// Wc the storage rows decompressed to dense columns (zeros at the dropped 2:4 places).  The
// contraction runs over the kept rows only (K = Rp storage rows: R/2 at 1:2:V, R/4 at 1:4:V),
// so the tensor-core work is tokens x Rp x C, half the dense product at 1:2 -- the work of the
// transposed 2:4 path, on dense mma.sync instead of mma.sp.
//
// Work: one CTA per (expert, 128 sorted rows, 128 columns).  The row tiles per expert come
// from offsets on the device (no host sync): the grid is sized for the most tiles S rows can
// make (ceil(S / 128) + E row tiles per column block); each CTA finds its item by a prefix
// sum of the experts' tile counts, items ordered expert, column block, row tile (row tiles
// fastest: the CTAs that run together share an expert's weight columns and its dy rows in
// L2).  CTAs past the last item write the zero rows (outside [offsets[0], offsets[E])), a
// grid-stride loop over them.  No split over K, no atomics: every entry is one fp32 sum in a
// fixed order, bit-identical run to run; the scale multiplies the sum, one rounding.
//
// The product D[s][c] = sum_k A[s][k] B[k][c] (M = sorted rows, N = columns, K = storage
// rows) on mma.sync m16n8k16, per k-tile of 32 storage rows:
//   B = the packed values of the k-tile's 32 rows x 128 columns (one 16-byte piece and one
//       16-bit meta half per thread), decompressed into dense 4-column groups (byte permutes
//       from the meta nibbles) and stored [32 rows][128 columns], read by ldmatrix.trans;
//   A = dy's columns gathered per slice: the 32 storage rows of a k-tile lie in a window of
//       32 M consecutive original rows of dy (GLU: of one half), so each thread loads M
//       16-byte candidate pieces per (token row, 8 storage rows) and picks the selected
//       element of every M with byte permutes (ssmm_dw.cuh's make_selectors / gather_word,
//       the same gather ssmm_dw does), selectors from idx of the k-tile; one A tile
//       [128 rows][32 storage rows] per distinct slice of the CTA's two 64-column halves
//       (V % 64 == 0: at most 2).  A token id outside [0, T) reads as a zero row.
// Both come through registers (loaded two k-tiles ahead, stored one ahead) into a double
// buffer, one barrier per k-tile.  8 warps as 4 (32 rows) x 2 (64 columns, one slice each);
// a warp's 32 x 64 tile is 2 x 8 mma tiles, 64 fp32 accumulators per thread.
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "ptx_mma.cuh"
#include "ssmm_dw.cuh"
#include "ssmm_dx.cuh"

namespace sam {
namespace {

constexpr int DX_BM = 128;                    // sorted rows per CTA
constexpr int DX_BN = 128;                    // columns per CTA (two 64-column halves)
constexpr int DX_BK = 32;                     // storage rows per k-tile
constexpr int DX_THREADS = 256;               // 8 warps: 4 (32 rows) x 2 (64 columns)
constexpr int DX_AROW = DX_BK * 2;            // bytes of one sorted row of an A tile
constexpr int DX_ATILE = DX_BM * DX_AROW;     // one A tile (one slice)
constexpr int DX_BROW = DX_BN * 2;            // bytes of one storage row of the B tile
constexpr int DX_BTILE = DX_BK * DX_BROW;
constexpr int DX_STAGE = 2 * DX_ATILE + DX_BTILE;  // two A tiles (slots), then B
constexpr int DX_SMEM = 2 * DX_STAGE;         // double buffer: 48 KB

// The kernel.  M: rows per group (1: plain 2:4, 2, 4).
template <typename T, int M>
__global__ void __launch_bounds__(DX_THREADS, 1) ssmm_dx_kernel(const DxArgs p) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int s_warp[DX_THREADS / 32];
    __shared__ int s_item[3];  // expert (-1: none), row tile, column block
    const uint32_t sbase = smem_u32(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t item = blockIdx.x;

    // ---- the work item: expert, row tile, column block (row tiles fastest: the CTAs that run
    // together share an expert's weight columns and its dy rows in L2)
    const int64_t tiles = dx_find_item<DX_BM, DX_THREADS, true>(p, item, s_warp, s_item);
    const int e = s_item[0];
    if (e < 0) {
        const int64_t busy = (int64_t)p.ncb * tiles;
        if (item >= busy) dx_zero_rows<T, DX_BM, DX_BN, DX_THREADS>(p, item - busy, (int64_t)gridDim.x - busy);
        return;
    }
    const int rt = s_item[1], cb = s_item[2];
    const int64_t s_begin = clamp_rows(p.offsets[e], p.S) + (int64_t)rt * DX_BM;
    const int64_t s_end = min(clamp_rows(p.offsets[e + 1], p.S), s_begin + DX_BM);
    const int64_t c0 = (int64_t)cb * DX_BN;
    const int wm = warp & 3, wn = warp >> 2;

    // ---- slices: half wn's columns lie in slice (c0 + 64 wn) / V; slot = minus the first
    int64_t j0 = 0;
    int nslot = 1, slot_w = 0;
    if (M > 1) {
        j0 = c0 / p.v;
        nslot = (c0 + 64 < p.C && (c0 + 64) / p.v != j0) ? 2 : 1;
        slot_w = wn == 1 && nslot == 2 ? 1 : 0;
    }

    // ---- the A pieces this thread brings: sorted rows ar, ar + 64; 8 storage rows P8
    const int P8 = tid & 3, ar = tid >> 2;
    const T *dy = static_cast<const T *>(p.dy);
    const T *dyrow[2];
    bool dyok[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int64_t s = s_begin + ar + 64 * u;
        const int64_t t = s < s_end ? (p.token_ids ? (int64_t)p.token_ids[s] : s) : -1;
        dyok[u] = t >= 0 && t < p.T;
        dyrow[u] = dyok[u] ? dy + t * p.lddy : dy;
    }
    const uint32_t a_dst = ar * DX_AROW + ((P8 ^ ((ar >> 1) & 3)) << 4);  // + 64 rows: + 64 DX_AROW

    // ---- the B piece: storage row br of the k-tile, 16 columns c0 + 16 bc ..
    const int br = tid >> 3, bc = tid & 7;
    const T *values = static_cast<const T *>(p.values) + ((int64_t)e * p.rp + br) * (p.cp / 2) + c0 / 2 + 8 * bc;
    const int64_t mtiles = p.cp / 32;
    const uint32_t *meta = p.meta + ((int64_t)e * (p.rp / 16) * mtiles + (c0 + 16 * bc) / 32) * 16 + (bc & 1);
    const uint32_t b_dst = 2 * DX_ATILE + br * DX_BROW;

    // ---- registers of the next k-tile
    uint4 raw[2][M];
    uint2 ix[2];
    uint4 bv;
    uint32_t bm16;
    auto load_k = [&](int kt) {
        const int64_t p0 = (int64_t)kt * DX_BK;
        // B: the values and the meta half of row p0 + br
        const int64_t pb = p0 + br;
        bv = __ldg(reinterpret_cast<const uint4 *>(values + p0 * (p.cp / 2)));
        bm16 = (__ldg(meta + (pb / 16) * mtiles * 16 + 2 * (pb % 8)) >> (16 * ((pb % 16) / 8))) & 0xffffu;
        // A: the window of the k-tile's storage rows in dy's columns
        int h;
        int64_t q0;
        if (p.glu) {
            const int64_t chunk = p0 / 64;
            h = (int)(chunk & 1);
            q0 = (chunk >> 1) * 64 + (p0 & 63);
        } else {
            h = 0;
            q0 = p0;
        }
        const int64_t local = q0 * M + 8 * M * P8;
        const int64_t col = (int64_t)h * p.half_rows + local;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (p.dy_vec) {
#pragma unroll
                for (int c = 0; c < M; c++) {
                    raw[u][c] = make_uint4(0, 0, 0, 0);
                    if (dyok[u] && local + 8 * c < p.half_rows)
                        raw[u][c] = __ldg(reinterpret_cast<const uint4 *>(dyrow[u] + col + 8 * c));
                }
            } else {
                // dy's rows not in 16-byte pieces (the half's rows not a multiple of 8)
                const unsigned short *r16 = reinterpret_cast<const unsigned short *>(dyrow[u]) + col;
#pragma unroll
                for (int c = 0; c < M; c++) {
                    uint32_t w[4];
#pragma unroll
                    for (int t = 0; t < 4; t++) {
                        const int64_t l0 = local + 8 * c + 2 * t;
                        const uint32_t lo = dyok[u] && l0 < p.half_rows ? __ldg(r16 + 8 * c + 2 * t) : 0u;
                        const uint32_t hi = dyok[u] && l0 + 1 < p.half_rows ? __ldg(r16 + 8 * c + 2 * t + 1) : 0u;
                        w[t] = lo | (hi << 16);
                    }
                    raw[u][c] = make_uint4(w[0], w[1], w[2], w[3]);
                }
            }
        }
        if (M > 1) {
#pragma unroll
            for (int s = 0; s < 2; s++) {
                ix[s] = make_uint2(0, 0);
                if (s < nslot)
                    ix[s] = __ldg(reinterpret_cast<const uint2 *>(p.idx + ((int64_t)e * p.slices + j0 + s) * p.rp +
                                                                  p0 + 8 * P8));
            }
        }
    };
    auto write_k = [&](int buf) {
        const uint32_t st = sbase + (uint32_t)buf * DX_STAGE;
        // B: 16 dense columns from 8 kept values and 4 nibbles
        {
            const uint32_t pv[4] = {bv.x, bv.y, bv.z, bv.w};
            uint32_t w[8];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const uint32_t nib = (bm16 >> (4 * k)) & 0xfu, i0 = nib & 3u, i1 = nib >> 2;
                w[2 * k] = __byte_perm(pv[k], 0u, dense_sel(i0, i1, 0) | (dense_sel(i0, i1, 1) << 8));
                w[2 * k + 1] = __byte_perm(pv[k], 0u, dense_sel(i0, i1, 2) | (dense_sel(i0, i1, 3) << 8));
            }
            sts_v4(st + b_dst + (((2 * bc) ^ (br & 7)) << 4), w[0], w[1], w[2], w[3]);
            sts_v4(st + b_dst + (((2 * bc + 1) ^ (br & 7)) << 4), w[4], w[5], w[6], w[7]);
        }
        // A: the selected element of every M candidates, per slot
#pragma unroll
        for (int s = 0; s < 2; s++) {
            if (s < nslot) {
                uint32_t sl[2] = {0u, 0u};
                if (M > 1) make_selectors<M>(ix[s], sl);
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
                    sts_v4(st + (uint32_t)s * DX_ATILE + a_dst + u * 64 * DX_AROW, gather_word<M>(w, sl, 0),
                           gather_word<M>(w, sl, 1), gather_word<M>(w, sl, 2), gather_word<M>(w, sl, 3));
                }
            }
        }
    };

    // ---- accumulators and the mma of one k-tile
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;
    const bool warp_live = s_begin + 32 * wm < s_end && c0 + 64 * wn < p.C;
    const int mi = lane >> 3, l7 = lane & 7;
    auto mma_tile = [&](int buf) {
        const uint32_t st = sbase + (uint32_t)buf * DX_STAGE;
        const uint32_t as = st + (uint32_t)slot_w * DX_ATILE, bs = st + 2 * DX_ATILE;
#pragma unroll
        for (int ks = 0; ks < DX_BK / 16; ks++) {
            uint32_t af[2][4], bfr[8][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int row = 32 * wm + 16 * i + 8 * (mi & 1) + l7;
                const int ch = 2 * ks + (mi >> 1);
                ldmatrix_x4(as + row * DX_AROW + ((ch ^ ((row >> 1) & 3)) << 4), af[i][0], af[i][1], af[i][2],
                            af[i][3]);
            }
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int k = 16 * ks + 8 * (mi & 1) + l7;
                const int ch = 8 * wn + 2 * jj + (mi >> 1);
                ldsm_x4_trans(bs + k * DX_BROW + ((ch ^ l7) << 4), bfr[2 * jj][0], bfr[2 * jj][1],
                              bfr[2 * jj + 1][0], bfr[2 * jj + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    Mma16816<T>::run(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j][0], bfr[j][1]);
        }
    };

    // ---- main loop: k-tile kt + 1 stored while mma(kt) runs, kt + 2 loaded; one barrier a
    // k-tile (write_k(kt + 1) overwrites the buffer mma(kt - 1) read before the last barrier)
    const int KT = (int)(p.rp / DX_BK);  // 0 for a weight without rows: the sums are 0
    if (KT > 0) {
        load_k(0);
        write_k(0);
        if (KT > 1) load_k(1);
    }
    __syncthreads();
    for (int kt = 0; kt < KT; kt++) {
        if (warp_live) mma_tile(kt & 1);
        if (kt + 1 < KT) {
            write_k((kt + 1) & 1);
            if (kt + 2 < KT) load_k(kt + 2);
        }
        __syncthreads();
    }

    // ---- epilogue: the scale on the fp32 sums, one rounding, the rows of this tile only
    if (!warp_live) return;
    const int g = lane >> 2, q4 = lane & 3;
    T *out = static_cast<T *>(p.out);
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int64_t s = s_begin + 32 * wm + 16 * i + g + 8 * hh;
            if (s >= s_end) continue;
            const float sc = p.scale ? __ldg(p.scale + s) : 1.0f;
            T *orow = out + s * p.ldo;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int64_t c = c0 + 64 * wn + 8 * j + 2 * q4;
                if (c < p.C)
                    *reinterpret_cast<uint32_t *>(orow + c) =
                        Elem<T>::pack2(acc[i][j][2 * hh] * sc, acc[i][j][2 * hh + 1] * sc);
            }
        }
    }
}

template <typename T, int M> sam_status launch(const DxArgs &a, int64_t grid, cudaStream_t stream) {
    SAM_CUDA_TRY(cudaFuncSetAttribute(ssmm_dx_kernel<T, M>, cudaFuncAttributeMaxDynamicSharedMemorySize, DX_SMEM),
                 "ssmm_dx");
    ssmm_dx_kernel<T, M><<<(unsigned)grid, DX_THREADS, DX_SMEM, stream>>>(a);
    return launch_status("ssmm_dx");
}

template <typename T> sam_status launch_dtype(const DxArgs &a, int m, int64_t grid, cudaStream_t s) {
    switch (m) {
    case 1: return launch<T, 1>(a, grid, s);
    case 2: return launch<T, 2>(a, grid, s);
    default: return launch<T, 4>(a, grid, s);
    }
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_ssmm_dx_cuda(const sam_ssmm_dx_params *ps, void *stream) {
    using namespace sam;
    const sam_format f = ps->f;
    const sam_dims &d = ps->d;
    if (f.n != 1 || (f.m != 1 && f.m != 2 && f.m != 4)) {
        set_error("ssmm_dx: the GPU kernel supports formats 2:4, 1:2:V and 1:4:V; got %d:%d:%d", f.n, f.m, f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && (f.v <= 0 || f.v % 64 != 0)) {
        set_error("ssmm_dx: the GPU kernel needs a slice length v that is a multiple of 64; got %d", f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (d.C % 8 != 0) {
        set_error("ssmm_dx: the GPU kernel needs the column count to be a multiple of 8 (16-byte rows); got %lld",
                  (long long)d.C);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (!tc_dtype_ok(ps->dtype, "ssmm_dx")) return SAM_STATUS_UNSUPPORTED;
    if (ps->ldo % 8 != 0 || (reinterpret_cast<uintptr_t>(ps->out) & 15) != 0 ||
        (reinterpret_cast<uintptr_t>(ps->values) & 15) != 0) {
        set_error("ssmm_dx: the GPU kernel needs out and values 16-byte aligned and out's row stride a multiple "
                  "of 8 (got %lld)", (long long)ps->ldo);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && ps->idx == nullptr && d.E > 0) {
        set_error("ssmm_dx: format 1:%d:%d needs idx", f.m, f.v);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    // (E == 0 still launches: every row is outside [offsets[0], offsets[E]) and is zeroed)
    if (ps->S == 0 || d.C == 0) return SAM_STATUS_OK;

    DxArgs a{};
    a.dy = ps->dy;
    a.T = ps->T;
    a.lddy = ps->lddy;
    a.values = ps->values;
    a.meta = ps->meta;
    a.idx = ps->idx;
    a.offsets = ps->offsets;
    a.token_ids = ps->token_ids;
    a.scale = ps->scale;
    a.out = ps->out;
    a.S = ps->S;
    a.ldo = ps->ldo;
    a.C = d.C;
    a.cp = d.cp;
    a.rp = d.rp;
    a.half_rows = d.half_rows;
    a.slices = d.slices;
    a.E = (int)d.E;
    a.glu = f.glu;
    a.v = f.m > 1 ? f.v : 0;
    a.ncb = (int)ceil_div(d.cp, DX_BN);
    a.dy_vec = d.half_rows % 8 == 0 && ps->lddy % 8 == 0 && (reinterpret_cast<uintptr_t>(ps->dy) & 15) == 0;
    // every row tile S rows can make (ceil(S / BM) + E: one partial tile per expert at most),
    // per column block; the rest of the CTAs zero the rows no expert owns
    const int64_t grid = (ceil_div(ps->S, DX_BM) + d.E) * a.ncb;
    if (grid > INT32_MAX) {
        set_error("ssmm_dx: problem too large for one launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    cudaStream_t s = (cudaStream_t)stream;
    const bool wgmma_ok = ssmm_dx_wgmma_available();
    if (ps->impl == 2 && !wgmma_ok) {
        set_error("ssmm_dx: impl 2 (the wgmma kernel) needs an sm_90 device and the sm_90a build");
        return SAM_STATUS_UNSUPPORTED;
    }
    if (dx_choose_kernel(wgmma_ok, ps->impl - 1) == DX_WGMMA && d.E > 0) {
        bool ran = false;
        const sam_status st = ssmm_dx_wgmma_launch(a, ps->dtype, f.m, s, &ran);
        if (ran || st != SAM_STATUS_OK) return st;
        // (dy's transposed copy could not be allocated: the mma.sync kernel needs no memory)
    }
    if (ps->dtype == SAM_BF16) return launch_dtype<__nv_bfloat16>(a, f.m, grid, s);
    return launch_dtype<__half>(a, f.m, grid, s);
}
