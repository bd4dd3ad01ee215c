"""RAGEN-2's collapse: diagnostics of a rollout (how much the reasoning depends on the prompt: mutual information,
retrieval), and what train.py watches in a run's metrics: warnings (paper Fig. 6) and early stops.

Diagnostics (ragen/trainer/collapse_metrics.py): (prompt x, reasoning z) pairs of a rollout, each z scored under every
pair's prompt by teacher forcing (cross_logliks), reduced to mutual information and retrieval accuracy
(collapse_stats). collapse_metrics is the train.py step's part that samples the pairs.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import starpo
from rollout import reasoning_span


def collapse_metrics(model, tok, out, seed, think, multi_turn, temperature, max_pairs=64, rank=0, world=1):
    """RAGEN-2 collapse diagnostics (ragen/trainer/collapse_metrics.py) of a rollout out, before filtering: up to 64
    (x, z) pairs (rollout.reasoning_span), each z scored under every column's prompt by model, the rollout model
    (cross_logliks), and reduced by collapse_stats. first_turn: first turns, one column per group (a group's
    members share their first prompt). any_turn (multi_turn runs only): one turn drawn per trajectory among its
    turns with a non-empty z, one column per pair (RAGEN's trajectory-uniform sample). seed: of the draws.
    Under torchrun every rank calls it with the whole rollout (the same pairs on every rank) and scores its share of
    the prompt columns (rank of world; cross_logliks); every rank returns the same diagnostics."""
    g = torch.Generator().manual_seed(seed)  # its own generator: the training RNG is untouched
    spans = [[reasoning_span(tok, out["tokens"][b].tolist(), out["loss_mask"][b].tolist(), e, think)
              for e in ends] for b, ends in enumerate(out["turn_ends"])]  # spans[b][t] = (x, z)
    m = {}
    for name in ["first_turn"] + (["any_turn"] if multi_turn else []):
        pairs = []  # (row, x, z)
        for b, turns in enumerate(spans):
            ok = [t for t, (_, z) in enumerate(turns[:1] if name == "first_turn" else turns) if z]
            if ok:
                pairs.append((b, *turns[ok[int(torch.randint(len(ok), (1,), generator=g))]]))
        m[f"collapse/{name}/valid_rate"] = len(pairs) / len(spans)
        pairs = [pairs[i] for i in sorted(torch.randperm(len(pairs), generator=g)[:max_pairs].tolist())]
        if name == "first_turn":
            cols = sorted({int(out["group"][b]) for b, _, _ in pairs})
            prompts = [next(x for b, x, _ in pairs if int(out["group"][b]) == c) for c in cols]
            own = [cols.index(int(out["group"][b])) for b, _, _ in pairs]
        else:
            prompts, own = [x for _, x, _ in pairs], list(range(len(pairs)))
        if len(prompts) < 2:  # MI needs two prompts at least
            continue
        ids = {}
        cls = [ids.setdefault(tuple(x), len(ids)) for x in prompts]  # identical prompts share an id
        L, L_sum = cross_logliks(model, prompts, [z for _, _, z in pairs], temperature, rank=rank, world=world)
        m.update({f"collapse/{name}/{k}": v for k, v in collapse_stats(L, L_sum, own, cls).items()})
    return m


@torch.no_grad()
def cross_logliks(model, prompts, responses, temperature=1.0, batch=16, chunk=64, rank=0, world=1):
    """Teacher-forced L[i, j] = log p(responses[i] | prompts[j]) under an HF causal LM at logits / temperature,
    as (per-token mean [P, N], per-sequence sum [P, N]) (RAGEN-2 collapse_metrics._compute_cross_log_probs).
    prompts, responses: lists of token-id lists; responses must be non-empty. Each prompt is prefilled once and
    its KV cache repeated over `batch` right-padded responses (cut back to the prompt after each batch), so
    the cost is the N prompts plus P x N response tokens, not P x N full sequences. A padded position comes after
    every real one, so no real token sees it; its log-prob is dropped. world > 1 (torchrun; every rank calls it
    with the same lists): this rank scores the columns rank, rank + world, ... and one all-reduce sums the ranks'
    columns into the whole matrix, on every rank."""
    P, N, dev = len(responses), len(prompts), model.get_output_embeddings().weight.device
    lens = torch.tensor([len(r) for r in responses])  # [P]
    if P == 0 or int(lens.min()) < 1:
        raise ValueError("cross_logliks needs at least one response and no empty ones")
    batch = min(batch, P)
    rows = -(-P // batch) * batch  # P rounded up to whole batches (the extra rows are all padding)
    z = torch.zeros(rows, int(lens.max()), dtype=torch.long)  # [rows, Tz] right-padded with token 0
    for i, r in enumerate(responses):
        z[i, :len(r)] = torch.tensor(r)
    valid = torch.arange(z.shape[1]) < F.pad(lens, (0, rows - P))[:, None]  # [rows, Tz] padding rows: all False
    lm_head, total = model.get_output_embeddings(), torch.zeros(rows, N)  # total [rows, N]
    for j in range(rank, N, world):
        x = prompts[j]
        pre = model(input_ids=torch.tensor([x], device=dev), use_cache=True, output_hidden_states=True, logits_to_keep=1)
        cache, h0 = pre.past_key_values, pre.hidden_states[-1][:, -1:]  # h0 [1, 1, H] predicts each response's first token
        cache.batch_repeat_interleave(batch)
        for s in range(0, rows, batch):
            zb = z[s:s + batch].to(dev)  # [batch, Tz]
            h = model(input_ids=zb, past_key_values=cache, use_cache=True, output_hidden_states=True,
                      logits_to_keep=1).hidden_states[-1]  # [batch, Tz, H]
            cache.crop(-zb.shape[1])  # back to the prompt (transformers 5: a negative count removes tokens)
            h = torch.cat([h0.expand(batch, 1, -1), h[:, :-1]], dim=1)  # [batch, Tz, H] position t predicts z_t
            lp = torch.cat([starpo._chunk_logprobs(lm_head, h[:, c:c + chunk], zb[:, c:c + chunk], temperature, False)[0]
                            for c in range(0, h.shape[1], chunk)], dim=1)  # [batch, Tz]
            total[s:s + batch, j] = (lp.float().cpu() * valid[s:s + batch]).sum(1)
    if world > 1:  # each column was scored on one rank, zeros elsewhere (on the model's device: NCCL reduces GPU tensors)
        summed = total.to(dev)
        dist.all_reduce(summed)
        total = summed.cpu()
    total = total[:P]  # [P, N]
    return total / lens[:, None], total


def collapse_stats(L, L_sum, own, cls=None, eps=1e-3):
    """RAGEN-2 collapse diagnostics (ragen/trainer/collapse_metrics.py, docs/reference_mutual_information_metrics.md)
    from cross log-likelihoods L[i, j] = log p(z_i | x_j): L [P, N] per-token mean, L_sum [P, N] per-sequence sum;
    own [P] the column of z_i's own prompt; cls [N] one id per column, equal for identical prompts (default: all
    different). matched_i = L[i, own_i]; marginal_i = logsumexp_j L[i, j] - log N (the uniform prompt mixture).
    mi = mean(matched - marginal) <= log N; cond_entropy H(Z|X) = -mean(matched); entropy H(Z) = -mean(marginal);
    mi_zscore = mean((matched - marginal) / (population std of marginal + eps)); *_seq: the same from L_sum.
    retrieval_acc: the top column of row i is own_i or identical to it; @k: any of the top min(k, N); chance: mean
    over rows of (#columns identical to own_i) / N, chance@k = min(1, min(k, N) x chance). Python floats."""
    P, N = L.shape
    own = torch.as_tensor(own, dtype=torch.long)  # [P]
    cls = torch.arange(N) if cls is None else torch.as_tensor(cls, dtype=torch.long)  # [N]
    out = dict(pairs=P, prompts=N, mi_upper_bound=math.log(N))
    for sfx, M in (("", L), ("_seq", L_sum)):
        M = M.double()
        matched = M[torch.arange(P), own]  # [P]
        marginal = torch.logsumexp(M, dim=1) - math.log(N)  # [P]
        std = marginal.std(unbiased=False)  # 0-d
        out.update({f"mi{sfx}": (matched - marginal).mean().item(), f"cond_entropy{sfx}": -matched.mean().item(),
                    f"entropy{sfx}": -marginal.mean().item(), f"marginal_std{sfx}": std.item(),
                    f"mi_zscore{sfx}": ((matched - marginal) / (std + eps)).mean().item()})
    same = cls[None, :] == cls[own][:, None]  # [P, N] column j is z_i's prompt or identical to it
    hit = same.gather(1, L.topk(min(8, N), dim=1).indices)  # [P, min(8, N)] in order of likelihood
    chance = same.double().mean(1).mean().item()
    out.update(retrieval_acc=hit[:, 0].double().mean().item(), retrieval_chance=chance)
    for k in (2, 4, 8):
        out[f"retrieval_acc@{k}"] = hit[:, :k].any(1).double().mean().item()
        out[f"retrieval_chance@{k}"] = min(1.0, min(k, N) * chance)
    return out


def std_collapsed(stds, n=10, frac=0.1):
    """RAGEN-2's reward-variance early stop (agent_trainer.fit): stds, the in-group reward std of every non-empty
    step so far, in order. True when the last n of the steps after the first n are all below frac x the mean of
    the first n."""
    base, later = stds[:n], stds[n:][-n:]
    return len(later) == n and all(s < frac * sum(base) / n for s in later)


def collapse_warnings(m, monitor):
    """Collapse indicators (paper Fig. 6) of step metrics m: in-group reward std and entropy falling far below their
    early level, a grad-norm spike, RAGEN-2's prompt-reasoning MI falling. monitor (checkpointed) keeps the history."""
    warn = []
    if len(monitor["early_std"]) < 5:
        monitor["early_std"].append(m["rollout/in_group_std"])
    elif (s0 := sum(monitor["early_std"]) / 5) > 0 and m["rollout/in_group_std"] < 0.1 * s0:
        warn.append(f"in-group reward std {m['rollout/in_group_std']:.3g} fell below 10% of its early level {s0:.3g}")
    if "actor/entropy" in m:  # a step left empty by the filter trained nothing and measured no entropy
        if len(monitor["early_entropy"]) < 5:
            monitor["early_entropy"].append(m["actor/entropy"])
        elif (e0 := sum(monitor["early_entropy"]) / 5) > 0 and m["actor/entropy"] < 0.1 * e0:
            warn.append(f"entropy {m['actor/entropy']:.3g} fell below 10% of its early level {e0:.3g}")
    g = monitor["grad_norms"]
    if len(g) >= 5 and m.get("actor/grad_norm", 0) > 10 * sorted(g)[len(g) // 2]:
        warn.append(f"actor grad norm {m['actor/grad_norm']:.3g} is over 10x its running median")
    mi = m.get("collapse/first_turn/mi")
    if mi is not None and not monitor.get("early_mi"):  # the first positive measurement is the reference
        monitor["early_mi"] = mi if mi > 0 else None
    elif mi is not None and mi < 0.1 * monitor["early_mi"]:
        warn.append(f"prompt-reasoning mutual information {mi:.3g} fell below 10% of its first value "
                    f"{monitor['early_mi']:.3g}: the responses stopped depending on the prompt")
    if math.isfinite(m.get("actor/grad_norm", float("nan"))):
        g.append(m["actor/grad_norm"])
        del g[:-50]
    return warn


def stop_reason(m, monitor, step, empty_stop_steps, early_stop, say=print):
    """RAGEN-2's stops (agent_trainer.fit), as (metric name, message) or None. Always: empty_stop_steps
    (--empty-stop-steps, 0 = never) steps in a row with nothing to train. With early_stop (--early-stop): the
    in-group reward std of 10 consecutive steps all under 10% of its mean over the first 10 non-empty steps; or a
    val-env success under 0.01 at 5 validations in a row. say: prints a step left empty."""
    empty = m["train/batch_size"] == 0
    monitor["empty_streak"] = monitor.get("empty_streak", 0) + 1 if empty else 0
    m["rollout/consecutive_empty_steps"] = monitor["empty_streak"]
    if empty:
        say(f"step {step}: nothing to train after filtering, step skipped ({monitor['empty_streak']} in a row)")
    if empty_stop_steps and monitor["empty_streak"] >= empty_stop_steps:
        return "empty_filtered_steps", f"{monitor['empty_streak']} steps in a row had nothing to train after filtering"
    if not early_stop:
        return None
    stds = monitor.setdefault("nonempty_std", [])  # in-group reward std of every non-empty step
    stds += [] if empty else [m["rollout/in_group_std"]]
    if not empty and std_collapsed(stds):
        return "reward_variance_collapse", (f"in-group reward std under 10% of its first-10-step mean "
                                            f"{sum(stds[:10]) / 10:.3g} for 10 steps in a row")
    low = monitor.setdefault("low_val_success", {})
    for k, v in m.items():
        if k.startswith("val-env/") and k.endswith("/success"):
            low[k] = low.get(k, 0) + 1 if v < 0.01 else 0
            if low[k] >= 5:
                return "low_validation_success", f"{k} under 0.01 at 5 validations in a row"
    return None
