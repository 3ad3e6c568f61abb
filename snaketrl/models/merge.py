"""A run's LoRA adapter merged into its base: one model directory (safetensors) that loads without peft.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from snaketrl.imports import imports_done
from snaketrl.io import atomic
from snaketrl.models.gguf import SOURCE_FILE
from snaketrl.models.tokenizer import prepare_tokenizer
from snaketrl.trainers import MODEL_CLASSES


def merge(adapter_dir, base_dir, out_dir, task_type: str = "CAUSAL_LM", threads: int | None = None) -> None:
    """Base model + LoRA adapter -> one model directory (safetensors) that loads without peft."""
    import torch
    import transformers
    from peft import PeftModel

    if threads:
        torch.set_num_threads(threads)

    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    kwargs = {"num_labels": 1} if task_type == "SEQ_CLS" else {}
    base = getattr(transformers, MODEL_CLASSES[task_type]).from_pretrained(base_dir, **kwargs)
    imports_done()
    prepare_tokenizer(tokenizer, base)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic(out_dir, directory=True) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (Path(base_dir) / SOURCE_FILE).is_file():  # the runs that start from it record their base's source
            shutil.copy2(Path(base_dir) / SOURCE_FILE, Path(tmp) / SOURCE_FILE)
