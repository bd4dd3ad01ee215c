"""How an episode is played, in one place for train.py, eval.py, sft.py and bench.py: the environment registry (every
env file's presets, the short names, the env's scripted policies), the agent-loop flags with their defaults,
AgentSettings, the one object rollout() takes them in, built by agent_settings() from flag values and a preset, and
seen_boards() / unseen_seeds(), which tell seeds apart by the board they start on (eval.py --unseen, sft.py's held-out
demonstrations).

A new environment is one file plus one register() line at the end of this one. The file (env_cue.py is the
smallest) holds a class with reset(seed) -> text, step(action text) -> (text, reward, done, info with "success"),
render() and actions(); PRESETS, {name: dict(kwargs for the class, instruction, max_actions_per_traj, max_tokens,
and optionally max_turns / max_actions_per_turn / max_context)}; sft.py's demonstration policies,
solver_actions(env, k) (the solver's next k actions, or None) and random_actions(env, k, rng); print_statistics(env,
args), what `python env_<name>.py --random N` prints; and a two-line __main__ that hands the command line to play.py,
the terminal player of every env.
"""
from dataclasses import dataclass

import env_bandit
import env_countdown
import env_cue
import env_frozenlake
import env_sokoban
import env_webshop

ENV_CLASSES = {}  # preset name -> (env class, preset dict, env module)
SHORT_NAMES = {}  # short name -> the preset it stands for
# The agent loop's defaults, each declared once and merged in agent_settings() alone. FLAG_DEFAULTS: the agent-loop
# flags' values when not given (train.py, eval.py, sft.py; the help reads its numbers from here). A None budget is
# filled per preset: max_actions_per_traj from the preset; those of AGENT_DEFAULTS from the preset where it sets them
# (RAGEN's env configs, e.g. WebShop's max_context), else from AGENT_DEFAULTS.
AGENT_DEFAULTS = dict(max_turns=5, max_actions_per_turn=5, max_context=3600)
FLAG_DEFAULTS = dict(max_turns=None, max_actions_per_turn=None, max_actions_per_traj=None, max_new_tokens=400,
                     max_context=None, no_think=False, format_penalty=-0.1, context_window_mode="full",
                     max_context_window=-1, no_stop_at_answer=False, temperature=1.0, top_p=1.0, no_kv_reuse=False,
                     no_prefix_sharing=False)


def register(cls, module, short=None, preset=None):
    """Add an environment: every preset of module.PRESETS, played with env class cls, and `short` as a short name
    of one of them, `preset`."""
    if short is not None and preset not in module.PRESETS:
        raise ValueError(f"short name {short!r}: {module.__name__} has no preset {preset!r}")
    for name, p in module.PRESETS.items():
        ENV_CLASSES[name] = (cls, p, module)
    if short is not None:
        SHORT_NAMES[short] = preset


def preset_name(name):
    """'sokoban' -> 'SimpleSokoban'; preset names are matched case-insensitively. ValueError for an unknown one."""
    name = SHORT_NAMES.get(name.lower(), name)
    for known in ENV_CLASSES:
        if known.lower() == name.lower():
            return known
    raise ValueError(f"unknown env or preset {name!r}; choose from {sorted(SHORT_NAMES)} or {sorted(ENV_CLASSES)}")


def add_agent_flags(p, defaults=FLAG_DEFAULTS, from_run=False, sampling=True):
    """The agent-loop flags on p (an argparse parser or group), defaults from `defaults`. from_run (eval.py): every
    default None, for a run directory's args.json and then `defaults` to fill, and --think to undo a run's
    --no-think. sampling=False (sft.py, whose turns are written, not sampled): no sampler flags."""
    def add(flag, help, **kw):
        default = defaults[flag[2:].replace("-", "_")]
        if from_run:  # the help says what fills it
            help += f" (a run directory: its own{'' if default in (None, False) else f'; else {default}'})"
        p.add_argument(flag, default=None if from_run else default, help=help, **kw)
    budget = lambda k: f"default {AGENT_DEFAULTS[k]}, or the preset's, e.g. {preset_values(k)}"
    add("--max-turns", f"turns per episode (agent_proxy.max_turn; {budget('max_turns')})", type=int)
    add("--max-actions-per-turn", f"actions kept per turn ({budget('max_actions_per_turn')})", type=int)
    add("--max-actions-per-traj", f"action budget per episode (default: the preset's, e.g. "
        f"{preset_values('max_actions_per_traj')})", type=int)
    add("--max-new-tokens", "response tokens per turn (rollout.response_length)", type=int)
    add("--max-context", f"longest conversation in tokens, longer episodes end as truncated ({budget('max_context')})",
        type=int)
    add("--no-think", "answer-only mode: force <answer> instead of <think> (enable_think=False)", action="store_true")
    if from_run:
        p.add_argument("--think", dest="no_think", action="store_false", help="thinking on, overriding a run's --no-think")
    add("--format-penalty", "added to the score once per malformed turn", type=float)
    add("--context-window-mode", "full: one training row per episode; limited_multi_turn / single_turn: one row per "
        "turn (RAGEN-2)", choices=["full", "limited_multi_turn", "single_turn"])
    add("--max-context-window", "show only the last k turns in the prompt (-1 = all)", type=int)
    add("--no-stop-at-answer", "let a turn run past its closing </answer> tag to a stop token or the token budget, "
        "training and showing what follows (the cut is RAGEN's; this keeps the uncut turn for comparison)",
        action="store_true")
    if sampling:
        add("--temperature", "sampling temperature (train.py: also the log-probs')", type=float)
        add("--top-p", "nucleus sampling", type=float)
        add("--no-kv-reuse", "re-prefill the whole conversation every turn (reference path)", action="store_true")
        add("--no-prefix-sharing", "compute every row's prompt in full, also the prefixes rows share (reference "
            "path): in the rollout's prefill (train/<env>/prefill_saved counts what sharing saves) and in train.py's "
            "old log-prob, value and update passes", action="store_true")


def preset_values(key):
    """What the presets set `key` to, for the flags' help: each value other than AGENT_DEFAULTS' once, with the first
    preset that sets it."""
    first = {}
    for name, (_, p, _) in ENV_CLASSES.items():
        if key in p and p[key] != AGENT_DEFAULTS.get(key):
            first.setdefault(p[key], name)
    return ", ".join(f"{name} {v}" for v, name in first.items())


@dataclass(frozen=True)
class AgentSettings:
    """How rollout() plays the episodes of one preset: its one settings argument, built by agent_settings() (no field has
    a default here: they come from FLAG_DEFAULTS, AGENT_DEFAULTS and the preset). The class lives with its builder and
    the defaults; rollout.py reads the fields and imports nothing of this file (it takes the envs as objects and knows
    no registry), so one definition serves both without rollout.py depending on every env file."""
    preset: dict                # the preset's dict, its max_actions_per_traj from --max-actions-per-traj
    max_turns: int
    max_actions_per_turn: int   # actions kept per turn, the first ones
    max_new_tokens: int         # sampled tokens per turn
    max_context: int            # tokens a conversation may hold; an episode whose next turn would not fit ends truncated
    think: bool                 # think-then-answer turns, else answer-only (--no-think)
    temperature: float          # the sampling temperature; rollout()'s temperature argument overrides it for one call
    top_p: float
    format_penalty: float       # added to the score once per malformed turn
    kv_reuse: bool              # keep the KV cache across turns (False: re-prefill every turn, the reference path)
    share_prefixes: bool        # prefill a prompt prefix rows share once
    stop_at_answer: bool        # a turn ends at its closing tag (RAGEN's cut)
    window: int                 # show only the last k turns (-1: all)
    window_mode: str            # full | limited_multi_turn | single_turn
    sample_seed: int            # the sampling keys' seed


def agent_settings(preset, flags, sample_seed=None, **fields):
    """The AgentSettings of `preset` (a preset name, or a preset dict: an env outside the registry, as the tests' own)
    from the agent flags' values `flags` (a dict, e.g. vars(args) or a run's args.json; a flag it lacks takes
    FLAG_DEFAULTS): the preset with --max-actions-per-traj, the turn / action / context budgets (None: the preset's,
    else AGENT_DEFAULTS), the token budget, think mode, temperature, top-p, format penalty, KV reuse, prefix sharing,
    the cut at the closing tag and the context window. sample_seed: the sampling keys' seed (default
    flags["sample_seed"]: eval.py's --sample-seed). fields: settings given as they are, over what the flags say (a
    test's or a benchmark's own budgets)."""
    a = dict(FLAG_DEFAULTS, **flags)
    preset = ENV_CLASSES[preset][1] if isinstance(preset, str) else preset
    budget = {k: a[k] if a[k] is not None else preset.get(k, v) for k, v in AGENT_DEFAULTS.items()}
    s = dict(preset=dict(preset, max_actions_per_traj=a["max_actions_per_traj"] or preset["max_actions_per_traj"]),
             **budget, max_new_tokens=a["max_new_tokens"], think=not a["no_think"], temperature=a["temperature"],
             top_p=a["top_p"], format_penalty=a["format_penalty"], kv_reuse=not a["no_kv_reuse"],
             share_prefixes=not a["no_prefix_sharing"], stop_at_answer=not a["no_stop_at_answer"],
             window=a["max_context_window"], window_mode=a["context_window_mode"],
             sample_seed=a["sample_seed"] if sample_seed is None else sample_seed)
    return AgentSettings(**dict(s, **fields))


def board(preset_key, observation):
    """The situation an observation shows, as text: the env file's board(text) where it has one (FrozenLake's Coord
    presets drop their Start line, which no move depends on), else the observation itself. Two observations with the
    same board ask for the same play, so a judge seed is unseen only if no training episode showed its board."""
    module = ENV_CLASSES[preset_key][2]
    return module.board(observation) if hasattr(module, "board") else observation


def seen_boards(preset_key, seeds):
    """The boards episodes of preset_key from `seeds` start on: the set of board() of their first observations,
    reset(seed)'s text with the env's defaults (small grids repeat across seeds, so two seeds may show one board)."""
    cls, preset, _ = ENV_CLASSES[preset_key]
    env = cls(**preset["kwargs"])
    return {board(preset_key, env.reset(s)) for s in seeds}


def unseen_seeds(preset_key, seeds, seen, n=None):
    """The seeds of `seeds`, in order, whose first board (as seen_boards) is not in `seen`; with n, the first n of
    them (fewer if `seeds` runs out)."""
    cls, preset, _ = ENV_CLASSES[preset_key]
    env, kept = cls(**preset["kwargs"]), []
    for s in seeds:
        if n is not None and len(kept) == n:
            break
        if board(preset_key, env.reset(s)) not in seen:
            kept.append(s)
    return kept


# the registry: one line per environment file (class, file, and optionally a short name and the preset it picks)
register(env_bandit.BanditEnv, env_bandit, "bandit", "Bandit")
register(env_sokoban.SokobanEnv, env_sokoban, "sokoban", "SimpleSokoban")
register(env_frozenlake.FrozenLakeEnv, env_frozenlake, "frozenlake", "FrozenLake")
register(env_webshop.WebShopEnv, env_webshop, "webshop", "WebShop")
register(env_countdown.CountdownEnv, env_countdown, "countdown", "Countdown")
register(env_cue.CueEnv, env_cue)
