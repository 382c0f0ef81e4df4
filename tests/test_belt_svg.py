"""
The belt as a picture (tools/belt_svg.py), parsed back: every stay drawn where and as long as it
was, in its own colour; and the bench (tools/bench.py): its warm-up, and the times of its steps.
"""
import random
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import torch

from tests.test_figures import SCHEDULE, SERVED  # the schedule worked by hand, whose step times bench reads
import belt_svg  # noqa: E402 (tools/, put on the path by tests.common)
import bench  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The belt as a picture: every stay drawn where and as long as it was, in its own colour


SVG = "{http://www.w3.org/2000/svg}"  # ElementTree names SVG's elements by namespace


def stay(slot, admit_step, first_token_step, finish_step):
    """A stand-in for a Completion: what belt_svg reads, and nothing else."""
    return SimpleNamespace(slot=slot, admit_step=admit_step, first_token_step=first_token_step,
                           finish_step=finish_step, tokens=[0] * (finish_step - first_token_step + 1))


def headline(n_steps):
    return {"steps": n_steps, "tokens/s": 49.3, "TTFT P50/P99 (steps)": (6, 11)}


# Six requests on a belt of 3 slots, the last unfinished (None): B and D spend steps prefilling only.
CONTINUOUS = [stay(0, 0, 0, 4), stay(1, 0, 2, 9), stay(2, 0, 0, 2), stay(2, 3, 5, 7), stay(0, 5, 5, 6), None]
STATIC = [stay(0, 0, 0, 4), stay(1, 0, 2, 9), stay(2, 0, 0, 2), stay(0, 10, 12, 14), stay(1, 10, 10, 11), None]
BELTS = [("continuous", 3, CONTINUOUS, headline(10), None), ("static", 3, STATIC, headline(15), None)]


def drawn_panels(svg):
    """The SVG parsed back -> per panel: (its px per step, {request: its stay bar}, {request: its
    prefill mark}). Parsing is the first check: a browser shows nothing of a malformed file."""
    panels = []
    for group in ET.fromstring(svg).iter(f"{SVG}g"):
        if group.get("class") == "panel":
            def by_request(kind):
                rects = [r for r in group.iter(f"{SVG}rect") if r.get("class") == kind]
                by_index = {int(r.get("data-request")): r for r in rects}
                assert len(by_index) == len(rects), f"a request with two {kind} rects"
                return by_index
            panels.append((float(group.get("data-step-width")), by_request("stay"), by_request("prefill")))
    return panels


def check_stays(svg, belts):
    """Per panel: exactly one bar per finished request, on its slot's row, from its admit step, as long
    as its stay, never over another in its slot; a hatched mark over exactly its prefill-only steps."""
    panels = drawn_panels(svg)
    assert len(panels) == len(belts)
    assert len({step_w for step_w, _, _ in panels}) == 1, "panels on different step scales"
    for (title, _, completions, _, _), (step_w, bars, prefills) in zip(belts, panels):
        # 1) Which: every finished request, and no other; hatched, those that spent steps prefilling.
        finished = {i for i, c in enumerate(completions) if c is not None}
        prefilling = {i for i in finished if completions[i].first_token_step > completions[i].admit_step}
        assert bars.keys() == finished, \
            f"{title}: bars for {sorted(bars.keys() - finished)} unfinished, none for {sorted(finished - bars.keys())}"
        assert prefills.keys() == prefilling, \
            f"{title}: marks on {sorted(prefills.keys() - prefilling)}, none on {sorted(prefilling - prefills.keys())}"
        # 2) Where: each slot on a row of its own, each bar from its admit step (step 0 at one x).
        row_of_slot, step_0_at = {}, set()
        for i, bar in bars.items():
            c = completions[i]
            y = row_of_slot.setdefault(c.slot, bar.get("y"))
            assert bar.get("y") == y, f"{title}: slot {c.slot} drawn on two rows"
            assert (int(bar.get("data-slot")), int(bar.get("data-admit"))) == (c.slot, c.admit_step)
            step_0_at.add(round(float(bar.get("x")) - c.admit_step * step_w, 1))
        assert len(set(row_of_slot.values())) == len(row_of_slot), f"{title}: two slots on one row"
        assert len(step_0_at) == 1, f"{title}: bars not at their admit steps, step 0 at x = {step_0_at}"
        # 3) How long: a stay of n steps is n step-widths; a mark covers the prefill-only steps.
        for i, bar in bars.items():
            c, width = completions[i], float(bar.get("width"))
            n_steps = c.finish_step - c.admit_step + 1
            assert width == pytest.approx(n_steps * step_w, abs=0.02), \
                f"{title}: request {i}'s bar is {width / step_w:.2f} steps long, its stay {n_steps}"
        for i, mark in prefills.items():
            c, bar = completions[i], bars[i]
            assert (mark.get("x"), mark.get("y")) == (bar.get("x"), bar.get("y")), f"request {i}'s mark"
            n_prefill_steps = c.first_token_step - c.admit_step
            assert float(mark.get("width")) == pytest.approx(n_prefill_steps * step_w, abs=0.02), f"request {i}"
        # 4) No two bars on top of each other in a slot.
        for slot in row_of_slot:
            in_slot = sorted((float(bar.get("x")), float(bar.get("width")), i) for i, bar in bars.items()
                             if completions[i].slot == slot)
            for (x, width, i), (next_x, _, j) in zip(in_slot, in_slot[1:]):
                assert x + width <= next_x + 0.02, f"{title}: requests {i} and {j} overlap in slot {slot}"


def test_belt_svg_draws_every_stay():
    """Two runs of six requests, by hand: each bar where and as long as its stay, nothing for the
    unfinished request, the headline figures in the titles."""
    svg = belt_svg.belt_svg(BELTS)
    check_stays(svg, BELTS)
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("font-weight") == "bold"]
    assert titles == ["continuous, 3 slots: 10 steps, 49.3 tokens/s, TTFT P50 6 steps",
                      "static, 3 slots: 15 steps, 49.3 tokens/s, TTFT P50 6 steps"], titles


def test_belt_svg_one_colour_per_request():
    """A colour names a request: the same in every panel, and different for each of the six."""
    panels = drawn_panels(belt_svg.belt_svg(BELTS))
    fills = [{i: bar.get("fill") for i, bar in bars.items()} for _, bars, _ in panels]
    assert fills[0] == fills[1], fills
    assert len(set(fills[0].values())) == len(fills[0]), fills[0]


def test_belt_svg_64_slots_300_steps():
    """A busy belt, 64 slots for 300 steps: it still parses, every stay is drawn, and every bar fits
    inside the picture."""
    rng, completions = random.Random(0), []
    for slot in range(64):  # stays one after another, now and then an idle step between
        step = rng.randrange(5)
        while step + (length := rng.randint(1, 40)) <= 300:
            n_prefill_steps = min(rng.choice([0, 0, 1, 3]), length - 1)
            completions.append(stay(slot, step, step + n_prefill_steps, step + length - 1))
            step += length + rng.randrange(3)
    completions[7] = None  # one cut short
    belts = [("continuous", 64, completions, headline(300), None)]
    svg = belt_svg.belt_svg(belts)
    check_stays(svg, belts)
    width = float(ET.fromstring(svg).get("width"))
    _, bars, _ = drawn_panels(svg)[0]
    assert max(float(bar.get("x")) + float(bar.get("width")) for bar in bars.values()) <= width


def test_belt_svg_groups_and_step_durations():
    """Two groups: the two belts above, then one run given its step durations. Each group has a step
    scale of its own, its longest run spanning the width: (1200 - 44 - 16) / 15 = 76 px a step for
    the first, (1200 - 44 - 16 - 40) / 10 = 110 for the second, which leaves 40 px for the scale of
    its durations. The run with durations gets a bar per step reported, at that step, as tall as its
    share of the group's longest step (40 px), grey where no request decoded; the runs without get
    none."""
    times = [(0, 0.1, False), (1, 0.4, True), (2, 0.2, True), (4, 0.05, True)]  # no step 3: the clock jumped
    summary = {**headline(10), "TBT P50/P99 (ms)": (5.0, 123.0)}
    svg = belt_svg.belt_svg(BELTS, [("long prompts", 3, CONTINUOUS, summary, times)])
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
         kw["kv_blocks"])))

    def timed(model, requests, runs, args, eos_id, show_belt):
        calls.extend(("timed", len(requests), *run[1:]) for run in runs)
        raise Stop

    monkeypatch.setattr(bench, "run_all", timed)
    args = SimpleNamespace(seed=0, quick=True, weights=None, device=torch.device("cpu"), dtype=torch.float32,
                           call_cost=None, decode_steps=False, requests=8, arrival_rate=None, slots=3,
                           prefill_chunk=5, disaggregate=True, max_len=None, paged=False, kv_blocks=None,
                           kv_block_size=16)
    with pytest.raises(Stop):
        bench.bench(args)
    untimed = [call[2:] for call in calls if call[0] == "untimed"]
    timed_runs = [call[2:] for call in calls if call[0] == "timed"]
    assert calls[:len(untimed)] == [c for c in calls if c[0] == "untimed"], "a timed run before the warm-up"
    assert untimed == timed_runs == [(3, "continuous", 5, False, None), (3, "static", 5, False, None),
                                     (1, "continuous", 5, False, None), (3, "continuous", 5, True, None)], calls
    assert {call[1] for call in calls if call[0] == "untimed"} == {2}, "the warm-up is not two short requests"


def test_step_times_by_hand():
    """A step decodes when it makes more tokens than first tokens: in the schedule of tests/test_figures.py,
    step 0 makes A's first token and nothing else (B's prompt is still going in), step 1 makes B's
    first token and A's second, step 2 C's first and B's second."""
    assert bench.step_times([SimpleNamespace(step=i, **vars(r)) for i, r in enumerate(SCHEDULE)], SERVED) == \
        [(0, 0.5, False), (1, 0.25, True), (2, 0.25, True), (3, 0.5, True), (4, 0.25, True)]
