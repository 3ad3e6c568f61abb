"""Generation's prefill once per distinct prompt (snaketrl.train.prefill): the same logits and sampled tokens bit for
bit on a quarter of the rows, transformers' own prefill where rows are distinct, and the plan's rule."""

import pytest

from test_generation import cpu, cuda, grpo_trainer, lora_model, prompts
from test_plan import plan_of


def repeated(inputs, times=4):
    """Each prompt's row `times` times in a row, as TRL's GRPO batch holds num_generations copies of a prompt."""
    return {k: v.repeat_interleave(times, dim=0) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_once_per_prompt_gives_the_same_logits_and_tokens_bit_for_bit(tiny_model_dir, dtype):
    """4 prompts x 4 copies (left-padded to the longest), 24 sampled tokens at temperature 0.7 under seed 0, the
    per-step logits returned: equal to transformers' prefill of all 16 rows, exactly; the model's prefill ran on
    4 rows; with distinct rows (no copies) transformers' prefill runs on all of them; outside, none patched."""
    import torch
    from transformers import set_seed

    from snaketrl.train.prefill import prefill_once_per_prompt

    model, tokenizer = lora_model(tiny_model_dir)
    model.to(getattr(torch, dtype))
    inner = model.get_base_model()
    rows = []
    inner.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape), with_kwargs=True)
    batch = repeated(prompts(tokenizer, n=4))
    assert (batch["attention_mask"] == 0).any()  # left padding in the rows

    def generate(inputs):
        set_seed(0)
        out = model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=True, temperature=0.7,
                             top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    plain_tokens, plain_logits = generate(batch)
    assert rows[0][0] == 16
    rows.clear()
    with prefill_once_per_prompt(model):
        tokens, logits = generate(batch)
        assert rows[0] == (4, batch["input_ids"].shape[1]) and all(r == (16, 1) for r in rows[1:])
        rows.clear()
        distinct = prompts(tokenizer, n=4)
        generate(distinct)
        assert rows[0][0] == 4
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)
    assert tokens.shape == (16, batch["input_ids"].shape[1] + 24)
    assert "_prefill" not in inner.__dict__


def test_a_grpo_trainers_generation_prefills_each_prompt_once_with_trls_completions(tmp_path, tiny_model_dir):
    """dedupe_prefill on a built GRPO trainer (2 generations of each of 4 prompts): TRL's sampled completions under
    the same seed, token for token, its prefill on the 4 distinct prompts."""
    from transformers import set_seed

    from snaketrl.train.prefill import dedupe_prefill

    trainer, _, prompt_ids = grpo_trainer(tmp_path, tiny_model_dir)
    batch = [ids for ids in prompt_ids for _ in range(2)]
    inner = trainer.accelerator.unwrap_model(trainer.model_wrapped).get_base_model()
    rows = []
    inner.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]), with_kwargs=True)

    def generate():
        set_seed(0)
        rows.clear()
        completions, _ = trainer._generate_single_turn(batch, None, {})
        return completions, rows[0]

    plain, plain_rows = generate()
    dedupe_prefill(trainer, "grpo")
    deduped, deduped_rows = generate()
    assert deduped == plain and len(plain) == 8 and (plain_rows, deduped_rows) == (8, 4)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_the_plan_prefills_once_per_prompt_on_a_cpu_for_a_real_models_grpo_and_rloo(tmp_path, config,
                                                                                    tiny_model_dir, trainer):
    from types import SimpleNamespace

    from snaketrl.train.plan import dedupes_prefill

    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, trainer, cpu())
    real = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, trainer, cpu(), run={"model_entry": real})
    assert plan.deduped_prefill is True and plan.report()["deduped_prefill"] is True
    assert any(note.startswith("generation prefills each distinct prompt once: ") for note in plan.notes)
    assert tiny.deduped_prefill is False and "deduped_prefill" not in tiny.report()
    _, gpu = plan_of(tmp_path / "gpu", config, tiny_model_dir, trainer, cuda(), run={"model_entry": real})
    assert gpu.deduped_prefill is False
    run = {"trainer": trainer, "model_entry": {"gguf": {}}}
    args = SimpleNamespace(num_generations=4, use_vllm=False, use_transformers_continuous_batching=False)
    assert dedupes_prefill(run, "cpu", args, False)[0] is True
    assert dedupes_prefill(run, "cpu", args, True)[0] is False  # sharded
    for change in ({"num_generations": 1}, {"use_vllm": True}, {"use_transformers_continuous_batching": True}):
        assert dedupes_prefill(run, "cpu", SimpleNamespace(**{**vars(args), **change}), False)[0] is False
    assert dedupes_prefill({**run, "trainer": "online_dpo"}, "cpu", args, False)[0] is False
