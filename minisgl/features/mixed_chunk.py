"""Mixed chunk: a prefill chunk and the running decodes in one forward (SGLang's enable_mixed_chunk).

Without it a step is either a prefill batch or a decode batch, so while a long prompt is
prefilled chunk by chunk every running request waits. Mixed, each prefill batch also carries one
decode token of every running request (SGLang: `ScheduleBatch.mix_with_running`): the decodes
advance at every step, and the prefill's forward is shared.

A decode row's input id is its latest token, which in the overlap loop is still in flight: the
row takes a FutureMap placeholder, as in a plain decode batch, and the forward resolves it on the
device. Its position is the request's *launched* length. SGLang's older formula computed the
prefix from the committed outputs, `len(prompt) + len(output_ids) + delta`, with `delta = 0`
under the overlap (the outputs lack the token in flight, which is this row's input) and `-1`
serially (they already hold it). minisgl keeps the launched length apart from the committed one
(request.py), so one formula is right in both loops; the switch `mixed_prefix_from_launched`
off uses the committed length the serial way, and the overlap loop then writes every decode
row one position early.

Mixed only when no request on either side asks for logprobs, as in SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mechanisms import Mechanisms
from ..staging import TokenColumns

if TYPE_CHECKING:
    from ..request import Req
    from ..scheduler import Scheduler


class MixedChunk:
    def __init__(self, mechanisms: Mechanisms) -> None:
        self.mechanisms = mechanisms
        self.decode_rows = 0  # decode rows that rode in a prefill batch

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    def mix(self, sched: Scheduler, tokens: TokenColumns, reqs: list[Req], qo_lens: list[int], kv_lens: list[int],
            samples: list[bool]) -> None:
        """Append one decode token of each running request to the prefill batch of `reqs` (a request
        whose last chunk is in that batch samples there, its first decode is the next step's)."""
        prefilled = {id(r) for r in reqs}
        decodes = [r for r in sched.running.reqs
                   if id(r) not in prefilled and not r.finished and not r.will_finish_by_length()]
        if not decodes or any(r.params.logprobs is not None for r in reqs + decodes):
            return
        if sched.kv_ledger.available() < len(decodes):  # optimistic admission: the decode step retracts
            return
        first = len(reqs)
        for req in decodes:
            input_id = sched._decode_input(req)  # a FutureMap placeholder while the token is in flight
            # >>> exercise 12: the decode row
            # as in a decode batch: at the launched length; with the switch off, SGLang's serial formula
            # (WRONG under the overlap: the committed outputs lag one token)
            position = req.launched_len if self.on("mixed_prefix_from_launched") else req.committed_len - 1
            tokens.add(req.row, [input_id], position, sched.kv_ledger.allocate(req, 1))
            req.launched_len += 1
            req.inflight_samples += 1
            # <<< exercise 12
            reqs.append(req)
            qo_lens.append(1)
            kv_lens.append(req.launched_len)
            samples.append(True)
        rode = len(reqs) - first  # the rows appended above: none where the region skipped them (the stub)
        sched.stats.decode_rows += rode
        self.decode_rows += rode
