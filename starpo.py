"""
StarPO / StarPO-S maths (RAGEN, arXiv 2504.20073) as small pure functions on tensors (torch only).

Layouts used everywhere:
  [B, T]  token tensors (rewards, values, log-probs, advantages) with a bool/0-1 `mask` of the same
          shape: 1 = a token the policy sampled (the loss mask), 0 = template, observation or padding.
  [B]     per-trajectory scores; groups are consecutive rows: rows g*G .. (g+1)*G-1 are group g.
Nothing here knows about text, tokenizers or environments; train.py does the plumbing.
"""
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------- masked helpers

def masked_mean(x, mask, dim=None):
    """Mean of x over mask==1 entries (0 when the mask is empty, never NaN)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1e-8)  # 0-d
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1e-8)  # x.shape without dim

def masked_var(x, mask):
    """Unbiased (Bessel-corrected) variance over mask==1 entries; 0 for fewer than 2 entries."""
    n = mask.to(x.dtype).sum()  # 0-d
    centred = (x - masked_mean(x, mask)) * mask  # [B, T]
    return (centred ** 2).sum() / (n - 1).clamp(min=1)  # 0-d  (veRL masked_var, unbiased=True)

def masked_whiten(x, mask):
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, 0 elsewhere (veRL masked_whiten)."""
    mask = mask.to(x.dtype)
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + 1e-8) * mask  # [B, T]

def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over masked tokens (veRL compute_data_metrics critic/vf_explained_var)."""
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)  # 0-d

# ----------------------------------------------------------------------------- advantages

def turn_advantages(adv, mask):
    """The advantage each turn's tokens carry, for the log: a turn is a run of action tokens (mask 1) in a row. Returns
    {turn<k>_mean, turn<k>_abs_mean, turn<k>_tokens} for every k some row reaches; a turn with mean |A| near 0 gets
    no gradient (GRPO: its episodes' groups had no reward spread or were filtered out)."""
    on = mask > 0                                                                   # [B, T]
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0))                      # [B, T] first token of each turn
    turn = torch.cumsum(starts.long(), 1) * on                                      # [B, T] 1, 2, ... on action tokens
    out = {}
    for k in range(1, int(turn.max()) + 1 if on.any() else 1):
        a = adv[turn == k].float()                                                  # [tokens of turn k]
        out.update({f"turn{k}_mean": a.mean().item(), f"turn{k}_abs_mean": a.abs().mean().item(), f"turn{k}_tokens": a.numel()})
    return out


def update_direction(new_logp, old_logp, adv, mask, success):
    """Did a step's updates move each token's log-prob the way its advantage asks? new_logp, old_logp (the policy
    after and before the step's updates), adv, mask [B, T]; success [B] bool (the row's episode succeeded). Returns
    the mean change of a token's log-prob over tokens with A > 0 and with A < 0, over successful and failed rows' tokens,
    the mean change of a whole row's log-prob (its tokens' sum) over successful and over failed rows, and the fraction
    of each kind's tokens given A > 0; a kind with no tokens is left out."""
    on, d = mask > 0, (new_logp - old_logp).float() * mask                          # [B, T], [B, T]
    out = {}
    for name, where in (("pos_adv", on & (adv > 0)), ("neg_adv", on & (adv < 0))):
        if where.any():
            out[f"dlogp_{name}"] = d[where].mean().item()
    for name, rows in (("success", success), ("failure", ~success)):
        where = on & rows[:, None]                                                  # [B, T]
        if where.any():
            out[f"dlogp_{name}"] = d[where].mean().item()
            out[f"{name}_seq_dlogp"] = d[rows].sum(1).mean().item()
            out[f"{name}_pos_adv_fraction"] = (adv[where] > 0).float().mean().item()
    return out


def _masked_gae(rewards, values, mask, gamma, lam, reset=None):
    """Reverse GAE that visits only mask==1 tokens: the 'next' value of an action token is the value
    of the next action token of the same row (skipping observations), 0 after the last one. Where
    `reset` is 1 the bootstrap value and the running advantage restart from 0 (bi-level turn ends)."""
    B, T = rewards.shape
    mask = mask.bool()
    next_value = rewards.new_zeros(B)  # [B] value of the next visited token
    last_gae = rewards.new_zeros(B)  # [B] advantage of the next visited token
    cols = []
    for t in reversed(range(T)):
        if reset is not None:
            next_value = torch.where(reset[:, t], 0.0, next_value)  # [B]
            last_gae = torch.where(reset[:, t], 0.0, last_gae)  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B] TD error
        gae = delta + gamma * lam * last_gae  # [B]
        m = mask[:, t]  # [B]
        cols.append(torch.where(m, gae, 0.0))
        last_gae = torch.where(m, gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
    adv = torch.stack(cols[::-1], dim=1)  # [B, T]
    return adv, (adv + values) * mask  # advantages, returns; both 0 off the mask

def _check_rewards_on_mask(rewards, mask):
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} differ")
    if (rewards.ne(0) & ~mask.bool()).any():
        raise ValueError("a non-zero reward sits on a token with mask 0; put rewards on sampled tokens")

@torch.no_grad()
def gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0):
    """GAE over the policy's own tokens in order. rewards, values, mask: [B, T]. Returns raw
    (advantages, returns) [B, T]; RAGEN/veRL then whiten the advantages over the batch's masked
    tokens: call masked_whiten. With gamma = lam = 1 and one terminal reward R, A_t = R - V_t.
    As veRL compute_gae_advantage_return (0.9.1), positions with mask 0 (observations, template, padding)
    are skipped: they carry the next value and the running advantage through unchanged and are no time step."""
    _check_rewards_on_mask(rewards, mask)
    return _masked_gae(rewards.float(), values.float(), mask, gamma, lam)

@torch.no_grad()
def bi_level_gae(rewards, values, mask, gamma=1.0, lam=1.0, high_level_gamma=0.95):
    """RAGEN core_algos.compute_bi_level_gae_advantage_return. Turn ends = tokens with non-zero reward.
    High level: GAE over turn ends only (discount high_level_gamma, and lam as RAGEN's code does; next
    value = V at the next turn end, 0 after the last); each turn end's reward := its high-level return.
    Low level: token GAE over masked tokens, restarting at every turn end with next value 0.
    Returns raw (advantages, returns), like gae_advantages."""
    _check_rewards_on_mask(rewards, mask)
    rewards, values = rewards.float(), values.float()
    turn_end = rewards.ne(0)  # [B, T] RAGEN: reward_mask = token_level_rewards.bool()
    _, high_returns = _masked_gae(rewards, values, turn_end, high_level_gamma, lam)  # [B, T]
    rewards = torch.where(turn_end, high_returns, rewards)  # [B, T] reward := high-level return
    return _masked_gae(rewards, values, mask, gamma, lam, reset=turn_end)

def _group_centred(x):
    """x minus its mean along the last dim, computed on the values shifted by each group's first value: exactly 0
    in a constant group (x - mean(x) is not 0 in fp32 when the mean rounds, e.g. 7.5e-9 for eight scores of -0.1,
    and grpo's 1 / (0 + 1e-6) would make it 0.0075 on every row); elsewhere equal to x - mean(x) up to rounding."""
    d = x - x[..., :1]  # [..., n] exactly 0 in a constant group
    return d - d.mean(-1, keepdim=True)  # [..., n]

def _group_std(x):
    """Unbiased std along the last dim; 0 (not NaN) for a group of one, exactly 0 for a constant group as torch.std
    gives (a 1e-8 std would survive include_zero=False)."""
    n = x.shape[-1]
    return (_group_centred(x) ** 2).sum(-1).div(max(n - 1, 1)).sqrt()

def group_advantages(scores, group, kind="grpo", eps=1e-6):
    """Outcome advantages from each row's group (veRL core_algos; RAGEN-2 agent_trainer.compute_advantage).
    scores [N] one score per row, group [N] group ids (any labels; groups may have different sizes) -> [N]:
      grpo                   (s - mean) / (std + eps), unbiased std (compute_grpo_outcome_advantage)
      drgrpo                 s - mean (Dr.GRPO: the same with norm_adv_by_std_in_grpo=False)
      rloo                   (s - mean) * n / (n - 1), i.e. s minus the mean of the others (compute_rloo_outcome_advantage)
      reinforce_pp_baseline  s - mean; train.py then whitens it over the batch's tokens (..._baseline_outcome_advantage)
    A group of one has mean 0 and std 1, as veRL: grpo gives s / (1 + eps), the others s. A constant group gives
    exactly 0 under every kind: s - mean is computed on the values shifted by the group's first (_group_centred), which
    veRL's s - mean is not (there one rounding step of the mean, divided by 0 + eps, pushes every row of the group)."""
    if kind not in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        raise ValueError(f"unknown group advantage {kind!r}")
    x = scores.float()
    adv = torch.empty_like(x)  # [N]
    for g in torch.unique(group):
        rows = group == g  # [N] bool
        s, n = x[rows], int(rows.sum())
        centred, std = (_group_centred(s), _group_std(s)) if n > 1 else (s, 1.0)  # [n], s - mean
        if kind == "grpo":
            adv[rows] = centred / (std + eps)
        elif kind == "rloo":
            adv[rows] = centred * n / (n - 1) if n > 1 else s
        else:
            adv[rows] = centred
    return adv

@torch.no_grad()
def reinforce_pp_advantages(rewards, mask, gamma=1.0):
    """REINFORCE++ (veRL compute_reinforce_plus_plus_outcome_advantage, 0.9.1): the discounted reward-to-go over
    the policy's own tokens, whitened over the batch's masked tokens. rewards, mask [B, T] -> (advantages,
    returns) [B, T], both 0 off the mask. Positions with mask 0 (observations, template) carry the running
    return through unchanged and are no time step, as in gae_advantages: every turn of a multi-turn row is
    credited with the rewards of the turns after it, not only the turn that holds a reward."""
    _check_rewards_on_mask(rewards, mask)
    m = mask.bool()
    returns, run = torch.zeros_like(rewards, dtype=torch.float32), rewards.new_zeros(rewards.shape[0]).float()
    for t in reversed(range(rewards.shape[1])):
        run = torch.where(m[:, t], rewards[:, t].float() + gamma * run, run)  # [B]
        returns[:, t] = run * m[:, t]
    return masked_whiten(returns, m.float()), returns

def normalize_scores(scores, group_size, grouping="state", method="identity", tags=None):
    """RAGEN ctx_manager._normalize_score_tensor on per-trajectory scores [B] (penalty already added).
    grouping: "state" (rows of one group = same seed), "batch" (all rows) or "inductive" (same env tag:
    pass `tags`, B hashables). method: identity | mean (x - mean) | mean_std ((x - mean)/(std + 1e-6),
    unbiased std, all zeros when std <= 1e-6) | asym_clip (mean_std clamped to [-1, 3]).
    As in RAGEN, nothing happens when every row is its own group."""
    B = scores.numel()
    if grouping == "state":
        ids = [i // group_size for i in range(B)]
    elif grouping == "batch":
        ids = [0] * B
    elif grouping == "inductive":
        if tags is None or len(tags) != B:
            raise ValueError("grouping='inductive' needs one tag per row")
        ids = [t.item() if torch.is_tensor(t) else t for t in tags]
    else:
        raise ValueError(f"unknown grouping {grouping!r}")
    if method not in ("identity", "mean", "mean_std", "asym_clip"):
        raise ValueError(f"unknown normalization method {method!r}")
    out = scores.float().clone()  # [B]
    if method == "identity" or len(set(ids)) == B:  # RAGEN: only if #groups < batch size
        return out
    for g in dict.fromkeys(ids):  # groups in order of first appearance
        rows = torch.tensor([i for i in range(B) if ids[i] == g])  # [n]
        x = out[rows]  # [n]
        if method == "mean":
            out[rows] = _group_centred(x)  # x - mean, exactly 0 in a constant group
            continue
        std = _group_std(x)  # 0-d
        x = (x - x.mean()) / (std + 1e-6) if std > 1e-6 else torch.zeros_like(x)
        out[rows] = x.clamp(-1.0, 3.0) if method == "asym_clip" else x  # asym_clip: RAGEN [-1, 3]
    return out

# ----------------------------------------------------------------------------- StarPO-S / RAGEN-2 filtering

def filter_groups(values, group_size, value, kind="std", strategy="top_k", include_zero=True, top_p_mode="linear",
                  eps=0.01):
    """Rollout filtering: StarPO-S (RAGEN agent_trainer._filter_rollout) and RAGEN-2's strategies (rollout_filter.py).
    values [B] per trajectory (the scores, or entropy or length) -> (keep [B] bool row mask, stats). Whole groups
    are kept or dropped, ranked by one statistic s per group: kind "std" / "std_rev" = largest / smallest unbiased
    in-group std (RAGEN-2's "reward variance"), "mean" / "mean_rev" = largest / smallest in-group mean.
    `value` (RAGEN-2 rollout_filter_value) means, per strategy:
      top_k      keep max(1, int(value * num_groups)) groups: v1's rollout_filter_ratio (value 1 keeps all)
      top_k_abs  keep max(1, int(value)) groups
      top_p      value >= 1 keeps all. linear: add the ranked s until the sum reaches value * sum(s) - eps,
                 stopping at the first s <= 0; keep those if it was reached, else none. softmax: keep the
                 shortest ranked prefix whose softmax(s) (smallest: softmax(-s)) mass reaches value
      min_p      largest: keep s >= value * max(s); smallest: keep s <= min(s) / value
    include_zero=False first removes the groups with |s| <= 1e-10 (top_k still counts all groups). Ties go to
    the lower group index (stable sorts) where RAGEN's topk / sort leave them unspecified. The result may be
    empty (top_p, min_p, include_zero=False); train.py then skips the step. stats: python floats named as RAGEN
    logs them under rollout/: in_group_{std,max,mean} over all groups, chosen_in_group_{std,max,mean} over the
    kept ones (0 when none); and in_group_spread / chosen_in_group_spread, the fraction of all / kept groups whose
    values differ at all (a group without spread has advantage 0 everywhere under GRPO)."""
    if values.numel() % group_size:
        raise ValueError(f"{values.numel()} scores do not split into groups of {group_size}")
    if kind not in ("std", "std_rev", "mean", "mean_rev"):
        raise ValueError(f"unknown filter kind {kind!r} (std, std_rev, mean or mean_rev)")
    x = values.float().view(-1, group_size)  # [num_groups, G]
    num_groups, largest = x.shape[0], not kind.endswith("_rev")
    per_group = dict(std=_group_std(x), max=x.max(-1).values, mean=x.mean(-1))  # each [num_groups]
    per_group["spread"] = (per_group["std"] > 1e-10).float()  # [num_groups] 1 where the group's rewards differ
    s = per_group[kind.removesuffix("_rev")]  # [num_groups] the ranking statistic
    cand = torch.arange(num_groups, device=x.device)  # [C] candidate groups
    if not include_zero:
        cand = cand[s.abs() > 1e-10]
    order = cand[torch.sort(s[cand], descending=largest, stable=True).indices]  # [C] best first
    ranked = s[order].tolist()
    if strategy in ("top_k", "top_k_abs"):
        k = int(value * num_groups) if strategy == "top_k" else int(value)
        chosen = order[:max(1, k)]
    elif strategy == "top_p" and value >= 1:
        chosen = order
    elif strategy == "top_p" and top_p_mode == "softmax":
        mass = torch.softmax(s[order] if largest else -s[order], dim=0).cumsum(0)  # [C]
        chosen = order[:int((mass < value).sum()) + 1]
    elif strategy == "top_p" and top_p_mode == "linear":
        target, total, n = value * sum(ranked) - eps, 0.0, 0
        for v in ranked:
            if total >= target or v <= 0:
                break
            total, n = total + v, n + 1
        chosen = order[:n] if total >= target else order[:0]
    elif strategy == "min_p":
        if not ranked:
            chosen = order
        elif largest:
            chosen = order[s[order] >= value * max(ranked) - 1e-10]
        else:
            chosen = order[s[order] <= min(ranked) / (value + 1e-10) + 1e-10]
    else:
        raise ValueError(f"unknown filter strategy {strategy!r} / top_p mode {top_p_mode!r}")
    kept = torch.zeros(num_groups, dtype=torch.bool, device=x.device)  # [num_groups]
    kept[chosen] = True
    stats = {f"in_group_{k}": v.mean().item() for k, v in per_group.items()}
    stats.update({f"chosen_in_group_{k}": v[kept].mean().item() if kept.any() else 0.0 for k, v in per_group.items()})
    return kept.repeat_interleave(group_size), stats  # [B]

def adjust_rows(n, divisor, mode="copy", generator=None):
    """Row indices that make n kept rows a multiple of `divisor` (RAGEN-2 agent_trainer.adjust_batch): "copy"
    appends divisor - n % divisor randomly drawn rows (without replacement when there are enough), "delete"
    drops n % divisor random rows (which can leave none). Returns [n'] long indices, kept rows in order first."""
    r, rows = n % divisor, torch.arange(n)
    if r == 0:
        return rows
    if mode == "copy":
        add = divisor - r
        extra = torch.randperm(n, generator=generator)[:add] if add <= n else torch.randint(n, (add,), generator=generator)
        return torch.cat([rows, extra])
    if mode == "delete":
        drop = torch.zeros(n, dtype=torch.bool)
        drop[torch.randperm(n, generator=generator)[:r]] = True
        return rows[~drop]
    raise ValueError(f"unknown batch adjust mode {mode!r} (copy or delete)")

# ----------------------------------------------------------------------------- losses

def aggregate(x, mask, agg="token-mean", token_count=None, seq_count=None):
    """veRL core_algos.agg_loss. x, mask [B, T] -> 0-d.
    token-mean: sum over local tokens / token_count (pass the all-reduced count over ranks and micro-
    batches so that the sum of the per-micro-batch losses is the global token mean; default: local).
    seq-mean-token-sum / seq-mean-token-mean: per-row token sum / token mean, summed over rows and divided
    by seq_count (pass the global number of rows with a loss token; default: the local rows that have one, as
    veRL averages over rows with a loss token). Empty rows add 0; no row at all gives 0, never NaN."""
    mask = mask.to(x.dtype)
    if agg == "token-mean":
        n = mask.sum() if token_count is None else torch.as_tensor(token_count, dtype=x.dtype)
        return (x * mask).sum() / n.clamp(min=1e-8)
    row = (x * mask).sum(-1)  # [B]
    if agg == "seq-mean-token-mean":
        row = row / mask.sum(-1).clamp(min=1)  # [B]
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {agg!r}")
    n = mask.sum(-1).gt(0).sum() if seq_count is None else torch.as_tensor(seq_count)
    return row.sum() / n.clamp(min=1)

def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                agg="token-mean", token_count=None, seq_count=None):
    """PPO clipped surrogate (veRL compute_policy_loss). logp, old_logp, advantages, mask: [B, T].
    dual_clip=None (or 0) disables the dual clip, as in paper-era RAGEN; clip_high=0.2 is vanilla PPO.
    Returns (loss 0-d, metrics of detached 0-d tensors over local masked tokens)."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # [B, T] veRL clamps before exp for stability
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T] DAPO clip-higher
    loss = torch.max(loss_unclipped, loss_clipped)  # [B, T]
    neg = advantages < 0  # [B, T]
    if dual_clip:  # dual clip (Ye et al. 2020, veRL clip_ratio_c=3): bound A<0 losses
        loss = torch.where(neg, torch.min(loss, -advantages * dual_clip), loss)  # [B, T]
    total = aggregate(loss, mask, agg, token_count, seq_count)
    with torch.no_grad():
        m = mask.bool()
        high = masked_mean(((advantages > 0) & (ratio > 1 + clip_high)).float(), m)
        low = masked_mean((neg & (ratio < 1 - clip_low)).float(), m)
        dual = masked_mean((neg & (ratio > dual_clip)).float(), m) if dual_clip else ratio.new_zeros(())
        metrics = dict(clipfrac=high + low, clipfrac_high=high, clipfrac_low=low, dual_clip_frac=dual,
                       approx_kl=masked_mean(-log_ratio, m),  # veRL ppo_kl = mean(old_logp - logp)
                       ratio_mean=masked_mean(ratio, m),
                       ratio_max=torch.where(m, ratio, 0.0).max() if m.any() else ratio.new_ones(()),
                       ratio_min=torch.where(m, ratio, torch.inf).min() if m.any() else ratio.new_ones(()))
    return total, metrics

def value_loss(values, old_values, returns, mask, clip=0.5, agg="token-mean", token_count=None, seq_count=None):
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2) (veRL compute_value_loss).
    values, old_values, returns, mask [B, T] -> (loss 0-d, metrics)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    err1, err2 = (values - returns) ** 2, (clipped - returns) ** 2  # [B, T]
    loss = 0.5 * aggregate(torch.max(err1, err2), mask, agg, token_count, seq_count)
    with torch.no_grad():
        metrics = dict(vf_clipfrac=masked_mean((err2 > err1).float(), mask),
                       vpred_mean=masked_mean(values, mask))
    return loss, metrics

def clip_and_step(model, optimizer, max_norm):
    """Clip the gradient norm of model's parameters to max_norm, then step; a non-finite norm (a NaN or inf loss:
    every rank sees the same all-reduced norm, so all skip together) skips the step and drops the gradients.
    Returns the norm before clipping as a float. Works on FSDP2's sharded parameters (the norm is a DTensor)."""
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
    if math.isfinite(gn):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return gn

def kl_penalty(logp, ref_logp, kind="kl"):
    """Per-token KL estimate [B, T] (veRL core_algos.kl_penalty; Schulman's k1/k2/k3)."""
    diff = logp - ref_logp  # [B, T]
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        d = (-diff).clamp(-20.0, 20.0)  # [B, T] log(ref/p), clamped as veRL does
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)  # [B, T] >= 0
    raise ValueError(f"unknown kl kind {kind!r}")

# ----------------------------------------------------------------------------- log-probs from a model

def _chunk_logprobs(lm_head, hidden, targets, temperature, with_entropy):
    # fp32 logits, not bf16 ones cast up (0.125 apart in [16, 32)): the GEMM itself in fp32, outside autocast. With
    # bf16 weights (FSDP2) that is an fp32 copy of lm_head's [V, d] weight per chunk, recomputed in backward
    if hasattr(lm_head, "lora_A"):  # peft's wrapper: lm_head.weight would be its frozen base alone
        raise ValueError("a LoRA adapter on lm_head is not supported: token_logprobs uses lm_head.weight directly")
    bias = None if lm_head.bias is None else lm_head.bias.float()
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.float(), lm_head.weight.float(), bias) / temperature  # [c, V] one chunk only
    logp_all = torch.log_softmax(logits, dim=-1)  # [c, V]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [c]
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)  # [c]
    return logp, ent

def last_hidden(model, tokens, attention_mask, share_prefix=False, **kw):
    """The last hidden layer [B, T, H] (after the final norm) of `model` (an HF causal LM or its base model) on
    right-padded rows. share_prefix: the prefix that every row shares (a group's first prompt; the longest common
    prefix, cut so each row keeps a token of its own) runs once, in row 0, and its K/V is repeated for the other
    rows, which attend to it as to their own; the same hidden states up to fp32 rounding, and gradients flow back
    through the shared part. Needs HF's KV cache, so not with gradient checkpointing (HF turns the cache off)."""
    B, T = tokens.shape
    P = 0
    if share_prefix and B > 1:
        same = (tokens == tokens[:1]).all(0)                                                  # [T]
        P = min(int(same.long().argmin()) if not bool(same.all()) else T, int(attention_mask.sum(1).min()) - 1)
    if P < 1:
        return model(input_ids=tokens, attention_mask=attention_mask, use_cache=False, output_hidden_states=True,
                     **kw).hidden_states[-1]
    head = model(input_ids=tokens[:1, :P], use_cache=True, output_hidden_states=True, **kw)
    past = head.past_key_values
    past.batch_repeat_interleave(B)  # [1, KV, P, D] -> [B, KV, P, D] in every layer (a copy: autograd sums it back)
    rest = model(input_ids=tokens[:, P:], attention_mask=attention_mask, past_key_values=past, use_cache=True,
                 output_hidden_states=True, **kw).hidden_states[-1]                          # [B, T-P, H]
    return torch.cat([head.hidden_states[-1].expand(B, -1, -1), rest], dim=1)                 # [B, T, H]


def token_logprobs(model, tokens, attention_mask, temperature=1.0, chunk=256, with_entropy=False, mask=None,
                   share_prefix=False):
    """Log-probs [B, T] of `tokens` under an HF causal LM with logits / temperature (veRL and RAGEN
    do the same), and the entropies [B, T] of that same distribution if asked (else None).
    Alignment: logp[:, t] = log p(tokens[:, t] | tokens[:, :t]), from the logits at position t-1;
    logp[:, 0] = 0, and so is every position outside `mask` (default: the attention mask). Callers pass
    the loss mask, the tokens the policy sampled: the layout of rollout's old_logp.

    Cost: the model runs once through `model(...)` with logits_to_keep=1 (one position of logits) and
    output_hidden_states=True; hidden_states[-1] is the final-norm output. Only the N positions in `mask`
    are gathered ([N, H]) and go through lm_head + log_softmax, `chunk` positions at a time, so no
    [B, T, V] fp32 tensor ever exists. In a multi-turn row most tokens are the prompt and the
    environment's observations: on Qwen2.5-0.5B's shape lm_head is 896 x 151,936 = 136M multiply-adds per
    position against ~360M for the 24 layers, so skipping the unsampled positions saves that share of the
    FLOPs and [c, V] logits traffic for each of them. Under autograd each chunk is activation-checkpointed
    (recomputed in backward), or backward would keep every chunk's [c, V] softmax alive. An empty mask still
    runs one empty chunk, so lm_head gets a (zero) gradient on every rank. The boolean gather costs
    one device sync per call (its size N), nothing next to the forward. We call the root `model(...)`
    rather than `model.model` so that FSDP2's root pre-forward hook unshards the root's parameters
    (embeddings, final norm, lm_head); lm_head is then used after the forward, which relies on FSDP2
    keeping the root unsharded after forward (its default, reshard_after_forward=None -> False for the
    root). In no_grad the per-layer hidden states ([L, B, T, H], small next to [B, T, V]) live until the
    forward ends. share_prefix: the rows' common prefix runs once (last_hidden)."""
    h = last_hidden(model, tokens, attention_mask, share_prefix, logits_to_keep=1)  # [B, T, H]
    keep = attention_mask[:, 1:].bool()  # [B, T-1] the positions whose log-prob is wanted
    if mask is not None:
        keep = keep & mask[:, 1:].bool()
    hidden, targets = h[:, :-1][keep], tokens[:, 1:][keep]  # [N, H], [N]: t-1 predicts t
    del h
    lm_head, use_ckpt = model.get_output_embeddings(), torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for s in range(0, max(len(hidden), 1), chunk):
        args = (lm_head, hidden[s:s + chunk], targets[s:s + chunk], temperature, with_entropy)
        if use_ckpt:  # recompute this chunk's [c, V] in backward instead of keeping it
            lp, en = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, en = _chunk_logprobs(*args)
        logps.append(lp)
        ents.append(en)
    put = lambda x: F.pad(torch.zeros(keep.shape, device=keep.device).masked_scatter(keep, torch.cat(x)), (1, 0))
    return put(logps), (put(ents) if with_entropy else None)  # [B, T], column 0 = 0
