"""The data ceiling of the wgmma.sp kernels: how fast SMs fill their shared memory from
L2 (samoyeds.shared_fill_rate), by TMA boxes, by cp.async rows in order and by cp.async
rows chosen by index (the routed-token gather), with every SM taking part and with fewer.

If the rate per SM stays put as SMs drop out, each SM's intake is the limit; if the
rate over the device stays put instead, the L2's output is.  Each point is the median
of the measurement's timed launches; the whole sweep runs REPEAT times, kinds and SM
counts interleaved, and reports the median of the repeats.

  python benchmarks/fill_rate.py [--ctas 0,99,66,33,16,4] [--repeat 3] [--out DIR]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import environment, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", default="0,99,66,33,16,4", help="SMs taking part (0: every SM)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = [int(c) for c in a.ctas.split(",")]
    runs = {}
    for _ in range(a.repeat):
        for n in ctas:
            for kind in sm._C.SHARED_FILL_KINDS:
                runs.setdefault((kind, n), []).append(sm.shared_fill_rate(kind, ctas=n))
    rows = []
    for (kind, n), rs in runs.items():
        row = {"kind": kind, "ctas": n or sms, "repeats": len(rs)}
        for k in ("tb_per_s", "bytes_per_clock_per_sm", "sm_clock_mhz"):
            row[k] = statistics.median(r[k] for r in rs)
        row["gb_per_s_per_sm"] = row["tb_per_s"] * 1e3 / row["ctas"]
        rows.append(row)
        print(f"{kind:16} {row['ctas']:4} SMs  {row['tb_per_s']:6.2f} TB/s  {row['gb_per_s_per_sm']:6.1f} GB/s per SM  "
              f"{row['bytes_per_clock_per_sm']:5.1f} B/clk/SM  at {row['sm_clock_mhz']:5.0f} MHz", flush=True)
    if a.out:
        write_json(os.path.join(a.out, "fill_rate.json"), {"environment": environment(), "sms": sms, "rows": rows})


if __name__ == "__main__":
    main()
