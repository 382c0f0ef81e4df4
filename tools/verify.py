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
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import model as model_py  # noqa: E402
import nanobatch  # noqa: E402
from model import GPT  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# Batch invariance, op by op: does a row's result depend on what else shares its call? (docs/api.md)

BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 31, 64, 100)  # rows in a call, as steps come
POSITIONS = (0, 1, 5, 16, 17, 63, 64, 100, 191, 200)  # a query's position, among its model's block_size


def varying_ops(model):
    """Each op of a step, as this model runs it (model.config.batch_invariant), measured on this machine: a row
    computed in calls of BATCH_SIZES rows (1: alone) against the same row in a call of the most, and attention's
    query also over more keys than its own (masked) and as one of a prompt's rows -> {op: where some row's bits
    differed, or "" if nowhere}. Inputs are random: an op's bits depend on the shapes it runs, not the values."""
    config, gen, device = model.config, torch.Generator().manual_seed(0), model.lm_head.weight.device
    block, C, n = model.transformer.h[0], config.n_embd, max(BATCH_SIZES)
    rows = model_py.pad_rows if config.batch_invariant else (lambda x: x)  # what forward_packed does first

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=model.lm_head.weight.dtype).to(device)

    tokens = torch.randint(config.vocab_size, (n,), generator=gen).to(device)
    positions = torch.arange(n, device=device) % config.block_size
    rowwise = {  # op: (the op on rows x (N, ...), its inputs)
        "embeddings": (lambda i: model.embed(tokens[i], positions[i]), torch.arange(n, device=device)),
        "layer norm": (block.ln_1, randn(n, C)),
        f"linear {C} -> {3 * C}": (lambda x: block.attn.c_attn(rows(x))[:len(x)], randn(n, C)),
        f"linear {4 * C} -> {C}": (lambda x: block.mlp.c_proj(rows(x))[:len(x)], randn(n, 4 * C)),
        "GELU": (lambda x: F.gelu(x, approximate="tanh"), randn(n, 4 * C)),
        f"LM head {C} -> {config.vocab_size}": (lambda x: model.lm_head(rows(x))[:len(x)], randn(n, C)),
        "softmax (sampling)": (lambda x: torch.softmax(x, dim=-1), randn(n, config.vocab_size)),
    }
    found = {}
    with torch.no_grad():
        for name, (op, x) in rowwise.items():
            in_the_most = op(x)  # every row in a call of n
            found[name] = ", ".join(str(size) for size in BATCH_SIZES if not torch.equal(op(x[:size]), in_the_most[:size]))
            found[name] = found[name] and f"in calls of {found[name]} rows"
        found["attention"] = attention_varies(block.attn.attention, config, randn)
    return found


def attention_varies(attend, config, randn):
    """Where a query's attention output differs from the same query alone over exactly its keys (-> "" if
    nowhere): over more keys, those past its position masked (the one-token call over the belt's longest row);
    in a batch of other slots' queries; as one of a causal call's rows (a prompt's chunk, and the reference)."""
    nh, hs, n_positions = config.n_head, config.n_embd // config.n_head, min(config.block_size, 256)
    q, k, v = (randn(1, nh, n_positions, hs) for _ in range(3))
    where = set()
    for p in [p for p in POSITIONS if p < n_positions]:
        alone = attend(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1],
                       attn_mask=torch.ones(1, 1, 1, p + 1, dtype=torch.bool, device=q.device))
        for L in sorted({min(n_positions, L) for L in (p + 2, p + 17, 2 * p + 1, n_positions)} - {p + 1}):
            mask = (torch.arange(L, device=q.device) <= p)[None, None, None]  # (1, 1, 1, L)
            if not torch.equal(attend(q[:, :, p:p + 1], k[:, :, :L], v[:, :, :L], attn_mask=mask), alone):
                where.add("over more keys (masked)")
        for batch in (2, 3, 5, 8):  # the query in slot 0 of a batch of slots at other positions
            others = randn(batch - 1, nh, p + 1, hs)
            keys, values = torch.cat([k[:, :, :p + 1], others]), torch.cat([v[:, :, :p + 1], others])
            queries = torch.cat([q[:, :, p:p + 1], randn(batch - 1, nh, 1, hs)])
            mask = torch.ones(batch, 1, 1, p + 1, dtype=torch.bool, device=q.device)
            if not torch.equal(attend(queries, keys, values, attn_mask=mask)[:1], alone):
                where.add("in a batch")
        for T in sorted({p + 1, p + 4, n_positions}):
            if T <= n_positions and not torch.equal(
                    attend(q[:, :, :T], k[:, :, :T], v[:, :, :T], is_causal=True)[:, :, p:p + 1], alone):
                where.add("as a prompt's row")
    return "; ".join(sorted(where))


def print_varying_ops(model):
    """varying_ops for the default path and the batch-invariant one, side by side -> whether every op of the
    batch-invariant path gave each row the same bits in every call (the bitwise proof's premise)."""
    config = replace(model.config, batch_invariant=not model.config.batch_invariant)
    twin = GPT(config).to(model.lm_head.weight.device, model.lm_head.weight.dtype).eval()
    twin.load_state_dict(model.state_dict())
    paths = sorted([model, twin], key=lambda m: m.config.batch_invariant)  # default, then invariant
    found = [varying_ops(m) for m in paths]
    print(f"each op of a step: where a row's bits differ from the same row's in a call of {BATCH_SIZES[-1]} rows "
          f"({model.lm_head.weight.device}, {model.lm_head.weight.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'op':24}{'default path':62}batch-invariant path")
    for name in found[0]:
        print(f"{name:24}{found[0][name] or 'nowhere':62}{found[1][name] or 'nowhere'}")
    return not any(found[1].values())


def verify(args):
    """Seeded greedy requests through generate and through generate_sequential; each answer
    identical, or apart by rounding, or by a BUG. Exits with status 1 if any is a BUG, else 0."""
    model = seeded_model(args)
    tokenizer = None if args.quick else load_tokenizer(model)
    if args.ops:
        sys.exit(0 if print_varying_ops(model) else 1)
    if model.config.batch_invariant:  # the premise of bit-for-bit logits, on this machine: each op's rows alike
        varying = {op: where for op, where in varying_ops(model).items() if where}
        print("the batch-invariant ops on this machine: " + ("each gives a row the same bits in every call" if not
              varying else "; ".join(f"{op} differs {where}" for op, where in varying.items()) + ": logits may differ"))

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
    rows_kept = {}  # batch-invariant: (i, k) -> the logits row of answer i's token k, for check_bits

    def on_step(report):
        for i, row in zip(report.sampled, report.logits):
            k, reference_tokens = n_rows_seen[i], reference[i].tokens
            n_rows_seen[i] += 1
            if model.config.batch_invariant and k in (0, requests[i].max_new_tokens // 2, requests[i].max_new_tokens - 1):
                rows_kept[i, k] = row.clone()
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
    n_unequal = 0
    if model.config.batch_invariant:  # the claim is stronger: the very bits of the logits
        n_unequal = check_bits(model, requests, batched, rows_kept)
    sys.exit(1 if counts["BUG"] or n_unequal else 0)


def check_bits(model, requests, batched, rows_kept):
    """Batch-invariant: each answer's first, middle and last token's logits row from the engine against the
    reference's forward over the same prefix, torch.equal -> how many differ (each named)."""
    n_compared, unequal = 0, []
    with torch.no_grad():
        for (i, k), row in rows_kept.items():
            prefix = torch.tensor([requests[i].prompt + batched[i].tokens[:k]], device=row.device)  # (1, T)
            n_compared += 1
            if not torch.equal(model(prefix)[0, -1], row):
                unequal.append(f"{letter(i)} token {k}")
    print(f"bit for bit: {n_compared - len(unequal)} of {n_compared} logits rows (each answer's first, middle and "
          f"last token's) equal the reference's" + (f"; not {', '.join(unequal)}" if unequal else ""))
    return len(unequal)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/verify.py", description="batched against sequential answers, each "
                                     "judged: identical, rounding or BUG (exit status 1)")
    parser.add_argument("--ops", action="store_true", help="only each op of a step, measured on this machine: "
                        "where a row's bits depend on its batch, on the default path and the batch-invariant one")
    _, args = nanobatch.parse_args(parser, argv, nanobatch.SERVING | {"quick", "weights", "policy"})
    nanobatch.run_cli(verify, args)


if __name__ == "__main__":
    main()
