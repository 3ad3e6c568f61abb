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


ADDED = (VOCAB, VOCAB + 1)  # a chat template's two added tokens: rows beyond the base vocabulary


def trained_rows_model(tmp_path):
    """The tiny LoRA model as run.py builds a model a chat template gave two tokens: its embeddings resized, the
    tokens' rows trainable in the (tied) embeddings and output projection (snaketrl.models.chat_template
    .trainable_tokens: peft's trainable_token_indices, which wraps the head), and those rows trained away from
    their originals, as after some steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.models.chat_template import trainable_tokens, write_record

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(VOCAB + len(ADDED))
    write_record({"added_tokens": {"<|im_start|>": ADDED[0], "<|im_end|>": ADDED[1]}}, tmp_path)
    lora = trainable_tokens(model, tmp_path, {"r": 4, "target_modules": ["q_proj", "v_proj"],
                                              "init_lora_weights": False})
    assert lora["trainable_token_indices"] == {"embed_tokens": list(ADDED), "lm_head": list(ADDED)}
    model = get_peft_model(model, LoraConfig(**lora))
    (delta,) = [p for n, p in model.named_parameters() if "trainable_tokens_delta" in n]
    with torch.no_grad():
        delta.copy_(torch.randn(delta.shape, generator=torch.Generator().manual_seed(3)))
    assert type(model.get_output_embeddings()).__name__ == "TrainableTokensWrapper"
    return model


def trained_row_ids():
    """Prompts and completions with the added tokens among them: ChatML's markers, as a chat template writes them."""
    import torch

    ids = torch.randint(0, VOCAB, (ROWS, PROMPT + KEEP), generator=torch.Generator().manual_seed(1))
    ids[:, 0], ids[:, PROMPT - 1] = ADDED[0], ADDED[1]
    ids[:, PROMPT + 3], ids[:, -1] = ADDED[0], ADDED[1]  # completion tokens scored: the trained rows' logits
    return ids


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("trainer_class", ["GRPOTrainer", "RLOOTrainer"])
def test_chunks_project_with_the_trained_rows_of_a_wrapped_head(trainer_class, recompute, tmp_path, monkeypatch):
    """A head whose added tokens' rows train (peft wraps it): the chunked log-probs, entropies and every gradient,
    the trained rows' among them, are TRL's unchunked path's, whether chunks keep their logits or recompute them.
    A projection by the base layer's weight (the rows as they were) gives other log-probs at the added tokens and
    other gradients of the rows: the test checks it does."""
    import torch
    import trl

    from snaketrl.train import logps

    cls = getattr(trl, trainer_class)
    monkeypatch.setattr(logps, "CHUNK_BYTES", 24 * VOCAB * 4)  # chunks of 24 of the 80 positions
    if recompute:
        monkeypatch.setattr(logps, "KEPT_LOGITS_BYTES", 24 * VOCAB * 4)
    ids, weights = trained_row_ids(), torch.randn(ROWS, KEEP, generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    results = {}
    for mode in ("trl", "chunked", "base rows"):
        model = trained_rows_model(tmp_path)
        trainer = fake_trainer(cls, model)
        head = model.get_output_embeddings()
        if mode != "trl":
            logps.chunk_completion_logits(trainer)
        if mode == "base rows":  # what a path that ignored the wrapper would project with
            head.forward = lambda h, base=head.original_module: base(h)
        lp, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, KEEP, compute_entropy=True)
        (lp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[mode] = lp.detach(), entropy, grads
    (lp, entropy, grads), (lp2, entropy2, grads2), (lp3, _, grads3) = results.values()
    assert len(grads) == len(grads2) == 9  # 8 LoRA matrices and the added rows' delta
    delta = next(n for n in grads if "trainable_tokens_delta" in n)
    assert grads[delta].shape == (len(ADDED), 16) and grads[delta].abs().min() > 0
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy2, entropy, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-4, atol=1e-6)
    # the base rows: the added tokens' log-probs and the rows' gradients differ far beyond the tolerance
    added = (ids[:, -KEEP:] == ADDED[0]) | (ids[:, -KEEP:] == ADDED[1])
    assert added.sum() == 2 * ROWS and ((lp3 - lp)[added].abs() > 0.1).all()
    assert not torch.allclose(grads3[delta], grads[delta], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_head_with_trained_rows_builds_its_weight_once_a_pass(recompute, tmp_path, monkeypatch):
    """peft's trainable-tokens head builds its whole weight (vocabulary x hidden) at each call of its forward: the
    chunked pass (4 chunks of 24 of the 80 positions) builds it once, forward and backward together, whether chunks
    keep their logits or recompute them, and the embeddings once, in the model's forward. With the head's own
    forward per chunk it was once a chunk, and again a chunk recomputed. The values: test above."""
    import torch
    import trl
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    from snaketrl.train import logps

    monkeypatch.setattr(logps, "CHUNK_BYTES", 24 * VOCAB * 4)
    if recompute:
        monkeypatch.setattr(logps, "KEPT_LOGITS_BYTES", 24 * VOCAB * 4)
    builds, build = [], TrainableTokensLayer.get_merged_weights
    monkeypatch.setattr(TrainableTokensLayer, "get_merged_weights",
                        lambda layer, active: builds.append(layer) or build(layer, active))
    ids = trained_row_ids()
    counts = {}
    for one_weight in (True, False):
        if not one_weight:  # each chunk through the head's own forward, as before
            monkeypatch.setattr(logps, "one_weight_forward", lambda head: head.forward)
        model = trained_rows_model(tmp_path)
        trainer = fake_trainer(trl.GRPOTrainer, model)
        logps.chunk_completion_logits(trainer)
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
        builds.clear()
        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), KEEP)
        lp.sum().backward()
        counts[one_weight] = (sum(b is head.token_adapter for b in builds),
                              sum(b is embeddings.token_adapter for b in builds), len(builds))
    chunks = -(-ROWS * KEEP // 24)
    assert chunks == 4 and counts[True] == (1, 1, 2)
    assert counts[False] == (chunks * (2 if recompute else 1), 1, chunks * (2 if recompute else 1) + 1)


def test_ppo_chunks_project_with_the_trained_rows_of_a_wrapped_head(tmp_path):
    """PPO's bounded pass (snaketrl.train.ppo: the hidden states where TRL's loop expects logits, projected a chunk
    at a time by the head's own forward, recomputed in the backward pass) on a head with trained rows: TRL's
    log-probs of the responses from every position's logits, and the same gradients, the rows' among them; not
    those of the base layer's rows."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    from snaketrl.train.logps import without_projection
    from snaketrl.train.ppo import _Hidden

    ids, temperature = trained_row_ids(), 0.7 + 1e-7
    responses = ids[:, PROMPT:]
    results = {}
    for mode in ("trl", "bounded", "base rows"):
        model = trained_rows_model(tmp_path)
        head = model.get_output_embeddings()
        if mode != "trl":
            with without_projection(head) as autocast:
                hidden = model(input_ids=ids, use_cache=False).logits
            stand_in = hidden.new_zeros(*ids.shape, 1)
            project = head if mode == "bounded" else head.original_module  # the rows as they were
            lp = _Hidden(hidden, project, autocast[0]).logps(stand_in[:, PROMPT - 1:-1], responses, temperature, [])
        else:  # TRL's loop: every position's logits, sliced, divided, log-softmaxed
            logits = model(input_ids=ids, use_cache=False).logits[:, PROMPT - 1:-1] / temperature
            lp = selective_log_softmax(logits, responses)
        lp.sum().backward()
        results[mode] = lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    (lp, grads), (lp2, grads2), (lp3, grads3) = results.values()
    assert lp.shape == (ROWS, KEEP) and len(grads) == 9
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-4, atol=1e-6)
    added = (responses == ADDED[0]) | (responses == ADDED[1])
    delta = next(n for n in grads if "trainable_tokens_delta" in n)
    assert ((lp3 - lp)[added].abs() > 0.1).all() and not torch.allclose(grads3[delta], grads[delta], rtol=1e-2,
                                                                         atol=1e-3)
