import os
import sys
from functools import partial

from snakemake.sourcecache import LocalSourceFile
from snakemake.utils import min_version

min_version("9.0")


# What ships with the workflow (the default config, its sample data, the accelerate configs) is read from
# the workflow's own directory, whatever the working directory (-d, or the user's directory when this is a
# module): the directory of this file while it is parsed (workflow.basedir is the first Snakefile's, the
# user's one in a module). A github()/gitlab() module has no such directory: Snakemake copies its files one
# at a time, as text, and jobs reach the snaketrl package through the scripts/snaketrl link.
if not isinstance(workflow.current_basedir, LocalSourceFile):
    sys.exit(
        f"snaketrl: used as a module from {workflow.current_basedir}, which is not a local directory; git "
        f"clone the repository at that version and set the module's snakefile: to the clone's Snakefile"
    )
WORKFLOW_ROOT = os.fspath(workflow.current_basedir)
# shipped("config/accelerate/ddp.yaml"): that file of the workflow, as an absolute path.
shipped = partial(os.path.join, WORKFLOW_ROOT)

# Pure Python (installed from this checkout): parsing never loads torch, transformers or trl.
from snaketrl.config import live_environment, resolve_runs, validate, yaml_mistake
from snaketrl.config.evaluation import check_evaluation, eval_targets
from snaketrl.errors import SnaketrlError
from snaketrl.forkserver import offer
from snaketrl.train.distributed import rule_gpus

# A --configfile on the command line replaces the offline default instead of being merged
# into it (merging would keep the default's tiny models and datasets beside the new ones).
# As a module with `config: config`, Snakemake skips this: the user's workflow loads the config.
# Snakemake's message for a YAML mistake names neither file nor line: find them first (a --configfile
# is read before this file runs; docs/configuration.md says how to find its mistake).
if not workflow.overwrite_configfiles:
    if mistake := yaml_mistake(shipped("config/config.yaml")):
        sys.exit(f"snaketrl: {mistake}")

    configfile: shipped("config/config.yaml")


try:
    validate(config, shipped("config/schema.yaml"))
    # What the profile or command line gives the train rule (set-resources): GPUs or none decide which
    # distributed modes and process counts can run.
    TRAIN_GPUS = rule_gpus(
        workflow.resource_settings.overwrite_resources.get("train", {})
    )
    RUNS = resolve_runs(config, shipped, TRAIN_GPUS)
    # The live view's fields reach the train jobs in their environment, not their params: turning the view on
    # or off retrains nothing (snaketrl/train/live.py).
    os.environ.update(live_environment(config, RUNS))
    EVAL = check_evaluation(config.get("evaluation"), RUNS, config["datasets"], shipped)
    EVAL_TARGETS = eval_targets(EVAL, RUNS) if EVAL else {}
except SnaketrlError as err:
    sys.exit(f"snaketrl: {err}")

# Jobs of tiny models spend most of their CPU importing torch and friends: where every model is tiny and jobs
# run here on CPUs, one warm process imports them once and forks the jobs (snaketrl/forkserver.py).
offer(
    all("tiny" in entry for entry in config["models"].values())
    and not TRAIN_GPUS
    and workflow.local_exec
    and not (workflow.remote_exec or workflow.subprocess_exec)
)


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/models.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        paths.report(),
        [paths.evaluation_db()] if EVAL else [],
