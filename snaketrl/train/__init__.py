"""The train stage (rules/train.smk): one run of any registered TRL trainer, LoRA/QLoRA, resumable.

run: the train job, and plan: what it decides before loading. args: the TRL config a run trains with. loading:
models and tokenizers as training loads them. batching, sampler, tokens: the length
stage's batching choice carried out and measured. cost: each step's FLOPs and peak memory. ppo: TRL's
PPOTrainer made resumable. orpo: TRL's ORPOTrainer with its rows cut at max_length and a finite odds-ratio
gradient. distributed: multi-GPU launches. training_samples: GRPO/PPO completions logged
while training. live: report_to trackio, the runs' curves in a local dashboard. generation: an online trainer's
generation with its LoRA adapter merged. checkpoints: resuming as if never interrupted. guard: diverged runs.
"""
