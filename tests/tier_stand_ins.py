"""The decode pair kernels stood in for by a loop over the pairs, for the expert tiers' tests on a CPU."""

from __future__ import annotations

import torch


def stand_in_pairs(lean, one_token_unless_in_place: bool = False):
    """`ExpertTiers`' pairs(weights, x_TD, entry_TK, weights_TK, kind): each pair's expert (its entry in `weights`,
    -1: none) on its token by `lean` (a `HostExperts`), weighted and summed per token in float32.
    one_token_unless_in_place: like the kernels (`kernels.paths.decode_applies`), None for more than one token
    unless kind is "in place"."""

    def pairs(weights, x_TD, entry_TK, weights_TK, kind="sorted"):
        if one_token_unless_in_place and x_TD.shape[0] > 1 and kind != "in place":
            return None
        y = torch.zeros(x_TD.shape, dtype=torch.float32)
        for t in range(x_TD.shape[0]):
            for k, e in enumerate(entry_TK[t].tolist()):
                if e >= 0:
                    y[t] += weights_TK[t, k] * lean.slot(weights, e, x_TD[t:t + 1])[0]
        return y

    return pairs
