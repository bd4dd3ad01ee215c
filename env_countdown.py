"""Countdown as RAGEN-2 plays it (ragen/env/countdown), offline: tasks come from the seed, not from a download.

RAGEN-2 takes the first 20,000 rows of the public set Jiayi-Pan/Countdown-Tasks-3to4 (a target and 3 or 4
numbers) and keeps the rows that + and - alone can solve. We draw such rows from the seed instead: 3 or 4
numbers in 1..99 and a target in 1..100, redrawn until some choice of signs hits the target (value ranges
are a guess from the public rows we could see; the README says what is known). One turn, one answer: an
expression that uses each number exactly once. Reward (RAGEN compute_score): 0 unless the integers written
in the answer are exactly the given numbers, then 1.0 if the expression equals the target, else 0.1.
RAGEN runs the answer through Python's eval; we never run model text: a hand-written tokenizer and
recursive-descent parser read integers, + - * /, parentheses and unary signs, exactly (fractions), with
bounded length and depth. Anything else, a division by zero included, is just not a correct value.
Train and validation never share a task: seeds below VAL_SEEDS (train.py validates from --val-seed 123)
draw only tasks whose CRC32 bucket is 0, seeds from VAL_SEEDS on (train.py trains from --seed 10000) only
the others, so the two sets of tasks are disjoint whatever the seeds.

  python env_countdown.py --seed 3           # play in the terminal
  python env_countdown.py --random 2000      # random-policy reward and task statistics
"""
import itertools
import random
import re
import statistics
import time
import zlib
from fractions import Fraction

NUM_RANGE, TARGET_RANGE, SIZES = (1, 99), (1, 100), (3, 4)
VAL_SEEDS = 10_000           # seeds < VAL_SEEDS: validation tasks; seeds >= VAL_SEEDS: training tasks
VAL_BUCKETS = 2              # a task is a validation task iff crc32(task) % VAL_BUCKETS == 0
MAX_ANSWER_CHARS = 256       # longer answers score 0 unread (a 4-number answer needs about 20 characters)
MAX_DEPTH = 32               # nested parentheses / unary signs

# config/envs.yaml Countdown env_instruction. RAGEN-2's ctx_manager adds no legend and no action list (CountdownEnvConfig
# has no grid_vocab and no action_lookup) and puts it in the system message, after "You're a helpful assistant. "
COUNTDOWN_INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the "
    "target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, "
    "7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>")

PRESETS = {  # config/envs.yaml Countdown; _4_countdown.yaml: max_turn 1, max_actions_per_turn 1
    "Countdown": dict(kwargs=dict(), instruction=COUNTDOWN_INSTRUCTION, instruction_in_system=True,
                      max_actions_per_traj=1, max_tokens=100, max_turns=1, max_actions_per_turn=1),
}


# ----------------------------------------------------------------------------- tasks
def plus_minus_values(nums):
    """Every sum(s_i * n_i) with signs s_i in {+1, -1}, the first one included (RAGEN has_solution tries them all)."""
    values = {0}
    for n in nums:
        values = {v + n for v in values} | {v - n for v in values}
    return values


def is_val_task(target, nums):
    """The split of a task, from the task itself (order of the numbers ignored): 1 task in VAL_BUCKETS is validation."""
    return zlib.crc32(f"{target}:{sorted(nums)}".encode()) % VAL_BUCKETS == 0


def generate_task(seed):
    """(target, nums) for a seed: uniform draws redrawn until +/- solvable and in the seed's split."""
    rng, val = random.Random(seed), seed < VAL_SEEDS
    while True:
        nums = [rng.randint(*NUM_RANGE) for _ in range(rng.choice(SIZES))]
        target = rng.randint(*TARGET_RANGE)
        if target in plus_minus_values(nums) and is_val_task(target, nums) == val:
            return target, nums


def solve(nums, target):
    """Brute force over every expression tree with + - * / (exact fractions): an expression string that
    equals target using each number once, or None. Independent of the generator's +/- check."""
    def search(items):  # items: [(value, text)]
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.combinations(range(len(items)), 2):
            (a, ta), (b, tb) = items[i], items[j]
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            options = [(a + b, f"({ta} + {tb})"), (a - b, f"({ta} - {tb})"), (b - a, f"({tb} - {ta})"),
                       (a * b, f"({ta} * {tb})")]
            options += [(a / b, f"({ta} / {tb})")] if b else []
            options += [(b / a, f"({tb} / {ta})")] if a else []
            for value in options:
                found = search(rest + [value])
                if found:
                    return found
        return None
    return search([(Fraction(n), str(n)) for n in nums])


# ----------------------------------------------------------------------------- the safe evaluator
def tokenize(text):
    """'(3 + 5) * 2' -> ['(', 3, '+', 5, ')', '*', 2]; None on any other character (ASCII digits only)."""
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch in " \t\r\n":
            i += 1
        elif ch in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            tokens.append(int(text[i:j]))
            i = j
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        else:
            return None
    return tokens


def evaluate(text):
    """Exact value (a Fraction) of an arithmetic expression, or None if it is not one of ours: integers,
    binary + - * /, unary + -, parentheses, at most MAX_ANSWER_CHARS long and MAX_DEPTH deep, no division
    by zero. Grammar: expr = term (('+'|'-') term)*; term = factor (('*'|'/') factor)*;
    factor = ('+'|'-') factor | integer | '(' expr ')'. Nothing is ever executed."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    tokens = tokenize(text)
    if not tokens:
        return None
    pos = 0

    def take(expected=None):
        nonlocal pos
        tok = tokens[pos] if pos < len(tokens) else None
        if expected is not None and tok != expected:
            raise ValueError(f"expected {expected!r}")
        pos += tok is not None
        return tok

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def expr(depth):
        value = term(depth)
        while peek() in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth):
        value = factor(depth)
        while peek() in ("*", "/"):
            if take() == "*":
                value = value * factor(depth)
            else:
                value = value / factor(depth)  # Fraction: ZeroDivisionError on 0
        return value

    def factor(depth):
        if depth >= MAX_DEPTH:
            raise ValueError("too deep")
        tok = take()
        if tok in ("+", "-"):
            value = factor(depth + 1)
            return value if tok == "+" else -value
        if tok == "(":
            value = expr(depth + 1)
            take(")")
            return value
        if isinstance(tok, int):
            return Fraction(tok)
        raise ValueError(f"unexpected {tok!r}")

    try:
        value = expr(0)
        return value if pos == len(tokens) else None
    except (ValueError, ZeroDivisionError):
        return None


def score(answer, nums, target, format_score=0.1):
    """RAGEN compute_score: 0 unless the integers in the answer (regex \\d+) are exactly nums, then 1.0 if it
    equals target, else format_score. Over-long answers score 0 before any reading."""
    if not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if sorted(int(n) for n in re.findall(r"\d+", answer)) != sorted(nums):
        return 0.0
    return 1.0 if evaluate(answer) == target else format_score


def random_answer(nums, rng):
    """The random policy: the numbers in a random order joined by random operators, no parentheses."""
    order = rng.sample(nums, len(nums))
    return " ".join(str(order[0]) if k == 0 else f"{rng.choice('+-*/')} {n}" for k, n in enumerate(order))


# ----------------------------------------------------------------------------- the environment
class CountdownEnv:
    def __init__(self):
        self.obs = None

    def reset(self, seed):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.target, self.nums = generate_task(seed)
        self.obs, self.done = f"Target: {self.target}, nums: {self.nums}", False  # RAGEN: Python list repr
        return self.obs

    def render(self):
        if self.obs is None:
            raise RuntimeError("call reset(seed) first")
        return self.obs

    def actions(self):
        return None  # free-form: the answer is an expression

    def step(self, action):
        """Any string is scored and ends the episode (RAGEN: action_is_valid always); after that, nothing."""
        if self.obs is None:
            raise RuntimeError("call reset(seed) first")
        if self.done or not isinstance(action, str):
            return self.obs, 0.0, self.done, dict(action_is_valid=False, action_is_effective=False, success=False)
        reward = score(action, self.nums, self.target)
        self.obs, self.done = f"Your answer get {reward} points.", True
        return self.obs, reward, True, dict(action_is_valid=True, action_is_effective=reward > 0, success=reward == 1.0)


def solver_actions(env, k):
    """sft.py's solver: an expression that hits the target, found by exhaustive search (None: none exists)."""
    answer = solve(env.nums, env.target)
    return None if answer is None else [answer]


def random_actions(env, k, rng):
    """One random expression of the numbers (one answer per turn, whatever k)."""
    return [random_answer(env.nums, rng)]


def print_statistics(env, args):
    """python env_countdown.py --random N (play.py): over N seeds from --seed, the random policy's success and mean
    reward, reset times, the tasks' sizes and targets. False without --random."""
    if not args.random:
        return False
    rewards, sizes, targets, reset_s = [], [], [], []
    for seed in range(args.seed, args.seed + args.random):
        t0 = time.perf_counter()
        env.reset(seed)
        reset_s.append(time.perf_counter() - t0)
        sizes.append(len(env.nums))
        targets.append(env.target)
        rewards.append(env.step(random_answer(env.nums, random.Random(seed)))[1])
    last = args.seed + args.random - 1
    split = "validation" if last < VAL_SEEDS else "training" if args.seed >= VAL_SEEDS else "mixed"
    print(f"{args.preset}: {args.random} seeds from {args.seed} ({split} tasks); random policy (numbers in a random "
          f"order, random + - * /): success {rewards.count(1.0) / len(rewards):.3f}, mean reward "
          f"{statistics.mean(rewards):.3f}; median reset {1e3 * statistics.median(reset_s):.2f} ms")
    print(f"3 numbers {sizes.count(3) / len(sizes):.3f}, 4 numbers {sizes.count(4) / len(sizes):.3f}; "
          f"target mean {statistics.mean(targets):.1f}, min {min(targets)}, max {max(targets)}")
    return True


if __name__ == "__main__":  # play in the terminal (q shows a solution), or --random N: statistics (play.py)
    import play
    play.main(CountdownEnv)
