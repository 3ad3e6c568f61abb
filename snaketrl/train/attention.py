"""`attn_implementation: varlen`: attention over packed (padding-free) sequences with torch's own flash varlen
kernel (torch.nn.attention.varlen), registered with transformers' AttentionInterface.

TRL's padding-free batches flatten a batch into one row whose position_ids restart at each sequence. With sdpa,
transformers turns those into a dense block-diagonal mask over the whole row: memory and time grow with the
square of the packed length (65 % of an H200's step time in the packed SFT bench). flash_attention_2 avoids it
but is a package that needs building against the local CUDA; torch ships the same varlen kernel. Here each
sequence attends to itself only, from cumulative sequence lengths, and no mask is ever built.

On a device the kernel does not run on (CPU, where CI tests it), each sequence goes through sdpa on its own:
the same result, one call per sequence."""

from __future__ import annotations

import inspect
import logging
import weakref
from contextlib import contextmanager

NAME = "varlen"

# One forward calls attention once per layer with the same position_ids (or padding mask): the sequence
# boundaries, and the device-to-host copy of their longest length, are worked out once per forward.
_last: tuple = (None, (), None)


# bench/gpu.py on one H200 (torch 2.11, Qwen2.5-0.5B's shape, LoRA r16, bf16, batch 8, 15 steps): packed SFT on
# LIMA 17,774 real tokens/s with sdpa, 35,241 with varlen (eval loss 7.7675 both); DPO on hh-rlhf's length-grouped
# padded pairs 5,804 -> 8,303 (eval loss 0.6616 both).
MEASURED = ("on CUDA torch's flash varlen kernel (attn_implementation varlen) measured 2.0x sdpa's real tokens/s "
            "for packed SFT and 1.4x for padded DPO pairs on an H200, with the same eval loss: no dense mask over a "
            "packed row, no attention to padding")


# TRL's SFTTrainer warns, going by attn_implementation's name alone, that packed and padding-free batches need one
# of its flash attention variants or sequences may attend to each other. varlen is such a variant under its own
# name (tests/test_attention.py: each sequence's loss and gradients are those of the sequence alone).
TRL_FLASH_WARNINGS = ("You are using packing, but the attention implementation is not set to a supported Flash",
                      "Padding-free training is enabled, but the attention implementation is not set to a supported")


@contextmanager
def answering_trl_flash_warnings(attention: str | None, run: str):
    """While TRL's trainer is built: under varlen, TRL_FLASH_WARNINGS are replaced by one line in the job's log
    that says why they do not apply. Any other attention keeps them."""
    if attention != NAME:
        yield
        return
    trl_logger, dropped = logging.getLogger("trl.trainer.sft_trainer"), []

    def answered(record):
        if any(warning in record.getMessage() for warning in TRL_FLASH_WARNINGS):  # after accelerate's [RANK n]
            dropped.append(record)
            return False
        return True

    trl_logger.addFilter(answered)
    try:
        yield
    finally:
        trl_logger.removeFilter(answered)
    if dropped:
        logging.getLogger("snaketrl.train").info(
            "%s: TRL's warning that packed or padding-free batches need a flash attention variant does not apply: "
            "varlen is one (torch's flash varlen kernel; each sequence attends only to itself)", run)


def choose(spec, entry: dict, device: str, routed: bool = True, model: str = "<name>") -> tuple[str | None, str]:
    """The attention a train job loads its policy with, and why: the model's own setting, else varlen on CUDA for
    trainers that do not generate, else transformers' default (None: sdpa). `routed`: the model's class runs its
    attention through transformers' AttentionInterface (routes_attention); a class that does not would ignore
    varlen and attend across a flattened batch's sequences."""
    if entry.get("attn_implementation"):
        if entry["attn_implementation"] == NAME and not routed:
            from snaketrl.errors import ConfigError

            raise ConfigError(f"config: models.{model}.attn_implementation {NAME}: this model's class does not run its "
                              f"attention through transformers' AttentionInterface, so it would ignore {NAME}; "
                              f"use sdpa or flash_attention_2")
        return entry["attn_implementation"], f"set by models.{model}.attn_implementation"
    if device != "cuda":
        return None, "transformers' default (sdpa): torch's varlen kernel needs CUDA"
    if spec.generates:
        return None, "transformers' default (sdpa): the trainer generates, which needs a KV cache varlen lacks"
    if not routed:
        return None, "transformers' default (sdpa): the model's class does not use transformers' AttentionInterface"
    return NAME, MEASURED


def routes_attention(model_dir, model_class: str, trust_remote_code: bool = False) -> bool:
    """Whether the transformers class `model_class` (an Auto class name) loads `model_dir` as a model that runs
    its attention through AttentionInterface (transformers' `_supports_attention_backend`). Code from the
    model's repository is not looked into: False."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    try:
        cls = getattr(transformers, model_class)._model_mapping[type(config)]
    except KeyError:
        return False
    return bool(getattr(cls, "_supports_attention_backend", False))


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (before a model is loaded with it)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    # The flash mask: None without padding (no mask built at all), else the 2D padding mask.
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def sequences(batch: int, length: int, attention_mask, position_ids):
    """(index of the real tokens among batch*length, or None when all are real; cu_seqlens (int32); the longest
    sequence). A sequence is a row's run of real tokens (with a padding mask), else a run of position_ids that
    go up by one (padding-free rows restart them per sequence), within one row."""
    import torch
    import torch.nn.functional as F

    global _last
    source = attention_mask if attention_mask is not None else position_ids
    key = (batch, length)
    if source is not None and _last[0] is not None and _last[0]() is source and _last[1] == key:
        return _last[2]
    device = (source if source is not None else torch.empty(0)).device
    if attention_mask is not None:
        mask = attention_mask[:, -length:].bool()
        index = mask.reshape(-1).nonzero().squeeze(-1)
        lengths = mask.sum(-1, dtype=torch.int32)
    else:
        index = None
        if position_ids is None:
            lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
        else:
            positions = position_ids.expand(batch, length).reshape(-1)
            starts = torch.ones_like(positions, dtype=torch.bool)
            starts[1:] = positions[1:] != positions[:-1] + 1
            starts[::length] = True
            bounds = starts.nonzero().squeeze(-1)
            lengths = torch.diff(bounds, append=bounds.new_tensor([batch * length])).to(torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    result = (index, cu, int(lengths.max()))
    if source is not None:
        _last = (weakref.ref(source), key, result)
    return result


def _varlen_kernel():
    """torch's varlen_attn and whether it takes window_size and enable_gqa (its signature moved between
    releases: torch 2.9 had is_causal)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, position_ids=None,
                             cu_seq_lens_q=None, max_length_q: int | None = None, **kwargs):
    """transformers' attention signature: query (batch, heads, length, dim), key/value (batch, kv_heads,
    length, dim); returns (batch, length, heads, dim) and no weights. Causal within each sequence."""
    import torch
    import torch.nn.functional as F

    if dropout and module.training:
        raise ValueError(f"attn_implementation {NAME}: attention dropout {dropout} is not supported (torch's varlen "
                         f"kernel has none); set the model's attention_dropout to 0 or use sdpa")
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[2] != length:
        raise ValueError(f"attn_implementation {NAME}: {length} queries against {key.shape[2]} keys (a KV cache, "
                         f"as in generation); varlen attends within whole sequences only: use sdpa to generate")
    if cu_seq_lens_q is not None:  # unpad() flattened a padded batch and says where its rows start
        index, cu, longest = None, cu_seq_lens_q, max_length_q
    else:
        index, cu, longest = sequences(batch, length, attention_mask, position_ids)

    def tokens(x):  # (batch, h, length, dim) -> (real tokens, h, dim)
        x = x.transpose(1, 2).reshape(batch * length, x.shape[1], dim)
        return x if index is None else x.index_select(0, index)

    q, k, v = tokens(query), tokens(key), tokens(value)
    if q.is_cuda:
        varlen_attn, has_window, has_gqa = _varlen_kernel()
        dtype = q.dtype
        if dtype not in (torch.float16, torch.bfloat16):  # the flash kernel computes in 16 bits only
            q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        if kv_heads != heads and not has_gqa:
            k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        extra = {"enable_gqa": True} if kv_heads != heads and has_gqa else {}
        if has_window:
            extra["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
        elif sliding_window:
            raise ValueError(f"attn_implementation {NAME}: sliding-window attention needs torch's varlen_attn with "
                             f"window_size (torch {torch.__version__} has none); use sdpa")
        else:
            extra["is_causal"] = True
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra).to(dtype)
    else:
        bounds = cu.tolist()
        parts = []
        for start, end in zip(bounds, bounds[1:]):
            if start == end:  # a row of padding only
                continue
            piece = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            window = None
            if sliding_window and end - start > sliding_window:
                rows = torch.arange(end - start, device=q.device)
                window = (rows[:, None] >= rows[None, :]) & (rows[:, None] - rows[None, :] < sliding_window)
            parts.append(F.scaled_dot_product_attention(*piece, attn_mask=window, is_causal=window is None,
                                                        scale=scaling, enable_gqa=kv_heads != heads)[0].transpose(0, 1))
        out = torch.cat(parts) if parts else q.new_zeros(0, heads, dim)
    if index is not None:
        out = out.new_zeros(batch * length, heads, dim).index_copy(0, index, out)
    return out.reshape(batch, length, heads, dim), None


def windowed(config) -> bool:
    """Whether some layer of the model attends within a sliding window (Gemma 2 and 3, Mistral; not Qwen2, whose
    config keeps the field at None unless use_sliding_window)."""
    if getattr(config, "sliding_window", None) is None:
        return False
    types = getattr(config, "layer_types", None)
    return not types or "sliding_attention" in types


def unpad(decoder) -> list:
    """Run every padded batch through `decoder` (a model's decoder stack, loaded with varlen) padding-free: its
    rows' real tokens as one flattened row, each row a sequence of its own at the positions the padded forward
    gives them, and the hidden states put back in the batch's padded layout for the head. The layers then spend
    nothing on padding (TRL 1.12 has no padding-free path for DPO, reward, KTO or ORPO). Forwards with a KV cache
    (generation) and batches without padding pass unchanged. Returns the hook handles."""
    import torch

    pending = []  # per decoder call: (index of the real tokens, rows, width), or None
    window = windowed(decoder.config)

    def flatten(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if (ids is None or ids.dim() != 2 or mask is None or mask.dim() != 2 or len(args) > 1
                or kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None):
            pending.append(None)
            return None
        keep = mask.bool()
        if bool(keep.all()):
            pending.append(None)
            return None
        if window and bool(((keep[:, 1:] & ~keep[:, :-1]).sum(-1) + keep[:, 0] > 1).any()):
            # The padded forward counts a gap's positions in the window, varlen only the real tokens around it.
            raise ValueError(f"attn_implementation {NAME}: a row with padding between its tokens under sliding-window "
                             f"attention (sliding_window {decoder.config.sliding_window}): varlen would not count "
                             f"the padding in the window as the padded forward does; use sdpa")
        rows, width = ids.shape
        index, cu, longest = sequences(rows, width, keep, None)
        positions = kwargs.get("position_ids")
        positions = (positions if positions is not None else torch.arange(width, device=ids.device)).expand(rows, width)
        pending.append((index, rows, width))
        kwargs = {**kwargs, "input_ids": ids.reshape(-1)[index][None], "attention_mask": None,
                  "position_ids": positions.reshape(-1)[index][None], "use_cache": False,
                  "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        return (), kwargs

    def restore(module, args, kwargs, output):
        entry = pending.pop()
        if entry is None:
            return None
        index, rows, width = entry
        hidden = output.last_hidden_state[0]
        output.last_hidden_state = hidden.new_zeros(rows * width, hidden.shape[-1]).index_copy(
            0, index, hidden).view(rows, width, -1)
        return output

    # snaketrl.train.tokens counts real tokens from the padded batch before this hook (prepended there), the
    # FLOP meter the flattened one after it: the work the layers do.
    return [decoder.register_forward_pre_hook(flatten, with_kwargs=True),
            decoder.register_forward_hook(restore, with_kwargs=True)]
