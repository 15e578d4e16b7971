// router.cu -- an MoE block's router: logits, scores and the top-k experts of every token
// (the definition is csrc/router_ref.c; the rule is written out at sam_router_params).
//
// Under torch a router is a GEMM launch (DeepSeek-V2's first casts the hidden states
// and its weight to fp32 and runs an FFMA GEMM), a softmax, a top-k (a sort) and one or
// two elementwise launches.  Here it is one or two launches:
//
//   * logits, from RT_TILE_MIN_T tokens (8192 with up to 16 experts): CTA = 8 warps on
//     BM tokens x BE experts (router_tile_kernel), both operands streamed through an
//     ST-stage cp.async ring in 64-column stages, so that every warp of the CTA reads its
//     fragments of the same weight tile from shared memory and a few stages are in flight
//     at once; warp (wm, wn) of a 4 x 2 (or 2 x 4) grid keeps its own tokens x experts over
//     the whole K (ldmatrix fragments, mma.sync m16n8k16; no partial sums to reduce), bias,
//     one rounding.  The tile is the largest that still gives about one CTA per SM.  Where
//     one expert tile holds every expert and a warp's share of the choice is small
//     (rt_tiles), the same CTA then chooses for its tokens from their logits as stored,
//     kept in shared memory: one launch.
//   * logits, fewer tokens: CTA = 8 warps on BE experts x BM tokens (grid: the expert tiles of a token
//     tile launched side by side, so the hidden states come from memory once),
//     the K dimension split over the warps (warp w: 32-column blocks w, w + 8, ...).
//     Lane (g, q) loads 16 bytes of expert rows g, g + 8 and of token g at column 8q of a
//     block straight into the fragments of two mma.sync m16n8k16 (the K permutation of
//     dense_decode.cu: the same for both operands, so the sums are those of x W^T);
//     bf16 / fp16 products are exact in fp32, so an fp32 GEMM on the same values (what
//     DeepSeek-V2's router computes) differs only in the order of the sums.  Two blocks
//     of loads in flight per warp; the eight partial tiles are summed in a fixed order
//     (warp w + 4 into warp w, then warps 0..3), the bias added, one rounding.
//   * selection (rt_choose; in router_select_kernel or the tile kernel): a segment of G
//     lanes per token (at most 8 experts a lane, 32 / G tokens a warp) reads its logits as
//     stored; softmax by segment reductions in a fixed order (or DeepSeek-V3's sigmoid with
//     a bias that only chooses); the group limit, then k rounds of a segment arg-max
//     (largest first, equal values: the lower id) on one 64-bit key per entry (rt_key: the
//     value's bits made unsigned-orderable above the complemented id: two shuffles and a
//     compare a step); the renormalising sum in selection order, as the reference.
//
// Both launch as programmatic dependents: each waits for the kernel before it on the
// stream before reading anything, and lets its own dependent start at once.
#include <math.h>

#include "common.cuh"
#include "ptx_mma.cuh"

namespace sam {
namespace {

constexpr int RT_WARPS = 8, RT_THREADS = 32 * RT_WARPS;
constexpr int RT_SEL_WARPS = 8;
constexpr int RT_TILE_MIN_T = 512;  // tokens from which the logits run on the tile kernel

struct RouterArgs {
    const void *x;
    int64_t ldx;
    int T;
    const void *w;
    int E, H;
    const void *bias;
    sam_dtype bias_dtype;
    const void *choice_bias;
    sam_dtype choice_bias_dtype;
    void *logits;
    sam_dtype logits_dtype;
    int k, mode, n_group, topk_group, renorm;
    float scale;
    int experts_major;  // logits grid: blockIdx.x the expert tile, blockIdx.y the token tile
    void *weights;
    sam_dtype weights_dtype;
    int64_t *ids;
    int sel_lanes;  // the tile kernel's choice (SEL): lanes per token (rt_lanes)
};

// ME: 16-expert m tiles, NT: 8-token n tiles of a CTA.
template <int ME_, int NT_> struct RCfg {
    static constexpr int ME = ME_, NT = NT_, BE = 16 * ME_, BM = 8 * NT_;
};

template <typename Cf> struct RBlock {
    uint4 a[Cf::ME][2];  // expert rows g, g + 8 of each m tile
    uint4 b[Cf::NT];     // token g of each n tile
};

__device__ __forceinline__ uint4 ld_nc16(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

template <typename Cf>
__device__ __forceinline__ void rt_load(RBlock<Cf> &bl, const RouterArgs &p, int e0, int t0, int blk, int g, int q) {
    const int col = 32 * blk + 8 * q;
    const bool cok = col < p.H;
#pragma unroll
    for (int m = 0; m < Cf::ME; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int e = e0 + 16 * m + 8 * h + g;
            const char *src = static_cast<const char *>(p.w) + ((int64_t)e * p.H + col) * 2;
            bl.a[m][h] = cok && e < p.E ? ld_nc16(src) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
    for (int j = 0; j < Cf::NT; j++) {
        const int t = t0 + 8 * j + g;
        const char *src = static_cast<const char *>(p.x) + ((int64_t)t * p.ldx + col) * 2;
        bl.b[j] = cok && t < p.T ? *reinterpret_cast<const uint4 *>(src) : make_uint4(0, 0, 0, 0);
    }
}

template <typename T, typename Cf>
__device__ __forceinline__ void rt_compute(const RBlock<Cf> &bl, float (&acc)[Cf::ME][Cf::NT][4]) {
#pragma unroll
    for (int s = 0; s < 2; s++)
#pragma unroll
        for (int m = 0; m < Cf::ME; m++) {
            const uint4 &lo = bl.a[m][0], &hi = bl.a[m][1];
            const uint32_t a0 = s ? lo.z : lo.x, a1 = s ? hi.z : hi.x;
            const uint32_t a2 = s ? lo.w : lo.y, a3 = s ? hi.w : hi.y;
#pragma unroll
            for (int j = 0; j < Cf::NT; j++) {
                const uint4 &bb = bl.b[j];
                Mma16816<T>::run(acc[m][j], a0, a1, a2, a3, s ? bb.z : bb.x, s ? bb.w : bb.y);
            }
        }
}

// First token and first expert of this CTA's tile (the grid of rt_grid).
__device__ __forceinline__ int rt_tile_token0(const RouterArgs &p, int BM) {
    return (int)(p.experts_major ? blockIdx.y : blockIdx.x) * BM;
}
__device__ __forceinline__ int rt_tile_expert0(const RouterArgs &p, int BE) {
    return (int)(p.experts_major ? blockIdx.x : blockIdx.y) * BE;
}

template <typename T, typename Cf>
__global__ void __launch_bounds__(RT_THREADS, 1) router_logits_kernel(const RouterArgs p) {
    constexpr int ME = Cf::ME, NT = Cf::NT, BE = Cf::BE, BM = Cf::BM, W = RT_WARPS;
    __shared__ float red[W / 2][BE][BM + 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int t0 = rt_tile_token0(p, BM), e0 = rt_tile_expert0(p, BE);
    const int nblk = (p.H + 31) / 32;
    pdl_wait();
    pdl_trigger();
    float acc[ME][NT][4] = {};
    RBlock<Cf> b0, b1;
    if (warp < nblk) rt_load(b0, p, e0, t0, warp, g, q);
#pragma unroll 1
    for (int blk = warp; blk < nblk;) {
        int nx = blk + W;
        if (nx < nblk) rt_load(b1, p, e0, t0, nx, g, q);
        rt_compute<T, Cf>(b0, acc);
        blk = nx;
        if (blk >= nblk) break;
        nx = blk + W;
        if (nx < nblk) rt_load(b0, p, e0, t0, nx, g, q);
        rt_compute<T, Cf>(b1, acc);
        blk = nx;
    }
    // a warp's tile: expert rows 16m + g (+ 8), tokens 8j + 2q (+ 1)
    auto put = [&](int slot) {
#pragma unroll
        for (int m = 0; m < ME; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                red[slot][16 * m + g][8 * j + 2 * q] = acc[m][j][0];
                red[slot][16 * m + g][8 * j + 2 * q + 1] = acc[m][j][1];
                red[slot][16 * m + g + 8][8 * j + 2 * q] = acc[m][j][2];
                red[slot][16 * m + g + 8][8 * j + 2 * q + 1] = acc[m][j][3];
            }
    };
    if (warp >= W / 2) put(warp - W / 2);
    __syncthreads();
    if (warp < W / 2) {
#pragma unroll
        for (int m = 0; m < ME; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                acc[m][j][0] += red[warp][16 * m + g][8 * j + 2 * q];
                acc[m][j][1] += red[warp][16 * m + g][8 * j + 2 * q + 1];
                acc[m][j][2] += red[warp][16 * m + g + 8][8 * j + 2 * q];
                acc[m][j][3] += red[warp][16 * m + g + 8][8 * j + 2 * q + 1];
            }
        __syncwarp();
        put(warp);
    }
    __syncthreads();
    for (int id = tid; id < BE * BM; id += RT_THREADS) {
        const int row = id % BE, tok = id / BE;  // consecutive threads: consecutive experts of a token
        const int e = e0 + row, t = t0 + tok;
        if (e >= p.E || t >= p.T) continue;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < W / 2; w++) v += red[w][row][tok];
        if (p.bias != nullptr) v += load_as_float(p.bias, p.bias_dtype, e);
        const int64_t o = (int64_t)t * p.E + e;
        switch (p.logits_dtype) {
        case SAM_F32: static_cast<float *>(p.logits)[o] = v; break;
        case SAM_BF16: static_cast<__nv_bfloat16 *>(p.logits)[o] = __float2bfloat16_rn(v); break;
        default: static_cast<__half *>(p.logits)[o] = __float2half_rn(v); break;
        }
    }
}

// ---- selection ------------------------------------------------------------------------
//
// A token's entries are held by a segment of G lanes (G a power of two, 1 to 32; 32 / G
// tokens per warp): lane `sub` of the segment holds experts sub + G i, i < PER.  Sums and
// arg-maxes run over the segment by shuffles of width G.

// The order of the choice (larger first, a NaN below every number, equal values by the
// lower id) as one unsigned 64-bit key per entry: the value's bits made
// unsigned-orderable (negative numbers complemented, the sign bit set on the others; -0
// as +0; a NaN 0, below every number) above the complemented id (equal values: the lower
// id is the larger key); 0 is no entry, below every entry.
__device__ __forceinline__ uint64_t rt_key(float v, int id) {
    const uint32_t b = v == 0.0f ? 0u : __float_as_uint(v);
    const uint32_t vk = isnan(v) ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((uint64_t)vk << 32) | (uint64_t)(~(uint32_t)id);
}
__device__ __forceinline__ float rt_key_value(uint64_t key) {
    const uint32_t vk = (uint32_t)(key >> 32);
    return __uint_as_float(vk & 0x80000000u ? vk & 0x7fffffffu : ~vk);  // (a NaN key: a NaN)
}
__device__ __forceinline__ int rt_key_id(uint64_t key) { return (int)~(uint32_t)key; }

__device__ __forceinline__ uint64_t rt_seg_max(uint64_t key, int G) {
    for (int o = G >> 1; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, key, o, G);
        key = other > key ? other : key;
    }
    return key;
}

// The best of (v, id) over the segment (id -1: no entry) into v and id.
__device__ __forceinline__ void rt_best(float &v, int &id, int G) {
    const uint64_t key = rt_seg_max(id < 0 ? 0ull : rt_key(v, id), G);
    v = rt_key_value(key);
    id = key == 0 ? -1 : rt_key_id(key);
}

// The group limit of one token's segment: v[i] (expert sub + G i, open entries) keeps its
// value where its group of E / n_group contiguous experts is among the topk_group best and
// becomes `masked` elsewhere; a group's score is its largest value, or with TOP2 the sum
// of its two largest.  Equal group scores: the lower group first.  row: the token's E
// floats of shared memory; n_group <= G.
template <int PER, bool TOP2>
__device__ __forceinline__ void rt_group_limit(float (&v)[PER], uint32_t open, float *row, int sub, int G, int E,
                                               int n_group, int topk_group, float masked) {
    const int gs = E / n_group;
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (open >> i & 1) row[sub + G * i] = v[i];
    __syncwarp();
    float gv = 0.0f;
    if (sub < n_group) {
        float a = -INFINITY, b = -INFINITY;
        for (int i = 0; i < gs; i++) {
            const float c = row[sub * gs + i];
            if (c > a) b = a, a = c;
            else if (c > b) b = c;
        }
        gv = TOP2 ? a + b : a;
    }
    uint32_t chosen = 0;
    for (int j = 0; j < topk_group; j++) {
        float bv = gv;
        int bi = sub < n_group && !(chosen >> sub & 1) ? sub : -1;
        rt_best(bv, bi, G);
        chosen |= 1u << (bi & 31);
    }
#pragma unroll
    for (int i = 0; i < PER; i++)
        if ((open >> i & 1) && !(chosen >> ((sub + G * i) / gs) & 1)) v[i] = masked;
}

// One token's choice by its segment: v[i] its logits as stored (entry sub + G i, bit i of
// open where that is an expert).  `live`: t < T (a segment past T runs along for the
// shuffles and writes nothing).  PER slots of results per lane: result j at lane j % G,
// slot j / G (k <= E <= G PER).  Every array is indexed by compile-time positions only (no
// local memory): the chosen score is taken where the key matches, and a lane's results
// enter its slots from the back, moved to the front once all are in.
template <int PER>
__device__ __forceinline__ void rt_choose(const RouterArgs &p, int64_t t, bool live, int sub, int G, float (&v)[PER],
                                          uint32_t open, float *row) {
    const int E = p.E;
    if (p.mode == SAM_ROUTER_SOFTMAX_TOPK) {
        float m = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (open >> i & 1) m = fmaxf(m, v[i]);
        for (int o = G >> 1; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o, G));
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (open >> i & 1) s += (v[i] = expf(v[i] - m));
        for (int o = G >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, G);
#pragma unroll
        for (int i = 0; i < PER; i++) v[i] /= s;
        if (p.n_group > 1) rt_group_limit<PER, false>(v, open, row, sub, G, E, p.n_group, p.topk_group, 0.0f);
    }
    float pv[PER] = {};  // SIGMOID_TOPK: the scores (v holds the choice values)
    if (p.mode == SAM_ROUTER_SIGMOID_TOPK) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int e = sub + G * i;
            pv[i] = 1.0f / (1.0f + expf(-v[i]));
            v[i] = pv[i] + (p.choice_bias != nullptr && e < E ? load_as_float(p.choice_bias, p.choice_bias_dtype, e)
                                                               : 0.0f);
        }
        if (p.n_group > 1)
            rt_group_limit<PER, true>(v, open, row, sub, G, E, p.n_group, p.topk_group, -INFINITY);
    }
    float mine[PER], tot = 0.0f, first = 0.0f;
    int mine_id[PER];
    uint64_t key[PER];  // the open entries' keys (0 once taken or past E)
#pragma unroll
    for (int i = 0; i < PER; i++) key[i] = (open >> i & 1) ? rt_key(v[i], sub + G * i) : 0ull;
    int held = 0;  // results this lane holds, in mine[PER - held ..]
    for (int j = 0; j < p.k; j++) {
        float bv = 0.0f, sv = 0.0f;  // sv: SIGMOID_TOPK, the chosen expert's score on its lane
        int bi = -1;
        uint64_t best = key[0];
#pragma unroll
        for (int i = 1; i < PER; i++) best = key[i] > best ? key[i] : best;
        best = rt_seg_max(best, G);  // k <= E: an open entry is left (0 only past T)
        bv = rt_key_value(best);
        bi = rt_key_id(best);
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const bool hit = key[i] == best;
            sv = hit ? pv[i] : sv;
            key[i] = hit ? 0ull : key[i];
        }
        if (j == 0) first = bv;
        if (p.mode == SAM_ROUTER_TOPK_SOFTMAX) bv = expf(bv - first);
        if (p.mode == SAM_ROUTER_SIGMOID_TOPK) bv = __shfl_sync(0xffffffffu, sv, bi & (G - 1), G);
        tot += bv;
        if (sub == (j & (G - 1))) {  // result j: this lane's next slot
#pragma unroll
            for (int s = 0; s + 1 < PER; s++) mine[s] = mine[s + 1], mine_id[s] = mine_id[s + 1];
            mine[PER - 1] = bv;
            mine_id[PER - 1] = bi;
            held++;
        }
    }
    if (!live) return;
    for (int r = held; r < PER; r++) {  // the first result to slot 0
#pragma unroll
        for (int s = 0; s + 1 < PER; s++) mine[s] = mine[s + 1], mine_id[s] = mine_id[s + 1];
    }
#pragma unroll
    for (int s = 0; s < PER; s++) {
        const int j = s * G + sub;
        if (j >= p.k) break;
        float w = mine[s];
        if (p.mode == SAM_ROUTER_TOPK_SOFTMAX || p.renorm) w /= p.mode == SAM_ROUTER_SIGMOID_TOPK ? tot + 1e-20f : tot;
        w *= p.scale;
        const int64_t o = t * p.k + j;
        switch (p.weights_dtype) {
        case SAM_F32: static_cast<float *>(p.weights)[o] = w; break;
        case SAM_BF16: static_cast<__nv_bfloat16 *>(p.weights)[o] = __float2bfloat16_rn(w); break;
        default: static_cast<__half *>(p.weights)[o] = __float2half_rn(w); break;
        }
        p.ids[o] = mine_id[s];
    }
}

// Lanes per token: the power of two that leaves at most 8 experts per lane and holds
// n_group lanes (the group scores); 32 from 257 experts (up to 16 per lane).
inline int rt_lanes(int E, int n_group) {
    int g = 1;
    while (g < 32 && (g * 8 < E || g < n_group)) g *= 2;
    return g;
}

// PER: entries per lane (E <= G PER).  CTA = RT_SEL_WARPS warps of 32 / G tokens each.
template <int PER>
__global__ void __launch_bounds__(32 * RT_SEL_WARPS) router_select_kernel(const RouterArgs p, int G) {
    __shared__ float sc[RT_SEL_WARPS][32 * PER];  // the group limit's rows: E floats per token
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane & (G - 1);
    const int64_t t0 = ((int64_t)blockIdx.x * RT_SEL_WARPS + warp) * (32 / G), t = t0 + (lane >> (__ffs(G) - 1));
    pdl_wait();
    pdl_trigger();
    if (t0 >= p.T) return;
    const bool live = t < p.T;
    float v[PER];
    uint32_t open = 0;  // bit i: entry sub + G i is an expert not taken yet
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = sub + G * i;
        const bool ok = live && e < p.E;
        v[i] = ok ? load_as_float(p.logits, p.logits_dtype, t * p.E + e) : 0.0f;
        if (ok) open |= 1u << i;
    }
    rt_choose<PER>(p, t, live, sub, G, v, open, sc[warp] + (lane / G) * (G * PER));
}

// ---- the tile kernel -----------------------------------------------------------------
//
// BM tokens x BE experts per CTA, WM x (8 / WM) warps; stage = BM token rows and BE
// expert rows of 64 columns (128 bytes each, 16-byte chunks XOR-swizzled by row so that
// the eight rows of an ldmatrix phase hit eight bank groups).
template <int BM_, int BE_, int WM_> struct RTile {
    static constexpr int BM = BM_, BE = BE_, WM = WM_, WN = RT_WARPS / WM_;
    static constexpr int MI = BM / WM / 16, NI = BE / WN / 8;  // m16 token tiles, n8 expert tiles of a warp
    static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && BM % 32 == 0 && BE % 32 == 0, "router tile");
    static constexpr int X_BYTES = BM * 128, STAGE = (BM + BE) * 128;
    static constexpr int ST = 160 * 1024 / STAGE < 8 ? 160 * 1024 / STAGE : 8;
    static constexpr int SMEM = ST * STAGE + 128;  // + alignment
};

__device__ __forceinline__ uint32_t rt_sw(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }

__device__ __forceinline__ float round_as(sam_dtype t, float v) {
    switch (t) {
    case SAM_BF16: return __bfloat162float(__float2bfloat16_rn(v));
    case SAM_F16: return __half2float(__float2half_rn(v));
    default: return v;
    }
}

// SEL (E <= BE, one expert tile): the choice of the tile's tokens too, from their logits as
// stored, kept in shared memory (rt_choose; p.sel_lanes lanes per token).
template <typename T, typename Cf, bool SEL>
__global__ void __launch_bounds__(RT_THREADS, 1) router_tile_kernel(const RouterArgs p) {
    constexpr int BM = Cf::BM, BE = Cf::BE, ST = Cf::ST, MI = Cf::MI, NI = Cf::NI;
    static_assert(Cf::SMEM - 128 >= BM * (BE + 32) * 4, "the logits tile of the choice");
    extern __shared__ unsigned char rt_smem_raw[];
    const uint32_t s0 = (smem_u32(rt_smem_raw) + 127u) & ~127u;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int t0 = rt_tile_token0(p, BM), e0 = rt_tile_expert0(p, BE);
    const int KT = (p.H + 63) / 64;
    pdl_wait();
    pdl_trigger();
    // copy plan: thread -> 16-byte chunk tid % 8 of rows tid / 8 + 32 i (H % 8 == 0: a chunk is
    // wholly inside or past the columns; rows past T or E and columns past H are zero-filled)
    const int ch = tid & 7, r0 = tid >> 3;
    auto load = [&](int kt, int st) {
        const uint32_t base = s0 + st * Cf::STAGE;
        const int col = kt * 64 + ch * 8;
        const bool cok = col < p.H;
#pragma unroll
        for (int i = 0; i < BM / 32; i++) {
            const int r = r0 + 32 * i, t = t0 + r;
            const bool ok = cok && t < p.T;
            const char *src = static_cast<const char *>(p.x) + (ok ? ((int64_t)t * p.ldx + col) * 2 : 0);
            cp_async16(base + rt_sw(r, ch), src, ok);
        }
#pragma unroll
        for (int i = 0; i < BE / 32; i++) {
            const int r = r0 + 32 * i, e = e0 + r;
            const bool ok = cok && e < p.E;
            const char *src = static_cast<const char *>(p.w) + (ok ? ((int64_t)e * p.H + col) * 2 : 0);
            cp_async16(base + Cf::X_BYTES + rt_sw(r, ch), src, ok);
        }
    };
    float acc[MI][NI][4] = {};
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < KT) load(s, s);
        cp_async_commit();
    }
    const int wm = warp / Cf::WN, wn = warp % Cf::WN;
    const int m0 = wm * (BM / Cf::WM), n0 = wn * (BE / Cf::WN);
#pragma unroll 1
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<ST - 2>();  // k-tile kt has landed (this thread's copies) ...
        __syncthreads();          // ... everyone's, and k-tile kt - 1's stage is read by no one
        if (kt + ST - 1 < KT) load(kt + ST - 1, (kt + ST - 1) % ST);
        cp_async_commit();
        const uint32_t xa = s0 + (kt % ST) * Cf::STAGE, wa = xa + Cf::X_BYTES;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t a[MI][4], b[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {  // matrices: rows 0-7 / 8-15 of k 0-7, then of k 8-15
                const int r = m0 + mi * 16 + (lane & 15);
                ldmatrix_x4(xa + rt_sw(r, kk * 2 + (lane >> 4)), a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
            }
#pragma unroll
            for (int ni = 0; ni < NI; ni += 2) {  // matrices: experts 0-7 at k 0-7 / 8-15, then 8-15
                const int j = lane >> 3, r = n0 + ni * 8 + (j >> 1) * 8 + (lane & 7);
                ldmatrix_x4(wa + rt_sw(r, kk * 2 + (j & 1)), b[ni][0], b[ni][1], b[ni + 1][0], b[ni + 1][1]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++)
                    Mma16816<T>::run(acc[mi][ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[ni][0], b[ni][1]);
        }
    }
    cp_async_wait<0>();
    // SEL: the logits tile, as stored, in shared memory (rows of BE + G floats: the G-lane
    // segments of a warp read TPW rows on distinct banks)
    const int G = SEL ? p.sel_lanes : 32, LDS = BE + G;
    float *tile = reinterpret_cast<float *>(rt_smem_raw + (s0 - smem_u32(rt_smem_raw)));
    if (SEL) __syncthreads();  // every warp is done with the ring
    // thread (g, q) holds tokens m0 + 16 mi + g (+ 8) x experts n0 + 8 ni + 2q (+ 1)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int el = n0 + ni * 8 + 2 * q + c, e = e0 + el;
            if (e >= p.E) continue;
            const float bz = p.bias != nullptr ? load_as_float(p.bias, p.bias_dtype, e) : 0.0f;
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int tl = m0 + mi * 16 + g + 8 * h, t = t0 + tl;
                    const float v = acc[mi][ni][2 * h + c] + bz;
                    if (t < p.T) store_from_float(p.logits, p.logits_dtype, (int64_t)t * p.E + e, v);
                    if (SEL) tile[tl * LDS + el] = round_as(p.logits_dtype, v);
                }
        }
    if constexpr (SEL) {
        __syncthreads();
        const int tpw = 32 / G, sub = lane & (G - 1);
        for (int base = warp * tpw; base < BM && t0 + base < p.T; base += RT_WARPS * tpw) {
            const int tl = base + lane / G;
            const int64_t t = t0 + tl;
            const bool live = t < p.T;
            float v[8];
            uint32_t open = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int e = sub + G * i;
                const bool ok = live && e < p.E;
                v[i] = ok ? tile[tl * LDS + e] : 0.0f;
                if (ok) open |= 1u << i;
            }
            rt_choose<8>(p, t, live, sub, G, v, open, tile + tl * LDS);
        }
    }
}

// The grid over token tiles of BM and expert tiles of BE (rt_tile_token0 / rt_tile_expert0),
// with b.experts_major set: the expert tiles of a token tile side by side in launch order, so
// that the hidden states are read from memory once and from L2 by the other tiles (grid.y
// allows 65535).
inline dim3 rt_grid(const RouterArgs &a, int BM, int BE, RouterArgs &b) {
    const unsigned tt = (unsigned)((a.T + BM - 1) / BM), et = (unsigned)((a.E + BE - 1) / BE);
    b = a;
    b.experts_major = et > 1 && tt <= 65535;
    return b.experts_major ? dim3(et, tt) : dim3(tt, et);
}

template <typename T, int ME, int NT> sam_status rt_launch(const RouterArgs &a, cudaStream_t stream) {
    using Cf = RCfg<ME, NT>;
    RouterArgs b;
    const dim3 grid = rt_grid(a, Cf::BM, Cf::BE, b);
    SAM_CUDA_TRY(launch_kernel(router_logits_kernel<T, Cf>, grid, dim3(RT_THREADS), 0, stream, pdl_enabled(), b),
                 "router");
    return launch_status("router");
}

// sel: the tile kernel chooses too (a.E <= BE), on G lanes per token (rt_lanes).
template <typename T, int BM, int BE, int WM>
sam_status rt_tile(const RouterArgs &a, cudaStream_t stream, bool sel, int G) {
    using Cf = RTile<BM, BE, WM>;
    RouterArgs b;
    const dim3 grid = rt_grid(a, BM, BE, b);
    b.sel_lanes = G;
    auto kernel = sel ? router_tile_kernel<T, Cf, true> : router_tile_kernel<T, Cf, false>;
    SAM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cf::SMEM), "router");
    SAM_CUDA_TRY(launch_kernel(kernel, grid, dim3(RT_THREADS), Cf::SMEM, stream, pdl_enabled(), b), "router");
    return launch_status("router");
}

// The tile kernel's tokens per CTA: the largest of 128, 64, 32 that gives at least three
// quarters of a CTA per SM (fewer tokens per CTA read the weight tile more often); 32-token
// tiles take 64 experts (a 2 x 4 grid of warps needs two n8 tiles a warp).  It chooses too
// (`chose`) where one expert tile holds every expert and its warps take at most two turns
// of 32 / G tokens each: more turns on 8 warps a CTA cost more than a selection kernel
// (docs/KERNELS.md, "Router, dense decode, gated activation").
template <typename T, int BE>
sam_status rt_tiles(const RouterArgs &a, cudaStream_t stream, bool &chose) {
    const int64_t et = (a.E + BE - 1) / BE, sms = device_sm_count() > 0 ? device_sm_count() : 132;
    auto enough = [&](int bm) { return 4 * ((a.T + bm - 1) / bm) * et >= 3 * sms; };
    const int G = rt_lanes(a.E, a.n_group);
    auto sel = [&](int bm, int be) { return chose = a.E <= be && bm * G <= 2 * 32 * RT_WARPS; };
    if (enough(128)) return rt_tile<T, 128, BE, 4>(a, stream, sel(128, BE), G);
    if (enough(64)) return rt_tile<T, 64, BE, 4>(a, stream, sel(64, BE), G);
    constexpr int BE32 = BE < 64 ? 64 : BE;
    return rt_tile<T, 32, BE32, 2>(a, stream, sel(32, BE32), G);
}

// The selection kernel: 32 / G tokens per warp (G = rt_lanes).
template <int PER> sam_status rt_select(const RouterArgs &a, cudaStream_t stream) {
    const int G = rt_lanes(a.E, a.n_group);
    const unsigned grid = (unsigned)((a.T + RT_SEL_WARPS * (32 / G) - 1) / (RT_SEL_WARPS * (32 / G)));
    SAM_CUDA_TRY(launch_kernel(router_select_kernel<PER>, dim3(grid),
                               dim3(32 * RT_SEL_WARPS), 0, stream, pdl_enabled(), a, G),
                 "router");
    return launch_status("router");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_router_cuda(const sam_router_params *p, void *stream) {
    using namespace sam;
    if (!tc_dtype_ok(p->dtype, "router")) return SAM_STATUS_UNSUPPORTED;
    auto half_or_f32 = [&](sam_dtype t) { return t == SAM_F32 || t == p->dtype; };
    if (!half_or_f32(p->logits_dtype) || !half_or_f32(p->weights_dtype) ||
        (p->bias != nullptr && !half_or_f32(p->bias_dtype)) ||
        (p->choice_bias != nullptr && !half_or_f32(p->choice_bias_dtype))) {
        set_error("router: logits, weights, bias and choice_bias are float32 or x's dtype");
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->T < 0 || p->T > INT32_MAX - 64 || p->E < 1 || p->E > SAM_ROUTER_MAX_EXPERTS || p->H < 0 ||
        p->H > INT32_MAX - 64 || p->k < 1 || p->k > p->E || p->k > SAM_ROUTER_MAX_K || p->n_group < 1 ||
        p->n_group > SAM_ROUTER_MAX_GROUPS || p->E % p->n_group != 0 || p->topk_group < 1 ||
        p->topk_group > p->n_group || p->mode < SAM_ROUTER_SOFTMAX_TOPK || p->mode > SAM_ROUTER_SIGMOID_TOPK ||
        (p->mode == SAM_ROUTER_TOPK_SOFTMAX && p->n_group != 1) ||
        (p->mode == SAM_ROUTER_SIGMOID_TOPK && p->n_group > 1 && p->E / p->n_group < 2)) {
        set_error("router: T = %lld, E = %lld, H = %lld, k = %d, mode = %d, n_group = %d, topk_group = %d out of "
                  "range", (long long)p->T, (long long)p->E, (long long)p->H, p->k, p->mode, p->n_group,
                  p->topk_group);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const uintptr_t mis = (reinterpret_cast<uintptr_t>(p->x) | reinterpret_cast<uintptr_t>(p->w)) & 15u;
    if (p->H % 8 != 0 || p->ldx % 8 != 0 || mis != 0) {
        set_error("router: the GPU kernel needs H and x's row stride multiples of 8 and x, w at 16-byte aligned "
                  "addresses (H = %lld, ldx = %lld)", (long long)p->H, (long long)p->ldx);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (p->T == 0) return SAM_STATUS_OK;
    RouterArgs a;
    a.x = p->x;
    a.ldx = p->ldx;
    a.T = (int)p->T;
    a.w = p->w;
    a.E = (int)p->E;
    a.H = (int)p->H;
    a.bias = p->bias;
    a.bias_dtype = p->bias_dtype;
    a.choice_bias = p->mode == SAM_ROUTER_SIGMOID_TOPK ? p->choice_bias : nullptr;
    a.choice_bias_dtype = p->choice_bias_dtype;
    a.logits = p->logits;
    a.logits_dtype = p->logits_dtype;
    a.k = p->k;
    a.mode = p->mode;
    a.n_group = p->n_group;
    a.topk_group = p->topk_group;
    a.renorm = p->renorm;
    a.scale = p->scale;
    a.experts_major = 0;
    a.weights = p->weights;
    a.weights_dtype = p->weights_dtype;
    a.ids = p->ids;
    a.sel_lanes = 32;
    cudaStream_t s = (cudaStream_t)stream;
    // (up to 16 experts the split-K kernel keeps more bytes in flight below 8192 tokens)
    const bool tiles = a.T >= RT_TILE_MIN_T && (a.E > 16 || a.T >= 8192);
    bool fused = false;  // the tile kernel chose
    const sam_status st = with_tc_dtype(p->dtype, [&](auto t) {
        using T = decltype(t);
        if (tiles) {
            if (a.E <= 32) return rt_tiles<T, 32>(a, s, fused);
            if (a.E <= 64) return rt_tiles<T, 64>(a, s, fused);
            return rt_tiles<T, 128>(a, s, fused);
        }
        // few tokens: 16-expert tiles over many CTAs; else 32 tokens by up to 64 experts
        if (a.T <= 8) return rt_launch<T, 1, 1>(a, s);
        if (a.T <= 16) return rt_launch<T, 1, 2>(a, s);
        if (a.E <= 16) return rt_launch<T, 1, 4>(a, s);
        if (a.E <= 32 || a.T <= 1024) return rt_launch<T, 2, 4>(a, s);
        return rt_launch<T, 4, 4>(a, s);
    });
    if (st != SAM_STATUS_OK || fused) return st;
    return a.E <= 256 ? rt_select<8>(a, s) : rt_select<16>(a, s);
}
