"""A delegated partition's id check (``partition/id_bounds.py``): ids computed from the inputs'
shapes alone (a token model's positions) are checked once per input signature, ids the caller's
values reach at every call, so caching the first never lets a bad id of the second through."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.partition.compiled import input_signature
from qplug_core.partition.id_bounds import IdBounds


class _Tokens(nn.Module):
    """Word ids handed on as given (``handed_on``: cast first, so a graph reads them) and positions
    from the length, as the zoo's BERT encoder."""

    def __init__(self, cast: bool) -> None:
        super().__init__()
        self.words, self.positions, self.cast = nn.Embedding(10, 4), nn.Embedding(4, 4), cast

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        words = self.words(ids.long() if self.cast else ids)
        return words + self.positions(torch.arange(ids.size(1), device=ids.device))


def _check(bounds: IdBounds, ids: torch.Tensor) -> None:
    bounds.check((ids,), input_signature((ids,)))


@pytest.mark.parametrize("cast", [False, True])
def test_bad_ids_are_refused_at_every_call_of_a_shape_already_checked(cast):
    bounds = IdBounds.of(fx.symbolic_trace(_Tokens(cast)))
    good = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(2):
        _check(bounds, good)
        with pytest.raises(InputMismatchError, match=r"input 'ids' holds ids from 1 to 10, but the table "
                                                     r"'words' it indexes has 10 rows"):
            _check(bounds, good + torch.tensor([[0, 0, 0], [0, 0, 4]]))


def test_an_input_too_long_is_refused_at_every_call_and_the_lengths_that_fit_are_not():
    bounds = IdBounds.of(fx.symbolic_trace(_Tokens(cast=False)))
    long = torch.zeros(1, 6, dtype=torch.long)
    for _ in range(2):
        with pytest.raises(InputMismatchError, match=r"input 'ids' is too long for the table 'positions': .* "
                                                     r"run from 0 to 5, and the table has 4 rows"):
            _check(bounds, long)
        _check(bounds, long[:, :4])
        _check(bounds, long[:, :1])
