"""
Latency against load, as the serving papers draw it: one seeded workload served by each policy at a sweep
of Poisson arrival rates; where each saturates, predicted and measured; capacity under a target; a burst.
The clock is steps (answers run to their drawn lengths): figures in steps are the same on any model.

    python tools/load.py --quick                      on the smallest GPT, in seconds: every figure in steps
    python tools/load.py                              GPT-2 124M: the sweep again, with what a step costs
    python tools/load.py --quick --svg docs/load.svg  and the picture: latency against rate, and the burst
"""
import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import nanobatch  # noqa: E402
from belt_svg import checked_path, tag  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from nanobatch import Request, generate, long_tailed, percentile, summarize  # noqa: E402

N_REQUESTS, MEAN_ANSWER = 200, 12  # Poisson arrivals; answers long-tailed as the bench's (its mean: 16)
MAX_LEN, BLOCK = 128, 16  # positions a slot reserves: the longest sequence (16 + 72 tokens) fits
CHUNK = 8  # chunked: prompt tokens a step, fewer than most prompts (4-16 tokens) hold
PAGED_ROWS = 4  # paged: rows per slot of the per-slot runs' memory (the bench's smaller factor)
RATES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)  # requests a step: static's knee to paged's
TTFT_TARGET = 10  # steps, for the P99 TTFT; why: docs/benchmarks.md, "Latency against load"
BURST_AT, N_STREAM = 100, 120  # the burst's step; the stream's requests (to step 375 at 0.32 a step)
# --quick: steps do not depend on the model, so the smallest GPT that runs the loop does (1 layer, 8
# wide, 512 tokens): 0.4 ms a step here, where nanobatch's TINY, with GPT-2's vocabulary, takes 2.9.
SMALLEST = GPTConfig(block_size=MAX_LEN, vocab_size=512, n_layer=1, n_head=1, n_embd=8)


# ---------------------------------------------------------------------------------------------
# The workload, the policies, one run


def draw(seed, n, vocab_size):
    """n requests: (prompt, answer length, arrival time at one request a step). The Poisson gaps are
    drawn once, so that at any rate the arrivals are these times / rate, in the same order."""
    rng = random.Random(seed)
    answers = long_tailed(rng, n, mean=MEAN_ANSWER, cap=MAX_LEN - 16)
    prompt_lengths = [rng.randint(4, 16) for _ in range(n)]
    times = accumulate([0.0] + [rng.expovariate(1.0) for _ in range(n - 1)])
    tokens = random.Random(seed + 1)  # apart, so that no draw above depends on the vocabulary
    return [([tokens.randrange(vocab_size) for _ in range(p)], n_new, t)
            for p, n_new, t in zip(prompt_lengths, answers, times)]


def arriving(workload, rate, at=None):
    """The workload as Requests arriving at `rate` a step (math.inf: all at step 0), or all at step `at`."""
    return [Request(prompt, n_new, arrival=int(t / rate) if at is None else at) for prompt, n_new, t in workload]


def policies(n_slots):
    """Name -> generate's keywords. Paged: the per-slot runs' memory, in blocks, for PAGED_ROWS x the rows."""
    return {"static": dict(n_slots=n_slots, policy="static"), "continuous": dict(n_slots=n_slots),
            "chunked": dict(n_slots=n_slots, prefill_chunk=CHUNK),
            "paged": dict(n_slots=PAGED_ROWS * n_slots, kv_blocks=n_slots * MAX_LEN // BLOCK, kv_block_size=BLOCK)}


def serve(model, requests, how, what):
    """One run -> (summarize's figures and this tool's, its step reports without logits, its
    completions). The clock jumps over an empty belt: tokens a step and occupancy count those steps."""
    reports, start = [], time.perf_counter()
    completions = generate(model, requests, max_len=MAX_LEN, eos_id=None, **how,
                           on_step=lambda report: reports.append(replace(report, logits=None, packed=None)))
    wall_s = time.perf_counter() - start
    print(f"load: {what}: {len(reports)} steps, {wall_s:.1f} s", file=sys.stderr, flush=True)  # progress
    summary, span = summarize(requests, completions, reports, wall_s), reports[-1].step + 1 - requests[0].arrival
    ttfts = [c.first_token_step - r.arrival + 1 for r, c in zip(requests, completions)]
    return {**summary, "latency": summary["latency P50/P99 (steps)"], "TTFT": summary["TTFT P50/P99 (steps)"],
            "tokens/step": summary["generated tokens"] / span, "queue": max(r.n_waiting for r in reports),
            "occupancy": sum(r.n_running + r.n_prefilling for r in reports) / (len(reports[0].belt) * span),
            "attainment": sum(t <= TTFT_TARGET for t in ttfts) / len(ttfts)}, reports, completions


# ---------------------------------------------------------------------------------------------
# 1) Saturation: predicted from the lengths, measured with every request queued at once


def predict(workload, n_slots):
    """Where each policy saturates, from the lengths -> {name: (requests a step, how)}. A request holds its
    slot for its answer's length in steps (a whole prompt samples in its own step); static, for its batch's longest."""
    prompts, answers = [len(p) for p, _, _ in workload], [n for _, n, _ in workload]
    mean, mean_prompt, rows = statistics.mean(answers), statistics.mean(prompts), PAGED_ROWS * n_slots
    longest = statistics.mean(max(answers[i:i + n_slots]) for i in range(0, len(answers), n_slots))
    waits = statistics.mean(math.ceil(p / CHUNK) - 1 for p in prompts)  # a chunked prompt's steps before it samples
    return {"static": (n_slots / longest, f"{n_slots} slots / {longest:.1f}, each batch's longest answer"),
            "continuous": (n_slots / mean, f"{n_slots} slots / {mean:.2f}, the mean answer"),
            "chunked": (min(n_slots / (mean + waits), CHUNK / mean_prompt), f"{n_slots} / ({mean:.2f} + {waits:.2f} "
                        f"steps before a first token); at most {CHUNK} / {mean_prompt:.2f}, budget / mean prompt"),
            "paged": (rows / mean, f"{rows} rows / {mean:.2f}, if its blocks hold them")}


def saturations(model, workload, n_slots, predicted):
    """Every request queued at step 0 -> {name: completions a step while requests still waited}, also
    printed over all the steps: the belt's last steps, emptying, are no part of a steady stream."""
    measured = {}
    print(f"\n{'saturation':12}{'predicted':>10}{'measured':>10}{'all steps':>10}  (requests a step) predicted as")
    for name, how in policies(n_slots).items():
        _, reports, _ = serve(model, arriving(workload, math.inf), how, f"{name}, every request at once")
        queued = [report for report in reports if report.n_waiting]
        measured[name] = sum(len(report.finished) for report in queued) / len(queued)
        print(f"{name:12}{predicted[name][0]:>10.3f}{measured[name]:>10.3f}{len(workload) / len(reports):>10.3f}  "
              f"{predicted[name][1]}")
    print(f"continuous / static: {predicted['continuous'][0] / predicted['static'][0]:.2f}x predicted, "
          f"{measured['continuous'] / measured['static']:.2f}x measured")
    return measured


# ---------------------------------------------------------------------------------------------
# 2) The sweep, 3) capacity under the target, 4) a burst into a steady stream


def sweep(model, workload, n_slots, rates, seconds):
    """Each policy at its rates ({name: [requests a step]}) -> {name: [(rate, figures)]}, printed as they come."""
    print(f"\n{'policy':12}{'rate':>6}{'latency P50/P99':>16}{'TTFT P50/P99':>14}{'tokens/step':>12}{'occupancy':>10}"
          f"{'queue':>6}{f'TTFT<={TTFT_TARGET}':>10}" + (f"{'s/step':>8}{'req/s':>7}{'latency (s)':>13}"
                                                      f"{'TTFT P99 s':>11}{'TBT P99 ms':>11}" if seconds else ""))
    curves = {name: [] for name in rates}
    for name, policy_rates in rates.items():
        for rate in policy_rates:
            f = serve(model, arriving(workload, rate), policies(n_slots)[name], f"{name} at {rate} a step")[0]
            curves[name].append((rate, f))
            step_s = f["wall time (s)"] / f["steps"]  # requests a step / seconds a step: requests a second
            print(f"{name:12}{rate:>6.2f}{'%d / %d' % f['latency']:>16}{'%d / %d' % f['TTFT']:>14}"
                  f"{f['tokens/step']:>12.2f}{f['occupancy']:>10.0%}{f['queue']:>6}{f['attainment']:>10.0%}" +
                  (f"{step_s:>8.3f}{rate / step_s:>7.2f}{'%.1f / %.1f' % f['latency P50/P99 (s)']:>13}"
                   f"{f['TTFT P50/P99 (s)'][1]:>11.1f}{f['TBT P50/P99 (ms)'][1]:>11.0f}" if seconds else ""))
    return curves


def capacity(model, workload, how, curve, name, n_probes=5):
    """The highest rate whose P99 TTFT meets TTFT_TARGET, bisected (Sarathi-Serve's search) in the log of the rate
    to 2% -> (the rate, the probes' (rate, figures)); None where no two rates of the sweep bracket it."""
    met = [rate for rate, f in curve if f["TTFT"][1] <= TTFT_TARGET]
    if not met or met[-1] == curve[-1][0]:
        return None, []  # it misses the target at the sweep's lowest rate, or meets it at the highest
    low, high, probes = met[-1], curve[len(met)][0], []
    for _ in range(n_probes):
        middle = math.sqrt(low * high)
        probes.append((middle, serve(model, arriving(workload, middle), how, f"{name} at {middle:.3f}, bisecting")[0]))
        low, high = (middle, high) if probes[-1][1]["TTFT"][1] <= TTFT_TARGET else (low, middle)
    return low, probes


def burst(model, workload, n_slots, seed):
    """The stream: the workload's first N_STREAM requests at half of continuous's predicted saturation,
    holding a share rho of about half the slot-steps; at BURST_AT, 3 x n_slots more at once. Predicted:
    their tokens go through the free share in tokens / (n_slots x (1 - rho)) steps -> (that, {policy:
    ({step: (queue, batch)}, the burst's TTFTs, steps to no queue (None: not while the stream lasts),
    steps to its last token)})."""
    rate = n_slots / statistics.mean(n for _, n, _ in workload) / 2
    stream, extra = workload[:N_STREAM], draw(seed + 2, 3 * n_slots, SMALLEST.vocab_size)
    rho, tokens = rate * statistics.mean(n for _, n, _ in stream) / n_slots, sum(n for _, n, _ in extra)
    requests, runs = arriving(stream, rate) + arriving(extra, rate, at=BURST_AT), {}
    predicted = tokens / (n_slots * (1 - rho))
    print(f"\nthe burst: a stream at {rate:.2f} a step (rho = {rho:.2f}), {len(extra)} more at step {BURST_AT}, "
          f"{tokens} tokens: predicted done in {tokens} / ({n_slots} x (1 - {rho:.2f})) = {predicted:.0f} steps")
    for name in ("static", "continuous"):
        _, reports, completions = serve(model, requests, policies(n_slots)[name], f"the burst, {name}")
        ttfts = [c.first_token_step - BURST_AT + 1 for c in completions[N_STREAM:]]
        done = max(c.finish_step for c in completions[N_STREAM:]) - BURST_AT + 1
        drained = next((r.step - BURST_AT for r in reports if BURST_AT <= r.step <= requests[N_STREAM - 1].arrival
                        and not r.n_waiting), None)
        runs[name] = ({r.step: (r.n_waiting, r.n_running + r.n_prefilling) for r in reports}, ttfts, drained, done)
        # The stream's waits for a first token before the burst, and after its last token: back to the floor?
        waits = [(r.arrival, c.first_token_step - r.arrival + 1) for r, c in zip(requests, completions[:N_STREAM])]
        before, after = [t for a, t in waits if a < BURST_AT], [t for a, t in waits if a > BURST_AT + done]
        print(f"{name:12}the burst's TTFT P50/max {percentile(ttfts, 50)} / {max(ttfts)} steps, its last token {done} "
              f"steps on; no queue {'%s steps on' % drained if drained else 'before the stream ends'}; the stream's "
              f"TTFT P50/P99 {percentile(before, 50)} / {percentile(before, 99)} before it" +
              (f", {percentile(after, 50)} / {percentile(after, 99)} after" if after else ""))
    print(f"\n{'step':>6}{'queue':>14}{'batch':>14}{'burst waiting':>15}   (static / continuous; no token yet)")
    for step in range(BURST_AT - 10, BURST_AT + round(2 * predicted) + 1, 10):  # queue, batch, burst without a token
        (q0, b0, w0), (q1, b1, w1) = (run[0].get(step, (0, 0)) + (sum(BURST_AT + t - 1 > step for t in run[1]),)
                                      for run in runs.values())
        print(f"{step:>6}{f'{q0} / {q1}':>14}{f'{b0} / {b1}':>14}{f'{w0} / {w1}':>15}")
    return predicted, runs


# ---------------------------------------------------------------------------------------------
# The picture, drawn as tools/belt_svg.py draws the belt: latency against rate; the burst's queue

COLOURS = {"static": "#c0392b", "continuous": "#2471a3", "chunked": "#27ae60", "paged": "#8e44ad"}
WIDTHS = {"static": 2, "continuous": 4.5, "chunked": 2.5, "paged": 1.2}  # px: lines that overlap show nested
PANEL_W, PANEL_H, TOP, LEFTS = 500, 330, 104, (70, 680)  # px: each plot, where the plots begin, and each panel


def axes(x0, to_x, x_ticks, to_y, y_ticks, x_label, y_label):
    """A panel's frame from x0, a grid line and a label at each tick (to_x, to_y: a value -> px)."""
    parts = [tag("rect", x=x0, y=TOP, width=PANEL_W, height=PANEL_H, fill="none", stroke="#999"),
             tag("text", x_label, x=x0 + PANEL_W / 2, y=TOP + PANEL_H + 34, font_size=12, text_anchor="middle"),
             tag("text", y_label, x=x0, y=TOP - 8, font_size=12)]
    for v in x_ticks:
        parts += [tag("line", x1=to_x(v), x2=to_x(v), y1=TOP, y2=TOP + PANEL_H, stroke="#eee"),
                  tag("text", f"{v:g}", x=to_x(v), y=TOP + PANEL_H + 16, font_size=11, text_anchor="middle")]
    for v in y_ticks:
        parts += [tag("line", x1=x0, x2=x0 + PANEL_W, y1=to_y(v), y2=to_y(v), stroke="#eee"),
                  tag("text", f"{v:g}", x=x0 - 6, y=to_y(v) + 4, font_size=11, text_anchor="end")]
    return parts


def load_svg(curves, predicted, measured, n_slots, burst_runs, predicted_drain):
    """Left: P50 and P99 latency against rate, log-log, a line per policy, its saturation measured and predicted.
    Right: the burst's queue by step, over its predicted drain (shaded), and the step of its last token."""
    lo, hi, floor, ceiling = RATES[0], max(rate for curve in curves.values() for rate, _ in curve), 5, 1000
    rate_x = lambda rate: LEFTS[0] + PANEL_W * math.log(rate / lo) / math.log(hi / lo)  # noqa: E731
    steps_y = lambda n: TOP + PANEL_H * math.log(ceiling / min(max(n, floor), ceiling), ceiling / floor)  # noqa: E731
    parts = axes(LEFTS[0], rate_x, [v for v in (0.05, 0.1, 0.2, 0.5, 1, 2, 5) if v <= hi], steps_y,
                 (5, 10, 20, 50, 100, 200, 500, 1000), "arrival rate, requests a step (log)", "latency, steps (log)")
    for name, curve in curves.items():
        for q, dash in ((0, "8,5"), (1, None)):
            points = " ".join(f"{rate_x(rate):.1f},{steps_y(f['latency'][q]):.1f}" for rate, f in curve if rate >= lo)
            parts.append(tag("polyline", points=points, fill="none", stroke=COLOURS[name], stroke_width=WIDTHS[name],
                             stroke_dasharray=dash, stroke_opacity=0.85, class_="latency", data_policy=name,
                             data_percentile=(50, 99)[q]))
        x, p, y = rate_x(measured[name]), rate_x(predicted[name][0]), TOP + PANEL_H
        parts += [tag("line", x1=x, x2=x, y1=TOP, y2=y, stroke=COLOURS[name], stroke_dasharray="2,3",
                      class_="saturation", data_policy=name, data_measured=f"{measured[name]:.3f}"),
                  tag("polygon", points=f"{p:.1f},{y - 8} {p - 5:.1f},{y} {p + 5:.1f},{y}", fill=COLOURS[name],
                      class_="predicted", data_policy=name, data_rate=f"{predicted[name][0]:.3f}")]
    first, last = BURST_AT - 20, BURST_AT + round(3 * predicted_drain)
    queues = [queue for steps, *_ in burst_runs.values() for step, (queue, _) in steps.items() if step <= last]
    top_queue = 10 * math.ceil(max(queues) / 10) + 10  # the axis: the longest queue rounded up, and room
    step_x = lambda step: LEFTS[1] + PANEL_W * (step - first) / (last - first)  # noqa: E731
    queue_y = lambda queue: TOP + PANEL_H * (1 - queue / top_queue)  # noqa: E731
    parts += axes(LEFTS[1], step_x, range(first + 20, last + 1, 50), queue_y, range(0, top_queue + 1, 10), "step",
                  f"the burst: requests waiting for a slot; {3 * n_slots} more arrive at step {BURST_AT}")
    parts += [tag("rect", x=step_x(BURST_AT), y=TOP, width=step_x(BURST_AT + predicted_drain) - step_x(BURST_AT),
                  height=PANEL_H, fill="#f3e9c6", class_="predicted-drain", data_steps=f"{predicted_drain:.0f}"),
              tag("text", f"predicted: the burst's tokens done in {predicted_drain:.0f} steps", x=step_x(BURST_AT) + 4,
                  y=TOP + 16, font_size=11, fill="#7a6a2a")]
    for name, (steps, _, drained, done) in burst_runs.items():
        points = " ".join(f"{step_x(s):.1f},{queue_y(steps.get(s, (0, 0))[0]):.1f}" for s in range(first, last + 1))
        x = step_x(min(BURST_AT + done - 1, last))  # the burst's last token, measured
        parts += [tag("polyline", points=points, fill="none", stroke=COLOURS[name], stroke_width=2, class_="queue",
                      data_policy=name, data_drained=drained or "never"),
                  tag("line", x1=x, x2=x, y1=TOP + 24, y2=TOP + PANEL_H, stroke=COLOURS[name], stroke_width=2,
                      stroke_dasharray="2,3", class_="burst-done", data_policy=name, data_steps=done)]
    parts += [tag("text", f"Latency against load, and a burst: {n_slots} slots, {N_REQUESTS} Poisson arrivals, answers "
                  f"of mean {MEAN_ANSWER} tokens, steps as the clock", x=8, y=22, font_size=15, font_weight="bold"),
              tag("text", "Left: solid, P99; dashed, P50; dotted, where each saturates; a triangle, predicted. Right: "
                  "dotted, the burst's last token (static cannot hold even the stream)", x=8, y=72, font_size=12)]
    for k, name in enumerate(COLOURS):  # the legend: a line per policy, and where it saturates
        parts += [tag("line", x1=8 + 300 * k, x2=32 + 300 * k, y1=46, y2=46, stroke=COLOURS[name], stroke_width=3),
                  tag("text", f"{name}: saturates at {measured[name]:.2f} ({predicted[name][0]:.2f} predicted)",
                      x=38 + 300 * k, y=50, font_size=12)]
    return tag("svg", "".join(parts), xmlns="http://www.w3.org/2000/svg", width=1200, height=TOP + PANEL_H + 46,
               font_family="sans-serif", style="background: white")



def load(args):
    """Everything above, in order: on the smallest GPT with --quick, else on GPT-2 124M."""
    if args.quick:  # its weights change no step; it gains nothing from a second thread, which only spins
        torch.set_num_threads(1)
    model = GPT(SMALLEST).eval() if args.quick else nanobatch.seeded_model(args)
    workload = draw(args.seed, N_REQUESTS, model.config.vocab_size)
    answers = [n for _, n, _ in workload]
    print(f"load: {N_REQUESTS} requests, prompts of 4-16 tokens, answers of {min(answers)}-{max(answers)} (mean "
          f"{statistics.mean(answers):.2f}); {args.slots} slots; GPT of {model.config.n_layer} x {model.config.n_embd}")
    predicted = predict(workload, args.slots)
    measured = saturations(model, workload, args.slots, predicted)
    # Each policy from a 16th of its saturation to the first rate past twice it: beyond, latency tracks the backlog.
    rates = {name: [r for r in RATES[:1 + sum(r <= 2 * rate for r in RATES)] if r >= rate / 16]
             for name, rate in measured.items()}
    curves = sweep(model, workload, args.slots, rates, seconds=not args.quick)
    if not args.quick:
        return print("\ncapacity and the burst: steps only, the same on any model: python tools/load.py --quick")
    print(f"\ncapacity: the highest rate whose P99 TTFT is at most {TTFT_TARGET} steps, in requests a step")
    for name, how in policies(args.slots).items():
        found, probes = capacity(model, workload, how, curves[name], name)
        curves[name] = sorted(curves[name] + probes)  # the probes sharpen the curve at its knee
        print(f"{name:12}{found:>7.3f}, {found / measured[name]:.0%} of its saturation" if found else
              f"{name:12}      -  (the sweep brackets none)")
    drain, runs = burst(model, workload, args.slots, args.seed)
    if args.svg:
        Path(args.svg).write_text(load_svg(curves, predicted, measured, args.slots, runs, drain))
        print(f"\nthe picture: {args.svg}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/load.py", description="latency against load, and a burst")
    parser.add_argument("--svg", metavar="FILE", type=checked_path, help="the picture, drawn into FILE (--quick)")
    _, args = nanobatch.parse_args(parser, argv, {"quick", "weights", "slots", "seed", "device", "dtype"})
    if args.svg and not args.quick:
        parser.error("--svg goes with --quick: the picture is in steps, the same on any model")
    nanobatch.run_cli(load, args)


if __name__ == "__main__":
    main()
