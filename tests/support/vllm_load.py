"""Load a model with vLLM in this process and print, as JSON, a SHA-256 of every parameter
and a greedy completion: ``python -m tests.support.vllm_load MODEL LOAD_FORMAT [EXTRA_JSON]``.

A child process of the loader tests (vLLM's in-process engine holds global state a test
session must not share). vLLM's CPU linear layers replace their weights with repacked copies
after loading; they are kept here so the checksums cover every parameter as loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker here: apply_model
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
import vllm.model_executor.layers.utils as layer_utils
from vllm import LLM, SamplingParams

_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
layer_utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: _dispatch(
    layer, remove_weight=False
)


def checksums(model: torch.nn.Module) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            p.detach().contiguous().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, p in model.named_parameters()
    }


def main() -> None:
    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=2,
        block_size=32,
    )
    [sums] = llm.apply_model(checksums)
    out = llm.generate(["w5 w6 w7 w8"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    print(json.dumps({"sums": sums, "tokens": list(out[0].outputs[0].token_ids)}), flush=True)


if __name__ == "__main__":
    main()
