// ssmm_wgmma_sp_epilogue.cuh -- the epilogue of the warp-specialised wgmma.sp kernel
// (ssmm_wgmma_sp.cu), per consumer warpgroup and outside the ring, so that it overlaps
// the producer's next item: bias, activation and routing scale on the accumulators in
// fp32 (the order of store_tile, ssmm_epilogue.cuh), one rounding to T into an 8 KB
// staging chunk (PAIRS: 4 KB), then whole 16-byte pieces of output rows.  A gated item's
// gate and up rows are the two m64 blocks of one consumer (a GLU chunk pair,
// samoyeds_layout.h); in the 128 x 128 1:2:V tile (HANDOVER) they are consumer 0's and
// consumer 1's, and each hands the other the rows of half of the tokens in fp32, each
// computing the activation of its half.
//
// Split-K (nsplit > 1; split_k_range, ssmm_work.cuh): store_partial writes an item's fp32
// sums over its K split, where the epilogue would read them, to the workspace, and
// ssmm_split_reduce_kernel adds the splits of each output element in split order and applies
// the epilogue (epilogue_value, ssmm_epilogue.cuh).  Deterministic from run to run; not
// bit-identical to nsplit = 1, which adds K in one fp32 sum.
#pragma once

#include "ptx_mma.cuh"
#include "ssmm_epilogue.cuh"
#include "ssmm_wgmma_sp_mainloop.cuh"
#include "ssmm_wgmma_sp_tile.cuh"
#include "tma.cuh"

namespace sam {

#ifdef SAM_HAS_WGMMA

// What a consumer's epilogue needs that stays the same from item to item (set up once,
// before its first item): the output, whether its rows take 16-byte stores, and the
// consumer's staging and hand-over areas.
template <typename T> struct EpilogueTarget {
    T *out;
    bool vec_ok;
    float *xch;
    unsigned char *stg;
    template <typename C>
    __device__ __forceinline__ static EpilogueTarget make(const PrefillArgs &p, const WgmmaSmem<C> &sm, int c) {
        EpilogueTarget d;
        d.out = static_cast<T *>(p.out);
        d.vec_ok = p.ldo % 8 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
        d.xch = reinterpret_cast<float *>(sm.smem + C::XCH_OFF);
        d.stg = sm.smem + C::STG_OFF + c * C::STG_BYTES;
        return d;
    }
};

// Thread (warp, g, q) of consumer c holds storage rows crow + b*64 + warp*16 + g + 8hh and
// tokens j*8 + 2q + t at acc[b * ASTRIDE + set][4j + 2hh + t].  Item: expert e, storage
// rows from row0, sorted rows from s0; tok / scl: its token rows and routing scales.
template <bool GATED, bool PRE, typename T, typename C>
__device__ __forceinline__ void epilogue(const PrefillArgs &p, const WgmmaSmem<C> &sm, const WgmmaConsumer &w,
                                         const EpilogueTarget<T> &target, float (&acc)[C::NACC][C::AN],
                                         const int32_t *tok, const float *scl, int e, int64_t row0, int64_t s0) {
    constexpr int M = C::M, NB = C::NB, BN = C::BN, ASTRIDE = C::ASTRIDE;
    const int c = w.c, warp = w.warp, g = w.g, q = w.q, crow = w.crow, wtid = w.wtid;
    unsigned char *const smem = sm.smem;
    T *out = target.out;
    const bool vec_ok = target.vec_ok;
    auto bias_at = [&](int64_t i) { return load_as_float(p.bias, p.bias_dtype, i); };
    float *xch = target.xch;
    unsigned char *stg = target.stg;
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
    const int64_t ocol0 = M == 1 ? (GATED ? (row0 / 128) * 64 + c * 64 : row0 + crow)
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
    // PRE, a gated launch's pre-activation (p.preact): gate g and up u (biases added) of output
    // column cw of token ltok, straight from the registers (2-byte stores: few registers
    // more in the epilogue), rounded once as the output is
    auto put_preact = [&](int ltok, int cw, float g, float u) {
        const int64_t col = ocol0 + cw;
        if (tok[ltok] < 0 || col >= p.out_cols) return;
        T *gp = static_cast<T *>(p.preact) + (s0 + ltok) * p.ldp + col;
        gp[0] = Elem<T>::from_f(g);
        gp[p.R / 2] = Elem<T>::from_f(u);
    };
    auto stg_at = [&](int tl, int cw) {  // staged element (token tl of the chunk, column cw)
        return sbase + tl * (OCW * 2) + ((((cw >> 3) ^ (tl & 7)) << 4) | ((cw & 7) * 2));
    };
    auto consumer_sync = [&]() {
        if (HANDOVER) named_barrier_sync(BAR_CONSUMERS, 256);
        else named_barrier_sync(BAR_CONSUMER0 + c, 128);
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
                        if constexpr (PRE) {
                            put_preact(ch * TC + tl, colw(0, hh, 0), g0, u0);
                            put_preact(ch * TC + tl, colw(0, hh, M - 1), g1, u1);
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
                                    if constexpr (PRE) put_preact(ch * TC + tl, colw(ob, hh, x), v, u);
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
}

// nsplit > 1: the item's sums over its K split j into ws[j][s][col] (PrefillArgs::ws) for
// the tokens the epilogue would store: col an output column (the epilogue's ocol0 + colw),
// a gated item's up rows at R / 2 + col.  Nothing staged: a few items, so few bytes.
template <typename C>
__device__ __forceinline__ void store_partial(const PrefillArgs &p, const WgmmaConsumer &w,
                                              const float (&acc)[C::NACC][C::AN], const int32_t *tok, int64_t row0,
                                              int64_t s0, int j) {
    constexpr int M = C::M, NB = C::NB, ASTRIDE = C::ASTRIDE;
    const bool gated = p.act != SAM_ACT_NONE;
    const int lr = w.warp * 16 + w.g;  // + 8 hh
    float *const ws = p.ws + ((int64_t)j * p.S + s0) * p.R;  // row s0 of split j
    int cb[NB], lim[NB];  // block b's first column (gate or up half; < R < 2**31), its columns before out_cols
#pragma unroll
    for (int b = 0; b < NB; b++) {
        const int64_t ocol = M == 1 ? (gated ? (row0 / 128) * 64 + w.c * 64 : row0 + w.crow + b * 64)
                                    : (gated ? (C::HANDOVER ? row0 : row0 + w.crow) : (row0 + w.crow) * 2 + b * 128);
        cb[b] = (int)((gated ? (C::HANDOVER ? w.c : b) * (p.R / 2) : 0) + ocol);
        lim[b] = (int)min(p.out_cols - ocol, (int64_t)(64 * M));  // (at most the block's 64 M)
    }
#pragma unroll
    for (int jt = 0; jt < C::BN / 8; jt++)
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int ltok = jt * 8 + 2 * w.q + t;
            if (tok[ltok] < 0) continue;
            float *const row = ws + (int64_t)ltok * p.R;
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
#pragma unroll
                    for (int x = 0; x < M; x++) {
                        const int off = (lr + 8 * hh) * M + x;
                        const int set = M == 1 ? 0 : 1 - x;  // M = 2: set 1 holds row 0 of each pair, set 0 row 1
                        if (off < lim[b]) row[cb[b] + off] = acc[b * ASTRIDE + set][4 * jt + 2 * hh + t];
                    }
        }
}

#endif  // SAM_HAS_WGMMA

constexpr int SPLIT_REDUCE_THREADS = 256;

// Split-K's second kernel: CTA s adds sorted row s's partial sums (store_partial) in split
// order 0 .. nsplit - 1 and applies the epilogue (bias, activation, routing scale, one
// rounding to T) to the same rows the epilogue stores: of an expert, with a valid token.
template <typename T>
__global__ void __launch_bounds__(SPLIT_REDUCE_THREADS) ssmm_split_reduce_kernel(const PrefillArgs p) {
    pdl_wait();
    const int64_t s = blockIdx.x;
    if (p.E == 0 || (int64_t)p.offsets[0] > s) return;
    int lo = 0, hi = p.E;  // the expert of row s: the last e < E with offsets[e] <= s
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if ((int64_t)p.offsets[mid] <= s) lo = mid;
        else hi = mid;
    }
    const int e = lo;
    if (row_token(p, s, expert_s_end(p, e)) < 0) return;
    const float sc = p.scale ? p.scale[s] : 1.0f;
    const bool gated = p.act != SAM_ACT_NONE;
    const int64_t up = gated ? p.R / 2 : 0, plane = p.S * p.R;
    const float *const ws = p.ws + s * p.R;
    T *const o = static_cast<T *>(p.out) + s * p.ldo;
    for (int64_t col = threadIdx.x; col < p.out_cols; col += SPLIT_REDUCE_THREADS) {
        float v = ws[col], u = gated ? ws[up + col] : 0.0f;
        for (int j = 1; j < p.nsplit; j++) {
            v += ws[j * plane + col];
            if (gated) u += ws[j * plane + up + col];
        }
        o[col] = Elem<T>::from_f(epilogue_value(p, e, col, gated, up, v, [&] { return u; }) * sc);
    }
}

}  // namespace sam
