/*
 * samoyeds_cuda.h -- the C interface of the samoyeds CUDA kernels.
 *
 * Plain C types only: this header is included by the CPython extension
 * (csrc/, compiled by a C compiler) and by the .cu files.  Every launcher
 * checks what it can without touching device memory, enqueues its kernels on
 * the given stream, never synchronises unless its comment says so, and returns
 * a status; sam_cuda_last_error() holds a message for the last failure of the
 * calling thread.  Nothing here exits or aborts.
 *
 * Pointers are device pointers.  All arrays are dense and row-major; the
 * extension checks shapes, dtypes, strides and devices before calling.
 */
#ifndef SAMOYEDS_CUDA_H
#define SAMOYEDS_CUDA_H

#include <stddef.h>
#include <stdint.h>
#include "samoyeds_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sam_status {
    SAM_STATUS_OK = 0,
    SAM_STATUS_INVALID_ARGUMENT = 1, /* a value the kernel cannot take (message says which) */
    SAM_STATUS_UNSUPPORTED = 2,      /* valid, but this build or device has no kernel for it */
    SAM_STATUS_CUDA_ERROR = 3,       /* the CUDA runtime reported an error */
    SAM_STATUS_BAD_DATA = 4          /* device data broke a rule (found by a checking kernel) */
} sam_status;

typedef enum sam_dtype {
    SAM_F32 = 0,
    SAM_F16 = 1,
    SAM_BF16 = 2,
    SAM_U8 = 3,
    SAM_I32 = 4,
    SAM_I64 = 5,
    SAM_U32 = 6,
    SAM_U16 = 7,
    SAM_F64 = 8,
    SAM_BOOL = 9,
    SAM_DTYPE_COUNT = 10
} sam_dtype;

typedef enum sam_act {
    SAM_ACT_NONE = 0,   /* y = acc (+ bias) */
    SAM_ACT_SWIGLU = 1, /* y_i = silu(g_i) * u_i, g = rows [0, I), u = rows [I, 2I) */
    SAM_ACT_GPTOSS = 2  /* g = min(g, limit), u = clamp(u, -limit, limit), y = (u + 1) g sigmoid(alpha g);
                          the clamps keep NaN, as torch.clamp */
} sam_act;

/* ---- device information -------------------------------------------------- */

const char *sam_cuda_last_error(void);
/* Number of usable devices; 0 (not an error) when there is no driver or GPU. */
int sam_cuda_device_count(void);
/* Compute capability (major*10 + minor) of a device, or -1. */
int sam_cuda_device_cc(int device);
/* Runtime version the extension was built against (e.g. 13000). */
int sam_cuda_runtime_version(void);
/* Space-separated list of the sm architectures compiled in. */
const char *sam_cuda_archs(void);
/* Makes `device` current for the calling thread, saving the previous one in
 * *prev; sam_cuda_device_exit(prev) restores it. */
sam_status sam_cuda_device_enter(int device, int *prev);
void sam_cuda_device_exit(int prev);

/* ---- format: mask, pack, unpack (cuda/format.cu) ------------------------- */

/* mask[E][R][C] (uint8 0/1) = the best mask of format f for saliency
 * scores[E][R][C] (dtype st; NULL = |w| with w of dtype wt). */
sam_status sam_format_mask_cuda(uint8_t *mask, const void *w, sam_dtype wt,
                                const void *scores, sam_dtype st,
                                sam_format f, const sam_dims *d, void *stream);

/* Packs w (dtype t) under mask into values (dtype t), meta, idx (NULL when
 * n == m).  Synchronises the stream to report a mask that breaks the format
 * (SAM_STATUS_BAD_DATA; the message names the first offending place). */
sam_status sam_format_pack_cuda(void *values, uint32_t *meta, uint8_t *idx,
                                const void *w, const uint8_t *mask, sam_dtype t,
                                sam_format f, const sam_dims *d, void *stream);

/* out[i] = values[src[i]] for 0 <= src[i] < n, else 0 (i < count; elements of elem_bytes
 * = 2 or 4 bytes): the refresh of a re-laid-out copy of packed values (PackedWeight.
 * unglued) through its index map, without a copy of the values with a zero appended. */
sam_status sam_format_gather_cuda(void *out, const void *values, int64_t n, int elem_bytes, const int32_t *src,
                                  int64_t count, void *stream);

/* The values of W^T's plain 2:4 packing (out [E][td->rp][td->cp/2], tmeta its metadata,
 * td the dims of W^T [E][C][R]) from the packed weight W (values, meta, idx in format f,
 * dims d): every place gets the value of W that tmeta names there, 0 where W keeps none.
 * The refresh of PackedWeight.transposed() after an optimizer step; one pass over W's
 * values and out, no index map.  Malformed meta or idx give unspecified values, never an
 * access outside the arrays. */
sam_status sam_format_transpose_values_cuda(void *out, const uint32_t *tmeta, const void *values,
                                            const uint32_t *meta, const uint8_t *idx, int elem_bytes,
                                            sam_format f, const sam_dims *d, const sam_dims *td, void *stream);

/* out[E][R][C] = the masked dense weight.  Synchronises the stream to report
 * invalid metadata or indices (SAM_STATUS_BAD_DATA). */
sam_status sam_format_unpack_cuda(void *out, const void *values, const uint32_t *meta,
                                  const uint8_t *idx, sam_dtype t,
                                  sam_format f, const sam_dims *d, void *stream);

/* ---- the sparse-sparse matmul (cuda/ssmm.cu and the kernels it picks) ---- */

/* Which kernel runs an ssmm (sam_ssmm_params.impl). */
typedef enum sam_impl {
    SAM_IMPL_AUTO = 0,      /* the selection rule of cuda/ssmm.cu */
    SAM_IMPL_MMA_SP = 1,    /* mma.sp, sm_80 and later (cuda/ssmm_mma_sp.cu) */
    SAM_IMPL_WGMMA_SP = 2,  /* the warp-specialised wgmma.sp kernel, sm_90a (cuda/ssmm_wgmma_sp.cu) */
    SAM_IMPL_DECODE = 3     /* split-K, bound by reading the weights (cuda/ssmm_decode.cu) */
} sam_impl;

/* The 1:2:V tile of the wgmma.sp kernel (storage rows x tokens). */
typedef enum sam_tile {
    SAM_TILE_AUTO = 0,
    SAM_TILE_128X128 = 1,
    SAM_TILE_256X64 = 2,
    SAM_TILE_256X96 = 3
} sam_tile;

/* How the wgmma.sp kernel brings the token rows into shared memory. */
typedef enum sam_token_rows {
    SAM_TOKEN_ROWS_AUTO = 0,   /* by TMA where x is read without a row map and aligned, else gathered */
    SAM_TOKEN_ROWS_GATHER = 1, /* always gathered (cp.async by index) */
    SAM_TOKEN_ROWS_TMA = 2     /* by TMA; SAM_STATUS_UNSUPPORTED where they cannot be */
} sam_token_rows;

/* Where moe_forward's gate_up reads its token rows (sam_moe_copy_x). */
typedef enum sam_x_copy {
    SAM_X_COPY_AUTO = 0,   /* the rule of sam_moe_copy_x */
    SAM_X_COPY_NEVER = 1,  /* by index from x (token_ids) */
    SAM_X_COPY_ALWAYS = 2  /* from a copy of x's routed rows in expert order, read without a row map */
} sam_x_copy;

/* What stays tunable in the kernel selection: filled by the extension from
 * samoyeds/_config.py (tests and benchmarks override it there); a call that
 * has no opinion passes sam_ssmm_config_default(). */
typedef struct sam_ssmm_config {
    int decode_max_rows;        /* AUTO: the decode kernel when S <= this (-1: SAM_DECODE_MAX_ROWS) */
    int decode_rows_per_expert; /* ... or when S <= this * E (-1: SAM_DECODE_ROWS_PER_EXPERT) */
    sam_tile tile;              /* the wgmma.sp kernel's 1:2:V tile */
    sam_token_rows token_rows;  /* the wgmma.sp kernel's token rows */
    int split_k;                /* the wgmma.sp kernel's K splits: 0 the rule (sam_ssmm_split_k), 1 none,
                                   n > 1 n splits (clamped to 1 .. min(SAM_SPLIT_K_MAX, units)) */
    sam_x_copy x_copy;          /* moe_forward: gate_up's rows from x by index or from a copy (sam_moe_copy_x) */
} sam_ssmm_config;

static inline sam_ssmm_config sam_ssmm_config_default(void) {
    sam_ssmm_config c;
    c.decode_max_rows = -1;
    c.decode_rows_per_expert = -1;
    c.tile = SAM_TILE_AUTO;
    c.token_rows = SAM_TOKEN_ROWS_AUTO;
    c.split_k = 0;
    c.x_copy = SAM_X_COPY_AUTO;
    return c;
}

/* Split-K of the wgmma.sp kernel (docs/KERNELS.md, "Split-K"): the K splits of a call whose
 * K is `units` whole units (1:2:V: V-slices, 2:4: pairs of 64-column k-tiles) of `unit_tiles`
 * k-tiles each, whose `items` work items (expert x row tile x token tile) would run on `sms`
 * SMs.  split_k: the config's override (0: the rule).  The rule splits only where the items
 * fill at most an eighth of the SMs, or a quarter with K of at least SAM_SPLIT_K_LONG k-tiles
 * (more splits then fit one wave: floor(sms / items)), keeps every split at least
 * SAM_SPLIT_K_MIN_TILES k-tiles and at most SAM_SPLIT_K_MAX splits (the partial sums'
 * traffic and the second kernel cost more than they give elsewhere: the sweep on an H100,
 * docs/KERNELS.md "Split-K").  A pure function, in C for the bindings' tests. */
#define SAM_SPLIT_K_MAX 16
#define SAM_SPLIT_K_MIN_TILES 16
#define SAM_SPLIT_K_LONG 256
static inline int sam_ssmm_split_k(int64_t units, int unit_tiles, int64_t items, int sms, int split_k) {
    int64_t n;
    if (split_k > 0) {
        n = split_k;
    } else {
        if (items <= 0 || sms <= 0) return 1;
        if (8 * items > sms && (4 * items > sms || units * unit_tiles < SAM_SPLIT_K_LONG)) return 1;
        const int64_t min_units = (SAM_SPLIT_K_MIN_TILES + unit_tiles - 1) / unit_tiles;
        n = sms / items;
        if (n > units / min_units) n = units / min_units;
    }
    if (n > units) n = units;
    if (n > SAM_SPLIT_K_MAX) n = SAM_SPLIT_K_MAX;
    return n < 1 ? 1 : (int)n;
}

/* Programmatic dependent launch (sm_90 and later) for every samoyeds kernel
 * launched after this call, process-wide: 1 on (the default), 0 plain launches. */
void sam_cuda_set_pdl(int enabled);
int sam_cuda_pdl(void);

typedef struct sam_ssmm_params {
    /* activations: x[T][ldx], row token_ids[s] (or s when token_ids is NULL) */
    const void *x;
    int64_t T;               /* rows of x */
    int64_t ldx;             /* elements between rows of x (>= C, multiple of 8) */
    sam_dtype dtype;         /* SAM_BF16 or SAM_F16, for x, values, out, bias */
    /* packed weights */
    const void *values;
    const uint32_t *meta;
    const uint8_t *idx;      /* NULL when f.n == f.m */
    sam_format f;
    sam_dims d;
    /* routing: expert e owns sorted rows [offsets[e], offsets[e+1]) */
    const int32_t *offsets;  /* [E+1], non-decreasing, offsets[E] <= S */
    const int32_t *token_ids;/* [S] or NULL (identity) */
    int64_t S;               /* capacity of the sorted rows (out's rows) */
    /* epilogue */
    sam_act act;
    const void *bias;        /* [E][R] of bias_dtype, or NULL */
    sam_dtype bias_dtype;
    const float *scale;      /* [S] per sorted row, or NULL */
    float alpha, limit;      /* SAM_ACT_GPTOSS constants */
    /* output: out[S][ldo], R columns (R/2 with an activation) */
    void *out;
    int64_t ldo;
    /* with a gated act, or NULL: the pre-activation too, preact[S][ldp] with R columns, the
     * gate rows' y + bias, then the up rows' (logical order: the GLU interleave undone),
     * rounded once, for the rows out gets (the backward's saved input) */
    void *preact;
    int64_t ldp;
    sam_impl impl;           /* SAM_IMPL_AUTO: best for the device */
    sam_ssmm_config cfg;     /* the selection's tunables (sam_ssmm_config_default()) */
    int offsets_ready;       /* 1: offsets were complete before the kernel launched just
                                before this one on the stream let its dependents start
                                (samoyeds kernels do so only after their own wait for the
                                kernel before them): moe_forward's down projection, whose
                                offsets come from the routing two launches back.  The
                                decode kernel then finds its expert and requests weights
                                while that kernel ends (programmatic dependent launch).
                                0 for any other call. */
} sam_ssmm_params;

sam_status sam_ssmm_cuda(const sam_ssmm_params *p, void *stream);

/* The decode / small-T kernel (cuda/ssmm_decode.cu), called by sam_ssmm_cuda
 * after its format checks for impl SAM_IMPL_DECODE, and for SAM_IMPL_AUTO when
 * sam_ssmm_use_decode(p): p->S at most p->cfg.decode_max_rows (-1:
 * SAM_DECODE_MAX_ROWS), or at most p->cfg.decode_rows_per_expert (-1:
 * SAM_DECODE_ROWS_PER_EXPERT) rows per expert on average.  The defaults come from
 * docs/KERNELS.md ("The selection rule"). */
#define SAM_DECODE_MAX_ROWS 128
#define SAM_DECODE_ROWS_PER_EXPERT 16
/* 2:4 and 1:2:V: the decode kernel's token passes are 32 rows (else 16) once the routed
 * rows average more than this many per expert; 1:4:V: 16 rows (else 8) above half as
 * many (cuda/ssmm_decode.cu, launch_pass). */
#define SAM_DECODE_WIDE_PASS 10
sam_status sam_ssmm_decode_cuda(const sam_ssmm_params *p, void *stream);
int sam_ssmm_use_decode(const sam_ssmm_params *p);

/* ---- the weight gradient of an ssmm, in the packed layout (cuda/ssmm_dw.cu) ---- */

/* For every expert e < E, storage row p < Rp and packed column j < Cp/2 (the k-th
 * kept value, k = j % 2, of the 4-column group c4 = 2 * (j - k)):
 *     out[e][p][j] = sum over s in [offsets[e], offsets[e+1]), in increasing s, of
 *                    dy[u][r] * scale[s] * x[t][col]
 * with r = the original row storage row p holds in slice c4 / V (docs/FORMAT.md,
 * "Storage row -> original rows": idx, GLU interleave; plain 2:4: no slices),
 * col = c4 + the k-th position of the group's meta nibble, t = token_ids[s] (or s),
 * u = dy_ids[s] (or s), scale[s] = 1 when scale is NULL.  Accumulated in fp32, rounded once to dtype.
 * Every entry of out is written: padding rows (q >= rc) and padding columns
 * (c4 >= C) get 0, as do the values of an expert without rows.  Deterministic
 * (no float atomics, a fixed order per entry).  Sorted rows outside the offsets'
 * ranges (placeholders past offsets[E]) are never read.
 * The C reference checks offsets (non-decreasing, offsets[0] >= 0, offsets[E] <= S),
 * token ids and dy ids of the covered rows (in [0, T), [0, Tdy)) and the packed
 * meta/idx (as ssmm does) before writing anything; the GPU kernels read a dy id outside
 * [0, Tdy) as a zero row. */
typedef struct sam_ssmm_dw_params {
    /* the upstream gradient: dy[Tdy][lddy], d.R columns (the weight's logical rows:
     * gate rows then up rows for a GLU weight); sorted row s reads row dy_ids[s], or row s
     * where dy_ids is NULL (Tdy = S) */
    const void *dy;
    int64_t lddy;            /* elements between rows of dy (>= R; GPU: multiple of 8) */
    int64_t S;               /* capacity of the sorted rows */
    const int32_t *dy_ids;   /* [S] or NULL: the row of dy each sorted row reads */
    int64_t Tdy;             /* rows of dy */
    /* dy * scale, rounded to dtype, in the transposed layout by expert segment
     * ([R + 1][sam_dyt_cols(S, E)], samoyeds_layout.h), or NULL: made by the caller (glu_backward's
     * out_t) and then read instead of dy (and scale) by the C reference and the wgmma kernel's
     * copy producer, the only ones that take it (the GPU refuses it with impl 1 and 2, and
     * without the sm_90a kernel) */
    const void *dy_t;
    /* activations: x[T][ldx], row token_ids[s] (or s when token_ids is NULL) */
    const void *x;
    int64_t T;               /* rows of x */
    int64_t ldx;             /* elements between rows of x (>= C; GPU: multiple of 8) */
    sam_dtype dtype;         /* dy, x and out: SAM_BF16 or SAM_F16 (the C reference: also SAM_F32) */
    /* the weight's mask (its values are not read) */
    const uint32_t *meta;
    const uint8_t *idx;      /* NULL when f.n == f.m */
    sam_format f;
    sam_dims d;
    /* routing: expert e owns sorted rows [offsets[e], offsets[e+1]) */
    const int32_t *offsets;  /* [E+1], non-decreasing, offsets[E] <= S */
    const int32_t *token_ids;/* [S] or NULL (identity: x has S rows) */
    const float *scale;      /* [S] multiplies dy's rows (the down projection's routing weights), or NULL */
    /* output: the gradient of the packed values, out[E][Rp][Cp/2] contiguous */
    void *out;
    /* which GPU kernel: 0 the rule (the wgmma kernel where it runs, else mma.sync),
     * 1 the mma.sync kernel (cuda/ssmm_dw.cu), 2 the wgmma kernel gathering dy's kept
     * rows, 3 the wgmma kernel reading them from a transposed copy of dy (2, 3: an sm_90
     * device and the sm_90a build); the C reference ignores it */
    int impl;
} sam_ssmm_dw_params;

/* The CUDA launcher (cuda/ssmm_dw.cu): same status and error convention as
 * sam_ssmm_cuda; stream is a cudaStream_t. */
sam_status sam_ssmm_dw_cuda(const sam_ssmm_dw_params *p, void *stream);

/* ---- the input gradient of an ssmm, from the forward's packing (cuda/ssmm_dx.cu) ---- */

/* For every expert e < E and sorted row s in [offsets[e], offsets[e+1]), every column c < C:
 *     out[s][c] = scale[s] * sum over r < R of dy[t][r] * W_e[r][c]
 * with t = token_ids[s] (or s), scale[s] = 1 when scale is NULL and W_e the masked dense
 * weight the packed arrays describe (docs/FORMAT.md: values, meta, idx, the GLU interleave;
 * dy's columns are the weight's logical rows, gate rows then up rows for a GLU weight).
 * Accumulated in fp32, the scale applied to the sum, rounded once to dtype.  The sum runs
 * over the kept values only: storage row p of slice j holds original row orig(p, j), so
 *     out[s][c] = scale[s] * sum over storage rows p of dy[t][orig(p, c / V)] * Wc[p][c]
 * (Wc: the storage rows decompressed to dense columns, zeros at the dropped 2:4 places).
 * Every row s < S outside [offsets[0], offsets[E]) (placeholders) is written as 0 and its
 * dy row is never read: the backward's elementwise steps read them.  Deterministic (no
 * float atomics, a fixed order per entry).  The GPU kernel treats a token id outside
 * [0, T) as a zero row of dy; the C reference refuses it (and bad offsets, meta and idx,
 * as ssmm does) before writing anything. */
typedef struct sam_ssmm_dx_params {
    /* the upstream gradient: dy[T][lddy], d.R columns, row token_ids[s] (or s) */
    const void *dy;
    int64_t T;               /* rows of dy */
    int64_t lddy;            /* elements between rows of dy (>= R; GPU: multiple of 8) */
    sam_dtype dtype;         /* dy, values and out: SAM_BF16 or SAM_F16 (the C reference: also SAM_F32) */
    /* the packed weight (the forward's: no transposed copy) */
    const void *values;
    const uint32_t *meta;
    const uint8_t *idx;      /* NULL when f.n == f.m */
    sam_format f;
    sam_dims d;
    /* routing: expert e owns sorted rows [offsets[e], offsets[e+1]) */
    const int32_t *offsets;  /* [E+1], non-decreasing, offsets[E] <= S */
    const int32_t *token_ids;/* [S] or NULL (identity: dy has the sorted rows) */
    int64_t S;               /* rows of out (capacity of the sorted rows) */
    const float *scale;      /* [S] multiplies the sums (the down projection's routing weights), or NULL */
    /* output: out[S][ldo], d.C columns */
    void *out;
    int64_t ldo;             /* elements between rows of out (>= C; GPU: multiple of 8) */
    int impl;                /* GPU kernel: 0 the rule (sm_90a: wgmma), 1 mma.sync, 2 wgmma */
} sam_ssmm_dx_params;

/* The CUDA launcher (cuda/ssmm_dx.cu): same status and error convention as sam_ssmm_cuda;
 * stream is a cudaStream_t.  GPU: formats 2:4, 1:2:V, 1:4:V with V a multiple of 64,
 * C a multiple of 8, dy and out 16-byte aligned. */
sam_status sam_ssmm_dx_cuda(const sam_ssmm_dx_params *p, void *stream);

/* ---- dense weights at a few tokens (cuda/dense_decode.cu) --------------------- */

/* out[t][r] = act(x[t] @ w[r]^T, x[t] @ up[r]^T) for t < T, r < R, fp32 accumulation,
 * rounded once to out's dtype: act NONE gives x[t] @ w[r]^T (up unused, NULL); a gated
 * act takes w as the gate rows and up as the up rows (SAM_ACT_SWIGLU: silu(g) * u).
 * Bound by reading the weights: every weight is read once per pass of up to 32 tokens
 * (one pass for T <= 32), split over the K dimension by the warps of a CTA and reduced
 * in a fixed order (deterministic).  The path of a block's unpruned shared experts at
 * decode sizes. */
typedef struct sam_dense_params {
    const void *x;           /* x[T][ldx], C columns used */
    int64_t T, ldx;
    const void *w, *up;      /* [R][C], rows contiguous (row stride C) */
    int64_t R, C;
    sam_dtype dtype;         /* x, w, up, out: SAM_BF16 or SAM_F16 (the C reference: also SAM_F32) */
    sam_act act;
    float alpha, limit;      /* SAM_ACT_GPTOSS constants */
    void *out;               /* out[T][ldo], R columns */
    int64_t ldo;
    int weights_ready;       /* 1: neither w nor up is written by the kernel launched just before
                                this one on the stream, which lets its dependents start only
                                after its own wait for the kernel before it (a samoyeds kernel:
                                the down projection after the gate/up one): the weights are then
                                requested while that kernel ends.  0 for any other call. */
} sam_dense_params;

/* GPU: C a multiple of 8, ldx a multiple of 8, x, w and up 16-byte aligned. */
sam_status sam_dense_decode_cuda(const sam_dense_params *p, void *stream);

/* ---- a gated activation of two matrices (cuda/glu.cu) --------------------------- */

/* out[t][i] = act(g[t][i], u[t][i]) for t < T, i < I (a gated act: SAM_ACT_SWIGLU or
 * SAM_ACT_GPTOSS), in fp32, rounded once: the activation between a dense MLP's gate/up
 * matmuls and its down matmul at prefill sizes, one pass instead of two. */
typedef struct sam_glu_params {
    const void *g, *u;       /* [T][ldg], [T][ldu]: I columns used */
    int64_t ldg, ldu;
    void *out;               /* [T][ldo] */
    int64_t ldo, T, I;
    sam_dtype dtype;         /* all three: SAM_BF16 or SAM_F16 (the C reference: also SAM_F32) */
    sam_act act;
    float alpha, limit;
} sam_glu_params;

sam_status sam_glu_cuda(const sam_glu_params *p, void *stream);

/* The backward of a gated activation, for the sorted rows s < S of an MoE (cuda/glu.cu):
 * from d = dh[s][i] * scale[s] (scale NULL: d = dh[s][i]), g = pre[s][i], u = pre[s][I + i],
 * in fp32, in the order _glu_backward (samoyeds/torch_ops.py) writes it:
 *   SAM_ACT_SWIGLU: sg = 1 / (1 + exp(-g))
 *                   dg = (d * u) * (sg * (1 + g * (1 - sg))),  du = d * (g * sg)
 *   SAM_ACT_GPTOSS: gc = min(g, limit), uc = clamp(u, -limit, limit), sg = 1 / (1 + exp(-alpha gc))
 *                   dg = g <= limit ? (d * (uc + 1)) * (sg + ((alpha gc) sg) (1 - sg)) : 0
 *                   du = -limit <= u <= limit ? d * (gc * sg) : 0
 *                   (the clamps pass the gradient at their ends, as torch's clamp; NaN: 0)
 * out[s][i] = dg, out[s][I + i] = du, each rounded once to out_dtype.  With offsets
 * (else NULL), rows s >= offsets[E] (placeholders, read on the device: no host sync) are
 * written as 0 and their dh, pre and scale are never read. */
typedef struct sam_glu_backward_params {
    const void *dh;          /* [S][lddh], I columns used */
    int64_t lddh;
    sam_dtype dh_dtype;      /* SAM_F32 or dtype */
    const void *pre;         /* [S][ldp]: gate columns [0, I), up columns [I, 2I) */
    int64_t ldp;
    sam_dtype dtype;         /* SAM_BF16, SAM_F16 or SAM_F32 */
    const float *scale;      /* [S] or NULL */
    const int32_t *offsets;  /* [E+1] or NULL (every row live) */
    int64_t E;
    void *out;               /* [S][ldo], 2I columns */
    int64_t ldo;
    sam_dtype out_dtype;     /* SAM_F32 or dtype */
    int64_t S, I;
    sam_act act;             /* SAM_ACT_SWIGLU or SAM_ACT_GPTOSS */
    float alpha, limit;
    float *hdot;             /* [S] or NULL: hdot[s] = sum_i dh[s][i] * h[s][i] with dh before the
                                scale and h = act(gate, up) rounded to dtype (what glu writes),
                                fp32 sums (the GPU's order: per lane, then a shuffle tree); 0 for
                                the rows past offsets[E].  An MoE backward's d routing weights. */
    void *out_t;             /* [2I + 1][sam_dyt_cols(S, E)] in dtype, or NULL (needs offsets): out
                                again, rounded to dtype, in the transposed layout by expert segment
                                (samoyeds_layout.h, sam_dyt_segment) that ssmm_dw's dy_t takes: the
                                gate_up weight gradient's copy of dy without a pass of its own */
} sam_glu_backward_params;

/* GPU: 16-byte accesses of 8 columns where I, the row strides and the pointers allow. */
sam_status sam_glu_backward_cuda(const sam_glu_backward_params *p, void *stream);

/* ---- the router: logits, scores and top-k experts (cuda/router.cu) ------------- */

typedef enum sam_router_mode {
    SAM_ROUTER_SOFTMAX_TOPK = 0, /* scores = softmax(logits); the k largest scores (Mixtral, Qwen, OLMoE,
                                    DeepSeek-V2) */
    SAM_ROUTER_TOPK_SOFTMAX = 1, /* the k largest logits; weights = softmax over those k (GPT-OSS) */
    SAM_ROUTER_SIGMOID_TOPK = 2  /* scores = sigmoid(logits), chosen by scores + choice_bias (DeepSeek-V3) */
} sam_router_mode;

#define SAM_ROUTER_MAX_EXPERTS 512
#define SAM_ROUTER_MAX_K 32
#define SAM_ROUTER_MAX_GROUPS 32

/* For every token t < T (fp32 accumulation):
 *     logits[t][e] = round_L(sum_c x[t][c] * w[e][c] + bias[e])       e < E, L = logits_dtype
 *   SOFTMAX_TOPK:
 *     p = softmax(logits[t]) in fp32, from the rounded logits
 *     n_group > 1 (group-limited): a group's score is the largest p of its E / n_group
 *     experts (groups contiguous); the p of every expert outside the topk_group best
 *     groups counts as 0
 *     sel = the k largest p, largest first (equal values: the lower expert id first)
 *     v = p[sel]; renorm: v /= (v[0] + ... + v[k-1]); v *= scale
 *   TOPK_SOFTMAX:
 *     sel = the k largest logits, largest first (ties as above); v = softmax(logits[sel]) * scale
 *   SIGMOID_TOPK:
 *     p = sigmoid(logits) in fp32, c = p + choice_bias (the bias only chooses)
 *     n_group > 1: a group's score is the sum of its two largest c; c of every expert outside
 *     the topk_group best groups counts as -inf
 *     sel = the k largest c, largest first (ties as above); v = p[sel];
 *     renorm: v /= (v[0] + ... + v[k-1] + 1e-20); v *= scale
 *   weights[t][j] = round_W(v[j]), ids[t][j] = sel[j] (int64).
 * Two launches on the GPU (logits; selection), each with programmatic dependent launch. */
typedef struct sam_router_params {
    const void *x;          /* x[T][ldx], H columns used */
    int64_t T, ldx;
    sam_dtype dtype;        /* x and w: SAM_BF16 or SAM_F16 (the C reference: also SAM_F32) */
    const void *w;          /* [E][H] contiguous */
    int64_t E, H;
    const void *bias;       /* [E] or NULL: added to the logits */
    sam_dtype bias_dtype;   /* SAM_F32 or dtype */
    const void *choice_bias;/* [E] (SIGMOID_TOPK) or NULL: added to the scores to choose */
    sam_dtype choice_bias_dtype;
    int k;
    sam_router_mode mode;
    int n_group, topk_group, renorm;
    float scale;
    void *logits;           /* [T][E] contiguous */
    sam_dtype logits_dtype; /* SAM_F32 or dtype */
    void *weights;          /* [T][k] contiguous */
    sam_dtype weights_dtype;/* SAM_F32 or dtype */
    int64_t *ids;           /* [T][k] contiguous */
} sam_router_params;

/* GPU: H and ldx multiples of 8, x and w 16-byte aligned, E <= SAM_ROUTER_MAX_EXPERTS,
 * 1 <= k <= min(E, SAM_ROUTER_MAX_K), n_group <= SAM_ROUTER_MAX_GROUPS dividing E (SIGMOID_TOPK with
 * groups: at least two experts per group). */
sam_status sam_router_cuda(const sam_router_params *p, void *stream);

/* ---- MoE routing and combine (cuda/moe.cu) -------------------------------- */

/* From top_k_index[T][K] (int32 or int64; ids >= E or < 0 are skipped):
 * offsets[E+1], token_ids[T*K] (token of each sorted row), perm[T*K]
 * (flat (t, k) of each sorted row), pos[T*K] (sorted row of each (t, k) or -1).
 * Stable: inside an expert, rows are in (t, k) order.  No host sync.  With scale
 * (else NULL), also scale[T*K], each sorted row's routing weight from weights[T*K]
 * of weights_dtype, as sam_moe_gather_weights_cuda gives it, in the same launch. */
sam_status sam_moe_route_cuda(const void *top_k_index, sam_dtype index_dtype,
                              int64_t T, int64_t K, int64_t E,
                              int32_t *offsets, int32_t *token_ids, int32_t *perm,
                              int32_t *pos, float *scale, const void *weights,
                              sam_dtype weights_dtype, void *stream);

/* out[s] = w[perm[s]] as float for s < offsets[E], 0 after; w of dtype wt. */
sam_status sam_moe_gather_weights_cuda(float *out, const void *w, sam_dtype wt,
                                       const int32_t *perm, const int32_t *offsets,
                                       int64_t E, int64_t S, void *stream);

/* sam_moe_zero_unrouted_ref on the stream: rows from offsets[E] (read on the device) to S
 * zeroed; no host sync. */
sam_status sam_moe_zero_unrouted_cuda(void *out, int64_t row_bytes, int64_t ld_bytes, const int32_t *offsets,
                                      int64_t E, int64_t S, void *stream);

/* dst[s] = x[token_ids[s]] (H elements of dtype; x's rows ldx apart, dst's H apart) for
 * the routed rows s < offsets[E]; rows past them are not written.  A programmatic
 * dependent launch: it waits for the routing before it reads. */
sam_status sam_moe_gather_rows_cuda(void *dst, const void *x, sam_dtype dtype, int64_t ldx, int64_t H,
                                    const int32_t *token_ids, const int32_t *offsets, int64_t E, int64_t S,
                                    void *stream);

/* Whether moe_forward copies x's routed rows in expert order to `copy` (S rows, H apart)
 * for its gate_up call (sam_ssmm_params with token_ids set) and reads the copy without a
 * row map (by TMA on the wgmma.sp kernel) instead of by index: cfg.x_copy, and under
 * AUTO the rule (cuda/ssmm.cu; docs/KERNELS.md): on the copy the call takes the wgmma.sp
 * kernel with its rows by TMA, the expert width I = R / 2 is at least
 * SAM_MOE_COPY_X_MIN_I (the copy's bytes per gate_up multiply-add fall as 1 / I) and the
 * sorted rows are at least SAM_MOE_COPY_X_MIN_ROWS per expert.  Measured on an H100
 * (dev/lab/results/h100/x_copy_4034409.json, moe.json): Mixtral-8x7B's block 1.07x / 1.13x
 * faster at T = 4096 / 16384 (I = 14336), 0.97x at T = 256 (64 rows per expert); every
 * model with I <= 2880 slower with the copy (0.87-0.95x). */
#define SAM_MOE_COPY_X_MIN_I 4096
#define SAM_MOE_COPY_X_MIN_ROWS 256
int sam_moe_copy_x(const sam_ssmm_params *gate_up, const void *copy);

/* out[t][h] = sum_k y[pos[t*K+k]][h] in fp32, fixed order; pos outside
 * [0, S) skipped (y has S rows). */
sam_status sam_moe_combine_cuda(void *out, sam_dtype out_dtype, const void *y,
                                sam_dtype y_dtype, const int32_t *pos,
                                int64_t T, int64_t K, int64_t H, int64_t ldy, int64_t S,
                                void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SAMOYEDS_CUDA_H */
