import sys

from snakemake.utils import min_version

# Pure Python (installed from this checkout): parsing never loads torch, transformers or trl.
from snaketrl.config import check, validate
from snaketrl.errors import SnaketrlError
from snaketrl.evaluation_config import check_evaluation, eval_targets

min_version("9.0")


# A --configfile on the command line replaces the offline default instead of being merged
# into it (merging would keep the default's tiny models and datasets beside the new ones).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


try:
    validate(config, workflow.source_path("config/schema.yaml"))
    RUNS = check(config)
    EVAL = check_evaluation(config.get("evaluation"), RUNS, config["datasets"])
    EVAL_TARGETS = eval_targets(EVAL, RUNS) if EVAL else {}
except SnaketrlError as err:
    sys.exit(f"snaketrl: {err}")


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/models.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    input:
        paths.report(),
        [paths.evaluation_db()] if EVAL else [],
