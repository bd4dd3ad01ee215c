"""
StarPO / StarPO-S: multi-turn PPO or GRPO on whole agent trajectories (RAGEN, arXiv 2504.20073).

    python train.py --demo                                              # the offline CPU demo, see README
    python train.py --env sokoban --algo ppo                            # one GPU, the paper's StarPO-S
    torchrun --nproc_per_node=8 train.py --env sokoban --algo ppo      # eight GPUs, same maths

One loop, in the order it happens:
rollout -> filter groups -> old / ref log-probs and values -> advantages -> PPO updates -> log
-> validation -> checkpoint. Defaults are the paper's StarPO-S settings (RAGEN's configs).
"""
import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import agent
import checkpoint
import collapse
import fsdp
import memplan
import models
import ranks
import rollout as rollout_py
import sampler as sampler_py
import starpo

# --demo: GRPO from sft.py --demo's format warm-up on Cue with letters A-M, validated on held-out seeds of A-M and on
# N-Z, letters neither the warm-up nor RL ever answers. The warm-up plays at random, so success is the task's own. lr
# 3e-5 and 8 steps were chosen on training success: at lr 1e-5 it stays under 0.35 for 6 steps and first reaches 0.9
# at steps 9-11 (a seed or a CPU's bf16 rounding that starts late ends short of it at step 12); at 3e-5 every seed
# tried reaches 0.9 at step 4 or 5, and 8 steps (0-7) leave two more after that (results/studies/demo-cue-robust.md)
DEMO = ("--model runs/demo-sft --env CueAM --val-env CueAM CueNZ --no-think --algo grpo --num-groups 8 --group-size 8 "
        "--filter-ratio 0.5 --mini-batch-size 32 --micro-batch-size 16 --max-new-tokens 8 --lr 3e-5 "
        "--max-context 256 --steps 8 --val-every 8 --val-groups 128 --collapse-every 0 --log-trajectories-every 4")
# --algo, the advantage estimators (advantages() dispatches on the name). Those of CRITIC_ALGOS learn a value function:
# resolve_args sets args.critic, and the critic, its optimiser, value pass, update, checkpoint and memory follow it
ALGOS = ("ppo", "grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
CRITIC_ALGOS = ("ppo",)


# ----------------------------------------------------------------------------- flags
class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the docstring as written, each flag with its default (a None default: the help says it)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    # --help lists the groups in this order: the flags most runs set first, the rest by topic
    common = p.add_argument_group("common flags")
    groups = {t: p.add_argument_group(t) for t in ("environment and agent loop", "model", "batch sizes", "algorithm",
                                                   "optimisation", "validation", "run")}
    ragen2 = p.add_argument_group("RAGEN-2 and variants: context windows, filters, turn-level rewards, stops")
    debug = p.add_argument_group("debugging and testing: reference paths that sample the same tokens, slower")
    g = groups["environment and agent loop"]
    common.add_argument("--env", nargs="+", default=["sokoban"], help=f"short name ({', '.join(agent.SHORT_NAMES)}) "
                        "or any preset; several as PRESET:GROUPS to mix them (es_manager.train.env_configs), e.g. "
                        "SimpleSokoban:4 FrozenLake:4")
    g.add_argument("--val-env", nargs="*", default=None, help="presets to validate on (default: the train preset; "
                   "Bandit adds BanditTest, Bandit2 Bandit2Test)")
    agent.add_agent_flags(g)  # turns, actions, tokens, think, penalty, window, sampling: shared with eval.py and sft.py
    debug.add_argument("--measure-activations", action="store_true", help="log perf/actor_saved_activations_mb: the "
                       "bytes autograd holds for backward in an actor micro-batch (memplan.saved_bytes: a hook on "
                       "every saved tensor)")
    g = groups["model"]
    common.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct",
                        help="hub id, local dir, 'smollm2' (offline) or 'tiny' (tests)")
    common.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="compute dtype of forwards and rollouts (weights and AdamW stay fp32): auto = bf16 on CUDA "
                   "(FSDP2 bf16 params, fp32 reduce) and on a CPU with native bf16 (AVX512-BF16 or AMX; a bf16 rollout "
                   "copy, bf16 autocast), fp32 on other CPUs; fp32 is fp32 on a GPU too (no TF32)")
    g.add_argument("--sampler", default="auto", choices=["auto", "eager", "static", "compiled"],
                   help="rollout sampler: static = fixed-shape KV pool, compiled = static + torch.compile'd decode "
                   "step (CUDA graphs on GPU); auto = compiled on CUDA, eager on CPU. "
                   "All of them sample the same tokens")
    g.add_argument("--plan", type=int, nargs="?", const=0, default=None, metavar="RANKS",
                   help="print the expected peak memory per rank by part for these flags on RANKS ranks (default: this "
                   "launch's), then exit; reads the model's config only")
    g.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per rank the plan must fit in "
                   "(default: the CUDA device's; --plan off a GPU: 80, an H100); given, it is checked on any device")
    g.add_argument("--force", action="store_true", help="start even when the memory plan does not fit the device")
    g.add_argument("--grad-checkpointing", action="store_true", help="trade compute for memory in the updates")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank via peft on the actor and the critic trunk, "
                   "base weights frozen (0 = full fine-tuning; RAGEN base-lora.yaml: 64, with lr x10)")
    g.add_argument("--lora-alpha", type=float, default=64,
                   help="LoRA alpha; the update is scaled by alpha / rank (RAGEN: 64)")
    g.add_argument("--lora-target", default="all-linear", help="peft target_modules: all-linear "
                   "(every Linear but lm_head) or comma-separated names, e.g. q_proj,v_proj")
    g.add_argument("--save-adapter", action="store_true",
                   help="with --lora-rank, also write the adapter alone (peft format) to <out>/hf/adapter")
    add_algorithm_flags(common, groups["batch sizes"], groups["algorithm"], ragen2)
    add_run_flags(common, groups, ragen2)
    return p


def add_algorithm_flags(common, batch, g, ragen2):
    """The batch sizes, the filter, the advantage and the losses."""
    common.add_argument("--num-groups", type=int, default=8,
                        help="env groups per rollout (es_manager.train.env_groups)")
    common.add_argument("--group-size", type=int, default=16, help="rollouts per group, all from the same seed")
    common.add_argument("--filter-ratio", type=float, default=0.25, help="the filter's value: top_k keeps this "
                        "fraction of groups (StarPO-S; 1 = no filter), top_k_abs this many, top_p this mass, "
                        "min_p this fraction of the best")
    ragen2.add_argument("--filter-type", default="std", choices=["std", "std_rev"],
                        help="keep the groups with the largest (std) or smallest (std_rev) statistic "
                        "(RAGEN-2: largest / smallest)")
    ragen2.add_argument("--filter-strategy", default="top_k", choices=["top_k", "top_k_abs", "top_p", "min_p"],
                        help="RAGEN-2 filter strategy")
    ragen2.add_argument("--filter-metric", default="reward_std",
                        choices=["reward_std", "reward_mean", "entropy", "entropy_std", "length"],
                        help="per-group statistic the filter ranks: in-group std or mean of the scores, mean or std of "
                        "the trajectories' mean token entropy, mean response length")
    ragen2.add_argument("--filter-top-p-mode", default="linear", choices=["linear", "softmax"],
                        help="top_p: score-sum rule or softmax mass")
    ragen2.add_argument("--filter-drop-zero", action="store_true",
                        help="drop groups whose statistic is 0 before ranking (include_zero=False)")
    ragen2.add_argument("--filter-eps", type=float, default=0.01, help="linear top_p threshold = value * sum - eps")
    ragen2.add_argument("--filter-loss-scaling", default="none", choices=["none", "linear", "sqrt"],
                        help="advantages x kept group fraction (or its sqrt)")
    ragen2.add_argument("--batch-adjust", default="copy", choices=["copy", "delete"],
                        help="make a varying kept row count a multiple of the mini-batch size: "
                        "duplicate or drop random rows")
    ragen2.add_argument("--empty-stop-steps", type=int, default=5,
                        help="stop after this many steps in a row with nothing to train (0 = never)")
    common.add_argument("--mini-batch-size", type=int, default=32,
                        help="trajectories per optimizer step (ppo_mini_batch_size)")
    batch.add_argument("--micro-batch-size", type=int, default=4,
                       help="rows per forward/backward on a rank (memory only, same maths)")
    batch.add_argument("--ppo-epochs", type=int, default=1, help="passes over the kept rollout")
    common.add_argument("--algo", default="ppo", choices=ALGOS,
                        help="ppo = critic + GAE; the others have no critic: grpo = group-normalised scores, "
                        "drgrpo = minus the group mean, rloo = minus the mean of the others, "
                        "reinforce_pp(_baseline) = REINFORCE++ (veRL)")
    g.add_argument("--vanilla", action="store_true",
                   help="vanilla StarPO: no filter, clip 0.2/0.2, KL loss 0.001 (overrides those flags)")
    g.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below 1")
    g.add_argument("--clip-high", type=float, default=0.28, help="PPO clip above 1 (clip-higher, DAPO)")
    g.add_argument("--dual-clip", type=float, default=3.0, help="dual-clip bound for negative advantages (0 = off)")
    g.add_argument("--loss-agg", default=None, choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"],
                   help="default token-mean; seq-mean-token-sum for drgrpo")
    g.add_argument("--entropy-coef", type=float, default=0.001, help="entropy bonus")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL loss to the reference model (0 = no reference model)")
    g.add_argument("--kl-type", default="kl", choices=["kl", "abs", "mse", "low_var_kl"], help="k1 / |k1| / k2 / k3")
    g.add_argument("--gamma", type=float, default=1.0, help="GAE discount over action tokens")
    g.add_argument("--lam", type=float, default=1.0, help="GAE lambda")
    ragen2.add_argument("--bi-level-gae", action="store_true",
                        help="turn-level discount across turns, token-level GAE inside turns")
    ragen2.add_argument("--high-level-gamma", type=float, default=0.95, help="turn-level discount for --bi-level-gae")
    ragen2.add_argument("--turn-rewards", action="store_true",
                        help="put each turn's reward on its last token (use_turn_scores; no penalty, no normalisation)")
    g.add_argument("--reward-norm", default=None, choices=["identity", "mean", "mean_std", "asym_clip"],
                   help="score normalisation (default: identity for ppo, mean_std for grpo)")
    ragen2.add_argument("--reward-norm-grouping", default="state", choices=["state", "batch", "inductive"],
                        help="which scores are normalised together: a group (same initial state), the whole batch, or "
                        "one env tag (inductive)")
    g.add_argument("--value-clip", type=float, default=0.5, help="critic value clipping")
    g.add_argument("--old-logp", default="recompute", choices=["recompute", "sampler"],
                   help="old log-probs from a forward before the update (RAGEN) or from the sampler")


def add_run_flags(common, groups, ragen2):
    """Optimisation, validation, and the run: its length, directory, logging, resume."""
    g = groups["optimisation"]
    common.add_argument("--steps", type=int, default=200, help="training steps (rollout + update)")
    common.add_argument("--lr", type=float, default=1e-6, help="actor AdamW learning rate")
    g.add_argument("--critic-lr", type=float, default=1e-5, help="critic AdamW learning rate")
    g.add_argument("--critic-warmup", type=int, default=0, help="PPO: the first N steps update the critic alone "
                   "(veRL's trainer.critic_warmup = N + 1: it counts steps from 1 and updates the actor "
                   "from that step on)")
    g.add_argument("--lr-warmup-steps", type=int, default=0, help="the actor's lr rises linearly over its first N "
                   "updates (veRL's actor.optim.lr_warmup_steps, constant schedule): update u < N trains at lr * u / N")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (actor and critic)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this")
    g = groups["validation"]
    g.add_argument("--val-every", type=int, default=10,
                   help="validate every N steps, before training and at the end (0 = never)")
    g.add_argument("--val-groups", type=int, default=256, help="validation episodes per val preset (fixed seeds)")
    g.add_argument("--val-temperature", type=float, default=0.5,
                   help="validation sampling temperature (RAGEN val_kwargs)")
    g.add_argument("--val-seed", type=int, default=123, help="first validation seed (RAGEN seed.val)")
    ragen2.add_argument("--collapse-every", type=int, default=5,
                        help="RAGEN-2 collapse diagnostics (prompt-reasoning MI, retrieval) at step 0 and every N "
                        "steps (0 = never; off when a context window cuts episodes into rows)")
    g = groups["run"]
    g.add_argument("--demo", action="store_true",
                   help=f"the offline CPU demo (README): {DEMO}; flags given with it override these")
    g.add_argument("--seed", type=int, default=10000, help="first train env seed; step s uses seed + s*num_groups + g")
    common.add_argument("--out", default=None, help="run directory (default runs/<preset>-<algo>-<time>)")
    common.add_argument("--resume", default=None, help="continue the run in this directory from its checkpoint")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--keep-hf", action="store_true", help="every checkpoint also leaves its HF directory as "
                   "<out>/step<N> (N steps done), to judge any of them later (hf/ holds only the last)")
    g.add_argument("--log-trajectories-every", type=int, default=10,
                   help="dump rollouts as JSONL every N steps (0 = never)")
    g.add_argument("--wandb", default=None, metavar="PROJECT", help="also log each metrics.jsonl line, and the args as "
                   "config, to this wandb project (pip install -r requirements-wandb.txt); the run is named after "
                   "--out, its files go to <out>/wandb, a --resume continues it; offline unless WANDB_MODE says "
                   "otherwise: upload later with wandb sync <out>/wandb/offline-run-*")
    g.add_argument("--pg-timeout-min", type=float, default=60, help="torchrun: minutes a rank waits in a collective "
                   "(rank 0 writing a 7B checkpoint keeps the others waiting for minutes; NCCL's default is 10)")
    g.add_argument("--check-update-every", type=int, default=0, help="every N steps (0 = never), one more actor "
                   "forward after the update logs check/*: how the step moved the log-probs of its tokens with A > 0 "
                   "and A < 0 and of its successful and failed episodes (not counted in work/*)")
    ragen2.add_argument("--early-stop", action="store_true", help="RAGEN-2's stops: in-group reward std collapsed "
                        "(10 steps under 10%% of the first 10), or validation success under 1%% 5 times in a row")


def parse_args(argv, world=1):
    """The command line (after --demo's flags) with the defaults that depend on other flags filled in, checked: a
    ValueError says in one line why a combination cannot run. world: the ranks of this launch; --plan RANKS plans
    another. Returns (args, the ranks the checks were made for, what the filter keeps in words)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.demo:  # the preset first, the command line after it: for a flag given twice argparse keeps the last
        args = p.parse_args(DEMO.split() + argv)
    resolve_args(args)
    world = args.plan or world  # --plan: the checks below are the planned launch's, and nothing after the plan runs
    return args, world, check_batch_sizes(args, world)


def resolve_args(args):
    """Fill in the defaults that depend on other flags, in place, and refuse the combinations that cannot run."""
    if args.vanilla:  # RAGEN train_all.sh USE_BASE: no filter, symmetric clip, KL loss 0.001 (k1)
        args.filter_ratio, args.clip_high, args.kl_coef = 1.0, 0.2, 0.001
    if args.reward_norm is None:  # real GRPO needs mean_std state normalisation (RAGEN's grpo setting)
        args.reward_norm = "mean_std" if args.algo == "grpo" else "identity"
    if args.loss_agg is None:  # Dr.GRPO sums a sequence's tokens (RAGEN-2 run_main_table_diff_algo.sh)
        args.loss_agg = "seq-mean-token-sum" if args.algo == "drgrpo" else "token-mean"
    # env mixing: [[preset, groups], ...]; one preset alone gets --num-groups. The first preset sets the agent-loop
    # defaults below, shared by all (RAGEN: one agent_proxy for every tag)
    mix = [e.rsplit(":", 1) if ":" in e else [e, ""] for e in args.env]
    if any(not (n.isdigit() and int(n) > 0) for _, n in mix if n or len(mix) > 1):
        raise ValueError("to mix presets give each a positive group count, e.g. --env SimpleSokoban:4 FrozenLake:4")
    args.env_mix = [[agent.preset_name(e), int(n) if n else args.num_groups] for e, n in mix]
    if len({e for e, _ in args.env_mix}) < len(args.env_mix):
        raise ValueError("a preset appears twice in --env")
    args.env, args.num_groups = args.env_mix[0][0], sum(n for _, n in args.env_mix)
    # the turn / action / context budgets, resolved once (agent.agent_settings: the flag, else the first preset's, else
    # agent.AGENT_DEFAULTS) and kept in args: every preset of the run plays with them, args.json records them
    s = agent.agent_settings(args.env, vars(args), sample_seed=args.seed)
    args.max_turns, args.max_actions_per_turn, args.max_context = s.max_turns, s.max_actions_per_turn, s.max_context
    if args.val_env is None:
        mix = dict(args.env_mix)
        args.val_env = list(mix) + [test for train, test in (("Bandit", "BanditTest"), ("Bandit2", "Bandit2Test"))
                                    if train in mix]
    args.val_env = [agent.preset_name(v) for v in args.val_env]
    args.critic = args.algo in CRITIC_ALGOS  # a value function to learn: the critic model and its update
    if args.critic_warmup < 0 or (args.critic_warmup and not args.critic):
        raise ValueError(f"--critic-warmup needs a critic (--algo {' or '.join(CRITIC_ALGOS)}) and a step count >= 0")
    if args.lr_warmup_steps < 0:
        raise ValueError("--lr-warmup-steps must be >= 0")
    if args.bi_level_gae and (args.algo != "ppo" or args.turn_rewards):
        raise ValueError("--bi-level-gae needs --algo ppo and no --turn-rewards (as RAGEN)")
    if args.max_context_window == 0 or args.max_context_window < -1:
        raise ValueError("--max-context-window is -1 (all turns) or k >= 1")
    if windowed(args) and (args.turn_rewards or args.bi_level_gae):
        raise ValueError("--turn-rewards and --bi-level-gae need whole episodes: --context-window-mode full, "
                         "no --max-context-window")
    if args.context_window_mode == "full" and args.max_context_window > 0 and args.old_logp == "sampler":
        raise ValueError("with a window in full mode the row's earlier answers were sampled under a longer prompt; "
                         "use --old-logp recompute")
    if args.turn_rewards and args.algo in ("drgrpo", "rloo", "reinforce_pp_baseline"):
        raise ValueError(f"--algo {args.algo} scores whole episodes; "
                         "--turn-rewards works with ppo, grpo and reinforce_pp")
    if args.plan is not None and args.plan < 0:
        raise ValueError(f"--plan {args.plan}: the number of ranks to plan for is >= 1 (bare --plan: this launch's)")
    if args.lora_rank < 0:
        raise ValueError("--lora-rank must be >= 0")
    if args.ppo_epochs < 1:  # the first epoch's first mini-batch also gives its rows' old log-probs
        raise ValueError("--ppo-epochs must be >= 1")
    if args.lora_rank and "lm_head" in args.lora_target.split(","):  # starpo's log-probs multiply by lm_head's weight
        raise ValueError("--lora-target lm_head: the log-prob passes use lm_head's weight directly and would skip "
                         "its adapter; adapt the other Linear layers (all-linear leaves lm_head out too)")


def windowed(args):
    """Whether a context window cuts episodes into several rows (rows no longer hold whole episodes)."""
    return args.context_window_mode != "full" or args.max_context_window > 0


def check_batch_sizes(args, world):
    """The batch sizes derived from the flags, checked against world ranks up front (RAGEN train.py asserts the same
    things). Returns what the filter keeps, in words."""
    kept_groups = args.num_groups if args.filter_ratio >= 1 else int(args.filter_ratio * args.num_groups)
    if args.filter_strategy == "top_k_abs":
        kept_groups = min(int(args.filter_ratio), args.num_groups)
    kept_rows = kept_groups * args.group_size
    # top_k keeps a known number of groups of whole episodes; otherwise the kept row count varies from step to step
    # and is brought to a multiple of lcm(mini-batch, ranks) by --batch-adjust
    # (RAGEN-2: lcm(env_groups, mini-batch, GPUs))
    fixed_keep = args.filter_strategy in ("top_k", "top_k_abs") and not args.filter_drop_zero and not windowed(args)
    if args.num_groups % world:
        raise ValueError(f"--num-groups {args.num_groups} cannot be split over {world} ranks")
    if any(n % world for _, n in args.env_mix):
        raise ValueError(f"each mixed preset's groups must split over {world} ranks: {args.env_mix}")
    if fixed_keep and (kept_rows < args.mini_batch_size or kept_rows % args.mini_batch_size):
        raise ValueError(f"the filter keeps {kept_groups} groups x {args.group_size} = {kept_rows} trajectories, "
                         f"which is not a positive multiple of --mini-batch-size {args.mini_batch_size}; "
                         "change --filter-ratio, --num-groups or --mini-batch-size")
    if args.mini_batch_size % world:
        raise ValueError(f"--mini-batch-size {args.mini_batch_size} must divide over {world} ranks")
    if args.val_groups % world:
        raise ValueError(f"--val-groups {args.val_groups} must divide over {world} ranks")
    return (f"keep {kept_groups} groups = {kept_rows}, {args.ppo_epochs * kept_rows // args.mini_batch_size} optimizer "
            f"steps per step" if fixed_keep else
            f"keep a varying number of rows, {args.batch_adjust} "
            f"to a multiple of {math.lcm(args.mini_batch_size, world)}")


# ----------------------------------------------------------------------------- where it runs, what it trains
def print0(*a):
    """print on rank 0 only (torchrun sets RANK on every rank)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, flush=True)


@dataclass
class State:
    """What the step's parts work with besides the flags: where this rank computes, the models and their optimisers.
    rollout_model is the actor itself on one fp32 process, else an unsharded copy (bf16 in bf16 compute) refreshed
    after every update; critic and ref are None when --algo and --kl-coef need none."""
    device: torch.device
    actor: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer
    rollout_model: torch.nn.Module
    critic: torch.nn.Module = None
    critic_opt: torch.optim.Optimizer = None
    ref: torch.nn.Module = None
    sampler: sampler_py.Sampler = field(default_factory=sampler_py.Sampler)
    autocast: object = nullcontext  # () -> the forwards' autocast context
    share_prefix: bool = True  # the trunk passes compute a micro-batch's shared prompt prefix once
    ddp: bool = False  # under torchrun: FSDP2-sharded models, collectives
    rank: int = 0
    world: int = 1
    lora_config: object = None  # a peft LoraConfig factory under LoRA
    lora_base: dict = field(default_factory=dict)  # LoRA under torchrun: the frozen base weights, for the rollout copy
    wandb_run: object = None
    # this rank's tokens through a model this step, every trunk pass counted (count_work): forward, backward; and the
    # seconds its own rollouts took, before a gather waited for the other ranks
    work: dict = field(default_factory=lambda: dict(forward=0, backward=0, rollout_s=0.0))


def build_models(args, device, ddp, rank, world):
    """The State: the models (fsdp.build_models), their AdamW optimisers, the sampler and the autocast."""
    bf16 = args.compute_dtype == "bf16"  # the GPU's settings, on a CPU too: a bf16 rollout copy, bf16 autocast
    m = fsdp.build_models(args.model, device, ddp, rank, bf16, with_critic=args.critic, with_ref=args.kl_coef > 0,
                          lora=(args.lora_rank, args.lora_alpha, args.lora_target),
                          grad_checkpointing=args.grad_checkpointing)
    actor, critic = m["actor"], m["critic"]
    return State(
        device=device, actor=actor, tok=m["tok"], rollout_model=m["rollout_model"], critic=critic, ref=m["ref"],
        ddp=ddp, rank=rank, world=world, lora_config=m["lora_config"], lora_base=m["lora_base"],
        opt=torch.optim.AdamW(actor.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay),
        critic_opt=None if critic is None else torch.optim.AdamW(critic.parameters(), lr=args.critic_lr,
                                                                 betas=(0.9, 0.999), weight_decay=args.weight_decay),
        sampler=sampler_py.sampler_settings(device, args.sampler),  # auto: static + compiled exactly on CUDA
        autocast=(lambda: torch.autocast(device.type, torch.bfloat16)) if bf16 else nullcontext,
        # the trunk passes (old log-probs, values, updates) run the prefix the micro-batch's rows share once (a kept
        # group's first prompt): HF's KV cache, which gradient checkpointing turns off; one process only
        # (FSDP2 runs one forward)
        share_prefix=not (args.no_prefix_sharing or args.grad_checkpointing or ddp))


def check_context(args, tok):
    """Refuse (ValueError) a --max-context that holds no turn: for every preset of --env and --val-env, the first
    episode it plays (its first training group's seed, or --val-seed) needs its first prompt in tok's tokens, one
    answer's --max-new-tokens and the end-of-turn tokens (rollout.context_needed); in less, no turn is played."""
    starts = [args.seed + sum(n for _, n in args.env_mix[:i]) for i in range(len(args.env_mix))]  # step 0's groups
    firsts = ([(key, seed) for (key, _), seed in zip(args.env_mix, starts)]
              + [(key, args.val_seed) for key in args.val_env])
    for key, seed in firsts:
        s = agent.agent_settings(key, vars(args), sample_seed=args.seed)
        need = rollout_py.context_needed(tok, agent.ENV_CLASSES[key][0](**s.preset["kwargs"]), seed, s)
        if s.max_context < need:
            raise ValueError(f"--max-context {s.max_context} holds no turn of {key}: its first prompt (seed {seed}) "
                             f"and one answer of --max-new-tokens {s.max_new_tokens} need {need} tokens")


# ----------------------------------------------------------------------------- rollouts, passes, logging
def phase(bar, step, what):
    """Say on the progress bar what the step is doing (rank 0 only: other ranks' bars, and a closed one, are disabled).
    The step's parts get it as say = functools.partial(phase, bar, step)."""
    if not bar.disable:
        bar.set_description(f"step {step}: {what}")


def run_rollout(st, args, presets, group_size, seed0, temperature, envs, say, what="rollout"):
    """One output per (preset, n_groups) of `presets`, group g of them (counted across presets) from seed seed0 + g:
    this rank's share of each preset's groups, gathered so that every rank holds all of them. envs: {preset: env
    objects}, reused from call to call."""
    outs = []
    for preset_key, n_groups in presets:
        cls, preset, _ = agent.ENV_CLASSES[preset_key]
        share = ranks.rows_of_rank(n_groups, st.rank, st.world)
        seeds = [seed0 + g for g in range(share.start, share.stop) for _ in range(group_size)]
        seed0 += n_groups
        if len(envs.get(preset_key, [])) < len(seeds):  # env objects are reused; validation chunks may differ in size
            envs[preset_key] = [cls(**preset["kwargs"]) for _ in seeds]
        t0 = time.time()
        out = rollout_py.rollout(st.rollout_model, st.tok, envs[preset_key][:len(seeds)], seeds,
                                 agent.agent_settings(preset_key, vars(args), sample_seed=args.seed),
                                 group_size=group_size, temperature=temperature, sampler=st.sampler,
                                 progress=lambda t, n: say(f"{what} {preset_key} turn {t}/{n}"))
        st.work["rollout_s"] += time.time() - t0
        outs.append(ranks.all_gather_rows({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in out.items()},
                                          st.ddp, st.world))
    return outs


def env_metrics(out, prefix, group_size):
    """RAGEN's train/<Tag>/* and val-env/<Tag>/* metrics, over all trajectories (before filtering)."""
    m = {f"{prefix}/success": out["success"].float().mean().item(),
         f"{prefix}/score": out["scores"].float().mean().item(),
         f"{prefix}/pass@{group_size}": out["success"].view(-1, group_size).any(dim=1).float().mean().item()}
    for k, v in out["stats"].items():
        m[f"{prefix}/{k}"] = v.float().mean().item()
    return m


def partition(st, args, n):
    """[(rows of a mini-batch, this rank's micro-batches of them)] of n rows: the update's, and the no-grad passes'."""
    return ranks.update_partition(n, args.mini_batch_size, args.micro_batch_size, st.rank, st.world)


def trim(attention_mask, idx, *tensors, device):
    """Rows idx of [B, T] tensors, cut to the longest real row of attention_mask [B, T] (right padding), on device."""
    T = int(attention_mask[idx].sum(1).max())
    return [t[idx, :T].to(device) for t in tensors]


def count_work(st, attention_mask, backward=False):
    """Add a pass over rows with attention_mask [b, T] to st.work: every real token once, as if no prefix were shared
    (the work measure the supervised controls are matched on, the same in train.py and sft.py)."""
    n = int(attention_mask.sum())
    st.work["forward"] += n
    st.work["backward"] += n if backward else 0


@torch.no_grad()
def forward_pass(st, args, model, batch, what, skip_first=False, count=True):
    """logp, entropy or values (what) of this rank's share of the rows of batch (tokens, attention_mask, loss_mask,
    a multiple of world rows), gathered; logp and entropy only at batch["loss_mask"] (0 elsewhere).
    skip_first: leave the update's first mini-batch out (zeros there). count: add the pass to st.work."""
    n = batch["tokens"].shape[0]
    res = torch.zeros(n, batch["tokens"].shape[1], device=st.device)  # on the device: NCCL reduces GPU tensors
    for mb in [mb for _, mine in partition(st, args, n)[1 if skip_first else 0:] for mb in mine]:
        tokens, am, lm = trim(batch["attention_mask"], mb, batch["tokens"], batch["attention_mask"], batch["loss_mask"],
                              device=st.device)
        if count:
            count_work(st, am)
        with st.autocast():
            if what == "values":
                x = model(tokens, am, st.share_prefix)
            else:  # only the sampled tokens' positions (lm) go through lm_head
                x = starpo.token_logprobs(model, tokens, am, temperature=args.temperature,
                                          with_entropy=what == "entropy", mask=lm, share_prefix=st.share_prefix)
                x = x[1] if what == "entropy" else x[0]
        res[mb, :x.shape[1]] = x.float()
    # FSDP2 keeps the root (embeddings, lm_head) gathered after a forward, for the backward no-grad never runs
    if st.ddp:
        model.reshard()
    if st.ddp and n:
        dist.all_reduce(res)  # each row is filled on exactly one rank, zeros elsewhere
    return res.cpu()


def log(st, args, metrics):
    """One line of metrics.jsonl (and wandb), rank 0."""
    if st.rank != 0:
        return
    with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if st.wandb_run is not None:
        st.wandb_run.log(metrics, step=metrics["step"])


def log_observations(st, args, outs, step):
    """Rank 0: one line of <out>/observations.jsonl per preset of the step: every observation its training episodes
    showed, at any turn (sorted, each once). eval.py --unseen reads it to judge only on boards no training episode
    showed; a resume drops the lines after its checkpoint, so the file stays complete."""
    if st.rank != 0:
        return
    with open(os.path.join(args.out, "observations.jsonl"), "a") as f:
        for (key, _), o in zip(args.env_mix, outs):
            f.write(json.dumps(dict(step=step, preset=key,
                                    observations=sorted({s for e in o["states"] for s in e}))) + "\n")


def dump_trajectories(st, args, out, name, n=16):
    if st.rank != 0:
        return
    with open(os.path.join(args.out, name), "w") as f:
        for i in range(min(n, len(out["text"]))):
            f.write(json.dumps(dict(group=int(out["group"][i]), score=float(out["scores"][i]),
                                    success=bool(out["success"][i]), turns=out["responses"][i],
                                    text=out["text"][i])) + "\n")


def validate(st, args, step, envs, say):
    """RAGEN's protocol: fixed seeds from --val-seed, groups of 1, temperature 0.5, every val preset."""
    m = {}
    for key in args.val_env:
        # in chunks of the largest training rollout call's size (one preset's groups: run_rollout calls the sampler
        # once per preset), so the sampler's one static KV pool (sized by training) serves validation too and no
        # training call decodes idle rows; the noise is keyed by episode seed, so chunking changes no sampled token
        chunk = max(n for _, n in args.env_mix) * args.group_size
        out = ranks.merge_rows([run_rollout(st, args, [(key, min(chunk, args.val_groups - g0))], 1, args.val_seed + g0,
                                            args.val_temperature, envs, say, "validation")[0]
                                for g0 in range(0, args.val_groups, chunk)])
        m.update(env_metrics(out, f"val-env/{key}", 1))
        if args.log_trajectories_every and step % args.log_trajectories_every == 0:
            dump_trajectories(st, args, out, f"val-{key}-step{step:05d}.jsonl")
    return m


# ----------------------------------------------------------------------------- the parts of one step
def normalised_scores(args, out, outs):
    """[N] each episode's score (sum of turn rewards + format penalty), normalised by --reward-norm unless rewards
    go on turns; outs are the rollout's per-preset outputs (their env tags for --reward-norm-grouping inductive)."""
    scores = out["scores"].float()
    if not args.turn_rewards:
        tags = [e for (e, _), o in zip(args.env_mix, outs) for _ in range(len(o["scores"]))]
        scores = starpo.normalize_scores(scores, args.group_size, args.reward_norm_grouping, args.reward_norm, tags)
    return scores


def filter_rows(st, args, out, scores, step):
    """Whole groups filtered (StarPO-S _filter_rollout, RAGEN-2 rollout_filter.py) by --filter-metric, then the rows
    of the kept episodes copied or dropped to a multiple of lcm(mini-batch, ranks) (RAGEN-2 adjust_batch).
    Returns ([K] kept rows of out, the kept group fraction, metrics)."""
    ep = out["episode"]  # [R] episode of each row (R = N, except one row per turn under --context-window-mode)
    ranked = scores      # [N] what the filter ranks
    if args.filter_metric in ("length", "entropy", "entropy_std"):  # per episode: summed response tokens, or the mean
        if args.filter_metric == "length":                          # over its rows of a row's mean token entropy
            per_row = out["loss_mask"].sum(1).float()  # [R]
        else:  # the actor's entropy (RAGEN-2 EntropyRolloutFilter); rows padded to a multiple of world for FSDP
            padded = {k: out[k][torch.arange(len(ep) + (-len(ep)) % st.world).clamp(max=max(len(ep) - 1, 0))]
                      for k in ("tokens", "attention_mask", "loss_mask")}
            per_row = (forward_pass(st, args, st.actor, padded, "entropy")[:len(ep)].sum(1)
                       / out["loss_mask"].sum(1).clamp(min=1))
        ranked = torch.zeros(len(scores)).index_add_(0, ep, per_row)
        if args.filter_metric != "length":
            ranked = ranked / torch.bincount(ep, minlength=len(scores)).clamp(min=1)
    kind = ("mean" if args.filter_metric in ("reward_mean", "entropy", "length") else "std") + \
        ("_rev" if args.filter_type == "std_rev" else "")  # starpo.filter_groups' ranking statistic
    keep, fstats = starpo.filter_groups(ranked, args.group_size, args.filter_ratio, kind, args.filter_strategy,
                                        not args.filter_drop_zero, args.filter_top_p_mode, args.filter_eps)  # [N] bool
    m = {}
    if ranked is not scores:  # the ranked metric under its own name; rollout/in_group_* stay the reward's
        m.update({f"rollout/{args.filter_metric}/{k}": v for k, v in fstats.items()})
        fstats = {k: v for k, v in starpo.filter_groups(scores, args.group_size, 1.0)[1].items()
                  if not k.startswith("chosen")}
    m.update({f"rollout/{k}": v for k, v in fstats.items()})
    m["rollout/kept_fraction"] = kept_ratio = keep.float().mean().item()  # RAGEN-2 filter_kept_ratio
    idx = keep[ep].nonzero().squeeze(1)                                   # [K0] rows of the kept episodes, in order
    m["rollout/empty_after_filter"], m["train/real_batch_size"] = float(len(idx) == 0), len(idx)
    g = torch.Generator().manual_seed(args.seed * 100003 + step)          # the same draw on every rank, and on resume
    idx = idx[starpo.adjust_rows(len(idx), math.lcm(args.mini_batch_size, st.world),
                                 args.batch_adjust, g)]  # [K] a no-op for a fixed top_k count
    m["train/empty_after_adjust"], m["train/batch_size"] = (float(len(idx) == 0 and m["train/real_batch_size"] > 0),
                                                            len(idx))
    return idx, kept_ratio, m


def place_rewards(args, out, idx, mask, scores):
    """[K, T] rewards on the kept rows idx of out, at action tokens (mask [K, T]): each turn's reward on its last
    sampled token with --turn-rewards (rows = episodes), else the normalised episode score on the row's last one."""
    rewards = torch.zeros(mask.shape)
    for i, (r, e) in enumerate(zip(idx.tolist(), out["episode"][idx].tolist())):
        if args.turn_rewards:  # use_turn_scores
            for pos, rew in zip(out["turn_ends"][r], out["turn_rewards"][e]):
                rewards[i, pos] += rew
        elif mask[i].any():  # a row with no sampled token (context overflow at turn 1) has nothing to train
            rewards[i, int(mask[i].nonzero().max())] = scores[e]
    return rewards


def old_logprobs(st, args, batch, say):
    """[K, T] the kept rows' old log-probs: the sampler's, or recomputed by the actor (RAGEN). Recomputed, the first
    mini-batch's rows are left at 0 here: the update's first forward runs on these same weights, on the same
    micro-batches (update_partition), so it computes them itself, to the last bit, and fills them in (actor_update)."""
    if args.old_logp == "sampler":
        return batch["old_logp"]
    say("old log-probs")
    return forward_pass(st, args, st.actor, batch, "logp", skip_first=True)  # 0 off the loss mask, as the sampler's


def reference_and_values(st, args, batch, say):
    """[K, T] reference log-probs (None without a KL loss) and critic values (None without a critic)."""
    if st.ref is not None or st.critic is not None or args.kl_coef > 0:
        say("reference log-probs and values")
    ref_logp = forward_pass(st, args, st.ref, batch, "logp") if st.ref is not None else None
    if args.kl_coef > 0 and args.lora_rank:  # LoRA: the reference is the base model = the actor with its adapter off
        st.actor.disable_adapters()          # (peft's disable_adapter, without a second copy of the weights)
        ref_logp = forward_pass(st, args, st.actor, batch, "logp")
        st.actor.enable_adapters()
    values = forward_pass(st, args, st.critic, batch, "values") * batch["mask"] if st.critic is not None else None
    return ref_logp, values


def advantages(args, batch, values, scores, groups, kept_ratio):
    """GAE over action tokens (PPO), REINFORCE++ returns, or one advantage per episode from its group (scores and
    groups [N] of the whole rollout). Returns advantages [K, T], returns [K, T] (PPO, else None), metrics."""
    mask, rewards, m, returns = batch["mask"], batch["rewards"], {}, None
    if args.algo == "ppo":
        if args.bi_level_gae:
            adv, returns = starpo.bi_level_gae(rewards, values, mask, args.gamma, args.lam, args.high_level_gamma)
        else:
            adv, returns = starpo.gae_advantages(rewards, values, mask, args.gamma, args.lam)
        adv = starpo.masked_whiten(adv, mask)  # veRL whitens GAE advantages over the batch's action tokens
        m["critic/explained_variance"] = float(starpo.explained_variance(values, returns, mask))
    elif args.algo == "reinforce_pp":
        adv, _ = starpo.reinforce_pp_advantages(rewards, mask, args.gamma)
    elif args.turn_rewards:  # grpo with use_turn_scores: veRL's GRPO sums the token rewards and broadcasts the sum to
        adv = rewards.sum(1, keepdim=True) * mask  # every token (RAGEN's uids are unique: groups of one, mean 0, std 1)
    else:  # grpo, drgrpo, rloo, reinforce_pp_baseline on the kept episodes, each counted once however many rows it
        # has (RAGEN-2 dedups (uid, episode) for GRPO). With grpo's default --reward-norm mean_std the scores are
        # already group-normalised and this is the identity up to eps; RAGEN-2 runs it on --reward-norm identity
        # [E] kept episodes, [K] each row's place in them
        eps_kept, row_of = batch["episode"].unique(return_inverse=True)
        adv = starpo.group_advantages(scores[eps_kept], groups[eps_kept], args.algo)[row_of][:, None] * mask
        if args.algo == "reinforce_pp_baseline":  # veRL then whitens over the batch's tokens
            adv = starpo.masked_whiten(adv, mask)
    if args.filter_loss_scaling != "none":  # RAGEN-2 filter_loss_scaling: damp the update by the kept group fraction
        adv = adv * (kept_ratio if args.filter_loss_scaling == "linear" else math.sqrt(kept_ratio))
    if not windowed(args):  # a row is one whole episode, so its k-th run of action tokens is turn k
        m.update({f"adv/{k}": v for k, v in starpo.turn_advantages(adv, mask).items()})
    return adv, returns, m



def critic_update(st, args, mine, batch, returns, values, counts):
    """One critic optimizer step over this rank's micro-batches `mine` of a mini-batch. Returns (summed loss terms,
    metrics per micro-batch): every micro-batch's loss is already divided by the mini-batch's global counts."""
    part, acc = {}, {}
    st.critic_opt.zero_grad(set_to_none=True)
    for mb in mine:  # FSDP2 reduce-scatters each backward's gradients into this rank's shard (see actor_update)
        tokens, am, mmask, mret, mold = trim(batch["attention_mask"], mb, batch["tokens"], batch["attention_mask"],
                                             batch["mask"], returns, values, device=st.device)
        count_work(st, am, backward=True)
        with st.autocast():
            v = st.critic(tokens, am, st.share_prefix)
        vf_loss, vm = starpo.value_loss(v.float(), mold, mret, mmask, args.value_clip, args.loss_agg, **counts)
        (vf_loss * st.world).backward()  # FSDP averages gradients over ranks; the count is already global
        part["critic/vf_loss"] = part.get("critic/vf_loss", 0.0) + vf_loss.item()
        for k, x in vm.items():
            acc.setdefault(f"critic/{k}", []).append(float(x))
    acc["critic/grad_norm"] = [starpo.clip_and_step(st.critic, st.critic_opt, args.grad_clip)]
    return part, acc


def actor_update(st, args, mine, batch, adv, old_logp, ref_logp, counts, fill_old=False):
    """One actor optimizer step over this rank's micro-batches `mine` (lists of row indices) of a mini-batch: clipped
    policy loss, entropy bonus, KL loss to ref_logp if given. batch: tokens, attention_mask, mask [K, T]; adv, old_logp,
    ref_logp [K, T]; counts: the mini-batch's token_count and seq_count over all ranks. Returns (summed loss terms,
    metrics per micro-batch) as critic_update. fill_old: these rows' old log-probs are this forward's (written into
    old_logp, for the later epochs)."""
    part, acc = {}, {}
    st.opt.zero_grad(set_to_none=True)
    # FSDP2 reduce-scatters each micro-batch's gradients as its backward runs and adds them to this rank's 1/W shard
    # (torchtitan and veRL do the same): a rank never holds more than a few blocks' unsharded gradients. Syncing only
    # in the last micro-batch would save the collectives in between but keep every parameter's unsharded gradient in
    # fp32 until then, 4 bytes a parameter on each rank (28 GiB at 7B)
    for mb in mine:
        tokens, am, mmask, madv, mold = trim(batch["attention_mask"], mb, batch["tokens"], batch["attention_mask"],
                                             batch["mask"], adv, old_logp, device=st.device)
        count_work(st, am, backward=True)
        with st.autocast(), (memplan.saved_bytes(st.actor) if args.measure_activations else nullcontext()) as held:
            logp, ent = starpo.token_logprobs(st.actor, tokens, am, temperature=args.temperature, with_entropy=True,
                                             mask=mmask, share_prefix=st.share_prefix)
        if held:
            acc.setdefault("perf/actor_saved_activations_mb", []).append(held[0] / 2**20)
        logp, ent = logp.float(), ent.float()
        if fill_old:
            mold = logp.detach()
            old_logp[mb, :mold.shape[1]] = mold.cpu()
        pg_loss, pm = starpo.policy_loss(logp, mold, madv, mmask, args.clip_low, args.clip_high,
                                         args.dual_clip, args.loss_agg, **counts)
        loss = pg_loss - args.entropy_coef * starpo.aggregate(ent, mmask, args.loss_agg, **counts)
        if ref_logp is not None:
            kl = starpo.kl_penalty(logp, trim(batch["attention_mask"], mb, ref_logp, device=st.device)[0], args.kl_type)
            kl_loss = starpo.aggregate(kl, mmask, args.loss_agg, **counts)
            loss = loss + args.kl_coef * kl_loss
            part["actor/kl_loss"] = part.get("actor/kl_loss", 0.0) + kl_loss.item()
        (loss * st.world).backward()
        part["actor/pg_loss"] = part.get("actor/pg_loss", 0.0) + pg_loss.item()
        part["actor/entropy"] = (part.get("actor/entropy", 0.0)
                                 + (ent * mmask).sum().item() / max(counts["token_count"], 1))
        for k, x in pm.items():
            acc.setdefault(f"actor/{k}", []).append(float(x))
    acc["actor/grad_norm"] = [starpo.clip_and_step(st.actor, st.opt, args.grad_clip)]
    return part, acc


def actor_lr(args, step):
    """The actor's lr at `step`: veRL's constant schedule with --lr-warmup-steps N of linear warm-up, counted in actor
    updates (there are none in the --critic-warmup steps). Update u < N trains at lr * u / N, so the first runs at lr 0
    and only fills AdamW's moments: AdamW's first step otherwise moves every weight by lr * sign(its gradient) (its
    bias-corrected moments are g and g^2), whatever the gradient's size."""
    u = max(step - args.critic_warmup, 0)  # this update's index among the actor's (0 in the critic's warm-up)
    return args.lr * min(1.0, u / args.lr_warmup_steps) if args.lr_warmup_steps > 0 else args.lr


def update(st, args, batch, adv, old_logp, returns, values, ref_logp, monitor, step, say):
    """--ppo-epochs passes of mini-batches of --mini-batch-size kept rows, this rank's share of each: a critic
    step (with a critic), then an actor step (none in the first --critic-warmup steps). A non-finite actor gradient
    skips its step (counted in monitor). Returns the metrics averaged over mini-batches and ranks."""
    acc, actor_on, lr = {}, step >= args.critic_warmup, actor_lr(args, step)
    for group in st.opt.param_groups:  # every step sets it, so a resume needs no scheduler state
        group["lr"] = lr
    st.actor.train()  # HF runs gradient checkpointing only in train mode (Qwen2.5 / Llama have no dropout)
    if st.critic is not None:
        st.critic.train()
    # [(rows, this rank's micro-batches of them)], as forward_pass
    minibatches = partition(st, args, len(batch["tokens"]))
    for epoch in range(args.ppo_epochs):
        for i, (mb_rows, mine) in enumerate(minibatches):
            say(f"update mini-batch {epoch * len(minibatches) + i + 1}/{args.ppo_epochs * len(minibatches)}")
            mask = batch["mask"][mb_rows]  # global token / row counts of this mini-batch (known on every rank)
            counts = dict(token_count=mask.sum().item(), seq_count=int(mask.any(-1).sum()))  # rows with a loss token
            part, got = (critic_update(st, args, mine, batch, returns, values, counts) if st.critic is not None
                         else ({}, {}))
            actor_part, actor_got = {}, {}
            if actor_on:
                fill_old = epoch == 0 and i == 0 and args.old_logp == "recompute"  # see old_logprobs
                actor_part, actor_got = actor_update(st, args, mine, batch, adv, old_logp, ref_logp, counts, fill_old)
                if fill_old and st.ddp:  # each row was filled on one rank, zeros elsewhere: every rank gets them all
                    filled = old_logp[mb_rows].to(st.device)
                    dist.all_reduce(filled)
                    old_logp[mb_rows] = filled.cpu()
                if not math.isfinite(actor_got["actor/grad_norm"][0]):
                    monitor["skipped"] += 1
                    print0(f"step {step}: non-finite actor gradient, update skipped ({monitor['skipped']} so far)")
            for k, x in list(got.items()) + list(actor_got.items()):
                acc.setdefault(k, []).extend(x)
            # x * world: all_reduce_mean below then sums the ranks' partials
            for k, x in {**part, **actor_part}.items():
                acc.setdefault(k, []).append(x * st.world)
    st.actor.eval()
    if st.critic is not None:
        st.critic.eval()
    m = ranks.all_reduce_mean({k: (max(v) if k.startswith("perf/") else sum(v) / len(v)) for k, v in acc.items()},
                              st.ddp, st.world, st.device)
    return dict(m, **{"actor/skipped_updates": monitor["skipped"], "actor/lr": lr if actor_on else 0.0})


def check_update(st, args, batch, old_logp, adv, success, say):
    """check/*: starpo.update_direction of the step's kept rows, from the actor's log-probs after the update against
    old_logp [K, T] (the policy the step started from); success [K]. A diagnostic, so its forward is not work."""
    say("update check")
    new_logp = forward_pass(st, args, st.actor, batch, "logp", count=False)    # [K, T]
    moved = starpo.update_direction(new_logp, old_logp, adv, batch["mask"], success)
    return {f"check/{k}": v for k, v in moved.items()}


def work_metrics(st, out, monitor):
    """The step's work in tokens through a model, over all ranks: the rollout's (the tokens the sampler prefilled
    and sampled), and every trunk pass's (count_work: old and reference log-probs, values, the updates' forwards and
    backwards); with the run's totals (carried in monitor, so a resume continues them). compute_tokens counts a
    backward twice, about the FLOPs over 2 x the parameters: the measure a supervised control is matched on."""
    w = torch.tensor([st.work["forward"], st.work["backward"]], dtype=torch.float64, device=st.device)
    if st.ddp:
        dist.all_reduce(w)
    st.work.update(forward=0, backward=0)
    fwd = w[0].item() + (out["stats"]["prefill_tokens"].sum() + out["stats"]["response_tokens"].sum()).item()
    bwd = w[1].item()
    for k, v in (("forward_tokens", fwd), ("backward_tokens", bwd), ("compute_tokens", fwd + 2 * bwd)):
        monitor[k] = monitor.get(k, 0.0) + v  # (a checkpoint written before these counts: from 0)
    return {"work/forward_tokens": fwd, "work/backward_tokens": bwd,
            "work/forward_tokens_total": monitor["forward_tokens"],
            "work/backward_tokens_total": monitor["backward_tokens"],
            "work/compute_tokens_total": monitor["compute_tokens"]}


def step_summary(st, args, m, timing, out, batch):
    """Timings, throughput and memory of a step for its metrics, and the progress bar's line."""
    perf = {f"timing_s/{k}": v for k, v in timing.items()}
    perf["perf/rollout_tokens_per_s"] = out["stats"]["response_tokens"].sum().item() / max(timing["rollout"], 1e-9)
    perf["perf/update_tokens_per_s"] = (batch["attention_mask"].sum().item() * args.ppo_epochs
                                        / max(timing["update"], 1e-9))
    if st.device.type == "cuda":
        perf["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(st.device) / 2**30
    line = (f"score {m[f'train/{args.env}/score']:.3f} succ {m[f'train/{args.env}/success']:.2f} "
            f"std {m['rollout/in_group_std']:.3f} ent {m.get('actor/entropy', 0):.3f} "
            f"gn {m.get('actor/grad_norm', 0):.2f} {timing['step']:.1f}s")
    return perf, line


# ----------------------------------------------------------------------------- the StarPO loop
@contextmanager
def timed(timing, name):
    """timing[name] = the block's wall time in seconds."""
    t0 = time.time()
    yield
    timing[name] = time.time() - t0


def train_loop(st, args, start_step, monitor):
    """Steps start_step .. --steps - 1, then the final validation. monitor: the collapse indicators and stop counters
    (checkpointed with the run). Returns the early stop (metric name, message), or None."""
    from tqdm import tqdm
    train_envs, val_envs = {}, {}
    bar = tqdm(range(start_step, args.steps), disable=st.rank != 0, initial=start_step, total=args.steps,
               dynamic_ncols=True)
    stop = None
    for step in bar:
        say = functools.partial(phase, bar, step)
        t_step = time.time()
        timing, m = {}, {"step": step}
        if args.val_every > 0 and step % args.val_every == 0:
            with timed(timing, "val"):
                m.update(validate(st, args, step, val_envs, say))

        # 1. rollout: group g of this step resets from seed + step*groups + g (RAGEN seed.train counter); mixed presets
        #    take their groups in --env order, each logged under its own name
        with timed(timing, "rollout"):
            st.work["rollout_s"] = 0.0
            outs = run_rollout(st, args, args.env_mix, args.group_size, args.seed + step * args.num_groups,
                               args.temperature, train_envs, say)
            # each rank's own rollout seconds (before the gathers waited for the slowest): the step waits for the max
            timing["rollout_rank_max"], timing["rollout_rank_mean"] = ranks.max_and_mean(
                st.work["rollout_s"], st.ddp, st.world, st.device)
        for (e, _), o in zip(args.env_mix, outs):
            m.update(env_metrics(o, f"train/{e}", args.group_size))
        log_observations(st, args, outs, step)
        out = ranks.merge_rows(outs)
        if args.log_trajectories_every and step % args.log_trajectories_every == 0:
            dump_trajectories(st, args, out, f"train-step{step:05d}.jsonl")
        # RAGEN-2, before filtering; it reads each episode whole from one row, so not when a context window cuts rows.
        # Every rank scores its share of the prompt columns on its rollout copy (all ranks hold the whole rollout)
        if args.collapse_every > 0 and step % args.collapse_every == 0 and not windowed(args):
            with timed(timing, "collapse"):
                say("collapse diagnostics")
                m.update(collapse.collapse_metrics(st.rollout_model, st.tok, out, args.seed + step, not args.no_think,
                                                   args.max_turns > 1, args.temperature, rank=st.rank, world=st.world))

        # 2. select rows: normalise the scores, filter whole groups, adjust the row count, place the rewards
        with timed(timing, "filter"):
            scores = normalised_scores(args, out, outs)  # [N]
            idx, kept_ratio, fm = filter_rows(st, args, out, scores, step)  # [K]
            m.update(fm)
            batch = {k: out[k][idx]
                     for k in ("tokens", "attention_mask", "loss_mask", "old_logp", "episode")}  # [K, T] / [K]
            batch["mask"] = batch["loss_mask"].float()  # [K, T] tokens the policy sampled
            batch["rewards"] = place_rewards(args, out, idx, batch["mask"], scores)  # [K, T]

        # 3. old log-probs (recomputed by the actor, as RAGEN), reference log-probs, values
        with timed(timing, "old_logp"):
            old_logp = old_logprobs(st, args, batch, say) if step >= args.critic_warmup else None  # no actor update
        with timed(timing, "ref_values"):
            ref_logp, values = reference_and_values(st, args, batch, say)

        # 4. advantages
        with timed(timing, "adv"):
            adv, returns, am = advantages(args, batch, values, scores, out["group"], kept_ratio)
            m.update(am)

        # 5. PPO updates, then the rollout copy takes the new weights
        with timed(timing, "update"):
            m.update(update(st, args, batch, adv, old_logp, returns, values, ref_logp, monitor, step, say))
            # complete now: the sampler's mean distance from it
            if args.old_logp == "recompute" and old_logp is not None:
                m["rollout/sampler_logp_abs_diff"] = (
                    ((batch["old_logp"] - old_logp).abs() * batch["mask"]).sum().item()
                    / max(batch["mask"].sum().item(), 1))
        if args.check_update_every and step % args.check_update_every == 0 and old_logp is not None:
            with timed(timing, "check_update"):
                m.update(check_update(st, args, batch, old_logp, adv, out["success"][batch["episode"]].bool(), say))
        with timed(timing, "sync"):
            m["perf/sync_gathered_mb"] = sync_rollout_weights(st, args) / 2**20

        # 6. log, checkpoint
        timing["step"] = time.time() - t_step
        perf, line = step_summary(st, args, m, timing, out, batch)
        m.update(perf)
        m.update(work_metrics(st, out, monitor))
        m["warnings"] = collapse.collapse_warnings(m, monitor)
        for w in m["warnings"]:
            print0(f"step {step}: WARNING {w}")
        stop = collapse.stop_reason(m, monitor, step, args.empty_stop_steps, args.early_stop, print0)
        if stop:
            m[f"early_stopped/{stop[0]}"] = 1.0
        log(st, args, m)
        bar.set_postfix_str(line)
        if stop or step == args.steps - 1 or (args.save_every > 0 and (step + 1) % args.save_every == 0):
            say("checkpoint")
            checkpoint.save_checkpoint(args, step, monitor, st.actor, st.opt, st.critic, st.critic_opt,
                                       st.rollout_model, st.tok, st.lora_config, st.rank)
        if stop:
            print0(f"step {step}: stopping early: {stop[1]} (checkpoint in {args.out})")
            break

    if args.val_every > 0 and not stop:  # RAGEN also validates after the last update (again on a resume at the end)
        print0(f"final validation: {args.val_env}, {args.val_groups} seeds each")
        m = {"step": args.steps}
        with timed(m, "timing_s/val"):
            m.update(validate(st, args, args.steps, val_envs, functools.partial(phase, bar, args.steps)))
        log(st, args, m)
    return stop


def sync_rollout_weights(st, args):
    """The rollout copy takes the actor's weights (fsdp.sync_rollout_weights); returns the bytes gathered."""
    return fsdp.sync_rollout_weights(st.actor, st.rollout_model, st.ddp, args.lora_rank > 0, st.lora_base)


# ----------------------------------------------------------------------------- the script
# Importing train.py runs nothing; `python train.py` (and torchrun) runs main(), which turns bad input into one line
def die(msg):  # every rank sees the same args, so every rank stops with the same one-line error
    print0(f"train.py: {msg}")
    sys.exit(2)


def start_wandb(args, resumed):
    """Rank 0, --wandb: the wandb run, its files in <out>/wandb, offline unless WANDB_MODE says otherwise. Its id is
    kept in <out>/wandb_run_id, so a --resume continues the same run."""
    import wandb
    id_path = os.path.join(args.out, "wandb_run_id")
    run_id = open(id_path).read() if resumed and os.path.exists(id_path) else None
    run = wandb.init(project=args.wandb, name=os.path.basename(os.path.normpath(args.out)), config=vars(args),
                     dir=args.out, id=run_id, resume="allow", mode=os.environ.get("WANDB_MODE", "offline"))
    with open(id_path, "w") as f:
        f.write(run.id)
    return run


def main(argv=None):
    """train.py's command line (default sys.argv[1:]): flags, models, the loop, the summary. Bad input stops with one
    line and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    try:
        args, world, keeps = parse_args(argv, world)
        device = ranks.init_compute(args.device, ddp and args.plan is None, args.pg_timeout_min)  # --plan only prints
        # the memory plan (memplan.py): one line at start, the parts with --plan; on CUDA (or with --gpu-memory-gb) a
        # plan that does not fit stops the run here, before any weight is loaded
        text, refusal = memplan.check_launch(args, world, device)
        if text:
            print0(text)
        if args.plan is not None:
            return
        if refusal:
            raise ValueError(refusal)
        # run directory (checkpoint.py): a resumed run takes the same flags, except those that change neither what is
        # trained nor the sampled tokens (checkpoint.RESUME_MAY_CHANGE)
        ckpt = checkpoint.open_run(args)
        # the compute dtype (args.json records it); a resumed run keeps its own unless --dtype names one
        args.compute_dtype = models.compute_dtype(args.dtype, device, ckpt["args"] if ckpt is not None else None)
        torch.backends.cuda.matmul.allow_tf32 = False  # --dtype fp32 on a GPU is fp32, not TF32
        print0(models.dtype_line(args.compute_dtype, args.dtype, device))
        if args.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb needs wandb: pip install -r requirements-wandb.txt")
        torch.manual_seed(args.seed)
        if args.demo:
            print0(f"--demo = python train.py {DEMO} {' '.join(a for a in argv if a != '--demo')}".rstrip())
        print0(f"env {' + '.join(f'{e}:{n}' for e, n in args.env_mix)} -> val {args.val_env} | {args.algo}"
               f"{' (vanilla StarPO)' if args.vanilla else ''} | world {world} on {device} | rollout {args.num_groups}x"
               f"{args.group_size} = {args.num_groups * args.group_size} trajectories, {keeps}")
        try:  # the first prompts, counted in the model's tokens before any weight loads
            tok = models.load_tokenizer(args.model)
        except (ValueError, FileNotFoundError, OSError) as e:
            first = " (--demo starts from sft.py --demo's warm-up: run python sft.py --demo first)" if args.demo else ""
            raise ValueError(f"cannot load --model {args.model}: {' '.join(str(e).split())}{first}") from None
        check_context(args, tok)
        print0(f"loading --model {args.model} ...")
        st = build_models(args, device, ddp, rank, world)
    except ValueError as e:
        die(e)
    start_step, monitor = checkpoint.load_checkpoint(args, ckpt, st.actor, st.opt, st.critic, st.critic_opt)
    # drop the mapped tensors, so the file is freed once a new ckpt.pt replaces it
    resumed, ckpt = ckpt is not None, None
    if resumed:
        print0(f"resumed {args.out} at step {start_step}")
    sync_rollout_weights(st, args)
    if rank == 0:
        checkpoint.start_run_dir(args, world, start_step, resumed)
        if args.wandb:
            st.wandb_run = start_wandb(args, resumed)
    try:
        train_loop(st, args, start_step, monitor)
    except OSError as e:  # a file that could not be written (a full disk): the last checkpoint stays whole
        die(e)
    if rank == 0:
        plot = None
        if args.demo and importlib.util.find_spec("matplotlib"):  # the demo draws its curves (eval.py --plot)
            from eval import plot_run
            plot = plot_run(args.out)
        checkpoint.print_summary(args, plot)
    if st.wandb_run is not None:
        st.wandb_run.finish()
    ranks.leave(ddp)


if __name__ == "__main__":
    main()
