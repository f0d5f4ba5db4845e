"""The mirrorsd command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json

import pytest
from helpers import run, run_all

def test_generate_json_on_a_local_folder_matches_target_only(tiny_folder):
    common = ["--target", str(tiny_folder), "--max-new-tokens", "24", "--json", "--raw", "--dtype", "float32"]
    spec, plain = run_all(("generate", *common, "--draft", "ngram", "def f(x): return x"),
                          ("generate", *common, "--draft", "none", "def f(x): return x"))
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) >= 1
    for key in ("tokens_per_second", "acceptance_rate", "mean_accepted_length", "verify_steps", "drafter"):
        assert key in a["stats"]
    assert b["stats"]["drafter"] == "none" and b["stats"]["drafter_shares"] == {"none": 1.0}
    shares = a["stats"]["drafter_shares"]  # steps per source, plain steps as "none"
    assert set(shares) == set(a["stats"]["drafters"]) and abs(sum(shares.values()) - 1) < 0.01
    assert a["stats"]["drafter"] == max(shares, key=lambda k: (shares[k], k != "none"))
    assert set(a["stats"]["acceptance_by_drafter"]) == {s for s, (d, _) in a["stats"]["drafter_tokens"].items() if d}
    assert a["model"] == str(tiny_folder)
    assert 0 < a["stats"]["prompt_time_s"] <= a["stats"]["time_to_first_token_s"] <= a["stats"]["total_time_s"]


def test_bad_arguments_give_a_message_not_a_traceback(tiny_folder):
    bad = [(["--seed", "-1"], "seed"), (["--k", "abc"], "--k"), (["--no-such-flag"], "no-such-flag"),
           (["--trace", str(tiny_folder / "config.json" / "t.json")], "cannot write the trace"),
           (["--k", "0"], "--k must be from 1"), (["--max-new-tokens", "0"], "--max-new-tokens must"),
           (["--dtype", "bogus"], "--dtype 'bogus'"), (["--device", "tpu9"], "--device 'tpu9'")]
    commands = ["serve", "--port", "0"], ["chat", "--terminal"]
    bad_model, bad_temp, empty, typo, *outs = run_all(
        ("generate", "--target", "no-such-model", "hi"),
        ("generate", "--target", str(tiny_folder), "--temperature", "-1", "hi"),
        ("generate", "--target", str(tiny_folder), "--file", "/dev/null"),  # was answered
        ("generate", "--target", str(tiny_folder), "--draft", "ngrams", "hi"),
        *[("generate", "--target", str(tiny_folder), *args, "hi") for args, _ in bad],
        *[(*command, "--target", str(tiny_folder), "--dtype", "fp64") for command in commands])
    assert bad_model.returncode == 2 and "unknown model" in bad_model.stderr and "Traceback" not in bad_model.stderr
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr and "Traceback" not in bad_temp.stderr
    for (args, words), out in zip(bad, outs):
        assert out.returncode == 2 and out.stderr.startswith("mirrorsd: error:") and words in out.stderr, out.stderr
        # (startswith: refused before the model loads, so no loading output comes first)
        assert "Traceback" not in out.stderr and "hint:" in out.stderr
    assert empty.returncode == 2 and "the prompt from --file /dev/null is empty" in empty.stderr, empty.stderr
    for out in outs[len(bad):]:
        assert out.returncode == 2 and out.stderr.startswith("mirrorsd: error: --dtype 'fp64'"), out.stderr
    assert typo.returncode == 2 and "did you mean 'ngram'" in typo.stderr and "chain[:PATH]" in typo.stderr


def test_models_lists_the_catalog(tmp_path):
    out = run("models", env={"MIRRORSD_CACHE": str(tmp_path), "COLUMNS": "200"})
    assert out.returncode == 0
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in out.stdout
    assert "missing" in out.stdout


@pytest.mark.integration
def test_default_generate_runs_offline_on_smollm2():
    out = run("generate", "--max-new-tokens", "16", "--json", "Say hello.")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["text"] and result["stats"]["drafter"].startswith(("chain(ngram ", "none"))  # auto: the chain
    assert result["stats"]["backend"] == "llamacpp:cpu"  # auto: the catalog's GGUF on llama.cpp


@pytest.mark.integration
def test_backend_choice_on_the_command_line_and_in_devices(tiny_folder):
    import torch

    torch_run, folder, not_gguf, devices, on_cuda = run_all(
        ("generate", "--backend", "torch", "--max-new-tokens", "8", "--json", "Say hello."),
        ("generate", "--target", str(tiny_folder), "--max-new-tokens", "4", "--json", "--raw", "hi"),
        ("generate", "--target", str(tiny_folder), "--backend", "llamacpp", "hi"),
        ("devices",), ("devices", "--device", "cuda"))
    assert torch_run.returncode == 0, torch_run.stderr
    assert json.loads(torch_run.stdout)["stats"]["backend"] == "torch:cpu"
    assert json.loads(folder.stdout)["stats"]["backend"] == "torch:cpu"  # auto: a folder is no GGUF
    assert not_gguf.returncode == 2 and "GGUF" in not_gguf.stderr and "Traceback" not in not_gguf.stderr
    assert devices.returncode == 0 and "auto -> llamacpp for GGUF models" in devices.stdout
    if not torch.cuda.is_available():  # it claimed the target would run on cuda
        assert on_cuda.returncode == 0 and "torch sees no cuda device here" in on_cuda.stdout, on_cuda.stdout
        assert "runs on the CPU only" in on_cuda.stdout or "with GPU offload" in on_cuda.stdout


def test_datastore_build_info_and_generate_with_it(tiny_folder, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x * 2\n" * 5)
    built = run("datastore", "build", str(corpus), "--tokenizer", str(tiny_folder), "--out", str(tmp_path / "ds"))
    assert built.returncode == 0, built.stderr
    info = json.loads(run("datastore", "info", str(tmp_path / "ds")).stdout)
    assert info["documents"] == 1 and info["tokens"] > 10
    again = run("datastore", "build", str(corpus), "--tokenizer", str(tiny_folder), "--out", str(tmp_path / "ds"))
    assert again.returncode == 2 and "--force" in again.stderr  # what it learned would be replaced silently
    forced = run("datastore", "build", str(corpus), "--tokenizer", str(tiny_folder), "--out", str(tmp_path / "ds"),
                 "--force")
    assert forced.returncode == 0, forced.stderr
    common = ["--target", str(tiny_folder), "--max-new-tokens", "16", "--json", "--raw", "--dtype", "float32",
              "def f(x):"]
    chain, plain, missing = run_all(("generate", "--draft", f"chain:{tmp_path / 'ds'}", *common),
                                    ("generate", "--draft", "none", *common),
                                    ("generate", "--draft", f"retrieval:{tmp_path / 'nope'}", *common))
    assert json.loads(chain.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert missing.returncode == 2 and "not a datastore" in missing.stderr
    (tmp_path / "ds" / "seg-00000.sa.npy").write_bytes(b"")  # looked like Ctrl-C: exit 130, no message
    cut = run("datastore", "info", str(tmp_path / "ds"))
    assert cut.returncode == 2 and "truncated" in cut.stderr and "Traceback" not in cut.stderr, cut.stderr


def test_generate_with_a_draft_model_through_the_pipeline_with_a_trace(tiny_folder, tmp_path):
    common = ["--target", str(tiny_folder), "--max-new-tokens", "24", "--json", "--raw", "--dtype", "float32"]
    plain = json.loads(run("generate", *common, "--draft", "none", "def f(x): return x").stdout)
    for mode in ("branches",):
        trace = tmp_path / f"{mode}.json"
        out = run("generate", *common, "--draft", str(tiny_folder), "--pipeline", mode, "--early-exit-layer", "1",
                  "--trace", str(trace), "def f(x): return x")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["token_ids"] == plain["token_ids"]
        assert got["stats"]["pipeline"] == mode and "hidden_draft_share" in got["stats"]
        assert {e.get("cat") for e in json.loads(trace.read_text())["traceEvents"]} >= {"draft", "verify"}


def test_help_and_version_do_not_import_the_heavy_libraries():
    import subprocess
    import sys

    code = "import sys, mirrorsd.apps.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    import time

    start = time.perf_counter()
    version = run("--version")
    took = time.perf_counter() - start  # about 0.3 s here when quiet; the bound only catches a torch import
    assert version.returncode == 0 and version.stdout.startswith("mirrorsd ") and took < 8, took
    assert run("-h").returncode == 0 and "generate" in run("-h").stdout


def test_prompt_from_stdin_a_file_and_a_system_message(tiny_folder, tmp_path):
    base = ["generate", "--target", str(tiny_folder), "--max-new-tokens", "6", "--draft", "none", "--json"]

    def text(out):
        assert out.returncode == 0, out.stderr
        assert "mirrorsd: loading" in out.stderr  # said at once, before the model loads
        return json.loads(out.stdout)["text"]

    (tmp_path / "p.txt").write_text("def quicksort(arr):")
    direct, piped, from_file, with_system = map(text, run_all(
        (*base, "def quicksort(arr):"), (*base, "-"), (*base, "--file", str(tmp_path / "p.txt")),
        (*base, "def quicksort(arr):", "--system", "Answer in French."), stdin="def quicksort(arr):"))
    assert piped == from_file == direct and isinstance(with_system, str)
    neither = run("generate", "--target", str(tiny_folder))
    assert neither.returncode == 2 and "stdin" in neither.stderr


def test_generate_with_a_json_schema_file(tiny_folder, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    common = ["--target", str(tiny_folder), "--max-new-tokens", "40", "--json", "--raw", "--dtype", "float32",
              "--json-schema", str(tmp_path / "schema.json"), "--logprobs", "1", "def f(x): return x"]
    (tmp_path / "bad.json").write_text('{"type": "nonsense"}')
    bad = [(["--json-schema", str(tmp_path / "bad.json")], "grammar is invalid"),
           (["--json-schema", str(tmp_path / "missing.json")], "cannot read the JSON schema file"),
           (["--regex", "(", "--grammar", str(tmp_path / "schema.json")], "at most one")]
    spec, plain, *outs = run_all(("generate", *common, "--draft", "ngram"), ("generate", *common, "--draft", "none"),
                                 *[("generate", "--target", str(tiny_folder), "--raw", *args, "hi") for args, _ in bad])
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == "stop"
    jsonschema.validate(json.loads(a["text"]), schema)
    assert len(a["logprobs"]) == len(a["token_ids"]) and len(a["logprobs"][0]["top"]) == 1
    for (_, words), out in zip(bad, outs):
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_files_that_are_not_what_a_command_expects_are_errors_not_tracebacks(tmp_path):
    """Malformed inputs and paths give `mirrorsd: error:` and exit 2 (MIRRORSD_DEBUG=1 shows the traceback)."""
    text = tmp_path / "notes.txt"
    text.write_text("just text\n")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('[1, 2]\n42\n{"messages": ["a string"]}\n')
    good = tmp_path / "good.txt"
    good.write_text("def f():\n    return 1\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        ["datastore", "info", str(text)],
        ["generate", "--draft", f"chain:{text}", "--max-new-tokens", "2", "hi"],
        ["datastore", "build", str(bad_jsonl), "--out", str(tmp_path / "ds1")],
        ["datastore", "build", str(good), "--out", str(a_file)],
        ["datastore", "build", str(good), "--out", str(tmp_path / "ds2"), "--segment-tokens", "0"],
    ]
    for args, r in zip(cases, run_all(*cases)):
        assert r.returncode == 2 and "mirrorsd: error:" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    cache_is_a_file = run("generate", "--max-new-tokens", "2", "hi", env={"MIRRORSD_CACHE": str(a_file)})
    assert cache_is_a_file.returncode == 2 and "Traceback" not in cache_is_a_file.stderr, cache_is_a_file.stderr
    debug = run("datastore", "info", str(text), env={"MIRRORSD_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.integration
def test_devices_check_measures_the_targets_batch_invariance():
    pytest.importorskip("llama_cpp")
    r = run("devices", "--check", "smollm2-135m")
    assert r.returncode == 0 and "smollm2-135m: llamacpp:cpu: batch-invariant" in r.stdout, r.stdout + r.stderr
    assert "declares exact verify passes" in r.stdout


def test_the_old_verifier_device_spelling_is_a_hidden_alias_of_device():
    shown = run("generate", "--help")
    assert "--device" in shown.stdout and "--verifier-device" not in shown.stdout
    placed = run("devices", "--verifier-device=cpu")
    assert placed.returncode == 0 and "target   -> cpu: asked for (--device)" in placed.stdout


def test_the_earlier_names_of_the_pipeline_off_and_the_target_export_are_hidden_aliases(tiny_folder, tmp_path):
    """`--pipeline sequential` is the pipeline off; `--role verifier` a target export; `--verifier-export` the
    bench's --target-export: accepted, and absent from the help."""
    *helps, out, export = run_all(
        ("generate", "--help"), ("export", "--help"), ("bench", "--help"),
        ("generate", "--target", str(tiny_folder), "--draft", "ngram", "--pipeline", "sequential", "--raw",
         "--max-new-tokens", "4", "--json", "def f(x):"),
        ("export", "--role", "verifier", "--model", str(tiny_folder), "--out", str(tmp_path / "t"), "--no-validate"))
    shown = "".join(h.stdout for h in helps)
    assert "sequential" not in shown and "verifier" not in shown and "--target-export" in shown
    assert out.returncode == 0 and json.loads(out.stdout)["stats"]["pipeline"] == "off", out.stderr
    assert export.returncode == 0, export.stderr
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["role"] == "target"


def test_rm_frees_a_cached_model_and_names_what_is_not_cached(tmp_path):
    entry = tmp_path / "models" / "smollm2-135m" / "gguf"
    entry.mkdir(parents=True)
    (entry / "smollm2-135m.gguf").write_bytes(b"\0" * 2_000_000)
    env = {"MIRRORSD_CACHE": str(tmp_path)}
    removed = run("rm", "smollm2-135m", env=env)
    assert removed.returncode == 0 and "removed smollm2-135m (2 MB freed)" in removed.stdout
    assert not (tmp_path / "models" / "smollm2-135m").exists()
    again = run("rm", "smollm2-135m", env=env)
    assert again.returncode == 2 and "not in the cache" in again.stderr
    unknown = run("pull", "no-such-model", env=env)
    assert unknown.returncode == 2 and "unknown catalog model" in unknown.stderr and "smollm2-135m" in unknown.stderr
    assert not (tmp_path / "models" / "no-such-model").exists()


def test_pull_fetches_the_gguf_and_converts_only_when_asked(tmp_path):
    """A GGUF llama.cpp runs offline is `ready` in `models` (it said `missing` while only the torch conversion
    counted), and `pull` leaves no float conversion (6x the GGUF) unless --torch asks for it."""
    import shutil

    from mirrorsd import catalog

    real = catalog.ensure_gguf("smollm2-135m", progress=False)
    gguf = tmp_path / "models" / "smollm2-135m" / "gguf" / "smollm2-135m.gguf"
    gguf.parent.mkdir(parents=True)
    shutil.copyfile(real, gguf)  # as a finished assembly leaves it: the file, then its checked record
    catalog._write_checked(gguf, catalog.CATALOG["smollm2-135m"].sha256)
    env = {"MIRRORSD_CACHE": str(tmp_path), "COLUMNS": "250"}
    pulled = run("pull", "smollm2-135m", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert "smollm2-135m: GGUF ready (" in pulled.stdout and "torch" not in pulled.stdout
    assert not (tmp_path / "models" / "smollm2-135m" / "hf").exists()
    listed = run("models", env=env)
    row = next(line for line in listed.stdout.splitlines() if "smollm2-135m" in line)
    assert "ready, " in row and "not made" in row and "missing" not in row, listed.stdout
    converted = run("pull", "smollm2-135m", "--torch", env=env)
    assert converted.returncode == 0 and "torch conversion ready (" in converted.stdout, converted.stderr
    row = next(line for line in run("models", env=env).stdout.splitlines() if "smollm2-135m" in line)
    assert row.count("ready, ") == 2, row
    assert catalog.CATALOG["smollm2-135m"] and (tmp_path / "models" / "smollm2-135m" / "hf").is_dir()


def test_a_hub_id_that_is_not_cached_fails_at_once_offline():
    out = run("generate", "--target", "some-org/not-a-cached-model", "hi")  # run() sets HF_HUB_OFFLINE=1
    assert out.returncode == 2 and "not in the local cache and the hub cannot be reached" in out.stderr
    assert "smollm2-135m" in out.stderr and "retry" not in out.stderr.lower() and "Traceback" not in out.stderr


def test_help_shows_option_names_whole_and_no_type_tags():
    """`--target TARGET`, `--json`, as llama.cpp and git show them: no typer `<str>` / `<bool>` tags, and at 80
    columns no option name cut off."""
    import re

    import typer

    from mirrorsd.apps.cli import app

    def commands(group, path=()):
        for name, sub in group.commands.items():
            if hasattr(sub, "commands"):
                yield from commands(sub, (*path, name))
            else:
                yield (*path, name), sub

    for path, command in commands(typer.main.get_command(app)):
        shown = run(*path, "--help", env={"COLUMNS": "80"})
        assert shown.returncode == 0, shown.stderr
        assert not re.search(r"<(str|int|float|bool|list|path)", shown.stdout), (path, shown.stdout)
        for param in command.params:
            if not param.hidden and param.param_type_name == "option":
                assert all(re.search(rf"{opt}\b", shown.stdout) for opt in param.opts), (path, param.opts)
