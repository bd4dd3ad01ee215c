"""
StarPO / StarPO-S: multi-turn PPO or GRPO on whole agent trajectories (RAGEN, arXiv 2504.20073).

    python train.py --model smollm2 --env bandit --no-think ...        # CPU demo, see README
    python train.py --env sokoban --algo ppo                            # one GPU, the paper's StarPO-S
    torchrun --nproc_per_node=8 train.py --env sokoban --algo ppo      # eight GPUs, same maths

One loop, in the order it happens (DESIGN.md §5):
rollout -> filter groups -> old / ref log-probs and values -> advantages -> PPO updates -> log
-> validation -> checkpoint. Defaults are the paper's StarPO-S settings (RAGEN_SPEC §4.1, §5).
"""
import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import env_bandit
import env_frozenlake
import env_sokoban
import env_webshop
import starpo
from rollout import load_model, rollout

# every preset of every env file, plus short names (one dict literal, no registry)
ENV_CLASSES = {}
for _cls, _mod in [(env_bandit.BanditEnv, env_bandit), (env_sokoban.SokobanEnv, env_sokoban),
                   (env_frozenlake.FrozenLakeEnv, env_frozenlake), (env_webshop.WebShopEnv, env_webshop)]:
    for _name, _preset in _mod.PRESETS.items():
        ENV_CLASSES[_name] = (_cls, _preset)
SHORT_NAMES = {"bandit": "Bandit", "sokoban": "SimpleSokoban", "frozenlake": "FrozenLake", "webshop": "WebShop"}


def preset_name(name):
    """'sokoban' -> 'SimpleSokoban'; preset names are matched case-insensitively."""
    name = SHORT_NAMES.get(name.lower(), name)
    for known in ENV_CLASSES:
        if known.lower() == name.lower():
            return known
    sys.exit(f"train.py: unknown env or preset {name!r}; choose from {sorted(SHORT_NAMES)} or {sorted(ENV_CLASSES)}")


# ----------------------------------------------------------------------------- CLI
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
# Environment and agent loop
p.add_argument("--env", default="sokoban", help="short name (bandit, sokoban, frozenlake, webshop) or any preset")
p.add_argument("--val-env", nargs="*", default=None, help="presets to validate on (default: the train preset; Bandit adds BanditTest)")
p.add_argument("--max-turns", type=int, default=None, help="turns per episode (agent_proxy.max_turn; default 5, or the preset's: Bandit 1, WebShop 9)")
p.add_argument("--max-actions-per-turn", type=int, default=None, help="actions kept per turn (default 5, or the preset's: Bandit and WebShop 1)")
p.add_argument("--max-actions-per-traj", type=int, default=None, help="action budget per episode (default: the preset's, 10 for Sokoban)")
p.add_argument("--max-new-tokens", type=int, default=400, help="response tokens per turn (rollout.response_length)")
p.add_argument("--max-context", type=int, default=None, help="longest conversation in tokens, longer episodes end as truncated (default 3600, WebShop 15000)")
p.add_argument("--no-think", action="store_true", help="answer-only mode: force <answer> instead of <think> (enable_think=False)")
p.add_argument("--format-penalty", type=float, default=-0.1, help="added to the score once per malformed turn")
p.add_argument("--no-kv-reuse", action="store_true", help="re-prefill the whole conversation every turn (reference path)")
p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature (also used for log-probs)")
p.add_argument("--top-p", type=float, default=1.0, help="rollout nucleus sampling")
# Model
p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="hub id, local dir, 'smollm2' (offline) or 'tiny' (tests)")
p.add_argument("--device", default="auto", help="auto | cpu | cuda")
p.add_argument("--grad-checkpointing", action="store_true", help="trade compute for memory in the updates")
# Batch sizes
p.add_argument("--num-groups", type=int, default=8, help="env groups per rollout (es_manager.train.env_groups)")
p.add_argument("--group-size", type=int, default=16, help="rollouts per group, all from the same seed")
p.add_argument("--filter-ratio", type=float, default=0.25, help="StarPO-S: keep this fraction of groups (1 = no filter)")
p.add_argument("--filter-type", default="std", choices=["std", "std_rev"], help="rank groups by largest (std) or smallest in-group reward std")
p.add_argument("--mini-batch-size", type=int, default=32, help="trajectories per optimizer step (ppo_mini_batch_size)")
p.add_argument("--micro-batch-size", type=int, default=4, help="rows per forward/backward on a rank (memory only, same maths)")
p.add_argument("--ppo-epochs", type=int, default=1, help="passes over the kept rollout")
p.add_argument("--online-k", type=int, default=1, help="Online-k: roll out k times the groups, feed k mini-batch updates")
# Algorithm
p.add_argument("--algo", default="ppo", choices=["ppo", "grpo"], help="ppo = critic + GAE; grpo = group-normalised scores, no critic")
p.add_argument("--vanilla", action="store_true", help="vanilla StarPO: no filter, clip 0.2/0.2, KL loss 0.001 (overrides those flags)")
p.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below 1")
p.add_argument("--clip-high", type=float, default=0.28, help="PPO clip above 1 (clip-higher, DAPO)")
p.add_argument("--dual-clip", type=float, default=3.0, help="dual-clip bound for negative advantages (0 = off)")
p.add_argument("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
p.add_argument("--entropy-coef", type=float, default=0.001, help="entropy bonus")
p.add_argument("--kl-coef", type=float, default=0.0, help="KL loss to the reference model (0 = no reference model)")
p.add_argument("--kl-type", default="kl", choices=["kl", "abs", "mse", "low_var_kl"], help="k1 / |k1| / k2 / k3")
p.add_argument("--gamma", type=float, default=1.0, help="GAE discount over action tokens")
p.add_argument("--lam", type=float, default=1.0, help="GAE lambda")
p.add_argument("--bi-level-gae", action="store_true", help="turn-level discount across turns, token-level GAE inside turns")
p.add_argument("--high-level-gamma", type=float, default=0.95, help="turn-level discount for --bi-level-gae")
p.add_argument("--turn-rewards", action="store_true", help="put each turn's reward on its last token (use_turn_scores; no penalty, no normalisation)")
p.add_argument("--reward-norm", default=None, choices=["identity", "mean", "mean_std", "asym_clip"], help="score normalisation (default: identity for ppo, mean_std for grpo)")
p.add_argument("--reward-norm-grouping", default="state", choices=["state", "batch", "inductive"])
p.add_argument("--value-clip", type=float, default=0.5, help="critic value clipping")
p.add_argument("--old-logp", default="recompute", choices=["recompute", "sampler"], help="old log-probs from a forward before the update (RAGEN) or from the sampler")
# Optimisation
p.add_argument("--steps", type=int, default=200, help="training steps (rollout + update)")
p.add_argument("--lr", type=float, default=1e-6, help="actor AdamW learning rate")
p.add_argument("--critic-lr", type=float, default=1e-5, help="critic AdamW learning rate")
p.add_argument("--weight-decay", type=float, default=0.01)
p.add_argument("--grad-clip", type=float, default=1.0)
# Validation
p.add_argument("--val-every", type=int, default=10, help="validate every N steps, before training and at the end (0 = never)")
p.add_argument("--val-groups", type=int, default=256, help="validation episodes per val preset (fixed seeds)")
p.add_argument("--val-temperature", type=float, default=0.5)
p.add_argument("--val-seed", type=int, default=123)
# Run
p.add_argument("--seed", type=int, default=10000, help="first train env seed; step s uses seed + s*num_groups + g")
p.add_argument("--out", default=None, help="run directory (default runs/<preset>-<algo>-<time>)")
p.add_argument("--resume", default=None, help="continue the run in this directory from its checkpoint")
p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
p.add_argument("--log-trajectories-every", type=int, default=10, help="dump rollouts as JSONL every N steps (0 = never)")
p.add_argument("--wandb", action="store_true", help="also log to wandb (optional import)")
p.add_argument("--inject-nan", type=int, default=-1, help="testing only: make the loss NaN at this step")
args = p.parse_args()

if args.vanilla:  # RAGEN train_all.sh USE_BASE: no filter, symmetric clip, KL loss 0.001 (k1)
    args.filter_ratio, args.clip_high, args.kl_coef = 1.0, 0.2, 0.001
if args.reward_norm is None:  # real GRPO needs mean_std state normalisation (RAGEN_SPEC §4.3)
    args.reward_norm = "mean_std" if args.algo == "grpo" else "identity"
args.env = preset_name(args.env)
for key, default in (("max_turns", 5), ("max_actions_per_turn", 5), ("max_context", 3600)):  # RAGEN's per-env configs
    if getattr(args, key) is None:
        setattr(args, key, ENV_CLASSES[args.env][1].get(key, default))
if args.val_env is None:
    args.val_env = [args.env] + (["BanditTest"] if args.env == "Bandit" else [])
args.val_env = [preset_name(v) for v in args.val_env]
if args.bi_level_gae and (args.algo != "ppo" or args.turn_rewards):
    sys.exit("train.py: --bi-level-gae needs --algo ppo and no --turn-rewards (as RAGEN)")

# ----------------------------------------------------------------------------- compute init
ddp = int(os.environ.get("RANK", -1)) != -1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
if use_cuda:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
else:
    device = torch.device("cpu")
if ddp:
    dist.init_process_group("nccl" if use_cuda else "gloo")
master = rank == 0


def print0(*a):
    if master:
        print(*a, flush=True)


def die(msg):  # every rank sees the same args, so every rank stops with the same one-line error
    print0(f"train.py: {msg}")
    sys.exit(2)


# derived batch sizes, checked up front (RAGEN train.py asserts the same things)
rollout_groups = args.num_groups * args.online_k
kept_groups = rollout_groups if args.filter_ratio >= 1 else int(args.filter_ratio * rollout_groups)
kept_rows = kept_groups * args.group_size
if rollout_groups % world:
    die(f"--num-groups x --online-k = {rollout_groups} groups cannot be split over {world} ranks")
if kept_rows < args.mini_batch_size or kept_rows % args.mini_batch_size:
    die(f"the filter keeps {kept_groups} groups x {args.group_size} = {kept_rows} trajectories, which is not a "
        f"positive multiple of --mini-batch-size {args.mini_batch_size}; change --filter-ratio, --num-groups or --mini-batch-size")
if args.mini_batch_size % world:
    die(f"--mini-batch-size {args.mini_batch_size} must divide over {world} ranks")
if args.val_groups % world:
    die(f"--val-groups {args.val_groups} must divide over {world} ranks")
updates_per_step = args.ppo_epochs * kept_rows // args.mini_batch_size

# run directory, resume checks
ckpt = None
if args.resume:
    ckpt_path = os.path.join(args.resume, "ckpt.pt")
    if not os.path.exists(ckpt_path):
        die(f"--resume {args.resume}: no ckpt.pt there")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    changed = {k: (v, getattr(args, k)) for k, v in ckpt["args"].items()
               if k not in ("resume", "out", "steps", "save_every", "inject_nan", "wandb", "val_every", "device",
                            "log_trajectories_every", "micro_batch_size", "grad_checkpointing", "no_kv_reuse")
               and getattr(args, k, None) != v}
    if changed:
        die(f"--resume {args.resume}: flags differ from the run's args.json: " +
            ", ".join(f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in changed.items()))
    args.out = args.resume
if args.out is None:
    args.out = os.path.join("runs", f"{args.env}-{args.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
torch.manual_seed(args.seed)

print0(f"env {args.env} -> val {args.val_env} | {args.algo}{' (vanilla StarPO)' if args.vanilla else ''} | "
       f"world {world} on {device} | rollout {rollout_groups}x{args.group_size} = {rollout_groups * args.group_size} "
       f"trajectories, keep {kept_groups} groups = {kept_rows}, {updates_per_step} optimizer steps per step")

# ----------------------------------------------------------------------------- models
# Weights are fp32 (the optimizer's master copy); on GPU the forward runs in bf16 autocast, as RAGEN's
# FSDP mixed precision does. Rollouts run on a plain unsharded copy (the sampler calls submodules
# directly, which FSDP2's hooks would not see; CPU_NOTES §5), refreshed after every update.
try:
    actor, tok = load_model(args.model, device=device, dtype=torch.float32)
except (ValueError, FileNotFoundError, OSError) as e:
    die(f"cannot load --model {args.model}: {e}")
rollout_dtype = torch.bfloat16 if use_cuda else torch.float32
autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if use_cuda else nullcontext
ref = copy.deepcopy(actor).eval().requires_grad_(False) if args.kl_coef > 0 else None


class Critic(torch.nn.Module):
    """Value head on its own copy of the LM trunk (RAGEN: AutoModelForTokenClassification, num_labels=1)."""

    def __init__(self, lm):
        super().__init__()
        self.model = copy.deepcopy(lm.model)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1, device=lm.device)
        torch.nn.init.zeros_(self.head.weight), torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens, attention_mask):
        h = self.model(input_ids=tokens, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        v = self.head(h).squeeze(-1).float()                                              # [B, T]
        # values[:, t] = V(tokens[:, :t]): the state in which token t is chosen, aligned with logp[:, t]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)                   # [B, T]


critic = Critic(actor) if args.algo == "ppo" else None
if args.grad_checkpointing:
    actor.gradient_checkpointing_enable()
    if critic is not None:
        critic.model.gradient_checkpointing_enable()
rollout_model = actor
if ddp or rollout_dtype != torch.float32:
    rollout_model = copy.deepcopy(actor).to(rollout_dtype).eval().requires_grad_(False)
if ddp:  # FSDP2: shard every transformer block, then the root (pytorch/examples distributed/FSDP2)
    from torch.distributed.fsdp import fully_shard
    for m in [actor, critic, ref]:
        if m is not None:
            for block in m.model.layers:
                fully_shard(block)
            fully_shard(m)
opt = torch.optim.AdamW(actor.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
critic_opt = None if critic is None else torch.optim.AdamW(
    critic.parameters(), lr=args.critic_lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)


@torch.no_grad()
def sync_rollout_weights():
    """Copy the (possibly sharded) actor into the unsharded rollout model; every rank calls this."""
    if rollout_model is actor:
        return
    for p_, q in zip(actor.parameters(), rollout_model.parameters()):
        q.copy_(p_.full_tensor() if hasattr(p_, "full_tensor") else p_)


def full_state(model, optimizer=None):
    """Unsharded state dicts on CPU (collective under FSDP2; every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=o)
    return msd, (get_optimizer_state_dict(model, optimizer, options=o) if optimizer is not None else None)


def load_state(model, optimizer, msd, osd):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    o = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, msd, options=o)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=o)


start_step = 0
if ckpt is not None:
    load_state(actor, opt, ckpt["actor"], ckpt["actor_opt"])
    if critic is not None:
        load_state(critic, critic_opt, ckpt["critic"], ckpt["critic_opt"])
    torch.set_rng_state(ckpt["torch_rng"])
    start_step = ckpt["step"] + 1
    print0(f"resumed {args.out} at step {start_step}")
sync_rollout_weights()


# ----------------------------------------------------------------------------- helpers
def all_gather_rows(out):
    """Every rank gets the whole rollout (all groups, in group order). Rollouts are small next to
    the model, so one all_gather_object keeps this simple; each row is padded to the longest T."""
    outs = [out]
    if ddp:
        outs = [None] * world
        dist.all_gather_object(outs, out)
    T = max(o["tokens"].shape[1] for o in outs)
    merged = {}
    for k in outs[0]:
        vals = [o[k] for o in outs]
        if k == "stats":
            merged[k] = {s: torch.cat([v[s] for v in vals]) for s in vals[0]}
        elif torch.is_tensor(vals[0]) and vals[0].dim() == 2:
            merged[k] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1])) for v in vals])
        elif torch.is_tensor(vals[0]):
            merged[k] = torch.cat(vals)
        else:
            merged[k] = [x for v in vals for x in v]
    return merged


def all_reduce_mean(d):
    """Average a dict of floats over ranks (one collective)."""
    if not ddp or not d:
        return d
    keys = sorted(d)
    t = torch.tensor([float(d[k]) for k in keys], dtype=torch.float64, device=device if use_cuda else "cpu")
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist())}


def rows_of_this_rank(n):
    """Contiguous share of n rows for this rank (n divisible by world)."""
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def run_rollout(preset_key, n_groups, group_size, seed0, temperature, envs):
    """This rank's share of n_groups groups, gathered so that every rank holds all of them."""
    cls, preset = ENV_CLASSES[preset_key]
    share = rows_of_this_rank(n_groups)
    seeds = [seed0 + g for g in range(share.start, share.stop) for _ in range(group_size)]
    if preset_key not in envs:
        envs[preset_key] = [cls(**preset["kwargs"]) for _ in seeds]
    preset = dict(preset, max_actions_per_traj=args.max_actions_per_traj or preset["max_actions_per_traj"])
    out = rollout(rollout_model, tok, envs[preset_key], seeds, preset, group_size=group_size,
                  max_turns=args.max_turns, max_actions_per_turn=args.max_actions_per_turn,
                  max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=args.top_p,
                  think=not args.no_think, max_context=args.max_context, format_penalty=args.format_penalty,
                  kv_reuse=not args.no_kv_reuse, sample_seed=args.seed)
    out["group"] = out["group"] + share.start
    return all_gather_rows({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in out.items()})


def env_metrics(out, prefix, group_size):
    """RAGEN's train/<Tag>/* and val-env/<Tag>/* metrics, over all trajectories (before filtering)."""
    m = {f"{prefix}/success": out["success"].float().mean().item(),
         f"{prefix}/score": out["scores"].float().mean().item(),
         f"{prefix}/pass@{group_size}": out["success"].view(-1, group_size).any(dim=1).float().mean().item()}
    for k, v in out["stats"].items():
        m[f"{prefix}/{k}"] = v.float().mean().item()
    return m


def micro_batches(rows):
    """Split a list of row indices into micro-batches of --micro-batch-size."""
    return [rows[i:i + args.micro_batch_size] for i in range(0, len(rows), args.micro_batch_size)]


def trim(idx, *tensors):
    """Rows idx of [B, T] tensors, cut to the longest real row (right padding)."""
    T = int(batch["attention_mask"][idx].sum(1).max())
    return [t[idx, :T].to(device) for t in tensors]


@torch.no_grad()
def forward_pass(model, what):
    """logp (what='logp') or values (what='values') of this rank's share of kept rows, gathered."""
    share = list(range(kept_rows))[rows_of_this_rank(kept_rows)]
    res = torch.zeros(kept_rows, batch["tokens"].shape[1], device=device)  # on the device: NCCL reduces GPU tensors
    for mb in micro_batches(share):
        tokens, am = trim(mb, batch["tokens"], batch["attention_mask"])
        with autocast():
            if what == "values":
                x = model(tokens, am)
            else:
                x, _ = starpo.token_logprobs(model, tokens, am, temperature=args.temperature)
        res[mb, :x.shape[1]] = x.float()
    if ddp:
        dist.all_reduce(res)  # each row is filled on exactly one rank, zeros elsewhere
    return res.cpu()


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


# ----------------------------------------------------------------------------- run directory and logging
if master:
    os.makedirs(args.out, exist_ok=True)
    import transformers
    with open(os.path.join(args.out, "args.json"), "w") as f:
        json.dump(dict(vars(args), git_commit=git_commit(), world_size=world, torch=torch.__version__,
                       transformers=transformers.__version__, python=platform.python_version(),
                       cuda=torch.version.cuda), f, indent=1)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if ckpt is not None and os.path.exists(metrics_path):  # drop lines a killed run wrote after its checkpoint
        lines = [l for l in open(metrics_path) if json.loads(l)["step"] < start_step]
        open(metrics_path, "w").writelines(lines)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)
wandb_run = None
if args.wandb and master:
    try:
        import wandb
    except ImportError:
        die("--wandb needs `pip install wandb`")
    wandb_run = wandb.init(project="starpo", name=os.path.basename(args.out), config=vars(args))


def log(metrics):
    if not master:
        return
    with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if wandb_run is not None:
        wandb_run.log(metrics, step=metrics["step"])


def dump_trajectories(out, name, n=16):
    if not master:
        return
    with open(os.path.join(args.out, name), "w") as f:
        for i in range(min(n, len(out["text"]))):
            f.write(json.dumps(dict(group=int(out["group"][i]), score=float(out["scores"][i]),
                                    success=bool(out["success"][i]), turns=out["responses"][i],
                                    text=out["text"][i])) + "\n")


def validate(step, envs):
    """RAGEN's protocol: fixed seeds from --val-seed, groups of 1, temperature 0.5, every val preset."""
    m = {}
    for key in args.val_env:
        out = run_rollout(key, args.val_groups, 1, args.val_seed, args.val_temperature, envs)
        m.update(env_metrics(out, f"val-env/{key}", 1))
        if step % max(args.log_trajectories_every, 1) == 0:
            dump_trajectories(out, f"val-{key}-step{step:05d}.jsonl")
    return m


def save_checkpoint(step):
    """Atomic: write to a temporary file, then rename. Also exports a plain HF directory <out>/hf."""
    actor_sd, actor_osd = full_state(actor, opt)
    critic_sd, critic_osd = full_state(critic, critic_opt) if critic is not None else (None, None)
    if not master:
        return
    state = dict(step=step, args={k: v for k, v in vars(args).items()}, actor=actor_sd, actor_opt=actor_osd,
                 critic=critic_sd, critic_opt=critic_osd, torch_rng=torch.get_rng_state(), monitor=monitor)
    tmp = os.path.join(args.out, "ckpt.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(args.out, "ckpt.pt"))
    export = copy.deepcopy(rollout_model).float()  # a plain (unsharded) model to hold the full weights
    export.load_state_dict(actor_sd)
    hf_tmp, hf_dir = os.path.join(args.out, "hf.tmp"), os.path.join(args.out, "hf")
    export.save_pretrained(hf_tmp)
    tok.save_pretrained(hf_tmp)
    if os.path.exists(hf_dir):
        os.rename(hf_dir, hf_dir + ".old")
    os.replace(hf_tmp, hf_dir)
    if os.path.exists(hf_dir + ".old"):
        import shutil
        shutil.rmtree(hf_dir + ".old")


# collapse indicators (paper Fig. 6): in-group reward std and entropy falling far below their early
# level, or a grad-norm spike, are announced and recorded
monitor = ckpt["monitor"] if ckpt is not None else {"early_std": [], "early_entropy": [], "grad_norms": [], "skipped": 0}


def collapse_warnings(m):
    warn = []
    if len(monitor["early_std"]) < 5:
        monitor["early_std"].append(m["rollout/in_group_std"])
        monitor["early_entropy"].append(m.get("actor/entropy", 0.0))
    else:
        s0, e0 = sum(monitor["early_std"]) / 5, sum(monitor["early_entropy"]) / 5
        if s0 > 0 and m["rollout/in_group_std"] < 0.1 * s0:
            warn.append(f"in-group reward std {m['rollout/in_group_std']:.3g} fell below 10% of its early level {s0:.3g}")
        if e0 > 0 and m.get("actor/entropy", e0) < 0.1 * e0:
            warn.append(f"entropy {m['actor/entropy']:.3g} fell below 10% of its early level {e0:.3g}")
    g = monitor["grad_norms"]
    if len(g) >= 5 and m.get("actor/grad_norm", 0) > 10 * sorted(g)[len(g) // 2]:
        warn.append(f"actor grad norm {m['actor/grad_norm']:.3g} is over 10x its running median")
    if math.isfinite(m.get("actor/grad_norm", float("nan"))):
        g.append(m["actor/grad_norm"])
        del g[:-50]
    return warn


# ----------------------------------------------------------------------------- the StarPO loop
from tqdm import tqdm

train_envs, val_envs = {}, {}
bar = tqdm(range(start_step, args.steps), disable=not master, initial=start_step, total=args.steps, dynamic_ncols=True)
for step in bar:
    t_step = time.time()
    timing, m = {}, {"step": step}
    if args.val_every > 0 and step % args.val_every == 0:
        t0 = time.time()
        m.update(validate(step, val_envs))
        timing["val"] = time.time() - t0

    # 1. rollout: group g of this step resets from seed + step*groups + g (RAGEN seed.train counter)
    t0 = time.time()
    out = run_rollout(args.env, rollout_groups, args.group_size, args.seed + step * rollout_groups,
                      args.temperature, train_envs)
    timing["rollout"] = time.time() - t0
    m.update(env_metrics(out, f"train/{args.env}", args.group_size))
    if args.log_trajectories_every and step % args.log_trajectories_every == 0:
        dump_trajectories(out, f"train-step{step:05d}.jsonl")

    # 2. scores -> normalisation -> StarPO-S variance filter (whole groups; RAGEN _filter_rollout)
    t0 = time.time()
    scores = out["scores"].float()  # [N] sum of turn rewards + format penalty
    if not args.turn_rewards:
        scores = starpo.normalize_scores(scores, args.group_size, args.reward_norm_grouping, args.reward_norm)
    keep, fstats = starpo.filter_groups(scores, args.group_size, args.filter_ratio, args.filter_type)  # [N] bool
    m.update({f"rollout/{k}": v for k, v in fstats.items()})
    m["rollout/kept_fraction"] = keep.float().mean().item()
    idx = keep.nonzero().squeeze(1)                                       # [K] kept rows, group order
    batch = {k: out[k][idx] for k in ("tokens", "attention_mask", "loss_mask", "old_logp")}
    K, T = batch["tokens"].shape
    assert K == kept_rows
    mask = batch["loss_mask"].float()                                     # [K, T] tokens the policy sampled
    rewards = torch.zeros(K, T)                                           # [K, T] reward on action tokens
    for i, r in enumerate(idx.tolist()):
        if args.turn_rewards:  # use_turn_scores: each turn's reward on its last sampled token
            for pos, rew in zip(out["turn_ends"][r], out["turn_rewards"][r]):
                rewards[i, pos] += rew
        else:  # RAGEN default: the (normalised) trajectory score on the last trained token
            if mask[i].any():  # a row with no sampled token (context overflow at turn 1) has nothing to train
                rewards[i, int(mask[i].nonzero().max())] = scores[r]
    timing["filter"] = time.time() - t0

    # 3. old log-probs (recomputed by the actor, as RAGEN), reference log-probs, values
    t0 = time.time()
    sampler_logp = batch["old_logp"]
    if args.old_logp == "recompute":
        batch["old_logp"] = forward_pass(actor, "logp") * mask
        m["rollout/sampler_logp_abs_diff"] = ((sampler_logp - batch["old_logp"]).abs() * mask).sum().item() / max(mask.sum().item(), 1)
    timing["old_logp"] = time.time() - t0
    t0 = time.time()
    ref_logp = forward_pass(ref, "logp") * mask if ref is not None else None
    values = forward_pass(critic, "values") * mask if critic is not None else None
    timing["ref_values"] = time.time() - t0

    # 4. advantages: GAE over action tokens (PPO) or the group-normalised score on every token (GRPO)
    t0 = time.time()
    if args.algo == "ppo":
        if args.bi_level_gae:
            adv, returns = starpo.bi_level_gae(rewards, values, mask, args.gamma, args.lam, args.high_level_gamma)
        else:
            adv, returns = starpo.gae_advantages(rewards, values, mask, args.gamma, args.lam)
        adv = starpo.masked_whiten(adv, mask)  # veRL whitens GAE advantages over the batch's action tokens
        m["critic/explained_variance"] = float(starpo.explained_variance(values, returns, mask))
    else:  # RAGEN's GRPO: unique uids, so the advantage is the normalised score broadcast over the turn tokens
        adv = rewards.sum(1, keepdim=True) * mask if not args.turn_rewards else rewards.flip(1).cumsum(1).flip(1) * mask
        returns = None
    timing["adv"] = time.time() - t0

    # 5. PPO updates: ppo_epochs x mini-batches of --mini-batch-size rows, this rank's share of each
    t0 = time.time()
    acc = {}
    minibatches = [list(range(s, s + args.mini_batch_size)) for s in range(0, K, args.mini_batch_size)]
    for epoch in range(args.ppo_epochs):
        for mb_rows in minibatches:
            mine = mb_rows[rows_of_this_rank(len(mb_rows))]
            n_tok = mask[mb_rows].sum().item()  # global token / row counts of this mini-batch (known on every rank)
            counts = dict(token_count=n_tok, seq_count=len(mb_rows))
            nan_now = step == args.inject_nan
            # critic
            if critic is not None:
                critic_opt.zero_grad(set_to_none=True)
                for mb in micro_batches(mine):
                    tokens, am, mmask, mret, mold = trim(mb, batch["tokens"], batch["attention_mask"], mask, returns, values)
                    with autocast():
                        v = critic(tokens, am)
                    vf_loss, vm = starpo.value_loss(v.float(), mold, mret, mmask, args.value_clip, args.loss_agg, **counts)
                    (vf_loss * world).backward()  # FSDP averages gradients over ranks; the count is already global
                    acc.setdefault("critic/vf_loss", []).append(vf_loss.item())
                    for k, x in vm.items():
                        acc.setdefault(f"critic/{k}", []).append(float(x))
                gn = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
                gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
                acc.setdefault("critic/grad_norm", []).append(gn)
                if math.isfinite(gn):
                    critic_opt.step()
            # actor
            opt.zero_grad(set_to_none=True)
            for mb in micro_batches(mine):
                tokens, am, mmask, madv, mold = trim(mb, batch["tokens"], batch["attention_mask"], mask, adv, batch["old_logp"])
                with autocast():
                    logp, ent = starpo.token_logprobs(actor, tokens, am, temperature=args.temperature, with_entropy=True)
                logp, ent = logp.float(), ent.float()
                pg_loss, pm = starpo.policy_loss(logp, mold, madv, mmask, args.clip_low, args.clip_high,
                                                 args.dual_clip, args.loss_agg, **counts)
                ent_loss = starpo.aggregate(ent, mmask, args.loss_agg, **counts)
                loss = pg_loss - args.entropy_coef * ent_loss
                if ref_logp is not None:
                    mref = trim(mb, ref_logp)[0]
                    kl = starpo.kl_penalty(logp, mref, args.kl_type)
                    kl_loss = starpo.aggregate(kl, mmask, args.loss_agg, **counts)
                    loss = loss + args.kl_coef * kl_loss
                    acc.setdefault("actor/kl_loss", []).append(kl_loss.item())
                if nan_now:
                    loss = loss * float("nan")
                (loss * world).backward()
                acc.setdefault("actor/pg_loss", []).append(pg_loss.item())
                acc.setdefault("actor/entropy", []).append((ent * mmask).sum().item() / max(mmask.sum().item(), 1))
                for k, x in pm.items():
                    acc.setdefault(f"actor/{k}", []).append(float(x))
            gn = torch.nn.utils.clip_grad_norm_(actor.parameters(), args.grad_clip)
            gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
            acc.setdefault("actor/grad_norm", []).append(gn)
            if math.isfinite(gn):  # a non-finite loss gives a non-finite norm on every rank: skip together
                opt.step()
            else:
                opt.zero_grad(set_to_none=True)
                monitor["skipped"] += 1
                print0(f"step {step}: non-finite actor gradient, update skipped ({monitor['skipped']} so far)")
    m.update(all_reduce_mean({k: sum(v) / len(v) for k, v in acc.items()}))
    m["actor/skipped_updates"] = monitor["skipped"]
    m["actor/lr"] = args.lr
    timing["update"] = time.time() - t0
    t0 = time.time()
    sync_rollout_weights()
    timing["sync"] = time.time() - t0

    # 6. log, validate at the end, checkpoint
    timing["step"] = time.time() - t_step
    m.update({f"timing_s/{k}": v for k, v in timing.items()})
    m["perf/rollout_tokens_per_s"] = out["stats"]["response_tokens"].sum().item() / max(timing["rollout"], 1e-9)
    m["perf/update_tokens_per_s"] = batch["attention_mask"].sum().item() * args.ppo_epochs / max(timing["update"], 1e-9)
    if use_cuda:
        m["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    m["warnings"] = collapse_warnings(m)
    for w in m["warnings"]:
        print0(f"step {step}: WARNING {w}")
    log(m)
    bar.set_postfix_str(f"score {m[f'train/{args.env}/score']:.3f} succ {m[f'train/{args.env}/success']:.2f} "
                        f"std {m['rollout/in_group_std']:.3f} ent {m.get('actor/entropy', 0):.3f} "
                        f"gn {m.get('actor/grad_norm', 0):.2f} {timing['step']:.1f}s")
    if step == args.steps - 1 or (args.save_every > 0 and (step + 1) % args.save_every == 0):
        save_checkpoint(step)

if args.val_every > 0 and start_step < args.steps:  # RAGEN also validates after the last update
    t0 = time.time()
    m = {"step": args.steps, **validate(args.steps, val_envs), "timing_s/val": time.time() - t0}
    log(m)
    print0(" | ".join(f"{k} {v:.3f}" for k, v in m.items() if k.endswith("/success")))

if wandb_run is not None:
    wandb_run.finish()
if ddp:
    dist.destroy_process_group()
