"""Exercise 12: mixed chunk (readings §18, lesson 12). A prefill batch also carries one decode token of
every running request, built as a decode batch builds it: the input a FutureMap placeholder while the
token is in flight, the position the request's launched length, a new KV slot, and the request's
launched length and in-flight samples advanced. With mixed_prefix_from_launched off, the position is
SGLang's serial formula, committed length - 1. Each assertion names its rule."""

import pytest

from minisgl import LLM, SamplingParams

PROMPTS = [[3, 4, 5 + i] * (4 + 5 * i) for i in range(5)] + [[9, 10, 11, 12, 13, 14, 15]]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
          for i, n in enumerate((3, 6, 9, 17, 12, 20))]

# A small pool: after the first wave the radix cache holds most of it, and the next wave's slots,
# the mixed rows' among them, must come from evicting it (the ledger's allocate does).
KV_TOKENS = 320

ROW_RULE = ("a mixed decode row is a decode row: input from _decode_input (a placeholder while in flight), position "
            "the launched length, one new KV slot, then launched_len and inflight_samples advance by one")
LEDGER_RULE = ("a mixed row's KV slot comes from the ledger (sched.kv_ledger.allocate), as a decode row's does: it "
               "evicts from the radix cache when the free list runs out and draws on the request's reservation")
SWITCH_RULE = ("with mixed_prefix_from_launched off the position is committed_len - 1 (right serially, one early "
               "under the overlap): keep the switch")


class RowRuleBroken(AssertionError):
    """One part of ROW_RULE a mixed row broke, named as it happened."""


def check_rows(sched, tokens, rows: list, before: dict[int, tuple[int, int, int]]) -> None:
    """Each row the region appended against its request's lengths before it ran: the position,
    then launched_len, inflight_samples and the KV slots allocated, each advanced by one."""
    positions = tokens.positions[len(tokens.positions) - len(rows):]
    for req, position in zip(rows, positions):
        launched, samples, allocated = before[id(req)]
        if sched.mechanisms.on("mixed_prefix_from_launched") and position != launched:
            raise RowRuleBroken(f"{ROW_RULE}: a row was put at position {position}, its launched length is {launched}")
        moved = {"launched_len": req.launched_len - launched, "inflight_samples": req.inflight_samples - samples,
                 "KV slots allocated": req.allocated_len - allocated}
        wrong = [f"{name} by {step}" for name, step in moved.items() if step != 1]
        if wrong:
            raise RowRuleBroken(f"{ROW_RULE}: a mixed row advanced {', '.join(wrong)}, each must advance by one")


def generate(qwen3: str, loop: str, *disabled: str, mixed: bool = True, llm: LLM | None = None,
             prompts: list[list[int]] = PROMPTS) -> tuple[LLM, list[list[int]]]:
    llm = llm or LLM(qwen3, loop=loop, disable=disabled, chunk_size=16, max_running_requests=4, device_delay_ms=2,
                     enable_mixed_chunk=mixed, kv_tokens=KV_TOKENS)
    llm.rows_mixed = []  # decode rows appended to each prefill batch
    if mixed:
        feature = llm.scheduler.features.mixed_chunk
        mix = feature.mix

        def counted(sched, tokens, reqs, *rest):
            first = len(reqs)
            lengths = {id(r): (r.launched_len, r.inflight_samples, r.allocated_len) for r in sched.running.reqs}
            mix(sched, tokens, reqs, *rest)
            llm.rows_mixed.append(len(reqs) - first)
            check_rows(sched, tokens, reqs[first:], lengths)

        feature.mix = counted
    try:
        rids, outs = [], {}
        for p, s in zip(prompts, PARAMS):  # staggered: every prefill finds decodes running
            rids.append(llm.add_request(p, s))
            outs.update({o.rid: o.token_ids for o in llm.step()})
        while llm.has_unfinished():
            outs.update({o.rid: o.token_ids for o in llm.step()})
    except Exception as exc:  # noqa: BLE001 - a crash is reported as the rule it breaks
        if "exercise 12" in str(exc) or isinstance(exc, RowRuleBroken):
            raise
        raise AssertionError(f"{ROW_RULE} ({type(exc).__name__}: {exc})") from None
    return llm, [outs[r] for r in rids]


@pytest.fixture(scope="module")
def plain(qwen3) -> list[list[int]]:
    llm, outs = generate(qwen3, "normal", mixed=False)
    llm.close()
    return outs


@pytest.mark.parametrize("loop, disabled", [("overlap", ()), ("normal", ()), ("overlap", ("future_map",))],
                         ids=["overlap", "normal", "overlap-future_map-off"])
def test_mixed_batches_give_the_plain_tokens(qwen3, plain, loop, disabled):
    """Without the FutureMap the overlap loop commits batch n-1 before planning batch n: no token is
    in flight when a row is mixed in, as in the normal loop. The launched length is right in every
    case; a formula from the committed length and the loop's name is not."""
    llm, outs = generate(qwen3, loop, *disabled)
    assert sum(llm.rows_mixed) > 0, ("mixed chunk: each running request's decode row must ride in the prefill batch "
                                     "(appended after the region); no prefill batch carried one")
    assert llm.scheduler.features.mixed_chunk.decode_rows == sum(llm.rows_mixed)  # counted: the rows that rode
    assert outs == plain, ROW_RULE
    llm.check_invariants()
    llm.close()


def test_mixed_rows_take_their_slots_through_the_ledger(qwen3, plain):
    """A second wave of new prompts on the same engine: the finished first wave fills the cache."""
    llm, outs = generate(qwen3, "overlap")
    assert outs == plain, ROW_RULE
    second = [[p[0] + 20, *p[1:]] for p in PROMPTS]
    try:
        generate(qwen3, "overlap", llm=llm, prompts=second)
    except AssertionError as exc:
        raise AssertionError(f"{LEDGER_RULE} ({exc})") from None
    llm.check_invariants()
    llm.close()


def test_the_switch_is_kept(qwen3, plain):
    llm, outs = generate(qwen3, "overlap", "mixed_prefix_from_launched")
    assert outs != plain, SWITCH_RULE
    llm.close()
    llm, outs = generate(qwen3, "normal", "mixed_prefix_from_launched")
    assert outs == plain, SWITCH_RULE
    llm.close()
