"""The 2-process half of test_tp_load: every rank loads each checkpoint with
load_quantized(device_mesh=...), and whole then sharded by sailfish.parallel's styles, and
compares. Run by the test as

    python tests/tp_load_worker.py OUT CASES_JSON [--cuda]

(writes OUT.<rank> as JSON; gloo on the CPU, NCCL with --cuda, one GPU per rank)."""
import copy
import json
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")


def sailfish_layers(model):
    from sailfish.nn import QuantLinear, QuantLinearW4A8
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantLinearW4A8))}


def layer_differences(got: nn.Module, ref: nn.Module) -> list:
    """What differs between two Sailfish layers: class, buffer names, values (bit for bit), segments."""
    out = []
    if type(got) is not type(ref):
        out.append(f"class {type(got).__name__} != {type(ref).__name__}")
    if got._buffers.keys() != ref._buffers.keys():
        out.append(f"buffers {sorted(got._buffers)} != {sorted(ref._buffers)}")
    for key, value in ref._buffers.items():
        mine = got._buffers.get(key)
        if (mine is None) != (value is None) or (value is not None and (
                mine.dtype != value.dtype or mine.shape != value.shape or not torch.equal(mine, value))):
            out.append(f"buffer {key}")
    if getattr(got, "segments", None) != getattr(ref, "segments", None):
        out.append("segments")
    return out


def logits(model, device):
    import sailfish
    ids = (torch.arange(10).reshape(2, 5) * 7 + 3) % 128
    # one K order per shape on a GPU, so that two models of the same shards give the same bits
    with torch.no_grad(), sailfish.batch_invariant_mode():
        return model(input_ids=ids.to(device)).logits.float().cpu()


def float_model(model):
    """model with every Sailfish layer as an fp32 nn.Linear of its dequantized weight, in fp32."""
    ref = copy.deepcopy(model)
    for name, layer in sailfish_layers(ref).items():
        lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(layer.dequantize().float())
            if layer.bias is not None:
                lin.bias.copy_(layer.bias.float())
        ref.set_submodule(name, lin.to(layer.qweight.device))
    return ref.float()


def run(rank: int, world: int, out: str, cases: list, cuda: bool) -> None:
    sys.path.insert(0, HERE)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from helpers import rel_err
    from sailfish import load_quantized
    from sailfish.parallel import default_plan

    torch.set_num_threads(1)  # two processes on a few cores: threads would oversubscribe them
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{out}.store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    results = []
    for case in cases:
        tp = load_quantized(case["path"], device=device, fuse=case["fuse"], device_mesh=mesh)
        full = load_quantized(case["path"], device=device, fuse=case["fuse"])
        fused = any(n.endswith("qkv_proj") for n in sailfish_layers(full))  # act-order layers may not fuse
        ref = parallelize_module(copy.deepcopy(full), mesh, default_plan(fused=fused))
        mine = sailfish_layers(tp)
        diffs = {n: layer_differences(mine[n], m) if n in mine else ["missing"]
                 for n, m in sailfish_layers(ref).items()}
        y_tp, y_ref, y_1 = logits(tp, device), logits(ref, device), logits(full, device)
        y_32 = logits(float_model(full), device)
        results.append({"path": case["path"], "layers": len(diffs), "diffs": {n: d for n, d in diffs.items() if d},
                        "fused": fused,
                        "equal_to_sharded_full": torch.equal(y_tp, y_ref),
                        "rel_err": rel_err(y_tp, y_1), "bound": 2 * rel_err(y_1, y_32)})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    mp.spawn(run, args=(2, out, cases, "--cuda" in sys.argv[3:]), nprocs=2)
