"""TRL 1.12's ORPOTrainer with its rows cut at max_length and an odds-ratio term whose gradient stays finite.

Truncation. TRL 1.12's experimental ORPO (`tokenize_row`) never cuts the prompt: where prompt and the longer
response exceed max_length, it cuts both responses to max_length minus the longer response's length. A response
longer than max_length makes that negative, and the other response keeps only what is left of it after dropping
that many tokens from its end: often nothing. Its average log-prob is then 0/0, NaN, and so are the gradient and,
after the optimizer step, every weight. On Gemma 3 270M (issue 54) pair 10 of the hh-rlhf harmless-base sample (a
10-token chosen answer against a 258-token rejected one, max_length 224) kept no chosen token: the eval loss was
NaN after 4 steps in every arm, fp32 or bf16, at any learning rate or clipping. Nor is a row bounded by max_length
(372 tokens at 224 in that sample), as the length stage and the memory plan count it. Here each row is cut as
TRL's DPO cuts it (`truncation_mode` keep_start: the first max_length tokens of prompt and response) and a pair
whose prompt alone fills max_length is dropped (the registry's `drops="long_prompt"`, DPO's rule), so that every
response kept scores at least one token.

Odds ratio. TRL's term is logsigmoid(log odds(chosen) - log odds(rejected)) of the responses' average log-probs,
with log(1 - p) as `log1mexp`. A chosen response the model is certain of has an average log-prob of exactly 0 (TRL's
log-softmax of bf16 logits gives 0 at p = 0.999 already, of fp32 ones from 1 - 6e-8; ORPO's NLL term drives the
chosen responses there): log1mexp(0) is -inf, the term 0, and autograd multiplies the sigmoid's 0 by log1mexp's
infinite slope: a NaN gradient. `odds_ratio` gives TRL's values
with the gradient in closed form, finite wherever TRL's loss is (tests/test_orpo.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl.experimental.orpo import ORPOTrainer as TRLORPOTrainer
from trl.experimental.orpo.orpo_trainer import log1mexp

ROW_KEYS = ("input_ids", "attention_mask", "labels")


class OddsRatio(torch.autograd.Function):
    """(TRL's logsigmoid of the log odds ratio, the log odds ratio) of average log-probs `chosen` and `rejected`;
    the gradient of the first as d/dc = s / (1 - e^c) and d/dr = -s / (1 - e^r), s = sigmoid(-log odds ratio),
    which near c = 0 (s -> 0, the slope -> inf) is 1 / (1 - e^c + e^c (e^-r - 1))."""

    @staticmethod
    def forward(ctx, chosen, rejected):
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ctx.save_for_backward(chosen, rejected, log_odds)
        ctx.mark_non_differentiable(log_odds)
        return F.logsigmoid(log_odds), log_odds

    @staticmethod
    def backward(ctx, grad, _):
        chosen, rejected, log_odds = ctx.saved_tensors
        s = torch.sigmoid(-log_odds)
        near = chosen > -0.5  # where s may underflow to 0 against 1 / (1 - e^c)
        d_chosen = torch.where(near, 1 / (-torch.expm1(chosen) + torch.exp(chosen) * torch.expm1(-rejected)),
                               s / -torch.expm1(chosen))
        return grad * d_chosen, grad * s / torch.expm1(rejected)


def odds_ratio(chosen, rejected):
    """TRL's `odds_ratio_loss` ratio and log odds ratio, per pair, with OddsRatio's gradient."""
    return OddsRatio.apply(chosen.float(), rejected.float())


class ORPOTrainer(TRLORPOTrainer):
    """TRL's ORPOTrainer, its rows cut and the pairs it could not score dropped (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_encoder_decoder:  # TRL's encoder-decoder path cuts each response on its own
            self.train_dataset = self.train_dataset.filter(scored)
            if self.eval_dataset is not None:
                self.eval_dataset = (self.eval_dataset.filter(scored) if not isinstance(self.eval_dataset, dict)
                                     else {k: v.filter(scored) for k, v in self.eval_dataset.items()})

    def tokenize_row(self, feature, model=None) -> dict:
        limit, self.max_length = self.max_length, float("inf")  # TRL's cut off (no row is longer than inf)
        try:
            row = super().tokenize_row(feature, model)
        finally:
            self.max_length = limit
        if not self.is_encoder_decoder:
            for side in ("chosen", "rejected"):
                for key in ROW_KEYS:
                    row[f"{side}_{key}"] = row[f"{side}_{key}"][:limit]
        return row

    def odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps):
        ratio, log_odds = odds_ratio(policy_chosen_logps, policy_rejected_logps)
        return (self.beta * ratio, self.beta * policy_chosen_logps.float().detach(),
                self.beta * policy_rejected_logps.float().detach(), ratio.mean(), log_odds.mean())


def scored(row: dict) -> bool:
    """Whether a tokenized pair keeps a response token on each side (TRL labels the rest -100)."""
    return all(any(label != -100 for label in row[f"{side}_labels"]) for side in ("chosen", "rejected"))
