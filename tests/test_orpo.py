"""TRL's ORPO with its rows cut at max_length and a finite odds-ratio gradient (snaketrl.train.orpo): where TRL 1.12's
loss or gradient is NaN (issue 54: a response cut to no token; a response of log-prob 0), and TRL's own values
elsewhere."""

import math

import pytest

MAX_LENGTH = 24


def trl_ratio(chosen, rejected):
    """TRL's odds_ratio_loss: its ratio per pair (beta 1) and its mean log odds ratio."""
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    fake = SimpleNamespace(beta=1.0, accelerator=SimpleNamespace(device=chosen.device))
    losses, _, _, _, log_odds = ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)
    return losses, log_odds


def ours(chosen, rejected):
    from snaketrl.train.orpo import odds_ratio

    ratio, log_odds = odds_ratio(chosen, rejected)
    return ratio, log_odds.mean()


def test_odds_ratio_is_trls_with_a_finite_gradient_at_log_prob_zero():
    import torch

    values = [-120.0, -30.0, -3.0, -0.9, -0.5, -0.3, -1e-3, -1e-6]
    pairs = {"chosen": [c for c in values for _ in values], "rejected": values * len(values)}
    results = []
    for ratio_of in (trl_ratio, ours):
        c, r = (torch.tensor(pairs[k], requires_grad=True) for k in ("chosen", "rejected"))
        ratio, log_odds = ratio_of(c, r)
        ratio.sum().backward()
        results.append((ratio.detach(), log_odds.item(), c.grad, r.grad))
    (ratio_t, odds_t, dc_t, dr_t), (ratio_s, odds_s, dc_s, dr_s) = results
    assert torch.isfinite(dc_t).all() and torch.isfinite(dr_t).all()
    assert torch.equal(ratio_s, ratio_t) and odds_s == odds_t
    assert torch.allclose(dc_s, dc_t, rtol=1e-4, atol=1e-6) and torch.allclose(dr_s, dr_t, rtol=1e-4, atol=1e-6)

    # A chosen response of average log-prob 0 (certain): TRL's term is 0 and its gradient NaN; here the limit,
    # d/dc = 1 / (e^-r - 1), the rejected response's odds, and d/dr = 0.
    rejected = torch.tensor([-3.0, -0.5, -1e-3])
    for ratio_of in (trl_ratio, ours):
        c, r = torch.zeros(3, requires_grad=True), rejected.clone().requires_grad_()
        ratio, _ = ratio_of(c, r)
        ratio.sum().backward()
        assert ratio.tolist() == [0.0, 0.0, 0.0]
        if ratio_of is trl_ratio:
            assert torch.isnan(c.grad).all()
        else:
            assert c.grad.tolist() == pytest.approx((1 / torch.expm1(-rejected)).tolist(), rel=1e-5)
            assert r.grad.tolist() == [0.0, 0.0, 0.0]


def trainers(model_dir, rows, tmp_path, max_length=MAX_LENGTH):
    """TRL's ORPOTrainer and snaketrl's, full fine-tuning of two copies of the tiny model on `rows`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig
    from trl.experimental.orpo import ORPOTrainer as TRLORPOTrainer

    from snaketrl.train.orpo import ORPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = ORPOConfig(output_dir=str(tmp_path), max_length=max_length, per_device_train_batch_size=1,
                      report_to="none", use_cpu=True, bf16=False)
    return [cls(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, processing_class=tokenizer,
                train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows))
            for cls in (TRLORPOTrainer, ORPOTrainer)]


def step(trainer, row: int, bump: float = 0.0):
    """The loss of pair `row` and whether every gradient is finite; `bump` added to the eos logit."""
    import torch

    model = trainer.model
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, out: out + bump * torch.nn.functional.one_hot(
            torch.tensor(trainer.processing_class.eos_token_id), out.shape[-1]))
    try:
        batch = trainer.data_collator([trainer.train_dataset[row]])
        model.zero_grad()
        loss, metrics = trainer.get_batch_loss_metrics(model, batch)
        loss.backward()
    finally:
        hook.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return loss.item(), metrics, all(torch.isfinite(g).all() for g in grads), grads


def test_an_eos_only_response_made_certain_keeps_a_finite_gradient(tiny_model_dir, tmp_path):
    """An empty chosen response is eos alone; an eos logit 100 above the rest gives it log-prob 0: TRL's loss is
    finite and its gradient NaN, snaketrl's the same loss with finite gradients; with the eos logit 2 higher (TRL's
    gradient finite) both losses and gradients are the same."""
    import torch

    rows = [{"prompt": "Which number comes after six?", "chosen": "", "rejected": " Eight, I think."}]
    trl, ours = trainers(tiny_model_dir, rows, tmp_path, max_length=64)  # no row cut
    for bump in (100.0, 2.0):
        loss_t, metrics_t, finite_t, grads_t = step(trl, 0, bump)
        loss_s, metrics_s, finite_s, grads_s = step(ours, 0, bump)
        assert (loss_s, metrics_s) == (loss_t, metrics_t)  # TRL's forward, op for op
        assert finite_s
        if bump == 100.0:
            assert metrics_t["logps/chosen"] == 0.0 and not finite_t
        else:
            assert finite_t
            assert all(torch.allclose(s, t, rtol=1e-4, atol=1e-7) for s, t in zip(grads_s, grads_t, strict=True))


def test_rows_are_cut_at_max_length_and_pairs_without_a_response_token_dropped(tiny_model_dir, tmp_path):
    """Issue 54's pair: a short chosen response against a rejected one longer than max_length. TRL cuts both to
    max_length minus the longer one's length (negative): the chosen response keeps no token, its average log-prob
    is 0/0 and the loss NaN. Here each row keeps its first max_length tokens; a pair whose prompt fills max_length
    is dropped, from the eval set too."""
    long = " ".join(["and then some more words"] * 12)
    rows = [{"prompt": "Tell me a story.", "chosen": " No.", "rejected": " Once upon a time " + long},
            {"prompt": "Tell me a long story: " + long, "chosen": " No.", "rejected": " Yes."},
            {"prompt": "Hello.", "chosen": " Hi there.", "rejected": " Go away."}]
    trl, ours = trainers(tiny_model_dir, rows, tmp_path)
    assert (len(trl.train_dataset), len(ours.train_dataset), len(ours.eval_dataset)) == (3, 2, 2)
    assert ours.train_dataset[1] == trl.train_dataset[2]  # a pair within max_length: TRL's row

    def completion_tokens(row):
        return [sum(label != -100 for label in row[f"{side}_labels"]) for side in ("chosen", "rejected")]

    uncut = trainers(tiny_model_dir, rows, tmp_path, max_length=1000)[0].train_dataset[0]  # TRL cuts nothing
    # TRL: both responses lose their last 107 - 24 tokens: the chosen " No." and eos all, the rejected row keeps 24
    # after 8 of prompt, 32 tokens
    assert completion_tokens(trl.train_dataset[0]) == [0, 24] and len(trl.train_dataset[0]["rejected_labels"]) == 32
    assert completion_tokens(uncut) == [4, 107] and completion_tokens(ours.train_dataset[0]) == [4, 16]
    row = ours.train_dataset[0]
    for key in ("input_ids", "attention_mask", "labels"):
        assert row[f"chosen_{key}"] == uncut[f"chosen_{key}"]
        assert row[f"rejected_{key}"] == uncut[f"rejected_{key}"][:MAX_LENGTH]
    loss_t, _, finite_t, _ = step(trl, 0)
    loss_s, _, finite_s, _ = step(ours, 0)
    assert math.isnan(loss_t) and not finite_t
    assert math.isfinite(loss_s) and loss_s > 0 and finite_s
