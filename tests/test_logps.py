"""GRPO's and RLOO's completion log-probs in chunks (snaketrl.train.logps): TRL's values and gradients, with no
logits tensor larger than a chunk."""

import inspect
import types
from types import SimpleNamespace

import pytest

VOCAB, ROWS, PROMPT, KEEP = 8192, 4, 12, 20


def lora_model():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model


def fake_trainer(cls, model):
    """What TRL's method reads of its trainer."""
    trainer = SimpleNamespace(temperature=0.7, _entropy_bonus_enabled=False,
                              model_kwarg_keys=inspect.signature(model.get_base_model().forward).parameters.keys(),
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True))
    trainer._get_per_token_logps_and_entropies = types.MethodType(cls._get_per_token_logps_and_entropies, trainer)
    return trainer


class Largest:
    """The largest tensor any torch op returns while it is entered (forward and backward)."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        largest = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        largest.bytes = max(largest.bytes, t.numel() * t.element_size())
                return out

        self.bytes, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("trainer_class", ["GRPOTrainer", "RLOOTrainer"])
def test_chunked_completion_logps_are_trls_without_its_logits(trainer_class, monkeypatch):
    import torch
    import trl

    from snaketrl.train import logps

    cls = getattr(trl, trainer_class)
    monkeypatch.setattr(logps, "CHUNK_BYTES", 24 * VOCAB * 4)  # chunks of 24 of the 80 positions
    ids = torch.randint(0, VOCAB, (ROWS, PROMPT + KEEP), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    weights = torch.randn(ROWS, KEEP, generator=torch.Generator().manual_seed(2))
    results = {}
    for chunked in (False, True):
        model = lora_model()
        trainer = fake_trainer(cls, model)
        if chunked:
            logps.chunk_completion_logits(trainer)
        with Largest() as largest:
            lp, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, KEEP, compute_entropy=True)
            (lp * weights).sum().backward()
        with torch.no_grad():  # as for the old policy's and the reference's log-probs, two rows at a time
            lp_rows, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, KEEP, batch_size=2)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[chunked] = lp.detach(), entropy, lp_rows, grads, largest.bytes
    (lp, entropy, lp_rows, grads, trl_largest), (lp2, entropy2, lp_rows2, grads2, largest) = results[False], results[True]
    assert lp.shape == lp2.shape == (ROWS, KEEP) and len(grads) == len(grads2) == 8
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy2, entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_rows2, lp_rows, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-4, atol=1e-6)
    assert trl_largest >= ROWS * (KEEP + 1) * VOCAB * 4  # TRL: every completion position's logits at once
    assert largest == 24 * VOCAB * 4  # here: one chunk's (the tied weights, 16 x VOCAB, are smaller)


def test_a_batch_whose_logits_fit_one_chunk_keeps_trls_path(monkeypatch):
    import torch
    import trl

    from snaketrl.train import logps

    model = lora_model()
    trainer = fake_trainer(trl.GRPOTrainer, model)
    trl_method = trainer._get_per_token_logps_and_entropies
    calls = []
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: calls.append(a) or trl_method(*a, **k)
    logps.chunk_completion_logits(trainer)
    ids = torch.randint(0, VOCAB, (ROWS, PROMPT + KEEP))
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), KEEP)
    assert len(calls) == 1  # 4 x 21 x 8192 fp32 logits: 2.6 MiB, within a chunk of 64 MiB
    monkeypatch.setattr(logps, "CHUNK_BYTES", 2 ** 20)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), KEEP)
    assert len(calls) == 1


def test_a_chunk_holds_at_most_64_positions_and_chunk_bytes_of_logits():
    """SmolLM2's 49,152 entries: 64 positions, 12 MiB of fp32 logits (below glibc's 32 MiB mmap threshold, so a job
    that gives freed memory back reuses heap blocks for them); Gemma 3's 262,144: CHUNK_BYTES (64 MiB) of them."""
    from snaketrl.train.logps import CHUNK_BYTES, chunk_positions

    assert chunk_positions(49152, 4) == 64 and 64 * 49152 * 4 == 12 * 2 ** 20
    assert chunk_positions(262144, 4) == 64 and chunk_positions(262144, 4) * 262144 * 4 == CHUNK_BYTES
    assert chunk_positions(262144 * 4, 4) == 16  # a larger vocabulary: the byte cap binds
    assert chunk_positions(2 ** 40, 4) == 1


def test_chunks_keep_their_logits_below_kept_logits_bytes_and_recompute_them_above(monkeypatch):
    """GRPO's trained pass over 4 chunks (80 completion positions in chunks of 24): below KEPT_LOGITS_BYTES the head
    projects each chunk once (forward) and its logits serve the backward pass; above it, twice (the backward
    recomputes them). The log-probs and the adapter's gradients the same in both, bit for bit."""
    import torch
    import trl

    from snaketrl.train import logps

    monkeypatch.setattr(logps, "CHUNK_BYTES", 24 * VOCAB * 4)
    ids = torch.randint(0, VOCAB, (ROWS, PROMPT + KEEP), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(ROWS, KEEP, generator=torch.Generator().manual_seed(2))
    assert not logps.keeps_too_much(ROWS * KEEP, VOCAB)  # 2.5 MiB of logits, within 256 MiB
    assert logps.keeps_too_much(16 * 64, 262144) and not logps.keeps_too_much(16 * 64, 49152)
    results = {}
    for kept in (logps.KEPT_LOGITS_BYTES, ROWS * KEEP * VOCAB * 4 - 1):
        monkeypatch.setattr(logps, "KEPT_LOGITS_BYTES", kept)
        model = lora_model()
        trainer = fake_trainer(trl.GRPOTrainer, model)
        logps.chunk_completion_logits(trainer)
        head, projected = model.get_output_embeddings(), []
        own = head.forward
        head.forward = lambda h: projected.append(h.shape[0]) or own(h)
        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), KEEP)
        (lp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[kept] = lp.detach(), grads, projected
    (lp, grads, once), (lp2, grads2, twice) = results.values()
    assert once == [24, 24, 24, 8] and sorted(twice) == sorted(once * 2)
    assert torch.equal(lp, lp2) and len(grads) == 8
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
