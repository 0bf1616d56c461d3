"""Mixed chunk in the overlap loop: a row stays taken until the last batch *planned* with it commits.

With prefill_sync, batch n-1 is committed after batch n is planned and before it launches. Mixed,
batch n carries a decode row of every running request, so n-1 may finish (EOS) a request whose
row n still uses. Freed at that commit, the row went to the next admission, whose prefix copy into
the row's table line raced n's write of the same line: a few requests in a few hundred got wrong
tokens. The demo model's answers end by EOS, and the arrivals come in bursts, as a server's do.
"""

from __future__ import annotations

import random

from minisgl import LLM, SamplingParams
from minisgl.demo.paths import demo_model_path

from .conftest import assert_pool_whole

PROMPTS = ["count 3 to 9:", "count 1 to 4:", "add 17 25:", "hello", "abc", "The quick brown fox",
           "count 10 to 20:", "reverse abc:"]
GREEDY = SamplingParams(max_new_tokens=60, temperature=0.0)


def test_mixed_chunk_under_bursts_keeps_rows_and_tokens():
    model = str(demo_model_path())
    with LLM(model, loop="normal") as llm:
        expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    rng = random.Random(1)
    prompt_of: dict[int, str] = {}
    wrong, finished_by_eos = [], 0
    with LLM(model, loop="overlap", enable_mixed_chunk=True, max_running_requests=64) as llm:
        while len(prompt_of) < 300 or llm.has_unfinished():
            for _ in range(rng.choice([0, 5, 20, 50]) if len(prompt_of) < 300 else 0):
                prompt = PROMPTS[len(prompt_of) % len(PROMPTS)]
                prompt_of[llm.add_request(prompt, GREEDY)] = prompt
            for out in llm.step():
                finished_by_eos += out.finish_reason == "stop"
                if out.token_ids != expected[prompt_of[out.rid]]:
                    wrong.append((prompt_of[out.rid], out.token_ids))
            llm.check_invariants()  # a row free while a batch in flight uses it fails here, every time
        assert llm.stats.decode_rows > 0 and llm.stats.early_commits > 0  # the path under test was taken
        assert_pool_whole(llm)
    assert finished_by_eos > 0
    assert wrong == []
