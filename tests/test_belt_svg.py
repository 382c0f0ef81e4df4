"""
The belt as a picture (tools/belt_svg.py), parsed back: every stay drawn where and as long as the
step reports say it was, in its own colour, a preempted one cut where it was; and the bench
(tools/bench.py): its warm-up, and the times of its steps.
"""
import dataclasses
import random
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import torch

import nanobatch
from nanobatch import generate
from tests.common import MAX_LEN, random_workload, tiny_gpt
from tests.test_schedule import RUNS, corners, served
from tests.test_figures import SCHEDULE, SERVED  # the schedule worked by hand, whose step times bench reads
import belt_svg  # noqa: E402 (tools/, put on the path by tests.common)
import bench  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The belt as a picture: every stay drawn where and as long as it was, in its own colour


SVG = "{http://www.w3.org/2000/svg}"  # ElementTree names SVG's elements by namespace


def stay(request, slot, first_step, first_token_step, last_step, preempted_at=None):
    """A stay worked by hand: request in slot from first_step to last_step, no token yet before
    first_token_step (hatched), and, if preempted_at, sent back to the queue at that step."""
    return SimpleNamespace(request=request, slot=slot, first=first_step, first_token_step=first_token_step,
                           last=last_step, preempted_at=preempted_at)


def reported(n_slots, stays):
    """The step reports of a belt on which these stays happened -> a stand-in for each StepReport,
    one a step from 0 to the last stay's end: what belt_svg reads (step, occupants, belt, preempted,
    admitted, found_cached: none found here)."""
    n_steps = max(s.last for s in stays) + 1
    reports = [SimpleNamespace(step=step, occupants=[None] * n_slots, belt=["."] * n_slots, preempted=[], admitted=[],
                               found_cached=[]) for step in range(n_steps)]
    for s in stays:
        reports[s.first].admitted.append(s.request)
        reports[s.first].found_cached.append(0)
        for report in reports[s.first:s.last + 1]:
            assert report.occupants[s.slot] is None, f"two stays by hand in slot {s.slot} at step {report.step}"
            report.occupants[s.slot] = s.request
            report.belt[s.slot] = "~" if report.step < s.first_token_step else nanobatch.letter(s.request)
        if s.preempted_at is not None:
            reports[s.preempted_at].preempted.append(s.request)
    for report in reports:
        report.belt = "".join(report.belt)
    return reports


def headline(n_steps):
    return {"steps": n_steps, "tokens/s": 49.3, "TTFT P50/P99 (steps)": (6, 11)}


# Six requests on a belt of 3 slots, the last never taken in (still queued: not drawn): B and D
# spend steps prefilling only.
CONTINUOUS = [stay(0, 0, 0, 0, 4), stay(1, 1, 0, 2, 9), stay(2, 2, 0, 0, 2), stay(3, 2, 3, 5, 7), stay(4, 0, 5, 5, 6)]
STATIC = [stay(0, 0, 0, 0, 4), stay(1, 1, 0, 2, 9), stay(2, 2, 0, 0, 2), stay(3, 0, 10, 12, 14), stay(4, 1, 10, 10, 11)]
# Part 3, paged: B is preempted at step 4 (its slot empty in that step), and is taken in again at
# step 5 into A's slot, where it feeds its prompt and answer again (steps 5-6) before its next token.
PREEMPTED = [stay(0, 0, 0, 0, 4), stay(1, 1, 0, 1, 3, preempted_at=4), stay(2, 2, 0, 0, 5), stay(1, 0, 5, 7, 9),
             stay(3, 1, 5, 5, 8), stay(4, 2, 6, 6, 7)]
BY_HAND = {"continuous": CONTINUOUS, "static": STATIC, "paged": PREEMPTED}  # each on 3 slots, request 5 queued
BELTS = [("continuous", 3, reported(3, CONTINUOUS), headline(10), None),
         ("static", 3, reported(3, STATIC), headline(15), None)]


def drawn_panels(svg):
    """The SVG parsed back -> per panel: (its px per step, {request: its stays' bars, in step order},
    {request: its prefill marks}). Parsing is the first check: a browser shows nothing of a
    malformed file."""
    panels = []
    for group in ET.fromstring(svg).iter(f"{SVG}g"):
        if group.get("class") == "panel":
            def by_request(kind):
                rects = {}
                for r in group.iter(f"{SVG}rect"):
                    if r.get("class") == kind:
                        rects.setdefault(int(r.get("data-request")), []).append(r)
                return {i: sorted(bars, key=lambda r: float(r.get("x"))) for i, bars in rects.items()}
            panels.append((float(group.get("data-step-width")), by_request("stay"), by_request("prefill")))
    return panels


def check_stays(svg, belts):
    """Per panel: exactly one bar per stay worked by hand (belts: [(title, stays)]), on its slot's row,
    from its first step, as long as its stay, never over another in its slot; a hatched mark over
    exactly its prefill-only steps."""
    panels = drawn_panels(svg)
    assert len(panels) == len(belts)
    assert len({step_w for step_w, _, _ in panels}) == 1, "panels on different step scales"
    for (title, by_hand), (step_w, drawn, drawn_marks) in zip(belts, panels):
        # 1) Which: a bar per stay, and no other; hatched, the stays that spent steps prefilling.
        stays_of = {}
        for s in sorted(by_hand, key=lambda s: s.first):
            stays_of.setdefault(s.request, []).append(s)
        assert {i: len(bars) for i, bars in drawn.items()} == {i: len(s) for i, s in stays_of.items()}, \
            f"{title}: bars per request {drawn}, stays by hand {stays_of}"
        bars = [(s, bar) for i in stays_of for s, bar in zip(stays_of[i], drawn[i])]
        prefilling = {i: sum(s.first_token_step > s.first for s in stays) for i, stays in stays_of.items()}
        assert {i: len(marks) for i, marks in drawn_marks.items()} == {i: n for i, n in prefilling.items() if n}, \
            f"{title}: marks {drawn_marks}, stays prefilling {prefilling}"
        # 2) Where: each slot on a row of its own, each bar from its first step (step 0 at one x).
        row_of_slot, step_0_at = {}, set()
        for s, bar in bars:
            y = row_of_slot.setdefault(s.slot, bar.get("y"))
            assert bar.get("y") == y, f"{title}: slot {s.slot} drawn on two rows"
            assert (int(bar.get("data-slot")), int(bar.get("data-first"))) == (s.slot, s.first)
            step_0_at.add(round(float(bar.get("x")) - s.first * step_w, 1))
        assert len(set(row_of_slot.values())) == len(row_of_slot), f"{title}: two slots on one row"
        assert len(step_0_at) == 1, f"{title}: bars not at their first steps, step 0 at x = {step_0_at}"
        # 3) How long: a stay of n steps is n step-widths; a mark covers the prefill-only steps.
        for s, bar in bars:
            width, n_steps = float(bar.get("width")), s.last - s.first + 1
            assert width == pytest.approx(n_steps * step_w, abs=0.02), \
                f"{title}: request {s.request}'s bar is {width / step_w:.2f} steps long, its stay {n_steps}"
            assert int(bar.get("data-last")) == s.last
        for i, marks in drawn_marks.items():
            for (s, bar), mark in zip([(s, bar) for s, bar in bars if s.request == i and s.first_token_step > s.first],
                                      marks):
                assert (mark.get("x"), mark.get("y")) == (bar.get("x"), bar.get("y")), f"request {i}'s mark"
                n_prefill_steps = s.first_token_step - s.first
                assert float(mark.get("width")) == pytest.approx(n_prefill_steps * step_w, abs=0.02), f"request {i}"
        # 4) No two bars on top of each other in a slot.
        for slot in row_of_slot:
            in_slot = sorted((float(bar.get("x")), float(bar.get("width")), s.request) for s, bar in bars
                             if s.slot == slot)
            for (x, width, i), (next_x, _, j) in zip(in_slot, in_slot[1:]):
                assert x + width <= next_x + 0.02, f"{title}: requests {i} and {j} overlap in slot {slot}"


def test_belt_svg_draws_every_stay():
    """Two runs of six requests, by hand: each bar where and as long as its stay, nothing for the
    request never taken in, the headline figures in the titles."""
    svg = belt_svg.belt_svg(BELTS)
    check_stays(svg, [("continuous", CONTINUOUS), ("static", STATIC)])
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("font-weight") == "bold"]
    assert titles == ["continuous, 3 slots: 10 steps, 49.3 tokens/s, TTFT P50 6 steps",
                      "static, 3 slots: 15 steps, 49.3 tokens/s, TTFT P50 6 steps"], titles
    assert "preempted" not in svg, "a preemption's mark, or its legend line, on a belt without one"


def test_belt_svg_one_colour_per_request():
    """A colour names a request: the same in every panel, and different for each of the six."""
    panels = drawn_panels(belt_svg.belt_svg(BELTS))
    fills = [{i: bar.get("fill") for i, bars in drawn.items() for bar in bars} for _, drawn, _ in panels]
    assert fills[0] == fills[1], fills
    assert len(set(fills[0].values())) == len(fills[0]), fills[0]


def test_belt_svg_a_preempted_stay():
    """Part 3, by hand: B preempted at step 4 in slot 1 is two bars: steps 0-3 in slot 1, ending in the
    preemption's dark red edge, and steps 5-9 in slot 0, its first two steps hatched (its prompt and
    answer going in again); its tooltips say so; the legend says what the edge means."""
    svg = belt_svg.belt_svg([("paged", 3, reported(3, PREEMPTED), headline(10), None)])
    check_stays(svg, [("paged", PREEMPTED)])
    (step_w, bars, _), = drawn_panels(svg)
    cut, back = bars[1]
    edges = [r for r in ET.fromstring(svg).iter(f"{SVG}rect") if r.get("class") == "preempted"]
    assert [(int(e.get("data-request")), int(e.get("data-step"))) for e in edges] == [(1, 4)], "one edge, B's at step 4"
    edge, = edges
    assert (edge.get("y"), edge.get("fill")) == (cut.get("y"), belt_svg.PREEMPTED_COLOUR)
    edge_end, stay_end = float(edge.get("x")) + float(edge.get("width")), float(cut.get("x")) + 4 * step_w
    assert edge_end == pytest.approx(stay_end, abs=0.02), "the edge is not at the end of B's first stay, over step 3"
    stays_of_b = [g for g in ET.fromstring(svg).iter(f"{SVG}g")
                  if g.find(f"{SVG}rect") is not None and g.find(f"{SVG}rect").get("data-request") == "1"]
    tips = {g.find(f"{SVG}rect").get("data-first"): g.find(f"{SVG}title").text for g in stays_of_b}
    assert tips == {"0": "request B, slot 1: steps 0-3, 3 tokens; no token yet in steps 0-0: its prompt not all in; "
                         "preempted at step 4: its blocks freed, back to the head of the queue",
                    "5": "request B, slot 0: steps 5-9, 3 tokens; no token yet in steps 5-6: its prompt and answer "
                         "going in again"}, tips
    assert any(t.text.startswith("preempted: its blocks freed") for t in ET.fromstring(svg).iter(f"{SVG}text"))


def check_against_reports(svg, reports):
    """Cell by cell, a belt drawn from a real run: the bars cover exactly the (slot, step) cells that the
    reports' occupants fill, each with its occupant's bar, never two; the hatched marks exactly the
    cells whose belt character is '~'; an edge for each request a report preempted, at that step; a mark
    for each admission that found positions cached (Part 4), at that step, with as many positions."""
    root = ET.fromstring(svg)
    (step_w, bars, marks), = drawn_panels(svg)
    step_0_x, row_h = belt_svg.LEFT, float(next(r for r in root.iter(f"{SVG}rect") if r.get("class") == "stay")
                                           .get("height")) + 1

    def cells(rect):
        first = round((float(rect.get("x")) - step_0_x) / step_w)
        slot = round((float(rect.get("y")) - belt_svg.TITLE_H) / row_h)
        return [(slot, step) for step in range(first, first + round(float(rect.get("width")) / step_w))]

    drawn, hatched = {}, set()
    for i, rects in bars.items():
        for rect in rects:
            for cell in cells(rect):
                assert cell not in drawn, f"two bars over slot {cell[0]} at step {cell[1]}"
                drawn[cell] = i
    for rects in marks.values():
        hatched.update(cell for rect in rects for cell in cells(rect))
    occupied = {(slot, r.step): i for r in reports for slot, i in enumerate(r.occupants) if i is not None}
    assert drawn == occupied, f"drawn but not recorded {sorted(drawn.items() - occupied.items())[:5]}, " \
                              f"recorded but not drawn {sorted(occupied.items() - drawn.items())[:5]}"
    assert hatched == {(slot, r.step) for r in reports for slot, c in enumerate(r.belt) if c == "~"}
    edges = sorted((int(e.get("data-request")), int(e.get("data-step"))) for e in root.iter(f"{SVG}rect")
                   if e.get("class") == "preempted")
    assert edges == sorted((i, r.step) for r in reports for i in r.preempted)
    found = sorted((int(e.get("data-request")), int(e.get("data-step")), int(e.get("data-found")))
                   for e in root.iter(f"{SVG}rect") if e.get("class") == "found")
    assert found == sorted((i, r.step, n) for r in reports for i, n in zip(r.admitted, r.found_cached) if n)
    for mark in root.iter(f"{SVG}rect"):  # at the left end of its stay's bar, on its row
        if mark.get("class") == "found":
            bar = next(b for b in bars[int(mark.get("data-request"))]
                       if round((float(b.get("x")) - step_0_x) / step_w) == int(mark.get("data-step")))
            assert (mark.get("x"), mark.get("y")) == (bar.get("x"), bar.get("y")), "a found mark off its stay's start"


def test_belt_svg_of_a_paged_run_is_its_reports():
    """A real paged run on a pool too small for its requests, preempted several times: every cell of
    the belt is its recorded occupant, each preemption an edge."""
    requests = random_workload(seed=3, n_requests=7)
    reports = []
    generate(tiny_gpt(), requests, n_slots=3, max_len=MAX_LEN, eos_id=None, on_step=reports.append, prefill_chunk=5,
             kv_blocks=5, kv_block_size=8)
    assert sum(len(r.preempted) for r in reports) >= 2, "the pool is ample: no preemption to draw"
    comebacks = {i for r in reports for i in r.preempted}
    moved = {i for i in comebacks if len({slot for r in reports for slot, j in enumerate(r.occupants) if j == i}) > 1}
    assert moved, "no preempted request came back in another slot"
    check_against_reports(belt_svg.belt_svg([("paged", 3, reports, headline(len(reports)), None)]), reports)


def test_belt_svg_of_a_prefix_cache_run_is_its_reports():
    """Part 4, a real run with a prefix cache, its prompts after one shared system prompt: every admission
    that found positions cached has a mark at the start of its stay, as many positions in its data and its
    tooltip, and the legend says what the mark means."""
    requests = random_workload(seed=3, n_requests=7)
    system = list(range(1, 17))  # two blocks of 8 positions
    requests = [dataclasses.replace(r, prompt=system + r.prompt[:8]) for r in requests]
    reports = []
    generate(tiny_gpt(), requests, n_slots=3, max_len=MAX_LEN, eos_id=None, on_step=reports.append, prefill_chunk=5,
             kv_blocks=12, kv_block_size=8, prefix_cache=True)
    assert sum(n > 0 for r in reports for n in r.found_cached) >= 3, "too few admissions found the system prompt"
    svg = belt_svg.belt_svg([("prefix cache", 3, reports, headline(len(reports)), None)])
    check_against_reports(svg, reports)
    tips = [g.find(f"{SVG}title").text for g in ET.fromstring(svg).iter(f"{SVG}g")  # a stay's group: its title first
            if g.find(f"{SVG}title") is not None and any(r.get("class") == "found" for r in g.findall(f"{SVG}rect"))]
    assert tips and all("found in the prefix cache, not fed again" in tip for tip in tips), tips
    texts = [t.text or "" for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert any(text.startswith("found: its admission found positions") for text in texts), "no legend for the mark"


def test_belt_svg_of_several_preemptions_in_one_step(gpt):
    """A real paged run in which two requests are preempted in the same step, twice, one of them (its
    prompt waiting for the budget) holding no block yet and so all hatched: every cell is its recorded
    occupant, and each preempted stay, both of a step's, ends in its edge at the end of its bar, its
    tooltip naming the step; no other stay says it was preempted."""
    requests, options, _ = RUNS["paged, several preempted in a step, one with no block yet"]
    _, reports = served(gpt, requests, max_len=MAX_LEN, **options)
    several = [report for report in reports if len(report.preempted) >= 2]
    assert len(several) >= 2 and "a request with no block yet preempted" in corners(reports, options["kv_block_size"])
    svg = belt_svg.belt_svg([("paged", options["n_slots"], reports, headline(len(reports)), None)])
    check_against_reports(svg, reports)
    root = ET.fromstring(svg)
    edges = {(int(e.get("data-request")), int(e.get("data-step"))): e for e in root.iter(f"{SVG}rect")
             if e.get("class") == "preempted"}
    stays = [g for g in root.iter(f"{SVG}g") if g.find(f"{SVG}rect") is not None
             and g.find(f"{SVG}rect").get("class") == "stay"]
    preempted_at = {}  # (request, the last step of the stay that the preemption ended) -> the step preempting it
    for before, report in zip(reports, reports[1:]):
        for i in report.preempted:
            assert i in before.occupants, f"step {report.step}: {i} preempted from no slot"
            preempted_at[i, before.step] = report.step
    for g in stays:
        bar, tip = g.find(f"{SVG}rect"), g.find(f"{SVG}title").text
        i, last = int(bar.get("data-request")), int(bar.get("data-last"))
        if (i, last) not in preempted_at:
            assert "preempted" not in tip, tip
            continue
        step = preempted_at.pop((i, last))
        assert tip.endswith(f"; preempted at step {step}: its blocks freed, back to the head of the queue"), tip
        edge = edges.pop((i, step))
        assert (edge.get("y"), edge.get("fill")) == (bar.get("y"), belt_svg.PREEMPTED_COLOUR)
        assert float(edge.get("x")) + float(edge.get("width")) == \
            pytest.approx(float(bar.get("x")) + float(bar.get("width")), abs=0.02), f"{i}'s edge off its bar's end"
    assert preempted_at == {} and edges == {}, f"preemptions without a stay {preempted_at}, edges without one {edges}"


def test_belt_svg_64_slots_300_steps():
    """A busy belt, 64 slots for 300 steps: it still parses, every stay is drawn, and every bar fits
    inside the picture. The run is cut short at step 299: stays still open then end there."""
    rng, by_hand = random.Random(0), []
    for slot in range(64):  # stays one after another, now and then an idle step between
        step = rng.randrange(5)
        while step + (length := rng.randint(1, 40)) <= 300:
            n_prefill_steps = min(rng.choice([0, 0, 1, 3]), length - 1)
            by_hand.append(stay(len(by_hand), slot, step, step + n_prefill_steps, step + length - 1))
            step += length + rng.randrange(3)
    n_steps = max(s.last for s in by_hand)  # the last step not reported: the run stopped before it
    reports = reported(64, by_hand)[:n_steps]
    by_hand = [s for s in by_hand if s.first < n_steps]
    for s in by_hand:  # a stay still open at the end ends with the last report
        s.last = min(s.last, n_steps - 1)
        s.first_token_step = min(s.first_token_step, s.last + 1)
    belts = [("continuous", 64, reports, headline(300), None)]
    svg = belt_svg.belt_svg(belts)
    check_stays(svg, [("continuous", by_hand)])
    check_against_reports(svg, reports)
    width = float(ET.fromstring(svg).get("width"))
    _, bars, _ = drawn_panels(svg)[0]
    assert max(float(bar.get("x")) + float(bar.get("width")) for bars_of in bars.values() for bar in bars_of) <= width


def test_belt_svg_groups_and_step_durations():
    """Two groups: the two belts above, then one run given its step durations. Each group has a step
    scale of its own, its longest run spanning the width: (1200 - 44 - 16) / 15 = 76 px a step for
    the first, (1200 - 44 - 16 - 40) / 10 = 110 for the second, which leaves 40 px for the scale of
    its durations. The run with durations gets a bar per step reported, at that step, as tall as its
    share of the group's longest step (40 px), grey where no request decoded; the runs without get
    none."""
    times = [(0, 0.1, False), (1, 0.4, True), (2, 0.2, True), (4, 0.05, True)]  # no step 3: the clock jumped
    summary = {**headline(10), "TBT P50/P99 (ms)": (5.0, 123.0)}
    svg = belt_svg.belt_svg(BELTS, [("long prompts", 3, reported(3, CONTINUOUS), summary, times)])
    assert [step_w for step_w, _, _ in drawn_panels(svg)] == [76, 76, 110]
    panels = [group for group in ET.fromstring(svg).iter(f"{SVG}g") if group.get("class") == "panel"]
    bars = [[r for r in panel.iter(f"{SVG}rect") if r.get("class") == "step-time"] for panel in panels]
    assert [len(b) for b in bars] == [0, 0, 4]
    assert [(int(r.get("data-step")), float(r.get("x")), float(r.get("height"))) for r in bars[2]] == \
        [(0, 44, 10), (1, 154, 40), (2, 264, 20), (4, 484, 5)]
    assert [r.get("fill") for r in bars[2]] == ["#bbb"] + [belt_svg.STEP_COLOUR] * 3  # step 0 decoded nothing
    texts = [t.text for t in panels[2].iter(f"{SVG}text")]
    assert "400 ms" in texts and texts[0].endswith("TBT P99 123 ms"), texts


class Stop(Exception):
    """Ends a run once the test has seen what it looks at."""


def test_bench_warms_each_way_of_serving_up_before_timing_it(monkeypatch):
    """Before its first timed run, the bench serves two short requests, untimed, in each way it is
    about to time (slots, policy, prompt budget, worker): a first call's set-up (cuBLAS, kernels
    loaded, a second GPU's context and its copy of the weights) is not the work's time."""
    calls = []
    monkeypatch.setattr(bench, "generate", lambda model, requests, **kw: calls.append(
        ("untimed", len(requests), kw["n_slots"], kw["policy"], kw["prefill_chunk"], kw["disaggregate"],
         kw["kv_blocks"], kw["prefix_cache"])))

    def timed(model, requests, runs, args, eos_id, show_belt):
        calls.extend(("timed", len(requests), *run[1:]) for run in runs)
        raise Stop

    monkeypatch.setattr(bench, "run_all", timed)
    args = SimpleNamespace(seed=0, quick=True, weights=None, device=torch.device("cpu"), dtype=torch.float32,
                           call_cost=None, decode_steps=False, requests=8, arrival_rate=None, slots=3,
                           prefill_chunk=5, disaggregate=True, max_len=None, paged=False, prefix=False, paged_step=False,
                           kv_blocks=None, kv_block_size=16, roofline=False, batch_invariant=False)
    with pytest.raises(Stop):
        bench.bench(args)
    untimed = [call[2:] for call in calls if call[0] == "untimed"]
    timed_runs = [call[2:] for call in calls if call[0] == "timed"]
    assert calls[:len(untimed)] == [c for c in calls if c[0] == "untimed"], "a timed run before the warm-up"
    assert untimed == timed_runs == [(3, "continuous", 5, False, None, False), (3, "static", 5, False, None, False),
                                     (1, "continuous", 5, False, None, False), (3, "continuous", 5, True, None, False)], calls
    assert {call[1] for call in calls if call[0] == "untimed"} == {2}, "the warm-up is not two short requests"


def test_step_times_by_hand():
    """A step decodes when it makes more tokens than first tokens: in the schedule of tests/test_figures.py,
    step 0 makes A's first token and nothing else (B's prompt is still going in), step 1 makes B's
    first token and A's second, step 2 C's first and B's second."""
    assert bench.step_times([SimpleNamespace(step=i, **vars(r)) for i, r in enumerate(SCHEDULE)], SERVED) == \
        [(0, 0.5, False), (1, 0.25, True), (2, 0.25, True), (3, 0.5, True), (4, 0.25, True)]
