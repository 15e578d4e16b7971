"""Summarise a compute-sanitizer initcheck log (run with --print-limit 0 for every report):
reports counted by the script's last printed phase line and the kernel, with the first
address of each group and the named range (lines 'name 0x.. .. 0x..' of initcheck_where.py)
it falls in.   python dev/sanitize/initcheck_summary.py LOG"""
import re
import sys
from collections import OrderedDict

ranges, groups, phase, pending = [], OrderedDict(), "start", None
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"(\S+)\s+0x([0-9a-f]+) \.\. 0x([0-9a-f]+)", line)
    if m:
        ranges.append((m.group(1), int(m.group(2), 16), int(m.group(3), 16)))
        continue
    if not line.startswith("========="):
        if line.strip():
            phase = line.strip()[:60]
        continue
    if "Uninitialized" in line:
        pending = {"what": line.split("=========")[1].strip()}
    elif pending is not None and line.startswith("=========     at "):
        pending["kernel"] = re.sub(r"<.*", "", line.split(" at ", 1)[1].strip())[:90]
    elif pending is not None and "Address 0x" in line:
        addr = int(line.split("Address ")[1], 16)
        owner = next((f"{n}+{addr - a}" for n, a, b in ranges if a <= addr < b), "?")
        key = (phase, pending.get("kernel", "?"))
        g = groups.setdefault(key, {"n": 0, "first": hex(addr), "owner": owner, "what": pending["what"]})
        g["n"] += 1
        pending = None
for (ph, k), g in groups.items():
    print(f"{g['n']:7d}  phase={ph!r}  kernel={k}  first={g['first']} in {g['owner']}  ({g['what']})")
print("total", sum(g["n"] for g in groups.values()))
