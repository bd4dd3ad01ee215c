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
  solver  the env's own solver (its file's solver_actions), re-planned every turn: Sokoban BFS, FrozenLake
          shortest path (slips ignored), Countdown's exhaustive search, WebShop's oracle, Bandit's high arm
  mix     each turn the solver's moves with probability 1 - epsilon, random ones otherwise
Each turn says at most the preset's max_actions_per_turn actions, within the episode's action budget. Think
mode answers with the fixed thought THOUGHT below. The output directory holds the model and its tokenizer.

Held-out demonstrations (--heldout per preset, on boards no training demonstration shows: the seeds from
--heldout-seed on, less validation's and those whose first observation a training demonstration shows) are scored without grad at step 0, every --eval-every steps and at the end; each time a JSON line
goes to <out>/sft_metrics.jsonl: step, train_loss (the mean step loss since the last line), heldout_loss, demos_seen,
seconds. --save-every K writes <out>/step<N>/ (an HF directory eval.py loads) and then <out>/ckpt.pt (the trainable
weights, the optimizer, the step, the data order), both renamed into place whole; the same command with --resume
continues from ckpt.pt (from step 0 if there is none yet) and ends as the uninterrupted run would:

    nohup python sft.py ... --save-every 25 --out runs/sft-x > runs/sft-x.log 2>&1 &     # again with --resume, >>
"""
import argparse
import contextlib
import copy
import json
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import agent
import checkpoint
import models
import ranks
import rollout as rollout_py
import sampler
import starpo

POLICIES = {"random": "valid actions drawn uniformly (format only)",
            "solver": "the env's solver (Sokoban BFS, FrozenLake shortest path, Countdown search, WebShop oracle, Bandit high arm)",
            "mix": "per turn: the solver with probability 1 - --epsilon, random otherwise"}
THOUGHT = "Let me choose my next moves."  # think mode: the same short thought every turn
CHUNK = 16  # episodes per rollout() call: rollout allocates a (never used) KV cache row per episode
VALIDATION = range(123, 123 + 256)  # eval.py's default seeds (RAGEN's seed.val, 256 of them): no demonstration uses them
HELDOUT_SEARCH = 100  # held-out demonstrations: at most this many seeds looked at per one wanted
RESUMABLE = {"resume", "device", "out", "steps", "epochs", "eval_every", "save_every", "micro_batch_size", "dtype",
             "compute_dtype", "compute_tokens"}  # flags --resume may change


# ----------------------------------------------------------------------------- demonstration policies
def demo_responder(policy, epsilon, seeds, settings, seed, module):
    """rollout's respond(b, env) for one batch of episodes: the answer text of episode b's next turn, from the env
    file `module`'s policies (solver_actions, random_actions)."""
    think, per_turn = settings.think, settings.max_actions_per_turn
    left = [settings.preset["max_actions_per_traj"]] * len(seeds)        # actions each episode may still take
    rngs = [random.Random(seed * 1_000_003 + s) for s in seeds]         # per episode: a batch-independent draw

    def respond(b, env):
        k, rng = min(per_turn, left[b]), rngs[b]
        use_solver = policy == "solver" or (policy == "mix" and rng.random() >= epsilon)
        actions = (module.solver_actions(env, k) if use_solver else None) or module.random_actions(env, k, rng)
        left[b] -= len(actions)
        answer = f" {rollout_py.ACTION_SEP} ".join(actions)
        if not think:  # the text after the forced ANSWER_OPEN
            return f" {answer} {rollout_py.ANSWER_CLOSE}"
        return f" {THOUGHT} {rollout_py.THINK_CLOSE} {rollout_py.ANSWER_OPEN} {answer} {rollout_py.ANSWER_CLOSE}"
    return respond


def demonstrations(model, tok, preset_key, policy, epsilon, seeds, settings, seed, states=None):
    """Play the demonstrations of one preset through rollout(). Returns (rows, successes): one row per episode in
    rollout.pack_rows' layout (episode, token ids, answer flags, log-probs 0), and how many the env scored a success.
    states, a list, if given: each episode's observations (one per turn) are appended to it."""
    cls, _, module = agent.ENV_CLASSES[preset_key]
    rows, wins = [], 0
    for i in range(0, len(seeds), CHUNK):
        chunk = seeds[i:i + CHUNK]
        envs = [cls(**settings.preset["kwargs"]) for _ in chunk]
        respond = demo_responder(policy, epsilon, chunk, settings, seed, module)
        out = rollout_py.rollout(model, tok, envs, chunk, settings, group_size=1, respond=respond, sampler=sampler.Sampler())
        if states is not None:
            states += out["states"]
        for r in range(len(chunk)):
            n = int(out["attention_mask"][r].sum())
            rows.append((i + r, out["tokens"][r, :n].tolist(), out["loss_mask"][r, :n].tolist(), [0.0] * n))
        wins += int(out["success"].sum())
    return rows, wins


def demonstration_observations(run_dir):
    """{preset: the set of observations the training demonstrations of the sft.py run in run_dir showed, at any turn},
    replayed from its sft.json: the same policy, seeds and agent loop, so the same episodes (its held-out
    demonstrations are not trained on and are left out). eval.py --unseen drops the judge seeds whose first board is
    one of them. The run's tokenizer and generation settings lay the turns out, as when it trained."""
    a = json.load(open(os.path.join(run_dir, "sft.json")))
    model, tok = models.load_model(run_dir)
    seen = {}
    for key in a["presets"]:
        states = []
        demonstrations(model, tok, key, a["policy"], a["epsilon"], list(range(a["seed"], a["seed"] + a["episodes"])),
                       agent.agent_settings(key, dict(a, sample_seed=0)), a["seed"], states)
        seen[key] = {s for episode in states for s in episode}
    return seen


def heldout_seeds(preset_key, first, n, train_seeds):
    """--heldout's seeds for one preset: the first n seeds from `first` on, validation's aside, whose board (first
    observation) no training demonstration (seeds train_seeds) shows, searched over at most HELDOUT_SEARCH * n seeds:
    fewer where the env has few boards (Cue has two). Returns (seeds, how many seeds were skipped as seen)."""
    seen = agent.seen_boards(preset_key, train_seeds)
    tried = [s for s in range(first, first + HELDOUT_SEARCH * n) if s not in VALIDATION]
    seeds = agent.unseen_seeds(preset_key, tried, seen, n)
    stop = tried.index(seeds[-1]) + 1 if seeds and len(seeds) == n else len(tried)  # seeds looked at
    return seeds, stop - len(seeds)


# ----------------------------------------------------------------------------- the loss
def sft_loss(model, tokens, attention_mask, loss_mask, share_prefix=False):
    """Summed cross-entropy of the loss-masked tokens given everything before them (the caller divides by the
    token count over all ranks, so that any number of ranks takes the same token mean). Only the positions that
    predict a masked token go through lm_head (a [N, V] logit matrix instead of [B, T, V]). share_prefix: the prefix
    every row shares (the system message, the start of the first user message) runs once (starpo.last_hidden, two
    model calls), the same loss and gradients up to fp32 rounding; off, model is called once as a module (not through
    its submodules), which DDP's wrapper needs to sync gradients."""
    predicts = torch.zeros_like(loss_mask)                          # [B, T] position t predicts token t + 1
    predicts[:, :-1] = loss_mask[:, 1:]
    if share_prefix:
        h = starpo.last_hidden(model, tokens, attention_mask.long(), share_prefix=True, logits_to_keep=1)  # [B, T, H]
        logits = model.get_output_embeddings()(h[predicts])                                               # [N, V]
    else:
        logits = model(input_ids=tokens, attention_mask=attention_mask.long(), logits_to_keep=predicts).logits  # [N, V]
    return F.cross_entropy(logits.float(), tokens[:, 1:][loss_mask[:, 1:]], reduction="sum")


def autocast(device, dtype):
    """The forwards' autocast: bf16 when the compute dtype (models.compute_dtype) is bf16, on CUDA or the CPU; the
    weights and AdamW stay fp32."""
    return torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bf16")


def heldout_loss(model, pad, rows, per_rank, rank, world, ddp, dtype):
    """The token mean of the loss on the held-out demonstrations `rows`, without grad: each rank runs its share of
    every batch of per_rank * world rows on the unwrapped model (no DDP collective inside), the sums are reduced."""
    device = next(model.parameters()).device
    total = torch.zeros(2, device=device)  # [summed loss, loss tokens]
    with torch.no_grad(), autocast(device, dtype):
        for i in range(rank * per_rank, len(rows), world * per_rank):
            tokens, attn, mask = (x.to(device) for x in rollout_py.pack_rows(rows[i:i + per_rank], pad)[:3])  # [B, T]
            total += torch.stack([sft_loss(model, tokens, attn, mask, share_prefix=True).float(),
                                  mask[:, 1:].sum().float()])
    if ddp:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def export(model, tok, path, lora):
    """model as a plain HF directory at `path` (fp32 weights, the LoRA adapter merged into a copy, the tokenizer
    beside them), written as path.tmp/ and renamed: a killed run leaves no half-written directory."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (copy.deepcopy(model).merge_and_unload() if lora else model).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def save_checkpoint(path, model, opt, gen, step, order, extra):
    """<out>/ckpt.pt: the trainable weights, the optimizer, the step, the data-order generator and the not-yet-used
    order, and `extra` (args, seconds, losses); written to ckpt.pt.tmp, synced, then renamed over ckpt.pt."""
    state = dict(model={n: q.detach().cpu() for n, q in model.named_parameters() if q.requires_grad},
                 optimizer=opt.state_dict(), step=step, generator=gen.get_state(), order=order, **extra)
    with open(path + ".tmp", "wb") as f:
        checkpoint.torch_save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_checkpoint(path, args):
    """ckpt.pt, refused (ValueError) if it was written with other flags than `args`, those that --resume may change
    (RESUMABLE) aside."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    changed = checkpoint.changed_flags(ckpt["args"], args, RESUMABLE)
    if changed:
        raise ValueError(f"--resume: {path} was written with other flags: {', '.join(changed)}")
    return ckpt


def write_metrics(path, lines):
    """sft_metrics.jsonl holding exactly `lines` (dicts), replaced whole."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    os.replace(path + ".tmp", path)


def train(model, tok, rows, heldout, steps, args, out_dir, ckpt, ddp, rank, world, say):
    """`steps` AdamW steps of --batch-size demonstrations (rows), each rank its share, on model (on its device, in
    train mode), from checkpoint `ckpt` (a dict, or None: from step 0). Every --eval-every steps, at step 0 and at
    the end: the loss on the held-out demonstrations, a line in <out_dir>/sft_metrics.jsonl; every --save-every steps
    and at the end: <out_dir>/step<N>/ and ckpt.pt; --compute-tokens may end it early. Returns the last step's loss
    (the token mean over all ranks) and the steps done."""
    device, pad = next(model.parameters()).device, tok.pad_token_id or 0
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)  # the same order on every rank
    order, start, seconds, loss, recent = [], 0, 0.0, float("nan"), []  # recent: step losses since the last line
    work = 0  # tokens of the demonstrations trained on so far, over all ranks: each has a forward and a backward
    metrics_path, ckpt_path = os.path.join(out_dir, "sft_metrics.jsonl"), os.path.join(out_dir, "ckpt.pt")
    lines = []
    if ckpt is not None:
        with torch.no_grad():
            for n, q in model.named_parameters():
                if q.requires_grad:
                    q.copy_(ckpt["model"][n])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"])
        order, start, seconds, loss, recent = ckpt["order"], ckpt["step"], ckpt["seconds"], ckpt["loss"], ckpt["recent"]
        work = ckpt.get("work", 0)  # (a checkpoint written before this count: from 0)
        if rank == 0 and os.path.exists(metrics_path):  # the lines written after the checkpoint are written again
            for text in open(metrics_path):
                try:
                    m = json.loads(text)
                except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                    continue
                lines += [m] if m["step"] <= start else []
    say(f"training {sum(q.numel() for q in params) / 1e6:.1f}M of {sum(q.numel() for q in model.parameters()) / 1e6:.1f}M "
        f"weights: {steps} steps of {args.batch_size} episodes, lr {args.lr}, {world} rank(s)"
        + (f"; resuming from step {start}" if ckpt is not None else ""))
    t0, micro = time.perf_counter() - seconds, args.micro_batch_size or args.batch_size // world  # rows per forward

    def log(step):  # the held-out loss and a metrics line (train loss: the mean over the steps since the last line)
        h = heldout_loss(model, pad, heldout, micro, rank, world, ddp, args.compute_dtype) if heldout else None
        # forward / backward tokens: the work train.py's work/* metrics count (every trained token once per pass, as
        # if no prefix were shared; compute_tokens = forward + 2 x backward), for controls matched in compute
        lines.append(dict(step=step, train_loss=sum(recent) / len(recent) if recent else None, heldout_loss=h,
                          demos_seen=step * args.batch_size, seconds=round(time.perf_counter() - t0, 1),
                          forward_tokens=work, backward_tokens=work, compute_tokens=3 * work))
        recent.clear()
        if rank == 0:
            write_metrics(metrics_path, lines)
        if h is not None:
            say(f"held-out loss {h:.4f} at step {step} ({step * args.batch_size} demonstrations seen)")
    if rank == 0:
        write_metrics(metrics_path, lines)
    if ckpt is None:
        log(0)
    done = start
    for step in range(start, steps):
        if 0 < args.compute_tokens <= 3 * work:  # a resumed run that had reached it
            break
        while len(order) < args.batch_size:  # epochs back to back, each a fresh permutation
            order += torch.randperm(len(rows), generator=gen).tolist()
        batch, order = order[:args.batch_size], order[args.batch_size:]
        mine = [rows[i] for i in batch[rank::world]]
        work += sum(len(rows[i][1]) for i in batch)  # every rank's rows (the batch is known on every rank)
        n = torch.tensor(float(sum(sum(flags[1:]) for _, _, flags, _ in mine)), device=device)  # this rank's loss tokens
        if ddp:  # the mean is over every rank's
            dist.all_reduce(n)
        loss = 0.0
        for i in range(0, len(mine), micro):  # gradients accumulate over the micro-batches; DDP syncs on the last
            tokens, attn, mask = (x.to(device) for x in rollout_py.pack_rows(mine[i:i + micro], pad)[:3])  # [b, T] each
            with net.no_sync() if ddp and i + micro < len(mine) else contextlib.nullcontext():
                with autocast(device, args.compute_dtype):  # DDP syncs gradients through its wrapper's one call: the plain forward
                    part = sft_loss(net, tokens, attn, mask, share_prefix=not ddp) / n.clamp(min=1)
                (part * world).backward()  # DDP averages the ranks' gradients; the sum over ranks is the global mean
            loss = loss + part.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ddp:  # each rank holds its share of the global token mean
            dist.all_reduce(loss)
        loss = loss.item()
        recent.append(loss)
        say(f"step {step + 1}/{steps}  loss {loss:.4f}  grad-norm {norm.item():.3f}  {time.perf_counter() - t0:.0f} s")
        done = step + 1
        matched = 0 < args.compute_tokens <= 3 * work  # the work of the run this one controls is reached
        if matched:
            say(f"reached --compute-tokens {args.compute_tokens} at step {done} ({3 * work} compute tokens)")
        elif args.compute_tokens and done == steps:
            say(f"--compute-tokens {args.compute_tokens} not reached: {3 * work} compute tokens in {steps} steps "
                "(more --episodes or --epochs)")
        if (args.eval_every and done % args.eval_every == 0) or done == steps or matched:
            log(done)
        if args.save_every and (done % args.save_every == 0 or done == steps or matched) and rank == 0:
            try:
                export(model, tok, os.path.join(out_dir, f"step{done}"), args.lora_rank)  # first: ckpt.pt says it is whole
                save_checkpoint(ckpt_path, model, opt, gen, done, order, dict(
                    args=vars(args), seconds=time.perf_counter() - t0, loss=loss, recent=list(recent), work=work))
            except OSError as e:  # a full disk: ckpt.pt is the last one written whole
                raise OSError(f"checkpoint of step {done} failed, {out_dir} still holds the previous one: {e}") from None
        if matched:
            break
    return loss, done


# ----------------------------------------------------------------------------- the script
# --demo: train.py --demo's start, a format warm-up: Cue with letters A-M played by the random policy, so the model
# learns to answer one letter in the format and nothing of which letter is right (success 1/13)
DEMO = ("--model smollm2 --env CueAM --policy random --no-think --max-new-tokens 8 --episodes 64 --batch-size 8 "
        "--heldout 0 --out runs/demo-sft")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="policies:\n" + "\n".join(f"  {k:7} {v}" for k, v in POLICIES.items()))
    p.add_argument("--model", default="smollm2", help="hub id, local dir, 'smollm2' (offline) or 'tiny' (tests)")
    p.add_argument("--env", nargs="+", default=["CoordFrozenLakeDet"], help="presets or short names to demonstrate")
    p.add_argument("--policy", default="solver", choices=list(POLICIES), help="demonstration policy (see below)")
    p.add_argument("--epsilon", type=float, default=0.5, help="mix: probability that a turn is played at random")
    p.add_argument("--episodes", type=int, default=128, help="demonstration episodes per preset")
    p.add_argument("--seed", type=int, default=10000, help="first env seed of the demonstrations (validation uses 123...)")
    p.add_argument("--heldout", type=int, default=64, help="held-out demonstrations per preset, on boards the training "
                   "demonstrations do not show, their loss logged (0 = none)")
    p.add_argument("--heldout-seed", type=int, default=5000, help="their first env seed (disjoint from the training "
                   "and validation seeds)")
    agent.add_agent_flags(p.add_argument_group("agent loop (as train.py's: the demonstrations are laid out as its "
                                               "rollouts)"), sampling=False)
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the demonstrations (ignored with --steps)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--compute-tokens", type=int, default=0, help="stop after the first step whose compute tokens "
                   "(forward + 2 x backward, as sft_metrics.jsonl counts them) reach this, logging and saving there: "
                   "a supervised control matched in work to an RL run (its work/compute_tokens_total); 0 = off")
    p.add_argument("--batch-size", type=int, default=4, help="episodes per optimizer step, over all ranks")
    p.add_argument("--micro-batch-size", type=int, default=0, help="episodes per forward/backward on a rank (memory "
                   "only, the same step; 0 = the rank's whole share of --batch-size)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm to this")
    p.add_argument("--train-layers", type=int, default=0, help="train only the top K transformer layers and the final "
                   "norm (0 = every weight)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank via peft, base weights frozen, merged into the "
                   "saved model (0 = no LoRA; RAGEN: 64)")
    p.add_argument("--lora-alpha", type=float, default=64, help="LoRA alpha; the update is scaled by alpha / rank")
    p.add_argument("--eval-every", type=int, default=25, help="held-out loss every K steps, and at step 0 and the end "
                   "(0 = only those)")
    p.add_argument("--save-every", type=int, default=0, help="every K steps and at the end: <out>/step<K>/ (HF) and "
                   "<out>/ckpt.pt (0 = neither, only the final model)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/ckpt.pt (from step 0 if there is none), "
                   "with the same flags")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="compute dtype (bf16 autocast, "
                   "fp32 weights and AdamW): auto = bf16 on CUDA and on a CPU with native bf16, else fp32; as train.py")
    p.add_argument("--out", default=None, help="output HF directory (default runs/sft-<preset>-<policy>-<time>)")
    p.add_argument("--demo", action="store_true", help=f"the first half of the README's demo: {DEMO}; flags given with "
                   "it override these")
    return p


def check_args(args, world):
    """The presets of --env, the flags checked: a ValueError says what cannot run."""
    if not 0 <= args.epsilon <= 1:
        raise ValueError(f"--epsilon {args.epsilon}: need 0 <= epsilon <= 1")
    if args.episodes < 1 or args.batch_size < 1 or args.lr <= 0 or args.epochs <= 0 or (args.steps is not None and args.steps < 1):
        raise ValueError("--episodes, --batch-size, --lr, --epochs and --steps must be positive")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must divide over {world} ranks")
    if args.train_layers < 0 or args.lora_rank < 0:
        raise ValueError("--train-layers and --lora-rank must be >= 0")
    if args.train_layers and args.lora_rank:
        raise ValueError("--train-layers and --lora-rank are two ways to train part of the model; give one")
    if min(args.heldout, args.eval_every, args.save_every, args.micro_batch_size, args.compute_tokens) < 0:
        raise ValueError("--heldout, --eval-every, --save-every, --micro-batch-size and --compute-tokens must be >= 0")
    train_seeds, held = range(args.seed, args.seed + args.episodes), range(args.heldout_seed, args.heldout_seed + args.heldout)
    for name, other in (("training", train_seeds), ("validation", VALIDATION)):
        if held and max(held.start, other.start) < min(held.stop, other.stop):
            raise ValueError(f"held-out seeds {held.start}..{held.stop - 1} overlap the {name} seeds "
                             f"{other.start}..{other.stop - 1}: move --heldout-seed")
    if args.resume and args.out is None:
        raise ValueError("--resume needs --out, the directory of the run to continue")
    if args.out and not args.resume and os.path.exists(os.path.join(args.out, "ckpt.pt")):
        raise ValueError(f"{args.out} holds a run (ckpt.pt): continue it with --resume, or give another --out")
    presets = [agent.preset_name(e) for e in args.env]
    if len(set(presets)) < len(presets):
        raise ValueError("a preset appears twice in --env")
    for key in presets:
        module = agent.ENV_CLASSES[key][2]
        if not (hasattr(module, "solver_actions") and hasattr(module, "random_actions")):
            raise ValueError(f"{module.__name__}.py defines no solver_actions and random_actions: no policy plays {key}")
    return presets


def trainable(model, args):
    """The model with the weights --train-layers or --lora-rank leave trainable (all of them without either)."""
    if args.train_layers:
        layers = model.model.layers
        if args.train_layers > len(layers):
            raise ValueError(f"--train-layers {args.train_layers}: the model has {len(layers)} layers")
        model.requires_grad_(False)
        for m in list(layers[-args.train_layers:]) + [model.model.norm]:
            m.requires_grad_(True)
    if args.lora_rank:  # the same adapter train.py adds: every Linear but lm_head, no dropout
        from peft import LoraConfig, get_peft_model
        with torch.random.fork_rng():  # the adapter's random init from --seed: the same run every time
            torch.manual_seed(args.seed)
            model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                     target_modules="all-linear"))
    return model


def main(argv=None):
    argv, p = sys.argv[1:] if argv is None else argv, build_parser()
    args = p.parse_args(argv)
    if args.demo:  # the preset first, the command line after it: for a flag given twice argparse keeps the last
        args = p.parse_args(DEMO.split() + argv)
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    def die(e):  # every rank sees the same args, so every rank stops with the same one-line error
        if rank == 0:
            print(f"sft.py: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        presets = check_args(args, world)
    except ValueError as e:
        die(e)
    try:
        model, tok = models.load_model(args.model, check=sampler.self_check)  # fp32 on the CPU: no device needed
        rollout_py.chat_pieces(tok)  # a chat template the rollout cannot extend is refused here, not mid-run
    except (ValueError, FileNotFoundError, OSError) as e:
        die(f"cannot load --model {args.model}: {' '.join(str(e).split())}")
    device = ranks.init_compute(args.device, ddp, 30)  # a collective waits at most 30 minutes
    args.compute_dtype = models.compute_dtype(args.dtype, device)
    out_dir = args.out or os.path.join("runs", f"sft-{presets[0]}-{args.policy}-{time.strftime('%Y%m%d-%H%M%S')}")
    ckpt = None
    if args.resume and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        try:
            ckpt = read_checkpoint(os.path.join(out_dir, "ckpt.pt"), args)
            args.compute_dtype = models.compute_dtype(args.dtype, device, ckpt["args"])  # a resumed run keeps its own
        except ValueError as e:
            die(e)
    elif args.resume:
        say(f"no {out_dir}/ckpt.pt yet: starting at step 0")
    say(models.dtype_line(args.compute_dtype, args.dtype, device))

    # demonstrations: every rank renders all of them (no model call, deterministic) and trains on its share
    rows, heldout, skipped, t0 = [], [], {}, time.perf_counter()  # skipped: {preset: held-out seeds skipped as seen}
    for key in presets:
        settings = agent.agent_settings(key, vars(args), sample_seed=0)
        seeds = list(range(args.seed, args.seed + args.episodes))
        try:  # an answer over --max-new-tokens in this tokenizer
            got, wins = demonstrations(model, tok, key, args.policy, args.epsilon, seeds, settings, args.seed)
        except ValueError as e:
            die(e)
        rows += got
        say(f"{key}: {len(got)} {args.policy} demonstrations (seeds {seeds[0]}..{seeds[-1]}, {settings.max_turns} "
            f"turns x {settings.max_actions_per_turn} actions), success {wins}/{len(got)} = {wins / len(got):.3f}, "
            f"{sum(sum(flags) for _, _, flags, _ in got) / len(got):.0f} answer tokens / episode")
        if args.heldout:  # boards the training demonstrations do not show
            seeds, skipped[key] = heldout_seeds(key, args.heldout_seed, args.heldout, seeds)
            if not seeds:
                say(f"{key}: no held-out demonstrations: all {skipped[key]} seeds looked at from {args.heldout_seed} "
                    "on show boards of the training demonstrations")
                continue
            got, wins = demonstrations(model, tok, key, args.policy, args.epsilon, seeds, settings, args.seed)
            heldout += got
            say(f"{key}: {len(got)} held-out demonstrations (seeds {seeds[0]}..{seeds[-1]}, {skipped[key]} skipped as "
                f"boards of the training demonstrations), success {wins}/{len(got)}")
    say(f"rendered {len(rows) + len(heldout)} episodes in {time.perf_counter() - t0:.1f} s")
    try:
        model = trainable(model, args)
    except ValueError as e:
        die(e)
    steps = args.steps or max(1, round(args.epochs * len(rows) / args.batch_size))
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    try:
        loss, steps = train(model.to(device).train(), tok, rows, heldout, steps, args, out_dir, ckpt, ddp, rank, world,
                            say)
    except OSError as e:
        die(e)
    if rank == 0:  # a plain HF directory: the adapter merged in, fp32 weights, the tokenizer beside them
        final = model.merge_and_unload() if args.lora_rank else model
        final.float().eval().save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "sft.json"), "w") as f:  # not args.json: eval.py reads that as a train.py run
            json.dump(dict(vars(args), presets=presets, steps=steps, world=world, final_loss=loss,
                           heldout_skipped=skipped), f, indent=1)
        say(f"saved {out_dir}  (eval.py --model {out_dir} --env {' '.join(presets)})")
    ranks.leave(ddp)


if __name__ == "__main__":
    main()
