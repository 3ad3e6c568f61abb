"""The models stage (rules/models.smk): the base models runs start from, and merged runs.

tiny: a tokenizer trained on the corpus and a random-init model. pretrain: its short causal-LM
pretraining. download: a Hub snapshot (gguf: or a GGUF file, or its parts, converted; chat_template: with the chat
template the config names). tokenizer: the pad token every stage relies on. merge: a run's
adapter merged into its base (another run's policy, or a reward model).
"""
