"""How a train.py step's rows are split over torchrun ranks and brought back together: every rank rolls out a
contiguous share of the groups and then holds the whole rollout (all_gather_rows); every rank trains its share of
each mini-batch (update_partition) and the update's metrics are averaged over ranks (all_reduce_mean). The models'
side, FSDP2 sharding, is fsdp.py. ddp: under torchrun (a process group); without it nothing is exchanged.
init_compute, this rank's device and process group, serves train.py and sft.py.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist


def init_compute(device_flag, ddp, timeout_min):
    """This rank's device from a --device flag (auto | cpu | cuda; auto: CUDA when available), on CUDA the LOCAL_RANK'th
    GPU, made current; and, when ddp, the process group (NCCL on CUDA, else gloo) whose collectives wait at most
    timeout_min minutes."""
    if device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=timeout_min))
    return device


def leave(ddp):
    """The end of a torchrun rank's run, once every file it writes is closed: the ranks wait for each other (a rank
    that tears down while rank 0 still writes its checkpoint and summary can make rank 0 abort), destroy the process
    group, and leave without finalizing the interpreter: torch's C++ teardown after the group is gone can, rarely and
    on a loaded machine, abort a rank ("terminate called without an active exception"), and os._exit skips it and
    nothing else this process still had to do. Without ddp: nothing."""
    if not ddp:
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rows_of_rank(n, rank, world):
    """Contiguous share of n rows for rank (n divisible by world)."""
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def all_gather_rows(out, ddp, world):
    """Every rank gets the whole rollout (all groups, in group order). Rollouts are small next to
    the model, so one all_gather_object keeps this simple; each row is padded to the longest T."""
    outs = [out]
    if ddp:
        outs = [None] * world
        dist.all_gather_object(outs, out)
    return merge_rows(outs)


def merge_rows(outs):
    """Concatenate rollout outputs (ranks, or mixed presets) in order: group and episode numbers continue from
    one output to the next, 2-D tensors are padded to the longest T, a stat some outputs lack counts 0 there."""
    T = max(o["tokens"].shape[1] for o in outs)
    n_groups = [int(o["group"].max()) + 1 if len(o["group"]) else 0 for o in outs]
    offsets = lambda sizes: [sum(sizes[:i]) for i in range(len(sizes))]
    outs = [dict(o, group=o["group"] + g0, episode=o["episode"] + e0) for o, g0, e0 in
            zip(outs, offsets(n_groups), offsets([len(o["scores"]) for o in outs]))]
    merged = {}
    for k in outs[0]:
        vals = [o[k] for o in outs]
        if k == "stats":
            keys = dict.fromkeys(s for v in vals for s in v)
            merged[k] = {s: torch.cat([v[s] if s in v else torch.zeros(len(o["scores"])) for v, o in zip(vals, outs)])
                         for s in keys}
        elif torch.is_tensor(vals[0]) and vals[0].dim() == 2:
            merged[k] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1])) for v in vals])
        elif torch.is_tensor(vals[0]):
            merged[k] = torch.cat(vals)
        else:
            merged[k] = [x for v in vals for x in v]
    return merged


def all_reduce_mean(d, ddp, world, device):
    """Average a dict of floats over ranks (one collective, on device: NCCL reduces GPU tensors)."""
    if not ddp or not d:
        return d
    keys = sorted(d)
    t = torch.tensor([float(d[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist())}


def max_and_mean(x, ddp, world, device):
    """(max, mean) over ranks of this rank's float x (two collectives, on device); x itself on one process."""
    if not ddp:
        return x, x
    t = torch.tensor([x, x], dtype=torch.float64, device=device)
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(t[1:])
    return t[0].item(), t[1].item() / world


def update_partition(n, mini, micro, rank, world):
    """The update's partition of n rows (n and mini, --mini-batch-size, multiples of world): [(rows of a mini-batch,
    this rank's micro-batches of micro rows of it)]. The no-grad passes (old and reference log-probs, values) use it
    too, so each row is padded to the same length beside the same rows as in the update: bf16 GEMMs whose rounding
    depends on their shape (cuBLAS picks kernels by shape) then give the update exactly the old log-probs at lr 0."""
    minis = [list(range(s, min(s + mini, n))) for s in range(0, n, mini)]
    mine = [rows[rows_of_rank(len(rows), rank, world)] for rows in minis]
    return [(rows, [m[i:i + micro] for i in range(0, len(m), micro)]) for rows, m in zip(minis, mine)]
