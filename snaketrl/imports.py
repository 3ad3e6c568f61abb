"""What a training-side job imports, trimmed to what it can use."""

from __future__ import annotations

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
        sys.modules["bitsandbytes"] = None  # importlib.util.find_spec then answers None, `import` ImportError
