"""Training FLOPs counted from forward hooks (snaketrl.train.cost), checked against the formula by hand."""

import pytest

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, RANK = 64, 128, 2, 4, 2, 1024, 16


@pytest.fixture(scope="module")
def lora_model():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=True)
    lora = LoraConfig(r=RANK, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(Qwen2ForCausalLM(config), lora)


# By hand, from the config: q and o are d×d, k and v d×(d/2) (2 of 4 heads for keys and values), the MLP's
# three projections d×4d... here d×128; LoRA's A and B on q, k, v: r·(in + out) each. The tied head is d×V.
KV = HIDDEN * KV_HEADS // HEADS
BASE = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * INTER)
LORA = LAYERS * RANK * ((HIDDEN + HIDDEN) + 2 * (HIDDEN + KV))
HEAD = HIDDEN * VOCAB


def forward_flops(tokens, pairs, head_tokens, lora=True):
    return 2 * (BASE + (LORA if lora else 0)) * tokens + 4 * LAYERS * HIDDEN * pairs + 2 * HEAD * head_tokens


def test_weights_are_the_linear_layers_lora_included_embedding_excluded(lora_model):
    from snaketrl.train.cost import FlopMeter, linear_weights

    meter = FlopMeter()
    handles = meter.hook({"policy": lora_model})
    try:
        assert meter.weights["policy"] == {"weights": BASE + LORA, "trainable": LORA, "lora": LORA, "layers": LAYERS,
                                           "attention_width": HIDDEN, "head_weights": HEAD, "head_trainable": 0}
        assert linear_weights(lora_model)[0] == BASE + LORA + HEAD
    finally:
        for h in handles:
            h.remove()


def test_trained_reference_and_generation_passes_count_what_they_compute(lora_model):
    import torch

    from snaketrl.train.cost import FlopMeter

    meter = FlopMeter()
    handles = meter.hook({"policy": lora_model})
    ids = torch.randint(0, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    try:
        lora_model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        # 3 rows of 10 tokens, 10 keys each: forward, the activations' gradients (through the frozen base and
        # head too: 2·N·t, twice the attention) and LoRA's weight gradients (2·N_trainable·t).
        attention = 4 * LAYERS * HIDDEN * 300
        assert meter.take() == {"flops_trained": (4 * (BASE + LORA) + 2 * LORA) * 30 + 3 * attention + 4 * HEAD * 30,
                                "flops_forward_only": 0, "forward_only_tokens": 0}
        with torch.no_grad(), lora_model.disable_adapter():  # DPO's reference: the policy without its adapter
            lora_model(input_ids=ids, attention_mask=mask)
        assert meter.take() == {"flops_trained": 0, "flops_forward_only": forward_flops(30, 300, 30, lora=False),
                                "forward_only_tokens": 30}
        # 5 new tokens: the prompt's prefill (head on its last position only), then 4 one-token steps with a cache.
        lora_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        pairs = 3 * 10 * 10 + sum(3 * (10 + i) for i in range(1, 5))
        assert meter.take() == {"flops_trained": 0, "flops_forward_only": forward_flops(30 + 12, pairs, 3 + 12),
                                "forward_only_tokens": 42}
    finally:
        for h in handles:
            h.remove()


def test_a_compiled_decode_step_is_counted_outside_its_graph_as_an_eager_one(lora_model):
    """Generation on a static cache with transformers' compiled decode step (dynamo only: the eager backend): the
    FLOPs by hand of the eager generation above, with no graph break from the hooks; removing the handles
    removes the compiled step's counting too."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, GenerationConfig

    from snaketrl.train.cost import FlopMeter

    task = lora_model.get_base_model()
    meter = FlopMeter()
    handles = meter.hook({"policy": lora_model})
    ids = torch.randint(0, VOCAB, (3, 10))
    compile_config = CompileConfig(backend="eager", fullgraph=True)
    compile_config._compile_all_devices = True
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static",
                              max_cache_len=32, compile_config=compile_config)
    counters.clear()
    try:
        with torch.no_grad():
            lora_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
        pairs = 3 * 10 * 10 + sum(3 * (10 + i) for i in range(1, 5))  # keys written so far, not the cache's 32
        assert meter.take() == {"flops_trained": 0, "flops_forward_only": forward_flops(30 + 12, pairs, 3 + 12),
                                "forward_only_tokens": 42}
        assert "get_compiled_call" in vars(task)
    finally:
        for h in handles:
            h.remove()
    assert "get_compiled_call" not in vars(task)


def test_head_tokens_follow_logits_to_keep():
    import torch

    from snaketrl.train.cost import head_tokens

    ids = torch.zeros(3, 10)
    assert head_tokens((), {"input_ids": ids}) == 30
    assert head_tokens((), {"input_ids": ids, "logits_to_keep": 0}) == 30
    assert head_tokens((), {"input_ids": ids, "logits_to_keep": 1}) == 3
    assert head_tokens((), {"input_ids": ids, "logits_to_keep": 20}) == 30
    assert head_tokens((), {"input_ids": ids, "logits_to_keep": torch.tensor([2, 5])}) == 6


def test_query_key_pairs_of_padding_free_and_cached_forwards():
    import torch

    from snaketrl.train.cost import query_key_pairs

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three packed sequences: 3, 2 and 4 tokens
    tokens, pairs = query_key_pairs((), {"input_ids": torch.zeros(1, 9), "position_ids": positions})
    assert (tokens, int(pairs)) == (9, 9 + 4 + 16)
    assert query_key_pairs((), {"input_ids": torch.zeros(2, 5), "attention_mask": torch.ones(2, 7)}) == (10, 70)

    class Cache:
        def get_seq_length(self):
            return 6

    assert query_key_pairs((), {"input_ids": torch.zeros(2, 1), "past_key_values": Cache()}) == (2, 14)


def test_summary_totals_and_cumulative_curve_over_restored_steps():
    from snaketrl.train.cost import cost_summary

    steps = [{"step": 1, "seconds": 1.5, "flops_trained": 100, "flops_forward_only": 20, "forward_only_tokens": 4,
              "peak_rss_bytes": 10},
             {"step": 2, "seconds": 0.5, "flops_trained": 100, "flops_forward_only": 30, "forward_only_tokens": 6,
              "peak_rss_bytes": 30},
             {"step": 3, "seconds": 1.0, "flops_trained": 50, "flops_forward_only": 0, "forward_only_tokens": 0,
              "peak_rss_bytes": 20}]
    out = cost_summary(steps)
    assert out["flops"] == 300 and out["flops_trained"] == 250 and out["flops_forward_only"] == 50
    assert out["forward_only_tokens"] == 10 and out["train_seconds"] == 3.0 and out["peak_rss_bytes"] == 30
    assert out["cost_by_step"] == {"step": [1, 2, 3], "flops": [120, 250, 300], "seconds": [1.5, 2.0, 3.0]}
    assert "cuda_peak_bytes" not in out
