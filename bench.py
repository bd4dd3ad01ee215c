"""Performance measurements, printed side by side from one run. One function per measurement.

  python bench.py                                  # CPU: smollm2, batch 32: our sampler vs HF generate, KV reuse vs re-prefill
  python bench.py --only sampler --batch 8 --new-tokens 32
  python bench.py --only envs                      # reset / step medians of every env preset
  python bench.py --only logprobs --batch 4 --turns 3 --turn-tokens 24    # the update's lm_head: sampled tokens only
  python bench.py --device cuda --model qwen2.5-0.5b-random --batch 128 --prompt-len 1024   # GPU: + bandwidth floor

"qwen2.5-0.5b-random" is a random-weight model with the Qwen2.5-0.5B shape (speed only, no tokenizer).
"""
import argparse
import time

import torch

import rollout
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
        ids = tok.encode(head + user + gen + "<think>", add_special_tokens=False)
        cut = len(tok.encode(head, add_special_tokens=False))
        prompts.append(ids[:cut] + ids[cut + i % 9:])
    return prompts


def time_ours_vs_hf(model, prompts, new_tokens, device, pad_id=0):
    """Same prompts, same settings (T=1, top-p 1, no top-k, exactly new_tokens per row): tokens/s of each."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)   # [B, L] left-padded for HF
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)

    def ours(n):
        return rollout.generate(model, prompts, n, stop_ids=(), temperature=1.0, seed=0)

    def hf(n):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
    rows = {}
    for name, fn in (("ours", ours), ("hf_generate", hf)):
        fn(4)  # warm-up (and, on CUDA, compilation / graph capture for the short run)
        if torch.device(device).type == "cuda":
            fn(new_tokens)
        sync(device)
        t = time.perf_counter()
        fn(new_tokens)
        sync(device)
        rows[name] = time.perf_counter() - t
    for name, s in rows.items():
        print(f"{name:12s} batch {B}  prompt {min(map(len, prompts))}-{L} tok  {new_tokens} new/row  "
              f"{s:7.2f} s  {B * new_tokens / s:8.1f} tok/s (prefill included)")
    print(f"ratio ours/hf_generate tokens/s: {rows['hf_generate'] / rows['ours']:.2f}x")
    return rows


def time_kv_reuse(model, tok, batch, group_size, turns, turn_tokens):
    """A multi-turn Sokoban rollout, with the KV cache kept across turns vs the whole history re-prefilled."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    seeds = [i // group_size for i in range(batch)]
    run = lambda reuse, n_turns, n_tok: rollout.rollout(
        model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)], seeds, preset, group_size=group_size,
        max_turns=n_turns, max_new_tokens=n_tok, kv_reuse=reuse, sample_seed=0)
    run(True, 1, 2)  # warm-up
    rows = {}
    for reuse in (True, False):
        t = time.perf_counter()
        out = run(reuse, turns, turn_tokens)
        rows[reuse] = (time.perf_counter() - t, out)
    (a, out_a), (b, out_b) = rows[True], rows[False]
    same = torch.equal(out_a["tokens"], out_b["tokens"])
    lp = (out_a["old_logp"] - out_b["old_logp"]).abs().max().item() if same else float("nan")
    print(f"kv_reuse     batch {batch} (groups of {group_size})  {turns} turns x <= {turn_tokens} tok  "
          f"final length {out_a['tokens'].shape[1]} tok  turns played {out_a['stats']['num_turns'].mean():.1f}")
    print(f"  reuse {a:7.2f} s   re-prefill {b:7.2f} s   speed-up {b / a:.2f}x   "
          f"same tokens: {same}   max |logp diff| {lp:.1e}")
    return rows


def time_windows(model, tok, batch, group_size, turns, turn_tokens, window=2, rounds=3):
    """What a context window costs (rollout's max_context_window): when a window drops a turn the KV-cache row is
    prefilled again from slot 0. Prefilled tokens are exact; times are the min of interleaved rounds."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    seeds = [i // group_size for i in range(batch)]
    run = lambda **kw: rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)], seeds, preset,
                                       group_size=group_size, max_turns=turns, max_new_tokens=turn_tokens, sample_seed=0, **kw)
    cfgs = {"full, KV kept": {}, "full, re-prefill every turn": dict(kv_reuse=False),
            f"limited_multi_turn, window {window}": dict(window=window, window_mode="limited_multi_turn"),
            f"limited_multi_turn, window {window}, re-prefill": dict(window=window, window_mode="limited_multi_turn", kv_reuse=False),
            f"single_turn, window {window}": dict(window=window, window_mode="single_turn")}
    best, outs = {}, {}
    for _ in range(rounds):
        for name, kw in cfgs.items():
            t = time.perf_counter()
            outs[name] = run(**kw)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    for name, out in outs.items():
        st = out["stats"]
        print(f"{name:40s} {best[name]:7.2f} s  prefilled {int(st['prefill_tokens'].sum()):6d} tok  sampled "
              f"{int(st['response_tokens'].sum()):5d} tok  row rebuilds {int(st['context_rebuilds'].sum()):3d}  rows {len(out['episode'])}")
    return best, outs


def time_logprobs(model, tok, batch, group_size, turns, turn_tokens, micro=4, rounds=2):
    """The update's log-prob pass (starpo.token_logprobs, forward + backward) on SimpleSokoban rollout rows,
    with lm_head over every real position against only the loss-masked (sampled) ones, as train.py runs it.
    Times are the min of interleaved rounds; the two must agree on the sampled tokens' log-probs."""
    from env_sokoban import PRESETS, SokobanEnv
    preset = PRESETS["SimpleSokoban"]
    out = rollout.rollout(model, tok, [SokobanEnv(**preset["kwargs"]) for _ in range(batch)],
                          [i // group_size for i in range(batch)], preset, group_size=group_size, max_turns=turns,
                          max_new_tokens=turn_tokens, sample_seed=0)
    tokens, am, lm = out["tokens"], out["attention_mask"], out["loss_mask"]  # [B, T] each
    best, lps = {}, {}
    for _ in range(rounds):
        for name, use in (("every position", False), ("loss-masked only", True)):
            t, lps[name] = time.perf_counter(), []
            for s in range(0, batch, micro):
                lp, ent = starpo.token_logprobs(model, tokens[s:s + micro], am[s:s + micro], with_entropy=True,
                                                mask=lm[s:s + micro] if use else None)
                ((lp * lm[s:s + micro]).sum() + (ent * lm[s:s + micro]).sum()).backward()
                lps[name].append((lp * lm[s:s + micro]).detach())
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    diff = max((a - b).abs().max().item() for a, b in zip(*lps.values()))
    print(f"log-probs fwd+bwd, {batch} rows x {tokens.shape[1]} slots: {int(am.sum())} real tokens, {int(lm.sum())} sampled "
          f"({lm.sum() / am.sum():.1%})")
    for name, t in best.items():
        print(f"  lm_head on {name:18s} {t:7.2f} s")
    print(f"  speedup {best['every position'] / best['loss-masked only']:.2f}x, max |log-prob difference| {diff:.2e}")
    return best


def time_decode_floor(model, batch, prompt_len, new_tokens, device, bandwidth):
    """Decode-only tokens/s at a given context, and its fraction of the memory-bandwidth floor
    (PERF_AND_PEERS.md 2.2: weights except the input embedding + every row's K/V read once per step)."""
    cfg = model.config
    V = cfg.vocab_size
    prompts = torch.randint(0, V, (batch, prompt_len)).tolist()
    step_ms = []
    for n in (1, 1 + new_tokens):  # decode time = (prefill + n steps) - (prefill + 1 step)
        for _ in range(2):         # first call of each length warms up / captures
            sync(device)
            t = time.perf_counter()
            rollout.generate(model, prompts, n, stop_ids=(), seed=0)
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
    import env_bandit
    import env_countdown
    import env_frozenlake
    import env_sokoban
    import env_webshop
    for cls, presets in ((env_bandit.BanditEnv, env_bandit.PRESETS), (env_sokoban.SokobanEnv, env_sokoban.PRESETS),
                         (env_frozenlake.FrozenLakeEnv, env_frozenlake.PRESETS), (env_webshop.WebShopEnv, env_webshop.PRESETS),
                         (env_countdown.CountdownEnv, env_countdown.PRESETS)):
        for name, preset in presets.items():
            env, resets, steps = cls(**preset["kwargs"]), [], []
            for seed in range(n_seeds):
                t = time.perf_counter()
                env.reset(seed)
                resets.append(time.perf_counter() - t)
                rng = random.Random(seed)  # Countdown takes free text: the random policy's expression
                action = rng.choice(env.actions()) if env.actions() else env_countdown.random_answer(env.nums, rng)
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
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------------ memory plan
# Peak memory per rank of `train.py`, part by part, from the model config and the flags. The parts are the ones
# train.py allocates: fp32 master weights, grads and AdamW states (sharded 1/W by FSDP2), the critic's trunk,
# the reference model, the rollout copy (unsharded, bf16 on GPU), the sampler's static KV pool, and the update's
# transients: what autograd holds for backward in one micro-batch, autocast's bf16 weight copies, and one
# token_logprobs chunk of logits. Activation bytes per token per layer are counted from what autograd saves in a
# Llama / Qwen2 layer (checked against saved_tensors_hooks on the CPU by test_memory_plan_*; fp32 and bf16):
#   fp32:          4 * (6d + 4I + 2HD + 2KvD + H + 2)          (norms 3d+1 each, q k v out, lse, MLP 4I)
#   bf16 autocast: 26d + 8 + 4HD + 4KvD + 4H + 8I              (fp32 norms + a bf16 cast per Linear input)
#   checkpointed:  4d per layer (the fp32 layer input) + one layer's full set while it is recomputed
#   outside layers: 12d + 8 (token ids, final norm, the log-prob chunks' inputs)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                  rms_norm_eps=1e-6)


def plan_memory(cfg, *, world=1, rows=128, micro=4, seq=3600, critic=True, ref=False, bf16=True, ckpt=False, chunk=256):
    """Expected bytes per rank by part. cfg: an HF config; rows: trajectories rolled out per step (all ranks);
    micro: rows per forward/backward; seq: the longest conversation (--max-context)."""
    d, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or d // H
    layer = d * (H * D + 2 * KV * D) + 2 * KV * D + H * D + H * D * d + 3 * d * I + 2 * d  # q k v (+biases) o, MLP, norms
    embed = V * d
    P = L * layer + embed * (1 if cfg.tie_word_embeddings else 2) + d
    trunk = P - (0 if cfg.tie_word_embeddings else embed) + d + 1                           # critic: no lm_head, + value head
    rb = 2 if bf16 else 4
    per_tok = (26 * d + 8 + 4 * H * D + 4 * KV * D + 4 * H + 8 * I) if bf16 else 4 * (6 * d + 4 * I + 2 * H * D + 2 * KV * D + H + 2)
    tokens = micro * seq
    acts = (L * 4 * d if ckpt else L * per_tok) * tokens + (12 * d + 8) * tokens  # + ids, final norm, chunk inputs
    slots = (seq + 1) // 128 * 128 + 128                        # rollout.static_capacity(max_context + 1)
    part = dict(
        weights=4 * P / world, grads=4 * P / world, adamw=8 * P / world,
        critic=16 * trunk / world if critic else 0, reference=4 * P / world if ref else 0,
        rollout_copy=rb * P if (world > 1 or bf16) else 0,
        kv_pool=L * 2 * (rows // world) * KV * slots * D * rb,
        activations=acts,                                       # held from forward to backward
        recompute=(per_tok * tokens + (2 * layer if bf16 else 0)) if ckpt else 0,  # ckpt: one layer rebuilt in backward
        # autocast's bf16 copies held to backward (checkpointed layers recast theirs); FSDP2: bf16 root + 2 blocks
        weight_casts=0 if not bf16 else 2 * (embed + 2 * layer) if world > 1 else 2 * embed if ckpt else 2 * P,
        logprob_chunk=4 * min(chunk, micro * seq) * V * 4,      # logits, log_softmax, probs, p*logp of one chunk, fp32
    )
    part["total"] = sum(part.values())
    return part


def print_plan(name, cfg, gpu_gb, **kw):
    part = plan_memory(cfg, **kw)
    gb = {k: v / 2**30 for k, v in part.items()}
    fits = "fits" if gb["total"] <= gpu_gb * 0.92 else "does NOT fit"   # ~8% for the CUDA context and fragmentation
    print(f"{name:34s} " + "  ".join(f"{k} {v:5.2f}" for k, v in gb.items() if k != "total") +
          f"  | total {gb['total']:6.2f} GB of {gpu_gb} -> {fits}")
    return part


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
    tok.chat_template = rollout.CHATML
    cfg = Qwen2Config(**dict(QWEN25_05B, num_hidden_layers=layers), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert len(tok) == cfg.vocab_size, len(tok)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


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
           "--val-every", "0", "--collapse-every", "0", "--steps", "1", "--sampler", sampler, "--out", out]
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
    parser.add_argument("--only", default="all", choices=["all", "sampler", "kv", "window", "decode", "envs", "logprobs"],
                        help="which measurement (window: the KV-row rebuilds of a context window; not in all)")
    parser.add_argument("--plan", action="store_true", help="print the memory plan of the paper's config on 24 GB, 1 and 8 H100s")
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
    args = parser.parse_args()
    if args.plan:  # the paper's StarPO-S PPO config: 8 groups x 16, max_context 3600, micro-batch 4, bf16
        from transformers import Qwen2Config
        cfg = Qwen2Config(**QWEN25_05B)
        for name, gb, kw in [("1 x 24 GB", 24, {}), ("1 x 24 GB, ckpt, micro 1", 24, dict(ckpt=True, micro=1)),
                             ("1 x 24 GB, grpo, ckpt", 24, dict(ckpt=True, critic=False)),
                             ("1 x H100 80 GB", 80, {}), ("1 x H100, --grad-checkpointing", 80, dict(ckpt=True)),
                             ("8 x H100 (per rank)", 80, dict(world=8)), ("8 x H100, --grad-checkpointing", 80, dict(world=8, ckpt=True))]:
            print_plan(name, cfg, gb, **kw)
        raise SystemExit
    if args.dry_run:
        dry_run(args.dry_run, args.sampler, "runs/dry-run")
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
        model, tok = rollout.load_model(args.model, device=args.device, dtype=dtype)
        print(f"load_model({args.model!r}): {time.time() - t:.2f} s")  # 'tiny' was once asserted < 1 s in a test
    if tok is not None and args.only in ("all", "sampler"):
        time_ours_vs_hf(model, first_turn_prompts(tok, args.batch), args.new_tokens, args.device, tok.pad_token_id or 0)
    if tok is not None and args.only in ("all", "kv"):
        time_kv_reuse(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens)
    if tok is not None and args.only == "window":
        time_windows(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens)
    if tok is not None and args.only == "logprobs":
        time_logprobs(model, tok, args.batch, args.group_size, args.turns, args.turn_tokens)
    if args.only == "decode" or (args.only == "all" and args.device.startswith("cuda")):
        time_decode_floor(model, args.batch, args.prompt_len, args.new_tokens, args.device, args.bandwidth)
    if tok is None and args.only in ("all", "sampler"):  # the random-weight model: HF generate on random prompts
        time_ours_vs_hf(model, torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len)).tolist(),
                        args.new_tokens, args.device)
