"""Performance measurements, printed side by side from one run. One function per measurement.

  python bench.py                                  # CPU: smollm2, batch 32: our sampler vs HF generate, KV reuse vs re-prefill
  python bench.py --only sampler --batch 8 --new-tokens 32
  python bench.py --only envs                      # reset / step medians of every env preset
  python bench.py --only logprobs --batch 4 --turns 3 --turn-tokens 24    # the update's lm_head: sampled tokens only
  python bench.py --only step --threads 2 --repeats 2   # one multi-turn PPO train.py step by phase (--against DIR: vs another checkout)
  python bench.py --only cut --batch 32 --turns 3 --turn-tokens 48   # turns cut at </answer> vs run to a stop token
  python bench.py --device cuda --model qwen2.5-0.5b-random --batch 128 --prompt-len 1024   # GPU: + bandwidth floor
  python bench.py --gpu-check                      # = python gpu_check.py: first thing on a GPU machine
  python bench.py --only prefill --repeats 5       # prefill shapes rounded up (sampler.PREFILL_MULTIPLE) vs exact lengths
  python bench.py --only host --model qwen2.5-0.5b-random --batch 16 --prompt-len 1024   # host us and ops per decode token
  python bench.py --plan --markdown > results/memory-plan.md   # the memory-plan page (the suite compares it)

"qwen2.5-0.5b-random" is a random-weight model with the Qwen2.5-0.5B shape (speed only, no tokenizer).
"""
import argparse
import models
import time

import torch

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


# ------------------------------------------------------------------------------------------------ host cost per decode step
class CannedBackend:
    """A torch.compile backend that runs nothing: each graph runs once for real (its first call, which gives its
    outputs' shapes and dtypes) and every later call returns those same tensors. What a compiled decode call then
    costs is the host's part alone: dynamo's guards, the call, and what the loop does between calls.
    stamps: (time.perf_counter(), time.process_time()) at the start of every call."""

    def __init__(self):
        self.stamps = []

    def __call__(self, gm, example_inputs):
        outs = []

        def run(*args):
            self.stamps.append((time.perf_counter(), time.process_time()))
            if not outs:
                outs.append(gm.forward(*args))
            return outs[0]
        return run


def outside_ops(prof):
    """{aten op: count} of a torch.profiler profile, counting each op the Python code called (not the ops it calls in
    turn) and none run inside a compiled region."""
    import collections
    ops = collections.Counter()
    for e in prof.events():
        p = e.cpu_parent
        while p is not None and not p.name.startswith(("aten::", "Torch-Compiled Region")):
            p = p.cpu_parent
        if e.name.startswith("aten::") and p is None:
            ops[e.name] += 1
    return ops


def time_host_per_step(model, tok, rows, context, new_tokens, repeats, every=8):
    """The host's time per decode token of the GPU sampler (static pool, compiled decode step, "all done" checked every
    `every` tokens, turns cut at </answer>) under CannedBackend, so that nothing runs inside a compiled call: from the
    first decode call to the end of the turn, over the turn's decode tokens. And the aten ops per token the decode
    loop runs outside compiled calls (torch.profiler): the difference between turns of 2 x new_tokens and new_tokens
    tokens over new_tokens, so the per-turn ops cancel. Every row holds `context` tokens (of any value: only the key
    length matters here) and appends one before sampling. Returns ([(wall, CPU) seconds per token of each turn], ops per token,
    {op: per token})."""
    canned = CannedBackend()
    how = sampler.Sampler(static=True, compile=canned, check_every=every)
    stop_at = rollout.answer_end(tok, rollout.FORCED[False], False)
    stop_ids = {tok.eos_token_id, tok.pad_token_id} - {None}
    cache = sampler.KVCache(model, rows, sampler.static_capacity(context + 2 * new_tokens + 1), static=True)
    keys = sampler.row_keys(range(rows))

    def turn(n):  # (wall, CPU) seconds from the first decode call to the turn's end
        cache.lens.fill_(context)
        canned.stamps.clear()
        sampler.sample_turn(model, cache, [[5]] * rows, n, stop_ids, keys, sampler=how, stop_at=stop_at)
        return time.perf_counter() - canned.stamps[1][0], time.process_time() - canned.stamps[1][1]  # [0]: sample_next
    for n in (new_tokens, 2 * new_tokens):  # compiles (the key length crosses a bucket) and runs each graph once
        turn(n)
    per_token = [[t / (new_tokens - 1) for t in turn(new_tokens)] for _ in range(repeats)]  # [repeats] x (wall, CPU)
    counts = []
    for n in (new_tokens, 2 * new_tokens):
        with torch.profiler.profile() as prof:
            turn(n)
        counts.append(outside_ops(prof))
    ops = {k: (counts[1][k] - counts[0][k]) / new_tokens for k in counts[1] if counts[1][k] != counts[0][k]}
    us = lambda i: (f"min {min(t[i] for t in per_token) * 1e6:.0f}, median "
                    f"{sorted(t[i] for t in per_token)[len(per_token) // 2] * 1e6:.0f}")
    print(f"host         {rows} rows, context {context}, {new_tokens} tokens a turn, check every {every}, cut at </answer>: "
          f"us per decode token over {repeats} turns: CPU time {us(1)}; wall {us(0)}; {sum(ops.values()):.2f} aten ops "
          f"per token outside compiled calls: "
          + ", ".join(f"{k[6:]} {v:.2f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
    return per_token, sum(ops.values()), ops


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
# results/memory-plan.md is the page `bench.py --plan --markdown` prints (plan_page) from these lists, and
# test_memory_plan_page_is_what_bench_prints fails while the committed page differs from what it prints.
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
    ("Qwen2.5-7B-Instruct", QWEN25_7B, 8, "--env sokoban --algo ppo --grad-checkpointing --micro-batch-size 2",
     dict(world=8, ckpt=True, micro=2)),
]


def plan_tables():
    """The memory-plan tables in markdown, from memplan: (the paper's configuration by part on three cards, the
    totals of PLAN_COMMANDS on 80 GB cards)."""
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


def plan_page():
    """results/memory-plan.md, whole: the two tables of plan_tables and the text that reads them. Links are relative
    to results/."""
    settings, commands = plan_tables()
    return f"""# Memory plan

Generated by `python bench.py --plan --markdown > results/memory-plan.md`; do not edit by hand (the suite's
`test_memory_plan_page_is_what_bench_prints` compares this file with what the command prints).

Arithmetic, not measurements: predicted by `memplan.py`, whose parts `test_memory_plan_*` checks
against CPU measurements ([method](../docs/sampler.md#the-memory-plan-memplanpy-trainpy---plan)); the
measured speed and memory are in [performance.md](performance.md). The paper's StarPO-S PPO
configuration: Qwen2.5-0.5B, 8 groups × 16 trajectories, `--max-context 3600`, micro-batch 4, bf16
compute, fp32 weights and AdamW, every row 3,600 tokens long. GB per rank (`python bench.py --plan`
prints every part on its own):

{settings}

Without checkpointing, the activations of four 3,600-token rows are most of the peak; that is
where 24 GB cards run out. On a 24 GB card the paper's PPO does not fit even with checkpointing and
micro-batch 1; GRPO (no critic) with checkpointing does. The KV pool stays allocated through the
update (CUDA graphs need fixed addresses).

The README's GPU commands and RAGEN-2's main table ([docs/ragen.md](../docs/ragen.md#ragen-2s-main-table))
on 80 GB cards (fits = under 92%), as `python train.py --plan RANKS --model <config dir> <flags>`
prints them with the model's config written into a local directory
(`test_memory_plan_commands_are_what_train_py_plans` runs each one):

{commands}
"""


# ------------------------------------------------------------------------------------------------ paper-shape dry run
def qwen25_tokenizer():
    """A byte-level Qwen2Tokenizer with the ChatML template whose vocabulary is padded to Qwen2.5's 151,936 entries
    with 2- and 3-byte strings (encode never makes them, decode reads them as bytes)."""
    import itertools
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer
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
    return tok


def save_qwen25_shape(path, layers=24):
    """A random model with Qwen2.5-0.5B-Instruct's exact shape (layers may be cut) and qwen25_tokenizer(), saved as a
    hub-like directory: train.py loads it like a real snapshot."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = qwen25_tokenizer()
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | a directory | hub id | qwen2.5-0.5b-random")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="all", choices=["all", "sampler", "kv", "cut", "window", "decode", "envs", "logprobs", "step",
                                                          "prefill", "host"],
                        help="which measurement (window: the KV-row rebuilds of a context window; prefill: bucketed "
                        "prefill shapes against exact lengths; host: the host's time and ops per decode token of the "
                        "compiled sampler, nothing run on the device; none of the three in all)")
    parser.add_argument("--plan", action="store_true", help="print the memory plan of the paper's config on 24 GB, 1 and 8 H100s")
    parser.add_argument("--markdown", action="store_true", help="with --plan: the page results/memory-plan.md (the paper's "
                        "config by part, the README's GPU commands); the suite compares it with the committed one")
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
    parser.add_argument("--gpu-check", action="store_true", help="gpu_check.py's PASS / FAIL checks of the GPU "
                        "path (on the CPU: with the CUDA-graph emulations); exits 1 on any FAIL")
    args = parser.parse_args()
    if args.gpu_check:  # the checks live in gpu_check.py; nothing else here imports it
        import gpu_check
        raise SystemExit(1 if gpu_check.main("cuda" if torch.cuda.is_available() else "cpu", bandwidth=args.bandwidth) else 0)
    if args.plan and args.markdown:  # results/memory-plan.md, whole
        print(plan_page(), end="")
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
    if args.only == "host":  # the random-weight model gets the byte-level tokenizer of its vocabulary size
        time_host_per_step(model, tok or qwen25_tokenizer(), args.batch, args.prompt_len, args.new_tokens, args.repeats)
    if args.only == "decode" or (args.only == "all" and args.device.startswith("cuda")):
        time_decode_floor(model, args.batch, args.prompt_len, args.new_tokens, args.device, args.bandwidth)
    if tok is None and args.only in ("all", "sampler"):  # the random-weight model: HF generate on random prompts
        time_ours_vs_hf(model, torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len)).tolist(),
                        args.new_tokens, args.device, repeats=args.repeats)
