"""DPO's, KTO's and ORPO's logits bounded: the vocabulary projection only at the positions their losses score, at
most snaketrl.train.logps.CHUNK_BYTES of logits at a time, each chunk recomputed in the backward pass.

TRL 1.12's DPO and KTO project every position of a batch onto the vocabulary (snaketrl's DPO tails on a CPU: every
position from each row's first completion token on), for the policy, whose logits and their gradients the backward
pass keeps, and for the reference; then take the completion tokens' log-probs (selective_log_softmax), their entropy
(entropy_from_logits), mean logit and, for DPO, argmax. ORPO does the same for its odds ratio and for its NLL term
(every attended token of the chosen rows). At Gemma 3's 262,144 entries, 4 rows of 256 positions are 1 GiB of fp32
logits per copy. Here the model's forward stops before its output projection (snaketrl.train.logps
.without_projection). TRL's DPO and KTO losses run on the hidden states: while they run, the two vocabulary functions
they call are replaced by ones that project only the completion positions, in chunks (`token_scores`), and the two
metrics they read from the logits themselves (the mean logit, DPO's token accuracy) are set again from the same
chunks (the mean logit by the projection's linearity). ORPO's forward (`concatenated_forward`) is replaced whole.
Every value TRL's loss computes and logs is the same, and so are the gradients (tests/test_scored.py). The price
is one more projection of the scored positions (the backward pass's): at Gemma 3's 262,144 x 640 in bf16, 256
positions' projection, log-softmax, entropy and backward took 3.49 CPU-s on one thread, TRL's 2.84. A batch
whose logits fit in one chunk keeps TRL's path, as does an evaluation that returns the logits, a loss that reads
them in another way (DPO's `sft` loss type, WPO weighting), a model's auxiliary loss, Liger's fused loss, an output
projection that is not a plain linear layer (a LoRA-adapted head; peft's wrapper of a head with trained token
rows, `trainable_token_indices`, as a base model's added ChatML tokens have: not yet supported) and a model whose
logits are more than its output projection (snaketrl.train.logps.supported).
"""

from __future__ import annotations

import contextlib
import types

TRAINERS = ("dpo", "kto", "orpo")
_calls: list = []  # the loss call now running on hidden states (one at a time)


def token_scores(hidden, head, targets, mask, autocast, extras: bool = True):
    """Per position of `mask` (rows x K, bool): TRL's log-prob of `targets` under `head`'s logits of `hidden`
    (rows x K x hidden size, the position before each target), and with `extras` its entropy and argmax (without
    gradient); 0, 0 and -1 elsewhere. The projection (under `autocast`, as in the model's forward) and TRL's
    log-softmax run on CHUNK_BYTES of logits at a time; under autograd each chunk keeps its hidden states only."""
    import torch
    import torch.nn.functional as F
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    from snaketrl.train import logps

    flat, ids = hidden[mask], targets[mask]
    positions = logps.chunk_positions(head.weight.shape[0], 4)

    def chunk(h, t):
        with autocast:
            logits = F.linear(h, head.weight, head.bias)
        logits = logits.to(hidden.dtype)  # the model's output dtype, as TRL's logits have it
        logp = selective_log_softmax(logits, t)
        if not extras:
            return logp, None, None
        with torch.no_grad():  # after the log-probs: the backward pass's recomputation stops before them
            return logp, entropy_from_logits(logits), logits.argmax(dim=-1)

    parts = logps.over_chunks(chunk, flat, ids, positions)
    logp = hidden.new_zeros(mask.shape).masked_scatter(mask, torch.cat([p[0] for p in parts]) if parts
                                                       else hidden.new_zeros(0))
    if not extras:
        return logp, None, None
    entropy = hidden.new_zeros(mask.shape)
    argmax = torch.full(mask.shape, -1, dtype=torch.long, device=hidden.device)
    if parts:
        entropy[mask] = torch.cat([p[1] for p in parts]).to(entropy.dtype)
        argmax[mask] = torch.cat([p[2] for p in parts])
    return logp, entropy, argmax


def mean_logits(hidden, head):
    """Each position's logits averaged over the vocabulary (TRL's logged `logits/*`), without projecting: the mean
    of a linear map's outputs is its input times the mean of the weight's rows, plus the bias's mean. The mean row
    is kept on the head until its weight changes (a frozen head under LoRA: never; on a CPU it costs 0.5 s at
    Gemma 3's 262,144 x 640)."""
    import torch

    with torch.no_grad():
        version = (head.weight.data_ptr(), head.weight._version)
        kept = getattr(head, "snaketrl_mean_row", None)
        if kept is None or kept[0] != version:
            kept = version, head.weight.sum(0, dtype=torch.float32) / head.weight.shape[0]
            head.snaketrl_mean_row = kept
        out = hidden.detach().float() @ kept[1]
        return out + head.bias.float().mean() if head.bias is not None else out


def heads(trainer) -> list:
    """The output projections of the trainer's policy and separate reference model, where each is a plain linear
    layer of a model whose logits are its projection alone (snaketrl.train.logps.supported); [] where any is not."""
    import torch

    from snaketrl.train.logps import supported

    found = []
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        inner = trainer.accelerator.unwrap_model(model)
        head = inner.get_output_embeddings() if supported(inner) else None
        if type(head) is not torch.nn.Linear:
            return []
        if all(head is not h for h in found):
            found.append(head)
    return found


def plans_chunks(trainer: str, args, lora: dict, model_dir) -> bool:
    """Whether a run's logits can be chunked (`bound_logits`), as far as its plan sees before any model loads: DPO,
    KTO or ORPO, without Liger, not DPO's `sft` loss or weighting, and an output projection that stays a plain linear
    layer (no LoRA or modules_to_save on it, no rows a chat template added: peft would wrap it). The memory estimate
    counts a chunk's logits only then: where bound_logits declines, every position's logits are held at once."""
    from snaketrl.models.chat_template import read_record

    if trainer not in TRAINERS or getattr(args, "use_liger_kernel", False):
        return False
    if trainer == "dpo":
        losses = args.loss_type if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]  # or TRL's default
        if "sft" in losses or args.use_weighting:
            return False
    trained = set(lora.get("target_modules") or []) | set(lora.get("modules_to_save") or [])
    return "lm_head" not in trained and not (read_record(model_dir) or {}).get("added_tokens")


def too_large(ids, head) -> bool:
    """Whether a batch of `ids` (rows x positions) has more fp32 logits than one chunk."""
    from snaketrl.train import logps

    return logps.exceeds_chunk(ids.numel(), head.weight.shape[0])


class _Call:
    """One loss call's heads (whose forward passes the hidden states through), the (targets, mask) pairs of the
    positions it scores, and what the vocabulary functions computed, by their input tensor."""

    def __init__(self, projections: list, masks: list):
        self.projections, self.masks = projections, masks  # [(head, autocasts seen)]
        self.last = None  # the head the last forward ran up to
        self.seen: dict = {}
        self.policy = None  # the (hidden, entropy, argmax, head) TRL took the entropy of: its policy's

    def mask_for(self, index):
        import torch

        for targets, mask in self.masks:
            if targets.shape == index.shape and torch.equal(targets, index):
                return mask.bool()
        return torch.ones(index.shape, dtype=torch.bool, device=index.device)


@contextlib.contextmanager
def on_hidden_states(projections: list, masks: list):
    """While entered, `projections`' forwards return their input (snaketrl.train.logps.without_projection), and
    the replaced vocabulary functions score the positions of `masks` ((targets, mask) pairs; all positions of
    targets not among them)."""
    from snaketrl.train.logps import without_projection

    with contextlib.ExitStack() as stack:
        entered = [(head, stack.enter_context(without_projection(head))) for head in projections]
        call = _Call(entered, masks)
        for head in projections:
            stack.enter_context(head.register_forward_pre_hook(lambda module, args: setattr(call, "last", module)))
        _calls.append(call)
        try:
            yield call
        finally:
            _calls.pop()


def _scored_log_softmax(trl_function):
    def selective_log_softmax(logits, index):
        call = _calls[-1] if _calls else None
        if call is None or call.last is None:
            return trl_function(logits, index)
        head = call.last
        autocast = next(seen for h, seen in call.projections if h is head)[-1]
        logp, entropy, argmax = token_scores(logits, head, index, call.mask_for(index), autocast)
        call.seen[(logits.data_ptr(), tuple(logits.shape))] = (logits, entropy, argmax, head)
        return logp
    return selective_log_softmax


def _scored_entropy(trl_function):
    def entropy_from_logits(logits, *args, **kwargs):
        call = _calls[-1] if _calls else None
        if call is None:
            return trl_function(logits, *args, **kwargs)
        call.policy = call.seen[(logits.data_ptr(), tuple(logits.shape))]  # TRL logs its policy's entropy alone
        return call.policy[1]
    return entropy_from_logits


def replace_functions(module) -> None:
    """`module` (TRL's DPO or KTO trainer module) calls the replaced vocabulary functions, which are TRL's own
    outside a loss call on hidden states: it looks them up by name at every call."""
    if not getattr(module, "snaketrl_scored", False):
        module.selective_log_softmax = _scored_log_softmax(module.selective_log_softmax)
        module.entropy_from_logits = _scored_entropy(module.entropy_from_logits)
        module.snaketrl_scored = True


def set_last(metrics: dict, key: str, value: float) -> None:
    """Replace the value TRL's loss call just logged under `key`, where it logged one."""
    if metrics.get(key):
        metrics[key][-1] = value


def gathered(trainer, value) -> float:
    """`value` summed over the processes, as TRL sums its metrics."""
    return trainer.accelerator.gather_for_metrics(value).sum().item()


def dpo_metrics(trainer, call, inputs) -> None:
    """DPO's logged mean logits and token accuracy, as TRL's `_compute_loss` computes them from the logits."""
    hidden, _, argmax, head = call.policy
    mask = inputs["completion_mask"][..., 1:].bool()
    labels, means = inputs["input_ids"][..., 1:], mean_logits(hidden, head)
    half = mask.shape[0] // 2
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for key, rows in (("logits/chosen", slice(None, half)), ("logits/rejected", slice(half, None))):
        tokens = gathered(trainer, mask[rows].sum())
        set_last(metrics, key, gathered(trainer, means[rows][mask[rows]].sum()) / tokens if tokens > 0 else 0.0)
    correct = ((argmax[:half] == labels[:half]) & mask[:half]).sum()
    total = gathered(trainer, mask[:half].sum())
    set_last(metrics, "mean_token_accuracy", gathered(trainer, correct) / total if total > 0 else 0.0)


def kto_metrics(trainer, call, inputs) -> None:
    """KTO's logged mean logits, as TRL's `_compute_loss` computes them from the logits."""
    import torch

    hidden, _, _, head = call.policy
    mask = inputs["completion_mask"][:, 1:].bool()
    means, chosen = mean_logits(hidden, head), torch.as_tensor(inputs["label"], dtype=torch.bool, device=mask.device)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for key, rows in (("logits/chosen", chosen), ("logits/rejected", ~chosen)):
        tokens = gathered(trainer, mask[rows].sum())
        if tokens > 0:
            set_last(metrics, key, gathered(trainer, means[rows][mask[rows]].sum()) / tokens)


def bound_logits(trainer, kind: str) -> bool:
    """`trainer` (TRL's DPO, KTO or ORPO, `kind`; its weights whole in each process) computes its logits as the
    module docstring says. Whether it will (False: its model or loss keeps TRL's path throughout)."""
    projections = heads(trainer)
    if not projections or getattr(trainer.args, "use_liger_kernel", False) or getattr(trainer, "aux_loss_enabled",
                                                                                        False):
        return False
    if kind == "orpo":
        if trainer.is_encoder_decoder:
            return False
        trl_forward = trainer.concatenated_forward
        trainer.concatenated_forward = types.MethodType(
            lambda self, model, batch: orpo_forward(self, model, batch, projections, trl_forward), trainer)
        return True
    if kind == "dpo" and ("sft" in trainer.loss_types or trainer.use_weighting):
        return False
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.kto_trainer as kto

    module, fix = (dpo, dpo_metrics) if kind == "dpo" else (kto, kto_metrics)
    replace_functions(module)
    compute = trainer._compute_loss

    def loss_on_hidden_states(model, inputs, return_outputs):
        if return_outputs or not too_large(inputs["input_ids"], projections[0]):
            return compute(model, inputs, return_outputs)
        masks = [(inputs[ids][:, 1:], inputs[mask][:, 1:]) for ids, mask in
                 (("input_ids", "completion_mask"), ("KL_input_ids", "KL_completion_mask")) if ids in inputs]
        with on_hidden_states(projections, masks) as call:
            loss = compute(model, inputs, return_outputs)
        fix(trainer, call, inputs)
        return loss

    trainer._compute_loss = loss_on_hidden_states
    return True


def orpo_forward(trainer, model, batch, projections, trl_forward):
    """TRL's ORPO `concatenated_forward` (decoder-only): the chosen rows' NLL over their attended tokens, each row's
    average completion log-prob, the rows' logits (here each position's mean logit: TRL logs their mean alone) and
    the NLL, the vocabulary projected only where the NLL or the log-probs score a token."""
    import torch

    cat = trainer.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=trainer.padding_value,
                                      device=trainer.accelerator.device)
    ids, attention, labels = (cat[k] for k in ("concatenated_input_ids", "concatenated_attention_mask",
                                               "concatenated_labels"))
    targets, completion = ids[:, 1:], labels[:, 1:] != -100
    if not too_large(ids, projections[0]) or not torch.equal(labels[:, 1:][completion], targets[completion]):
        return trl_forward(model, batch)
    chosen = batch["chosen_labels"].shape[0]
    nll = attention[:, 1:] == 1
    nll[chosen:] = False
    with on_hidden_states(projections, []) as call:
        hidden = model(ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    head = call.last
    autocast = next(seen for h, seen in call.projections if h is head)[-1]
    logp, _, _ = token_scores(hidden, head, targets, nll | completion, autocast, extras=False)
    nll_loss = -logp[:chosen][nll[:chosen]].mean()  # CrossEntropyLoss's mean over the tokens it does not ignore
    average = (logp * completion).sum(-1) / completion.sum(-1)
    means = mean_logits(hidden, head)
    return average[:chosen], average[chosen:], means[:chosen], means[chosen:], nll_loss
