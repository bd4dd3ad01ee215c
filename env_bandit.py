"""Two-armed bandit with symbolic arm names (ragen/env/bandit), the StarPO paper's single-turn test.

One arm is low risk (always pays 0.1), the other high risk (pays 1.0 with probability 0.25, else 0):
the high-risk arm is better on average but loses 3 pulls out of 4. The model only sees the names,
so it has to reason from what "Dragon" or "Phoenix" suggests. One pull ends the episode.
Randomness: gymnasium's np_random seeded at reset (a numpy Generator from the seed); it decides
the order the names are shown in, then the high arm's payout. Same seed + same answer = same reward.
RAGEN-2's presets (Bandit2, Bandit2Test) first draw the name pair from a pool, and give each member
of a group its own generator (reset(seed, member)), so the members of a group play different games.

  python env_bandit.py --preset Bandit              # play in the terminal
  python env_bandit.py --preset Bandit --random 2000  # random-policy success and payout means
  python env_bandit.py --preset Bandit2 --seed 3      # RAGEN-2's: a name pair drawn from its pool
"""
import random

import numpy as np

# ragen/env/bandit/env.py INIT_PROMPT; three lines end with a space, as in RAGEN
INIT_PROMPT = """You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. 
Game Rules: 
1. There are 2 arms, named {name_a} and {name_b}
2. Each arm has its own reward distribution, related to their names. 
3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.
4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> or <answer> {name_b} </answer>.
"""


def bandit_preset(lo, hi):
    # RAGEN builds no legend or action list for the bandit (its action names are only known after
    # reset), so the prompt prefix is empty and the whole game text is the observation
    # config/_1_bandit.yaml: one turn with one action
    return dict(kwargs=dict(lo_arm_name=lo, hi_arm_name=hi), instruction="", max_actions_per_traj=1,
                max_tokens=100, max_turns=1, max_actions_per_turn=1)


ARM_PAIRS = {  # RAGEN-2 ragen/env/bandit/config.py ARM_NAMES: (low-risk, high-risk) names, one pair drawn per episode
    "train": [("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
              ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
              ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
              ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer")],
    "test": [("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
             ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
             ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator")],
}


def bandit2_preset(split):
    # RAGEN-2's Bandit / BanditTest tags (config/envs.yaml split train / test; _1_bandit.yaml's one turn, one
    # action): each episode draws its pair from the split's pool, and each member of a group resets from its own
    # seed (seed_per_member: rollout passes the member index), so a group's members differ in names, order and
    # payout. The instruction is empty, so the system message is "You're a helpful assistant. " as in v1.
    return dict(kwargs=dict(pairs=ARM_PAIRS[split]), instruction="", instruction_in_system=True, seed_per_member=True,
                max_actions_per_traj=1, max_tokens=100, max_turns=1, max_actions_per_turn=1)


PRESETS = {
    "Bandit": bandit_preset("Phoenix", "Dragon"),       # config/envs.yaml Bandit (paper Fig. 3)
    "BanditTest": bandit_preset("Trader", "Librarian"),  # config/envs.yaml BanditTest (val of _1_bandit.yaml)
    # The paper's generalisation pair (§4.4, "train on Teacher/Engineer, test on Librarian/Trader"), as
    # RAGEN's train_all.sh runs it by overriding the Bandit names: the "generalization" run ...
    "BanditGen": bandit_preset("Engineer", "Teacher"),
    "BanditGenTest": bandit_preset("Trader", "Librarian"),
    # ... and the "rev" run, which swaps which name of each pair is the risky one. (The paper's
    # Bandit-Rev example "Librarian = high-risk" matches the script's non-rev run: the naming in
    # script and paper disagree.)
    "BanditRev": bandit_preset("Teacher", "Engineer"),
    "BanditRevTest": bandit_preset("Librarian", "Trader"),
    # RAGEN-2's Bandit and BanditTest (its _1_bandit.yaml trains on the first, validates on both)
    "Bandit2": bandit2_preset("train"),
    "Bandit2Test": bandit2_preset("test"),
}


class BanditEnv:
    def __init__(self, lo_arm_name="Phoenix", hi_arm_name="Dragon", lo_arm_score=0.1, hi_arm_hiscore=1.0,
                 hi_arm_loscore=0.0, hi_arm_hiscore_prob=0.25, pairs=None):
        """pairs (RAGEN-2): (low-risk, high-risk) name pairs; each reset draws one, in place of lo/hi_arm_name."""
        if pairs is not None and not pairs:
            raise ValueError("pairs must hold at least one (low-risk, high-risk) name pair")
        for lo, hi in pairs or [(lo_arm_name, hi_arm_name)]:
            if not lo.strip() or not hi.strip() or lo.strip().lower() == hi.strip().lower():
                raise ValueError(f"arm names must be non-empty and differ: {lo!r}, {hi!r}")
        self.lo_arm_name, self.hi_arm_name, self.pairs = lo_arm_name, hi_arm_name, pairs
        self.lo_arm_score, self.hi_arm_hiscore = lo_arm_score, hi_arm_hiscore
        self.hi_arm_loscore, self.hi_arm_hiscore_prob = hi_arm_loscore, hi_arm_hiscore_prob
        self.names, self.obs = None, None

    def reset(self, seed, member=None):
        """member (RAGEN-2's presets): the episode's index in its group. Its generator is then the member-th child
        of the group seed's SeedSequence (= SeedSequence(seed).spawn(member + 1)[member]): the members of a group
        differ, and a group is reproducible from its seed. None: the seed's own generator (RAGEN v1: one per group)."""
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if member is not None and (not isinstance(member, int) or member < 0):
            raise ValueError(f"member must be None or a non-negative int, got {member!r}")
        # = gymnasium seeding.np_random(seed). RAGEN-2 seeds with seed + a count of the BanditEnv objects its process
        # built before this one, which depends on how many envs were built where, so its draws are not reproduced
        self.rng = np.random.default_rng(seed if member is None else np.random.SeedSequence(seed, spawn_key=(member,)))
        if self.pairs is not None:  # RAGEN-2 reset: the pair first
            self.lo_arm_name, self.hi_arm_name = self.pairs[int(self.rng.random() * len(self.pairs))]
        # RAGEN _randomize_arms: with probability 1/2 the low arm is shown first
        lo_first = self.rng.random() < 0.5
        self.names = [self.lo_arm_name, self.hi_arm_name] if lo_first else [self.hi_arm_name, self.lo_arm_name]
        self.obs = INIT_PROMPT.format(name_a=self.names[0], name_b=self.names[1])
        self.done, self.success = False, False
        return self.obs

    def render(self):
        if self.obs is None:
            raise RuntimeError("call reset(seed) first")
        return self.obs

    def actions(self):
        if self.names is None:
            raise RuntimeError("call reset(seed) first")
        return list(self.names)

    def step(self, action):
        # RAGEN es_manager maps the answer to an arm by case-insensitive exact name match
        answer = action.strip().lower() if isinstance(action, str) else None
        arm = next((name for name in self.actions() if name.lower() == answer), None)
        if self.done or arm is None:  # invalid: nothing happens
            info = dict(action_is_valid=False, action_is_effective=False, success=self.success)
            return self.obs, 0.0, self.done, info
        if arm == self.hi_arm_name:  # RAGEN _hi_arm_reward
            win = self.rng.random() < self.hi_arm_hiscore_prob
            reward = self.hi_arm_hiscore if win else self.hi_arm_loscore
        else:
            reward = self.lo_arm_score
        self.obs, self.done = f"{arm}: {reward} points", True
        self.success = arm == self.hi_arm_name
        # hi_arm_first: where the high arm was listed (a policy that names one position wins on half the games)
        info = dict(action_is_valid=True, action_is_effective=True, success=self.success,
                    hi_arm_first=float(self.names[0] == self.hi_arm_name))
        return self.obs, reward, True, info


def solver_actions(env, k):
    """sft.py's solver: the high-risk arm, the better one on average."""
    return [env.hi_arm_name]


def random_actions(env, k, rng):
    """k arms drawn uniformly."""
    return [rng.choice(env.actions()) for _ in range(k)]


def print_statistics(env, args):
    """python env_bandit.py --random N (play.py): over N seeds from --seed, the random policy's success and the mean
    payout of always pulling the low-risk arm, or the high-risk one. False without --random."""
    if not args.random:
        return False
    seeds = range(args.seed, args.seed + args.random)
    wins = 0
    for seed in seeds:  # a random policy picks either shown name with probability 1/2
        env.reset(seed)
        wins += env.step(random.Random(seed).choice(env.actions()))[3]["success"]
    # always pulling the low-risk arm, or always the high-risk one (named by the pair, or by risk when drawn)
    low, high = ("the low-risk arm", "the high-risk arm") if env.pairs else (env.lo_arm_name, env.hi_arm_name)
    payout = {low: 0.0, high: 0.0}
    for name in payout:
        for seed in seeds:
            env.reset(seed)
            payout[name] += env.step(env.lo_arm_name if name == low else env.hi_arm_name)[1] / len(seeds)
    print(f"{args.preset}: {args.random} seeds from {args.seed}; "
          f"random policy success {wins / len(seeds):.3f}; "
          + "; ".join(f"mean payout of {name} {mean:.4f}" for name, mean in payout.items()))
    return True


if __name__ == "__main__":  # play in the terminal, or --random N: statistics (play.py)
    import play
    play.main(BanditEnv)
