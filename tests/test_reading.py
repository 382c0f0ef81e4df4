"""
What a reader is promised about the code itself: the loop reads the same in every mode (it never
asks which mode runs: the cache and the prompts' feeder answer for the Parts), it fits a sitting,
and every line count the README states is the count of the file or Part it names.
"""
import ast
import re

import pytest

from tests.common import REPO

NANOBATCH = REPO / "nanobatch.py"
# Names that tell the modes apart: a condition of the loop that reads one of them asks which mode
# runs (the cache manager, the prompts' feeder, a handover, or the arguments that choose them). `work`
# too: only the prefill worker can leave a step with nothing to feed.
MODE_NAMES = {"blocks", "prompts", "pool", "worker", "handover", "handovers", "kv_blocks", "kv_block_size",
              "disaggregate", "work", "preempted"}


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
])
def test_a_question_about_the_mode_is_caught(planted):
    """Teeth: a condition on the arguments, on `work`, or on the prompts' feeder, planted in the loop."""
    text = NANOBATCH.read_text()
    before, after = planted
    assert text.count(before) == 1
    assert mode_questions(text.replace(before, after)), f"not caught: {after.strip()}"


def test_the_loop_fits_a_sitting():
    """generate at most 75 lines from its def to its end, its loop at most 45."""
    generate, loop = generate_and_its_loop(NANOBATCH.read_text())
    assert generate.end_lineno - generate.lineno + 1 <= 75, "generate is over 75 lines"
    assert loop.end_lineno - loop.lineno + 1 <= 45, "generate's loop is over 45 lines"


# ---------------------------------------------------------------------------------------------
# Every line count the README states


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


TOOLS = ["bench.py", "verify.py", "belt_svg.py", "explore.py", "explore.html", "gpu_check.sh", "load.py"]


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
