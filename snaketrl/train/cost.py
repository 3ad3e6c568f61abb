"""What a run costs: training FLOPs counted from the forward passes of every model a trainer runs, and peak memory.

One forward of a decoder on `t` tokens (`p` query-key pairs: each query against every key of its row, masked
ones included, as eager and SDPA attention compute them) costs

    F = 2·N·t + 4·L·d·p

where N is the weights of every linear layer the tokens pass through (attention and MLP projections, LoRA's A
and B while the adapter is on, the output head on the tokens it is applied to; the input embedding is a lookup,
not counted), L the layers and d the attention width (heads × head_dim). A forward with gradients is trained:
its backward costs 2·N·t + 4·L·d·p·2 more for the activations' gradients (through frozen LoRA bases too) and
2·N_trainable·t for the weight gradients, so a trained token costs 4·N + 2·N_trainable (6·N when every weight
trains) plus three times its attention. A forward without gradients (generation, prompt prefill included; the
reference model, or the policy with its adapter off; reward and value models scoring rollouts) costs F alone.
Activation checkpointing's recomputed forwards are not counted: these are the model's FLOPs, not the hardware's.
"""

from __future__ import annotations

import sys

import torch

ORIGINAL = "original_module"  # peft's ModulesToSaveWrapper keeps the untrained head beside the trained copy


def linear_weights(module) -> tuple[int, int]:
    """(weights, trainable weights) of the linear layers in `module`: in × out per layer (a 4-bit layer's packed
    storage is not its size), each layer once (peft's LoRA layer wraps its base layer: both are counted once)."""
    total = trainable = 0
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and ORIGINAL not in name.split("."):
            size = sub.in_features * sub.out_features
            total += size
            trainable += size if sub.weight.requires_grad else 0
    return total, trainable


def _lora_layers(module) -> list:
    return [m for m in module.modules() if hasattr(m, "lora_A") and hasattr(m, "disable_adapters")]


def _lora_weights(module) -> int:
    return sum(linear_weights(m.lora_A)[0] + linear_weights(m.lora_B)[0] for m in _lora_layers(module))


def _attention_width(config) -> tuple[int, int]:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads * head_dim


def query_key_pairs(args, kwargs) -> tuple[int, int]:
    """(tokens, query-key pairs) of one decoder forward: a 2-D attention mask's width is the keys each query
    sees (the cache included while generating); without one, a cache's length plus the new tokens, or in a
    padding-free batch (one row, positions restarting at 0) each packed sequence's own length (then the pairs
    are a 0-d tensor on the batch's device)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:-1]
    rows, width = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[-1])
    tokens = rows * width
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() in (2, 4):
        return tokens, tokens * mask.shape[-1]
    cache = kwargs.get("past_key_values")
    past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
    positions = kwargs.get("position_ids")
    if not past and rows == 1 and torch.is_tensor(positions):
        # A sequence at positions 0 .. n-1 has n² pairs, the sum of 2·position + 1 over its tokens. Left on the
        # device (a 0-d tensor): reading it here would make the CPU wait for the GPU on every forward.
        return tokens, (2 * positions.reshape(-1).long() + 1).sum()
    return tokens, tokens * (width + past)


def decoder(model):
    """The decoder stack (transformers' `base_model`: the model without its head) of the model being trained.
    Every training forward runs it with the batch's input_ids and attention_mask: the model's own forward, and the
    fused-loss paths of TRL's Liger DPO/KTO/GRPO, which call it directly and never the model (nor peft's wrapper)."""
    model = getattr(model, "policy", model)
    if hasattr(model, "get_base_model"):  # a peft model: its own `base_model` is the tuner, not the decoder
        model = model.get_base_model()
    return getattr(model, "base_model", model)


class FlopMeter:
    """Counts the FLOPs above with forward hooks on each model's decoder and head, split into trained
    (forward and backward of passes with gradients) and forward-only; `take()` hands the counts since the
    last call over and starts again."""

    def __init__(self):
        self.weights: dict[str, dict] = {}  # model -> its N, N_trainable, LoRA weights, L, d
        self.trained = self.forward_only = self.forward_tokens = 0

    def hook(self, models: dict) -> list:
        """Hook every model of `models` (name -> module; each module once); returns the hook handles."""
        handles, seen = [], set()
        for name, model in models.items():
            if model is None or id(model) in seen:
                continue
            seen.add(id(model))
            task = model.get_base_model() if hasattr(model, "get_base_model") else model
            backbone = decoder(model)
            heads = [m for n, m in task.named_children() if m is not backbone and linear_weights(m)[0]]
            weights, trained = linear_weights(backbone)
            layers, width = _attention_width(backbone.config)
            loras = _lora_layers(backbone)
            info = {"weights": weights, "trainable": trained, "lora": _lora_weights(backbone),
                    "layers": layers, "attention_width": width,
                    "head_weights": sum(linear_weights(h)[0] for h in heads),
                    "head_trainable": sum(linear_weights(h)[1] for h in heads)}
            self.weights[name] = info
            trains = bool(trained or info["head_trainable"])
            handles.append(backbone.register_forward_pre_hook(self._decoder(info, loras, trains), with_kwargs=True))
            for head in heads:
                handles.append(head.register_forward_pre_hook(self._head(*linear_weights(head), trains)))
        return handles

    def _add(self, tokens: int, weights: int, trainable: int, attention: int, trains: bool, count_tokens: bool):
        forward = 2 * weights * tokens + attention
        if trains and torch.is_grad_enabled():
            self.trained += forward + 2 * weights * tokens + 2 * attention + 2 * trainable * tokens
        else:
            self.forward_only += forward
            self.forward_tokens += tokens if count_tokens else 0

    def _decoder(self, info: dict, loras: list, trains: bool):
        def count(module, args, kwargs):
            tokens, pairs = query_key_pairs(args, kwargs)
            off = bool(loras) and (loras[0].disable_adapters or loras[0].merged)  # a reference pass, or merged
            weights = info["weights"] - (info["lora"] if off else 0)
            self._add(tokens, weights, 0 if off else info["trainable"],
                      4 * info["layers"] * info["attention_width"] * pairs, trains and not off, True)
        return count

    def _head(self, weights: int, trainable: int, trains: bool):
        def count(module, args):
            # A frozen head of a trained model still passes its activations' gradient down (LoRA below it).
            hidden = args[0]
            self._add(hidden.numel() // hidden.shape[-1], weights, trainable, 0, trains, False)
        return count

    def take(self) -> dict:
        """The counts since the last call, as ints (a padding-free forward's attention is counted on the device:
        TokenCounter calls this once a step, after the step's work is done)."""
        step = {"flops_trained": int(self.trained), "flops_forward_only": int(self.forward_only),
                "forward_only_tokens": self.forward_tokens}
        self.reset()
        return step

    def reset(self) -> None:
        self.trained = self.forward_only = self.forward_tokens = 0


def models_of(trainer) -> dict:
    """Every model a TRL trainer runs forwards through: the trained one (PPO's policy and value model), and
    a separate reference, reward or value model, or reward-model reward functions (GRPO)."""
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    models = {"policy": getattr(model, "policy", model), "value_model": getattr(model, "value_model", None),
              "ref_model": getattr(trainer, "ref_model", None), "reward_model": getattr(trainer, "reward_model", None)}
    for i, func in enumerate(getattr(trainer, "reward_funcs", None) or []):
        if isinstance(func, torch.nn.Module):
            models[f"reward_func_{i}"] = func
    return {name: m for name, m in models.items() if isinstance(m, torch.nn.Module)}


def peak_memory() -> dict:
    """The process's peak resident memory so far (getrusage; KiB on Linux, bytes on macOS) and, on a GPU,
    the peak of torch's allocated CUDA memory."""
    out = {}
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024
    except ImportError:  # Windows
        pass
    if torch.cuda.is_available():
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def step_flops(step: dict) -> int:
    """One per-step record's FLOPs: trained and forward-only together."""
    return step.get("flops_trained", 0) + step.get("flops_forward_only", 0)


def cost_summary(steps: list[dict]) -> dict:
    """Totals over the per-step records (snaketrl.train.tokens.TokenCounter.steps) and the cumulative FLOPs and
    seconds at every optimizer step, to put a log_history's steps on a compute axis."""
    flops = seconds = 0
    curve = {"step": [], "flops": [], "seconds": []}
    for s in steps:
        flops += step_flops(s)
        seconds += s["seconds"]
        curve["step"].append(s["step"])
        curve["flops"].append(flops)
        curve["seconds"].append(round(seconds, 3))
    out = {"flops": flops, "flops_trained": sum(s.get("flops_trained", 0) for s in steps),
           "flops_forward_only": sum(s.get("flops_forward_only", 0) for s in steps),
           "forward_only_tokens": sum(s.get("forward_only_tokens", 0) for s in steps),
           "train_seconds": seconds, "cost_by_step": curve}
    for key in ("peak_rss_bytes", "cuda_peak_bytes"):
        values = [s[key] for s in steps if key in s]
        if values:
            out[key] = max(values)
    return out
