"""One mistaken config per class of mistake, each a copy of the default with one mistake: the parse-time check
ends in exactly this one line, naming the key where it is written (checked in process, as the Snakefile calls
it; two through a real `snakemake -n`)."""

import copy
import os
from functools import partial

import pytest
import yaml

from conftest import ROOT
from snaketrl.config import resolve_runs, validate, yaml_mistake
from snaketrl.config.evaluation import check_evaluation
from snaketrl.errors import ConfigError

DEFAULT = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
SHIPPED = partial(os.path.join, str(ROOT))


def parse(change) -> dict:
    """What the Snakefile does with the default config after `change`: validate, check, check_evaluation."""
    config = copy.deepcopy(DEFAULT)
    change(config)
    validate(config, str(ROOT / "config" / "schema.yaml"))
    runs = resolve_runs(config, SHIPPED)
    check_evaluation(config.get("evaluation"), runs, config["datasets"], SHIPPED)
    return runs


def at(path: str, value):
    """A change setting `value` at the slash-separated `path` (missing mappings are made)."""
    def change(config):
        *parents, key = path.split("/")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    return change


GRPO_REWARDS = "trainers/grpo/reward_funcs"
MISTAKES = {
    # A TRL field's type, from its config class's annotation (enum values too).
    "type": (at("training/per_device_train_batch_size", "eight"),
             "config: training.per_device_train_batch_size: expected an integer, got 'eight'"),
    "type in a trainer's args": (at("trainers/sft/args/per_device_train_batch_size", "eight"),
                                 "config: trainers.sft.args.per_device_train_batch_size: expected an integer, got "
                                 "'eight'"),
    "type of a boolean": (at("trainers/dpo/args/beta", True), "config: trainers.dpo.args.beta: expected a number, got "
                                                              "true"),
    "enum value": (at("training/eval_strategy", "step"),
                   "config: training.eval_strategy: expected one of 'no', 'steps', 'epoch', got 'step'; did you mean "
                   "'steps'?"),
    # Counts that make a run train nothing.
    "negative epochs": (at("training/num_train_epochs", -1),
                        "config: training.num_train_epochs: expected a number >= 0 (0 trains nothing unless max_steps "
                        "is set), got -1"),
    "zero epochs without max_steps": (at("trainers/sft/args/num_train_epochs", 0),
                                      "config: trainers.sft.args.num_train_epochs: 0 epochs without max_steps trains "
                                      "nothing (run sft-qwen2-tiny); expected a number > 0"),
    "zero max_steps": (at("trainers/grpo/args/max_steps", 0),
                       "config: trainers.grpo.args.max_steps: expected a positive integer, or -1 (the default: "
                       "num_train_epochs decides), got 0"),
    "zero accumulation": (at("runs/sft-qwen2-tiny", {"args": {"gradient_accumulation_steps": 0}}),
                          "config: runs.sft-qwen2-tiny.args.gradient_accumulation_steps: expected an integer >= 1, "
                          "got 0"),
    "one generation": (at("trainers/grpo/args/num_generations", 1),
                       "config: trainers.grpo.args.num_generations: expected an integer >= 2 (group-relative "
                       "advantages need at least two completions per prompt), got 1"),
    "fractional steps above 1": (at("training/logging_steps", 2.5),
                                 "config: training.logging_steps: expected a number > 0 (up to 1: a share of the "
                                 "training steps; above 1: a whole number of steps), got 2.5"),
    "zero LoRA rank": (at("lora/r", 0), "config: lora.r: expected an integer >= 1, got 0"),
    "LoRA type": (at("models/qwen2-tiny/lora/lora_dropout", "none"),
                  "config: models.qwen2-tiny.lora.lora_dropout: expected a number, got 'none'"),
    "zero evaluation rows": (at("evaluation/prompts/size", 0), "config: evaluation.prompts.size: 0 is less than the "
                                                               "minimum of 1"),
    # Names: a did-you-mean among the right kind only.
    "unknown TRL field": (at("trainers/sft/args/learning_rat", 0.1),
                          "config: trainers.sft.args.learning_rat: not a field of trl.SFTConfig; did you mean "
                          "'learning_rate'?"),
    "field of other trainers in training": (at("training/beta", 0.2),
                                            "config: training.beta: not a field of trl.experimental.ppo.PPOConfig "
                                            "(training applies to every trainer; set it under trainers.<name>.args "
                                            "of dpo, grpo)"),
    "unknown LoRA field": (at("lora/alpha", 16), "config: lora.alpha: not a field of peft.LoraConfig; did you mean "
                                                 "'lora_alpha'?"),
    "unknown key": (at("evaluation/generation/max_tokens", 32),
                    "config: evaluation.generation.max_tokens: unknown key; did you mean 'max_new_tokens'?"),
    "another tool's key": (at("models/qwen2-tiny/load_in_4bit", True),
                           "config: models.qwen2-tiny.load_in_4bit: unknown key; use quantization: 4bit (the "
                           "workflow sets bitsandbytes' nf4 with double quantization)"),
    "typo of a matrix run": (at("runs/sft-qwen2-tinny", {"args": {"learning_rate": 0.01}}),
                             "config: runs.sft-qwen2-tinny: missing 'trainer' (not a matrix run, so it must name "
                             "one); did you mean the matrix run 'sft-qwen2-tiny'?"),
    "reward models without reward runs": (at("matrix/trainers", ["sft", "dpo"]),
                                          "config: evaluation.reward_models: 'reward-qwen2-tiny' is not a run; no "
                                          "run trains a reward model (add reward to matrix.trainers, or leave "
                                          "reward_models out)"),
    "matrix model": (at("matrix/models", ["qwen2-tiny", "pythia-tinny"]),
                     "config: matrix.models: unknown model 'pythia-tinny' (did you mean 'pythia-tiny'?); expected one "
                     "of ['pythia-tiny', 'qwen2-tiny']"),
    # Fields the workflow owns, refused where they are written.
    "owned by the length stage": (at("training/max_length", 512),
                                  "config: training.max_length: set by the length histogram (tune "
                                  "length.keep_share); remove it"),
    "owned seed": (at("trainers/dpo/args/seed", 3),
                   "config: trainers.dpo.args.seed: set by the top-level seed (`seeds: [...]`, top level or per run, "
                   "repeats runs over seeds); remove it"),
    "owned bf16": (at("training/bf16", True), "config: training.bf16: the hardware decides bf16 (on where the GPU "
                                              "supports it); only bf16: false may be set"),
    "owned in a sweep": (at("sweeps/sft/packing", [True, False]),
                         "config: sweeps.sft.packing: set by the length stage's batching choice (length.batching: "
                         "auto, padded, grouped, packed), it cannot be swept"),
    # References and paths.
    "placeholder": (at("trainers/grpo/policy", "sft-{models}"),
                    "config: trainers.grpo.policy: 'sft-{models}': unknown placeholder {models}; the only one is "
                    "{model} (the run's model)"),
    "local model directory": (at("models/qwen2-tiny", {"hub": "/data/models/Qwen2.5-0.5B-Instruct",
                                                       "lora": {"target_modules": ["q_proj"]}}),
                              "config: models.qwen2-tiny.hub: local directory /data/models/Qwen2.5-0.5B-Instruct does "
                              "not exist (a Hub id is written org/name)"),
    "reward function module": (at(GRPO_REWARDS, ["my_rewards:length"]),
                               "config: trainers.grpo.reward_funcs: 'my_rewards:length': no module 'my_rewards' on "
                               "the Python path (install it, or put its directory on PYTHONPATH)"),
    "reward function name": (at(GRPO_REWARDS, ["snaketrl.rewards:unique_char"]),
                             "config: trainers.grpo.reward_funcs: 'snaketrl.rewards:unique_char': module "
                             f"'snaketrl.rewards' ({ROOT}/snaketrl/rewards.py) defines no 'unique_char'; did you mean "
                             "'unique_chars'?"),
    # Names that become folders under results/: one path segment (a '/' or '..' would write elsewhere).
    "model name with a slash": (lambda c: c["models"].update({"org/tiny": c["models"]["qwen2-tiny"]}),
                                "config: models.org/tiny: a model name names folders under results/; it may hold only "
                                "letters, digits, '_', '.', '~', '+', '-', starting with a letter or digit"),
    "dataset name climbing out": (lambda c: c["datasets"].update({"../up": c["datasets"]["tldr"]}),
                                  "config: datasets.../up: a dataset name names folders under results/; it may hold "
                                  "only letters, digits, '_', '.', '~', '+', '-', starting with a letter or digit"),
    "file of a corpus dataset": (lambda c: c["datasets"]["firefly"].update(files="data/nope.jsonl"),
                                 "config: datasets.firefly.files: train file data/nope.jsonl does not exist (relative "
                                 f"paths are read from the working directory, {ROOT})"),
}


@pytest.mark.parametrize("change, message", MISTAKES.values(), ids=MISTAKES.keys())
def test_each_mistake_is_one_line_naming_its_key(change, message):
    with pytest.raises(ConfigError) as err:
        parse(change)
    assert str(err.value) == message


def test_yaml_1_1_readings_are_the_values_meant():
    """YAML 1.1 reads 1e-4 as the string '1e-4' and `no` as false: the job gets the float and 'no'; a swept run
    keeps the name as written."""
    def change(config):
        text = "learning_rate: 1e-4\neval_strategy: no\n"
        config["training"].update(yaml.safe_load(text))
        config["lora"]["r"] = 8.0
        config["sweeps"] = {"dpo": {"beta": ["5e-2", 0.5]}}

    runs = parse(change)
    assert runs["sft-qwen2-tiny"]["args"]["eval_strategy"] == "no"
    assert runs["sft-qwen2-tiny"]["args"]["learning_rate"] == 1e-4
    assert isinstance(runs["sft-qwen2-tiny"]["args"]["learning_rate"], float)
    assert runs["sft-qwen2-tiny"]["lora"]["r"] == 8 and isinstance(runs["sft-qwen2-tiny"]["lora"]["r"], int)
    assert runs["dpo-qwen2-tiny-beta~5e-2"]["args"]["beta"] == 0.05
    assert runs["dpo-qwen2-tiny-beta~5e-2"]["swept"] == {"beta": 0.05}


@pytest.mark.parametrize("text, message", [
    ("training:\n  learning_rate: 0.1\n\tlogging_steps: 5\n",
     "line 3, column 1: found character '\\t' that cannot start any token; YAML indents with spaces, never tabs"),
    ("matrix:\n  trainers: [sft, dpo\n  models: [qwen2-tiny]\n",
     "line 3, column 9: expected ',' or ']', but got ':' (while parsing a flow sequence that started at line 2)"),
])
def test_yaml_mistakes_name_file_line_and_column(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert yaml_mistake(str(path)) == f"config: {path}, {message}"
    path.write_text("training: {learning_rate: 0.1}\n")
    assert yaml_mistake(str(path)) is None


def test_mistakes_end_the_dry_run_in_one_line(tmp_path):
    """Through Snakemake: the default config edited in place (a tab), and a --configfile with a mistyped field
    (once a TypeError with a stack)."""
    from test_workflow import copy_project, snakemake

    wd = copy_project(tmp_path / "wf")
    config = wd / "config" / "config.yaml"
    good = config.read_text()
    config.write_text(good.replace("\n  num_train_epochs: 2", "\n\tnum_train_epochs: 2"))
    proc = snakemake(wd, "-n", "--quiet", timeout=120)
    line = (f"snaketrl: config: {config}, line {good[:good.index('  num_train_epochs')].count(chr(10)) + 1}, "
            f"column 1: found character '\\t' that cannot start any token; YAML indents with spaces, never tabs")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-2000:]

    config.write_text(good)
    mine = tmp_path / "mine.yaml"
    mine.write_text(good.replace("per_device_train_batch_size: 8", 'per_device_train_batch_size: "eight"'))
    proc = snakemake(wd, "-n", "--quiet", "--configfile", str(mine), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("snaketrl: config: training.per_device_train_batch_size: expected "
                                                    "an integer, got 'eight'")
    assert "Traceback" not in proc.stderr


def test_use_vllm_passes_through_where_vllm_imports_and_is_refused_in_one_line_elsewhere(monkeypatch):
    """TRL's use_vllm (its colocate mode by default) reaches the run's args where vllm imports; where it does not,
    parsing names the package; a job that sees no CUDA GPU names that."""
    import importlib.util

    from snaketrl.train.args import check_hardware

    find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
        with pytest.raises(ConfigError) as err:
            parse(at("trainers/grpo/args/use_vllm", True))
    assert str(err.value) == ("config: trainers.grpo.args.use_vllm: use_vllm needs the vllm package, which this "
                              "environment lacks (pip install vllm, on a machine with a CUDA GPU); without it, drop "
                              "use_vllm: TRL then generates with transformers")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    runs = parse(at("trainers/grpo/args/use_vllm", True))
    assert {run["args"].get("use_vllm") for name, run in runs.items() if run["trainer"] == "grpo"} == {True}
    with pytest.raises(ConfigError, match=r"^config: run 'grpo-x': use_vllm generates with vLLM on a CUDA GPU; "
                                          r"none is visible"):
        check_hardware({"use_vllm": True}, "grpo-x", cuda=False)
