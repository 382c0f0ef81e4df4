"""
The command line, offline: nanobatch.py and the tools run as a user runs them, what they refuse
said in one line, a broken loop's traceback kept, a closed pipe and Ctrl-C; and tools/gpu_check.sh's
dry run on the CPU.
"""
import os
import signal
import subprocess
import sys

import pytest

import model as model_py
import nanobatch
from model import GPT
from tests.common import IN_BACKGROUND, REPO
from tests.test_belt_svg import drawn_panels  # the picture parsed back
import belt_svg  # noqa: E402 (tools/, put on the path by tests.common)
import bench  # noqa: E402
import verify  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The command line, offline


def cli_env(tmp_path):
    return {**os.environ, "NANOBATCH_CACHE": str(tmp_path),  # an empty cache: no real weights found
            "OMP_NUM_THREADS": "1",  # one CPU thread for torch, as in the suite (see torch.set_num_threads in tests/common.py)
            "PYTHONWARNINGS": "ignore",  # torch's import-time warnings are not the CLI's output
            # Every proxy points at a closed local port: a download attempt fails at once, offline.
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}


def run_cli(tmp_path, *args, script="nanobatch.py"):
    return subprocess.run([sys.executable, script, *args], cwd=REPO, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=100)


def default_ctrl_c():
    """In the child: Ctrl-C as a terminal delivers it, even where the suite was started with SIGINT
    ignored (a shell's background job), which Python would then keep ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(tmp_path, *args):
    return subprocess.Popen([sys.executable, "nanobatch.py", *args], cwd=REPO, env=cli_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=None if sys.platform == "win32" else default_ctrl_c)


# Three tests below run a command as a user does, each in a process of its own that imports torch first
# (2 s of CPU). Their processes start as the session's first test does (tests/conftest.py starts those of
# the tests selected), beside the tests that run in this process: on two cores, with the other core idle
# or busy, the suite ends sooner for it. A thread each talks to its process as a terminal would, and each
# test waits for its own, then checks what came back.


def demo_to_svg(folder):
    """`python tools/belt_svg.py FILE --quick` -> (its CompletedProcess, the SVG it wrote)."""
    result = run_cli(folder, str(folder / "belt.svg"), "--quick", script="tools/belt_svg.py")
    return result, (folder / "belt.svg").read_text() if (folder / "belt.svg").exists() else ""


def head_3(folder):
    """`python nanobatch.py --demo --quick | head -3`: the reader goes away after three lines -> (its exit
    status, its stderr)."""
    process = start_cli(folder, "--demo", "--quick")
    try:
        for _ in range(3):
            process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read()
        return process.wait(timeout=100), stderr
    finally:
        process.kill()  # if it hangs, nothing outlives the suite (a process that ended is left alone)


def ctrl_c_at_step_3(folder):
    """`python nanobatch.py --demo --quick --disaggregate`, Ctrl-C as a terminal sends it once three steps
    are printed -> (its exit status, its stdout, its stderr)."""
    process = start_cli(folder, "--demo", "--quick", "--disaggregate")
    try:
        n_steps_seen, line = 0, "?"
        while n_steps_seen < 3 and line:  # "" at the end of its output: it ended first
            line = process.stdout.readline()
            n_steps_seen += line.startswith("step ")
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=100)
        return process.returncode, stdout, stderr
    finally:
        process.kill()


IN_BACKGROUND.update({"test_cli_demo_quick": demo_to_svg, "test_cli_closed_pipe_ends_quietly": head_3,
                      "test_cli_ctrl_c_shows_the_figures_so_far": ctrl_c_at_step_3})  # test -> its run (tests/common.py)


def test_cli_demo_quick(ran):
    """The demo runs offline in seconds on a tiny random model: a belt line per step, the table with
    its legend, the sentence that says which rows to compare, and, run by tools/belt_svg.py, a picture
    of both runs, one bar for each of the 32 requests in each."""
    result, svg = ran
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) > 100, result.stdout[-2000:]
    for row in nanobatch.LEGEND:  # a line in the table, and a line in the legend under it
        assert [line[:24] for line in lines].count(f"{row:24}") == 1, f"{row}: not once in the table"
        assert sum(line.startswith(f"{row}: ") for line in lines) == 1, f"{row}: not once in the legend"
    assert "The rows to compare: steps and TTFT" in result.stdout
    panels = drawn_panels(svg)
    assert [sorted(bars) for _, bars, _ in panels] == [list(range(32))] * 2, "not one bar per request per panel"


@pytest.mark.skipif(os.environ.get("NANOBATCH_GPU_CHECK") != "1", reason=(
    "the GPU check's dry run, eleven processes that each import torch, is left out of the default run: "
    "`NANOBATCH_GPU_CHECK=1 python -m pytest -q -k gpu_check_on_the_cpu` runs it, as .ci/run does"))
def test_gpu_check_on_the_cpu(tmp_path):
    """tools/gpu_check.sh --cpu: every step of the GPU check on the CPU with tiny models, each with
    its output and its summary line, all ok. Its outputs are then read as a user would: the bench
    says why --quick's ratios are not GPT-2's, prints its table of decode steps at 8 to 64 slots,
    and draws a bar for each request of each run (continuous and static: 16; the long-prompt runs
    three ways: 16, 8 per slot); the disaggregated demo hands over every one of its 32 requests."""
    out = tmp_path / "out"
    result = subprocess.run(["bash", "tools/gpu_check.sh", str(out), "--cpu"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**cli_env(tmp_path), "PYTHON": sys.executable})
    summary = (out / "summary.txt").read_text().splitlines()
    steps = ["machine", "pytest", "bench-2-slots-float32", "bench-4-slots-float32", "bench-paged-2-slots-float32",
             "decode-steps-cost-0", "decode-steps-cost-2000", "decode-steps-cost-20000", "verify-bfloat16",
             "verify-bfloat16-disaggregated", "verify-bfloat16-paged", "verify-ops-float32", "verify-batch-invariant",
             "verify-batch-invariant-paged", "demo-quick-disaggregated", "demo-disaggregated", "demo-paged"]
    assert [line.split()[0] for line in summary] == steps and result.stdout.splitlines() == summary, result.stdout
    assert result.returncode == 0 and all(line.split()[1] == "ok" for line in summary), summary
    assert all((out / f"{name}.txt").stat().st_size > 0 for name in steps)
    bench_out = (out / "bench-2-slots-float32.txt").read_text()
    assert "--quick: on a model this small a step's fixed cost" in bench_out, bench_out[-2000:]
    table = [line.split() for line in bench_out.splitlines() if line.split()[1:2] == ["slots"]]
    assert [row[0] for row in table] == ["8", "16", "32", "64"] and all(len(row) == 8 for row in table), table
    panels = drawn_panels((out / "bench-2-slots-float32.svg").read_text())
    assert [sorted(bars) for _, bars, _ in panels] == [list(range(16))] * 5, "not one bar per request per panel"
    assert "12 answers: " in (out / "verify-bfloat16-disaggregated.txt").read_text()
    assert "12 answers: " in (out / "verify-bfloat16-paged.txt").read_text()
    assert "paged, 64 slots: " in (out / "demo-paged.txt").read_text()
    ops = (out / "verify-ops-float32.txt").read_text()  # the default path varies here; the batch-invariant never
    assert "attention" in ops and all(line.rstrip().endswith("nowhere") for line in ops.splitlines()[2:]), ops
    for name in ("verify-batch-invariant", "verify-batch-invariant-paged"):
        assert "bit for bit (batch-invariant): 36 of 36 logits rows" in (out / f"{name}.txt").read_text()
    demo = (out / "demo-quick-disaggregated.txt").read_text()
    assert "== disaggregated: 32 requests" in demo and "the prefill worker on" in demo and "== static" in demo
    handed = [word for line in demo.split("== static")[0].splitlines() if line.startswith("step ")
              for word in line.split() if word.startswith(">")]
    assert sorted(handed) == sorted(f">{nanobatch.letter(i)}" for i in range(32)), handed


@pytest.mark.parametrize("argv, message", [
    (["--demo", "--prompt", "Hi"], "nanobatch.py: error: argument --prompt: not allowed with argument --demo"),
    ([], "nanobatch.py: error: one of the arguments --demo --prompt is required"),
    (["--demo", "--slots", "0"], "nanobatch.py: error: argument --slots: must be > 0, got 0"),
    (["--demo", "--device", "gpu"], "nanobatch.py: error: argument --device: gpu is no device"),
    # What does not apply to the mode is refused, not ignored, even when it is typed with its default.
    (["--demo", "--quick", "--weights", "gpt2"],
     "nanobatch.py: error: --weights does not apply to --quick, which runs a tiny random model"),
    (["--demo", "--max-new-tokens", "64"], "nanobatch.py: error: --max-new-tokens does not apply to --demo"),
    (["--demo", "--policy", "static"], "nanobatch.py: error: --policy does not apply to --demo"),
    (["--prompt", "Hello", "--quick"], "nanobatch.py: error: --quick does not apply to --prompt"),
    (["--demo", "--requests", "10"], "nanobatch.py: error: unrecognized arguments: --requests 10"),
    # The tools: each takes its own options, and none of another's.
    ((bench, "--arrival-rate", "nan"), "tools/bench.py: error: argument --arrival-rate: must be > 0, got nan"),
    ((bench, "--temperature", "0"), "tools/bench.py: error: unrecognized arguments: --temperature 0"),
    ((bench, "--quiet"), "tools/bench.py: error: unrecognized arguments: --quiet"),
    ((bench, "--svg", "no/such/folder/belt.svg"),
     "tools/bench.py: error: argument --svg: no/such/folder/belt.svg: no such folder"),
    ((bench, "--decode-steps", "--svg", "belt.svg"),
     "tools/bench.py: error: --svg does not apply to --decode-steps, which times its own belts"),
    ((bench, "--decode-steps", "--slots", "4"),
     "tools/bench.py: error: --slots does not apply to --decode-steps, which times its own belts"),
    (["--demo", "--max-len", "0"], "nanobatch.py: error: argument --max-len: must be > 0, got 0"),
    (["--demo", "--kv-blocks", "0"], "nanobatch.py: error: argument --kv-blocks: must be > 0, got 0"),
    (["--demo", "--kv-block-size", "8"],
     "nanobatch.py: error: --kv-block-size applies to a paged cache only: give --kv-blocks too"),
    (["--demo", "--prefix-cache"],
     "nanobatch.py: error: --prefix-cache applies to a paged cache only: give --kv-blocks too"),
    ((verify, "--kv-block-size", "16"),
     "tools/verify.py: error: --kv-block-size applies to a paged cache only: give --kv-blocks too"),
    ((belt_svg, "--slots", "4", "belt.svg"), "tools/belt_svg.py: error: the following arguments are required: FILE"),
    ((verify, "--temperature", "0.8"), "tools/verify.py: error: unrecognized arguments: --temperature 0.8"),
    ((belt_svg, "no/such/folder/belt.svg"), "tools/belt_svg.py: error: argument FILE: no/such/folder/belt.svg: "
                                            "no such folder"),
])
def test_cli_refuses_what_it_cannot_do(argv, message, capsys):
    """Flags that make no sense are refused by the parser, before any model is made: its usage
    line, then its error, exit status 2. argv: nanobatch.py's, or (a tool, its own)."""
    main, argv = (argv[0].main, list(argv[1:])) if isinstance(argv, tuple) else (nanobatch.main, argv)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and err[-1] == message, err


@pytest.mark.parametrize("option, where", [("--bench", "tools/bench.py"), ("--verify", "tools/verify.py"),
                                           ("--svg=belt.svg", "tools/belt_svg.py FILE")])
def test_cli_says_where_the_tools_went(option, where, capsys):
    """--bench, --verify and --svg live in tools/ now: one line says where, exit status 2."""
    with pytest.raises(SystemExit) as exit:
        nanobatch.main(["--demo", option])
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f"has moved: python {where}" in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["--demo", "--quick", "--max-len", "1"], "max_len must be an int in 2..1024 (the model's block_size), got 1"),
    ((verify, "--quick", "--policy", "static", "--disaggregate"), "disaggregate=True needs policy='continuous'"),
    (["--demo", "--quick", "--slots", "100000"], "a KV cache of 100000 slots x 1024 positions takes 105 GB, but cpu "
                                                 "has 2 GB free: at most 1907 slots fit at max_len=1024"),
    (["--demo", "--quick", "--kv-blocks", "8", "--disaggregate"], "kv_blocks needs policy='continuous' and "
                                                                  "disaggregate=False"),
    (["--demo", "--quick", "--kv-blocks", "2"], "kv_blocks=2 cannot hold requests[2]'s whole sequence"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    """Input that generate refuses ends in one line, exit status 2, no traceback: a cache too large
    for the memory free (2 GB here, whatever the machine has) too."""
    monkeypatch.setattr(model_py, "available_memory", lambda device: 2_000_000_000)
    main, argv = (argv[0].main, list(argv[1:])) if isinstance(argv, tuple) else (nanobatch.main, argv)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f": error: {message}" in err[0], err


@pytest.mark.parametrize("main, mode", [(bench.main, []), (verify.main, []), (nanobatch.main, ["--demo"])],
                         ids=["bench", "verify", "demo"])
def test_cli_missing_checkpoint_is_one_line(main, mode, tmp_path, capsys):
    """A --weights that is not there ends in one line naming it, exit status 2, in every command that
    loads weights."""
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(SystemExit) as exit:
        main([*mode, "--weights", missing])
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f": error: {missing}" in err[0], err


@pytest.mark.parametrize("error", [RuntimeError("shapes cannot be multiplied (8x64 and 65x64)"),
                                   ValueError("too many values to unpack (expected 5)")])
def test_cli_a_broken_loop_keeps_its_traceback(monkeypatch, error):
    """An error inside the loop, torch's or Python's, is not turned into one line: the student who
    edited the loop needs the traceback that says where it broke."""
    def broken_forward(self, packed, cache):
        raise error

    monkeypatch.setattr(GPT, "forward_packed", broken_forward)
    with pytest.raises(type(error), match=str(error).split(" (")[0]):
        nanobatch.main(["--demo", "--quick", "--quiet"])


def test_cli_closed_pipe_ends_quietly(ran):
    """`python nanobatch.py --demo --quick | head -3`: the reader goes away after three lines, and the
    demo stops without a word, with the status a shell gives a program stopped by SIGPIPE."""
    status, stderr = ran
    assert status == 141 and stderr == "", stderr


def check_cut_table(stdout, run_name):
    """The figures of the run up to Ctrl-C: its table, named '(cut)', whose tokens count the requests
    still running and whose belt was full (the queue never emptied)."""
    assert "interrupted after" in stdout and f"{run_name} (cut)" in stdout, stdout[-2000:]
    rows = {line[:24].strip(): line[24:].split() for line in stdout.splitlines()}
    assert int(rows["generated tokens"][-1]) > 0 and int(rows["mean occupancy"][-1].rstrip("%")) >= 90, stdout


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_cli_ctrl_c_shows_the_figures_so_far(ran):
    """Ctrl-C a few steps into the disaggregated demo, as a terminal sends it: exit status 130, the
    table of the run up to there, and the prefill worker stopped and joined on the way out."""
    status, stdout, stderr = ran
    assert status == 130, stderr[-2000:]
    check_cut_table(stdout, "disaggregated")


def test_cli_ctrl_c_in_the_loop_shows_the_figures_so_far(monkeypatch, capsys):
    """The same in the plain demo, in this process: a KeyboardInterrupt (what Python makes of Ctrl-C)
    from the loop's fourth forward ends it with status 130 and the table of the run up to there. A
    child process, as the disaggregated case above starts, costs a second and a half, most of it
    importing torch: the signal's way into Python is that case's to prove, the loop's way out this."""
    forward_packed, n_forwards = GPT.forward_packed, [0]

    def interrupted(model, packed, cache):
        n_forwards[0] += 1
        if n_forwards[0] == 4:
            raise KeyboardInterrupt
        return forward_packed(model, packed, cache)

    monkeypatch.setattr(GPT, "forward_packed", interrupted)
    with pytest.raises(SystemExit) as exit:
        nanobatch.main(["--demo", "--quick"])
    assert exit.value.code == 130
    check_cut_table(capsys.readouterr().out, "continuous")
