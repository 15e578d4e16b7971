// ssmm.cu -- grouped sparse-sparse matmul on Sparse Tensor Cores: the checks and the
// one rule that picks a kernel (sam_ssmm_cuda).  Every kernel computes, for every
// expert e and sorted row s of e (csrc/ssmm_ref.c, the definition):
//     out[s] = act(x[token_ids[s]] @ W_e^T + bias_e) * scale[s]
// with W_e in the Samoyeds format (samoyeds_layout.h), fp32 accumulation.
//
//   ssmm_decode.cu     few routed rows: split K, bound by reading the weights once
//   ssmm_wgmma_sp.cu   sm_90a: warp-specialised wgmma.sp, weights by TMA, persistent grid
//   ssmm_mma_sp.cu     everything else (sm_80 and later): mma.sp
// docs/KERNELS.md has the measurements behind each choice.
#include <algorithm>

#include "common.cuh"
#include "ssmm_kernels.h"

namespace sam {
namespace {

// What the rule needs to know of the device (queried by sam_ssmm_cuda).
struct SsmmDevice {
    bool wgmma_sp;  // ssmm_wgmma_sp_available(): sm_90, sm_90a code, a tensor-map encoder
    int sms;        // streaming multiprocessors (0: unknown)
};

// What runs: the kernel, and for wgmma.sp its 1:2:V tile, token rows and K splits.
struct SsmmChoice {
    sam_impl impl;
    sam_tile tile;
    sam_token_rows rows;
    int nsplit;
};

// 1:2:V's tile on the wgmma.sp kernel, where cfg leaves it to the rule (docs/KERNELS.md,
// "1:2:V tiles"): 256 x 64 on gathered token rows (half the gathered bytes per FLOP); on
// rows by TMA 256 x 96 where each routed expert averages at least 256 rows, it pads no
// more work than 128 x 128 and its items fill the SMs; else 256 x 64 where it pads at
// least 3 % less work than 128 x 128 and its items fill the SMs; else 128 x 128.
sam_tile tall_tile(const sam_ssmm_params *ps, bool tokens_by_tma, int sms) {
    if (!tokens_by_tma) return SAM_TILE_256X64;
    const double S = (double)ps->S, routed = (double)std::min<int64_t>(ps->d.E, ps->S), n = (double)sms;
    const double rt_tall = (double)ceil_div(ps->d.rp, 256), rt_128 = (double)ceil_div(ps->d.rp, 128);
    const double work_tall = rt_tall * 256.0 * (S + 32.0 * routed), work_128 = rt_128 * 128.0 * (S + 64.0 * routed);
    const double work_96 = rt_tall * 256.0 * (S + 48.0 * routed), items_96 = rt_tall * (S / 96.0 + routed / 2.0);
    if (S >= 256.0 * routed && work_96 <= work_128 && items_96 >= n) return SAM_TILE_256X96;
    const double items_tall = rt_tall * (S / 64.0 + routed / 2.0);
    return work_tall < 0.97 * work_128 && items_tall >= n ? SAM_TILE_256X64 : SAM_TILE_128X128;
}

// The wgmma.sp kernel's K splits (sam_ssmm_split_k; docs/KERNELS.md, "Split-K"): K in units
// of a V-slice (1:2:V, row selection folds per slice) or a k-tile pair (2:4, the consumers'
// step); its items as tall_tile counts them, each routed expert past the first padding half
// a token tile.
int wgmma_splits(const sam_ssmm_params *ps, sam_tile tile, int sms) {
    const int unit = ps->f.m > 1 ? ps->f.v / 64 : 2;
    const int64_t units = ceil_div(ps->d.cp / 64, unit);
    const int bmt = ps->f.m == 1 || tile != SAM_TILE_128X128 ? 256 : 128;
    const int bn = ps->f.m == 1 || tile == SAM_TILE_128X128 ? 128 : tile == SAM_TILE_256X96 ? 96 : 64;
    const int64_t routed = std::min<int64_t>(ps->d.E, ps->S);
    const int64_t items = ceil_div(ps->d.rp, bmt) * (ceil_div(ps->S, bn) + std::max<int64_t>(routed - 1, 0) / 2);
    // (the kernel splits K in 32-bit arithmetic: split_k_range)
    if (units < 1 || ps->S == 0 || ps->d.cp / 64 > INT32_MAX / SAM_SPLIT_K_MAX) return 1;
    return sam_ssmm_split_k(units, unit, items, sms, ps->cfg.split_k);
}

// The selection rule: a pure function of the call and the device.  impl = AUTO unless
// the caller forces one (p->impl); a forced wgmma.sp the device cannot run is refused
// by the launcher (SAM_IMPL_WGMMA_SP with impl = AUTO never reaches it).
SsmmChoice choose_kernel(const sam_ssmm_params *ps, const SsmmDevice &dev) {
    SsmmChoice c = {SAM_IMPL_MMA_SP, SAM_TILE_AUTO, ps->cfg.token_rows, 1};
    // few rows in all or per expert: reading each routed expert's weights once sets the pace
    if (ps->impl == SAM_IMPL_DECODE || (ps->impl == SAM_IMPL_AUTO && sam_ssmm_use_decode(ps))) {
        c.impl = SAM_IMPL_DECODE;
        return c;
    }
    if (ps->impl == SAM_IMPL_MMA_SP) return c;
    // wgmma.sp takes 2:4 and 1:2:V whose slices are whole 128-column k-tile pairs
    const bool fits = ps->f.m == 1 || (ps->f.m == 2 && ps->f.v % 128 == 0);
    // it streams the weights by TMA: an sm_90 device, aligned weights (always so for the library's)
    if (!(fits && dev.wgmma_sp && ssmm_weights_mappable(ps)) && ps->impl == SAM_IMPL_AUTO) return c;
    c.impl = SAM_IMPL_WGMMA_SP;
    const bool tma_rows = ps->cfg.token_rows != SAM_TOKEN_ROWS_GATHER && ssmm_tokens_mappable(ps);
    c.tile = ps->cfg.tile != SAM_TILE_AUTO ? ps->cfg.tile : tall_tile(ps, tma_rows, dev.sms);
    c.nsplit = wgmma_splits(ps, c.tile, dev.sms);
    // 256 x 96 is never split (WgmmaTile::SPLIT_K): a split call the rule gave it takes 256 x 64
    if (c.nsplit > 1 && c.tile == SAM_TILE_256X96 && ps->f.m > 1) {
        c.tile = ps->cfg.tile == SAM_TILE_AUTO ? SAM_TILE_256X64 : c.tile;
        c.nsplit = c.tile == SAM_TILE_256X96 ? 1 : wgmma_splits(ps, c.tile, dev.sms);
    }
    return c;
}

}  // namespace
}  // namespace sam

extern "C" int sam_ssmm_use_decode(const sam_ssmm_params *p) {
    const int max_rows = p->cfg.decode_max_rows >= 0 ? p->cfg.decode_max_rows : SAM_DECODE_MAX_ROWS;
    const int per_expert =
        p->cfg.decode_rows_per_expert >= 0 ? p->cfg.decode_rows_per_expert : SAM_DECODE_ROWS_PER_EXPERT;
    // the decode kernel while it reads each routed expert's weights in one pass or close to it
    return p->S <= max_rows || p->S <= (int64_t)per_expert * p->d.E;
}

extern "C" int sam_moe_copy_x(const sam_ssmm_params *g, const void *copy) {
    using namespace sam;
    if (g->token_ids == nullptr || g->cfg.x_copy == SAM_X_COPY_NEVER) return 0;
    if (g->cfg.x_copy == SAM_X_COPY_ALWAYS) return 1;
    // the call as it would be on the copy: S rows, H apart, read without a row map
    sam_ssmm_params q = *g;
    q.token_ids = nullptr;
    q.x = copy;
    q.T = g->S;
    q.ldx = g->d.C;
    // wide experts (the copy's bytes per multiply-add fall as 1 / I), enough rows per expert
    if (g->d.R / 2 < SAM_MOE_COPY_X_MIN_I || g->S < (int64_t)SAM_MOE_COPY_X_MIN_ROWS * g->d.E ||
        q.cfg.token_rows == SAM_TOKEN_ROWS_GATHER || !ssmm_tokens_mappable(&q))
        return 0;
    const SsmmDevice dev = {ssmm_wgmma_sp_available(), device_sm_count()};
    return choose_kernel(&q, dev).impl == SAM_IMPL_WGMMA_SP;
}

extern "C" sam_status sam_ssmm_cuda(const sam_ssmm_params *ps, void *stream) {
    using namespace sam;
    const sam_format f = ps->f;
    if (f.n != 1) {
        set_error("ssmm: the GPU kernel needs n = 1 (formats 2:4, 1:2:V, 1:4:V); got %d:%d:%d", f.n, f.m, f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.m > 1 && f.v % 64 != 0) {
        set_error("ssmm: the GPU kernel needs a slice length v that is a multiple of 64; got %d", f.v);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (f.glu == (ps->act == SAM_ACT_NONE)) {
        set_error("ssmm: the GPU kernel pairs a gated activation with a glu-packed weight and no "
                  "activation with a plain one (glu=%d, act=%d)", f.glu, (int)ps->act);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (ps->d.C % 8 != 0) {
        set_error("ssmm: the GPU kernel needs the column count to be a multiple of 8 (16-byte rows); got %lld",
                  (long long)ps->d.C);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (ps->impl < SAM_IMPL_AUTO || ps->impl > SAM_IMPL_DECODE) {
        set_error("ssmm: impl must be 0 (auto), 1 (mma_sp), 2 (wgmma_sp) or 3 (decode); got %d", (int)ps->impl);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const SsmmDevice dev = {ssmm_wgmma_sp_available(), device_sm_count()};
    const SsmmChoice c = choose_kernel(ps, dev);
    cudaStream_t s = (cudaStream_t)stream;
    switch (c.impl) {
    case SAM_IMPL_DECODE: return sam_ssmm_decode_cuda(ps, stream);
    case SAM_IMPL_WGMMA_SP:
        if (!dev.wgmma_sp || !ssmm_weights_mappable(ps) || (f.m != 1 && (f.m != 2 || f.v % 128 != 0))) {
            set_error("ssmm: the wgmma.sp kernel needs an sm_90 device, a build for sm_90a, the driver's tensor-map "
                      "encoder, 16-byte aligned weights and a format 2:4 or 1:2:V with V a multiple of 128 (got "
                      "%d:%d:%d)", f.n, f.m, f.v);
            return SAM_STATUS_UNSUPPORTED;
        }
        return ssmm_wgmma_sp_launch(ps, s, c.tile, c.rows, c.nsplit);
    default: return ssmm_mma_sp_launch(ps, s);
    }
}
