"""The `mirrorsd` command line."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from mirrorsd.config import GenerationConfig
from mirrorsd.errors import MirrorsdError

DEFAULTS = GenerationConfig()  # the CLI's defaults are the SDK's

app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Lossless speculative decoding on one machine's chips.")


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        print(f"mirrorsd {metadata.version('mirrorsd')}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Lossless speculative decoding on one machine's chips."""

BACKEND_HELP = ("Model backend: auto (onnx for an export folder; llama.cpp for a GGUF model, i.e. catalog models "
                "and .gguf files, where llama-cpp-python is installed; else torch) | llamacpp (on a GPU: "
                "fixed-shape passes) | llamacpp-static (fixed-shape passes on llama.cpp's stock kernels on any "
                "device) | onnx (a "
                "`mirrorsd export --role target` folder) | torch (float32 on the CPU; on a CUDA GPU the static-shape path, "
                "bfloat16, CUDA graphs) | torch-static (the static-shape path on any device).")
Backend = Annotated[str, typer.Option(help=BACKEND_HELP)]
DraftBackend = Annotated[Optional[str], typer.Option(help="Backend of a draft model (default: --backend).")]


def _read_file(path: str, what: str) -> str:
    from mirrorsd.errors import ConfigError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc}", "check the path") from exc


def _read_prompt(prompt: str | None, file: str | None) -> str:
    """The prompt from the argument, stdin ('-') or --file (exactly one of them); never empty."""
    from mirrorsd.errors import ConfigError

    text = _prompt_text(prompt, file)
    if not text.strip():
        where = f"--file {file}" if file is not None else "standard input" if prompt == "-" else "the argument"
        raise ConfigError(f"the prompt from {where} is empty", "give some text for the model to answer")
    return text


def _prompt_text(prompt: str | None, file: str | None) -> str:
    from mirrorsd.errors import ConfigError

    if (prompt is None) == (file is None):
        raise ConfigError("give the prompt as an argument, '-' for stdin, or --file F (one of them)",
                          'e.g. mirrorsd generate "Write a quicksort." or echo hi | mirrorsd generate -')
    if file is not None:
        return _read_file(file, "prompt")
    if prompt != "-":
        return prompt
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"standard input is not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "send the prompt as UTF-8") from None
    except (OSError, ValueError, AttributeError) as exc:  # stdin closed (<&-): sys.stdin is None or unusable
        raise ConfigError(f"cannot read the prompt from standard input: {exc}",
                          "pipe the prompt in, e.g. echo hi | mirrorsd generate -") from None


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text (sent through the chat template unless "
                                                         "--raw); '-' reads it from stdin.")] = None,
    file: Annotated[Optional[str], typer.Option("--file", help="Read the prompt from this file.")] = None,
    system: Annotated[Optional[str], typer.Option(help="A system message before the prompt (chat template).")] = None,
    target: Annotated[str, typer.Option(help="Target model: catalog name, folder, .gguf or hub id.")] = "smollm2-135m",
    draft: Annotated[str, typer.Option(help="auto | ngram | retrieval[:DIR] | chain[:DIR] | none | a draft model "
                                            "(catalog name, folder, .gguf) | an export folder "
                                            "(mirrorsd export).")] = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = DEFAULTS.max_new_tokens,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = DEFAULTS.temperature,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1.0 = off).")] = DEFAULTS.top_p,
    top_k: Annotated[int, typer.Option(help="Keep the k likeliest tokens (0 = off).")] = DEFAULTS.top_k,
    repetition_penalty: Annotated[float, typer.Option(help="> 1 discourages repeats.")] = DEFAULTS.repetition_penalty,
    presence_penalty: Annotated[float, typer.Option(help="OpenAI's presence penalty, -2..2.")] = DEFAULTS.presence_penalty,
    frequency_penalty: Annotated[float, typer.Option(help="OpenAI's frequency penalty, -2..2.")] = DEFAULTS.frequency_penalty,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    num_draft_tokens: Annotated[int, typer.Option("--k", help="Draft tokens per step (start value if adaptive).")] = DEFAULTS.num_draft_tokens,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    device: Annotated[str, typer.Option(help="Target device: auto | cpu | cuda[:N] | mps | xpu.")] = "auto",
    draft_device: Annotated[Optional[str], typer.Option(
        help="Draft device: a torch device for a draft model (default: the target's), or a backend for an "
             "export: cpu | coreml | qnn | openvino | dml | vitisai | cuda (default: the placement policy).")] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16 (torch backend).")] = "auto",
    backend: Backend = "auto",
    draft_backend: DraftBackend = None,
    raw: Annotated[bool, typer.Option("--raw", help="Use the prompt as raw text, no chat template.")] = False,
    pipeline: Annotated[str, typer.Option(help="auto | off | overlap | branches (how drafting and "
                                               "verification are scheduled; output is the same).")] = DEFAULTS.pipeline,
    early_exit_layer: Annotated[Optional[int], typer.Option(help="l_e for branch hints (default: 4/5 of the depth).")] = None,
    branch_width: Annotated[int, typer.Option(help="kappa: branch candidates per draft position.")] = DEFAULTS.branch_width,
    branch_source: Annotated[str, typer.Option(help="auto | early_exit | draft: where branches take their "
                                                    "candidates (the target's early exit or the draft's own top-k).")
                             ] = DEFAULTS.branch_source,
    trace: Annotated[Optional[str], typer.Option(help="Write the request's draft/verify timeline to this "
                                                      "file (Chrome trace JSON: open in Perfetto or chrome://tracing).")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="Structured output: the reply is JSON valid against the "
                                                            "JSON schema in this file.")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Structured output: the reply matches this regex.")] = None,
    grammar: Annotated[Optional[str], typer.Option(help="Structured output: the reply follows the Lark grammar in "
                                                        "this file (llguidance's dialect).")] = None,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: the target's log-probability of each token "
                                                         "and of N alternatives.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
    allow_inexact: Annotated[bool, typer.Option("--allow-inexact", help="Let --draft auto speculate on a backend whose verify passes "
                                                "are not batch-invariant (torch on a GPU or in bfloat16, int8 / fp16 "
                                                "ONNX exports): "
                                                "greedy output may then part from target-only decoding.")] = False,
) -> None:
    """Generate text. Output is exactly what the target alone would produce (under --json-schema / --regex /
    --grammar: exactly what the target alone produces under that constraint)."""
    _check_flags(num_draft_tokens, max_new_tokens, device, dtype)  # before the heavy imports: a typo costs no load
    from mirrorsd import Engine, GenerationConfig
    from mirrorsd.results import FinishEvent

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty, seed=seed, num_draft_tokens=num_draft_tokens,
                           stop=tuple(stop or ()), pipeline=pipeline, early_exit_layer=early_exit_layer,
                           branch_width=branch_width, branch_source=branch_source, regex=regex, logprobs=logprobs,
                           json_schema=_read_file(json_schema, "JSON schema") if json_schema else None,
                           grammar=_read_file(grammar, "grammar") if grammar else None)
    if trace:
        from mirrorsd.engine import check_writable

        check_writable(trace)  # before loading: a bad path should not cost a model load
    prompt = _read_prompt(prompt, file)
    print(f"mirrorsd: loading {target} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    engine = Engine.load(target=target, draft=draft, device=device, dtype=dtype, draft_device=draft_device,
                         progress=True, backend=backend, draft_backend=draft_backend, allow_inexact=allow_inexact)
    load_s = time.perf_counter() - started
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    request = prompt if raw else messages
    if not raw and getattr(engine.tokenizer, "chat_template", None) is None:
        request = prompt if not system else f"{system}\n\n{prompt}"
    result = None
    for event in engine.stream(request, cfg, trace=trace):
        if isinstance(event, FinishEvent):
            result = event.result
        if not as_json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    s = result.stats
    if as_json:
        print(json.dumps({"model": target, **result.to_dict()}))
    else:
        from mirrorsd.apps.chat.session import stats_line

        print(f"\n\n[{target} on {s.backend} · {stats_line(s.to_dict(), load_s)} · finish: {result.finish_reason}]",
              file=sys.stderr)
        if trace:
            print(f"[trace written to {trace}]", file=sys.stderr)


@app.command()
def models() -> None:
    """List the offline catalog and what is already cached, and the GGUF models of ollama, LM Studio and the
    Hugging Face cache found on this machine (usable by name, read in place)."""
    from rich.console import Console
    from rich.table import Table

    from mirrorsd import catalog

    table = Table(title=f"catalog (cache: {catalog.cache_dir()})")
    for col in ("name", "download", "GGUF (llama.cpp)", "torch conversion", "description"):
        table.add_column(col)
    for entry in catalog.CATALOG.values():
        state = catalog.cache_state(entry.name)
        table.add_row(entry.name, f"~{entry.approx_download_mb} MB",
                      f"ready, {state.gguf_bytes / 1e6:.0f} MB" if state.gguf == "ready" else state.gguf,
                      f"ready, {state.torch_bytes / 1e6:.0f} MB" if state.torch == "ready" else
                      "not made (--backend torch makes it)" if state.torch == "missing" else state.torch,
                      entry.description)
    Console().print(table)
    from mirrorsd.local_models import discover

    found = discover()
    if found:  # other tools' models, read in place under these names
        local = Table(title="on this machine (ollama, LM Studio, Hugging Face cache): --target NAME")
        for col in ("name", "size", "file"):
            local.add_column(col)
        for m in found:
            local.add_row(m.name, f"{m.size / 1e6:.0f} MB", str(m.path))
        Console().print(local)


@app.command()
def pull(name: Annotated[str, typer.Argument(help="A catalog model (see `mirrorsd models`).")],
         torch: Annotated[bool, typer.Option("--torch", help="Also convert it for the torch backend (float "
                                                             "safetensors: several times the GGUF's size).")] = False,
         ) -> None:
    """Fetch a catalog model's GGUF into the cache now (what llama.cpp, the default backend, runs), with
    progress; later commands then start at once. --torch also makes the torch backend's conversion."""
    from mirrorsd import catalog

    catalog.lookup(name)  # an unknown name fails before anything is fetched
    gguf = catalog.ensure_gguf(name, progress=True)
    print(f"{name}: GGUF ready ({gguf.stat().st_size / 1e6:.0f} MB): {gguf}")
    if torch:
        folder = catalog.ensure(name, progress=True)
        print(f"{name}: torch conversion ready ({_size(folder)}): {folder}")


@app.command()
def rm(name: Annotated[str, typer.Argument(help="A catalog model (see `mirrorsd models`).")]) -> None:
    """Remove a catalog model from the cache (it is fetched again when next used)."""
    import shutil

    from mirrorsd import catalog
    from mirrorsd.errors import CatalogError

    catalog.lookup(name)
    root = catalog.entry_dir(name)
    if not root.exists():
        raise CatalogError(f"{name} is not in the cache ({root})", "`mirrorsd models` lists what is cached")
    size = _size(root)
    shutil.rmtree(root)
    print(f"removed {name} ({size} freed)")


def _size(folder) -> str:
    from mirrorsd.catalog import folder_bytes

    return f"{folder_bytes(folder) / 1e6:.0f} MB"


@app.command()
def bench(
    ctx: typer.Context,
    target: Annotated[str, typer.Option(help="Target model.")] = "qwen2.5-coder-1.5b",
    draft_model: Annotated[str, typer.Option(help="Draft model for the draft-model rows ('' to skip).")] = "qwen2.5-coder-0.5b",
    per_category: Annotated[int, typer.Option(help="Prompts per category of the bundled suite.")] = 2,
    prompts: Annotated[Optional[str], typer.Option(help="Your own prompts instead: a JSONL file "
                                                        "({'prompt'|'messages'|'text', 'category', 'temperature'}).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per generation.")] = 64,
    repeats: Annotated[int, typer.Option(help="Runs per configuration and prompt, interleaved (median taken).")] = 2,
    k: Annotated[int, typer.Option("--k", help="Draft tokens per step for our drafters (the start value "
                                                                  "where K adapts).")] = DEFAULTS.num_draft_tokens,
    dtype: Annotated[str, typer.Option(help="Model dtype for every configuration: float32 | bfloat16 | float16.")] = "float32",
    draft_export: Annotated[Optional[str], typer.Option(help="An export folder (`mirrorsd export`) for the "
                                                             "exported-draft rows, on the backend placement picks.")] = None,
    target_export: Annotated[Optional[str], typer.Option(help="The target's `mirrorsd export --role target` "
                                                                "folder, for the ONNX Runtime rows.")] = None,
    datastore: Annotated[str, typer.Option(help="Datastore for the retrieval rows: 'default' (this Python's stdlib), "
                                                "a datastore folder, or 'none' to skip them.")] = "default",
    only: Annotated[Optional[list[str]], typer.Option(help="Run only this configuration (repeatable; its "
                                                           "target-only reference row runs too).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Under five minutes: smollm2-135m on llama.cpp (the default "
                                             "backend) with our n-gram and chain rows and llama-cpp-python's, no "
                                             "draft model, 1 prompt per category, 48 tokens, 2 repeats (explicit "
                                             "options still apply; without --quick: every row).")] = False,
    pin_devices: Annotated[bool, typer.Option("--pin-devices", help="Separate compute, simulated (Linux): the target on one core and "
                                                   "the draft on another, one thread each, in every mode; runs "
                                                   "target-only and each draft with the pipeline off / overlap / branches.")] = False,
    peers: Annotated[Optional[list[str]], typer.Option(help="Peers served from a process of their own, run "
                                                           "when asked for (repeatable): vllm (vLLM-CPU target-only, "
                                                           "n-gram and draft model; its environment: "
                                                           "scripts/setup_vllm.sh), llama-server (llama.cpp's server, "
                                                           "stock kernels, target-only and its n-gram kinds; "
                                                           "scripts/build_llama_variant.sh server).")] = None,
    out: Annotated[str, typer.Option(help="Folder for report.json, report.md and the PNG plots.")] = "bench-out",
) -> None:
    """Every drafter, our runtime and transformers side by side on a prompt suite; report + plots."""
    from mirrorsd.apps.bench.runner import QUICK, QUICK_ONLY, BenchOptions, command_line, run_bench

    given = {name for name in ("target", "draft_model", "per_category", "max_new_tokens", "repeats")
             if ctx.get_parameter_source(name).name == "COMMANDLINE"}
    values = dict(target=target, draft_model=draft_model or None, per_category=per_category,
                  max_new_tokens=max_new_tokens, repeats=repeats)
    if quick:
        values.update({key: val for key, val in QUICK.items() if key not in given})
        only = only or list(QUICK_ONLY)
    run_bench(BenchOptions(prompts_file=prompts, k=k, dtype=dtype, only=tuple(only or ()), out=out, pin_devices=pin_devices,
                           peers=tuple(peers or ()),
                           draft_export=draft_export, target_export=target_export, **values),
              datastore=None if datastore == "none" else datastore, command=command_line())


@app.command("eval-drafts")
def eval_drafts(
    workload: Annotated[str, typer.Argument(help="Your workload: a JSONL file, one prompt per line "
                                                 "({'prompt'|'messages'|'text'}).")],
    target: Annotated[str, typer.Option(help="Target model.")] = "smollm2-135m",
    drafter: Annotated[Optional[list[str]], typer.Option(help="Candidate (repeatable): ngram | retrieval[:DS] | "
                                                              "chain[:DS] | a draft model.")] = None,
    samples: Annotated[int, typer.Option(help="Prompts sampled from the workload.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed for the sample.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per generation.")] = 64,
    k_max: Annotated[int, typer.Option(help="Largest draft length K considered.")] = 8,
    price_per_hour: Annotated[Optional[float], typer.Option(help="Device price per hour, for cost per million tokens.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16.")] = "float32",
    out: Annotated[str, typer.Option(help="Folder for eval-drafts.json and eval-drafts.md.")] = "eval-drafts-out",
) -> None:
    """Measure candidate drafters on your workload; predict and measure speedup; recommend drafter and K."""
    from mirrorsd.apps.bench.runner import command_line
    from mirrorsd.apps.bench.eval_drafts import EvalOptions, run_eval_drafts

    candidates = tuple(drafter or ("ngram", "retrieval", "chain"))
    run_eval_drafts(EvalOptions(workload=workload, target=target, drafters=candidates, samples=samples, seed=seed, max_new_tokens=max_new_tokens, k_max=k_max,
                                price_per_hour=price_per_hour, dtype=dtype, out=out), command=command_line())


@app.command()
def devices(
    draft: Annotated[Optional[str], typer.Option(help="An export folder to place (default: the exports cache).")] = None,
    draft_device: Annotated[Optional[str], typer.Option(help="Draft backend override.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="Target device override.")] = None,
    check: Annotated[Optional[str], typer.Option(help="Check a target's batch invariance on its backend: verify "
                                                "passes of 1..17 positions against one-token decoding "
                                                "(a catalog name, .gguf, folder or export).")] = None,
    backend: Backend = "auto",
) -> None:
    """What this machine has, and what would run where, and why."""
    from mirrorsd.devices import discover, place
    from mirrorsd.devices import ExportInfo, npu_backends
    from mirrorsd.export_format import read_manifest
    from mirrorsd.drafters import exports_dir

    inv = discover()
    print(f"system      {inv.system} {inv.machine}; CPU {inv.cpu}, {inv.cores} cores")
    for b in inv.torch:
        memory = f", {b.memory_gb} GB" if b.memory_gb else ""
        print(f"torch       {b.device}: {b.name}{memory}")
    print(f"onnxruntime providers: {', '.join(inv.providers) or 'none (onnxruntime not installed)'}")
    for d in inv.ep_devices:
        print(f"            EP device: {d.provider} -> {d.device_type} ({d.vendor})")
    print(f"Core ML     {'available' if inv.coreml else 'not available (macOS with coremltools only)'}")
    npus = npu_backends(inv)
    print("NPU         " + ("; ".join(f"{b}: {what}" for b, what in npus) if npus else "none found"))
    for note in inv.notes:
        print(f"note        {note}")
    if draft:
        exports = [ExportInfo.from_manifest(draft, read_manifest(draft))]
    else:
        exports = [ExportInfo.from_manifest(p.parent, read_manifest(p.parent))
                   for p in sorted(exports_dir().glob("*/manifest.json"))]
        print(f"exports     {len(exports)} in {exports_dir()}" + "".join(f"\n            {e.path} ({e.format}, "
                                                                        f"{e.profile}, quant {e.quant})" for e in exports))
    p = place(inv, exports, explicit=bool(draft), draft_device=draft_device, target_device=device)
    from mirrorsd.backends import llamacpp_installed

    if llamacpp_installed():
        import llama_cpp

        offload = llama_cpp.llama_supports_gpu_offload()
        print(f"backend     auto -> llamacpp for GGUF models (every catalog model, .gguf files): llama-cpp-python "
              f"is installed ({'with GPU offload' if offload else 'CPU build'}); torch (float32) for Hugging Face "
              "folders")
        if device not in (None, "auto", "cpu") and not offload:
            print(f"backend     --device {device}: this llama.cpp build runs on the CPU only, so GGUF models go to "
                  "torch there (auto backend); --backend llamacpp with it is refused")
    else:
        print("backend     auto -> torch (float32): llama-cpp-python is not installed "
              "(pip install 'mirrorsd[llamacpp]' runs GGUF models on llama.cpp's quantized kernels)")
    print("backend     auto -> onnx for an export folder (`mirrorsd export --role target`): ONNX Runtime's "
          "int4/int8 kernels, CUDA provider where installed")
    if any(str(b.device).startswith("cuda") for b in inv.torch):
        print("backend     torch on cuda -> the static-shape path (every pass 16 rows, CUDA graphs, bfloat16); "
              "exact where its invariance check on this GPU passes (run at the first load, then kept)")
    print(f"target   -> {p.target}: {p.target_reason}")
    if p.draft == "export":
        print(f"draft    -> {p.draft_export} on {p.draft_backend}: {p.draft_reason}")
    else:
        print(f"draft    -> {p.draft_reason}")
    if check:
        _check_invariance(check, backend)


DEVICE_FLAG = re.compile(r"auto|cpu|(cuda|xpu)(:\d+)?|mps")
DTYPE_FLAGS = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def _check_flags(k: int = 1, max_new_tokens: int = 1, device: str = "auto", dtype: str = "auto") -> None:
    """--k, --max-new-tokens, --device and --dtype, checked and named as flags (GenerationConfig names its
    fields; a bad device or dtype would otherwise surface after a model load, or never on llama.cpp)."""
    from mirrorsd.config import MAX_DRAFT_TOKENS
    from mirrorsd.errors import ConfigError

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}", "e.g. --max-new-tokens 256")
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"--k must be from 1 to {MAX_DRAFT_TOKENS}, got {k}",
                          "--k is the draft length K (typically 4-16); --draft none decodes without drafting")
    if not DEVICE_FLAG.fullmatch(device):
        raise ConfigError(f"--device {device!r} is not a device", "use auto, cpu, cuda, cuda:N, mps or xpu")
    if dtype not in DTYPE_FLAGS:
        raise ConfigError(f"--dtype {dtype!r} is not a dtype", f"use one of {', '.join(DTYPE_FLAGS)}")


def _check_invariance(target: str, backend: str) -> None:
    """`devices --check`: the target's verify passes against its one-token decoding, bit for bit."""
    from mirrorsd.errors import ConfigError
    from mirrorsd.backends import load_lm
    from mirrorsd.backends import check_batch_invariance

    loaded = load_lm(target, backend, progress=True)
    lm, ids = loaded.lm, loaded.tokenizer("Batch invariance: the same logits in a batch as alone.")["input_ids"]
    report = check_batch_invariance(lm, ids, offsets=(len(ids), 280))  # continued greedily past 280
    declared = "declares exact verify passes" if lm.exact_batches else "declares inexact verify passes"
    print(f"check       {target}: {report.summary()}; the backend {declared}")
    if report.exact != lm.exact_batches:
        raise ConfigError(f"{lm.backend} {declared}, but the check measured otherwise",
                          "report this: the backend's exact_batches declaration is wrong on this machine")


@app.command("export")
def export_cmd(
    model: Annotated[Optional[str], typer.Option(help="Model to export: catalog name, folder or .gguf.")] = None,
    role: Annotated[str, typer.Option(help="draft (a draft model; NPU profile by default) | target (the target "
                                           "for --backend onnx: dynamic profile, K+1 tokens per call).")] = "draft",
    out: Annotated[Optional[str], typer.Option(help="Export folder to write.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="onnx | coreml.")] = "onnx",
    profile: Annotated[Optional[str], typer.Option(help="npu (static shapes) | dynamic (CPU/GPU providers); "
                                                        "default: npu for a draft, dynamic for a target.")] = None,
    precision: Annotated[str, typer.Option(help="fp32 | fp16.")] = "fp32",
    quant: Annotated[str, typer.Option(help="none | int8 (QDQ for npu, dynamic for dynamic) | int4 | gguf (a "
                                            "GGUF's own blocks in MatMulNBits, not re-rounded).")] = "none",
    max_context: Annotated[Optional[int], typer.Option(help="KV cache slots, the longest context the model "
                                                            "sees (default 1024 for a draft, 4096 for a target).")] = None,
    prefill_chunk: Annotated[int, typer.Option(help="Tokens per prefill block (npu profile).")] = 16,
    validate: Annotated[Optional[str], typer.Option(help="Only validate this export folder.")] = None,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip validation after exporting.")] = False,
    target: Annotated[Optional[str], typer.Option(help="Target for the validation's acceptance rate "
                                                       "(default: the exported model itself).")] = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime provider the validation runs on.")] = "cpu",
    atol: Annotated[Optional[float], typer.Option(help="Validation of an fp32 export: the largest |logit "
                                                       "difference| from PyTorch that passes (default 5e-4, "
                                                       "exporters.validate.ATOL).", show_default=False)] = None,
    min_top1: Annotated[Optional[float], typer.Option(help="Validation of an fp16 or quantized export: the least "
                                                           "top-1 agreement with PyTorch that passes, 0..1 (default "
                                                           "0.99, exporters.validate.TOP1_MIN).",
                                                      show_default=False)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show the tools' own logs and warnings (torch.onnx, "
                                                            "onnxscript, onnxruntime), hidden by default.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest (or, with --validate, the report) "
                                                         "as JSON instead of the summary table.")] = False,
) -> None:
    """Export a draft model to ONNX / Core ML for an NPU, or a target to ONNX for the onnx backend (and
    validate it); or validate an export. Exits 1 when validation fails."""
    from rich.console import Console

    from mirrorsd.apps.export_view import PhaseDisplay
    from mirrorsd.errors import ConfigError
    from mirrorsd.exporters import PhaseLog
    from mirrorsd.exporters import Limits

    limits = Limits(**{k: v for k, v in (("atol", atol), ("top1_min", min_top1)) if v is not None})
    if not (limits.atol >= 0 and 0 <= limits.top1_min <= 1):
        raise ConfigError("--atol must be >= 0 and --min-top1 between 0 and 1", "e.g. --atol 5e-4 --min-top1 0.99")
    phases = PhaseLog(PhaseDisplay(Console(stderr=True)))
    if validate:
        report = _validate_export(validate, target, provider, limits, phases, verbose)
        _show_validation(report, report if as_json else None, f"the export in {validate} is unchanged")
        return
    if not model or not out:
        raise ConfigError("mirrorsd export needs --model and --out (or --validate DIR)",
                          "e.g. mirrorsd export --model smollm2-135m --out exports/smollm2-npu")
    from mirrorsd.exporters import ROLE_ALIASES, export_draft

    role = ROLE_ALIASES.get(role, role)
    manifest = export_draft(model, out, fmt=fmt, profile=profile, precision=precision, quant=quant,
                            max_context=max_context or (4096 if role == "target" else 1024),
                            prefill_chunk=prefill_chunk, validate=not no_validate, progress=True, role=role,
                            phases=phases, verbose=verbose, limits=limits)
    if not as_json:
        print(f"{out}: {role}, {fmt} {manifest['profile']} profile, {manifest['precision']}, quant "
              f"{manifest['quant_form']}, max context {manifest['max_context']}; full report in {out}/manifest.json")
    what = ("as a target it decodes its own quantized model, which differs from the source more often than the "
            "limits allow") if role == "target" else "it still drafts losslessly, at a lower acceptance rate"
    _show_validation(manifest.get("validation"), manifest if as_json else None, f"the export is written to {out}; {what}")


def _validate_export(folder: str, target: str | None, provider: str, limits, phases, verbose: bool) -> dict:
    """`mirrorsd export --validate DIR`: the report, against the export's own model or --target's."""
    from mirrorsd.exporters import validate_export
    from mirrorsd.exporters import quiet_tools

    with quiet_tools(verbose):
        target_model = None
        if target:
            import torch

            from mirrorsd.export_format import check_tokenizer, read_manifest
            from mirrorsd.models import load_model

            with phases.phase("load", target):
                target_model, target_tok = load_model(target, torch.device("cpu"), torch.float32, progress=True)
            check_tokenizer(read_manifest(folder), target_tok, target, folder)
        with phases.phase("validate", f"against PyTorch on the {provider} provider"):
            return validate_export(folder, target=target_model, provider=provider, limits=limits)


def _show_validation(report: dict | None, as_json: dict | None, failed_note: str) -> None:
    """The summary table (or `as_json`, the machine output, on stdout); a failed validation ends in a FAILED
    line on stderr and exit code 1."""
    from rich.console import Console

    from mirrorsd.apps.export_view import failure_summary, validation_table

    if as_json is not None:
        print(json.dumps(as_json, indent=1))
    elif report is not None:
        Console().print(validation_table(report))
    if report is not None and not report["passed"]:
        print(f"mirrorsd: {failure_summary(report)}", file=sys.stderr)
        print(f"  note: {failed_note}; --atol / --min-top1 set the limits", file=sys.stderr)
        raise typer.Exit(1)


@app.command("draft-bench")
def draft_bench(
    draft: Annotated[str, typer.Option(help="Draft model to export and time.")] = "qwen2.5-coder-0.5b",
    target: Annotated[str, typer.Option(help="Target whose acceptance of the drafts is measured.")] = "qwen2.5-coder-1.5b",
    prompts: Annotated[int, typer.Option(help="Number of HumanEval prompts (from 0).")] = 3,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
    k: Annotated[int, typer.Option("--k", help="Draft tokens per verify step (fixed).")] = 4,
    threads: Annotated[int, typer.Option(help="Threads for torch and ONNX Runtime alike.")] = 1,
    exports: Annotated[Optional[str], typer.Option(help="Folder for the exports (reused when present).")] = None,
) -> None:
    """Draft tokens/s and acceptance of one draft through torch vs ONNX Runtime fp32 / int8 / int4."""
    from mirrorsd.apps.bench.draft_bench import run_draft_bench

    run_draft_bench(draft=draft, target=target, n_prompts=prompts, max_new_tokens=max_new_tokens, k=k,
                    threads=threads, exports=exports)


# Options `chat` and `serve` share.
Target = Annotated[str, typer.Option(help="Target model: catalog name, folder, .gguf or hub id.")]
Draft = Annotated[str, typer.Option(help="auto | ngram | retrieval[:DIR] | chain[:DIR] | none | a draft model.")]
Device = Annotated[str, typer.Option(help="Target device: auto | cpu | cuda[:N] | mps.")]
Dtype = Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")]


@app.command()
def chat(
    target: Target = "smollm2-135m",
    draft: Draft = "auto",
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.7,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens per reply.")] = 512,
    system: Annotated[str, typer.Option(help="A system message before the conversation (/system changes it).")] = "",
    device: Device = "auto",
    dtype: Dtype = "auto",
    backend: Backend = "auto",
    terminal: Annotated[bool, typer.Option("--terminal", help="Chat in the terminal even where a window could open.")] = False,
    highlight: Annotated[Optional[bool], typer.Option(help="Terminal: colour draft-accepted tokens "
                                                          "(default: when output is a terminal).")] = None,
) -> None:
    """Chat: a desktop window (Qt), or a terminal chat where there is no display or the window cannot start."""
    _check_flags(max_new_tokens=max_new_tokens, device=device, dtype=dtype)
    from mirrorsd.apps.chat.launch import run_chat
    from mirrorsd.apps.chat.session import ChatSettings

    settings = ChatSettings(temperature=temperature, max_new_tokens=max_new_tokens, system=system)
    settings.config()  # bad settings fail here, before any model loads
    sys.exit(run_chat(target, draft, device, dtype, settings, terminal=terminal, highlight=highlight,
                      backend=backend))


@app.command()
def serve(
    target: Target = "smollm2-135m",
    draft: Draft = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    api_key: Annotated[Optional[str], typer.Option(envvar="MIRRORSD_API_KEY",
                                                   help="Require 'Authorization: Bearer KEY' on every path but "
                                                        "/health (else 401). Set MIRRORSD_API_KEY instead to keep "
                                                        "the key out of `ps`.")] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Model id clients use (default: --target).")] = None,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask for.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body in bytes.")] = 1 << 20,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait behind the running one; more get 429.")] = 8,
    shutdown_grace: Annotated[float, typer.Option(help="Seconds running requests get to finish on Ctrl-C / "
                                                       "SIGTERM before they are cancelled.")] = 5.0,
    allow_control_tokens: Annotated[bool, typer.Option("--allow-control-tokens", help="Let control-token text in client messages (e.g. "
                                                            "<|im_start|>) become control tokens. Off: it stays "
                                                            "text, so a client cannot forge a system turn.")] = False,
    device: Device = "auto",
    draft_device: Annotated[Optional[str], typer.Option(help="Draft model device (default: same as --device).")] = None,
    dtype: Dtype = "auto",
    backend: Backend = "auto",
    draft_backend: DraftBackend = None,
    allowed_hosts: Annotated[Optional[list[str]], typer.Option(help="A Host name to answer besides the loopback "
                                                               "ones (repeatable); others get 403.")] = None,
    allowed_origins: Annotated[Optional[list[str]], typer.Option(help="A web page origin (e.g. "
                                                                 "https://chat.example, or '*') that may call the "
                                                                 "server from a browser besides its own and "
                                                                 "loopback ones (repeatable); others get 403.")] = None,
) -> None:
    """OpenAI- and ollama-compatible server: /v1/chat/completions, /v1/completions (SSE streaming), /v1/models,
    /health; ollama's /api/chat, /api/generate (NDJSON streaming), /api/tags, /api/show, /api/ps."""
    try:
        from mirrorsd.apps.serve.openai_api import ServerLimits, serve as run_server
    except ImportError as exc:
        raise MirrorsdError(f"the server needs FastAPI and uvicorn ({exc})", "pip install 'mirrorsd[serve]'") from exc
    from mirrorsd import Engine
    from mirrorsd.apps.serve.openai_api import bind_socket
    from mirrorsd.errors import ConfigError

    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty", "pass a non-empty key (or set MIRRORSD_API_KEY), or leave it out")
    if api_key is not None and api_key != api_key.strip():
        raise ConfigError("--api-key starts or ends with whitespace, which no client header would carry",
                          "pass the key without surrounding spaces")
    _check_flags(device=device, dtype=dtype)
    if min(max_tokens_limit, max_body_bytes, max_queue + 1) < 1 or not shutdown_grace >= 0:
        raise ConfigError("--max-tokens-limit and --max-body-bytes must be >= 1, --max-queue and "
                          "--shutdown-grace >= 0", "e.g. --max-tokens-limit 4096 --max-queue 8")
    limits = ServerLimits(max_tokens=max_tokens_limit, max_body_bytes=max_body_bytes, max_queue=max_queue)
    sock = bind_socket(host, port)  # a busy or bad port fails now, not after loading the model
    engine = Engine.load(target=target, draft=draft, device=device, dtype=dtype, draft_device=draft_device,
                         progress=True, backend=backend, draft_backend=draft_backend)
    engine.allow_control_tokens = allow_control_tokens
    with engine:
        engine.prepare()  # measured before "serving" (once per machine, then kept), not in the first request
        print(f"mirrorsd: serving {model_name or target} at http://{host}:{sock.getsockname()[1]}/v1",
              file=sys.stderr)
        run_server(engine, host=host, port=port, api_key=api_key, model_name=model_name or target,
                   limits=limits, sock=sock, shutdown_grace_s=shutdown_grace,
                   allowed_hosts=tuple(allowed_hosts or ()), allowed_origins=tuple(allowed_origins or ()))


@app.command()
def handoff(
    out: Annotated[str, typer.Argument(help="A new folder for the handoff.")],
    to: Annotated[str, typer.Option(help="The engine to hand off to: vllm.")] = "vllm",
    target: Annotated[Optional[str], typer.Option(help="Target model (default: the report's, else "
                                                       "smollm2-135m).")] = None,
    draft: Annotated[Optional[str], typer.Option(help="ngram | retrieval[:DIR] | chain[:DIR] (ours, inside vLLM) | "
                                                      "a draft model (catalog name, folder, .gguf); default: the "
                                                      "report's recommendation, else ngram.")] = None,
    k: Annotated[Optional[int], typer.Option("--k", help="Tokens to speculate per step (default: the report's "
                                                         "best K for the drafter).")] = None,
    eval_report: Annotated[Optional[str], typer.Option(help="An eval-drafts.json (mirrorsd eval-drafts) to take "
                                                            "the drafter, K and its measured figures from.")] = None,
    dtype: Annotated[str, typer.Option(help="The models' weights in OUT: bfloat16 (half the size; what vLLM serves "
                                              "on GPUs) or float32 (mirrorsd's own weights, bit for bit).")] = "bfloat16",
    link: Annotated[bool, typer.Option("--link", help="With --dtype float32: link the model folders and the "
                                                       "datastore instead of copying them (vLLM on this host only).")] = False,
) -> None:
    """Take a drafter measured here to vLLM: OUT/serve.sh serves the target with it on vLLM (tensor and pipeline
    parallel across GPUs and nodes)."""
    from mirrorsd.apps.handoff.folder import plan_handoff, write_handoff
    from mirrorsd.errors import ConfigError

    if to != "vllm":
        raise ConfigError(f"cannot hand off to {to!r}", "--to vllm")
    plan = plan_handoff(target, draft, k, eval_report)
    folder = write_handoff(plan, out, dtype=dtype, link=link, progress=True)
    print(f"{folder}: {plan.target} with {plan.draft}, K={plan.k} ({plan.k_from}); run {folder / 'serve.sh'} where "
          "vLLM is installed (see its README.md)")


datastore_app = typer.Typer(no_args_is_help=True, help="Retrieval datastores for the retrieval drafter.")
app.add_typer(datastore_app, name="datastore")


def _load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from mirrorsd.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(spec, progress=True))


@datastore_app.command("build")
def datastore_build(
    paths: Annotated[list[str], typer.Argument(help="Files, folders (source/text files, recursively) or JSONL "
                                                    "conversations ({'messages': [...]}, {'text': ...}).")],
    out: Annotated[str, typer.Option(help="Folder to write the datastore to.")],
    tokenizer: Annotated[str, typer.Option(help="The target model whose tokenizer to use.")] = "smollm2-135m",
    segment_tokens: Annotated[int, typer.Option(help="Tokens per index segment (bounds build memory, ~60 B/token).")] = 8_000_000,
    force: Annotated[bool, typer.Option("--force", help="Replace a datastore already at --out (what it learned "
                                                        "from replies is lost).")] = False,
) -> None:
    """Build a datastore; use it with `mirrorsd generate --draft chain:DIR` (or retrieval:DIR)."""
    from mirrorsd.errors import ConfigError
    from mirrorsd.drafters import build_datastore

    if segment_tokens < 1:
        raise ConfigError(f"--segment-tokens must be >= 1, got {segment_tokens}", "the default is 8000000")
    if (Path(out) / "datastore.json").exists() and not force:  # it may hold replies learned with chain:DIR
        raise ConfigError(f"{out} already holds a datastore (with any replies it learned)",
                          "pick another --out, or pass --force to replace it")
    t0 = time.perf_counter()
    store = build_datastore(paths, _load_tokenizer(tokenizer), out, segment_tokens=segment_tokens, progress=True,
                            tokenizer_name=tokenizer)
    print(f"{out}: {store.num_tokens} tokens, {store.header['documents']} documents, "
          f"{len(store.segments)} segment(s), built in {time.perf_counter() - t0:.1f} s")


@datastore_app.command("info")
def datastore_info(path: Annotated[str, typer.Argument(help="A datastore folder.")]) -> None:
    """Say what a datastore holds (and check that it opens)."""
    from mirrorsd.drafters import Datastore

    store = Datastore.open(path)
    h = store.header
    print(json.dumps({"tokens": store.num_tokens, "documents": h["documents"], "segments": len(h["segments"]),
                      "tokenizer": h.get("tokenizer_name"), "tokenizer_fingerprint": h["tokenizer"][:16],
                      "version": h["version"]}, indent=1))


# Old spellings, still accepted and not shown: one name per concept in the help.
HIDDEN_ALIASES = {"--verifier-device": "--device", "--verifier-export": "--target-export"}


def _unaliased(args: list[str]) -> list[str]:
    """argv with old option spellings (also as --old=value) replaced by their current names."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        out.append(HIDDEN_ALIASES[name] + eq + value if name in HIDDEN_ALIASES else arg)
    return out


def _without_type_tags(command) -> None:
    """Help as llama.cpp's and git's read: `--target TARGET`, `--json`, `prompt`, not typer's `<str>` / `<bool>` tags."""
    help_option = command.get_help_option(command.context_class(command, help_option_names=["-h", "--help"]))
    for param in [*command.params, *([help_option] if help_option else [])]:
        if param.param_type_name == "argument":
            param.display_type_rich = lambda ctx: None  # typer shows an argument's type whatever its metavar
        elif param.metavar is None:
            param.metavar = "" if param.is_flag else param.opts[-1].lstrip("-").split("-")[-1].upper()
    for sub in getattr(command, "commands", {}).values():
        _without_type_tags(sub)


def main() -> None:
    try:  # typer 0.2x vendors click; older typer uses click itself
        from typer._click.exceptions import UsageError
    except ImportError:
        from click.exceptions import UsageError
    command = typer.main.get_command(app)
    _without_type_tags(command)
    try:
        code = command.main(args=_unaliased(sys.argv[1:]), standalone_mode=False, prog_name="mirrorsd")
    except UsageError as err:  # a bad option value, an unknown option or command: the same shape as ours
        print(f"mirrorsd: error: {err.format_message()}", file=sys.stderr)
        print(f"  hint: see `{err.ctx.command_path if err.ctx else 'mirrorsd'} --help`", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except MirrorsdError as err:
        _fail(err.message, err.hint)
    except KeyboardInterrupt:
        sys.exit(130)
    except (OSError, UnicodeError, ValueError, KeyError, IndexError, TypeError) as err:
        # A file, folder or stream that is not what a command expected (a datastore path that is a text file,
        # an unwritable folder, a malformed JSON line, ...): the error and its cause, not a traceback.
        if os.environ.get("MIRRORSD_DEBUG"):
            raise
        what = f"{err.filename}: " if isinstance(err, OSError) and err.filename else ""
        _fail(f"{what}{err.strerror if isinstance(err, OSError) and err.strerror else err} "
              f"({type(err).__name__})", "check the paths and files given; MIRRORSD_DEBUG=1 shows where it failed")
    if isinstance(code, int) and code:
        sys.exit(code)


def _fail(message: str, hint: str | None) -> None:
    print(f"mirrorsd: error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
