"""The GPU check of the static-shape torch backend: exactness and speed, side by side in one run on the device.

    python scripts/gpu_check.py --prompts prompts.jsonl --out DIR [--device cuda] [--small] [--max-new-tokens 64]

1. Shapes. Random-weight models with the configs of smollm2-135m, qwen2.5-coder-1.5b and -0.5b (batch invariance
   and speed do not depend on trained weights), in bfloat16: eager torch (transformers' forward, dynamic cache)
   against the static-shape backend (CUDA graphs on a GPU): the invariance check (max |diff| over passes of
   1..17 positions), a decode step, and verify passes of K+1 positions in decode steps.
2. smollm2-135m, real weights (the catalog's GGUF, converted), on the static backend as `Engine.load` gives it:
   target only, n-gram, the chain and a self draft on the same device in every pipeline mode, per prompt
   category, each row's greedy tokens compared with target only's; a seeded sampled run in every mode. Peers on
   the same device: transformers `generate`, prompt lookup, and assisted generation with the model drafting for
   itself (as our self-draft row).
3. The real qwen2.5-coder 1.5b/0.5b pair, modelled: its acceptance (--alpha, measured on the CPU: exact
   verification makes acceptance device-independent) with part 1's costs of the two shapes.
4. llama.cpp, the build llama-cpp-python loads (on the device: LLAMA_CPP_LIB_PATH naming the folder
   `scripts/build_llama_variant.sh cuda` built, the CUDA 13 runtime and cuBLAS of torch's install on
   LD_LIBRARY_PATH), its stock kernels with flash attention: passes of any shape against fixed passes of 16 rows
   (the invariance check, a decode step, verify passes in decode steps) on smollm2's GGUF and on random-weight
   Q4_K_M files of the 1.5b and 0.5b shapes; then smollm2 as `Engine.load` gives it there (fixed-shape passes
   where the check finds them exact), every drafter x mode as in part 2.
report.md and report.json are rewritten after every part, so a run cut short keeps what it measured.
--prompts: a JSONL workload (`mirrorsd bench --workload` format; `--write-prompts FILE` writes the bench's bundled
suite there, on a machine that reaches the package registry); --small: tiny shapes, for a dry run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

SHAPES = {  # the catalog models' configs (config.json of each converted GGUF)
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                               max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}
SMALL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
VERIFY_SIZES = tuple(range(2, 18))  # K+1 for K = 1..16
SHOWN_SIZES = (2, 4, 8, 9, 16, 17)
MODES = ("off", "overlap", "branches")
PARTS = ("shapes", "smollm2", "pair", "llamacpp")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pass_seconds(lm, ids: list[int], n: int, device: str, base: int = 64, repeats: int = 10) -> float:
    """Median time of a pass over n positions after `base` cached ones."""
    times = []
    for _ in range(repeats):
        lm.truncate(base)
        lm.score(ids[:base])
        sync(device)
        t = time.perf_counter()
        lm.score(ids[:base], ids[base:base + n - 1])
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def measure(what: str, lm, offsets: tuple[int, ...], device: str) -> dict:
    """The invariance check at `offsets` (passes of 1..17 positions), a decode step, and verify passes of K+1
    positions in decode steps."""
    from mirrorsd.runtime.backends.invariance import check_batch_invariance, probe_tokens

    ids = probe_tokens(lm.vocab_size, 200)
    report = check_batch_invariance(lm, ids[:8], offsets=offsets, sizes=tuple(range(1, 18)))
    decode = pass_seconds(lm, ids, 1, device)
    row = {"backend": lm.backend, "max_abs_diff": report.max_abs_diff, "decode_ms": round(decode * 1e3, 3),
           "verify_steps": {n: round(pass_seconds(lm, ids, n, device) / decode, 3) for n in VERIFY_SIZES}}
    print(what, row, flush=True)
    return row


def with_speedup(rows: dict, base: str) -> dict:
    """Each row's decode speed against row `base`'s."""
    for r in rows.values():
        r["speedup"] = round(rows[base]["decode_ms"] / r["decode_ms"], 2)
    return rows


def random_model(shape: dict, device: str):
    import transformers

    shape = dict(shape)
    family = shape.pop("model_type")
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    cfg = getattr(transformers, cls[0])(bos_token_id=None, eos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, cls[1])(cfg).to(torch.bfloat16).eval()


def part_shapes(args) -> dict:
    """Part 1: per shape, eager against static: exactness, decode ms, verify cost in decode steps."""
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
    from mirrorsd.runtime.backends.torch_static import StaticTorchLM

    out = {}
    for name, shape in SHAPES.items():
        model = random_model({**shape, **SMALL} if args.small else shape, args.device)
        configs = {"eager torch": TorchCausalLM(model, args.device),
                   "static, graphed" if args.device.startswith("cuda") else "static":
                       StaticTorchLM(model, args.device, exact_batches=False),
                   "draft (1 row)": StaticTorchLM(model, args.device, rows=1, prefill_rows=16, exact_batches=False)}
        rows = {}
        for label, lm in configs.items():
            rows[label] = measure(f"{name}, {label}", lm, (1, 40), args.device)
            lm.reset()
        out[name] = with_speedup(rows, "eager torch")
        del configs, model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def timed_generate(engine, prompt, cfg, device: str):
    sync(device)
    t = time.perf_counter()
    result = engine.generate(prompt.request, cfg)
    sync(device)
    return result, time.perf_counter() - t


def run_row(engine, prompts, cfg_for, device: str, reference: dict | None) -> dict:
    """One configuration over the prompts, by category: tok/s, tokens per step, greedy equality."""
    from collections import defaultdict

    by_cat: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "steps": 0, "equal": 0, "n": 0})
    tokens = {}
    for i, prompt in enumerate(prompts):
        engine.reset()  # a cold cache for every request
        result, seconds = timed_generate(engine, prompt, cfg_for(prompt), device)
        c = by_cat[prompt.category]
        c["tokens"] += result.stats.generated_tokens
        c["seconds"] += seconds
        c["steps"] += result.stats.verify_steps
        c["n"] += 1
        c["equal"] += reference is None or list(result.token_ids) == reference[i]
        tokens[i] = list(result.token_ids)
    cats = {k: {"tok_s": round(v["tokens"] / v["seconds"], 2), "tokens_per_step": round(v["tokens"] / v["steps"], 2),
                "greedy_equal": f"{v['equal']}/{v['n']}"} for k, v in by_cat.items()}
    total_t = sum(v["tokens"] for v in by_cat.values())
    total_s = sum(v["seconds"] for v in by_cat.values())
    return {"categories": cats, "tok_s": round(total_t / total_s, 2), "token_ids": tokens,
            "greedy_equal": f"{sum(v['equal'] for v in by_cat.values())}/{len(prompts)}"}


def part_smollm2(args, prompts, backend: str = "torch-static") -> dict:
    """Part 2: the real smollm2-135m on the static backend; every drafter x mode; peers (transformers, for torch)."""
    from mirrorsd import Engine, GenerationConfig

    def greedy(_prompt, mode="off"):
        return GenerationConfig(max_new_tokens=args.max_new_tokens, pipeline=mode)

    target = Engine.load("smollm2-135m", draft="none", backend=backend, device=args.device)
    lm = target.target
    info = {"backend": lm.backend, "dtype": str(getattr(lm, "dtype", "")), "exact_batches": lm.exact_batches,
            "graphed": getattr(lm, "graphed", False)}
    target.generate(prompts[0].request, greedy(None))  # warm-up
    rows = {"target only": run_row(target, prompts, greedy, args.device, None)}
    reference = rows["target only"]["token_ids"]
    print("target only", rows["target only"]["tok_s"], info, flush=True)
    drafts = {"n-gram": dict(draft="ngram"), "chain": dict(draft="chain"),
              "self draft on the device": dict(draft="smollm2-135m", draft_device=args.device)}
    sampled = {}
    for label, kw in drafts.items():
        engine = Engine.load("smollm2-135m", backend=backend, device=args.device, **kw)
        for mode in MODES if kw["draft"] not in ("ngram", "chain") else ("off",):
            rows[f"{label}, {mode}"] = run_row(engine, prompts, lambda p, m=mode: greedy(p, m), args.device, reference)
            print(label, mode, rows[f"{label}, {mode}"]["tok_s"], rows[f"{label}, {mode}"]["greedy_equal"], flush=True)
        seeded = {mode: engine.generate(prompts[0].request, GenerationConfig(
            max_new_tokens=args.max_new_tokens, temperature=0.8, seed=1, pipeline=mode)).token_ids for mode in MODES}
        sampled[label] = len({tuple(t) for t in seeded.values()}) == 1
        engine.close()
    if backend.startswith("torch"):
        rows.update(hf_peers(args, prompts, target))
    for r in rows.values():
        r.pop("token_ids", None)
    return {"target": info, "rows": rows, "seeded_sampled_same_in_every_mode": sampled}


def hf_peers(args, prompts, engine) -> dict:
    """transformers on the same device and dtype: generate, prompt lookup, assisted generation (self)."""
    from transformers import AutoModelForCausalLM

    from mirrorsd.models import resolve_model_path

    dtype = getattr(engine.target, "dtype", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m"), dtype=dtype).to(args.device)
    peers = {"transformers generate": {}, "transformers prompt lookup": dict(prompt_lookup_num_tokens=10),
             "transformers assisted (self)": dict(assistant_model=model)}
    out = {}
    for label, kw in peers.items():
        tokens = seconds = 0.0
        for prompt in prompts:
            ids = torch.tensor([engine.encode(prompt.request)], device=args.device)
            sync(args.device)
            t = time.perf_counter()
            gen = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kw)
            sync(args.device)
            seconds += time.perf_counter() - t
            tokens += gen.shape[1] - ids.shape[1]
        out[label] = {"tok_s": round(tokens / seconds, 2)}
        print(label, out[label], flush=True)
    return out


def part_pair(shapes: dict, alpha: float) -> dict:
    """Part 3: speedup of the 1.5b/0.5b pair modelled from acceptance alpha and the measured graphed costs:
    E[tokens per step] = (1 - alpha^(K+1)) / (1 - alpha); step time = K draft steps + a verify pass of K+1."""
    t15, t05 = shapes["qwen2.5-coder-1.5b"], shapes["qwen2.5-coder-0.5b"]
    static = next(k for k in t15 if k.startswith("static"))
    target_ms, draft_ms = t15[static]["decode_ms"], t05["draft (1 row)"]["decode_ms"]
    best = None
    for k in range(1, 17):
        verify = t15[static]["verify_steps"][k + 1]
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        speedup = tokens / (k * draft_ms / target_ms + verify)
        if best is None or speedup > best["speedup"]:
            best = {"K": k, "speedup": round(speedup, 2), "tokens_per_step": round(tokens, 2),
                    "verify_steps": verify}
    return {"alpha": alpha, "target_decode_ms": target_ms, "draft_decode_ms": draft_ms, "best": best,
            "model": "tokens per step (1 - a^(K+1)) / (1 - a) over (K draft steps + one verify pass of K+1), "
                     "in target decode steps; draft and verify one after the other (no overlap)"}


def shape_gguf(name: str, folder: Path, small: bool) -> Path:
    """A Q4_K_M GGUF with random weights and the shape of `name` (llama.cpp's own quantizer picks each tensor's
    type, Q6_K where a Q4_K_M file has it); the Llama layout, as verify costs depend on the shapes only."""
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_files import quantize_gguf, write_llama_gguf

    shape = {**SHAPES[name], **(SMALL if small else {})}
    shape.pop("model_type")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(bos_token_id=None, eos_token_id=None, **shape))
    f32 = write_llama_gguf(model.eval(), folder / f"{name}-f32.gguf")
    del model
    out = quantize_gguf(f32, folder / f"{name}-Q4_K_M.gguf")
    f32.unlink()
    return out


def part_llamacpp(args, prompts) -> dict:
    """Part 4: llama.cpp's stock kernels with flash attention, passes of any shape against fixed 16-row passes;
    then smollm2 on the llama.cpp backend as Engine.load gives it on this device."""
    import tempfile

    import llama_cpp

    from mirrorsd.models import resolve_gguf
    from mirrorsd.runtime.backends.invariance import FIXED_ROWS
    from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM

    gpu = args.device != "cpu" and bool(llama_cpp.llama_supports_gpu_offload())
    out = {"gpu_offload": gpu, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # --small (a dry run on a CPU): the tiny files only; smollm2's check is the engine load's below
        files = {} if args.small else {"smollm2-135m (its GGUF)": resolve_gguf("smollm2-135m", False)[0]}
        for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
            files[f"{name} shape (random Q4_K_M)"] = shape_gguf(name, Path(tmp), args.small)
        for name, path in files.items():
            rows = {}
            for label, kw in {"stock, any shape": {}, f"fixed {FIXED_ROWS} rows": dict(fixed_rows=FIXED_ROWS)}.items():
                lm = LlamaCppLM(path, exact=False, flash_attn=True, gpu_layers=None if gpu else 0, **kw)
                # 241 and 300 too: kernels choose by the cells a pass reads (llama.cpp pads them to 256); at 241 a
                # pass reads 256 and its rows' one-token references more. "cpu": llama.cpp's passes return when done
                rows[label] = measure(f"{name}, {label}", lm, (1, 40, 241, 300), "cpu")
                lm.close()
            out["shapes"][name] = with_speedup(rows, "stock, any shape")
    # the backend a user gets: fixed shapes on a GPU build (exact where the check says so); the same path on a CPU
    out["smollm2"] = part_smollm2(args, prompts, backend="llamacpp" if gpu else "llamacpp-static")
    return out


def shape_table(title: str, shapes: dict, versus: str) -> list[str]:
    lines = [title, "", f"| model shape | configuration | max \\|diff\\| n=1..17 | decode ms | vs {versus} | "
             + " | ".join(f"K+1={n}" for n in SHOWN_SIZES) + " |",
             "|---|---|---|---|---|" + "---|" * len(SHOWN_SIZES)]
    for name, rows in shapes.items():
        for label, r in rows.items():
            diff = "**0 (exact)**" if r["max_abs_diff"] == 0 else f"{r['max_abs_diff']:.3g}"
            lines.append(f"| {name} | {label} | {diff} | {r['decode_ms']} | {r['speedup']}x | "
                         + " | ".join(str(r["verify_steps"][n]) for n in SHOWN_SIZES) + " |")
    return lines + [""]


def engine_table(title: str, s: dict) -> list[str]:
    rows = s["rows"]
    cats = sorted({c for r in rows.values() for c in r.get("categories", {})})
    base = rows["target only"]["tok_s"]
    t = s["target"]
    lines = [f"{title} on {t['backend']} ({t['dtype'] + ', ' if t['dtype'] else ''}exact_batches "
             f"{t['exact_batches']}, graphed {t['graphed']})", "",
             "| configuration | tok/s | vs target only | " + " | ".join(cats) + " | greedy equal |",
             "|---|---|---|" + "---|" * len(cats) + "---|"]
    for label, r in rows.items():
        per = " | ".join(f"{r['categories'][c]['tok_s'] / rows['target only']['categories'][c]['tok_s']:.2f}x"
                         if c in r.get("categories", {}) else "-" for c in cats)
        lines.append(f"| {label} | {r['tok_s']} | {r['tok_s'] / base:.2f}x | {per} | {r.get('greedy_equal', '-')} |")
    return lines + ["", f"Seeded sampled run the same in every mode: {s['seeded_sampled_same_in_every_mode']}", ""]


def write_report(out: Path, args, result: dict) -> None:
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    m = result["machine"]
    lines = [f"# The static-shape torch backend on {m['device_name']}", "",
             f"torch {m['torch']}, {m['platform']}. Command: `{m['command']}`", ""]
    if "shapes" in result:
        lines += shape_table("## Shapes (random weights, bfloat16)", result["shapes"], "eager")
    if "smollm2" in result:
        lines += engine_table("## smollm2-135m", result["smollm2"])
    if "pair" in result:
        p = result["pair"]
        lines += ["## qwen2.5-coder 1.5b / 0.5b, modelled", "",
                  f"alpha {p['alpha']}, target step {p['target_decode_ms']} ms, draft step {p['draft_decode_ms']} ms: "
                  f"best K {p['best']['K']}, **{p['best']['speedup']}x** target only ({p['model']}).", ""]
    if "llamacpp" in result:
        r = result["llamacpp"]
        lines += shape_table(f"## llama.cpp, stock kernels, flash attention (GPU offload: {r['gpu_offload']})",
                             r["shapes"], "stock decode")
        lines += engine_table("## smollm2-135m, llama.cpp", r["smollm2"])
    for part, error in result.get("errors", {}).items():
        lines += [f"Part {part} failed: `{error}`", ""]
    (out / "report.md").write_text("\n".join(lines))


def main() -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", help="JSONL workload (mirrorsd bench --workload format)")
    ap.add_argument("--write-prompts", type=Path, help="write the bundled suite (2 per category) here, and exit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes in part 1 (a dry run on a CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.917, help="the 1.5b/0.5b pair's acceptance (docs/pipeline.md)")
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    from mirrorsd.apps.bench.prompt_suite import bundled_suite, load_workload

    if args.write_prompts:
        args.write_prompts.write_text("".join(json.dumps({"category": p.category, "messages": p.messages,
                                                          "temperature": p.temperature, "top_p": p.top_p}) + "\n"
                                              for p in bundled_suite(2) if p.json_schema is None))
        return
    if not (args.prompts and args.out):
        ap.error("--prompts and --out are required")
    if unknown := set(args.parts.split(",")) - set(PARTS):
        ap.error(f"--parts: no part {', '.join(sorted(unknown))} (the parts: {', '.join(PARTS)})")

    prompts = [p for p in load_workload(args.prompts) if p.greedy and p.json_schema is None]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else
                          platform.processor() or "cpu", "torch": torch.__version__, "platform": platform.platform(),
                          "command": "python " + " ".join(sys.argv)}, "errors": {}}
    parts = args.parts.split(",")
    for part, run in (("shapes", lambda: part_shapes(args)), ("smollm2", lambda: part_smollm2(args, prompts)),
                      ("pair", lambda: part_pair(result["shapes"], args.alpha)),
                      ("llamacpp", lambda: part_llamacpp(args, prompts))):
        if part not in parts:
            continue
        try:
            result[part] = run()
        except Exception as exc:  # a part that fails is reported; the others still run
            traceback.print_exc()
            result["errors"][part] = f"{type(exc).__name__}: {exc}"
        write_report(args.out, args, result)
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
