/*
 * samoyeds_layout.h -- the packed Samoyeds weight layout, as plain C arithmetic.
 *
 * Shared by the C reference (csrc/) and the CUDA kernels (cuda/); it is the
 * single definition of where every packed byte lives.  docs/FORMAT.md is the
 * prose version of this file with a worked example.
 *
 * Logical weight: W[E][R][C] (R output rows, C input columns), format (N, M, V)
 * with inner 2:4.  For every group of M consecutive rows and every V-long slice
 * of the columns, N rows are kept; inside a kept row, 2 of every 4 columns are
 * kept.  N == M (stored as n = m = 1) is plain 2:4.
 *
 * Packed layout, version SAM_LAYOUT_VERSION:
 *   values  [E][Rp][Cp/2]      the kept values, 2:4-compressed along columns
 *   meta    [E][Rp/16][Cp/32][16] uint32, one mma.sp m16n8k32 operand tile per
 *                              16 rows x 32 columns, words in lane order (below)
 *   idx     [E][S][Rp] uint8   for N < M only: which row of its group the
 *                              condensed row holds in column slice s
 * where
 *   Rc = R*N/M condensed rows, Rp = Rc padded to SAM_ROW_ALIGN (per GLU half),
 *   Cp = C padded to SAM_COL_ALIGN, S = ceil(C / V) slices.
 *
 * Condensed row order.  Plain layout: condensed row q is storage row q; it
 * belongs to row group q / N (original rows (q/N)*M ... +M-1).  GLU layout
 * (a fused gate_up [2I][C] matrix whose epilogue pairs gate row i with up row
 * I+i): each half is condensed and padded to a multiple of SAM_GLU_CHUNK rows,
 * then the halves are interleaved in chunks of SAM_GLU_CHUNK storage rows:
 * gate chunk 0, up chunk 0, gate chunk 1, up chunk 1, ...  A 2*SAM_GLU_CHUNK
 * row tile of the kernel thus holds matching gate and up rows.
 *
 * Metadata word order inside a 16x32 tile (16 words): word w = 2*r + h for
 * r = 0..7, h = 0..1.  Its low 16 bits describe row r, its high 16 bits row
 * r + 8, both for columns 16h .. 16h+15 of the tile; inside a half-word, the
 * nibble 4*j .. 4*j+3 covers columns 4j .. 4j+3 (j = 0..3) and holds the two
 * kept positions i0 < i1 (2 bits each, i0 in the low bits).  This is the
 * register a thread of lane 4r + h passes to mma.sp m16n8k32 (selector 0).
 * Every code is one of the six valid pairs; padding uses (0, 1).
 */
#ifndef SAMOYEDS_LAYOUT_H
#define SAMOYEDS_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define SAM_HD __host__ __device__ __forceinline__
#else
#define SAM_HD static inline
#endif

#define SAM_LAYOUT_VERSION 1
#define SAM_ROW_ALIGN 64   /* condensed rows are padded to this (a wgmma m64 tile) */
#define SAM_COL_ALIGN 128  /* columns are padded to this (two 64-column k-tiles) */
#define SAM_GLU_CHUNK 64   /* GLU interleave unit, in storage rows */
#define SAM_META_PAD 0x4u  /* nibble for an all-padding group: positions (0, 1) */
#define SAM_MAX_M 8        /* the largest row group the format accepts */

typedef struct sam_format {
    int32_t n;   /* rows kept per group (n == m == 1: plain 2:4) */
    int32_t m;   /* rows per group */
    int32_t v;   /* slice length in columns (a multiple of 32; unused when n == m) */
    int32_t glu; /* 1: gate/up interleaved layout (R = 2I) */
} sam_format;

typedef struct sam_dims {
    int64_t E, R, C;      /* logical shape */
    int64_t rc;           /* condensed rows of the whole matrix (or of one GLU half) */
    int64_t rp;           /* storage rows (padded, both halves for GLU) */
    int64_t cp;           /* padded columns */
    int64_t slices;       /* column slices (0 when n == m) */
    int64_t half_rows;    /* GLU: I = R/2 original rows per half; plain: R */
    int64_t half_rp;      /* GLU: padded condensed rows per half; plain: rp */
} sam_dims;

SAM_HD int64_t sam_round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

SAM_HD int sam_format_has_selection(sam_format f) { return f.n < f.m; }

/* Fills *d; returns 0, or a nonzero code naming the first broken rule:
 * 1 rows not a multiple of m (per half for GLU), 2 columns not a multiple of 4,
 * 3 GLU with an odd row count. */
SAM_HD int sam_dims_make(sam_format f, int64_t E, int64_t R, int64_t C, sam_dims *d)
{
    d->E = E; d->R = R; d->C = C;
    if (C % 4 != 0) return 2;
    if (f.glu) {
        if (R % 2 != 0) return 3;
        d->half_rows = R / 2;
    } else {
        d->half_rows = R;
    }
    if (d->half_rows % f.m != 0) return 1;
    d->rc = d->half_rows / f.m * f.n;
    d->half_rp = sam_round_up(d->rc, f.glu ? SAM_GLU_CHUNK : SAM_ROW_ALIGN);
    d->rp = f.glu ? 2 * d->half_rp : d->half_rp;
    d->cp = sam_round_up(C, SAM_COL_ALIGN);
    d->slices = sam_format_has_selection(f) ? (C + f.v - 1) / f.v : 0;
    return 0;
}

/* Storage row p -> (half, condensed row inside the half); returns 0 for a
 * padding row that holds no condensed row. */
SAM_HD int sam_storage_row(const sam_dims *d, int glu, int64_t p, int *half, int64_t *q)
{
    if (glu) {
        int64_t chunk = p / SAM_GLU_CHUNK;
        *half = (int)(chunk & 1);
        *q = (chunk >> 1) * SAM_GLU_CHUNK + p % SAM_GLU_CHUNK;
    } else {
        *half = 0;
        *q = p;
    }
    return *q < d->rc;
}

/* (half, condensed row q) -> storage row. */
SAM_HD int64_t sam_storage_index(int glu, int half, int64_t q)
{
    if (!glu) return q;
    return (q / SAM_GLU_CHUNK * 2 + half) * SAM_GLU_CHUNK + q % SAM_GLU_CHUNK;
}

/* Original row of condensed row q (of a half) when its group picks row sel. */
SAM_HD int64_t sam_original_row(sam_format f, const sam_dims *d, int half, int64_t q, int sel)
{
    return (int64_t)half * d->half_rows + q / f.n * f.m + sel;
}

/* Metadata word index (inside the whole meta array of one expert) and bit
 * shift for storage row p, column c. */
SAM_HD int64_t sam_meta_word(const sam_dims *d, int64_t p, int64_t c)
{
    int64_t tile = (p / 16) * (d->cp / 32) + c / 32;
    int r = (int)(p % 8);
    int h = (int)((c % 32) / 16);
    return tile * 16 + 2 * r + h;
}

SAM_HD int sam_meta_shift(int64_t p, int64_t c)
{
    return (int)((p % 16) / 8) * 16 + (int)((c % 16) / 4) * 4;
}

/* Sizes in elements of the three packed arrays of one expert. */
SAM_HD int64_t sam_values_per_expert(const sam_dims *d) { return d->rp * (d->cp / 2); }
SAM_HD int64_t sam_meta_per_expert(const sam_dims *d) { return d->rp / 16 * (d->cp / 32) * 16; }
SAM_HD int64_t sam_idx_per_expert(const sam_dims *d) { return d->slices * d->rp; }

/* A 2:4 nibble is valid when its two positions are distinct and ordered. */
SAM_HD int sam_nibble_valid(unsigned nib)
{
    unsigned i0 = nib & 3u, i1 = (nib >> 2) & 3u;
    return i0 < i1;
}

/* The transposed copy of an upstream gradient dy[S][R] by expert segment, what ssmm_dw's
 * wgmma kernel reads dy's kept rows from (ssmm_dw's dy_t, glu_backward's out_t,
 * cuda/ssmm_dyt.cuh): (R + 1) rows of sam_dyt_cols(S, E) columns; row r < R holds, for every
 * sorted row s of expert e (offsets[e] <= s < offsets[e+1]), dy[s][r] at column
 * sam_dyt_segment(offsets[e], e) + s - offsets[e]; every other element, and all of row R, is 0.
 * Each segment starts on a multiple of 64 columns and is followed by at least one zero column
 * before the next (a 64-token k-tile from its start never reaches the next expert). */
SAM_HD int64_t sam_dyt_segment(int64_t off_e, int64_t e) { return sam_round_up((off_e > 0 ? off_e : 0) + 64 * e, 64); }
SAM_HD int64_t sam_dyt_cols(int64_t S, int64_t E) { return sam_round_up(S + 64 * E, 64); }

#endif /* SAMOYEDS_LAYOUT_H */
