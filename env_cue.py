"""Cue: a tiny diagnostic task for the learning tests (test_all.py) and the README's demo, not a RAGEN environment.

The first state shows a cue letter, repeated ("cue QQQ..."); the right first answer is that letter, one of
`letters`. The cue is drawn uniformly from the seed, so a policy that ignores the state cannot beat
1 / len(letters): only an observation-conditioned policy can. One-letter answers let a random-init byte-level
model learn it in seconds on a CPU. Cue and CueDelay use Q and Z, letters no other part of the prompt contains, and
show the cue `repeat` = 32 times: a 2-layer random model starts out attending almost uniformly over the
~300-token prompt, and 32 copies give the cue a share of that average that it learns to read within about 100
SFT steps.
  Cue       one turn: reward 1 if the answer is the cue letter, else 0; the episode ends on the first valid answer.
  CueDelay  two turns: the cue is shown only at turn 1; the next state is "wait" and its one valid answer is
            "go". The only reward comes with "go" and is 1 if the turn-1 answer was the cue letter: credit for
            the last turn's reward has to travel back to turn 1.
  CueAM, CueNZ  one turn, the cue shown once ("cue K"), 13 letters each (A-M, N-Z): the README's demo (sft.py
            --demo, then train.py --demo) trains a pretrained model on A-M and validates on both.
Actions are matched case-insensitively after stripping spaces; anything else is an invalid no-op.
Randomness: random.Random(seed) at reset draws the cue; nothing else is random.

  python env_cue.py --preset CueDelay              # play in the terminal
  python env_cue.py --preset Cue --random 2000     # random-policy success over many seeds
"""
import random

CUE_INSTRUCTION = "Answer the cue letter, then go.\n"


def cue_preset(turns, letters="QZ", repeat=32):
    return dict(kwargs=dict(letters=letters, turns=turns, repeat=repeat), instruction=CUE_INSTRUCTION,
                max_actions_per_traj=turns, max_tokens=4, max_turns=turns, max_actions_per_turn=1)


PRESETS = {
    "Cue": cue_preset(1),
    "CueDelay": cue_preset(2),
    # the README's demo, for a pretrained model (the cue shown once): it trains on A-M and validates on both, so on
    "CueAM": cue_preset(1, "ABCDEFGHIJKLM", repeat=1),  # letters it never answers in training too
    "CueNZ": cue_preset(1, "NOPQRSTUVWXYZ", repeat=1),
}


class CueEnv:
    def __init__(self, letters="QZ", turns=1, repeat=32):
        if len(set(letters)) < 2 or not all(c.isalpha() and c.isupper() for c in letters):
            raise ValueError(f"letters must be at least 2 distinct capital letters, got {letters!r}")
        if not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an int >= 1, got {turns!r}")
        if not isinstance(repeat, int) or repeat < 1:
            raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
        self.letters, self.turns, self.repeat = letters, turns, repeat
        self.cue, self.obs = None, None

    def reset(self, seed):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.cue = random.Random(seed).choice(self.letters)
        self.turn, self.pick, self.done, self.success = 1, None, False, False
        self.obs = "cue " + self.cue * self.repeat
        return self.obs

    def render(self):
        if self.obs is None:
            raise RuntimeError("call reset(seed) first")
        return self.obs

    def actions(self):
        if self.obs is None:
            raise RuntimeError("call reset(seed) first")
        return list(self.letters) if self.turn == 1 else ["go"]

    def step(self, action):
        answer = action.strip().lower() if isinstance(action, str) else None
        if self.done or answer not in [a.lower() for a in self.actions()]:  # invalid: nothing happens
            return self.obs, 0.0, self.done, dict(action_is_valid=False, action_is_effective=False, success=self.success)
        if self.turn == 1:
            self.pick = answer.upper()
        self.done = self.turn == self.turns
        self.success = self.done and self.pick == self.cue
        self.turn += 1
        self.obs = f"{self.pick}: {float(self.success)} points" if self.done else "wait"
        return self.obs, float(self.success), self.done, dict(action_is_valid=True, action_is_effective=True,
                                                                 success=self.success)


def solver_actions(env, k):
    """sft.py's solver: the right answer of the current turn, the cue at turn 1, then go (one action a turn, any k)."""
    return env.actions()[:1] if env.turn > 1 else [env.cue]


def random_actions(env, k, rng):
    """sft.py's random policy: k valid answers drawn uniformly (turn 1: any of the letters)."""
    return [rng.choice(env.actions()) for _ in range(k)]


def print_statistics(env, args):
    """python env_cue.py --random N (play.py): the random policy's success over N seeds from --seed. False without
    --random."""
    if not args.random:
        return False
    wins = 0
    for seed in range(args.seed, args.seed + args.random):
        env.reset(seed)
        rng = random.Random(seed + 1_000_003)  # not the env's own draw
        while not env.done:
            info = env.step(random_actions(env, 1, rng)[0])[3]
        wins += info["success"]
    print(f"{args.preset}: {args.random} seeds from {args.seed}; random policy success {wins / args.random:.3f}")
    return True


if __name__ == "__main__":  # play in the terminal, or --random N: statistics (play.py)
    import play
    play.main(CueEnv)
