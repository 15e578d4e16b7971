"""The row-selection fold of ssmm_work.cuh (fold_row_set / finish_row_sets) emulated in fp32:
how often row M-1 of a group, which no slice selects, comes out as a rounding residual instead
of 0 (it is made as the total minus the other rows' shares).  Random slice totals, M = 4, 3-5
slices that select rows 0..M-2 only; every FFMA of the kernel rounded once, as on the GPU.

    python dev/lab/fold_residual.py [--trials 20000] [--scale 30]
"""
import argparse

import numpy as np


def fold_case(rng, M: int, slices: int, scale: float) -> float:
    f = np.float32
    T, D, sel = f(0), [f(0)] * M, M
    picks = rng.integers(0, M - 1, slices)  # rows 0 .. M-2: row M-1 never selected

    def fold(want):
        nonlocal sel
        for a in range(1, M):
            coef = (1.0 if sel == a - 1 else 0.0) - (1.0 if want == a - 1 else 0.0)
            D[a] = f(coef * np.float64(T) + np.float64(D[a]))  # fmaf: one rounding
        sel = want

    for j in range(slices):
        fold(int(picks[j]))
        T = f(T + f(rng.standard_normal() * scale))
    fold(M)
    r = T
    for a in range(1, M):
        r = f(r - D[a])
    return float(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--scale", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    res = [fold_case(rng, 4, int(rng.integers(3, 6)), args.scale) for _ in range(args.trials)]
    nz = [abs(r) for r in res if r != 0]
    print(f"M = 4, row 3 never selected, 3-5 slices: nonzero in {len(nz)} of {args.trials} cases, "
          f"largest |residual| {max(nz) if nz else 0:.3g} (slice totals ~ N(0, {args.scale:g}))")


if __name__ == "__main__":
    main()
