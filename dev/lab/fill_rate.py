"""The data ceiling of the wgmma.sp kernels: how fast SMs fill their shared memory from
L2 (samoyeds.shared_fill_rate), by TMA boxes, by cp.async rows in order, by cp.async
rows chosen by index (the routed-token gather), by stages holding a box and gathered
rows (as the kernels' stages do) and by TMA multicast in clusters of two (each CTA
loads half of every box into both: the bytes landed against half the L2 reads); with every SM taking part and with fewer (128 KB of
stages in flight), and with every SM and fewer stages in flight.

If the rate per SM stays put as SMs drop out, each SM's intake is the limit; if the
rate over the device stays put instead, the L2's output is.  The rate against the bytes
in flight says how much of a ring a stream needs.  Each point is the median of the
measurement's timed launches; the whole sweep runs REPEAT times, the points
interleaved, and reports the median of the repeats.

  python dev/lab/fill_rate.py [--ctas 0,98,66,32,16,4] [--stage-kb 16,32,64,96,128,192] [--kinds a,b] [--repeat 3] [--out DIR]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
from common import environment, require_peak, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", default="0,98,66,32,16,4", help="SMs taking part (0: every SM; even, for multicast)")
    ap.add_argument("--stage-kb", default="16,32,64,96,128,192", help="KB of stages in flight per SM (every SM)")
    ap.add_argument("--kinds", default=None, help="ways of loading (default: every one of dev/peak FILL_KINDS)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    peak = require_peak("fill_rate")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stage_bytes = {k: 32768 if k == "tma_and_gather" else 16384 for k in peak.FILL_KINDS}  # (to pick points)
    kinds = a.kinds.split(",") if a.kinds else list(peak.FILL_KINDS)
    points = [(kind, n, 0) for n in (int(c) for c in a.ctas.split(",")) for kind in kinds]
    for kb in (int(k) for k in a.stage_kb.split(",")):
        for kind in kinds:
            st = kb * 1024 // stage_bytes[kind]
            if 1 <= st and st * stage_bytes[kind] == kb * 1024 and (kind, 0, st) not in points:
                points.append((kind, 0, st))
    runs = {}
    for _ in range(a.repeat):
        for kind, n, st in points:
            runs.setdefault((kind, n, st), []).append(peak.shared_fill_rate(kind, ctas=n, stages=st))
    rows = []
    for (kind, n, st), rs in runs.items():
        # what ran, as the measurement reports it
        row = {"kind": kind, "ctas": rs[0]["ctas"], "in_flight_kb": rs[0]["in_flight_bytes"] // 1024,
               "repeats": len(rs)}
        for k in ("tb_per_s", "bytes_per_clock_per_sm", "sm_clock_mhz"):
            row[k] = statistics.median(r[k] for r in rs)
        row["gb_per_s_per_sm"] = row["tb_per_s"] * 1e3 / row["ctas"]
        rows.append(row)
        print(f"{kind:16} {row['ctas']:4} SMs {row['in_flight_kb']:4} KB  {row['tb_per_s']:6.2f} TB/s  {row['gb_per_s_per_sm']:6.1f} GB/s per SM  "
              f"{row['bytes_per_clock_per_sm']:5.1f} B/clk/SM  at {row['sm_clock_mhz']:5.0f} MHz", flush=True)
    if a.out:
        write_json(os.path.join(a.out, "fill_rate.json"), {"environment": environment(), "sms": sms, "rows": rows})


if __name__ == "__main__":
    main()
