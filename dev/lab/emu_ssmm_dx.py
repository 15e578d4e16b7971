"""An emulation of cuda/ssmm_dx.cu's index arithmetic, checked against the C reference
(sam_ssmm_dx_ref through samoyeds.ops.ssmm_dx on the CPU) on random cases.

What it follows, step by step as the kernel does (names as there):
  * the grid: blockIdx -> (e, rt, cb) by the prefix sum of the experts' row tiles, items
    ordered expert, column block, row tile; the CTAs past the last item zeroing the rows no
    expert owns (zero_rows);
  * load_k / write_k per thread: the B piece (16-byte values piece, the meta word and half),
    its expansion by __byte_perm with dense_sel, stored at the swizzled offsets; the A pieces
    from dy's candidate windows (the vector or element reads, the half's bounds), the
    selectors of ssmm_dw.cuh (make_selectors / gather_word, on the 16-bit patterns with
    __byte_perm's definition), stored per slot at the swizzled offsets;
  * mma_tile: the ldmatrix / ldmatrix.trans lane addresses and what each lane receives, and
    mma.m16n8k16's fragment layouts (A row, B col, C), independently of how write_k computed
    its offsets;
  * the epilogue: the C fragment's rows and columns, the scale, the row and column bounds.
Values are small integers (fp16 patterns; scales powers of two), so the emulated fp32 sums
must equal the reference's bit for bit.

  python dev/lab/emu_ssmm_dx.py [--cases 40] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BM, BN, BK, THREADS = 128, 128, 32, 256
AROW, ATILE = BK * 2, BM * BK * 2
BROW, BTILE = BN * 2, BK * BN * 2
STAGE = 2 * ATILE + BTILE


def byte_perm(x: int, y: int, s: int) -> int:
    b = [(x >> (8 * i)) & 0xff for i in range(4)] + [(y >> (8 * i)) & 0xff for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


def make_selectors(M: int, idx8: list) -> list:
    s = []
    for o in range(4):
        ia, ib = idx8[2 * o] & (M - 1), idx8[2 * o + 1] & (M - 1)
        if M == 2:
            s.append((2 * ia) | ((2 * ia + 1) << 4) | ((4 + 2 * ib) << 8) | ((5 + 2 * ib) << 12))
        else:
            s.append((2 * ia) | ((2 * ia + 1) << 4) | (((2 * ib) | ((2 * ib + 1) << 4)) << 8))
    return [s[0] | (s[1] << 16), s[2] | (s[3] << 16)]


def gather_word(M: int, w: list, sel: list, o: int) -> int:
    if M == 1:
        return w[o]
    s = (sel[o >> 1] >> (16 * (o & 1))) & 0xffff
    n = 4 * M
    if M == 2:
        return byte_perm(w[(2 * o) % n], w[(2 * o + 1) % n], s)
    lo = byte_perm(w[(4 * o) % n], w[(4 * o + 1) % n], s & 0xff)
    hi = byte_perm(w[(4 * o + 2) % n], w[(4 * o + 3) % n], s >> 8)
    return byte_perm(lo, hi, 0x5410)


def dense_sel(i0: int, i1: int, i: int) -> int:
    return 0x10 if i == i0 else 0x32 if i == i1 else 0x44


def f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


class Smem:
    def __init__(self, n):
        self.b = np.zeros(n, dtype=np.uint8)

    def sts_v4(self, addr, words):
        assert addr % 16 == 0
        self.b[addr:addr + 16] = np.array(words, dtype=np.uint32).view(np.uint8)

    def u32(self, addr):
        assert addr % 4 == 0
        return int(self.b[addr:addr + 4].view(np.uint32)[0])

    def u16(self, addr):
        assert addr % 2 == 0
        return int(self.b[addr:addr + 2].view(np.uint16)[0])


def ldmatrix_x4(sm, addrs, trans):
    """addrs[lane]: the row address lane gives; returns regs[lane][4] (32-bit words)."""
    regs = [[0] * 4 for _ in range(32)]
    for j in range(4):
        rows = addrs[8 * j:8 * j + 8]
        for t in range(32):
            if not trans:
                regs[t][j] = sm.u32(rows[t >> 2] + 4 * (t & 3))
            else:
                lo = sm.u16(rows[2 * (t & 3)] + 2 * (t >> 2))
                hi = sm.u16(rows[2 * (t & 3) + 1] + 2 * (t >> 2))
                regs[t][j] = lo | (hi << 16)
    return regs


def halves(w):
    return f16(w & 0xffff), f16(w >> 16)


def mma(acc, a, b):
    """acc[lane][4] += A (16x16, from a[lane][4]) @ B (16x8, from b[lane][2]) per PTX's layouts."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, q = t >> 2, t & 3
        for r, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 8 + 2 * q), (g + 8, 8 + 2 * q)]):
            A[row, col], A[row, col + 1] = halves(a[t][r])
        for r, k in enumerate([2 * q, 8 + 2 * q]):
            B[k, g], B[k + 1, g] = halves(b[t][r])
    D = A @ B
    for t in range(32):
        g, q = t >> 2, t & 3
        acc[t][0] += D[g, 2 * q]
        acc[t][1] += D[g, 2 * q + 1]
        acc[t][2] += D[g + 8, 2 * q]
        acc[t][3] += D[g + 8, 2 * q + 1]


def emulate(P):
    """The kernel's out (float64) for the arguments P (a dict as DxArgs; arrays numpy)."""
    S, C, E, ncb = P["S"], P["C"], P["E"], P["ncb"]
    out = np.full((S, C), np.nan)
    offsets = P["offsets"]
    clamp = lambda o: min(max(int(o), 0), S)  # noqa: E731
    nt = [max(0, clamp(offsets[e + 1]) - clamp(offsets[e])) for e in range(E)]
    nt = [(n + BM - 1) // BM for n in nt]
    tiles = sum(nt)
    grid = ((S + BM - 1) // BM + E) * ncb
    for item in range(grid):
        e, acc_tiles = -1, 0
        for ee in range(E):  # the prefix sum (the kernel's, pass by pass, gives the same)
            lo = ncb * acc_tiles
            if nt[ee] > 0 and lo <= item < lo + ncb * nt[ee]:
                e, local = ee, item - lo
                rt, cb = local % nt[ee], local // nt[ee]
            acc_tiles += nt[ee]
        if e < 0:
            busy = ncb * tiles
            if item >= busy:
                zero_rows(P, out, item - busy, grid - busy)
            continue
        cta(P, out, e, rt, cb)
    return out


def zero_rows(P, out, f, nfree):
    S, C, ncb, offsets, E = P["S"], P["C"], P["ncb"], P["offsets"], P["E"]
    first, last = min(max(int(offsets[0]), 0), S), min(max(int(offsets[E]), 0), S)
    nza, nzb = (first + BM - 1) // BM, (S - last + BM - 1) // BM
    u = f
    while u < (nza + nzb) * ncb:
        zt, cb = u // ncb, u % ncb
        r0 = zt * BM if zt < nza else last + (zt - nza) * BM
        r1 = min(r0 + BM, first if zt < nza else S)
        c0 = cb * BN
        for i in range(BM * (BN // 8)):
            r, c = r0 + i // (BN // 8), c0 + 8 * (i % (BN // 8))
            if r < r1 and c < C:
                out[r, c:c + 8] = 0.0
        u += nfree


def cta(P, out, e, rt, cb):
    S, C, cp, rp, M, glu = P["S"], P["C"], P["cp"], P["rp"], P["M"], P["glu"]
    half_rows, v, slices = P["half_rows"], P["v"], P["slices"]
    offsets, tok_ids, dy, T, lddy = P["offsets"], P["token_ids"], P["dy"], P["T"], P["lddy"]
    clamp = lambda o: min(max(int(o), 0), S)  # noqa: E731
    s_begin = clamp(offsets[e]) + rt * BM
    s_end = min(clamp(offsets[e + 1]), s_begin + BM)
    c0 = cb * BN
    j0, nslot = 0, 1
    if M > 1:
        j0 = c0 // v
        nslot = 2 if (c0 + 64 < C and (c0 + 64) // v != j0) else 1
    sm = Smem(2 * STAGE)
    dyf = dy.reshape(-1)
    KT = rp // BK

    def write_k(kt, buf):
        st = buf * STAGE
        p0 = kt * BK
        for tid in range(THREADS):
            # B
            br, bc = tid >> 3, tid & 7
            pb = p0 + br
            base = (e * rp + pb) * (cp // 2) + c0 // 2 + 8 * bc
            pv = [int(x) for x in P["values"][base:base + 8].view(np.uint32)]
            mt = cp // 32
            word = (e * (rp // 16) * mt + (c0 + 16 * bc) // 32) * 16 + (bc & 1) + (pb // 16) * mt * 16 + 2 * (pb % 8)
            bm16 = (int(P["meta"][word]) >> (16 * ((pb % 16) // 8))) & 0xffff
            w = []
            for k in range(4):
                nib = (bm16 >> (4 * k)) & 0xf
                i0, i1 = nib & 3, nib >> 2
                w.append(byte_perm(pv[k], 0, dense_sel(i0, i1, 0) | (dense_sel(i0, i1, 1) << 8)))
                w.append(byte_perm(pv[k], 0, dense_sel(i0, i1, 2) | (dense_sel(i0, i1, 3) << 8)))
            bdst = 2 * ATILE + br * BROW
            sm.sts_v4(st + bdst + (((2 * bc) ^ (br & 7)) << 4), w[:4])
            sm.sts_v4(st + bdst + (((2 * bc + 1) ^ (br & 7)) << 4), w[4:])
            # A
            P8, ar = tid & 3, tid >> 2
            if glu:
                chunk = p0 // 64
                h, q0 = chunk & 1, (chunk >> 1) * 64 + (p0 & 63)
            else:
                h, q0 = 0, p0
            local = q0 * M + 8 * M * P8
            col = h * half_rows + local
            raw = []
            for u in range(2):
                s = s_begin + ar + 64 * u
                t = (int(tok_ids[s]) if tok_ids is not None else s) if s < s_end else -1
                ok = 0 <= t < T
                words = []
                for c in range(M):
                    for tt in range(4):
                        ws = 0
                        for k2 in range(2):
                            l = local + 8 * c + 2 * tt + k2
                            inside = (local + 8 * c < half_rows) if P["dy_vec"] else (l < half_rows)
                            if ok and inside:
                                ws |= int(dyf[t * lddy + col + 8 * c + 2 * tt + k2]) << (16 * k2)
                        words.append(ws)
                raw.append(words)
            adst = ar * AROW + ((P8 ^ ((ar >> 1) & 3)) << 4)
            for sl in range(nslot):
                sel = [0, 0]
                if M > 1:
                    ib = (e * slices + j0 + sl) * rp + p0 + 8 * P8
                    sel = make_selectors(M, [int(x) for x in P["idx"][ib:ib + 8]])
                for u in range(2):
                    words = [gather_word(M, raw[u], sel, o) for o in range(4)]
                    sm.sts_v4(st + sl * ATILE + adst + u * 64 * AROW, words)

    accs = {}
    for warp in range(8):
        accs[warp] = [[[[0.0] * 4 for _ in range(32)] for _ in range(8)] for _ in range(2)]
    for kt in range(KT):
        write_k(kt, kt & 1)
        st = (kt & 1) * STAGE
        for warp in range(8):
            wm, wn = warp & 3, warp >> 2
            slot_w = 1 if (wn == 1 and nslot == 2) else 0
            if not (s_begin + 32 * wm < s_end and c0 + 64 * wn < C):
                continue
            a_s, b_s = st + slot_w * ATILE, st + 2 * ATILE
            for ks in range(BK // 16):
                af = []
                for i in range(2):
                    addrs = []
                    for lane in range(32):
                        mi, l7 = lane >> 3, lane & 7
                        row = 32 * wm + 16 * i + 8 * (mi & 1) + l7
                        ch = 2 * ks + (mi >> 1)
                        addrs.append(a_s + row * AROW + ((ch ^ ((row >> 1) & 3)) << 4))
                    af.append(ldmatrix_x4(sm, addrs, False))
                bfr = [None] * 8
                for jj in range(4):
                    addrs = []
                    for lane in range(32):
                        mi, l7 = lane >> 3, lane & 7
                        k = 16 * ks + 8 * (mi & 1) + l7
                        ch = 8 * wn + 2 * jj + (mi >> 1)
                        addrs.append(b_s + k * BROW + ((ch ^ l7) << 4))
                    r = ldmatrix_x4(sm, addrs, True)
                    bfr[2 * jj] = [[r[t][0], r[t][1]] for t in range(32)]
                    bfr[2 * jj + 1] = [[r[t][2], r[t][3]] for t in range(32)]
                for i in range(2):
                    for j in range(8):
                        mma(accs[warp][i][j], af[i], bfr[j])
    for warp in range(8):
        wm, wn = warp & 3, warp >> 2
        if not (s_begin + 32 * wm < s_end and c0 + 64 * wn < C):
            continue
        for lane in range(32):
            g, q4 = lane >> 2, lane & 3
            for i in range(2):
                for hh in range(2):
                    s = s_begin + 32 * wm + 16 * i + g + 8 * hh
                    if s >= s_end:
                        continue
                    sc = float(P["scale"][s]) if P["scale"] is not None else 1.0
                    for j in range(8):
                        c = c0 + 64 * wn + 8 * j + 2 * q4
                        if c < C:
                            a = accs[warp][i][j][lane]
                            out[s, c] = a[2 * hh] * sc
                            out[s, c + 1] = a[2 * hh + 1] * sc


def one_case(rng, torch, sm):
    from samoyeds.ops import ssmm_dx
    fmt = rng.choice(["2:4", "samoyeds-1:2:64", "samoyeds-1:2:128", "samoyeds-1:2:192", "samoyeds-1:4:64",
                      "samoyeds-1:4:128"])
    f = sm.SparseFormat.parse(fmt)
    M = 1 if f.n == f.m else f.m
    glu = bool(rng.integers(2))
    unit = 2 * M if glu else M
    R = int(rng.integers(1, 160 // unit + 1)) * unit
    C = int(rng.integers(1, 40)) * 8
    E, K, T = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(0, 150))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    w = torch.randint(-2, 3, (E, R, C), generator=gen).float()
    pw = sm.pack(w, fmt, glu=glu)
    ids = torch.randint(0, E + 1, (T, K), generator=gen)
    r = sm.route(ids, E)
    S = T * K
    with_ids = bool(rng.integers(2))
    rows = T if with_ids else S
    lddy = (R + 7) // 8 * 8 + 8 * int(rng.integers(2))
    dy = torch.randint(-2, 3, (rows, lddy), generator=gen).float()
    scale = (2.0 ** torch.randint(-2, 2, (S,), generator=gen)).float() if rng.integers(2) else None
    tok = r.token_ids if with_ids else None
    want = ssmm_dx(dy[:, :R], pw, r.offsets, tok, scale).double().numpy()
    rp, cp = pw.values.shape[1], pw.values.shape[2] * 2
    half = R // 2 if glu else R
    P = dict(S=S, C=C, E=E, cp=cp, rp=rp, M=M, glu=glu, half_rows=half, v=f.v if M > 1 else 0,
             slices=pw.idx.shape[1] if pw.idx is not None else 1, ncb=cp // BN,
             offsets=r.offsets.numpy(), token_ids=tok.numpy() if tok is not None else None,
             dy=dy.half().numpy().view(np.uint16), T=rows, lddy=lddy,
             dy_vec=half % 8 == 0, values=pw.values.half().numpy().reshape(-1).view(np.uint16),
             meta=pw.meta.numpy().reshape(-1).astype(np.uint32), idx=pw.idx.numpy().reshape(-1)
             if pw.idx is not None else None, scale=scale.numpy() if scale is not None else None)
    got = emulate(P)
    name = f"{fmt} glu={glu} R={R} C={C} E={E} T={T} K={K} ids={with_ids} scale={scale is not None}"
    if S and not np.array_equal(got, want):
        bad = np.argwhere(~(got == want))
        return f"MISMATCH {name}: {len(bad)} entries, first {bad[:3].tolist()}"
    return f"ok {name}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import torch

    import samoyeds as sm
    rng = np.random.default_rng(a.seed)
    fails = 0
    for _ in range(a.cases):
        msg = one_case(rng, torch, sm)
        print(msg, flush=True)
        fails += not msg.startswith("ok")
    print(f"{fails} of {a.cases} cases differ")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
