"""The evaluate stage (rules/evaluate.smk): one yardstick for every run.

loading: a run's model and adapter. generation: completions. scoring: reward functions, reward models and
the aggregates of their scores. likelihood: held-out NLL, preference accuracy, KL. harness:
lm-evaluation-harness tasks. kinds: what each evaluation dataset is for. job: the eval job. storage: one
SQLite database of every job's files.

Each function works on a loaded model and plain lists, so each is testable on a tiny model. Heavy imports
(torch, transformers, peft, lm_eval) happen inside functions: importing these modules is cheap, and the
config check (snaketrl.config.evaluation) reads kinds and harness at parse time.
"""
