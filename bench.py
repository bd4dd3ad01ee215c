"""Performance measurements, printed side by side from one run. One function per measurement.

  python bench.py                                  # CPU: smollm2, batch 32: our sampler vs HF generate, KV reuse vs re-prefill
  python bench.py --only sampler --batch 8 --new-tokens 32
  python bench.py --only envs                      # reset / step medians of every env preset
  python bench.py --only logprobs --batch 4 --turns 3 --turn-tokens 24    # the update's lm_head: sampled tokens only
  python bench.py --only step --threads 2 --repeats 2   # one multi-turn PPO train.py step by phase (--against DIR: vs another checkout)
  python bench.py --only cut --batch 32 --turns 3 --turn-tokens 48   # turns cut at </answer> vs run to a stop token
  python bench.py --device cuda --model qwen2.5-0.5b-random --batch 128 --prompt-len 1024   # GPU: + bandwidth floor
  python bench.py --gpu-check                      # first thing on a GPU machine: PASS / FAIL per line, exit 1 on a FAIL
  python bench.py --only prefill --repeats 5       # prefill shapes rounded up (sampler.PREFILL_MULTIPLE) vs exact lengths
  python bench.py --plan --markdown                # results/README.md's memory-plan tables (the suite compares them)

"qwen2.5-0.5b-random" is a random-weight model with the Qwen2.5-0.5B shape (speed only, no tokenizer).
"""
import argparse
import contextlib
import copy
import models
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import agent
import rollout
import sampler
import starpo


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def first_turn_prompts(tok, batch):
    """RAGEN first-turn Sokoban prompts for seeds 0..batch-1, made ragged by dropping i % 9 tokens."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    head, gen, _, _ = rollout.chat_pieces(tok)
    prompts = []
    for i in range(batch):
        env = SokobanEnv(**preset["kwargs"])
        user = preset["instruction"] + rollout.turn_prompt(preset, 1, env.reset(i), preset["max_actions_per_traj"], True)
        ids = tok.encode(head + user + gen + rollout.THINK_OPEN, add_special_tokens=False)
        cut = len(tok.encode(head, add_special_tokens=False))
        prompts.append(ids[:cut] + ids[cut + i % 9:])
    return prompts


def interleaved(fns, repeats, device="cpu"):
    """Time every callable of fns ({name: fn}) `repeats` times, alternating between them (A B A B ...), so that a
    change in the machine's load hits every side alike. Returns ({name: [seconds]}, {name: last result})."""
    times, results = {name: [] for name in fns}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            results[name] = fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return times, results


def spread(ts):
    """'min 12.30 s, spread 1.08x' over the repeats of one side (spread = max / min)."""
    return f"min {min(ts):7.2f} s, spread {max(ts) / min(ts):4.2f}x"


def ratio(slow, fast):
    """Speed-up of `fast` over `slow` from the minima of interleaved repeats, with each side's spread."""
    return (f"{min(slow) / min(fast):.2f}x (min over min; spreads {max(slow) / min(slow):.2f}x / "
            f"{max(fast) / min(fast):.2f}x over {len(slow)} / {len(fast)} repeats)")


def matmul_peak(device, n=2048, reps=5):
    """FLOP/s of the best of `reps` fp32 [n, n] @ [n, n] matmuls: the compute peak the floors below are written against."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms up
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def time_ours_vs_hf(model, prompts, new_tokens, device, pad_id=0, repeats=3):
    """Same prompts, same settings (T=1, top-p 1, no top-k, exactly new_tokens per row), interleaved repeats of
    ours (prefix-shared prefill), ours with every prompt prefilled in full, and HF generate. The compute floor:
    the matmul FLOPs of the linear layers (2 x parameters without the embedding, per token through the trunk; the
    lm_head once per sampled token), at the measured fp32 matmul peak."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)   # [B, L] left-padded for HF
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)

    def ours(n, share=True):
        return sampler.generate(model, prompts, n, stop_ids=(), temperature=1.0, seed=0, share_prefixes=share)

    def hf(n):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
    for fn in (ours, hf):  # warm-up (and, on CUDA, compilation / graph capture for the short and the full run)
        fn(4)
        if torch.device(device).type == "cuda":
            fn(new_tokens)
    times, _ = interleaved({"ours": lambda: ours(new_tokens), "ours, no prefix sharing": lambda: ours(new_tokens, False),
                            "hf_generate": lambda: hf(new_tokens)}, repeats, device)
    embed = model.model.embed_tokens.weight.numel()
    trunk = sum(p.numel() for p in model.model.parameters()) - embed                # linear layers + norms
    head = model.lm_head.weight.numel()
    prompt_tok, saved = sum(map(len, prompts)), sum(sampler.shared_prefixes(prompts)[1])
    flops = {"ours": 2 * trunk * (prompt_tok - saved + B * new_tokens) + 2 * head * B * new_tokens}
    flops["ours, no prefix sharing"] = flops["hf_generate"] = flops["ours"] + 2 * trunk * saved
    peak = matmul_peak(device)
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s (fp32 2048^2, best of 5); prompts {prompt_tok} tok, "
          f"{saved} of them shared ({saved / prompt_tok:.0%}, copied instead of computed)")
    for name, ts in times.items():
        floor = flops[name] / peak
        print(f"{name:24s} batch {B}  prompt {min(map(len, prompts))}-{L} tok  {new_tokens} new/row  {spread(ts)}  "
              f"{B * new_tokens / min(ts):7.1f} tok/s  floor {floor:6.2f} s ({floor / min(ts):.0%} of the peak)")
    print(f"speed-up ours over hf_generate: {ratio(times['hf_generate'], times['ours'])}")
    print(f"speed-up of prefix sharing: {ratio(times['ours, no prefix sharing'], times['ours'])}")
    return times


def loop_settings(preset, **fields):
    """rollout()'s settings for a timing: agent.agent_settings of `preset` (a dict) with no flags, a 4096-token context
    and sample seed 0, then `fields`."""
    return agent.agent_settings(preset, {}, **dict(dict(max_context=4096, sample_seed=0), **fields))


def time_kv_reuse(model, tok, batch, group_size, turns, turn_tokens, repeats=3):
    """A multi-turn Sokoban rollout, with the KV cache kept across turns vs the whole history re-prefilled
    (interleaved repeats)."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    seeds = [i // group_size for i in range(batch)]
    run = lambda reuse, n_turns, n_tok: rollout.rollout(
        model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)], seeds,
        loop_settings(preset, max_turns=n_turns, max_new_tokens=n_tok, kv_reuse=reuse), group_size=group_size)
    run(True, 1, 2)  # warm-up
    times, outs = interleaved({"reuse": lambda: run(True, turns, turn_tokens),
                               "re-prefill": lambda: run(False, turns, turn_tokens)}, repeats)
    out_a, out_b = outs["reuse"], outs["re-prefill"]
    same = torch.equal(out_a["tokens"], out_b["tokens"])
    lp = (out_a["old_logp"] - out_b["old_logp"]).abs().max().item() if same else float("nan")
    print(f"kv_reuse     batch {batch} (groups of {group_size})  {turns} turns x <= {turn_tokens} tok  "
          f"final length {out_a['tokens'].shape[1]} tok  turns played {out_a['stats']['num_turns'].mean():.1f}")
    print(f"  reuse {spread(times['reuse'])}   re-prefill {spread(times['re-prefill'])}   speed-up "
          f"{ratio(times['re-prefill'], times['reuse'])}   same tokens: {same}   max |logp diff| {lp:.1e}")
    return times


def time_answer_cut(model, tok, batch, group_size, turns, turn_tokens, repeats=3):
    """The multi-turn rollout of the step bench (CoordFrozenLakeDet, answer-only) with turns ending at their
    closing tag (the default) against turns running to a stop token or the budget (interleaved repeats):
    rollout seconds and sampled tokens per turn (after the cut; the uncut side keeps all it samples)."""
    from env_frozenlake import PRESETS, FrozenLakeEnv
    preset = PRESETS["CoordFrozenLakeDet"]
    seeds = [i // group_size for i in range(batch)]
    run = lambda cut, n_turns, n_tok: rollout.rollout(
        model, tok, [FrozenLakeEnv(**preset["kwargs"]) for _ in range(batch)], seeds,
        loop_settings(preset, max_turns=n_turns, max_actions_per_turn=4, max_new_tokens=n_tok, think=False, stop_at_answer=cut),
        group_size=group_size)
    run(True, 1, 2)  # warm-up
    times, outs = interleaved({"cut": lambda: run(True, turns, turn_tokens),
                               "uncut": lambda: run(False, turns, turn_tokens)}, repeats)
    per_turn = {k: (o["stats"]["response_tokens"].sum() / o["stats"]["num_turns"].sum()).item() for k, o in outs.items()}
    print(f"answer cut   batch {batch} (groups of {group_size})  {turns} turns x <= {turn_tokens} tok, CoordFrozenLakeDet")
    print(f"  cut {spread(times['cut'])}   uncut {spread(times['uncut'])}   speed-up {ratio(times['uncut'], times['cut'])}   "
          f"sampled tokens per turn: cut {per_turn['cut']:.1f}, uncut {per_turn['uncut']:.1f}")
    return times, per_turn


def time_prefill_buckets(model, tok, prompts, new_tokens, group_size, turns, turn_tokens, device, repeats=3):
    """Prefill shapes rounded up to sampler.PREFILL_MULTIPLE (the default) against exact lengths (multiple 1),
    interleaved: single-turn sampling of `prompts`, and with a tokenizer a multi-turn Sokoban rollout (every turn's
    append is a prefill). In fp32 on the CPU both sides sample the same tokens (printed); in bf16 on CUDA a token
    may differ where two logits are within rounding (the GEMMs have other shapes)."""
    from env_sokoban import PRESETS, SokobanEnv
    kind = torch.device(device).type
    bucketed = sampler.PREFILL_MULTIPLE[kind]
    preset, B = PRESETS["SimpleSokoban"], len(prompts)

    def at(multiple, fn):  # fn run with prefill shapes rounded up to `multiple`
        def run():
            sampler.PREFILL_MULTIPLE[kind] = multiple
            try:
                return fn()
            finally:
                sampler.PREFILL_MULTIPLE[kind] = bucketed
        return run
    cases = {"sampler": lambda: sampler.generate(model, prompts, new_tokens, stop_ids=(), seed=0)}
    if tok is not None:
        cases["multi-turn"] = lambda: rollout.rollout(
            model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(B)], [i // group_size for i in range(B)],
            loop_settings(preset, max_turns=turns, max_new_tokens=turn_tokens), group_size=group_size)
    every = {}
    for name, fn in cases.items():
        for m in (bucketed, 1):  # warm-up (on CUDA: compilation and graph capture)
            at(m, fn)()
        sides = {f"multiple {bucketed}": at(bucketed, fn), "exact lengths": at(1, fn)}
        times, outs = every[name] = interleaved(sides, repeats, device)
        a, b = outs.values()
        same = a[0] == b[0] if name == "sampler" else torch.equal(a["tokens"], b["tokens"])
        print(f"prefill      {name:10s} batch {B}  multiple {bucketed}: {spread(times[f'multiple {bucketed}'])}   exact: "
              f"{spread(times['exact lengths'])}   speed-up {ratio(times['exact lengths'], times[f'multiple {bucketed}'])}"
              f"   same tokens: {same}")
    return {name: times for name, (times, _) in every.items()}


def time_windows(model, tok, batch, group_size, turns, turn_tokens, window=2, rounds=3):
    """What a context window costs (rollout's max_context_window): when a window drops a turn the KV-cache row is
    prefilled again from slot 0. Prefilled tokens are exact; times are the min of interleaved rounds."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    seeds = [i // group_size for i in range(batch)]
    run = lambda **kw: rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)], seeds,
                                       loop_settings(preset, max_turns=turns, max_new_tokens=turn_tokens, **kw),
                                       group_size=group_size)
    cfgs = {"full, KV kept": {}, "full, re-prefill every turn": dict(kv_reuse=False),
            f"limited_multi_turn, window {window}": dict(window=window, window_mode="limited_multi_turn"),
            f"limited_multi_turn, window {window}, re-prefill": dict(window=window, window_mode="limited_multi_turn", kv_reuse=False),
            f"single_turn, window {window}": dict(window=window, window_mode="single_turn")}
    times, outs = interleaved({name: (lambda kw=kw: run(**kw)) for name, kw in cfgs.items()}, rounds)
    for name, out in outs.items():
        st = out["stats"]
        print(f"{name:40s} {spread(times[name])}  prefilled {int(st['prefill_tokens'].sum()):6d} tok  sampled "
              f"{int(st['response_tokens'].sum()):5d} tok  row rebuilds {int(st['context_rebuilds'].sum()):3d}  rows {len(out['episode'])}")
    return times, outs


def time_logprobs(model, tok, batch, group_size, turns, turn_tokens, micro=4, rounds=3):
    """The update's log-prob pass (starpo.token_logprobs, forward + backward) on SimpleSokoban rollout rows,
    with lm_head over every real position against only the loss-masked (sampled) ones, as train.py runs it.
    Times are the min of interleaved rounds; the two must agree on the sampled tokens' log-probs."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    out = rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)],
                          [i // group_size for i in range(batch)],
                          loop_settings(preset, max_turns=turns, max_new_tokens=turn_tokens), group_size=group_size)
    tokens, am, lm = out["tokens"], out["attention_mask"], out["loss_mask"]  # [B, T] each
    times, lps = {}, {}
    for _ in range(rounds):
        for name, use in (("every position", False), ("loss-masked only", True)):
            t, lps[name] = time.perf_counter(), []
            for s in range(0, batch, micro):
                lp, ent = starpo.token_logprobs(model, tokens[s:s + micro], am[s:s + micro], with_entropy=True,
                                                mask=lm[s:s + micro] if use else None)
                ((lp * lm[s:s + micro]).sum() + (ent * lm[s:s + micro]).sum()).backward()
                lps[name].append((lp * lm[s:s + micro]).detach())
            times.setdefault(name, []).append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    diff = max((a - b).abs().max().item() for a, b in zip(*lps.values()))
    print(f"log-probs fwd+bwd, {batch} rows x {tokens.shape[1]} slots: {int(am.sum())} real tokens, {int(lm.sum())} sampled "
          f"({lm.sum() / am.sum():.1%})")
    for name, ts in times.items():
        print(f"  lm_head on {name:18s} {spread(ts)}")
    print(f"  speed-up {ratio(times['every position'], times['loss-masked only'])}, max |log-prob difference| {diff:.2e}")
    return times


def time_decode_floor(model, batch, prompt_len, new_tokens, device, bandwidth):
    """Decode-only tokens/s at a given context, and its fraction of the memory-bandwidth floor
    (the floor: weights except the input embedding + every row's K/V read once per step)."""
    cfg = model.config
    V = cfg.vocab_size
    prompts = torch.randint(0, V, (batch, prompt_len)).tolist()
    step_ms = []
    for n in (1, 1 + new_tokens):  # decode time = (prefill + n steps) - (prefill + 1 step)
        for _ in range(2):         # first call of each length warms up / captures
            sync(device)
            t = time.perf_counter()
            sampler.generate(model, prompts, n, stop_ids=(), seed=0)
            sync(device)
        step_ms.append(time.perf_counter() - t)
    per_step = (step_ms[1] - step_ms[0]) / new_tokens
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - model.model.embed_tokens.weight.numel() * \
        model.model.embed_tokens.weight.element_size() * (0 if cfg.tie_word_embeddings else 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_tok = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * model.lm_head.weight.element_size()
    floor = (weights + batch * (prompt_len + new_tokens / 2) * kv_per_tok) / bandwidth
    print(f"decode       batch {batch}  context {prompt_len}+{new_tokens}  {per_step * 1e3:.2f} ms/step  "
          f"{batch / per_step:9.0f} tok/s   floor {floor * 1e3:.2f} ms/step at {bandwidth / 1e12:.2f} TB/s  "
          f"-> {floor / per_step:.0%} of the floor")
    return per_step, floor


def time_envs(n_seeds):
    """Median reset and step time per preset over n_seeds seeds (one random valid action per seed)."""
    import random
    import statistics
    import agent
    for name, (cls, preset, module) in agent.ENV_CLASSES.items():
        env, resets, steps = cls(**preset["kwargs"]), [], []
        for seed in range(n_seeds):
            t = time.perf_counter()
            env.reset(seed)
            resets.append(time.perf_counter() - t)
            rng = random.Random(seed)  # free-text envs (Countdown) have no action list: their random policy's answer
            action = rng.choice(env.actions()) if env.actions() else module.random_actions(env, 1, rng)[0]
            t = time.perf_counter()
            env.step(action)
            steps.append(time.perf_counter() - t)
        print(f"env          {name:18s} median reset {statistics.median(resets) * 1e3:7.3f} ms   "
              f"median step {statistics.median(steps) * 1e3:7.3f} ms   ({n_seeds} seeds)")


def qwen25_05b_random(device, dtype, layers=24):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
    with torch.device(device):
        model = models.cast_parameters(Qwen2ForCausalLM(cfg), dtype)  # inv_freq stays fp32
    return model.eval()


# the Qwen2.5-0.5B-Instruct shape (the paper's model): the dry run's random model, and the shape --plan plans
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                  rms_norm_eps=1e-6)
QWEN25_3B = dict(QWEN25_05B, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16)
QWEN25_7B = dict(QWEN25_05B, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------------ memory plan tables
# results/README.md's two memory-plan tables are printed by `bench.py --plan --markdown` from these lists, and
# test_memory_plan_tables_are_what_bench_prints fails while the committed tables differ from what it prints.
# The paper's StarPO-S PPO configuration (train.py's defaults, which are plan_memory's: 8 groups x 16, mini-batch 32,
# micro-batch 4, --max-context 3600), bf16, Qwen2.5-0.5B: (setting, card GB, what the setting changes)
PLAN_SETTINGS = [("1 × 24 GB", 24, {}),
                 ("1 × 24 GB, `--grad-checkpointing --micro-batch-size 1`", 24, dict(ckpt=True, micro=1)),
                 ("1 × 24 GB, `--algo grpo --grad-checkpointing`", 24, dict(ckpt=True, critic=False)),
                 ("1 × H100 80 GB", 80, {}),
                 ("1 × H100, `--grad-checkpointing`", 80, dict(ckpt=True)),
                 ("8 × H100 (per rank)", 80, dict(world=8)),
                 ("8 × H100, `--grad-checkpointing`", 80, dict(world=8, ckpt=True))]
# The README's GPU commands and RAGEN-2's main table on 80 GB cards: (model, its shape, ranks, train.py flags, what
# the flags set in plan_memory). test_memory_plan_commands_are_what_train_py_plans runs `train.py --plan RANKS` on
# each and compares its total and its "fits with" flags.
PLAN_COMMANDS = [
    ("Qwen2.5-0.5B-Instruct", QWEN25_05B, 1, "--env sokoban --algo ppo", {}),
    ("Qwen2.5-0.5B-Instruct", QWEN25_05B, 8, "--env sokoban --algo ppo", dict(world=8)),
    ("Qwen2.5-0.5B-Instruct", QWEN25_05B, 8, "--env sokoban --algo ppo --vanilla", dict(world=8, ref=True)),
    ("Qwen2.5-0.5B-Instruct", QWEN25_05B, 8, "--env sokoban --algo grpo", dict(world=8, critic=False)),
    ("Qwen2.5-3B", QWEN25_3B, 4, "--env CoordSokoban --algo ppo --grad-checkpointing", dict(world=4, ckpt=True)),
    ("Qwen2.5-3B", QWEN25_3B, 4, "--env CoordSokoban --algo ppo", dict(world=4)),
    ("Qwen2.5-3B", QWEN25_3B, 4, "--env CoordSokoban --algo grpo --grad-checkpointing", dict(world=4, ckpt=True, critic=False)),
    ("Qwen2.5-3B", QWEN25_3B, 4, "--env CoordSokoban --algo grpo", dict(world=4, critic=False)),
    ("Qwen2.5-7B-Instruct", QWEN25_7B, 8, "--env sokoban --algo ppo --grad-checkpointing", dict(world=8, ckpt=True)),
    ("Qwen2.5-7B-Instruct", QWEN25_7B, 8, "--env sokoban --algo ppo --grad-checkpointing --kl-coef 0.001",
     dict(world=8, ckpt=True, ref=True)),
]


def plan_tables():
    """results/README.md's memory-plan tables in markdown, from memplan: (the paper's configuration by part on three
    cards, the totals of PLAN_COMMANDS on 80 GB cards)."""
    import memplan
    from transformers import Qwen2Config
    gb = lambda *v: f"{sum(v) / memplan.GIB:.2f}"
    rows = ["| setting | weights + grads + AdamW | critic | rollout copy | KV pool | activations (+ recompute) | "
            "weight casts | grad buffers | log-prob chunk + backward | total | fits? |", "|---" * 11 + "|"]
    for name, card, kw in PLAN_SETTINGS:
        p = memplan.plan_memory(Qwen2Config(**QWEN25_05B), **kw)
        if p["reference"] or p["lora_base"]:
            raise ValueError(f"plan_tables: {name}: the table has no column for the reference model or the LoRA base")
        rows.append(f"| {name} | {gb(p['weights'], p['grads'], p['adamw'])} | {gb(p['critic'])} | {gb(p['rollout_copy'])} "
                    f"| {gb(p['kv_pool'])} | {gb(p['activations'])} (+{gb(p['recompute'])}) | {gb(p['weight_casts'])} "
                    f"| {gb(p['grad_buffers'])} | {gb(p['logprob_chunk'], p['logprob_backward'])} | {gb(p['total'])} "
                    f"| {'yes' if memplan.fits(p['total'], card * memplan.GIB) else '**no**'} |")
    settings = "\n".join(rows)
    rows = ["| model | ranks | `train.py` flags | per rank | fits? |", "|---|---|---|---|---|"]
    for model, shape, ranks, flags, kw in PLAN_COMMANDS:
        cfg, card = Qwen2Config(**shape), 80 * memplan.GIB
        total = memplan.plan_memory(cfg, **kw)["total"]
        if memplan.fits(total, card):
            fit = "yes"
        else:  # what train.py --plan names: the flags that make it fit, from plan_memory's defaults for the rest
            fix = memplan.fitting_flags(cfg, dict(dict(world=1, micro=4, ckpt=False), **kw), card)
            fit = f"**no**; fits with `{fix}`" if fix else "**no**; nothing `train.py --plan` suggests fits it"
        rows.append(f"| {model} | {ranks} | `{flags}` | {gb(total)} GB | {fit} |")
    return settings, "\n".join(rows)


# ------------------------------------------------------------------------------------------------ paper-shape dry run
def save_qwen25_shape(path, layers=24):
    """A random model with Qwen2.5-0.5B-Instruct's exact shape (layers may be cut) and a byte-level Qwen2Tokenizer
    whose vocabulary is padded to 151,936 entries with 2- and 3-byte strings (encode never makes them, decode
    reads them as bytes), saved as a hub-like directory: train.py loads it like a real snapshot."""
    import itertools
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for n in (2, 3):
        for t in itertools.product(alphabet, repeat=n):
            if len(vocab) >= QWEN25_05B["vocab_size"] - 3:  # + <|im_end|>, <|endoftext|>, <|im_start|>
                break
            vocab["".join(t)] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = models.CHATML
    cfg = Qwen2Config(**dict(QWEN25_05B, num_hidden_layers=layers), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert len(tok) == cfg.vocab_size, len(tok)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# the multi-turn PPO step of the bench: SmolLM2, CoordFrozenLakeDet, PPO with the critic, 4 groups x 8, 3 turns
STEP = ("--env CoordFrozenLakeDet --no-think --algo ppo --max-turns 3 --max-actions-per-turn 4 --max-new-tokens 48 "
        "--num-groups 4 --group-size 8 --filter-ratio 0.25 --mini-batch-size 8 --micro-batch-size 4 --lr 2e-5 "
        "--critic-lr 1e-4 --val-every 0 --collapse-every 0 --steps 1 --log-trajectories-every 0")
STEP_SIDES = {"before": "--no-prefix-sharing",  # the one speed-up a flag turns off
              "after": ""}                      # the defaults


def time_step(model, repeats, threads, against=None, before=None, step_flags=""):
    """One train.py step (STEP) per side, sides interleaved `repeats` times, each a fresh process on the same seed;
    per phase (train.py's timing_s/*) the min and spread of each side and the speed-up. Sides: STEP_SIDES, or with
    `against` (another checkout, e.g. a git worktree of an older commit) that checkout's train.py against this
    one's, both with the defaults; with `before` (flags), this checkout with those flags against its defaults.
    step_flags: train.py flags for both sides, after STEP (e.g. "--algo grpo --num-groups 4 --group-size 4"). The scores, losses and sampled tokens are printed side by side."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    sides = {"before": (against, ""), "after": (here, "")} if against else {k: (here, v) for k, v in STEP_SIDES.items()}
    if before is not None:
        sides = {"before": (here, before), "after": (here, "")}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else dict(os.environ)
    times, last = {name: {} for name in sides}, {}
    for _ in range(repeats):
        for name, (tree, flags) in sides.items():
            out = tempfile.mkdtemp()
            cmd = [sys.executable, os.path.join(tree, "train.py"), "--model", model, *STEP.split(), *step_flags.split(), *flags.split(),
                   "--out", out]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                raise SystemExit(f"train.py exited with {r.returncode}\n" + r.stdout[-2000:] + r.stderr[-3000:])
            last[name] = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
            for k, v in last[name].items():
                if k.startswith("timing_s/"):
                    times[name].setdefault(k[9:], []).append(v)
            print(f"  {name:7s} step {last[name]['timing_s/step']:7.1f} s", flush=True)
    a, b = sides
    print(f"multi-turn step, --model {model} {STEP} {step_flags}\n  {a}: {' '.join(sides[a])}\n  {b}: {' '.join(sides[b])}")
    for phase in ("rollout", "old_logp", "ref_values", "update", "step"):
        ta, tb = times[a][phase], times[b][phase]
        gain = ratio(ta, tb) if min(ta) > 0.05 and min(tb) > 0.05 else "(phase skipped)"
        print(f"  {phase:10s} {a} {spread(ta)}  ->  {b} {spread(tb)}   {gain}")
    env_key = "train/CoordFrozenLakeDet/"
    for k in (env_key + "score", env_key + "response_tokens", env_key + "num_turns", env_key + "prefill_tokens",
              env_key + "prefill_saved", "critic/vf_loss", "actor/pg_loss",
              "actor/ratio_max", "rollout/sampler_logp_abs_diff"):
        print(f"  {k:40s} " + "   ".join(f"{name} {last[name].get(k, float('nan')):.6g}" for name in sides))
    return times, last


def dry_run(layers, sampler, out):
    """One full StarPO-S step of train.py (rollout on the sampler path asked for, filter, old log-probs, values,
    PPO update, checkpoint + HF export) on the Qwen2.5-0.5B shape at a small batch; prints time and peak RSS."""
    import os
    import resource
    import subprocess
    import sys
    import tempfile
    d = tempfile.mkdtemp()
    save_qwen25_shape(d, layers)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), "--model", d,
           "--env", "sokoban", "--algo", "ppo", "--num-groups", "2", "--group-size", "2", "--filter-ratio", "0.5",
           "--mini-batch-size", "2", "--micro-batch-size", "1", "--max-new-tokens", "16", "--max-turns", "2",
           "--val-every", "0", "--collapse-every", "0", "--steps", "1", "--sampler", sampler, "--measure-activations",
           "--out", out]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:  # -9: killed, most likely by the kernel's OOM killer (the plan says how much is needed)
        raise SystemExit(f"train.py exited with {r.returncode} after {wall:.0f} s\n" + r.stdout[-2000:] + r.stderr[-3000:])
    import json
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"dry run      Qwen2.5-0.5B shape, {layers} layers, sampler {sampler}: one step in {wall:.0f} s wall "
          f"(step {m['timing_s/step']:.0f} s: " + ", ".join(f"{k[9:]} {v:.1f}" for k, v in m.items()
                                                                if k.startswith("timing_s/") and k != "timing_s/step") +
          f"), peak RSS {rss:.1f} GB, saved activations {m['perf/actor_saved_activations_mb']:.0f} MB per micro-batch")
    return m


# ------------------------------------------------------------------------------------------------ CUDA-graph emulations
# Two torch.compile backends that give the CPU the two CUDA-graph faults it cannot have (the test suite and
# --gpu-check run every compiled path of sampler.py under them). Both run each captured graph eagerly.

class GraphReplayBackend:
    """A CUDA-graph replay writes its outputs into the same static buffers every time, and with CUDA graph trees
    starting the next compiled call frees the previous call's outputs (torch _inductor/cudagraph_trees.py,
    dealloc_current_path_weakrefs): a caller that keeps a compiled output, or feeds it into the next compiled
    call, reads garbage. Here every output of compiled call k is overwritten with garbage (NaN; random ints) as
    soon as call k+1 starts, so such a caller samples different tokens on the CPU too. Outputs that are a
    graph's own inputs (mutated in place) are real tensors, not graph memory, and are left alone."""

    def __init__(self):
        self.graphs, self.calls, self.live = 0, 0, []
        self.noise = torch.Generator().manual_seed(0)

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            for t in self.live:  # the previous call's outputs: its static buffers are reused now
                if t.is_floating_point():
                    t.fill_(float("nan"))
                else:
                    t.copy_(torch.randint(0, 100, t.shape, generator=self.noise))
            self.calls += 1
            outs = gm.forward(*args)
            mine = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
            self.live = [o for o in outs if torch.is_tensor(o) and o.untyped_storage().data_ptr() not in mine]
            return outs
        return run


class RecordingBackend:
    """Records every graph dynamo hands over (one per compile or recompile) with its example inputs, and flags
    the inputs that inductor would keep on the CPU: a Python float that changed value between calls becomes a
    0-d float64 CPU tensor input (dynamo's automatic dynamic), and inductor skips CUDA graphs for any graph with
    a CPU input, silently, for the rest of the run. `inner` runs the graph (default: eagerly)."""

    def __init__(self, inner=None):
        self.graphs, self.inner = [], inner

    def __call__(self, gm, example_inputs):
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = [n.name for n in nodes]
        scalars = [n.name for n, x in zip(nodes, example_inputs)
                   if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)
                   or (torch.is_tensor(x) and x.dim() == 0 and x.dtype == torch.float64 and x.device.type == "cpu")]
        self.graphs.append(dict(inputs=names, cpu_scalars=scalars))
        return gm.forward if self.inner is None else self.inner(gm, example_inputs)


# ------------------------------------------------------------------------------------------------ CUDA on fake tensors
# The CUDA path's device, dtype and layout rules on a machine without a GPU: under FakeTensorMode, device="cuda"
# tensors hold no data (shape, strides, dtype and device only) and every op runs its meta kernel, which for a
# CUDA-only kernel (the efficient attention) gives CUDA's layout. The suite and --gpu-check trace the sampler and
# the update's forward this way (fake_cuda_trace).
# Two things cannot run there: a host read of tensor data (.tolist(), .item(), bool(), nonzero: sample_turn's
# checks and everything after them), and backward (the autograd engine asks the accelerator for a CUDA stream,
# which a CPU-only torch has none of, fake or not).

@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which device="cuda" tensors work on a CPU-only torch too. Python indexing (x[i], x[i] = y)
    sets a device guard for its tensor's device, and a CPU-only build has no CUDA guard: for the duration, CUDA's slot
    of c10's guard registry holds the CPU's no-op guard (a CUDA build already has one and is left alone)."""
    import ctypes
    import os
    from torch._subclasses.fake_tensor import FakeTensorMode
    slot = None
    if not torch.backends.cuda.is_built():
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        guards = (ctypes.c_void_p * 2).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")  # [CPU, CUDA]
        if guards[1] is None:
            slot, guards[1] = guards, guards[0]
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        if slot is not None:
            slot[1] = None


def fake_cuda_model(model, dtype):
    """model, in place, with fake CUDA parameters in dtype (tied ones stay tied) and fake CUDA buffers in their own
    dtype (models.cast_parameters' rule: RoPE's inv_freq stays fp32). Call it inside fake_cuda()."""
    made = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="cuda"), p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return model


def cuda_layout(o):
    """o [B, H, L, D], the values the same, stored as CUDA's memory-efficient and flash kernels store their output:
    [B, L, H, D] memory returned as its transposed view (their meta kernels end in res.transpose(1, 2))."""
    return o.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA's memory-efficient kernel runs it. Autocast casts the inputs first (SDPA
    is on its lower-precision list); then an AssertionError unless the inputs are ones that kernel takes: one device;
    q, k, v of one dtype; an additive mask in that dtype (the kernel raises "invalid dtype for bias" on any other)
    or a bool one; a head dim that is a multiple of 8 and unit last-dim strides (else SDPA falls back to math). The
    output is the kernel's: on fake tensors its meta kernel's, a transposed view of [B, L, H, D] memory.
    enable_gqa (HF's attention passes it; the sampler folds its query heads instead) repeats K/V first."""
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        attn_mask = attn_mask.to(dtype) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    assert q.device == k.device == v.device and (attn_mask is None or attn_mask.device == q.device), \
        f"SDPA inputs on {q.device}, {k.device}, {v.device}, mask {None if attn_mask is None else attn_mask.device}"
    assert q.dtype == k.dtype == v.dtype, f"SDPA q, k, v in {q.dtype}, {k.dtype}, {v.dtype}"
    assert attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype), f"mask in {attn_mask.dtype}, query in {q.dtype}"
    assert q.shape[-1] % 8 == 0 and k.shape[-1] == q.shape[-1] and v.shape[-1] % 8 == 0, f"head dim {q.shape[-1]}"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "SDPA inputs need a unit last-dim stride"
    if enable_gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA turns a bool mask into an additive one
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # [B, H, L, S]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))  # backward needs the log-sum-exp
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                                  scale=scale)[0]


class AllTrueMasks(TorchDispatchMode):
    """Answers the two host reads of the update's forward for bool masks that are all True (the only masks
    fake_cuda_trace passes): a boolean-mask index selects every position (nonzero of an all-True mask, in row-major
    order) and a bool read on the host (bool(mask.any())) is True. Any other host read still raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            index = []
            for i in args[1]:
                if i is not None and i.dtype == torch.bool:  # every position of i's dims, as long indices
                    grid = torch.meshgrid(*[torch.arange(s, device=i.device) for s in i.shape], indexing="ij")
                    index += [g.reshape(-1) for g in grid]
                else:
                    index.append(i)
            return func(args[0], index)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            return True
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast(dtype=torch.bfloat16):
    """torch.autocast("cuda", dtype), which turns itself off where CUDA is not available; this one does not."""
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


def fake_cuda_trace(arch="llama", T=24):
    """The CUDA path of build_tiny(arch) on fake CUDA tensors, SDPA as CUDA's efficient kernel (efficient_sdpa):
      sampler  the bf16 rollout model: forward_cached (a ragged prefill in row chunks, a decode step), sample_next,
               decode_step (top-p, greedy), prefill_shared, KVCache.select and ensure
      update   the actor's forward as train.py runs it on one process (fp32 weights, bf16 autocast) and under FSDP2
               (bf16 parameters): starpo.token_logprobs with entropy on 3 rows of T tokens, the policy, entropy and
               KL losses, the critic's values and value loss (no backward: see above)
    A device, dtype or layout that CUDA refuses raises. Returns {name: (shape, dtype, device type)} of the results,
    and under "sdpa" the sampler's SDPA calls as (output strides, enable_gqa)."""
    import fsdp
    F, B = torch.nn.functional, 3  # rows (the sampler's: a long prompt, a short one, an idle row)
    real_sdpa, mask_bytes = F.scaled_dot_product_attention, sampler.PREFILL_MASK_BYTES
    calls, seen = [], {}
    put = lambda name, x: seen.__setitem__(name, (tuple(x.shape), x.dtype, x.device.type))

    def sampler_sdpa(*a, **k):  # efficient_sdpa, recording each call's output strides and whether it asked for GQA
        o = efficient_sdpa(*a, **k)
        calls.append((o.stride(), k.get("enable_gqa", False)))
        return o
    rollout_model, actor, fsdp_actor = (models.build_tiny(arch)[0] for _ in range(3))
    critic = fsdp.Critic(actor)
    try:
        with fake_cuda(), torch.no_grad():  # the sampler
            F.scaled_dot_product_attention = sampler_sdpa
            sampler.PREFILL_MASK_BYTES = 1  # one row per prefill chunk
            model = fake_cuda_model(rollout_model, torch.bfloat16)
            cache = sampler.KVCache(model, B, 80)
            ids = torch.zeros(B, 16, dtype=torch.long, device="cuda")                              # [B, 16] right-padded
            n = torch.tensor([13, 5, 0], device="cuda")                                            # [B] the last row idles
            logits = sampler.forward_cached(model, cache.k, cache.v, cache.lens, ids, n, 16)       # [B, V]
            cache.lens += n
            keys, temp, top_p = (torch.arange(B, device="cuda"), torch.tensor(1.0, device="cuda"),
                                 torch.tensor(0.9, device="cuda"))
            tok, lp = sampler.sample_next(logits, keys, temp, top_p)
            fed = torch.ones(B, dtype=torch.long, device="cuda")
            tok, lp = sampler.decode_step(model, cache.k, cache.v, cache.lens, tok[:, None], fed, 24, keys + 1, temp,
                                          top_p, False)                                            # [B], [B]
            greedy, _ = sampler.decode_step(model, cache.k, cache.v, cache.lens + 1, tok[:, None], fed, 24, keys + 2, temp,
                                            None, True)                                            # [B]
            prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 12]]  # shared prefixes [5, 6] and [5, 6, 7, 8]
            fresh = sampler.KVCache(model, B, 40)
            shared = sampler.prefill_shared(model, fresh, prompts, sampler.shared_prefixes(prompts)[0], 6)
            fresh.select([0] * B)
            fresh.ensure(300)
            for name, x in dict(logits=logits, token=tok, logp=lp, greedy=greedy, shared_logits=shared, cache_k=cache.k[0],
                                grown_k=fresh.k[0], lens=fresh.lens).items():
                put(name, x)
        seen["sdpa"] = calls
        with fake_cuda(), AllTrueMasks():  # the update's forward: one process (fp32 + autocast), FSDP2 (bf16 params)
            F.scaled_dot_product_attention = efficient_sdpa
            for name, model, dtype in (("update", actor, torch.float32), ("fsdp_update", fsdp_actor, torch.bfloat16)):
                model = fake_cuda_model(model, dtype).train()
                value_model = fake_cuda_model(critic, dtype).train() if name == "update" else None
                tokens = torch.zeros(B, T, dtype=torch.long, device="cuda")                        # [B, T]
                am, mask = torch.ones(B, T, dtype=torch.bool, device="cuda"), torch.ones(B, T, device="cuda")
                with cuda_autocast():
                    logp, ent = starpo.token_logprobs(model, tokens, am, with_entropy=True, mask=mask)
                    values = value_model(tokens, am) if value_model is not None else None
                logp, ent, adv = logp.float(), ent.float(), torch.zeros(B, T, device="cuda")
                counts = dict(token_count=B * T, seq_count=B)  # Python numbers, as train.update passes them
                pg, _ = starpo.policy_loss(logp, logp.detach(), adv, mask, **counts)
                loss = pg - 0.001 * starpo.aggregate(ent, mask, **counts) + 0.001 * starpo.aggregate(
                    starpo.kl_penalty(logp, logp.detach(), "low_var_kl"), mask, "seq-mean-token-mean", **counts)
                got = {f"{name}_logp": logp, f"{name}_entropy": ent, f"{name}_loss": loss}  # [B, T], [B, T], []
                if values is not None:                                                               # [B, T], []
                    got.update(values=values, value_loss=starpo.value_loss(values.float(), values.detach(), adv, mask,
                                                                           **counts)[0])
                for k, x in got.items():
                    put(k, x)
    finally:
        F.scaled_dot_product_attention, sampler.PREFILL_MASK_BYTES = real_sdpa, mask_bytes
    assert {s[2] for k, s in seen.items() if k != "sdpa"} == {"cuda"}, seen
    assert all(seen[k][1] == torch.float32 for k in seen if k.endswith(("logits", "logp", "entropy", "loss", "values")))
    assert seen["cache_k"][1] == torch.bfloat16 and not any(gqa for _, gqa in seen["sdpa"]), seen
    return seen


# ------------------------------------------------------------------------------------------------ host syncs
class HostSyncs(TorchFunctionMode):
    """Counts (in .count) the torch calls that make the host wait for a CUDA device: reads of tensor data on the host
    (bool(), int(), float(), .item(), .tolist()) and ops whose output size depends on the data (nonzero,
    masked_select, unique, indexing with a bool mask, repeat_interleave by a tensor, and isin where torch's rule makes
    it sort: test elements >= 10 x elements^0.145). Nothing waits on the CPU; on CUDA each is a sync. A compiled
    call counts as one opaque call (run eager code under it)."""
    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist"}
    SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") else ()
        index = index if isinstance(index, tuple) else (index,)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        isin = name == "isin" and all(torch.is_tensor(x) for x in args[:2])
        self.count += (name in self.READS or name in self.SIZED
                       or any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
                       or (name == "repeat_interleave" and torch.is_tensor(repeats) and kwargs.get("output_size") is None)
                       or (isin and args[1].numel() >= 10 * args[0].numel() ** 0.145))
        return func(*args, **kwargs)


def decode_syncs_per_token(model, device, every=8, budgets=(16, 48)):
    """Host syncs per decode token of sampler.generate on 4 rows with no stop token (every row runs to its budget):
    the difference between two budgets over their difference, so the prefill's and the turn end's syncs cancel.
    CUDA: the sampler sampler_settings picks (static, compiled), warmed up first, counted by CUDA's sync debug mode;
    the CPU: the eager sampler, counted by HostSyncs. The decode loop's contract is 1 / every."""
    import warnings
    cuda = torch.device(device).type == "cuda"
    how = sampler.sampler_settings(device)._replace(check_every=every) if cuda else sampler.Sampler(check_every=every)
    run = lambda n: sampler.generate(model, [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]], n, sampler=how)
    counts = []
    for n in budgets:
        if cuda:
            run(n)  # compiles and captures first
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run(n)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        else:
            with HostSyncs() as syncs:
                run(n)
            counts.append(syncs.count)
    return (counts[1] - counts[0]) / (budgets[1] - budgets[0])


def splitmix64(k):
    """splitmix64's finaliser of k in Python's unbounded ints, as the signed int64 sampler.mix64 stores."""
    z = k % 2 ** 64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2 ** 64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2 ** 64
    z ^= z >> 31
    return z - 2 ** 64 if z >= 2 ** 63 else z


# ------------------------------------------------------------------------------------------------ the GPU check
def gpu_check(device, layers=24, bandwidth=3.35e12, floor_fraction=0.25):
    """python bench.py --gpu-check: what the CPU tests cannot see, one PASS / FAIL line each; returns the number
    of FAILs. On CUDA: the compiled sampler with inductor and CUDA graphs, the SDPA kernel that runs, the fp32
    logits GEMM, logits independent of SDPA's output layout, the fake-CUDA trace, the noise bits, host syncs per
    decode token, one train.py step's peak memory against its plan, decode speed against the bandwidth floor
    (Qwen2.5-0.5B shape, `layers` layers, random weights). On the CPU the same checks run on the tiny model with the
    emulations above in place of CUDA graphs and layouts, and the memory and speed lines report without a GPU
    figure to hold them to."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile
    from torch._dynamo.utils import counters
    from env_frozenlake import PRESETS, FrozenLakeEnv
    device = torch.device(device)
    cuda, fails = device.type == "cuda", []

    def line(name, ok, detail):  # ok None: nothing to check on this device, the line only reports
        fails.append(ok is False)
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {name:24s} {detail}", flush=True)

    # 1, 2: the compiled static sampler against eager, then validation (T=0.5) and training (T=1.0) for 3 steps
    model, tok = models.load_model("tiny", device=device, check=sampler.self_check)  # fp32: compiled and eager agree to the token
    preset = PRESETS["FrozenLake"]
    run = lambda sampler, seeds=(5, 5, 6, 6), temperature=None: rollout.rollout(
        model, tok, [FrozenLakeEnv(**preset["kwargs"]) for _ in seeds], list(seeds),
        loop_settings(preset, max_turns=3, max_new_tokens=16, max_context=1200, think=False, top_p=0.95, sample_seed=4),
        group_size=2, temperature=temperature, sampler=sampler)
    torch._dynamo.reset()
    counters.clear()
    rec = RecordingBackend(GraphReplayBackend())
    fast = sampler.Sampler(static=True, compile="inductor" if cuda else rec, check_every=8)
    eager, got = run(sampler.Sampler()), run(fast)
    same = torch.equal(got["tokens"], eager["tokens"])
    line("compiled == eager", same, f"{int(got['stats']['response_tokens'].sum())} tokens sampled by the static path "
         f"({'inductor, CUDA graphs' if cuda else 'CUDA-graph replays emulated'}), identical to eager: {same}")
    for step in range(3):
        for temperature in (0.5, 1.0):
            run(fast, seeds=(step, step, step + 1, step + 1), temperature=temperature)
    graphs = counters["stats"]["unique_graphs"]
    cpu_inputs = counters["inductor"]["cudagraph_skips"] if cuda else sum(len(g["cpu_scalars"]) for g in rec.graphs)
    line("graphs, recompiles", graphs <= 3 and cpu_inputs == 0,
         f"{graphs} graphs for 2 functions (at most 3 for one top-p and greedy setting: sample_next once, decode_step "
         f"with a fixed and a symbolic key length), "
         f"{'CUDA graphs skipped' if cuda else 'Python floats as CPU tensor inputs'}: {cpu_inputs}")

    # 3: which SDPA kernel the sampler's attention runs (its explicit mask rules flash out on CUDA)
    qwen = qwen25_05b_random(device, torch.bfloat16, layers=2) if cuda else model  # CUDA: 7 query heads per KV head
    prompts = torch.randint(0, qwen.config.vocab_size, (8, 100)).tolist()
    torch._dynamo.reset()
    with torch.profiler.profile() as prof:
        sampler.generate(qwen, prompts, 4, sampler=sampler.sampler_settings(device))
    ran = sorted({e.key for e in prof.key_averages()
                  if "attention" in e.key and e.key != "aten::scaled_dot_product_attention"})  # the kernels it chose
    want = "efficient_attention" if cuda else "flash_attention_for_cpu"
    line("SDPA kernel", any(want in k for k in ran) and not any("math" in k for k in ran),
         f"{', '.join(ran) or 'none'} (want {want}, no math)")

    # the sampler's logits of a bf16 model are the fp32 product of its hidden state (on CUDA one GEMM with an fp32
    # output, a path the CPU has no kernel for; on the CPU the upcast product)
    low = qwen if cuda else models.cast_parameters(copy.deepcopy(model), torch.bfloat16)
    seen = []
    hook = low.model.norm.register_forward_hook(lambda mod, inp, out: seen.append(out))
    ids = torch.tensor(prompts[:2], device=device)                                       # [2, 100]
    cache = sampler.KVCache(low, 2, ids.shape[1] + 1)
    with torch.no_grad():
        logits = sampler.forward_cached(low, cache.k, cache.v, cache.lens, ids, torch.full((2,), ids.shape[1], device=device),
                                        ids.shape[1])                                  # [2, V]
    hook.remove()
    want = seen[-1].float() @ low.lm_head.weight.float().T                             # [2, V]
    err, top = (logits - want).abs().max().item(), want.abs().max().item()
    line("fp32 logits", logits.dtype == torch.float32 and err <= 1e-3 * max(1.0, top),
         f"{logits.dtype}, max error {err:.2e} against the fp32 product (logits up to {top:.1f})")

    # 5: the same logits whatever layout SDPA's output has: the kernel's own (CUDA's efficient and flash kernels return
    # a transposed view; the CPU emulates it) against a contiguous copy of it
    real, strides = torch.nn.functional.scaled_dot_product_attention, []

    def kernel(*a, **k):  # SDPA with CUDA's output layout, recording its strides
        o = real(*a, **k) if cuda else cuda_layout(real(*a, **k))
        strides.append(o.stride())
        return o

    def logits_with(sdpa):  # [2, V] the sampler's logits of the two prompts, SDPA replaced by sdpa
        torch.nn.functional.scaled_dot_product_attention = sdpa
        try:
            c = sampler.KVCache(low, 2, ids.shape[1] + 1)
            with torch.no_grad():
                return sampler.forward_cached(low, c.k, c.v, c.lens, ids, torch.full((2,), ids.shape[1], device=device),
                                              ids.shape[1])
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
    as_is, dense = logits_with(kernel), logits_with(lambda *a, **k: real(*a, **k).contiguous())
    line("SDPA output layout", torch.equal(as_is, dense),
         f"output strides {strides[0]} ({'the kernel' if cuda else 'CUDA emulated'}): logits identical to a contiguous "
         f"output's: {torch.equal(as_is, dense)} (max difference {(as_is - dense).abs().max().item():.2e})")

    # 6: the sampler and the update's forward on fake CUDA tensors, every supported layout (fake_cuda_trace)
    archs = ("llama", "llama3", "mistral", "qwen2", "qwen3")
    try:
        traced = [fake_cuda_trace(a) for a in archs]
        line("fake-CUDA trace", True, f"{', '.join(archs)}: sampler and update forward in bf16 on fake CUDA tensors, SDPA "
             f"as the efficient kernel (strides {traced[0]['sdpa'][0][0]}): every device, dtype and layout accepted")
    except Exception as e:  # an AssertionError of efficient_sdpa or fake_cuda_trace, a device or dtype RuntimeError
        line("fake-CUDA trace", False, f"{type(e).__name__}: {str(e)[:400]}")

    # 7: the counter-based noise on the device: splitmix64 in int64 (wrapping multiply, masked shifts) gives the bits
    # of Python's unbounded ints, eager and compiled (inductor: Triton on CUDA), and the draw of fixed logits is the CPU's
    keys = torch.tensor([0, 1, -1, 2 ** 62 + 12345, -(2 ** 63), 987654321])
    noisy = torch.randn(len(keys), 1000, generator=torch.Generator().manual_seed(0)) * 3          # [6, 1000]
    want, draw = [splitmix64(k) for k in keys.tolist()], sampler.sample_next(noisy, keys, 0.7)[0].tolist()
    ways = dict(eager=(sampler.mix64, sampler.sample_next))
    if cuda:
        ways["inductor"] = (torch.compile(sampler.mix64), torch.compile(sampler.sample_next))
    bad = [w for w, (mix, sample) in ways.items() if mix(keys.to(device)).tolist() != want
           or sample(noisy.to(device), keys.to(device), torch.tensor(0.7, device=device))[0].tolist() != draw]
    line("noise bits", not bad, f"mix64 and sample_next on {device.type} ({', '.join(ways)}) against the Python reference "
         f"and the CPU's draw: {'identical' if not bad else 'different: ' + ', '.join(bad)}")

    # 8: host syncs in the decode loop: the "all rows done" check every check_every tokens, nothing else
    per_token = decode_syncs_per_token(model, device)
    line("host syncs / token", per_token <= 1 / 8, f"{per_token:.3f} per decode token at check_every 8 (want 1/8; "
         f"{'CUDA sync debug mode' if cuda else 'HostSyncs: the calls that sync on CUDA'})")

    # 9: one train.py step, its peak memory against the plan it prints
    out = tempfile.mkdtemp()
    model_arg = save_qwen25_shape(os.path.join(out, "model"), layers) if cuda else "tiny"
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), "--model", model_arg,
           "--device", device.type, "--env", "sokoban", "--algo", "ppo", "--num-groups", "2", "--group-size", "4",
           "--filter-ratio", "1", "--mini-batch-size", "8", "--micro-batch-size", "2", "--max-new-tokens", "16",
           "--max-turns", "2", "--max-context", "1024", "--val-every", "0", "--collapse-every", "0", "--steps", "1",
           "--out", os.path.join(out, "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    plan = re.search(r"memory plan: ([\d.]+) GB", r.stdout)
    if r.returncode or plan is None:
        line("train.py step", False, f"exit {r.returncode}: " + (r.stdout[-800:] + r.stderr[-1500:]).replace("\n", " | "))
    else:
        m = json.loads(open(os.path.join(out, "run", "metrics.jsonl")).readline())
        peak = m.get("perf/max_memory_allocated_gb")
        line("train.py step", None if peak is None else peak <= float(plan.group(1)),
             f"one step in {m['timing_s/step']:.1f} s; peak {'n/a on the CPU' if peak is None else f'{peak:.2f} GB'} "
             f"(torch.cuda.max_memory_allocated) against the plan's {plan.group(1)} GB")

    # 10: decode speed against the bandwidth floor (CUDA: the paper's 128 rollout rows at context 1024)
    qwen = qwen25_05b_random(device, torch.bfloat16, layers) if cuda else model
    batch, context = (128, 1024) if cuda else (8, 64)
    per_step, floor = time_decode_floor(qwen, batch, context, 32, device, bandwidth)
    line("decode vs floor", floor / per_step >= floor_fraction if cuda else None,
         f"{batch / per_step:,.0f} tok/s, {floor / per_step:.0%} of the {bandwidth / 1e12:.2f} TB/s floor" +
         (f" (want >= {floor_fraction:.0%}: without CUDA graphs the kernel launches alone take several times the floor)"
          if cuda else " (no floor to hold a CPU to)"))
    return sum(fails)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | a directory | hub id | qwen2.5-0.5b-random")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="all", choices=["all", "sampler", "kv", "cut", "window", "decode", "envs", "logprobs", "step",
                                                          "prefill"],
                        help="which measurement (window: the KV-row rebuilds of a context window; prefill: bucketed "
                        "prefill shapes against exact lengths; neither in all)")
    parser.add_argument("--plan", action="store_true", help="print the memory plan of the paper's config on 24 GB, 1 and 8 H100s")
    parser.add_argument("--markdown", action="store_true", help="with --plan: results/README.md's memory-plan tables, "
                        "also the README's GPU commands (the suite compares them with the committed ones)")
    parser.add_argument("--dry-run", type=int, default=0, metavar="LAYERS", help="one train.py step on the Qwen2.5-0.5B "
                        "shape cut to LAYERS layers (24 = the real depth)")
    parser.add_argument("--sampler", default="compiled", help="dry run: train.py --sampler")
    parser.add_argument("--batch", type=int, default=32, help="rows sampled together")
    parser.add_argument("--new-tokens", type=int, default=64, help="sampler bench: tokens per row")
    parser.add_argument("--group-size", type=int, default=8, help="kv bench: rows per group (shared first prompt)")
    parser.add_argument("--turns", type=int, default=5, help="kv bench: turns per episode")
    parser.add_argument("--turn-tokens", type=int, default=48, help="kv bench: max new tokens per turn")
    parser.add_argument("--prompt-len", type=int, default=1024, help="decode bench: context length")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="decode bench: memory bandwidth, bytes/s")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--env-seeds", type=int, default=1000, help="envs bench: seeds per preset")
    parser.add_argument("--against", metavar="DIR", help="step bench: time DIR's train.py (another checkout, e.g. `git "
                        "worktree add DIR <commit>`) against this one's, both with the defaults")
    parser.add_argument("--step-flags", metavar="FLAGS", default="", help="step bench: train.py flags for both sides, "
                        "after the bench's own (e.g. --step-flags=\"--algo grpo --group-size 4\")")
    parser.add_argument("--before", metavar="FLAGS", help="step bench: this checkout with FLAGS (one string, e.g. "
                        "--before=--no-stop-at-answer) against its defaults")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, the sides interleaved (ratios: min over min)")
    parser.add_argument("--gpu-check", action="store_true", help="PASS / FAIL checks of the GPU path (on the CPU: "
                        "with the CUDA-graph emulations); exits 1 on any FAIL")
    args = parser.parse_args()
    if args.gpu_check:
        raise SystemExit(1 if gpu_check("cuda" if torch.cuda.is_available() else "cpu", bandwidth=args.bandwidth) else 0)
    if args.plan and args.markdown:  # results/README.md's two tables, to paste over the committed ones
        print("\n\n".join(plan_tables()))
        raise SystemExit
    if args.plan:  # the paper's StarPO-S PPO config by part, each part on its own (PLAN_SETTINGS)
        import memplan
        from transformers import Qwen2Config
        cfg = Qwen2Config(**QWEN25_05B)
        for name, gb, kw in PLAN_SETTINGS:
            part = memplan.plan_memory(cfg, **kw)  # train.py --plan prints the same for any flags
            print(f"{name.replace('`', ''):54s} " + "  ".join(f"{k} {v / 2**30:5.2f}" for k, v in part.items() if k != "total") +
                  f"  | total {part['total'] / 2**30:6.2f} GB of {gb} -> "
                  f"{'fits' if memplan.fits(part['total'], gb * 2**30) else 'does NOT fit'}")
        raise SystemExit
    if args.dry_run:
        dry_run(args.dry_run, args.sampler, "runs/dry-run")
        raise SystemExit
    if args.repeats < 1:
        raise SystemExit("bench.py: --repeats must be >= 1")
    if args.only == "step":  # train.py processes: the model loads in each
        time_step(args.model, args.repeats, args.threads, args.against, args.before, args.step_flags)
        raise SystemExit
    if args.only in ("all", "envs"):
        time_envs(args.env_seeds)
    if args.only == "envs":
        raise SystemExit
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    print(f"torch {torch.__version__}  device {args.device}  dtype {dtype}  threads {torch.get_num_threads()}")
    if args.model == "qwen2.5-0.5b-random":
        model, tok = qwen25_05b_random(args.device, dtype), None
    else:
        t = time.time()
        model, tok = models.load_model(args.model, device=args.device, dtype=dtype, check=sampler.self_check)
        print(f"load_model({args.model!r}): {time.time() - t:.2f} s")  # 'tiny' was once asserted < 1 s in a test
    if tok is not None and args.only in ("all", "sampler"):
        time_ours_vs_hf(model, first_turn_prompts(tok, args.batch), args.new_tokens, args.device, tok.pad_token_id or 0,
                        args.repeats)
    if tok is not None and args.only in ("all", "kv"):
        time_kv_reuse(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens, args.repeats)
    if tok is not None and args.only == "cut":
        time_answer_cut(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens, args.repeats)
    if args.only == "prefill":  # sampler.PREFILL_MULTIPLE against exact lengths, side by side
        ragged = [torch.randint(0, model.config.vocab_size, (args.prompt_len - i % 61,)).tolist() for i in range(args.batch)]
        time_prefill_buckets(model, tok, first_turn_prompts(tok, args.batch) if tok is not None else ragged,
                             args.new_tokens, args.group_size, args.turns, args.turn_tokens, args.device, args.repeats)
    if tok is not None and args.only == "window":
        time_windows(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens, rounds=args.repeats)
    if tok is not None and args.only == "logprobs":
        time_logprobs(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens, rounds=args.repeats)
    if args.only == "decode" or (args.only == "all" and args.device.startswith("cuda")):
        time_decode_floor(model, args.batch, args.prompt_len, args.new_tokens, args.device, args.bandwidth)
    if tok is None and args.only in ("all", "sampler"):  # the random-weight model: HF generate on random prompts
        time_ours_vs_hf(model, torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len)).tolist(),
                        args.new_tokens, args.device, repeats=args.repeats)
