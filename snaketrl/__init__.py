"""snaketrl: the importable logic behind the Snakemake workflow.

Importing this package (and snaketrl.config, snaketrl.trainers) must stay cheap: the
Snakefile imports it while parsing, and parsing never loads torch, transformers or trl.
"""

__version__ = "0.1.0"
