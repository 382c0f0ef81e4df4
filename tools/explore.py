"""
A real run, step by step, in one page: the belt, each step's packed rows, and the masks they attended under.

    python tools/explore.py FILE [the options of nanobatch.py --demo]       the demo's two runs
    python tools/explore.py FILE --prompt TEXT [...]                        your prompts' run

It runs the demo (or your prompts) exactly as nanobatch.py does, the belt on screen, then writes
FILE: one HTML page, its data, style and script inside it, that opens from disk with no network.
FILE#run=continuous&step=12 opens it at step 12; with &predict=1, as a question for a class (its packed
rows hidden until revealed). The page draws what the engine recorded (each StepReport and the PackedStep
its forward ran on), never a recomputation, so a broken mask shows as a broken grid. Record once, replay
in the page: the data sit in <script id="nanobatch-run">, and one function, render(run, step), draws a
step from them alone.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
from belt_svg import AXIS_H, HATCH, LEFT, RIGHT, SVG_WIDTH, TITLE_H, colour, panel_svg, run_for_file, tag  # noqa: E402
from nanobatch import fail, letter  # noqa: E402

LANE_H = 13  # px: one prompt held by the prefill worker, in its lane under the belt: room for a letter


# ---------------------------------------------------------------------------------------------
# The data: each step as the engine ran it, copied to the host here (never inside generate)


def occupants(completions):
    """{(slot, step): the request in that slot at that step}, from its admission to its last token."""
    return {(c.slot, step): i for i, c in enumerate(completions) if c is not None
            for step in range(c.admit_step, c.finish_step + 1)}


def bits(mask):
    """A bool mask (..., L) -> a string of 0/1 per row of L, exactly as the engine's tensor holds it."""
    return ["".join("1" if visible else "0" for visible in row) for row in mask.reshape(-1, mask.size(-1)).tolist()]


def rows_and_masks(packed, step, occupant, n_sampled_rows, tokenizer):
    """One step's PackedStep -> (its rows, its masks), as the page's contract spells them. occupant:
    occupants()'s map. The first n_sampled_rows of logit_rows are the rows sampled; pack_step puts
    static's padding rows after them: rows for slots that hold no request."""
    if packed is None:  # Part 2: the loop waited for the worker, and ran no forward
        return [], []
    tokens, positions, slots = packed.tokens.tolist(), packed.positions.tolist(), packed.slots.tolist()
    sampled = set(packed.logit_rows[:n_sampled_rows].tolist())
    D = packed.n_one_token
    kinds = ["one-token"] * D  # rows [0, D): a token each, every one in a slot of its own
    for chunk_rows, _, _ in packed.chunks:  # a prompt's chunk; a chunk of one: a row past the cut, alone
        T = chunk_rows.stop - chunk_rows.start
        kinds += ["chunk" if T > 1 else "alone past the cut"] * T
    rows = []
    for i, (token, position, slot, kind) in enumerate(zip(tokens, positions, slots, kinds)):
        request = occupant.get((slot, step))  # None: static's padding, a row for a slot no one holds
        row = dict(slot=slot, position=position, request=request, token=token, sampled=i in sampled,
                   kind="padding" if request is None else kind)
        if tokenizer is not None:
            row["text"] = tokenizer.decode([token])
        rows.append(row)
    masks = []
    if D:  # the one-token call: a query per slot, S of them; a slot with no row gets a dummy, dropped
        row_of_slot = {slot: i for i, slot in enumerate(slots[:D])}
        S = packed.one_token_mask.size(0)
        masks.append(dict(slot=None, rows=[row_of_slot.get(s) for s in range(S)],
                          visible=bits(packed.one_token_mask)))  # (S, 1, L) -> S strings of L
    for chunk_rows, slot, mask in packed.chunks:  # (T, L) each, over its own slot
        masks.append(dict(slot=slot, rows=list(range(chunk_rows.start, chunk_rows.stop)), visible=bits(mask)))
    return rows, masks


def request_data(i, request, completion):
    """What the page shows of request i: its name and colour, and its stay (None: it did not finish)."""
    data = dict(letter=letter(i), colour=colour(i), arrival=request.arrival, prompt_len=len(request.prompt))
    if completion is not None:
        data.update(slot=completion.slot, admit_step=completion.admit_step, finish_step=completion.finish_step,
                    first_token_step=completion.first_token_step, reason=completion.finish_reason,
                    n_tokens=len(completion.tokens))
    return data


def run_data(run, requests, completions, reports, tokenizer=None):
    """One run, (name, n_slots, policy, prefill_chunk, disaggregate) as nanobatch.Shown.runs holds it,
    with its requests, completions and StepReports -> its part of the page's data."""
    name, n_slots, policy, prefill_chunk, disaggregate = run
    occupant = occupants(completions)
    done = [(i, c) for i, c in enumerate(completions) if c is not None]
    steps = []
    for report in reports:
        n_sampled_rows = len(report.sampled) - len(report.handed_over)  # handovers: logits, but no row
        rows, masks = rows_and_masks(report.packed, report.step, occupant, n_sampled_rows, tokenizer)
        steps.append(dict(
            step=report.step, belt=report.belt, rows=rows, masks=masks,
            admitted=report.admitted, handed_over=report.handed_over,
            finished=[[i, c.finish_reason, len(c.tokens)] for i, c in report.finished],
            waiting=[i for i, c in done if requests[i].arrival <= report.step < c.admit_step],  # the queue
            worker=[i for i, c in done if disaggregate and c.admit_step <= report.step < c.first_token_step],
            n_waiting=report.n_waiting, n_running=report.n_running, n_prefilling=report.n_prefilling,
            n_prompt_tokens=report.n_prompt_tokens, sampled=report.sampled,
            n_one_token=0 if report.packed is None else report.packed.n_one_token,  # D
            cut=None if report.packed is None else report.packed.one_token_mask.size(-1),  # the one-token call's L
            model_s=round(report.model_s, 5), step_s=round(report.step_s, 5)))
    return dict(name=name, n_slots=n_slots, policy=policy, prefill_chunk=prefill_chunk, disaggregate=disaggregate,
                requests=[request_data(i, r, c) for i, (r, c) in enumerate(zip(requests, completions))],
                steps=steps)


def page_data(shown, command=""):
    """What --demo or --prompt ran (nanobatch.Shown) -> the page's data: {"runs": [...]}, and more."""
    runs = [run_data(run, shown.requests, shown.completions[run[0]], shown.reports[run[0]], shown.tokenizer)
            for run in shown.runs]
    return dict(command=command, has_text=shown.tokenizer is not None, runs=runs)


# ---------------------------------------------------------------------------------------------
# The belts, drawn once by belt_svg.py's own panel; the page only moves the frame of the step shown


def worker_lane_svg(completions, step_w, top):
    """The prompts the prefill worker holds, each a bar from its admission (phase 2) to its handover
    (phase 4b), its letter where it fits; bars that overlap in time stack in lanes, as few as their
    overlaps allow -> (its SVG, where its bars begin, where the next part begins)."""
    title = ("the prefill worker (Part 2): the prompts it holds, each from its admission (phase 2) to its handover "
             "(phase 4b)")
    parts, lane_ends = [tag("text", title, x=8, y=top + 12, font_size=12, font_weight="bold")], []
    top += 18  # the bars start below the title, and so does the frame of the step shown
    for admit_step, handover_step, i in sorted((c.admit_step, c.first_token_step, i)
                                               for i, c in enumerate(completions) if c is not None):
        lane = next((k for k, end in enumerate(lane_ends) if end < admit_step), len(lane_ends))  # the first free
        lane_ends[lane:lane + 1] = [handover_step]
        x, y, width = LEFT + admit_step * step_w, top + lane * LANE_H, (handover_step - admit_step + 1) * step_w
        tip = tag("title", f"{letter(i)}: admitted at step {admit_step}, handed over at step {handover_step}")
        parts.append(tag("rect", tip, class_="held", data_request=i, x=x, y=y, width=width, height=LANE_H - 1,
                         fill=colour(i), stroke="white", stroke_width=0.5))
        if width >= 9:  # room for a letter of 10 px
            parts.append(tag("text", letter(i), x=x + width / 2, y=y + LANE_H / 2, font_size=10,
                             text_anchor="middle", dominant_baseline="central"))
    parts.append(tag("text", "worker", x=LEFT - 8, y=top + 8, font_size=10, fill="#555", text_anchor="end"))
    return "".join(parts), top, top + max(1, len(lane_ends)) * LANE_H + 8


def step_frame(y, height, step_w):
    """The step shown, over the slots (or the worker's lanes): a translucent column with a thin outline,
    so that the letters under it stay readable. The page moves it to the step shown (its x)."""
    return tag("rect", class_="mark", x=LEFT, y=y, width=max(step_w, 3), height=height, fill="#1f4e99",
               fill_opacity=0.18, stroke="#1f4e99", stroke_width=1)


def belts_html(shown):
    """A belt per run, each on its own step scale (the page shows one run at a time, so each fills the
    width), with a frame on the step shown, which the page moves: a <div class="belt" data-run=NAME>
    each. The SVG scales to the window (a viewBox), so no scrollbar at 1000 px."""
    belts = []
    for name, n_slots, _, _, disaggregate in shown.runs:
        completions = shown.completions[name]
        n_steps = max((c.finish_step + 1 for c in completions if c), default=1)
        step_w = (SVG_WIDTH - LEFT - RIGHT) / n_steps  # px per step: this run spans the width
        panel, bottom = panel_svg(name, n_slots, completions, shown.summaries[name], None, step_w, n_steps, 1, 0)
        # The frame covers the slots and the busy strip, from under the title to above the axis
        frames = [step_frame(TITLE_H, bottom - AXIS_H - 4 - TITLE_H, step_w)]
        lane = ""
        if disaggregate:
            lane, lanes_top, bottom = worker_lane_svg(completions, step_w, bottom)
            frames.append(step_frame(lanes_top, bottom - 8 - lanes_top, step_w))  # the lanes, not their title
        svg = tag("svg", panel + lane + "".join(frames), viewBox=f"0 0 {SVG_WIDTH} {bottom}",
                  font_family="sans-serif", data_left=LEFT, data_step_width=repr(step_w))
        belts.append(f'<div class="belt" data-run="{name}">{svg}</div>')
    return "\n".join(belts)


def page_html(shown, command=""):
    """The whole page as text: PAGE, the belts and the data put in."""
    data = json.dumps(page_data(shown, command), separators=(",", ":")).replace("<", "\\u003c")  # no "</script>"
    return PAGE.replace("__HATCH__", HATCH).replace("__BELTS__", belts_html(shown)).replace("__DATA__", data)


def main(argv=None):
    """Run the demo or the prompts as nanobatch.py does, write FILE -> what ran (nanobatch.Shown)."""
    path, rest, shown = run_for_file(argv, "tools/explore.py", "A run, step by step, in one HTML page written to "
                                     "FILE: the demo's (continuous, then static), or your prompts'.", "page")
    try:
        Path(path).write_text(page_html(shown, " ".join(["python tools/explore.py", path, *rest])))
    except OSError as e:  # no permission, a folder by that name
        fail(f"{path}: {e}")
    name, reports = shown.runs[0][0], shown.reports[shown.runs[0][0]]
    print(f"\nthe run, step by step: {path} (open it in a browser; at step 12, say: "
          f"{Path(path).resolve().as_uri()}#run={name}&step={reports[min(12, len(reports) - 1)].step})")
    return shown


# ---------------------------------------------------------------------------------------------
# The page: the style, the parts, and the script that replays the data. Plain HTML, CSS and
# JavaScript, no library: it must open from disk in a classroom with no network.

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>nanobatch, step by step</title>
<style>
  body { font: 13px/1.35 system-ui, sans-serif; margin: 0 12px 24px; color: #222; background: white; }
  header { position: sticky; top: 0; z-index: 2; background: white; padding: 6px 0 4px;
           border-bottom: 1px solid #ddd; }
  h1 { font-size: 15px; margin: 0 12px 0 0; display: inline; }
  h2 { font-size: 13px; margin: 10px 0 4px; }
  code, .mono, .command { font-family: monospace; }
  .command { font-size: 12px; color: #555; }
  .controls { margin-top: 4px; display: flex; align-items: center; gap: 6px; flex-wrap: wrap; }
  .controls button { font: inherit; padding: 1px 8px; }
  #tabs button[aria-selected="true"] { font-weight: bold; background: #333; color: white; }
  #slider { width: 320px; }
  #shown-step { font-weight: bold; font-size: 15px; }
  .phase { display: inline-block; font: normal 11px sans-serif; color: #555; background: #eef;
           border: 1px solid #ccd; border-radius: 8px; padding: 0 6px; margin-left: 6px; }
  .belt svg { display: block; cursor: pointer; width: 100%; height: auto; max-width: 1500px; }
  .info { display: flex; flex-wrap: wrap; gap: 4px 18px; }
  .info > span { white-space: nowrap; }
  .chip { display: inline-block; font: 12px monospace; padding: 0 3px; border-radius: 3px; margin-right: 2px; }
  .groups { display: flex; flex-wrap: wrap; gap: 6px; align-items: flex-start; }
  .group { border: 1px solid #bbb; border-radius: 4px; padding: 2px 3px 3px; }
  .group.chunk { border-color: #333; }
  .group.alone { border: 2px solid #d35400; }
  .caption { font-size: 11px; color: #444; margin-bottom: 2px; }
  .cards { display: flex; gap: 1px; }
  .row { width: 28px; font: 9px/12px monospace; text-align: center; border: 1px solid #999; border-radius: 3px;
         overflow: hidden; background: white; padding-bottom: 5px; }
  .row.padding { border-style: dashed; color: #777; }
  .row .who { font: bold 11px/14px sans-serif; }
  .row .index { color: #888; }
  .row .token { overflow: hidden; white-space: pre; }
  .row.sampled { box-shadow: inset 0 -4px 0 #222; }
  .grids { display: flex; flex-wrap: wrap; gap: 8px 18px; align-items: flex-start; }
  .grid { max-height: 440px; max-width: 100%; overflow: auto; border: 1px solid #ddd; padding: 2px 4px; }
  .grid .caption { position: sticky; left: 0; }
  .qrow, .ticks { display: flex; align-items: center; height: var(--cell); }
  .ticks { height: 12px; }
  .label { width: 150px; flex: none; white-space: nowrap; overflow: hidden; position: sticky; left: 0;
           background: white; padding-right: 4px; font: calc(var(--cell) + 1px)/var(--cell) monospace; }
  .ticks .label { font: 9px sans-serif; color: #777; }
  .qrow.dummy .label { color: #999; font-style: italic; }
  .tick { width: var(--cell); flex: none; font: 9px monospace; color: #777; white-space: nowrap; }
  .cell { display: block; flex: none; width: calc(var(--cell) - 1px); height: calc(var(--cell) - 1px);
          margin-right: 1px; background: #f3f3f3; }
  .cell.v1 { background: var(--c); }
  .qrow.dummy .cell.v1, .qrow.padding .cell.v1 { background: #9a9a9a; }
  .cell.later { background: repeating-linear-gradient(45deg, #ddd 0 2px, #f3f3f3 2px 4px); }
  .cell.own { outline: 1px solid #222; outline-offset: -1px; }
  .cell.leak { background: #e00 !important; outline: 2px solid #900; }
  .cell.hole { outline: 2px solid #06c; outline-offset: -2px; }
  .concealed { padding: 14px; background: #fff8e0; border: 1px dashed #c90; font-size: 14px; }
  .nothing { color: #666; font-style: italic; }
  #notice { margin-top: 4px; padding: 2px 6px; background: #fff3cd; border: 1px solid #c90; }
  #legend { margin-top: 18px; border-top: 1px solid #ddd; font-size: 12px; }
  #legend dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 4px 0; }
  #legend dt { text-align: right; }
  #legend .cell { display: inline-block; vertical-align: middle; --cell: 11px; }
</style>
</head>
<body>
<!-- The belts' hatching, defined once in an SVG that is always rendered: a pattern inside a hidden belt
     (display: none) draws nothing, in Chrome, for the belts that use it. -->
<svg width="0" height="0" style="position: absolute" aria-hidden="true"><defs>__HATCH__</defs></svg>
<header>
  <h1>nanobatch, step by step</h1><span class="command" id="command"></span>
  <div class="controls">
    <span id="tabs" role="tablist"></span>
    <button id="prev" title="previous step (left arrow; with shift, 10 steps)">&#9664; prev</button>
    <button id="next" title="next step (right arrow; with shift, 10 steps)">next &#9654;</button>
    <button id="play" title="play / pause (space)">play</button>
    <span>step <span id="shown-step"></span> <span id="step-count" class="command"></span></span>
    <input type="range" id="slider" min="0" value="0" aria-label="step">
    <label title="hide each next step's packed rows and masks until revealed (p)">
      <input type="checkbox" id="predict"> predict</label>
    <button id="reveal" title="show the hidden step (Enter)" disabled>reveal</button>
    <span class="command">keys: &larr; &rarr; home end, space play, p predict, enter reveal, t next run</span>
  </div>
  <div id="notice" hidden></div>
</header>

<h2>the belt: slots against steps, the step shown in blue <span class="phase">phase 6: each step's report</span>
  <span class="phase">click a step to go there</span></h2>
__BELTS__

<h2>the step shown <span class="phase">phases 1-2: arrive, admit</span>
  <span class="phase">phase 5: new tokens, stopping</span>
  <span class="phase">phase 7: retire</span></h2>
<div id="step-info" class="info"></div>

<h2 id="packed-title">the packed step</h2>
<div id="packed"></div>

<h2>attention, as the engine ran it: model.attend_packed's calls, in every layer
  <span class="phase">phase 4: one forward</span></h2>
<div id="attention"></div>

<section id="legend">
  <h2>legend</h2>
  <dl>
    <dt>the belt</dt><dd>a bar per request in its slot, its letter and colour the same everywhere on this page;
      hatched: in its slot, no token yet, its prompt not all in the cache (it may wait for the prompt budget, or
      for the worker, before any of it goes in); grey: an idle slot; <b>busy</b>: the share of slots holding a
      request; the blue column: the step shown; <b>worker</b> (with <code>--disaggregate</code>): the prompts the
      prefill worker holds, a bar each from admission to handover; bars that overlap in time stack in lanes,
      one under another.</dd>
    <dt class="mono">step 12 |AB~.| 2/4 waiting 3</dt><dd>the line the terminal printed for the step: per slot,
      the letter of the request that made a token, <code>~</code> a prompt not all in yet (or with the worker),
      <code>.</code> a slot doing no useful work; then the requests that made a token / the slots, and the
      requests still queued.</dd>
    <dt class="mono">+K &nbsp; &gt;K &nbsp; -K(length,5)</dt><dd>K admitted into a free slot (phase 2); K's keys and
      values handed over by the prefill worker (phase 4b); K finished (why, and how many tokens it made; phase 5),
      its slot free from the next step (phase 7).</dd>
    <dt>waste</dt><dd>slots idle: holding no request; padding rows: rows static batching computes for no one;
      dummy queries: slots with no one-token row, whose query in the one-token call is computed and dropped.</dd>
    <dt>a packed row</dt><dd>top to bottom: its index in the step (0..M-1), its request's letter (<code>pad</code>:
      static padding), <code>s</code> slot, <code>p</code> position, its token (its id, or its text where a tokenizer
      was loaded); a black underline: its logits are sampled (its request makes a token this step). The groups:
      <b>one-token rows</b> (a decoding token, or a one-token prompt; at most one a slot; rows 0..D-1, attending
      together), a prompt's <b>chunk</b>, <b>padding</b> (dashed), and a one-token row <b>alone past the cut</b>
      (orange): the one-token call reads every slot's first L positions, and pack_step picks L, the cut, to read
      the fewest keys, a call of its own costing as much as ~150 keys on a CPU (20,000 on a GPU); a row longer
      than the cut attends alone. Padding rows count as one-token rows of length 1, so in a static run they can
      pull the cut down to 1, and a real row attends alone though it is no longer than the others.</dd>
    <dt>a mask grid</dt><dd>a row per query, a column per cache position of its call's L:
      <i class="cell v1" style="--c: hsl(80,70%,65%)"></i> 1, may attend (its request's colour; grey: padding or
      a dummy); <i class="cell own v1" style="--c: hsl(80,70%,65%)"></i> its own position;
      <i class="cell"></i> 0, past its position: nothing of its own there (the slot's unused tail, or what an earlier
      occupant left); <i class="cell later"></i> 0, a later token of the same chunk, written this step (causal);
      <i class="cell v1 leak"></i> a 1 past the query's own position: a broken mask, drawn as the engine ran it;
      <i class="cell hole"></i> a 0 at or before its own position: a broken mask too.
      In the one-token call, row s is slot s's query: <i>dummy</i> for a slot with no one-token row (its output
      dropped); its L is the step's cut.</dd>
    <dt><span class="phase">phase 3</span></dt><dd>the numbered phase of <code>nanobatch.generate</code> a part
      comes from (its comments: 0 jump the clock, 1 arrivals, 2 admit, 3 choose and pack, 4 forward,
      4b handovers, 5 new tokens and stopping, 6 report, 7 retire).</dd>
  </dl>
</section>

<script type="application/json" id="nanobatch-run">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("nanobatch-run").textContent);
const $ = (selector) => document.querySelector(selector);
const state = {run: 0, index: 0, concealed: false, player: null};  // which step is shown, and how

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
}
function phase(text) { return `<span class="phase">${text}</span>`; }
function span(first, last) { return first === last ? `${first}` : `${first}-${last}`; }
function chip(run, i, text) {
  return `<span class="chip" style="background:${run.requests[i].colour}">${escapeHtml(text)}</span>`;
}
function nameOf(run, row) { return row.request === null ? "pad" : run.requests[row.request].letter; }
function colourOf(run, row) { return row.request === null ? "#9a9a9a" : run.requests[row.request].colour; }
function tokenText(row) {  // the token's text, spaces and newlines made visible; else its id
  return DATA.has_text ? JSON.stringify(row.text).slice(1, -1).replace(/ /g, "\u00b7") : String(row.token);
}

// The step in words: the line the terminal printed, then what each phase did. concealed: the class
// predicts this step, so only its premise shows (who sits where going in, who was admitted, the
// queue); every figure that follows from the packing, or from the forward, waits for reveal.
function stepInfo(run, step, concealed) {
  const letter = (i) => run.requests[i].letter, chips = (list) => list.map((i) => chip(run, i, letter(i)));
  const admitted = step.admitted.map((i) => [i, "+" + letter(i)]);
  const handedOver = step.handed_over.map((i) => [i, ">" + letter(i)]);
  const finished = step.finished.map(([i, why, n]) => [i, `-${letter(i)}(${why},${n})`]);
  if (concealed) return premise(run, step, admitted);
  const events = [[admitted, "phase 2"], [handedOver, "phase 4b"], [finished, "phase 5, freed in phase 7"]]
    .filter(([list]) => list.length)
    .map(([list, when]) => list.map(([i, text]) => chip(run, i, text)).join("") + phase(when)).join(" ");
  const idle = [...step.belt].filter((c) => c === ".").length;
  const padding = step.rows.filter((row) => row.kind === "padding").length;
  const oneTokenCall = step.masks.find((mask) => mask.slot === null);
  const dummies = oneTokenCall ? oneTokenCall.rows.filter((r) => r === null).length : 0;
  const budget = run.prefill_chunk === null ? "no limit" : run.prefill_chunk;
  const line = `step ${step.step} |${step.belt}| ${step.n_running}/${run.n_slots} waiting ${step.n_waiting}  ` +
    [...admitted, ...handedOver, ...finished].map(([, text]) => text).join(" ");
  const parts = [
    `<span class="mono" title="what the terminal printed for this step">${escapeHtml(line)}</span>`,
    `<span>events: ${events || "none"}</span>`,
    `<span>queue: ${step.n_waiting} waiting ${chips(step.waiting).join("")}${phase("phases 1-2")}</span>`,
    `<span><b>${step.n_running}/${run.n_slots}</b> make a token` +
      `${step.n_prefilling ? `, ${step.n_prefilling} prefilling` : ""}${phase("phase 5")}</span>`,
    run.disaggregate
      ? `<span>prompt tokens: none here, the worker prefills them (its chunk: ${budget})${phase("phase 3")}</span>`
      : `<span>prompt tokens <b>${step.n_prompt_tokens}</b> of ${budget} (prefill_chunk)${phase("phase 3")}</span>`,
    `<span>step ${(1e3 * step.step_s).toFixed(1)} ms, model ${(1e3 * step.model_s).toFixed(1)} ms` +
      `${phase("phase 4")}</span>`,
    `<span>waste: <b>${idle}</b> slot${idle === 1 ? "" : "s"} idle, <b>${padding}</b> padding ` +
      `row${padding === 1 ? "" : "s"}, ${dummies} dumm${dummies === 1 ? "y query" : "y queries"}</span>`,
  ];
  if (run.disaggregate) {
    const held = step.worker.length ? chips(step.worker).join("") : "none";
    parts.push(`<span>the prefill worker holds: ${held}${phase("Part 2")}</span>`);
  }
  return parts.join("");
}

// The question's premise, all of it known before the step packs: the slots going in (the line the
// terminal printed a step before), who phase 2 admitted now, and who still waits. Hidden: the belt
// line of this step (who made a token), M and the rows' kinds, prompt tokens spent, the counts made
// and prefilling, padding, dummy queries, the times, the handovers and retirements.
function premise(run, step, admitted) {
  const index = run.steps.indexOf(step), before = index > 0 ? run.steps[index - 1] : null;
  const letter = (i) => run.requests[i].letter;
  const retired = before === null ? [] : before.finished.map(([i]) => letter(i));
  const going = before === null ? "the first step: every slot empty" : `after step ${before.step}: ` +
    `<span class="mono">|${escapeHtml(before.belt)}|</span>` +
    (retired.length ? `, ${retired.join(", ")} retired (their slots free now)` : "");
  const budget = run.disaggregate ? "the worker prefills the prompts" : `prompt budget: ${run.prefill_chunk === null
    ? "no limit" : run.prefill_chunk + " tokens"} (prefill_chunk)`;
  return [
    `<span>going in: ${going}</span>`,
    `<span>admitted: ${admitted.map(([i, text]) => chip(run, i, text)).join("") || "none"}${phase("phase 2")}</span>`,
    `<span>queue: ${step.n_waiting} waiting ${step.waiting.map((i) => chip(run, i, letter(i))).join("")}` +
      `${phase("phases 1-2")}</span>`,
    `<span>${budget}${phase("phase 3")}</span>`,
    `<span class="command">predict: the rest of this step is hidden until revealed</span>`,
  ].join("");
}

// The packed rows, side by side in the engine's order: the one-token rows [0, D), then each chunk.
function rowCard(run, row, i) {
  const isPrompt = row.request !== null && row.position < run.requests[row.request].prompt_len;
  const title = `row ${i}: ${row.request === null ? "padding, for no one" : "request " + nameOf(run, row)}, ` +
    `slot ${row.slot}, position ${row.position}${isPrompt ? " (a prompt token)" : ""}, token ${row.token}` +
    `${DATA.has_text ? " " + JSON.stringify(row.text) : ""}, ${row.kind}, ` +
    (row.sampled ? "its logits sampled" : "not sampled");
  return `<div class="row${row.kind === "padding" ? " padding" : ""}${row.sampled ? " sampled" : ""}" ` +
    `data-slot="${row.slot}" data-position="${row.position}" data-kind="${row.kind}" ` +
    `data-sampled="${row.sampled ? 1 : 0}" title="${escapeHtml(title)}">` +
    `<div class="index">${i}</div>` +
    `<div class="who" style="background:${colourOf(run, row)}">${nameOf(run, row)}</div>` +
    `<div>s${row.slot}</div><div>p${row.position}</div><div class="token">${escapeHtml(tokenText(row))}</div></div>`;
}

function groupCaption(run, step, kind, first, last) {
  const row = step.rows[first], lastRow = step.rows[last], who = nameOf(run, row);
  if (kind === "one-token") {
    const prompts = step.rows.slice(first, last + 1).filter((r) => r.request !== null &&
      r.position < run.requests[r.request].prompt_len).map((r) => nameOf(run, r));
    return `rows ${span(first, last)}: one-token rows, D = ${last + 1}, attending together` +
      (prompts.length ? ` (a one-token prompt: ${prompts.join(", ")})` : "");
  }
  if (kind === "chunk") {
    const rest = run.requests[row.request].prompt_len - 1 - lastRow.position;
    return `rows ${span(first, last)}: ${who}'s prompt, positions ${span(row.position, lastRow.position)}, ` +
      `into slot ${row.slot}${rest ? `; ${rest} more next step` : ""}`;
  }
  return `row ${first}: ${who} alone past the cut`;
}

function packedRows(run, step) {
  if (!step.rows.length) {
    return `<div class="nothing">no forward this step: nothing to decode, so the loop waited for the prefill ` +
      `worker (phase 4b)</div>`;
  }
  const groups = step.n_one_token ? [["one-token", 0, step.n_one_token - 1]] : [];
  for (const mask of step.masks.filter((mask) => mask.slot !== null)) {
    groups.push([step.rows[mask.rows[0]].kind, mask.rows[0], mask.rows[mask.rows.length - 1]]);
  }
  return `<div class="groups">` + groups.map(([kind, first, last]) => {
    const cards = step.rows.slice(first, last + 1).map((row, k) => rowCard(run, row, first + k)).join("");
    const style = kind === "chunk" ? " chunk" : kind === "alone past the cut" ? " alone" : "";
    return `<div class="group${style}"><div class="caption">${groupCaption(run, step, kind, first, last)}</div>` +
      `<div class="cards">${cards}</div></div>`;
  }).join("") + `</div>`;
}

// A mask as the engine ran it: a row per query, a cell per position of its call's L. The shading
// comes from the run's own data (positions, the chunk's end), and never changes a 0 or a 1.
function maskGrid(run, step, mask) {
  const L = mask.visible[0].length, longest = Math.max(L, mask.rows.length);
  const cellPx = longest <= 48 ? 10 : longest <= 160 ? 8 : 6;  // 8 slots of ~100 positions; 32 slots
  const chunkEnd = mask.slot === null ? null : step.rows[mask.rows[mask.rows.length - 1]].position;
  const queries = mask.rows.map((r, q) => {
    const row = r === null ? null : step.rows[r], slot = mask.slot === null ? q : mask.slot;
    const label = row === null ? `slot ${slot}: dummy, no row`
      : (mask.slot === null ? `slot ${slot} \u2190 row ${r}: ` : `row ${r}: `) + `${nameOf(run, row)} p${row.position}`;
    const cells = [...mask.visible[q]].map((bit, l) => {
      let marks = "";
      if (row !== null) {
        if (bit === "1" && l > row.position) marks = " leak";
        else if (bit === "0" && l <= row.position) marks = " hole";
        else if (bit === "0" && chunkEnd !== null && l <= chunkEnd) marks = " later";
        else if (l === row.position) marks = " own";
      }
      return `<i class="cell${bit === "1" ? " v1" : ""}${marks}" data-visible="${bit}"></i>`;
    }).join("");
    const kind = row === null ? " dummy" : row.request === null ? " padding" : "";
    return `<div class="qrow${kind}" style="--c:${row === null ? "#9a9a9a" : colourOf(run, row)}" ` +
      `data-slot="${slot}"><span class="label">${label}</span>${cells}</div>`;
  });
  const ticks = Array.from({length: L}, (_, l) => `<span class="tick">${l % 10 === 0 ? l : ""}</span>`).join("");
  const first = step.rows[mask.rows.find((r) => r !== null)];
  const caption = mask.slot === null
    ? `the one-token call: S = ${mask.rows.length} queries, row s is slot s's (queries[slots[:D]] = q[:D]), ` +
      `over L = ${L} positions of every slot (the cut)`
    : mask.rows.length === 1 && first.kind === "alone past the cut"
    ? `${nameOf(run, first)} alone past the cut: 1 query over L = ${L} positions of slot ${mask.slot}`
    : `${nameOf(run, first)}'s chunk: T = ${mask.rows.length} queries over L = ${L} positions of slot ${mask.slot}`;
  return `<div class="grid" style="--cell:${cellPx}px"><div class="caption">${caption}</div>` +
    `<div class="ticks"><span class="label">cache position</span>${ticks}</div>${queries.join("")}</div>`;
}

function attention(run, step) {
  if (!step.masks.length) return `<div class="nothing">no forward, no attention</div>`;
  return `<div class="grids">${step.masks.map((mask) => maskGrid(run, step, mask)).join("")}</div>`;
}

// The one function that draws: step `index` of run `runIndex`, from the data alone; concealed: the
// predict switch hides its packed rows, its masks, and every figure that follows from them.
function render(runIndex, index, concealed) {
  const run = DATA.runs[runIndex], step = run.steps[index];
  $("#shown-step").textContent = step.step;
  $("#step-count").textContent = `(${index + 1} of ${run.steps.length} steps of ${run.name})`;
  $("#slider").max = run.steps.length - 1;
  $("#slider").value = index;
  document.querySelectorAll("#tabs button").forEach((tab, k) => tab.setAttribute("aria-selected", k === runIndex));
  for (const belt of document.querySelectorAll(".belt")) {
    const svg = belt.querySelector("svg");
    belt.style.display = belt.dataset.run === run.name ? "" : "none";
    for (const frame of belt.querySelectorAll(".mark")) {  // over the slots, and over the worker's lanes
      frame.setAttribute("x", +svg.dataset.left + step.step * +svg.dataset.stepWidth);
    }
  }
  $("#step-info").innerHTML = stepInfo(run, step, concealed);
  $("#packed-title").innerHTML = `the packed step: ${concealed ? "M = ? rows" : `M = ${step.rows.length} rows`}, ` +
    `side by side, as one forward takes them` + phase("phase 3: plan_step chooses, pack_step packs");
  $("#reveal").disabled = !concealed;
  $("#packed").innerHTML = concealed ? `<div class="concealed">Predict: which rows does step ${step.step} feed ` +
    `the model, and what may each of them see? Press Enter (or reveal) to show.</div>` : packedRows(run, step);
  $("#attention").innerHTML = concealed ? "" : attention(run, step);
}

// The controls: each changes only which step is shown, then draws it and puts it in the address.
// With predict on, a step reached going forward (not playing) is a question: concealed until revealed.
function go(runIndex, index, conceal) {
  const steps = DATA.runs[runIndex].steps;
  index = Math.max(0, Math.min(steps.length - 1, index));
  const forward = runIndex === state.run && index > state.index;
  conceal = conceal ?? (forward && state.player === null);
  Object.assign(state, {run: runIndex, index, concealed: $("#predict").checked && conceal});
  render(state.run, state.index, state.concealed);
  putInAddress();
}

function putInAddress() {  // #run=NAME&step=N, and &predict=1 while predict is on
  const run = DATA.runs[state.run];
  const hash = `#run=${encodeURIComponent(run.name)}&step=${run.steps[state.index].step}` +
    ($("#predict").checked ? "&predict=1" : "");
  if (location.hash !== hash) {
    try { history.replaceState(null, "", hash); } catch (error) { location.hash = hash; }
  }
}

// #run=NAME&step=N&predict=1 -> [run, index, predict]. A run not here: the first, and a notice naming
// the runs there are (a misspelt link must not pass for the right one). A step not a number: the first
// step; else the first step numbered N or later, or the last.
function fromHash() {
  const wanted = new URLSearchParams(location.hash.slice(1));
  let runIndex = DATA.runs.findIndex((run) => run.name === wanted.get("run"));
  const notice = $("#notice");
  notice.hidden = runIndex !== -1 || !wanted.has("run");
  if (runIndex === -1) {
    notice.textContent = `No run named "${wanted.get("run")}" here; the runs are: ` +
      `${DATA.runs.map((run) => run.name).join(", ")}. Showing ${DATA.runs[0].name}.`;
    runIndex = 0;
  }
  const steps = DATA.runs[runIndex].steps, text = (wanted.get("step") || "").trim();
  const number = /^[0-9]+$/.test(text) ? Number(text) : -1;
  const index = steps.findIndex((step) => step.step >= number);
  return [runIndex, index === -1 ? steps.length - 1 : index, wanted.get("predict") === "1"];
}

function showRun(runIndex) { go(runIndex, Math.min(state.index, DATA.runs[runIndex].steps.length - 1)); }
function reveal() { state.concealed = false; render(state.run, state.index, false); }
function play() {
  if (state.player === null) {
    state.player = setInterval(() => {
      if (state.index + 1 < DATA.runs[state.run].steps.length) go(state.run, state.index + 1);
      else play();  // the end: pause
    }, 600);
  } else {
    clearInterval(state.player);
    state.player = null;
  }
  $("#play").textContent = state.player === null ? "play" : "pause";
}
// Predict on: the step shown becomes the question too (the class guesses it now), concealed until
// revealed; off: everything shows.
function predictChanged() {
  state.concealed = $("#predict").checked;
  render(state.run, state.index, state.concealed);
  putInAddress();
}
function togglePredict() {
  $("#predict").checked = !$("#predict").checked;
  predictChanged();
}

$("#command").textContent = DATA.command;
$("#tabs").innerHTML = DATA.runs.map((run, k) => `<button role="tab">${escapeHtml(run.name)}</button>`).join(" | ");
document.querySelectorAll("#tabs button").forEach((tab, k) => tab.addEventListener("click", () => showRun(k)));
$("#prev").addEventListener("click", () => go(state.run, state.index - 1));
$("#next").addEventListener("click", () => go(state.run, state.index + 1));
$("#play").addEventListener("click", play);
$("#reveal").addEventListener("click", reveal);
$("#predict").addEventListener("change", predictChanged);
$("#slider").addEventListener("input", () => go(state.run, +$("#slider").value));
for (const svg of document.querySelectorAll(".belt svg")) {  // a click on the belt: that step
  svg.addEventListener("click", (event) => {
    const box = svg.getBoundingClientRect(), x = (event.clientX - box.left) * svg.viewBox.baseVal.width / box.width;
    const number = Math.floor((x - svg.dataset.left) / svg.dataset.stepWidth);
    const index = DATA.runs[state.run].steps.findIndex((step) => step.step >= number);
    if (index !== -1) go(state.run, index);
  });
}
const KEYS = {
  ArrowRight: (by) => go(state.run, state.index + by), ArrowLeft: (by) => go(state.run, state.index - by),
  Home: () => go(state.run, 0), End: () => go(state.run, DATA.runs[state.run].steps.length - 1),
  " ": play, Enter: reveal, p: togglePredict, t: () => showRun((state.run + 1) % DATA.runs.length),
};
window.addEventListener("keydown", (event) => {  // first, before a focused button or the slider takes it
  if (event.ctrlKey || event.metaKey || event.altKey || !KEYS[event.key]) return;
  event.preventDefault();
  KEYS[event.key](event.shiftKey ? 10 : 1);
}, true);
window.addEventListener("keyup", (event) => { if (event.key === " ") event.preventDefault(); }, true);  // no click
window.addEventListener("hashchange", () => {  // a link typed or pasted into the address bar
  const [runIndex, index, predict] = fromHash();
  if (runIndex !== state.run || index !== state.index || predict !== $("#predict").checked) {
    $("#predict").checked = predict;
    go(runIndex, index, predict);
  }
});
const [firstRun, firstIndex, predictFirst] = fromHash();
$("#predict").checked = predictFirst;
go(firstRun, firstIndex, predictFirst);  // opened with predict on: the step it opens on is the question
</script>
</body>
</html>
"""

if __name__ == "__main__":
    main()
