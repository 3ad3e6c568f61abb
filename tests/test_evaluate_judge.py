"""A reward model judging completions of its own prompts (evaluation.reward_models: {run, prompts}): the prompts it
and the runs trained against it were trained on, not the yardstick's."""

import re
import sqlite3
from collections import Counter

import pytest
import yaml

from conftest import ROOT
from snaketrl import paths
from snaketrl.config.evaluation import check_evaluation, eval_job_inputs, eval_targets
from snaketrl.config.schema import validate
from snaketrl.data.fetch import fetch
from snaketrl.errors import ConfigError, DataError
from snaketrl.evaluate.job import evaluate
from snaketrl.evaluate.kinds import JUDGE_PROMPTS
from snaketrl.evaluate.scoring import reward_model_scores, win_rate
from snaketrl.evaluate.storage import collect
from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.report import intervals

JUDGE = "reward-qwen2-tiny"
SCORE = "rm_reward_qwen2_tiny"
OWN = {"run": JUDGE, "prompts": {"dataset": "descriptiveness", "size": 5},
       "generation": {"max_new_tokens": 3, "do_sample": True, "temperature": 0.7}}
SETTINGS = {"prompts": {"dataset": "tldr", "size": 6}, "generation": {"max_new_tokens": 8, "batch_size": 4},
            "reward_funcs": ["unique_chars"], "reward_models": [OWN]}


def _runs():
    """Resolved runs as snaketrl.config.resolve_runs returns them (only the keys evaluation reads)."""
    def run(trainer, model, dataset):
        return {"trainer": trainer, "model": model, "dataset": dataset, "policy": None, "seed": 42}

    return {"sft-qwen2-tiny": run("sft", "qwen2-tiny", "tldr"), JUDGE: run("reward", "qwen2-tiny", "descriptiveness"),
            "reward-pythia-tiny": run("reward", "pythia-tiny", "descriptiveness"),
            "ppo-qwen2-tiny": run("ppo", "qwen2-tiny", "descriptiveness")}


@pytest.fixture(scope="module")
def datasets():
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["datasets"]


def _check(datasets, *entries, **section):
    return check_evaluation({**SETTINGS, "reward_models": list(entries), **section}, _runs(), datasets)


# --- The config, at parse time ---------------------------------------------------------------------------------

def test_a_judge_keeps_its_prompts_and_generation(datasets):
    ev = _check(datasets, OWN, "reward-pythia-tiny")
    assert ev["reward_models"] == [JUDGE, "reward-pythia-tiny"]
    # Its rows: the prepared split PPO trains from (the same rows as any prompt-layout trainer's).
    assert ev[JUDGE_PROMPTS] == {JUDGE: {
        "dataset": "descriptiveness", "split": "eval", "size": 5, "trainer": "ppo",
        "generation": {"max_new_tokens": 3, "do_sample": True, "temperature": 0.7, "top_p": 1.0, "batch_size": 4}}}
    # The prepared eval split of its dataset is an input of every eval job: a new prompt set reruns them.
    for name in eval_targets(ev, _runs()):
        inputs = eval_job_inputs(name, ev, _runs())
        assert inputs[JUDGE_PROMPTS] == [paths.prepared("descriptiveness", "ppo", "eval")]
    # Its own prompts alone need no evaluation.prompts; a dataset no run trains on in that layout is prepared as
    # evaluation.prompts' are.
    alone = check_evaluation({"reward_models": [{"run": JUDGE, "prompts": "tldr"}]}, _runs(), datasets)
    assert alone["prompts"] is None and alone[JUDGE_PROMPTS][JUDGE] == {
        "dataset": "tldr", "split": "eval", "size": None, "trainer": "grpo", "generation": alone["generation"]}


def test_a_plain_name_keeps_todays_meaning(datasets):
    ev = _check(datasets, JUDGE)
    assert ev["reward_models"] == [JUDGE] and JUDGE_PROMPTS not in ev
    assert all(JUDGE_PROMPTS not in eval_job_inputs(n, ev, _runs()) for n in eval_targets(ev, _runs()))
    with pytest.raises(ConfigError, match=r"^config: evaluation: reward_funcs/reward_models score generated "
                                          r"completions; set evaluation.prompts.dataset$"):
        check_evaluation({"reward_models": [JUDGE]}, _runs(), datasets)


@pytest.mark.parametrize("prompts, message", [
    ({"dataset": "nope"}, "config: evaluation.reward_models[0].prompts.dataset: unknown dataset 'nope'; expected one "
                          "of ['arithmetic', 'descriptiveness', 'firefly', 'tldr', 'ultrafeedback']"),
    ({"dataset": "tldr", "size": 0}, "config: evaluation.reward_models[0].prompts.size: expected a positive integer "
                                     "or null, got 0"),
    ({"dataset": "tldr", "split": "test"}, "config: evaluation.reward_models[0].prompts.split: expected 'eval' (held "
                                           "out from training) or 'train', got 'test'"),
    ({"dataset": "tldr", "rows": 3}, "config: evaluation.reward_models[0].prompts.rows: unknown key; expected one of "
                                     "['dataset', 'split', 'size']"),
])
def test_a_judges_prompts_are_checked_at_parse_time(datasets, prompts, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _check(datasets, {"run": JUDGE, "prompts": prompts})


def test_a_judges_dataset_needs_a_prompt_column(datasets, tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "a document"}\n')
    with pytest.raises(ConfigError, match=re.escape(
            "config: evaluation.reward_models[1].prompts: dataset 'docs' has no column 'prompt' (generation needs "
            "prompt); its columns are ['text'] (map names with datasets.docs.columns)") + "$"):
        _check({**datasets, "docs": {"files": str(tmp_path / "docs.jsonl")}}, "reward-pythia-tiny",
               {"run": JUDGE, "prompts": "docs"})


@pytest.mark.parametrize("entry, message", [
    ({"run": JUDGE}, "config: evaluation.reward_models[0].prompts: expected the prompts it judges, a dataset name or "
                     "{dataset, split, size} (a run name alone judges the yardstick's prompts)"),
    ({"run": JUDGE, "prompts": "tldr", "seed": 1}, "config: evaluation.reward_models[0].seed: unknown key; expected "
                                                   "one of ['run', 'prompts', 'generation']"),
    ({"run": JUDGE, "prompts": "tldr", "generation": {"max_tokens": 3}},
     "config: evaluation.reward_models[0].generation.max_tokens: unknown key; expected one of ['batch_size', "
     "'do_sample', 'max_new_tokens', 'temperature', 'top_p']"),
    ({"run": JUDGE, "prompts": "tldr", "generation": {"max_new_tokens": 0}},
     "config: evaluation.reward_models[0].generation.max_new_tokens: expected a positive integer, got 0"),
    ({"run": "reward-nope", "prompts": "tldr"}, "config: evaluation.reward_models: 'reward-nope' is not a run; reward "
                                                "model runs are ['reward-pythia-tiny', 'reward-qwen2-tiny']"),
])
def test_a_judge_entry_is_checked_at_parse_time(datasets, entry, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _check(datasets, entry)


def test_one_dataset_is_one_prompt_set(datasets):
    """Two judges of one dataset share its completions, so they must name the same prompts."""
    same = _check(datasets, OWN, {**OWN, "run": "reward-pythia-tiny"})
    assert same[JUDGE_PROMPTS][JUDGE] == same[JUDGE_PROMPTS]["reward-pythia-tiny"]
    with pytest.raises(ConfigError, match=re.escape(
            "config: evaluation.reward_models[1].prompts: dataset 'descriptiveness' is judged on other prompts by "
            "evaluation.reward_models[0]; give both the same split, size and generation") + "$"):
        _check(datasets, OWN, {"run": "reward-pythia-tiny", "prompts": {"dataset": "descriptiveness", "size": 4}})


def test_the_schema_takes_both_forms_and_refuses_a_size_below_one():
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["evaluation"]["reward_models"] = ["reward-pythia-tiny", {"run": "reward-qwen2-tiny",
                                                                    "prompts": {"dataset": "descriptiveness"}}]
    validate(config, str(ROOT / "config" / "schema.yaml"))
    config["evaluation"]["reward_models"][1]["prompts"]["size"] = 0
    with pytest.raises(ConfigError, match=r"^config: evaluation\.reward_models\.1\.prompts\.size: 0 is less than "
                                          r"the minimum of 1$"):
        validate(config, str(ROOT / "config" / "schema.yaml"))


def test_the_real_models_judge_reads_held_out_rows_of_every_opening():
    """config/smollm2.yaml: PPO's judge completes the first 64 rows of descriptiveness' eval split (160 held out, as
    get_dataset holds them out), none a row PPO or the reward model trains on, and every one of the sample's 5
    openings among them (docs/real-model.md)."""
    cfg = yaml.safe_load((ROOT / "config" / "smollm2.yaml").read_text())
    entry = cfg["datasets"]["descriptiveness"]
    (judge,) = cfg["evaluation"]["reward_models"]
    got = fetch("descriptiveness", {**entry, "files": str(ROOT / entry["files"].removeprefix("workflow:"))},
                cfg["seed"])
    assert (judge["run"], judge["prompts"]) == ("reward-smollm2", {"dataset": "descriptiveness", "size": 64})
    assert (len(got.eval), len(got.train)) == (160, 240)
    assert not {row_key(r) for r in got.eval} & {row_key(r) for r in got.train}
    assert sorted(Counter(r["prompt"] for r in got.eval[:64]).values()) == [6, 9, 12, 15, 22]
    assert {r["prompt"] for r in got.eval[:64]} == {r["prompt"] for r in got.train}


def row_key(row: dict) -> tuple:
    return row["prompt"], row["chosen"], row["rejected"]


# --- The eval job ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judged(tmp_path_factory, tiny_model_dir, reward_dir, datasets):
    """A base job, then a run job against it (win rates), both with the judge on its own prompts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketrl.data.preprocess import preprocess

    tmp = tmp_path_factory.mktemp("judged")
    for name, dataset in (("prompts", "tldr"), ("own", "descriptiveness")):
        rows = preprocess(read_jsonl(ROOT / f"data/samples/{dataset}.jsonl")[:12], dataset=dataset, trainer="grpo",
                          layout="prompt", columns={}, split="eval").rows
        write_jsonl(rows, tmp / f"{name}.jsonl")
    torch.manual_seed(0)
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                        task_type="CAUSAL_LM"))
    adapter.save_pretrained(tmp / "adapter")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp / "adapter")
    settings = check_evaluation(SETTINGS, _runs(), datasets)
    common = dict(settings=settings, model_dir=tiny_model_dir, reward_models={JUDGE: reward_dir},
                  prompts_file=tmp / "prompts.jsonl", reward_model_prompts={"descriptiveness": tmp / "own.jsonl"},
                  threads=1)
    base = evaluate(target={"kind": "base", "run": None, "model": "qwen2-tiny", "trainer": "base", "seed": 42,
                            "reference": None},
                    out_completions=tmp / "base/completions.jsonl", out_metrics=tmp / "base/metrics.json", **common)
    run = evaluate(target={"kind": "run", "run": "sft-qwen2-tiny", "model": "qwen2-tiny", "trainer": "sft",
                           "seed": 42, "reference": "base-qwen2-tiny"},
                   adapter_dir=tmp / "adapter", reference_completions=tmp / "base/completions.jsonl",
                   out_completions=tmp / "run/completions.jsonl", out_metrics=tmp / "run/metrics.json", **common)
    return tmp, base, run


def test_the_judge_scores_completions_of_its_own_prompts(judged, reward_dir):
    tmp, base, run = judged
    own = [r["prompt"] for r in read_jsonl(tmp / "own.jsonl")[:5]]
    rows = read_jsonl(tmp / "run/completions.jsonl")
    yardstick, judge = rows[:6], rows[6:]
    assert [r["prompt_id"] for r in rows] == list(range(11))
    assert [r["prompt"] for r in yardstick] == [r["prompt"] for r in read_jsonl(tmp / "prompts.jsonl")[:6]]
    assert [r["prompt"] for r in judge] == own and {r["prompt_set"] for r in judge} == {"descriptiveness"}
    # The yardstick's rows carry the reward functions' scores and KL; the judge's rows its score alone.
    assert all("prompt_set" not in r and SCORE not in r and "fn_unique_chars" in r and "kl_k1" in r
               for r in yardstick)
    assert all("fn_unique_chars" not in r and "kl_k1" not in r for r in judge)
    # Its own generation: at most 3 new tokens there, 8 on the yardstick's prompts.
    assert max(r["n_tokens"] for r in judge) <= 3 < max(r["n_tokens"] for r in yardstick)
    # The scores are the reward model's of these prompts and completions, recomputed here.
    assert [r[SCORE] for r in judge] == pytest.approx(
        reward_model_scores(reward_dir, own, [r["completion"] for r in judge]), abs=1e-5)
    entry = run["scores"][SCORE]
    assert entry["n"] == 5 and entry["prompts"] == "descriptiveness"
    assert entry["mean"] == pytest.approx(sum(r[SCORE] for r in judge) / 5)
    base_rows = read_jsonl(tmp / "base/completions.jsonl")
    assert entry["win_rate"] == win_rate([r[SCORE] for r in judge], [r[SCORE] for r in base_rows[6:]])
    assert run["scores"]["fn_unique_chars"]["n"] == 6 and run["scores"]["fn_unique_chars"]["prompts"] == "tldr"
    assert run["n_prompts"] == 6 and run["mean_length"] == sum(r["n_tokens"] for r in yardstick) / 6
    assert set(run["timing_s"]) >= {"generate", "generate_judged", "scores"}


def test_the_judges_rows_reach_the_database_and_the_intervals(judged, tmp_path):
    tmp, _, _ = judged
    jobs = [tmp / "base/completions.jsonl", tmp / "run/completions.jsonl"]
    assert collect(jobs, tmp_path / "eval.sqlite")["completions"] == 22
    db = sqlite3.connect(tmp_path / "eval.sqlite")
    assert db.execute(f"SELECT run, prompt_set, COUNT({SCORE}), COUNT(fn_unique_chars) FROM completions "
                      f"GROUP BY run, prompt_set ORDER BY run, prompt_set").fetchall() == [
        ("base-qwen2-tiny", None, 0, 6), ("base-qwen2-tiny", "descriptiveness", 5, 0),
        ("sft-qwen2-tiny", None, 0, 6), ("sft-qwen2-tiny", "descriptiveness", 5, 0)]
    assert db.execute(f"SELECT scores_{SCORE}_n, scores_{SCORE}_prompts FROM metrics WHERE run = 'sft-qwen2-tiny'"
                      ).fetchall() == [(5, "descriptiveness")]
    # The report's paired intervals, unchanged: the judge's difference is over its 5 prompts, the function's over 6.
    scores = intervals.prompt_scores([r for job in jobs for r in read_jsonl(job)], {})
    judge = intervals.compare(scores, "sft-qwen2-tiny", "base-qwen2-tiny", SCORE)
    rows = read_jsonl(jobs[1])[6:]
    base = read_jsonl(jobs[0])[6:]
    assert judge.prompts == 5 and judge.difference == pytest.approx(
        sum(a[SCORE] - b[SCORE] for a, b in zip(rows, base)) / 5)
    assert intervals.compare(scores, "sft-qwen2-tiny", "base-qwen2-tiny", "fn_unique_chars").prompts == 6


def test_a_reference_of_other_judged_prompts_is_refused(judged, tiny_model_dir, reward_dir, datasets):
    tmp, _, _ = judged
    base_rows = read_jsonl(tmp / "base/completions.jsonl")
    write_jsonl(base_rows[:6] + base_rows[7:], tmp / "short.jsonl")  # the judge's first prompt missing
    with pytest.raises(DataError, match=re.escape(
            f"evaluate sft-qwen2-tiny: the reference's completions ({tmp / 'short.jsonl'}) are for other prompts; "
            f"rerun its eval job with the same evaluation.prompts and reward_models' prompts") + "$"):
        evaluate(target={"kind": "run", "run": "sft-qwen2-tiny", "model": "qwen2-tiny", "trainer": "sft", "seed": 42,
                         "reference": "base-qwen2-tiny"},
                 settings=check_evaluation(SETTINGS, _runs(), datasets), model_dir=tiny_model_dir,
                 reward_models={JUDGE: reward_dir}, prompts_file=tmp / "prompts.jsonl",
                 reward_model_prompts={"descriptiveness": tmp / "own.jsonl"}, reference_completions=tmp / "short.jsonl",
                 out_completions=tmp / "x/completions.jsonl", out_metrics=tmp / "x/metrics.json", threads=1)
    assert not (tmp / "x").exists()


def test_the_reports_first_sentence_counts_the_judges_prompts(judged):
    """The yardstick is the judge's score, taken over its 5 prompts, not the yardstick's 6."""
    from snaketrl.report.render import evaluation_section

    tmp, _, _ = judged
    evaluated = {job: {"completions": tmp / d / "completions.jsonl", "metrics": tmp / d / "metrics.json"}
                 for job, d in (("base-qwen2-tiny", "base"), ("sft-qwen2-tiny", "run"))}
    section = evaluation_section(evaluated, {})
    assert section["metric"] == SCORE
    assert "(bootstrap over the 5 prompts); " in section["first"]["sentences"][0]
