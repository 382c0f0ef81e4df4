"""
The benchmark: continuous batching against static and sequential, timed, on seeded workloads.

    python tools/bench.py                    GPT-2 124M (random weights unless --weights): minutes on a CPU
    python tools/bench.py --quick            a tiny model, in seconds
    python tools/bench.py --svg FILE         and the belt of its runs drawn into FILE

1) The main workload: 16 requests per slot, all queued at once, prompts of 4-16 tokens, answers of
   long-tailed lengths, served continuous, static, and sequential (the engine with one slot), then
   as a perfectly packable workload (every answer of the mean length): the scheduler's efficiency.
2) Long prompts: a stream of short requests with four 600-token prompts among them, served with
   whole prompts, in chunks, and disaggregated, with their step durations.
3) A table of decode steps at 8 to 64 slots, of different lengths: what the attention cut buys.
"""
import argparse
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import model as model_py  # noqa: E402
import nanobatch  # noqa: E402
from belt_svg import checked_path, write_svg  # noqa: E402
from nanobatch import (Request, Running, check_runs, generate, long_tailed, pack_step, positive,  # noqa: E402
                       print_table, run_all, seeded_model, synchronize)


def bench(args):
    """Seeded workloads, timed: continuous against static and sequential (the engine with one
    slot), the scheduler's efficiency, and long prompts served whole, in chunks or disaggregated ->
    two groups of panels: continuous and static; the three long-prompt runs."""
    model = seeded_model(args)
    if args.call_cost is not None:  # what one more attention call costs on this device, in keys
        model_py.CALL_COST_IN_KEYS["cpu" if args.device.type == "cpu" else "gpu"] = args.call_cost
    if args.decode_steps:
        return attention_table(model)
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests = args.requests or 16 * args.slots  # a steady stream: many more requests than slots
    lengths = long_tailed(rng, n_requests, mean=16, cap=128)
    requests = [Request([rng.randrange(V) for _ in range(rng.randint(4, 16))], n,
                        arrival=int(i / args.arrival_rate) if args.arrival_rate else 0)
                for i, n in enumerate(lengths)]
    print(f"bench: {n_requests} requests, prompts of 4-16 tokens, answers of {min(lengths)}-{max(lengths)} "
          f"(mean {sum(lengths) / n_requests:.1f}) tokens, GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    runs = [("continuous", args.slots, "continuous", args.prefill_chunk, False),
            ("static", args.slots, "static", args.prefill_chunk, False),
            ("sequential", 1, "continuous", args.prefill_chunk, False)]
    runs += [("disaggregated", args.slots, "continuous", args.prefill_chunk, True)] if args.disaggregate else []
    warm_up(model, requests, runs, args)
    # eos_id=None: every answer runs to its drawn length, so real weights see the same workload.
    summaries, completions, _ = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    # The scheduler's efficiency: the same prompts with every answer of the mean length, so that a
    # belt of them never idles. While requests wait, continuous should come close to its rate.
    mean_length = round(sum(lengths) / n_requests)
    packable = [Request(r.prompt, mean_length, arrival=r.arrival) for r in requests]
    packable_run = ("packable", args.slots, "continuous", args.prefill_chunk, False)
    summaries.update(run_all(model, packable, [packable_run], args, eos_id=None, show_belt=False)[0])
    print_table(summaries, legend=True)
    cont, stat, seq, ideal = (summaries[name] for name in ("continuous", "static", "sequential", "packable"))
    print(f"\nsteps static / continuous:        {stat['steps'] / cont['steps']:.2f}x")
    print(f"tokens/s continuous / static:     {cont['tokens/s'] / stat['tokens/s']:.2f}x")
    print(f"tokens/s continuous / sequential: {cont['tokens/s'] / seq['tokens/s']:.2f}x")
    if args.disaggregate:
        print(f"tokens/s disaggregated / continuous: {summaries['disaggregated']['tokens/s'] / cont['tokens/s']:.2f}x")
    if cont["tokens/s while queued"] and ideal["tokens/s while queued"]:
        print(f"scheduler efficiency: while requests wait, continuous makes {cont['tokens/s while queued']:.1f} "
              f"tokens/s, {cont['tokens/s while queued'] / ideal['tokens/s while queued']:.0%} of the "
              f"{ideal['tokens/s while queued']:.1f} of a perfectly packable workload (every answer {mean_length} "
              f"tokens)")
    if args.quick:
        print("--quick: on a model this small a step's fixed cost (Python, and launching each of its "
              "operations) dominates what its rows cost, so these ratios are not GPT-2's: steps compare "
              "fairly, seconds do not. Without --quick: GPT-2 124M.")
    long_prompt_panels = long_prompts(model, args)
    if model.config.block_size >= 1024:
        short, long = (time_decode_steps(model, [[100] * args.slots], max_len, repeats=10)[0]
                       for max_len in (128, 1024))
        print(f"\ndecode step at position 100: {1e3 * short:.1f} ms with max_len=128, "
              f"{1e3 * long:.1f} ms with max_len=1024 ({long / short:.2f}x)")
    max_len = args.max_len or model.config.block_size
    config = model.config
    cache_bytes = config.n_layer * 2 * args.slots * max_len * config.n_embd * model.lm_head.weight.element_size()
    if args.device.type == "cuda":  # the loop's GPU, and the worker's where it has one of its own
        loop_gpu = model.lm_head.weight.device
        gpus = sorted({loop_gpu, nanobatch.prefill_device(loop_gpu)}, key=str)
        peak = ", ".join(f"{torch.cuda.max_memory_allocated(gpu) / 1e6:.0f} MB on {gpu}" for gpu in gpus)
    else:
        try:
            import resource  # Unix only
            peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB resident"
        except ImportError:
            peak = "not measured here"
    print(f"KV cache: {cache_bytes / 1e6:.1f} MB ({args.slots} slots x {max_len} positions), made once per "
          f"run; peak memory of the whole process so far: {peak}")
    if model.config.block_size >= 1024:
        attention_table(model)  # last: its belts of 64 slots hold a cache 8 times the size of 8 slots'
    shown = ["continuous", "static"] + ["disaggregated"] * args.disaggregate
    return [[(name, args.slots, completions[name], summaries[name], None) for name in shown], long_prompt_panels]


def long_prompts(model, args):
    """A steady stream of short requests with a few long prompts among them, served with whole
    prompts, in chunks, and disaggregated: a whole long prompt stalls every decoding request for one
    long step; chunks spread it over several; a prefill worker takes it off the belt -> their
    panels, each with its step durations."""
    V, rng, n_requests = model.config.vocab_size, random.Random(args.seed + 1), 8 * args.slots
    long_len = min(600, (args.max_len or model.config.block_size) - 70)  # room for the short answers beside it
    if long_len < 100:
        print(f"\nlong prompts: skipped, --max-len {args.max_len} leaves no room for a long prompt (170 at least)")
        return []
    lengths = long_tailed(rng, n_requests, mean=16, cap=64)
    is_long = [i % (n_requests // 4) == n_requests // 8 for i in range(n_requests)]  # 4 of them, spread out
    requests = [Request([rng.randrange(V) for _ in range(long_len if long else rng.randint(4, 16))], n,
                        arrival=i * 2)  # one every other step: about what the belt serves
                for i, (n, long) in enumerate(zip(lengths, is_long))]
    chunk = args.prefill_chunk or 64
    print(f"\nlong prompts: {n_requests} requests arriving one every other step, {sum(is_long)} of them with "
          f"{long_len}-token prompts, the rest 4-16; whole prompts, chunks of {chunk}, and disaggregated (whole "
          f"prompts on a prefill worker)")
    runs = [("whole prompts", args.slots, "continuous", None, False),
            (f"chunks of {chunk}", args.slots, "continuous", chunk, False),
            ("disaggregated", args.slots, "continuous", None, True)]
    warm_up(model, requests, runs, args)
    summaries, completions, reports = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    print_table(summaries)
    whole, chunked, disaggregated = summaries.values()
    print(f"\n{'against whole prompts':24}{'chunked':>18}{'disaggregated':>18}")
    for row, figure in [("TBT P99", lambda summary: summary["TBT P50/P99 (ms)"][1]),
                        ("TTFT P99", lambda summary: summary["TTFT P50/P99 (s)"][1]),
                        ("tokens/s", lambda summary: summary["tokens/s"])]:
        print(f"{row:24}" + "".join(f"{figure(summary) / figure(whole):>17.2f}x"
                                    for summary in (chunked, disaggregated)))
    return [(name, args.slots, completions[name], summaries[name], step_times(reports[name], completions[name]))
            for name, *_ in runs]


def warm_up(model, requests, runs, args):
    """Each run's way of serving once, untimed, on the workload's first two requests cut to two
    tokens: the first call of a kernel (cuBLAS's set-up, a second GPU's context and weights) must not
    be timed as the work's. The workload is checked first, so that bad input is one line."""
    check_runs(model, requests, runs, args, eos_id=None)
    for _, n_slots, policy, prefill_chunk, disaggregate in runs:
        generate(model, [replace(r, max_new_tokens=2) for r in requests[:2]], n_slots=n_slots, max_len=args.max_len,
                 eos_id=None, policy=policy, prefill_chunk=prefill_chunk, disaggregate=disaggregate)


def step_times(reports, completions):
    """[(step, seconds, whether a request decoded in it)]: a step decodes when it makes more tokens
    than first tokens."""
    first_tokens = Counter(c.first_token_step for c in completions if c is not None)
    return [(report.step, report.step_s, report.n_running > first_tokens[report.step]) for report in reports]


def time_decode_steps(model, belts, max_len, repeats=5):
    """Seconds for one forward of each belt, every slot decoding, slot s of belt b at position
    belts[b][s], in one cache of max_len positions: the median of `repeats` rounds, each round
    running every belt once, so that the machine's drift falls on all belts alike."""
    device, n_slots = model.lm_head.weight.device, len(belts[0])
    cache = model.new_cache(n_slots, max_len)
    steps = []
    for positions in belts:
        runs = [Running(slot, Request([0] * position, 2), slot, None, admit_step=0, n_cached=position, tokens=[0])
                for slot, position in enumerate(positions)]  # each about to feed its first answer token
        steps.append(pack_step([(run, [0]) for run in runs], [], n_slots, device)[0])
    seconds = [[] for _ in belts]
    with torch.no_grad():
        for _ in range(1 + repeats):  # the first round warms up
            for packed, times in zip(steps, seconds):
                start = time.perf_counter()
                model.forward_packed(packed, cache)
                synchronize(device)
                times.append(time.perf_counter() - start)
    return [statistics.median(times[1:]) for times in seconds]


def attention_table(model):
    """How a step's cost grows with the belt and its lengths: decode steps of 8 to 64 slots, every
    slot short; one long among short ones; lengths spread from 50 to 1000, against every slot at
    their mean (the same keys in all). Attention reads what the slots hold: one long slot costs
    about its own length, not every slot's padding to it."""
    def spread(n):
        return [50 + 950 * slot // (n - 1) for slot in range(n)]

    belts = {"all short (48)": lambda n: [48] * n, "one long (940)": lambda n: [940] + [48] * (n - 1),
             "spread 50-1000": spread, "at their mean": lambda n: [round(sum(spread(n)) / n)] * n}
    config, itemsize = model.config, model.lm_head.weight.element_size()
    cache_64_gb = 64 * 1024 * config.n_layer * 2 * config.n_embd * itemsize / 1e9  # keys and values, every layer
    print(f"\ndecode steps (ms, the median of 5 rounds of the four belts), every slot decoding, its length in keys "
          f"(64 slots hold a cache of {cache_64_gb:.1f} GB)")
    print(f"{'':10}" + "".join(f"{name:>16}" for name in belts) + f"{'long / short':>14}{'spread / mean':>15}")
    for n_slots in (8, 16, 32, 64):
        try:  # 64 slots of GPT-2 124M hold 4.8 GB in float32: more than some machines have free
            model_py.check_cache_fits(config, n_slots, 1024, model.lm_head.weight.device, model.lm_head.weight.dtype)
        except ValueError as e:
            print(f"{n_slots} slots: not timed, {e}")
            continue
        lengths = [[length - 1 for length in belt(n_slots)] for belt in belts.values()]  # positions
        ms = [1e3 * seconds for seconds in time_decode_steps(model, lengths, max_len=1024)]
        print(f"{f'{n_slots} slots':10}" + "".join(f"{t:>16.1f}" for t in ms) +
              f"{ms[1] / ms[0]:>13.2f}x{ms[2] / ms[3]:>14.2f}x", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/bench.py", description="continuous vs static vs sequential, timed")
    parser.add_argument("--requests", type=positive(int), metavar="N", help="the main workload's (16 per slot)")
    parser.add_argument("--arrival-rate", type=positive(float), metavar="R", help="requests per step (all at once)")
    parser.add_argument("--call-cost", type=int, metavar="KEYS", help="what one more attention call costs on "
                        "the device, in keys (model.CALL_COST_IN_KEYS: 150 on a CPU, 20,000 on a GPU)")
    parser.add_argument("--decode-steps", action="store_true", help="only the table of decode steps")
    parser.add_argument("--svg", metavar="FILE", type=checked_path, help="the belt drawn into FILE: continuous, "
                        "static (and disaggregated), then the long-prompt runs with their step durations")
    typed, args = nanobatch.parse_args(parser, argv, nanobatch.SERVING | {"quick", "weights"})
    ignored = ["slots", "max_len", "prefill_chunk", "disaggregate", "requests", "arrival_rate", "svg"]
    for name in [name for name in ignored if typed.get(name) not in (None, False)] if args.decode_steps else []:
        parser.error(f"--{name.replace('_', '-')} does not apply to --decode-steps, which times its own belts")
    groups = nanobatch.run_cli(bench, args)
    if args.svg:
        write_svg(args.svg, groups)


if __name__ == "__main__":
    main()
