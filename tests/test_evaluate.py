"""Evaluation: each metric on a case checked by hand or against a direct computation with the model's logits."""

import json
import math
import re
import shutil
import sqlite3
import subprocess
import sys

import pytest

from conftest import ROOT
from snaketrl.config.evaluation import check_evaluation, eval_targets
from snaketrl.errors import ConfigError, DataError
from snaketrl.evaluate.generation import generate
from snaketrl.evaluate.harness import _lm_eval_available, lm_eval_run, lm_eval_task_manager
from snaketrl.evaluate.job import evaluate
from snaketrl.evaluate.likelihood import (completion_nll, encode_pairs, kl_to_reference, padded_batches,
                                          preference_accuracy, token_logprobs)
from snaketrl.evaluate.loading import load_for_eval
from snaketrl.evaluate.scoring import (distinct_n, judge_texts, mean_std, reward_function_scores, reward_model_scores,
                                       win_rate)
from snaketrl.evaluate.storage import COMPLETION_COLUMNS, collect
from snaketrl.io import read_jsonl, write_jsonl

SETTINGS = {
    "prompts": {"dataset": "tldr", "size": 6},
    "references": {"dataset": "tldr", "size": 6},
    "pairs": {"dataset": "descriptiveness", "size": 6},
    "generation": {"max_new_tokens": 8, "batch_size": 4},
    "reward_funcs": ["unique_chars", "format"],
}


def _runs():
    """Resolved runs as snaketrl.config.resolve_runs returns them (only the keys evaluation reads)."""
    def run(trainer, model, policy=None):
        return {"trainer": trainer, "model": model, "policy": policy, "seed": 42}

    return {"sft-qwen2-tiny": run("sft", "qwen2-tiny"), "dpo-qwen2-tiny": run("dpo", "qwen2-tiny"),
            "reward-qwen2-tiny": run("reward", "qwen2-tiny"), "reward-pythia-tiny": run("reward", "pythia-tiny"),
            "ppo-qwen2-tiny": run("ppo", "qwen2-tiny", policy="sft-qwen2-tiny")}


@pytest.fixture(scope="module")
def datasets():
    import yaml

    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["datasets"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    """Two LoRA 'runs' of the tiny model whose effect is known: `identity` (B = 0, peft's default init:
    the run is its base) and `random` (both LoRA matrices random: a different model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name, init in (("identity", True), ("random", False)):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                               LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                          init_lora_weights=init, task_type="CAUSAL_LM"))
        path = tmp_path_factory.mktemp("adapters") / name
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def pythia_dir(tmp_path_factory):
    """A tiny model of another family (GPT-NeoX) with its own tokenizer."""
    import yaml

    from snaketrl.models.tiny import build_tiny_from_files

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    out = tmp_path_factory.mktemp("pythia") / "lm"
    build_tiny_from_files(cfg["models"]["pythia-tiny"]["tiny"], [ROOT / "data/samples/tldr.jsonl"], out, seed=1)
    return out


@pytest.fixture(scope="module")
def judge_dir(pythia_dir):
    """A 'merged reward model' of another family: a one-label sequence classifier with a random head, as a
    trained reward run's merged/ directory looks."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(pythia_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(pythia_dir)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(pythia_dir.parent / "merged")
    tok.save_pretrained(pythia_dir.parent / "merged")
    return pythia_dir.parent / "merged"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir, adapters):
    return load_for_eval(tiny_model_dir, adapters["random"], threads=1)


def _direct_logp(model, tokenizer, prompt: str, completion: str) -> tuple[float, int]:
    """Sum of log p(completion tokens) by hand: one unpadded forward, cross-entropy on completion positions."""
    import torch
    import torch.nn.functional as F

    p_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
    assert ids[:len(p_ids)] == p_ids
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float()
    nll = F.cross_entropy(logits[len(p_ids) - 1:-1], x[0, len(p_ids):], reduction="sum")
    return -float(nll), len(ids) - len(p_ids)


# --- Aggregates on hand-checked values ---------------------------------------------------------

def test_win_rate_counts_ties_half_and_skips_missing():
    assert win_rate([1, 2, 3, float("nan")], [1, 1, 4, 0]) == pytest.approx((0.5 + 1 + 0) / 3)
    assert win_rate([2, 2], [2, 2]) == 0.5
    assert win_rate([None], [1]) is None


def test_distinct_2_on_fixed_strings():
    # bigrams: (a b) (b a) (a b) | (a b) (b c): 5 in all, 3 distinct; one-word texts have none.
    assert distinct_n(["a b a b", "a b c", "x"], 2) == pytest.approx(3 / 5)
    assert distinct_n(["one", ""], 2) is None


def test_mean_std():
    assert mean_std([1, 3, float("nan")]) == {"mean": 2, "std": 1}
    assert mean_std([]) == {"mean": None, "std": None}


def test_reward_functions_score_as_trl_calls_them():
    scores = reward_function_scores(
        ["unique_chars", "format", {"function": "keyword", "kwargs": {"words": ["cat", "dog"]}}, "accuracy"],
        ["p1", "p2"], ["abcabc.", "a cat #### 4"], {"answer": ["#### 4", "x #### 4"]})
    assert scores == {"fn_unique_chars": [4.0, 6.0], "fn_format": [1.0, 0.0], "fn_keyword": [0.0, 0.5],
                      "fn_accuracy": [0.0, 1.0]}
    # Conversational prompts: completions reach the function as assistant messages.
    seen = {}

    def spy(completions, **kw):
        seen["c"] = completions
        return [1.0] * len(completions)

    import snaketrl.rewards as R

    R.BUILTINS["_spy"] = spy
    try:
        reward_function_scores(["_spy"], [[{"role": "user", "content": "hi"}]], ["yo"])
    finally:
        del R.BUILTINS["_spy"]
    assert seen["c"] == [[{"role": "assistant", "content": "yo"}]]


# --- Generation ------------------------------------------------------------------------------------

def test_generate_is_greedy_batched_and_left_padded(loaded):
    prompts = [r["prompt"] for r in read_jsonl(ROOT / "data/samples/tldr.jsonl")[:5]]
    one = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=8, batch_size=1)
    many = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=8, batch_size=4)
    assert many.texts == one.texts and many.token_ids == one.token_ids  # padding changes nothing
    assert all(1 <= n <= 8 for n in many.n_tokens) and many.n_tokens == [len(t) for t in many.token_ids]
    assert loaded.tokenizer.padding_side == "left"


def test_generate_uses_the_chat_template_for_conversations(loaded):
    tok = loaded.tokenizer
    conv = [[{"role": "user", "content": "Tell me about penguins."}]]
    got = generate(loaded.model, tok, conv, max_new_tokens=4)
    assert tok.decode(got.prompt_ids[0]).endswith("<|im_start|>assistant\n")


# --- Likelihood ------------------------------------------------------------------------------------

def test_nll_matches_cross_entropy_by_hand(loaded):
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:4]
    got = completion_nll(loaded.model, loaded.tokenizer, [r["prompt"] for r in rows],
                           [r["completion"] for r in rows], batch_size=3)
    direct = [_direct_logp(loaded.model, loaded.tokenizer, r["prompt"], r["completion"]) for r in rows]
    n = sum(k for _, k in direct)
    assert got["n_tokens"] == n and got["n_references"] == 4
    assert got["nll"] == pytest.approx(-sum(lp for lp, _ in direct) / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]))


def test_logprobs_come_back_per_pair_in_order_from_length_sorted_batches(loaded):
    """Batches are cut from the pairs sorted by length: each pair's values still come back in its own place."""
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:7]
    # Lengths out of order, a short pair after long ones, so that sorting moves pairs between batches.
    rows = [rows[i] for i in (3, 0, 6, 1, 5, 2, 4)]
    rows[2] = {"prompt": "Hi.", "completion": "Hello."}
    pairs = encode_pairs(loaded.tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert sorted(range(7), key=lambda i: sum(map(len, pairs[i]))) != list(range(7))
    got = token_logprobs(loaded.model, pairs, pad_token_id=loaded.tokenizer.pad_token_id, batch_size=3)
    direct = [_direct_logp(loaded.model, loaded.tokenizer, r["prompt"], r["completion"]) for r in rows]
    assert [len(x) for x in got] == [n for _, n in direct]
    assert [float(x.sum()) for x in got] == pytest.approx([lp for lp, _ in direct], rel=1e-5)


def test_batches_end_where_the_next_row_would_make_them_more_than_a_tenth_padding():
    # sorted: 9 10 11 | 12 (the batch of 3 is full) | 50 55 (100 would pad them to 300 for 205 real) | 100
    assert padded_batches([10, 100, 11, 12, 50, 9, 55], 3, 0.1) == [[5, 0, 2], [3], [4, 6], [1]]
    assert padded_batches([7] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert padded_batches([], 4) == []


def test_a_merged_adapter_scores_as_peft_does_and_its_reference_is_the_base(tiny_model_dir, adapters):
    """On a CPU the run's passes take the adapter merged into the weights; the reference unmerges and disables it
    (the plain base's numbers) and merges it back."""
    run = load_for_eval(tiny_model_dir, adapters["random"])
    assert run.merged
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:5]
    pairs = encode_pairs(run.tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])

    def sums(model):
        lps = token_logprobs(model, pairs, pad_token_id=run.tokenizer.pad_token_id, batch_size=2)
        return [float(x.sum()) for x in lps]

    merged = sums(run.model)
    with run.reference():
        reference = sums(run.model)
    assert sums(run.model) == pytest.approx(merged, rel=1e-6)  # merged again
    assert sums(load_for_eval(tiny_model_dir).model) == pytest.approx(reference, rel=1e-5)
    run.model.unmerge_adapter()
    assert sums(run.model) == pytest.approx(merged, rel=1e-5)  # peft's LoRA layers, unmerged
    assert merged != pytest.approx(reference, rel=1e-3)


def test_nll_by_hand_for_another_family(pythia_dir):
    plain = load_for_eval(pythia_dir, threads=1)
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[4:7]
    got = completion_nll(plain.model, plain.tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    direct = [_direct_logp(plain.model, plain.tokenizer, r["prompt"], r["completion"]) for r in rows]
    assert got["nll"] == pytest.approx(-sum(lp for lp, _ in direct) / sum(k for _, k in direct), rel=1e-5)


def test_preference_accuracy_is_dpo_implicit_reward_by_hand(loaded):
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:8]
    p, c, r = ([row[k] for row in rows] for k in ("prompt", "chosen", "rejected"))
    got, per_pair = preference_accuracy(loaded, p, c, r, batch_size=3)
    run = [(_direct_logp(loaded.model, loaded.tokenizer, *x)[0]) for x in zip(p, c)], \
          [(_direct_logp(loaded.model, loaded.tokenizer, *x)[0]) for x in zip(p, r)]
    with loaded.reference():
        base = [(_direct_logp(loaded.model, loaded.tokenizer, *x)[0]) for x in zip(p, c)], \
               [(_direct_logp(loaded.model, loaded.tokenizer, *x)[0]) for x in zip(p, r)]
    wins = [(rc - bc) > (rr - br) for rc, rr, bc, br in zip(*run, *base)]
    assert got["accuracy"] == pytest.approx(sum(wins) / 8)
    assert got["logp_accuracy"] == pytest.approx(sum(a > b for a, b in zip(*run)) / 8)
    assert got["margin"] == pytest.approx(sum((a - b) - (x - y) for a, x, b, y in zip(*run, *base)) / 8, abs=1e-3)
    assert got["n_pairs"] == 8
    assert [row["logp_chosen"] for row in per_pair] == pytest.approx(run[0], rel=1e-5)
    assert [row["reference_logp_rejected"] for row in per_pair] == pytest.approx(base[1], rel=1e-5)
    # the base's, as its own eval job computed them: the same numbers without the reference passes
    reference = ([row["reference_logp_chosen"] for row in per_pair],
                 [row["reference_logp_rejected"] for row in per_pair])
    cached, cached_pairs = preference_accuracy(loaded, p, c, r, batch_size=3, reference_logps=reference)
    assert (cached, cached_pairs) == (got, per_pair)


def test_identity_adapter_has_no_preference_and_no_kl(tiny_model_dir, adapters):
    same = load_for_eval(tiny_model_dir, adapters["identity"])
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:6]
    got, _ = preference_accuracy(same, *([row[k] for row in rows] for k in ("prompt", "chosen", "rejected")))
    assert got["accuracy"] == 0.0 and got["margin"] == pytest.approx(0, abs=1e-6)  # all ties: no wins, as DPO
    gen = generate(same.model, same.tokenizer, [r["prompt"] for r in rows], max_new_tokens=6)
    assert kl_to_reference(same, gen) == pytest.approx([0.0] * 6, abs=1e-5)


def test_base_model_has_plain_accuracy_only(tiny_model_dir):
    base = load_for_eval(tiny_model_dir)
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:4]
    got, per_pair = preference_accuracy(base, *([row[k] for row in rows] for k in ("prompt", "chosen", "rejected")))
    assert got["accuracy"] is None and got["margin"] is None and 0 <= got["logp_accuracy"] <= 1
    assert len(per_pair) == 4 and set(per_pair[0]) == {"logp_chosen", "logp_rejected"}
    assert kl_to_reference(base, generate(base.model, base.tokenizer, ["Hi"], max_new_tokens=2)) is None


def test_kl_is_the_log_ratio_of_the_generated_tokens(loaded, monkeypatch):
    import torch

    from snaketrl.evaluate import generation

    prompts = ["She walked into the room and saw a", "Hi"]
    gen = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=6, logprobs=True)
    kl = kl_to_reference(loaded, gen, batch_size=2)
    # logits too many to keep: the run's log-probabilities come from a forward pass, to the same estimate
    monkeypatch.setattr(generation, "LOGITS_BYTES", 0)
    again = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=6, logprobs=True)
    assert again.logprobs is None and again.token_ids == gen.token_ids
    assert kl_to_reference(loaded, again, batch_size=2) == pytest.approx(kl, abs=1e-4)

    def logp(ids, n_prompt):
        x = torch.tensor([ids], device=loaded.model.device)
        with torch.no_grad():
            lp = loaded.model(input_ids=x).logits[0].float().log_softmax(-1)
        return sum(float(lp[i - 1, ids[i]]) for i in range(n_prompt, len(ids)))

    for k, p, c, lp in zip(kl, gen.prompt_ids, gen.token_ids, gen.logprobs):
        run = logp(p + c, len(p))
        with loaded.reference():
            base = logp(p + c, len(p))
        assert k == pytest.approx(run - base, abs=1e-4)
        assert len(lp) == len(c) and float(lp.sum()) == pytest.approx(run, abs=1e-4)  # the run's, from generation


# --- Judges ----------------------------------------------------------------------------------------

def test_reward_model_of_another_family_scores_text(judge_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts, completions = ["Hello there", "A much longer prompt than the other one"], [" friend.", " ok"]
    got = reward_model_scores(judge_dir, prompts, completions, batch_size=2)  # right-padded batch
    tok = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForSequenceClassification.from_pretrained(judge_dir).eval()
    for score, p, c in zip(got, prompts, completions):
        with torch.no_grad():
            alone = model(**tok(p + c + tok.eos_token, return_tensors="pt")).logits[0, 0].item()
        assert score == pytest.approx(alone, abs=1e-4)


def test_judge_renders_conversations_with_its_own_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts, special = judge_texts(tok, [[{"role": "user", "content": "hi"}]], ["yo"])
    assert texts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"] and not special


# --- The job and the database ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def eval_jobs(tmp_path_factory, tiny_model_dir, adapters, judge_dir, datasets):
    """A base job, then a run job that reads the base's completions (win rates), as the workflow runs them."""
    from snaketrl.data.preprocess import preprocess

    tmp = tmp_path_factory.mktemp("eval")
    for kind, dataset, trainer, layout in (("prompts", "tldr", "grpo", "prompt"),
                                           ("references", "tldr", "sft", "language_modeling"),
                                           ("pairs", "descriptiveness", "dpo", "preference")):
        rows = preprocess(read_jsonl(ROOT / f"data/samples/{dataset}.jsonl")[:12], dataset=dataset, trainer=trainer,
                          layout=layout, columns={}, split="eval").rows
        write_jsonl(rows, tmp / f"{kind}.jsonl")
    settings = check_evaluation(SETTINGS, _runs(), datasets)
    files = {k: tmp / f"{k}.jsonl" for k in ("prompts", "references", "pairs")}
    common = dict(settings=settings, model_dir=tiny_model_dir, reward_models={"reward-pythia-tiny": judge_dir},
                  prompts_file=files["prompts"], references_file=files["references"], pairs_file=files["pairs"],
                  threads=1)
    targets = {"base-qwen2-tiny": {"kind": "base", "run": None, "model": "qwen2-tiny", "trainer": "base",
                                   "seed": 42, "reference": None},
               "sft-qwen2-tiny": {"kind": "run", "run": "sft-qwen2-tiny", "model": "qwen2-tiny", "trainer": "sft",
                                  "seed": 42, "reference": "base-qwen2-tiny"}}
    base = evaluate(target=targets["base-qwen2-tiny"], out_completions=tmp / "base/completions.jsonl",
                    out_metrics=tmp / "base/metrics.json", out_pairs=tmp / "base/pairs.jsonl", **common)
    run = evaluate(target=targets["sft-qwen2-tiny"], adapter_dir=adapters["random"],
                   reference_completions=tmp / "base/completions.jsonl", reference_pairs=tmp / "base/pairs.jsonl",
                   out_completions=tmp / "run/completions.jsonl", out_metrics=tmp / "run/metrics.json",
                   out_pairs=tmp / "run/pairs.jsonl", **common)
    return tmp, base, run


def test_eval_job_writes_rows_and_metrics(eval_jobs):
    tmp, base, run = eval_jobs
    rows = read_jsonl(tmp / "run/completions.jsonl")
    assert len(rows) == 6 and [r["prompt_id"] for r in rows] == list(range(6))
    assert {"run", "model", "trainer", "seed", "prompt", "completion", "n_tokens", "fn_unique_chars", "fn_format",
            "rm_reward_pythia_tiny", "kl_k1"} <= set(rows[0])
    assert rows[0]["run"] == "sft-qwen2-tiny" and rows[0]["reference"] == "base-qwen2-tiny"
    assert json.loads((tmp / "run/metrics.json").read_text()) == json.loads(json.dumps(run))
    # Win rates against the base's completions of the same prompts, recomputed from the two files.
    base_rows = read_jsonl(tmp / "base/completions.jsonl")
    for score in ("fn_unique_chars", "rm_reward_pythia_tiny"):
        assert run["scores"][score]["win_rate"] == win_rate([r[score] for r in rows], [r[score] for r in base_rows])
        assert base["scores"][score]["win_rate"] is None
    assert base["pairs"]["accuracy"] is None and run["pairs"]["accuracy"] is not None
    assert base["kl_k1"] is None and run["kl_k1"] == pytest.approx(sum(r["kl_k1"] for r in rows) / 6)
    assert run["mean_length"] == sum(r["n_tokens"] for r in rows) / 6
    assert run["references"]["n_references"] == 6 and run["references"]["nll"] > 0


def test_a_run_reads_its_base_pair_logps_from_the_base_job(eval_jobs, adapters, tiny_model_dir, datasets):
    """The run job took its base's pair log-probabilities from the base job's pairs.jsonl: the same accuracy and
    margin as a job that computes them with its adapter disabled; pairs of another job are refused, by file."""
    from snaketrl.errors import DataError

    tmp, base, run = eval_jobs
    base_pairs, run_pairs = read_jsonl(tmp / "base/pairs.jsonl"), read_jsonl(tmp / "run/pairs.jsonl")
    assert len(base_pairs) == len(run_pairs) == run["pairs"]["n_pairs"] == 6
    assert [r["reference_logp_chosen"] for r in run_pairs] == [r["logp_chosen"] for r in base_pairs]
    assert {"run", "pair_id", "pair_key", "logp_chosen", "logp_rejected"} <= set(base_pairs[0])
    settings = check_evaluation({**SETTINGS, "prompts": None, "references": None, "reward_funcs": []}, _runs(),
                                datasets)
    target = {"kind": "run", "run": "sft-qwen2-tiny", "model": "qwen2-tiny", "trainer": "sft", "seed": 42,
              "reference": "base-qwen2-tiny"}
    common = dict(target=target, settings=settings, model_dir=tiny_model_dir, adapter_dir=adapters["random"],
                  pairs_file=tmp / "pairs.jsonl", threads=1)
    computed = evaluate(**common, out_completions=tmp / "own/c.jsonl", out_metrics=tmp / "own/m.json")
    assert computed["pairs"]["accuracy"] == run["pairs"]["accuracy"]
    assert computed["pairs"]["margin"] == pytest.approx(run["pairs"]["margin"], abs=1e-6)
    other = tmp / "other_pairs.jsonl"
    write_jsonl(base_pairs[1:] + base_pairs[:1], other)
    with pytest.raises(DataError, match=rf"^evaluate sft-qwen2-tiny: the reference's pairs \({other}\) are other "
                                        r"pairs; rerun its eval job with the same evaluation.pairs$"):
        evaluate(**common, reference_pairs=other, out_completions=tmp / "x/c.jsonl", out_metrics=tmp / "x/m.json")
    assert not (tmp / "x").exists()


def test_a_run_from_a_merged_policy_reads_the_policy_jobs_pair_logps(eval_jobs, adapters, tiny_model_dir, datasets,
                                                                      caplog):
    """A run started from another run's merged policy (GRPO from SFT) takes its reference's pair log-probabilities
    from that run's eval job, which scored them with the same base and adapter (merged in memory, as the merge rule
    merges on disk): the same accuracy as computing them. The base's pairs are refused for it, naming both scorers;
    pairs computed in another dtype are computed again."""
    import logging

    from snaketrl.errors import DataError
    from snaketrl.models.merge import merge

    tmp, _, _ = eval_jobs
    merge(adapters["random"], tiny_model_dir, tmp / "merged", threads=1)
    assert json.loads((tmp / "merged/merged_from.json").read_text()) == {
        "model_dir": str(tiny_model_dir), "adapter_dir": str(adapters["random"])}
    settings = check_evaluation({**SETTINGS, "prompts": None, "references": None, "reward_funcs": []}, _runs(),
                                datasets)
    target = {"kind": "run", "run": "grpo-qwen2-tiny", "model": "qwen2-tiny", "trainer": "grpo", "seed": 42,
              "reference": "base-qwen2-tiny"}
    common = dict(target=target, settings=settings, model_dir=tmp / "merged", adapter_dir=adapters["random"],
                  pairs_file=tmp / "pairs.jsonl", threads=1)
    policy_pairs = read_jsonl(tmp / "run/pairs.jsonl")
    assert {(r["model_dir"], r["adapter_dir"], r["dtype"]) for r in policy_pairs} == {
        (str(tiny_model_dir), str(adapters["random"]), "torch.float32")}
    computed = evaluate(**common, out_completions=tmp / "g1/c.jsonl", out_metrics=tmp / "g1/m.json",
                        out_pairs=tmp / "g1/p.jsonl")
    with caplog.at_level(logging.INFO, logger="snaketrl.evaluate"):
        read = evaluate(**common, reference_pairs=tmp / "run/pairs.jsonl", out_completions=tmp / "g2/c.jsonl",
                        out_metrics=tmp / "g2/m.json", out_pairs=tmp / "g2/p.jsonl")
    assert "the reference's pair log-probabilities from its eval job" in caplog.text
    assert [r["reference_logp_chosen"] for r in read_jsonl(tmp / "g2/p.jsonl")] == [
        r["logp_chosen"] for r in policy_pairs]
    assert [r["reference_logp_chosen"] for r in read_jsonl(tmp / "g1/p.jsonl")] == pytest.approx(
        [r["logp_chosen"] for r in policy_pairs], abs=1e-4)
    assert read["pairs"]["accuracy"] == computed["pairs"]["accuracy"]
    assert read["pairs"]["margin"] == pytest.approx(computed["pairs"]["margin"], abs=1e-4)
    base = {"model_dir": str(tiny_model_dir), "adapter_dir": None}
    with pytest.raises(DataError, match=re.escape(
            f"evaluate grpo-qwen2-tiny: the reference's pairs ({tmp / 'base/pairs.jsonl'}) were scored by {base}, "
            f"not by this run's base {{'model_dir': '{tiny_model_dir}', 'adapter_dir': '{adapters['random']}'}}")):
        evaluate(**common, reference_pairs=tmp / "base/pairs.jsonl", out_completions=tmp / "x/c.jsonl",
                 out_metrics=tmp / "x/m.json")
    assert not (tmp / "x").exists()
    write_jsonl([{**r, "dtype": "torch.bfloat16"} for r in policy_pairs], tmp / "bf16_pairs.jsonl")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="snaketrl.evaluate"):
        again = evaluate(**common, reference_pairs=tmp / "bf16_pairs.jsonl", out_completions=tmp / "g3/c.jsonl",
                         out_metrics=tmp / "g3/m.json")
    assert "were computed in torch.bfloat16; this job computes them in torch.float32" in caplog.text
    assert again["pairs"] == computed["pairs"]
    shutil.copytree(tmp / "merged", tmp / "unrecorded")  # merged before merges recorded their source
    (tmp / "unrecorded/merged_from.json").unlink()
    older = evaluate(**{**common, "model_dir": tmp / "unrecorded"}, reference_pairs=tmp / "run/pairs.jsonl",
                     out_completions=tmp / "g4/c.jsonl", out_metrics=tmp / "g4/m.json")
    assert older["pairs"] == computed["pairs"]


def test_collect_builds_one_database(eval_jobs, tmp_path):
    tmp, _, _ = eval_jobs
    samples = tmp_path / "samples.jsonl"
    write_jsonl([{"run": "grpo-x", "step": 0, "prompt": "p", "completion": "c", "reward": 1.5, "mode": "train"}],
                samples)
    counts = collect([tmp / "base/completions.jsonl", tmp / "run/completions.jsonl"], tmp_path / "eval.sqlite",
                       samples_files=[samples], groups={"sft-qwen2-tiny": "sft"})
    assert counts == {"completions": 12, "metrics": 2, "training_samples": 1, "run_groups": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.sqlite", "samples.jsonl"]  # no temporary left
    db = sqlite3.connect(tmp_path / "eval.sqlite")
    assert db.execute("SELECT run, COUNT(*) FROM completions GROUP BY run ORDER BY run").fetchall() == [
        ("base-qwen2-tiny", 6), ("sft-qwen2-tiny", 6)]
    cols = [r[1] for r in db.execute("PRAGMA table_info(completions)")]
    assert cols[:8] == COMPLETION_COLUMNS and "rm_reward_pythia_tiny" in cols
    assert db.execute("SELECT COUNT(*) FROM completions WHERE kl_k1 IS NULL").fetchone() == (6,)  # the base's
    (acc, win), = db.execute("SELECT pairs_accuracy, scores_fn_unique_chars_win_rate FROM metrics "
                             "WHERE run = 'sft-qwen2-tiny'").fetchall()
    assert acc is not None and 0 <= win <= 1
    assert db.execute("SELECT run, step, reward FROM training_samples").fetchall() == [("grpo-x", 0, 1.5)]
    # The leaderboard's rows: a job named in groups folds into its group, the base is its own.
    assert db.execute("SELECT run, run_group FROM run_groups ORDER BY run").fetchall() == [
        ("base-qwen2-tiny", "base-qwen2-tiny"), ("sft-qwen2-tiny", "sft")]


def test_a_diverged_run_is_refused_before_anything_is_written(eval_jobs, tiny_model_dir, datasets, tmp_path):
    """An adapter whose weights went NaN, as a run that diverged before training stopped on it left them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketrl.divergence import Diverged

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "adapter")
    tmp = eval_jobs[0]
    target = {"kind": "run", "run": "sft-qwen2-tiny", "model": "qwen2-tiny", "trainer": "sft", "seed": 42,
              "reference": None}
    with pytest.raises(Diverged, match=r"^evaluation of run 'sft-qwen2-tiny': nll is nan; its model diverged in "
                                       r"training: train it again \(try a lower learning_rate, max_grad_norm > 0, "
                                       r"or bf16 off\)$"):
        evaluate(target=target, settings=check_evaluation(SETTINGS, _runs(), datasets), model_dir=tiny_model_dir,
                 adapter_dir=tmp_path / "adapter", references_file=tmp / "references.jsonl",
                 pairs_file=tmp / "pairs.jsonl", out_completions=tmp_path / "out/completions.jsonl",
                 out_metrics=tmp_path / "out/metrics.json", threads=1)
    assert not (tmp_path / "out").exists()


# --- Bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("section, message", [
    ({"references": {"dataset": "descriptiveness"}},
     "config: evaluation.references: dataset 'descriptiveness' has no column 'completion' (held-out NLL needs "
     "prompt, completion); its columns are ['prompt', 'chosen', 'rejected'] (map names with "
     "datasets.descriptiveness.columns)"),
    ({"pairs": {"dataset": "tldr"}},
     "config: evaluation.pairs: dataset 'tldr' has no column 'chosen' (preference accuracy needs prompt, chosen, "
     "rejected); its columns are ['prompt', 'completion'] (map names with datasets.tldr.columns)"),
    ({"prompts": {"dataset": "ultrafeedback"}},
     "config: evaluation.prompts: dataset 'ultrafeedback' has no column 'prompt' (generation needs prompt); its "
     "columns are ['chosen', 'rejected', 'score_chosen', 'score_rejected'] (map names with "
     "datasets.ultrafeedback.columns)"),
    ({"prompts": "nope"}, "config: evaluation.prompts.dataset: unknown dataset 'nope'; expected one of "
                          "['arithmetic', 'descriptiveness', 'firefly', 'tldr', 'ultrafeedback']"),
    ({"prompts": "tldr", "reward_models": ["reward-qwen2"]},
     "config: evaluation.reward_models: 'reward-qwen2' is not a run (did you mean 'reward-qwen2-tiny'?); reward "
     "model runs are ['reward-pythia-tiny', 'reward-qwen2-tiny']"),
    ({"prompts": "tldr", "reward_models": ["sft-qwen2-tiny"]},
     "config: evaluation.reward_models: run 'sft-qwen2-tiny' trains 'sft', not a reward model; reward model runs "
     "are ['reward-pythia-tiny', 'reward-qwen2-tiny']"),
    ({"prompts": "tldr", "runs": ["reward-qwen2-tiny"]},
     "config: evaluation.runs: run 'reward-qwen2-tiny' trains a reward model (reward), which generates nothing; "
     "list it under evaluation.reward_models to judge with it"),
    ({"prompts": "tldr", "reward_funcs": ["nope"]},
     "config: evaluation.reward_funcs: unknown reward function 'nope'; expected one of ['accuracy', 'format', "
     "'keyword', 'prompt_overlap', 'rouge', 'unique_chars'] or 'package.module:function'"),
    ({"lm_eval": {"tasks": ["snaketrl_arithmetc"]}},
     None),  # message depends on whether lm-eval is installed: checked below
    ({"reward_funcs": ["format"]},
     "config: evaluation: reward_funcs/reward_models score generated completions; set evaluation.prompts.dataset"),
    ({"prompts": "tldr", "bogus": 1}, "config: evaluation.bogus: unknown key; expected one of ['batch_size', "
                                      "'generation', 'lm_eval', 'pairs', 'prompts', 'references', 'reward_funcs', "
                                      "'reward_models', 'runs']"),
])
def test_bad_evaluation_config_is_one_line(section, message, datasets):
    with pytest.raises(ConfigError) as err:
        check_evaluation(section, _runs(), datasets)
    if message is None:
        assert str(err.value).startswith("config: evaluation.lm_eval.tasks: ")
        assert "snaketrl_arithmetc" in str(err.value)
        if _lm_eval_available():
            assert "unknown lm-eval task 'snaketrl_arithmetc' (did you mean 'snaketrl_arithmetic'?)" in str(err.value)
    else:
        assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_mapped_columns_satisfy_the_check(datasets):
    got = check_evaluation({"prompts": "arithmetic", "references": "firefly", "pairs": "ultrafeedback",
                            "lm_eval": {"tasks": ["snaketrl_arithmetic"]}}, _runs(), datasets)
    assert got["prompts"] == {"dataset": "arithmetic", "split": "eval", "size": None, "trainer": "grpo"}
    assert (got["references"]["trainer"], got["pairs"]["trainer"]) == ("sft", "dpo")
    assert got["runs"] == ["dpo-qwen2-tiny", "ppo-qwen2-tiny", "sft-qwen2-tiny"]


def test_eval_rows_are_checked_before_any_model_loads(tmp_path, datasets):
    write_jsonl([{"question": "q"}], tmp_path / "prompts.jsonl")
    settings = check_evaluation({"prompts": "tldr"}, _runs(), datasets)
    with pytest.raises(DataError, match=r"^evaluate sft-x: .*prompts.jsonl: no column 'prompt' \(generation needs "
                                        r"prompt\); columns are \['question'\]$"):
        evaluate(target={"run": "sft-x", "model": "m", "trainer": "sft"}, settings=settings,
                   model_dir=tmp_path / "no-model", prompts_file=tmp_path / "prompts.jsonl",
                   out_completions=tmp_path / "c.jsonl", out_metrics=tmp_path / "m.json")


def test_an_eval_size_beyond_its_split_is_refused_before_any_model_loads(tmp_path, datasets):
    # 3 held-out rows for a size of 5: comparing on 3 would pass for the configured 5.
    write_jsonl([{"prompt": f"p{i}"} for i in range(3)], tmp_path / "prompts.jsonl")
    settings = check_evaluation({"prompts": {"dataset": "tldr", "size": 5}}, _runs(), datasets)
    with pytest.raises(DataError) as err:
        evaluate(target={"run": "sft-x", "model": "m", "trainer": "sft"}, settings=settings,
                   model_dir=tmp_path / "no-model", prompts_file=tmp_path / "prompts.jsonl",
                   out_completions=tmp_path / "c.jsonl", out_metrics=tmp_path / "m.json")
    assert str(err.value) == (f"evaluate sft-x: evaluation.prompts.size is 5, but the eval split of dataset 'tldr' "
                              f"({tmp_path / 'prompts.jsonl'}) holds 3 rows; set evaluation.prompts.size to at most "
                              f"3, or hold out more rows (datasets.tldr.eval_size, or a longer eval file)")
    assert not (tmp_path / "c.jsonl").exists()


def test_eval_targets_add_base_jobs_and_references(datasets):
    ev = check_evaluation({"prompts": "tldr", "runs": ["ppo-qwen2-tiny", "dpo-qwen2-tiny"]}, _runs(), datasets)
    targets = eval_targets(ev, _runs())
    assert sorted(targets) == ["base-qwen2-tiny", "dpo-qwen2-tiny", "ppo-qwen2-tiny"]
    # One yardstick: win rates against the untrained base, also for a run started from SFT's merged model.
    assert targets["ppo-qwen2-tiny"]["reference"] == "base-qwen2-tiny"
    assert targets["dpo-qwen2-tiny"]["reference"] == "base-qwen2-tiny"
    assert targets["base-qwen2-tiny"] == {"kind": "base", "run": None, "model": "qwen2-tiny", "trainer": "base",
                                          "seed": 42, "reference": None}


def test_parse_time_checks_import_no_torch():
    code = ("import sys, yaml; from snaketrl.config.evaluation import check_evaluation; import snaketrl.evaluate.job; "
            "ds = yaml.safe_load(open('config/config.yaml'))['datasets']; "
            "check_evaluation({'prompts': 'tldr', 'lm_eval': {'tasks': ['snaketrl_arithmetic']}}, "
            "{'a': {'trainer': 'sft', 'model': 'm', 'policy': None, 'seed': 1}}, ds); "
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'lm_eval') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- lm-evaluation-harness ---------------------------------------------------------------------------

def test_lm_eval_runs_the_project_task_offline(loaded, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = lm_eval_run(loaded.model, loaded.tokenizer, ["snaketrl_arithmetic"], limit=4, batch_size=4)
    assert set(got) == {"snaketrl_arithmetic"}
    assert got["snaketrl_arithmetic"]["exact_match,final-number"] == 0.0  # a random tiny model
    assert got["snaketrl_arithmetic"]["sample_len"] == 4


@pytest.mark.parametrize("num_fewshot,chat", [(None, False), (2, False), (2, True)])
def test_lm_eval_run_asks_what_simple_evaluate_asks_and_starts_no_process(loaded, monkeypatch, num_fewshot, chat):
    """lm_eval_run is lm-eval's simple_evaluate without its environment report (`pip list`, `git` and more, 1.7 s
    of every eval job): the same requests and the same answers, and no command started; with a chat model, the
    shots and the question as turns in its template."""
    context = assert_lm_eval_run_is_simple_evaluate(loaded.model, loaded.tokenizer, num_fewshot, chat, monkeypatch)
    assert context.count("<|im_start|>user") == (1 + num_fewshot if chat else 0)  # one turn per shot, multiturn


def assert_lm_eval_run_is_simple_evaluate(model, tokenizer, num_fewshot, chat, monkeypatch, limit=6) -> str:
    """lm_eval_run's requests, answers and metrics are simple_evaluate's, and it starts no process; returns the
    first request's context (the tiny models here, SmolLM2 in tests/test_real.py)."""
    lm_eval = pytest.importorskip("lm_eval")
    import subprocess

    from lm_eval.models.huggingface import HFLM

    from snaketrl.evaluate.loading import max_positions

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    manager = lm_eval_task_manager(["snaketrl_arithmetic"])
    ours, evaluate = [], lm_eval.evaluate

    def logged(**kwargs):
        ours.append(evaluate(**{**kwargs, "log_samples": True}))
        return ours[-1]

    def no_process(*args, **kwargs):
        raise AssertionError(f"started {args[0]!r}")

    with monkeypatch.context() as patch:
        patch.setattr(lm_eval, "evaluate", logged)
        patch.setattr(subprocess.Popen, "__init__", no_process)
        got = lm_eval_run(model, tokenizer, ["snaketrl_arithmetic"], limit=limit, batch_size=4, seed=3,
                          num_fewshot=num_fewshot, task_manager=manager, chat=chat)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    theirs = lm_eval.simple_evaluate(
        model=HFLM(pretrained=inner, tokenizer=tokenizer, batch_size=4, max_length=max_positions(inner)),
        tasks=["snaketrl_arithmetic"], task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=True,
        bootstrap_iters=0, random_seed=3, numpy_random_seed=3, torch_random_seed=3, fewshot_random_seed=3,
        apply_chat_template=chat)
    fields = lambda result: [(s["arguments"], s["resps"]) for s in result["samples"]["snaketrl_arithmetic"]]  # noqa: E731
    assert len(fields(ours[0])) == limit and fields(ours[0]) == fields(theirs)
    [[(context, _)], _] = fields(ours[0])[0]
    assert context.count("Question:") == 1 + (num_fewshot or 0)  # the question after its shots
    assert got == {k: {m: v for m, v in theirs["results"][k].items() if m in ("sample_len", "exact_match,final-number")}
                   for k in theirs["results"]}
    return context


def test_project_task_data_is_an_input_and_the_job_reads_the_copy_it_is_given():
    """The arithmetic task's data ships with the workflow: the eval job gets the workflow's copy as an input
    (from any working directory) and lm-eval loads the task with that file; other tasks go by name."""
    from snaketrl.evaluate.harness import project_task_files, task_specs

    assert project_task_files(["snaketrl_arithmetic", "hellaswag"]) == ["data/samples/arithmetic.jsonl"]
    [spec, other] = task_specs(["snaketrl_arithmetic", "hellaswag"], {"data/samples/arithmetic.jsonl": "/w/a.jsonl"})
    assert spec["task"] == "snaketrl_arithmetic" and spec["dataset_kwargs"]["data_files"] == {"test": "/w/a.jsonl"}
    assert spec["doc_to_text"] == "Question: {{question}}\nAnswer:" and other == "hellaswag"
    assert task_specs(["snaketrl_arithmetic"], None) == ["snaketrl_arithmetic"]


def test_unknown_lm_eval_task_at_job_time():
    pytest.importorskip("lm_eval")
    with pytest.raises(ConfigError, match=r"^evaluation.lm_eval.tasks: unknown lm-eval task 'snaketrl_arith' "
                                          r"\(did you mean 'snaketrl_arithmetic'\?\); project tasks "
                                          r"\(snaketrl/evaluate/lm_eval_tasks\) are \['snaketrl_arithmetic'\]$"):
        lm_eval_task_manager(["snaketrl_arith"])


def test_k1_on_sampled_completions_estimates_the_exact_kl(loaded):
    """One-token completions sampled from the run: the k1 mean approaches sum_v p_run(v) log(p_run(v)/p_base(v))."""
    import statistics

    import torch

    gen = generate(loaded.model, loaded.tokenizer, ["She walked into the room and saw a"] * 2000,
                     max_new_tokens=1, do_sample=True, batch_size=500, seed=0)
    k1 = kl_to_reference(loaded, gen, batch_size=500)
    ids = torch.tensor([gen.prompt_ids[0]], device=loaded.model.device)
    with torch.no_grad():
        run = loaded.model(input_ids=ids).logits[0, -1].log_softmax(-1)
        with loaded.reference():
            base = loaded.model(input_ids=ids).logits[0, -1].log_softmax(-1)
    exact = float((run.exp() * (run - base)).sum())
    assert exact > 0
    assert statistics.mean(k1) == pytest.approx(exact, abs=4 * statistics.stdev(k1) / len(k1) ** 0.5)


def test_schema_section_validates_and_agrees_with_the_defaults(config):
    import yaml

    from snaketrl.config import validate
    from snaketrl.config.evaluation import DEFAULTS

    config["evaluation"] = {"prompts": {"dataset": "tldr", "size": 32}, "references": "tldr", "pairs": None,
                            "reward_funcs": ["unique_chars"], "lm_eval": {"tasks": ["snaketrl_arithmetic"]}}
    validate(config, str(ROOT / "config" / "schema.yaml"))
    ev = config["evaluation"]
    assert ev["generation"] == DEFAULTS["generation"] and ev["lm_eval"] == {**DEFAULTS["lm_eval"], **ev["lm_eval"]}
    schema = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())["properties"]["evaluation"]["properties"]
    assert set(schema) == set(DEFAULTS)
    config["evaluation"]["prompts"] = {"dataset": "tldr", "split": "test"}
    with pytest.raises(ConfigError, match=r"^config: evaluation.prompts.split: 'test' is not one of \['eval', 'train'\]$"):
        validate(config, str(ROOT / "config" / "schema.yaml"))


def test_eval_job_inputs_name_the_workflow_files(datasets):
    from snaketrl import paths
    from snaketrl.config.evaluation import eval_job_inputs

    ev = check_evaluation({"prompts": "tldr", "pairs": "descriptiveness", "reward_models": ["reward-pythia-tiny"]},
                          _runs(), datasets)
    assert eval_job_inputs("ppo-qwen2-tiny", ev, _runs()) == {
        "model": paths.merged("sft-qwen2-tiny"), "adapter": paths.adapter("ppo-qwen2-tiny"),
        "prompts": paths.prepared("tldr", "grpo", "eval"), "pairs": paths.prepared("descriptiveness", "dpo", "eval"),
        "reward_models": [paths.merged("reward-pythia-tiny")],
        "reference": paths.evaluation("base-qwen2-tiny", "completions.jsonl"),  # one yardstick: the base
        "reference_pairs": paths.evaluation("sft-qwen2-tiny", "pairs.jsonl")}  # its start's pair log-probabilities
    assert eval_job_inputs("sft-qwen2-tiny", ev, _runs())["reference_pairs"] == paths.evaluation(
        "base-qwen2-tiny", "pairs.jsonl")
    assert eval_job_inputs("base-qwen2-tiny", ev, _runs())["model"] == paths.model("qwen2-tiny")
    assert "reference" not in eval_job_inputs("base-qwen2-tiny", ev, _runs())
