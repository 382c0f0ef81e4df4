"""
The labs of docs/labs.md, each pinned by a test whose name holds `lab`. The tests a lab says fail
are the proof's: they are called here from test_nanobatch.py, by name, with the lab's change applied.
"""
import argparse
import contextlib
import inspect
import io
import re
import shlex
import statistics
import textwrap

import pytest
import torch

import model as model_py
import nanobatch
import test_nanobatch as proof
from test_nanobatch import check_clock, decode_sees_everything
from tests.common import MAX_LEN, REPO, first_difference, random_workload, tiny_gpt
import bench  # noqa: E402 (tools/, put on the path by tests.common)


# ---------------------------------------------------------------------------------------------
# The labs of docs/labs.md, each pinned by a test whose name holds `lab`
#
#     python -m pytest -q -k lab        (every lab's claim, checked on main; seconds each)
#
# A lab's change is read from the lab's own ```diff block and applied here, to the source of the one
# function it touches, never to the files: so the page and its test cannot drift apart, and a diff
# that no longer applies fails its lab by name. Each test then checks what its lab says happens: the
# tests it names fail (called in this process with the change applied), or the figures move as
# stated, in steps and tokens wherever the claim allows; the timing claims compare runs made in one
# process, with a wide margin. The labs' excerpts are checked line by line against what their
# commands print, where the line does not hold a time.

LABS = REPO / "docs" / "labs.md"
TIMELESS_ROWS = ("steps", "generated tokens", "mean occupancy", "occupancy while queued", "latency P50/P99 (steps)",
                 "TTFT P50/P99 (steps)", "KV cache in use", "preemptions")  # the summary's rows that hold no time
PAGED_LINES = ("The same ", "  paged, ", "  per slot, ")  # what --demo --kv-blocks prints last: no time either


# ---------------------------------------------------------------------------------------------
# Reading docs/labs.md: a lab's section, its diffs, its commands, its excerpts


def lab(number):
    """Lab `number`'s section of docs/labs.md: from its heading to the next heading of its level."""
    match = re.search(rf"^## Lab {number}\. .*?(?=^## |\Z)", LABS.read_text(), re.M | re.S)
    assert match, f"docs/labs.md has no '## Lab {number}. ...'"
    return match.group(0)


def diffs(section):
    """Each ```diff block of a lab -> (the file it changes, its lines before, its lines after): a
    line marked '-' is before only, '+' after only, ' ' (context) both."""
    found = []
    for block in re.findall(r"```diff\n(.*?)```", section, re.S):
        lines = block.splitlines()
        assert lines[0].startswith("--- a/") and lines[1].startswith("+++ b/"), f"no file header: {block}"
        body = lines[2:]
        assert all(line[:1] in " -+" for line in body), f"a line neither ' ', '-' nor '+': {block}"
        before = "".join(line[1:] + "\n" for line in body if line[:1] in " -")
        after = "".join(line[1:] + "\n" for line in body if line[:1] in " +")
        found.append((lines[1][len("+++ b/"):], before, after))
    return found


def functions_of(module):
    """(owner, name, function) for every function defined in module, methods of its classes included."""
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield module, name, value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for method_name, method in vars(value).items():
                if inspect.isfunction(method):
                    yield value, method_name, method


def source_of(function):
    """function's source, or '' for one made at run time (a dataclass's __init__, say)."""
    try:
        return inspect.getsource(function)
    except OSError:
        return ""


def apply_lab(monkeypatch, section, which=0):
    """A lab's diff applied, as a student applies it, to this process only: the one function whose
    source holds the diff's lines is compiled again with them changed, in its module's namespace, and
    monkeypatched in, where its module and the proof (test_nanobatch.py) hold it -> its name."""
    path, before, after = diffs(section)[which]
    module = {"nanobatch.py": nanobatch, "model.py": model_py}[path]
    assert (REPO / path).read_text().count(before) == 1, f"the lab's diff no longer applies to {path}:\n{before}"
    [(owner, name, function)] = [found for found in functions_of(module) if before in source_of(found[2])]
    source = textwrap.dedent(inspect.getsource(function).replace(before, after))
    defined = {}
    exec(compile(source, f"<{path}, {name}, as the lab changes it>", "exec"), vars(module), defined)
    for holder in (owner, proof) if owner is module else (owner,):
        if getattr(holder, name, None) is function:
            monkeypatch.setattr(holder, name, defined[name])
    return name


def commands(section):
    """The commands of a lab's ```bash blocks, each as its argv up to a pipe: a line, or the lines
    that a quoted argument spans (python -c "...")."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the argument goes on on the next line
                continue
            if argv:
                found.append(argv[:argv.index("|")] if "|" in argv else argv)
            pending = ""
        assert not pending, f"a quote left open in:\n{block}"
    return found


def excerpt_lines(section):
    """The lines of a lab's ```text excerpts that hold no time: belt lines and the summary's timeless rows."""
    lines = [line for block in re.findall(r"```text\n(.*?)```", section, re.S) for line in block.splitlines()]
    return [line for line in lines if line.startswith(("step ", *TIMELESS_ROWS, *PAGED_LINES))]


def check_excerpt(section, printed, width=None):
    """Every timeless line of the lab's excerpts is a line its command printed (its first `width`
    characters: the columns that hold no time)."""
    lines = {line[:width] for line in printed.splitlines()}
    missing = [line for line in excerpt_lines(section) if line[:width] not in lines]
    assert not missing, "lines of the lab's excerpt that the run did not print:\n" + "\n".join(missing)


def demo(*options):
    """nanobatch.py --demo --quick, in this process -> (what it ran, what it printed)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        shown = nanobatch.main(["--demo", "--quick", *options])
    return shown, printed.getvalue()


def ttft_steps(shown, name, i):
    return shown.completions[name][i].first_token_step - shown.requests[i].arrival + 1


def workload_for(model, sampled):
    """test_nanobatch's `workload` fixture, for a call outside pytest's fixtures: the requests, an
    eos_id the model emits mid-answer, and the reference's answers."""
    requests = random_workload(seed=9, sampled=sampled)
    no_eos = nanobatch.generate_sequential(model, requests, max_len=MAX_LEN, eos_id=None)
    eos_id = next(c.tokens[k] for c in no_eos for k in range(1, len(c.tokens)) if c.tokens[k] not in c.tokens[:k])
    return requests, eos_id, nanobatch.generate_sequential(model, requests, max_len=MAX_LEN, eos_id=eos_id)


def matches_sequential(model, monkeypatch, n_slots, policy="continuous", prefill_chunk=None, sampled=False):
    """Does test_generate_matches_sequential pass on this case (its cut 'by cost')?"""
    try:
        proof.test_generate_matches_sequential(model, workload_for(model, sampled), n_slots, policy, prefill_chunk,
                                               "by cost", monkeypatch)
    except AssertionError:
        return False
    return True


def recorded_masks(model, requests, n_slots):
    """Every mask the forwards of a run attended under, as the page draws them (from StepReport.packed)."""
    reports = []
    nanobatch.generate(model, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=None, on_step=reports.append)
    return [[report.packed.one_token_mask.tolist()] + [mask.tolist() for _, _, mask in report.packed.chunks]
            for report in reports]


@pytest.fixture(scope="module")
def main_demo():
    """The quick demo as main runs it, once: what it ran and what it printed."""
    return demo()


def test_lab_commands_parse(monkeypatch):
    """Every command the labs give is one a fresh clone takes: nanobatch.py's and tools/bench.py's
    options parse (parsed only, not run), tools/explore.py takes the demo's, each -k selection names
    tests of the suite, and the page's deep links are the form tools/explore.py prints."""
    text = LABS.read_text()
    parsed = []
    monkeypatch.setattr(nanobatch, "run_cli", lambda run, args: parsed.append(args))
    suite_text = "".join(path.read_text() for path in [REPO / "test_nanobatch.py", *(REPO / "tests").glob("*.py")])
    for number in range(1, 10):
        for argv in commands(lab(number)):
            if argv[:2] == ["python", "nanobatch.py"]:
                nanobatch.main(argv[2:])
            elif argv[:2] == ["python", "tools/bench.py"]:
                bench.main(argv[2:])
            elif argv[:2] == ["python", "tools/explore.py"]:
                assert (REPO / "tools" / "explore.py").is_file()
                nanobatch.main(["--demo", *argv[3:]])  # FILE, then the options of --demo
            elif argv[:4] == ["python", "-m", "pytest", "-q"]:
                selection = argv[argv.index("-k") + 1]
                for word in set(re.findall(r"\w+", selection)) - {"and", "or", "not"}:
                    assert word in suite_text, f"lab {number}: -k {selection!r}: no test of the suite holds {word!r}"
            elif argv[:2] == ["python", "-c"]:
                compile(argv[2], f"lab {number}'s python -c", "exec")
            elif argv[0] != "git":
                raise AssertionError(f"lab {number}: a command these checks do not know: {argv}")
        assert "**Predict.**" in lab(number) and "**Why.**" in lab(number), f"lab {number} lacks its parts"
    assert parsed, "no command of nanobatch.py or tools/bench.py was parsed"
    assert len(text.splitlines()) <= 340, "docs/labs.md is over 340 lines"
    for link in re.findall(r"file:///tmp/belt\.html#[^`\s]+", text):
        assert re.fullmatch(r"file:///tmp/belt\.html#run=(continuous|static)&step=\d+", link), link


# ---------------------------------------------------------------------------------------------
# Lab 1: read the belt


def test_lab_1_read_the_belt(main_demo):
    """The belt's excerpt is the demo's; L takes F's slot the step after F's last token, and its
    37-token prompt goes in over two steps (32, the budget, then 5); I, admitted into slot 0 at
    step 2, waits for a share of the budget until step 5; step 8 packs 7 one-token rows and L's
    first 32 tokens, 39 rows."""
    shown, printed = main_demo
    check_excerpt(lab(1), printed)
    completions, reports = shown.completions["continuous"], shown.reports["continuous"]
    F, I, L = (ord(name) - ord("A") for name in "FIL")
    assert (completions[F].slot, completions[F].finish_step) == (5, 7)
    assert (completions[L].slot, completions[L].admit_step, completions[L].first_token_step) == (5, 8, 9)
    assert len(shown.requests[L].prompt) == 37 and nanobatch.DEMO_PREFILL_CHUNK == 32
    assert (completions[I].slot, completions[I].admit_step, completions[I].first_token_step) == (0, 2, 6)
    into_slot_0 = [[rows.stop - rows.start for rows, slot, _ in reports[step].packed.chunks if slot == 0]
                   for step in range(2, 7)]
    assert into_slot_0 == [[], [], [], [17], [4]], "I's prompt: nothing at steps 2-4, 17 tokens at 5, 4 at 6"
    step_8 = reports[8].packed
    assert step_8.n_one_token == 7 and step_8.tokens.numel() == 39
    assert [(rows.stop - rows.start, slot) for rows, slot, _ in step_8.chunks] == [(32, 5)]


# ---------------------------------------------------------------------------------------------
# Lab 2: static from continuous


def test_lab_2_static_from_continuous(monkeypatch, main_demo):
    """Static refilling once half the belt is free: static's 198 steps become 125 and its median
    TTFT 45 steps 19; continuous, which never reads the changed condition, stays at 111 and 10."""
    before, _ = main_demo
    assert [before.summaries[name]["steps"] for name in ("continuous", "static")] == [111, 198]
    assert [before.summaries[name]["TTFT P50/P99 (steps)"] for name in ("continuous", "static")] == [(10, 16),
                                                                                                   (45, 106)]
    assert apply_lab(monkeypatch, lab(2)) == "slots_to_fill"
    after, printed = demo("--quiet")
    check_excerpt(lab(2), printed)
    assert [after.summaries[name]["steps"] for name in ("continuous", "static")] == [111, 125]
    assert [after.summaries[name]["TTFT P50/P99 (steps)"] for name in ("continuous", "static")] == [(10, 16),
                                                                                                  (19, 28)]


# ---------------------------------------------------------------------------------------------
# Lab 3: the mask


def test_lab_3a_the_mask_sees_past_its_position(monkeypatch):
    """A token that may see one position past its own: the equivalence fails wherever the call's L
    reaches past a row (3 slots), and holds where every row attends alone over exactly its own
    prefix (one slot, a token a step); the teeth test's control fails; the masks the forward ran
    under, which the page draws, change."""
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before = recorded_masks(gpt, rng_requests, n_slots=3)
    assert apply_lab(monkeypatch, lab(3), which=0) == "attention_mask"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3)
    assert matches_sequential(gpt, monkeypatch, n_slots=1, prefill_chunk=1)
    with pytest.raises(AssertionError):
        proof.test_a_broken_mask_is_caught(gpt, monkeypatch, decode_sees_everything)
    assert recorded_masks(gpt, rng_requests, n_slots=3) != masks_before, "the page's grid would not show it"
    # The page at the demo's step 8: a 1 past each row's own position, but for E's (39, the last of
    # the one-token call's L = 40) and the last of L's chunk (31 of 32).
    step_8 = demo("--quiet")[0].reports["continuous"][8]
    D, packed = step_8.packed.n_one_token, step_8.packed
    sees_past = {slot: bool(packed.one_token_mask[slot, 0, position + 1:].any())
                 for slot, position in zip(packed.slots[:D].tolist(), packed.positions[:D].tolist())}
    assert [slot for slot, seen in sees_past.items() if not seen] == [4] and step_8.belt[4] == "E"
    [(_, _, chunk_mask)] = packed.chunks  # L's first 32 prompt tokens, at positions 0..31
    assert [bool(chunk_mask[t, t + 1:].any()) for t in range(32)] == [True] * 31 + [False]


def test_lab_3b_the_mask_reads_another_slots_keys(monkeypatch):
    """Each one-token row scoring its neighbour's keys: the equivalence fails with 3 slots and holds
    with one (one slot rolled is itself); the teeth test's control fails; yet every mask the forward
    ran under is main's, so the page's grid cannot show it: which slot is read is the cache's index."""
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before = recorded_masks(gpt, rng_requests, n_slots=3)
    assert apply_lab(monkeypatch, lab(3), which=1) == "attend_packed"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3)
    assert matches_sequential(gpt, monkeypatch, n_slots=1)
    with pytest.raises(AssertionError):
        proof.test_a_broken_mask_is_caught(gpt, monkeypatch, decode_sees_everything)
    assert recorded_masks(gpt, rng_requests, n_slots=3) == masks_before, "the masks changed"


# ---------------------------------------------------------------------------------------------
# Lab 4: the dirty slot


def test_lab_4_the_dirty_slot(monkeypatch):
    """No wipe as a request leaves: the teeth test fails, its request 2 answering all 0s (argmax of
    NaN logits); a slot left with finite keys still answers right, the mask giving them weight 0."""
    assert apply_lab(monkeypatch, lab(4)) == "generate"
    with pytest.raises(AssertionError, match=re.escape("got  length [0, 0, 0, 0, 0, 0, 0]")):
        proof.test_a_slot_is_cleaned_for_its_new_occupant(monkeypatch)
    proof.test_reused_slot_gives_the_same_answer(tiny_gpt())


# ---------------------------------------------------------------------------------------------
# Lab 5: stalls


def test_lab_5_stalls():
    """The bench's long-prompt runs on the quick model: in steps, whole prompts feed 600 prompt
    tokens into one step, chunks at most 64, the prefill worker's loop none; chunks take the TTFT
    P50/P99 from 4/14 steps to 9/26. In time, the steps that take a long prompt whole last over
    twice the median step (measured: 3.1x)."""
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    args = argparse.Namespace(seed=0, slots=8, max_len=None, prefill_chunk=None, device=torch.device("cpu"),
                              kv_block_size=16)
    reports, run_all = {}, bench.run_all

    def recording(*arguments, **keywords):  # the step reports of the three runs, which long_prompts keeps to itself
        summaries, completions, all_reports = run_all(*arguments, **keywords)
        reports.update(all_reports)
        return summaries, completions, all_reports

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setattr(bench, "run_all", recording)
        panels = bench.long_prompts(model, args)
    summaries = {name: summary for name, _, _, summary, _ in panels}
    assert list(summaries) == ["whole prompts", "chunks of 64", "disaggregated"]
    check_excerpt(lab(5), printed.getvalue(), width=24 + 2 * 18)  # the table's label, then whole prompts and chunks
    assert summaries["whole prompts"]["TTFT P50/P99 (steps)"] == (4, 14)
    assert summaries["chunks of 64"]["TTFT P50/P99 (steps)"] == (9, 26)
    most = {name: max(report.n_prompt_tokens for report in reports[name]) for name in summaries}
    assert most == {"whole prompts": 600, "chunks of 64": 64, "disaggregated": 0}
    whole = reports["whole prompts"]
    long_steps = [report.step_s for report in whole if report.n_prompt_tokens >= 600]
    assert len(long_steps) == 4
    assert min(long_steps) > 2 * statistics.median(report.step_s for report in whole)


# ---------------------------------------------------------------------------------------------
# Lab 6: fairness


def test_lab_6_fairness(monkeypatch, main_demo):
    """Shortest job first on the demo: the median TTFT falls from 10 steps to 4, its P99 rises from
    16 to 36, and C (41 tokens, first in the queue) waits 36 steps for its first token instead of 2.
    Every answer is main's token for token: only the clock's first-come-first-served check fails."""
    before, _ = main_demo
    C = ord("C") - ord("A")
    assert apply_lab(monkeypatch, lab(6)) == "generate"
    after, printed = demo()
    check_excerpt(lab(6), printed)
    assert before.summaries["continuous"]["TTFT P50/P99 (steps)"] == (10, 16)
    assert after.summaries["continuous"]["TTFT P50/P99 (steps)"] == (4, 36)
    assert (ttft_steps(before, "continuous", C), ttft_steps(after, "continuous", C)) == (2, 36)
    assert before.requests[C].max_new_tokens == 41 and before.requests[C].arrival == 0
    for name in ("continuous", "static"):
        assert first_difference(after.completions[name], before.completions[name]) == ""
    with pytest.raises(AssertionError, match="admit_step out of arrival order"):
        check_clock(after.requests, after.completions["continuous"], 8, "continuous",
                          nanobatch.DEMO_PREFILL_CHUNK)


# ---------------------------------------------------------------------------------------------
# Lab 7: batch size


def test_lab_7_batch_size():
    """On a CPU a decode step's cost grows with its rows: 64 slots take well over twice the time of
    one per step (measured on the quick model: 5.3x), yet make well over 4 times its tokens a second
    (12x). The lab's own command runs, here on the quick model instead of GPT-2 124M."""
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    one, sixty_four = (bench.time_decode_steps(model, [[47] * n_slots], max_len=64)[0] for n_slots in (1, 64))
    assert sixty_four > 2 * one, f"a step of 64 slots {sixty_four:.4f} s, of one {one:.4f} s"
    assert 64 / sixty_four > 4 * (1 / one), f"tokens/s: 64 slots {64 / sixty_four:.0f}, one {1 / one:.0f}"
    [snippet] = [argv[2] for argv in commands(lab(7)) if argv[:2] == ["python", "-c"]]
    assert snippet.count("GPTConfig()") == 1
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet.replace("GPTConfig()", "GPTConfig(n_layer=1, n_head=1, n_embd=8)"), {})
    assert [line.split(":")[0].strip() for line in printed.getvalue().splitlines()] == \
        [f"{n} slots" for n in (1, 2, 4, 8, 16, 32, 64)]


# ---------------------------------------------------------------------------------------------
# Lab 8: sampling


def test_lab_8_sampling(monkeypatch):
    """Per-request generators: seeded, batched equals sequential; seed=None, two runs of the same
    request differ, so nothing can equal them. The lab's snippet prints what its excerpt shows for
    a seed. One generator shared by every request: every sampled case fails, one slot included (the
    reference left the generator elsewhere), and every greedy case passes."""
    gpt = tiny_gpt()
    assert matches_sequential(gpt, monkeypatch, n_slots=3, sampled=True)
    unseeded = nanobatch.Request([1, 2, 3], 16, temperature=1.0, seed=None)
    first, second = (nanobatch.generate(gpt, [unseeded], max_len=MAX_LEN, eos_id=None)[0].tokens for _ in range(2))
    assert first != second, "two unseeded runs drew the same 16 tokens"
    [snippet] = [argv[2] for argv in commands(lab(8)) if argv[:2] == ["python", "-c"]]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, {})
    seeded_line = printed.getvalue().splitlines()[0]
    assert seeded_line in re.findall(r"```text\n(.*?)```", lab(8), re.S)[-1].splitlines()
    assert apply_lab(monkeypatch, lab(8)) == "new_sampler"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3, sampled=True)
    assert not matches_sequential(gpt, monkeypatch, n_slots=1, sampled=True)
    assert matches_sequential(gpt, monkeypatch, n_slots=3, sampled=False)
    with pytest.raises(AssertionError):
        proof.test_needle_among_fillers(gpt)


# ---------------------------------------------------------------------------------------------
# Lab 9: what the reservation wastes


def test_lab_9_what_the_reservation_wastes(main_demo):
    """Per slot, the demo's cache holds a token in 2% of its positions, 4% at the peak; with max_len
    128 in 19% and 35%, the same 111 steps. Paged, the same 8,192 positions as 512 blocks of 16 with
    32 slots: up to 18 requests make a token in one step (per slot 8), 86 steps (111), median TTFT 12
    steps (21), none preempted. In 24 blocks, 384 positions: 67 preemptions, 108 steps, median TTFT 17."""
    shown, printed = main_demo
    runs = {options: demo("--quiet", *options) for options in
            [("--max-len", "128"), ("--kv-blocks", "512", "--slots", "32"), ("--kv-blocks", "24", "--slots", "32")]}
    check_excerpt(lab(9), "\n".join([printed] + [output for _, output in runs.values()]))

    def figures(shown, name):
        summary = shown.summaries[name]
        kv_mean, kv_peak = summary["KV cache in use"]
        return (round(100 * kv_mean), round(100 * kv_peak), summary["steps"], summary["TTFT P50/P99 (steps)"][0],
                summary["preemptions"], max(report.n_running for report in shown.reports[name]))

    assert figures(shown, "continuous") == (2, 4, 111, 10, 0, 8)
    assert figures(runs["--max-len", "128"][0], "continuous") == (19, 35, 111, 10, 0, 8)
    paged = runs["--kv-blocks", "512", "--slots", "32"][0]
    assert paged.runs[1][1] == 8 == 512 * 16 // 1024, "per slot, the same memory is not 8 slots"
    assert [figures(paged, name)[2:] for name in ("paged", "per slot")] == [(86, 12, 0, 18), (111, 21, 0, 8)]
    assert all(r.arrival == 0 for r in paged.requests), "with 32 slots, all 32 requests should queue at step 0"
    tight = runs["--kv-blocks", "24", "--slots", "32"][0]
    assert [name for name, *_ in tight.runs] == ["paged"] and figures(tight, "paged")[2:5] == (108, 17, 67)

