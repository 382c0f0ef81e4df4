"""
A real run, step by step, in one page: the belt, each step's packed rows, the masks they attended under, and
the KV cache they left (per slot, a bar per slot; paged, the pool's blocks and the block tables; with a
prefix cache, the blocks shared, kept and evicted, and the positions each admission found cached).

    python tools/explore.py FILE [the options of nanobatch.py --demo]       the demo's two runs
    python tools/explore.py FILE --prompt TEXT [...]                        your prompts' run

It runs the demo (or your prompts) exactly as nanobatch.py does, the belt on screen, then writes
FILE: one HTML page, its data, style and script inside it, that opens from disk with no network.
The page's HTML, style and script are tools/explore.html, a file to read on its own; this file
records the run and writes its data, and the belts drawn by belt_svg.py, into it.
FILE#run=continuous&step=12 opens it at step 12; with &predict=1, as a question for a class (its packed
rows hidden until revealed). The page draws what the engine recorded (each StepReport and the PackedStep
its forward ran on), never a recomputation, so a broken mask shows as a broken grid, and a block table
read one block off as a block in the wrong colour. Record once, replay in the page: the data sit in
<script id="nanobatch-run">, and one function, render(run, step), draws a step from them alone.
tools/serve.py serves the same page live, each step sent as step_data() makes it here.
"""
import json
import re
import sys
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
from belt_svg import AXIS_H, HATCH, LEFT, RIGHT, SVG_WIDTH, TITLE_H, colour, panel_svg, run_for_file, tag  # noqa: E402
from nanobatch import ROOM_TO_GROW, fail, letter  # noqa: E402

LANE_H = 13  # px: one prompt held by the prefill worker, in its lane under the belt: room for a letter
TEMPLATE = Path(__file__).resolve().with_name("explore.html")  # the page: its HTML, style and script


# ---------------------------------------------------------------------------------------------
# The data: each step as the engine ran it, copied to the host here (never inside generate)


def occupants(reports):
    """{(slot, step): the request in that slot at that step}, as each StepReport recorded its slots."""
    return {(slot, report.step): i for report in reports for slot, i in enumerate(report.occupants) if i is not None}


def bits(mask):
    """A bool mask (..., L) -> a string of 0/1 per row of L, exactly as the engine's tensor holds it."""
    return ["".join("1" if visible else "0" for visible in row) for row in mask.reshape(-1, mask.size(-1)).tolist()]


def rows_and_masks(packed, step, occupant, n_sampled_rows, tokenizer, max_cells=None):
    """One step's PackedStep -> (its rows, its masks), as the page's contract spells them. occupant:
    occupants()'s map. The first n_sampled_rows of logit_rows are the rows sampled; pack_step puts
    static's padding rows after them: rows for slots that hold no request. A mask of more than max_cells
    cells comes without its bits (visible None): the live page's limit, a grid it can draw at every step."""
    def visible(mask):
        return None if max_cells is not None and mask.numel() > max_cells else bits(mask)

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
                          visible=visible(packed.one_token_mask)))  # (S, 1, L) -> S strings of L
    for chunk_rows, slot, mask in packed.chunks:  # (T, L) each, over its own slot
        masks.append(dict(slot=slot, rows=list(range(chunk_rows.start, chunk_rows.stop)), visible=visible(mask)))
    return rows, masks


def request_data(i, request):
    """What the page's script needs of request i: its name and colour, and where its prompt ends. Its
    stay is in the belt, drawn here by belt_svg.py, each stay's details in its tooltip."""
    return dict(letter=letter(i), colour=colour(i), prompt_len=len(request.prompt))


def step_data(report, occupant, tokenizer=None, max_cells=None):
    """One StepReport -> its step in the page's data: its rows and masks (rows_and_masks), its events, and the
    cache as the forward left it. occupant: occupants()'s map. tools/serve.py sends each live step in this
    shape too, so that the live page draws it as this page draws a recorded one."""
    n_sampled_rows = len(report.sampled) - len(report.handed_over)  # handovers: logits, but no row
    rows, masks = rows_and_masks(report.packed, report.step, occupant, n_sampled_rows, tokenizer, max_cells)
    return dict(
        step=report.step, belt=report.belt, rows=rows, masks=masks,
        admitted=report.admitted, handed_over=report.handed_over,
        finished=[[i, c.finish_reason, len(c.tokens)] for i, c in report.finished],
        waiting=report.waiting, at_worker=report.at_worker,  # the queue, and the worker's prompts, after phase 2
        n_waiting=report.n_waiting, n_running=report.n_running, n_prefilling=report.n_prefilling,
        n_prompt_tokens=report.n_prompt_tokens,
        n_one_token=0 if report.packed is None else report.packed.n_one_token,  # D
        cut=None if report.packed is None else report.packed.one_token_mask.size(-1),  # the one-token call's L
        model_s=round(report.model_s, 5), step_s=round(report.step_s, 5),
        # The cache after the step's forward: each slot's request, positions holding a token, and
        # blocks (per slot, [slot]); the positions written this step are the rows' own
        occupants=report.occupants, n_cached=report.n_cached, block_tables=report.block_tables,
        kv_used=report.kv_used, preempted=report.preempted,  # Part 3: sent back to the queue in phase 3
        # Part 4: the positions each admitted request found cached, the free blocks that keep their keys, and
        # the kept blocks this step's new work took (evicted: the engine's record, none without a prefix cache)
        found_cached=report.found_cached, cached_free=report.cached_free, evicted=report.evicted or [])


def run_data(run, requests, completions, reports, tokenizer=None):
    """One run, (name, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache) as nanobatch.Shown.runs
    holds it, with its requests, completions and StepReports -> its part of the page's data. Every
    step's figures come from its StepReport, the cache's too (who sits in each slot, its positions
    held, its block table, the blocks kept: after the forward, before phase 7 retires anyone); the belt
    is drawn from the reports too (belts_html), the worker's lane from the completions."""
    name, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache = run  # kv_blocks None: per slot
    occupant = occupants(reports)
    steps = [step_data(report, occupant, tokenizer) for report in reports]
    return dict(name=name, n_slots=n_slots, policy=policy, prefill_chunk=prefill_chunk, disaggregate=disaggregate,
                kv_blocks=kv_blocks, prefix_cache=prefix_cache,
                kv_total=reports[0].kv_total if reports else 0,  # the cache's positions
                requests=[request_data(i, request) for i, request in enumerate(requests)], steps=steps)


def page_data(shown, command=""):
    """What --demo or --prompt ran (nanobatch.Shown) -> the page's data: {"runs": [...]}, and more."""
    runs = [run_data(run, shown.requests, shown.completions[run[0]], shown.reports[run[0]], shown.tokenizer)
            for run in shown.runs]
    return dict(command=command, has_text=shown.tokenizer is not None, runs=runs,
                room_to_grow=ROOM_TO_GROW)  # Part 3: the tokens of growth admission keeps free for each request


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
    for name, n_slots, _, _, disaggregate, *_ in shown.runs:
        completions, reports = shown.completions[name], shown.reports[name]
        n_steps = reports[-1].step + 1 if reports else 1
        step_w = (SVG_WIDTH - LEFT - RIGHT) / n_steps  # px per step: this run spans the width
        panel, bottom = panel_svg(name, n_slots, reports, shown.summaries[name], None, step_w, n_steps, 1, 0)
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
    """The whole page as text: what ran, its data and its belts, in tools/explore.html."""
    return filled(page_data(shown, command), belts_html(shown))


def filled(data, belts):
    """tools/explore.html with its markers, __HATCH__, __BELTS__ and __DATA__, filled in, in one pass (so
    that nothing put in is read as a marker). tools/serve.py fills it too: a live run, its belt drawn live."""
    data = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # no "</script>"
    parts = dict(HATCH=HATCH, BELTS=belts, DATA=data)
    return re.sub(r"__(HATCH|BELTS|DATA)__", lambda marker: parts[marker[1]], TEMPLATE.read_text())


def main(argv=None):
    """Run the demo or the prompts as nanobatch.py does, write FILE -> what ran (nanobatch.Shown)."""
    path, rest, shown = run_for_file(argv, "tools/explore.py", "A run, step by step, in one HTML page written to "
                                     "FILE: the demo's (continuous, then static), or your prompts'.", "page")
    try:
        Path(path).write_text(page_html(shown, " ".join(["python tools/explore.py", path, *rest])))
    except OSError as e:  # no permission, a folder by that name
        fail(f"{path}: {e}")
    name, reports = shown.runs[0][0], shown.reports[shown.runs[0][0]]
    number = reports[min(12, len(reports) - 1)].step  # step 12, or the last of a shorter run
    print(f"\nthe run, step by step: {path} (open it in a browser; at step {number}, say: "
          f"{Path(path).resolve().as_uri()}#run={quote(name, safe='')}&step={number})")  # a space as %20
    return shown


if __name__ == "__main__":
    main()
