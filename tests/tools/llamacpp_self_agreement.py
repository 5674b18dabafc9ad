#!/usr/bin/env python3
"""How often llama.cpp agrees with itself on the real Gemma 3 270M: the noise floor under the
teacher-forced top-1 agreement tests/model/test_gemma3_270m.py measures for Pantheon. Run by hand:

    .venv/bin/python tests/tools/llamacpp_self_agreement.py --llama-server /var/tmp/llama-server/build/bin/llama-server [--config f32]

tests/data/llamacpp/gemma3_270m.json holds llama.cpp's top-1 at every step of sequences it sampled,
each step a one-token decode (its flash attention's single-row path: the query rounded to f16 and
the values summed in an f16 accumulator; matrix-vector kernels). Here the same llama-server sees
each step's whole prefix again as one prompt (`cache_prompt` off): a prefix of 64 tokens or more
goes through its tiled f32 attention and its matrix-matrix kernels — the same model and weights,
other (equally valid) arithmetic. The share of steps whose top-1 stays the same is how closely
llama.cpp reproduces its own recording when only the order and precision of its sums change."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.tools.make_gemma3_refs import CONFIGS, gemma_server  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--config", choices=CONFIGS, default="default", help="which recording (make_gemma3_refs.py)")
    args = ap.parse_args(argv)
    extra, ref_path = CONFIGS[args.config]
    ref = json.loads(ref_path.read_text())
    same = total = long_same = long_total = 0
    missed = []
    with gemma_server(args.llama_server, extra) as url:  # the recording's server, as it recorded
        for seq in ref["sequences"]:
            ids = seq["prompt"] + seq["sampled"]
            for i, (top1, margin) in enumerate(zip(seq["top1"], seq["margin"])):
                prefix = ids[:len(seq["prompt"]) + i]
                r = httpx.post(url + "/completion", timeout=300, json={
                    "prompt": prefix, "n_predict": 1, "temperature": 0, "n_probs": 2, "post_sampling_probs": False,
                    "cache_prompt": False}).json()
                mine = r["completion_probabilities"][0]["top_logprobs"][0]["id"]
                total += 1
                same += int(mine == top1)
                if len(prefix) >= 64:
                    long_total += 1
                    long_same += int(mine == top1)
                if mine != top1:
                    missed.append(margin)
        print(f"llama.cpp re-reading its own sequences as prompts: top-1 equal on {same}/{total} steps "
              f"({100 * same / total:.2f} %); prefixes of >= 64 tokens {long_same}/{long_total}; "
              f"recorded margins where it differs: {sorted(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
