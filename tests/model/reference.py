"""Greedy continuations from Hugging Face transformers, and a tie-aware comparison against ours.

Where the reference's two best logits at a step are within TIE_MARGIN, either token is a correct greedy choice,
so a divergence there is a tie, not a bug; the comparison stops at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_MARGIN = 0.01


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # per generated step: logit[best] - logit[second]


@torch.inference_mode()
def hf_greedy(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    **processors: object,
) -> Reference:
    """`processors`: generate()'s logits-processor arguments (e.g. sequence_bias); the tie margins are then taken
    from the processed scores, which the choice was made on."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
        **processors,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for logits in out.scores if processors else out.logits:
        top = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top[0] - top[1]))
    return Reference(tokens, gaps)


def assert_greedy_match(ours: list[int], ref: Reference, label: str) -> None:
    for step, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a != b:
            if ref.top2_gaps[step] < TIE_MARGIN:
                return  # a tie in the reference: both continuations are correct greedy choices
            raise AssertionError(
                f"{label}: token {step} differs: ours {a}, transformers {b} (reference top-2 gap "
                f"{ref.top2_gaps[step]:.4f}); ours={ours} ref={ref.token_ids}"
            )
    assert len(ours) == len(ref.token_ids), f"{label}: lengths differ: ours={ours} ref={ref.token_ids}"
