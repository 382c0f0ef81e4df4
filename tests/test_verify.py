"""
tools/verify.py: in float64 every answer identical, a broken engine named, and the verdict's rule
(rounding or BUG) pinned at its edges.
"""
import math
from dataclasses import replace

import pytest
import torch

import nanobatch
from test_nanobatch import decode_sees_everything, prefill_sees_the_future  # the teeth's broken masks
from tests.common import TIMEOUT_S, V, ends_within
import verify  # noqa: E402 (tools/, put on the path by tests.common)
from verify import verdict  # noqa: E402


# --verify: every answer identical in float64, a broken engine named, the verdict's rule


@pytest.fixture
def small_vocab_quick(monkeypatch):
    """verify --quick's tiny model with the engine tests' vocabulary of 512, not GPT-2's 50,257: its
    LM head in float64, over every position of every reference forward, took over 90% of these tests'
    time (4.2 s a run, 0.3 s with 512), and no claim below depends on the vocabulary (eos_id is None)."""
    monkeypatch.setattr(nanobatch, "TINY", replace(nanobatch.TINY, vocab_size=V))


@pytest.mark.usefixtures("small_vocab_quick")
@pytest.mark.parametrize("disaggregated", [[], ["--disaggregate"]])
def test_verify_float64_every_answer_identical(capsys, disaggregated):
    """In float64 the engine's greedy answers are the reference's, every one, prefilled on the belt
    or by the worker: exit status 0."""
    with pytest.raises(SystemExit) as exit_status:
        ends_within(TIMEOUT_S, verify.main, ["--quick", "--dtype", "float64", "--device", "cpu", *disaggregated])
    out = capsys.readouterr().out
    assert exit_status.value.code == 0, out[-2000:]
    answers = [line for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    assert len(answers) == 12 and all(line.split()[1] == "identical" for line in answers), out
    assert "12 answers: 12 identical, 0 rounding, 0 BUG" in out, out


@pytest.mark.usefixtures("small_vocab_quick")
@pytest.mark.parametrize("broken_mask", [decode_sees_everything, prefill_sees_the_future])
def test_verify_names_a_broken_engine(monkeypatch, capsys, broken_mask):
    """Teeth: with a broken mask, every answer that differs (the first one among them) is a BUG,
    none passes for rounding, and the exit status is 1."""
    monkeypatch.setattr(nanobatch, "attention_mask", broken_mask)
    with pytest.raises(SystemExit) as exit_status:
        verify.main(["--quick", "--dtype", "float64", "--device", "cpu"])
    out = capsys.readouterr().out
    verdicts = [line.split()[1] for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    differing = [name for name in verdicts if name != "identical"]
    assert exit_status.value.code == 1, out
    assert differing and set(differing) == {"BUG"}, out


@pytest.mark.usefixtures("small_vocab_quick")
def test_verify_judges_the_workers_first_token(monkeypatch, capsys):
    """Disaggregated, a worker whose prompt sees its own future is judged on its first tokens: the
    logits it reports for them are compared like the loop's, so answers that differ from their
    first token on are each a BUG, and the exit status is 1."""
    monkeypatch.setattr(nanobatch, "attention_mask", prefill_sees_the_future)
    with pytest.raises(SystemExit) as exit_status:
        ends_within(TIMEOUT_S, verify.main, ["--quick", "--dtype", "float64", "--device", "cpu", "--disaggregate"])
    out = capsys.readouterr().out
    verdicts = [line.split()[1:6] for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    assert exit_status.value.code == 1, out
    assert all(words[0] in ("identical", "BUG") for words in verdicts), out
    assert ["BUG", "first", "differs", "at", "token"] in verdicts and "first differs at token 0:" in out, out


def logits(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_verdict_rounding_within_the_dtype_error():
    """Tokens 0 and 1 are 1e-4 apart in float64. The reference is 2e-4 off and takes token 1, the
    engine 3e-4 off and takes token 0: a flip within the error the dtype itself makes."""
    exact = logits(1.0, 1.0001, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.0, 1.0003, -0.0001, -1.0)  # takes token 1
    batched = logits(1.0003, 1.0, 0.0, -1.0)  # takes token 0
    name, figures = verdict(batched, sequential, exact)
    assert name == "rounding", figures
    assert figures["reference margin"] == pytest.approx(3e-4, abs=1e-6), figures
    assert figures["batched error"] == pytest.approx(3e-4, abs=1e-6), figures
    assert figures["reference error"] == pytest.approx(2e-4, abs=1e-6), figures


def test_verdict_bug_across_a_wide_margin():
    """The reference is 1e-4 off and takes token 0, 2 ahead; the engine takes token 1, 2 off."""
    exact = logits(3.0, 1.0, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(3.0001, 1.0, 0.0, -1.0)
    batched = logits(1.0, 3.0, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert name == "BUG", figures
    assert figures["batched error"] == pytest.approx(2.0), figures


def test_verdict_bug_at_a_near_tie():
    """The trap the margin sets: tokens 0 and 1 are 1e-4 apart, and the engine's logits differ
    from the reference's by 0.01, far more than the margin. A margin-against-difference rule would
    call it rounding, but the reference is 1e-6 off the exact logits and the engine 0.01: BUG."""
    exact = logits(1.0, 1.0001, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.000001, 1.0001, 0.0, -1.0)
    batched = logits(1.01, 1.0001, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert figures["reference margin"] < figures["|batched - reference|"], figures
    assert name == "BUG", figures


@pytest.mark.parametrize("batched_error, side, expected", [(3.9e-3, -1, "rounding"), (4.1e-3, +1, "BUG")])
def test_verdict_threshold_is_4x_the_reference_error_against_float64(batched_error, side, expected):
    """The rule as the README states it, pinned at its edge: the reference is 1e-3 off float64, so
    the engine may be up to 4e-3 off. 3.9e-3 off on the other side of float64 is rounding, though it
    lies 4.9e-3 from the reference's row; 4.1e-3 off on the same side is a BUG, though it lies only
    3.1e-3 from the reference's row. A rule that compared the two rows with each other, or took
    another factor, gets one of the two wrong."""
    exact = logits(1.0, 0.5, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.001, 0.5, 0.0, -1.0)
    batched = logits(1.0 + side * batched_error, 0.5, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert figures["reference error"] == pytest.approx(1e-3, rel=1e-3), figures
    assert name == expected, figures


@pytest.mark.parametrize("offset, expected", [(4e-16, "rounding"), (1e-9, "BUG"), (math.nan, "BUG")])
def test_verdict_in_float64(offset, expected):
    """In float64 the reference is the exact recomputation, its error 0: the engine may be off by
    rounding in the last bits only (the tolerance is a few roundings of the largest logit), and a
    NaN is never rounding."""
    exact = logits(1.0, 1.0, 0.5, -2.0, dtype=torch.float64)
    batched = exact + logits(offset, 0.0, 0.0, 0.0, dtype=torch.float64)
    name, figures = verdict(batched, exact.clone(), exact)
    assert name == expected, figures
