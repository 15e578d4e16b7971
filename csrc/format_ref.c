/*
 * format_ref.c -- mask selection, packing and unpacking of the Samoyeds format
 * on the CPU.  The layout is defined in cuda/samoyeds_layout.h; cuda/format.cu
 * computes the same bytes on the GPU.
 *
 * mask: for every V-slice of every group of M rows, the N rows whose 2:4-pruned
 *   saliency (the sum over the slice of the two largest scores of every four
 *   columns) is largest are kept; inside each kept row, the two largest of
 *   every four.  Ties go to the lower index.  Sums are in double so the GPU,
 *   which adds in another order, picks the same rows.
 * pack: keeps exactly what the mask keeps; a group with fewer than N masked
 *   rows, or a 4-column group with fewer than 2 masked columns, is completed
 *   with the lowest unused indices (their values are zero), so every stored
 *   2:4 code is valid.  A mask that keeps more than the format allows is an
 *   error naming the place.
 * check: the codes and row indices of the live storage rows are what the format
 *   allows (valid 2:4 codes; indices below m, increasing within a group); unpack
 *   and ssmm refuse packed arrays that fail it before writing anything.
 * unpack: writes the masked dense weight.
 */
#include "sam_ref.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(_MSC_VER)
#define SAM_THREAD_LOCAL __declspec(thread)
#else
#define SAM_THREAD_LOCAL _Thread_local
#endif

static SAM_THREAD_LOCAL char ref_error[512];

const char *sam_ref_last_error(void) { return ref_error; }

void sam_ref_set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ref_error, sizeof ref_error, fmt, ap);
    va_end(ap);
}

/* The two largest of four scores (ties: lower index), as ordered positions. */
static void top2_of4(const double s[4], int *i0, int *i1)
{
    int a = 0;
    for (int i = 1; i < 4; i++)
        if (s[i] > s[a]) a = i;
    int b = a == 0 ? 1 : 0;
    for (int i = 0; i < 4; i++)
        if (i != a && s[i] > s[b]) b = i;
    *i0 = a < b ? a : b;
    *i1 = a < b ? b : a;
}

static double score_at(const void *w, sam_dtype wt, const void *scores, sam_dtype st, int64_t i)
{
    if (scores != NULL) return sam_load_f64(scores, st, i);
    return fabs(sam_load_f64(w, wt, i));
}

sam_status sam_format_mask_ref(uint8_t *mask, const void *w, sam_dtype wt,
                               const void *scores, sam_dtype st,
                               sam_format f, const sam_dims *d)
{
    const int64_t R = d->R, C = d->C;
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : C;
    if (d->E * R * C == 0) return SAM_STATUS_OK; /* (mask may be NULL: no memset of nothing) */
    memset(mask, 0, (size_t)(d->E * R * C));
    for (int64_t e = 0; e < d->E; e++) {
        const int64_t base = e * R * C;
        for (int64_t g0 = 0; g0 < R; g0 += f.m) {
            for (int64_t c0 = 0; c0 < C; c0 += V) {
                const int64_t c1 = c0 + V < C ? c0 + V : C;
                double sal[SAM_MAX_M];
                for (int r = 0; r < f.m; r++) {
                    sal[r] = 0.0;
                    for (int64_t c = c0; c < c1; c += 4) {
                        double s[4];
                        for (int j = 0; j < 4; j++)
                            s[j] = score_at(w, wt, scores, st, base + (g0 + r) * C + c + j);
                        int i0, i1;
                        top2_of4(s, &i0, &i1);
                        sal[r] += s[i0] + s[i1];
                    }
                }
                /* keep the n best rows (ties: lower row) */
                int keep[SAM_MAX_M] = {0};
                for (int k = 0; k < f.n; k++) {
                    int best = -1;
                    for (int r = 0; r < f.m; r++)
                        if (!keep[r] && (best < 0 || sal[r] > sal[best])) best = r;
                    keep[best] = 1;
                }
                for (int r = 0; r < f.m; r++) {
                    if (!keep[r]) continue;
                    for (int64_t c = c0; c < c1; c += 4) {
                        double s[4];
                        for (int j = 0; j < 4; j++)
                            s[j] = score_at(w, wt, scores, st, base + (g0 + r) * C + c + j);
                        int i0, i1;
                        top2_of4(s, &i0, &i1);
                        mask[base + (g0 + r) * C + c + i0] = 1;
                        mask[base + (g0 + r) * C + c + i1] = 1;
                    }
                }
            }
        }
    }
    return SAM_STATUS_OK;
}

static void copy_elem(void *dst, int64_t di, const void *src, int64_t si, size_t es)
{
    memcpy((char *)dst + di * (int64_t)es, (const char *)src + si * (int64_t)es, es);
}

static void zero_elem(void *dst, int64_t di, size_t es)
{
    memset((char *)dst + di * (int64_t)es, 0, es);
}

static size_t elem_size(sam_dtype t) { return t == SAM_F32 ? 4 : 2; }

static void fill_meta_padding(uint32_t *meta, int64_t n)
{
    for (int64_t i = 0; i < n; i++) sam_st_u32(meta, i, 0x44444444u);
}

/* memset that takes the NULL of an empty array (memset(NULL, 0, 0) is undefined). */
static void zero_bytes(void *p, size_t n)
{
    if (n != 0) memset(p, 0, n);
}

sam_status sam_format_pack_ref(void *values, uint32_t *meta, uint8_t *idx,
                               const void *w, const uint8_t *mask, sam_dtype t,
                               sam_format f, const sam_dims *d)
{
    const int64_t R = d->R, C = d->C, cp = d->cp;
    const size_t es = elem_size(t);
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : C;
    const int64_t nv = sam_values_per_expert(d), nm = sam_meta_per_expert(d), ni = sam_idx_per_expert(d);
    const int halves = f.glu ? 2 : 1;

    zero_bytes(values, (size_t)(d->E * nv) * es);
    fill_meta_padding(meta, d->E * nm);
    if (sel) zero_bytes(idx, (size_t)(d->E * ni));

    for (int64_t e = 0; e < d->E; e++) {
        const int64_t wb = e * R * C;
        char *ve = (char *)values + e * nv * (int64_t)es;
        const int64_t mb = e * nm; /* this expert's first meta word */
        uint8_t *ie = sel ? idx + e * ni : NULL;
        for (int h = 0; h < halves; h++) {
            for (int64_t grp = 0; grp < d->half_rows / f.m; grp++) {
                const int64_t row0 = h * d->half_rows + grp * f.m; /* first original row */
                for (int64_t c0 = 0, j = 0; c0 < C; c0 += V, j++) {
                    const int64_t c1 = c0 + V < C ? c0 + V : C;
                    /* rows of the group that the mask uses in this slice */
                    int chosen[SAM_MAX_M], nch = 0, used[SAM_MAX_M] = {0};
                    for (int r = 0; r < f.m; r++) {
                        int any = 0;
                        for (int64_t c = c0; c < c1 && !any; c++) any = mask[wb + (row0 + r) * C + c] != 0;
                        if (any) {
                            if (nch == f.n) {
                                sam_ref_set_error(
                                    "mask: expert %lld, rows %lld..%lld, columns %lld..%lld keep more than "
                                    "%d of %d rows; the format allows %d", (long long)e, (long long)row0,
                                    (long long)(row0 + f.m - 1), (long long)c0, (long long)(c1 - 1),
                                    f.n, f.m, f.n);
                                return SAM_STATUS_INVALID_ARGUMENT;
                            }
                            used[r] = 1;
                            chosen[nch++] = r;
                        }
                    }
                    for (int r = 0; r < f.m && nch < f.n; r++) /* complete with unused rows */
                        if (!used[r]) { used[r] = 1; chosen[nch++] = r; }
                    /* sort ascending: slot s holds the s-th chosen row */
                    for (int a = 1; a < nch; a++)
                        for (int b = a; b > 0 && chosen[b - 1] > chosen[b]; b--) {
                            int tmp = chosen[b]; chosen[b] = chosen[b - 1]; chosen[b - 1] = tmp;
                        }
                    for (int s = 0; s < f.n; s++) {
                        const int64_t q = grp * f.n + s;
                        const int64_t p = sam_storage_index(f.glu, h, q);
                        const int64_t orow = row0 + chosen[s];
                        if (sel) ie[j * d->rp + p] = (uint8_t)chosen[s];
                        for (int64_t c = c0; c < c1; c += 4) {
                            int pos[4], np = 0;
                            for (int k = 0; k < 4; k++)
                                if (mask[wb + orow * C + c + k]) {
                                    if (np == 2) {
                                        sam_ref_set_error(
                                            "mask: expert %lld, row %lld, columns %lld..%lld keep more than 2 of 4",
                                            (long long)e, (long long)orow, (long long)c, (long long)(c + 3));
                                        return SAM_STATUS_INVALID_ARGUMENT;
                                    }
                                    pos[np++] = k;
                                }
                            int keep_mask[4] = {0, 0, 0, 0};
                            for (int k = 0; k < np; k++) keep_mask[pos[k]] = 1;
                            for (int k = 0; k < 4 && np < 2; k++)
                                if (!keep_mask[k]) { keep_mask[k] = 2; pos[np++] = k; }
                            int i0 = pos[0] < pos[1] ? pos[0] : pos[1];
                            int i1 = pos[0] < pos[1] ? pos[1] : pos[0];
                            const int64_t vb = p * (cp / 2) + c / 2;
                            if (keep_mask[i0] == 1) copy_elem(ve, vb, w, wb + orow * C + c + i0, es);
                            else zero_elem(ve, vb, es);
                            if (keep_mask[i1] == 1) copy_elem(ve, vb + 1, w, wb + orow * C + c + i1, es);
                            else zero_elem(ve, vb + 1, es);
                            const int64_t word = mb + sam_meta_word(d, p, c);
                            const int shift = sam_meta_shift(p, c);
                            uint32_t nib = (uint32_t)(i0 | (i1 << 2));
                            sam_st_u32(meta, word, (sam_ld_u32(meta, word) & ~(0xfu << shift)) | (nib << shift));
                        }
                    }
                }
            }
        }
    }
    return SAM_STATUS_OK;
}

sam_status sam_format_check_ref(const uint32_t *meta, const uint8_t *idx, sam_format f, const sam_dims *d)
{
    const int64_t C = d->C;
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : C;
    const int64_t nm = sam_meta_per_expert(d), ni = sam_idx_per_expert(d);

    for (int64_t e = 0; e < d->E; e++) {
        const int64_t mb = e * nm; /* this expert's first meta word */
        const uint8_t *ie = sel ? idx + e * ni : NULL;
        for (int64_t p = 0; p < d->rp; p++) {
            int h;
            int64_t q;
            if (!sam_storage_row(d, f.glu, p, &h, &q)) continue;
            for (int64_t c0 = 0, j = 0; sel && c0 < C; c0 += V, j++) {
                const int s = ie[j * d->rp + p];
                if (s >= f.m) {
                    sam_ref_set_error("idx: expert %lld, slice %lld, storage row %lld holds %d; "
                                      "expected a value below %d", (long long)e, (long long)j,
                                      (long long)p, s, f.m);
                    return SAM_STATUS_BAD_DATA;
                }
                if (q % f.n > 0) { /* slots of a group must pick increasing rows */
                    const int64_t pprev = sam_storage_index(f.glu, h, q - 1);
                    if (ie[j * d->rp + pprev] >= s) {
                        sam_ref_set_error("idx: expert %lld, slice %lld: storage rows %lld and %lld "
                                          "pick rows %d and %d of their group; expected increasing",
                                          (long long)e, (long long)j, (long long)pprev, (long long)p,
                                          ie[j * d->rp + pprev], s);
                        return SAM_STATUS_BAD_DATA;
                    }
                }
            }
            for (int64_t c = 0; c < C; c += 4) {
                const uint32_t nib = (sam_ld_u32(meta, mb + sam_meta_word(d, p, c)) >> sam_meta_shift(p, c)) & 0xfu;
                if (!sam_nibble_valid(nib)) {
                    sam_ref_set_error("meta: expert %lld, storage row %lld, columns %lld..%lld hold "
                                      "the invalid 2:4 code 0x%x", (long long)e, (long long)p,
                                      (long long)c, (long long)(c + 3), nib);
                    return SAM_STATUS_BAD_DATA;
                }
            }
        }
    }
    return SAM_STATUS_OK;
}

sam_status sam_format_unpack_ref(void *out, const void *values, const uint32_t *meta,
                                 const uint8_t *idx, sam_dtype t,
                                 sam_format f, const sam_dims *d)
{
    const int64_t R = d->R, C = d->C, cp = d->cp;
    const size_t es = elem_size(t);
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : C;
    const int64_t nv = sam_values_per_expert(d), nm = sam_meta_per_expert(d), ni = sam_idx_per_expert(d);

    const sam_status status = sam_format_check_ref(meta, idx, f, d); /* nothing written unless valid */
    if (status != SAM_STATUS_OK) return status;
    zero_bytes(out, (size_t)(d->E * R * C) * es);
    for (int64_t e = 0; e < d->E; e++) {
        const char *ve = (const char *)values + e * nv * (int64_t)es;
        const int64_t mb = e * nm; /* this expert's first meta word */
        const uint8_t *ie = sel ? idx + e * ni : NULL;
        const int64_t ob = e * R * C;
        for (int64_t p = 0; p < d->rp; p++) {
            int h;
            int64_t q;
            if (!sam_storage_row(d, f.glu, p, &h, &q)) continue;
            for (int64_t c0 = 0, j = 0; c0 < C; c0 += V, j++) {
                const int64_t c1 = c0 + V < C ? c0 + V : C;
                const int s = sel ? ie[j * d->rp + p] : 0;
                const int64_t orow = sam_original_row(f, d, h, q, s);
                for (int64_t c = c0; c < c1; c += 4) {
                    uint32_t nib = (sam_ld_u32(meta, mb + sam_meta_word(d, p, c)) >> sam_meta_shift(p, c)) & 0xfu;
                    const int64_t vb = p * (cp / 2) + c / 2;
                    copy_elem(out, ob + orow * C + c + (nib & 3u), ve, vb, es);
                    copy_elem(out, ob + orow * C + c + (nib >> 2), ve, vb + 1, es);
                }
            }
        }
    }
    return SAM_STATUS_OK;
}

sam_status sam_format_gather_ref(void *out, const void *values, int64_t n, int elem_bytes, const int32_t *src,
                                 int64_t count)
{
    for (int64_t i = 0; i < count; i++) {
        const int64_t j = src[i];
        if (elem_bytes == 2)
            ((uint16_t *)out)[i] = j >= 0 && j < n ? ((const uint16_t *)values)[j] : 0;
        else
            ((uint32_t *)out)[i] = j >= 0 && j < n ? ((const uint32_t *)values)[j] : 0;
    }
    return SAM_STATUS_OK;
}

/* The storage row holding original row orow in column c's slice (a row of the weight, both GLU
 * halves counted); 0 when no condensed row of its group keeps it there.  ie: the expert's
 * row indices (NULL without row selection). */
static int storage_row_of(sam_format f, const sam_dims *d, const uint8_t *ie, int64_t orow, int64_t c, int64_t *p)
{
    const int h = f.glu ? (int)(orow / d->half_rows) : 0;
    const int64_t rin = orow - (int64_t)h * d->half_rows, grp = rin / f.m;
    const int sel = (int)(rin % f.m);
    for (int t = 0; t < f.n; t++) {
        const int64_t q = grp * f.n + t;
        if (q >= d->rc) break;
        const int64_t pp = sam_storage_index(f.glu, h, q);
        const int s = ie != NULL ? ie[(c / f.v) * d->rp + pp] : 0;
        if (s == sel) {
            *p = pp;
            return 1;
        }
    }
    return 0;
}

sam_status sam_format_transpose_values_ref(void *out, const uint32_t *tmeta, const void *values,
                                           const uint32_t *meta, const uint8_t *idx, int elem_bytes,
                                           sam_format f, const sam_dims *d, const sam_dims *td)
{
    const size_t es = (size_t)elem_bytes;
    const int sel = sam_format_has_selection(f);
    const int64_t nv = sam_values_per_expert(d), nm = sam_meta_per_expert(d), ni = sam_idx_per_expert(d);
    const int64_t tnv = sam_values_per_expert(td), tnm = sam_meta_per_expert(td), tk = td->cp / 2;
    for (int64_t e = 0; e < d->E; e++) {
        const uint8_t *ie = sel ? idx + e * ni : NULL;
        for (int64_t c = 0; c < td->rp; c++) {
            for (int64_t k = 0; k < tk; k++) {
                const int64_t o = e * tnv + c * tk + k;
                zero_elem(out, o, es);
                if (c >= d->C) continue;
                /* the place's row of W: its window's first row and the position tmeta names */
                const int64_t tc = k / 2 * 4;
                const uint32_t tn = (sam_ld_u32(tmeta, e * tnm + sam_meta_word(td, c, tc)) >> sam_meta_shift(c, tc)) & 0xfu;
                const int64_t orow = tc + (int64_t)((k & 1) ? tn >> 2 : tn & 3u);
                int64_t p;
                if (orow >= d->R || !storage_row_of(f, d, ie, orow, c, &p)) continue;
                const uint32_t nib = (sam_ld_u32(meta, e * nm + sam_meta_word(d, p, c)) >> sam_meta_shift(p, c)) & 0xfu;
                const int64_t vb = e * nv + p * (d->cp / 2) + c / 4 * 2;
                /* (the second slot first: where a malformed code names one column twice, the
                 * kernel's later write, the second slot's value, is what stays) */
                if ((int64_t)(nib >> 2) == c % 4)
                    copy_elem(out, o, values, vb + 1, es);
                else if ((int64_t)(nib & 3u) == c % 4)
                    copy_elem(out, o, values, vb, es);
            }
        }
    }
    return SAM_STATUS_OK;
}
