"""What a training-side job imports, trimmed to what it can use, and what its imports cost the garbage collector."""

from __future__ import annotations

import atexit
import gc
import sys


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
    """First thing in every training-side process: `skip_bitsandbytes_without_cuda`, then `pause_collector`."""
    skip_bitsandbytes_without_cuda()
    pause_collector()


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
