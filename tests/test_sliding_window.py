"""Sliding-window attention and tied embeddings (Gemma 3's: sliding_window on five layers in six, the output
projection tied to the embeddings) under every attention path the workflow chooses: each gives the losses and
gradients of the sequences alone under eager attention, on a tiny random Gemma 3 whose window (4 tokens) is
shorter than its sequences; a path that cannot train is refused by the plan in one line. And a chat template's
added rows trained as trainable tokens stay tied through the adapter, the merge and the save."""

import json

import pytest
from test_attention import grads, model_with, sequence_losses
from test_chat_template import base_dir  # noqa: F401 (a fixture: the tokenizer without ChatML's markers)

WINDOW = 4
LENGTHS = (23, 3, 17, 9)  # a row shorter than the window, and rows several windows long


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny random Gemma 3 (gemma3_text): two sliding-window layers around a full one, one key-value head, tied
    embeddings, scaled embeddings (Gemma multiplies them by sqrt(hidden_size))."""
    return tiny_gemma(tmp_path_factory.mktemp("gemma") / "model", vocab_size=256)


def tiny_gemma(out, vocab_size, window=WINDOW):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma3_text", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                  query_pre_attn_scalar=16, sliding_window=window, max_position_embeddings=128,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(out)
    return out


def assert_matches(reference, expected, model, got, device, rounding=None):
    """test_attention's assert_same, with each CPU gradient's tolerance scaled to its largest entry: Gemma's
    embeddings are scaled by sqrt(hidden_size), and entries of 10 differ by 1e-5 in fp32 between two correct
    paths (measured: 8e-6 at most, eager packed against eager alone). On CUDA the path runs in bf16 against the
    fp32 reference, within twice bf16's own rounding there: `rounding`, eager attention in bf16 (a model and its
    losses), and at least assert_same's 3 %. Measured on a CPU: bf16 eager 3.8 %, sdpa and varlen 3.5-4.1 % (q/k
    norm gradients), a dropped window 143 %."""
    import torch

    if device != "cpu":
        for a, b in zip(expected, got):
            assert b.item() == pytest.approx(a.item(), rel=2e-2)
        want = grads(reference, expected)
        floor = max(relative_errors(want, grads(*rounding)).values())
        errors = relative_errors(want, grads(model, got))
        assert max(errors.values()) < max(3e-2, 2 * floor), (floor, sorted(errors.items(), key=lambda e: -e[1])[:5])
        return
    for a, b in zip(expected, got):
        assert b.item() == pytest.approx(a.item(), rel=1e-5)
    want, have = grads(reference, expected), grads(model, got)
    assert want.keys() == have.keys() and len(have) > 10
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-5 * float(want[name].abs().max()),
                                   msg=name)


def relative_errors(want, have):
    """Each parameter's gradient error relative to the reference's norm, in float32."""
    assert want.keys() == have.keys() and len(have) > 10
    return {name: ((have[name].float() - want[name].float()).norm() / want[name].float().norm()).item()
            for name in want}


def sequences():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 256, (n,), generator=g) for n in LENGTHS]


def test_the_window_changes_the_losses(gemma_dir):
    """The tests below could not tell a path that drops the window from one that keeps it if it changed nothing."""
    from transformers import AutoModelForCausalLM

    windowed = model_with(gemma_dir, "eager")
    whole = AutoModelForCausalLM.from_pretrained(gemma_dir, attn_implementation="eager", sliding_window=max(LENGTHS))
    for s, n in zip(sequences(), LENGTHS):
        a, b = (sequence_losses(m, [s], packed=False)[0].item() for m in (windowed, whole))
        assert (a == pytest.approx(b, rel=1e-6)) is (n <= WINDOW), n


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("attention, device", [
    ("eager", "cpu"), ("sdpa", "cpu"), ("varlen", "cpu"),
    *[pytest.param(attention, "cuda", marks=pytest.mark.cuda) for attention in ("sdpa", "varlen")]])
def test_each_attention_keeps_the_window_packed_and_padded(gemma_dir, attention, packed, device):
    """Packed: one padding-free row whose position_ids restart per sequence (TRL's packing and padding_free):
    transformers' masks window each sequence by its positions, varlen by its cumulative lengths. Padded: a
    right-padded batch (DPO's and reward's pairs). Each sequence's loss and every gradient as the sequence's alone
    under eager attention (on CUDA: varlen's flash kernel with window_size, to bf16's rounding)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reference = model_with(gemma_dir, "eager", device)
    model = model_with(gemma_dir, attention, device, dtype)
    alone = [sequence_losses(reference, [s], packed=False, device=device)[0] for s in sequences()]
    assert_matches(reference, alone, model, sequence_losses(model, sequences(), packed=packed, device=device),
                   device, rounding=bf16_rounding(gemma_dir, device, lambda m: sequence_losses(
                       m, sequences(), packed=packed, device=device)))


def bf16_rounding(gemma_dir, device, losses):
    """On CUDA: eager attention in bf16 and its losses, bf16's own rounding against the fp32 reference."""
    import torch

    if device == "cpu":
        return None
    eager = model_with(gemma_dir, "eager", device, torch.bfloat16)
    return eager, losses(eager)


def padded_batch():
    """`sequences()` as one right-padded batch with its labels (-100 on padding)."""
    import torch

    seqs = sequences()
    ids = torch.ones(len(seqs), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def row_losses(model, ids, mask, labels):
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return [F.cross_entropy(logits[row, :-1], labels[row, 1:], reduction="sum") for row in range(len(ids))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_unpadded_varlen_keeps_the_window(gemma_dir, device):
    """snaketrl.train.attention.unpad (varlen on a padded batch, what a CUDA DPO or reward job gets): the layers
    see the real tokens only, each row windowed on its own, with the padded batch's losses and gradients."""
    import torch

    from snaketrl.train.attention import unpad
    from snaketrl.train.cost import decoder

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids, mask, labels = (t.to(device) for t in padded_batch())
    reference = model_with(gemma_dir, "eager", device)
    flat = model_with(gemma_dir, "varlen", device, dtype)
    seen = []
    decoder(flat).embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    unpad(decoder(flat))
    assert_matches(reference, row_losses(reference, ids, mask, labels), flat, row_losses(flat, ids, mask, labels),
                   device, rounding=bf16_rounding(gemma_dir, device, lambda m: row_losses(m, ids, mask, labels)))
    assert seen == [(1, sum(LENGTHS))]


def test_unpadded_varlen_refuses_a_gap_inside_a_row_under_a_window(gemma_dir):
    """Padding between a row's tokens (no trainer varlen runs makes it: TRL right-pads or flushes left) counts in a
    padded forward's window, and not in varlen's over the real tokens: refused in one line, not trained otherwise."""
    import torch
    from transformers import AutoConfig

    from snaketrl.train.attention import unpad, windowed
    from snaketrl.train.cost import decoder

    ids, mask, _ = padded_batch()
    mask[0, 6:10] = 0
    flat = model_with(gemma_dir, "varlen")
    unpad(decoder(flat))
    with pytest.raises(ValueError, match=r"^attn_implementation varlen: a row with padding between its tokens under "
                                         r"sliding-window attention \(sliding_window 4\): varlen would not count "
                                         r"the padding in the window as the padded forward does; use sdpa$"):
        flat(input_ids=ids, attention_mask=mask, use_cache=False)
    assert windowed(flat.config) and not windowed(AutoConfig.for_model("qwen2"))  # Qwen2's window is off
    with torch.no_grad():  # a right-padded batch still runs
        flat(input_ids=ids, attention_mask=padded_batch()[1], use_cache=False)


def test_row_groups_keep_the_window(gemma_dir, monkeypatch):
    """snaketrl.train.batching.split_rows (a CPU job's grouped batches): each length group runs trimmed and, under
    sdpa, without its padding mask; the window then still counts from each row's start."""
    from snaketrl.data import lengths
    from snaketrl.train.batching import split_rows

    monkeypatch.setattr(lengths, "MIN_ROW_SPLIT_TOKENS", 1)  # split this small batch: rows 3 and 9, 17 and 23 long

    ids, mask, labels = padded_batch()
    reference = model_with(gemma_dir, "eager")
    grouped = split_rows(model_with(gemma_dir, "sdpa"))
    widths = []
    grouped.model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        (kwargs["input_ids"].shape[1], kwargs["attention_mask"] is None)), with_kwargs=True)
    assert_matches(reference, row_losses(reference, ids, mask, labels), grouped,
                   row_losses(grouped, ids, mask, labels), "cpu")
    assert sorted(widths) == [(9, True), (23, True)]


def test_flex_attention_is_refused_on_a_cpu_before_loading():
    """torch's FlexAttention has no backward pass on a CPU ("FlexAttention does not support backward on CPU",
    after half a minute of compiling): the plan's hardware check refuses it before any model loads."""
    from snaketrl.errors import ConfigError
    from snaketrl.train.args import check_hardware

    with pytest.raises(ConfigError, match=r"^config: models.g.attn_implementation: flex_attention needs a CUDA GPU "
                                          r"to train \(torch's FlexAttention has no backward pass on a CPU\); none "
                                          r"is visible$"):
        check_hardware({}, "r", "g", {"attn_implementation": "flex_attention"}, cuda=False)
    check_hardware({}, "r", "g", {"attn_implementation": "flex_attention"}, cuda=True)
    check_hardware({}, "r", "g", {"attn_implementation": "eager"}, cuda=False)


def test_added_rows_stay_tied_through_the_adapter_the_merge_and_the_save(base_dir, tmp_path):  # noqa: F811
    """chat_template chatml on a tied Gemma 3: the two markers' rows train as trainable tokens (one set: the output
    projection reads the embeddings' rows, scaled as Gemma scales them in the embedding only); the merged
    model saves one tied matrix holding the trained rows, and gives the adapter's logits."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from first_tokens import first_training_ids
    from snaketrl.evaluate.loading import load_for_eval
    from snaketrl.models.download import download
    from snaketrl.models.merge import merge

    base = tiny_gemma(tmp_path / "base", vocab_size=len(AutoTokenizer.from_pretrained(base_dir)))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (base / file).write_bytes((base_dir / file).read_bytes())
    download("g", {"hub": str(base), "chat_template": "chatml"}, tmp_path / "g")
    added = sorted(json.loads((tmp_path / "g" / "chat_template.json").read_text())["added_tokens"].values())
    assert len(added) == 2
    entry = {"hub": "org/g", "chat_template": "chatml", "lora": {"target_modules": ["q_proj", "v_proj"]}}
    first_training_ids("sft", "g", entry, tmp_path / "g", tmp_path / "sft", steps=2, threads=1)
    adapter = tmp_path / "sft" / "out" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"embed_tokens": added, "lm_head": added}  # peft ties the two

    merge(adapter, tmp_path / "g", tmp_path / "merged")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # one matrix, tied on load
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.lm_head.weight is merged.get_input_embeddings().weight
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "g").get_input_embeddings().weight[added]
    assert not torch.allclose(merged.get_input_embeddings().weight[added], before)  # the trained rows
    unmerged = load_for_eval(tmp_path / "g", adapter).model
    ids = torch.tensor([[added[0], 7, 9, added[1], 11, added[0], 3, 5, 8]])  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, unmerged(ids).logits, rtol=1e-4, atol=1e-5)
