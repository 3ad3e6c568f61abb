"""The next token's draw by the inverse CDF (snaketrl.train.sampling): multinomial's distribution, zero-probability
entries never drawn, torch's own multinomial outside and for other calls, a generation reproducible under a seed
with multinomial's shapes and eos handling, and the plan's rule."""

import dataclasses

import pytest

from test_generation import cpu, cuda, lora_model, prompts
from test_plan import plan_of
from test_trainers import PER_TRAINER, prepare

PROBS = [0.5, 0.0, 0.2, 0.15, 0.1, 0.04, 0.0, 0.01]


def counts(samples, entries):
    import torch

    return torch.bincount(samples.reshape(-1), minlength=entries)


@pytest.mark.parametrize("scale", [1.0, 3.5])  # multinomial takes rows that do not sum to 1
def test_the_draw_follows_the_rows_probabilities(scale):
    """200,000 draws from one row of fixed probabilities: the chi-square test against the probabilities keeps
    them (p 0.95 under seed 0: deterministic), and the entries of probability 0 are never drawn. The same
    test rejects the counts shifted by one entry (p < 1e-100), so it can fail."""
    import torch
    from scipy.stats import chisquare

    from snaketrl.train.sampling import draw

    probs = torch.tensor(PROBS) * scale
    n, nonzero = 200_000, probs > 0
    torch.manual_seed(0)
    samples = draw(probs.expand(n, -1).contiguous())
    assert samples.shape == (n, 1) and samples.dtype == torch.int64
    seen = counts(samples, len(PROBS))
    assert seen[~nonzero].tolist() == [0, 0]
    expected = probs[nonzero].double() / probs.double().sum() * n
    expected = (expected * n / expected.sum()).numpy()  # the float32 probabilities' sum is 1 up to rounding
    assert chisquare(seen[nonzero].double().numpy(), expected).pvalue > 0.01
    shifted = seen[nonzero].roll(1)  # each entry drawn as often as its neighbour should be
    assert chisquare(shifted.double().numpy(), expected).pvalue < 1e-100


def test_a_row_of_one_entry_draws_it_and_rows_are_independent():
    import torch

    from snaketrl.train.sampling import draw

    probs = torch.zeros(3, 49152)
    probs[0, 49151], probs[1, 0], probs[2, 17] = 1.0, 2.0, 1e-30  # a tiny total still draws its one entry
    torch.manual_seed(0)
    assert draw(probs).reshape(-1).tolist() == [49151, 0, 17]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_nan_or_inf_fails_as_multinomial_does(bad):
    import torch

    from snaketrl.train.sampling import draw

    probs = torch.tensor([PROBS, PROBS])
    probs[1, 2] = bad
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        draw(probs)
    with pytest.raises(RuntimeError, match="row sums to 0"):
        draw(torch.zeros(2, 4))


def test_multinomial_is_torchs_own_outside_and_for_other_calls():
    import torch

    from snaketrl.train import sampling

    own = torch.multinomial
    probs = torch.tensor([PROBS, PROBS])
    with sampling.inverse_cdf():
        assert torch.multinomial is not own
        torch.manual_seed(0)
        inside = torch.multinomial(probs, num_samples=1)
        torch.manual_seed(0)
        assert torch.equal(inside, sampling.draw(probs))
        assert torch.multinomial(probs, 3).shape == (2, 3)  # several samples a row: torch's
        assert torch.multinomial(probs[0], 1).shape == (1,)  # one row, 1-D: torch's
    assert torch.multinomial is own


def generate(model, tokenizer, inputs, **kwargs):
    from transformers import set_seed

    set_seed(0)
    return model.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                          pad_token_id=tokenizer.pad_token_id, **kwargs)


def test_a_generation_by_inverse_cdf_is_reproducible_with_multinomials_shapes_and_eos_handling(tiny_model_dir):
    """The tiny model's sampling, 8 prompts x 24 new tokens, eos any of 2,000 token ids (so that rows end early):
    under one seed the same tokens twice; other tokens than multinomial's (the draw ran); every row ends at its first
    eos and is padded after it as multinomial's rows are."""
    import torch

    from snaketrl.train.sampling import inverse_cdf

    model, tokenizer = lora_model(tiny_model_dir)
    inputs = prompts(tokenizer)
    eos = list(range(100, 2100))
    plain = generate(model, tokenizer, inputs, eos_token_id=eos)
    with inverse_cdf():
        drawn = generate(model, tokenizer, inputs, eos_token_id=eos)
        again = generate(model, tokenizer, inputs, eos_token_id=eos)
    assert torch.equal(drawn, again)
    assert drawn.shape[0] == plain.shape[0] == 8 and not torch.equal(drawn[:, :plain.shape[1]], plain)
    width = inputs["input_ids"].shape[1]
    ended = 0
    for out in (plain, drawn):
        for row in out[:, width:].tolist():
            stops = [i for i, t in enumerate(row) if t in eos]
            if stops:
                ended += 1
                assert all(t == tokenizer.pad_token_id for t in row[stops[0] + 1:]), row
    assert ended >= 4  # the eos handling was exercised in both


def test_the_plan_draws_by_inverse_cdf_on_a_cpu_for_a_real_models_online_trainer(tmp_path, config, tiny_model_dir):
    from types import SimpleNamespace

    from snaketrl.train.plan import samples_by_inverse_cdf

    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, "grpo", cpu())
    real = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, "grpo", cpu(), run={"model_entry": real})
    assert plan.inverse_cdf_sampling is True and plan.report()["inverse_cdf_sampling"] is True
    assert any(note.startswith("generation draws its tokens by the inverse CDF: ") for note in plan.notes)
    assert tiny.inverse_cdf_sampling is False and "inverse_cdf_sampling" not in tiny.report()
    _, gpu = plan_of(tmp_path / "gpu", config, tiny_model_dir, "grpo", cuda(), run={"model_entry": real})
    assert gpu.inverse_cdf_sampling is False
    run, args = {"trainer": "rloo", "model_entry": {"gguf": {}}}, SimpleNamespace(use_vllm=False)
    assert samples_by_inverse_cdf(run, "cpu", args)[0] is True
    assert samples_by_inverse_cdf(run, "cpu", SimpleNamespace(use_vllm=True))[0] is False
    assert samples_by_inverse_cdf({**run, "trainer": "ppo"}, "cpu", args)[0] is False


def test_a_grpo_job_draws_every_generated_token_by_inverse_cdf(tmp_path, config, tiny_model_dir, monkeypatch):
    """Two steps through train_run with the plan's inverse-CDF draw forced on (the plan keeps a tiny model on TRL's
    path): every decode step of every generation draws by it (one draw a step: at least one a completion token),
    and the job trains and reports it."""
    import json

    import snaketrl.train.run as run_module
    import snaketrl.train.sampling as sampling
    from snaketrl.train.run import train_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "grpo", args={**PER_TRAINER["grpo"], "max_steps": 2})
    plan_run, draw, drawn = run_module.plan_run, sampling.draw, []
    monkeypatch.setattr(run_module, "plan_run", lambda *a, **k: dataclasses.replace(plan_run(*a, **k),
                                                                                    inverse_cdf_sampling=True))
    monkeypatch.setattr(sampling, "draw", lambda probs: drawn.append(probs.shape[0]) or draw(probs))
    metrics = train_run(**inputs)
    assert metrics["inverse_cdf_sampling"] is True
    state = json.loads((inputs["out_dir"] / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    # each generation's decode steps: at most max_completion_length (8), at least one
    assert drawn and all(rows > 0 for rows in drawn)
    assert len(drawn) <= 8 * 4  # 2 steps of training + 2 of evaluation, one generation each at most 8 steps
