"""The models' distributed lifecycle in train.py: built (the critic, LoRA adapters), sharded (FSDP2 under torchrun),
filled, mirrored into the rollout copy, gathered for checkpoints and filled back on resume.

Weights are fp32 (the optimizer's master copy); in bf16 compute (CUDA, or a CPU with native bf16: models.compute_dtype)
the forward runs in bf16 autocast, as RAGEN's FSDP mixed precision does. Rank 0 alone reads the weights (fp32 on the
CPU, self-checked by models.load_model) and builds the models there; every rank works on their structure on the meta
device (meta_copy: no memory), shards it under torchrun (shard), and only then allocates it on the device and fills
it from rank 0's state dicts, broadcast (materialize). No GPU ever holds a whole fp32 model before sharding
(Qwen2.5-7B PPO: 83 GB of fp32 actor, critic trunk and rollout copy on each rank), and the rollout copy is allocated
in its own dtype.
Rollouts run on a plain unsharded copy (the sampler calls submodules directly, which FSDP2's hooks would not see),
refreshed after every update (sync_rollout_weights). Under LoRA the adapter is merged into that copy, and only the
adapters are gathered.
"""
import copy
import models
import sampler

import torch
import torch.distributed as dist

import starpo


def meta_copy(m, dtype=None):
    """A copy of module m with its parameters on the meta device (in dtype if given), tied ones still tied; buffers
    (RoPE's inv_freq, small) are copied as they are."""
    memo = {id(q): torch.nn.Parameter(torch.empty_like(q, device="meta", dtype=dtype), q.requires_grad) for q in m.parameters()}
    return copy.deepcopy(m, memo)


def materialize(m, src, device, ddp):
    """Allocate meta module m (sharded if FSDP2 wraps it) on device and fill its parameters from src, a full state
    dict on rank 0 (broadcast when ddp, under torchrun; None: filled later). Buffers are not in state dicts and
    to_empty leaves them uninitialised: they are put back. to_empty unties tied weights of a plain module."""
    buffers = {n: b.clone() for n, b in m.named_buffers()}
    m.to_empty(device=device)
    from torch.distributed.fsdp import FSDPModule
    if hasattr(m, "tie_weights") and not isinstance(m, FSDPModule):  # (FSDP2 keeps them tied)
        m.tie_weights()
    for n, b in m.named_buffers():
        b.copy_(buffers[n])
    if src is not None and ddp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(m, dict(src), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # (it
        # puts the loaded DTensors into the dict it is given; the reference and the rollout copy share one)
    elif src is not None:
        m.load_state_dict(src)
    return m


class Critic(torch.nn.Module):
    """Value head on its own copy of the LM trunk (RAGEN: AutoModelForTokenClassification, num_labels=1)."""

    def __init__(self, lm):
        super().__init__()
        self.model = copy.deepcopy(lm.model)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1, device=lm.device)
        torch.nn.init.zeros_(self.head.weight), torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens, attention_mask, share_prefix=False):
        h = starpo.last_hidden(self.model, tokens, attention_mask, share_prefix)             # [B, T, H]
        v = self.head(h).squeeze(-1).float()                                              # [B, T]
        # values[:, t] = V(tokens[:, :t]): the state in which token t is chosen, aligned with logp[:, t]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)                   # [B, T]


def add_lora(models, rank, alpha, target):
    """peft LoRA of rank, alpha and target modules (--lora-target: "all-linear" or comma-separated names) on each of
    models, injected in place by transformers' add_adapter (the classes stay; base weights frozen). Returns the
    LoraConfig factory (a fresh config per use: the HF export builds one more); a ValueError says in one line what
    peft or transformers refused."""
    from peft import LoraConfig
    config = lambda: LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                target_modules="all-linear" if target == "all-linear" else target.split(","))
    try:
        for m in models:
            m.add_adapter(config())
    except ValueError as e:  # peft names missing target modules; transformers refuses a peft it cannot drive
        if "target modules" in str(e).lower():
            raise ValueError(f"--lora-target {target!r}: {str(e).splitlines()[0]}") from e
        import importlib.metadata, transformers
        raise ValueError(f"LoRA: {str(e).splitlines()[0]} (installed: peft {importlib.metadata.version('peft')}, "
                         f"transformers {transformers.__version__}; requirements.txt pins a pair that works)") from e
    return config


def shard(models, bf16):
    """FSDP2: shard every transformer block of each model (None: skipped), then its root (pytorch/examples
    distributed/FSDP2)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # bf16: all-gather bf16 parameters (half the traffic of fp32), reduce-scatter gradients in fp32 (RAGEN's FSDP
    # mixed_precision: param_dtype bf16, reduce_dtype fp32); the sharded master weights and AdamW stay fp32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for m in models:
        if m is not None:
            for block in m.model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(m, mp_policy=mp)


@torch.no_grad()
def sync_rollout_weights(actor, rollout_model, ddp, lora=False, lora_base=None):
    """Copy the (possibly sharded) actor into the unsharded rollout model; every rank calls this. Returns the bytes
    it all-gathered. FSDP2: one all-gather per block and one for the root (unshard, in the all-gather dtype: bf16
    under bf16 compute, the rollout copy's dtype), rather than one fp32 gather per parameter.
    lora: the rollout model is a plain copy with the adapter merged in, W = W0 + B @ A * alpha / r
    (peft's lora.Linear.get_delta_weight), rather than a copy carrying peft's layers: the sampler keeps running the
    plain HF layout that load_model self-checked (and that the compiled CUDA-graph step captures) with no per-token
    adapter matmuls, at the cost of one rank-r product per adapted weight per sync. Only those weights change,
    and only the adapters are gathered: the frozen W0 was kept from the rollout copy's first fill (lora_base, by
    module name, in the rollout dtype, under ddp only; W0 of a bf16 checkpoint is exact in it)."""
    if rollout_model is actor:
        return 0
    gathered = 0
    if lora:
        for name, m in actor.named_modules():
            if hasattr(m, "lora_A"):  # a peft LoRA layer around m.base_layer
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                if ddp:
                    a, b = a.full_tensor(), b.full_tensor()
                    gathered += (a.numel() + b.numel()) * a.element_size()
                w0 = lora_base[name] if ddp else m.base_layer.weight
                rollout_model.get_submodule(name).weight.copy_(w0 + b @ a * m.scaling["default"])
        return gathered
    if not ddp:
        for p_, q in zip(actor.parameters(), rollout_model.parameters()):
            q.copy_(p_)
        return 0
    mirror = dict(rollout_model.named_parameters())
    for prefix, part in [(f"model.layers.{i}.", block) for i, block in enumerate(actor.model.layers)] + [("", actor)]:
        part.unshard()  # this FSDP2 group's parameters, gathered in one collective
        for n, p_ in part.named_parameters(prefix=prefix.rstrip(".")):
            if prefix or not n.startswith("model.layers."):  # the root: its own parameters (the blocks are done)
                mirror[n].copy_(p_)
                gathered += p_.numel() * p_.element_size()
        part.reshard()
    return gathered


def model_state(model, lora=False, full=False):
    """model's trainable weights as a state dict keyed by parameter name: this rank's share (DTensor shards under
    FSDP2, whole tensors on one process), or with full=True the whole tensors on CPU (a collective under FSDP2: every
    rank calls it). lora: the adapters (+ the critic's head) only, the frozen base comes from --model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full,
                                                               ignore_frozen_params=lora))
    if lora:  # a tied (frozen) lm_head.weight slips through ignore_frozen_params
        trainable = {n for n, q in model.named_parameters() if q.requires_grad}
        msd = {k: v for k, v in msd.items() if k in trainable}
    return msd


def training_state(model, optimizer=None, lora=False, with_optimizer=None):
    """This rank's share of model's trainable weights and of optimizer's state, as torch.distributed.checkpoint saves
    and loads them: {"model": ..., "optim": ...}, keyed by parameter name, so that any number of ranks can load them.
    "optim" is left out for an optimizer that has never stepped (the actor in PPO's critic warm-up): torch's
    get_optimizer_state_dict would create its state by stepping it at lr 0 (_init_optim_state), in the file and in the
    live optimizer, AdamW at step 1 with zero moments, so that the first real update takes step 2's bias correction and
    a run that saved would differ from one that did not. with_optimizer=True (a load's template for a checkpoint whose
    optimizer had stepped) includes it anyway, creating the state the load then overwrites."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    state = {"model": model_state(model, lora)}
    if optimizer is not None and (with_optimizer or (with_optimizer is None and optimizer.state)):
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=lora))
    return state


def set_training_state(model, optimizer, state, lora=False):
    """Fill model (and optimizer, where state has "optim") from a loaded training_state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    o = StateDictOptions(strict=not lora)  # LoRA: the frozen base comes from --model
    set_model_state_dict(model, state["model"], options=o)
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=o)


def load_state(model, optimizer, msd, osd, lora=False):
    """Fill model (and optimizer) from whole state dicts (a ckpt.pt written before the sharded state directories held
    them), on every rank (sharded under FSDP2). osd None: the optimizer had never stepped and stays as it is
    (set_optimizer_state_dict would step it at lr 0, as training_state says)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    o = StateDictOptions(full_state_dict=True, strict=not lora)  # LoRA: the frozen base comes from --model
    set_model_state_dict(model, msd, options=o)
    if optimizer is not None and osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=o)
        for st in optimizer.state.values():  # own copies, not views of the memory-mapped ckpt.pt
            st.update({k: v.clone() for k, v in st.items() if torch.is_tensor(v)})


def load_on_rank0(name, ddp, master):
    """rank 0 loads the model `name` (fp32 on the CPU); under torchrun the other ranks get its structure on the meta
    device and the tokenizer. A failure raises the same ValueError on every rank."""
    model, tok, err = None, None, None
    if master:
        try:
            model, tok = models.load_model(name, check=sampler.self_check)
        except (ValueError, FileNotFoundError, OSError) as e:
            err = f"cannot load --model {name}: {e}"
    if ddp:  # the other ranks get the structure and the tokenizer (and the error, so that every rank stops)
        box = [err, meta_copy(model) if model is not None else None, tok]
        dist.broadcast_object_list(box)
        err, model, tok = box[0], model if master else box[1], box[2]
    if err:
        raise ValueError(err)
    return model, tok


def build_models(name, device, ddp, rank, bf16, with_critic, with_ref, lora=(0, 64, "all-linear"), grad_checkpointing=False):
    """train.py's models from the model `name`: fp32 master weights, built on the meta device, sharded when ddp,
    then filled from rank 0 (this file's docstring says how and why). with_critic: a critic (a value head on a copy of the
    trunk); with_ref: a frozen reference (under LoRA none: the actor with its adapter off is the reference);
    lora: (rank, alpha, target modules), rank 0 = full fine-tuning; bf16: the rollout copy in bf16. Returns a dict:
    actor, critic, ref, rollout_model (the actor itself on one fp32 process without LoRA, else an unsharded copy),
    tok, lora_config, lora_base (LoRA under torchrun: the frozen base of every adapted weight)."""
    master, (lora_rank, lora_alpha, lora_target) = rank == 0, lora
    loaded, tok = load_on_rank0(name, ddp, master)  # rank 0's real weights go into the state dicts below
    ref = meta_copy(loaded).eval().requires_grad_(False) if with_ref and not lora_rank else None
    critic_src = Critic(loaded) if with_critic else None  # rank 0: a real trunk copy, on the CPU
    if grad_checkpointing:
        loaded.gradient_checkpointing_enable()
        if critic_src is not None:
            critic_src.model.gradient_checkpointing_enable()
    rollout_copy = None  # None: the actor itself samples. LoRA: a plain copy, adapter merged in (sync_rollout_weights)
    if ddp or bf16 or lora_rank:
        rollout_copy = meta_copy(loaded, torch.bfloat16 if bf16 else torch.float32).eval().requires_grad_(False)
    base_sd = loaded.state_dict() if master else {}  # the base weights: reference, rollout copy (views, no copy)
    lora_config = None
    if lora_rank:  # RAGEN: the critic trunk gets LoRA too; its head trains fully
        lora_config = add_lora([loaded] + ([critic_src.model] if critic_src is not None else []), lora_rank, lora_alpha,
                               lora_target)
    actor_sd = loaded.state_dict() if master else {}
    critic_sd = (critic_src.state_dict() if master else {}) if critic_src is not None else None
    actor, critic = meta_copy(loaded), None if critic_src is None else meta_copy(critic_src)
    del loaded, critic_src  # rank 0's real weights live on in the state dicts alone: no allocated model before sharding
    if ddp:
        shard([actor, critic, ref], bf16)
    for m, sd in [(actor, actor_sd), (critic, critic_sd), (ref, base_sd), (rollout_copy, base_sd)]:
        if m is not None:
            materialize(m, sd, device, ddp)
    rollout_model = actor if rollout_copy is None else rollout_copy
    # LoRA on several ranks: the frozen base of every adapted weight, kept from the rollout copy's fill (not re-gathered)
    lora_base = {n: rollout_model.get_submodule(n).weight.clone() for n, m in actor.named_modules()
                 if hasattr(m, "lora_A")} if lora_rank and ddp else {}
    return dict(actor=actor, critic=critic, ref=ref, rollout_model=rollout_model, tok=tok, lora_config=lora_config,
                lora_base=lora_base)
