// ssmm_epilogue.cuh -- the epilogue every ssmm kernel applies to its fp32 sums
// (csrc/ssmm_ref.c): out[s][col] = round(act(acc + bias_e) * scale[s]), a gated act
// pairing gate column col with the up column of the same GLU chunk pair
// (samoyeds_layout.h), one rounding to the output type, whole 16-byte pieces of output
// rows where the row stride and address allow.  Tokens with an invalid id and columns
// past out_cols are never written.
#pragma once

#include "ssmm_work.cuh"

namespace sam {

// The gated activation of gate v and up u of a launch (bias added).
__device__ __forceinline__ float gated_act(const SsmmArgs &p, float v, float u) {
    return gated_act((sam_act)p.act, p.alpha, p.limit, v, u);
}

// Output column col of expert e (col < out_cols: the bias applies): v plus its bias, and
// with a gated activation act(v + bias, up() + the up column's bias), bias_up = R / 2 the
// up columns' offset in the bias.  up() is read only for a gated activation.
template <typename Up>
__device__ __forceinline__ float epilogue_value(const SsmmArgs &p, int e, int64_t col, bool gated, int64_t bias_up,
                                                float v, Up up) {
    const bool in = col < p.out_cols;
    if (p.bias && in) v += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + col);
    if (gated) {
        float u = up();
        if (p.bias && in) u += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + bias_up + col);
        v = gated_act(p, v, u);
    }
    return v;
}

// A gated launch's pre-activation (p.preact): output columns c0 .. c0 + 7 of sorted row s,
// gate v(k) and up u(k) with their biases added as epilogue_value adds them, rounded once,
// to preact[s][c] (gate) and preact[s][R/2 + c] (up).  Columns past out_cols: not written.
template <typename T, typename V, typename U>
__device__ __forceinline__ void store_preact8(const SsmmArgs &p, int e, int64_t s, int64_t c0, V v, U u) {
    T *gate = static_cast<T *>(p.preact) + s * p.ldp + c0, *up = gate + p.R / 2;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        if (c0 + k >= p.out_cols) break;
        float a = v(k), b = u(k);
        if (p.bias) {
            a += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + c0 + k);
            b += load_as_float(p.bias, p.bias_dtype, (int64_t)e * p.R + p.R / 2 + c0 + k);
        }
        gate[k] = Elem<T>::from_f(a);
        up[k] = Elem<T>::from_f(b);
    }
}

// The epilogue of the mma.sp kernel: from the fp32 tile f[token][c]
// (c = local storage row * M + its row of the group, so c runs over original rows
// in order) of a CTA of BMT storage rows: bias, activation (the gate column of a
// GLU pair -- one pair per 128 storage rows, see the GLU layout -- pairs with the
// up column 64*M further), routing scale, 16-byte stores of whole output rows.
// Not unrolled: it stays small in the instruction cache.
template <typename T, int M, int BMT, int BN, int THREADS, int FS>
__device__ __forceinline__ void store_tile(const SsmmArgs &p, const float *ftile, const int32_t *tok_s, int e,
                                              int64_t row0, int64_t s0, int tid) {
    const bool gated = p.act != SAM_ACT_NONE;
    const int OC = gated ? BMT / 2 * M : BMT * M;
    const int64_t col0 = gated ? (row0 / 128) * 64 * M : row0 * M;
    const int64_t bias_up = gated ? p.R / 2 : 0;
    T *out = static_cast<T *>(p.out);
    const int chunks = OC / 8;
    const bool vec_ok = (p.ldo % 8 == 0) && ((reinterpret_cast<uintptr_t>(p.out) & 15) == 0);
#pragma unroll 1
    for (int id = tid; id < BN * chunks; id += THREADS) {
        const int ltok = id / chunks, ch = id % chunks;
        if (tok_s[ltok] < 0) continue;
        const int oc = ch * 8;
        const int64_t c0 = col0 + oc;
        if (c0 >= p.out_cols) continue;
        const int64_t s = s0 + ltok;
        const float sc = p.scale ? p.scale[s] : 1.0f;
        // gate column of output column oc: pair oc / (64 M), 128 M columns per pair
        const int src_c = gated ? (oc / (64 * M)) * 128 * M + oc % (64 * M) : oc;
        const float *src = ftile + ltok * FS + src_c;
        alignas(16) T y8[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float v = epilogue_value(p, e, c0 + k, gated, bias_up, src[k], [&] { return src[64 * M + k]; });
            y8[k] = Elem<T>::from_f(v * sc);
        }
        if (gated && p.preact)
            store_preact8<T>(p, e, s, c0, [&](int k) { return src[k]; }, [&](int k) { return src[64 * M + k]; });
        T *dst = out + s * p.ldo + c0;
        if (vec_ok && c0 + 8 <= p.out_cols) {
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(y8);
        } else {
            for (int k = 0; k < 8 && c0 + k < p.out_cols; k++) dst[k] = y8[k];
        }
    }
}

}  // namespace sam
