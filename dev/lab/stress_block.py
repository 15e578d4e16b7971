"""Bursts of back-to-back forwards of one patched MoE block, enqueued without a
synchronisation between them, each watched for completion: finds a stall (a kernel that
never finishes) that timed single calls do not show.  Exit status 3 names the burst that
did not finish within --timeout seconds (the process is left at once: a stalled kernel
cannot be interrupted from the host).

  python dev/lab/stress_block.py --model gpt-oss-20b --tokens 256 [--bursts 6] [--calls 200]

SAMOYEDS_* variables (SAMOYEDS_PDL, SAMOYEDS_WS_TILE, SAMOYEDS_WGMMA_KERNEL, ...) select
what runs, so one call per setting bisects a stall.  --tiny --device cpu checks the script.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import torch  # noqa: E402

import samoyeds as sm  # noqa: E402
from bench_moe import random_block  # noqa: E402


def on_stall(cmd: str) -> None:
    """Runs cmd (a debugger attaching to this process, say) while the stalled kernel still runs."""
    import ctypes
    import subprocess
    try:  # let a child process attach where Yama restricts ptrace to ancestors
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    subprocess.run(cmd.replace("{pid}", str(os.getpid())), shell=True, timeout=300, check=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200, help="forwards per burst")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds a burst may take")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="shapes / 16: a quick CPU check of the script")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--on-stall", default="",
                    help="a shell command run on a stall before the process leaves, {pid} replaced by this "
                         "process's id (e.g. cuda-gdb -p {pid} -batch -ex 'info cuda kernels')")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    holder, cfg = random_block(a.model, a.device, dtype, a.tiny, a.seed)
    sm.patch_model(holder, a.format, progress=False)
    gen = torch.Generator(device=a.device).manual_seed(a.seed + a.tokens)
    x = torch.randn(1, a.tokens, cfg.hidden_size, device=a.device, generator=gen).to(dtype)
    setting = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("SAMOYEDS_")) or "defaults"
    print(f"{a.model} T={a.tokens} {a.format}: {setting}", flush=True)
    with torch.inference_mode():
        holder(x)
        if a.device == "cuda":
            torch.cuda.synchronize()
        for b in range(a.bursts):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                holder(x)
            if a.device == "cuda":
                done = torch.cuda.Event()
                done.record()
                while not done.query():
                    if time.perf_counter() - t0 > a.timeout:
                        print(f"STALL: burst {b} of {a.calls} calls unfinished after {a.timeout:.0f} s", flush=True)
                        if a.on_stall:
                            on_stall(a.on_stall)
                        os._exit(3)
                    time.sleep(0.01)
            print(f"burst {b}: {a.calls} calls in {time.perf_counter() - t0:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
