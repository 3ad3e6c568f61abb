"""The output head reads its input contiguous (snaketrl.train.head): one matrix multiply instead of a batch-sized
copy of the head's weight where a frozen head meets a slice of the hidden states, with the same logits and tokens."""

import pytest

from test_generation import generate, lora_model, prompts
from test_trainers import PER_TRAINER, prepare


def vocabulary_products(model, inputs, keep, grad=False):
    """The logits of a forward keeping the last `keep` positions, and the batched multiplies (aten::bmm) it ran over
    the vocabulary: the broadcast head. With `grad`, as a trained pass: also the LoRA weights' gradients of a loss
    on those logits (their backward runs outside the profile)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.set_grad_enabled(grad), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        logits = model(**inputs, logits_to_keep=keep).logits
    broadcast = [e.input_shapes for e in prof.events() if e.name == "aten::bmm" and vocab in e.input_shapes[1]]
    if not grad:
        return logits, broadcast, {}
    model.zero_grad()
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), broadcast, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("keep,grad", [(1, False), (5, False), (5, True)])
def test_a_frozen_head_on_kept_positions_runs_one_matrix_multiply_with_the_same_logits(tiny_model_dir, keep, grad):
    """Generation's prefill (1), no-grad log-probabilities (5) and a trained pass's (5, with gradients)."""
    import torch

    from snaketrl.train.head import contiguous_head

    model, tokenizer = lora_model(tiny_model_dir)  # peft freezes the head, as under TRL
    inputs = prompts(tokenizer)
    rows, hidden = inputs["input_ids"].shape[0], model.config.hidden_size
    vocab = model.get_output_embeddings().weight.shape[0]
    plain, broadcast, plain_grads = vocabulary_products(model, inputs, keep, grad)
    assert broadcast == [[[rows, keep, hidden], [rows, hidden, vocab]]]  # torch's matmul without the hook
    assert contiguous_head(model) and contiguous_head(model)
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 1
    hooked, broadcast, grads = vocabulary_products(model, inputs, keep, grad)
    assert broadcast == []
    assert hooked.shape == (rows, keep, vocab)
    # the same dot products, summed in another blocking: fp32 rounding apart (measured: 1.8e-7 on logits up to 0.6)
    torch.testing.assert_close(hooked, plain, rtol=1e-6, atol=1e-6)
    assert len(grads) == (16 if grad else 0) and grads.keys() == plain_grads.keys()  # 2 layers x 4 modules x A, B
    for name, grad_ in grads.items():
        torch.testing.assert_close(grad_, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_sampling_with_the_hooked_head_gives_trls_tokens(tiny_model_dir):
    """TRL's sampling settings (GRPOConfig's defaults, temperature 0.7), the same seed: the same tokens."""
    from snaketrl.train.head import contiguous_head

    model, tokenizer = lora_model(tiny_model_dir)
    inputs = prompts(tokenizer)
    kwargs = {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": None,
              "repetition_penalty": 1.0}
    plain = generate(model, tokenizer, inputs, **kwargs)
    contiguous_head(model)
    assert generate(model, tokenizer, inputs, **kwargs) == plain


def test_a_job_hooks_its_policys_head(tmp_path, config, tiny_model_dir, monkeypatch):
    import snaketrl.train.run as run_module
    from snaketrl.train.run import train_run

    hooked = []
    contiguous_head = run_module.contiguous_head
    monkeypatch.setattr(run_module, "contiguous_head", lambda model: hooked.append(contiguous_head(model)))
    train_run(**prepare(tmp_path, config, tiny_model_dir, "grpo", args={**PER_TRAINER["grpo"], "max_steps": 1}))
    assert hooked == [True]
