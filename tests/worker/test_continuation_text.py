"""A generation is the continuation of its prompt: the space its first token starts with is
kept (mlx-lm's streaming detokenizers drop it, gluing "plans" + " the" into "plansthe"),
and a first token without one gets none."""
from __future__ import annotations

from pathlib import Path

from p2pmesh.worker.model import load_tokenizer
from p2pmesh.worker.serve import ContinuationText

MODEL = Path(__file__).resolve().parents[2] / "scripts" / "demo_model"


def _stream(text: str, tokenizer) -> str:  # type: ignore[no-untyped-def]
    detok = tokenizer.detokenizer
    detok.reset()
    out = ContinuationText(detok, tokenizer)
    pieces = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(tok)
        pieces.append(out.segment(tok))
    detok.finalize()
    pieces.append(out.segment(None))
    return "".join(pieces)


def test_the_first_tokens_space_is_kept_and_nothing_else_changes() -> None:
    tokenizer = load_tokenizer(MODEL)
    assert _stream(" the model's layers over those Macs.", tokenizer) == " the model's layers over those Macs."
    assert _stream(": all nodes", tokenizer) == ": all nodes"
    assert _stream("plain start", tokenizer) == "plain start"
