"""benchmarks/bench_train.py on the CPU (--tiny): both methods run forward + backward on every
model's toy shapes, the ssmm_dw kernel-level timing runs, and train.json carries the run's
environment and the fields the report reads."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import run_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_train_tiny(tmp_path):
    p = run_python([os.path.join(ROOT, "benchmarks", "bench_train.py"), "--tiny", "--device", "cpu",
                    "--models", "olmoe,gpt-oss-20b", "--out", str(tmp_path)], timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "train.json").read_text())
    assert d["complete"] and "commit" in d["env"] and "command" in d["env"]
    assert [c["model"] for c in d["cases"]] == ["olmoe", "gpt-oss-20b"]
    for c in d["cases"]:
        for m in ("samoyeds", "grouped_mm", "samoyeds_recompute"):
            r = c["methods"][m]
            assert "error" not in r, r
            assert r["ms_fwd_bwd"] > 0 and r["ms_fwd"] > 0 and r["grads"]
        assert c["speedup_fwd_bwd"] > 0 and c["speedup_fwd_bwd_recompute"] > 0
    assert {(r["model"], r["projection"]) for r in d["dw_kernel"]} == {
        (m, p) for m in ("olmoe", "gpt-oss-20b") for p in ("gate_up", "down")}
    assert all(r["ms_ssmm_dw"] > 0 and r["ms_dense"] > 0 for r in d["dw_kernel"])


def test_bench_train_breakdown_tiny(tmp_path):
    """--only-breakdown: every stage of the layer forward and backward timed, shares of each
    group summing to 1, the composed ops' totals present, nothing else measured."""
    p = run_python([os.path.join(ROOT, "benchmarks", "bench_train.py"), "--tiny", "--device", "cpu",
                    "--models", "gpt-oss-20b", "--only-breakdown", "--no-kernel", "--out", str(tmp_path)],
                   timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "train_breakdown.json").read_text())
    assert d["complete"] and d["cases"] == [] and d["dw_kernel"] == []
    rows = d["breakdown"]
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    stages = {(r["group"], r["stage"]) for r in rows}
    # on the CPU the default dX path is ssmm_dx: the transposed packing is the other path
    for want in (("bwd", "gather_weights"), ("bwd", "ssmm_dw_down"), ("bwd", "ssmm_dw_gate_up"), ("bwd", "dx_down"),
                 ("bwd", "dx_gate_up"), ("bwd", "glu_backward"), ("bwd", "combine"),
                 ("dx_other", "transposed_refresh_down"), ("dx_other", "dx_transposed_down"),
                 ("dx_other", "dx_transposed_gate_up"), ("bwd", "down_bias_sum"), ("bwd", "gate_up_bias_sum"),
                 ("bwd", "dweights"), ("fwd", "ssmm_gate_up"), ("fwd", "ssmm_down"), ("fwd", "op_total"),
                 ("bwd", "op_total"), ("fwd_bwd", "autograd")):
        assert want in stages, want
    for g in ("fwd", "bwd"):
        share = sum(r.get("share", 0.0) for r in rows if r["group"] == g)
        assert abs(share - 1.0) < 1e-6
    assert all(r["ms"] > 0 for r in rows if "ms" in r)
