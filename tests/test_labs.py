"""
The labs of docs/labs.md, each pinned by a test whose name holds `lab`. The tests a lab says fail
are the proof's: they are called here from test_nanobatch.py, by name, with the lab's change applied.
"""
import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import itertools
import math
import re
import shlex
import statistics
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

import model as model_py
import nanobatch
import test_nanobatch as proof
import tests.common
from test_nanobatch import check_clock
from tests.common import MAX_LEN, REPO, TIMEOUT_S, ends_within, first_difference, random_workload, tiny_gpt
import bench  # noqa: E402 (tools/, put on the path by tests.common)
import load  # noqa: E402
import load_http  # noqa: E402
import serve  # noqa: E402
import verify  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The labs of docs/labs.md, each pinned by a test whose name holds `lab`
#
#     python -m pytest -q -k lab        (every lab's claim, checked on main; seconds each)
#
# A lab's change is read from the lab's own ```diff block and applied here, to the source of the one
# function it touches, never to the files: so the page and its test cannot drift apart, and a diff
# that no longer applies fails its lab by name. Each test then checks what its lab says happens: the
# tests it names fail (called in this process with the change applied), or the figures move as
# stated, in steps and tokens wherever the claim allows; the timing claims time what they compare in
# turn, round after round, each one's fastest round kept, and assert only what holds however busy
# the machine is (a time read once failed by chance: Labs 5 and 7). The labs' excerpts are checked
# line by line against what their commands print, where the line does not hold a time, and so are
# the counts of tests failed and passed that pytest printed there (the tests a lab runs are run here,
# below). And every figure a lab's prose states in steps, tokens, slots, rows, positions, requests,
# tests or cases is read from the prose itself, by its phrase (`says`), and compared with what the
# runs gave: a lab cannot state a number its code does not produce, and each lab's test ends by
# checking that no number of its prose went unread. Figures in seconds are not measured (the labs
# say they vary); where the prose repeats its excerpt's, the two must agree.

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
    monkeypatched in, where its module and the proof (test_nanobatch.py) hold it; or a module's
    constant (NAME = value, one line) given the new value -> its name."""
    path, before, after = diffs(section)[which]
    module = {"nanobatch.py": nanobatch, "model.py": model_py, "tools/bench.py": bench}[path]
    assert (REPO / path).read_text().count(before) == 1, f"the lab's diff no longer applies to {path}:\n{before}"
    constant = re.fullmatch(r"([A-Z][A-Z0-9_]*) = [^\n]*\n", before)
    if constant:  # read by the functions that use it when they run: a module's global, set anew
        name = constant[1]
        assert re.fullmatch(rf"{name} = [^\n]*\n", after), f"the lab's diff changes {name} into another line"
        monkeypatch.setattr(module, name, ast.literal_eval(after.split("=", 1)[1].split("#")[0].strip()))
        return name
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


class Stopped(Exception):
    """Raised from a run's on_step, with that step's StepReport, to end the run there."""


def demo_step(number, *options):
    """The quick demo's first run up to step `number`, stopped there -> that step's StepReport (its
    logits and PackedStep kept). The rest of the demo, its two runs to their ends, would take a second."""
    generate = nanobatch.generate

    def stopping(*args, on_step, **kwargs):
        def report_then_stop(report):
            on_step(report)
            if report.step == number:
                raise Stopped(report)
        return generate(*args, on_step=report_then_stop, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stopped) as stopped:
        patch.setattr(nanobatch, "generate", stopping)
        demo("--quiet", *options)
    return stopped.value.args[0]


def ttft_steps(shown, name, i):
    return shown.completions[name][i].first_token_step - shown.requests[i].arrival + 1


def recorded_masks(model, requests, n_slots):
    """Every mask the forwards of a run attended under, as the page draws them (from StepReport.packed)."""
    reports = []
    nanobatch.generate(model, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=None, on_step=reports.append)
    return [[report.packed.one_token_mask.tolist()] + [mask.tolist() for _, _, mask in report.packed.chunks]
            for report in reports]


# ---------------------------------------------------------------------------------------------
# The figures a lab's prose states, read by their phrase


NUMBER_WORDS = {"one": 1, "two": 2, "both": 2, "three": 3, "four": 4, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
                "thirteen": 13}


def prose(section):
    """A lab's text outside its code blocks, on one line, without its marks (`code`, **bold**): a
    phrase is found wherever the lines wrap."""
    text = re.sub(r"```.*?```", " ", section, flags=re.S).replace("`", "").replace("**", "")
    return " ".join(text.split())


PINNED = {}  # a lab's prose -> the spans of it that `stated` matched in the test running now


def stated(section, pattern):
    """The figures a lab's text states in the groups of `pattern`, which must match it once -> (the
    words matched, the figures: an int for '7', '1,024' or 'four', a float for '3.35', else the text)."""
    found = list(re.finditer(pattern, prose(section)))
    heading = section.splitlines()[0].lstrip("# ")
    assert len(found) == 1, f"{heading}: the text has {len(found)} phrases like {pattern!r}, not one (reworded?)"

    def figure(text):
        if re.fullmatch(r"\d[\d,]*", text):
            return int(text.replace(",", ""))
        if re.fullmatch(r"\d+\.\d+", text):
            return float(text)
        return NUMBER_WORDS.get(text.lower(), text)
    PINNED.setdefault(prose(section), set()).update(found[0].span(g) for g in range(1, len(found[0].groups()) + 1))
    return found[0].group(0), tuple(figure(group) for group in found[0].groups())


def says(section, pattern, *figures):
    """The lab's text states, in the phrase `pattern` matches, exactly these figures (worked out from
    what its runs did)."""
    words, written = stated(section, pattern)
    heading = section.splitlines()[0].lstrip("# ")
    assert written == figures, f"{heading} says {words!r}, but the figures are {figures}"


# Every figure a lab states in digits must be one its test works out: each lab's test ends by
# checking that every number in its prose lies in a phrase that `stated` (or `says`) matched, but for
# the phrases it names as holding none a run gives (a heading's minutes, a name like GPT-2, a time the
# lab says varies). A figure added to a lab's text, or a phrase reworded so that it is no longer
# read, fails its lab by name.

FIGURE = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)")  # 7, 1,024, 3.35, 4 and 40 of 4-40; not H100
NAMES = (r"^## Lab \d+\. [^(]*\(\d+ min\)", r"\(\d\) ", r"GPT-2\b", r"Part \d\b")  # a heading, (1) a question, names


@pytest.fixture(autouse=True)
def pinned_afresh():
    """Each test counts the phrases it matched itself."""
    PINNED.clear()


def check_every_figure_pinned(section, *unpinned, within=r".*"):
    """Every number in the lab's prose (within the part the regex `within` matches) lies in a phrase
    this test matched with `stated`, in a heading or a name (NAMES), or in one of the `unpinned`
    phrases (regexes), each of which must be there, so that the list cannot go stale."""
    text = prose(section)
    heading = section.splitlines()[0].lstrip("# ")
    part = re.search(within, text)
    assert part, f"{heading}: no part like {within!r}"
    read = set(PINNED.get(text, set()))
    for phrase in NAMES + unpinned:
        spans = [match.span() for match in re.finditer(phrase, text)]
        assert spans or phrase in NAMES, f"{heading}: the text has no {phrase!r}, which its test names as holding " \
                                         f"no figure to check"
        read.update(spans)
    loose = [f"{text[start:end]} in {text[max(0, start - 30):end + 10]!r}" for start, end in
             (figure.span() for figure in FIGURE.finditer(text, *part.span()))
             if not any(first <= start and end <= last for first, last in read)]
    assert not loose, f"{heading} states figures its test does not check:\n" + "\n".join(loose)


def phase(first_word):
    """The number of `generate`'s phase whose comment opens with first_word ('# 7) Retire ...'), as
    nanobatch.py has it (a lab's change may have replaced the function in this process)."""
    text = (REPO / "nanobatch.py").read_text()
    found = re.findall(rf"# (\d+)\) {first_word}\b", re.search(r"^def generate\(.*?(?=^\S)", text, re.M | re.S)[0])
    assert len(found) == 1, f"generate has {len(found)} phases that open with {first_word!r}"
    return int(found[0])


# ---------------------------------------------------------------------------------------------
# The tests a lab runs, run here, with its change applied
#
# A lab's `python -m pytest -q ... -k EXPR` prints how many of the tests it selects fail and pass,
# and its prose counts the cases that fail. Both are worked out here, in this process, with the
# lab's change applied (by the caller, with apply_lab): each case of each selected test is called
# as pytest calls it, with its parametrized arguments and its fixtures, made by the fixtures' own
# functions (gpt, gpt_on, workload, explored_runs, ...; monkeypatch fresh for each case), on a CPU.
# Each case is a tiny model's run, a tenth of a second or so; test_generate_matches_sequential has
# 54 of them. So a run stops as soon as its test must fail (a greedy token, or an answer, unlike the
# reference's: first_difference fails it there anyway): a failing case costs a few steps. And a
# case that a lab's change cannot reach (a roll over one slot; a greedy token, which never draws)
# is not run: its run is main's, which passes, for the reason its lab's test checks.


@dataclasses.dataclass
class Case:
    id: str  # as pytest names it: test_nanobatch.py::test_clock[1-continuous-None]
    test: str  # the test's name
    params: dict  # its fixtures' params (gpt_on: 'cpu', workload: 'greedy') and parametrized arguments
    marked: tuple = ()  # which of params are parametrized arguments
    passed: bool = True  # False: failed, or skipped
    skipped: bool = False
    message: str = ""  # what failed, as pytest's E lines print it: 'AssertionError: ...'
    ran: bool = True  # False: not run, its run being main's for a reason the lab's test checks


def selected_tests(expression):
    """The suite's tests a `-k expression` selects, as pytest selects them: a word matches a test
    whose file or name holds it (case aside) -> [(module, name)], file by file, in file order."""
    found = []
    for path in [REPO / "test_nanobatch.py", *sorted((REPO / "tests").glob("test_*.py"))]:
        for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M):
            where = f"{path.relative_to(REPO)}::{name}".lower()
            test = re.sub(r"\w+", lambda word: word[0] if word[0] in ("and", "or", "not") else
                          f"({word[0].lower()!r} in where)", expression)
            if eval(test, {"where": where}):
                module_name = path.stem if path.parent == REPO else f"tests.{path.stem}"
                found.append((importlib.import_module(module_name), name))
    assert found, f"-k {expression!r} selects no test"
    return found


def lab_selection(section):
    """The tests the lab's `python -m pytest` command selects."""
    [argv] = [argv for argv in commands(section) if argv[:4] == ["python", "-m", "pytest", "-q"]]
    return selected_tests(argv[argv.index("-k") + 1])


def fixture_definition(module, name):
    """The fixture a test of `module` takes by that name: the module's own, or tests.common's (which
    tests/conftest.py hands to every file)."""
    definition = getattr(module, name, None) or getattr(tests.common, name, None)
    assert hasattr(definition, "__wrapped__"), f"{module.__name__}'s tests take {name!r}, which run_cases cannot make"
    return definition


def fixture_params(module, name):
    """The params a fixture is declared with (@pytest.fixture(params=...)), on a CPU; None: none."""
    function = fixture_definition(module, name).__wrapped__
    [tree] = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    for keyword in (keyword for decorator in tree.decorator_list for keyword in getattr(decorator, "keywords", [])):
        if keyword.arg == "params":
            params = eval(ast.unparse(keyword.value), vars(sys.modules[function.__module__]))
            return [param for param in params if not str(param).startswith("cuda")]
    return None


def cases_of(module, name):
    """A test's cases on a CPU, in pytest's order and with pytest's ids -> [Case] (not yet run)."""
    function, axes = getattr(module, name), []

    def with_params(parameter):  # a fixture's own fixtures first, as pytest orders their params
        if parameter in ("monkeypatch", "request") or parameter in (axis for axis, _ in axes):
            return
        for inner in inspect.signature(fixture_definition(module, parameter).__wrapped__).parameters:
            with_params(inner)
        params = fixture_params(module, parameter)
        if params is not None:
            axes.append((parameter, [(param, str(param)) for param in params]))

    marks = [mark.args for mark in getattr(function, "pytestmark", []) if mark.name == "parametrize"]
    marked = {argname.strip() for argnames, _ in marks for argname in argnames.split(",")}
    for parameter in inspect.signature(function).parameters:
        if parameter not in marked:
            with_params(parameter)
    for argnames, values in marks:  # the decorator nearest the def first
        argnames = [argname.strip() for argname in argnames.split(",")]
        rows = [dict(zip(argnames, value if len(argnames) > 1 else (value,))) for value in values]
        rows = [row for row in rows if not any(str(value).startswith("cuda") for value in row.values())]
        axes.append((tuple(argnames), [(row, "-".join(pytest_id(row[argname], argname, index)
                                                      for argname in argnames)) for index, row in enumerate(rows)]))
    found = []
    for combination in itertools.product(*(values for _, values in axes)):
        params = {}
        for (axis, _), (value, _) in zip(axes, combination):
            params.update(value if isinstance(axis, tuple) else {axis: value})
        ids = "-".join(value_id for _, value_id in combination)
        path = module.__file__[len(str(REPO)) + 1:]
        found.append(Case(f"{path}::{name}" + (f"[{ids}]" if ids else ""), name, params, tuple(marked)))
    return found


def pytest_id(value, argname, index):
    """A parametrized value's part of a test id, as pytest makes it."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return getattr(value, "__name__", f"{argname}{index}")


def run_cases(tests, inert=lambda case: False, where=lambda case: True, stop=None):
    """Each case of `tests` ([(module, name)]) that `where` keeps, called as pytest calls it -> [Case],
    each with its verdict. An `inert` case is not run: the lab's change cannot reach it (its run is
    main's, bit for bit, for a reason the caller checks), so it passes as it does on main. stop(case)
    -> None, or a watch: watch(requests) -> a check of each step of a run, which raises where the test
    must fail anyway; by default, for a test taking the `workload`, a token unlike the reference's."""
    made, found = {}, []  # the fixtures made, by name and param: scoped to this call, as a module's are

    def value(module, name, case, monkeypatch):
        if name == "monkeypatch":
            return monkeypatch
        key = (name, case.params.get(name))
        if key not in made:
            function = fixture_definition(module, name).__wrapped__
            made[key] = function(**{inner: SimpleNamespace(param=case.params.get(name)) if inner == "request"
                                    else value(module, inner, case, monkeypatch)
                                    for inner in inspect.signature(function).parameters})
        return made[key]

    for module, name in tests:
        function = getattr(module, name)
        for case in filter(where, cases_of(module, name)):
            found.append(case)
            if inert(case):
                case.ran = False
                continue
            with pytest.MonkeyPatch.context() as monkeypatch:
                arguments = {parameter: case.params[parameter] if parameter in case.marked else
                             value(module, parameter, case, monkeypatch)
                             for parameter in inspect.signature(function).parameters}
                watch = stop(case) if stop else differs_from(arguments["workload"][2]) if "workload" in arguments \
                    else None
                if watch is not None:
                    stop_early(monkeypatch, module, watch)
                try:
                    function(**arguments)
                except pytest.skip.Exception:
                    case.passed, case.skipped = False, True
                except Exception as error:  # as pytest counts it: failed
                    case.passed, case.message = False, f"{type(error).__name__}: {error}"
    return found


def stop_early(monkeypatch, module, watch):
    """The module's generate, each run checked after each step by watch(requests): a check that
    raises ends a run whose test fails anyway, a few steps in rather than after the whole run."""
    generate = module.generate

    def stopping(model, requests, *args, on_step=None, **kwargs):
        check = watch(requests)

        def watching(report):
            if on_step is not None:
                on_step(report)
            check(report)
        return generate(model, requests, *args, on_step=watching, **kwargs)

    monkeypatch.setattr(module, "generate", stopping)


def differs_from(reference):
    """A stop: a greedy token unlike the reference's, as it is made (its logits' argmax), or any
    answer unlike the reference's, as it ends; first_difference fails the test on either."""
    def watch(requests):
        made = [0] * len(requests)  # tokens each request has made so far

        def check(report):
            for row, i in zip(report.logits, report.sampled):  # in the order of logits' rows
                if requests[i].temperature == 0:
                    assert reference[i].tokens[made[i]:made[i] + 1] == [int(row.argmax())], f"request {i} differs"
                made[i] += 1
            for i, completion in report.finished:
                assert first_difference([completion], reference[i:i + 1]) == "", f"request {i} differs"
        return check
    return watch


def of_test(cases, name):
    return [case for case in cases if case.test == name]


def check_pytest_lines(section, cases, block=0):
    """What pytest printed in the lab's block-th ```text excerpt: 'N failed, M passed', each FAILED
    line naming the first case of its test to fail, and each E line in the message of the first case
    that failed ('...': anything). Not the seconds, nor the tests deselected: those count the rest of
    the suite, which any new test changes."""
    lines = re.findall(r"```text\n(.*?)```", section, re.S)[block].splitlines()
    heading = section.splitlines()[0].lstrip("# ")
    [summary] = [line for line in lines if re.match(r"\d+ (failed|passed|skipped)", line)]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|skipped)", summary)}
    failed = [case for case in cases if not case.passed and not case.skipped]
    ran = {"failed": len(failed), "passed": sum(case.passed for case in cases),
           "skipped": sum(case.skipped for case in cases)}
    assert {"failed": 0, "passed": 0, "skipped": 0, **counts} == ran, \
        f"{heading}'s excerpt says {summary!r}; its tests: {ran}"
    for line in lines:
        if line.startswith("FAILED "):
            named = line[len("FAILED "):].split(" - ")[0]  # the case's id (then, maybe, ' - Asser...')
            first = [case.id for case in failed if case.test == named.split("::")[1].split("[")[0]][:1]
            assert [named] == first, f"{heading}: {line!r}, but the first of its test to fail: {first}"
        elif line.startswith("E "):
            pattern = ".*".join(re.escape(part) for part in line[1:].strip().split("..."))
            assert any(re.fullmatch(pattern, text.strip()) for text in failed[0].message.splitlines()), \
                f"{heading}: {line!r} is not in the first failure's message:\n{failed[0].message}"


def matches_sequential(n_slots, policy="continuous", prefill_chunk=None, sampled=False, cut="by cost"):
    """test_generate_matches_sequential's case, run (stopped at its first wrong token, if any) -> the
    Case: .passed, and what failed."""
    [case] = run_cases([(proof, "test_generate_matches_sequential")], where=lambda case: case.params == {
        "gpt_on": "cpu", "workload": "sampled" if sampled else "greedy", "n_slots": n_slots, "policy": policy,
        "prefill_chunk": prefill_chunk, "cut": cut})
    return case


@functools.cache
def proof_workload(name):
    """test_nanobatch.py's workload fixture, "greedy" or "sampled", on tiny_gpt() -> (requests, eos_id, reference)."""
    return fixture_definition(proof, "workload").__wrapped__(SimpleNamespace(param=name), tiny_gpt())


def logits_moved(case, main):
    """A case of test_generate_matches_sequential, run as the lab changes it and as main has it (main: the
    (holder, name, function) that the change replaced), compared step by step -> (the largest logit difference,
    whether every token is main's); (inf, False) where the two runs part."""
    model, (requests, eos_id, _) = tiny_gpt(), proof_workload(case.params["workload"])

    def run():
        reports = []
        with pytest.MonkeyPatch.context() as patch:
            if case.params["cut"] == "split":
                proof.split_attention_everywhere(patch)
            completions = nanobatch.generate(model, requests, n_slots=case.params["n_slots"], max_len=MAX_LEN,
                                             eos_id=eos_id, policy=case.params["policy"],
                                             prefill_chunk=case.params["prefill_chunk"], on_step=reports.append)
        return [completion.tokens for completion in completions], reports

    (changed, changed_reports) = run()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(*main)
        on_main, main_reports = run()
    if [(r.step, r.sampled) for r in changed_reports] != [(r.step, r.sampled) for r in main_reports]:
        return math.inf, False
    return max(float((a.logits - b.logits).abs().max()) for a, b in zip(changed_reports, main_reports)
               if a.logits.numel()), changed == on_main


@pytest.fixture(scope="module")
def main_demo(quick_demo):
    """The quick demo as main runs it, once for the suite (tests/common.py's quick_demo, whose page the page's
    tests read): what it ran and what it printed."""
    return quick_demo.shown, quick_demo.printed


def test_lab_commands_parse(monkeypatch):
    """Every command the labs give is one a fresh clone takes: nanobatch.py's, tools/bench.py's,
    tools/load.py's, tools/serve.py's, tools/load_http.py's and tools/verify.py's options parse (parsed
    only, not run; an environment variable set before one is left aside), tools/explore.py takes the
    demo's, each -k selection names tests of the suite, and the page's deep links are the form
    tools/explore.py prints. The introduction's figures: thirteen labs, their minutes in hours, and
    --quick's model of 2 layers and 64 dimensions."""
    text = LABS.read_text()
    parsed = []
    monkeypatch.setattr(nanobatch, "run_cli", lambda run, args: parsed.append(args))
    monkeypatch.setattr(load_http, "load_http", parsed.append)  # what load_http.main runs once it has parsed
    suite_text = "".join(path.read_text() for path in [REPO / "test_nanobatch.py", *(REPO / "tests").glob("*.py")])
    n_labs = len(re.findall(r"^## Lab \d+\. ", text, re.M))
    for number in range(1, n_labs + 1):
        for argv in commands(lab(number)):
            while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # OMP_NUM_THREADS=1 python ...
                argv = argv[1:]
            if argv[:2] == ["python", "nanobatch.py"]:
                nanobatch.main(argv[2:])
            elif argv[:2] == ["python", "tools/bench.py"]:
                bench.main(argv[2:])
            elif argv[:2] == ["python", "tools/load.py"]:
                load.main(argv[2:])
            elif argv[:2] == ["python", "tools/serve.py"]:
                parsed.append(serve.parse(argv[2:]))
            elif argv[:2] == ["python", "tools/load_http.py"]:
                load_http.main(argv[2:])
            elif argv[:2] == ["python", "tools/verify.py"]:
                verify.main(argv[2:])
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
    assert len(text.splitlines()) <= 630, "docs/labs.md is over 630 lines"
    for link in re.findall(r"file:///tmp/belt\.html#[^`\s]+", text):
        assert re.fullmatch(r"file:///tmp/belt\.html#run=(continuous|static)&step=\d+", link), link
    introduction = text[:text.index("\n## Lab 1.")]
    minutes = [int(n) for n in re.findall(r"^## Lab \d+\. .*\((\d+) min\)$", text, re.M)]
    assert len(minutes) == n_labs, "a lab's heading without its minutes"
    says(introduction, r"(\w+) labs for a workshop, in order, about (\w+) hours", n_labs, round(sum(minutes) / 60))
    says(introduction, r"a tiny random GPT-2 \((\d+) layers, (\d+) dimensions\)", nanobatch.TINY.n_layer,
         nanobatch.TINY.n_embd)
    check_every_figure_pinned(introduction, r"2-core AMD EPYC VMs with AVX-512 \(Labs 5 and 7's times: one without\)",
                              r"Lab 13's bits")  # the excerpts' machines


# ---------------------------------------------------------------------------------------------
# Lab 1: read the belt


def test_lab_1_read_the_belt(main_demo):
    """The belt's excerpt is the demo's; L takes F's slot the step after F's last token, and its
    37-token prompt goes in over two steps (32, the budget, then 5); I, admitted into slot 0 at
    step 2, waits behind D to H's prompts for a share of the budget until step 5; step 8 packs 7
    one-token rows and L's first 32 tokens, 39 rows. Every figure of the lab's text is the demo's."""
    shown, printed = main_demo
    section = lab(1)
    check_excerpt(section, printed)
    completions, reports = shown.completions["continuous"], shown.reports["continuous"]
    F, I, L = (ord(name) - ord("A") for name in "FIL")
    f, i, l = completions[F], completions[I], completions[L]
    line_of_step = {}  # the continuous belt's steps, by the line they are printed on
    for n, line in enumerate(printed.splitlines(), 1):
        if line.startswith("step "):
            line_of_step.setdefault(int(line.split()[1]), n)
    says(section, r"Print the belt to step (\d+) \(\| head -(\d+)\)", f.finish_step, line_of_step[f.finish_step])
    says(section, r"F leaves at step (\d+): which request", f.finish_step)
    says(section, r"L's prompt has (\d+) tokens; at most (\d+) prompt tokens enter a step",
         len(shown.requests[L].prompt), nanobatch.DEMO_PREFILL_CHUNK)
    says(section, r"How many rows does step (\d+)'s one forward carry", l.admit_step)
    says(section, r"I took slot (\d+) at step (\d+), yet makes no token until step (\d+)",
         i.slot, i.admit_step, i.first_token_step)
    says(section, r"Check with \| head -(\d+), then", line_of_step[l.first_token_step])
    says(section, r"belt\.html#run=continuous&step=(\d+), tick predict, press →: step (\d+) shows",
         f.finish_step, l.admit_step)
    assert l.slot == f.slot and reports[f.finish_step].waiting[0] == L, "L did not take F's slot, first in line"
    says(section, r"Phase (\d+) of generate retires F at the end of step (\d+), its last token's, freeing slot "
         r"(\d+); phase (\d+) of step (\d+) gives it", phase("Retire"), f.finish_step, f.slot, phase("Admit"),
         l.admit_step)
    step_8 = reports[l.admit_step].packed
    [(rows, slot, _)] = step_8.chunks
    D, positions = step_8.n_one_token, step_8.positions[rows].tolist()
    says(section, r"The page at step (\d+): the packed step: M = (\d+) rows, rows (\d+)-(\d+): one-token rows, "
         r"D = (\d+), attending together", l.admit_step, step_8.tokens.numel(), 0, D - 1, D)
    says(section, r"rows (\d+)-(\d+): L's prompt, positions (\d+)-(\d+), into slot (\d+); (\d+) more next step",
         rows.start, rows.stop - 1, positions[0], positions[-1], slot, len(shown.requests[L].prompt) - len(positions))
    assert (slot, reports[l.admit_step].belt[slot]) == (l.slot, "~")
    says(section, r"\((\d+) one-token rows\), then prompts in arrival order within the budget: L's first (\d+) "
         r"tokens, so slot (\d+) shows ~", D, rows.stop - rows.start, slot)
    chunks = {report.step: {report.occupants[slot]: rows.stop - rows.start for rows, slot, _ in report.packed.chunks}
              for report in reports if report.packed is not None}  # step -> {request: its rows in a chunk}
    says(section, r"At step (\d+) its last (\d+) go in", l.first_token_step, chunks[l.first_token_step][L])
    assert not any(I in chunks[step] for step in range(i.admit_step, i.first_token_step - 1)), "I fed at once"
    ahead = sorted({j for step in range(i.admit_step, i.first_token_step) for j in chunks[step]} - {I})
    assert ahead == list(range(ahead[0], ahead[-1] + 1)) and ahead[-1] < I, f"the prompts fed beside I's: {ahead}"
    says(section, r"I \((\d+) tokens\) waited behind the prompts of (\w) to (\w), which came before it, for a share "
         r"of the budget: (\d+) tokens at step (\d+), its last (\d+) at step (\d+)", len(shown.requests[I].prompt),
         chr(ord("A") + ahead[0]), chr(ord("A") + ahead[-1]), chunks[i.first_token_step - 1][I],
         i.first_token_step - 1, chunks[i.first_token_step][I], i.first_token_step)
    check_every_figure_pinned(section)


# ---------------------------------------------------------------------------------------------
# Lab 2: static from continuous


def test_lab_2_static_from_continuous(monkeypatch, main_demo):
    """Static refilling once half the belt is free: static's 198 steps become 125 and its median
    TTFT 45 steps 19, winning back 73 of the 87 steps it lost to continuous; continuous, which never
    reads the changed condition, stays at 111 and 10."""
    before, _ = main_demo
    section = lab(2)
    steps = {name: before.summaries[name]["steps"] for name in ("continuous", "static")}
    median = {name: before.summaries[name]["TTFT P50/P99 (steps)"][0] for name in ("continuous", "static")}
    says(section, r"On main the demo's static run takes (\d+) steps and its median request waits (\d+) steps for its "
         r"first token; continuous, (\d+) and (\d+)\.", steps["static"], median["static"], steps["continuous"],
         median["continuous"])
    assert apply_lab(monkeypatch, section) == "slots_to_fill"
    after, printed = demo("--quiet")
    check_excerpt(section, printed)
    assert [after.summaries[name]["steps"] for name in ("continuous", "static")] == [111, 125]
    assert [after.summaries[name]["TTFT P50/P99 (steps)"] for name in ("continuous", "static")] == [(10, 16),
                                                                                                  (19, 28)]
    says(section, r"refilling at half the belt wins back (\d+) of (\d+) steps",
         steps["static"] - after.summaries["static"]["steps"], steps["static"] - steps["continuous"])
    says(section, r"Phase (\d+) of generate asks slots_to_fill", phase("Admit"))
    says(section, r"until it refills \(phase (\d+); \. on its belt\)", phase("Choose"))
    check_every_figure_pinned(section)


# ---------------------------------------------------------------------------------------------
# Lab 3: the mask
#
# The proof's test_generate_matches_sequential has 54 cases on a CPU, which Labs 3 and 8 count: each
# is run here with the lab's change (a failing one stops at its first wrong token), but those that
# the lab's test shows its change cannot reach (one slot, in 3a fed a token a step; in 8 greedy).


def test_lab_3a_the_mask_sees_past_its_position(monkeypatch):
    """A token that may see one position past its own. Of test_generate_matches_sequential's 54
    cases on a CPU, the 10 that feed a token a step with one slot (runs the change cannot reach), or
    with every row split off alone, pass: each row's L ends at its own position. So do 2 greedy
    static ones by cost, a token a step (3 and 16 slots), by luck: their rows see past, their logits
    move (by up to 0.15), but not one argmax. The 42 others fail, with every disaggregated and
    packed-forward case, the teeth test at its first check, and the page's test: 65 failed, 12
    passed. The masks the forward ran under, which the page draws, change: at the demo's step 8, a 1
    past every row's own position but E's (39, the last of the one-token call's L = 40) and the last
    of L's chunk."""
    section = lab(3)
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before, main_mask = recorded_masks(gpt, rng_requests, n_slots=3), nanobatch.attention_mask
    assert apply_lab(monkeypatch, section, which=0) == "attention_mask"
    # One slot fed a token a step: each step feeds one token, at some position p, and the cut over one
    # row is its length, p + 1, whatever a call costs; over L = p + 1 positions the changed mask is
    # main's. So those runs are main's, which pass: they are not run.
    for call_cost in (model_py.CALL_COST_IN_KEYS["cpu"], 0):
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(model_py.CALL_COST_IN_KEYS, "cpu", call_cost)
            assert all(model_py.attention_cut([n], 1, torch.device("cpu")) == n for n in range(1, MAX_LEN + 1))
    for p in range(MAX_LEN):
        position = torch.tensor([[p]])
        assert torch.equal(nanobatch.attention_mask(position, p + 1), main_mask(position, p + 1))
        assert not torch.equal(nanobatch.attention_mask(position, p + 2), main_mask(position, p + 2))
    cases = run_cases(lab_selection(section), inert=lambda case: (case.params.get("n_slots"),
                                                                  case.params.get("prefill_chunk")) == (1, 1))
    check_pytest_lines(section, cases, block=0)
    sequential = of_test(cases, "test_generate_matches_sequential")
    axes = {axis: list(dict.fromkeys(case.params[axis] for case in sequential))  # each axis's values, in order
            for axis in ("n_slots", "policy", "prefill_chunk", "workload", "cut")}
    one_slot, *slots = axes["n_slots"]  # one slot: continuous by cost only, the others' runs being its own
    assert {(case.params["policy"], case.params["cut"]) for case in sequential if case.params["n_slots"] == one_slot} \
        == {("continuous", "by cost")}
    says(section, r"test_generate_matches_sequential runs (\d+) cases on a CPU \((\d+) or (\d+) slots, (\w+) policies, "
         r"(\w+) cuts, or (\d+) slot; whole prompts, (\d+) tokens a step or (\d+); greedy and sampled\)", len(sequential), *slots, len(axes["policy"]), len(axes["cut"]), one_slot,
         *sorted(axes["prefill_chunk"][1:], reverse=True))
    assert axes["prefill_chunk"][0] is None and axes["workload"] == ["greedy", "sampled"]
    assert len(sequential) == (len(slots) * len(axes["policy"]) * len(axes["cut"]) + 1) * len(axes["prefill_chunk"]) \
        * len(axes["workload"])
    passing = [case for case in sequential if case.passed]
    alone = [case for case in sequential if case.params["prefill_chunk"] == 1 and
             (case.params["n_slots"] == 1 or case.params["cut"] == "split")]
    lucky = [case for case in passing if case not in alone]
    assert all(case in passing for case in alone), [case.id for case in alone if not case.passed]
    says(section, r"(\d+) cases pass\. (\d+) feed a token a step with one slot, or with every row split off alone",
         len(passing), len(alone))
    # The others: greedy, static, by cost, a token a step. Their rows do see past their own position (the change
    # reaches them), their logits move, and not one token does: each run is compared with main's, row by row.
    assert all(case.params["workload"] == "greedy" and case.params["policy"] == "static" and
               case.params["cut"] == "by cost" and case.params["prefill_chunk"] == 1 for case in lucky), \
        [case.id for case in lucky]
    moved = [logits_moved(case, main=(nanobatch, "attention_mask", main_mask)) for case in lucky]
    assert all(dlogit > 0 and same_tokens for dlogit, same_tokens in moved), moved
    says(section, r"(\d+) more, greedy, static, by cost, a token a step \((\d+) and (\d+) slots\), pass by luck",
         len(lucky), *[case.params["n_slots"] for case in lucky])
    says(section, r"their logits move by up to ([\d.]+), yet no argmax moves", round(max(d for d, _ in moved), 2))
    says(section, r"(\d+) of the (\d+) fail, with every disaggregated and packed-forward case",
         len(sequential) - len(passing), len(sequential))
    for name in ("test_disaggregated_matches_sequential", "test_packed_forward_matches_forward",
                 "test_a_broken_mask_is_caught", "test_a_broken_mask_shows_in_the_page"):
        assert of_test(cases, name) and not any(case.passed for case in of_test(cases, name)), f"{name} passes"
    assert not any("went unnoticed" in case.message for case in of_test(cases, "test_a_broken_mask_is_caught")), \
        "the teeth test failed at its second check, not at its first (the engine's own run)"
    assert recorded_masks(gpt, rng_requests, n_slots=3) != masks_before, "the page's grid would not show it"
    # The page at the demo's step 8: a 1 past each row's own position, but for E's (39, the last of the
    # one-token call's L = 40) and the last of L's chunk (31 of 32).
    step = stated(section, r"At file:///tmp/belt\.html#run=continuous&step=(\d+) the grids draw")[1][0]
    report = demo_step(step)
    packed, D = report.packed, report.packed.n_one_token
    sees_past = {slot: bool(packed.one_token_mask[slot, 0, position + 1:].any())
                 for slot, position in zip(packed.slots[:D].tolist(), packed.positions[:D].tolist())}
    [blind] = [slot for slot, seen in sees_past.items() if not seen]
    legend = stated(section, r"the grids draw a red cell \((a \d+ past the query's own position)\)")[1][0]
    assert legend in (REPO / "tools" / "explore.html").read_text(), f"the page has no {legend!r}"
    position = packed.positions[:D].tolist()[packed.slots[:D].tolist().index(blind)]
    says(section, r"for every slot but (\w)'s \(position (\d+), the longest: L = (\d+) ends there\)",
         report.belt[blind], position, packed.one_token_mask.size(-1))
    [(_, _, chunk_mask)] = packed.chunks  # L's first 32 prompt tokens, at positions 0..31
    assert [bool(chunk_mask[t, t + 1:].any()) for t in range(32)] == [True] * 31 + [False]
    check_every_figure_pinned(section, within=r"^.*?(?=Change \(b\))")


def test_lab_3b_the_mask_reads_another_slots_keys(monkeypatch):
    """Each one-token row scoring its neighbour's keys: 41 of test_generate_matches_sequential's 54
    cases fail, all with 3 or 16 slots; every 1-slot case passes (one slot rolled is itself: those
    runs are main's), and so do 7 split cases: static's 6 on 16 slots, whose rows together attend over
    one position (one key: weight 1, whatever it scores), and 1 sampled one on 3 slots whose logits
    move (by up to 0.27) but not one token: 59 failed, 18 passed. The teeth test's control fails; yet
    every mask the forward ran under is main's, so the page's grid cannot show it and the page's test
    passes: which slot is read is the cache's index."""
    section = lab(3)
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before = recorded_masks(gpt, rng_requests, n_slots=3)
    main_attend = model_py.CausalSelfAttention.attend_packed
    assert apply_lab(monkeypatch, section, which=1) == "attend_packed"
    shift = int(re.search(r"keys\.roll\((\d+), 0\)", diffs(section)[1][2])[1])

    def read(n_slots):  # the slot whose keys each slot's one-token row scores, the call's keys rolled
        return torch.arange(n_slots).roll(shift, 0).tolist()

    assert read(5) == [4, 0, 1, 2, 3]
    says(section, r"score its neighbour's keys \(slot s - (\d+)'s; the last slot's for slot (\d+)\)", shift, 0)
    # The one-token call's keys are (S, nh, L, hs), S the belt's slots: with one slot, a roll leaves them as they are.
    one_slot = []
    nanobatch.generate(gpt, rng_requests, n_slots=1, max_len=MAX_LEN, eos_id=None, on_step=one_slot.append)
    assert {report.packed.one_token_mask.size(0) for report in one_slot if report.packed} == {1}
    itself = [n_slots for n_slots in (1, 3, 16) if read(n_slots) == list(range(n_slots))]
    cases = run_cases(lab_selection(section), inert=lambda case: case.params.get("n_slots") in itself)
    check_pytest_lines(section, cases, block=1)
    sequential = of_test(cases, "test_generate_matches_sequential")
    failing = [case for case in sequential if not case.passed]
    says(section, r"(\d+) of the (\d+) fail, and the page's test passes", len(failing), len(sequential))
    assert all(case.passed for case in of_test(cases, "test_a_broken_mask_shows_in_the_page"))
    says(section, r"so every (\d+)-slot case passes \(the proof needs (\d+) and (\d+)\)", *itself,
         *sorted({case.params["n_slots"] for case in failing}))
    split = [case for case in sequential if case.passed and case.params["n_slots"] > 1]
    assert all(case.params["cut"] == "split" for case in split), [case.id for case in split]
    # static on the most slots: every call of rows together attends over one position (idle slots' padding rows, a
    # one-token prompt's), whose one key gets weight 1 whatever it scores: the values, which are not rolled, decide.
    most = max(slots for slots in itself + [case.params["n_slots"] for case in sequential])
    on_one_position = [case for case in split if (case.params["policy"], case.params["n_slots"]) == ("static", most)]
    for case in on_one_position:
        reports = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_py.CausalSelfAttention, "attend_packed", main_attend)
            proof.split_attention_everywhere(patch)
            requests, eos_id, _ = proof_workload(case.params["workload"])
            nanobatch.generate(gpt, requests, n_slots=most, max_len=MAX_LEN, eos_id=eos_id, policy="static",
                               prefill_chunk=case.params["prefill_chunk"], on_step=reports.append)
        assert {report.packed.one_token_mask.size(-1) for report in reports
                if report.packed is not None and report.packed.n_one_token} == {1}, case.id
    lucky = [case for case in split if case not in on_one_position]
    assert all(case.params["workload"] == "sampled" for case in lucky), [case.id for case in lucky]
    [lucky_slots] = {case.params["n_slots"] for case in lucky}
    moved = [logits_moved(case, main=(model_py.CausalSelfAttention, "attend_packed", main_attend)) for case in lucky]
    assert all(dlogit > 0 and same_tokens for dlogit, same_tokens in moved), moved
    says(section, r"So do (\d+) split cases: static's (\d+) on (\d+) slots, whose rows together attend over one "
         r"position only", len(split), len(on_one_position), most)
    says(section, r"and (\d+) sampled ones? on (\d+) slots, whose logits move \(by up to ([\d.]+)\)", len(lucky),
         lucky_slots, round(max(dlogit for dlogit, _ in moved), 2))
    assert not all(case.passed for case in of_test(cases, "test_a_broken_mask_is_caught"))
    assert recorded_masks(gpt, rng_requests, n_slots=3) == masks_before, "the masks changed"
    check_every_figure_pinned(section, r"positions 0\.\.L-1", r"k_cache\[slot:slot \+ 1, :, :L\]", r"weight 1,",
                              within=r"Change \(b\).*")


# ---------------------------------------------------------------------------------------------
# Lab 4: the dirty slot


def test_lab_4_the_dirty_slot(monkeypatch):
    """No wipe as a request leaves: of the two tests, the cleaned-slot one fails, its request 2 (a
    one-token prompt, after the poisoned request in slot 0, a long companion in slot 1) answering
    all 0s (argmax of NaN logits) where the reference answers 7, the poisoned token, then 0s; the
    reused-slot one passes, the mask giving finite keys weight 0."""
    section = lab(4)
    assert apply_lab(monkeypatch, section) == "vacate"
    served, generate = [], proof.generate

    def recording(model, requests, **options):  # the runs the tests make, to read their requests and answers
        served.append((model, requests, generate(model, requests, **options)))
        return served[-1][2]

    monkeypatch.setattr(proof, "generate", recording)
    cases = run_cases(lab_selection(section))
    check_pytest_lines(section, cases)
    says(section, r"Of these (\w+), one leaves finite keys in a slot, the other plants a NaN", len(cases))
    [(model, requests, got)] = [run for run in served if len(run[1]) == 5]  # the cleaned-slot test's: 3 after 2
    [poison] = model.lm_head.weight.isnan().any(dim=1).nonzero().flatten().tolist()
    [failure] = [case.message for case in cases if not case.passed]
    later = int(re.search(r"request (\d+) differs", failure)[1])
    says(section, r"a long companion in slot (\d+) keeps", got[1].slot)
    assert len(requests[2 + later].prompt) == 1, "request 2 is not a one-token prompt"
    says(section, r"Request (\d+), a one-token prompt", later)
    says(section, r"and argmax takes NaN as the largest: id (\d+)", *set(got[2 + later].tokens))
    reference = nanobatch.generate_sequential(model, requests[2:], max_len=MAX_LEN, eos_id=None)
    says(section, r"\(The (\d+) in want: token (\d+)'s logit is NaN too", reference[later].tokens[0], poison)
    says(section, r"\(token (\d+)'s is row (\d+) of its weight\)", poison, poison)  # the LM head's weight (V, C)
    says(section, r"each answer takes (\d+), then, all NaN, (\d+)s", *{c.tokens[0] for c in reference},
         *{token for c in reference for token in c.tokens[1:]})
    says(section, r"Skip the wipe that phase (\d+) of generate asks for", phase("Retire"))
    # The arithmetic of the mask, which the test's runs show: a hidden key's weight 0, 0 x NaN NaN.
    check_every_figure_pinned(section, r"weight 0\.", r"exactly 0, and 0 x finite is 0", r"But 0 x NaN")


# ---------------------------------------------------------------------------------------------
# Lab 5: stalls


def forward_seconds(model, steps, n_slots, max_len, enough, most_rounds=20):
    """Seconds for one forward of each PackedStep, in a cache of n_slots x max_len: the fastest of the
    rounds, each round running every step once (after one to warm up), until enough(the fastest so far)
    holds, or most_rounds. Round after round, a busy machine's drift falls on all the steps alike, and
    the fastest round is the step's own cost, what the machine's other work did not add: on an idle
    machine one round shows it, beside other work it may take several."""
    cache, seconds = model.new_cache(n_slots, max_len), [[] for _ in steps]
    with torch.no_grad():
        for n_rounds in range(1 + most_rounds):
            for packed, times in zip(steps, seconds):
                start = time.perf_counter()
                model.forward_packed(packed, cache)
                times.append(time.perf_counter() - start)
            fastest = [min(times[1:]) for times in seconds] if n_rounds else None
            if n_rounds and enough(fastest):
                break
    return fastest


def test_lab_5_stalls():
    """The bench's long-prompt runs on the quick model: 64 requests, four of them 600-token prompts.
    In steps, whole prompts feed 600 prompt tokens into one step, chunks of 64 spread each over 10
    steps, and the prefill worker's loop feeds none; chunks take the TTFT P50/P99 from 4/14 steps to
    9/26, and the long prompts' first tokens 9 to 15 steps later. In time, phase 4's forward of each
    step that takes a long prompt whole lasts longer than the median step's, by a quarter at least;
    the prose's milliseconds are the excerpt's.
    Those forwards are timed again here, round after round until it holds, up to 20 (forward_seconds).
    Read once, from the run's own StepReport.step_s, the four long steps against the median step failed "over twice" by
    chance: with a busy core beside it, 2.5-3.3x in 7 runs of 8, and in the eighth 1.63x (its long
    steps at 1.65x, 1.63x, 3.4x and 3.5x: one step's time, read once, is the machine's too). Timed
    again, fastest round kept, the fastest long step took at least 2.4x the median step in 40 runs
    beside a busy core, but 1.65x once with the machine's memory shared too: a step with no long prompt
    mostly reads the quick model's 13 MB LM head, and waits on memory, as Lab 7's one slot does, while
    a long prompt adds its rows' arithmetic. Longer by a quarter holds whatever the memory does."""
    section = lab(5)
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    args = argparse.Namespace(seed=0, slots=8, max_len=None, prefill_chunk=None, device=torch.device("cpu"),
                              kv_block_size=16)
    served, run_all = {}, bench.run_all

    def recording(model, requests, *arguments, **keywords):  # what long_prompts keeps to itself
        served["requests"], (summaries, completions, reports) = requests, run_all(model, requests, *arguments,
                                                                                  **keywords)
        served.update(completions=completions, reports=reports)
        return summaries, completions, reports

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setattr(bench, "run_all", recording)
        panels = bench.long_prompts(model, args)
    requests, completions, reports = served["requests"], served["completions"], served["reports"]
    summaries = {name: summary for name, _, _, summary, _ in panels}
    assert list(summaries) == ["whole prompts", "chunks of 64", "disaggregated"]
    check_excerpt(section, printed.getvalue(), width=24 + 2 * 18)  # the table's label, then whole prompts and chunks
    assert summaries["whole prompts"]["TTFT P50/P99 (steps)"] == (4, 14)
    assert summaries["chunks of 64"]["TTFT P50/P99 (steps)"] == (9, 26)
    longs = [i for i, request in enumerate(requests) if len(request.prompt) >= 100]
    long_len, chunk = len(requests[longs[0]].prompt), int(list(summaries)[1].split()[-1])
    says(section, r"how long a (\d+)-token prompt holds up", long_len)
    says(section, r"the bench serves (\d+) requests, (\w+) of them (\d+)-token prompts, whole, in chunks of (\d+)",
         len(requests), len(longs), long_len, chunk)
    most = {name: max(report.n_prompt_tokens for report in reports[name]) for name in summaries}
    assert most == {"whole prompts": 600, "chunks of 64": 64, "disaggregated": 0}
    says(section, r"puts a whole (\d+)-token prompt into one step \(phase (\d+)\), and phase (\d+)'s one forward",
         most["whole prompts"], phase("Choose"), phase("One forward"))

    def prompt_steps(name, i):  # the steps that fed request i's prompt tokens
        return [report.step for report in reports[name] if report.packed is not None and any(
            report.occupants[slot] == i and report.packed.positions[rows.start] < len(requests[i].prompt)
            for rows, slot, _ in report.packed.chunks)]

    [n_chunk_steps] = {len(prompt_steps("chunks of 64", i)) for i in longs}
    assert {len(prompt_steps("whole prompts", i)) for i in longs} == {1}
    says(section, r"A budget of (\d+) spreads it over (\d+) steps beside decoding", chunk, n_chunk_steps)
    later = [completions["chunks of 64"][i].first_token_step - completions["whole prompts"][i].first_token_step
             for i in longs]
    says(section, r"the long prompts' first tokens come (\d+) to (\d+) steps later \(TTFT (\d+) / (\d+) steps "
         r"becomes (\d+) / (\d+)\)", min(later), max(later), *summaries["whole prompts"]["TTFT P50/P99 (steps)"],
         *summaries["chunks of 64"]["TTFT P50/P99 (steps)"])
    says(section, r"--requests (\d+) cuts the main workload", *[int(argv[argv.index("--requests") + 1])
                                                                 for argv in commands(section) if "--requests" in argv])
    assert "on half the CPU's threads" in prose(section) and nanobatch.split_threads(16) == (8, 8)
    # Milliseconds are noise on a busy machine, as the lab says: the prose's are its excerpt's, no more.
    excerpt = re.search(r"TBT P50/P99 \(ms\) +\S+ / (\S+) +\S+ / (\S+) +\S+ / (\S+)", section).groups()
    says(section, r"a TBT P99 of ([\d.]+) ms", float(excerpt[0]))
    says(section, r"beside decoding, which is fed first: ([\d.]+) ms", float(excerpt[1]))
    says(section, r"\(plan_step\(belt, 0\)\): ([\d.]+) ms", float(excerpt[2]))
    whole = reports["whole prompts"]
    long_steps = [report.packed for report in whole if report.n_prompt_tokens >= 600]
    others = [report.packed for report in whole if report.packed is not None and report.n_prompt_tokens < 600]
    assert len(long_steps) == 4
    def longer(seconds):  # the fastest long step, longer than the median other step by a quarter
        return min(seconds[:4]) > 1.25 * statistics.median(seconds[4:])

    seconds = forward_seconds(model, long_steps + others[::len(others) // 8][:8], args.slots, model.config.block_size,
                              enough=longer)
    assert longer(seconds), \
        f"the long steps' forwards {seconds[:4]}, the others' {seconds[4:]}"
    check_every_figure_pinned(section, r"7 s on an idle machine", r"plan_step\(belt, 0\)")  # a time, the code


# ---------------------------------------------------------------------------------------------
# Lab 6: fairness


def test_lab_6_fairness(monkeypatch, main_demo):
    """Shortest job first on the demo: step 0 admits the 8 shortest of the 12 waiting; the median
    TTFT falls from 10 steps to 4, its P99 rises from 16 to 36, and C (41 tokens, third in line at
    step 0) waits 36 steps for its first token instead of 2. Every answer is main's token for token:
    only the clock's first come, first served fails, in all 12 cases of test_clock and in
    test_generate_matches_sequential."""
    section = lab(6)
    before, _ = main_demo
    C = ord("C") - ord("A")
    says(section, r"The median TTFT \((\d+) steps on main\)", before.summaries["continuous"]["TTFT P50/P99 (steps)"][0])
    in_line = [i for i, request in enumerate(before.requests) if request.arrival == 0]  # the queue at step 0
    says(section, r"C wants (\d+) tokens and is (\w+) in line at step (\d+) \(its TTFT on main: (\d+) steps\)",
         before.requests[C].max_new_tokens, ["first", "second", "third", "fourth"][in_line.index(C)],
         before.requests[C].arrival, ttft_steps(before, "continuous", C))
    assert apply_lab(monkeypatch, section) == "generate"
    says(section, r"In phase (\d+) of generate, order the queue", phase("Admit"))
    after, printed = demo()
    check_excerpt(section, printed)
    step_0 = after.reports["continuous"][0]
    shortest = sorted(in_line, key=lambda i: after.requests[i].max_new_tokens)[:len(step_0.admitted)]
    assert sorted(step_0.admitted) == sorted(shortest), "step 0 did not admit the shortest jobs"
    says(section, r"Step (\d+) admits the (\d+) shortest of the (\d+) waiting", step_0.step, len(step_0.admitted),
         len(in_line))
    ttft_main, ttft_first = (shown.summaries["continuous"]["TTFT P50/P99 (steps)"] for shown in (before, after))
    says(section, r"the median TTFT drops from (\d+) steps to (\d+)", ttft_main[0], ttft_first[0])
    says(section, r"which waits (\d+) steps \(the P99: (\d+) to (\d+)\)", ttft_steps(after, "continuous", C),
         ttft_main[1], ttft_first[1])
    for name in ("continuous", "static"):
        assert first_difference(after.completions[name], before.completions[name]) == ""
    with pytest.raises(AssertionError, match="admit_step out of arrival order"):
        check_clock(after.requests, after.completions["continuous"], 8, "continuous", nanobatch.DEMO_PREFILL_CHUNK)

    def out_of_arrival_order(requests):  # a stop: an admission that check_clock's first come, first served fails
        def check(report):
            for j in report.admitted:
                earlier = [i for i in report.waiting if (requests[i].arrival, i) < (requests[j].arrival, j)]
                assert not earlier, f"request {j} admitted while {earlier}, come before it, wait"
        return check

    first = cases_of(proof, "test_clock")[0]  # run whole: its message is the excerpt's E line
    check_pytest_lines(section, run_cases(lab_selection(section), stop=lambda case: None if case.id == first.id
                                          else out_of_arrival_order))
    assert "in test_clock and test_generate_matches_sequential" in prose(section)
    assert "admit_step out of arrival order" in matches_sequential(n_slots=3).message
    check_every_figure_pinned(section)


# ---------------------------------------------------------------------------------------------
# Lab 7: batch size


def test_lab_7_batch_size():
    """On a CPU a decode step's cost grows with its rows: 64 slots take longer than one per step
    (over 1.25x), yet make over twice its tokens a second. The lab's own command runs, here on the
    quick model instead of GPT-2 124M, at 1 to 64 slots. The prose's ratios are its excerpt's;
    GPT-2 124M in bfloat16 is 250 MB, 75 us at 3.35 TB/s.
    Why so loose: the ratio is the machine's as much as the model's. One slot's step reads the quick
    model's 13 MB LM head for one row, and waits on memory; 64 slots' step multiplies. Timed once
    each, here, beside other work, 64 slots took 1.7x to 24x one slot's step: one slot's took 1.3 ms,
    or 6-10 ms while other work shared the memory, and either timing could meet a burst of other
    work that the other missed. "Over twice" and "over 4x the tokens a second", so timed, failed in
    two full runs of the suite out of three with a busy core beside it. So the two are timed in
    turn, each one's fastest kept (five rounds: 3.1x to 13x in 40 runs beside a busy core), and only
    what holds whatever the memory does is asserted: more time a step, more tokens a second. Five
    rounds still failed once, on two cores shared with seven busy processes (64 slots' fastest step
    40x one slot's): the rounds go on until both hold of the fastest, up to 20; one if the machine is
    idle."""
    section = lab(7)
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    rounds = []
    while len(rounds) < 20:  # in turn, until both hold of the fastest of each, or 20 rounds: one if the machine is idle
        rounds.append([bench.time_decode_steps(model, [[47] * n_slots], max_len=64)[0] for n_slots in (1, 64)])
        one, sixty_four = (min(seconds) for seconds in zip(*rounds))
        if sixty_four > 1.25 * one and 64 / sixty_four > 2 * (1 / one):
            break
    assert sixty_four > 1.25 * one, f"a step of 64 slots {sixty_four:.4f} s, of one {one:.4f} s"
    assert 64 / sixty_four > 2 * (1 / one), f"tokens/s: 64 slots {64 / sixty_four:.0f}, one {1 / one:.0f}"
    [snippet] = [argv[2] for argv in commands(section) if argv[:2] == ["python", "-c"]]
    assert snippet.count("GPTConfig()") == 1
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet.replace("GPTConfig()", "GPTConfig(n_layer=1, n_head=1, n_embd=8)"), {})
    slots = [int(line.split()[0]) for line in printed.getvalue().splitlines()]
    assert slots == [1, 2, 4, 8, 16, 32, 64]
    says(section, r"and the tokens a second at (\d+) to (\d+) slots", slots[0], slots[-1])
    says(section, r"From (\d+) slot to (\d+), how much longer", slots[0], slots[-1])
    says(section, r"and (\d+) rows add little compute: a step costs about the same at (\d+) or (\d+) slots",
         slots[-1], slots[0], slots[-1])
    # Times vary, as the lab says (run it twice): its ratios are its excerpt's, no more.
    excerpt = {int(n): (float(ms), int(tokens_s)) for n, ms, tokens_s in
               re.findall(r"^(\d+) slots: a step takes ([\d.]+) ms .*?, (\d+) tokens/s$", section, re.M)}
    says(section, r"(\d+) slots make (\d+)x the tokens/s of one, not (\d+)x, and each request waits ([\d.]+)x as long",
         slots[-1], round(excerpt[64][1] / excerpt[1][1]), slots[-1], round(excerpt[64][0] / excerpt[1][0], 1))
    # 124M parameters of 2 bytes, read at 3.35 TB/s (the arithmetic only: a GPU is not measured here)
    millions, megabytes, microseconds, terabytes_s = stated(section, r"GPT-2 (\d+)M in bfloat16, (\d+) MB: about "
                                                                     r"(\d+) us at an H100's ([\d.]+) TB/s")[1]
    assert (round(2 * millions, -1), round(megabytes / terabytes_s)) == (megabytes, microseconds), \
        f"Lab 7: {millions}M parameters of 2 bytes at {terabytes_s} TB/s are not {megabytes} MB, {microseconds} us"
    check_every_figure_pinned(section)


# ---------------------------------------------------------------------------------------------
# Lab 8: sampling


def test_lab_8_sampling(monkeypatch):
    """Per-request generators: seeded, batched equals sequential; seed=None, two runs of the same
    request differ, so nothing can equal them. The lab's snippet prints what its excerpt shows for
    a seed. One generator shared by every request: every sampled case fails (27, one slot
    included), the needle too, and every greedy case passes (greedy never draws: those runs are
    main's): 34 failed, 33 passed."""
    section = lab(8)
    gpt = tiny_gpt()
    assert matches_sequential(n_slots=3, sampled=True).passed
    unseeded = nanobatch.Request([1, 2, 3], 16, temperature=1.0, seed=None)
    first, second = (nanobatch.generate(gpt, [unseeded], max_len=MAX_LEN, eos_id=None)[0].tokens for _ in range(2))
    assert first != second, "two unseeded runs drew the same 16 tokens"
    [snippet] = [argv[2] for argv in commands(section) if argv[:2] == ["python", "-c"]]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, {})
    seeded_line = printed.getvalue().splitlines()[0]
    assert seeded_line in re.findall(r"```text\n(.*?)```", section, re.S)[-1].splitlines()
    assert apply_lab(monkeypatch, section) == "new_sampler"
    # Greedy never draws: sample takes the argmax, its generator untouched, so the greedy cases run as on main.
    assert all(request.temperature == 0 for request in random_workload(seed=9, sampled=False))
    generator, logits = torch.Generator().manual_seed(0), torch.randn(8, dtype=torch.float64)
    state = generator.get_state()
    assert nanobatch.sample(logits, nanobatch.Request([1], 1, temperature=0.0), generator) == logits.argmax()
    assert torch.equal(generator.get_state(), state), "a greedy token drew from its generator"
    cases = run_cases(lab_selection(section), inert=lambda case: case.params.get("workload") == "greedy")
    check_pytest_lines(section, cases)
    sequential = of_test(cases, "test_generate_matches_sequential")
    sampled = [case for case in sequential if case.params["workload"] == "sampled"]
    assert not any(case.passed for case in sampled) and any(case.params["n_slots"] == 1 for case in sampled)
    assert all(case.passed for case in sequential if case.params["workload"] == "greedy")
    assert not any(case.passed for case in of_test(cases, "test_needle_among_fillers"))
    says(section, r"Every sampled case fails \((\d+), (\w+) slot included; the needle too\), every greedy one passes",
         len(sampled), min(case.params["n_slots"] for case in sampled))
    check_every_figure_pinned(section)


# ---------------------------------------------------------------------------------------------
# Lab 9: what the reservation wastes


def test_lab_9_what_the_reservation_wastes(main_demo):
    """Per slot, the demo's cache (8 slots of 1,024 positions, prompts of 5-39 tokens, answers of at
    most 64) holds a token in 2% of its positions, 4% at the peak; with max_len 128 in 19% and 35%,
    the same 111 steps. Paged, the same 8,192 positions as 512 blocks of 16 with 32 slots: up to 18
    requests make a token in one step (per slot 8), 86 steps (111), median TTFT 12 steps (21), none
    preempted. In 16 blocks, 256 positions: 2 preemptions, 134 steps, median TTFT 25, and 80 prompt tokens
    fed again (845 computed, the prompts holding 765)."""
    section = lab(9)
    shown, printed = main_demo
    runs = {options: demo("--quiet", *options) for options in
            [("--max-len", "128"), ("--kv-blocks", "512", "--slots", "32"), ("--kv-blocks", "16", "--slots", "32")]}
    check_excerpt(section, "\n".join([printed] + [output for _, output in runs.values()]))

    def figures(shown, name):
        summary = shown.summaries[name]
        kv_mean, kv_peak = summary["KV cache in use"]
        return (round(100 * kv_mean), round(100 * kv_peak), summary["steps"], summary["TTFT P50/P99 (steps)"][0],
                summary["preemptions"], max(report.n_running for report in shown.reports[name]))

    main, short = figures(shown, "continuous"), figures(runs["--max-len", "128"][0], "continuous")
    paged_run, tight_run = runs["--kv-blocks", "512", "--slots", "32"][0], runs["--kv-blocks", "16", "--slots", "32"][0]
    paged, per_slot, tight = figures(paged_run, "paged"), figures(paged_run, "per slot"), figures(tight_run, "paged")
    n_slots, max_len = shown.runs[0][1], shown.reports["continuous"][0].kv_total // shown.runs[0][1]
    requests = shown.requests
    says(section, r"The demo's (\d+) slots reserve ([\d,]+) positions each;", n_slots, max_len)
    lengths = sorted(len(request.prompt) for request in requests)
    says(section, r"its prompts are (\d+)-(\d+) tokens, its answers at most", lengths[0], lengths[-1])  # both ends
    says(section, r"its answers at most (\d+)\.", max(request.max_new_tokens for request in requests))
    says(section, r"With --max-len (\d+)\? Do the steps change", *[int(argv[argv.index("--max-len") + 1])
                                                                  for argv in commands(section) if "--max-len" in argv])
    says(section, r"these hold a few dozen tokens: (\d+)% of the cache holds one, (\d+)% at the peak", *main[:2])
    short_len = runs["--max-len", "128"][0].reports["continuous"][0].kv_total // n_slots
    says(section, r"--max-len (\d+) keeps the same (\d+) steps \(none needs more\) in an eighth of the memory",
         short_len, main[2])
    assert short[2] == main[2] and max(len(r.prompt) + r.max_new_tokens for r in requests) <= short_len
    assert max_len == 8 * short_len and short[:2] == (19, 35)
    pool, kv_blocks = paged_run.reports["paged"][0].kv_total, paged_run.runs[0][5]  # positions, blocks
    block_size = pool // kv_blocks
    says(section, r"Paged, the same ([\d,]+) positions as (\d+) blocks of (\d+), shared by (\d+) slots", pool,
         kv_blocks, block_size, paged_run.runs[0][1])
    assert pool == n_slots * max_len
    says(section, r"over the (\d+) slots that memory makes per slot\?", paged_run.runs[1][1])
    assert paged_run.runs[1][1] == pool // max_len, "per slot, the same memory is not 8 slots"
    says(section, r"In (\d+) blocks \(([\d,]+) positions\), how often is a request preempted", tight_run.runs[0][5],
         tight_run.reports["paged"][0].kv_total)
    says(section, r"a request takes a block of (\d+) positions when its tokens reach one", block_size)
    says(section, r"with --slots (\d+), queues all (\d+) requests at step (\d+)", paged_run.runs[0][1],
         sum(request.arrival == 0 for request in paged_run.requests), 0)
    assert len(paged_run.requests) == 32
    says(section, r"(\d+) slots run (\d+) requests at once, not (\d+): (\d+) steps, not (\d+), and the median request "
         r"waits (\d+) steps, not (\d+)\.", paged_run.runs[0][1], paged[5], per_slot[5], paged[2], per_slot[2],
         paged[3], per_slot[3])
    assert paged[4] == per_slot[4] == 0, "the ample pool preempted"
    says(section, r"In (\d+) blocks the pool runs short: .*?: (\d+) times, (\d+) steps, median TTFT (\d+)\.",
         tight_run.runs[0][5], tight[4], tight[2], tight[3])
    assert [name for name, *_ in tight_run.runs] == ["paged"]
    fed = sum(report.n_prompt_tokens for report in tight_run.reports["paged"])
    says(section, r"The prompts hold (\d+) tokens; (\d+) were computed\.", sum(len(r.prompt) for r in requests), fed)
    says(section, r"whole sequence and (\d+) tokens more", nanobatch.ROOM_TO_GROW)
    check_every_figure_pinned(section, r"vLLM's paper measured 20-38%")  # a paper's figure, not a run's


# ---------------------------------------------------------------------------------------------
# Lab 11: the system prompt


def lab_11_run(monkeypatch):
    """Lab 11's command, in this process -> (what it printed, {(when, run name): (requests, reports)})."""
    served, run_all = {}, bench.run_all

    def recording(model, requests, runs, *arguments, **keywords):
        summaries, completions, reports = run_all(model, requests, runs, *arguments, **keywords)
        when = "at once" if all(r.arrival == 0 for r in requests) else "arriving"
        served.update({(when, name): (requests, reports[name]) for name in reports})
        return summaries, completions, reports

    [argv] = [argv for argv in commands(lab(11)) if argv[:2] == ["python", "tools/bench.py"]]
    monkeypatch.setattr(bench, "run_all", recording)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        bench.main(argv[2:])
    return printed.getvalue(), served


def test_lab_11_the_system_prompt(monkeypatch):
    """32 requests that share a 96-token system prompt (6 blocks of 16), 3,384 prompt tokens: arriving
    one a step, the cache computes 408 (all but the first find the 6 blocks); all at step 0, 1,848
    (the first wave of 16 rows finds nothing cached before its forward). With the odd requests' first
    token changed, two prompts that share no block: 504 arriving, 1,848 at once. Each figure of the
    prose is worked out from the runs' own requests and reports."""
    section = lab(11)
    printed, served = lab_11_run(monkeypatch)
    check_excerpt(section, printed)
    requests, _ = served["arriving", "cache"]
    n_system, total = bench.SYSTEM_PROMPT, sum(len(r.prompt) for r in requests)
    assert all(r.prompt[:n_system] == requests[0].prompt[:n_system] for r in requests), "no shared system prompt"
    fed = {key: sum(report.n_prompt_tokens for report in reports) for key, (_, reports) in served.items()}
    n_rows = max(report.n_running for report in served["at once", "cache"][1])
    assert fed["arriving", "no cache"] == fed["at once", "no cache"] == total
    assert fed["arriving", "cache"] == total - (len(requests) - 1) * n_system
    assert fed["at once", "cache"] == total - (len(requests) - n_rows) * n_system
    says(section, r"serves (\d+) requests here, each a system prompt of (\d+) tokens \((\d+) blocks of (\d+)\)",
         len(requests), n_system, n_system // 16, 16)
    says(section, r"([\d,]+) prompt tokens in all, on (\d+) rows", total, n_rows)
    says(section, r"- (\d+) x (\d+) = (\d+)\. \(2\)", len(requests) - 1, n_system, fed["arriving", "cache"])
    says(section, r"all (\d+) compute the system prompt, the other (\d+) find it: [\d,]+ - (\d+) x (\d+) = ([\d,]+),",
         n_rows, len(requests) - n_rows, n_rows, n_system, fed["at once", "cache"])
    says(section, r"finds the (\d+)\s+blocks", n_system // 16)
    apply_lab(monkeypatch, section)
    printed, served = lab_11_run(monkeypatch)
    check_excerpt(section, printed)
    fed = {key: sum(report.n_prompt_tokens for report in reports) for key, (_, reports) in served.items()}
    requests, _ = served["arriving", "cache"]
    assert len({tuple(r.prompt[:n_system]) for r in requests}) == 2, "not two system prompts"
    says(section, r"each is computed once: [\d,]+ - (\d+) x (\d+) = (\d+); at once, still ([\d,]+)\.",
         len(requests) - 2, n_system, fed["arriving", "cache"], fed["at once", "cache"])


# ---------------------------------------------------------------------------------------------
# Lab 12: serving live


def test_lab_12_serving_live(at_8, knee):
    """(1) The lab's snippet, run here: A, cancelled from on_step at the end of step 3 (its 4th token),
    leaves at step 4, told abort with its 4 tokens, and D, first in line, takes its slot 0 in that very
    step (2 steps sooner than uncancelled), E B's at step 6 (3 sooner); every answer is the list form's,
    A's cut. (2) tools/load.py --quick's saturation table and its static runs at 0.4 and 0.8 a step:
    static completes 0.229 requests a step, and its median TTFT past it is what (λ/μ - 1) x t predicts
    for the median arrival (t = 100 / λ), within 5%: 187 and 312 steps, 185 and 323 measured. (3) The
    HTTP run's figures are seconds, this machine's on one run: not measured here (no server is started).
    Its commands are the tools' (static, --quick, load_http at the server's default address, the rates
    of the excerpt's rows, its header the tool's); the prose's seconds are the excerpt's, and its
    arithmetic holds on them."""
    section = lab(12)
    excerpts = re.findall(r"```text\n(.*?)```", section, re.S)

    def printed_all(block, printed):  # every line of the block-th excerpt but '...' is a line printed
        missing = [line for line in excerpts[block].splitlines() if line != "..." and line not in printed.splitlines()]
        assert not missing, "lines of Lab 12's excerpt that its command did not print:\n" + "\n".join(missing)

    # (1) A cancel is a retirement: the snippet, run in this process (held to TIMEOUT_S: a hang fails here).
    [snippet] = [argv[2] for argv in commands(section) if argv[:2] == ["python", "-c"]]
    ran = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # print_step prints from the engine's thread too
        ends_within(TIMEOUT_S, exec, snippet, ran)
    printed_all(0, printed.getvalue())
    requests, streams, full = ran["requests"], ran["streams"], ran["full"]
    done = [stream.completion for stream in streams]
    A, B, C, D, E = range(5)
    [n_slots] = {int(n) for n in re.findall(r"n_slots=(\d+)", snippet)}
    [cancelled_at] = [int(n) for n in re.findall(r"report\.step == (\d+): streams\[0\]\.cancel\(\)", snippet)]
    says(section, r"Requests A to E want (\d+), (\d+), (\d+), (\d+) and (\d+) tokens; all arrive at step (\d+) on "
         r"(\d+) slots", *[request.max_new_tokens for request in requests], 0, n_slots)
    assert re.search(r"^step    0 \|ABC\|  3/3 waiting   2  \+A \+B \+C$", printed.getvalue(), re.M)  # all at 0
    assert (done[A].finish_reason, done[A].finish_step) == ("abort", cancelled_at + 1)
    says(section, r"A is cancelled from on_step at the end of step (\d+), its (\d+)th token's", cancelled_at,
         len(done[A].tokens))
    assert all(c.finish_reason == "length" for c in full) and full[A].finish_step > cancelled_at + 1
    assert (full[D].admit_step, full[E].admit_step) == (full[B].finish_step + 1, full[C].finish_step + 1)
    says(section, r"Uncancelled, D would start at step (\d+) \(as B leaves\) and E at step (\d+)\.",
         full[D].admit_step, full[E].admit_step)
    says(section, r"Phase (\d+) of step (\d+) asks the callers who has gone", phase("Arrivals"), done[A].finish_step)
    says(section, r"with its (\d+) tokens, and leaves its slot as phase (\d+) retires", len(done[A].tokens),
         phase("Retire"))
    assert done[D].slot == done[A].slot and done[D].admit_step == done[D].first_token_step == done[A].finish_step
    says(section, r"phase (\d+) of the same step gives slot (\d+) to D, first in line", phase("Admit"), done[D].slot)
    says(section, r"So step (\d+)'s line shows \+D -A\(abort,(\d+)\)", done[A].finish_step, len(done[A].tokens))
    assert done[E].slot == done[B].slot and done[E].admit_step == done[B].finish_step + 1
    says(section, r"D starts (\d+) steps sooner, E (\d+) \(at step (\d+), in B's slot\)",
         full[D].admit_step - done[D].admit_step, full[E].admit_step - done[E].admit_step, done[E].admit_step)
    assert done[A].tokens == full[A].tokens[:len(done[A].tokens)]
    assert [c.tokens for c in done[B:]] == [c.tokens for c in full[B:]], "a cancel changed another's answer"
    assert "hearing the client gone (uvicorn's `http.disconnect`)" in " ".join(section.split())

    # (2) Static past its saturation, in steps: the tool's saturation table, and its static runs at the excerpt's rates.
    # load.py --quick's runs (seed 0), made once for the session (tests/common.py): the rates the excerpt shows.
    rates = [float(rate) for rate in re.findall(r"^static +(\d\.\d\d) ", excerpts[1], re.M)]
    (_, measured, printed_table), (curves, printed_sweep) = at_8, knee
    assert rates == [rate for rate, _ in curves["static"]], "the session's sweep has not the excerpt's rates"
    printed_all(1, printed_table + printed_sweep)
    mu, static = round(measured["static"], 3), dict(curves["static"])
    half = load.N_REQUESTS // 2
    says(section, r"Static completes μ = ([\d.]+) requests a step", mu)
    says(section, r"The median request, the (\d+)th of (\d+), arrives near step (\d+) / λ: its TTFT at ([\d.]+) a "
         r"step\? At ([\d.]+)\?", half, load.N_REQUESTS, half, *rates)
    assert mu < min(rates), "a rate below static's saturation"
    predicted = {rate: round((rate / mu - 1) * half / rate) for rate in rates}
    assert all(abs(predicted[rate] / static[rate]["TTFT"][0] - 1) < 0.05 for rate in rates), (predicted, static)
    low, high = rates
    says(section, rf"\(({low}) / ({mu}) - 1\) x (\d+) = (\d+) steps predicted, (\d+) measured; at ({high}), "
         rf"\(({high}) / ({mu}) - 1\) x (\d+) = (\d+) and (\d+)\.", low, mu, round(half / low), predicted[low],
         static[low]["TTFT"][0], high, high, mu, round(half / high), predicted[high], static[high]["TTFT"][0])
    [per_step] = {round(static[rate]["tokens/step"], 2) for rate in rates}
    says(section, r"static makes ([\d.]+) tokens a step at both rates", per_step)
    says(section, r"\((\d+) waiting at most, then (\d+)\)", *[static[rate]["queue"] for rate in rates])

    # (3) In seconds, over HTTP: the commands, and the prose's seconds against the excerpt's (not measured here).
    [server_argv] = [argv[argv.index("python") + 2:] for argv in commands(section) if "tools/serve.py" in argv]
    [client_argv] = [argv[2:] for argv in commands(section) if argv[:2] == ["python", "tools/load_http.py"]]
    server = serve.parse(server_argv)
    assert (server.quick, server.policy, server.slots) == (True, "static", 8), "not load.py's static on 8 slots"
    assert client_argv[:2] == ["--url", f"http://127.0.0.1:{server.port}/"] and client_argv[2] == "--rate"
    with contextlib.redirect_stdout(io.StringIO()) as header:
        load_http.print_table([])
    [head, *lines] = excerpts[2].splitlines()
    assert head == header.getvalue().rstrip("\n"), "the excerpt's header is not load_http's"
    rows = {float(cells[0]): cells for cells in (line.split() for line in lines)}
    assert list(rows) == [float(rate) for rate in client_argv[3:]] and all(
        int(cells[1]) == int(cells[2]) == load.N_REQUESTS for cells in rows.values()), rows
    ttft, itl, per_s = ({rate: float(cells[k]) for rate, cells in rows.items()} for k in (6, 11, 4))
    slow, fast = rows
    says(section, r"Is (\d+) a second past it, or (\d+)\? Predict the TTFT P50 at (\d+)", slow, fast, fast)
    says(section, r"a step took ([\d.]+) ms at (\d+) a second: static saturates near ([\d.]+) / ([\d.]+) = (\d+) a "
         r"second", itl[slow], slow, mu, round(itl[slow] / 1e3, 6), round(mu / (itl[slow] / 1e3)))
    says(section, r"and at (\d+) a request waits a few steps \(TTFT P50 ([\d.]+) s\)", slow, ttft[slow])
    capacity = round(mu / (itl[fast] / 1e3))
    says(section, r"At (\d+) a step took ([\d.]+) ms: ([\d.]+) / ([\d.]+) = (\d+) a second, the req/s column's "
         r"([\d.]+)", fast, itl[fast], mu, round(itl[fast] / 1e3, 6), capacity, per_s[fast])
    says(section, r"\((\d+) / (\d+) - 1\) x ([\d.]+) = ([\d.]+) s predicted, ([\d.]+) measured", fast, capacity,
         round(half / fast, 2), round((fast / capacity - 1) * round(half / fast, 2), 2), ttft[fast])
    # Holding no run's figure: a lab's name, the formula's 1, the machine, a setting, and other runs' seconds.
    check_every_figure_pinned(section, r"Lab 10\b", r"- 1\) x", r"a 2-core AMD EPYC VM with AVX-512",
                              r"OMP_NUM_THREADS=1", r"at 8 a second, ITL P50 of 3\.49, 11\.9 and 99\.9 ms in three "
                              r"runs, TTFT P50 of 0\.02, 3\.07 and 27\.2 s")



# ---------------------------------------------------------------------------------------------
# Lab 13: why temperature 0 is not deterministic under load
#
# The lab's commands run with one thread (OMP_NUM_THREADS=1), as this process does (tests/common.py); here they
# run in this process, tools/verify.py's through their pipes, and the snippet. Two of verify's costs are left
# aside, each for a reason. --ops's table is measured on verify --quick's model with the engine tests' vocabulary,
# not GPT-2's 50,257 (its LM head over 17 calls of up to 100 rows took most of a run), its LM head's line given
# the vocabulary back: MKL switches kernels at the same rows at both widths. And a run of answers skips the ops'
# check that --batch-invariant prints first, which the lab's excerpts (| tail -2) do not show.
# The bits are this machine's MKL's (a 2-core AMD EPYC with AVX-512). Where --ops measures what the excerpt's
# table says, every line the runs print must be the excerpt's, and where each changed row first differs is
# measured; on another machine the prose is read against its excerpts, and what holds there too is checked:
# at MIN_ROWS_INVARIANT = 2 the linear layers vary where the default path's do and attention does not, no answer
# changes, the excerpt names every row (no step samples as many rows as its table's general kernel takes), and
# the snippet's rows first differ in layer 0 or in the LM head.


def verify_run(*argv):
    """tools/verify.py, in this process -> (its exit status, its lines, their times left out)."""
    C, V = nanobatch.TINY.n_embd, nanobatch.TINY.vocab_size
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        if "--ops" in argv:  # on the tests' vocabulary (above)
            patch.setattr(nanobatch, "TINY", dataclasses.replace(nanobatch.TINY, vocab_size=tests.common.V))
        else:  # the ops' check, not shown (above)
            patch.setattr(verify, "varying_ops", lambda model: {})
        with pytest.raises(SystemExit) as exited:
            verify.main(list(argv))
    text = printed.getvalue().replace(f"{f'LM head {C} -> {tests.common.V}':24}", f"{f'LM head {C} -> {V}':24}")
    return exited.value.code, [without_times(line) for line in text.splitlines()]


def without_times(line):
    """A line of verify's without its seconds: '12 answers: ... 0 BUG (generate_sequential 0.4 s, ...)'."""
    return re.sub(r" \(generate_sequential [\d.]+ s, generate [\d.]+ s\)$", "", line)


def lab_13_printed(section, block):
    """What the lab's block-th ```bash block prints, in this process: each tools/verify.py command through its
    pipe (| tail -N, | grep -E "RE"), then the snippet -> (its lines, verify's exit statuses)."""
    text = re.findall(r"```bash\n(.*?)```", section, re.S)[block]
    lines, statuses = [], []
    for line in (line for line in text.splitlines() if "tools/verify.py" in line):
        argv, _, pipe = line.partition("#")[0].partition("|")
        argv = shlex.split(argv)
        status, printed = verify_run(*argv[argv.index("tools/verify.py") + 1:])
        statuses.append(status)
        if re.fullmatch(r"tail -\d+", pipe.strip()):
            printed = printed[-int(pipe.split("-")[1]):]
        elif pipe.strip():
            [pattern] = shlex.split(pipe)[2:]  # grep -E "RE"
            printed = [shown for shown in printed if re.search(pattern, shown)]
        lines += printed
    for snippet in (argv[argv.index("-c") + 1] for argv in commands(f"```bash\n{text}```") if "-c" in argv):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(snippet, {})
        lines += printed.getvalue().splitlines()
    return lines, statuses


def ops_columns(lines):
    """--ops's table -> {op: (where the default path varies, where the batch-invariant one does)}."""
    return {line[:24].strip(): (line[24:86].strip(), line[86:].strip()) for line in lines
            if re.match(r"(embeddings|layer norm|linear|GELU|LM head|softmax|attention) ", line)}


def bits_line(lines):
    """verify's 'bit for bit (...): N of M logits rows ...' -> (N, M, the rows it names: {(letter, token)})."""
    [line] = [line for line in lines if line.startswith("bit for bit")]
    equal, compared = map(int, re.search(r": (\d+) of (\d+) logits rows", line).groups())
    return equal, compared, {(name, int(k)) for name, k in re.findall(r"(\w) token (\d+)", line)}


def test_lab_13_why_temperature_0_is_not_deterministic_under_load(monkeypatch):
    """verify --quick with one thread: 12 answers identical on both paths, 0 of the 36 logits rows bit for bit on the
    default path, 36 of 36 batch-invariant; --ops: the default path's linear layers and LM head vary in calls of
    1-8 rows, its attention over more keys and as a prompt's row, the batch-invariant path nowhere. At
    MIN_ROWS_INVARIANT = 2 the linear layers and the LM head vary as the default path's, attention not; the answers
    stay, all 36 rows change (a step samples 8 rows at most). Measured in layer 0's c_attn: 29 rows first differ
    there, where a row of their prefix went through calls of other sizes on the two sides, one under 9 rows; 7 in
    the LM head alone, the first tokens of A, B, C, E, F, G and J, prompts of 10-16 tokens fed in steps of 9 rows or
    more. The snippet: a prompt of 16 alone on a slot, token 0 differs in the LM head only, tokens 1-3 from layer
    0's c_attn on; on main, nowhere. With 2 threads the linear layers switch kernels at the same 9 rows, and the
    default path's attention varies in a batch too."""
    section = lab(13)
    excerpts = [[without_times(line) for line in block.splitlines()] for block in re.findall(r"```text\n(.*?)```",
                                                                                             section, re.S)]
    assert torch.get_num_threads() == 1 and all(argv[0] == "OMP_NUM_THREADS=1" for argv in commands(section)
                                                if argv[0] != "git"), "the lab's runs are not one thread's"
    steps = []  # verify's last generate call's steps: (rows, rows sampled, the requests fed, those sampled)
    generate, served = verify.generate, {}

    def recording(model, requests, *args, on_step, **kwargs):
        served.update(model=model, requests=requests, n_slots=kwargs["n_slots"], c_attn={})
        steps.clear()
        newest = []  # layer 0's c_attn out in the step running now: (M, 3C), row m the packed step's row m
        hook = model.transformer.h[0].attn.c_attn.register_forward_hook(
            lambda layer, inputs, out: newest.append(out.reshape(-1, out.size(-1))))

        def record(report):
            packed = report.packed
            if packed is not None:  # (request, position) -> its row out of layer 0's c_attn
                for m, (slot, position) in enumerate(zip(packed.slots.tolist(), packed.positions.tolist())):
                    served["c_attn"][report.occupants[slot], position] = newest[-1][m]
            newest.clear()
            steps.append((0 if packed is None else packed.tokens.numel(), len(report.sampled), set() if packed is None
                          else {report.occupants[slot] for slot in packed.slots.tolist()}, list(report.sampled)))
            on_step(report)
        try:
            served["got"] = generate(model, requests, *args, on_step=record, **kwargs)
        finally:
            hook.remove()
        return served["got"]

    monkeypatch.setattr(verify, "generate", recording)
    main, main_statuses = lab_13_printed(section, 0)
    assert main_statuses == [0, 0, 0]
    [snippet] = [argv[argv.index("-c") + 1] for argv in commands(section) if "-c" in argv]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, {})
    on_main = printed.getvalue().splitlines()
    least, invariant_least = model_py.Linear(4, 4).min_rows, model_py.MIN_ROWS_INVARIANT  # the default path's; main's
    assert apply_lab(monkeypatch, section) == "MIN_ROWS_INVARIANT" and model_py.MIN_ROWS_INVARIANT == least
    changed, changed_statuses = lab_13_printed(section, 1)
    assert changed_statuses == [1, 1], "at the default path's least rows, the ops' table or the bits did not fail"

    # What the runs print: the excerpts' lines, where this machine's MKL switches kernels as the excerpt's (the
    # --ops header, which names torch's version, aside); on another, what holds of any BLAS that varies at all.
    header = [line for line in main if line.startswith("each op of a step")]
    table = ops_columns(excerpts[0])
    as_here = ops_columns(main) == table
    if as_here:
        assert [line for line in main if line not in header] == [line for line in excerpts[0]
                                                                 if not line.startswith("each op of a step")]
        assert changed == excerpts[1]
    assert all(invariant == "nowhere" for _, invariant in ops_columns(main).values())
    broken = ops_columns(changed)
    products = [op for op in broken if op.startswith(("linear", "LM head"))]
    assert len(products) == 3 and all(broken[op][1] == broken[op][0] != "nowhere" for op in products), broken
    assert broken["attention"][1] == "nowhere", "the linear layers' least rows broke attention too"
    answers = "12 answers: 12 identical, 0 rounding, 0 BUG"
    assert main.count(answers) == 2 and changed.count(answers) == 1, "an answer changed"

    # (1) The default path and the batch-invariant one, from the first excerpt.
    requests, n_slots = served["requests"], served["n_slots"]
    default_bits, invariant_bits = bits_line(excerpts[0][:2]), bits_line(excerpts[0][2:4])
    compared = 3 * len(requests)  # each answer's first, middle and last token's
    assert default_bits[1] == invariant_bits[1] == compared and invariant_bits[0] == compared
    assert excerpts[0][0] == excerpts[0][2] == answers
    says(section, r"serves (\d+) greedy requests on (\d+) slots", len(requests), n_slots)
    says(section, r"compares (\d+) logits rows \(each answer's first, middle and last token's\)", compared)
    says(section, r"Which of the (\d+) rows change\?", compared)
    says(section, r"yet (\d+) of the (\d+) rows keep their bits", *default_bits[:2])
    says(section, r"on the same ops: (\d+) of (\d+)\.", *invariant_bits[:2])
    sizes = [int(n) for n in re.findall(r"\d+", table["linear 64 -> 192"][0])]  # the calls whose rows differ
    assert all([int(n) for n in re.findall(r"\d+", table[op][0])] == sizes for op in products), table
    threshold = sizes[-1] + 1  # from this many rows, MKL's general kernel
    assert sizes == list(range(1, threshold)) and threshold <= invariant_least, "not calls under a size"
    says(section, r"compute a call of (\d+)-(\d+) rows with another kernel than a call of (\d+) or more", 1,
         sizes[-1], threshold)
    assert [table[op][0] for op in ("embeddings", "layer norm", "GELU", "softmax (sampling)")] == ["nowhere"] * 4
    assert table["attention"][0] == "as a prompt's row; over more keys (masked)" and \
        "gives a row other bits over more keys, or as one of a prompt's rows" in prose(section)
    assert max(n_sampled for _, n_sampled, _, _ in steps) == n_slots < threshold
    says(section, r"A step samples at most (\d+) rows, one a slot, so every logits row comes out of an LM head call "
         r"of fewer than (\d+)\.", n_slots, threshold)
    says(section, r"computes at least (\d+) rows a call \(MIN_ROWS_INVARIANT\)", invariant_least)
    says(section, r"At (\d+), the default path's least", least)
    says(section, r"\(Linear (\d+) rows a call at least, always MKL's general kernel; attention_in_key_blocks sums "
         r"exactly (\d+) keys a product", invariant_least, model_py.KEY_BLOCK)
    # (2) The proof's teeth make the lab's change.
    teeth = source_of(proof.test_a_product_of_a_few_rows_left_to_its_own_kernel_is_caught)
    assert f'monkeypatch.setattr(model_py, "MIN_ROWS_INVARIANT", {least})' in teeth
    says(section, r"\(2\) At (\d+), the linear layers and the LM head vary where the default path's do", least)

    # (3) Which rows: every one, in the excerpt, each step sampling fewer rows than the general kernel takes.
    made, n_made = {}, [0] * len(requests)  # (request, token) -> the index of the step that sampled it
    for index, (_, _, _, sampled) in enumerate(steps):
        for i in sampled:
            made[i, n_made[i]], n_made[i] = index, n_made[i] + 1
    kept = [(i, k) for i, request in enumerate(requests)
            for k in sorted({0, request.max_new_tokens // 2, request.max_new_tokens - 1})]
    assert len(kept) == compared
    equal, _, excerpt_named = bits_line(excerpts[1])
    assert excerpt_named == {(nanobatch.letter(i), k) for i, k in kept} and equal == 0
    says(section, r"The answers stay, (\d+) identical, but all (\d+) rows lose their bits", len(requests), compared)
    says(section, r"\((\d+) at step (\d+), (\d+) while every slot decodes, fewer as the belt empties\)", steps[0][0], 0,
         n_slots)
    assert any(rows == len(fed) == n_slots for rows, _, fed, _ in steps) and steps[-1][0] < n_slots
    shortest = min(len(request.prompt) for request in requests)
    says(section, r"the reference, a whole prefix of (\d+) tokens or more in one call", shortest)

    # (4) Where: a row whose every row of its prefix went through calls of the general kernel's size on both sides
    # (steps of `threshold` rows or more, a prefix of as many) differs in the LM head alone; any other from layer
    # 0's c_attn on. Measured here: each compared row's prefix through the reference's forward, stopped once layer
    # 0's c_attn has run, against the rows the engine's steps made of it.
    def alike_to_the_lm_head(i, k):  # the rule, on the run's own steps and the excerpt's table
        fed_steps = [rows for rows, _, fed, _ in steps[:made[i, k] + 1] if i in fed]
        return min(fed_steps) >= threshold and len(requests[i].prompt) + k >= threshold

    def reference_c_attn(prefix):  # (T, 3C): layer 0's c_attn in the reference's forward over prefix
        def stop(layer, inputs, out):
            raise Stopped(out[0])
        hook = served["model"].transformer.h[0].attn.c_attn.register_forward_hook(stop)
        try:
            with torch.no_grad(), pytest.raises(Stopped) as stopped:
                served["model"](torch.tensor([prefix]))
        finally:
            hook.remove()
        return stopped.value.args[0]

    by_rule = [(i, k) for i, k in kept if alike_to_the_lm_head(i, k)]
    assert all(k == 0 for _, k in by_rule)
    if as_here:
        got, rows_made = served["got"], served["c_attn"]
        measured = [(i, k) for i, k in kept if all(torch.equal(row, rows_made[i, p]) for p, row in enumerate(
            reference_c_attn(requests[i].prompt + got[i].tokens[:k])))]
        assert measured == by_rule, (measured, by_rule)
    heads = [len(requests[i].prompt) for i, _ in by_rule]
    says(section, r"(\d+) of the (\d+) rows first differ there\. The other (\d+), the first tokens of ([A-Z, and]+), "
         r"prompts of (\d+)-(\d+) tokens that went in steps of (\d+) rows or more as the reference computes them, "
         r"differ in the LM head alone", compared - len(by_rule), compared, len(by_rule),
         ", ".join(nanobatch.letter(i) for i, _ in by_rule[:-1]) + f" and {nanobatch.letter(by_rule[-1][0])}",
         min(heads), max(heads), threshold)
    says(section, r"one of them under (\d+) rows: a decode step's \((\d+) rows at most\)", threshold, n_slots)
    assert any(len(fed) < rows < threshold and len(fed) > 1 for rows, _, fed, _ in steps), "no late prompt's small step"
    assert any(i in steps[0][2] and len(request.prompt) < threshold for i, request in enumerate(requests))
    says(section, r"over a prompt of fewer than (\d+) tokens that the engine computed in a step of (\d+) rows or more "
         r"\(step (\d+)'s (\d+)\)", threshold, threshold, 0, steps[0][0])
    # The snippet, a prompt alone on a slot, token by token against the reference's last row. On main the same bits;
    # at the default path's least, token 0 in the LM head only (its step samples 1 row), every later one from layer
    # 0's c_attn on (a step of 1 row). On any machine, nothing differs first past layer 0's first product but the head.
    [(first, last, n_tokens)] = [tuple(map(int, found)) for found in
                                 re.findall(r"Request\(list\(range\((\d+), (\d+)\)\), (\d+)\)", snippet)]
    n_prompt = last - first
    assert "n_slots=1" in snippet and n_prompt >= threshold
    assert on_main == [f"token {k} (the reference over {n_prompt + k} rows): the same bits" for k in range(n_tokens)]
    shown = excerpts[1][-n_tokens:]
    c_attn = "transformer.h.0.attn.c_attn"
    assert shown == [f"token {k} (the reference over {n_prompt + k} rows): first differs in "
                     f"{'lm_head' if k == 0 else c_attn}" for k in range(n_tokens)]
    assert all(re.fullmatch(rf".*: (the same bits|first differs in ({re.escape(c_attn)}|lm_head))", line)
               for line in changed[-n_tokens:]), changed[-n_tokens:]
    says(section, r"first differs in layer (\d+)'s first product, c_attn", int(re.search(r"h\.(\d+)\.", c_attn)[1]))
    says(section, r"token (\d+), its prompt's (\d+) rows computed as the reference's, differs in lm_head only \(its "
         r"step samples (\d+) row\); tokens (\d+)-(\d+), each a step of (\d+) row against the reference's (\d+)-(\d+),",
         0, n_prompt, 1, 1, n_tokens - 1, 1, n_prompt + 1, n_prompt + n_tokens - 1)

    # The cost, and the machine: with two threads (this machine's MKL) the linear layers switch kernels at the same
    # rows, and the default path's attention varies in a batch too.
    says(section, r"so a step's products of a few rows cost what (\d+) rows do", invariant_least)
    if as_here:
        linear, previous, seeded = model_py.Linear(64, 192), torch.get_num_threads(), torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (linear.weight, linear.bias):
                p.normal_(generator=seeded)
            x = torch.randn(100, 64, generator=seeded)
            torch.set_num_threads(2)
            try:
                full = linear(x)
                differ = {n: [row for row in range(n) if not torch.equal(linear(x[:n])[row], full[row])]
                          for n in range(1, 17)}
                attention = verify.attention_varies(torch.nn.functional.scaled_dot_product_attention, nanobatch.TINY,
                                                    lambda *shape: torch.randn(*shape, generator=seeded))
            finally:
                torch.set_num_threads(previous)
        assert differ == {n: list(range(n)) if n < threshold else [] for n in range(1, 17)}, differ
        assert attention == "as a prompt's row; in a batch; over more keys (masked)", attention
        says(section, r"the linear layers' rows differ in the same calls, of (\d+)-(\d+) rows, and the default path's "
             r"attention in a batch too", 1, threshold - 1)
    else:  # another machine's threads may switch elsewhere: the prose speaks of this one's
        stated(section, r"the linear layers' rows differ in the same calls, of (\d+)-(\d+) rows")
    says(section, r"(\d+) rows is the\s+threshold here\)", threshold)
    says(section, r"rounds up to whole groups of (\d+) rows", threshold - 1)  # Linear's: calls of 9 rows or more
    check_every_figure_pinned(section, r"temperature 0 answers with the load", r"Inference\", 2025",
                              r"VLLM_BATCH_INVARIANT=1", r"OMP_NUM_THREADS=1", r"a 2-core AMD EPYC VM with AVX-512")
