"""The agent loop (RAGEN's ctx_manager + es_manager): from "a model and a batch of environments" to "token tensors
with loss masks". Prompts, parsing, stepping, penalties, and one token sequence per trajectory, never re-tokenised;
the tokens come from sampler.py, turn by turn, on one KV cache.
"""
import bisect
import re

import torch

from sampler import KVCache, row_keys, sample_turn, sampler_settings, shared_prefixes, static_capacity

# The turn format (RAGEN's), declared once: the tags of a turn's think and answer spans, the separator between a
# turn's actions, and what is built from them: the tag forced after the generation prompt (FORCED), the tag that
# closes the span the collapse diagnostics read (SPAN_CLOSE), the format line of every turn prompt (FORMATS), the
# pattern that parses a turn (TURN_PATTERNS, RAGEN's _parse_response) and the strings stripped from its parts
# (SPECIAL_STRINGS). Every function here and sft.py's demonstrations use these names; the env instructions write
# their example answers out in their own text (docs/reference.md, "Change the turn format").
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
ACTION_SEP = "||"  # actions are split at it; retold turns and demonstrations join them with " || "
FORCED = {True: THINK_OPEN, False: ANSWER_OPEN}        # think mode -> the tag a turn is forced to open with
SPAN_CLOSE = {True: THINK_CLOSE, False: ANSWER_CLOSE}  # think mode -> the tag that closes reasoning_span's z
FORMATS = {True: f"{THINK_OPEN} [Your thoughts] {THINK_CLOSE} {ANSWER_OPEN} [your answer] {ANSWER_CLOSE}",
           False: f"{ANSWER_OPEN} [your answer] {ANSWER_CLOSE}"}
TURN_PATTERNS = {
    True: re.compile(rf"{re.escape(THINK_OPEN)}(.*?){re.escape(THINK_CLOSE)}\s*{re.escape(ANSWER_OPEN)}(.*?)"
                     rf"{re.escape(ANSWER_CLOSE)}", re.DOTALL),
    False: re.compile(rf"{re.escape(ANSWER_OPEN)}(.*?){re.escape(ANSWER_CLOSE)}", re.DOTALL)}
SPECIAL_STRINGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, "<|im_start|>", "<|im_end|>")

SYSTEM = "You're a helpful assistant. "  # RAGEN ctx_manager system prompt (trailing space included)


def system_message(preset):
    """The system message's text. RAGEN-2's presets (preset["instruction_in_system"]) append the instruction to
    SYSTEM (RAGEN-2 ctx_manager._build_system_content); v1's keep SYSTEM alone and open the first user message
    with the instruction (opening_message)."""
    return SYSTEM + preset["instruction"] if preset.get("instruction_in_system") else SYSTEM


RETRY = "No valid action provided previously. Environment state remains the same. Please try again.\n"


def turn_prompt(preset, turn, state, actions_left, think, retry=False):
    """RAGEN ctx_manager.get_lm_inputs: the '\\nTurn i:' block of a user message. retry: RAGEN-2's line after a turn
    with no valid action (its presets only, as the other RAGEN-2 prompt changes)."""
    return (f"\nTurn {turn}:\nState:\n{state}\n{RETRY if retry else ''}You have {actions_left} actions left. Always output: "
            f"{FORMATS[think]} with no extra text. Strictly follow this format. Max response length: {preset['max_tokens']} "
            "words (tokens).\n")


def chat_pieces(tok, system=SYSTEM):
    """Cut the chat template into the texts that surround messages, so that a conversation can be
    built by appending tokens: first = head + user + gen; next turns = close + user_head + user + gen.
    head holds the system message with the text `system`, as the template renders it.
    The check: appending gives exactly the template's own rendering of the conversation with the earlier
    assistant turn as history. Qwen3's template renders a *last* assistant turn with an empty think block
    but history turns without one, so the history rendering is the one to match (README 'Models').
    Works for ChatML-style templates (Qwen2.5, Qwen3, SmolLM2, tiny) and Llama 3.x; others get a clear error."""
    U, A = "\x01USER\x01", "\x01ASSISTANT\x01"
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    sys_u = [{"role": "system", "content": system}, {"role": "user", "content": U}]
    asst = {"role": "assistant", "content": A}
    head, gen = render(sys_u, True).split(U)
    close = render(sys_u + [asst], False).split(A)[-1]             # after the turn, e.g. "<|im_end|>\n"
    two = render(sys_u + [asst, {"role": "user", "content": U}], True)
    user_head = two.split(A)[-1][len(close):].split(U)[0]
    if two != head + U + gen + A + close + user_head + U + gen:
        raise ValueError("the tokenizer's chat template is not append-only (ChatML-like); rollout cannot extend it")
    return head, gen, close, user_head


def parse_response(text, think, max_actions):
    """RAGEN ctx_manager._parse_response. text includes the forced tag (FORCED[think]) in front.
    Returns (think_text, actions, matched)."""
    match = TURN_PATTERNS[think].search(text)
    if match is None:
        return "", [], False
    parts = list(match.groups())
    for s in SPECIAL_STRINGS:
        parts = [p.replace(s, "") for p in parts]
    actions = [a.strip() for a in parts[-1].strip().split(ACTION_SEP) if a.strip()]
    return (parts[0].strip() if think else ""), actions[:max_actions], True


def answer_end(tok, forced, think):
    """sample_turn's stop_at for a turn that ends where RAGEN ends it: at the closing tag of its first match of
    RAGEN's pattern (think mode: the ANSWER_CLOSE that completes think-then-answer). Returns a function of a row's
    sampled tokens: the number of tokens up to and including the one that completes the match, or None while
    there is no match. The match of the kept tokens is the match of any longer text: the earliest-ending match
    also starts leftmost (the pattern's (.*?) may swallow an earlier opening tag), so parsing the
    cut turn gives the uncut turn's think and actions. A token that completes the tag and carries text past it
    is kept whole: the kept tokens are always a prefix of the sampled ones.
    stop_at(ids, start) tests only the cuts past `start` (the caller knows the first `start` tokens complete no
    turn), and only after a token that can hold the pattern's last character '>': every other character of the
    text up to that '>' is already in the shorter prefix (bytes of ASCII never change with the bytes after them),
    so no match can end anywhere else. A turn of N tokens with k such tokens costs at most k decodes of <= N."""
    pattern = TURN_PATTERNS[think]
    # tokens whose stored string holds '>': as itself (byte-level BPE) or inside '<0x3E>' (byte fallback); ~30 ms
    closers = {i for i, s in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))) if ">" in s}
    found = lambda ids, n: pattern.search(forced + tok.decode(ids[:n], skip_special_tokens=True)) is not None

    def stop_at(ids, start=0):
        return next((n for n in range(start + 1, len(ids) + 1) if ids[n - 1] in closers and found(ids, n)), None)
    return stop_at


def reasoning_span(tok, tokens, loss_mask, turn_end, think):
    """RAGEN-2's (x, z) of one turn, for train.py's collapse diagnostics. tokens, loss_mask: one rollout row as
    lists; turn_end: the turn's last sampled position (rollout's turn_ends). x = every token before the turn's
    first sampled token: the conversation so far, ending with the forced tag (FORCED[think]).
    z = the sampled tokens of the think (no-think: answer) span, up to the first token that reaches its closing
    tag (SPAN_CLOSE[think]), or up to the end of the turn's text when the tag never closes (a trailing stop token
    is not text). Returns (x, z) as token lists; z may be empty."""
    start = turn_end
    while start > 0 and loss_mask[start - 1]:  # the turn's sampled tokens are one contiguous span
        start -= 1
    resp = tokens[start:turn_end + 1]
    length = lambda n: len(tok.decode(resp[:n], skip_special_tokens=True))  # characters of the first n tokens
    text = tok.decode(resp, skip_special_tokens=True)
    cut = text.find(SPAN_CLOSE[think])
    n = bisect.bisect_left(range(len(resp) + 1), len(text) if cut < 0 else cut, key=length)
    return tokens[:start], resp[:n]


def step_env(env, actions, budget):
    """RAGEN es_manager.step: execute the valid actions in order, at most `budget` of them, stopping when
    the episode ends. Invalid ones (env says action_is_valid=False) are no-ops that cost no budget.
    Returns (reward, done, info of the last step, counts, infos of the executed steps).
    The reward is RAGEN-2's acc_reward: the int 0 plus each executed step's reward as the env returns it, so the
    "Reward:" lines print as RAGEN-2's do (0 for a FrozenLake turn of int rewards or a turn that executes nothing,
    -0.2 for two Sokoban steps)."""
    names = env.actions()
    lookup = None if names is None else {a.strip().lower() for a in names}
    reward, done, info, infos = 0, False, {}, []
    c = dict(executed=0, valid=0, invalid=0, effective=0)
    for a in actions:
        if done or c["executed"] >= budget:  # not executed; RAGEN still checks it against the lookup
            ok = lookup is None or a.lower() in lookup
            c["valid" if ok else "invalid"] += 1
            continue
        _, r, done, info = env.step(a)
        if not info["action_is_valid"]:
            c["invalid"] += 1
            continue
        c["valid"] += 1
        c["executed"] += 1
        c["effective"] += bool(info["action_is_effective"])
        reward += r
        infos.append(info)
    return reward, done, info, c, infos


def append(ep, ids, lp=None):
    """Append tokens to episode ep's conversation; lp None: forced tokens (template, observation), loss 0."""
    ep["ids"] += ids
    ep["sampled"] += [lp is not None] * len(ids)
    ep["logps"] += lp if lp is not None else [0.0] * len(ids)


def retell(ep, lo, turn, think, format_penalty):
    """single_turn: turns lo..turn-1 of episode ep as text (RAGEN-2's wording)."""
    if lo >= turn:
        return ""
    text = (f"Summary: {turn - 1} step(s) completed so far. Showing the last {turn - lo} turn(s) with "
            "state/action/reward details. Recent turns:\n---\n")
    for t in range(lo, turn):
        r = ep["responses"][t - 1]
        joined = f" {ACTION_SEP} ".join(r["actions"])
        said = (f"{THINK_OPEN}{r['think']}{THINK_CLOSE}" if think else "") + f"{ANSWER_OPEN}{joined}{ANSWER_CLOSE}"
        text += (f"Turn {t} State:\n{ep['states'][t - 1]}\nTurn {t} Action: {said if r['matched'] else r['raw']}\n"
                 f"Turn {t} Reward: {r['reward'] + (format_penalty if r['penalized'] else 0)}\n---\n")
    return text


def opening_message(ep, t, lo, first_shown, chat, preset, think, format_penalty):
    """Token ids of the user message that opens turn t of episode ep when turn lo opens the conversation: turn lo
    after the system message, with the instruction unless the system message holds it (system_message; single_turn:
    turns first_shown..t-1 retold before the turn), later turns with RAGEN's "Reward:" feedback sharing the message.
    chat: (tokenizer, head, user_head, gen + the forced tag) of chat_pieces(tok, system_message(preset))."""
    tok, head, user_head, tail = chat
    if t == lo:
        instruction = "" if preset.get("instruction_in_system") else preset["instruction"]
        text = head + instruction + retell(ep, first_shown, t, think, format_penalty) + ep["users"][t - 1] + tail
    else:
        text = user_head + f"Reward:\n{ep['turn_rewards'][t - 2]}\n" + ep["users"][t - 1] + tail
    return tok.encode(text, add_special_tokens=False)


def rebuild_window(ep, lo, turn, shown, chat, preset, think, format_penalty):
    """Turns left the prompt: episode ep's conversation again, from turn lo to turn-1, re-rendered from the turns'
    own tokens (answers and closing tokens as they were sampled or forced)."""
    ep.update(ids=[], sampled=[], logps=[], turn_ends=[])
    for t in range(lo, turn):
        out, lp, closing = ep["answers"][t - 1]
        append(ep, opening_message(ep, t, lo, shown, chat, preset, think, format_penalty))
        append(ep, out, lp)
        ep["turn_ends"].append(len(ep["ids"]) - 1)
        append(ep, closing)


def pack_rows(rows, pad):
    """Training rows [(episode, token ids, sampled flags, log-probs)] as right-padded tensors."""
    R, T = len(rows), max([len(r[1]) for r in rows], default=1)
    tokens = torch.full((R, T), pad, dtype=torch.long)                    # [R, T] right-padded
    attention_mask = torch.zeros(R, T, dtype=torch.bool)                  # [R, T]
    loss_mask = torch.zeros(R, T, dtype=torch.bool)                       # [R, T] 1 = sampled by the policy
    old_logp = torch.zeros(R, T)                                          # [R, T]
    for r, (_, ids, flags, lp) in enumerate(rows):
        L = len(ids)
        tokens[r, :L] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, :L] = True
        loss_mask[r, :L] = torch.tensor(flags, dtype=torch.bool)
        old_logp[r, :L] = torch.tensor(lp, dtype=torch.float)
    return tokens, attention_mask, loss_mask, old_logp


STATS = ("num_turns", "num_actions", "valid_actions", "invalid_actions", "effective_actions", "format_errors",
         "context_truncated", "response_tokens", "think_tokens", "prefill_tokens", "prefill_saved", "context_rebuilds")


def new_episode(budget):
    """One episode's state: its conversation (token ids, 1 where the policy sampled the token, their log-probs) and
    where its answers end in it; per turn: reward, parsed response, state, user message, (answer, log-probs,
    closing); per-episode counters (STATS), numeric env info values, format penalty, its action budget, how it ended."""
    return dict(ids=[], sampled=[], logps=[], turn_ends=[], turn_rewards=[], responses=[], states=[], users=[],
                answers=[], stats=dict.fromkeys(STATS, 0), extras={}, penalty=0.0, success=False, finished=False,
                shown_from=1, budget=budget)


# Context windows (RAGEN-2 agent_proxy.context_window_mode, max_context_window): window = k > 0 shows only
# the last k turns (the current one included; turn numbers kept), window = -1 all of them. window_mode:
#   full                one training row per episode, its whole conversation (with a window: the last one shown)
#   limited_multi_turn  one row per turn: exactly what the model saw at that turn, loss on that turn's answer only
#   single_turn         as limited_multi_turn, but the shown earlier turns are retold as text inside one
#                       user message (RAGEN-2 ctx_manager._build_single_turn_user_content)
# Rows then outnumber episodes: `episode` [R] says which episode each row belongs to. When the prompt stops
# being an extension of what the KV cache row holds (a window drops a turn; single_turn from turn 2 on), the
# row is re-prefilled from slot 0; stats count prefill_tokens and context_rebuilds per episode.
def open_turn(ep, env, turn, chat, preset, think, format_penalty, window, window_mode, room):
    """Append the user message that opens `turn` to episode ep. A context window that drops a turn re-renders the
    kept ones first (returns rebuilt=True: its KV row must be prefilled again). room: the most tokens the
    conversation may hold before the answer; past it the episode ends here, truncated. Returns (opened, rebuilt)."""
    ep["states"].append(env.render())
    retry = preset.get("instruction_in_system", False) and turn > 1 and ep["responses"][-1]["none_valid"]
    ep["users"].append(turn_prompt(preset, turn, ep["states"][-1], ep["budget"] - ep["stats"]["num_actions"], think, retry))
    shown = max(1, turn - window + 1) if window > 0 else 1  # first turn the model sees
    lo = turn if window_mode == "single_turn" else shown    # first turn given as chat messages
    rebuilt = lo != ep["shown_from"]
    if rebuilt:  # turns left the prompt: re-render the kept ones from their own tokens
        ep["shown_from"] = lo
        rebuild_window(ep, lo, turn, shown, chat, preset, think, format_penalty)
        ep["stats"]["context_rebuilds"] += 1
    ids = opening_message(ep, turn, lo, shown, chat, preset, think, format_penalty)
    if len(ep["ids"]) + len(ids) > room:
        ep["finished"] = True  # would not fit: end here, counted as truncated
        ep["stats"]["context_truncated"] = 1
        if turn == 1:
            append(ep, ids)  # keep the prompt for the logs; this row has no sampled tokens
        return False, rebuilt
    append(ep, ids)
    return True, rebuilt


def cache_rows(model, cache, rows, eps, new, rebuilt, kv_reuse, static, max_context, share_prefixes):
    """The KV cache for this turn's sampling: kept from the last turn (finished episodes dropped; static: kept as
    idle rows), or fresh (the first turn; every turn without kv_reuse, the re-prefill reference path). Rows whose
    window was rebuilt start again from slot 0. Counts prefill_tokens and prefill_saved (shared_prefixes, as
    sample_turn shares them). Returns (cache, rows: the episode of each cache row, todo: each row's new tokens)."""
    if cache is None or not kv_reuse:
        rows = list(range(len(eps))) if static else sorted(new)
        cache = KVCache(model, len(rows), static_capacity(max_context + 1) if static else 256, static=static)
    elif not static:
        keep = [i for i, b in enumerate(rows) if b in new]
        cache.select(keep)
        rows = [rows[i] for i in keep]
    for i, b in enumerate(rows):
        if b in rebuilt:  # the cache row holds turns the prompt no longer shows
            cache.lens[i] = 0
    lens = cache.lens.tolist()
    todo = [eps[b]["ids"][lens[i]:] if b in new else [] for i, b in enumerate(rows)]
    saved = shared_prefixes(todo)[1] if share_prefixes and not any(lens) else [0] * len(rows)
    for i, b in enumerate(rows):
        eps[b]["stats"]["prefill_tokens"] += len(todo[i])
        eps[b]["stats"]["prefill_saved"] += saved[i]
    return cache, rows, todo


def script_turn(respond, envs, rows, enc, close_ids, stop_at, max_new_tokens):
    """sft.py's demonstrations: respond(b, env)'s text for each row, laid out as a sampled turn (its tokens, then
    the stop token a sampler would draw, cut at the closing tag as stop_at cuts; mask 1, log-prob 0). No model,
    no cache. A text longer than a sampled answer could be is refused: the demonstration would lie."""
    toks = []
    for b in rows:
        t = enc(respond(b, envs[b])) + close_ids[:1]
        t = t[:stop_at(t) or len(t)] if stop_at else t
        if len(t) > max_new_tokens:
            raise ValueError(f"respond's answer for episode {b} is {len(t)} tokens with its stop token, over "
                             f"max_new_tokens {max_new_tokens}")
        toks.append(t)
    return toks, [[0.0] * len(t) for t in toks]


def record_turn(ep, env, out, lp, tok, forced, close_ids, think, max_actions_per_turn, format_penalty, per_turn_row):
    """Lay out episode ep's answer (out: sampled tokens, lp: their log-probs) and close the turn: the end-of-turn
    tokens follow, forced (mask 0) unless the answer ended with the sampled one. Parse it as RAGEN does, step the
    env with its actions, and count. per_turn_row: also return the turn's own training row (the context it was
    sampled in, loss on this answer only: the windowed modes), else None."""
    append(ep, out, lp)
    ep["turn_ends"].append(len(ep["ids"]) - 1)
    closing = close_ids[1:] if out[-1] == close_ids[0] else close_ids
    append(ep, closing)
    ep["answers"].append((out, lp, closing))
    row = None
    if per_turn_row:
        n = len(ep["ids"]) - len(out) - len(closing)
        row = (list(ep["ids"]), [False] * n + [True] * len(out) + [False] * len(closing), [0.0] * n + lp + [0.0] * len(closing))
    text = forced + tok.decode(out, skip_special_tokens=True)   # RAGEN prepends the forced tag back
    thought, actions, matched = parse_response(text, think, max_actions_per_turn)
    s, budget = ep["stats"], ep["budget"]
    reward, done, info, c, infos = step_env(env, actions, budget - s["num_actions"])
    bad = c["invalid"] > 0 or c["valid"] == 0  # RAGEN: any dropped action, or none valid at all
    ep["penalty"] += format_penalty if bad else 0.0
    ep["turn_rewards"].append(reward)
    for k, ck in (("num_actions", "executed"), ("valid_actions", "valid"), ("invalid_actions", "invalid"),
                  ("effective_actions", "effective")):
        s[k] += c[ck]
    s["num_turns"] += 1
    s["format_errors"] += int(bad)
    s["response_tokens"] += len(out)
    s["think_tokens"] += len(tok.encode(thought, add_special_tokens=False)) if thought else 0
    for inf in infos:  # numeric env info keys, averaged per episode at the end
        for k, v in inf.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in s:
                ep["extras"].setdefault(k, []).append(float(v))
    ep["responses"].append(dict(raw=text, think=thought, actions=actions, matched=matched, reward=reward, penalized=bad,
                                none_valid=c["valid"] == 0,
                                info={k: getattr(v, "item", lambda: v)() for k, v in info.items()}))
    if done:  # RAGEN: terminated; success only if the env says so (else truncated)
        ep["finished"], ep["success"] = True, bool(info.get("success", False))
    elif s["num_actions"] >= budget:
        ep["finished"] = True
    return row


def rollout_output(eps, samples, tok, group_size):
    """rollout()'s result: training rows as tensors (one per episode, or the per-turn rows of a windowed mode)."""
    B = len(eps)
    rows = [(b, e["ids"], e["sampled"], e["logps"]) for b, e in enumerate(eps)]  # R = B, one per episode
    turn_ends = [e["turn_ends"] for e in eps]
    if samples is not None:  # one row per turn, each with its one trained answer
        rows = samples
        turn_ends = [[max(i for i, f in enumerate(flags) if f)] for _, _, flags, _ in samples]
    tokens, attention_mask, loss_mask, old_logp = pack_rows(rows, tok.pad_token_id if tok.pad_token_id is not None else 0)
    penalty = torch.tensor([e["penalty"] for e in eps])
    stats = {k: torch.tensor([e["stats"][k] for e in eps], dtype=torch.bool if k == "context_truncated" else torch.float)
             for k in STATS}
    for k in sorted({k for e in eps for k in e["extras"]}):  # per-row means of numeric env info extras
        stats[k] = torch.tensor([sum(e["extras"][k]) / len(e["extras"][k]) if e["extras"].get(k) else 0.0 for e in eps])
    return dict(tokens=tokens, attention_mask=attention_mask, loss_mask=loss_mask, old_logp=old_logp,
                turn_ends=turn_ends, turn_rewards=[e["turn_rewards"] for e in eps], penalty=penalty,
                scores=torch.tensor([sum(e["turn_rewards"]) for e in eps], dtype=torch.float) + penalty,
                success=torch.tensor([e["success"] for e in eps]), group=torch.arange(B) // group_size,
                episode=torch.tensor([r[0] for r in rows], dtype=torch.long),
                text=[tok.decode(e["ids"]) for e in eps], stats=stats, responses=[e["responses"] for e in eps],
                states=[e["states"] for e in eps])  # per episode: the observation (env.render()) each turn showed


def check_rollout_args(seeds, B, group_size, temperature, max_new_tokens, window, window_mode):
    if len(seeds) != B or group_size < 1 or B % group_size:
        raise ValueError(f"need one seed per env and B={B} divisible by group_size={group_size}")
    if any(seeds[i] != seeds[i - i % group_size] for i in range(B)):
        raise ValueError("all members of a group must share a seed (RAGEN group = same initial state)")
    if temperature <= 0 or max_new_tokens < 1:
        raise ValueError("need temperature > 0 (greedy=True for argmax) and max_new_tokens >= 1")
    if window_mode not in ("full", "limited_multi_turn", "single_turn") or window == 0 or window < -1:
        raise ValueError(f"window_mode {window_mode!r} / window {window}: need full, limited_multi_turn or "
                         "single_turn and a window of -1 (all turns) or k >= 1")


def turn_layout(model, tok, preset, think):
    """How a turn is laid out in tokens: chat = (tok, head, user_head, generation prompt + the forced tag) for
    opening_message, the forced tag (FORCED[think]: RAGEN appends it after the generation prompt), the end-of-turn
    tokens (e.g. [<|im_end|>, "\\n"]) and the token ids that stop sampling."""
    head, gen, close, user_head = chat_pieces(tok, system_message(preset))
    forced = FORCED[think]
    close_ids = tok.encode(close, add_special_tokens=False)
    gc_eos = model.generation_config.eos_token_id
    stop_ids = ({close_ids[0], tok.eos_token_id} | set(gc_eos if isinstance(gc_eos, list) else [gc_eos])) - {None}
    return (tok, head, user_head, gen + forced), forced, close_ids, stop_ids


def context_needed(tok, env, seed, settings):
    """The shortest max_context in which rollout(..., settings) plays the first turn of the episode env resets to from
    seed (as a group's first member): the tokens of its first prompt, one answer's max_new_tokens and the end-of-turn
    tokens. A shorter one ends the episode before its first turn (open_turn: truncated)."""
    preset, think = settings.preset, settings.think
    env.reset(seed, **(dict(member=0) if preset.get("seed_per_member") else {}))
    head, gen, close, user_head = chat_pieces(tok, system_message(preset))
    ep = new_episode(preset["max_actions_per_traj"])
    ep["users"].append(turn_prompt(preset, 1, env.render(), ep["budget"], think))
    prompt = opening_message(ep, 1, 1, 1, (tok, head, user_head, gen + FORCED[think]), preset, think, 0.0)
    return len(prompt) + settings.max_new_tokens + len(tok.encode(close, add_special_tokens=False))


def rollout(model, tok, envs, seeds, settings, *, group_size, temperature=None, greedy=False, split=None, sampler=None,
            progress=None, respond=None):
    """Play B = num_groups * group_size episodes at once; one token sequence per episode.
    settings: how the episodes are played (turn, action, token and context budgets, think mode, sampling, penalty,
    cache paths, the cut at the closing tag, the context window, the sampling seed), an agent.AgentSettings that
    agent.agent_settings() builds from the flags and the preset; this file reads its fields and never imports agent.py.
    The arguments after it are this call's own: group_size, temperature (None: settings.temperature; train.py's
    validation samples at its own), greedy (argmax), split (the env's reset split, WebShop's goals), sampler, progress
    and respond.
    The sampling noise of a token is a pure function of (settings.sample_seed, the episode's env seed, its index in
    the group, the turn, the token's index in the turn): the same episodes draw the same noise whatever the batch,
    the number of ranks, the cache path, or a resume, and so sample the same tokens where their logits come out
    the same (fp32 on the CPU, tested); in bf16 on CUDA a GEMM rounds by its shape, so a token may differ where
    two noisy logits are within rounding.
    settings.window, settings.window_mode: RAGEN-2's context windows (see open_turn); the windowed modes give one row
    per turn, and `episode` [R] says which episode each row belongs to.
    settings.share_prefixes: rows prefilled from slot 0 together compute each prompt prefix they share once and copy
    its K/V (sampler.shared_prefixes); stats' prefill_saved counts the prompt tokens each row got by copy.
    progress(turn, max_turns), if given, is called as each turn starts (train.py's progress bar).
    sampler: a Sampler (default: sampler_settings of the model's device).
    respond(b, env), if given, writes episode b's answer (the text after the forced tag) in place of sampling: the
    model is not run, and the answer is laid out as a sampled one that stopped (sft.py's demonstrations).
    settings.stop_at_answer: a turn ends at its closing tag, as RAGEN ends it (answer_end): what a row samples past
    the tag is dropped before it is trained, logged or shown again, and the end-of-turn tokens after the tag are
    forced (mask 0: every trained token is one the policy sampled). False: a turn runs to a stop token or its budget
    and every sampled token is kept (trained, and shown in later turns)."""
    s = settings
    preset, think, max_turns, max_new_tokens = s.preset, s.think, s.max_turns, s.max_new_tokens
    temperature = s.temperature if temperature is None else temperature
    B = len(envs)
    check_rollout_args(seeds, B, group_size, temperature, max_new_tokens, s.window, s.window_mode)
    chat, forced, close_ids, stop_ids = turn_layout(model, tok, preset, think)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    stop_at = answer_end(tok, forced, think) if s.stop_at_answer else None  # a turn ends at its closing tag
    sampler = sampler or sampler_settings(model.lm_head.weight.device)
    room = s.max_context - max_new_tokens - len(close_ids)  # the most a conversation may hold before an answer

    for b, (env, seed) in enumerate(zip(envs, seeds)):  # RAGEN-2's Bandit (seed_per_member): one game per member
        member = dict(member=b % group_size) if preset.get("seed_per_member") else {}
        env.reset(seed, **member) if split is None else env.reset(seed, split=split, **member)
    eps = [new_episode(preset["max_actions_per_traj"]) for _ in range(B)]
    samples = None if s.window_mode == "full" else []  # the windowed modes' per-turn rows (b, ids, flags, logps)
    cache, rows = None, list(range(B))  # rows[i] = the episode held in cache row i
    for turn in range(1, max_turns + 1):
        if progress is not None:
            progress(turn, max_turns)
        new, rebuilt = set(), set()
        for b in (b for b in range(B) if not eps[b]["finished"]):
            opened, again = open_turn(eps[b], envs[b], turn, chat, preset, think, s.format_penalty, s.window, s.window_mode,
                                      room)
            new |= {b} if opened else set()
            rebuilt |= {b} if again else set()
        if not new:
            break
        if respond is not None:  # scripted: no model, no cache
            rows = sorted(new)
            toks, lps = script_turn(respond, envs, rows, enc, close_ids, stop_at, max_new_tokens)
        else:
            cache, rows, todo = cache_rows(model, cache, rows, eps, new, rebuilt, s.kv_reuse, sampler.static, s.max_context,
                                           s.share_prefixes)
            keys = row_keys([s.sample_seed] * len(rows), [seeds[b] for b in rows], [b % group_size for b in rows],
                            [turn] * len(rows))
            toks, lps = sample_turn(model, cache, todo, max_new_tokens, stop_ids, keys, temperature, s.top_p, greedy,
                                    sampler, s.share_prefixes, stop_at)
        for i, b in enumerate(rows):
            if b in new:
                row = record_turn(eps[b], envs[b], toks[i], lps[i], tok, forced, close_ids, think, s.max_actions_per_turn,
                                  s.format_penalty, samples is not None)
                if row is not None:
                    samples.append((b, *row))
    return rollout_output(eps, samples, tok, group_size)
