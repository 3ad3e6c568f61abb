from snaketrl.imports import start_job

start_job()  # first: before peft or transformers load

from snaketrl.evaluate.kinds import JUDGE_PROMPTS, judge_prompt_sets  # noqa: E402
from snaketrl.evaluate.job import evaluate  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake):
    inp = snakemake.input
    settings = snakemake.params.settings
    print(evaluate(target=snakemake.params.target, settings=settings, model_dir=inp.model,
                   adapter_dir=inp.get("adapter"), prompts_file=inp.get("prompts"),
                   references_file=inp.get("references"), pairs_file=inp.get("pairs"),
                   reward_models=dict(zip(settings["reward_models"], inp.get("reward_models", []))),
                   reference_completions=inp.get("reference"), reference_pairs=inp.get("reference_pairs"),
                   lm_eval_data=inp.get("lm_eval_data"), out_pairs=snakemake.output.pairs,
                   reward_model_prompts=dict(zip(judge_prompt_sets(settings), inp.get(JUDGE_PROMPTS, []))),
                   out_completions=snakemake.output.completions,
                   out_metrics=snakemake.output.metrics, threads=snakemake.threads))
