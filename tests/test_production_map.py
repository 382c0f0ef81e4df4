"""docs/production.md, the reading map into four engines, checked for its form, offline.

The page says, for each idea of nanobatch, where vLLM, SGLang, nano-vllm and Hugging Face
transformers do the same thing. Their source is not here, so what a test can hold the page to is its
form, and its side of each row: every name of ours that it cites must exist, read from nanobatch.py
and model.py with ast (nothing is imported), so that a rename in the code breaks the page here and
not in a classroom. In steps:
    1) the page is at most 160 lines;
    2) its first lines name the date it was read, and one version (a tag or a commit) per engine,
       named there once and not again in the rows;
    3) every idea has one `nanobatch:` line, and one line per engine: a place (a file under that
       engine's tree and a class or function) and what it does differently, or `none:` and why;
    4) every name of ours it cites exists, and the ideas the page was written for are all there;
    5) the checker has teeth: each defect planted in a copy of the page is reported.
"""
import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "production.md"
SOURCES = (ROOT / "nanobatch.py", ROOT / "model.py")
MAX_LINES = 160
ENGINES = {  # each engine as the page names it -> how the path of each of its places begins
    "vLLM": "vllm/",
    "SGLang": "python/sglang/",
    "nano-vllm": "nanovllm/",
    "HF transformers": "src/transformers/",
}
# The ideas the page exists to map, each by a name of ours that its row must cite.
REQUIRED = {
    "generate", "slots_to_fill", "plan_step", "pack_step", "PackedStep", "CausalSelfAttention.attend_packed",
    "attention_mask", "KVCache", "KVCache.clear", "PrefillWorker", "Handover", "KVCache.send",
    "BlockPool", "BlockPool.admit", "BlockPool.make_room", "BlockPool.vacate", "Running.block_table",
    "PackedStep.block_tables", "summarize", "sample", "split_at_cut", "attention_cut",
    "PrefixCache", "PrefixCache.keys", "PrefixCache.key_written", "PrefixCache.admit", "PrefixCache.release",
    "PrefixCache.vacate", "PrefixCache.take_block", "Running.n_found", "StepReport.found_cached",
}
NAME_FORM = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?(\([A-Za-z_]\w*\))?")  # f, C.m, f(param), C.m(param)
VERSION_FORM = re.compile(r"\btag v\d+(\.\d+)+\b|\bcommit [0-9a-f]{7,40}\b")
VERSION_IN_ROW = re.compile(r"\bv\d+\.\d+\.\d+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE_FORM = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CELL = re.compile(r"- (?P<engine>[^:`]+): (?P<rest>.*)")
PLACE = re.compile(r"`(?P<path>[^`]+)` `(?P<name>[A-Za-z_][\w.]*)`: (?P<text>.+)")


# ---------------------------------------------------------------------------------------------
# Our side: the names nanobatch.py and model.py define, read from their source


def defined_names(sources):
    """Top-level functions and classes; methods and class-level fields as Class.name; and each
    function's parameters as f(param) or Class.m(param)."""
    names = set()

    def add_function(qualified, node):
        names.add(qualified)
        arguments = node.args
        for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + [arguments.vararg, arguments.kwarg]:
            if arg is not None:
                names.add(f"{qualified}({arg.arg})")

    for path in sources:
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add_function(node.name, node)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        add_function(f"{node.name}.{member.name}", member)
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(f"{node.name}.{member.target.id}")  # a dataclass field
                    elif isinstance(member, ast.Assign):
                        names.update(f"{node.name}.{t.id}" for t in member.targets if isinstance(t, ast.Name))
    return names


@functools.cache
def code_names():
    return frozenset(defined_names(SOURCES))


# ---------------------------------------------------------------------------------------------
# The page's side: read it into its header and its ideas, and say what is wrong with it, by kind


def read_page(text):
    """-> (header: [(line number, line)], ideas: [{"title", "line", "body": [(line number, line)]}])."""
    header, ideas = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("### "):
            ideas.append({"title": line[4:].strip(), "line": number, "body": []})
        elif line.startswith("## ") and ideas:  # a part's heading ends the idea before it
            ideas.append(None)
        elif ideas and ideas[-1] is not None:
            ideas[-1]["body"].append((number, line))
        elif not ideas:
            header.append((number, line))
    return header, [idea for idea in ideas if idea is not None]


def check_page(text, names):
    """Every problem of the page, {kind: [message]}, kinds: length, version, cell, name, coverage."""
    found = {kind: [] for kind in ("length", "version", "cell", "name", "coverage")}
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        found["length"].append(f"the page has {len(lines)} lines, more than {MAX_LINES}")
    header, ideas = read_page(text)

    # 2) The date and the versions, in the first lines, one per engine.
    if not any(DATE_FORM.search(line) for _, line in header[:10]):
        found["version"].append("the first 10 lines name no date (YYYY-MM-DD) on which the engines were read")
    for engine in ENGINES:
        version_lines = [(n, line) for n, line in header if line.startswith(f"- {engine}: ")]
        if len(version_lines) != 1:
            found["version"].append(f"the top names {len(version_lines)} versions of {engine}, not one "
                                    f"(a line '- {engine}: tag vX.Y.Z' or '- {engine}: commit HEX')")
        elif not VERSION_FORM.search(version_lines[0][1]):
            found["version"].append(f"line {version_lines[0][0]}: {engine}'s version names neither a tag "
                                    f"('tag vX.Y.Z') nor a commit ('commit HEX')")
    if not ideas:
        found["cell"].append("the page has no ideas: no '### ' heading")

    # 3) and 4) Each idea: one nanobatch line of names that exist, one cell per engine.
    cited = set()
    for idea in ideas:
        where = f"'{idea['title']}' (line {idea['line']})"
        nanobatch_lines, cells = [], {}
        for number, line in idea["body"]:
            if not line.strip():
                continue
            if VERSION_IN_ROW.search(line):
                found["version"].append(f"line {number} in {where} names a version: versions are named once, "
                                        f"at the top")
            if line.startswith("nanobatch: "):
                nanobatch_lines.append((number, line))
            elif (cell := CELL.fullmatch(line)) and cell["engine"] in ENGINES:
                if cell["engine"] in cells:
                    found["cell"].append(f"line {number}: {where} has a second cell for {cell['engine']}")
                cells[cell["engine"]] = (number, cell["rest"])
            else:
                found["cell"].append(f"line {number} in {where} is neither the nanobatch line nor a cell "
                                     f"'- ENGINE: ...' of one of {list(ENGINES)}: {line[:60]!r}")
        if len(nanobatch_lines) != 1:
            found["cell"].append(f"{where} has {len(nanobatch_lines)} 'nanobatch:' lines, not one")
        for number, line in nanobatch_lines:
            cited_here = re.findall(r"`([^`]+)`", line)
            if not cited_here:
                found["cell"].append(f"line {number}: {where}'s nanobatch line cites no name in backticks")
            for name in cited_here:
                cited.add(name)
                if not NAME_FORM.fullmatch(name):
                    found["name"].append(f"line {number} cites `{name}`, which is not of the form f, C.m, "
                                         f"f(param) or C.m(param)")
                elif name not in names:
                    found["name"].append(f"line {number} cites `{name}`, which nanobatch.py and model.py do "
                                         f"not define")
        for engine, path_start in ENGINES.items():
            if engine not in cells:
                found["cell"].append(f"{where} has no cell for {engine}: a line '- {engine}: `path` `Name`: "
                                     f"what differs', or '- {engine}: none: why'")
                continue
            number, rest = cells[engine]
            if rest.startswith("none: "):
                if len(rest.split()) < 4:
                    found["cell"].append(f"line {number}: {engine}'s 'none:' in {where} says not why")
            elif not (place := PLACE.fullmatch(rest)):
                found["cell"].append(f"line {number}: {engine}'s cell in {where} has no place "
                                     f"'`path` `Name`: what differs', nor 'none: why'")
            elif not (place["path"].startswith(path_start) and place["path"].endswith(".py")):
                found["cell"].append(f"line {number}: {engine}'s place `{place['path']}` in {where} is not a "
                                     f".py file under {path_start}")
            elif len(place["text"].split()) < 4:
                found["cell"].append(f"line {number}: {engine}'s cell in {where} does not say what differs")
    for name in sorted(REQUIRED - cited):
        found["coverage"].append(f"no idea cites `{name}`: the page was asked to map it")
    return found


def report(messages):
    return "docs/production.md:\n  " + "\n  ".join(messages)


# ---------------------------------------------------------------------------------------------
# 1) to 4): the real page


@pytest.fixture(scope="module")
def page_problems():
    return check_page(PAGE.read_text(), code_names())


def test_the_page_is_at_most_160_lines(page_problems):
    assert not page_problems["length"], report(page_problems["length"])


def test_the_date_and_each_engines_version_are_named_once_at_the_top(page_problems):
    assert not page_problems["version"], report(page_problems["version"])


def test_every_idea_has_a_place_or_none_for_each_engine(page_problems):
    assert not page_problems["cell"], report(page_problems["cell"])


def test_every_name_of_ours_the_page_cites_exists(page_problems):
    assert not page_problems["name"], report(page_problems["name"])


def test_the_ideas_asked_for_are_all_mapped(page_problems):
    assert not page_problems["coverage"], report(page_problems["coverage"])


# ---------------------------------------------------------------------------------------------
# 5) Teeth: each defect, planted in a copy of the real page, must be reported


def drop_line(starting):
    """A plant: the page without its first line that starts so."""
    def plant(text):
        lines = text.splitlines()
        index = next(i for i, line in enumerate(lines) if line.startswith(starting))
        return "\n".join(lines[:index] + lines[index + 1:])
    return plant


def replace_once(old, new):
    def plant(text):
        assert old in text, f"the plant needs {old!r} in the page"
        return text.replace(old, new, 1)
    return plant


def drop_idea(title):
    def plant(text):
        start = text.index(f"### {title}\n")
        end = text.find("\n#", start + 1)
        return text[:start] + (text[end + 1:] if end != -1 else "")
    return plant


PLANTS = {  # what is planted -> (the plant, the kind of problem it must raise, words the message must hold)
    "an engine's cell missing": (drop_line("- SGLang: `python/sglang/srt/managers/schedule_policy.py`"),
                                 "cell", "no cell for SGLang"),
    "a made-up name of ours": (replace_once("`summarize`", "`summarise`"), "name", "`summarise`"),
    "a method that is not there": (replace_once("`KVCache.clear`", "`KVCache.wipe`"), "name", "`KVCache.wipe`"),
    "a parameter that is not there": (replace_once("`plan_step(prefill_chunk)`", "`plan_step(chunk)`"),
                                      "name", "`plan_step(chunk)`"),
    "an engine's version missing": (drop_line("- nano-vllm: commit"), "version", "versions of nano-vllm"),
    "a version repeated in a row": (replace_once("`EngineCore.step`: ", "`EngineCore.step`: in v0.33.0, "),
                                    "version", "named once"),
    "a place under another engine's tree": (replace_once("- vLLM: `vllm/v1/engine/core.py`",
                                                         "- vLLM: `nanovllm/engine/llm_engine.py`"),
                                            "cell", "not a .py file under vllm/"),
    "a cell with no place": (replace_once("- nano-vllm: `nanovllm/layers/sampler.py` `Sampler.forward`: ",
                                          "- nano-vllm: somewhere in its sampler: "), "cell", "has no place"),
    "an idea dropped": (drop_idea("The attention cut"), "coverage", "`split_at_cut`"),
    "too long": (lambda text: text + "\n" * MAX_LINES, "length", "more than 160"),
}


@pytest.mark.parametrize("defect", PLANTS)
def test_the_checker_reports_a_planted_defect(defect):
    plant, kind, words = PLANTS[defect]
    text = PAGE.read_text()
    before = set(check_page(text, code_names())[kind])
    new = [message for message in check_page(plant(text), code_names())[kind] if message not in before]
    assert any(words in message for message in new), \
        f"planting {defect} raised no new {kind} problem saying {words!r}; new ones: {new}"


def test_the_name_reader_finds_each_form_it_accepts(tmp_path):
    """The names the checker trusts, on a tiny source: a function and its parameters, a class, its
    method and that method's parameters, its class-level fields; and nothing else."""
    path = tmp_path / "probe.py"
    path.write_text("def f(a, *rest, key=1):\n    inner = 2\n"
                    "class C:\n    field: int = 0\n    LIMIT = 3\n    def m(self, b):\n        self.hidden = b\n")
    names = defined_names([path])
    assert names == {"f", "f(a)", "f(rest)", "f(key)", "C", "C.field", "C.LIMIT", "C.m", "C.m(self)", "C.m(b)"}
