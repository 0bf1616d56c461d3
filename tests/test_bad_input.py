"""Every bad input gets one clear error, and requests already in flight still finish."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from minisgl import LLM, SamplingParams

from .conftest import assert_pool_whole

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("params, message", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
])
def test_bad_sampling_params(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hello"], SamplingParams(**params))


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * (llm.max_seq_len + 3)], GREEDY)


def test_token_ids_out_of_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**9]], GREEDY)


def test_kv_pool_too_small_for_request(llm):
    with pytest.raises(ValueError, match="KV slots"):
        llm.generate([[5] * 300], SamplingParams(max_new_tokens=400))


def test_unknown_mechanism(qwen3):
    with pytest.raises(ValueError, match="unknown mechanism"):
        LLM(qwen3, disable=("future_map", "warp_drive"))


def test_missing_and_malformed_model_dir(tmp_path, qwen3):
    with pytest.raises(ValueError):
        LLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(qwen3, broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ValueError):
        LLM(broken)


def test_unsupported_architecture(tmp_path, qwen3):
    other = tmp_path / "gpt2ish"
    shutil.copytree(qwen3, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(other)


def test_bad_request_does_not_disturb_requests_in_flight(llm):
    prompts = ["hello there", "count 1 to 9:", "the lazy dog"]
    ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    rids = [llm.add_request(p, GREEDY) for p in prompts]
    llm.step()
    llm.step()  # now prefilled and decoding, one batch in flight
    with pytest.raises(ValueError):
        llm.add_request("", GREEDY)
    with pytest.raises(ValueError):
        llm.add_request("hello", SamplingParams(temperature=-1))
    with pytest.raises(ValueError):
        llm.add_request([5] * 300, SamplingParams(max_new_tokens=400))
    outs = {}
    while llm.has_unfinished():
        outs.update({o.rid: o for o in llm.step()})
    assert [outs[r].token_ids for r in rids] == ref
    assert_pool_whole(llm)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minisgl", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("extra", [
    ["--max-new-tokens", "0"],
    ["--temperature", "-1"],
    ["--top-p", "2"],
    ["--disable", "warp_drive"],
    ["--prompt", ""],
])
def test_cli_bad_input_exits_2_without_traceback(qwen3, extra):
    proc = run_cli("generate", "--model", qwen3, "--prompt", "hi", *extra)
    assert proc.returncode == 2, proc.stderr
    assert "error" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_missing_model_exits_2(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "error" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_generate_prints_output(qwen3):
    proc = run_cli("generate", "--model", qwen3, "--prompt", "hello", "--max-new-tokens", "5", "--loop", "normal")
    assert proc.returncode == 0, proc.stderr
    assert "length" in proc.stdout
