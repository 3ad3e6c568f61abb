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
    rows, width = input_shape(args, kwargs)
    tokens = rows * width
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() in (2, 4):
        return tokens, tokens * mask.shape[-1]
    cache = kwargs.get("past_key_values")
    past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
    positions = kwargs.get("position_ids")
    # `not past` last: a static cache's length is a tensor, whose truth the CPU would wait for on a GPU.
    if rows == 1 and torch.is_tensor(positions) and not past:
        # A sequence at positions 0 .. n-1 has n² pairs, the sum of 2·position + 1 over its tokens. Left on the
        # device (a 0-d tensor): reading it here would make the CPU wait for the GPU on every forward.
        return tokens, (2 * positions.reshape(-1).long() + 1).sum()
    return tokens, tokens * (width + past)


def input_shape(args, kwargs) -> tuple[int, int]:
    """(rows, width) of a forward's input ids (or embeddings); a 1-D input is one row."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:-1]
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[-1])


def head_tokens(args, kwargs) -> int:
    """Tokens a causal LM's head runs on in one forward: transformers' `logits_to_keep` (an int: the last k of
    each row, 0 all of them; a tensor: the positions it holds)."""
    rows, width = input_shape(args, kwargs)
    keep = kwargs.get("logits_to_keep", 0)
    if torch.is_tensor(keep):
        return rows * keep.numel()
    return rows * (min(keep, width) if keep else width)


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
    last call over and starts again. A decode step generate runs compiled is counted as its eager forward."""

    def __init__(self):
        self.weights: dict[str, dict] = {}  # model -> its N, N_trainable, LoRA weights, L, d
        self.trained = self.forward_only = self.forward_tokens = 0
        # True within a compiled call counted before it ran (`_count_compiled`): the hooks traced into its graph
        # count nothing there (read as a constant at trace time: no graph break, one guard)
        self.counted_outside = False

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
            count_decoder = self._decoder(info, loras, trains)
            count_heads = [self._head(*linear_weights(head), trains) for head in heads]
            handles.append(backbone.register_forward_pre_hook(self._hook(count_decoder), with_kwargs=True))
            for head, count in zip(heads, count_heads):
                handles.append(head.register_forward_pre_hook(self._hook(
                    lambda args, kwargs, count=count: count(args[0].numel() // args[0].shape[-1]))))
            if hasattr(task, "get_compiled_call"):
                handles.append(self._count_compiled(task, count_decoder, count_heads))
        return handles

    def _hook(self, count):
        """A forward pre-hook (with or without kwargs) running `count(args, kwargs)` unless the call is counted
        outside (a compiled decode step)."""
        def hook(module, args, kwargs=None):
            if not self.counted_outside:
                count(args, kwargs or {})
        return hook

    def _count_compiled(self, task, count_decoder, count_heads) -> "Restored":
        """transformers' generate runs its decode steps through `task.get_compiled_call`'s function
        (snaketrl.train.generation.compile_decode). Its calls are counted here, before each runs and outside its
        graph, as the hooks count an eager forward of the same inputs: traced into the graph, the hooks would
        break it (a static cache's length is a tensor, the query-key pairs branch on it)."""
        original = task.get_compiled_call

        def get_compiled_call(compile_config):
            compiled = original(compile_config)

            def counted(*args, **kwargs):
                count_decoder(args, kwargs)
                for count in count_heads:
                    count(head_tokens(args, kwargs))
                self.counted_outside = True
                try:
                    return compiled(*args, **kwargs)
                finally:
                    self.counted_outside = False
            return counted

        task.get_compiled_call = get_compiled_call
        return Restored(task, "get_compiled_call")

    def _add(self, tokens: int, weights: int, trainable: int, attention: int, trains: bool, count_tokens: bool):
        forward = 2 * weights * tokens + attention
        if trains and torch.is_grad_enabled():
            self.trained += forward + 2 * weights * tokens + 2 * attention + 2 * trainable * tokens
        else:
            self.forward_only += forward
            self.forward_tokens += tokens if count_tokens else 0

    def _decoder(self, info: dict, loras: list, trains: bool):
        def count(args, kwargs):
            tokens, pairs = query_key_pairs(args, kwargs)
            off = bool(loras) and (loras[0].disable_adapters or loras[0].merged)  # a reference pass, or merged
            weights = info["weights"] - (info["lora"] if off else 0)
            self._add(tokens, weights, 0 if off else info["trainable"],
                      4 * info["layers"] * info["attention_width"] * pairs, trains and not off, True)
        return count

    def _head(self, weights: int, trainable: int, trains: bool):
        def count(tokens: int):
            # A frozen head of a trained model still passes its activations' gradient down (LoRA below it).
            self._add(tokens, weights, trainable, 0, trains, False)
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


class Restored:
    """A hook handle for an attribute set on an object: `remove()` deletes it (the class's shows again)."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def remove(self) -> None:
        self.owner.__dict__.pop(self.name, None)


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


# A step record's memory (snaketrl.train.tokens.TokenCounter): the peaks so far, and the resident memory and peak
# where training began (the weights loaded), which the steps' peak adds to unless loading peaked higher.
MEMORY_KEYS = ("peak_rss_bytes", "cuda_peak_bytes", "train_begin_rss_bytes", "train_begin_peak_rss_bytes",
               "train_begin_cuda_peak_bytes")


def resident_bytes() -> int:
    """The process's resident memory now: where training begins, what its steps' peak adds to (the activation
    estimate of snaketrl.train.memory is checked against that difference)."""
    import psutil

    return psutil.Process().memory_info().rss


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
    for key in MEMORY_KEYS:
        values = [s[key] for s in steps if key in s]
        if values:
            out[key] = max(values)
    return out
