"""
The belt as a picture: an SVG panel per run, steps along x, slots along y.

    python tools/belt_svg.py FILE [the options of nanobatch.py --demo]       the demo's two runs
    python tools/belt_svg.py FILE --prompt TEXT [...]                        your prompts' run

It runs the demo (or your prompts) exactly as nanobatch.py does, the belt on screen, then draws
FILE. tools/bench.py --svg FILE draws the bench's runs with the same functions.
"""
import argparse
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
from nanobatch import fail, letter, main as nanobatch_main  # noqa: E402

SVG_WIDTH, LEFT, RIGHT = 1200, 44, 16  # px: fits a laptop screen; LEFT holds the margin's labels
TITLE_H, GAP, STRIP_H, AXIS_H = 26, 6, 24, 30  # px: a panel's title, belt-to-strip gap, strip, axis
STEP_TIMES_H, SCALE_W = 40, 40  # px: the strip of step durations, and room right of it for its scale
STEP_COLOUR = "#c0392b"  # a step's duration, red: a stall must stand out
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


def stay_svg(i, c, step_w, row_h):
    """Request i's stay in its slot: a bar from its admit step to its last token, the steps before its
    first token hatched over (its prompt not all in the cache yet: it may wait for the prompt budget, or
    for the worker, before any of it goes in), its letter if the bar has room for one, and a tooltip."""
    x, y, height = LEFT + c.admit_step * step_w, TITLE_H + c.slot * row_h, row_h - 1  # 1 px between rows
    width, n_prefill_steps = (c.finish_step - c.admit_step + 1) * step_w, c.first_token_step - c.admit_step
    n_tokens = len(c.tokens)
    tip = (f"request {letter(i)}, slot {c.slot}: steps {c.admit_step}-{c.finish_step}, "
           f"{n_tokens} token{'' if n_tokens == 1 else 's'}")
    if n_prefill_steps:  # in its slot, but its prompt not all in the cache: waiting for the budget or the worker
        tip += f"; no token yet in steps {c.admit_step}-{c.first_token_step - 1}: its prompt not all in"
    parts = [tag("title", escape(tip)),
             tag("rect", class_="stay", data_request=i, data_slot=c.slot, data_admit=c.admit_step,
                 data_finish=c.finish_step, x=x, y=y, width=width, height=height, fill=colour(i),
                 stroke="white", stroke_width=0.5)]  # the white edge parts two stays that touch
    if n_prefill_steps:
        parts.append(tag("rect", class_="prefill", data_request=i, x=x, y=y, width=n_prefill_steps * step_w,
                         height=height, fill="url(#hatch)"))
    font_px = min(12, row_h - 4)
    if font_px >= 7 and width >= font_px:  # 64 slots, or a 1-step stay: colour and tooltip must do
        parts.append(tag("text", letter(i), x=x + width / 2, y=y + height / 2, font_size=font_px,
                         text_anchor="middle", dominant_baseline="central"))
    return tag("g", "".join(parts))


def panel_svg(title, n_slots, completions, summary, step_times, step_w, n_axis_steps, longest_s, top):
    """One run, drawn from y = top down: its title, a belt of n_slots rows, the occupancy strip, the
    step durations if step_times are given ([(step, seconds, whether a request decoded in it)], a
    bar each, longest_s the full height), and the step axis -> (its SVG, where the next begins)."""
    done = [(i, c) for i, c in enumerate(completions) if c is not None]  # None: did not finish
    n_steps = max((c.finish_step + 1 for _, c in done), default=0)
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
    parts += [stay_svg(i, c, step_w, row_h) for i, c in done]
    # The strip: at each step, the share of slots holding a request, prefilling or decoding.
    strip_top = TITLE_H + belt_h + GAP
    parts += [margin_label("busy", strip_top + STRIP_H / 2),
              tag("rect", x=LEFT, y=strip_top, width=n_steps * step_w, height=STRIP_H, fill="#eee")]
    for step in range(n_steps):
        bar_h = STRIP_H * sum(c.admit_step <= step <= c.finish_step for _, c in done) / n_slots
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


def legend_svg(has_step_times):
    """Above the panels, what the marks mean, on as many lines as it takes -> (its SVG, its height)."""
    keys = [([colour(2)], "a request in its slot, with its letter (hover over it: details)"),
            ([colour(2), "url(#hatch)"], "no token yet: its prompt not all in"),
            (["#eee"], "an idle slot"), (["#666"], "busy: the share of slots holding a request")]
    keys += [([STEP_COLOUR], "ms: how long each step took"),
             (["#bbb"], "a step in which no request decoded")] if has_step_times else []
    parts, x, y = [], 8, 8
    for fills, text in keys:
        width = 26 + 6.5 * len(text)  # text at 12 px runs about 6.5 px a character
        if x + width > SVG_WIDTH:
            x, y = 8, y + 22
        swatch = "".join(tag("rect", width=20, height=14, fill=fill) for fill in fills)
        parts.append(tag("g", swatch + tag("text", escape(text), x=26, y=11, font_size=12),
                         transform=f"translate({x}, {y})"))
        x += width + 20
    return "".join(parts), y + 32


def belt_svg(*groups):
    """groups: each a list of panels [(title, n_slots, completions, summary, step_times)], runs of
    the same requests -> an SVG document, a panel per run, one under the other, each group on one
    step scale (and one scale of step durations), so that its runs compare by eye. completions: one
    per request in request order, each with .slot, .admit_step, .first_token_step, .finish_step and
    .tokens, or None (not finished: not drawn); summary: summarize()'s figures; step_times: None, or
    [(step, seconds)] for a strip of step durations."""
    has_step_times = any(panel[4] for panels in groups for panel in panels)
    legend, top = legend_svg(has_step_times)
    parts = [tag("defs", HATCH), legend]
    for g, panels in enumerate(groups):
        top += 4 * GAP if g else 0  # a gap between groups: each has scales of its own
        n_steps = max((c.finish_step + 1 for _, _, completions, _, _ in panels for c in completions if c), default=1)
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
    write_svg(path, shown.panels())


if __name__ == "__main__":
    main()
