// format.cu -- mask selection, packing and unpacking of the Samoyeds format on
// the GPU.  Same bytes as csrc/format_ref.c (layout: samoyeds_layout.h).
//
//  mask:   one warp per (expert, row group, column slice).  Row saliencies are
//          summed in double in the reference's order (a lane-ordered shuffle
//          scan), so the GPU picks exactly the reference's rows.
//  pack:   (a) one warp per (expert, half, row group, slice) picks the stored
//          rows (idx); (b) one thread per metadata word writes its 2 rows x 16
//          columns: 16 values and one word, no write shared between threads.
//  unpack: zero the output, then one thread per metadata word scatters.
// pack and unpack check the data on the device and report the first offence
// (one 64-bit atomicMin), synchronising the stream to do so.
#include "common.cuh"

namespace sam {
namespace {

constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ void top2_of4(const double s[4], int &i0, int &i1) {
    int a = 0;
#pragma unroll
    for (int i = 1; i < 4; i++)
        if (s[i] > s[a]) a = i;
    int b = a == 0 ? 1 : 0;
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (i != a && s[i] > s[b]) b = i;
    i0 = min(a, b);
    i1 = max(a, b);
}

struct ScoreSrc {
    const void *w;
    sam_dtype wt;
    const void *s;
    sam_dtype st;
    __device__ __forceinline__ double at(int64_t i) const {
        return s != nullptr ? load_as_double(s, st, i) : fabs(load_as_double(w, wt, i));
    }
};

// One warp per (e, group, slice).  For plain 2:4 (n == m) the "group" is one
// row and the slice the whole row.
__global__ void mask_kernel(uint8_t *mask, ScoreSrc src, sam_format f, int64_t E, int64_t R, int64_t C,
                            int64_t V, int64_t nslices) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int64_t groups = R / f.m;
    if (warp >= E * groups * nslices) return;
    const int64_t j = warp % nslices, grp = (warp / nslices) % groups, e = warp / (nslices * groups);
    const int64_t c0 = j * V, c1 = min(c0 + V, C);
    const int64_t row0 = grp * f.m;
    const int64_t base = e * R * C;
    int keep[SAM_MAX_M];
    if (f.n < f.m) {
        double sal[SAM_MAX_M];
        for (int r = 0; r < f.m; r++) sal[r] = 0.0;
        for (int64_t cc = c0; cc < c1; cc += 128) {
            const int64_t c = cc + 4 * lane;
            for (int r = 0; r < f.m; r++) {
                double v = 0.0;
                if (c < c1) {
                    double s[4];
                    for (int k = 0; k < 4; k++) s[k] = src.at(base + (row0 + r) * C + c + k);
                    int i0, i1;
                    top2_of4(s, i0, i1);
                    v = s[i0] + s[i1];
                }
                // lane-ordered accumulation: the reference's order
                const int live = (int)(c1 - cc >= 128 ? 32 : (c1 - cc + 3) / 4);
                for (int k = 0; k < live; k++) sal[r] += __shfl_sync(FULL, v, k);
            }
        }
        for (int r = 0; r < f.m; r++) keep[r] = 0;
        for (int k = 0; k < f.n; k++) {
            int best = -1;
            for (int r = 0; r < f.m; r++)
                if (!keep[r] && (best < 0 || sal[r] > sal[best])) best = r;
            keep[best] = 1;
        }
    } else {
        keep[0] = 1;
    }
    for (int r = 0; r < f.m; r++) {
        for (int64_t c = c0 + 4 * lane; c < c1; c += 128) {
            uchar4 out = make_uchar4(0, 0, 0, 0);
            if (keep[r]) {
                double s[4];
                for (int k = 0; k < 4; k++) s[k] = src.at(base + (row0 + r) * C + c + k);
                int i0, i1;
                top2_of4(s, i0, i1);
                unsigned char b[4] = {0, 0, 0, 0};
                b[i0] = 1;
                b[i1] = 1;
                out = make_uchar4(b[0], b[1], b[2], b[3]);
            }
            *reinterpret_cast<uchar4 *>(mask + base + (row0 + r) * C + c) = out;
        }
    }
}

// Error record: kind in the top byte, flat element index below.
enum : unsigned long long {
    ERR_NONE = ~0ull,
    ERR_ROWS = 1ull,      // a slice of a row group keeps more than n rows
    ERR_COLS = 2ull,      // a 4-column group keeps more than 2
    ERR_IDX = 3ull,       // idx out of range or not increasing
    ERR_META = 4ull,      // invalid 2:4 code
};
__device__ __forceinline__ void report(unsigned long long *err, unsigned long long kind, int64_t flat) {
    atomicMin(err, (kind << 56) | (unsigned long long)flat);
}

// (a) selection: one warp per (e, half, group, slice).
__global__ void select_kernel(uint8_t *idx, const uint8_t *mask, sam_format f, sam_dims d,
                              unsigned long long *err) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int64_t groups = d.R / f.m;  // both halves together: groups never straddle them
    if (warp >= d.E * groups * d.slices) return;
    const int64_t j = warp % d.slices, grp = (warp / d.slices) % groups, e = warp / (d.slices * groups);
    const int64_t c0 = j * f.v, c1 = min(c0 + (int64_t)f.v, d.C);
    const int64_t row0 = grp * f.m;
    const int h = (int)(row0 / d.half_rows);
    const int64_t hgrp = (row0 - h * d.half_rows) / f.m;
    int used[SAM_MAX_M], chosen[SAM_MAX_M], nch = 0;
    for (int r = 0; r < f.m; r++) {
        bool any = false;
        for (int64_t c = c0 + 4 * lane; c < c1; c += 128)
            any |= *reinterpret_cast<const uint32_t *>(mask + (e * d.R + row0 + r) * d.C + c) != 0u;
        used[r] = __any_sync(FULL, any) ? 1 : 0;
        if (used[r]) {
            if (nch == f.n) {
                if (lane == 0) report(err, ERR_ROWS, (e * d.R + row0) * d.C + c0);
                return;
            }
            chosen[nch++] = r;
        }
    }
    for (int r = 0; r < f.m && nch < f.n; r++)
        if (!used[r]) { used[r] = 1; chosen[nch++] = r; }
    for (int a = 1; a < nch; a++)
        for (int b = a; b > 0 && chosen[b - 1] > chosen[b]; b--) {
            int t = chosen[b]; chosen[b] = chosen[b - 1]; chosen[b - 1] = t;
        }
    if (lane < f.n) {
        int s = 0;
        for (int k = 0; k < f.n; k++) if (k == lane) s = chosen[k];
        const int64_t p = sam_storage_index(f.glu, h, hgrp * f.n + lane);
        idx[(e * d.slices + j) * d.rp + p] = (uint8_t)s;
    }
}

// (b) values and metadata: one thread per metadata word.
template <typename T>
__global__ void pack_kernel(T *values, uint32_t *meta, const uint8_t *idx, const T *w, const uint8_t *mask,
                            sam_format f, sam_dims d, unsigned long long *err) {
    const int64_t words_per_e = sam_meta_per_expert(&d);
    const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= d.E * words_per_e) return;
    const int64_t e = gid / words_per_e, wi = gid % words_per_e;
    const int64_t ksteps = d.cp / 32;
    const int64_t tile = wi / 16, word = wi % 16;
    const int64_t p16 = tile / ksteps, ks = tile % ksteps;
    const int r = (int)(word / 2), hh = (int)(word % 2);
    const int64_t cbase = ks * 32 + hh * 16;
    uint32_t out_word = 0;
    for (int rr = 0; rr < 2; rr++) {
        const int64_t p = p16 * 16 + r + 8 * rr;
        int h;
        int64_t q;
        const bool live = sam_storage_row(&d, f.glu, p, &h, &q);
        alignas(16) T vals[8];
        for (int g = 0; g < 4; g++) {
            const int64_t c = cbase + 4 * g;
            unsigned nib = SAM_META_PAD;
            T v0 = Elem<T>::from_f(0.0f), v1 = Elem<T>::from_f(0.0f);
            if (live && c < d.C) {
                int s = 0;
                if (f.n < f.m) s = idx[(e * d.slices + c / f.v) * d.rp + p];
                const int64_t orow = sam_original_row(f, &d, h, q, s);
                const int64_t flat = (e * d.R + orow) * d.C + c;
                const uint32_t mw = *reinterpret_cast<const uint32_t *>(mask + flat);
                int pos[4], np = 0, kept[4] = {0, 0, 0, 0};
                for (int k = 0; k < 4; k++)
                    if ((mw >> (8 * k)) & 0xffu) {
                        if (np == 2) { report(err, ERR_COLS, flat); np = 3; break; }
                        pos[np++] = k;
                        kept[k] = 1;
                    }
                if (np == 3) np = 2;
                for (int k = 0; k < 4 && np < 2; k++)
                    if (!kept[k]) { pos[np++] = k; kept[k] = 2; }
                const int i0 = min(pos[0], pos[1]), i1 = max(pos[0], pos[1]);
                if (kept[i0] == 1) v0 = w[flat + i0];
                if (kept[i1] == 1) v1 = w[flat + i1];
                nib = (unsigned)(i0 | (i1 << 2));
            }
            vals[2 * g] = v0;
            vals[2 * g + 1] = v1;
            out_word |= nib << (16 * rr + 4 * g);
        }
        T *dst = values + (e * d.rp + p) * (d.cp / 2) + cbase / 2;
#pragma unroll
        for (int v = 0; v < (int)(sizeof(vals) / 16); v++)
            reinterpret_cast<uint4 *>(dst)[v] = reinterpret_cast<const uint4 *>(vals)[v];
    }
    meta[gid] = out_word;
}

template <typename T>
__global__ void unpack_kernel(T *out, const T *values, const uint32_t *meta, const uint8_t *idx, sam_format f,
                              sam_dims d, unsigned long long *err) {
    const int64_t words_per_e = sam_meta_per_expert(&d);
    const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= d.E * words_per_e) return;
    const int64_t e = gid / words_per_e, wi = gid % words_per_e;
    const int64_t ksteps = d.cp / 32;
    const int64_t tile = wi / 16, word = wi % 16;
    const int64_t p16 = tile / ksteps, ks = tile % ksteps;
    const int r = (int)(word / 2), hh = (int)(word % 2);
    const int64_t cbase = ks * 32 + hh * 16;
    const uint32_t mw = meta[gid];
    for (int rr = 0; rr < 2; rr++) {
        const int64_t p = p16 * 16 + r + 8 * rr;
        int h;
        int64_t q;
        if (!sam_storage_row(&d, f.glu, p, &h, &q)) continue;
        const T *src = values + (e * d.rp + p) * (d.cp / 2) + cbase / 2;
        for (int g = 0; g < 4; g++) {
            const int64_t c = cbase + 4 * g;
            if (c >= d.C) break;
            int s = 0;
            if (f.n < f.m) {
                const int64_t j = c / f.v;
                s = idx[(e * d.slices + j) * d.rp + p];
                bool bad = s >= f.m;
                if (!bad && q % f.n > 0) {
                    const int64_t pp = sam_storage_index(f.glu, h, q - 1);
                    bad = idx[(e * d.slices + j) * d.rp + pp] >= s;
                }
                if (bad) { report(err, ERR_IDX, (e * d.slices + j) * d.rp + p); continue; }
            }
            const unsigned nib = (mw >> (16 * rr + 4 * g)) & 0xfu;
            if (!sam_nibble_valid(nib)) { report(err, ERR_META, (e * d.rp + p) * d.cp + c); continue; }
            const int64_t orow = sam_original_row(f, &d, h, q, s);
            T *dst = out + (e * d.R + orow) * d.C + c;
            dst[nib & 3u] = src[2 * g];
            dst[nib >> 2] = src[2 * g + 1];
        }
    }
}

// Reads the error record after the stream's work; formats it like the reference.
sam_status check_errors(unsigned long long *derr, cudaStream_t stream, const char *op, const sam_dims &d,
                        sam_format f) {
    unsigned long long herr = ERR_NONE;
    cudaError_t e1 = cudaMemcpyAsync(&herr, derr, sizeof herr, cudaMemcpyDeviceToHost, stream);
    cudaError_t e2 = cudaStreamSynchronize(stream);
    cudaFreeAsync(derr, stream);
    if (e1 != cudaSuccess) return cuda_status(e1, op);
    if (e2 != cudaSuccess) return cuda_status(e2, op);
    if (herr == ERR_NONE) return SAM_STATUS_OK;
    const unsigned long long kind = herr >> 56, flat = herr & ((1ull << 56) - 1);
    const long long C = d.C, R = d.R;
    if (kind == ERR_ROWS) {
        long long e = flat / (R * C), row = flat / C % R, c = flat % C;
        set_error("mask: expert %lld, rows %lld..%lld, columns from %lld keep more than %d of %d rows; "
                  "the format allows %d", e, row, row + f.m - 1, c, f.n, f.m, f.n);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (kind == ERR_COLS) {
        long long e = flat / (R * C), row = flat / C % R, c = flat % C;
        set_error("mask: expert %lld, row %lld, columns %lld..%lld keep more than 2 of 4", e, row, c, c + 3);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (kind == ERR_IDX) {
        long long p = flat % d.rp, j = flat / d.rp % d.slices, e = flat / (d.rp * d.slices);
        set_error("idx: expert %lld, slice %lld, storage row %lld is out of range or not increasing "
                  "within its group", e, j, p);
        return SAM_STATUS_BAD_DATA;
    }
    long long c = flat % d.cp, p = flat / d.cp % d.rp, e = flat / (d.cp * d.rp);
    set_error("meta: expert %lld, storage row %lld, columns %lld..%lld hold an invalid 2:4 code", e, p, c,
              c + 3);
    return SAM_STATUS_BAD_DATA;
}

sam_status alloc_error(unsigned long long **derr, cudaStream_t stream, const char *op) {
    SAM_CUDA_TRY(cudaMallocAsync((void **)derr, sizeof(unsigned long long), stream), op);
    SAM_CUDA_TRY(cudaMemsetAsync(*derr, 0xff, sizeof(unsigned long long), stream), op);
    return SAM_STATUS_OK;
}

template <typename T>
sam_status pack_typed(void *values, uint32_t *meta, uint8_t *idx, const void *w, const uint8_t *mask,
                      sam_format f, const sam_dims *d, cudaStream_t stream) {
    unsigned long long *derr = nullptr;
    sam_status st = alloc_error(&derr, stream, "format_pack");
    if (st != SAM_STATUS_OK) return st;
    if (f.n < f.m && d->E * d->R > 0 && d->slices > 0) {
        SAM_CUDA_TRY(cudaMemsetAsync(idx, 0, (size_t)(d->E * sam_idx_per_expert(d)), stream), "format_pack");
        const int64_t warps = d->E * (d->R / f.m) * d->slices;
        select_kernel<<<(unsigned)ceil_div(warps, 8), 256, 0, stream>>>(idx, mask, f, *d, derr);
        if ((st = launch_status("format_pack")) != SAM_STATUS_OK) return st;
    }
    const int64_t words = d->E * sam_meta_per_expert(d);
    if (words > 0) {
        pack_kernel<T><<<(unsigned)ceil_div(words, 256), 256, 0, stream>>>(
            static_cast<T *>(values), meta, idx, static_cast<const T *>(w), mask, f, *d, derr);
        if ((st = launch_status("format_pack")) != SAM_STATUS_OK) return st;
    }
    return check_errors(derr, stream, "format_pack", *d, f);
}

template <typename T>
sam_status unpack_typed(void *out, const void *values, const uint32_t *meta, const uint8_t *idx, sam_format f,
                        const sam_dims *d, cudaStream_t stream) {
    const size_t bytes = (size_t)(d->E * d->R * d->C) * sizeof(T);
    if (bytes) SAM_CUDA_TRY(cudaMemsetAsync(out, 0, bytes, stream), "format_unpack");
    unsigned long long *derr = nullptr;
    sam_status st = alloc_error(&derr, stream, "format_unpack");
    if (st != SAM_STATUS_OK) return st;
    const int64_t words = d->E * sam_meta_per_expert(d);
    if (words > 0) {
        unpack_kernel<T><<<(unsigned)ceil_div(words, 256), 256, 0, stream>>>(
            static_cast<T *>(out), static_cast<const T *>(values), meta, idx, f, *d, derr);
        if ((st = launch_status("format_unpack")) != SAM_STATUS_OK) return st;
    }
    return check_errors(derr, stream, "format_unpack", *d, f);
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_format_mask_cuda(uint8_t *mask, const void *w, sam_dtype wt, const void *scores,
                                           sam_dtype st, sam_format f, const sam_dims *d, void *stream) {
    const int64_t V = f.n < f.m ? f.v : (d->C > 0 ? d->C : 1);
    const int64_t nslices = f.n < f.m ? d->slices : 1;
    const int64_t warps = d->E * (d->R / f.m) * nslices;
    if (warps == 0 || d->C == 0) return SAM_STATUS_OK;
    sam::ScoreSrc src{w, wt, scores, st};
    sam::mask_kernel<<<(unsigned)sam::ceil_div(warps, 8), 256, 0, (cudaStream_t)stream>>>(
        mask, src, f, d->E, d->R, d->C, V, nslices);
    return sam::launch_status("format_mask");
}

extern "C" sam_status sam_format_pack_cuda(void *values, uint32_t *meta, uint8_t *idx, const void *w,
                                           const uint8_t *mask, sam_dtype t, sam_format f, const sam_dims *d,
                                           void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    switch (t) {
    case SAM_BF16: return sam::pack_typed<__nv_bfloat16>(values, meta, idx, w, mask, f, d, s);
    case SAM_F16: return sam::pack_typed<__half>(values, meta, idx, w, mask, f, d, s);
    case SAM_F32: return sam::pack_typed<float>(values, meta, idx, w, mask, f, d, s);
    default: sam::set_error("format_pack: unsupported dtype"); return SAM_STATUS_UNSUPPORTED;
    }
}

extern "C" sam_status sam_format_unpack_cuda(void *out, const void *values, const uint32_t *meta,
                                             const uint8_t *idx, sam_dtype t, sam_format f, const sam_dims *d,
                                             void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    switch (t) {
    case SAM_BF16: return sam::unpack_typed<__nv_bfloat16>(out, values, meta, idx, f, d, s);
    case SAM_F16: return sam::unpack_typed<__half>(out, values, meta, idx, f, d, s);
    case SAM_F32: return sam::unpack_typed<float>(out, values, meta, idx, f, d, s);
    default: sam::set_error("format_unpack: unsupported dtype"); return SAM_STATUS_UNSUPPORTED;
    }
}

namespace sam {
namespace {

// format_gather: 8 outputs a thread where count, out and src allow (two 16-byte loads of src,
// 8 element loads, one or two 16-byte stores), else one.  One pass of a grid in place order,
// no grid-stride loop: the CTAs run roughly in order, so the sources in flight stay within a
// narrow window of places and hit L2 (a grid-stride loop let the CTAs drift apart over the
// places: Mixtral-8x7B's gate_up refresh took 4.2 ms against 2.5 ms for torch's gather).
template <typename E, bool VEC>
__global__ void gather_kernel(E *out, const E *values, int64_t n, const int32_t *src, int64_t count) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        const int64_t i = t * 8;
        if (i >= count) return;
        const int4 a = *reinterpret_cast<const int4 *>(src + i), b = *reinterpret_cast<const int4 *>(src + i + 4);
        const int32_t j[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        E v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = j[u] >= 0 && j[u] < n ? __ldg(values + j[u]) : E(0);
#pragma unroll
        for (int q = 0; q < (int)(8 * sizeof(E)) / 16; q++)
            reinterpret_cast<uint4 *>(out + i)[q] = reinterpret_cast<const uint4 *>(v)[q];
    } else {
        if (t >= count) return;
        const int32_t j = src[t];
        out[t] = j >= 0 && j < n ? values[j] : E(0);
    }
}

template <typename E>
sam_status gather_typed(void *out, const void *values, int64_t n, const int32_t *src, int64_t count,
                        cudaStream_t s) {
    const bool vec = count % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0 &&
                     (reinterpret_cast<uintptr_t>(src) & 15) == 0;
    const int64_t blocks = ceil_div(vec ? count / 8 : count, 256);
    if (blocks > INT32_MAX) {
        set_error("format_gather: %lld places is more than one launch takes", (long long)count);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (vec)
        gather_kernel<E, true><<<(unsigned)blocks, 256, 0, s>>>((E *)out, (const E *)values, n, src, count);
    else
        gather_kernel<E, false><<<(unsigned)blocks, 256, 0, s>>>((E *)out, (const E *)values, n, src, count);
    return launch_status("format_gather");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_format_gather_cuda(void *out, const void *values, int64_t n, int elem_bytes,
                                             const int32_t *src, int64_t count, void *stream) {
    if (count == 0) return SAM_STATUS_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (elem_bytes == 2) return sam::gather_typed<uint16_t>(out, values, n, src, count, s);
    if (elem_bytes == 4) return sam::gather_typed<uint32_t>(out, values, n, src, count, s);
    sam::set_error("format_gather: elements of 2 or 4 bytes, got %d", elem_bytes);
    return SAM_STATUS_UNSUPPORTED;
}

namespace sam {
namespace {

// format_transpose_values: one CTA per tile of W^T's packing, CT rows (W's columns c0 ..) by
// 64 places (W's rows r0 .. r0 + 127), E = the element's bits (uint16_t / uint32_t); CT = 256 /
// sizeof(E), so a condensed row's values in a tile are one 128-byte line, and so are a W^T row's
// places.  Two steps:
// 1. W's tile, transposed, into a zeroed shared tile: every condensed row whose original row falls
//    in the tile, 16 columns an item (8 values in one or two 16-byte loads, their four meta
//    nibbles in one word, one row index: V is a multiple of 32), each value written at
//    [column][row].  A thread keeps one 16-column group for the whole tile, so its column, slice
//    and the column parts of its addresses are computed once; per item only the condensed row's
//    parts (shifts and one multiply), TV_U items' loads in flight together.
// 2. Every place reads the row its tmeta nibble names from that tile (8 places a thread: one
//    tmeta half-word, loaded before step 1; 16-byte stores, 8 threads a 128-byte row).
// W's values are read once, the places written once; no index map.  (A first version that did
// 64-bit divisions per item was bound by its integer instructions: 42 % of the copy rate; the
// next read 4 columns an item in 4-byte loads: 67 % of an H100's copy rate, less on an H200.)
constexpr int TV_K = 64;          // places of a W^T row per tile
constexpr int TV_ROWS = 2 * TV_K; // W's rows per tile
constexpr int TV_THREADS = 256;
constexpr int TV_U = 2;           // step 1's items a thread has in flight

template <typename E>
__global__ void __launch_bounds__(TV_THREADS) transpose_values_kernel(E *out, const uint32_t *tmeta,
                                                                      const E *values, const uint32_t *meta,
                                                                      const uint8_t *idx, sam_format f, sam_dims d,
                                                                      sam_dims td) {
    constexpr int CT = 256 / (int)sizeof(E);         // W's columns (W^T's rows) per tile
    constexpr int LD = TV_ROWS + 4 / (int)sizeof(E);  // tile row pitch: one word past the rows
    constexpr int G = CT / 16;                        // 16-column groups per condensed row
    constexpr int QS = TV_THREADS / G;                // condensed rows a pass of the CTA covers
    constexpr int P2 = CT * (TV_K / 8) / TV_THREADS;  // step 2's 8-place pieces a thread
    constexpr int W = (int)sizeof(E) / 2;             // 16-byte words of eight values
    __shared__ __align__(16) E tile[CT * LD];
    const int64_t e = blockIdx.z;
    const int c0 = (int)blockIdx.x * CT;
    const int k0 = (int)blockIdx.y * TV_K, r0 = 2 * k0;
    const int64_t tk = td.cp / 2;

    // step 2's tmeta half-words, first: they depend on nothing here
    uint32_t hw[P2];
#pragma unroll
    for (int j = 0; j < P2; j++) {
        const int it = threadIdx.x + j * TV_THREADS;
        const int c = c0 + it / (TV_K / 8), tc = 2 * (k0 + 8 * (it % (TV_K / 8)));
        hw[j] = c < td.rp ? __ldg(tmeta + e * sam_meta_per_expert(&td) + sam_meta_word(&td, c, tc)) >>
                                sam_meta_shift(c, tc)
                          : 0u;   // (W^T's rows past its last 64-row tile: none)
    }
    for (int i = threadIdx.x; i < CT * LD * (int)sizeof(E) / 16; i += TV_THREADS)
        reinterpret_cast<uint4 *>(tile)[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();

    // this thread's 16-column group, for the whole tile
    const int gl = threadIdx.x % G, c = c0 + 16 * gl;
    if (c < d.C) {
        const int64_t cp2 = d.cp / 2;
        const E *vcol = values + e * d.rp * cp2 + c / 2;
        const uint32_t *mcol = meta + e * sam_meta_per_expert(&d) + (c / 32) * 16 + (c % 32) / 16;
        const int groups = d.C - c >= 16 ? 4 : (d.C - c + 3) / 4;   // 4-column groups inside C
        const uint8_t *icol = idx != nullptr ? idx + (e * d.slices + c / f.v) * d.rp : nullptr;
        E *tcol = tile + 16 * gl * LD;
        for (int h = 0; h < (f.glu ? 2 : 1); h++) {
            const int base = h * (int)d.half_rows;
            const int lo = r0 - base > 0 ? r0 - base : 0;
            const int hi = r0 + TV_ROWS - base < (int)d.half_rows ? r0 + TV_ROWS - base : (int)d.half_rows;
            if (lo >= hi) continue;
            const int qlo = lo / f.m * f.n, qend = (hi - 1) / f.m * f.n + f.n;
            const int qhi = qend < (int)d.rc ? qend : (int)d.rc;
            for (int q0 = qlo + (int)threadIdx.x / G; q0 < qhi; q0 += TV_U * QS) {
                int s[TV_U], p[TV_U];
                uint32_t w[TV_U];
                uint4 v8[TV_U][W];
#pragma unroll
                for (int u = 0; u < TV_U; u++) {
                    const int q = q0 + u * QS;
                    s[u] = -1;
                    if (q >= qhi) continue;
                    p[u] = f.glu ? ((q / SAM_GLU_CHUNK) * 2 + h) * SAM_GLU_CHUNK + q % SAM_GLU_CHUNK : q;
                    s[u] = icol != nullptr ? (int)__ldg(icol + p[u]) : 0;
                    w[u] = __ldg(mcol + (int64_t)(p[u] / 16) * cp2 + 2 * (p[u] % 8));
                    const uint4 *src = reinterpret_cast<const uint4 *>(vcol + (int64_t)p[u] * cp2);
#pragma unroll
                    for (int k = 0; k < W; k++) v8[u][k] = __ldg(src + k);
                }
#pragma unroll
                for (int u = 0; u < TV_U; u++) {
                    const int q = q0 + u * QS;
                    if (s[u] < 0 || s[u] >= f.m) continue;   // (past the rows; a malformed row index)
                    const int row = base + (f.n == 1 ? q : q / f.n) * f.m + s[u] - r0;
                    if (row < 0 || row >= TV_ROWS) continue;
                    const uint32_t nibs = w[u] >> ((p[u] % 16) / 8 * 16);
                    const E *v = reinterpret_cast<const E *>(v8[u]);
#pragma unroll
                    for (int g = 0; g < 4; g++) {
                        if (g >= groups) break;
                        const uint32_t nib = nibs >> (4 * g);
                        tcol[(4 * g + (nib & 3u)) * LD + row] = v[2 * g];
                        tcol[(4 * g + ((nib >> 2) & 3u)) * LD + row] = v[2 * g + 1];
                    }
                }
            }
        }
    }
    __syncthreads();

#pragma unroll
    for (int j = 0; j < P2; j++) {
        const int it = threadIdx.x + j * TV_THREADS;
        const int cl = it / (TV_K / 8), kc = it % (TV_K / 8);
        if (c0 + cl >= td.rp) continue;
        const E *src = tile + cl * LD + 16 * kc;
        E v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const unsigned nib = (hw[j] >> (4 * (i / 2))) & 0xfu;
            v[i] = src[4 * (i / 2) + ((i & 1) ? (nib >> 2) : (nib & 3u))];
        }
        uint4 *dst = reinterpret_cast<uint4 *>(out + (e * td.rp + c0 + cl) * tk + k0 + 8 * kc);
#pragma unroll
        for (int q = 0; q < W; q++) dst[q] = reinterpret_cast<const uint4 *>(v)[q];
    }
}

template <typename E>
sam_status transpose_values_typed(void *out, const uint32_t *tmeta, const void *values, const uint32_t *meta,
                                  const uint8_t *idx, sam_format f, const sam_dims &d, const sam_dims &td,
                                  cudaStream_t s) {
    constexpr int CT = 256 / (int)sizeof(E);
    const int64_t ctiles = ceil_div(td.rp, (int64_t)CT), ktiles = td.cp / 2 / TV_K;
    if (d.E == 0 || ctiles == 0 || ktiles == 0) return SAM_STATUS_OK;
    if ((td.cp / 2) % TV_K != 0 || ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(values)) & 15)) {
        set_error("format_transpose_values: out and values must start on 16 bytes");
        return SAM_STATUS_UNSUPPORTED;
    }
    // (32-bit row and column arithmetic: R and C are below 2**31 - 256, the binding's bound)
    if (ctiles > INT32_MAX || ktiles > 65535 || d.E > 65535 || d.R > INT32_MAX - 256 || d.C > INT32_MAX - 256) {
        set_error("format_transpose_values: a weight of %lld experts and %lld x %lld is more than one launch takes",
                  (long long)d.E, (long long)d.R, (long long)d.C);
        return SAM_STATUS_UNSUPPORTED;
    }
    transpose_values_kernel<E><<<dim3((unsigned)ctiles, (unsigned)ktiles, (unsigned)d.E), TV_THREADS, 0, s>>>(
        (E *)out, tmeta, (const E *)values, meta, idx, f, d, td);
    return launch_status("format_transpose_values");
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_format_transpose_values_cuda(void *out, const uint32_t *tmeta, const void *values,
                                                       const uint32_t *meta, const uint8_t *idx, int elem_bytes,
                                                       sam_format f, const sam_dims *d, const sam_dims *td,
                                                       void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (elem_bytes == 2)
        return sam::transpose_values_typed<uint16_t>(out, tmeta, values, meta, idx, f, *d, *td, s);
    if (elem_bytes == 4)
        return sam::transpose_values_typed<uint32_t>(out, tmeta, values, meta, idx, f, *d, *td, s);
    sam::set_error("format_transpose_values: elements of 2 or 4 bytes, got %d", elem_bytes);
    return SAM_STATUS_UNSUPPORTED;
}
