"""Speculative decoding with the model's own draft layers: one step verifies the drafts of the
last one and drafts the next, inside the step graph. The family's `Drafter` drafts: the MTP layer
(`mtp_drafts`, steps 3 and 4 below) or another of the family's own (DeepSeek-V4.1's DSpark stages
draft a block of tokens in one pass after the last accepted position) in place of steps 3 and 4.

Each row of a step holds its tokens as usual, and a row that decodes holds after its last token
the k (or fewer) tokens the MTP layer drafted in the row's previous step: [t, d_0 .. d_{m-1}],
`logits_index` pointing at t. The step
1. runs the main model over every token (writing their KV) and takes the logits at t and at each
   draft: the model's prediction of d_0 .. d_{m-1} and of the token after them;
2. accepts a prefix of the drafts and picks the next token (`graphc::verify_drafts`: greedy, or
   the speculative-sampling rule, so tokens are distributed as without drafts);
3. runs the MTP layer over every position i with its input token i + 1: the step's own next token
   up to the last accepted position, whose next token is the one just picked. Its KV so holds,
   at every position the row keeps, what the MTP layer would have written one token at a time;
   positions past the last accepted one hold a rejected guess and are written again when the
   row reaches them (the host rolls the row back by not counting them);
4. drafts k tokens from the last accepted position: the MTP layer's prediction there, then k - 1
   more from its own output one position further each (writing its KV at those positions, which
   the next step overwrites).
Rows without drafts (prompt chunks, prompt-as-decode rows) run the same way with none to verify:
their MTP KV is filled and their first drafts made. The last position of a prompt chunk that is
not the prompt's last has no next token yet: the host runs it again as the first of the next
chunk (`Scheduler`), so its MTP KV is written once the token is known.

Every rank computes the verdict (the sampler's noise is drawn from the step's seeds, so it is the
same everywhere): the MTP layer's input on every rank depends on it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from graphc.models.drafter import Drafter
from graphc.models.step_model import StepInputs, StepModel
from graphc.ops import sampler
from graphc.step import ELSEWHERE_SLOT, PADDING_SLOT


class SpeculativeStep(nn.Module):
    """`model` (its parameters under `model.`) taking one speculative step of `draft_tokens` = k
    drafts per row, drafted by its family's `drafter`."""

    def __init__(self, model: StepModel, draft_tokens: int, drafter: Drafter):
        super().__init__()
        self.model, self.draft_tokens, self.drafter = model, draft_tokens, drafter

    def forward(self, input_ids: Tensor, step: StepInputs, logits_index: Tensor, temperature: Tensor,
                top_k: Tensor, top_p: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
        """Returns [B, 2 + 2k] int64: the accepted count n, tokens t_0 .. t_k (t_0 .. t_n are the
        row's new tokens), then the k drafts for its next step; and the logits at `logits_index` [B, V]."""
        return speculative_step(self.model, self.drafter, self.draft_tokens, input_ids, step, logits_index,
                                temperature, top_k, top_p, seed)


def speculative_step(model: StepModel, drafter: Drafter, k: int, input_ids: Tensor, step: StepInputs,
                     logits_index: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                     seed: Tensor) -> tuple[Tensor, Tensor]:
    """`SpeculativeStep.forward`: the numbered steps of the module docstring."""
    width = input_ids.shape[1]
    hidden = model.final_hidden(input_ids, step)  # [B, W, D]
    offsets = torch.arange(k + 1, device=input_ids.device)
    verified = (logits_index[:, None] + offsets).clamp(max=width - 1)  # [B, 1 + k]
    logits = model.logits(_take(hidden, verified))  # [B, 1 + k, V]
    last_real = ((step.slot_mapping != PADDING_SLOT) * torch.arange(width, device=input_ids.device)).amax(dim=1)
    draft_count = (last_real - logits_index).clamp(0, k)  # [B]
    drafts = input_ids.gather(1, (logits_index[:, None] + 1 + offsets[:k]).clamp(max=width - 1))  # [B, k]
    verdict = sampler.verify_drafts(logits, drafts, draft_count, temperature, top_k, top_p, seed)  # [B, 2 + k]
    accepted = verdict[:, :1]  # [B, 1]
    picked = verdict[:, 1:].gather(1, accepted)  # [B, 1]: the token after the last accepted one

    kept_until = logits_index[:, None] + accepted  # [B, 1]: the last accepted position's index
    new_drafts = drafter.draft(model, k, hidden, input_ids, step, kept_until, picked)  # [B, k]
    return torch.cat([verdict, new_drafts], dim=1), logits[:, 0]


def mtp_drafter(layer) -> Drafter:
    """The MTP drafter of a family whose draft layer's args `layer` gives (`Drafter.layer`)."""
    return Drafter("mtp", mtp_drafts, layer)


def mtp_drafts(model: StepModel, k: int, hidden: Tensor, input_ids: Tensor, step: StepInputs, kept_until: Tensor,
               picked: Tensor) -> Tensor:
    """Steps 3 and 4 of the module docstring: the MTP layer's k drafts [B, k] after each row's
    last accepted position `kept_until` [B, 1], whose next token is `picked` [B, 1]."""
    width = input_ids.shape[1]
    following = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)  # token i + 1 at i
    index = torch.arange(width, device=input_ids.device)[None, :]
    next_ids = torch.where(index < kept_until, following, picked)  # [B, W]
    drafted = _take(model.draft_hidden(hidden, next_ids, step), kept_until)  # [B, 1, D]
    live = (step.slot_mapping != PADDING_SLOT).any(dim=1, keepdim=True)  # [B, 1]: rows with tokens
    position = step.positions.gather(1, kept_until)  # [B, 1]
    draft = model.draft_logits(drafted).argmax(dim=-1)  # [B, 1]
    new_drafts = [draft]
    for _ in range(k - 1):  # further ahead: the MTP layer on its own output, one position on
        position = position + 1
        ahead = StepInputs(position, step.block_table, _slots(step, position, live), step.kv_pool, step.parallel,
                           step.moe_form)
        drafted = model.draft_hidden(drafted, draft, ahead)
        draft = model.draft_logits(drafted).argmax(dim=-1)
        new_drafts.append(draft)
    return torch.cat(new_drafts, dim=1)


def _take(values: Tensor, index: Tensor) -> Tensor:
    """values [B, W, D] at index [B, N] -> [B, N, D]."""
    return values.gather(1, index[:, :, None].expand(-1, -1, values.shape[-1]))


def _slots(step: StepInputs, position: Tensor, live: Tensor) -> Tensor:
    """The pool slots of `position` [B, 1] as the host's `SequenceBlocks.slot` gives them, from
    the block table: this rank's KV shard holds logical block j where j % cp is its cp rank, at
    table column j // cp. Rows without tokens (`live` False) and positions past a sequence's
    blocks (the table's width counts every shard's) write nothing."""
    block_size = step.kv_pool.shape[2]
    cp, shard = step.parallel.cp, step.parallel.kv_shard()
    logical = position // block_size
    column = logical // cp
    inside = logical < step.block_table.shape[1]
    block = step.block_table.gather(1, column.clamp(max=step.block_table.shape[1] - 1))
    slot = torch.where(logical % cp == shard, block * block_size + position % block_size, ELSEWHERE_SLOT)
    return torch.where(inside & live, slot, PADDING_SLOT)
