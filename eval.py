"""
Evaluate a model or a trained checkpoint on fixed validation seeds, and plot a run's training curves.

    python eval.py --model smollm2 --env bandit --no-think               # a hub id, a directory, smollm2, tiny
    python eval.py --model runs/Bandit-ppo-xyz --env Bandit BanditTest   # a run dir: loads <run>/hf, takes its flags
    python eval.py --model runs/Bandit-ppo-xyz --samples 8 --greedy     # pass@1..8 with 8 samples per seed
    python eval.py --plot runs/Bandit-ppo-xyz                            # -> runs/Bandit-ppo-xyz/curves.png
    python eval.py --plot runs/A runs/B --out ab.png                    # two runs overlaid, with a legend
    python eval.py --paired runs/A/eval-x runs/B/eval-y                 # B against A on the same episodes
    python eval.py --model runs/A --unseen runs/A runs/sft-fl           # only boards its training never showed

RAGEN's validation protocol (its config's seed.val = 123): seeds 123, 124, ... one group of one env per seed, sampling
at temperature 0.5, the training budgets of turns and actions. With --samples k every seed becomes a group of
k episodes from the same initial state, and pass@j (j <= k) uses the unbiased estimator of the Codex paper.
Episodes are played by rollout.rollout(), the same agent loop that training uses; this file only counts.
"""
import argparse
import fnmatch
import inspect
import json
import math
import os
import sys
import time

import torch

import agent
import models
import sampler
from rollout import chat_pieces, rollout, step_env

# train.py's flags that set how an episode is played; a run directory's args.json gives them to eval.py
# (validation samples at --val-temperature, keyed by the run's --seed)
FROM_RUN = dict({k: k for k in agent.FLAG_DEFAULTS if k != "temperature"}, val_seed="val_seed", temperature="val_temperature",
                env="val_env", sample_seed="seed")
DEFAULTS = dict(agent.FLAG_DEFAULTS, temperature=0.5, val_seed=123, sample_seed=0, env=None)  # RAGEN's val: T = 0.5


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c succeeded: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
    Codex paper), as the numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))  # the probability that all k fail


def episode_records(out, tok, preset_key, seeds, sample_of):
    """One JSON-ready dict per episode: every turn's prompt (the exact tokens the model was given, decoded)
    and response (raw text, parsed think and actions, reward, env info), the score and success."""
    records = []
    for b in range(len(out["scores"])):
        tokens, sampled = out["tokens"][b].tolist(), out["loss_mask"][b].tolist()
        turns, prev_end = [], -1
        for end, resp in zip(out["turn_ends"][b], out["responses"][b]):
            start = end
            while start > 0 and sampled[start - 1]:  # the turn's sampled tokens are one contiguous span
                start -= 1
            turns.append(dict(prompt=tok.decode(tokens[prev_end + 1:start]), **resp))
            prev_end = end
        records.append(dict(preset=preset_key, seed=seeds[b], sample=sample_of[b], success=bool(out["success"][b]),
                            score=round(float(out["scores"][b]), 6), penalty=round(float(out["penalty"][b]), 6),
                            turn_rewards=out["turn_rewards"][b], stats={k: v[b].item() for k, v in out["stats"].items()},
                            turns=turns, text=out["text"][b]))
    return records


def solver_agreement(out, preset_key, settings, seeds, group_size, split=None):
    """Per episode of rollout() output `out`, per turn: whether the turn's first action is the env solver's next move
    (its file's solver_actions(env, 1), case aside) at the state the turn saw; None where the solver has no plan. The
    env is replayed from the episode's seed with each turn's parsed actions, stepped as rollout steps them (step_env
    within the episode's action budget); a replay that ends otherwise than the episode raises RuntimeError."""
    cls, _, module = agent.ENV_CLASSES[preset_key]
    preset, result = settings.preset, []
    for b, turns in enumerate(out["responses"]):
        env = cls(**preset["kwargs"])
        member = dict(member=b % group_size) if preset.get("seed_per_member") else {}  # as rollout resets it
        env.reset(seeds[b], **member) if split is None else env.reset(seeds[b], split=split, **member)
        left, done, info, agree = preset["max_actions_per_traj"], False, {}, []
        for turn in turns:
            plan, said = module.solver_actions(env, 1), turn["actions"]
            agree.append(None if not plan else bool(said) and said[0].strip().lower() == plan[0].strip().lower())
            _, done, info, counts, _ = step_env(env, said, left)
            left -= counts["executed"]
        if (done and bool(info.get("success", False))) != bool(out["success"][b]):
            raise RuntimeError(f"{preset_key} seed {seeds[b]}: the replay of the episode's actions does not end as the "
                               "episode did")
        result.append(agree)
    return result


def summarize(records, samples):
    """The table row of one preset: rates over episodes, pass@k averaged over seeds."""
    n, mean = len(records), lambda xs: sum(xs) / max(len(xs), 1)
    st = lambda k: [r["stats"][k] for r in records]
    wins = {}
    for r in records:
        wins[r["seed"]] = wins.get(r["seed"], 0) + r["success"]
    valid, invalid, errors = sum(st("valid_actions")), sum(st("invalid_actions")), sum(st("format_errors"))
    played = sum(st("num_turns"))
    row = dict(episodes=n, success=mean([r["success"] for r in records]))
    for k in sorted({samples} | {2 ** i for i in range(1, 12) if 2 ** i < samples} - {1}):  # pass@1 = success
        row[f"pass@{k}"] = mean([pass_at_k(samples, c, k) for c in wins.values()])
    row.update(score=mean([r["score"] for r in records]),
               valid_action_rate=valid / (valid + invalid) if valid + invalid else None,  # None: no action proposed
               format_ok_rate=1.0 - errors / played if played else None,  # None: no turn played
               turns=mean(st("num_turns")), response_tokens=mean(st("response_tokens")),
               think_tokens=mean(st("think_tokens")))
    if "solver_agreement" in records[0]:  # --agreement: over the turns where the solver has a move
        turns = [a for r in records for a in r["solver_agreement"] if a is not None]
        row["solver_agreement"] = mean(turns) if turns else None
    return row


def wins(records):
    """{(seed, sample): 1 if the episode succeeded else 0} of an evaluation's episode records."""
    return {(r["seed"], r["sample"]): int(bool(r["success"])) for r in records}


def paired(a, b):
    """Success of evaluation b against evaluation a on the same episodes (each list of episode records, matched by
    seed and sample): the difference in success rate, its paired standard error (of the per-episode differences), and
    the episodes won by each alone. Raises ValueError when the two did not play the same episodes."""
    won_a, won_b = wins(a), wins(b)
    if won_a.keys() != won_b.keys() or len(won_a) < 2:
        raise ValueError("the two evaluations did not play the same seeds and samples (at least two)")
    d = [won_b[k] - won_a[k] for k in sorted(won_a)]  # per episode: +1 won by b alone, -1 by a alone
    n, diff = len(d), sum(d) / len(d)
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1) / n)
    return dict(episodes=n, success_a=sum(won_a.values()) / n, success_b=sum(won_b.values()) / n, diff=diff,
                paired_se=se, diff_in_se=diff / se if se > 0 else None, a_alone=d.count(-1), b_alone=d.count(1))


def student_t_p(t, dof):
    """Two-sided p of Student's t statistic t with an integer dof >= 1: P(|T| >= |t|), from the closed forms of the
    t distribution's CDF for integer degrees of freedom (Abramowitz and Stegun 26.7.3 / 26.7.4), with
    theta = atan(|t| / sqrt(dof)): P(|T| < |t|) = sin(theta) * sum_k c_k cos(theta)^(2k) for even dof, and
    (2 / pi) * (theta + sin(theta) * cos(theta) * sum_k c_k cos(theta)^(2k)) for odd dof (theta alone for dof 1)."""
    if dof < 1 or dof != int(dof):
        raise ValueError(f"Student's t needs an integer dof >= 1, got {dof}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c, term, total = math.cos(theta) ** 2, 1.0, 0.0
    if dof % 2 == 0:  # 1 + (1/2) c + (1*3)/(2*4) c^2 + ... up to c^((dof-2)/2)
        for k in range(dof // 2):
            total += term
            term *= c * (2 * k + 1) / (2 * k + 2)
        inside = math.sin(theta) * total
    else:  # 1 + (2/3) c + (2*4)/(3*5) c^2 + ... up to c^((dof-3)/2), times sin cos
        for k in range((dof - 1) // 2):
            total += term
            term *= c * (2 * k + 2) / (2 * k + 3)
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    return max(0.0, 1.0 - inside)


def paired_runs(a, bs):
    """Several runs of one arm (e.g. RL seeds), each evaluation in bs, against evaluation a on the same episodes: the
    mean over runs of their success differences, its standard error over runs (std / sqrt(runs), the seed-to-seed
    spread) with Student's t test of "no difference" over the runs (t, dof = runs - 1, two-sided p): the test of
    the arm, as each seed is one draw of the training; and the paired standard error of the runs' mean success per
    episode against a (the judge-board spread), which treats the trained models as fixed and so says how well the
    judge set measures these runs, not whether another seed would do the same."""
    rows = [paired(a, b) for b in bs]
    k, diffs = len(rows), [r["diff"] for r in rows]
    mean = sum(diffs) / k
    se_runs = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (k - 1) / k) if k > 1 else None
    t = mean / se_runs if se_runs else None
    wa, wbs = wins(a), [wins(b) for b in bs]
    d = [sum(wb[e] for wb in wbs) / k - wa[e] for e in sorted(wa)]  # per episode: the runs' mean success minus a's
    n = len(d)
    se_episodes = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    return dict(runs=k, success_a=rows[0]["success_a"], mean_success_b=sum(r["success_b"] for r in rows) / k,
                mean_diff=mean, se_over_runs=se_runs, t=t, dof=k - 1, p=None if t is None else student_t_p(t, k - 1),
                paired_se_of_mean=se_episodes)


def compare(dir_a, *dirs_b, played=()):
    """eval.py --paired A B [B ...]: the paired table of every preset A and each B played; with several Bs (the seeds
    of one arm) also their mean difference with its standard errors (paired_runs). Refuses evaluations that sampled
    differently (sampler seed, temperature, greedy): their episodes would not be paired. played (--unseen with
    --paired: training_shown() of each source): only the seeds A played whose board no source showed are compared, as
    if each evaluation had been run with that --unseen (a seed's sampling noise does not depend on the others played:
    rollout.rollout), so models can be judged on every seed as each is trained and the set fixed when all are)."""
    for d in (dir_a, *dirs_b):
        if not os.path.exists(os.path.join(d, "summary.json")):
            raise ValueError(f"{d} has no summary.json (give eval.py output directories)")
    sa = json.load(open(os.path.join(dir_a, "summary.json")))
    keys = ("sample_seed", "temperature", "greedy", "samples")
    read = lambda d, key: [json.loads(l) for l in open(os.path.join(d, f"{key}.jsonl"))]
    shared = list(sa["results"])
    for dir_b in dirs_b:
        sb = json.load(open(os.path.join(dir_b, "summary.json")))
        if any(sa["args"].get(k) != sb["args"].get(k) for k in keys):
            raise ValueError(f"{dir_a} and {dir_b} sampled differently ({', '.join(keys)} must match)")
        shared = [key for key in shared if key in sb["results"]]
    if not shared:
        raise ValueError(f"{dir_a} and {', '.join(dirs_b)} share no preset")
    a = {key: read(dir_a, key) for key in shared}  # A's episodes, read once for every B
    bs = [{key: read(dir_b, key) for key in shared} for dir_b in dirs_b]
    for key in shared if played else ():
        kept = set(unseen_judge_seeds(key, sorted({r["seed"] for r in a[key]}), played))
        a[key] = [r for r in a[key] if r["seed"] in kept]
        for b in bs:
            b[key] = [r for r in b[key] if r["seed"] in kept]
    for dir_b, b in zip(dirs_b, bs):
        print(f"A = {dir_a}, B = {dir_b}")
        rows = {key: paired(a[key], b[key]) for key in shared}
        print_table(rows)
    if len(dirs_b) > 1:
        print(f"A = {dir_a}, B = the mean of {len(dirs_b)} runs: t = mean_diff / se_over_runs, Student's t with dof = "
              f"runs - 1, two-sided p (the test over seeds); paired_se_of_mean treats the {len(dirs_b)} trained models "
              "as fixed (the judge boards' spread only)")
        rows = {key: paired_runs(a[key], [b[key] for b in bs]) for key in shared}
        print_table(rows)
    return rows


def print_table(rows):
    """A markdown table, one row per preset (pastes into the README as it is); n/a where a value is None (a rate over
    no turn or no action, a ratio over a zero standard error)."""
    cols = list(next(iter(rows.values())))
    print("| preset | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows.items():
        cells = ["n/a" if v is None else str(v) if isinstance(v, int) else f"{v:.3f}" for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


def training_shown(source):
    """What a training source showed its model, for --unseen: {preset: (the seeds its episodes started from, the set
    of observations they showed at any turn, or None where not recorded)}. A train.py run directory (args.json):
    step s played group g of its --env mix from seed + s*num_groups + g, each preset its groups in --env order, for
    every step with training metrics in metrics.jsonl (the final validation's line has none); the observations of
    those steps from its observations.jsonl. An sft.py run directory (sft.json): seeds seed..seed+episodes-1 of each
    preset (its held-out demonstrations are not trained on), the observations by replaying them
    (sft.demonstration_observations). A seed range 'A-B' (A to B inclusive) or one seed 'A': under the key None,
    seeds of the judged preset, first boards only."""
    if os.path.exists(os.path.join(source, "args.json")):
        a = json.load(open(os.path.join(source, "args.json")))
        path, steps = os.path.join(source, "metrics.jsonl"), []
        for line in open(path) if os.path.exists(path) else []:
            try:
                m = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                continue
            if any(k.startswith("train/") for k in m):
                steps.append(m["step"])
        obs_path, shown = os.path.join(source, "observations.jsonl"), {}
        for line in open(obs_path) if os.path.exists(obs_path) else []:
            try:
                o = json.loads(line)
            except json.JSONDecodeError:
                continue
            if o["step"] in steps:
                shown.setdefault(o["preset"], set()).update(o["observations"])
        played, first = {}, 0  # first: the preset's first group within a step
        for key, n in a["env_mix"]:
            seeds = [a["seed"] + s * a["num_groups"] + first + g for s in sorted(set(steps)) for g in range(n)]
            played[key] = (seeds, shown.get(key, set()) if os.path.exists(obs_path) else None)
            first += n
        return played
    if os.path.exists(os.path.join(source, "sft.json")):
        import sft
        a, shown = json.load(open(os.path.join(source, "sft.json"))), sft.demonstration_observations(source)
        return {key: (list(range(a["seed"], a["seed"] + a["episodes"])), shown[key]) for key in a["presets"]}
    lo, _, hi = source.partition("-")
    if lo.isdigit() and (hi.isdigit() or not hi) and int(lo) <= int(hi or lo):
        return {None: (list(range(int(lo), int(hi or lo) + 1)), None)}
    raise ValueError(f"--unseen {source}: not a train.py run directory (args.json), an sft.py one (sft.json) or a "
                     "seed range A-B")


def unseen_judge_seeds(key, judge, played):
    """The seeds of judge (of preset key) whose first observation no training source in played (training_shown() of
    each) showed at any turn; prints how many were dropped, and why. Each source's seeds reset in its own preset (None:
    this one); boards are compared as text (agent.board)."""
    first = set().union(*(agent.seen_boards(k or key, s) for p in played for k, (s, _) in p.items()))
    later = {agent.board(key, o) for p in played for k, (_, shown) in p.items() if k == key and shown for o in shown}
    n_first = len(judge) - len(agent.unseen_seeds(key, judge, first))
    kept = agent.unseen_seeds(key, judge, first | later)
    unrecorded = [k for p in played for k, (s, o) in p.items() if o is None and k is not None]
    print(f"{key}: --unseen drops {len(judge) - len(kept)} of {len(judge)} seeds: {n_first} whose board a training "
          f"episode started on, {len(judge) - len(kept) - n_first} more whose board one showed at a later turn; "
          f"{len(kept)} remain" + (f" (no observations.jsonl for {', '.join(unrecorded)}: first boards only there)"
                                   if unrecorded else ""))
    return kept


def resolve(args):
    """eval.py's flags completed and checked: a run directory's flags (FROM_RUN) for those not given, then DEFAULTS,
    the output directory. Returns (the model directory or name to load, the presets); a ValueError says what is wrong."""
    run_dir, args.model = None, os.path.expanduser(args.model)
    if os.path.isdir(args.model) and os.path.exists(os.path.join(args.model, "args.json")):
        run_dir, model_path = args.model, os.path.join(args.model, "hf")
        if not os.path.isdir(model_path):
            raise ValueError(f"run directory {run_dir} has no hf/ (the run has not saved a checkpoint yet)")
        run_args = json.load(open(os.path.join(run_dir, "args.json")))
        for ours, theirs in FROM_RUN.items():
            if getattr(args, ours) is None and theirs in run_args:
                setattr(args, ours, run_args[theirs])
    else:
        model_path = args.model
        looks_like_path = model_path.startswith((".", "/", "~")) or model_path.count("/") > 1 or (
            "/" in model_path and os.path.isdir(model_path.split("/")[0]))
        if looks_like_path and not os.path.isdir(model_path):
            raise ValueError(f"no model directory {model_path}")
    if os.path.isdir(model_path) and not os.path.exists(os.path.join(model_path, "config.json")):
        raise ValueError(f"{model_path} is not a model directory (no config.json)")
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.env:
        raise ValueError("give --env (a preset or short name); only a run directory provides a default")
    presets = [agent.preset_name(e) for e in args.env]
    if args.samples < 1 or args.num_seeds < 1 or args.temperature <= 0:
        raise ValueError("--samples and --num-seeds must be >= 1 and --temperature > 0")
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = os.path.basename(os.path.normpath(args.model)) or "model"
        args.out = os.path.join(run_dir, f"eval-{stamp}") if run_dir else os.path.join("runs", f"eval-{base}-{stamp}")
    return model_path, presets


def evaluate(model, tok, args, presets, played=()):
    """Play --num-seeds seeds x --samples episodes of each preset; write <out>/<preset>.jsonl and summary.json, print
    the table. Returns its rows. played: training_shown() of each --unseen source; a seed whose first observation one
    of them showed, at any turn, is dropped (a preset left with none is not played)."""
    rows = {}
    for key in presets:
        cls, preset, _ = agent.ENV_CLASSES[key]
        settings = agent.agent_settings(key, vars(args))
        groups_per_call = max(1, args.batch_size // args.samples)  # bounded KV-cache memory
        split = args.split if "split" in inspect.signature(cls.reset).parameters else None  # WebShop's goal splits
        judge = [args.val_seed + g for g in range(args.num_seeds)]
        if played:
            judge = unseen_judge_seeds(key, judge, played)
            if not judge:
                continue
        records, t0, envs = [], time.time(), []
        for g0 in range(0, len(judge), groups_per_call):
            seeds = [s for s in judge[g0:g0 + groups_per_call] for _ in range(args.samples)]  # [B] k samples share a seed
            envs += [cls(**preset["kwargs"]) for _ in range(len(seeds) - len(envs))]
            out = rollout(model, tok, envs[:len(seeds)], seeds, settings, group_size=args.samples, greedy=args.greedy,
                          split=split)  # sampled at settings.temperature, which is args.temperature
            records += episode_records(out, tok, key, seeds, [i % args.samples for i in range(len(seeds))])
            if args.agreement:
                for r, agree in zip(records[-len(seeds):], solver_agreement(out, key, settings, seeds, args.samples, split)):
                    r["solver_agreement"] = agree
        elapsed = time.time() - t0
        with open(os.path.join(args.out, f"{key}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")  # default=str: env info may hold non-JSON values
        rows[key] = summarize(records, args.samples)
        print(f"{key}: {len(records)} episodes in {elapsed:.1f}s "
              f"({sum(r['stats']['response_tokens'] for r in records) / elapsed:.0f} sampled tokens/s)")
    if rows:
        print_table(rows)
    json.dump(dict(args=vars(args), results=rows), open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    return rows


# the paper's collapse indicators (Fig. 6) and the rest of the dashboard: (title, metric key patterns)
PANELS = [("success rate", ["train/*/success", "val-env/*/success"]),
          ("score (reward)", ["train/*/score", "val-env/*/score"]),
          ("in-group reward std", ["rollout/in_group_std", "rollout/chosen_in_group_std"]),
          ("entropy; RAGEN-2 H(Z|X) per token", ["actor/entropy", "collapse/*/cond_entropy"]),
          ("grad norm", ["actor/grad_norm", "critic/grad_norm"]),
          ("critic explained variance (axis from -1)", ["critic/explained_variance"]),
          ("tokens per episode", ["train/*/response_tokens", "train/*/think_tokens"]),
          ("kept fraction", ["rollout/kept_fraction"]),
          ("format-valid turns", ["train/*/format_ok_rate", "val-env/*/format_ok_rate"]),
          ("actions per turn", ["train/*/actions_per_turn", "val-env/*/actions_per_turn"]),
          ("prompt-response MI (RAGEN-2), nats", ["collapse/*/mi"]),
          ("prompt retrieval from the response", ["collapse/*/retrieval_acc", "collapse/*/retrieval_chance"]),
          ("collapse warnings per step", ["collapse/warnings"])]


def read_metrics(run_dir):
    """{key: ([steps], [values])} of <run_dir>/metrics.jsonl; validation and collapse keys appear on their steps only."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"no metrics.jsonl in {run_dir}")
    series = {}
    for line in open(path):
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
        if isinstance(m.get("warnings"), list):  # train.py's collapse warnings, sentences: drawn as a count
            m["collapse/warnings"] = len(m["warnings"])
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                series.setdefault(k, ([], []))[0].append(m["step"])
                series[k][1].append(v)
    for k in [k for k in series if k.endswith("/num_turns")]:  # per-turn rates: per-step ratio of means = of sums
        prefix, (steps, turns) = k[:-len("num_turns")], series[k]  # a step with no turn: NaN, a gap in the curve
        for name, of, f in (("format_ok_rate", "format_errors", lambda r: 1 - r), ("actions_per_turn", "num_actions", float)):
            if series.get(prefix + of, (None,))[0] == steps:
                series[prefix + name] = (steps, [f(x / t) if t else math.nan for x, t in zip(series[prefix + of][1], turns)])
    if not any(fnmatch.fnmatch(k, p) for k in series for _, ps in PANELS for p in ps):
        raise ValueError(f"{path} holds none of the metrics to plot")
    return series


def plot_run(*run_dirs, out=None, baselines=()):
    """Draw the training curves of one or more runs into one figure, one colour per run when there are several
    (line style = metric), and return its path: `out`, default <run>/curves.png, or <first run>/compare.png.
    baselines: (name, success) pairs drawn as grey lines on the success panel (a scripted policy, the start model)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    runs = [(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in run_dirs]
    # only the panels some run has data for (no critic panel for GRPO, no MI panels with --collapse-every 0)
    panels = [(title, patterns) for title, patterns in PANELS
              if any(fnmatch.fnmatch(k, p) for _, series in runs for k in series for p in patterns)]
    cols = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(2, cols, figsize=(4.4 * cols, 6.8), squeeze=False)  # one panel per drawn PANELS entry
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, patterns) in zip(axes.flat, panels):
        for r, (name, series) in enumerate(runs):
            keys = sorted(k for k in series if any(fnmatch.fnmatch(k, p) for p in patterns))
            for i, k in enumerate(keys):
                steps, values = series[k]
                style = {} if len(runs) == 1 else dict(color=f"C{r}", linestyle=["-", "--", ":", "-."][i % 4])
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                        label=k if len(runs) == 1 else f"{name}: {k}", **style)
        if title.startswith("critic explained variance"):  # 1 - Var[R - V] / Var[R] is -hundreds when Var[R] ~ 0
            ax.set_ylim(-1.05, 1.05)
        if title == "success rate":
            for i, (name, y) in enumerate(baselines):
                ax.axhline(y, color="grey", linestyle=["--", ":", "-."][i % 3], linewidth=1, label=f"{name}: {y:g}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.lines:
            ax.legend(fontsize=7 if len(runs) == 1 else 6)
    fig.suptitle(" vs ".join(name for name, _ in runs))
    fig.tight_layout()
    out = out or os.path.join(run_dirs[0], "curves.png" if len(runs) == 1 else "compare.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", nargs="+", default=None, metavar="RUN_DIR", help="draw a run's curves into RUN_DIR/curves.png; "
                   "several runs: overlaid, into <first>/compare.png (or --out FILE.png)")
    baseline = lambda text: (text.rpartition("=")[0], float(text.rpartition("=")[2]))  # NAME=SUCCESS; argparse says if not
    p.add_argument("--baseline", nargs="+", type=baseline, default=[], metavar="NAME=SUCCESS", help="with --plot: reference success "
                   "rates drawn as horizontal lines, e.g. random=0.19 warm-up=0.15")
    p.add_argument("--paired", nargs="+", default=None, metavar="EVAL", help="EVAL_A EVAL_B [EVAL_B ...]: compare eval.py "
                   "outputs of the same seeds and sampler seed: success difference B - A, its paired standard error, wins "
                   "alone; several Bs (one arm's seeds): also their mean difference, its SE over runs, Student's t, its "
                   "dof and two-sided p (the test over seeds), and the paired SE of the mean; with --unseen, on the seeds it keeps")
    p.add_argument("--model", default=None, help="hub id, local dir, run dir (loads <run>/hf), 'smollm2' or 'tiny'")
    p.add_argument("--env", nargs="+", action="extend", default=None, help="presets or short names (repeatable)")
    p.add_argument("--num-seeds", type=int, default=256, help="validation seeds (RAGEN: 256 groups of 1)")
    p.add_argument("--val-seed", type=int, default=None, help="first seed (RAGEN seed.val = 123)")
    p.add_argument("--samples", type=int, default=1, help="episodes per seed, for pass@k")
    p.add_argument("--unseen", nargs="+", default=None, metavar="RUN_DIR_OR_SEEDS", help="drop the seeds whose first "
                   "observation (the board) one of these showed at any turn: train.py run directories (their "
                   "observations.jsonl), sft.py ones (their demonstrations replayed; name an SFT warm start too) or "
                   "seed ranges A-B of the judged presets (their first boards)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    p.add_argument("--agreement", action="store_true", help="also the fraction of turns whose first action is the env "
                   "solver's move at that state (the episode replayed from its seed)")
    p.add_argument("--sample-seed", type=int, default=None, help="seed of the sampler's random draws (default 0; a run dir: its --seed)")
    agent.add_agent_flags(p.add_argument_group("agent loop (train.py's flags)"), defaults=DEFAULTS, from_run=True)
    p.add_argument("--split", default=None, choices=["train", "val", "test"], help="WebShop goal split (default: the env's)")
    p.add_argument("--batch-size", type=int, default=128, help="episodes per rollout call (memory only)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="the sampling model's dtype: auto = "
                   "bf16 on CUDA and on a CPU with native bf16, else fp32 (train.py's rollout copy; logits are fp32)")
    p.add_argument("--out", default=None, help="output dir (default <run>/eval-<time> or runs/eval-<model>-<time>); with --plot: the PNG")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:  # bad input: one line and exit code 2
        if args.plot:
            print(plot_run(*args.plot, out=args.out, baselines=args.baseline))
            return
        if args.paired:
            if len(args.paired) < 2:
                raise ValueError("--paired needs EVAL_A and at least one EVAL_B")
            compare(*args.paired, played=[training_shown(source) for source in args.unseen or []])
            return
        if args.model is None:
            raise ValueError("give --model (or --plot RUN_DIR)")
        model_path, presets = resolve(args)
        played = [training_shown(source) for source in args.unseen or []]
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no GPU")
        device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
        dtype = models.compute_dtype(args.dtype, device)  # the rule train.py's rollout copy follows
        try:
            model, tok = models.load_model(model_path, device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                                           check=sampler.self_check)
            chat_pieces(tok)  # a chat template the rollout cannot extend is refused here, before any episode
        except (ValueError, FileNotFoundError, OSError) as e:
            raise ValueError(f"cannot load --model {args.model}: {' '.join(str(e).split())}") from e
    except (ValueError, ImportError) as e:
        print(f"eval.py: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    mode = "greedy" if args.greedy else f"T={args.temperature}"
    print(f"{args.model} on {presets} | {args.num_seeds} seeds from {args.val_seed} x {args.samples} samples, {mode}, "
          f"think={not args.no_think}, {args.max_new_tokens} tokens per turn | {device} {dtype} -> {args.out}")
    evaluate(model, tok, args, presets, played)


if __name__ == "__main__":
    main()
