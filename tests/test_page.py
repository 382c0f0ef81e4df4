"""
The step made visible: the README's worked step, and the page of tools/explore.py, whose rows, masks
and events must be the engine's own.
"""
import contextlib
import dataclasses
import html
import io
import itertools
import json
import re
import shutil
import subprocess
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from decimal import ROUND_HALF_UP, Decimal
from types import SimpleNamespace

import pytest
import torch

import model as model_py
import nanobatch
from nanobatch import Request, generate
from tests.common import MAX_LEN, REPO, hand_worked_requests, random_workload, record_forwards, tiny_gpt
from tests.test_schedule import RUNS as SCHEDULED
import belt_svg  # noqa: E402 (tools/, put on the path by tests.common)
import explore  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The step made visible: the README's worked step, and the page of tools/explore.py
#
# The README works one step through pack_step, number for number; the page draws every step of a real
# run from the engine's own data (each StepReport's PackedStep), never a recomputation. Its rows and
# masks must be what the loop's forward_packed calls received (captured here, in the calling thread
# only: a prefill worker's own calls are not the loop's), its events what the StepReports said; a
# planted broken mask must show in its data; the page must stand alone; and, where Chromium is
# installed, a deep link must open on that step with those rows and cells in the DOM.


def worked_step(c_prompt_len=6):
    """The README's worked step, built by the engine's own plan_step and pack_step: A (slot 1) and B
    (slot 0) decode, C (slot 2) has 3 of its 6 prompt tokens in, D (slot 3) has a one-token prompt,
    the prompt budget is 4. A sits above B on the belt, so that the packed rows' order (by request)
    and the one-token mask's (by slot) differ. Token ids are made up so that the tens name the request
    (A = 1..., D = 4...) and the units the position. -> (the belt, slot by slot, and pack_step's two)"""
    def running(index, slot, prompt, tokens, n_cached, arrival):
        request = Request(prompt, max_new_tokens=10, arrival=arrival)
        return nanobatch.Running(index, request, slot, None, admit_step=0, n_cached=n_cached, tokens=tokens)

    belt = [running(1, 0, [20, 21, 22], [23, 24, 25], n_cached=5, arrival=0),  # B: all in but 25, at position 5
            running(0, 1, [10, 11], [12], n_cached=2, arrival=0),  # A: prompt and first token in but 12, at position 2
            running(2, 2, list(range(30, 30 + c_prompt_len)), [], n_cached=3, arrival=1),  # C: 30..32 went in before
            running(3, 3, [40], [], n_cached=0, arrival=2)]  # D: a one-token prompt, admitted this step
    work = nanobatch.plan_step(belt, prefill_chunk=4)
    return belt, *nanobatch.pack_step(work, [], n_slots=4, device=torch.device("cpu"))


def spaced_bits(mask_row):
    """A mask's row as the README draws it: 1 or 0 per position, a space between."""
    return " ".join(str(int(visible)) for visible in mask_row)


def readme_worked_step(belt, packed, to_sample):
    """The worked step as the README prints it, made from the PackedStep: what the README must hold."""
    M, D = len(packed.tokens), packed.n_one_token
    name = [nanobatch.letter(belt[slot].request_index) for slot in packed.slots.tolist()]  # each row's request

    def line(label, values):
        return f"{label:<11}" + "".join(f"{value:>4}" for value in values)

    (chunk_rows, chunk_slot, chunk_mask), = packed.chunks
    top = [line("row", range(M)), line("request", name), line("tokens", packed.tokens.tolist()),
           line("positions", packed.positions.tolist()), line("slots", packed.slots.tolist()),
           f"n_one_token = {D}: rows 0..{D - 1} attend together; rows {chunk_rows.start}..{chunk_rows.stop - 1},"
           f" a chunk, alone over slot {chunk_slot}",
           f"logit_rows = {packed.logit_rows.tolist()}: the rows sampled, for "
           + ", ".join(nanobatch.letter(run.request_index) for run in to_sample) + ", in that order"]
    S, _, L = packed.one_token_mask.shape
    one_token_slots = packed.slots[:D].tolist()
    left = [f"one_token_mask, (S, 1, L) = ({S}, 1, {L})", f"{'query':<8}{'from':<12}" + " ".join(map(str, range(L)))]
    for slot in range(S):
        source = f"row {one_token_slots.index(slot)} ({name[one_token_slots.index(slot)]})" \
            if slot in one_token_slots else "a dummy"
        left.append(f"slot {slot}  {source:<12}{spaced_bits(packed.one_token_mask[slot, 0])}")
    right = [f"chunks[0]: rows {chunk_rows.start}..{chunk_rows.stop - 1}, slot {chunk_slot}, (T, L) = "
             f"{tuple(chunk_mask.shape)}",
             f"{'row (request, pos)':<20}" + " ".join(map(str, range(chunk_mask.size(-1))))]
    for row, mask_row in zip(range(chunk_rows.start, chunk_rows.stop), chunk_mask):
        right.append(f"row {row} ({name[row]}, {int(packed.positions[row])})        {spaced_bits(mask_row)}")
    right += [""] * (len(left) - len(right))
    return "\n".join(top + [""] + [f"{a:<42}{b}".rstrip() for a, b in zip(left, right)])


def test_readme_worked_step():
    """The README's worked step is what plan_step and pack_step make of that belt, number for number,
    the rows sampled in the order of the runs due a token; and so is its variant, C with a prompt of 8,
    which takes the whole budget and leaves D out of the step."""
    belt, packed, to_sample = worked_step()
    assert packed.tokens.tolist() == [12, 25, 40, 33, 34, 35]
    assert packed.n_one_token == 3 and packed.logit_rows.tolist() == [0, 1, 2, 5]
    assert [run.request_index for run in to_sample] == [0, 1, 3, 2]
    text = readme_worked_step(belt, packed, to_sample)
    readme = (REPO / "README.md").read_text()
    assert text in readme, "the README's worked step differs from what pack_step makes; it should read:\n" + text
    _, packed, to_sample = worked_step(c_prompt_len=8)
    variant = (f"rows `{packed.tokens.tolist()}`, `n_one_token = {packed.n_one_token}`, dummies for slots 2 and 3, "
               f"`logit_rows = {packed.logit_rows.tolist()}`")
    assert variant in " ".join(readme.split()), variant  # the README's lines wrap anywhere
    assert packed.slots[:packed.n_one_token].tolist() == [1, 0] and [run.request_index for run in to_sample] == [0, 1]


RUNS = {  # name -> generate's options: chunks beside one-token rows; static's padding; the worker's steps
    "continuous": dict(n_slots=3, policy="continuous", prefill_chunk=5),
    "static": dict(n_slots=3, policy="static", prefill_chunk=5),
    "disaggregated": dict(n_slots=3, policy="continuous", prefill_chunk=None, disaggregate=True),
    "paged": dict(n_slots=3, policy="continuous", prefill_chunk=5, kv_blocks=5, kv_block_size=8),  # preempts
}


def explored(monkeypatch, name):
    """A run of RUNS[name] on a tiny model, its forward calls recorded -> (its page data, reports, calls)."""
    options = RUNS[name]
    requests, reports = random_workload(seed=3, n_requests=7), []
    calls = record_forwards(monkeypatch)
    completions = generate(tiny_gpt(), requests, max_len=MAX_LEN, eos_id=None, on_step=reports.append, **options)
    run = (name, options["n_slots"], options["policy"], options["prefill_chunk"], options.get("disaggregate", False),
           options.get("kv_blocks"), options.get("prefix_cache", False))
    return explore.run_data(run, requests, completions, reports), reports, calls


def bits(mask):
    """(..., L) bool -> a string of 0/1 per row of L: the contract's "visible", worked out here on its own."""
    return ["".join(str(int(visible)) for visible in row) for row in mask.reshape(-1, mask.size(-1)).tolist()]


def row_kinds(call, occupants):
    """Each row's kind, from the forward's PackedStep and who held each slot: the D one-token rows,
    then each chunk's (a chunk of one row: a one-token row alone past the cut); a slot no one holds,
    padding."""
    kinds = ["one-token"] * call.n_one_token
    for chunk_rows, _, _ in call.chunks:
        T = chunk_rows.stop - chunk_rows.start
        kinds += ["chunk" if T > 1 else "alone past the cut"] * T
    return ["padding" if occupants[slot] is None else kind for slot, kind in zip(call.slots.tolist(), kinds)]


def check_against_forwards(data, reports, calls):
    """Step by step: a step with a forward has exactly that call's rows and masks, its D and its cut
    (the one-token call's L, its mask's last dimension); one without has none."""
    forward_steps = [(step, report) for step, report in zip(data["steps"], reports) if report.packed is not None]
    assert len(forward_steps) == len(calls), f"{len(forward_steps)} steps with a forward, {len(calls)} calls"
    for step in data["steps"]:
        if not any(step is s for s, _ in forward_steps):
            assert step["rows"] == [] and step["masks"] == [], f"step {step['step']}: rows without a forward"
            assert (step["n_one_token"], step["cut"]) == (0, None), f"step {step['step']}: D or a cut without a forward"
    for (step, report), call in zip(forward_steps, calls):
        rows, where = step["rows"], f"step {step['step']}"
        assert [row["slot"] for row in rows] == call.slots.tolist(), where
        assert [row["position"] for row in rows] == call.positions.tolist(), where
        assert [row["token"] for row in rows] == call.tokens.tolist(), where
        assert [row["request"] for row in rows] == [report.occupants[slot] for slot in call.slots.tolist()], where
        assert [row["kind"] for row in rows] == row_kinds(call, report.occupants), where
        assert (step["n_one_token"], step["cut"]) == (call.n_one_token, call.one_token_mask.size(-1)), where
        n_sampled = len(report.sampled) - len(report.handed_over)  # handovers come after the forward's rows
        sampled_rows, padding_rows = call.logit_rows[:n_sampled].tolist(), call.logit_rows[n_sampled:].tolist()
        assert [i for i, row in enumerate(rows) if row["sampled"]] == sorted(sampled_rows), where
        assert [rows[i]["request"] for i in sampled_rows] == report.sampled[:n_sampled], where
        assert [i for i, row in enumerate(rows) if row["request"] is None] == sorted(padding_rows), where
        assert all(row["kind"] == "padding" for row in rows if row["request"] is None), where
        D, S = call.n_one_token, call.one_token_mask.size(0)
        want = []
        if D:  # a forward with no one-token rows has no one-token mask
            row_of_slot = {slot: i for i, slot in enumerate(call.slots[:D].tolist())}
            want.append(dict(slot=None, rows=[row_of_slot.get(s) for s in range(S)], visible=bits(call.one_token_mask)))
        want += [dict(slot=slot, rows=list(range(chunk_rows.start, chunk_rows.stop)), visible=bits(mask))
                 for chunk_rows, slot, mask in call.chunks]
        got = [dict(slot=mask["slot"], rows=mask["rows"], visible=mask["visible"]) for mask in step["masks"]]
        assert got == want, where


@pytest.fixture(scope="module")
def explored_runs():
    """Each of RUNS once, for the tests below -> {name: (its page data, reports, calls)}."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {name: explored(monkeypatch, name) for name in RUNS}


@pytest.mark.parametrize("name", RUNS)
def test_page_rows_and_masks_are_the_forwards(explored_runs, name):
    """Every step's rows and masks in the page's data equal the PackedStep the loop's forward received;
    a static run has padding rows, a disaggregated one steps with no forward."""
    data, reports, calls = explored_runs[name]
    check_against_forwards(data, reports, calls)
    kinds = {row["kind"] for step in data["steps"] for row in step["rows"]}
    if name == "static":
        assert "padding" in kinds
    if name == "disaggregated":
        assert any(not step["rows"] for step in data["steps"]), "the loop never waited for the worker"
        assert "chunk" not in kinds, "the loop fed a prompt chunk itself"
    if name == "continuous":
        assert any(step["n_one_token"] and any(row["kind"] == "chunk" for row in step["rows"])
                   for step in data["steps"]), "no chunk went in beside one-token rows"


def test_rows_past_the_cut_are_chunks_of_one(monkeypatch):
    """With attention calls made free, long one-token rows attend alone: each a chunk of one row."""
    monkeypatch.setattr(model_py, "CALL_COST_IN_KEYS", {"cpu": 0, "gpu": 0})
    data, reports, calls = explored(monkeypatch, "continuous")
    check_against_forwards(data, reports, calls)
    alone = [mask for step in data["steps"] for mask in step["masks"]
             if mask["slot"] is not None and step["rows"][mask["rows"][0]]["kind"] == "alone past the cut"]
    assert alone, "no row attended alone past the cut"
    assert all(len(mask["rows"]) == 1 and len(mask["visible"]) == 1 for mask in alone)


@pytest.mark.parametrize("name", RUNS)
def test_page_events_are_the_step_reports(explored_runs, name):
    """Every step's events and counts in the page's data are its StepReport's."""
    data, reports, _ = explored_runs[name]
    assert len(data["steps"]) == len(reports)
    for step, report in zip(data["steps"], reports):
        assert (step["step"], step["belt"]) == (report.step, report.belt)
        assert (step["admitted"], step["handed_over"]) == (report.admitted, report.handed_over)
        assert step["finished"] == [[i, c.finish_reason, len(c.tokens)] for i, c in report.finished]
        assert (step["n_waiting"], step["n_running"], step["n_prefilling"], step["n_prompt_tokens"]) == \
               (report.n_waiting, report.n_running, report.n_prefilling, report.n_prompt_tokens)
        assert (step["waiting"], step["at_worker"]) == (report.waiting, report.at_worker), f"step {report.step}"
        assert len(step["waiting"]) == report.n_waiting, f"step {report.step}: the queue the page names"
        assert (step["model_s"], step["step_s"]) == (pytest.approx(report.model_s, abs=1e-5),
                                                     pytest.approx(report.step_s, abs=1e-5))


@pytest.mark.parametrize("name", RUNS)
def test_page_cache_is_the_step_reports(explored_runs, name):
    """Every step's cache in the page's data is its StepReport's: who sits in each slot, each slot's
    positions held and block table, kv_used, the requests preempted; the run's pool (kv_blocks, None per
    slot) and kv_total. Paged, the tables the forward read through begin with the tables recorded."""
    data, reports, calls = explored_runs[name]
    assert (data["kv_blocks"], data["kv_total"]) == (RUNS[name].get("kv_blocks"), reports[0].kv_total)
    for step, report in zip(data["steps"], reports):
        assert (step["occupants"], step["n_cached"], step["block_tables"], step["kv_used"], step["preempted"]) == \
               (report.occupants, report.n_cached, report.block_tables, report.kv_used, report.preempted), step["step"]
    forwards = [report for report in reports if report.packed is not None]
    for report, call in zip(forwards, calls):
        if call.block_tables is None:
            assert all(table in ([], [slot]) for slot, table in enumerate(report.block_tables)), report.step
        else:
            assert all(call.block_tables[slot, :len(table)].tolist() == table
                       for slot, table in enumerate(report.block_tables)), report.step
    if name == "paged":
        assert sum(len(step["preempted"]) for step in data["steps"]) >= 2, "no preemption on the page"


def check_run_fields(run, ran, requests, reports):
    """The run's own fields in its part of the page's data are what ran, (name, n_slots, policy,
    prefill_chunk, disaggregate, kv_blocks, prefix_cache) as nanobatch.Shown holds it, and its reports'
    kv_total; each request's letter, its colour (the belt's, belt_svg.colour) and its prompt's length."""
    fields = ("name", "n_slots", "policy", "prefill_chunk", "disaggregate", "kv_blocks", "prefix_cache")
    assert tuple(run[field] for field in fields) == tuple(ran), f"{run['name']}: the run, {ran}"
    assert run["kv_total"] == reports[0].kv_total, f"{run['name']}: {run['kv_total']} positions"
    assert run["requests"] == [dict(letter=nanobatch.letter(i), colour=belt_svg.colour(i), prompt_len=len(request.prompt))
                               for i, request in enumerate(requests)], f"{run['name']}: the requests"


@pytest.mark.parametrize("name", RUNS)
def test_page_run_is_what_ran(explored_runs, name):
    """A run's name, slots, policy, prompt budget, worker, pool, prefix cache, positions and requests in
    the page's data are those it ran with (the tab, the cache's title and every '(a prompt token)' read
    them)."""
    data, reports, _ = explored_runs[name]
    options = RUNS[name]
    ran = (name, options["n_slots"], options["policy"], options["prefill_chunk"], options.get("disaggregate", False),
           options.get("kv_blocks"), options.get("prefix_cache", False))
    check_run_fields(data, ran, random_workload(seed=3, n_requests=7), reports)


def leaks(data):
    """(step, mask slot, query row) wherever a query may see a position past its own."""
    return [(step["step"], mask["slot"], r) for step in data["steps"] for mask in step["masks"]
            for r, visible in zip(mask["rows"], mask["visible"])
            if r is not None and "1" in visible[step["rows"][r]["position"] + 1:]]


def sees_one_past_its_own(positions, L):
    """Broken on purpose: a token may see the position after its own too."""
    return torch.arange(L, device=positions.device)[None, None, :] <= positions[:, :, None] + 1  # (B, T, L)


def broken_both_ways(positions, L):
    """Broken on purpose, both ways: a token may see the position after its own, and none sees positions
    1 and 2 (a token at 1 or 2 misses its own position, a later one two earlier positions)."""
    key_positions = torch.arange(L, device=positions.device)[None, None, :]
    hidden = (key_positions >= 1) & (key_positions <= 2) & (key_positions <= positions[:, :, None])
    return (key_positions <= positions[:, :, None] + 1) & ~hidden  # (B, T, L)


def test_a_broken_mask_shows_in_the_page(explored_runs, monkeypatch):
    """The page draws the engine's masks, not its own: a mask that lets a row see the position after
    its own shows as a 1 past the query's position; the engine's own never does."""
    assert all(leaks(data) == [] for data, _, _ in explored_runs.values())
    monkeypatch.setattr(nanobatch, "attention_mask", sees_one_past_its_own)
    broken, reports, calls = explored(monkeypatch, "continuous")
    check_against_forwards(broken, reports, calls)
    assert leaks(broken), "the broken mask left no trace in the page's data"


# ---------------------------------------------------------------------------------------------
# The page itself: the --quick demo, written once for these tests


@pytest.fixture(scope="module")
def quick_page(quick_demo):
    """tools/explore.py FILE --quick, its forwards recorded (tests/common.py's quick_demo, run once for the
    suite: the labs read it too) -> (the page's path, its text, its data, calls, Shown)."""
    return quick_demo.path, quick_demo.page, quick_demo.data, quick_demo.calls, quick_demo.shown


def test_quick_page_data_are_the_forwards(quick_page):
    """The data the page carries (parsed back out of it) are the forwards of both demo runs, in order."""
    _, _, data, calls, shown = quick_page
    assert [run["name"] for run in data["runs"]] == ["continuous", "static"]
    for run, ran in zip(data["runs"], shown.runs):
        check_run_fields(run, ran, shown.requests, shown.reports[ran[0]])
    for run in data["runs"]:
        n_calls = sum(report.packed is not None for report in shown.reports[run["name"]])
        check_against_forwards(run, shown.reports[run["name"]], calls[:n_calls])
        calls = calls[n_calls:]
    assert calls == []


def test_the_page_stands_alone(quick_page):
    """One file: no reference to anything outside it, and under 2 MB."""
    _, page, _, _, _ = quick_page
    assert len(page.encode()) < 2e6
    outside_the_data = re.sub(r'<script type="application/json".*?</script>', "", page, flags=re.S)
    assert not re.search(r"\b(src|href)\s*=", outside_the_data)
    assert not re.search(r"<(link|iframe|img|object|embed)\b|@import|https?:", outside_the_data, re.I)
    assert all(url == "url(#hatch)" for url in re.findall(r"url\([^)]*\)", outside_the_data))


def opened(path, link):
    """Headless Chromium at FILE#link -> the DOM as text, its scripts run; without Chromium, a skip.
    The page's tests read what a script of theirs, put in the page, wrote into the DOM."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no Chromium here to open the page in (Debian: apt-get install chromium)")
    # Within 120 s: the probe, three launches at once on two cores shared with other work, took 23 s once.
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           f"{path.as_uri()}#{link}"], capture_output=True, text=True, timeout=120, check=True).stdout


FOLLOW_LINKS = """<script>
// What the page shows as opened, at the link it was opened at; then each link as if typed into the
// address bar (the page reads a link on load and on hashchange, with one function): what it then
// shows, into the DOM for the test to read.
function shownNow() {
  const notice = document.querySelector("#notice");
  return {step: document.querySelector("#shown-step").textContent.trim(), notice: notice.hidden ? "" : notice.textContent,
          rows: [...document.querySelectorAll("#packed .row")].map((row) => [+row.dataset.slot, +row.dataset.position]),
          cells: [...document.querySelectorAll(".cell[data-visible]")].map((cell) => cell.dataset.visible).join(""),
          hash: location.hash, info: document.querySelector("#step-info").textContent,
          packed: document.querySelector("#packed-title").textContent,
          titles: [...document.querySelectorAll("#packed .row")].map((row) => row.title),
          captions: [...document.querySelectorAll("#packed .caption")].map((caption) => caption.textContent),
          grids: [...document.querySelectorAll("#attention .grid")].map((grid) => [
            grid.querySelector(".caption").textContent,
            ...[...grid.querySelectorAll(".qrow .label")].map((label) => label.textContent)])};
}
const loaded = shownNow();
const followed = LINKS.map((link) => {
  history.replaceState(null, "", "#" + link);
  window.dispatchEvent(new HashChangeEvent("hashchange"));
  return shownNow();
});
document.body.dataset.followed = JSON.stringify({loaded, followed});
</script>
</body>"""
OPENED_AT = ("static", 5)  # a step with padding, dummy queries, and a chunk that starts mid-prompt (its L past its T)
FOLLOWED = ["run=Static&step=12", "run=static&step=abc", "run=static&step=100000", "run=continuous&step=12&predict=1"]


def following_page(quick_page, folder):
    """The quick page with FOLLOW_LINKS in it, then PRESS_KEYS -> (its file, the link to open it at)."""
    _, page, _, _, _ = quick_page
    path = folder / "following.html"
    path.write_text(page.replace("</body>", FOLLOW_LINKS.replace("LINKS", json.dumps(FOLLOWED))
                                 .replace("</body>", PRESS_KEYS)))
    return path, "run={}&step={}".format(*OPENED_AT)


@pytest.fixture(scope="module")
def launched(quick_page, by_hand, crowded_run, tmp_path_factory):
    """The three pages the tests below open in Chromium (following_page, probed_page, crowded_page),
    written, then opened all at once, a Chromium each -> {page: a Future of its DOM}. A launch mostly
    waits, a second or two on two cores: three at once take hardly longer than one."""
    folder = tmp_path_factory.mktemp("pages")
    pages = {"following": following_page(quick_page, folder), "probed": probed_page(by_hand, folder),
             "crowded": crowded_page(crowded_run, folder)}
    launches = ThreadPoolExecutor(len(pages), thread_name_prefix="chromium")
    opening = {name: launches.submit(opened, path, link) for name, (path, link) in pages.items()}
    launches.shutdown(wait=False)  # each test waits for its own page, and the next tests run meanwhile
    return opening


@pytest.fixture(scope="module")
def followed(launched):
    """The quick page opened in headless Chromium at #run=static&step=5, FOLLOW_LINKS in it, then
    PRESS_KEYS -> (what it showed as opened, what it showed at each of FOLLOWED, the DOM at the end)."""
    dom = launched["following"].result()
    shown = json.loads(html.unescape(re.search(r'data-followed="([^"]*)"', dom)[1]))
    return shown["loaded"], shown["followed"], dom


def test_a_deep_link_opens_on_its_step(quick_page, followed):
    """Headless Chromium at FILE#run=static&step=5 shows step 5 of the static run: its number, its
    rows, its mask cells; and every row's title, every caption and every mask's caption and labels
    are those worked out from its StepReport (wanted_rows, below): a chunk's L, say, past its T."""
    _, _, data, _, shown = quick_page
    loaded, _, _ = followed
    name, number = OPENED_AT
    index, step = next((k, step) for run in data["runs"] if run["name"] == name
                       for k, step in enumerate(run["steps"]) if step["step"] == number)
    assert loaded["step"] == str(number)
    assert loaded["rows"] == [[row["slot"], row["position"]] for row in step["rows"]]
    assert loaded["cells"] == "".join("".join(mask["visible"]) for mask in step["masks"])
    titles, captions, grids = wanted_rows(shown.reports[name][index], shown.requests, {}, {})
    assert (loaded["titles"], loaded["captions"], loaded["grids"]) == (titles, captions, grids)
    chunks = [tuple(map(int, found)) for grid in grids for found in re.findall(r"T = (\d+) queries over L = (\d+)", grid[0])]
    assert any(T < L for T, L in chunks) and "dummy" in str(grids) and "pad" in str(grids), \
        "the step has no chunk that starts mid-prompt, or no padding, or no dummy query"


def test_deep_links_that_name_nothing_here_or_ask_a_question(quick_page, followed):
    """A run not in the page opens the first run with a one-line notice naming the runs there are; a
    step that is not a number opens the first step, one past the end the last; &predict=1 opens the
    step as a question: no rows, no cells, no figure that follows from its packing, the link kept."""
    _, _, data, _, _ = quick_page
    _, shown, _ = followed
    steps = {run["name"]: run["steps"] for run in data["runs"]}
    wanted = [steps["continuous"][12], steps["static"][0], steps["static"][-1]]  # continuous: the first run
    for link, got, step in zip(FOLLOWED, shown, wanted):
        assert got["step"] == str(step["step"]), link
        assert got["rows"] == [[row["slot"], row["position"]] for row in step["rows"]], link
    assert shown[0]["notice"] == 'No run named "Static" here; the runs are: continuous, static. Showing continuous.'
    assert shown[1]["notice"] == shown[2]["notice"] == ""
    question = shown[3]
    assert question["step"] == "12" and question["rows"] == [] and question["cells"] == ""
    assert question["hash"] == "#run=continuous&step=12&predict=1" and "M = ? rows" in question["packed"]
    assert "make a token" not in question["info"] and "prompt tokens" not in question["info"]


PRESS_KEYS = """<script>
// At continuous step 5, predict off, as a link typed into the address bar opens it (FOLLOW_LINKS, run
// before this, left the page elsewhere), then keys pressed.
history.replaceState(null, "", "#run=continuous&step=5");
window.dispatchEvent(new HashChangeEvent("hashchange"));
function press(key) { window.dispatchEvent(new KeyboardEvent("keydown", {key})); }
function shown() {  // the rows drawn, the address, and whether a figure that follows from the packing shows
  const text = document.getElementById("step-info").textContent + document.getElementById("packed-title").textContent;
  return document.querySelectorAll("#packed .row").length + " " + location.hash + " " +
    /make a token|prompt tokens|padding row|dumm|M = [0-9]/.test(text);
}
press("p");  // predict on: the step shown becomes the question
document.body.dataset.asked = shown();
press("ArrowRight");  // one step on: its rows, and the figures that give them away, hidden
document.body.dataset.hidden = shown();
press("Enter");  // revealed
document.body.dataset.revealed = shown();
</script>
</body>"""


def test_predict_hides_the_next_step_until_revealed(quick_page, followed):
    """At continuous step 5, the key p (predict) hides step 5's packed rows and every figure that follows
    from them (M, the counts, prompt tokens spent, padding, dummies); the right arrow: step 6, as hidden,
    its address (predict kept) in the hash; Enter shows them all."""
    _, _, data, _, _ = quick_page
    _, _, dom = followed
    n_rows = len(next(step for step in data["runs"][0]["steps"] if step["step"] == 6)["rows"])
    assert 'data-asked="0 #run=continuous&amp;step=5&amp;predict=1 false"' in dom
    assert 'data-hidden="0 #run=continuous&amp;step=6&amp;predict=1 false"' in dom
    assert f'data-revealed="{n_rows} #run=continuous&amp;step=6&amp;predict=1 true"' in dom


def test_rows_carry_the_token_text_where_a_tokenizer_is_loaded(explored_runs):
    """With a tokenizer, each row's text is its token decoded alone; without one, the row has no text."""
    data, reports, _ = explored_runs["continuous"]
    report = next(report for report in reports if report.packed is not None)
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")  # a stand-in: what explore calls, and nothing else
    rows, _ = explore.rows_and_masks(report.packed, report.step, explore.occupants([]), 0, tokenizer)
    assert [row["text"] for row in rows] == [f"<{token}>" for token in report.packed.tokens.tolist()]
    assert all("text" not in row for step in data["steps"] for row in step["rows"])


# ---------------------------------------------------------------------------------------------
# The page's files: tools/explore.html, the template a reader opens, and the script in it


def page_script(page):
    """The page's script: its one <script> that is not the JSON data."""
    return re.search(r"<script>\n(.*?)</script>", page, re.S)[1]


def page_style(page):
    """The page's style: its one <style>."""
    return re.search(r"<style>(.*?)</style>", page, re.S)[1]


def test_the_page_is_its_template_filled_in(quick_page):
    """The page written is tools/explore.html word for word, with its three markers filled in: the
    belts' hatching, the belts, the data."""
    _, page, _, _, _ = quick_page
    template = explore.TEMPLATE.read_text()
    parts = re.split(r"__(?:HATCH|BELTS|DATA)__", template)
    assert len(parts) == 4, "tools/explore.html should hold each of its three markers once"
    assert re.fullmatch("(.*?)".join(map(re.escape, parts)), page, re.S), "the page is not its template filled in"


def test_the_page_script_parses(quick_page, tmp_path):
    """node --check takes the page's script; and the same check refuses it with a brace missing."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no Node.js here to check the page's script with (Debian: apt-get install nodejs)")
    _, page, _, _, _ = quick_page
    script = page_script(page)
    brace_missing = script.replace("function render(runIndex, index, concealed) {", "function render(runIndex)")
    for name, text, parses in [("page.js", script, True), ("broken.js", brace_missing, False)]:
        path = tmp_path / name
        path.write_text(text)
        checked = subprocess.run([node, "--check", str(path)], capture_output=True, text=True, timeout=30)
        assert (checked.returncode == 0) == parses, f"{name}: node --check said {checked.returncode}:\n{checked.stderr}"


def undrawn(data, script):
    """The keys of the page's data (at every level: runs, requests, steps, rows, masks) that its script
    never reads, as `.key`."""
    runs = data["runs"]
    steps = [step for run in runs for step in run["steps"]]
    dicts = [data, *runs, *(request for run in runs for request in run["requests"]), *steps,
             *(row for step in steps for row in step["rows"]), *(mask for step in steps for mask in step["masks"])]
    return sorted(key for key in {key for d in dicts for key in d} if not re.search(rf"\.{key}\b", script))


def test_every_field_of_the_data_is_drawn(quick_page):
    """Every field explore.py writes into the page's data is read by its script: none is carried for
    nothing. Planted: the one-token call's caption says L from its bits again, and `cut` goes unread."""
    _, page, data, _, _ = quick_page
    script = page_script(page)
    assert undrawn(data, script) == []
    assert undrawn(data, script.replace("over L = ${step.cut} positions", "over L = ${L} positions")
                   .replace("the cut is ${step.cut}", "the cut")) == ["cut"]


# ---------------------------------------------------------------------------------------------
# What the page draws, pinned in Chromium, on a schedule worked by hand
#
# Six requests on two slots (HAND_WORKED, tests/common.py; eos_id=None, so each makes exactly
# max_new_tokens), whose schedule is worked out below, run six ways: continuous, static,
# disaggregated, continuous under a mask broken both ways (it sees one position past its own, and hides
# positions 1 and 2), paged in a pool so
# small that a request is preempted, and the same pool with a prefix cache, in which requests find,
# share, keep and evict blocks. The page of these six runs is opened once in Chromium, where a probe
# runs the page's own script again, in a scope of its own, at every step of every run: as written,
# and once per defect planted (its style or script edited here as text). Each check below must pass
# on the page as written and fail on each defect planted for it. One launch for them all: a launch of
# Chromium takes a second or more on two cores, a run of the page's script milliseconds.

# (tests/test_reports.py works out every StepReport of these runs field by field; in short:)
# continuous  step 0    |AB|  A, B admitted (their whole prompts, each a chunk), C waits     queue: C
#             steps 1-3 |AB|  A and B decode                                                 queue: C
#             step 4    |AB|  A's last token (its 5th)                                       queue: C
#             step 5    |CB|  C takes A's slot and makes its one token; B's last (its 6th)   queue: none
#             (the belt empty and no one waiting: the clock jumps to step 10, when D, E, F arrive)
#             step 10   |DE|  D, E admitted, F waits; E (a one-token prompt) makes its one    queue: F
#             step 11   |DF|  F takes E's slot; D's last token, F's one                       queue: none
# static: a slot refills only once every slot is free, so C waits for B, F for D:
#             steps 0-4 |AB| C, step 5 |.B| C, step 6 |C.| none, step 10 |DE| F, step 11 |D.| F, step 12 |F.| none
# paged (Part 3), a pool of 6 blocks of 2 positions, 12 in all (per slot, the two slots reserve 128).
# A request gets in only if the free blocks hold, for it and for each request on the belt, its sequence
# so far and 3 positions more (ROOM_TO_GROW; alone on the belt, its sequence only). Blocks: first freed,
# first taken.
#             step 0    |AB|  A in alone (3 positions: 2 blocks); B beside it, as A's 3 + 3 positions and
#                             B's 2 + 3 take 3 + 3 blocks, the 6 free. A's prompt goes into blocks 0, 1,
#                             B's into block 2                                                queue: C
#             step 1    |AB|  A's position 3 into block 1, B's 2 into block 3                 queue: C
#             step 2    |AB|  A's position 4 into block 4, B's 3 into block 3                 queue: C
#             step 3    |AB|  A's 5 into block 4, B's 4 into block 5: all 6 blocks held       queue: C
#             step 4    |A.|  A's position 6 needs a block and none is free, so B, admitted after A, is
#                             preempted (!B), a bystander: its blocks 2, 3, 5 wiped and freed. A takes
#                             block 2 and makes its last token                                queue: B C
#             step 5    |B.|  B back, alone, into slot 0 (it was in 1): its prompt and 4 tokens again,
#                             positions 0-5 into blocks 3, 5, 0, and its 5th token. C waits: B's 6 + 3
#                             positions and C's 3 + 3 take 5 + 3 blocks, 6 are free           queue: C
#             step 6    |B.|  B's last token (position 6 into block 1). C waits: B's 7 + 3 take 2 blocks
#                             more, C's 3 + 3 three, 3 are free                               queue: C
#             step 7    |C.|  C in (blocks 4, 2) and out                                      queue: none
#             step 10   |DE|  D in alone (blocks 3, 5); E beside it: D's 3 + 3 and E's 1 + 3 take 3 + 2
#                             blocks of the 6 free (E's: block 0). E's one token              queue: F
#             step 11   |D.|  F waits: D's 4 + 3 take 2 blocks more, F's 3 + 3 three, 4 are free. D's last
#                                                                                             queue: F
#             step 12   |F.|  F in (blocks 1, 4) and out                                      queue: none
# prefix cache (Part 4), the same pool, which keeps a full block's keys for a later request whose
# sequence begins with the same tokens (SYSTEM, say). Blocks: free ones without keys first, then kept
# ones, the least recently used first, evicted (their keys dropped). kept: the free blocks with keys as
# the step's report lists them (cached_free), before phase 7 retires anyone. As paged to step 3, then:
#             step 4    |A.|  !B as paged, but B's full blocks 2, 3 (positions 0-3) are kept, and only 5
#                             wiped, which A takes. A makes its last token         queue: B C  kept: 2, 3
#                             (as A leaves, its full blocks 0 (SYSTEM), 1, 4 are kept, 5 wiped)
#             step 5    |B.|  B back into slot 0 finds its own blocks 2, 3 (+B(4 found)): only positions
#                             4-5 go in, into block 5. C finds block 0 but waits: B's 6 + 3 take 3 blocks
#                             beside its 2, C's 3 + 3 two beside block 0, and 3 are free; its try made
#                             block 0 the most recently used                       queue: C    kept: 1, 4, 0
#             step 6    |B.|  B's position 6 needs a block and only kept ones are free: block 1, the least
#                             recently used, is evicted (A's keys dropped)         queue: C    kept: 4, 0
#                             (as B leaves, its 2, 3, 5 are kept, 1 wiped)
#             step 7    |C.|  C finds block 0 (+C(2 found)): only position 2 goes in, into block 1
#                                                                                  queue: none kept: 4, 2, 3, 5
#                             (as C leaves, block 0 is kept, 1 wiped)
#             step 10   |DE|  D finds block 0, kept as C left (+D(2 found)): position 2 into block 1.
#                             E takes block 4, evicted (A's keys dropped)          queue: F    kept: 2, 3, 5
#             step 11   |DF|  F finds block 0, which D holds: shared (+F(2 found)). F gets in where paged F
#                             waited (D's 4 + 3 take 2 blocks more, F's 3 + 3 two beside block 0, and 4 are
#                             free); its position 2 into block 4 (E's, wiped)      queue: none kept: 2, 3, 5
CONTINUOUS_QUEUE = {0: "C", 1: "C", 2: "C", 3: "C", 4: "C", 5: "", 10: "F", 11: ""}  # who waits after admissions
QUEUES = {"continuous": CONTINUOUS_QUEUE, "broken": CONTINUOUS_QUEUE,  # a mask changes no schedule
          "static": {0: "C", 1: "C", 2: "C", 3: "C", 4: "C", 5: "C", 6: "", 10: "F", 11: "F", 12: ""},
          "paged": {0: "C", 1: "C", 2: "C", 3: "C", 4: "BC", 5: "C", 6: "C", 7: "", 10: "F", 11: "F", 12: ""},
          "prefix cache": {0: "C", 1: "C", 2: "C", 3: "C", 4: "BC", 5: "C", 6: "C", 7: "", 10: "F", 11: ""}}
PREFIX_CACHE = {  # the prefix cache by hand: step -> (kept, found: "+K(N found)", evicted, shared), where not none
    4: ([2, 3], [], [], []), 5: ([1, 4, 0], ["+B(4 found)"], [], []), 6: ([4, 0], [], [1], []),
    7: ([4, 2, 3, 5], ["+C(2 found)"], [], []), 10: ([2, 3, 5], ["+D(2 found)"], [4], []),
    11: ([2, 3, 5], ["+F(2 found)"], [], [0])}
BY_HAND = {  # name -> generate's options
    "continuous": dict(policy="continuous"),
    "static": dict(policy="static"),
    "disaggregated": dict(policy="continuous", disaggregate=True),
    "broken": dict(policy="continuous"),  # run with broken_both_ways for the mask
    "paged": dict(policy="continuous", kv_blocks=6, kv_block_size=2),
    "prefix cache": dict(policy="continuous", kv_blocks=6, kv_block_size=2, prefix_cache=True),
}
EMPTY, GREY, RED = "rgb(243, 243, 243)", "rgb(154, 154, 154)", "rgb(238, 0, 0)"  # a 0; padding's 1; a 1 past its row

PLANTED = {  # a defect: (the style or the script, the text as written, the text planted)
    "the shown step's index": ("script", "$(\"#shown-step\").textContent = step.step;",
                               "$(\"#shown-step\").textContent = index;"),
    "the index in the address": ("script", "step=${run.steps[state.index].step}", "step=${state.index}"),
    "a 1 painted as a 0": ("style", ".cell.v1 { background: var(--c); }", ""),
    "cells painted from positions": ("script", '<i class="cell${bit === "1" ? " v1" : ""}',
                                     '<i class="cell${row !== null && l <= row.position ? " v1" : ""}'),
    "its own position marked": ("script", 'if (bit === "1" && l > row.position) marks = " leak";',
                                'if (bit === "1" && l >= row.position) marks = " leak";'),
    "no marks in the one-token call": ("script", 'if (bit === "1" && l > row.position) marks = " leak";',
                                       'if (bit === "1" && l > row.position && mask.slot !== null) marks = " leak";'),
    "no marks in a chunk": ("script", 'if (bit === "1" && l > row.position) marks = " leak";',
                            'if (bit === "1" && l > row.position && mask.slot === null) marks = " leak";'),
    "a hole at its own position unmarked": ("script", 'else if (bit === "0" && l <= row.position) marks = " hole";',
                                            'else if (bit === "0" && l < row.position) marks = " hole";'),
    "a hole outlined as its own position": ("style", ".cell.hole { outline: 2px solid #06c; outline-offset: -2px; }",
                                            ".cell.hole { outline: 1px solid #222; outline-offset: -1px; }"),
    "the frame at the index": ("script", "+svg.dataset.left + step.step * +svg.dataset.stepWidth",
                               "+svg.dataset.left + index * +svg.dataset.stepWidth"),
    "the queue before admission": ("script", "chips(step.waiting)", "chips([...step.admitted, ...step.waiting])"),
    "blocks waited for beside a slot phase 3 freed": ("script", "(i) => i === null).length - step.preempted.length;",
                                                      "(i) => i === null).length;"),
    "block tables shifted by one": ("script", "blocks[block].holders.push(",
                                    "blocks[(block + 1) % nBlocks].holders.push("),
    "fill from kv_used": ("script", "step.n_cached[slot] - k * size", "step.kv_used - k * size"),
    "fill from the table's start": ("script", "step.n_cached[slot] - k * size", "step.n_cached[slot]"),
    "writes into the table's first block": ("script", "table[Math.floor(row.position / size)]", "table[0]"),
    "empty painted as held": ("style", ".seg.empty { background: repeating-linear-gradient(135deg, var(--c) 0 2px, "
                                       "white 2px 6px); }", ".seg.empty { background: var(--c); }"),
    "freed from this step's tables": ("script", "before.block_tables[before.occupants.indexOf(i)]",
                                      "step.block_tables[step.occupants.indexOf(i)]"),
    "free counted in requests": ("script", "<b>${nBlocks - nHeld}</b>", "<b>${nBlocks - nHolders}</b>"),
    "free counted in table entries": ("script", "<b>${nBlocks - nHeld}</b>",
                                      "<b>${nBlocks - step.block_tables.flat().length}</b>"),
    "one holder per block": ("script", "blocks[block].holders.push({slot, request: step.occupants[slot], k, fill});",
                             "blocks[block].holders = [{slot, request: step.occupants[slot], k, fill}];"),
    "shared painted in one colour": ("style", ".seg.shared { background: var(--bands); }",
                                     ".seg.shared { background: var(--c); }"),
    "kept painted as held": ("style", ".seg.kept { background: color-mix(in srgb, var(--c) 30%, white); }",
                             ".seg.kept { background: var(--c); }"),
    "kept drawn as free": ("script", "for (const block of step.cached_free) blocks[block].keptFor",
                           "for (const block of []) blocks[block].keptFor"),
    "kept from the step before": ("script", "for (const block of step.cached_free) blocks[block].keptFor",
                                  "for (const block of (before ?? step).cached_free) blocks[block].keptFor"),
    "evictions from the step before": ("script", "for (const block of step.evicted) blocks[block].evictedFrom",
                                       "for (const block of (before ?? step).evicted) blocks[block].evictedFrom"),
    "evictions left undrawn": ("script", "for (const block of step.evicted) blocks[block].evictedFrom",
                               "for (const block of []) blocks[block].evictedFrom"),
    "found left out of the events": ("script", '(step.found_cached[a] ? `(${step.found_cached[a]} found)` : "")', '""'),
    "found left out of the captions": ("script", 'return n ? `positions ${span(0, n - 1)} found cached` : "";',
                                       'return "";'),
    "found blocks from the table's end": ("script", ".slice(0, step.found_cached[a] / size)",
                                          ".slice(-step.found_cached[a] / size)"),
    "preemptions left out of the line": ("script", "...finished, ...preempted]", "...finished]"),
    "a block's positions one past its end": ("script", "span(holder.k * size, holder.k * size + size - 1)",
                                             "span(holder.k * size, holder.k * size + size)"),
    "a block's positions from its number": ("script", "span(holder.k * size, holder.k * size + size - 1)",
                                            "span(block.block * size, block.block * size + size - 1)"),
    "a block's tokens from its number": ("script", "const start = (first?.k ?? 0) * size, written",
                                         "const start = block.block * size, written"),
    "an answer's first token a prompt token": (
        "script", "const isPrompt = row.request !== null && row.position < run.requests[row.request].prompt_len;",
        "const isPrompt = row.request !== null && row.position <= run.requests[row.request].prompt_len;"),
    "every row sampled": ("script", '(row.sampled ? "its logits sampled" : "not sampled")', '"its logits sampled"'),
    "the one-token call's S from its L": ("script", "S = ${mask.rows.length} queries", "S = ${L} queries"),
    "a chunk's L from its rows": ("script", "T = ${mask.rows.length} queries over L = ${L} positions",
                                  "T = ${mask.rows.length} queries over L = ${mask.rows.length} positions"),
    "every query a dummy": ("script", "oneTokenCall.rows.filter((r) => r === null).length", "oneTokenCall.rows.length"),
    "a slot's fill from kv_used": ("script", "${letter(who)}, ${block.fill} of ${size}",
                                   "${letter(who)}, ${step.kv_used} of ${size}"),
    "the tab's policy the first run's": ("script", "const tabTitle = (run) => `${run.policy} batching",
                                         "const tabTitle = (run) => `${DATA.runs[0].policy} batching"),
    "the step count from the step's number": ("script", "(${index + 1} of ${run.steps.length}",
                                              "(${step.step + 1} of ${run.steps.length}"),
    "a whole prompt one to go": ("script", "const rest = run.requests[row.request].prompt_len - 1 - lastRow.position;",
                                 "const rest = run.requests[row.request].prompt_len - lastRow.position;"),
    "the worker's prompts during the step": (
        "script", 'const held = step.at_worker.length ? chips(step.at_worker).join("") : "none";',
        'const during = [...step.at_worker, ...step.handed_over];\n'
        '    const held = during.length ? chips(during).join("") : "none";'),
}

# The run each defect is planted on: the probe runs a planted page's script over that run's links only (a
# sixth of them, so that its defects cost what the page as written does), one where the defect shows.
PLANTED_ON = {
    "the shown step's index": "continuous", "the index in the address": "continuous",  # the clock jumps there
    "a 1 painted as a 0": "continuous", "cells painted from positions": "broken", "its own position marked": "broken",
    "no marks in the one-token call": "broken", "no marks in a chunk": "broken",
    "a hole at its own position unmarked": "broken", "a hole outlined as its own position": "broken",
    "the frame at the index": "continuous", "the queue before admission": "continuous",
    "the worker's prompts during the step": "disaggregated", "blocks waited for beside a slot phase 3 freed": "paged",
    "block tables shifted by one": "paged", "fill from kv_used": "paged", "fill from the table's start": "paged",
    "writes into the table's first block": "paged", "empty painted as held": "paged",
    "one holder per block": "prefix cache", "shared painted in one colour": "prefix cache",
    "kept painted as held": "prefix cache", "free counted in requests": "paged",
    "free counted in table entries": "prefix cache", "freed from this step's tables": "paged",
    "preemptions left out of the line": "paged", "kept drawn as free": "prefix cache",
    "kept from the step before": "prefix cache", "evictions from the step before": "prefix cache",
    "evictions left undrawn": "prefix cache", "found left out of the events": "prefix cache",
    "found left out of the captions": "prefix cache", "found blocks from the table's end": "prefix cache",
    "an answer's first token a prompt token": "continuous", "every row sampled": "static",
    "a block's positions one past its end": "paged", "a block's positions from its number": "paged",
    "a block's tokens from its number": "paged", "the one-token call's S from its L": "static",
    "a chunk's L from its rows": "prefix cache", "every query a dummy": "static",
    "a slot's fill from kv_used": "continuous", "the tab's policy the first run's": "static",
    "the step count from the step's number": "continuous", "a whole prompt one to go": "continuous",
}
QUESTIONS = ["run=paged&step=4&predict=1", "run=prefix cache&step=4&predict=1", "run=paged&step=5&predict=1"]

# The defects whose checks read the colours painted (check_cells, check_marks, check_mask_marks,
# check_cache_cells): the
# probe reads each cell's computed style for these only (a style read per cell, in 43 runs of the page's
# script over every link, took a third of the probe's seconds: on two shared cores, 8 to 10 s read for
# every defect, 6 s for these 13 only; 15 now).
PAINTED = {"a 1 painted as a 0", "cells painted from positions", "its own position marked",
           "no marks in the one-token call", "no marks in a chunk", "block tables shifted by one", "fill from kv_used",
           "a hole at its own position unmarked", "a hole outlined as its own position",
           "fill from the table's start", "writes into the table's first block", "empty painted as held",
           "one holder per block", "shared painted in one colour", "kept painted as held"}

PROBE = """<script>
const VARIANTS = __VARIANTS__, PAINTED = __PAINTED__;  // filled in by the fixture below
let measure = true;  // read the cache's widths too: a layout each link, so only for the page as written
let paint = true;  // read each cell's colours: for the page as written and the defects in PAINTED only
// The probe: at each link, what the page drew: the step shown, the address, the frames' x, each part
// of the step's figures with its chips, and each mask cell's data-visible and its colour as painted.
function look(hash) {
  const belt = [...document.querySelectorAll(".belt")].find((belt) => belt.style.display !== "none");
  const cell = (cell) => {
    const painted = paint ? getComputedStyle(cell) : {};
    return [cell.dataset.visible, painted.backgroundColor, painted.backgroundImage !== "none",
            painted.outlineStyle === "none" ? "none" : `${painted.outlineColor} ${painted.outlineWidth}`];
  };
  return {step: document.querySelector("#shown-step").textContent, hash,
          frames: [...belt.querySelectorAll(".mark")].map((frame) => +frame.getAttribute("x")),
          rows: [...document.querySelectorAll("#packed .row")].map((row) => [+row.dataset.slot, +row.dataset.position]),
          info: [...document.querySelectorAll("#step-info > span")].map((span) =>
            [span.textContent, [...span.querySelectorAll(".chip")].map((chip) => chip.textContent)]),
          grids: [...document.querySelectorAll("#attention .grid")].map((grid) =>
            [...grid.querySelectorAll(".qrow")].map((query) => [...query.querySelectorAll(".cell")].map(cell))),
          captions: [...document.querySelectorAll("#packed .caption")].map((caption) => caption.textContent),
          blocks: [...document.querySelectorAll("#cache .block")].map((block) => ({
            block: +block.dataset.block, request: block.dataset.request, slot: block.dataset.slot,
            fill: +block.dataset.fill, freed: block.dataset.freed, kept: block.dataset.kept,
            evicted: block.dataset.evicted,
            found: block.dataset.found, label: block.previousElementSibling.textContent, title: block.title,
            width: measure ? block.clientWidth : null,
            segments: [...block.querySelectorAll(".seg")].map((segment) => {
              const painted = paint ? getComputedStyle(segment) : {};
              return [segment.classList[1], +segment.dataset.n, painted.backgroundColor, painted.backgroundImage,
                      painted.boxShadow, measure ? segment.getBoundingClientRect().width : null];
            })})),
          figures: document.querySelector("#cache .kv-figures").textContent,
          preemption: document.querySelector("#cache .preemption")?.textContent ?? "",
          foundLine: document.querySelector("#cache .found-line")?.textContent ?? "",
          eviction: document.querySelector("#cache .eviction")?.textContent ?? "",
          tables: [...document.querySelectorAll("#cache .tables > span")].map((span) => [+span.dataset.slot,
                                                                                         span.textContent]),
          texts: {count: document.querySelector("#step-count").textContent,  // every other text and title drawn
                  packed: document.querySelector("#packed-title").textContent,
                  cache: document.querySelector("#cache-title").textContent,
                  tabs: [...document.querySelectorAll("#tabs button")].map((tab) => [tab.textContent, tab.title]),
                  rows: [...document.querySelectorAll("#packed .row")].map((row) => row.title),
                  grids: [...document.querySelectorAll("#attention .grid")].map((grid) => [
                    grid.querySelector(".caption").textContent,
                    ...[...grid.querySelectorAll(".qrow .label")].map((label) => label.textContent)])}};
}
// Each request's colour, as the browser paints it, and pale, as a kept block's cells (Part 4).
const probe = document.body.appendChild(document.createElement("i"));
const requests = JSON.parse(document.getElementById("nanobatch-run").textContent).runs[0].requests;
const painted = (background) => {
  probe.style.background = background;
  return getComputedStyle(probe).backgroundColor;
};
const colours = requests.map((request) => painted(request.colour));
const pale = requests.map((request) => painted(`color-mix(in srgb, ${request.colour} 30%, white)`));
// Each variant's style and script (the page's, or with a defect planted): the script run again in a
// function of its own, then each of its links followed as the page follows one (fromHash, then go). Its
// address bar is an object of its own: Chrome throttles history.replaceState, called here hundreds of times.
const looked = {};
for (const [name, [style, script, links]] of Object.entries(VARIANTS)) {
  document.querySelector("style").textContent = style;
  measure = name === "as written";
  paint = measure || PAINTED.includes(name);
  const address = {hash: ""}, history = {replaceState: (state, title, hash) => { address.hash = hash; }};
  try {
    looked[name] = new Function("LINKS", "look", "location", "history", script + `
      return LINKS.map((link) => { location.hash = "#" + link; go(...fromHash()); return look(location.hash); });`
    )(links, look, address, history);
  } catch (error) {
    looked[name] = String(error);
  }
}
document.body.dataset.looked = JSON.stringify({colours, pale, looked});
</script>
</body>"""


def run_by_hand(name):
    """BY_HAND[name] on two slots, on a tiny model -> (the run as Shown holds it, completions, reports,
    {step: the blocks the prefix cache evicted in it}, recorded in the engine as it evicts them)."""
    options, reports, evicted = BY_HAND[name], [], {}
    take_block = nanobatch.PrefixCache.take_block

    def evicting(pool):  # PrefixCache.take_block, noting each kept block it takes: an eviction
        kept, block = pool.kept, take_block(pool)
        if block in kept:
            evicted.setdefault(len(reports), []).append(block)  # the report of this step comes next
        return block

    with pytest.MonkeyPatch.context() as monkeypatch:
        if name == "broken":
            monkeypatch.setattr(nanobatch, "attention_mask", broken_both_ways)
        monkeypatch.setattr(nanobatch.PrefixCache, "take_block", evicting)
        completions = generate(tiny_gpt(), hand_worked_requests(), n_slots=2, eos_id=None, on_step=reports.append,
                               **options)
    run = (name, 2, options["policy"], None, options.get("disaggregate", False), options.get("kv_blocks"),
           options.get("prefix_cache", False))
    return run, completions, reports, {reports[k].step: blocks for k, blocks in evicted.items()}


def probe_links(data):
    """Every step of every run, by its number, and one link into the gap: (link, run, the step it must show)."""
    links = [(f"run={run['name']}&step={step['step']}", run, step) for run in data["runs"] for step in run["steps"]]
    continuous = data["runs"][0]
    return links + [("run=continuous&step=7", continuous, continuous["steps"][6])]  # 7: in the gap, so step 10


@pytest.fixture(scope="module")
def by_hand():
    """BY_HAND's six runs, as nanobatch.Shown holds them, and their page -> a namespace: shown, page, data,
    and evicted: {run name: {step: the blocks the engine evicted in it}}."""
    requests, runs, completions, reports, evicted = hand_worked_requests(), [], {}, {}, {}
    for name in BY_HAND:
        run, completions[name], reports[name], evicted[name] = run_by_hand(name)
        runs.append(run)
    summaries = {name: nanobatch.summarize(requests, completions[name], reports[name], 1.0) for name in BY_HAND}
    shown = nanobatch.Shown(requests, runs, completions, summaries, reports, None)
    page = explore.page_html(shown)
    data = json.loads(re.search(r'<script type="application/json" id="nanobatch-run">(.*?)</script>', page, re.S)[1])
    return SimpleNamespace(shown=shown, page=page, data=data, evicted=evicted)


def probed_page(by_hand, folder):
    """by_hand's page, QUESTIONS followed in it (FOLLOW_LINKS), then the probe, its variants filled in ->
    (its file, the link to open it at)."""
    page, links = by_hand.page, probe_links(by_hand.data)
    variants = {"as written": [page_style(page), page_script(page), [link for link, _, _ in links]]}
    assert set(PLANTED_ON) == set(PLANTED), set(PLANTED) ^ set(PLANTED_ON)
    for name, (where, written, planted) in PLANTED.items():
        style, script, _ = variants["as written"]
        assert (style if where == "style" else script).count(written) == 1, f"{name}: {written!r} is not in the page"
        variants[name] = [style.replace(written, planted), script] if where == "style" else \
            [style, script.replace(written, planted)]
        variants[name].append([link for link, run, _ in links if run["name"] == PLANTED_ON[name]])
    probe = PROBE.replace("__VARIANTS__", json.dumps(variants).replace("<", "\\u003c"))  # no "</script>" in it
    assert PAINTED <= set(PLANTED), PAINTED - set(PLANTED)
    probe = probe.replace("__PAINTED__", json.dumps(sorted(PAINTED)))
    path = folder / "probed.html"
    path.write_text(page.replace("</body>", FOLLOW_LINKS.replace("LINKS", json.dumps(QUESTIONS)).replace("</body>", probe)))
    return path, ""


@pytest.fixture(scope="module")
def probed(by_hand, launched):
    """by_hand's page, opened in Chromium, QUESTIONS followed in it (FOLLOW_LINKS), then the probe ->
    by_hand with more: the links followed, the colour the browser paints each request in, {variant: what
    it drew at each of its links: every link as written, a planted defect's run's (PLANTED_ON)}, and what
    the page showed at each of QUESTIONS."""
    dom = launched["probed"].result()
    dumped = json.loads(html.unescape(re.search(r'data-looked="([^"]*)"', dom)[1]))
    for name, looks in dumped["looked"].items():
        assert isinstance(looks, list), f"the page's script, {name}, did not run: {looks}"
    followed = json.loads(html.unescape(re.search(r'data-followed="([^"]*)"', dom)[1]))["followed"]
    return SimpleNamespace(**vars(by_hand), links=probe_links(by_hand.data), colours=dumped["colours"],
                           pale=dumped["pale"], looked=dumped["looked"], followed=followed)


def check_planted(check, probed, *defects):
    """check passes on the page as written, at every link, and fails (an AssertionError) on each of the
    defects planted, at the links of the run it is planted on (PLANTED_ON)."""
    check(probed, probed.looked["as written"])
    for defect in defects:  # a check of colours fails on a defect whose colours were not read: not its teeth
        assert defect in PAINTED or check not in (check_cells, check_marks, check_mask_marks, check_cache_cells), \
            f"{defect}: add it to PAINTED, so that the probe reads its colours"
        planted_on = SimpleNamespace(**{**vars(probed), "links": [(link, run, step) for link, run, step in probed.links
                                                                  if run["name"] == PLANTED_ON[defect]]})
        try:
            check(planted_on, probed.looked[defect])
        except AssertionError:
            continue
        pytest.fail(f"{check.__name__} passed with a defect planted: {defect}")


def check_deep_links(probed, looks):
    """Each link shows the step it names, by its number: #shown-step, the address, the packed rows."""
    for (link, run, step), look in zip(probed.links, looks):
        assert look["step"] == str(step["step"]), f"{link}: #shown-step says {look['step']}, not {step['step']}"
        address = f"#run={urllib.parse.quote(run['name'], safe='')}&step={step['step']}"  # as encodeURIComponent
        assert look["hash"] == address, f"{link}: the address says {look['hash']}"
        assert look["rows"] == [[row["slot"], row["position"]] for row in step["rows"]], link


def test_deep_links_on_a_run_whose_clock_jumps(probed):
    """In the gap run, step numbers and the steps' places in the list differ after the jump (step 10 is
    the seventh): every link shows the step it names, by its number, a link into the gap the next step.
    Planted: #shown-step shows the step's place in the list; the address carries it."""
    assert [step["step"] for step in probed.data["runs"][0]["steps"]] == [0, 1, 2, 3, 4, 5, 10, 11]
    check_planted(check_deep_links, probed, "the shown step's index", "the index in the address")


def cells_of(look, step):
    """Each mask cell drawn at a step, with what the data say of it -> [(where, its bit, the row it is
    for (None: a dummy query), its position, what was drawn: (data-visible, colour, hatched, outline))]."""
    assert len(look["grids"]) == len(step["masks"]), "a grid per mask"
    cells = []
    for g, (mask, grid) in enumerate(zip(step["masks"], look["grids"])):
        assert len(grid) == len(mask["rows"]), "a row of cells per query"
        for q, (r, bits_of_query, drawn) in enumerate(zip(mask["rows"], mask["visible"], grid)):
            assert len(drawn) == len(bits_of_query), "a cell per position"
            row = None if r is None else step["rows"][r]
            cells += [((g, q, l), bit, row, l, painted) for l, (bit, painted) in enumerate(zip(bits_of_query, drawn))]
    return cells


def check_cells(probed, looks):
    """Each cell says its bit (data-visible) and is painted as its bit says: a 1 in its row's colour
    (grey for padding or a dummy query; red where it is past the row's position), a 0 empty or hatched."""
    for (link, run, step), look in zip(probed.links, looks):
        for where, bit, row, l, (visible, colour, hatched, _) in cells_of(look, step):
            where = f"{link}, mask {where[0]}, query {where[1]}, position {l}"
            assert visible == bit, f"{where}: data-visible {visible}, the data {bit}"
            painted_one = not hatched and colour != EMPTY
            assert painted_one == (bit == "1"), f"{where}: a {bit} painted {colour}{' hatched' if hatched else ''}"
            if bit == "1" and (row is None or l <= row["position"]):
                want = GREY if row is None or row["request"] is None else probed.colours[row["request"]]
                assert colour == want, f"{where}: a 1 painted {colour}, not its row's {want}"


def test_mask_cells_are_painted_as_their_bits(probed):
    """At every step of the five runs, every cell is painted as its data-visible says. Planted: the
    style forgets to colour a 1; the script paints a cell from the row's position, not from its bit."""
    check_planted(check_cells, probed, "a 1 painted as a 0", "cells painted from positions")


def check_marks(probed, looks):
    """Red exactly where a 1 lies past its row's position."""
    for (link, run, step), look in zip(probed.links, looks):
        cells = cells_of(look, step)
        red = {where for where, _, _, _, (_, colour, *_) in cells if colour == RED}
        past = {where for where, bit, row, l, _ in cells if bit == "1" and row is not None and l > row["position"]}
        assert red == past, f"{link}: red but not past their rows {sorted(red - past)}, unmarked {sorted(past - red)}"


def test_a_mask_that_sees_one_past_is_marked_where_it_does(probed):
    """The broken run's masks see one position past their rows', in the one-token call and in chunks:
    the page marks red exactly those cells, and no cell of the other runs. Planted: the own position
    marked too; the one-token call's leaks unmarked; a chunk's."""
    broken = next(run for run in probed.data["runs"] if run["name"] == "broken")
    leaking = {mask["slot"] is None for step in broken["steps"] for mask in step["masks"]
               for r, visible in zip(mask["rows"], mask["visible"])
               if r is not None and "1" in visible[step["rows"][r]["position"] + 1:]}
    assert leaking == {True, False}, "the broken run should see past its rows in the one-token call and in a chunk"
    check_planted(check_marks, probed, "its own position marked", "no marks in the one-token call",
                  "no marks in a chunk")


OUTLINES = {"own": "rgb(34, 34, 34) 1px", "hole": "rgb(0, 102, 204) 2px", "leak": "rgb(153, 0, 0) 2px"}


def check_mask_marks(probed, looks):
    """Each cell of a row (not a dummy query) carries the one mark its bit and position call for, as the
    legend says: a 1 at its own position outlined dark; a 1 past it red, outlined dark red; a 0 at or
    before it (a hole: a broken mask) outlined blue; a 0 past it but within its chunk's last row's
    position (a later token of the same chunk) hatched; any other cell neither outlined nor hatched."""
    for (link, run, step), look in zip(probed.links, looks):
        cells = iter(cells_of(look, step))
        for mask in step["masks"]:
            chunk_end = None if mask["slot"] is None else step["rows"][mask["rows"][-1]]["position"]
            for r, visible in zip(mask["rows"], mask["visible"]):
                for l, bit in enumerate(visible):
                    where, _, row, _, (_, _, hatched, outline) = next(cells)
                    position = None if r is None else step["rows"][r]["position"]
                    mark = None if r is None else "leak" if bit == "1" and l > position else \
                        "hole" if bit == "0" and l <= position else \
                        "later" if bit == "0" and chunk_end is not None and l <= chunk_end else \
                        "own" if l == position else None
                    want = (OUTLINES.get(mark, "none"), mark == "later")
                    assert (outline, hatched and bit == "0") == want, \
                        f"{link}, mask {where[0]}, query {where[1]}, position {l} (a {bit}, the row at {position}): " \
                        f"drawn outline {outline}, hatched {hatched}; a {mark} mark wants {want}"


def test_every_mark_of_a_mask_is_where_its_bits_say(probed):
    """The broken run's masks also hide positions 1 and 2: from a token there, its own position, from a
    later one two earlier positions, in the one-token call and in chunks. At every step of the six runs each
    cell carries the mark its bit and position call for (check_mask_marks). Planted: a hole at the own
    position drawn as none; a hole drawn as the own position's outline."""
    broken = next(run for run in probed.data["runs"] if run["name"] == "broken")
    holes = {(mask["slot"] is None, l == step["rows"][r]["position"]) for step in broken["steps"]
             for mask in step["masks"] for r, visible in zip(mask["rows"], mask["visible"]) if r is not None
             for l, bit in enumerate(visible) if bit == "0" and l <= step["rows"][r]["position"]}
    assert holes == {(True, True), (True, False), (False, True), (False, False)}, \
        f"the broken run should hide its own position and an earlier one, in the one-token call and a chunk: {holes}"
    assert any(mask["slot"] is not None and len(mask["rows"]) > 1 for run in probed.data["runs"] for step in run["steps"]
               for mask in step["masks"]), "no chunk of several rows: no later token to hatch"
    check_planted(check_mask_marks, probed, "a hole at its own position unmarked", "a hole outlined as its own position")


def attributes(element):
    return dict(re.findall(r'([\w-]+)="([^"]*)"', element))


def check_frames(probed, looks):
    """The frame (over the slots, and over the worker's lanes) sits on the step's column: where the
    belt drew that step of every stay it covers."""
    belts = dict(re.findall(r'<div class="belt" data-run="([^"]*)">(.*?)</div>', probed.page, re.S))
    for (link, run, step), look in zip(probed.links, looks):
        stays = [attributes(rect) for rect in re.findall(r'<rect class="stay"[^>]*>', belts[run["name"]])]
        columns = [float(stay["x"]) + (step["step"] - int(stay["data-first"])) * float(stay["width"]) /
                   (int(stay["data-last"]) - int(stay["data-first"]) + 1)
                   for stay in stays if int(stay["data-first"]) <= step["step"] <= int(stay["data-last"])]
        assert columns, f"{link}: no stay covers the step"
        n_frames = 2 if run["disaggregate"] else 1
        assert len(look["frames"]) == n_frames, f"{link}: {len(look['frames'])} frames"
        for x in look["frames"]:
            assert all(abs(x - column) < 0.05 for column in columns), f"{link}: the frame at {x}, the step at {columns}"


def test_the_frame_sits_on_the_step_shown(probed):
    """Planted: the frame at the step's place in the list, which the clock's jump sets apart."""
    check_planted(check_frames, probed, "the frame at the index")


def chips_of(look, label):
    """The chips in the part of the step's figures that begins with label; None: no such part."""
    return next((chips for text, chips in look["info"] if text.startswith(label)), None)


def check_queue_and_worker(probed, looks):
    """The queue's chips are the engine's recorded queue (StepReport.waiting) after the step's
    admissions; paged, a queue beside a slot that admission left free (not one that phase 3 freed by
    a preemption) says it waits for blocks; the worker's chips (disaggregated only) are the prompts it
    recorded holding after the step."""
    for (link, run, step), look in zip(probed.links, looks):
        report = probed.shown.reports[run["name"]][run["steps"].index(step)]
        queue, recorded = chips_of(look, "queue:"), [nanobatch.letter(i) for i in report.waiting]
        assert queue == recorded, f"{link}: the queue drawn {queue}, recorded {recorded}"
        n_free = report.occupants.count(None) - len(report.preempted)  # slots free after admission
        text = next(text for text, _ in look["info"] if text.startswith("queue:"))
        assert ("for blocks, a slot free" in text) == bool(run["kv_blocks"] and report.waiting and n_free), link
        held = chips_of(look, "the prefill worker holds:")
        assert held == ([nanobatch.letter(i) for i in report.at_worker] if run["disaggregate"] else None), \
            f"{link}: the worker holds {held}, recorded {[nanobatch.letter(i) for i in report.at_worker]}"


def test_the_queue_is_the_engines_and_the_schedule_worked_by_hand(by_hand):
    """Each step's queue in the page's data is what its StepReport recorded, and the schedule worked by
    hand above; the worker's prompts are what the engine recorded it holding after the step."""
    for run in by_hand.data["runs"]:
        reports = by_hand.shown.reports[run["name"]]
        assert [step["waiting"] for step in run["steps"]] == [report.waiting for report in reports]
        assert [step["at_worker"] for step in run["steps"]] == [report.at_worker for report in reports]
        if run["name"] in QUEUES:
            assert {step["step"]: "".join(nanobatch.letter(i) for i in step["waiting"]) for step in run["steps"]} \
                == QUEUES[run["name"]], f"{run['name']}: the queue worked by hand"


def test_the_queue_and_the_worker_drawn_are_the_engines(probed):
    """Planted: the queue as it stood before admission; the worker's prompts during the step (its
    handovers too)."""
    check_planted(check_queue_and_worker, probed, "the queue before admission", "the worker's prompts during the step",
                  "blocks waited for beside a slot phase 3 freed")


def worker_lane(page, name):
    """{request: the steps its bar in the worker's lane covers}, read from the page's SVG."""
    belt = re.search(rf'<div class="belt" data-run="{name}">(.*?)</div>', page, re.S)[1]
    svg = attributes(re.search(r"<svg[^>]*>", belt)[0])
    left, step_w, lane = float(svg["data-left"]), float(svg["data-step-width"]), {}
    for rect in re.findall(r'<rect class="held"[^>]*>', belt):
        held = attributes(rect)
        first, n_steps = round((float(held["x"]) - left) / step_w), round(float(held["width"]) / step_w)
        lane[int(held["data-request"])] = set(range(first, first + n_steps))
    return lane


def check_lane(page, reports):
    recorded = {}
    for report in reports:
        for i in report.at_worker + report.handed_over:
            recorded.setdefault(i, set()).add(report.step)
    assert worker_lane(page, "disaggregated") == recorded


def test_the_workers_lane_is_what_it_held(by_hand):
    """Each bar in the worker's lane covers the steps in which the engine recorded the prompt at the
    worker (after the step) or handed over (in it). Planted: handovers a step late in the completions."""
    reports = by_hand.shown.reports["disaggregated"]
    check_lane(by_hand.page, reports)
    shown = by_hand.shown
    late = [dataclasses.replace(c, first_token_step=c.first_token_step + 1) for c in shown.completions["disaggregated"]]
    planted = dataclasses.replace(shown, completions={**shown.completions, "disaggregated": late})
    with pytest.raises(AssertionError):
        check_lane(explore.page_html(planted), reports)


def last_holders(reports, index, block):
    """The requests that listed block last before reports[index], in slot order: whose keys a block kept
    since then holds (Part 4), worked out here from the reports on their own."""
    for report in reversed(reports[:index]):
        holders = [i for i, table in zip(report.occupants, report.block_tables) if block in table]
        if holders:
            return holders
    return []


def recorded_cache(run, reports, index):
    """The cache reports[index] recorded, worked out here on its own -> {block: (its holders [(request,
    slot)] in slot order, its fill, [(kind, whose)] a cell per position)}: holders and fill from the block
    tables and n_cached (a shared block is full for each holder), the positions written from the PackedStep
    the forward ran on, through its own block_tables (None, per slot: slot s is block s); a free block
    kept (cached_free) in the colour of whoever held it last, a shared one in a band for each holder."""
    report = reports[index]
    n_blocks = run["kv_blocks"] or run["n_slots"]
    size = report.kv_total // n_blocks
    holders, fills = {block: [] for block in range(n_blocks)}, {block: 0 for block in range(n_blocks)}
    for slot, table in enumerate(report.block_tables):
        for k, block in enumerate(table):
            holders[block].append((report.occupants[slot], slot))
            fills[block] = max(fills[block], min(size, max(0, report.n_cached[slot] - k * size)))
    blocks = {}
    for block, who in holders.items():
        if not who:
            kept = block in report.cached_free
            cells = [("kept", tuple(last_holders(reports, index, block)[:1])) if kept else ("free", ())] * size
        else:
            kind = "shared" if len(who) > 1 else "held"
            n_empty = size - fills[block]
            cells = [(kind, tuple(i for i, _ in who))] * fills[block] + [("empty", (who[0][0],))] * n_empty
        blocks[block] = (who, fills[block], cells)
    if report.packed is not None:
        tables = report.packed.block_tables
        for slot, position in zip(report.packed.slots.tolist(), report.packed.positions.tolist()):
            block = slot if tables is None else int(tables[slot, position // size])
            blocks[block][2][position % size] = ("written", (report.occupants[slot],))  # (None,): static's padding
    return blocks


def painted_cells(look_block, probed):
    """A block as the browser painted it -> [(kind, (its colours))] a cell per position, each run of cells
    checked first: as wide as its share of the block (on the page as written: the probe lays out no other
    variant), and painted as its kind says (held: its request's colour; written: the same, outlined;
    reserved but empty: hatched in it; shared: a band of each holder's colour, top to bottom; kept: pale
    in its last holder's; free: the empty grey)."""
    size, cells = sum(n for _, n, *_ in look_block["segments"]), []
    for kind, n, background, image, shadow, width in look_block["segments"]:
        if width is not None:
            assert width == pytest.approx(n / size * look_block["width"], abs=1), f"{n} cells {width:.1f} px wide"
        colours = [colour for colour, _ in itertools.groupby(re.findall(r"rgba?\([^)]*\)", image))]  # each band once
        if kind == "empty":
            assert image.startswith("repeating-linear-gradient"), f"reserved but empty, not hatched: {background}"
            colours = colours[:1]  # the request's colour, then white
        elif kind == "shared":
            assert image.startswith("linear-gradient"), f"shared, not in bands: {background} {image}"
        else:
            assert image == "none", f"{kind} cells painted {image}"
            colours = [background]
        assert (shadow != "none") == (kind == "written"), f"{kind} cells, box-shadow {shadow}"
        cells += [(kind, tuple(colours))] * n
    return cells


def check_cache_cells(probed, looks):
    """At every step of the six runs, every block (per slot: a block a slot) is drawn with its recorded
    holders (several, for a block shared) and fill, and every cell in the kind and colour that the report
    and the forward's PackedStep say: held, shared, written this step, reserved but empty, kept, free."""
    def colour(kind, i):
        return GREY if i is None else probed.pale[i] if kind == "kept" else probed.colours[i]

    for (link, run, step), look in zip(probed.links, looks):
        reports = probed.shown.reports[run["name"]]
        want = recorded_cache(run, reports, run["steps"].index(step))
        assert [block["block"] for block in look["blocks"]] == list(want), f"{link}: the blocks drawn"
        for block in look["blocks"]:
            who, fill, cells = want[block["block"]]
            where = f"{link}, block {block['block']}"
            assert (block["request"], block["slot"], block["fill"]) == \
                   (" ".join(str(i) for i, _ in who), " ".join(str(slot) for _, slot in who), fill), where
            drawn = painted_cells(block, probed)
            recorded = [(kind, (EMPTY,) if kind == "free" else tuple(colour(kind, i) for i in whose))
                        for kind, whose in cells]
            assert drawn == recorded, f"{where}: drawn {drawn}, recorded {recorded} ({cells})"


def test_the_cache_cells_are_the_engines(probed):
    """Planted: the block tables read one block off; a block filled as far as kv_used reaches, or as far
    as its holder's n_cached from its table's start; a row's keys drawn in its table's first block; the
    reserved but empty cells painted as held; a shared block drawn for one holder, or in one colour; a
    kept block painted in its holder's full colour."""
    assert any(run["kv_blocks"] for run in probed.data["runs"]) and not all(run["kv_blocks"] for run in
                                                                          probed.data["runs"])
    check_planted(check_cache_cells, probed, "block tables shifted by one", "fill from kv_used",
                  "fill from the table's start", "writes into the table's first block", "empty painted as held",
                  "one holder per block", "shared painted in one colour", "kept painted as held")


def check_cache_figures(probed, looks):
    """The cache's figures are the report's: kv_used of kv_total (a shared block's positions once: worked
    out here too), the positions reserved but empty, the blocks (per slot: slots) free, a block shared
    counted once, and with a prefix cache how many of them are kept; paged, each busy slot's block table
    and positions."""
    for (link, run, step), look in zip(probed.links, looks):
        reports = probed.shown.reports[run["name"]]
        report, blocks = reports[run["steps"].index(step)], recorded_cache(run, reports, run["steps"].index(step))
        n_blocks = run["kv_blocks"] or run["n_slots"]
        held = [fill for who, fill, _ in blocks.values() if who]
        n_held, n_in_use, unit = len(held), sum(held), "block" if run["kv_blocks"] else "slot"
        n_shared = sum(len(who) > 1 for who, _, _ in blocks.values())
        assert n_in_use == report.kv_used, f"{link}: kv_used {report.kv_used}, positions in use {n_in_use}"
        wanted = [f"in use: {report.kv_used} of {report.kv_total} positions hold a token",
                  f"{(n_empty := n_held * report.kv_total // n_blocks - n_in_use)} "
                  f"position{'' if n_empty == 1 else 's'} reserved but empty",
                  f"free: {n_blocks - n_held} of {n_blocks} {unit}{'' if n_blocks == 1 else 's'}" +
                  (f", {len(report.cached_free)} of them kept" if run["prefix_cache"] else "")]
        wanted += [f"({n_shared} shared)", "a shared block's once"] if n_shared else []
        assert all(text in look["figures"] for text in wanted), f"{link}: {look['figures']!r}, not {wanted}"
        tables = [(slot, f"{report.n_cached[slot]} positions, block_table [{', '.join(map(str, table))}]")
                  for slot, table in enumerate(report.block_tables) if table] if run["kv_blocks"] else []
        assert [(slot, text[-len(want):]) for (slot, text), (_, want) in zip(look["tables"], tables)] == tables \
            and len(look["tables"]) == len(tables), f"{link}: the block tables drawn {look['tables']}"


def test_the_cache_figures_are_the_engines(probed):
    """Planted: the blocks free counted as the blocks less the requests holding some, or less the entries
    of the block tables (a shared block counted once for each holder)."""
    check_planted(check_cache_figures, probed, "free counted in requests", "free counted in table entries")


def check_preemptions(probed, looks):
    """A preemption shows where the engine printed it, in the step's line (print_step's, word for word),
    and in the cache: a line naming each request preempted and the blocks its table listed a step
    before, those blocks outlined; no outline, and no such line, at a step without one."""
    for (link, run, step), look in zip(probed.links, looks):
        index = run["steps"].index(step)
        reports = probed.shown.reports[run["name"]]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            nanobatch.print_step(reports[index])
        assert look["info"][0][0].split() == printed.getvalue().split(), f"{link}: the line the engine printed"
        freed = {}
        for i in reports[index].preempted:  # preempted in this step: gone from its occupants
            table = reports[index - 1].block_tables[reports[index - 1].occupants.index(i)]
            freed.update((block, str(i)) for block in table)
            blocks = f"its block{'' if len(table) == 1 else 's'} {', '.join(map(str, table))}" if table else \
                "no block yet"
            assert f"!{nanobatch.letter(i)}{blocks}" in look["preemption"], f"{link}: {look['preemption']!r}"
        n = len(reports[index].preempted)
        assert look["preemption"].startswith(f"phase 3 {n} preempted") if n else look["preemption"] == "", link
        assert {block["block"]: block["freed"] for block in look["blocks"] if block["freed"]} == freed, link


def test_a_preemption_shows_in_the_line_and_the_cache(probed):
    """In the paged runs worked by hand, B (in slot 1) is preempted at step 4, its blocks 2, 3, 5 freed; back
    at step 5 in slot 0, its chunk says it feeds its prompt and answer again: all of it, or, with the prefix
    cache, what its kept blocks 2, 3 do not hold. Planted: the freed blocks looked up in the step's own
    tables (where the preempted request is no more); the step's line without its !K."""
    looks = dict(zip([link for link, _, _ in probed.links], probed.looked["as written"]))
    for name, again in [("paged", "positions 0-5, into slot 0"),
                        ("prefix cache", "positions 4-5, into slot 0 (positions 0-3 found cached)")]:
        run = next(run for run in probed.data["runs"] if run["name"] == name)
        assert [(step["step"], step["preempted"]) for step in run["steps"] if step["preempted"]] == [(4, [1])], name
        assert run["steps"][3]["occupants"] == [0, 1] and run["steps"][5]["occupants"] == [1, None], name
        assert f"B's prompt and answer again (preempted at step 4), {again}; all in: its next token" \
            in " ".join(looks[f"run={name}&step=5"]["captions"]), name
    assert "!Bits blocks 2, 3, 5 (kept: 2, 3)" in looks["run=prefix cache&step=4"]["preemption"]
    check_planted(check_preemptions, probed, "freed from this step's tables", "preemptions left out of the line")


@pytest.fixture(scope="module")
def crowded_run():
    """A run no hand worked: tests/test_schedule.py's paged run in which two requests are preempted in
    one step, twice, one of them holding no block yet, and come back -> a namespace: shown, page, data,
    and the links to each step around a preemption or a comeback (the step before it, it, the step after)."""
    requests, options, _ = SCHEDULED["paged, several preempted in a step, one with no block yet"]
    reports = []
    completions = generate(tiny_gpt(), requests, max_len=MAX_LEN, eos_id=None, on_step=reports.append, **options)
    name = "crowded"
    run = (name, options["n_slots"], "continuous", options["prefill_chunk"], False, options["kv_blocks"], False)
    shown = nanobatch.Shown(requests, [run], {name: completions},
                            {name: nanobatch.summarize(requests, completions, reports, 1.0)}, {name: reports}, None)
    page = explore.page_html(shown)
    data = json.loads(re.search(r'<script type="application/json" id="nanobatch-run">(.*?)</script>', page, re.S)[1])
    comebacks = {i for r in reports for i in r.preempted}
    around = {k + d for k, r in enumerate(reports) if r.preempted or set(r.admitted) & comebacks for d in (-1, 0, 1)}
    steps = data["runs"][0]["steps"]
    links = [(f"run={name}&step={steps[k]['step']}", data["runs"][0], steps[k]) for k in sorted(around)
             if 0 <= k < len(steps)]
    return SimpleNamespace(shown=shown, page=page, data=data, evicted={name: {}}, links=links)


def crowded_page(crowded_run, folder):
    """crowded_run's page with the probe, the page as written only, at its links -> (its file, the link)."""
    page = crowded_run.page
    variants = {"as written": [page_style(page), page_script(page), [link for link, _, _ in crowded_run.links]]}
    probe = PROBE.replace("__VARIANTS__", json.dumps(variants).replace("<", "\\u003c")).replace("__PAINTED__", "[]")
    path = folder / "crowded.html"
    path.write_text(page.replace("</body>", probe))
    return path, ""


@pytest.fixture(scope="module")
def crowded(crowded_run, launched):
    """crowded_run's page opened in Chromium with the probe -> a namespace as probed's."""
    dumped = json.loads(html.unescape(re.search(r'data-looked="([^"]*)"', launched["crowded"].result())[1]))
    assert isinstance(dumped["looked"]["as written"], list), dumped["looked"]["as written"]
    return SimpleNamespace(**vars(crowded_run), colours=dumped["colours"], pale=dumped["pale"], looked=dumped["looked"])


def test_a_crowded_run_as_drawn(crowded):
    """Where two requests are preempted in one step (one with no block yet), the step's line names both,
    the cache's line says two gave way, the latest first, each with the blocks its table listed, all of
    them outlined; and everything else drawn there (every check above that reads no planted page: the
    steps shown, the cells and their marks, the cache's cells and figures, the queue, every text and
    title) is the reports'."""
    looks = crowded.looked["as written"]
    several = [look["preemption"] for look in looks if look["preemption"].startswith("phase 3 2 preempted")]
    assert several and all("the latest first" in line for line in several) and \
        any("no block yet" in line for line in several), several
    for check in (check_preemptions, check_deep_links, check_cells, check_marks, check_mask_marks, check_cache_cells,
                  check_cache_figures, check_prefix_cache, check_queue_and_worker, check_frames, check_texts):
        check(crowded, looks)


def report_size(run, report):
    """Positions a block: the pool's, or per slot a slot's."""
    return report.kv_total // (run["kv_blocks"] or run["n_slots"])


def check_prefix_cache(probed, looks):
    """Part 4, at every step of the six runs: the blocks drawn kept are the report's cached_free, each
    naming whoever held it last (whose keys it keeps); those drawn evicted are the ones the engine evicted
    in that step (recorded as it took them), each naming whose keys it dropped, in a line that names them
    too; those drawn found are the first found_cached / size entries of each admitted request's table; a
    block in several tables names every holder. Runs without a prefix cache draw none of it."""
    for (link, run, step), look in zip(probed.links, looks):
        reports = probed.shown.reports[run["name"]]
        index = run["steps"].index(step)
        report, size = reports[index], report_size(run, reports[index])
        letter = nanobatch.letter

        def names(blocks):
            return {block: " ".join(str(i) for i in last_holders(reports, index, block)) for block in blocks}

        drawn = {kind: {block["block"]: block[kind] for block in look["blocks"] if block[kind]}
                 for kind in ("kept", "evicted", "found")}
        evicted = probed.evicted[run["name"]].get(report.step, [])
        found = {}
        for i, n_found in zip(report.admitted, report.found_cached):
            table = report.block_tables[report.occupants.index(i)]
            found.update((block, str(i)) for block in table[:n_found // size])
        assert drawn == {"kept": names(report.cached_free), "evicted": names(evicted), "found": found}, \
            f"{link}: drawn {drawn}, recorded kept {report.cached_free}, evicted {evicted}, found {found}"
        for block in look["blocks"]:  # a block in several tables: its label and its title name them all
            holders = [letter(i) for i, table in zip(report.occupants, report.block_tables) if block["block"] in table]
            if len(holders) > 1:
                assert f"shared by {', '.join(holders)}" in block["label"], f"{link}: {block['label']}"
                each = " and ".join(rf"{who} \(its positions [^)]*\)" for who in holders)
                assert re.match(rf"block {block['block']}: shared by {each}", block["title"]), link
        for block in evicted:
            kept_by = ", ".join(letter(i) for i in last_holders(reports, index, block))
            now = ", ".join(letter(i) for i, table in zip(report.occupants, report.block_tables) if block in table)
            assert f"block {block}, kept with {kept_by}'s keys, now {now}'s" in look["eviction"], f"{link}: {look}"
        assert bool(look["eviction"]) == bool(evicted), link


def test_the_prefix_cache_worked_by_hand(by_hand):
    """The prefix cache run does what the comment above works out by hand: at each step, the blocks kept
    after it, the admissions that found positions cached, the blocks the engine evicted (recorded in
    the engine as it took them), the blocks in two tables at once; and the page's data are its reports'."""
    run = next(run for run in by_hand.data["runs"] if run["name"] == "prefix cache")
    evicted = by_hand.evicted["prefix cache"]
    worked = {}
    for step, report in zip(run["steps"], by_hand.shown.reports["prefix cache"]):
        assert (step["found_cached"], step["cached_free"]) == (report.found_cached, report.cached_free)
        listed = [block for table in step["block_tables"] for block in table]
        facts = (step["cached_free"], [f"+{nanobatch.letter(i)}({n} found)" for i, n in
                                       zip(step["admitted"], step["found_cached"]) if n],
                 evicted.get(step["step"], []), sorted({block for block in listed if listed.count(block) > 1}))
        if any(facts):
            worked[step["step"]] = facts
    assert worked == PREFIX_CACHE
    assert all(not any(step["cached_free"] + step["found_cached"]) for run in by_hand.data["runs"]
               if not run["prefix_cache"] for step in run["steps"]), "a cache without a prefix cache kept blocks"


def test_a_shared_block_a_kept_one_and_an_eviction_as_drawn(probed):
    """At step 11 of the prefix cache worked by hand, block 0 is listed by D and F, both named; blocks 2, 3, 5
    are kept, B's; at step 10, block 4 was evicted, A's keys, now E's; at step 5, B found its own blocks.
    Planted: kept blocks drawn as free, or as the step before left them; the evictions drawn a step late,
    or not at all; the blocks found read from the end of the table; a shared block drawn for one holder."""
    looks = dict(zip([link for link, _, _ in probed.links], probed.looked["as written"]))
    blocks = {block["block"]: block for block in looks["run=prefix cache&step=11"]["blocks"]}
    assert (blocks[0]["request"], blocks[0]["label"]) == ("3 5", "block 0: shared by D, F, found")
    assert "shared by D (its positions 0-1, entry 0 of slot 0's block table) and F (its positions 0-1, entry 0 " \
           "of slot 1's block table)" in blocks[0]["title"]
    assert [(b, blocks[b]["kept"], blocks[b]["label"]) for b in (2, 3, 5)] == \
           [(2, "1", "block 2: keeps B's"), (3, "1", "block 3: keeps B's"), (5, "1", "block 5: keeps B's")]
    assert "free, kept: it holds the keys of B's positions 0-1" in blocks[2]["title"]
    step_10 = looks["run=prefix cache&step=10"]
    assert "block 4, kept with A's keys, now E's" in step_10["eviction"]
    assert next(block for block in step_10["blocks"] if block["block"] == 4)["label"] == "block 4: E, evicted"
    assert "+B(4 found)its positions 0-3 in blocks 2, 3, kept" in looks["run=prefix cache&step=5"]["foundLine"]
    assert "+F(2 found)its positions 0-1 in block 0, held by D: now shared" in \
        looks["run=prefix cache&step=11"]["foundLine"]
    assert "+D(2 found)its positions 0-1 in block 0, kept as C left after step 7" in \
        looks["run=prefix cache&step=10"]["foundLine"]
    check_planted(check_prefix_cache, probed, "kept drawn as free", "kept from the step before",
                  "evictions from the step before", "evictions left undrawn", "found blocks from the table's end",
                  "one holder per block")


def check_found(probed, looks):
    """Each admission that found positions cached says how many, as print_step does (+K(N found)), in the
    step's events and, with the blocks it found them in, in the cache's found line; the packed rows of
    its first feed say which positions it did not feed."""
    for (link, run, step), look in zip(probed.links, looks):
        report = probed.shown.reports[run["name"]][run["steps"].index(step)]
        chips = next(chips for text, chips in look["info"] if text.startswith("events:"))
        for i, n_found in zip(report.admitted, report.found_cached):
            text = f"+{nanobatch.letter(i)}" + (f"({n_found} found)" if n_found else "")
            assert text in chips, f"{link}: events {chips}, not {text}"
            assert (f"{text}its positions 0-{n_found - 1} in block" in look["foundLine"]) == bool(n_found), link
            if n_found and any(row["request"] == i for row in step["rows"]):  # what it feeds: the rest
                assert f"positions 0-{n_found - 1} found cached" in " ".join(look["captions"]), \
                    f"{link}: captions {look['captions']}"
        assert bool(look["foundLine"]) == any(report.found_cached), f"{link}: {look['foundLine']!r}"


def test_found_positions_show_in_the_events_and_the_cache(probed):
    """+K(N found) in the events, in the cache's found line and in the caption of what it feeds; and in the
    belt, a mark at the start of the stay its admission began, as many positions in its data as the report
    says. Planted: the events without what each admission found; the captions without it."""
    check_planted(check_found, probed, "found left out of the events", "found left out of the captions")
    belt = re.search(r'<div class="belt" data-run="prefix cache">(.*?)</div>', probed.page, re.S)[1]
    marks = sorted((int(a["data-request"]), int(a["data-step"]), int(a["data-found"]))
                   for a in map(attributes, re.findall(r'<rect class="found"[^>]*>', belt)))
    assert marks == sorted((i, report.step, n) for report in probed.shown.reports["prefix cache"]
                           for i, n in zip(report.admitted, report.found_cached) if n) == \
        [(1, 5, 4), (2, 7, 2), (3, 10, 2), (5, 11, 2)]


def test_the_question_does_not_give_its_preemption_away(probed):
    """With predict on, step 4 of the paged runs worked by hand shows the queue as admission left it, C
    alone: not B, whom phase 3 preempts, at its head, where the step's report has it (QUESTIONS, followed
    in the probe's launch)."""
    followed = probed.followed
    assert [(got["step"], got["rows"]) for got in followed] == [("4", []), ("4", []), ("5", [])]
    queues = [re.search(r"queue: [^)]*?(?=phases)", got["info"])[0] for got in followed]
    assert queues == ["queue: 1 waiting C", "queue: 1 waiting C", "queue: 1 waiting C for blocks, a slot free"], queues


# ---------------------------------------------------------------------------------------------
# Every text the page draws, and every title it shows on hover, worked out from the StepReports
#
# What a reader reads on the page (the step's figures and events, the packed rows' captions and
# titles, each mask's caption and its rows' labels, each cache block's label and title, the tabs,
# the titles over each part) is worked out below from the StepReports, the PackedStep each forward
# ran on, and the requests, never from the page's data; at every step of the six runs worked by
# hand the page must draw exactly it. So is every title in the belts (the SVG's <title>s, drawn by
# belt_svg.py and explore.py in Python): each stay's and each bar of the worker's lane.


def js_span(first, last):
    """The page's span(): '5', or '5-7'."""
    return f"{first}" if first == last else f"{first}-{last}"


def js_number(x):
    """A number as JavaScript prints it: 64, not 64.0."""
    return f"{x:g}" if x != int(x) else f"{int(x)}"


def js_fixed(x, digits):
    """x.toFixed(digits), as JavaScript rounds: the exact value of the double, a tie rounded up (1.25 to
    1.3), where Python's format rounds a tie to even (1.2). The page's times have five decimals of a
    second, so a tie in milliseconds comes about one step in ten."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def wanted_rows(report, requests, preempted_at, found):
    """The packed rows' titles, their groups' captions and the masks' captions and labels, from the
    forward's PackedStep -> (row titles, group captions, grids: [caption, label of each query]).
    preempted_at: {request: the step that last preempted it}; found: {request: the positions its latest
    admission found in the prefix cache} (Part 4)."""
    packed = report.packed
    if packed is None:
        return [], [], []
    letter = nanobatch.letter
    slots, positions, tokens = packed.slots.tolist(), packed.positions.tolist(), packed.tokens.tolist()
    who = [report.occupants[slot] for slot in slots]
    name = ["pad" if i is None else letter(i) for i in who]
    kinds = row_kinds(packed, report.occupants)
    is_prompt = [i is not None and position < len(requests[i].prompt) for i, position in zip(who, positions)]
    sampled = set(packed.logit_rows[:len(report.sampled) - len(report.handed_over)].tolist())
    titles = [f"row {r}: {'padding, for no one' if who[r] is None else 'request ' + name[r]}, slot {slots[r]}, "
              f"position {positions[r]}{' (a prompt token)' if is_prompt[r] else ''}, token {tokens[r]}, {kinds[r]}, "
              f"{'its logits sampled' if r in sampled else 'not sampled'}" for r in range(len(tokens))]

    def found_words(i):
        return f"positions {js_span(0, found[i] - 1)} found cached" if found.get(i) else ""

    D, (S, _, cut) = packed.n_one_token, packed.one_token_mask.shape
    captions, grids = [], []
    if D:  # a prompt token among them: a one-token prompt, or the last of a longer one (its first blocks found)
        prompts = [f"a one-token prompt: {name[r]}" if positions[r] == 0 else
                   ", ".join(filter(None, [f"{name[r]}'s last prompt token", found_words(who[r])]))
                   for r in range(D) if is_prompt[r]]
        captions.append(f"rows {js_span(0, D - 1)}: one-token rows, D = {D}, attending together"
                        + (f" ({'; '.join(prompts)})" if prompts else ""))
        row_of_slot = {slot: r for r, slot in enumerate(slots[:D])}
        grids.append([f"the one-token call: S = {S} queries, row s is slot s's (queries[slots[:D]] = q[:D]), over "
                      f"L = {cut} positions of every slot (the cut)"]
                     + [f"slot {s}: dummy, no row" if s not in row_of_slot else
                        f"slot {s} \u2190 row {row_of_slot[s]}: {name[row_of_slot[s]]} p{positions[row_of_slot[s]]}"
                        for s in range(S)])
    for rows, slot, mask in packed.chunks:
        first, last = rows.start, rows.stop - 1
        T, L = mask.shape
        found_here = f" ({found_words(who[first])})" if found_words(who[first]) else ""
        where = f"positions {js_span(positions[first], positions[last])}, into slot {slot}{found_here}"
        if kinds[first] == "alone past the cut":
            captions.append(f"row {first}: {name[first]} alone past the cut")
            caption = f"{name[first]} alone past the cut (at p{positions[first]}, the cut is {cut}): 1 query over " \
                      f"L = {L} positions of slot {slot}"
        elif who[first] in preempted_at:
            captions.append(f"rows {js_span(first, last)}: {name[first]}'s prompt and answer again (preempted at step "
                            f"{preempted_at[who[first]]}), {where}; "
                            + ("all in: its next token" if last in sampled else "more next step"))
            caption = f"{name[first]}'s chunk: T = {T} queries over L = {L} positions of slot {slot}"
        else:
            rest = len(requests[who[first]].prompt) - 1 - positions[last]
            captions.append(f"rows {js_span(first, last)}: {name[first]}'s prompt, {where}"
                            + (f"; {rest} more next step" if rest else ""))
            caption = f"{name[first]}'s chunk: T = {T} queries over L = {L} positions of slot {slot}"
        grids.append([caption] + [f"row {r}: {name[r]} p{positions[r]}" for r in range(first, last + 1)])
    return titles, captions, grids


def wanted_blocks(ran, reports, index, evicted):
    """Each cache block's label and title (its hover text): whose positions it holds (a shared block:
    every holder's), which of them hold a token, which were written this step, whether a preemption
    freed it; Part 4, whose keys a kept block keeps, who found it this step, and whose keys the engine
    evicted from it (evicted: the blocks the engine evicted in this step) -> [[label, title]]."""
    name, n_slots, _, _, _, kv_blocks, _ = ran
    report, letter = reports[index], nanobatch.letter
    n_blocks = kv_blocks or n_slots
    size = report.kv_total // n_blocks
    holders = {block: [] for block in range(n_blocks)}  # block -> [(slot, request, k: its entry in the table)]
    fill = dict.fromkeys(range(n_blocks), 0)  # block -> positions holding a token: a shared block's, for each holder
    for slot, table in enumerate(report.block_tables):
        for k, block in enumerate(table):
            holders[block].append((slot, report.occupants[slot], k))
            fill[block] = max(fill[block], min(size, max(0, report.n_cached[slot] - k * size)))
    written = {}  # block -> offsets written this step, through the tables the forward read
    if report.packed is not None:
        tables = report.packed.block_tables
        for slot, position in zip(report.packed.slots.tolist(), report.packed.positions.tolist()):
            block = slot if tables is None else int(tables[slot, position // size])
            written.setdefault(block, set()).add(position % size)
    freed = {}  # block -> the request whose preemption freed it: its table a step before
    for i in report.preempted:  # (admitted and preempted in one step, it held none)
        before = reports[index - 1] if index else None
        if before is not None and i in before.occupants:
            freed.update((block, i) for block in before.block_tables[before.occupants.index(i)])

    def held_last(block):  # [(request, k)]: who listed block last before this step, in slot order
        for earlier in reversed(reports[:index]):
            listed = [(i, table.index(block)) for i, table in zip(earlier.occupants, earlier.block_tables)
                      if block in table]
            if listed:
                return listed
        return []

    kept_for = {block: held_last(block) for block in report.cached_free}  # Part 4: free, its keys kept
    evicted_from = {block: held_last(block) for block in evicted}
    found_by = {}  # block -> the requests admitted now that found it: their tables' first found_cached / size
    for i, n_found in zip(report.admitted, report.found_cached):
        for block in report.block_tables[report.occupants.index(i)][:n_found // size]:
            found_by.setdefault(block, []).append(i)

    def names(listed):
        return " and ".join(letter(i) for i, _ in listed)

    def positions(k):
        return js_span(k * size, k * size + size - 1)

    drawn = []
    for block in range(n_blocks):
        held, filled = holders[block], fill[block]
        first = (held[0][2] if held else 0) * size
        tokens = f"{js_span(first, first + filled - 1)} hold{'s' if filled == 1 else ''} a token" if filled else ""
        tokens += ", " if 0 < filled < size else ""
        tokens += f"{js_span(first + filled, first + size - 1)} reserved, empty" if filled < size else ""
        if not held:
            holds = "free" if block not in kept_for else "free, kept: it holds the keys of " + \
                (f"{names(kept_for[block])}'s positions {positions(kept_for[block][0][1])}" if kept_for[block]
                 else "a full block") + ", matchable by a later request until evicted"
        elif kv_blocks is None:
            holds = f"request {letter(held[0][1])}'s; {tokens}"
        elif len(held) > 1:
            holds = "shared by " + " and ".join(f"{letter(i)} (its positions {positions(k)}, entry {k} of slot "
                                                f"{slot}'s block table)" for slot, i, k in held) + \
                ": the keys of their common prefix"
        else:
            slot, i, k = held[0]
            holds = f"request {letter(i)}'s positions {positions(k)} (entry {k} of slot {slot}'s block table): {tokens}"
        title = (f"slot {block}, positions 0-{size - 1}: " if kv_blocks is None else f"block {block}: ") + holds
        if block in written:
            title += f"; written this step: {js_span(first + min(written[block]), first + max(written[block]))}"
        if block in found_by:
            title += f"; found in the prefix cache this step by {' and '.join(letter(i) for i in found_by[block])}"
        if block in evicted_from:
            title += f"; evicted this step: it kept {names(evicted_from[block])}'s keys, dropped and wiped for new work"
        if block in freed:
            title += f"; freed this step, preempted from {letter(freed[block])}"
        if kv_blocks is None:
            i = held[0][1] if held else None
            label = f"slot {block}: " + ("empty" if i is None else f"{letter(i)}, {filled} of {size}") + \
                    (", handed over" if i is not None and i in report.handed_over else "")
        else:
            label = f"block {block}: " + ("shared by " if len(held) > 1 else "") + \
                (", ".join(letter(i) for _, i, _ in held) if held else "" if block in kept_for else "free") + \
                (f"keeps {', '.join(letter(i) for i, _ in kept_for[block])}'s" if block in kept_for else
                 f", was {letter(freed[block])}'s" if block in freed else "") + \
                (", evicted" if block in evicted_from else "") + (", found" if block in found_by else "")
        drawn.append([label, title])
    return drawn


def wanted_info(ran, report):
    """The step's figures, a part each, as their text reads (each part's chips and phase labels run on)."""
    _, n_slots, _, prefill_chunk, disaggregate, kv_blocks, _ = ran
    letter = nanobatch.letter
    groups = [([f"+{letter(i)}" + (f"({n} found)" if n else "") for i, n in zip(report.admitted, report.found_cached)],
               "phase 2"),
              ([f"!{letter(i)}" for i in report.preempted], "phase 3, preempted"),
              ([f">{letter(i)}" for i in report.handed_over], "phase 4b"),
              ([f"-{letter(i)}({c.finish_reason},{len(c.tokens)})" for i, c in report.finished],
               "phase 5, freed in phase 7")]
    events = " ".join("".join(chips) + label for chips, label in groups if chips) or "none"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        nanobatch.print_step(report)
    budget = "no limit" if prefill_chunk is None else prefill_chunk
    packed = report.packed
    n_padding = 0 if packed is None else sum(report.occupants[slot] is None for slot in packed.slots.tolist())
    n_dummies = 0 if packed is None or not packed.n_one_token else packed.one_token_mask.size(0) - packed.n_one_token
    n_idle = report.belt.count(".")
    # Paged, a queue beside a slot free after admission (not one phase 3's preemptions freed) waits for blocks.
    n_free = report.occupants.count(None) - len(report.preempted)
    for_blocks = " for blocks, a slot free" if kv_blocks is not None and report.n_waiting and n_free else ""
    info = [" ".join(printed.getvalue().split()), f"events: {events}",
            f"queue: {report.n_waiting} waiting {''.join(letter(i) for i in report.waiting)}{for_blocks}phases 1-2",
            f"{report.n_running}/{n_slots} make a token"
            + (f", {report.n_prefilling} prefilling" if report.n_prefilling else "") + "phase 5",
            f"prompt tokens: none here, the worker prefills them (its chunk: {budget})phase 3" if disaggregate else
            f"prompt tokens {report.n_prompt_tokens} of {budget} (prefill_chunk)phase 3",
            f"step {js_fixed(1e3 * round(report.step_s, 5), 1)} ms, model {js_fixed(1e3 * round(report.model_s, 5), 1)} ms"
            "phase 4",
            f"waste: {n_idle} slot{'' if n_idle == 1 else 's'} idle, {n_padding} padding row"
            f"{'' if n_padding == 1 else 's'}, {n_dummies} dumm{'y query' if n_dummies == 1 else 'y queries'}"]
    if disaggregate:
        info.append(f"the prefill worker holds: {''.join(letter(i) for i in report.at_worker) or 'none'}Part 2")
    return info


def wanted_texts(shown, name, index, evicted):
    """Everything the page draws as text at step `index` of run `name`, worked out from what ran (evicted:
    the blocks the engine evicted in that step)."""
    ran = next(run for run in shown.runs if run[0] == name)
    _, n_slots, _, _, _, kv_blocks, prefix_cache = ran
    reports = shown.reports[name]
    report = reports[index]
    preempted_at = {i: earlier.step for earlier in reports[:index] for i in earlier.preempted}  # the latest
    found = {i: n for earlier in reports[:index + 1] for i, n in zip(earlier.admitted, earlier.found_cached)}
    rows, captions, grids = wanted_rows(report, shown.requests, preempted_at, found)
    M = 0 if report.packed is None else report.packed.tokens.numel()
    pool = f"per slot, {n_slots} slots of {js_number(report.kv_total / n_slots)} positions" if kv_blocks is None \
        else f"paged, a pool of {kv_blocks} blocks of {js_number(report.kv_total / kv_blocks)} positions" + \
        (", with a prefix cache: full blocks shared, and kept once free" if prefix_cache else "")
    tabs = [[other, f"{policy} batching, {slots} slots, prefill_chunk "
                    f"{'none (whole prompts)' if chunk is None else chunk}"
                    f"{', the prompts on a worker' if worker else ''}"
                    f"{'' if blocks is None else f', paged: {blocks} blocks'}{', a prefix cache' if prefix else ''}"]
            for other, slots, policy, chunk, worker, blocks, prefix in shown.runs]
    return dict(count=f"({index + 1} of {len(reports)} steps of {name})", tabs=tabs,
                packed=f"the packed step: M = {M} rows, side by side, as one forward takes them"
                       "phase 3: plan_step chooses, pack_step packs",
                cache=f"the KV cache after the forward: {pool}phase 4: the forward writes each row's keys and "
                      "valuesphase 6: the report records the cache",
                rows=rows, captions=captions, grids=grids, blocks=wanted_blocks(ran, reports, index, evicted),
                info=wanted_info(ran, report))


def check_texts(probed, looks):
    """At every step of the six runs, every text and title the page draws is the one worked out from
    what ran (wanted_texts), word for word."""
    for (link, run, step), look in zip(probed.links, looks):
        evicted = probed.evicted[run["name"]].get(step["step"], [])
        want = wanted_texts(probed.shown, run["name"], run["steps"].index(step), evicted)
        drawn = dict(look["texts"], captions=look["captions"],
                     blocks=[[block["label"], block["title"]] for block in look["blocks"]],
                     info=[" ".join(look["info"][0][0].split())] + [text for text, _ in look["info"][1:]])
        for part, wanted in want.items():
            assert drawn[part] == wanted, f"{link}, {part}:\n  drawn {drawn[part]}\n  want  {wanted}"


def test_every_text_and_title_is_the_reports(probed):
    """Planted: a block's hover text one position past its end, or its positions (or the positions
    that hold a token) counted from its number, not its entry in the table; a row's title calling its
    first answer token a prompt token, or every row sampled; the one-token call's S read from its L;
    a chunk's L read from its rows (B's chunk with the prefix cache, at step 5, starts at position 4);
    the dummy queries counted as every query; a slot's label and a tab's title from the wrong field;
    the step count from the step's number; a whole prompt left one to go."""
    assert [text for text, _ in probed.looked["as written"][0]["info"]] and all(
        look["texts"]["rows"] for look in probed.looked["as written"] if look["rows"]), "the probe read no text"
    check_planted(check_texts, probed, "a block's positions one past its end", "a block's positions from its number",
                  "a block's tokens from its number", "an answer's first token a prompt token", "every row sampled",
                  "the one-token call's S from its L", "a chunk's L from its rows", "every query a dummy",
                  "a slot's fill from kv_used", "the tab's policy the first run's",
                  "the step count from the step's number", "a whole prompt one to go")


def stays_by_hand(reports):
    """Each stay on the belt, worked out from the reports on their own: a request's run of reports in
    one slot -> [(request, slot, [(step, its belt character)], the step of the report that preempted
    it or None, whether it came back after one, the positions its admission found cached)]."""
    stays, open_stays, seen = [], {}, set()
    for report in reports:
        found = dict(zip(report.admitted, report.found_cached))  # Part 4: what each admission found cached
        for slot, i in enumerate(report.occupants):
            stay = open_stays.get(slot)
            if stay is not None and stay[0] != i:  # its occupant left, retired or preempted
                stays.append(open_stays.pop(slot))
                stay = None
            if i is not None:
                if stay is None:
                    open_stays[slot] = stay = (i, slot, [], [None], i in seen, found.get(i, 0))
                    seen.add(i)
                stay[2].append((report.step, report.belt[slot]))
        for i in report.preempted:  # the stay that held it until now
            last = max((stay for stay in stays if stay[0] == i), key=lambda stay: stay[2][-1][0])
            last[3][0] = report.step
    return stays + list(open_stays.values())


def check_belt_titles(page, shown):
    """Each stay's title in each run's belt, and each bar's in the worker's lane, is what the reports say."""
    letter = nanobatch.letter
    for name, *_ in shown.runs:
        belt = re.search(rf'<div class="belt" data-run="{name}">(.*?)</div>', page, re.S)[1]
        drawn = sorted(html.unescape(title) for title in re.findall(r"<g><title>(.*?)</title><rect class=\"stay\"", belt))
        wanted = []
        for i, slot, steps, (preempted,), came_back, n_found in stays_by_hand(shown.reports[name]):
            hatched = [step for step, character in steps if character == "~"]
            n_tokens = len(steps) - len(hatched)
            title = f"request {letter(i)}, slot {slot}: steps {steps[0][0]}-{steps[-1][0]}, {n_tokens} token" + \
                    ("" if n_tokens == 1 else "s")
            if n_found:
                title += f"; admitted with positions 0-{n_found - 1} found in the prefix cache, not fed again"
            if hatched:
                title += f"; no token yet in steps {hatched[0]}-{hatched[-1]}: " + \
                         ("its prompt and answer going in again" if came_back else "its prompt not all in")
            if preempted is not None:
                title += f"; preempted at step {preempted}: its blocks freed, back to the head of the queue"
            wanted.append(title)
        assert drawn == sorted(wanted), f"{name}: the stays' titles\n  drawn {drawn}\n  want  {sorted(wanted)}"
        lane = sorted(html.unescape(title) for title in re.findall(r'<rect class="held"[^>]*><title>([^<]*)</title>', belt))
        admitted = {i: report.step for report in shown.reports[name] for i in report.admitted}
        handed = {i: report.step for report in shown.reports[name] for i in report.handed_over}
        assert lane == sorted(f"{letter(i)}: admitted at step {admitted[i]}, handed over at step {handed[i]}"
                              for i in handed), f"{name}: the worker's lane's titles {lane}"


def test_the_belts_titles_are_the_reports(by_hand):
    """Each bar's hover text in the belts (the stays: steps, tokens, the positions found cached, the
    steps with no token yet, a preemption; the worker's lane: admission and handover), against the
    reports of the six runs."""
    check_belt_titles(by_hand.page, by_hand.shown)
    assert re.search(r"<title>[A-F]: admitted at step \d+, handed over", by_hand.page), "no bar in the worker's lane"
    assert "preempted at step 4" in by_hand.page, "no preempted stay"
    assert "admitted with positions 0-3 found in the prefix cache" in by_hand.page, "no stay that found positions"


def test_the_closing_message_names_the_step_it_links(by_hand, tmp_path, monkeypatch, capsys):
    """tools/explore.py ends with a link to step 12, or to a shorter run's last step, and says which:
    here the gap run's last step, 11 (the eighth)."""
    path = tmp_path / "belt.html"
    monkeypatch.setattr(explore, "run_for_file", lambda *args: (str(path), [], by_hand.shown))
    explore.main([str(path)])
    assert f"at step 11, say: {path.resolve().as_uri()}#run=continuous&step=11)" in capsys.readouterr().out
