"""FrozenLake as RAGEN plays it (ragen/env/frozen_lake on gymnasium's toy_text FrozenLake), without gym.

A random 4x4 lake: each tile is frozen with probability p (else a hole; RAGEN v1 0.8, RAGEN-2 0.9),
start and goal are random distinct tiles, and the map is redrawn until a 4-connected path joins them.
The ice is slippery: the player moves in the intended direction with probability success_rate (RAGEN
v1 1/3, RAGEN-2's CoordFrozenLake 0.8, RAGEN-2's main table 1, a deterministic lake) and else in one
of the two perpendicular ones, half of the rest each; bumping into the edge means staying put. The
episode ends in a hole (reward 0) or on the goal (+1).
Randomness: the map comes from gymnasium's seeding.np_random(seed) (a numpy Generator), the slips
from a second Generator with the same seed, of which reset draws one number (gymnasium samples
the start state with it), so a seed gives RAGEN's map and RAGEN's slips.

  python env_frozenlake.py --seed 3         # play in the terminal
  python env_frozenlake.py --random 1000    # random-policy success rate
  python env_frozenlake.py --preset CoordFrozenLake --seed 3   # RAGEN-2's coordinate observation
"""
import random

import numpy as np

ACTIONS = ["Left", "Down", "Right", "Up"]     # RAGEN action_lookup 1..4 -> gymnasium actions 0..3
MOVES = [(0, -1), (1, 0), (0, 1), (-1, 0)]    # gymnasium LEFT, DOWN, RIGHT, UP
# RAGEN grid_lookup / grid_vocab: the start tile is drawn as plain ice
LEGEND = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "√": "player on goal"}

FROZENLAKE_INSTRUCTION = (  # config/envs.yaml FrozenLake env_instruction, typos included
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go "
    "to the target, I should go left then go up.</think><answer>Left || Up</answer>")


def make_instruction(text, max_actions):
    # ragen/llm_agent/ctx_manager.py: env_instruction + symbol legend + action list + action budget
    return (text + "\nThe meaning of each symbol in the state is:\n"
            + ", ".join(f"{k}: {v}" for k, v in LEGEND.items())
            + "\nYour available actions are:\n" + ", ".join(ACTIONS)
            + f'\nYou can make up to {max_actions} actions, separated by the action separator " || "\n')


COORD_INSTRUCTION = (  # RAGEN-2 config/envs.yaml CoordFrozenLake env_instruction, a YAML block ("(5, 5)" as there)
    "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed coordinates "
    "for the start, goal, player, and any holes.\nCoordinates range from the top-left corner (0, 0) to the "
    "bottom-right corner (5, 5).\nBeware that the ice is slippery, so the agent might slide and end up in an "
    "unintended tile.\nRespond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n")


PRESETS = {  # RAGEN v1 envs.yaml FrozenLake: env_config null = v1's FrozenLakeEnvConfig defaults (p 0.8, 1/3 slips)
    "FrozenLake": dict(kwargs=dict(size=4, p=0.8, is_slippery=True),
                       instruction=make_instruction(FROZENLAKE_INSTRUCTION, 10), max_actions_per_traj=10, max_tokens=100),
    # RAGEN-2 tags: RAGEN-2's lakes (FrozenLakeEnvConfig's p 0.9; the tag's success_rate 0.8), and RAGEN-2 base.yaml's
    # agent loop (5 turns, at most 2 actions a turn). The legend is shown: the tags set observation_format under
    # env_config, and RAGEN-2's ctx_manager reads the tag's top-level value, FrozenLakeEnvConfig's default "grid".
    # RAGEN-2 puts the instruction in the system message.
    "CoordFrozenLake": dict(kwargs=dict(observation_format="grid_coord", p=0.9, success_rate=0.8, ragen2_map=True),
                            instruction=make_instruction(COORD_INSTRUCTION, 10), instruction_in_system=True,
                            max_actions_per_traj=10, max_tokens=120, max_turns=5, max_actions_per_turn=2),
    # _3_frozen_lake.yaml (RAGEN-2's main table): CoordFrozenLake with success_rate 1, i.e. no slips
    "CoordFrozenLakeDet": dict(kwargs=dict(observation_format="grid_coord", p=0.9, success_rate=1.0, ragen2_map=True),
                               instruction=make_instruction(COORD_INSTRUCTION, 10), instruction_in_system=True,
                               max_actions_per_traj=10, max_tokens=120, max_turns=5, max_actions_per_turn=2),
}


def has_path(desc, start):
    """Is the goal reachable from start without crossing a hole (4-connected)?"""
    size, seen, todo = len(desc), {start}, [start]
    while todo:
        r, c = todo.pop()
        if desc[r][c] == "G":
            return True
        for dr, dc in MOVES:
            q = (r + dr, c + dc)
            if 0 <= q[0] < size and 0 <= q[1] < size and q not in seen and desc[q[0]][q[1]] != "H":
                seen.add(q)
                todo.append(q)
    return False


def shortest_path(desc, start):
    """Breadth-first search from start to the goal around the holes: the intended moves (slips ignored) as action
    names, [] when start is the goal, None when no path exists. A player on a hole has no path."""
    size, parent, todo = len(desc), {start: None}, [start]
    for p in todo:  # todo grows while it is read: a FIFO queue
        if desc[p[0]][p[1]] == "G":
            path = []
            while parent[p] is not None:
                p, a = parent[p]
                path.append(ACTIONS[a])
            return path[::-1]
        if desc[p[0]][p[1]] == "H":
            continue
        for a, (dr, dc) in enumerate(MOVES):
            q = (p[0] + dr, p[1] + dc)
            if 0 <= q[0] < size and 0 <= q[1] < size and q not in parent:
                parent[q] = (p, a)
                todo.append(q)
    return None


def generate_map(size, p, seed, ragen2=False):
    """RAGEN generate_random_map (ragen/env/frozen_lake/utils.py): rows of S/F/H/G, redrawn until solvable.
    ragen2: RAGEN-2's version, which draws a new board (not just new cells) when start and goal coincide."""
    rng = np.random.default_rng(seed)  # = gymnasium seeding.np_random(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        while True:  # start and goal: uniform, distinct
            start = (int(rng.integers(0, size)), int(rng.integers(0, size)))
            goal = (int(rng.integers(0, size)), int(rng.integers(0, size)))
            if start != goal or ragen2:
                break
        if start == goal:
            continue
        board[start], board[goal] = "S", "G"
        desc = ["".join(row) for row in board]
        if has_path(desc, start):
            return desc


class FrozenLakeEnv:
    def __init__(self, size=4, p=0.8, is_slippery=True, success_rate=1 / 3, observation_format="grid",
                 ragen2_map=False):
        if size < 2 or not 0 < p <= 1 or not 0 <= success_rate <= 1 \
                or observation_format not in ("grid", "grid_coord"):
            raise ValueError(f"need size >= 2, 0 < p <= 1, 0 <= success_rate <= 1, observation_format grid or "
                             f"grid_coord; got {size}, {p}, {success_rate}, {observation_format!r}")
        self.size, self.p, self.is_slippery, self.success_rate = size, p, is_slippery, success_rate
        self.observation_format, self.ragen2_map, self.desc = observation_format, ragen2_map, None

    def reset(self, seed):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.desc = generate_map(self.size, self.p, seed, self.ragen2_map)
        self.rng = np.random.default_rng(seed)  # gymnasium reset(seed) seeds the slip generator ...
        self.rng.random()                       # ... and spends one draw on the (single) start tile
        self.pos = next((r, row.index("S")) for r, row in enumerate(self.desc) if "S" in row)
        self.done = False
        return self.render()

    def load(self, text):
        """Start an episode from a lake given as text (tests, hand-made maps); slips use seed 0."""
        rows = text.strip("\n").split("\n")
        if len(rows) < 2 or any(len(row) != len(rows) or set(row) - set(LEGEND) for row in rows) \
                or sum(row.count(g) for row in rows for g in "PX√") != 1:
            raise ValueError(f"a lake is a square of {''.join(LEGEND)} with one player, got:\n{text}")
        self.pos = next((r, c) for r, row in enumerate(rows) for c, g in enumerate(row) if g in "PX√")
        tile = {"_": "F", "P": "F", "O": "H", "X": "H", "√": "G", "G": "G"}
        self.desc = ["".join(tile[g] for g in row) for row in rows]
        self.rng, self.done = np.random.default_rng(0), self.desc[self.pos[0]][self.pos[1]] in "GH"
        return self.render()

    def render(self):
        if self.desc is None:
            raise RuntimeError("call reset(seed) first")
        tile = {"S": "_", "F": "_", "H": "O", "G": "G"}
        grid = [[tile[t] for t in row] for row in self.desc]
        r, c = self.pos
        grid[r][c] = {"H": "X", "G": "√"}.get(self.desc[r][c], "P")
        text = "\n".join("".join(row) for row in grid)
        if self.observation_format == "grid":
            return text
        # RAGEN-2 frozen_lake/utils.py format_coordinate_render, entities in this order, empty ones left out
        at = lambda t: [(i, j) for i, row in enumerate(self.desc) for j, ch in enumerate(row) if ch == t]
        player = {"G": "Player on goal", "H": "Player in hole"}.get(self.desc[r][c], "Player")
        lines = [f"Board size: {self.size} rows x {self.size} cols (zero-indexed)."]
        for label, cells in (("Start", at("S")), ("Goal", at("G")), (player, [(r, c)]), ("Holes", at("H"))):
            if cells:
                lines.append(f"{label}: " + ", ".join(f"({i}, {j})" for i, j in cells))
        return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + text

    def actions(self):
        return list(ACTIONS)

    def step(self, action):
        if self.desc is None:
            raise RuntimeError("call reset(seed) first")
        name = action.strip().capitalize() if isinstance(action, str) else None
        if self.done or name not in ACTIONS:  # invalid: nothing happens
            info = dict(action_is_valid=False, action_is_effective=False, success=self._on("G"))
            return self.render(), 0, self.done, info
        a = ACTIONS.index(name)
        if self.is_slippery:  # gymnasium: outcomes [(a-1)%4, a, (a+1)%4] with probabilities [f, s, f],
            u = self.rng.random()  # f = (1 - s) / 2, picked by cumsum > uniform (one draw even when s = 1)
            fail = (1 - self.success_rate) / 2
            a = (a - 1) % 4 if u < fail else a if u < fail + self.success_rate else (a + 1) % 4
        old, n = self.pos, len(self.desc)
        r = min(max(old[0] + MOVES[a][0], 0), n - 1)  # the edge keeps you in place
        c = min(max(old[1] + MOVES[a][1], 0), n - 1)
        self.pos = (r, c)
        self.done = self._on("G") or self._on("H")
        reward = 1 if self._on("G") else 0  # gymnasium >= 1.2.1: ints from reward_schedule (1, 0, 0)
        return self.render(), reward, self.done, dict(action_is_valid=True, action_is_effective=self.pos != old,
                                                      success=self._on("G"))

    def _on(self, tile):
        return self.desc[self.pos[0]][self.pos[1]] == tile


def solver_actions(env, k):
    """sft.py's solver: the first k moves of a shortest path to the goal, slips ignored (None: no path)."""
    plan = shortest_path(env.desc, env.pos)
    return plan[:k] if plan else None


def random_actions(env, k, rng):
    """k moves drawn uniformly."""
    return [rng.choice(env.actions()) for _ in range(k)]


def board(observation):
    """What an observation shows that play depends on (eval.py --unseen compares these): the text without the Coord
    presets' "Start:" line. Where an episode began changes no move, so a lake with the player on a cell is one
    situation whatever cell the player started from."""
    return "\n".join(line for line in observation.split("\n") if not line.startswith("Start:"))


def print_statistics(env, args):
    """python env_frozenlake.py --random N (play.py): over N seeds from --seed, the random policy's success within
    the preset's action budget and how often it fell in a hole. False without --random."""
    if not args.random:
        return False
    budget, wins, holes = PRESETS[args.preset]["max_actions_per_traj"], 0, 0
    for seed in range(args.seed, args.seed + args.random):
        env.reset(seed)
        policy = random.Random(seed)
        for _ in range(budget):
            _, _, done, info = env.step(policy.choice(ACTIONS))
            if done:
                break
        wins, holes = wins + info["success"], holes + env._on("H")
    print(f"{args.preset}: {args.random} seeds from {args.seed}; random policy ({budget} actions): "
          f"success {wins / args.random:.3f}, fell in a hole {holes / args.random:.3f}")
    return True


if __name__ == "__main__":  # play in the terminal, or --random N: statistics (play.py)
    import play
    play.main(FrozenLakeEnv)
