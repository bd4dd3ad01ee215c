"""Peak memory per rank of train.py, part by part, from the model config and the flags (train.py --plan), and the
check of a launch against its device (check_launch: the plan printed at start, a launch that does not fit refused
with the flags that would make it fit).

Its own file because train.py and bench.py (a measurement tool) both need it, and the test suite checks it against
what the CPU measures. saved_bytes measures the activation part on a real forward (train.py --measure-activations).

The parts are the ones train.py allocates: fp32 master weights, grads and AdamW states (sharded 1/W by FSDP2),
the critic's trunk, the reference model, the rollout copy (unsharded, bf16 on GPU), the sampler's static KV pool,
and the update's transients: what autograd holds for backward in one micro-batch, the bf16 weight copies
(autocast's on one process, FSDP2's all-gathered ones on several), the gradient buffers of the blocks in backward, and one
token_logprobs chunk of logits with its backward. Activation bytes per token per layer are counted from what
autograd saves in a Llama / Qwen2 layer (checked against saved_tensors_hooks on the CPU by test_memory_plan_*;
fp32 and bf16):
  fp32:          4 * (6d + 4I + 2HD + 2KvD + H + 2)          (norms 3d+1 each, q k v out, lse, MLP 4I)
  bf16 autocast: 26d + 8 + 4HD + 4KvD + 4H + 8I              (fp32 norms + a bf16 cast per Linear input)
  checkpointed:  4d per layer (the fp32 layer input) + one layer's full set while it is recomputed
  outside layers: 12d + 8 (token ids, final norm, the log-prob chunks' inputs)
The rollout's own transients are not a part: its prefills run in row chunks whose attention mask stays under
sampler.PREFILL_MASK_BYTES (1 GiB), below the update's transients counted here.
The total is the sum of the parts: every part can be alive at the update's peak (the static KV pool stays
allocated through the update, CUDA graphs need fixed addresses), so it is an upper bound, and the worst case
assumes every row of a micro-batch is --max-context tokens long.
"""
from contextlib import contextmanager

GIB = 2**30
HEADROOM = 0.92  # a card "fits" when the plan is under 92% of its memory: the CUDA context and fragmentation


def plan_memory(cfg, *, world=1, rows=128, micro=4, seq=3600, critic=True, ref=False, bf16=True,
                ckpt=False, lora_rank=0, chunk=256):
    """Expected bytes per rank by part (a dict, "total" included). cfg: an HF config; world: ranks; rows:
    trajectories rolled out per step on all ranks (the sampler's pool holds rows / world); micro: rows per
    forward/backward on a rank; seq: the longest
    conversation (--max-context); ref: a separate reference model (--kl-coef > 0 without LoRA); lora_rank:
    adapters on every Linear of the layers (all-linear), base weights frozen."""
    d, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or d // H
    tied = cfg.tie_word_embeddings
    linear = d * (H * D + 2 * KV * D) + H * D * d + 3 * d * I   # q k v o, gate up down: the weights LoRA adapts
    layer = linear + 2 * KV * D + H * D + 2 * d                 # + q k v biases, two norms
    embed = V * d
    root = embed * (1 if tied else 2) + d                       # input embedding, lm_head if untied, final norm
    P = L * layer + root
    trunk = P - (0 if tied else embed) + d + 1                  # critic: no lm_head, + value head
    # trainable parameters: everything, or the adapters (r x (in + out) per adapted Linear) + the critic's head
    adapters = L * lora_rank * (7 * d + 2 * H * D + 2 * KV * D + 3 * I)
    train_actor, train_critic = (adapters, adapters + d + 1) if lora_rank else (P, trunk)
    rb = 2 if bf16 else 4
    per_tok = (26 * d + 8 + 4 * H * D + 4 * KV * D + 4 * H + 8 * I) if bf16 else 4 * (6 * d + 4 * I + 2 * H * D + 2 * KV * D + H + 2)
    tokens = micro * seq
    acts = (L * 4 * d if ckpt else L * per_tok) * tokens + (12 * d + 8) * tokens  # + ids, final norm, chunk inputs
    slots = (seq + 1) // 128 * 128 + 128                        # sampler.static_capacity(max_context + 1)
    lm_copy = 4 * embed if world > 1 and bf16 else 0            # token_logprobs' fp32 copy of a bf16 lm_head weight
    part = dict(
        weights=4 * (P + adapters) / world, grads=4 * train_actor / world, adamw=8 * train_actor / world,
        critic=(4 * (trunk + adapters) + 12 * train_critic) / world if critic else 0,
        reference=4 * P / world if ref else 0,
        rollout_copy=rb * P if (world > 1 or bf16 or lora_rank) else 0,
        # LoRA on several ranks: the frozen base of the adapted weights, kept unsharded for sync_rollout_weights
        lora_base=rb * L * linear if lora_rank and world > 1 else 0,
        kv_pool=L * 2 * (rows // world) * KV * slots * D * rb,
        activations=acts,                                       # held from forward to backward
        recompute=(per_tok * tokens + (2 * layer if bf16 else 0)) if ckpt else 0,  # ckpt: one layer rebuilt in backward
        # bf16 copies of the weights held to backward. One process: autocast's casts (checkpointed layers recast
        # theirs, lm_head's stays). FSDP2: the all-gathered root (embedding, untied lm_head) and two blocks
        # (the one running and the one prefetched), in bf16 or fp32 as the forward runs
        weight_casts=(rb * (root + 2 * layer) if world > 1 else 0 if not bf16 else 2 * embed if ckpt else 2 * P),
        # FSDP2 backward: the unsharded gradients of the root and of two blocks in the compute dtype, plus their
        # fp32 reduce-scatter input. Every micro-batch's backward reduce-scatters into the rank's shard (train.py's
        # updates), so no unsharded gradient outlives its block: the plan does not grow with the micro-batch count
        grad_buffers=((rb + 4) * (root + 2 * layer) if not lora_rank else 0) if world > 1 else 0,
        # one chunk of token_logprobs: logits, log_softmax, probabilities, their product in fp32, computed from an
        # fp32 copy of lm_head's weight where the weight is bf16 (FSDP2's gathered parameters). Its backward
        # recomputes them (the copy included) and adds the gradients of the log-softmax and of the logits, and
        # lm_head's fp32 weight gradient, cast to bf16 for a bf16 parameter, before it is accumulated
        logprob_chunk=4 * min(chunk, tokens) * V * 4 + lm_copy,
        logprob_backward=2 * min(chunk, tokens) * V * 4 + lm_copy
        + (0 if lora_rank else 4 * embed + (rb * embed if lm_copy else 0)),
    )
    part["total"] = sum(part.values())
    return part


def fits(total, gpu_bytes):
    return total <= gpu_bytes * HEADROOM


def format_plan(part, gpu_bytes=None):
    """One line per part in GB, then the total, and against gpu_bytes (if given) whether it fits."""
    lines = [f"  {k:17s} {v / GIB:8.2f} GB" for k, v in part.items() if k != "total"]
    lines.append(f"  {'total':17s} {part['total'] / GIB:8.2f} GB per rank")
    if gpu_bytes:
        lines.append(f"  -> {'fits' if fits(part['total'], gpu_bytes) else 'does NOT fit'} in {gpu_bytes / GIB:.1f} GB "
                     f"(under {HEADROOM:.0%} of it)")
    return "\n".join(lines)


def model_config(name):
    """The --model's HF config, read without its weights."""
    import models
    if name in ("tiny", "tiny-qwen2"):  # built in memory, a few hundred KB of weights
        return models.build_tiny("llama" if name == "tiny" else "qwen2")[0].config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(models.smollm2_dir() if name == "smollm2" else name)


def fitting_flags(cfg, kw, gpu_bytes, splits=lambda w: True):
    """The first of these changes, taken in turn and kept, that brings the plan_memory(cfg, **kw) under gpu_bytes, as
    flags: --grad-checkpointing, halving --micro-batch-size down to 1, then 2, 4, 8 ranks (those the batch sizes
    split over: splits(ranks)); None if none does."""
    kw, flags, tries = dict(kw), {}, []
    if not kw["ckpt"]:
        tries.append(("ckpt", True, "--grad-checkpointing"))
    tries += [("micro", m, f"--micro-batch-size {m}") for m in (kw["micro"] // 2**i for i in range(1, 12)) if m >= 1]
    tries += [("world", w, f"torchrun --nproc_per_node={w}") for w in (2, 4, 8) if w > kw["world"] and splits(w)]
    for key, value, flag in tries:
        kw[key], flags[key] = value, flag
        if fits(plan_memory(cfg, **kw)["total"], gpu_bytes):
            return " ".join(flags.values())
    return None


def check_launch(args, world, device):
    """train.py's plan of its launch (args: its flags, world: its ranks, device: its torch device) from the --model's
    config. Returns (what to print: the parts with --plan, else one line; why the launch is refused, or None). On
    CUDA, or with --gpu-memory-gb, a plan that does not fit is refused unless --force, with the flags that would make
    it fit. A config that cannot be read gives (None, None) (loading the model then says why), under --plan a
    ValueError."""
    try:
        cfg = model_config(args.model)
    except (OSError, ValueError) as e:
        if args.plan is not None:
            raise ValueError(f"cannot load --model {args.model}: cannot read its config: {str(e).splitlines()[0]}") from e
        return None, None
    import models
    import torch
    use_cuda = device.type == "cuda"
    cuda_bytes = torch.cuda.get_device_properties(device).total_memory if use_cuda else None
    gpu_plan = use_cuda or (args.plan is not None and args.device == "auto")  # --plan off a GPU plans the CUDA run
    kw = dict(world=world, rows=args.num_groups * args.group_size, micro=args.micro_batch_size,
              seq=args.max_context, critic=args.critic, ref=args.kl_coef > 0 and not args.lora_rank,
              bf16=models.compute_dtype(args.dtype, "cuda" if gpu_plan else "cpu") == "bf16", ckpt=args.grad_checkpointing,
              lora_rank=args.lora_rank)
    plan = plan_memory(cfg, **kw)
    gpu_bytes = (args.gpu_memory_gb * GIB if args.gpu_memory_gb is not None else
                 cuda_bytes if use_cuda else 80 * GIB if gpu_plan else None)
    fit = gpu_bytes is None or fits(plan["total"], gpu_bytes)
    splits = lambda w: args.num_groups % w == 0 and args.mini_batch_size % w == 0 and args.val_groups % w == 0
    fitting = None if fit else fitting_flags(cfg, kw, gpu_bytes, splits)
    if args.plan is not None:
        text = (f"memory plan of --model {args.model} per rank, {world} rank{'s' * (world > 1)}, "
                f"{'bf16' if kw['bf16'] else 'fp32'} compute, micro-batch {args.micro_batch_size} x {args.max_context} "
                f"tokens{', grad checkpointing' if args.grad_checkpointing else ''}:\n" + format_plan(plan, gpu_bytes))
        if not fit:
            text += f"\n  fits with: {fitting}" if fitting else "\n  nothing here fits it: a smaller --model or larger GPUs"
        return text, None
    text = (f"memory plan: {plan['total'] / GIB:.2f} GB per rank" + (f" of {gpu_bytes / GIB:.1f} GB" if gpu_bytes else "")
            + " (--plan for its parts)")
    refusal = None
    if not fit and (use_cuda or args.gpu_memory_gb is not None) and not args.force:
        refusal = (f"the memory plan, {plan['total'] / GIB:.1f} GB per rank, does not fit in {gpu_bytes / GIB:.1f} GB "
                   f"(under {HEADROOM:.0%} of it); " + (f"it fits with {fitting}" if fitting else "a smaller --model or "
                   "larger GPUs") + "; --plan shows its parts, --force starts anyway")
    return text, refusal


@contextmanager
def saved_bytes(model):
    """Bytes of the distinct storages autograd keeps for backward inside the block (held[0]), the model's own
    parameters (and views of them) excepted: the activation memory of a micro-batch, which plan_memory predicts
    (train.py --measure-activations logs it). Activation checkpointing keeps its own inside checkpointed blocks, so
    with gradient checkpointing this counts only what checkpointing still stores."""
    import torch
    local = lambda q: q.to_local() if hasattr(q, "to_local") else q  # FSDP2: a DTensor's storage is its shard's
    held, seen = [0], {local(q).untyped_storage().data_ptr() for q in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            held[0] += s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield held
