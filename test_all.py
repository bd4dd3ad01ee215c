"""All tests of the project: CPU-first, tiny random models.

    python -m pytest -q -n 2 test_all.py                  # the whole suite (the CI command)
    python -m pytest -q -n 2 test_all.py -m "not slow"    # the fast tier: no subprocess, no paper-shape model

Grouped by concept: environments, StarPO maths, models and sampler, training, checkpoints and resume, evaluation
and plots, supervised warm-up. Each section tests its file against an independent reference: hand-worked cases,
slow plain-Python loops, a brute-force solver, a full-recompute sampler, a 1-process run for the 2-process torchrun
run. Tests marked `slow` (pytest.ini) start train.py, eval.py, sft.py, bench.py, gpu_check.py or torchrun, or build
the paper's model shape.
"""
import argparse
import dataclasses
import inspect
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from env_bandit import BanditEnv, PRESETS as BANDIT_PRESETS
import env_countdown as CD
import env_cue
from env_frozenlake import FrozenLakeEnv, PRESETS as FROZENLAKE_PRESETS, has_path
from env_sokoban import SokobanEnv, PRESETS as SOKOBAN_PRESETS, solve
import env_webshop as W
import agent
import checkpoint
import collapse
import eval as ev
import models
import rollout
import sampler
import sft
import starpo


@pytest.fixture(autouse=True)
def fp32_unless_asked(monkeypatch):
    """The suite's exactness tests compare tokens and log-probs in fp32: --dtype auto resolves to fp32 in this process
    whatever the CPU (models.compute_dtype picks bf16 on one with native bf16); subprocesses get --dtype fp32 (TINY,
    run_train, run_sft, run_eval). A test that wants bf16 says --dtype bf16."""
    monkeypatch.setattr(models, "native_bf16", lambda: False)


HERE = os.path.dirname(os.path.abspath(__file__))


# ==================================================================================================
# Environments: Bandit, Sokoban, FrozenLake, WebShop, Countdown (env_*.py)
# ==================================================================================================
ALL_PRESETS = [(BanditEnv, BANDIT_PRESETS), (SokobanEnv, SOKOBAN_PRESETS), (FrozenLakeEnv, FROZENLAKE_PRESETS)]


ENV_PRESETS = [(cls, name) for cls, presets in ALL_PRESETS for name in presets]


def test_presets_follow_the_interface():
    assert set(BANDIT_PRESETS) == {"Bandit", "BanditTest", "BanditGen", "BanditGenTest", "BanditRev", "BanditRevTest",
                                   "Bandit2", "Bandit2Test"}
    assert set(SOKOBAN_PRESETS) == {"SimpleSokoban", "LargerSokoban", "SokobanNewVocab", "CoordSokoban"}
    assert set(FROZENLAKE_PRESETS) == {"FrozenLake", "CoordFrozenLake", "CoordFrozenLakeDet"}
    for cls, name in ENV_PRESETS:
        preset = (BANDIT_PRESETS | SOKOBAN_PRESETS | FROZENLAKE_PRESETS)[name]
        assert {"kwargs", "instruction", "max_actions_per_traj", "max_tokens"} <= set(preset)
        assert set(preset) <= {"kwargs", "instruction", "max_actions_per_traj", "max_tokens", "max_turns", "max_actions_per_turn",
                               "instruction_in_system", "seed_per_member"}
        # RAGEN-2's presets (Coord*, Bandit2*) put the instruction in the system message; v1's open the first user message with it
        assert preset.get("instruction_in_system", False) == (name.startswith("Coord") or name.startswith("Bandit2"))
        env = cls(**preset["kwargs"])
        assert isinstance(env.reset(0), str) and env.render() == env.reset(0)
        assert preset["max_tokens"] == (120 if name.startswith("Coord") else 100)  # RAGEN-2 gives Coord tags 120
    assert all(p["instruction"] == "" and p["max_actions_per_traj"] == 1 for p in BANDIT_PRESETS.values())


def test_no_heavy_imports():
    code = ("import sys, env_bandit, env_sokoban, env_frozenlake; "
            "bad = {'torch', 'transformers', 'gym', 'gymnasium'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instructions_are_ragens_prefix():
    # RAGEN's exact first user message prefix for SimpleSokoban
    expected = (
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
        "When you are right next to a box, you can push it by moving in the same direction. You cannot push a "
        "box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
        "<answer>Right || Right || Up</answer>\n"
        "The meaning of each symbol in the state is:\n"
        "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target\n"
        "Your available actions are:\n"
        "Up, Down, Left, Right\n"
        'You can make up to 10 actions, separated by the action separator " || "\n')
    assert SOKOBAN_PRESETS["SimpleSokoban"]["instruction"] == expected
    assert SOKOBAN_PRESETS["LargerSokoban"]["instruction"] == expected
    new = SOKOBAN_PRESETS["SokobanNewVocab"]["instruction"]
    assert "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target\n" in new
    fl = FROZENLAKE_PRESETS["FrozenLake"]["instruction"]
    assert fl.startswith("You are solving the FrozenLake puzzle. Forbid the whole and go to the target.")
    assert fl.endswith("</answer>\nThe meaning of each symbol in the state is:\n"
                       "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal\n"
                       "Your available actions are:\nLeft, Down, Right, Up\n"
                       'You can make up to 10 actions, separated by the action separator " || "\n')


@pytest.mark.parametrize("cls,name", ENV_PRESETS)
def test_same_seed_same_trajectory(cls, name):
    preset = (BANDIT_PRESETS | SOKOBAN_PRESETS | FROZENLAKE_PRESETS)[name]
    for seed in range(30):
        a, b = cls(**preset["kwargs"]), cls(**preset["kwargs"])
        assert a.reset(seed) == b.reset(seed)
        policy = random.Random(seed)
        for _ in range(12):
            action = policy.choice(a.actions() + ["junk"])
            assert a.step(action) == b.step(action)


@pytest.mark.parametrize("cls,name", ENV_PRESETS)
def test_garbage_actions_never_raise(cls, name):
    preset = (BANDIT_PRESETS | SOKOBAN_PRESETS | FROZENLAKE_PRESETS)[name]
    env, rng = cls(**preset["kwargs"]), random.Random(0)
    garbage = ["", " ", "\n", "\x00", "Up || Down", "<answer>Up</answer>", "Upp", "U p", "1", "left right",
               "x" * 1_000_000, "Up" * 100_000, "Ｕｐ", "↑", "\ud800", "🐉", None, 3, b"Up", ["Up"],
               "Dragon!", "Phoenix Dragon", "<answer> Dragon </answer>", "Dragon\x00", "DRAG ON"]
    for _ in range(3000):  # random unicode mixed with action letters
        garbage.append("".join(chr(rng.randrange(0x110000)) if rng.random() < 0.5 else rng.choice("UpDownLeftRight \t")
                               for _ in range(rng.randrange(12))))
    for i, action in enumerate(garbage):
        if i % 50 == 0:
            obs = env.reset(i)
        if isinstance(action, str) and action.strip().lower() in {n.lower() for n in env.actions()}:
            continue  # a random draw that spells a real action
        out = env.step(action)
        assert out[0] == obs and out[1] == 0.0 and out[2] is False
        assert out[3]["action_is_valid"] is False and out[3]["action_is_effective"] is False
        assert env.render() == obs


# ------------------------------------------------------------------ Bandit
def test_bandit_prompt_and_order():
    env = BanditEnv("Phoenix", "Dragon")
    firsts = {env.reset(seed).split("named ")[1].split(" and")[0] for seed in range(20)}
    assert firsts == {"Phoenix", "Dragon"}  # the seed decides the display order
    obs = env.reset(0)
    a, b = env.actions()
    assert obs == (
        "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
        "Game Rules: \n"
        f"1. There are 2 arms, named {a} and {b}\n"
        "2. Each arm has its own reward distribution, related to their names. \n"
        "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
        "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
        f"rewards on average? Choose between {a} and {b}, and output like <answer> {a} </answer> or "
        f"<answer> {b} </answer>.\n")


def test_bandit_step_rules():
    env = BanditEnv("Trader", "Librarian")
    env.reset(1)
    obs, reward, done, info = env.step("  tRADER ")
    assert (obs, reward, done, info["success"], info["action_is_valid"]) == ("Trader: 0.1 points", 0.1, True, False, True)
    assert env.step("Trader") == (obs, 0.0, True, dict(action_is_valid=False, action_is_effective=False, success=False))
    env.reset(1)
    obs, reward, done, info = env.step("LIBRARIAN")
    assert obs == f"Librarian: {reward} points" and reward in (0.0, 1.0) and done and info["success"]


def test_bandit_payout_means():
    env, hi, lo = BanditEnv(), [], []
    for seed in range(4000):
        env.reset(seed)
        hi.append(env.step("dragon")[1])
        env.reset(seed)
        lo.append(env.step("phoenix")[1])
    assert set(lo) == {0.1} and set(hi) == {0.0, 1.0}
    assert abs(sum(hi) / 4000 - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 4000)
    # RAGEN's own env gave a high-arm mean of 0.2445 over 2000 seeds; ours draws the same numbers
    assert sum(hi[:2000]) / 2000 == pytest.approx(0.2445)


def test_bandit2_members_differ_and_a_group_reproduces(tiny):
    # RAGEN-2 (ragen/env/bandit/env.py): each member of a group resets from its own seed, then draws its name pair
    # from a pool, the order the names are shown in, and the payout; v1's group shares all three
    preset, test = BANDIT_PRESETS["Bandit2"], BANDIT_PRESETS["Bandit2Test"]
    pool = preset["kwargs"]["pairs"]
    names = lambda pairs: {name for pair in pairs for name in pair}
    assert len(names(pool)) == 24 and len(names(test["kwargs"]["pairs"])) == 16
    assert not names(pool) & names(test["kwargs"]["pairs"])  # no name of the validation pool is trained on
    env, again = BanditEnv(**preset["kwargs"]), BanditEnv(**preset["kwargs"])
    pairs, orders, draws = set(), set(), set()
    for m in range(16):
        obs = env.reset(7, member=m)
        assert again.reset(7, member=m) == obs  # reproducible from (group seed, member)
        pairs.add((env.lo_arm_name, env.hi_arm_name))
        orders.add(env.actions()[0] == env.lo_arm_name)
        out = env.step(env.hi_arm_name)
        assert again.step(again.hi_arm_name) == out
        draws.add(out[1])
    assert len(pairs) > 4 and pairs <= set(pool) and orders == {True, False} and draws == {0.0, 1.0}
    child = np.random.default_rng(np.random.SeedSequence(7).spawn(4)[3])  # member 3: the group seed's 4th child
    lo, hi = pool[int(child.random() * len(pool))]                         # RAGEN-2's draws: pair, order, payout
    assert env.reset(7, member=3).split("named ")[1].startswith(f"{lo} and {hi}\n" if child.random() < 0.5 else f"{hi} and {lo}\n")
    assert env.step(hi)[1] == (1.0 if child.random() < 0.25 else 0.0)
    with pytest.raises(ValueError, match="member"):
        env.reset(7, member=-1)

    model, tok = tiny  # rollout resets member b of a group with b % group_size, whatever the batch around it

    def play(seeds, preset):
        envs = [BanditEnv(**preset["kwargs"]) for _ in seeds]
        return rollout.rollout(model, tok, envs, seeds, loop_settings(preset, max_turns=1, max_new_tokens=6),
                               group_size=4)["text"]
    both = play([7] * 4 + [8] * 4, preset)
    prompts = [t.split("<|im_start|>assistant")[0] for t in both]
    assert [p.split("State:\n")[1].split("\nYou have 1 actions left")[0] for p in prompts] == \
        [env.reset(s, member=m) for s in (7, 8) for m in range(4)]
    assert len(set(prompts[:4])) > 1 and len(set(prompts[4:])) > 1
    assert play([8] * 4, preset) == both[4:]
    v1 = [t.split("<|im_start|>assistant")[0] for t in play([7] * 4, BANDIT_PRESETS["Bandit"])]
    assert len(set(v1)) == 1  # v1: one episode per group


# ------------------------------------------------------------------ Sokoban
def test_sokoban_matches_ragen_room():
    env = SokobanEnv(**SOKOBAN_PRESETS["SimpleSokoban"]["kwargs"])
    # the room RAGEN renders for seed 10000
    assert env.reset(10000) == "######\n#O####\n#__###\n#X_###\n#_P_##\n######"
    assert solve(env.render()) == ["Left", "Up", "Up"]
    total = sum(env.step(a)[1] for a in ["Left", "Up", "Up"])
    assert total == pytest.approx(10.7) and env.done  # RAGEN: a 3-move solution totals 10.7


def test_sokoban_push_rules():
    env = SokobanEnv()
    env.load("#####\n#P_O#\n#_X_#\n#O_X#\n#####")
    assert env.step("Right") == ("#####\n#_PO#\n#_X_#\n#O_X#\n#####", pytest.approx(-0.1), False,
                                 dict(action_is_valid=True, action_is_effective=True, success=False))
    obs, r, done, info = env.step("Down")  # push the box down onto the free cell: no target involved
    assert obs == "#####\n#__O#\n#_P_#\n#OXX#\n#####" and r == pytest.approx(-0.1)
    obs, r, done, info = env.step("Down")  # the box is against the wall: nothing moves
    assert obs == "#####\n#__O#\n#_P_#\n#OXX#\n#####" and r == pytest.approx(-0.1) and not info["action_is_effective"]
    env.load("######\n#PXXO#\n#O___#\n######")
    obs, r, done, info = env.step("Right")  # two boxes in a row cannot be pushed
    assert obs == "######\n#PXXO#\n#O___#\n######" and not info["action_is_effective"] and info["action_is_valid"]
    env.load("######\n#PX_O#\n#____#\n#O_X_#\n######")
    env.step("Right")
    obs, r, done, info = env.step("Right")  # box onto a target, one box still off
    assert obs == "######\n#__P√#\n#____#\n#O_X_#\n######" and r == pytest.approx(0.9) and not done
    env.load("#######\n#_P√__#\n#O_X__#\n#######")
    obs, r, done, info = env.step("Right")  # box off its target
    assert obs == "#######\n#__SX_#\n#O_X__#\n#######" and r == pytest.approx(-1.1)
    env.load("#####\n#P#_#\n#X_O#\n#_#_#\n#####")
    env.step("Down")  # push down, box ends at the bottom
    obs, r, done, info = env.step("Left")  # move into the wall
    assert obs == "#####\n#_#_#\n#P_O#\n#X#_#\n#####" and not info["action_is_effective"]


def test_sokoban_solve_and_finish():
    env = SokobanEnv()
    env.load("#####\n#PXO#\n#####")
    assert env.step("Right") == ("#####\n#_P√#\n#####", pytest.approx(10.9), True,
                                 dict(action_is_valid=True, action_is_effective=True, success=True))
    assert env.step("Left")[1:3] == (0.0, True)  # after the end: invalid no-op
    assert solve("#####\n#P_√#\n#####") == []
    assert solve("######\n#PX_O#\n######") == ["Right", "Right"]
    assert solve("#####\n#XP_#\n#__O#\n#####") is None  # box in a corner
    assert solve("OXP") == ["Left"] and solve("P\nX\nO") == ["Down"]  # rooms without a wall border
    assert env.load("OXP") and env.step("Right")[3]["action_is_effective"] is False  # off the grid = wall
    with pytest.raises(ValueError):
        env.load("#####\n#PX_#\n#####")  # no target for the box
    env = SokobanEnv(max_steps=3)
    env.load("######\n#P___#\n#__XO#\n######")
    assert [env.step("Left")[2] for _ in range(3)] == [False, False, True]


@pytest.mark.parametrize("name", list(SOKOBAN_PRESETS))
def test_sokoban_generated_rooms_are_solvable(name):
    preset = SOKOBAN_PRESETS[name]
    env = SokobanEnv(**preset["kwargs"])
    glyphs = env.glyphs
    lengths = []
    for seed in range(500):
        room = env.reset(seed).split("Grid Map: \n")[-1]  # CoordSokoban: the grid after the coordinates
        assert set(room) <= set(glyphs + "\n") and len(room.split("\n")) == env.dim_room[0]
        assert room.count(glyphs[4]) == env.num_boxes and room.count(glyphs[2]) + room.count(glyphs[6]) == env.num_boxes
        path = solve(room, glyphs)
        assert path, f"seed {seed} unsolved or solved already:\n{room}"
        lengths.append(len(path))
        if seed % 10 == 0:  # replay: -0.1 a step, +1 net per box that ends on a target, +10 at the end
            rewards = [env.step(a)[1] for a in path]
            assert env.done and env.step("Up")[3]["success"]
            assert sum(rewards) == pytest.approx(10 + env.num_boxes - 0.1 * len(path))
    if name == "SimpleSokoban":  # RAGEN's generator: mean optimal length about 4.1 over 200 seeds
        assert 3.6 < sum(lengths) / len(lengths) < 4.6


# ------------------------------------------------------------------ FrozenLake
def test_frozenlake_matches_ragen_map():
    env = FrozenLakeEnv(**FROZENLAKE_PRESETS["FrozenLake"]["kwargs"])
    assert env.reset(10000) == "____\n____\n___O\nGP__"  # RAGEN's map for seed 10000


def test_frozenlake_maps_have_a_path():
    env = FrozenLakeEnv()
    for seed in range(1000):
        env.reset(seed)
        flat = "".join(env.desc)
        assert len(env.desc) == 4 and flat.count("S") == 1 and flat.count("G") == 1 and set(flat) <= set("SFHG")
        assert has_path(env.desc, env.pos) and env.desc[env.pos[0]][env.pos[1]] == "S"


def test_frozenlake_rules():
    env = FrozenLakeEnv(is_slippery=False)
    env.load("P___\n____\n_O__\n___G")
    assert env.step("up") == ("P___\n____\n_O__\n___G", 0.0, False,
                              dict(action_is_valid=True, action_is_effective=False, success=False))  # border: stay
    assert env.step("Left")[0] == "P___\n____\n_O__\n___G"
    env.step("Down")
    obs, r, done, info = env.step("Down")
    assert obs == "____\n____\nPO__\n___G" and not done
    obs, r, done, info = env.step("Right")
    assert (obs, r, done, info["success"]) == ("____\n____\n_X__\n___G", 0.0, True, False)  # in a hole
    assert env.step("Up")[1:3] == (0.0, True) and env.render() == obs
    env.load("____\n____\n____\n__PG")
    obs, r, done, info = env.step("Right")
    assert (obs, r, done, info["success"]) == ("____\n____\n____\n___√", 1.0, True, True)
    # slippery, in a corner: Up can only stay (Up, Left) or slide Right
    env = FrozenLakeEnv()
    ends = []
    for seed in range(600):
        env.reset(seed)
        env.load("P___\n____\n____\n___G")
        env.rng = np.random.default_rng(seed)  # load() would always slip with seed 0
        ends.append(env.step("Up")[0].split("\n")[0])
    assert set(ends) == {"P___", "_P__"} and abs(ends.count("P___") / 600 - 2 / 3) < 0.08


def slip_counts(env, seeds):
    """From a random start with all three outcomes inside the lake, one move: how often the player went
    intended - 1, intended, intended + 1 (mod 4) of the action order Left, Down, Right, Up."""
    counts, moves = [0, 0, 0], [(0, -1), (1, 0), (0, 1), (-1, 0)]
    for seed in range(seeds):
        env.reset(seed)
        r, c = env.pos
        inside = [a for a in range(4) if all(0 <= r + moves[b][0] < 4 and 0 <= c + moves[b][1] < 4
                                              for b in ((a - 1) % 4, a, (a + 1) % 4))]
        if not inside:
            continue
        a = inside[seed % len(inside)]
        env.step(["Left", "Down", "Right", "Up"][a])
        counts[[(r + moves[b][0], c + moves[b][1]) for b in ((a - 1) % 4, a, (a + 1) % 4)].index(env.pos)] += 1
    return counts


def test_frozenlake_slip_frequencies():
    counts = slip_counts(FrozenLakeEnv(), 6000)
    n = sum(counts)
    assert n > 3000 and all(abs(k / n - 1 / 3) < 4 * math.sqrt(2 / 9 / n) for k in counts), counts


def test_frozenlake_success_rate():
    # success_rate 1 on slippery ice = the non-slippery lake, step for step
    det, plain = FrozenLakeEnv(success_rate=1.0), FrozenLakeEnv(is_slippery=False)
    for seed in range(300):
        assert det.reset(seed) == plain.reset(seed)
        policy = random.Random(seed)
        for _ in range(10):
            a = policy.choice(["Left", "Down", "Right", "Up"])
            assert det.step(a) == plain.step(a)
    # success_rate s: intended with s, each perpendicular with (1 - s) / 2
    for s in (0.6, 0.0):
        counts = slip_counts(FrozenLakeEnv(success_rate=s), 2500)
        n, want = sum(counts), [(1 - s) / 2, s, (1 - s) / 2]
        assert n > 1200 and all(abs(k / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9 for k, p in zip(counts, want)), counts
    with pytest.raises(ValueError):
        FrozenLakeEnv(success_rate=1.5)


def test_frozenlake_shortest_path_hand_made():
    env = FrozenLakeEnv(success_rate=1.0)
    env.load("P_O_\n__O_\nO___\n___G")
    from env_frozenlake import shortest_path
    path = shortest_path(env.desc, env.pos)
    assert len(path) == 6, path  # Manhattan distance: the holes leave a shortest path open
    for a in path:
        _, r, done, info = env.step(a)
    assert done and info["success"]
    assert shortest_path(["SH", "HG"], (0, 0)) is None and shortest_path(["SH", "HG"], (1, 1)) == []


# ------------------------------------------------------------ Coord presets (RAGEN-2): the grids as coordinate lists
def test_coord_renders_hand_worked():
    env = SokobanEnv(**SOKOBAN_PRESETS["CoordSokoban"]["kwargs"])
    assert env.reset(10000) == (
        # RAGEN-2 sokoban/utils.py format_coordinate_render of collect_entity_coordinates (walls left out there)
        "Coordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\nTargets: (1, 1)\nBoxes: (3, 1)\nPlayer: (4, 2)\n"
        "Grid Map: \n######\n#O####\n#__###\n#X_###\n#_P_##\n######")  # the grid is RAGEN's seed-10000 room
    obs = env.load("######\n#√_S_#\n#_X__#\n######")
    assert obs.split("\n")[2:6] == ["Targets: (1, 1), (1, 3)", "Boxes: (2, 2)", "Boxes on target: (1, 1)",
                                    "Player on target: (1, 3)"] and "\nPlayer: " not in obs
    lake = FrozenLakeEnv(**FROZENLAKE_PRESETS["CoordFrozenLake"]["kwargs"])
    assert lake.reset(10001) == ("Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (2, 0)\n"
                                 "Goal: (0, 1)\nPlayer: (2, 0)\nHoles: (1, 3), (2, 2)\nGrid Map: \n_G__\n___O\nP_O_\n____")
    det = FrozenLakeEnv(**FROZENLAKE_PRESETS["CoordFrozenLakeDet"]["kwargs"])
    det.reset(10000)
    assert det.step("Left")[0].split("\n")[4] == "Player on goal: (3, 0)"
    det.load("_P__\n_O__\n____\n___G")
    obs = det.step("Down")[0]
    assert "Player in hole: (1, 1)\nHoles: (1, 1)\n" in obs and "Start" not in obs and obs.endswith("____\n_X__\n____\n___G")
    for name, presets in (("CoordSokoban", SOKOBAN_PRESETS), ("CoordFrozenLake", FROZENLAKE_PRESETS)):
        assert (presets[name]["max_turns"], presets[name]["max_actions_per_turn"]) == (5, 2)  # RAGEN-2 base.yaml


def test_coord_frozenlake_lakes_are_ragen2s():
    # RAGEN-2 frozen_lake/config.py FrozenLakeEnvConfig: p 0.9 (frozen tiles), success_rate 0.8; config/envs.yaml
    # CoordFrozenLake sets success_rate 0.8, _3_frozen_lake.yaml (the main table) success_rate 1
    for name, success_rate in (("CoordFrozenLake", 0.8), ("CoordFrozenLakeDet", 1.0)):
        env = FrozenLakeEnv(**FROZENLAKE_PRESETS[name]["kwargs"])
        assert (env.size, env.p, env.is_slippery, env.success_rate) == (4, 0.9, True, success_rate), name
    v1 = FrozenLakeEnv(**FROZENLAKE_PRESETS["FrozenLake"]["kwargs"])
    assert (v1.p, v1.success_rate) == (0.8, 1 / 3)  # RAGEN v1: gymnasium's slippery ice

    def reachable(board, start):  # RAGEN-2 utils.py is_valid: depth-first from S, a G next to a visited tile wins
        frontier, seen = [start], set()
        while frontier:
            r, c = frontier.pop()
            if (r, c) in seen:
                continue
            seen.add((r, c))
            for dr, dc in [(1, 0), (0, 1), (-1, 0), (0, -1)]:
                if 0 <= r + dr < 4 and 0 <= c + dc < 4:
                    if board[r + dr][c + dc] == "G":
                        return True
                    if board[r + dr][c + dc] != "H":
                        frontier.append((r + dr, c + dc))
        return False

    def ragen2_lake(seed):  # RAGEN-2 frozen_lake/utils.py generate_random_map(4, 0.9, seed), as a plain loop
        rng = np.random.default_rng(seed)  # gymnasium seeding.np_random(seed)
        while True:
            board = [list(row) for row in rng.choice(["F", "H"], (4, 4), p=[0.9, 1 - 0.9])]
            (sr, sc), (gr, gc) = rng.integers(4, size=2), rng.integers(4, size=2)
            if (sr, sc) != (gr, gc):
                board[sr][sc], board[gr][gc] = "S", "G"
                if reachable(board, (int(sr), int(sc))):
                    return ["".join(r) for r in board]
    coord, v1_rule = FrozenLakeEnv(**FROZENLAKE_PRESETS["CoordFrozenLake"]["kwargs"]), FrozenLakeEnv(p=0.9)
    differ = holes = 0
    for seed in range(600):
        coord.reset(seed)
        v1_rule.reset(seed)
        assert coord.desc == ragen2_lake(seed)
        differ += coord.desc != v1_rule.desc
        holes += "".join(coord.desc).count("H")
    assert 10 < differ < 80  # RAGEN-2 draws a new board when start == goal, RAGEN new cells: about 1 seed in 15
    assert abs(holes / (600 * 14) - 0.1) < 0.03  # the 14 tiles besides S and G: about 1 in 10 a hole (solvable lakes only)


def first_prompt(model, tok, preset, env, seed, **kw):
    """The text of episode `seed`'s first prompt as rollout() builds it, up to and including the forced '<think>'."""
    text = rollout.rollout(model, tok, [env], [seed], loop_settings(preset, max_turns=1, max_new_tokens=2, **kw),
                           group_size=1, greedy=True)["text"][0]
    return text[:text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n<think>")]


def test_ragen2_presets_say_when_no_action_was_valid(tiny):
    # RAGEN-2 ctx_manager._build_turn_state_content: a turn after one with no valid action carries "No valid action
    # provided previously. ..." between its state and the actions-left line (es_manager: manager_invalid_action when
    # no proposed action maps to a valid one). v1 presets keep v1's prompt, without it
    model, tok = tiny
    warning = "No valid action provided previously. Environment state remains the same. Please try again.\n"
    answers = {0: "<answer>Jump</answer>", 1: "<answer>Right</answer>"}  # row 0: nothing valid; row 1: a move
    for name, shown in (("CoordFrozenLakeDet", True), ("FrozenLake", False)):
        preset = FROZENLAKE_PRESETS[name]
        envs = [FrozenLakeEnv(**preset["kwargs"]) for _ in range(2)]
        out = rollout.rollout(model, tok, envs, [10001, 10001],
                              loop_settings(preset, max_turns=2, max_new_tokens=40, think=False), group_size=2,
                              respond=lambda b, env: answers[b], sampler=sampler.Sampler())
        texts = [t[t.index("\nTurn 2:"):] for t in out["text"]]
        assert (warning in texts[0]) == shown and warning not in texts[1], (name, texts)
        if shown:
            assert texts[0].index(warning) > texts[0].index("Grid Map") and texts[0].index(warning) < texts[0].index("You have")
        assert warning not in out["text"][0][:out["text"][0].index("\nTurn 2:")]  # never on the first turn


def test_coord_prompts_are_ragen2s(tiny):
    # RAGEN-2 ctx_manager: system = "You're a helpful assistant. " + env_instruction + legend + action list (the Coord
    # tags set observation_format under env_config, so the tag's top-level value is the default "grid": legend shown);
    # the first user message is the "\nTurn 1:" block alone. Written out by hand from config/envs.yaml and the
    # FrozenLakeEnvConfig / SokobanEnvConfig grid_vocab and action_lookup, through the tiny model's ChatML. The lake is
    # RAGEN-2's generate_random_map(4, 0.9, 10001) (S (2, 0), G (0, 1), H (1, 3) and (2, 2)) in its grid_coord render
    model, tok = tiny
    tail = ("You have 10 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
            "with no extra text. Strictly follow this format. Max response length: 120 words (tokens).\n"
            "<|im_end|>\n<|im_start|>assistant\n<think>")
    lake = ("<|im_start|>system\nYou're a helpful assistant. You are solving the FrozenLake puzzle. The observation "
            "includes both a symbol grid and zero-indexed coordinates for the start, goal, player, and any holes.\n"
            "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\n"
            "Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.\n"
            "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n\n"
            "The meaning of each symbol in the state is:\n"
            "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal\n"
            "Your available actions are:\nLeft, Down, Right, Up\n"
            'You can make up to 10 actions, separated by the action separator " || "\n<|im_end|>\n'
            "<|im_start|>user\n\nTurn 1:\nState:\nCoordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\n"
            "Start: (2, 0)\nGoal: (0, 1)\nPlayer: (2, 0)\nHoles: (1, 3), (2, 2)\nGrid Map: \n_G__\n___O\nP_O_\n____\n" + tail)
    for name in ("CoordFrozenLake", "CoordFrozenLakeDet"):  # RAGEN-2's lake for seed 10001 (p 0.9): the same in both
        preset = FROZENLAKE_PRESETS[name]
        assert first_prompt(model, tok, preset, FrozenLakeEnv(**preset["kwargs"]), 10001) == lake
    room = ("<|im_start|>system\nYou're a helpful assistant. You are solving the Sokoban puzzle. You are the player and "
            "you need to push all boxes to targets.\nYou are provided with a symbol grid and the zero-indexed coordinates "
            "of the player, each box, and each target. \nCoordinates range from the top-left corner (0, 0) to the "
            "bottom-right corner (5, 5). \nWhen you are exactly next to a box, you can push it by moving in the same "
            "direction. \nYou cannot push a box through a wall, and you cannot pull a box.\n"
            "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n\n"
            "The meaning of each symbol in the state is:\n"
            "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target\n"
            "Your available actions are:\nUp, Down, Left, Right\n"
            'You can make up to 10 actions, separated by the action separator " || "\n<|im_end|>\n'
            "<|im_start|>user\n\nTurn 1:\nState:\nCoordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\n"
            "Targets: (1, 1)\nBoxes: (3, 1)\nPlayer: (4, 2)\n"
            "Grid Map: \n######\n#O####\n#__###\n#X_###\n#_P_##\n######\n" + tail)
    preset = SOKOBAN_PRESETS["CoordSokoban"]
    assert first_prompt(model, tok, preset, SokobanEnv(**preset["kwargs"]), 10000) == room
    # v1 presets: the system message is "You're a helpful assistant. " alone, the instruction opens the user message
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    assert first_prompt(model, tok, preset, SokobanEnv(**preset["kwargs"]), 10000) == (
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n" + preset["instruction"]
        + "\nTurn 1:\nState:\n######\n#O####\n#__###\n#X_###\n#_P_##\n######\n" + tail.replace("120 words", "100 words"))
    # single_turn retells earlier turns in the user message; the instruction stays in the system message (RAGEN-2)
    preset = SOKOBAN_PRESETS["CoordSokoban"]
    out = rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"])], [10000],
                          loop_settings(preset, max_turns=2, max_new_tokens=2, window=2, window_mode="single_turn"),
                          group_size=1)
    second = tok.decode(out["tokens"][1][out["attention_mask"][1]])  # the row of turn 2
    assert second.startswith(room.split("<|im_start|>user\n")[0] + "<|im_start|>user\nSummary: 1 step(s) completed")


def test_reward_line_is_ragen2s(tiny):
    # RAGEN-2 es_manager._execute_actions: acc_reward = 0, then acc_reward += reward for each executed action; the
    # next turn opens with ctx_manager's f"Reward:\n{content['reward']}\n" and single_turn retells simple_memory's
    # f"Turn {t} Reward: {h_turn['reward']}\n". FrozenLake's rewards are gymnasium's ints (reward_schedule (1, 0, 0)),
    # so a lake turn prints 0; Sokoban's are gym_sokoban's floats (0 + -0.1 + -0.1 = -0.2); a turn that executes
    # nothing prints the starting 0 in every env
    model, tok = tiny
    preset = FROZENLAKE_PRESETS["CoordFrozenLakeDet"]
    out = rollout.rollout(model, tok, [FrozenLakeEnv(**preset["kwargs"])], [10001],
                          loop_settings(preset, max_turns=2, max_new_tokens=40, think=False), group_size=1,
                          respond=lambda b, env: "Right</answer>", sampler=sampler.Sampler())
    assert "<|im_start|>user\nReward:\n0\n\nTurn 2:\n" in out["text"][0]
    out = rollout.rollout(model, tok, [FrozenLakeEnv(**preset["kwargs"])], [10001],
                          loop_settings(preset, max_turns=2, max_new_tokens=40, think=False, window=2,
                                        window_mode="single_turn"),
                          group_size=1, respond=lambda b, env: "Right</answer>", sampler=sampler.Sampler())
    assert "\nTurn 1 Reward: 0\n---\n" in tok.decode(out["tokens"][1][out["attention_mask"][1]])
    preset = SOKOBAN_PRESETS["CoordSokoban"]
    answers = {0: "Up || Up</answer>", 1: "Jump</answer>"}  # two steps; nothing valid
    out = rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(2)], [10000, 10000],
                          loop_settings(preset, max_turns=2, max_new_tokens=40, think=False), group_size=2,
                          respond=lambda b, env: answers[b], sampler=sampler.Sampler())
    assert "<|im_start|>user\nReward:\n-0.2\n\nTurn 2:\n" in out["text"][0]
    assert "<|im_start|>user\nReward:\n0\n\nTurn 2:\n" in out["text"][1]


# ------------------------------------------------------------------ WebShop: catalog, goals, splits
@pytest.fixture(scope="module")
def env():
    return W.WebShopEnv(**W.PRESETS["WebShop"]["kwargs"])  # the catalog + index are built once per process


def test_catalog_and_goals_are_deterministic():
    a, b, c = W.generate_catalog(300, seed=7), W.generate_catalog(300, seed=7), W.generate_catalog(300, seed=8)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)
    assert W.build_goals(a, 7) == W.build_goals(b, 7)
    assert len({p["asin"] for p in a}) == 300 and all(len(p["asin"]) == 10 for p in a)


def test_same_seed_same_episode(env):
    other = W.WebShopEnv(**W.PRESETS["WebShop"]["kwargs"])
    assert other.shop is env.shop  # shared module-level cache, built once
    rng = random.Random(0)
    assert env.reset(123, "val") == other.reset(123, "val")
    for _ in range(8):
        action = rng.choice(env.actions()).replace("<content>", env.goal["query"])
        assert env.step(action) == other.step(action)
    assert env.reset(1, "train") != env.reset(2, "train")


def test_goals_built_the_webshop_way(env):
    shop = env.shop
    goals, by_asin = shop["goals"], shop["by_asin"]
    assert 3000 <= len(goals) and shop["splits"] == dict(test=500, val=1000, train=len(goals) - 1500)
    per_product = {}
    for g in goals:
        per_product[g["asin"]] = per_product.get(g["asin"], 0) + 1
        p = by_asin[g["asin"]]
        assert g["instruction_text"].startswith(p["instruction_text"]) and set(g["attributes"]) <= set(p["Attributes"])
        assert g["price_upper"] > p["price"] and g["price_upper"] - p["price"] < 41  # 2nd-4th $10 step above
    for asin, n in per_product.items():  # one goal per combination of the product's option values
        assert n == math.prod(len(v) for v in by_asin[asin]["options"].values())
    g = next(g for g in goals if len(g["goal_options"]) == 2)
    (k1, v1), (k2, v2) = sorted(g["goal_options"].items())
    suffix = f" with {k1}: {v1}, and {k2}: {v2}, and price lower than {g['price_upper']:.2f} dollars"
    assert g["instruction_text"].endswith(suffix)


def test_split_arithmetic_and_disjointness(env):
    shop, seen = env.shop, {}
    for split, n in shop["splits"].items():
        seen[split] = set()
        for seed in range(n):
            env.reset(seed, split)
            seen[split].add(id(env.goal))
        assert len(seen[split]) == n
    assert not (seen["test"] & seen["val"] or seen["test"] & seen["train"] or seen["val"] & seen["train"])
    env.reset(10007, "train")  # RAGEN: train idx = 1500 + seed % (N - 1500), then the Random(42) permutation
    assert env.goal is shop["goals"][shop["perm"][1500 + 10007 % (len(shop["goals"]) - 1500)]]
    env.reset(623, "val")
    assert env.goal is shop["goals"][shop["perm"][500 + 623 % 1000]]
    small = W.load_shop(num_products=100, catalog_seed=3)  # small catalogs split 10/20/70%
    assert sum(small["splits"].values()) == len(small["goals"]) and small["splits"]["test"] >= 1
    with pytest.raises(ValueError):
        env.reset(0, "dev")


def test_every_goal_is_reachable_with_reward_one(env):
    shop = env.shop  # the invariant the oracle relies on: the target with the goal's options scores 1.0
    for g in shop["goals"]:
        assert W.webshop_reward(g, shop["by_asin"][g["asin"]], g["goal_options"])[0] == 1.0


# ------------------------------------------------------------------ WebShop: pages and actions
def test_pages_text_and_actions(env):
    env.reset(4, "test")
    goal, instr = env.goal, env.goal["instruction_text"]
    assert env.obs == f"Instruction: {instr}" and env.actions() == ["search[<content>]"]
    assert env._page_text() == f"WebShop [SEP] Instruction: [SEP] {instr} [SEP] Search"
    obs, reward, done, info = env.step(f"search[{W.search_words(goal)}]")
    assert (reward, done, info["action_is_valid"], info["action_is_effective"]) == (0.0, False, True, True)
    page1 = [env.shop["by_asin"][a] for a in env.results[:10]]
    head = (f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] Page 1 (Total results: {len(env.results)}) "
            "[SEP] Next >")
    assert env.obs == head + "".join(f" [SEP] {p['asin']} [SEP] {p['Title']} [SEP] {p['Price']}" for p in page1)
    assert env.actions() == ["click[back to search]", "click[next >]"] + [f"click[{p['asin'].lower()}]" for p in page1]
    assert obs.startswith(env.obs + "." + W.RENDER_INSTRUCTIONS[0]) and obs.endswith(
        "\n You must choose from these actions:" + ", ".join(env.actions()) + ".")
    env.step("click[next >]")
    assert "Page 2 " in env.obs and env.actions()[:3] == ["click[back to search]", "click[< prev]", "click[next >]"]
    for _ in range(3):
        env.step("click[next >]")
    obs, _, _, info = env.step("click[next >]")  # page 6 of 50 results: empty, and RAGEN hides next >
    assert env.actions() == ["click[back to search]", "click[< prev]"] and info["end_of_page"] == 1
    assert env.step("click[next >]")[3]["action_is_valid"] is False
    env.step("click[back to search]")
    env.step(f"search[{goal['name']}]")
    p = env.shop["by_asin"][goal["asin"]]
    env.step(f"click[{p['asin'].lower()}]")
    values = [v for vs in p["options"].values() for v in vs]
    assert env.actions() == ["click[back to search]", "click[< prev]", "click[description]", "click[features]",
                             "click[reviews]", "click[buy now]"] + [f"click[{v}]" for v in values]
    options = "".join(f" [SEP] {k} [SEP] " + " [SEP] ".join(vs) for k, vs in p["options"].items())
    assert env.obs == (f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] < Prev{options} [SEP] {p['Title']} "
                       f"[SEP] Price: {p['Price']} [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews "
                       f"[SEP] Buy Now")
    item_page = env.obs
    env.step("click[features]")
    assert env.obs.endswith("< Prev [SEP] " + " [SEP] ".join(p["BulletPoints"]))
    assert env.actions() == ["click[back to search]", "click[< prev]"]
    env.step("click[< prev]")
    assert env.obs == item_page
    env.step("click[reviews]")
    assert env.obs.endswith("[SEP] < Prev")  # WebShop's reviews are always empty
    env.step("click[< prev]")
    env.step("click[< prev]")  # item -> the results page it came from
    assert env.obs.startswith(f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] Page 1 ")


def test_option_clicks_and_buying(env):
    env.reset(11, "test")
    goal = env.goal
    env.step(f"search[{goal['name']}]")
    env.step(f"click[{goal['asin'].lower()}]")
    for name, value in goal["goal_options"].items():
        _, reward, done, info = env.step(f"CLICK[{value.upper()}]")  # case-insensitive, as WebShop lower-cases
        assert info["action_is_valid"] and not info["action_is_effective"]  # text mode shows no selection
        assert env.options[name] == value and (reward, done) == (0.0, False)
    _, reward, done, info = env.step("click[buy now]")
    assert (reward, done, info["success"], info["success_purchase"]) == (1.0, True, True, 1)
    assert info["r_type"] == 1.0 and info["r_att"] == 1.0 and info["r_price"] == 1.0
    assert env.step("click[buy now]") == (env.render(), 0.0, True, dict(action_is_valid=False,
                                                                        action_is_effective=False, success=False))


def test_garbage_and_unavailable_actions_are_no_ops(env):
    env.reset(3, "val")
    garbage = ["", "   ", "click", "click[]", "search[]", "search[   ]", "buy now", "click[buy now]", "click[< prev]",
               "jump[up]", "[x]", "<answer>search[x]</answer>", "click[b0zzzzzzzz]", "\x00\n[]", "seek[x]",
               "click[next >]", "Up", "click[search]", 42, None]
    for action in garbage + [str(i) * 50 for i in range(3)]:
        before = (env.render(), env.page)
        assert env.step(action) == (before[0], 0.0, False, dict(action_is_valid=False, action_is_effective=False,
                                                                success=False))
        assert (env.render(), env.page) == before
    env.step("search[coffee]")
    env.step(env.actions()[-1])  # open a product
    page = env.obs
    _, _, _, info = env.step("search[dress]")  # WebShop would search from here; the available list never offers it
    assert not info["action_is_valid"] and env.obs == page
    rng = random.Random(0)
    for seed in range(300):  # random strings and random mutations of valid actions never raise
        env.reset(seed, "train")
        for _ in range(12):
            act = rng.choice(env.actions()).replace("<content>", "tea")
            act = rng.choice([act, act.upper(), act[:-1], act + "]", act.replace("[", " "), "".join(
                rng.choice("[]click search <>") for _ in range(rng.randint(0, 12)))])
            _, reward, done, info = env.step(act)
            assert 0.0 <= reward <= 1.0 and {"action_is_valid", "action_is_effective", "success"} <= set(info)
            if done:
                assert env.actions() == [] and env.step("click[buy now]")[1:3] == (0.0, True)
                break


# ------------------------------------------------------------------ WebShop: policies
def test_oracle_reaches_one_on_200_goals(env):
    for split, seeds in (("test", range(200)), ("val", range(20)), ("train", range(10000, 10020))):
        for seed in seeds:
            reward, info, _ = W.run_oracle(env, seed, split)
            assert reward == 1.0 and info["success"], (split, seed)


def test_webshop_oracle_action_buys_the_target():
    env = W.WebShopEnv()
    for seed in range(20):
        env.reset(seed, "test")
        for _ in range(9):
            _, reward, done, info = env.step(W.oracle_action(env))
            if done:
                break
        assert info["success"], seed


def test_random_clicker_scores_far_lower(env):
    runs = [W.run_random(env, seed, "test") for seed in range(300)]
    mean, success = statistics.mean(r for r, _ in runs), statistics.mean(i["success"] for _, i in runs)
    assert mean < 0.25 and success < 0.05


def test_bm25_finds_the_target_in_the_top_10_on_most_goals(env):
    shop = env.shop
    goals = shop["goals"][:400]
    hits = [g["asin"] in {shop["products"][d]["asin"] for d in shop["index"].search(W.search_words(g), 10)}
            for g in goals]
    assert sum(hits) / len(hits) >= 0.8


def test_bm25_scores_hand_worked():
    index = W.BM25Index(["red shoe", "blue shoes shoes", "green hat of the year"])
    idf = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # "shoe" is in 2 of 3 documents
    avgdl = (2 + 3 + 3) / 3  # "of", "the" are stop words; "shoes" stems to "shoe"
    s0 = idf * 1 / (1 + 0.9 * (1 - 0.4 + 0.4 * 2 / avgdl))
    s1 = idf * 2 / (2 + 0.9 * (1 - 0.4 + 0.4 * 3 / avgdl))
    assert index.search("Shoes") == [1, 0] and index.search("the") == [] and index.search("hat blue")
    scores = {}
    for d, tf in index.postings["shoe"]:
        scores[d] = index.idf["shoe"] * tf / (tf + index.norm[d])
    assert scores[0] == pytest.approx(s0) and scores[1] == pytest.approx(s1)
    assert [W.stem(w) for w in ("dresses", "batteries", "glass", "shoes", "cups")] == ["dress", "battery", "glass",
                                                                                         "shoe", "cup"]


# ------------------------------------------------------------------ WebShop: reward (hand-worked)
GOAL = dict(asin="B000000001", query="women's dresses", name="Acme Women's Long Sleeve Dress",
            product_category="Clothing, Shoes & Jewelry › Women › Clothing › Dresses",
            nouns=["acme", "women", "dress"],
            attributes=["machine wash", "long sleeve"], goal_options={"color": "black", "size": "x-large"},
            price_upper=40.0, instruction_text="Find me machine wash women's dresses with long sleeve")


def product(**kw):
    p = dict(asin="B000000001", query="women's dresses", Title="Acme Women's Long Sleeve Dress",
             product_category=GOAL["product_category"], nouns=["acme", "women", "dress"],
             Attributes=["machine wash", "long sleeves"], BulletPoints=[], Description="", price=30.0)
    p.update(kw)
    return p


def test_reward_partial_credit_exact():
    R = W.webshop_reward
    assert R(GOAL, product(), {"color": "black", "size": "x-large"})[0] == 1.0  # D = 2 attributes + 2 options + 1
    assert R(GOAL, product(), {"color": "navy", "size": "x-large"})[0] == pytest.approx(4 / 5)  # wrong option
    assert R(GOAL, product(price=40.0), {"color": "black", "size": "x-large"})[0] == 1.0  # at the bound: ok
    assert R(GOAL, product(price=45.0), {"color": "black", "size": "x-large"})[0] == pytest.approx(4 / 5)  # over
    reward, info = R(GOAL, product(price=45.0), {"color": "navy"})
    assert reward == pytest.approx(2 / 5) and info["r_option"] == 0.0 and info["r_price"] is False
    assert info["w_att"] == pytest.approx(2 / 5) and info["w_option"] == pytest.approx(2 / 5)
    assert R(GOAL, product(), {"size": "large", "color": "black"})[0] == 1.0  # quirk: "large" counts for "x-large"
    assert R(dict(GOAL, goal_options={"size": "large"}), product(), {"size": "x-large"})[0] == pytest.approx(3 / 4)
    assert R(dict(GOAL, goal_options={"color": "light blue"}), product(), ["light blue"])[0] == 1.0  # -> "blue"
    reward, info = R(dict(GOAL, goal_options={}), product(price=99.0), {})  # no options: D = 2 + 0 + 1
    assert reward == pytest.approx(2 / 3) and "r_option" not in info


def test_attribute_fuzzy_and_substring_matching():
    R, opts = W.webshop_reward, {"color": "black", "size": "x-large"}
    assert R(GOAL, product(Attributes=["DUMMY_ATTR"]), opts)[0] == pytest.approx(4 / 5)  # "long sleeve" in the title
    fuzzy = product(Attributes=["machine washable", "long sleeves"], Title="Acme Dress")  # ratios 86 and 96 > 85
    assert R(GOAL, fuzzy, opts)[0] == 1.0
    bullets = product(Attributes=["DUMMY_ATTR"], Title="Acme Dress", BulletPoints=["Machine wash cold, LONG SLEEVE"])
    assert R(GOAL, bullets, opts)[0] == 1.0
    described = product(Attributes=["cotton"], Title="Acme Dress", Description="hand wash only")
    assert R(GOAL, described, opts)[1]["r_att"] == 0.0


def test_type_reward_branches():
    T = W.type_reward
    other = dict(query="men's sandals", product_category="Shoes › Men › Sandals")
    assert T(GOAL, product(nouns=["zed", "dress"]))[0] == 1.0  # same query, title score 1/3
    assert T(GOAL, product(nouns=["acme", "sandal"], **other)) == (1.0, False, False, pytest.approx(1 / 3))
    goal5 = dict(GOAL, nouns=["acme", "women", "dress", "pockets", "party"])
    assert T(goal5, product(nouns=["acme"], **other))[0] == 0.5  # title score 0.2 is not > 0.2
    assert T(goal5, product(nouns=["acme"]))[0] == 1.0  # ... but the query matches
    cat2 = dict(query="x", product_category="Clothing, Shoes & Jewelry › Women › Shoes")  # 2 shared levels
    assert T(goal5, product(nouns=["acme"], **cat2))[:3] == (1.0, False, True)
    goal11 = dict(GOAL, nouns=[f"n{i}" for i in range(11)])
    assert T(goal11, product(nouns=["n0"]))[0] == 0.1  # 1/11 < 0.1 overrides the query match
    assert T(GOAL, product(nouns=["sandal"]))[0] == 0.0  # no shared noun: 0 even for the same query
    assert T(dict(GOAL, nouns=[]), product(nouns=[], **other)) == (0.5, False, False, 0.2)  # no goal nouns: 0.2
    assert W.webshop_reward(GOAL, product(nouns=["sandal"]), {"color": "black", "size": "x-large"})[0] == 0.0


def test_token_set_ratio_and_normalize_color():
    golden = [("black", ("color", "black"), 100), ("blue", ("color", "dark blue"), 100),  # WebShop's thefuzz token_set_ratio
              ("x-large", ("size", "large"), 83), ("large", ("size", "x-large"), 100),
              ("small", ("size", "x-small"), 100), ("medium", ("size", "large"), 25),
              ("light blue", ("color", "blue"), 60), ("machine wash", "machine washable", 86),
              ("long sleeve", "long sleeves", 96), ("16 ounce (pack of 2)", ("size", "16 ounce (pack of 3)"), 94),
              ("", "anything", 0), ("Ünïcode!!", "unicode", 83), ("a b", "b a", 100), ("abc", "xyz", 0)]
    for a, b, want in golden:
        assert W.token_set_ratio(a, b) == want, (a, b)
    assert W.normalize_color("light blue") == "blue" and W.normalize_color("rose gold") == "gold"  # list order
    assert W.normalize_color(("color", "black")) == "black"  # a tuple: exact element membership only
    assert W.normalize_color(("color", "dark blue")) == ("color", "dark blue")
    for name, values in W.OPTION_POOLS.values():  # catalog values never hit a colour inside a longer word
        for v in values.split("|"):
            assert W.normalize_color(v) == v or W.normalize_color(v) in v.split(), v


def test_indel_ratio_matches_dynamic_programming():
    def lcs(a, b):
        row = [0] * (len(b) + 1)
        for ch in a:
            prev, row = row, [0]
            for j, cb in enumerate(b):
                row.append(prev[j] + 1 if ch == cb else max(prev[j + 1], row[j]))
        return row[-1]
    rng = random.Random(0)
    for _ in range(500):
        a, b = ("".join(rng.choice("ab c") for _ in range(rng.randint(0, 70))) for _ in range(2))
        if a or b:
            assert W._indel_ratio(a, b) == pytest.approx(200 * lcs(a, b) / (len(a) + len(b)))


# ------------------------------------------------------------------ WebShop: presets and the real-data loader
def test_presets():
    assert set(W.PRESETS) == {"WebShop"}
    p = W.PRESETS["WebShop"]
    assert set(p) == {"kwargs", "instruction", "max_actions_per_traj", "max_tokens", "max_turns", "max_actions_per_turn", "max_context"}
    assert (p["max_actions_per_traj"], p["max_tokens"], p["max_turns"], p["max_actions_per_turn"]) == (9, 200, 9, 1)
    assert p["instruction"].startswith("You are browsing an online shop.") and p["instruction"].endswith(
        "Valid answer is search[<keywords>] or click[<clickable>].")
    assert len(W.RENDER_INSTRUCTIONS) == 8 and len(W.COLOR_SET) == 102


def test_real_data_loader(tmp_path, monkeypatch):
    items = [
        dict(asin="B01AAAAAAA", name="Acme Men's Slim Fit Shirt", category="fashion", query=" Men's Shirts ",
             product_category="Clothing › Men › Shirts", full_description="A shirt.", small_description=["Soft"],
             pricing="$19.99$27.99", customization_options={"Color": [{"value": "Black/White "}, {"value": "Navy"},
                                                                      {"value": "Red"}],
                                                            "Size": [{"value": "Large"}], "Style": None}),
        dict(asin="B01BBBBBBB", name="Plain Mug", category="garden", query="mugs", product_category="Kitchen › Mugs",
             full_description=None, small_description=[], pricing="", customization_options=None),
        dict(asin="B01AAAAAAA", name="duplicate"), dict(asin="nan", name="no asin"),
        dict(asin="B01CCCCCCCCC", name="asin too long"),
    ]
    attrs = {"B01AAAAAAA": dict(attributes=["slim fit", "machine wash"], instruction="Find me slim fit men's shirts",
                                instruction_attributes=["slim fit"])}
    (tmp_path / "items.json").write_text(json.dumps(items))
    (tmp_path / "attrs.json").write_text(json.dumps(attrs))
    products = W.load_webshop_json(str(tmp_path / "items.json"), str(tmp_path / "attrs.json"))
    assert [p["asin"] for p in products] == ["B01AAAAAAA", "B01BBBBBBB"]
    shirt, mug = products
    assert shirt["pricing"] == [19.99, 27.99] and shirt["Price"] == "$19.99 to $27.99"
    assert 19.99 <= shirt["price"] <= 27.99 and shirt["query"] == "men's shirts"
    assert shirt["options"] == {"color": ["black | white", "navy", "red"], "size": ["large"]}
    assert mug["pricing"] == [100.0] and mug["Price"] == "$100.0" and mug["Attributes"] == ["DUMMY_ATTR"]
    assert mug["Description"] == "" and mug["options"] == {}
    env = W.WebShopEnv(items_path=str(tmp_path / "items.json"), attrs_path=str(tmp_path / "attrs.json"))
    assert len(env.shop["goals"]) == 3 and env.shop["splits"] == dict(test=1, val=1, train=1)  # 3 colours x 1 size
    for split in ("train", "val", "test"):
        assert W.run_oracle(env, 0, split)[0] == 1.0
    monkeypatch.setattr(W, "MAX_JSON_BYTES", 100)
    with pytest.raises(ValueError, match="refused"):
        W.load_webshop_json(str(tmp_path / "items.json"), str(tmp_path / "attrs.json"))
    with pytest.raises(FileNotFoundError):
        W.load_webshop_json(str(tmp_path / "missing.json"), str(tmp_path / "attrs.json"))


# ------------------------------------------------------------------ Countdown
def ragen_has_solution(nums, target):
    """RAGEN countdown has_solution, as a plain loop: pad to 4 numbers with zeros, try all 16 sign vectors."""
    padded = nums + [0] * (4 - len(nums))
    return any(sum(s * n for s, n in zip(signs, padded)) == target for signs in itertools.product([1, -1], repeat=4))


def test_countdown_generated_tasks_are_solvable():
    env = CD.CountdownEnv(**CD.PRESETS["Countdown"]["kwargs"])
    for seed in [*range(500), *range(10_000, 10_500)]:  # 500 validation and 500 training tasks
        obs = env.reset(seed)
        assert obs == f"Target: {env.target}, nums: {env.nums}"
        assert len(env.nums) in (3, 4) and all(1 <= n <= 99 for n in env.nums) and 1 <= env.target <= 100
        assert ragen_has_solution(env.nums, env.target)  # RAGEN keeps only these
        expr = CD.solve(env.nums, env.target)            # brute force over + - * /, exact
        assert expr is not None
        assert env.step(expr) == ("Your answer get 1.0 points.", 1.0, True,
                                  dict(action_is_valid=True, action_is_effective=True, success=True))


def test_countdown_reward_hand_picked_answers():
    nums, target = [44, 19, 35], 98  # the public set's first row
    cases = [
        ("44 + 19 + 35", 1.0), ("(44 + 35) + 19", 1.0), (" 35--19+44 ", 1.0), ("((44)) + (19 + (35))", 1.0),
        ("44 * 19 / 35", 0.1), ("44 - 19 - 35", 0.1),            # right numbers, wrong value
        ("44 + 19 + 35.", 0.1), ("44 ** 19 + 35", 0.1), ("44 + 19 35", 0.1), ("44 // 19 + 35", 0.1),  # not ours
        ("44 + 19 + 35 = 98", 0.0), ("44 + 19", 0.0), ("44 + 19 + 36", 0.0), ("44 + 19 + 35 + 0", 0.0), ("", 0.0),
        ("__import__('os')", 0.0), ("9**9**9", 0.0), ("(" * 10_000 + "44 + 19 + 35" + ")" * 10_000, 0.0),
        ("1" * 100_000, 0.0), ("x" * 100_000, 0.0), ("44 + 19 + 35" + " " * 100_000, 0.0),  # over-long: not read
        ("__import__('os').system('rm 44 19 35')", 0.1),  # right numbers, never executed
        ("(" * 40 + "44 + 19 + 35" + ")" * 40, 0.1), ("(" * 30 + "44 + 19 + 35" + ")" * 30, 1.0),  # depth bound 32
        ("-" * 40 + "44 + 19 + 35", 0.1),
    ]
    for answer, want in cases:
        assert CD.score(answer, nums, target) == want, answer[:50]
    assert CD.score("9**9**9", [9, 9, 9], 5) == 0.1  # right numbers: parsed, refused, never computed
    assert CD.score("5 / (3 - 3)", [3, 3, 5], 5) == 0.1 and CD.score("5 + 3 - 3", [3, 3, 5], 5) == 1.0
    assert CD.score("(3 / 3 - 1) / (3 - 3)", [3, 3, 1, 3, 3], 0) == 0.1  # 0/0 too
    assert CD.evaluate("1 / 3 * 3") == 1 and CD.evaluate("7 / 2") == Fraction(7, 2)  # exact, no floats


def test_countdown_episode_protocol():
    env = CD.CountdownEnv()
    with pytest.raises(RuntimeError):
        env.step("1")
    obs = env.reset(123)
    assert env.render() == obs and env.actions() is None
    assert env.step(None) == (obs, 0.0, False, dict(action_is_valid=False, action_is_effective=False, success=False))
    out = env.step("1 + 2")  # any string is the one answer (RAGEN: always valid) and ends the episode
    assert out[1:] == (0.0, True, dict(action_is_valid=True, action_is_effective=False, success=False))
    assert out[0] == env.render() == "Your answer get 0.0 points."
    assert env.step(CD.solve(env.nums, env.target)) == (out[0], 0.0, True,
                                                        dict(action_is_valid=False, action_is_effective=False, success=False))
    p = CD.PRESETS["Countdown"]
    assert p["instruction"].startswith("You are solving the Countdown puzzle. You should use the num list to create")
    assert p["instruction"].endswith("So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>")
    assert (p["max_actions_per_traj"], p["max_turns"], p["max_actions_per_turn"], p["max_tokens"]) == (1, 1, 1, 100)
    assert p["instruction_in_system"] is True  # RAGEN-2's preset: the instruction is in the system message


def test_countdown_prompt_is_ragen2s(tiny):
    # RAGEN-2 ctx_manager: system = "You're a helpful assistant. " + env_instruction, nothing more: CountdownEnvConfig
    # has no grid_vocab and no action_lookup, so no legend and no action list (the instruction ends at "</answer>",
    # right before <|im_end|>); the first user message is the "\nTurn 1:" block alone, with max_actions_per_traj 1 left
    # and the tag's max_tokens 100. Written out by hand from config/envs.yaml, through the tiny model's ChatML
    model, tok = tiny
    preset = CD.PRESETS["Countdown"]
    assert first_prompt(model, tok, preset, CD.CountdownEnv(**preset["kwargs"]), 10000) == (
        "<|im_start|>system\nYou're a helpful assistant. You are solving the Countdown puzzle. You should use the num "
        "list to create an equation that equals the target. Example answer format: <think> To find an equation using "
        "[3, 5, 2] to get 4. Let's check 2 + 5 = 7, 7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - "
        "3</answer><|im_end|>\n<|im_start|>user\n\nTurn 1:\nState:\nTarget: 12, nums: [92, 16, 88]\n"
        "You have 1 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
        "with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n"
        "<|im_end|>\n<|im_start|>assistant\n<think>")


def random_tree(rng, depth):
    """(text, exact value or None on a division by zero) of a random expression, built by the test itself."""
    if depth == 0 or rng.random() < 0.3:
        n = rng.randint(0, 120)
        return (f"-{n}", Fraction(-n)) if rng.random() < 0.1 else (str(n), Fraction(n))
    (ta, a), (tb, b) = random_tree(rng, depth - 1), random_tree(rng, depth - 1)
    op = rng.choice("+-*/")
    value = None if a is None or b is None or (op == "/" and b == 0) else \
        {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[op]()
    sp = rng.choice(["", " ", "  "])
    return f"({ta}{sp}{op}{sp}({tb}))", value


def test_countdown_evaluator_matches_tree_values():
    rng = random.Random(0)
    for _ in range(3000):
        text, value = random_tree(rng, rng.randint(0, 4))
        if len(text) <= CD.MAX_ANSWER_CHARS:
            assert CD.evaluate(text) == value, text
    # precedence and associativity, hand-worked
    for text, value in [("2 + 3 * 4", 14), ("2 * 3 + 4", 10), ("10 - 4 - 3", 3), ("48 / 4 / 2", 6), ("-3 * -2", 6),
                        ("2 - (3 - 4)", 3), ("+-+5", -5), ("(1 + 2) * (3 + 4)", 21), ("6 / 4 * 2", 3)]:
        assert CD.evaluate(text) == value, text
    for text in ["", "()", "1 +", "* 2", "(1", "1)", "1 2", "1..2", "1e3", "0x10", "½", "٣ + 1", "1 ^ 2", "abs(1)"]:
        assert CD.evaluate(text) is None, text


def test_countdown_train_and_validation_never_share_a_task():
    env = CD.CountdownEnv()
    key = lambda seed: (env.reset(seed), (env.target, tuple(sorted(env.nums))))[1]
    val = {key(s) for s in range(123, 123 + 1000)}                 # train.py --val-seed 123 and on
    train = {key(s) for s in range(10_000, 10_000 + 2000)}         # train.py --seed 10000 and on
    assert len(val) > 950 and len(train) > 1950 and not val & train
    assert all(CD.is_val_task(t, list(n)) for t, n in val) and not any(CD.is_val_task(t, list(n)) for t, n in train)
    other = CD.CountdownEnv()
    for seed in (0, 123, 9_999, 10_000, 2**40):
        assert other.reset(seed) == env.reset(seed)  # same seed, same task, from a fresh env


def test_countdown_garbage_never_raises():
    env, rng = CD.CountdownEnv(), random.Random(0)
    garbage = ["", " ", "\n", "\x00", "1 || 2", "<answer>1</answer>", "\ud800", "🐉", "1" * 1_000_000, "(" * 300,
               ")" * 300, "-" * 300, "1/" * 100 + "0", "((((((1", "9" * 250, "9" * 5000, "1e308 * 1e308"]
    for _ in range(2000):  # random unicode mixed with digits and operators
        garbage.append("".join(chr(rng.randrange(0x110000)) if rng.random() < 0.3 else rng.choice("0123456789+-*/() ")
                               for _ in range(rng.randrange(40))))
    for i, answer in enumerate(garbage):
        env.reset(i % 7)
        obs, reward, done, info = env.step(answer)
        assert reward in (0.0, 0.1, 1.0) and done is True and info["action_is_valid"] is True
        assert obs == f"Your answer get {reward} points." and info["success"] == (reward == 1.0)
    for junk in (None, 3, b"1 + 2", ["1"]):
        obs = env.reset(0)
        assert env.step(junk) == (obs, 0.0, False, dict(action_is_valid=False, action_is_effective=False, success=False))


def test_countdown_leaf_and_wiring():
    code = "import sys, env_countdown; bad = {'torch', 'numpy', 'transformers'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE)
    assert agent.ENV_CLASSES["Countdown"][0] is CD.CountdownEnv and agent.preset_name("countdown") == "Countdown"
    for name in NEW_PRESETS:
        assert name in agent.ENV_CLASSES
    for script in ("train.py", "eval.py", "sft.py", "bench.py"):  # one registry, agent.py's: the scripts take it from there
        src = open(os.path.join(HERE, script)).read()
        assert "agent.ENV_CLASSES" in src and "ENV_CLASSES = {" not in src and "import env_" not in src, script


# ------------------------------------------------------------------ the terminal player (play.py)
def typed(lines):
    """play.main's read(): the lines in order, then the end of input."""
    it = iter(lines)

    def read(prompt):
        print(prompt, end="")
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


@pytest.mark.parametrize("cls,preset,argv", [
    (BanditEnv, "Bandit", []), (SokobanEnv, "SimpleSokoban", []), (FrozenLakeEnv, "CoordFrozenLakeDet", []),
    (W.WebShopEnv, "WebShop", ["--split", "train"]), (CD.CountdownEnv, "Countdown", []), (env_cue.CueEnv, "CueDelay", [])])
def test_the_terminal_player_plays_a_solver_session_in_every_env(cls, preset, argv, capsys):
    # every env file's __main__ is play.main(cls): the env's solver's actions, found on a twin env, typed in, win the
    # episode; each step shows its reward, and the prompt lists the env's actions (Countdown's answer is free text)
    # and how to stop (q, or where q is an action, the end of input)
    import play
    module = sys.modules[cls.__module__]
    twin, moves, done = cls(**module.PRESETS[preset]["kwargs"]), [], False
    twin.reset(3)  # WebShop: the train split, as --split train
    first = twin.actions()
    while not done:
        moves += module.solver_actions(twin, 1)
        done = twin.step(moves[-1])[2]
    total, success = play.main(cls, ["--preset", preset, "--seed", "3", *argv], read=typed(moves))
    out = capsys.readouterr().out
    assert success and out.count("\nreward ") == len(moves) and out.count("done True") == 1, out
    how = "end of input stops" if "q" in [a.lower() for a in first or []] else "q stops"  # Cue's Q is an action
    assert (f"action ({', '.join(first)}; {how}): " if first else f"answer (free text; {how}): ") in out
    assert "the solver from here" not in out


def test_the_terminal_player_stops_on_q_or_end_of_input_and_shows_the_solver(capsys):
    import play
    assert play.main(SokobanEnv, ["--seed", "3"], read=typed(["Left", "q"])) == (-0.1, False)
    out = capsys.readouterr().out
    assert SOKOBAN_PRESETS["SimpleSokoban"]["instruction"] in out and "action (Up, Down, Left, Right; q stops): " in out
    assert out.endswith("the solver from here: Up\n")
    assert play.main(CD.CountdownEnv, ["--seed", "3"], read=typed([])) == (0.0, False)  # end of input: a solution
    assert capsys.readouterr().out.endswith("the solver from here: ((30 + 25) - (34 - 71))\n")
    # the statistics flags run the env file's print_statistics instead; the file's __main__ is the player
    assert play.main(BanditEnv, ["--random", "20"]) is None and "random policy success" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "env_cue.py", "--seed", "3"], input="Q\n", capture_output=True, text=True,
                       cwd=HERE, timeout=60)
    assert r.returncode == 0 and "'success': True" in r.stdout and r.stderr == "", r.stdout + r.stderr


# ==================================================================================================
# StarPO maths (starpo.py) and collapse diagnostics (collapse.py)
# ==================================================================================================
def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# ------------------------------------------------------------------ slow references (plain Python lists)
def slow_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the masked positions backwards (RAGEN's valid_positions loop)."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = [t for t in range(T) if mask[b][t]]
        last = 0.0
        for i in reversed(range(len(pos))):
            p = pos[i]
            nv = values[b][pos[i + 1]] if i + 1 < len(pos) else 0.0
            last = rewards[b][p] + gamma * nv - values[b][p] + gamma * lam * last
            adv[b][p], ret[b][p] = last, last + values[b][p]
    return adv, ret


def slow_bi_level(rewards, values, mask, gamma, lam, hgamma):
    """Transcription of RAGEN compute_bi_level_gae_advantage_return, one row at a time."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        r = list(rewards[b])
        eos = [t for t in range(T) if rewards[b][t] != 0]
        last = 0.0
        for i in reversed(range(len(eos))):
            nv = values[b][eos[i + 1]] if i + 1 < len(eos) else 0.0
            last = r[eos[i]] + hgamma * nv - values[b][eos[i]] + hgamma * lam * last
            adv[b][eos[i]] = last
        for p in eos:
            r[p] = adv[b][p] + values[b][p]
        pos = [t for t in range(T) if mask[b][t]]
        last = 0.0
        for i in reversed(range(len(pos))):
            p = pos[i]
            if p in eos or i + 1 == len(pos):
                nv, last = 0.0, 0.0
            else:
                nv = values[b][pos[i + 1]]
            last = r[p] + gamma * nv - values[b][p] + gamma * lam * last
            adv[b][p], ret[b][p] = last, last + values[b][p]
    return adv, ret


def random_episode_batch(B=4, T=24, seed=0, turn_rewards=True):
    """Rows of [prompt..., turn, obs, turn, obs, ..., pad], rewards on (some) turn ends."""
    rng = random.Random(seed)
    rewards = [[0.0] * T for _ in range(B)]
    mask = [[0] * T for _ in range(B)]
    for b in range(B):
        t = rng.randint(1, 3)
        while t < T - 2:
            n = rng.randint(1, 4)
            end = min(t + n, T - 1)
            for i in range(t, end):
                mask[b][i] = 1
            if turn_rewards and rng.random() < 0.7:
                rewards[b][end - 1] = rng.choice([-0.1, 0.5, 1.0, -1.0])
            t = end + rng.randint(1, 3)
        if not turn_rewards:
            last = max(i for i in range(T) if mask[b][i])
            rewards[b][last] = rng.choice([0.0, 1.0, -0.3])
    values = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    return rewards, values, mask


# ------------------------------------------------------------------ GAE
def test_gae_two_turns_with_observation_tokens_hand_computed():
    # tokens: prompt | a1 a2 | obs obs | a3 a4 | pad ; rewards on a2 (0.5) and a4 (1.0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 0.5, 0, 0, 0, 1.0, 0]])
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]])  # 9s must be skipped
    adv, ret = starpo.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand: A6 = 1 - .4 = .6; A5 = (.9*.4 - .3) + .72*.6 = .492; A2 = (.5 + .9*.3 - .2) + .72*.492
    # = .92424; A1 = (.9*.2 - .1) + .72*.92424 = .7454528
    assert close(adv, [[0, 0.7454528, 0.92424, 0, 0, 0.492, 0.6, 0]])
    assert close(ret, [[0, 0.8454528, 1.12424, 0, 0, 0.792, 1.0, 0]])


def test_gae_gamma_lam_one_is_return_minus_value():
    rewards, values, mask = random_episode_batch(seed=1, turn_rewards=False)
    r, v, m = torch.tensor(rewards), torch.tensor(values), torch.tensor(mask).bool()
    adv, ret = starpo.gae_advantages(r, v, m, 1.0, 1.0)
    R = r.sum(1, keepdim=True)  # [B, 1] the single terminal reward
    assert close(adv, (R - v) * m) and close(ret, R * m)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_slow_loop(gamma, lam):
    rewards, values, mask = random_episode_batch(seed=2)
    adv, ret = starpo.gae_advantages(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
    sa, sr = slow_gae(rewards, values, mask, gamma, lam)
    assert close(adv, sa) and close(ret, sr)


def test_gae_rejects_reward_off_mask():
    with pytest.raises(ValueError, match="mask 0"):
        starpo.gae_advantages(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]))


def test_bi_level_gae_hand_computed_and_slow_loop():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 0.5, 0, 0, 0, 1.0, 0]])
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]])
    adv, ret = starpo.bi_level_gae(rewards, values, mask, 1.0, 1.0, high_level_gamma=0.5)
    # high level: A(6) = 1 - .4 = .6 -> R6 = 1; A(2) = .5 + .5*.4 - .2 + .5*.6 = .8 -> R2 = 1.
    # low level (gamma = lam = 1, restart at 2 and 6): A6 = .6, A5 = .4 - .3 + .6 = .7, A2 = .8, A1 = .9
    assert close(adv, [[0, 0.9, 0.8, 0, 0, 0.7, 0.6, 0]]) and close(ret, [[0, 1, 1, 0, 0, 1, 1, 0]])
    for seed, (g, l, hg) in enumerate([(1.0, 1.0, 0.95), (0.9, 0.8, 0.7)]):
        rw, vl, mk = random_episode_batch(seed=10 + seed)
        adv, ret = starpo.bi_level_gae(torch.tensor(rw), torch.tensor(vl), torch.tensor(mk), g, l, hg)
        sa, sr = slow_bi_level(rw, vl, mk, g, l, hg)
        assert close(adv, sa) and close(ret, sr)


def test_bi_level_with_one_terminal_reward_equals_gae():
    rewards, values, mask = random_episode_batch(seed=3, turn_rewards=False)
    r, v, m = torch.tensor(rewards), torch.tensor(values), torch.tensor(mask)
    a1, r1 = starpo.gae_advantages(r, v, m, 0.9, 0.9)
    a2, r2 = starpo.bi_level_gae(r, v, m, 0.9, 0.9, 0.5)
    assert close(a1, a2) and close(r1, r2)


def test_masked_helpers():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert close(starpo.masked_mean(x, m), 2.0)
    assert close(starpo.masked_mean(x, m, dim=1), [1.5, 3.0])
    w = starpo.masked_whiten(x, m)
    std = math.sqrt(((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / 2)  # unbiased over [1, 2, 3]
    assert close(w, [[-1 / std, 0, 0], [1 / std, 0, 0]], 1e-4)
    v = torch.tensor([[1.0, 1.0, 5.0], [4.0, 7.0, 7.0]])
    # masked R = [1, 2, 3], V = [1, 1, 4]: Var[R - V] = Var[0, 1, -1] = 1, Var[R] = 1 (unbiased)
    assert close(starpo.explained_variance(v, x, m), 1 - 1.0 / (1.0 + 1e-5))
    empty = torch.zeros_like(m)
    for out in (starpo.masked_mean(x, empty), starpo.masked_whiten(x, empty), starpo.explained_variance(v, x, empty)):
        assert torch.isfinite(out).all()


# ------------------------------------------------------------------ group advantages and reward normalisation
def test_grpo_advantages():
    s = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 0.3, -0.1, 0.7, 0.2])
    a = starpo.group_advantages(s, torch.arange(12) // 4)
    assert close(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6))  # mean .25, std .5
    assert torch.equal(a[4:8], torch.zeros(4))  # constant group: exactly 0, not NaN
    assert close(a.view(3, 4).mean(1), torch.zeros(3))
    assert close(a[8:].std(), 1.0, 1e-4)
    assert close(starpo.group_advantages(s, torch.arange(12) // 4, "drgrpo")[:4], [0.75, -0.25, -0.25, -0.25])
    # groups of one: veRL's mean 0 and std 1 (RAGEN-2 keeps it), so s / (1 + 1e-6)
    assert torch.equal(starpo.group_advantages(s, torch.arange(12)), s / (1 + 1e-6))
    with pytest.raises(ValueError):
        starpo.group_advantages(s, torch.arange(12), "remax")


def test_turn_advantages_by_hand():
    # two rows: turns are the runs of action tokens (mask 1) between prompt or observation tokens (mask 0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 0, 1, 1, 1]], dtype=torch.float)
    adv = torch.tensor([[9.0, 2.0, 2.0, 9.0, 9.0, -1.0, 9.0], [9.0, 9.0, -3.0, 9.0, 0.5, 0.5, 0.5]]) * mask
    m = starpo.turn_advantages(adv, mask)
    assert set(m) == {"turn1_mean", "turn1_abs_mean", "turn1_tokens", "turn2_mean", "turn2_abs_mean", "turn2_tokens"}
    assert close(m["turn1_mean"], (2 + 2 - 3) / 3) and close(m["turn1_abs_mean"], (2 + 2 + 3) / 3) and m["turn1_tokens"] == 3
    assert close(m["turn2_mean"], (-1 + 1.5) / 4) and close(m["turn2_abs_mean"], (1 + 1.5) / 4) and m["turn2_tokens"] == 4
    assert starpo.turn_advantages(adv, torch.zeros_like(mask)) == {}


def test_update_direction_by_hand():
    # row 0 succeeded (A > 0 on its tokens), row 1 failed (A < 0); mask 0 positions never count
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float)
    adv = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, -1.0, -1.0, 0.5]])
    old = torch.tensor([[9.0, -1.0, -2.0, 9.0], [9.0, -1.0, -1.0, -3.0]])
    new = torch.tensor([[0.0, -0.5, -1.5, 0.0], [0.0, -1.5, -1.0, -2.0]])  # deltas: +0.5 +0.5 | -0.5 0 +1
    m = starpo.update_direction(new, old, adv, mask, torch.tensor([True, False]))
    assert close(m["dlogp_pos_adv"], (0.5 + 0.5 + 1.0) / 3) and close(m["dlogp_neg_adv"], -0.5 / 2)
    assert close(m["dlogp_success"], 0.5) and close(m["dlogp_failure"], 0.5 / 3)
    assert close(m["success_seq_dlogp"], 1.0) and close(m["failure_seq_dlogp"], 0.5)
    assert m["success_pos_adv_fraction"] == 1.0 and close(m["failure_pos_adv_fraction"], 1 / 3)
    none = starpo.update_direction(new, old, adv, mask, torch.tensor([False, False]))
    assert "dlogp_success" not in none and "success_seq_dlogp" not in none and "dlogp_failure" in none


def slow_normalize(scores, ids, method):
    out = list(scores)
    if method == "identity" or len(set(ids)) == len(ids):
        return out
    for g in set(ids):
        rows = [i for i in range(len(ids)) if ids[i] == g]
        xs = [scores[i] for i in rows]
        mu = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        for i, x in zip(rows, xs):
            if method == "mean":
                out[i] = x - mu
            else:
                y = (x - mu) / (sd + 1e-6) if sd > 1e-6 else 0.0
                out[i] = min(max(y, -1.0), 3.0) if method == "asym_clip" else y
    return out


@pytest.mark.parametrize("method", ["identity", "mean", "mean_std", "asym_clip"])
def test_normalize_scores_matches_slow_loop(method):
    rng = random.Random(4)
    scores = [rng.choice([0.0, 1.0, -0.1, 5.0, 0.9]) for _ in range(12)]
    scores[4:8] = [0.5] * 4  # a constant group -> zeros under mean_std
    scores[8:12] = [10.0, 0.0, 0.0, 0.0]  # a big outlier -> clipped at 3 under asym_clip (z = 1.5)
    tags = ["Bandit", "Sokoban", "Bandit", "FrozenLake"] * 3
    t = torch.tensor(scores)
    for grouping, ids in [("state", [i // 4 for i in range(12)]), ("batch", [0] * 12), ("inductive", tags)]:
        got = starpo.normalize_scores(t, 4, grouping, method, tags=tags if grouping == "inductive" else None)
        assert close(got, slow_normalize(scores, ids, method), 1e-4), (grouping, method)
    # every row its own group: RAGEN leaves the scores untouched
    assert torch.equal(starpo.normalize_scores(t, 1, "state", method), t)


def test_normalize_scores_asym_clip_bounds_and_errors():
    s = torch.tensor([10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = starpo.normalize_scores(s, 16, "state", "asym_clip")
    assert out.max() == 3.0 and out.min() >= -1.0
    with pytest.raises(ValueError):
        starpo.normalize_scores(s, 4, "inductive", "mean")  # tags missing
    with pytest.raises(ValueError):
        starpo.normalize_scores(s, 4, "state", "zscore")


def slow_group_advantages(scores, ids, kind, eps=1e-6):
    """veRL core_algos' id2score loops in plain Python."""
    by = {}
    for s, i in zip(scores, ids):
        by.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, ids):
        xs, n = by[i], len(by[i])
        mean, std = (sum(xs) / n, statistics.stdev(xs)) if n > 1 else (0.0, 1.0)
        out.append((s - mean) / (std + eps) if kind == "grpo" else
                   (s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s) if kind == "rloo" else s - mean)
    return out


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_group_advantages_match_verl_loops(kind):
    # groups of 3, 2 (a tie), 1 (singleton) and 4 (constant), labelled out of order
    scores = [1.0, 0.0, 0.0, 0.5, 0.5, 3.0, 2.0, 2.0, 2.0, 2.0, 0.7, -0.3]
    ids = [5, 5, 5, 2, 2, 9, 7, 7, 7, 7, 1, 1]
    got = starpo.group_advantages(torch.tensor(scores), torch.tensor(ids), kind)
    assert close(got, slow_group_advantages(scores, ids, kind), 1e-5)
    assert torch.equal(got[6:10], torch.zeros(4)) and torch.equal(got[3:5], torch.zeros(2))  # constant groups: 0
    if kind == "rloo":  # the score minus the mean of the others: 1 - 0, 0 - 0.5
        assert close(got[:3], [1.0, -0.5, -0.5])
    assert starpo.group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), kind).shape == (0,)


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_group_advantages_of_a_constant_group_are_exactly_zero(kind):
    # s - mean(s) is one rounding step of the fp32 mean when the mean rounds (8 x -0.1: 7.5e-9), and grpo divides
    # it by 0 + 1e-6 (8 x -0.1: 0.00745 on every row, 8 x 1.7: 0.119, 8 x -0.3: -0.0298); centred on the values
    # shifted by the group's first, as the std is, a constant group gives exactly 0 beside any other group
    for v in (-0.1, 1.7, -0.3, 0.1, 1 / 3, 0.9, 1e6 + 0.1):
        for n in (2, 3, 5, 8, 16, 128):
            s = torch.cat([torch.full((n,), v), torch.tensor([0.0, 1.0, 0.5])])  # [n + 3]
            ids = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(3, dtype=torch.long)])
            got = starpo.group_advantages(s, ids, kind)
            assert torch.equal(got[:n], torch.zeros(n)), (v, n, got[:n].unique())
            assert close(got[n:], slow_group_advantages([0.0, 1.0, 0.5], [1, 1, 1], kind), 1e-5)
    # normalize_scores' "mean" centres the same way
    assert torch.equal(starpo.normalize_scores(torch.full((8,), -0.1), 4, "state", "mean"), torch.zeros(8))


def test_reinforce_pp_returns_carry_across_observations():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0, 0.0]])  # [2, 5]
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]])  # row 0: an observation token at 1, padding at 4
    adv, ret = starpo.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0 backwards: t3 1, t2 .5, t1 (mask 0) no step: 0 and .5 carried, t0 .25; row 1: .5 at t2, .25, .125
    assert close(ret[0], [0.25, 0.0, 0.5, 1.0, 0.0]) and close(ret[1], [0.125, 0.25, 0.5, 0.0, 0.0])
    on = [0.25, 0.5, 1.0, 0.125, 0.25, 0.5]  # the masked returns, whitened with an unbiased variance
    mu, var = sum(on) / 6, sum((x - sum(on) / 6) ** 2 for x in on) / 5
    want = [[(x - mu) / math.sqrt(var + 1e-8) * m for x, m in zip(r, mr)] for r, mr in zip(ret.tolist(), mask.tolist())]
    assert close(adv, want, 1e-5)


def test_constant_groups_have_exactly_zero_std():
    # x - mean(x) is not 0 in fp32 for a constant group of 0.1 or -0.1 (the mean rounds), so a shifted formula
    # is needed: RAGEN-2's torch.std gives exactly 0, and its include_zero=False drops such groups
    for v in (-0.1, 0.9, 0.1, 1 / 3, -0.3, 1e6 + 0.1):
        for n in (2, 3, 5, 8, 16):
            x = torch.full((n,), v, dtype=torch.float32)
            assert starpo._group_std(x).item() == 0.0, (v, n)
            assert starpo._group_std(x.view(1, n).expand(3, n)).eq(0).all()
    s = [-0.1] * 8 + [0.9] * 8 + [0.0, 1.0] * 4 + [0.1] * 8  # three constant groups, one spread
    for strategy, mode in (("top_p", "softmax"), ("top_p", "linear"), ("top_k", "linear"), ("min_p", "linear")):
        got = kept_groups(s, 8, 0.9 if strategy != "top_k" else 0.25, "std", strategy, include_zero=False,
                          top_p_mode=mode)[0]
        assert got == {2}, (strategy, mode, got)
    assert kept_groups([0.1] * 4 + [0.9] * 4, 4, 0.5, "std", "top_k")[0] == {0}  # all zero: the lower index


# ---------------------------------------------------------------- filtering (StarPO-S, RAGEN-2) and the batch adjust
def test_filter_groups_keeps_top_std_with_deterministic_ties():
    # group stds (G=2): g0 0, g1 |1-0|/sqrt2, g2 0, g3 same as g1 (tie), g4 2/sqrt2 (largest)
    s = torch.tensor([1.0, 1.0, 1.0, 0.0, 3.0, 3.0, 0.0, 1.0, 2.0, 0.0])
    groups = lambda keep: keep.view(5, 2)[:, 0].tolist()
    keep, st = starpo.filter_groups(s, 2, 0.4)  # int(0.4*5) = 2 groups: g4, then g1 beats g3
    assert keep.tolist() == [False, False, True, True, False, False, False, False, True, True]
    r2 = 1 / math.sqrt(2)
    assert close(st["in_group_std"], (0 + r2 + 0 + r2 + 2 * r2) / 5) and close(st["chosen_in_group_std"], 1.5 * r2)
    assert close(st["in_group_mean"], 6 / 5) and close(st["chosen_in_group_mean"], 0.75)
    assert close(st["in_group_max"], 8 / 5) and close(st["chosen_in_group_max"], 1.5)
    assert close(st["in_group_spread"], 3 / 5) and st["chosen_in_group_spread"] == 1.0  # groups with any reward spread
    assert all(isinstance(v, float) for v in st.values())
    keep, st = starpo.filter_groups(s, 2, 0.4, kind="std_rev")  # smallest std: g0 and g2 (tie, lower first)
    assert groups(keep) == [True, False, True, False, False] and st["chosen_in_group_std"] == 0
    assert st["chosen_in_group_spread"] == 0.0
    keep, st = starpo.filter_groups(s, 2, 0.6, kind="std_rev")  # int(3.0) = 3: g0, g2, then g1 (beats g3)
    assert groups(keep) == [True, True, True, False, False]
    keep, st = starpo.filter_groups(s, 2, 1.0)  # ratio 1 keeps everything
    assert keep.all() and st["chosen_in_group_std"] == st["in_group_std"]
    keep, st = starpo.filter_groups(s, 2, 0.1)  # int(0.5) = 0 -> we keep one group (RAGEN: none)
    assert groups(keep) == [False, False, False, False, True]
    assert starpo.filter_groups(s, 1, 0.5)[1]["in_group_std"] == 0  # group of one: std 0, not NaN
    with pytest.raises(ValueError):
        starpo.filter_groups(s, 2, 0.5, kind="max_mean")


def test_filter_groups_paper_default_quarter():
    torch.manual_seed(0)
    s = torch.randint(0, 2, (8 * 16,)).float()  # 8 groups x 16
    keep, st = starpo.filter_groups(s, 16, 0.25)
    assert keep.sum() == 32
    stds = s.view(8, 16).std(-1)  # torch's unbiased std as an independent check
    kept = keep.view(8, 16)[:, 0]
    assert stds[kept].min() >= stds[~kept].max() and close(st["chosen_in_group_std"], stds[kept].mean())


def slow_select(values, G, value, kind, strategy, include_zero=True, mode="linear", eps=0.01):
    """RAGEN-2 rollout_filter._select_top_groups in plain Python (ties: lower group index): kept group indices."""
    groups = [values[i:i + G] for i in range(0, len(values), G)]
    s = [(statistics.stdev(g) if len(g) > 1 else 0.0) if kind.startswith("std") else sum(g) / len(g) for g in groups]
    largest = not kind.endswith("_rev")
    cand = [i for i in range(len(s)) if include_zero or abs(s[i]) > 1e-10]
    order = sorted(cand, key=lambda i: (-s[i] if largest else s[i], i))
    if strategy in ("top_k", "top_k_abs"):
        return set(order[:max(1, int(value * len(s)) if strategy == "top_k" else int(value))])
    if strategy == "top_p" and value >= 1:
        return set(order)
    if strategy == "top_p" and mode == "softmax":
        z = [math.exp(s[i] if largest else -s[i]) for i in order]
        for j in range(len(order)):
            if sum(z[:j + 1]) / sum(z) >= value:
                return set(order[:j + 1])
        return set(order)
    if strategy == "top_p":
        target, total, n = value * sum(s[i] for i in cand) - eps, 0.0, 0
        for i in order:
            if total >= target or s[i] <= 0:
                break
            total, n = total + s[i], n + 1
        return set(order[:n]) if total >= target else set()
    if not cand:
        return set()
    if largest:
        return {i for i in cand if s[i] >= value * max(s[j] for j in cand) - 1e-10}
    return {i for i in cand if s[i] <= min(s[j] for j in cand) / (value + 1e-10) + 1e-10}


def kept_groups(values, G, *a, **kw):
    keep, st = starpo.filter_groups(torch.tensor(values), G, *a, **kw)
    return set(keep.view(-1, G)[:, 0].nonzero().squeeze(1).tolist()), st


def test_filter_strategies_hand_worked():
    stat = [3.0, 1.0, 0.0, 2.0]  # groups of one, ranked by their mean: the statistic is the value itself
    assert kept_groups(stat, 1, 0.5, "mean", "top_p")[0] == {0}        # target 0.5*6-0.01: 3 reaches it
    assert kept_groups(stat, 1, 0.9, "mean", "top_p")[0] == {0, 3, 1}  # target 5.39: 3+2+1
    assert kept_groups([0.0] * 4, 1, 0.9, "mean", "top_p")[0] == set()  # all zero: target -0.01 is met by nothing
    assert kept_groups([-1.0, 2.0], 1, 0.5, "mean_rev", "top_p")[0] == set()  # smallest first is <= 0: stop, unmet
    assert kept_groups(stat, 1, 1.0, "mean", "top_p")[0] == {0, 1, 2, 3}
    # softmax: e^2 / (e^2 + 2) = 0.787 reaches 0.5 alone; 0.9 needs all three (0.787 + 0.106 = 0.894 < 0.9)
    assert kept_groups([2.0, 0.0, 0.0], 1, 0.5, "mean", "top_p", top_p_mode="softmax")[0] == {0}
    assert kept_groups([2.0, 0.0, 0.0], 1, 0.9, "mean", "top_p", top_p_mode="softmax")[0] == {0, 1, 2}
    assert kept_groups([4.0, 2.0, 1.9, 0.0], 1, 0.5, "mean", "min_p")[0] == {0, 1}       # >= 0.5 * 4
    assert kept_groups([1.0, 2.0, 3.0], 1, 0.5, "mean_rev", "min_p")[0] == {0, 1}        # <= 1 / 0.5
    assert kept_groups([1.0, 2.0, 2.0, 0.0], 1, 2, "mean", "top_k_abs")[0] == {1, 2}
    assert kept_groups([1.0, 2.0, 2.0, 0.0], 1, 1, "mean", "top_k_abs")[0] == {1}        # tie: lower index
    # include_zero=False: zero-std groups go first; top_k still counts all 4 groups (int(0.5 * 4) = 2)
    s = [1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]  # stds 0, 0, 0, 2.12
    assert kept_groups(s, 2, 0.5, "std", "top_k", include_zero=False)[0] == {3}
    assert kept_groups(s, 2, 0.5, "std", "top_k")[0] == {3, 0}
    got, st = kept_groups(s[:6], 2, 0.5, "std", "top_k", include_zero=False)  # nothing left: empty, stats 0
    assert got == set() and st["chosen_in_group_std"] == 0.0 and st["chosen_in_group_mean"] == 0.0
    with pytest.raises(ValueError):
        starpo.filter_groups(torch.tensor(s), 2, 0.5, "std", "top_q")


def test_filter_strategies_match_plain_python():
    rng = random.Random(11)
    cases = 0
    for G in (1, 2, 4):  # exact binary means and variances: float32 and float64 rank the groups the same
        for num_groups in (1, 3, 6):
            for _ in range(3):
                values = [rng.choice([-1.0, 0.0, 0.0, 0.5, 1.0, 2.0, 3.0]) for _ in range(G * num_groups)]
                for kind in ("std", "std_rev", "mean", "mean_rev"):
                    for strategy, value, mode in (("top_k", 0.25, "linear"), ("top_k", 0.5, "linear"), ("top_k_abs", 2, "linear"),
                                                  ("top_p", 0.5, "linear"), ("top_p", 0.9, "linear"), ("top_p", 0.9, "softmax"),
                                                  ("top_p", 0.5, "softmax"), ("top_p", 1.0, "linear"), ("min_p", 0.3, "linear"),
                                                  ("min_p", 0.7, "linear")):
                        for include_zero in (True, False):
                            want = slow_select(values, G, value, kind, strategy, include_zero, mode)
                            got = kept_groups(values, G, value, kind, strategy, include_zero, mode)[0]
                            assert got == want, (values, G, value, kind, strategy, include_zero, mode)
                            cases += 1
    assert cases == 3 * 3 * 3 * 4 * 10 * 2


def test_std_collapsed_hand_worked():
    base = [1.0, 0.5, 1.5] + [1.0] * 7  # mean 1: the threshold is 0.1
    assert not collapse.std_collapsed(base + [0.05] * 9)           # only 9 later steps
    assert collapse.std_collapsed(base + [0.05] * 10)
    assert collapse.std_collapsed(base + [0.5] + [0.05] * 10)      # the last 10 count, not all the later ones
    assert not collapse.std_collapsed(base + [0.05] * 9 + [0.1])   # 0.1 is not under 0.1
    assert not collapse.std_collapsed([0.0] * 20)                  # a zero baseline never collapses


def test_adjust_rows_copy_delete():
    g = lambda: torch.Generator().manual_seed(3)
    assert torch.equal(starpo.adjust_rows(8, 4, "copy", g()), torch.arange(8))  # already a multiple: no-op
    c = starpo.adjust_rows(9, 4, "copy", g())
    assert len(c) == 12 and torch.equal(c[:9], torch.arange(9)) and len(set(c[9:].tolist())) == 3  # no repeats
    assert torch.equal(c, starpo.adjust_rows(9, 4, "copy", g()))  # the same draw from the same seed (every rank)
    assert starpo.adjust_rows(1, 4, "copy", g()).tolist() == [0, 0, 0, 0]  # fewer rows than needed: with replacement
    d = starpo.adjust_rows(9, 4, "delete", g())
    assert len(d) == 8 and d.tolist() == sorted(d.tolist()) and set(d.tolist()) < set(range(9))
    assert len(starpo.adjust_rows(3, 4, "delete", g())) == 0  # fewer rows than the multiple: nothing left
    assert len(starpo.adjust_rows(0, 4, "copy", g())) == 0
    with pytest.raises(ValueError):
        starpo.adjust_rows(5, 4, "pad", g())


# ------------------------------------------------------------------ policy loss, aggregation and the optimiser step
def one_token(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = starpo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


def test_policy_loss_equals_minus_advantage_when_on_policy():
    torch.manual_seed(0)
    logp = torch.randn(3, 6)
    adv, mask = torch.randn(3, 6), torch.rand(3, 6) > 0.3
    loss, metrics = starpo.policy_loss(logp, logp.clone(), adv, mask)
    assert close(loss, -(adv * mask).sum() / mask.sum())
    assert metrics["clipfrac"] == 0 and close(metrics["approx_kl"], 0) and close(metrics["ratio_mean"], 1)


def test_policy_loss_decoupled_clip_only_on_the_advantage_side():
    A = 2.0
    # inside the band [0.8, 1.28]: clipped == unclipped, gradient flows
    for r in (0.85, 1.0, 1.25):
        for a in (A, -A):
            loss, grad, _ = one_token(r, a)
            assert close(loss, -a * r) and abs(grad) > 0
    # A > 0: clipped above 1.28 (no gradient), not below 0.8
    loss, grad, m = one_token(1.5, A)
    assert close(loss, -A * 1.28) and grad == 0 and m["clipfrac_high"] == 1 and m["clipfrac_low"] == 0
    loss, grad, m = one_token(0.5, A)
    assert close(loss, -A * 0.5) and grad != 0 and m["clipfrac"] == 0
    # A < 0: clipped below 0.8, not above 1.28
    loss, grad, m = one_token(0.5, -A)
    assert close(loss, A * 0.8) and grad == 0 and m["clipfrac_low"] == 1 and m["clipfrac_high"] == 0
    loss, grad, m = one_token(1.5, -A)
    assert close(loss, A * 1.5) and grad != 0 and m["clipfrac"] == 0
    # symmetric vanilla clip 0.2 / 0.2
    assert close(one_token(1.5, A, clip_high=0.2)[0], -A * 1.2)


def test_policy_loss_dual_clip_bounds_negative_advantages():
    A = -2.0
    loss, grad, m = one_token(10.0, A)  # unbounded PPO loss would be 20
    assert close(loss, -A * 3.0) and grad == 0 and m["dual_clip_frac"] == 1
    assert close(one_token(10.0, A, dual_clip=None)[0], -A * 10.0)
    assert close(one_token(10.0, 2.0)[0], -2.0 * 1.28)  # positive advantages: ordinary clip only
    loss, _, m = one_token(2.0, A)  # below c: untouched
    assert close(loss, 4.0) and m["dual_clip_frac"] == 0
    assert close(one_token(1e12, A)[0], 6.0)  # huge ratios stay finite and bounded


def test_policy_loss_token_mean_over_two_halves_with_global_count():
    torch.manual_seed(1)
    logp, old = torch.randn(6, 10) * 0.3, torch.randn(6, 10) * 0.3
    adv, mask = torch.randn(6, 10), torch.rand(6, 10) > 0.4
    full, _ = starpo.policy_loss(logp, old, adv, mask)
    n = mask.sum()  # what train.py all-reduces over ranks / micro-batches
    halves = [starpo.policy_loss(logp[s], old[s], adv[s], mask[s], token_count=n)[0]
              for s in (slice(0, 2), slice(2, 6))]  # unequal token counts in the two halves
    assert close(halves[0] + halves[1], full)
    local = [starpo.policy_loss(logp[s], old[s], adv[s], mask[s])[0] for s in (slice(0, 2), slice(2, 6))]
    assert not close((local[0] + local[1]) / 2, full)  # local means would weight tokens differently


def test_loss_aggregations_and_empty_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # last row fully masked
    assert close(starpo.aggregate(x, m, "token-mean"), 10 / 4)
    assert close(starpo.aggregate(x, m, "seq-mean-token-sum"), (6 + 4) / 2)  # over the rows with a loss token
    assert close(starpo.aggregate(x, m, "seq-mean-token-mean"), (2 + 4) / 2)
    assert close(starpo.aggregate(x, m, "seq-mean-token-mean", seq_count=6), 1.0)
    with pytest.raises(ValueError):
        starpo.aggregate(x, m, "token-sum")
    # a mini-batch whose rows hold no loss token: train.py passes global counts of 0, and the loss is 0, not 0/0
    empty = torch.zeros_like(m)
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert starpo.aggregate(x, empty, agg, token_count=0, seq_count=0).item() == 0.0
    logp = torch.randn(3, 3, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        for mask in (m, torch.zeros_like(m)):
            loss, metrics = starpo.policy_loss(logp, torch.randn(3, 3), torch.randn(3, 3), mask, agg=agg)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
            assert all(torch.isfinite(torch.as_tensor(v)) for v in metrics.values())


def test_seq_mean_aggregation_counts_only_rows_with_a_loss_token():
    x = torch.tensor([[1.0, 2.0, 0.0], [5.0, 5.0, 5.0], [3.0, 0.0, 0.0]])  # [3, 3]
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])  # row 1 has no loss token
    # veRL agg_loss: the per-row token sums (3, 3) or token means (1.5, 3), averaged over the 2 rows that have one
    assert starpo.aggregate(x, mask, "seq-mean-token-sum").item() == 3.0
    assert starpo.aggregate(x, mask, "seq-mean-token-mean").item() == 2.25
    assert starpo.aggregate(x, mask, "seq-mean-token-sum", seq_count=3).item() == 2.0  # a global count wins
    assert starpo.aggregate(x, torch.zeros_like(mask), "seq-mean-token-sum").item() == 0.0  # never NaN


def test_clip_and_step_skips_a_non_finite_gradient():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(1, 3)).sum() * float("nan")).backward()
    assert math.isnan(starpo.clip_and_step(model, opt, 1.0))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no step, weights finite
    assert all(p.grad is None for p in model.parameters())  # the NaN gradient is dropped, not accumulated
    model(torch.ones(1, 3)).sum().mul(100).backward()
    gn = starpo.clip_and_step(model, opt, 1.0)
    assert math.isfinite(gn) and gn > 1 and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------ value loss, KL, entropy
def test_value_loss_clipping():
    v, old, ret = torch.tensor([[1.0, 0.0, 0.2]]), torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[2.0, 1.0, -1.0]])
    m = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = starpo.value_loss(v, old, ret, m, clip=0.5)
    # tok0: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped worse); tok1: 1; tok2: max(1.44, 1.44) = 1.44
    assert close(loss, 0.5 * (2.25 + 1.0 + 1.44) / 3) and close(metrics["vf_clipfrac"], 1 / 3)
    assert torch.isfinite(starpo.value_loss(v, old, ret, torch.zeros_like(m))[0])


def test_kl_penalty_kinds():
    torch.manual_seed(2)
    logp, ref = torch.randn(4, 5), torch.randn(4, 5)
    d = logp - ref
    assert close(starpo.kl_penalty(logp, ref, "kl"), d) and close(starpo.kl_penalty(logp, ref, "k1"), d)
    assert close(starpo.kl_penalty(logp, ref, "abs"), d.abs())
    assert close(starpo.kl_penalty(logp, ref, "mse"), 0.5 * d ** 2)
    k3 = starpo.kl_penalty(logp, ref, "low_var_kl")
    assert close(k3, (torch.exp(-d) + d - 1).clamp(max=10.0)) and (k3 >= 0).all()
    assert torch.equal(starpo.kl_penalty(logp, logp, "k3"), torch.zeros(4, 5))
    assert starpo.kl_penalty(torch.zeros(1), torch.full((1,), 100.0), "k3").item() == 10.0  # veRL clamp
    with pytest.raises(ValueError):
        starpo.kl_penalty(logp, ref, "full")


# ------------------------------------------------------------------ token_logprobs on a tiny Llama
@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def reference_logprobs(model, tokens, attention_mask, temperature):
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits.float() / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1) * attention_mask[:, 1:]
    ent = -(logp_all.exp() * logp_all).sum(-1) * attention_mask[:, 1:]
    return torch.nn.functional.pad(logp, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def test_token_logprobs_chunked_equals_full_log_softmax(tiny_llama):
    torch.manual_seed(4)
    tokens = torch.randint(0, 300, (3, 13))
    am = torch.ones(3, 13, dtype=torch.long)
    am[1, 9:] = 0  # right padding
    am[2, 5:] = 0
    with torch.no_grad():
        ref_lp, ref_ent = reference_logprobs(tiny_llama, tokens, am, 0.7)
        for chunk in (1, 5, 64):
            lp, ent = starpo.token_logprobs(tiny_llama, tokens, am, temperature=0.7, chunk=chunk, with_entropy=True)
            assert lp.shape == (3, 13) and close(lp, ref_lp) and close(ent, ref_ent)
        lp, ent = starpo.token_logprobs(tiny_llama, tokens, am, chunk=4)
        assert ent is None and close(lp, reference_logprobs(tiny_llama, tokens, am, 1.0)[0])
        assert (lp[:, 0] == 0).all() and (lp[1, 9:] == 0).all()
        # a loss mask: only its positions go through lm_head, the rest are 0; an empty one gives zeros
        sub = torch.rand(3, 13) < 0.5
        want = torch.nn.functional.pad(sub[:, 1:] & am[:, 1:].bool(), (1, 0))
        for chunk in (2, 64):
            lp, ent = starpo.token_logprobs(tiny_llama, tokens, am, temperature=0.7, chunk=chunk, with_entropy=True, mask=sub)
            assert close(lp, ref_lp * want) and close(ent, ref_ent * want) and (lp[~want] == 0).all()
        lp, ent = starpo.token_logprobs(tiny_llama, tokens, am, with_entropy=True, mask=torch.zeros_like(sub))
        assert (lp == 0).all() and (ent == 0).all()


def test_token_logprobs_gradients_match_unchunked(tiny_llama):
    torch.manual_seed(5)
    tokens = torch.randint(0, 300, (2, 11))
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 7:] = 0
    w = torch.randn(2, 11)

    def grads(fn):
        tiny_llama.zero_grad()
        lp, ent = fn()
        ((lp * w).sum() + ent.sum()).backward()
        return [p.grad.clone() for p in tiny_llama.parameters()]

    g_ref = grads(lambda: reference_logprobs(tiny_llama, tokens, am, 1.0))
    g_chunk = grads(lambda: starpo.token_logprobs(tiny_llama, tokens, am, chunk=3, with_entropy=True))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_ref, g_chunk))
    sub = torch.rand(2, 11) < 0.5  # a loss mask: the gradient of the masked positions only
    sub[:, 5] = True
    g_ref = grads(lambda: [x * sub for x in reference_logprobs(tiny_llama, tokens, am, 1.0)])
    g_mask = grads(lambda: starpo.token_logprobs(tiny_llama, tokens, am, chunk=3, with_entropy=True, mask=sub))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_ref, g_mask))
    g_none = grads(lambda: starpo.token_logprobs(tiny_llama, tokens, am, with_entropy=True, mask=torch.zeros_like(sub)))
    assert all((g == 0).all() for g in g_none)  # every parameter, lm_head included, gets a (zero) gradient
    tiny_llama.zero_grad()


def test_all_masked_rows_give_zeros_not_nan():
    rewards, values, mask = random_episode_batch(seed=6)
    r, v, m = torch.tensor(rewards), torch.tensor(values), torch.tensor(mask).bool()
    r[2], m[2] = 0.0, False  # one row with no sampled token at all
    for adv, ret in (starpo.gae_advantages(r, v, m, 0.9, 0.9), starpo.bi_level_gae(r, v, m, 0.9, 0.9, 0.5)):
        assert torch.isfinite(adv).all() and adv[2].eq(0).all() and ret[2].eq(0).all()
        w = starpo.masked_whiten(adv, m)
        assert torch.isfinite(w).all() and close(starpo.masked_mean(w, m), 0.0) and w[2].eq(0).all()
    loss, _ = starpo.value_loss(v, v, v + 1, m)
    assert torch.isfinite(loss)


# --------------------------------------------------------------- collapse diagnostics (RAGEN-2): prompt-reasoning MI
def test_collapse_stats_hand_worked_three_prompts():
    # 4 responses scored under 3 prompts; prompts 0 and 2 are the same text (class ids 0, 1, 0)
    p = [[.5, .25, .25],  # own prompt 0: top column 0 -> right
         [.2, .6, .2],    # own 1: top 1 -> right
         [.4, .2, .3],    # own 2: top 0, which is identical to 2 -> right (wrong if identity is ignored)
         [.3, .1, .2]]    # own 1: top 0, then 2 (both class 0) -> wrong @1 and @2, right @4 (all 3 columns)
    own, lens = [0, 1, 2, 1], [2, 1, 3, 4]
    L = torch.tensor(p).log()
    L_sum = L * torch.tensor(lens, dtype=torch.float)[:, None]
    s = collapse.collapse_stats(L, L_sum, own, [0, 1, 0])
    # matched = .5, .6, .3, .1; mixture = row means 1/3, 1/3, .3, .2; ratios 1.5, 1.8, 1, .5
    mi = (math.log(1.5) + math.log(1.8) + math.log(1.0) + math.log(0.5)) / 4
    assert s["mi"] == pytest.approx(mi) and s["mi_upper_bound"] == pytest.approx(math.log(3))
    assert s["cond_entropy"] == pytest.approx(-(math.log(.5) + math.log(.6) + math.log(.3) + math.log(.1)) / 4)
    assert s["entropy"] == pytest.approx(-(2 * math.log(1 / 3) + math.log(.3) + math.log(.2)) / 4)
    assert s["entropy"] - s["cond_entropy"] == pytest.approx(s["mi"])  # I(X; Z) = H(Z) - H(Z|X)
    sd = statistics.pstdev([math.log(1 / 3), math.log(1 / 3), math.log(.3), math.log(.2)])
    assert s["marginal_std"] == pytest.approx(sd) and s["mi_zscore"] == pytest.approx(mi / (sd + 1e-3))
    seq = [l * math.log(row[o]) - math.log(sum(q ** l for q in row) / 3) for row, o, l in zip(p, own, lens)]
    assert s["mi_seq"] == pytest.approx(sum(seq) / 4)
    # retrieval: rows 0-2 right, row 3 wrong; chance = mean(2/3, 1/3, 2/3, 1/3) = 1/2
    assert (s["retrieval_acc"], s["retrieval_acc@2"], s["retrieval_acc@4"], s["retrieval_acc@8"]) == (0.75, 0.75, 1.0, 1.0)
    assert s["retrieval_chance"] == pytest.approx(0.5) and s["retrieval_chance@2"] == pytest.approx(1.0) == s["retrieval_chance@8"]
    plain = collapse.collapse_stats(L, L_sum, own)  # all prompts taken as different
    assert plain["retrieval_acc"] == 0.5 and plain["retrieval_chance"] == pytest.approx(1 / 3)
    assert plain["retrieval_chance@2"] == pytest.approx(2 / 3) and plain["mi"] == pytest.approx(mi)


def test_cross_logliks_equal_teacher_forcing_of_each_concatenation():
    model, _ = models.build_tiny()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (5, 9, 7)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 1, 6, 4, 2)]
    L, L_sum = collapse.cross_logliks(model, prompts, responses, temperature=0.7, batch=2)  # ragged, 3 batches
    for j, x in enumerate(prompts):
        for i, z in enumerate(responses):
            logp = teacher_forced_logp(model, torch.tensor([x + z]), torch.ones(1, len(x + z)), 0.7)[0, len(x):]
            assert L_sum[i, j].item() == pytest.approx(logp.sum().item(), abs=1e-4)
            assert L[i, j].item() == pytest.approx(logp.mean().item(), abs=1e-4)


def test_mi_is_zero_for_a_prompt_blind_model_and_near_log_n_for_a_copying_one():
    """The tiny Llama with every attention and MLP output zeroed is a bigram model: the next token depends on
    the current token only. With a large final-norm gain it copies the current token."""
    model, tok = models.build_tiny()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(60.0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    # prompts that differ but end alike: the model cannot see the difference, so L has equal columns
    blind = [enc(f"state {c}: <answer>") for c in "ABCD"]
    responses = [enc(s) for s in ("Left", "Up", "Right || Down", "Down")]
    L, L_sum = collapse.cross_logliks(model, blind, responses)
    s = collapse.collapse_stats(L, L_sum, [0, 1, 2, 3])
    assert abs(s["mi"]) < 1e-5 and abs(s["mi_seq"]) < 1e-4 and s["mi_upper_bound"] == pytest.approx(math.log(4))
    assert s["cond_entropy"] == pytest.approx(s["entropy"], abs=1e-5)
    # prompts that end in their state letter: the model answers with that letter, so z names its prompt
    copy = [enc(f"state: {c}") for c in "ABCDEFGH"]
    z = [[torch.argmax(model(input_ids=torch.tensor([x])).logits[0, -1]).item()] for x in copy]  # greedy answers
    assert z == [x[-1:] for x in copy]
    L, L_sum = collapse.cross_logliks(model, copy, z)
    s = collapse.collapse_stats(L, L_sum, list(range(8)))
    assert math.log(8) - 0.05 < s["mi"] <= math.log(8) + 1e-6 and s["retrieval_acc"] == 1.0
    assert s["retrieval_chance"] == pytest.approx(1 / 8) and s["cond_entropy"] < 0.05


def test_reasoning_span_cuts_prompt_and_span():
    _, tok = models.build_tiny()
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    x1 = enc("<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n<answer>")
    obs = enc("\n<|im_start|>user\nReward:\n0.0\nAgain<|im_end|>\n<|im_start|>assistant\n<answer>")
    for response, think, expected in [("Left</answer><|im_end|>", False, "Left"),
                                      ("Left || Up</answer>", False, "Left || Up"),  # cut by its budget
                                      ("Left || Ri<|im_end|>", False, "Left || Ri"),  # never closed: to the end
                                      ("</answer><|im_end|>", False, ""),
                                      ("go right</think><answer>Right</answer><|im_end|>", True, "go right")]:
        r1, r2 = enc("Up</answer><|im_end|>"), enc(response)
        tokens = x1 + r1 + obs + r2 + enc("\n")
        mask = [0] * len(x1) + [1] * len(r1) + [0] * len(obs) + [1] * len(r2) + [0]
        x, z = rollout.reasoning_span(tok, tokens, mask, len(x1) + len(r1) + len(obs) + len(r2) - 1, think)
        assert x == x1 + r1 + obs and tok.decode(z) == expected  # x: the whole conversation before the turn
        x, z = rollout.reasoning_span(tok, tokens, mask, len(x1) + len(r1) - 1, False)
        assert x == x1 and tok.decode(z) == "Up"


# ==================================================================================================
# Models, sampler and agent loop (rollout.py)
# ==================================================================================================
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model's ops are microseconds long; on a shared 2-core box OpenMP threads only fight (4x slower)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return models.load_model("tiny", check=sampler.self_check)


def loop_settings(preset, **fields):
    """rollout()'s settings for a test's own preset dict: agent.agent_settings with no flags, then the budgets these
    tests play with (5 turns of 5 actions, 100 tokens per answer, a 4096-token context, sample seed 0) and `fields`
    over them."""
    budgets = dict(max_turns=5, max_actions_per_turn=5, max_new_tokens=100, max_context=4096, sample_seed=0)
    return agent.agent_settings(preset, {}, **dict(budgets, **fields))


class CorridorEnv:
    """Fake env for the agent loop: walk Right from 0 to 3; reward 1 and success at 3."""
    def reset(self, seed):
        self.pos, self.done = 0, False
        return self.render()

    def render(self):
        return "".join("P" if i == self.pos else "_" for i in range(4))

    def actions(self):
        return ["Left", "Right"]

    def step(self, action):
        if self.done or action.strip().lower() not in ("left", "right"):
            return self.render(), 0.0, self.done, dict(action_is_valid=False, action_is_effective=False, success=False)
        old = self.pos
        self.pos = max(0, min(3, self.pos + (1 if action.strip().lower() == "right" else -1)))
        self.done = self.pos == 3
        return self.render(), float(self.done), self.done, dict(action_is_valid=True, action_is_effective=self.pos != old,
                                                                success=self.done, dist=3.0 - self.pos)


CORRIDOR = dict(instruction="Walk to the right end.\n", max_actions_per_traj=4, max_tokens=20)


def padded(prompts, left):
    L = max(len(p) for p in prompts)
    pad = [[0] * (L - len(p)) for p in prompts]
    ids = torch.tensor([q + p if left else p + q for p, q in zip(prompts, pad)])
    mask = torch.tensor([[0] * len(q) + [1] * len(p) if left else [1] * len(p) + [0] * len(q) for p, q in zip(prompts, pad)])
    return ids, mask


def save_tiny(path, arch="qwen2"):
    """A tiny model + tokenizer directory, laid out like a hub snapshot."""
    model, tok = models.build_tiny(arch)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@torch.no_grad()
def reference_generate(model, prompts, max_new_tokens, stop_ids=()):
    """Slow greedy oracle: a full HF forward over the whole left-padded batch at every step."""
    seqs, done = [list(p) for p in prompts], [False] * len(prompts)
    out = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        L = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (L - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1).tolist()
        for b, t in enumerate(nxt):
            if not done[b]:
                out[b].append(t)
                seqs[b].append(t)
                done[b] = t in stop_ids
        if all(done):
            break
    return out


def teacher_forced_logp(model, tokens, attention_mask, temperature=1.0):
    """log p(token t | tokens < t) from one plain HF forward, at the position of token t. [B, T]"""
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=attention_mask.long()).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(len(tokens), 1), logp], 1)


def test_tiny_models_build_deterministic_and_leave_rng_alone():  # load time: bench.py --model tiny (no wall time here)
    for name, cls in (("tiny", "LlamaForCausalLM"), ("tiny-qwen2", "Qwen2ForCausalLM")):
        torch.manual_seed(123)
        before = torch.rand(1)
        torch.manual_seed(123)
        m1, tok = models.load_model(name)
        assert type(m1).__name__ == cls and len(tok) == m1.config.vocab_size == 259
        assert torch.rand(1) == before  # building the model did not consume the global RNG
        m2, _ = models.load_model(name)
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
        text = "héllo ✓ <answer>Up || Left</answer>"
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_qwen2_directory_loads_like_a_hub_snapshot(tmp_path):
    save_tiny(tmp_path / "q", arch="qwen2")
    model, tok = models.load_model(str(tmp_path / "q"), check=sampler.self_check)
    ref, ref_tok = models.build_tiny("qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM" and type(tok).__name__ == "Qwen2Tokenizer"
    assert tok.chat_template == ref_tok.chat_template and rollout.chat_pieces(tok) == rollout.chat_pieces(ref_tok)
    prompt = [tok.encode("Turn 1:\nState:\n_P_O", add_special_tokens=False)]
    assert sampler.generate(model, prompt, 12, greedy=True)[0] == sampler.generate(ref, prompt, 12, greedy=True)[0]


def test_load_model_errors_are_clear(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="neither"):
        models.load_model("no-such-model")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to fall back on
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="--model smollm2"):
        models.load_model("nobody/no-such-repo")


@pytest.mark.parametrize("left", [True, False])
def test_greedy_sampler_matches_references_on_ragged_batches(tiny, left):
    model, tok = tiny
    texts = ["a long prompt about a sokoban room", "hi", "<|im_start|>user\nmedium one", "x" * 50]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    stop = {tok.eos_token_id, tok.pad_token_id}
    ids, mask = padded(prompts, left)
    ours, _ = sampler.generate(model, ids, 24, stop, attention_mask=mask, greedy=True)
    assert ours == reference_generate(model, prompts, 24, stop)
    hf_ids, hf_mask = padded(prompts, left=True)
    hf = model.generate(input_ids=hf_ids, attention_mask=hf_mask, max_new_tokens=24, do_sample=False,
                        eos_token_id=sorted(stop), pad_token_id=0)[:, hf_ids.shape[1]:]
    assert all(hf[b, :len(o)].tolist() == o for b, o in enumerate(ours))


def test_sampler_logprobs_equal_teacher_forced_forward(tiny):
    model, tok = tiny
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["State:\n#P_O#", "hello", "abc" * 9]]
    toks, lps = sampler.generate(model, prompts, 20, temperature=0.7, top_p=0.9, seed=3)
    for p, o, lp in zip(prompts, toks, lps):
        x = torch.tensor([p + o])
        tf = teacher_forced_logp(model, x, torch.ones_like(x), temperature=0.7)[0, len(p):]
        assert len(o) == 20 and torch.allclose(tf, torch.tensor(lp), atol=1e-4)


def test_per_row_stop_budget_seed_and_group_prefill(tiny):
    model, tok = tiny
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["one", "two two", "three three three"]]
    stop = set(range(3, 200))  # most byte tokens stop, so rows stop at different steps
    toks, _ = sampler.generate(model, prompts, 30, stop, seed=1)
    for o in toks:
        assert 1 <= len(o) <= 30 and all(t not in stop for t in o[:-1]) and (o[-1] in stop or len(o) == 30)
    a = sampler.generate(model, prompts, 16, seed=5)
    b = sampler.generate(model, prompts, 16, seed=5)
    assert a == b
    # a group of 4 identical prompts is prefilled once and copied; it must equal 4 separate prefills
    group = [prompts[2]] * 4
    shared = sampler.generate(model, group, 16, greedy=True)
    alone = sampler.generate(model, prompts[2:], 16, greedy=True)
    assert shared[0] == alone[0] * 4
    assert max(abs(x - y) for row in shared[1] for x, y in zip(row, alone[1][0])) < 1e-5


def test_parse_response_follows_ragen():
    p = rollout.parse_response
    assert p("<think>go right</think> <answer>Right || Up</answer>", True, 5) == ("go right", ["Right", "Up"], True)
    assert p("<think>a</think><answer>Right</answer> trailing text <answer>Up</answer>", True, 5)[1] == ["Right"]
    assert p("<think>no answer tag", True, 5) == ("", [], False)
    assert p("<think>x</think>junk<answer>Up</answer>", True, 5)[2] is False  # only whitespace between the tags
    assert p("<think>x</think><answer> A || B || C || D </answer>", True, 2)[1] == ["A", "B"]
    assert p("<think>x</think><answer> || </answer>", True, 5) == ("x", [], True)
    assert p("<answer>Left<|im_end|></answer>", False, 5) == ("", ["Left"], True)


def test_the_turn_format_is_declared_once():
    # the tags are written out once, in rollout.py's format block; the code of rollout.py and sft.py names them, and
    # what is built from them is RAGEN's text (the env instructions keep their own, RAGEN's, example answers)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    for name in ("rollout.py", "sft.py"):
        lines = open(os.path.join(HERE, name)).read().splitlines()
        said = [l for l in lines if any(t in l for t in tags)]
        assert said == ([l for l in lines if l.startswith(("THINK_OPEN, THINK_CLOSE =", "ANSWER_OPEN, ANSWER_CLOSE ="))]
                        if name == "rollout.py" else []), (name, said)
    assert rollout.FORMATS == {True: "<think> [Your thoughts] </think> <answer> [your answer] </answer>",
                               False: "<answer> [your answer] </answer>"}
    assert [rollout.TURN_PATTERNS[t].pattern for t in (True, False)] == [r"<think>(.*?)</think>\s*<answer>(.*?)</answer>",
                                                                        r"<answer>(.*?)</answer>"]
    assert (rollout.FORCED, rollout.SPAN_CLOSE) == ({True: "<think>", False: "<answer>"}, {True: "</think>", False: "</answer>"})


def scripted(monkeypatch, tok, replies):
    """Replace the sampler by scripted replies (text per call and row); records the rows asked each turn."""
    calls = []

    def fake_sample_turn(model, cache, new_ids, max_new_tokens, stop_ids, *args):
        active = [i for i, x in enumerate(new_ids) if x]
        cache.lens += torch.tensor([len(x) for x in new_ids])
        text = replies[len(calls)]
        calls.append(len(active))
        toks = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] if x else [] for x in new_ids]
        return toks, [[-1.0] * len(t) for t in toks]
    monkeypatch.setattr(rollout, "sample_turn", fake_sample_turn)
    return calls


def test_agent_loop_penalties_budget_success(monkeypatch, tiny):
    model, tok = tiny
    replies = ["go</think><answer>Right || Jump || Right</answer> extra",   # unknown action: penalty, no budget
               "hmm</think><answer></answer>",                              # empty answer: penalty
               "no tags at all",                                            # missing tags: penalty
               "ok</think><answer>Left || Right || Right || Right || Right || Right</answer>"]  # 5 kept, budget 4
    calls = scripted(monkeypatch, tok, replies)
    out = rollout.rollout(model, tok, [CorridorEnv(), CorridorEnv()], [0, 0], loop_settings(CORRIDOR, max_turns=5),
                          group_size=2)
    s = out["stats"]
    assert calls == [2, 2, 2, 2]  # both episodes end in turn 4, when the action budget runs out
    assert s["num_turns"].tolist() == [4, 4] and s["format_errors"].tolist() == [3, 3]
    # turn 1: Right, Right (2 actions); turn 4: Left, Right, hits the budget of 4 at pos 2 -> truncated, not success
    assert s["num_actions"].tolist() == [4, 4] and s["invalid_actions"].tolist() == [1, 1]
    assert s["valid_actions"].tolist() == [2 + 5, 2 + 5]  # not-executed actions are still checked against the names
    assert out["turn_rewards"][0] == [0.0, 0.0, 0.0, 0.0] and out["success"].tolist() == [False, False]
    assert out["penalty"].tolist() == pytest.approx([-0.3, -0.3]) and out["scores"].tolist() == pytest.approx([-0.3, -0.3])
    assert "You have 2 actions left" in out["text"][0] and "Reward:\n0.0\n\nTurn 2:" in out["text"][0]
    assert out["responses"][0][0]["actions"] == ["Right", "Jump", "Right"] and "dist" in s


def test_agent_loop_success_drops_finished_rows(monkeypatch, tiny):
    model, tok = tiny
    replies = ["a</think><answer>Right || Right || Right</answer>", "b</think><answer>Right</answer>"]
    calls = scripted(monkeypatch, tok, replies)
    envs = [CorridorEnv(), CorridorEnv()]
    envs[1].step = lambda a, e=envs[1]: CorridorEnv.step(e, "Left")  # a hopeless second row
    out = rollout.rollout(model, tok, envs, [0, 1], loop_settings(CORRIDOR, max_turns=2, think=True), group_size=1)
    assert calls == [2, 1]   # row 0 reached the goal after 3 actions and left the batch
    assert out["success"].tolist() == [True, False] and out["turn_rewards"][0] == [1.0]
    assert out["scores"].tolist() == pytest.approx([1.0, 0.0]) and out["stats"]["num_actions"].tolist() == [3, 4]
    assert out["group"].tolist() == [0, 1]


def check_consistent(out, tok, B, think=True):
    T = out["tokens"].shape[1]
    for k in ("tokens", "attention_mask", "loss_mask", "old_logp"):
        assert out[k].shape == (B, T)
    assert not (out["loss_mask"] & ~out["attention_mask"]).any() and (out["old_logp"][~out["loss_mask"]] == 0).all()
    assert (out["old_logp"][out["loss_mask"]] <= 0).all()
    for b in range(B):
        n = int(out["stats"]["num_turns"][b])
        assert len(out["turn_ends"][b]) == len(out["turn_rewards"][b]) == len(out["responses"][b]) == n
        # masked spans == the sampled responses, each ending at its turn end, right after the forced tag
        m, spans = out["loss_mask"][b].tolist() + [False], []
        for i in range(T):
            if m[i] and (i == 0 or not m[i - 1]):
                spans.append((i, m.index(False, i) - 1))
        assert [j for _, j in spans] == out["turn_ends"][b]
        forced = "<think>" if think else "<answer>"
        for (i, j), resp in zip(spans, out["responses"][b]):
            assert forced + tok.decode(out["tokens"][b, i:j + 1], skip_special_tokens=True) == resp["raw"]
            assert tok.decode(out["tokens"][b, i - len(forced):i]) == forced  # forced tag: in the sequence, not in the mask
            assert out["tokens"][b, j + 1] in (tok.convert_tokens_to_ids("<|im_end|>"), tok.encode("\n")[0])
        assert out["text"][b] == tok.decode(out["tokens"][b][out["attention_mask"][b]])
    assert out["scores"].tolist() == pytest.approx([sum(r) + p for r, p in zip(out["turn_rewards"], out["penalty"].tolist())])


@pytest.mark.parametrize("greedy", [True, False])
def test_kv_reuse_equals_reprefill_and_old_logp_equals_training_forward(tiny, greedy):
    model, tok = tiny
    preset, outs = SOKOBAN_PRESETS["SimpleSokoban"], []
    for reuse in (True, False):
        envs = [SokobanEnv(**preset["kwargs"]) for _ in range(4)]
        outs.append(rollout.rollout(model, tok, envs, [3, 3, 8, 8],
                                    loop_settings(preset, max_turns=3, max_new_tokens=24, kv_reuse=reuse, sample_seed=0),
                                    group_size=2, greedy=greedy))
    a, b = outs
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert torch.allclose(a["old_logp"], b["old_logp"], atol=1e-4)
    check_consistent(a, tok, 4)
    tf = teacher_forced_logp(model, a["tokens"], a["attention_mask"])
    assert torch.allclose(tf[a["loss_mask"]], a["old_logp"][a["loss_mask"]], atol=1e-4)


def test_static_shape_path_gives_the_same_rollout(monkeypatch, tiny):
    # the CUDA layout (fixed batch with idle rows, fixed capacity, bucketed key length), run eagerly on CPU
    model, tok = tiny
    preset, outs = FROZENLAKE_PRESETS["FrozenLake"], []
    for static in (False, True):
        envs = [FrozenLakeEnv(**preset["kwargs"]) for _ in range(4)]
        envs[1].step = lambda a: ("", 0.0, True, dict(action_is_valid=True, action_is_effective=True, success=False))
        monkeypatch.setattr(rollout, "parse_response", lambda text, think, k: ("", ["Stay"], True))  # only row 1 ends
        outs.append(rollout.rollout(model, tok, envs, [5, 5, 6, 6],
                                    loop_settings(preset, max_turns=3, max_new_tokens=12, max_context=1500),
                                    group_size=2, greedy=True, sampler=sampler.Sampler(static=static)))
    a, b = outs
    assert a["stats"]["num_turns"].tolist()[:2] == [3, 1]
    assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-5)


def test_multi_turn_rollout_on_sokoban_and_frozenlake(tiny):
    model, tok = tiny
    for env_cls, preset, think in ((SokobanEnv, SOKOBAN_PRESETS["SimpleSokoban"], True),
                                   (FrozenLakeEnv, FROZENLAKE_PRESETS["FrozenLake"], False)):
        envs = [env_cls(**preset["kwargs"]) for _ in range(6)]
        out = rollout.rollout(model, tok, envs, [1, 1, 1, 2, 2, 2],
                              loop_settings(preset, max_turns=3, max_new_tokens=16, think=think, sample_seed=2),
                              group_size=3)
        check_consistent(out, tok, 6, think=think)
        assert out["group"].tolist() == [0, 0, 0, 1, 1, 1] and out["stats"]["num_turns"].tolist() == [3] * 6
        assert all(set(v.shape) == {6} for v in out["stats"].values())
        first = out["text"][0].split("<|im_start|>assistant")[0]
        assert first == out["text"][1].split("<|im_start|>assistant")[0] != out["text"][3].split("<|im_start|>assistant")[0]
        assert preset["instruction"] + "\nTurn 1:\nState:\n" + envs[3].__class__(**preset["kwargs"]).reset(2) in out["text"][3]


def test_context_overflow_truncates_cleanly(tiny):
    model, tok = tiny
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    envs = [SokobanEnv(**preset["kwargs"]) for _ in range(2)]
    first = rollout.rollout(model, tok, envs, [4, 4], loop_settings(preset, max_turns=1, max_new_tokens=8),
                            group_size=2, greedy=True)
    L1 = first["tokens"].shape[1]
    out = rollout.rollout(model, tok, envs, [4, 4],
                          loop_settings(preset, max_turns=5, max_new_tokens=8, max_context=L1 + 40), group_size=2,
                          greedy=True)  # room for turn 1 only
    assert out["stats"]["context_truncated"].tolist() == [True, True] and out["stats"]["num_turns"].tolist() == [1, 1]
    assert torch.equal(out["tokens"], first["tokens"]) and out["tokens"].shape[1] <= L1 + 40
    tiny_ctx = rollout.rollout(model, tok, envs, [4, 4], loop_settings(preset, max_turns=2, max_context=100),
                               group_size=2)
    assert tiny_ctx["stats"]["num_turns"].tolist() == [0, 0] and not tiny_ctx["loss_mask"].any()
    assert tiny_ctx["stats"]["context_truncated"].all() and tiny_ctx["scores"].tolist() == [0.0, 0.0]


def test_gumbel_sampler_draws_from_the_softmax_and_nucleus():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(40000, 1)             # [N, 4]
    keys = sampler.row_keys(range(40000), [9] * 40000)
    tok, lp = sampler.sample_next(logits, keys, temperature=0.8)
    freq = torch.bincount(tok, minlength=4) / len(tok)
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.8, -1), atol=0.01)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.8, -1).gather(-1, tok[:, None]).squeeze(-1))
    tok, _ = sampler.sample_next(logits, keys, top_p=0.7)  # nucleus of p = [.64, .24, ...] at 0.7: tokens 2 and 1
    p = torch.softmax(logits[0], -1)[[2, 1]]
    freq = torch.bincount(tok, minlength=4) / len(tok)
    assert freq[0] == 0 and freq[3] == 0 and abs(freq[2] - p[0] / p.sum()) < 0.01


def test_sampler_noise_is_splitmix64_of_the_key_and_the_vocab_index():
    # the counter-based RNG against an independent reference: splitmix64's finaliser in Python's unbounded ints
    # (gpu_check.splitmix64, which gpu_check.py holds CUDA to), and the Gumbel-max draw written out of place; the sampler
    # computes it in place, and must leave its inputs alone
    import gpu_check
    mix = lambda z: gpu_check.splitmix64(z) % 2 ** 64  # on an unsigned 64-bit int
    keys = torch.tensor([0, 1, -1, 2 ** 62 + 12345, -(2 ** 63), 987654321])
    kept = keys.clone()
    assert sampler.mix64(keys).tolist() == [gpu_check.splitmix64(k) for k in keys.tolist()]
    logits = torch.randn(len(keys), 50, generator=torch.Generator().manual_seed(0)) * 3   # [B, V]
    logits_kept = logits.clone()
    tok, lp = sampler.sample_next(logits, keys, temperature=0.7)
    assert torch.equal(keys, kept) and torch.equal(logits, logits_kept)
    logp = torch.log_softmax(logits / 0.7, -1)
    for b, k in enumerate(keys.tolist()):
        x = [mix((mix(k % 2 ** 64) + v * (0x9E3779B97F4A7C15)) % 2 ** 64) for v in range(50)]
        u = torch.tensor([((z & 0xFFFFFF) + 0.5) / 2 ** 24 for z in x], dtype=torch.float32)   # [V]
        assert tok[b] == (logp[b] - torch.log(-torch.log(u))).argmax() and lp[b] == logp[b, tok[b]]


def test_fp32_cpu_sampling_is_the_same_whatever_the_batch_split(tiny):
    # what makes 1-process and N-rank training sample the same trajectories: noise keyed per episode, and fp32 CPU
    # logits that depend on the batch around a row by last-bit rounding at most (MKL picks GEMM kernels by row
    # count), too little to move a token here. On CUDA in bf16 the noise is the same but the rounding is bf16's,
    # so a token may differ where two noisy logits are within it (docs/sampler.md)
    model, tok = tiny
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    seeds = [s for s in (5, 6, 7, 8) for _ in range(2)]
    run = lambda sl: rollout.rollout(model, tok, [FrozenLakeEnv() for _ in seeds[sl]], seeds[sl],
                                     loop_settings(preset, max_turns=2, max_new_tokens=10, think=False, sample_seed=3),
                                     group_size=2)
    whole, halves = run(slice(0, 8)), [run(slice(0, 4)), run(slice(4, 8))]
    rows = [(h, i) for h in halves for i in range(4)]
    for b, (h, i) in enumerate(rows):
        n = int(whole["attention_mask"][b].sum())
        assert n == int(h["attention_mask"][i].sum())
        assert torch.equal(whole["tokens"][b, :n], h["tokens"][i, :n])
    assert not torch.equal(whole["tokens"][0], whole["tokens"][1])  # members of a group still differ


def test_rollout_rejects_bad_groups(tiny):
    model, tok = tiny
    envs = [CorridorEnv() for _ in range(4)]
    with pytest.raises(ValueError, match="share a seed"):
        rollout.rollout(model, tok, envs, [0, 1, 2, 2], loop_settings(CORRIDOR), group_size=2)
    with pytest.raises(ValueError, match="divisible"):
        rollout.rollout(model, tok, envs[:3], [0, 0, 0], loop_settings(CORRIDOR), group_size=2)


# ------------------------------------------------------------ model families: refusals, self-check, Qwen3's template
# Qwen/Qwen3-0.6B tokenizer_config.json's chat_template with the tool branches removed
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}
{%- endfor %}
{%- for message in messages %}{%- set content = message.content %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}{%- set reasoning_content = '' %}
{%- if '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index %}
{%- if loop.last or (not loop.last and reasoning_content) %}
{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"""


FAMILIES = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def save_family(path, arch):
    model, tok = models.build_tiny(arch)
    if arch == "qwen3":
        tok.chat_template = QWEN3_TEMPLATE
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_family_samples_like_hf(tmp_path, arch):
    model, tok = models.load_model(save_family(tmp_path / arch, arch), check=sampler.self_check)  # refusals, self-check
    assert type(model).__name__ == FAMILIES[arch]
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["a long prompt about a sokoban room", "hi", "x" * 30]]
    ours, _ = sampler.generate(model, prompts, 16, greedy=True)
    ids, mask = padded(prompts, left=True)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                        eos_token_id=None)[:, ids.shape[1]:]
    assert hf.tolist() == ours
    toks, lps = sampler.generate(model, prompts, 12, temperature=0.7, seed=3)
    for p, o, lp in zip(prompts, toks, lps):
        x = torch.tensor([p + o])
        assert torch.allclose(teacher_forced_logp(model, x, torch.ones_like(x), 0.7)[0, len(p):], torch.tensor(lp), atol=1e-4)


def test_qwen3_template_what_the_model_sees(tmp_path):
    model, tok = models.load_model(save_family(tmp_path / "q3", "qwen3"), check=sampler.self_check)
    head, gen, close, user_head = rollout.chat_pieces(tok)
    assert gen == "<|im_end|>\n<|im_start|>assistant\n" and close == "<|im_end|>\n"  # no empty think block
    answer = "<think>go right</think><answer>Right</answer>"
    msgs = [{"role": "system", "content": rollout.SYSTEM}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": answer}, {"role": "user", "content": "u2"}]
    ours = head + "u1" + gen + answer + close + user_head + "u2" + gen
    # Qwen3's own rendering drops the think block of earlier turns; the token stream keeps what was sampled
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ours.replace("<think>go right</think>", "")
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    envs = [SokobanEnv(**preset["kwargs"]) for _ in range(2)]
    out = rollout.rollout(model, tok, envs, [3, 3],
                          loop_settings(preset, max_turns=2, max_new_tokens=12, sample_seed=0), group_size=2)
    check_consistent(out, tok, 2)


@pytest.mark.parametrize("model_type,kw,message", [
    ("gemma2", {}, "Gemma2ForCausalLM: the sampler does not implement logit soft-capping"),
    ("mixtral", {}, "MixtralForCausalLM: the sampler does not implement MoE routing"),
    ("qwen2", dict(use_sliding_window=True), "Qwen2ForCausalLM: the sampler does not implement sliding-window attention"),
    ("mistral", dict(sliding_window=4096), "sliding-window attention"),
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope type 'dynamic'"),
    ("smollm3", {}, "SmolLM3ForCausalLM: the sampler does not implement model type 'smollm3'"),
])
def test_unsupported_families_refused_up_front(tmp_path, model_type, kw, message):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, **kw)
    cfg.architectures = [{"gemma2": "Gemma2", "mixtral": "Mixtral", "qwen2": "Qwen2", "mistral": "Mistral",
                          "llama": "Llama", "smollm3": "SmolLM3"}[model_type] + "ForCausalLM"]
    cfg.save_pretrained(tmp_path)  # no weights: refused from config.json before any is read
    with pytest.raises(ValueError, match=message) as e:
        models.load_model(str(tmp_path))
    assert "\n" not in str(e.value)


def test_loading_a_model_depends_on_no_sampler_and_no_agent_loop():
    # models.py loads and refuses; the self-check runs the sampler, so the sampler side owns it (sampler.self_check,
    # passed to load_model as its check) and models.py imports neither sampler.py nor rollout.py
    code = "import sys, models; bad = {'sampler', 'rollout', 'agent'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE)


def test_self_check_refuses_a_sampler_that_skips_qwen3_qk_norm(tmp_path, monkeypatch):
    """A sampler without Qwen3's q_norm / k_norm samples other tokens than HF: refused at load time."""
    real = sampler.forward_cached

    def skipping(model, *a):
        attns = [layer.self_attn for layer in model.model.layers]
        saved = [(x.q_norm, x.k_norm) for x in attns]
        for x in attns:
            x.q_norm = x.k_norm = torch.nn.Identity()
        try:
            return real(model, *a)
        finally:
            for x, (q, k) in zip(attns, saved):
                x.q_norm, x.k_norm = q, k

    path = save_family(tmp_path / "q3", "qwen3")
    monkeypatch.setattr(sampler, "forward_cached", skipping)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM: the sampler's next-token logits differ from the HF forward"):
        models.load_model(path, check=sampler.self_check)


def test_every_loader_that_samples_runs_the_self_check(monkeypatch, tmp_path, capsys):
    # models.load_model runs the check its caller passes; train.py's (fsdp.load_on_rank0), eval.py's and sft.py's
    # loads pass sampler.self_check, so a refusal stops each of them (train.py and eval.py / sft.py in one line)
    import fsdp

    def refuse(model):
        raise ValueError("refused by the self-check")
    monkeypatch.setattr(sampler, "self_check", refuse)
    with pytest.raises(ValueError, match="cannot load --model tiny: refused by the self-check"):
        fsdp.load_on_rank0("tiny", False, True)
    for name, main, argv in (("eval", ev.main, ["--model", "tiny", "--env", "bandit", "--out", str(tmp_path / "e")]),
                             ("sft", sft.main, ["--model", "tiny", "--env", "Bandit", "--device", "cpu"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"{name}.py: cannot load --model tiny: refused by the self-check\n", err

def test_smollm2_passes_the_self_check():
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "starpo", "smollm2")
    if not os.path.isdir(cache):
        pytest.skip("SmolLM2 not converted here (python -c \"import models; models.load_model('smollm2')\")")
    model, tok = models.load_model("smollm2", check=sampler.self_check)  # raises if the sampler's logits differ from HF's
    assert type(model).__name__ == "LlamaForCausalLM" and rollout.chat_pieces(tok)[1].endswith("assistant\n")



def test_a_template_the_rollout_cannot_extend_is_refused_in_one_line(tmp_path, capsys):
    # a template whose rendering of the earlier messages changes as the conversation grows (here: it opens with the
    # message count) cannot be extended by appending tokens (rollout.chat_pieces): eval.py and sft.py refuse it right
    # after loading, train.py from the tokenizer alone, before any weight loads; each in one line, exit code 2
    import train
    model, tok = models.build_tiny("llama")
    tok.chat_template = "{{ messages | length }}" + models.CHATML
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path, why = str(tmp_path / "m"), "chat template is not append-only"
    for name, main, argv in (("eval", ev.main, ["--model", path, "--env", "bandit", "--out", str(tmp_path / "e")]),
                             ("sft", sft.main, ["--model", path, "--env", "Bandit", "--device", "cpu"]),
                             ("train", train.main, ["--model", path, "--env", "bandit", "--device", "cpu",
                                                    "--out", str(tmp_path / "t")])):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        said = "".join(capsys.readouterr())  # progress bars and train.py's opening lines aside, one line says why
        lines = [line for line in said.splitlines() if why in line]
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"{name}.py: ") and "Traceback" not in said
    assert not (tmp_path / "t").exists()

# ------------------------------------------------------------------ a turn ends at its closing tag (RAGEN)
def bigram_model(tok, walk, scale=5.0):
    """A tiny model that writes text by a table: the next token depends only on the current one, walk[token] =
    its successors, drawn with equal probability (each successor must have one predecessor for that). Attention
    and MLP outputs are zeroed, so the last hidden state is the current token's embedding; lm_head row s points
    along the embeddings of s's predecessors: their logit is ~8 * scale above the rest."""
    model, _ = models.build_tiny()
    model.resize_token_embeddings(len(tok))
    V, d = len(tok), model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    E = torch.nn.functional.normalize(torch.randn(V, d, generator=g), dim=1)   # [V, d] unit rows
    W = torch.zeros(V, d)                                                     # [V, d]
    for c, nexts in walk.items():
        for s in nexts:
            W[s] += E[c] * scale
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(E)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.lm_head.weight = torch.nn.Parameter(W)  # untied from the embedding
    return model


def script_walk(tok, steps):
    """walk from (text, [texts]) pairs: the last token of text goes to the first token of each successor text."""
    one = lambda s: tok.encode(s, add_special_tokens=False)[-1]
    return {one(a): [one(b) for b in bs] for a, bs in steps}


@pytest.fixture(scope="module")
def tagged():
    """(model, tok) for both modes. no-think: byte tokens, so '</answer>' spans 9 tokens; after the forced
    '<answer>' a row writes 'U</answer>' (then 'U</answer>' or 'D...' again: text past the tag) or 'Dxyxy...'
    (never closes). think: '<think>', '</think>', '<answer>', '</answer>' are single added tokens; a row writes
    'hm</think><answer>L</answer>zzz...' or 'hm</think><answer>Qkkk...' (never closes)."""
    _, tok = models.build_tiny()
    tok.add_tokens(["<think>", "</think>"])  # '<answer>' stays bytes in no-think mode; think mode adds it below
    steps = [(">", ["U", "D"]), ("U", ["<"]), ("<", ["/"]), ("/", ["a"]), ("a", ["n"]), ("n", ["s"]), ("s", ["w"]),
             ("w", ["e"]), ("e", ["r"]), ("r", [">"]), ("D", ["x"]), ("x", ["y"]), ("y", ["x"])]
    no_think = (bigram_model(tok, script_walk(tok, steps)), tok)
    _, tok2 = models.build_tiny()
    tok2.add_tokens(["<think>", "</think>", "<answer>", "</answer>"])
    steps = [("<think>", ["h"]), ("h", ["m"]), ("m", ["</think>"]), ("</think>", ["<answer>"]), ("<answer>", ["L", "Q"]),
             ("L", ["</answer>"]), ("</answer>", ["z"]), ("z", ["z"]), ("Q", ["k"]), ("k", ["k"])]
    return {False: no_think, True: (bigram_model(tok2, script_walk(tok2, steps)), tok2)}


def answer_spans(out, tok):
    """The sampled spans of each training row (runs of loss_mask) as text, and the text of the whole row."""
    spans, texts = [], []
    for ids, m in zip(out["tokens"].tolist(), out["loss_mask"].tolist()):
        runs, cur = [], []
        for i, f in zip(ids, m):
            if f:
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        spans.append([tok.decode(r) for r in runs + ([cur] if cur else [])])
        texts.append(tok.decode(ids))
    return spans, texts


def tag_rollout(model, tok, think, **kw):
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    envs = [FrozenLakeEnv(**preset["kwargs"]) for _ in range(8)]
    sampler = kw.pop("sampler", None)  # this call's own; the rest are settings
    settings = loop_settings(preset, **dict(dict(max_turns=3, max_new_tokens=24, max_context=4000, think=think), **kw))
    return rollout.rollout(model, tok, envs, [3] * 4 + [4] * 4, settings, group_size=4, sampler=sampler)


def test_answer_end_cuts_at_the_token_that_completes_the_pattern(tiny):
    _, tok = tiny  # byte tokens: the tag is split over 9 tokens
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    cut = rollout.answer_end(tok, "<answer>", False)
    ids = enc("Up</answer> and more</answer>")
    assert cut(ids) == len(enc("Up</answer>")) and cut(ids[:len(enc("Up</answer"))]) is None
    assert cut(enc("Up || Down")) is None and cut([]) is None
    think = rollout.answer_end(tok, "<think>", True)  # the '</answer>' that completes think-then-answer
    ids = enc("a</answer> b</think> <answer>Left</answer>zz")
    assert think(ids) == len(enc("a</answer> b</think> <answer>Left</answer>"))
    text = "<think>" + tok.decode(ids[:think(ids)])
    assert rollout.parse_response(text, True, 5) == rollout.parse_response("<think>" + tok.decode(ids), True, 5)


@pytest.mark.parametrize("think", [False, True])
def test_turn_end_check_decodes_a_bounded_number_of_tokens(tiny, monkeypatch, think):
    # the host's </answer> check in sample_turn (every check_every tokens) decodes each row's text only where its
    # newest tokens could complete the closing tag, each candidate cut once: at most 4x the tokens sampled, not the
    # whole prefix of every live row at every check (quadratic in the turn's length). The cuts are exact: the
    # cut tests above and test_answer_end_cuts_at_the_token_that_completes_the_pattern
    model, tok = tiny
    forced = "<think>" if think else "<answer>"
    stop_at, decoded, real = rollout.answer_end(tok, forced, think), [], tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw))
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["<answer>", "go </answer", "x", "yy </think> <"] * 2]
    cache = sampler.KVCache(model, len(prompts), 200)
    toks, _ = sampler.sample_turn(model, cache, prompts, 120, (), sampler.row_keys([0] * 8, range(8)), 1.0,
                                  sampler=sampler.Sampler(check_every=8), stop_at=stop_at)
    sampled = sum(map(len, toks))
    assert sampled > 400 and sum(decoded) <= 4 * sampled, (sum(decoded), sampled)


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("how", ["kv", "reprefill", "static-check8", "limited_multi_turn"])
def test_nothing_after_the_closing_tag_is_trained_or_shown_again(tagged, think, how):
    model, tok = tagged[think]
    kw = dict(kv="", reprefill=dict(kv_reuse=False), limited_multi_turn=dict(window_mode="limited_multi_turn"),
              **{"static-check8": dict(sampler=sampler.Sampler(static=True, check_every=8))})[how] or {}
    cut, uncut = tag_rollout(model, tok, think, **kw), tag_rollout(model, tok, think, stop_at_answer=False, **kw)
    (spans, texts), (uspans, utexts) = answer_spans(cut, tok), answer_spans(uncut, tok)
    closed = 0
    for row, text in zip(spans, texts):
        for s in row:  # a sampled span ends at its tag, or never closes it (it ran to the budget)
            closed += s.endswith("</answer>")
            assert s.count("</answer>") == s.endswith("</answer>")
        # every assistant turn of the row, this one and those shown again, ends at its tag if it closes it
        for turn in text.split("<|im_start|>assistant\n")[1:]:
            said = turn.split("<|im_end|>")[0]
            assert said.count("</answer>") == said.endswith("</answer>"), said
    assert closed and any(not s.endswith("</answer>") for row in spans for s in row)  # both kinds occur
    assert any("</answer>" in s[:-9] for row in uspans for s in row)  # uncut: text past the tag, trained
    # kept tokens and log-probs are a prefix of the uncut sampler's (the bigram model ignores the context)
    for r in range(len(spans)):
        assert len(spans[r]) == len(uspans[r])
        for s, u in zip(spans[r], uspans[r]):
            assert u.startswith(s)
    runs = lambda out, r: [x for x in torch.tensor_split(out["old_logp"][r], torch.nonzero(torch.diff(
        out["loss_mask"][r].int())).flatten() + 1) if x.any()]  # log-probs of each sampled span (none is exactly 0)
    for r in range(len(spans)):
        assert all(torch.equal(k, u[:len(k)]) for k, u in zip(runs(cut, r), runs(uncut, r)))
    assert cut["stats"]["response_tokens"].sum() < uncut["stats"]["response_tokens"].sum()


@pytest.mark.parametrize("think", [False, True])
def test_cut_turns_are_exact_on_every_cache_path(tiny, monkeypatch, think):
    # a random model whose turns end at the first letter a-m (a stand-in tag it hits every ~20 tokens): the
    # cache row must roll back to the cut, so every path gives the re-prefill reference's tokens and log-probs
    model, tok = tiny
    pattern = r"<think>(.*?)[a-m](.*?)[n-z]" if think else r"<answer>(.*?)[a-m]"
    monkeypatch.setitem(rollout.TURN_PATTERNS, think, __import__("re").compile(pattern, __import__("re").DOTALL))
    runs = {how: tag_rollout(model, tok, think, max_new_tokens=30, temperature=1.0, **kw) for how, kw in [
        ("reprefill", dict(kv_reuse=False)), ("kv", {}), ("check8", dict(sampler=sampler.Sampler(check_every=8))),
        ("static-check8", dict(sampler=sampler.Sampler(static=True, check_every=8)))]}
    ref = runs.pop("reprefill")
    assert 0 < ref["stats"]["response_tokens"].sum() < 8 * 3 * 30  # some turns were cut
    for how, out in runs.items():
        assert torch.equal(out["tokens"], ref["tokens"]) and torch.equal(out["loss_mask"], ref["loss_mask"]), how
        assert torch.allclose(out["old_logp"], ref["old_logp"], atol=1e-5), how
    # turn 1's kept tokens and log-probs are a prefix of what the uncut sampler draws with the same keys
    uncut = tag_rollout(model, tok, think, max_new_tokens=30, temperature=1.0, stop_at_answer=False, max_turns=1)
    first = tag_rollout(model, tok, think, max_new_tokens=30, temperature=1.0, max_turns=1)
    for r in range(8):
        m, um = first["loss_mask"][r], uncut["loss_mask"][r]
        k, u = first["tokens"][r][m], uncut["tokens"][r][um]
        assert torch.equal(k, u[:len(k)]) and torch.allclose(first["old_logp"][r][m], uncut["old_logp"][r][um][:len(k)])
    assert any(m.sum() < um.sum() for m, um in zip(first["loss_mask"], uncut["loss_mask"]))


# ------------------------------------------------------------------ context windows (RAGEN-2)
def windowed_rollout(model, tok, **kw):
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    envs = [SokobanEnv(**preset["kwargs"]) for _ in range(4)]
    return rollout.rollout(model, tok, envs, [3, 3, 8, 8], loop_settings(preset, max_turns=3, max_new_tokens=16,
                                                                          sample_seed=0, **kw), group_size=2)


def test_limited_multi_turn_rows_are_the_full_rollouts_prefixes(tiny):
    model, tok = tiny
    full, lmt = windowed_rollout(model, tok), windowed_rollout(model, tok, window_mode="limited_multi_turn")
    assert full["episode"].tolist() == [0, 1, 2, 3] and lmt["episode"].tolist() == [0, 1, 2, 3] * 3  # turn by turn
    for r, b in enumerate(lmt["episode"].tolist()):
        L, turn = int(lmt["attention_mask"][r].sum()), r // 4
        assert torch.equal(lmt["tokens"][r, :L], full["tokens"][b, :L])  # the same tokens, cut after this turn
        spans = [(i, j) for i, j in zip([0] + full["turn_ends"][b], full["turn_ends"][b])]
        # the loss covers this turn's answer only: the full rollout's mask between the previous and this turn end
        want = full["loss_mask"][b, :L].clone()
        want[:spans[turn][0] + (turn > 0)] = False
        assert torch.equal(lmt["loss_mask"][r, :L], want) and lmt["turn_ends"][r] == [full["turn_ends"][b][turn]]
    assert lmt["scores"].tolist() == full["scores"].tolist() and lmt["stats"]["context_rebuilds"].sum() == 0


@pytest.mark.parametrize("mode", ["full", "limited_multi_turn", "single_turn"])
def test_context_window_rebuilds_the_kv_row(tiny, mode):
    model, tok = tiny
    a = windowed_rollout(model, tok, window_mode=mode, window=1)
    b = windowed_rollout(model, tok, window_mode=mode, window=1, kv_reuse=False)  # a fresh prefill every turn
    assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-4)
    m = a["loss_mask"]
    assert torch.allclose(teacher_forced_logp(model, a["tokens"], a["attention_mask"])[m], a["old_logp"][m], atol=1e-4)
    assert a["stats"]["context_rebuilds"].tolist() == [2.0] * 4  # turns 2 and 3 drop the turn before
    full = windowed_rollout(model, tok)
    assert (a["stats"]["prefill_tokens"] > full["stats"]["prefill_tokens"]).all()
    text = tok.decode(a["tokens"][-1][a["attention_mask"][-1]])  # the last row: turn 3 of its episode, alone
    assert "\nTurn 3:\n" in text and "\nTurn 2:\n" not in text and "\nTurn 1:\n" not in text and "Summary:" not in text
    assert len(a["episode"]) == (4 if mode == "full" else 12)


def test_single_turn_retells_the_window_as_text(tiny):
    model, tok = tiny
    out = windowed_rollout(model, tok, window_mode="single_turn", window=2)
    last = tok.decode(out["tokens"][-1][out["attention_mask"][-1]])  # turn 3 shows turn 2 retold, then turn 3
    assert last.count("<|im_start|>user") == 1 and "Showing the last 1 turn(s)" in last and "Summary: 2 step(s)" in last
    r = out["responses"][3][1]
    assert f"Turn 2 Reward: {r['reward'] + (-0.1 if r['penalized'] else 0)}\n" in last and "Turn 1 State" not in last
    assert out["stats"]["context_rebuilds"].tolist() == [2.0] * 4


# ------------------------------------------------------------------ prefix-shared prefill
def test_shared_prefixes_tree_and_saved_tokens():
    # rows 0-2 share [1, 2, 3]; rows 0 and 1 share a 4th token; row 3 stops after its shared token; row 4 idles;
    # row 5 shares nothing. Every row keeps its last token to itself.
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 3, 9], [1, 2], [], [8, 8]]
    nodes, saved = sampler.shared_prefixes(prompts)
    assert nodes == [(-1, 0, 1, [0, 1, 2, 3]), (0, 1, 3, [0, 1, 2]), (1, 3, 4, [0, 1])]
    assert saved == [0, 1 + 2 + 1, 1 + 2, 1, 0, 0]


@pytest.mark.parametrize("static", [False, True])
def test_prefix_shared_prefill_is_exact(tiny, static):
    # the same tokens and log-probs (1e-5) with and without sharing: single turn (a tree of shared prefixes, a
    # group of identical prompts, a prompt that is another's prefix, an idle row), and whole rollouts with groups,
    # think and no-think, episodes that end early (idle rows) and the re-prefill path (every turn from slot 0)
    model, tok = tiny
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    head = enc("<|im_start|>system\nYou are a walker. Walk to the right end of the corridor.\n")
    prompts = [head + enc("board A\n")] * 3 + [head + enc("board B\n"), head + enc("board"), [], head[:5] + enc("x"),
                                               enc("nothing shared at all")]
    how = sampler.Sampler(static=static)
    runs = []
    for share in (True, False):
        cache = sampler.KVCache(model, 10 if static else len(prompts), 256, static=static)  # static: 2 extra idle rows
        keys = sampler.row_keys([0] * len(prompts), range(len(prompts)))
        runs.append(sampler.sample_turn(model, cache, prompts, 12, (), keys, 0.8, 1.0, False, how, share))
    (ta, la), (tb, lb) = runs
    assert ta == tb and [len(t) for t in ta] == [12] * 5 + [0] + [12] * 2
    assert max(abs(x - y) for ra, rb in zip(la, lb) for x, y in zip(ra, rb)) < 1e-5
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    for think, reuse in ((True, True), (False, True), (True, False)):
        outs = []
        for share in (True, False):
            envs = [FrozenLakeEnv(**preset["kwargs"]) for _ in range(6)]
            envs[1].step = lambda a: ("", 0.0, True, dict(action_is_valid=True, action_is_effective=True, success=False))
            outs.append(rollout.rollout(model, tok, envs, [5, 5, 5, 7, 7, 7],
                                        loop_settings(preset, max_turns=3, max_new_tokens=10, max_context=1500, think=think,
                                                      kv_reuse=reuse, share_prefixes=share),
                                        group_size=3, sampler=how))
        a, b = outs
        assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-5)
        saved, prefilled = a["stats"]["prefill_saved"], a["stats"]["prefill_tokens"]
        assert b["stats"]["prefill_saved"].sum() == 0 and torch.equal(prefilled, b["stats"]["prefill_tokens"])
        # row 0 computes its whole prompt; the others copy what they share with it (row 3: the instructions)
        assert saved[0] == 0 and (saved[1:] > 0).all() and (saved < prefilled).all()


@pytest.mark.parametrize("static,m", [(False, 8), (True, 8), (False, 64), (True, 64)])  # 8: the CPU's, 64: CUDA's
def test_prefill_shapes_are_bucketed_and_change_no_token(monkeypatch, tiny, static, m):
    # every prefill (first prompts, the shared-prefix spans, later turns' appends, re-prefills) runs padded to a
    # multiple of sampler.PREFILL_MULTIPLE tokens with its key length rounded up alike (at most the cache's slots),
    # so nearby lengths share one shape; the padding is masked, so the tokens and log-probs are those of the exact
    # lengths (multiple 1), on the eager cache and the static pool, with KV reuse and with re-prefill
    model, tok = tiny
    real, calls = sampler.forward_cached, []

    def recording(model, k_cache, v_cache, lens, ids, n, end):
        calls.append((ids.shape[1], end, k_cache[0].shape[2]))  # (T, key length, slots)
        return real(model, k_cache, v_cache, lens, ids, n, end)
    monkeypatch.setattr(sampler, "forward_cached", recording)
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    for reuse in (True, False):
        outs, shapes = [], []
        for multiple in (1, m):
            monkeypatch.setattr(sampler, "PREFILL_MULTIPLE", {"cpu": multiple})
            calls.clear()
            envs = [SokobanEnv(**preset["kwargs"]) for _ in range(6)]
            outs.append(rollout.rollout(model, tok, envs, [3, 3, 3, 4, 4, 4],
                                        loop_settings(preset, max_turns=3, max_new_tokens=10, max_context=1500, kv_reuse=reuse,
                                                      sample_seed=1),
                                        group_size=3, sampler=sampler.Sampler(static=static)))
            shapes.append([c for c in calls if c[0] > 1])  # the prefills (a decode step has T = 1)
        exact, bucketed = shapes
        assert any(t % m for t, _, _ in exact) and any(e % m for _, e, s in exact if e < s)  # lengths that need it
        assert len(bucketed) >= len(exact) and all(t % m == 0 and (e % m == 0 or e == s) for t, e, s in bucketed), bucketed
        a, b = outs
        assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-5)
        assert a["stats"]["num_turns"].min() >= 2  # later turns' appends ran


def test_prefills_split_by_rows_under_the_mask_budget_change_no_token(monkeypatch, tiny):
    # a prefill's additive mask is [B, 1, G*T, end] (23 GB for 128 rows re-prefilled at 3,600 tokens in bf16 on
    # Qwen2.5-0.5B); forward_cached runs it in row chunks of at most sampler.PREFILL_MASK_BYTES, with the same
    # tokens and log-probs as in one piece
    model, tok = tiny
    F, cfg = torch.nn.functional, model.config
    real, widest, G = F.scaled_dot_product_attention, [], cfg.num_attention_heads // cfg.num_key_value_heads

    def recording(q, k, v, attn_mask=None, **kw):
        widest.append(attn_mask.shape[0] if attn_mask.shape[2] > G else 0)  # [B, 1, G*T, end]: a prefill's rows
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    preset = SOKOBAN_PRESETS["SimpleSokoban"]
    outs, rows = [], []
    for budget in (2**40, 1):  # no split; one row at a time
        monkeypatch.setattr(sampler, "PREFILL_MASK_BYTES", budget)
        widest.clear()
        envs = [SokobanEnv(**preset["kwargs"]) for _ in range(6)]
        outs.append(rollout.rollout(model, tok, envs, [3, 3, 3, 4, 4, 4],
                                    loop_settings(preset, max_turns=3, max_new_tokens=10, kv_reuse=False, sample_seed=1),
                                    group_size=3))
        rows.append(max(widest))
    assert rows[0] > 1 and rows[1] == 1
    a, b = outs
    assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-5)
    assert a["stats"]["num_turns"].min() >= 2  # later turns re-prefilled


def test_prefix_shared_trunk_passes_are_exact(tiny):
    # the update's passes with the rows' common prefix run once: the same log-probs, entropies, hidden states
    # (the critic's input) and gradients as every row computed in full; right padding included
    import copy
    model = tiny[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.randint(3, 250, (1, 25), generator=g).expand(4, -1), torch.randint(3, 250, (4, 15), generator=g)], 1)
    am = torch.ones(4, 40, dtype=torch.bool)
    am[1, 35:] = am[3, 30:] = False                                    # [4, 40] ragged rows
    lm = am.clone()
    lm[:, :27] = False
    res = []
    for share in (False, True):
        m = copy.deepcopy(model).train()
        lp, ent = starpo.token_logprobs(m, tokens, am, with_entropy=True, mask=lm, share_prefix=share)
        h = starpo.last_hidden(m.model, tokens, am, share)
        (lp.sum() + ent.sum() + (h * am[..., None]).sum()).backward()
        res.append([lp, ent, h * am[..., None]] + [p.grad for p in m.parameters()])
    for a, b in zip(*res):  # fp32 rounding: sums in another order
        assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max()), (a - b).abs().max()


# --------------------------------------------------- static KV pool, compiled decode step (the CUDA path on the CPU)
class LongThenDoneEnv(CorridorEnv):
    """Corridor whose state text is `width` long and which ends after its first step (idle row afterwards)."""
    def __init__(self, width, ends):
        self.width, self.ends = width, ends

    def render(self):
        return "_" * self.width

    def step(self, action):
        return self.render(), 0.0, self.ends, dict(action_is_valid=True, action_is_effective=True, success=False)


def test_static_cache_ignores_idle_rows_with_long_histories(monkeypatch, tiny):
    # an idle row (finished episode) near max_context must not size the static cache (nor trip its assert)
    model, tok = tiny
    monkeypatch.setattr(rollout, "parse_response", lambda text, think, k: ("", ["Right"], True))
    outs = []
    for static in (False, True):
        envs = [LongThenDoneEnv(580, ends=True), LongThenDoneEnv(5, ends=False)]  # row 0: 847-token prompt
        outs.append(rollout.rollout(model, tok, envs, [0, 1],
                                    loop_settings(CORRIDOR, max_turns=3, max_new_tokens=40, max_context=900, think=False),
                                    group_size=1, greedy=True, sampler=sampler.Sampler(static=static)))
    a, b = outs
    assert a["stats"]["num_turns"].tolist() == [1, 3] and a["stats"]["response_tokens"][0] == 40  # row 0 idles at 886
    assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["old_logp"], b["old_logp"], atol=1e-5)


def test_one_static_pool_reused_and_replaced_never_duplicated(monkeypatch, tiny):
    # one pool, sized for the largest batch; smaller batches run in it, bigger ones replace it
    model, tok = tiny
    static = sampler.Sampler(static=True)
    monkeypatch.setattr(sampler, "_POOL", {})
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["one", "two two", "three three three", "four"]]
    big = sampler.generate(model, prompts, 8, greedy=True, sampler=static)
    k0 = sampler._POOL["kv"][0][0]
    small = sampler.generate(model, prompts[1:3], 8, greedy=True, sampler=static)  # fits: same tensors, idle extra rows
    assert sampler._POOL["kv"][0][0] is k0 and small[0] == big[0][1:3]
    sampler.generate(model, prompts * 2, 8, greedy=True, sampler=static)           # 8 rows: replaces the pool
    assert len(sampler._POOL) == 1 and sampler._POOL["kv"][0][0].shape[0] == 8
    eager = sampler.generate(model, prompts, 8, greedy=True)
    assert eager[0] == big[0]


def test_attention_mask_is_built_once_per_forward_in_the_compute_dtype(monkeypatch, tiny):
    # every layer gets the same folded mask tensor (at 128 rows it is ~0.5 GB bool per copy), and it is additive in
    # the query's dtype, so SDPA does not convert a bool mask again in every layer either
    model, tok = tiny
    masks, real = [], torch.nn.functional.scaled_dot_product_attention
    def sdpa(q, k, v, attn_mask=None, **kw):
        masks.append((attn_mask, q.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["one", "two two", "three three three"]]
    sampler.generate(model, prompts, 3, greedy=True)
    per_forward = len(model.model.layers)
    assert len(masks) >= 3 * per_forward and len(masks) % per_forward == 0  # prefill (maybe in parts) + 2 decode steps
    for f in range(len(masks) // per_forward):
        group = masks[f * per_forward:(f + 1) * per_forward]
        assert all(m is group[0][0] and m.dtype == dt for m, dt in group)


def test_folded_gqa_attention_equals_hf_at_qwen_head_ratio():
    # 14 query heads on 2 KV heads (Qwen2.5-0.5B's ratio) folded into the query-length axis
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=112, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 47))]
    ours, lps = sampler.generate(model, prompts, 10, greedy=True)
    assert ours == reference_generate(model, prompts, 10)
    for p, o, lp in zip(prompts, ours, lps):
        x = torch.tensor([p + o])
        assert torch.allclose(teacher_forced_logp(model, x, torch.ones_like(x))[0, len(p):], torch.tensor(lp), atol=1e-4)


def allocations(code):
    """(shape tuples) of every buffer that inductor's generated code allocates."""
    import re
    return [tuple(int(x) for x in s.split(",") if x.strip()) for s in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)]


def test_compiled_static_rollout_samples_the_eager_tokens_and_writes_the_cache_in_place(monkeypatch, tiny):
    # the CUDA path (static pool, compiled decode step with the sampler inside, a host check of
    # "all done" every 8 tokens) run with inductor on the CPU: the same tokens as the eager path, the KV pool
    # mutated in place (same storage, no cache-sized buffer anywhere in the generated code)
    from torch._inductor.utils import run_and_get_code
    model, tok = tiny
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    run = lambda sampler=None: rollout.rollout(model, tok, [FrozenLakeEnv(**preset["kwargs"]) for _ in range(4)], [5, 5, 6, 6],
                                               loop_settings(preset, max_turns=2, max_new_tokens=12, max_context=1200,
                                                             think=False, sample_seed=4), group_size=2, sampler=sampler)
    eager = run()
    assert eager["stats"]["num_turns"].tolist() == [2] * 4
    monkeypatch.setattr(sampler, "_POOL", {})
    monkeypatch.setattr(sampler, "_COMPILED", {})
    compiled = sampler.Sampler(static=True, compile="inductor", check_every=8)
    fast, codes = run_and_get_code(run, compiled)
    assert torch.equal(fast["tokens"], eager["tokens"]) and torch.allclose(fast["old_logp"], eager["old_logp"], atol=1e-5)
    k = sampler._POOL["kv"][0][0]
    layer_cache = k.numel()
    assert codes and all(math.prod(s) < layer_cache for c in codes for s in allocations(c))
    ptrs = [x.data_ptr() for x in sampler._POOL["kv"][0] + sampler._POOL["kv"][1]]
    again = run(compiled)
    assert [x.data_ptr() for x in sampler._POOL["kv"][0] + sampler._POOL["kv"][1]] == ptrs
    assert torch.equal(again["tokens"], eager["tokens"])


def test_compiled_sampler_follows_in_place_weight_updates(monkeypatch, tiny):
    # the compiled graphs hold the model's parameters as attributes (install_free_tensors), the same tensor objects:
    # train.py refreshes the rollout copy in place after every update, and the next turn samples from the new weights
    # (inductor, as on the GPU), with no new graph
    import copy
    from torch._dynamo.utils import counters
    model = copy.deepcopy(tiny[0])
    torch._dynamo.reset()
    monkeypatch.setattr(sampler, "_POOL", {})
    monkeypatch.setattr(sampler, "_COMPILED", {})
    how = sampler.Sampler(static=True, compile="inductor", check_every=4)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    run = lambda s: sampler.generate(model, prompts, 12, temperature=0.7, seed=1, sampler=s)
    before = run(how)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        noise = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=noise))
    after, eager = run(how), run(None)
    assert after[0] == eager[0] != before[0] and all(x == pytest.approx(y, abs=1e-5) for x, y in zip(after[1], eager[1]))
    assert counters["stats"]["unique_graphs"] == graphs


def bench_model_qwen_shape(layers):
    import bench
    return bench.qwen25_05b_random("cpu", torch.float32, layers=layers)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_decode_runs_on_the_memory_efficient_sdpa_kernel():
    # the folded GQA attention on the hardware: with only the efficient kernel allowed, a fallback to math would raise
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = bench_model_qwen_shape(layers=2).cuda().to(torch.bfloat16)
    prompts = [list(range(5, 5 + n)) for n in (7, 30, 64)]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        toks, _ = sampler.generate(model, prompts, 16, greedy=True)
    assert all(len(t) == 16 for t in toks)


# ------------------------------------------------------------- CUDA graphs emulated on the CPU (gpu_check.py's backends)
def emulated_rollout(model, tok, sampler=None, seeds=(5, 5, 6, 6), **kw):
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    return rollout.rollout(model, tok, [FrozenLakeEnv(**preset["kwargs"]) for _ in seeds], list(seeds),
                           loop_settings(preset, **dict(dict(max_turns=2, max_new_tokens=12, max_context=1200, think=False,
                                                             sample_seed=4), **kw)), group_size=2, sampler=sampler)


def test_compiled_sampler_never_reads_an_output_after_the_next_compiled_call(monkeypatch, tiny):
    # a CUDA-graph replay reuses its output buffers (graph trees free them as the next compiled call starts): under
    # the emulation every compiled path (sample_next after the prefill, decode_step) must give the eager tokens
    import gpu_check
    model, tok = tiny
    torch._dynamo.reset()
    monkeypatch.setattr(sampler, "_POOL", {})
    monkeypatch.setattr(sampler, "_COMPILED", {})
    eager = emulated_rollout(model, tok)
    replay = gpu_check.GraphReplayBackend()
    fast = emulated_rollout(model, tok, sampler.Sampler(static=True, compile=replay, check_every=8))
    assert replay.graphs >= 2 and replay.calls > 20  # both functions compiled, every token through them
    assert torch.equal(fast["tokens"], eager["tokens"]) and torch.allclose(fast["old_logp"], eager["old_logp"], atol=1e-5)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["one", "two two", "three three three"]]
    (a, la), (b, lb) = [sampler.generate(model, prompts, 10, temperature=0.7, top_p=0.9, seed=2, sampler=s)
                        for s in (sampler.Sampler(static=True, compile=replay, check_every=4), None)]
    assert a == b and all(x == pytest.approx(y, abs=1e-5) for x, y in zip(la, lb))


def test_compiled_sampler_gets_no_python_float_and_no_graph_beyond_the_key_buckets(monkeypatch, tiny):
    # inductor drops CUDA graphs for a graph with a CPU input, and dynamo makes a float64 CPU tensor of a Python
    # float whose value changes (the temperature: validation 0.5, training 1.0). Several steps of validation +
    # training, several turns each: every graph is free of such inputs, sample_next compiles once, and decode_step
    # at most twice (dynamo makes the key length symbolic on its second bucket)
    import gpu_check
    model, tok = tiny
    torch._dynamo.reset()
    monkeypatch.setattr(sampler, "_POOL", {})
    monkeypatch.setattr(sampler, "_COMPILED", {})
    rec = gpu_check.RecordingBackend(gpu_check.GraphReplayBackend())
    how = sampler.Sampler(static=True, compile=rec, check_every=8)
    for step in range(3):
        for temperature in (0.5, 1.0):  # validation, then training
            out = emulated_rollout(model, tok, how, seeds=(step, step, step + 1, step + 1), max_turns=3,
                                   temperature=temperature, top_p=0.95)
    assert out["tokens"].shape[1] > 2 * 128  # the key length crossed buckets
    assert [g["cpu_scalars"] for g in rec.graphs if g["cpu_scalars"]] == []
    sample = [g for g in rec.graphs if any("logits" in n for n in g["inputs"])]
    assert len(sample) == 1 and len(rec.graphs) - len(sample) <= 2, [g["inputs"] for g in rec.graphs]


def test_compiled_decode_records_a_bounded_number_of_cuda_graphs_as_conversations_grow(monkeypatch, tiny):
    # CUDA graph trees record one graph per distinct set of integer inputs of a compiled graph (the decode step's key
    # length, once dynamo has made it symbolic) and Inductor warns past 8 a graph. A rollout at --max-context 3600
    # whose conversations grow through most key lengths: at most 8 recordings per graph and 9 for the decode step
    # (its first graph, compiled at a fixed key length, records once), counted by the replay emulation; the tokens
    # are the eager path's
    import gpu_check
    model, tok = tiny
    monkeypatch.setattr(rollout, "parse_response", lambda text, think, k: ("", ["Right"], True))
    long_game = dict(CORRIDOR, max_actions_per_traj=100)
    outs, replay = [], gpu_check.GraphReplayBackend()
    for how in (None, sampler.Sampler(static=True, compile=replay, check_every=8)):
        torch._dynamo.reset()
        monkeypatch.setattr(sampler, "_POOL", {})
        monkeypatch.setattr(sampler, "_COMPILED", {})
        envs = [LongThenDoneEnv(10, ends=False) for _ in range(2)]  # a turn adds ~250 tokens (prompt, 10-token state)
        settings = loop_settings(long_game, max_turns=20, max_new_tokens=6, max_context=3600, think=False, sample_seed=1)
        outs.append(rollout.rollout(model, tok, envs, [0, 1], settings, group_size=1, sampler=how))
    eager, fast = outs
    assert torch.equal(fast["tokens"], eager["tokens"]) and torch.allclose(fast["old_logp"], eager["old_logp"], atol=1e-5)
    assert fast["attention_mask"].sum(1).min() > 3300  # every conversation grew to near --max-context
    decode = [keys for keys in replay.recorded if any(keys)]  # graphs with an integer input: the decode step's
    assert all(len(keys) <= 8 for keys in replay.recorded) and sum(len(keys) for keys in decode) <= 9, replay.recorded


def cuda_layout_sdpa(real):
    """F.scaled_dot_product_attention with the output layout of CUDA's memory-efficient and flash kernels
    (gpu_check.cuda_layout; test_cuda_efficient_attention_returns_a_transposed_view pins it to the meta kernel)."""
    import gpu_check
    return lambda *a, **k: gpu_check.cuda_layout(real(*a, **k))


@pytest.mark.parametrize("path", ["eager", "static", "compiled", "no-kv-reuse", "generate"])
def test_sampler_samples_the_same_under_cuda_sdpa_output_layout(monkeypatch, tiny, path):
    # every sampler path, with SDPA returning CUDA's strides, samples the tokens and log-probs of the CPU layout;
    # "compiled" runs under the CUDA-graph emulation, the rollouts are multi-turn (KV reuse, except "no-kv-reuse")
    import gpu_check
    model, tok = tiny
    how = dict(eager=None, static=sampler.Sampler(static=True), compiled="replay").get(path)
    outs = []
    for patch in (False, True):
        torch._dynamo.reset()
        monkeypatch.setattr(sampler, "_POOL", {})
        monkeypatch.setattr(sampler, "_COMPILED", {})
        if patch:
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                                cuda_layout_sdpa(torch.nn.functional.scaled_dot_product_attention))
        s = sampler.Sampler(static=True, compile=gpu_check.GraphReplayBackend(), check_every=8) if how == "replay" else how
        if path == "generate":
            prompts = [tok.encode(t, add_special_tokens=False) for t in ["one", "two two", "three three three"]]
            toks, lps = sampler.generate(model, prompts, 10, temperature=0.7, seed=2)
            outs.append(dict(tokens=torch.tensor([t + [0] * (10 - len(t)) for t in toks]),
                             old_logp=torch.tensor([l + [0.0] * (10 - len(l)) for l in lps])))
        else:
            outs.append(emulated_rollout(model, tok, s, max_turns=3, kv_reuse=path != "no-kv-reuse"))
    a, b = outs
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["old_logp"], b["old_logp"])


def test_cuda_efficient_attention_returns_a_transposed_view():
    # the layout cuda_layout_sdpa emulates, read off the installed torch's meta kernel for CUDA's memory-efficient
    # attention (the kernel a masked SDPA runs on a GPU) on fake CUDA tensors: a torch that changes it fails here
    import gpu_check
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 2, 112, 64, dtype=torch.bfloat16, device="cuda")       # [B, KV, G*T, D]
        kv = torch.empty(2, 2, 128, 64, dtype=torch.bfloat16, device="cuda")      # [B, KV, S, D]
        mask = torch.empty(2, 1, 112, 128, dtype=torch.bfloat16, device="cuda")
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, kv, kv, mask, False)[0]
        emulated = gpu_check.cuda_layout(torch.empty(2, 2, 112, 64))
    assert out.shape == (2, 2, 112, 64) and out.stride() == emulated.stride() == (14336, 64, 128, 1)


# ------------------------------------------------------------- the CUDA path on fake CUDA tensors (gpu_check.fake_cuda_trace)
@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_cuda_path_traces_on_fake_cuda_tensors(arch):
    # the sampler (bf16 rollout model) and the update's forward (fp32 weights under bf16 autocast, and FSDP2's bf16
    # parameters) on fake CUDA tensors, SDPA as CUDA's efficient kernel: every tensor on the device, in the dtype
    # CUDA's kernels take, under the efficient kernel's output layout (a fake CUDA SDPA left alone decomposes into
    # math on a CPU-only torch, with a contiguous output, hence gpu_check.efficient_sdpa)
    import gpu_check
    seen = gpu_check.fake_cuda_trace(arch, T=24)
    V = models.build_tiny(arch)[0].config.vocab_size
    assert seen["logits"] == seen["shared_logits"] == ((3, V), torch.float32, "cuda")  # mm(..., out_dtype=fp32)
    assert seen["token"] == seen["greedy"] == ((3,), torch.long, "cuda") and seen["logp"] == ((3,), torch.float32, "cuda")
    assert seen["cache_k"][1:] == (torch.bfloat16, "cuda") and seen["grown_k"][0][2] == 512  # ensure() grew it on the device
    for part in ("update", "fsdp_update"):
        assert seen[f"{part}_logp"] == seen[f"{part}_entropy"] == ((3, 24), torch.float32, "cuda")
        assert seen[f"{part}_loss"] == ((), torch.float32, "cuda")
    assert seen["values"] == ((3, 24), torch.float32, "cuda") and seen["value_loss"] == ((), torch.float32, "cuda")
    # every sampler attention call (prefill in row chunks, decode, shared prefixes) got the transposed layout
    assert len(seen["sdpa"]) >= 10 and all(s[1] < s[2] and not gqa for s, gqa in seen["sdpa"])


def test_fake_cuda_trace_catches_device_dtype_and_layout_faults():
    # what the trace is for: a tensor made on the CPU, a dtype CUDA's kernel refuses, a .view of a kernel's output
    import gpu_check
    model = models.build_tiny()[0]
    with gpu_check.fake_cuda():
        with pytest.raises(RuntimeError, match="same device"):  # sampling keys made without device=
            sampler.sample_next(torch.zeros(2, 50, device="cuda"), torch.arange(2))
        model = gpu_check.fake_cuda_model(model, torch.bfloat16)
        k, v = ([torch.zeros(2, 2, 16, 16, device="cuda") for _ in model.model.layers] for _ in range(2))  # fp32 cache
        with pytest.raises((RuntimeError, AssertionError), match="dtype"), torch.no_grad():
            sampler.forward_cached(model, k, v, torch.zeros(2, dtype=torch.long, device="cuda"),
                                   torch.zeros(2, 8, dtype=torch.long, device="cuda"), torch.full((2,), 8, device="cuda"), 8)
        q = torch.empty(2, 2, 16, 16, dtype=torch.bfloat16, device="cuda")                       # [B, H, L, D]
        with pytest.raises(AssertionError, match="mask in torch.float32"):  # "invalid dtype for bias" on CUDA
            gpu_check.efficient_sdpa(q, q, q, attn_mask=torch.zeros(2, 1, 16, 16, device="cuda"))
        out = gpu_check.efficient_sdpa(q, q, q)
        with pytest.raises((RuntimeError, ValueError), match="view"):  # fine on a contiguous CPU output
            out.view(2, 2, 256)


def test_decode_loop_syncs_the_host_once_per_check(tiny):
    # on CUDA each host read of tensor data (bool(), .tolist(), nonzero, a sorting isin) waits for the GPU: the decode
    # loop makes one per check_every tokens, with and without a turn cut (stop_at), counted by gpu_check.HostSyncs
    import gpu_check
    model, tok = tiny
    assert gpu_check.decode_syncs_per_token(model, "cpu", every=8) == 1 / 8
    stop_at = rollout.answer_end(tok, "<answer>", False)  # random weights never close the tag: rows run to budget

    def syncs(n):
        cache = sampler.KVCache(model, 4, 128)
        with gpu_check.HostSyncs() as h:
            sampler.sample_turn(model, cache, [[5, 6, 7], [8, 9], [10], [11, 12]], n, (), sampler.row_keys(range(4)),
                                sampler=sampler.Sampler(check_every=8), stop_at=stop_at)
        return h.count
    assert (syncs(48) - syncs(16)) / 32 == 1 / 8
    with gpu_check.HostSyncs() as h:  # what it counts: reads, data-sized outputs, isin only where torch sorts
        x = torch.arange(6)
        bool(x.any()), x.tolist(), x[x > 2], x.nonzero(), torch.isin(x, torch.tensor([1, 2])), torch.isin(x, torch.arange(30))
    assert h.count == 5


def test_decode_loop_runs_a_few_ops_per_token_outside_the_compiled_step(tiny):
    # on CUDA every op the decode loop runs outside its compiled step is a kernel launch and host time per token
    # (bench.py --only host): with the bookkeeping inside the step, the loop clones the step's three outputs (tokens,
    # log-probs, lengths) and reads the tokens once per check (4 ops per 8 tokens); a launch more per token fails here
    import bench
    model, tok = tiny
    _, per_token, ops = bench.time_host_per_step(model, tok, rows=4, context=100, new_tokens=16, repeats=1)
    assert per_token <= 3.5, ops


def test_decode_calls_skip_guards_only_where_they_cannot_change(monkeypatch, tiny):
    # a compiled decode call skips dynamo's guards only when the call before it in its turn ran them at the same key
    # length; under that stance dynamo would run a stale graph for a changed Python input (a key length, top-p mode,
    # greedy flag), so each turn's first call and each new key length run them: a turn that crosses a key length, then
    # top-p and greedy turns, compile new graphs (RecordingBackend) and sample the eager tokens; most calls skip them
    import gpu_check
    model, _ = tiny
    torch._dynamo.reset()
    monkeypatch.setattr(sampler, "_POOL", {})
    monkeypatch.setattr(sampler, "_COMPILED", {})
    skipped, set_stance = [], torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: skipped.append(k) or set_stance(*a, **k))
    rec = gpu_check.RecordingBackend(gpu_check.GraphReplayBackend())
    how = sampler.Sampler(static=True, compile=rec, check_every=8)
    prompts = [list(range(5, 5 + n)) for n in (200, 3, 120)]  # 281 slots: key lengths 256, then 384
    graphs = []
    for kw in (dict(), dict(top_p=0.9), dict(greedy=True), dict()):
        (a, la), (b, lb) = [sampler.generate(model, prompts, 80, temperature=0.8, seed=3, sampler=s, **kw) for s in (how, None)]
        assert a == b and all(x == pytest.approx(y, abs=1e-5) for x, y in zip(la, lb)), kw
        graphs.append(len(rec.graphs))
    assert graphs[0] >= 3 and graphs[0] < graphs[1] < graphs[2] == graphs[3], graphs  # the repeat compiles nothing
    assert len(skipped) >= 4 and all(k == dict(skip_guard_eval_unsafe=True) for k in skipped), skipped


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_with_the_emulations():
    # gpu_check.py off a GPU (bench.py --gpu-check runs the same): the same twelve checks, CUDA graphs and SDPA's CUDA
    # layout emulated, the tiny model; exit 0 = no FAIL. Peak memory and the bandwidth floor have nothing to hold a CPU
    # to: those three lines only report; the torchrun line runs on CUDA only (its CPU form is the test below)
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_check.py")], capture_output=True, text=True,
                       cwd=HERE, env=dict(train_env(), CUDA_VISIBLE_DEVICES=""), timeout=600)
    lines = [(l[:4], l[6:30].strip()) for l in r.stdout.splitlines() if l.startswith(("PASS", "FAIL", "INFO"))]
    assert r.returncode == 0 and lines == [
        ("PASS", "compiled == eager"), ("PASS", "graphs, recompiles"), ("PASS", "SDPA kernel"), ("PASS", "fp32 logits"),
        ("PASS", "SDPA output layout"), ("PASS", "fake-CUDA trace"), ("PASS", "noise bits"), ("PASS", "host syncs / token"),
        ("INFO", "train.py step"), ("INFO", "decode vs floor"), ("INFO", "decode 16 rows, 3k"), ("INFO", "torchrun, resume")
    ], r.stdout + r.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_resume_check_on_two_gloo_ranks(tmp_path):
    # gpu_check.py's torchrun line, which runs only on CUDA (NCCL), in its CPU form: 2 gloo ranks, 2 steps against 1
    # step and a resume to 2, the same metrics and weights within the 2-rank tolerance
    import gpu_check
    ok, detail = gpu_check.torchrun_resume("cpu", 2, str(tmp_path))
    assert ok, detail



@pytest.mark.slow
def test_step_bench_times_every_phase_of_both_sides(tmp_path):
    # bench.py --only step on the tiny model: train.py's step, per phase, on both sides; --against another checkout
    # (here this one again) runs that checkout's train.py; both sides must report the same scores and losses
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--only", "step", "--model", "tiny", "--repeats", "1",
                        "--against", HERE], capture_output=True, text=True, cwd=HERE, env=train_env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = {l.split()[0]: l for l in r.stdout.splitlines() if l.startswith("  ")}
    assert set(rows) >= {"rollout", "old_logp", "ref_values", "update", "step", "critic/vf_loss"}, r.stdout
    assert rows["before:"].split()[1:] == [HERE], rows["before:"]  # the other checkout, its defaults (no flag)
    assert "(phase skipped)" in rows["old_logp"]  # one mini-batch: the update's own forward gives its old log-probs
    before, after = rows["critic/vf_loss"].split()[2], rows["critic/vf_loss"].split()[4]
    assert before == after, rows["critic/vf_loss"]

# ------------------------------------------------------------------ log-probs from fp32 logits
def large_logit_model():
    """The tiny model with its final norm scaled so that the top logits lie in [16, 32), where bf16's spacing is
    0.125: a bf16 logit is off by up to 0.0625, and so is every log-prob taken from it."""
    model, tok = models.build_tiny()
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)
    return model, tok


def test_a_bf16_load_casts_only_parameters_and_samples_like_trains_rollout_copy(tmp_path):
    # one dtype rule for every copy that samples (models.cast_parameters): eval.py's load_model(dtype=bf16) and
    # train.py's bf16 rollout copy (fsdp.meta_copy) both keep RoPE's inv_freq in fp32, so their logits are identical
    import fsdp
    path = str(save_tiny(tmp_path / "m", arch="qwen2"))
    model, tok = models.load_model(path, dtype=torch.bfloat16)
    copy = fsdp.build_models(path, torch.device("cpu"), False, 0, True, False, False)["rollout_model"]
    for m in (model, copy):
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
        inv = [b for n, b in m.named_buffers() if n.endswith("inv_freq")]
        assert inv and all(b.dtype == torch.float32 for b in inv)
    ids = torch.tensor([tok.encode("a longer prompt than the other", add_special_tokens=False)[:12]] * 2)  # [2, 12]
    logits = [sampler.forward_cached(m, *(lambda c: (c.k, c.v, c.lens))(sampler.KVCache(m, 2, 16)), ids,
                                     torch.tensor([12, 7]), 12) for m in (model, copy)]
    assert torch.equal(*logits)


def test_dtype_auto_is_bf16_exactly_where_the_cpu_has_native_bf16(tmp_path, monkeypatch, capsys):
    # one rule (models.compute_dtype) for train.py, sft.py and eval.py: auto = bf16 on CUDA and on a CPU with bf16
    # matrix units, else fp32; printed, and recorded in args.json (sft.json); a bf16 CPU run samples from a bf16 copy
    import train
    assert [models.compute_dtype(f, "cuda") for f in ("auto", "fp32", "bf16")] == ["bf16", "fp32", "bf16"]
    # a resumed run keeps its own under auto (one saved before the key: the rule it ran under), not a named one
    assert [models.compute_dtype(f, "cpu", saved) for f, saved in (("auto", {"compute_dtype": "bf16"}), ("auto", {}),
            ("fp32", {"compute_dtype": "bf16"}))] == ["bf16", "fp32", "fp32"]
    auto = TINY[:2] + TINY[4:]  # TINY without its --dtype fp32
    assert "--dtype" not in auto
    for native, want in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(models, "native_bf16", lambda: native)
        assert models.compute_dtype("auto", "cpu") == want and models.compute_dtype("fp32", "cpu") == "fp32"
        out = tmp_path / want
        train.main([*auto, "--env", "bandit", "--algo", "grpo", "--steps", "1", "--val-every", "0", "--out", str(out)])
        assert f"compute dtype {want} (--dtype auto" in capsys.readouterr().out
        assert json.load(open(out / "args.json"))["compute_dtype"] == want
        code = 0
        try:
            sft.main(["--device", "cpu", "--model", "tiny", "--env", "bandit", "--episodes", "4", "--steps", "1",
                      "--batch-size", "4", "--out", str(tmp_path / f"sft-{want}")])
        except SystemExit as e:
            code = e.code
        assert code in (0, None) and f"compute dtype {want} (--dtype auto" in capsys.readouterr().out
        assert json.load(open(tmp_path / f"sft-{want}" / "sft.json"))["compute_dtype"] == want


def test_sampler_logits_are_fp32_for_a_bf16_model():
    model, tok = large_logit_model()
    model = model.to(torch.bfloat16)
    seen = []
    model.model.norm.register_forward_hook(lambda mod, inp, out: seen.append(out))
    ids = torch.tensor([tok.encode("hello world, a prompt", add_special_tokens=False)])  # [1, T]
    cache = sampler.KVCache(model, 1, ids.shape[1] + 1)
    with torch.no_grad():
        ours = sampler.forward_cached(model, cache.k, cache.v, cache.lens, ids, torch.tensor([ids.shape[1]]), ids.shape[1])
    want = seen[-1].float() @ model.lm_head.weight.float().T  # [1, V] the bf16 model's hidden state, fp32 product
    assert ours.dtype == torch.float32 and want.abs().max() >= 16
    rounded = (want.to(torch.bfloat16).float() - want).abs().max()  # what a bf16 logit loses here
    assert rounded > 0.01 and (ours - want).abs().max() < 1e-4, ((ours - want).abs().max(), rounded)
    # the CPU keeps an fp32 copy of the bf16 lm_head (sampler.fp32_weight): an in-place refresh of the weights, as
    # train.py's sync_rollout_weights makes after every update, must reach the logits
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.flip(0))  # tied: the embedding changes too
        cache = sampler.KVCache(model, 1, ids.shape[1] + 1)
        again = sampler.forward_cached(model, cache.k, cache.v, cache.lens, ids, torch.tensor([ids.shape[1]]), ids.shape[1])
    want = seen[-1].float() @ model.lm_head.weight.float().T
    assert (again - want).abs().max() < 1e-4 and (again - ours).abs().max() > 1


def test_token_logprobs_under_bf16_autocast_come_from_fp32_logits():
    model, tok = large_logit_model()
    tokens = torch.tensor([tok.encode("a longer sentence for the log-probs", add_special_tokens=False)])  # [1, T]
    am = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        lp, _ = starpo.token_logprobs(model, tokens, am)
        hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1][0, :-1]  # [T-1, d]
    logits = hidden.float() @ model.lm_head.weight.float().T  # [T-1, V] fp32
    want = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    assert logits.abs().max() >= 16
    bf16 = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    assert (bf16 - want).abs().max() > 0.01 and (lp[0, 1:] - want).abs().max() < 1e-4, (lp[0, 1:] - want).abs().max()


# ==================================================================================================
# Training (train.py end to end, in subprocesses, torchrun included)
# ==================================================================================================
TINY = ["--device", "cpu", "--dtype", "fp32", "--model", "tiny", "--num-groups", "2", "--group-size", "2", "--filter-ratio", "1", "--mini-batch-size", "4",
        "--micro-batch-size", "2", "--max-new-tokens", "12", "--max-turns", "2", "--val-groups", "2", "--val-every", "2",
        "--log-trajectories-every", "1"]


def train_env():
    """The test's environment minus torch.distributed variables a launcher may have set (a plain run would
    think it is a rank); --standalone torchrun picks its own free port."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_train(*flags, torchrun=0, check=True, env=None):
    """train.py (on torchrun ranks) on the CPU unless the flags name a device: on a GPU machine a plain run would
    take CUDA (bf16, compiled sampler) and a 2-rank run would ask for cuda:1; the suite's tolerances are CPU ones."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] if torchrun else [sys.executable]
    flags = flags if "--device" in flags else ("--device", "cpu", *flags)
    flags = flags if "--dtype" in flags else ("--dtype", "fp32", *flags)  # fp32 tolerances: auto is bf16 on some CPUs
    r = subprocess.run(cmd + [os.path.join(HERE, "train.py"), *flags], capture_output=True, text=True, cwd=HERE,
                       env=dict(train_env(), **(env or {})), timeout=600)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def read_metrics(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def comparable(m):
    return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}


# -------------------------------------------------------------- two steps of every env, algorithm, filter and window
NEW_PRESETS = ["Countdown", "CoordSokoban", "CoordFrozenLake", "CoordFrozenLakeDet"]


# Two steps of each env and algorithm, the RAGEN-2 presets, and the RAGEN-2 algorithms, filters and context windows
# (flags after TINY "--steps 2"). Collapse diagnostics stay at their default (step 0, then every 5 steps): whether a
# case logs them says whether its rows hold whole episodes.
TWO_STEP_RUNS = {
    **{f"{env}-{algo}": ["--env", env, "--algo", algo] for algo in ("ppo", "grpo") for env in ("bandit", "sokoban", "frozenlake", "webshop")},
    **{env: ["--env", env, "--algo", "grpo", "--val-every", "0"] for env in NEW_PRESETS},
    "drgrpo-mixed-limited_multi_turn": [
        "--algo", "drgrpo", "--env", "SimpleSokoban:2", "FrozenLake:2", "--filter-strategy", "top_p", "--filter-ratio", "0.5",
        "--filter-metric", "length", "--context-window-mode", "limited_multi_turn", "--max-context-window", "1",
        "--batch-adjust", "delete", "--val-every", "2"],
    "rloo-single_turn": [
        "--algo", "rloo", "--env", "frozenlake", "--filter-strategy", "top_p", "--filter-top-p-mode", "softmax",
        "--filter-ratio", "0.6", "--filter-metric", "entropy", "--context-window-mode", "single_turn", "--val-every", "0"],
    "reinforce_pp_baseline-window": [
        "--algo", "reinforce_pp_baseline", "--env", "sokoban", "--filter-strategy", "top_k_abs", "--filter-ratio", "1",
        "--filter-metric", "entropy_std", "--filter-loss-scaling", "sqrt", "--max-context-window", "1", "--collapse-every", "1",
        "--val-every", "0"],
}


@pytest.mark.slow
@pytest.mark.parametrize("flags", list(TWO_STEP_RUNS.values()), ids=list(TWO_STEP_RUNS))
def test_two_step_run(tmp_path, flags):
    out = str(tmp_path / "run")
    run_train(*TINY, "--steps", "2", *flags, "--out", out)
    ms, args = read_metrics(out), json.load(open(os.path.join(out, "args.json")))
    assert [m["step"] for m in ms] == [0, 1, *([2] if args["val_every"] else [])]  # two steps, then the final validation
    assert all(m["train/batch_size"] % 4 == 0 for m in ms[:2])  # whole mini-batches after the batch adjust
    if "--filter-strategy" not in flags:  # --filter-ratio 1 keeps both groups of 2 whole episodes
        assert [m["train/batch_size"] for m in ms[:2]] == [4, 4]
    for m in ms[:2]:
        if m["train/batch_size"]:
            assert all(k in m for k in ("actor/pg_loss", "actor/entropy", "rollout/in_group_std", "timing_s/rollout"))
            assert ("critic/vf_loss" in m) == (args["algo"] == "ppo")
    assert args["loss_agg"] == ("seq-mean-token-sum" if "drgrpo" in flags else "token-mean")
    windowed = args["context_window_mode"] != "full" or args["max_context_window"] > 0
    assert ("collapse/first_turn/mi" in ms[0]) == (not windowed)  # windowed rows are not whole episodes: no MI
    assert ("adv/turn1_abs_mean" in ms[0]) == (not windowed and ms[0]["train/batch_size"] > 0)  # nor turn numbers
    assert os.path.exists(os.path.join(out, "ckpt.pt"))
    if flags[1] in NEW_PRESETS:
        assert args["max_actions_per_turn"] == {"Countdown": 1}.get(flags[1], 2)  # from the preset (TINY sets --max-turns)
    if "FrozenLake:2" in flags:  # env mixing: metrics per preset, validation on both, 8 episodes x 2 turns = 16 rows
        assert {"train/SimpleSokoban/success", "train/FrozenLake/success", "val-env/FrozenLake/success"} <= set(ms[0]) | set(ms[-1])
        assert args["env_mix"] == [["SimpleSokoban", 2], ["FrozenLake", 2]] and ms[0]["rollout/length/in_group_mean"] > 0


# ------------------------------------------------------------------ what a step logs and how it runs
@pytest.mark.slow
@pytest.mark.slow
def test_work_and_observations_are_logged_every_step(tmp_path):
    """work/*: the tokens each pass runs through a model. GRPO with 2 epochs over one mini-batch: the actor's forward
    and backward twice over the kept rows (its old log-probs come from the first forward), so forward - rollout =
    backward; PPO, 1 epoch: values, actor and critic forwards, actor and critic backwards, forward - rollout = 1.5 x
    backward. The rollout's share is the tokens the sampler prefilled and sampled. observations.jsonl: one line per
    step and preset with every observation the step's training episodes showed."""
    flags = [*TINY, "--env", "frozenlake", "--steps", "2", "--lr", "1e-3", "--val-every", "0", "--collapse-every", "0"]
    for algo, extra, ratio in (("grpo", ["--ppo-epochs", "2"], 1.0), ("ppo", [], 1.5)):
        out = str(tmp_path / algo)
        run_train(*flags, "--algo", algo, *extra, "--out", out)
        ms, total = read_metrics(out), 0.0
        for m in ms:
            rollout_tokens = 4 * (m["train/FrozenLake/prefill_tokens"] + m["train/FrozenLake/response_tokens"])
            assert m["work/forward_tokens"] - rollout_tokens == pytest.approx(ratio * m["work/backward_tokens"]), algo
            total += m["work/forward_tokens"] + 2 * m["work/backward_tokens"]
            assert m["work/compute_tokens_total"] == pytest.approx(total)
        obs = [json.loads(l) for l in open(os.path.join(out, "observations.jsonl"))]
        assert [(o["step"], o["preset"]) for o in obs] == [(0, "FrozenLake"), (1, "FrozenLake")]
        first = [FrozenLakeEnv(**FROZENLAKE_PRESETS["FrozenLake"]["kwargs"]).reset(s) for s in (10000, 10001)]
        assert set(first) <= set(obs[0]["observations"]) and obs[0]["observations"] == sorted(set(obs[0]["observations"]))


def test_update_check_logs_how_the_step_moved_its_tokens(tmp_path, monkeypatch):
    """--check-update-every 1: every step logs check/* (starpo.update_direction, tested by hand above) from one more
    forward that work/* leaves out. The tiny model warmed up to say a digit (Toy), so that groups differ in reward;
    a large GRPO step moves tokens with A > 0 up and tokens with A < 0 down."""
    import importlib
    import train
    (tmp_path / "env_toy.py").write_text(TOY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(agent, "ENV_CLASSES", dict(agent.ENV_CLASSES))
    monkeypatch.setattr(agent, "SHORT_NAMES", dict(agent.SHORT_NAMES))
    toy = importlib.import_module("env_toy")
    agent.register(toy.ToyEnv, toy, "toy", "Toy")
    sft.main(["--device", "cpu", "--model", "tiny", "--env", "toy", "--policy", "random", "--no-think", "--episodes",
              "64", "--epochs", "8", "--batch-size", "8", "--lr", "3e-3", "--heldout", "0", "--out", str(tmp_path / "sft")])
    flags = [*TINY[:4], "--model", str(tmp_path / "sft"), *TINY[6:], "--env", "toy", "--algo", "grpo", "--no-think", "--max-turns", "1", "--max-new-tokens", "24", "--steps", "2", "--lr", "1e-3",
             "--val-every", "0", "--collapse-every", "0", "--num-groups", "4", "--group-size", "4",
             "--mini-batch-size", "16"]
    train.main([*flags, "--check-update-every", "1", "--out", str(tmp_path / "a")])
    train.main([*flags, "--out", str(tmp_path / "b")])
    checked, plain = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    for m, p in zip(checked, plain):
        assert m["work/compute_tokens_total"] == p["work/compute_tokens_total"] and "check/dlogp_pos_adv" not in p
        print({k: round(v, 4) for k, v in m.items() if k.startswith(("check/", "train/Toy/success"))})
        assert m["check/dlogp_pos_adv"] > 0 > m["check/dlogp_neg_adv"]
        assert m["check/success_pos_adv_fraction"] > m["check/failure_pos_adv_fraction"]


def test_lr_warmup_follows_verls_constant_schedule(tmp_path):
    """--lr-warmup-steps N is veRL's get_constant_schedule_with_warmup (a LambdaLR stepped once per actor update):
    update u < N at lr * u / N, counted from the actor's first update (after --critic-warmup). So the first update
    runs at lr 0 and leaves the weights bit-equal to a run at lr 0; the next ones move them."""
    import train
    verl = lambda u, n: float(u) / float(max(1.0, n)) if u < n else 1.0  # veRL's lambda, written out
    for critic_warmup, n in ((0, 4), (2, 3), (0, 1)):
        args = argparse.Namespace(lr=1e-4, lr_warmup_steps=n, critic_warmup=critic_warmup)
        assert [train.actor_lr(args, critic_warmup + u) for u in range(6)] == pytest.approx(
            [1e-4 * verl(u, n) for u in range(6)])
    assert train.actor_lr(argparse.Namespace(lr=1e-4, lr_warmup_steps=0, critic_warmup=0), 0) == 1e-4
    assert train.actor_lr(argparse.Namespace(lr=1e-4, lr_warmup_steps=3, critic_warmup=2), 1) == 0.0  # critic alone
    flags = [*TINY, "--env", "frozenlake", "--algo", "grpo", "--val-every", "0", "--collapse-every", "0"]
    runs = {name: str(tmp_path / name) for name in ("warm", "zero", "long")}
    run_train(*flags, "--steps", "1", "--lr", "1e-2", "--lr-warmup-steps", "3", "--out", runs["warm"])
    run_train(*flags, "--steps", "1", "--lr", "0", "--out", runs["zero"])
    run_train(*flags, "--steps", "3", "--lr", "1e-2", "--lr-warmup-steps", "2", "--out", runs["long"])
    assert [m["actor/lr"] for m in read_metrics(runs["long"])] == pytest.approx([0.0, 5e-3, 1e-2])
    warm, zero, long = (checkpoint.read_state(runs[k])["actor"] for k in ("warm", "zero", "long"))
    assert all(torch.equal(warm[k], zero[k]) for k in zero)
    assert max((long[k] - zero[k]).abs().max().item() for k in zero) > 1e-4


def test_logged_losses_do_not_depend_on_the_micro_batch_size(tmp_path):
    # logged losses are means over the mini-batch, not over micro-batch partial sums (4x less at 1 than at 4)
    flags = [*TINY, "--env", "frozenlake", "--algo", "ppo", "--steps", "1", "--val-every", "0", "--collapse-every", "0",
             "--lr", "1e-3", "--critic-lr", "1e-3"]
    outs = [str(tmp_path / f"mb{n}") for n in (1, 4)]
    for out, n in zip(outs, (1, 4)):
        run_train(*flags, "--micro-batch-size", str(n), "--out", out)
    a, b = read_metrics(outs[0])[0], read_metrics(outs[1])[0]
    for k in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm", "critic/grad_norm"):
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert a["critic/vf_loss"] > 0


@pytest.mark.slow
def test_inductive_reward_norm_runs_on_mixed_presets(tmp_path):
    # --reward-norm-grouping inductive needs each row's env tag, passed by train.py to normalize_scores
    out = str(tmp_path / "ind")
    run_train(*TINY, "--env", "bandit:1", "frozenlake:1", "--algo", "grpo", "--reward-norm", "mean",
              "--reward-norm-grouping", "inductive", "--steps", "1", "--val-every", "0", "--collapse-every", "0", "--out", out)
    assert math.isfinite(read_metrics(out)[0]["actor/pg_loss"])


@pytest.mark.slow
def test_grad_checkpointing_runs_and_holds_fewer_activations(tmp_path):
    # HF skips checkpointing in eval mode (the mode load_model returns models in), so the update runs in train mode:
    # the bytes autograd holds for backward (perf/actor_saved_activations_mb) must drop
    flags = [*TINY, "--env", "sokoban", "--algo", "grpo", "--steps", "1", "--val-every", "0", "--collapse-every", "0",
             "--micro-batch-size", "4", "--max-new-tokens", "24", "--measure-activations"]
    held = {}
    for ckpt in (False, True):
        out = str(tmp_path / f"ckpt{ckpt}")
        run_train(*flags, *(["--grad-checkpointing"] if ckpt else []), "--out", out)
        held[ckpt] = read_metrics(out)[0]["perf/actor_saved_activations_mb"]
    assert held[True] < 0.6 * held[False], held


@pytest.mark.slow
def test_train_logs_collapse_metrics_and_plot_overlays_runs(tmp_path):
    out = str(tmp_path / "run")
    run_train(*TINY, "--env", "frozenlake", "--algo", "grpo", "--no-think", "--steps", "2", "--val-every", "0",
              "--collapse-every", "1", "--out", out)
    ms = read_metrics(out)
    for m in ms:  # 2 groups x 2 rows: first_turn has one column per group, any_turn one per pair
        assert m["collapse/first_turn/prompts"] == 2 and m["collapse/any_turn/prompts"] == m["collapse/any_turn/pairs"]
        for v in ("first_turn", "any_turn"):
            assert -1e-6 < m[f"collapse/{v}/mi"] + 1e-3 and m[f"collapse/{v}/mi"] <= m[f"collapse/{v}/mi_upper_bound"] + 1e-6
            assert 0 <= m[f"collapse/{v}/retrieval_acc"] <= 1 and m[f"collapse/{v}/valid_rate"] > 0
        assert "timing_s/collapse" in m
    png = ev.plot_run(out, out, out=str(tmp_path / "ab.png"))  # two runs overlaid
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000


# Every prompt prefill collapse.cross_logliks runs (a model call on one prompt without a cache): [rank, prefills] as
# one JSON line per call of cross_logliks
COLLAPSE_PROBE = ("import json, os, collapse\n_cross = collapse.cross_logliks\n"
                  "class Counting:\n"
                  "    def __init__(self, model):\n        self.model, self.prefills = model, 0\n"
                  "    def __getattr__(self, name):\n        return getattr(self.model, name)\n"
                  "    def __call__(self, *a, **k):\n"
                  "        self.prefills += k.get('past_key_values') is None\n"
                  "        return self.model(*a, **k)\n"
                  "def cross_logliks(model, *a, **k):\n"
                  "    counting = Counting(model)\n"
                  "    out = _cross(counting, *a, **k)\n"
                  "    with open(os.environ['COLLAPSE_PROBE'], 'a') as f:\n"
                  "        f.write(json.dumps([os.environ.get('RANK', '0'), counting.prefills]) + '\\n')\n"
                  "    return out\n"
                  "collapse.cross_logliks = cross_logliks\n")


@pytest.mark.slow
def test_collapse_diagnostics_are_spread_over_the_ranks(tmp_path):
    """The collapse diagnostics' prompt columns are divided among the ranks (each prefills its share, the scores are
    summed over ranks): 2 ranks prefill the prompts 1 process does, each about half of them, and log the same
    diagnostics."""
    (tmp_path / "sitecustomize.py").write_text(COLLAPSE_PROBE)
    flags = [*TINY, "--env", "frozenlake", "--algo", "grpo", "--no-think", "--num-groups", "4", "--steps", "1",
             "--val-every", "0", "--collapse-every", "1", "--lr", "1e-3"]
    counts = {}
    for ranks, name in ((0, "one"), (2, "two")):
        probe = str(tmp_path / f"{name}.jsonl")
        run_train(*flags, "--out", str(tmp_path / name), torchrun=ranks,
                  env=dict(PYTHONPATH=os.pathsep.join([str(tmp_path), HERE]), COLLAPSE_PROBE=probe))
        counts[name] = [json.loads(l) for l in open(probe)]
    one = sum(n for _, n in counts["one"])
    per_rank = {r: sum(n for q, n in counts["two"] if q == r) for r in ("0", "1")}
    assert one >= 4 and sum(per_rank.values()) == one and min(per_rank.values()) >= one // 2 - 1, (counts, per_rank)
    a, b = read_metrics(str(tmp_path / "one"))[0], read_metrics(str(tmp_path / "two"))[0]
    keys = [k for k in a if k.startswith("collapse/")]
    assert keys and keys == [k for k in b if k.startswith("collapse/")]
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_ranks_leave_together_and_skip_the_interpreters_teardown(tmp_path):
    """ranks.leave: two gloo ranks meet, destroy the group and exit 0 without running the interpreter's teardown, so
    a teardown that would abort (here an atexit handler that calls os.abort, standing in for torch's C++ teardown)
    cannot fail a finished run; the text written before leave() comes through."""
    script = tmp_path / "leave.py"
    script.write_text("import atexit, os, ranks, torch.distributed as dist\n"
                      "ranks.init_compute('cpu', True, 1)\n"
                      "atexit.register(os.abort)\n"
                      "print(f'rank {dist.get_rank()} done')\n"
                      "ranks.leave(True)\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                       capture_output=True, text=True, cwd=HERE, env=dict(train_env(), PYTHONPATH=HERE), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout


@pytest.mark.slow
def test_each_ranks_rollout_time_is_logged(tmp_path):
    """timing_s/rollout_rank_max and _mean: the seconds each rank spent in its own rollout (before the gather waits
    for the others), the slowest and the mean over ranks, so load imbalance shows in metrics.jsonl. Rank 1 made 1 s
    slower per rollout call: the max leads the mean by about half a second; one process: max = mean."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time, rollout\n_rollout = rollout.rollout\n"
        "def slow(*a, **k):\n    time.sleep(1.0 if os.environ.get('RANK') == '1' else 0.0)\n    return _rollout(*a, **k)\n"
        "rollout.rollout = slow\n")
    flags = [*TINY, "--env", "frozenlake", "--algo", "grpo", "--steps", "1", "--val-every", "0", "--collapse-every", "0"]
    env = dict(PYTHONPATH=os.pathsep.join([str(tmp_path), HERE]))
    run_train(*flags, "--out", str(tmp_path / "one"), env=env)
    run_train(*flags, "--out", str(tmp_path / "two"), torchrun=2, env=env)
    a, b = read_metrics(str(tmp_path / "one"))[0], read_metrics(str(tmp_path / "two"))[0]
    assert a["timing_s/rollout_rank_max"] == a["timing_s/rollout_rank_mean"] > 0
    assert 0.4 < b["timing_s/rollout_rank_max"] - b["timing_s/rollout_rank_mean"] < 0.6, b
    assert b["timing_s/rollout"] >= b["timing_s/rollout_rank_max"]


def test_plot_reads_the_collapse_warnings_as_a_count_per_step(tmp_path):
    # metrics.jsonl logs each step's warnings as a list of sentences; the plot draws how many each step had
    lines = [{"step": 0, "rollout/in_group_std": 0.4, "warnings": []},
             {"step": 1, "rollout/in_group_std": 0.01, "warnings": ["in-group reward std fell", "entropy fell"]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert ev.read_metrics(str(tmp_path))["collapse/warnings"] == ([0, 1], [0, 2])
    assert any("collapse/warnings" in ps for _, ps in ev.PANELS)
    png = ev.plot_run(str(tmp_path), out=str(tmp_path / "c.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# two steps, no validation, no collapse diagnostics
R2 = [*TINY, "--collapse-every", "0", "--val-every", "0", "--steps", "2"]


@pytest.mark.slow
def test_empty_steps_are_skipped_then_stop(tmp_path):
    # the tiny model never answers well, so every group has std 0 and linear top_p keeps nothing
    out = str(tmp_path / "run")
    r = run_train(*R2, "--env", "bandit", "--algo", "grpo", "--filter-strategy", "top_p", "--filter-ratio", "0.9",
                  "--steps", "5", "--empty-stop-steps", "2", "--max-turns", "1", "--max-new-tokens", "4", "--out", out)
    ms = read_metrics(out)
    assert [m["step"] for m in ms] == [0, 1] and [m["rollout/consecutive_empty_steps"] for m in ms] == [1, 2]
    assert ms[1]["early_stopped/empty_filtered_steps"] == 1 and "actor/pg_loss" not in ms[0]
    assert "stopping early: 2 steps in a row had nothing to train" in r.stdout
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert ckpt["step"] == 1
    # an empty step measures no entropy: it must not enter the early level as 0 (that would hide a later fall)
    assert ckpt["monitor"]["early_entropy"] == [] and len(ckpt["monitor"]["early_std"]) == 2


@pytest.mark.slow
def test_early_stop_on_validation_success(tmp_path):
    out = str(tmp_path / "run")
    r = run_train(*R2, "--env", "bandit", "--early-stop", "--val-every", "1", "--steps", "8", "--max-turns", "1",
                  "--max-new-tokens", "4", "--out", out)
    ms = read_metrics(out)
    assert [m["step"] for m in ms] == [0, 1, 2, 3, 4] and ms[-1]["early_stopped/low_validation_success"] == 1
    assert "val-env/Bandit/success under 0.01 at 5 validations in a row" in r.stdout
    assert not any(m["step"] == 8 for m in ms)  # no final validation after a stop


@pytest.mark.slow
def test_paper_shape_step_at_reduced_depth(tmp_path):
    # bench.py --dry-run 24 runs one full StarPO-S step on the Qwen2.5-0.5B shape; here the same code path with
    # 2 of its 24 layers: hidden 896, 14 heads on 2 KV heads, vocab 151,936 tied, loaded from a hub-like directory
    import bench
    path = bench.save_qwen25_shape(str(tmp_path / "qwen-shape"), layers=2)
    out = str(tmp_path / "run")
    run_train("--model", path, "--env", "sokoban", "--algo", "ppo", "--num-groups", "2", "--group-size", "2",
              "--filter-ratio", "0.5", "--mini-batch-size", "2", "--micro-batch-size", "1", "--max-new-tokens", "8",
              "--max-turns", "2", "--val-every", "0", "--collapse-every", "0", "--steps", "1", "--sampler", "static",
              "--log-trajectories-every", "0", "--out", out)
    m = read_metrics(out)[0]
    assert m["train/SimpleSokoban/response_tokens"] > 0 and math.isfinite(m["actor/pg_loss"]) and m["critic/vf_loss"] > 0
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).config.vocab_size == 151936


# ------------------------------------------------------------------ 2 ranks equal 1 process (FSDP2 on gloo)
def assert_same_as_one_process(one, two):
    """The 2-rank tolerance: losses, grad norms and scores to 1e-3 relative, weights to 1e-4."""
    a, b = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for k in ("train/FrozenLake/score", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm",
                  "rollout/sampler_logp_abs_diff"):
            assert (k in x) == (k in y), k
            if k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), (x["step"], k)
    wa, wb = checkpoint.read_state(one)["actor"], checkpoint.read_state(two)["actor"]
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp32-ppo", "bf16-static-sampler", "3-row-groups"])
def test_two_ranks_match_one_process(tmp_path, case):
    """One run on 1 process and on 2 torchrun ranks (FSDP2 on gloo). bf16-static-sampler is the CUDA configuration
    on the CPU: bf16 compute (autocast + bf16 rollout copy), the static KV pool with validation chunked into it, FSDP2
    with MixedPrecisionPolicy(bf16 params, fp32 reduce); no trajectory files with --log-trajectories-every 0, not
    even from validation. Its tokens match because the CPU's bf16 GEMMs round alike at any batch shape; cuBLAS's
    need not, so on CUDA a token may differ between 1 and 2 ranks where two logits are within rounding.
    3-row-groups: a filter keeping a varying number of rows, the copy adjust on 2 ranks."""
    if case == "fp32-ppo":
        flags = [*TINY, "--env", "frozenlake", "--algo", "ppo", "--steps", "2", "--val-every", "0", "--lr", "1e-3", "--critic-lr", "1e-3",
                 "--ppo-epochs", "2"]  # epoch 2 reads the old log-probs that epoch 1's first mini-batch filled in on each rank
    elif case == "bf16-static-sampler":
        flags = [*TINY, "--env", "bandit", "--algo", "grpo", "--steps", "1", "--val-every", "1", "--val-groups", "6",
                 "--collapse-every", "0", "--max-new-tokens", "6", "--dtype", "bf16", "--sampler", "static",
                 "--log-trajectories-every", "0"]
    else:
        flags = [*R2, "--env", "frozenlake", "--algo", "reinforce_pp", "--num-groups", "4", "--group-size", "3",
                 "--filter-strategy", "min_p", "--filter-ratio", "0.9", "--filter-metric", "length", "--lr", "1e-3"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_train(*flags, "--out", one)
    run_train(*flags, "--out", two, torchrun=2)
    a, b = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    if case == "fp32-ppo":
        assert_same_as_one_process(one, two)
    elif case == "bf16-static-sampler":
        assert [m["step"] for m in a] == [0, 1]
        assert "val-env/BanditTest/score" in a[0] and not [f for f in os.listdir(one) if f.endswith(".jsonl") and f not in (
            "metrics.jsonl", "observations.jsonl")]  # the step logs only
        for k in ("train/Bandit/score", "val-env/Bandit/score", "val-env/BanditTest/score"):
            assert a[0][k] == pytest.approx(b[0][k], abs=1e-6), k   # bf16 on the CPU: same tokens on 1 and 2 ranks
        assert a[0]["actor/pg_loss"] == pytest.approx(b[0]["actor/pg_loss"], rel=0.05, abs=1e-3)  # bf16 compute
    else:
        assert [m["train/real_batch_size"] for m in a] == [m["train/real_batch_size"] for m in b]
        assert any(m["train/real_batch_size"] % 4 for m in a)  # 3-row groups: the copy adjust had work to do
        for x, y in zip(a, b):
            assert x["train/batch_size"] == y["train/batch_size"] and x["train/batch_size"] % 4 == 0
            for k in ("rollout/kept_fraction", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), k


# At the first fully_shard call of a process, the bytes of every allocated (not meta) parameter alive in it that
# FSDP2 has not sharded yet, found through the garbage collector: [rank, bytes] as one JSON line
SHARD_PROBE = ("import gc, json, os, torch, torch.distributed.fsdp as F\n_shard, _seen = F.fully_shard, []\n"
               "def fully_shard(module, **kw):\n"
               "    if not _seen:\n"
               "        _seen.append(1)\n"
               "        ps = [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]\n"
               "        b = sum(p.numel() * p.element_size() for p in ps if not p.is_meta and not hasattr(p, 'to_local'))\n"
               "        with open(os.environ['SHARD_PROBE'], 'a') as f:\n"
               "            f.write(json.dumps([os.environ.get('RANK'), b]) + '\\n')\n"
               "    return _shard(module, **kw)\n"
               "F.fully_shard = fully_shard\n")


@pytest.mark.slow
def test_models_are_sharded_before_they_are_allocated(tmp_path):
    # actor, critic trunk, reference and rollout copy are built on the meta device and sharded before any weight is
    # allocated: when sharding starts, no rank holds as much as one bf16 copy of the model in parameters (rank 0's
    # fp32 source state dict is host memory on a GPU machine); the rollout copy then fills in bf16 with one
    # all-gather per block (sync bytes = the bf16 model, tied embedding once)
    (tmp_path / "sitecustomize.py").write_text(SHARD_PROBE)
    probe, out = str(tmp_path / "probe.jsonl"), str(tmp_path / "run")
    run_train(*TINY, "--env", "frozenlake", "--algo", "ppo", "--kl-coef", "0.1", "--dtype", "bf16", "--steps", "1",
              "--val-every", "0", "--collapse-every", "0", "--out", out, torchrun=2,
              env=dict(PYTHONPATH=str(tmp_path), SHARD_PROBE=probe))
    calls = [json.loads(l) for l in open(probe)]
    n = sum(p.numel() for p in models.build_tiny("llama")[0].parameters())
    assert sorted(r for r, _ in calls) == ["0", "1"] and max(b for _, b in calls) < 2 * n, (calls, n)
    assert read_metrics(out)[0]["perf/sync_gathered_mb"] == pytest.approx(2 * n / 2**20)


# After every backward of a process, the bytes of unsharded gradients FSDP2 holds (an FSDPParam's unsharded grad, or
# its fp32 accumulation when the reduce dtype differs): [rank, bytes] as one JSON line per backward
GRAD_PROBE = ("import gc, json, os, torch\n_backward = torch.Tensor.backward\n"
              "def backward(self, *a, **k):\n"
              "    _backward(self, *a, **k)\n"
              "    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam\n"
              "    held = 0\n"
              "    for p in (o for o in gc.get_objects() if isinstance(o, FSDPParam)):\n"
              "        for g in (getattr(getattr(p, '_unsharded_param', None), 'grad', None), p.unsharded_accumulated_grad):\n"
              "            held += 0 if g is None else g.numel() * g.element_size()\n"
              "    with open(os.environ['GRAD_PROBE'], 'a') as f:\n"
              "        f.write(json.dumps([os.environ.get('RANK'), held]) + '\\n')\n"
              "torch.Tensor.backward = backward\n")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradients_are_reduce_scattered_every_micro_batch(tmp_path, dtype):
    """Several micro-batches per rank (mini-batch 4 on 2 ranks, micro 1: two backwards per optimizer step, actor and
    critic): after every backward no rank holds an unsharded gradient (each micro-batch's gradients are reduce-scattered
    into the rank's shard at once, so a rank's gradient memory is its 1/W shard, not the whole model in fp32); in fp32
    the weights equal the 1-process run's within the 2-rank tolerance."""
    (tmp_path / "sitecustomize.py").write_text(GRAD_PROBE)
    probe, one, two = str(tmp_path / "probe.jsonl"), str(tmp_path / "one"), str(tmp_path / "two")
    flags = [*TINY, "--env", "frozenlake", "--algo", "ppo", "--steps", "2", "--val-every", "0", "--collapse-every", "0",
             "--lr", "1e-3", "--critic-lr", "1e-3", "--micro-batch-size", "1", "--dtype", dtype]
    run_train(*flags, "--out", two, torchrun=2, env=dict(PYTHONPATH=str(tmp_path), GRAD_PROBE=probe))
    calls = [json.loads(l) for l in open(probe)]
    assert len(calls) == 2 * 2 * 2 * 2 and sorted({r for r, _ in calls}) == ["0", "1"], calls  # steps x models x micro x ranks
    assert max(b for _, b in calls) == 0, calls
    if dtype == "fp32":
        run_train(*flags, "--out", one)
        assert_same_as_one_process(one, two)


# ------------------------------------------------------------------ LoRA
LORA = [*TINY, "--env", "sokoban", "--algo", "ppo", "--lora-rank", "4", "--kl-coef", "0.01", "--lr", "1e-2",
        "--critic-lr", "1e-2", "--val-every", "0"]


@pytest.mark.slow
def test_lora_errors_name_their_cause(tmp_path):
    # an install whose peft is older than transformers' LoRA integration needs: the real cause, in one line
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as md\n_v = md.version\n"
        "md.version = lambda name: '0.1.0' if name == 'peft' else _v(name)\n")
    env = dict(train_env(), PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *LORA, "--steps", "1", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=HERE, env=env, timeout=600)
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in said, said[-2000:]
    assert "peft 0.1.0" in said and "transformers 5." in said and "--lora-target" not in said, said
    r = run_train(*LORA, "--lora-target", "no_such_proj", "--steps", "1", "--out", str(tmp_path / "t"), check=False)
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "--lora-target 'no_such_proj'" in said and "Traceback" not in said, said[-2000:]


@pytest.mark.slow
def test_lora_run_resume_two_ranks_and_export(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    full, part, two = str(tmp_path / "full"), str(tmp_path / "part"), str(tmp_path / "two")
    flags = [*LORA, "--save-every", "1", "--save-adapter"]
    run_train(*flags, "--steps", "2", "--out", full)
    run_train(*flags, "--steps", "1", "--out", part)
    run_train(*flags[:-1], "--steps", "2", "--resume", part)  # an output-only flag may change on a resume
    run_train(*flags, "--steps", "2", "--out", two, torchrun=2)
    a, b, c = read_metrics(full), read_metrics(part), read_metrics(two)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [m["step"] for m in c] == [0, 1]
    for x, y, z in zip(a, b, c):
        x, y = comparable(x), comparable(y)
        assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6) for k in x), x
        for k in ("train/SimpleSokoban/score", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/grad_norm"):
            assert x[k] == pytest.approx(z[k], rel=1e-3, abs=1e-5), k
    # the rollout copy samples with the merged adapter (sampler log-probs == the peft actor's, on 1 and 2 ranks)
    # while the policy moved away from the reference (the base: the actor with its adapter off)
    assert all(m["rollout/sampler_logp_abs_diff"] < 1e-5 for m in a + c) and abs(a[1]["actor/kl_loss"]) > 1e-4
    ck = [checkpoint.read_state(d) for d in (full, part, two)]
    assert os.path.isdir(os.path.join(full, "hf", "adapter")) and not os.path.exists(os.path.join(part, "hf", "adapter"))
    assert all(".lora_" in k for k in ck[0]["actor"])  # the checkpoint holds adapters (+ the critic head), no base
    assert {k for k in ck[0]["critic"] if ".lora_" not in k} == {"head.weight", "head.bias"}
    for other, tol in ((ck[1], 1e-6), (ck[2], 1e-4)):
        assert ck[0]["actor"].keys() == other["actor"].keys()
        assert max((ck[0]["actor"][k] - other["actor"][k]).abs().max().item() for k in ck[0]["actor"]) < tol
    # the export: merged weights that from_pretrained loads, equal to base + adapter through peft's own forward
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(full, "hf"))
    adapted = PeftModel.from_pretrained(models.build_tiny("llama")[0], os.path.join(full, "hf", "adapter"))
    x = torch.tensor([[5, 80, 81, 82, 83, 9]])
    with torch.no_grad():
        lm, la, lb = merged(x).logits, adapted(x).logits, models.build_tiny("llama")[0](x).logits
    assert torch.allclose(lm, la, atol=1e-5) and (lm - lb).abs().max() > 1e-3


@pytest.mark.slow
def test_lora_sync_gathers_only_the_adapters(tmp_path):
    out = str(tmp_path / "two")
    run_train(*LORA, "--steps", "2", "--out", out, torchrun=2)
    adapters = checkpoint.read_state(out)["actor"]  # the actor's trainables: adapters
    want = sum(v.numel() * 4 for v in adapters.values()) / 2**20
    assert [m["perf/sync_gathered_mb"] for m in read_metrics(out) if "perf/sync_gathered_mb" in m] == pytest.approx([want] * 2)


# ------------------------------------------------------------------ flags, errors, --demo, progress and --help
@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--env", "chess"], "unknown env or preset 'chess'"),
    (["--filter-ratio", "0.25", "--mini-batch-size", "4"], "not a positive multiple of --mini-batch-size"),
    (["--model", "/nonexistent/model-dir"], "cannot load --model"),
    (["--resume", "/nonexistent/run"], "no ckpt.pt there"),
    (["--env", "SimpleSokoban:2", "FrozenLake"], "give each a positive group count"),
    (["--context-window-mode", "single_turn", "--turn-rewards"], "--turn-rewards and --bi-level-gae need whole episodes"),
    (["--plan", "-2"], "--plan -2: the number of ranks"),
    (["--lora-rank", "4", "--lora-target", "q_proj,lm_head"], "--lora-target lm_head: the log-prob passes"),
    (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1"),
    (["--lr-warmup-steps", "-1"], "--lr-warmup-steps must be >= 0"),
])
def test_bad_flags_give_one_line_errors(flags, message):
    r = run_train(*TINY, "--steps", "1", *flags, check=False)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.slow
def test_validation_chunks_fit_the_static_pool_of_one_presets_training_call(tmp_path, monkeypatch):
    # run_rollout calls the sampler once per preset: with --env A:2 B:2 a training call has 2 groups' rows, and
    # validation runs in chunks of that size, so the static pool it shares has no rows that training decodes idle
    import train
    monkeypatch.setattr(sampler, "_POOL", {})
    train.main([*TINY, "--env", "SimpleSokoban:2", "FrozenLake:2", "--algo", "grpo", "--val-groups", "8", "--val-every", "1",
                "--steps", "1", "--sampler", "static", "--out", str(tmp_path / "run")])
    assert sampler._POOL["kv"][0][0].shape[0] == 2 * 2  # groups of one preset x --group-size


def test_demo_presets_chain_sft_into_train_and_flags_override_them(tmp_path, capsys):
    warm = str(tmp_path / "demo-sft")
    code, out, err = sft_main(capsys, "--demo", "--model", "tiny", "--episodes", "8", "--out", warm)
    assert code == 2 and "over max_new_tokens 8" in err  # the byte-level tiny model spells an answer in 12 tokens
    code, out, err = sft_main(capsys, "--demo", "--model", "tiny", "--episodes", "8", "--max-new-tokens", "12", "--out", warm)
    assert code == 0, err
    meta = json.load(open(os.path.join(warm, "sft.json")))
    assert (meta["env"], meta["policy"], meta["no_think"], meta["heldout"]) == (["CueAM"], "random", True, 0)  # the preset
    assert (meta["model"], meta["episodes"]) == ("tiny", 8)  # given flags win
    import train
    assert sft.DEMO.endswith(" --out runs/demo-sft") and train.DEMO.startswith("--model runs/demo-sft ")  # one chain
    # the settings the demo's robustness was measured with (every seed of results/studies/demo-cue-robust.md)
    assert sft.DEMO == ("--model smollm2 --env CueAM --policy random --no-think --max-new-tokens 8 --episodes 64 "
                        "--batch-size 8 --heldout 0 --out runs/demo-sft")
    assert " --lr 3e-5 " in train.DEMO and " --steps 8 --val-every 8 --val-groups 128 " in train.DEMO
    assert " --num-groups 8 --group-size 8 --filter-ratio 0.5 --mini-batch-size 32 " in train.DEMO
    out = str(tmp_path / "demo")
    r = run_train("--lr", "1e-3", "--demo", "--model", warm, "--max-new-tokens", "12", "--max-context", "512", "--steps", "2",
                  "--val-every", "2", "--val-groups", "4", "--out", out)  # the byte-level tokenizer: longer prompts
    args = json.load(open(os.path.join(out, "args.json")))
    assert (args["env"], args["val_env"], args["algo"], args["no_think"]) == ("CueAM", ["CueAM", "CueNZ"], "grpo", True)  # the preset
    assert (args["model"], args["lr"], args["steps"], args["val_groups"]) == (warm, 1e-3, 2, 4)  # given flags win, before or after --demo
    demo_line = next(l for l in r.stdout.splitlines() if l.startswith("--demo = python train.py --model runs/demo-sft "))
    assert demo_line.endswith(f" --lr 1e-3 --model {warm} --max-new-tokens 12 --max-context 512 --steps 2 --val-every 2 "
                              f"--val-groups 4 --out {out}")
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]
    assert "held-out validation, 4 seeds per preset, step 0 -> 2:\n  CueAM: success " in r.stdout and "\n  CueNZ: success " in r.stdout
    assert os.path.exists(os.path.join(out, "curves.png")) and f"curves: {os.path.join(out, 'curves.png')}" in r.stdout
    # without the warm-up, train.py --demo says what to run first
    r = run_train("--demo", "--model", str(tmp_path / "no-warm-up"), check=False)
    assert r.returncode == 2 and "run python sft.py --demo first" in r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_progress_names_each_phase_and_the_end_says_what_next(tmp_path):
    out = str(tmp_path / "run")
    r = run_train(*TINY, "--env", "sokoban", "--algo", "ppo", "--ppo-epochs", "2", "--steps", "1", "--val-every", "1",
                  "--out", out)
    for line in ["step 0: validation SimpleSokoban turn 2/2", "step 0: rollout SimpleSokoban turn 1/2",
                 "step 0: rollout SimpleSokoban turn 2/2", "step 0: collapse diagnostics", "step 0: old log-probs",
                 "step 0: reference log-probs and values", "step 0: update mini-batch 1/2", "step 0: update mini-batch 2/2",
                 "step 0: checkpoint"]:
        assert line in r.stderr, line  # tqdm writes to stderr
    assert r.stdout.index("loading --model tiny") < r.stdout.index("final validation: ['SimpleSokoban'], 2 seeds each")
    for line in ["held-out validation, 2 seeds per preset, step 0 -> 1:", f"run directory {out}:",
                 f"curves: python eval.py --plot {out}", f"--resume {out}", f"next: python eval.py --model {out}"]:
        assert line in r.stdout, line
    assert not os.path.exists(os.path.join(out, "curves.png"))  # drawn by --demo only


def wandb_records(path):
    """The protobuf records of a wandb run file (<dir>/wandb/offline-run-*/run-<id>.wandb): a 7-byte header, then
    LevelDB's log format: 32 KiB blocks of chunks (crc32, length, type: 1 a whole record, 2 its first part, 3 a middle
    part, 4 its last part), a block's last bytes padding when fewer than a chunk header's 7 are left."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data, pos, part = open(path, "rb").read(), 7, b""
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            yield record
            part = b""


@pytest.mark.slow
def test_wandb_logs_each_metrics_line_and_the_args_offline_and_a_resume_continues_its_run(tmp_path):
    pytest.importorskip("wandb")
    out = str(tmp_path / "run")
    flags = [*TINY, "--env", "bandit", "--algo", "grpo", "--val-every", "0", "--collapse-every", "0", "--wandb", "test-project"]
    run_train(*flags, "--steps", "1", "--out", out)  # WANDB_MODE unset: offline
    run_train(*flags, "--steps", "2", "--resume", out)
    launches = sorted(d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-"))
    assert len(launches) == 2
    rows, runs, config = [], [], {}
    for d in launches:
        files = [f for f in os.listdir(os.path.join(out, "wandb", d)) if f.endswith(".wandb")]
        for r in wandb_records(os.path.join(out, "wandb", d, *files)):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                runs.append((r.run.run_id, r.run.project, r.run.display_name))
            if kind in ("run", "config"):
                updates = r.run.config.update if kind == "run" else r.config.update
                config.update({u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"})
            if kind == "history":  # wandb's own keys (_step, _runtime, _timestamp) start with _
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    # both launches log to one run, its id kept in the run directory; the rows are metrics.jsonl's lines
    run_id = open(os.path.join(out, "wandb_run_id")).read()
    assert runs == [(run_id, "test-project", "run")] * 2
    assert rows == read_metrics(out)  # as numbers: wandb writes a whole float as an integer (1.0 as 1)
    assert [m["step"] for m in rows] == [0, 1]
    # the config: the args (args.json without the versions it adds), the resumed launch's last
    args = json.load(open(os.path.join(out, "args.json")))
    for k in ("git_commit", "world_size", "torch", "transformers", "python", "cuda"):
        del args[k]
    assert config == args and args["wandb"] == "test-project" and args["steps"] == 2


@pytest.mark.slow
def test_help_is_grouped_and_shows_defaults():
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--help"], capture_output=True, text=True,
                       cwd=HERE, env=dict(os.environ, COLUMNS="200"), timeout=120)
    assert r.returncode == 0, r.stderr
    titles = [l[:-1] for l in r.stdout.splitlines() if l.endswith(":") and not l.startswith(" ")]
    assert titles[-10:] == ["common flags", "environment and agent loop", "model", "batch sizes", "algorithm", "optimisation",
                            "validation", "run", "RAGEN-2 and variants: context windows, filters, turn-level rewards, stops",
                            "debugging and testing: reference paths that sample the same tokens, slower"]
    for text in ["--filter-ratio FILTER_RATIO", "(default: 0.25)", "(default: 1e-06)", "--demo", "(default: ['sokoban'])"]:
        assert text in r.stdout, text


# ------------------------------------------------------------------ train.py's parts in process, one env registry (agent.py)
def test_importing_train_runs_nothing():
    code = "import sys, train; assert 'wandb' not in sys.modules"  # --wandb imports it, only when given
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                       env=dict(train_env(), RANK="0", WORLD_SIZE="2"), timeout=120)  # a torchrun rank: no process group either
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr
    code = "import sys, agent; bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"  # the registry is torch-free
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE)


def test_actor_update_on_a_toy_batch_moves_each_row_the_way_of_its_advantage():
    import train
    model, tok = models.load_model("tiny")
    args, world, _ = train.parse_args(["--model", "tiny", "--lr", "1e-2", "--entropy-coef", "0"])
    assert world == 1 and args.env == "SimpleSokoban" and args.max_turns == 5  # the preset's defaults filled in
    st = train.State(device=torch.device("cpu"), actor=model, tok=tok, rollout_model=model,
                     opt=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))
    tokens = torch.randint(3, 250, (4, 10), generator=torch.Generator().manual_seed(0))  # [K, T]
    attention_mask = torch.ones(4, 10, dtype=torch.bool)                                   # [K, T] rows 2, 3 padded
    attention_mask[2:, 8:] = False
    mask = torch.zeros(4, 10)                                                              # [K, T] the "sampled" tokens
    mask[:, 5:8] = 1
    batch = dict(tokens=tokens, attention_mask=attention_mask, mask=mask, loss_mask=mask.bool())
    adv = torch.tensor([2.0, -1.0, 1.0, -2.0])[:, None] * mask                            # [K, T]
    before = train.forward_pass(st, args, model, batch, "logp")                            # [K, T]
    counts = dict(token_count=mask.sum().item(), seq_count=4)
    part, acc = train.actor_update(st, args, [[0, 1], [2, 3]], batch, adv, before.clone(), None, counts)
    # on-policy (old log-probs = the current ones): ratio 1, the loss is minus the token mean of the advantages
    assert part["actor/pg_loss"] == pytest.approx(-(adv.sum() / mask.sum()).item(), abs=1e-6)
    assert len(acc["actor/clipfrac"]) == 2 and math.isfinite(acc["actor/grad_norm"][0])
    moved = ((train.forward_pass(st, args, model, batch, "logp") - before) * mask).sum(1)  # [K]
    assert (moved[[0, 2]] > 0).all() and (moved[[1, 3]] < 0).all(), moved


def test_critic_warmup_trains_only_the_critic_for_its_steps(tmp_path, capsys):
    # --critic-warmup 2 (veRL trainer.critic_warmup = 3): steps 0 and 1 step the critic alone, so the actor's weights
    # are still the start's after them; step 2 steps both
    import train
    base = ["--device", "cpu", "--model", "tiny", *TINY[4:], "--env", "frozenlake", "--algo", "ppo", "--lr", "1e-3",
            "--collapse-every", "0", "--val-every", "0", "--critic-warmup", "2"]
    train.main([*base, "--steps", "2", "--out", str(tmp_path / "warm")])
    ms = read_metrics(str(tmp_path / "warm"))
    assert all("critic/vf_loss" in m and "actor/pg_loss" not in m for m in ms), ms
    start, _ = models.load_model("tiny")
    after, _ = models.load_model(str(tmp_path / "warm" / "hf"))
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), after.state_dict().values()))
    train.main([*base, "--steps", "3", "--out", str(tmp_path / "on")])
    ms = read_metrics(str(tmp_path / "on"))
    assert ["actor/pg_loss" in m for m in ms] == [False, False, True]
    with pytest.raises(SystemExit):
        train.main([*base, "--algo", "grpo", "--steps", "1", "--out", str(tmp_path / "no")])
    assert "--critic-warmup needs a critic" in capsys.readouterr().out

def test_agent_flags_are_declared_once_for_train_eval_and_sft(tmp_path):
    import train
    flags = {"--max-turns", "--max-actions-per-turn", "--max-actions-per-traj", "--max-new-tokens", "--max-context",
             "--no-think", "--format-penalty", "--context-window-mode", "--max-context-window", "--no-stop-at-answer"}
    sampling = {"--temperature", "--top-p", "--no-kv-reuse", "--no-prefix-sharing"}
    for parser, want in ((train.build_parser(), flags | sampling), (ev.build_parser(), flags | sampling),
                         (sft.build_parser(), flags)):
        have = {o for a in parser._actions for o in a.option_strings}
        assert want <= have and not (sampling - want) & have
    settings = lambda argv: agent.agent_settings("Bandit", vars(train.parse_args(argv)[0]), sample_seed=0)
    assert settings([]).stop_at_answer and not settings(["--no-stop-at-answer"]).stop_at_answer
    assert settings(["--env", "bandit"]).max_turns == 1 and settings(["--max-turns", "3"]).max_turns == 3
    # eval.py takes the flag from a run directory's args.json, as the run's other agent flags
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    (run / "args.json").write_text(json.dumps(dict(vars(train.parse_args(["--no-stop-at-answer", "--env", "bandit"])[0]))))
    args = ev.build_parser().parse_args(["--model", str(run)])
    assert ev.resolve(args)[1] == ["Bandit", "BanditTest"] and args.no_stop_at_answer is True and args.temperature == 0.5



def test_agent_defaults_are_declared_once_and_merged_in_one_place(monkeypatch):
    # agent.AGENT_DEFAULTS holds the number behind --max-context; the help text, train.py's resolved args (args.json)
    # and agent_settings (what rollout() plays with) all follow a change to it. A preset's own value (WebShop's) wins
    # over it and a flag over both; rollout() takes the settings as one object and imports no agent.py
    import train
    monkeypatch.setitem(agent.AGENT_DEFAULTS, "max_context", 1234)
    assert "default 1234, or the preset's, e.g. WebShop 15000" in " ".join(train.build_parser().format_help().split())
    assert train.parse_args([])[0].max_context == 1234 and train.parse_args(["--env", "webshop"])[0].max_context == 15000
    assert train.parse_args(["--env", "webshop", "--max-context", "99"])[0].max_context == 99
    assert agent.agent_settings("SimpleSokoban", {}, sample_seed=0).max_context == 1234
    assert agent.agent_settings("WebShop", {}, sample_seed=0).max_context == 15000
    assert agent.agent_settings("WebShop", dict(max_context=99), sample_seed=0).max_context == 99
    assert list(inspect.signature(rollout.rollout).parameters)[:5] == ["model", "tok", "envs", "seeds", "settings"]
    code = "import sys, rollout; assert 'agent' not in sys.modules and not any(m.startswith('env_') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE)

TOY_ENV = '''"""Toy: say the digit shown, in one turn."""
PRESETS = {"Toy": dict(kwargs=dict(n=3), instruction="Say the digit you see.\\n", max_actions_per_traj=1, max_tokens=20,
                       max_turns=1, max_actions_per_turn=1)}


class ToyEnv:
    def __init__(self, n=3):
        self.n = n

    def reset(self, seed):
        self.digit, self.done = str(seed % self.n), False
        return self.render()

    def render(self):
        return f"digit {self.digit}"

    def actions(self):
        return [str(i) for i in range(self.n)]

    def step(self, action):
        if self.done or not isinstance(action, str) or action.strip() not in self.actions():
            return self.render(), 0.0, self.done, dict(action_is_valid=False, action_is_effective=False, success=False)
        self.done, success = True, action.strip() == self.digit
        return "done", float(success), True, dict(action_is_valid=True, action_is_effective=True, success=success)


def solver_actions(env, k):
    return [env.digit]


def random_actions(env, k, rng):
    return [rng.choice(env.actions()) for _ in range(k)]
'''


def test_a_new_env_is_one_file_and_one_registry_line(tmp_path, monkeypatch, capsys):
    # a throwaway env file, registered in process, then demonstrated (sft.py), trained on (train.py) and evaluated
    # (eval.py) through their main functions: nothing else names it
    import importlib
    import train
    (tmp_path / "env_toy.py").write_text(TOY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(agent, "ENV_CLASSES", dict(agent.ENV_CLASSES))
    monkeypatch.setattr(agent, "SHORT_NAMES", dict(agent.SHORT_NAMES))
    toy = importlib.import_module("env_toy")
    agent.register(toy.ToyEnv, toy, "toy", "Toy")  # the registry line
    assert agent.preset_name("toy") == "Toy"
    sft.main(["--device", "cpu", "--model", "tiny", "--env", "toy", "--episodes", "6", "--steps", "1",
              "--out", str(tmp_path / "sft")])
    said = capsys.readouterr().out
    assert "Toy: 6 solver demonstrations" in said and "success 6/6" in said
    train.main([*TINY[:4], "--model", str(tmp_path / "sft"), *TINY[6:], "--env", "toy", "--algo", "grpo",
                "--steps", "1", "--collapse-every", "0", "--out", str(tmp_path / "run")])
    ms = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in ms] == [0, 1] and "train/Toy/success" in ms[0] and "val-env/Toy/success" in ms[1]
    capsys.readouterr()
    ev.main(["--device", "cpu", "--model", str(tmp_path / "run"), "--num-seeds", "3", "--out", str(tmp_path / "ev")])
    assert "| Toy | 3 |" in capsys.readouterr().out


def test_a_full_disk_during_torch_save_is_a_one_line_error_and_the_last_checkpoint_stays(tmp_path, monkeypatch, capsys):
    # torch.save's zip writer reports a write that fails (a full disk) as a RuntimeError, not an OSError; train.py and
    # sft.py say so in one line, and the checkpoint written before stays whole and resumes. train.py's step-1 checkpoint
    # fails once in ckpt.pt.tmp (the commit) and once inside its sharded state directory (torch.distributed.checkpoint
    # also writes through torch.save)
    import train
    real, commits = torch.save, []

    def full(when):
        def save(obj, f, *a, **k):
            name = str(getattr(f, "name", f))
            commits.append(name) if name.endswith("ckpt.pt.tmp") else None
            if when(name):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
            return real(obj, f, *a, **k)
        return save
    flags = ["--device", "cpu", "--model", "tiny", *TINY[4:], "--env", "bandit", "--algo", "grpo", "--steps", "2",
             "--save-every", "1", "--val-every", "0", "--collapse-every", "0"]
    for where, when in (("the commit", lambda name: name.endswith("ckpt.pt.tmp") and len(commits) == 2),
                        ("the shards", lambda name: not name.endswith("ckpt.pt.tmp") and len(commits) == 1)):
        commits.clear()
        monkeypatch.setattr(torch, "save", full(when))
        out = str(tmp_path / where.replace(" ", "-"))
        with pytest.raises(SystemExit) as e:
            train.main([*flags, "--out", out])
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert e.value.code == 2 and last.startswith("train.py: checkpoint of step 1 failed") and "unexpected pos" in last, (where, last)
        assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 0, where  # step 0's, whole
        monkeypatch.setattr(torch, "save", real)
        train.main([*flags, "--resume", out])  # and it resumes
        assert checkpoint.read_state(out)["step"] == 1
    commits.clear()
    monkeypatch.setattr(torch, "save", full(lambda name: name.endswith("ckpt.pt.tmp") and len(commits) == 2))
    code, _, err = sft_main(capsys, "--model", "tiny", "--env", "bandit", "--episodes", "8", "--batch-size", "4",
                            "--heldout", "0", "--save-every", "1", "--out", str(tmp_path / "sft"))
    assert code == 2 and err.strip().splitlines()[-1].startswith("sft.py: checkpoint of step 2 failed, "), err
    assert torch.load(os.path.join(tmp_path, "sft", "ckpt.pt"), weights_only=False)["step"] == 1


def test_a_new_advantage_estimator_is_a_starpo_kind_and_a_name(tmp_path, monkeypatch):
    # docs/reference.md "Add an advantage estimator", a group one: a constant-baseline REINFORCE (advantage = score
    # - 0.5 on every sampled token) as a kind of starpo.group_advantages and a name in train.ALGOS, patched in process;
    # two train.py steps on the tiny model, and a spy on the actor update sees exactly its advantages
    import train
    group_advantages, actor_update, seen = starpo.group_advantages, train.actor_update, []

    def with_toy(scores, group, kind="grpo", eps=1e-6):  # [N] -> [N]
        return scores.float() - 0.5 if kind == "toy" else group_advantages(scores, group, kind, eps)

    def spy(st, args, mine, batch, adv, *a, **k):
        seen.append((batch, adv.clone(), st.critic))
        return actor_update(st, args, mine, batch, adv, *a, **k)
    monkeypatch.setattr(starpo, "group_advantages", with_toy)
    monkeypatch.setattr(train, "ALGOS", train.ALGOS + ("toy",))
    monkeypatch.setattr(train, "actor_update", spy)
    train.main(["--device", "cpu", "--model", "tiny", *TINY[4:], "--env", "bandit", "--algo", "toy", "--steps", "2",
                "--val-every", "0", "--collapse-every", "0", "--out", str(tmp_path / "run")])
    assert [m["step"] for m in read_metrics(str(tmp_path / "run"))] == [0, 1] and len(seen) == 2
    for batch, adv, critic in seen:  # the row's score sits on its last sampled token (--reward-norm identity)
        want = (batch["rewards"].sum(1, keepdim=True) - 0.5) * batch["mask"]  # [K, T]
        assert critic is None and batch["mask"].any() and torch.allclose(adv, want)
    # a group-relative estimator would give a group of equal scores 0; the toy one does not
    assert any((adv != 0).any() for _, adv, _ in seen)


def test_a_max_context_that_holds_no_turn_is_refused(tiny, tmp_path, capsys, monkeypatch):
    # rollout.context_needed is the edge: in that many tokens the first turn is played, in one less the episode ends
    # before it. train.py refuses a --max-context under it for a preset of --env or of --val-env, in one line, from
    # the tokenizer alone: before any weight loads and before anything is written
    import train
    monkeypatch.setattr(train, "build_models", lambda *a, **k: pytest.fail("weights loaded before the check"))
    model, tok = tiny
    need = {}
    for key in ("Bandit", "SimpleSokoban"):
        s = agent.agent_settings(key, dict(max_new_tokens=12, max_turns=1, sample_seed=0))
        cls = agent.ENV_CLASSES[key][0]
        need[key] = rollout.context_needed(tok, cls(**s.preset["kwargs"]), 10000, s)
        for context, turns in ((need[key], 1), (need[key] - 1, 0)):
            out = rollout.rollout(model, tok, [cls(**s.preset["kwargs"])], [10000],
                                  dataclasses.replace(s, max_context=context), group_size=1, sampler=sampler.Sampler())
            assert out["stats"]["num_turns"].tolist() == [turns], (key, context)
    assert need["Bandit"] < need["SimpleSokoban"]
    base = ["--device", "cpu", "--model", "tiny", *TINY[4:], "--env", "bandit", "--out", str(tmp_path / "run")]
    for flags, key in ((["--max-context", "10"], "Bandit"),
                       (["--max-context", str(need["Bandit"]), "--val-env", "SimpleSokoban"], "SimpleSokoban")):
        with pytest.raises(SystemExit) as e:
            train.main(base + flags)
        said = capsys.readouterr().out.strip().splitlines()[-1]
        assert e.value.code == 2 and said.startswith(f"train.py: --max-context {flags[1]} holds no turn of {key}"), said
    assert not os.path.exists(tmp_path / "run")


def test_a_rate_over_no_turn_is_not_available(tmp_path, capsys):
    # no turn played: format-valid turns is n/a in train.py's summary, None (JSON null) and n/a in eval.py's table,
    # NaN (a gap) in the plotted curve, never the 1.000 of 1 - 0 / 0 errors
    import argparse
    import checkpoint
    lines = [{"step": s, "val-env/Fl/success": 0.0, "val-env/Fl/score": -0.1, "val-env/Fl/num_turns": turns,
              "val-env/Fl/format_errors": errors} for s, turns, errors in ((0, 0.0, 0.0), (2, 2.0, 0.5))]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    checkpoint.print_summary(argparse.Namespace(out=str(tmp_path), val_env=["Fl"], val_groups=2, demo=False,
                                                log_trajectories_every=0))
    assert "format-valid turns n/a -> 0.750" in capsys.readouterr().out
    stats = dict(num_turns=0, valid_actions=0, invalid_actions=0, format_errors=0, response_tokens=0, think_tokens=0)
    row = ev.summarize([dict(seed=123, success=False, score=-0.1, stats=stats)], samples=1)
    assert json.loads(json.dumps(row))["format_ok_rate"] is None and row["valid_action_rate"] is None
    ev.print_table({"Fl": row})
    assert "| Fl | 1 | 0.000 | 0.000 | -0.100 | n/a | n/a | 0.000 |" in capsys.readouterr().out  # pass@1, score, rates
    steps, rates = ev.read_metrics(str(tmp_path))["val-env/Fl/format_ok_rate"]
    assert steps == [0, 2] and math.isnan(rates[0]) and rates[1] == 0.75


WARMUP = [*TINY, "--env", "Bandit", "--algo", "ppo", "--critic-warmup", "2", "--lr", "1e-3", "--val-every", "0",
          "--collapse-every", "0", "--log-trajectories-every", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [0, 2])
def test_a_checkpoint_in_the_critic_warmup_changes_nothing(tmp_path, ranks):
    """A save while the actor's AdamW has never stepped (PPO's critic warm-up) leaves it never stepped, in the file
    and in the live optimiser: the same run with and without checkpoints ends with the same weights, bit for bit, and
    a resume from a warm-up checkpoint equals the uninterrupted run. (torch's get_optimizer_state_dict creates a
    missing state by a step at lr 0: AdamW at step 1 with zero moments, and the first real update would take step
    2's bias correction.)"""
    saved, plain, resumed = (str(tmp_path / n) for n in ("saved", "plain", "resumed"))
    run_train(*WARMUP, "--steps", "3", "--save-every", "1", "--out", saved, torchrun=ranks)
    run_train(*WARMUP, "--steps", "3", "--out", plain, torchrun=ranks)
    run_train(*WARMUP, "--steps", "2", "--save-every", "1", "--out", resumed, torchrun=ranks)  # both steps in the warm-up
    warm = checkpoint.read_state(resumed)
    assert warm["step"] == 1 and not (warm["actor_opt"] or {}).get("state"), "a never-stepped AdamW saved with state"
    run_train(*WARMUP, "--steps", "3", "--resume", resumed, torchrun=ranks)
    w = {d: checkpoint.read_state(d) for d in (saved, plain, resumed)}
    for d in (saved, resumed):
        assert all(torch.equal(w[d]["actor"][k], w[plain]["actor"][k]) for k in w[plain]["actor"]), d
        assert all(torch.equal(w[d]["critic"][k], w[plain]["critic"][k]) for k in w[plain]["critic"]), d
        steps = {float(s["step"]) for s in w[d]["actor_opt"]["state"].values()}
        assert steps == {1.0}, (d, steps)  # one real actor update (the third step), none before it


def test_a_checkpoint_takes_what_it_saves(tmp_path):
    # save_checkpoint and load_checkpoint take the models, optimisers, tokenizer and rank themselves (no train.State):
    # fresh copies get the weights and AdamW state back, hf/ loads as the actor
    import checkpoint
    import train
    args = train.parse_args(["--model", "tiny", "--algo", "grpo", "--out", str(tmp_path)])[0]
    model, tok = models.load_model("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    checkpoint.save_checkpoint(args, 3, {"skipped": 1}, model, opt, None, None, model, tok, None, 0)
    fresh = models.load_model("tiny")[0]
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert checkpoint.load_checkpoint(args, ckpt, fresh, fresh_opt, None, None) == (4, {"skipped": 1})
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    assert all(torch.equal(fresh_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"])
               for p, q in zip(model.parameters(), fresh.parameters()))
    hf = models.load_model(str(tmp_path / "hf"))[0].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in hf.items())
    # the resume check: a changed flag is named, one the flags may change is not, one the run never saved (a newer
    # or derived key, e.g. args.critic for a run saved before it existed) is not compared
    saved = {k: v for k, v in vars(args).items() if k != "critic"}
    args.lr, args.steps, args.critic = 1e-3, 7, "anything"
    assert checkpoint.changed_flags(saved, args, checkpoint.RESUME_MAY_CHANGE) == ["--lr was 1e-06, now 0.001"]


# ------------------------------------------------------------------ memory plan (memplan.py, train.py --plan)
def tiny_config():
    return models.build_tiny("llama")[0].config


def test_memory_plan_never_grows_when_the_micro_batch_halves_and_7b_ppo_fits_eight_cards():
    # every micro-batch reduce-scatters its gradients (train.py), so fewer rows per forward never costs memory; the
    # plan's suggestion for Qwen2.5-7B StarPO-S PPO (critic, gradient checkpointing) on 8 x 80 GB is a smaller
    # micro-batch, and with it the plan fits under the headroom
    import bench
    import memplan
    from transformers import Qwen2Config
    for shape in (bench.QWEN25_05B, bench.QWEN25_3B, bench.QWEN25_7B):
        cfg = Qwen2Config(**shape)
        for world in (1, 2, 8):
            for kw in (dict(), dict(ckpt=True), dict(critic=False), dict(ref=True), dict(lora_rank=64), dict(bf16=False)):
                totals = [memplan.plan_memory(cfg, world=world, micro=m, **kw)["total"] for m in (16, 8, 4, 2, 1)]
                assert totals == sorted(totals, reverse=True), (shape["num_hidden_layers"], world, kw, totals)
    cfg, card = Qwen2Config(**bench.QWEN25_7B), 80 * memplan.GIB
    kw = dict(world=8, micro=4, ckpt=True, critic=True)
    assert memplan.fitting_flags(cfg, kw, card) == "--micro-batch-size 2"
    assert memplan.fits(memplan.plan_memory(cfg, **dict(kw, micro=2))["total"], card)


def test_memory_plan_hand_computed_for_an_untied_config():
    # d 8, I 12, 2 layers, 2 heads of 4 on 1 KV head, vocab 20, untied: every part by hand, on 2 ranks, bf16, PPO
    # with a reference model, 4 rows rolled out, mini-batch 4 in micro-batches of 1, 10-token conversations
    import memplan
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=20, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    # the parameter counts the plan is built on, against the model: linear 8*(8+4+4) + 8*8 + 3*8*12 = 480 per layer,
    # + biases 4+4+8 and norms 16 = 512; root 2 embeddings of 20*8 + final norm 8 = 328; P = 2*512 + 328 = 1352
    a = model.model.layers[0]
    linear = sum(m.weight.numel() for m in (a.self_attn.q_proj, a.self_attn.k_proj, a.self_attn.v_proj, a.self_attn.o_proj,
                                            a.mlp.gate_proj, a.mlp.up_proj, a.mlp.down_proj))
    assert (linear, sum(p.numel() for p in a.parameters()), sum(p.numel() for p in model.parameters())) == (480, 512, 1352)
    plan = memplan.plan_memory(cfg, world=2, rows=4, micro=1, seq=10, critic=True, ref=True, bf16=True)
    want = dict(weights=4 * 1352 / 2, grads=4 * 1352 / 2, adamw=8 * 1352 / 2,
                critic=16 * (1352 - 160 + 8 + 1) / 2,          # the trunk: no lm_head, + value head (8 + 1)
                reference=4 * 1352 / 2, rollout_copy=2 * 1352, lora_base=0,
                kv_pool=2 * 2 * (4 // 2) * 1 * 128 * 4 * 2,   # layers x K,V x rows per rank x KV heads x 128 slots x D x bf16
                # bf16 autocast per token per layer 26*8 + 8 + 4*8 + 4*4 + 4*2 + 8*12 = 368, outside 12*8 + 8 = 104
                activations=(2 * 368 + 104) * 10, recompute=0,
                weight_casts=2 * (328 + 2 * 512),             # bf16 root (both embeddings) + two blocks, all-gathered
                # bf16 grads + fp32 reduce-scatter input of root + two blocks (each micro-batch reduce-scatters: its
                # 2 micro-batches per rank add no unsharded accumulation)
                grad_buffers=(2 + 4) * (328 + 2 * 512),
                # 10 positions (< the 256 chunk) x vocab 20, four fp32 tensors, + the fp32 copy of the bf16 lm_head
                logprob_chunk=4 * 10 * 20 * 4 + 4 * 160,
                # two fp32 gradients of the chunk, the copy again, lm_head's fp32 weight gradient and its bf16 cast
                logprob_backward=2 * 10 * 20 * 4 + 4 * 160 + 4 * 160 + 2 * 160)
    want["total"] = sum(want.values())
    assert plan == pytest.approx(want) and want["total"] == 60280
    # one process, fp32, no critic: no rollout copy, no FSDP buffers, no casts
    one = memplan.plan_memory(cfg, world=1, rows=4, micro=1, seq=10, critic=False, bf16=False)
    assert one["rollout_copy"] == one["grad_buffers"] == one["weight_casts"] == one["critic"] == 0
    # LoRA rank 2 on 2 ranks: adapters 2*(7*8 + 2*8 + 2*4 + 3*12) = 232 per layer train; the base of the adapted
    # weights (480 per layer) is gathered once in bf16 for the rollout copy
    lora = memplan.plan_memory(cfg, world=2, rows=4, micro=1, seq=10, critic=False, bf16=True, lora_rank=2)
    assert (lora["grads"], lora["adamw"], lora["lora_base"]) == (4 * 464 / 2, 8 * 464 / 2, 2 * 2 * 480)


def test_memory_plan_matches_what_the_cpu_measures():
    # memplan.plan_memory's parts against the same quantities measured on small Qwen2-shaped models: bytes autograd
    # holds for backward (fp32 and bf16 autocast, with and without checkpointing), weights / grads / AdamW states
    # after a real step, and the static KV pool the sampler allocates. Within 15%.
    import memplan
    from transformers import Qwen2Config, Qwen2ForCausalLM
    for d, I, H, KV, L, V, micro, seq, bf16, ckpt in [(96, 256, 6, 2, 3, 500, 2, 100, False, False),
                                                      (128, 344, 8, 4, 4, 1000, 3, 80, True, False),
                                                      (128, 344, 8, 2, 4, 800, 2, 120, False, True),
                                                      (96, 256, 6, 3, 3, 500, 2, 100, True, True)]:
        cfg = Qwen2Config(vocab_size=V, hidden_size=d, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                          num_key_value_heads=KV, tie_word_embeddings=True)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        held, seen = [0], set(params)

        def pack(t):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                held[0] += t.untyped_storage().nbytes()
            return t
        tokens = torch.randint(0, V, (micro, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logp, ent = starpo.token_logprobs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        plan = memplan.plan_memory(cfg, world=1, rows=4, micro=micro, seq=seq, critic=False, bf16=bf16, ckpt=ckpt)
        want = plan["activations"] + (plan["weight_casts"] if bf16 else 0)
        assert held[0] == pytest.approx(want, rel=0.15), (d, bf16, ckpt, held[0], want)
        opt = torch.optim.AdamW(model.parameters())
        opt.step()
        measured = dict(weights=sum(p.numel() * 4 for p in model.parameters()),
                        grads=sum(p.grad.numel() * 4 for p in model.parameters()),
                        adamw=sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim()))
        for k, v in measured.items():
            assert plan[k] == pytest.approx(v, rel=0.15), k


def test_memory_plan_kv_pool_is_the_pool_the_sampler_allocates(monkeypatch, tiny):
    import memplan
    model, tok = tiny
    monkeypatch.setattr(sampler, "_POOL", {})
    preset = FROZENLAKE_PRESETS["FrozenLake"]
    rollout.rollout(model, tok, [FrozenLakeEnv(**preset["kwargs"]) for _ in range(4)], [1, 1, 2, 2],
                    loop_settings(preset, max_turns=1, max_new_tokens=4, max_context=1000), group_size=2,
                    sampler=sampler.Sampler(static=True))
    pool = sum(x.numel() * x.element_size() for x in sampler._POOL["kv"][0] + sampler._POOL["kv"][1])
    assert memplan.plan_memory(model.config, rows=4, seq=1000, bf16=False)["kv_pool"] == pool


def test_memory_plan_page_is_what_bench_prints(monkeypatch, capsys):
    # results/memory-plan.md is generated: `python bench.py --plan --markdown` prints it whole (memplan.py's arithmetic
    # and the text around it), so a change to the plan fails here until the page is written again, and prose
    # elsewhere cannot fail it. The command runs in process (runpy), exactly as on the command line.
    import runpy
    monkeypatch.setattr(sys, "argv", ["bench.py", "--plan", "--markdown"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(os.path.join(HERE, "bench.py"), run_name="__main__")
    assert not stop.value.code
    with open(os.path.join(HERE, "results", "memory-plan.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == capsys.readouterr().out, ("results/memory-plan.md is not what `python bench.py --plan --markdown` "
                                                  "prints; write it again: python bench.py --plan --markdown > "
                                                  "results/memory-plan.md")


def markdown_slug(heading):
    """GitHub's anchor for a heading: lowercase; every character but letters, digits, spaces, hyphens and underscores
    dropped (non-ASCII letters stay: "ε"); spaces to hyphens. A link in the heading counts by its text."""
    import re
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def markdown_anchors_and_links(text):
    """(the anchors of a markdown page's headings, the targets of its inline links and images), fenced code blocks
    skipped, and code spans for links. A repeated heading's anchor gets -1, -2, ... in page order, as on GitHub."""
    import re
    anchors, count, prose, fenced = set(), {}, [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(line)
            heading = re.match(r"#{1,6} (.+)", line)
            if heading:
                slug = markdown_slug(heading.group(1))
                anchors.add(f"{slug}-{count[slug]}" if slug in count else slug)
                count[slug] = count.get(slug, 0) + 1
    prose = re.sub(r"`[^`]*`", "", "\n".join(prose))  # a code span may run over a line break
    return anchors, re.findall(r"\[[^\]]*\]\(([^()\s]+)\)", prose)


def markdown_anchors(path):
    with open(path, encoding="utf-8") as f:
        return markdown_anchors_and_links(f.read())[0]


def test_markdown_links_resolve():
    # every relative link of README.md, docs/*.md and results/**/*.md names a file of the repository, and its #anchor a
    # heading of that file by GitHub's rule; the rule first on headings these pages link to, and on a hand-made page
    import glob
    import re
    import urllib.parse
    assert (markdown_slug("Three seeds and a control from the 4,096-demonstration start: GRPO and PPO beat both (CPU)") ==
            "three-seeds-and-a-control-from-the-4096-demonstration-start-grpo-and-ppo-beat-both-cpu")
    assert (markdown_slug("The ε = 0.5 mix warm-up: between random and solver, reading the board from 3,840 demonstrations")
            == "the-ε--05-mix-warm-up-between-random-and-solver-reading-the-board-from-3840-demonstrations")
    assert markdown_slug("The memory plan (`memplan.py`, `train.py --plan`)") == "the-memory-plan-memplanpy-trainpy---plan"
    page = "# A\n## A\n```bash\n# A\n[x](fenced.md)\n```\nsee `[y](code.md)` [z](a.md#a-1)\n### A, `b` [c](d.md)\n## A"
    assert markdown_anchors_and_links(page) == ({"a", "a-1", "a-b-c", "a-2"}, ["a.md#a-1", "d.md"])
    pages = [os.path.join(HERE, "README.md"), *glob.glob(os.path.join(HERE, "docs", "*.md")),
             *glob.glob(os.path.join(HERE, "results", "**", "*.md"), recursive=True)]
    broken = []
    for md in pages:
        with open(md, encoding="utf-8") as f:
            links = markdown_anchors_and_links(f.read())[1]
        for target in (t for t in links if not re.match(r"[a-z]+:", t)):  # http:, https:, mailto: are not checked
            path, _, anchor = urllib.parse.unquote(target).partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            where = f"{os.path.relpath(md, HERE)}: {target}: "
            if not dest.startswith(HERE + os.sep) or not os.path.exists(dest):
                broken.append(where + "no such file in the repository")
            elif anchor and not (dest.endswith(".md") and anchor in markdown_anchors(dest)):
                broken.append(where + f"no heading of {os.path.relpath(dest, HERE)} has this anchor")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_memory_plan_commands_are_what_train_py_plans(tmp_path):
    # bench.PLAN_COMMANDS states what each command's flags set in plan_memory; `train.py --plan RANKS` with those
    # flags, on the model's shape written as a config directory, must print the same total and the same "fits with"
    # flags. One process runs train.py once per command (runpy: --plan exits before any weight or rank is made)
    import re
    import bench
    from transformers import Qwen2Config
    commands, want = [], bench.plan_tables()[1].splitlines()[2:]
    for model, shape, ranks, flags, kw in bench.PLAN_COMMANDS:
        Qwen2Config(**shape).save_pretrained(str(tmp_path / model))
        commands.append(["--plan", str(ranks), "--model", str(tmp_path / model), "--gpu-memory-gb", "80", *flags.split()])
    script = ("import contextlib, io, json, runpy, sys\nout = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    sys.argv, printed = ['train.py', *argv], io.StringIO()\n"
              "    with contextlib.redirect_stdout(printed):\n"
              "        try:\n            runpy.run_path('train.py', run_name='__main__')\n"
              "        except SystemExit as e:\n            assert not e.code, (argv, e.code)\n"
              "    out.append(printed.getvalue())\n"
              "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True, cwd=HERE,
                       env=train_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for printed, row, argv in zip(json.loads(r.stdout.splitlines()[-1]), want, commands):
        total = re.search(r"  total +([\d.]+) GB per rank", printed).group(1)
        fix = re.search(r"fits with: (.*)", printed)
        assert f"| {total} GB |" in row, (argv, printed, row)
        assert (f"fits with `{fix.group(1)}`" in row) if fix else ("fits with" not in row), (argv, printed, row)
        assert ("does NOT fit" in printed) == ("**no**" in row), (argv, printed, row)


@pytest.mark.slow
def test_plan_prints_the_parts_and_exits_without_training(tmp_path):
    out = str(tmp_path / "run")
    r = run_train(*TINY, "--env", "sokoban", "--algo", "ppo", "--kl-coef", "0.1", "--plan", "2", "--out", out)
    for part in ("weights", "critic", "reference", "rollout_copy", "kv_pool", "activations", "weight_casts",
                 "grad_buffers", "logprob_chunk", "logprob_backward", "total"):
        assert f"  {part} " in r.stdout, part
    assert "2 ranks" in r.stdout and "loading --model" not in r.stdout
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) and not os.path.exists(os.path.join(out, "ckpt.pt"))


@pytest.mark.slow
def test_train_refuses_a_plan_that_does_not_fit_and_names_the_flags_that_would(tmp_path):
    import memplan
    kw = dict(world=1, rows=4, micro=2, seq=3600, critic=True, bf16=False)
    with_ckpt, without = (memplan.plan_memory(tiny_config(), ckpt=c, **kw)["total"] for c in (True, False))
    gb = (with_ckpt + without) / 2 / memplan.HEADROOM / 2**30  # a card between the two
    flags = [*TINY, "--env", "frozenlake", "--algo", "ppo", "--steps", "1", "--val-every", "0", "--collapse-every", "0"]
    r = run_train(*flags, "--gpu-memory-gb", str(gb), "--out", str(tmp_path / "no"), check=False)
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "does not fit" in said and "--grad-checkpointing" in said and "--force" in said, said
    assert "loading --model" not in r.stdout and "Traceback" not in said
    r = run_train(*flags, "--gpu-memory-gb", str(gb), "--force", "--out", str(tmp_path / "forced"))
    assert f"memory plan: {without / 2**30:.2f} GB per rank" in r.stdout, r.stdout
    run_train(*flags, "--gpu-memory-gb", str(gb), "--grad-checkpointing", "--out", str(tmp_path / "ckpt"))


# Under autocast, every Linear's output scaled by 1 + k/256 with k = (rows of the GEMM) mod 7: a GEMM whose last bits
# depend on its shape, as cuBLAS picks its kernel (and split-K) by shape; the CPU's bf16 GEMMs round alike at any shape
SHAPE_ROUNDING = ("import torch, torch.nn.functional as F\n_linear = F.linear\n"
                  "F.linear = lambda x, w, b=None: _linear(x, w, b) * (1 + (x.numel() // x.shape[-1] % 7) / 256 "
                  "* torch.is_autocast_enabled('cpu'))\n")


@pytest.mark.slow
@pytest.mark.parametrize("micro", ["1", "3"])
def test_lr_zero_bf16_ratio_is_exactly_one(tmp_path, micro):
    # old log-probs and the update see the same rows in the same micro-batches at the same padded length, so
    # under bf16 autocast the GEMMs have the same shapes and the ratio is 1 to the last bit at --lr 0, even where
    # the GEMMs' rounding depends on their shape (SHAPE_ROUNDING)
    (tmp_path / "sitecustomize.py").write_text(SHAPE_ROUNDING)
    out = str(tmp_path / "run")
    run_train(*TINY, "--env", "sokoban", "--algo", "ppo", "--group-size", "4", "--mini-batch-size", "4",
              "--micro-batch-size", micro, "--dtype", "bf16", "--lr", "0", "--critic-lr", "0", "--filter-ratio", "1",
              "--steps", "1", "--val-every", "0", "--collapse-every", "0", "--max-new-tokens", "24", "--out", out,
              env=dict(PYTHONPATH=str(tmp_path)))
    m = read_metrics(out)[0]
    assert m["train/batch_size"] == 8
    assert (m["actor/ratio_min"], m["actor/ratio_max"], m["actor/clipfrac"], m["actor/approx_kl"]) == (1.0, 1.0, 0.0, 0.0), m



RECORD_LOGPROB_PASSES = ("import atexit, json, os, torch, starpo\n_tl, _pl, calls, losses = starpo.token_logprobs, starpo.policy_loss, [], []\n"
                         "def counted(model, tokens, *a, **k):\n"
                         "    calls.append((torch.is_grad_enabled(), tokens.shape[0]))\n"
                         "    return _tl(model, tokens, *a, **k)\n"
                         "def recorded(logp, old, adv, mask, *a, **k):\n"
                         "    losses.append((logp[mask > 0].tolist(), old[mask > 0].tolist()))\n"
                         "    return _pl(logp, old, adv, mask, *a, **k)\n"
                         "starpo.token_logprobs, starpo.policy_loss = counted, recorded\n"
                         "atexit.register(lambda: open(os.environ['CALLS_OUT'], 'w').write(json.dumps([calls, losses])))\n")


@pytest.mark.slow
@pytest.mark.parametrize("mini,epochs,lr,no_grad_rows", [("8", "1", "0", 0), ("4", "2", "1e-2", 4)])
def test_old_logprobs_of_the_first_mini_batch_come_from_the_update_itself(tmp_path, mini, epochs, lr, no_grad_rows):
    # the first mini-batch's first forward runs on the weights of the rollout, so its log-probs are the recomputed
    # old log-probs: the no-grad pass skips those rows, and the later epochs must reuse them (not their own)
    (tmp_path / "sitecustomize.py").write_text(RECORD_LOGPROB_PASSES)
    out, record = str(tmp_path / "run"), tmp_path / "calls.json"
    run_train(*TINY, "--env", "sokoban", "--algo", "ppo", "--group-size", "4", "--mini-batch-size", mini,
              "--micro-batch-size", "2", "--ppo-epochs", epochs, "--lr", lr, "--critic-lr", "0", "--filter-ratio", "1",
              "--steps", "1", "--val-every", "0", "--collapse-every", "0", "--max-new-tokens", "24", "--out", out,
              env=dict(PYTHONPATH=os.pathsep.join([str(tmp_path), HERE]), CALLS_OUT=str(record)))
    m = read_metrics(out)[0]
    calls, losses = json.loads(record.read_text())  # [(grad enabled, rows)] per log-prob call; [(logp, old)] per loss
    assert m["train/batch_size"] == 8
    assert sum(n for grad, n in calls if not grad) == no_grad_rows, calls
    assert sum(n for grad, n in calls if grad) == 8 * int(epochs), calls
    assert m["rollout/sampler_logp_abs_diff"] < 1e-5  # over all kept rows, the update's first mini-batch included
    if lr == "0":
        assert (m["actor/ratio_min"], m["actor/ratio_max"], m["actor/clipfrac"]) == (1.0, 1.0, 0.0), m
        return
    first, second = losses[:2], losses[2:4]          # epoch 1: the two micro-batches of mini-batch 1, then of 2
    again, again2 = losses[4:6], losses[6:]          # epoch 2
    for (logp, old), (_, old_again), (logp_again, _) in zip(first, again, again):
        assert old == logp and old_again == logp  # epoch 1: its own forward; epoch 2: epoch 1's, kept
        assert logp_again != logp                  # the weights moved in between
    assert [old for _, old in again2] == [old for _, old in second]  # mini-batch 2: from the no-grad pass

# ==================================================================================================
# Checkpoints and resume: kill train.py at any instant, resume on any world size, export
# ==================================================================================================
# A kill changes what is on disk only at a file-system operation, or half-way through one write. So a run is
# interrupted just before its N-th operation under --out (an open for writing, rename, remove, mkdir, rmtree),
# seen by a Python audit hook in this wrapper; train.py runs unchanged. "kill" sends SIGKILL (before an append
# to metrics.jsonl it first writes half a line, as a kill in the middle of the write would); "fail" raises
# OSError instead (a full disk). N may be "N:text": the N-th operation whose description contains text.
INTERRUPT = r'''
import atexit, os, runpy, signal, sys
n, _, only = sys.argv[1].partition(":")
n, how, out, seen = int(n), sys.argv[2], os.path.abspath(sys.argv[3]), [0]
atexit.register(lambda: print(f"OPERATIONS {seen[0]}", file=sys.stderr, flush=True))

def hook(event, a):
    if seen[0] < 0 or event not in ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree"):
        return
    path = os.fspath(a[0]) if isinstance(a[0], (str, os.PathLike)) else None
    if not isinstance(path, str) or (event == "open" and not set(str(a[1])) & set("wax+")):
        return
    what = f"{event} {os.path.relpath(os.path.abspath(path), out)}"
    if what.split(" ", 1)[1].startswith("..") or only not in what:
        return
    seen[0] += 1
    if seen[0] == n:
        seen[0] = -1
        print(f"INTERRUPTED ({how}) before {what}", file=sys.stderr, flush=True)
        if how == "fail":
            raise OSError(28, "No space left on device (injected)")
        if what == "open metrics.jsonl":
            with open(path, "a") as f:
                f.write('{"step": 1, "train/Froz')
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_keep_hf_leaves_every_checkpoint_as_an_hf_directory_to_judge_later(tmp_path):
    """--keep-hf: each checkpoint's weights also stay as <out>/step<N> (N steps done), loadable and different per
    step; the last equals hf/; a resume that repeats a step replaces its directory. Without it there are none."""
    from safetensors.torch import load_file
    out = str(tmp_path / "run")
    flags = [*TINY, "--env", "frozenlake", "--algo", "grpo", "--lr", "1e-2", "--val-every", "0", "--collapse-every", "0",
             "--save-every", "1"]
    run_train(*flags, "--steps", "2", "--keep-hf", "--out", out)
    assert sorted(d for d in os.listdir(out) if d.startswith("step")) == ["step1", "step2"]
    w = {d: load_file(os.path.join(out, d, "model.safetensors")) for d in ("step1", "step2", "hf")}
    assert all(torch.equal(w["step2"][k], w["hf"][k]) for k in w["hf"])
    assert any(not torch.equal(w["step1"][k], w["step2"][k]) for k in w["hf"])
    run_train(*flags, "--steps", "3", "--keep-hf", "--resume", out)
    assert sorted(d for d in os.listdir(out) if d.startswith("step")) == ["step1", "step2", "step3"]
    assert os.path.exists(os.path.join(out, "step3", "tokenizer_config.json"))
    run_train(*flags, "--steps", "1", "--out", str(tmp_path / "plain"))
    assert not [d for d in os.listdir(tmp_path / "plain") if d.startswith("step")]


KILLED = [*TINY, "--env", "frozenlake", "--algo", "ppo", "--lr", "1e-3", "--critic-lr", "1e-3", "--steps", "3", "--save-every", "1"]


LEFTOVERS = {"hf.tmp", "hf.old", "ckpt.pt.tmp", "metrics.jsonl.tmp", "args.json.tmp"}


def interrupted(out, at, how="kill", extra=()):
    """One launch of KILLED (+ extra flags) into out (resuming it when it has a checkpoint), stopped before operation
    `at`."""
    start = ["--resume", out] if os.path.exists(os.path.join(out, "ckpt.pt")) else ["--out", out]
    return subprocess.run([sys.executable, "-c", INTERRUPT, at, how, out, os.path.join(HERE, "train.py"), *KILLED, *extra, *start],
                          capture_output=True, text=True, cwd=HERE, env=train_env(), timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """KILLED run to the end in one go (under the wrapper, counting its file operations)."""
    out = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    r = interrupted(out, "0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, int(r.stderr.split("OPERATIONS ")[-1].split()[0])


def assert_same_run(a, b):
    """Metrics (timing aside) equal, the checkpoint's weights equal, hf/ holds the checkpoint's actor, no leftovers."""
    from safetensors.torch import load_file
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        x, y = comparable(x), comparable(y)
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    wa, wb = checkpoint.read_state(a)["actor"], checkpoint.read_state(b)["actor"]
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    hf = load_file(os.path.join(b, "hf", "model.safetensors"))
    assert hf and all(torch.equal(hf[k], wb[k]) for k in hf)
    assert not LEFTOVERS & set(os.listdir(b))
    state = torch.load(os.path.join(b, "ckpt.pt"), weights_only=False)["state"]  # its state directory, and no other
    assert [d for d in os.listdir(b) if d.startswith("state-")] == [state]


@pytest.mark.slow
@pytest.mark.parametrize("at", ["1:os.rename step2.tmp", "2:os.rename ckpt.pt.tmp"])
def test_keep_hf_killed_around_its_copy_resumes_to_whole_step_directories(tmp_path, at):
    """--keep-hf killed after step 2's copy began (before it is renamed in, or before ckpt.pt commits step 2): the
    resume repeats step 2 and ends with step1..step3 whole, step3 equal to hf/, no step*.tmp left."""
    from safetensors.torch import load_file
    out = str(tmp_path / "run")
    r = interrupted(out, at, extra=["--keep-hf"])
    assert r.returncode != 0 and "INTERRUPTED" in r.stderr, r.stderr[-2000:]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == 0  # step 2 (index 1) not committed
    r = interrupted(out, "0", extra=["--keep-hf"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("step")) == ["step1", "step2", "step3"]
    w = {d: load_file(os.path.join(out, d, "model.safetensors")) for d in ("step2", "step3", "hf")}
    assert all(torch.equal(w["step3"][k], w["hf"][k]) for k in w["hf"])
    assert any(not torch.equal(w["step2"][k], w["step3"][k]) for k in w["hf"])
    assert not LEFTOVERS & set(os.listdir(out))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["half a metrics line", "stale hf.old"])
def test_resume_repairs_what_a_kill_leaves(tmp_path, uninterrupted, damage):
    """What a kill leaves: a partial last metrics line (a JSONDecodeError when read back) and a stale hf.old (a
    'Directory not empty' at the next checkpoint, after ckpt.pt moved on); leftover hf.tmp and ckpt.pt.tmp too."""
    import shutil
    ref, _ = uninterrupted
    out = str(tmp_path / "run")
    shutil.copytree(ref, out)
    if damage == "half a metrics line":
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write('{"step": 3, "train/Froz')
    else:
        shutil.copytree(os.path.join(out, "hf"), os.path.join(out, "hf.old"))
    shutil.copytree(os.path.join(out, "hf"), os.path.join(out, "hf.tmp"))
    open(os.path.join(out, "ckpt.pt.tmp"), "wb").write(b"PK\x03\x04 half a checkpoint")
    run_train(*KILLED, "--steps", "4", "--resume", out)
    ms = read_metrics(out)
    assert [m["step"] for m in ms] == [0, 1, 2, 3, 4]  # the old final validation (step 3) replaced by step 3, then val
    assert [comparable(m) for m in ms[:3]] == [comparable(m) for m in read_metrics(ref)[:3]]
    sd = checkpoint.read_state(out)
    assert sd["step"] == 3 and not LEFTOVERS & set(os.listdir(out))
    from safetensors.torch import load_file
    assert all(torch.equal(v, sd["actor"][k]) for k, v in load_file(os.path.join(out, "hf", "model.safetensors")).items())


@pytest.mark.slow
def test_kill_at_random_instants_and_resume_equals_uninterrupted(tmp_path, uninterrupted):
    """Stop a 3-step run (a checkpoint every step) at seeded random file operations, resuming after each
    stop, then let it finish: metrics, checkpoint and hf/ equal the uninterrupted run's. The first stop is a
    failed write at the worst moment of the step-1 checkpoint (the step-0 hf/ moved to hf.old, the new one not yet
    renamed in): a one-line error, and the step-0 checkpoint still resumes. The last stop comes after the last
    checkpoint, in the final validation, which the resume must redo."""
    ref, n_ops = uninterrupted
    out, rng = str(tmp_path / "run"), random.Random(16)
    # a launch resumed at the last step still does a third of a whole run's operations, so every stop happens
    plan = [("fail", "2:os.rename hf.tmp")] + [("kill", str(rng.randint(1, n_ops // 3))) for _ in range(2)]
    plan += [("kill", "1:open val-FrozenLake-step00003")]
    stops = []
    for how, at in plan:
        r = interrupted(out, at, how)
        assert r.returncode != 0 and "INTERRUPTED" in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
        stops.append(r.stderr.split("INTERRUPTED ")[1].splitlines()[0])
        if how == "fail":
            assert "train.py: checkpoint of step 1 failed" in r.stdout and "Traceback" not in r.stdout + r.stderr, r.stderr
            assert not os.path.exists(os.path.join(out, "hf")) and os.path.isdir(os.path.join(out, "hf.old"))
    r = interrupted(out, "0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print("\n".join(stops))
    assert_same_run(ref, out)


@pytest.mark.slow
def test_checkpoints_are_written_sharded_by_every_rank(tmp_path):
    """ckpt.pt is small (step, args, RNG, monitor and the name of the state directory); the weights and AdamW states
    of actor and critic are in a torch.distributed.checkpoint directory, each rank writing its own shard (about half
    each on 2 ranks), never gathered on rank 0; hf/ holds the whole actor; checkpoint.read_state reads it all back."""
    import checkpoint
    out = str(tmp_path / "run")
    run_train(*KILLED, "--steps", "2", "--out", out, torchrun=2)
    states = [d for d in os.listdir(out) if d.startswith("state-")]
    assert states == ["state-000002"], os.listdir(out)
    shards = sorted(f for f in os.listdir(os.path.join(out, states[0])) if f.endswith(".distcp"))
    sizes = [os.path.getsize(os.path.join(out, states[0], f)) for f in shards]
    assert len(shards) == 2 and min(sizes) > 0.4 * sum(sizes), (shards, sizes)
    assert os.path.getsize(os.path.join(out, "ckpt.pt")) < 50_000
    st = checkpoint.read_state(out)
    tiny = models.build_tiny("llama")[0]
    n = sum(p.numel() for p in tiny.parameters())  # the tied embedding once; the state dict names it twice
    assert st["step"] == 1 and {k: v.shape for k, v in st["actor"].items()} == {k: v.shape for k, v in tiny.state_dict().items()}
    assert sum(v.numel() for v in st["critic"].values()) > n // 2 and len(st["actor_opt"]["state"]) == len(list(tiny.parameters()))
    assert sum(sizes) > 4 * 3 * n  # actor and critic weights with their two AdamW moments, in fp32
    from safetensors.torch import load_file
    hf = load_file(os.path.join(out, "hf", "model.safetensors"))
    assert all(torch.equal(hf[k], st["actor"][k]) for k in hf)


@pytest.mark.slow
def test_resume_across_world_sizes(tmp_path, uninterrupted):
    """A checkpoint written by 2 ranks resumes in 1 process, whose checkpoint resumes on 2 ranks again; the
    result matches the 1-process run within the 2-rank tolerance (each rank reads its shards of the state directory)."""
    ref, _ = uninterrupted
    out = str(tmp_path / "run")
    run_train(*KILLED, "--steps", "1", "--out", out, torchrun=2)
    run_train(*KILLED, "--steps", "2", "--resume", out)
    run_train(*KILLED, "--steps", "3", "--resume", out, torchrun=2)
    assert_same_as_one_process(ref, out)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["parent is a file", "read-only", "holds a checkpoint"])
def test_out_dir_checked_before_the_model_loads(tmp_path, case):
    """--model is bad too: the run-directory error must come first, so nothing was loaded."""
    out = tmp_path / "run"
    if case == "parent is a file":
        (tmp_path / "f").write_text("")
        out, message = tmp_path / "f" / "run", "is not a directory"
    elif case == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        out.mkdir()
        out.chmod(0o500)
        message = "is not writable"
    else:
        out.mkdir()
        (out / "ckpt.pt").write_bytes(b"")
        message = "holds a checkpoint: continue it with --resume"
    r = run_train(*TINY, "--steps", "1", "--model", "/nonexistent/model-dir", "--out", str(out), check=False)
    assert r.returncode == 2 and message in r.stdout and r.stdout.count("\n") <= 2, r.stdout + r.stderr
    assert "cannot load --model" not in r.stdout and "Traceback" not in r.stdout + r.stderr


@pytest.mark.slow
def test_resume_with_different_flags_is_refused(tmp_path):
    out = str(tmp_path / "run")
    run_train(*TINY, "--env", "bandit", "--steps", "1", "--val-every", "0", "--out", out)
    r = run_train(*TINY, "--env", "bandit", "--steps", "2", "--val-every", "0", "--resume", out, "--algo", "grpo", check=False)
    assert r.returncode != 0 and "--algo was 'ppo', now 'grpo'" in r.stdout + r.stderr
    # flags that change neither the training nor the sampled tokens may differ
    run_train(*TINY, "--env", "bandit", "--steps", "2", "--val-every", "0", "--resume", out, "--sampler", "static",
              "--pg-timeout-min", "5", "--force", "--gpu-memory-gb", "64")
    assert [m["step"] for m in read_metrics(out)] == [0, 1]


def test_lora_on_lm_head_is_refused_by_the_log_prob_pass():
    head = torch.nn.Linear(4, 8)
    head.lora_A = torch.nn.ModuleDict()  # what peft's wrapper carries; its .weight would be the frozen base alone
    with pytest.raises(ValueError, match="LoRA adapter on lm_head"):
        starpo._chunk_logprobs(head, torch.randn(3, 4), torch.tensor([0, 1, 2]), 1.0, False)


@pytest.mark.slow
def test_exported_hf_dir_loads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = str(tmp_path / "run")
    run_train(*TINY, "--env", "bandit", "--steps", "1", "--val-every", "0", "--out", out)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "hf"))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 5 or tok.eos_token_id in gen[0].tolist()
    sd = checkpoint.read_state(out)["actor"]
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])


# ==================================================================================================
# Evaluation and plots (eval.py)
# ==================================================================================================
TINY_EVAL = ["--model", "tiny", "--num-seeds", "2", "--samples", "2", "--max-new-tokens", "8", "--max-turns", "2"]


def run_eval(*flags):
    """eval.py on the CPU whatever GPUs the machine has (the suite's numbers are CPU numbers)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    flags = flags if "--device" in flags else ("--device", "cpu", *flags)
    flags = flags if "--dtype" in flags else ("--dtype", "fp32", *flags)
    return subprocess.run([sys.executable, os.path.join(HERE, "eval.py"), *flags], capture_output=True, text=True,
                          cwd=HERE, env=env, timeout=600)


def test_pass_at_k_hand_made():
    # 5 samples, 2 successes: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - 1/10; pass@4 = 1
    assert ev.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert ev.pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert ev.pass_at_k(5, 2, 4) == 1.0 and ev.pass_at_k(5, 5, 5) == 1.0
    assert ev.pass_at_k(5, 0, 5) == 0.0
    for n in range(1, 9):  # the product form equals the binomial formula everywhere
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        ev.pass_at_k(2, 1, 3)


def test_summarize_hand_made_records():
    stats = lambda valid, invalid, errors: dict(num_turns=2, valid_actions=valid, invalid_actions=invalid,
                                                format_errors=errors, response_tokens=10, think_tokens=4)
    recs = [dict(seed=123, success=True, score=1.0, stats=stats(1, 0, 0)),   # seed 123: 2 of 4 succeed
            dict(seed=123, success=False, score=0.0, stats=stats(1, 1, 1)),
            dict(seed=123, success=True, score=1.0, stats=stats(1, 0, 0)),
            dict(seed=123, success=False, score=0.0, stats=stats(0, 0, 2)),
            dict(seed=124, success=False, score=0.0, stats=stats(1, 0, 0))] + [   # seed 124: 0 of 4
            dict(seed=124, success=False, score=0.0, stats=stats(1, 0, 0))] * 3
    row = ev.summarize(recs, samples=4)
    assert row["success"] == pytest.approx(2 / 8)
    assert row["pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2) + 0) / 2)  # (5/6 + 0) / 2
    assert row["pass@4"] == pytest.approx(0.5)
    assert row["valid_action_rate"] == pytest.approx(7 / 8)
    assert row["format_ok_rate"] == pytest.approx(1 - 3 / 16)
    assert row["score"] == pytest.approx(0.25) and row["turns"] == 2 and row["response_tokens"] == 10


@pytest.mark.slow
def test_eval_tiny_each_env_writes_jsonl_and_table(tmp_path):
    out = str(tmp_path / "ev")
    r = run_eval(*TINY_EVAL, "--env", "bandit", "sokoban", "--env", "frozenlake", "webshop", "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(os.path.join(out, "summary.json")))["results"]
    for preset in ("Bandit", "SimpleSokoban", "FrozenLake", "WebShop"):
        assert f"| {preset} |" in r.stdout  # the table row
        recs = [json.loads(l) for l in open(os.path.join(out, f"{preset}.jsonl"))]
        assert [(x["seed"], x["sample"]) for x in recs] == [(123, 0), (123, 1), (124, 0), (124, 1)]
        for x in recs:
            assert {"preset", "success", "score", "turn_rewards", "stats", "turns", "text"} <= set(x)
            assert 1 <= len(x["turns"]) <= 2 and len(x["turn_rewards"]) == len(x["turns"])
            for t in x["turns"]:
                assert {"prompt", "raw", "think", "actions", "reward", "info"} <= set(t)
                assert t["raw"].startswith("<think>")
            assert x["turns"][0]["prompt"].startswith("<|im_start|>system")  # the exact tokens the model saw
            assert x["turns"][0]["prompt"].endswith("<|im_start|>assistant\n<think>")
            assert x["turns"][0]["prompt"] in x["text"]
        row = summary[preset]
        assert row["episodes"] == 4 and 0 <= row["success"] <= row["pass@2"] <= 1
        assert row["turns"] == pytest.approx(sum(x["stats"]["num_turns"] for x in recs) / 4)


# Two-sided critical values of Student's t as printed in the standard tables (e.g. Fisher and Yates, Table III): at
# these t the two-sided p is the column's alpha, to the tables' three decimals
T_TABLE = {1: {0.10: 6.314, 0.05: 12.706, 0.01: 63.657}, 2: {0.10: 2.920, 0.05: 4.303, 0.01: 9.925},
           3: {0.05: 3.182, 0.01: 5.841}, 4: {0.05: 2.776, 0.01: 4.604}, 5: {0.05: 2.571, 0.01: 4.032},
           6: {0.05: 2.447}, 8: {0.05: 2.306}, 9: {0.05: 2.262}, 10: {0.05: 2.228, 0.01: 3.169}}


def test_student_t_p_against_a_printed_table_and_the_density():
    for dof, row in T_TABLE.items():
        for alpha, t in row.items():
            assert ev.student_t_p(t, dof) == pytest.approx(alpha, abs=5e-5 + alpha * 1e-3), (dof, alpha)
            assert ev.student_t_p(-t, dof) == ev.student_t_p(t, dof)
    # against the density integrated numerically (midpoint rule): p = 1 - 2 * integral_0^t f(x) dx
    def density(x, n):
        return math.gamma((n + 1) / 2) / (math.sqrt(n * math.pi) * math.gamma(n / 2)) * (1 + x * x / n) ** (-(n + 1) / 2)
    for n in (1, 2, 3, 4, 7):
        for t in (0.5, 1.7, 3.3):
            steps = 20000
            area = sum(density((i + 0.5) * t / steps, n) for i in range(steps)) * t / steps
            assert ev.student_t_p(t, n) == pytest.approx(1 - 2 * area, abs=1e-7), (n, t)
    assert ev.student_t_p(0.0, 3) == 1.0
    for bad in (0, 2.5):
        with pytest.raises(ValueError):
            ev.student_t_p(1.0, bad)


def test_paired_comparison_by_hand(tmp_path, capsys):
    # 5 episodes, A wins 1 0 1 0 1, B wins 1 1 1 1 0: d = 0 1 0 1 -1, mean 0.2, sample variance (2*0.04 + 2*0.64 +
    # 1.44) / 4 = 0.7, paired SE sqrt(0.7 / 5) = 0.3742, 0.2 / 0.3742 = 0.535 SE; B alone wins 2, A alone 1
    rec = lambda seed, won: dict(seed=seed, sample=0, success=won)
    a = [rec(s, w) for s, w in zip(range(5), [1, 0, 1, 0, 1])]
    b = [rec(s, w) for s, w in zip(reversed(range(5)), [0, 1, 1, 1, 1])]  # another order: matched by seed
    row = ev.paired(a, b)
    assert row["success_a"] == 0.6 and row["success_b"] == 0.8 and row["diff"] == pytest.approx(0.2)
    assert row["paired_se"] == pytest.approx(math.sqrt(0.7 / 5)) and (row["a_alone"], row["b_alone"]) == (1, 2)
    with pytest.raises(ValueError, match="same seeds"):
        ev.paired(a, b[1:])
    for name, recs, seed in (("A", a, 0), ("B", b, 0), ("C", b, 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "Toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (tmp_path / name / "summary.json").write_text(json.dumps(dict(
            args=dict(sample_seed=seed, temperature=0.5, greedy=False, samples=1), results={"Toy": {}})))
    ev.main(["--paired", str(tmp_path / "A"), str(tmp_path / "B")])
    assert "| Toy | 5 | 0.600 | 0.800 | 0.200 | 0.374 | 0.535 | 1 | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # another sampler seed: the episodes are not paired
        ev.main(["--paired", str(tmp_path / "A"), str(tmp_path / "C")])
    assert "sampled differently" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not an evaluation's directory: one line
        ev.main(["--paired", str(tmp_path / "A"), str(tmp_path)])
    assert "has no summary.json" in capsys.readouterr().err
    # two runs of one arm: B as above (diff 0.2) and D winning 0 0 1 1 1 (d = -1 0 0 1 0, diff 0). Mean 0.1; over
    # runs: sample std of (0.2, 0) is 0.1414, / sqrt(2) = 0.1. Per episode, the runs' mean minus A: -0.5 0.5 0 1 -0.5,
    # deviations from 0.1 squared sum to 1.7: paired SE sqrt(1.7 / 4 / 5) = 0.2915
    d = [rec(s, w) for s, w in zip(range(5), [0, 0, 1, 1, 1])]
    row = ev.paired_runs(a, [b, d])
    assert row["mean_diff"] == pytest.approx(0.1) and row["se_over_runs"] == pytest.approx(0.1)
    assert row["paired_se_of_mean"] == pytest.approx(math.sqrt(1.7 / 20)) and row["mean_success_b"] == pytest.approx(0.7)
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "Toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in d))
    (tmp_path / "D" / "summary.json").write_text((tmp_path / "B" / "summary.json").read_text())
    ev.main(["--paired", str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "D")])
    out = capsys.readouterr().out
    assert "| Toy | 5 | 0.600 | 0.600 | 0.000 | 0.316 | 0.000 | 1 | 1 |" in out  # D alone: d var 2 / 4, SE sqrt(0.1)
    # t = 0.1 / 0.1 = 1 with 1 dof: p = 1 - 2 atan(1) / pi = 0.5
    assert row["t"] == pytest.approx(1.0) and row["dof"] == 1 and row["p"] == pytest.approx(0.5)
    assert "B = the mean of 2 runs" in out and "| Toy | 2 | 0.600 | 0.700 | 0.100 | 0.100 | 1.000 | 1 | 0.500 | 0.292 |" in out
    with pytest.raises(SystemExit):
        ev.main(["--paired", str(tmp_path / "A")])
    assert "at least one EVAL_B" in capsys.readouterr().err


def test_unseen_keeps_exactly_the_judge_seeds_with_unseen_boards(tmp_path, capsys):
    # CoordFrozenLakeDet's 4x4 lakes repeat across seeds. Found by resetting both ranges: of judge seeds 123..172 only
    # 125, 136 and 160 start on a lake that training seeds 10400..10699 start on (125 = 10488 = 10614, 136 = 10420 =
    # 10554, 160 = 10543)
    import sft
    key = "CoordFrozenLakeDet"
    env = FrozenLakeEnv(**FROZENLAKE_PRESETS[key]["kwargs"])
    for a, b in ((125, 10488), (125, 10614), (136, 10420), (136, 10554), (160, 10543)):
        assert env.reset(a) == env.reset(b), (a, b)
    want = [s for s in range(123, 173) if s not in (125, 136, 160)]
    assert agent.unseen_seeds(key, range(123, 173), agent.seen_boards(key, range(10400, 10700))) == want
    # at a later turn: the mix demonstration of seed 10538 (policy seed 10400, as sft.py --seed 10400 plays it) shows
    # at its second turn judge seed 171's lake with the player on 171's start cell; its Start line names another cell,
    # which no move depends on (env_frozenlake.board), so 171 is a board that training showed. Found by replaying
    # the 300 demonstrations of 10400..10699; no other judge seed of 123..172 is shown at a later turn
    model, tok = models.load_model("tiny")
    a = dict(presets=[key], policy="mix", epsilon=0.5, seed=10400, episodes=300, no_think=True, max_turns=3,
             max_actions_per_turn=2, max_new_tokens=64)
    states = []
    sft.demonstrations(model, tok, key, "mix", 0.5, [10538], agent.agent_settings(key, dict(a, sample_seed=0)), 10400, states)
    assert states[0][1] != env.reset(171) and agent.board(key, states[0][1]) == agent.board(key, env.reset(171))
    assert "Start: (" in states[0][1] and "Start:" not in agent.board(key, states[0][1])
    # what training sources showed. A train.py run: step s played group g of its --env mix from seed + s*num_groups + g,
    # each preset its groups in --env order, for the steps with training metrics (the line of step 2 is the final
    # validation's), and the observations its observations.jsonl lists for those steps (here by hand: judge seed 150's
    # lake and player under another Start). An sft.py run: seed..seed+episodes-1 of each preset and the observations
    # of its demonstrations, replayed. A range: A-B inclusive, first boards only
    run, demos = tmp_path / "run", tmp_path / "sft"
    run.mkdir()
    model.save_pretrained(demos)
    tok.save_pretrained(demos)
    (demos / "sft.json").write_text(json.dumps(dict(a, heldout=64, heldout_seed=5000)))
    (run / "args.json").write_text(json.dumps(dict(seed=10400, num_groups=150, env_mix=[[key, 100], ["SimpleSokoban", 50]])))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (
        {"step": 0, f"train/{key}/success": 0.1}, {"step": 1, f"train/{key}/success": 0.2},
        {"step": 2, f"val-env/{key}/success": 0.3})))
    other_start = env.reset(150).replace("Start: ", "Start: (9, 9) was ", 1)
    (run / "observations.jsonl").write_text("".join(json.dumps(o) + "\n" for o in (
        dict(step=0, preset=key, observations=[other_start]), dict(step=2, preset=key, observations=[env.reset(140)]))))
    shown = ev.training_shown(str(run))
    assert shown == {key: ([*range(10400, 10500), *range(10550, 10650)], {other_start}),
                     "SimpleSokoban": ([*range(10500, 10550), *range(10650, 10700)], set())}
    replayed = ev.training_shown(str(demos))
    assert replayed[key][0] == list(range(10400, 10700)) and env.reset(10538) in replayed[key][1]
    assert states[0][1] in replayed[key][1] and len(replayed[key][1]) > 300  # later turns add observations
    assert ev.training_shown("10400-10699") == {None: (list(range(10400, 10700)), None)}
    assert ev.training_shown("7") == {None: ([7], None)}
    for bad in ("10699-10400", "x-y", str(tmp_path / "nothing")):
        with pytest.raises(ValueError):
            ev.training_shown(bad)
    # the train.py run played 10420, 10488, 10554 and 10614 as lakes, but 10543 as a Sokoban room: 160 stays
    seen = set().union(*(agent.seen_boards(k, s) for k, (s, _) in shown.items()))
    assert agent.unseen_seeds(key, range(123, 173), seen) == sorted(want + [160])
    # eval.py --unseen: the judge plays the remaining seeds and says how many it dropped, and why
    ev.main(["--device", "cpu", "--model", "tiny", "--env", key, "--val-seed", "123", "--num-seeds", "50", "--no-think",
             "--max-turns", "1", "--max-new-tokens", "4", "--unseen", str(demos), str(run), "10000-10001",
             "--out", str(tmp_path / "ev")])
    said = capsys.readouterr().out
    assert (f"{key}: --unseen drops 5 of 50 seeds: 3 whose board a training episode started on, 2 more whose board "
            "one showed at a later turn; 45 remain") in said and f"| {key} | 45 |" in said, said
    assert [json.loads(l)["seed"] for l in open(tmp_path / "ev" / f"{key}.jsonl")] == [s for s in want if s not in (150, 171)]
    # judged on every seed first, filtered at --paired: the same 45 episodes, token for token (a seed's sampling noise
    # does not depend on the seeds beside it; only prefill_saved, the prompt tokens copied from a batch neighbour,
    # does), and the same drop line
    ev.main(["--device", "cpu", "--model", "tiny", "--env", key, "--val-seed", "123", "--num-seeds", "50", "--no-think",
             "--max-turns", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "all")])
    read = lambda d: {r["seed"]: r for r in map(json.loads, open(tmp_path / d / f"{key}.jsonl"))}
    every, kept = read("all"), read("ev")
    for r in [*every.values(), *kept.values()]:
        del r["stats"]["prefill_saved"]
    assert len(every) == 50 and all(every[s] == r for s, r in kept.items())
    capsys.readouterr()
    ev.main(["--paired", str(tmp_path / "all"), str(tmp_path / "ev"), "--unseen", str(demos), str(run), "10000-10001"])
    said = capsys.readouterr().out
    assert f"{key}: --unseen drops 5 of 50 seeds" in said and f"| {key} | 45 |" in said and "| 0.000 | n/a |" in said, said


@pytest.mark.slow
def test_train_run_then_eval_run_dir_and_plot(tmp_path):
    """A real 2-step tiny train.py run: eval.py loads <run>/hf with the run's flags, --plot draws its curves."""
    run = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--device", "cpu", "--model", "tiny", "--env", "bandit", "--steps", "2",
                        "--num-groups", "2", "--group-size", "2", "--filter-ratio", "1", "--mini-batch-size", "4",
                        "--max-new-tokens", "12", "--max-turns", "2", "--val-groups", "2", "--val-every", "1",
                        "--no-think", "--out", run], capture_output=True, text=True, cwd=HERE, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run_eval("--model", run, "--num-seeds", "2", "--greedy", "--out", str(tmp_path / "ev"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.load(open(tmp_path / "ev" / "summary.json"))
    assert s["args"]["no_think"] is True and s["args"]["max_turns"] == 2 and s["args"]["max_new_tokens"] == 12
    assert s["args"]["greedy"] is True and s["args"]["temperature"] == 0.5  # the run's --val-temperature
    assert set(s["results"]) == {"Bandit", "BanditTest"}  # the run's validation presets
    rec = json.loads(open(tmp_path / "ev" / "Bandit.jsonl").readline())
    assert rec["turns"][0]["raw"].startswith("<answer>")  # no-think mode came from args.json
    r = run_eval("--plot", run)
    assert r.returncode == 0, r.stderr[-3000:]
    png = os.path.join(run, "curves.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("window", [[], ["--max-context-window", "1", "--top-p", "0.9", "--seed", "7", "--no-prefix-sharing"]])
def test_eval_of_a_run_dir_reproduces_its_last_validation(tmp_path, window):
    # eval.py --model <run> samples as the run validated: same seeds, window, top-p, sampling keys (the run's --seed)
    run = str(tmp_path / "run")
    run_train(*TINY, "--env", "frozenlake", "--algo", "grpo", "--steps", "1", "--val-groups", "6", "--val-every", "1",
              "--max-turns", "3", "--val-temperature", "1.0", *window, "--out", run)
    last = read_metrics(run)[-1]
    r = run_eval("--model", run, "--num-seeds", "6", "--out", str(tmp_path / "ev"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.load(open(tmp_path / "ev" / "summary.json"))
    got, a = s["results"]["FrozenLake"], s["args"]
    assert last["val-env/FrozenLake/num_turns"] > 1  # later turns exist, so the window changes what is shown
    for ours, theirs in (("score", "score"), ("success", "success"), ("response_tokens", "response_tokens"),
                         ("turns", "num_turns")):  # the run logs fp32 means
        assert got[ours] == pytest.approx(last[f"val-env/FrozenLake/{theirs}"], rel=1e-6), ours
    assert (a["max_context_window"], a["top_p"], a["sample_seed"], a["no_prefix_sharing"]) == (
        (1, 0.9, 7, True) if window else (-1, 1.0, 10000, False))  # train.py: --seed 10000


def test_plot_hand_written_metrics(tmp_path):
    keys = lambda s: {"step": s, "train/Bandit/success": s / 10, "train/Bandit/score": s / 5 - 0.1,
                      "train/Bandit/response_tokens": 30 - s, "train/Bandit/think_tokens": 0.0,
                      "train/Bandit/format_errors": 0.5, "train/Bandit/num_turns": 1.0,
                      "rollout/in_group_std": 0.4 - s / 50, "rollout/kept_fraction": 0.25, "actor/entropy": 1.0 - s / 20,
                      "actor/grad_norm": 0.3, "critic/explained_variance": s / 10 - 0.2, "warnings": []}
    lines = [keys(s) for s in range(6)]
    lines[0].update({"val-env/Bandit/success": 0.1, "val-env/Bandit/score": 0.0})
    lines.append({"step": 6, "val-env/Bandit/success": 0.6, "val-env/Bandit/score": 0.5})
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    path = ev.plot_run(str(tmp_path))
    assert path == str(tmp_path / "curves.png") and os.path.getsize(path) > 10_000
    # --baseline: reference success rates as horizontal lines on the success panel, labelled
    import matplotlib.figure
    drawn = []
    save = matplotlib.figure.Figure.savefig
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or save(fig, *a, **k))
        ev.main(["--plot", str(tmp_path), "--baseline", "random=0.19", "warm-up=0.15", "--out", str(tmp_path / "b.png")])
    success = drawn[0].axes[0]
    assert success.get_title() == "success rate"
    flat = {l.get_label(): set(l.get_ydata()) for l in success.lines if len(set(l.get_ydata())) == 1}
    assert flat["random: 0.19"] == {0.19} and flat["warm-up: 0.15"] == {0.15}
    ev_panel = [ax for ax in drawn[0].axes if ax.get_title().startswith("critic explained variance")]
    assert len(ev_panel) == 1 and list(ev_panel[0].lines[0].get_ydata()) == pytest.approx([s / 10 - 0.2 for s in range(6)])
    # only panels with data: these metrics have no MI, retrieval or actions-per-turn panel, and no drawn panel is empty
    titles = [ax.get_title() for ax in drawn[0].axes if ax.get_title()]
    assert len(titles) == 10 and not any(t.startswith(("prompt", "actions per turn")) for t in titles)
    assert "collapse warnings per step" in titles  # the steps' warning lists, counted
    assert all(ax.lines for ax in drawn[0].axes if ax.get_title())
    with pytest.raises(SystemExit):
        ev.main(["--plot", str(tmp_path), "--baseline", "random"])


def test_read_metrics_derives_per_turn_rates(tmp_path):
    # per step, format-valid turns and actions per turn are ratios of the logged per-episode means (= of the sums)
    lines = [{"step": s, "train/Fl/num_turns": 2.0, "train/Fl/format_errors": 0.5 * s, "train/Fl/num_actions": 3.0 - s}
             for s in range(3)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    series = ev.read_metrics(str(tmp_path))
    assert series["train/Fl/format_ok_rate"] == ([0, 1, 2], pytest.approx([1.0, 0.75, 0.5]))
    assert series["train/Fl/actions_per_turn"] == ([0, 1, 2], pytest.approx([1.5, 1.0, 0.5]))
    assert any("train/*/actions_per_turn" in patterns for _, patterns in ev.PANELS)


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):  # the library raises; the script says it in one line
        ev.plot_run(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        ev.main(["--plot", str(tmp_path)])
    assert e.value.code == 2 and "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--env", "chess"], "unknown env or preset 'chess'"),
    (["--model", "./no/such/dir", "--env", "bandit"], "no model directory"),
    (["--model", "tiny"], "give --env"),
    (["--env", "bandit"], "give --model"),
    (["--model", "tiny", "--env", "bandit", "--samples", "0"], "--samples"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_bad_input_run_dirs(tmp_path, capsys):
    run = tmp_path / "run"  # a run directory whose run has not saved a checkpoint yet
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"val_env": ["Bandit"]}))
    r = run_eval("--model", str(run))  # through the real entry point: exit code 2, one line, no traceback
    assert r.returncode == 2 and "has no hf/" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    for argv, message in [(["--plot", str(tmp_path)], "no metrics.jsonl"),
                          (["--model", str(tmp_path), "--env", "bandit"], "not a model directory")]:
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err


# ==================================================================================================
# Supervised warm-up (sft.py): demonstrations laid out by the rollout, cross-entropy on the answers
# ==================================================================================================
def demo_rollout(model, tok, key, policy, seeds, think=True, epsilon=0.5, respond_log=None, **over):
    """Demonstrations of one preset through rollout()'s respond hook; respond_log collects (b, answer text)."""
    flags = dict(ev.DEFAULTS, no_think=not think, max_turns=None, max_actions_per_turn=None, max_context=None,
                 max_actions_per_traj=None)
    flags.update(over)
    settings = agent.agent_settings(key, flags)
    cls, _, module = agent.ENV_CLASSES[key]
    envs = [cls(**settings.preset["kwargs"]) for _ in seeds]
    respond = sft.demo_responder(policy, epsilon, seeds, settings, 7, module)
    logged = lambda b, env: respond_log.append((b, respond(b, env))) or respond_log[-1][1]
    out = rollout.rollout(model, tok, envs, seeds, settings, group_size=1,
                          respond=respond if respond_log is None else logged, sampler=sampler.Sampler())
    return out, settings


def test_demonstration_longer_than_the_token_budget_is_refused(tiny):
    model, tok = tiny  # a solver answer with its <think> is far over 4 tokens, which no sampled answer could exceed
    with pytest.raises(ValueError, match="over max_new_tokens 4"):
        demo_rollout(model, tok, "CoordFrozenLakeDet", "solver", [10000], max_new_tokens=4)


@pytest.mark.parametrize("key,think", [("CoordFrozenLakeDet", True), ("SimpleSokoban", False), ("Bandit", True)])
def test_demonstration_is_what_the_sampling_rollout_lays_out(tiny, monkeypatch, key, think):
    # the same answers, once written by respond and once "sampled" (sample_turn forced to emit their tokens):
    # every token, mask bit, turn end, reward and success agree
    model, tok = tiny
    for seed in (10000, 10001, 10002):
        texts = []
        demo, settings = demo_rollout(model, tok, key, "mix", [seed], think=think, respond_log=texts)
        queue = [tok.encode(t, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")] for _, t in texts]

        def forced(model, cache, todo, *a, **k):
            assert len(todo) == 1
            out, stop_at = queue.pop(0), a[-1]  # sample_turn's last argument: where a turn ends (at its tag)
            out = out[:stop_at(out)] if stop_at and stop_at(out) else out
            return [out], [[-1.0] * len(out)]
        monkeypatch.setattr(rollout, "sample_turn", forced)
        cls = agent.ENV_CLASSES[key][0]
        sampled = rollout.rollout(model, tok, [cls(**settings.preset["kwargs"])], [seed], settings, group_size=1)
        monkeypatch.undo()
        assert not queue
        for k in ("tokens", "attention_mask", "loss_mask", "success", "scores"):
            assert torch.equal(demo[k], sampled[k]), (key, seed, k)
        assert demo["turn_ends"] == sampled["turn_ends"] and demo["turn_rewards"] == sampled["turn_rewards"]
        assert demo["stats"]["format_errors"].item() == 0 and demo["stats"]["invalid_actions"].item() == 0


def test_demonstration_mask_covers_exactly_the_answers(tiny):
    # the masked spans, one per turn, decode to the policy's answer, which ends at its closing tag; each follows the
    # forced tag and is followed by the unmasked end-of-turn tokens (forced after the tag, as the sampler cuts)
    model, tok = tiny
    for think in (True, False):
        texts = []
        out, settings = demo_rollout(model, tok, "CoordFrozenLakeDet", "random", [10000, 10001, 10002], think=think,
                                     respond_log=texts)
        forced = "<think>" if think else "<answer>"
        for b in range(3):
            ids, mask = out["tokens"][b].tolist(), out["loss_mask"][b].tolist()
            spans, start = [], None
            for i, m in enumerate(mask + [False]):
                if m and start is None:
                    start = i
                if not m and start is not None:
                    spans.append((start, i))
                    start = None
            mine = [t for c, t in texts if c == b]
            assert len(spans) == len(mine) == len(out["turn_ends"][b]) == int(out["stats"]["num_turns"][b])
            for (s, e), text in zip(spans, mine):
                assert tok.decode(ids[s:e]) == text and text.endswith("</answer>")
                assert tok.decode(ids[:s]).endswith("<|im_start|>assistant\n" + forced)
                assert tok.decode(ids[e:e + 2]) == "<|im_end|>\n"
            assert sum(mask) == sum(e - s for s, e in spans)


def test_demonstration_policies():
    # solver demonstrations win every episode given the turns; random and mixed ones are all valid moves; mix
    # at epsilon 0 is the solver
    model, tok = models.load_model("tiny")
    seeds = list(range(10000, 10008))
    for key in ("CoordFrozenLakeDet", "SimpleSokoban", "Bandit", "Countdown"):
        out, _ = demo_rollout(model, tok, key, "solver", seeds, max_turns=10)
        assert out["success"].all(), key
        for policy in ("random", "mix"):
            ran, _ = demo_rollout(model, tok, key, policy, seeds)
            assert ran["stats"]["invalid_actions"].sum() == 0 and ran["stats"]["format_errors"].sum() == 0, key
        assert torch.equal(demo_rollout(model, tok, key, "mix", seeds, epsilon=0.0, max_turns=10)[0]["tokens"], out["tokens"])


def run_sft(*flags, torchrun=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] if torchrun else [sys.executable]
    return subprocess.run(cmd + [os.path.join(HERE, "sft.py"), "--device", "cpu", "--dtype", "fp32", *flags], capture_output=True, text=True,
                          cwd=HERE, env=train_env(), timeout=600)


def sft_main(capsys, *flags):
    """sft.main in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    code = 0
    try:
        sft.main(["--device", "cpu", "--dtype", "fp32", *flags])
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    return code, said.out, said.err


def test_sft_stops_at_the_compute_of_the_run_it_controls(tmp_path, capsys):
    """--compute-tokens N: the supervised control matched in work to an RL run (its work/compute_tokens_total): sft.py
    stops after the first step whose compute tokens (forward + 2 x backward) reach N, logs and saves there, and says
    so; a target its demonstrations cannot reach stops at the last step and says that."""
    flags = ["--model", "tiny", "--env", "CoordFrozenLakeDet", "--policy", "solver", "--no-think", "--episodes", "32",
             "--batch-size", "4", "--heldout", "0", "--eval-every", "1"]
    code, out, err = sft_main(capsys, *flags, "--out", str(tmp_path / "all"))
    every = [m["compute_tokens"] for m in map(json.loads, open(tmp_path / "all" / "sft_metrics.jsonl"))]  # steps 0..8
    target = (every[3] + every[4]) // 2                                      # reached in step 4
    code, out, err = sft_main(capsys, *flags, "--compute-tokens", str(target), "--save-every", "100",
                              "--out", str(tmp_path / "matched"))
    lines = [json.loads(l) for l in open(tmp_path / "matched" / "sft_metrics.jsonl")]
    assert code == 0 and [m["step"] for m in lines] == [0, 1, 2, 3, 4] and lines[-1]["compute_tokens"] == every[4]
    assert f"reached --compute-tokens {target} at step 4 ({every[4]} compute tokens)" in out
    assert os.path.isdir(tmp_path / "matched" / "step4") and not os.path.exists(tmp_path / "matched" / "step8")
    assert json.load(open(tmp_path / "matched" / "sft.json"))["steps"] == 4
    code, out, err = sft_main(capsys, *flags, "--compute-tokens", str(target), "--resume", "--out",
                              str(tmp_path / "matched"))                 # a resume of a run that reached it: no step
    assert code == 0 and [json.loads(l)["step"] for l in open(tmp_path / "matched" / "sft_metrics.jsonl")][-1] == 4
    code, out, err = sft_main(capsys, *flags, "--compute-tokens", str(every[-1] + 1), "--out", str(tmp_path / "short"))
    assert code == 0 and f"--compute-tokens {every[-1] + 1} not reached: {every[-1]} compute tokens in 8 steps" in out


def test_sft_loss_falls(tmp_path, capsys):
    code, out, err = sft_main(capsys, "--model", "tiny", "--env", "CoordFrozenLakeDet", "--policy", "solver", "--episodes",
                              "8", "--steps", "8", "--lr", "3e-3", "--out", str(tmp_path / "sft"), "--max-turns", "3")
    assert code == 0, out + err
    losses = [float(l.split("loss ")[1].split()[0]) for l in out.splitlines() if l.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    assert "success 8/8" in out


@pytest.mark.slow
def test_sft_output_loads_in_eval_and_train(tmp_path, capsys):
    out = str(tmp_path / "sft")
    assert sft_main(capsys, "--model", "tiny", "--env", "CoordFrozenLakeDet", "--episodes", "4", "--steps", "1",
                    "--out", out)[0] == 0
    ev.main(["--device", "cpu", "--model", out, "--env", "CoordFrozenLakeDet", "--num-seeds", "2", "--max-new-tokens", "8",
             "--max-turns", "2", "--out", str(tmp_path / "eval")])
    assert "| CoordFrozenLakeDet | 2 |" in capsys.readouterr().out
    run_train("--model", out, "--env", "CoordFrozenLakeDet", "--steps", "1", "--num-groups", "2", "--group-size", "2",
              "--mini-batch-size", "4", "--filter-ratio", "1", "--max-new-tokens", "8", "--max-turns", "2",
              "--val-every", "0", "--collapse-every", "0", "--log-trajectories-every", "0", "--out", str(tmp_path / "ppo"))


def test_sft_lora_and_top_layers_train_what_they_say(tmp_path, capsys):
    base = models.load_model("tiny")[0].state_dict()
    for flags in (["--train-layers", "1"], ["--lora-rank", "4", "--lora-alpha", "8"]):
        out = str(tmp_path / flags[0].strip("-"))
        code, said, err = sft_main(capsys, "--model", "tiny", "--env", "bandit", "--episodes", "4", "--steps", "2",
                                   "--lr", "1e-2", "--save-every", "2", "--out", out, *flags)
        assert code == 0, said + err
        sd = models.load_model(out)[0].state_dict()
        step2 = models.load_model(os.path.join(out, "step2"))[0].state_dict()  # the checkpoint's export: the same
        assert all(torch.equal(sd[k], step2[k]) for k in sd)
        changed = {k for k in base if not torch.equal(base[k], sd[k])}
        if flags[0] == "--train-layers":  # layer 1 (the top one) and the final norm only
            assert changed and all(k.startswith("model.layers.1.") or k == "model.norm.weight" for k in changed), changed
        else:  # merged LoRA: the adapted Linears of both layers, never the embedding or the norms
            assert any(".layers.0." in k for k in changed) and not any("norm" in k or "embed" in k for k in changed), changed


def test_sft_flags(capsys):
    code, out, _ = sft_main(capsys, "--help")
    assert code == 0 and all(p in out for p in ("random", "solver", "mix", "--epsilon"))
    for flags, said in ((["--epsilon", "2"], "--epsilon"), (["--env", "nope"], "unknown env"),
                        (["--train-layers", "1", "--lora-rank", "2"], "give one"), (["--batch-size", "0"], "positive"),
                        (["--train-layers", "9"], "has 2 layers"), (["--heldout-seed", "10001"], "overlap"),
                        (["--heldout-seed", "300"], "overlap"), (["--eval-every", "-1"], ">= 0")):
        code, _, err = sft_main(capsys, "--model", "tiny", "--episodes", "2", "--steps", "1", "--out", "/nonexistent/x", *flags)
        assert code == 2 and said in err and err.count("\n") == 1, (flags, err)


def test_sft_loss_shared_prefix_equals_plain():
    # the rows' common prefix (the system message and the start of the first user message) run once: the same summed
    # loss and the same gradients as every row run in full
    model, tok = models.load_model("tiny")
    settings = agent.agent_settings("CoordFrozenLakeDet", dict(no_think=True, max_turns=3, sample_seed=0))
    rows, _ = sft.demonstrations(model, tok, "CoordFrozenLakeDet", "mix", 0.5, list(range(10000, 10005)), settings, 7)
    tokens, attn, mask = rollout.pack_rows(rows, tok.pad_token_id)[:3]
    assert int((tokens == tokens[:1]).all(0).long().argmin()) > 100  # a long shared prefix, then the rows differ
    got = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        loss = sft.sft_loss(model, tokens, attn, mask, share_prefix=share) / mask[:, 1:].sum()
        loss.backward()
        got.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, g_plain), (shared, g_shared) = got
    assert shared == pytest.approx(plain, rel=1e-5, abs=1e-5)
    assert all(torch.allclose(g_shared[n], g_plain[n], rtol=1e-5, atol=1e-5) for n in g_plain)


def test_sft_micro_batches_take_the_same_step(tmp_path, capsys):
    # --micro-batch-size splits a rank's batch for memory: the same token-mean loss, gradients and weights
    from safetensors.torch import load_file
    flags = ["--model", "tiny", "--env", "sokoban", "--policy", "random", "--episodes", "5", "--batch-size", "5",
             "--steps", "2", "--lr", "1e-3", "--heldout", "3"]
    runs = {m: str(tmp_path / f"micro{m}") for m in ("0", "2")}
    for m, out in runs.items():
        assert sft_main(capsys, *flags, "--micro-batch-size", m, "--out", out)[0] == 0
    a, b = (json.load(open(os.path.join(d, "sft.json")))["final_loss"] for d in runs.values())
    assert a == pytest.approx(b, rel=1e-5)
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in runs.values())
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)


def test_sft_heldout_loss_is_logged(tmp_path, capsys):
    # sft_metrics.jsonl: step 0, every --eval-every steps and the end; the held-out loss is the token mean of the
    # demonstrations on seeds --heldout-seed.., here checked at step 0 against the untrained model
    out = str(tmp_path / "sft")
    code, said, err = sft_main(capsys, "--model", "tiny", "--env", "CoordFrozenLakeDet", "--no-think", "--max-turns", "2",
                               "--episodes", "4", "--heldout", "3", "--heldout-seed", "7000", "--batch-size", "2",
                               "--steps", "3", "--eval-every", "2", "--lr", "3e-3", "--out", out)
    assert code == 0, said + err
    ms = [json.loads(l) for l in open(os.path.join(out, "sft_metrics.jsonl"))]
    assert [m["step"] for m in ms] == [0, 2, 3] and [m["demos_seen"] for m in ms] == [0, 4, 6]
    assert ms[0]["train_loss"] is None and all(m["train_loss"] > 0 and m["seconds"] >= 0 for m in ms[1:])
    model, tok = models.load_model("tiny")
    settings = agent.agent_settings("CoordFrozenLakeDet", dict(no_think=True, max_turns=2, sample_seed=0))
    rows, _ = sft.demonstrations(model, tok, "CoordFrozenLakeDet", "solver", 0.5, [7000, 7001, 7002], settings, 10000)
    tokens, attn, mask = rollout.pack_rows(rows, tok.pad_token_id)[:3]
    with torch.no_grad():
        want = sft.sft_loss(model, tokens, attn, mask).item() / mask[:, 1:].sum().item()
    assert ms[0]["heldout_loss"] == pytest.approx(want, rel=1e-5)
    assert ms[-1]["heldout_loss"] < ms[0]["heldout_loss"]
    assert "seeds 7000..7002" in said and said.count("held-out loss") == 3
    # the work: steps 1-2 trained the 4 demonstrations once (one epoch), step 3 two of them again; each token has a
    # forward and a backward (train.py's work/* count)
    rows, _ = sft.demonstrations(model, tok, "CoordFrozenLakeDet", "solver", 0.5, list(range(10000, 10004)), settings, 10000)
    once = sum(len(r[1]) for r in rows)
    assert ms[1]["forward_tokens"] == ms[1]["backward_tokens"] == once and ms[1]["compute_tokens"] == 3 * once
    assert once < ms[2]["forward_tokens"] < 2 * once and ms[0]["forward_tokens"] == 0


def test_sft_heldout_boards_are_not_training_boards(tmp_path, capsys):
    # --heldout takes the seeds from --heldout-seed on whose board no training demonstration shows: of 5045..5049,
    # 5047 shows a lake of training seeds 10000..10127 (found by resetting both ranges), so it is skipped
    key = "CoordFrozenLakeDet"
    env = FrozenLakeEnv(**FROZENLAKE_PRESETS[key]["kwargs"])
    assert env.reset(5047) in {env.reset(s) for s in range(10000, 10128)}
    assert sft.heldout_seeds(key, 5045, 4, range(10000, 10128)) == ([5045, 5046, 5048, 5049], 1)
    assert sft.heldout_seeds(key, 5045, 2, range(10000, 10128)) == ([5045, 5046], 0)
    # Cue has two boards (cue Q or Z), both among any few demonstrations: no held-out board exists, so no held-out loss
    assert sft.heldout_seeds("Cue", 5000, 3, range(10000, 10008))[0] == []
    out = str(tmp_path / "sft")
    code, said, err = sft_main(capsys, "--model", "tiny", "--env", "Cue", "--no-think", "--episodes", "8", "--heldout",
                               "3", "--batch-size", "4", "--steps", "1", "--out", out)
    assert code == 0, said + err
    assert "Cue: no held-out demonstrations" in said and "held-out loss" not in said
    assert [json.loads(l)["heldout_loss"] for l in open(os.path.join(out, "sft_metrics.jsonl"))] == [None, None]


@pytest.mark.parametrize("part", [[], ["--lora-rank", "4", "--lora-alpha", "8"]])
def test_sft_resume_reproduces_the_uninterrupted_run(tmp_path, capsys, monkeypatch, part):
    # a run killed while writing its step-3 checkpoint resumes from step 2 and ends as the uninterrupted run: the
    # same metrics lines, final loss and weights (epochs of 3 demonstrations cut across batches of 2, so the
    # not-yet-used order is carried); step<N>/ directories load; a finished run resumed again changes nothing.
    # Every weight trained, or a LoRA adapter (the checkpoint holds the adapter, step<N>/ the merged model)
    from safetensors.torch import load_file
    flags = ["--model", "tiny", "--env", "CoordFrozenLakeDet", "--policy", "mix", "--no-think", "--max-turns", "2",
             "--episodes", "3", "--heldout", "2", "--batch-size", "2", "--steps", "4", "--lr", "3e-3",
             "--eval-every", "1", "--save-every", "1", *part]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert sft_main(capsys, *flags, "--out", straight)[0] == 0
    real_save, calls = torch.save, []

    def dying_save(obj, f, *a, **k):  # the third checkpoint (step 3) dies half-written
        calls.append(1)
        if len(calls) == 3:
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        sft_main(capsys, *flags, "--out", killed)
    monkeypatch.undo()
    capsys.readouterr()
    assert torch.load(os.path.join(killed, "ckpt.pt"), weights_only=False)["step"] == 2
    code, said, err = sft_main(capsys, *flags, "--out", killed, "--resume")
    assert code == 0 and "resuming from step 2" in said, said + err
    read = lambda d: [{k: v for k, v in json.loads(l).items() if k != "seconds"} for l in open(os.path.join(d, "sft_metrics.jsonl"))]
    a, b = read(straight), read(killed)
    assert [m["step"] for m in b] == [0, 1, 2, 3, 4] and len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], abs=1e-6) for k in x), (x, y)
    final = lambda d: json.load(open(os.path.join(d, "sft.json")))["final_loss"]
    assert final(straight) == pytest.approx(final(killed), abs=1e-6)
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (straight, killed))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)
    assert sorted(d for d in os.listdir(killed) if d.startswith("step")) == ["step1", "step2", "step3", "step4"]
    step4 = models.load_model(os.path.join(killed, "step4"))[0].state_dict()
    assert all(torch.equal(step4[k], wb[k]) for k in wb)
    code, said, err = sft_main(capsys, *flags, "--out", killed, "--resume")  # finished: nothing left to train
    assert code == 0 and "resuming from step 4" in said and read(killed) == b, said + err
    for more, why in ((["--out", killed], "--resume"), (["--out", killed, "--resume", "--lr", "1e-3"], "--lr"),
                      (["--resume"], "--out")):
        code, _, err = sft_main(capsys, *flags, *more)
        assert code == 2 and why in err and err.count("\n") == 1, (more, err)
    fresh = str(tmp_path / "fresh")  # --resume with nothing saved yet starts at step 0
    code, said, err = sft_main(capsys, *flags, "--out", fresh, "--resume", "--steps", "1")
    assert code == 0 and "step 1/1" in said and "resuming" not in said, said + err


def test_eval_solver_agreement_replays_the_episodes(tiny, tmp_path, capsys):
    # per turn: the first action against the solver's at the state the turn was played in (taken here inside the
    # rollout, by a spy on respond): solver demonstrations agree on every turn, random ones on some; a replay that
    # ends otherwise than its episode is an error; eval.py --agreement puts the fraction in its table and JSON
    model, tok = tiny
    key, seeds = "CoordFrozenLakeDet", list(range(10000, 10008))
    settings = agent.agent_settings(key, dict(ev.DEFAULTS, no_think=True, max_turns=4, max_actions_per_turn=2))
    cls, _, module = agent.ENV_CLASSES[key]
    for policy in ("solver", "random"):
        respond, truth = sft.demo_responder(policy, 0.5, seeds, settings, 7, module), [[] for _ in seeds]

        def spy(b, env):
            plan, text = module.solver_actions(env, 1), respond(b, env)
            truth[b].append(text.split()[0].lower() == plan[0].lower())
            return text
        out = rollout.rollout(model, tok, [cls(**settings.preset["kwargs"]) for _ in seeds], seeds, settings, group_size=1,
                              respond=spy, sampler=sampler.Sampler())
        assert ev.solver_agreement(out, key, settings, seeds, 1) == truth
        turns = [t for ts in truth for t in ts]
        assert all(turns) if policy == "solver" else 0 < sum(turns) < len(turns)
    out["success"][0] = not out["success"][0]
    with pytest.raises(RuntimeError, match="replay"):
        ev.solver_agreement(out, key, settings, seeds, 1)
    ev.main(["--device", "cpu", "--model", "tiny", "--env", key, "--num-seeds", "2", "--max-new-tokens", "8",
             "--max-turns", "2", "--no-think", "--agreement", "--out", str(tmp_path / "eval")])
    assert "solver_agreement |" in capsys.readouterr().out
    recs = [json.loads(l) for l in open(tmp_path / "eval" / f"{key}.jsonl")]
    turns = [t for r in recs for t in r["solver_agreement"]]
    assert len(turns) == sum(len(r["turns"]) for r in recs)
    row = json.load(open(tmp_path / "eval" / "summary.json"))["results"][key]
    assert row["solver_agreement"] == pytest.approx(sum(turns) / len(turns))


@pytest.mark.slow
def test_sft_two_ranks_gloo(tmp_path):
    # 2 ranks take the global token mean, as one process does: the same loss and weights, whatever the split of
    # tokens between the ranks (Sokoban episodes differ in length); each rank's 3 episodes in micro-batches of 2 and 1
    # (DDP syncs on the last)
    from safetensors.torch import load_file
    one, two = str(tmp_path / "one"), str(tmp_path / "ddp")
    flags = ["--model", "tiny", "--env", "sokoban", "--policy", "random", "--episodes", "6", "--batch-size", "6",
             "--steps", "2", "--lr", "1e-3"]
    r = run_sft(*flags, "--out", one)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = run_sft(*flags, "--micro-batch-size", "2", "--out", two, torchrun=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 rank(s)" in r.stdout
    a, b = (json.load(open(os.path.join(d, "sft.json")))["final_loss"] for d in (one, two))
    assert a == pytest.approx(b, rel=1e-5)
    ha, hb = ([json.loads(l)["heldout_loss"] for l in open(os.path.join(d, "sft_metrics.jsonl"))] for d in (one, two))
    assert len(ha) == 2 and ha == pytest.approx(hb, rel=1e-5)  # 64 held-out demonstrations split over the ranks
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (one, two))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)


# ==================================================================================================
# Learning tests: the tiny random model learns Cue (env_cue.py), and stops learning under a planted fault
# ==================================================================================================
def test_cue_rules_hand_worked():
    env = env_cue.CueEnv(letters="QZ", turns=2, repeat=3)
    seed = next(s for s in range(100) if random.Random(s).choice("QZ") == "Z")
    assert env.reset(seed) == env.render() == "cue ZZZ" and env.actions() == ["Q", "Z"]
    assert env.step("go") == ("cue ZZZ", 0.0, False, dict(action_is_valid=False, action_is_effective=False, success=False))
    assert env.step(" z ") == ("wait", 0.0, False, dict(action_is_valid=True, action_is_effective=True, success=False))
    assert env.actions() == ["go"] and env.step("Z")[3]["action_is_valid"] is False  # turn 2: only go
    assert env.step("GO") == ("Z: 1.0 points", 1.0, True, dict(action_is_valid=True, action_is_effective=True, success=True))
    assert env.step("go") == ("Z: 1.0 points", 0.0, True, dict(action_is_valid=False, action_is_effective=False, success=True))
    env.reset(seed)  # the wrong letter at turn 1: nothing until the last turn, then 0
    assert env.step("Q")[1:3] == (0.0, False) and env.step("go") == ("Q: 0.0 points", 0.0, True, dict(
        action_is_valid=True, action_is_effective=True, success=False))
    one = env_cue.CueEnv(**env_cue.PRESETS["Cue"]["kwargs"])
    assert one.reset(seed) == "cue " + "Z" * 32 and one.step("Z")[1:3] == (1.0, True)
    for bad in (dict(letters="Q"), dict(letters="qz"), dict(turns=0), dict(repeat=0)):
        with pytest.raises(ValueError):
            env_cue.CueEnv(**bad)


def test_cue_protocol_determinism_and_garbage():
    assert {"kwargs", "instruction", "max_actions_per_traj", "max_tokens", "max_turns", "max_actions_per_turn"} == \
        set(env_cue.PRESETS["Cue"]) == set(env_cue.PRESETS["CueDelay"])
    assert agent.preset_name("cuedelay") == "CueDelay" and agent.ENV_CLASSES["Cue"][0] is env_cue.CueEnv
    code = "import sys, env_cue; bad = {'torch', 'numpy', 'transformers'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE)
    for name, preset in env_cue.PRESETS.items():
        a, b = env_cue.CueEnv(**preset["kwargs"]), env_cue.CueEnv(**preset["kwargs"])
        for seed in range(20):
            assert a.reset(seed) == b.reset(seed)
            rng = random.Random(seed)
            for _ in range(4):
                action = rng.choice(a.actions() + ["junk", "", None, 3, "Q Z", "\ud800", "x" * 10_000])
                assert a.step(action) == b.step(action)
        obs = a.reset(0)
        for junk in ("", "QZ", "<answer> Q </answer>", None, 3, b"Q", ["Q"], "\ud800", "go"):
            assert a.step(junk) == (obs, 0.0, False, dict(action_is_valid=False, action_is_effective=False, success=False))


def test_cue_needs_the_observation_and_its_scripted_policies():
    # a state-blind policy (the same answer whatever the cue) wins about half the time; the solver always; random
    # answers are always valid
    env, seeds = env_cue.CueEnv(**env_cue.PRESETS["CueDelay"]["kwargs"]), range(10_000, 12_000)
    blind = {c: 0 for c in "QZ"}
    for seed in seeds:
        for c in blind:
            env.reset(seed)
            env.step(c)
            blind[c] += env.step("go")[3]["success"]
    assert sum(blind.values()) == len(seeds) and all(abs(n / len(seeds) - 0.5) < 0.03 for n in blind.values()), blind
    rng = random.Random(0)
    for seed in seeds[:200]:
        for policy in ("solver", "random"):
            env.reset(seed)
            while not env.done:
                action = env_cue.solver_actions(env, 1) if policy == "solver" else env_cue.random_actions(env, 1, rng)
                info = env.step(action[0])[3]
                assert info["action_is_valid"]
            assert info["success"] or policy == "random"


# Learning runs: train.py from the warm start (cue_start), validated on the same seeds (123...) before the first step
# and after the last, sampling at temperature 1 (the policy being trained). Cue has two states (the cue Q or Z) and
# training plays both, so what the validation measures is training-distribution success: that the policy learned,
# not that it generalizes. The margin is in standard errors of the difference of two success rates over CUE_SEEDS
# episodes each; the measured rises are 7 to 8.5 of them. Each learning test asserts two things, each of which can
# fail alone: the start is above 1/2 (the warm start reads the cue; a state-blind policy wins 1/2), and the rise is
# over CUE_MARGIN standard errors (the estimator learns). "The end is past 1/2 by CUE_MARGIN standard errors" follows
# from the two (end - 1/2 = rise + (start - 1/2), and the standard error about 1/2 exceeds the one about start by at
# most (start - 1/2) / sqrt(CUE_SEEDS), times CUE_MARGIN still under start - 1/2), so it is not asserted
CUE_SEEDS, CUE_MARGIN = 512, 4
CUE_RUN = ["--no-think", "--max-new-tokens", "16", "--num-groups", "8", "--group-size", "8", "--filter-ratio", "1",
           "--mini-batch-size", "64", "--micro-batch-size", "32", "--lr", "1e-3", "--critic-lr", "1e-3",
           "--val-groups", str(CUE_SEEDS), "--val-temperature", "1.0", "--collapse-every", "0",
           "--log-trajectories-every", "0"]
# Planted faults, run by sitecustomize in train.py's process before it starts. CUE_FAULT=<name> in the environment
# plants one in every learning run, by hand: the tests it concerns then fail (sign, logits: all of them; turn: PPO on
# CueDelay; last_turn: CueDelay). test_cue_flipped_advantage_sign_unlearns keeps "sign" in the suite
CUE_FAULTS = {
    # every advantage negated: GAE's (PPO) and the group estimators'
    "sign": ("import starpo\n_gae, _group = starpo.gae_advantages, starpo.group_advantages\n"
             "def gae(*a, **k):\n    adv, returns = _gae(*a, **k)\n    return -adv, returns\n"
             "starpo.gae_advantages, starpo.group_advantages = gae, lambda *a, **k: -_group(*a, **k)\n"),
    # the loss's log-probs one position off: token t scored by the logits at t (which predict token t + 1). (The loss
    # mask itself moved one token over a contiguous answer drops its first token and adds the forced one after it:
    # the answer letter stays in the loss, and the run learns as well, measured 0.76 to 0.93 on Cue with GRPO)
    "logits": ("import starpo\n"
               "def token_logprobs(model, tokens, attention_mask, temperature=1.0, with_entropy=False, mask=None, **k):\n"
               "    lp = (model(input_ids=tokens, attention_mask=attention_mask.long()).logits.float() / temperature).log_softmax(-1)\n"
               "    keep = (attention_mask if mask is None else mask).float()\n"
               "    ent = -(lp.exp() * lp).sum(-1) * keep if with_entropy else None\n"
               "    return lp.gather(-1, tokens[..., None])[..., 0] * keep, ent\n"
               "starpo.token_logprobs = token_logprobs\n"),
    # PPO: an earlier turn's value target and advantage from its own turn's reward (0), not the episode's return
    "turn": ("import starpo, torch\n_gae = starpo.gae_advantages\n"
             "def gae(rewards, values, mask, gamma=1.0, lam=1.0):\n"
             "    adv, returns = _gae(rewards, values, mask, gamma, lam)\n"
             "    m = mask.bool()\n"
             "    turn = torch.cumsum((m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]).long(), 1)  # [B, T] answer span\n"
             "    early = m & (turn < turn.max(1, keepdim=True).values)\n"
             "    return torch.where(early, -values, adv), torch.where(early, 0.0, returns)\n"
             "starpo.gae_advantages = gae\n"),
    # the advantage kept on the last turn's tokens only
    "last_turn": ("import starpo, torch\n_loss = starpo.policy_loss\n"
                  "def policy_loss(logp, old, adv, mask, *a, **k):\n"
                  "    m = mask.bool()\n"
                  "    turn = torch.cumsum((m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]).long(), 1)  # [B, T]\n"
                  "    return _loss(logp, old, adv * (turn == turn.max(1, keepdim=True).values), mask, *a, **k)\n"
                  "starpo.policy_loss = policy_loss\n"),
}


@pytest.fixture(scope="session")
def cue_start(tmp_path_factory):
    """A weak observation-conditioned policy of the tiny random model on Cue and CueDelay, from two short SFT runs on
    mixed demonstrations (built once per test session, shared by xdist workers through a lock). 100 steps with one
    turn in 4 played at random build what reads the cue: the model then answers the cue on nearly every well-formed
    turn. 40 steps at a tenth of the learning rate with half the turns at random bring it near what those teach (the
    cue on 3 turns in 4): training-distribution success at temperature 1 about 0.8 on Cue and 0.75 on CueDelay (from 4
    demonstration seeds: 0.76 to 0.81 and 0.74 to 0.77; a state-blind policy: 0.5), which leaves room to learn. A
    single run on half-random turns does not start reading the cue within 200 steps; RL from that state-blind
    policy sharpens whichever answer it prefers, and learns nothing of the cue."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist: the session's directory, above the workers' own
        root = root.parent
    weak = root / "cue-start" / "weak"
    with FileLock(str(root / "cue-start.lock")):
        if not (weak / "config.json").exists():
            mixed = ["--env", "Cue", "CueDelay", "--policy", "mix", "--no-think", "--episodes", "256", "--batch-size", "16"]
            for model, eps, steps, lr, out in (("tiny", "0.25", "100", "3e-3", "sharp"), ("sharp", "0.5", "40", "3e-4", "weak")):
                model = model if model == "tiny" else str(root / "cue-start" / model)
                r = run_sft(*mixed, "--model", model, "--epsilon", eps, "--steps", steps, "--lr", lr,
                            "--out", str(root / "cue-start" / out))
                assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return str(weak)


def cue_run(model, out, preset, algo, steps, fault=None):
    """Training-distribution success (start, end) of train.py --algo algo on `preset` from `model`, on the validation
    seeds before the first step and after the last; fault: a CUE_FAULTS name planted in train.py's process (default: $CUE_FAULT, else none)."""
    fault, env = fault or os.environ.get("CUE_FAULT"), None
    if fault:
        site = out + "-site"
        os.makedirs(site)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(CUE_FAULTS[fault])
        env = dict(PYTHONPATH=os.pathsep.join([site, HERE]))
    run_train(*CUE_RUN, "--model", model, "--env", preset, "--algo", algo, "--steps", str(steps), "--val-every", str(steps),
              "--out", out, env=env)
    val = [m[f"val-env/{preset}/success"] for m in read_metrics(out) if f"val-env/{preset}/success" in m]
    assert len(val) == 2, val
    return val[0], val[1]


def standard_errors(start, end, n=CUE_SEEDS):
    """end - start in standard errors of the difference of two success rates, each over n episodes."""
    return (end - start) / max(math.sqrt((start * (1 - start) + end * (1 - end)) / n), 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_cue_learning_raises_training_distribution_success(tmp_path, cue_start, algo):
    # the right answer is the letter the state shows, so no state-blind policy beats 1/2: 8 steps of each estimator
    # raise training-distribution success by more than CUE_MARGIN standard errors from a start above 1/2, so past 1/2
    # by as many (measured: 0.76 to 0.94, 0.93, 0.93 for ppo, grpo, rloo: 8.5, 7.4, 7.8 standard errors)
    start, end = cue_run(cue_start, str(tmp_path / "run"), "Cue", algo, 8)
    said = f"training-distribution success {start:.3f} -> {end:.3f}"
    assert start > 0.5, f"the warm start does not read the cue: {said}"  # catches a broken cue_start
    assert standard_errors(start, end) > CUE_MARGIN, f"no rise of {CUE_MARGIN} standard errors: {said}"  # no learning


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_cue_delay_credit_travels_back_across_turns(tmp_path, cue_start, algo):
    # CueDelay: the cue shows at turn 1, the one reward comes after turn 2's "go" and depends only on turn 1's
    # answer, so turn 1 learns only if the credit reaches it (measured: 0.74 to 0.91 in 8 steps for both, 7.6 and 7.2
    # standard errors; with turn 1's targets from its own turn, fault "turn", PPO gets 0.77)
    start, end = cue_run(cue_start, str(tmp_path / "run"), "CueDelay", algo, 8)
    said = f"training-distribution success {start:.3f} -> {end:.3f}"
    assert start > 0.5, f"the warm start does not read the cue: {said}"  # catches a broken cue_start
    assert standard_errors(start, end) > CUE_MARGIN, f"no rise of {CUE_MARGIN} standard errors: {said}"  # no credit


@pytest.mark.slow
def test_cue_flipped_advantage_sign_unlearns(tmp_path, cue_start):
    # the planted fault the learning tests must catch, kept where it is cheap: with every advantage negated, 4 steps of
    # the same GRPO run drive success down by more than CUE_MARGIN standard errors (measured: 0.76 to 0.46, 10 of
    # them; to 0.04 in 8 steps)
    start, end = cue_run(cue_start, str(tmp_path / "run"), "Cue", "grpo", 4, fault="sign")
    assert standard_errors(start, end) < -CUE_MARGIN, f"training-distribution success {start:.3f} -> {end:.3f}"
