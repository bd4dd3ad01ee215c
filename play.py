"""The terminal player of every environment: `python env_<name>.py` plays one episode the way the model plays it
(reset from a seed, read an action, step, show what came back), or prints the env's statistics over many seeds.

    python env_sokoban.py --preset SimpleSokoban --seed 3       # play: type Up, Down, Left or Right; q stops
    python env_sokoban.py --random 200 --seed 10000             # the env's statistics over 200 seeds instead

Each env file's __main__ is two lines, `import play` and `play.main(TheEnvClass)`, and the env file provides, besides
the class: PRESETS (the --preset choices; the first is the default), solver_actions(env, k) (shown when a player
stops early) and print_statistics(env, args) (what --random N prints; False when no statistics flag was given, and the
episode is played). An env with flags of its own defines add_flags(parser) (env_webshop.py: the catalog, the goal
split, the oracle); a flag named after a parameter of the class goes to its constructor over the preset's kwargs,
one named after a parameter of reset() goes to reset. Torch-free like the envs, and imported only from their
__main__, so importing an env stays light.
"""
import argparse
import inspect
import sys


def play(env, seed, reset_kw=None, solver=None, read=input):
    """One episode in the terminal: reset(seed, **reset_kw) and show the observation; then read an action (read:
    input, or a test's lines), step, and show the observation, reward, total, done and info, until the episode
    ends. The prompt lists env.actions() where the env has a set of them (Sokoban's moves, Cue's letters, WebShop's
    search and clicks), else asks for free text (Countdown's expression). q (where it is no action: Cue's letters
    include Q) or the end of input stops early and shows solver(env), the env's solver from there, if it has a plan.
    Returns (total reward, success)."""
    print(env.reset(seed, **(reset_kw or {})))
    total, done, info = 0.0, False, {}
    while not done:
        actions = env.actions()
        stop = "q" if "q" not in [a.lower() for a in actions or []] else None  # None: only the end of input stops
        how = f"{'q' if stop else 'end of input'} stops"
        try:
            action = read(f"action ({', '.join(actions)}; {how}): " if actions else f"answer (free text; {how}): ")
        except EOFError:
            action = None
        if action is None or action.strip().lower() == stop:
            plan = solver(env) if solver is not None else None
            if plan:
                print(f"the solver from here: {' || '.join(plan)}")
            break
        obs, reward, done, info = env.step(action)
        total += reward
        print(f"{obs}\nreward {reward} (total {total}) done {done} {info}")
    return total, bool(info.get("success", False))


def main(cls, argv=None, read=input):
    """The command line of cls's env file (argv: default sys.argv[1:]): --preset, --seed, --random N and the file's
    own flags. Returns play()'s (total reward, success), or None when the file's statistics ran instead."""
    module = sys.modules[cls.__module__]  # the env file ("__main__" when run as a script)
    p = argparse.ArgumentParser(description=(module.__doc__ or "").strip().split("\n")[0])
    p.add_argument("--preset", default=next(iter(module.PRESETS)), choices=list(module.PRESETS), help="the preset")
    p.add_argument("--seed", type=int, default=0, help="episode seed (the first seed of the statistics)")
    p.add_argument("--random", type=int, default=0, metavar="N", help="statistics over N seeds instead of play")
    if hasattr(module, "add_flags"):
        module.add_flags(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    given = lambda fn: {k: v for k, v in vars(args).items() if k in inspect.signature(fn).parameters and k != "seed"
                        and v is not None}
    preset = module.PRESETS[args.preset]
    env = cls(**dict(preset["kwargs"], **given(cls)))
    if module.print_statistics(env, args):
        return None
    if preset["instruction"]:
        print(preset["instruction"])
    return play(env, args.seed, given(cls.reset), lambda e: module.solver_actions(e, sys.maxsize), read)  # its whole plan
