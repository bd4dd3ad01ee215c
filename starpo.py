"""
StarPO / StarPO-S maths (RAGEN, arXiv 2504.20073) as small pure functions on tensors (torch only).

Layouts used everywhere:
  [B, T]  token tensors (rewards, values, log-probs, advantages) with a bool/0-1 `mask` of the same
          shape: 1 = a token the policy sampled (the loss mask), 0 = template, observation or padding.
  [B]     per-trajectory scores; groups are consecutive rows: rows g*G .. (g+1)*G-1 are group g.
Nothing here knows about text, tokenizers or environments; train.py does the plumbing.
"""
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
    Differs from veRL compute_gae_advantage_return (which steps through every position, so with
    gamma or lam < 1 observation tokens count as time steps); identical for RAGEN's gamma = lam = 1."""
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

def _group_std(x):
    """Unbiased std along the last dim; 0 (not NaN) for a group of one."""
    n = x.shape[-1]
    return ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1).div(max(n - 1, 1)).sqrt()

def grpo_advantages(scores, group_size, norm_std=True, eps=1e-6):
    """(score - group mean) / (group std + eps), unbiased std: veRL compute_grpo_outcome_advantage.
    scores [B] -> [B]; train.py broadcasts it over the row's mask. A constant group gives 0 exactly.
    A group of one keeps its score (veRL: mean 0, std 1); that is what RAGEN's unique uids produce."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    if group_size == 1:
        return scores.float().clone()
    x = scores.float().view(-1, group_size)  # [num_groups, G]
    adv = x - x.mean(-1, keepdim=True)  # [num_groups, G]
    if norm_std:
        adv = adv / (_group_std(x).unsqueeze(-1) + eps)  # [num_groups, G]
    return adv.reshape(-1)  # [B]

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
            out[rows] = x - x.mean()
            continue
        std = _group_std(x)  # 0-d
        x = (x - x.mean()) / (std + 1e-6) if std > 1e-6 else torch.zeros_like(x)
        out[rows] = x.clamp(-1.0, 3.0) if method == "asym_clip" else x  # asym_clip: RAGEN [-1, 3]
    return out

# ----------------------------------------------------------------------------- StarPO-S filtering

def filter_groups(scores, group_size, keep_ratio, kind="std"):
    """StarPO-S uncertainty filtering (RAGEN agent_trainer._filter_rollout). scores [B] -> (keep [B]
    bool row mask, stats). kind "std" keeps the int(keep_ratio * num_groups) groups with the largest
    in-group (unbiased) reward std, "std_rev" the smallest; keep_ratio >= 1 keeps all. Differences:
    ties are broken by group index (lower index wins, a stable sort) where RAGEN's topk leaves them
    unspecified, and at least one group is kept where RAGEN's int(...) == 0 would keep none.
    stats: python floats named as RAGEN logs them under rollout/: in_group_{std,max,mean} (averaged
    over all groups) and chosen_in_group_{std,max,mean} (over the kept groups)."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    if kind not in ("std", "std_rev"):
        raise ValueError(f"unknown filter kind {kind!r} (RAGEN offers 'std' and 'std_rev')")
    x = scores.float().view(-1, group_size)  # [num_groups, G]
    num_groups = x.shape[0]
    std = _group_std(x)  # [num_groups]
    per_group = dict(std=std, max=x.max(-1).values, mean=x.mean(-1))  # each [num_groups]
    kept = torch.ones(num_groups, dtype=torch.bool, device=x.device)  # [num_groups]
    if keep_ratio < 1:
        k = max(1, int(keep_ratio * num_groups))  # RAGEN: int(rollout_filter_ratio * num_groups)
        order = torch.sort(std, descending=(kind == "std"), stable=True).indices  # [num_groups]
        kept = torch.zeros_like(kept)
        kept[order[:k]] = True
    stats = {f"in_group_{k}": v.mean().item() for k, v in per_group.items()}
    stats.update({f"chosen_in_group_{k}": v[kept].mean().item() for k, v in per_group.items()})
    return kept.repeat_interleave(group_size), stats  # [B]

# ----------------------------------------------------------------------------- losses

def aggregate(x, mask, agg="token-mean", token_count=None, seq_count=None):
    """veRL core_algos.agg_loss. x, mask [B, T] -> 0-d.
    token-mean: sum over local tokens / token_count (pass the all-reduced count over ranks and micro-
    batches so that the sum of the per-micro-batch losses is the global token mean; default: local).
    seq-mean-token-sum / seq-mean-token-mean: per-row token sum / token mean, summed over rows and divided
    by seq_count (the global number of rows; default local B). Empty rows count 0, never NaN."""
    mask = mask.to(x.dtype)
    if agg == "token-mean":
        n = mask.sum() if token_count is None else torch.as_tensor(token_count, dtype=x.dtype)
        return (x * mask).sum() / n.clamp(min=1e-8)
    row = (x * mask).sum(-1)  # [B]
    if agg == "seq-mean-token-mean":
        row = row / mask.sum(-1).clamp(min=1)  # [B]
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return row.sum() / (x.shape[0] if seq_count is None else seq_count)

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

def _entropy_rows(flat, rows):
    logp = torch.log_softmax(flat[rows].float(), dim=-1)  # [c, V] one chunk, upcast to fp32
    return -(logp.exp() * logp).sum(-1)  # [c]

def entropy(logits, mask, chunk=1024):
    """Token entropy [B, T] (fp32) of logits [B, T, V] (any dtype), 0 where mask is 0. Only masked
    positions are computed, `chunk` of them at a time, so at most [chunk, V] fp32 exists at once
    (checkpointed under autograd, as in token_logprobs, so backward does not keep every chunk)."""
    m = mask.bool()
    flat, idx = logits.reshape(-1, logits.shape[-1]), m.flatten().nonzero().squeeze(1)  # [B*T, V], [N]
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    ent = [idx[i:i + chunk] for i in range(0, idx.numel(), chunk)]  # row indices, each [<=chunk]
    ent = [checkpoint(_entropy_rows, flat, r, use_reentrant=False) if use_ckpt else _entropy_rows(flat, r)
           for r in ent]  # each [<=chunk]; the row gather happens inside, so nothing big is saved
    ent = torch.cat(ent) if ent else flat.new_zeros(0, dtype=torch.float32)  # [N]
    return torch.zeros(m.shape, dtype=torch.float32, device=logits.device).masked_scatter(m, ent)

# ----------------------------------------------------------------------------- log-probs from a model

def _chunk_logprobs(lm_head, hidden, targets, temperature, with_entropy):
    logits = lm_head(hidden).float() / temperature  # [B, c, V] fp32, one chunk only
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, c, V]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, c]
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)  # [B, c]
    return logp, ent

def token_logprobs(model, tokens, attention_mask, temperature=1.0, chunk=256, with_entropy=False):
    """Log-probs [B, T] of `tokens` under an HF causal LM with logits / temperature (veRL does the same,
    RAGEN_SPEC 4.1), and the entropies [B, T] of that same distribution if asked (else None).
    Alignment: logp[:, t] = log p(tokens[:, t] | tokens[:, :t]), from the logits at position t-1;
    logp[:, 0] = 0 and padding positions are 0. The same layout as rollout's old_logp.

    Memory: the model runs once through `model(...)` with logits_to_keep=1 (one position of logits)
    and output_hidden_states=True; hidden_states[-1] is the final-norm output, so lm_head +
    log_softmax run here over `chunk` positions at a time and no [B, T, V] fp32 tensor ever exists.
    Under autograd each chunk is activation-checkpointed (recomputed in backward), or backward would
    keep every chunk's [B, c, V] softmax alive. We call the root `model(...)` rather than `model.model`
    so that FSDP2's root pre-forward hook unshards the root's parameters (embeddings, final norm,
    lm_head); lm_head is then used after the forward, which relies on FSDP2 keeping the root unsharded
    after forward (its default, reshard_after_forward=None -> False for the root). Cost: in no_grad the
    per-layer hidden states ([L, B, T, H], small next to [B, T, V]) live until the forward ends."""
    out = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False,
                output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][:, :-1]  # [B, T-1, H] position t-1 predicts token t
    del out
    lm_head, targets = model.get_output_embeddings(), tokens[:, 1:]  # targets [B, T-1]
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for s in range(0, hidden.shape[1], chunk):
        args = (lm_head, hidden[:, s:s + chunk], targets[:, s:s + chunk], temperature, with_entropy)
        if use_ckpt:  # recompute this chunk's [B, c, V] in backward instead of keeping it
            lp, en = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, en = _chunk_logprobs(*args)
        logps.append(lp)
        ents.append(en)
    valid = attention_mask[:, 1:].to(torch.float32)  # [B, T-1]
    pad = lambda x: F.pad((torch.cat(x, dim=1) if x else valid) * valid, (1, 0))  # [B, T], column 0 = 0
    return pad(logps), (pad(ents) if with_entropy else None)
