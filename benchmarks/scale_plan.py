"""Per-GPU weight memory of large MoE models packed by samoyeds, at EP = 2, 4, 8, 16.

Nothing is downloaded and no weights are made: each model is built from its published
config (the values below, from the models' config.json on the Hugging Face Hub) on the
meta device by transformers, and every parameter is counted where it would live:

* routed experts (``*.mlp.experts.*``): packed in ``--fmt`` (default samoyeds-1:2:128),
  bytes from samoyeds' own storage shapes (:class:`samoyeds.packed.PackedDims`: kept values,
  2:4 metadata, row indices), checked here against a real :func:`samoyeds.pack`; each rank
  holds ``E / EP`` experts (transformers' ``grouped_gemm`` style);
* everything else in bf16, either sharded ``/ EP`` where the model's ``tp_plan`` shards it
  (the plan ``DistributedConfig(tp_size=EP, ep_size=EP)`` applies: column/row-wise
  attention and MLPs, embeddings, lm_head) and replicated otherwise ("transformers"
  column), or replicated on every rank ("replicated" column: data-parallel attention
  with expert parallelism, as the all-to-all engines run it).

Weights only: the KV cache, activations and the communication buffers come on top.

    python benchmarks/scale_plan.py                 # prints the tables
    python benchmarks/scale_plan.py --update docs/SCALE.md   # rewrites its generated section
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

#: Published config.json values (transformers config kwargs).
CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    # deepseek-ai/DeepSeek-V3 (the multi-token-prediction layer, which transformers does not load, is left out)
    "DeepSeek-V3": ("DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        tie_word_embeddings=False)),
    # Qwen/Qwen3-235B-A22B
    "Qwen3-235B-A22B": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_experts=128, num_experts_per_tok=8, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)),
    # mistralai/Mixtral-8x22B-v0.1
    "Mixtral-8x22B": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False)),
}
EPS = (2, 4, 8, 16)
#: Usable memory of one GPU (GiB), as torch reports it on the machines the project uses.
GPUS = {"H100 80GB": 78.0, "H200": 139.0}
#: tp_plan styles that split a weight across the ranks (the rest replicate it).
SHARDING = {"colwise", "rowwise", "packed_colwise", "packed_rowwise", "colwise_gather_output", "colwise_rep",
            "rowwise_rep", "rowwise_split_input", "embedding_rowwise", "embedding_colwise"}
BEGIN, END = "<!-- scale_plan.py: begin -->", "<!-- scale_plan.py: end -->"
GIB = 2**30


def packed_nbytes(fmt: Any, E: int, R: int, C: int, glu: bool, elem: int = 2) -> int:
    """Bytes of ``E`` packed ``[R, C]`` weights: values ``[E, rp, cp/2]`` (``elem`` bytes each),
    uint32 metadata ``[E, rp/16, cp/32, 16]``, uint8 row indices ``[E, slices, rp]``."""
    from samoyeds.packed import PackedDims

    d = PackedDims.of(fmt, E, R, C, glu)
    return E * (d.rp * d.cp // 2 * elem + d.rp // 16 * (d.cp // 32) * 16 * 4 + d.slices * d.rp)


def check_packed_nbytes(fmt: Any) -> None:
    """packed_nbytes against what samoyeds.pack allocates, on small random experts."""
    import samoyeds

    g = torch.Generator().manual_seed(0)
    for E, R, C, glu in ((2, 512, 256, True), (3, 256, 384, False)):
        w = torch.randn(E, R, C, generator=g, dtype=torch.float32).to(torch.bfloat16)
        p = samoyeds.pack(w, fmt, glu=glu)
        assert p.nbytes == packed_nbytes(fmt, E, R, C, glu), (p.nbytes, packed_nbytes(fmt, E, R, C, glu))


def meta_model(name: str) -> Any:
    import transformers

    import lm

    cls, fields = CONFIGS[name]
    return lm.meta_model(getattr(transformers, cls)(**fields), torch.bfloat16)


def count(name: str, fmt: Any) -> Dict[str, Any]:
    """Bytes of ``name``'s weights by kind, and whether the model's tp_plan shards each."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    model = meta_model(name)
    plan = dict(model.tp_plan)
    E = None
    c = {"experts_dense": 0, "experts_packed": 0, "experts_other": 0, "sharded": 0, "replicated": 0,
         "params": 0, "active": 0}
    for mname, mod in model.named_modules():
        gu = mod._parameters.get("gate_up_proj")
        if gu is not None and gu.dim() == 3 and mname.endswith("mlp.experts"):
            dn = mod._parameters["down_proj"]
            E = gu.shape[0]
            # the packing layout: gate_up [E, 2I, H] (gate rows, then up), down [E, H, I]
            H, I = dn.shape[1], dn.shape[2]
            c["experts_dense"] += (gu.numel() + dn.numel()) * 2
            c["experts_packed"] += packed_nbytes(fmt, E, 2 * I, H, True) + packed_nbytes(fmt, E, H, I, False)
            for pname, p in mod.named_parameters(recurse=False):
                if pname not in ("gate_up_proj", "down_proj"):
                    c["experts_other"] += p.numel() * p.element_size()
            continue
    for pname, p in model.named_parameters():
        c["params"] += p.numel()
        if ".mlp.experts." in pname:
            continue
        style = _get_parameter_plan(pname, plan, is_weight=True)
        c["sharded" if style in SHARDING else "replicated"] += p.numel() * p.element_size()
    c["experts"] = E
    c["top_k"] = model.config.num_experts_per_tok
    return c


def per_gpu(c: Dict[str, Any], ep: int, packed: bool, replicate_dense: bool) -> float:
    """GiB of weights on one rank at EP = ``ep``."""
    experts = (c["experts_packed"] if packed else c["experts_dense"]) + c["experts_other"]
    rest = c["sharded"] + c["replicated"] if replicate_dense else c["sharded"] / ep + c["replicated"]
    return (experts / ep + rest) / GIB


def fits(gib: float) -> str:
    ok = [g for g, cap in GPUS.items() if gib <= cap]
    return "H100" if "H100 80GB" in ok else "H200" if ok else "no"


def tables(fmt_name: str) -> str:
    from samoyeds.format import SparseFormat

    fmt = SparseFormat.parse(fmt_name)
    check_packed_nbytes(fmt)
    out: List[str] = []
    out.append(f"Format `{fmt.name}`; weights only, GiB per GPU (2^30 bytes); 'fits' compares with "
               f"{', '.join(f'{g} ({cap:g} GiB usable)' for g, cap in GPUS.items())}. Generated by "
               "`python benchmarks/scale_plan.py --update docs/SCALE.md`.\n")
    out.append("| model | params (B) | routed experts bf16 (GiB) | packed (GiB) | packed / bf16 | "
               "other weights bf16 (GiB) | of which the tp_plan shards |")
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    counts = {}
    for name in CONFIGS:
        c = counts[name] = count(name, fmt)
        other = c["sharded"] + c["replicated"]
        out.append(f"| {name} | {c['params'] / 1e9:.1f} | {c['experts_dense'] / GIB:.1f} | "
                   f"{c['experts_packed'] / GIB:.1f} | {c['experts_packed'] / c['experts_dense']:.1%} | "
                   f"{other / GIB:.1f} | {c['sharded'] / max(other, 1):.0%} |")
    out.append("")
    out.append("Per GPU at EP = N, transformers' plan (`DistributedConfig(tp_size=N, ep_size=N)`: experts "
               "split by expert, the rest as the model's tp_plan shards it) and with every non-expert weight "
               "replicated (data-parallel attention, as all-to-all engines run expert parallelism):\n")
    out.append("| model | EP | experts / GPU | bf16, transformers plan | packed, transformers plan | fits | "
               "bf16, replicated | packed, replicated | fits |")
    out.append("|---|---:|---:|---:|---:|---|---:|---:|---|")
    for name, c in counts.items():
        for ep in EPS:
            if c["experts"] % ep:
                out.append(f"| {name} | {ep} | - ({c['experts']} experts do not split {ep} ways) | | | | | | |")
                continue
            cells = [per_gpu(c, ep, packed, rep) for rep in (False, True) for packed in (False, True)]
            out.append(f"| {name} | {ep} | {c['experts'] // ep} | {cells[0]:.1f} | {cells[1]:.1f} | "
                       f"{fits(cells[1])} | {cells[2]:.1f} | {cells[3]:.1f} | {fits(cells[3])} |")
    return "\n".join(out) + "\n"


def update(path: str, text: str) -> None:
    with open(path) as fh:
        doc = fh.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: expected the markers {BEGIN} and {END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{text}{END}{tail}")
    print(f"updated {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="samoyeds-1:2:128")
    ap.add_argument("--update", metavar="DOC", help="rewrite the generated section of DOC (docs/SCALE.md)")
    args = ap.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    text = tables(args.fmt)
    if args.update:
        update(args.update, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
