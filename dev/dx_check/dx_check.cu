// dx_check.cu -- a standalone check of cuda/ssmm_dx.cu against a float64 decode of the packed
// layout (docs/FORMAT.md), built without the extension (seconds; no torch), then timed at
// Mixtral-8x7B's two dX products (T = 4096, K = 2):
//   nvcc -O2 -std=c++17 --expt-relaxed-constexpr -DSAM_ARCHS='"90a"' -I cuda -gencode=arch=compute_90a,code=sm_90a \
//        dev/dx_check/dx_check.cu cuda/ssmm_dx.cu cuda/device.cu -o /tmp/dx_check && /tmp/dx_check
// Random packings (idx, 2:4 codes, values; padding rows and columns zero), routing with empty
// experts, placeholders past offsets[E] and an invalid token id; out poisoned with NaN.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "samoyeds_cuda.h"

static uint32_t rng = 12345u;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5; return rng; }
static float frand() { return (rnd() & 0xffffff) / 16777216.0f * 2.0f - 1.0f; }
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }
static double fb(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("cuda %s line %d\n", cudaGetErrorString(e_), __LINE__); exit(2); } } while (0)

static int run(int E, int R, int C, int glu, int M, int V, int T, int K, int with_ids, int with_scale, int reps) {
    const int half = glu ? R / 2 : R, rch = half / M;
    const int hrp = (rch + 63) / 64 * 64, rp = glu ? 2 * hrp : hrp, cp = (C + 127) / 128 * 128;
    const int slices = M > 1 ? (C + V - 1) / V : 1;
    std::vector<uint16_t> vals((size_t)E * rp * cp / 2, 0);
    std::vector<uint32_t> meta((size_t)E * (rp / 16) * (cp / 32) * 16, 0);
    std::vector<uint8_t> idx((size_t)E * slices * rp, 0);
    static const int codes[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
    for (int e = 0; e < E; e++)
        for (int p = 0; p < rp; p++) {
            const int q = glu ? (p / 128) * 64 + p % 64 : p;   // condensed row (GLU: of its half)
            const bool live = q < rch;
            for (int j = 0; j < slices; j++) idx[((size_t)e * slices + j) * rp + p] = live && M > 1 ? rnd() % M : 0;
            for (int c = 0; c < cp; c += 4) {
                const int code = live && c < C ? rnd() % 6 : 0;
                const int i0 = codes[code][0], i1 = codes[code][1];
                const size_t word = (size_t)e * (rp / 16) * (cp / 32) * 16 + ((size_t)(p / 16) * (cp / 32) + c / 32) * 16 +
                                    2 * (p % 8) + (c % 32) / 16;
                meta[word] |= (uint32_t)(i0 | (i1 << 2)) << ((p % 16) / 8 * 16 + (c % 16) / 4 * 4);
                for (int k = 0; k < 2; k++)
                    vals[((size_t)e * rp + p) * (cp / 2) + c / 2 + k] = live && c < C ? bf(frand()) : 0;
            }
        }
    // routing: random experts in [0, E] (E: placeholder), expert 1 empty
    const int S = T * K;
    std::vector<int> cnt(E + 1, 0), eid(S);
    for (int s = 0; s < S; s++) { int x = rnd() % (E + 1); if (x == 1 && E > 2) x = 0; eid[s] = x; cnt[x]++; }
    std::vector<int32_t> off(E + 1, 0), tok(S, 0);
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + cnt[e];
    { std::vector<int> fill(off.begin(), off.end() - 1); int tail = off[E];
      for (int s = 0; s < S; s++) { const int x = eid[s]; tok[x < E ? fill[x]++ : tail++] = s / K; } }
    if (with_ids && off[E] > 3) tok[2] = T + 9;   // invalid: a zero row
    const int dyrows = with_ids ? T : S, lddy = (R + 7) / 8 * 8;
    std::vector<uint16_t> dy((size_t)dyrows * lddy);
    for (auto &x : dy) x = bf(frand());
    std::vector<float> sc(S);
    for (auto &x : sc) x = (rnd() & 0xffff) / 65536.0f;
    // the oracle (float64, from the packed layout by FORMAT.md's rules), on every row or, for
    // large cases, every `step`-th one
    const int step = (size_t)S * rp * (size_t)C > 4e9 ? 613 : 1;
    std::vector<double> want((size_t)S * C, 0.0);
    for (int e = 0; e < E; e++)
        for (int s = off[e]; s < off[e + 1]; s++) {
            if (s % step) continue;
            const int t = with_ids ? tok[s] : s;
            if (t < 0 || t >= dyrows) continue;
            double *o = &want[(size_t)s * C];
            for (int p = 0; p < rp; p++) {
                int h = 0, q = p;
                if (glu) { const int ch = p / 64; h = ch & 1; q = (ch >> 1) * 64 + p % 64; }
                if (q >= rch) continue;
                for (int c = 0; c < C; c += 4) {
                    const int j = M > 1 ? c / V : 0;
                    const int r = h * half + q * M + idx[((size_t)e * slices + j) * rp + p];
                    const double g = fb(dy[(size_t)t * lddy + r]);
                    const size_t word = (size_t)e * (rp / 16) * (cp / 32) * 16 +
                                        ((size_t)(p / 16) * (cp / 32) + c / 32) * 16 + 2 * (p % 8) + (c % 32) / 16;
                    const uint32_t nib = (meta[word] >> ((p % 16) / 8 * 16 + (c % 16) / 4 * 4)) & 15u;
                    const uint16_t *v = &vals[((size_t)e * rp + p) * (cp / 2) + c / 2];
                    o[c + (nib & 3)] += g * fb(v[0]);
                    o[c + (nib >> 2)] += g * fb(v[1]);
                }
            }
            if (with_scale) for (int c = 0; c < C; c++) o[c] *= sc[s];
        }
    // the device
    void *d_vals, *d_meta, *d_idx, *d_dy, *d_off, *d_tok, *d_sc, *d_out;
    CK(cudaMalloc(&d_vals, vals.size() * 2)); CK(cudaMalloc(&d_meta, meta.size() * 4));
    CK(cudaMalloc(&d_idx, idx.size() + 16)); CK(cudaMalloc(&d_dy, dy.size() * 2 + 16));
    CK(cudaMalloc(&d_off, off.size() * 4)); CK(cudaMalloc(&d_tok, S * 4 + 4)); CK(cudaMalloc(&d_sc, S * 4 + 4));
    CK(cudaMalloc(&d_out, (size_t)S * C * 2 + 16));
    CK(cudaMemcpy(d_vals, vals.data(), vals.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_idx, idx.data(), idx.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_dy, dy.data(), dy.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_off, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_tok, tok.data(), S * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_sc, sc.data(), S * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_out, 0xff, (size_t)S * C * 2));   // NaN
    sam_ssmm_dx_params p;
    memset(&p, 0, sizeof p);
    p.dy = d_dy; p.T = dyrows; p.lddy = lddy; p.dtype = SAM_BF16;
    p.values = d_vals; p.meta = (const uint32_t *)d_meta; p.idx = M > 1 ? (const uint8_t *)d_idx : nullptr;
    p.f.n = 1; p.f.m = M; p.f.v = M > 1 ? V : 0; p.f.glu = glu;
    p.d.E = E; p.d.R = R; p.d.C = C; p.d.rc = rch; p.d.rp = rp; p.d.cp = cp; p.d.slices = M > 1 ? slices : 0;
    p.d.half_rows = half; p.d.half_rp = hrp;
    p.offsets = (const int32_t *)d_off; p.token_ids = with_ids ? (const int32_t *)d_tok : nullptr; p.S = S;
    p.scale = with_scale ? (const float *)d_sc : nullptr; p.out = d_out; p.ldo = C;
    sam_status st = sam_ssmm_dx_cuda(&p, nullptr);
    CK(cudaDeviceSynchronize());
    if (st != SAM_STATUS_OK) { printf("status %d: %s\n", st, sam_cuda_last_error()); return 1; }
    std::vector<uint16_t> got((size_t)S * C);
    CK(cudaMemcpy(got.data(), d_out, got.size() * 2, cudaMemcpyDeviceToHost));
    double err = 0, mx = 0;
    int bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        const double g = fb(got[i]), w = want[i];
        if (!isfinite(g)) { bad++; continue; }
        if (i / C >= (size_t)off[E] && g != 0.0) bad++;
        if ((i / C) % step) continue;
        err = fmax(err, fabs(g - w));
        mx = fmax(mx, fabs(w));
    }
    // determinism
    std::vector<uint16_t> again((size_t)S * C);
    CK(cudaMemset(d_out, 0xff, (size_t)S * C * 2));
    sam_ssmm_dx_cuda(&p, nullptr);
    CK(cudaMemcpy(again.data(), d_out, again.size() * 2, cudaMemcpyDeviceToHost));
    const bool same = memcmp(again.data(), got.data(), got.size() * 2) == 0;
    float ms = 0;
    if (reps > 0) {
        cudaEvent_t a, b;
        cudaEventCreate(&a); cudaEventCreate(&b);
        cudaEventRecord(a);
        for (int i = 0; i < reps; i++) sam_ssmm_dx_cuda(&p, nullptr);
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        cudaEventElapsedTime(&ms, a, b);
        ms /= reps;
    }
    const bool ok = bad == 0 && err <= 1e-2 * mx + 1e-6 && same;
    printf("%s E=%d R=%d C=%d glu=%d M=%d V=%d T=%d K=%d ids=%d scale=%d: max err %.3g of %.3g, bad %d, "
           "deterministic %d%s", ok ? "ok  " : "FAIL", E, R, C, glu, M, V, T, K, with_ids, with_scale, err, mx, bad,
           (int)same, reps ? "" : "\n");
    if (reps) printf(", %.3f ms = %.1f TFLOP/s over the kept rows\n", ms, 2.0 * off[E] * rp * (double)C / ms / 1e9);
    cudaFree(d_vals); cudaFree(d_meta); cudaFree(d_idx); cudaFree(d_dy); cudaFree(d_off); cudaFree(d_tok);
    cudaFree(d_sc); cudaFree(d_out);
    return ok ? 0 : 1;
}

int main() {
    int fails = 0;
    fails += run(4, 136, 200, 1, 2, 128, 37, 2, 1, 1, 0);
    fails += run(4, 136, 200, 0, 2, 64, 37, 2, 0, 1, 0);
    fails += run(5, 272, 264, 1, 4, 64, 129, 3, 1, 0, 0);
    fails += run(3, 96, 128, 0, 1, 0, 50, 2, 1, 1, 0);
    fails += run(3, 200, 72, 1, 1, 0, 61, 2, 0, 0, 0);     // half rows 100: dy by elements
    fails += run(3, 40, 264, 1, 2, 64, 33, 2, 1, 1, 0);    // half rows 20
    fails += run(4, 1152, 456, 0, 2, 192, 300, 2, 1, 1, 0);
    fails += run(3, 1280, 392, 0, 4, 320, 300, 2, 0, 1, 0);
    fails += run(8, 1024, 1024, 1, 2, 128, 1000, 2, 1, 0, 0);
    // Mixtral-8x7B at T = 4096 (K = 2): gate_up dX (R = 2I, C = H, sorted rows) and down dX
    // (R = H, C = I, dout by token id)
    fails += run(8, 28672, 4096, 1, 2, 128, 4096, 2, 0, 0, 10);
    fails += run(8, 4096, 14336, 0, 2, 128, 4096, 2, 1, 0, 10);
    printf("%d failed\n", fails);
    return fails != 0;
}
