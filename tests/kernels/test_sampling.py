"""Triton sampler vs the reference sampler and the sampling contract (docs/CONTRACTS.md)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import ember.kernels.sampling as sampling_module
from ember.kernels.hash_rng import row_key, token_uniform
from ember.kernels.sampling import sample
from ember.layers.reference_ops import hash_uniform, sample_reference, sampling_keep_mask

pytestmark = pytest.mark.slow

VOCAB = 3000  # three streaming blocks, the last one partial


def params(
    batch, device, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=None
):
    """Per-row sampling tensors; scalars are broadcast, tensors used as given."""

    def full(value, dtype):
        return torch.as_tensor(value, dtype=dtype).expand(batch).contiguous().to(device)

    return {
        "temperature": full(temperature, torch.float32),
        "top_k": full(top_k, torch.int32),
        "top_p": full(top_p, torch.float32),
        "min_p": full(min_p, torch.float32),
        "seeds": full(seeds if seeds is not None else 1234, torch.int64),
        "steps": full(steps if steps is not None else 0, torch.int64),
    }


def run_both(logits, p):
    got = sample(logits, **p).cpu()
    expected = sample_reference(logits.cpu(), **{k: v.cpu() for k, v in p.items()})
    return got, expected


# --------------------------------------------------------------------------------------------
# The random stream


def _mix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_reference_hash_follows_contract_text():
    """Python-int arithmetic of the contract; u is then formed in float32."""
    seed, step = (7 << 32) + 99, 12
    h = _mix32_python(_mix32_python(_mix32_python(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ step)
    top_bits = torch.tensor([_mix32_python(h ^ _mix32_python(i)) >> 8 for i in range(50)])
    expected = (top_bits.to(torch.float32) + 0.5) / 2**24
    got = hash_uniform(torch.tensor([seed]), torch.tensor([step]), 50)[0]
    assert torch.equal(got, expected)


@triton.jit
def _uniform_kernel(seeds_ptr, steps_ptr, out_ptr, first, count, BLOCK: tl.constexpr):
    """u of tokens [first, first + count) of each row."""
    row = tl.program_id(0)
    key = row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    offsets = tl.arange(0, BLOCK)
    u = token_uniform(key, first + offsets)
    tl.store(out_ptr + row * count + offsets, u, mask=offsets < count)


def test_triton_hash_is_bit_exact(gen, device):
    seeds = torch.randint(0, 2**62, (4,), generator=gen)
    steps = torch.randint(0, 2**31, (4,), generator=gen)
    out = torch.empty(4, 100, device=device)
    _uniform_kernel[(4,)](seeds.to(device), steps.to(device), out, 0, 100, BLOCK=128)
    assert torch.equal(out.cpu(), hash_uniform(seeds, steps, 100))


def test_saturated_draw_stays_below_one(device):
    """float32 rounds (2**24 - 1) + 0.5 up to 2**24; u must stay < 1 (else E = 0 and the token
    wins outright). Seed 0, step 12 draws all-ones hash bits for token 972081."""
    seeds, steps, token = torch.tensor([0]), torch.tensor([12]), 972_081
    expected = hash_uniform(seeds, steps, token + 1)[0, -1]
    assert expected == 1.0 - 2.0**-24
    out = torch.empty(1, 1, device=device)
    _uniform_kernel[(1,)](seeds.to(device), steps.to(device), out, token, 1, BLOCK=16)
    assert out[0, 0].item() == expected


# --------------------------------------------------------------------------------------------
# Agreement with the reference


def test_greedy_is_first_argmax(gen, device):
    logits = torch.randn(5, VOCAB, generator=gen)
    logits[1, [7, 2500]] = 50.0  # a tie: the first index wins
    logits[2, :] = float("-inf")
    logits[2, 1234] = 0.0
    got = sample(logits.to(device), **params(5, device, temperature=0.0)).cpu()
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1] == 7


def _random_params(gen, batch, device):
    """Rows spread over every path: greedy, plain, min-p only, top-k, top-p, and mixes."""
    choice = torch.randint(0, 6, (batch,), generator=gen)
    u = torch.rand(4, batch, generator=gen)
    temperature = torch.where(choice == 0, 0.0, 0.3 + 1.5 * u[0])
    top_k = torch.where((choice == 3) | (choice == 5), (u[1] * 200).int() + 1, 0)
    top_k = torch.where(u[3] < 0.15, 1500, top_k)  # kept sets beyond the candidate list
    top_p = torch.where((choice == 4) | (choice == 5), 0.5 + 0.5 * u[2], 1.0)
    min_p = torch.where(choice == 2, 0.2 * u[3], torch.where(u[3] > 0.8, 0.05, 0.0))
    seeds = torch.randint(0, 2**40, (batch,), generator=gen)
    steps = torch.randint(0, 1000, (batch,), generator=gen)
    return params(
        batch,
        device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        steps=steps,
    )


@pytest.mark.parametrize("candidates", [32, sampling_module._CANDIDATES])
def test_same_tokens_as_reference(gen, device, monkeypatch, candidates):
    """A small candidate list forces the whole-row threshold searches; the default list takes
    the compaction path for usual top-k/top-p sets."""
    monkeypatch.setattr(sampling_module, "_CANDIDATES", candidates)
    batch = 24
    logits = torch.randn(batch, VOCAB, generator=gen) * (
        1 + 3 * torch.rand(batch, 1, generator=gen)
    )
    logits[0, : VOCAB // 2] = float("-inf")  # e.g. banned by a logit bias
    got, expected = run_both(logits.to(device), _random_params(gen, batch, device))
    assert got.tolist() == expected.tolist()


def test_top_k_one_is_greedy(gen, device):
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    p = params(
        6,
        device,
        temperature=torch.linspace(0.5, 2.0, 6),
        top_k=1,
        seeds=torch.arange(6),
        steps=torch.arange(6) * 7,
    )
    got = sample(logits.to(device), **p).cpu()
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "filters",
    [{"top_k": 20}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 50, "top_p": 0.9, "min_p": 0.02}],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_samples_stay_in_kept_set(gen, device, filters):
    """Many draws of one row: every token is in the reference's kept set, and draws vary."""
    draws, vocab = 32, 1200
    logits = (torch.randn(1, vocab, generator=gen) * 2.5).expand(draws, vocab).contiguous()
    p = params(draws, device, temperature=1.0, seeds=42, steps=torch.arange(draws), **filters)
    tokens = sample(logits.to(device), **p).cpu()
    keep = sampling_keep_mask(
        logits[:1], *(p[k][:1].cpu() for k in ("temperature", "top_k", "top_p", "min_p"))
    )[0]
    assert keep[tokens].all()
    kept_probs = logits[0].masked_fill(~keep, float("-inf")).softmax(-1)
    if kept_probs.max() < 0.8:  # else 32 equal draws are likely enough (>0.1%) to be fair
        assert len(set(tokens.tolist())) > 1
    assert keep.sum() < vocab // 2  # the filters did cut something


def test_draws_do_not_depend_on_batch(gen, device):
    """Same (seed, step) -> same token, whatever the batch composition and order."""
    batch = 8
    logits = torch.randn(batch, VOCAB, generator=gen) * 2
    p = _random_params(gen, batch, device)
    alone = sample(logits.to(device), **p).cpu()

    order = torch.randperm(batch, generator=gen)
    extra = torch.randn(3, VOCAB, generator=gen)
    mixed_logits = torch.cat([logits[order], extra])
    mixed_p = {k: torch.cat([v[order.to(v.device)], v[:3]]) for k, v in p.items()}
    mixed = sample(mixed_logits.to(device), **mixed_p).cpu()
    assert mixed[:batch].tolist() == alone[order].tolist()


def test_step_changes_the_draw(gen, device):
    logits = torch.zeros(32, VOCAB)  # uniform: the draw is the hash alone
    tokens = sample(logits.to(device), **params(32, device, steps=torch.arange(32))).cpu()
    assert len(set(tokens.tolist())) > 24


def test_large_vocab(gen, device):
    """Qwen-sized vocabulary through the fast path and the filtered path."""
    vocab = 151_936
    logits = torch.randn(2, vocab, generator=gen) * 3
    p = params(
        2,
        device,
        temperature=torch.tensor([1.0, 0.8]),
        top_k=torch.tensor([0, 40]),
        top_p=torch.tensor([1.0, 0.9]),
    )
    got, expected = run_both(logits.to(device), p)
    assert got.tolist() == expected.tolist()
