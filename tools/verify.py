"""
verify: the engine's greedy answers against the reference's, each judged identical, rounding or BUG.

    python tools/verify.py --dtype bfloat16      GPT-2 124M (random weights unless --weights)
    python tools/verify.py --quick               a tiny model, in seconds

Exit status 0: every answer identical or apart by rounding; 1: a BUG; 2: bad input.
"""
import argparse
import copy
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import nanobatch  # noqa: E402
from nanobatch import (Request, check_arguments, fail, generate, generate_sequential, letter,  # noqa: E402
                       load_tokenizer, placement, sample, seeded_model)


ROUNDING_FACTOR = 4  # how far past the reference's own error the batched logits may land. Summing in
#                      another order lands about as far: at most 1.53x at each of 720 tokens measured
#                      (tiny and 124M models, float32 and bfloat16). A decode mask that sees too much
#                      landed 19x-43x as far in bfloat16, over 390,000x in float32 (--quick).


def verdict(batched, sequential, exact):
    """Why the engine's greedy token differs from the reference's -> ('rounding' or 'BUG', the
    figures behind it).

    batched, sequential: (V,) the logits each side took its token from, in the run's dtype;
    exact: (V,) the logits of the same prefix recomputed in float64, from the same weights. The
    two tokens are always a near-tie (each side ranks its own first, so their gap is within twice
    the rows' difference), so the margin alone tells nothing. The distance to the exact logits
    does: the dtype's rounding moves the reference's logits some way, and the engine's, which only
    sum in another order, about as far; a wrong mask or cache computes something else, and lands
    much further. The reference's error counts as at least one rounding of the largest logit: in
    float64 the reference is the exact recomputation, and its error 0.
    """
    one_rounding = torch.finfo(sequential.dtype).eps * exact.abs().max().item()
    batched, sequential, exact = batched.double(), sequential.double(), exact.double()

    def distance(a, b):  # the largest logit difference; a NaN is the largest of all
        return (a - b).abs().nan_to_num(nan=math.inf).max().item()

    top_two = sequential.topk(2).values
    figures = {
        "reference margin": (top_two[0] - top_two[1]).item(),  # between the reference's top two logits
        "|batched - reference|": distance(batched, sequential),
        "batched error": distance(batched, exact),
        "reference error": distance(sequential, exact),
    }
    figures["tolerance"] = ROUNDING_FACTOR * max(figures["reference error"], one_rounding)
    return "rounding" if figures["batched error"] <= figures["tolerance"] else "BUG", figures


def verify(args):
    """Seeded greedy requests through generate and through generate_sequential; each answer
    identical, or apart by rounding, or by a BUG. Exits with status 1 if any is a BUG, else 0."""
    model = seeded_model(args)
    tokenizer = None if args.quick else load_tokenizer(model)

    def shown_token(token):
        return f"{tokenizer.decode([token])!r} ({token})" if tokenizer else str(token)

    # 1) The workload: prompts of mixed lengths, answers long enough to meet near-ties, more
    #    requests than slots and a third of them late, so that slots are reused mid-run.
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests, prompt_lens, answer_lens = (12, (4, 16), (8, 24)) if args.quick else (16, (4, 48), (24, 64))
    requests = [Request([rng.randrange(V) for _ in range(rng.randint(*prompt_lens))], rng.randint(*answer_lens),
                        arrival=rng.randint(1, 40) if i % 3 == 2 else 0) for i in range(n_requests)]
    try:  # bad input is refused before anything is printed
        check_arguments(model, requests, args.slots, args.max_len or model.config.block_size, None, args.policy,
                        args.prefill_chunk, args.disaggregate, args.kv_blocks, args.kv_block_size)
    except ValueError as e:
        fail(e)
    prompts_go = f"prompt chunks of {args.prefill_chunk}" if args.prefill_chunk else "whole prompts"
    if args.disaggregate:
        prompts_go += f" on a prefill worker: {placement(model.lm_head.weight.device)}"
    if args.kv_blocks:
        prompts_go += f", paged: {args.kv_blocks} blocks of {args.kv_block_size}"
    print(f"verify: {n_requests} greedy requests (prompts of {'-'.join(map(str, prompt_lens))} random tokens, "
          f"answers of {'-'.join(map(str, answer_lens))}, {sum(r.arrival > 0 for r in requests)} arriving late) "
          f"through generate ({args.slots} slots, {args.policy}, {prompts_go}) and "
          f"generate_sequential; GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    print(f"rule: at an answer's first differing token, both forwards' logits are compared with a float64 "
          f"recomputation of the same prefix: 'rounding' if the batched ones are within {ROUNDING_FACTOR}x the "
          f"reference's own error of it (at least one rounding of the largest logit), 'BUG' if further")
    # 2) The reference's answers.
    start = time.perf_counter()
    reference = generate_sequential(model, requests, max_len=args.max_len, eos_id=None)
    reference_s = time.perf_counter() - start
    # 3) The engine's answers, and from its step reports the logits row of each answer's first
    #    token that differs from the reference's. Request i's k-th row in the reports made its token k.
    n_rows_seen, first_flip = [0] * n_requests, {}  # first_flip[i]: (position in the answer, logits row)

    def on_step(report):
        for i, row in zip(report.sampled, report.logits):
            k, reference_tokens = n_rows_seen[i], reference[i].tokens
            n_rows_seen[i] += 1
            token = int(sample(row, requests[i], None))  # the engine's own rule: the token it took
            if i not in first_flip and k < len(reference_tokens) and token != reference_tokens[k]:
                first_flip[i] = (k, row.clone())  # a copy: the step's whole (R, V) logits need not stay

    start = time.perf_counter()
    batched = generate(model, requests, n_slots=args.slots, max_len=args.max_len, eos_id=None, policy=args.policy,
                       prefill_chunk=args.prefill_chunk, on_step=on_step, disaggregate=args.disaggregate,
                       kv_blocks=args.kv_blocks, kv_block_size=args.kv_block_size)
    batched_s = time.perf_counter() - start
    # 4) Each answer, identical or judged at its first differing token. The reference's logits
    #    there come again from the forward it ran (plain, in the run's dtype, on the same prefix),
    #    the exact ones from a float64 copy of the model.
    exact_model, counts = None, {"identical": 0, "rounding": 0, "BUG": 0}
    for i, (request, got, want) in enumerate(zip(requests, batched, reference)):
        if n_rows_seen[i] != len(got.tokens):  # a token whose logits were not reported goes unjudged
            name, line = "BUG", f"{len(got.tokens)} tokens, but {n_rows_seen[i]} logits rows for it in the step reports"
        elif got.tokens == want.tokens:
            name, line = "identical", ""
        elif i not in first_flip:  # only a broken engine or report gets here
            name, line = "BUG", (f"answers of {len(got.tokens)} and {len(want.tokens)} tokens, and no logits "
                                 f"row in the step reports made a token that differs")
        else:
            position, batched_row = first_flip[i]
            if exact_model is None:
                exact_model = copy.deepcopy(model).double()
            prefix = torch.tensor([request.prompt + want.tokens[:position]], device=args.device)  # (1, T)
            with torch.no_grad():
                sequential_row, exact_row = model(prefix)[0, -1], exact_model(prefix)[0, -1]  # each (V,)
            name, f = verdict(batched_row, sequential_row, exact_row)
            line = (f"first differs at token {position}: {shown_token(got.tokens[position])} vs "
                    f"{shown_token(want.tokens[position])} (batched vs reference); reference margin "
                    f"{f['reference margin']:.3g}; |batched - reference| {f['|batched - reference|']:.3g}; "
                    f"off float64: batched {f['batched error']:.3g}, reference {f['reference error']:.3g}, "
                    f"tolerance {f['tolerance']:.3g}")
        counts[name] += 1
        print(f"{letter(i)}  {name:9} {line}".rstrip())
    print(f"{n_requests} answers: " + ", ".join(f"{n} {name}" for name, n in counts.items()) +
          f" (generate_sequential {reference_s:.1f} s, generate {batched_s:.1f} s)")
    sys.exit(1 if counts["BUG"] else 0)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/verify.py", description="batched against sequential answers, each "
                                     "judged: identical, rounding or BUG (exit status 1)")
    _, args = nanobatch.parse_args(parser, argv, nanobatch.SERVING | {"quick", "weights", "policy"})
    nanobatch.run_cli(verify, args)


if __name__ == "__main__":
    main()
