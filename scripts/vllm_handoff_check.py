"""A vLLM server started from a `mirrorsd handoff` folder against mirrorsd: greedy completions of a few raw prompts
from both (mirrorsd's torch float32 target-only decoding as the reference) and vLLM's speculative counters. Where
docs/handoff.md's "Checked" table comes from.

    PYTHON=VLLM_VENV/bin/python VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 OUT/serve.sh --dtype float32 \\
        --enforce-eager --max-model-len 2048 --host 127.0.0.1 --port 8011 &
    .venv/bin/python scripts/vllm_handoff_check.py --port 8011 --target smollm2-135m
"""

from __future__ import annotations

import argparse
import json

PROMPTS = ["def fibonacci(n):\n    ", "The three primary colors are",
           "import json\n\ndef load(path):\n    with open(path) as f:\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--target", default="smollm2-135m", help="the served model name (and mirrorsd's target)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    import httpx
    from openai import OpenAI

    from mirrorsd import Engine, GenerationConfig

    client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0)
    theirs = [client.completions.create(model=args.target, prompt=p, max_tokens=args.max_tokens, temperature=0)
              .choices[0].text for p in PROMPTS]
    counters = [line for line in httpx.get(f"http://127.0.0.1:{args.port}/metrics").text.splitlines()
                if line.startswith(("vllm:spec_decode_num_draft_tokens_total",
                                    "vllm:spec_decode_num_accepted_tokens_total"))]
    engine = Engine.load(args.target, draft="none", backend="torch")
    ours = [engine.generate(p, GenerationConfig(max_new_tokens=args.max_tokens)).text for p in PROMPTS]
    print(json.dumps({"equal": [a == b for a, b in zip(theirs, ours)], "vllm_counters": counters}, indent=1))


if __name__ == "__main__":
    main()
