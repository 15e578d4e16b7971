// ssmm_ws.cuh -- the warp-specialised Hopper kernel of ssmm (wgmma.mma_async.sp,
// sm_90a).  Included by ssmm.cu inside its namespace: it shares KParams, store_tile,
// cta_work and the shared-memory swizzles of the other two kernels there.
//
// Computes what every ssmm kernel computes (csrc/ssmm_ref.c):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
//
// CTA = 3 warpgroups.  Warpgroup 0 is the producer: one elected thread streams the
// packed values and the 2:4 metadata of the tile with TMA (cp.async.bulk.tensor,
// completing on the stage's `full` mbarrier by transaction bytes), and all 128
// threads gather the BN = 128 token rows of the tile straight from x by index
// with cp.async (TMA cannot gather rows on sm_90), each thread ending its stage
// with cp.async.mbarrier.arrive.noinc, so a stage is marked full by the hardware
// the moment its bytes have landed and the producer never waits on its own
// copies: it only waits for a free stage (`empty`).  Warpgroups 1 and 2 are
// consumers: they wait on `full`, load the k-tile's metadata words into registers
// and issue its wgmma.sp with both operands read by the tensor cores from shared
// memory through descriptors (the packed values in the 64-byte swizzle TMA wrote,
// the tokens in the 128-byte swizzle), keep one k-tile of wgmmas in flight,
// and arrive on the `empty` mbarrier of a stage once the wgmmas that read it are
// done.  No CTA-wide barrier inside the main loop; setmaxnreg gives the
// consumers 216 registers and the producer 72.
//
// Tiles (BK = 64 dense columns per stage, NB m64 blocks per consumer):
//   2:4 (M = 1):     BM = 256 storage rows (each consumer 2 x m64) x 128 tokens,
//                    6 stages of 34 KB; 128 fp32 accumulators per thread.
//   1:M:V (M = 2):   BM = 128 storage rows (each consumer 1 x m64, 2 accumulator
//                    sets) x 128 tokens, 8 stages of 26 KB.
// The taller 2:4 tile halves the token bytes per issued FLOP against 128 x 128.
// With the weights by TMA and the stages marked full by the copies themselves it
// runs 1.5-1.6x the single-role kernel for 2:4 and 1.15x for 1:2:128 on an H100
// (docs/PERFORMANCE.md, v7); auto runs it for both.
//
// Row selection as in the other kernels: M accumulator sets per condensed row;
// wgmma writes set 0; at every V boundary the warpgroup drains its wgmmas and
// swaps set 0 with the set of the newly selected row (register selects).
#pragma once

// Tensor maps of one launch (host: ws_tensor_maps in ssmm.cu): the packed values
// as [E][rp][cp/2] elements, boxes of BMT rows x 32 values (64 bytes, 64-byte
// swizzle: the K-major layout wgmma reads through smem_desc_sw64), and the metadata as
// [E][rp/16][cp/2] words, boxes of BMT/16 row tiles x (KS x 16) words.
struct WsMaps {
    CUtensorMap a, meta;
};

#ifdef SAM_HAS_WGMMA
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Expects `bytes` more transaction bytes on the barrier and arrives once.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on the barrier when every cp.async this thread issued so far has
// landed; .noinc: the arrival is one of the counted ones.
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// 3-d TMA tile load global -> shared, completing on `bar` by its byte count.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif

template <int M_> struct WsCfg {
    static constexpr int M = M_;
    static constexpr int NB = M == 1 ? 2 : 1;          // m64 blocks per consumer warpgroup
    static constexpr int BMW = 64 * NB;                // storage rows per consumer
    static constexpr int BMT = 2 * BMW;                // storage rows per CTA
    static constexpr int BN = 128, BK = 64, KS = BK / 32;
    static constexpr int THREADS = 384, PTHREADS = 128;
    // registers per thread after setmaxnreg (128 * PREGS + 256 * CREGS <= 384 * 168)
    static constexpr int PREGS = M == 1 ? 72 : 64, CREGS = M == 1 ? 216 : 216;
    static constexpr int A_BYTES = BMT * 64;           // BK/2 packed values x 2 bytes per row
    static constexpr int B_BYTES = BN * 128;
    static constexpr int META_BYTES = (BMT / 16) * KS * 64;
    static constexpr int IDX_BYTES = M > 1 ? BMT : 0;
    static constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + META_BYTES + IDX_BYTES + 1023) / 1024 * 1024;
    static constexpr int ST = M == 1 ? 6 : 8;          // stages
    static constexpr int PIPE_BYTES = ST * STAGE_BYTES;
    static constexpr int FS = BMT * M + 4;             // fp32 epilogue tile row stride
    static constexpr int EPI_BYTES = BN * FS * 4;
    static constexpr int MAIN_BYTES = PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES;
    static constexpr int BAR_OFF = MAIN_BYTES;         // 2 x ST mbarriers
    static constexpr int TOK_OFF = BAR_OFF + 2 * ST * 8;
    static constexpr int SMEM = TOK_OFF + BN * 4 + 1024;  // + alignment slack
    // A (TMA, 64-byte swizzle, read by smem_desc_sw64): rows of 64 bytes; B: rows of
    // 128 bytes in the 128-byte swizzle (smem_desc_sw128)
    static __device__ __forceinline__ uint32_t b_off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, 1) ssmm_ws_kernel(const KParams p, const __grid_constant__ WsMaps tm) {
#ifdef SAM_HAS_WGMMA
    constexpr int M = C::M, NB = C::NB, BMW = C::BMW, BMT = C::BMT, BN = C::BN, BK = C::BK, KS = C::KS,
                  ST = C::ST, PT = C::PTHREADS;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char *smem = align_smem(smem_raw);
    int32_t *tok_s = reinterpret_cast<int32_t *>(smem + C::TOK_OFF);
    const uint32_t bar0 = smem_u32(smem + C::BAR_OFF);
    auto full_bar = [&](int s) { return bar0 + 8u * s; };
    auto empty_bar = [&](int s) { return bar0 + 8u * (ST + s); };
    const int tid = threadIdx.x;

    int e, rt;
    int64_t s0;
    if (!cta_work<BN, C::THREADS>(p, tok_s, e, rt, s0)) return;
    const int64_t row0 = (int64_t)rt * BMT;
    const int KT = (int)(p.cp / BK);
    const int kt_per_slice = M > 1 ? p.V / BK : 1;
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(full_bar(s), PT + 1);  // 128 cp.async arrivals + the TMA thread's expect_tx
            mbar_init(empty_bar(s), 2 * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tma_prefetch_map(&tm.a);
        tma_prefetch_map(&tm.meta);
    }
    __syncthreads();
    auto stage_ptr = [&](int st) { return smem + st * C::STAGE_BYTES; };

    const int wg = tid / 128;
    if (wg == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<C::PREGS>();
        const T *x = static_cast<const T *>(p.x);
        // B: 128 token rows x 8 chunks; thread -> chunk tid % 8, rows tid / 8 + 16 i
        constexpr int B_CH = BN * 8 / PT;
        const int b_row = tid / 8, b_ch = tid % 8;
        const T *b_src[B_CH];
        unsigned b_ok = 0;
#pragma unroll
        for (int i = 0; i < B_CH; i++) {
            const int t = tok_s[b_row + 16 * i];
            b_ok |= (unsigned)(t >= 0) << i;
            b_src[i] = x + (t >= 0 ? (int64_t)t * p.ldx + b_ch * 8 : 0);
        }
        uint32_t b_dst[B_CH];
#pragma unroll
        for (int i = 0; i < B_CH; i++) b_dst[i] = C::A_BYTES + C::b_off(b_row + 16 * i, b_ch);
        // row-selection indices (1:M:V): BMT bytes in 16-byte chunks
        const uint8_t *idxg = M > 1 ? p.idx + (int64_t)e * p.slices * p.rp : nullptr;
        const bool i_load = M > 1 && tid < BMT / 16;
        const bool i_ok = i_load && row0 + tid * 16 < p.rp;
        const uint8_t *i_src = M > 1 ? idxg + (i_ok ? row0 + tid * 16 : 0) : nullptr;
        constexpr uint32_t TX = C::A_BYTES + C::META_BYTES;

        for (int kt = 0; kt < KT; kt++) {
            const int s = kt % ST;
            if (kt >= ST) mbar_wait(empty_bar(s), ((kt / ST) - 1) & 1);
            const uint32_t base = smem_u32(stage_ptr(s));
            if (tid == 0) {
                mbar_arrive_expect_tx(full_bar(s), TX);
                tma_load_3d(base, &tm.a, kt * (BK / 2), (int)row0, e, full_bar(s));
                tma_load_3d(base + C::A_BYTES + C::B_BYTES, &tm.meta, kt * KS * 16, (int)(row0 / 16), e,
                            full_bar(s));
            }
            const int col = kt * BK + b_ch * 8;
            const bool col_ok = col < p.C;
#pragma unroll
            for (int i = 0; i < B_CH; i++) {
                const bool ok = col_ok && ((b_ok >> i) & 1);
                cp_async16(base + b_dst[i], ok ? b_src[i] + kt * BK : x, ok);
            }
            if (M > 1 && i_load)
                cp_async16(base + C::A_BYTES + C::B_BYTES + C::META_BYTES + tid * 16,
                           i_src + (int64_t)(kt / kt_per_slice) * p.rp, i_ok);
            cp_async_mbar_arrive(full_bar(s));
        }
        cp_async_wait<0>();
        named_barrier_sync(1, C::THREADS);  // the consumers saw every stage full: all copies have landed
        return;                             // the consumers write the tile
    }
    // ---------------- consumers ----------------
    setmaxnreg_inc<C::CREGS>();
    const int c = wg - 1, ctid = tid - 128, warp = (tid >> 5) & 3, lane = tid & 31;  // warp of its warpgroup
    const int g = lane >> 2, q = lane & 3;
    // M = 1: two m64 blocks, M = 2: two accumulator sets.  What wgmma writes is
    // not zero-filled: the first k-tile's wgmmas start from zero (scale-d = 0), so no
    // ordinary instruction defines an accumulator while wgmmas are in flight.
    float acc[2][64];
    // M > 1: the first slice boundary swaps sets before any wgmma, so every set starts at zero
    constexpr bool zero_init = M > 1;
#pragma unroll
    for (int a = 0; a < 2; a++)
        if (a >= NB || zero_init)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[a][i] = 0.0f;
    uint32_t perm[2] = {identity_perm<M>(), identity_perm<M>()};
    uint32_t ef[2][NB][KS];
    const int crow = c * BMW;  // first storage row of this consumer

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
    auto select_rows = [&](int st) {
        const uint8_t *idx_s = stage_ptr(st) + C::A_BYTES + C::B_BYTES + C::META_BYTES;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const uint32_t want = idx_s[crow + warp * 16 + g + 8 * hh];
            select_row_set<M, 16>([&](int a, int j, int k) -> float & { return acc[a][4 * j + k]; }, perm[hh], want, hh);
        }
    };
    auto step = [&](auto par_c, int kt) {
        constexpr int par = decltype(par_c)::value;
        const int st = kt % ST;
        mbar_wait(full_bar(st), (kt / ST) & 1);
        fence_proxy_async();  // the token rows came through the generic proxy (cp.async)
        load_meta(par_c, st);
        if (M > 1 && kt % kt_per_slice == 0) {
            wgmma_wait<0>();
#pragma unroll
            for (int a = 0; a < 2; a++) fence_regs(acc[a]);
            select_rows(st);
#pragma unroll
            for (int a = 0; a < 2; a++) fence_regs(acc[a]);
        }
        const uint32_t sa = smem_u32(stage_ptr(st)), sb = sa + C::A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                WgmmaSpSS<T>::run(acc[b], smem_desc_sw64(sa + (crow + b * 64) * 64 + ks * 32),
                                  smem_desc_sw128(sb + ks * 64), ef[par][b][ks], zero_init || kt > 0 || ks > 0);
        wgmma_commit();
        wgmma_wait<1>();
        if (kt > 0) mbar_arrive(empty_bar((kt - 1) % ST));
    };
    for (int kt = 0; kt < KT; kt += 2) {  // KT is even: columns are padded to 128
        step(std::integral_constant<int, 0>{}, kt);
        step(std::integral_constant<int, 1>{}, kt + 1);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int a = 0; a < 2; a++) fence_regs(acc[a]);
    if (KT == 0) {  // no columns: nothing was accumulated
#pragma unroll
        for (int a = 0; a < NB; a++)
#pragma unroll
            for (int i = 0; i < 64; i++) acc[a][i] = 0.0f;
    }
    named_barrier_sync(1, C::THREADS);  // all copies landed, all wgmmas done: the ring becomes the fp32 tile

    // ---- epilogue: accumulators -> fp32 tile [BN][FS] -> store_tile (ssmm.cu)
    constexpr int FS = C::FS;
    float *ftile = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int lrow = crow + b * 64 + warp * 16 + g + 8 * hh;
#pragma unroll
            for (int a = 0; a < M; a++) {
                const float *src = acc[M == 1 ? b : a];
                const int col = lrow * M + (int)((perm[hh] >> (4 * a)) & 15u);
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const int ltok = j * 8 + 2 * q;
                    ftile[ltok * FS + col] = src[4 * j + 2 * hh];
                    ftile[(ltok + 1) * FS + col] = src[4 * j + 2 * hh + 1];
                }
            }
        }
    named_barrier_sync(2, 256);
    store_tile<T, M, BMT, BN, 256, FS>(p, ftile, tok_s, e, row0, s0, ctid);
#else
    (void)p;
    __trap();
#endif
}
