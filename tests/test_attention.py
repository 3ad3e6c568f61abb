"""attn_implementation: varlen (snaketrl/train/attention.py) against sdpa: the same losses and gradients, per
sequence, whether the sequences come packed into one padding-free row or padded in a batch."""

import pytest


def model_with(tiny_model_dir, attention, device="cpu", dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    from snaketrl.train.attention import register

    register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention,
                                                dtype=dtype or torch.float32).to(device)


def sequence_losses(model, seqs, packed: bool, device="cpu"):
    """Per sequence: its summed next-token loss, from one packed row or one right-padded batch."""
    import torch
    import torch.nn.functional as F

    if packed:
        ids = torch.cat(seqs)[None].to(device)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()
        out, start = [], 0
        for s in seqs:
            end = start + len(s)
            out.append(F.cross_entropy(logits[start:end - 1], ids[0, start + 1:end], reduction="sum"))
            start = end
        return out
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float()
    return [F.cross_entropy(logits[row, :len(s) - 1], ids[row, 1:len(s)].to(device), reduction="sum")
            for row, s in enumerate(seqs)]


def grads(model, losses):
    model.zero_grad()
    sum(losses).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, expected, model, got, device):
    """Each loss and every parameter's gradient as the reference's: to float rounding on CPU (fp32), to bf16's
    on CUDA (each gradient within 3 % of the reference's norm)."""
    import torch

    for a, b in zip(expected, got):
        assert b.item() == pytest.approx(a.item(), rel=1e-5 if device == "cpu" else 2e-2)
    want, have = grads(reference, expected), grads(model, got)
    assert want.keys() == have.keys() and len(have) > 10
    if device == "cpu":
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    else:
        errors = {name: ((have[name].float() - want[name].float()).norm() / want[name].float().norm()).item()
                  for name in want}
        assert max(errors.values()) < 3e-2, sorted(errors.items(), key=lambda e: -e[1])[:5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_varlen_gives_each_sequence_its_own_loss_and_gradient(tiny_model_dir, packed, device):
    """On CPU (fp32, one sdpa call per sequence) to float rounding; on CUDA (bf16, torch's flash varlen kernel
    against sdpa) to bf16's: each gradient within 3 % of the reference's norm."""
    import torch

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, 1000, (n,), generator=g) for n in (37, 12, 64, 5, 29)]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reference = model_with(tiny_model_dir, "sdpa", device, dtype)
    varlen = model_with(tiny_model_dir, "varlen", device, dtype)
    alone = [sequence_losses(reference, [s], packed=False, device=device)[0] for s in seqs]
    assert_same(reference, alone, varlen, sequence_losses(varlen, seqs, packed=packed, device=device), device)


def test_varlen_finds_sequences_from_positions_and_masks():
    import torch

    from snaketrl.train.attention import sequences

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    index, cu, longest = sequences(1, 9, None, positions)
    assert index is None and cu.tolist() == [0, 3, 5, 9] and longest == 4
    # Rows of a batch are sequences of their own even when positions run on across the row boundary.
    index, cu, longest = sequences(2, 3, None, torch.arange(3)[None])
    assert cu.tolist() == [0, 3, 6] and longest == 3
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    index, cu, longest = sequences(3, 4, mask, None)
    assert index.tolist() == [0, 1, 2, 5, 6, 7] and cu.tolist() == [0, 3, 6, 6] and longest == 3


def test_varlen_only_for_a_model_class_that_routes_attention_through_transformers(tiny_model_dir, monkeypatch):
    """A class with its own attention code would ignore varlen and attend across a flattened batch."""
    from transformers import Qwen2ForCausalLM

    from snaketrl.errors import ConfigError
    from snaketrl.train.attention import choose, routes_attention
    from snaketrl.trainers import REGISTRY

    assert routes_attention(tiny_model_dir, "AutoModelForCausalLM")
    assert routes_attention(tiny_model_dir, "AutoModelForSequenceClassification")
    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_attention_backend", False)
    assert not routes_attention(tiny_model_dir, "AutoModelForCausalLM")
    attention, why = choose(REGISTRY["sft"], {}, "cuda", routed=False)
    assert attention is None and "AttentionInterface" in why
    with pytest.raises(ConfigError, match=r"^config: models.m.attn_implementation varlen: this model's class does "
                                          r"not run its attention through transformers' AttentionInterface"):
        choose(REGISTRY["sft"], {"attn_implementation": "varlen"}, "cpu", routed=False, model="m")


def test_cuda_jobs_choose_varlen_unless_the_model_sets_one_or_the_trainer_generates():
    from snaketrl.train.attention import choose
    from snaketrl.trainers import REGISTRY

    for trainer in ("sft", "dpo", "reward", "kto", "orpo"):
        assert choose(REGISTRY[trainer], {}, "cuda")[0] == "varlen"
        assert choose(REGISTRY[trainer], {}, "cpu")[0] is None
        assert choose(REGISTRY[trainer], {"attn_implementation": "eager"}, "cuda")[0] == "eager"
    for trainer in ("grpo", "rloo", "online_dpo", "ppo"):
        attention, why = choose(REGISTRY[trainer], {}, "cuda")
        assert attention is None and "KV cache" in why


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "online_dpo", "ppo"])
def test_varlen_is_refused_for_trainers_that_generate(trainer):
    from snaketrl.errors import ConfigError
    from snaketrl.train.args import check_switches

    with pytest.raises(ConfigError, match=rf"^config: run 'x': models.m.attn_implementation varlen attends within "
                                          rf"whole sequences and has no KV cache, which {trainer} needs"):
        check_switches(trainer, {}, "run 'x'", "m", {"attn_implementation": "varlen"})
    check_switches("sft", {}, "run 'x'", "m", {"attn_implementation": "varlen"})


def test_varlen_refuses_a_kv_cache(tiny_model_dir):
    import torch

    model = model_with(tiny_model_dir, "varlen").eval()
    ids = torch.randint(5, 1000, (1, 6))
    with pytest.raises(ValueError, match="attn_implementation varlen: 1 queries against 7 keys"):
        model.generate(ids, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("padding", ["right", "middle"])
def test_unpad_runs_a_padded_batch_padding_free_with_the_padded_losses_and_gradients(tiny_model_dir, padding,
                                                                                     device):
    """snaketrl.train.attention.unpad: the decoder sees only the batch's real tokens (one flattened row), and every
    row's loss and every gradient are those of the padded batch under sdpa (right padding as DPO and reward
    batches have; padding in the middle as a left-padded prompt before a right-padded completion would give)."""
    import torch
    import torch.nn.functional as F

    from snaketrl.train.attention import unpad
    from snaketrl.train.cost import decoder

    g = torch.Generator().manual_seed(2)
    lengths = [(0, 37), (0, 12), (0, 64), (0, 5)] if padding == "right" else [(0, 30), (6, 20), (0, 64), (3, 9)]
    ids = torch.randint(5, 1000, (len(lengths), 64), generator=g)
    mask = torch.zeros_like(ids)
    for row, (gap_at, n) in enumerate(lengths):
        mask[row, :n] = 1
        if gap_at:
            mask[row, gap_at:gap_at + 4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for row, (gap_at, n) in enumerate(lengths):
        if gap_at:  # its logits would come from a pad position, which the flattened row has not computed
            labels[row, gap_at + 4] = -100

    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)

    def losses(model):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        return [F.cross_entropy(logits[row, :-1], labels[row, 1:], reduction="sum") for row in range(len(ids))]

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reference = model_with(tiny_model_dir, "sdpa", device, dtype)
    flat = model_with(tiny_model_dir, "varlen", device, dtype)
    seen = []
    decoder(flat).embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    handles = unpad(decoder(flat))
    expected = losses(reference)
    assert_same(reference, expected, flat, losses(flat), device)
    assert seen == [(1, int(mask.sum()))]  # the layers ran on the real tokens only
    for handle in handles:
        handle.remove()
    assert losses(flat)[0].item() == pytest.approx(expected[0].item(), rel=1e-5 if device == "cpu" else 2e-2)
    assert seen[-1] == tuple(ids.shape)


def test_a_varlen_dpo_run_trains_padding_free_to_the_padded_runs_losses(tmp_path, config, tiny_model_dir):
    """train_run with models.<m>.attn_implementation varlen (what a CUDA job gets unasked): DPO's padded pairs run
    through the layers padding-free (token efficiency 1.0), with the losses of the same run under sdpa."""
    import copy
    import json

    from snaketrl.train.run import train_run
    from test_trainers import prepare

    logs, metrics = {}, {}
    for attention in ("sdpa", "varlen"):
        cfg = copy.deepcopy(config)
        cfg["models"]["qwen2-tiny"]["attn_implementation"] = attention
        (tmp_path / attention).mkdir()
        metrics[attention] = train_run(**prepare(tmp_path / attention, cfg, tiny_model_dir, "dpo"))
        state = json.loads((tmp_path / attention / "out" / "trainer_state.json").read_text())
        logs[attention] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert metrics["varlen"]["unpadded"] and not metrics["sdpa"]["unpadded"]
    assert metrics["sdpa"]["token_efficiency"] < 0.95 and metrics["varlen"]["token_efficiency"] == 1.0
    assert metrics["varlen"]["real_tokens"] == metrics["sdpa"]["real_tokens"]
    assert len(logs["varlen"]) == 3 and logs["varlen"] == pytest.approx(logs["sdpa"], rel=1e-4)


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_trls_flash_attention_warning_is_answered_under_varlen_only(tiny_model_dir, tmp_path, caplog, attention):
    """TRL's SFTTrainer, built for packed (padding-free) SFT, warns by attn_implementation's name that sequences may
    attend to each other unless a flash variant is set. Under varlen the job's log says instead why it does not
    apply; under sdpa TRL's warning stays. TRL's own text: if TRL rewords it, this fails."""
    import logging

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from snaketrl.train.attention import answering_trl_flash_warnings

    model = model_with(tiny_model_dir, attention)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = Dataset.from_list([{"prompt": "TL;DR: a b c", "completion": " d e"}] * 4)
    args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, report_to="none", bf16=False,
                     activation_checkpointing=False)
    with caplog.at_level(logging.INFO), answering_trl_flash_warnings(attention, "sft-qwen2-tiny"):
        SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trl_warned = [r.getMessage().removeprefix("[RANK 0] ")[:45] for r in caplog.records
                  if r.name == "trl.trainer.sft_trainer" and "Flash Attention" in r.getMessage()]
    answered = [r.getMessage() for r in caplog.records if r.name == "snaketrl.train"]
    if attention == "varlen":
        assert trl_warned == [] and len(answered) == 1 and answered[0].startswith(
            "sft-qwen2-tiny: TRL's warning that packed or padding-free batches need a flash attention variant "
            "does not apply: varlen is one")
    else:
        assert trl_warned == ["Padding-free training is enabled, but the att",
                              "You are using packing, but the attention impl"] and answered == []
