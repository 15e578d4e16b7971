"""The issue rate of each tensor-core instruction form (samoyeds.tensor_core_rate), and
for the wgmma forms the shared-memory operand bytes they read at that rate.

A warpgroup MMA reads B (and, in the forms the warp-specialised kernels issue, the packed
A tile) from shared memory at every instruction.  If the rate of a form falls as its
operand bytes per FLOP grow, the shared-memory port, not the tensor pipe, is its ceiling,
and a kernel issuing that form cannot run faster than the form does here.  Each kind is
measured REPEAT times, the kinds interleaved; the median is reported, with the bytes per
SM clock at the SM clock a TMA fill of shared memory runs at in the same call
(samoyeds.shared_fill_rate).

  python dev/lab/tc_forms.py [--repeat 3] [--out DIR]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
from common import environment, require_peak, write_json  # noqa: E402

# kind -> (N, A read from shared memory, sparse); the mma kinds read no shared memory
WGMMA_FORMS = {
    "wgmma": (128, False, False),
    "wgmma_sp": (128, False, True),
    "wgmma_sp_n64": (64, False, True),
    "wgmma_sp_ss": (128, True, True),
    "wgmma_sp_ss_n96": (96, True, True),
    "wgmma_sp_ss_n64": (64, True, True),
}


def operand_bytes_per_flop(kind: str):
    """Shared-memory bytes an instruction of `kind` reads per dense-equivalent flop (bf16)."""
    if kind not in WGMMA_FORMS:
        return None
    n, a_shared, sparse = WGMMA_FORMS[kind]
    k = 32 if sparse else 16               # the instruction's K (dense-equivalent)
    b = n * k * 2                          # B: N x K bf16
    a = 64 * (k // 2 if sparse else k) * 2 if a_shared else 0  # A: 64 rows, packed when sparse
    return (a + b) / (2.0 * 64 * n * k)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    peak = require_peak("tc_forms")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kinds = list(peak.TENSOR_CORE_KINDS)
    runs = {k: [] for k in kinds}
    clocks = []
    for _ in range(a.repeat):
        for k in kinds:
            try:
                runs[k].append(peak.tensor_core_rate(k))
            except NotImplementedError as exc:
                print(f"{k}: not measured ({exc})", file=sys.stderr)
        try:
            clocks.append(peak.shared_fill_rate("tma")["sm_clock_mhz"])
        except NotImplementedError:
            pass
    mhz = statistics.median(clocks) if clocks else None
    ref = statistics.median(runs["wgmma_sp"]) if runs.get("wgmma_sp") else None
    rows = []
    for k in kinds:
        if not runs[k]:
            continue
        tf = statistics.median(runs[k])
        row = {"kind": k, "tflops": tf, "repeats": len(runs[k]), "spread": max(runs[k]) / min(runs[k])}
        bpf = operand_bytes_per_flop(k)
        if bpf is not None:
            n, a_shared, sparse = WGMMA_FORMS[k]
            row.update(n=n, a_in_shared=a_shared, sparse=sparse, smem_bytes_per_flop=bpf,
                       smem_gb_s_per_sm=tf * 1e12 * bpf / sms / 1e9)
            if mhz:
                row["smem_bytes_per_clock_per_sm"] = row["smem_gb_s_per_sm"] * 1e9 / (mhz * 1e6)
        if ref and k.startswith("wgmma_sp"):
            row["vs_wgmma_sp"] = tf / ref
        rows.append(row)
        extra = ""
        if "smem_bytes_per_clock_per_sm" in row:
            extra = f"  reads {row['smem_bytes_per_clock_per_sm']:6.1f} B/clk/SM of shared memory"
        if "vs_wgmma_sp" in row:
            extra += f"  {row['vs_wgmma_sp']:.3f}x wgmma_sp"
        print(f"{k:16} {tf:8.1f} TFLOP/s (spread {row['spread']:.3f}){extra}", flush=True)
    if a.out:
        write_json(os.path.join(a.out, "tc_forms.json"),
                   {"environment": environment(), "sms": sms, "sm_clock_mhz_under_fill": mhz, "rows": rows})


if __name__ == "__main__":
    main()
