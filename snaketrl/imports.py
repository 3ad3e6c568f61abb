"""What a training-side job imports, trimmed to what it can use, and what its imports cost the garbage collector."""

from __future__ import annotations

import atexit
import gc
import sys

from snaketrl import forkserver
from snaketrl.processes import keep_freed_memory


def skip_bitsandbytes_without_cuda() -> None:
    """bitsandbytes serves only QLoRA, which needs a CUDA GPU (snaketrl.train.args.check_hardware refuses it
    otherwise), yet peft and transformers import it wherever it is installed, and with it torch's compiler
    stack: about 3 s of CPU in every job (bench: `python -X importtime -c "import peft"`). Without a CUDA GPU
    they are told it is absent. Call before anything imports peft or transformers' integrations."""
    if "bitsandbytes" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        _absent("bitsandbytes")


def skip_deepspeed_inference_ops() -> None:
    """DeepSpeed on CPUs builds its shared-memory all-reduce whenever its communication starts: a C++ extension
    compiled on first use (about 110 s of a 2-core machine's CPU, once per machine and torch version) that only
    its inference_all_reduce calls. ZeRO training reduces through torch.distributed (gloo) either way. Marked
    incompatible, it is neither built nor loaded (inference_all_reduce would fall back to torch.distributed).
    Call before DeepSpeed's communication starts (before the training arguments are built)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def data_job() -> None:
    """First thing in a data-env job that loads tokenizers (the length and prompt jobs). envs/data.yaml has no
    torch, and these jobs need none; where one environment holds everything (README's set-up), transformers
    imports torch all the same: `from transformers import AutoTokenizer` and a tokenizer's load took 4.4 s of
    CPU with it, 1.8 s told it is absent, in each of the default's 12 such jobs. So it is told, as the data env
    tells it, and the collector pauses until exit (`pause_collector`)."""
    if "torch" not in sys.modules:
        _absent("torch")
    pause_collector()


def _absent(module: str) -> None:
    """Libraries then take `module` for not installed: importlib.util.find_spec answers None, `import` ImportError."""
    sys.modules[module] = None


def start_job() -> None:
    """First thing in every training-side process: where the workflow's fork server runs, hand the job to it
    (snaketrl.forkserver); else `skip_bitsandbytes_without_cuda`, then `pause_collector`, and start that server
    where this job is the first. Every job keeps the memory it frees for itself (`keep_freed_memory`)."""
    first = forkserver.hand_over()
    keep_freed_memory()
    skip_bitsandbytes_without_cuda()
    pause_collector()
    if first:
        forkserver.start(*first)


def pause_collector() -> None:
    """torch, transformers and TRL leave about a million objects that live as long as the process; Python's
    cyclic collector walks them all again and again while they are imported and once more at exit: about 3 s
    of CPU in a training job whose imports take 8 to 10 s (a tiny run's whole training takes about 5), 1 to 2 s
    in a length job while transformers imported torch there (`data_job`). So the collector pauses until
    `imports_done` (which the job calls once its libraries and model are loaded) and everything alive then is
    frozen: never collected again, at exit neither. Garbage made after that is collected as usual."""
    if not _paused:
        _paused.append(True)
        gc.disable()
        atexit.register(gc.freeze)  # registered first, so it runs last: the interpreter's final collections skip it all


def imports_done() -> None:
    """The job's libraries and model are loaded: freeze what lives now and collect from here on. Once per
    process, and only where `start_job` paused the collector (a test calling train_run twice changes nothing)."""
    if _paused == [True]:
        _paused.append(False)
        gc.freeze()
        gc.enable()


_paused: list[bool] = []  # [True]: start_job paused the collector; [True, False]: imports_done resumed it
