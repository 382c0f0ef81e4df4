"""
The belt as a picture: an SVG panel per run, steps along x, slots along y.

    python tools/belt_svg.py FILE [the options of nanobatch.py --demo]       the demo's two runs
    python tools/belt_svg.py FILE --prompt TEXT [...]                        your prompts' run

It runs the demo (or your prompts) exactly as nanobatch.py does, the belt on screen, then draws
FILE from the runs' step reports: a bar per stay, where and as long as StepReport.occupants put the
request in its slot (Part 3: a preempted request's stay ends early, and it comes back in another;
Part 4: a stay whose admission found positions in the prefix cache begins with a mark).
tools/bench.py --svg FILE draws the bench's runs with the same functions.
"""
import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
from nanobatch import fail, letter, main as nanobatch_main  # noqa: E402

SVG_WIDTH, LEFT, RIGHT = 1200, 44, 16  # px: fits a laptop screen; LEFT holds the margin's labels
TITLE_H, GAP, STRIP_H, AXIS_H = 26, 6, 24, 30  # px: a panel's title, belt-to-strip gap, strip, axis
STEP_TIMES_H, SCALE_W = 40, 40  # px: the strip of step durations, and room right of it for its scale
STEP_COLOUR = "#c0392b"  # a step's duration, red: a stall must stand out
PREEMPTED_COLOUR = "#7b0000"  # the end of a stay cut by a preemption (Part 3): dark red, not a step's red
FOUND_COLOUR = "#1b6e2f"  # the start of a stay whose admission found positions cached (Part 4): dark green
HATCH = ('<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform='
         '"rotate(45)"><rect width="3" height="6" fill="white" fill-opacity="0.6"/></pattern>')


def tag(name, content="", **attributes):
    """One SVG element as text: class_ -> class (a Python keyword), data_slot -> data-slot, floats
    to 0.01 px. content is markup already, so callers escape their text."""
    def value(v):
        return str(round(v, 2) if isinstance(v, float) else v)

    attrs = "".join(f" {key.rstrip('_').replace('_', '-')}={quoteattr(value(v))}"
                    for key, v in attributes.items())
    content = str(content)  # a number (slot, step) is text too
    return f"<{name}{attrs}>{content}</{name}>" if content else f"<{name}{attrs}/>"


def margin_label(text, y):
    """Grey text in the left margin, right-aligned against the belt: slot numbers, 'busy', 'step'."""
    return tag("text", text, x=LEFT - 8, y=y, font_size=10, fill="#555", text_anchor="end",
               dominant_baseline="central")


def colour(request_index):
    """A request's colour, the same in every panel: hues a golden angle (137.5 degrees) apart, so
    that requests close in the queue, which often sit side by side, never look alike."""
    return f"hsl({request_index * 137.508 % 360:.0f}, 70%, 65%)"


def every(px_per_unit, min_gap_px, choices):
    """The first of choices (in steps or slots) whose labels stand min_gap_px apart, or the last."""
    return next((c for c in choices if c * px_per_unit >= min_gap_px), choices[-1])


@dataclass
class Stay:
    """A request's stay in a slot, as the step reports recorded it: the steps, one after another, in
    which StepReport.occupants put it in that slot. Preempted (Part 3), a request leaves its slot
    before its last token, and a later stay, maybe in another slot, takes it in again."""
    request: int  # its index in the caller's list
    slot: int
    steps: list = field(default_factory=list)  # [(step, its character in the belt: '~' no token yet)]
    preempted_at: int | None = None  # the step whose report preempted it, ending this stay (Part 3)
    is_comeback: bool = False  # a stay after a preemption: its '~' steps feed its prompt and answer again
    n_found: int = 0  # positions its admission found in the prefix cache (Part 4), not fed again

    @property
    def first(self):
        return self.steps[0][0]

    @property
    def last(self):
        return self.steps[-1][0]


def stays(reports):
    """Every stay on the belt, from the step reports' occupants and belts -> [Stay], by request, then
    step. Reports come one a step while anyone is on the belt (the clock jumps only over an empty
    one), so a stay is a run of consecutive reports with the same occupant in the same slot; a
    preempted request is gone from occupants in the report that preempts it. A stay begins in the step
    that admits it, whose report says what its admission found cached (Part 4)."""
    in_slot, latest, done = {}, {}, []  # slot -> the stay in it; request -> its latest stay
    for report in reports:
        found = dict(zip(report.admitted, report.found_cached))  # request -> positions found, if admitted here
        for slot, i in enumerate(report.occupants):
            if slot in in_slot and in_slot[slot].request != i:  # its occupant left (or was preempted)
                done.append(in_slot.pop(slot))
            if i is not None and slot not in in_slot:  # taken in: a new stay
                in_slot[slot] = Stay(i, slot, is_comeback=i in latest, n_found=found.get(i, 0))
                latest[i] = in_slot[slot]
            if i is not None:
                in_slot[slot].steps.append((report.step, report.belt[slot]))
        for i in report.preempted:
            latest[i].preempted_at = report.step
    return sorted(done + list(in_slot.values()), key=lambda stay: (stay.request, stay.first))


def stay_svg(stay, step_w, row_h):
    """One stay: a bar from its first step to its last, the steps with no token yet hatched over (its
    prompt not all in the cache: it may wait for the prompt budget, or for the worker, before any of
    it goes in; back after a preemption, its prompt and answer go in again), a dark green edge where its
    admission found positions in the prefix cache, a dark red edge where it was preempted, its letter if
    the bar has room for one, and a tooltip."""
    i, slot, first, last = stay.request, stay.slot, stay.first, stay.last
    x, y, height = LEFT + first * step_w, TITLE_H + slot * row_h, row_h - 1  # 1 px between rows
    width = (last - first + 1) * step_w
    hatched = [step for step, character in stay.steps if character == "~"]  # its first steps: no token yet
    n_tokens = len(stay.steps) - len(hatched)  # a token in every other step of the stay
    tip = f"request {letter(i)}, slot {slot}: steps {first}-{last}, {n_tokens} token{'' if n_tokens == 1 else 's'}"
    if stay.n_found:
        tip += f"; admitted with positions 0-{stay.n_found - 1} found in the prefix cache, not fed again"
    if hatched:  # in its slot, its prompt (and, back after a preemption, its answer) not all in the cache
        what = "its prompt and answer going in again" if stay.is_comeback else "its prompt not all in"
        tip += f"; no token yet in steps {hatched[0]}-{hatched[-1]}: {what}"
    if stay.preempted_at is not None:
        tip += f"; preempted at step {stay.preempted_at}: its blocks freed, back to the head of the queue"
    parts = [tag("title", escape(tip)),
             tag("rect", class_="stay", data_request=i, data_slot=slot, data_first=first, data_last=last,
                 x=x, y=y, width=width, height=height, fill=colour(i),
                 stroke="white", stroke_width=0.5)]  # the white edge parts two stays that touch
    if hatched:
        parts.append(tag("rect", class_="prefill", data_request=i, x=LEFT + hatched[0] * step_w, y=y,
                         width=len(hatched) * step_w, height=height, fill="url(#hatch)"))
    if stay.n_found:  # the bar's left end, over its first step
        parts.append(tag("rect", class_="found", data_request=i, data_step=first, data_found=stay.n_found,
                         x=x, y=y, width=min(3, width / 2), height=height, fill=FOUND_COLOUR))
    if stay.preempted_at is not None:  # the bar's right end, over its last step
        parts.append(tag("rect", class_="preempted", data_request=i, data_step=stay.preempted_at,
                         x=x + width - min(3, width / 2), y=y, width=min(3, width / 2), height=height,
                         fill=PREEMPTED_COLOUR))
    font_px = min(12, row_h - 4)
    if font_px >= 7 and width >= font_px:  # 64 slots, or a 1-step stay: colour and tooltip must do
        parts.append(tag("text", letter(i), x=x + width / 2, y=y + height / 2, font_size=font_px,
                         text_anchor="middle", dominant_baseline="central"))
    return tag("g", "".join(parts))


def panel_svg(title, n_slots, reports, summary, step_times, step_w, n_axis_steps, longest_s, top):
    """One run, drawn from y = top down: its title, a belt of n_slots rows, a bar per stay (from its
    step reports: stays()), the occupancy strip, the step durations if step_times are given ([(step,
    seconds, whether a request decoded in it)], a bar each, longest_s the full height), and the step
    axis -> (its SVG, where the next begins)."""
    n_steps = reports[-1].step + 1 if reports else 0
    row_h = min(22, max(6, 360 / n_slots))  # 8 slots: roomy rows; 64: thin ones, 384 px in all
    belt_h = n_slots * row_h
    heading = (f"{title}, {n_slots} slots: {summary['steps']} steps, {summary['tokens/s']:.1f} tokens/s, "
               f"TTFT P50 {summary['TTFT P50/P99 (steps)'][0]:g} steps")
    if step_times:
        heading += f", TBT P99 {summary['TBT P50/P99 (ms)'][1]:.0f} ms"
    parts = [tag("text", escape(heading), x=8, y=18, font_size=15, font_weight="bold"),
             tag("rect", x=LEFT, y=TITLE_H, width=n_steps * step_w, height=belt_h, fill="#eee")]  # idle
    parts += [margin_label(slot, TITLE_H + (slot + 0.5) * row_h)
              for slot in range(0, n_slots, every(row_h, 14, (1, 2, 4, 8, 16)))]
    parts += [stay_svg(stay, step_w, row_h) for stay in stays(reports)]
    # The strip: at each step, the share of slots holding a request, prefilling or decoding.
    strip_top = TITLE_H + belt_h + GAP
    parts += [margin_label("busy", strip_top + STRIP_H / 2),
              tag("rect", x=LEFT, y=strip_top, width=n_steps * step_w, height=STRIP_H, fill="#eee")]
    n_busy = {report.step: sum(i is not None for i in report.occupants) for report in reports}
    for step in range(n_steps):  # 0 where the clock jumped: no report, an empty belt
        bar_h = STRIP_H * n_busy.get(step, 0) / n_slots
        parts.append(tag("rect", class_="occupancy", x=LEFT + step * step_w, y=strip_top + STRIP_H - bar_h,
                         width=step_w, height=bar_h, fill="#666", shape_rendering="crispEdges"))
    # The step durations: a bar per step, so that a stall stands out.
    axis_y = strip_top + STRIP_H + 4
    if step_times:
        times_top = strip_top + STRIP_H + GAP
        parts += [margin_label("ms", times_top + STEP_TIMES_H / 2),
                  tag("rect", x=LEFT, y=times_top, width=n_steps * step_w, height=STEP_TIMES_H, fill="#eee")]
        for step, seconds, decoded in step_times:  # grey: prompts only, or waiting for the worker
            bar_h = STEP_TIMES_H * seconds / longest_s
            parts.append(tag("rect", class_="step-time", data_step=step, data_ms=f"{1e3 * seconds:.1f}",
                             x=LEFT + step * step_w, y=times_top + STEP_TIMES_H - bar_h, width=step_w, height=bar_h,
                             fill=STEP_COLOUR if decoded else "#bbb", shape_rendering="crispEdges"))
        parts.append(tag("text", f"{1e3 * longest_s:.0f} ms", x=LEFT + n_axis_steps * step_w + 4, y=times_top + 8,
                         font_size=10, fill="#555"))  # the scale: a bar of the full height
        axis_y = times_top + STEP_TIMES_H + 4
    # The step axis, the same in every panel of a group.
    parts.append(margin_label("step", axis_y + 8))
    for step in range(0, n_axis_steps + 1, every(step_w, 50, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))):
        x = LEFT + step * step_w
        parts += [tag("line", x1=x, x2=x, y1=axis_y - 4, y2=axis_y, stroke="#555"),
                  tag("text", step, x=x, y=axis_y + 12, font_size=10, fill="#555", text_anchor="middle")]
    return tag("g", "".join(parts), class_="panel", data_title=title, data_step_width=repr(step_w),
               transform=f"translate(0, {top})"), top + axis_y + AXIS_H


def legend_svg(has_step_times, has_preemptions, has_found=False):
    """Above the panels, what the marks mean, on as many lines as it takes -> (its SVG, its height)."""
    bar = tag("rect", width=20, height=14, fill=colour(2))  # a stay's bar, under its marks
    keys = [(bar, "a request in its slot, with its letter (hover over it: details)"),
            (bar + tag("rect", width=20, height=14, fill="url(#hatch)"), "no token yet: its prompt not all in" +
             (" (back after a preemption: its prompt and answer)" if has_preemptions else "")),
            (tag("rect", width=20, height=14, fill="#eee"), "an idle slot"),
            (tag("rect", width=20, height=14, fill="#666"), "busy: the share of slots holding a request")]
    keys += [(bar + tag("rect", x=17, width=3, height=14, fill=PREEMPTED_COLOUR), "preempted: its blocks freed, "
              "back to the queue, to feed its prompt and answer again")] if has_preemptions else []
    keys += [(bar + tag("rect", width=3, height=14, fill=FOUND_COLOUR), "found: its admission found positions "
              "in the prefix cache, not fed again")] if has_found else []
    keys += [(tag("rect", width=20, height=14, fill=STEP_COLOUR), "ms: how long each step took"),
             (tag("rect", width=20, height=14, fill="#bbb"), "a step in which no request decoded")] \
        if has_step_times else []
    parts, x, y = [], 8, 8
    for swatch, text in keys:
        width = 26 + 6.5 * len(text)  # text at 12 px runs about 6.5 px a character
        if x + width > SVG_WIDTH:
            x, y = 8, y + 22
        parts.append(tag("g", swatch + tag("text", escape(text), x=26, y=11, font_size=12),
                         transform=f"translate({x}, {y})"))
        x += width + 20
    return "".join(parts), y + 32


def belt_svg(*groups):
    """groups: each a list of panels [(title, n_slots, reports, summary, step_times)], runs of the
    same requests -> an SVG document, a panel per run, one under the other, each group on one step
    scale (and one scale of step durations), so that its runs compare by eye. reports: the run's
    StepReports, each with .step, .occupants, .belt, .preempted, .admitted and .found_cached: the
    stays are drawn from them; summary: summarize()'s figures; step_times: None, or [(step, seconds,
    whether a request decoded)] for a strip of step durations."""
    has_step_times = any(panel[4] for panels in groups for panel in panels)
    has_preemptions = any(report.preempted for panels in groups for panel in panels for report in panel[2])
    has_found = any(any(report.found_cached) for panels in groups for panel in panels for report in panel[2])
    legend, top = legend_svg(has_step_times, has_preemptions, has_found)
    parts = [tag("defs", HATCH), legend]
    for g, panels in enumerate(groups):
        top += 4 * GAP if g else 0  # a gap between groups: each has scales of its own
        n_steps = max((reports[-1].step + 1 for _, _, reports, _, _ in panels if reports), default=1)
        durations = [seconds for *_, step_times in panels for _, seconds, _ in step_times or ()]
        width = SVG_WIDTH - LEFT - RIGHT - (SCALE_W if durations else 0)
        step_w = width / n_steps  # px per step: the longest run spans the width
        for panel in panels:
            group, top = panel_svg(*panel, step_w, n_steps, max(durations, default=1), top)
            parts.append(group)
    return tag("svg", "".join(parts), xmlns="http://www.w3.org/2000/svg", width=SVG_WIDTH, height=top,
               font_family="sans-serif", style="background: white")


def write_svg(path, groups):
    try:
        Path(path).write_text(belt_svg(*groups))
    except OSError as e:  # no such folder, no permission
        fail(f"{path}: {e}")
    print(f"\nthe belt, a panel per run: {path} (open it in a browser)")


def checked_path(path):
    """An argparse type: FILE, whose folder must exist: found out now, not after a long run."""
    if not Path(path).parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: no such folder")
    return path


def run_for_file(argv, prog, description, what):
    """argv: FILE, then nanobatch.py's options (--demo's, or --prompt TEXT ...). FILE's folder is
    checked first, then the demo or the prompts run as nanobatch.py runs them, the belt on screen
    -> (FILE, the options after it, what ran: nanobatch.Shown). tools/explore.py starts the same way."""
    parser = argparse.ArgumentParser(prog=prog, usage="%(prog)s FILE [options of nanobatch.py --demo, or --prompt "
                                     "TEXT ...]", description=description)
    parser.add_argument("file", metavar="FILE", type=checked_path, help=f"where to write the {what}")
    argv = sys.argv[1:] if argv is None else argv
    path = parser.parse_args(argv[:1]).file  # FILE comes first; the rest is nanobatch.py's
    rest = argv[1:]
    mode = [] if any(arg.split("=")[0] in ("--demo", "--prompt") for arg in rest) else ["--demo"]
    return path, rest, nanobatch_main(mode + rest, prog=f"{prog} FILE")


def main(argv=None):
    path, _, shown = run_for_file(argv, "tools/belt_svg.py", "The belt drawn into FILE, a panel per run: the "
                                  "demo's (continuous, then static), or your prompts'.", "SVG")
    write_svg(path, [[(name, n_slots, shown.reports[name], shown.summaries[name], None)
                      for name, n_slots, *_ in shown.runs]])  # one group: a panel per run


if __name__ == "__main__":
    main()
