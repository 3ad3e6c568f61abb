"""The report stage (rules/report.smk): curves per run and one self-contained HTML report.

plots: a run's curves from trainer_state.json. figures: the helpers every section uses. leaderboard: the
yardstick's table. sweeps: the sweep section. render: the report itself (templates/).
"""
