"""Generation's bf16 linear layers on prepacked oneDNN weights (snaketrl.train.packed): the same logits and tokens
bit for bit, every plain bf16 linear layer packed and restored, gradients on the layers' own path, and the plan's
rule."""

import pytest

from test_generation import GIB, grpo_trainer, lora_model, prompts
from test_plan import plan_of


def onednn_bf16() -> bool:
    from snaketrl.train.args import native_bf16

    return native_bf16(cpu=True)


needs_bf16 = pytest.mark.skipif("not onednn_bf16()", reason="oneDNN without bf16 units: the plan never packs here")


def bf16_lora_model(tiny_model_dir):
    """The tiny model with its trained-looking LoRA adapter, its base weights in bf16 and the adapter's in fp32 (as
    peft keeps them), as a CPU job with bf16 units loads a real model."""
    import torch

    model, tokenizer = lora_model(tiny_model_dir)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
    return model, tokenizer


def counted_products(monkeypatch) -> list:
    """The weight shapes of every oneDNN packed product from here on."""
    import torch

    products, pointwise = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, w, *a: products.append(tuple(w.shape)) or pointwise(x, w, *a), raising=False)
    return products


def plain_linears(model):
    import torch

    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16]


@needs_bf16
def test_packed_layers_give_the_same_logits_and_sampled_tokens_bit_for_bit(tiny_model_dir, monkeypatch):
    """A forward's logits and 8 prompts x 24 sampled tokens (temperature 0.7, seed 0) within `packed` equal the
    unpacked ones exactly; within, every plain bf16 linear layer (each LoRA layer's base, the MLP's three, the
    head: 7 a layer and one) runs oneDNN's packed product, the adapters' fp32 matrices torch's own; with gradients
    on the layers' own forward runs (its output has a gradient); outside, no forward of their own is left."""
    import torch
    from transformers import set_seed

    from snaketrl.train.packed import packed

    model, tokenizer = bf16_lora_model(tiny_model_dir)
    layers = plain_linears(model)
    assert len(layers) == 7 * model.config.num_hidden_layers + 1
    assert all(m.weight.dtype == torch.float32 for n, m in model.named_modules() if n.endswith("lora_A.default"))
    inputs = prompts(tokenizer)

    def run():
        with torch.no_grad():
            logits = model(**inputs).logits
        set_seed(0)
        out = model.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.pad_token_id)
        return logits, out

    plain_logits, plain_tokens = run()
    products = counted_products(monkeypatch)
    with packed(model):
        assert all("forward" in m.__dict__ for m in layers)
        logits, tokens = run()
        trained = model(**inputs).logits
    assert torch.equal(logits, plain_logits) and torch.equal(tokens, plain_tokens)
    assert tokens.shape == (8, inputs["input_ids"].shape[1] + 24)
    assert {tuple(m.weight.shape) for m in layers} == set(products)
    assert trained.requires_grad
    torch.testing.assert_close(trained.detach(), plain_logits, rtol=0, atol=0)
    assert not any("forward" in m.__dict__ for m in model.modules())
    count = len(products)
    run()
    assert len(products) == count  # outside: torch's own linear again


@needs_bf16
def test_a_grpo_trainers_packed_generation_samples_trls_completions(tmp_path, tiny_model_dir, monkeypatch):
    """pack_for_generation on a built GRPO trainer whose weights are bf16: TRL's sampled completions under the same
    seed, token for token, by packed products (each layer's once a decode step at least), and the layers' own
    forward for the trained pass after it."""
    import torch
    from transformers import set_seed

    from snaketrl.train.packed import pack_for_generation

    trainer, _, prompt_ids = grpo_trainer(tmp_path, tiny_model_dir)
    trainer.model.to(torch.bfloat16)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)

    def generate():
        set_seed(0)
        completions, _ = trainer._generate_single_turn(prompt_ids, None, {})
        return completions

    plain = generate()
    products = counted_products(monkeypatch)
    pack_for_generation(trainer, "grpo")
    assert generate() == plain and max(len(c) for c in plain) == 16
    assert len(products) >= 16 * len(plain_linears(model))
    assert plain_linears(model) and not any("forward" in m.__dict__ for m in plain_linears(model))


def test_the_plan_packs_generation_on_a_bf16_cpu_for_a_real_models_online_trainer(tmp_path, config, tiny_model_dir):
    from types import SimpleNamespace

    from snaketrl.train.plan import Device, packs_for_generation

    bf16_cpu = Device("cpu", True, 64 * GIB)
    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, "grpo", bf16_cpu)
    real = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, "grpo", bf16_cpu, run={"model_entry": real})
    assert plan.args.bf16 and plan.packed_generation is True and plan.report()["packed_generation"] is True
    assert any(note.startswith("generation's bf16 linear layers on prepacked weights: ") for note in plan.notes)
    assert tiny.packed_generation is False and "packed_generation" not in tiny.report()
    _, fp32 = plan_of(tmp_path / "fp32", config, tiny_model_dir, "grpo", Device("cpu", False, 64 * GIB),
                      run={"model_entry": real})
    assert fp32.packed_generation is False
    run, args = {"trainer": "rloo", "model_entry": {"gguf": {}}}, SimpleNamespace(bf16=True, use_vllm=False)
    assert packs_for_generation(run, "cpu", args, False, True)[0] is True
    assert packs_for_generation(run, "cuda", args, False, True)[0] is False
    assert packs_for_generation(run, "cpu", args, True, True)[0] is False  # sharded
    assert packs_for_generation(run, "cpu", args, False, False)[0] is False  # no bf16 units
    assert packs_for_generation(run, "cpu", SimpleNamespace(bf16=False, use_vllm=False), False, True)[0] is False
    assert packs_for_generation(run, "cpu", SimpleNamespace(bf16=True, use_vllm=True), False, True)[0] is False
    assert packs_for_generation({**run, "model_entry": {"quantization": "4bit"}}, "cpu", args, False, True)[0] is False
    assert packs_for_generation({**run, "trainer": "ppo"}, "cpu", args, False, True)[0] is False
