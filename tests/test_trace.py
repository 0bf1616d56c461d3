"""Tracing: metrics, Chrome trace export, the terminal timeline, and what a real run shows.

The real-run tests use `device_delay_ms=20`: a forward then takes ~20 ms while the host's
work per iteration is well under a millisecond, so the overlap loop should keep the device
busy nearly all the time and the normal loop should leave a gap (the bubble) after every
forward. Timing on a shared machine is noisy, so those checks compare medians and ratios,
and re-measure a couple of times before failing; a broken overlap fails every attempt.
"""

import io
import json

import pytest
from rich.console import Console

from minisgl import LLM, SamplingParams
from minisgl.sampling_params import RequestOutput
from minisgl.observe.timeline import render_timeline
from minisgl.observe.trace import merge_intervals, pipeline_metrics, request_metrics, to_chrome_trace, write_chrome_trace
from minisgl.tracer import HOST_LANE, Span, SpanName

pytest.importorskip("transformers")

T = 1000.0  # an arbitrary perf_counter origin: every result must be relative to the spans


def S(name, lane, start, end, iteration, batch_id=-1):
    return Span(name, lane, T + start, T + end, iteration, batch_id)


def hand_spans():
    """Four iterations; two device lanes; forwards b0 and b1 overlap on the device, and so do
    b2 and a forward on a second stream."""
    schedule, launch, wait, commit, forward = (SpanName.SCHEDULE, SpanName.LAUNCH, SpanName.WAIT, SpanName.COMMIT,
                                               SpanName.FORWARD)
    return [
        S(schedule, "host", 0, 1, 1), S(launch, "host", 1, 2, 1, 0),
        S(schedule, "host", 2, 2.5, 2), S(launch, "host", 2.5, 3, 2, 1),
        S(wait, "host", 3, 9, 2, 0), S(commit, "host", 9, 9.5, 2, 0),
        S(schedule, "host", 9.5, 10, 3), S(launch, "host", 10, 10.5, 3, 2),
        S(wait, "host", 10.5, 14, 3, 1), S(commit, "host", 14, 15, 3, 1),
        S(schedule, "host", 15, 16, 4), S(launch, "host", 16, 17, 4, 3),
        S(wait, "host", 17, 20, 4, 2), S(commit, "host", 20, 21, 4, 2),
        S(forward, "engine", 2, 6, 1, 0),
        S(forward, "engine", 5, 9, 2, 1),  # overlaps b0 by 1: counted once
        S(forward, "engine", 10, 14, 3, 2),
        S(forward, "aux", 13, 15, 3, 2),  # another stream, overlapping b2
        S(forward, "engine", 17, 20, 4, 3),
    ]


# ----------------------------------------------------------------------------- (a) metrics by hand


def test_merge_intervals():
    assert merge_intervals([(5, 9), (2, 6), (10, 14), (13, 15), (17, 20)]) == [(2, 9), (10, 15), (17, 20)]
    assert merge_intervals([(0, 1), (1, 2)]) == [(0, 2)]
    assert merge_intervals([]) == []


def test_pipeline_metrics_hand_computed():
    m = pipeline_metrics(hand_spans())
    approx = pytest.approx
    assert m["wall_s"] == approx(21.0)
    # Device union: [2, 9] + [10, 15] + [17, 20] = 15 busy over the window [2, 20] = 18.
    assert m["device_busy_fraction"] == approx(15 / 18)
    # Gaps of the union, not of consecutive spans: 9->10 and 15->17.
    assert m["num_idle_gaps"] == 2
    assert m["idle_gap_total_s"] == approx(3.0)
    assert m["idle_gap_mean_s"] == approx(1.5)
    assert m["idle_gap_median_s"] == approx(1.5)
    assert m["num_forwards"] == 5  # every forward span counts, on any stream
    assert m["device_time_per_forward_s"] == approx((4 + 4 + 4 + 2 + 3) / 5)  # G
    # After each batch's launch ended: b2's span starts 0.5 inside its launch, the aux forward after it.
    assert m["forward_after_launch_s"] == approx((4 + 4 + 3.5 + 2 + 3) / 5)
    # C: host time per iteration without WAIT: 2, 1.5, 2, 3.
    assert m["num_iterations"] == 4
    assert m["host_time_per_iteration_s"] == approx(8.5 / 4)
    assert m["exposed_host_time_per_step_s"] == approx(3.0 / 5)
    assert m["host_wait_fraction"] == approx((6 + 3.5 + 3) / 21)


def test_a_serving_loops_io_span_is_host_work():
    """A serving loop's own work between two steps (lesson 13) is part of C, as the scheduler's spans are."""
    spans = hand_spans() + [S(SpanName.IO, "host", 21, 22.5, 4)]
    assert pipeline_metrics(spans)["host_time_per_iteration_s"] == pytest.approx((8.5 + 1.5) / 4)


def test_pipeline_metrics_degenerate():
    assert pipeline_metrics([])["num_forwards"] == 0
    m = pipeline_metrics([S(SpanName.FORWARD, "engine", 0, 2, 1, 0)])
    assert m["device_busy_fraction"] == 1.0 and m["idle_gap_total_s"] == 0.0
    assert m["host_time_per_iteration_s"] == 0.0


def _output(rid, n, ttft, e2e, tpot=None):
    metrics = {"ttft": ttft, "e2e": e2e}
    if tpot is not None:
        metrics["tpot"] = tpot
    return RequestOutput(rid, [1, 2], list(range(n)), "", "length", metrics)


def test_request_metrics_hand_computed():
    outs = [_output(0, 3, 1.0, 3.0, 1.0), _output(1, 5, 2.0, 6.0, 1.0), _output(2, 1, 3.0, 3.0),
            _output(3, 4, 4.0, 10.0, 2.0)]
    m = request_metrics(outs)
    assert m["num_requests"] == 4 and m["output_tokens"] == 13
    assert m["ttft_mean_s"] == pytest.approx(2.5)
    assert m["ttft_p50_s"] == pytest.approx(2.5)
    assert m["ttft_p90_s"] == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert m["tpot_mean_s"] == pytest.approx(4 / 3)  # only requests with >= 2 tokens have a TPOT
    assert m["e2e_mean_s"] == pytest.approx(5.5)
    assert request_metrics([])["output_tokens"] == 0


# ----------------------------------------------------------------------------- (b) Chrome trace


def check_chrome(trace, spans):
    trace = json.loads(json.dumps(trace))  # plain JSON all the way down
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[1].startswith("host")  # the host lane first
    device_lanes = sorted({sp.lane for sp in spans if sp.lane != "host"})
    assert sorted(n.split(": ", 1)[1] for tid, n in names.items() if tid != 1) == device_lanes
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(spans)
    assert min(e["ts"] for e in xs) == 0
    for e in xs:
        assert e["pid"] == 1 and e["tid"] in names
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert {"iteration", "batch_id"} <= set(e["args"])
    # Host spans nest sensibly: within one iteration, no two host spans overlap.
    host = [e for e in xs if e["tid"] == 1]
    for it in {e["args"]["iteration"] for e in host}:
        same = sorted((e for e in host if e["args"]["iteration"] == it), key=lambda e: e["ts"])
        for a, b in zip(same, same[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 0.01, (a, b)  # 0.01 us: rounding
    return events


def test_chrome_trace_hand_spans(tmp_path):
    spans = hand_spans()
    events = check_chrome(to_chrome_trace(spans), spans)
    b1 = next(e for e in events if e["ph"] == "X" and e["args"]["batch_id"] == 1 and e["args"]["kind"] == SpanName.FORWARD.value)
    assert b1["ts"] == pytest.approx(5e6) and b1["dur"] == pytest.approx(4e6)  # microseconds
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(to_chrome_trace(spans)))


# ----------------------------------------------------------------------------- (c) a real run

PROMPTS = ["the quick brown fox", "hello world", "one two three four five", "a tiny model"]
DELAY_MS = 20


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from minisgl.demo.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("trace_model") / "qwen3", "qwen3")


def traced_run(path, loop, delay_ms=DELAY_MS):
    llm = LLM(path, loop=loop, device_delay_ms=delay_ms, trace=True)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
        spans = list(llm.engine.tracer.resolve())
    finally:
        llm.close()
    return outputs, spans


@pytest.fixture(scope="module")
def runs(tiny_model):
    return {loop: traced_run(tiny_model, loop) for loop in ("normal", "overlap")}


def retry(measure, check, first=None, attempts=4):
    """Timing checks: pass if any of `attempts` measurements passes (the machine is shared)."""
    error = None
    for i in range(attempts):
        data = first if i == 0 and first is not None else measure()
        try:
            return check(data)
        except AssertionError as exc:
            error = exc
    raise error


def forwards_by_batch(spans):
    return {sp.batch_id: sp for sp in spans if sp.lane != HOST_LANE and sp.name == SpanName.FORWARD}


def launches_by_batch(spans):
    return {sp.batch_id: sp for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.LAUNCH}


def test_real_run_records_every_batch(runs):
    for loop, (outputs, spans) in runs.items():
        fwd, launch = forwards_by_batch(spans), launches_by_batch(spans)
        assert sorted(fwd) == sorted(launch) == list(range(len(fwd))), loop
        assert len(fwd) >= 8  # one prefill + 7 decode steps for 8 tokens
        assert {sp.lane for sp in spans} == {"host", "engine"}
        assert all(sp.end >= sp.start for sp in spans)
        m = request_metrics(outputs)
        assert m["output_tokens"] == len(PROMPTS) * 8
        assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["e2e_mean_s"] * 2
        assert m["tpot_mean_s"] >= DELAY_MS / 1000 * 0.9  # every token waits for a forward


def test_real_run_chrome_trace(runs):
    for _, spans in runs.values():
        check_chrome(to_chrome_trace(spans), spans)


def test_overlap_launches_next_batch_while_device_runs(runs, tiny_model):
    def check(run):
        _, spans = run
        fwd, launch = forwards_by_batch(spans), launches_by_batch(spans)
        steady = [n for n in sorted(fwd)[1:] if n + 1 in launch]  # decode steps after the prefill
        assert len(steady) >= 5
        hidden = [n for n in steady if launch[n + 1].start < fwd[n].end]
        assert len(hidden) >= 0.75 * len(steady), f"launch of n+1 before forward n ended only for {hidden}"

    retry(lambda: traced_run(tiny_model, "overlap"), check, first=runs["overlap"])


def test_normal_never_launches_while_device_runs(runs):
    _, spans = runs["normal"]
    fwd = list(forwards_by_batch(spans).values())
    for la in launches_by_batch(spans).values():
        assert not any(f.start < la.start < f.end for f in fwd), la
    # The bubble *is* the host's work: between forward n and n+1 lie commit n and schedule n+1.
    by_batch = forwards_by_batch(spans)
    commits = {sp.batch_id: sp for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.COMMIT}
    schedules = {sp.iteration: sp for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.SCHEDULE}
    for n in sorted(by_batch)[:-1]:
        gap_start, gap_end = by_batch[n].end, by_batch[n + 1].start
        sched = schedules[by_batch[n + 1].iteration]
        assert gap_start <= commits[n].start and sched.end <= gap_end


def test_overlap_keeps_device_busier(runs, tiny_model):
    def check(pair):
        normal, overlap = (pipeline_metrics(spans) for _, spans in pair)
        assert overlap["device_busy_fraction"] > 0.9, overlap
        assert overlap["device_busy_fraction"] > normal["device_busy_fraction"], (normal, overlap)
        # Per step the normal loop's device sits through the host's commit + schedule + launch;
        # the overlap loop's only through the stream's own hand-off. Medians shrug off the
        # odd descheduling hiccup of a loaded machine.
        assert normal["idle_gap_median_s"] > 3 * overlap["idle_gap_median_s"], (normal, overlap)
        assert normal["exposed_host_time_per_step_s"] > overlap["exposed_host_time_per_step_s"]

    retry(lambda: (traced_run(tiny_model, "normal"), traced_run(tiny_model, "overlap")), check,
          first=(runs["normal"], runs["overlap"]))


# ----------------------------------------------------------------------------- (d) the timeline


def render_text(spans, title="t"):
    console = Console(record=True, width=100, file=io.StringIO(), color_system="truecolor")
    console.print(render_timeline(spans, title))
    return console.export_text()


def test_timeline_renders_real_runs(runs):
    for loop, (_, spans) in runs.items():
        text = render_text(spans, f"{loop} loop")
        assert f"{loop} loop" in text
        lines = text.splitlines()
        assert all(len(line) <= 100 for line in lines)
        lanes = {line.strip("│ ").split(" ")[0] for line in lines}
        assert {"host", "launch", "engine"} <= lanes
        assert "ms" in text and "forward" in text and "schedule" in text  # axis and legend


def test_timeline_hand_spans_show_bubbles_and_labels():
    text = render_text(hand_spans(), "hand")
    engine = next(line for line in text.splitlines() if line.strip("│ ").startswith("engine"))
    assert "·" in engine  # the device gaps 9->10 and 15->17 are drawn
    assert "b2" in engine  # forwards are labelled with their batch id
    schedule, launch, forward = SpanName.SCHEDULE, SpanName.LAUNCH, SpanName.FORWARD
    no_gaps = [S(schedule, "host", 0, 1, 1), S(launch, "host", 1, 2, 1, 0),
               S(schedule, "host", 2, 3, 2), S(launch, "host", 3, 4, 2, 1),
               S(forward, "engine", 2, 12, 1, 0), S(forward, "engine", 12, 22, 2, 1)]
    engine = next(line for line in render_text(no_gaps).splitlines() if line.strip("│ ").startswith("engine"))
    assert "·" not in engine and "b0" in engine and "b1" in engine


def test_timeline_empty():
    assert "no spans" in render_text([])


def test_host_work_by_phase_separates_the_mix_of_iterations():
    """C per iteration by the phase of the batch each iteration launched (observe/breakdown.py):
    hand_spans' iterations 1-4 launch batches 0-3; batch 0 a prefill, 1-2 full decode, 3 a tail."""
    from minisgl.observe.breakdown import NO_LAUNCH, host_by_phase, phase_of
    from minisgl.tracer import BatchRecord

    full = 4
    batches = [BatchRecord(0, True, 2, 10, 10, 50, 2), BatchRecord(1, False, full, full, 40, 40, full),
               BatchRecord(2, False, full, full, 44, 44, full), BatchRecord(3, False, 1, 1, 12, 12, 1)]
    spans = hand_spans() + [S(SpanName.COMMIT, "host", 21, 21.5, 5, 3)]  # a fifth iteration only commits
    by_phase = host_by_phase(spans, batches, full)
    # Host work without WAIT per iteration (test above): 2, 1.5, 2, 3, then 0.5.
    totals = {phase: (t["iterations"], t["host_s"]) for phase, t in by_phase.items()}
    assert totals == {"prefill": (1, pytest.approx(2.0)), phase_of(full, False, full): (2, pytest.approx(3.5)),
                      phase_of(1, False, full): (1, pytest.approx(3.0)), NO_LAUNCH: (1, pytest.approx(0.5))}
    assert sum(n for n, _ in totals.values()) == pipeline_metrics(spans)["num_iterations"]
    # ... and by span: the full-batch iterations 2 and 3 scheduled 0.5 + 0.5, launched 0.5 + 0.5,
    # committed batches 0 and 1 in 0.5 + 1 (an iteration commits the batch before its own).
    full_decode = by_phase[phase_of(full, False, full)]
    assert (full_decode[SpanName.SCHEDULE], full_decode[SpanName.LAUNCH], full_decode[SpanName.COMMIT]) == \
        (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.5))


def test_breakdown_prints_c_by_span_and_the_allocator():
    """`bench --breakdown`'s table (observe/bench.py): each phase's C per iteration, then its
    schedule / launch / commit parts, and on CUDA the allocator's counts during the run."""
    from minisgl.observe import bench
    from minisgl.observe.breakdown import ModelCost, breakdown
    from minisgl.tracer import BatchRecord

    full = 4
    batches = [BatchRecord(0, True, 2, 10, 10, 50, 2), BatchRecord(1, False, full, full, 40, 40, full),
               BatchRecord(2, False, full, full, 44, 44, full), BatchRecord(3, False, 1, 1, 12, 12, 1)]
    cost = ModelCost(matmul_params=1000, layers=2, q_size=8, kv_bytes_per_token=10)
    rows = breakdown(hand_spans(), batches, cost, hbm=1e6, flops=1e9, full_batch=full)
    console = Console(record=True, width=150, file=io.StringIO())
    bench.print_breakdown({"loop": "overlap", "breakdown": rows,
                           "allocator": {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 0}}, console)
    text = console.export_text()
    full_row = next(line for line in text.splitlines() if "full batch" in line)
    # iterations 2 and 3 (ms per iteration, the hand spans' seconds x 1000): 1750 in all,
    # schedule 500, launch 500, commit 750
    assert full_row.split()[-6:] == ["1750.00", "500.00", "/", "500.00", "/", "750.00"]
    assert "3 cudaMalloc, 1 cudaFree, 0 retries" in text


def test_host_work_step_by_step_counts_the_launching_iterations():
    """C step by step (the lab's ideal pairs it with forwards): the iterations that launched, in
    launch order; hand_spans' four, not a fifth that only commits."""
    from minisgl.observe.trace import host_work_by_launch

    spans = hand_spans() + [S(SpanName.COMMIT, "host", 21, 21.5, 5, 3)]
    assert host_work_by_launch(spans) == pytest.approx([2.0, 1.5, 2.0, 3.0])


def test_cuda_spans_resolve_each_pair_once_the_device_has_passed_it(monkeypatch):
    """A CPU check of the CUDA tracer's bookkeeping (fake events): a span comes out once both of
    its events have completed, oldest first, so only the forwards in flight keep their events;
    resolve(wait=True) syncs and hands out the rest."""
    import torch

    from minisgl.gpu.cuda_spans import CudaSpans
    from minisgl.tracer import SpanName

    clock = {"now_ms": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            self.done, self.at_ms = False, None

        def record(self) -> None:
            clock["now_ms"] += 1.0
            self.at_ms = clock["now_ms"]

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, other: "FakeEvent") -> float:
            return other.at_ms - self.at_ms

    synced = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    spans = CudaSpans()
    starts = [spans.begin() for _ in range(3)]
    for start in starts:
        start.done = True
    assert spans.end(starts[0], SpanName.FORWARD, "engine", 0, 0) == []  # its end event not passed yet
    spans.pending[0][3].done = True
    got = spans.end(starts[1], SpanName.FORWARD, "engine", 1, 1)
    assert [(f[4], round((f[3] - f[2]) * 1000)) for f in got] == [(0, 3)] and len(spans.pending) == 1
    spans.end(starts[2], SpanName.FORWARD, "engine", 2, 2)
    assert not synced and len(spans.pending) == 2  # the device has passed neither end
    assert [f[4] for f in spans.resolve(wait=True)] == [1, 2] and synced and not spans.pending


def test_the_decode_floor_takes_the_longer_of_bytes_and_flops_for_gemms_and_attention_apart():
    """ModelCost.decode_floor by hand: the GEMMs are bound by the weights' bytes at few rows and
    by their FLOPs at many; attention by the KV's bytes; the two add (they run one after the other)."""
    from minisgl.observe.breakdown import ModelCost

    cost = ModelCost(matmul_params=1000, layers=2, q_size=8, kv_bytes_per_token=10)  # 2,000 weight bytes
    hbm, flops = 1e3, 1e5
    # 1 row: GEMMs max(2000 / 1e3, 2 * 1000 * 1 / 1e5) = 2.0 s; attention max(50 * 10 / 1e3, 4 * 2 * 8 * 50 / 1e5)
    assert cost.decode_floor(1, 50, hbm, flops) == pytest.approx(2.0 + 0.5)
    # 400 rows: the GEMMs' FLOPs (8.0 s) pass the weights' read (2.0 s)
    assert cost.decode_floor(400, 50, hbm, flops) == pytest.approx(8.0 + 0.5)
    # attention's FLOPs pass its bytes when the matmul rate is low
    assert cost.decode_floor(1, 50, hbm, 1e3) == pytest.approx(2.0 + 3.2)


def test_the_roofline_counts_the_gemms_flops_where_they_pass_the_bytes(monkeypatch):
    """bench.roofline on a hand workload: two requests decoding 2 and 1 tokens; its decode time is
    the sum of the steps' decode_floor, and the bytes-only figure is kept beside it."""
    from types import SimpleNamespace

    from minisgl.observe import bench
    from minisgl.observe.bench import Workload
    from minisgl.observe.breakdown import ModelCost

    cost = ModelCost(matmul_params=1000, layers=2, q_size=8, kv_bytes_per_token=10)
    workload = Workload("hand", [[1] * 3, [1] * 5], [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=1)])
    args = SimpleNamespace(device="cpu", ceilings=(1e3, 1e3))
    monkeypatch.setattr(ModelCost, "from_config", classmethod(lambda cls, model: cost))
    floor = bench.roofline("unused", workload, args)
    steps = cost.decode_floor(2, 4 + 6, 1e3, 1e3) + cost.decode_floor(1, 5, 1e3, 1e3)
    assert floor["decode_s"] == pytest.approx(steps)
    assert floor["decode_bytes_only_s"] == pytest.approx((2000 + 100) / 1e3 + (2000 + 50) / 1e3)
    assert floor["decode_s"] > floor["decode_bytes_only_s"]  # 2 rows: 4 s of GEMM FLOPs against 2 s of reads
