"""One rank of the expert-parallel test (tests/test_ep.py), launched by
``python -m torch.distributed.run --nproc-per-node 2 tests/ep_worker.py OUT DTYPE IMPL DIR...``.

For every saved model directory DIR (one tiny model per family) it loads the model with
``DistributedConfig(tp_size=W, ep_size=W, ep_implementation=IMPL)`` (transformers
initialises the process group: gloo on the CPU, NCCL on GPUs), packs it with
samoyeds.patch_model, and writes to
``OUT/<family>.rank<r>.pt``: the logits on the test's prompts, the greedy tokens, what
each rank holds (expert count, buffer shapes), the logits after unpatch_model (the
masked dense weights under transformers' own experts implementation, DTensors again), and
the logits of the model patched again with whole-model masks (:func:`whole_masks`), which
each rank cuts to its experts.

Usage: ep_worker.py OUT_DIR DTYPE(fp32|bf16) EP_IMPLEMENTATION MODEL_DIR...

EP_IMPLEMENTATION is DistributedConfig's ep_implementation: "auto" (AllReduceEP at
inference: every rank runs its experts on the whole batch, the others' ids masked) or
"all_to_all" (AllToAllEP: each rank sends its slice of the batch's rows to the experts'
ranks and gets the outputs back).
"""
from __future__ import annotations

import os
import sys

import torch

try:  # the samoyeds the launching test imports (PYTHONPATH), or else the source tree built in place
    import samoyeds  # noqa: F401
except ImportError:
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prompts(vocab: int, device: torch.device) -> torch.Tensor:
    """The test's prompts: ``[2, 11]`` token ids, the same on every rank and in the test."""
    g = torch.Generator().manual_seed(43)
    return torch.randint(3, vocab, (2, 11), generator=g).to(device)


def whole_masks(model, fmt: str = "samoyeds-1:2:128") -> dict:
    """Masks for every experts module that stores ``[E, out, in]`` (not GPT-OSS), shaped like
    the whole model's Parameters (all ``E`` experts, gathered from the ranks), from fixed random
    scores: not the magnitude masks patch_model makes by itself, so a rank that cut another
    rank's experts' masks gives other logits."""
    from samoyeds.hf import find_experts, parallel
    from samoyeds.packed import mask

    masks = {}
    for t in find_experts(model):
        if t.experts.is_transposed:
            continue
        masks[t.name] = {}
        for key in ("gate_up_proj", "down_proj"):
            w = t.experts._parameters[key].detach()
            w = w.full_tensor() if parallel.is_dtensor(w) else w
            scores = torch.rand(w.shape, generator=torch.Generator().manual_seed(7)).to(w.device)
            masks[t.name][key] = mask(w, fmt, scores=scores)
    return masks


def run(out: str, dtype: torch.dtype, ep_impl: str, model_dir: str) -> None:
    import transformers
    from transformers import DistributedConfig

    import samoyeds
    from samoyeds.hf import parallel
    from samoyeds.hf.shared import find_shared

    world = int(os.environ["WORLD_SIZE"])
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, cfg.architectures[0])
    model = cls.from_pretrained(model_dir, dtype=dtype,
                                distributed_config=DistributedConfig(tp_size=world, ep_size=world,
                                                                    ep_implementation=ep_impl)).eval()
    rank = torch.distributed.get_rank()
    device = next(model.parameters()).device
    ids = prompts(cfg.vocab_size, device)
    try:   # a format the shapes do not fit: patch_model fails after localising, and must restore
        samoyeds.patch_model(model, fmt="1:3:128", progress=False)
    except samoyeds.hf.UnsupportedModelError:
        pass
    restored = all(parallel.is_dtensor(t.experts.gate_up_proj) for t in samoyeds.hf.find_experts(model))
    shared = find_shared(model, samoyeds.hf.find_experts(model))
    shared_refused = None
    if shared:   # tensor-parallel shared experts (DeepSeek-V3's plan) cannot be packed
        try:
            samoyeds.patch_model(model, progress=False, shared_experts=True)
            shared_refused = False
            samoyeds.unpatch_model(model)
        except samoyeds.hf.UnsupportedModelError:
            shared_refused = True
    samoyeds.patch_model(model, progress=False)
    experts = [m for m in model.modules() if getattr(m, "_samoyeds", None) is not None]
    held = {
        "num_experts": [m.num_experts for m in experts],
        "packed_experts": [m._samoyeds.num_experts for m in experts],
        "gate_up_values": [tuple(m.samoyeds_gate_up_values.shape) for m in experts],
        "localized": len(parallel.recorded(model)),
        "dtensor_after_failed_patch": restored,
        "shared": len(shared),
        "shared_sharded": all(parallel.is_sharded(st.mlp) for st in shared),
        "shared_refused": shared_refused,
        # their class and their block's stay transformers' (swap.py marks samoyeds' classes)
        "shared_swapped": any(getattr(type(m), "_samoyeds_swapped", False) for st in shared
                              for m in (st.mlp, st.parent)),
    }
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                pad_token_id=0).cpu()
    samoyeds.unpatch_model(model)
    held["dtensor_after_unpatch"] = all(parallel.is_dtensor(m.gate_up_proj) for m in experts)
    with torch.no_grad():
        dense_logits = model(ids).logits.float().cpu()
    masks = whole_masks(model)
    masked_logits = None
    if masks:
        samoyeds.patch_model(model, progress=False, masks=masks)
        with torch.no_grad():
            masked_logits = model(ids).logits.float().cpu()
    family = cfg.model_type
    torch.save({"logits": logits, "tokens": tokens, "dense_logits": dense_logits, "masked_logits": masked_logits,
                "held": held, "device": str(device)}, os.path.join(out, f"{family}.rank{rank}.pt"))


def main() -> None:
    out, dtype = sys.argv[1], {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[2]]
    ep_impl = sys.argv[3]
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        for model_dir in sys.argv[4:]:
            run(out, dtype, ep_impl, model_dir)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
