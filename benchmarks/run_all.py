"""The benchmark suite's one entry point: runs the chosen benchmarks one after the
other, each as its own process writing its JSON into --out, each with its log
(``<step>.log``) next to it; one that fails does not stop the others.  A summary
(``run_all.json``: step, command, exit status, seconds) is written last.

  step        script                       JSON             paper
  kernel      bench_kernel.py              kernel.json      Fig. 13 (per-model projections)
  sweep       bench_sweep.py               sweep.json       Fig. 12/13 (m, k, n sweep)
  moe         bench_moe.py                 moe.json         Fig. 14
  e2e         bench_e2e.py                 e2e.json         Fig. 15
  memory      bench_memory.py              memory.json      Fig. 16
  breakdown   bench_breakdown.py           breakdown.json   Fig. 17
  accuracy    accuracy.py                  accuracy.json    (pruned-model perplexity)
  train       bench_train.py               train.json       (training: MoE fwd+bwd, ssmm_dw)

  python benchmarks/run_all.py [--only kernel,sweep,...] [--out DIR] [--tiny --device cpu]
                               [--args step="extra args"]...

--tiny --device cpu runs every script's CPU smoke mode (the accuracy study at its
test size) in seconds to a minute each.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = {
    "kernel": "bench_kernel.py",
    "sweep": "bench_sweep.py",
    "moe": "bench_moe.py",
    "e2e": "bench_e2e.py",
    "memory": "bench_memory.py",
    "breakdown": "bench_breakdown.py",
    "accuracy": "accuracy.py",
    "train": "bench_train.py",
}
DEFAULT = "kernel,sweep,moe,e2e,memory,breakdown,accuracy,train"


def command(step: str, out: str, tiny: bool, device: str, extra: str) -> list:
    cmd = [sys.executable, os.path.join(HERE, STEPS[step]), "--out", out]
    if step == "accuracy":
        if tiny:
            cmd += ["--mode", "test"]
        if device:
            cmd += ["--device", device]
    else:
        if tiny:
            cmd.append("--tiny")
        if device:
            cmd += ["--device", device]
    return cmd + shlex.split(extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=DEFAULT, help=f"comma-separated steps among {','.join(STEPS)}")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/<gpu>; "
                                                "required with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="every script's CPU smoke mode")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"])
    ap.add_argument("--args", action="append", default=[], metavar='STEP="ARGS"',
                    help="extra arguments for one step, e.g. --args e2e=\"--models mixtral-8x7b\"")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"--only: unknown steps {unknown}; expected among {list(STEPS)}")
    extra = {}
    for a in args.args:
        step, _, rest = a.partition("=")
        if step not in STEPS:
            ap.error(f"--args: unknown step {step!r}")
        extra[step] = rest
    if args.tiny and not args.out:
        ap.error("--tiny writes nothing into benchmarks/results: give --out")
    out = args.out
    if out is None:
        sys.path.insert(0, HERE)
        from common import gpu_dir
        out = gpu_dir(None)
    os.makedirs(out, exist_ok=True)
    summary = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "steps": []}
    for step in steps:
        cmd = command(step, out, args.tiny, args.device, extra.get(step, ""))
        if not os.path.exists(cmd[1]):
            summary["steps"].append({"step": step, "rc": None, "error": f"{STEPS[step]} not found"})
            print(f"== {step}: {STEPS[step]} not found, skipped", flush=True)
            continue
        print(f"== {step}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        log_path = os.path.join(out, f"{step}.log")
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
            for line in p.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = p.wait()
        secs = time.perf_counter() - t0
        summary["steps"].append({"step": step, "command": " ".join(cmd), "rc": rc, "seconds": round(secs, 1),
                                 "log": os.path.basename(log_path)})
        print(f"== {step}: exit {rc} after {secs:.0f} s", flush=True)
    with open(os.path.join(out, "run_all.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print("\nstep        exit   seconds")
    for s in summary["steps"]:
        print(f"{s['step']:<12}{str(s['rc']):>4}{s.get('seconds', 0):>10.0f}  {s.get('error', '')}")
    return 0 if all(s["rc"] == 0 for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
