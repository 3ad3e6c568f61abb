"""A job keeps what it frees (snaketrl.processes.keep_freed_memory), but one whose trainer samples completions
gives it back (give_back_freed_memory, snaketrl.train.run): its blocks take a new size every step."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Steps of an online trainer's job in small: four blocks of 36-96 MB a step, each of a new size (completions and
# caches of other lengths), each followed by a small block that outlives it (what the step keeps). RSS after each.
STEPS = ("import json, random, sys, collections, psutil\n"
         "from snaketrl.imports import start_job\nstart_job()\n"
         "import torch\nfrom snaketrl.processes import give_back_freed_memory\n"
         "if sys.argv[1] == 'given back':\n    give_back_freed_memory()\n"
         "rng, kept, rss = random.Random(0), collections.deque(maxlen=16), []\n"
         "for step in range(20):\n"
         "    for _ in range(4):\n"
         "        big = torch.ones(rng.randint(9, 24) * 2 ** 20)\n"
         "        kept.append(torch.ones(2 ** 12))\n"
         "        del big\n"
         "    rss.append(psutil.Process().memory_info().rss)\n"
         "print(json.dumps(rss))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steps_of_new_sizes_grow_a_kept_heap_and_not_one_given_back():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "SNAKETRL_FORKSERVER": "0", "OMP_NUM_THREADS": "1"}
    env.pop("SNAKETRL_KEEP_FREED_MEMORY", None)
    growth = {}
    for name, mode, keep in (("kept", "kept", {}), ("given back", "given back", {}),
                             ("kept by the user's choice", "given back", {"SNAKETRL_KEEP_FREED_MEMORY": "1"})):
        proc = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, cwd=ROOT,
                              env={**env, **keep})
        assert proc.returncode == 0, proc.stderr[-2000:]
        rss = json.loads(proc.stdout)
        growth[name] = rss[-1] - rss[0]
    # Kept, the heap fragments: 630-690 MB more after 20 steps (two seeds); given back, nothing.
    assert growth["kept"] > 300e6 and growth["kept by the user's choice"] > 300e6, growth
    assert abs(growth["given back"]) < 20e6, growth
