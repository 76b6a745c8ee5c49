"""The routing table's rule, ranges, lookup and key, with injected timings (no GPU, no torch)."""

from __future__ import annotations

import pytest

from sgl_kernel_sm120.policy import Route
from sglang_sm120.routing import table as tbl
from sglang_sm120.routing.table import NCCL, Point, parse_route, route_id, route_label

ONE = "sm120/ONESHOT/push/device"
TWO = "sm120/TWOSHOT/push/device"
ISL = "sm120/ISLAND/pull/device"


def points(nccl, **ours):
    """Points at rows 1..n of 7168 bf16 from per-candidate time lists (None: failed there)."""
    n = len(nccl)
    out = []
    for i in range(n):
        times = {NCCL: nccl[i]} if nccl[i] is not None else {}
        failed = {}
        for name, series in ours.items():
            cid = {"one": ONE, "two": TWO, "isl": ISL}[name]
            if series[i] is None:
                failed[cid] = "timed out"
            else:
                times[cid] = series[i]
        out.append(Point(rows=i + 1, nbytes=(i + 1) * 14336, times=times, failed=failed))
    return out


def ids(routes):
    return [route_id(r) for r in routes]


def test_a_candidate_that_beats_nccl_by_more_than_two_percent_at_every_size_serves_every_size():
    assert ids(tbl.choose(points([20, 21, 22, 23], one=[10, 11, 12, 13]))) == [ONE] * 4


def test_a_gain_below_two_percent_leaves_the_size_on_nccl():
    # 1.5% faster everywhere: never enough
    assert ids(tbl.choose(points([100, 100, 100], one=[98.5, 98.5, 98.5]))) == [NCCL] * 3


def test_exactly_two_percent_is_enough_and_a_tie_is_not():
    assert ids(tbl.choose(points([100, 100], one=[98.0, 98.0]))) == [ONE, ONE]
    assert ids(tbl.choose(points([100, 100], one=[100, 100]))) == [NCCL, NCCL]


def test_a_win_at_one_size_only_is_not_sustained():
    # wins only at rows 2: a run of one size
    assert ids(tbl.choose(points([10, 10, 10], one=[11, 5, 11]))) == [NCCL] * 3
    # and a win at the largest size only cannot be confirmed
    assert ids(tbl.choose(points([10, 10, 10], one=[11, 11, 5]))) == [NCCL] * 3


def test_ours_never_serves_a_measured_size_where_nccl_was_faster():
    # ours wins at small sizes, loses from rows 4 on, wins again at 6-7: NCCL keeps 4 and 5
    chosen = ids(tbl.choose(points([10, 10, 10, 10, 10, 10, 10], one=[5, 5, 5, 11, 12, 5, 5])))
    assert chosen == [ONE, ONE, ONE, NCCL, NCCL, ONE, ONE]


def test_a_failed_candidate_is_never_routed_to_and_breaks_its_run():
    chosen = ids(tbl.choose(points([10, 10, 10, 10], one=[5, None, 5, 5])))
    assert chosen == [NCCL, NCCL, ONE, ONE]


def test_without_an_nccl_time_no_candidate_is_routed():
    assert ids(tbl.choose(points([None, None], one=[1, 1]))) == [NCCL, NCCL]


def test_an_incumbent_of_ours_is_displaced_only_by_a_sustained_gain():
    # TWOSHOT is 5% faster than ONESHOT at rows 3 only: ONESHOT stays
    chosen = ids(tbl.choose(points([20] * 4, one=[10, 10, 10, 10], two=[12, 12, 9.5, 10.5])))
    assert chosen == [ONE] * 4
    # from rows 3 on it is faster at two consecutive sizes: it takes over there
    chosen = ids(tbl.choose(points([20] * 4, one=[10, 10, 10, 10], two=[12, 12, 9.5, 9.5])))
    assert chosen == [ONE, ONE, TWO, TWO]


def test_a_tie_between_two_of_ours_keeps_the_incumbent():
    chosen = ids(tbl.choose(points([20] * 4, one=[10, 10, 10, 10], two=[11, 10, 10, 10])))
    assert chosen == [ONE] * 4


def test_the_fastest_contender_takes_over_when_the_incumbent_falls_out():
    # ONESHOT fails from rows 3 on; ISLAND and TWOSHOT both beat NCCL there, ISLAND is faster
    chosen = ids(tbl.choose(points([20] * 4, one=[10, 10, None, None], two=[15, 15, 14, 14], isl=[16, 16, 12, 12])))
    assert chosen == [ONE, ONE, ISL, ISL]


def test_points_out_of_order_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        tbl.choose(list(reversed(points([1, 1], one=[1, 1]))))


def test_ranges_cover_from_one_byte_to_the_largest_point_and_merge_equal_routes():
    pts = points([10, 10, 10, 10], one=[5, 5, 11, 11])
    entries = tbl.ranges(pts, tbl.choose(pts), "bfloat16", "plain")
    assert [(e.low, e.high, route_id(e.route)) for e in entries] == [(1, 2 * 14336, ONE),
                                                                     (2 * 14336 + 1, 4 * 14336, NCCL)]


def test_sizes_between_an_nccl_point_and_one_of_ours_stay_on_nccl():
    pts = points([10, 10, 10, 10], one=[11, 11, 5, 5])
    entries = tbl.ranges(pts, tbl.choose(pts), "bfloat16", "plain")
    assert [(e.low, e.high, route_id(e.route)) for e in entries] == [(1, 3 * 14336 - 1, NCCL),
                                                                     (3 * 14336, 4 * 14336, ONE)]


def _table(nccl, one, kind="plain", dtype="bfloat16"):
    return tbl.RoutingTable.from_points(
        key=key(), measured="2026-12-03T00:00:00Z", workload={"hidden": 7168, "max_bytes": len(nccl) * 14336},
        measurements={(dtype, kind): points(nccl, one=one)},
    )


def test_lookup_routes_each_size_as_chosen_and_nothing_past_the_largest_point():
    table = _table([10, 10, 10, 10], [5, 5, 11, 11])
    assert route_id(tbl.lookup(table, 16, "bfloat16", False)) == ONE
    assert route_id(tbl.lookup(table, 2 * 14336, "bfloat16", False)) == ONE
    assert tbl.lookup(table, 2 * 14336 + 2, "bfloat16", False) is None  # NCCL won there
    assert tbl.lookup(table, 4 * 14336 + 2, "bfloat16", False) is None  # not covered: NCCL too
    assert tbl.lookup(table, 16, "float16", False) is None  # not measured
    assert tbl.lookup(table, 16, "bfloat16", True) is None


def test_the_table_survives_its_json_form():
    table = _table([10, 10, 10], [5, 5, None], kind="fused")
    again = tbl.RoutingTable.from_dict(table.to_dict())
    assert again.to_dict() == table.to_dict() and again.digest() == table.digest()
    assert again.measurements[("bfloat16", "fused")][2].failed == {ONE: "timed out"}


@pytest.mark.parametrize("text", [
    "sm120/ONESHOT/push", "sm120/FOURSHOT/push/device", "sm120/ONESHOT/carrier/device", "sm120/ONESHOT/push/gpu",
    "sm120/TWOSHOT/push/device/c8", "sm120/ONESHOT/push/device/c3", "gloo", "sm120/ONESHOT/push/device/c4/b8",
    "sm120/ONESHOT/push/device/t100", "ONESHOT/push/device",
])
def test_a_malformed_route_is_refused(text):
    with pytest.raises(tbl.TableError):
        parse_route(text)


def test_route_ids_round_trip():
    routes = (None, Route("ISLAND", "staged", "device"), Route("ONESHOT", "push", "host", ctas=8),
              Route("ONESHOT", "pull", "device", ctas=94, cluster=4), Route("TWOSHOT", "push", "device", threads=256))
    for route in routes:
        assert parse_route(route_id(route)) == route
    assert route_id(Route("ONESHOT", "push", "device", ctas=188, cluster=4)) == "sm120/ONESHOT/push/device/b188/c4"
    assert route_label(Route("ONESHOT", "push", "device", cluster=4)) == "ONESHOT/push/device/c4"
    assert route_label(None) == "NCCL" and route_id(None) == NCCL


def key(**changes):
    local = [{"uuid": f"GPU-{r}", "pci_bus_id": f"0000:0{r}:00.0", "name": "RTX PRO 6000", "driver": "580.1",
              "cuda": "13.0", "torch": "2.14.1", "nccl": "2.27.3", "sglang_sm120": "0.1.0", "kernels": "lib:1:2"}
             for r in range(2)]
    made = tbl.make_key(local, islands=None, p2p=[[True, True], [True, True]], memory="device")
    made.update(changes)
    return made


def test_keys_differing_in_a_version_are_other_versions_and_in_the_box_another_key():
    assert tbl.compare_keys(key(), key()) is None
    what, detail = tbl.compare_keys(key(), key(driver="570.9"))
    assert what == "other versions" and "driver '570.9' -> '580.1'" in detail
    what, detail = tbl.compare_keys(key(), key(memory="host"))
    assert what == "another key" and "memory 'host' -> 'device'" in detail
    other_gpu = key()
    other_gpu["gpus"] = [dict(other_gpu["gpus"][0]), {**other_gpu["gpus"][1], "uuid": "GPU-x"}]
    assert tbl.compare_keys(key(), other_gpu) == ("another key", "gpus of ranks [1] differ")


def test_a_version_that_differs_between_ranks_is_kept_as_both():
    local = [{"uuid": "a", "driver": "1"}, {"uuid": "b", "driver": "2"}]
    assert tbl.make_key(local, islands=None, p2p=None, memory="host")["driver"] == "1 | 2"


def test_coverage_needs_the_hidden_size_and_every_kind_not_the_largest_size():
    table = _table([10, 10], [5, 5])
    assert table.coverage_gap("bfloat16", 7168, kinds=("plain",)) is None
    assert "hidden 7168, this server has hidden 4096" in table.coverage_gap("bfloat16", 4096, kinds=("plain",))
    assert table.coverage_gap("bfloat16", 7168) == "no bfloat16 fused routes"
    # sizes past the largest measured one are NCCL's, and the table still serves the others
    assert tbl.lookup(table, 28673, "bfloat16", False) is None and tbl.lookup(table, 28672, "bfloat16", False)


def test_the_verify_size_compares_the_chosen_route_with_nccl():
    table = _table([20, 20, 10], [10, 10, 30])
    route, ours, nccl = table.versus_nccl("bfloat16", "plain", 1)
    assert route_id(route) == ONE and (ours, nccl) == (10.0, 20.0)
    assert table.versus_nccl("bfloat16", "plain", 3) == (None, None, 10.0)  # NCCL won there
    assert table.versus_nccl("bfloat16", "plain", 4) == (None, None, None)  # not measured


def test_describe_lists_the_ranges_in_words():
    table = _table([10, 10, 10, 10], [5, 5, 11, 11])
    assert tbl.describe(table, "bfloat16", "plain") == "ONESHOT/push/device up to 28672 B, NCCL up to 57344 B"
    assert tbl.describe(table, "bfloat16", "plain", up_to=20000) == "ONESHOT/push/device up to 20000 B"


def test_sizes_between_two_measured_points_are_ours_only_where_both_chose_the_same_route_of_ours():
    # rows 1, 2, 4, 8 measured (a quick ladder): ONESHOT at 1-2, TWOSHOT at 4-8
    rows = (1, 2, 4, 8)
    times = {1: (5, 9), 2: (5, 9), 4: (9, 5), 8: (9, 5)}
    pts = [Point(r, r * 14336, {NCCL: 10.0, ONE: float(times[r][0]), TWO: float(times[r][1])}) for r in rows]
    entries = tbl.ranges(pts, tbl.choose(pts), "bfloat16", "plain")
    assert [(e.low, e.high, route_id(e.route)) for e in entries] == [
        (1, 2 * 14336, ONE),  # below the first point, the first point, and between two ONESHOT points
        (2 * 14336 + 1, 4 * 14336 - 1, NCCL),  # 3 rows: its neighbours chose different routes
        (4 * 14336, 8 * 14336, TWO),  # 5-7 rows: both neighbours TWOSHOT
    ]


def test_a_table_rederived_from_its_measurements_drops_a_hand_edit_and_the_blamed():
    table = _table([10, 10, 10, 10], [5, 5, 5, 5])
    edited = tbl.RoutingTable.from_dict({**table.to_dict(), "entries": [
        {"dtype": "bfloat16", "kind": "plain", "low": 1, "high": 4 * 14336, "route": NCCL}]})
    assert tbl.lookup(edited, 14336, "bfloat16", False) is None
    again = edited.rederived()
    assert route_id(tbl.lookup(again, 14336, "bfloat16", False)) == ONE
    assert tbl.route_differences(edited, again) == (
        "bfloat16 plain: stored NCCL up to 57344 B; from its measurements ONESHOT/push/device up to 57344 B")
    assert tbl.route_differences(table, table.rederived()) == ""
    blamed = table.rederived([{"dtype": "bfloat16", "kind": "plain", "candidate": ONE, "from_bytes": 3 * 14336,
                               "reason": "exit code -9 while running it"}])
    assert tbl.describe(blamed, "bfloat16", "plain") == "ONESHOT/push/device up to 28672 B, NCCL up to 57344 B"
    point = blamed.measurements[("bfloat16", "plain")][2]
    assert ONE not in point.times and point.failed[ONE] == "blamed: exit code -9 while running it"


def test_the_launch_facts_are_part_of_the_key():
    local = [{"uuid": "GPU-0", "driver": "580"}, {"uuid": "GPU-1", "driver": "580"}]
    four = tbl.make_key(local, islands=None, p2p=None, memory="device",
                        launch={"clusters": [2, 4], "sm_budget": 188, "pdl": True, "switches": {}})
    none = tbl.make_key(local, islands=None, p2p=None, memory="device",
                        launch={"clusters": [], "sm_budget": 188, "pdl": True, "switches": {}})
    kind, what = tbl.compare_keys(four, none)
    assert kind == "another key" and what.startswith("launch ")
    assert tbl.compare_keys(four, dict(four)) is None


@pytest.mark.parametrize("change, why", [
    ({"low": 0}, "1 <= low <= high"), ({"low": 9, "high": 8}, "1 <= low <= high"), ({"kind": "both"}, "a kind of"),
    ({"dtype": "float32"}, "a dtype of"), ({"route": "gloo"}, "bad route 'gloo'"), ({"high": None}, "bad entry"),
])
def test_an_entry_that_breaks_the_tables_rules_is_refused(change, why):
    doc = _table([10, 10], [5, 5]).to_dict()
    doc["entries"][0].update(change)
    with pytest.raises(tbl.TableError, match=why):
        tbl.RoutingTable.from_dict(doc)


def test_overlapping_entries_are_refused():
    doc = _table([10, 10], [5, 5]).to_dict()
    doc["entries"].append({**doc["entries"][0], "low": doc["entries"][0]["high"]})
    with pytest.raises(tbl.TableError, match="overlapping bfloat16 plain entries"):
        tbl.RoutingTable.from_dict(doc)
