"""Rollout: from "a model and a batch of environments" to "token tensors with loss masks".

Two parts, read top to bottom (models.py loads and checks the models):
  1. The sampler: a KV cache in which row b holds its first lens[b] tokens at slots 0..lens[b]-1,
     one forward function that appends a ragged block of new tokens to every row (prefill, the new
     tokens of a later turn, and single-token decode are all this call), temperature / top-p / greedy
     sampling, and the log-prob of each sampled token. It calls the submodules of an HF Llama/Qwen2
     model directly, so it needs a plain (not FSDP-sharded) model. On CUDA the decode step is
     compiled with CUDA graphs (static shapes); on CPU everything runs eager in fp32.
  2. The agent loop (RAGEN's ctx_manager + es_manager): prompts, parsing,
     stepping, penalties, and one token sequence per trajectory, never re-tokenised.
"""
import bisect
import re

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# ----------------------------------------------------------------------------------------------
# 1. The sampler
#
# GPU memory traffic, per decode step of B rows at context S (Qwen2.5-0.5B, bf16):
# the weights (~0.99 GB with the tied embedding read once as lm_head) plus every live row's K/V
# (24 layers x 2 x 2 heads x 64 x 2 B = 12 KiB per token) is the floor. Three things keep us near it:
#  - one K and one V tensor per layer, written in place by index assignment (index_put_ on a graph
#    input marked static): inductor stores the new [B, KV, 1, D] slice and copies nothing else. A
#    single 5-D [L, B, KV, S, D] tensor written with scatter_ on a view made inductor copy the whole
#    layer cache every token (~2.8 GB/token at B=16 x 3,602 slots); test_compiled_decode_step_* checks it.
#  - attention without GQA expansion: the G = H/KV query heads sharing a KV head are folded into the
#    query-length axis ([B, KV, G*T, D] against [B, KV, S, D]), so SDPA reads K/V once per KV head and
#    may use the memory-efficient kernel with our mask; `enable_gqa=True` plus a mask leaves only the
#    math kernel (fp32 upcast, K/V repeated G=7 times).
#  - sampling inside the compiled step: Gumbel-max noise is ~13 int64 ops and a log_softmax over
#    [B, V=151,936]; fused, it is one pass over the logits instead of ~23 eager passes.
# The host never waits for the GPU inside a turn except every `check_every` tokens.
# CUDA graphs have two rules the code below keeps (bench.py emulates both on the CPU, and the tests run every
# compiled path under the emulations): a compiled call's outputs live in buffers that the next compiled call
# reuses, so each output is cloned before anything else runs (as gpt-fast's generate.py does); and a graph
# with a CPU tensor input is run without CUDA graphs, so no Python float goes into a compiled call (dynamo
# turns one whose value changes, like the temperature between validation and training, into a CPU tensor).

_POOL = {}               # the one static KV pool: {"kv": (k_list, v_list)}; replaced, never duplicated
_COMPILED = {}


class Sampler(NamedTuple):
    """How the sampler runs. static: fixed batch, capacity and key-length buckets (what CUDA graphs need);
    compile: a torch.compile backend for the static path's sampler and decode step, None = eager ("inductor"
    on CUDA means mode="reduce-overhead": CUDA graphs; bench.py's emulations are backends too);
    check_every: decode tokens between host checks of "all rows done" (each check is a device sync)."""
    static: bool = False
    compile: object = None
    check_every: int = 1


def sampler_settings(device, name="auto"):
    """train.py's --sampler: eager, static (fixed shapes, eager), compiled (static + torch.compile'd decode step)
    or auto (compiled on CUDA, eager elsewhere). In fp32 all of them sample the same tokens; in bf16 on CUDA compiled
    and eager kernels round differently, so a token may differ where two logits are within rounding."""
    device = torch.device(device)
    if name == "auto":
        name = "compiled" if device.type == "cuda" else "eager"
    if name not in ("eager", "static", "compiled"):
        raise ValueError(f"sampler {name!r}: need auto, eager, static or compiled")
    return Sampler(static=name != "eager", compile="inductor" if name == "compiled" else None,
                   check_every=8 if device.type == "cuda" else 1)


# Prefills (a batch's prompts, a later turn's new tokens, shared-prefix spans) run padded to a multiple of this many
# tokens per device type, their key length rounded up alike (KVCache.prefill_shape): prompts of nearby lengths share
# one shape, so one mask size and, wherever prefill is compiled, one graph. The padding is masked and its outputs
# unused, so the tokens and log-probs do not depend on it (tested). 1 = exact lengths (bench.py --only prefill).
PREFILL_MULTIPLE = {"cpu": 8, "cuda": 64}
# A prefill's additive mask is [B, 1, G*T, end] in the compute dtype: 23 GB for 128 rows re-prefilled at 3,600 tokens
# in bf16 on Qwen2.5-0.5B (G = 7). forward_cached runs a prefill in row chunks whose mask stays under this many bytes
# (a decode step's never splits), which keeps the rollout's transients below the update's in memplan's count.
PREFILL_MASK_BYTES = 2**30


class KVCache:
    """Keys/values of B rows: one K and one V tensor per layer, each [B, KV, S, D]. Row b holds its first
    lens[b] tokens at slots 0..lens[b]-1 (no padding inside a row), so a token's slot is also its RoPE
    position. Padding queries write past a row's end (overwritten before any real query can see them)
    and the last slot is scratch space. static=True: the process-wide pool (CUDA graphs need fixed
    addresses); it may have more rows and slots than asked for, a bigger request replaces it, and rows
    are never dropped. multiple: what prefill shapes are rounded up to (PREFILL_MULTIPLE of its device)."""

    def __init__(self, model, B, capacity, static=False):
        attn, p = model.model.layers[0].self_attn, model.lm_head.weight
        L, KV, D = len(model.model.layers), attn.k_proj.out_features // attn.head_dim, attn.head_dim
        self.static = static
        old = _POOL["kv"][0][0] if static and "kv" in _POOL else None     # layer 0's K of the current pool
        same = old is not None and (old.dtype, old.device, len(_POOL["kv"][0]), old.shape[1], old.shape[3]) == (p.dtype, p.device, L, KV, D)
        if same and old.shape[0] >= B and old.shape[2] >= capacity:
            self.k, self.v = _POOL["kv"]
        else:
            if same:  # grow to cover both requests
                B, capacity = max(B, old.shape[0]), max(capacity, old.shape[2])
            if static:  # free the old pool before allocating the new one: never two pools at once
                old = None
                _POOL.clear()
            self.k = [torch.zeros(B, KV, capacity, D, dtype=p.dtype, device=p.device) for _ in range(L)]  # L x [B, KV, S, D]
            self.v = [torch.zeros_like(x) for x in self.k]                                                  # L x [B, KV, S, D]
            if static:
                _POOL["kv"] = (self.k, self.v)
                for x in self.k + self.v:
                    torch._dynamo.mark_static_address(x)
        self.lens = torch.zeros(self.k[0].shape[0], dtype=torch.long, device=p.device)  # [B]
        self.multiple = PREFILL_MULTIPLE.get(p.device.type, 8)

    def prefill_shape(self, T, end):
        """(T, end) of a prefill of T tokens per row attending to `end` keys, rounded up to a multiple of
        self.multiple; the key length at most the cache's slots. Its padding queries only write slots past their
        row's last token (or the scratch slot) and their outputs are never read; the padding keys are masked."""
        m = self.multiple
        return -(-T // m) * m, min(-(-end // m) * m, self.k[0].shape[2])

    def ensure(self, need):
        """Grow to hold `need` slots plus the scratch slot (eager path only)."""
        if need + 1 > self.k[0].shape[2]:
            if self.static:
                raise ValueError(f"static KV cache of {self.k[0].shape[2]} slots is too small for {need}")
            grow = (need + 1 + 255) // 256 * 256 - self.k[0].shape[2]
            pad = lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], grow, x.shape[3])], dim=2)
            self.k, self.v = [pad(x) for x in self.k], [pad(x) for x in self.v]

    def select(self, rows):
        """Keep rows (drop finished envs), or repeat them (copy a group's shared prompt)."""
        rows = torch.as_tensor(rows, device=self.lens.device)
        self.k, self.v, self.lens = [x[rows] for x in self.k], [x[rows] for x in self.v], self.lens[rows]


def forward_cached(model, k_cache, v_cache, lens, ids, n, end):
    """Append ids[b, :n[b]] to row b of the cache (slots lens[b]...) and return the next-token logits
    after each row's last new token. k_cache, v_cache: per-layer [B, KV, S, D]; ids [B, T]; n [B]
    (0 = the row only idles); end: keys to attend to, >= max(lens + T) over rows whose output is used.
    The caller adds n to lens. Calls the model's submodules (Llama / Qwen2 / Qwen3 layout)."""
    m, (B, T) = model.model, ids.shape
    a0 = m.layers[0].self_attn
    G = a0.q_proj.out_features // a0.k_proj.out_features                       # query heads per KV head
    r = max(1, PREFILL_MASK_BYTES // (G * T * end * m.embed_tokens.weight.element_size()))  # rows per chunk
    if B > r:  # row slices of the cache are views: each chunk writes its rows in place
        return torch.cat([forward_cached(model, [x[i:i + r] for x in k_cache], [x[i:i + r] for x in v_cache], lens[i:i + r],
                                         ids[i:i + r], n[i:i + r], end) for i in range(0, B, r)])
    pos = lens[:, None] + torch.arange(T, device=ids.device)                    # [B, T] slot = RoPE position
    slot = pos.clamp(max=k_cache[0].shape[2] - 1)                               # overflow -> scratch slot
    row = torch.arange(B, device=ids.device)[:, None]                           # [B, 1]
    h = m.embed_tokens(ids)                                                     # [B, T, d]
    cos, sin = m.rotary_emb(h, pos)
    # The mask, built once for every layer: causal + own row, folded like the queries (row g*T+t is query t of
    # head g), additive in the compute dtype so SDPA does not convert a bool mask in each layer. SDPA kernels: an
    # explicit mask rules out flash on CUDA; the memory-efficient kernel takes it (bench.py --gpu-check says which
    # ran), else math (fp32 scores, [G*T, end] per head materialised). The CPU takes its fused flash kernel.
    allowed = torch.arange(end, device=ids.device) <= pos[:, :, None]           # [B, T, end]
    mask = torch.zeros(B, 1, T, end, dtype=h.dtype, device=ids.device).masked_fill_(~allowed[:, None], float("-inf"))
    mask = mask.repeat(1, 1, G, 1) if G > 1 else mask                          # [B, 1, G*T, end]
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, -1, a.head_dim)                              # [B, T, H, D]
        k = a.k_proj(x).view(B, T, -1, a.head_dim)                              # [B, T, KV, D]
        v = a.v_proj(x).view(B, T, -1, a.head_dim)                              # [B, T, KV, D]
        if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, T, D], [B, KV, T, D]
        KV = k.shape[1]
        k_cache[i][row, :, slot] = k.transpose(1, 2)                            # in place: [B, T, KV, D] at (b, :, slot)
        v_cache[i][row, :, slot] = v                                            # v is still [B, T, KV, D]
        qf = q.reshape(B, KV, G * T, a.head_dim)                                # [B, KV, G*T, D] head kv*G+g -> row g*T+t
        o = F.scaled_dot_product_attention(qf, k_cache[i][:, :, :end], v_cache[i][:, :, :end], attn_mask=mask,
                                           scale=a.scaling)                     # [B, KV, G*T, D]
        # o's memory layout is the kernel's: contiguous on the CPU, a transposed view of [B, G*T, KV, D] memory from
        # CUDA's efficient and flash kernels. Splitting one dim (unflatten) is a view under any strides; the reshape
        # then makes the one copy o_proj needs: [B, KV, G, T, D] -> [B, T, KV, G, D] -> [B, T, H*D] (head kv*G+g)
        h = h + a.o_proj(o.unflatten(2, (G, T)).permute(0, 3, 1, 2, 4).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = h[torch.arange(B, device=ids.device), (n - 1).clamp(min=0)]          # [B, d] only these need logits
    # fp32 logits: bf16 ones are 0.125 apart in [16, 32), and the sampled log-probs would inherit that. On CUDA
    # the bf16 GEMM writes fp32 itself (mm's out_dtype: no autograd, fine here); an fp32 copy of the [V, d] weight
    # every decode step would more than double its memory traffic
    h, w = m.norm(last), model.lm_head.weight                                   # [B, d], [V, d]
    if h.is_cuda and h.dtype != torch.float32:
        return torch.mm(h, w.t(), out_dtype=torch.float32)                      # [B, V]
    # (W @ h^T)^T, the same dot products (summed in another order for some batch sizes: last-bit differences),
    # which MKL runs faster than h @ W^T for a decode batch of a few dozen rows
    return torch.mm(w.float(), h.float().t()).t().contiguous()                  # [B, V]


_M = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64 constants, as int64


def mix64(x, inplace=False):
    """splitmix64's finaliser on int64 tensors (multiplication wraps; shifts made logical by masking).
    inplace: overwrite x (a temporary of the caller's): one [B, V] temporary per round instead of four."""
    x = x if inplace else x.clone()
    for s, m in ((30, _M[1]), (27, _M[2]), (31, None)):
        t = x >> s
        x ^= t.bitwise_and_((1 << (64 - s)) - 1)
        if m is not None:
            x *= m
    return x


def row_keys(*columns):
    """Fold integer columns (lists or [A] tensors) into one int64 key per row."""
    k = None
    for c in columns:
        c = torch.as_tensor(c, dtype=torch.long)
        k = mix64(c if k is None else k * _M[0] + c)
    return k


def sample_next(logits, keys, temperature=1.0, top_p=None, greedy=False):
    """One token per row, and its log-prob under softmax(logits / temperature) (before top-p, which is
    what the trainer recomputes). logits [B, V], keys [B] int64 on logits' device -> (tokens [B], logp [B]).
    temperature, top_p: numbers or 0-d tensors; top_p None = no nucleus.
    The draw is Gumbel-max with noise that is a pure function of (key, vocab index), a counter-based RNG:
    a trajectory's samples do not depend on its batch, its rank, its cache path or a resumed run."""
    logp = torch.log_softmax(logits / temperature, dim=-1)                      # [B, V]
    if greedy:
        tok = logp.argmax(-1)
    else:
        V = logp.shape[1]
        x = mix64(mix64(keys)[:, None] + torch.arange(V, device=logp.device) * _M[0], inplace=True)  # [B, V]
        u = (x & 0xFFFFFF).float().add_(0.5).mul_(2.0 ** -24)                   # [B, V] uniform in (0, 1)
        score = u.log_().neg_().log_().neg_().add_(logp)                        # [B, V] logp + Gumbel noise
        if top_p is not None:  # nucleus: keep the smallest top set whose mass reaches top_p
            p, i = logp.exp().sort(-1, descending=True)
            outside = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, i, p.cumsum(-1) - p >= top_p)
            score = score.masked_fill(outside, float("-inf"))
        tok = score.argmax(-1)
    # a masked sum, not gather() or indexing: inductor's CPU backend (torch 2.13) fuses argmax + gather into a
    # kernel that reads the index before the reduction has finished ("index out of bounds"); exact all the same
    return tok, torch.where(torch.arange(logp.shape[1], device=tok.device) == tok[:, None], logp, 0.0).sum(-1)


def decode_step(model, k_cache, v_cache, lens, ids, n, end, keys, temperature, top_p, greedy):
    """One decode token for every row: forward_cached + sample_next, the unit compiled on the GPU (gpt-fast's
    decode_one_token), so the [B, V] logits are produced and consumed inside one graph."""
    return sample_next(forward_cached(model, k_cache, v_cache, lens, ids, n, end), keys, temperature, top_p, greedy)


def compiled(fn, backend, device):
    """fn as the static path runs it: torch.compile'd with `backend` (None: fn itself, eager); "inductor" on CUDA
    with mode="reduce-overhead" (CUDA graphs). Every output is cloned as the call returns: it lives in the graph's
    static buffers, which the next compiled call overwrites (with CUDA graph trees, frees) before it runs.
    Shapes are fixed except the key length `end`, which comes in buckets of 128: dynamo makes it symbolic
    after its second value (one recompile) and CUDA graph trees record one graph per bucket."""
    if backend is None:
        return fn
    if (fn, backend) not in _COMPILED:
        if device.type == "cuda" and backend == "inductor":
            c = torch.compile(fn, backend=backend, mode="reduce-overhead")
        else:  # inductor's vectorised C++ int64 multiply corrupts memory in torch 2.13 (the hash in sample_next)
            c = torch.compile(fn, backend=backend, options={"cpp.simdlen": 1} if backend == "inductor" else None)
        _COMPILED[fn, backend] = lambda *args: tuple(x.clone() for x in c(*args))
    return _COMPILED[fn, backend]


def shared_prefixes(prompts):
    """The prefix tree of a batch of fresh prompts (token lists; empty = idle row), so that each span several rows
    share is prefilled once: first the longest common prefix of all rows (the system prompt and instructions),
    then of each set of rows that agree on the next token (a group's identical prompt, up to its board), and so
    on. Every row keeps at least its last token to itself (its logits are needed). Returns (nodes, saved): nodes
    are (parent, start, end, rows) in breadth-first order (parents first, each depth contiguous); the rows (2 or
    more) share tokens [0, end) and the parent node holds [0, start) (-1: none, start 0). saved[i]: the prompt
    tokens whose K/V row i gets copied instead of computed (every row of a node but its first)."""
    nodes, saved = [], [0] * len(prompts)
    todo = [(-1, 0, [i for i, p in enumerate(prompts) if p])]  # (parent, start, rows) still to split
    while todo:
        parent, start, rows = todo.pop(0)
        first, end = prompts[rows[0]], min(len(prompts[r]) for r in rows) - 1
        for r in rows[1:]:
            p, j = prompts[r], start
            while j < end and p[j] == first[j]:
                j += 1
            end = j
        if end > start:
            nodes.append((parent, start, end, rows))
            parent = len(nodes) - 1
            for r in rows[1:]:
                saved[r] += end - start
        split = {}  # rows that go on past `end`, by their next token
        for r in rows:
            if len(prompts[r]) - 1 > end:
                split.setdefault(prompts[r][end], []).append(r)
        todo += [(parent, end, rs) for rs in split.values() if len(rs) > 1]
    return nodes, saved


def prefill_shared(model, cache, prompts, nodes, end):
    """Prefill fresh rows (cache.lens all 0) with prompts, each span of `nodes` (shared_prefixes) computed once.
    One forward per depth of the tree on a cache with a row per node, whose row starts as a copy of its parent's;
    then every row copies its deepest node's K/V and appends the rest of its own prompt. cache.lens is left to
    the caller. end: keys to attend to (>= the longest prompt). Returns the next-token logits [R, V]. Every
    forward runs at its KVCache.prefill_shape."""
    dev, R = cache.lens.device, len(cache.lens)
    top = max(e for _, _, e, _ in nodes)
    tree = KVCache(model, len(nodes), -(-top // cache.multiple) * cache.multiple + 1)  # row j: node j's tokens [0, end_j)
    depth = []
    for parent, *_ in nodes:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    for d in range(depth[-1] + 1):
        a, b = depth.index(d), len(depth) - depth[::-1].index(d)  # nodes a..b-1 are this depth's
        level = nodes[a:b]
        if d > 0:  # a child starts from its parent's K/V (copied past `start` too: overwritten before it is read)
            S = max(s for _, s, _, _ in level)
            par = torch.tensor([p for p, _, _, _ in level], device=dev)
            for x in tree.k + tree.v:
                x[a:b, :, :S] = x[par, :, :S]
        T, attend = tree.prefill_shape(max(e - s for _, s, e, _ in level), max(e for _, _, e, _ in level))
        ids = torch.tensor([prompts[rs[0]][s:e] + [0] * (T - e + s) for _, s, e, rs in level], device=dev)  # [b-a, T]
        lens = torch.tensor([s for _, s, _, _ in level], device=dev)                                      # [b-a]
        forward_cached(model, [x[a:b] for x in tree.k], [x[a:b] for x in tree.v], lens, ids,
                       torch.tensor([e - s for _, s, e, _ in level], device=dev), attend)
    leaf = [-1] * R  # the deepest node holding each row (nodes are in breadth-first order)
    for j, (_, _, _, rs) in enumerate(nodes):
        for r in rs:
            leaf[r] = j
    pre = [nodes[j][2] if j >= 0 else 0 for j in leaf]                          # tokens row r gets by copy
    held = [r for r in range(R) if leaf[r] >= 0]
    src, dst = torch.tensor([leaf[r] for r in held], device=dev), torch.tensor(held, device=dev)
    for big, small in zip(cache.k + cache.v, tree.k + tree.v):
        big[dst, :, :top] = small[src, :, :top]
    rest = [list(p[k:]) for p, k in zip(list(prompts) + [[]] * (R - len(prompts)), pre)]
    T, end = cache.prefill_shape(max(1, max(len(x) for x in rest)), end)
    ids = torch.tensor([x + [0] * (T - len(x)) for x in rest], device=dev)     # [R, T] right-padded
    return forward_cached(model, cache.k, cache.v, torch.tensor(pre, device=dev), ids,
                          torch.tensor([len(x) for x in rest], device=dev), end)


@torch.no_grad()  # not inference_mode: the outputs feed autograd later
def sample_turn(model, cache, new_ids, max_new_tokens, stop_ids, keys, temperature=1.0, top_p=1.0, greedy=False,
                sampler=Sampler(), share=True, stop_at=None):
    """Append new_ids[b] to cache row b, then sample up to max_new_tokens per row, each row stopping at a
    stop token or its budget. An empty new_ids[b] marks an idle row; cache rows past len(new_ids) idle too.
    Returns per-row lists of sampled tokens and their log-probs. keys [A] int64: one sampling key per row
    (the t-th draw uses key + t). The last sampled token is not in the cache (the next turn appends it).
    sampler: how to run (Sampler); its static must match the cache's. share: prefill the prefixes that fresh
    rows share once (shared_prefixes); False computes every row's prompt (the reference the tests compare to).
    stop_at(tokens) -> n or None (e.g. answer_end): a row also stops once its first n tokens are a complete turn
    and keeps only those. It is checked with "all rows done" (every sampler.check_every tokens), so a row may
    sample a few tokens past n: they are dropped and its cache row rolls back to the cut. The kept tokens and
    log-probs are those the row draws without stop_at (a prefix of them: same keys, same logits)."""
    dev, A, R = cache.lens.device, len(new_ids), len(cache.lens)
    new_ids = list(new_ids) + [[]] * (R - A)                                    # static pool: extra rows idle
    n = torch.tensor([len(x) for x in new_ids], device=dev)                     # [R]
    live = [l + len(x) for l, x in zip(cache.lens.tolist(), new_ids) if x]
    hi = max(live) if live else 1                                               # longest live row after the append
    cache.ensure(hi + max_new_tokens)   # idle rows (finished episodes with long histories) never size the cache
    keys = torch.cat([torch.as_tensor(keys, dtype=torch.long), torch.zeros(R - A, dtype=torch.long)]).to(dev)  # [R]
    nodes = shared_prefixes(new_ids)[0] if share and not bool(cache.lens.any()) else None
    if nodes:  # fresh rows whose prompts share prefixes (a preset's instructions, a group's prompt): each once
        logits = prefill_shared(model, cache, new_ids, nodes, hi)
    else:  # the append at its bucketed shape (KVCache.prefill_shape)
        T, end = cache.prefill_shape(max(1, max(len(x) for x in new_ids)), hi)
        ids = torch.tensor([list(x) + [0] * (T - len(x)) for x in new_ids], device=dev)  # [R, T] right-padded
        logits = forward_cached(model, cache.k, cache.v, cache.lens, ids, n, end)  # [R, V]
    cache.lens += n
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    out = torch.zeros(R, max_new_tokens, dtype=torch.long, device=dev)          # [R, N]
    out_lp = torch.zeros(R, max_new_tokens, device=dev)                         # [R, N]
    count = torch.zeros(R, dtype=torch.long, device=dev)                        # [R] tokens sampled so far
    done = n == 0                                                               # [R]
    backend = sampler.compile if cache.static else None  # only fixed shapes are compiled
    sample, step = compiled(sample_next, backend, dev), compiled(decode_step, backend, dev)
    every = sampler.check_every
    temp = torch.tensor(float(temperature), device=dev)                        # [] device tensors, never a Python
    nucleus = None if top_p >= 1.0 else torch.tensor(float(top_p), device=dev)  # float: see "CUDA graphs" above
    tok, lp = sample(logits, keys, temp, nucleus, greedy)
    for t in range(max_new_tokens):
        out[:, t], out_lp[:, t] = tok, lp
        count += (~done).long()
        done = done | torch.isin(tok, stop) | (count == max_new_tokens)
        if t == max_new_tokens - 1:
            break
        if t % every == every - 1:  # the only host sync
            if stop_at is not None:  # rows whose text completed a turn stop too (cut below)
                rows = (~done[:A]).nonzero().flatten().tolist()
                done[[b for b, ids in zip(rows, out[rows, :t + 1].tolist()) if stop_at(ids) is not None]] = True
            if bool(done.all()):
                break
        fed = (~done).long()                                                    # finished rows idle
        end = hi + 1 if not cache.static else min(cache.k[0].shape[2], (hi // 128 + 1) * 128)  # buckets: few graphs
        tok, lp = step(model, cache.k, cache.v, cache.lens, tok[:, None], fed, end, keys + (t + 1), temp, nucleus, greedy)
        cache.lens += fed
        hi += 1
    count, out, out_lp = count.tolist(), out.tolist(), out_lp.tolist()
    if stop_at is not None:  # keep each row up to its turn's end; its cache row holds the kept tokens but the last
        for b in range(A):
            n = stop_at(out[b][:count[b]])
            if n is not None and n < count[b]:
                cache.lens[b] -= count[b] - n
                count[b] = n
    return [out[b][:count[b]] for b in range(A)], [out_lp[b][:count[b]] for b in range(A)]


def static_capacity(need):
    """Slots of a static cache: a multiple of 128, so every key-length bucket fits and none is the odd one."""
    return (need // 128 + 1) * 128


def generate(model, prompts, max_new_tokens, stop_ids=(), attention_mask=None, temperature=1.0, top_p=1.0,
             greedy=False, seed=0, sampler=None, share_prefixes=True):
    """Single-turn sampling. prompts: list of token lists, or a [B, P] tensor padded on either side with
    its attention_mask. Returns (tokens, logps): per-row lists, each ending at its stop token if any.
    sampler: a Sampler (default: sampler_settings of the model's device)."""
    if torch.is_tensor(prompts):
        mask = torch.ones_like(prompts, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [row[m].tolist() for row, m in zip(prompts, mask)]
    sampler = sampler or sampler_settings(model.lm_head.weight.device)
    need = max(len(p) for p in prompts) + max_new_tokens + 1
    cache = KVCache(model, len(prompts), static_capacity(need) if sampler.static else need, static=sampler.static)
    keys = row_keys([seed] * len(prompts), range(len(prompts)))
    return sample_turn(model, cache, prompts, max_new_tokens, stop_ids, keys, temperature, top_p, greedy, sampler,
                       share_prefixes)


# ----------------------------------------------------------------------------------------------
# 2. The agent loop (RAGEN's ctx_manager + es_manager)

SYSTEM = "You're a helpful assistant. "  # RAGEN ctx_manager system prompt (trailing space included)
FORMATS = {True: "<think> [Your thoughts] </think> <answer> [your answer] </answer>",
           False: "<answer> [your answer] </answer>"}
SPECIAL_STRINGS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")


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


TURN_PATTERNS = {True: re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL),  # RAGEN's
                 False: re.compile(r"<answer>(.*?)</answer>", re.DOTALL)}                      # _parse_response


def parse_response(text, think, max_actions):
    """RAGEN ctx_manager._parse_response. text includes the forced '<think>'/'<answer>' prefix.
    Returns (think_text, actions, matched)."""
    match = TURN_PATTERNS[think].search(text)
    if match is None:
        return "", [], False
    parts = list(match.groups())
    for s in SPECIAL_STRINGS:
        parts = [p.replace(s, "") for p in parts]
    actions = [a.strip() for a in parts[-1].strip().split("||") if a.strip()]
    return (parts[0].strip() if think else ""), actions[:max_actions], True


def answer_end(tok, forced, think):
    """sample_turn's stop_at for a turn that ends where RAGEN ends it: at the closing tag of its first match of
    RAGEN's pattern (think mode: the '</answer>' that completes think-then-answer). Returns a function of a row's
    sampled tokens: the number of tokens up to and including the one that completes the match, or None while
    there is no match. The match of the kept tokens is the match of any longer text: the earliest-ending match
    also starts leftmost (the pattern's (.*?) may swallow an earlier '<think>' / '<answer>'), so parsing the
    cut turn gives the uncut turn's think and actions. A token that completes the tag and carries text past it
    is kept whole: the kept tokens are always a prefix of the sampled ones."""
    pattern = TURN_PATTERNS[think]
    found = lambda ids, n: pattern.search(forced + tok.decode(ids[:n], skip_special_tokens=True)) is not None

    def stop_at(ids):
        if not found(ids, len(ids)):
            return None
        return bisect.bisect_left(range(len(ids) + 1), True, key=lambda n: found(ids, n))  # the shortest prefix
    return stop_at


def reasoning_span(tok, tokens, loss_mask, turn_end, think):
    """RAGEN-2's (x, z) of one turn, for train.py's collapse diagnostics. tokens, loss_mask: one rollout row as
    lists; turn_end: the turn's last sampled position (rollout's turn_ends). x = every token before the turn's
    first sampled token: the conversation so far, ending with the forced '<think>' ('<answer>' in no-think mode).
    z = the sampled tokens of the think (no-think: answer) span, up to the first token that reaches the closing
    tag, or up to the end of the turn's text when the tag never closes (a trailing stop token is not text).
    Returns (x, z) as token lists; z may be empty."""
    start = turn_end
    while start > 0 and loss_mask[start - 1]:  # the turn's sampled tokens are one contiguous span
        start -= 1
    resp = tokens[start:turn_end + 1]
    length = lambda n: len(tok.decode(resp[:n], skip_special_tokens=True))  # characters of the first n tokens
    text = tok.decode(resp, skip_special_tokens=True)
    cut = text.find("</think>" if think else "</answer>")
    n = bisect.bisect_left(range(len(resp) + 1), len(text) if cut < 0 else cut, key=length)
    return tokens[:start], resp[:n]


def step_env(env, actions, budget):
    """RAGEN es_manager.step: execute the valid actions in order, at most `budget` of them, stopping when
    the episode ends. Invalid ones (env says action_is_valid=False) are no-ops that cost no budget.
    Returns (reward, done, info of the last step, counts, infos of the executed steps)."""
    names = env.actions()
    lookup = None if names is None else {a.strip().lower() for a in names}
    reward, done, info, infos = 0.0, False, {}, []
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
        reward += float(r)
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
        said = (f"<think>{r['think']}</think>" if think else "") + f"<answer>{' || '.join(r['actions'])}</answer>"
        text += (f"Turn {t} State:\n{ep['states'][t - 1]}\nTurn {t} Action: {said if r['matched'] else r['raw']}\n"
                 f"Turn {t} Reward: {r['reward'] + (format_penalty if r['penalized'] else 0.0)}\n---\n")
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
                scores=torch.tensor([sum(e["turn_rewards"]) for e in eps]) + penalty,
                success=torch.tensor([e["success"] for e in eps]), group=torch.arange(B) // group_size,
                episode=torch.tensor([r[0] for r in rows], dtype=torch.long),
                text=[tok.decode(e["ids"]) for e in eps], stats=stats, responses=[e["responses"] for e in eps])


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
    opening_message, the forced tag ('<think>', or '<answer>' without thinking: RAGEN appends it after the
    generation prompt), the end-of-turn tokens (e.g. [<|im_end|>, "\\n"]) and the token ids that stop sampling."""
    head, gen, close, user_head = chat_pieces(tok, system_message(preset))
    forced = "<think>" if think else "<answer>"
    close_ids = tok.encode(close, add_special_tokens=False)
    gc_eos = model.generation_config.eos_token_id
    stop_ids = ({close_ids[0], tok.eos_token_id} | set(gc_eos if isinstance(gc_eos, list) else [gc_eos])) - {None}
    return (tok, head, user_head, gen + forced), forced, close_ids, stop_ids


def rollout(model, tok, envs, seeds, preset, *, group_size, max_turns=5, max_actions_per_turn=5, max_new_tokens=100,
            temperature=1.0, top_p=1.0, greedy=False, think=True, max_context=4096, format_penalty=-0.1,
            kv_reuse=True, split=None, sample_seed=0, window=-1, window_mode="full", progress=None, sampler=None,
            share_prefixes=True, respond=None, stop_at_answer=True):
    """Play B = num_groups * group_size episodes at once; one token sequence per episode.
    The sampling noise of a token is a pure function of (sample_seed, the episode's env seed, its index in
    the group, the turn, the token's index in the turn): the same episodes draw the same noise whatever the batch,
    the number of ranks, the cache path, or a resume, and so sample the same tokens where their logits come out
    the same (fp32 on the CPU, tested); in bf16 on CUDA a GEMM rounds by its shape, so a token may differ where
    two noisy logits are within rounding.
    window, window_mode: RAGEN-2's context windows (see open_turn); the windowed modes give one row per turn, and
    `episode` [R] says which episode each row belongs to.
    share_prefixes: rows prefilled from slot 0 together compute each prompt prefix they share once and copy its
    K/V (rollout.shared_prefixes); stats' prefill_saved counts the prompt tokens each row got by copy.
    progress(turn, max_turns), if given, is called as each turn starts (train.py's progress bar).
    sampler: a Sampler (default: sampler_settings of the model's device).
    respond(b, env), if given, writes episode b's answer (the text after the forced tag) in place of sampling: the
    model is not run, and the answer is laid out as a sampled one that stopped (sft.py's demonstrations).
    stop_at_answer: a turn ends at its closing tag, as RAGEN ends it (answer_end): what a row samples past the tag
    is dropped before it is trained, logged or shown again, and the end-of-turn tokens after the tag are forced
    (mask 0: every trained token is one the policy sampled). False: a turn runs to a stop token or its budget and
    every sampled token is kept (trained, and shown in later turns)."""
    B = len(envs)
    check_rollout_args(seeds, B, group_size, temperature, max_new_tokens, window, window_mode)
    chat, forced, close_ids, stop_ids = turn_layout(model, tok, preset, think)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    stop_at = answer_end(tok, forced, think) if stop_at_answer else None  # a turn ends at its closing tag
    sampler = sampler or sampler_settings(model.lm_head.weight.device)
    room = max_context - max_new_tokens - len(close_ids)  # the most a conversation may hold before an answer

    for b, (env, seed) in enumerate(zip(envs, seeds)):  # RAGEN-2's Bandit (seed_per_member): one game per member
        member = dict(member=b % group_size) if preset.get("seed_per_member") else {}
        env.reset(seed, **member) if split is None else env.reset(seed, split=split, **member)
    eps = [new_episode(preset["max_actions_per_traj"]) for _ in range(B)]
    samples = None if window_mode == "full" else []  # the windowed modes' per-turn rows (b, ids, flags, logps)
    cache, rows = None, list(range(B))  # rows[i] = the episode held in cache row i
    for turn in range(1, max_turns + 1):
        if progress is not None:
            progress(turn, max_turns)
        new, rebuilt = set(), set()
        for b in (b for b in range(B) if not eps[b]["finished"]):
            opened, again = open_turn(eps[b], envs[b], turn, chat, preset, think, format_penalty, window, window_mode, room)
            new |= {b} if opened else set()
            rebuilt |= {b} if again else set()
        if not new:
            break
        if respond is not None:  # scripted: no model, no cache
            rows = sorted(new)
            toks, lps = script_turn(respond, envs, rows, enc, close_ids, stop_at, max_new_tokens)
        else:
            cache, rows, todo = cache_rows(model, cache, rows, eps, new, rebuilt, kv_reuse, sampler.static, max_context,
                                           share_prefixes)
            keys = row_keys([sample_seed] * len(rows), [seeds[b] for b in rows], [b % group_size for b in rows],
                            [turn] * len(rows))
            toks, lps = sample_turn(model, cache, todo, max_new_tokens, stop_ids, keys, temperature, top_p, greedy,
                                    sampler, share_prefixes, stop_at)
        for i, b in enumerate(rows):
            if b in new:
                row = record_turn(eps[b], envs[b], toks[i], lps[i], tok, forced, close_ids, think, max_actions_per_turn,
                                  format_penalty, samples is not None)
                if row is not None:
                    samples.append((b, *row))
    return rollout_output(eps, samples, tok, group_size)
