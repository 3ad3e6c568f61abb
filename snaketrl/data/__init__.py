"""The data stage (rules/data.smk): fetch a dataset, check and map its rows to a trainer's layout,
measure its lengths.

fetch: the user's files or a Hub dataset, split. schema: what a row must hold, worded for the user.
formats: dataset formats converted to TRL's columns. preprocess: rows mapped to a trainer's layout.
lengths: the length histogram that chooses max_length and the batching. samples: the shipped samples.
"""
