"""
tools/load.py, latency against load: its saturations against the arithmetic that predicts them, the
knee, the burst, the picture, and Lab 10. Steps are the clock and every answer runs to its drawn length,
so the tool's smallest GPT gives the figures GPT-2 gives: these tests run the default workload (200
requests, 8 slots) through the tool's own functions, in a few seconds.
"""
import re

import pytest

import load  # tools/, put on the path by tests.common
from tests.common import REPO, quietly, saturated
from tests.test_labs import commands, lab, says


@pytest.fixture(scope="module")
def at_16(smallest, workload):
    return saturated(smallest, workload, 16)


@pytest.fixture(scope="module")
def burst(smallest, workload):
    return quietly(load.burst, smallest, workload, 8, 0)


def test_the_workload_is_one_draw_scaled_by_the_rate(workload):
    """One seeded draw: at any rate the arrivals are the same times / rate, so a request never comes
    later at a higher rate; the lengths do not depend on the vocabulary (the tokens are drawn apart)."""
    slow, fast = (load.arriving(workload, rate) for rate in (0.1, 0.4))
    assert all(f.arrival <= s.arrival for s, f in zip(slow, fast)) and slow[-1].arrival > 3 * fast[-1].arrival
    assert [(r.prompt, r.max_new_tokens) for r in slow] == [(r.prompt, r.max_new_tokens) for r in fast]
    other = load.draw(0, load.N_REQUESTS, 50257)
    assert [(len(p), n, t) for p, n, t in other] == [(len(p), n, t) for p, n, t in workload]
    assert {r.arrival for r in load.arriving(workload, float("inf"))} == {0}
    answers = [n for _, n, _ in workload]
    assert (min(answers), max(answers), round(sum(answers) / len(answers), 2)) == (1, 72, 12.49)


def test_each_saturation_lies_near_its_prediction(at_8, at_16):
    """Measured with every request queued at once, over the steps that left some waiting, each policy
    completes within 10% of what the lengths predict, at 8 slots and 16 (the issue asked 25%). Over all
    the steps it completes fewer: the last steps, the belt emptying, are no part of a steady stream."""
    for predicted, measured, printed in (at_8, at_16):
        for name, (rate, _) in predicted.items():
            assert abs(measured[name] / rate - 1) < 0.10, f"{name}: measured {measured[name]:.3f}, predicted {rate:.3f}"
        all_steps = {line.split()[0]: float(line.split()[3]) for line in printed.splitlines()[2:6]}
        assert all(all_steps[name] <= measured[name] for name in measured)


def test_continuous_is_three_times_static_only_with_more_slots(at_8, at_16):
    """The issue expected continuous to saturate at 3x static's rate or more. It does not at 8 slots:
    static holds a batch for its longest answer, and the longest of 8 long-tailed answers averages about
    (1 + 1/2 + ... + 1/8) = 2.72 times the mean for an exponential (here 35.3 / 12.49 = 2.83), so the
    ratio is about that, 2.78 measured. The longest of 16 is about 3.38 times the mean: with 16 slots
    the ratio is above 3."""
    ratios = [measured["continuous"] / measured["static"] for _, measured, _ in (at_8, at_16)]
    predicted = [p["continuous"][0] / p["static"][0] for p, _, _ in (at_8, at_16)]
    assert ratios[0] < 3 <= ratios[1], ratios
    assert all(abs(r / p - 1) < 0.05 for r, p in zip(ratios, predicted)), (ratios, predicted)
    harmonic = [sum(1 / k for k in range(1, n + 1)) for n in (8, 16)]
    assert all(abs(p / h - 1) < 0.1 for p, h in zip(predicted, harmonic)), (predicted, harmonic)


def test_the_queue_grows_past_saturation(at_8, knee):
    """The knee: at 0.4 a step, below continuous's saturation (0.636) and above static's (0.229),
    continuous keeps its median latency at the unloaded 9 steps and a short queue, while static's
    queue grows to 79; at 0.8, past its saturation, continuous's queue grows too."""
    curves, _ = knee
    (static, _), (below, above) = ([f for _, f in curves[name]] for name in ("static", "continuous"))  # at 0.4, 0.8
    _, measured, _ = at_8
    assert measured["static"] < 0.4 < measured["continuous"] < 0.8
    assert below["latency"][0] == 9 and below["queue"] < 8 < 4 * 8 <= above["queue"], (below["queue"], above["queue"])
    assert static["queue"] > 8 * below["queue"]


def test_a_burst_drains_as_predicted_and_the_stream_returns_to_its_floor(burst):
    """The stream holds about half the slots; 24 more requests arrive at step 100. Continuous makes
    the burst's last token within 25% of tokens / (n_slots x (1 - rho)), its queue empties before
    that, and the stream's first tokens come as fast after the burst as before. Static cannot hold
    even the stream (0.32 a step, past its 0.229): its queue is never empty while the stream lasts."""
    (predicted, runs), printed = burst
    steps, ttfts, drained, done = runs["continuous"]
    assert abs(done / predicted - 1) < 0.25, (done, predicted)
    assert drained is not None and drained < done and max(ttfts) < drained
    p50, p99, p50_after, p99_after = map(int, re.search(r"continuous .*TTFT P50/P99 (\d+) / (\d+) before it, "
                                                         r"(\d+) / (\d+) after", printed).groups())
    assert p50_after == p50 and p99_after <= p99, "the stream's first tokens did not come back to their floor"
    assert runs["static"][2] is None and min(runs["static"][1]) > max(ttfts)
    rows = [line.split() for line in printed.splitlines() if re.match(r" +\d+ +\d+ / \d+ ", line)]
    assert [int(row[0]) for row in rows] == list(range(90, 100 + round(2 * predicted) + 1, 10))
    assert all(int(row[3]) == steps.get(int(row[0]), (0, 0))[0] for row in rows), "the table's queue is not the run's"


def test_the_picture_is_drawn_from_the_runs(at_8, burst):
    """docs/load.svg is what the tool draws: the saturations it marks, measured and predicted, and the
    burst's queues, are this code's (re-draw it with the command in its README paragraph), and a line
    per policy and percentile, each point on the log scales, goes up with the rate once queues form."""
    predicted, measured, _ = at_8
    (drain, runs), _ = burst
    svg = (REPO / "docs" / "load.svg").read_text()
    marked = dict(re.findall(r'class="saturation" data-policy="(\w+)" data-measured="([\d.]+)"', svg))
    assert marked == {name: f"{rate:.3f}" for name, rate in measured.items()}
    triangles = dict(re.findall(r'class="predicted" data-policy="(\w+)" data-rate="([\d.]+)"', svg))
    assert triangles == {name: f"{rate:.3f}" for name, (rate, _) in predicted.items()}
    assert re.search(rf'class="predicted-drain" data-steps="{drain:.0f}"', svg)
    for name, (_, _, drained, done) in runs.items():
        assert f'class="queue" data-policy="{name}" data-drained="{drained or "never"}"' in svg
        assert f'class="burst-done" data-policy="{name}" data-steps="{done}"' in svg
    lines = re.findall(r'<polyline points="([^"]+)"[^>]*class="latency" data-policy="(\w+)" data-percentile="(\d+)"', svg)
    assert sorted((name, q) for _, name, q in lines) == sorted((name, q) for name in measured for q in ("50", "99"))
    for points, name, _ in lines:
        ys = [float(point.split(",")[1]) for point in points.split()]
        assert ys[-1] < ys[0], f"{name}: latency does not rise with the rate"  # y grows downward


def test_the_readme_states_what_the_tool_measures(at_8, knee, burst):
    """The README's paragraph under its measured numbers: its figures are the runs' (steps: any machine)."""
    text = " ".join((REPO / "README.md").read_text().split())
    predicted, measured, _ = at_8
    (drain, runs), _ = burst
    below = knee[0]["continuous"][0][1]
    figures = (f"static saturates at {measured['static']:.3f} requests a step and continuous at "
               f"{measured['continuous']:.3f}, as their lengths predict ({predicted['static'][0]:.3f}, "
               f"{predicted['continuous'][0]:.3f}): {measured['continuous'] / measured['static']:.2f}x, not 3x. "
               f"Below it continuous's median latency stays {below['latency'][0]} steps; a burst of "
               f"{len(runs['continuous'][1])} is done in {runs['continuous'][3]} steps (predicted: {drain:.0f})")
    assert figures in text, f"the README should say: {figures}"


def test_the_command_line_refuses_what_does_not_apply(monkeypatch, capsys):
    """--svg draws steps only, with --quick; --weights applies to GPT-2 124M, not to --quick."""
    monkeypatch.setattr(load.nanobatch, "run_cli", lambda run, args: None)
    for argv, message in ([["--svg", "/tmp/load.svg"], "--svg goes with --quick"],
                          [["--quick", "--weights", "gpt2"], "--weights does not apply to --quick"]):
        with pytest.raises(SystemExit):
            load.main(argv)
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Lab 10: find the knee


def test_lab_10_find_the_knee(at_8, at_16, knee, workload):
    """Lab 10's excerpt is what its commands print, line for line (the tool's saturation tables at 8
    and 16 slots, and the sweep's lines it shows: none holds a time), and every figure of its prose is
    the workload's, the arithmetic's or the runs'."""
    section = lab(10)
    [excerpt] = re.findall(r"```text\n(.*?)```", section, re.S)
    printed = set("\n".join([at_8[2], at_16[2], knee[1]]).splitlines())
    missing = [line for line in excerpt.splitlines() if line not in printed]
    assert not missing, "lines of Lab 10's excerpt that the tool did not print:\n" + "\n".join(missing)
    assert [argv[2:] for argv in commands(section)] == [["--quick"], ["--quick", "--slots", "16"]]
    (predicted, measured, _), (predicted_16, measured_16, _) = at_8, at_16
    answers, prompts = [n for _, n, _ in workload], [len(p) for p, _, _ in workload]
    mean = round(sum(answers) / len(answers), 2)
    says(section, r"tools/load.py serves (\d+) requests arriving as a Poisson stream, answers of (\d+) to (\d+) "
         r"tokens, mean ([\d.]+),", load.N_REQUESTS, min(answers), max(answers), mean)
    harmonic = [round(sum(1 / k for k in range(1, n + 1)), 2) for n in (8, 16)]
    says(section, r"How many requests a step do (\d+) slots complete", 8)
    says(section, r"the longest of (\d+) such answers is about the mean x \(1 \+ 1/2 \+ \.\.\. \+ 1/(\d+)\), "
         r"([\d.]+) times it", 8, 8, harmonic[0])
    says(section, r"Is continuous's (\d+) times it\? \(3\) At ([\d.]+) a step", 3, 0.4)
    says(section, r"With --slots (\d+)\? And chunked, at most (\d+) prompt tokens a step", 16, load.CHUNK)
    says(section, r"(\d+) / ([\d.]+) = ([\d.]+) a step, measured ([\d.]+) \(", 8, mean,
         round(predicted["continuous"][0], 3), round(measured["continuous"], 3))
    says(section, r"over all the steps ([\d.]+),", float(re.search(r"^continuous +\S+ +\S+ +(\S+)", at_8[2], re.M)[1]))
    longest = sum(max(answers[i:i + 8]) for i in range(0, len(answers), 8)) / (len(answers) / 8)
    says(section, r"the longest of each batch of (\d+) averages ([\d.]+) here, ([\d.]+) a step, measured ([\d.]+)\.",
         8, round(longest, 1), round(predicted["static"][0], 3), round(measured["static"], 3))
    ratio, ratio_16 = (round(m["continuous"] / m["static"], 2) for m in (measured, measured_16))
    says(section, r"So continuous makes ([\d.]+)x static's, not (\d+)x", ratio, 3)
    static_at, (below, above) = ([f for _, f in knee[0][name]] for name in ("static", "continuous"))
    says(section, r"At ([\d.]+) static's queue reaches (\d+) and its median request takes (\d+) steps; "
         r"continuous's takes (\d+), as unloaded, until past its own saturation \(([\d.]+)\)", 0.4,
         static_at[0]["queue"], static_at[0]["latency"][0], below["latency"][0], 0.8)
    assert measured["static"] < 0.4 < measured["continuous"] < 0.8
    says(section, r"static gains ([\d.]+)x \(the longest of (\d+) is ([\d.]+)x the mean\): at (\d+) slots, "
         r"([\d.]+)x", round(measured_16["static"] / measured["static"], 1), 16, harmonic[1], 16, ratio_16)
    assert abs(measured_16["continuous"] / measured["continuous"] - 2) < 0.1, "continuous did not double"
    says(section, r"Chunked stops near ([\d.]+): plan_step feeds (\d+) prompt tokens a step, at most (\d+) / "
         r"([\d.]+) prompts", round(measured_16["chunked"], 2), load.CHUNK, load.CHUNK,
         round(sum(prompts) / len(prompts), 2))
