"""Structured output: llguidance mask cost per position on the catalog vocabularies (docs/structured-output.md)."""
import json, time
import numpy as np
from mirrorsd.runtime.backends import load_lm
from mirrorsd.structured import Grammars, grammar_text
from mirrorsd.apps.bench.prompt_suite import _JSON_SCHEMA
for name in ("smollm2-135m", "qwen2.5-coder-1.5b"):
    l = load_lm(name, "llamacpp")
    g = Grammars(l.tokenizer, l.lm.vocab_size, l.eos_ids)
    t = time.perf_counter(); g._tokenizer(); build = time.perf_counter() - t
    times = []
    for msgs, schema in _JSON_SCHEMA:
        c = g.constraint(grammar_text(json.dumps(schema), None, None))
        text = json.dumps({"people": [{"name": "Ana Silva", "email": "ana@example.org", "age": 34, "city": "Porto"}]}) if "people" in schema["properties"] else "{"
        ids = l.tokenizer(text)["input_ids"]
        for t_ in ids:
            s = time.perf_counter(); row = c.masks([]); times.append(time.perf_counter() - s)
            if not row[0, t_]: break
            c.advance([t_])
    print(name, f"tokenizer build {build:.2f} s; mask per position: median {np.median(times)*1e3:.2f} ms, p90 {np.percentile(times,90)*1e3:.2f} ms, max {max(times)*1e3:.2f} ms over {len(times)}")
