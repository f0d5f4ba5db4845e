"""pipeline="auto"'s calibration kept across processes (runtime/decode/policy/calibrate.py: CalibrationStore)."""

from __future__ import annotations

import json
import os

import pytest

from mirrorsd import Engine
from mirrorsd.devices import machine_id
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.decode.policy.calibrate import CalibrationStore, Costs
from mirrorsd.runtime.decode.pipeline.threads import CoreLayout
from mirrorsd.runtime.drafters import ModelDrafter


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The default place: calibrations.json in the cache folder (the suite's own file set aside)."""
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    monkeypatch.delenv("MIRRORSD_CALIBRATIONS", raising=False)
    return tmp_path / "calibrations.json"


def load(folder) -> Engine:
    return Engine.load(str(folder), draft=str(folder), backend="torch", device="cpu", dtype="float32")


def test_a_calibration_is_measured_once_and_reused_by_a_later_engine(cache, tiny_folder):
    first = load(tiny_folder)
    costs = first.calibration(4)
    entries = json.loads(cache.read_text())
    assert len(entries) == 1 and Costs.from_dict(next(iter(entries.values()))) == costs
    first.close()

    later = load(tiny_folder)  # as a later process would: a fresh engine, the same models and placement
    assert later.calibration(4) == costs  # read back: a new measurement would not repeat every float
    other_k = later.calibration(3)  # another K is another calibration
    assert other_k.k == 3 and len(json.loads(cache.read_text())) == 2
    if len(os.sched_getaffinity(0)) >= 2:
        later.cores = CoreLayout.first_two()
        assert later.calibration(4) != costs  # another placement: measured afresh, kept under its own key
        assert len(json.loads(cache.read_text())) == 3
    later.close()


def test_mirrorsd_calibrations_names_another_file(cache, tiny_folder, monkeypatch):
    elsewhere = cache.parent / "elsewhere" / "costs.json"
    monkeypatch.setenv("MIRRORSD_CALIBRATIONS", str(elsewhere))
    engine = load(tiny_folder)
    engine.calibration(4)
    assert len(json.loads(elsewhere.read_text())) == 1 and not cache.exists()
    engine.close()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"x": 1}'])
def test_an_unreadable_store_is_measured_afresh_and_rewritten(cache, tiny_folder, content):
    cache.write_text(content)
    engine = load(tiny_folder)
    costs = engine.calibration(4)
    entries = json.loads(cache.read_text())
    assert Costs.from_dict(entries[CalibrationStore.key(engine.calibrated.pair_id, CoreLayout(), 4, machine_id())]) == costs
    with pytest.deprecated_call():  # the old spelling reads the same measurements
        assert engine.calibrations is engine.calibrated.costs
    engine.close()


def test_an_entry_that_is_not_a_calibration_is_measured_afresh(cache, tiny_folder):
    engine = load(tiny_folder)
    key = CalibrationStore.key(engine.calibrated.pair_id, CoreLayout(), 4, machine_id())
    for bad in ({"k": 4}, {"k": 4, "verify_s": -1.0, "draft_token_s": 0.1, "verify_shared_s": 0.1,
                           "draft_token_shared_s": 0.1}, "text", None):
        cache.write_text(json.dumps({key: bad}))
        engine.calibrated.costs.clear()
        costs = engine.calibration(4)
        assert min(costs.verify_s, costs.draft_token_s, costs.verify_shared_s, costs.draft_token_shared_s) > 0
        assert Costs.from_dict(json.loads(cache.read_text())[key]) == costs
    engine.close()


def test_an_engine_built_from_objects_keeps_its_calibration_to_itself(cache, target_model, other_model, tokenizer):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.calibration(4)
    assert engine.calibrated.store is None and not cache.exists()


def test_a_read_only_cache_costs_a_calibration_not_the_request(cache, tiny_folder, caplog):
    engine = load(tiny_folder)
    engine.calibrated.store = CalibrationStore(cache / "inside-a-file" / "calibrations.json")
    cache.write_text("{}")  # a file where the store's folder should be
    assert engine.calibration(4).k == 4
    assert "could not keep the calibration" in caplog.text
    engine.close()


def test_the_verify_curve_is_measured_before_a_request_starts_and_kept_across_engines(cache, tiny_folder):
    from mirrorsd import GenerationConfig
    from mirrorsd.runtime.decode.policy import verify_curve

    engine = load(tiny_folder)
    stream = engine.stream("The quick brown fox", GenerationConfig(max_new_tokens=4))
    curve = verify_curve.known(engine.target)  # measured by stream(), before the request's first step
    key = CalibrationStore.key(engine.calibrated.target_id, CoreLayout(), verify_curve.STORE_KEY, machine_id())  # the target's alone
    assert curve is not None and curve[0] == 1.0 and tuple(json.loads(cache.read_text())[key]) == curve
    stream.close()
    engine.close()

    kept = (1.0,) + tuple(1.0 + k / 7 for k in range(1, len(curve)))  # no measurement gives these
    cache.write_text(json.dumps({key: list(kept)}))
    later = load(tiny_folder)  # as a later process would: the curve is read back, not measured
    later.prepare()
    assert verify_curve.known(later.target) == kept
    for bad in ([2.0, 1.0], [1.0, -1.0], "text", [1.0, True]):  # not a curve: measured afresh and rewritten
        cache.write_text(json.dumps({key: bad}))
        again = load(tiny_folder)
        again.prepare()
        assert verify_curve.known(again.target) != kept and json.loads(cache.read_text())[key] != bad
        again.close()
    later.close()


def test_a_model_free_drafter_reads_the_targets_curve_back_too(cache, tiny_folder):
    """The curve is the target's: an engine with the n-gram drafter keeps it and reads it back across processes
    (it measured it on every first request: a second of a cached model's first answer)."""
    from mirrorsd import Engine
    from mirrorsd.runtime.decode.policy import verify_curve

    first = Engine.load(target=str(tiny_folder), draft="ngram", dtype="float32")
    first.prepare()
    key = CalibrationStore.key(first.calibrated.target_id, CoreLayout(), verify_curve.STORE_KEY, machine_id())
    assert tuple(json.loads(cache.read_text())[key]) == verify_curve.known(first.target)
    first.close()
    kept = (1.0,) + tuple(1.0 + k / 9 for k in range(1, 17))
    cache.write_text(json.dumps({key: list(kept)}))
    later = Engine.load(target=str(tiny_folder), draft="ngram", dtype="float32")
    later.prepare()
    assert verify_curve.known(later.target) == kept
    later.close()
