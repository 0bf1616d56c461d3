"""Parity of minisgl's decoder + paged torch attention with Hugging Face transformers.

Tiny random checkpoints are written by transformers itself (save_pretrained), loaded
back with minisgl.models.decoder.load_model, and compared logit-for-logit in float32 with
the transformers model that wrote them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from minisgl.models.attention import AttentionMetadata, KVCache, TorchAttentionBackend, causal_attention
from minisgl.gpu.piecewise_graph import BUCKET_STEP, SMALLEST_BUCKET, PiecewisePrefill, prefill_token_buckets
from minisgl.models.decoder import CPU_INVARIANT_ROWS, CausalLM, load_model, set_fixed_rows
from minisgl.models.rope import rope_inv_freq, rope_parameters

TOL = dict(atol=1e-4, rtol=1e-4)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Tiny original context, so that short test prompts already cross every band.
    "original_max_position_embeddings": 64,
}

# name -> (model class, config, save_pretrained kwargs)
VARIANTS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SMALL, num_hidden_layers=2, tie_word_embeddings=True), {}),
    "llama3_rope": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**SMALL, num_hidden_layers=2, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)),
        {},
    ),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SMALL, num_hidden_layers=2, tie_word_embeddings=True), {}),
    "qwen2_untied": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**SMALL, num_hidden_layers=2, tie_word_embeddings=False),
        {},
    ),
    # Qwen3 with head_dim (32) != hidden_size / num_heads (16), as in the real models.
    "qwen3": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
        {},
    ),
    # Sharded into several files, 3 layers, multi-query attention (1 kv head for 4 q heads).
    "llama_sharded": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, num_hidden_layers=3, tie_word_embeddings=False),
        {"max_shard_size": "40KB"},
    ),
}
NAMES = list(VARIANTS)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine the
    thread pool's waiting makes this module ~5x slower. Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (checkpoint folder, the transformers model that wrote it)."""
    out = {}
    for i, (name, (cls, make_config, save_kwargs)) in enumerate(VARIANTS.items()):
        torch.manual_seed(1234 + i)
        hf = cls(make_config()).float().eval()
        # transformers initialises biases to 0, norms to 1 and weights with std 0.02, which
        # would hide bias/norm bugs and give nearly flat logits: use bolder random values.
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.1)
        hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
        hf.generation_config.pad_token_id = 0
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder, **save_kwargs)
        out[name] = (folder, hf)
    return out


@pytest.fixture(scope="session")
def loaded(checkpoints) -> dict[str, CausalLM]:
    return {name: load_model(folder, torch.float32, torch.device("cpu"))[0] for name, (folder, _) in checkpoints.items()}


class Runner:
    """Drives CausalLM the way an engine would, with the simplest memory manager:
    KV slots are handed out sequentially, so requests that decode together get
    interleaved (non-contiguous) slots and attention must really follow kv_indices."""

    def __init__(self, model: CausalLM, num_slots: int = 256) -> None:
        self.model = model
        self.kv = KVCache(model.num_layers, num_slots, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
        self.backend = TorchAttentionBackend()
        self.forward = lambda ids, meta: model(ids, meta, self.kv, self.backend)  # or another forward's run()
        self.next_slot = 0
        self.slots: dict[int, list[int]] = {}  # request id -> slot of each position

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one batch: request id -> its new tokens. Returns request id -> logits [vocab]."""
        ids, positions, out_slots, kv_indices, qo_lens, kv_lens = [], [], [], [], [], []
        for rid, tokens in new_tokens.items():
            slots = self.slots.setdefault(rid, [])
            fresh = list(range(self.next_slot, self.next_slot + len(tokens)))
            self.next_slot += len(tokens)
            positions += range(len(slots), len(slots) + len(tokens))
            slots += fresh
            ids += tokens
            out_slots += fresh
            kv_indices += slots
            qo_lens.append(len(tokens))
            kv_lens.append(len(slots))
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=torch.tensor(out_slots, dtype=torch.int64),
            qo_indptr=_indptr(qo_lens),
            kv_indptr=_indptr(kv_lens),
            kv_indices=torch.tensor(kv_indices, dtype=torch.int64),
            qo_lens=qo_lens,
            kv_lens=kv_lens,
        )
        with torch.inference_mode():
            logits = self.forward(torch.tensor(ids, dtype=torch.int64), meta)
        assert logits.shape == (len(new_tokens), self.model.vocab_size) and logits.dtype == torch.float32
        return dict(zip(new_tokens, logits))


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one full-sequence forward pass (no cache)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", NAMES)
def test_batched_prefill_matches_hf(name, checkpoints, loaded):
    hf = checkpoints[name][1]
    batch = prompts([5, 1, 12, 7])
    ours = Runner(loaded[name]).step(dict(enumerate(batch)))
    for rid, tokens in enumerate(batch):
        torch.testing.assert_close(ours[rid], hf_logits(hf, tokens)[-1], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_decode_through_kv_cache_matches_hf(name, checkpoints, loaded):
    hf = checkpoints[name][1]
    seqs = prompts([6, 3, 9], seed=1)
    runner = Runner(loaded[name])
    logits = runner.step(dict(enumerate(seqs)))
    history = {rid: [logits[rid]] for rid in logits}
    for _ in range(8):  # all three requests decode together, one token each
        for rid, seq in enumerate(seqs):
            seq.append(int(history[rid][-1].argmax()))
        logits = runner.step({rid: seq[-1:] for rid, seq in enumerate(seqs)})
        for rid in logits:
            history[rid].append(logits[rid])
    for rid, seq in enumerate(seqs):
        # seq has prompt + 8 generated tokens; logits at the last 9 positions must agree.
        torch.testing.assert_close(torch.stack(history[rid]), hf_logits(hf, seq)[-9:], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_piecewise_prefill_pieces_compute_the_forward(name, checkpoints):
    """The prefill graphs' cut (gpu/piecewise_graph.py), run without capture: each batch padded to
    its token bucket, attention between the pieces on the real tokens only. Every logit and every
    KV slot equals the plain forward's, bit for bit (batch-invariant GEMMs, as on the engine's CPU:
    a row's numbers do not depend on the padding rows beside it). Batches below, at and above the
    smallest bucket, a prompt chunk beside decode rows, and exactly the largest bucket."""
    model = load_model(checkpoints[name][0], torch.float32, torch.device("cpu"))[0]
    set_fixed_rows(model, CPU_INVARIANT_ROWS)
    plain, pieces = Runner(model), Runner(model)
    runner = PiecewisePrefill(model, pieces.kv, pieces.backend, max_tokens=100, device=torch.device("cpu"),
                              capture=False)
    assert runner.buckets == [64, 100]
    pieces.forward = runner.run
    long_prompt = prompts([80], seed=3)[0]
    steps = [dict(enumerate(prompts([5, 1, 12, 7]))),  # 25 tokens: bucket 64
             {0: long_prompt[:40], 4: prompts([24], seed=4)[0]},  # exactly 64
             {0: long_prompt[40:], 1: [3], 2: [4], 3: [5]},  # 43 tokens, three of them decode rows
             {5: prompts([100], seed=5)[0]}]  # the largest bucket, no padding
    for step in steps:
        expected, got = plain.step(step), pieces.step(step)
        assert all(torch.equal(expected[rid], got[rid]) for rid in step), f"logits differ at {sorted(step)}"
    assert all(torch.equal(a, b) for a, b in zip(plain.kv.k + plain.kv.v, pieces.kv.k + pieces.kv.v))


def test_prefill_token_buckets_pad_little():
    """A batch of T tokens runs at the smallest bucket >= T: powers of two up to BUCKET_STEP (at most
    twice T), then steps of BUCKET_STEP, and the largest batch exactly."""
    for max_tokens in (50, 100, 1024, 3000, 8192, 8192 + 256):
        buckets = prefill_token_buckets(max_tokens)
        assert buckets[-1] == max_tokens and buckets == sorted(set(buckets))
        for tokens in range(1, max_tokens + 1):
            bucket = next(b for b in buckets if b >= tokens)
            assert bucket <= max(2 * tokens, SMALLEST_BUCKET) if tokens <= BUCKET_STEP else bucket - tokens < BUCKET_STEP


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_mixed_with_decode_matches_hf(name, checkpoints, loaded):
    hf = checkpoints[name][1]
    long_prompt, short_prompt = prompts([17, 4], seed=2)
    chunks = [long_prompt[:6], long_prompt[6:11], long_prompt[11:]]
    runner = Runner(loaded[name])
    short_seq = list(short_prompt)
    long_logits, short_logits = [], []
    for i, chunk in enumerate(chunks):
        # Request 1 prefills fully in the first batch, then decodes while request 0's chunks continue.
        step = {0: chunk, 1: short_seq if i == 0 else short_seq[-1:]}
        out = runner.step(step)
        long_logits.append(out[0])
        short_logits.append(out[1])
        short_seq.append(int(out[1].argmax()))
    ref_long = hf_logits(hf, long_prompt)
    torch.testing.assert_close(torch.stack(long_logits), ref_long[[5, 10, 16]], **TOL)
    torch.testing.assert_close(torch.stack(short_logits), hf_logits(hf, short_seq[:-1])[-3:], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_hf_generate(name, checkpoints, loaded):
    hf = checkpoints[name][1]
    seqs = prompts([4, 10], seed=3)
    runner = Runner(loaded[name])
    step = dict(enumerate(seqs))
    ours: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(8):
        logits = runner.step(step)
        step = {rid: [int(row.argmax())] for rid, row in logits.items()}
        for rid, tok in step.items():
            ours[rid] += tok
    for rid, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([seq]), max_new_tokens=8, do_sample=False)[0, len(seq) :].tolist()
        assert ours[rid] == ref


def test_tied_and_untied_embeddings(loaded):
    for name, model in loaded.items():
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (name in ("llama", "qwen2", "qwen3")), name


def test_sharded_checkpoint_really_is_sharded(checkpoints):
    folder = checkpoints["llama_sharded"][0]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2


# ---------------------------------------------------------------- pieces


def test_llama3_rope_scaling_touches_each_band(loaded):
    params = rope_parameters(loaded["llama3_rope"].config)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    scaled = rope_inv_freq(16, params)
    plain = rope_inv_freq(16, {"rope_type": "default", "rope_theta": 500000.0})
    ratio = plain / scaled
    # Fast pairs untouched, slow pairs divided by the factor, some blended in between.
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(4.0)).any()
    assert ((ratio > 1.01) & (ratio < 3.99)).any()


def test_torch_backend_paged_gqa_against_dense_reference():
    torch.manual_seed(0)
    hq, hkv, d, num_slots = 4, 2, 8, 64
    kv = KVCache(1, num_slots, hkv, d, torch.float32, "cpu")
    # Request 0 already has 5 cached tokens and adds 3; request 1 is a decode after 6 cached.
    past = {0: 5, 1: 6}
    new = {0: 3, 1: 1}
    perm = torch.randperm(num_slots)  # scattered slots: attention must follow kv_indices
    slots = {0: perm[:8], 1: perm[8:15]}
    full_k = {r: torch.randn(past[r] + new[r], hkv, d) for r in past}
    full_v = {r: torch.randn(past[r] + new[r], hkv, d) for r in past}
    for r in past:  # the cached part is already in the pool
        kv.k[0][slots[r][: past[r]]] = full_k[r][: past[r]]
        kv.v[0][slots[r][: past[r]]] = full_v[r][: past[r]]
    q = torch.randn(4, hq, d)
    meta = AttentionMetadata(
        positions=torch.tensor([5, 6, 7, 6]),
        out_slots=torch.cat([slots[0][5:], slots[1][6:]]),
        qo_indptr=_indptr([3, 1]),
        kv_indptr=_indptr([8, 7]),
        kv_indices=torch.cat([slots[0], slots[1]]),
        qo_lens=[3, 1],
        kv_lens=[8, 7],
    )
    assert meta.num_requests == 2 and not meta.is_decode
    k_new = torch.cat([full_k[0][5:], full_k[1][6:]])
    v_new = torch.cat([full_v[0][5:], full_v[1][6:]])
    out = TorchAttentionBackend().forward(q, k_new, v_new, 0, meta, kv)

    torch.testing.assert_close(kv.k[0][meta.out_slots], k_new)  # new K/V were stored
    for r, rows in ((0, slice(0, 3)), (1, slice(3, 4))):
        k, v = full_k[r].repeat_interleave(2, dim=1), full_v[r].repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k) / math.sqrt(d)
        n_q, n_k = scores.shape[1:]
        visible = torch.ones(n_q, n_k).tril(diagonal=n_k - n_q).bool()
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)
        torch.testing.assert_close(out[rows], ref)
    # A single query at the end of the sequence sees everything.
    torch.testing.assert_close(causal_attention(q[3:], full_k[1], full_v[1]), out[3:])


# ---------------------------------------------------------------- load_model errors


def test_load_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, torch.device("cpu"))


def test_load_dir_without_config_or_weights(tmp_path, checkpoints):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    shutil.copy(checkpoints["llama"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_load_unsupported_architecture(tmp_path, checkpoints):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture MistralForCausalLM; supported: LlamaForCausalLM"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_load_missing_weight(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"][0], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_fill_indptr_writes_offsets_into_a_pinned_sized_buffer():
    """FlashInfer's plan inputs are written in place (pinned buffers on a GPU): offsets, then length."""
    from minisgl.gpu.flashinfer_backend import fill_indptr

    buf = torch.full((6,), -1, dtype=torch.int32)
    n = fill_indptr([3, 1, 5], buf.numpy())
    assert (n, buf[:n].tolist(), buf[n:].tolist()) == (4, [0, 3, 4, 9], [-1, -1])
    assert buf[:fill_indptr([], buf.numpy())].tolist() == [0]
