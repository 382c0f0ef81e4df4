"""
The benchmark: continuous batching against static and sequential, timed, on seeded workloads.

    python tools/bench.py                    GPT-2 124M (random weights unless --weights): minutes on a CPU
    python tools/bench.py --quick            a tiny model, in seconds
    python tools/bench.py --svg FILE         and the belt of its runs drawn into FILE
    python tools/bench.py --paged            only section 4, paged attention: a few minutes on a CPU
    python tools/bench.py --prefix           only section 5, prefix caching: a few minutes on a CPU
    python tools/bench.py --paged-step       only section 6, a paged decode step at 64 rows: a minute or two
    python tools/bench.py --roofline         only section 7, a decode step against its matrix products: minutes

1) The main workload: 16 requests per slot, all queued at once, prompts of 4-16 tokens, answers of
   long-tailed lengths, served continuous, static, and sequential (the engine with one slot), then
   as a perfectly packable workload (every answer of the mean length): the scheduler's efficiency.
2) Long prompts: a stream of short requests with four 600-token prompts among them, served with
   whole prompts, in chunks, and disaggregated, with their step durations.
3) A table of decode steps at 8 to 64 slots, of different lengths: what the attention cut buys.
4) --paged, on its own (it would add more than half again to the run above): per slot against paged
   in the same KV memory, on the main workload (12 requests a slot, answers of at most 64 tokens) and
   on the demo's, and the block tables' price.
5) --prefix, on its own: requests that share a system prompt, with the prefix cache and without, in
   the same pool, arriving in a stream and all at once.
6) --paged-step, on its own: a decode step of 64 rows of short sequences, paged against per slot, timed
   in whole runs of generate and step by step: the two ways of measuring it side by side.
7) --roofline, on its own: generate's decode step at 1 to 64 rows, the default path and the batch-invariant one
   alternated, against the step's matrix products alone (its floor), and where the rest of the step goes.
"""
import argparse
import math
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import model as model_py  # noqa: E402
from model import GPT  # noqa: E402
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
    if args.paged:
        return paged_attention(model, args)
    if args.prefix:
        return prefix_caching(model, args)
    if args.paged_step:
        return paged_step(model, args)
    if args.roofline:
        return roofline(model, args)
    requests = main_workload(model, args, args.slots)
    runs = [("continuous", args.slots, "continuous", args.prefill_chunk, False, None, False),
            ("static", args.slots, "static", args.prefill_chunk, False, None, False),
            ("sequential", 1, "continuous", args.prefill_chunk, False, None, False)]
    if args.disaggregate:
        runs.append(("disaggregated", args.slots, "continuous", args.prefill_chunk, True, None, False))
    warm_up(model, requests, runs, args)
    # eos_id=None: every answer runs to its drawn length, so real weights see the same workload.
    summaries, _, reports = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    # The scheduler's efficiency: the same prompts with every answer of the mean length, so that a
    # belt of them never idles. While requests wait, continuous should come close to its rate.
    mean_length = round(sum(r.max_new_tokens for r in requests) / len(requests))
    packable = [Request(r.prompt, mean_length, arrival=r.arrival) for r in requests]
    packable_run = ("packable", args.slots, "continuous", args.prefill_chunk, False, None, False)
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
    return [[(name, args.slots, reports[name], summaries[name], None) for name in shown], long_prompt_panels]


def main_workload(model, args, n_slots, per_slot=16, cap=128):
    """The main workload, printed in a line: per_slot requests a slot (or --requests), all queued at step 0
    (or --arrival-rate), prompts of 4-16 tokens, answers of long-tailed lengths, mean 16, at most cap."""
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests = args.requests or per_slot * n_slots  # a steady stream: many more requests than slots
    lengths = long_tailed(rng, n_requests, mean=16, cap=cap)
    requests = [Request([rng.randrange(V) for _ in range(rng.randint(4, 16))], n,
                        arrival=int(i / args.arrival_rate) if args.arrival_rate else 0)
                for i, n in enumerate(lengths)]
    print(f"bench: {n_requests} requests, prompts of 4-16 tokens, answers of {min(lengths)}-{max(lengths)} "
          f"(mean {sum(lengths) / n_requests:.1f}) tokens, GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    return requests


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
    runs = [("whole prompts", args.slots, "continuous", None, False, None, False),
            (f"chunks of {chunk}", args.slots, "continuous", chunk, False, None, False),
            ("disaggregated", args.slots, "continuous", None, True, None, False)]
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
    return [(name, args.slots, reports[name], summaries[name], step_times(reports[name], completions[name]))
            for name, *_ in runs]


def warm_up(model, requests, runs, args):
    """Each run's way of serving once, untimed, on the workload's first two requests cut to two
    tokens: the first call of a kernel (cuBLAS's set-up, a second GPU's context and weights) must not
    be timed as the work's. The workload is checked first, so that bad input is one line."""
    check_runs(model, requests, runs, args, eos_id=None)
    for _, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache in runs:
        generate(model, [replace(r, max_new_tokens=2) for r in requests[:2]], n_slots=n_slots, max_len=args.max_len,
                 eos_id=None, policy=policy, prefill_chunk=prefill_chunk, disaggregate=disaggregate,
                 kv_blocks=kv_blocks, kv_block_size=args.kv_block_size, prefix_cache=prefix_cache)


def step_times(reports, completions):
    """[(step, seconds, whether a request decoded in it)]: a step decodes when it makes more tokens
    than first tokens."""
    first_tokens = Counter(c.first_token_step for c in completions if c is not None)
    return [(report.step, report.step_s, report.n_running > first_tokens[report.step]) for report in reports]


def decode_step(model, positions, kv_block_size=None):
    """One step's PackedStep, every slot decoding, slot s at position positions[s] -> the step read
    per slot (slot s is block s), or, with kv_block_size, paged (Part 3), through block tables."""
    n_slots = len(positions)
    runs = [Running(slot, Request([0] * position, 2), slot, None, admit_step=0, n_cached=position, tokens=[0])
            for slot, position in enumerate(positions)]  # each about to feed its first answer token
    # Paged, slot s's b-th block is block b * n_slots + s: as in a pool that many requests have used,
    # no slot's blocks lie side by side, and each table holds the blocks up to its position.
    tables = None if kv_block_size is None else [[b * n_slots + slot for b in range(position // kv_block_size + 1)]
                                                 for slot, position in enumerate(positions)]
    return pack_step([(run, [0]) for run in runs], [], n_slots, model.lm_head.weight.device, tables)[0]


def timed_forward(model, packed, cache):
    """Seconds for one forward of a PackedStep, the device's work finished."""
    start = time.perf_counter()
    with torch.no_grad():
        model.forward_packed(packed, cache)
    synchronize(model.lm_head.weight.device)
    return time.perf_counter() - start


def time_decode_steps(model, belts, max_len, repeats=5):
    """Seconds for one forward of each belt, every slot decoding, slot s of belt b at position
    belts[b][s], in one cache of max_len positions a slot: the median of `repeats` rounds, each round
    running every belt once, so that the machine's drift falls on all belts alike."""
    cache = model.new_cache(len(belts[0]), max_len)
    steps = [decode_step(model, positions) for positions in belts]
    rounds = [[timed_forward(model, packed, cache) for packed in steps] for _ in range(1 + repeats)]  # 1st: warm-up
    return [statistics.median(seconds[belt] for seconds in rounds[1:]) for belt in range(len(belts))]


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


# ---------------------------------------------------------------------------------------------
# 4) Paged attention (nanobatch Part 3): the same KV memory, per slot and paged, side by side

PAGED_ROWS = (4, 8)  # the paged runs' rows, in per-slot slots: more requests at once in the same memory
N_PASSES = 5  # the main workload's runs, in turn, this many times: enough for a range on a noisy, shared VM
EXTRA_ROWS = {  # figures from the step reports that summarize() leaves out, in the same table
    "requests at once": "requests in a slot (decoding, or taking in their prompt): mean / peak over the steps",
    "reserved holding tokens": "of the positions reserved step by step (per slot: max_len for each slot taken; "
                               "paged: the blocks taken), the share holding a token",
    "mean step (ms)": "wall time / steps",
}


def paged_attention(model, args):
    """Per slot against paged in the same KV memory, in one run. Per slot, --slots slots each reserve
    max_len positions: a server cannot know how long an answer will be. Paged, the same positions as
    a pool of blocks, shared by 4 and 8 times as many rows. The ceiling: per slot with as many slots
    as the most paged rows, each of the memory's share, as if every request's length were known.
    On the main workload, then the demo's; then decode steps through block tables against the same
    steps per slot, alternated. -> no panels: --svg does not apply."""
    max_len, block_size = args.max_len or model.config.block_size, args.kv_block_size
    n_slots = args.kv_blocks * block_size // max_len if args.kv_blocks else args.slots  # per slot, in that memory
    if n_slots == 0:
        nanobatch.fail(f"--kv-blocks {args.kv_blocks} of {block_size} positions hold no slot of max_len={max_len}: "
                       f"no per-slot run to compare")
    n_blocks = args.kv_blocks or n_slots * max_len // block_size
    rows = [factor * n_slots for factor in PAGED_ROWS]
    config = model.config
    cache_mb = config.n_layer * 2 * n_blocks * block_size * config.n_embd * model.lm_head.weight.element_size() / 1e6
    print(f"paged: the same KV memory, {n_blocks * block_size} positions ({cache_mb:.0f} MB), per slot as {n_slots} "
          f"slots of max_len={max_len}, paged as {n_blocks} blocks of {block_size} shared by "
          f"{' and '.join(map(str, rows))} rows")

    # 1) The main workload, every request queued at once: where more requests at once should pay. 12
    #    requests a slot, answers of at most 64 tokens, so that the ceiling's slots hold every sequence.
    #    The runs in turn, N_PASSES times: this VM's speed drifts by 10-30% and more, so each ratio is
    #    taken within a pass, and shown with its range over the passes.
    requests = main_workload(model, args, n_slots, per_slot=12, cap=64)
    known_len = n_blocks * block_size // rows[-1]  # the ceiling's max_len: the memory's share of each slot
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    ceiling = rows[-1] if longest <= known_len else None  # a sequence cut short would be other work
    passes = [same_memory(model, requests, args, n_slots, max_len, n_blocks, rows, args.prefill_chunk,
                          (ceiling, known_len)) for _ in range(N_PASSES)]
    summaries, figures = passes[0]
    print(f"\nthe first of {N_PASSES} passes (steps, TTFT in steps, requests at once and the cache's use are the "
          f"same in each), then tokens/s in each pass")
    print_table(summaries)
    print_extra_rows(figures)
    for i, (runs, _) in enumerate(passes, 1):
        print(f"{f'tokens/s, pass {i}':24}" + "".join(f"{runs[name]['tokens/s']:>18.0f}" for name in summaries))
    legend = {**nanobatch.LEGEND, **EXTRA_ROWS, "tokens/s, pass N": "tokens/s in pass N: the runs in turn, each pass"}
    print("\n" + "\n".join(f"{row}: {meaning}" for row, meaning in legend.items()))

    def over_passes(ratio, percent=False):  # ratio(summaries, figures) of each pass -> its median and range
        values = [ratio(*pass_) for pass_ in passes]
        median, low, high = statistics.median(values), min(values), max(values)
        if percent:
            return f"{median:.0%} ({low:.0%}-{high:.0%} over {len(values)} passes)"
        return f"{median:.2f}x ({low:.2f}-{high:.2f} over {len(values)} passes)"

    per_slot_name, paged_name = f"per slot {n_slots}x{max_len}", f"paged {rows[-1]} rows"
    print()
    for name in [f"paged {n} rows" for n in rows]:
        print(f"tokens/s, the same memory: {name} / {per_slot_name}: " +
              over_passes(lambda runs, _: runs[name]["tokens/s"] / runs[per_slot_name]["tokens/s"]))
    if ceiling:
        known_name = f"per slot {ceiling}x{known_len}"
        print(f"tokens/s, as if lengths were known: {known_name} / {per_slot_name}: " +
              over_passes(lambda runs, _: runs[known_name]["tokens/s"] / runs[per_slot_name]["tokens/s"]))
        for name in [f"paged {n} rows" for n in rows]:  # the ceiling: per slot, as if lengths were known
            print(f"tokens/s, {name} / the ceiling, {known_name}: " +
                  over_passes(lambda runs, _: runs[name]["tokens/s"] / runs[known_name]["tokens/s"], percent=True))
        # The same rows and, unless paged preempted, the same steps: the block tables' price in whole runs.
        same = "the same steps" if summaries[known_name]["steps"] == summaries[paged_name]["steps"] else \
            "OTHER steps: paged preempted"
        print(f"mean step, {paged_name} / {known_name} ({same}): " +
              over_passes(lambda _, extra: extra[paged_name]["mean step (ms)"] / extra[known_name]["mean step (ms)"]))
    else:
        print(f"per slot as if lengths were known: not run, the longest sequence ({longest} positions) does not "
              f"fit in {known_len}")

    # 2) The demo's workload (nanobatch.demo's, random prompts): how much of the memory each fills.
    chunk = args.prefill_chunk or nanobatch.DEMO_PREFILL_CHUNK
    print(f"\nthe demo's workload: 32 requests, {n_slots + n_slots // 2} at step 0, then one every other step, "
          f"prompts of 4-40 tokens in chunks of {chunk}, answers of long-tailed lengths (mean 16, at most 64)")
    summaries, figures = same_memory(model, demo_workload(model, args, n_slots), args, n_slots, max_len, n_blocks,
                                     rows[-1:], chunk, (None, None))
    print_table(summaries)
    print_extra_rows(figures)

    # 3) A decode step through block tables against the same step per slot: the block tables' price.
    block_table_price(model, sorted({n_slots, rows[-1]}), block_size)
    if args.quick:
        print("--quick: on a model this small a step's fixed cost dominates what its rows cost, so more rows "
              "cost little and these ratios are not GPT-2's. Without --quick: GPT-2 124M.")


def same_memory(model, requests, args, n_slots, max_len, n_blocks, rows, prefill_chunk, ceiling):
    """The requests per slot in n_slots slots of max_len, paged in n_blocks blocks with each of rows,
    and, where ceiling is (n, known_len) with n not None, per slot in n slots of known_len; each
    group warmed up, then timed -> ({name: summarize(...)}, {name: EXTRA_ROWS' figures})."""
    # Per slot, generate takes no block size without a pool: those runs keep the default it expects.
    per_slot_args = argparse.Namespace(**{**vars(args), "max_len": max_len, "kv_block_size": 16})
    groups = [(per_slot_args, [(f"per slot {n_slots}x{max_len}", n_slots, "continuous", prefill_chunk, False, None,
                                False)]),
              (args, [(f"paged {n} rows", n, "continuous", prefill_chunk, False, n_blocks, False) for n in rows])]
    n_known, known_len = ceiling
    if n_known:
        known_args = argparse.Namespace(**{**vars(per_slot_args), "max_len": known_len})
        groups.append((known_args, [(f"per slot {n_known}x{known_len}", n_known, "continuous", prefill_chunk, False,
                                     None, False)]))
    summaries, figures = {}, {}
    for run_args, runs in groups:
        warm_up(model, requests, runs, run_args)
        group, _, reports = run_all(model, requests, runs, run_args, eos_id=None, show_belt=False)
        summaries.update(group)
        for name, _, _, _, _, kv_blocks, _ in runs:
            positions_per_block = run_args.kv_block_size if kv_blocks else run_args.max_len
            figures[name] = extra_figures(reports[name], positions_per_block, group[name])
    return summaries, figures


def extra_figures(reports, positions_per_block, summary):
    """EXTRA_ROWS' figures of one run. A block table lists the blocks a request holds: per slot, its
    slot, a block of max_len positions; paged, blocks of kv_block_size."""
    at_once = [report.n_running + report.n_prefilling for report in reports]
    reserved = positions_per_block * sum(len(table) for report in reports for table in report.block_tables)
    return {"requests at once": (statistics.mean(at_once), max(at_once)),
            "reserved holding tokens": sum(report.kv_used for report in reports) / reserved,
            "mean step (ms)": 1e3 * summary["wall time (s)"] / summary["steps"]}


def print_extra_rows(figures):
    """EXTRA_ROWS under print_table's, in its columns: {run name: extra_figures(...)}."""
    def cell(row, value):
        if isinstance(value, tuple):
            return " / ".join(cell(row, v) for v in value)
        if row == "reserved holding tokens":
            return f"{value:.1%}"  # one decimal: per slot's share is a few percent
        return str(value) if isinstance(value, int) else f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}"

    for row in EXTRA_ROWS:
        print(f"{row:24}" + "".join(f"{cell(row, run[row]):>18}" for run in figures.values()))


def demo_workload(model, args, n_slots):
    """nanobatch.demo's workload as it builds it offline (random prompts): 32 requests, a belt and a
    half at step 0, the rest one every other step; prompts of 4-40 tokens, answers long-tailed, at
    most 64. Greedy, and no EOS, as the rest of the bench."""
    n_requests, first_wave = 32, n_slots + n_slots // 2
    lengths = long_tailed(random.Random(args.seed), n_requests, mean=16, cap=64)
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(n_requests)]
    return [Request(prompt, n, arrival=0 if i < first_wave else 2 * (i - first_wave + 1))
            for i, (prompt, n) in enumerate(zip(prompts, lengths))]


def block_table_price(model, row_counts, block_size, n_rounds=15):
    """Decode steps of the same belts per slot and paged (decode_step), every slot decoding: per slot
    in n_slots slots of max_len, paged in a pool of as many positions. A round times one step each way,
    per slot first in one round and paged first in the next, so that the machine's drift falls on
    both alike: the ratio of each round, its median and range. Paged, model.slot_positions gathers
    each slot's blocks into a copy that a per-slot view does not make: then that copy timed alone
    (time_gathers), what a kernel that reads the blocks where they lie would not spend."""
    max_len, config, device = model.config.block_size, model.config, model.lm_head.weight.device
    belts = {"all at 48": lambda n: [48] * n, "all at 96": lambda n: [96] * n,  # longer than any of the workload's: 80
             "spread 50-1000": lambda n: [50 + 950 * slot // max(1, n - 1) for slot in range(n)]}
    print(f"\ndecode steps through block tables of {block_size} (ms, per slot / paged: medians of {n_rounds} "
          f"rounds of a step each way, alternated; then paged / per slot: the median and the range of the rounds)")
    print(f"{'':10}" + "".join(f"{name:>36}" for name in belts))
    for n_slots in row_counts:
        slot_len = block_size * math.ceil(max_len / block_size)  # a slot's positions, in whole blocks
        try:  # two caches of n_slots x 1024 positions, 4.8 GB each at 64 slots of GPT-2 124M in float32
            model_py.check_cache_fits(config, 2 * n_slots, slot_len, device, model.lm_head.weight.dtype)
        except ValueError as e:
            print(f"{n_slots} rows: not timed, {e}")
            continue
        # Two caches of as many positions: per slot, and a pool of blocks (a slot's keys, heads first, are no
        # run of blocks, so the pool cannot be a view of the slots' memory). Only a forward's time is kept.
        caches = model.new_cache(n_slots, slot_len), model.new_cache(n_slots * slot_len // block_size, block_size)
        cells, gather_cells = [], []
        for belt in belts.values():
            positions = [length - 1 for length in belt(n_slots)]
            steps = (decode_step(model, positions), decode_step(model, positions, block_size))  # per slot, paged
            seconds = ([], [])  # per slot, paged
            for i in range(1 + n_rounds):  # the first round warms up
                for way in ((0, 1) if i % 2 else (1, 0)):  # per slot first in odd rounds, paged in even ones
                    seconds[way].append(timed_forward(model, steps[way], caches[way]))
            per_slot, paged = (times[1:] for times in seconds)
            ratios = [paged_s / per_slot_s for paged_s, per_slot_s in zip(paged, per_slot)]
            cells.append(f"{1e3 * statistics.median(per_slot):.1f} / {1e3 * statistics.median(paged):.1f}  "
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
            gathers = statistics.median(time_gathers(steps[1], caches[1]) for _ in range(n_rounds))
            gather_cells.append(f"{1e3 * gathers:.1f} ms alone, {gathers / statistics.median(paged):.0%} of paged")
        print(f"{f'{n_slots} rows':10}" + "".join(f"{cell:>36}" for cell in cells))
        print(f"{'  gathers':10}" + "".join(f"{cell:>36}" for cell in gather_cells), flush=True)
        del caches  # before the next row count's: at 64 rows, 9.7 GB


def time_gathers(packed, cache):
    """Seconds for the copies that a paged forward of packed makes, alone: model.slot_positions, as
    attend_packed calls it, in every layer, for keys and for values: the one-token call's slots up to
    the cut, then each chunk's slot up to its length."""
    one_token_slots, cut = packed.slots[:packed.n_one_token], packed.one_token_mask.size(-1)
    start = time.perf_counter()
    for layer in range(cache.kv.size(0)):
        for layer_cache, gathered in cache.layer(layer):  # keys, then values
            if packed.n_one_token:
                model_py.slot_positions(layer_cache, gathered, packed.block_tables, one_token_slots, cut)
            for _, slot, mask in packed.chunks:
                model_py.slot_positions(layer_cache, gathered, packed.block_tables, slice(slot, slot + 1),
                                        mask.size(-1))
    synchronize(cache.kv.device)
    return time.perf_counter() - start


SYSTEM_PROMPT = 96  # tokens every --prefix request starts with: six blocks of 16


def prefix_caching(model, args):
    """--prefix: 64 requests (or --requests) that share a system prompt of SYSTEM_PROMPT tokens, each
    followed by 4-16 of its own, answers of long-tailed lengths (mean 16, at most 64), one arriving every
    other step (or --arrival-rate), then all at step 0; --slots rows (16), a pool of --kv-blocks (512):
    with the prefix cache and without, in that pool -> nothing to draw."""
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests, rate, kv_blocks = args.requests or 64, args.arrival_rate or 0.5, args.kv_blocks or 512
    system, lengths = [rng.randrange(V) for _ in range(SYSTEM_PROMPT)], long_tailed(rng, n_requests, mean=16, cap=64)
    arriving = [Request(system + [rng.randrange(V) for _ in range(rng.randint(4, 16))], n, arrival=int(i / rate))
                for i, n in enumerate(lengths)]
    print(f"bench --prefix: {n_requests} requests, a system prompt of {SYSTEM_PROMPT} tokens and 4-16 of their own, "
          f"answers of {min(lengths)}-{max(lengths)} tokens, {args.slots} rows, {kv_blocks} blocks of "
          f"{args.kv_block_size}, GPT-2 {model.config.n_layer} layers, {args.device}, {args.dtype}")
    at_once = [replace(r, arrival=0) for r in arriving]
    for when, requests in [(f"{rate:g} a step", arriving), ("all at step 0", at_once)]:
        runs = [(name, args.slots, "continuous", args.prefill_chunk, False, kv_blocks, cache)
                for name, cache in [("cache", True), ("no cache", False)]]
        print(f"\narriving {when}:")
        warm_up(model, requests, runs, args)
        summaries, _, reports = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
        print_table(summaries)
        (cached, plain), fed = summaries.values(), [sum(r.n_prompt_tokens for r in reports[name]) for name, *_ in runs]
        print(f"prompt tokens computed: {fed[0]} with the cache, {fed[1]} without ({fed[0] / fed[1]:.0%}); "
              f"requests at once: {', '.join(str(max(r.n_running for r in reports[name])) for name, *_ in runs)}")
        print(f"tokens/s with the cache / without: {cached['tokens/s'] / plain['tokens/s']:.2f}x")
    return []


# ---------------------------------------------------------------------------------------------
# 6) --paged-step: one decode step at 64 rows of short sequences, per slot and paged, timed two ways

STEP_ROWS, STEP_PROMPT, STEP_NEW = 64, 48, 6  # requests (and rows), their prompts' tokens, new tokens each


def paged_step(model, args, n_runs=2, n_rounds=15):
    """A decode step of STEP_ROWS rows of short sequences, paged against per slot, timed two ways.
    Whole runs: STEP_ROWS requests of STEP_PROMPT random tokens and STEP_NEW new ones each, served per
    slot (STEP_ROWS slots of max_len) and paged (the blocks they need and STEP_ROWS more), the two in
    turn n_runs times; a run's figure is the median model_s of its steps that feed no prompt token
    while every row runs, a way's the smaller of its runs'. Step by step: those same steps
    (StepReport.packed) again, on caches that their prefill filled, a step each way in turn over
    n_rounds rounds; then block_table_price's step, every row at position 47, on the same caches."""
    max_len, block_size, V = args.max_len or model.config.block_size, args.kv_block_size, model.config.vocab_size
    rng, device = random.Random(args.seed), model.lm_head.weight.device
    requests = [Request([rng.randrange(V) for _ in range(STEP_PROMPT)], STEP_NEW) for _ in range(STEP_ROWS)]
    n_blocks = STEP_ROWS * math.ceil((STEP_PROMPT + STEP_NEW) / block_size) + STEP_ROWS
    print(f"paged step: {STEP_ROWS} requests of {STEP_PROMPT} random tokens, {STEP_NEW} new tokens each (decode "
          f"steps at positions {STEP_PROMPT}-{STEP_PROMPT + STEP_NEW - 2}), GPT-2 {model.config.n_layer} layers, "
          f"{args.device}, {args.dtype}, {torch.get_num_threads()} threads; per slot {STEP_ROWS} slots of "
          f"max_len={max_len}, paged {n_blocks} blocks of {block_size} (the requests' and {STEP_ROWS} more)")
    ways = {"per slot": dict(max_len=max_len), "paged": dict(kv_blocks=n_blocks, kv_block_size=block_size)}

    # 1) Whole runs, in turn: each run's median over its steps of decoding alone with every row running.
    medians, reports = {way: [] for way in ways}, {}
    for i in range(n_runs):
        for way in (list(ways) if i % 2 == 0 else list(ways)[::-1]):  # per slot first in odd runs
            reports[way] = []
            generate(model, requests, n_slots=STEP_ROWS, eos_id=None, on_step=reports[way].append, **ways[way])
            decoding = [r.model_s for r in reports[way] if r.n_prompt_tokens == 0 and r.n_running == STEP_ROWS]
            medians[way].append(statistics.median(decoding))
    print(f"\nwhole runs, in turn: the median model_s of each run's {len(decoding)} steps that feed no prompt "
          f"token while all {STEP_ROWS} rows run (ms)")
    for way, figures in medians.items():
        print(f"  {way:10}" + "".join(f"{1e3 * seconds:>9.1f}" for seconds in figures))
    print(f"  paged / per slot, the smaller run of each: {min(medians['paged']) / min(medians['per slot']):.2f}x; "
          f"run by run: " + ", ".join(f"{paged / per_slot:.2f}x"
                                      for per_slot, paged in zip(medians["per slot"], medians["paged"])))

    # 2) The same steps, each per slot and paged in turn, on caches that the runs' prefill step filled.
    model_py.check_cache_fits(model.config, STEP_ROWS, max_len, device, model.lm_head.weight.dtype)
    caches = {"per slot": model.new_cache(STEP_ROWS, max_len), "paged": model.new_cache(n_blocks, block_size)}
    with torch.no_grad():
        for way, cache in caches.items():
            model.forward_packed(reports[way][0].packed, cache)  # the prefill: every prompt in one step
    steps = {f"position {r.packed.positions[0]}": {way: reports[way][i].packed for way in ways}
             for i, r in enumerate(reports["per slot"]) if r.n_prompt_tokens == 0}
    # block_table_price's step at 48 keys: three whole blocks a row, its block s + 64 b taken from the same pool.
    steps["position 47, block_table_price's"] = {"per slot": decode_step(model, [47] * STEP_ROWS),
                                                 "paged": decode_step(model, [47] * STEP_ROWS, block_size)}
    print(f"\nstep by step, in turn (ms: the median of {n_rounds} rounds, a step each way, the order swapped each "
          f"round; paged / per slot: the median of the rounds and their range)")
    for name, packed in steps.items():
        seconds = {way: [] for way in ways}
        for i in range(1 + n_rounds):  # the first round warms up
            for way in (list(ways) if i % 2 else list(ways)[::-1]):
                seconds[way].append(timed_forward(model, packed[way], caches[way]))
        ratios = [paged / per_slot for per_slot, paged in zip(seconds["per slot"][1:], seconds["paged"][1:])]
        keys = packed["paged"].one_token_mask.size(-1)
        print(f"  {name} ({keys} keys, {math.ceil(keys / block_size)} blocks):".ljust(58) +
              f"{1e3 * statistics.median(seconds['per slot'][1:]):7.1f} / "
              f"{1e3 * statistics.median(seconds['paged'][1:]):7.1f}  {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    return []


# ---------------------------------------------------------------------------------------------
# 7) The roofline: a decode step against the matrix products it cannot do without

ROOFLINE_ROWS = (1, 8, 16, 64)  # every slot decoding: a lone request, a small belt, a middling one, a full one
ROOFLINE_PROMPT, ROOFLINE_NEW = 16, 40  # each request's prompt and answer: steps of 17 to 55 positions
STEP_OPS = {  # a profiled step's operations, by what they do (torch.profiler's names, self time)
    "matrix products": ("aten::addmm", "aten::mm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
                  "aten::masked_fill", "aten::masked_fill_", "aten::index_select"),
    "cache writes": ("aten::_index_put_impl_",),
    "norms, GELU, residuals": ("aten::native_layer_norm", "aten::gelu", "aten::add", "aten::add_"),
    "sampling": ("aten::argmax",),
}


def roofline_requests(model, n_rows):
    """n_rows requests of ROOFLINE_PROMPT tokens each (fixed ids), ROOFLINE_NEW new tokens each."""
    return [Request([(97 * i + j) % model.config.vocab_size for j in range(ROOFLINE_PROMPT)], ROOFLINE_NEW)
            for i in range(n_rows)]


def decode_steps(model, n_rows):
    """generate's decode steps with every one of n_rows slots decoding -> their StepReports' step_s."""
    seconds = []
    generate(model, roofline_requests(model, n_rows), n_slots=n_rows, eos_id=None, on_step=lambda report:
             seconds.append(report.step_s) if report.n_running == n_rows and report.n_prompt_tokens == 0 else None)
    return seconds


def products_alone(model, n_rows, layout):
    """Seconds for the 48 linear layers and the LM head of a step of n_rows, on (n_rows, C) inputs, nothing else:
    layout "nn.Linear", torch's F.linear, x W^T, as nn.Linear computes it (the floor any engine on this torch pays);
    "as the model", model.Linear's own: (W x^T)^T, its rows padded as it pads them (one thread, above 8: x W^T)."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    layers = [layer for block in model.transformer.h for layer in (block.attn.c_attn, block.attn.c_proj,
                                                                   block.mlp.c_fc, block.mlp.c_proj)]
    layers.append(model.lm_head)
    inputs = {layer.weight.size(1): torch.randn(n_rows, layer.weight.size(1), device=device, dtype=dtype)
              for layer in layers}
    start = time.perf_counter()
    for layer in layers:
        x = inputs[layer.weight.size(1)]
        layer(x) if layout == "as the model" else F.linear(x, layer.weight, layer.bias)
    synchronize(device)
    return time.perf_counter() - start


def roofline(model, args, n_passes=3, n_products=15):
    """Section 7: at each row count, the decode step of the default path and the batch-invariant one (the same
    weights), alternated over n_passes runs of generate, as the median step_s; the products alone in both layouts,
    the median of n_products; then one profiled run of the default path: where the rest of its step goes."""
    invariant = GPT(replace(model.config, batch_invariant=True)).to(args.device, args.dtype).eval()
    invariant.load_state_dict(model.state_dict())
    rows = [args.slots] if args.slots != nanobatch.OPTIONS["slots"][1] else ROOFLINE_ROWS
    print(f"decode steps ({ROOFLINE_PROMPT}-token prompts, {ROOFLINE_NEW} new tokens, every slot decoding), the "
          f"median step_s of {n_passes} runs a path, alternated; products alone: the 48 linear layers and the LM "
          f"head on ({'{rows}'}, {model.config.n_embd}), the median of {n_products}; {torch.get_num_threads()} "
          f"threads, {args.device}, {args.dtype}; products as nn.Linear computes them (F.linear, x W^T), and "
          f"as model.Linear does (Linear: (W x^T)^T, or on one thread above 8 rows x W^T)")
    print(f"{'rows':>5}{'default ms':>12}{'invariant ms':>14}{'invariant/default':>19}{'products ms':>13}"
          f"{'Linear':>9}{'default/products':>18}{'Linear':>9}")
    with torch.no_grad():
        for warm_up in (model, invariant):  # the first run of a process pays for its first allocations
            decode_steps(warm_up, rows[0])
        for n_rows in rows:
            steps = {False: [], True: []}
            for i in range(2 * n_passes):
                path = bool(i % 2) != bool(i // 2 % 2)  # default, invariant, invariant, default, ...
                steps[path] += decode_steps(invariant if path else model, n_rows)
            products = {"nn.Linear": [], "as the model": []}
            for _ in range(n_products):  # the two ways in turn, so that the machine's drift falls on both
                for layout in products:
                    products[layout].append(products_alone(model, n_rows, layout))
            products = {layout: statistics.median(seconds) for layout, seconds in products.items()}
            default, batch_invariant = (statistics.median(steps[path]) for path in (False, True))
            print(f"{n_rows:>5}{1e3 * default:>12.1f}{1e3 * batch_invariant:>14.1f}{batch_invariant / default:>18.2f}x"
                  f"{1e3 * products['nn.Linear']:>13.1f}{1e3 * products['as the model']:>9.1f}"
                  f"{default / products['nn.Linear']:>17.2f}x{default / products['as the model']:>8.2f}x", flush=True)
    where_the_step_goes(model, rows[-1])


def where_the_step_goes(model, n_rows, n_active=20):
    """n_active decode steps of a run of generate at n_rows, profiled: each kind of operation's share of their time,
    by torch.profiler's self time (STEP_OPS); the rest, the Python between them and the smaller operations."""
    from torch.profiler import ProfilerActivity, profile, schedule
    with torch.no_grad(), warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU], schedule=schedule(
            wait=2, warmup=1, active=n_active)) as profiled:  # (its warning: one cycle's events, as wanted)
        warnings.simplefilter("ignore")
        generate(model, roofline_requests(model, n_rows), n_slots=n_rows, eos_id=None,
                 on_step=lambda report: profiled.step())
    self_us = {event.key: event.self_cpu_time_total for event in profiled.key_averages()}
    total_us = sum(self_us.values())  # the steps' whole time: ProfilerStep's own is the Python between operations
    shares = {kind: sum(self_us.get(name, 0) for name in names) / total_us for kind, names in STEP_OPS.items()}
    shares["everything else (Python, copies, small ops)"] = 1 - sum(shares.values())
    print(f"\nwhere a decode step's time goes at {n_rows} rows ({n_active} steps, profiled, so slower): " +
          ", ".join(f"{kind} {share:.1%}" for kind, share in shares.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/bench.py", description="continuous vs static vs sequential, timed")
    parser.add_argument("--requests", type=positive(int), metavar="N", help="the main workload's (16 per slot)")
    parser.add_argument("--arrival-rate", type=positive(float), metavar="R", help="requests per step (all at once)")
    parser.add_argument("--call-cost", type=int, metavar="KEYS", help="what one more attention call costs on "
                        "the device, in keys (model.CALL_COST_IN_KEYS: 150 on a CPU, 20,000 on a GPU)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--decode-steps", action="store_true", help="only the table of decode steps")
    only.add_argument("--paged", action="store_true", help="only section 4: per slot against paged in the same KV "
                      "memory (--slots slots of --max-len, or --kv-blocks blocks), and the block tables' price")
    only.add_argument("--prefix", action="store_true", help="only section 5: a shared system prompt, with the prefix "
                      "cache and without, in one pool (--kv-blocks, 512; --slots, 16)")
    only.add_argument("--paged-step", action="store_true", help="only section 6: a decode step of 64 rows of short "
                      "sequences, paged against per slot, timed in whole runs and step by step")
    only.add_argument("--roofline", action="store_true", help="only section 7: a decode step at 1 to 64 rows (or "
                      "--slots), default and batch-invariant, against its matrix products alone")
    parser.add_argument("--svg", metavar="FILE", type=checked_path, help="the belt drawn into FILE: continuous, "
                        "static (and disaggregated), then the long-prompt runs with their step durations")
    typed, args = nanobatch.parse_args(parser, argv, nanobatch.SERVING | {"quick", "weights"})
    ignored = ["slots", "max_len", "prefill_chunk", "disaggregate", "requests", "arrival_rate", "svg"]
    for name in [name for name in ignored if typed.get(name) not in (None, False)] if args.decode_steps else []:
        parser.error(f"--{name.replace('_', '-')} does not apply to --decode-steps, which times its own belts")
    if args.paged:
        if args.disaggregate:
            parser.error("--disaggregate does not apply to --paged: a paged cache takes no prefill worker")
        if args.svg:
            parser.error("--svg does not apply to --paged, which draws no belt")
        if "kv_blocks" in typed and "slots" in typed:
            parser.error("--paged takes --slots or --kv-blocks, not both: each sets the memory that both caches get")
    elif args.prefix:
        if args.disaggregate or args.svg:
            parser.error(f"--{'disaggregate' if args.disaggregate else 'svg'} does not apply to --prefix")
        args.slots = args.slots if "slots" in typed else 16
    elif args.paged_step:
        for name in [name for name in ("slots", "kv_blocks", "prefill_chunk", "disaggregate", "requests",
                                       "arrival_rate", "svg") if typed.get(name) not in (None, False)]:
            parser.error(f"--{name.replace('_', '-')} does not apply to --paged-step, which runs its own workload")
    elif args.roofline:
        for name in [name for name in ("kv_blocks", "prefill_chunk", "disaggregate", "requests", "arrival_rate", "svg",
                                       "batch_invariant") if typed.get(name) not in (None, False)]:
            parser.error(f"--{name.replace('_', '-')} does not apply to --roofline, which runs both paths its own way")
    elif "kv_blocks" in typed:  # the other sections' runs reserve per slot
        parser.error("--kv-blocks applies to --paged and --prefix only")
    groups = nanobatch.run_cli(bench, args)
    if args.svg:
        write_svg(args.svg, groups)


if __name__ == "__main__":
    main()
