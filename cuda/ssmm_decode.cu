// ssmm_decode.cu -- the decode / small-T path of the grouped sparse-sparse matmul.
//
// Computes what cuda/ssmm.cu computes (the definition is csrc/ssmm_ref.c): for
// every expert e and sorted row s in [offsets[e], offsets[e+1]):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
// with W_e in the Samoyeds format (samoyeds_layout.h), fp32 accumulation.
//
// Why a second kernel.  With a few tokens per expert the op is bound by reading
// the packed weights once; the prefill kernel's 128-row x 128-token CTA tiles
// then give a few hundred CTAs that each stream a long K loop, and most of the
// GPU's memory parallelism idles.  Here a CTA owns ROWS = 16*MT storage rows of
// one routed expert and ALL of its tokens (in passes of BN = 8*NT), and splits
// the column (K) loop across its W warps (intra-CTA split-K):
//
//   * grid = row tiles x min(E, S) CTAs; CTA (j, rt) finds the j-th expert
//     with rows from offsets[] on the device (no host sync, CUDA-graph safe);
//     CTAs past the routed experts exit at once, so an expert with no token
//     costs nothing and each routed expert's values/meta/idx are read once
//     per token pass (one pass when its rows fit BN).
//   * warp w streams the k-tiles (64 columns) w, w + W, w + 2W, ... through
//     its own ST-stage cp.async pipeline (packed values of the CTA's rows, the
//     2:4 metadata tiles, the row-selection indices at a slice change, and the
//     BN token rows gathered by index from x); warps never wait for each other
//     inside the loop (__syncwarp only).  Interleaving the warps' k-tiles keeps
//     W*64 contiguous bytes of every row in flight together (DRAM page
//     locality; docs/KERNELS.md, "The decode kernel").  Each k-step is MT x NT
//     mma.sp m16n8k32 on ldmatrix fragments (weights = the sparse A operand).
//   * row selection (1:M:V): M accumulator sets per condensed row (a running
//     total and the shares of M - 1 rows), folded at the warp's first k-tile and
//     whenever its next k-tile lies in another slice, exactly as in ssmm_mma_sp.cu; the
//     set -> original row map (perm) travels with the partial sums into the reduction.
//   * the W partial tiles are reduced through shared memory in warp order
//     0..W-1 (deterministic, no atomics), then the prefill epilogue semantics:
//     bias, SwiGLU / GPT-OSS (gate row i pairs with up row i: a GLU CTA takes
//     ROWS/2 condensed rows of the gate chunk and the same rows of the up
//     chunk), routing scale, rounding once to bf16/fp16.
//
// Invariants: rp is a multiple of 64 and ROWS divides 64 (per GLU half: ROWS/2
// divides SAM_GLU_CHUNK), so a CTA's rows never leave the packed arrays; cp is
// a multiple of 128 (even k-tile count); C % 8 == 0 and V % 64 == 0 (checked
// by sam_ssmm_cuda).  Invalid token ids (< 0 or >= T) read nothing and write
// nothing; rows past offsets[E] or S are never touched.
#include "common.cuh"
#include "ptx_mma.cuh"
#include "ssmm_epilogue.cuh"
#include "ssmm_work.cuh"

namespace sam {
namespace {

// M: accumulator sets (row-group size); MT: m16 row tiles per CTA; NT: n8 token
// tiles per pass; W: warps (split-K ways); ST: pipeline stages per warp.
template <int M_, int MT_, int NT_, int W_, int ST_> struct DecodeTile {
    static constexpr int M = M_, MT = MT_, NT = NT_, W = W_, ST = ST_;
    static_assert(MT % 2 == 0 && 64 % (16 * MT / 2) == 0, "a GLU half of the rows divides the 64-row chunk");
    static constexpr int THREADS = 32 * W;
    static constexpr int ROWS = 16 * MT;  // storage rows per CTA
    static constexpr int BN = 8 * NT;     // tokens per pass
    // one stage = 64 dense columns: 32 packed values (64 bytes) per row
    static constexpr int A_BYTES = ROWS * 64;
    static constexpr int B_BYTES = BN * 128;
    static constexpr int META_BYTES = MT * 128;  // two 16x32 metadata tiles per row tile
    static constexpr int IDX_BYTES = M > 1 ? MT * 16 : 0;
    static constexpr int B_OFF = A_BYTES, META_OFF = B_OFF + B_BYTES, IDX_OFF = META_OFF + META_BYTES;
    static constexpr int STAGE = (IDX_OFF + IDX_BYTES + 127) / 128 * 128;
    static constexpr int WARP_BYTES = ST * STAGE;
    static constexpr int PIPE = W * WARP_BYTES;
    // reduction tile: [W][BN][FS] fp32, column = local row * M + row of its group
    static constexpr int OC = ROWS * M;
    static constexpr int FS = OC + 4;  // rows of the tile land on different banks
    static constexpr int RED = W * BN * FS * 4;
    static constexpr int SMEM = (PIPE > RED ? PIPE : RED) + 128;  // + alignment
    // A rows are 64 bytes: XOR the 16-byte chunk with row bits 1-2 so that an
    // 8-row ldmatrix phase hits 8 distinct bank groups; B rows are 128 bytes.
    static __device__ __forceinline__ uint32_t a_off(int row, int ch) {
        return row * 64 + ((ch ^ ((row >> 1) & 3)) << 4);
    }
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }
};

struct DParams : SsmmArgs {
    int kps;    // k-tiles (64 columns) per slice; 1 << 30 without row selection
    int nrt;    // row tiles per expert
    int early;  // offsets and weights may be read before pdl_wait() (sam_ssmm_params.offsets_ready)
};

// The j-th expert (in expert order) that owns at least one sorted row in
// [0, S), or -1, and its rows [b0, b1).  Run by one whole warp.  The offsets
// of 32 * RCH experts are loaded before any is looked at, so that the search
// costs one round trip to memory for E <= 256 (not one per 32 experts).
__device__ __forceinline__ int routed_expert(const DParams &p, int j, int lane, int64_t &b0, int64_t &b1) {
    constexpr int RCH = 8;
    int run = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32 * RCH) {
        int32_t lo[RCH], hi[RCH];
#pragma unroll
        for (int c = 0; c < RCH; c++) {
            const int e = e0 + 32 * c + lane;
            lo[c] = hi[c] = 0;
            if (e < p.E) {
                lo[c] = p.offsets[e];
                hi[c] = p.offsets[e + 1];
            }
        }
#pragma unroll
        for (int c = 0; c < RCH; c++) {
            const int64_t a = max(0, lo[c]), b = min((int64_t)hi[c], p.S);
            unsigned bal = __ballot_sync(0xffffffffu, b > a);
            const int n = __popc(bal);
            if (j < run + n) {  // (warp-uniform)
                for (int k = j - run; k > 0; k--) bal &= bal - 1;
                const int src = __ffs(bal) - 1;
                b0 = __shfl_sync(0xffffffffu, a, src);
                b1 = __shfl_sync(0xffffffffu, b, src);
                return e0 + 32 * c + src;
            }
            run += n;
        }
    }
    return -1;
}

// The slice of the k-tiles kt0, kt0 + step, kt0 + 2 step, ... (kps k-tiles per slice)
// without a division per k-tile: start() at kt0, then next() moves one k-tile on and
// says whether its slice differs from the previous one's.
struct SliceWalk {
    int slice, rem;  // the current k-tile is slice * kps + rem
    __device__ __forceinline__ void start(int kt, int kps) {
        slice = kt / kps;
        rem = kt - slice * kps;
    }
    __device__ __forceinline__ bool next(int step, int kps) {
        const int before = slice;
        for (rem += step; rem >= kps; rem -= kps) slice++;
        return slice != before;
    }
};

// One warp's copy plan for a work item (expert e, row tile rt) and a token pass: where
// each lane's 16-byte pieces of a k-tile come from.  Storage rows: tiles [0, MT/2) start
// at base0, tiles [MT/2, MT) at base1 (GLU: the gate and up rows of the same condensed rows).
template <typename T, typename Cf> struct DPlan {
    static constexpr int M = Cf::M, MT = Cf::MT, NT = Cf::NT, ROWS = Cf::ROWS;
    const T *a_src0, *a_src1;
    const uint32_t *m_src;
    const uint8_t *i_src;
    const T *b_src[2 * NT];

    __device__ __forceinline__ void item(const DParams &p, int e, int rt, int lane) {
        int64_t base0, base1;
        if (p.glu) {
            const int64_t q0 = (int64_t)rt * (ROWS / 2);
            base0 = sam_storage_index(1, 0, q0);
            base1 = sam_storage_index(1, 1, q0);
        } else {
            base0 = (int64_t)rt * ROWS;
            base1 = base0 + ROWS / 2;
        }
        const int64_t pitch = p.cp / 2;  // packed values per storage row
        const T *vals = static_cast<const T *>(p.values) + (int64_t)e * p.rp * pitch;
        // A: lane copies chunk lane%4 of local rows 8i + lane/4, i < 2*MT
        a_src0 = vals + (base0 + (lane >> 2)) * pitch + (lane & 3) * 8;
        a_src1 = vals + (base1 + (lane >> 2)) * pitch + (lane & 3) * 8;
        // metadata: lane < 8*MT copies chunk lane%8 of row tile lane/8 (two k32 tiles = 128 bytes)
        const int mi = lane >> 3;
        const int64_t m_base = mi < MT ? (mi < MT / 2 ? base0 + 16 * mi : base1 + 16 * (mi - MT / 2)) : 0;
        m_src = p.meta + ((int64_t)e * (p.rp / 16) + m_base / 16) * (p.cp / 32) * 16 + (lane & 7) * 4;
        // indices: lane < MT copies the 16 bytes of row tile lane (at a slice start)
        const int64_t i_base = lane < MT / 2 ? base0 + 16 * lane : base1 + 16 * (lane - MT / 2);
        i_src = (M > 1 && lane < MT) ? p.idx + (int64_t)e * p.slices * p.rp + i_base : nullptr;
    }
    // B: lane copies chunk lane%8 of token rows lane/8 + 4i, i < 2*NT (tok: -1 = none)
    __device__ __forceinline__ void tokens(const DParams &p, const int32_t *tok, int lane) {
        const T *x = static_cast<const T *>(p.x);
#pragma unroll
        for (int i = 0; i < 2 * NT; i++) {
            const int t = tok[(lane >> 3) + 4 * i];
            b_src[i] = t >= 0 ? x + (int64_t)t * p.ldx + (lane & 7) * 8 : nullptr;
        }
    }
    // the weights of k-tile kt into the stage at `base`; `fresh`: its slice differs from
    // the previous copy's, so the row-selection indices of `slice` come too
    __device__ __forceinline__ void issue_w(const DParams &p, uint32_t base, int kt, bool fresh, int slice,
                                            int lane) const {
        const int64_t pitch = p.cp / 2, ka = (int64_t)kt * 32;
        const uint32_t a_dst = Cf::a_off(lane >> 2, lane & 3);  // + 512*i (the swizzle only uses row bits 1-2)
#pragma unroll
        for (int i = 0; i < 2 * MT; i++) {
            const T *src = (i < MT ? a_src0 : a_src1) + (int64_t)(i % MT) * 8 * pitch + ka;
            cp_async16_l2_256(base + a_dst + 512 * i, src);
        }
        if ((lane >> 3) < MT) {
            const uint32_t m_dst = base + Cf::META_OFF + (lane >> 3) * 128 + (lane & 7) * 16;
            cp_async16_l2_256(m_dst, m_src + (int64_t)kt * 32);
        }
        // (columns are padded to 128: with V = 64 a last k-tile past the last slice holds only
        // zero values and keeps the last slice's indices, never reading past idx)
        if (M > 1 && lane < MT && fresh)
            cp_async16(base + Cf::IDX_OFF + lane * 16, i_src + (int64_t)min(slice, (int)p.slices - 1) * p.rp, true);
    }
    // the token rows of k-tile kt
    __device__ __forceinline__ void issue_b(const DParams &p, uint32_t base, int kt, int lane) const {
        const int brow = lane >> 3, bch = lane & 7;
        const bool col_ok = kt * 64 + bch * 8 < p.C;
#pragma unroll
        for (int i = 0; i < 2 * NT; i++) {
            const bool ok = col_ok && b_src[i] != nullptr;
            cp_async16(base + Cf::B_OFF + Cf::b_off(brow + 4 * i, bch), ok ? b_src[i] + kt * 64 : p.x, ok);
        }
    }
    __device__ __forceinline__ void issue(const DParams &p, uint32_t base, int kt, bool fresh, int slice,
                                          int lane) const {
        issue_w(p, base, kt, fresh, slice, lane);
        issue_b(p, base, kt, lane);
    }
};

// A warp's k-tiles (64 columns each), interleaved: warp, warp + W, ...: at any moment
// the W warps read W*64 contiguous bytes of every row (DRAM page locality).
template <typename Cf> struct DRange {
    static constexpr int KSTEP = Cf::W;
    int kt0, n_it, kt_end;
    __device__ __forceinline__ DRange(const DParams &p, int warp) {
        const int KT = (int)(p.cp / 64), W = Cf::W;
        kt0 = warp;
        n_it = warp < KT ? (KT - warp + W - 1) / W : 0;
        kt_end = kt0 + n_it * KSTEP;
    }
};

// The first ST - 1 stages of the warp's range, one commit group each (empty past the
// range).  cw walks the slices of the k-tiles copied (a k-tile whose slice differs from
// the warp's previous one brings the row-selection indices).  WEIGHTS / TOKENS: which
// parts to request; the weights alone are not committed, so that with the token rows
// requested later (TOKENS alone) each stage's group still holds all of its copies.
template <bool WEIGHTS, bool TOKENS, typename T, typename Cf>
__device__ __forceinline__ void d_prologue(const DParams &p, const DPlan<T, Cf> &pl, const DRange<Cf> &r,
                                           SliceWalk &cw, uint32_t wbase_u, int lane) {
    if (WEIGHTS) cw.start(r.kt0, p.kps);
#pragma unroll
    for (int s = 0; s < Cf::ST - 1; s++) {
        if (s < r.n_it) {
            const uint32_t base = wbase_u + s * Cf::STAGE;
            const int kt = r.kt0 + s * DRange<Cf>::KSTEP;
            if (WEIGHTS) {
                const bool fresh = s == 0 || cw.next(DRange<Cf>::KSTEP, p.kps);
                pl.issue_w(p, base, kt, fresh, cw.slice, lane);
            }
            if (TOKENS) pl.issue_b(p, base, kt, lane);
        }
        if (TOKENS) cp_async_commit();
    }
}

// The warp's k-tiles through its ST-stage ring (d_prologue issued the first ST - 1):
// MT x NT mma.sp m16n8k32 per 32 columns on ldmatrix fragments (weights = the sparse A
// operand).  Row selection (1:M:V): M accumulator sets per condensed row, set 0 the running
// total mma writes, the others the shares of M - 1 rows, folded in whenever a k-tile lies in
// another slice than the warp's previous one (fold_row_set, ssmm_work.cuh); at the end perm says
// which row of its group each set holds.  Ends with every copy landed.
template <typename T, typename Cf>
__device__ __forceinline__ void d_kloop(const DParams &p, const DPlan<T, Cf> &pl, const DRange<Cf> &r,
                                        SliceWalk &cw, unsigned char *wbase, int lane,
                                        float (&acc)[Cf::M][Cf::MT][Cf::NT][4], uint32_t (&perm)[Cf::MT][2]) {
    constexpr int M = Cf::M, MT = Cf::MT, NT = Cf::NT, ST = Cf::ST, KSTEP = DRange<Cf>::KSTEP;
    const int g = lane >> 2, q = lane & 3;
    const uint32_t wbase_u = smem_u32(wbase);
    init_row_sets(acc, perm);
    SliceWalk mw;
    mw.start(r.kt0, p.kps);
    int rd = 0;
#pragma unroll 1
    for (int kt = r.kt0; kt < r.kt_end; kt += KSTEP) {
        cp_async_wait<ST - 2>();
        __syncwarp();  // every lane's copies of k-tile kt landed; the slot refilled below is free
        {
            const int nk = kt + (ST - 1) * KSTEP;
            if (nk < r.kt_end) {
                const bool fresh = cw.next(KSTEP, p.kps);
                pl.issue(p, wbase_u + (rd == 0 ? ST - 1 : rd - 1) * Cf::STAGE, nk, fresh, cw.slice, lane);
            }
            cp_async_commit();
        }
        const unsigned char *stage = wbase + rd * Cf::STAGE;
        if (M > 1 && (kt == r.kt0 || mw.next(KSTEP, p.kps))) {
            const uint8_t *idx_s = stage + Cf::IDX_OFF;
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const uint32_t want = idx_s[i * 16 + g + 8 * hh];
                    fold_row_set<M, NT>([&](int a, int j, int k) -> float & { return acc[a][i][j][k]; },
                                          perm[i][hh], want, hh);
                }
        }
        const uint32_t sa = smem_u32(stage);
        const uint32_t *mt_s = reinterpret_cast<const uint32_t *>(stage + Cf::META_OFF);
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            uint32_t af[MT][4], bf[NT][4], ef[MT];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                const int row = i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int ch = 2 * ks + (lane >> 4);
                ldmatrix_x4(sa + Cf::a_off(row, ch), af[i][0], af[i][1], af[i][2], af[i][3]);
                ef[i] = mt_s[(i * 2 + ks) * 16 + 2 * g + (q & 1)];
            }
#pragma unroll
            for (int jj = 0; jj < NT; jj++) {
                const int rr = jj * 8 + (lane & 7);
                const int ch = 4 * ks + (lane >> 3);
                ldmatrix_x4(sa + Cf::B_OFF + Cf::b_off(rr, ch), bf[jj][0], bf[jj][1], bf[jj][2], bf[jj][3]);
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int jj = 0; jj < NT; jj++) MmaSp<T>::run(acc[0][i][jj], af[i], bf[jj], ef[i]);
        }
        rd = rd + 1 == ST ? 0 : rd + 1;
    }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            finish_row_sets<M, NT>([&](int a, int j, int k) -> float & { return acc[a][i][j][k]; }, perm[i][hh], hh);
}

// The warp's sums into a [BN][FS] fp32 tile: column = local row * M + row of its group.
template <typename Cf>
__device__ __forceinline__ void d_store_tile(float *tile, const float (&acc)[Cf::M][Cf::MT][Cf::NT][4],
                                             const uint32_t (&perm)[Cf::MT][2], int lane) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < Cf::MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int lrow = i * 16 + g + 8 * hh;
#pragma unroll
            for (int a = 0; a < Cf::M; a++) {
                const int c = lrow * Cf::M + (int)((perm[i][hh] >> (4 * a)) & 15u);
#pragma unroll
                for (int jj = 0; jj < Cf::NT; jj++) {
                    const int ltok = jj * 8 + 2 * q;
                    tile[ltok * Cf::FS + c] = acc[a][i][jj][2 * hh];
                    tile[(ltok + 1) * Cf::FS + c] = acc[a][i][jj][2 * hh + 1];
                }
            }
        }
}

// The NPART tiles at red summed in order, then the prefill epilogue semantics: bias,
// SwiGLU / GPT-OSS (gate row i pairs with up row i: a GLU CTA takes ROWS/2 condensed
// rows of the gate chunk and the same rows of the up chunk), routing scale, rounding
// once to bf16/fp16, 16-byte stores.  Token pass at sorted row s0 of expert e, row tile
// rt; tok: the pass's token ids (-1 = no row).  Shared by the CTA's threads.
template <typename T, typename Cf, int NPART>
__device__ __forceinline__ void d_epilogue(const DParams &p, const float *red, const int32_t *tok, int64_t s0,
                                           int e, int rt, int tid) {
    constexpr int ROWS = Cf::ROWS, M = Cf::M, BN = Cf::BN, FS = Cf::FS;
    const bool gated = p.act != SAM_ACT_NONE;
    const int OCOLS = gated ? ROWS / 2 * M : ROWS * M;  // output columns of this CTA
    const int64_t col0 = gated ? (int64_t)rt * (ROWS / 2) * M : (int64_t)rt * ROWS * M;
    const int64_t bias_up = gated ? p.R / 2 : 0;
    T *out = static_cast<T *>(p.out);
    const bool vec_ok = (p.ldo % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.out) & 15) == 0);
    const int chunks = OCOLS / 8;
#pragma unroll 1
    for (int id = tid; id < BN * chunks; id += Cf::THREADS) {
        const int ltok = id / chunks, ch = id % chunks;
        if (tok[ltok] < 0) continue;
        const int64_t s = s0 + ltok;
        const float sc = p.scale ? p.scale[s] : 1.0f;
        const int64_t c0 = col0 + ch * 8;
        float v[8], u[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = u[k] = 0.0f;
#pragma unroll 1
        for (int w = 0; w < NPART; w++) {
            const float *src = red + (w * BN + ltok) * FS + ch * 8;
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] += src[k];
            if (gated) {
#pragma unroll
                for (int k = 0; k < 8; k++) u[k] += src[OCOLS + k];
            }
        }
        float y8[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            y8[k] = epilogue_value(p, e, c0 + k, gated, bias_up, v[k], [&] { return u[k]; }) * sc;
        }
        if (gated && p.preact)
            store_preact8<T>(p, e, s, c0, [&](int k) { return v[k]; }, [&](int k) { return u[k]; });
        T *dst = out + s * p.ldo + c0;
        if (vec_ok && c0 + 8 <= p.out_cols) {
            uint4 pk;
            pk.x = Elem<T>::pack2(y8[0], y8[1]);
            pk.y = Elem<T>::pack2(y8[2], y8[3]);
            pk.z = Elem<T>::pack2(y8[4], y8[5]);
            pk.w = Elem<T>::pack2(y8[6], y8[7]);
            *reinterpret_cast<uint4 *>(dst) = pk;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (c0 + k < p.out_cols) dst[k] = Elem<T>::from_f(y8[k]);
        }
    }
}

// The token ids of the pass at sorted row s0 of rows [s0, s_end): row i's token, or -1
// (past the expert's rows, or an invalid id: it reads and writes nothing).
__device__ __forceinline__ int32_t d_token(const DParams &p, int64_t s0, int64_t s_end, int i) {
    const int64_t s = s0 + i;
    int32_t t = -1;
    if (s < s_end) {
        const int64_t v = p.token_ids ? (int64_t)p.token_ids[s] : s;
        if (v >= 0 && v < p.T) t = (int32_t)v;
    }
    return t;
}

// One CTA per work item (routed expert, row tile).
template <typename T, typename Cf>
__global__ void __launch_bounds__(Cf::THREADS, 1) ssmm_decode_kernel(const DParams p) {
    constexpr int BN = Cf::BN, THREADS = Cf::THREADS;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);
    __shared__ int32_t tok_s[BN];
    __shared__ int64_t sh_rows[2];
    __shared__ int sh_e;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rt = (int)(blockIdx.x % (unsigned)p.nrt), j = (int)(blockIdx.x / (unsigned)p.nrt);
    // Launched as a programmatic dependent of the kernel before it on the stream: that
    // kernel may still be running until pdl_wait().  offsets, the weights and this CTA's
    // shared memory may be read first only where the caller says the offsets are ready
    // (early: moe_forward's down projection, whose offsets come from two launches back).
    if (!p.early) {
        pdl_wait();
        pdl_trigger();
    }
    if (warp == 0) {
        int64_t b0 = 0, b1 = 0;
        const int e = routed_expert(p, j, lane, b0, b1);
        if (lane == 0) {
            sh_e = e;
            sh_rows[0] = b0;
            sh_rows[1] = b1;
        }
    }
    __syncthreads();
    const int e = sh_e;
    if (e < 0) {
        if (p.early) pdl_wait();  // the grid ends only after the one before it
        return;
    }
    const int64_t s_begin = sh_rows[0], s_end = sh_rows[1];

    DPlan<T, Cf> pl;
    pl.item(p, e, rt, lane);
    const DRange<Cf> r(p, warp);
    SliceWalk cw;
    unsigned char *wbase = smem + warp * Cf::WARP_BYTES;
    float *red = reinterpret_cast<float *>(smem);

    if (p.early) {  // the first pass's first weights stream while the kernel before ends
        d_prologue<true, false>(p, pl, r, cw, smem_u32(wbase), lane);
        pdl_wait();
        pdl_trigger();
    }
#pragma unroll 1
    for (int64_t s0 = s_begin; s0 < s_end; s0 += BN) {
        for (int i = tid; i < BN; i += THREADS) tok_s[i] = d_token(p, s0, s_end, i);
        __syncthreads();
        pl.tokens(p, tok_s, lane);
        float acc[Cf::M][Cf::MT][Cf::NT][4];
        uint32_t perm[Cf::MT][2];
        if (p.early && s0 == s_begin)
            d_prologue<false, true>(p, pl, r, cw, smem_u32(wbase), lane);
        else
            d_prologue<true, true>(p, pl, r, cw, smem_u32(wbase), lane);
        d_kloop(p, pl, r, cw, wbase, lane, acc, perm);
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with its pipeline: the tiles below overlay it
        d_store_tile<Cf>(red + warp * BN * Cf::FS, acc, perm, lane);
        __syncthreads();
        d_epilogue<T, Cf, Cf::W>(p, red, tok_s, s0, e, rt, tid);
        __syncthreads();  // the next pass rewrites tok_s and the pipeline
    }
}

template <typename T, typename Cf> sam_status launch(const sam_ssmm_params *ps, cudaStream_t stream) {
    DParams k;
    static_cast<SsmmArgs &>(k) = ssmm_args(ps);
    k.kps = Cf::M > 1 ? ps->f.v / 64 : (1 << 30);
    k.nrt = (int)(ps->d.rp / Cf::ROWS);
    const int64_t routed = std::min<int64_t>(ps->d.E, ps->S);  // experts that can own a row
    const int64_t grid = (int64_t)k.nrt * routed;
    if (grid == 0) return SAM_STATUS_OK;
    if (grid > INT32_MAX) {
        set_error("ssmm: problem too large for one decode launch (%lld CTAs)", (long long)grid);
        return SAM_STATUS_UNSUPPORTED;
    }
    const bool pdl = pdl_enabled();
    k.early = pdl && ps->offsets_ready;
    auto kernel = ssmm_decode_kernel<T, Cf>;
    SAM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cf::SMEM), "ssmm");
    SAM_CUDA_TRY(launch_kernel(kernel, dim3((unsigned)grid), dim3(Cf::THREADS), Cf::SMEM, stream, pdl, k), "ssmm");
    return launch_status("ssmm");
}

// The CTA shape of a token pass of NT n8 tiles (docs/KERNELS.md, "The decode kernel"):
// 64 rows by 8 warps of 3 stages when the grid has fewer CTAs than two per SM (more warps
// per CTA keep more bytes in flight; 4 warps of 4 stages where the device cannot give its
// shared memory, sm_80's 163 KB); else 64 rows by 2 warps of 3 stages while the routed rows
// average at most 8 per expert or the passes are 32 tokens wide (more, smaller CTAs per SM
// overlap one's reduction with the others' loads); else 64 rows by 4 warps of 4 stages.
bool smem_fits(int bytes) {
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return bytes <= optin;
}

template <typename T, int M, int NT> sam_status launch_cta(const sam_ssmm_params *ps, cudaStream_t s) {
    using Wide = DecodeTile<M, 4, NT, 8, 3>;
    using Small = DecodeTile<M, 4, NT, 2, 3>;
    using Base = DecodeTile<M, 4, NT, 4, 4>;
    const int64_t ctas = ps->d.rp / 64 * std::min<int64_t>(ps->d.E, ps->S);
    const bool few_rows = ps->S <= 8 * (int64_t)ps->d.E;
    if (ctas < 2 * (int64_t)device_sm_count()) {
        if (smem_fits(Wide::SMEM)) return launch<T, Wide>(ps, s);
        return launch<T, Base>(ps, s);
    }
    if (few_rows || NT == 4) return launch<T, Small>(ps, s);
    return launch<T, Base>(ps, s);
}

// Tokens per pass (BN = 8 NT), from S (the capacity of sorted rows, an upper bound of any
// expert's rows) and E, so that an expert's rows mostly fit one pass and its weights are
// read once, with at most 128 accumulator registers (M * NT <= 8 at MT = 4):
//   * 8 while S <= 8 or S < E (less than one row per expert on average);
//   * 2:4 and 1:2:V: 16 while S <= 16 or the rows average at most SAM_DECODE_WIDE_PASS
//     per expert, else 32;
//   * 1:4:V: 8 up to SAM_DECODE_WIDE_PASS / 2 rows per expert, else 16.
// docs/KERNELS.md ("The decode kernel") has the measurements.
template <typename T> sam_status launch_pass(const sam_ssmm_params *ps, cudaStream_t s) {
    const int m = ps->f.m;
    // routed rows above which the passes are wider: 32 tokens (2:4, 1:2:V), 16 (1:4:V, from
    // half the rows per expert: its 16-token pass holds as many accumulators as 1:2:V's 32)
    const int64_t wide = (int64_t)(m == 4 ? SAM_DECODE_WIDE_PASS / 2 : SAM_DECODE_WIDE_PASS) * ps->d.E;
    int nt = 1;
    if (ps->S > 8 && ps->S >= ps->d.E) nt = m == 4 ? (ps->S > wide ? 2 : 1) : ps->S <= 16 || ps->S <= wide ? 2 : 4;
    if (m == 1) {
        if (nt == 1) return launch_cta<T, 1, 1>(ps, s);
        if (nt == 2) return launch_cta<T, 1, 2>(ps, s);
        return launch_cta<T, 1, 4>(ps, s);
    }
    if (m == 2) {
        if (nt == 1) return launch_cta<T, 2, 1>(ps, s);
        if (nt == 2) return launch_cta<T, 2, 2>(ps, s);
        return launch_cta<T, 2, 4>(ps, s);
    }
    if (m == 4) {  // M * NT <= 8: at most 16 tokens
        if (nt == 1) return launch_cta<T, 4, 1>(ps, s);
        return launch_cta<T, 4, 2>(ps, s);
    }
    set_error("ssmm: the decode kernel supports formats 2:4, 1:2:V and 1:4:V; got %d:%d:%d", ps->f.n, ps->f.m,
              ps->f.v);
    return SAM_STATUS_UNSUPPORTED;
}

}  // namespace
}  // namespace sam

// The format/epilogue checks of sam_ssmm_cuda (n = 1, V % 64, glu <-> act,
// C % 8) have run before this is called.
extern "C" sam_status sam_ssmm_decode_cuda(const sam_ssmm_params *ps, void *stream) {
    return sam::with_tc_dtype(ps->dtype,
                              [&](auto t) { return sam::launch_pass<decltype(t)>(ps, (cudaStream_t)stream); });
}
