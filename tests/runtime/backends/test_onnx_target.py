"""The ONNX Runtime backend for the target: a tiny random Llama exported with `--role target`, loaded
as the target (`Engine.load(DIR)`, `--backend onnx`), token-equal to its own target-only decoding with
every drafter and pipeline, sampling in distribution, the IO-binding path equal to the host path, and
bad input."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_distribution, exact_first_two, invariance_tokens, run
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError, ExportError
from mirrorsd.exporters import export_draft, export_target, read_manifest
from mirrorsd.runtime.backends import auto_backend, load_lm
from mirrorsd.runtime.backends.exported import load_export_lm
from mirrorsd.runtime.backends.invariance import check_batch_invariance
from mirrorsd.runtime.backends.onnx_lm import OnnxCausalLM
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter

pytestmark = pytest.mark.slow  # ONNX exports of the target, then passes through ONNX Runtime

PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:", "The quick brown fox", "import numpy as np\n"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tokenizer, target_model):
    """quant -> a target export of the tiny target."""
    root = tmp_path_factory.mktemp("targets")
    return {quant: export_target(target_model, root / quant, quant=quant, max_context=256, tokenizer=tokenizer)
            and root / quant for quant in ("none", "int4")}


def test_a_target_export_carries_what_loading_it_as_the_target_needs(targets):
    manifest = read_manifest(targets["none"])
    assert manifest["role"] == "target" and manifest["profile"] == "dynamic"
    assert (targets["none"] / "tokenizer" / "tokenizer.json").is_file()
    assert manifest["eos_ids"] == [0] and manifest["source"]["weights"] == "float"
    assert manifest["validation"]["passed"] and manifest["validation"]["max_abs_logit_diff"] <= 1e-4
    assert "acceptance_rate" not in manifest["validation"]  # a target export is not a draft
    int4 = read_manifest(targets["int4"])
    assert int4["quant_form"].startswith("MatMulNBits 4-bit") and "top1_agreement" in int4["validation"]


def target_only(engine: Engine, prompt: str, n: int) -> list[int]:
    return engine.with_drafter(None).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("pipeline", ["off", "overlap"])
def test_speculation_on_the_onnx_target_is_token_equal_to_its_target_only(targets, quant, pipeline,
                                                                             other_model, target_model):
    engine = Engine.load(str(targets[quant]), draft=None)
    engine.eos_ids = frozenset()
    assert engine.target.backend == "onnx:CPU"
    drafters = {"ngram": NGramDrafter(), "other model": ModelDrafter(TorchCausalLM(other_model)),
                "same weights": ModelDrafter(TorchCausalLM(target_model))}
    for name, drafter in drafters.items():
        spec = engine.with_drafter(drafter, helper=None)
        for prompt in PROMPTS:
            result = spec.generate(prompt, GenerationConfig(max_new_tokens=40, num_draft_tokens=4, pipeline=pipeline))
            assert result.token_ids == target_only(engine, prompt, 40), (name, prompt)
            assert result.stats.backend == "onnx:CPU"
        assert result.stats.drafted_tokens > 0, name


def test_io_binding_gives_the_host_path_logits_and_rolls_back(targets, tokenizer):
    folder = targets["int4"]
    manifest = read_manifest(folder)
    host, bound, fresh = (OnnxCausalLM(folder, manifest, io_binding=flag) for flag in (False, True, True))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert torch.equal(host.score(ids, [5, 6, 7, 8]), bound.score(ids, [5, 6, 7, 8]))
    got = bound.score(ids + [11], [12, 13])  # drafts 5..8 rejected: the cache rolls back to the prompt
    assert torch.equal(got, host.score(ids + [11], [12, 13]))
    assert torch.equal(got, fresh.score(ids + [11], [12, 13]))  # batch-invariant: as if never drafted
    assert bound._cached == ids + [11, 12, 13]


def test_sampling_through_the_onnx_target_follows_the_target_distribution(targets, target_model, other_model,
                                                                            tokenizer):
    cfg = GenerationConfig(temperature=0.8, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False)
    engine = Engine.load(str(targets["none"]), draft=None).with_drafter(ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    p1, p2 = exact_first_two(target_model, tokenizer, cfg, PROMPTS[1])  # the fp32 export = these weights
    assert_distribution(engine, PROMPTS[1], cfg, p1, p2, seeds=1200, min_drafted=800)


def test_auto_picks_onnx_for_an_export_and_the_cli_runs_it(targets, tiny_folder):
    assert auto_backend(str(targets["int4"])) == "onnx"
    assert auto_backend(str(tiny_folder)) == "torch"
    out = run("generate", "def quicksort", "--target", str(targets["int4"]), "--max-new-tokens", "8", "--raw")
    assert out.returncode == 0, out.stderr
    assert "on onnx:CPU" in out.stderr


def test_bad_input_is_a_clear_error(targets, tiny_folder, tmp_path, target_model, tokenizer):
    with pytest.raises(ConfigError) as err:
        load_lm(str(tiny_folder), "onnx")
    assert "--role target" in err.value.hint
    with pytest.raises(ConfigError):
        export_target(target_model, tmp_path / "x", quant="int2", tokenizer=tokenizer)
    out = run("export", "--role", "target", "--profile", "npu", "--model", str(tiny_folder), "--out",
              str(tmp_path / "y"))
    assert out.returncode != 0 and "dynamic profile" in out.stderr and "Traceback" not in out.stderr
    old = tmp_path / "old"  # an export from before tokenizers were saved beside the graphs
    old.mkdir()
    for f in targets["none"].iterdir():
        if f.is_file():
            (old / f.name).symlink_to(f)
    with pytest.raises(ExportError) as err:
        load_lm(str(old), "onnx")
    assert "no tokenizer" in err.value.message


INVARIANCE_TOKENS = invariance_tokens(300, 230)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_target_export_is_batch_invariant_and_declared_so(targets, quant):
    """Every row of a verify pass of 1..17 positions equals one-token decoding bit for bit (the graph's spare
    row keeps ONNX Runtime's single-row kernels out of it), after whole and chunked prefills."""
    lm = load_lm(str(targets[quant]), "onnx").lm
    assert lm.exact_batches
    report = check_batch_invariance(lm, INVARIANCE_TOKENS, offsets=(9, 200))
    assert report.exact, report.summary()


def test_a_graph_without_the_spare_row_fails_the_same_check_and_is_declared_inexact(tmp_path, tokenizer,
                                                                                     target_model):
    export_draft(target_model, tmp_path / "draft", profile="dynamic", quant="none", max_context=256,
                 tokenizer=tokenizer, validate=False)
    lm = load_export_lm(tmp_path / "draft")
    assert not lm.exact_batches
    report = check_batch_invariance(lm, INVARIANCE_TOKENS, offsets=(9,), sizes=(1, 4, 9))
    assert not report.exact and report.max_abs_diff < 1e-4, report.summary()


def test_int8_and_fp16_target_exports_are_declared_inexact(tmp_path, tokenizer, target_model):
    """int8 quantizes activations with one scale per tensor (a row depends on its neighbours); fp16 runs other
    kernels: neither is exact, and neither claims to be."""
    for name, options in {"int8": {"quant": "int8"}, "fp16": {"quant": "none", "precision": "fp16"}}.items():
        export_target(target_model, tmp_path / name, max_context=256, tokenizer=tokenizer, validate=False, **options)
        assert not load_lm(str(tmp_path / name), "onnx").lm.exact_batches, name


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_target_export_drafting_for_itself_has_every_token_accepted(targets, quant):
    engine = Engine.load(str(targets[quant]), draft=None)
    engine.eos_ids = frozenset()
    spec = engine.with_drafter(ModelDrafter(load_lm(str(targets[quant]), "onnx").lm), helper=None)
    for pipeline in ("off", "overlap", "branches"):
        for prompt in PROMPTS:
            result = spec.generate(prompt, GenerationConfig(max_new_tokens=32, num_draft_tokens=4, pipeline=pipeline))
            assert result.token_ids == target_only(engine, prompt, 32), (pipeline, prompt)
            assert result.stats.accepted_tokens == result.stats.drafted_tokens > 0, (pipeline, prompt)
