"""A run's LoRA adapter merged into its base: one model directory (safetensors) that loads without peft.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from snaketrl.imports import imports_done
from snaketrl.io import atomic, write_json
from snaketrl.models.chat_template import RECORD_FILE
from snaketrl.models.gguf import SOURCE_FILE
from snaketrl.models.tokenizer import prepare_tokenizer
from snaketrl.trainers import MODEL_CLASSES

# What a merged directory was merged from: an eval job scoring with it as its reference finds there the job that
# scored with that base and adapter (snaketrl.evaluate.job).
MERGED_FROM = "merged_from.json"


def merge(adapter_dir, base_dir, out_dir, task_type: str = "CAUSAL_LM", threads: int | None = None,
          trust_remote_code: bool = False) -> None:
    """Base model + LoRA adapter -> one model directory (safetensors) that loads without peft (a model that
    ships its own code keeps it: save_pretrained copies it beside the weights)."""
    import torch
    import transformers
    from peft import PeftModel

    if threads:
        torch.set_num_threads(threads)

    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir, trust_remote_code=trust_remote_code)
    kwargs = {"num_labels": 1} if task_type == "SEQ_CLS" else {}
    base = getattr(transformers, MODEL_CLASSES[task_type]).from_pretrained(
        base_dir, trust_remote_code=trust_remote_code, **kwargs)
    imports_done()
    prepare_tokenizer(tokenizer, base)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic(out_dir, directory=True) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json({"model_dir": str(base_dir), "adapter_dir": str(adapter_dir)}, Path(tmp) / MERGED_FROM)
        # The runs that start from it record their base's source and chat template (and train its added tokens).
        for record in (SOURCE_FILE, RECORD_FILE):
            if (Path(base_dir) / record).is_file():
                shutil.copy2(Path(base_dir) / record, Path(tmp) / record)
