"""The sampler: batched multi-turn sampling from a KV cache, in the order a call runs.

A KV cache in which row b holds its first lens[b] tokens at slots 0..lens[b]-1; one forward function that appends
a ragged block of new tokens to every row (prefill, the new tokens of a later turn, and single-token decode are all
this call); temperature / top-p / greedy sampling with counter-based Gumbel-max noise; the log-prob of each sampled
token. It calls the submodules of an HF Llama/Qwen2/Qwen3 model directly, so it needs a plain (not FSDP-sharded)
model (models.py loads and checks it against the HF forward). On CUDA the decode step is compiled with CUDA graphs
(static shapes); on the CPU everything runs eager. rollout.py drives it turn by turn; generate() is one turn.
"""
import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

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
# CUDA graphs have two rules the code below keeps (gpu_check.py emulates both on the CPU, and the tests run every
# compiled path under the emulations): a compiled call's outputs live in buffers that the next compiled call
# reuses, so each output is cloned before anything else runs (as gpt-fast's generate.py does); and a graph
# with a CPU tensor input is run without CUDA graphs, so no Python float goes into a compiled call (dynamo
# turns one whose value changes, like the temperature between validation and training, into a CPU tensor).

_POOL = {}               # the one static KV pool: {"kv": (k_list, v_list)}; replaced, never duplicated
_COMPILED = {}


class Sampler(NamedTuple):
    """How the sampler runs. static: fixed batch, capacity and key-length buckets (what CUDA graphs need);
    compile: a torch.compile backend for the static path's sampler and decode step, None = eager ("inductor"
    on CUDA means mode="reduce-overhead": CUDA graphs; gpu_check.py's emulations are backends too);
    check_every: decode tokens between the host's reads of the new tokens (each a device sync; a row's turn ends
    only there)."""
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
    # explicit mask rules out flash on CUDA; the memory-efficient kernel takes it (gpu_check.py says which
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
    return torch.mm(fp32_weight(w), h.float().t()).t().contiguous()            # [B, V]


_FP32 = {}  # the fp32 copy of a bf16 lm_head weight on the CPU: {"src": weight, "version": its _version, "w": copy}


def fp32_weight(w):
    """w in fp32. The CPU has no GEMM that writes fp32 from bf16 inputs, so a bf16 model's lm_head runs in fp32 on a
    copy of its [V, d] weight, made once and kept while w is unchanged: train.py refreshes the rollout copy in place
    after every update (Parameter.copy_), which moves w._version on. Converting it every decode step instead took
    4x the product's time (SmolLM2, 16 rows). The copy holds w, so w's memory cannot pass to another tensor."""
    if w.dtype == torch.float32:
        return w
    if _FP32.get("src") is not w or _FP32["version"] != w._version:
        _FP32.clear()  # one model samples at a time: never two copies
        _FP32.update(src=w, version=w._version, w=w.float())
    return _FP32["w"]


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


def decode_step(model, k_cache, v_cache, lens, tok, fed, end, keys, temperature, top_p, greedy):
    """One decode token for every row: forward_cached + sample_next, the unit compiled on the GPU (gpt-fast's
    decode_one_token), so the [B, V] logits are produced and consumed inside one graph, and with it the loop's
    per-token bookkeeping, so that the host does nothing else per token. Row b appends tok[b] [B] if fed[b] [B]
    (1, or 0: the row idles), samples with key keys[b] + lens[b] (sample_turn offsets its keys so that this counts
    the row's tokens) and then holds lens[b] + fed[b] tokens. Returns (tokens [B], logp [B], lens + fed [B])."""
    logits = forward_cached(model, k_cache, v_cache, lens, tok[:, None], fed, end)                  # [B, V]
    tok, logp = sample_next(logits, keys + lens, temperature, top_p, greedy)
    return tok, logp, lens + fed


def compiled(fn, backend, device):
    """fn as the static path runs it: torch.compile'd with `backend` (None: fn itself, eager); "inductor" on CUDA
    with mode="reduce-overhead" (CUDA graphs). Every output is cloned as the call returns: it lives in the graph's
    static buffers, which the next compiled call overwrites (with CUDA graph trees, frees) before it runs.
    Shapes are fixed except the key length `end`, one of key_buckets(): dynamo makes it symbolic after its second
    value (one recompile) and CUDA graph trees record one graph per bucket."""
    if backend is None:
        return fn
    if (fn, backend) not in _COMPILED:
        if device.type == "cuda" and backend == "inductor":
            c = torch.compile(fn, backend=backend, mode="reduce-overhead")
        else:  # inductor's vectorised C++ int64 multiply corrupts memory in torch 2.13 (the hash in sample_next)
            c = torch.compile(fn, backend=backend, options={"cpp.simdlen": 1} if backend == "inductor" else None)
        _COMPILED[fn, backend] = lambda *args: tuple(x.clone() for x in c(*args))
    return _COMPILED[fn, backend]


# The static path's decode steps attend to `end` keys, one number for all rows: the smallest of key_buckets() that
# holds the longest row. CUDA graph trees record a graph for every distinct integer input of a compiled graph (the
# key length, once dynamo has made it symbolic), each a capture and its own memory, and Inductor warns past 8 a graph;
# every key past a row's end is read and masked for nothing. KEY_BUCKETS lengths spaced geometrically from 256 to the
# pool's slots bound the recordings whatever --max-context is; at --max-context 3600 (3,712 slots): 256, 384, 640,
# 896, 1280, 1792, 2560, 3712, each at most 1.7x the one below (1.5x past 640), where 128-token buckets gave 29
# graphs. Past 256 keys a decode step then reads at most that many times the keys it needs, beside the weights, which
# it reads whole (Qwen2.5-0.5B: ~0.99 GB against 12 KiB of K/V per key per row, 0.2 GB at 16 rows x 1,024 keys).
KEY_BUCKETS = 8


def key_buckets(capacity):
    """The key lengths of a static cache of `capacity` slots (a multiple of 128): KEY_BUCKETS multiples of 128,
    geometric from 256 to capacity, the last capacity itself (fewer where they round to the same)."""
    grow = (capacity / 256) ** (1 / (KEY_BUCKETS - 1))
    return sorted({min(capacity, -(-round(256 * grow ** i) // 128) * 128) for i in range(KEY_BUCKETS)})


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
    stop_at(tokens, start) -> n or None (e.g. answer_end): a row also stops once its first n tokens are a complete
    turn and keeps only those; start: tokens already known to complete none (each is tested once).
    The host reads the sampled tokens every sampler.check_every tokens (its only wait for the device), and only there
    does a row's turn end, at a stop token or at stop_at's cut: until the check every row of the turn samples on, and
    what it samples past its end is dropped, its cache row rolled back to the end (the slots past it are overwritten
    before any query can see them). The kept tokens and log-probs are those the row draws alone (same keys, same
    logits), a prefix of them with stop_at."""
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
    start = cache.lens.clone()                                                  # [R] each row's length before its turn
    fed = (n > 0).long()                # [R] the turn's rows append a token every step, idle rows none
    offsets = keys - start + 1          # [R] a row holding start + t - 1 tokens samples its t-th: key + t
    backend = sampler.compile if cache.static else None  # only fixed shapes are compiled
    sample, step = compiled(sample_next, backend, dev), compiled(decode_step, backend, dev)
    every, stops = sampler.check_every, set(stop_ids)
    temp = torch.tensor(float(temperature), device=dev)                        # [] device tensors, never a Python
    nucleus = None if top_p >= 1.0 else torch.tensor(float(top_p), device=dev)  # float: see "CUDA graphs" above
    toks, lps = [], []                              # per token [R] each: the turn's draws, on the device until the end
    seen = [[] for _ in range(A)]                   # each open row's tokens up to the last check
    kept = [None if x else 0 for x in new_ids[:A]]  # each row's tokens once its turn has ended
    checked = 0                                     # tokens the host has read

    def check():  # the host reads the tokens since the last check (a device sync): do open rows' turns end there?
        nonlocal checked
        rows = torch.stack(toks[checked:], 1)[:A].tolist()                       # [A, tokens since the last check]
        checked = len(toks)
        for b, new in enumerate(rows):
            if kept[b] is None:
                stop = next((i + 1 for i, x in enumerate(new) if x in stops), None)  # up to its first stop token
                seen[b] += new[:stop]
                cut = stop_at(seen[b], len(seen[b]) - len(new[:stop])) if stop_at is not None else None
                kept[b] = cut if cut is not None else len(seen[b]) if stop is not None else None
        return all(k is not None for k in kept)
    buckets = key_buckets(cache.k[0].shape[2]) if cache.static else None
    end = 0
    # What a compiled decode call costs the host is dynamo's, mostly for the model (bench.py --only host): its ~290
    # parameters (Qwen2.5-0.5B) gathered as graph inputs by Python bytecode on every call, and the guards on them and
    # their modules. Two settings cut it. Compiled here, a graph holds the model's parameters and buffers as its own
    # attributes (dynamo's install_free_tensors): the same tensor objects, so train.py's in-place weight refresh
    # reaches it, and new ones fail a guard. And a call skips the guards when the call before it in this turn ran them
    # at the same key length: every input is then the same object (model, K/V pool, temperature, top-p, greedy,
    # offsets, fed, key length) or a clone of that call's output (tokens, lens: same shape, dtype and device), so no
    # guard can come out otherwise. Under that stance dynamo still checks tensors (and refuses one that changed) but
    # not Python values: it would run a stale graph for a new key length, top-p mode or greedy flag, which is why a
    # turn's first call and each new key length run the guards (and recompile where they fail).
    free_tensors = torch._dynamo.config.patch(install_free_tensors=True) if backend else contextlib.nullcontext()
    with free_tensors, contextlib.ExitStack() as unguarded:
        tok, lp = sample(logits, keys, temp, nucleus, greedy)
        toks.append(tok)
        lps.append(lp)
        for t in range(1, max_new_tokens):  # t: the token this step samples (token 0 came from the prefill's logits)
            if t % every == 0 and check():
                break
            new_key_length = hi >= end
            if new_key_length:
                unguarded.close()
                end = hi + 1 if buckets is None else next(b for b in buckets if b > hi)
            tok, lp, cache.lens = step(model, cache.k, cache.v, cache.lens, tok, fed, end, offsets, temp, nucleus, greedy)
            if new_key_length and backend is not None:
                unguarded.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
            toks.append(tok)
            lps.append(lp)
            hi += 1
    if checked < len(toks):
        check()
    kept = [len(seen[b]) if k is None else k for b, k in enumerate(kept)]     # the budget ended the rest
    cache.lens = start + torch.tensor([max(k - 1, 0) for k in kept] + [0] * (R - A), device=dev)  # [R] its last
    out, out_lp = torch.stack(toks, 1)[:A].tolist(), torch.stack(lps, 1)[:A].tolist()  # [A, N]; token not cached
    return [out[b][:kept[b]] for b in range(A)], [out_lp[b][:kept[b]] for b in range(A)]


def static_capacity(need):
    """Slots of a static cache: a multiple of 128, as its key lengths (key_buckets, the last of them the capacity)."""
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


@torch.no_grad()
def self_check(model, tol=1e-3):
    """models.load_model's check for every model that is sampled: refuse (ValueError) a model the sampler would
    compute wrong: next-token logits of a ragged 2-row batch fed through the KV cache in two chunks (prefill, then an
    append at an offset), against the HF model's own forward, in fp32.
    tol is on max |difference| / std of the logits: fp32 noise is ~1e-5 (SmolLM2), a skipped q_norm ~1.
    Three small forwards, each reading every weight once (timings: results/performance.md)."""
    V, dev = model.config.vocab_size, model.lm_head.weight.device
    ids = (torch.arange(12, device=dev).view(2, 6) * 7919 + 5) % V                 # [2, 6] arbitrary tokens
    n = torch.tensor([6, 3], device=dev)                                            # [2] ragged rows
    cache = KVCache(model, 2, 8)
    forward_cached(model, cache.k, cache.v, cache.lens, ids[:, :2], torch.full_like(n, 2), 2)
    cache.lens += 2
    ours = forward_cached(model, cache.k, cache.v, cache.lens, ids[:, 2:], n - 2, 6)  # [2, V]
    mask = torch.arange(6, device=dev) < n[:, None]                                 # [2, 6] right padding
    ref = model(ids, attention_mask=mask.long()).logits[torch.arange(2), n - 1].float()  # [2, V]
    err = ((ours - ref).abs().max() / ref.std()).item()
    if not err <= tol:  # NaN fails too
        raise ValueError(f"{type(model).__name__}: the sampler's next-token logits differ from the HF forward "
                         f"(max error {err:.2g} x logit std > {tol:g}); refusing a model it would sample wrong")
