"""TRL's default batching against the batching the length stage chooses, measured.

For every run of a config whose trainer can batch otherwise (SFT, DPO, reward, ORPO) and every seed: one
epoch with TRL's default batching (`padded`: random batches padded to their longest) and one with the
strategy `length.batching: auto` chooses, on the same tiny model (built and pretrained as the workflow
does), the same examples and the same max_length, each in a process of its own. Prints token efficiency
(real / processed tokens, counted during training), real tokens per second of training steps, wall time
of the epoch (both the best of the seeds: other load on the machine only slows a run down), peak RSS,
the final eval loss (mean ± standard deviation over seeds), and the ratios chosen / default; the eval
loss's change against the default comes with its standard error over seeds and whether seed noise explains it.

    python bench/efficiency.py                                  # the default config's samples
    python bench/efficiency.py --configfile bench/public_data.yaml --seeds 1 2
    python bench/efficiency.py --strategies padded auto packed  # also SFT packing

Duplicate examples (the human TL;DRs repeat each post once per model sample) are kept once.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# One epoch, evaluated once at its end; no checkpoints (their writes are not batching's cost).
EPOCH = {"num_train_epochs": 1, "max_steps": -1, "eval_strategy": "no", "save_strategy": "no",
         "logging_steps": 10}


def load_config(path: Path) -> tuple[dict, dict]:
    import yaml

    from snaketrl.config import resolve_runs, validate

    config = yaml.safe_load(path.read_text())
    validate(config, str(ROOT / "config" / "schema.yaml"))
    return config, resolve_runs(config, shipped)


def corpus_file(config: dict, item: str, work: Path) -> str:
    """A tiny model's corpus entry as a file: one naming a dataset of the config stands for its train split
    as fetched (snaketrl.config.corpus_files; the workflow's get_dataset writes it), here under `work`."""
    from snaketrl import paths
    from snaketrl.data.fetch import fetch
    from snaketrl.io import write_jsonl

    if item not in config["datasets"]:
        return paths.from_config(item, shipped)
    path = work / "corpus" / f"{item}.jsonl"
    if not path.is_file():
        write_jsonl(fetch(item, fetchable(config["datasets"][item]), config["seed"]).train, path)
    return str(path)


def shipped(rel: str) -> str:
    """A file shipped with the workflow (a config's `workflow:<path>`): the Snakefile's `shipped`, for this clone."""
    return str(ROOT / rel)


def fetchable(entry: dict) -> dict:
    """A dataset entry with its local files as get_dataset reads them (`workflow:` ones resolved)."""
    from snaketrl.config import local_files

    return {**entry, "files": local_files(entry, shipped)} if "files" in entry else entry


def base_model(config: dict, name: str, work: Path) -> Path:
    """The run's base, once per work dir: a tiny model built and pretrained from its config entry, or a hub or
    gguf model as the download_model job makes it."""
    import contextlib

    from snaketrl.config import gguf_file
    from snaketrl.models.download import download
    from snaketrl.models.pretrain import pretrain_model
    from snaketrl.models.tiny import build_tiny_from_files

    entry = config["models"][name]
    init, out = work / "models" / f"{name}-init", work / "models" / name
    if "tiny" not in entry:
        if not out.is_dir():
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the table
                download(name, entry, out, gguf_file(entry, shipped).get("gguf"))
        return out
    tiny = entry["tiny"]
    if not out.is_dir():
        import torch

        # One thread, as the workflow's pretrain job, except on a GPU machine: there the base of bench/gpu.yaml's
        # 0.5B shape took 69 s on one of 16 cores, device time spent on nothing the bench compares.
        threads = None if torch.cuda.is_available() else 1
        corpus = [corpus_file(config, item, work) for item in tiny["corpus"]]
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the table
            build_tiny_from_files(tiny, corpus, init, seed=config["seed"], threads=threads)
            pretrain_model(init, corpus, out, work / "models" / f"{name}-state.json",
                           work / "models" / f"{name}-metrics.json", {**tiny["pretrain"], "seed": config["seed"]},
                           threads=threads)
    return out


def prepared(config: dict, run: dict, work: Path, unique: bool = True) -> tuple[Path, Path]:
    """The run's train and eval rows as its trainer reads them (snaketrl.data: fetch, then preprocess), each
    distinct row once unless not `unique` (as the workflow: PPO's prompts, 5 distinct in the descriptiveness
    sample's 400 pairs, each as often as its pairs)."""
    from snaketrl.data.fetch import fetch
    from snaketrl.data.preprocess import preprocess
    from snaketrl.io import write_jsonl
    from snaketrl.trainers import REGISTRY

    out = work / "data" / run["dataset"] / (run["trainer"] if unique else f"{run['trainer']}-all")
    if not (out / "eval.jsonl").is_file():
        entry = run["dataset_entry"]
        got = fetch(run["dataset"], fetchable(entry), config["seed"])
        for split, rows in (("train", got.train), ("eval", got.eval)):
            rows = preprocess(rows, dataset=run["dataset"], trainer=run["trainer"],
                              layout=REGISTRY[run["trainer"]].layout, columns=entry["columns"], split=split,
                              format=entry["format"], bad_rows=entry["bad_rows"]).rows
            if unique:
                rows = list({json.dumps(r, sort_keys=True): r for r in rows}.values())
            write_jsonl(rows, out / f"{split}.jsonl")
    return out / "train.jsonl", out / "eval.jsonl"


def length_settings(config: dict, run: dict, batching: str) -> dict:
    """The length stage's settings for a run (snaketrl.config.length_settings, as the workflow's length job gets
    them), `batching` asked, with the run's own attention (a bench may set another)."""
    from snaketrl.config import canonical
    from snaketrl.config import length_settings as settings

    return canonical({**settings(config, run["trainer"], run["dataset"], run["model"],
                                 run["args"].get("per_device_train_batch_size", 8), batching),
                      "attn_implementation": run["model_entry"].get("attn_implementation")})


def cpu_clock():
    """A callback timing the training loop in CPU seconds of this process: with one torch thread, other load
    on a shared machine barely changes it, while it stretches wall time."""
    import time

    from transformers import TrainerCallback

    class CpuClock(TrainerCallback):
        seconds = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.process_time()

        def on_train_end(self, args, state, control, **kwargs):
            self.seconds = time.process_time() - self.started

    return CpuClock()


def worker(job_file: str) -> None:
    """One epoch of one (run, seed, strategy): length stage, then training; prints one JSON line."""
    from snaketrl.data.lengths import histogram
    from snaketrl.train.run import train_run

    job = json.loads(Path(job_file).read_text())
    work = Path(job["work"])
    stats = histogram(job["model_dir"], job["train"], job["settings"], work / "lengths.json", work / "lengths.png",
                      job["run"]["name"])
    run = {**job["run"], "seed": job["seed"], "args": {**job["run"]["args"], **EPOCH}}
    clock = cpu_clock()
    metrics = train_run(run, model_dir=job["model_dir"], train_file=job["train"], eval_file=job["eval"],
                        lengths_file=work / "lengths.json", out_dir=work / "out", checkpoint_dir=work / "ckpt",
                        threads=job["threads"], callbacks=[clock])
    print("RESULT " + json.dumps({
        "strategy": stats["batching"]["strategy"], "expected": stats["batching"]["expected_efficiency"],
        "max_length": stats["max_length"], "examples": stats["n_examples"],
        "efficiency": metrics["token_efficiency"], "tokens_per_s": metrics["real_tokens_per_second"],
        "epoch_s": metrics["train_runtime"], "epoch_cpu_s": clock.seconds,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "eval_loss": metrics["eval_loss"],
        "steps": json.loads((work / "out" / "trainer_state.json").read_text())["global_step"]}), flush=True)


def run_worker(script: str, job: dict) -> tuple[dict | None, str]:
    """`script --worker` on `job` in a process of its own (written into the job's work dir): the JSON of its
    last RESULT line, None where it failed, and its stderr."""
    Path(job["work"]).mkdir(parents=True, exist_ok=True)
    job_file = Path(job["work"]) / "job.json"
    job_file.write_text(json.dumps(job, default=str))
    proc = subprocess.run([sys.executable, script, "--worker", str(job_file)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return None, proc.stderr
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


def measure(job: dict) -> dict:
    result, stderr = run_worker(__file__, job)
    if result is None:
        sys.exit(f"{job['run']['name']} ({job['settings']['batching']}, seed {job['seed']}) failed:\n"
                 f"{stderr[-3000:]}")
    return result


def spread(values: list[float]) -> str:
    """Mean ± the seeds' standard deviation."""
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def loss_change(loss: list[float], base: list[float]) -> str:
    """The change of the mean eval loss against TRL's default, and whether seed noise explains it: the
    standard error of a difference of two means carries both arms' seed variance (Welch). Worse than
    seed noise means higher by more than two standard errors."""
    change = statistics.fmean(loss) - statistics.fmean(base)
    if min(len(loss), len(base)) < 2:
        return f"{change:+.3f}"
    se = (statistics.variance(loss) / len(loss) + statistics.variance(base) / len(base)) ** 0.5
    # A change below the table's precision is none, whatever the seeds (a reward model at loss 0.000).
    verdict = "worse than seed noise" if change > max(2 * se, 0.0005) else "within seed noise"
    return f"{change:+.3f} (SE {se:.3f}: {verdict})"


def report(name: str, results: dict[str, list[dict]]) -> list[str]:
    """Markdown rows of one run: each strategy, then the ratios of each non-default one to TRL's default."""
    def mean(strategy, key):
        values = [r[key] for r in results[strategy]]
        best = {"tokens_per_s": max, "epoch_s": min, "epoch_cpu_s": min, "rss_mb": max}.get(key)
        return best(values) if best else statistics.fmean(values)

    rows = []
    for requested, rs in results.items():
        r = rs[0]
        rows.append(f"| {name} | {r['strategy']}{' (auto)' if requested == 'auto' else ''} | {r['examples']} | "
                    f"{r['max_length']} | {r['expected']:.3f} | {mean(requested, 'efficiency'):.3f} | "
                    f"{mean(requested, 'tokens_per_s'):.0f} | {mean(requested, 'epoch_s'):.1f} | "
                    f"{mean(requested, 'epoch_cpu_s'):.1f} | "
                    f"{mean(requested, 'rss_mb'):.0f} | {spread([x['eval_loss'] for x in rs])} |")
    base = "padded"
    for requested in results if base in results else ():  # ratios need TRL's default beside
        if requested == base or results[requested][0]["strategy"] == base:
            continue
        loss = [x["eval_loss"] for x in results[requested]]
        noise = [x["eval_loss"] for x in results[base]]
        rows.append(f"| {name} | **ratio {results[requested][0]['strategy']} / padded** | | | | "
                    f"{mean(requested, 'efficiency') / mean(base, 'efficiency'):.2f}× | "
                    f"{mean(requested, 'tokens_per_s') / mean(base, 'tokens_per_s'):.2f}× | "
                    f"{mean(requested, 'epoch_s') / mean(base, 'epoch_s'):.2f}× | "
                    f"{mean(requested, 'epoch_cpu_s') / mean(base, 'epoch_cpu_s'):.2f}× | "
                    f"{mean(requested, 'rss_mb') / mean(base, 'rss_mb'):.2f}× | "
                    f"{loss_change(loss, noise)} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", type=Path, default=ROOT / "config" / "config.yaml")
    ap.add_argument("--runs", nargs="*", help="run names (default: every run whose trainer can batch otherwise)")
    ap.add_argument("--strategies", nargs="*", default=["padded", "auto"],
                    help="length.batching values to measure (padded is TRL's default)")
    ap.add_argument("--seeds", nargs="*", type=int, default=[42])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    ap.add_argument("--work", type=Path, default=Path("/tmp/snaketrl-bench-efficiency"),
                    help="models, data and runs (reused across invocations)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.worker:
        return worker(opts.worker)

    import os

    from snaketrl.trainers import REGISTRY

    configfile = opts.configfile.resolve()
    os.chdir(ROOT)  # config paths are relative to the project, as for Snakemake
    config, runs = load_config(configfile)
    names = opts.runs or [n for n, r in runs.items() if len(REGISTRY[r["trainer"]].batching) > 1]
    table = ["| run | batching | examples | max_length | expected efficiency | token efficiency | real tokens/s | "
             "epoch (s) | epoch CPU (s) | peak RSS (MB) | eval loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        run = runs[name]
        model_dir = base_model(config, run["model"], opts.work)
        train, evals = prepared(config, run, opts.work)
        results = {}
        for strategy in opts.strategies:
            if strategy not in ("auto", *REGISTRY[run["trainer"]].batching):
                continue
            for seed in opts.seeds:
                job = {"run": run, "seed": seed, "settings": length_settings(config, run, strategy),
                       "model_dir": str(model_dir),
                       "train": str(train), "eval": str(evals), "threads": opts.threads,
                       "work": str(opts.work / "runs" / name / f"{strategy}-seed{seed}")}
                result = measure(job)
                print(f"{name} {strategy} seed {seed}: {result}", file=sys.stderr, flush=True)
                results.setdefault(strategy, []).append(result)
        table += report(name, results)
    print("\n".join(table))


if __name__ == "__main__":
    main()
