"""
Supervised warm-up: train a model on environment demonstrations, then hand it to train.py or eval.py.

    python sft.py --model smollm2 --env CoordFrozenLakeDet --policy solver --episodes 128 --out runs/sft-fl
    python sft.py --model smollm2 --env CoordFrozenLakeDet --policy mix --epsilon 0.5 --train-layers 10
    python eval.py --model runs/sft-fl --env CoordFrozenLakeDet          # or: train.py --model runs/sft-fl
    torchrun --nproc-per-node 2 sft.py --model tiny --env bandit --out /tmp/sft-tiny   # data-parallel (DDP)

A demonstration is an episode played by a scripted policy through rollout.rollout() itself (its `respond`
hook): the prompts, turn layout, parsing, env stepping and loss mask are the rollout's own, so the model is
trained on exactly the token sequences it will later be shown and asked to continue. The loss is the
cross-entropy of the tokens rollout marks as sampled (each turn's answer text and its stop token).
Policies:
  random  valid actions drawn uniformly (teaches the format only)
  solver  the env's own solver, re-planned every turn: Sokoban BFS, FrozenLake shortest path (slips ignored),
          Countdown's exhaustive search, WebShop's oracle, Bandit's high arm
  mix     each turn the solver's moves with probability 1 - epsilon, random ones otherwise
Each turn says at most the preset's max_actions_per_turn actions, within the episode's action budget. Think
mode answers with the fixed thought THOUGHT below. The output directory holds the model and its tokenizer.
"""
import argparse
import datetime
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import env_bandit
import env_countdown
import env_frozenlake
import env_sokoban
import env_webshop
import eval as eval_py
import rollout as rollout_py

POLICIES = {"random": "valid actions drawn uniformly (format only)",
            "solver": "the env's solver (Sokoban BFS, FrozenLake shortest path, Countdown search, WebShop oracle, Bandit high arm)",
            "mix": "per turn: the solver with probability 1 - --epsilon, random otherwise"}
THOUGHT = "Let me choose my next moves."  # think mode: the same short thought every turn
CHUNK = 16  # episodes per rollout() call: rollout allocates a (never used) KV cache row per episode


# ----------------------------------------------------------------------------- demonstration policies
def random_actions(env, k, rng):
    """k uniformly drawn valid actions (Countdown: a random expression; WebShop: one click or a search of 3 goal words)."""
    if isinstance(env, env_countdown.CountdownEnv):
        return [env_countdown.random_answer(env.nums, rng)]
    if isinstance(env, env_webshop.WebShopEnv):  # as env_webshop.run_random; the page changes after every action
        action = rng.choice(env.actions())
        if action == "search[<content>]":
            words = env_webshop.search_words(env.goal).split()
            action = f"search[{' '.join(rng.sample(words, min(3, len(words))))}]"
        return [action]
    return [rng.choice(env.actions()) for _ in range(k)]


def solver_actions(env, k):
    """The first k moves of the env's solver from the current state; None when it has no plan."""
    if isinstance(env, env_sokoban.SokobanEnv):
        grid = env.render().split("Grid Map: \n")[-1]  # grid_coord renders coordinates above the grid
        plan = env_sokoban.solve(grid, env.glyphs)
    elif isinstance(env, env_frozenlake.FrozenLakeEnv):
        plan = env_frozenlake.shortest_path(env.desc, env.pos)
    elif isinstance(env, env_countdown.CountdownEnv):
        answer = env_countdown.solve(env.nums, env.target)
        plan = None if answer is None else [answer]
    elif isinstance(env, env_webshop.WebShopEnv):
        plan = [env_webshop.oracle_action(env)]
    elif isinstance(env, env_bandit.BanditEnv):
        plan = [env.hi_arm_name]
    else:
        raise ValueError(f"no solver for {type(env).__name__}")
    return plan[:k] if plan else None


def demo_responder(policy, epsilon, seeds, settings, seed):
    """rollout's respond(b, env) for one batch of episodes: the answer text of episode b's next turn."""
    think, per_turn = settings["think"], settings["max_actions_per_turn"]
    left = [settings["preset"]["max_actions_per_traj"]] * len(seeds)     # actions each episode may still take
    rngs = [random.Random(seed * 1_000_003 + s) for s in seeds]         # per episode: a batch-independent draw

    def respond(b, env):
        k, rng = min(per_turn, left[b]), rngs[b]
        use_solver = policy == "solver" or (policy == "mix" and rng.random() >= epsilon)
        actions = (solver_actions(env, k) if use_solver else None) or random_actions(env, k, rng)
        left[b] -= len(actions)
        answer = " || ".join(actions)
        return f" {THOUGHT} </think> <answer> {answer} </answer>" if think else f" {answer} </answer>"
    return respond


def demonstrations(model, tok, preset_key, policy, epsilon, seeds, settings, seed):
    """Play the demonstrations of one preset through rollout(). Returns (rows, successes): one row per episode in
    rollout.pack_rows' layout (episode, token ids, answer flags, log-probs 0), and how many the env scored a success."""
    cls = eval_py.ENV_CLASSES[preset_key][0]
    rows, wins = [], 0
    for i in range(0, len(seeds), CHUNK):
        chunk = seeds[i:i + CHUNK]
        envs = [cls(**settings["preset"]["kwargs"]) for _ in chunk]
        respond = demo_responder(policy, epsilon, chunk, settings, seed)
        out = rollout_py.rollout(model, tok, envs, chunk, group_size=1, respond=respond, sampler=rollout_py.Sampler(),
                                 split="train" if cls is env_webshop.WebShopEnv else None, **settings)
        for r in range(len(chunk)):
            n = int(out["attention_mask"][r].sum())
            rows.append((i + r, out["tokens"][r, :n].tolist(), out["loss_mask"][r, :n].tolist(), [0.0] * n))
        wins += int(out["success"].sum())
    return rows, wins


# ----------------------------------------------------------------------------- the loss
def sft_loss(model, tokens, attention_mask, loss_mask):
    """Summed cross-entropy of the loss-masked tokens given everything before them (the caller divides by the
    token count over all ranks, so that any number of ranks takes the same token mean). Only the positions that
    predict a masked token go through lm_head (a [N, V] logit matrix instead of [B, T, V]). model is called as a
    module (not through starpo.token_logprobs, which calls its submodules) so that DDP's wrapper syncs gradients."""
    predicts = torch.zeros_like(loss_mask)                          # [B, T] position t predicts token t + 1
    predicts[:, :-1] = loss_mask[:, 1:]
    logits = model(input_ids=tokens, attention_mask=attention_mask.long(), logits_to_keep=predicts).logits  # [N, V]
    return F.cross_entropy(logits.float(), tokens[:, 1:][loss_mask[:, 1:]], reduction="sum")


# ----------------------------------------------------------------------------- the script
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="policies:\n" + "\n".join(f"  {k:7} {v}" for k, v in POLICIES.items()))
    p.add_argument("--model", default="smollm2", help="hub id, local dir, 'smollm2' (offline) or 'tiny' (tests)")
    p.add_argument("--env", nargs="+", default=["CoordFrozenLakeDet"], help="presets or short names to demonstrate")
    p.add_argument("--policy", default="solver", choices=list(POLICIES), help="demonstration policy (see below)")
    p.add_argument("--epsilon", type=float, default=0.5, help="mix: probability that a turn is played at random")
    p.add_argument("--episodes", type=int, default=128, help="demonstration episodes per preset")
    p.add_argument("--seed", type=int, default=10000, help="first env seed of the demonstrations (validation uses 123...)")
    p.add_argument("--no-think", action="store_true", help="answer-only turns (as train.py / eval.py --no-think)")
    p.add_argument("--max-turns", type=int, default=None, help="turns per episode (default: the preset's, else 5)")
    p.add_argument("--max-actions-per-turn", type=int, default=None, help="actions per turn (default: the preset's, else 5)")
    p.add_argument("--max-actions-per-traj", type=int, default=None, help="action budget per episode (default: the preset's)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the demonstrations (ignored with --steps)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--batch-size", type=int, default=4, help="episodes per optimizer step, over all ranks")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this")
    p.add_argument("--train-layers", type=int, default=0, help="train only the top K transformer layers and the final "
                   "norm (0 = every weight)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank via peft, base weights frozen, merged into the "
                   "saved model (0 = no LoRA; RAGEN: 64)")
    p.add_argument("--lora-alpha", type=float, default=64, help="LoRA alpha; the update is scaled by alpha / rank")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--out", default=None, help="output HF directory (default runs/sft-<preset>-<policy>-<time>)")
    args = p.parse_args(argv)

    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)

    def die(msg):  # every rank sees the same args, so every rank stops with the same one-line error
        if rank == 0:
            print(f"sft.py: {msg}", file=sys.stderr)
        sys.exit(2)

    if not 0 <= args.epsilon <= 1:
        die(f"--epsilon {args.epsilon}: need 0 <= epsilon <= 1")
    if args.episodes < 1 or args.batch_size < 1 or args.lr <= 0 or args.epochs <= 0 or (args.steps is not None and args.steps < 1):
        die("--episodes, --batch-size, --lr, --epochs and --steps must be positive")
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must divide over {world} ranks")
    if args.train_layers < 0 or args.lora_rank < 0:
        die("--train-layers and --lora-rank must be >= 0")
    if args.train_layers and args.lora_rank:
        die("--train-layers and --lora-rank are two ways to train part of the model; give one")
    try:
        presets = [eval_py.preset_name(e) for e in args.env]
    except ValueError as e:
        die(str(e))
    if len(set(presets)) < len(presets):
        die("a preset appears twice in --env")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    out_dir = args.out or os.path.join("runs", f"sft-{presets[0]}-{args.policy}-{time.strftime('%Y%m%d-%H%M%S')}")

    try:
        model, tok = rollout_py.load_model(args.model)  # fp32 on the CPU: demonstrations need no device
    except (ValueError, FileNotFoundError, OSError) as e:
        die(f"cannot load --model {args.model}: {' '.join(str(e).split())}")

    # demonstrations: every rank renders all of them (no model call, deterministic) and trains on its share
    flags = dict(eval_py.DEFAULTS, no_think=args.no_think, max_turns=args.max_turns, max_context=None,
                 max_actions_per_turn=args.max_actions_per_turn, max_actions_per_traj=args.max_actions_per_traj)
    rows, t0 = [], time.perf_counter()
    for key in presets:
        settings = eval_py.agent_settings(key, flags)
        seeds = list(range(args.seed, args.seed + args.episodes))
        got, wins = demonstrations(model, tok, key, args.policy, args.epsilon, seeds, settings, args.seed)
        rows += got
        say(f"{key}: {len(got)} {args.policy} demonstrations (seeds {seeds[0]}..{seeds[-1]}, {settings['max_turns']} "
            f"turns x {settings['max_actions_per_turn']} actions), success {wins}/{len(got)} = {wins / len(got):.3f}, "
            f"{sum(sum(flags) for _, _, flags, _ in got) / len(got):.0f} answer tokens / episode")
    say(f"rendered {len(rows)} episodes in {time.perf_counter() - t0:.1f} s")

    if args.train_layers:
        layers = model.model.layers
        if args.train_layers > len(layers):
            die(f"--train-layers {args.train_layers}: the model has {len(layers)} layers")
        model.requires_grad_(False)
        for m in list(layers[-args.train_layers:]) + [model.model.norm]:
            m.requires_grad_(True)
    if args.lora_rank:  # the same adapter train.py adds: every Linear but lm_head, no dropout
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    model.to(device).train()
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps = args.steps or max(1, round(args.epochs * len(rows) / args.batch_size))
    say(f"training {sum(q.numel() for q in params) / 1e6:.1f}M of {sum(q.numel() for q in model.parameters()) / 1e6:.1f}M "
        f"weights: {steps} steps of {args.batch_size} episodes, lr {args.lr}, {world} rank(s)")

    gen = torch.Generator().manual_seed(args.seed)  # the same order on every rank
    order, pad = [], tok.pad_token_id if tok.pad_token_id is not None else 0
    t0 = time.perf_counter()
    for step in range(steps):
        while len(order) < args.batch_size:  # epochs back to back, each a fresh permutation
            order += torch.randperm(len(rows), generator=gen).tolist()
        batch, order = order[:args.batch_size], order[args.batch_size:]
        mine = [rows[i] for i in batch[rank::world]]
        tokens, attn, mask = (x.to(device) for x in rollout_py.pack_rows(mine, pad)[:3])  # [B, T] each
        n = mask[:, 1:].sum().float()  # this rank's loss tokens; the mean is over every rank's
        if ddp:
            dist.all_reduce(n)
        with (torch.autocast("cuda", torch.bfloat16) if use_cuda else torch.autocast("cpu", enabled=False)):
            loss = sft_loss(net, tokens, attn, mask) / n.clamp(min=1)
        (loss * world).backward()  # DDP averages the ranks' gradients; the sum over ranks is the global mean
        norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if ddp:  # each rank holds its share of the global token mean
            dist.all_reduce(loss)
        say(f"step {step + 1}/{steps}  loss {loss.item():.4f}  grad-norm {norm.item():.3f}  {time.perf_counter() - t0:.0f} s")

    if rank == 0:  # a plain HF directory: the adapter merged in, fp32 weights, the tokenizer beside them
        export = model.merge_and_unload() if args.lora_rank else model
        export.float().eval().save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "sft.json"), "w") as f:  # not args.json: eval.py reads that as a train.py run
            json.dump(dict(vars(args), presets=presets, steps=steps, world=world, final_loss=loss.item()), f, indent=1)
        say(f"saved {out_dir}  (eval.py --model {out_dir} --env {' '.join(presets)})")
    if ddp:  # the ranks leave together: a gloo rank that tears down while rank 0 is still writing can hang at exit
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
