"""What a user would write instead, against snaketrl's choice, on the same GPU (or CPU) in one run.

For every run of the config (bench/gpu.yaml: issue 18's SFT on LIMA and DPO on hh-rlhf with a model of
Qwen2.5-0.5B's shape; bench/smollm2.yaml: the same data on SmolLM2-135M-Instruct, on CPU; bench/gemma3.yaml: Gemma 3
270M, also the reward model, KTO and ORPO on hh-rlhf) and every seed, one
epoch (or --max-steps steps) in a process of its own for each arm, every arm on the same rows (a chat model's as
chat turns, as the workflow gives them):
  trl         TRL's SFTTrainer / DPOTrainer (RewardTrainer, KTOTrainer, ORPOTrainer) written plainly, with their
              defaults (random batches padded to their longest, TRL's activation checkpointing on), the same rows,
              model, LoRA, max_length and epochs; a reward model loaded as TRL's docs do (a sequence classifier
              with num_labels=1, LoRA's SEQ_CLS task)
  trl-packed  the same with packing=True (SFT only)
  trl-tuned   packing=True and activation checkpointing off: what a user who tunes TRL writes (SFT only)
  trl-cpu-bf16  on a CPU, TRL's defaults once told use_cpu=True (without it TRL refuses a machine with no bf16
              GPU): its bf16=True then autocasts on the CPU (on a GPU this arm is `trl`)
  snaketrl    the workflow's train_run with the length stage's `auto` choice for this device and the
              checkpointing it chooses from memory
Prints real (non-pad) tokens per second of training steps (each step timed after the GPU finished its work),
token efficiency, the CPU seconds of the training loop (on a shared CPU the steadier measure: other load stretches
wall time, not a one-thread process's CPU time), peak GPU memory (on a CPU the process's peak RSS), an MFU estimate,
the eval loss (mean ± std over seeds), and the ratios against TRL's defaults, with the device's name and torch's
version.

    python bench/gpu.py                                    # on a GPU machine: the table for the README
    python bench/gpu.py --configfile bench/smollm2.yaml --max-steps 6     # SmolLM2 on CPU (docs/real-model.md)
    python bench/gpu.py --configfile config/config.yaml --runs sft-qwen2-tiny dpo-qwen2-tiny   # a CPU smoke run
    python bench/gpu.py --arms snaketrl --attention flex_attention --args '{"use_liger_kernel": true}'  # variants

MFU = the FLOPs of the work done / training seconds / the card's dense bf16 peak. The FLOPs are those every run
records (snaketrl.train.cost, docs/evaluation.md): per forward on t tokens with p query-key pairs
F = 2·N·t + 4·L·d·p; a trained forward adds its backward, 2·N·t + 8·L·d·p + 2·N_trainable·t; forwards without
gradients (DPO's reference pass) count F. Padding the kernels compute counts as work done, so token efficiency
shows the waste; activation checkpointing's recomputed forward does not count (it is not the model's work).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from efficiency import (  # noqa: E402
    EPOCH,
    base_model,
    cpu_clock,
    length_settings,
    load_config,
    loss_change,
    prepared,
    run_worker,
    spread,
)

ARMS = ("trl", "trl-packed", "trl-tuned", "trl-cpu-bf16", "snaketrl")
PACKED = ("trl-packed", "trl-tuned")
OFFLINE = ("sft", "dpo", "reward", "kto", "orpo")  # the trainers it runs: no generation (bench/rl.py's)
# Dense bf16 peaks (no sparsity) from the vendors' data sheets, matched on torch.cuda.get_device_name.
PEAK_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0,
               "L4": 121.0, "A10": 125.0}


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s (the most specific name that matches), None when unknown."""
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if name in device_name:
            return PEAK_TFLOPS[name] * 1e12
    return None


def profiler(out: str, skip: int = 2, steps: int = 3):
    """A callback that profiles optimizer steps skip+1 .. skip+steps and writes, to `out`, the share of their wall
    time the GPU was busy and the operators and kernels that took it (torch.profiler)."""
    import time

    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]

    class Profile(TrainerCallback):
        def __init__(self):
            self.prof, self.started, self.seen = None, None, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.seen += 1
            if self.seen == skip + 1:
                sync()
                self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
                self.prof.__enter__()
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is None or self.seen != skip + steps:
                return
            sync()
            wall = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            events = self.prof.key_averages()
            # Kernels only: an operator's row repeats the time of the kernels it launched.
            kernels = sum(e.self_device_time_total for e in events
                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
            with open(out, "w") as f:
                f.write(f"{steps} steps: {wall:.3f} s wall, GPU kernels {kernels:.3f} s ({kernels / wall:.0%} busy)\n\n")
                f.write(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
                f.write("\n")
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
                f.write("\n")  # which tensors the costly operators ran on
                f.write(self.prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=80))
            self.prof = None

    return Profile()


def plain_trl(job: dict) -> dict:
    """The user's alternative: TRL's trainer with its defaults (packing as the arm says), one epoch."""
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from snaketrl.data.chat import as_chat
    from snaketrl.io import read_jsonl
    from snaketrl.train.tokens import TokenCounter
    from snaketrl.trainers import REGISTRY, load

    run, spec = job["run"], REGISTRY[job["run"]["trainer"]]
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    args = {key: value for key, value in run["args"].items() if key not in ("activation_checkpointing",)}
    tuned = {"trl-packed": {"packing": True},
             "trl-tuned": {"packing": True, "activation_checkpointing": False},
             "trl-cpu-bf16": {} if cuda else {"use_cpu": True, "bf16": True}}.get(job["arm"], {})
    config = load(spec.config)(output_dir=job["work"] + "/out", seed=job["seed"], max_length=job["max_length"],
                               **{"bf16": bf16, **args, **job["schedule"], **tuned})
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    attention = run["model_entry"].get("attn_implementation")
    if attention == "varlen":
        from snaketrl.train.attention import register

        register()
    # A reward model as TRL's docs load one: a sequence classifier with one label (RewardTrainer refuses others)
    labels = {"num_labels": 1} if spec.task_type == "SEQ_CLS" else {}
    model = getattr(transformers, spec.model_class).from_pretrained(
        job["model_dir"], dtype=torch.bfloat16 if bf16 else torch.float32, **labels,
        **({"attn_implementation": attention} if attention else {}))
    counter, clock = TokenCounter(tokenizer.pad_token_id), cpu_clock()
    extra = [profiler(job["profile"])] if job.get("profile") else []
    rows = {split: read_jsonl(job[split]) for split in ("train", "eval")}  # the workflow's rows, as chats where it
    rows = {split: as_chat(r) if run.get("chat") else r for split, r in rows.items()}  # gives them so
    # TRL's own class where the registry names snaketrl's subclass of it (snaketrl.train.orpo)
    trainer_cls = next(c for c in load(spec.trainer).__mro__ if c.__module__.startswith("trl."))
    trainer = trainer_cls(model=model, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows["train"]), eval_dataset=Dataset.from_list(rows["eval"]),
                          peft_config=LoraConfig(task_type=spec.task_type, **run["lora"]),
                          callbacks=[counter, clock, *extra])
    counter.watch(trainer)  # DPO's reference forwards count, as in train_run
    metrics = dict(trainer.train().metrics)
    metrics.update(counter.summary(), cpu_s=clock.seconds)
    metrics.update(trainer.evaluate())
    metrics.update(activation_checkpointing=config.activation_checkpointing,
                   batching="packed" if job["arm"] in PACKED else "padded")
    return metrics


def snaketrl_choice(job: dict) -> dict:
    from snaketrl.data.lengths import histogram
    from snaketrl.train.run import train_run

    work = Path(job["work"])
    histogram(job["model_dir"], job["train"], job["settings"], work / "lengths.json", work / "lengths.png",
              job["run"]["name"])
    run = {**job["run"], "seed": job["seed"], "args": {**job["run"]["args"], **job["schedule"]}}
    clock = cpu_clock()
    metrics = train_run(run, model_dir=job["model_dir"], train_file=job["train"], eval_file=job["eval"],
                        lengths_file=work / "lengths.json", out_dir=work / "out", checkpoint_dir=work / "ckpt",
                        threads=job.get("threads"),
                        callbacks=[clock, *([profiler(job["profile"])] if job.get("profile") else [])])
    return {**metrics, "cpu_s": clock.seconds}


def worker(job_file: str) -> None:
    """One epoch of one (run, seed, arm); prints one JSON line."""
    import torch

    job = json.loads(Path(job_file).read_text())
    cuda = torch.cuda.is_available()
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    if job["arm"] == "snaketrl":
        from snaketrl.processes import keep_freed_memory

        keep_freed_memory()  # as every training-side job does (snaketrl.imports.start_job)
    metrics = (snaketrl_choice if job["arm"] == "snaketrl" else plain_trl)(job)
    from snaketrl.manifest import cpu_model

    device = torch.cuda.get_device_name() if cuda else f"{cpu_model()}, {torch.get_num_threads()} threads"
    device += f", torch {torch.__version__}"
    peak = peak_flops(device) if cuda else None
    print("RESULT " + json.dumps({
        "arm": job["arm"], "batching": metrics.get("batching"), "device": device,
        "checkpointing": bool(metrics.get("activation_checkpointing")),
        "efficiency": metrics["token_efficiency"], "tokens_per_s": metrics["real_tokens_per_second"],
        "warm_tokens_per_s": metrics.get("warm_real_tokens_per_second"), "epoch_s": metrics["train_runtime"],
        "cpu_s": metrics["cpu_s"], "eval_loss": metrics["eval_loss"],
        "train_loss": metrics.get("train_loss"), "real_tokens": metrics["real_tokens"],
        "peak_gib": (torch.cuda.max_memory_allocated() / 2 ** 30 if cuda
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20),  # KiB on Linux
        "flops": metrics["flops"], "train_s": metrics["train_seconds"],
        "mfu": metrics["flops"] / metrics["train_seconds"] / peak if peak and metrics["train_seconds"] else None}),
        flush=True)


def measure(job: dict) -> dict:
    result, stderr = run_worker(__file__, job)
    if result is None:
        out_of_memory = "OutOfMemoryError" in stderr
        print(f"{job['run']['name']} {job['arm']} seed {job['seed']} failed"
              f"{' (out of memory)' if out_of_memory else ''}:\n{stderr[-2000:]}", file=sys.stderr)
        return {"arm": job["arm"], "failed": "out of memory" if out_of_memory else "error"}
    return result


def table(name: str, results: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: each arm (best tokens/s of its seeds, mean of the rest), then ratios to TRL's defaults."""
    def best(arm, key, pick=max):
        values = [r[key] for r in results[arm] if r.get(key) is not None]
        return pick(values) if values else None

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    rows = []
    for arm, rs in results.items():
        if any("failed" in r for r in rs):
            rows.append(f"| {name} | {arm} | {rs[0].get('failed', next(r['failed'] for r in rs if 'failed' in r))} "
                        f"| | | | | | | | | |")
            continue
        r = rs[0]
        rows.append(f"| {name} | {arm} ({r['batching']}, checkpointing {'on' if r['checkpointing'] else 'off'}) | "
                    f"{fmt(best(arm, 'efficiency'), '.3f')} | {fmt(best(arm, 'tokens_per_s'), ',.0f')} | "
                    f"{fmt(best(arm, 'warm_tokens_per_s'), ',.0f')} | "
                    f"{fmt(best(arm, 'epoch_s', min), '.1f')} | {fmt(best(arm, 'cpu_s', min), '.1f')} | "
                    f"{fmt(best(arm, 'peak_gib'), '.1f')} | {fmt(best(arm, 'mfu'), '.1%')} | "
                    f"{spread([x['train_loss'] for x in rs if x.get('train_loss') is not None] or [float('nan')])} | "
                    f"{spread([x['eval_loss'] for x in rs])} |")
    base = results.get("trl")
    if base and not any("failed" in r for r in base):
        for arm, rs in results.items():
            if arm == "trl" or any("failed" in r for r in rs):
                continue
            # Per real token: the arms' rows are the same, their real tokens too unless packing cuts some off.
            cpu = (best("trl", "cpu_s", min) / best("trl", "real_tokens")) / (best(arm, "cpu_s", min) / best(arm, "real_tokens"))
            warm = (f"{best(arm, 'warm_tokens_per_s') / best('trl', 'warm_tokens_per_s'):.2f}×"
                    if best(arm, "warm_tokens_per_s") and best("trl", "warm_tokens_per_s") else "")
            rows.append(f"| {name} | **{arm} / trl** | | **{best(arm, 'tokens_per_s') / best('trl', 'tokens_per_s'):.2f}×** "
                        f"| {warm} "
                        f"| {best(arm, 'epoch_s', min) / best('trl', 'epoch_s', min):.2f}× | **{cpu:.2f}×** | | | | "
                        f"{loss_change([x['eval_loss'] for x in rs], [x['eval_loss'] for x in base])} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", type=Path, default=ROOT / "bench" / "gpu.yaml")
    ap.add_argument("--runs", nargs="*", help="run names (default: every SFT, DPO, reward, KTO and ORPO run)")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--seeds", nargs="*", type=int, default=[42])
    ap.add_argument("--max-steps", type=int, help="train this many steps instead of one epoch")
    ap.add_argument("--threads", type=int, help="torch threads of every arm (default: torch's, all cores)")
    ap.add_argument("--attention", help="attn_implementation of every arm's model (e.g. flex_attention; default: "
                                        "the config's, else transformers' sdpa)")
    ap.add_argument("--args", type=json.loads, default={},
                    help='TRL args set in every arm, as JSON (e.g. \'{"use_liger_kernel": true}\')')
    ap.add_argument("--profile", type=Path, help="a folder: each arm's steps 3-5 profiled into <run>-<arm>.txt (GPU)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/snaketrl-bench-gpu"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.worker:
        return worker(opts.worker)

    import contextlib
    import os

    from snaketrl.data.lengths import histogram
    from snaketrl.io import read_jsonl, write_jsonl
    from snaketrl.trainers import REGISTRY

    if opts.profile:
        opts.profile.mkdir(parents=True, exist_ok=True)
    configfile = opts.configfile.resolve()
    os.chdir(ROOT)  # config paths are relative to the project, as for Snakemake
    config, runs = load_config(configfile)
    names = opts.runs or [n for n, r in runs.items() if r["trainer"] in OFFLINE]
    out = ["| run | arm | token efficiency | real tokens/s | after step 1 | epoch (s) | CPU (s) | peak memory (GiB) "
           "| MFU | train loss | eval loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    device = None
    schedule = {**EPOCH, "max_steps": opts.max_steps} if opts.max_steps else EPOCH
    for name in names:
        run = runs[name]
        if opts.attention:
            run = {**run, "model_entry": {**run["model_entry"], "attn_implementation": opts.attention}}
        if opts.args:
            run = {**run, "args": {**run["args"], **opts.args}}
        model_dir = base_model(config, run["model"], opts.work)
        train, evals = prepared(config, run, opts.work)
        if run.get("eval_rows"):  # every arm evaluates on the rows train_run would
            evals = evals.with_name(f"eval-{run['eval_rows']}.jsonl")
            write_jsonl(read_jsonl(evals.with_name("eval.jsonl"))[:run["eval_rows"]], evals)
        settings = length_settings(config, run, "auto")
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the table
            stats = histogram(model_dir, train, settings, opts.work / f"{name}-lengths.json",
                              opts.work / f"{name}-lengths.png", name, model=run["model"],
                              dataset=run["dataset"])  # every arm trains at its max_length
        results = {}
        for arm in opts.arms:
            if arm in PACKED and "packed" not in REGISTRY[run["trainer"]].batching:
                continue
            for seed in opts.seeds:
                job = {"run": run, "arm": arm, "seed": seed, "settings": settings, "model_dir": str(model_dir),
                       "schedule": schedule, "threads": opts.threads,
                       "train": str(train), "eval": str(evals), "max_length": stats["max_length"],
                       "work": str(opts.work / "runs" / name / f"{arm}-{seed}"),
                       "profile": str(opts.profile / f"{name}-{arm}.txt") if opts.profile else None}
                result = measure(job)
                device = result.get("device", device)
                print(f"{name} {arm} seed {seed}: {result}", file=sys.stderr, flush=True)
                results.setdefault(arm, []).append(result)
        out += table(name, results)
    print(f"device: {device}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
