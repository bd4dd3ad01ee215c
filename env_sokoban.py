"""Sokoban as RAGEN plays it (ragen/env/sokoban on top of gym_sokoban 0.0.6), in plain Python.

A room is made the gym-sokoban way: a random walk stamps floor into a walled grid, the player and
the box targets are dropped on the floor with the boxes sitting on their targets, and a depth-first
search plays the game backwards (pulling boxes) to find the state that is hardest to undo; RAGEN
then jiggles the player a few cells. Playing forwards from there is always possible.
Randomness: Python `random` for the topology and the jiggle, NumPy's legacy global RNG for the
placement, both seeded with the reset seed (ragen/utils.py:all_seed). We use private generators
seeded the same way, so a seed gives the room RAGEN gives (seed 10000 is checked in the tests),
except when generation fails and reseeds (about 1 seed in 10 for LargerSokoban, none in 1000 for
6x6): RAGEN's new seed comes from Python's per-process string hash, ours from a fixed formula.

  python env_sokoban.py --preset SimpleSokoban --seed 3       # play in the terminal
  python env_sokoban.py --preset SimpleSokoban --random 500   # random-policy success, optimal lengths
  python env_sokoban.py --preset CoordSokoban --seed 3        # RAGEN-2's coordinate observation
"""
import random
import statistics
import time

import numpy as np

ACTIONS = ["Up", "Down", "Left", "Right"]   # RAGEN action_lookup 1..4 = gym_sokoban "push up/down/left/right"
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]   # gym_sokoban CHANGE_COORDINATES, same order
# cell codes (RAGEN grid_lookup 0..6): wall, empty, target, box on target, box, player, player on target
NAMES = ["wall", "empty", "target", "box on target", "box", "player", "player on target"]
GLYPHS = "#_O√XPS"           # U+221A for box on target, as RAGEN (the paper prints a check mark)
NEW_VOCAB_GLYPHS = "W.GCBA@"  # RAGEN tag SokobanDifferentGridVocab
WALL, FLOOR, TARGET = 0, 1, 2

SOKOBAN_INSTRUCTION = (  # config/envs.yaml, env_instruction of every Sokoban tag
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. You cannot push "
    "a box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>")


def make_instruction(text, glyphs, max_actions):
    # ragen/llm_agent/ctx_manager.py: env_instruction + symbol legend + action list + action budget
    legend = ", ".join(f"{g}: {n}" for g, n in zip(glyphs, NAMES))
    return (text + "\nThe meaning of each symbol in the state is:\n" + legend
            + "\nYour available actions are:\n" + ", ".join(ACTIONS)
            + f'\nYou can make up to {max_actions} actions, separated by the action separator " || "\n')


COORD_INSTRUCTION = (  # RAGEN-2 config/envs.yaml CoordSokoban env_instruction (a YAML block, trailing spaces kept)
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\nYou are "
    "provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). \nWhen you are exactly "
    "next to a box, you can push it by moving in the same direction. \nYou cannot push a box through a wall, and "
    "you cannot pull a box.\nThe answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n")


PRESETS = {  # RAGEN tags of config/envs.yaml
    # 6x6, 1 box; search_depth is SokobanEnvConfig's default 300 (the tag does not set it)
    "SimpleSokoban": dict(kwargs=dict(dim_room=(6, 6), num_boxes=1, max_steps=100, search_depth=300),
                          instruction=make_instruction(SOKOBAN_INSTRUCTION, GLYPHS, 10), max_actions_per_traj=10,
                          max_tokens=100),
    "LargerSokoban": dict(kwargs=dict(dim_room=(8, 8), num_boxes=2, max_steps=100, search_depth=10),
                          instruction=make_instruction(SOKOBAN_INSTRUCTION, GLYPHS, 10), max_actions_per_traj=10,
                          max_tokens=100),
    # RAGEN's SokobanDifferentGridVocab. Deliberate fix: RAGEN builds the legend from the default
    # config, so its prompt describes "# _ O √ X P S" while the grid shows "W . G C B A @"; our
    # legend describes the glyphs the grid really uses.
    "SokobanNewVocab": dict(kwargs=dict(dim_room=(6, 6), num_boxes=1, max_steps=100, search_depth=30,
                                        glyphs=NEW_VOCAB_GLYPHS),
                            instruction=make_instruction(SOKOBAN_INSTRUCTION, NEW_VOCAB_GLYPHS, 10),
                            max_actions_per_traj=10, max_tokens=100),
    # RAGEN-2's default tag (base.yaml trains and validates on it), with its agent loop: 5 turns, at most 2
    # actions a turn; search_depth is SokobanEnvConfig's default 300. The legend is shown: the tag sets
    # observation_format under env_config, and RAGEN-2's ctx_manager reads the tag's top-level value,
    # SokobanEnvConfig's default "grid". RAGEN-2 puts the instruction in the system message.
    "CoordSokoban": dict(kwargs=dict(dim_room=(6, 6), num_boxes=1, max_steps=100, search_depth=300,
                                     observation_format="grid_coord"),
                         instruction=make_instruction(COORD_INSTRUCTION, GLYPHS, 10), instruction_in_system=True,
                         max_actions_per_traj=10, max_tokens=120, max_turns=5, max_actions_per_turn=2),
}

# ----------------------------------------------------------------------------- room generation
# 3x3 floor stamps of the random walk, row by row (gym_sokoban room_utils.room_topology_generation):
# horizontal bar, vertical bar, and three corner shapes
MASKS = ["000111000", "010010010", "000110010", "000110110", "000011010"]
WALK_DIRECTIONS = [(1, 0), (0, 1), (-1, 0), (0, -1)]


def make_topology(H, W, num_steps, rng, p_change=0.35):
    """Random walk inside the border; every step ORs a random 3x3 mask into the floor."""
    # random.sample(seq, 1)[0] in gym_sokoban draws exactly what random.choice(seq) draws
    direction = rng.choice(WALK_DIRECTIONS)
    r, c = rng.randint(1, H - 1), rng.randint(1, W - 1)
    fixed = [[WALL] * W for _ in range(H)]
    for _ in range(num_steps):
        if rng.random() < p_change:
            direction = rng.choice(WALK_DIRECTIONS)
        r = max(min(r + direction[0], H - 2), 1)
        c = max(min(c + direction[1], W - 2), 1)
        mask = rng.choice(MASKS)
        for k in range(9):
            if mask[k] == "1":
                fixed[r - 1 + k // 3][c - 1 + k % 3] = FLOOR
    border = lambda i, j: i in (0, H - 1) or j in (0, W - 1)  # the border is always wall
    return [[WALL if border(i, j) else k for j, k in enumerate(row)] for i, row in enumerate(fixed)]


def reverse_play(fixed, targets, player, search_depth):
    """Depth-first search over pull moves from the solved room (gym_sokoban room_utils.depth_first_search).
    Score of a state: (#changes of the box being pulled) x (sum of box displacements), 0 while any
    target is covered. Returns the best (score, player, {target: box}). Visited states are shared by
    the whole search and the depth budget (ttl) counts recursion levels, as in gym_sokoban."""
    explored, best, target_set = set(), [-1, None, None], set(targets)

    def dfs(player, boxes, pulled, swaps, last_pull, ttl):
        ttl -= 1
        if ttl <= 0 or len(explored) >= 300000:
            return
        # a gym_sokoban state is the room array: boxes never pulled (code 4) differ from pulled ones (code 3)
        key = (player, frozenset(boxes[t] for t in pulled), frozenset(t for t in boxes if t not in pulled))
        if key in explored:
            return
        covered = player in target_set or any(b in target_set for b in boxes.values())
        score = 0 if covered else swaps * sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in boxes.items())
        if score > best[0]:
            best[:] = [score, player, dict(boxes)]
        explored.add(key)
        occupied = set(boxes.values())
        for dr, dc in MOVES:
            nxt = (player[0] + dr, player[1] + dc)
            if fixed[nxt[0]][nxt[1]] == WALL or nxt in occupied:
                continue  # no move: same state, already explored
            behind = (player[0] - dr, player[1] - dc)
            nboxes, npulled, npull = boxes, pulled, last_pull
            if behind in occupied:  # the player drags the box behind it into its old cell
                t = next(t for t, b in boxes.items() if b == behind)
                nboxes, npulled, npull = {**boxes, t: player}, pulled | {t}, t
            dfs(nxt, nboxes, npulled, swaps + (npull != last_pull), npull, ttl)

    dfs(player, {t: t for t in targets}, frozenset(), 0, None, search_depth)
    return best


def generate_room(dim, num_boxes, search_depth, seed):
    """One attempt at RAGEN's generate_room (ragen/env/sokoban/utils.py). Returns (fixed, boxes, player);
    raises RuntimeError when the seed gives no usable room (RAGEN then reseeds)."""
    H, W = dim
    rng, nprng = random.Random(seed), np.random.RandomState(seed)  # = random.seed / np.random.seed in all_seed
    for _ in range(4):  # up to 4 topologies
        fixed = make_topology(H, W, int(1.7 * (H + W)), rng)
        cells = [(r, c) for r in range(H) for c in range(W) if fixed[r][c] == FLOOR]  # np.where order
        if len(cells) <= num_boxes + 1:
            raise RuntimeError(f"not enough floor ({len(cells)} cells) for {num_boxes} boxes and a player")
        player = cells.pop(nprng.randint(len(cells)))
        targets = [cells.pop(nprng.randint(len(cells))) for _ in range(num_boxes)]
        for r, c in targets:
            fixed[r][c] = TARGET
        targets.sort()  # box_mapping follows np.where(room_structure == 2)
        score, player, boxes = reverse_play(fixed, targets, player, search_depth)
        displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in boxes.items())
        if displacement > 0:
            break
    if displacement == 0:
        raise RuntimeError("reverse play moved no box")
    boxes = set(boxes.values())
    # RAGEN add_random_player_movement: move the player 1-3 steps to fresh free cells (utils.py)
    if rng.random() <= (0.8 if displacement == 1 else 0.5):
        visited = [player]
        while True:
            options = [(player[0] + dr, player[1] + dc) for dr, dc in MOVES]
            options = [p for p in options if fixed[p[0]][p[1]] != WALL and p not in boxes and p not in visited]
            if not options:
                break
            player = rng.choice(options)
            visited.append(player)
            if len(visited) > 3 or rng.random() > 0.5:
                break
    return fixed, boxes, player


def parse_room(text, glyphs=GLYPHS):
    """Inverse of render: grid text -> (fixed, boxes, player); a coordinate render is read from its grid."""
    rows = text.split("Grid Map: \n")[-1].strip("\n").split("\n")
    if len({len(row) for row in rows}) != 1 or any(ch not in glyphs for row in rows for ch in row):
        raise ValueError(f"a room is a rectangle of the glyphs {glyphs!r}, got:\n{text}")
    fixed, boxes, players = [], set(), []
    for r, row in enumerate(rows):
        codes = [glyphs.index(ch) for ch in row]
        fixed.append([WALL if k == 0 else TARGET if k in (2, 3, 6) else FLOOR for k in codes])
        boxes |= {(r, c) for c, k in enumerate(codes) if k in (3, 4)}
        players += [(r, c) for c, k in enumerate(codes) if k in (5, 6)]
    num_targets = sum(row.count(TARGET) for row in fixed)
    if len(players) != 1 or len(boxes) != num_targets or not boxes:
        raise ValueError(f"need one player and as many boxes as targets (at least one), got:\n{text}")
    return fixed, boxes, players[0]


def solve(room, glyphs=GLYPHS, max_depth=100):
    """Breadth-first search over (player, boxes): a shortest action list that solves the room given as
    text, [] if it is solved already, None if there is none within max_depth moves.
    (RAGEN's get_shortest_action_path does the same BFS over whole room arrays.)"""
    fixed, boxes, player = parse_room(room, glyphs)
    W = len(fixed[0]) + 1  # flat index r * W + c; the spare column stops moves wrapping round a row end
    free = {r * W + c for r, row in enumerate(fixed) for c, k in enumerate(row) if k != WALL}
    targets = frozenset(r * W + c for r, row in enumerate(fixed) for c, k in enumerate(row) if k == TARGET)
    steps = [-W, W, -1, 1]  # Up, Down, Left, Right
    start = (player[0] * W + player[1], frozenset(r * W + c for r, c in boxes))
    if start[1] == targets:
        return []
    parent, frontier = {start: None}, [start]
    for _ in range(max_depth):
        next_frontier = []
        for state in frontier:
            p, bx = state
            for a, d in enumerate(steps):
                q = p + d
                if q not in free:
                    continue
                nbx = bx
                if q in bx:  # push, if the cell beyond is free
                    if q + d not in free or q + d in bx:
                        continue
                    nbx = (bx - {q}) | {q + d}
                child = (q, nbx)
                if child in parent:
                    continue
                parent[child] = (state, a)
                if nbx == targets:
                    path = []
                    while parent[child] is not None:
                        child, a = parent[child]
                        path.append(ACTIONS[a])
                    return path[::-1]
                next_frontier.append(child)
        if not next_frontier:
            return None
        frontier = next_frontier
    return None


# ----------------------------------------------------------------------------- the environment
class SokobanEnv:
    def __init__(self, dim_room=(6, 6), num_boxes=1, max_steps=100, search_depth=300, glyphs=GLYPHS,
                 observation_format="grid"):
        if len(dim_room) != 2 or min(dim_room) < 3 or num_boxes < 1 or len(glyphs) != 7 \
                or observation_format not in ("grid", "grid_coord"):
            raise ValueError(f"bad config: dim_room={dim_room}, num_boxes={num_boxes}, glyphs={glyphs!r}, "
                             f"observation_format={observation_format!r}")
        self.dim_room, self.num_boxes, self.max_steps = tuple(dim_room), num_boxes, max_steps
        self.search_depth, self.glyphs, self.observation_format = search_depth, glyphs, observation_format
        self.player = None

    def reset(self, seed):
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        for _ in range(1000):
            try:
                fixed, boxes, player = generate_room(self.dim_room, self.num_boxes, self.search_depth, seed)
                break
            except RuntimeError:
                # RAGEN reseeds with abs(hash(str(seed))) % 2**32, which changes from process to process;
                # one LCG step keeps the retry reproducible
                seed = (seed * 1103515245 + 12345) % 2**32
        else:
            raise RuntimeError(f"no room for {self.dim_room}, {self.num_boxes} boxes after 1000 seeds")
        self._set_state(fixed, boxes, player)
        return self.render()

    def load(self, text):
        """Start an episode from a room given as text (hand-made puzzles, tests)."""
        self._set_state(*parse_room(text, self.glyphs))
        return self.render()

    def _set_state(self, fixed, boxes, player):
        self.fixed, self.boxes, self.player = fixed, set(boxes), player
        self.targets = {(r, c) for r, row in enumerate(fixed) for c, k in enumerate(row) if k == TARGET}
        self.num_env_steps, self.done = 0, False

    def _free(self, p):  # gym_sokoban: a player or box may enter empty floor or an empty target
        r, c = p
        return (0 <= r < len(self.fixed) and 0 <= c < len(self.fixed[0]) and self.fixed[r][c] != WALL
                and p not in self.boxes)

    def render(self):
        if self.player is None:
            raise RuntimeError("call reset(seed) first")
        lines = []
        for r, row in enumerate(self.fixed):
            codes = [(3 if k == TARGET else 4) if (r, c) in self.boxes
                     else (6 if k == TARGET else 5) if (r, c) == self.player else k for c, k in enumerate(row)]
            lines.append("".join(self.glyphs[k] for k in codes))
        if self.observation_format == "grid":
            return "\n".join(lines)
        # RAGEN-2 sokoban/utils.py format_coordinate_render: row-major lists, empty ones left out, no walls (its
        # collect_entity_coordinates leaves them out, "too heavy")
        at = lambda keep: [(r, c) for r, row in enumerate(self.fixed) for c, k in enumerate(row) if keep((r, c), k)]
        groups = [("Targets", at(lambda p, k: k == TARGET)),
                  ("Boxes", at(lambda p, k: p in self.boxes and k != TARGET)),
                  ("Boxes on target", at(lambda p, k: p in self.boxes and k == TARGET)),
                  ("Player", at(lambda p, k: p == self.player and k != TARGET)),
                  ("Player on target", at(lambda p, k: p == self.player and k == TARGET))]
        coords = [f"Board size: {self.dim_room[0]} rows x {self.dim_room[1]} cols (zero-indexed)."]
        coords += [f"{label}: " + ", ".join(f"({r}, {c})" for r, c in cells) for label, cells in groups if cells]
        return "Coordinates: \n" + "\n".join(coords) + "\nGrid Map: \n" + "\n".join(lines)

    def actions(self):
        return list(ACTIONS)

    def step(self, action):
        if self.player is None:
            raise RuntimeError("call reset(seed) first")
        name = action.strip().capitalize() if isinstance(action, str) else None
        on_before = len(self.boxes & self.targets)
        if self.done or name not in ACTIONS:  # invalid: nothing happens, no step is used
            info = dict(action_is_valid=False, action_is_effective=False, success=on_before == len(self.boxes))
            return self.render(), 0.0, self.done, info
        self.num_env_steps += 1
        dr, dc = MOVES[ACTIONS.index(name)]
        r, c = old = self.player
        nxt, beyond = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
        if nxt in self.boxes and self._free(beyond):  # gym_sokoban _push
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
            self.player = nxt
        elif self._free(nxt):  # otherwise _move
            self.player = nxt
        on_after = len(self.boxes & self.targets)
        # gym_sokoban _calc_reward: step penalty, +1 / -1 per box on / off target, +10 when all are on
        reward = -0.1
        if on_after > on_before:
            reward += 1
        elif on_after < on_before:
            reward -= 1
        solved = on_after == len(self.boxes)
        if solved:
            reward += 10
        self.done = solved or self.num_env_steps == self.max_steps
        info = dict(action_is_valid=True, action_is_effective=self.player != old, success=solved)
        return self.render(), reward, self.done, info


def solver_actions(env, k):
    """sft.py's solver: the first k moves of a shortest solution from the current room (None: none found)."""
    grid = env.render().split("Grid Map: \n")[-1]  # grid_coord renders coordinates above the grid
    plan = solve(grid, env.glyphs)
    return plan[:k] if plan else None


def random_actions(env, k, rng):
    """k moves drawn uniformly."""
    return [rng.choice(env.actions()) for _ in range(k)]


# ----------------------------------------------------------------------------- terminal play / statistics
def print_statistics(env, args):
    """python env_sokoban.py --random N (play.py): over N seeds from --seed, the random policy's success within the
    preset's action budget, reset times and the optimal solutions' lengths. False without --random."""
    if not args.random:
        return False
    budget, wins, lengths, reset_s = PRESETS[args.preset]["max_actions_per_traj"], 0, [], []
    for seed in range(args.seed, args.seed + args.random):
        t0 = time.perf_counter()
        room = env.reset(seed)
        reset_s.append(time.perf_counter() - t0)
        lengths.append(len(solve(room, env.glyphs)))
        policy = random.Random(seed)
        for _ in range(budget):
            _, _, done, info = env.step(policy.choice(ACTIONS))
            if done:
                break
        wins += info["success"]
    print(f"{args.preset}: {args.random} seeds from {args.seed}; random policy ({budget} actions) "
          f"success {wins / args.random:.3f}; median reset {1e3 * statistics.median(reset_s):.2f} ms")
    print(f"optimal solution length: mean {statistics.mean(lengths):.2f}, min {min(lengths)}, "
          f"max {max(lengths)}, <= {budget}: {sum(n <= budget for n in lengths) / len(lengths):.3f}")
    for n in range(min(lengths), max(lengths) + 1):
        print(f"{n:3d} {lengths.count(n):5d} " + "#" * round(60 * lengths.count(n) / len(lengths)))
    return True


if __name__ == "__main__":  # play in the terminal (q shows the optimal plan), or --random N: statistics (play.py)
    import play
    play.main(SokobanEnv)
