// ssmm_dw.cuh -- what the two ssmm_dw kernels share (ssmm_dw.cu: mma.sync, any sm_80+;
// ssmm_dw_wgmma.cu: wgmma, sm_90a): the launch arguments, the gather of the kept rows of
// dy from their M candidates (byte permutes), the routing scale, and the selection rule.
#pragma once

#include "common.cuh"
#include "ptx_mma.cuh"

namespace sam {

// The arguments of both kernels (sam_ssmm_dw_params resolved by the launcher).
struct DwArgs {
    const void *dy;
    int64_t lddy, S;
    const int32_t *dy_ids;  // null: sorted row s reads dy's row s
    int64_t Tdy;            // rows of dy (an id outside [0, Tdy) reads as a zero row)
    const void *x;
    int64_t T, ldx;
    const uint32_t *meta;
    const uint8_t *idx;
    const int32_t *offsets, *token_ids;
    const float *scale;
    void *out;
    int64_t C, cp, rp, rc, half_rows, slices;
    int E, glu, v, nrb, ncb, nslot, dy_vec;
    // the wgmma kernel's transposed copy of dy (dyt_segment, ssmm_dw_wgmma.cu), or null
    const void *dyt;
    int64_t ldt;
};

// (device helpers: internal to each kernel file)
namespace {

// The row of dy that sorted row s reads: s, or dy_ids[s]; -1 where that id lies outside dy.
__device__ __forceinline__ int64_t dw_dy_row(const DwArgs &p, int64_t s) {
    if (p.dy_ids == nullptr) return s;
    const int64_t u = __ldg(p.dy_ids + s);
    return u >= 0 && u < p.Tdy ? u : -1;
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                              uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void sts_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

// The two 16-bit elements of a word as floats (low half first) and back (one rounding each).
template <typename T> __device__ __forceinline__ void unpack2(uint32_t w, float &a, float &b);
template <> __device__ __forceinline__ void unpack2<__nv_bfloat16>(uint32_t w, float &a, float &b) {
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
}
template <> __device__ __forceinline__ void unpack2<__half>(uint32_t w, float &a, float &b) {
    a = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
    b = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
template <typename T> __device__ __forceinline__ uint32_t scale2(uint32_t w, float sc) {
    float a, b;
    unpack2<T>(w, a, b);
    return Elem<T>::pack2(a * sc, b * sc);
}

__device__ __forceinline__ float pick4(float v0, float v1, float v2, float v3, uint32_t i) {
    return i == 0 ? v0 : i == 1 ? v1 : i == 2 ? v2 : v3;
}

// The byte-permute selectors that gather storage rows 8*P8 .. +7 of a block from their
// 8 M candidate elements (16-bit, in registers) for one slice, two 32-bit words holding
// one 16-bit selector per output word o (rows 2o, 2o+1):
//   M = 2: rows 2o and 2o+1 have their candidates in words 2o and 2o+1; one permute of
//          that pair takes element idx of each;
//   M = 4: row 2o's four candidates are words 4o, 4o+1, row 2o+1's words 4o+2, 4o+3; the
//          low byte of the selector picks row 2o's element from its pair, the high byte
//          row 2o+1's from its pair, and a third permute joins the two halves.
// The M candidate 16-byte pieces of dy row `row` a thread gathers from: candidate rows
// u_base + 8 c ... (u_local: the first one's index in its half).  Whole 16-byte loads where dy
// is in 16-byte pieces (vec; rowok: the pieces inside the half), else element by element up
// to the half's last row; zeros for a row not read (ok false) or a block past the rows (live).
template <typename T, int M>
__device__ __forceinline__ void load_candidates(uint4 (&raw)[M], const T *row, int64_t u_base, int64_t u_local,
                                                int64_t half_rows, unsigned rowok, bool ok, bool live, bool vec) {
    if (vec) {
#pragma unroll
        for (int c = 0; c < M; c++) {
            raw[c] = make_uint4(0, 0, 0, 0);
            if (ok && ((rowok >> c) & 1u)) raw[c] = __ldg(reinterpret_cast<const uint4 *>(row + u_base + 8 * c));
        }
        return;
    }
    // rows not in 16-byte pieces (the half's rows or dy's row start not a multiple of 8)
    const unsigned short *r16 = reinterpret_cast<const unsigned short *>(row);
#pragma unroll
    for (int c = 0; c < M; c++) {
        uint32_t w[4];
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint32_t lo = 0, hi = 0;
            const int64_t l0 = u_local + 8 * c + 2 * t;
            if (ok && live && l0 < half_rows) lo = __ldg(r16 + u_base + 8 * c + 2 * t);
            if (ok && live && l0 + 1 < half_rows) hi = __ldg(r16 + u_base + 8 * c + 2 * t + 1);
            w[t] = lo | (hi << 16);
        }
        raw[c] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

template <int M> __device__ __forceinline__ void make_selectors(uint2 idx8, uint32_t (&sel)[2]) {
    uint32_t s[4];
#pragma unroll
    for (int o = 0; o < 4; o++) {
        const uint32_t w = o < 2 ? idx8.x : idx8.y;
        const uint32_t ia = (w >> (16 * (o & 1))) & (M - 1), ib = (w >> (16 * (o & 1) + 8)) & (M - 1);
        if (M == 2) {
            s[o] = (2 * ia) | ((2 * ia + 1) << 4) | ((4 + 2 * ib) << 8) | ((5 + 2 * ib) << 12);
        } else {
            s[o] = (2 * ia) | ((2 * ia + 1) << 4) | (((2 * ib) | ((2 * ib + 1) << 4)) << 8);
        }
    }
    sel[0] = s[0] | (s[1] << 16);
    sel[1] = s[2] | (s[3] << 16);
}

// Output word o of a gathered 16-byte piece from the candidates w[0 .. 4M).
template <int M>
__device__ __forceinline__ uint32_t gather_word(const uint32_t (&w)[4 * M], const uint32_t (&sel)[2], int o) {
    if (M == 1) return w[o];
    const uint32_t s = (sel[o >> 1] >> (16 * (o & 1))) & 0xffffu;
    if (M == 2) return __byte_perm(w[(2 * o) % (4 * M)], w[(2 * o + 1) % (4 * M)], s);
    const uint32_t lo = __byte_perm(w[(4 * o) % (4 * M)], w[(4 * o + 1) % (4 * M)], s & 0xffu);
    const uint32_t hi = __byte_perm(w[(4 * o + 2) % (4 * M)], w[(4 * o + 3) % (4 * M)], s >> 8);
    return __byte_perm(lo, hi, 0x5410);
}


}  // namespace

// ---- which kernel runs an ssmm_dw (sam_ssmm_dw_cuda) -------------------------------------
enum DwKernel { DW_MMA = 0, DW_WGMMA = 1 };

// The selection rule, a pure function of what the launcher knows: the wgmma kernel
// (ssmm_dw_wgmma.cu) wherever it runs (an sm_90 device with the sm_90a build:
// `wgmma_ok`), else the mma.sync kernel (ssmm_dw.cu), which takes every format, dtype and
// alignment the launcher accepts.  `force`: DW_MMA when the call asks for the mma.sync
// kernel (sam_ssmm_dw_params.impl = 1, `ssmm_dw(..., impl="mma")`), DW_WGMMA for either
// wgmma producer (impl 2, 3: an error where it cannot run), so that the tests run every
// kernel on an H100; -1 leaves the rule's choice.
inline DwKernel dw_choose_kernel(bool wgmma_ok, int force) {
    if (force == DW_MMA) return DW_MMA;
    return wgmma_ok ? DW_WGMMA : DW_MMA;
}

// Where the wgmma kernel runs, how its producer gets dy's kept rows: from a transposed copy
// of dy written first (one pass over dy, then 128-byte rows by cp.async), or gathered from
// dy itself (M candidate rows per kept row, picked by byte permutes, for every column
// block).  The copy wins at every C measured (768 to 14336, docs/KERNELS.md), so the rule
// takes it; the gather remains the fallback where the copy's memory cannot be had.
// `force`: 0 the gather, 1 the copy (sam_ssmm_dw_params.impl 2 and 3), -1 the rule.
inline bool dw_use_copy(int force) { return force != 0; }

// Whether the wgmma kernel can run on the current device (ssmm_dw_wgmma.cu).
bool ssmm_dw_wgmma_available();
// Launches it (a.* filled as for the mma kernel; m the format's M, 1, 2 or 4; copy: G from
// dy's transposed copy, else the gather).
sam_status ssmm_dw_wgmma_launch(const DwArgs &a, sam_dtype dtype, int m, bool copy, cudaStream_t stream);

}  // namespace sam
