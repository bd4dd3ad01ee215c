"""train.py's run directory: args.json, metrics.jsonl, observations.jsonl, ckpt.pt and state-<N>/ (what --resume
continues) and hf/ (the trained model as a plain HF directory), written so that a run killed at any instant resumes
from its last checkpoint.

The training state (actor and critic weights and AdamW states) is saved sharded with torch.distributed.checkpoint:
every rank writes its own shard into state-<N>/ (N steps done), and no rank ever holds the whole state (at 7B the
actor, critic and their AdamW states are about 176 GB); a resume on any number of ranks reads the shards it needs.
ckpt.pt is small: the step, args, RNG, monitor and the name of its state directory. hf/ is the actor gathered whole
on rank 0, weights only. Files are replaced by rename: a checkpoint writes state-<N>.tmp/ (all ranks), renames it
to state-<N>/, writes ckpt.pt.tmp and hf.tmp, renames hf -> hf.old, hf.tmp -> hf, then ckpt.pt.tmp -> ckpt.pt (the
commit), and removes the older state directory; clean_interrupted_checkpoint undoes what a kill half-way left
behind. A resumed run drops the metrics lines written after its checkpoint.
"""
import json
import os
import platform
import shutil
import subprocess
import time
import warnings

import torch
import torch.distributed as dist

from fsdp import load_state, meta_copy, model_state, set_training_state, training_state

# A resumed run takes the same flags, except these, which change neither what is trained nor the sampled tokens:
# where and how long it runs, what it logs, memory, and the reference paths
RESUME_MAY_CHANGE = ("resume", "out", "steps", "save_every", "wandb", "val_every", "device", "log_trajectories_every",
                     "micro_batch_size", "grad_checkpointing", "no_kv_reuse", "no_prefix_sharing", "collapse_every",
                     "save_adapter", "keep_hf", "force", "gpu_memory_gb", "pg_timeout_min", "plan", "sampler", "measure_activations",
                     "dtype", "compute_dtype")  # and the dtype: a resumed run keeps its compute dtype unless --dtype names one


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def changed_flags(saved, args, may_change):
    """A resume's check (train.py, sft.py): the flags of a run's args `saved` (a dict) that args now gives otherwise,
    those in may_change aside, as '--flag was a, now b'. A key saved lacks (a flag newer than the run, or derived from
    others) is not compared."""
    return [f"--{k.replace('_', '-')} was {v!r}, now {getattr(args, k, None)!r}" for k, v in saved.items()
            if k not in may_change and getattr(args, k, None) != v]


def open_run(args):
    """The run directory of args (args.out set, default runs/<preset>-<algo>-<time>) and, with --resume, its
    checkpoint (else None), checked: a ValueError says why this launch cannot use them."""
    ckpt = None
    if args.resume:
        ckpt_path = os.path.join(args.resume, "ckpt.pt")
        if not os.path.exists(ckpt_path):
            raise ValueError(f"--resume {args.resume}: no ckpt.pt there")
        # small (the weights are in its state directory); mmap: a ckpt.pt that holds full state dicts itself is
        # mapped once in the page cache for all ranks
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
        if ckpt["step"] >= args.steps:
            raise ValueError(f"--resume {args.resume}: its checkpoint is at step {ckpt['step']}; --steps {args.steps} "
                             "leaves nothing to do")
        changed = changed_flags(ckpt["args"], args, RESUME_MAY_CHANGE)
        if changed:
            raise ValueError(f"--resume {args.resume}: flags differ from the run's args.json: {', '.join(changed)}")
        args.out = args.resume
    elif args.out is not None and os.path.exists(os.path.join(args.out, "ckpt.pt")):
        raise ValueError(f"--out {args.out} holds a checkpoint: continue it with --resume {args.out}, or choose another --out")
    if args.out is None:
        args.out = os.path.join("runs", f"{args.env}-{args.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    d = os.path.abspath(args.out)
    while not os.path.exists(d):  # the run directory, or the first of its parents that exists, must be a writable directory
        d = os.path.dirname(d)
    if not (os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)):
        raise ValueError(f"--out {args.out}: cannot write there, {d} {'is not writable' if os.path.isdir(d) else 'is not a directory'}")
    return ckpt


def clean_interrupted_checkpoint(out):
    """Undo what a save_checkpoint killed half-way left behind in run directory out; afterwards hf/ holds the weights
    of ckpt.pt and the only state directory is ckpt.pt's. save_checkpoint renames hf -> hf.old, hf.tmp -> hf, then
    ckpt.pt.tmp -> ckpt.pt (the commit): hf.old together with ckpt.pt.tmp, or without hf, means the commit never
    happened, so hf.old is ckpt.pt's export."""
    j = lambda name: os.path.join(out, name)
    shutil.rmtree(j("hf.tmp"), ignore_errors=True)
    committed = torch.load(j("ckpt.pt"), weights_only=False, mmap=True).get("state") if os.path.exists(j("ckpt.pt")) else None
    remove_states(out, committed)  # a half-written state (.tmp), one renamed in before its commit, one left after it
    if os.path.isdir(j("hf.old")):
        if os.path.exists(j("ckpt.pt.tmp")) or not os.path.isdir(j("hf")):
            if os.path.isdir(j("hf")):
                os.rename(j("hf"), j("hf.tmp"))
                shutil.rmtree(j("hf.tmp"))
            os.rename(j("hf.old"), j("hf"))
        else:
            shutil.rmtree(j("hf.old"))
    if os.path.exists(j("ckpt.pt.tmp")):  # last: while it exists, a rerun of this function redoes the above
        os.remove(j("ckpt.pt.tmp"))


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def remove_states(out, keep):
    """Remove every state directory in run directory out but `keep` (a name, or None: all)."""
    for d in os.listdir(out):
        if d.startswith("state-") and d != keep:
            shutil.rmtree(os.path.join(out, d))


def start_run_dir(args, world, start_step, resumed):
    """Rank 0, before the first step: the run directory made and cleaned, args.json written (with the versions), and
    metrics.jsonl cut to the steps before start_step on a resume (removed on a fresh start)."""
    os.makedirs(args.out, exist_ok=True)
    clean_interrupted_checkpoint(args.out)
    import transformers
    write_atomically(os.path.join(args.out, "args.json"), json.dumps(dict(
        vars(args), git_commit=git_commit(), world_size=world, torch=torch.__version__,
        transformers=transformers.__version__, python=platform.python_version(), cuda=torch.version.cuda), indent=1))
    for name in ("metrics.jsonl", "observations.jsonl"):  # the step-by-step logs
        path = os.path.join(args.out, name)
        if resumed and os.path.exists(path):  # drop the lines a killed run wrote after its checkpoint,
            lines = open(path).read().split("\n")[:-1]  # and a partial last line (a kill while appending)
            write_atomically(path, "".join(l + "\n" for l in lines if json.loads(l)["step"] < start_step))
        elif os.path.exists(path):
            os.remove(path)


def lora_export(model_name, lora_config, adapter_sd, adapter_dir=None):
    """The HF export under LoRA: the --model weights reloaded (frozen while training) plus the adapter (peft
    lora_config), merged by peft into a plain fp32 model; the adapter alone (peft format) goes to adapter_dir if given."""
    from peft import get_peft_model
    from models import load_model
    model = get_peft_model(load_model(model_name)[0], lora_config)
    bad = model.base_model.model.load_state_dict(adapter_sd, strict=False).unexpected_keys  # the actor's names
    assert not bad, bad
    if adapter_dir:
        model.save_pretrained(adapter_dir)
    return model.merge_and_unload()


def save_checkpoint(args, step, monitor, actor, opt, critic, critic_opt, rollout_model, tok, lora_config, rank):
    """The checkpoint of `step` (0-based) in <args.out>: state-<step+1>/, the actor and the critic (None: none) with
    their optimisers opt and critic_opt, written sharded by every rank (torch.distributed.checkpoint); ckpt.pt, the
    torch RNG, step and monitor and the state directory's name; hf/, the actor's weights in rollout_model's structure
    (under LoRA: the --model reloaded with the adapter of lora_config(), a factory, merged in) and tok. Everything is
    written under temporary names and renamed in, ckpt.pt last (the commit). Every rank calls it (the shards and hf/'s
    weights are collectives), rank 0 renames and commits. Killed at any instant, the previous checkpoint stays whole,
    hf/ is ahead of ckpt.pt for at most one rename (and --keep-hf's copy of it to step<N>), and
    clean_interrupted_checkpoint() puts it back; a failed write raises OSError, which says so."""
    import torch.distributed.checkpoint as dcp
    lora = args.lora_rank > 0  # LoRA: adapters (+ critic head)
    actor_sd = model_state(actor, lora, full=True)  # the whole actor on rank 0 (CPU), for hf/ only
    shards = {"actor": training_state(actor, opt, lora)}
    if critic is not None:
        shards["critic"] = training_state(critic, critic_opt, lora)
    name = f"state-{step + 1:06d}"
    j = lambda name: os.path.join(args.out, name)
    try:  # every rank writes its shards; a failure on any rank raises on every rank
        with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process", it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(shards, checkpoint_id=j(name + ".tmp"), no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as e:  # (the latter is a BaseException) a full disk on some rank
        cause = next(iter(e.failures.values()))[0] if isinstance(e, dcp.api.CheckpointException) else e
        raise OSError(f"checkpoint of step {step} failed writing {name}.tmp, {args.out} still holds the previous one: "
                      f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None
    if rank != 0:
        return
    state = dict(step=step, args={k: v for k, v in vars(args).items()}, state=name, torch_rng=torch.get_rng_state(),
                 monitor=monitor)
    try:
        shutil.rmtree(j(name), ignore_errors=True)  # one renamed in by a launch killed before its commit
        os.rename(j(name + ".tmp"), j(name))
        torch_save(state, j("ckpt.pt.tmp"))
        if lora:  # the peft config of the actor's adapters
            export = lora_export(args.model, lora_config(), actor_sd,
                                 os.path.join(j("hf.tmp"), "adapter") if args.save_adapter else None)
        else:
            # the rollout copy's structure holding the gathered CPU tensors themselves: no weight copy, none on the GPU
            export = meta_copy(rollout_model)
            export.load_state_dict(actor_sd, assign=True)
            export.tie_weights()
        export.save_pretrained(j("hf.tmp"))
        tok.save_pretrained(j("hf.tmp"))
        if os.path.isdir(j("hf")):
            os.rename(j("hf"), j("hf.old"))
        os.rename(j("hf.tmp"), j("hf"))
        if args.keep_hf:  # a copy named after the steps done, before the commit: a resume that repeats the step redoes it
            keep = j(f"step{step + 1}")
            shutil.rmtree(keep + ".tmp", ignore_errors=True)
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(j("hf"), keep + ".tmp")
            os.rename(keep + ".tmp", keep)
        os.replace(j("ckpt.pt.tmp"), j("ckpt.pt"))  # the commit: a resume now starts after this step
        shutil.rmtree(j("hf.old"), ignore_errors=True)
        remove_states(args.out, name)  # the previous checkpoint's
    except OSError as e:
        raise OSError(f"checkpoint of step {step} failed, {args.out} still holds the previous one: {e}") from e


def torch_save(obj, f):
    """torch.save, except that a write that fails (a full disk) is an OSError: torch's zip writer reports it as a
    RuntimeError ("unexpected pos ...")."""
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        raise OSError(f"could not write {getattr(f, 'name', f)}: {e}") from None


def load_checkpoint(args, ckpt, actor, opt, critic, critic_opt):
    """Fill the actor, the critic (None: none) and their optimisers, and the torch RNG, from open_run's checkpoint
    ckpt (None: a fresh run), on every rank: each reads its own share of the state directory, whatever the number of
    ranks that wrote it (or from full state dicts in ckpt.pt itself). Returns (the first step to run,
    the collapse indicators and stop counters, checkpointed with the run)."""
    if ckpt is None:
        return 0, {"early_std": [], "early_entropy": [], "grad_norms": [], "skipped": 0}
    lora = args.lora_rank > 0
    if "state" in ckpt:
        import torch.distributed.checkpoint as dcp
        path = os.path.join(args.out, ckpt["state"])
        saved = read_state_keys(path)  # which optimisers had stepped (a never-stepped one is not saved)
        shards = {"actor": training_state(actor, opt, lora, with_optimizer="actor.optim" in saved)}
        if critic is not None:
            shards["critic"] = training_state(critic, critic_opt, lora, with_optimizer="critic.optim" in saved)
        with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process", it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(shards, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_training_state(actor, opt, shards["actor"], lora)
        if critic is not None:
            set_training_state(critic, critic_opt, shards["critic"], lora)
    else:
        load_state(actor, opt, ckpt["actor"], ckpt["actor_opt"], lora)
        if critic is not None:
            load_state(critic, critic_opt, ckpt["critic"], ckpt["critic_opt"], lora)
    torch.set_rng_state(ckpt["torch_rng"])
    return ckpt["step"] + 1, ckpt["monitor"]


def read_state_keys(path):
    """The top two levels of the keys in the state directory at path, e.g. {"actor.model", "actor.optim", ...}."""
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {".".join(k.split(".")[:2]) for k in keys}


def read_state(run_dir):
    """A run directory's checkpoint, whole, in this process (for inspection and tests): ckpt.pt's entries (step, args,
    torch_rng, monitor) with actor, actor_opt, critic, critic_opt as full state dicts (None where absent: no critic,
    or an optimizer that never stepped). Reads either checkpoint format."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    ckpt = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    if "state" not in ckpt:
        return ckpt
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore")
        shards = _load_state_dict_from_keys(checkpoint_id=os.path.join(run_dir, ckpt["state"]))
    for m in ("actor", "critic"):
        ckpt[m], ckpt[f"{m}_opt"] = shards.get(m, {}).get("model"), shards.get(m, {}).get("optim")
    return ckpt


def print_summary(args, plot=None):
    """The end of a run (rank 0): what moved on the held-out validation seeds (first and last validation in
    metrics.jsonl), where the run's files are (plot: the curves' PNG if one was drawn), what to run next."""
    o, key = args.out, f"val-env/{args.val_env[0]}/success"
    vals = [v for v in map(json.loads, open(os.path.join(o, "metrics.jsonl"))) if key in v]
    if len(vals) > 1:
        a, b = vals[0], vals[-1]
        ok = lambda v, e: ("n/a" if not v[f"val-env/{e}/num_turns"] else  # a rate over no turn played
                           f"{1 - v[f'val-env/{e}/format_errors'] / v[f'val-env/{e}/num_turns']:.3f}")
        print(f"\nheld-out validation, {args.val_groups} seeds per preset, step {a['step']} -> {b['step']}:")
        for e in args.val_env:
            print(f"  {e}: success {a[f'val-env/{e}/success']:.3f} -> {b[f'val-env/{e}/success']:.3f} | score "
                  f"{a[f'val-env/{e}/score']:.3f} -> {b[f'val-env/{e}/score']:.3f} | format-valid turns "
                  f"{ok(a, e)} -> {ok(b, e)}")
    print(f"\nrun directory {o}:\n  metrics.jsonl   one line of metrics per step; curves: {plot or f'python eval.py --plot {o}'}\n"
          f"  *.jsonl         sample trajectories, every --log-trajectories-every {args.log_trajectories_every} steps")
    if os.path.isdir(os.path.join(o, "hf")):
        print(f"  hf/             the trained model as an HF directory; ckpt.pt continues it (--resume {o}, same flags)\n"
              f"next: python eval.py --model {o}    # the run's val presets {args.val_env} on 256 held-out seeds", flush=True)
