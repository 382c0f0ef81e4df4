"""
What a reader is promised about the code itself: the loop reads the same in every mode (it never
asks which mode runs: the cache, the prompts' feeder and the callers answer for the Parts), it and
each Part fit a sitting, the banners and the module docstring name the five Parts, and every line
count the README states is the count of the file or Part it names.
"""
import ast
import re

import pytest

from tests.common import REPO

NANOBATCH = REPO / "nanobatch.py"
# Names that tell the modes apart: a condition of the loop that reads one of them asks which mode
# runs (the cache manager, the prompts' feeder, a handover, whether the callers are live, or the
# arguments and classes that choose them). `work`, `preempted` and `cancelled` too: only the prefill
# worker can leave a step with nothing to feed, only a pool (Part 3) preempts, only live callers
# (Part 5) cancel. Not `callers`: the loop's condition asks them whether more will come, a question
# with both answers in every mode, as `waiting` is one.
MODE_NAMES = {"blocks", "prompts", "pool", "worker", "handover", "handovers", "kv_blocks", "kv_block_size",
              "disaggregate", "work", "preempted", "is_live", "LiveRequests", "RequestList", "cancelled"}


def generate_and_its_loop(text):
    """(generate's FunctionDef, its `while` loop) in nanobatch.py's text."""
    [generate] = [node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef) and node.name == "generate"]
    loop = next(node for node in ast.walk(generate) if isinstance(node, ast.While))  # the outermost
    return generate, loop


def conditions(tree):
    """Every condition under tree: of an if, a conditional expression, a while, a comprehension's if."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def mode_questions(text):
    """The conditions inside generate's loop that read a name of MODE_NAMES, as source."""
    _, loop = generate_and_its_loop(text)
    asked = []
    for test in conditions(loop):
        names = {node.id for node in ast.walk(test) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(test) if isinstance(node, ast.Attribute)}
        if names & MODE_NAMES:
            asked.append(ast.get_source_segment(text, test))
    return asked


def test_the_loop_never_asks_which_mode_runs():
    """No condition inside the loop names the cache's manager, the prompts' feeder, a handover, or
    the arguments that choose them: Parts 2 and 3 answer the loop's calls, they add no branch to it.
    Static batching's padding rows are Part 1's policy, and may stay."""
    text = NANOBATCH.read_text()
    assert mode_questions(text) == [], f"the loop asks which mode runs: {mode_questions(text)}"


@pytest.mark.parametrize("planted", [
    ("            step += 1\n    return", "            step += 1 if kv_blocks else 1\n    return"),
    ("            step += 1\n    return", "            if work:\n                step += 1\n    return"),
    ("            for run in finished:\n", "            for run in finished if prompts.budget else []:\n"),
    ("            step += 1\n    return", "            step += 0 if is_live else 1\n    return"),
    ("            step += 1\n    return",
     "            if not isinstance(callers, LiveRequests):\n                step += 1\n    return"),
    ("            for run in finished:\n", "            for run in finished if not cancelled else []:\n"),
])
def test_a_question_about_the_mode_is_caught(planted):
    """Teeth: a condition on the arguments, on `work`, on the prompts' feeder, or on whether the callers
    are live (Part 5), planted in the loop."""
    text = NANOBATCH.read_text()
    before, after = planted
    assert text.count(before) == 1
    assert mode_questions(text.replace(before, after)), f"not caught: {after.strip()}"


def test_the_loop_fits_a_sitting():
    """generate at most 80 lines from its def to its end, its loop at most 48 (issue 40: Part 5 adds a
    question for the callers, and a token handed to its caller)."""
    generate, loop = generate_and_its_loop(NANOBATCH.read_text())
    assert generate.end_lineno - generate.lineno + 1 <= 80, "generate is over 80 lines"
    assert loop.end_lineno - loop.lineno + 1 <= 48, "generate's loop is over 48 lines"


# ---------------------------------------------------------------------------------------------
# Each Part's size, and every line count the README states


def n_lines(path):
    return len((REPO / path).read_text().splitlines())


def part_lines(number):
    """nanobatch.py's Part `number`, counted as the README counts it. Part 1: from line 1 to the end of
    generate_sequential. A later Part: from its banner to its last line before the next banner."""
    lines = NANOBATCH.read_text().splitlines()
    banners = [i for i, line in enumerate(lines) if line.startswith("# ----")]
    if number == 1:
        start = 0
        [after] = [i for i, line in enumerate(lines) if line.startswith("def generate_sequential(")]
    else:
        [start] = [i for i in banners if lines[i + 1].startswith(f"# Part {number},")]
        after = start
    end = next(i for i in banners if i > after)
    while not lines[end - 1].strip():  # the blank lines before the next banner belong to neither
        end -= 1
    return end - start


def function_lines(owner, name):
    """A function's (or a method's) lines in nanobatch.py, from its def to its last line."""
    tree = ast.parse(NANOBATCH.read_text())
    [node] = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == owner]
    [method] = [child for child in node.body if isinstance(child, ast.FunctionDef) and child.name == name]
    return method.end_lineno - method.lineno + 1


PART_LIMITS = {1: 424, 2: 100, 3: 130, 4: 100, 5: 120}  # lines, as part_lines counts them (issue 40)


@pytest.mark.parametrize("number", PART_LIMITS)
def test_each_part_fits_its_limit(number):
    """Each Part of nanobatch.py within its lines: Part 1 no longer than when Part 5 came (424),
    Part 5 at most 120, and Parts 2, 3, 4 at most 100, 130, 100."""
    n_part, limit = part_lines(number), PART_LIMITS[number]
    assert n_part <= limit, f"Part {number} is {n_part} lines, over its {limit}"


def test_the_banners_and_the_docstring_name_every_part():
    """A banner opens each Part, in order, and the module docstring names each: Part 5 too."""
    text = NANOBATCH.read_text()
    lines = text.splitlines()
    banners = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("# ----") and
               lines[i + 1].startswith("# Part ")]
    assert [banner.split(",")[0] for banner in banners] == [f"# Part {n}" for n in PART_LIMITS], banners
    docstring = ast.get_docstring(ast.parse(text))
    assert all(f"Part {n}," in docstring for n in PART_LIMITS), "the module docstring does not name every Part"
    assert "Part 5, serving live" in docstring and banners[-1].startswith("# Part 5, serving live")


TOOLS = ["bench.py", "verify.py", "belt_svg.py", "explore.py", "explore.html", "gpu_check.sh", "load.py", "load_http.py",
         "serve.py", "serve.html"]


def stated_counts():
    """(pattern in the README, its count as computed): each holds its figures as groups."""
    tools = [name for name in TOOLS if (REPO / "tools" / name).exists()]
    return [
        (r"\| `nanobatch.py` \| (\d+) \|", [n_lines("nanobatch.py")]),
        (r"\*\*Part 1, continuous batching\*\* \((\d+)\s+lines", [part_lines(1)]),
        (r"\*\*Part 2, disaggregated prefill\*\* \((\d+) lines", [part_lines(2)]),
        (r"\*\*Part 3, paged attention\*\* \((\d+) lines", [part_lines(3)]),
        (r"\*\*Part 4, prefix caching\*\* \((\d+) lines", [part_lines(4)] if "# Part 4," in NANOBATCH.read_text()
         else None),
        (r"\*\*Part 5, serving live\*\* \((\d+) lines", [part_lines(5)]),
        (r"\| `model.py` \| (\d+) \|", [n_lines("model.py")]),
        (r"\| `test_nanobatch.py` \| (\d+) \|", [n_lines("test_nanobatch.py")]),
        (r"\| `tests/` \| (\d+) \|", [sum(n_lines(path.relative_to(REPO)) for path in (REPO / "tests").glob("*.py"))]),
        (r"\| `tools/` \| " + r" \+ ".join([r"(\d+)"] * len(tools)) + r" \|",
         [n_lines(f"tools/{name}") for name in tools]),
        (r"`PrefillWorker.prefill`,\s+(\d+)\s+lines", [function_lines("PrefillWorker", "prefill")]),
    ]


def test_every_line_count_the_readme_states_is_true():
    """Each count the README states is the file's or the Part's, as counted above; and no other
    'N lines' appears in the README, where no check would keep it true."""
    readme = (REPO / "README.md").read_text()
    checked = []
    for pattern, counts in stated_counts():
        match = re.search(pattern, readme)
        if counts is None:
            assert match is None, f"the README counts a Part that nanobatch.py lacks: {match[0]}"
            continue
        assert match, f"the README no longer states {pattern}"
        assert [int(group) for group in match.groups()] == counts, f"the README says {match[0]!r}: the count is {counts}"
        checked.append(match.span())
    for stray in re.finditer(r"\b\d+\s+lines\b", readme):
        assert any(start <= stray.start() < end for start, end in checked), \
            f"the README states {stray[0]!r} (…{readme[stray.start() - 60:stray.end()]}) and no test checks it"
