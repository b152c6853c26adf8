"""A backend in ``fast`` numerics against the cpu oracle on real weights, teacher-forced: the
first ``--tokens`` tokens of a text in one prefill on each, then per position whether the two
agree on the most likely next token (top-1, ties counted as agreement when the oracle's own
top is among the candidate's maxima), the NLL of the text's next token on each, and the
perplexity over all positions. Prints one JSON line.

    python benchmarks/fast_agreement.py MODEL.gguf [--text FILE] [--tokens 512]
        [--backend triton] [--numerics fast]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

import parity

TEXT = Path(__file__).parent / "data" / "alice_ch1-5.txt"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--numerics", default="fast")
    args = ap.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    logits = {}
    for side, name, numerics in (
        ("oracle", "cpu", "exact"),
        ("candidate", args.backend, args.numerics),
    ):
        model = parity.load(args.model, backend=name, numerics=numerics, strict=True,
                            n_ctx=args.tokens)  # fmt: skip
        ids = model.tokenize(text)[: args.tokens]
        logits[side] = model.logits(ids)
        model.close()
    ref, cand = logits["oracle"], logits["candidate"]
    top_ref = ref.argmax(axis=1)
    agree = cand[np.arange(len(ids)), top_ref] == cand.max(axis=1)
    nxt = np.asarray(ids[1:])
    nll = {k: -log_softmax(v[:-1])[np.arange(len(nxt)), nxt] for k, v in logits.items()}
    ppl = {k: math.exp(float(v.mean())) for k, v in nll.items()}
    print(json.dumps({
        "model": Path(args.model).name, "backend": args.backend, "numerics": args.numerics,
        "tokens": len(ids), "top1_agreement": round(float(agree.mean()), 5),
        "top1_agree": int(agree.sum()),
        "ppl_oracle": round(ppl["oracle"], 5), "ppl_candidate": round(ppl["candidate"], 5),
        "ppl_rel_diff": round(ppl["candidate"] / ppl["oracle"] - 1, 7),
        "max_abs_logit_diff": float(np.abs(cand - ref).max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
