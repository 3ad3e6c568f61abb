"""The next token's draw in generation by the inverse CDF: one uniform a row through the cumulative probabilities.

transformers samples each decode step with `torch.multinomial(probs, num_samples=1)`, which on a CPU draws one
exponential per vocabulary entry (the exponential race: argmax of p / q, q ~ Exp(1)): at 16 rows of SmolLM2's
49,152 entries 15-17 ms a step, one thread, ~1 CPU-s of a GRPO step's 64 decode steps. The inverse CDF draws from
the same distribution with one uniform a row: the first entry whose cumulative probability exceeds u x the row's
total, in float64 (a float32 running sum over 49,152 entries rounds a small entry's share away), ~1 ms a step.
Under a seed it draws other tokens than multinomial does: the same distribution, not TRL's tokens.

`inverse_cdf` swaps torch's multinomial for it while generation runs: transformers looks it up on torch at each
step. Any other call (several samples, a generator or an out tensor, not 2-D) goes to torch's own. Applied by
snaketrl.train.run.build_trainer where the plan says (snaketrl.train.plan.samples_by_inverse_cdf).
"""

from __future__ import annotations

import contextlib
import functools

from snaketrl.train.generation import around_generation


def draw(probs):
    """One index a row of `probs` (rows x entries, non-negative, each row's sum positive and finite), drawn with
    probability entry / row sum, by the inverse CDF on the default generator. An entry of probability 0 is never
    drawn. Raises as torch.multinomial does on a row of inf, nan or no mass; a negative entry is not looked for (a
    softmax gives none) where multinomial's own check would read every entry once more."""
    import torch

    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if not bool(torch.all(torch.isfinite(total) & (total > 0))):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0, or a row sums to 0")
    # u < total strictly, so the first entry past it has probability > 0 (its cdf rises above its predecessor's)
    u = torch.minimum(torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)


@contextlib.contextmanager
def inverse_cdf():
    """torch.multinomial draws one sample a row by `draw` within; torch's own outside and for any other call."""
    import torch

    multinomial = torch.multinomial

    @functools.wraps(multinomial)
    def sample(input, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or generator is not None or out is not None or input.dim() != 2:
            return multinomial(input, num_samples, replacement, generator=generator, out=out)
        return draw(input)

    torch.multinomial = sample
    try:
        yield
    finally:
        torch.multinomial = multinomial


def sample_by_inverse_cdf(trainer, trainer_name: str) -> None:
    """Patch a built GRPO, RLOO or online DPO trainer: its generation draws each token by `draw`."""
    around_generation(trainer, trainer_name, inverse_cdf)
