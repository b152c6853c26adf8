"""Who is closer to the model: parity's oracle or llama.cpp? Both against a float64 forward pass
of the same quantized weights (``parity.arch.reference``: float64 activations, exact softmax,
tanh GELU), on the chunks llama.cpp scored.

``llama-perplexity --kl-divergence-base FILE`` saves llama.cpp's log-probabilities; this runs
the same chunks (first token BOS) through parity's cpu backend and the float64 reference and
prints, per pair, the teacher-forced top-1 agreement and the mean KL divergence from the
reference (over the reference's tokens with log p > -16, as llama.cpp sums it).

    python benchmarks/agreement_float64.py MODEL BASE.kld [--chunks N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import parity
from parity.arch.reference import reference_forward
from parity.measure.agreement import log_softmax, read_base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("base")
    ap.add_argument("--chunks", type=int)
    args = ap.parse_args()
    base = read_base(args.base)
    model = parity.load(args.model, backend="cpu", n_ctx=base.n_ctx)
    spec, weights = model.spec, model.file.weights
    first = base.first
    n_chunks = base.n_chunk if args.chunks is None else min(args.chunks, base.n_chunk)
    pairs = ("parity-ref", "llama.cpp-ref", "parity-llama.cpp")
    same = dict.fromkeys(pairs, 0)
    kld = {"parity": 0.0, "llama.cpp": 0.0}
    scored = 0
    for c in range(n_chunks):
        t0 = time.perf_counter()
        chunk = np.array(base.tokens[c])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        ref = log_softmax(reference_forward(spec, weights, chunk)[first:-1])
        ours = log_softmax(model.logits(chunk, n_out=base.n_ctx - first)[:-1])
        theirs = base.log_probs(c)
        tops = {"ref": ref.argmax(1), "parity": ours.argmax(1), "llama.cpp": theirs.argmax(1)}
        for pair in pairs:
            a, b = pair.split("-", 1)
            same[pair] += int((tops[a] == tops[b]).sum())
        seen = ref > -16.0
        for name, lp in (("parity", ours), ("llama.cpp", theirs)):
            kld[name] += float(np.where(seen, np.exp(ref) * (ref - lp), 0.0).sum())
        scored += len(ref)
        print(f"chunk {c + 1}/{n_chunks}: {time.perf_counter() - t0:.1f} s", flush=True)
    for pair in pairs:
        print(f"top-1 {pair}: {100 * same[pair] / scored:.2f} % ({same[pair]}/{scored})")
    for name, total in kld.items():
        print(f"mean KL divergence ref || {name}: {total / scored:.6f}")


if __name__ == "__main__":
    main()
