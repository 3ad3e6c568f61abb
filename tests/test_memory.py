"""snaketrl.train.memory's estimate against the peak a training step measures, where the vocabulary dominates."""

import weakref

import pytest


class PeakLive:
    """The peak bytes of tensors torch ops create while it is entered, alive at once (each storage once; views of
    `model`'s weights left out): what a step adds to memory, measured where the CPU allocator keeps no count."""

    def __init__(self, model):
        self.weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        state = self
        self.live, self.peak, self.seen = 0, 0, set()

        def freed(key, size):
            state.live -= size
            state.seen.discard(key)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        key = storage.data_ptr()
                        if key and key not in state.seen and key not in state.weights:
                            state.seen.add(key)
                            state.live += storage.nbytes()
                            state.peak = max(state.peak, state.live)
                            weakref.finalize(storage, freed, key, storage.nbytes())
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


VOCAB, HIDDEN, ROWS, WIDTH, LABELS = 65536, 64, 2, 48, 16


def vocab_model(hidden: int, trained_rows: bool, tmp_path):
    """A one-layer Qwen2 LoRA model with VOCAB entries, tied; with `trained_rows`, two added tokens whose rows train
    (peft's trainable tokens, as a chat template's): (the peft model, its shape)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.models.chat_template import trainable_tokens, write_record

    shape = {"hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": VOCAB}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", **shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    lora = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    if trained_rows:
        model.resize_token_embeddings(VOCAB + 2, mean_resizing=False)
        shape["vocab_size"] = VOCAB + 2
        write_record({"added_tokens": {"<|im_start|>": VOCAB, "<|im_end|>": VOCAB + 1}}, tmp_path)
        lora = trainable_tokens(model, tmp_path, lora)
    return get_peft_model(model, LoraConfig(**lora)), shape


def sft_step_peak(dtype, monkeypatch) -> tuple[int, dict]:
    """Peak bytes of one SFT step on the label tokens only (snaketrl's one pass, as on a CPU) of a LoRA model
    with a large vocabulary, and its config."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    import trl.trainer.sft_trainer as sft

    from snaketrl.train.labelled import one_pass_loss

    # as use_one_pass does, for this test alone
    monkeypatch.setattr(sft, "_chunked_cross_entropy_loss", one_pass_loss)
    shape = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": VOCAB}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", **shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    sft._patch_chunked_ce_lm_head(model.get_base_model(), chunk_size=256)
    ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :WIDTH - LABELS] = -100  # the prompt: no logits
    with PeakLive(model) as peak:
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    return peak.peak, shape


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sft_estimate_counts_the_label_logits_and_the_fp32_head_copy(dtype, monkeypatch):
    """SFT's one-pass loss computes in fp32 with an fp32 copy of a 16-bit output projection, kept for the
    backward pass: the estimate counts it (it missed it: 0.59 of Gemma 3 270M's measured peak)."""
    import torch

    from snaketrl.train.memory import activation_bytes

    measured, shape = sft_step_peak(getattr(torch, dtype), monkeypatch)
    size = 2 if dtype == "bfloat16" else 4
    tokens, labels = ROWS * WIDTH, ROWS * LABELS  # the first label has no logit (TRL's shift)
    estimate = activation_bytes(shape, tokens, size, projected=labels, upcast_head=True)
    assert 1.0 <= estimate / measured < 1.25, (estimate, measured)
    if size == 2:  # without the copy: far below
        assert activation_bytes(shape, tokens, size, projected=labels) / measured < 0.75
    else:
        assert activation_bytes(shape, tokens, size, projected=labels) == estimate


def test_the_estimate_counts_logits_where_each_trainer_computes_them():
    """A reward model's score head projects onto no vocabulary; ORPO one and a half times every position; SFT every
    position and the fp32 head copy; GRPO and RLOO their completions, chunked, each chunk keeping its logits (and, on
    a head with trained rows, its weight copies) up to logps.KEPT_LOGITS_BYTES."""
    from types import SimpleNamespace

    from snaketrl.train.memory import activation_bytes
    from snaketrl.train.plan import forward_tokens, projected_tokens
    from snaketrl.trainers import REGISTRY

    gemma = {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "vocab_size": 262144}
    fields = SimpleNamespace(per_device_train_batch_size=16, max_completion_length=32)
    assert projected_tokens("reward", REGISTRY["reward"], fields, 256) == 0
    assert forward_tokens(REGISTRY["grpo"], fields, 256) == 16 * (256 + 32)
    assert projected_tokens("grpo", REGISTRY["grpo"], fields, 256) == projected_tokens(
        "rloo", REGISTRY["rloo"], fields, 256) == 16 * 32  # the completions (logits_to_keep)
    assert projected_tokens("sft", REGISTRY["sft"], fields, 256) == 16 * 256
    # a preference pair is two rows
    assert projected_tokens("kto", REGISTRY["kto"], fields, 256) == 2 * 16 * 256
    assert projected_tokens("orpo", REGISTRY["orpo"], fields, 256) == 3 * 16 * 256
    layers = 18 * (38 * 640 + 10 * 2048)
    assert activation_bytes(gemma, 4096, 2, projected=0) == 4096 * layers
    assert activation_bytes(gemma, 4096, 2, upcast_head=True) == 4096 * (layers + 12 * 262144) + 4 * 262144 * 640
    # DPO, KTO and ORPO project 64 positions of Gemma's vocabulary at a time (64 MiB of fp32 logits): four copies
    assert activation_bytes(gemma, 4096, 2, chunked=True) == 4096 * layers + 16 * 262144 * 64
    assert activation_bytes(gemma, 4096, 2, projected=40, chunked=True) == 4096 * layers + 16 * 262144 * 40
    # GRPO's 16 x 32 completion positions: 8 chunks of 64, within KEPT_LOGITS_BYTES (256 positions' worth) no more:
    # a chunk at a time, as DPO's; 4 x 32 keep the first chunk's logits (one fp32 copy) beside the last one's four
    assert activation_bytes(gemma, 4608, 2, 512, chunked=True, kept=True) == 4608 * layers + 16 * 262144 * 64
    assert activation_bytes(gemma, 4608, 2, 128, chunked=True, kept=True) == \
        4608 * layers + 16 * 262144 * 64 + 4 * 262144 * 64
    # a head with trained rows (ChatML's added tokens): its bf16 weight built once a pass, its gradient summed over
    # the chunks and a chunk's own: three copies, less the last chunk's kept logits where chunks keep them
    head = 262144 * 640 * 2
    assert activation_bytes(gemma, 4608, 2, 128, chunked=True, kept=True, trained_rows=True) == \
        4608 * layers + 16 * 262144 * 64 + 4 * 262144 * 64 + 3 * head - 4 * 262144 * 64
    assert activation_bytes(gemma, 4608, 2, 512, chunked=True, kept=True, trained_rows=True) == \
        4608 * layers + 16 * 262144 * 64 + 3 * head
    # one chunk (TRL's path): the one copy its forward builds
    assert activation_bytes(gemma, 4608, 2, 40, chunked=True, kept=True, trained_rows=True) == \
        4608 * layers + 16 * 262144 * 40 + head
    # PPO's value model runs the same tokens: its layers count again
    assert activation_bytes(gemma, 4096, 2, chunked=True, value_model=True) == 2 * 4096 * layers + 16 * 262144 * 64


def test_a_chunked_step_measures_the_estimate_of_its_chunks():
    """DPO's, KTO's and ORPO's log-probs in chunks (snaketrl.train.scored): a step of 768 positions holds the logits
    of a chunk's 64 positions at a time (logps.MAX_CHUNK_POSITIONS), four fp32 copies of them in its backward pass,
    as the estimate counts; TRL's path, all positions at once, the same per position."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    from snaketrl.train.logps import chunk_positions, without_projection
    from snaketrl.train.memory import activation_bytes
    from snaketrl.train.scored import token_scores

    rows, width = 2, 384
    shape = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": VOCAB}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", **shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, VOCAB, (rows, width), generator=torch.Generator().manual_seed(1))
    head = model.get_output_embeddings()
    measured = {}
    for chunked in (True, False):
        with PeakLive(model) as peak:
            if chunked:
                with without_projection(head) as autocast:
                    hidden = model(input_ids=ids, use_cache=False).logits
                logp, _, _ = token_scores(hidden[:, :-1], head, ids[:, 1:], torch.ones(rows, width - 1, dtype=bool),
                                          autocast[0])
            else:
                logp = selective_log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:])
            logp.sum().backward()
        measured[chunked] = peak.peak
    assert chunk_positions(VOCAB, 4) == 64  # 64 MiB would hold 256: the cap on positions binds
    estimate = activation_bytes(shape, rows * width, 4, chunked=True)
    assert 0.98 <= estimate / measured[True] < 1.1, (estimate, measured)  # 0.9973 measured
    assert measured[False] > 2.9 * measured[True]  # every position's logits at once
    # the unchunked count (12 bytes per entry) for every position is short of TRL's path
    assert activation_bytes(shape, rows * width, 4) / measured[False] < 0.8


@pytest.mark.parametrize("trained_rows", [False, True])
@pytest.mark.parametrize("kept", [True, False])
def test_grpos_chunked_step_measures_its_estimate(kept, trained_rows, tmp_path, monkeypatch):
    """GRPO's trained pass (snaketrl.train.logps) over 8 x 48 completion positions, 6 chunks of 64: below
    KEPT_LOGITS_BYTES every chunk keeps its fp32 logits for the backward pass, which holds the last one's four
    copies; above it, one chunk's four copies at a time. On a head whose added tokens' rows train (peft's wrapper
    builds the whole weight: once a pass, snaketrl.train.head.one_weight_forward) the backward pass holds that
    weight, its gradient summed over the chunks and a chunk's own gradient: a head 256 wide, whose weight is four
    chunk logits' worth, as Gemma 3's bf16 head is five (at 64 wide autograd frees a chunk's logits first: 1 to 2
    copies measured against the 2 to 3 counted). The estimate for the completion positions against every tensor
    alive at once."""
    import torch
    import trl

    from snaketrl.train import logps
    from snaketrl.train.memory import activation_bytes
    from test_logps import fake_trainer

    rows, prompt, keep = 8, 16, 48
    monkeypatch.setattr(logps, "KEPT_LOGITS_BYTES", logps.KEPT_LOGITS_BYTES if kept else 2 ** 20)
    model, shape = vocab_model(256 if trained_rows else HIDDEN, trained_rows, tmp_path)
    trainer = fake_trainer(trl.GRPOTrainer, model)
    logps.chunk_completion_logits(trainer)
    ids = torch.randint(0, VOCAB, (rows, prompt + keep), generator=torch.Generator().manual_seed(1))
    with PeakLive(model) as peak:
        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), keep)
        lp.sum().backward()
    assert logps.keeps_too_much(rows * keep, VOCAB) is not kept
    estimate = activation_bytes(shape, ids.numel(), 4, rows * keep, chunked=True, kept=True,
                                trained_rows=trained_rows)
    assert 0.95 <= estimate / peak.peak < 1.1, (estimate, peak.peak)  # 0.995 to 1.05 measured
    if kept or trained_rows:  # the chunk count of DPO's alone falls short
        assert activation_bytes(shape, ids.numel(), 4, rows * keep, chunked=True) / peak.peak < 0.85


def test_trls_path_on_a_head_with_trained_rows_holds_one_weight_copy_more(tmp_path):
    """DPO, KTO and ORPO keep TRL's path, every position's logits at once, where a chat template's added tokens train
    in the head (snaketrl.train.scored.plans_chunks): peft's wrapper builds the whole weight once a forward, and one
    copy is alive at the step's peak, which the estimate counts (it counted none: Gemma 3's DPO and ORPO)."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    from snaketrl.train.memory import activation_bytes

    rows, width, hidden = 2, 96, 256
    measured = {}
    for trained_rows in (False, True):
        model, shape = vocab_model(hidden, trained_rows, tmp_path)
        ids = torch.randint(0, VOCAB, (rows, width), generator=torch.Generator().manual_seed(1))
        with PeakLive(model) as peak:
            selective_log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:]).sum().backward()
        measured[trained_rows] = peak.peak
    copy = (VOCAB + 2) * hidden * 4
    assert 0.95 <= (measured[True] - measured[False]) / copy < 1.1, measured  # 1.03 measured
    assert activation_bytes(shape, rows * width, 4, trained_rows=True) - activation_bytes(shape, rows * width, 4) \
        == copy


@pytest.mark.parametrize("dtype, prompt", [("bfloat16", 16), ("bfloat16", 112), ("float32", 48)])
def test_online_dpos_trained_pass_measures_its_estimate(dtype, prompt):
    """Online DPO's trained pass (TRL's _forward: the model's logits for every position, a log-softmax of the
    completions alone), its reference pass without gradient, and the backward pass: the estimate counts a
    16-bit run's logits twice (accelerate's fp32 copy of them) and the completions' log-softmax: 6 and 6 bytes per
    vocabulary entry of every and each completion position in bf16, 4 and 8 in fp32."""
    import types

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from accelerate.utils import convert_outputs_to_fp32
    from trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer

    from snaketrl.train.memory import activation_bytes

    rows, completion = 8, 32
    shape = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": VOCAB}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", **shape, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        dtype=getattr(torch, dtype))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(1)
    prompts, completions = (torch.randint(0, VOCAB, (rows, n), generator=gen) for n in (prompt, completion))
    forward = types.MethodType(OnlineDPOTrainer._forward, types.SimpleNamespace(max_length=512))
    masks = torch.ones_like(prompts), torch.ones_like(completions)
    if dtype == "bfloat16":  # as the trainer runs a 16-bit model: accelerate's autocast, its outputs back in fp32
        model.forward = convert_outputs_to_fp32(model.forward)
    with PeakLive(model) as peak, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        logprobs = forward(model, prompts, masks[0], completions, masks[1])
        with torch.no_grad(), model.disable_adapter():
            reference = forward(model, prompts, masks[0], completions, masks[1])
        (logprobs - reference).sum().backward()
    size = 2 if dtype == "bfloat16" else 4
    tokens = rows * (prompt + completion)
    estimate = activation_bytes(shape, tokens, size, completions=rows * completion)
    assert 0.97 <= estimate / peak.peak < 1.1, (estimate, peak.peak)
    if dtype == "float32":  # 4 bytes of every position, 8 of each completion position, exactly; the layers' estimate
        assert 0.999 < estimate / peak.peak < 1.001


def test_ppos_value_model_keeps_a_gradient_and_two_adamw_moments_of_every_weight(tmp_path):
    """PPO trains its value model's every weight: after an AdamW step each has a gradient and two moments in its
    dtype, what trained_state_bytes counts from the model's files (none of it counted before: Qwen's PPO step added
    3.14 GiB against an estimate of 1.18)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from snaketrl.train.memory import parameter_count, trained_state_bytes

    shape = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 4096,
             "num_labels": 1, "pad_token_id": 0}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(
        "qwen2", **shape, num_attention_heads=4, num_key_value_heads=2), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert parameter_count(tmp_path) == sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.randint(1, 4096, (2, 16))).logits.sum().backward()
    optimizer.step()
    kept = sum(p.grad.nbytes for p in model.parameters()) + sum(
        t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim() > 0)
    assert trained_state_bytes(tmp_path, 2) == kept
    assert trained_state_bytes(None, 2) == 0


def test_a_kept_heap_counts_trls_logits_twice_and_only_where_the_job_keeps_it(monkeypatch):
    """A job that keeps what it frees (snaketrl.processes) cannot reuse the last step's logits blocks for the next
    step's new lengths: TRL's every-position logits count twice there (ORPO on Gemma 3: 5.93 GiB added kept, 3.25
    given back); chunks, of one size, once; a job that samples completions gives its memory back."""
    from snaketrl.train.memory import activation_bytes, keeps_freed_memory

    gemma = {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "vocab_size": 262144}
    layers = 18 * (38 * 640 + 10 * 2048)
    assert activation_bytes(gemma, 1024, 2, heap_kept=True) == 1024 * layers + 2 * 12 * 262144 * 1024
    assert activation_bytes(gemma, 1024, 2, chunked=True, heap_kept=True) == \
        activation_bytes(gemma, 1024, 2, chunked=True)
    monkeypatch.delenv("SNAKETRL_KEEP_FREED_MEMORY", raising=False)
    assert keeps_freed_memory("cpu", generates=False) and not keeps_freed_memory("cpu", generates=True)
    assert not keeps_freed_memory("cuda", generates=False)
    monkeypatch.setenv("SNAKETRL_KEEP_FREED_MEMORY", "0")
    assert not keeps_freed_memory("cpu", generates=False)
    monkeypatch.setenv("SNAKETRL_KEEP_FREED_MEMORY", "1")
    assert keeps_freed_memory("cpu", generates=True)
