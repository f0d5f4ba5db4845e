import pytest

from mirrorsd.runtime.timeline import DRAFT, VERIFY, Timeline


def test_overlap_counts_each_intersection_once_whatever_the_order_spans_end():
    t = Timeline()
    t.add(VERIFY, 0.0, 1.0, "verify")
    t.add(DRAFT, 0.5, 1.5, "draft")  # 0.5 overlaps
    t.add(DRAFT, 1.6, 1.8, "draft")  # ends before the next verify begins... recorded first
    t.add(VERIFY, 1.7, 3.0, "verify")  # 0.1 with the draft above
    t.add(DRAFT, 2.0, 2.5, "draft")  # 0.5
    assert t.overlap == pytest.approx(1.1)
    assert t.busy[DRAFT] == pytest.approx(1.7) and t.busy[VERIFY] == pytest.approx(2.3)


def test_chrome_trace_has_a_lane_per_worker():
    t = Timeline()
    with t.span(DRAFT, "draft") as args:
        args["tokens"] = 3
    with t.span(VERIFY, "verify"):
        pass
    events = t.chrome_trace()["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"draft worker", "verify worker"}
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["tid"] for e in spans] == [1, 2] and spans[0]["args"] == {"tokens": 3}

