"""What a GPU machine checks first, and the emulations that let the CPU (and the suite) check the same things.

  python gpu_check.py                          # on a GPU, before anything else: PASS / FAIL per line, exit 1 on a FAIL
  CUDA_VISIBLE_DEVICES= python gpu_check.py    # on the CPU: the tiny model, CUDA graphs and CUDA's layouts emulated
  python gpu_check.py --layers 2               # the decode and train.py lines on 2 of Qwen2.5-0.5B's 24 layers

`python bench.py --gpu-check` runs the same. Each numbered check is a function check_<what>(ctx) returning
(name, ok, detail), ok None when there is nothing to hold this device to (the line only reports, INFO); main runs
them in order and prints one PASS / FAIL / INFO line each. Below the checks' CPU stand-ins: two torch.compile
backends for CUDA graphs, CUDA on fake tensors, CUDA's SDPA layout and kernel rules, host-sync counting; the suite
imports them from here.
"""
import argparse
import contextlib
import copy

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import bench
import models
import rollout
import sampler
import starpo


# ------------------------------------------------------------------------------------------------ the checks
def context(device, layers=24, bandwidth=3.35e12, floor_fraction=0.25):
    """What the checks share, built once. On CUDA the sampler's lines run on the Qwen2.5-0.5B shape (random weights,
    bf16; 2 layers for the kernel and logits lines, `layers` for train.py and decode speed); on the CPU on the tiny
    model, whose bf16 copy stands in for the logits lines. compiled: the static sampler the first two checks share
    (inductor with CUDA graphs on CUDA, the recording and replay emulations on the CPU). prompts: random tokens from
    a seeded generator, so that the logits lines print the same figures in every run."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    model, tok = models.load_model("tiny", device=device, check=sampler.self_check)  # fp32: compiled and eager agree
    recording = RecordingBackend(GraphReplayBackend())
    qwen = bench.qwen25_05b_random(device, torch.bfloat16, layers=2) if cuda else model  # CUDA: 7 query heads per KV head
    prompts = torch.randint(0, qwen.config.vocab_size, (8, 100), generator=torch.Generator().manual_seed(0))   # [8, 100]
    return dict(device=device, cuda=cuda, model=model, tok=tok, recording=recording,
                compiled=sampler.Sampler(static=True, compile="inductor" if cuda else recording, check_every=8),
                qwen=qwen, prompts=prompts.tolist(),
                low=qwen if cuda else models.cast_parameters(copy.deepcopy(model), torch.bfloat16),
                decoder=bench.qwen25_05b_random(device, torch.bfloat16, layers) if cuda else model,
                layers=layers, bandwidth=bandwidth, floor_fraction=floor_fraction)


def frozenlake_rollout(ctx, how, seeds=(5, 5, 6, 6), temperature=None):
    """The tiny model's 3-turn FrozenLake rollout on sampler `how` (the first two checks)."""
    from env_frozenlake import PRESETS, FrozenLakeEnv
    preset = PRESETS["FrozenLake"]
    settings = bench.loop_settings(preset, max_turns=3, max_new_tokens=16, max_context=1200, think=False, top_p=0.95,
                                   sample_seed=4)
    return rollout.rollout(ctx["model"], ctx["tok"], [FrozenLakeEnv(**preset["kwargs"]) for _ in seeds], list(seeds),
                           settings, group_size=2, temperature=temperature, sampler=how)


def check_compiled_matches_eager(ctx):
    """1: the compiled static sampler (from a fresh dynamo) samples the eager sampler's tokens."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    eager, got = frozenlake_rollout(ctx, sampler.Sampler()), frozenlake_rollout(ctx, ctx["compiled"])
    same = torch.equal(got["tokens"], eager["tokens"])
    return ("compiled == eager", same, f"{int(got['stats']['response_tokens'].sum())} tokens sampled by the static path "
            f"({'inductor, CUDA graphs' if ctx['cuda'] else 'CUDA-graph replays emulated'}), identical to eager: {same}")


def check_graphs_and_recompiles(ctx):
    """2: validation (T=0.5) and training (T=1.0) for 3 steps on check 1's compiled sampler, whose graphs count too:
    at most 3 graphs, and none that inductor runs without CUDA graphs (a CPU input)."""
    from torch._dynamo.utils import counters
    for step in range(3):
        for temperature in (0.5, 1.0):
            frozenlake_rollout(ctx, ctx["compiled"], seeds=(step, step, step + 1, step + 1), temperature=temperature)
    graphs = counters["stats"]["unique_graphs"]
    cpu_inputs = (counters["inductor"]["cudagraph_skips"] if ctx["cuda"]
                  else sum(len(g["cpu_scalars"]) for g in ctx["recording"].graphs))
    return ("graphs, recompiles", graphs <= 3 and cpu_inputs == 0,
            f"{graphs} graphs for 2 functions (at most 3 for one top-p and greedy setting: sample_next once, decode_step "
            f"with a fixed and a symbolic key length), "
            f"{'CUDA graphs skipped' if ctx['cuda'] else 'Python floats as CPU tensor inputs'}: {cpu_inputs}")


def check_sdpa_kernel(ctx):
    """3: which SDPA kernel the sampler's attention runs (its explicit mask rules flash out on CUDA)."""
    device = ctx["device"]
    torch._dynamo.reset()
    with torch.profiler.profile() as prof:
        sampler.generate(ctx["qwen"], ctx["prompts"], 4, sampler=sampler.sampler_settings(device))
    ran = sorted({e.key for e in prof.key_averages()
                  if "attention" in e.key and e.key != "aten::scaled_dot_product_attention"})  # the kernels it chose
    want = "efficient_attention" if ctx["cuda"] else "flash_attention_for_cpu"
    return ("SDPA kernel", any(want in k for k in ran) and not any("math" in k for k in ran),
            f"{', '.join(ran) or 'none'} (want {want}, no math)")


def logits_of_two(ctx):
    """[2, V] the sampler's logits of the bf16 model after the first two prompts."""
    low, device = ctx["low"], ctx["device"]
    ids = torch.tensor(ctx["prompts"][:2], device=device)                                # [2, 100]
    cache = sampler.KVCache(low, 2, ids.shape[1] + 1)
    with torch.no_grad():
        return sampler.forward_cached(low, cache.k, cache.v, cache.lens, ids, torch.full((2,), ids.shape[1], device=device),
                                      ids.shape[1])


def check_fp32_logits(ctx):
    """4: the sampler's logits of a bf16 model are the fp32 product of its hidden state (on CUDA one GEMM with an fp32
    output, a path the CPU has no kernel for; on the CPU the upcast product)."""
    low, seen = ctx["low"], []
    hook = low.model.norm.register_forward_hook(lambda mod, inp, out: seen.append(out))
    logits = logits_of_two(ctx)                                                         # [2, V]
    hook.remove()
    want = seen[-1].float() @ low.lm_head.weight.float().T                             # [2, V]
    err, top = (logits - want).abs().max().item(), want.abs().max().item()
    return ("fp32 logits", logits.dtype == torch.float32 and err <= 1e-3 * max(1.0, top),
            f"{logits.dtype}, max error {err:.2e} against the fp32 product (logits up to {top:.1f})")


def check_sdpa_output_layout(ctx):
    """5: the same logits whatever layout SDPA's output has: the kernel's own (CUDA's efficient and flash kernels
    return a transposed view; the CPU emulates it) against a contiguous copy of it."""
    real, strides, cuda = torch.nn.functional.scaled_dot_product_attention, [], ctx["cuda"]

    def kernel(*a, **k):  # SDPA with CUDA's output layout, recording its strides
        o = real(*a, **k) if cuda else cuda_layout(real(*a, **k))
        strides.append(o.stride())
        return o

    def logits_with(sdpa):  # [2, V] logits_of_two with SDPA replaced by sdpa
        torch.nn.functional.scaled_dot_product_attention = sdpa
        try:
            return logits_of_two(ctx)
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
    as_is, dense = logits_with(kernel), logits_with(lambda *a, **k: real(*a, **k).contiguous())
    return ("SDPA output layout", torch.equal(as_is, dense),
            f"output strides {strides[0]} ({'the kernel' if cuda else 'CUDA emulated'}): logits identical to a contiguous "
            f"output's: {torch.equal(as_is, dense)} (max difference {(as_is - dense).abs().max().item():.2e})")


def check_fake_cuda_trace(ctx):
    """6: the sampler and the update's forward on fake CUDA tensors, every supported layout (fake_cuda_trace)."""
    archs = ("llama", "llama3", "mistral", "qwen2", "qwen3")
    try:
        traced = [fake_cuda_trace(a) for a in archs]
    except Exception as e:  # an AssertionError of efficient_sdpa or fake_cuda_trace, a device or dtype RuntimeError
        return ("fake-CUDA trace", False, f"{type(e).__name__}: {str(e)[:400]}")
    return ("fake-CUDA trace", True, f"{', '.join(archs)}: sampler and update forward in bf16 on fake CUDA tensors, SDPA "
            f"as the efficient kernel (strides {traced[0]['sdpa'][0][0]}): every device, dtype and layout accepted")


def check_noise_bits(ctx):
    """7: the counter-based noise on the device: splitmix64 in int64 (wrapping multiply, masked shifts) gives the bits
    of Python's unbounded ints, eager and compiled (inductor: Triton on CUDA), and the draw of fixed logits is the
    CPU's."""
    device = ctx["device"]
    keys = torch.tensor([0, 1, -1, 2 ** 62 + 12345, -(2 ** 63), 987654321])
    noisy = torch.randn(len(keys), 1000, generator=torch.Generator().manual_seed(0)) * 3          # [6, 1000]
    want, draw = [splitmix64(k) for k in keys.tolist()], sampler.sample_next(noisy, keys, 0.7)[0].tolist()
    ways = dict(eager=(sampler.mix64, sampler.sample_next))
    if ctx["cuda"]:
        ways["inductor"] = (torch.compile(sampler.mix64), torch.compile(sampler.sample_next))
    bad = [w for w, (mix, sample) in ways.items() if mix(keys.to(device)).tolist() != want
           or sample(noisy.to(device), keys.to(device), torch.tensor(0.7, device=device))[0].tolist() != draw]
    return ("noise bits", not bad, f"mix64 and sample_next on {device.type} ({', '.join(ways)}) against the Python "
            f"reference and the CPU's draw: {'identical' if not bad else 'different: ' + ', '.join(bad)}")


def check_host_syncs(ctx):
    """8: host syncs in the decode loop: one read every check_every tokens (stop tokens, rows done), nothing else."""
    per_token = decode_syncs_per_token(ctx["model"], ctx["device"])
    return ("host syncs / token", per_token <= 1 / 8, f"{per_token:.3f} per decode token at check_every 8 (want 1/8; "
            f"{'CUDA sync debug mode' if ctx['cuda'] else 'HostSyncs: the calls that sync on CUDA'})")


def check_train_step(ctx):
    """9: one train.py step (PPO, the random Qwen2.5-0.5B shape on CUDA, the tiny model on the CPU), its peak memory
    against the plan it prints."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile
    out, device = tempfile.mkdtemp(), ctx["device"]
    model_arg = bench.save_qwen25_shape(os.path.join(out, "model"), ctx["layers"]) if ctx["cuda"] else "tiny"
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), "--model", model_arg,
           "--device", device.type, "--env", "sokoban", "--algo", "ppo", "--num-groups", "2", "--group-size", "4",
           "--filter-ratio", "1", "--mini-batch-size", "8", "--micro-batch-size", "2", "--max-new-tokens", "16",
           "--max-turns", "2", "--max-context", "1024", "--val-every", "0", "--collapse-every", "0", "--steps", "1",
           "--out", os.path.join(out, "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    plan = re.search(r"memory plan: ([\d.]+) GB", r.stdout)
    if r.returncode or plan is None:
        return ("train.py step", False, f"exit {r.returncode}: " + (r.stdout[-800:] + r.stderr[-1500:]).replace("\n", " | "))
    m = json.loads(open(os.path.join(out, "run", "metrics.jsonl")).readline())
    peak = m.get("perf/max_memory_allocated_gb")
    return ("train.py step", None if peak is None else peak <= float(plan.group(1)),
            f"one step in {m['timing_s/step']:.1f} s; peak {'n/a on the CPU' if peak is None else f'{peak:.2f} GB'} "
            f"(torch.cuda.max_memory_allocated) against the plan's {plan.group(1)} GB")


def decode_line(ctx, name, batch, context):
    """The decode lines: tokens/s of `batch` rows at `context` tokens against the bandwidth floor of that shape (bench's
    time_decode_floor prints its own line first); on the CPU the tiny model reports, with no floor to hold it to."""
    cuda, bandwidth, floor_fraction = ctx["cuda"], ctx["bandwidth"], ctx["floor_fraction"]
    torch._dynamo.reset()  # the lines before compiled other models and shapes; past its recompile limit dynamo runs eager
    per_step, floor = bench.time_decode_floor(ctx["decoder"], batch, context, 32, ctx["device"], bandwidth)
    return (name, floor / per_step >= floor_fraction if cuda else None,
            f"{batch / per_step:,.0f} tok/s, {floor / per_step:.0%} of the {bandwidth / 1e12:.2f} TB/s floor" +
            (f" (want >= {floor_fraction:.0%}: without CUDA graphs the kernel launches alone take several times the floor)"
             if cuda else " (no floor to hold a CPU to)"))


def check_decode_floor(ctx):
    """10: decode speed against the bandwidth floor at the paper's 128 rollout rows, context 1024 (CPU: 8 rows, 64)."""
    return decode_line(ctx, "decode vs floor", *((128, 1024) if ctx["cuda"] else (8, 64)))


def check_decode_rank_shape(ctx):
    """11: the same at one rank's share of the 8-GPU default (8 groups x 16 = 128 rows over 8 ranks: 16 rows) at a
    3,072-token context (the default --max-context is 3,600): few rows, so the weights are most of the step's read,
    and long K/V rows (CPU: 16 rows at 192, the context cut by 16 as the line above cuts it)."""
    return decode_line(ctx, "decode 16 rows, 3k", *((16, 3072) if ctx["cuda"] else (16, 192)))


def check_torchrun_resume(ctx):
    """12: train.py on torchrun ranks, NCCL on CUDA: torchrun_resume below on min(2, GPUs) ranks. Not run on the CPU,
    where its three launches of 2 gloo ranks take minutes (docs/sampler.md); the suite runs that form
    (test_torchrun_resume_check_on_two_gloo_ranks), and its CPU twins are test_two_ranks_match_one_process (2 gloo
    ranks against 1 process), test_resume_across_world_sizes (a checkpoint of 2 ranks resumed on 1 and back) and
    test_kill_at_random_instants_and_resume_equals_uninterrupted (resumes within one world size)."""
    if not ctx["cuda"]:
        return ("torchrun, resume", None, "not run on the CPU (three torchrun launches, minutes there); the suite runs "
                "it on 2 gloo ranks (test_torchrun_resume_check_on_two_gloo_ranks)")
    import tempfile
    return ("torchrun, resume", *torchrun_resume("cuda", min(2, torch.cuda.device_count()), tempfile.mkdtemp()))


def torchrun_resume(device, ranks, out):
    """train.py (tiny model, PPO) on `ranks` torchrun ranks of `device` (NCCL on CUDA, gloo in fp32 on the CPU), its runs
    under the directory `out`. Run A takes 2 steps with a checkpoint after each; run B takes 1, then resumes (--resume)
    to 2. Returns (ok, detail), ok when B's metrics (timing and perf keys aside) and final actor weights are A's:
    exactly on 1 rank; on 2 within the suite's 2-rank tolerance (test_all.py's assert_same_as_one_process: metrics to
    1e-3 relative, weights to 1e-4)."""
    import json
    import math
    import os
    import subprocess
    import sys
    a, b = os.path.join(out, "a"), os.path.join(out, "b")
    flags = ["--model", "tiny", "--device", device, *(["--dtype", "fp32"] if device == "cpu" else []), "--env", "frozenlake",
             "--algo", "ppo", "--num-groups", "2", "--group-size", "2", "--filter-ratio", "1", "--mini-batch-size", "4",
             "--micro-batch-size", "2", "--max-new-tokens", "12", "--max-turns", "2", "--lr", "1e-3", "--critic-lr", "1e-3",
             "--val-every", "0", "--collapse-every", "0", "--log-trajectories-every", "0", "--save-every", "1"]
    # a launcher's variables would make the ranks join the wrong group; --standalone picks its own free port
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC_")}
    for more in (["--steps", "2", "--out", a], ["--steps", "1", "--out", b], ["--steps", "2", "--resume", b]):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), *flags, *more],
                           capture_output=True, text=True, env=dict(env, PYTHONUNBUFFERED="1"))
        if r.returncode:
            return False, (f"{ranks} ranks, {' '.join(more[:3])}: exit {r.returncode}: " +
                           (r.stdout[-800:] + r.stderr[-1500:]).replace("\n", " | "))
    ma, mb = ([{k: v for k, v in json.loads(l).items() if not k.startswith(("timing_s/", "perf/"))}
               for l in open(os.path.join(d, "metrics.jsonl"))] for d in (a, b))
    import checkpoint
    wa, wb = (checkpoint.read_state(d)["actor"] for d in (a, b))
    moved = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa) if wa.keys() == wb.keys() else math.inf
    same = [m.keys() for m in ma] == [m.keys() for m in mb]
    off = sorted({k for x, y in zip(ma, mb) for k in x if k in y and x[k] != y[k] and not (
        ranks > 1 and isinstance(x[k], (int, float)) and math.isclose(x[k], y[k], rel_tol=1e-3, abs_tol=1e-5))})
    return (same and not off and (moved == 0 if ranks == 1 else moved < 1e-4),
            f"{ranks} {'NCCL' if device == 'cuda' else 'gloo'} rank{'s' if ranks > 1 else ''}, 2 steps against 1 + a resume "
            f"to 2: metrics {'the same' if same and not off else 'different: ' + ', '.join(off[:5] or ['their keys'])}"
            f"{' (within 1e-3)' if ranks > 1 else ''}, actor weights "
            f"{'identical' if moved == 0 else f'apart by {moved:.1e}'}{' (want < 1e-4)' if ranks > 1 else ''}")


def main(device, layers=24, bandwidth=3.35e12, floor_fraction=0.25):
    """Every check in order, one `PASS|FAIL|INFO  name  detail` line each as it finishes; returns the number of FAILs."""
    ctx, fails = context(device, layers, bandwidth, floor_fraction), 0
    for check in (check_compiled_matches_eager, check_graphs_and_recompiles, check_sdpa_kernel, check_fp32_logits,
                  check_sdpa_output_layout, check_fake_cuda_trace, check_noise_bits, check_host_syncs, check_train_step,
                  check_decode_floor, check_decode_rank_shape, check_torchrun_resume):
        name, ok, detail = check(ctx)  # ok None: nothing to check on this device, the line only reports
        fails += ok is False
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {name:24s} {detail}", flush=True)
    return fails


# ------------------------------------------------------------------------------------------------ CUDA-graph emulations
# Two torch.compile backends that give the CPU the two CUDA-graph faults it cannot have (the test suite and the
# checks above run every compiled path of sampler.py under them). Both run each captured graph eagerly.

class GraphReplayBackend:
    """A CUDA-graph replay writes its outputs into the same static buffers every time, and with CUDA graph trees
    starting the next compiled call frees the previous call's outputs (torch _inductor/cudagraph_trees.py,
    dealloc_current_path_weakrefs): a caller that keeps a compiled output, or feeds it into the next compiled
    call, reads garbage. Here every output of compiled call k is overwritten with garbage (NaN; random ints) as
    soon as call k+1 starts, so such a caller samples different tokens on the CPU too. Outputs that are a
    graph's own inputs (mutated in place) are real tensors, not graph memory, and are left alone.
    A graph with a symbolic integer input (dynamo's automatic dynamic, e.g. the decode step's key length) gets one
    CUDA graph recorded per distinct set of its integer inputs (cudagraph_trees.py, cudagraphify's fn_cache keyed by
    the int inputs; Inductor warns past cudagraph_dynamic_shape_warn_limit, 8): recorded[g] holds graph g's sets."""

    def __init__(self):
        self.graphs, self.calls, self.live, self.recorded = 0, 0, [], []
        self.noise = torch.Generator().manual_seed(0)

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        keys = set()  # this graph's integer-input sets: one recording each
        self.recorded.append(keys)

        def run(*args):
            keys.add(tuple(a for a in args if isinstance(a, int)))
            for t in self.live:  # the previous call's outputs: its static buffers are reused now
                if t.is_floating_point():
                    t.fill_(float("nan"))
                else:
                    t.copy_(torch.randint(0, 100, t.shape, generator=self.noise))
            self.calls += 1
            outs = gm.forward(*args)
            mine = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
            self.live = [o for o in outs if torch.is_tensor(o) and o.untyped_storage().data_ptr() not in mine]
            return outs
        return run


class RecordingBackend:
    """Records every graph dynamo hands over (one per compile or recompile) with its example inputs, and flags
    the inputs that inductor would keep on the CPU: a Python float that changed value between calls becomes a
    0-d float64 CPU tensor input (dynamo's automatic dynamic), and inductor skips CUDA graphs for any graph with
    a CPU input, silently, for the rest of the run. `inner` runs the graph (default: eagerly)."""

    def __init__(self, inner=None):
        self.graphs, self.inner = [], inner

    def __call__(self, gm, example_inputs):
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = [n.name for n in nodes]
        scalars = [n.name for n, x in zip(nodes, example_inputs)
                   if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)
                   or (torch.is_tensor(x) and x.dim() == 0 and x.dtype == torch.float64 and x.device.type == "cpu")]
        self.graphs.append(dict(inputs=names, cpu_scalars=scalars))
        return gm.forward if self.inner is None else self.inner(gm, example_inputs)


# ------------------------------------------------------------------------------------------------ CUDA on fake tensors
# The CUDA path's device, dtype and layout rules on a machine without a GPU: under FakeTensorMode, device="cuda"
# tensors hold no data (shape, strides, dtype and device only) and every op runs its meta kernel, which for a
# CUDA-only kernel (the efficient attention) gives CUDA's layout. The suite and check 6 trace the sampler and
# the update's forward this way (fake_cuda_trace).
# Two things cannot run there: a host read of tensor data (.tolist(), .item(), bool(), nonzero: sample_turn's
# checks and everything after them), and backward (the autograd engine asks the accelerator for a CUDA stream,
# which a CPU-only torch has none of, fake or not).

@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which device="cuda" tensors work on a CPU-only torch too. Python indexing (x[i], x[i] = y)
    sets a device guard for its tensor's device, and a CPU-only build has no CUDA guard: for the duration, CUDA's slot
    of c10's guard registry holds the CPU's no-op guard (a CUDA build already has one and is left alone)."""
    import ctypes
    import os
    from torch._subclasses.fake_tensor import FakeTensorMode
    slot = None
    if not torch.backends.cuda.is_built():
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        guards = (ctypes.c_void_p * 2).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")  # [CPU, CUDA]
        if guards[1] is None:
            slot, guards[1] = guards, guards[0]
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        if slot is not None:
            slot[1] = None


def fake_cuda_model(model, dtype):
    """model, in place, with fake CUDA parameters in dtype (tied ones stay tied) and fake CUDA buffers in their own
    dtype (models.cast_parameters' rule: RoPE's inv_freq stays fp32). Call it inside fake_cuda()."""
    made = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="cuda"), p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return model


def cuda_layout(o):
    """o [B, H, L, D], the values the same, stored as CUDA's memory-efficient and flash kernels store their output:
    [B, L, H, D] memory returned as its transposed view (their meta kernels end in res.transpose(1, 2))."""
    return o.transpose(1, 2).contiguous().transpose(1, 2)


def efficient_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA's memory-efficient kernel runs it. Autocast casts the inputs first (SDPA
    is on its lower-precision list); then an AssertionError unless the inputs are ones that kernel takes: one device;
    q, k, v of one dtype; an additive mask in that dtype (the kernel raises "invalid dtype for bias" on any other)
    or a bool one; a head dim that is a multiple of 8 and unit last-dim strides (else SDPA falls back to math). The
    output is the kernel's: on fake tensors its meta kernel's, a transposed view of [B, L, H, D] memory.
    enable_gqa (HF's attention passes it; the sampler folds its query heads instead) repeats K/V first."""
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        attn_mask = attn_mask.to(dtype) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    assert q.device == k.device == v.device and (attn_mask is None or attn_mask.device == q.device), \
        f"SDPA inputs on {q.device}, {k.device}, {v.device}, mask {None if attn_mask is None else attn_mask.device}"
    assert q.dtype == k.dtype == v.dtype, f"SDPA q, k, v in {q.dtype}, {k.dtype}, {v.dtype}"
    assert attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype), f"mask in {attn_mask.dtype}, query in {q.dtype}"
    assert q.shape[-1] % 8 == 0 and k.shape[-1] == q.shape[-1] and v.shape[-1] % 8 == 0, f"head dim {q.shape[-1]}"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "SDPA inputs need a unit last-dim stride"
    if enable_gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA turns a bool mask into an additive one
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # [B, H, L, S]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))  # backward needs the log-sum-exp
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                                  scale=scale)[0]


class AllTrueMasks(TorchDispatchMode):
    """Answers the two host reads of the update's forward for bool masks that are all True (the only masks
    fake_cuda_trace passes): a boolean-mask index selects every position (nonzero of an all-True mask, in row-major
    order) and a bool read on the host (bool(mask.any())) is True. Any other host read still raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            index = []
            for i in args[1]:
                if i is not None and i.dtype == torch.bool:  # every position of i's dims, as long indices
                    grid = torch.meshgrid(*[torch.arange(s, device=i.device) for s in i.shape], indexing="ij")
                    index += [g.reshape(-1) for g in grid]
                else:
                    index.append(i)
            return func(args[0], index)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            return True
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast(dtype=torch.bfloat16):
    """torch.autocast("cuda", dtype), which turns itself off where CUDA is not available; this one does not."""
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


def fake_cuda_trace(arch="llama", T=24):
    """The CUDA path of build_tiny(arch) on fake CUDA tensors, SDPA as CUDA's efficient kernel (efficient_sdpa):
      sampler  the bf16 rollout model: forward_cached (a ragged prefill in row chunks, a decode step), sample_next,
               decode_step (top-p, greedy), prefill_shared, KVCache.select and ensure
      update   the actor's forward as train.py runs it on one process (fp32 weights, bf16 autocast) and under FSDP2
               (bf16 parameters): starpo.token_logprobs with entropy on 3 rows of T tokens, the policy, entropy and
               KL losses, the critic's values and value loss (no backward: see above)
    A device, dtype or layout that CUDA refuses raises. Returns {name: (shape, dtype, device type)} of the results,
    and under "sdpa" the sampler's SDPA calls as (output strides, enable_gqa)."""
    import fsdp
    F, B = torch.nn.functional, 3  # rows (the sampler's: a long prompt, a short one, an idle row)
    real_sdpa, mask_bytes = F.scaled_dot_product_attention, sampler.PREFILL_MASK_BYTES
    calls, seen = [], {}
    put = lambda name, x: seen.__setitem__(name, (tuple(x.shape), x.dtype, x.device.type))

    def sampler_sdpa(*a, **k):  # efficient_sdpa, recording each call's output strides and whether it asked for GQA
        o = efficient_sdpa(*a, **k)
        calls.append((o.stride(), k.get("enable_gqa", False)))
        return o
    rollout_model, actor, fsdp_actor = (models.build_tiny(arch)[0] for _ in range(3))
    critic = fsdp.Critic(actor)
    try:
        with fake_cuda(), torch.no_grad():  # the sampler
            F.scaled_dot_product_attention = sampler_sdpa
            sampler.PREFILL_MASK_BYTES = 1  # one row per prefill chunk
            model = fake_cuda_model(rollout_model, torch.bfloat16)
            cache = sampler.KVCache(model, B, 80)
            ids = torch.zeros(B, 16, dtype=torch.long, device="cuda")                              # [B, 16] right-padded
            n = torch.tensor([13, 5, 0], device="cuda")                                            # [B] the last row idles
            logits = sampler.forward_cached(model, cache.k, cache.v, cache.lens, ids, n, 16)       # [B, V]
            cache.lens += n
            keys, temp, top_p = (torch.arange(B, device="cuda"), torch.tensor(1.0, device="cuda"),
                                 torch.tensor(0.9, device="cuda"))
            tok, lp = sampler.sample_next(logits, keys, temp, top_p)
            fed = torch.ones(B, dtype=torch.long, device="cuda")
            tok, lp, lens = sampler.decode_step(model, cache.k, cache.v, cache.lens, tok, fed, 24, keys, temp, top_p,
                                                False)                                             # [B], [B], [B]
            greedy, _, _ = sampler.decode_step(model, cache.k, cache.v, lens, tok, fed, 24, keys, temp, None, True)  # [B]
            prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 12]]  # shared prefixes [5, 6] and [5, 6, 7, 8]
            fresh = sampler.KVCache(model, B, 40)
            shared = sampler.prefill_shared(model, fresh, prompts, sampler.shared_prefixes(prompts)[0], 6)
            fresh.select([0] * B)
            fresh.ensure(300)
            for name, x in dict(logits=logits, token=tok, logp=lp, greedy=greedy, shared_logits=shared, cache_k=cache.k[0],
                                grown_k=fresh.k[0], lens=fresh.lens).items():
                put(name, x)
        seen["sdpa"] = calls
        with fake_cuda(), AllTrueMasks():  # the update's forward: one process (fp32 + autocast), FSDP2 (bf16 params)
            F.scaled_dot_product_attention = efficient_sdpa
            for name, model, dtype in (("update", actor, torch.float32), ("fsdp_update", fsdp_actor, torch.bfloat16)):
                model = fake_cuda_model(model, dtype).train()
                value_model = fake_cuda_model(critic, dtype).train() if name == "update" else None
                tokens = torch.zeros(B, T, dtype=torch.long, device="cuda")                        # [B, T]
                am, mask = torch.ones(B, T, dtype=torch.bool, device="cuda"), torch.ones(B, T, device="cuda")
                with cuda_autocast():
                    logp, ent = starpo.token_logprobs(model, tokens, am, with_entropy=True, mask=mask)
                    values = value_model(tokens, am) if value_model is not None else None
                logp, ent, adv = logp.float(), ent.float(), torch.zeros(B, T, device="cuda")
                counts = dict(token_count=B * T, seq_count=B)  # Python numbers, as train.update passes them
                pg, _ = starpo.policy_loss(logp, logp.detach(), adv, mask, **counts)
                loss = pg - 0.001 * starpo.aggregate(ent, mask, **counts) + 0.001 * starpo.aggregate(
                    starpo.kl_penalty(logp, logp.detach(), "low_var_kl"), mask, "seq-mean-token-mean", **counts)
                got = {f"{name}_logp": logp, f"{name}_entropy": ent, f"{name}_loss": loss}  # [B, T], [B, T], []
                if values is not None:                                                               # [B, T], []
                    got.update(values=values, value_loss=starpo.value_loss(values.float(), values.detach(), adv, mask,
                                                                           **counts)[0])
                for k, x in got.items():
                    put(k, x)
    finally:
        F.scaled_dot_product_attention, sampler.PREFILL_MASK_BYTES = real_sdpa, mask_bytes
    assert {s[2] for k, s in seen.items() if k != "sdpa"} == {"cuda"}, seen
    assert all(seen[k][1] == torch.float32 for k in seen if k.endswith(("logits", "logp", "entropy", "loss", "values")))
    assert seen["cache_k"][1] == torch.bfloat16 and not any(gqa for _, gqa in seen["sdpa"]), seen
    return seen


# ------------------------------------------------------------------------------------------------ host syncs
class HostSyncs(TorchFunctionMode):
    """Counts (in .count) the torch calls that make the host wait for a CUDA device: reads of tensor data on the host
    (bool(), int(), float(), .item(), .tolist()) and ops whose output size depends on the data (nonzero,
    masked_select, unique, indexing with a bool mask, repeat_interleave by a tensor, and isin where torch's rule makes
    it sort: test elements >= 10 x elements^0.145). Nothing waits on the CPU; on CUDA each is a sync. A compiled
    call counts as one opaque call (run eager code under it)."""
    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist"}
    SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") else ()
        index = index if isinstance(index, tuple) else (index,)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        isin = name == "isin" and all(torch.is_tensor(x) for x in args[:2])
        self.count += (name in self.READS or name in self.SIZED
                       or any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
                       or (name == "repeat_interleave" and torch.is_tensor(repeats) and kwargs.get("output_size") is None)
                       or (isin and args[1].numel() >= 10 * args[0].numel() ** 0.145))
        return func(*args, **kwargs)


def decode_syncs_per_token(model, device, every=8, budgets=(16, 48)):
    """Host syncs per decode token of sampler.generate on 4 rows with no stop token (every row runs to its budget):
    the difference between two budgets over their difference, so the prefill's and the turn end's syncs cancel.
    CUDA: the sampler sampler_settings picks (static, compiled), warmed up first, counted by CUDA's sync debug mode;
    the CPU: the eager sampler, counted by HostSyncs. The decode loop's contract is 1 / every."""
    import warnings
    cuda = torch.device(device).type == "cuda"
    how = sampler.sampler_settings(device)._replace(check_every=every) if cuda else sampler.Sampler(check_every=every)
    run = lambda n: sampler.generate(model, [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]], n, sampler=how)
    counts = []
    for n in budgets:
        if cuda:
            run(n)  # compiles and captures first
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run(n)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        else:
            with HostSyncs() as syncs:
                run(n)
            counts.append(syncs.count)
    return (counts[1] - counts[0]) / (budgets[1] - budgets[0])


def splitmix64(k):
    """splitmix64's finaliser of k in Python's unbounded ints, as the signed int64 sampler.mix64 stores."""
    z = k % 2 ** 64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2 ** 64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2 ** 64
    z ^= z >> 31
    return z - 2 ** 64 if z >= 2 ** 63 else z


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="CUDA: layers of the Qwen2.5-0.5B shape in the train.py and "
                        "decode lines (24 = the real depth)")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="memory bandwidth of the decode floor, bytes/s")
    args = parser.parse_args()
    if args.layers < 1:
        raise SystemExit("gpu_check.py: --layers must be >= 1")
    raise SystemExit(1 if main("cuda" if torch.cuda.is_available() else "cpu", args.layers, args.bandwidth) else 0)
